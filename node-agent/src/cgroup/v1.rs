//! cgroup v1: one directory per controller. Devices through `devices.deny`/`devices.allow`,
//! memory through `memory.limit_in_bytes` (and the memory+swap limit, so the limit is not
//! escaped into swap), CPU through the CFS quota, cpuset through `cpuset.cpus`/`.mems`
//! (which v1 requires set before a task may join).

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use super::mounts::V1Controller;
use super::{CgroupDir, Enforced, Limits, Usage, keyed, read_u64, write};

/// CFS period: quota = milli-CPUs × period / 1000.
const CFS_PERIOD_US: u64 = 100_000;

/// Creates `parent` under every controller; in cpuset, each new level copies its parent's
/// CPUs and memory nodes (an empty cpuset takes no task).
pub fn prepare_parent(
    controllers: &BTreeMap<V1Controller, PathBuf>,
    parent: &Path,
) -> io::Result<()> {
    for (c, mount) in controllers {
        let mut dir = mount.clone();
        for part in parent.components() {
            let above = dir.clone();
            dir = dir.join(part);
            if !dir.is_dir() {
                std::fs::create_dir(&dir).or_else(|e| {
                    if e.kind() == io::ErrorKind::AlreadyExists {
                        Ok(())
                    } else {
                        Err(io::Error::new(
                            e.kind(),
                            format!("creating {}: {e}", dir.display()),
                        ))
                    }
                })?;
            }
            if *c == V1Controller::Cpuset {
                inherit_cpuset(&above, &dir)?;
            }
        }
    }
    Ok(())
}

fn inherit_cpuset(above: &Path, dir: &Path) -> io::Result<()> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let mine = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        if mine.trim().is_empty() {
            let theirs = std::fs::read_to_string(above.join(file))?;
            write(&dir.join(file), theirs.trim())?;
        }
    }
    Ok(())
}

/// Creates the allocation's directories (each with the controllers mounted there) and
/// writes its limits. Which files a directory has follows from its controllers, so nothing
/// is looked up first.
pub fn create(
    dirs: &BTreeMap<PathBuf, Vec<V1Controller>>,
    limits: &Limits,
) -> io::Result<Enforced> {
    let mut enforced = Enforced {
        hierarchy: "cgroup v1".into(),
        ..Enforced::default()
    };
    for (path, controllers) in dirs {
        std::fs::create_dir(path)
            .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", path.display())))?;
        let dir = CgroupDir::open(path)?;
        let has = |c: V1Controller| controllers.contains(&c);
        if has(V1Controller::Cpuset) {
            // A new v1 cpuset is empty and takes no task: its own CPUs and nodes, or its
            // parent's.
            let above = path.parent().unwrap_or(path);
            for (file, own) in [("cpuset.cpus", &limits.cpus), ("cpuset.mems", &limits.mems)] {
                let value = match own {
                    Some(value) => value.clone(),
                    None => std::fs::read_to_string(above.join(file))?.trim().to_owned(),
                };
                dir.write(file, &value)?;
            }
            enforced.cpuset = limits.cpus.is_some();
        }
        if has(V1Controller::Memory)
            && let Some(bytes) = limits.memory_bytes
        {
            dir.write("memory.limit_in_bytes", &bytes.to_string())?;
            // Present only with swap accounting; must not be below limit_in_bytes.
            dir.write_if_present("memory.memsw.limit_in_bytes", &bytes.to_string())?;
            enforced.memory = true;
        }
        if has(V1Controller::Cpu)
            && let Some(milli) = limits.cpu_milli
        {
            dir.write("cpu.cfs_period_us", &CFS_PERIOD_US.to_string())?;
            let quota = (milli * CFS_PERIOD_US / 1000).max(1000);
            dir.write("cpu.cfs_quota_us", &quota.to_string())?;
            enforced.cpu = true;
        }
        if has(V1Controller::Devices)
            && let Some(rules) = &limits.devices
        {
            dir.write("devices.deny", "a")?;
            let rules: Vec<String> = rules.iter().map(ToString::to_string).collect();
            dir.write_each("devices.allow", rules.iter().map(String::as_str))?;
            enforced.devices = true;
        }
    }
    Ok(enforced)
}

pub fn usage(cpuacct: Option<&Path>, memory: Option<&Path>) -> Usage {
    Usage {
        cpu_ns: cpuacct
            .and_then(|d| read_u64(&d.join("cpuacct.usage")))
            .unwrap_or(0),
        peak_memory_bytes: memory
            .and_then(|d| read_u64(&d.join("memory.max_usage_in_bytes")))
            .unwrap_or(0),
        oom_kills: memory
            .and_then(|d| std::fs::read_to_string(d.join("memory.oom_control")).ok())
            .and_then(|t| keyed(&t, "oom_kill"))
            .unwrap_or(0),
    }
}
