//! A smoke run of `gpuctl bench membership` at a small size, so the benchmark never rots: a
//! state built, backed up, restored into three real replicas, saved again, and a fourth
//! replica added; the JSON must show the learner installed the state before it became a voter.

mod common;
use common::bench_json;

#[test]
fn membership_adds_a_replica_to_a_restored_cluster() {
    let j = bench_json(&["membership", "--jobs", "2000", "--hosts", "50"]);
    assert_eq!(j["benchmark"], "membership");
    let c = &j["cases"][0];
    assert_eq!(c["jobs"], 2000, "{c}");
    assert!(c["error"].is_null(), "{c}");
    assert_eq!(c["add"]["ok"], true, "{c}");
    assert!(c["snapshot_bytes"].as_u64().unwrap() > 100_000, "{c}");
    assert!(c["save"]["file_bytes"].as_u64().unwrap() > 100_000, "{c}");
    let installed = c["add"]["installed_s"].as_f64().unwrap();
    let promoted = c["add"]["promoted_s"].as_f64().unwrap();
    assert!(promoted >= installed, "{c}");
    assert_eq!(c["promoted_after_install"], true, "{c}");
    assert!(c["probe"]["writes"].as_u64().unwrap() > 0, "{c}");
}
