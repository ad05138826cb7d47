//! Deterministic simulation testing: the control plane's core — openraft, the real state
//! machine (`ClusterState::apply`), the scheduler (`plan_with`), the leader loops and the
//! gRPC service implementations — runs with simulated hosts and clients in one process, over
//! a simulated network and clock, under a seeded schedule of faults. Every random choice comes
//! from the seed, so a failing seed reruns the same way (bit for bit when built with
//! `RUSTFLAGS="--cfg tokio_unstable"`, which lets the seed fix tokio's scheduler randomness
//! too; see `runner::run_seed`):
//!
//! ```text
//! GPUCP_DST_SEED=N cargo test -p control-plane --lib dst::tests::seeds -- --nocapture
//! gpuctl simulate cluster --seed N
//! ```
//!
//! One file per job:
//! - `params`: the size and timing of a seed.
//! - `net`: simulated links (delay, loss, symmetric and one-way cuts) and openraft's
//!   `RaftNetwork` over them.
//! - `store`: the Raft log on a simulated disk that survives crashes.
//! - `cluster`: replicas (start, crash, restart) and calls into their services.
//! - `agent`: simulated GPU hosts speaking the agent API, running processes.
//! - `workload`: tenants, job mix, clients with idempotency keys and retries.
//! - `services`: a long-running service beside the batch work (create, scale, roll out,
//!   undo, delete) and what "restored" means for it.
//! - `faults`: the fault schedule and the task that applies it.
//! - `check`: the invariants.
//! - `world`: what the tasks of one seed share.
//! - `runner`: one seed to its verdict, and many seeds across threads.
//!
//! What is not simulated: sled (the log and snapshots live in memory; sled's own durability is
//! covered by openraft's storage suite in `raft/store_suite.rs`), the tonic transport (services
//! are called in-process; forwarding between replicas is replaced by the caller retrying on the
//! leader a refusal names), and real processes (the chaos harness covers those).

pub mod agent;
pub mod check;
pub mod cluster;
#[cfg(test)]
mod elections;
pub mod faults;
pub mod net;
pub mod params;
pub mod runner;
pub mod services;
#[cfg(test)]
mod slow_follower;
#[cfg(test)]
mod stale_leader;
pub mod store;
pub mod workload;
pub mod world;

pub use params::Params;
pub use runner::{SeedReport, Summary, rerun_command, run_seed, run_seeds};

/// Seeds run by default (`cargo test`, `gpuctl simulate cluster`).
pub const DEFAULT_SEEDS: u64 = 1_000;

/// The seeds the environment asks for: `GPUCP_DST_SEED=N` alone, or `GPUCP_DST_SEEDS`
/// (default 1,000) from `GPUCP_DST_FIRST_SEED` (default 0).
pub fn seeds_from_env() -> Result<Vec<u64>, String> {
    let var = |name: &str| -> Result<Option<u64>, String> {
        match std::env::var(name) {
            Ok(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|e| format!("{name}={v:?} is not a number: {e}")),
            Err(_) => Ok(None),
        }
    };
    if let Some(seed) = var("GPUCP_DST_SEED")? {
        return Ok(vec![seed]);
    }
    let count = var("GPUCP_DST_SEEDS")?.unwrap_or(DEFAULT_SEEDS);
    let first = var("GPUCP_DST_FIRST_SEED")?.unwrap_or(0);
    Ok((first..first.saturating_add(count)).collect())
}

/// Worker threads for a run of many seeds: one per core.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CI run: 1,000 seeds (or what the environment asks for), zero violations.
    #[test]
    fn seeds() {
        let seeds = seeds_from_env().expect("valid GPUCP_DST_* variables");
        let started = std::time::Instant::now();
        let params = Params::default();
        let summary = run_seeds(&seeds, &params, default_threads(), &|r| {
            if !r.violations.is_empty() {
                eprintln!("{}", r.describe_failure());
            }
        });
        eprintln!(
            "dst: {} seeds in {:.1} s: {} jobs acknowledged, {} succeeded, {} service replica processes, faults {:?}, {} violations",
            summary.seeds,
            started.elapsed().as_secs_f64(),
            summary.jobs_acked,
            summary.jobs_succeeded,
            summary.replica_processes_started,
            summary.faults,
            summary.violations()
        );
        let failures: Vec<String> = summary
            .failed
            .iter()
            .map(SeedReport::describe_failure)
            .collect();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert_eq!(summary.seeds, seeds.len() as u64);
        assert!(
            summary.jobs_succeeded > 0,
            "no job completed in any seed: the simulation is not exercising the scheduler"
        );
        assert!(
            summary.replica_processes_started > 0,
            "no service replica ran in any seed: the simulation is not exercising services"
        );
    }

    /// The same seed twice gives the same run. Built with `--cfg tokio_unstable` (tokio's
    /// scheduler randomness seeded too) the whole event history is identical; without it the
    /// seed still fixes the workload, the fault schedule and every link's message fates, and
    /// the run ends the same way (same simulated length, same processes, same verdict), but
    /// simultaneous wake-ups may interleave differently (see `runner::run_seed`).
    #[test]
    fn a_seed_replays_identically() {
        let params = Params::default();
        for seed in [3, 17, 42, 99] {
            let a = run_seed(seed, &params);
            let b = run_seed(seed, &params);
            assert!(a.processes_started > 0, "seed {seed} started no process");
            assert_eq!(
                a.violations, b.violations,
                "seed {seed}: different verdicts"
            );
            assert_eq!(a.faults, b.faults, "seed {seed}: different fault schedules");
            assert_eq!(
                a.jobs_acked, b.jobs_acked,
                "seed {seed}: different workloads"
            );
            if cfg!(tokio_unstable) {
                assert_eq!(
                    (a.history_hash, a.sim_ms, a.processes_started),
                    (b.history_hash, b.sim_ms, b.processes_started),
                    "seed {seed} ran differently twice"
                );
            }
        }
    }
}
