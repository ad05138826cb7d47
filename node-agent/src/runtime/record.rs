//! What the runtime keeps on disk and how it reads it back: the state-directory layout, the
//! per-allocation record, the exit file the shim writes, atomic writes, and the rule that
//! turns "what is left on disk and in /proc" into an [`ExitKind`] ([`classify`]).
//!
//! Layout under `state_dir`:
//! ```text
//! runtime.lock                     flock held by the one runtime using this directory
//! allocations.log                  AllocationRecords, one appended line per change (runtime-
//!                                  owned; record_log.rs)
//! logs/<id>/stdout, logs/<id>/stderr
//! logs/<id>.exit.json              ShimExitRecord (shim-owned; written once, atomically; kept
//!                                  with the logs after the allocation is forgotten; beside
//!                                  the job's directory, not in it, so no file the job writes
//!                                  in its working directory can pass for its exit)
//! gpu-usage.jsonl                  GPU usage journal (journal.rs)
//! ```
//!
//! Agents before the record log kept one file per allocation, `allocations/<id>.json`, and
//! had their shims write `allocations/<id>.exit.json`. `RecordLog::open` moves such records
//! into the log; the runtime still looks for the exit file there when the new one is absent,
//! since a shim started by an older agent keeps the path it was given.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::process::WaitStatus;
use super::types::{ExitKind, LaunchSpec, RuntimeError, StopReason};

/// Version of [`AllocationRecord`]'s format; an agent refuses records it does not know
/// rather than misreading what a newer agent wrote.
pub(crate) const RECORD_FORMAT: u32 = 1;

/// Paths inside the state directory, in one place.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    root: PathBuf,
}

impl Layout {
    pub(crate) fn new(root: PathBuf) -> Layout {
        Layout { root }
    }
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }
    pub(crate) fn lock(&self) -> PathBuf {
        self.root.join("runtime.lock")
    }
    pub(crate) fn record_log(&self) -> PathBuf {
        self.root.join("allocations.log")
    }
    /// Where the shim writes how the command ended.
    pub(crate) fn exit_file(&self, id: u64) -> PathBuf {
        self.root.join("logs").join(format!("{id}.exit.json"))
    }
    /// The directory of the per-file records of agents before the record log.
    pub(crate) fn legacy_records_dir(&self) -> PathBuf {
        self.root.join("allocations")
    }
    pub(crate) fn legacy_record(&self, id: u64) -> PathBuf {
        self.legacy_records_dir().join(format!("{id}.json"))
    }
    /// Where the shims of agents before the record log write their exit file.
    pub(crate) fn legacy_exit_file(&self, id: u64) -> PathBuf {
        self.legacy_records_dir().join(format!("{id}.exit.json"))
    }
    pub(crate) fn log_dir(&self, id: u64) -> PathBuf {
        self.root.join("logs").join(id.to_string())
    }
    pub(crate) fn stdout_log(&self, id: u64) -> PathBuf {
        self.log_dir(id).join("stdout")
    }
    /// Written by a container job's runner when the engine says the container was killed
    /// for its memory limit: the kill happened in the container's own cgroup, which the
    /// engine removes with it, so the allocation's cgroup never counts it (cgroup v1).
    pub(crate) fn container_oom_marker(&self, id: u64) -> PathBuf {
        self.log_dir(id).join("container-oom")
    }
    pub(crate) fn stderr_log(&self, id: u64) -> PathBuf {
        self.log_dir(id).join("stderr")
    }
    pub(crate) fn journal(&self) -> PathBuf {
        self.root.join("gpu-usage.jsonl")
    }

    pub(crate) fn create_dirs(&self) -> Result<(), RuntimeError> {
        let dir = self.root.join("logs");
        fs::create_dir_all(&dir).map_err(|source| RuntimeError::Io {
            action: "create state directory",
            path: dir.clone(),
            source,
        })?;
        if let Err(e) = spread_subdirectories(&dir) {
            tracing::debug!(dir = %dir.display(), error = %e, "cannot mark the log directory as a top directory; job directories stay in its block group");
        }
        Ok(())
    }
}

/// Marks `dir` as the top of a directory hierarchy (`chattr +T`, ext2/3/4's `FS_TOPDIR_FL`):
/// the file system then places each new subdirectory, here one per job, in a block group of
/// its own choosing instead of next to `dir`, and the job's files follow its directory.
///
/// Why: a host running many short jobs creates and deletes thousands of job directories. On
/// ext4 without a journal, inode allocation scans past every inode of the group deleted in the
/// last one to six minutes (`recently_deleted`), so with every job directory in one group each
/// creation gets slower the more jobs ran recently: `perf` put 28% of all CPU of back-to-back
/// `gpuctl bench e2e` runs there. Spread over the file system's groups, each scan is short.
/// Harmless elsewhere; file systems without the flag refuse it, and that is ignored.
fn spread_subdirectories(dir: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = File::open(dir)?;
    let mut flags = inode_flags(&file)?;
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(());
    }
    flags |= FS_TOPDIR_FL;
    // SAFETY: `file` stays open for the call, and this ioctl reads a single `int` through the
    // pointer (the kernel's ABI, despite the `long` in its number).
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `FS_TOPDIR_FL` from `linux/fs.h`; the libc crate does not export it.
const FS_TOPDIR_FL: libc::c_int = 0x0002_0000;

/// The inode flags `chattr` sets and `lsattr` shows.
fn inode_flags(file: &File) -> io::Result<libc::c_int> {
    use std::os::fd::AsRawFd;
    let mut flags: libc::c_int = 0;
    // SAFETY: `file` stays open for the call, and this ioctl writes a single `int` through the
    // pointer.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(flags)
}

/// A stop the runtime started: when SIGTERM went out and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StopRequest {
    pub reason: StopReason,
    pub term_sent_at_ms: u64,
    /// Set when the agent stopped the allocation because it failed a check of its own (a
    /// liveness probe): the exit is reported as that failure, also by a restarted agent.
    /// Older agents ignore the field (the stop then reads as a plain stop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// An exit the runtime has observed and reported (until `forget`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RecordedExit {
    pub kind: ExitKind,
    pub at_ms: u64,
    /// What the allocation's cgroup measured, reported with the exit again after a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::cgroup::Usage>,
}

/// Everything the runtime must remember about one allocation across agent restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AllocationRecord {
    pub format: u32,
    pub spec: LaunchSpec,
    /// `None` while launching: the record is written before the shim is spawned, so a crash
    /// in between leaves a trace (and the shim never runs the command without this field
    /// persisted; see the go handshake in `shim.rs`).
    pub shim_pid: Option<u32>,
    /// `/proc/<pid>/stat` field 22 (start time in clock ticks since boot) of the shim, to
    /// tell our shim from an unrelated process that later got the same pid.
    pub shim_start_ticks: Option<u64>,
    /// When the command was released to run (wall clock, ms since the epoch); the time limit
    /// counts from here.
    pub started_at_ms: u64,
    pub stop: Option<StopRequest>,
    pub kill_sent_at_ms: Option<u64>,
    pub exit: Option<RecordedExit>,
    /// The allocation's cgroup, created before its shim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<crate::cgroup::AllocationCgroup>,
}

impl AllocationRecord {
    pub(crate) fn launching(spec: LaunchSpec, now_ms: u64) -> AllocationRecord {
        AllocationRecord {
            format: RECORD_FORMAT,
            spec,
            shim_pid: None,
            shim_start_ticks: None,
            started_at_ms: now_ms,
            stop: None,
            kill_sent_at_ms: None,
            exit: None,
            cgroup: None,
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.spec.allocation_id
    }

    /// Still running (or being stopped) as far as the runtime knows.
    pub(crate) fn is_live(&self) -> bool {
        self.exit.is_none()
    }
}

/// How the shim's child ended, as the shim saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub(crate) enum ChildStatus {
    Exited { code: i32 },
    Signaled { signal: i32 },
}

/// The exit file: `{"status":"exited","code":0,"at_ms":...}` or
/// `{"status":"signaled","signal":9,"at_ms":...}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ShimExitRecord {
    #[serde(flatten)]
    pub status: ChildStatus,
    pub at_ms: u64,
    /// The shim stopped the command itself because the agent's lease expired.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
}

/// Writes `bytes` to `path` so that readers see either the old content or all of the new:
/// write a temporary file in `tmp_dir` (on the same file system as `path`), fsync it, rename
/// it over `path`, fsync `path`'s directory (so the rename itself survives a power loss).
///
/// Why a separate `tmp_dir`: the shim writes the exit file from the job's own log directory,
/// so that the file's inode is allocated in that directory's block group, which
/// `Layout::create_dirs` spreads over the disk, and not in the crowded one of `logs/` (see
/// `spread_subdirectories`); a rename allocates no inode. If that fails for any reason (the
/// job removed its own directory, the two are on different file systems), `path` still names
/// the old content, and the write is made again from `path`'s own directory.
pub(crate) fn write_atomic_via(tmp_dir: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    if replace_file_via(tmp_dir, path, bytes).is_err() {
        replace_file(path, bytes)?;
    }
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// [`write_atomic_via`] from `path`'s own directory, without the final directory sync: once this returns `Ok`, `path` names
/// the new content (not yet durably, until the directory is synced); on `Err` it still names
/// the old content.
pub(crate) fn replace_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no directory"))?;
    replace_file_via(dir, path, bytes)
}

fn replace_file_via(tmp_dir: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".tmp.{}", std::process::id()));
    let tmp = tmp_dir.join(tmp_name);
    let result = (|| {
        // 0600: records hold the job's environment, which may carry tokens.
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Removes a file that may already be gone (forget is idempotent).
pub(crate) fn remove_if_present(path: &Path) -> Result<(), RuntimeError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(RuntimeError::Io {
            action: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Loads every per-file allocation record (`allocations/<id>.json`, the layout of agents
/// before the record log; none if the directory does not exist). A record that cannot be
/// read fails the whole load: the runtime would otherwise lose track of a process that may
/// still run and could later start the same allocation twice (invariant 3), so a person has
/// to look at it. The record log applies the same rule to its lines.
pub(crate) fn load_records(layout: &Layout) -> Result<Vec<AllocationRecord>, RuntimeError> {
    let dir = layout.legacy_records_dir();
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(RuntimeError::Io {
                action: "list state records in",
                path: dir,
                source,
            });
        }
    };
    let mut records = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| RuntimeError::Io {
            action: "list state records in",
            path: dir.clone(),
            source,
        })?;
        let path = entry.path();
        let Some(id) = record_id(&path) else {
            // Exit files, temporary files of interrupted writes, anything else.
            continue;
        };
        let corrupt = |message: String| RuntimeError::CorruptRecord {
            path: path.clone(),
            message,
        };
        let bytes = fs::read(&path).map_err(|source| RuntimeError::Io {
            action: "read state record",
            path: path.clone(),
            source,
        })?;
        let record: AllocationRecord =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if record.format != RECORD_FORMAT {
            return Err(corrupt(format!(
                "format {} is not the supported format {RECORD_FORMAT} (written by another \
                 node-agent version?)",
                record.format
            )));
        }
        if record.id() != id {
            return Err(corrupt(format!(
                "the file name says allocation {id} but the record is for allocation {}",
                record.id()
            )));
        }
        records.push(record);
    }
    records.sort_by_key(AllocationRecord::id);
    Ok(records)
}

/// `allocations/<digits>.json` → the id; anything else → `None`.
fn record_id(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".json")?;
    if stem.is_empty() || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    stem.parse().ok()
}

/// Reads the shim's exit file. `Ok(None)`: not written (yet). `Err`: present but
/// unreadable, which should not happen since the shim renames a complete file into place.
pub(crate) fn read_exit_file(path: &Path) -> Result<Option<ShimExitRecord>, String> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("exit file {} is unreadable: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("exit file {} is unreadable: {e}", path.display())),
    }
}

/// What the runtime learnt about the shim process once it stopped running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ShimFate {
    /// The agent stopped between writing the launch record and recording the shim's pid;
    /// the shim never received the go-ahead, so the command never ran.
    NeverReleased,
    /// The shim was our child and we reaped it with this status.
    Reaped(WaitStatus),
    /// The shim is gone and was not our child (re-adopted after a restart), so its status
    /// is unknown.
    Gone,
    /// The shim's pid now belongs to an unrelated process.
    PidReused,
    /// The exit file exists but could not be read.
    UnreadableExitFile(String),
}

/// Turns what is left of an allocation into its [`ExitKind`]. The runtime's own intent wins
/// (a time limit it enforced → `TimedOut`, a stop it was asked for → `Stopped`), because the
/// control plane needs the *reason* (requeue, charge, notify) and the process's own status
/// is then just the effect of our signal. Otherwise the shim's exit file is the truth; with
/// no exit file the process vanished, unless the runtime itself had sent SIGKILL.
pub(crate) fn classify(
    record: &AllocationRecord,
    exit: Option<&ShimExitRecord>,
    fate: &ShimFate,
) -> ExitKind {
    if let Some(stop) = &record.stop {
        return match stop.reason {
            StopReason::TimeLimit => ExitKind::TimedOut,
            _ => ExitKind::Stopped,
        };
    }
    if let Some(exit) = exit {
        if exit.fenced {
            return ExitKind::Vanished {
                reason: "its supervisor stopped it because the agent's lease to the control plane expired".into(),
            };
        }
        return match exit.status {
            ChildStatus::Exited { code } => ExitKind::Exited { code },
            ChildStatus::Signaled { signal } => ExitKind::Signaled { signal },
        };
    }
    if record.kill_sent_at_ms.is_some() {
        return ExitKind::Signaled {
            signal: libc::SIGKILL,
        };
    }
    let pid = record
        .shim_pid
        .map_or_else(|| "?".to_string(), |p| p.to_string());
    let reason = match fate {
        ShimFate::NeverReleased => {
            "the agent stopped while launching the allocation; the command was never started"
                .to_string()
        }
        ShimFate::Reaped(WaitStatus::Signaled(signal)) => format!(
            "the supervisor shim (pid {pid}) was killed by signal {signal} before it could \
             record how the command ended"
        ),
        ShimFate::Reaped(WaitStatus::Exited(code)) => format!(
            "the supervisor shim (pid {pid}) exited with code {code} without recording how \
             the command ended; see the allocation's stderr log"
        ),
        ShimFate::Gone => format!(
            "the supervisor shim (pid {pid}) is gone and left no exit record (killed together \
             with its command, or the host rebooted)"
        ),
        ShimFate::PidReused => format!(
            "the supervisor shim (pid {pid}) is gone (the pid now belongs to another process) \
             and left no exit record"
        ),
        ShimFate::UnreadableExitFile(message) => message.clone(),
    };
    ExitKind::Vanished { reason }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;

    fn record() -> AllocationRecord {
        let spec = LaunchSpec {
            allocation_id: 12,
            job_id: 3,
            job_name: "j".to_string(),
            tenant: "t".to_string(),
            command: vec!["sleep".to_string(), "1".to_string()],
            env: BTreeMap::from([("TOKEN".to_string(), "x".to_string())]),
            gpus: vec!["GPU-1".to_string()],
            time_limit: Some(Duration::from_millis(1500)),
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
        };
        let mut r = AllocationRecord::launching(spec, 1000);
        r.shim_pid = Some(4242);
        r.shim_start_ticks = Some(987_654);
        r
    }

    #[test]
    fn record_round_trips_through_json() {
        let mut r = record();
        r.stop = Some(StopRequest {
            reason: StopReason::Fenced,
            term_sent_at_ms: 2000,
            failure: None,
        });
        r.kill_sent_at_ms = Some(3000);
        r.exit = Some(RecordedExit {
            kind: ExitKind::Vanished {
                reason: "x".to_string(),
            },
            at_ms: 4000,
            usage: None,
        });
        let json = serde_json::to_string(&r).expect("encode");
        let back: AllocationRecord = serde_json::from_str(&json).expect("decode");
        assert_eq!(back, r);
    }

    #[test]
    fn shares_and_slices_round_trip_and_records_without_them_still_load() {
        let mut r = record();
        r.spec.share = Some(crate::runtime::types::GpuShare {
            milli: 250,
            memory_mib: 20_389,
            gpu_memory_mib: 81_559,
        });
        let json = serde_json::to_string(&r).expect("encode");
        assert_eq!(
            serde_json::from_str::<AllocationRecord>(&json).expect("decode"),
            r
        );
        let mut r = record();
        r.spec.gpus = vec!["MIG-1".to_string()];
        r.spec.mig_parents = BTreeMap::from([("MIG-1".to_string(), "GPU-1".to_string())]);
        let json = serde_json::to_string(&r).expect("encode");
        assert_eq!(
            serde_json::from_str::<AllocationRecord>(&json).expect("decode"),
            r
        );

        // What an agent before shares wrote: no `share`, no `mig_parents`.
        let json = serde_json::to_string(&record()).expect("encode");
        assert!(
            !json.contains("share") && !json.contains("mig_parents"),
            "{json}"
        );
        assert_eq!(
            serde_json::from_str::<AllocationRecord>(&json).expect("decode"),
            record()
        );
    }

    #[test]
    fn exit_file_format_is_stable() {
        let exit = ShimExitRecord {
            status: ChildStatus::Signaled { signal: 15 },
            at_ms: 77,
            fenced: false,
        };
        let json = serde_json::to_string(&exit).expect("encode");
        assert_eq!(json, r#"{"status":"signaled","signal":15,"at_ms":77}"#);
        let back: ShimExitRecord =
            serde_json::from_str(r#"{"status":"exited","code":3,"at_ms":5}"#).expect("decode");
        assert_eq!(back.status, ChildStatus::Exited { code: 3 });
    }

    /// The exit file lands at its path, its inode made in the job's directory, with nothing
    /// left behind in either directory.
    #[test]
    fn write_atomic_via_another_directory_leaves_only_the_target() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        layout.create_dirs().expect("dirs");
        let job_dir = layout.log_dir(5);
        fs::create_dir_all(&job_dir).expect("mkdir");
        fs::write(layout.stdout_log(5), "out").expect("write");
        let target = layout.exit_file(5);
        fs::write(&target, "old").expect("write");

        write_atomic_via(&job_dir, &target, b"new").expect("write via");
        assert_eq!(fs::read(&target).expect("read"), b"new");
        let names = |d: &Path| -> Vec<String> {
            let mut v: Vec<String> = fs::read_dir(d)
                .expect("read_dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&job_dir), vec!["stdout"]);
        assert_eq!(names(&layout.root().join("logs")), vec!["5", "5.exit.json"]);
        // 0600 as every record: it may be read back by the agent only.
        let mode = fs::metadata(&target).expect("stat").mode() & 0o777;
        assert_eq!(mode, 0o600);

        // A job that removed its own directory still gets its exit file, written from logs/.
        fs::remove_dir_all(&job_dir).expect("rm job dir");
        write_atomic_via(&job_dir, &target, b"newer").expect("write beside the target");
        assert_eq!(fs::read(&target).expect("read"), b"newer");
        assert_eq!(names(&layout.root().join("logs")), vec!["5.exit.json"]);

        // When neither directory can take it, the write fails and says why.
        let elsewhere = layout.root().join("gone").join("6.exit.json");
        let err = write_atomic_via(&job_dir, &elsewhere, b"x").expect_err("no directory");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(!elsewhere.exists());
    }

    /// Writes a record the way agents before the record log did.
    fn store_legacy(layout: &Layout, record: &AllocationRecord) {
        fs::create_dir_all(layout.legacy_records_dir()).expect("mkdir");
        let bytes = serde_json::to_vec_pretty(record).expect("encode");
        let path = layout.legacy_record(record.id());
        write_atomic_via(&layout.legacy_records_dir(), &path, &bytes).expect("write");
    }

    #[test]
    fn legacy_load_skips_non_records_and_rejects_corrupt_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        layout.create_dirs().expect("dirs");
        assert_eq!(load_records(&layout).expect("no legacy directory"), vec![]);
        store_legacy(&layout, &record());
        fs::write(layout.legacy_exit_file(12), "{}").expect("write");
        fs::write(
            layout.legacy_records_dir().join("12.json.tmp.99"),
            "garbage",
        )
        .expect("write");
        let loaded = load_records(&layout).expect("load");
        assert_eq!(loaded, vec![record()]);

        fs::write(layout.legacy_record(13), "{not json").expect("write");
        let err = load_records(&layout).expect_err("corrupt record must fail the load");
        assert!(matches!(err, RuntimeError::CorruptRecord { .. }), "{err}");

        // A record stored under the wrong name is as suspicious as a corrupt one.
        fs::remove_file(layout.legacy_record(13)).expect("rm");
        fs::copy(layout.legacy_record(12), layout.legacy_record(14)).expect("copy");
        assert!(load_records(&layout).is_err());
    }

    /// Where the file system has the flag (ext2/3/4), the log directory carries it; where it
    /// has not, creating the directories still succeeds.
    #[test]
    fn the_log_directory_spreads_job_directories_where_the_file_system_can() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        layout.create_dirs().expect("dirs");
        let logs = File::open(dir.path().join("logs")).expect("open logs");
        match spread_subdirectories(&dir.path().join("logs")) {
            Ok(()) => {
                let flags = inode_flags(&logs).expect("flags were just set");
                assert_ne!(flags & FS_TOPDIR_FL, 0, "flags {flags:#x}");
            }
            Err(e) => eprintln!("this file system does not take the top-directory flag: {e}"),
        }
        // Opening again (an agent restart) keeps the directory and its flag.
        layout.create_dirs().expect("dirs again");
    }

    #[test]
    fn unknown_format_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        layout.create_dirs().expect("dirs");
        let mut r = record();
        r.format = 99;
        store_legacy(&layout, &r);
        assert!(load_records(&layout).is_err());
    }

    #[test]
    fn exit_files_live_with_the_logs() {
        let layout = Layout::new(PathBuf::from("/s"));
        assert_eq!(layout.exit_file(7), PathBuf::from("/s/logs/7.exit.json"));
        assert_eq!(
            layout.legacy_exit_file(7),
            PathBuf::from("/s/allocations/7.exit.json")
        );
        assert_eq!(layout.record_log(), PathBuf::from("/s/allocations.log"));
    }

    #[test]
    fn classify_prefers_the_runtimes_intent() {
        let exited = ShimExitRecord {
            status: ChildStatus::Exited { code: 0 },
            at_ms: 1,
            fenced: false,
        };
        let mut r = record();
        assert_eq!(
            classify(&r, Some(&exited), &ShimFate::Gone),
            ExitKind::Exited { code: 0 }
        );
        let signaled = ShimExitRecord {
            status: ChildStatus::Signaled { signal: 11 },
            at_ms: 1,
            fenced: false,
        };
        assert_eq!(
            classify(&r, Some(&signaled), &ShimFate::Gone),
            ExitKind::Signaled { signal: 11 }
        );
        assert!(matches!(
            classify(&r, None, &ShimFate::Reaped(WaitStatus::Signaled(9))),
            ExitKind::Vanished { .. }
        ));
        assert!(matches!(
            classify(&r, None, &ShimFate::NeverReleased),
            ExitKind::Vanished { .. }
        ));

        r.kill_sent_at_ms = Some(5);
        assert_eq!(
            classify(&r, None, &ShimFate::Gone),
            ExitKind::Signaled { signal: 9 }
        );

        r.stop = Some(StopRequest {
            reason: StopReason::Requested,
            term_sent_at_ms: 4,
            failure: None,
        });
        assert_eq!(
            classify(&r, Some(&exited), &ShimFate::Gone),
            ExitKind::Stopped
        );
        r.stop = Some(StopRequest {
            reason: StopReason::TimeLimit,
            term_sent_at_ms: 4,
            failure: None,
        });
        assert_eq!(classify(&r, None, &ShimFate::PidReused), ExitKind::TimedOut);
    }

    #[test]
    fn a_stop_for_a_failed_check_keeps_its_failure_and_older_stops_still_load() {
        let mut r = record();
        r.stop = Some(StopRequest {
            reason: StopReason::Requested,
            term_sent_at_ms: 7,
            failure: Some("liveness probe failed: connection refused".into()),
        });
        let json = serde_json::to_string(&r).expect("encode");
        assert_eq!(
            serde_json::from_str::<AllocationRecord>(&json).expect("decode"),
            r
        );
        // Written by an agent before the field: no failure.
        let old = r#"{"reason":"requested","term_sent_at_ms":7}"#;
        let stop: StopRequest = serde_json::from_str(old).expect("decode");
        assert_eq!(stop.failure, None);
        // A plain stop writes nothing new, so older agents read it as before.
        let plain = StopRequest {
            failure: None,
            ..stop
        };
        assert!(
            !serde_json::to_string(&plain)
                .expect("encode")
                .contains("failure")
        );
    }
}
