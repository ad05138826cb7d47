//! Smoke runs of `gpuctl bench scheduler` and `gpuctl bench e2e` at small sizes, so the
//! benchmarks never rot. The end-to-end one runs both sides: three real replicas with real
//! agent processes, and Slurm, which the benchmark installs from Debian's packages and starts
//! itself (it needs root and apt, as CI has). The JSON on the last line must show the work
//! done, not just a clean exit.

mod common;
use common::bench_json;

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
