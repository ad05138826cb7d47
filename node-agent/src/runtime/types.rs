//! The runtime's public vocabulary: what to launch ([`LaunchSpec`]), why an allocation is
//! stopped ([`StopReason`]), how it ended ([`ExitKind`]), what [`super::Runtime::poll`]
//! reports ([`RuntimeEvent`]), the configuration ([`RuntimeConfig`]) and the errors
//! ([`RuntimeError`]). Plain data only; the behaviour lives in `supervisor.rs`.

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How long a stopped (or timed-out) process group gets between SIGTERM and SIGKILL, when
/// the configuration does not say otherwise. 30 s is what Slurm (`KillWait`) and Kubernetes
/// (`terminationGracePeriodSeconds`) default to, so checkpointing jobs behave the same here.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(30);

/// SIGTERM → SIGKILL grace when a workload is fenced; must stay below the control plane's
/// node grace (5 s by default), which registration checks.
pub const DEFAULT_FENCE_GRACE: Duration = Duration::from_secs(2);

/// Everything needed to start one allocation's process. Persisted verbatim in the
/// allocation's state record, so a restarted agent knows what it is supervising.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchSpec {
    /// Identifies the allocation on this host; it is also the allocation epoch assigned by
    /// the control plane (ids only grow), so one id is one placement of one job.
    pub allocation_id: u64,
    pub job_id: u64,
    pub job_name: String,
    pub tenant: String,
    /// Program and arguments; `command[0]` is looked up in the command's `PATH`.
    pub command: Vec<String>,
    /// Extra environment for the command. It cannot override the variables the runtime
    /// sets itself (`CUDA_VISIBLE_DEVICES`, `NVIDIA_VISIBLE_DEVICES`, `GPUCP_*`); see
    /// [`super::command_env`].
    pub env: BTreeMap<String, String>,
    /// GPU (or MIG instance) UUIDs the allocation holds; the command sees exactly these.
    pub gpus: Vec<String>,
    /// Wall-clock limit counted from the moment the command was started; when it passes the
    /// runtime stops the process group and reports [`ExitKind::TimedOut`].
    pub time_limit: Option<Duration>,
    /// `Some` for a share of one GPU (`gpus` then names exactly that GPU, which other shares
    /// may use at the same time); `None` when the GPUs are the allocation's alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<GpuShare>,
    /// MIG slice UUID → UUID of the GPU it is a slice of, for every entry of `gpus` that is a
    /// MIG slice. A slice is a unit of its own, but never in use while its parent GPU is used
    /// whole (see `ledger.rs`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mig_parents: BTreeMap<String, String>,
    /// CPU (thousandths of a CPU) and memory (MiB) the job asked for: its cgroup's quota and
    /// hard limit where cgroups are enforced. 0: not limited.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_milli: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_mib: u64,
    /// Minors of the allocation's GPUs' device nodes (`/dev/nvidiaN`; a MIG slice's parent
    /// GPU): what its cgroup lets it open.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_minors: Vec<u32>,
    /// Minors of the `/dev/nvidia-caps` nodes of the allocation's MIG slices (each slice's
    /// GPU instance and compute instance access nodes, `cgroup::mig_caps`): what its cgroup
    /// lets it open of the `nvidia-caps` major.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_cap_minors: Vec<u32>,
    /// Where the command starts; `None`, or a directory this host lacks: the allocation's
    /// scratch directory (the latter said in its stderr log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<PathBuf>,
    /// The NUMA node every GPU of the allocation is attached to, if they share one: its
    /// cgroup's cpuset is pinned to that node's CPUs and memory where the host has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Run the command in a container of this image (through the host's container engine)
    /// instead of as a process of the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<super::container::ContainerSpec>,
    /// Files that take the command's stdout and stderr instead of the allocation's own log
    /// files (which then link to them, so the logs still read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_path: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_path: Option<PathBuf>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A share of one GPU, used through CUDA MPS: a fraction of its compute and a limit on its
/// memory. Shares of one GPU never hold more than 1000 milli together, nor more than its
/// memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuShare {
    /// Milli-GPU, 1..=999: the share of the GPU's compute (streaming multiprocessors).
    pub milli: u32,
    /// GPU memory the share may use, MiB (0: no limit).
    pub memory_mib: u64,
    /// Total memory of the GPU, MiB (0: unknown), so that the runtime and the usage journal
    /// can check that the shares of one GPU fit in it.
    #[serde(default)]
    pub gpu_memory_mib: u64,
}

/// Why the agent stops an allocation. Recorded with the stop request so that a restarted
/// agent still reports the right [`ExitKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The control plane asked for it (cancel, preemption, rescheduling, drain).
    Requested,
    /// The agent fenced itself: its lease to the control plane expired (invariant 3).
    Fenced,
    /// One of the allocation's GPUs failed.
    GpuFault,
    /// The allocation's time limit passed (whoever noticed first, agent or leader);
    /// reported as [`ExitKind::TimedOut`] instead of [`ExitKind::Stopped`].
    TimeLimit,
}

/// How an allocation's process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExitKind {
    /// The command exited by itself with this code.
    Exited { code: i32 },
    /// The command was killed by this signal, not at the runtime's request.
    Signaled { signal: i32 },
    /// The time limit passed and the runtime stopped the process group.
    TimedOut,
    /// The runtime stopped the process group on request ([`super::Runtime::stop`]), however
    /// the process then ended (by the SIGTERM, the SIGKILL, or on its own meanwhile).
    Stopped,
    /// The command went past its memory limit and the kernel's OOM killer killed it (or a
    /// process of it, after which it failed).
    OutOfMemory { limit_mib: u64 },
    /// The process is gone and left no exit record, so how it ended is unknown (for example
    /// its supervisor was killed, or the agent crashed while launching it). `reason` says
    /// what the runtime saw.
    Vanished { reason: String },
}

/// What [`super::Runtime::poll`] reports. Each event is reported once per runtime life; an
/// `Exited` event is reported again by the next life until [`super::Runtime::forget`] is
/// called (at-least-once delivery: the control plane deduplicates by allocation id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RuntimeEvent {
    /// The command was started (only for launches of this life; re-adopted processes are
    /// listed by [`super::Runtime::live`] instead of being announced again).
    Started { allocation_id: u64, pid: u32 },
    /// The allocation's process ended; its GPUs are free again on this host.
    Exited {
        allocation_id: u64,
        kind: ExitKind,
        /// Wall-clock milliseconds since the Unix epoch: when the command ended if its
        /// supervisor recorded it, else when the runtime noticed.
        at_ms: u64,
        /// What its cgroup measured, where it had one.
        #[serde(default)]
        usage: Option<crate::cgroup::Usage>,
        /// The failure it was stopped for ([`super::Runtime::stop_failed`]), if any.
        #[serde(default)]
        failure: Option<String>,
    },
}

/// Where a command runs beside a live allocation (an exec probe), as
/// [`super::Runtime::exec_target`] says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecTarget {
    /// A process of the host: the allocation's environment and working directory, and its
    /// cgroup (`cgroup.procs` files to join; empty where the node does not enforce).
    Host {
        env: BTreeMap<String, String>,
        workdir: PathBuf,
        cgroup_procs: Vec<PathBuf>,
    },
    /// Inside the allocation's container, through the engine at `socket` (`None`: the
    /// default socket).
    Container {
        socket: Option<String>,
        name: String,
    },
}

/// Configuration of the runtime. Defaults are in [`RuntimeConfig::for_current_exe`] and
/// [`DEFAULT_STOP_GRACE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Where allocation records, exit files, logs and the GPU usage journal live. Must
    /// survive agent restarts (not a tmpfs that is wiped when the agent's unit restarts).
    pub state_dir: PathBuf,
    /// The program that runs the supervisor shim, normally the `node-agent` binary itself.
    pub shim_program: PathBuf,
    /// Arguments placed before the shim's own options, normally `["shim"]`.
    pub shim_args: Vec<String>,
    /// Fork shims from one pre-started launcher (`shim_program shim_args --launcher`) rather
    /// than exec `shim_program` for every allocation; falls back to exec'ing where the
    /// launcher cannot start or fails.
    pub launcher: bool,
    /// Time between SIGTERM and SIGKILL when stopping a process group.
    pub stop_grace: Duration,
    /// A file holding the agent's lease expiry (ms since the Unix epoch). Each shim reads it
    /// and stops its command when the lease passes, so workloads are fenced even when the
    /// agent itself is dead (SIGKILL, crash) and cannot fence them. `None`: no such fencing.
    pub lease_file: Option<PathBuf>,
    /// SIGTERM → SIGKILL grace when fencing (lease expired). Shorter than `stop_grace`: the
    /// control plane places the job elsewhere once its own grace has passed, and the fenced
    /// copy must be gone by then.
    pub fence_grace: Duration,
    /// Where allocations get cgroups of their own (`None`: not enforced, and the node says
    /// so when it registers).
    pub cgroups: Option<crate::cgroup::Cgroups>,
    /// Majors of the NVIDIA driver's dynamic devices, for the cgroups' device rules.
    pub driver_majors: crate::cgroup::devices::DriverMajors,
    /// How this host runs container jobs (`None`: it does not, and refuses them).
    pub containers: Option<super::container::ContainerRuntime>,
}

impl RuntimeConfig {
    /// The usual configuration: the running `node-agent` binary is its own shim
    /// (`node-agent shim ...`), with [`DEFAULT_STOP_GRACE`].
    pub fn for_current_exe(state_dir: impl Into<PathBuf>) -> Result<RuntimeConfig, RuntimeError> {
        let shim_program = std::env::current_exe().map_err(|source| RuntimeError::Io {
            action: "find the running node-agent binary (used as the supervisor shim)",
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?;
        Ok(RuntimeConfig {
            state_dir: state_dir.into(),
            shim_program,
            shim_args: vec!["shim".to_string()],
            launcher: true,
            stop_grace: DEFAULT_STOP_GRACE,
            lease_file: None,
            fence_grace: DEFAULT_FENCE_GRACE,
            cgroups: None,
            driver_majors: Default::default(),
            containers: None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "allocation {0} is already known to this host's runtime (running, or exited and not \
         yet forgotten); refusing to start a second copy"
    )]
    AlreadyKnown(u64),
    #[error(
        "GPU {gpu} is in use by allocation {holder} on this host ({reason}); refusing to \
         start allocation {allocation} (the control plane's view of this host is stale)"
    )]
    GpuBusy {
        gpu: String,
        /// One allocation in the way (the lowest id, when several are).
        holder: u64,
        allocation: u64,
        reason: String,
    },
    #[error("allocation {0} is not known to this host's runtime")]
    Unknown(u64),
    #[error(
        "cannot create allocation {allocation}'s cgroup: {source}; the allocation was not \
         started (it never runs unconfined on a node that enforces)"
    )]
    Cgroup {
        allocation: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "allocation {0} is still running; stop it and wait for its exit event before \
         forgetting it"
    )]
    StillRunning(u64),
    #[error("launch spec of allocation {allocation} is invalid: {message}")]
    InvalidSpec { allocation: u64, message: String },
    #[error("allocation {allocation} cannot run its container here: {message}")]
    Container { allocation: u64, message: String },
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "state record {} is unreadable ({message}); check whether the allocation's process \
         still runs (ps -eo pid,pgid,args), stop it if so, then move the file aside (for the \
         record log allocations.log, delete just the line named: the other lines track other \
         allocations) and restart the agent",
        path.display()
    )]
    CorruptRecord { path: PathBuf, message: String },
    #[error(
        "state directory {} is in use by another node-agent runtime (lock {} is held); two \
         agents on one state directory would start allocations twice",
        state_dir.display(),
        lock.display()
    )]
    StateDirBusy { state_dir: PathBuf, lock: PathBuf },
    #[error(
        "could not start the supervisor shim {} for allocation {allocation}: {source}",
        program.display()
    )]
    Spawn {
        allocation: u64,
        program: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "could not send signal {signal} to the process group of allocation {allocation}: {source}"
    )]
    Signal {
        allocation: u64,
        signal: i32,
        #[source]
        source: io::Error,
    },
    #[error("GPU usage journal {}, line {line}: {message}", path.display())]
    Journal {
        path: PathBuf,
        line: usize,
        message: String,
    },
}
