//! cgroup v2: one directory in the unified hierarchy. Memory through `memory.max` (and no
//! swap), CPU through `cpu.max`, cpuset through `cpuset.cpus`/`.mems`, stopping through
//! `cgroup.kill`. Device confinement on v2 is a cgroup eBPF program (what runc and crun
//! attach); it is not built yet, so `Enforced::devices` stays false on v2 and the agent
//! reports the node's devices as unenforced rather than pretend.

use std::io;
use std::path::Path;

use super::mounts::V2_CONTROLLERS;
use super::{Enforced, Limits, Usage, keyed, read_u64, write};

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

pub fn create(dir: &Path, limits: &Limits) -> io::Result<Enforced> {
    std::fs::create_dir(dir)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", dir.display())))?;
    let has = |file: &str| dir.join(file).exists();
    let mut enforced = Enforced {
        hierarchy: "cgroup v2".into(),
        ..Enforced::default()
    };
    if has("memory.max")
        && let Some(bytes) = limits.memory_bytes
    {
        write(&dir.join("memory.max"), &bytes.to_string())?;
        if has("memory.swap.max") {
            write(&dir.join("memory.swap.max"), "0")?;
        }
        enforced.memory = true;
    }
    if has("cpu.max")
        && let Some(milli) = limits.cpu_milli
    {
        let quota = (milli * CPU_PERIOD_US / 1000).max(1000);
        write(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
        enforced.cpu = true;
    }
    if has("cpuset.cpus") {
        if let Some(cpus) = &limits.cpus {
            write(&dir.join("cpuset.cpus"), cpus)?;
            enforced.cpuset = true;
        }
        if let Some(mems) = &limits.mems {
            write(&dir.join("cpuset.mems"), mems)?;
        }
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
