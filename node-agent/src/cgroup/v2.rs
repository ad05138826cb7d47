//! cgroup v2: one directory in the unified hierarchy. Memory through `memory.max` (and no
//! swap), CPU through `cpu.max`, cpuset through `cpuset.cpus`/`.mems`, stopping through
//! `cgroup.kill`, devices through a cgroup eBPF program attached to the directory
//! (`device_program`, what runc and crun attach). Whether the kernel takes such a program
//! is probed once, when the node's parent cgroup is prepared ([`probe_devices`]); where it
//! does not, `Enforced::devices` stays false and the node registers its devices as not
//! enforced, saying why, rather than pretend.

use std::io;
use std::path::Path;

use super::device_program;
use super::mounts::V2_CONTROLLERS;
use super::{CgroupDir, Enforced, Limits, Usage, keyed, read_u64, write};

/// The throwaway cgroup [`probe_devices`] attaches to, under the node's parent (allocations
/// are `alloc-<N>`, so never this).
const PROBE: &str = "device-probe";

const CPU_PERIOD_US: u64 = 100_000;

/// Creates `parent` under `root`, and enables the controllers it needs (those the root
/// offers) for the children of every level, from the root down.
pub fn prepare_parent(root: &Path, parent: &Path) -> io::Result<()> {
    let offered = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
    let enable: Vec<String> = V2_CONTROLLERS
        .iter()
        .filter(|c| offered.split_whitespace().any(|o| o == **c))
        .map(|c| format!("+{c}"))
        .collect();
    let mut dir = root.to_owned();
    for part in parent.components() {
        if !enable.is_empty() {
            write(&dir.join("cgroup.subtree_control"), &enable.join(" "))?;
        }
        dir = dir.join(part);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("creating {}: {e}", dir.display()),
                ));
            }
        }
    }
    if !enable.is_empty() {
        write(&dir.join("cgroup.subtree_control"), &enable.join(" "))?;
    }
    Ok(())
}

/// Whether device programs can be attached under `parent` (its path in the hierarchy):
/// attaches a deny-all program to a new empty child cgroup, which is removed again. The
/// error says what the host lacks (no CONFIG_CGROUP_BPF, no CAP_SYS_ADMIN, ...).
pub fn probe_devices(parent: &Path) -> io::Result<()> {
    let dir = parent.join(PROBE);
    // Left by an agent that died mid-probe: empty, as nothing ever joins it.
    let _ = std::fs::remove_dir(&dir);
    std::fs::create_dir(&dir)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", dir.display())))?;
    let attached = device_program::attach(&dir, &[]);
    let _ = std::fs::remove_dir(&dir);
    attached
}

/// Creates the allocation's cgroup `dir` with `limits`. `devices`: the host takes device
/// programs ([`probe_devices`]); then a program that cannot be attached fails the creation
/// (the node said its devices are enforced), otherwise devices are left unconfined.
pub fn create(dir: &Path, limits: &Limits, devices: bool) -> io::Result<Enforced> {
    std::fs::create_dir(dir)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", dir.display())))?;
    let enforced = apply(dir, limits, devices);
    if enforced.is_err() {
        // Nothing has joined it yet: remove it rather than leave a half-limited cgroup.
        let _ = std::fs::remove_dir(dir);
    }
    enforced
}

fn apply(path: &Path, limits: &Limits, devices: bool) -> io::Result<Enforced> {
    let dir = CgroupDir::open(path)?;
    // A controller the parent does not enable has no files here: the limit is reported as
    // not enforced (no lookup first).
    let mut enforced = Enforced {
        hierarchy: "cgroup v2".into(),
        ..Enforced::default()
    };
    if let Some(bytes) = limits.memory_bytes
        && dir.write_if_present("memory.max", &bytes.to_string())?
    {
        // Present only with swap accounting.
        dir.write_if_present("memory.swap.max", "0")?;
        enforced.memory = true;
    }
    if let Some(milli) = limits.cpu_milli {
        let quota = (milli * CPU_PERIOD_US / 1000).max(1000);
        enforced.cpu = dir.write_if_present("cpu.max", &format!("{quota} {CPU_PERIOD_US}"))?;
    }
    if let Some(cpus) = &limits.cpus {
        enforced.cpuset = dir.write_if_present("cpuset.cpus", cpus)?;
    }
    if let Some(mems) = &limits.mems {
        dir.write_if_present("cpuset.mems", mems)?;
    }
    if devices && let Some(rules) = &limits.devices {
        device_program::attach(path, rules)?;
        enforced.devices = true;
    }
    Ok(enforced)
}

pub fn usage(dir: &Path) -> Usage {
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).unwrap_or_default();
    let events = std::fs::read_to_string(dir.join("memory.events")).unwrap_or_default();
    Usage {
        cpu_ns: keyed(&stat, "usage_usec").unwrap_or(0) * 1000,
        // memory.peak: Linux 5.19.
        peak_memory_bytes: read_u64(&dir.join("memory.peak")).unwrap_or(0),
        oom_kills: keyed(&events, "oom_kill").unwrap_or(0),
    }
}
