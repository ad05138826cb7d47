//! The invariants of docs/ARCHITECTURE.md, checked while a seed runs and at its end.
//!
//! - `Observer` sees the simulated hosts: every process start and stop, at the simulated
//!   instant it happens. It checks on the spot that no GPU (or MIG slice) is used by two
//!   processes, that shares of one GPU stay within 1000 milli, that no job runs from two
//!   placements, that no tenant's running processes exceed its limit, and a service's rules:
//!   one copy per ordinal, at most `replicas + max_surge` copies (`dst::services`).
//! - `check_replicas` looks at every live replica's applied state: its internal consistency
//!   (`check_consistency`: no GPU held by two live allocations, shares within a GPU, each
//!   service's ordinals), quotas, allocations' terms never going down in id order (no
//!   decision of a deposed leader), a service's copies that are not stopping within
//!   `replicas + max_surge`, and that two replicas at the same applied index hold identical
//!   state.
//! - `check_end` runs once faults have stopped: every acknowledged submission is present
//!   exactly once, every job reached a final state within the budget, replicas converged.
//!
//! It also keeps the event history whose hash shows that a seed replays identically.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::state::{ClusterState, JobId, JobState, MILLI_PER_GPU};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    /// Simulated milliseconds since the seed started.
    pub at_ms: u64,
    pub evidence: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] at {} ms: {}",
            self.invariant, self.at_ms, self.evidence
        )
    }
}

/// A process a simulated host runs for one allocation.
#[derive(Debug, Clone)]
pub struct Process {
    pub node: String,
    pub allocation: u64,
    pub job: JobId,
    pub tenant: String,
    pub gpus: Vec<String>,
    /// Milli of a share; 0 for whole GPUs and MIG slices.
    pub gpu_milli: u32,
    /// Milli-GPU the process counts for against its tenant's limit.
    pub tenant_milli: u64,
    /// (term, created_at) of the allocation: equal for every task of one placement.
    pub placement: (u64, u64),
    /// The service and ordinal, for a replica of a service.
    pub replica: Option<(String, u32)>,
}

/// A value a service's `replicas + max_surge` had: from when the change was sent until every
/// later change was acknowledged (`None`: still in effect, or never known to be replaced).
#[derive(Debug, Clone)]
struct BoundSpan {
    from_ms: u64,
    until_ms: Option<u64>,
    bound: u32,
}

#[derive(Default)]
pub struct Observer {
    /// Running processes by allocation.
    running: BTreeMap<u64, Process>,
    pub violations: Vec<Violation>,
    /// Tenant → most GPUs it may hold (0: no limit).
    pub tenant_limits: BTreeMap<String, u32>,
    history: DefaultHasher,
    pub events: u64,
    pub processes_started: u64,
    /// Processes that were a service's replicas (a start after a crash counts again).
    pub replica_processes_started: u64,
    pub tasks_succeeded: u64,
    /// The events themselves, when `GPUCP_DST_TRACE` asks for them (to compare two runs).
    pub trace: Option<Vec<String>>,
    /// Acknowledged jobs that want their nodes to themselves (`--exclusive`): every job of an
    /// exclusive array too.
    exclusive: BTreeSet<JobId>,
    /// Acknowledged arrays with a limit: first id → (jobs, most running at once).
    arrays: BTreeMap<JobId, (u64, u32)>,
    /// Services: every value their copy limit may have had (`dst::services`).
    service_bounds: BTreeMap<String, Vec<BoundSpan>>,
    /// How long after a limit was replaced a copy placed under it may still start on a host
    /// (the lease and grace during which a host may act on an older assignment).
    pub service_bound_slack_ms: u64,
    /// The service's client made every change of its plan.
    pub service_client_done: bool,
}

impl Observer {
    /// Adds an event to the history whose hash shows a seed is reproducible.
    pub fn record(&mut self, at_ms: u64, event: impl Hash + fmt::Debug) {
        at_ms.hash(&mut self.history);
        event.hash(&mut self.history);
        self.events += 1;
        if let Some(trace) = &mut self.trace {
            trace.push(format!("{at_ms} {event:?}"));
        }
    }

    pub fn history_hash(&self) -> u64 {
        self.history.clone().finish()
    }

    pub fn violation(&mut self, invariant: &'static str, at_ms: u64, evidence: String) {
        // One report per invariant and evidence is enough; a broken state repeats itself.
        if self
            .violations
            .iter()
            .any(|v| v.invariant == invariant && v.evidence == evidence)
        {
            return;
        }
        self.violations.push(Violation {
            invariant,
            at_ms,
            evidence,
        });
    }

    /// What an acknowledged submission asked of the hosts beyond its shape: exclusive nodes,
    /// an array's limit of running jobs. Its jobs are `id..id + jobs`.
    pub fn note_rules(&mut self, id: JobId, spec: &crate::state::JobSpec) {
        let jobs = spec.array.as_ref().map_or(1, |a| a.indices().len() as u64);
        if spec.exclusive {
            self.exclusive.extend(id..id + jobs);
        }
        if let Some(a) = &spec.array
            && a.max_running > 0
        {
            self.arrays.insert(id, (jobs, a.max_running));
        }
    }

    /// The service `key` may run `bound` copies from `at_ms` (when the change was sent).
    pub fn service_bound_changed(&mut self, key: &str, at_ms: u64, bound: u32) {
        self.service_bounds
            .entry(key.to_owned())
            .or_default()
            .push(BoundSpan {
                from_ms: at_ms,
                until_ms: None,
                bound,
            });
    }

    /// A change of the service `key` was acknowledged at `at_ms`: every limit before the
    /// newest one is replaced (changes are sent one after the other).
    pub fn service_change_acked(&mut self, key: &str, at_ms: u64) {
        if let Some(spans) = self.service_bounds.get_mut(key)
            && let Some((_, earlier)) = spans.split_last_mut()
        {
            for span in earlier.iter_mut().filter(|s| s.until_ms.is_none()) {
                span.until_ms = Some(at_ms);
            }
        }
    }

    /// The most copies of `key` that may run at `at_ms`: the greatest limit in effect within
    /// the slack before it.
    fn service_bound(&self, key: &str, at_ms: u64) -> Option<u32> {
        self.service_bounds
            .get(key)?
            .iter()
            .filter(|s| {
                s.from_ms <= at_ms
                    && s.until_ms
                        .is_none_or(|u| u + self.service_bound_slack_ms >= at_ms)
            })
            .map(|s| s.bound)
            .max()
    }

    /// The ordinals of `key` the hosts run now, sorted (one entry per running copy).
    pub fn service_ordinals_running(&self, key: &str) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .running
            .values()
            .filter_map(|p| p.replica.as_ref())
            .filter(|(service, _)| service == key)
            .map(|(_, ordinal)| *ordinal)
            .collect();
        out.sort_unstable();
        out
    }

    /// A service's rules as `p` starts: never two copies of one ordinal, never more copies
    /// than `replicas + max_surge`.
    fn check_service(&mut self, at_ms: u64, p: &Process) {
        let Some((key, ordinal)) = &p.replica else {
            return;
        };
        let twins: Vec<String> = self
            .running
            .values()
            .filter(|o| o.replica.as_ref() == Some(&(key.clone(), *ordinal)))
            .map(|o| format!("allocation {} (job {}) on {}", o.allocation, o.job, o.node))
            .collect();
        if !twins.is_empty() {
            self.violation(
                "one copy per ordinal (hosts)",
                at_ms,
                format!(
                    "replica {ordinal} of {key} started as allocation {} (job {}) on {} while {} still ran",
                    p.allocation,
                    p.job,
                    p.node,
                    twins.join(", ")
                ),
            );
        }
        let copies = self
            .running
            .values()
            .filter(|o| o.replica.as_ref().is_some_and(|(s, _)| s == key))
            .count()
            + 1;
        if let Some(bound) = self.service_bound(key, at_ms)
            && copies > bound as usize
        {
            let ordinals = self.service_ordinals_running(key);
            self.violation(
                "at most replicas + max_surge copies (hosts)",
                at_ms,
                format!(
                    "{key} runs {copies} copies once replica {ordinal} started on {} (running ordinals {ordinals:?}), its limit is {bound}",
                    p.node
                ),
            );
        }
    }

    /// Slurm's rules on the hosts as `p` starts: an exclusive job shares its node with no other
    /// job, and an array runs no more jobs at once than its limit.
    fn check_rules(&mut self, at_ms: u64, p: &Process) {
        let beside: BTreeSet<JobId> = self
            .running
            .values()
            .filter(|o| o.node == p.node && o.job != p.job)
            .map(|o| o.job)
            .collect();
        let exclusive_here = std::iter::once(p.job)
            .chain(beside.iter().copied())
            .find(|j| self.exclusive.contains(j));
        if let Some(ex) = exclusive_here
            && !beside.is_empty()
        {
            self.violation(
                "exclusive nodes (hosts)",
                at_ms,
                format!(
                    "job {} started on {} beside jobs {beside:?}, and job {ex} wants the node to itself",
                    p.job, p.node
                ),
            );
        }
        if let Some((&first, &(jobs, max))) = self.arrays.range(..=p.job).next_back()
            && p.job < first + jobs
        {
            let running: BTreeSet<JobId> = self
                .running
                .values()
                .map(|o| o.job)
                .chain(std::iter::once(p.job))
                .filter(|j| (first..first + jobs).contains(j))
                .collect();
            if running.len() > max as usize {
                self.violation(
                    "array limit (hosts)",
                    at_ms,
                    format!(
                        "array {first} runs jobs {running:?} at once, its limit is {max} (job {} started on {})",
                        p.job, p.node
                    ),
                );
            }
        }
    }

    /// A host starts a process. Checks invariants 1 (host side), 3 and 5 (host side), and
    /// Slurm's rules (exclusive nodes, array limits).
    pub fn start(&mut self, at_ms: u64, p: Process) {
        self.record(at_ms, ("start", &p.node, p.allocation, p.job, &p.gpus));
        self.processes_started += 1;
        if p.replica.is_some() {
            self.replica_processes_started += 1;
        }
        for gpu in &p.gpus {
            let users: Vec<&Process> = self
                .running
                .values()
                .filter(|o| o.gpus.contains(gpu))
                .collect();
            let clash = if p.gpu_milli == 0 {
                !users.is_empty()
            } else {
                users.iter().any(|o| o.gpu_milli == 0)
                    || users.iter().map(|o| o.gpu_milli).sum::<u32>() + p.gpu_milli
                        > MILLI_PER_GPU as u32
            };
            if clash {
                let others: Vec<String> = users
                    .iter()
                    .map(|o| {
                        format!(
                            "allocation {} (job {}, {} milli) on {}",
                            o.allocation, o.job, o.gpu_milli, o.node
                        )
                    })
                    .collect();
                self.violation(
                    "no double booking (hosts)",
                    at_ms,
                    format!(
                        "GPU {gpu}: allocation {} (job {}, {} milli) started on {} while {} still ran on it",
                        p.allocation,
                        p.job,
                        p.gpu_milli,
                        p.node,
                        others.join(", ")
                    ),
                );
            }
        }
        let elsewhere: Vec<String> = self
            .running
            .values()
            .filter(|o| o.job == p.job && o.placement != p.placement)
            .map(|o| format!("allocation {} on {}", o.allocation, o.node))
            .collect();
        if !elsewhere.is_empty() {
            self.violation(
                "at most one running copy",
                at_ms,
                format!(
                    "job {} started as allocation {} on {} while an older placement still ran: {}",
                    p.job,
                    p.allocation,
                    p.node,
                    elsewhere.join(", ")
                ),
            );
        }
        if let Some(&limit) = self.tenant_limits.get(&p.tenant)
            && limit > 0
        {
            let held: u64 = self
                .running
                .values()
                .filter(|o| o.tenant == p.tenant)
                .map(|o| o.tenant_milli)
                .sum::<u64>()
                + p.tenant_milli;
            if held > u64::from(limit) * MILLI_PER_GPU {
                self.violation(
                    "quotas hold (hosts)",
                    at_ms,
                    format!(
                        "tenant {} runs {held} milli-GPU of processes, its limit is {limit} GPUs (allocation {} of job {} on {})",
                        p.tenant, p.allocation, p.job, p.node
                    ),
                );
            }
        }
        self.check_rules(at_ms, &p);
        self.check_service(at_ms, &p);
        self.running.insert(p.allocation, p);
    }

    /// A host's process ended (exited, stopped, killed with its host).
    pub fn stop(&mut self, at_ms: u64, allocation: u64, why: &str) {
        if let Some(p) = self.running.remove(&allocation) {
            self.record(at_ms, ("stop", &p.node, allocation, why));
            if why == "succeeded" {
                self.tasks_succeeded += 1;
            }
        }
    }

    pub fn running_on(&self, node: &str) -> Vec<u64> {
        self.running
            .values()
            .filter(|p| p.node == node)
            .map(|p| p.allocation)
            .collect()
    }
}

/// Checks one replica's applied state on its own: the apply-time rules held.
pub fn check_state(replica: u64, state: &ClusterState) -> Vec<(&'static str, String)> {
    let mut found = Vec::new();
    if let Err(e) = state.check_consistency() {
        found.push((
            "no double booking (replicated state)",
            format!("replica {replica}: {e}"),
        ));
    }
    for t in state.tenants.values().filter(|t| t.max_gpus > 0) {
        let held = state.gpu_milli_held_by_tenant(&t.name);
        if held > u64::from(t.max_gpus) * MILLI_PER_GPU {
            found.push((
                "quotas hold (replicated state)",
                format!(
                    "replica {replica}: tenant {} holds {held} milli-GPU, its limit is {} GPUs",
                    t.name, t.max_gpus
                ),
            ));
        }
    }
    // Allocation ids are given in log order, so their terms never go down: an older term
    // after a newer one is a deposed leader's decision that reached the state.
    let mut newest: Option<(u64, u64)> = None;
    for (id, rec) in &state.allocations {
        let term = rec.allocation.term;
        if let Some((prev_id, prev_term)) = newest
            && term < prev_term
        {
            found.push((
                "no decision from a stale leader (replicated state)",
                format!(
                    "replica {replica}: allocation {id} (job {}) carries term {term}, after allocation {prev_id} of term {prev_term}",
                    rec.allocation.job
                ),
            ));
        }
        if newest.is_none_or(|(_, t)| term >= t) {
            newest = Some((*id, term));
        }
    }
    for s in state.services.values() {
        let live: Vec<(u32, JobId)> = s
            .replicas
            .iter()
            .filter(|(_, id)| state.jobs.get(id).is_some_and(|j| !j.state.is_final()))
            .map(|(o, id)| (*o, *id))
            .collect();
        let bound = s.spec.replicas + s.spec.strategy.max_surge;
        if live.len() > bound as usize {
            found.push((
                "at most replicas + max_surge copies (replicated state)",
                format!(
                    "replica {replica}: service {} has {} copies that are not stopping {live:?}, its limit is {bound}",
                    s.key(),
                    live.len()
                ),
            ));
        }
    }
    found
}

/// First difference between two replicas' states at the same applied index, for evidence.
pub fn describe_difference(a: &ClusterState, b: &ClusterState) -> String {
    let ids: BTreeSet<JobId> = a.jobs.keys().chain(b.jobs.keys()).copied().collect();
    for id in ids {
        let (ja, jb) = (a.jobs.get(&id), b.jobs.get(&id));
        if ja != jb {
            return format!(
                "job {id}: {:?} vs {:?}",
                ja.map(|j| (j.state, &j.allocations)),
                jb.map(|j| (j.state, &j.allocations))
            );
        }
    }
    if a.allocations != b.allocations {
        return "allocations differ".into();
    }
    if a.nodes != b.nodes {
        return "nodes differ".into();
    }
    "states differ (outside jobs, allocations and nodes)".into()
}

/// Jobs not yet in a final state, with their recent history, as liveness evidence.
pub fn unfinished(state: &ClusterState, limit: usize) -> (usize, String) {
    // A service's replicas run until it is scaled down or deleted: `services::settled`
    // judges them.
    let open: Vec<_> = state
        .jobs
        .values()
        .filter(|j| !j.state.is_final() && j.replica.is_none())
        .collect();
    let shown: Vec<String> = open
        .iter()
        .take(limit)
        .map(|j| {
            // The last few transitions and where its live allocations are: what a person
            // needs to see why it is stuck.
            let recent: Vec<String> = j
                .history
                .iter()
                .rev()
                .take(3)
                .rev()
                .map(|h| format!("{}@{}: {}", h.state, h.at % 1_000_000, h.reason))
                .collect();
            let allocs: Vec<String> = state
                .allocations_of(j.id)
                .map(|r| {
                    format!(
                        "alloc {} on {} started={} stop={}",
                        r.allocation.id, r.allocation.node, r.started, r.stop_requested
                    )
                })
                .collect();
            let last = format!("{} | {}", recent.join(" -> "), allocs.join(", "));
            format!(
                "job {} ({}x{} GPUs{}, tenant {}) {} ({last})",
                j.id,
                j.spec.tasks,
                j.spec.gpus_per_task,
                j.spec
                    .mig_profile
                    .as_deref()
                    .map(|p| format!(" {p}"))
                    .unwrap_or_default(),
                j.spec.tenant,
                j.state
            )
        })
        .collect();
    (open.len(), shown.join("; "))
}

/// Counts of jobs by final state, for the summary.
pub fn completed(state: &ClusterState) -> u64 {
    state
        .jobs
        .values()
        .filter(|j| j.state == JobState::Succeeded)
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(allocation: u64, job: JobId, node: &str, ordinal: u32) -> Process {
        Process {
            node: node.into(),
            allocation,
            job,
            tenant: "t1".into(),
            gpus: vec![format!("GPU-{node}-{allocation}")],
            gpu_milli: 0,
            tenant_milli: 1000,
            placement: (1, allocation),
            replica: Some(("t1/svc".into(), ordinal)),
        }
    }

    fn invariants(o: &Observer) -> Vec<&'static str> {
        o.violations.iter().map(|v| v.invariant).collect()
    }

    #[test]
    fn a_second_copy_of_an_ordinal_is_reported_and_a_restart_after_the_first_is_not() {
        let mut o = Observer::default();
        o.service_bound_changed("t1/svc", 0, 3);
        o.start(10, replica(1, 100, "h1", 0));
        o.stop(20, 1, "failed");
        // Restarted in place: a new allocation of the same job, after the first ended.
        o.start(21, replica(2, 100, "h1", 0));
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        // Replaced elsewhere (another job) while the copy on h1 still runs.
        o.start(30, replica(3, 101, "h2", 0));
        assert_eq!(invariants(&o), vec!["one copy per ordinal (hosts)"]);
    }

    #[test]
    fn copies_beyond_replicas_plus_surge_are_reported_once_the_old_limit_has_expired() {
        let mut o = Observer {
            service_bound_slack_ms: 100,
            ..Observer::default()
        };
        o.service_bound_changed("t1/svc", 0, 3);
        o.service_change_acked("t1/svc", 5);
        for (a, ordinal) in [(1, 0), (2, 1), (3, 2)] {
            o.start(10, replica(a, 100 + a, "h1", ordinal));
        }
        // Scaled down to 1 + 1 surge at 50, answered at 60.
        o.service_bound_changed("t1/svc", 50, 2);
        o.service_change_acked("t1/svc", 60);
        o.stop(70, 3, "stopped");
        o.stop(70, 2, "stopped");
        // Within the slack after the old limit was replaced: 3 copies are still allowed.
        o.start(150, replica(4, 104, "h2", 1));
        o.start(155, replica(5, 105, "h2", 2));
        assert!(o.violations.is_empty(), "{:?}", o.violations);
        o.stop(156, 5, "stopped");
        // After it: 3 copies are one too many.
        o.start(200, replica(6, 106, "h2", 3));
        assert_eq!(
            invariants(&o),
            vec!["at most replicas + max_surge copies (hosts)"]
        );
    }
}
