//! A GPU host that exists only on paper: described by an `nvidia-smi topo -m` file, a GPU
//! model and optional MIG layouts, with hardware faults injected by tests.
//!
//! Everything a real host would report is derived deterministically from the description, so
//! the same host name always yields the same GPU UUIDs, PCI bus ids and MIG UUIDs: a restarted
//! simulated agent re-registers as the same host with the same GPUs. `mig` (a submodule) owns
//! the MIG profile tables and layout check.

pub mod mig;

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::topology::{self, Topology};
use super::{GpuBackend, GpuDevice, GpuError, GpuEvent, HostInventory, MigInstance};

/// What a simulated host has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimulatedSpec {
    /// Host name; seeds every UUID, so two hosts never share one.
    pub host: String,
    /// Short name of the topology for logs (`dgx-h100`, a file stem).
    pub topology_name: String,
    pub topology: Topology,
    /// GPU model, the same for every GPU of the host (`NVIDIA H100 80GB HBM3`).
    pub model: String,
    /// Memory of one GPU, MiB.
    pub memory_mib: u64,
    /// MIG layouts: (GPU index, profiles such as `1g.10gb`). A GPU listed here has MIG mode
    /// on, even with no profiles; the others have it off.
    pub mig: Vec<(u32, Vec<String>)>,
    /// Host CPU capacity in milli-CPUs (1000 per logical CPU).
    pub cpu_milli: u64,
    /// Host memory, MiB.
    pub host_memory_mib: u64,
}

/// A shipped host description: one of the topology files under `node-agent/topologies/`
/// with the hardware such a host typically carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    /// The topology file's contents.
    pub topology_text: &'static str,
    pub model: &'static str,
    pub memory_mib: u64,
    pub cpu_milli: u64,
    pub host_memory_mib: u64,
    /// MIG layouts, as in [`SimulatedSpec::mig`]: (GPU index, profiles). Empty: no MIG.
    pub mig: &'static [(u32, &'static [&'static str])],
}

/// The shipped presets. CPU counts match the union of the files' CPU affinity lists (a test
/// checks it); memory sizes are the vendors' standard configurations.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "dgx-h100",
        topology_text: include_str!("../../topologies/dgx-h100.txt"),
        model: "NVIDIA H100 80GB HBM3",
        memory_mib: 81559,
        // 2 × 56-core Xeon 8480C with hyper-threading.
        cpu_milli: 224_000,
        host_memory_mib: 2 * 1024 * 1024,
        mig: &[],
    },
    Preset {
        name: "dgx1-v100",
        topology_text: include_str!("../../topologies/dgx1-v100.txt"),
        model: "Tesla V100-SXM2-32GB",
        memory_mib: 32768,
        // 2 × 20-core Xeon E5-2698 v4 with hyper-threading.
        cpu_milli: 80_000,
        host_memory_mib: 512 * 1024,
        mig: &[],
    },
    Preset {
        name: "a100-pcie-4gpu-nvlink-pairs",
        topology_text: include_str!("../../topologies/a100-pcie-4gpu-nvlink-pairs.txt"),
        model: "NVIDIA A100 80GB PCIe",
        memory_mib: 81920,
        cpu_milli: 32_000,
        host_memory_mib: 1024 * 1024,
        mig: &[],
    },
    Preset {
        name: "pcie-8gpu-2socket",
        topology_text: include_str!("../../topologies/pcie-8gpu-2socket.txt"),
        model: "NVIDIA L40S",
        memory_mib: 46068,
        cpu_milli: 64_000,
        host_memory_mib: 1024 * 1024,
        mig: &[],
    },
    // One GPU: the smallest host, where GPU shares (MPS) pack.
    Preset {
        name: "h100-pcie-1gpu",
        topology_text: include_str!("../../topologies/h100-pcie-1gpu.txt"),
        model: "NVIDIA H100 PCIe",
        memory_mib: 81559,
        cpu_milli: 32_000,
        host_memory_mib: 512 * 1024,
        mig: &[],
    },
    // The same host with its GPU in MIG mode, cut into every size of slice: 3g + 2g + 1g + 1g
    // (all 7 compute slices and 8 memory slices).
    Preset {
        name: "h100-pcie-1gpu-mig",
        topology_text: include_str!("../../topologies/h100-pcie-1gpu.txt"),
        model: "NVIDIA H100 PCIe",
        memory_mib: 81559,
        cpu_milli: 32_000,
        host_memory_mib: 512 * 1024,
        mig: &[(0, &["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])],
    },
];

/// The preset called `name`.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

impl Preset {
    /// The description of a host called `host` built from this preset, with its MIG layout.
    pub fn spec(&self, host: &str) -> Result<SimulatedSpec, GpuError> {
        let topology =
            topology::parse(self.topology_text).map_err(|message| GpuError::Topology {
                path: format!("preset {}", self.name),
                message,
            })?;
        Ok(SimulatedSpec {
            host: host.to_string(),
            topology_name: self.name.to_string(),
            topology,
            model: self.model.to_string(),
            memory_mib: self.memory_mib,
            mig: self
                .mig
                .iter()
                .map(|(gpu, profiles)| (*gpu, profiles.iter().map(|p| p.to_string()).collect()))
                .collect(),
            cpu_milli: self.cpu_milli,
            host_memory_mib: self.host_memory_mib,
        })
    }
}

fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl SimulatedSpec {
    /// A host called `host` from the preset called `name`.
    pub fn from_preset(name: &str, host: &str) -> Result<Self, GpuError> {
        preset(name)
            .ok_or_else(|| {
                GpuError::Backend(format!(
                    "unknown simulated host preset `{name}` (known: {})",
                    preset_names()
                ))
            })?
            .spec(host)
    }

    /// A host called `host` whose GPUs are `model` with `memory_mib` each, linked as the
    /// `nvidia-smi topo -m` file at `path` says.
    ///
    /// CPU capacity defaults to the CPUs named in the file's affinity lists (16 per GPU if
    /// it has none) and host memory to twice the GPUs' total memory, the usual sizing rule;
    /// both fields are public to override.
    pub fn from_topology_file(
        path: impl AsRef<Path>,
        host: &str,
        model: &str,
        memory_mib: u64,
    ) -> Result<Self, GpuError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let error = |message: String| GpuError::Topology {
            path: shown.clone(),
            message,
        };
        let text = read_topology_text(path).map_err(error)?;
        let topology = topology::parse(&text).map_err(error)?;
        if topology.gpu_count() > MAX_GPUS {
            return Err(error(format!(
                "the matrix has {} GPUs; a host has at most {MAX_GPUS} (the control plane \
                 refuses larger ones)",
                topology.gpu_count()
            )));
        }
        let gpus = topology.gpu_count() as u64;
        let cpus = topology
            .affinity_cpu_count()
            .map(u64::from)
            .unwrap_or(16 * gpus);
        let topology_name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or(shown);
        Ok(SimulatedSpec {
            host: host.to_string(),
            topology_name,
            topology,
            model: model.to_string(),
            memory_mib,
            mig: Vec::new(),
            cpu_milli: cpus * 1000,
            host_memory_mib: 2 * memory_mib * gpus,
        })
    }
}

/// Most GPUs of a host: the control plane's limit (`MAX_GPUS_PER_NODE`); a host with more
/// would be refused at every registration.
pub const MAX_GPUS: usize = 16;

/// Largest topology file read: `nvidia-smi topo -m` of a 16-GPU host with NICs is a few KB.
pub const MAX_TOPOLOGY_FILE_BYTES: u64 = 1024 * 1024;

/// The text of a topology file: refused if it is larger than any `nvidia-smi topo -m` output
/// (`/dev/zero` must not be read until memory runs out) or not UTF-8 (the line that is not).
fn read_topology_text(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read the file: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_TOPOLOGY_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read the file: {e}"))?;
    if bytes.len() as u64 > MAX_TOPOLOGY_FILE_BYTES {
        return Err(format!(
            "the file is larger than {MAX_TOPOLOGY_FILE_BYTES} bytes: not `nvidia-smi topo -m` \
             output (is it the right file?)"
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        let good = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = good.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = good.len() - good.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) + 1;
        let byte = e.as_bytes()[good.len()];
        format!(
            "line {line}: byte 0x{byte:02x} at column {column} is not UTF-8 text: not \
             `nvidia-smi topo -m` output (is it the right file?)"
        )
    })
}

/// A simulated host. The inventory is fixed at construction; events come only from
/// [`SimulatedBackend::inject`].
#[derive(Debug)]
pub struct SimulatedBackend {
    spec: SimulatedSpec,
    inventory: HostInventory,
    events: Mutex<VecDeque<GpuEvent>>,
    event_ready: Condvar,
}

impl SimulatedBackend {
    /// Validates `spec` (topology, MIG layouts) and builds the host.
    pub fn new(spec: SimulatedSpec) -> Result<Self, GpuError> {
        let inventory = build_inventory(&spec)
            .map_err(|e| GpuError::Backend(format!("simulated host `{}`: {e}", spec.host)))?;
        Ok(SimulatedBackend {
            spec,
            inventory,
            events: Mutex::new(VecDeque::new()),
            event_ready: Condvar::new(),
        })
    }

    /// See [`SimulatedSpec::from_preset`].
    pub fn from_preset(name: &str, host: &str) -> Result<Self, GpuError> {
        Self::new(SimulatedSpec::from_preset(name, host)?)
    }

    /// See [`SimulatedSpec::from_topology_file`].
    pub fn from_topology_file(
        path: impl AsRef<Path>,
        host: &str,
        model: &str,
        memory_mib: u64,
    ) -> Result<Self, GpuError> {
        Self::new(SimulatedSpec::from_topology_file(
            path, host, model, memory_mib,
        )?)
    }

    pub fn spec(&self) -> &SimulatedSpec {
        &self.spec
    }

    /// UUID of the GPU at `index`.
    pub fn gpu_uuid(&self, index: u32) -> Option<&str> {
        self.inventory
            .gpus
            .get(index as usize)
            .map(|gpu| gpu.uuid.as_str())
    }

    /// Queues `event` for [`GpuBackend::next_event`]. Refused if its GPU is not one of this
    /// host's (a test that injects into the wrong host should fail loudly, not hang).
    pub fn inject(&self, event: GpuEvent) -> Result<(), GpuError> {
        let uuid = match &event {
            GpuEvent::Xid { gpu_uuid, .. }
            | GpuEvent::FellOffBus { gpu_uuid }
            | GpuEvent::Recovered { gpu_uuid } => gpu_uuid,
        };
        if !self.inventory.gpus.iter().any(|gpu| &gpu.uuid == uuid) {
            return Err(GpuError::Backend(format!(
                "cannot inject {event:?}: {uuid} is not a GPU of simulated host `{}` (its GPUs \
                 are {})",
                self.spec.host,
                self.inventory
                    .gpus
                    .iter()
                    .map(|g| g.uuid.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        self.queue().push_back(event);
        self.event_ready.notify_all();
        Ok(())
    }

    /// The queue, even if a thread panicked while holding it: a `VecDeque` push or pop cannot
    /// leave it inconsistent, and losing injected events to poisoning would hide the panic's
    /// real cause behind a second failure.
    fn queue(&self) -> MutexGuard<'_, VecDeque<GpuEvent>> {
        self.events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl GpuBackend for SimulatedBackend {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn inventory(&self) -> Result<HostInventory, GpuError> {
        Ok(self.inventory.clone())
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError> {
        let queue = self.queue();
        let (mut queue, _) = self
            .event_ready
            .wait_timeout_while(queue, timeout, |q| q.is_empty())
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Ok(queue.pop_front())
    }
}

fn build_inventory(spec: &SimulatedSpec) -> Result<HostInventory, String> {
    if spec.host.trim().is_empty() {
        return Err("the host name is empty (it seeds the GPU UUIDs)".into());
    }
    if spec.memory_mib == 0 {
        return Err("GPU memory is 0 MiB".into());
    }
    spec.topology
        .validate()
        .map_err(|e| format!("topology `{}`: {e}", spec.topology_name))?;
    let count = spec.topology.gpu_count();
    if count == 0 {
        return Err(format!("topology `{}` has no GPUs", spec.topology_name));
    }

    let mut gpus: Vec<GpuDevice> = (0..count as u32)
        .map(|index| GpuDevice {
            uuid: gpu_uuid(&spec.host, index),
            index,
            model: spec.model.clone(),
            memory_mib: spec.memory_mib,
            pci_bus_id: pci_bus_id(index),
            numa_node: spec.topology.numa_node(index as usize),
            mig_enabled: false,
            mig_instances: Vec::new(),
        })
        .collect();

    for (gpu_index, profiles) in &spec.mig {
        let gpu = gpus.get_mut(*gpu_index as usize).ok_or_else(|| {
            format!(
                "MIG layout for GPU{gpu_index}, but the host has GPU0..GPU{}",
                count - 1
            )
        })?;
        if gpu.mig_enabled {
            return Err(format!("two MIG layouts for GPU{gpu_index}"));
        }
        let table = mig::mig_gpu_for(&spec.model, spec.memory_mib).ok_or_else(|| {
            format!(
                "MIG layout for GPU{gpu_index}, but `{}` ({} MiB) has no MIG (simulated MIG \
                 GPUs: A100 40GB/80GB, H100 80GB)",
                spec.model, spec.memory_mib
            )
        })?;
        let placed = table
            .place(profiles)
            .map_err(|e| format!("GPU{gpu_index} MIG layout: {e}"))?;
        gpu.mig_enabled = true;
        gpu.mig_instances = placed
            .into_iter()
            .zip(0u32..)
            .map(|((profile, _start), slot)| MigInstance {
                uuid: mig_uuid(&spec.host, *gpu_index, slot),
                profile: profile.name.to_string(),
                memory_mib: profile.memory_mib,
                // One per slot, never 0 (the whole-GPU instance), as the driver's are unique
                // per GPU; not the driver's placement-based numbering, which nothing here
                // depends on. Each slice is one compute instance spanning its GPU instance
                // (what `nvidia-smi mig -cgi ... -C` makes): CI 0.
                gpu_instance_id: Some(slot + 1),
                compute_instance_id: Some(0),
            })
            .collect();
    }

    Ok(HostInventory {
        gpus,
        topology: spec.topology.clone(),
        cpu_milli: spec.cpu_milli,
        memory_mib: spec.host_memory_mib,
        driver: format!("simulated {}", spec.topology_name),
    })
}

/// FNV-1a over `parts`, each followed by a 0xff separator (which never occurs in UTF-8) so
/// that ("ab", "c") and ("a", "bc") hash differently, then a SplitMix64 finaliser so that
/// neighbouring indices give unrelated-looking UUIDs.
fn stable_hash(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &byte in part.iter().chain(&[0xff]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// `PREFIX-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` from two independent 64-bit hashes.
fn uuid_like(prefix: &str, parts: &[&[u8]]) -> String {
    let mut seeded = Vec::with_capacity(parts.len() + 1);
    seeded.push(b"high".as_slice());
    seeded.extend_from_slice(parts);
    let high = stable_hash(&seeded);
    seeded[0] = b"low".as_slice();
    let low = stable_hash(&seeded);
    format!(
        "{prefix}-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

/// The UUID of simulated GPU `index` on `host`: `GPU-` and 8-4-4-4-12 hex digits, like
/// `nvidia-smi -L` prints.
pub fn gpu_uuid(host: &str, index: u32) -> String {
    uuid_like("GPU", &[b"gpu", host.as_bytes(), &index.to_le_bytes()])
}

/// The UUID of MIG instance `slot` (its position in the GPU's layout) on GPU `gpu_index`.
pub fn mig_uuid(host: &str, gpu_index: u32, slot: u32) -> String {
    uuid_like(
        "MIG",
        &[
            b"mig",
            host.as_bytes(),
            &gpu_index.to_le_bytes(),
            &slot.to_le_bytes(),
        ],
    )
}

/// A plausible PCI bus id in NVML's format: the buses an HGX H100 board uses, repeated in
/// further PCI domains beyond eight GPUs so that ids stay unique.
pub fn pci_bus_id(index: u32) -> String {
    const BUSES: [u32; 8] = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];
    format!("{:08X}:{:02X}:00.0", index / 8, BUSES[(index % 8) as usize])
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;
    use crate::gpu::LinkKind;

    fn is_uuid(prefix: &str, s: &str) -> bool {
        let Some(rest) = s.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else {
            return false;
        };
        let groups: Vec<&str> = rest.split('-').collect();
        groups.iter().map(|g| g.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
            && groups.iter().all(|g| {
                g.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            })
    }

    #[test]
    fn presets_describe_their_hosts() {
        // (preset, GPUs, model, GPU memory, NUMA of the last GPU, a link)
        let cases = [
            (
                "dgx-h100",
                8,
                "NVIDIA H100 80GB HBM3",
                81559,
                Some(1),
                (0, 7, LinkKind::NvLink(18)),
            ),
            (
                "dgx1-v100",
                8,
                "Tesla V100-SXM2-32GB",
                32768,
                Some(1),
                (0, 5, LinkKind::Sys),
            ),
            (
                "a100-pcie-4gpu-nvlink-pairs",
                4,
                "NVIDIA A100 80GB PCIe",
                81920,
                Some(1),
                (2, 3, LinkKind::NvLink(12)),
            ),
            (
                "pcie-8gpu-2socket",
                8,
                "NVIDIA L40S",
                46068,
                Some(1),
                (0, 1, LinkKind::Pix),
            ),
        ];
        for (name, gpus, model, memory, numa, (a, b, link)) in cases {
            let backend = SimulatedBackend::from_preset(name, "node-1").expect(name);
            let inv = backend.inventory().expect("inventory");
            assert_eq!(inv.gpus.len(), gpus, "{name}");
            assert!(
                inv.gpus
                    .iter()
                    .all(|g| g.model == model && g.memory_mib == memory)
            );
            assert_eq!(inv.gpus[gpus - 1].numa_node, numa, "{name}");
            assert_eq!(inv.gpus[0].numa_node, Some(0), "{name}");
            assert_eq!(inv.topology.link(a, b), Some(link), "{name}");
            assert_eq!(inv.driver, format!("simulated {name}"));
            // The preset's CPU capacity is the CPUs its topology file names.
            let cpus = inv.topology.affinity_cpu_count().expect("affinity lists");
            assert_eq!(inv.cpu_milli, u64::from(cpus) * 1000, "{name}");
            assert!(
                inv.memory_mib >= 2 * memory * gpus as u64,
                "{name}: host memory"
            );
            assert_eq!(backend.name(), "simulated");
        }
        let err = SimulatedBackend::from_preset("dgx-b200", "n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("dgx-b200") && err.contains("dgx-h100"),
            "{err}"
        );
    }

    #[test]
    fn every_preset_builds_and_the_single_gpu_ones_have_their_mig_layouts() {
        let mut names = HashSet::new();
        for p in PRESETS {
            assert!(names.insert(p.name), "two presets called {}", p.name);
            let inv = SimulatedBackend::from_preset(p.name, "node-1")
                .unwrap_or_else(|e| panic!("{}: {e}", p.name))
                .inventory()
                .expect("inventory");
            let cpus = inv.topology.affinity_cpu_count().expect("affinity lists");
            assert_eq!(inv.cpu_milli, u64::from(cpus) * 1000, "{}", p.name);
            let mig_gpus: Vec<u32> = p.mig.iter().map(|(gpu, _)| *gpu).collect();
            for gpu in &inv.gpus {
                assert_eq!(gpu.mig_enabled, mig_gpus.contains(&gpu.index), "{}", p.name);
            }
        }

        let inv = SimulatedBackend::from_preset("h100-pcie-1gpu", "n")
            .expect("preset")
            .inventory()
            .expect("inventory");
        assert_eq!(inv.gpus.len(), 1);
        assert!(!inv.gpus[0].mig_enabled && inv.gpus[0].mig_instances.is_empty());
        assert_eq!(inv.gpus[0].memory_mib, 81559);

        let inv = SimulatedBackend::from_preset("h100-pcie-1gpu-mig", "n")
            .expect("preset")
            .inventory()
            .expect("inventory");
        assert_eq!(inv.gpus.len(), 1);
        let gpu = &inv.gpus[0];
        assert!(gpu.mig_enabled);
        let got: Vec<(&str, u64)> = gpu
            .mig_instances
            .iter()
            .map(|m| (m.profile.as_str(), m.memory_mib))
            .collect();
        assert_eq!(
            got,
            [
                ("3g.40gb", 40448),
                ("2g.20gb", 20096),
                ("1g.10gb", 9984),
                ("1g.10gb", 9984)
            ]
        );
        assert!(gpu.mig_instances.iter().all(|m| is_uuid("MIG", &m.uuid)));
        // The same host name gives the same UUIDs as the whole-GPU preset (the GPU is the
        // same card, only its mode differs).
        assert_eq!(gpu.uuid, gpu_uuid("n", 0));
    }

    #[test]
    fn uuids_are_deterministic_unique_and_well_formed() {
        let mut seen = HashSet::new();
        for host in ["node-1", "node-2", "node-10", "node-1 "] {
            let inv = SimulatedBackend::from_preset("dgx-h100", host)
                .expect("preset")
                .inventory()
                .expect("inventory");
            let again = SimulatedBackend::from_preset("dgx-h100", host)
                .expect("preset")
                .inventory()
                .expect("inventory");
            assert_eq!(inv, again, "same host, same inventory");
            for gpu in &inv.gpus {
                assert!(is_uuid("GPU", &gpu.uuid), "{}", gpu.uuid);
                assert!(seen.insert(gpu.uuid.clone()), "duplicate {}", gpu.uuid);
            }
        }
        assert_eq!(seen.len(), 32);
        assert!(is_uuid("MIG", &mig_uuid("node-1", 0, 0)));
        assert_ne!(mig_uuid("node-1", 0, 1), mig_uuid("node-1", 1, 0));
        assert_ne!(
            mig_uuid("node-1", 0, 0),
            gpu_uuid("node-1", 0).replacen("GPU", "MIG", 1)
        );
    }

    #[test]
    fn pci_bus_ids_are_plausible_and_unique() {
        assert_eq!(pci_bus_id(0), "00000000:18:00.0");
        assert_eq!(pci_bus_id(7), "00000000:DB:00.0");
        assert_eq!(pci_bus_id(8), "00000001:18:00.0");
        let ids: HashSet<String> = (0..64).map(pci_bus_id).collect();
        assert_eq!(ids.len(), 64);
    }

    fn a100_spec(mig: Vec<(u32, Vec<&str>)>) -> SimulatedSpec {
        let mut spec =
            SimulatedSpec::from_preset("a100-pcie-4gpu-nvlink-pairs", "mig-host").expect("preset");
        spec.mig = mig
            .into_iter()
            .map(|(gpu, profiles)| (gpu, profiles.into_iter().map(String::from).collect()))
            .collect();
        spec
    }

    #[test]
    fn mig_layouts_become_instances() {
        let spec = a100_spec(vec![
            (1, vec!["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
            (3, vec![]),
        ]);
        let inv = SimulatedBackend::new(spec)
            .expect("valid")
            .inventory()
            .expect("inv");
        assert!(!inv.gpus[0].mig_enabled && inv.gpus[0].mig_instances.is_empty());
        let gpu = &inv.gpus[1];
        assert!(gpu.mig_enabled);
        let got: Vec<(&str, u64)> = gpu
            .mig_instances
            .iter()
            .map(|m| (m.profile.as_str(), m.memory_mib))
            .collect();
        assert_eq!(
            got,
            [
                ("3g.40gb", 40192),
                ("2g.20gb", 19968),
                ("1g.10gb", 9728),
                ("1g.10gb", 9728)
            ]
        );
        let uuids: HashSet<&str> = gpu.mig_instances.iter().map(|m| m.uuid.as_str()).collect();
        assert_eq!(uuids.len(), 4);
        assert!(uuids.iter().all(|u| is_uuid("MIG", u)));
        assert!(inv.gpus[3].mig_enabled && inv.gpus[3].mig_instances.is_empty());
    }

    #[test]
    fn impossible_mig_layouts_are_rejected() {
        let cases: Vec<(SimulatedSpec, &[&str])> = vec![
            (
                a100_spec(vec![(0, vec!["4g.40gb", "4g.40gb"])]),
                &["GPU0", "at most 1"],
            ),
            (
                a100_spec(vec![(2, vec!["3g.40gb", "3g.40gb", "1g.10gb"])]),
                &["GPU2", "9 memory slices"],
            ),
            (
                a100_spec(vec![(0, vec!["1g.5gb"])]),
                &["unknown MIG profile `1g.5gb`"],
            ),
            (
                a100_spec(vec![(4, vec!["1g.10gb"])]),
                &["GPU4", "GPU0..GPU3"],
            ),
            (
                a100_spec(vec![(0, vec![]), (0, vec![])]),
                &["two MIG layouts for GPU0"],
            ),
            (
                {
                    let mut spec = SimulatedSpec::from_preset("dgx1-v100", "v").expect("preset");
                    spec.mig = vec![(0, vec!["1g.10gb".into()])];
                    spec
                },
                &["Tesla V100-SXM2-32GB", "has no MIG"],
            ),
        ];
        for (spec, words) in cases {
            let err = SimulatedBackend::new(spec).unwrap_err().to_string();
            for word in words {
                assert!(err.contains(word), "`{err}` should mention `{word}`");
            }
        }
    }

    #[test]
    fn invalid_specs_are_rejected() {
        let mut spec = SimulatedSpec::from_preset("dgx-h100", "h").expect("preset");
        spec.topology.links[0][1] = LinkKind::Sys;
        let err = SimulatedBackend::new(spec).unwrap_err().to_string();
        assert!(err.contains("not symmetric"), "{err}");
        let spec = SimulatedSpec::from_preset("dgx-h100", " ").expect("preset");
        assert!(
            SimulatedBackend::new(spec)
                .unwrap_err()
                .to_string()
                .contains("host name")
        );
    }

    #[test]
    fn injected_events_come_back_in_order() {
        let backend = SimulatedBackend::from_preset("dgx-h100", "node-1").expect("preset");
        assert_eq!(
            backend.next_event(Duration::from_millis(10)).expect("ok"),
            None
        );
        let gpu3 = backend.gpu_uuid(3).expect("GPU3").to_string();
        let events = [
            GpuEvent::Xid {
                gpu_uuid: gpu3.clone(),
                code: 48,
                detail: "DBE".into(),
            },
            GpuEvent::FellOffBus {
                gpu_uuid: gpu3.clone(),
            },
            GpuEvent::Recovered {
                gpu_uuid: gpu3.clone(),
            },
        ];
        for event in &events {
            backend.inject(event.clone()).expect("own GPU");
        }
        for event in events {
            assert_eq!(backend.next_event(Duration::ZERO).expect("ok"), Some(event));
        }
        assert_eq!(backend.next_event(Duration::ZERO).expect("ok"), None);
    }

    #[test]
    fn inject_refuses_foreign_gpus() {
        let backend = SimulatedBackend::from_preset("dgx-h100", "node-1").expect("preset");
        let other = gpu_uuid("node-2", 0);
        let err = backend
            .inject(GpuEvent::FellOffBus {
                gpu_uuid: other.clone(),
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains(&other) && err.contains("node-1"), "{err}");
        assert_eq!(backend.next_event(Duration::ZERO).expect("ok"), None);
    }

    #[test]
    fn next_event_wakes_when_an_event_is_injected() {
        let backend = Arc::new(SimulatedBackend::from_preset("dgx-h100", "n").expect("preset"));
        let uuid = backend.gpu_uuid(0).expect("GPU0").to_string();
        let injector = {
            let backend = Arc::clone(&backend);
            let uuid = uuid.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                backend.inject(GpuEvent::Recovered { gpu_uuid: uuid })
            })
        };
        let start = Instant::now();
        let event = backend.next_event(Duration::from_secs(30)).expect("ok");
        assert_eq!(event, Some(GpuEvent::Recovered { gpu_uuid: uuid }));
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "woken by the inject, not the timeout"
        );
        injector.join().expect("injector thread").expect("inject");
    }

    #[test]
    fn from_topology_file_reads_and_names_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("lab-box.txt");
        let text = concat!(
            "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n",
            "GPU0\t X \tPIX\t0-7\t0\n",
            "GPU1\tPIX\t X \t8-15\t0\n",
        );
        std::fs::write(&good, text).expect("write");
        let backend =
            SimulatedBackend::from_topology_file(&good, "lab", "NVIDIA A100-SXM4-40GB", 40960)
                .expect("parses");
        let inv = backend.inventory().expect("inventory");
        assert_eq!(inv.gpus.len(), 2);
        assert_eq!(inv.cpu_milli, 16_000);
        assert_eq!(inv.memory_mib, 2 * 2 * 40960);
        assert_eq!(inv.driver, "simulated lab-box");

        let bad = dir.path().join("broken.txt");
        std::fs::write(&bad, "GPU0 GPU1\nGPU0 X NV4\nGPU1 NV2 X\n").expect("write");
        let err = SimulatedBackend::from_topology_file(&bad, "lab", "m", 1).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, GpuError::Topology { .. }), "{text}");
        assert!(
            text.contains("broken.txt") && text.contains("not symmetric"),
            "{text}"
        );

        let missing = dir.path().join("missing.txt");
        let text = SimulatedBackend::from_topology_file(&missing, "lab", "m", 1)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("missing.txt") && text.contains("cannot read"),
            "{text}"
        );
    }

    #[test]
    fn hostile_topology_files_are_refused_naming_the_file_and_the_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let refused = |name: &str, bytes: &[u8]| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).expect("write");
            let err = SimulatedBackend::from_topology_file(&path, "lab", "m", 1).unwrap_err();
            assert!(matches!(err, GpuError::Topology { .. }), "{err}");
            let text = err.to_string();
            assert!(
                text.starts_with(&format!("topology file {}: ", path.display())),
                "{text}"
            );
            assert!(text.len() < 400, "{} bytes: {text:.400}", text.len());
            text
        };
        // Binary garbage: the line and column of the first byte that is not UTF-8.
        let text = refused("binary.txt", b"GPU0\nGPU0 X\n\x7fELF\xff\xfe\x00");
        assert!(
            text.contains("line 3: byte 0xff at column 5 is not UTF-8 text"),
            "{text}"
        );
        // Larger than any `nvidia-smi topo -m` output (and /dev/zero, which never ends).
        let text = refused("huge.txt", &vec![b'#'; 2 * 1024 * 1024]);
        assert!(text.contains("larger than 1048576 bytes"), "{text}");
        if Path::new("/dev/zero").exists() {
            let err = SimulatedBackend::from_topology_file("/dev/zero", "lab", "m", 1)
                .unwrap_err()
                .to_string();
            assert!(err.contains("larger than"), "{err}");
        }
        // Garbage text on one long line: quoted in part.
        let text = refused("garbage.txt", "Z".repeat(100_000).as_bytes());
        assert!(
            text.contains("line 1: expected the header row") && text.contains("(100000 bytes)"),
            "{text}"
        );
        // A well-formed matrix of more GPUs than the control plane takes.
        let n = MAX_GPUS + 1;
        let mut big = String::new();
        for i in 0..n {
            big.push_str(&format!("\tGPU{i}"));
        }
        big.push('\n');
        for r in 0..n {
            big.push_str(&format!("GPU{r}"));
            for c in 0..n {
                big.push_str(if r == c { "\t X " } else { "\tSYS" });
            }
            big.push('\n');
        }
        let text = refused("gpu17.txt", big.as_bytes());
        assert!(text.contains("17 GPUs; a host has at most 16"), "{text}");
    }
}
