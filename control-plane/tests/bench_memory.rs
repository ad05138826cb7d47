//! Smoke of `gpuctl bench memory` at a small size (CI runs it in a debug build): the benchmark
//! runs end to end and what it reports adds up: every job is accounted for (whole, archived
//! or forgotten), compaction keeps fewer full records and writes a smaller snapshot, and a
//! restarted replica loads exactly what was built.

mod common;
use common::bench_json;

#[test]
fn bench_memory_accounts_for_every_job_and_compaction_shrinks_the_state() {
    let j = bench_json(&[
        "memory",
        "--hosts",
        "100",
        "--jobs",
        "5000",
        "--also-uncompacted",
    ]);

    assert_eq!(j["benchmark"], "memory");
    assert_eq!(j["hosts"], 100);
    assert_eq!(j["gpus"], 800);
    assert_eq!(j["jobs"], 5000);
    let cases = j["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2, "{j}");
    let (compacted, uncompacted) = (&cases[0], &cases[1]);
    assert_eq!(compacted["compaction"], true);
    assert_eq!(uncompacted["compaction"], false);

    let n = |v: &serde_json::Value, what: &str| {
        v[what]
            .as_u64()
            .unwrap_or_else(|| panic!("{what} missing in {v}"))
    };
    for case in cases {
        let b = &case["build"];
        assert_eq!(n(b, "jobs"), 5000, "{b}");
        assert_eq!(
            n(b, "full_records") + n(b, "archived") + n(b, "forgotten"),
            5000,
            "a job is unaccounted for: {b}"
        );
        // Every job was submitted with a key; the keys of archived jobs stay answerable.
        assert_eq!(
            n(b, "idempotency_keys"),
            n(b, "full_records") + n(b, "archived"),
            "{b}"
        );
        assert!(n(b, "running") > 0 && n(b, "live_allocations") > 0, "{b}");
        assert!(n(b, "snapshot_bytes") > 0, "{b}");
        assert!(b["vm_rss_mib"].as_f64().unwrap() > 0.0, "{b}");
        assert!(
            b["vm_hwm_mib"].as_f64().unwrap() >= b["vm_rss_mib"].as_f64().unwrap(),
            "{b}"
        );
        let r = &case["restart"];
        assert_eq!(n(r, "full_records"), n(b, "full_records"), "{case}");
        assert_eq!(n(r, "archived"), n(b, "archived"), "{case}");
        assert!(r["vm_rss_mib"].as_f64().unwrap() > 0.0, "{r}");
    }
    let (c, u) = (&compacted["build"], &uncompacted["build"]);
    assert!(n(c, "archived") > 0, "nothing was archived: {c}");
    assert_eq!(n(u, "archived"), 0, "{u}");
    assert_eq!(n(u, "full_records"), 5000, "{u}");
    assert!(n(c, "full_records") < n(u, "full_records"), "{c} vs {u}");
    assert!(
        n(c, "snapshot_bytes") < n(u, "snapshot_bytes"),
        "compaction did not shrink the snapshot: {c} vs {u}"
    );
}
