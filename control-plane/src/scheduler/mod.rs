//! Scheduling policy: pure code that looks at the cluster state and proposes a plan —
//! placements, preemptions, and the head job's backfill reservation. The leader proposes the
//! plan as Raft entries and `apply` re-checks every placement and victim against the state at
//! that point in the log, so a plan computed on a slightly stale view can never double-book a
//! GPU or break a quota.
//!
//! A pass is a pipeline of small steps, each in its own module:
//! - `queue`: which job next — priority classes raised by aging (a bounded wait for every job),
//!   fair share across tenants by decayed GPU-seconds and weight, then submission order;
//!   dependencies honoured.
//! - tenant limits: a job that would take its tenant past `max_gpus` waits (invariant 5).
//! - `fleet` + `placement`: where it goes — partition, GPU model, CPU, memory, whole GPUs, MIG
//!   slices or milli-GPU shares; among the nodes that fit, the placement that leaves the least
//!   fragmentation for the expected workload (`score`, `frag`: FGD, USENIX ATC '23); inside the
//!   node, the best-connected GPUs (`fit`). Gangs are all-or-nothing and prefer one rack.
//! - `backfill`: the first job that cannot start gets a reservation; later jobs start only if
//!   they cannot delay it.
//! - `preempt`: that job may evict the cheapest set of lower-priority preemptible jobs, or
//!   reclaim its tenant's guaranteed quota from borrowers.

mod backfill;
pub mod capacity;
mod fit;
pub mod fleet;
pub mod frag;
mod live;
pub mod placement;
mod preempt;
pub mod queue;
pub mod reasons;
pub mod score;

use serde::Serialize;

use crate::state::{
    ClusterState, Job, JobId, JobPlacement, MILLI_PER_GPU, TaskPlacement, Timestamp,
};
pub use backfill::{Reservation, end_if_started};
pub use fit::{best_gpu_set, link_rank, rank_matrix};
use fleet::{Fleet, NodeIdx};
use frag::Workload;
use placement::{Placer, Scorer, Shape, Units, unit_uuids};
pub use preempt::Preemption;
pub use queue::dependencies_met;
pub use reasons::{Board, ReasonLog, Why};
pub use score::ScorePolicy;

/// Settings of the policy. One place for every default.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// A pending job rises one priority level per step of eligible waiting.
    pub aging_step_ms: u64,
    /// Reserve for the head job and let later jobs start only if they do not delay it. Off:
    /// nothing behind a blocked head job starts (strict order).
    pub backfill: bool,
    /// The head job may evict lower-priority preemptible work or reclaim guaranteed quota.
    pub preemption: bool,
    /// How candidate nodes are scored.
    pub scoring: ScorePolicy,
    /// Most pending jobs one pass considers, so a pass stays cheap however long the queue.
    pub max_jobs_per_pass: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            aging_step_ms: 30 * 60 * 1000,
            backfill: true,
            preemption: true,
            scoring: ScorePolicy::FgdHorizon,
            max_jobs_per_pass: 10_000,
        }
    }
}

/// What one pass decided.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Plan {
    pub placements: Vec<JobPlacement>,
    pub preemptions: Vec<Preemption>,
    pub reservation: Option<Reservation>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.placements.is_empty() && self.preemptions.is_empty()
    }
}

/// A job placed now must end at least this long before a reservation starts to count as ending
/// before it (its allocation is created when the plan applies, a little after `now`).
const SHORT_JOB_MARGIN_MS: u64 = 1000;

/// One scheduling pass with the default policy.
pub fn plan(state: &ClusterState, now: Timestamp) -> Plan {
    plan_with(state, now, &Policy::default())
}

/// Where one pass spent its time, for the benchmark (microseconds per stage).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PassStats {
    pub queue_us: u64,
    pub fleet_us: u64,
    pub place_us: u64,
    pub reserve_us: u64,
    pub preempt_us: u64,
    pub jobs_considered: usize,
}

/// One scheduling pass.
pub fn plan_with(state: &ClusterState, now: Timestamp, policy: &Policy) -> Plan {
    plan_with_stats(state, now, policy).0
}

/// One scheduling pass, and where its time went.
pub fn plan_with_stats(state: &ClusterState, now: Timestamp, policy: &Policy) -> (Plan, PassStats) {
    let (plan, stats, _) = plan_explained(state, now, policy);
    (plan, stats)
}

/// One scheduling pass, where its time went, and why each job it looked at and left pending
/// is still pending (`reasons`: recorded as small values while the pass runs, put into words
/// only when someone asks).
pub fn plan_explained(
    state: &ClusterState,
    now: Timestamp,
    policy: &Policy,
) -> (Plan, PassStats, ReasonLog) {
    let mut reasons = ReasonLog::default();
    let mut stats = PassStats::default();
    let mut clock = std::time::Instant::now();
    let lap = |clock: &mut std::time::Instant| {
        let us = clock.elapsed().as_micros() as u64;
        *clock = std::time::Instant::now();
        us
    };
    let mut queue = queue::Queue::build(state, now, policy.aging_step_ms, policy.max_jobs_per_pass);
    stats.queue_us = lap(&mut clock);
    let workload = expected_workload(state);
    let scorer = Scorer {
        policy: policy.scoring.clone(),
        workload,
        fit_only: false,
    };
    let mut placer = Placer::new(Fleet::build(state), scorer);
    stats.fleet_us = lap(&mut clock);
    let mut plan = Plan::default();
    // Per tenant (by the queue's id): its GPU limit (milli), looked up once.
    let mut limits: Vec<Option<Option<u64>>> = vec![None; queue.tenants()];
    // GPU capacity (milli) each limited tenant holds, updated as this pass places its jobs.
    let mut held: Vec<Option<u64>> = vec![None; queue.tenants()];
    let mut head: Option<(&Job, Shape)> = None;
    let mut planned: Vec<(NodeIdx, Option<Timestamp>, Shape, Units)> = Vec::new();
    // Every live allocation with its job and node, walked once and shared by the reservation
    // and the preemption search.
    let mut live: Option<Vec<live::LiveAllocation>> = None;
    // Per shape and task count: whether no ready node could ever hold the job (asked only of
    // jobs that would become the head).
    let mut unfit: fleet::FastMap<(Shape, u32), bool> = fleet::FastMap::default();
    // Jobs of each array that hold allocations, counted on the first job of a limited array
    // the pass meets, and kept current as it places more.
    let mut array_running: Option<fleet::FastMap<JobId, u32>> = None;
    while let Some((job, tenant_id)) = queue.next_with_tenant() {
        stats.jobs_considered += 1;
        let array_limit = match (job.array_task, &job.spec.array) {
            (Some(task), Some(array)) if array.max_running > 0 => {
                Some((task.array_id, array.max_running))
            }
            _ => None,
        };
        if let Some((array, max)) = array_limit {
            let counts = array_running.get_or_insert_with(|| arrays_running(state));
            if counts.get(&array).copied().unwrap_or(0) >= max {
                reasons.jobs.push((job.id, Why::ArrayLimit { array, max }));
                continue;
            }
        }
        let t = tenant_id as usize;
        let limit = *limits[t].get_or_insert_with(|| {
            state
                .tenants
                .get(&job.spec.tenant)
                .map(|t| u64::from(t.max_gpus) * MILLI_PER_GPU)
                .filter(|m| *m > 0)
        });
        if let Some(limit) = limit {
            let h =
                *held[t].get_or_insert_with(|| state.gpu_milli_held_by_tenant(&job.spec.tenant));
            if h + job.spec.total_gpu_milli() > limit {
                reasons.jobs.push((
                    job.id,
                    Why::Quota {
                        held_milli: h,
                        max_gpus: (limit / MILLI_PER_GPU) as u32,
                    },
                ));
                continue;
            }
        }
        let shape = Shape::of(&job.spec);
        let end = end_if_started(job, now);
        let long = match &plan.reservation {
            Some(r) => end.is_none_or(|e| e + SHORT_JOB_MARGIN_MS > r.start_at),
            None => false,
        };
        match placer.place(&shape, job.spec.tasks, long) {
            Some(tasks) => {
                if limit.is_some() {
                    *held[t].get_or_insert(0) += job.spec.total_gpu_milli();
                }
                if let (Some((array, _)), Some(counts)) = (array_limit, array_running.as_mut()) {
                    *counts.entry(array).or_default() += 1;
                }
                queue.charge(tenant_id, queue::expected_gpu_seconds(job));
                let mut placed = Vec::with_capacity(tasks.len());
                for (idx, units) in tasks {
                    let node = placer.fleet.nodes[idx as usize].node;
                    placed.push(TaskPlacement {
                        node: node.spec.name.clone(),
                        gpus: unit_uuids(node, &units),
                    });
                    planned.push((idx, end, shape.clone(), units));
                }
                plan.placements.push(JobPlacement {
                    job: job.id,
                    tasks: placed,
                });
            }
            // A job with node rules does not become the head: the reservation and the
            // preemption search treat alike nodes as interchangeable, which its rules deny.
            None if shape.has_node_rules() => reasons.jobs.push((job.id, Why::NodeRules)),
            // A job no ready node could ever hold (held with `hold_if_unfit`, or waiting for
            // a node that is down) does not become the head: its reservation would never
            // start, and it would take the reservation from a job that can run.
            None if head.is_none() && never_fits_ready(&mut unfit, &placer, &shape, job) => {
                reasons.jobs.push((job.id, Why::Unfit));
            }
            None if head.is_none() => {
                reasons.jobs.push((job.id, Why::Resources));
                reasons.head = Some(job.id);
                // The head's tenant keeps room under its limit for it: later jobs of the same
                // tenant must not use it up, or the reservation would be void at its start.
                if limit.is_some() {
                    *held[t].get_or_insert(0) += job.spec.total_gpu_milli();
                }
                if !policy.backfill {
                    head = Some((job, shape));
                    break;
                }
                let started = std::time::Instant::now();
                let live =
                    live.get_or_insert_with(|| live::live_allocations(state, &placer.fleet, now));
                plan.reservation = backfill::reserve(&mut placer, job, &shape, now, &planned, live);
                stats.reserve_us = started.elapsed().as_micros() as u64;
                head = Some((job, shape));
            }
            None => {
                // Behind the head. Room for it now, kept only by the reservation, says
                // "Reservation"; otherwise it waits its turn ("Priority"). The extra question
                // is asked only of jobs that backfill turned away (`long`), and is answered
                // from a cache until the fleet changes.
                let head_id = head.as_ref().map_or(0, |(h, _)| h.id);
                let why = if long && placer.fits_ignoring_reservation(&shape) {
                    Why::Reservation { for_job: head_id }
                } else {
                    Why::Priority { behind: head_id }
                };
                reasons.jobs.push((job.id, why));
            }
        }
    }
    reasons.jobs_considered = stats.jobs_considered;
    stats.place_us = lap(&mut clock).saturating_sub(stats.reserve_us);
    if policy.preemption
        && let Some((job, shape)) = &head
        && let Some(p) = preempt::select(
            state,
            &placer,
            job,
            shape,
            now,
            live.get_or_insert_with(|| live::live_allocations(state, &placer.fleet, now)),
        )
    {
        plan.preemptions.push(p);
    }
    stats.preempt_us = lap(&mut clock);
    (plan, stats, reasons)
}

/// Per job array with a limit of running jobs, how many of its jobs hold allocations.
fn arrays_running(state: &ClusterState) -> fleet::FastMap<JobId, u32> {
    let mut counts = fleet::FastMap::default();
    for job in state.jobs_with_allocations() {
        if let (Some(task), Some(array)) = (job.array_task, &job.spec.array)
            && array.max_running > 0
        {
            *counts.entry(task.array_id).or_default() += 1;
        }
    }
    counts
}

/// Whether no ready node of the pass's fleet could ever hold every task of `job` (memoized per
/// shape and task count).
fn never_fits_ready(
    memo: &mut fleet::FastMap<(Shape, u32), bool>,
    placer: &Placer,
    shape: &Shape,
    job: &Job,
) -> bool {
    let key = (shape.clone(), job.spec.tasks);
    if let Some(&answer) = memo.get(&key) {
        return answer;
    }
    let nodes = placer.fleet.nodes.iter().map(|n| n.node);
    let answer = !placer.fleet.nodes.is_empty()
        && capacity::never_fits(nodes, shape, job.spec.tasks).is_some();
    memo.insert(key, answer);
    answer
}

/// The workload fragmentation is measured against: the shapes of pending work and of what
/// runs now (a sample of each, so the cost stays bounded on large clusters).
fn expected_workload(state: &ClusterState) -> Workload {
    const SAMPLE: usize = 2_000;
    let pending = state.pending_jobs().take(SAMPLE);
    let running = state.jobs_with_allocations().take(SAMPLE);
    let shapes: Vec<Shape> = pending
        .chain(running)
        .filter(|j| j.spec.mig_profile.is_none())
        .map(|j| Shape::of(&j.spec))
        .collect();
    Workload::from_demands(shapes.iter().map(Shape::scored_demand))
}

/// Free GPU capacity on ready nodes and the part of it the expected workload could not use
/// (the fragmentation placement minimises, `frag::fragmentation`), both in GPUs: the gauge
/// operators watch (`metrics`). Costs one fragmentation evaluation per ready node.
pub fn fleet_fragmentation(state: &ClusterState) -> (f64, f64) {
    let workload = expected_workload(state);
    let (mut free, mut fragmented) = (0u64, 0f64);
    for node in state.nodes.values() {
        if node.status != crate::state::NodeStatus::Ready || node.drained {
            continue;
        }
        let Some(f) = state.index.node_free.get(&node.spec.name) else {
            continue;
        };
        let res = score::NodeResources {
            cpu_milli: f.cpu_milli,
            memory_mib: f.memory_mib,
            model: node
                .spec
                .gpus
                .first()
                .map(|g| g.model.as_str())
                .unwrap_or(""),
            gpu_milli: &f.gpu_milli[..f.gpus as usize],
        };
        free += res.free_gpu_milli();
        fragmented += frag::fragmentation(&res, &workload);
    }
    let per_gpu = MILLI_PER_GPU as f64;
    (free as f64 / per_gpu, fragmented / per_gpu)
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod reasons_tests;
#[cfg(test)]
mod tests;
