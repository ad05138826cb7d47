//! Container workloads: what a job's `--image` becomes on the host, as pure data.
//!
//! A container job runs under the same shim as a process job; the shim's command is the
//! container runner (`node-agent container-run --spec JSON`, in `container_runner.rs`), which
//! creates the container through the local Docker engine's API, streams its output into the
//! allocation's logs, forwards the stop signals and exits with the container's code. So logs,
//! exit codes, time limits, cancel, fencing and re-adoption across agent restarts are the
//! process path's, unchanged. What is the container's own:
//!
//! - **Devices**: exactly the allocated GPUs' nodes (and the driver's control nodes) are
//!   mapped in; the engine's device cgroup denies the rest, as the NVIDIA container toolkit
//!   does on real hosts (docs/ARCHITECTURE.md, "Container workloads").
//! - **Limits**: with the engine's `cgroupfs` driver the container's cgroup is created *under*
//!   the allocation's (`cgroup_parent`), so the allocation's memory limit, CPU quota, cpuset,
//!   accounting and kill cover it; with the `systemd` driver (which only takes slices as
//!   parents) the same limits are set on the container itself.
//! - **Name**: `gpucp-<allocation>-<host key>`, unique per agent state directory, so two
//!   simulated hosts sharing one engine never collide and the agent can remove what a
//!   SIGKILLed runner left.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The subcommand of the agent's binary (and of `gpuctl`) that runs one container.
pub const RUNNER_SUBCOMMAND: &str = "container-run";

/// What a job asked for: an image and host directories to mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerSpec {
    pub image: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A host directory (or file) bind-mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    pub source: PathBuf,
    pub target: PathBuf,
    #[serde(default)]
    pub read_only: bool,
}

/// When the runner pulls an image the engine lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PullPolicy {
    /// Pull only when the host lacks the image (Kubernetes' `IfNotPresent`).
    #[default]
    Missing,
    /// Never pull: an image must be loaded on the host beforehand (air-gapped fleets).
    Never,
}

/// How this host runs containers; `RuntimeConfig::containers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerRuntime {
    /// The program and leading arguments that run [`RUNNER_SUBCOMMAND`].
    pub runner_program: PathBuf,
    pub runner_args: Vec<String>,
    /// The engine's Unix socket (`None`: `DOCKER_HOST` or `/var/run/docker.sock`).
    pub socket: Option<String>,
    /// Where the GPUs' device nodes are on this host (`/dev`; a simulated host's own).
    pub device_dir: PathBuf,
    /// The engine creates containers' cgroups under a given cgroupfs path (`cgroupfs`
    /// driver), so the allocation's cgroup can be their parent.
    pub cgroupfs_driver: bool,
    /// Host paths a job may mount must lie under one of these (empty: no mounts).
    pub mount_prefixes: Vec<PathBuf>,
    pub pull: PullPolicy,
    /// What the node registers, e.g. `docker 20.10.24 (cgroupfs)`.
    pub description: String,
}

/// Everything the runner needs to create, run and remove one container; passed to it as
/// JSON (`--spec`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerSpec {
    pub name: String,
    pub socket: Option<String>,
    pub image: String,
    pub pull: PullPolicy,
    pub command: Vec<String>,
    /// `KEY=VALUE`, the job's environment (the host's own is not passed in).
    pub env: Vec<String>,
    pub workdir: Option<String>,
    /// (host path, path in the container) of every device node it may open.
    pub devices: Vec<(PathBuf, PathBuf)>,
    pub mounts: Vec<Mount>,
    /// The allocation's cgroup, relative to the hierarchy's root (`cgroupfs` driver).
    pub cgroup_parent: Option<String>,
    /// Limits set on the container itself (when it has no cgroup parent of ours).
    pub memory_bytes: Option<u64>,
    pub nano_cpus: Option<u64>,
    pub cpuset_cpus: Option<String>,
    pub cpuset_mems: Option<String>,
    /// `/dev/shm` size: PyTorch data loaders and NCCL use it, and the engine's 64 MiB
    /// default is the first thing a training job trips over.
    pub shm_bytes: u64,
    pub labels: BTreeMap<String, String>,
    /// Created when the engine reports the container OOM-killed.
    #[serde(default)]
    pub oom_marker: Option<PathBuf>,
}

/// The container name of allocation `id` on the host whose agent keeps its state in
/// `state_dir`: stable for the life of the state directory, across agent restarts and
/// releases (FNV-1a, not std's hasher, whose output may change between Rust releases).
pub fn container_name(state_dir: &Path, id: u64) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in state_dir.as_os_str().as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("gpucp-{id}-{:08x}", hash as u32)
}

/// Checks a job's mounts against the host's allowed prefixes; the error names the mount and
/// what the node allows. Paths are compared by components, so `/data2` is not under `/data`,
/// and `..` is refused rather than resolved.
pub fn check_mounts(mounts: &[Mount], prefixes: &[PathBuf]) -> Result<(), String> {
    for m in mounts {
        for (what, path) in [("source", &m.source), ("target", &m.target)] {
            if !path.is_absolute()
                || path
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return Err(format!(
                    "mount {} {}: the {what} must be an absolute path without `..`",
                    m.source.display(),
                    m.target.display()
                ));
            }
        }
        if !prefixes.iter().any(|p| m.source.starts_with(p)) {
            let allowed = if prefixes.is_empty() {
                "none (its operator allows them with --container-mount-prefix)".to_owned()
            } else {
                prefixes
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(format!(
                "mount source {} is not under a directory this node allows containers to mount: {allowed}",
                m.source.display()
            ));
        }
    }
    Ok(())
}

/// The device nodes a container of an allocation holding GPU minors `gpu_minors` gets: those
/// GPUs' `nvidiaN`, its MIG slices' capability nodes (`nvidia-caps/nvidia-capN`), and the
/// control nodes every CUDA process opens, where the host has them. A CPU-only allocation
/// gets no NVIDIA node. `exists` is the filesystem check (a parameter, so this stays pure).
pub fn container_devices(
    device_dir: &Path,
    gpu_minors: &[u32],
    mig_cap_minors: &[u32],
    exists: impl Fn(&Path) -> bool,
) -> Vec<(PathBuf, PathBuf)> {
    if gpu_minors.is_empty() {
        return Vec::new();
    }
    const CONTROL: [&str; 4] = [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia-modeset",
    ];
    let names = gpu_minors
        .iter()
        .map(|m| format!("nvidia{m}"))
        .chain(CONTROL.into_iter().map(str::to_owned))
        .chain(
            mig_cap_minors
                .iter()
                .map(|m| format!("nvidia-caps/nvidia-cap{m}")),
        );
    names
        .map(|name| (device_dir.join(&name), Path::new("/dev").join(&name)))
        .filter(|(host, _)| exists(host))
        .collect()
}

/// The `/dev/shm` size for a job with `memory_mib` of memory (0: unlimited): half of it, at
/// least the engine's 64 MiB and at most 64 GiB; 8 GiB when memory is not limited. Shared
/// memory is charged to the cgroup, so this never lets a job past `--mem`.
pub fn shm_bytes(memory_mib: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    if memory_mib == 0 {
        return 8 * 1024 * MIB;
    }
    (memory_mib / 2).clamp(64, 64 * 1024) * MIB
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(source: &str, target: &str) -> Mount {
        Mount {
            source: source.into(),
            target: target.into(),
            read_only: false,
        }
    }

    #[test]
    fn names_are_stable_per_state_directory_and_distinct_between_hosts() {
        let a = container_name(Path::new("/var/lib/gpucp/agent"), 7);
        assert_eq!(a, container_name(Path::new("/var/lib/gpucp/agent"), 7));
        assert_ne!(a, container_name(Path::new("/tmp/dev/host-1"), 7));
        assert_ne!(a, container_name(Path::new("/var/lib/gpucp/agent"), 8));
        assert!(a.starts_with("gpucp-7-"), "{a}");
        // Docker's name rule: [a-zA-Z0-9][a-zA-Z0-9_.-]+
        assert!(
            a.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
        );
    }

    #[test]
    fn mounts_must_lie_under_an_allowed_prefix_by_components() {
        let allowed = [PathBuf::from("/data"), PathBuf::from("/home")];
        assert!(check_mounts(&[mount("/data/imagenet", "/in")], &allowed).is_ok());
        assert!(check_mounts(&[mount("/home", "/home")], &allowed).is_ok());
        let e = check_mounts(&[mount("/data2/x", "/in")], &allowed).unwrap_err();
        assert!(e.contains("/data2/x") && e.contains("/data, /home"), "{e}");
        let e = check_mounts(&[mount("/data/../etc", "/in")], &allowed).unwrap_err();
        assert!(e.contains("without `..`"), "{e}");
        let e = check_mounts(&[mount("/data/x", "in")], &allowed).unwrap_err();
        assert!(e.contains("target must be an absolute path"), "{e}");
        let e = check_mounts(&[mount("/data/x", "/in")], &[]).unwrap_err();
        assert!(e.contains("--container-mount-prefix"), "{e}");
        assert!(check_mounts(&[], &[]).is_ok());
    }

    #[test]
    fn a_container_gets_its_own_gpus_and_the_control_nodes_the_host_has() {
        let present = |p: &Path| p.file_name().unwrap() != "nvidia-modeset";
        let devices = container_devices(Path::new("/sim/dev"), &[2, 5], &[21], present);
        let inside: Vec<_> = devices
            .iter()
            .map(|(_, c)| c.display().to_string())
            .collect();
        assert_eq!(
            inside,
            [
                "/dev/nvidia2",
                "/dev/nvidia5",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia-caps/nvidia-cap21"
            ]
        );
        assert_eq!(devices[0].0, Path::new("/sim/dev/nvidia2"));
        assert!(container_devices(Path::new("/dev"), &[], &[], |_| true).is_empty());
    }

    #[test]
    fn shared_memory_is_half_the_limit_within_bounds() {
        const MIB: u64 = 1 << 20;
        assert_eq!(shm_bytes(0), 8192 * MIB);
        assert_eq!(shm_bytes(100), 64 * MIB);
        assert_eq!(shm_bytes(32_768), 16_384 * MIB);
        assert_eq!(shm_bytes(1 << 30), 65_536 * MIB);
    }
}
