//! The live allocations of one pass, each with its job and its node's index in the pass's
//! fleet. On a full cluster both the backfill reservation and the preemption search need every
//! running allocation; walking the state's maps (a job lookup per job, a name lookup per
//! allocation) is most of what they cost, so the walk is done once per pass and shared.

use super::fleet::{Fleet, NodeIdx};
use crate::state::{AllocationRecord, ClusterState, Job};

/// One live allocation.
#[derive(Debug, Clone, Copy)]
pub struct LiveAllocation<'s> {
    /// Its node's index in the fleet; None when the node is not in it (not ready).
    pub node: Option<NodeIdx>,
    pub rec: &'s AllocationRecord,
    pub job: &'s Job,
}

/// Every live allocation, in allocation id order.
pub fn live_allocations<'s>(state: &'s ClusterState, fleet: &Fleet) -> Vec<LiveAllocation<'s>> {
    let mut live = Vec::with_capacity(state.allocations.len());
    let mut owner: Option<&Job> = None;
    for rec in state.allocations.values() {
        // A job's allocations are usually adjacent: look it up once.
        if owner.is_none_or(|o| o.id != rec.allocation.job) {
            owner = state.jobs.get(&rec.allocation.job);
        }
        let Some(job) = owner.filter(|o| o.id == rec.allocation.job) else {
            continue;
        };
        let node = fleet.index_of.get(rec.allocation.node.as_str()).copied();
        live.push(LiveAllocation { node, rec, job });
    }
    live
}
