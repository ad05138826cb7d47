//! The allocation record log, `state_dir/allocations.log`: every change to an
//! [`AllocationRecord`] appended as one line, instead of one file per allocation rewritten
//! atomically on every change. A job's three record writes and its forget then cost no inode
//! creation or deletion at all (inode churn is what made the old layout expensive on
//! journal-less ext4); the log is rewritten, with only the live records, on open and once
//! enough dead lines have accumulated.
//!
//! A line is `<checksum> <json>\n`: the checksum is FNV-1a 64 of the JSON bytes, as 16 hex
//! digits; the JSON is `{"put":<AllocationRecord>}` or `{"forget":{"id":<id>}}`. Replaying
//! the lines in order gives the records: the last put of an id wins, a forget removes it.
//!
//! Each append is `write_all` on an append-mode descriptor, and most are followed by
//! `sync_data`, so the record is on disk when `put` returns. Two kinds of change are written
//! without their own sync ([`Durability::WithNextSync`]) and become durable with the next
//! synced append (one `fdatasync` flushes every earlier write to the file, in order): the
//! first record of a launch, which the launch's next record (the shim's pid, synced before
//! the command may start) always follows, and changes whose loss in a power failure cannot
//! matter because they are found again after the reboot (the exit, which the shim's synced
//! exit file holds; the forgetting of an acknowledged exit, which is at worst reported again
//! and ignored). An agent that crashes without the machine loses nothing: the page cache
//! holds every write. A crash can tear only the last line; `open` cuts such a line off (with
//! a warning). A bad line anywhere else cannot come from a crash and fails the open with
//! [`RuntimeError::CorruptRecord`]: like a corrupt record file before, it may be the only
//! trace of a process that still runs (see `load_records`).
//!
//! Records written by an agent from before the log (`allocations/<id>.json`) are moved into
//! the log by `open`, before anything else happens, and their files deleted once the log
//! holding them is durable.

use std::collections::{BTreeMap, btree_map};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::record::{
    AllocationRecord, Layout, RECORD_FORMAT, load_records, remove_if_present, replace_file,
    sync_dir,
};
use super::types::RuntimeError;

/// When an append must be on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// Before the call returns (`fdatasync`).
    Synced,
    /// With the next synced append, or whenever the kernel writes it back.
    WithNextSync,
}

/// Dead lines (overwritten puts, forgets and what they forgot) beyond which the log is
/// compacted: at least this many, and at least `DEAD_PER_LIVE` per live record, so a
/// compaction's cost (proportional to the live records) is spread over many appends.
const MIN_DEAD_LINES: usize = 1024;
const DEAD_PER_LIVE: usize = 4;

/// One line's JSON, as written.
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum LineOut<'a> {
    Put(&'a AllocationRecord),
    Forget { id: u64 },
}

/// One line's JSON, as read.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum LineIn {
    Put(Box<AllocationRecord>),
    Forget { id: u64 },
}

/// The open record log of a state directory. Knows the records as they are on disk (which
/// may lag the runtime's memory after a failed append; the runtime retries those).
#[derive(Debug)]
pub(crate) struct RecordLog {
    path: PathBuf,
    /// The append descriptor; `None` after the log file was replaced or an append could not
    /// be undone: the next append reopens it first (cutting the file back to `len`).
    file: Option<File>,
    /// Bytes of whole, good lines in the file at `path`.
    len: u64,
    /// Lines in the file at `path`.
    lines: usize,
    /// The directory entry of a compacted log may not be durable yet (the directory sync
    /// failed): appends wait until it is, or they could vanish with the new file.
    dir_unsynced: bool,
    records: BTreeMap<u64, AllocationRecord>,
}

impl RecordLog {
    /// Opens (creating it if needed) the record log of `layout`, cuts off a line torn by a
    /// crash, moves records of the per-file layout into it, compacts it, and returns it with
    /// the records it holds, in id order.
    pub(crate) fn open(
        layout: &Layout,
    ) -> Result<(RecordLog, Vec<AllocationRecord>), RuntimeError> {
        let path = layout.record_log();
        let io_err = |action: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| RuntimeError::Io {
                action,
                path,
                source,
            }
        };
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                create(&path).map_err(io_err("create record log", &path))?;
                Vec::new()
            }
            Err(e) => return Err(io_err("read record log", &path)(e)),
        };
        let replay = replay(&bytes).map_err(|message| RuntimeError::CorruptRecord {
            path: path.clone(),
            message,
        })?;
        if let Some(why) = &replay.torn {
            tracing::warn!(
                path = %path.display(),
                kept_bytes = replay.good_len,
                dropped_bytes = bytes.len() as u64 - replay.good_len,
                "record log ends in {why}, left by an interrupted append; cutting it off"
            );
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io_err("open record log", &path))?;
            file.set_len(replay.good_len)
                .and_then(|()| file.sync_all())
                .map_err(io_err("truncate record log", &path))?;
        }
        let mut log = RecordLog {
            path,
            file: None,
            len: replay.good_len,
            lines: replay.lines,
            dir_unsynced: false,
            records: replay.records,
        };

        // Records of an agent from before the log. A record already in the log is newer
        // (or the same: an upgrade interrupted after compacting, before deleting the files).
        let legacy = load_records(layout)?;
        let mut migrated = 0;
        for record in &legacy {
            if let btree_map::Entry::Vacant(slot) = log.records.entry(record.id()) {
                slot.insert(record.clone());
                migrated += 1;
            }
        }
        if migrated > 0 || log.lines > log.records.len() {
            log.compact()
                .map_err(io_err("compact record log", &log.path))?;
            if log.dir_unsynced {
                let root = layout.root();
                sync_dir(root).map_err(io_err("sync state directory", root))?;
                log.dir_unsynced = false;
            }
        }
        if !legacy.is_empty() {
            tracing::info!(
                records = legacy.len(),
                migrated,
                "moved per-file allocation records into the record log"
            );
            for record in &legacy {
                remove_if_present(&layout.legacy_record(record.id()))?;
            }
            let dir = layout.legacy_records_dir();
            sync_dir(&dir).map_err(io_err("sync state directory", &dir))?;
        }
        log.reopen().map_err(io_err("open record log", &log.path))?;
        remove_leftover_temporaries(layout.root());
        let records = log.records.values().cloned().collect();
        Ok((log, records))
    }

    /// Whether the log holds a record for `id` (not forgotten).
    pub(crate) fn contains(&self, id: u64) -> bool {
        self.records.contains_key(&id)
    }

    /// The record of `id`, if the log holds one.
    pub(crate) fn get(&self, id: u64) -> Option<AllocationRecord> {
        self.records.get(&id).cloned()
    }

    /// Appends `record` and makes it durable.
    pub(crate) fn put(&mut self, record: &AllocationRecord) -> Result<(), RuntimeError> {
        self.put_with(record, Durability::Synced)
    }

    /// Appends `record`, made durable now or with the next synced append (see the module
    /// documentation for which changes may wait).
    pub(crate) fn put_with(
        &mut self,
        record: &AllocationRecord,
        durability: Durability,
    ) -> Result<(), RuntimeError> {
        self.append(&LineOut::Put(record), durability)?;
        self.records.insert(record.id(), record.clone());
        self.maybe_compact();
        Ok(())
    }

    /// Appends a tombstone for `id` and makes it durable. Nothing to do for an id the log
    /// does not hold.
    pub(crate) fn forget(&mut self, id: u64) -> Result<(), RuntimeError> {
        self.forget_with(id, Durability::Synced)
    }

    /// [`Self::forget`], made durable now or with the next synced append.
    pub(crate) fn forget_with(
        &mut self,
        id: u64,
        durability: Durability,
    ) -> Result<(), RuntimeError> {
        if !self.records.contains_key(&id) {
            return Ok(());
        }
        self.append(&LineOut::Forget { id }, durability)?;
        self.records.remove(&id);
        self.maybe_compact();
        Ok(())
    }

    fn append(&mut self, line: &LineOut<'_>, durability: Durability) -> Result<(), RuntimeError> {
        let bytes = encode_line(line);
        let path = self.path.clone();
        let err = |source| RuntimeError::Io {
            action: "append to record log",
            path: path.clone(),
            source,
        };
        if self.dir_unsynced {
            let dir = self.path.parent().unwrap_or(Path::new("."));
            sync_dir(dir).map_err(err)?;
            self.dir_unsynced = false;
        }
        if self.file.is_none() {
            self.reopen().map_err(err)?;
        }
        let Some(file) = self.file.as_mut() else {
            unreachable!("reopened above");
        };
        let written = file.write_all(&bytes).and_then(|()| match durability {
            Durability::Synced => file.sync_data(),
            Durability::WithNextSync => Ok(()),
        });
        match written {
            Ok(()) => {
                self.len += bytes.len() as u64;
                self.lines += 1;
                Ok(())
            }
            Err(e) => {
                // Whatever part of the line reached the file must not stay there: the next
                // append would follow it and turn it into a corrupt line in the middle.
                if file.set_len(self.len).is_err() {
                    self.file = None;
                }
                Err(err(e))
            }
        }
    }

    /// Opens the append descriptor, cutting off anything beyond the last good line (left by
    /// an append that failed and could not be undone then).
    fn reopen(&mut self) -> io::Result<()> {
        self.file = None;
        let file = OpenOptions::new().append(true).open(&self.path)?;
        let len = file.metadata()?.len();
        if len < self.len {
            return Err(io::Error::other(format!(
                "the record log is {len} bytes long, shorter than the {} bytes written to it; \
                 was it changed by something else?",
                self.len
            )));
        }
        if len > self.len {
            file.set_len(self.len)?;
            file.sync_all()?;
        }
        self.file = Some(file);
        Ok(())
    }

    fn maybe_compact(&mut self) {
        let dead = self.lines.saturating_sub(self.records.len());
        if dead <= MIN_DEAD_LINES.max(DEAD_PER_LIVE * self.records.len()) {
            return;
        }
        if let Err(e) = self.compact() {
            // The old log is still whole and in place; appends continue there.
            tracing::warn!(path = %self.path.display(), error = %e, "cannot compact the record log; will retry");
        }
    }

    /// Replaces the log with one holding only the live records (one put each): written to a
    /// temporary file, synced, renamed over the log. The directory sync follows; if it
    /// fails, appends wait for a later one to succeed.
    fn compact(&mut self) -> io::Result<()> {
        let mut bytes = Vec::new();
        for record in self.records.values() {
            bytes.extend_from_slice(&encode_line(&LineOut::Put(record)));
        }
        replace_file(&self.path, &bytes)?;
        // From here on the file at `path` is the new one.
        self.file = None;
        self.len = bytes.len() as u64;
        self.lines = self.records.len();
        let dir = self.path.parent().unwrap_or(Path::new("."));
        self.dir_unsynced = sync_dir(dir).is_err();
        self.reopen()
    }
}

/// Removes the temporary files of compactions interrupted by a crash
/// (`allocations.log.tmp.<pid>`; see `write_atomic_via`). The runtime holds the state-directory
/// lock, so no compaction is in progress.
fn remove_leftover_temporaries(root: &Path) {
    for entry in fs::read_dir(root).into_iter().flatten().flatten() {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.starts_with("allocations.log.tmp."))
            && let Err(e) = fs::remove_file(entry.path())
        {
            tracing::warn!(path = %entry.path().display(), error = %e, "cannot remove a leftover temporary file");
        }
    }
}

/// Creates an empty log file (0600: records hold the job's environment, which may carry
/// tokens) and makes its directory entry durable.
fn create(path: &Path) -> io::Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.sync_all()?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// FNV-1a, 64 bits.
fn checksum(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn encode_line(line: &LineOut<'_>) -> Vec<u8> {
    frame_line(&serde_json::to_vec(line).expect("records always encode as JSON"))
}

/// One line of the log for `json`: its checksum, a space, the JSON and a newline.
pub fn frame_line(json: &[u8]) -> Vec<u8> {
    let mut bytes = format!("{:016x} ", checksum(json)).into_bytes();
    bytes.extend_from_slice(json);
    bytes.push(b'\n');
    bytes
}

/// What replaying a log's bytes gives.
#[derive(Debug)]
struct Replay {
    records: BTreeMap<u64, AllocationRecord>,
    lines: usize,
    /// Bytes up to the end of the last good line.
    good_len: u64,
    /// Why the bytes after `good_len` were dropped (a torn last line), if there are any.
    torn: Option<&'static str>,
}

/// Replays a log. `Err`: a bad line other than the last, or a good line that makes no sense.
fn replay(bytes: &[u8]) -> Result<Replay, String> {
    let mut replay = Replay {
        records: BTreeMap::new(),
        lines: 0,
        good_len: 0,
        torn: None,
    };
    let mut rest = bytes;
    let mut number = 0;
    while !rest.is_empty() {
        number += 1;
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            replay.torn = Some("an incomplete line (no newline)");
            break;
        };
        let line = &rest[..end];
        rest = &rest[end + 1..];
        let json = match checked_json(line) {
            Ok(json) => json,
            Err(why) if rest.is_empty() => {
                tracing::debug!(line = number, why, "last record log line is torn");
                replay.torn = Some("a line that fails its checksum");
                break;
            }
            Err(why) => {
                return Err(format!(
                    "line {number}: {why}; only the last line can be torn by a crash, so the \
                     log is corrupt"
                ));
            }
        };
        let entry: LineIn = serde_json::from_slice(json).map_err(|e| {
            format!("line {number}: the checksum matches but the entry is unreadable: {e}")
        })?;
        match entry {
            LineIn::Put(record) => {
                if record.format != RECORD_FORMAT {
                    return Err(format!(
                        "line {number}: allocation {}'s record has format {}, not the supported \
                         format {RECORD_FORMAT} (written by another node-agent version?)",
                        record.id(),
                        record.format
                    ));
                }
                replay.records.insert(record.id(), *record);
            }
            LineIn::Forget { id } => {
                replay.records.remove(&id);
            }
        }
        replay.lines += 1;
        replay.good_len = (bytes.len() - rest.len()) as u64;
    }
    Ok(replay)
}

/// `<16 hex digits> <json>` with a matching checksum → the JSON.
fn checked_json(line: &[u8]) -> Result<&[u8], &'static str> {
    let (sum, json) = match line.iter().position(|&b| b == b' ') {
        Some(16) => (&line[..16], &line[17..]),
        _ => return Err("not `<checksum> <json>`"),
    };
    let sum = std::str::from_utf8(sum)
        .ok()
        .and_then(|s| u64::from_str_radix(s, 16).ok())
        .ok_or("the checksum is not hexadecimal")?;
    if sum != checksum(json) {
        return Err("the checksum does not match");
    }
    Ok(json)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::runtime::types::LaunchSpec;

    fn record(id: u64, pid: Option<u32>) -> AllocationRecord {
        let spec = LaunchSpec {
            allocation_id: id,
            job_id: 3,
            job_name: "j".to_string(),
            tenant: "t".to_string(),
            command: vec!["sleep".to_string(), "1".to_string()],
            env: BTreeMap::from([("TOKEN".to_string(), "x".to_string())]),
            gpus: vec!["GPU-1".to_string()],
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
        };
        let mut r = AllocationRecord::launching(spec, 1000);
        r.shim_pid = pid;
        r.shim_start_ticks = pid.map(u64::from);
        r
    }

    fn layout() -> (tempfile::TempDir, Layout) {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path().to_path_buf());
        layout.create_dirs().expect("dirs");
        (dir, layout)
    }

    fn open(layout: &Layout) -> (RecordLog, Vec<AllocationRecord>) {
        RecordLog::open(layout).expect("open record log")
    }

    fn ids(records: &[AllocationRecord]) -> Vec<u64> {
        records.iter().map(AllocationRecord::id).collect()
    }

    fn append_raw(layout: &Layout, bytes: &[u8]) {
        let mut file = OpenOptions::new()
            .append(true)
            .open(layout.record_log())
            .expect("open");
        file.write_all(bytes).expect("append");
    }

    fn corrupt_message(err: RuntimeError) -> String {
        match err {
            RuntimeError::CorruptRecord { path, message } => {
                assert!(path.ends_with("allocations.log"), "{}", path.display());
                message
            }
            other => panic!("expected CorruptRecord, got {other}"),
        }
    }

    #[test]
    fn records_round_trip_and_the_last_put_wins() {
        let (_dir, layout) = layout();
        let (mut log, records) = open(&layout);
        assert!(records.is_empty());
        assert!(layout.record_log().exists());
        log.put(&record(2, None)).expect("put");
        log.put(&record(1, Some(10))).expect("put");
        log.put(&record(2, Some(20))).expect("put");
        assert!(log.contains(1) && log.contains(2) && !log.contains(3));
        drop(log);

        let (_log, records) = open(&layout);
        assert_eq!(records, vec![record(1, Some(10)), record(2, Some(20))]);
    }

    #[test]
    fn a_tombstone_removes_the_record() {
        let (_dir, layout) = layout();
        let (mut log, _) = open(&layout);
        log.put(&record(1, Some(10))).expect("put");
        log.put(&record(2, Some(20))).expect("put");
        log.forget(1).expect("forget");
        log.forget(1).expect("forgetting twice is a no-op");
        log.forget(7).expect("forgetting an unknown id is a no-op");
        assert!(!log.contains(1));
        let text = fs::read_to_string(layout.record_log()).expect("read");
        assert_eq!(text.lines().count(), 3, "one tombstone, no more:\n{text}");
        assert!(text.contains(r#"{"forget":{"id":1}}"#), "{text}");
        drop(log);
        let (_log, records) = open(&layout);
        assert_eq!(records, vec![record(2, Some(20))]);
    }

    #[test]
    fn a_partial_last_line_is_cut_off_and_appends_continue_after_it() {
        let (_dir, layout) = layout();
        let (mut log, _) = open(&layout);
        log.put(&record(1, Some(10))).expect("put");
        drop(log);
        let good = fs::metadata(layout.record_log()).expect("stat").len();
        let line = encode_line(&LineOut::Put(&record(2, Some(20))));
        append_raw(&layout, &line[..line.len() / 2]);

        let (mut log, records) = open(&layout);
        assert_eq!(ids(&records), vec![1]);
        assert_eq!(fs::metadata(layout.record_log()).expect("stat").len(), good);
        log.put(&record(3, Some(30))).expect("put");
        drop(log);
        let (_log, records) = open(&layout);
        assert_eq!(ids(&records), vec![1, 3]);
    }

    #[test]
    fn a_last_line_failing_its_checksum_is_cut_off() {
        let (_dir, layout) = layout();
        let (mut log, _) = open(&layout);
        log.put(&record(1, Some(10))).expect("put");
        drop(log);
        let good = fs::metadata(layout.record_log()).expect("stat").len();
        // A whole line whose JSON lost a byte (as if a block came back stale).
        let mut line = encode_line(&LineOut::Put(&record(2, Some(20))));
        line.remove(40);
        append_raw(&layout, &line);

        let (mut log, records) = open(&layout);
        assert_eq!(ids(&records), vec![1]);
        assert_eq!(fs::metadata(layout.record_log()).expect("stat").len(), good);
        log.put(&record(2, Some(21))).expect("put");
        drop(log);
        let (_log, records) = open(&layout);
        assert_eq!(records, vec![record(1, Some(10)), record(2, Some(21))]);
    }

    #[test]
    fn a_bad_line_before_the_last_fails_the_load() {
        let (_dir, layout) = layout();
        let (mut log, _) = open(&layout);
        log.put(&record(1, Some(10))).expect("put");
        log.put(&record(2, Some(20))).expect("put");
        log.put(&record(3, Some(30))).expect("put");
        drop(log);
        let text = fs::read_to_string(layout.record_log()).expect("read");
        let broken = text.replacen(r#""shim_pid":20"#, r#""shim_pid":21"#, 1);
        assert_ne!(broken, text);
        fs::write(layout.record_log(), &broken).expect("write");

        let message = corrupt_message(RecordLog::open(&layout).expect_err("corrupt"));
        assert!(message.contains("line 2"), "{message}");
        assert!(message.contains("checksum"), "{message}");
        // Nothing was cut off or rewritten: a person has to look at it.
        assert_eq!(
            fs::read_to_string(layout.record_log()).expect("read"),
            broken
        );
    }

    #[test]
    fn a_record_of_an_unknown_format_fails_the_load() {
        let (_dir, layout) = layout();
        let mut r = record(1, Some(10));
        r.format = 99;
        create(&layout.record_log()).expect("create");
        append_raw(&layout, &encode_line(&LineOut::Put(&r)));
        let message = corrupt_message(RecordLog::open(&layout).expect_err("unknown format"));
        assert!(message.contains("format 99"), "{message}");
    }

    #[test]
    fn compaction_keeps_exactly_the_live_records_and_shrinks_the_file() {
        let (_dir, layout) = layout();
        let (mut log, _) = open(&layout);
        let (mut biggest, mut last, mut compactions) = (0, 0, 0);
        // Three puts and a forget per allocation, as a job costs; every fifth one stays.
        for id in 0..600u64 {
            log.put(&record(id, None)).expect("put");
            log.put(&record(id, Some(10))).expect("put");
            let mut exited = record(id, Some(10));
            exited.exit = Some(crate::runtime::record::RecordedExit {
                kind: crate::runtime::types::ExitKind::Exited { code: 0 },
                at_ms: 5,
                usage: None,
            });
            log.put(&exited).expect("put");
            if id % 5 != 0 {
                log.forget(id).expect("forget");
            }
            let size = fs::metadata(layout.record_log()).expect("stat").len();
            if size < last {
                compactions += 1;
            }
            (biggest, last) = (biggest.max(size), size);
            assert!(
                log.lines - log.records.len() <= MIN_DEAD_LINES.max(4 * log.records.len()),
                "compaction keeps the dead lines bounded"
            );
        }
        assert!(compactions >= 2, "{compactions} compactions");
        let expected: Vec<u64> = (0..600).filter(|id| id % 5 == 0).collect();
        assert_eq!(log.records.keys().copied().collect::<Vec<_>>(), expected);
        drop(log);

        // Open compacts too: one line per live record.
        let (log, records) = open(&layout);
        assert_eq!(ids(&records), expected);
        let now = fs::metadata(layout.record_log()).expect("stat").len();
        assert!(
            now < biggest / 4,
            "compacted: {now} bytes, was up to {biggest}"
        );
        assert!(records.iter().all(|r| r.exit.is_some()));
        let text = fs::read_to_string(layout.record_log()).expect("read");
        assert_eq!(text.lines().count(), expected.len());
        assert_eq!(log.lines, expected.len());
        // No temporary files left behind, nor kept from a compaction a crash interrupted.
        drop(log);
        fs::write(layout.root().join("allocations.log.tmp.99999"), "x").expect("write");
        let (_log, _) = open(&layout);
        let names: Vec<String> = fs::read_dir(layout.root())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("allocations.log"))
            .collect();
        assert_eq!(names, vec!["allocations.log".to_string()]);
    }

    fn write_legacy(layout: &Layout, record: &AllocationRecord) {
        fs::create_dir_all(layout.legacy_records_dir()).expect("mkdir");
        fs::write(
            layout.legacy_record(record.id()),
            serde_json::to_vec_pretty(record).expect("encode"),
        )
        .expect("write");
    }

    #[test]
    fn per_file_records_move_into_the_log() {
        let (_dir, layout) = layout();
        write_legacy(&layout, &record(4, Some(40)));
        write_legacy(&layout, &record(5, None));
        // The shim's exit file of a running allocation stays where its shim writes it.
        fs::write(layout.legacy_exit_file(4), "{}").expect("write");

        let (mut log, records) = open(&layout);
        assert_eq!(records, vec![record(4, Some(40)), record(5, None)]);
        assert!(!layout.legacy_record(4).exists());
        assert!(!layout.legacy_record(5).exists());
        assert!(layout.legacy_exit_file(4).exists());
        log.forget(5).expect("forget");
        drop(log);
        let (_log, records) = open(&layout);
        assert_eq!(records, vec![record(4, Some(40))]);
    }

    #[test]
    fn an_upgrade_interrupted_before_deleting_the_old_files_keeps_the_newer_record() {
        let (_dir, layout) = layout();
        let (mut log, _) = open(&layout);
        log.put(&record(4, Some(41))).expect("put");
        drop(log);
        write_legacy(&layout, &record(4, Some(40)));
        let (_log, records) = open(&layout);
        assert_eq!(records, vec![record(4, Some(41))]);
        assert!(!layout.legacy_record(4).exists());
    }

    #[test]
    fn a_corrupt_per_file_record_fails_the_load_and_is_kept() {
        let (_dir, layout) = layout();
        write_legacy(&layout, &record(4, Some(40)));
        fs::write(layout.legacy_record(6), "{not json").expect("write");
        let err = RecordLog::open(&layout).expect_err("corrupt legacy record");
        match &err {
            RuntimeError::CorruptRecord { path, .. } => {
                assert_eq!(path, &layout.legacy_record(6));
            }
            other => panic!("expected CorruptRecord, got {other}"),
        }
        assert!(layout.legacy_record(4).exists() && layout.legacy_record(6).exists());
    }
}
