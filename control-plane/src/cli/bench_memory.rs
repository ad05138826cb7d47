//! `gpuctl bench memory`: the memory of a replica's state machine holding a large fleet and a
//! long history of jobs, with finished jobs compacted by the default retention (and, with
//! `--also-uncompacted`, without compaction, to show what it saves).
//!
//! What is measured, per case, in two fresh child processes (this binary again, so nothing of
//! the parent or of the other case is counted):
//! 1. `build`: opens a replica data directory (`DataDir`, sled) and its `StateMachineStore`,
//!    and applies, as Raft entries through `RaftStateMachine::apply`, the commands a leader
//!    would have committed: registration of every host, then waves of jobs that are submitted
//!    (with idempotency keys), placed in batched plans, started, and exited (95% succeed),
//!    the leader's `CompactJobs` whenever compaction is due (checked every minute of leader
//!    time, as the leader does). The last wave stays running, so the fleet ends full. Then it
//!    builds a snapshot with the replica's own `build_snapshot` (serialized and flushed to
//!    sled). It reports VmRSS after applying and VmHWM (the peak, snapshot included), and
//!    the peaks of applying and of building the snapshot apart (`vm_hwm_applying_mib`,
//!    `vm_hwm_snapshot_mib`: VmHWM is reset between them).
//! 2. `load`: opens the same directory as a restarted replica does (`StateMachineStore::open`:
//!    decode the snapshot, rebuild the indexes, check consistency) and reports VmRSS/VmHWM.
//!
//! Not counted: a replica's gRPC server, openraft's in-memory log cache and sled's copy of log
//! entries not yet purged behind a snapshot (bounded by `--snapshot-every`, not by the number
//! of jobs). The scheduler is not run: placements are packed onto free GPUs directly; the
//! scheduler's own memory is per pass, not per job record.

use std::path::{Path, PathBuf};
use std::process::Command as Process;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::{CommittedLeaderId, EntryPayload};
use serde_json::json;

use super::output::table;
use crate::config::Defaults;
use crate::datadir::DataDir;
use crate::raft::state_machine::StateMachineStore;
use crate::raft::{Entry, LogId};
use crate::state::{
    Command, JobId, JobPlacement, JobSpec, NodeSpec, Outcome, Request, TaskOutcome, TaskPlacement,
    Tenant, Timestamp,
};

/// What `gpuctl bench memory` was asked.
pub struct Args {
    pub hosts: usize,
    pub jobs: usize,
    pub also_uncompacted: bool,
    /// Set in the child processes only.
    pub phase: Option<String>,
    pub dir: Option<PathBuf>,
    pub compaction: bool,
}

/// The target for a replica at 10,000 hosts and 1,000,000 job records.
const TARGET_RSS_MIB: f64 = 1024.0;
/// Leader time of the first command (any fixed instant: apply never reads a clock).
pub(super) const START_MS: Timestamp = 1_767_225_600_000;
pub(super) const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 60 * MINUTE_MS;
/// Placements per `Place` entry, as a leader batches a plan.
pub(super) const PLAN_BATCH: usize = 1000;
/// Entries handed to `apply` at once, as openraft hands over committed entries.
const APPLY_BATCH: usize = 256;

/// Runs the benchmark (parent) or one phase of it (child); returns (table, JSON).
pub fn run(args: Args) -> anyhow::Result<(String, serde_json::Value)> {
    match args.phase.as_deref() {
        None => parent(&args),
        Some("build") => {
            let dir = args.dir.context("--phase build needs --dir")?;
            Ok((
                String::new(),
                build(&dir, args.hosts, args.jobs, args.compaction)?,
            ))
        }
        Some("load") => {
            let dir = args.dir.context("--phase load needs --dir")?;
            Ok((String::new(), load(&dir)?))
        }
        Some(other) => bail!("unknown --phase {other:?} (build or load)"),
    }
}

fn parent(args: &Args) -> anyhow::Result<(String, serde_json::Value)> {
    ensure!(args.hosts > 0, "--hosts must be at least 1");
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let mut cases = Vec::new();
    let modes: &[bool] = if args.also_uncompacted {
        &[true, false]
    } else {
        &[true]
    };
    for &compaction in modes {
        let tmp = tempfile::Builder::new()
            .prefix("gpucp-bench-memory-")
            .tempdir()
            .context("creating a temporary data directory")?;
        let dir = tmp.path().join("replica");
        let mut build_args = vec![
            "--phase".to_owned(),
            "build".into(),
            "--dir".into(),
            dir.display().to_string(),
            "--hosts".into(),
            args.hosts.to_string(),
            "--jobs".into(),
            args.jobs.to_string(),
        ];
        if !compaction {
            build_args.push("--no-compaction".into());
        }
        let built = child(&exe, &build_args)?;
        let loaded = child(
            &exe,
            &[
                "--phase".into(),
                "load".into(),
                "--dir".into(),
                dir.display().to_string(),
            ],
        )?;
        let disk = dir_size(&dir)?;
        cases.push(json!({
            "compaction": compaction,
            "build": built,
            "restart": loaded,
            "data_dir_bytes": disk,
        }));
    }
    let gpus = cases[0]["build"]["gpus"].as_u64().unwrap_or(0);
    let worst_peak = cases
        .iter()
        .filter(|c| c["compaction"] == true)
        .flat_map(|c| {
            [
                c["build"]["vm_hwm_mib"].as_f64(),
                c["restart"]["vm_hwm_mib"].as_f64(),
            ]
        })
        .map(|v| v.unwrap_or(f64::NAN))
        .fold(0.0, f64::max);
    let retention = Defaults::job_retention();
    let json = json!({
        "benchmark": "memory",
        "hosts": args.hosts,
        "gpus": gpus,
        "jobs": args.jobs,
        "retention": retention,
        "target_rss_mib": TARGET_RSS_MIB,
        "peak_rss_mib": worst_peak,
        "meets_target": worst_peak <= TARGET_RSS_MIB,
        "cases": cases,
    });
    Ok((text_report(&json), json))
}

fn text_report(j: &serde_json::Value) -> String {
    let mib = |v: &serde_json::Value| format!("{:.0}", v.as_f64().unwrap_or(f64::NAN));
    let rows: Vec<Vec<String>> = j["cases"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let b = &c["build"];
            vec![
                if c["compaction"] == true {
                    "compacted".into()
                } else {
                    "uncompacted".into()
                },
                b["full_records"].to_string(),
                b["archived"].to_string(),
                b["forgotten"].to_string(),
                mib(&b["vm_rss_mib"]),
                mib(&b["vm_hwm_mib"]),
                mib(&c["restart"]["vm_rss_mib"]),
                mib(&c["restart"]["vm_hwm_mib"]),
                format!(
                    "{:.0}",
                    b["snapshot_bytes"].as_f64().unwrap_or(f64::NAN) / (1024.0 * 1024.0)
                ),
                format!("{:.0}", b["apply_seconds"].as_f64().unwrap_or(f64::NAN)),
            ]
        })
        .collect();
    let t = table(
        &[
            "CASE",
            "FULL_RECORDS",
            "ARCHIVED",
            "FORGOTTEN",
            "RSS_MIB",
            "PEAK_MIB",
            "RESTART_RSS_MIB",
            "RESTART_PEAK_MIB",
            "SNAPSHOT_MIB",
            "APPLY_S",
        ],
        &rows,
    );
    format!(
        "state machine of one replica: {} hosts, {} GPUs, {} jobs (target: peak RSS <= {} MiB: {})\n{t}",
        j["hosts"],
        j["gpus"],
        j["jobs"],
        j["target_rss_mib"],
        if j["meets_target"] == true {
            "met"
        } else {
            "NOT met"
        }
    )
}

/// Runs this binary as `bench memory ARGS --output json` and returns its last stdout line.
pub(super) fn child(exe: &Path, args: &[String]) -> anyhow::Result<serde_json::Value> {
    bench_child(exe, "memory", args)
}

/// Runs `gpuctl bench BENCHMARK ARGS -o json` (a measuring phase in a process of its own) and
/// returns the JSON of its last line.
pub(super) fn bench_child(
    exe: &Path,
    benchmark: &str,
    args: &[String],
) -> anyhow::Result<serde_json::Value> {
    let out = Process::new(exe)
        .args(["bench", benchmark])
        .args(args)
        .args(["--output", "json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| {
            format!(
                "running {} bench {benchmark} {}",
                exe.display(),
                args.join(" ")
            )
        })?;
    ensure!(
        out.status.success(),
        "bench {benchmark} {} failed ({})",
        args.join(" "),
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .last()
        .context("the measuring child printed nothing")?;
    serde_json::from_str(last).with_context(|| format!("the measuring child printed {last:?}"))
}

fn dir_size(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// VmRSS and VmHWM of this process, in MiB.
pub(super) fn memory_mib() -> anyhow::Result<(f64, f64)> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let field = |name: &str| -> anyhow::Result<f64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("/proc/self/status has no {name}"))?;
        let kib: f64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("unreadable line {line:?}"))?;
        Ok(kib / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Resets VmHWM to the current RSS (Linux: `clear_refs` 5), so that a later VmHWM is the peak
/// of what follows. Returns whether it was reset.
pub(super) fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Applies entries to the real state machine, as openraft does with committed entries.
pub(super) struct Applier {
    pub(super) sm: StateMachineStore,
    pub(super) runtime: tokio::runtime::Runtime,
    index: u64,
    pending: Vec<Entry>,
    pub(super) entries: u64,
}

impl Applier {
    /// A fresh replica data directory (replica 1 of cluster `bench-memory`, what
    /// `bench_membership::write_backup` reads) and its state machine.
    pub(super) fn create(dir: &Path) -> anyhow::Result<Self> {
        let data_dir = DataDir::open(dir, "bench-memory", 1)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("opening the replica data directory")?;
        let sm = StateMachineStore::open(&data_dir.db).map_err(|e| anyhow::anyhow!(e))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Applier {
            sm,
            runtime,
            index: 0,
            pending: Vec::new(),
            entries: 0,
        })
    }

    pub(super) fn push(&mut self, at: Timestamp, command: Command) -> anyhow::Result<()> {
        self.index += 1;
        self.pending.push(Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), self.index),
            payload: EntryPayload::Normal(Request::new(at, command).into()),
        });
        if self.pending.len() >= APPLY_BATCH {
            self.flush()?;
        }
        Ok(())
    }

    /// Eight tenants (`t0`..`t7`, an eighth of the GPUs each as quota) and the hosts of
    /// `fleet(hosts)`, registered; returns the hosts.
    pub(super) fn register_fleet(
        &mut self,
        at: Timestamp,
        hosts: usize,
    ) -> anyhow::Result<Vec<NodeSpec>> {
        let nodes = fleet(hosts)?;
        let gpus: usize = nodes.iter().map(|n| n.gpus.len()).sum();
        for t in 0..8 {
            self.push(
                at,
                Command::PutTenant {
                    tenant: Tenant {
                        name: format!("t{t}"),
                        weight: 1,
                        quota_gpus: (gpus / 8) as u32,
                        max_gpus: 0,
                    },
                },
            )?;
        }
        for spec in &nodes {
            self.push(at, Command::RegisterNode { spec: spec.clone() })?;
        }
        self.flush()?;
        Ok(nodes)
    }

    /// Fills the free GPUs of `nodes` (all of them, host by host) with jobs `from..limit` of
    /// the workload (`job`): submitted over five minutes, placed in plans of `PLAN_BATCH`, and
    /// every task reported started a minute later. Returns how many jobs, their allocations and
    /// the leader time after the starts.
    pub(super) fn fill_fleet(
        &mut self,
        nodes: &[NodeSpec],
        from: usize,
        limit: usize,
        at: Timestamp,
    ) -> anyhow::Result<(usize, Vec<u64>, Timestamp)> {
        let mut packer = Packer::new(nodes);
        let mut wave: Vec<(usize, TaskPlacement)> = Vec::new();
        while from + wave.len() < limit {
            let i = from + wave.len();
            let (spec, _) = job(i);
            let Some(task) = packer.take(spec.gpus_per_task as usize) else {
                break;
            };
            wave.push((i, task));
        }
        ensure!(!wave.is_empty(), "no job of the workload fits a host");
        let jobs = wave
            .into_iter()
            .map(|(i, task)| {
                let (spec, key) = job(i);
                (spec, Some(key), task)
            })
            .collect();
        self.run_jobs(jobs, at)
    }

    /// Submits `jobs` (one task each) over five minutes, places each on its task's GPUs in
    /// plans of `PLAN_BATCH`, and reports every task started a minute later. Returns how many
    /// jobs, their allocations and the leader time after the starts.
    pub(super) fn run_jobs(
        &mut self,
        jobs: Vec<(JobSpec, Option<String>, TaskPlacement)>,
        mut at: Timestamp,
    ) -> anyhow::Result<(usize, Vec<u64>, Timestamp)> {
        let count = jobs.len();
        if count == 0 {
            return Ok((0, Vec::new(), at));
        }
        let step = (5 * MINUTE_MS / count as u64).max(1);
        let mut tasks = Vec::with_capacity(count);
        for (n, (spec, key, task)) in jobs.into_iter().enumerate() {
            self.push(at + n as u64 * step, Command::submit(spec, key))?;
            tasks.push(task);
        }
        at += 5 * MINUTE_MS;
        self.flush()?;
        // Ids come from the log, one per accepted submission, in order.
        let first_id = self.sm.read().cluster.last_job_id + 1 - count as u64;
        // Plans of PLAN_BATCH jobs each, then every task's start report.
        for (c, chunk) in tasks.chunks(PLAN_BATCH).enumerate() {
            let placements = chunk
                .iter()
                .enumerate()
                .map(|(k, task)| JobPlacement {
                    job: first_id + (c * PLAN_BATCH + k) as u64,
                    tasks: vec![task.clone()],
                })
                .collect();
            self.push(
                at,
                Command::Place {
                    term: 1,
                    placements,
                },
            )?;
        }
        self.flush()?;
        let allocations: Vec<u64> = {
            let data = self.sm.read();
            (0..count as u64)
                .flat_map(|k| data.cluster.jobs[&(first_id + k)].allocations.clone())
                .collect()
        };
        at += MINUTE_MS;
        for &allocation in &allocations {
            self.push(at, Command::AllocationStarted { allocation })?;
        }
        Ok((count, allocations, at))
    }

    /// Applies what is queued and checks that nothing was refused.
    pub(super) fn flush(&mut self) -> anyhow::Result<Vec<Outcome>> {
        let entries = std::mem::take(&mut self.pending);
        self.entries += entries.len() as u64;
        let mut sm = self.sm.clone();
        let outcomes = self
            .runtime
            .block_on(sm.apply(entries))
            .context("applying entries")?;
        for o in &outcomes {
            match o {
                Outcome::Rejected(r) => bail!("the state machine refused a command: {r}"),
                Outcome::Placed { rejected, .. } if !rejected.is_empty() => {
                    bail!("the state machine refused placements: {rejected:?}")
                }
                _ => {}
            }
        }
        Ok(outcomes)
    }
}

/// The fleet of `synthetic::fleet`: mostly DGX H100, a tenth DGX-1 V100, a tenth L40S hosts.
pub(super) fn fleet(hosts: usize) -> anyhow::Result<Vec<NodeSpec>> {
    let templates = [
        crate::synthetic::node_from_preset(
            "dgx-h100",
            "template",
            Some("h100"),
            Default::default(),
        )?,
        crate::synthetic::node_from_preset(
            "dgx1-v100",
            "template",
            Some("v100"),
            Default::default(),
        )?,
        crate::synthetic::node_from_preset(
            "pcie-8gpu-2socket",
            "template",
            Some("l40s"),
            Default::default(),
        )?,
    ];
    Ok((0..hosts)
        .map(|i| {
            let host = format!("host-{i:05}");
            let mut spec = templates[match i % 10 {
                8 => 1,
                9 => 2,
                _ => 0,
            }]
            .clone();
            for g in &mut spec.gpus {
                g.uuid = format!("GPU-{host}-{}", g.index);
            }
            spec.name = host;
            spec.labels
                .insert("rack".into(), format!("rack-{:03}", i / 32));
            spec.agent_address = format!("10.{}.{}.{}:7100", i / 65536, i / 256 % 256, i % 256);
            spec.incarnation = format!("boot-{i:08x}");
            spec
        })
        .collect())
}

/// Job `i` of the workload: whole GPUs on one host (1, 2, 4 or 8), a realistic command line,
/// environment and idempotency key, as `gpuctl submit` sends them.
pub(super) fn job(i: usize) -> (JobSpec, String) {
    let gpus = [1, 1, 1, 2, 2, 4, 8, 1][i % 8];
    let mut spec = crate::synthetic::job_spec(
        i,
        (i % 8) as u64,
        (gpus, 1, 0),
        ["normal", "normal", "low", "high"][i % 4],
        [3600, 4 * 3600, 24 * 3600][i % 3],
    );
    spec.command = vec![
        "python".into(),
        "train.py".into(),
        "--config".into(),
        format!("configs/experiment-{}.yaml", i % 997),
        "--seed".into(),
        i.to_string(),
    ];
    spec.env
        .insert("WANDB_PROJECT".into(), format!("project-{}", i % 31));
    spec.env.insert("NCCL_DEBUG".into(), "WARN".into());
    (
        spec,
        format!(
            "{:016x}-{:08x}",
            (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            i
        ),
    )
}

/// Packs whole-GPU tasks onto free GPUs, host by host.
pub(super) struct Packer<'a> {
    nodes: &'a [NodeSpec],
    node: usize,
    next_gpu: usize,
}

impl<'a> Packer<'a> {
    pub(super) fn new(nodes: &'a [NodeSpec]) -> Self {
        Packer {
            nodes,
            node: 0,
            next_gpu: 0,
        }
    }

    pub(super) fn take(&mut self, gpus: usize) -> Option<TaskPlacement> {
        while self.node < self.nodes.len() {
            let node = &self.nodes[self.node];
            if self.next_gpu + gpus <= node.gpus.len() {
                let uuids = node.gpus[self.next_gpu..self.next_gpu + gpus]
                    .iter()
                    .map(|g| g.uuid.clone())
                    .collect();
                self.next_gpu += gpus;
                return Some(TaskPlacement {
                    node: node.name.clone(),
                    gpus: uuids,
                });
            }
            self.node += 1;
            self.next_gpu = 0;
        }
        None
    }
}

/// Phase 1: apply the whole history to a real state machine, snapshot it, measure.
fn build(
    dir: &Path,
    hosts: usize,
    jobs: usize,
    compaction: bool,
) -> anyhow::Result<serde_json::Value> {
    let mut a = Applier::create(dir)?;
    let retention = Defaults::job_retention();
    let started = Instant::now();
    let mut at = START_MS;

    let nodes = a.register_fleet(at, hosts)?;

    // Waves: fill the fleet with jobs, run them for about an hour, let them exit over the
    // next hour (compaction due-checks every minute meanwhile), then start the next wave.
    let mut submitted = 0usize;
    let mut last_compaction_check = at;
    while submitted < jobs {
        let (wave, allocations, started_at) = a.fill_fleet(&nodes, submitted, jobs, at)?;
        at = started_at;
        let last_wave = submitted + wave >= jobs;
        if last_wave {
            break;
        }
        // Exits spread over the second hour; compaction as the leader would propose it.
        at += HOUR_MS;
        let exit_step = (HOUR_MS / allocations.len() as u64).max(1);
        for (n, &allocation) in allocations.iter().enumerate() {
            let exit_at = at + n as u64 * exit_step;
            let outcome = match n % 20 {
                0 => TaskOutcome::Failed {
                    exit_code: Some(1),
                    signal: None,
                    reason: "Traceback: CUDA out of memory".into(),
                },
                1 => TaskOutcome::TimedOut,
                _ => TaskOutcome::Succeeded,
            };
            a.push(
                exit_at,
                Command::AllocationExited {
                    allocation,
                    outcome,
                    usage: None,
                },
            )?;
            if compaction && exit_at >= last_compaction_check + MINUTE_MS {
                last_compaction_check = exit_at;
                a.flush()?;
                if a.sm.read().cluster.compaction_due(&retention, exit_at) {
                    a.push(
                        exit_at,
                        Command::CompactJobs {
                            retention,
                            limit: None,
                        },
                    )?;
                }
            }
        }
        at += HOUR_MS;
        submitted += wave;
    }
    a.flush()?;
    let apply_seconds = started.elapsed().as_secs_f64();
    let (rss_applied, hwm_applied) = memory_mib()?;
    // From here VmHWM is the snapshot's own peak (where the kernel lets it be reset).
    let hwm_reset = reset_hwm();

    let snapshot_started = Instant::now();
    let mut builder = a.sm.clone();
    let snapshot = a
        .runtime
        .block_on(builder.build_snapshot())
        .context("building the snapshot")?;
    let snapshot_seconds = snapshot_started.elapsed().as_secs_f64();
    let snapshot_locked_seconds = a.sm.last_snapshot_locked().as_secs_f64();
    // The state's JSON, as stored (framed with a few hundred bytes of meta) and as sent to a
    // follower. openraft drops it once built; so does this.
    let snapshot_bytes = snapshot.snapshot.len();
    drop(snapshot);
    let (rss_after_snapshot, hwm_snapshot) = memory_mib()?;
    let hwm = hwm_snapshot.max(hwm_applied);

    // For comparison: serializing the state alone, into nothing (what the read lock would be
    // held for if the snapshot were stored after it, from memory).
    let data = a.sm.read();
    let encode_started = Instant::now();
    serde_json::to_writer(std::io::sink(), &*data).context("encoding the state")?;
    let encode_seconds = encode_started.elapsed().as_secs_f64();
    let c = &data.cluster;
    c.check_consistency()
        .map_err(|e| anyhow::anyhow!("the state is inconsistent after the run: {e}"))?;
    let kept = c.jobs.len() + c.archived.len();
    Ok(json!({
        "hosts": hosts,
        "gpus": c.total_gpus(),
        "jobs": c.last_job_id,
        "entries": a.entries,
        "full_records": c.jobs.len(),
        "running": c.jobs.values().filter(|j| !j.state.is_final()).count(),
        "archived": c.archived.len(),
        "forgotten": c.last_job_id as usize - kept,
        "idempotency_keys": c.index.idempotency.values().map(|k| k.len()).sum::<usize>(),
        "live_allocations": c.allocations.len(),
        "leader_time_hours": (at - START_MS) as f64 / HOUR_MS as f64,
        "apply_seconds": apply_seconds,
        "snapshot_seconds": snapshot_seconds,
        "snapshot_locked_seconds": snapshot_locked_seconds,
        "encode_seconds": encode_seconds,
        "snapshot_bytes": snapshot_bytes,
        "vm_rss_mib": rss_applied,
        "vm_rss_after_snapshot_mib": rss_after_snapshot,
        "vm_hwm_mib": hwm,
        "vm_hwm_applying_mib": hwm_applied,
        "vm_hwm_snapshot_mib": if hwm_reset { json!(hwm_snapshot) } else { json!(null) },
    }))
}

/// Phase 2: open the directory as a restarted replica does, measure.
fn load(dir: &Path) -> anyhow::Result<serde_json::Value> {
    let started = Instant::now();
    let data_dir = DataDir::open(dir, "bench-memory", 1)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("opening the replica data directory")?;
    let sm = StateMachineStore::open(&data_dir.db).map_err(|e| anyhow::anyhow!(e))?;
    let load_seconds = started.elapsed().as_secs_f64();
    let (rss, hwm) = memory_mib()?;
    let data = sm.read();
    let jobs: JobId = data.cluster.last_job_id;
    Ok(json!({
        "jobs": jobs,
        "full_records": data.cluster.jobs.len(),
        "archived": data.cluster.archived.len(),
        "load_seconds": load_seconds,
        "vm_rss_mib": rss,
        "vm_hwm_mib": hwm,
    }))
}
