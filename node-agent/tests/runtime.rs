//! Process-level tests of the workload runtime: real shims (this package's `node-agent`
//! binary), real `sh` commands, real signals. Every wait polls with a deadline, so the tests
//! are as fast as the machine allows and fail with a message instead of hanging.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use node_agent::runtime::{
    ExitKind, GpuShare, INHERITED_ENV, LaunchSpec, RESERVED_ENV, Runtime, RuntimeConfig,
    RuntimeError, RuntimeEvent, StopReason, UsageRecord, check_no_overlap, read_usage_journal,
};

const SHIM: &str = env!("CARGO_BIN_EXE_node-agent");
/// Generous: the test machine may be busy compiling other crates.
const DEADLINE: Duration = Duration::from_secs(20);
const GRACE: Duration = Duration::from_secs(1);

fn config(state_dir: &Path) -> RuntimeConfig {
    RuntimeConfig {
        state_dir: state_dir.to_path_buf(),
        shim_program: PathBuf::from(SHIM),
        shim_args: vec!["shim".to_string()],
        launcher: true,
        stop_grace: GRACE,
        lease_file: None,
        fence_grace: GRACE,
        cgroups: None,
        driver_majors: Default::default(),
        containers: None,
    }
}

/// An allocation running `sh -c script`, with `WORK` pointing at a scratch directory.
fn spec(id: u64, gpus: &[&str], work: &Path, script: &str) -> LaunchSpec {
    LaunchSpec {
        allocation_id: id,
        job_id: 1000 + id,
        job_name: format!("job-{id}"),
        tenant: "tenant-a".to_string(),
        command: vec!["sh".to_string(), "-c".to_string(), script.to_string()],
        env: BTreeMap::from([("WORK".to_string(), work.display().to_string())]),
        gpus: gpus.iter().map(|g| g.to_string()).collect(),
        time_limit: None,
        share: None,
        mig_parents: BTreeMap::new(),
        cpu_milli: 0,
        memory_mib: 0,
        gpu_minors: Vec::new(),
        mig_cap_minors: Vec::new(),
        workdir: None,
        numa_node: None,
        container: None,
        stdout_path: None,
        stderr_path: None,
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls until allocation `id` exits; returns its exit kind and every event seen meanwhile.
fn wait_for_exit(rt: &mut Runtime, id: u64) -> (ExitKind, Vec<RuntimeEvent>) {
    let deadline = Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    loop {
        for event in rt.poll() {
            seen.push(event.clone());
            if let RuntimeEvent::Exited {
                allocation_id,
                kind,
                ..
            } = event
                && allocation_id == id
            {
                return (kind, seen);
            }
        }
        assert!(
            Instant::now() < deadline,
            "allocation {id} did not exit in time; events so far: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls for a while and returns every event: used to prove that nothing more comes.
fn drain_for(rt: &mut Runtime, period: Duration) -> Vec<RuntimeEvent> {
    let end = Instant::now() + period;
    let mut seen = rt.poll();
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
        seen.extend(rt.poll());
    }
    seen
}

fn exits_of(events: &[RuntimeEvent], id: u64) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, RuntimeEvent::Exited { allocation_id, .. } if *allocation_id == id))
        .count()
}

fn started_pid(events: &[RuntimeEvent], id: u64) -> u32 {
    events
        .iter()
        .find_map(|e| match e {
            RuntimeEvent::Started { allocation_id, pid } if *allocation_id == id => Some(*pid),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Started event for {id} in {events:?}"))
}

/// Dead = no such process, or a zombie nobody reaped yet (it runs no code and holds no GPU).
fn process_dead(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
        Err(_) => true,
    }
}

fn read_pid_file(path: &Path) -> u32 {
    let mut pid = None;
    wait_until(&format!("pid file {}", path.display()), || {
        pid = fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok());
        pid.is_some()
    });
    pid.unwrap_or_default()
}

fn env_file(path: &Path) -> BTreeMap<String, String> {
    fs::read_to_string(path)
        .expect("env output")
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn command_sees_exactly_its_gpus_and_identity() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");

    let mut s = spec(
        1,
        &["GPU-aaa", "MIG-bbb"],
        work.path(),
        "env > \"$WORK/env1\"",
    );
    s.env.insert("MODEL".to_string(), "resnet".to_string());
    // A job must not be able to widen its own GPU set.
    s.env
        .insert("CUDA_VISIBLE_DEVICES".to_string(), "GPU-zzz".to_string());
    let spec_keys: BTreeSet<String> = s.env.keys().cloned().collect();
    rt.launch(s).expect("launch");
    assert_eq!(wait_for_exit(&mut rt, 1).0, ExitKind::Exited { code: 0 });

    let env = env_file(&work.path().join("env1"));
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-aaa,MIG-bbb");
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-aaa,MIG-bbb");
    assert_eq!(env["GPUCP_GPUS"], "GPU-aaa,MIG-bbb");
    assert_eq!(env["GPUCP_JOB_ID"], "1001");
    assert_eq!(env["GPUCP_ALLOCATION_ID"], "1");
    assert_eq!(env["GPUCP_JOB_NAME"], "job-1");
    assert_eq!(env["GPUCP_TENANT"], "tenant-a");
    assert_eq!(env["MODEL"], "resnet");
    // Nothing else of the test process's environment (CARGO_*, RUST_*, ...) leaks in;
    // the shell itself may add PWD, SHLVL, OLDPWD and `_`.
    let shell_added = ["PWD", "OLDPWD", "SHLVL", "_"];
    for key in env.keys() {
        assert!(
            INHERITED_ENV.contains(&key.as_str())
                || RESERVED_ENV.contains(&key.as_str())
                || spec_keys.contains(key)
                || shell_added.contains(&key.as_str()),
            "unexpected variable {key} in the command's environment"
        );
    }

    rt.launch(spec(2, &[], work.path(), "env > \"$WORK/env2\""))
        .expect("launch");
    assert_eq!(wait_for_exit(&mut rt, 2).0, ExitKind::Exited { code: 0 });
    let env = env_file(&work.path().join("env2"));
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], "");
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "void");
}

#[test]
fn exit_code_and_logs_are_reported() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(
        7,
        &["GPU-a"],
        work.path(),
        "echo out; echo err >&2; exit 7",
    ))
    .expect("launch");
    let (kind, events) = wait_for_exit(&mut rt, 7);
    assert_eq!(kind, ExitKind::Exited { code: 7 });
    assert!(started_pid(&events, 7) > 1);
    let (stdout, stderr) = rt.log_paths(7);
    assert_eq!(fs::read_to_string(stdout).expect("stdout"), "out\n");
    assert_eq!(fs::read_to_string(stderr).expect("stderr"), "err\n");
    assert!(rt.live().is_empty());
    assert!(rt.gpus_in_use().is_empty());
}

#[test]
fn death_by_signal_is_reported() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(3, &[], work.path(), "kill -USR1 $$"))
        .expect("launch");
    assert_eq!(
        wait_for_exit(&mut rt, 3).0,
        ExitKind::Signaled {
            signal: libc::SIGUSR1
        }
    );
}

#[test]
fn missing_program_exits_127_with_the_reason_in_stderr() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    let mut s = spec(4, &[], work.path(), "");
    s.command = vec!["/nonexistent/trainer".to_string()];
    rt.launch(s).expect("launch");
    assert_eq!(wait_for_exit(&mut rt, 4).0, ExitKind::Exited { code: 127 });
    let stderr = fs::read_to_string(rt.log_paths(4).1).expect("stderr");
    assert!(stderr.contains("/nonexistent/trainer"), "{stderr}");
}

#[test]
fn stop_escalates_to_sigkill_when_sigterm_is_ignored() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(
        5,
        &["GPU-a"],
        work.path(),
        "trap '' TERM; touch \"$WORK/ready\"; sleep 30",
    ))
    .expect("launch");
    // Stop only once the trap is in place; before it, SIGTERM would simply work.
    wait_until("the command to ignore SIGTERM", || {
        work.path().join("ready").exists()
    });
    let pid = rt.pid(5).expect("live");
    let t0 = Instant::now();
    rt.stop(5, StopReason::Requested).expect("stop");
    let (kind, _) = wait_for_exit(&mut rt, 5);
    let elapsed = t0.elapsed();
    assert_eq!(kind, ExitKind::Stopped);
    assert!(
        elapsed >= GRACE.mul_f32(0.9),
        "exited after {elapsed:?}, before the grace: SIGTERM was not ignored?"
    );
    assert!(
        elapsed < GRACE + Duration::from_secs(5),
        "SIGKILL came too late: {elapsed:?}"
    );
    assert!(process_dead(pid));
    assert!(rt.gpus_in_use().is_empty());
}

#[test]
fn a_job_that_traps_sigterm_gets_it_and_can_checkpoint() {
    // Checkpointing jobs catch SIGTERM; the shim must not leave it blocked for them.
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(
        15,
        &["GPU-a"],
        work.path(),
        "trap 'touch \"$WORK/checkpointed\"; exit 0' TERM; touch \"$WORK/ready\"; sleep 30 & wait",
    ))
    .expect("launch");
    wait_until("the command to install its trap", || {
        work.path().join("ready").exists()
    });
    let t0 = Instant::now();
    rt.stop(15, StopReason::Requested).expect("stop");
    let (kind, _) = wait_for_exit(&mut rt, 15);
    assert_eq!(kind, ExitKind::Stopped);
    assert!(
        work.path().join("checkpointed").exists(),
        "the job never saw SIGTERM"
    );
    assert!(
        t0.elapsed() < GRACE,
        "it took the SIGKILL: {:?}",
        t0.elapsed()
    );
}

#[test]
fn stop_kills_the_whole_process_group() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    // The grandchild ignores SIGTERM, so only the group SIGKILL can end it.
    rt.launch(spec(
        6,
        &["GPU-a"],
        work.path(),
        "(trap '' TERM; exec sleep 300) & echo $! > \"$WORK/grandchild\"; wait",
    ))
    .expect("launch");
    let grandchild = read_pid_file(&work.path().join("grandchild"));
    assert!(!process_dead(grandchild));
    let t0 = Instant::now();
    rt.stop(6, StopReason::Fenced).expect("stop");
    assert_eq!(wait_for_exit(&mut rt, 6).0, ExitKind::Stopped);
    wait_until("the grandchild to die", || process_dead(grandchild));
    // The shell died of SIGTERM at once; the grandchild went with the shim's group kill,
    // without waiting for the grace.
    assert!(t0.elapsed() < GRACE + Duration::from_secs(5));
}

#[test]
fn leftover_background_processes_die_when_the_command_exits() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(
        8,
        &["GPU-a"],
        work.path(),
        "sleep 300 & echo $! > \"$WORK/grandchild\"",
    ))
    .expect("launch");
    assert_eq!(wait_for_exit(&mut rt, 8).0, ExitKind::Exited { code: 0 });
    let grandchild = read_pid_file(&work.path().join("grandchild"));
    wait_until("the leftover background process to die", || {
        process_dead(grandchild)
    });
}

#[test]
fn time_limit_is_enforced_and_reported_as_timed_out() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    let mut s = spec(9, &["GPU-a"], work.path(), "sleep 30");
    s.time_limit = Some(Duration::from_millis(800));
    let t0 = Instant::now();
    rt.launch(s).expect("launch");
    assert_eq!(wait_for_exit(&mut rt, 9).0, ExitKind::TimedOut);
    let elapsed = t0.elapsed();
    assert!(elapsed >= Duration::from_millis(700), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(8), "{elapsed:?}");
}

#[test]
fn launch_refuses_busy_gpus_and_second_copies_and_journal_shows_no_overlap() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    let long = "sleep 30";
    rt.launch(spec(10, &["GPU-0", "GPU-1"], work.path(), long))
        .expect("launch 10");

    let err = rt
        .launch(spec(11, &["GPU-2", "GPU-1"], work.path(), long))
        .expect_err("GPU-1 is busy");
    assert!(
        matches!(&err, RuntimeError::GpuBusy { gpu, holder: 10, allocation: 11, .. } if gpu == "GPU-1"),
        "{err}"
    );
    let err = rt
        .launch(spec(10, &["GPU-3"], work.path(), long))
        .expect_err("allocation 10 already runs");
    assert!(matches!(err, RuntimeError::AlreadyKnown(10)), "{err}");

    rt.launch(spec(12, &["GPU-2"], work.path(), long))
        .expect("launch 12");
    assert_eq!(rt.live(), vec![10, 12]);
    assert_eq!(
        rt.gpus_in_use(),
        BTreeMap::from([
            ("GPU-0".to_string(), vec![10]),
            ("GPU-1".to_string(), vec![10]),
            ("GPU-2".to_string(), vec![12]),
        ])
    );

    rt.stop(10, StopReason::Requested).expect("stop");
    assert_eq!(wait_for_exit(&mut rt, 10).0, ExitKind::Stopped);
    // Exited but not forgotten: still refused, so a replayed assignment cannot rerun it.
    assert!(matches!(
        rt.launch(spec(10, &["GPU-0"], work.path(), long)),
        Err(RuntimeError::AlreadyKnown(10))
    ));
    // The GPUs are free again.
    rt.launch(spec(11, &["GPU-1"], work.path(), long))
        .expect("GPU-1 is free now");
    rt.stop(11, StopReason::Requested).expect("stop");
    rt.stop(12, StopReason::Requested).expect("stop");
    wait_for_exit(&mut rt, 11);
    if rt.live().contains(&12) {
        wait_for_exit(&mut rt, 12);
    }
    assert!(rt.live().is_empty());

    let journal = read_usage_journal(&rt.usage_journal_path()).expect("journal");
    let starts = journal
        .iter()
        .filter(|r| matches!(r, UsageRecord::Start { .. }))
        .count();
    assert_eq!(starts, 3, "{journal:?}");
    check_no_overlap(&journal).expect("real history has no overlap");

    // Inject a start of another allocation on GPU-1 while allocation 10 held it.
    let at = journal
        .iter()
        .position(|r| matches!(r, UsageRecord::Start { allocation: 10, .. }))
        .expect("start of 10");
    let mut tampered = journal.clone();
    tampered.insert(
        at + 1,
        UsageRecord::Start {
            allocation: 99,
            job: 99,
            gpus: vec!["GPU-1".to_string()],
            pid: 1,
            at_ms: 0,
            share: None,
            mig_parents: BTreeMap::new(),
        },
    );
    let err = check_no_overlap(&tampered).expect_err("injected overlap");
    assert!(err.contains("GPU-1"), "{err}");
}

/// A share of `milli` of `gpu` (an 80 GB GPU), with memory in proportion.
fn share_spec(id: u64, gpu: &str, milli: u32, work: &Path, script: &str) -> LaunchSpec {
    LaunchSpec {
        share: Some(GpuShare {
            milli,
            memory_mib: 80 * u64::from(milli),
            gpu_memory_mib: 80_000,
        }),
        ..spec(id, &[gpu], work, script)
    }
}

/// An allocation on the MIG slice `slice` of `parent`.
fn slice_spec(id: u64, slice: &str, parent: &str, work: &Path, script: &str) -> LaunchSpec {
    LaunchSpec {
        mig_parents: BTreeMap::from([(slice.to_string(), parent.to_string())]),
        ..spec(id, &[slice], work, script)
    }
}

#[test]
fn shares_run_together_within_one_gpu_and_mig_slices_beside_each_other_but_not_beside_their_gpu() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    let script = "env > \"$WORK/env-$GPUCP_ALLOCATION_ID\"; sleep 30";

    for id in 1..=4 {
        rt.launch(share_spec(id, "GPU-s", 250, work.path(), script))
            .unwrap_or_else(|e| panic!("share {id}: {e}"));
    }
    assert_eq!(rt.live(), vec![1, 2, 3, 4]);
    assert_eq!(rt.gpus_in_use()["GPU-s"], vec![1, 2, 3, 4]);
    assert_eq!(rt.allocations_on("GPU-s"), vec![1, 2, 3, 4]);
    for id in 1..=4 {
        let path = work.path().join(format!("env-{id}"));
        wait_until("the share's environment", || {
            fs::read_to_string(&path).is_ok_and(|t| t.contains("GPUCP_GPU_MILLI"))
        });
        let env = env_file(&path);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-s");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "GPU-s=20000M");
        assert_eq!(env["GPUCP_GPU_MILLI"], "250");
        assert_eq!(env["GPUCP_GPU_MEMORY_MIB"], "20000");
    }

    step_refused(
        &mut rt,
        share_spec(5, "GPU-s", 250, work.path(), script),
        "1000 milli",
    );
    step_refused(&mut rt, spec(6, &["GPU-s"], work.path(), script), "shared");

    rt.stop(2, StopReason::Requested).expect("stop");
    assert_eq!(wait_for_exit(&mut rt, 2).0, ExitKind::Stopped);
    rt.launch(share_spec(5, "GPU-s", 250, work.path(), script))
        .expect("a share ended: the fifth fits now");
    step_refused(
        &mut rt,
        share_spec(7, "GPU-s", 10, work.path(), script),
        "1000 milli",
    );

    // MIG: two slices of one GPU at once, but no slice while the GPU is used whole, and no
    // whole-GPU use while a slice runs.
    rt.launch(slice_spec(10, "MIG-1", "GPU-m", work.path(), script))
        .expect("slice 1");
    rt.launch(slice_spec(11, "MIG-2", "GPU-m", work.path(), script))
        .expect("slice 2");
    assert_eq!(rt.allocations_on("GPU-m"), vec![10, 11]);
    assert_eq!(rt.allocations_on("MIG-2"), vec![11]);
    step_refused(
        &mut rt,
        slice_spec(12, "MIG-1", "GPU-m", work.path(), script),
        "allocation 10",
    );
    step_refused(&mut rt, spec(13, &["GPU-m"], work.path(), script), "MIG");
    step_refused(
        &mut rt,
        share_spec(14, "GPU-m", 100, work.path(), script),
        "MIG",
    );
    rt.launch(spec(15, &["GPU-w"], work.path(), script))
        .expect("whole GPU");
    step_refused(
        &mut rt,
        slice_spec(16, "MIG-3", "GPU-w", work.path(), script),
        "GPU-w",
    );

    for id in rt.live() {
        rt.stop(id, StopReason::Requested).expect("stop");
    }
    while !rt.live().is_empty() {
        let id = rt.live()[0];
        wait_for_exit(&mut rt, id);
    }
    let journal = read_usage_journal(&rt.usage_journal_path()).expect("journal");
    check_no_overlap(&journal).expect("the real history obeys the rule");
    let shares = journal
        .iter()
        .filter(|r| matches!(r, UsageRecord::Start { share: Some(s), .. } if s.milli == 250))
        .count();
    assert_eq!(shares, 5, "{journal:?}");
}

/// `spec` is refused because its GPU is busy, with `word` in the reason; nothing starts.
fn step_refused(rt: &mut Runtime, spec: LaunchSpec, word: &str) {
    let id = spec.allocation_id;
    let live = rt.live();
    match rt.launch(spec) {
        Err(RuntimeError::GpuBusy {
            allocation, reason, ..
        }) => {
            assert_eq!(allocation, id);
            assert!(
                reason.contains(word),
                "allocation {id}: `{reason}` lacks `{word}`"
            );
        }
        other => panic!("allocation {id}: expected GpuBusy, got {other:?}"),
    }
    assert_eq!(rt.live(), live, "a refused launch started something");
}

#[test]
fn restart_readopts_the_running_process_and_reports_its_exit_once() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let script = "echo started >> \"$WORK/marker\"; \
                  while [ ! -e \"$WORK/release\" ]; do sleep 0.05; done; exit 3";
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(20, &["GPU-a"], work.path(), script))
        .expect("launch");
    let pid = started_pid(&rt.poll(), 20);
    let marker = work.path().join("marker");
    wait_until("the command to start", || marker.exists());

    // Agent crash: the runtime goes away without stopping anything.
    drop(rt);
    assert!(!process_dead(pid), "the process must survive the agent");

    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    assert_eq!(rt.live(), vec![20]);
    assert_eq!(rt.pid(20), Some(pid), "re-adopted, not restarted");
    assert_eq!(
        rt.gpus_in_use(),
        BTreeMap::from([("GPU-a".to_string(), vec![20])])
    );
    assert!(matches!(
        rt.launch(spec(20, &["GPU-b"], work.path(), script)),
        Err(RuntimeError::AlreadyKnown(20))
    ));
    assert!(matches!(
        rt.launch(spec(21, &["GPU-a"], work.path(), script)),
        Err(RuntimeError::GpuBusy { holder: 20, .. })
    ));
    assert!(drain_for(&mut rt, Duration::from_millis(200)).is_empty());

    fs::write(work.path().join("release"), "").expect("release");
    let (kind, _) = wait_for_exit(&mut rt, 20);
    assert_eq!(kind, ExitKind::Exited { code: 3 });
    assert_eq!(
        exits_of(&drain_for(&mut rt, Duration::from_millis(300)), 20),
        0
    );
    assert!(rt.forget(20).is_ok());
    assert_eq!(
        fs::read_to_string(&marker).expect("marker"),
        "started\n",
        "the command ran exactly once"
    );

    drop(rt);
    let mut rt = Runtime::open(config(state.path())).expect("third open");
    assert!(drain_for(&mut rt, Duration::from_millis(200)).is_empty());
    assert!(rt.live().is_empty());
    check_no_overlap(&read_usage_journal(&rt.usage_journal_path()).expect("journal"))
        .expect("no overlap");
}

#[test]
fn exit_while_the_agent_is_down_is_reported_on_the_next_open_until_forgotten() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(
        30,
        &["GPU-a"],
        work.path(),
        "while [ ! -e \"$WORK/release\" ]; do sleep 0.05; done; exit 5",
    ))
    .expect("launch");
    let pid = rt.pid(30).expect("live");
    drop(rt);

    fs::write(work.path().join("release"), "").expect("release");
    wait_until("the process to end while no runtime runs", || {
        process_dead(pid)
    });

    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    assert!(rt.live().is_empty());
    let events = drain_for(&mut rt, Duration::from_millis(200));
    assert_eq!(exits_of(&events, 30), 1, "{events:?}");
    assert!(matches!(
        events.as_slice(),
        [RuntimeEvent::Exited {
            allocation_id: 30,
            kind: ExitKind::Exited { code: 5 },
            ..
        }]
    ));

    // Not forgotten (the control plane did not acknowledge): reported again next time.
    drop(rt);
    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    let events = drain_for(&mut rt, Duration::from_millis(100));
    assert_eq!(exits_of(&events, 30), 1, "{events:?}");
    rt.forget(30).expect("forget");
    drop(rt);
    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    assert!(drain_for(&mut rt, Duration::from_millis(100)).is_empty());
}

#[test]
fn a_group_killed_while_the_agent_is_down_is_reported_vanished() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(40, &["GPU-a"], work.path(), "sleep 300"))
        .expect("launch");
    let pid = rt.pid(40).expect("live");
    drop(rt);

    let group = libc::pid_t::try_from(pid).expect("pid fits");
    // SAFETY: signals only the test's own allocation group.
    assert_eq!(unsafe { libc::killpg(group, libc::SIGKILL) }, 0);
    wait_until("the shim to die", || process_dead(pid));

    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    let events = drain_for(&mut rt, Duration::from_millis(100));
    let kinds: Vec<&ExitKind> = events
        .iter()
        .filter_map(|e| match e {
            RuntimeEvent::Exited {
                allocation_id: 40,
                kind,
                ..
            } => Some(kind),
            _ => None,
        })
        .collect();
    assert!(
        matches!(
            kinds.as_slice(),
            [ExitKind::Vanished { .. }] | [ExitKind::Signaled { signal: 9 }]
        ),
        "{events:?}"
    );
    assert!(rt.gpus_in_use().is_empty());
}

#[test]
fn stop_is_idempotent_and_the_exit_is_reported_once() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(50, &[], work.path(), "sleep 30"))
        .expect("launch");
    assert!(matches!(rt.forget(50), Err(RuntimeError::StillRunning(50))));
    rt.stop(50, StopReason::GpuFault).expect("stop");
    rt.stop(50, StopReason::TimeLimit).expect("second stop");
    let (kind, _) = wait_for_exit(&mut rt, 50);
    assert_eq!(kind, ExitKind::Stopped, "the first reason wins");
    rt.stop(50, StopReason::Requested).expect("stop after exit");
    assert_eq!(
        exits_of(&drain_for(&mut rt, Duration::from_millis(300)), 50),
        0
    );
}

#[test]
fn shim_records_the_exit_when_sigterm_hits_the_whole_group() {
    let work = tempfile::tempdir().expect("tempdir");
    let exit_file = work.path().join("exit.json");
    let ready = work.path().join("ready");
    let mut shim = Command::new(SHIM)
        .arg("shim")
        .arg("--exit-file")
        .arg(&exit_file)
        .arg("--stdout")
        .arg(work.path().join("out"))
        .arg("--stderr")
        .arg(work.path().join("err"))
        .arg("--")
        .arg("sh")
        .arg("-c")
        .arg(format!(
            "trap 'exit 9' TERM; touch '{}'; while :; do sleep 0.05; done",
            ready.display()
        ))
        .spawn()
        .expect("spawn shim");
    wait_until("the command to trap SIGTERM", || ready.exists());
    let group = libc::pid_t::try_from(shim.id()).expect("pid fits");
    // SAFETY: the shim leads its own group (setsid); this signals only that group.
    assert_eq!(unsafe { libc::killpg(group, libc::SIGTERM) }, 0);
    let status = shim.wait().expect("wait shim");
    // The shim outlived the SIGTERM, recorded the exit, then killed its group and itself.
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }
    let record: serde_json::Value =
        serde_json::from_slice(&fs::read(&exit_file).expect("exit file")).expect("json");
    assert_eq!(record["status"], "exited");
    assert_eq!(record["code"], 9);
}

#[test]
fn shim_without_arguments_explains_its_usage() {
    let output = Command::new(SHIM).arg("shim").output().expect("run");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("usage"));
}

#[test]
fn the_agent_on_a_host_without_a_driver_names_the_missing_library() {
    // This machine (and CI) has no NVIDIA driver: the NVML backend must say so plainly.
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let output = Command::new(SHIM)
        .args(["--name", "n1", "--insecure", "--state-dir"])
        .arg(dir.path())
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("libnvidia-ml.so.1"), "{stderr}");
    // Without TLS files or --insecure, the agent says what to give first.
    let output = Command::new(SHIM)
        .args(["--name", "n1", "--state-dir"])
        .arg(dir.path())
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--tls-dir") && stderr.contains("gpuctl certs issue node"),
        "{stderr}"
    );
}

/// Names in a directory, sorted; empty if it does not exist.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn records_go_to_one_log_and_exit_files_stay_with_the_logs() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    let ids: Vec<u64> = (100..112).collect();
    for &id in &ids {
        let script = format!("exit {}", id % 7);
        rt.launch(spec(id, &["GPU-a"], work.path(), &script))
            .expect("launch");
        let (kind, _) = wait_for_exit(&mut rt, id);
        assert_eq!(
            kind,
            ExitKind::Exited {
                code: (id % 7) as i32
            }
        );
        rt.forget(id).expect("forget");
    }

    // No per-allocation record files, no temporary files: the state directory holds the
    // same few files however many jobs ran.
    assert_eq!(
        names_in(&state.path().join("allocations")),
        Vec::<String>::new()
    );
    assert_eq!(
        names_in(state.path()),
        ["allocations.log", "gpu-usage.jsonl", "logs", "runtime.lock"]
    );
    // Three puts (launching, pid recorded, exit) and a tombstone per allocation.
    let log = fs::read_to_string(state.path().join("allocations.log")).expect("record log");
    assert_eq!(log.lines().count(), 4 * ids.len());
    for &id in &ids {
        let logs = state.path().join("logs");
        assert_eq!(
            names_in(&logs.join(id.to_string())),
            ["stderr", "stdout"],
            "{id}"
        );
        let exit_file = logs.join(format!("{id}.exit.json"));
        let exit: serde_json::Value =
            serde_json::from_slice(&fs::read(exit_file).expect("exit file")).expect("json");
        assert_eq!(exit["status"], "exited");
        assert_eq!(exit["code"], id % 7);
    }

    // All forgotten: nothing comes back, and opening compacted the log to nothing.
    drop(rt);
    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    assert!(rt.poll().is_empty());
    assert_eq!(
        fs::read_to_string(state.path().join("allocations.log")).expect("record log"),
        ""
    );
}

#[test]
fn an_agent_upgraded_from_per_file_records_readopts_the_running_process() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let script = "echo started >> \"$WORK/marker\"; \
                  while [ ! -e \"$WORK/release\" ]; do sleep 0.05; done; exit 4";
    let mut rt = Runtime::open(config(state.path())).expect("open");
    rt.launch(spec(60, &["GPU-a"], work.path(), script))
        .expect("launch");
    let pid = rt.pid(60).expect("live");
    drop(rt);

    // Turn the state directory into what an agent before the record log left: the record
    // as `allocations/60.json`, no log.
    let log_path = state.path().join("allocations.log");
    let log = fs::read_to_string(&log_path).expect("record log");
    let last = log.lines().last().expect("a line");
    let (_checksum, json) = last.split_once(' ').expect("checksum and json");
    let line: serde_json::Value = serde_json::from_str(json).expect("json");
    let record = &line["put"];
    assert_eq!(record["shim_pid"], pid);
    fs::create_dir(state.path().join("allocations")).expect("mkdir");
    fs::write(
        state.path().join("allocations").join("60.json"),
        serde_json::to_vec_pretty(record).expect("encode"),
    )
    .expect("write");
    fs::remove_file(&log_path).expect("rm");

    let mut rt = Runtime::open(config(state.path())).expect("reopen");
    assert_eq!(rt.live(), vec![60]);
    assert_eq!(rt.pid(60), Some(pid), "re-adopted, not restarted");
    assert_eq!(
        names_in(&state.path().join("allocations")),
        Vec::<String>::new()
    );
    fs::write(work.path().join("release"), "").expect("release");
    let (kind, _) = wait_for_exit(&mut rt, 60);
    assert_eq!(kind, ExitKind::Exited { code: 4 });
    assert_eq!(
        fs::read_to_string(work.path().join("marker")).expect("marker"),
        "started\n",
        "the command ran exactly once"
    );
    drop(rt);
    // The exit is in the log now (not forgotten): reported again after a restart.
    let mut rt = Runtime::open(config(state.path())).expect("third open");
    let events = rt.poll();
    assert_eq!(exits_of(&events, 60), 1, "{events:?}");
}

/// A job script that waits for the file `release` to exist, then exits with `code`.
fn exits_once_released(release: &Path, code: i32) -> String {
    format!(
        "while [ ! -e {} ]; do sleep 0.02; done; exit {code}",
        release.display()
    )
}

/// The parent of process `pid` (field 4 of its stat line).
fn parent_of(pid: u32) -> u32 {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no stat for process {pid}"))
}

/// Whether this process may set a process's command line (CAP_SYS_RESOURCE, which a root
/// agent on a host has and one in a container usually lacks).
fn has_cap_sys_resource() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("CapEff:"))?;
            u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

fn cmdline(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .replace('\0', " ")
}

#[test]
fn shims_are_forked_by_the_launcher_and_exec_d_without_one() {
    for launcher in [true, false] {
        let state = tempfile::tempdir().expect("tempdir");
        let work = tempfile::tempdir().expect("tempdir");
        let mut rt = Runtime::open(RuntimeConfig {
            launcher,
            ..config(state.path())
        })
        .expect("open");
        let release = work.path().join("release");
        let script = exits_once_released(&release, 5);
        rt.launch(spec(1, &["GPU-a"], work.path(), &script))
            .expect("launch");
        let pid = rt.pid(1).expect("a shim pid");
        let parent = parent_of(pid);
        // `ps` tells the shim apart: its command line names its files in the state directory
        // (a forked one's as an exec'd one's, where the agent may set it; else the launcher's,
        // which names the directory too).
        let state_dir = state.path().to_string_lossy().into_owned();
        assert!(cmdline(pid).contains(&state_dir), "{:?}", cmdline(pid));
        if launcher {
            assert_ne!(parent, std::process::id(), "the launcher forks the shim");
            if has_cap_sys_resource() {
                wait_until("the forked shim to show its own arguments", || {
                    cmdline(pid).contains("shim --await-go --exit-file")
                });
            }
            assert!(
                cmdline(parent).contains("shim --launcher"),
                "the shim's parent is {:?}",
                cmdline(parent)
            );
        } else {
            assert_eq!(parent, std::process::id(), "exec'd by the runtime itself");
        }
        fs::write(&release, "").expect("release");
        let (kind, _) = wait_for_exit(&mut rt, 1);
        assert_eq!(kind, ExitKind::Exited { code: 5 }, "launcher: {launcher}");
        assert!(process_dead(pid));
    }
}

#[test]
fn a_dead_launcher_leaves_running_jobs_alone_and_shims_are_exec_d_meanwhile() {
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let mut rt = Runtime::open(config(state.path())).expect("open");
    let release = work.path().join("release");
    let script = exits_once_released(&release, 3);
    rt.launch(spec(1, &["GPU-a"], work.path(), &script))
        .expect("launch");
    let first = rt.pid(1).expect("a shim pid");
    let launcher = parent_of(first);
    assert!(cmdline(launcher).contains("--launcher"));
    // SAFETY: kill(2) of the launcher, a child of this test process.
    unsafe { libc::kill(launcher as i32, libc::SIGKILL) };
    wait_until("the launcher to die", || process_dead(launcher));

    // The next launch notices and execs its shim; the first job runs on, re-parented.
    rt.launch(spec(2, &["GPU-b"], work.path(), "exit 4"))
        .expect("launch without a launcher");
    assert_eq!(parent_of(rt.pid(2).expect("pid")), std::process::id());
    assert_eq!(wait_for_exit(&mut rt, 2).0, ExitKind::Exited { code: 4 });
    assert!(
        !process_dead(first),
        "the first job's shim outlives its launcher"
    );
    fs::write(&release, "").expect("release");
    assert_eq!(wait_for_exit(&mut rt, 1).0, ExitKind::Exited { code: 3 });
}
