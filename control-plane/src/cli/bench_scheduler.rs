//! `gpuctl bench scheduler`: one planning pass, in process, over synthetic fleets of 8-GPU
//! hosts (DGX H100, DGX-1, PCIe L40S; 32 per rack) with pending jobs of mixed shapes (1–8 GPUs,
//! 2×8 gangs, GPU shares, CPU-only; three priority classes; eight tenants; dependencies).
//! Three fleet states per size: empty, half used, and full (where every job is blocked, so the
//! pass computes the backfill reservation and preemption victims instead of placements).

use std::time::Instant;

use serde_json::json;

use crate::scheduler::{Policy, plan_with, plan_with_stats};
use crate::state::{Command, Outcome};
use crate::synthetic::{Driver, fleet, mixed_jobs, submit_all};

pub struct Args {
    pub hosts: Vec<usize>,
    pub jobs: Vec<usize>,
    pub runs: usize,
    /// Which fleet states to measure: empty, half, full.
    pub fleets: Vec<String>,
    /// Placement scores to time, each on the same fleet and queue (the scheduler's default,
    /// `Policy::default().scoring`, when empty).
    pub scoring: Vec<crate::scheduler::score::ScorePolicy>,
}

/// CPU time this thread has used. The pass runs on one thread, so its CPU time is what the
/// pass costs even when other work shares the machine (wall time then also counts waiting
/// for a core); both are reported.
fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A fingerprint of a plan (its JSON form, hashed with fixed keys): equal plans, equal
/// fingerprints, so a change to the policy's code can be checked to leave its output alone.
fn plan_fingerprint(plan: &crate::scheduler::Plan) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    serde_json::to_string(plan).unwrap_or_default().hash(&mut h);
    format!("{:016x}", h.finish())
}

/// GPUs with anything on them (whole, shared or sliced).
fn gpus_in_use(driver: &Driver) -> usize {
    let s = &driver.state;
    let whole_or_slice: usize = s
        .gpu_holder
        .keys()
        .filter(|u| !u.starts_with("MIG-"))
        .count();
    whole_or_slice + s.index.gpu_shares.len()
}

/// Places work until `fraction` of the GPUs are in use (or nothing more fits). Filling uses a
/// plain pass (no backfill, no preemption): it only needs a realistic mix of running work.
pub(crate) fn fill(driver: &mut Driver, fraction: f64, seed: u64) -> anyhow::Result<()> {
    let total = driver.state.total_gpus() as f64;
    let policy = Policy {
        backfill: false,
        preemption: false,
        ..Policy::default()
    };
    for round in 0..64 {
        if (gpus_in_use(driver) as f64) >= total * fraction {
            break;
        }
        let batch = (total as usize / 4).clamp(500, 20_000);
        let jobs = mixed_jobs(batch, seed + round, driver.state.last_job_id + 1);
        submit_all(driver, &jobs)?;
        let plan = plan_with(
            &driver.state,
            driver.now,
            &Policy {
                backfill: true,
                ..policy.clone()
            },
        );
        if plan.placements.is_empty() {
            break;
        }
        // Place only as much as the target needs, in queue order.
        let mut placements = Vec::new();
        let mut held = gpus_in_use(driver) as f64;
        for p in plan.placements {
            if held >= total * fraction {
                break;
            }
            held += p.tasks.iter().map(|t| t.gpus.len()).sum::<usize>() as f64;
            placements.push(p);
        }
        match driver.apply(&Command::Place {
            term: 1,
            placements,
        }) {
            Outcome::Placed { .. } => {}
            other => anyhow::bail!("fill: {other:?}"),
        }
        // Cancel what did not fit so the pending queue under test is only the jobs below.
        let pending: Vec<u64> = driver.state.index.pending.iter().copied().collect();
        for id in pending {
            driver.apply(&Command::cancel(id, "bench fill"));
        }
    }
    Ok(())
}

pub fn run(args: Args) -> anyhow::Result<(String, serde_json::Value)> {
    let scorings = if args.scoring.is_empty() {
        vec![Policy::default().scoring]
    } else {
        args.scoring.clone()
    };
    let mut text = format!(
        "{:>7} {:>7} {:>6} {:>7} {:>9} {:>9} {:>9} {:>10} {:>7} {:>6} {:>6}\n",
        "hosts",
        "pending",
        "fleet",
        "score",
        "min ms",
        "p50 ms",
        "max ms",
        "cpu p50 ms",
        "placed",
        "rsv",
        "preempt"
    );
    let mut rows = Vec::new();
    for &hosts in &args.hosts {
        for &jobs in &args.jobs {
            for (label, fraction) in [("empty", 0.0), ("half", 0.5), ("full", 1.0)] {
                if !args.fleets.iter().any(|f| f == label) {
                    continue;
                }
                let mut driver = Driver::new(1_700_000_000_000);
                fleet(&mut driver, hosts)?;
                if fraction > 0.0 {
                    fill(&mut driver, fraction, 7)?;
                }
                // Time passes so that running work has a history and queued work can age.
                driver.now += 10 * 60 * 1000;
                let pending = mixed_jobs(jobs, 42, driver.state.last_job_id + 1);
                submit_all(&mut driver, &pending)?;
                let used = gpus_in_use(&driver);
                for scoring in &scorings {
                    let policy = Policy {
                        scoring: scoring.clone(),
                        ..Policy::default()
                    };
                    let score = scoring.name();
                    let mut times = Vec::with_capacity(args.runs);
                    let mut cpu_times = Vec::with_capacity(args.runs);
                    let mut last = None;
                    for _ in 0..args.runs {
                        let started = Instant::now();
                        let cpu_started = thread_cpu_time();
                        let result = plan_with_stats(&driver.state, driver.now, &policy);
                        cpu_times.push((thread_cpu_time() - cpu_started).as_secs_f64() * 1000.0);
                        times.push(started.elapsed().as_secs_f64() * 1000.0);
                        last = Some(result);
                    }
                    let (plan, stats) = last.unwrap_or_default();
                    let fingerprint = plan_fingerprint(&plan);
                    let head = plan.reservation.as_ref().map_or(String::new(), |r| {
                    let spec = driver.state.jobs.get(&r.job).map(|j| &j.spec);
                    format!(
                        "; head {} task(s) x {} GPU(s) (milli {}) reserved on {} node(s) from +{} s",
                        spec.map_or(0, |s| s.tasks),
                        spec.map_or(0, |s| s.gpus_per_task),
                        spec.map_or(0, |s| s.gpu_milli),
                        r.nodes.len(),
                        r.start_at.saturating_sub(driver.now) / 1000
                    )
                });
                    times.sort_by(f64::total_cmp);
                    cpu_times.sort_by(f64::total_cmp);
                    let (min, p50, max) =
                        (times[0], times[times.len() / 2], times[times.len() - 1]);
                    let cpu_p50 = cpu_times[cpu_times.len() / 2];
                    text += &format!(
                        "{hosts:>7} {jobs:>7} {label:>6} {score:>7} {min:>9.1} {p50:>9.1} {max:>9.1} {cpu_p50:>10.1} {:>7} {:>6} {:>6}\n",
                        plan.placements.len(),
                        if plan.reservation.is_some() {
                            "yes"
                        } else {
                            "no"
                        },
                        plan.preemptions
                            .iter()
                            .map(|p| p.victims.len())
                            .sum::<usize>(),
                    );
                    rows.push(json!({
                    "hosts": hosts,
                    "gpus": driver.state.total_gpus(),
                    "pending": jobs,
                    "fleet": label,
                    "placement_score": score,
                    "gpus_in_use_at_start": used,
                    "pass_ms": {"min": min, "p50": p50, "max": max},
                    "pass_cpu_ms_p50": cpu_p50,
                    "runs": args.runs,
                    "placements": plan.placements.len(),
                    "reservation": plan.reservation.is_some(),
                    "preempted": plan.preemptions.iter().map(|p| p.victims.len()).sum::<usize>(),
                    "last_pass_stages_us": stats,
                    "plan_fingerprint": fingerprint,
                }));
                    eprintln!(
                        "{hosts} hosts, {jobs} pending, {label}, {score}: {stats:?} plan {fingerprint}{head}"
                    );
                }
            }
        }
    }
    Ok((text, json!({"benchmark": "scheduler", "results": rows})))
}
