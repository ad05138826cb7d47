//! Smoke runs of the benchmarks at small sizes, so none of them rots: `placement` and
//! `failover` start three real replicas and simulated hosts; `scheduler` runs in process;
//! `e2e` runs both sides, three real replicas with real agent processes and Slurm, which the
//! benchmark installs from Debian's packages and starts itself (it needs root and apt, as CI
//! has). The JSON on the last line of stdout must show the work done, not just a clean exit.

use std::process::Command;

fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuctl"))
        .args(["--output", "json", "bench"])
        .args(args)
        .output()
        .expect("running gpuctl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gpuctl bench {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last line of stdout is not JSON ({e}): {last:?}\n{stderr}"))
}

#[test]
fn placement_places_and_finishes_every_job() {
    // 20 hosts hold 160 jobs at once: the other 340 need GPUs freed by finished jobs.
    let j = bench_json(&["placement", "--hosts", "20", "--jobs", "500"]);
    assert_eq!(j["benchmark"], "placement");
    assert_eq!(j["jobs"], 500);
    assert_eq!(j["finish"], true, "{j}");
    assert_eq!(j["placed"], 500, "{j}");
    assert_eq!(j["finished"], 500, "{j}");
    assert!(j["placements_per_sec"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["place_entries"].as_u64().unwrap() >= 1, "{j}");
}

#[test]
fn placement_without_turnover_needs_no_finishing() {
    let j = bench_json(&[
        "placement",
        "--hosts",
        "10",
        "--jobs",
        "80",
        "--finish",
        "no",
    ]);
    assert_eq!(j["finish"], false, "{j}");
    assert_eq!(j["placed"], 80, "{j}");
    assert_eq!(j["finished"], 0, "{j}");
    assert!(j["placements_per_sec"].as_f64().unwrap() > 0.0, "{j}");
}

#[test]
fn failover_measures_leader_commit_and_placement() {
    let j = bench_json(&["failover", "--kills", "2", "--hosts", "4", "--rate", "50"]);
    assert_eq!(j["benchmark"], "failover");
    assert_eq!(j["kills"], 2);
    for key in [
        "to_new_leader_ms",
        "to_first_commit_ms",
        "to_first_placement_ms",
    ] {
        assert_eq!(j[key]["n"], 2, "{key}: {j}");
        let p50 = j[key]["p50"].as_f64().unwrap();
        assert!(p50 > 0.0 && p50 < 30_000.0, "{key}: {j}");
    }
    assert!(j["jobs_finished"].as_u64().unwrap() > 0, "{j}");
}

#[test]
fn scheduler_pass_runs_on_every_fleet_state() {
    let j = bench_json(&["scheduler", "--hosts", "50", "--jobs", "200", "--runs", "1"]);
    assert_eq!(j["benchmark"], "scheduler");
    let rows = j["results"].as_array().expect("results");
    assert_eq!(rows.len(), 3, "{j}");
    // On the empty fleet the pass places work; on the full one it reserves for the head job.
    assert!(rows[0]["placements"].as_u64().unwrap() > 0, "{j}");
    assert_eq!(rows[2]["reservation"], true, "{j}");
}

#[test]
fn end_to_end_completes_every_job_on_both_sides() {
    let j = bench_json(&["e2e", "--jobs", "100"]);
    assert_eq!(j["benchmark"], "e2e");
    assert_eq!(j["gpucp_completed"], 100, "{j}");
    assert_eq!(j["slurm_completed"], 100, "{j}");
    assert!(j["gpucp_jobs_per_sec"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["slurm_jobs_per_sec"].as_f64().unwrap() > 0.0, "{j}");
}
