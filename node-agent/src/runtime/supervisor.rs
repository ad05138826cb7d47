//! [`Runtime`]: launches allocations under the shim, supervises them by polling, stops them
//! (SIGTERM, then SIGKILL after the grace), enforces time limits, and re-adopts them after an
//! agent restart. Synchronous: the agent calls [`Runtime::poll`] from a periodic tick
//! (e.g. `spawn_blocking` every few hundred milliseconds); no call blocks for long.
//!
//! Exit detection works the same for processes started in this life and re-adopted ones:
//! `/proc/<pid>/stat` (with the start time, against pid reuse) says whether the shim still
//! runs; once it does not, the exit file says how the command ended. Our own children are
//! additionally reaped with `waitpid(WNOHANG)` so they do not stay zombies.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::env::{command_env, validate_spec};
use super::journal::{UsageRecord, append_usage};
use super::launcher::{Launcher, SpawnRequest};
use super::ledger::GpuLedger;
use super::process::{
    Probe, Reap, now_ms, pidfd_open, probe, read_stat, signal_group, try_reap, wait_readable,
};
use super::record::{
    AllocationRecord, Layout, RecordedExit, ShimFate, StopRequest, classify, read_exit_file,
    remove_if_present,
};
use super::record_log::{Durability, RecordLog};
use super::shim::ShimArgs;
use super::types::{
    ExecTarget, ExitKind, LaunchSpec, RuntimeConfig, RuntimeError, RuntimeEvent, StopReason,
};

/// One allocation as the runtime tracks it.
#[derive(Debug)]
struct Entry {
    record: AllocationRecord,
    /// The in-memory record is newer than the record log (an append failed); retried every
    /// poll. The in-memory state keeps driving supervision meanwhile.
    dirty: bool,
    /// When `poll` last looked for the exit file of this running allocation's shim.
    exit_checked_at_ms: u64,
    /// A pidfd of the shim, once `/proc` confirmed it names the recorded process: while it
    /// is not readable the shim runs, which each poll then learns from one `poll(2)` instead
    /// of reading `/proc/PID/stat` (every launch and exit on the host polls every live
    /// allocation). Anything else is decided by `probe`, as without one.
    shim_pidfd: Option<OwnedFd>,
}

/// How often `poll` looks for the exit file of a shim that still runs (one that wrote it
/// and then got stuck instead of ending its group).
const EXIT_FILE_CHECK_MS: u64 = 1000;

/// The workload runtime of one host. One per state directory (enforced with a lock file).
///
/// Dropping it leaves every process running, exactly like an agent crash: the next
/// [`Runtime::open`] on the same state directory re-adopts them.
#[derive(Debug)]
pub struct Runtime {
    config: RuntimeConfig,
    layout: Layout,
    /// Holds the state-directory lock (flock) for the runtime's lifetime.
    _lock: File,
    /// Where every record change goes (`allocations.log`).
    log: RecordLog,
    entries: BTreeMap<u64, Entry>,
    /// Events produced outside `poll` (launch, open), handed out by the next `poll`.
    pending: Vec<RuntimeEvent>,
    /// Forks shims (see `launcher.rs`); `None`: shims are exec'd one by one.
    launcher: Option<Launcher>,
    /// When the launcher last failed: it is started again no sooner than
    /// [`LAUNCHER_RETRY`] later, so a launcher that cannot run costs one attempt a minute.
    launcher_failed_at: Option<std::time::Instant>,
}

/// How long after a launcher failure the runtime tries to start one again.
const LAUNCHER_RETRY: Duration = Duration::from_secs(60);

/// A shim started for a launch, not yet released.
enum StartedShim {
    /// Exec'd by the agent; released through its stdin.
    Direct(Child),
    /// Forked by the launcher; released through it.
    Forked(u32),
}

impl StartedShim {
    fn pid(&self) -> u32 {
        match self {
            StartedShim::Direct(child) => child.id(),
            StartedShim::Forked(pid) => *pid,
        }
    }
}

impl Runtime {
    /// Opens the state directory (creating it if needed), loads the persisted records, and
    /// settles each one: an exit already recorded is reported again by the next `poll` (it
    /// was not forgotten, so the control plane may not have it); a process that ended while
    /// the agent was down is classified now (from its exit file, else `Vanished`); a process
    /// still running is re-adopted, never started again.
    pub fn open(config: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        let layout = Layout::new(config.state_dir.clone());
        layout.create_dirs()?;
        let lock = lock_state_dir(&layout)?;
        // Create the journal so that readers find it even before the first launch.
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(layout.journal())
            .map_err(|source| RuntimeError::Io {
                action: "create GPU usage journal",
                path: layout.journal(),
                source,
            })?;
        let (log, records) = RecordLog::open(&layout)?;
        let mut runtime = Runtime {
            config,
            layout,
            _lock: lock,
            log,
            entries: BTreeMap::new(),
            pending: Vec::new(),
            launcher: None,
            launcher_failed_at: None,
        };
        runtime.ensure_launcher();
        let now = now_ms();
        for record in records {
            let id = record.id();
            if let Some(exit) = &record.exit {
                runtime.pending.push(RuntimeEvent::Exited {
                    allocation_id: id,
                    kind: exit.kind.clone(),
                    at_ms: exit.at_ms,
                    usage: exit.usage,
                    failure: record.stop.as_ref().and_then(|s| s.failure.clone()),
                });
            }
            let launching = record.is_live() && record.shim_pid.is_none();
            let resend_term =
                record.is_live() && record.stop.is_some() && record.kill_sent_at_ms.is_none();
            runtime.entries.insert(
                id,
                Entry {
                    record,
                    dirty: false,
                    exit_checked_at_ms: 0,
                    shim_pidfd: None,
                },
            );
            if launching {
                runtime.finish(id, None, ShimFate::NeverReleased, now);
            } else if resend_term {
                // The previous life may have crashed between recording the stop and sending
                // SIGTERM; a second SIGTERM is harmless. The grace still counts from the
                // recorded time.
                if let Err(e) = runtime.signal(id, libc::SIGTERM) {
                    tracing::warn!(allocation = id, error = %e, "cannot re-send SIGTERM; SIGKILL follows after the grace");
                }
            }
        }
        runtime.supervise(now);
        Ok(runtime)
    }

    /// Starts an allocation's command under a new shim. Refuses an allocation id the runtime
    /// already knows (running, or exited and not forgotten) and GPUs the live allocations do
    /// not leave free for it ([`Runtime::check_gpus_free`]): whatever the control plane
    /// believes, this host never runs two copies of an allocation, two allocations on one GPU
    /// (beyond shares that fit together), or a MIG slice beside a whole-GPU use of its parent.
    ///
    /// Order of effects, so that a crash at any point leaves no untracked process: write the
    /// launch record; spawn the shim, which waits; record its pid and start time; journal the
    /// start; release the shim with the go byte.
    pub fn launch(&mut self, spec: LaunchSpec) -> Result<(), RuntimeError> {
        validate_spec(&spec)?;
        let id = spec.allocation_id;
        if self.entries.contains_key(&id) || self.log.contains(id) {
            return Err(RuntimeError::AlreadyKnown(id));
        }
        self.check_gpus_free(&spec)?;
        // A container this host cannot run is refused before anything is written.
        self.check_container(&spec)?;
        self.ensure_launcher();

        let log_dir = self.layout.log_dir(id);
        fs::create_dir_all(&log_dir).map_err(|source| RuntimeError::Io {
            action: "create log directory",
            path: log_dir.clone(),
            source,
        })?;
        let (stdout_log, stderr_log) = self.log_paths(id);
        // Output files the job named: the logs become links to them, so `gpuctl logs` reads
        // them too. One that cannot be created fails the launch, as sbatch fails the job.
        for (wanted, log) in [
            (&spec.stdout_path, &stdout_log),
            (&spec.stderr_path, &stderr_log),
        ] {
            if let Some(file) = wanted {
                link_output_file(file, log).map_err(|message| RuntimeError::InvalidSpec {
                    allocation: id,
                    message,
                })?;
            }
        }
        // The shim's own diagnostics (cannot start the command, ...) go to the job's stderr
        // log, where the job's owner looks first.
        let shim_stderr = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stderr_log)
            .map_err(|source| RuntimeError::Io {
                action: "open log file",
                path: stderr_log.clone(),
                source,
            })?;

        // An exit file left by an earlier allocation with this id (forgotten, then the id
        // came again) would pass for this one's.
        remove_if_present(&self.layout.exit_file(id))?;
        remove_if_present(&self.layout.legacy_exit_file(id))?;

        let mut record = AllocationRecord::launching(spec, now_ms());
        // The allocation's cgroup enforces them, or a container carries them itself.
        let limits = cgroup_limits(&record.spec, self.config.driver_majors);
        if let Some(cgroups) = &self.config.cgroups {
            let (cg, enforced) = cgroups
                .create(&cgroup_name(id), &limits)
                .map_err(|source| RuntimeError::Cgroup {
                    allocation: id,
                    source,
                })?;
            tracing::debug!(allocation = id, enforced = %enforced.describe(), "cgroup created");
            record.cgroup = Some(cg);
        }
        // Durable with the next record (the shim's pid), which is synced before the command
        // may start; until then no process of this allocation can run.
        if let Err(e) = self.log.put_with(&record, Durability::WithNextSync) {
            self.remove_cgroup(&record);
            return Err(e);
        }

        let command = match self.container_command(&record, limits) {
            Ok(command) => command,
            Err(e) => {
                self.remove_cgroup(&record);
                let _ = self.log.forget(id);
                return Err(e);
            }
        };
        let shim_args = ShimArgs {
            await_go: true,
            exit_file: self.layout.exit_file(id),
            stdout: stdout_log,
            stderr: stderr_log,
            command,
            lease_file: self.config.lease_file.clone(),
            fence_grace: self.config.fence_grace,
            cgroup: record.cgroup.clone(),
        };
        let env = command_env(&record.spec, |key| std::env::var(key).ok());
        let workdir = match &record.spec.workdir {
            // A container's directory is inside it; its runner works in the scratch one.
            _ if record.spec.container.is_some() => log_dir.clone(),
            Some(dir) if dir.is_dir() => dir.clone(),
            Some(dir) => {
                // Slurm's habit: run anyway, where the job can write, and say so.
                let _ = writeln!(
                    &shim_stderr,
                    "gpucp: working directory {} does not exist on this host; the job runs in {} instead",
                    dir.display(),
                    log_dir.display()
                );
                log_dir.clone()
            }
            None => log_dir.clone(),
        };
        let started = match self.launcher.as_mut() {
            Some(launcher) => {
                let request = SpawnRequest {
                    args: shim_args.to_args(),
                    env: env.clone().into_iter().collect(),
                    workdir: workdir.clone(),
                };
                match launcher.spawn(request) {
                    Ok(pid) => Ok(StartedShim::Forked(pid)),
                    Err(e) => {
                        self.launcher_failed(&e);
                        self.exec_shim(&shim_args, &env, &workdir, shim_stderr)
                    }
                }
            }
            None => self.exec_shim(&shim_args, &env, &workdir, shim_stderr),
        };
        let shim = match started {
            Ok(shim) => shim,
            Err(source) => {
                self.remove_cgroup(&record);
                if let Err(e) = self.log.forget(id) {
                    tracing::error!(allocation = id, error = %e, "cannot forget the record of a launch whose shim did not start; the next start reports it as vanished");
                }
                return Err(RuntimeError::Spawn {
                    allocation: id,
                    program: self.config.shim_program.clone(),
                    source,
                });
            }
        };
        let pid = shim.pid();

        let program = self.config.shim_program.clone();
        let spawn_error = |source| RuntimeError::Spawn {
            allocation: id,
            program: program.clone(),
            source,
        };
        let started = (|| {
            let stat = read_stat(pid).map_err(spawn_error)?.ok_or_else(|| {
                spawn_error(io::Error::other("the shim exited right after starting"))
            })?;
            record.shim_pid = Some(pid);
            record.shim_start_ticks = Some(stat.start_ticks);
            record.started_at_ms = now_ms();
            self.log.put(&record)?;
            append_usage(
                &self.layout.journal(),
                &UsageRecord::Start {
                    allocation: id,
                    job: record.spec.job_id,
                    gpus: record.spec.gpus.clone(),
                    pid,
                    at_ms: record.started_at_ms,
                    share: record.spec.share,
                    mig_parents: record.spec.mig_parents.clone(),
                },
            )?;
            self.release(&shim).map_err(|e| {
                // Journal the stop too, so the history shows the GPUs free again.
                let _ = append_usage(
                    &self.layout.journal(),
                    &UsageRecord::Stop {
                        allocation: id,
                        gpus: record.spec.gpus.clone(),
                        at_ms: now_ms(),
                        exited_at_ms: None,
                    },
                );
                spawn_error(e)
            })
        })();
        if let Err(e) = started {
            self.abort_launch(id, shim);
            return Err(e);
        }
        // Dropping an exec'd shim's `Child` neither kills nor waits; `poll` reaps it with
        // waitpid (a forked one, the launcher reaps).
        drop(shim);
        self.entries.insert(
            id,
            Entry {
                record,
                dirty: false,
                // Just started: nothing to look for yet.
                exit_checked_at_ms: now_ms(),
                shim_pidfd: None,
            },
        );
        self.pending.push(RuntimeEvent::Started {
            allocation_id: id,
            pid,
        });
        Ok(())
    }

    /// Stops an allocation: SIGTERM to its process group now, SIGKILL once `stop_grace` has
    /// passed (sent by `poll`). Idempotent: stopping an allocation that is already stopping
    /// or has exited does nothing (the first reason is kept). The exit is then reported as
    /// `Stopped` (`TimedOut` for [`StopReason::TimeLimit`]) by `poll`.
    pub fn stop(&mut self, allocation_id: u64, reason: StopReason) -> Result<(), RuntimeError> {
        let entry = self
            .entries
            .get(&allocation_id)
            .ok_or(RuntimeError::Unknown(allocation_id))?;
        if !entry.record.is_live() || entry.record.stop.is_some() {
            return Ok(());
        }
        self.begin_stop(allocation_id, reason, now_ms())
    }

    /// Stops an allocation because it failed a check the agent runs (its liveness probe):
    /// as [`Runtime::stop`] with [`StopReason::Requested`] (SIGTERM, SIGKILL after the stop
    /// grace, the cgroup or container emptied), and `failure` is kept with the stop request,
    /// so its exit event carries it ([`RuntimeEvent::Exited::failure`]), also when a
    /// restarted agent finds the exit. Does nothing to an allocation already stopping.
    pub fn stop_failed(&mut self, allocation_id: u64, failure: String) -> Result<(), RuntimeError> {
        let entry = self
            .entries
            .get(&allocation_id)
            .ok_or(RuntimeError::Unknown(allocation_id))?;
        if !entry.record.is_live() || entry.record.stop.is_some() {
            return Ok(());
        }
        self.begin_stop_with(
            allocation_id,
            StopReason::Requested,
            Some(failure),
            now_ms(),
        )
    }

    /// Whether live allocation `allocation_id` is being stopped (by this runtime's life or,
    /// re-adopted, by an earlier one).
    pub fn is_stopping(&self, allocation_id: u64) -> bool {
        self.entries
            .get(&allocation_id)
            .is_some_and(|e| e.record.is_live() && e.record.stop.is_some())
    }

    /// When a live allocation's command was released to run (ms since the Unix epoch): what
    /// its probes' initial delay counts from, also for one re-adopted after a restart.
    pub fn started_at_ms(&self, allocation_id: u64) -> Option<u64> {
        self.entries
            .get(&allocation_id)
            .filter(|e| e.record.is_live() && e.record.shim_pid.is_some())
            .map(|e| e.record.started_at_ms)
    }

    /// Where a command runs beside live allocation `allocation_id` (its exec probe): in its
    /// container, or on the host with the allocation's environment, working directory and
    /// cgroup. `None` for an allocation that is not live.
    pub fn exec_target(&self, allocation_id: u64) -> Option<ExecTarget> {
        let entry = self.entries.get(&allocation_id)?;
        let record = &entry.record;
        if !record.is_live() {
            return None;
        }
        let spec = &record.spec;
        if spec.container.is_some() {
            let engine = self.config.containers.as_ref()?;
            return Some(ExecTarget::Container {
                socket: engine.socket.clone(),
                name: super::container::container_name(&self.config.state_dir, allocation_id),
            });
        }
        let log_dir = self.layout.log_dir(allocation_id);
        // The rule the launch applied: the job's directory where the host has it.
        let workdir = match &spec.workdir {
            Some(dir) if dir.is_dir() => dir.clone(),
            _ => log_dir,
        };
        Some(ExecTarget::Host {
            env: command_env(spec, |key| std::env::var(key).ok()),
            workdir,
            cgroup_procs: record
                .cgroup
                .as_ref()
                .map(|cg| cg.procs_files())
                .unwrap_or_default(),
        })
    }

    /// Reaps exits, escalates stops whose grace has passed, enforces time limits, and
    /// returns the events since the last call (launches, exits, and exits found by `open`).
    pub fn poll(&mut self) -> Vec<RuntimeEvent> {
        self.retry_dirty();
        self.supervise(now_ms());
        std::mem::take(&mut self.pending)
    }

    /// Allocations whose processes run (or are being stopped), in id order.
    pub fn live(&self) -> Vec<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| e.record.is_live())
            .map(|(id, _)| *id)
            .collect()
    }

    /// GPU (or MIG slice) UUID → the live allocations using it on this host, in id order:
    /// one for a whole GPU or a slice, one or more for a shared GPU.
    pub fn gpus_in_use(&self) -> BTreeMap<String, Vec<u64>> {
        let mut in_use: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (id, entry) in &self.entries {
            if entry.record.is_live() {
                for gpu in &entry.record.spec.gpus {
                    in_use.entry(gpu.clone()).or_default().push(*id);
                }
            }
        }
        in_use
    }

    /// The live allocations a fault of GPU `uuid` hits: those using it whole, its shares,
    /// and those on any of its MIG slices (or, for a slice UUID, the one holding it). In id
    /// order.
    pub fn allocations_on(&self, uuid: &str) -> Vec<u64> {
        let (ledger, stray) = self.ledger();
        let mut users = ledger.users_of(uuid);
        users.extend(
            stray
                .iter()
                .filter(|(_, devices)| devices.contains(uuid))
                .map(|(id, _)| *id),
        );
        users.sort_unstable();
        users.dedup();
        users
    }

    /// Whether `spec`'s GPUs are free for it now, given the live allocations: `Err(GpuBusy)`
    /// names one allocation in the way and why (`Err(InvalidSpec)` if the spec cannot be
    /// launched at all). The rule is the usage journal's (see `ledger.rs`); the agent also
    /// uses this to defer a launch until a stopping allocation has released its GPU.
    pub fn check_gpus_free(&self, spec: &LaunchSpec) -> Result<(), RuntimeError> {
        validate_spec(spec)?;
        let (mut ledger, stray) = self.ledger();
        let busy = |gpu: &str, holder: u64, reason: String| RuntimeError::GpuBusy {
            gpu: gpu.to_string(),
            holder,
            allocation: spec.allocation_id,
            reason,
        };
        for (id, devices) in &stray {
            if let Some(gpu) = devices_of(spec).into_iter().find(|d| devices.contains(d)) {
                return Err(busy(
                    &gpu,
                    *id,
                    "that allocation's record overlaps another live one; nothing starts on \
                     its GPUs until it ends"
                        .to_string(),
                ));
            }
        }
        ledger
            .claim(
                spec.allocation_id,
                now_ms(),
                &spec.gpus,
                spec.share.as_ref(),
                &spec.mig_parents,
            )
            .map_err(|c| {
                busy(
                    &c.gpu,
                    c.holders.first().copied().unwrap_or(spec.allocation_id),
                    c.reason,
                )
            })
    }

    /// The GPU uses of every live allocation, and the allocations whose uses the ledger
    /// refused, with every device they name. Live allocations were admitted one by one
    /// through the same rule, so the second list is empty unless records on disk were edited
    /// or written under another rule; its allocations still block their devices.
    fn ledger(&self) -> (GpuLedger, Vec<(u64, BTreeSet<String>)>) {
        let mut ledger = GpuLedger::default();
        let mut stray = Vec::new();
        for (id, entry) in &self.entries {
            let record = &entry.record;
            if !record.is_live() {
                continue;
            }
            let spec = &record.spec;
            if let Err(c) = ledger.claim(
                *id,
                record.started_at_ms,
                &spec.gpus,
                spec.share.as_ref(),
                &spec.mig_parents,
            ) {
                tracing::error!(allocation = id, gpu = %c.gpu, reason = %c.reason, "live allocations overlap on a GPU");
                stray.push((*id, devices_of(spec)));
            }
        }
        (ledger, stray)
    }

    /// The shim's pid (= process group id) of a live allocation. Addition to the brief: lets
    /// the agent report it and tests check that a re-adopted process is the same one.
    pub fn pid(&self, allocation_id: u64) -> Option<u32> {
        self.entries
            .get(&allocation_id)
            .filter(|e| e.record.is_live())
            .and_then(|e| e.record.shim_pid)
    }

    /// Forgets an exited allocation's record (a tombstone in the record log) once the control
    /// plane has acknowledged its exit report, so the exit is not reported again after a
    /// restart. Idempotent for unknown (already forgotten) ids; refuses a live allocation.
    /// Logs and the exit file next to them are kept.
    pub fn forget(&mut self, allocation_id: u64) -> Result<(), RuntimeError> {
        let Some(entry) = self.entries.get(&allocation_id) else {
            return Ok(());
        };
        if entry.record.is_live() {
            return Err(RuntimeError::StillRunning(allocation_id));
        }
        // The exit file of a shim started by an agent before the record log sits among the
        // old records; it goes as it did then, before the record (if we crash in between, the
        // record, which has the exit, remains and the exit is reported again: the safe
        // direction).
        remove_if_present(&self.layout.legacy_exit_file(allocation_id))?;
        // Lost in a power failure, the record comes back and its exit is reported again,
        // which the control plane ignores: no sync of its own.
        self.log
            .forget_with(allocation_id, Durability::WithNextSync)?;
        self.entries.remove(&allocation_id);
        self.pending.retain(|event| match event {
            RuntimeEvent::Started {
                allocation_id: a, ..
            }
            | RuntimeEvent::Exited {
                allocation_id: a, ..
            } => *a != allocation_id,
        });
        Ok(())
    }

    /// `(stdout, stderr)` log files of an allocation: `state_dir/logs/<id>/{stdout,stderr}`.
    pub fn log_paths(&self, allocation_id: u64) -> (PathBuf, PathBuf) {
        (
            self.layout.stdout_log(allocation_id),
            self.layout.stderr_log(allocation_id),
        )
    }

    /// The GPU usage journal of this state directory (see `journal.rs`).
    pub fn usage_journal_path(&self) -> PathBuf {
        self.layout.journal()
    }

    /// The processes of each live allocation that has a cgroup (its own and its children's:
    /// a container's), for per-job GPU accounting.
    pub fn allocation_processes(&self) -> BTreeMap<u64, BTreeSet<u32>> {
        self.entries
            .iter()
            .filter(|(_, e)| e.record.exit.is_none())
            .filter_map(|(id, e)| {
                let pids = e.record.cgroup.as_ref()?.pids().ok()?;
                Some((*id, pids.into_iter().collect()))
            })
            .collect()
    }

    /// Refuses a container job this host cannot run: no engine, or a mount outside what
    /// the node allows.
    fn check_container(&self, spec: &LaunchSpec) -> Result<(), RuntimeError> {
        let Some(container) = &spec.container else {
            return Ok(());
        };
        let refuse = |message: String| RuntimeError::Container {
            allocation: spec.allocation_id,
            message,
        };
        let Some(engine) = &self.config.containers else {
            return Err(refuse(
                "this node has no container engine (its agent found none at start-up)".into(),
            ));
        };
        super::container::check_mounts(&container.mounts, &engine.mount_prefixes).map_err(refuse)
    }

    /// What the shim runs for `record`: the job's command, or for a container job the
    /// container runner with the container's whole description.
    fn container_command(
        &self,
        record: &AllocationRecord,
        limits: crate::cgroup::Limits,
    ) -> Result<Vec<String>, RuntimeError> {
        let spec = &record.spec;
        let (Some(container), Some(engine)) = (&spec.container, &self.config.containers) else {
            return Ok(spec.command.clone());
        };
        let mut env = command_env(spec, |_| None);
        if !spec.env.contains_key("PATH") {
            // The image's own PATH, not the host's default.
            env.remove("PATH");
        }
        if env.contains_key("GPUCP_DEVICE_DIR") {
            env.insert("GPUCP_DEVICE_DIR".into(), "/dev".into());
        }
        let mut mounts = container.mounts.clone();
        // Shares of a GPU reach its MPS daemon through the pipe directory.
        if let Some(pipes) = env.get("CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from)
            && pipes.is_dir()
        {
            mounts.push(super::container::Mount {
                source: pipes.clone(),
                target: pipes,
                read_only: false,
            });
        }
        // With the engine's cgroupfs driver on v1, the container's cgroup sits under the
        // allocation's, which then limits, measures and kills it; otherwise the container
        // carries the limits itself.
        let cgroup_parent = self
            .config
            .cgroups
            .as_ref()
            .filter(|cg| engine.cgroupfs_driver && !cg.is_v2() && record.cgroup.is_some())
            .map(|cg| cg.relative_path(&cgroup_name(spec.allocation_id)));
        let own = |v: Option<u64>| v.filter(|_| cgroup_parent.is_none());
        let runner = super::container::RunnerSpec {
            name: super::container::container_name(&self.config.state_dir, spec.allocation_id),
            socket: engine.socket.clone(),
            image: container.image.clone(),
            pull: engine.pull,
            command: spec.command.clone(),
            env: env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            workdir: spec.workdir.as_ref().map(|d| d.display().to_string()),
            devices: super::container::container_devices(
                &engine.device_dir,
                &spec.gpu_minors,
                &spec.mig_cap_minors,
                |p| p.exists(),
            ),
            mounts,
            memory_bytes: own(limits.memory_bytes),
            nano_cpus: own(limits.cpu_milli.map(|m| m * 1_000_000)),
            cpuset_cpus: limits.cpus.filter(|_| cgroup_parent.is_none()),
            cpuset_mems: limits.mems.filter(|_| cgroup_parent.is_none()),
            cgroup_parent: cgroup_parent.map(|p| p.display().to_string()),
            shm_bytes: super::container::shm_bytes(spec.memory_mib),
            labels: [
                ("gpucp.job".to_string(), spec.job_id.to_string()),
                (
                    "gpucp.allocation".to_string(),
                    spec.allocation_id.to_string(),
                ),
                ("gpucp.tenant".to_string(), spec.tenant.clone()),
                // Which agent owns it, where several share one engine.
                (
                    "gpucp.state-dir".to_string(),
                    self.config.state_dir.display().to_string(),
                ),
            ]
            .into(),
            oom_marker: Some(self.layout.container_oom_marker(spec.allocation_id)),
        };
        let json = serde_json::to_string(&runner).map_err(|e| RuntimeError::Container {
            allocation: spec.allocation_id,
            message: format!("cannot encode the container spec: {e}"),
        })?;
        let mut command = vec![engine.runner_program.display().to_string()];
        command.extend(engine.runner_args.iter().cloned());
        command.extend([
            super::container::RUNNER_SUBCOMMAND.to_string(),
            "--spec".into(),
            json,
        ]);
        Ok(command)
    }

    /// Removes the container of a container job (what a killed runner left); a no-op for
    /// process jobs and for containers already removed.
    fn remove_container(&self, spec: &LaunchSpec) {
        let (Some(_), Some(engine)) = (&spec.container, &self.config.containers) else {
            return;
        };
        super::container_runner::remove_blocking(
            engine.socket.clone(),
            super::container::container_name(&self.config.state_dir, spec.allocation_id),
        );
    }

    /// Undoes a launch whose shim was spawned but not released: the command never ran, so
    /// killing the shim (alone in its new group) and forgetting the record leaves no trace.
    fn abort_launch(&mut self, id: u64, shim: StartedShim) {
        match shim {
            StartedShim::Direct(mut child) => {
                drop(child.stdin.take()); // EOF: the shim exits by itself even if kill fails.
                let _ = child.kill();
                let _ = child.wait();
            }
            StartedShim::Forked(pid) => {
                // The launcher kills it and reaps it; if the launcher is gone, so is the
                // shim's go pipe, and the shim exits by itself.
                if let Some(launcher) = self.launcher.as_mut()
                    && let Err(e) = launcher.abort(pid)
                {
                    self.launcher_failed(&e);
                }
            }
        }
        if let Some(entry_record) = self.log_record(id) {
            self.remove_cgroup(&entry_record);
        }
        if let Err(e) = self.log.forget(id) {
            tracing::error!(allocation = id, error = %e, "cannot remove record of an aborted launch; the next start reports it as vanished");
        }
    }

    /// Starts the launcher if the configuration wants one and none runs (not more than once
    /// per [`LAUNCHER_RETRY`] after a failure).
    fn ensure_launcher(&mut self) {
        if !self.config.launcher
            || self.launcher.is_some()
            || self
                .launcher_failed_at
                .is_some_and(|t| t.elapsed() < LAUNCHER_RETRY)
        {
            return;
        }
        match Launcher::start(
            &self.config.shim_program,
            &self.config.shim_args,
            &self.config.state_dir,
        ) {
            Ok(launcher) => {
                tracing::info!(program = %self.config.shim_program.display(), "shim launcher started: shims are forked, not exec'd");
                self.launcher = Some(launcher);
            }
            Err(e) => self.launcher_failed(&e),
        }
    }

    /// Drops a launcher that failed (it is killed); shims are exec'd until it is restarted.
    fn launcher_failed(&mut self, error: &io::Error) {
        tracing::warn!(%error, "shim launcher failed; exec'ing each shim instead (retried in a minute)");
        self.launcher = None;
        self.launcher_failed_at = Some(std::time::Instant::now());
    }

    /// Execs the shim program for one launch (no launcher).
    fn exec_shim(
        &self,
        shim_args: &ShimArgs,
        env: &BTreeMap<String, String>,
        workdir: &std::path::Path,
        shim_stderr: File,
    ) -> io::Result<StartedShim> {
        let mut command = Command::new(&self.config.shim_program);
        command
            .args(&self.config.shim_args)
            .args(shim_args.to_args())
            .env_clear()
            .envs(env)
            // The job's directory, or a writable per-allocation one for scratch files.
            .current_dir(workdir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(shim_stderr)
            // The shim leads its own process group from its first instruction, so `stop` can
            // signal the group even if it comes before the shim has run at all. Set by
            // posix_spawn, not by a closure between fork and exec: with no closure, std
            // starts the shim with vfork semantics instead of copying the agent's address
            // space (page tables of a multi-threaded process) for every launch.
            .process_group(0);
        command.spawn().map(StartedShim::Direct)
    }

    /// Sends the go byte: the shim starts the command.
    fn release(&mut self, shim: &StartedShim) -> io::Result<()> {
        match shim {
            StartedShim::Direct(child) => {
                let mut go = child
                    .stdin
                    .as_ref()
                    .ok_or_else(|| io::Error::other("no pipe to the shim"))?;
                // A shim that died already makes this fail with EPIPE rather than raising
                // SIGPIPE, because Rust programs (the agent, the test harness) ignore SIGPIPE.
                go.write_all(b"G")
            }
            StartedShim::Forked(pid) => {
                let launcher = self
                    .launcher
                    .as_mut()
                    .ok_or_else(|| io::Error::other("the shim launcher is gone"))?;
                launcher.go(*pid)
            }
        }
    }

    fn begin_stop(&mut self, id: u64, reason: StopReason, now: u64) -> Result<(), RuntimeError> {
        self.begin_stop_with(id, reason, None, now)
    }

    fn begin_stop_with(
        &mut self,
        id: u64,
        reason: StopReason,
        failure: Option<String>,
        now: u64,
    ) -> Result<(), RuntimeError> {
        let Some(entry) = self.entries.get_mut(&id) else {
            return Err(RuntimeError::Unknown(id));
        };
        entry.record.stop = Some(StopRequest {
            reason,
            term_sent_at_ms: now,
            failure,
        });
        tracing::info!(allocation = id, ?reason, "stopping allocation");
        // Persist before signalling: a restarted agent must know the exit was ours.
        self.persist(id);
        self.signal(id, libc::SIGTERM)
            .map_err(|source| RuntimeError::Signal {
                allocation: id,
                signal: libc::SIGTERM,
                source,
            })
    }

    /// Signals an allocation's process group, after checking the shim's pid still names our
    /// shim (or its zombie, or the group it left behind): never an unrelated process.
    fn signal(&self, id: u64, signal: i32) -> io::Result<()> {
        let Some(entry) = self.entries.get(&id) else {
            return Ok(());
        };
        let (Some(pid), Some(ticks)) = (entry.record.shim_pid, entry.record.shim_start_ticks)
        else {
            return Ok(());
        };
        match probe(pid, ticks) {
            Probe::Reused => Ok(()),
            Probe::Running | Probe::Zombie | Probe::Gone => signal_group(pid, signal).map(|_| ()),
        }
    }

    fn persist(&mut self, id: u64) {
        self.persist_with(id, Durability::Synced);
    }

    fn persist_with(&mut self, id: u64, durability: Durability) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        match self.log.put_with(&entry.record, durability) {
            Ok(()) => entry.dirty = false,
            Err(e) => {
                tracing::error!(allocation = id, error = %e, "cannot persist allocation state; will retry");
                entry.dirty = true;
            }
        }
    }

    fn retry_dirty(&mut self) {
        let dirty: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.dirty)
            .map(|(id, _)| *id)
            .collect();
        for id in dirty {
            self.persist(id);
        }
    }

    /// One supervision pass over every live allocation.
    fn supervise(&mut self, now: u64) {
        let live = self.live();
        for id in live {
            self.supervise_one(id, now);
        }
    }

    fn supervise_one(&mut self, id: u64, now: u64) {
        let Some(entry) = self.entries.get(&id) else {
            return;
        };
        let record = &entry.record;
        let (Some(pid), Some(ticks)) = (record.shim_pid, record.shim_start_ticks) else {
            return;
        };
        let still_running = entry
            .shim_pidfd
            .as_ref()
            .is_some_and(|fd| matches!(wait_readable(fd.as_raw_fd(), Duration::ZERO), Ok(false)));
        let probed = if still_running {
            Probe::Running
        } else {
            probe(pid, ticks)
        };
        if probed == Probe::Running && !still_running {
            // Confirmed after opening: had the shim exited and its pid been reused in
            // between, the second look would see another start time.
            let pidfd = pidfd_open(pid).filter(|_| probe(pid, ticks) == Probe::Running);
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.shim_pidfd = pidfd;
            }
        }
        let Some(entry) = self.entries.get(&id) else {
            return;
        };
        match probed {
            Probe::Running => {
                // A safety net for a stuck shim, looked at once a second rather than on every
                // poll: polls come with every launch and exit, and each look is a lookup.
                if now >= entry.exit_checked_at_ms.saturating_add(EXIT_FILE_CHECK_MS) {
                    if let Some(entry) = self.entries.get_mut(&id) {
                        entry.exit_checked_at_ms = now;
                    }
                    if self.exit_file(id).exists() {
                        // The command has ended and the shim is about to kill its group and
                        // itself; make sure of it (a stopped or stuck shim) and report once it
                        // is gone, so that no process of the allocation remains when we report.
                        let _ = signal_group(pid, libc::SIGKILL);
                        return;
                    }
                }
                self.enforce_deadlines(id, pid, now);
            }
            Probe::Zombie => {
                // The zombie still reserves the pid, so the group id cannot be anybody else's.
                let _ = signal_group(pid, libc::SIGKILL);
                self.kill_cgroup(id);
                let fate = match try_reap(pid) {
                    Reap::Reaped(status) => ShimFate::Reaped(status),
                    Reap::NotOurChild | Reap::StillRunning => ShimFate::Gone,
                };
                self.settle(id, fate, now);
            }
            Probe::Gone => {
                // The shim is gone but members of its group may remain (the shim alone was
                // killed); while any member lives the group id cannot be reused, so this
                // reaches only our processes.
                let _ = signal_group(pid, libc::SIGKILL);
                self.kill_cgroup(id);
                self.settle(id, ShimFate::Gone, now);
            }
            Probe::Reused => self.settle(id, ShimFate::PidReused, now),
        }
    }

    /// Time limit and stop escalation for a running allocation.
    fn enforce_deadlines(&mut self, id: u64, pid: u32, now: u64) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let record = &mut entry.record;
        let Some(stop) = &record.stop else {
            let Some(limit) = record.spec.time_limit else {
                return;
            };
            if now >= record.started_at_ms.saturating_add(duration_ms(limit)) {
                tracing::info!(allocation = id, ?limit, "time limit reached");
                if let Err(e) = self.begin_stop(id, StopReason::TimeLimit, now) {
                    tracing::warn!(allocation = id, error = %e, "cannot signal timed-out allocation; SIGKILL follows after the grace");
                }
            }
            return;
        };
        let grace = duration_ms(match stop.reason {
            StopReason::Fenced => self.config.fence_grace.min(self.config.stop_grace),
            _ => self.config.stop_grace,
        });
        if record.kill_sent_at_ms.is_some() || now < stop.term_sent_at_ms.saturating_add(grace) {
            return;
        }
        tracing::warn!(
            allocation = id,
            "process group still running after the stop grace; sending SIGKILL"
        );
        record.kill_sent_at_ms = Some(now);
        self.persist(id);
        if let Err(e) = signal_group(pid, libc::SIGKILL) {
            tracing::error!(allocation = id, error = %e, "cannot SIGKILL process group");
        }
        // Processes that left the group (setsid, daemonised) are still in the cgroup.
        self.kill_cgroup(id);
    }

    /// Kills every process in allocation `id`'s cgroup, if it has one.
    fn kill_cgroup(&self, id: u64) {
        let Some(cg) = self.entries.get(&id).and_then(|e| e.record.cgroup.as_ref()) else {
            return;
        };
        match cg.kill_all() {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                allocation = id,
                processes = n,
                "killed what was left in the allocation's cgroup"
            ),
            Err(e) => {
                tracing::error!(allocation = id, error = %e, "cannot empty the allocation's cgroup")
            }
        }
    }

    /// Removes a record's cgroup (emptied first); a failure is logged, the directory stays.
    fn remove_cgroup(&self, record: &AllocationRecord) {
        let Some(cg) = &record.cgroup else { return };
        if let Err(e) = cg.kill_all().and_then(|_| cg.remove()) {
            tracing::warn!(allocation = record.id(), error = %e, "cannot remove the allocation's cgroup");
        }
    }

    /// The record of a launch not yet in `entries` (what `abort_launch` undoes).
    fn log_record(&self, id: u64) -> Option<AllocationRecord> {
        self.log.get(id)
    }

    /// Where allocation `id`'s shim writes its exit file: `logs/<id>.exit.json`; when that is
    /// absent, `allocations/<id>.exit.json` if it exists, which is where a shim started by an
    /// agent before the record log writes it (launch removes a stale one of either, so what
    /// is found is this allocation's).
    fn exit_file(&self, id: u64) -> PathBuf {
        let current = self.layout.exit_file(id);
        if !current.exists() {
            let legacy = self.layout.legacy_exit_file(id);
            if legacy.exists() {
                return legacy;
            }
        }
        current
    }

    /// Records an exit whose shim is no longer running (reads its exit file).
    fn settle(&mut self, id: u64, fate: ShimFate, now: u64) {
        let (exit, fate) = match read_exit_file(&self.exit_file(id)) {
            Ok(exit) => (exit, fate),
            Err(message) => (None, ShimFate::UnreadableExitFile(message)),
        };
        self.finish(id, exit, fate, now);
    }

    /// Classifies, journals, persists and queues the exit of allocation `id`. The journal
    /// line goes first: after a crash between the two, the exit is found again and journaled
    /// twice, which the checker tolerates; the other order could lose the `stop` line.
    fn finish(
        &mut self,
        id: u64,
        exit: Option<super::record::ShimExitRecord>,
        fate: ShimFate,
        now: u64,
    ) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let mut kind = classify(&entry.record, exit.as_ref(), &fate);
        let at_ms = exit.map_or(now, |e| e.at_ms);
        if entry.record.spec.container.is_some() {
            let spec = entry.record.spec.clone();
            self.remove_container(&spec);
        }
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        let usage = entry.record.cgroup.as_ref().map(|cg| {
            if let Err(e) = cg.kill_all() {
                tracing::error!(allocation = id, error = %e, "cannot empty the allocation's cgroup");
            }
            cg.usage()
        });
        let container_oom =
            entry.record.spec.container.is_some() && self.layout.container_oom_marker(id).exists();
        let usage = usage.map(|mut u| {
            u.oom_kills = u.oom_kills.max(u64::from(container_oom));
            u
        });
        if (container_oom || usage.is_some_and(|u| u.oom_kills > 0))
            && matches!(kind, ExitKind::Signaled { .. } | ExitKind::Exited { code: i32::MIN..=-1 | 1.. })
        {
            kind = ExitKind::OutOfMemory {
                limit_mib: entry.record.spec.memory_mib,
            };
        }
        if let Err(e) = append_usage(
            &self.layout.journal(),
            &UsageRecord::Stop {
                allocation: id,
                gpus: entry.record.spec.gpus.clone(),
                at_ms: now,
                exited_at_ms: (at_ms != now).then_some(at_ms),
            },
        ) {
            tracing::error!(allocation = id, error = %e, "cannot journal GPU release");
        }
        tracing::info!(allocation = id, ?kind, "allocation exited");
        entry.record.exit = Some(RecordedExit {
            kind: kind.clone(),
            at_ms,
            usage,
        });
        let cgroup = entry.record.cgroup.clone();
        let failure = entry.record.stop.as_ref().and_then(|s| s.failure.clone());
        // No sync of its own: after a power failure the record without its exit is settled
        // again the same way, from the shim's exit file (synced) or the shim's absence.
        self.persist_with(id, Durability::WithNextSync);
        if let Some(cg) = cgroup
            && let Err(e) = cg.remove()
        {
            tracing::warn!(allocation = id, error = %e, "cannot remove the allocation's cgroup");
        }
        self.pending.push(RuntimeEvent::Exited {
            allocation_id: id,
            kind,
            at_ms,
            usage,
            failure,
        });
    }
}

/// Creates (or appends to) the job's output `file` and makes the allocation's `log` a link
/// to it.
fn link_output_file(file: &std::path::Path, log: &std::path::Path) -> Result<(), String> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .map_err(|e| format!("cannot open its output file {}: {e}", file.display()))?;
    let _ = fs::remove_file(log);
    std::os::unix::fs::symlink(file, log)
        .map_err(|e| format!("cannot link {} to {}: {e}", log.display(), file.display()))
}

/// The cgroup of allocation `id`.
fn cgroup_name(id: u64) -> String {
    format!("alloc-{id}")
}

/// What a spec's cgroup limits: its memory (hard), its CPU quota, and devices to its own
/// GPUs' nodes plus what every process needs.
fn cgroup_limits(
    spec: &LaunchSpec,
    majors: crate::cgroup::devices::DriverMajors,
) -> crate::cgroup::Limits {
    // Pinned to the GPUs' NUMA node where this host has it (a simulated host may describe
    // nodes the machine running it lacks: then not pinned).
    let numa_cpus = spec.numa_node.and_then(|n| {
        std::fs::read_to_string(format!("/sys/devices/system/node/node{n}/cpulist"))
            .ok()
            .map(|cpus| (cpus.trim().to_owned(), n.to_string()))
            .filter(|(cpus, _)| !cpus.is_empty())
    });
    crate::cgroup::Limits {
        memory_bytes: (spec.memory_mib > 0).then_some(spec.memory_mib.saturating_mul(1 << 20)),
        cpu_milli: (spec.cpu_milli > 0).then_some(spec.cpu_milli),
        cpus: numa_cpus.as_ref().map(|(cpus, _)| cpus.clone()),
        mems: numa_cpus.map(|(_, node)| node),
        // A container's devices are confined by the engine's own device cgroup, a child of
        // this one (on v1 a child may never allow more than its parent, and the engine's
        // default rules include `c *:* m`).
        devices: spec.container.is_none().then(|| {
            crate::cgroup::devices::allocation_rules(&spec.gpu_minors, &spec.mig_cap_minors, majors)
        }),
    }
}

/// Every device UUID a spec touches: its GPUs and slices, and the parents of its slices.
fn devices_of(spec: &LaunchSpec) -> BTreeSet<String> {
    spec.gpus
        .iter()
        .chain(spec.mig_parents.values())
        .cloned()
        .collect()
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How long `open` waits for the state-directory lock before reporting it busy. Another
/// thread's `fork` briefly duplicates every descriptor of the process, the lock's included,
/// until the child's `exec` closes it; so a lock just released by a dropped runtime (in tests,
/// or an agent restarting in-process) can look held for a few milliseconds. A second live
/// agent holds it for good and is still refused.
const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Takes an exclusive flock on `state_dir/runtime.lock`, waiting up to [`LOCK_WAIT`]. The
/// lock belongs to the open file, so it is released when the runtime is dropped or the agent
/// dies, and the shims do not keep it (std opens files close-on-exec).
fn lock_state_dir(layout: &Layout) -> Result<File, RuntimeError> {
    let path = layout.lock();
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| RuntimeError::Io {
            action: "open lock file",
            path: path.clone(),
            source,
        })?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(libc::EWOULDBLOCK) => {
                return Err(RuntimeError::StateDirBusy {
                    state_dir: layout.root().to_path_buf(),
                    lock: path,
                });
            }
            _ => {
                return Err(RuntimeError::Io {
                    action: "lock",
                    path,
                    source: err,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::runtime::types::ExitKind;

    fn config(dir: &std::path::Path) -> RuntimeConfig {
        RuntimeConfig {
            state_dir: dir.to_path_buf(),
            // Never spawned in these tests.
            shim_program: PathBuf::from("/nonexistent/node-agent"),
            shim_args: vec!["shim".to_string()],
            launcher: false,
            stop_grace: Duration::from_secs(1),
            lease_file: None,
            fence_grace: Duration::from_secs(1),
            cgroups: None,
            driver_majors: Default::default(),
            containers: None,
        }
    }

    fn spec(id: u64, gpus: &[&str]) -> LaunchSpec {
        LaunchSpec {
            allocation_id: id,
            job_id: 1,
            job_name: "j".to_string(),
            tenant: "t".to_string(),
            command: vec!["true".to_string()],
            env: BTreeMap::new(),
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

    fn store_record(dir: &std::path::Path, record: &AllocationRecord) {
        let layout = Layout::new(dir.to_path_buf());
        layout.create_dirs().expect("dirs");
        let (mut log, _) = RecordLog::open(&layout).expect("open record log");
        log.put(record).expect("put");
    }

    /// Exits reported by the next polls, until one comes back empty.
    fn exits(rt: &mut Runtime) -> Vec<(u64, ExitKind)> {
        rt.poll()
            .into_iter()
            .filter_map(|e| match e {
                RuntimeEvent::Exited {
                    allocation_id,
                    kind,
                    ..
                } => Some((allocation_id, kind)),
                RuntimeEvent::Started { .. } => None,
            })
            .collect()
    }

    #[test]
    fn a_launch_interrupted_before_the_pid_was_recorded_is_reported_vanished() {
        let dir = tempfile::tempdir().expect("tempdir");
        store_record(
            dir.path(),
            &AllocationRecord::launching(spec(5, &["GPU-a"]), 1),
        );

        let mut rt = Runtime::open(config(dir.path())).expect("open");
        assert!(rt.live().is_empty());
        assert!(rt.gpus_in_use().is_empty());
        let events = rt.poll();
        assert!(
            matches!(
                events.as_slice(),
                [RuntimeEvent::Exited {
                    allocation_id: 5,
                    kind: ExitKind::Vanished { .. },
                    ..
                }]
            ),
            "{events:?}"
        );
        assert!(rt.poll().is_empty());
        // Still known until forgotten: no second copy.
        assert!(matches!(
            rt.launch(spec(5, &[])),
            Err(RuntimeError::AlreadyKnown(5))
        ));
        rt.forget(5).expect("forget");
        rt.forget(5).expect("forget is idempotent");
        drop(rt);
        let mut rt = Runtime::open(config(dir.path())).expect("reopen");
        assert!(rt.poll().is_empty());
    }

    #[test]
    fn a_running_shim_is_watched_through_a_pidfd_and_its_end_is_still_noticed() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().expect("tempdir");
        // Stands in for a re-adopted shim: a process of its own group, recorded by pid and
        // start time.
        let mut shim = Command::new("sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .expect("sleep");
        let pid = shim.id();
        let ticks = read_stat(pid).expect("stat").expect("running").start_ticks;
        let mut record = AllocationRecord::launching(spec(6, &["GPU-a"]), now_ms());
        record.shim_pid = Some(pid);
        record.shim_start_ticks = Some(ticks);
        store_record(dir.path(), &record);

        let mut rt = Runtime::open(config(dir.path())).expect("open");
        assert!(exits(&mut rt).is_empty());
        assert!(
            rt.entries[&6].shim_pidfd.is_some(),
            "a confirmed shim is watched through a pidfd"
        );
        assert!(exits(&mut rt).is_empty(), "still running");
        shim.kill().expect("kill");
        shim.wait().expect("reap");
        let ended = exits(&mut rt);
        assert!(
            matches!(ended.as_slice(), [(6, ExitKind::Vanished { .. })]),
            "{ended:?}"
        );
    }

    #[test]
    fn a_spawn_failure_leaves_no_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rt = Runtime::open(config(dir.path())).expect("open");
        let err = rt.launch(spec(3, &["GPU-a"])).expect_err("no shim binary");
        assert!(
            matches!(err, RuntimeError::Spawn { allocation: 3, .. }),
            "{err}"
        );
        assert!(rt.live().is_empty());
        assert!(rt.poll().is_empty());
        // Its launch record was forgotten: nothing comes back after a restart, and the id
        // can be launched again.
        drop(rt);
        let layout = Layout::new(dir.path().to_path_buf());
        let (_, records) = RecordLog::open(&layout).expect("open record log");
        assert!(records.is_empty(), "{records:?}");
        let mut rt = Runtime::open(config(dir.path())).expect("reopen");
        assert!(rt.poll().is_empty());
        assert!(matches!(
            rt.launch(spec(3, &["GPU-a"])),
            Err(RuntimeError::Spawn { allocation: 3, .. })
        ));
    }

    /// A dead pid: a child of the test, already reaped.
    fn dead_pid() -> u32 {
        let mut child = Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait");
        pid
    }

    #[test]
    fn an_allocation_of_an_agent_before_the_record_log_is_settled_from_its_legacy_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        fs::create_dir_all(layout.legacy_records_dir()).expect("mkdir");
        let mut record = AllocationRecord::launching(spec(8, &["GPU-a"]), 1);
        record.shim_pid = Some(dead_pid());
        // Not the start time of whatever may have that pid now.
        record.shim_start_ticks = Some(1);
        fs::write(
            layout.legacy_record(8),
            serde_json::to_vec_pretty(&record).expect("encode"),
        )
        .expect("write");
        fs::write(
            layout.legacy_exit_file(8),
            r#"{"status":"exited","code":7,"at_ms":5}"#,
        )
        .expect("write");

        let mut rt = Runtime::open(config(dir.path())).expect("open");
        assert!(!layout.legacy_record(8).exists(), "moved into the log");
        assert_eq!(exits(&mut rt), vec![(8, ExitKind::Exited { code: 7 })]);
        rt.forget(8).expect("forget");
        assert!(!layout.legacy_exit_file(8).exists());
        drop(rt);
        let mut rt = Runtime::open(config(dir.path())).expect("reopen");
        assert!(rt.poll().is_empty());
    }

    #[test]
    fn the_exit_file_next_to_the_logs_wins_and_is_kept_after_forget() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        let mut record = AllocationRecord::launching(spec(9, &["GPU-a"]), 1);
        record.shim_pid = Some(dead_pid());
        record.shim_start_ticks = Some(1);
        store_record(dir.path(), &record);
        fs::create_dir_all(layout.log_dir(9)).expect("mkdir");
        fs::write(
            layout.exit_file(9),
            r#"{"status":"signaled","signal":15,"at_ms":5}"#,
        )
        .expect("write");

        let mut rt = Runtime::open(config(dir.path())).expect("open");
        assert_eq!(exits(&mut rt), vec![(9, ExitKind::Signaled { signal: 15 })]);
        rt.forget(9).expect("forget");
        assert!(layout.exit_file(9).exists(), "kept with the logs");
        // The id comes again: the stale exit file goes before the new shim starts (here the
        // shim cannot start at all).
        assert!(matches!(
            rt.launch(spec(9, &["GPU-a"])),
            Err(RuntimeError::Spawn { allocation: 9, .. })
        ));
        assert!(!layout.exit_file(9).exists());
    }

    #[test]
    fn runtime_can_move_to_a_blocking_task() {
        fn assert_send<T: Send + 'static>() {}
        assert_send::<Runtime>();
    }

    #[test]
    fn one_runtime_per_state_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rt = Runtime::open(config(dir.path())).expect("open");
        let err = Runtime::open(config(dir.path())).expect_err("second runtime");
        assert!(matches!(err, RuntimeError::StateDirBusy { .. }), "{err}");
        drop(rt);
        Runtime::open(config(dir.path())).expect("lock released on drop");
    }

    #[test]
    fn invalid_specs_and_unknown_ids_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rt = Runtime::open(config(dir.path())).expect("open");
        let mut bad = spec(1, &[]);
        bad.command.clear();
        assert!(matches!(
            rt.launch(bad),
            Err(RuntimeError::InvalidSpec { allocation: 1, .. })
        ));
        assert!(matches!(
            rt.stop(9, StopReason::Requested),
            Err(RuntimeError::Unknown(9))
        ));
        rt.forget(9).expect("forgetting an unknown id is a no-op");
    }
}
