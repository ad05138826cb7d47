//! A synthetic deep-learning training workload whose job sizes and durations follow the
//! published characterisations of two production GPU clusters, deterministic from a seed
//! (`gpuctl simulate replay --workload dl`).
//!
//! Sources and what is taken from each:
//! - Microsoft Philly (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN
//!   Training Workloads", USENIX ATC '19; trace at github.com/msr-fiddle/philly-traces): most
//!   jobs use one GPU, a minority 2–4, a few 8 and 16 or more; run times are heavy-tailed, from
//!   minutes to days, with a median in the tens of minutes; the cluster is shared by a few
//!   virtual clusters (tenants) of unequal size.
//! - SenseTime Helios (Hu et al., "Characterization and Prediction of Deep Learning Workloads
//!   in Large-Scale GPU Datacenters", SC '21; trace at github.com/S-Lab-System-Group/HeliosData):
//!   GPU jobs are mostly single-GPU with a long tail of large jobs; durations look lognormal,
//!   most GPU jobs end within an hour, while a few large, long jobs take most of the GPU time.
//!
//! The numbers below are **approximations chosen to match those shapes**, not values read off
//! the papers' figures (this module was written without the traces at hand):
//!
//! | GPUs | share of jobs | median duration |
//! | --- | --- | --- |
//! | 1 | 70% | 20 min |
//! | 2 | 10% | 40 min |
//! | 4 | 9% | 40 min |
//! | 8 | 7% | 60 min |
//! | 16 (2 × 8) | 2.5% | 2 h |
//! | 32 (4 × 8) | 1% | 2 h |
//! | 64 (8 × 8) | 0.5% | 2 h |
//!
//! Durations are lognormal around those medians with σ = 1.8 (so p90 ≈ 10 × the median and
//! p99 ≈ 65 ×), clamped to 1 minute – 7 days: about two thirds of all jobs end within an hour, and
//! jobs of 8 GPUs or more, about 11% of jobs, hold about 80% of the GPU time. Jobs larger than
//! one 8-GPU host are gangs of 8-GPU tasks, as in the `synthetic` workload; sizes above the
//! fleet's GPU count are capped at it. Tenants (8, Philly's virtual clusters) have unequal
//! activity: 30, 20, 15, 10, 8, 7, 5 and 5% of jobs. Every job is of priority class `normal`
//! and not preemptible (neither trace carries classes), with no dependencies. Each job's time
//! limit is its duration × 1.2–3 rounded up to a minute, so none times out and every policy
//! runs every job to completion. Arrivals are a Poisson process at the offered `load`, computed
//! as `workload::synthetic` does.

use super::workload::{TraceJob, poisson_arrivals, unit};
use crate::scheduler::score::SplitMix64;

/// GPUs per host in the fleets this workload is meant for: bigger jobs are gangs of such tasks.
pub const GPUS_PER_HOST: u32 = 8;

/// (GPUs, per-mille of jobs, median duration in seconds), smallest first.
const SIZES: [(u32, u64, f64); 7] = [
    (1, 700, 20.0 * 60.0),
    (2, 100, 40.0 * 60.0),
    (4, 90, 40.0 * 60.0),
    (8, 70, 60.0 * 60.0),
    (16, 25, 2.0 * 3600.0),
    (32, 10, 2.0 * 3600.0),
    (64, 5, 2.0 * 3600.0),
];

/// Spread of log-durations around each size's median.
const LOG_SIGMA: f64 = 1.8;
const MIN_DURATION_S: f64 = 60.0;
const MAX_DURATION_S: f64 = 7.0 * 24.0 * 3600.0;

/// Per-mille of jobs from each tenant `t0`..`t7`.
const TENANT_SHARES: [u64; 8] = [300, 200, 150, 100, 80, 70, 50, 50];

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut SplitMix64) -> f64 {
    let u1 = 1.0 - unit(rng); // (0, 1]: ln stays finite
    let u2 = unit(rng);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Index into a table of per-mille weights summing to 1000.
fn pick(rng: &mut SplitMix64, weights: impl Iterator<Item = u64>) -> usize {
    let mut r = rng.below(1000);
    for (i, w) in weights.enumerate() {
        if r < w {
            return i;
        }
        r -= w;
    }
    unreachable!("weights sum to 1000")
}

/// (tasks, GPUs per task) of a job of `gpus` GPUs: one task up to a host, else 8-GPU tasks.
fn gang(gpus: u32) -> (u32, u32) {
    if gpus <= GPUS_PER_HOST {
        (1, gpus)
    } else {
        (gpus.div_ceil(GPUS_PER_HOST), GPUS_PER_HOST)
    }
}

/// `n` jobs on a fleet of `capacity_gpus` GPUs, offering `load` × its capacity.
pub fn dl(n: usize, capacity_gpus: usize, load: f64, seed: u64) -> Vec<TraceJob> {
    let mut rng = SplitMix64::new(seed ^ 0x00d1_0ad5_ca1e);
    // The largest job must fit the fleet: never bigger than its GPUs, in whole hosts.
    let largest = (capacity_gpus as u32 / GPUS_PER_HOST * GPUS_PER_HOST).max(1);
    let mut jobs = Vec::with_capacity(n);
    for i in 0..n {
        let (gpus, _, median_s) = SIZES[pick(&mut rng, SIZES.iter().map(|s| s.1))];
        let gpus = gpus.min(largest);
        let duration_s =
            (median_s * (LOG_SIGMA * normal(&mut rng)).exp()).clamp(MIN_DURATION_S, MAX_DURATION_S);
        let duration_ms = (duration_s * 1000.0) as u64;
        let factor = 1.2 + 1.8 * unit(&mut rng);
        let limit_s = ((duration_s * factor / 60.0).ceil() as u64).max(1) * 60;
        let tenant = pick(&mut rng, TENANT_SHARES.iter().copied()) as u64;
        let (tasks, per_task) = gang(gpus);
        let spec = crate::synthetic::job_spec(i, tenant, (per_task, tasks, 0), "normal", limit_s);
        jobs.push(TraceJob {
            spec,
            arrival_ms: 0,
            duration_ms,
            after: None,
        });
    }
    poisson_arrivals(&mut jobs, capacity_gpus, load, &mut rng);
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(jobs: &[TraceJob], f: impl Fn(&TraceJob) -> bool) -> f64 {
        jobs.iter().filter(|j| f(j)).count() as f64 / jobs.len() as f64
    }

    #[test]
    fn deterministic_and_at_the_target_load() {
        let a = dl(4000, 512, 0.9, 7);
        assert_eq!(a, dl(4000, 512, 0.9, 7));
        assert_ne!(a, dl(4000, 512, 0.9, 8));
        assert!(a.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        let span = a.last().unwrap().arrival_ms as f64;
        let work: f64 = a
            .iter()
            .map(|j| j.spec.total_gpu_milli() as f64 * j.run_ms() as f64)
            .sum();
        let offered = work / span / 512_000.0;
        assert!((offered - 0.9).abs() < 0.15, "offered load {offered}");
        // Every job runs to completion: its limit is above its duration.
        assert!(a.iter().all(|j| j.run_ms() == j.duration_ms));
    }

    #[test]
    fn sizes_follow_the_published_shape() {
        let jobs = dl(20_000, 512, 0.9, 1);
        let gpus = |j: &TraceJob| j.spec.total_gpus();
        let single = share(&jobs, |j| gpus(j) == 1);
        let two_to_four = share(&jobs, |j| (2..=4).contains(&gpus(j)));
        let eight = share(&jobs, |j| gpus(j) == 8);
        let larger = share(&jobs, |j| gpus(j) > 8);
        // Most jobs one GPU, a minority 2–4, a few 8, fewer 16+.
        assert!((0.67..0.73).contains(&single), "1 GPU: {single}");
        assert!(
            (0.16..0.22).contains(&two_to_four),
            "2-4 GPUs: {two_to_four}"
        );
        assert!((0.05..0.09).contains(&eight), "8 GPUs: {eight}");
        assert!((0.025..0.055).contains(&larger), "16+ GPUs: {larger}");
        // Jobs over one host are gangs of whole 8-GPU hosts.
        for j in jobs.iter().filter(|j| gpus(j) > 8) {
            assert_eq!(j.spec.gpus_per_task, GPUS_PER_HOST);
            assert_eq!(u64::from(j.spec.tasks) * 8, gpus(j));
        }
        // A few large jobs take most of the GPU time.
        let gpu_time = |f: &dyn Fn(&TraceJob) -> bool| -> f64 {
            jobs.iter()
                .filter(|j| f(j))
                .map(|j| gpus(j) as f64 * j.duration_ms as f64)
                .sum()
        };
        let large_share = gpu_time(&|j| gpus(j) >= 8) / gpu_time(&|_| true);
        assert!(large_share > 0.6, "GPU time of 8+ GPU jobs: {large_share}");
    }

    #[test]
    fn durations_are_heavy_tailed_with_a_median_of_tens_of_minutes() {
        let jobs = dl(20_000, 512, 0.9, 2);
        let mut minutes: Vec<f64> = jobs
            .iter()
            .map(|j| j.duration_ms as f64 / 60_000.0)
            .collect();
        minutes.sort_by(f64::total_cmp);
        let q = |p: f64| minutes[((p * minutes.len() as f64) as usize).min(minutes.len() - 1)];
        let (median, p99) = (q(0.5), q(0.99));
        assert!((10.0..60.0).contains(&median), "median {median} min");
        let under_an_hour = share(&jobs, |j| j.duration_ms < 3_600_000);
        assert!((0.6..0.8).contains(&under_an_hour), "{under_an_hour}");
        // From minutes to days.
        assert!(
            minutes[0] >= 1.0 && minutes[0] < 2.0,
            "shortest {}",
            minutes[0]
        );
        assert!(p99 > 24.0 * 60.0 / 2.0, "p99 {p99} min");
        assert!(p99 / median > 30.0, "p99/median {}", p99 / median);
        assert!(*minutes.last().unwrap() <= 7.0 * 24.0 * 60.0);
    }

    #[test]
    fn tenants_are_unequal_and_jobs_fit_a_small_fleet() {
        let jobs = dl(5000, 32, 0.9, 3);
        let busiest = share(&jobs, |j| j.spec.tenant == "t0");
        let quietest = share(&jobs, |j| j.spec.tenant == "t7");
        assert!(busiest > 4.0 * quietest, "t0 {busiest} t7 {quietest}");
        assert!(jobs.iter().all(|j| j.spec.total_gpus() <= 32));
        assert!(jobs.iter().any(|j| j.spec.total_gpus() == 32));
        assert!(jobs.iter().all(|j| j.spec.priority_class == "normal"
            && !j.spec.preemptible
            && j.after.is_none()));
    }
}
