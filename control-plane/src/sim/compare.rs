//! Queueing quality side by side (`gpuctl simulate replay --compare`): on one trace and fleet,
//! the real scheduler with its default policy ("ours"), FIFO with EASY backfill (Slurm's
//! default behaviour) and the Tiresias-style least-attained-service baseline (`sim::las`), each
//! replayed through the state machine; and the ratios of ours to each baseline.
//!
//! FIFO + backfill is the real scheduler under a policy that reduces it to Slurm's defaults
//! (`priority/basic`, `sched/backfill`): every job of one tenant and one priority class, no
//! aging (`aging_step_ms` 0), no preemption, backfill on. Its queue order is then submission
//! order (`scheduler::queue`: one class, one tenant), and its backfill is EASY: one
//! reservation, for the first job that cannot start, which later jobs may not delay. Placement
//! is the same as ours (FGD), so the comparison isolates the queueing policy. Slurm's own
//! backfill plans reservations for many queued jobs (`bf_max_job_test`), not one.

use serde::Serialize;

use super::las::LasConfig;
use super::replay::{self, RunConfig, RunResult, Scheduler};
use super::workload::TraceJob;
use crate::scheduler::Policy;
use crate::state::ClusterState;

/// Labels of the three runs, in the order they are reported.
pub const OURS: &str = "ours";
pub const FIFO_BACKFILL: &str = "fifo+backfill";
pub const LAS: &str = "tiresias-las";

/// Settings shared by the three runs, and each scheduler's own.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    pub ours: Policy,
    pub las: LasConfig,
    /// How long a stopped job takes to exit.
    pub grace_ms: u64,
    /// Extra periodic passes (0: only at events).
    pub tick_ms: u64,
}

impl Default for CompareConfig {
    fn default() -> Self {
        CompareConfig {
            ours: Policy::default(),
            las: LasConfig::default(),
            grace_ms: 30_000,
            tick_ms: 0,
        }
    }
}

/// The real scheduler's policy reduced to FIFO with EASY backfill (see the module docs).
pub fn fifo_backfill_policy(ours: &Policy) -> Policy {
    Policy {
        backfill: true,
        preemption: false,
        aging_step_ms: 0,
        ..ours.clone()
    }
}

/// The trace as a FIFO scheduler sees it: every job of `tenant`, priority class `normal`, not
/// preemptible. Arrivals, shapes, durations, limits and dependencies are unchanged.
pub fn fifo_trace(jobs: &[TraceJob], tenant: &str) -> Vec<TraceJob> {
    jobs.iter()
        .map(|j| {
            let mut j = j.clone();
            j.spec.tenant = tenant.into();
            j.spec.priority_class = "normal".into();
            j.spec.preemptible = false;
            j
        })
        .collect()
}

/// Ours divided by a baseline, per metric: below 1 is better for ours on times, above 1 on
/// utilization. `None` where the baseline's figure is 0.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ratios {
    pub baseline: String,
    pub mean_jct: Option<f64>,
    pub p99_jct: Option<f64>,
    pub mean_queue_delay: Option<f64>,
    pub p99_queue_delay: Option<f64>,
    pub gpu_utilization: Option<f64>,
}

fn ratio(ours: f64, baseline: f64) -> Option<f64> {
    (baseline > 0.0).then(|| ours / baseline)
}

pub fn ratios(ours: &RunResult, baseline: &RunResult) -> Ratios {
    Ratios {
        baseline: baseline.label.clone(),
        mean_jct: ratio(ours.mean_jct_s, baseline.mean_jct_s),
        p99_jct: ratio(ours.p99_jct_s, baseline.p99_jct_s),
        mean_queue_delay: ratio(ours.mean_queue_delay_s, baseline.mean_queue_delay_s),
        p99_queue_delay: ratio(ours.p99_queue_delay_s, baseline.p99_queue_delay_s),
        gpu_utilization: ratio(ours.gpu_utilization, baseline.gpu_utilization),
    }
}

/// The three runs (ours, FIFO + backfill, LAS) and ours against each baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub runs: Vec<RunResult>,
    pub ratios: Vec<Ratios>,
}

/// Replays `jobs` on a copy of `base` under each scheduler; `started` is told each run's label
/// before it runs (for progress output).
pub fn compare(
    base: &ClusterState,
    jobs: &[TraceJob],
    cfg: &CompareConfig,
    mut started: impl FnMut(&str),
) -> anyhow::Result<Comparison> {
    let run_cfg = |label: &str, scheduler: Scheduler| RunConfig {
        label: label.into(),
        scheduler,
        grace_ms: cfg.grace_ms,
        tick_ms: cfg.tick_ms,
        // Preemptive LAS assumes checkpointed jobs; every scheduler gets the same jobs.
        resume: true,
    };
    let Some(first) = jobs.first() else {
        anyhow::bail!("the trace has no jobs to compare schedulers on");
    };
    // One tenant the fleet knows: the first job's.
    let fifo_jobs = fifo_trace(jobs, &first.spec.tenant);
    let mut runs = Vec::with_capacity(3);
    started(OURS);
    runs.push(replay::run(
        base,
        jobs,
        &run_cfg(OURS, Scheduler::Ours(cfg.ours.clone())),
    )?);
    started(FIFO_BACKFILL);
    let fifo = Scheduler::Ours(fifo_backfill_policy(&cfg.ours));
    runs.push(replay::run(
        base,
        &fifo_jobs,
        &run_cfg(FIFO_BACKFILL, fifo),
    )?);
    started(LAS);
    runs.push(replay::run(
        base,
        jobs,
        &run_cfg(LAS, Scheduler::Las(cfg.las.clone())),
    )?);
    let ratios = vec![ratios(&runs[0], &runs[1]), ratios(&runs[0], &runs[2])];
    Ok(Comparison { runs, ratios })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::dl_workload;
    use crate::sim::replay::EPOCH_MS;
    use crate::synthetic::Driver;

    #[test]
    fn fifo_trace_keeps_the_work_and_drops_classes_and_tenants() {
        let jobs = dl_workload::dl(50, 64, 0.9, 4);
        let fifo = fifo_trace(&jobs, "t0");
        assert_eq!(fifo.len(), jobs.len());
        for (a, b) in jobs.iter().zip(&fifo) {
            assert_eq!(
                (a.arrival_ms, a.duration_ms, a.spec.total_gpus(), a.after),
                (b.arrival_ms, b.duration_ms, b.spec.total_gpus(), b.after)
            );
            assert_eq!(a.spec.time_limit_secs, b.spec.time_limit_secs);
            assert_eq!(b.spec.tenant, "t0");
            assert_eq!(b.spec.priority_class, "normal");
        }
        assert!(jobs.iter().any(|j| j.spec.tenant != "t0"));
        let p = fifo_backfill_policy(&Policy::default());
        assert!(p.backfill && !p.preemption && p.aging_step_ms == 0);
    }

    /// A few hundred jobs of the DL workload on four 8-GPU hosts under all three schedulers.
    #[test]
    fn smoke_three_schedulers_on_a_small_dl_trace() {
        let mut d = Driver::new(EPOCH_MS);
        crate::synthetic::fleet(&mut d, 4).unwrap();
        let jobs = dl_workload::dl(300, 32, 0.9, 5);
        let mut order = Vec::new();
        let c = compare(&d.state, &jobs, &CompareConfig::default(), |l| {
            order.push(l.to_string())
        })
        .unwrap();
        assert_eq!(order, [OURS, FIFO_BACKFILL, LAS]);
        let gpu_ms: f64 = jobs
            .iter()
            .map(|j| j.spec.total_gpus() as f64 * j.duration_ms as f64)
            .sum();
        for r in &c.runs {
            // Every job submitted, run to completion, nothing refused by apply.
            assert_eq!(r.rejected_submissions, 0, "{}", r.label);
            assert_eq!(
                (r.completed, r.unfinished, r.timed_out),
                (300, 0, 0),
                "{}",
                r.label
            );
            assert_eq!(r.refused_placements, 0, "{}: {:?}", r.label, r.refusals);
            // A job's completion time is at least its queueing delay plus its duration.
            assert!(r.mean_jct_s >= r.mean_queue_delay_s, "{}", r.label);
            assert!(r.p99_jct_s >= r.mean_jct_s && r.p99_queue_delay_s >= r.mean_queue_delay_s);
            // Utilization is the offered work over the makespan, give or take the GPU time
            // that stopped jobs lose and redo.
            let at_least = gpu_ms / 1000.0 / (r.makespan_s * 32.0);
            assert!(
                r.gpu_utilization >= at_least * 0.99 && r.gpu_utilization <= 1.0,
                "{}: {} vs {at_least}",
                r.label,
                r.gpu_utilization
            );
        }
        let [ours, fifo, las] = [&c.runs[0], &c.runs[1], &c.runs[2]];
        assert_eq!(fifo.preemptions, 0, "FIFO + backfill never preempts");
        assert!(las.preemptions > 0, "LAS stops long jobs for new ones");
        assert_eq!((las.policy.as_str(), las.backfill), ("las", false));
        assert_eq!(c.ratios.len(), 2);
        assert_eq!(c.ratios[0].baseline, FIFO_BACKFILL);
        assert_eq!(c.ratios[1].baseline, LAS);
        let r = c.ratios[1].mean_jct.unwrap();
        assert!((r - ours.mean_jct_s / las.mean_jct_s).abs() < 1e-12);
    }
}
