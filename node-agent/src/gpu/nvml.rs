//! The real backend: GPUs as the NVIDIA driver reports them through NVML (nvml-wrapper 0.13,
//! which loads `libnvidia-ml.so.1` at run time, so the agent builds and starts on hosts
//! without a driver and says so instead of failing to link).
//!
//! What NVML does not say directly comes from sysfs: a GPU's NUMA node and local CPU list
//! (`/sys/bus/pci/devices/<addr>/numa_node`, `local_cpulist`), and the host's CPUs and memory
//! from `/proc`. Everything that does not need a driver (bus-id parsing, link-matrix assembly,
//! event mapping, `/proc` parsing) is a plain function with its own tests.

use std::ffi::OsStr;
use std::sync::Mutex;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};

use super::topology::{LinkKind, Topology};
use super::{GpuBackend, GpuDevice, GpuError, GpuEvent, HostInventory, MigInstance};

/// The library NVML is loaded from on Linux.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// `NVML_NVLINK_MAX_LINKS` from nvml.h (18 since Hopper); nvml-wrapper does not re-export it.
const NVLINK_MAX_LINKS: u32 = 18;

/// `NVML_DEVICE_MIG_ENABLE` from nvml.h: the value of `MigMode::current` when MIG is on.
const MIG_ENABLED: u32 = 1;

/// The Xid code NVML reports when it cannot tell which Xid happened.
const UNKNOWN_XID: u32 = 999;

const MIB: u64 = 1024 * 1024;

/// GPUs through the NVIDIA driver.
///
/// Ownership: nvml-wrapper's `EventSet<'nvml>` borrows the `Nvml` it came from, and the
/// backend must hold both. Rather than a self-referential struct (unsafe, or a crate we do
/// not depend on), the `Nvml` handle is leaked into a `&'static Nvml` with `Box::leak`: the
/// agent creates one backend for its whole life, NVML is meant to be initialised once per
/// process, and the driver releases everything when the process exits. The cost is that
/// `nvmlShutdown` never runs, which NVIDIA documents as harmless at exit. Each successful
/// [`NvmlBackend::new`] leaks one handle, so create the backend once.
///
/// `EventSet` is `Send` but not `Sync` (NVML event sets are not thread-safe), so it sits
/// behind a `Mutex`; one event loop calls `next_event` at a time anyway.
#[derive(Debug)]
pub struct NvmlBackend {
    nvml: &'static Nvml,
    /// `None` when no GPU reports Xid events (then `next_event` only waits).
    events: Option<Mutex<EventSet<'static>>>,
    /// UUID by index, to name a GPU that NVML reports lost without saying which.
    uuids: Vec<String>,
    driver: String,
}

impl NvmlBackend {
    /// Loads NVML from `libnvidia-ml.so.1` and registers for Xid events on every GPU.
    pub fn new() -> Result<Self, GpuError> {
        Self::with_library(OsStr::new(NVML_LIBRARY))
    }

    /// Like [`NvmlBackend::new`] with another library path (a driver installed outside the
    /// loader path; tests use a path that does not exist).
    pub fn with_library(library: &OsStr) -> Result<Self, GpuError> {
        let nvml = Nvml::builder()
            .lib_path(library)
            .init()
            .map_err(|e| no_driver(library, &e))?;
        let nvml: &'static Nvml = Box::leak(Box::new(nvml));

        let driver = match nvml.sys_driver_version() {
            Ok(version) => format!("nvml {version}"),
            Err(_) => "nvml".to_string(),
        };
        let count = nvml
            .device_count()
            .map_err(|e| backend_error("counting GPUs", &e))?;
        let mut uuids = Vec::with_capacity(count as usize);
        for index in 0..count {
            let uuid = nvml
                .device_by_index(index)
                .and_then(|device| device.uuid())
                .map_err(|e| backend_error(&format!("reading the UUID of GPU {index}"), &e))?;
            uuids.push(uuid);
        }
        let events = register_xid_events(nvml, count).map(Mutex::new);
        Ok(NvmlBackend {
            nvml,
            events,
            uuids,
            driver,
        })
    }

    /// The GPU NVML reported lost (`wait` says only that one is).
    fn find_lost_gpu(&self) -> Result<GpuEvent, GpuError> {
        for uuid in &self.uuids {
            let lost = match self.nvml.device_by_uuid(uuid.as_str()) {
                Err(NvmlError::GpuLost) => true,
                Err(_) => false,
                Ok(device) => matches!(device.pci_info(), Err(NvmlError::GpuLost)),
            };
            if lost {
                return Ok(GpuEvent::FellOffBus {
                    gpu_uuid: uuid.clone(),
                });
            }
        }
        Err(GpuError::Backend(
            "NVML reported a lost GPU, but every GPU still answers; check `dmesg` for Xid 79"
                .into(),
        ))
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    /// Queries NVML afresh on every call. A GPU that fails to answer fails the whole
    /// inventory: skipping it would renumber the matrix against `nvidia-smi`'s indices.
    fn inventory(&self) -> Result<HostInventory, GpuError> {
        let nvml = self.nvml;
        let count = nvml
            .device_count()
            .map_err(|e| backend_error("counting GPUs", &e))?;
        let mut gpus = Vec::with_capacity(count as usize);
        let mut addresses = Vec::with_capacity(count as usize);
        for index in 0..count {
            let at = |what: &str| format!("reading the {what} of GPU {index}");
            let device = nvml
                .device_by_index(index)
                .map_err(|e| backend_error(&format!("opening GPU {index}"), &e))?;
            let uuid = device.uuid().map_err(|e| backend_error(&at("UUID"), &e))?;
            let model = device.name().map_err(|e| backend_error(&at("name"), &e))?;
            let memory = device
                .memory_info()
                .map_err(|e| backend_error(&at("memory size"), &e))?;
            let pci = device
                .pci_info()
                .map_err(|e| backend_error(&at("PCI bus id"), &e))?;
            let address = PciAddress::parse(&pci.bus_id);
            let (mig_enabled, mig_instances) = mig_of(&device, index)?;
            gpus.push(GpuDevice {
                uuid,
                index,
                model,
                memory_mib: memory.total / MIB,
                pci_bus_id: pci.bus_id,
                numa_node: address.and_then(|a| a.sysfs_numa_node()),
                mig_enabled,
                mig_instances,
            });
            addresses.push(address);
        }

        let topology = Topology {
            links: link_matrix(nvml, &addresses),
            cpu_affinity: addresses
                .iter()
                .map(|a| a.and_then(|a| a.sysfs_local_cpulist()).unwrap_or_default())
                .collect(),
            numa_affinity: gpus.iter().map(|g| g.numa_node).collect(),
        };
        Ok(HostInventory {
            gpus,
            topology,
            cpu_milli: host_cpu_count() * 1000,
            memory_mib: host_memory_mib()?,
            driver: self.driver.clone(),
        })
    }

    /// Compute processes and their memory (`nvmlDeviceGetComputeRunningProcesses`), with
    /// each one's SM utilisation over the last sampling window
    /// (`nvmlDeviceGetProcessUtilization`; GPUs without it give memory only). A GPU that
    /// does not answer is skipped: accounting is best effort, never a reason to fail a job.
    fn process_samples(&self) -> Vec<super::ProcessGpuSample> {
        let mut out = Vec::new();
        // Samples of the last 10 s (NVML keeps a short ring of them per GPU).
        let since_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
            .saturating_sub(10_000_000);
        for (index, uuid) in self.uuids.iter().enumerate() {
            let Ok(device) = self.nvml.device_by_index(index as u32) else {
                continue;
            };
            let utilisation: std::collections::HashMap<u32, u32> = device
                .process_utilization_stats(since_us)
                .unwrap_or_default()
                .into_iter()
                .map(|s| (s.pid, s.sm_util))
                .collect();
            for p in device.running_compute_processes().unwrap_or_default() {
                out.push(super::ProcessGpuSample {
                    gpu_uuid: uuid.clone(),
                    pid: p.pid,
                    sm_percent: utilisation.get(&p.pid).copied(),
                    memory_bytes: match p.used_gpu_memory {
                        nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => Some(bytes),
                        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                    },
                });
            }
        }
        out
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError> {
        let Some(events) = &self.events else {
            // Nothing can arrive; wait as asked so the caller's loop does not spin.
            std::thread::sleep(timeout);
            return Ok(None);
        };
        // A panic while waiting cannot corrupt the set itself (NVML owns its state).
        let set = events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let data = match set.wait(timeout_ms) {
            Ok(data) => data,
            Err(NvmlError::Timeout) => return Ok(None),
            Err(NvmlError::GpuLost) => return self.find_lost_gpu().map(Some),
            Err(e) => return Err(backend_error("waiting for GPU events", &e)),
        };
        if !data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
            // Only Xid events are registered; anything else is not ours to report.
            return Ok(None);
        }
        let uuid = match data.device.uuid() {
            Ok(uuid) => uuid,
            Err(NvmlError::GpuLost) => return self.find_lost_gpu().map(Some),
            Err(e) => return Err(backend_error("reading the UUID of a GPU with an Xid", &e)),
        };
        Ok(Some(xid_event(uuid, data.event_data)))
    }
}

/// Maps an NVML init failure to `NoDriver` with what an operator should do.
fn no_driver(library: &OsStr, error: &NvmlError) -> GpuError {
    let library = library.to_string_lossy();
    let what = match error {
        NvmlError::LibloadingError(_) => format!("cannot load {library}"),
        NvmlError::DriverNotLoaded => {
            format!("{library} is installed but the NVIDIA kernel driver is not loaded")
        }
        NvmlError::NoPermission => {
            format!("{library} loaded but this user may not talk to the NVIDIA driver")
        }
        NvmlError::FailedToLoadSymbol(_) => {
            format!("{library} lacks functions this agent needs (driver too old?)")
        }
        _ => format!("initialising NVML from {library} failed"),
    };
    GpuError::NoDriver(format!(
        "{what} ({error}): this host has no NVIDIA driver the agent can use. Install or load \
         the NVIDIA driver (`nvidia-smi` must work), or test without GPUs using the simulated \
         backend (a topology file or a preset such as `dgx-h100`)"
    ))
}

fn backend_error(doing: &str, error: &NvmlError) -> GpuError {
    GpuError::Backend(format!("NVML: {doing}: {error}"))
}

/// Registers every GPU that supports it for critical Xid events, in one set.
///
/// `register_events` consumes the set and frees it on failure, so a GPU that refuses is left
/// out and the set is rebuilt without it; each retry excludes one more GPU, so this ends.
fn register_xid_events(nvml: &'static Nvml, count: u32) -> Option<EventSet<'static>> {
    let mut excluded: Vec<u32> = Vec::new();
    'attempt: loop {
        let mut set = match nvml.create_event_set() {
            Ok(set) => set,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "cannot create an NVML event set: Xid errors will not be reported"
                );
                return None;
            }
        };
        let mut registered = 0;
        for index in 0..count {
            if excluded.contains(&index) {
                continue;
            }
            let device = match nvml.device_by_index(index) {
                Ok(device) => device,
                Err(e) => {
                    tracing::warn!(gpu = index, error = %e, "cannot open GPU for Xid events");
                    excluded.push(index);
                    continue;
                }
            };
            let supported = device
                .supported_event_types()
                .unwrap_or_else(|_| EventTypes::empty());
            if !supported.contains(EventTypes::CRITICAL_XID_ERROR) {
                tracing::warn!(
                    gpu = index,
                    "GPU does not report Xid events: its faults will not be seen"
                );
                excluded.push(index);
                continue;
            }
            match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                Ok(same_set) => {
                    set = same_set;
                    registered += 1;
                }
                Err(e) => {
                    tracing::warn!(gpu = index, error = %e.error, "cannot register for Xid events");
                    excluded.push(index);
                    continue 'attempt;
                }
            }
        }
        return (registered > 0).then_some(set);
    }
}

/// An NVML Xid event as a `GpuEvent`; Xid 79 is the GPU falling off the bus.
fn xid_event(gpu_uuid: String, data: Option<XidError>) -> GpuEvent {
    let (code, detail) = match data {
        Some(XidError::Value(value)) => (
            u32::try_from(value).unwrap_or(u32::MAX),
            "reported by NVML".to_string(),
        ),
        Some(XidError::Unknown) | None => (
            UNKNOWN_XID,
            "NVML reported an Xid but could not tell which; see `dmesg | grep Xid`".to_string(),
        ),
    };
    if code == 79 {
        GpuEvent::FellOffBus { gpu_uuid }
    } else {
        GpuEvent::Xid {
            gpu_uuid,
            code,
            detail,
        }
    }
}

/// MIG mode and instances of one GPU.
fn mig_of(device: &Device<'_>, index: u32) -> Result<(bool, Vec<MigInstance>), GpuError> {
    let enabled = match device.mig_mode() {
        Ok(mode) => mode.current == MIG_ENABLED,
        // Pre-Ampere GPUs and GPUs without MIG.
        Err(NvmlError::NotSupported) => false,
        Err(e) => {
            return Err(backend_error(
                &format!("reading MIG mode of GPU {index}"),
                &e,
            ));
        }
    };
    if !enabled {
        return Ok((false, Vec::new()));
    }
    let slots = device
        .mig_device_count()
        .map_err(|e| backend_error(&format!("counting MIG slots of GPU {index}"), &e))?;
    let mut instances = Vec::new();
    for slot in 0..slots {
        let mig = match device.mig_device_by_index(slot) {
            Ok(mig) => mig,
            // The count is the maximum; unpopulated slots answer NotFound.
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => {
                return Err(backend_error(
                    &format!("opening MIG slot {slot} of GPU {index}"),
                    &e,
                ));
            }
        };
        let at = |what: &str| format!("reading the {what} of MIG slot {slot} on GPU {index}");
        let uuid = mig.uuid().map_err(|e| backend_error(&at("UUID"), &e))?;
        let memory_mib = mig
            .memory_info()
            .map_err(|e| backend_error(&at("memory size"), &e))?
            .total
            / MIB;
        let name = mig.name().unwrap_or_default();
        let (gpu_instance_id, compute_instance_id) = mig_instance_ids(&mig);
        instances.push(MigInstance {
            uuid,
            profile: mig_profile_name(&name, memory_mib),
            memory_mib,
            gpu_instance_id,
            compute_instance_id,
        });
    }
    Ok((true, instances))
}

/// The GPU instance and compute instance ids of a MIG device handle. nvml-wrapper 0.13 does
/// not wrap `nvmlDeviceGetGpuInstanceId`/`nvmlDeviceGetComputeInstanceId`, so they are called
/// from the library it loaded. `None` for one the driver lacks or refuses: the slice then
/// gets no capability node (see `MigInstance`), which fails closed.
fn mig_instance_ids(mig: &Device<'_>) -> (Option<u32>, Option<u32>) {
    let lib = mig.nvml().lib();
    // NVML_SUCCESS
    const SUCCESS: u32 = 0;
    let gi = lib.nvmlDeviceGetGpuInstanceId.as_ref().ok().and_then(|f| {
        let mut id = 0;
        // SAFETY: a MIG device handle NVML gave, and a place for the one integer it writes.
        (unsafe { (*f)(mig.handle(), &mut id) } == SUCCESS).then_some(id)
    });
    let ci = lib
        .nvmlDeviceGetComputeInstanceId
        .as_ref()
        .ok()
        .and_then(|f| {
            let mut id = 0;
            // SAFETY: as above.
            (unsafe { (*f)(mig.handle(), &mut id) } == SUCCESS).then_some(id)
        });
    (gi, ci)
}

/// The profile of a MIG device from its NVML name (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`). When
/// the name does not carry one, `mig-<N>gb` from its memory, so that it is at least clear
/// which slices are which size.
fn mig_profile_name(device_name: &str, memory_mib: u64) -> String {
    if let Some((_, profile)) = device_name.rsplit_once("MIG ") {
        let profile = profile.trim();
        if !profile.is_empty() && !profile.contains(' ') {
            return profile.to_string();
        }
    }
    format!("mig-{}gb", (memory_mib + 512) / 1024)
}

/// A PCI address, comparable whatever way it was written (NVML: `00000000:1B:00.0`, sysfs:
/// `0000:1b:00.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PciAddress {
    domain: u32,
    bus: u8,
    device: u8,
    function: u8,
}

impl PciAddress {
    fn parse(text: &str) -> Option<Self> {
        let text = text.trim().trim_end_matches('\0');
        let (domain, rest) = text.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        Some(PciAddress {
            domain: u32::from_str_radix(domain, 16).ok()?,
            bus: u8::from_str_radix(bus, 16).ok()?,
            device: u8::from_str_radix(device, 16).ok()?,
            function: u8::from_str_radix(function, 16).ok()?,
        })
    }

    /// The directory name under `/sys/bus/pci/devices`.
    fn sysfs_name(self) -> String {
        format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }

    fn sysfs_read(self, file: &str) -> Option<String> {
        let path = format!("/sys/bus/pci/devices/{}/{file}", self.sysfs_name());
        std::fs::read_to_string(path).ok()
    }

    /// `-1` (no NUMA information) reads as `None`.
    fn sysfs_numa_node(self) -> Option<u32> {
        parse_numa_node(&self.sysfs_read("numa_node")?)
    }

    fn sysfs_local_cpulist(self) -> Option<String> {
        let list = self.sysfs_read("local_cpulist")?;
        let list = list.trim();
        (!list.is_empty()).then(|| list.to_string())
    }
}

fn parse_numa_node(text: &str) -> Option<u32> {
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// The link matrix: NVLink counts where GPUs have active NVLinks to each other (directly or
/// through NVSwitches), otherwise the PCIe level NVML reports.
fn link_matrix(nvml: &Nvml, addresses: &[Option<PciAddress>]) -> Vec<Vec<LinkKind>> {
    let n = addresses.len();
    let mut direct = vec![vec![0u32; n]; n];
    let mut to_switch = vec![0u32; n];
    for (i, own) in addresses.iter().enumerate() {
        let Ok(device) = nvml.device_by_index(i as u32) else {
            continue;
        };
        for link in 0..NVLINK_MAX_LINKS {
            let nvlink = device.link_wrapper_for(link);
            match nvlink.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // NotSupported: no NVLink on this GPU; InvalidArg: past its last link.
                Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
                Err(_) => continue,
            }
            // The far end's PCI address names the peer GPU. An address that is no GPU of
            // this host is an NVSwitch (nvml-wrapper 0.13's `remote_device_type` always
            // answers Unknown: it writes the result into a temporary, so it cannot be used).
            let Some(remote) = nvlink
                .remote_pci_info()
                .ok()
                .and_then(|info| PciAddress::parse(&info.bus_id))
            else {
                continue;
            };
            match addresses.iter().position(|a| *a == Some(remote)) {
                Some(j) if Some(remote) != *own => direct[i][j] += 1,
                Some(_) => {}
                None => to_switch[i] += 1,
            }
        }
    }
    assemble_links(&direct, &to_switch, |i, j| pcie_link(nvml, i, j))
}

/// Builds a symmetric matrix: direct NVLinks (the larger of the two ends' counts, in case one
/// end could not be read) plus links through NVSwitches (limited by the GPU with fewer), and
/// `pcie(i, j)` for pairs without NVLink, asked once per pair.
fn assemble_links(
    direct: &[Vec<u32>],
    to_switch: &[u32],
    pcie: impl Fn(usize, usize) -> LinkKind,
) -> Vec<Vec<LinkKind>> {
    let n = direct.len();
    let mut links = vec![vec![LinkKind::SelfLink; n]; n];
    for i in 0..n {
        for j in (i + 1)..n {
            let nvlinks = direct[i][j].max(direct[j][i]) + to_switch[i].min(to_switch[j]);
            let link = if nvlinks > 0 {
                LinkKind::NvLink(nvlinks)
            } else {
                pcie(i, j)
            };
            links[i][j] = link;
            links[j][i] = link;
        }
    }
    links
}

fn pcie_link(nvml: &Nvml, i: usize, j: usize) -> LinkKind {
    let level = nvml.device_by_index(i as u32).and_then(|a| {
        let b = nvml.device_by_index(j as u32)?;
        a.topology_common_ancestor(b)
    });
    match level {
        Ok(level) => link_for_level(level),
        Err(e) => {
            // Assume the worst path: the scheduler then never prefers this pair wrongly.
            tracing::warn!(
                gpu_a = i,
                gpu_b = j,
                error = %e,
                "PCIe topology unknown; treating as SYS"
            );
            LinkKind::Sys
        }
    }
}

/// NVML's common-ancestor level as `nvidia-smi topo -m` prints it.
fn link_for_level(level: TopologyLevel) -> LinkKind {
    match level {
        // Internal: two GPUs on one board (K80-style), joined by the board's own switch.
        TopologyLevel::Internal | TopologyLevel::Single => LinkKind::Pix,
        TopologyLevel::Multiple => LinkKind::Pxb,
        TopologyLevel::HostBridge => LinkKind::Phb,
        TopologyLevel::Node => LinkKind::Node,
        TopologyLevel::System => LinkKind::Sys,
    }
}

/// Logical CPUs of the host: `/proc/cpuinfo` counts all of them, where
/// `available_parallelism` would count only those this process's cgroup or affinity allows.
fn host_cpu_count() -> u64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| count_cpuinfo_processors(&text))
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() as u64)
        })
        .unwrap_or(1)
}

fn count_cpuinfo_processors(text: &str) -> Option<u64> {
    let count = text
        .lines()
        .filter(|line| {
            line.split_once(':')
                .is_some_and(|(key, _)| key.trim() == "processor")
        })
        .count() as u64;
    (count > 0).then_some(count)
}

fn host_memory_mib() -> Result<u64, GpuError> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| GpuError::Backend(format!("cannot read /proc/meminfo: {e}")))?;
    parse_meminfo_total_mib(&text)
        .ok_or_else(|| GpuError::Backend("/proc/meminfo has no readable MemTotal line".into()))
}

/// `MemTotal:  263856824 kB` → MiB.
fn parse_meminfo_total_mib(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut fields = line["MemTotal:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") | None => Some(value / 1024),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::topology;

    /// This machine has no NVIDIA driver: construction must fail with `NoDriver` and a message
    /// that names the library and tells the operator what to do. On a GPU host the backend
    /// comes up instead, and its inventory must agree with itself.
    #[test]
    fn new_without_a_driver_says_so() {
        match NvmlBackend::new() {
            Err(GpuError::NoDriver(message)) => {
                assert!(message.contains(NVML_LIBRARY), "{message}");
                assert!(message.contains("no NVIDIA driver"), "{message}");
                assert!(message.contains("simulated"), "{message}");
            }
            Err(other) => panic!("expected NoDriver, got {other}"),
            Ok(backend) => {
                let inv = backend.inventory().expect("inventory on a GPU host");
                assert_eq!(inv.gpus.len(), inv.topology.gpu_count());
                assert_eq!(inv.topology.validate(), Ok(()));
                assert!(inv.driver.starts_with("nvml"));
            }
        }
    }

    #[test]
    fn a_missing_library_is_no_driver_naming_the_path() {
        let path = OsStr::new("/nonexistent/lib/libnvidia-ml.so.1");
        match NvmlBackend::with_library(path) {
            Err(GpuError::NoDriver(message)) => {
                assert!(
                    message.contains("/nonexistent/lib/libnvidia-ml.so.1"),
                    "{message}"
                );
                assert!(message.contains("cannot load"), "{message}");
            }
            Err(other) => panic!("expected NoDriver, got {other}"),
            Ok(_) => panic!("a library that does not exist cannot load"),
        }
    }

    #[test]
    fn no_driver_messages_per_cause() {
        let lib = OsStr::new(NVML_LIBRARY);
        let cases = [
            (NvmlError::DriverNotLoaded, "kernel driver is not loaded"),
            (NvmlError::NoPermission, "may not talk to the NVIDIA driver"),
            (
                NvmlError::FailedToLoadSymbol("nvmlInit_v2".into()),
                "driver too old",
            ),
            (NvmlError::Unknown, "initialising NVML"),
        ];
        for (error, words) in cases {
            let GpuError::NoDriver(message) = no_driver(lib, &error) else {
                panic!("init failures are NoDriver");
            };
            assert!(message.contains(words), "{message}");
            assert!(message.contains(NVML_LIBRARY), "{message}");
        }
    }

    #[test]
    fn xid_events_map_to_gpu_events() {
        let uuid = || "GPU-1".to_string();
        assert_eq!(
            xid_event(uuid(), Some(XidError::Value(79))),
            GpuEvent::FellOffBus { gpu_uuid: uuid() }
        );
        assert!(matches!(
            xid_event(uuid(), Some(XidError::Value(48))),
            GpuEvent::Xid { code: 48, .. }
        ));
        assert!(matches!(
            xid_event(uuid(), Some(XidError::Unknown)),
            GpuEvent::Xid {
                code: UNKNOWN_XID,
                ..
            }
        ));
        assert!(matches!(
            xid_event(uuid(), Some(XidError::Value(1 << 40))),
            GpuEvent::Xid { code: u32::MAX, .. }
        ));
    }

    #[test]
    fn pci_addresses() {
        let nvml_form = PciAddress::parse("00000000:1B:00.0").expect("NVML form");
        let sysfs_form = PciAddress::parse("0000:1b:00.0").expect("sysfs form");
        assert_eq!(nvml_form, sysfs_form);
        assert_eq!(nvml_form.sysfs_name(), "0000:1b:00.0");
        assert_eq!(
            PciAddress::parse("00000001:DB:1F.7").map(PciAddress::sysfs_name),
            Some("0001:db:1f.7".to_string())
        );
        for bad in ["", "1B:00.0", "0000:1g:00.0", "0000:1b:00", "0000:1b:100.0"] {
            assert_eq!(PciAddress::parse(bad), None, "{bad:?}");
        }
        assert_eq!(parse_numa_node("1\n"), Some(1));
        assert_eq!(parse_numa_node("-1\n"), None);
        assert_eq!(parse_numa_node("x"), None);
    }

    #[test]
    fn topology_levels_print_like_nvidia_smi() {
        let cases = [
            (TopologyLevel::Internal, "PIX"),
            (TopologyLevel::Single, "PIX"),
            (TopologyLevel::Multiple, "PXB"),
            (TopologyLevel::HostBridge, "PHB"),
            (TopologyLevel::Node, "NODE"),
            (TopologyLevel::System, "SYS"),
        ];
        for (level, token) in cases {
            assert_eq!(link_for_level(level).to_string(), token);
        }
    }

    /// The matrices NVML link counts assemble into are the ones `nvidia-smi topo -m` prints
    /// for the same hosts (the shipped files).
    #[test]
    fn assembled_links_match_the_shipped_topologies() {
        let sys = |_: usize, _: usize| LinkKind::Sys;

        // DGX H100: each GPU's 18 NVLinks go to NVSwitches, none directly to a GPU.
        let dgx = assemble_links(&vec![vec![0; 8]; 8], &[18; 8], sys);
        let want = topology::parse(include_str!("../../topologies/dgx-h100.txt")).expect("file");
        assert_eq!(dgx, want.links);

        // DGX-1 V100 hybrid cube-mesh: direct links only, PCIe elsewhere.
        let want = topology::parse(include_str!("../../topologies/dgx1-v100.txt")).expect("file");
        let direct: Vec<Vec<u32>> = want
            .links
            .iter()
            .map(|row| row.iter().map(|l| l.nvlinks()).collect())
            .collect();
        assert_eq!(assemble_links(&direct, &[0; 8], sys), want.links);

        // One end's count unreadable: the other end's count still shows; PCIe is asked once
        // per pair and mirrored.
        let mut direct = vec![vec![0; 3]; 3];
        direct[0][1] = 4;
        let asked = std::cell::RefCell::new(Vec::new());
        let links = assemble_links(&direct, &[0; 3], |i, j| {
            asked.borrow_mut().push((i, j));
            LinkKind::Phb
        });
        assert_eq!(links[1][0], LinkKind::NvLink(4));
        assert_eq!(links[2][0], LinkKind::Phb);
        assert_eq!(asked.into_inner(), [(0, 2), (1, 2)]);
    }

    #[test]
    fn mig_profile_names() {
        assert_eq!(
            mig_profile_name("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864),
            "1g.5gb"
        );
        assert_eq!(
            mig_profile_name("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", 9984),
            "1g.10gb+me"
        );
        assert_eq!(mig_profile_name("", 9728), "mig-10gb");
        assert_eq!(mig_profile_name("NVIDIA H100 MIG ", 20096), "mig-20gb");
    }

    #[test]
    fn proc_parsing() {
        let cpuinfo = "processor\t: 0\nmodel name\t: x\n\nprocessor\t: 1\nmodel name\t: x\n";
        assert_eq!(count_cpuinfo_processors(cpuinfo), Some(2));
        assert_eq!(count_cpuinfo_processors("model name : x\n"), None);
        let meminfo = "MemTotal:       263856824 kB\nMemFree:        1000 kB\n";
        assert_eq!(parse_meminfo_total_mib(meminfo), Some(257672));
        assert_eq!(parse_meminfo_total_mib("MemFree: 1 kB\n"), None);
        assert_eq!(parse_meminfo_total_mib("MemTotal: lots kB\n"), None);
        // This host's own files parse.
        assert!(host_cpu_count() >= 1);
        assert!(host_memory_mib().expect("/proc/meminfo") > 0);
    }
}
