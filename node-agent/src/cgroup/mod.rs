//! Enforcement of an allocation's resources with a cgroup of its own, on cgroup v1 or v2,
//! whichever the host runs (`mounts`): the device nodes it may open (`devices`), a hard
//! memory limit, a CPU quota, a cpuset, stopping every process of it whatever its session
//! or process group (freeze, kill, thaw), and its accounting (CPU time, peak memory, OOM
//! kills), read from the cgroup when it ends.
//!
//! The cgroup is created before the workload's first instruction: the shim's child joins it
//! between clone and exec (`AllocationCgroup::procs_files`, written with "0"), so nothing the
//! job runs, forks or daemonises is ever outside it. The shim itself stays outside, so it
//! is neither charged nor killed with the job, and records how the job ended.
//!
//! Layout: `<controller mount>/<parent>/<allocation name>` on v1 (one directory per
//! controller), `<v2 mount>/<parent>/<allocation name>` on v2. `parent` is per node (e.g.
//! `gpucp/node-a`), so two simulated hosts on one machine keep apart.

pub mod device_program;
pub mod devices;
pub mod mig_caps;
pub mod mounts;
mod v1;
mod v2;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use devices::DeviceRule;
use mounts::Hierarchy;

/// What an allocation's cgroup limits. `None` leaves that resource unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    /// CPU quota in thousandths of a CPU (1000 = one CPU's time per period).
    pub cpu_milli: Option<u64>,
    /// cpuset CPUs and memory nodes, in the kernel's list form ("0-3,8").
    pub cpus: Option<String>,
    pub mems: Option<String>,
    /// The device nodes it may open; `None` leaves devices unconfined.
    pub devices: Option<Vec<DeviceRule>>,
}

/// What an allocation's cgroup measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub cpu_ns: u64,
    pub peak_memory_bytes: u64,
    /// Processes of the allocation the kernel's OOM killer killed.
    pub oom_kills: u64,
}

/// What was actually enforced on an allocation, for `gpuctl show` and the node's
/// registration: a hierarchy that cannot do something says so rather than pretend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Enforced {
    pub hierarchy: String,
    pub devices: bool,
    pub memory: bool,
    pub cpu: bool,
    pub cpuset: bool,
}

impl Enforced {
    /// "cgroup v1: devices, memory, cpu" (the limits in force).
    pub fn describe(&self) -> String {
        let parts: Vec<&str> = [
            (self.devices, "devices"),
            (self.memory, "memory"),
            (self.cpu, "cpu"),
            (self.cpuset, "cpuset"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        format!("{}: {}", self.hierarchy, parts.join(", "))
    }
}

/// The host's cgroup hierarchy and this node's parent cgroup in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    hierarchy: Hierarchy,
    parent: PathBuf,
    /// v2: whether device programs attach here, or why not (probed once, at set-up). Always
    /// `Ok` on v1, whose `devices` controller is required.
    devices: Result<(), String>,
}

/// How long stopping an allocation may take before it is reported as failed.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

impl Cgroups {
    /// Finds the hierarchy from `/proc/self/mountinfo` and creates (or reuses) the parent
    /// cgroup `parent` in it. The error says what is missing or not writable.
    pub fn detect(parent: &Path) -> Result<Cgroups, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?;
        let mounts = mounts::parse_mountinfo(&mountinfo);
        let hierarchy = mounts::choose(&mounts, |root| {
            std::fs::read_to_string(root.join("cgroup.controllers")).ok()
        })?;
        let mut c = Cgroups {
            hierarchy,
            parent: parent.to_owned(),
            devices: Ok(()),
        };
        c.prepare_parent().map_err(|e| {
            format!(
                "{} found, but its cgroup {} cannot be set up: {e} (the agent needs root, and a writable hierarchy)",
                c.hierarchy.name(),
                parent.display()
            )
        })?;
        c.probe_devices();
        Ok(c)
    }

    /// A given hierarchy, without detection (tests of the other hierarchy on a hybrid host).
    pub fn with_hierarchy(hierarchy: Hierarchy, parent: &Path) -> Result<Cgroups, String> {
        let mut c = Cgroups {
            hierarchy,
            parent: parent.to_owned(),
            devices: Ok(()),
        };
        c.prepare_parent().map_err(|e| e.to_string())?;
        c.probe_devices();
        Ok(c)
    }

    fn probe_devices(&mut self) {
        if let Hierarchy::V2 { root } = &self.hierarchy {
            self.devices = v2::probe_devices(&root.join(&self.parent)).map_err(|e| e.to_string());
        }
    }

    /// Whether allocations' device allow-lists are enforced here, or why not.
    pub fn devices_enforced(&self) -> Result<(), &str> {
        self.devices.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// What allocations' cgroups enforce on this host, for the node's registration.
    pub fn capabilities(&self) -> String {
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => {
                let mut on = vec!["devices", "memory", "cpu", "kill"];
                if controllers.contains_key(&mounts::V1Controller::Cpuset) {
                    on.push("cpuset");
                }
                format!("cgroup v1: {}", on.join(", "))
            }
            // "devices NOT enforced" is what `gpuctl nodes` looks for (cli/output.rs).
            Hierarchy::V2 { .. } => match &self.devices {
                Ok(()) => "cgroup v2: devices, memory, cpu, cpuset, kill".into(),
                Err(why) => {
                    format!("cgroup v2: memory, cpu, cpuset, kill (devices NOT enforced: {why})")
                }
            },
        }
    }

    pub fn is_v2(&self) -> bool {
        matches!(self.hierarchy, Hierarchy::V2 { .. })
    }

    /// Allocation `name`'s cgroup relative to the hierarchy's root (`/gpucp/node.1a2b/alloc-7`):
    /// what a container engine with the cgroupfs driver takes as a container's parent.
    pub fn relative_path(&self, name: &str) -> PathBuf {
        Path::new("/").join(&self.parent).join(name)
    }

    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hierarchy
    }

    fn prepare_parent(&self) -> io::Result<()> {
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => v1::prepare_parent(controllers, &self.parent),
            Hierarchy::V2 { root } => v2::prepare_parent(root, &self.parent),
        }
    }

    /// Removes this node's (empty) parent cgroup, the last level of `parent` only.
    pub fn remove_parent(&self) -> io::Result<()> {
        let dirs: Vec<PathBuf> = match &self.hierarchy {
            Hierarchy::V1 { controllers } => controllers
                .values()
                .map(|m| m.join(&self.parent))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect(),
            Hierarchy::V2 { root } => vec![root.join(&self.parent)],
        };
        dirs.iter().try_for_each(|d| remove_dir_if_present(d))
    }

    /// Creates allocation `name`'s cgroup with `limits` (a leftover of the same name, from
    /// an earlier attempt, is emptied and replaced), and says what it enforces.
    ///
    /// On v1, a hierarchy in which the allocation has nothing to limit or count (`cpu`
    /// without a CPU quota, `cpuset` without NUMA pinning) gets no directory of its own: the
    /// job joins the node's parent cgroup there, which keeps it out of the agent's own
    /// cgroup at the cost of one write instead of a directory made and removed per job.
    pub fn create(&self, name: &str, limits: &Limits) -> io::Result<(AllocationCgroup, Enforced)> {
        let (cg, own) = self.plan(name, limits);
        let enforced = match self.make(&cg, &own, limits) {
            // Rare (an agent that died between creating and recording a cgroup): checked on
            // this path only, so a launch does not pay a lookup per controller for it.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let leftover = self.open(name);
                leftover.kill_all()?;
                leftover.remove()?;
                self.make(&cg, &own, limits)?
            }
            other => other?,
        };
        Ok((cg, enforced))
    }

    /// The allocation's cgroup for `limits`, and on v1 the controllers of each directory of
    /// its own.
    fn plan(&self, name: &str, limits: &Limits) -> (AllocationCgroup, V1Dirs) {
        let Hierarchy::V1 { controllers } = &self.hierarchy else {
            return (self.open(name), V1Dirs::new());
        };
        let needs_own = |c: mounts::V1Controller| match c {
            mounts::V1Controller::Cpu => limits.cpu_milli.is_some(),
            mounts::V1Controller::Cpuset => limits.cpus.is_some() || limits.mems.is_some(),
            _ => true,
        };
        let mut by_mount = V1Dirs::new();
        for (c, mount) in allocation_controllers(controllers) {
            by_mount.entry(mount.clone()).or_default().push(c);
        }
        let mut own = V1Dirs::new();
        let mut joins = Vec::new();
        for (mount, here) in by_mount {
            // Co-mounted controllers (`cpu,cpuacct`) share a directory: one that needs it
            // decides for all.
            if here.iter().any(|c| needs_own(*c)) {
                own.insert(mount.join(&self.parent).join(name), here);
            } else {
                joins.push(mount.join(&self.parent));
            }
        }
        let mut cg = self.open(name);
        cg.dirs = own.keys().cloned().collect();
        cg.joins = joins;
        (cg, own)
    }

    fn make(&self, cg: &AllocationCgroup, own: &V1Dirs, limits: &Limits) -> io::Result<Enforced> {
        match &self.hierarchy {
            Hierarchy::V1 { .. } => v1::create(own, limits),
            Hierarchy::V2 { .. } => v2::create(&cg.dirs[0], limits, self.devices.is_ok()),
        }
    }

    /// Allocation `name`'s cgroup, whether or not it exists (an agent restarted finds the
    /// cgroups of the allocations it re-adopts by name).
    pub fn open(&self, name: &str) -> AllocationCgroup {
        match &self.hierarchy {
            Hierarchy::V1 { controllers } => AllocationCgroup {
                v2: false,
                dirs: allocation_controllers(controllers)
                    .map(|(_, mount)| mount.join(&self.parent).join(name))
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect(),
                joins: Vec::new(),
                freezer: controllers
                    .get(&mounts::V1Controller::Freezer)
                    .map(|m| m.join(&self.parent).join(name)),
                memory: controllers
                    .get(&mounts::V1Controller::Memory)
                    .map(|m| m.join(&self.parent).join(name)),
                cpuacct: controllers
                    .get(&mounts::V1Controller::Cpuacct)
                    .map(|m| m.join(&self.parent).join(name)),
            },
            Hierarchy::V2 { root } => {
                let dir = root.join(&self.parent).join(name);
                AllocationCgroup {
                    v2: true,
                    dirs: vec![dir.clone()],
                    joins: Vec::new(),
                    freezer: Some(dir.clone()),
                    memory: Some(dir.clone()),
                    cpuacct: Some(dir),
                }
            }
        }
    }
}

/// v1 directories to create, with the controllers mounted at each.
type V1Dirs = std::collections::BTreeMap<PathBuf, Vec<mounts::V1Controller>>;

/// The v1 controllers an allocation is placed in: all the host has but `pids`, which limits
/// nothing here (each directory costs a create, a join and a removal per launch). Which of
/// them get a directory of the allocation's own is [`Cgroups::create`]'s choice.
fn allocation_controllers(
    controllers: &std::collections::BTreeMap<mounts::V1Controller, PathBuf>,
) -> impl Iterator<Item = (mounts::V1Controller, &PathBuf)> {
    controllers
        .iter()
        .filter(|(c, _)| **c != mounts::V1Controller::Pids)
        .map(|(c, m)| (*c, m))
}

/// One allocation's cgroup (v1: its directory in each controller's hierarchy). Passed to
/// the shim as JSON, and kept in the allocation's record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AllocationCgroup {
    v2: bool,
    /// The allocation's own directories: created, joined, emptied and removed.
    dirs: Vec<PathBuf>,
    /// v1: the node's parent cgroups of hierarchies where the allocation has none of its
    /// own (see [`Cgroups::create`]): joined only.
    #[serde(default)]
    joins: Vec<PathBuf>,
    freezer: Option<PathBuf>,
    memory: Option<PathBuf>,
    cpuacct: Option<PathBuf>,
}

impl AllocationCgroup {
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|d| d.is_dir())
    }

    /// The `cgroup.procs` files a process writes "0" to, to join the cgroup: what the shim's
    /// child does between clone and exec.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .chain(&self.joins)
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// [`Self::procs_files`] as C strings, made before a fork: the child may not allocate.
    pub fn procs_files_c(&self) -> Vec<std::ffi::CString> {
        use std::os::unix::ffi::OsStrExt;
        self.procs_files()
            .iter()
            .filter_map(|p| std::ffi::CString::new(p.as_os_str().as_bytes()).ok())
            .collect()
    }

    /// The processes in the cgroup now, its child cgroups' included (a container engine
    /// creates the container's cgroup under the allocation's).
    pub fn pids(&self) -> io::Result<Vec<u32>> {
        let dir = self.freezer.as_ref().unwrap_or(&self.dirs[0]);
        let mut pids = read_pids(&dir.join("cgroup.procs"))?;
        for child in descendants(dir) {
            match read_pids(&child.join("cgroup.procs")) {
                Ok(more) => pids.extend(more),
                // Removed meanwhile (the engine cleaning up after its container).
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(pids)
    }

    /// Stops every process of the allocation, whatever its session or process group: frozen
    /// first (so nothing forks while the list is read), killed, thawed so the kills land,
    /// until the cgroup is empty. Returns how many processes were killed.
    pub fn kill_all(&self) -> io::Result<usize> {
        let deadline = std::time::Instant::now() + KILL_TIMEOUT;
        let mut killed = 0;
        if self.v2 {
            // cgroup.kill (Linux 5.14) kills atomically, forks included.
            let kill = self.dirs[0].join("cgroup.kill");
            if kill.exists() {
                let before = self.pids()?.len();
                write(&kill, "1")?;
                self.wait_empty(deadline)?;
                return Ok(before);
            }
        }
        loop {
            let pids = self.pids()?;
            if pids.is_empty() {
                return Ok(killed);
            }
            self.freeze(true, deadline)?;
            for pid in self.pids()? {
                // SAFETY: kill takes a pid and a signal number only.
                if unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) } == 0 {
                    killed += 1;
                }
            }
            self.freeze(false, deadline)?;
            if std::time::Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "processes {pids:?} survive SIGKILL in {}",
                        self.dirs[0].display()
                    ),
                ));
            }
            // Killed processes leave the cgroup as they exit: a moment before the list is
            // read again (not a synchronisation: the loop re-checks).
            let _ = self.wait_empty(std::time::Instant::now() + Duration::from_millis(100));
        }
    }

    fn freeze(&self, frozen: bool, deadline: std::time::Instant) -> io::Result<()> {
        let Some(dir) = &self.freezer else {
            return Ok(());
        };
        if self.v2 {
            return write(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" });
        }
        let state = dir.join("freezer.state");
        let want = if frozen { "FROZEN" } else { "THAWED" };
        write(&state, want)?;
        // Freezing is asynchronous on v1: FREEZING until every task has stopped.
        while std::fs::read_to_string(&state)?.trim() != want {
            if std::time::Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{} did not reach {want}", state.display()),
                ));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    fn wait_empty(&self, deadline: std::time::Instant) -> io::Result<()> {
        while !self.pids()?.is_empty() {
            if std::time::Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{} is not empty after its kill", self.dirs[0].display()),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// CPU time, peak memory and OOM kills so far.
    pub fn usage(&self) -> Usage {
        if self.v2 {
            v2::usage(&self.dirs[0])
        } else {
            v1::usage(self.cpuacct.as_deref(), self.memory.as_deref())
        }
    }

    /// Removes the (empty) cgroup, child cgroups first; a directory already gone is fine.
    pub fn remove(&self) -> io::Result<()> {
        for dir in &self.dirs {
            // Child cgroups are rare (a container engine's, under a container job's): try the
            // directory alone first, and look for them only when it is not empty.
            if remove_dir_if_present(dir).is_ok() {
                continue;
            }
            for d in descendants(dir).into_iter().chain([dir.clone()]) {
                remove_dir_if_present(&d)?;
            }
        }
        Ok(())
    }
}

/// A cgroup directory opened once, whose files are then opened relative to it: every path
/// walk through cgroupfs revalidates each component, and a launch writes a dozen files.
struct CgroupDir {
    fd: std::os::fd::OwnedFd,
    path: PathBuf,
}

impl CgroupDir {
    fn open(path: &Path) -> io::Result<CgroupDir> {
        use std::os::unix::fs::OpenOptionsExt;
        // O_PATH: a handle for lookups under it, not for reading (the access mode is ignored).
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(path)
            .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))?;
        Ok(CgroupDir {
            fd: dir.into(),
            path: path.to_owned(),
        })
    }

    /// Writes `value` to the file `name` in it, in one write (cgroup files take one value
    /// per write).
    fn write(&self, name: &str, value: &str) -> io::Result<()> {
        self.write_each(name, [value])
    }

    /// Writes each of `values` to the file `name`, one write per value through one open:
    /// cgroupfs parses every write on its own (one `devices.allow` rule each), and a job's
    /// dozen device rules would otherwise cost a dozen opens and path lookups.
    fn write_each<'v>(
        &self,
        name: &str,
        values: impl IntoIterator<Item = &'v str>,
    ) -> io::Result<()> {
        use std::io::Write;
        use std::os::fd::{AsRawFd, FromRawFd};
        let in_dir = |value: &str, e: io::Error| {
            io::Error::new(
                e.kind(),
                format!(
                    "writing {value:?} to {}: {e}",
                    self.path.join(name).display()
                ),
            )
        };
        let mut values = values.into_iter().peekable();
        let Some(first) = values.peek().copied() else {
            return Ok(());
        };
        let c = std::ffi::CString::new(name)
            .map_err(|_| in_dir(first, io::Error::other("the file name contains a NUL byte")))?;
        // SAFETY: a valid directory descriptor and a NUL-terminated relative name.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(in_dir(first, io::Error::last_os_error()));
        }
        // SAFETY: a new descriptor nothing else owns.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        for value in values {
            // One `write` call per value: `write_all` of a short value is one write, and
            // cgroupfs takes a value whole or refuses it.
            file.write_all(value.as_bytes())
                .map_err(|e| in_dir(value, e))?;
        }
        Ok(())
    }

    /// [`Self::write`] to a file that only some hosts have (a controller the parent does not
    /// enable, swap accounting off): `false` where it is absent.
    fn write_if_present(&self, name: &str, value: &str) -> io::Result<bool> {
        match self.write(name, value) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Removes an (empty) directory; one already gone is fine.
fn remove_dir_if_present(dir: &Path) -> io::Result<()> {
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io::Error::new(
            e.kind(),
            format!("removing {}: {e}", dir.display()),
        )),
        _ => Ok(()),
    }
}

/// Joins the calling process to the cgroup whose `cgroup.procs` files are `files` (from
/// [`AllocationCgroup::procs_files_c`]). Only async-signal-safe calls (open, write, close),
/// so it may run in a child between fork (or the shim's clone) and exec, before the
/// workload's first instruction.
pub fn join_current_process(files: &[std::ffi::CString]) -> io::Result<()> {
    for f in files {
        // SAFETY: `f` is a NUL-terminated path; the buffer is a static byte string; the
        // descriptor is closed on every path.
        unsafe {
            let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let n = libc::write(fd, b"0".as_ptr().cast(), 1);
            let err = io::Error::last_os_error();
            libc::close(fd);
            if n != 1 {
                return Err(err);
            }
        }
    }
    Ok(())
}

/// Every cgroup below `dir`, deepest first (the order they can be removed in).
fn descendants(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let child = entry.path();
            out.extend(descendants(&child));
            out.push(child);
        }
    }
    out
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    std::fs::write(path, value).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("writing {value:?} to {}: {e}", path.display()),
        )
    })
}

fn read_pids(path: &Path) -> io::Result<Vec<u32>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// A flat-keyed cgroup file ("key value" lines: cpu.stat, memory.events, memory.oom_control)
/// → the value of `key`.
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next()? == key).then(|| w.next()?.parse().ok())?
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests;
