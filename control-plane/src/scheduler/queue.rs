//! Queue order: priority classes, aging, fair share across tenants, submission order.
//!
//! - A job's level is its priority class (low 0, normal 1, high 2) raised by one for every
//!   `aging_step` it has been eligible to run (submitted, dependencies met), up to level 3, which
//!   only aging reaches. Level 3 is served first and strictly first-come-first-served, so a job
//!   that has waited `3 × aging_step` (a low job; less for others) can no longer be overtaken by
//!   new work of any class: with the backfill reservation for the head job, its wait is bounded.
//! - Within levels 0–2, tenants take turns by fair share: the tenant with the least decayed
//!   GPU-seconds per unit of weight goes next (usage of finished allocations, decayed with a
//!   24 h half-life, plus what running allocations have used so far, plus an estimate for what
//!   this pass has already given it), then submission order within the tenant.
//!
//! - A replica of a service below its minimum replicas is queued one level above its class
//!   (at most level 2), ahead of batch work of its own class.
//!
//! Pure: the order depends only on the state and `now`, so a new leader serves the same queue
//! in the same order (invariant 4).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use super::fleet::FastMap;
use crate::state::{
    ClusterState, Dependency, DependencyKind, Job, JobId, JobState, MILLI_PER_GPU, Timestamp,
    YIELD_LIMIT_MS, priority_rank,
};

/// The level only aging reaches; served first, in eligibility order.
pub const AGED_LEVEL: u8 = 3;

/// Whether a pending job's dependencies allow it to start now.
pub fn dependencies_met(state: &ClusterState, job: &Job) -> bool {
    job.spec
        .dependencies
        .iter()
        .all(|d| dependency_met(state, d))
}

/// Whether the job's own request lets it start at `now`: not held, and past its begin time.
pub fn eligible(job: &Job, now: Timestamp) -> bool {
    !job.held && job.spec.begin_at.is_none_or(|b| b <= now)
}

/// Whether one dependency is met.
pub fn dependency_met(state: &ClusterState, d: &Dependency) -> bool {
    // Archived jobs answer too: a new job may depend on one that finished long ago.
    let Some((dep, _)) = state.job_outcome(d.job) else {
        return false;
    };
    match d.kind {
        DependencyKind::AfterOk => dep == JobState::Succeeded,
        DependencyKind::AfterAny => dep.is_final(),
        DependencyKind::AfterNotOk => dep.is_final() && dep != JobState::Succeeded,
    }
}

/// Whether a preempted job still stands aside for the job it was stopped for: that job is
/// still pending (not placed, not gone), is not itself standing aside for another, and the
/// victim has waited less than `YIELD_LIMIT_MS` since its requeue. Without this, the first
/// victim to exit would be placed straight back on the GPUs it freed while the others still
/// stop, and be preempted again, for ever. The second condition breaks cycles: two jobs that
/// preempted each other (one by priority, one reclaiming its quota) must not wait on each
/// other.
pub fn yielding(state: &ClusterState, job: &Job, now: Timestamp) -> bool {
    let pending = |id: Option<JobId>| {
        id.and_then(|id| state.jobs.get(&id))
            .filter(|j| j.state == JobState::Pending)
    };
    let Some(preemptor) = pending(job.yielded_to) else {
        return false;
    };
    // One level only: a preemptor that stands aside itself (its own preemptor still waits)
    // is not waited for.
    pending(preemptor.yielded_to).is_none()
        && now.saturating_sub(eligible_since(state, job)) < YIELD_LIMIT_MS
}

/// When the job became eligible: when it last entered the queue (submission, or a requeue —
/// a preempted job must not count the time it ran as waiting, or it would overtake the job
/// that preempted it), or the end of its last dependency, whichever is later.
pub fn eligible_since(state: &ClusterState, job: &Job) -> Timestamp {
    let queued = job
        .history
        .iter()
        .rev()
        .find(|h| h.state == JobState::Pending)
        .map_or(job.submitted_at, |h| h.at);
    job.spec
        .dependencies
        .iter()
        .filter_map(|d| state.job_outcome(d.job))
        .map(|(_, changed_at)| changed_at)
        .fold(queued, Timestamp::max)
}

/// A job's level at `now`: its class, raised by aging.
pub fn level(job: &Job, since: Timestamp, now: Timestamp, aging_step_ms: u64) -> u8 {
    let base = priority_rank(&job.spec.priority_class);
    let steps = now
        .saturating_sub(since)
        .checked_div(aging_step_ms)
        .unwrap_or(0);
    (u64::from(base) + steps).min(u64::from(AGED_LEVEL)) as u8
}

/// Totally ordered f64 for heaps (shares are finite and non-negative).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Share(f64);
impl Eq for Share {}
impl PartialOrd for Share {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Share {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// A tenant of the queued jobs, by its position among them in name order: ids compare as the
/// names do, and the pass looks its tenants' shares, weights and limits up by position instead
/// of comparing names (strings on the heap) for every job.
pub type TenantId = u32;

struct Level<'a> {
    /// Level 3: one FIFO by eligibility time.
    fifo: VecDeque<(&'a Job, TenantId)>,
    /// Levels 0–2: per-tenant FIFOs (by tenant id) and a heap of tenants by fair share.
    tenants: Vec<VecDeque<&'a Job>>,
    heap: BinaryHeap<Reverse<(Share, TenantId)>>,
}

/// The pending queue of one pass, served in order by `next`; `charge` tells it what a tenant
/// just received so the next turn goes to whoever is furthest below its share.
pub struct Queue<'a> {
    levels: Vec<Level<'a>>,
    /// GPU-seconds per unit of weight, per tenant.
    shares: Vec<f64>,
    weights: Vec<f64>,
    current: usize,
}

/// What a placement is expected to use, for fair share within one pass: its GPUs for its time
/// limit, or an hour without one.
pub fn expected_gpu_seconds(job: &Job) -> f64 {
    let secs = job.spec.time_limit_secs.unwrap_or(3600).min(3600) as f64;
    job.spec.total_gpu_milli() as f64 / MILLI_PER_GPU as f64 * secs
}

impl<'a> Queue<'a> {
    /// The pending jobs whose dependencies are met, at most `limit` of them (the oldest of each
    /// level first).
    pub fn build(
        state: &'a ClusterState,
        now: Timestamp,
        aging_step_ms: u64,
        limit: usize,
    ) -> Queue<'a> {
        let mut by_level: Vec<Vec<(Timestamp, &'a Job)>> =
            vec![Vec::new(); AGED_LEVEL as usize + 1];
        for job in state.pending_jobs() {
            if !eligible(job, now) || !dependencies_met(state, job) || yielding(state, job, now) {
                continue;
            }
            let since = eligible_since(state, job);
            let mut lvl = level(job, since, now, aging_step_ms);
            // A replica of a service below its minimum goes ahead of the batch work of its own
            // class (never past a higher class, nor into the aged level): an online service
            // that lost replicas is restored first, by preemption if it must.
            if lvl + 1 < AGED_LEVEL && job.replica.is_some() && state.service_below_minimum(job) {
                lvl += 1;
            }
            by_level[lvl as usize].push((since, job));
        }
        // Usage per tenant: decayed finished usage plus what running allocations used so far.
        let mut usage: BTreeMap<&'a str, f64> = BTreeMap::new();
        for (tenant, u) in &state.tenant_usage {
            usage.insert(tenant.as_str(), u.gpu_seconds_at(now));
        }
        for tenant in state.index.tenant_running.keys() {
            *usage.entry(tenant.as_str()).or_default() += state.running_gpu_seconds(tenant, now);
        }
        // The jobs each level keeps, highest level first, and their tenants: numbered as met,
        // then renumbered in name order.
        let mut kept: Vec<(usize, Vec<(Timestamp, &'a Job)>)> = Vec::new();
        let mut budget = limit;
        let mut first_seen: FastMap<&'a str, u32> = FastMap::default();
        let mut met: Vec<&'a str> = Vec::new();
        let mut seen_ids: Vec<Vec<u32>> = Vec::new();
        for (lvl, mut jobs) in by_level.into_iter().enumerate().rev() {
            if lvl == AGED_LEVEL as usize {
                jobs.sort_unstable_by_key(|(since, j)| (*since, j.id));
            } else {
                jobs.sort_unstable_by_key(|(_, j)| j.id);
            }
            jobs.truncate(budget);
            budget -= jobs.len();
            let mut ids = Vec::with_capacity(jobs.len());
            for (_, job) in &jobs {
                let tenant = job.spec.tenant.as_str();
                let id = *first_seen.entry(tenant).or_insert_with(|| {
                    met.push(tenant);
                    (met.len() - 1) as u32
                });
                ids.push(id);
            }
            seen_ids.push(ids);
            kept.push((lvl, jobs));
        }
        let mut by_name: Vec<u32> = (0..met.len() as u32).collect();
        by_name.sort_unstable_by_key(|&i| met[i as usize]);
        let mut id_of = vec![0 as TenantId; met.len()];
        for (id, &i) in by_name.iter().enumerate() {
            id_of[i as usize] = id as TenantId;
        }
        let names: Vec<&str> = by_name.iter().map(|&i| met[i as usize]).collect();
        let weights: Vec<f64> = names
            .iter()
            .map(|&tenant| {
                state
                    .tenants
                    .get(tenant)
                    .map_or(1.0, |t| f64::from(t.weight.max(1)))
            })
            .collect();
        let shares: Vec<f64> = names
            .iter()
            .zip(&weights)
            .map(|(&tenant, w)| usage.get(tenant).copied().unwrap_or(0.0) / w)
            .collect();
        let mut levels = Vec::with_capacity(kept.len());
        for ((lvl, jobs), ids) in kept.into_iter().zip(seen_ids) {
            let mut level = Level {
                fifo: VecDeque::new(),
                tenants: vec![VecDeque::new(); names.len()],
                heap: BinaryHeap::new(),
            };
            for ((_, job), seen) in jobs.into_iter().zip(ids) {
                let tenant = id_of[seen as usize];
                if lvl == AGED_LEVEL as usize {
                    level.fifo.push_back((job, tenant));
                } else {
                    level.tenants[tenant as usize].push_back(job);
                }
            }
            for (tenant, jobs) in level.tenants.iter().enumerate() {
                if !jobs.is_empty() {
                    level
                        .heap
                        .push(Reverse((Share(shares[tenant]), tenant as TenantId)));
                }
            }
            levels.push(level);
        }
        Queue {
            levels,
            shares,
            weights,
            current: 0,
        }
    }

    /// The next job to consider, or None when the queue is served.
    pub fn next_job(&mut self) -> Option<&'a Job> {
        self.next_with_tenant().map(|(job, _)| job)
    }

    /// The next job to consider and its tenant's id, or None when the queue is served.
    pub fn next_with_tenant(&mut self) -> Option<(&'a Job, TenantId)> {
        while let Some(level) = self.levels.get_mut(self.current) {
            if let Some(entry) = level.fifo.pop_front() {
                return Some(entry);
            }
            while let Some(Reverse((Share(s), tenant))) = level.heap.pop() {
                // Stale heap entry: the tenant was charged since it was pushed.
                let current = self.shares[tenant as usize];
                if s < current {
                    level.heap.push(Reverse((Share(current), tenant)));
                    continue;
                }
                let queue = &mut level.tenants[tenant as usize];
                let job = queue.pop_front();
                if !queue.is_empty() {
                    level.heap.push(Reverse((Share(current), tenant)));
                }
                if let Some(job) = job {
                    return Some((job, tenant));
                }
            }
            self.current += 1;
        }
        None
    }

    /// How many tenants the queued jobs have (ids are below this).
    pub fn tenants(&self) -> usize {
        self.shares.len()
    }

    /// A tenant received `gpu_seconds` of expected use in this pass.
    pub fn charge(&mut self, tenant: TenantId, gpu_seconds: f64) {
        let t = tenant as usize;
        self.shares[t] += gpu_seconds / self.weights[t];
    }
}
