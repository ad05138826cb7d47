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
    // (What the preemption search asks of the job, its priority and tenant, is left to it:
    // those are strings on the heap, and it asks only of the few preemptible jobs.)
    let owners = owners(state);
    let mut run = 0;
    let mut previous_job: Option<JobId> = None;
    // Consecutive allocations often share their node (work placed together): compare with
    // the last one's name before hashing.
    let mut last_node: Option<(&str, Option<NodeIdx>)> = None;
    for rec in state.allocations.values() {
        let id = rec.allocation.job;
        if previous_job.is_some_and(|p| p != id) {
            run += 1;
        }
        previous_job = Some(id);
        let Some(job) = owners[run] else {
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

/// Most jobs stepped over in the job map before seeking instead.
const MAX_STEPS: usize = 32;

/// The job of each run of allocations of one job (allocations in id order; a job's
/// allocations are usually adjacent, so it is looked up once), or None where the job is gone.
/// Looking up tens of thousands of jobs one by one in a map of a hundred thousand was a search
/// from the root each: the runs are sorted by job and the map is walked in step instead,
/// seeking only across long gaps.
fn owners(state: &ClusterState) -> Vec<Option<&Job>> {
    // (job, run), one per run.
    let mut runs: Vec<(JobId, u32)> = Vec::with_capacity(state.allocations.len());
    for rec in state.allocations.values() {
        let id = rec.allocation.job;
        if runs.last().is_none_or(|&(last, _)| last != id) {
            runs.push((id, runs.len() as u32));
        }
    }
    let mut owners: Vec<Option<&Job>> = vec![None; runs.len()];
    sort_by_job(&mut runs);
    let Some(&(first, _)) = runs.first() else {
        return owners;
    };
    let mut walk = state.jobs.range(first..);
    let mut at = walk.next();
    for (id, run) in runs {
        let mut steps = 0;
        while let Some((&k, _)) = at
            && k < id
        {
            if steps == MAX_STEPS {
                walk = state.jobs.range(id..);
                at = walk.next();
                break;
            }
            at = walk.next();
            steps += 1;
        }
        owners[run as usize] = at
            .filter(|(k, _)| **k == id)
            .map(|(_, job)| job)
            .filter(|job| job.id == id);
    }
    owners
}

/// Sorts (job, run) pairs by job, keeping runs of one job in order: a radix sort of the ids'
/// offsets from the smallest, `DIGIT` bits a pass. Job ids of one cluster's running work span a
/// range of at most some millions, and a comparison sort of tens of thousands of them cost
/// more than the map lookups it saves; wider spans fall back to one.
fn sort_by_job(runs: &mut Vec<(JobId, u32)>) {
    const DIGIT: u32 = 11;
    const MAX_PASSES: u32 = 3;
    let Some(min) = runs.iter().map(|r| r.0).min() else {
        return;
    };
    let span = runs.iter().map(|r| r.0 - min).max().unwrap_or(0);
    if span >> (DIGIT * MAX_PASSES) != 0 {
        runs.sort_unstable();
        return;
    }
    let mask = (1u64 << DIGIT) - 1;
    let mut sorted = vec![(0, 0); runs.len()];
    let mut shift = 0;
    loop {
        let mut start = vec![0u32; (1 << DIGIT) + 1];
        for &(id, _) in runs.iter() {
            start[(((id - min) >> shift) & mask) as usize + 1] += 1;
        }
        for d in 0..1 << DIGIT {
            start[d + 1] += start[d];
        }
        for &r in runs.iter() {
            let at = &mut start[(((r.0 - min) >> shift) & mask) as usize];
            sorted[*at as usize] = r;
            *at += 1;
        }
        std::mem::swap(runs, &mut sorted);
        shift += DIGIT;
        if span >> shift == 0 {
            break;
        }
    }
}
