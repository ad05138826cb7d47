//! The GPU usage journal: one JSON line per allocation start and observed exit, appended to
//! `state_dir/gpu-usage.jsonl`, and the checker that proves from it that no GPU was used by
//! two allocations at once on this host (invariant 1). Tests and chaos runs read it; the
//! runtime never reads it back, so a damaged journal cannot affect scheduling.
//!
//! Lines are written in the order the runtime did things (one runtime per state directory,
//! all operations through `&mut self`), and a `start` is written before the command is
//! released and a `stop` only after the process group is gone. So the order of lines is a
//! conservative history: a real overlap always shows as one. Lines are not fsynced; after a
//! power loss the tail may be missing, which the checker tolerates (a missing `stop` reads
//! as "still running"; a repeated `stop`, written again after a crash, is ignored).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::types::RuntimeError;

/// One journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum UsageRecord {
    /// `{"event":"start","allocation":ID,"job":ID,"gpus":[...],"pid":P,"at_ms":T}`: written
    /// before the command is released to run.
    Start {
        allocation: u64,
        job: u64,
        gpus: Vec<String>,
        /// The shim's pid, which is also the process group id of the allocation.
        pid: u32,
        at_ms: u64,
    },
    /// `{"event":"stop","allocation":ID,"gpus":[...],"at_ms":T}`: written when the runtime
    /// has observed the exit and killed what was left of the process group.
    Stop {
        allocation: u64,
        gpus: Vec<String>,
        at_ms: u64,
    },
}

/// Appends one line. A single `write` of the whole line, so concurrent readers and an
/// interrupted agent never leave half a line in the middle of the file (at worst at the end).
pub(crate) fn append_usage(path: &Path, record: &UsageRecord) -> Result<(), RuntimeError> {
    let io_err = |source: io::Error| RuntimeError::Io {
        action: "append to GPU usage journal",
        path: path.to_path_buf(),
        source,
    };
    let mut line = serde_json::to_vec(record).map_err(|e| io_err(io::Error::other(e)))?;
    line.push(b'\n');
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io_err)?;
    file.write_all(&line).map_err(io_err)
}

/// Reads a journal. A final line without its newline is an append cut short by a crash and
/// is skipped if it does not parse; any other unreadable line is an error with its number.
pub fn read_usage_journal(path: &Path) -> Result<Vec<UsageRecord>, RuntimeError> {
    let text = fs::read_to_string(path).map_err(|source| RuntimeError::Io {
        action: "read GPU usage journal",
        path: path.to_path_buf(),
        source,
    })?;
    let complete = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut records = Vec::with_capacity(lines.len());
    for (index, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(record) => records.push(record),
            Err(_) if !complete && index + 1 == lines.len() => {}
            Err(e) => {
                return Err(RuntimeError::Journal {
                    path: path.to_path_buf(),
                    line: index + 1,
                    message: e.to_string(),
                });
            }
        }
    }
    Ok(records)
}

/// Verifies that no GPU is held by two allocations at overlapping times: replaying the
/// records in order, a `start` must find each of its GPUs free (or held by nobody else), and
/// an allocation must not start again while it runs (a second copy). Records of several hosts
/// may be concatenated (GPU UUIDs are globally unique, so each GPU's history comes from one
/// host, in that host's order). `Err` describes the first violation.
pub fn check_no_overlap(records: &[UsageRecord]) -> Result<(), String> {
    // GPU → (allocation, start time) of its current holder.
    let mut holders: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut running: BTreeSet<u64> = BTreeSet::new();
    for (index, record) in records.iter().enumerate() {
        match record {
            UsageRecord::Start {
                allocation,
                gpus,
                at_ms,
                ..
            } => {
                if !running.insert(*allocation) {
                    return Err(format!(
                        "record {}: allocation {allocation} started at {at_ms} ms while an \
                         earlier start of it had no stop (two copies)",
                        index + 1
                    ));
                }
                let mut seen = BTreeSet::new();
                for gpu in gpus {
                    if !seen.insert(gpu.as_str()) {
                        return Err(format!(
                            "record {}: allocation {allocation} lists GPU {gpu} twice",
                            index + 1
                        ));
                    }
                    if let Some((holder, since)) = holders.get(gpu.as_str()) {
                        return Err(format!(
                            "record {}: GPU {gpu} used by allocation {allocation} from {at_ms} \
                             ms while allocation {holder} held it (since {since} ms)",
                            index + 1
                        ));
                    }
                    holders.insert(gpu, (*allocation, *at_ms));
                }
            }
            UsageRecord::Stop {
                allocation, gpus, ..
            } => {
                running.remove(allocation);
                for gpu in gpus {
                    if holders.get(gpu.as_str()).map(|(a, _)| a) == Some(allocation) {
                        holders.remove(gpu.as_str());
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(allocation: u64, gpus: &[&str], at_ms: u64) -> UsageRecord {
        UsageRecord::Start {
            allocation,
            job: allocation * 10,
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            pid: 100,
            at_ms,
        }
    }

    fn stop(allocation: u64, gpus: &[&str], at_ms: u64) -> UsageRecord {
        UsageRecord::Stop {
            allocation,
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            at_ms,
        }
    }

    #[test]
    fn line_format_matches_the_documented_one() {
        let json = serde_json::to_string(&start(1, &["GPU-a"], 5)).expect("encode");
        assert_eq!(
            json,
            r#"{"event":"start","allocation":1,"job":10,"gpus":["GPU-a"],"pid":100,"at_ms":5}"#
        );
        let json = serde_json::to_string(&stop(1, &["GPU-a"], 6)).expect("encode");
        assert_eq!(
            json,
            r#"{"event":"stop","allocation":1,"gpus":["GPU-a"],"at_ms":6}"#
        );
    }

    #[test]
    fn accepts_a_clean_history() {
        let history = vec![
            start(1, &["GPU-a", "GPU-b"], 1),
            start(2, &["GPU-c"], 2),
            stop(1, &["GPU-a", "GPU-b"], 3),
            start(3, &["GPU-a"], 3),
            // A stop written twice (agent crashed after journaling it) is harmless.
            stop(1, &["GPU-a", "GPU-b"], 4),
            start(4, &["GPU-b"], 5),
            stop(2, &["GPU-c"], 6),
        ];
        assert_eq!(check_no_overlap(&history), Ok(()));
        assert_eq!(check_no_overlap(&[]), Ok(()));
    }

    #[test]
    fn finds_an_overlap() {
        let history = vec![
            start(1, &["GPU-a", "GPU-b"], 1),
            start(2, &["GPU-c", "GPU-b"], 2),
        ];
        let err = check_no_overlap(&history).expect_err("overlap");
        assert!(
            err.contains("GPU-b") && err.contains("allocation 1"),
            "{err}"
        );
    }

    #[test]
    fn a_stop_of_another_allocation_does_not_free_the_gpu() {
        let history = vec![
            start(1, &["GPU-a"], 1),
            stop(9, &["GPU-a"], 2),
            start(2, &["GPU-a"], 3),
        ];
        assert!(check_no_overlap(&history).is_err());
    }

    #[test]
    fn finds_a_second_copy_of_an_allocation() {
        let history = vec![start(1, &[], 1), start(1, &[], 2)];
        assert!(check_no_overlap(&history).is_err());
    }

    #[test]
    fn journal_file_round_trips_and_tolerates_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("gpu-usage.jsonl");
        append_usage(&path, &start(1, &["GPU-a"], 1)).expect("append");
        append_usage(&path, &stop(1, &["GPU-a"], 2)).expect("append");
        assert_eq!(
            read_usage_journal(&path).expect("read"),
            vec![start(1, &["GPU-a"], 1), stop(1, &["GPU-a"], 2)]
        );
        let mut file = OpenOptions::new().append(true).open(&path).expect("open");
        file.write_all(br#"{"event":"start","alloc"#)
            .expect("write");
        assert_eq!(read_usage_journal(&path).expect("read").len(), 2);

        fs::write(&path, "{\"event\":\"bogus\"}\n").expect("write");
        let err = read_usage_journal(&path).expect_err("bad line");
        assert!(
            matches!(err, RuntimeError::Journal { line: 1, .. }),
            "{err}"
        );
    }
}
