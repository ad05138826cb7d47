//! The agent that runs on every GPU host.
//!
//! Layout:
//! - `gpu/`: what the host has — a `GpuBackend` trait with an NVML implementation (real
//!   hosts) and a simulated one (hosts described by `nvidia-smi topo -m` files, with fault
//!   injection), plus the topology parser.
//! - `health/`: Xid error classification (which faults fail a job, which make a GPU unhealthy).
//! - `runtime/`: launching, supervising, stopping and re-adopting workload processes.
//! - `agent/`: the main loop — register, heartbeat, follow assignments, report, self-fence.
//! - `observe/`: the metrics and health HTTP port, shared with the replicas.

pub mod agent;
pub mod cgroup;
pub mod gpu;
pub mod health;
pub mod observe;
pub mod runtime;
