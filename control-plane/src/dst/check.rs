//! The invariants of docs/ARCHITECTURE.md, checked while a seed runs and at its end.
//!
//! - `Observer` sees the simulated hosts: every process start and stop, at the simulated
//!   instant it happens. It checks on the spot that no GPU (or MIG slice) is used by two
//!   processes, that shares of one GPU stay within 1000 milli, that no job runs from two
//!   placements, and that no tenant's running processes exceed its limit.
//! - `check_replicas` looks at every live replica's applied state: its internal consistency
//!   (`check_consistency`: no GPU held by two live allocations, shares within a GPU), quotas,
//!   and that two replicas at the same applied index hold identical state.
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
    pub tasks_succeeded: u64,
    /// The events themselves, when `GPUCP_DST_TRACE` asks for them (to compare two runs).
    pub trace: Option<Vec<String>>,
    /// Acknowledged jobs that want their nodes to themselves (`--exclusive`): every job of an
    /// exclusive array too.
    exclusive: BTreeSet<JobId>,
    /// Acknowledged arrays with a limit: first id → (jobs, most running at once).
    arrays: BTreeMap<JobId, (u64, u32)>,
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
    let open: Vec<_> = state
        .jobs
        .values()
        .filter(|j| !j.state.is_final())
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
