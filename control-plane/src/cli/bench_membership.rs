//! `gpuctl bench membership`: what it costs to add a replica to a cluster that holds a large
//! state, the learner being sent that state as one Raft snapshot.
//!
//! For each size in `--jobs`, on a fresh cluster of three real replica processes (mutual TLS,
//! durable sled storage, loopback):
//! 1. The state: the job history of `gpuctl bench memory` (10,000 8-GPU hosts; waves of jobs
//!    submitted, placed, started and finished through the real state machine, compacted by the
//!    default retention; the last wave running), applied in a child process (`bench memory
//!    --phase build`), then written as a backup file in the format `cluster snapshot save`
//!    writes.
//! 2. `cluster snapshot restore` of that file into three data directories (the library call the
//!    command makes), and the three replicas started on them, with a node grace and job
//!    retentions long enough that the state stays as restored (`STEADY_STATE_FLAGS`).
//! 3. `gpuctl cluster snapshot save` against the running cluster (this binary as a child
//!    process): its time and the file's size.
//! 4. A fourth, pristine replica is started and added through the real `AddReplica` API (what
//!    `gpuctl cluster add` calls). Meanwhile, every 50 ms, the learner's and the leader's
//!    `ClusterStatus` (when the learner has the snapshot's entry applied; when the leader lists
//!    it as a voter) and the VmRSS of both processes; every 100 ms a probe write through the
//!    leader (a tenant's quota), whose latency and longest gap between acknowledged writes say
//!    how available the cluster stayed.
//!
//! The promotion must follow the install: a learner that voted before it had the state would
//! count towards quorums it cannot serve. The benchmark checks it, from what it saw.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use proto::v1 as pb;
use serde_json::json;

use super::output::table;
use crate::backup::file::BackupWriter;
use crate::backup::restore::{RestoreRequest, restore};
use crate::backup::{BackupHeader, Counts, hex};
use crate::client::{Client, with_timeout};
use crate::datadir::DataDir;
use crate::local_cluster::{LocalCluster, StartMode, free_ports};
use crate::raft::state_machine::{StateMachineStore, encode_state};

pub struct Args {
    pub jobs: Vec<usize>,
    pub hosts: usize,
    /// Extra flags for every replica.
    pub replica_args: Vec<String>,
}

const CLUSTER: &str = "bench";
/// How often the learner's and leader's status and RSS are sampled.
const SAMPLE: Duration = Duration::from_millis(50);
/// Replica flags that keep the restored state as it is while the replica is added (unless
/// `--replica-args` names them): the history's hosts have no agents here, and its leader
/// times are months old. With the defaults, the leader declares all 10,000 hosts lost 10 s
/// after it starts, and its first compaction, a minute in, forgets about a million archived
/// jobs in one entry (5 s of apply on every replica, the leader deposed): that, not the new
/// replica, would be measured.
const STEADY_STATE_FLAGS: [(&str, &str); 3] = [
    ("--node-grace-ms", "86400000"),
    ("--finished-job-retention-secs", "315360000"),
    ("--archive-retention-secs", "315360000"),
];
/// How often the probe writes.
const PROBE: Duration = Duration::from_millis(100);

pub fn run(args: Args, keep_data: Option<PathBuf>) -> anyhow::Result<(String, serde_json::Value)> {
    ensure!(!args.jobs.is_empty(), "--jobs names no size");
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let tmp = tempfile::Builder::new()
        .prefix("gpucp-bench-membership-")
        .tempdir()?;
    let root = keep_data.unwrap_or_else(|| tmp.path().to_owned());
    let mut cases = Vec::new();
    for &jobs in &args.jobs {
        let dir = root.join(format!("jobs-{jobs}"));
        std::fs::create_dir_all(&dir)?;
        eprintln!("== {jobs} jobs: building the state");
        let case = match one_size(&exe, &dir, jobs, &args) {
            Ok(c) => c,
            Err(e) => json!({"jobs": jobs, "error": format!("{e:#}")}),
        };
        eprintln!("{case}");
        cases.push(case);
        // The next size starts on a clean disk.
        if dir.starts_with(tmp.path()) {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let json = json!({"benchmark": "membership", "hosts": args.hosts, "cases": cases});
    Ok((text_report(&json), json))
}

fn text_report(j: &serde_json::Value) -> String {
    let f = |v: &serde_json::Value, scale: f64, digits: usize| match v.as_f64() {
        Some(x) => format!("{:.*}", digits, x / scale),
        None => "-".to_owned(),
    };
    let mib = 1024.0 * 1024.0;
    let mut rows = Vec::new();
    let mut errors = String::new();
    for c in j["cases"].as_array().into_iter().flatten() {
        if let Some(e) = c["error"].as_str() {
            errors.push_str(&format!("{} jobs: FAILED: {e}\n", c["jobs"]));
            continue;
        }
        rows.push(vec![
            c["jobs"].to_string(),
            f(&c["snapshot_bytes"], mib, 0),
            f(&c["save"]["seconds"], 1.0, 1),
            f(&c["save"]["file_bytes"], mib, 0),
            f(&c["add"]["installed_s"], 1.0, 1),
            f(&c["add"]["promoted_s"], 1.0, 1),
            f(&c["add"]["answered_s"], 1.0, 1),
            f(&c["probe"]["max_gap_ms"], 1.0, 0),
            f(&c["probe"]["max_latency_ms"], 1.0, 0),
            c["probe"]["failed"].to_string(),
            f(&c["rss"]["leader_peak_mib"], 1.0, 0),
            f(&c["rss"]["learner_peak_mib"], 1.0, 0),
            if c["promoted_after_install"] == true {
                "yes".into()
            } else {
                "NO".into()
            },
        ]);
    }
    let t = table(
        &[
            "JOBS",
            "SNAPSHOT_MIB",
            "SAVE_S",
            "SAVE_MIB",
            "INSTALLED_S",
            "VOTER_S",
            "ADD_S",
            "WRITE_GAP_MS",
            "WRITE_MAX_MS",
            "WRITE_FAILED",
            "LEADER_RSS_MIB",
            "LEARNER_RSS_MIB",
            "VOTER_AFTER_INSTALL",
        ],
        &rows,
    );
    format!(
        "adding a 4th replica to 3 (TLS, sled, loopback) holding a job history of {} hosts; times from the AddReplica call\n{t}{errors}",
        j["hosts"]
    )
}

fn one_size(exe: &Path, dir: &Path, jobs: usize, args: &Args) -> anyhow::Result<serde_json::Value> {
    // 1. The state, applied in a child (its memory is not this process's).
    let seed_dir = dir.join("seed");
    let built = super::bench_memory::child(
        exe,
        &[
            "--phase".into(),
            "build".into(),
            "--dir".into(),
            seed_dir.display().to_string(),
            "--hosts".into(),
            args.hosts.to_string(),
            "--jobs".into(),
            jobs.to_string(),
        ],
    )?;
    let backup = dir.join("seed.backup");
    let started = Instant::now();
    let header = write_backup(&seed_dir, &backup)?;
    let backup_write_s = started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&seed_dir)?;
    eprintln!(
        "state built ({} full records, {} archived) in {:.0} s; backup of {} bytes written in {:.1} s",
        built["full_records"],
        built["archived"],
        built["apply_seconds"].as_f64().unwrap_or(f64::NAN),
        header.state_bytes,
        backup_write_s
    );

    // 2. Three replicas restored from it.
    let (mut cluster, snapshot_bytes, restore_s) =
        restored_cluster(exe, dir, &backup, &args.replica_args)?;
    std::fs::remove_file(&backup)?;
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let leader = runtime.block_on(cluster.wait_for_leader(Duration::from_secs(600)))?;
    let first_leader_s = started.elapsed().as_secs_f64();
    eprintln!(
        "restored 3 replicas ({restore_s:.1} s each); leader {} after {first_leader_s:.1} s",
        leader.leader
    );

    // 3. `gpuctl cluster snapshot save`.
    let save = save_backup(&cluster, exe, &dir.join("saved.backup"))?;
    eprintln!("cluster snapshot save: {save}");

    // 4. The fourth replica.
    let result = runtime.block_on(join_and_watch(
        &mut cluster,
        leader.leader,
        header.last_applied.index,
        Joining::Added,
    ));
    let add = match result {
        Ok(add) => add,
        Err(e) => {
            let learner_log: String = cluster
                .log(4)
                .lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            bail!("{e:#}\nthe learner's last log lines:\n{learner_log}");
        }
    };
    let installed = add["add"]["installed_s"].as_f64();
    let promoted = add["add"]["promoted_s"].as_f64();
    let mut out = json!({
        "jobs": jobs,
        "state": built,
        "backup_state_bytes": header.state_bytes,
        "snapshot_bytes": snapshot_bytes,
        "restore_seconds_per_replica": restore_s,
        "first_leader_seconds": first_leader_s,
        "save": save,
        "promoted_after_install": matches!((installed, promoted), (Some(i), Some(p)) if p >= i),
    });
    if let (Some(o), Some(a)) = (out.as_object_mut(), add.as_object()) {
        o.extend(a.clone());
    }
    Ok(out)
}

/// Three replicas (mutual TLS, sled, loopback ports) restored from `backup` into data
/// directories under `dir`, not started yet, with `STEADY_STATE_FLAGS` unless `replica_args`
/// names them. Returns the cluster, the restored snapshot's size and the seconds one restore
/// took (mean of three).
pub(super) fn restored_cluster(
    exe: &Path,
    dir: &Path,
    backup: &Path,
    replica_args: &[String],
) -> anyhow::Result<(LocalCluster, u64, f64)> {
    let ports = free_ports(3)?;
    let mut cluster = LocalCluster::new(exe, &["replica"], dir, CLUSTER, &ports);
    cluster.extra_args = replica_args.to_vec();
    for (flag, value) in STEADY_STATE_FLAGS {
        if !cluster.extra_args.iter().any(|a| a == flag) {
            cluster
                .extra_args
                .extend([flag.to_owned(), value.to_owned()]);
        }
    }
    let members: std::collections::BTreeMap<u64, String> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64 + 1, format!("127.0.0.1:{p}")))
        .collect();
    let started = Instant::now();
    let mut snapshot_bytes = 0;
    for id in 1..=3u64 {
        let data_dir = cluster.replicas[&id].data_dir.clone();
        let restored = restore(&RestoreRequest {
            backup,
            data_dir: &data_dir,
            replica_id: id,
            cluster: CLUSTER,
            members: &members,
        })
        .with_context(|| format!("restoring replica {id}"))?;
        snapshot_bytes = restored.snapshot_bytes;
    }
    Ok((
        cluster,
        snapshot_bytes,
        started.elapsed().as_secs_f64() / 3.0,
    ))
}

/// Writes the state stored in `seed_dir` (the build phase's replica, id 1 of cluster
/// `bench-memory`) as a backup file, as `cluster snapshot save` would.
pub(super) fn write_backup(seed_dir: &Path, path: &Path) -> anyhow::Result<BackupHeader> {
    let data_dir = DataDir::open(seed_dir, "bench-memory", 1)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("opening the built state")?;
    let sm = StateMachineStore::open(&data_dir.db).map_err(|e| anyhow::anyhow!(e))?;
    let (meta, copy) = sm.consistent_copy();
    let last_applied = meta
        .last_log_id
        .context("the built state applied nothing")?;
    let counts = Counts::of(&copy.cluster);
    let membership = meta.last_membership.clone();
    drop(sm);
    let encoded = encode_state(meta, copy).map_err(|e| anyhow::anyhow!(e))?;
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    for chunk in &encoded.chunks {
        digest.update(chunk);
    }
    let header = BackupHeader {
        cluster: "bench-memory".into(),
        replica_id: 1,
        made_at_ms: crate::replica::now_ms(),
        last_applied,
        membership,
        state_bytes: encoded.len(),
        state_sha256: hex(digest.finish().as_ref()),
        counts,
    };
    let mut writer = BackupWriter::create(path, header.clone())?;
    for chunk in &encoded.chunks {
        writer.write_state(chunk)?;
    }
    writer.finish()?;
    Ok(header)
}

/// `gpuctl cluster snapshot save FILE` as an operator runs it: seconds and bytes.
pub(super) fn save_backup(
    cluster: &LocalCluster,
    exe: &Path,
    file: &Path,
) -> anyhow::Result<serde_json::Value> {
    let started = Instant::now();
    let out = std::process::Command::new(exe)
        .args(["cluster", "snapshot", "save"])
        .arg(file)
        .args(["-o", "json"])
        .envs(cluster.gpuctl_env()?)
        .output()
        .context("running gpuctl cluster snapshot save")?;
    let seconds = started.elapsed().as_secs_f64();
    ensure!(
        out.status.success(),
        "gpuctl cluster snapshot save failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file_bytes = std::fs::metadata(file)?.len();
    std::fs::remove_file(file)?;
    Ok(json!({"seconds": seconds, "file_bytes": file_bytes}))
}

/// What the samplers saw while the fourth replica was added.
#[derive(Default)]
struct Seen {
    installed: Option<Duration>,
    promoted: Option<Duration>,
    /// The learner's largest applied index seen before it was promoted.
    learner_applied_before_promotion: u64,
    leader_rss_peak_kib: u64,
    learner_rss_peak_kib: u64,
    status_misses: u64,
}

/// How the replica under watch comes to hold the state.
#[derive(Clone, Copy, Debug)]
pub(super) enum Joining {
    /// A fourth, pristine replica, added through `AddReplica` (what `gpuctl cluster add` calls).
    Added,
    /// Follower `id` lost its disk: killed, its data directory deleted, removed from the
    /// membership, and started again empty with `--join` through the leader (README's
    /// operating notes; the chaos harness's wipe does the same). Times count from that start.
    Wiped(u64),
}

/// Starts replica 4 and adds it, or wipes a follower and lets it join again (`how`), and
/// measures (see the module header). `seeded` is the log index of the restored state: a
/// learner that has applied it has installed the snapshot.
pub(super) async fn join_and_watch(
    cluster: &mut LocalCluster,
    leader: u64,
    seeded: u64,
    how: Joining,
) -> anyhow::Result<serde_json::Value> {
    let credentials = cluster.credentials()?;
    let leader_addr = cluster.addr(leader);
    let (id, t0) = match how {
        Joining::Added => {
            let port = free_ports(1)?[0];
            let id = cluster.add_spare(port);
            cluster.start(id, StartMode::Pristine)?;
            // Replica 4 serves its API once it listens.
            let deadline = Instant::now() + Duration::from_secs(60);
            while cluster.status(id).await.is_none() {
                ensure!(Instant::now() < deadline, "replica {id} did not start");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (id, Instant::now())
        }
        Joining::Wiped(id) => {
            ensure!(id != leader, "the wiped replica must be a follower");
            cluster.kill(id)?;
            let dir = cluster.replicas[&id].data_dir.clone();
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("wiping replica {id}'s data directory {dir:?}"))?;
            let mut admin = Client::new(std::slice::from_ref(&leader_addr), &credentials)?;
            admin.deadline = Duration::from_secs(120);
            admin
                .call(|mut c, t| async move {
                    c.remove_replica(with_timeout(
                        pb::RemoveReplicaRequest { id, force: false },
                        t,
                    ))
                    .await
                })
                .await
                .with_context(|| format!("removing wiped replica {id} from the membership"))?;
            let t0 = Instant::now();
            cluster.start(id, StartMode::Join(leader_addr.clone()))?;
            (id, t0)
        }
    };
    let address = cluster.addr(id);
    let pids = (
        cluster.replicas[&leader].pid().context("leader pid")?,
        cluster.replicas[&id].pid().context("learner pid")?,
    );

    let seen = Arc::new(Mutex::new(Seen::default()));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // The samplers: status of learner and leader, and RSS.
    let sampler = {
        let seen = seen.clone();
        let done = done.clone();
        let learner = Client::new(std::slice::from_ref(&address), &credentials)?;
        let leader_client = Client::new(std::slice::from_ref(&leader_addr), &credentials)?;
        tokio::spawn(async move {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let l = quick_status(&learner).await;
                let m = quick_status(&leader_client).await;
                let rss = (vm_rss_kib(pids.0), vm_rss_kib(pids.1));
                {
                    let mut s = seen.lock().expect("samples");
                    let now = t0.elapsed();
                    s.leader_rss_peak_kib = s.leader_rss_peak_kib.max(rss.0);
                    s.learner_rss_peak_kib = s.learner_rss_peak_kib.max(rss.1);
                    match &l {
                        Some(l) if l.applied_index >= seeded => {
                            s.installed.get_or_insert(now);
                        }
                        Some(_) => {}
                        None => s.status_misses += 1,
                    }
                    let voter = m
                        .as_ref()
                        .is_some_and(|m| m.members.iter().any(|x| x.id == id && x.role == "voter"));
                    if voter {
                        s.promoted.get_or_insert(now);
                    } else if let Some(l) = &l {
                        s.learner_applied_before_promotion =
                            s.learner_applied_before_promotion.max(l.applied_index);
                    }
                }
                tokio::time::sleep(SAMPLE).await;
            }
        })
    };

    // The probe: one write every 100 ms through the leader (and on, if it changes).
    let probe = {
        let done = done.clone();
        let mut endpoints = vec![leader_addr.clone()];
        endpoints.extend(
            cluster
                .endpoints()
                .into_iter()
                .filter(|e| *e != leader_addr && *e != address),
        );
        let mut client = Client::new(&endpoints, &credentials)?;
        client.deadline = Duration::from_secs(30);
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut acked: Vec<Instant> = vec![Instant::now()];
            let mut failed = 0u64;
            let mut i = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let tenant = pb::Tenant {
                    name: "probe".into(),
                    weight: 1,
                    quota_gpus: i,
                    max_gpus: 0,
                };
                let sent = Instant::now();
                let r = client
                    .call(|mut c, t| {
                        let r = tenant.clone();
                        async move { c.put_tenant(with_timeout(r, t)).await }
                    })
                    .await;
                match r {
                    Ok(_) => {
                        latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
                        acked.push(Instant::now());
                    }
                    Err(_) => failed += 1,
                }
                tokio::time::sleep(PROBE.saturating_sub(sent.elapsed())).await;
            }
            acked.push(Instant::now());
            let max_gap = acked
                .windows(2)
                .map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1000.0)
                .fold(0.0, f64::max);
            let summary = super::bench::summary(latencies);
            json!({
                "writes": summary["n"],
                "failed": failed,
                "max_gap_ms": max_gap,
                "max_latency_ms": summary["max"],
                "p50_latency_ms": summary["p50"],
                "p99_latency_ms": summary["p99"],
            })
        })
    };
    let (called, answer, answered) = match how {
        Joining::Added => {
            // A second of probe writes before the add, for a baseline.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let mut admin = Client::new(std::slice::from_ref(&leader_addr), &credentials)?;
            admin.deadline = Duration::from_secs(3600);
            admin.attempt_timeout = Duration::from_secs(3600);
            admin.retry_deadline_exceeded = false;
            let req = pb::AddReplicaRequest {
                id,
                address: address.clone(),
                learner_only: false,
                force: false,
            };
            let called = t0.elapsed();
            let answer = admin
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.add_replica(with_timeout(req, t)).await }
                })
                .await
                .map(|_| ());
            (called, answer, t0.elapsed())
        }
        Joining::Wiped(_) => {
            // The replica adds itself; it is done when the leader lists it as a voter.
            let deadline = Instant::now() + Duration::from_secs(3600);
            let answer = loop {
                if seen.lock().expect("samples").promoted.is_some() {
                    break Ok(());
                }
                if Instant::now() >= deadline {
                    break Err(tonic::Status::deadline_exceeded(
                        "the wiped replica was not a voter within an hour",
                    ));
                }
                tokio::time::sleep(SAMPLE).await;
            };
            (Duration::ZERO, answer, t0.elapsed())
        }
    };
    // The probe and samplers see a second more.
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let probe = probe.await?;
    sampler.await?;
    let s = seen.lock().expect("samples");
    let since_call = |d: Option<Duration>| d.map(|d| d.saturating_sub(called).as_secs_f64());
    let mut out = json!({
        "add": {
            "ok": answer.is_ok(),
            "error": answer.as_ref().err().map(|e| e.message().to_owned()),
            "installed_s": since_call(s.installed),
            "promoted_s": since_call(s.promoted),
            "answered_s": answered.saturating_sub(called).as_secs_f64(),
            "learner_applied_before_promotion": s.learner_applied_before_promotion,
            "seeded_index": seeded,
            "status_misses": s.status_misses,
        },
        "probe": probe,
        "rss": {
            "leader_peak_mib": s.leader_rss_peak_kib as f64 / 1024.0,
            "learner_peak_mib": s.learner_rss_peak_kib as f64 / 1024.0,
            "leader_hwm_mib": vm_hwm_kib(pids.0) as f64 / 1024.0,
            "learner_hwm_mib": vm_hwm_kib(pids.1) as f64 / 1024.0,
        },
    });
    if let Err(e) = answer {
        out["add"]["error"] = json!(e.message());
        bail!(
            "AddReplica failed after {:.1} s: {}; measured so far: {out}",
            answered.saturating_sub(called).as_secs_f64(),
            e.message()
        );
    }
    Ok(out)
}

/// A replica's status within 500 ms, or nothing.
pub(super) async fn quick_status(client: &Client) -> Option<pb::ClusterStatusResponse> {
    let mut c = client.clone();
    c.deadline = Duration::from_millis(500);
    c.attempt_timeout = Duration::from_millis(500);
    c.call(|mut c, t| async move {
        c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
            .await
    })
    .await
    .ok()
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

pub(super) fn vm_rss_kib(pid: u32) -> u64 {
    proc_status_kib(pid, "VmRSS:")
}

pub(super) fn vm_hwm_kib(pid: u32) -> u64 {
    proc_status_kib(pid, "VmHWM:")
}
