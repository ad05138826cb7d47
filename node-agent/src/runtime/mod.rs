//! The workload runtime: launches each allocation's command with exactly its GPUs visible,
//! supervises it, stops it (SIGTERM, then SIGKILL after a grace), enforces its time limit,
//! and re-adopts running processes after an agent restart, so a restart never starts a
//! second copy (invariant 3) and two allocations never use one GPU beyond what shares of it
//! allow (invariant 1).
//!
//! Files:
//! - `types.rs`: the public data types ([`LaunchSpec`], [`ExitKind`], [`RuntimeEvent`],
//!   [`StopReason`], [`RuntimeConfig`], [`RuntimeError`]);
//! - `supervisor.rs`: [`Runtime`], the state machine over processes and records;
//! - `shim.rs`: [`shim_main`], the per-allocation supervisor process;
//! - `spawn.rs`: how a shim starts its command (confined before its first instruction,
//!   without copying the shim's memory);
//! - `launcher.rs`: the pre-forked process that forks shims for the agent (no exec per job);
//! - `record.rs`: the on-disk layout and records, and exit classification;
//! - `record_log.rs`: the append-only log the records are kept in;
//! - `env.rs`: the command's environment ([`command_env`]) and spec validation;
//! - `journal.rs`: the GPU usage journal and its overlap checker;
//! - `ledger.rs`: the rule both the launch check and the checker apply: whole GPUs, shares of a
//!   GPU (CUDA MPS) and MIG slices, and which of them may overlap;
//! - `process.rs`: `/proc`, signal and `waitpid` helpers;
//! - `container.rs`: what a container job becomes on the host (devices, limits, name);
//!   `container_runner.rs`: the process that runs it through the engine's API.
//!
//! Process model: `agent ─spawn→ launcher ─fork→ shim (process group leader) ─spawn→
//! command`, or `agent ─spawn→ shim` where no launcher runs.
//! The shim outlives the agent and writes the command's exit status to an exit file; the
//! runtime finds its processes again from per-allocation records (pid + start time), kept
//! in one append-only log.

pub mod container;
pub mod container_runner;
mod env;
mod journal;
mod launcher;
mod ledger;
pub(crate) mod process;
mod record;
mod record_log;
mod shim;
mod spawn;
mod supervisor;
mod types;

pub use env::{
    DEFAULT_PATH, HOST_MPS_ENV, INHERITED_ENV, RESERVED_ENV, active_thread_percentage, command_env,
    validate_spec,
};
pub use journal::{UsageRecord, check_no_overlap, read_usage_journal};
pub use ledger::MILLI_PER_GPU;
pub use record_log::frame_line;
pub use shim::{SHIM_EXECUTABLE, SHIM_PROTOCOL, SHIM_PROTOCOL_FLAG, shim_command, shim_main};
pub use supervisor::Runtime;
pub use types::{
    DEFAULT_FENCE_GRACE, DEFAULT_STOP_GRACE, ExecTarget, ExitKind, GpuShare, LaunchSpec,
    RuntimeConfig, RuntimeError, RuntimeEvent, StopReason,
};
