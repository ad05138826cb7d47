//! `gpuctl bench`: measurements anyone can rerun against a local cluster of real replica
//! processes (this binary's `replica` subcommand) with durable storage on loopback.
//!
//! - `failover`: SIGKILL the leader while writes flow; time to a new leader and to the first
//!   write committed after the kill. Repeated `--kills` times (the killed replica restarts and
//!   catches up between rounds), reported as p50/p99/max.
//! - `submit`: committed submissions per second and their latency with `--clients` concurrent
//!   clients, each waiting for its write to commit before sending the next.
//! - `scheduler`: one scheduling pass, in process (`bench_scheduler`).
//! - `e2e`: end-to-end jobs per second on simulated hosts running real agents, side by side
//!   with Slurm (`bench_e2e`, `bench_slurm`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::output::{Format, table};
use crate::client::{Client, with_timeout};
use crate::local_cluster::{LocalCluster, StartMode, free_ports};

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Leader failover: SIGKILL the leader repeatedly and time the recovery.
    Failover {
        #[arg(long, default_value_t = 20)]
        kills: usize,
        /// Extra flags for every replica (e.g. "--election-min-ms 150 --election-max-ms 300").
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
    },
    /// Committed submissions per second through three replicas.
    Submit {
        /// Concurrent clients (comma-separated list runs each in turn).
        #[arg(long, default_value = "1,64", value_delimiter = ',')]
        clients: Vec<usize>,
        /// Seconds of load per client count.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
    },
    /// One scheduling pass, in process, on synthetic fleets (no replicas started).
    Scheduler {
        /// Fleet sizes in 8-GPU hosts (comma-separated).
        #[arg(long, default_value = "1000,10000", value_delimiter = ',')]
        hosts: Vec<usize>,
        /// Pending jobs (comma-separated).
        #[arg(long, default_value = "1000,10000", value_delimiter = ',')]
        jobs: Vec<usize>,
        /// Passes timed per case.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Fleet states: empty (every job placed), half (half the GPUs in use), full (every
        /// job blocked: reservation and preemption are computed).
        #[arg(long, default_value = "empty,half,full", value_delimiter = ',')]
        fleets: Vec<String>,
    },
    /// End to end, ours and Slurm's side by side: jobs of `sleep 0` on one GPU each, from
    /// release to all completed, on simulated hosts running real agents (Slurm: real slurmds).
    E2e {
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        /// 1, 4 or 8 (the simulated host presets).
        #[arg(long, default_value_t = 8)]
        gpus_per_host: usize,
        #[arg(long, default_value_t = 2000)]
        jobs: usize,
        /// Run our side only (Slurm is neither installed nor started).
        #[arg(long)]
        skip_slurm: bool,
    },
}

pub fn run(command: BenchCommand, keep_data: Option<PathBuf>, fmt: Format) -> anyhow::Result<()> {
    if let BenchCommand::E2e {
        hosts,
        gpus_per_host,
        jobs,
        skip_slurm,
    } = command
    {
        let args = super::bench_e2e::Args {
            hosts,
            gpus_per_host,
            jobs,
            skip_slurm,
        };
        return super::bench_e2e::run(args, keep_data, fmt);
    }
    if let BenchCommand::Scheduler {
        hosts,
        jobs,
        runs,
        fleets,
    } = command
    {
        let (text, json) = super::bench_scheduler::run(super::bench_scheduler::Args {
            hosts,
            jobs,
            runs: runs.max(1),
            fleets,
        })?;
        match fmt {
            Format::Json => println!("{json}"),
            Format::Table => print!("{text}"),
        }
        return Ok(());
    }
    let tmp = tempfile::Builder::new().prefix("gpucp-bench-").tempdir()?;
    let dir = keep_data.unwrap_or_else(|| tmp.path().to_owned());
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let ports = free_ports(3)?;
    let mut cluster = LocalCluster::new(&exe, &["replica"], &dir, "bench", &ports);
    if let BenchCommand::Failover { replica_args, .. } = &command {
        cluster.extra_args = replica_args.split_whitespace().map(str::to_owned).collect();
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        match command {
            BenchCommand::Failover { kills, .. } => failover(&mut cluster, kills).await,
            BenchCommand::Submit { clients, seconds } => {
                submit(&cluster, &clients, Duration::from_secs(seconds)).await
            }
            BenchCommand::Scheduler { .. } | BenchCommand::E2e { .. } => {
                unreachable!("runs on its own, above")
            }
        }
    })?;
    match fmt {
        Format::Json => println!("{}", result.json),
        Format::Table => print!("{}", result.text),
    }
    Ok(())
}

struct Report {
    text: String,
    json: serde_json::Value,
}

/// Percentile by nearest rank over a sorted slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(|a, b| a.total_cmp(b));
    json!({
        "p50": percentile(&v, 50.0),
        "p99": percentile(&v, 99.0),
        "max": v.last().copied().unwrap_or(f64::NAN),
        "mean": v.iter().sum::<f64>() / v.len().max(1) as f64,
        "n": v.len(),
    })
}

fn submit_request(i: u64, key_prefix: &str) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        spec: Some(pb::JobSpec {
            tenant: "bench".into(),
            name: format!("bench-{i}"),
            command: vec!["sleep".into(), "0".into()],
            gpus_per_task: 1,
            tasks: 1,
            priority_class: "normal".into(),
            ..Default::default()
        }),
        idempotency_key: format!("{key_prefix}-{i}"),
    }
}

async fn failover(cluster: &mut LocalCluster, kills: usize) -> anyhow::Result<Report> {
    let mut to_leader = Vec::new();
    let mut to_commit = Vec::new();
    let mut seq = 0u64;
    for round in 0..kills {
        let before = cluster.wait_for_leader(Duration::from_secs(30)).await?;
        // Warm: one committed write so every replica is current before the kill.
        let mut client = cluster.client()?;
        seq += 1;
        let req = submit_request(seq, "warm");
        client
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.submit_job(with_timeout(r, t)).await }
            })
            .await?;
        for id in cluster.replicas.keys().copied().collect::<Vec<_>>() {
            wait_applied(cluster, id, before.commit_index).await?;
        }

        let killed = before.leader;
        let survivors: Vec<String> = cluster
            .replicas
            .values()
            .filter(|r| r.id != killed)
            .map(|r| r.addr.clone())
            .collect();
        let mut probe = Client::new(&survivors)?;
        probe.attempt_timeout = Duration::from_millis(300);
        probe.deadline = Duration::from_secs(30);
        let t0 = Instant::now();
        cluster.kill(killed)?;

        // Writes through the survivors until one commits; a status poller notes the new leader.
        let leader_watch = {
            let addrs = survivors.clone();
            tokio::spawn(async move {
                loop {
                    for a in &addrs {
                        if let Ok(mut c) = Client::new(std::slice::from_ref(a)) {
                            c.deadline = Duration::from_millis(100);
                            c.attempt_timeout = Duration::from_millis(100);
                            if let Ok(s) = c
                                .call(|mut c, t| async move {
                                    c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
                                        .await
                                })
                                .await
                                && s.leader != 0
                                && s.leader != killed
                                && s.term > before.term
                            {
                                return (Instant::now(), s.leader);
                            }
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        seq += 1;
        let req = submit_request(seq, "probe");
        probe
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.submit_job(with_timeout(r, t)).await }
            })
            .await?;
        let committed = t0.elapsed();
        let (elected_at, new_leader) = leader_watch.await?;
        let elected = elected_at.duration_since(t0).min(committed);
        to_leader.push(elected.as_secs_f64() * 1000.0);
        to_commit.push(committed.as_secs_f64() * 1000.0);
        eprintln!(
            "kill {}/{kills}: leader {killed} killed; replica {new_leader} leads after {:.0} ms; first commit after {:.0} ms",
            round + 1,
            elected.as_secs_f64() * 1000.0,
            committed.as_secs_f64() * 1000.0
        );
        cluster.start(killed, StartMode::Initial)?;
    }
    let j = json!({
        "benchmark": "failover",
        "kills": kills,
        "to_new_leader_ms": summary(to_leader.clone()),
        "to_first_commit_ms": summary(to_commit.clone()),
    });
    let row = |name: &str, v: &serde_json::Value| {
        vec![
            name.to_owned(),
            format!("{:.0}", v["p50"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.0}", v["p99"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.0}", v["max"].as_f64().unwrap_or(f64::NAN)),
        ]
    };
    let text = table(
        &[
            "FROM SIGKILL OF THE LEADER TO",
            "P50_MS",
            "P99_MS",
            "MAX_MS",
        ],
        &[
            row("a new leader", &j["to_new_leader_ms"]),
            row("first committed write", &j["to_first_commit_ms"]),
        ],
    );
    Ok(Report {
        text: format!("{kills} leader kills, 3 replicas\n{text}"),
        json: j,
    })
}

async fn wait_applied(cluster: &LocalCluster, id: u64, index: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = cluster.status(id).await
            && s.applied_index >= index
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("replica {id} did not catch up to index {index}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn submit(
    cluster: &LocalCluster,
    client_counts: &[usize],
    duration: Duration,
) -> anyhow::Result<Report> {
    let mut rows = Vec::new();
    let mut results = Vec::new();
    for (run, &clients) in client_counts.iter().enumerate() {
        if clients == 0 {
            bail!("--clients must be at least 1");
        }
        let start = Instant::now();
        let mut tasks = Vec::new();
        for c in 0..clients {
            let mut client = cluster.client()?;
            // Spread clients over replicas, as real users would be.
            for _ in 0..c % 3 {
                client
                    .call(|mut c, t| async move {
                        c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
                            .await
                    })
                    .await
                    .ok();
            }
            let prefix = format!("run{run}-client{c}");
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut i = 0u64;
                while start.elapsed() < duration {
                    i += 1;
                    let req = submit_request(i, &prefix);
                    let t = Instant::now();
                    client
                        .call(|mut c, to| {
                            let r = req.clone();
                            async move { c.submit_job(with_timeout(r, to)).await }
                        })
                        .await?;
                    latencies.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                Ok::<_, tonic::Status>(latencies)
            }));
        }
        let mut latencies = Vec::new();
        for t in tasks {
            latencies.extend(t.await??);
        }
        let elapsed = start.elapsed().as_secs_f64();
        let per_sec = latencies.len() as f64 / elapsed;
        let lat = summary(latencies.clone());
        rows.push(vec![
            clients.to_string(),
            latencies.len().to_string(),
            format!("{per_sec:.0}"),
            format!("{:.1}", lat["p50"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.1}", lat["p99"].as_f64().unwrap_or(f64::NAN)),
        ]);
        results.push(json!({"clients": clients, "committed": latencies.len(), "per_sec": per_sec, "latency_ms": lat}));
    }
    let text = table(
        &["CLIENTS", "COMMITTED", "PER_SEC", "P50_MS", "P99_MS"],
        &rows,
    );
    Ok(Report {
        text: format!("committed submissions through 3 replicas (durable, loopback)\n{text}"),
        json: json!({"benchmark": "submit", "runs": results}),
    })
}
