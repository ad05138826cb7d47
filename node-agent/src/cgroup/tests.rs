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

#[test]
fn on_cgroup_v2_a_job_is_killed_whole_through_cgroup_kill() {
    if !is_root() {
        return;
    }
    let mounts = mounts::parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    let Some(v2) = mounts.iter().find(|m| m.v2) else {
        eprintln!("no cgroup v2 mount here; not run");
        return;
    };
    let host = Host(
        Cgroups::with_hierarchy(
            Hierarchy::V2 {
                root: v2.mount_point.clone(),
            },
            &parent(),
        )
        .expect("the v2 mount is writable"),
    );
    let (cg, enforced) = host.create("alloc-v2", &Limits::default()).unwrap();
    assert_eq!(enforced.hierarchy, "cgroup v2");
    assert!(
        !enforced.devices,
        "devices on v2 are not enforced yet, and say so"
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
