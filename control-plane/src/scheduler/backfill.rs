//! Backfill: when the job at the head of the queue cannot start, it gets a reservation — the
//! earliest time at which running work's time limits free enough room, on named nodes — and
//! later jobs may start now only if they cannot delay it: either they end (by their own time
//! limit) before the reservation starts, or they use only what the reserved nodes will still
//! have spare at that time.
//!
//! Work without a time limit is assumed to run forever here; allocations being stopped end now.

use std::collections::BTreeMap;

use serde::Serialize;

use super::fleet::{FastMap, GroupId, NodeFree, NodeIdx};
use super::live::LiveAllocation;
use super::placement::{FitMemo, Placer, Shape, Units, count_fit, give_back};
use crate::state::{Job, JobId, Timestamp};

/// The head job's reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reservation {
    pub job: JobId,
    /// When the reserved room is free (leader clock, ms).
    pub start_at: Timestamp,
    /// Node → tasks of the job reserved there.
    pub nodes: BTreeMap<String, u32>,
}

/// When a job placed now would end, if it has a time limit.
pub fn end_if_started(job: &Job, now: Timestamp) -> Option<Timestamp> {
    job.spec
        .time_limit_secs
        .map(|s| now.saturating_add(s.saturating_mul(1000)))
}

/// A release of resources at a known time on a node.
struct Release<'s> {
    at: Timestamp,
    kind: ReleaseKind<'s>,
}

enum ReleaseKind<'s> {
    /// A live allocation ends (with its job, so nothing is looked up again).
    Allocation(&'s LiveAllocation<'s>),
    /// A task placed earlier in this pass ends.
    Planned(&'s Shape, &'s Units),
}

/// A lower bound of when a node could hold one task of `shape`: the first release after which
/// its free GPU units (whole GPUs, or MIG slices), counting every released GPU as whole again,
/// reach what the task needs. Shapes without GPUs, and shares: `now` (no bound).
fn earliest_by_units(
    placer: &Placer,
    idx: NodeIdx,
    releases: &[Release],
    shape: &Shape,
    now: Timestamp,
) -> Timestamp {
    let free = &placer.fleet.nodes[idx as usize].free;
    let need = u64::from(shape.gpus);
    let mut units = if shape.mig_profile.is_some() {
        u64::from(free.mig_free.count_ones())
    } else {
        free.milli().iter().filter(|&&m| m >= 1000).count() as u64
    };
    // Shares may fit on a partly used GPU: no bound from whole GPUs.
    if need == 0 || units >= need || shape.gpu_milli > 0 {
        return now;
    }
    for r in releases {
        units += match &r.kind {
            ReleaseKind::Allocation(a) => u64::from(a.units),
            ReleaseKind::Planned(_, Units::Gpus(g)) => g.len() as u64,
            ReleaseKind::Planned(_, Units::Slices(s)) => s.len() as u64,
        };
        if units >= need {
            return r.at;
        }
    }
    Timestamp::MAX
}

/// Finds the head job's reservation and holds its nodes in the placer. `planned`: tasks placed
/// earlier in this pass, with their node and end time.
pub fn reserve<'s>(
    placer: &mut Placer,
    job: &Job,
    shape: &Shape,
    now: Timestamp,
    planned: &'s [(NodeIdx, Option<Timestamp>, Shape, Units)],
    live: &'s [LiveAllocation<'s>],
) -> Option<Reservation> {
    let tasks = job.spec.tasks;
    // Releases per node, in time order.
    // Indexed by node: dense, so no map lookups per allocation.
    let mut releases: Vec<Vec<Release<'s>>> = Vec::new();
    releases.resize_with(placer.fleet.nodes.len(), Vec::new);
    for a in live {
        let (Some(idx), Some(at)) = (a.node, a.ends_at) else {
            continue;
        };
        if placer.fleet.nodes[idx as usize].shadow.is_some() {
            continue;
        }
        releases[idx as usize].push(Release {
            at,
            kind: ReleaseKind::Allocation(a),
        });
    }
    for (idx, end, s, units) in planned {
        if let Some(at) = end {
            releases[*idx as usize].push(Release {
                at: *at,
                kind: ReleaseKind::Planned(s, units),
            });
        }
    }
    // Per node, the step function "tasks that fit from time t on".
    let mut steps: Vec<(Timestamp, NodeIdx, u32)> = Vec::new();
    let mut free_at: FastMap<NodeIdx, Vec<(Timestamp, NodeFree)>> = FastMap::default();
    // A one-task job needs one node: visit nodes by a cheap lower bound of when they could hold
    // it (GPU units alone) and stop once no unvisited node can beat the earliest exact time.
    let mut order: Vec<(Timestamp, NodeIdx, Vec<Release>)> = releases
        .into_iter()
        .enumerate()
        .filter(|(_, rel)| !rel.is_empty())
        .map(|(idx, mut rel)| {
            let idx = idx as NodeIdx;
            rel.sort_by_key(|r| r.at);
            let bound = earliest_by_units(placer, idx, &rel, shape, now);
            (bound, idx, rel)
        })
        .collect();
    order.sort_by_key(|(bound, idx, _)| (*bound, *idx));
    let mut earliest: Option<Timestamp> = None;
    let mut memo = FitMemo::default();
    // Tasks that fit on each node now.
    let mut count_now: Vec<u32> = vec![0; placer.fleet.nodes.len()];
    for (bound, idx, rel) in order {
        if tasks == 1 && earliest.is_some_and(|e| bound > e) {
            break;
        }
        let n = &placer.fleet.nodes[idx as usize];
        let mut free = n.free;
        // Before its bound the node holds no task (too few GPU units): no need to ask.
        let mut last = if bound > now {
            0
        } else {
            memo.count(placer, idx, &free, shape, tasks)
        };
        count_now[idx as usize] = last;
        let mut timeline = vec![(now, free)];
        let mut i = 0;
        while i < rel.len() {
            let at = rel[i].at;
            while i < rel.len() && rel[i].at == at {
                match &rel[i].kind {
                    ReleaseKind::Allocation(a) => free.add_allocation(n.node, a.job, a.rec),
                    ReleaseKind::Planned(s, units) => free = give_back(n.node, &free, s, units),
                }
                i += 1;
            }
            let count = if at < bound {
                0
            } else {
                memo.count(placer, idx, &free, shape, tasks)
            };
            timeline.push((at, free));
            if count != last {
                steps.push((at, idx, count));
                last = count;
            }
            if count >= tasks {
                earliest = Some(earliest.map_or(at, |e| e.min(at)));
                break;
            }
        }
        free_at.insert(idx, timeline);
    }
    // Nodes that already fit some tasks now (gangs) count from the start. Nodes of one fleet
    // group have the same hardware and free resources: count once per group.
    if tasks > 1 {
        let mut per_group: FastMap<GroupId, u32> = FastMap::default();
        for (i, n) in placer.fleet.nodes.iter().enumerate() {
            if n.shadow.is_some() || free_at.contains_key(&(i as NodeIdx)) {
                continue;
            }
            let c = *per_group
                .entry(n.group)
                .or_insert_with(|| count_fit(placer, i as NodeIdx, &n.free, shape, tasks).0);
            count_now[i] = c;
        }
    }
    steps.sort_unstable();
    let mut current = count_now;
    let mut total: u64 = current.iter().map(|&c| u64::from(c)).sum();
    let mut start = None;
    if total >= u64::from(tasks) {
        start = Some(now);
    } else {
        for (at, idx, count) in steps {
            let before = std::mem::replace(&mut current[idx as usize], count);
            total = total + u64::from(count) - u64::from(before);
            if total >= u64::from(tasks) {
                start = Some(at);
                break;
            }
        }
    }
    let start = start?;
    // Reserve on the nodes with room at `start`, most room first (fewest nodes for a gang).
    let mut room: Vec<(u32, NodeIdx)> = current
        .iter()
        .enumerate()
        .filter(|(_, c)| **c > 0)
        .map(|(i, c)| (*c, i as NodeIdx))
        .collect();
    room.sort_unstable_by_key(|(c, i)| (std::cmp::Reverse(*c), *i));
    let mut left = tasks;
    let mut nodes = BTreeMap::new();
    for (c, idx) in room {
        if left == 0 {
            break;
        }
        let here = c.min(left);
        left -= here;
        let at_start = free_at
            .get(&idx)
            .and_then(|t| t.iter().rev().find(|(at, _)| *at <= start))
            .map(|(_, f)| *f)
            .unwrap_or_else(|| placer.fleet.nodes[idx as usize].free);
        let (_, shadow) = count_fit(placer, idx, &at_start, shape, here);
        placer.fleet.reserve(idx, shadow);
        nodes.insert(
            placer.fleet.nodes[idx as usize].node.spec.name.clone(),
            here,
        );
    }
    Some(Reservation {
        job: job.id,
        start_at: start,
        nodes,
    })
}
