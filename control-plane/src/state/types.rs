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
    /// The release of the agent that registered this node ("0.2.0"); empty for an agent
    /// older than release 0.2, which did not report one. Introduced by format 2: left out
    /// (kept empty) while the cluster version is lower, so the entry keeps format 1's shape.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent_release: String,
    /// What the agent enforces on each allocation ("cgroup v1: devices, memory, cpu, kill"),
    /// or "unenforced: REASON"; empty when not reported. Format 2, as `agent_release`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub enforcement: String,
    /// The container engine the node runs container jobs with ("docker 20.10.24
    /// (cgroupfs)"); empty: none, so container jobs are not placed on it. Format 2.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub container_runtime: String,
    /// Host ports the node hands out to tasks that ask for named ports (service replicas),
    /// as the agent's `--service-ports` says; `None`: such tasks are not placed on it.
    /// Format 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_ports: Option<PortRange>,
}

/// An inclusive range of host ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn len(&self) -> usize {
        usize::from(self.last.saturating_sub(self.first)) + usize::from(self.last >= self.first)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }
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
    /// A share of one GPU per task, in milli-GPU (1..=999); 0 means whole GPUs. A share needs
    /// `gpus_per_task == 1` and is packed with other shares onto one GPU.
    #[serde(default)]
    pub gpu_milli: u32,
    /// GPU memory a share may use (MiB); 0 means in proportion to `gpu_milli`.
    #[serde(default)]
    pub gpu_memory_mib: u64,
    /// MIG profile (`1g.10gb`, `3g.40gb`, ...): each of `gpus_per_task` is a slice of it.
    #[serde(default)]
    pub mig_profile: Option<String>,
    /// May be stopped and requeued to make room for higher-priority work.
    #[serde(default)]
    pub preemptible: bool,
    /// All GPUs of a task must sit on one NUMA node (otherwise that is only a preference).
    #[serde(default)]
    pub single_numa: bool,
    /// Working directory of its tasks (absolute). Format 2: left out while the cluster
    /// version is 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Run every task in a container of this image on a node with a container engine.
    /// Format 2: refused while the cluster version is 1 (never run outside its container).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerSpec>,
    /// Files that take its tasks' stdout and stderr (sbatch's `-o`/`-e` patterns). Format 2:
    /// left out while the cluster version is 1 (the output then stays in the agent's logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_path: Option<String>,
    /// Accept the job even if no node of the cluster could ever hold it, and keep it pending
    /// (reason `Unfit: ...`) until a node that fits joins. Without it such a job is refused
    /// at submission. Format 2: refused while the cluster version is 1 (a format-1 replica
    /// would refuse the job at apply where this one accepts it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub hold_if_unfit: bool,
    /// Tasks run only on these nodes (Slurm's `-w/--nodelist`, expanded; sorted, distinct).
    /// Format 2, as are the fields below: a job using any of them is refused while the
    /// cluster version is 1 (a format-1 replica would place it anywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodelist: Vec<String>,
    /// Tasks never run on these nodes (`-x/--exclude`; sorted, distinct).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
    /// The job's nodes run nothing else while it runs (`--exclusive`): it starts only on idle
    /// nodes, and no other job is placed beside it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub exclusive: bool,
    /// Not eligible before this leader time (`--begin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin_at: Option<Timestamp>,
    /// Submitted held (`--hold`): it waits until released (`gpuctl release`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub hold: bool,
    /// A job array (`--array=0-99%8`): one submission creates a job per index, with
    /// consecutive ids; the first is the array's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<ArraySpec>,
    /// Named host ports each task gets from its node's range (`PORT`, `GPUCP_PORT_<NAME>`):
    /// what a service replica listens on. Format 2.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
}

/// The indices of a job array and how many of its tasks may run at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ArraySpec {
    /// `first-last:step` ranges as given (validated: ascending within a range, step >= 1).
    pub ranges: Vec<ArrayRange>,
    /// Most tasks of the array placed at once (`%N`); 0: no limit.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub max_running: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ArrayRange {
    pub first: u32,
    pub last: u32,
    pub step: u32,
}

impl ArraySpec {
    /// Every index, ascending and distinct (ranges may overlap).
    pub fn indices(&self) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .ranges
            .iter()
            .flat_map(|r| {
                (u64::from(r.first)..=u64::from(r.last))
                    .step_by(r.step.max(1) as usize)
                    .map(|i| i as u32)
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The lowest and highest index (without listing them).
    pub fn index_bounds(&self) -> (u32, u32) {
        let min = self.ranges.iter().map(|r| r.first).min().unwrap_or(0);
        // A range's last index is the highest its step reaches.
        let max = self
            .ranges
            .iter()
            .map(|r| r.first + r.last.saturating_sub(r.first) / r.step.max(1) * r.step.max(1))
            .max()
            .unwrap_or(0);
        (min, max)
    }

    /// Slurm's spelling: `0-99:2,200%8`.
    pub fn text(&self) -> String {
        let mut out = self
            .ranges
            .iter()
            .map(|r| match (r.first == r.last, r.step) {
                (true, _) => r.first.to_string(),
                (false, 1) => format!("{}-{}", r.first, r.last),
                (false, s) => format!("{}-{}:{s}", r.first, r.last),
            })
            .collect::<Vec<_>>()
            .join(",");
        if self.max_running > 0 {
            out.push_str(&format!("%{}", self.max_running));
        }
        out
    }
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// Where a job sits in its array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayTask {
    /// The array's id: the id of its first job.
    pub array_id: JobId,
    /// This job's index (`SLURM_ARRAY_TASK_ID`).
    pub index: u32,
    /// Jobs in the array (ids `array_id..array_id + count`).
    pub count: u32,
}

pub(crate) fn is_false(b: &bool) -> bool {
    !*b
}

/// A job's container: its image and the host paths mounted into it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ContainerSpec {
    pub image: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<ContainerMount>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ContainerMount {
    pub source: String,
    pub target: String,
    #[serde(default)]
    pub read_only: bool,
}

/// Milli-GPU per whole GPU: quotas, fair share and shares are all counted in milli-GPU.
pub const MILLI_PER_GPU: u64 = 1000;

/// Compute slices of an A100/H100 in MIG mode: a `3g.40gb` slice is 3/7 of the GPU.
pub const MIG_COMPUTE_SLICES: u64 = 7;

/// Compute slices a MIG profile name asks for (`3g.40gb` → 3, `1g.10gb+me` → 1).
pub fn mig_compute_slices(profile: &str) -> Option<u64> {
    let g = profile.split_once('g')?.0;
    let n: u64 = g.parse().ok()?;
    (1..=MIG_COMPUTE_SLICES).contains(&n).then_some(n)
}

impl JobSpec {
    /// Whether the job names the nodes it may use or must have to itself (`-w`, `-x`,
    /// `--exclusive`): such a job is placed node by node, not by groups of alike nodes.
    pub fn has_node_constraints(&self) -> bool {
        !self.nodelist.is_empty() || !self.exclude.is_empty() || self.exclusive
    }

    /// Whether `--nodelist` and `--exclude` let a task run on node `name`.
    pub fn allows_node(&self, name: &str) -> bool {
        (self.nodelist.is_empty()
            || self
                .nodelist
                .binary_search_by(|n| n.as_str().cmp(name))
                .is_ok())
            && self
                .exclude
                .binary_search_by(|n| n.as_str().cmp(name))
                .is_err()
    }

    /// Whether the spec uses a field of format 2 that a format-1 replica would drop.
    pub fn needs_format_2(&self) -> bool {
        self.container.is_some()
            || self.hold_if_unfit
            || self.has_node_constraints()
            || self.begin_at.is_some()
            || self.hold
            || self.array.is_some()
            || !self.ports.is_empty()
    }

    pub fn total_gpus(&self) -> u64 {
        u64::from(self.gpus_per_task) * u64::from(self.tasks)
    }

    /// Whether each task asks for a share of one GPU rather than whole GPUs or MIG slices.
    pub fn is_share(&self) -> bool {
        self.gpu_milli > 0
    }

    /// GPU capacity one task holds, in milli-GPU: 1000 per whole GPU, the share itself, or a
    /// MIG slice's fraction of its GPU. This is what quotas and fair share count.
    pub fn gpu_milli_per_task(&self) -> u64 {
        if self.is_share() {
            return u64::from(self.gpu_milli);
        }
        let per_gpu = match &self.mig_profile {
            Some(p) => {
                mig_compute_slices(p).unwrap_or(MIG_COMPUTE_SLICES) * MILLI_PER_GPU
                    / MIG_COMPUTE_SLICES
            }
            None => MILLI_PER_GPU,
        };
        u64::from(self.gpus_per_task) * per_gpu
    }

    pub fn total_gpu_milli(&self) -> u64 {
        self.gpu_milli_per_task() * u64::from(self.tasks)
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
    /// Set when the job was preempted and requeued: the job it was stopped for. It does not
    /// start again while that job still waits (up to `YIELD_LIMIT_MS`), so the room its stop
    /// made is not taken back by itself before the preemptor can use it (a preemption loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub yielded_to: Option<JobId>,
    /// What its tasks used, over every task and attempt whose end was measured (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<JobUsage>,
    /// The allocations of each placement (attempt), oldest first, one per task in task
    /// order: what `gpuctl logs --attempt K --task N` reads. The last
    /// [`MAX_RECORDED_ATTEMPTS`] only; recorded from format 2 on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<Vec<AllocationId>>,
    /// Held (`--hold`, `gpuctl hold`): pending but not considered until released.
    #[serde(default, skip_serializing_if = "is_false")]
    pub held: bool,
    /// Its place in a job array, if it is one of an array's jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array_task: Option<ArrayTask>,
    /// How its last attempt's tasks exited, as sacct's ExitCode: the first failing task's
    /// code and signal, or 0:0 when every task succeeded (format 2; `None`: no task has
    /// exited since it was last placed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<JobExit>,
    /// Set when the job is a replica of a service (format 2): it is restarted when it exits
    /// and ends only when the service stops it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<super::service::ReplicaOf>,
}

/// A job's exit status (Slurm's `ExitCode` `code:signal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobExit {
    pub code: i32,
    pub signal: i32,
}

/// Placements of one job whose allocations are kept (a job requeued for ever keeps the
/// latest).
pub const MAX_RECORDED_ATTEMPTS: usize = 64;

/// A job's resource use, summed from its tasks' exits (Slurm's `sacct` TotalCPU, MaxRSS).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobUsage {
    pub cpu_ms: u64,
    /// The largest peak of any one task.
    pub peak_memory_bytes: u64,
    pub oom_kills: u64,
    pub tasks_measured: u64,
    /// GPU samples over its tasks, the sum of their SM utilisation (for a sample-weighted
    /// average) and the largest GPU memory peak of any task (NVML hosts).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpu_samples: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpu_sm_percent_sum: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpu_peak_memory_bytes: u64,
}

/// For `skip_serializing_if`: a count that is 0 is left out of the entry.
pub(crate) fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl JobUsage {
    pub fn add(&mut self, task: &crate::state::command::TaskUsage) {
        self.cpu_ms = self.cpu_ms.saturating_add(task.cpu_ms);
        self.peak_memory_bytes = self.peak_memory_bytes.max(task.peak_memory_bytes);
        self.oom_kills = self.oom_kills.saturating_add(task.oom_kills);
        self.tasks_measured += 1;
        self.gpu_samples = self.gpu_samples.saturating_add(task.gpu_samples);
        self.gpu_sm_percent_sum = self
            .gpu_sm_percent_sum
            .saturating_add(task.gpu_sm_percent_avg.saturating_mul(task.gpu_samples));
        self.gpu_peak_memory_bytes = self.gpu_peak_memory_bytes.max(task.gpu_peak_memory_bytes);
    }
}

/// Longest a preempted job stands aside for the job it was stopped for (a preemptor that can
/// never start must not keep its victims waiting for ever).
pub const YIELD_LIMIT_MS: u64 = 10 * 60 * 1000;

impl Job {
    /// Leader time of the job's last state change (for a finished job: when it ended).
    pub fn last_change_at(&self) -> Timestamp {
        self.history.last().map_or(self.submitted_at, |h| h.at)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ending {
    pub state: JobState,
    pub reason: String,
    /// The pending job this one is being stopped for, when it was preempted: the scheduler
    /// waits for these stops instead of choosing more victims.
    #[serde(default)]
    pub preempted_for: Option<JobId>,
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
    /// For a share: the milli-GPU it holds of its one GPU (0: the GPUs are exclusive).
    #[serde(default)]
    pub gpu_milli: u32,
    /// For a share: the GPU memory it may use (MiB).
    #[serde(default)]
    pub gpu_memory_mib: u64,
    /// Host ports given to the task, one per name of its job's `ports`, in order (format 2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Not to be started before this leader time: a replica restarting after a back-off
    /// (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_after: Option<Timestamp>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    /// Fair-share weight: a tenant with twice the weight is entitled to twice the GPU-seconds.
    pub weight: u32,
    /// GPUs guaranteed to the tenant: work beyond its quota that others hold (borrowed
    /// capacity) is preempted when the tenant needs it back.
    pub quota_gpus: u32,
    /// Most GPUs the tenant may hold, its quota plus what it may borrow; 0 means no limit.
    pub max_gpus: u32,
}

/// A tenant's GPU usage for fair share: GPU-seconds, decayed with a half-life so that old usage
/// counts less (Slurm's PriorityDecayHalfLife). Kept as an integer (milli-GPU-seconds) so that
/// it survives a snapshot round trip bit for bit: replicas must order the queue identically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DecayedUsage {
    pub milli_gpu_seconds: u64,
    /// When `milli_gpu_seconds` was last brought up to date.
    pub at: Timestamp,
}

/// Half-life of fair-share usage.
pub const USAGE_HALF_LIFE_MS: u64 = 24 * 3600 * 1000;

impl DecayedUsage {
    /// The usage as of `now`, decayed, in GPU-seconds.
    pub fn gpu_seconds_at(&self, now: Timestamp) -> f64 {
        let elapsed = now.saturating_sub(self.at) as f64;
        let decay = (-elapsed / USAGE_HALF_LIFE_MS as f64 * std::f64::consts::LN_2).exp();
        self.milli_gpu_seconds as f64 / MILLI_PER_GPU as f64 * decay
    }

    /// Adds usage at `now` (leader time from the log), decaying what was there.
    pub fn add(&mut self, now: Timestamp, milli_gpu_seconds: u64) {
        let now = now.max(self.at);
        let decayed = (self.gpu_seconds_at(now) * MILLI_PER_GPU as f64).round() as u64;
        self.milli_gpu_seconds = decayed.saturating_add(milli_gpu_seconds);
        self.at = now;
    }
}

/// GPU shares held on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GpuShares {
    pub milli: u32,
    pub memory_mib: u64,
    pub allocations: std::collections::BTreeSet<AllocationId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    pub name: String,
    pub description: String,
}

/// What is left of a finished job once its full record has been archived (see
/// `retention.rs`): enough to answer `get`, a retry with its idempotency key, and a dependency
/// on it, but not its spec, history or placement.
///
/// A million of these may be kept, so the record is packed: its four strings share one
/// allocation, and a snapshot writes it as a JSON array (`ArchivedJobFields`), not an object
/// that repeats every field name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ArchivedJobFields", into = "ArchivedJobFields")]
pub struct ArchivedJob {
    pub id: JobId,
    /// Tenant, name, idempotency key and reason, one after the other (lengths in `lens`).
    texts: Box<str>,
    /// Lengths of tenant, name and key in `texts` (the reason is the rest).
    lens: [u32; 3],
    has_key: bool,
    /// `spec_fingerprint` of its spec: a retry with the same key must carry the same spec.
    pub spec_fingerprint: u64,
    /// The final state (succeeded, failed, cancelled, timed out).
    pub state: JobState,
    pub submitted_at: Timestamp,
    pub ended_at: Timestamp,
    pub archived_at: Timestamp,
}

/// `ArchivedJob` as stored in snapshots: (id, tenant, name, idempotency key, spec
/// fingerprint, state, reason, submitted at, ended at, archived at).
#[derive(Serialize, Deserialize)]
pub struct ArchivedJobFields(
    JobId,
    String,
    String,
    Option<String>,
    u64,
    JobState,
    String,
    Timestamp,
    Timestamp,
    Timestamp,
);

impl ArchivedJob {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: JobId,
        tenant: &str,
        name: &str,
        idempotency_key: Option<&str>,
        spec_fingerprint: u64,
        state: JobState,
        reason: &str,
        (submitted_at, ended_at, archived_at): (Timestamp, Timestamp, Timestamp),
    ) -> ArchivedJob {
        let key = idempotency_key.unwrap_or("");
        let len = |s: &str| u32::try_from(s.len()).expect("a job string under 4 GiB");
        ArchivedJob {
            id,
            texts: [tenant, name, key, reason].concat().into_boxed_str(),
            lens: [len(tenant), len(name), len(key)],
            has_key: idempotency_key.is_some(),
            spec_fingerprint,
            state,
            submitted_at,
            ended_at,
            archived_at,
        }
    }

    /// The i-th of tenant, name, key, reason.
    fn text(&self, i: usize) -> &str {
        let start: usize = self.lens[..i].iter().map(|l| *l as usize).sum();
        let end = match self.lens.get(i) {
            Some(l) => start + *l as usize,
            None => self.texts.len(),
        };
        &self.texts[start..end]
    }

    pub fn tenant(&self) -> &str {
        self.text(0)
    }

    pub fn name(&self) -> &str {
        self.text(1)
    }

    pub fn idempotency_key(&self) -> Option<&str> {
        self.has_key.then(|| self.text(2))
    }

    /// Why it ended (exit code, signal, who cancelled), as its last history entry said.
    pub fn reason(&self) -> &str {
        self.text(3)
    }
}

impl From<ArchivedJobFields> for ArchivedJob {
    fn from(f: ArchivedJobFields) -> Self {
        let ArchivedJobFields(id, tenant, name, key, fingerprint, state, reason, s, e, a) = f;
        ArchivedJob::new(
            id,
            &tenant,
            &name,
            key.as_deref(),
            fingerprint,
            state,
            &reason,
            (s, e, a),
        )
    }
}

impl From<ArchivedJob> for ArchivedJobFields {
    fn from(a: ArchivedJob) -> Self {
        ArchivedJobFields(
            a.id,
            a.tenant().to_owned(),
            a.name().to_owned(),
            a.idempotency_key().map(str::to_owned),
            a.spec_fingerprint,
            a.state,
            a.reason().to_owned(),
            a.submitted_at,
            a.ended_at,
            a.archived_at,
        )
    }
}

/// How long finished jobs are kept: first whole, then as an `ArchivedJob`, then not at all.
/// Carried by each `CompactJobs` command (the leader's configuration), so every replica
/// compacts alike whatever its own configuration says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRetention {
    /// A finished job keeps its full record at least this long after it ended...
    pub full_record_ms: u64,
    /// ...unless more than this many finished jobs have full records: then the oldest are
    /// archived early.
    pub max_full_records: u64,
    /// An archived job (and its idempotency key) is kept this long after the job ended...
    pub archive_ms: u64,
    /// ...unless more than this many jobs are archived: then the oldest are forgotten early.
    pub max_archived: u64,
}

#[cfg(test)]
mod job_usage_tests {
    use super::*;
    use crate::state::command::TaskUsage;

    #[test]
    fn a_jobs_usage_sums_cpu_keeps_peaks_and_weights_gpu_utilisation_by_samples() {
        let mut u = JobUsage::default();
        u.add(&TaskUsage {
            cpu_ms: 1000,
            peak_memory_bytes: 5 << 20,
            oom_kills: 0,
            gpu_samples: 3,
            gpu_sm_percent_avg: 90,
            gpu_peak_memory_bytes: 10 << 30,
        });
        u.add(&TaskUsage {
            cpu_ms: 500,
            peak_memory_bytes: 7 << 20,
            oom_kills: 1,
            gpu_samples: 1,
            gpu_sm_percent_avg: 10,
            gpu_peak_memory_bytes: 2 << 30,
        });
        // A task on a host without GPU samples adds its CPU and memory only.
        u.add(&TaskUsage {
            cpu_ms: 100,
            ..Default::default()
        });
        assert_eq!(
            (u.cpu_ms, u.peak_memory_bytes, u.oom_kills),
            (1600, 7 << 20, 1)
        );
        assert_eq!(u.tasks_measured, 3);
        assert_eq!(u.gpu_samples, 4);
        assert_eq!(u.gpu_sm_percent_sum / u.gpu_samples, (3 * 90 + 10) / 4);
        assert_eq!(u.gpu_peak_memory_bytes, 10 << 30);
    }
}
