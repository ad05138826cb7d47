//! Commands: the only way the replicated state changes. Each is one Raft log entry, stamped by
//! the leader that proposed it (`Request::at`), so `apply` never reads a clock.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::access::TokenRecord;
use super::audit::{Actor, AuditRetention};
use super::format::{self, FormatVersion};
use super::service::ServiceSpec;
use super::types::{
    AllocationId, GpuHealth, JobId, JobRetention, JobSpec, NodeSpec, NodeStatus, Partition, Tenant,
    Timestamp,
};

/// The Raft entry payload. Encoded in the shape of its `format` (`format` module): format 1 as
/// `{"at","command"}`, later ones as `{"format":N,"request":{"at","command"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The format the entry is written in: the cluster version when the leader proposed it.
    pub format: FormatVersion,
    /// Leader's wall clock when it proposed the command (ms since the Unix epoch).
    pub at: Timestamp,
    pub command: Command,
}

impl Request {
    /// A request in the format this binary writes by default (tests, tools, benchmarks).
    pub fn new(at: Timestamp, command: Command) -> Request {
        Request {
            format: format::CURRENT,
            at,
            command,
        }
    }
}

/// One task of a job placed on GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskPlacement {
    pub node: String,
    pub gpus: Vec<String>,
}

/// Every task of one job: accepted whole or not at all (gangs are never partially placed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobPlacement {
    pub job: JobId,
    pub tasks: Vec<TaskPlacement>,
}

/// What `Command::ChangeJobs` does to each of its jobs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobChange {
    /// A pending job is not considered until released (Slurm's `scontrol hold`).
    Hold,
    /// A held job waits again, its queue time counted from now (`scontrol release`).
    Release,
    /// A running job is stopped and queued again; a finished one is queued again
    /// (`scontrol requeue`).
    Requeue { reason: String },
    /// As `Command::CancelJob`, for each job (`scancel` of a whole array).
    Cancel { reason: String },
    /// Change a pending job's request (`scontrol update`); a running job's name only.
    Update(JobUpdate),
}

/// The fields `JobChange::Update` sets; `None` leaves one as it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct JobUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Seconds; `Some(0)`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class: Option<String>,
    /// `Some("")`: no partition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// `Some(0)`: no begin time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodelist: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude: Option<Vec<String>>,
    /// An array's `%N` (0: no limit); for every job of the array.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
}

impl JobUpdate {
    pub fn is_empty(&self) -> bool {
        *self == JobUpdate::default()
    }

    /// Whether only fields that may change while the job runs are set.
    pub fn only_running_fields(&self) -> bool {
        JobUpdate {
            name: None,
            max_running: None,
            ..self.clone()
        }
        .is_empty()
    }
}

impl JobChange {
    pub fn verb(&self) -> &'static str {
        match self {
            JobChange::Hold => "hold",
            JobChange::Release => "release",
            JobChange::Requeue { .. } => "requeue",
            JobChange::Cancel { .. } => "cancel",
            JobChange::Update(_) => "update",
        }
    }
}

/// What `Command::ServiceRollout` does to a service's rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutAction {
    /// Stop replacing replicas (an operator, or the leader when the rollout made no progress
    /// within its deadline).
    Pause { reason: String },
    /// Go on replacing replicas; the progress deadline counts afresh.
    Resume,
    /// Go back to an earlier revision's template (the one before the current by default):
    /// replicas of the current revision are replaced by copies of that one.
    Undo { to_revision: Option<u64> },
}

impl RolloutAction {
    pub fn verb(&self) -> &'static str {
        match self {
            RolloutAction::Pause { .. } => "pause",
            RolloutAction::Resume => "resume",
            RolloutAction::Undo { .. } => "undo",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskOutcome {
    Succeeded,
    Failed {
        exit_code: Option<i32>,
        signal: Option<i32>,
        reason: String,
    },
    TimedOut,
    /// The node or GPU failed under it: the job goes back to the queue.
    Lost {
        reason: String,
    },
    /// Stopped because the control plane asked (cancel, eviction, another task failed): the
    /// job's recorded ending decides what happens next.
    Stopped,
}

/// What one task's cgroup measured, reported with its exit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskUsage {
    pub cpu_ms: u64,
    pub peak_memory_bytes: u64,
    pub oom_kills: u64,
    /// From the driver's per-process samples (NVML hosts; 0 elsewhere): rounds it was seen
    /// on a GPU, its average SM utilisation (percent, over its GPUs), its GPU memory peak.
    #[serde(default, skip_serializing_if = "super::types::is_zero")]
    pub gpu_samples: u64,
    #[serde(default, skip_serializing_if = "super::types::is_zero")]
    pub gpu_sm_percent_avg: u64,
    #[serde(default, skip_serializing_if = "super::types::is_zero")]
    pub gpu_peak_memory_bytes: u64,
}

// A submission carries the whole spec inline: submissions are most of what clients write, and
// a box per submission would cost an allocation on the hot path to save stack in the rest.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    SubmitJob {
        spec: JobSpec,
        idempotency_key: Option<String>,
    },
    CancelJob {
        job: JobId,
        reason: String,
    },
    RegisterNode {
        spec: NodeSpec,
    },
    /// A scheduling plan. `term` is the proposing leader's term, recorded on each allocation.
    Place {
        term: u64,
        placements: Vec<JobPlacement>,
    },
    AllocationStarted {
        allocation: AllocationId,
    },
    AllocationExited {
        allocation: AllocationId,
        outcome: TaskOutcome,
        /// What the task's cgroup measured. Format 2 (left out below, and not recorded
        /// while the cluster version is 1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<TaskUsage>,
    },
    PutTenant {
        tenant: Tenant,
    },
    /// Drain (no new work; with `evict`, running work is stopped and requeued), undrain, or
    /// mark down.
    SetNodeStatus {
        node: String,
        status: NodeStatus,
        evict: bool,
        reason: String,
    },
    /// The node's lease and grace period expired: it has stopped its work (agents self-fence),
    /// so its allocations are released and their jobs requeued.
    NodeLost {
        node: String,
        reason: String,
        /// The registration the leader judged silent; a node that registered again since is
        /// alive, and the command is refused.
        registered_at: Timestamp,
    },
    /// A GPU became unhealthy (Xid, fell off the bus) or returned to service.
    SetGpuHealth {
        node: String,
        gpu: String,
        health: GpuHealth,
    },
    PutPartition {
        partition: Partition,
    },
    /// Stop `victims` (requeued once stopped) so that pending `for_job` can start: lower
    /// priority preemptible work, or work borrowing another tenant's guaranteed quota. Apply
    /// checks each victim against those rules.
    Preempt {
        for_job: JobId,
        victims: Vec<JobId>,
        reason: String,
    },
    /// Archive finished jobs whose full record is past `retention` and forget archived ones
    /// past theirs, as of the entry's leader time. Proposed periodically by the leader.
    CompactJobs {
        retention: JobRetention,
        /// Most jobs one entry archives or forgets (format 2; `None`: all that are due). A
        /// restored backup or a long-idle leader may find a million due at once, and applying
        /// them in one entry stalls every replica for seconds: the leader proposes batches.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<u64>,
    },
    /// Several commands in one log entry (group commit): concurrent API writes share one Raft
    /// append, so one fsync on each replica. Applied in order, each as if it were its own
    /// entry at this entry's index and time; each gets its own outcome. Never nested.
    Batch {
        commands: Vec<Command>,
    },
    /// An API token (only its secret's hash; see `access`).
    CreateToken {
        token: TokenRecord,
    },
    /// The token stops working on every replica once this applies.
    RevokeToken {
        id: String,
        by: String,
    },
    /// A change the state machine does not make itself but the audit trail records
    /// (membership changes, which openraft applies).
    AuditNote {
        action: String,
        target: String,
        detail: String,
    },
    /// Trim the audit trail to `retention` as of the entry's time, and keep `retention` for
    /// the records that follow. Proposed periodically by the leader.
    CompactAudit {
        retention: AuditRetention,
    },
    /// Raise the cluster version (`format`): from this entry on, entries and snapshots are
    /// written in `version`'s format and its commands are accepted. Proposed by a leader once
    /// every member reports a binary that reads it; never lowers the version. Introduced by
    /// format 2 (a format-1 binary cannot decode it, and so stops rather than misapply).
    SetClusterVersion {
        version: FormatVersion,
    },
    /// Hold, release, requeue, update or cancel jobs (Slurm's `scontrol` and `scancel` of a
    /// whole array): one entry however many jobs. Applied to each job on its own; jobs the
    /// change does not apply to are refused one by one, and when none took it the command is
    /// refused whole. Introduced by format 2.
    ChangeJobs {
        jobs: Vec<JobId>,
        change: JobChange,
    },
    /// `command`, made by `actor` through the API: applied as `command`, and recorded in the
    /// audit trail when it changed the state. Holds neither a batch nor another `Attributed`.
    Attributed {
        actor: Actor,
        command: Box<Command>,
    },
    /// Create a service, or change one: a changed replica template is a new revision, which
    /// a rolling update brings to every replica; other settings take effect at once. With
    /// `create_only`, an existing service of that name is refused. Introduced by format 2, as
    /// are the service commands below.
    PutService {
        spec: Box<ServiceSpec>,
        #[serde(default)]
        create_only: bool,
    },
    /// Set how many replicas a service keeps (a person, or the leader's autoscaler).
    ScaleService {
        service: String,
        replicas: u32,
        reason: String,
    },
    /// Stop every replica of a service, then forget it.
    DeleteService {
        service: String,
    },
    ServiceRollout {
        service: String,
        action: RolloutAction,
    },
    /// A node's agent says a replica's readiness probe now passes, or no longer does.
    ReplicaReadiness {
        allocation: AllocationId,
        ready: bool,
        reason: String,
    },
}

impl Command {
    pub fn submit(spec: JobSpec, idempotency_key: Option<String>) -> Command {
        Command::SubmitJob {
            spec,
            idempotency_key,
        }
    }

    pub fn cancel(job: JobId, reason: impl Into<String>) -> Command {
        Command::CancelJob {
            job,
            reason: reason.into(),
        }
    }

    /// `self`, made by `actor`.
    pub fn by(self, actor: Actor) -> Command {
        Command::Attributed {
            actor,
            command: Box::new(self),
        }
    }

    /// The command itself, without its attribution.
    pub fn unattributed(&self) -> &Command {
        match self {
            Command::Attributed { command, .. } => command,
            other => other,
        }
    }

    /// Whether applying this command may take long enough (many milliseconds on a slow host)
    /// that it should not run on an async runtime worker: a plan or a batch of hundreds.
    pub fn is_heavy(&self) -> bool {
        const HEAVY: usize = 256;
        match self {
            Command::Place { placements, .. } => placements.len() >= HEAVY,
            Command::Batch { commands } => commands.len() >= HEAVY,
            _ => false,
        }
    }

    /// The format (cluster version) that introduced this kind of command: the cluster refuses
    /// it below that version, since a replica on an older binary could not apply it.
    /// `SetClusterVersion` itself is the exception that raises the version.
    pub fn introduced_in(&self) -> FormatVersion {
        match self {
            Command::SetClusterVersion { .. } => 2,
            Command::Batch { commands } => commands
                .iter()
                .map(Command::introduced_in)
                .max()
                .unwrap_or(format::LEGACY),
            Command::Attributed { command, .. } => command.introduced_in(),
            // Format 1 has no container (stripping it would run the job outside one), holds no
            // job that no node fits, and knows no node lists, exclusive nodes, begin times,
            // holds or arrays: a format-1 replica would run such a job differently.
            Command::SubmitJob { spec, .. } if spec.needs_format_2() => 2,
            Command::ChangeJobs { .. } => 2,
            Command::PutService { .. }
            | Command::ScaleService { .. }
            | Command::DeleteService { .. }
            | Command::ServiceRollout { .. }
            | Command::ReplicaReadiness { .. } => 2,
            _ => format::LEGACY,
        }
    }

    /// Refuses a command that `version` does not have yet. `SetClusterVersion` is what raises
    /// the version, and is checked against the members' binaries instead
    /// (`leader::cluster_version`).
    pub fn check_allowed_at(&self, version: format::ClusterVersion) -> Result<(), Rejection> {
        let needs = self.introduced_in();
        if matches!(self, Command::SetClusterVersion { .. }) || version.allows(needs) {
            return Ok(());
        }
        Err(Rejection::precondition(format!(
            "{} needs cluster version {needs}, and the cluster is at {}: it is raised once every replica runs a release that reads format {needs} (`gpuctl cluster status` shows each replica's release)",
            self.kind(),
            version.0
        )))
    }

    /// Short name for spans, metrics and the audit trail.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::SubmitJob { .. } => "submit_job",
            Command::CancelJob { .. } => "cancel_job",
            Command::RegisterNode { .. } => "register_node",
            Command::Place { .. } => "place",
            Command::AllocationStarted { .. } => "allocation_started",
            Command::AllocationExited { .. } => "allocation_exited",
            Command::PutTenant { .. } => "put_tenant",
            Command::SetNodeStatus { .. } => "set_node_status",
            Command::NodeLost { .. } => "node_lost",
            Command::SetGpuHealth { .. } => "set_gpu_health",
            Command::PutPartition { .. } => "put_partition",
            Command::Preempt { .. } => "preempt",
            Command::CompactJobs { .. } => "compact_jobs",
            Command::Batch { .. } => "batch",
            Command::CreateToken { .. } => "create_token",
            Command::RevokeToken { .. } => "revoke_token",
            Command::AuditNote { .. } => "audit_note",
            Command::CompactAudit { .. } => "compact_audit",
            Command::SetClusterVersion { .. } => "set_cluster_version",
            Command::ChangeJobs { .. } => "change_jobs",
            Command::PutService { .. } => "put_service",
            Command::ScaleService { .. } => "scale_service",
            Command::DeleteService { .. } => "delete_service",
            Command::ServiceRollout { .. } => "service_rollout",
            Command::ReplicaReadiness { .. } => "replica_readiness",
            Command::Attributed { command, .. } => command.kind(),
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::SubmitJob {
                spec,
                idempotency_key,
            } => write!(
                f,
                "submit tenant={} gpus={}x{} key={}",
                spec.tenant,
                spec.tasks,
                spec.gpus_per_task,
                idempotency_key.as_deref().unwrap_or("-")
            ),
            Command::CancelJob { job, reason } => write!(f, "cancel job={job} reason={reason:?}"),
            Command::RegisterNode { spec } => {
                write!(f, "register node={} gpus={}", spec.name, spec.gpus.len())
            }
            Command::Place { term, placements } => {
                write!(f, "place term={term} jobs={}", placements.len())
            }
            Command::AllocationStarted { allocation } => write!(f, "started alloc={allocation}"),
            Command::AllocationExited {
                allocation,
                outcome,
                ..
            } => write!(f, "exited alloc={allocation} outcome={outcome:?}"),
            Command::PutTenant { tenant } => write!(f, "put tenant={}", tenant.name),
            Command::SetNodeStatus {
                node,
                status,
                evict,
                reason,
            } => write!(
                f,
                "node {node} -> {} evict={evict} reason={reason:?}",
                status.as_str()
            ),
            Command::NodeLost { node, reason, .. } => write!(f, "node {node} lost: {reason}"),
            Command::SetGpuHealth { node, gpu, health } => {
                write!(f, "gpu {gpu} on {node} -> {health:?}")
            }
            Command::PutPartition { partition } => write!(f, "put partition={}", partition.name),
            Command::Preempt {
                for_job, victims, ..
            } => write!(f, "preempt for job={for_job} victims={victims:?}"),
            Command::CompactJobs { retention, .. } => write!(
                f,
                "compact jobs full_record_ms={} max_full_records={} archive_ms={} max_archived={}",
                retention.full_record_ms,
                retention.max_full_records,
                retention.archive_ms,
                retention.max_archived
            ),
            Command::Batch { commands } => {
                write!(f, "batch of {}:", commands.len())?;
                for c in commands {
                    write!(f, " [{c}]")?;
                }
                Ok(())
            }
            Command::CreateToken { token } => write!(
                f,
                "create token={} role={} tenant={} expires_at={:?}",
                token.id,
                token.role.as_str(),
                token.tenant.as_deref().unwrap_or("-"),
                token.expires_at
            ),
            Command::RevokeToken { id, .. } => write!(f, "revoke token={id}"),
            Command::AuditNote {
                action,
                target,
                detail,
            } => write!(f, "{action} {target}: {detail}"),
            Command::CompactAudit { retention } => write!(
                f,
                "compact audit max_age_ms={} max_records={}",
                retention.max_age_ms, retention.max_records
            ),
            Command::SetClusterVersion { version } => {
                write!(f, "set cluster version={version}")
            }
            Command::ChangeJobs { jobs, change } => {
                write!(f, "{} jobs={jobs:?}", change.verb())
            }
            Command::Attributed { actor, command } => {
                write!(f, "{command} (by {} from {})", actor.principal, actor.from)
            }
            Command::PutService { spec, create_only } => write!(
                f,
                "{} service={} replicas={}",
                if *create_only { "create" } else { "put" },
                spec.key(),
                spec.replicas
            ),
            Command::ScaleService {
                service,
                replicas,
                reason,
            } => write!(
                f,
                "scale service={service} replicas={replicas} reason={reason:?}"
            ),
            Command::DeleteService { service } => write!(f, "delete service={service}"),
            Command::ServiceRollout { service, action } => {
                write!(f, "rollout {} service={service}", action.verb())
            }
            Command::ReplicaReadiness {
                allocation,
                ready,
                reason,
            } => write!(
                f,
                "readiness alloc={allocation} ready={ready} reason={reason:?}"
            ),
        }
    }
}

/// Why a command changed nothing. Business rejections are normal responses, not errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RejectKind {
    /// The request itself is wrong (maps to gRPC InvalidArgument).
    InvalidArgument,
    /// It names something that does not exist (NotFound).
    NotFound,
    /// Valid, but the current state does not allow it (FailedPrecondition).
    FailedPrecondition,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    pub kind: RejectKind,
    /// The request field at fault, when there is one.
    pub field: Option<String>,
    pub message: String,
}

impl Rejection {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Rejection {
            kind: RejectKind::InvalidArgument,
            field: Some(field.into()),
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Rejection {
            kind: RejectKind::NotFound,
            field: None,
            message: message.into(),
        }
    }

    pub fn precondition(message: impl Into<String>) -> Self {
        Rejection {
            kind: RejectKind::FailedPrecondition,
            field: None,
            message: message.into(),
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{field}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// The result of applying one command; returned to whoever proposed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    JobSubmitted {
        id: JobId,
        created: bool,
    },
    JobCancelled {
        id: JobId,
    },
    NodeRegistered,
    Placed {
        accepted: Vec<JobId>,
        rejected: Vec<(JobId, String)>,
    },
    Preempted {
        accepted: Vec<JobId>,
        rejected: Vec<(JobId, String)>,
    },
    Done,
    /// `Command::ChangeJobs`: the jobs it changed, and why each other job was refused.
    JobsChanged {
        changed: Vec<JobId>,
        refused: Vec<(JobId, String)>,
    },
    Rejected(Rejection),
    /// A service command: the service's key and its current revision.
    ServiceChanged {
        service: String,
        revision: u64,
        created: bool,
    },
    /// The outcome of each command of a `Command::Batch`, in order.
    Batch(Vec<Outcome>),
}
