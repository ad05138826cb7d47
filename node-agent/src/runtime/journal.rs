//! The GPU usage journal: one JSON line per allocation start and observed exit, appended to
//! `state_dir/gpu-usage.jsonl`, and the checker that proves from it that no GPU was used by
//! two allocations at once on this host, beyond what shares of a GPU allow (invariant 1;
//! the rule is `ledger.rs`'s). Tests and chaos runs read it; the runtime never reads it back,
//! so a damaged journal cannot affect scheduling.
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

use super::ledger::{GpuLedger, MILLI_PER_GPU};
use super::types::{GpuShare, RuntimeError};

/// One journal line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum UsageRecord {
    /// `{"event":"start","allocation":ID,"job":ID,"gpus":[...],"pid":P,"at_ms":T}`: written
    /// before the command is released to run. A share adds
    /// `"share":{"milli":M,"memory_mib":MIB,"gpu_memory_mib":MIB}`, MIG slices add
    /// `"mig_parents":{"MIG-...":"GPU-..."}`; lines without them (older agents, exclusive
    /// GPUs) read as whole-GPU uses.
    Start {
        allocation: u64,
        job: u64,
        gpus: Vec<String>,
        /// The shim's pid, which is also the process group id of the allocation.
        pid: u32,
        at_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        share: Option<GpuShare>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        mig_parents: BTreeMap<String, String>,
    },
    /// `{"event":"stop","allocation":ID,"gpus":[...],"at_ms":T}`: written when the runtime
    /// has observed the exit and killed what was left of the process group.
    Stop {
        allocation: u64,
        gpus: Vec<String>,
        at_ms: u64,
        /// When the workload really ended, from the shim's exit file, where it differs from
        /// `at_ms` (the agent was down when it ended, or the shim fenced it itself). `at_ms`
        /// stays the conservative end for the GPU ledger; the chaos checker uses this one to
        /// tell a fenced copy from a second running copy of a job on another node.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exited_at_ms: Option<u64>,
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

/// Verifies that no GPU was used by two allocations at overlapping times, beyond what shares
/// allow: replaying the records in order, each `start` must be allowed by the uses still
/// running (`ledger.rs`: a whole GPU or MIG slice is one allocation's alone, a MIG slice never
/// overlaps a whole-GPU use of its parent, shares of one GPU overlap only with shares and
/// within 1000 milli and the GPU's memory), and an allocation must not start again while it
/// runs (a second copy). Records of several hosts may be concatenated (GPU UUIDs are globally
/// unique, so each GPU's history comes from one host, in that host's order). `Err` describes
/// the first violation.
pub fn check_no_overlap(records: &[UsageRecord]) -> Result<(), String> {
    let mut ledger = GpuLedger::default();
    let mut running: BTreeSet<u64> = BTreeSet::new();
    for (index, record) in records.iter().enumerate() {
        let line = index + 1;
        match record {
            UsageRecord::Start {
                allocation,
                gpus,
                at_ms,
                share,
                mig_parents,
                ..
            } => {
                if !running.insert(*allocation) {
                    return Err(format!(
                        "record {line}: allocation {allocation} started at {at_ms} ms while an \
                         earlier start of it had no stop (two copies)"
                    ));
                }
                let mut seen = BTreeSet::new();
                for gpu in gpus {
                    if !seen.insert(gpu.as_str()) {
                        return Err(format!(
                            "record {line}: allocation {allocation} lists GPU {gpu} twice"
                        ));
                    }
                }
                if let Some(share) = share {
                    if gpus.len() != 1 || !mig_parents.is_empty() {
                        return Err(format!(
                            "record {line}: allocation {allocation} is a share but uses \
                             {gpus:?} (a share uses exactly one whole GPU)"
                        ));
                    }
                    if share.milli == 0 || share.milli > MILLI_PER_GPU {
                        return Err(format!(
                            "record {line}: allocation {allocation} is a share of {} milli",
                            share.milli
                        ));
                    }
                }
                ledger
                    .claim(*allocation, *at_ms, gpus, share.as_ref(), mig_parents)
                    .map_err(|c| {
                        format!(
                            "record {line}: GPU {} used by allocation {allocation} from \
                             {at_ms} ms while allocation {} used it: {}",
                            c.gpu,
                            c.holders
                                .iter()
                                .map(u64::to_string)
                                .collect::<Vec<_>>()
                                .join(", allocation "),
                            c.reason
                        )
                    })?;
            }
            UsageRecord::Stop { allocation, .. } => {
                // The uses the start recorded end; a stop of an allocation that does not run
                // (written twice after a crash, or of another host) changes nothing.
                if running.remove(allocation) {
                    ledger.release(*allocation);
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
        start_of(allocation, gpus, at_ms, None, BTreeMap::new())
    }

    fn start_of(
        allocation: u64,
        gpus: &[&str],
        at_ms: u64,
        share: Option<GpuShare>,
        mig_parents: BTreeMap<String, String>,
    ) -> UsageRecord {
        UsageRecord::Start {
            allocation,
            job: allocation * 10,
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            pid: 100,
            at_ms,
            share,
            mig_parents,
        }
    }

    /// GPU memory of the GPUs in these tests, MiB.
    const GPU_MIB: u64 = 80_000;

    /// A share of `milli` and `memory_mib` of `gpu` (whose memory is [`GPU_MIB`]).
    fn share(allocation: u64, gpu: &str, milli: u32, memory_mib: u64, at_ms: u64) -> UsageRecord {
        share_of(allocation, &[gpu], milli, memory_mib, at_ms)
    }

    fn share_of(
        allocation: u64,
        gpus: &[&str],
        milli: u32,
        memory_mib: u64,
        at_ms: u64,
    ) -> UsageRecord {
        let share = GpuShare {
            milli,
            memory_mib,
            gpu_memory_mib: GPU_MIB,
        };
        start_of(allocation, gpus, at_ms, Some(share), BTreeMap::new())
    }

    /// A start on MIG slices `(slice, parent)`.
    fn slices(allocation: u64, slices: &[(&str, &str)], at_ms: u64) -> UsageRecord {
        let gpus: Vec<&str> = slices.iter().map(|(s, _)| *s).collect();
        let parents = slices
            .iter()
            .map(|(s, p)| (s.to_string(), p.to_string()))
            .collect();
        start_of(allocation, &gpus, at_ms, None, parents)
    }

    fn stop(allocation: u64, gpus: &[&str], at_ms: u64) -> UsageRecord {
        UsageRecord::Stop {
            allocation,
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            at_ms,
            exited_at_ms: None,
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

    /// (what, history, Ok or the words the error must contain)
    type Case = (
        &'static str,
        Vec<UsageRecord>,
        Result<(), &'static [&'static str]>,
    );

    #[test]
    fn shares_slices_and_whole_gpus() {
        let g = "GPU-a";
        let cases: Vec<Case> = vec![
            (
                "four shares of 250 milli at once",
                vec![
                    share(1, g, 250, 20_000, 1),
                    share(2, g, 250, 20_000, 2),
                    share(3, g, 250, 20_000, 3),
                    share(4, g, 250, 20_000, 4),
                ],
                Ok(()),
            ),
            (
                "600 + 400 milli is exactly one GPU",
                vec![share(1, g, 600, 100, 1), share(2, g, 400, 100, 2)],
                Ok(()),
            ),
            (
                "a fifth share of 250 milli",
                vec![
                    share(1, g, 250, 100, 1),
                    share(2, g, 250, 100, 2),
                    share(3, g, 250, 100, 3),
                    share(4, g, 250, 100, 4),
                    share(5, g, 250, 100, 5),
                ],
                Err(&["record 5", "allocation 5", "1000 milli", "allocation 1"]),
            ),
            (
                "600 + 500 milli",
                vec![share(1, g, 600, 100, 1), share(2, g, 500, 100, 2)],
                Err(&[
                    "GPU-a",
                    "allocation 2",
                    "allocation 1",
                    "600 of its 1000 milli",
                ]),
            ),
            (
                "shares whose memory exceeds the GPU's",
                vec![share(1, g, 300, 50_000, 1), share(2, g, 300, 30_001, 2)],
                Err(&["GPU-a", "50000 MiB", "80000 MiB"]),
            ),
            (
                "shares whose memory fills the GPU exactly",
                vec![share(1, g, 300, 50_000, 1), share(2, g, 300, 30_000, 2)],
                Ok(()),
            ),
            (
                "a share on a GPU used whole",
                vec![start(1, &[g], 1), share(2, g, 100, 100, 2)],
                Err(&["GPU-a", "allocation 2", "allocation 1"]),
            ),
            (
                "a whole-GPU use of a shared GPU",
                vec![share(1, g, 100, 100, 1), start(2, &["GPU-b", g], 2)],
                Err(&["GPU-a", "allocation 2", "allocation 1", "shared"]),
            ),
            (
                "shares of two GPUs do not add up",
                vec![share(1, g, 600, 100, 1), share(2, "GPU-b", 600, 100, 2)],
                Ok(()),
            ),
            (
                "sequential uses: whole, shares, whole again",
                vec![
                    start(1, &[g], 1),
                    stop(1, &[g], 2),
                    share(2, g, 600, 100, 2),
                    share(3, g, 400, 100, 3),
                    stop(2, &[g], 4),
                    // 400 still held: 500 more fit now that the 600 ended.
                    share(4, g, 500, 100, 5),
                    stop(3, &[g], 6),
                    stop(4, &[g], 7),
                    start(5, &[g], 8),
                ],
                Ok(()),
            ),
            (
                "600, then 500 after the 600 ended",
                vec![
                    share(1, g, 600, 100, 1),
                    stop(1, &[g], 2),
                    share(2, g, 500, 100, 3),
                ],
                Ok(()),
            ),
            (
                "a stop of an allocation that is not running frees no share",
                vec![
                    share(1, g, 600, 100, 1),
                    stop(9, &[g], 2),
                    share(2, g, 500, 100, 3),
                ],
                Err(&["allocation 1"]),
            ),
            (
                "a whole GPU before every share ended",
                vec![
                    share(1, g, 300, 100, 1),
                    share(2, g, 300, 100, 2),
                    stop(1, &[g], 3),
                    start(3, &[g], 4),
                ],
                Err(&["allocation 3", "allocation 2"]),
            ),
            (
                "two MIG slices of one GPU at once",
                vec![
                    slices(1, &[("MIG-1", "GPU-m")], 1),
                    slices(2, &[("MIG-2", "GPU-m")], 2),
                    slices(3, &[("MIG-3", "GPU-m"), ("MIG-4", "GPU-m")], 3),
                ],
                Ok(()),
            ),
            (
                "one MIG slice twice",
                vec![
                    slices(1, &[("MIG-1", "GPU-m")], 1),
                    slices(2, &[("MIG-1", "GPU-m")], 2),
                ],
                Err(&["MIG-1", "allocation 2", "allocation 1"]),
            ),
            (
                "a MIG slice of a GPU used whole",
                vec![start(1, &["GPU-m"], 1), slices(2, &[("MIG-1", "GPU-m")], 2)],
                Err(&["MIG-1", "GPU-m", "allocation 1"]),
            ),
            (
                "a whole-GPU use of a GPU with a MIG slice in use",
                vec![slices(1, &[("MIG-1", "GPU-m")], 1), start(2, &["GPU-m"], 2)],
                Err(&["GPU-m", "allocation 1", "MIG-1"]),
            ),
            (
                "a share of a GPU with a MIG slice in use",
                vec![
                    slices(1, &[("MIG-1", "GPU-m")], 1),
                    share(2, "GPU-m", 100, 100, 2),
                ],
                Err(&["GPU-m", "allocation 1"]),
            ),
            (
                "a MIG slice of a shared GPU",
                vec![
                    share(1, "GPU-m", 100, 100, 1),
                    slices(2, &[("MIG-1", "GPU-m")], 2),
                ],
                Err(&["MIG-1", "GPU-m", "allocation 1"]),
            ),
            (
                "a MIG slice used as a whole GPU by a record that lacks its parent",
                vec![slices(1, &[("MIG-1", "GPU-m")], 1), start(2, &["MIG-1"], 2)],
                Err(&["MIG-1", "allocation 1"]),
            ),
            (
                "slices after the whole GPU ended, and the whole GPU after the slices",
                vec![
                    start(1, &["GPU-m"], 1),
                    stop(1, &["GPU-m"], 2),
                    slices(2, &[("MIG-1", "GPU-m"), ("MIG-2", "GPU-m")], 3),
                    slices(3, &[("MIG-3", "GPU-m")], 3),
                    stop(2, &["MIG-1", "MIG-2"], 4),
                    stop(3, &["MIG-3"], 5),
                    start(4, &["GPU-m"], 6),
                ],
                Ok(()),
            ),
            (
                "a share naming two GPUs",
                vec![share_of(1, &["GPU-a", "GPU-b"], 100, 100, 1)],
                Err(&["share", "exactly one"]),
            ),
            (
                "a share of 0 milli",
                vec![share(1, g, 0, 100, 1)],
                Err(&["0 milli"]),
            ),
            (
                "a share of more than a GPU",
                vec![share(1, g, 1001, 100, 1)],
                Err(&["1001 milli"]),
            ),
        ];
        for (what, history, want) in cases {
            match (check_no_overlap(&history), want) {
                (Ok(()), Ok(())) => {}
                (Err(err), Err(words)) => {
                    for word in words {
                        assert!(err.contains(word), "{what}: `{err}` lacks `{word}`");
                    }
                }
                (got, want) => panic!("{what}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn share_and_slice_lines_round_trip_and_old_lines_read_as_whole_gpus() {
        let json = serde_json::to_string(&share(1, "GPU-a", 250, 20_389, 5)).expect("encode");
        assert_eq!(
            json,
            r#"{"event":"start","allocation":1,"job":10,"gpus":["GPU-a"],"pid":100,"at_ms":5,"share":{"milli":250,"memory_mib":20389,"gpu_memory_mib":80000}}"#
        );
        let json = serde_json::to_string(&slices(2, &[("MIG-1", "GPU-m")], 5)).expect("encode");
        assert_eq!(
            json,
            r#"{"event":"start","allocation":2,"job":20,"gpus":["MIG-1"],"pid":100,"at_ms":5,"mig_parents":{"MIG-1":"GPU-m"}}"#
        );
        for record in [
            share(1, "GPU-a", 250, 20_389, 5),
            slices(2, &[("MIG-1", "GPU-m")], 5),
        ] {
            let json = serde_json::to_string(&record).expect("encode");
            assert_eq!(
                serde_json::from_str::<UsageRecord>(&json).expect("decode"),
                record
            );
        }
        let old =
            r#"{"event":"start","allocation":1,"job":10,"gpus":["GPU-a"],"pid":100,"at_ms":5}"#;
        assert_eq!(
            serde_json::from_str::<UsageRecord>(old).expect("decode"),
            start(1, &["GPU-a"], 5)
        );
    }

    /// One use in a generated history: what the reference rule below needs to know.
    #[derive(Debug, Clone)]
    enum Use {
        Whole(Vec<&'static str>),
        Share(&'static str, u32, u64),
        Slices(Vec<(&'static str, &'static str)>),
    }

    /// The overlap rule stated directly over the uses that run when a start comes, pair by
    /// pair and sum by sum, without the ledger: the model `check_no_overlap` must agree with.
    fn reference_allows(running: &[(u64, Use)], allocation: u64, new: &Use) -> bool {
        if running.iter().any(|(a, _)| *a == allocation) {
            return false;
        }
        // (device UUID, physical GPU, kind) of every device a use names.
        #[derive(PartialEq)]
        enum Kind {
            Whole,
            Share,
            Slice,
        }
        let devices = |u: &Use| -> Vec<(&'static str, &'static str, Kind)> {
            match u {
                Use::Whole(gpus) => gpus.iter().map(|g| (*g, *g, Kind::Whole)).collect(),
                Use::Share(g, _, _) => vec![(*g, *g, Kind::Share)],
                Use::Slices(s) => s.iter().map(|(s, p)| (*s, *p, Kind::Slice)).collect(),
            }
        };
        let mine = devices(new);
        for (i, (d, _, _)) in mine.iter().enumerate() {
            if mine[..i].iter().any(|(e, _, _)| e == d) {
                return false;
            }
        }
        for (_, other) in running {
            for (d, dp, dk) in &mine {
                for (e, ep, ek) in devices(other) {
                    let conflict = if *d == e {
                        !(*dk == Kind::Share && ek == Kind::Share)
                    } else if *dp == ep || *d == ep || e == *dp {
                        // Different devices of one physical GPU: only slices coexist.
                        !(*dk == Kind::Slice && ek == Kind::Slice)
                    } else {
                        false
                    };
                    if conflict {
                        return false;
                    }
                }
            }
        }
        if let Use::Share(g, milli, memory) = new {
            let (mut m, mut mem) = (*milli, *memory);
            for (_, other) in running {
                if let Use::Share(h, milli, memory) = other
                    && h == g
                {
                    m += milli;
                    mem += memory;
                }
            }
            if m > MILLI_PER_GPU || mem > GPU_MIB {
                return false;
            }
        }
        true
    }

    fn record_of(allocation: u64, u: &Use) -> UsageRecord {
        match u {
            Use::Whole(gpus) => start(allocation, gpus, allocation),
            Use::Share(g, milli, memory) => share(allocation, g, *milli, *memory, allocation),
            Use::Slices(s) => slices(allocation, s, allocation),
        }
    }

    fn a_use() -> impl proptest::strategy::Strategy<Value = Use> {
        use proptest::prelude::*;
        // GPU-0 has MIG slices MIG-0a and MIG-0b; GPU-1 is only ever used whole or shared.
        let gpu = prop_oneof![Just("GPU-0"), Just("GPU-1")];
        prop_oneof![
            proptest::sample::subsequence(vec!["GPU-0", "GPU-1"], 1..=2).prop_map(Use::Whole),
            (
                gpu,
                proptest::sample::select(vec![100u32, 250, 400, 500, 600, 750, 999]),
                proptest::sample::select(vec![10_000u64, 20_000, 40_000, 60_000]),
            )
                .prop_map(|(g, m, mem)| Use::Share(g, m, mem)),
            proptest::sample::subsequence(vec![("MIG-0a", "GPU-0"), ("MIG-0b", "GPU-0")], 1..=2)
                .prop_map(Use::Slices),
        ]
    }

    proptest::proptest! {
        /// Random histories of starts and stops over two GPUs, one of them with MIG slices:
        /// the checker accepts exactly the histories the reference rule allows.
        #[test]
        fn the_checker_agrees_with_the_rule_stated_pairwise(
            steps in proptest::collection::vec((a_use(), 0u8..3), 1..16)
        ) {
            let mut records = Vec::new();
            let mut running: Vec<(u64, Use)> = Vec::new();
            let mut allowed = true;
            for (i, (u, action)) in steps.into_iter().enumerate() {
                // Stop the oldest running allocation one time in three, else start a new one.
                if action == 0 && !running.is_empty() {
                    let (a, _) = running.remove(0);
                    records.push(stop(a, &[], 0));
                    continue;
                }
                let allocation = i as u64 + 1;
                if !reference_allows(&running, allocation, &u) {
                    allowed = false;
                }
                records.push(record_of(allocation, &u));
                running.push((allocation, u));
                if !allowed {
                    break;
                }
            }
            let got = check_no_overlap(&records);
            proptest::prop_assert_eq!(got.is_ok(), allowed, "{:?}\n{:#?}", got, records);
        }
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
