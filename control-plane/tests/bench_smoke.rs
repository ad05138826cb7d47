//! Smoke runs of `gpuctl bench scheduler`, `status-page` and `e2e` at small sizes, so the
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
fn status_page_renders_every_page_of_a_filled_fleet() {
    let j = bench_json(&["status-page", "--hosts", "20", "--runs", "2"]);
    assert_eq!(j["benchmark"], "status-page");
    assert_eq!(j["gpus"], 160, "{j}");
    assert!(j["gpus_held"].as_u64().unwrap() >= 120, "{j}");
    for page in ["nodes", "cluster", "queue", "tenants", "node", "job"] {
        assert_eq!(j["pages"][page]["ms"]["n"], 2, "{page}: {j}");
        assert!(
            j["pages"][page]["bytes"].as_u64().unwrap() > 1000,
            "{page}: {j}"
        );
    }
}

#[test]
fn end_to_end_completes_every_job_on_both_sides_and_with_exec_shims() {
    let j = bench_json(&["e2e", "--jobs", "100", "--with-exec-shims-too"]);
    assert_eq!(j["benchmark"], "e2e");
    assert_eq!(j["gpucp_completed"], 100, "{j}");
    // The same jobs with each shim exec'd rather than forked by the agents' launchers.
    assert!(
        j["gpucp_exec_shims_jobs_per_sec"].as_f64().unwrap() > 0.0,
        "{j}"
    );
    assert!(j["launcher_saving_ms_per_job"].is_number(), "{j}");
    assert_eq!(j["slurm_completed"], 100, "{j}");
    assert!(j["gpucp_jobs_per_sec"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["slurm_jobs_per_sec"].as_f64().unwrap() > 0.0, "{j}");
}

#[test]
fn end_to_end_runs_container_jobs_beside_process_jobs() {
    // SAFETY: geteuid has no arguments and cannot fail.
    let root = unsafe { libc::geteuid() == 0 };
    if !(root && control_plane::host_image::engine_available()) {
        assert!(
            std::env::var("GPUCP_REQUIRE_DOCKER").is_err() && std::env::var_os("CI").is_none(),
            "a Docker engine is required here but not usable as root"
        );
        eprintln!("no Docker engine reachable as root here; not run");
        return;
    }
    let j = bench_json(&[
        "e2e",
        "--jobs",
        "20",
        "--hosts",
        "1",
        "--gpus-per-host",
        "4",
        "--skip-slurm",
        "--with-containers-too",
    ]);
    assert_eq!(j["gpucp_completed"], 20, "{j}");
    assert!(
        j["gpucp_containers_jobs_per_sec"].as_f64().unwrap() > 0.0,
        "{j}"
    );
    assert!(j["container_cost_ms_per_job"].is_number(), "{j}");
}
