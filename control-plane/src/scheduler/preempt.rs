//! Preemption: the head job cannot start, so it evicts the cheapest set of jobs the rules let it
//! stop — lower-priority preemptible work, or work of tenants running on capacity borrowed
//! beyond their quota while the head's tenant is within its guarantee (the rules are
//! `ClusterState::check_preemption`, the same check apply makes). Cheapest means the fewest
//! GPU-seconds of work lost (GPU capacity × time since the victim started). Victims get the
//! agents' stop grace period and are requeued, never lost.

use std::collections::BTreeMap;

use serde::Serialize;

use super::fleet::{FastMap, NodeFree, NodeIdx};
use super::live::LiveAllocation;
use super::placement::{FitMemo, Placer, Scorer, Shape, evaluate_node, take};
use crate::state::{
    AllocationRecord, ClusterState, Job, JobId, MILLI_PER_GPU, Timestamp, priority_rank,
};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Preemption {
    pub for_job: JobId,
    pub victims: Vec<JobId>,
}

/// A candidate victim's number in one search (in the order met).
type Slot = u32;

/// Work lost if `victim`, whose first task started at `since`, is stopped now: milli-GPU ×
/// seconds since then.
fn cost(victim: &Job, since: Timestamp, now: Timestamp) -> u64 {
    victim.spec.total_gpu_milli().max(1) * (now.saturating_sub(since) / 1000 + 1)
}

/// Whether a tenant holds more GPU capacity than its quota guarantees.
fn tenant_borrowing(state: &ClusterState, tenant: &str) -> bool {
    let held = state.gpu_milli_held_by_tenant(tenant);
    let quota = state
        .tenants
        .get(tenant)
        .map_or(0, |t| u64::from(t.quota_gpus) * MILLI_PER_GPU);
    held > quota
}

/// Victims for `head`, or None when preemption cannot make room (or room is already being
/// made: victims chosen earlier are still stopping).
pub fn select(
    state: &ClusterState,
    placer: &Placer,
    head: &Job,
    shape: &Shape,
    now: Timestamp,
    live: &[LiveAllocation],
) -> Option<Preemption> {
    let fit_only = Scorer::fit_only();
    let mut memo = FitMemo::default();
    // Cheap prefilters before the exact rule (`check_preemption`) runs on each candidate:
    // lower-priority preemptible work, or work of a tenant that borrows beyond its quota while
    // the head's tenant is within its guarantee.
    let head_rank = priority_rank(&head.spec.priority_class);
    let reclaiming = state.tenants.get(&head.spec.tenant).is_some_and(|t| {
        state.gpu_milli_held_by_tenant(&t.name) + head.spec.total_gpu_milli()
            <= u64::from(t.quota_gpus) * MILLI_PER_GPU
    });
    // Candidates and their allocations per node, in one walk over the live allocations (a
    // job's allocations are usually adjacent, so its rules are checked once): on a full
    // cluster this walk is most of the pass.
    // Candidates are numbered as met (`Slot`); per candidate: its id, job, and when its first
    // task started.
    let mut candidates: Vec<(JobId, &Job, Timestamp)> = Vec::new();
    let mut slot_of: FastMap<JobId, Slot> = FastMap::default();
    // Indexed by node (dense); `with_victims` lists the nodes that have any.
    let mut victims_on: Vec<Vec<Slot>> = vec![Vec::new(); placer.fleet.nodes.len()];
    // Per node, the candidates' allocations there (so adding a victim needs no lookups).
    let mut allocs_on: Vec<Vec<(Slot, &AllocationRecord)>> =
        vec![Vec::new(); placer.fleet.nodes.len()];
    let mut with_victims: Vec<NodeIdx> = Vec::new();
    let mut last: Option<(JobId, Option<Slot>)> = None;
    let mut reclaim_allowed: FastMap<&str, bool> = FastMap::default();
    // Whether a tenant holds more GPU capacity than its quota guarantees (runs on borrowed
    // room): tenants are few, jobs many.
    let mut borrowing: FastMap<&str, bool> = FastMap::default();
    for a in live {
        let (rec, id, job) = (a.rec, a.job_id, a.job);
        let candidate = match last {
            Some((j, c)) if j == id => c,
            _ => {
                // Victims chosen for this job earlier are still stopping: wait.
                if a.preempted && job.ending.as_ref().and_then(|e| e.preempted_for) == Some(head.id)
                {
                    return None;
                }
                // Cheapest facts first (the walk copied them from the job): the priority and
                // the tenant are strings on the heap, and most running jobs are not
                // preemptible.
                let lower = a.preemptible && priority_rank(&job.spec.priority_class) < head_rank;
                let reclaimable = reclaiming
                    && !a.stopping
                    && *borrowing
                        .entry(job.spec.tenant.as_str())
                        .or_insert_with(|| tenant_borrowing(state, &job.spec.tenant));
                // The exact rule apply checks, on the few jobs the facts above leave. Its
                // reclaim branch depends only on the victim's tenant once the job itself is
                // live, so it is evaluated once per tenant: it looks tenants up by name, and a
                // full cluster has tens of thousands of running jobs.
                let allowed = id != head.id
                    && if lower {
                        state.check_preemption_of(head, a.job).is_ok()
                    } else if reclaimable && a.job.spec.tenant != head.spec.tenant {
                        *reclaim_allowed
                            .entry(a.job.spec.tenant.as_str())
                            .or_insert_with(|| state.check_preemption_of(head, a.job).is_ok())
                    } else {
                        false
                    };
                let c = allowed.then(|| {
                    *slot_of.entry(id).or_insert_with(|| {
                        candidates.push((id, a.job, a.created_at));
                        (candidates.len() - 1) as Slot
                    })
                });
                last = Some((id, c));
                c
            }
        };
        let Some(slot) = candidate else {
            continue;
        };
        let since = &mut candidates[slot as usize].2;
        *since = (*since).min(a.created_at);
        let Some(node) = a.node else { continue };
        allocs_on[node as usize].push((slot, rec));
        let list = &mut victims_on[node as usize];
        if list.is_empty() {
            with_victims.push(node);
        }
        if !list.contains(&slot) {
            list.push(slot);
        }
    }
    let costs: Vec<u64> = candidates
        .iter()
        .map(|&(_, job, since)| cost(job, since, now))
        .collect();
    if costs.is_empty() {
        return None;
    }
    for &idx in &with_victims {
        victims_on[idx as usize].sort_by_key(|&s| (costs[s as usize], candidates[s as usize].0));
    }
    let mut chosen: Vec<bool> = vec![false; candidates.len()];
    let mut chosen_ids: Vec<JobId> = Vec::new();
    // Free resources per node as the chosen victims' exits would leave them.
    let mut overlay: BTreeMap<NodeIdx, NodeFree> = BTreeMap::new();
    let free_of = |overlay: &BTreeMap<NodeIdx, NodeFree>, idx: NodeIdx| {
        overlay
            .get(&idx)
            .cloned()
            .unwrap_or_else(|| placer.fleet.nodes[idx as usize].free)
    };
    for _ in 0..head.spec.tasks {
        // The node where this task needs the cheapest extra victims. Nodes are visited by the
        // cost of their cheapest victim (a lower bound of what the node costs), so the search
        // stops as soon as no unvisited node can beat the best found.
        let mut order: Vec<(u64, NodeIdx)> = with_victims
            .iter()
            .map(|&idx| {
                // The lists are sorted by cost: the first one not chosen is the cheapest.
                let cheapest = victims_on[idx as usize]
                    .iter()
                    .find(|&&v| !chosen[v as usize])
                    .map_or(u64::MAX, |&v| costs[v as usize]);
                let lower = if overlay.contains_key(&idx) {
                    0
                } else {
                    cheapest
                };
                (lower, idx)
            })
            .collect();
        order.sort_unstable();
        let mut best: Option<(u64, usize, NodeIdx, Vec<Slot>)> = None;
        for (lower, idx) in order {
            if best.as_ref().is_some_and(|b| lower > b.0) {
                break;
            }
            let list = &victims_on[idx as usize];
            let n = &placer.fleet.nodes[idx as usize];
            let mut free = free_of(&overlay, idx);
            let mut extra = Vec::new();
            let mut extra_cost = 0u64;
            let mut fits = if overlay.contains_key(&idx) {
                memo.fits(placer, idx, &free, shape)
            } else {
                memo.fits_as_is(placer, idx, shape)
            };
            // A node that needs victims costs at least its cheapest one (`lower`) and takes at
            // least one: when that cannot beat the best found, its victims need not be added
            // up (on a full fleet many nodes tie on the cheapest victim's cost).
            if !fits
                && best
                    .as_ref()
                    .is_some_and(|b| (lower, 1, idx) > (b.0, b.1, b.2))
            {
                continue;
            }
            for &v in list {
                if fits {
                    break;
                }
                if chosen[v as usize] {
                    continue;
                }
                let job = candidates[v as usize].1;
                for &(s, rec) in &allocs_on[idx as usize] {
                    if s == v {
                        free.add_allocation(n.node, job, rec);
                    }
                }
                extra.push(v);
                extra_cost += costs[v as usize];
                fits = memo.fits(placer, idx, &free, shape);
            }
            if !fits {
                continue;
            }
            let candidate = (extra_cost, extra.len(), idx, extra);
            if best
                .as_ref()
                .is_none_or(|b| (candidate.0, candidate.1, candidate.2) < (b.0, b.1, b.2))
            {
                best = Some(candidate);
            }
        }
        let (_, _, idx, extra) = best?;
        for v in extra {
            chosen[v as usize] = true;
            let (id, job, _) = candidates[v as usize];
            chosen_ids.push(id);
            // A victim's exit frees its tasks on every node it runs on.
            for rec in state.allocations_of(id) {
                if let Some(i) = placer.fleet.index_of.get(rec.allocation.node.as_str()) {
                    let mut f = free_of(&overlay, i);
                    f.add_allocation(placer.fleet.nodes[i as usize].node, job, rec);
                    overlay.insert(i, f);
                }
            }
        }
        let n = &placer.fleet.nodes[idx as usize];
        let free = free_of(&overlay, idx);
        let fit = evaluate_node(&fit_only, n, &free, shape)?;
        overlay.insert(idx, take(n.node, &free, shape, &fit.units));
    }
    if chosen_ids.is_empty() {
        return None;
    }
    chosen_ids.sort_unstable();
    Some(Preemption {
        for_job: head.id,
        victims: chosen_ids,
    })
}
