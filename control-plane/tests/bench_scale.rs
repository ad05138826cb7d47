//! A smoke run of `gpuctl bench scale` at two small sizes, so the benchmark never rots: for
//! each, a full fleet and a pending queue built through the real state machine, three real
//! replicas restored from it, the leader's passes read from its metrics, a backup saved, and a
//! follower wiped and joined again; then the cost-curve plot.

mod common;
use common::bench_json;

#[test]
fn scale_holds_a_full_fleet_and_queue_and_a_wiped_replica_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("scale.svg");
    let j = bench_json(&[
        "scale",
        "--hosts",
        "10,30",
        "--pending",
        "300",
        "--runs",
        "2",
        "--window-secs",
        "2",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert_eq!(j["benchmark"], "scale");
    let cases = j["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2, "{j}");
    for (c, hosts) in cases.iter().zip([10u64, 30]) {
        assert!(c["error"].is_null(), "{c}");
        assert_eq!(c["hosts"], hosts, "{c}");
        let b = &c["build"];
        // Full: every GPU held, the whole queue waiting, and the pass places nothing.
        assert_eq!(b["gpus"], hosts * 8, "{c}");
        assert_eq!(b["free_gpus"], 0, "{c}");
        assert_eq!(b["pending"], 300, "{c}");
        assert_eq!(b["plan_placements"], 0, "{c}");
        assert_eq!(b["pass_ms"]["n"], 2, "{c}");
        assert!(b["snapshot_mib"].as_f64().unwrap() > 0.0, "{c}");
        // The running leader scheduled the same queue.
        assert!(c["leader_passes"].as_f64().unwrap() >= 1.0, "{c}");
        assert!(c["leader_pass_ms_mean"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["rss"]["max_mib"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["save"]["file_bytes"].as_u64().unwrap() > 10_000, "{c}");
        // The wiped follower installed the state before it voted again.
        let add = &c["rejoin"]["add"];
        assert_eq!(add["ok"], true, "{c}");
        let installed = add["installed_s"].as_f64().unwrap();
        let promoted = add["promoted_s"].as_f64().unwrap();
        assert!(installed <= promoted, "{c}");
        assert!(c["rejoin"]["probe"]["writes"].as_u64().unwrap() > 0, "{c}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.contains("a wiped replica joins again"), "{svg}");
    assert_eq!(svg.matches("<circle").count(), 9 * 2);
}
