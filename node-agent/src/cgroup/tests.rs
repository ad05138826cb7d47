//! The cgroup layer against the host's real hierarchy (root is needed to create cgroups; CI
//! and this kind of machine run tests as root). Each test has a parent cgroup of its own.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::devices::{BASIC, DeviceRule, NVIDIA_MAJOR};
use super::mounts::Hierarchy;
use super::*;

fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A parent cgroup unique to this test run and test.
fn parent() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    PathBuf::from(format!(
        "gpucp-test/{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ))
}

/// A test's parent cgroup, removed when the test ends.
struct Host(Cgroups);

impl std::ops::Deref for Host {
    type Target = Cgroups;
    fn deref(&self) -> &Cgroups {
        &self.0
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.0.remove_parent();
    }
}

/// The host's hierarchy, or `None` (with a notice) where tests cannot create cgroups.
fn host() -> Option<Host> {
    if !is_root() {
        eprintln!("cgroup tests need root to create cgroups; not run");
        return None;
    }
    Some(Host(
        Cgroups::detect(&parent()).expect("a usable, writable cgroup hierarchy on this host"),
    ))
}

/// Starts `sh -c script` inside `cg` (joined between fork and exec, as the shim does).
fn spawn_in(cg: &AllocationCgroup, script: &str) -> Child {
    let files = cg.procs_files_c();
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: join_current_process makes only async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || join_current_process(&files));
    }
    cmd.spawn().expect("spawning sh")
}

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => {
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                == Some("Z")
        }
    }
}

fn kill_and_remove(cg: &AllocationCgroup) {
    cg.kill_all().expect("kill_all");
    cg.remove().expect("remove");
}

#[test]
fn a_job_that_setsids_and_forks_is_killed_whole() {
    let Some(host) = host() else { return };
    let (cg, _) = host.create("alloc-1", &Limits::default()).unwrap();
    // A grandchild in a session of its own, another in the background: what escapes a
    // process-group kill.
    let mut child = spawn_in(&cg, "setsid sh -c 'sleep 1000' & sleep 1000 & wait");
    wait_for(
        "three processes in the cgroup",
        Duration::from_secs(10),
        || cg.pids().unwrap().len() >= 3,
    );
    let pids = cg.pids().unwrap();
    let killed = cg.kill_all().unwrap();
    assert!(killed >= 3, "killed {killed} of {pids:?}");
    assert!(cg.pids().unwrap().is_empty());
    child.wait().unwrap();
    wait_for("every process gone", Duration::from_secs(10), || {
        pids.iter().all(|p| gone(*p))
    });
    cg.remove().unwrap();
    assert!(!cg.exists());
}

#[test]
fn a_job_past_its_memory_limit_is_oom_killed_and_counted() {
    let Some(host) = host() else { return };
    let limits = Limits {
        memory_bytes: Some(32 << 20),
        ..Limits::default()
    };
    let (cg, enforced) = host.create("alloc-oom", &limits).unwrap();
    assert!(enforced.memory, "{enforced:?}");
    // dd fills a 256 MiB buffer: far past the 32 MiB limit.
    let out = spawn_in(&cg, "exec dd if=/dev/zero of=/dev/null bs=256M count=1")
        .wait_with_output()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{out:?}");
    let usage = cg.usage();
    assert!(usage.oom_kills >= 1, "{usage:?}");
    assert!(usage.peak_memory_bytes <= 32 << 20, "{usage:?}");
    assert!(usage.peak_memory_bytes > 0, "{usage:?}");
    kill_and_remove(&cg);
}

#[test]
fn a_cpu_quota_caps_a_busy_job() {
    let Some(host) = host() else { return };
    let limits = Limits {
        cpu_milli: Some(500),
        ..Limits::default()
    };
    let (cg, enforced) = host.create("alloc-cpu", &limits).unwrap();
    assert!(enforced.cpu, "{enforced:?}");
    let mut child = spawn_in(&cg, "while :; do :; done & while :; do :; done & wait");
    let start = cg.usage().cpu_ns;
    let t0 = Instant::now();
    // A measurement window, not a synchronisation: the quota is checked over it.
    std::thread::sleep(Duration::from_millis(1000));
    let used = cg.usage().cpu_ns - start;
    let wall = t0.elapsed();
    kill_and_remove(&cg);
    child.wait().unwrap();
    // Two busy loops may use at most half a CPU (plus one period of slack).
    let cap = wall.as_nanos() as u64 / 2 + 100_000_000;
    assert!(
        used <= cap,
        "used {used} ns of CPU in {wall:?} under a 0.5 CPU quota"
    );
    assert!(used > 0);
}

#[test]
fn a_job_opens_only_its_own_gpus_device_node() {
    let Some(host) = host() else { return };
    if !matches!(host.hierarchy(), Hierarchy::V1 { .. }) {
        eprintln!("device confinement on cgroup v2 is not built; not run");
        return;
    }
    // Simulated GPUs: real character devices with NVIDIA's major and no driver behind them,
    // so an allowed open reaches the (absent) driver (ENXIO) and a denied one stops at the
    // cgroup (EPERM).
    let dir = tempfile::tempdir().unwrap();
    for minor in 0..4u32 {
        let path =
            std::ffi::CString::new(format!("{}/nvidia{minor}", dir.path().display())).unwrap();
        // SAFETY: mknod with a valid path; makedev only combines numbers.
        let rc = unsafe {
            libc::mknod(
                path.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(NVIDIA_MAJOR, minor),
            )
        };
        assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
    }
    let mut rules: Vec<DeviceRule> = BASIC.to_vec();
    rules.push(DeviceRule {
        major: NVIDIA_MAJOR,
        minor: Some(1),
    });
    let limits = Limits {
        devices: Some(rules),
        ..Limits::default()
    };
    let (cg, enforced) = host.create("alloc-dev", &limits).unwrap();
    assert!(enforced.devices);
    // Every rule was taken (they are written through one open of `devices.allow`), and
    // nothing else: the list is exactly the rules.
    let list_file = cg
        .procs_files()
        .into_iter()
        .map(|f| f.with_file_name("devices.list"))
        .find(|f| f.exists())
        .expect("a v1 devices directory");
    let listed: std::collections::BTreeSet<String> = std::fs::read_to_string(&list_file)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let expected: std::collections::BTreeSet<String> = limits
        .devices
        .as_ref()
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(listed, expected, "{}", list_file.display());
    let d = dir.path().display();
    let out = spawn_in(
        &cg,
        &format!(
            "for n in 0 1 2 3; do cat {d}/nvidia$n 2>&1 </dev/null; done; echo ok > /dev/null"
        ),
    )
    .wait_with_output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[0].contains("Operation not permitted"), "{text}");
    assert!(
        lines[1].contains("No such device"),
        "its own GPU is allowed: {text}"
    );
    assert!(lines[2].contains("Operation not permitted"), "{text}");
    assert!(lines[3].contains("Operation not permitted"), "{text}");
    assert!(out.status.success(), "/dev/null stays usable: {out:?}");
    kill_and_remove(&cg);
}

#[test]
fn usage_is_read_back_and_a_leftover_cgroup_is_replaced() {
    let Some(host) = host() else { return };
    let (cg, _) = host.create("alloc-use", &Limits::default()).unwrap();
    let out = spawn_in(&cg, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
        .wait_with_output()
        .unwrap();
    assert!(out.status.success());
    let usage = cg.usage();
    assert!(usage.cpu_ns > 0, "{usage:?}");
    assert!(usage.peak_memory_bytes > 0, "{usage:?}");
    assert_eq!(usage.oom_kills, 0);
    // An agent that crashed after creating it creates it again: the old one is emptied.
    let mut stray = spawn_in(&cg, "sleep 1000");
    wait_for("the stray process", Duration::from_secs(10), || {
        !cg.pids().unwrap().is_empty()
    });
    let (again, _) = host.create("alloc-use", &Limits::default()).unwrap();
    assert!(again.pids().unwrap().is_empty());
    stray.wait().unwrap();
    kill_and_remove(&again);
}

/// The host's cgroup v2 mount as a test's parent cgroup (on a hybrid host, the unified
/// mount beside the v1 controllers), or `None` with a notice where there is none.
fn v2_host() -> Option<Host> {
    if !is_root() {
        eprintln!("cgroup tests need root to create cgroups; not run");
        return None;
    }
    let mounts = mounts::parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    let Some(v2) = mounts.iter().find(|m| m.v2) else {
        eprintln!("no cgroup v2 mount here; not run");
        return None;
    };
    Some(Host(
        Cgroups::with_hierarchy(
            Hierarchy::V2 {
                root: v2.mount_point.clone(),
            },
            &parent(),
        )
        .expect("the v2 mount is writable"),
    ))
}

/// Character devices `dir/<name>` with NVIDIA's major and no driver behind them: an open the
/// cgroup allows reaches the absent driver (ENXIO), one it denies stops at EPERM.
fn mknod_nvidia(dir: &std::path::Path, nodes: &[(&str, u32)]) {
    for (name, minor) in nodes {
        let path = std::ffi::CString::new(format!("{}/{name}", dir.display())).unwrap();
        // SAFETY: mknod with a valid path; makedev only combines numbers.
        let rc = unsafe {
            libc::mknod(
                path.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(NVIDIA_MAJOR, *minor),
            )
        };
        assert_eq!(rc, 0, "mknod: {}", std::io::Error::last_os_error());
    }
}

#[test]
fn on_cgroup_v2_a_job_is_killed_whole_through_cgroup_kill() {
    let Some(host) = v2_host() else { return };
    let (cg, enforced) = host.create("alloc-v2", &Limits::default()).unwrap();
    assert_eq!(enforced.hierarchy, "cgroup v2");
    assert!(
        !enforced.devices,
        "no device rules asked for, none attached"
    );
    let mut child = spawn_in(&cg, "setsid sh -c 'sleep 1000' & sleep 1000 & wait");
    wait_for(
        "three processes in the v2 cgroup",
        Duration::from_secs(10),
        || cg.pids().unwrap().len() >= 3,
    );
    let pids = cg.pids().unwrap();
    cg.kill_all().unwrap();
    assert!(cg.pids().unwrap().is_empty());
    child.wait().unwrap();
    wait_for("every process gone", Duration::from_secs(10), || {
        pids.iter().all(|p| gone(*p))
    });
    cg.remove().unwrap();
}

#[test]
fn on_cgroup_v2_a_device_program_lets_a_job_open_only_its_own_gpus_node() {
    let Some(host) = v2_host() else { return };
    if let Err(why) = host.devices_enforced() {
        // Not a skip to pass over quietly: the node would register "devices NOT enforced".
        panic!("this kernel refuses cgroup device programs on its v2 mount: {why}");
    }
    assert!(
        host.capabilities()
            .starts_with("cgroup v2: devices, memory"),
        "{}",
        host.capabilities()
    );
    let dir = tempfile::tempdir().unwrap();
    mknod_nvidia(dir.path(), &[("dev0", 0), ("dev1", 1)]);
    let mut rules: Vec<DeviceRule> = BASIC.to_vec();
    rules.push(DeviceRule {
        major: NVIDIA_MAJOR,
        minor: Some(0),
    });
    let limits = Limits {
        devices: Some(rules),
        ..Limits::default()
    };
    let (cg, enforced) = host.create("alloc-v2-dev", &limits).unwrap();
    assert!(enforced.devices, "{enforced:?}");
    // The shell joins the cgroup between fork and exec (spawn_in), so its opens are the
    // cgroup's. `exec 3<>` opens read-write, as a CUDA process opens /dev/nvidiaN.
    let d = dir.path().display();
    let out = spawn_in(
        &cg,
        &format!(
            "for n in 0 1; do (exec 3<>{d}/dev$n) 2>&1 | sed \"s/^/dev$n: /\"; done; echo ok >/dev/null"
        ),
    )
    .wait_with_output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |n: u32| {
        text.lines()
            .find(|l| l.starts_with(&format!("dev{n}: ")))
            .unwrap_or_else(|| panic!("no error line for dev{n}: {text}"))
    };
    assert!(
        line(0).contains("No such device"),
        "minor 0 is allowed: the open passes the cgroup and finds no driver: {text}"
    );
    assert!(
        line(1).contains("Operation not permitted"),
        "minor 1 is denied by the device program: {text}"
    );
    assert!(out.status.success(), "/dev/null stays usable: {out:?}");

    // The same open from outside the cgroup: not confined (the program is the cgroup's).
    let outside = Command::new("sh")
        .arg("-c")
        .arg(format!("(exec 3<>{d}/dev1) 2>&1"))
        .output()
        .unwrap();
    let outside = String::from_utf8_lossy(&outside.stdout);
    assert!(outside.contains("No such device"), "{outside}");

    // And mknod inside the cgroup: allowed for minor 0, EPERM for minor 1.
    let out = spawn_in(
        &cg,
        &format!(
            "mknod {d}/m0 c {NVIDIA_MAJOR} 0 && echo made0; mknod {d}/m1 c {NVIDIA_MAJOR} 1 2>&1"
        ),
    )
    .wait_with_output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("made0"), "{text}");
    assert!(text.contains("Operation not permitted"), "{text}");
    kill_and_remove(&cg);
}

/// Drops CAP_SYS_ADMIN, CAP_BPF and CAP_PERFMON from the calling thread's effective set
/// (capabilities are per thread: the rest of the test process keeps them).
fn drop_bpf_capabilities_of_this_thread() {
    // linux/capability.h
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a version-3 header and the two data words it takes.
    unsafe {
        assert_eq!(
            libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()),
            0
        );
        data[0].effective &= !(1 << CAP_SYS_ADMIN);
        data[1].effective &= !(1 << (CAP_BPF - 32) | 1 << (CAP_PERFMON - 32));
        assert_eq!(
            libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()),
            0,
            "capset: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[test]
fn on_cgroup_v2_a_host_that_refuses_device_programs_says_so_and_still_runs_jobs() {
    let Some(_) = v2_host() else { return };
    // In a thread of its own: the capabilities dropped are that thread's only.
    std::thread::spawn(|| {
        drop_bpf_capabilities_of_this_thread();
        let host = v2_host().expect("the v2 mount, without CAP_SYS_ADMIN");
        let why = host
            .devices_enforced()
            .expect_err("no CAP_SYS_ADMIN, no device program");
        eprintln!("refused, as it should be: {why}");
        assert!(
            why.contains("loading the cgroup device program") && why.contains("CAP_SYS_ADMIN"),
            "{why}"
        );
        assert_eq!(
            host.capabilities(),
            format!("cgroup v2: memory, cpu, cpuset, kill (devices NOT enforced: {why})")
        );
        let dir = tempfile::tempdir().unwrap();
        mknod_nvidia(dir.path(), &[("dev1", 1)]);
        let limits = Limits {
            devices: Some(BASIC.to_vec()),
            ..Limits::default()
        };
        let (cg, enforced) = host.create("alloc-v2-nobpf", &limits).unwrap();
        assert!(!enforced.devices, "{enforced:?}");
        let out = spawn_in(
            &cg,
            &format!("(exec 3<>{}/dev1) 2>&1", dir.path().display()),
        )
        .wait_with_output()
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("No such device"),
            "unconfined, as said: {text}"
        );
        kill_and_remove(&cg);
    })
    .join()
    .unwrap();
}

/// The cgroup of process `pid` in the v1 hierarchy of `controller` (`/proc/PID/cgroup`).
fn v1_cgroup_of(pid: u32, controller: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()?
        .lines()
        .find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, names, path) = (parts.next()?, parts.next()?, parts.next()?);
            names
                .split(',')
                .any(|n| n == controller)
                .then(|| path.to_owned())
        })
}

#[test]
fn on_v1_a_job_without_a_cpu_quota_or_pinning_joins_the_nodes_cpu_and_cpuset_cgroups() {
    let Some(host) = host() else { return };
    let Hierarchy::V1 { controllers } = host.hierarchy() else {
        eprintln!("a v1 layout; not run on v2");
        return;
    };
    let separate_cpu = controllers.get(&mounts::V1Controller::Cpu)
        != controllers.get(&mounts::V1Controller::Cpuacct);
    let parent =
        format!("/{}", host.relative_path("x").parent().unwrap().display()).replace("//", "/");
    for (name, limits) in [
        ("alloc-plain", Limits::default()),
        (
            "alloc-quota",
            Limits {
                cpu_milli: Some(500),
                ..Limits::default()
            },
        ),
    ] {
        let (cg, _) = host.create(name, &limits).unwrap();
        let mut child = spawn_in(&cg, "sleep 1000");
        let pid = child.id();
        wait_for("the job to join", Duration::from_secs(10), || {
            v1_cgroup_of(pid, "memory").is_some_and(|p| p.ends_with(name))
        });
        let own = format!("{parent}/{name}");
        // Accounted and confined in its own directories, whatever its limits.
        for c in ["memory", "devices", "freezer", "cpuacct"] {
            assert_eq!(v1_cgroup_of(pid, c).as_deref(), Some(own.as_str()), "{c}");
        }
        let cpu = v1_cgroup_of(pid, "cpu").unwrap();
        if limits.cpu_milli.is_some() || !separate_cpu {
            assert_eq!(
                cpu, own,
                "a quota (or cpuacct beside it) needs its own cpu cgroup"
            );
        } else {
            assert_eq!(
                cpu, parent,
                "no quota: the node's cpu cgroup, not the agent's"
            );
        }
        if controllers.contains_key(&mounts::V1Controller::Cpuset) {
            assert_eq!(
                v1_cgroup_of(pid, "cpuset").as_deref(),
                Some(parent.as_str())
            );
        }
        kill_and_remove(&cg);
        child.wait().unwrap();
        assert!(!cg.exists());
    }
}
