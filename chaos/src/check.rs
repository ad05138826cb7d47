//! The checker: reads a history and reports, for each invariant of `docs/ARCHITECTURE.md`, the
//! evidence of every violation it finds. Pure: no I/O, no clock, so it is tested with histories
//! built by hand (below) and re-runs identically on a saved history (`chaos check`).

use std::collections::{BTreeMap, BTreeSet};

use node_agent::runtime::{UsageRecord, check_no_overlap};
use serde::Serialize;

use crate::history::{Event, JobView, OpKind, Outcome};

/// Evidence lines kept per invariant; the count stays exact.
const MAX_EVIDENCE: usize = 20;

#[derive(Debug, Clone, Serialize)]
pub struct InvariantResult {
    pub name: &'static str,
    pub description: &'static str,
    pub violations: usize,
    pub evidence: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub invariants: Vec<InvariantResult>,
}

impl Report {
    pub fn violations(&self) -> usize {
        self.invariants.iter().map(|i| i.violations).sum()
    }

    pub fn get(&self, name: &str) -> Option<&InvariantResult> {
        self.invariants.iter().find(|i| i.name == name)
    }
}

pub const ACKED_ONCE: &str = "acknowledged_jobs_present_once";
pub const NO_DOUBLE_BOOKING: &str = "no_gpu_held_by_two_allocations";
pub const NO_SHARED_PROCESS: &str = "no_gpu_used_by_two_processes";
pub const ONE_COPY: &str = "no_job_running_in_two_places";
pub const QUOTAS: &str = "quotas_held";
pub const QUEUE_ORDER: &str = "queue_order_preserved";
pub const PROGRESS: &str = "runnable_jobs_placed_after_faults";
pub const NO_STALE_LEADER: &str = "no_decision_from_a_stale_leader";
pub const NO_CRASH: &str = "no_process_crashed";
pub const REMOVED_STAYS_OUT: &str = "removed_replica_stays_out";
pub const SERVICE_ORDINAL_ONCE: &str = "no_service_ordinal_running_twice";
pub const SERVICE_COPIES: &str = "service_copies_within_replicas_plus_surge";
pub const SERVICE_RESTORED: &str = "services_restored_after_faults";

/// How long after a service's copy limit was replaced a copy placed under it may still run on
/// a host: the agents' lease plus grace in a chaos run (3 s), and margin.
const SERVICE_BOUND_SLACK_MS: u64 = 5_000;

struct Collector {
    result: InvariantResult,
}

impl Collector {
    fn new(name: &'static str, description: &'static str) -> Collector {
        Collector {
            result: InvariantResult {
                name,
                description,
                violations: 0,
                evidence: Vec::new(),
            },
        }
    }
    fn violation(&mut self, evidence: String) {
        self.result.violations += 1;
        if self.result.evidence.len() < MAX_EVIDENCE {
            self.result.evidence.push(evidence);
        }
    }
}

pub fn check(events: &[Event]) -> Report {
    Report {
        invariants: vec![
            acked_once(events),
            no_double_booking(events),
            no_shared_process(events),
            one_copy(events),
            quotas(events),
            queue_order(events),
            progress(events),
            no_stale_leader(events),
            no_crash(events),
            removed_stays_out(events),
            service_ordinal_once(events),
            service_copies(events),
            services_restored(events),
        ],
    }
}

fn final_jobs(events: &[Event]) -> Option<(bool, &[JobView])> {
    events.iter().rev().find_map(|e| match e {
        Event::Final { settled, jobs, .. } => Some((*settled, jobs.as_slice())),
        _ => None,
    })
}

/// Every (time, jobs) view of the replicated state: periodic snapshots and the final one.
fn state_views(events: &[Event]) -> impl Iterator<Item = (u64, &[JobView])> {
    events.iter().filter_map(|e| match e {
        Event::Snapshot { at_ms, jobs } | Event::Final { at_ms, jobs, .. } => {
            Some((*at_ms, jobs.as_slice()))
        }
        _ => None,
    })
}

/// Invariant 2: each acknowledged submission is in the final state, and one idempotency key
/// never made two jobs (nor was it acknowledged with two ids).
fn acked_once(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        ACKED_ONCE,
        "every acknowledged submission is present exactly once (one job per idempotency key)",
    );
    let Some((_, jobs)) = final_jobs(events) else {
        c.violation("the history has no final state: the run ended before it was read".into());
        return c.result;
    };
    let by_id: BTreeMap<u64, &JobView> = jobs.iter().map(|j| (j.id, j)).collect();
    let mut by_key: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for j in jobs.iter().filter(|j| !j.key.is_empty()) {
        by_key.entry(&j.key).or_default().push(j.id);
    }
    for (key, ids) in &by_key {
        if ids.len() > 1 {
            c.violation(format!(
                "idempotency key {key:?} made {} jobs: {ids:?}",
                ids.len()
            ));
        }
    }
    let mut acked: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for e in events {
        let Event::Op {
            op,
            kind: OpKind::Submit { key, .. },
            outcome: Outcome::Ok { job, .. },
            completed_ms,
            ..
        } = e
        else {
            continue;
        };
        let at = completed_ms.unwrap_or_default();
        match by_id.get(job) {
            None => c.violation(format!(
                "op {op}: job {job} (key {key:?}) was acknowledged at {at} ms but is not in \
                 the final state"
            )),
            Some(j) if j.key != *key => c.violation(format!(
                "op {op}: key {key:?} was acknowledged as job {job}, but job {job} carries key \
                 {:?}",
                j.key
            )),
            Some(_) => {}
        }
        if let Some((first, first_op)) = acked.insert(key, (*job, *op))
            && first != *job
        {
            c.violation(format!(
                "key {key:?} was acknowledged as job {first} (op {first_op}) and as job {job} \
                 (op {op})"
            ));
        }
    }
    c.result
}

/// Invariant 1, replicated state: a GPU's live allocations never hold more than the whole GPU.
fn no_double_booking(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        NO_DOUBLE_BOOKING,
        "no GPU is held by two live allocations (beyond shares that fit) in the replicated state",
    );
    let mut reported: BTreeSet<Vec<u64>> = BTreeSet::new();
    for (at, jobs) in state_views(events) {
        // (node, GPU) -> [(allocation, job, milli)]
        type Holders<'a> = BTreeMap<(&'a str, &'a str), Vec<(u64, u64, u32)>>;
        let mut holders: Holders = BTreeMap::new();
        for j in jobs {
            for a in &j.allocs {
                for g in &a.gpus {
                    holders
                        .entry((a.node.as_str(), g.as_str()))
                        .or_default()
                        .push((a.id, j.id, a.milli));
                }
            }
        }
        for ((node, gpu), hs) in holders {
            let milli: u64 = hs
                .iter()
                .map(|(_, _, m)| if *m == 0 { 1000 } else { u64::from(*m) })
                .sum();
            if hs.len() > 1 && milli > 1000 {
                let ids: Vec<u64> = hs.iter().map(|h| h.0).collect();
                if reported.insert(ids) {
                    c.violation(format!(
                        "at {at} ms GPU {gpu} on {node} is held by {} milli-GPU of allocations \
                         (allocation, job, milli; 0 = whole GPU): {hs:?}",
                        milli
                    ));
                }
            }
        }
    }
    c.result
}

fn journals(events: &[Event]) -> BTreeMap<&str, Vec<UsageRecord>> {
    let mut by_node: BTreeMap<&str, Vec<UsageRecord>> = BTreeMap::new();
    for e in events {
        if let Event::Usage { node, record } = e {
            by_node.entry(node).or_default().push(record.clone());
        }
    }
    by_node
}

/// Invariant 1, hosts: replaying each agent's usage journal, no GPU is used by two processes.
fn no_shared_process(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        NO_SHARED_PROCESS,
        "no GPU is used by two running processes on a host at any instant (agent journals)",
    );
    for (node, records) in journals(events) {
        if let Err(e) = check_no_overlap(&records) {
            c.violation(format!("node {node}: {e}"));
        }
    }
    c.result
}

/// One process run of an allocation, from the journals.
#[derive(Debug)]
struct Run<'a> {
    node: &'a str,
    allocation: u64,
    start: u64,
    end: Option<u64>,
}

/// The processes the agents ran, by job: where, and from when to when (the end is the
/// earlier of the journal's stop line and the shim's exit file; None: never stopped).
fn process_runs(events: &[Event]) -> BTreeMap<u64, Vec<Run<'_>>> {
    let mut exits: BTreeMap<(&str, u64), u64> = BTreeMap::new();
    for e in events {
        if let Event::ProcessExit {
            node,
            allocation,
            at_ms,
            ..
        } = e
        {
            exits.insert((node.as_str(), *allocation), *at_ms);
        }
    }
    let mut runs: BTreeMap<u64, Vec<Run>> = BTreeMap::new();
    let mut open: BTreeMap<(&str, u64), (u64, usize)> = BTreeMap::new();
    for e in events {
        let Event::Usage { node, record } = e else {
            continue;
        };
        match record {
            UsageRecord::Start {
                allocation,
                job,
                at_ms,
                ..
            } => {
                let list = runs.entry(*job).or_default();
                list.push(Run {
                    node,
                    allocation: *allocation,
                    start: *at_ms,
                    end: None,
                });
                open.insert((node.as_str(), *allocation), (*job, list.len() - 1));
            }
            UsageRecord::Stop {
                allocation,
                at_ms,
                exited_at_ms,
                ..
            } => {
                if let Some((job, i)) = open.remove(&(node.as_str(), *allocation))
                    && let Some(run) = runs.get_mut(&job).and_then(|l| l.get_mut(i))
                {
                    run.end = Some(exited_at_ms.map_or(*at_ms, |e| e.min(*at_ms)));
                }
            }
        }
    }
    for list in runs.values_mut() {
        for r in list.iter_mut() {
            if let Some(exit) = exits.get(&(r.node, r.allocation)) {
                r.end = Some(r.end.map_or(*exit, |e| e.min(*exit)));
            }
        }
    }
    runs
}

/// The first instant at which more than `limit` of `runs` overlap, with those runs described.
/// Ends sort before starts at the same millisecond.
fn first_overlap(runs: &[&Run], limit: usize) -> Option<(u64, String)> {
    let mut points: Vec<(u64, i64, usize)> = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        points.push((r.start, 1, i));
        if let Some(end) = r.end {
            points.push((end, -1, i));
        }
    }
    points.sort();
    let mut live: BTreeSet<usize> = BTreeSet::new();
    for (at, delta, i) in points {
        if delta < 0 {
            live.remove(&i);
            continue;
        }
        live.insert(i);
        if live.len() > limit {
            let desc: Vec<String> = live
                .iter()
                .map(|k| {
                    let r = runs[*k];
                    format!(
                        "allocation {} on {} from {} to {}",
                        r.allocation,
                        r.node,
                        r.start,
                        r.end.map_or("(never stopped)".into(), |e| e.to_string())
                    )
                })
                .collect();
            return Some((at, format!("{} processes: {}", live.len(), desc.join("; "))));
        }
    }
    None
}

/// Invariant 3: at no instant does a job run more copies than it has tasks, neither in the
/// replicated state nor in the processes the agents ran.
fn one_copy(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        ONE_COPY,
        "no job runs in two places at once (more processes or allocations than tasks)",
    );
    let tasks: BTreeMap<u64, i64> = final_jobs(events)
        .map(|(_, jobs)| jobs.iter().map(|j| (j.id, j.tasks.max(1))).collect())
        .unwrap_or_default();
    for (at, jobs) in state_views(events) {
        for j in jobs {
            if j.allocs.len() as i64 > j.tasks.max(1) {
                c.violation(format!(
                    "at {at} ms job {} ({} task(s)) has {} live allocations: {:?}",
                    j.id,
                    j.tasks,
                    j.allocs.len(),
                    j.allocs
                        .iter()
                        .map(|a| format!("{} on {}", a.id, a.node))
                        .collect::<Vec<_>>()
                ));
            }
        }
    }
    let runs = process_runs(events);
    for (job, list) in &runs {
        let limit = tasks.get(job).copied().unwrap_or(1);
        let list: Vec<&Run> = list.iter().collect();
        if let Some((at, desc)) = first_overlap(&list, limit.max(1) as usize) {
            c.violation(format!("at {at} ms job {job} ({limit} task(s)) ran {desc}"));
        }
    }
    c.result
}

/// Each job that is a service's replica, in any view of the state: its (service, ordinal).
fn replica_of_jobs(events: &[Event]) -> BTreeMap<u64, (&str, u32)> {
    let mut out = BTreeMap::new();
    for (_, jobs) in state_views(events) {
        for j in jobs {
            if let Some(r) = &j.replica {
                out.insert(j.id, (r.service.as_str(), r.ordinal));
            }
        }
    }
    out
}

/// A service never runs two copies of one ordinal at once (fencing, as for a job's tasks).
fn service_ordinal_once(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        SERVICE_ORDINAL_ONCE,
        "no service runs two copies of one ordinal at once on the hosts",
    );
    let replica_of = replica_of_jobs(events);
    let runs = process_runs(events);
    let mut by_ordinal: BTreeMap<(&str, u32), Vec<&Run>> = BTreeMap::new();
    for (job, list) in &runs {
        if let Some(key) = replica_of.get(job) {
            by_ordinal.entry(*key).or_default().extend(list.iter());
        }
    }
    for ((service, ordinal), list) in by_ordinal {
        if let Some((at, desc)) = first_overlap(&list, 1) {
            c.violation(format!(
                "at {at} ms replica {ordinal} of {service} ran {desc}"
            ));
        }
    }
    c.result
}

/// A service never runs more copies than `replicas + max_surge`, taking for each moment the
/// largest value that was in effect shortly before (a change applies somewhere between its
/// sending and its answer, and a host may run a copy it was told to stop until its lease ends).
fn service_copies(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        SERVICE_COPIES,
        "no service runs more copies than replicas + max_surge on the hosts",
    );
    // Per service: (sent, answered, bound) of every change, in order.
    type Change = (u64, Option<u64>, u32);
    let mut changes: BTreeMap<&str, Vec<Change>> = BTreeMap::new();
    for e in events {
        if let Event::ServiceChange {
            at_ms,
            service,
            replicas,
            max_surge,
            answered_ms,
            ..
        } = e
        {
            changes.entry(service.as_str()).or_default().push((
                *at_ms,
                *answered_ms,
                replicas + max_surge,
            ));
        }
    }
    let replica_of = replica_of_jobs(events);
    let runs = process_runs(events);
    let mut by_service: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for (job, list) in &runs {
        if let Some((service, _)) = replica_of.get(job) {
            by_service.entry(service).or_default().extend(list.iter());
        }
    }
    for (service, list) in by_service {
        let Some(changes) = changes.get(service) else {
            continue;
        };
        // The bound at `t`: every change sent by then whose successor was not yet answered
        // `SERVICE_BOUND_SLACK_MS` before `t`.
        let bound_at = |t: u64| -> u32 {
            changes
                .iter()
                .enumerate()
                .filter(|(i, (sent, _, _))| {
                    *sent <= t
                        && changes[i + 1..]
                            .iter()
                            .find_map(|(_, answered, _)| *answered)
                            .is_none_or(|a| a + SERVICE_BOUND_SLACK_MS >= t)
                })
                .map(|(_, (_, _, b))| *b)
                .max()
                .unwrap_or(u32::MAX)
        };
        for r in &list {
            let live = list
                .iter()
                .filter(|o| o.start <= r.start && o.end.is_none_or(|e| e > r.start))
                .count();
            let bound = bound_at(r.start);
            if live > bound as usize {
                c.violation(format!(
                    "at {} ms {service} ran {live} copies once allocation {} started on {}, its limit then was {bound}",
                    r.start, r.allocation, r.node
                ));
                break;
            }
        }
    }
    c.result
}

/// Once faults stop, every service is back at its replicas: all ready, at the current revision.
fn services_restored(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        SERVICE_RESTORED,
        "once faults stop, every service has its replicas ready at its current revision",
    );
    let Some(services) = events.iter().rev().find_map(|e| match e {
        Event::Final { services, .. } => Some(services),
        _ => None,
    }) else {
        return c.result;
    };
    for s in services.iter().filter(|s| !s.restored()) {
        c.violation(format!(
            "service {} at the end: {} of {} replicas ready, {} at revision {}, rollout {}{}",
            s.key,
            s.ready,
            s.replicas,
            s.updated,
            s.revision,
            s.rollout,
            if s.deleting { ", being deleted" } else { "" }
        ));
    }
    c.result
}

/// Invariant 5: a tenant with a hard limit never holds more GPUs than it.
fn quotas(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        QUOTAS,
        "no tenant holds more GPUs than its limit in the replicated state",
    );
    let limits: BTreeMap<&str, u32> = events
        .iter()
        .find_map(|e| match e {
            Event::Config { tenants, .. } => Some(
                tenants
                    .iter()
                    .filter(|t| t.max_gpus > 0)
                    .map(|t| (t.name.as_str(), t.max_gpus))
                    .collect(),
            ),
            _ => None,
        })
        .unwrap_or_default();
    for (at, jobs) in state_views(events) {
        let mut held: BTreeMap<&str, (u64, Vec<u64>)> = BTreeMap::new();
        for j in jobs {
            for a in &j.allocs {
                let milli = if a.milli == 0 {
                    1000 * a.gpus.len() as u64
                } else {
                    u64::from(a.milli)
                };
                let h = held.entry(j.tenant.as_str()).or_default();
                h.0 += milli;
                h.1.push(j.id);
            }
        }
        for (tenant, (milli, ids)) in held {
            if let Some(limit) = limits.get(tenant)
                && milli.div_ceil(1000) > u64::from(*limit)
            {
                c.violation(format!(
                    "at {at} ms tenant {tenant} holds {:.1} GPUs, over its limit of {limit} \
                     (jobs {ids:?})",
                    milli as f64 / 1000.0
                ));
            }
        }
    }
    c.result
}

/// Invariant 4, as seen from outside: among jobs that are alike for the scheduler (same
/// tenant, priority class and shape, no dependencies, never requeued) a later submission is
/// never placed before an earlier one — also when the leader changed in between.
fn queue_order(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        QUEUE_ORDER,
        "alike jobs (tenant, priority, shape) are placed in submission order across failovers",
    );
    let Some((_, jobs)) = final_jobs(events) else {
        return c.result;
    };
    type Class<'a> = (&'a str, &'a str, i64, i64, u32);
    let mut classes: BTreeMap<Class, Vec<&JobView>> = BTreeMap::new();
    for j in jobs {
        if j.placed_ms.is_some() && !j.requeued && !j.has_dependencies && !j.scheduling_rules {
            classes
                .entry((
                    &j.tenant,
                    &j.priority,
                    j.gpus_per_task,
                    j.tasks,
                    j.gpu_milli,
                ))
                .or_default()
                .push(j);
        }
    }
    for (class, mut list) in classes {
        list.sort_by_key(|j| j.id);
        // The earlier job placed last so far: any later job placed before it overtook it.
        let mut latest: Option<&JobView> = None;
        for j in list {
            let placed = j.placed_ms.unwrap_or_default();
            if let Some(e) = latest {
                let e_placed = e.placed_ms.unwrap_or_default();
                if placed < e_placed {
                    c.violation(format!(
                        "job {} (submitted {} ms) was placed at {placed} ms, before the earlier \
                         alike job {} (submitted {} ms, placed {e_placed} ms); class {class:?}",
                        j.id, j.submitted_ms, e.id, e.submitted_ms
                    ));
                    continue;
                }
            }
            if latest.is_none_or(|e| e.placed_ms <= j.placed_ms) {
                latest = Some(j);
            }
        }
    }
    c.result
}

/// Invariant 6: after the faults stopped, every job left the queue.
fn progress(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        PROGRESS,
        "once faults stop, every runnable job is placed (none left pending at the end)",
    );
    let Some((settled, jobs)) = final_jobs(events) else {
        c.violation("the history has no final state".into());
        return c.result;
    };
    let pending: Vec<u64> = jobs
        .iter()
        .filter(|j| j.state == "pending" && !j.has_dependencies)
        .map(|j| j.id)
        .collect();
    for id in &pending {
        c.violation(format!("job {id} is still pending at the end of the run"));
    }
    if !settled && pending.is_empty() {
        c.violation("the cluster did not settle before the deadline".into());
    }
    c.result
}

/// A deposed leader must not decide anything: allocation ids are given in log order, so their
/// leader terms never go down. A placement from an old term after one from a newer term is
/// a decision of a stale leader that made it into the state.
fn no_stale_leader(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        NO_STALE_LEADER,
        "no placement of an old leader term is applied after one of a newer term",
    );
    let mut allocs: BTreeMap<u64, (u64, u64, String)> = BTreeMap::new();
    for (_, jobs) in state_views(events) {
        for j in jobs {
            for a in &j.allocs {
                allocs.insert(a.id, (a.term, j.id, a.node.clone()));
            }
        }
    }
    let mut highest: Option<(u64, u64)> = None;
    for (id, (term, job, node)) in &allocs {
        if let Some((t, by)) = highest
            && *term < t
        {
            c.violation(format!(
                "allocation {id} (job {job} on {node}) carries term {term}, after allocation \
                 {by} of term {t}"
            ));
            continue;
        }
        highest = Some((*term, *id));
    }
    for e in events {
        if let Event::Failover {
            old_term,
            new_term,
            new_leader,
            old_leader,
            ..
        } = e
            && (new_term <= old_term || new_leader == old_leader)
        {
            c.violation(format!(
                "failover from leader {old_leader} (term {old_term}) to {new_leader} (term \
                 {new_term}) did not elect a new leader in a newer term"
            ));
        }
    }
    c.result
}

/// A replica or agent that panicked is a bug even when the others carried on (a replica whose
/// Raft task died keeps answering with what it last knew, e.g. that it is the leader).
fn no_crash(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        NO_CRASH,
        "no replica or agent process panicked or stopped on a fatal error",
    );
    for e in events {
        if let Event::Crash { process, line } = e {
            c.violation(format!("{process}: {line}"));
        }
    }
    c.result
}

/// A replica removed from the membership stops taking part: it says it was removed (or exits)
/// and never campaigns again (its term does not climb while it is watched).
fn removed_stays_out(events: &[Event]) -> InvariantResult {
    let mut c = Collector::new(
        REMOVED_STAYS_OUT,
        "a removed replica stops or goes inert (no campaigning: its term does not climb)",
    );
    for e in events {
        if let Event::MemberChange {
            removed,
            stopped_after_ms,
            exited_by_itself,
            term_when_stopped,
            term_after_watch,
            watched_ms,
            ..
        } = e
        {
            if stopped_after_ms.is_none() {
                c.violation(format!(
                    "replica {removed} neither said it was removed nor exited after its removal"
                ));
            } else if !exited_by_itself && term_after_watch > term_when_stopped {
                c.violation(format!(
                    "removed replica {removed} went from term {term_when_stopped} to \
                     {term_after_watch} within {watched_ms} ms: it campaigned"
                ));
            }
        }
    }
    c.result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{AllocView, FaultKind, TenantLimit};

    fn job(id: u64, key: &str) -> JobView {
        JobView {
            id,
            key: key.into(),
            tenant: "t".into(),
            priority: "normal".into(),
            gpus_per_task: 1,
            tasks: 1,
            gpu_milli: 0,
            state: "succeeded".into(),
            submitted_ms: id * 10,
            placed_ms: Some(id * 10 + 5),
            requeued: false,
            has_dependencies: false,
            scheduling_rules: false,
            allocs: vec![],
            replica: None,
        }
    }

    fn alloc(id: u64, node: &str, gpus: &[&str], milli: u32, term: u64) -> AllocView {
        AllocView {
            id,
            node: node.into(),
            gpus: gpus.iter().map(|s| s.to_string()).collect(),
            milli,
            term,
            created_ms: 0,
        }
    }

    fn submit_ok(op: u64, key: &str, job: u64) -> Event {
        Event::Op {
            op,
            client: 0,
            kind: OpKind::Submit {
                key: key.into(),
                tenant: "t".into(),
                priority: "normal".into(),
                gpus_per_task: 1,
                tasks: 1,
                gpu_milli: 0,
            },
            invoked_ms: 1,
            completed_ms: Some(2),
            outcome: Outcome::Ok { job, created: true },
        }
    }

    fn final_state(jobs: Vec<JobView>) -> Event {
        Event::Final {
            at_ms: 1000,
            settled: true,
            jobs,
            services: vec![],
        }
    }

    fn start(node: &str, allocation: u64, job: u64, gpus: &[&str], at: u64) -> Event {
        Event::Usage {
            node: node.into(),
            record: UsageRecord::Start {
                allocation,
                job,
                gpus: gpus.iter().map(|s| s.to_string()).collect(),
                pid: 1,
                at_ms: at,
                share: None,
                mig_parents: Default::default(),
            },
        }
    }

    fn stop(node: &str, allocation: u64, gpus: &[&str], at: u64) -> Event {
        Event::Usage {
            node: node.into(),
            record: UsageRecord::Stop {
                allocation,
                gpus: gpus.iter().map(|s| s.to_string()).collect(),
                at_ms: at,
                exited_at_ms: None,
            },
        }
    }

    fn only(report: &Report, name: &str) -> usize {
        for i in &report.invariants {
            if i.name != name {
                assert_eq!(
                    i.violations, 0,
                    "unexpected violation of {}: {:?}",
                    i.name, i
                );
            }
        }
        report.get(name).unwrap().violations
    }

    #[test]
    fn a_clean_history_passes() {
        let mut j1 = job(1, "a");
        j1.allocs = vec![alloc(1, "n1", &["g0"], 0, 2)];
        j1.state = "running".into();
        let events = vec![
            submit_ok(1, "a", 1),
            submit_ok(2, "b", 2),
            submit_ok(3, "a", 1),
            start("n1", 1, 1, &["g0"], 10),
            stop("n1", 1, &["g0"], 20),
            start("n1", 2, 2, &["g0"], 20),
            stop("n1", 2, &["g0"], 30),
            final_state(vec![j1, job(2, "b")]),
        ];
        let r = check(&events);
        assert_eq!(r.violations(), 0, "{r:#?}");
    }

    #[test]
    fn a_lost_acknowledged_job_is_reported() {
        let events = vec![
            submit_ok(1, "a", 1),
            submit_ok(2, "b", 2),
            final_state(vec![job(1, "a")]),
        ];
        let r = check(&events);
        assert_eq!(only(&r, ACKED_ONCE), 1);
        assert!(r.get(ACKED_ONCE).unwrap().evidence[0].contains("job 2"));
    }

    #[test]
    fn a_key_that_made_two_jobs_is_reported() {
        let events = vec![
            submit_ok(1, "a", 1),
            submit_ok(2, "a", 2),
            final_state(vec![job(1, "a"), job(2, "a")]),
        ];
        let r = check(&events);
        // Two jobs for one key, and the key acknowledged with two ids.
        assert_eq!(only(&r, ACKED_ONCE), 2);
    }

    #[test]
    fn two_live_allocations_on_one_gpu_are_reported() {
        let mut j1 = job(1, "a");
        j1.allocs = vec![alloc(1, "n1", &["g0", "g1"], 0, 2)];
        let mut j2 = job(2, "b");
        j2.allocs = vec![alloc(2, "n1", &["g1"], 0, 2)];
        // Two shares that fit are fine.
        let mut j3 = job(3, "c");
        j3.allocs = vec![alloc(3, "n1", &["g5"], 500, 2)];
        let mut j4 = job(4, "d");
        j4.allocs = vec![alloc(4, "n1", &["g5"], 500, 2)];
        let events = vec![
            Event::Snapshot {
                at_ms: 5,
                jobs: vec![j1, j2, j3, j4],
            },
            final_state(vec![job(1, "a"), job(2, "b"), job(3, "c"), job(4, "d")]),
        ];
        let r = check(&events);
        assert_eq!(only(&r, NO_DOUBLE_BOOKING), 1);
        assert!(r.get(NO_DOUBLE_BOOKING).unwrap().evidence[0].contains("g1"));
    }

    #[test]
    fn two_processes_on_one_gpu_are_reported() {
        let events = vec![
            start("n1", 1, 1, &["g0"], 10),
            start("n1", 2, 2, &["g0"], 15),
            stop("n1", 1, &["g0"], 20),
            stop("n1", 2, &["g0"], 30),
            final_state(vec![job(1, "a"), job(2, "b")]),
        ];
        let r = check(&events);
        assert_eq!(only(&r, NO_SHARED_PROCESS), 1);
    }

    #[test]
    fn a_job_running_on_two_nodes_is_reported_using_the_real_exit_time() {
        // The first copy's journal stop came late (its agent was down), but the exit file
        // shows it ended before the second copy started: no violation.
        let clean = vec![
            start("n1", 1, 7, &["g0"], 10),
            start("n2", 2, 7, &["g0"], 50),
            stop("n1", 1, &["g0"], 60),
            Event::ProcessExit {
                node: "n1".into(),
                allocation: 1,
                at_ms: 40,
                fenced: true,
            },
            stop("n2", 2, &["g0"], 70),
            final_state(vec![job(7, "a")]),
        ];
        assert_eq!(check(&clean).violations(), 0);
        // The same, with the real end in the journal's stop line.
        let journaled = vec![
            start("n1", 1, 7, &["g0"], 10),
            start("n2", 2, 7, &["g0"], 50),
            Event::Usage {
                node: "n1".into(),
                record: UsageRecord::Stop {
                    allocation: 1,
                    gpus: vec!["g0".into()],
                    at_ms: 60,
                    exited_at_ms: Some(40),
                },
            },
            stop("n2", 2, &["g0"], 70),
            final_state(vec![job(7, "a")]),
        ];
        assert_eq!(check(&journaled).violations(), 0);
        // Without the fence the two overlap.
        let broken = vec![
            start("n1", 1, 7, &["g0"], 10),
            start("n2", 2, 7, &["g0"], 50),
            stop("n1", 1, &["g0"], 60),
            stop("n2", 2, &["g0"], 70),
            final_state(vec![job(7, "a")]),
        ];
        let r = check(&broken);
        assert_eq!(only(&r, ONE_COPY), 1);
        let e = &r.get(ONE_COPY).unwrap().evidence[0];
        assert!(e.contains("n1") && e.contains("n2"), "{e}");
    }

    #[test]
    fn two_allocations_of_a_one_task_job_in_the_state_are_reported() {
        let mut j = job(1, "a");
        j.allocs = vec![alloc(1, "n1", &["g0"], 0, 2), alloc(2, "n2", &["g0"], 0, 2)];
        let events = vec![
            Event::Snapshot {
                at_ms: 5,
                jobs: vec![j],
            },
            final_state(vec![job(1, "a")]),
        ];
        assert_eq!(only(&check(&events), ONE_COPY), 1);
    }

    #[test]
    fn a_tenant_over_its_limit_is_reported() {
        let mut j1 = job(1, "a");
        j1.allocs = vec![alloc(1, "n1", &["g0", "g1"], 0, 2)];
        let mut j2 = job(2, "b");
        j2.allocs = vec![alloc(2, "n1", &["g2"], 0, 2)];
        let events = vec![
            Event::Config {
                at_ms: 0,
                seed: 0,
                replicas: vec![],
                agents: vec![],
                tenants: vec![TenantLimit {
                    name: "t".into(),
                    max_gpus: 2,
                }],
            },
            Event::Snapshot {
                at_ms: 5,
                jobs: vec![j1, j2],
            },
            final_state(vec![job(1, "a"), job(2, "b")]),
        ];
        assert_eq!(only(&check(&events), QUOTAS), 1);
    }

    #[test]
    fn a_later_alike_job_placed_first_is_reported() {
        let mut j1 = job(1, "a");
        let mut j2 = job(2, "b");
        j1.placed_ms = Some(100);
        j2.placed_ms = Some(50);
        // A different shape may overtake (backfill): not a violation.
        let mut j3 = job(3, "c");
        j3.gpus_per_task = 4;
        j3.placed_ms = Some(10);
        let events = vec![final_state(vec![j1, j2, j3])];
        let r = check(&events);
        assert_eq!(only(&r, QUEUE_ORDER), 1);
        assert!(r.get(QUEUE_ORDER).unwrap().evidence[0].contains("job 2"));
    }

    #[test]
    fn a_panicked_process_is_reported() {
        let events = vec![
            Event::Crash {
                process: "replica 2".into(),
                line: "thread 'x' panicked at raft.rs:1:1".into(),
            },
            final_state(vec![]),
        ];
        assert_eq!(only(&check(&events), NO_CRASH), 1);
    }

    #[test]
    fn a_job_left_pending_is_reported() {
        let mut j = job(1, "a");
        j.state = "pending".into();
        j.placed_ms = None;
        let events = vec![final_state(vec![j])];
        assert_eq!(only(&check(&events), PROGRESS), 1);
    }

    #[test]
    fn a_placement_from_an_older_term_after_a_newer_one_is_reported() {
        let mut j1 = job(1, "a");
        j1.allocs = vec![alloc(10, "n1", &["g0"], 0, 5)];
        let mut j2 = job(2, "b");
        j2.allocs = vec![alloc(11, "n1", &["g1"], 0, 4)];
        let events = vec![
            Event::Snapshot {
                at_ms: 5,
                jobs: vec![j1, j2],
            },
            Event::Failover {
                fault: FaultKind::LeaderPause,
                old_leader: 1,
                old_term: 4,
                new_leader: 2,
                new_term: 5,
                injected_ms: 1,
                committed_ms: 2,
            },
            final_state(vec![job(1, "a"), job(2, "b")]),
        ];
        let r = check(&events);
        assert_eq!(only(&r, NO_STALE_LEADER), 1);
        assert!(r.get(NO_STALE_LEADER).unwrap().evidence[0].contains("allocation 11"));
    }

    fn member_change(stopped: Option<u64>, term_before: u64, term_after: u64) -> Event {
        Event::MemberChange {
            at_ms: 1,
            added: 4,
            promoted_after_ms: 1200,
            removed: 1,
            removed_was_leader: true,
            stopped_after_ms: stopped,
            exited_by_itself: false,
            term_when_stopped: term_before,
            term_after_watch: term_after,
            watched_ms: 1000,
            members: vec![],
        }
    }

    #[test]
    fn a_removed_replica_that_stays_out_passes() {
        let events = vec![member_change(Some(30), 7, 7), final_state(vec![])];
        assert_eq!(only(&check(&events), REMOVED_STAYS_OUT), 0);
    }

    #[test]
    fn a_removed_replica_that_campaigns_or_never_stops_is_reported() {
        let events = vec![
            member_change(Some(30), 7, 9),
            member_change(None, 7, 7),
            final_state(vec![]),
        ];
        let r = check(&events);
        assert_eq!(only(&r, REMOVED_STAYS_OUT), 2);
        let evidence = &r.get(REMOVED_STAYS_OUT).unwrap().evidence;
        assert!(evidence[0].contains("term 7 to 9"), "{evidence:?}");
        assert!(evidence[1].contains("neither"), "{evidence:?}");
    }

    /// A running replica job of `svc` at `ordinal`.
    fn replica_job(id: u64, ordinal: u32) -> JobView {
        JobView {
            state: "running".into(),
            scheduling_rules: true,
            replica: Some(crate::history::ReplicaView {
                service: "team-c/svc".into(),
                ordinal,
                revision: 1,
                ready: true,
            }),
            ..job(id, "")
        }
    }

    fn service_change(at: u64, answered: Option<u64>, replicas: u32) -> Event {
        Event::ServiceChange {
            at_ms: at,
            service: "team-c/svc".into(),
            change: format!("Scale({replicas})"),
            replicas,
            max_surge: 1,
            answered_ms: answered,
        }
    }

    fn service_view(replicas: u32, ready: u32, rollout: &str) -> crate::history::ServiceView {
        crate::history::ServiceView {
            key: "team-c/svc".into(),
            replicas,
            max_surge: 1,
            revision: 2,
            rollout: rollout.into(),
            ready,
            updated: ready,
            deleting: false,
        }
    }

    #[test]
    fn a_service_restored_within_its_limits_passes() {
        let events = vec![
            service_change(0, Some(5), 2),
            start("n1", 1, 1, &["g0"], 10),
            start("n2", 2, 2, &["g1"], 12),
            // Ordinal 0 crashed and restarted in place (a new allocation of the same job)
            // only after its first process ended.
            stop("n1", 1, &["g0"], 20),
            start("n1", 3, 1, &["g0"], 21),
            Event::Final {
                at_ms: 1000,
                settled: true,
                jobs: vec![replica_job(1, 0), replica_job(2, 1)],
                services: vec![service_view(2, 2, "complete")],
            },
        ];
        let r = check(&events);
        assert_eq!(r.violations(), 0, "{:?}", r.invariants);
    }

    #[test]
    fn two_copies_of_one_ordinal_are_reported() {
        // Job 2 replaced ordinal 0 on another node while the first copy still ran there.
        let mut second = replica_job(2, 0);
        second.id = 2;
        let events = vec![
            service_change(0, Some(5), 2),
            start("n1", 1, 1, &["g0"], 10),
            start("n2", 2, 2, &["g1"], 15),
            stop("n1", 1, &["g0"], 30),
            Event::Final {
                at_ms: 1000,
                settled: true,
                jobs: vec![replica_job(1, 0), second],
                services: vec![service_view(2, 2, "complete")],
            },
        ];
        let r = check(&events);
        assert_eq!(only(&r, SERVICE_ORDINAL_ONCE), 1);
    }

    #[test]
    fn copies_over_replicas_plus_surge_are_reported_after_the_slack() {
        // Scaled from 3 to 1 (answered at 100): a fourth copy at 50 is within 3 + 1; once the
        // slack has passed the limit is 1 + 1, and a third copy then is one too many.
        let mut events = vec![
            service_change(0, Some(5), 3),
            service_change(90, Some(100), 1),
        ];
        for (alloc, at) in [(1, 10), (2, 11), (3, 12), (4, 50)] {
            events.push(start(&format!("n{alloc}"), alloc, alloc, &["g0"], at));
        }
        for alloc in 1..=4 {
            events.push(stop(&format!("n{alloc}"), alloc, &["g0"], 60));
        }
        let late = 100 + SERVICE_BOUND_SLACK_MS + 1;
        for (alloc, at) in [(5, late), (6, late + 1), (7, late + 2)] {
            events.push(start(&format!("n{alloc}"), alloc, alloc, &["g0"], at));
        }
        let jobs = (1..=7).map(|i| replica_job(i, i as u32)).collect();
        events.push(Event::Final {
            at_ms: late + 10,
            settled: true,
            jobs,
            services: vec![service_view(1, 1, "complete")],
        });
        let r = check(&events);
        assert_eq!(only(&r, SERVICE_COPIES), 1, "{:?}", r.get(SERVICE_COPIES));
        assert!(
            r.get(SERVICE_COPIES).unwrap().evidence[0].contains("ran 3 copies"),
            "{:?}",
            r.get(SERVICE_COPIES)
        );
    }

    #[test]
    fn a_service_not_back_at_its_replicas_is_reported() {
        let events = vec![
            service_change(0, Some(5), 3),
            Event::Final {
                at_ms: 1000,
                settled: false,
                jobs: vec![],
                services: vec![service_view(3, 2, "progressing")],
            },
        ];
        let r = check(&events);
        assert_eq!(r.get(SERVICE_RESTORED).unwrap().violations, 1);
    }
}
