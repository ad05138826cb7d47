//! `gpuctl bench rollout`: an agent rollout across a fleet of simulated GPU hosts, each a real
//! agent process with real workloads, measured as an operator would judge it.
//!
//! Three replicas and `--hosts` agents run from a binary installed under the run's directory.
//! Every host runs `--jobs-per-host` long jobs (each host has a partition of its own, so the
//! jobs are spread evenly). A fresh copy of the binary is then installed at the agents' path
//! (a new file renamed over the old, as a package upgrade does) and every agent is restarted
//! in place with `gpuctl node restart-agent --all --max-unavailable N`'s code, while a steady
//! stream of short jobs is submitted round-robin to every host's partition. Reported: the
//! rollout's total time and each agent's time until ready again; long jobs restarted (any
//! that left `running` or ran a second time: the target is 0); short jobs refused at submit,
//! requeued, or not succeeded; and agents still running the old file afterwards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::agent_rollout;
use super::output::{Format, table};
use crate::client::{Client, with_timeout};
use crate::local_cluster::{LocalCluster, free_ports};

/// Simulated 8-GPU host presets, used in turn.
const PRESETS: [&str; 3] = ["dgx-h100", "pcie-8gpu-2socket", "dgx1-v100"];
const TENANT: &str = "default";
/// Longest wait for hosts to register, jobs to start, short jobs to finish.
const WAIT: Duration = Duration::from_secs(120);

pub struct Args {
    pub hosts: usize,
    pub max_unavailable: usize,
    pub jobs_per_host: usize,
    /// Short jobs submitted per second during the rollout.
    pub rate: u64,
    pub replica_args: Vec<String>,
}

/// Agents started at once: every agent of a fleet starting in the same instant would
/// measure the 2-core benchmark host's start-up burst, not the rollout.
const START_BATCH: usize = 8;

fn partition_of(host: &str) -> String {
    format!("p-{host}")
}

pub fn run(args: Args, keep_data: Option<PathBuf>, fmt: Format) -> anyhow::Result<()> {
    if args.hosts == 0 || args.max_unavailable == 0 {
        bail!("--hosts and --max-unavailable must be at least 1");
    }
    if args.jobs_per_host > 8 {
        bail!("--jobs-per-host: the simulated hosts have 8 GPUs");
    }
    let tmp;
    let dir = match keep_data {
        Some(d) => {
            std::fs::create_dir_all(&d)?;
            d
        }
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_owned()
        }
    };
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let bin_dir = dir.join("bin");
    std::fs::create_dir_all(&bin_dir)?;
    let agent_program = bin_dir.join("gpuctl");
    install(&exe, &agent_program)?;

    let ports = free_ports(3 + args.hosts)?;
    let mut cluster = LocalCluster::new(&exe, &["replica"], &dir, "bench-rollout", &ports[..3]);
    cluster.extra_args = args.replica_args.clone();
    cluster.agent_program = Some((agent_program.clone(), vec!["agent".into()]));
    let hosts: Vec<String> = (1..=args.hosts).map(|i| format!("host-{i}")).collect();
    for (i, (name, port)) in hosts.iter().zip(&ports[3..]).enumerate() {
        let partition = partition_of(name);
        cluster.add_agent(
            name,
            PRESETS[i % PRESETS.len()],
            *port,
            &["--stop-grace-secs", "5", "--partition", &partition],
        );
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let figures = runtime.block_on(async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        let mut client = cluster.client()?;
        for batch in hosts.chunks(START_BATCH) {
            for name in batch {
                cluster.start_agent(name)?;
            }
            wait_ready(&mut client, batch).await.with_context(|| {
                format!(
                    "the hosts did not register; see the agent logs in {}",
                    dir.display()
                )
            })?;
        }
        let long = start_long_jobs(&mut client, &hosts, args.jobs_per_host).await?;
        let before = long_job_runs(&mut client, &long).await?;
        let pids: BTreeMap<String, u32> = hosts
            .iter()
            .filter_map(|h| cluster.agents[h].pid().map(|p| (h.clone(), p)))
            .collect();

        install(&exe, &agent_program)?;
        let stop_load = Arc::new(AtomicBool::new(false));
        let load = tokio::spawn(short_load(
            cluster.client()?,
            hosts.iter().map(|h| partition_of(h)).collect(),
            args.rate,
            stop_load.clone(),
        ));
        let report = agent_rollout::rollout(
            &client,
            &hosts,
            args.max_unavailable,
            Duration::from_secs(60),
            false,
            |_| {},
        )
        .await;
        stop_load.store(true, Ordering::SeqCst);
        let load = load.await??;
        let short = finish_short_jobs(&mut client, &load.ids).await?;

        let after = long_job_runs(&mut client, &long).await?;
        let restarted = long
            .iter()
            .filter(|id| before.get(id) != after.get(id) || after.get(id).is_none_or(|r| r.0 != 1))
            .count();
        let on_old_binary = pids
            .iter()
            .filter(|(_, pid)| !runs_file(**pid, &agent_program))
            .count();
        cancel_all(&mut client, &long).await;
        anyhow::Ok(Figures {
            report,
            long_jobs: long.len(),
            long_restarted: restarted,
            submitted: load.ids.len(),
            refused: load.refused,
            short,
            on_old_binary,
        })
    })?;
    print_figures(&args, &figures, fmt);
    drop(cluster);
    Ok(())
}

struct Figures {
    report: agent_rollout::RolloutReport,
    long_jobs: usize,
    long_restarted: usize,
    submitted: usize,
    refused: usize,
    short: ShortOutcome,
    on_old_binary: usize,
}

/// Installs a copy of `from` at `to` as a package upgrade does: a new file (a new inode)
/// renamed over the old, so running agents keep the old one until they restart.
fn install(from: &Path, to: &Path) -> anyhow::Result<()> {
    let tmp = to.with_extension("installing");
    std::fs::copy(from, &tmp).with_context(|| format!("copying {}", from.display()))?;
    std::fs::rename(&tmp, to).with_context(|| format!("installing {}", to.display()))?;
    Ok(())
}

/// Whether process `pid` runs the file now at `path` (and not a replaced, deleted one).
fn runs_file(pid: u32, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let exe = std::fs::metadata(format!("/proc/{pid}/exe"));
    let file = std::fs::metadata(path);
    matches!((exe, file), (Ok(a), Ok(b)) if a.ino() == b.ino() && a.dev() == b.dev())
}

async fn list_nodes(client: &mut Client) -> anyhow::Result<Vec<pb::Node>> {
    Ok(client
        .call(|mut c, t| async move {
            c.list_nodes(with_timeout(pb::ListNodesRequest::default(), t))
                .await
        })
        .await?
        .nodes)
}

async fn wait_ready(client: &mut Client, hosts: &[String]) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT;
    loop {
        let nodes = list_nodes(client).await?;
        let ready = nodes.iter().filter(|n| n.status == "ready").count();
        if hosts
            .iter()
            .all(|h| nodes.iter().any(|n| &n.name == h && n.status == "ready"))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{ready} of {} hosts ready after {WAIT:?}", hosts.len());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn job(name: String, partition: String, command: Vec<String>) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        idempotency_key: name.clone(),
        spec: Some(pb::JobSpec {
            tenant: TENANT.into(),
            name,
            command,
            gpus_per_task: 1,
            tasks: 1,
            partition,
            priority_class: "normal".into(),
            ..Default::default()
        }),
    }
}

async fn submit(client: &mut Client, req: pb::SubmitJobRequest) -> Result<u64, tonic::Status> {
    client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.submit_job(with_timeout(r, t)).await }
        })
        .await
        .map(|r| r.id)
}

/// Cancels the long jobs (their agents stop them) so none outlives the benchmark.
async fn cancel_all(client: &mut Client, ids: &[u64]) {
    for id in ids {
        let req = pb::CancelJobRequest {
            id: *id,
            reason: "bench rollout done".into(),
            ..Default::default()
        };
        let _ = client
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.cancel_job(with_timeout(r, t)).await }
            })
            .await;
    }
}

/// `per_host` jobs on every host, each one sleeping process (128 polling loops would spend
/// the 2-core benchmark host on process spawns, starving the replicas measured); waits
/// until all run.
async fn start_long_jobs(
    client: &mut Client,
    hosts: &[String],
    per_host: usize,
) -> anyhow::Result<Vec<u64>> {
    let script = "exec sleep 86400".to_owned();
    let mut ids = Vec::new();
    for h in hosts {
        for k in 0..per_host {
            let req = job(
                format!("long-{h}-{k}"),
                partition_of(h),
                vec!["sh".into(), "-c".into(), script.clone()],
            );
            ids.push(submit(client, req).await?);
        }
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let runs = long_job_runs(client, &ids).await?;
        let running = runs.values().filter(|r| r.1 == "running").count();
        if running == ids.len() {
            return Ok(ids);
        }
        if Instant::now() > deadline {
            bail!(
                "{running} of {} long jobs running after {WAIT:?}",
                ids.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn list_jobs(client: &mut Client) -> anyhow::Result<Vec<pb::Job>> {
    Ok(client
        .call(|mut c, t| async move {
            let req = pb::ListJobsRequest {
                include_finished: true,
                ..Default::default()
            };
            c.list_jobs(with_timeout(req, t)).await
        })
        .await?
        .jobs)
}

/// Job id → (times it entered `running`, current state).
async fn long_job_runs(
    client: &mut Client,
    ids: &[u64],
) -> anyhow::Result<BTreeMap<u64, (usize, String)>> {
    let wanted: std::collections::BTreeSet<u64> = ids.iter().copied().collect();
    Ok(list_jobs(client)
        .await?
        .into_iter()
        .filter(|j| wanted.contains(&j.id))
        .map(|j| {
            let runs = j.history.iter().filter(|h| h.state == "running").count();
            (j.id, (runs, j.state))
        })
        .collect())
}

struct Load {
    ids: Vec<u64>,
    refused: usize,
}

/// Short jobs at `rate` per second, round-robin over `partitions`, until `stop`.
async fn short_load(
    mut client: Client,
    partitions: Vec<String>,
    rate: u64,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Load> {
    let mut load = Load {
        ids: Vec::new(),
        refused: 0,
    };
    let period = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut tick = tokio::time::interval(period);
    let mut i = 0usize;
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let partition = partitions[i % partitions.len()].clone();
        let req = job(format!("short-{i}"), partition, vec!["true".into()]);
        match submit(&mut client, req).await {
            Ok(id) => load.ids.push(id),
            Err(_) => load.refused += 1,
        }
        i += 1;
    }
    Ok(load)
}

#[derive(Default)]
struct ShortOutcome {
    succeeded: usize,
    /// Placed more than once (an agent lost or refused the first placement).
    requeued: usize,
    /// Not succeeded within the wait.
    not_succeeded: usize,
}

async fn finish_short_jobs(client: &mut Client, ids: &[u64]) -> anyhow::Result<ShortOutcome> {
    let wanted: std::collections::BTreeSet<u64> = ids.iter().copied().collect();
    let deadline = Instant::now() + WAIT;
    loop {
        let jobs: Vec<pb::Job> = list_jobs(client)
            .await?
            .into_iter()
            .filter(|j| wanted.contains(&j.id))
            .collect();
        let done = jobs
            .iter()
            .filter(|j| {
                matches!(
                    j.state.as_str(),
                    "succeeded" | "failed" | "cancelled" | "timed_out"
                )
            })
            .count();
        if done == ids.len() || Instant::now() > deadline {
            let mut o = ShortOutcome::default();
            for j in &jobs {
                if j.state == "succeeded" {
                    o.succeeded += 1;
                }
                if j.history.iter().filter(|h| h.state == "scheduled").count() > 1 {
                    o.requeued += 1;
                }
            }
            o.not_succeeded = ids.len() - o.succeeded;
            return Ok(o);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn print_figures(args: &Args, f: &Figures, fmt: Format) {
    let mut down: Vec<u64> = f
        .report
        .restarted
        .iter()
        .filter_map(|r| r.result.as_ref().ok().map(|a| a.down_ms))
        .collect();
    down.sort_unstable();
    let failed: Vec<String> = f
        .report
        .failures()
        .map(|(n, e)| format!("{n}: {e}"))
        .collect();
    let json = json!({
        "hosts": args.hosts,
        "max_unavailable": args.max_unavailable,
        "replica_args": args.replica_args,
        "rollout_s": f.report.elapsed.as_secs_f64(),
        "agents_restarted": down.len(),
        "agents_failed": failed,
        "agents_not_started": f.report.not_started,
        "agents_on_old_binary": f.on_old_binary,
        "peak_unavailable": f.report.peak_unavailable,
        "agent_ready_ms": {"p50": percentile(&down, 0.5), "p99": percentile(&down, 0.99), "max": down.last().copied().unwrap_or(0)},
        "long_jobs": f.long_jobs,
        "long_jobs_restarted": f.long_restarted,
        "short_jobs_submitted": f.submitted,
        "short_jobs_refused": f.refused,
        "short_jobs_requeued": f.short.requeued,
        "short_jobs_not_succeeded": f.short.not_succeeded,
    });
    if fmt.is_json() {
        println!("{json}");
        return;
    }
    let rows = vec![
        vec![
            "hosts (real agent processes)".into(),
            args.hosts.to_string(),
        ],
        vec![
            "replica flags".into(),
            if args.replica_args.is_empty() {
                "(defaults)".into()
            } else {
                args.replica_args.join(" ")
            },
        ],
        vec!["max unavailable".into(), args.max_unavailable.to_string()],
        vec![
            "rollout time (check + restarts)".into(),
            format!("{:.1} s", f.report.elapsed.as_secs_f64()),
        ],
        vec![
            "agents restarted / failed / not started".into(),
            format!(
                "{} / {} / {}",
                down.len(),
                failed.len(),
                f.report.not_started.len()
            ),
        ],
        vec![
            "agents still on the old binary".into(),
            f.on_old_binary.to_string(),
        ],
        vec![
            "agent ready again after restart p50 / p99 / max".into(),
            format!(
                "{} / {} / {} ms",
                percentile(&down, 0.5),
                percentile(&down, 0.99),
                down.last().copied().unwrap_or(0)
            ),
        ],
        vec![
            "long jobs restarted (target 0)".into(),
            format!("{} of {}", f.long_restarted, f.long_jobs),
        ],
        vec![
            "short jobs during the rollout: submitted / refused at submit".into(),
            format!("{} / {}", f.submitted, f.refused),
        ],
        vec![
            "short jobs requeued / not succeeded".into(),
            format!("{} / {}", f.short.requeued, f.short.not_succeeded),
        ],
    ];
    print!("{}", table(&["FIGURE", "VALUE"], &rows));
    for line in failed {
        println!("FAILED {line}");
    }
}
