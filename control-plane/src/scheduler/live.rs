//! The live allocations of one pass, each with its job, its node's index in the pass's fleet,
//! and the few facts about it that the backfill reservation and the preemption search ask of
//! every allocation. On a full cluster both need every running allocation; the records and
//! jobs are large and scattered in memory (and their strings are separate heap blocks), so
//! touching them is most of what those steps cost. The walk reads each record and job once
//! and keeps the answers in one compact array that both steps share.

use super::fleet::{FastMap, Fleet, NodeIdx};
use crate::state::{AllocationRecord, ClusterState, Job, JobId, MILLI_PER_GPU, Timestamp};

/// One live allocation.
#[derive(Debug, Clone, Copy)]
pub struct LiveAllocation<'s> {
    /// Its node's index in the fleet; None when the node is not in it (not ready).
    pub node: Option<NodeIdx>,
    pub rec: &'s AllocationRecord,
    pub job: &'s Job,
    /// Its job's id (the record's, copied so a scan needs not follow the pointer).
    pub job_id: JobId,
    /// When its resources come back as far as time limits tell: `now` for work being stopped,
    /// None for work without a time limit (assumed to run forever).
    pub ends_at: Option<Timestamp>,
    pub created_at: Timestamp,
    /// GPUs (or MIG slices) it holds.
    pub units: u32,
    /// Facts about its job, the same for all of the job's allocations.
    pub class: JobClass,
}

/// What the preemption search asks of a running job before the exact rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobClass {
    /// `priority_rank` of its priority class.
    pub rank: u8,
    pub preemptible: bool,
    /// Its tenant holds more GPU capacity than its quota guarantees (runs on borrowed room).
    pub tenant_borrowing: bool,
    /// The job is being stopped, or is final: it cannot be a victim.
    pub stopping: bool,
    /// The job it is being stopped for, when it was preempted.
    pub preempted_for: Option<JobId>,
}

impl JobClass {
    /// `borrowing` remembers each tenant's borrowing state: tenants are few, jobs many.
    fn of<'s>(
        state: &'s ClusterState,
        job: &'s Job,
        borrowing: &mut FastMap<&'s str, bool>,
    ) -> JobClass {
        let tenant = job.spec.tenant.as_str();
        let tenant_borrowing = *borrowing.entry(tenant).or_insert_with(|| {
            let held = state
                .index
                .tenant_held_milli
                .get(tenant)
                .copied()
                .unwrap_or(0);
            let quota = state
                .tenants
                .get(tenant)
                .map_or(0, |t| u64::from(t.quota_gpus) * MILLI_PER_GPU);
            held > quota
        });
        JobClass {
            rank: crate::state::priority_rank(&job.spec.priority_class),
            preemptible: job.spec.preemptible,
            tenant_borrowing,
            stopping: job.ending.is_some() || job.state.is_final(),
            preempted_for: job.ending.as_ref().and_then(|e| e.preempted_for),
        }
    }
}

/// Every live allocation, in allocation id order.
pub fn live_allocations<'s>(
    state: &'s ClusterState,
    fleet: &Fleet,
    now: Timestamp,
) -> Vec<LiveAllocation<'s>> {
    let mut live = Vec::with_capacity(state.allocations.len());
    // A job's allocations are usually adjacent: look it up, and classify it, once. Tenants
    // are few: their borrowing state is computed once each.
    let mut owner: Option<(&Job, JobClass)> = None;
    let mut borrowing = FastMap::default();
    // Consecutive allocations often share their node (work placed together): compare with
    // the last one's name before hashing.
    let mut last_node: Option<(&str, Option<NodeIdx>)> = None;
    for rec in state.allocations.values() {
        let id = rec.allocation.job;
        if owner.is_none_or(|(o, _)| o.id != id) {
            owner = state
                .jobs
                .get(&id)
                .map(|job| (job, JobClass::of(state, job, &mut borrowing)));
        }
        let Some((job, class)) = owner.filter(|(o, _)| o.id == id) else {
            continue;
        };
        let ends_at = if rec.stop_requested || job.ending.is_some() {
            Some(now)
        } else {
            job.spec.time_limit_secs.map(|s| {
                rec.allocation
                    .created_at
                    .saturating_add(s.saturating_mul(1000))
                    .max(now)
            })
        };
        let name = rec.allocation.node.as_str();
        let node = match last_node {
            Some((last, idx)) if last == name => idx,
            _ => {
                let idx = fleet.index_of.get(name);
                last_node = Some((name, idx));
                idx
            }
        };
        live.push(LiveAllocation {
            node,
            rec,
            job,
            job_id: id,
            ends_at,
            created_at: rec.allocation.created_at,
            units: rec.allocation.gpus.len() as u32,
            class,
        });
    }
    live
}
