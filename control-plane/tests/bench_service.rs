//! Smoke run of `gpuctl bench service` (issue 22's figures), so the benchmark keeps working:
//! two hosts, two tries of each fault, a rolling update of three replicas, with short node
//! leases so a cut-off host is replaced within seconds.

mod common;
use common::bench_json;

#[test]
fn bench_service_smoke_measures_restarts_replacement_rollout_and_autoscaling() {
    let j = bench_json(&[
        "service",
        "--hosts",
        "2",
        "--tries",
        "2",
        "--replicas",
        "3",
        "--replica-args",
        "--node-lease-ms 1500 --node-grace-ms 1500 --agent-heartbeat-ms 200",
    ]);
    assert_eq!(j["benchmark"], "service", "{j}");
    for key in [
        "restart_after_kill_ms",
        "replace_after_host_cut_off_ms",
        "autoscale_to_new_replica_ready_ms",
    ] {
        assert_eq!(j[key]["n"], 2, "{key}: {j}");
        let p50 = j[key]["p50"].as_f64().unwrap();
        assert!(p50 > 0.0 && p50 < 60_000.0, "{key}: {j}");
    }
    // The cut-off host's replica cannot come back before its lease and grace have run out.
    // The lease runs from the agent's last heartbeat, up to one heartbeat (200 ms) before the
    // kill the benchmark times from.
    assert!(
        j["replace_after_host_cut_off_ms"]["p50"].as_f64().unwrap() >= 3_000.0 - 200.0,
        "{j}"
    );
    let roll = &j["rolling_update"];
    assert_eq!(roll["replicas"], 3, "{j}");
    assert!(
        roll["min_ready"].as_u64().unwrap() >= 3,
        "never below replicas - 0: {j}"
    );
    assert!(
        roll["max_copies"].as_u64().unwrap() <= 4,
        "replicas + surge: {j}"
    );
}
