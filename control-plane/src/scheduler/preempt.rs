//! Preemption: the head job cannot start, so it evicts the cheapest set of jobs the rules let it
//! stop — lower-priority preemptible work, or work of tenants running on capacity borrowed
//! beyond their quota while the head's tenant is within its guarantee (the rules are
//! `ClusterState::check_preemption`, the same check apply makes). Cheapest means the fewest
//! GPU-seconds of work lost (GPU capacity × time since the victim started). Victims get the
//! agents' stop grace period and are requeued, never lost.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

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

/// What the walk over the live allocations asks of a candidate's tenant, answered once per
/// tenant: tenants are few and running jobs many, and each answer looks tenants up by name.
#[derive(Default)]
struct TenantRules {
    /// The tenant holds more GPU capacity than its quota guarantees (runs on borrowed room).
    borrowing: Option<bool>,
    /// The exact rule (`check_preemption_of`) for a lower-priority preemptible job of the
    /// tenant that is live and not stopping.
    by_priority: Option<bool>,
    /// The exact rule for any other live job of the tenant that is not stopping, when the
    /// head's tenant reclaims its guarantee.
    by_reclaim: Option<bool>,
}

/// The rules of each tenant met, by name. Tenants are few, and a name of up to 15 bytes
/// packed into one integer is compared in one step: a short list of those costs less than
/// hashing the name for every running job. Longer names, and tenants past the first
/// `LISTED`, go to a map.
#[derive(Default)]
struct Tenants<'s> {
    listed: Vec<(u128, TenantRules)>,
    more: FastMap<&'s str, TenantRules>,
}

impl<'s> Tenants<'s> {
    const LISTED: usize = 32;

    /// The name's length and bytes in one integer, if it has at most 15 bytes.
    fn packed(name: &str) -> Option<u128> {
        let bytes = name.as_bytes();
        if bytes.len() > 15 {
            return None;
        }
        let packed = bytes
            .iter()
            .enumerate()
            .fold(bytes.len() as u128, |k, (i, &b)| {
                k | u128::from(b) << (8 * (i + 1))
            });
        Some(packed)
    }

    fn of(&mut self, tenant: &'s str) -> &mut TenantRules {
        if let Some(key) = Self::packed(tenant) {
            if let Some(i) = self.listed.iter().position(|(k, _)| *k == key) {
                return &mut self.listed[i].1;
            }
            if self.listed.len() < Self::LISTED {
                self.listed.push((key, TenantRules::default()));
                return &mut self.listed.last_mut().expect("just pushed").1;
            }
        }
        self.more.entry(tenant).or_default()
    }
}

/// The candidates' allocations on fleet nodes, grouped by node in flat arrays (a node's entries
/// are one range of each): on a full fleet thousands of nodes hold candidates, and a vector per
/// node cost an allocation each.
struct OnNodes<'s> {
    /// Per node, its candidates' allocations as (candidate, record), in walk order.
    allocs: Vec<(Slot, &'s AllocationRecord)>,
    /// Node `i`'s allocations are `allocs[alloc_start[i]..alloc_start[i + 1]]`.
    alloc_start: Vec<u32>,
    /// Per node, its distinct candidates, cheapest first.
    victims: Vec<Slot>,
    /// Node `i`'s candidates are `victims[victim_start[i]..victim_start[i + 1]]`.
    victim_start: Vec<u32>,
    /// Nodes with any candidate, in index order.
    with_victims: Vec<NodeIdx>,
}

impl<'s> OnNodes<'s> {
    /// Groups `walk` (node, candidate, record) by node, keeping walk order within a node (a
    /// stable counting sort); each node's distinct candidates are sorted by `order`.
    fn group<K: Ord>(
        nodes: usize,
        walk: &[(NodeIdx, Slot, &'s AllocationRecord)],
        order: impl Fn(Slot) -> K,
    ) -> OnNodes<'s> {
        let mut alloc_start = vec![0u32; nodes + 1];
        for &(idx, _, _) in walk {
            alloc_start[idx as usize + 1] += 1;
        }
        for i in 0..nodes {
            alloc_start[i + 1] += alloc_start[i];
        }
        let mut allocs = match walk.first() {
            Some(&(_, slot, rec)) => vec![(slot, rec); walk.len()],
            None => Vec::new(),
        };
        let mut next = alloc_start[..nodes].to_vec();
        for &(idx, slot, rec) in walk {
            let at = &mut next[idx as usize];
            allocs[*at as usize] = (slot, rec);
            *at += 1;
        }
        let mut victims = Vec::with_capacity(allocs.len());
        let mut victim_start = Vec::with_capacity(nodes + 1);
        let mut with_victims = Vec::new();
        for idx in 0..nodes {
            let first = victims.len();
            victim_start.push(first as u32);
            let here = &allocs[alloc_start[idx] as usize..alloc_start[idx + 1] as usize];
            if here.is_empty() {
                continue;
            }
            for &(slot, _) in here {
                if !victims[first..].contains(&slot) {
                    victims.push(slot);
                }
            }
            victims[first..].sort_unstable_by_key(|&s| order(s));
            with_victims.push(idx as NodeIdx);
        }
        victim_start.push(victims.len() as u32);
        OnNodes {
            allocs,
            alloc_start,
            victims,
            victim_start,
            with_victims,
        }
    }

    fn allocs(&self, idx: NodeIdx) -> &[(Slot, &'s AllocationRecord)] {
        let i = idx as usize;
        &self.allocs[self.alloc_start[i] as usize..self.alloc_start[i + 1] as usize]
    }

    fn victims(&self, idx: NodeIdx) -> &[Slot] {
        let i = idx as usize;
        &self.victims[self.victim_start[i] as usize..self.victim_start[i + 1] as usize]
    }
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
    // A replica of a service below its minimum may also stop preemptible batch work of its own
    // class (`check_preemption_of`'s service rule).
    let restoring_service = state.service_below_minimum(head);
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
    // Sized for the worst case: growing it showed in profiles.
    let mut slot_of: FastMap<JobId, Slot> =
        FastMap::with_capacity_and_hasher(live.len(), Default::default());
    // The candidates' allocations on fleet nodes, in walk order: (node, candidate, record).
    let mut walk: Vec<(NodeIdx, Slot, &AllocationRecord)> = Vec::with_capacity(live.len());
    let mut last: Option<(JobId, Option<Slot>)> = None;
    let mut rules = Tenants::default();
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
                let rank = priority_rank(&job.spec.priority_class);
                let lower = a.preemptible
                    && (rank < head_rank
                        || (restoring_service && rank == head_rank && job.replica.is_none()));
                let allowed = id != head.id
                    && if lower {
                        // The exact rule refuses a job that is final, holds nothing or is
                        // stopping; past those, its answer for a lower-priority preemptible
                        // job depends only on the job's tenant (who is within its guarantee,
                        // who borrows), so it is evaluated once per tenant.
                        let live_job = !job.state.is_final()
                            && !job.allocations.is_empty()
                            && job.ending.is_none();
                        live_job
                            && *rules
                                .of(job.spec.tenant.as_str())
                                .by_priority
                                .get_or_insert_with(|| state.check_preemption_of(head, job).is_ok())
                    } else if reclaiming && !a.stopping {
                        // The rule's reclaim branch likewise depends only on the victim's
                        // tenant once the job itself is live.
                        let tenant = job.spec.tenant.as_str();
                        let r = rules.of(tenant);
                        *r.borrowing
                            .get_or_insert_with(|| tenant_borrowing(state, tenant))
                            && tenant != head.spec.tenant
                            && *r
                                .by_reclaim
                                .get_or_insert_with(|| state.check_preemption_of(head, job).is_ok())
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
        if let Some(node) = a.node {
            walk.push((node, slot, rec));
        }
    }
    let costs: Vec<u64> = candidates
        .iter()
        .map(|&(_, job, since)| cost(job, since, now))
        .collect();
    if costs.is_empty() {
        return None;
    }
    let on = OnNodes::group(placer.fleet.nodes.len(), &walk, |s| {
        (costs[s as usize], candidates[s as usize].0)
    });
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
        let mut order: BinaryHeap<Reverse<(u64, NodeIdx)>> = on
            .with_victims
            .iter()
            .map(|&idx| {
                // The lists are sorted by cost: the first one not chosen is the cheapest.
                let cheapest = on
                    .victims(idx)
                    .iter()
                    .find(|&&v| !chosen[v as usize])
                    .map_or(u64::MAX, |&v| costs[v as usize]);
                let lower = if overlay.contains_key(&idx) {
                    0
                } else {
                    cheapest
                };
                Reverse((lower, idx))
            })
            .collect();
        let mut best: Option<(u64, usize, NodeIdx, Vec<Slot>)> = None;
        // The victims a node needs, reused from node to node (most are not the best).
        let mut extra: Vec<Slot> = Vec::new();
        // In order of (lower bound, node): a heap, since the search usually stops long before
        // the last node.
        while let Some(Reverse((lower, idx))) = order.pop() {
            if best.as_ref().is_some_and(|b| lower > b.0) {
                break;
            }
            let n = &placer.fleet.nodes[idx as usize];
            extra.clear();
            let mut extra_cost = 0u64;
            let mut fits = match overlay.get(&idx) {
                Some(free) => memo.fits(placer, idx, free, shape),
                None => memo.fits_as_is(placer, idx, shape),
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
            let mut free = free_of(&overlay, idx);
            for &v in on.victims(idx) {
                if fits {
                    break;
                }
                // Every victim costs at least 1: a node that does not fit yet at the best
                // answer's cost can only end above it.
                if best.as_ref().is_some_and(|b| extra_cost >= b.0) {
                    break;
                }
                if chosen[v as usize] {
                    continue;
                }
                let job = candidates[v as usize].1;
                for &(s, rec) in on.allocs(idx) {
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
            if best
                .as_ref()
                .is_none_or(|b| (extra_cost, extra.len(), idx) < (b.0, b.1, b.2))
            {
                best = Some((extra_cost, extra.len(), idx, extra.clone()));
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
