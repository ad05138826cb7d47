//! The live allocations of one pass, each with its job, its node's index in the pass's fleet,
//! and the few facts about it that the backfill reservation and the preemption search ask of
//! every allocation. On a full cluster both need every running allocation; the records and
//! jobs are large and scattered in memory (and their strings are separate heap blocks), so
//! touching them is most of what those steps cost. The walk reads each record and job once
//! and keeps the answers in one compact array that both steps share.

use super::fleet::{Fleet, NodeIdx};
use crate::state::{AllocationRecord, ClusterState, Job, JobId, Timestamp};

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
    /// Facts about its job that the preemption search asks of every running job, read here
    /// while the job is in cache (plain fields, no strings):
    /// - the job is preemptible;
    pub preemptible: bool,
    /// - it is being stopped, or is final (it cannot be a victim);
    pub stopping: bool,
    /// - it is being stopped for some job's preemption.
    pub preempted: bool,
}

/// Every live allocation, in allocation id order.
pub fn live_allocations<'s>(
    state: &'s ClusterState,
    fleet: &Fleet,
    now: Timestamp,
) -> Vec<LiveAllocation<'s>> {
    let mut live = Vec::with_capacity(state.allocations.len());
    // A job's allocations are usually adjacent: look it up once. (What the preemption search
    // asks of the job, its priority and tenant, is left to it: those are strings on the heap,
    // and it asks only of the few preemptible jobs.)
    let mut owner: Option<&Job> = None;
    // Consecutive allocations often share their node (work placed together): compare with
    // the last one's name before hashing.
    let mut last_node: Option<(&str, Option<NodeIdx>)> = None;
    for rec in state.allocations.values() {
        let id = rec.allocation.job;
        if owner.is_none_or(|o| o.id != id) {
            owner = state.jobs.get(&id);
        }
        let Some(job) = owner.filter(|o| o.id == id) else {
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
            preemptible: job.spec.preemptible,
            stopping: job.ending.is_some() || job.state.is_final(),
            preempted: job
                .ending
                .as_ref()
                .is_some_and(|e| e.preempted_for.is_some()),
        });
    }
    live
}
