//! The recorded history of a chaos run: one JSON object per line, appended as things happen,
//! so that a run can be checked again later (`chaos check HISTORY`) and a violation can be
//! traced back to the operations, faults and process starts around it.
//!
//! Times are wall-clock milliseconds since the Unix epoch, the same clock the replicas stamp
//! into the log and the agents write into their usage journals (everything runs on one host).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use node_agent::runtime::UsageRecord;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// First line: what was started, with which limits.
    Config {
        at_ms: u64,
        seed: u64,
        replicas: Vec<Member>,
        agents: Vec<Member>,
        tenants: Vec<TenantLimit>,
    },
    /// One client operation, written when it completes (or at the end, if it never did).
    Op {
        op: u64,
        client: u32,
        kind: OpKind,
        invoked_ms: u64,
        /// None: still outstanding when the run ended.
        completed_ms: Option<u64>,
        outcome: Outcome,
    },
    /// A fault the harness injected; `healed_ms` is when it was undone (restart, SIGCONT, rules
    /// removed), None for faults that are over at once.
    Fault {
        kind: FaultKind,
        target: String,
        at_ms: u64,
        healed_ms: Option<u64>,
        detail: String,
    },
    /// A leader fault and the first write committed after it through the other replicas.
    Failover {
        fault: FaultKind,
        old_leader: u64,
        old_term: u64,
        new_leader: u64,
        new_term: u64,
        injected_ms: u64,
        committed_ms: u64,
    },
    /// A membership change (`replica_add_remove`): replica `added` started empty, added with
    /// AddReplica and a voter `promoted_after_ms` after the call; then replica `removed` (the
    /// leader when `removed_was_leader`) taken out with RemoveReplica. `stopped_after_ms`: from
    /// the removal's answer until the removed process said it was removed (or exited); None if
    /// it did neither within the limit. Its term, read when it stopped and again after
    /// `watched_ms`, must not climb (a removed replica must not campaign). `members`: the
    /// replicas the harness talks to from now on.
    MemberChange {
        at_ms: u64,
        added: u64,
        promoted_after_ms: u64,
        removed: u64,
        removed_was_leader: bool,
        stopped_after_ms: Option<u64>,
        exited_by_itself: bool,
        term_when_stopped: u64,
        term_after_watch: u64,
        watched_ms: u64,
        members: Vec<Member>,
    },
    /// A replica restarted on another build (`replica_upgrade`): SIGTERM (SIGKILL once
    /// `sigkilled`), restarted from `to` (a file; the running process's /proc/PID/exe was
    /// checked to be it), caught up `caught_up_after_ms` after the signal.
    Upgrade {
        at_ms: u64,
        replica: u64,
        was_leader: bool,
        from: String,
        to: String,
        exe: String,
        sigkilled: bool,
        exited_after_ms: u64,
        caught_up_after_ms: u64,
        cluster_version: u32,
    },
    /// The live jobs as one replica's applied state showed them at `at_ms`.
    Snapshot { at_ms: u64, jobs: Vec<JobView> },
    /// One line of an agent's GPU usage journal (process start/stop on which GPUs).
    Usage { node: String, record: UsageRecord },
    /// When a workload process really ended, from the shim's exit file. The journal's stop
    /// line is written when the agent observes the exit, which is later when the agent was
    /// down at the time; the checker takes the earlier of the two.
    ProcessExit {
        node: String,
        allocation: u64,
        at_ms: u64,
        fenced: bool,
    },
    /// A replica or agent process panicked or stopped on a fatal error (the line of its log).
    Crash { process: String, line: String },
    /// The workload's service was sent a change at `at_ms`: from then on it may run up to
    /// `replicas + max_surge` copies (until the change after it is answered).
    ServiceChange {
        at_ms: u64,
        service: String,
        change: String,
        replicas: u32,
        max_surge: u32,
        /// When the change was answered (None: never).
        answered_ms: Option<u64>,
    },
    /// Every job at the end of the run, after the faults stopped and the cluster settled.
    Final {
        at_ms: u64,
        /// Whether every batch job left the queue, and every service was back at its replicas,
        /// before the settle deadline.
        settled: bool,
        jobs: Vec<JobView>,
        /// Every service at that moment.
        #[serde(default)]
        services: Vec<ServiceView>,
    },
}

/// What the checker needs of a service (a projection of the API's `Service`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceView {
    pub key: String,
    pub replicas: u32,
    pub max_surge: u32,
    pub revision: u64,
    pub rollout: String,
    pub ready: u32,
    /// Ready replicas of the current revision.
    pub updated: u32,
    pub deleting: bool,
}

impl ServiceView {
    pub fn from_proto(s: &proto::v1::Service) -> ServiceView {
        let spec = s.spec.clone().unwrap_or_default();
        ServiceView {
            key: format!("{}/{}", spec.tenant, spec.name),
            replicas: spec.replicas,
            max_surge: spec
                .strategy
                .as_ref()
                .and_then(|st| st.max_surge)
                .unwrap_or(1),
            revision: s.revision,
            rollout: s.rollout.clone(),
            ready: s.ready,
            updated: s.updated,
            deleting: s.deleting,
        }
    }

    /// Back at what was asked: every replica ready at the current revision, nothing left over.
    pub fn restored(&self) -> bool {
        !self.deleting
            && self.rollout == "complete"
            && self.ready == self.replicas
            && self.updated == self.replicas
    }
}

/// A job that is a service's replica: which one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReplicaView {
    pub service: String,
    pub ordinal: u32,
    pub revision: u64,
    pub ready: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub name: String,
    pub addr: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantLimit {
    pub name: String,
    /// Hard limit in GPUs; 0: none.
    pub max_gpus: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    Submit {
        key: String,
        tenant: String,
        priority: String,
        gpus_per_task: i64,
        tasks: i64,
        gpu_milli: u32,
    },
    Cancel {
        job: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// Acknowledged. For a submission, the job id and whether this call created it.
    Ok { job: u64, created: bool },
    /// Definitely not done (the server refused it).
    Fail { error: String },
    /// Maybe done: the client gave up (timeout, no replica reachable).
    Unknown { error: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    LeaderKill,
    FollowerKill,
    LeaderPause,
    LeaderPartition,
    AgentPartition,
    AgentKill,
    ReplicaWipe,
    RollingRestart,
    ReplicaAddRemove,
    ReplicaUpgrade,
}

impl FaultKind {
    pub const ALL: [FaultKind; 10] = [
        FaultKind::LeaderKill,
        FaultKind::FollowerKill,
        FaultKind::LeaderPause,
        FaultKind::LeaderPartition,
        FaultKind::AgentPartition,
        FaultKind::AgentKill,
        FaultKind::ReplicaWipe,
        FaultKind::RollingRestart,
        FaultKind::ReplicaAddRemove,
        FaultKind::ReplicaUpgrade,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::LeaderKill => "leader_kill",
            FaultKind::FollowerKill => "follower_kill",
            FaultKind::LeaderPause => "leader_pause",
            FaultKind::LeaderPartition => "leader_partition",
            FaultKind::AgentPartition => "agent_partition",
            FaultKind::AgentKill => "agent_kill",
            FaultKind::ReplicaWipe => "replica_wipe",
            FaultKind::RollingRestart => "rolling_restart",
            FaultKind::ReplicaAddRemove => "replica_add_remove",
            FaultKind::ReplicaUpgrade => "replica_upgrade",
        }
    }
}

/// What the checker needs of a job (a projection of the API's `Job`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    pub id: u64,
    #[serde(default)]
    pub key: String,
    pub tenant: String,
    pub priority: String,
    pub gpus_per_task: i64,
    pub tasks: i64,
    pub gpu_milli: u32,
    pub state: String,
    pub submitted_ms: u64,
    /// First time the job left the queue (its first `scheduled` state change).
    pub placed_ms: Option<u64>,
    /// It went back to the queue at least once (its placement order is not comparable).
    pub requeued: bool,
    pub has_dependencies: bool,
    /// Held, limited by its array, begun later, or bound to nodes: its placement order is not
    /// its submission order's to decide.
    #[serde(default)]
    pub scheduling_rules: bool,
    pub allocs: Vec<AllocView>,
    /// Set for a service's replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AllocView {
    pub id: u64,
    pub node: String,
    pub gpus: Vec<String>,
    /// Milli-GPU of a share; 0 for whole GPUs.
    pub milli: u32,
    pub term: u64,
    pub created_ms: u64,
}

impl JobView {
    pub fn from_proto(j: &proto::v1::Job) -> JobView {
        let spec = j.spec.clone().unwrap_or_default();
        let placed_ms = j
            .history
            .iter()
            .find(|h| h.state == "scheduled")
            .map(|h| h.at_ms);
        // Pending again after having been scheduled: a requeue.
        let requeued = j
            .history
            .iter()
            .skip_while(|h| h.state != "scheduled")
            .any(|h| h.state == "pending");
        JobView {
            id: j.id,
            key: j.idempotency_key.clone(),
            tenant: spec.tenant,
            priority: if spec.priority_class.is_empty() {
                "normal".into()
            } else {
                spec.priority_class
            },
            gpus_per_task: spec.gpus_per_task,
            tasks: spec.tasks.max(1),
            gpu_milli: spec.gpu_milli,
            state: j.state.clone(),
            submitted_ms: j.submitted_at_ms,
            placed_ms,
            requeued,
            has_dependencies: !spec.dependencies.is_empty(),
            // A replica is placed ahead of its class when its service is below its minimum.
            scheduling_rules: j.replica.is_some()
                || spec.hold
                || spec.array.as_ref().is_some_and(|a| a.max_running > 0)
                || spec.begin_at_ms > 0
                || !spec.nodelist.is_empty()
                || !spec.exclude.is_empty()
                || spec.exclusive,
            allocs: j
                .allocations
                .iter()
                .map(|a| AllocView {
                    id: a.id,
                    node: a.node.clone(),
                    gpus: a.gpus.clone(),
                    milli: a.gpu_milli,
                    term: a.term,
                    created_ms: a.created_at_ms,
                })
                .collect(),
            replica: j.replica.as_ref().map(|r| ReplicaView {
                service: r.service.clone(),
                ordinal: r.ordinal,
                revision: r.revision,
                ready: r.ready,
            }),
        }
    }
}

/// Appends events to a JSON-lines file; cheap to clone and share between tasks.
#[derive(Clone)]
pub struct Recorder {
    file: Arc<Mutex<File>>,
}

impl Recorder {
    pub fn create(path: &Path) -> anyhow::Result<Recorder> {
        let file = File::create(path)
            .with_context(|| format!("creating the history file {}", path.display()))?;
        Ok(Recorder {
            file: Arc::new(Mutex::new(file)),
        })
    }

    /// Writes one line. One `write` per event so a crash leaves at most a torn last line.
    pub fn record(&self, event: &Event) {
        let mut line = serde_json::to_vec(event).expect("history events always serialize");
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = f.write_all(&line) {
            eprintln!("chaos: cannot append to the history file: {e}");
        }
    }
}

/// Reads a history file. A torn last line (the run was killed mid-write) is skipped.
pub fn read(path: &Path) -> anyhow::Result<Vec<Event>> {
    let f = File::open(path).with_context(|| format!("opening history {}", path.display()))?;
    let lines: Vec<String> = BufReader::new(f)
        .lines()
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading history {}", path.display()))?;
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(e) => events.push(e),
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => anyhow::bail!("{} line {}: {e}", path.display(), i + 1),
        }
    }
    Ok(events)
}

pub fn now_ms() -> u64 {
    control_plane::replica::now_ms()
}
