//! `gpuctl bench`: measurements anyone can rerun against a local cluster of real replica
//! processes (this binary's `replica` subcommand) with durable storage on loopback.
//!
//! - `failover` (`bench_failover`): SIGKILL the leader while simulated hosts run a steady job
//!   stream; time to a new leader, to the first commit and to the first placement after the
//!   kill. Repeated `--kills` times, reported as p50/p99/max.
//! - `placement` (`bench_placement`): committed placements per second for a burst of one-GPU
//!   jobs on a fleet of simulated hosts (`bench_hosts`).
//! - `submit`: submission latency at fixed offered rates, open loop, through a follower and
//!   through the leader (`bench_submit`).
//! - `scheduler`: one scheduling pass, in process (`bench_scheduler`).
//! - `e2e`: end-to-end jobs per second on simulated hosts running real agents, side by side
//!   with Slurm (`bench_e2e`, `bench_slurm`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use crate::local_cluster::{LocalCluster, free_ports};

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Leader failover: SIGKILL the leader repeatedly while simulated hosts run a steady job
    /// stream, and time the recovery (new leader, first commit, first placement).
    Failover {
        #[arg(long, default_value_t = 20)]
        kills: usize,
        /// Extra flags for every replica (e.g. "--election-min-ms 150 --election-max-ms 300").
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
        /// Simulated 8-GPU hosts finishing each job as soon as it is assigned.
        #[arg(long, default_value_t = 32)]
        hosts: usize,
        /// Submissions per second of the steady job stream.
        #[arg(long, default_value_t = 200)]
        rate: u64,
    },
    /// Committed placements per second: a burst of one-GPU jobs on simulated hosts.
    Placement {
        /// Simulated hosts, registered through the agent API (no processes).
        #[arg(long, default_value_t = 1000)]
        hosts: usize,
        /// One-GPU jobs in the burst.
        #[arg(long, default_value_t = 100_000)]
        jobs: usize,
        /// Simulated host preset.
        #[arg(long, default_value = "dgx-h100")]
        preset: String,
        /// Hosts report each job started and succeeded as soon as it is assigned, so GPUs turn
        /// over (auto: when the burst has more jobs than the fleet has GPUs).
        #[arg(long, value_enum, default_value = "auto")]
        finish: super::bench_placement::Finish,
        /// Submissions in flight at once while the burst is queued.
        #[arg(long, default_value_t = 256)]
        submit_concurrency: usize,
        /// Heartbeat period of each host (default: half the lease the control plane grants).
        #[arg(long, value_name = "MS")]
        heartbeat_ms: Option<u64>,
    },
    /// Submission latency at fixed offered rates (open loop) through three replicas.
    Submit {
        /// Offered rates in submissions per second (comma-separated; each is run in turn).
        #[arg(long, default_value = "100,1000,5000", value_delimiter = ',')]
        rates: Vec<u64>,
        /// Replica the client is pinned to: follower (forwards to the leader), leader, or both.
        #[arg(
            long,
            value_enum,
            default_value = "follower,leader",
            value_delimiter = ','
        )]
        via: Vec<super::bench_submit::Via>,
        /// Seconds of load per (rate, via) run.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Extra flags for every replica (e.g. "--election-min-ms 500 --election-max-ms 1000"
        /// to keep a heavily loaded machine from electing new leaders mid-run).
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
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
    /// Memory of one replica's state machine with a large fleet and a long job history,
    /// finished jobs compacted by the default retention (in child processes; no replicas).
    Memory {
        /// 8-GPU hosts.
        #[arg(long, default_value_t = 10_000)]
        hosts: usize,
        /// Jobs submitted over the run (all but the last wave finish).
        #[arg(long, default_value_t = 1_000_000)]
        jobs: usize,
        /// Also measure the same history without compaction.
        #[arg(long)]
        also_uncompacted: bool,
        /// Internal: the measuring child's phase (build or load).
        #[arg(long, hide = true)]
        phase: Option<String>,
        /// Internal: the child's data directory.
        #[arg(long, hide = true)]
        dir: Option<PathBuf>,
        /// Internal: the child applies no `CompactJobs`.
        #[arg(long, hide = true)]
        no_compaction: bool,
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
    if let BenchCommand::Memory {
        hosts,
        jobs,
        also_uncompacted,
        phase,
        dir,
        no_compaction,
    } = command
    {
        let (text, json) = super::bench_memory::run(super::bench_memory::Args {
            hosts,
            jobs,
            also_uncompacted,
            phase,
            dir,
            compaction: !no_compaction,
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
    if let BenchCommand::Failover { replica_args, .. } | BenchCommand::Submit { replica_args, .. } =
        &command
    {
        cluster.extra_args = replica_args.split_whitespace().map(str::to_owned).collect();
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        match command {
            BenchCommand::Failover {
                kills, hosts, rate, ..
            } => {
                let args = super::bench_failover::Args { kills, hosts, rate };
                let (text, json) = super::bench_failover::run(&mut cluster, args).await?;
                Ok::<_, anyhow::Error>(Report { text, json })
            }
            BenchCommand::Placement {
                hosts,
                jobs,
                preset,
                finish,
                submit_concurrency,
                heartbeat_ms,
            } => {
                let args = super::bench_placement::Args {
                    hosts,
                    jobs,
                    preset,
                    finish,
                    submit_concurrency,
                    heartbeat: heartbeat_ms.map(Duration::from_millis),
                };
                let (text, json) = super::bench_placement::run(&cluster, args).await?;
                Ok(Report { text, json })
            }
            BenchCommand::Submit {
                rates,
                via,
                seconds,
                ..
            } => {
                let args = super::bench_submit::Args {
                    rates,
                    vias: via,
                    duration: Duration::from_secs(seconds),
                };
                let (text, json) = super::bench_submit::run(&cluster, args).await?;
                Ok(Report { text, json })
            }
            BenchCommand::Scheduler { .. }
            | BenchCommand::Memory { .. }
            | BenchCommand::E2e { .. } => {
                unreachable!("runs in process, above")
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

pub(super) fn summary(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(|a, b| a.total_cmp(b));
    json!({
        "p50": percentile(&v, 50.0),
        "p99": percentile(&v, 99.0),
        "max": v.last().copied().unwrap_or(f64::NAN),
        "mean": v.iter().sum::<f64>() / v.len().max(1) as f64,
        "n": v.len(),
    })
}

pub(super) fn submit_request(i: u64, key_prefix: &str) -> pb::SubmitJobRequest {
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
