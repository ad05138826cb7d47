//! GPU discovery behind one trait. `nvml` talks to the NVIDIA driver on a real host;
//! `simulated` describes a host from an `nvidia-smi topo -m` file and lets tests inject faults.
//! `topology` parses that file format (also what an operator pastes from a real host).

pub mod nvml;
pub mod simulated;
pub mod topology;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use topology::{LinkKind, Topology};

/// A MIG instance: a slice of a GPU with its own UUID, schedulable on its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    pub uuid: String,
    /// NVIDIA profile name, e.g. `1g.10gb`, `3g.40gb`.
    pub profile: String,
    pub memory_mib: u64,
    /// Its GPU instance and compute instance ids (`nvidia-smi`'s "GI ID" and "CI ID"): with
    /// the parent GPU's minor, they name the `/dev/nvidia-caps` nodes its processes must
    /// open (`cgroup::mig_caps`). `None` where the driver did not say: the slice is then
    /// granted no capability node, and a confined job cannot use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance_id: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDevice {
    pub uuid: String,
    /// Index as `nvidia-smi` numbers it (and as the topology matrix orders it).
    pub index: u32,
    /// Model name, e.g. `NVIDIA H100 80GB HBM3`; short names such as `H100` are fine too.
    pub model: String,
    pub memory_mib: u64,
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    /// MIG mode is enabled; `mig_instances` lists the configured slices.
    pub mig_enabled: bool,
    pub mig_instances: Vec<MigInstance>,
}

/// Everything the agent reports about its host when it registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInventory {
    pub gpus: Vec<GpuDevice>,
    /// Link matrix between the GPUs, indexed like `gpus`.
    pub topology: Topology,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// Driver / backend description for operators (`nvml 550.54.15`, `simulated dgx-h100`).
    pub driver: String,
}

/// A hardware event on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuEvent {
    /// An Xid error reported by the driver.
    Xid {
        gpu_uuid: String,
        code: u32,
        detail: String,
    },
    /// The GPU is no longer reachable on the PCIe bus (e.g. Xid 79).
    FellOffBus { gpu_uuid: String },
    /// The GPU works again (after a reset, or a simulated recovery).
    Recovered { gpu_uuid: String },
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The NVIDIA management library could not be loaded (no driver on this host).
    #[error("NVML is not available: {0}")]
    NoDriver(String),
    #[error("topology file {path}: {message}")]
    Topology { path: String, message: String },
    #[error("GPU backend error: {0}")]
    Backend(String),
}

/// One process's use of one GPU, as the driver saw it lately.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessGpuSample {
    pub gpu_uuid: String,
    pub pid: u32,
    /// Share of the GPU's streaming multiprocessors it kept busy, percent (`None`: the
    /// driver had no recent sample for it).
    pub sm_percent: Option<u32>,
    /// GPU memory it holds, bytes (`None`: not reported).
    pub memory_bytes: Option<u64>,
}

/// What the agent needs from a GPU host.
pub trait GpuBackend: Send + Sync {
    /// Short name for logs (`nvml`, `simulated`).
    fn name(&self) -> &'static str;
    /// Current inventory: GPUs, link matrix, CPU and memory capacity.
    fn inventory(&self) -> Result<HostInventory, GpuError>;
    /// Waits up to `timeout` for the next hardware event. `Ok(None)` on timeout.
    fn next_event(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError>;
    /// The processes using each GPU now, for per-job GPU accounting. Simulated GPUs run no
    /// process, so by default there are none.
    fn process_samples(&self) -> Vec<ProcessGpuSample> {
        Vec::new()
    }
}
