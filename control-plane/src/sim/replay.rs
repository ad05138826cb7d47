//! Time-based replay: jobs arrive, wait, run for their duration (or until their time limit, or
//! until preempted) and leave, on a virtual clock. Every change goes through
//! `ClusterState::apply`, so the real state machine checks each placement and preemption the
//! scheduler proposes; a refused placement is a scheduler/state disagreement and is counted.
//!
//! Events: arrivals, allocation ends (`Succeeded` after `duration`, `TimedOut` at the time
//! limit, `Stopped` a grace period after a preemption), and aging ticks. After all events of
//! one instant are applied, one scheduling pass runs (`plan_with` at that instant), its
//! preemptions are applied first, then its placements, and every placed allocation is reported
//! started at once. Besides event times, a pass runs whenever a pending job's aging level rises
//! (the plan depends on `now` only through aging and fair-share decay), and optionally every
//! `tick_ms` while anything else is still to happen.
//!
//! A run plans with the real scheduler under a policy, or with the simulator-only
//! least-attained-service baseline (`Scheduler::Las`, `sim::las`), whose stops are requeues
//! (`JobChange::Requeue`). With `RunConfig::resume`, a stopped job later runs only what was left
//! of its work (checkpointed training); without, it starts over.
//!
//! Metrics:
//! - queueing delay of a job: the sum, over its placements, of placement time − the time it
//!   became eligible (`queue::eligible_since`: submission, requeue after a preemption, or the
//!   end of its last dependency). Jobs never placed are left out (and counted `unfinished`).
//! - JCT: final state time − submission time, for jobs that reached a final state.
//! - GPU utilization: time-weighted mean of allocated GPU capacity (milli-GPU held by live
//!   allocations, stopping ones included) / GPU capacity (healthy non-MIG GPUs × 1000), from
//!   the first arrival to the last event.
//! - unallocatable share: time-weighted mean of U(t) / capacity, where U(t) is the free GPU
//!   capacity (milli) on the nodes where no task of any eligible pending job fits (CPU, memory
//!   and, per its shape, enough free whole GPUs of an accepted model or one GPU with room for
//!   its share), measured after each pass. With nothing eligible pending, U(t) = 0: idle
//!   capacity nobody asks for is not lost. Tasks are checked one at a time, so a gang whose
//!   tasks each fit somewhere makes those nodes count as usable.
//! - idle-while-pending share: time-weighted mean of all free GPU capacity / capacity at the
//!   moments when at least one eligible job is pending (capacity lost to fragmentation, to
//!   strict ordering or to backfill reservations alike).

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use serde::Serialize;

use super::las::{self, LasConfig};
use super::workload::TraceJob;
use crate::scheduler::queue::{AGED_LEVEL, dependencies_met, eligible_since, level};
use crate::scheduler::{Policy, ScorePolicy, plan_with};
use crate::state::{
    ClusterState, Command, Dependency, DependencyKind, JobChange, JobId, JobState, MILLI_PER_GPU,
    NodeStatus, Outcome, TaskOutcome, Timestamp,
};
use crate::synthetic::Driver;

/// Simulated time of the trace's 0 (any fixed epoch; only differences matter).
pub const EPOCH_MS: Timestamp = 1_000_000_000;

/// Which scheduler plans the passes of a run.
#[derive(Debug, Clone)]
pub enum Scheduler {
    /// The real scheduler: `plan_with` under this policy.
    Ours(Policy),
    /// The simulator-only Tiresias-style baseline (`sim::las`); its preemptions are requeues.
    Las(LasConfig),
}

/// One run's settings.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub label: String,
    pub scheduler: Scheduler,
    /// How long a preempted job takes to stop.
    pub grace_ms: u64,
    /// Extra periodic passes (0: passes only at events and aging steps).
    pub tick_ms: u64,
    /// A stopped job resumes where it stopped (checkpointed training, as Tiresias assumes)
    /// instead of starting over.
    pub resume: bool,
}

/// The figures of one run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunResult {
    pub label: String,
    pub backfill: bool,
    pub policy: String,
    pub preemption: bool,
    pub jobs: usize,
    pub rejected_submissions: usize,
    pub completed: usize,
    pub timed_out: usize,
    pub failed: usize,
    pub unfinished: usize,
    pub preemptions: usize,
    pub placements: usize,
    pub mean_queue_delay_s: f64,
    pub p50_queue_delay_s: f64,
    pub p99_queue_delay_s: f64,
    pub max_queue_delay_s: f64,
    pub mean_jct_s: f64,
    pub p99_jct_s: f64,
    pub gpu_utilization: f64,
    pub unallocatable_share: f64,
    pub idle_while_pending_share: f64,
    pub makespan_s: f64,
    pub passes: u64,
    pub refused_placements: usize,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refusals: Vec<String>,
    pub wall_s: f64,
    /// (seconds since the first arrival, allocated milli, unallocatable milli) from each pass
    /// that changed them; piecewise constant until the next point.
    #[serde(skip)]
    pub series: Vec<(f64, u64, u64)>,
    #[serde(skip)]
    pub capacity_milli: u64,
    #[serde(skip)]
    pub end_s: f64,
}

impl RunResult {
    /// Time-weighted means of utilization and unallocatable share in `bins` equal windows.
    pub fn binned(&self, bins: usize) -> Vec<(f64, f64, f64)> {
        let cap = self.capacity_milli.max(1) as f64;
        let end = self.end_s.max(1e-9);
        let width = end / bins as f64;
        let mut out = vec![(0.0, 0.0, 0.0); bins];
        for (i, w) in self.series.iter().enumerate() {
            let stop = self.series.get(i + 1).map_or(end, |n| n.0);
            let (mut a, b) = (w.0, stop);
            while a < b {
                let k = ((a / width) as usize).min(bins - 1);
                let edge = ((k + 1) as f64 * width).min(b).max(a + 1e-9);
                let dt = edge.min(b) - a;
                out[k].1 += w.1 as f64 / cap * dt / width;
                out[k].2 += w.2 as f64 / cap * dt / width;
                a = edge;
            }
        }
        for (k, o) in out.iter_mut().enumerate() {
            o.0 = (k as f64 + 0.5) * width;
        }
        out
    }
}

pub fn policy_name(p: &ScorePolicy) -> &'static str {
    match p {
        ScorePolicy::Fgd => "fgd",
        ScorePolicy::FgdLookahead => "fgd-la",
        ScorePolicy::FgdHorizon => "fgd-h",
        ScorePolicy::BestFit => "best-fit",
        ScorePolicy::RandomFit { .. } => "random-fit",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    /// Every task of `job` exits; ignored unless `run` is still the job's current run.
    End {
        job: JobId,
        run: u32,
        kind: EndKind,
    },
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum EndKind {
    Succeeded,
    TimedOut,
    Stopped,
}

#[derive(Debug, Clone, Default)]
struct JobRecord {
    trace: usize,
    submitted: Timestamp,
    run: u32,
    /// When the current run ends if nothing stops it.
    natural_end: Timestamp,
    /// When the current run started.
    started: Timestamp,
    /// Work done by earlier runs that were stopped (counted only with `RunConfig::resume`).
    done_ms: u64,
    delay_ms: u64,
    placed: bool,
    ended: Option<Timestamp>,
}

struct Sim<'a> {
    driver: Driver,
    jobs: &'a [TraceJob],
    cfg: &'a RunConfig,
    events: BinaryHeap<Reverse<(Timestamp, u64, Event)>>,
    seq: u64,
    records: HashMap<JobId, JobRecord>,
    by_trace: Vec<Option<JobId>>,
    next_tick: Option<Timestamp>,
    /// Events other than ticks still queued.
    live: usize,
    out: RunResult,
}

impl Sim<'_> {
    fn push(&mut self, at: Timestamp, ev: Event) {
        if ev != Event::Tick {
            self.live += 1;
        }
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, ev)));
    }

    fn apply(&mut self, c: &Command) -> Outcome {
        self.driver.apply(c)
    }

    fn handle(&mut self, now: Timestamp, ev: Event) -> anyhow::Result<()> {
        match ev {
            Event::Arrive(i) => {
                let t = &self.jobs[i];
                let mut spec = t.spec.clone();
                if let Some(dep) = t.after.and_then(|a| self.by_trace[a]) {
                    spec.dependencies = vec![Dependency {
                        kind: DependencyKind::AfterAny,
                        job: dep,
                    }];
                }
                match self.apply(&Command::submit(spec, None)) {
                    Outcome::JobSubmitted { id, .. } => {
                        self.by_trace[i] = Some(id);
                        self.records.insert(
                            id,
                            JobRecord {
                                trace: i,
                                submitted: now,
                                ..JobRecord::default()
                            },
                        );
                    }
                    _ => self.out.rejected_submissions += 1,
                }
            }
            Event::End { job, run, kind } => {
                if self.records.get(&job).is_none_or(|r| r.run != run) {
                    return Ok(());
                }
                let outcome = match kind {
                    EndKind::Succeeded => TaskOutcome::Succeeded,
                    EndKind::TimedOut => TaskOutcome::TimedOut,
                    EndKind::Stopped => TaskOutcome::Stopped,
                };
                let allocs = self.driver.state.jobs[&job].allocations.clone();
                for allocation in allocs {
                    let o = self.apply(&Command::AllocationExited {
                        allocation,
                        outcome: outcome.clone(),
                        usage: None,
                    });
                    anyhow::ensure!(o == Outcome::Done, "exit of allocation {allocation}: {o:?}");
                }
                let state = self.driver.state.jobs[&job].state;
                let resume = self.cfg.resume;
                let rec = self.records.get_mut(&job).expect("record");
                rec.run += 1;
                if kind == EndKind::Stopped && resume {
                    rec.done_ms += now.saturating_sub(rec.started);
                }
                if state.is_final() {
                    rec.ended = Some(now);
                }
            }
            Event::Tick => {}
        }
        Ok(())
    }

    /// A running job was asked to stop: it exits a grace period later (or at its natural end,
    /// if sooner) and is requeued.
    fn stopping(&mut self, job: JobId, now: Timestamp) {
        let Some(rec) = self.records.get_mut(&job) else {
            return;
        };
        rec.run += 1;
        let run = rec.run;
        let at = now + self.cfg.grace_ms.min(rec.natural_end.saturating_sub(now));
        self.out.preemptions += 1;
        self.push(
            at,
            Event::End {
                job,
                run,
                kind: EndKind::Stopped,
            },
        );
    }

    fn pass(&mut self, now: Timestamp) -> anyhow::Result<()> {
        self.out.passes += 1;
        let placements = match &self.cfg.scheduler {
            Scheduler::Ours(policy) => {
                let plan = plan_with(&self.driver.state, now, policy);
                for p in plan.preemptions {
                    let o = self.apply(&Command::Preempt {
                        for_job: p.for_job,
                        victims: p.victims,
                        reason: String::new(),
                    });
                    if let Outcome::Preempted { accepted, .. } = o {
                        for v in accepted {
                            self.stopping(v, now);
                        }
                    }
                }
                plan.placements
            }
            Scheduler::Las(cfg) => {
                let plan = las::plan(&self.driver.state, now, cfg);
                if !plan.stop.is_empty() {
                    let o = self.apply(&Command::ChangeJobs {
                        jobs: plan.stop,
                        change: JobChange::Requeue {
                            reason: "a job of a higher queue waits".into(),
                        },
                    });
                    let Outcome::JobsChanged { changed, refused } = o else {
                        anyhow::bail!("requeue of the baseline's victims: {o:?}");
                    };
                    anyhow::ensure!(
                        refused.is_empty(),
                        "requeue of the baseline's victims refused: {refused:?}"
                    );
                    for v in changed {
                        self.stopping(v, now);
                    }
                }
                plan.placements
            }
        };
        if placements.is_empty() {
            return Ok(());
        }
        let eligible: HashMap<JobId, Timestamp> = placements
            .iter()
            .filter_map(|p| {
                let j = self.driver.state.jobs.get(&p.job)?;
                Some((p.job, eligible_since(&self.driver.state, j)))
            })
            .collect();
        let o = self.apply(&Command::Place {
            term: 1,
            placements,
        });
        let Outcome::Placed { accepted, rejected } = o else {
            anyhow::bail!("place: {o:?}");
        };
        self.out.refused_placements += rejected.len();
        for (job, why) in rejected
            .into_iter()
            .take(5 - self.out.refusals.len().min(5))
        {
            self.out.refusals.push(format!("t={now} job {job}: {why}"));
        }
        for job in accepted {
            self.out.placements += 1;
            for allocation in self.driver.state.jobs[&job].allocations.clone() {
                let o = self.apply(&Command::AllocationStarted { allocation });
                anyhow::ensure!(
                    o == Outcome::Done,
                    "start of allocation {allocation}: {o:?}"
                );
            }
            let rec = self.records.get_mut(&job).expect("placed job has a record");
            let t = &self.jobs[rec.trace];
            rec.delay_ms += now.saturating_sub(eligible.get(&job).copied().unwrap_or(now));
            rec.placed = true;
            rec.run += 1;
            rec.started = now;
            // What is left of its work, cut at its time limit (which counts per run).
            let left = t.duration_ms.saturating_sub(rec.done_ms);
            let run_ms = match t.spec.time_limit_secs {
                Some(l) => left.min(l * 1000),
                None => left,
            };
            rec.natural_end = now + run_ms;
            let (run, at) = (rec.run, rec.natural_end);
            let kind = if run_ms < left {
                EndKind::TimedOut
            } else {
                EndKind::Succeeded
            };
            self.push(at, Event::End { job, run, kind });
        }
        Ok(())
    }

    /// Schedules a pass for the next moment a pending job's aging level rises (or the next
    /// periodic tick), unless one is already due by then.
    fn schedule_tick(&mut self, now: Timestamp) {
        let state = &self.driver.state;
        // Only the real scheduler ages jobs; the baseline changes its mind only at events.
        let step = match &self.cfg.scheduler {
            Scheduler::Ours(policy) => policy.aging_step_ms,
            Scheduler::Las(_) => 0,
        };
        let mut next: Option<Timestamp> = None;
        if step > 0 {
            for job in state.pending_jobs() {
                if !dependencies_met(state, job) {
                    continue;
                }
                let since = eligible_since(state, job);
                if level(job, since, now, step) >= AGED_LEVEL {
                    continue;
                }
                let at = since + (now.saturating_sub(since) / step + 1) * step;
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        if self.cfg.tick_ms > 0
            && !self.events.is_empty()
            && state.index.pending.iter().next().is_some()
        {
            let at = now + self.cfg.tick_ms;
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        if let Some(at) = next
            && self.next_tick.is_none_or(|t| t <= now || at < t)
        {
            self.next_tick = Some(at);
            self.push(at, Event::Tick);
        }
    }
}

/// GPU capacity (milli), the unallocatable free capacity (see the module docs) and all free
/// capacity, and whether any eligible job is pending.
fn gpu_accounting(state: &ClusterState) -> (u64, u64, u64, bool) {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    struct TaskShape<'a> {
        gpus: u32,
        milli: u32,
        cpu: u64,
        mem: u64,
        models: &'a [String],
    }
    let shapes: BTreeSet<TaskShape> = state
        .pending_jobs()
        .filter(|j| j.spec.mig_profile.is_none() && dependencies_met(state, j))
        .map(|j| TaskShape {
            gpus: j.spec.gpus_per_task,
            milli: j.spec.gpu_milli,
            cpu: j.spec.cpu_milli_per_task,
            mem: j.spec.memory_mib_per_task,
            models: &j.spec.gpu_models,
        })
        .collect();
    let (mut capacity, mut unallocatable, mut free) = (0, 0, 0);
    for node in state.nodes.values() {
        let usable = node.status == NodeStatus::Ready && !node.drained;
        let gpus: Vec<_> = node
            .spec
            .gpus
            .iter()
            .filter(|g| g.mig.is_empty() && g.health == crate::state::GpuHealth::Healthy)
            .collect();
        capacity += gpus.len() as u64 * MILLI_PER_GPU;
        if !usable {
            continue;
        }
        // (model, free milli) of each GPU.
        let free_gpus: Vec<(&str, u64)> = gpus
            .iter()
            .map(|g| {
                let f = if state.gpu_holder.contains_key(&g.uuid) {
                    0
                } else {
                    MILLI_PER_GPU - u64::from(state.shared_milli(&g.uuid))
                };
                (g.model.as_str(), f)
            })
            .collect();
        let node_free: u64 = free_gpus.iter().map(|g| g.1).sum();
        free += node_free;
        if node_free == 0 || shapes.is_empty() {
            continue;
        }
        let (cpu, mem) = state.node_usage(&node.spec.name);
        let (cpu_left, mem_left) = (
            node.spec.cpu_milli.saturating_sub(cpu),
            node.spec.memory_mib.saturating_sub(mem),
        );
        let fits = shapes.iter().any(|s| {
            if s.cpu > cpu_left || s.mem > mem_left {
                return false;
            }
            let model_ok = |m: &str| s.models.is_empty() || s.models.iter().any(|x| x == m);
            if s.gpus == 0 {
                true
            } else if s.milli > 0 {
                free_gpus
                    .iter()
                    .any(|&(m, f)| model_ok(m) && f >= u64::from(s.milli))
            } else {
                free_gpus
                    .iter()
                    .filter(|&&(m, f)| model_ok(m) && f == MILLI_PER_GPU)
                    .count()
                    >= s.gpus as usize
            }
        });
        if !fits {
            unallocatable += node_free;
        }
    }
    (capacity, unallocatable, free, !shapes.is_empty())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Replays `jobs` (sorted by arrival) on a copy of `base` (nodes and tenants registered).
pub fn run(base: &ClusterState, jobs: &[TraceJob], cfg: &RunConfig) -> anyhow::Result<RunResult> {
    let started = std::time::Instant::now();
    let first = jobs.first().map_or(0, |j| j.arrival_ms);
    let mut driver = Driver::new(EPOCH_MS + first);
    driver.state = base.clone();
    driver.index = 1_000_000;
    let (backfill, policy, preemption) = match &cfg.scheduler {
        Scheduler::Ours(p) => (p.backfill, policy_name(&p.scoring), p.preemption),
        Scheduler::Las(l) => {
            // The baseline stops its victims with a requeue (`ChangeJobs`, format 2).
            let o = driver.apply(&Command::SetClusterVersion { version: 2 });
            anyhow::ensure!(o == Outcome::Done, "raising the cluster version: {o:?}");
            (false, "las", l.preemption)
        }
    };
    let mut sim = Sim {
        driver,
        jobs,
        cfg,
        events: BinaryHeap::new(),
        seq: 0,
        records: HashMap::new(),
        by_trace: vec![None; jobs.len()],
        next_tick: None,
        live: 0,
        out: RunResult {
            label: cfg.label.clone(),
            backfill,
            policy: policy.into(),
            preemption,
            jobs: jobs.len(),
            ..RunResult::default()
        },
    };
    for (i, j) in jobs.iter().enumerate() {
        sim.push(EPOCH_MS + j.arrival_ms, Event::Arrive(i));
    }
    let t0 = EPOCH_MS + first;
    let mut last = t0;
    let (mut alloc, mut unalloc, mut idle_pending) = (0u64, 0u64, 0u64);
    let (mut alloc_int, mut unalloc_int, mut idle_int) = (0f64, 0f64, 0f64);
    let mut capacity = 0;
    while let Some(Reverse((now, _, _))) = sim.events.peek().copied() {
        // Only ticks left and nothing running: no pass can change anything any more.
        if sim.live == 0 && sim.driver.state.allocations.is_empty() {
            break;
        }
        let dt = (now - last) as f64;
        alloc_int += alloc as f64 * dt;
        unalloc_int += unalloc as f64 * dt;
        idle_int += idle_pending as f64 * dt;
        last = now;
        sim.driver.now = now;
        while let Some(Reverse((at, _, ev))) = sim.events.peek().copied()
            && at == now
        {
            sim.events.pop();
            if ev != Event::Tick {
                sim.live -= 1;
            }
            sim.handle(now, ev)?;
        }
        sim.pass(now)?;
        sim.schedule_tick(now);
        let (cap, u, free, pending) = gpu_accounting(&sim.driver.state);
        capacity = cap;
        let a: u64 = sim.driver.state.index.tenant_held_milli.values().sum();
        idle_pending = if pending { free } else { 0 };
        if sim.out.series.last().is_none_or(|s| s.1 != a || s.2 != u) {
            sim.out.series.push(((now - t0) as f64 / 1000.0, a, u));
        }
        (alloc, unalloc) = (a, u);
    }
    let mut out = sim.out;
    let span = (last - t0) as f64;
    out.capacity_milli = capacity;
    out.end_s = span / 1000.0;
    out.makespan_s = span / 1000.0;
    if span > 0.0 && capacity > 0 {
        let denom = span * capacity as f64;
        out.gpu_utilization = alloc_int / denom;
        out.unallocatable_share = unalloc_int / denom;
        out.idle_while_pending_share = idle_int / denom;
    }
    let mut delays = Vec::new();
    let mut jcts = Vec::new();
    for (id, rec) in &sim.records {
        match sim.driver.state.jobs[id].state {
            JobState::Succeeded => out.completed += 1,
            JobState::TimedOut => out.timed_out += 1,
            JobState::Failed | JobState::Cancelled => out.failed += 1,
            _ => out.unfinished += 1,
        }
        if rec.placed {
            delays.push(rec.delay_ms as f64 / 1000.0);
        }
        if let Some(end) = rec.ended {
            jcts.push((end - rec.submitted) as f64 / 1000.0);
        }
    }
    delays.sort_by(f64::total_cmp);
    jcts.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    out.mean_queue_delay_s = mean(&delays);
    out.p50_queue_delay_s = percentile(&delays, 0.5);
    out.p99_queue_delay_s = percentile(&delays, 0.99);
    out.max_queue_delay_s = delays.last().copied().unwrap_or(0.0);
    out.mean_jct_s = mean(&jcts);
    out.p99_jct_s = percentile(&jcts, 0.99);
    out.wall_s = started.elapsed().as_secs_f64();
    Ok(out)
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::sim::workload;
    use crate::state::{JobSpec, Tenant};

    /// `nodes` plain nodes of `gpus` GPUs each and one tenant `t`.
    fn cluster(nodes: usize, gpus: u32) -> ClusterState {
        let mut d = Driver::new(EPOCH_MS);
        for n in 0..nodes {
            let spec = crate::sim::test_fleet::plain_node(&format!("n{n}"), gpus);
            assert_eq!(
                d.apply(&Command::RegisterNode { spec }),
                Outcome::NodeRegistered
            );
        }
        d.apply(&Command::PutTenant {
            tenant: Tenant {
                name: "t".into(),
                weight: 1,
                quota_gpus: 0,
                max_gpus: 0,
            },
        });
        d.state
    }

    fn job(gpus: u32, arrival_s: u64, duration_s: u64, limit_s: u64) -> TraceJob {
        TraceJob {
            spec: JobSpec {
                tenant: "t".into(),
                name: "j".into(),
                command: vec!["x".into()],
                gpus_per_task: gpus,
                tasks: 1,
                priority_class: "normal".into(),
                time_limit_secs: Some(limit_s),
                cpu_milli_per_task: 1000,
                memory_mib_per_task: 1024,
                ..JobSpec::default()
            },
            arrival_ms: arrival_s * 1000,
            duration_ms: duration_s * 1000,
            after: None,
        }
    }

    fn cfg(backfill: bool) -> RunConfig {
        RunConfig {
            label: String::new(),
            scheduler: Scheduler::Ours(Policy {
                backfill,
                ..Policy::default()
            }),
            grace_ms: 30_000,
            tick_ms: 0,
            resume: false,
        }
    }

    #[test]
    fn hand_computed_delays_and_completion_times() {
        // One node, 4 GPUs. A: 4 GPUs at 0 for 100 s. B: 2 GPUs at 10 s for 50 s, waits for A
        // (delay 90, ends 150, JCT 140). C: 2 GPUs at 20 s, 30 s of work but a 20 s limit:
        // starts at 100 (delay 80), times out at 120 (JCT 100). D: 4 GPUs at 30 s after C
        // (afterany), 10 s: eligible at 120, starts when B ends at 150 (delay 30), ends 160
        // (JCT 130).
        let mut jobs = vec![
            job(4, 0, 100, 200),
            job(2, 10, 50, 100),
            job(2, 20, 30, 20),
            job(4, 30, 10, 100),
        ];
        jobs[3].after = Some(2);
        let r = run(&cluster(1, 4), &jobs, &cfg(true)).unwrap();
        assert_eq!(r.refused_placements, 0, "{:?}", r.refusals);
        assert_eq!((r.completed, r.timed_out, r.unfinished), (3, 1, 0));
        assert_eq!(r.mean_queue_delay_s, (0.0 + 90.0 + 80.0 + 30.0) / 4.0);
        assert_eq!(r.max_queue_delay_s, 90.0);
        assert_eq!(r.mean_jct_s, (100.0 + 140.0 + 100.0 + 130.0) / 4.0);
        assert_eq!(r.makespan_s, 160.0);
        // GPU-seconds: 400 + 100 + 40 + 40 = 580 of 4 × 160.
        assert!(
            (r.gpu_utilization - 580.0 / 640.0).abs() < 1e-9,
            "{}",
            r.gpu_utilization
        );
        // 120..150: B holds 2 GPUs, D (4 GPUs) waits, 2 free GPUs fit nothing pending.
        assert!(
            (r.unallocatable_share - 2.0 * 30.0 / 640.0).abs() < 1e-9,
            "{}",
            r.unallocatable_share
        );
    }

    #[test]
    fn backfill_lets_short_jobs_past_a_blocked_head() {
        // Two 4-GPU nodes. Long jobs hold 6 GPUs; a 2×4-GPU gang (the head) waits for them;
        // short 1-GPU jobs behind the head fit in the 2 free GPUs and end before they do.
        let mut head = job(4, 1, 100, 200);
        head.spec.tasks = 2;
        let mut jobs = vec![job(4, 0, 1000, 2000), job(2, 0, 1000, 2000), head];
        for i in 0..6 {
            jobs.push(job(1, 2 + i, 60, 120));
        }
        let on = run(&cluster(2, 4), &jobs, &cfg(true)).unwrap();
        let off = run(&cluster(2, 4), &jobs, &cfg(false)).unwrap();
        assert_eq!(on.refused_placements + off.refused_placements, 0);
        assert_eq!(on.rejected_submissions + off.rejected_submissions, 0);
        assert!(
            on.mean_queue_delay_s < off.mean_queue_delay_s,
            "on {} off {}",
            on.mean_queue_delay_s,
            off.mean_queue_delay_s
        );
        assert_eq!(on.unfinished + off.unfinished, 0);
    }

    fn small_synthetic(seed: u64) -> (ClusterState, Vec<TraceJob>) {
        let mut d = Driver::new(EPOCH_MS);
        crate::synthetic::fleet(&mut d, 4).unwrap();
        (d.state, workload::synthetic(150, 32, 0.9, seed))
    }

    #[test]
    fn small_synthetic_run_has_no_refused_placements_and_is_deterministic() {
        let (base, jobs) = small_synthetic(3);
        let a = run(&base, &jobs, &cfg(true)).unwrap();
        assert_eq!(a.refused_placements, 0, "{:?}", a.refusals);
        assert_eq!(a.rejected_submissions, 0);
        assert_eq!(a.unfinished, 0);
        assert!(a.timed_out > 0 && a.completed > 0);
        assert!(a.gpu_utilization > 0.2 && a.gpu_utilization <= 1.0);
        let b = run(&base, &jobs, &cfg(true)).unwrap();
        let strip = |mut r: RunResult| {
            r.wall_s = 0.0;
            serde_json::to_string(&r).unwrap()
        };
        assert_eq!(strip(a), strip(b));
    }
}
