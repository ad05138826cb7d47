//! Backfill: when the job at the head of the queue cannot start, it gets a reservation — the
//! earliest time at which running work's time limits free enough room, on named nodes — and
//! later jobs may start now only if they cannot delay it: either they end (by their own time
//! limit) before the reservation starts, or they use only what the reserved nodes will still
//! have spare at that time.
//!
//! Work without a time limit is assumed to run forever here; allocations being stopped end now.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

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
#[derive(Clone, Copy)]
struct Release<'s> {
    at: Timestamp,
    kind: ReleaseKind<'s>,
}

#[derive(Clone, Copy)]
enum ReleaseKind<'s> {
    /// A live allocation ends (with its job, so nothing is looked up again).
    Allocation(&'s LiveAllocation<'s>),
    /// A task placed earlier in this pass ends.
    Planned(&'s Shape, &'s Units),
}

/// Every node's releases in one array, grouped by node (in index order) and, within a node, in
/// time order (ties in the order they were collected: live allocations, then this pass's
/// tasks). One flat array instead of a vector per node: a full 10,000-node fleet has tens of
/// thousands of releases and allocating per node showed in profiles.
struct Releases<'s> {
    flat: Vec<Release<'s>>,
    /// Node `i`'s releases are `flat[start[i]..start[i + 1]]`.
    start: Vec<u32>,
}

impl<'s> Releases<'s> {
    fn collect(
        placer: &Placer,
        planned: &'s [(NodeIdx, Option<Timestamp>, Shape, Units)],
        live: &'s [LiveAllocation<'s>],
    ) -> Releases<'s> {
        let nodes = placer.fleet.nodes.len();
        let mut entries: Vec<(NodeIdx, Release<'s>)> =
            Vec::with_capacity(live.len() + planned.len());
        for a in live {
            let (Some(idx), Some(at)) = (a.node, a.ends_at) else {
                continue;
            };
            if placer.fleet.nodes[idx as usize].shadow.is_some() {
                continue;
            }
            let kind = ReleaseKind::Allocation(a);
            entries.push((idx, Release { at, kind }));
        }
        for (idx, end, s, units) in planned {
            if let Some(at) = end {
                let kind = ReleaseKind::Planned(s, units);
                entries.push((*idx, Release { at: *at, kind }));
            }
        }
        // Counting sort by node (stable), then a stable sort by time within each node.
        let mut start = vec![0u32; nodes + 1];
        for (idx, _) in &entries {
            start[*idx as usize + 1] += 1;
        }
        for i in 0..nodes {
            start[i + 1] += start[i];
        }
        let mut next = start.clone();
        let mut slot = vec![0u32; entries.len()];
        for (i, (idx, _)) in entries.iter().enumerate() {
            let at = &mut next[*idx as usize];
            slot[*at as usize] = i as u32;
            *at += 1;
        }
        let mut flat: Vec<Release<'s>> = slot.iter().map(|&i| entries[i as usize].1).collect();
        for i in 0..nodes {
            flat[start[i] as usize..start[i + 1] as usize].sort_by_key(|r| r.at);
        }
        Releases { flat, start }
    }

    /// How many nodes have any release.
    fn nodes_with_releases(&self) -> usize {
        self.start.windows(2).filter(|w| w[0] < w[1]).count()
    }

    fn of(&self, idx: NodeIdx) -> &[Release<'s>] {
        let i = idx as usize;
        &self.flat[self.start[i] as usize..self.start[i + 1] as usize]
    }
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

/// One node's free resources over time, as its releases are replayed in order: "how many tasks
/// fit from time t on" is a step function of t. Before `bound` the node holds no task (too few
/// GPU units), so its releases there are applied without asking; the node's replay ends once it
/// holds every task.
struct Timeline<'r, 's> {
    idx: NodeIdx,
    releases: &'r [Release<'s>],
    bound: Timestamp,
    /// Releases applied so far (a prefix of `releases`).
    applied: usize,
    free: NodeFree,
    /// Tasks that fit after the last time replayed.
    count: u32,
    /// The node held every task at the last time replayed: its replay is over.
    done: bool,
}

impl Timeline<'_, '_> {
    /// When the next replayed time may change the count: the first release time not applied
    /// yet that is not before `bound`.
    fn next_time(&self) -> Option<Timestamp> {
        if self.done {
            return None;
        }
        self.releases[self.applied..]
            .iter()
            .map(|r| r.at)
            .find(|&at| at >= self.bound)
    }

    /// Applies every release up to and including time `at`, and counts the tasks that fit
    /// then (none before `bound`).
    fn advance<'a>(
        &mut self,
        placer: &Placer<'a>,
        memo: &mut FitMemo<'a>,
        shape: &Shape,
        tasks: u32,
        at: Timestamp,
    ) -> u32 {
        let n = &placer.fleet.nodes[self.idx as usize];
        while let Some(r) = self.releases.get(self.applied).filter(|r| r.at <= at) {
            match &r.kind {
                ReleaseKind::Allocation(a) => self.free.add_allocation(n.node, a.job, a.rec),
                ReleaseKind::Planned(s, units) => {
                    self.free = give_back(n.node, &self.free, s, units)
                }
            }
            self.applied += 1;
        }
        let count = if at < self.bound {
            0
        } else {
            memo.count(placer, self.idx, &self.free, shape, tasks)
        };
        self.count = count;
        if count >= tasks {
            self.done = true;
        }
        count
    }

    /// Free resources at `start`: the node's releases up to then, replayed one time after
    /// another, stopping where the node first held every task (as the search did).
    fn free_at<'a>(
        &mut self,
        placer: &Placer<'a>,
        memo: &mut FitMemo<'a>,
        shape: &Shape,
        tasks: u32,
        start: Timestamp,
    ) -> NodeFree {
        while !self.done
            && let Some(at) = self.releases.get(self.applied).map(|r| r.at)
            && at <= start
        {
            self.advance(placer, memo, shape, tasks, at);
        }
        self.free
    }
}

/// Finds the head job's reservation and holds its nodes in the placer. `planned`: tasks placed
/// earlier in this pass, with their node and end time.
///
/// The start is the first time at which the nodes together hold every task. Node counts change
/// only at release times, so the nodes' timelines are replayed together in (time, node) order
/// and the replay stops at that time: on a full fleet most nodes' releases lie after it and are
/// never looked at. (Counts of a node are evaluated only from its `earliest_by_units` bound
/// on.)
pub fn reserve<'s>(
    placer: &mut Placer,
    job: &Job,
    shape: &Shape,
    now: Timestamp,
    planned: &'s [(NodeIdx, Option<Timestamp>, Shape, Units)],
    live: &'s [LiveAllocation<'s>],
) -> Option<Reservation> {
    let tasks = job.spec.tasks;
    let nodes = placer.fleet.nodes.len();
    let releases = Releases::collect(placer, planned, live);
    let mut memo = FitMemo::default();
    // Tasks that fit on each node now.
    let mut current: Vec<u32> = vec![0; nodes];
    // Sized up front: a timeline holds a node's free resources, and growing the vector copied
    // them again and again.
    let mut timelines: Vec<Timeline> = Vec::with_capacity(releases.nodes_with_releases());
    // Node → its timeline, for nodes with releases.
    let mut timeline_of: Vec<u32> = vec![u32::MAX; nodes];
    let mut queue: BinaryHeap<Reverse<(Timestamp, NodeIdx)>> = BinaryHeap::new();
    for idx in 0..nodes as NodeIdx {
        let rel = releases.of(idx);
        if rel.is_empty() {
            continue;
        }
        let bound = earliest_by_units(placer, idx, rel, shape, now);
        let free = placer.fleet.nodes[idx as usize].free;
        // Before its bound the node holds no task (too few GPU units): no need to ask.
        let count = if bound > now {
            0
        } else {
            memo.count_as_is(placer, idx, shape, tasks)
        };
        current[idx as usize] = count;
        let t = Timeline {
            idx,
            releases: rel,
            bound,
            applied: 0,
            free,
            count,
            done: false,
        };
        if let Some(at) = t.next_time() {
            queue.push(Reverse((at, idx)));
        }
        timeline_of[idx as usize] = timelines.len() as u32;
        timelines.push(t);
    }
    // Nodes that already fit some tasks now (gangs) count from the start. Nodes of one fleet
    // group have the same hardware and free resources: count once per group.
    if tasks > 1 {
        let mut per_group: FastMap<GroupId, u32> = FastMap::default();
        for (i, n) in placer.fleet.nodes.iter().enumerate() {
            if n.shadow.is_some() || timeline_of[i] != u32::MAX {
                continue;
            }
            let c = *per_group
                .entry(n.group)
                .or_insert_with(|| count_fit(placer, i as NodeIdx, &n.free, shape, tasks).0);
            current[i] = c;
        }
    }
    let mut total: u64 = current.iter().map(|&c| u64::from(c)).sum();
    let mut start = None;
    if total >= u64::from(tasks) {
        start = Some(now);
    } else {
        while let Some(Reverse((at, idx))) = queue.pop() {
            let t = &mut timelines[timeline_of[idx as usize] as usize];
            let before = t.count;
            let count = t.advance(placer, &mut memo, shape, tasks, at);
            if let Some(next) = t.next_time() {
                queue.push(Reverse((next, idx)));
            }
            if count != before {
                current[idx as usize] = count;
                total = total + u64::from(count) - u64::from(before);
                if total >= u64::from(tasks) {
                    start = Some(at);
                    break;
                }
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
    let mut reserved = BTreeMap::new();
    for (c, idx) in room {
        if left == 0 {
            break;
        }
        let here = c.min(left);
        left -= here;
        let at_start = match timeline_of[idx as usize] {
            u32::MAX => placer.fleet.nodes[idx as usize].free,
            t => timelines[t as usize].free_at(placer, &mut memo, shape, tasks, start),
        };
        let (_, shadow) = count_fit(placer, idx, &at_start, shape, here);
        placer.fleet.reserve(idx, shadow);
        reserved.insert(
            placer.fleet.nodes[idx as usize].node.spec.name.clone(),
            here,
        );
    }
    Some(Reservation {
        job: job.id,
        start_at: start,
        nodes: reserved,
    })
}
