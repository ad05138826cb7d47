//! Plain data of the replicated cluster state: nodes and their GPUs, jobs, allocations,
//! tenants and partitions. No behaviour beyond small accessors; rules live in `apply.rs`.
//!
//! Maps are `BTreeMap` so iteration order (and therefore snapshots and scheduler passes) is the
//! same on every replica.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub type JobId = u64;
pub type AllocationId = u64;
/// Milliseconds since the Unix epoch, as stamped by the leader that proposed a command.
pub type Timestamp = u64;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuHealth {
    Healthy,
    /// Unusable until it recovers or an operator uncordons it (the reason says which fault).
    Unhealthy {
        reason: String,
    },
}

/// A MIG slice of a GPU, with its own UUID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigSlice {
    pub uuid: String,
    /// NVIDIA profile name, e.g. `1g.10gb`.
    pub profile: String,
    pub memory_mib: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub uuid: String,
    pub index: u32,
    pub model: String,
    pub memory_mib: u64,
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
    pub health: GpuHealth,
    #[serde(default)]
    pub mig: Vec<MigSlice>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStatus {
    Ready,
    /// Takes no new work; running work stays.
    Drained,
    /// Its lease expired; its allocations were released.
    Down,
}

impl NodeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeStatus::Ready => "ready",
            NodeStatus::Drained => "drained",
            NodeStatus::Down => "down",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    pub gpus: Vec<Gpu>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub partition: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Link matrix between the GPUs (cells as `nvidia-smi topo -m` prints them).
    #[serde(default)]
    pub topology: Vec<Vec<String>>,
    /// Where the node's agent serves its own API (logs, fault injection).
    #[serde(default)]
    pub agent_address: String,
    #[serde(default)]
    pub driver: String,
    /// Identity of the agent process tree that registered this node (see `agent.proto`).
    #[serde(default)]
    pub incarnation: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub spec: NodeSpec,
    pub status: NodeStatus,
    pub registered_at: Timestamp,
    /// An operator drained the node. Kept apart from `status` so that a node that goes down
    /// and comes back while drained stays drained.
    #[serde(default)]
    pub drained: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DependencyKind {
    /// Start after the job succeeded.
    AfterOk,
    /// Start after the job ended, however it ended.
    AfterAny,
    /// Start after the job failed, timed out or was cancelled.
    AfterNotOk,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dependency {
    pub kind: DependencyKind,
    pub job: JobId,
}

/// What a user asks for. Validated by `validate::validate_job_spec` at the API and again at apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct JobSpec {
    pub tenant: String,
    pub name: String,
    pub command: Vec<String>,
    pub gpus_per_task: u32,
    pub tasks: u32,
    /// Acceptable GPU models; empty accepts any.
    pub gpu_models: Vec<String>,
    pub partition: Option<String>,
    pub priority_class: String,
    pub time_limit_secs: Option<u64>,
    pub dependencies: Vec<Dependency>,
    pub cpu_milli_per_task: u64,
    pub memory_mib_per_task: u64,
    pub env: BTreeMap<String, String>,
}

impl JobSpec {
    pub fn total_gpus(&self) -> u64 {
        u64::from(self.gpus_per_task) * u64::from(self.tasks)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum JobState {
    /// Waiting for resources or dependencies.
    Pending,
    /// Has allocations; the agents have not all reported it started.
    Scheduled,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    TimedOut,
}

impl JobState {
    pub const ALL: [JobState; 7] = [
        JobState::Pending,
        JobState::Scheduled,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::TimedOut,
    ];

    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::TimedOut
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Scheduled => "scheduled",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::TimedOut => "timed_out",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateChange {
    pub at: Timestamp,
    pub state: JobState,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    pub idempotency_key: Option<String>,
    pub state: JobState,
    pub submitted_at: Timestamp,
    pub history: Vec<StateChange>,
    /// Live allocations of this job (one per task once placed).
    pub allocations: Vec<AllocationId>,
    /// Raft log index of the last change to this job.
    pub version: u64,
    /// Set when a task ended the job (failed, lost) while other tasks still run: the state the
    /// job takes once every allocation has exited. `Pending` here means a requeue.
    #[serde(default)]
    pub ending: Option<Ending>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ending {
    pub state: JobState,
    pub reason: String,
}

/// One task of a job bound to GPUs of one node. Its id doubles as the allocation epoch: ids only
/// grow, so an agent can tell a stale assignment from a newer one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub id: AllocationId,
    pub job: JobId,
    pub node: String,
    pub gpus: Vec<String>,
    /// Raft term of the leader whose plan created it.
    pub term: u64,
    pub created_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    pub weight: u32,
    pub quota_gpus: u32,
    pub max_gpus: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub name: String,
    pub description: String,
}
