//! `gpuctl bench scale`: what one replica set costs as the fleet grows, holding a full fleet
//! and a long pending queue.
//!
//! For each size in `--hosts` (8-GPU hosts), on a fresh cluster of three real replica
//! processes (mutual TLS, durable sled storage, loopback):
//! 1. The state, built in a child process (`--phase build`) through the real state machine, as
//!    Raft entries: the fleet of `bench memory` (DGX H100, DGX-1 V100, PCIe L40S hosts), filled
//!    to its last GPU with running whole-GPU jobs (submitted, placed, started), then `--pending`
//!    more jobs of the mixed shapes of `bench scheduler` (1–8 GPUs, 2×8 gangs, GPU shares,
//!    three priorities, eight tenants, dependency chains) that wait, because nothing is free.
//!    Tenants' quotas cover what they hold, and the running jobs are not preemptible, so the
//!    queue holds still: what is measured is the cost of holding it, not of moving it. In that
//!    child, on the same state: the scheduling pass the leader runs (`plan_explained`, with
//!    every pending job's reason), `--runs` times; the snapshot the replica builds
//!    (`build_snapshot`: copy under the read lock, serialize, store in sled); and the process's
//!    RSS.
//! 2. The state written as a backup and restored into three data directories
//!    (`bench_membership::restored_cluster`), and the replicas started on it: the time to a
//!    leader (each replica decodes the snapshot and rebuilds its indexes first).
//! 3. `--window` seconds of the leader scheduling that queue, its passes read from its own
//!    Prometheus endpoint (`gpucp_scheduler_pass_duration_seconds` sum and count); then every
//!    replica's VmRSS and VmHWM (the limit: 2 GiB).
//! 4. `gpuctl cluster snapshot save` against the running cluster.
//! 5. A follower loses its disk: killed, wiped, removed from the membership and started empty
//!    with `--join` (`bench_membership::Joining::Wiped`): the time until it has installed the
//!    leader's snapshot and until it is a voter again, its RSS peak, and the leader's write
//!    gaps meanwhile (a probe write every 100 ms).
//!
//! `--plot FILE` draws the cost curve over the sizes (SVG, `bench_scale_plot`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use openraft::storage::RaftSnapshotBuilder;
use serde_json::json;

use super::bench_membership::{
    Joining, join_and_watch, restored_cluster, save_backup, vm_hwm_kib, vm_rss_kib, write_backup,
};
use super::bench_memory::{Applier, MINUTE_MS, START_MS, bench_child, job, memory_mib, reset_hwm};
use super::output::table;
use crate::local_cluster::free_ports;
use crate::scheduler::{Policy, plan_explained};
use crate::state::{Command, JobSpec, TaskPlacement, Tenant};

pub struct Args {
    pub hosts: Vec<usize>,
    pub pending: usize,
    /// In-process scheduling passes per size.
    pub runs: usize,
    /// How long the running leader schedules the queue before its passes are read.
    pub window: Duration,
    pub replica_args: Vec<String>,
    pub plot: Option<PathBuf>,
    /// Set in the child process only.
    pub phase: Option<String>,
    pub dir: Option<PathBuf>,
}

/// The limit for a replica holding 20,000 hosts and 100,000 pending jobs.
pub const TARGET_RSS_MIB: f64 = 2048.0;

pub fn run(args: Args, keep_data: Option<PathBuf>) -> anyhow::Result<(String, serde_json::Value)> {
    match args.phase.as_deref() {
        None => parent(&args, keep_data),
        Some("build") => {
            let dir = args.dir.as_deref().context("--phase build needs --dir")?;
            let hosts = *args.hosts.first().context("--hosts names no size")?;
            Ok((String::new(), build(dir, hosts, args.pending, args.runs)?))
        }
        Some(other) => bail!("unknown --phase {other:?} (build)"),
    }
}

fn parent(args: &Args, keep_data: Option<PathBuf>) -> anyhow::Result<(String, serde_json::Value)> {
    ensure!(!args.hosts.is_empty(), "--hosts names no size");
    ensure!(
        args.hosts.iter().all(|&h| h > 0),
        "--hosts: every size must be at least 1"
    );
    ensure!(args.runs > 0, "--runs must be at least 1");
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let tmp = tempfile::Builder::new()
        .prefix("gpucp-bench-scale-")
        .tempdir()?;
    let root = keep_data.unwrap_or_else(|| tmp.path().to_owned());
    let mut cases = Vec::new();
    for &hosts in &args.hosts {
        let dir = root.join(format!("hosts-{hosts}"));
        std::fs::create_dir_all(&dir)?;
        eprintln!(
            "== {hosts} hosts, {} pending jobs: building the state",
            args.pending
        );
        let case = match one_size(&exe, &dir, hosts, args) {
            Ok(c) => c,
            Err(e) => json!({"hosts": hosts, "error": format!("{e:#}")}),
        };
        eprintln!("{case}");
        cases.push(case);
        // The next size starts on a clean disk.
        if dir.starts_with(tmp.path()) {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let json = json!({
        "benchmark": "scale",
        "pending": args.pending,
        "target_rss_mib": TARGET_RSS_MIB,
        "cases": cases,
    });
    if let Some(path) = &args.plot {
        let svg = super::bench_scale_plot::cost_curve(&json);
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    Ok((text_report(&json), json))
}

fn text_report(j: &serde_json::Value) -> String {
    let f = |v: &serde_json::Value, digits: usize| match v.as_f64() {
        Some(x) => format!("{x:.digits$}"),
        None => "-".to_owned(),
    };
    let mut rows = Vec::new();
    let mut errors = String::new();
    for c in j["cases"].as_array().into_iter().flatten() {
        if let Some(e) = c["error"].as_str() {
            errors.push_str(&format!("{} hosts: FAILED: {e}\n", c["hosts"]));
            continue;
        }
        let b = &c["build"];
        rows.push(vec![
            c["hosts"].to_string(),
            b["gpus"].to_string(),
            b["running"].to_string(),
            b["pending"].to_string(),
            f(&b["pass_ms"]["p50"], 1),
            f(&c["leader_pass_ms_mean"], 1),
            f(&b["snapshot_seconds"], 2),
            f(&b["snapshot_mib"], 0),
            f(&c["first_leader_seconds"], 1),
            f(&c["rss"]["max_mib"], 0),
            f(&c["rss"]["hwm_max_mib"], 0),
            f(&c["save"]["seconds"], 1),
            f(&c["rejoin"]["add"]["installed_s"], 1),
            f(&c["rejoin"]["add"]["promoted_s"], 1),
            f(&c["rejoin"]["probe"]["max_gap_ms"], 0),
        ]);
    }
    let t = table(
        &[
            "HOSTS",
            "GPUS",
            "RUNNING",
            "PENDING",
            "PASS_MS",
            "LEADER_PASS_MS",
            "SNAPSHOT_S",
            "SNAPSHOT_MIB",
            "LEADER_AFTER_S",
            "RSS_MIB",
            "RSS_PEAK_MIB",
            "SAVE_S",
            "REJOIN_INSTALLED_S",
            "REJOIN_VOTER_S",
            "WRITE_GAP_MS",
        ],
        &rows,
    );
    format!(
        "3 replicas (TLS, sled, loopback) holding a full fleet and {} pending jobs; PASS_MS: p50 \
         in process; LEADER_PASS_MS: the running leader's mean; RSS: the largest replica's \
         (limit {TARGET_RSS_MIB:.0} MiB); rejoin: a follower wiped and joined again, from its start\n{t}{errors}",
        j["pending"]
    )
}

fn one_size(
    exe: &Path,
    dir: &Path,
    hosts: usize,
    args: &Args,
) -> anyhow::Result<serde_json::Value> {
    // 1. The state, and what can be measured on it in process, in a child.
    let seed_dir = dir.join("seed");
    let built = bench_child(
        exe,
        "scale",
        &[
            "--phase".into(),
            "build".into(),
            "--dir".into(),
            seed_dir.display().to_string(),
            "--hosts".into(),
            hosts.to_string(),
            "--pending".into(),
            args.pending.to_string(),
            "--runs".into(),
            args.runs.to_string(),
        ],
    )?;
    let backup = dir.join("seed.backup");
    let header = write_backup(&seed_dir, &backup)?;
    std::fs::remove_dir_all(&seed_dir)?;
    eprintln!(
        "state built: {} running, {} pending, pass p50 {:.0} ms, snapshot {:.2} s",
        built["running"], built["pending"], built["pass_ms"]["p50"], built["snapshot_seconds"]
    );

    // 2. Three replicas restored from it, each with a metrics endpoint.
    let (mut cluster, snapshot_bytes, restore_s) =
        restored_cluster(exe, dir, &backup, &args.replica_args)?;
    std::fs::remove_file(&backup)?;
    let metrics_ports = free_ports(3)?;
    for (id, port) in (1..=3u64).zip(&metrics_ports) {
        if let Some(r) = cluster.replicas.get_mut(&id) {
            r.metrics_addr = Some(format!("127.0.0.1:{port}"));
        }
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let leader = runtime
        .block_on(cluster.wait_for_leader(Duration::from_secs(600)))?
        .leader;
    let first_leader_s = started.elapsed().as_secs_f64();
    eprintln!("leader {leader} after {first_leader_s:.1} s");

    // 3. The leader schedules the queue for a while.
    let metrics_addr = cluster.replicas[&leader]
        .metrics_addr
        .clone()
        .context("the leader has no metrics endpoint")?;
    let before = runtime.block_on(pass_totals(&metrics_addr))?;
    std::thread::sleep(args.window);
    let after = runtime.block_on(pass_totals(&metrics_addr))?;
    let passes = after.0 - before.0;
    let leader_pass_ms_mean = (passes > 0.0).then(|| (after.1 - before.1) / passes * 1000.0);
    let still_leader = runtime
        .block_on(cluster.wait_for_leader(Duration::from_secs(60)))?
        .leader;
    let mut rss = serde_json::Map::new();
    let (mut max_mib, mut hwm_max_mib) = (0.0f64, 0.0f64);
    for (id, r) in &cluster.replicas {
        let pid = r
            .pid()
            .with_context(|| format!("replica {id} is not running"))?;
        let (now, peak) = (
            vm_rss_kib(pid) as f64 / 1024.0,
            vm_hwm_kib(pid) as f64 / 1024.0,
        );
        max_mib = max_mib.max(now);
        hwm_max_mib = hwm_max_mib.max(peak);
        rss.insert(
            format!("replica_{id}"),
            json!({"mib": now, "hwm_mib": peak, "leader": *id == leader}),
        );
    }
    rss.insert("max_mib".into(), json!(max_mib));
    rss.insert("hwm_max_mib".into(), json!(hwm_max_mib));

    // 4. An operator's backup of it.
    let save = save_backup(&cluster, exe, &dir.join("saved.backup"))?;

    // 5. A follower loses its disk and joins again.
    let follower = *cluster
        .replicas
        .keys()
        .find(|id| **id != still_leader)
        .context("no follower")?;
    let rejoin = runtime
        .block_on(join_and_watch(
            &mut cluster,
            still_leader,
            header.last_applied.index,
            Joining::Wiped(follower),
        ))
        .with_context(|| format!("replica {follower} wiped and joining again"))?;
    Ok(json!({
        "hosts": hosts,
        "build": built,
        "snapshot_bytes_restored": snapshot_bytes,
        "restore_seconds_per_replica": restore_s,
        "first_leader_seconds": first_leader_s,
        "window_seconds": args.window.as_secs_f64(),
        "leader_passes": passes,
        "leader_pass_ms_mean": leader_pass_ms_mean,
        "leader_changed": still_leader != leader,
        "rss": rss,
        "save": save,
        "rejoin": rejoin,
    }))
}

/// The leader's scheduling passes so far: (count, seconds in all), from its `/metrics`.
async fn pass_totals(addr: &str) -> anyhow::Result<(f64, f64)> {
    let socket = addr
        .parse()
        .with_context(|| format!("metrics address {addr}"))?;
    let (status, body) = node_agent::observe::http_get(socket, "/metrics")
        .await
        .with_context(|| format!("scraping http://{addr}/metrics"))?;
    ensure!(status == 200, "http://{addr}/metrics answered {status}");
    let sample = |name: &str| {
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .with_context(|| format!("http://{addr}/metrics has no {name}"))
    };
    Ok((
        sample("gpucp_scheduler_pass_duration_seconds_count")?,
        sample("gpucp_scheduler_pass_duration_seconds_sum")?,
    ))
}

/// The pending queue: `bench scheduler`'s mix, with its CPU-only jobs asking for a GPU as
/// well (on a fleet full of GPU work they would still find free CPUs and start, and the queue
/// would not hold still).
fn pending_jobs(n: usize, first_id: u64) -> Vec<JobSpec> {
    crate::synthetic::mixed_jobs(n, 42, first_id)
        .into_iter()
        .map(|mut spec| {
            if spec.gpus_per_task == 0 && spec.gpu_milli == 0 {
                make_one_gpu(&mut spec);
            }
            spec
        })
        .collect()
}

/// Turns `spec` into a one-GPU job with the CPU and memory the synthetic mixes give one GPU
/// (`synthetic::job_spec`), keeping everything else.
fn make_one_gpu(spec: &mut JobSpec) {
    let one = crate::synthetic::job_spec(0, 0, (1, 1, 0), "normal", 0);
    spec.gpus_per_task = 1;
    spec.gpu_milli = 0;
    spec.cpu_milli_per_task = one.cpu_milli_per_task;
    spec.memory_mib_per_task = one.memory_mib_per_task;
}

/// The child: builds the state in `dir` and measures the pass and the snapshot on it.
fn build(
    dir: &Path,
    hosts: usize,
    pending: usize,
    runs: usize,
) -> anyhow::Result<serde_json::Value> {
    let mut a = Applier::create(dir)?;
    let started = Instant::now();
    let nodes = a.register_fleet(START_MS, hosts)?;
    let (packed, _, at) = a.fill_fleet(&nodes, 0, usize::MAX, START_MS)?;
    // The packer leaves a host's last GPUs free when the next job is larger: one-GPU jobs
    // take them, so that the fleet is full.
    let holes: Vec<TaskPlacement> = {
        let data = a.sm.read();
        nodes
            .iter()
            .flat_map(|n| {
                n.gpus
                    .iter()
                    .filter(|g| !data.cluster.gpu_holder.contains_key(&g.uuid))
                    .map(|g| TaskPlacement {
                        node: n.name.clone(),
                        gpus: vec![g.uuid.clone()],
                    })
            })
            .collect()
    };
    let topped_up = holes
        .into_iter()
        .enumerate()
        .map(|(k, task)| {
            let (mut spec, key) = job(packed + k);
            make_one_gpu(&mut spec);
            (spec, Some(key), task)
        })
        .collect();
    let (holes_filled, _, mut at) = a.run_jobs(topped_up, at)?;
    let running = packed + holes_filled;
    // Every tenant's guarantee covers what it holds: no quota reclaim moves the queue.
    let held: Vec<(String, u32)> = {
        let data = a.sm.read();
        let c = &data.cluster;
        let mut by_tenant = std::collections::BTreeMap::<String, u32>::new();
        for job in c.jobs.values().filter(|j| !j.state.is_final()) {
            *by_tenant.entry(job.spec.tenant.clone()).or_default() +=
                job.spec.gpus_per_task * job.spec.tasks;
        }
        by_tenant.into_iter().collect()
    };
    let share = (nodes.iter().map(|n| n.gpus.len()).sum::<usize>() / 8) as u32;
    for (name, gpus) in held {
        a.push(
            at,
            Command::PutTenant {
                tenant: Tenant {
                    name,
                    weight: 1,
                    quota_gpus: gpus.max(share),
                    max_gpus: 0,
                },
            },
        )?;
    }
    at += MINUTE_MS;
    let first_id = a.sm.read().cluster.last_job_id + 1;
    for (k, spec) in pending_jobs(pending, first_id).into_iter().enumerate() {
        // A thousand submissions a second.
        a.push(at + k as u64, Command::submit(spec, None))?;
    }
    a.flush()?;
    at += pending as u64 + MINUTE_MS;
    let apply_seconds = started.elapsed().as_secs_f64();
    let (rss_mib, _) = memory_mib()?;

    // The leader's pass over this state, as `leader::schedule_once` runs it.
    let policy = Policy::default();
    let data = a.sm.read();
    let c = &data.cluster;
    let waiting = c.index.pending.len();
    let mut times = Vec::with_capacity(runs);
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let result = plan_explained(c, at, &policy);
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        last = Some(result);
    }
    let (plan, _, reasons) = last.context("no pass ran")?;
    let summary = json!({
        "gpus": c.total_gpus(),
        "running": running,
        "free_gpus": c.total_gpus().saturating_sub(c.gpu_holder.len()),
        "pending": waiting,
        "entries": a.entries,
        "apply_seconds": apply_seconds,
        "pass_ms": super::bench::summary(times),
        "plan_placements": plan.placements.len(),
        "plan_preemptions": plan.preemptions.len(),
        "reservation": plan.reservation.is_some(),
        "jobs_considered": reasons.jobs_considered,
        "jobs_with_reasons": reasons.jobs.len(),
        "vm_rss_mib": rss_mib,
    });
    drop(data);

    // The snapshot the replica builds of it.
    let hwm_reset = reset_hwm();
    let t = Instant::now();
    let mut builder = a.sm.clone();
    let snapshot = a
        .runtime
        .block_on(builder.build_snapshot())
        .context("building the snapshot")?;
    let snapshot_seconds = t.elapsed().as_secs_f64();
    let snapshot_bytes = snapshot.snapshot.len();
    drop(snapshot);
    let (_, hwm_snapshot) = memory_mib()?;
    let mut out = summary;
    out["snapshot_seconds"] = json!(snapshot_seconds);
    out["snapshot_locked_seconds"] = json!(a.sm.last_snapshot_locked().as_secs_f64());
    out["snapshot_mib"] = json!(snapshot_bytes as f64 / (1024.0 * 1024.0));
    out["vm_hwm_snapshot_mib"] = if hwm_reset {
        json!(hwm_snapshot)
    } else {
        json!(null)
    };
    Ok(out)
}
