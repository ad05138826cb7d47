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
//! - `status-page`: rendering the status page's pages, in process (`bench_status_page`).
//! - `membership`: adding a replica to a cluster holding a large state (`bench_membership`).
//! - `scale`: one replica set holding a full fleet and a long queue, from 1,000 to 20,000 hosts:
//!   pass time, memory, snapshots, a wiped replica's rejoin (`bench_scale`).
//! - `e2e`: end-to-end jobs per second on simulated hosts running real agents, side by side
//!   with Slurm (`bench_e2e`, `bench_slurm`).
//! - `rollout`: an in-place agent rollout across a fleet of real agents running jobs
//!   (`bench_rollout`): time, jobs restarted, work refused.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use proto::v1 as pb;
use serde_json::json;

use super::output::{Format, table};
use crate::local_cluster::{LocalCluster, free_ports};

/// How the benchmark's cluster is secured. Several modes run one after the other, each on a
/// fresh cluster, and are reported side by side (the cost of TLS, measured in one run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Security {
    /// Mutual TLS on every connection, tokens and roles checked: how the cluster runs.
    Tls,
    /// Plaintext, nothing authenticated (`--insecure`).
    Insecure,
}

impl Security {
    fn name(self) -> &'static str {
        match self {
            Security::Tls => "tls",
            Security::Insecure => "insecure",
        }
    }
}

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
        /// Keep one core busy with a spinning process for the whole run (a loaded host).
        #[arg(long)]
        cpu_hog: bool,
        /// After the kills, let the work flow this long without faults and count the
        /// elections that happen anyway (e.g. `30m`; default: none).
        #[arg(long, value_parser = humantime::parse_duration)]
        steady: Option<Duration>,
        /// tls, insecure, or both (`tls,insecure`: side by side, each on a fresh cluster).
        #[arg(long, value_enum, default_value = "tls", value_delimiter = ',')]
        security: Vec<Security>,
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
        /// insecure (the default: thousands of simulated hosts share connections in one
        /// process) or tls (each host with its own certificate and connections).
        #[arg(long, value_enum, default_value = "insecure", value_delimiter = ',')]
        security: Vec<Security>,
        /// Also compare the log's JSON entries with a protobuf encoding of the same entries
        /// (bytes, encode, decode, decode + apply), on the entries this run committed, read
        /// back from a follower's log after the run. The replicas then keep their whole log
        /// (no snapshots during the run).
        #[arg(long)]
        encoding_compare: bool,
        /// Run twice, with every replica's metrics exporter on (`--metrics-listen`, scraped
        /// every second) and off, on fresh clusters, and report both and their ratio.
        #[arg(long)]
        metrics_compare: bool,
    },
    /// Submission latency at fixed offered rates (open loop) through three replicas.
    Submit {
        /// Offered rates in submissions per second (comma-separated; each is run in turn).
        /// Default 100,1000,5000 unless --clients is given.
        #[arg(long, value_delimiter = ',')]
        rates: Option<Vec<u64>>,
        /// Closed loop instead: this many concurrent clients, spread over the replicas, each
        /// sending its next submission once the last is committed (comma-separated counts).
        #[arg(long, value_delimiter = ',')]
        clients: Vec<usize>,
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
        /// tls, insecure, or both (`tls,insecure`: side by side, each on a fresh cluster).
        #[arg(long, value_enum, default_value = "tls", value_delimiter = ',')]
        security: Vec<Security>,
        /// Run twice, with every replica's metrics exporter on (`--metrics-listen`, scraped
        /// every second) and off, on fresh clusters, and report both and their ratio.
        #[arg(long)]
        metrics_compare: bool,
        /// Side by side with etcd in the same run: a three-member etcd on loopback (installed
        /// from Debian's `etcd-server` if missing), puts of a job-sized value against our
        /// committed submissions, closed loop at each --clients count (default 1,64,256).
        #[arg(long)]
        etcd_compare: bool,
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
        /// Placement scores to time on each fleet and queue (comma-separated, e.g.
        /// `fgd,fgd-h`; default the scheduler's own, fgd-h).
        #[arg(long, value_delimiter = ',')]
        placement_score: Vec<crate::scheduler::score::ScorePolicy>,
    },
    /// Rendering the status page (the node grid and every other page), in process, on a
    /// synthetic fleet of 8-GPU hosts with most GPUs held (no replicas started).
    StatusPage {
        /// 8-GPU hosts.
        #[arg(long, default_value_t = 1000)]
        hosts: usize,
        /// Renderings timed per page.
        #[arg(long, default_value_t = 50)]
        runs: usize,
        /// Fraction of the GPUs held by running work.
        #[arg(long, default_value_t = 0.9)]
        fill: f64,
        /// Jobs left pending (with the reasons of a scheduling pass).
        #[arg(long, default_value_t = 200)]
        pending: usize,
        /// Write one rendering of each page here (nodes.html, ...), e.g. for screenshots.
        #[arg(long, value_name = "DIR")]
        html_dir: Option<PathBuf>,
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
    /// Adding a replica to a cluster holding a large state: a 3-replica cluster restored from
    /// a job history of `--jobs` jobs, a 4th replica added (`cluster add`): snapshot size, time
    /// to install and to promote, the leader's write gaps meanwhile, RSS, and `cluster snapshot
    /// save` of the same state.
    Membership {
        /// Job history sizes, one fresh cluster each (comma-separated).
        #[arg(long, default_value = "1000000", value_delimiter = ',')]
        jobs: Vec<usize>,
        /// 8-GPU hosts of the history (as `bench memory`).
        #[arg(long, default_value_t = 10_000)]
        hosts: usize,
        /// Extra flags for every replica.
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
    },
    /// One replica set holding a full fleet of 8-GPU hosts and a long pending queue, for each
    /// fleet size: the scheduling pass (in process and on the running leader), every
    /// replica's memory, the snapshot's build, `cluster snapshot save`, and a follower wiped
    /// and joining again (snapshot installed, voter). `--plot` draws the cost curve.
    Scale {
        /// Fleet sizes in 8-GPU hosts, one fresh cluster each (comma-separated).
        #[arg(
            long,
            default_value = "1000,2000,5000,10000,20000",
            value_delimiter = ','
        )]
        hosts: Vec<usize>,
        /// Jobs pending behind the full fleet.
        #[arg(long, default_value_t = 100_000)]
        pending: usize,
        /// In-process scheduling passes per size.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Seconds the running leader schedules the queue before its passes are read.
        #[arg(long, default_value_t = 15)]
        window_secs: u64,
        /// Extra flags for every replica.
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
        /// Write the cost curve over the sizes to this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Internal: the measuring child's phase (build).
        #[arg(long, hide = true)]
        phase: Option<String>,
        /// Internal: the child's data directory.
        #[arg(long, hide = true)]
        dir: Option<PathBuf>,
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
        /// Also run our side with the agents' cgroups off, and report what enforcement
        /// costs each job.
        #[arg(long)]
        without_cgroups_too: bool,
        /// Also run our side with every job in a container (an image of this host's
        /// `sleep`, built with the local Docker engine), and report what a container costs.
        #[arg(long)]
        with_containers_too: bool,
        /// Also run our side with each job's supervisor started by exec rather than forked
        /// by the agent's launcher (`node-agent --shim-start exec`), and report what the
        /// launcher saves each job.
        #[arg(long)]
        with_exec_shims_too: bool,
    },
    /// Agent rollout: every agent of a fleet of real agent processes (simulated GPUs, real
    /// jobs) restarted in place onto a newly installed binary, --max-unavailable at a time,
    /// while short jobs keep arriving. Reports time, jobs restarted, work refused.
    Rollout {
        #[arg(long, default_value_t = 64)]
        hosts: usize,
        #[arg(long, default_value_t = 8)]
        max_unavailable: usize,
        /// Long one-GPU jobs running on every host through the rollout.
        #[arg(long, default_value_t = 2)]
        jobs_per_host: usize,
        /// Short jobs submitted per second during the rollout, round-robin over the hosts.
        #[arg(long, default_value_t = 10)]
        rate: u64,
        /// Extra flags for every replica (e.g. "--election-min-ms 300 --election-max-ms 600").
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
    },
    /// Long-running services: restart after kill -9, replacement after a host is cut off,
    /// a rolling update, autoscaling (real agents, `gpuctl demo-server` replicas).
    Service {
        /// Simulated 8-GPU hosts (at least 2: a replica is replaced on another host).
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        /// Kills of a replica's process, and cut-offs of a replica's host.
        #[arg(long, default_value_t = 20)]
        tries: usize,
        /// Replicas of the rolling update.
        #[arg(long, default_value_t = 8)]
        replicas: u32,
        /// Extra flags for every replica (e.g. "--node-lease-ms 2000 --node-grace-ms 1000").
        #[arg(long, default_value = "", allow_hyphen_values = true)]
        replica_args: String,
    },
}

pub fn run(command: BenchCommand, keep_data: Option<PathBuf>, fmt: Format) -> anyhow::Result<()> {
    if let BenchCommand::Service {
        hosts,
        tries,
        replicas,
        replica_args,
    } = command
    {
        let args = super::bench_service::Args {
            hosts,
            tries,
            replicas,
            replica_args: replica_args.split_whitespace().map(str::to_owned).collect(),
        };
        return super::bench_service::run(args, keep_data, fmt);
    }
    if let BenchCommand::Rollout {
        hosts,
        max_unavailable,
        jobs_per_host,
        rate,
        replica_args,
    } = command
    {
        let args = super::bench_rollout::Args {
            hosts,
            max_unavailable,
            jobs_per_host,
            rate,
            replica_args: replica_args.split_whitespace().map(str::to_owned).collect(),
        };
        return super::bench_rollout::run(args, keep_data, fmt);
    }
    if let BenchCommand::E2e {
        hosts,
        gpus_per_host,
        jobs,
        skip_slurm,
        without_cgroups_too,
        with_containers_too,
        with_exec_shims_too,
    } = command
    {
        let args = super::bench_e2e::Args {
            hosts,
            gpus_per_host,
            jobs,
            skip_slurm,
            without_cgroups_too,
            with_containers_too,
            with_exec_shims_too,
        };
        return super::bench_e2e::run(args, keep_data, fmt);
    }
    if let BenchCommand::Scheduler {
        hosts,
        jobs,
        runs,
        fleets,
        placement_score,
    } = command
    {
        let (text, json) = super::bench_scheduler::run(super::bench_scheduler::Args {
            hosts,
            jobs,
            runs: runs.max(1),
            fleets,
            scoring: placement_score,
        })?;
        print_report(fmt, &text, &json);
        return Ok(());
    }
    if let BenchCommand::StatusPage {
        hosts,
        runs,
        fill,
        pending,
        html_dir,
    } = command
    {
        let (text, json) = super::bench_status_page::run(super::bench_status_page::Args {
            hosts,
            runs: runs.max(1),
            fill,
            pending,
            html_dir,
        })?;
        print_report(fmt, &text, &json);
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
        print_report(fmt, &text, &json);
        return Ok(());
    }
    if let BenchCommand::Membership {
        jobs,
        hosts,
        replica_args,
    } = command
    {
        let (text, json) = super::bench_membership::run(
            super::bench_membership::Args {
                jobs,
                hosts,
                replica_args: replica_args.split_whitespace().map(str::to_owned).collect(),
            },
            keep_data,
        )?;
        print_report(fmt, &text, &json);
        return Ok(());
    }
    if let BenchCommand::Scale {
        hosts,
        pending,
        runs,
        window_secs,
        replica_args,
        plot,
        phase,
        dir,
    } = command
    {
        let (text, json) = super::bench_scale::run(
            super::bench_scale::Args {
                hosts,
                pending,
                runs,
                window: Duration::from_secs(window_secs),
                replica_args: replica_args.split_whitespace().map(str::to_owned).collect(),
                plot,
                phase,
                dir,
            },
            keep_data,
        )?;
        print_report(fmt, &text, &json);
        return Ok(());
    }
    let tmp = tempfile::Builder::new().prefix("gpucp-bench-").tempdir()?;
    let dir = keep_data.unwrap_or_else(|| tmp.path().to_owned());
    let modes = match &command {
        BenchCommand::Failover { security, .. }
        | BenchCommand::Placement { security, .. }
        | BenchCommand::Submit { security, .. } => security.clone(),
        _ => vec![Security::Tls],
    };
    if modes.is_empty() {
        anyhow::bail!("--security must name tls, insecure or both");
    }
    let metrics_compare = matches!(
        command,
        BenchCommand::Placement {
            metrics_compare: true,
            ..
        } | BenchCommand::Submit {
            metrics_compare: true,
            ..
        }
    );
    // With --metrics-compare each mode runs with the exporter on, then off: the ratio is
    // on / off (below 1: metrics cost throughput). The first run of a process pays for cold
    // caches, so the order favours "off" if anything.
    let exporter: &[bool] = if metrics_compare {
        &[true, false]
    } else {
        &[false]
    };
    let mut reports = Vec::new();
    let bar = super::progress::bar((modes.len() * exporter.len()) as u64, "variants", fmt);
    for &mode in &modes {
        for &metrics in exporter {
            let name = match (metrics_compare, metrics) {
                (false, _) => mode.name().to_owned(),
                (true, true) => format!("{}+metrics", mode.name()),
                (true, false) => format!("{}-no-metrics", mode.name()),
            };
            // Each variant on a cluster of its own, one after the other, so they share the
            // machine's state (caches, other load) as closely as two runs can.
            let root = if modes.len() * exporter.len() == 1 {
                dir.clone()
            } else {
                dir.join(&name)
            };
            bar.set_message(name.clone());
            let report = run_on_cluster(&command, &root, mode, metrics)?;
            bar.inc(1);
            reports.push((name, report));
        }
    }
    bar.finish_and_clear();
    let (text, json) = if reports.len() == 1 {
        let (mode, r) = reports.pop().expect("one report");
        let mut json = r.json;
        json["security"] = json!(mode);
        (r.text, json)
    } else {
        side_by_side(&reports)
    };
    print_report(fmt, &text, &json);
    Ok(())
}

/// A benchmark's report as asked: its JSON object on one line, or its table.
fn print_report(fmt: Format, text: &str, json: &serde_json::Value) {
    match fmt {
        Format::Json | Format::Yaml => println!("{json}"),
        Format::Table | Format::Wide => print!("{text}"),
    }
}

/// Starts a three-replica cluster secured as `mode` under `root` and runs the benchmark on it.
fn run_on_cluster(
    command: &BenchCommand,
    root: &std::path::Path,
    mode: Security,
    metrics: bool,
) -> anyhow::Result<Report> {
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let ports = free_ports(3)?;
    let mut cluster = LocalCluster::new(&exe, &["replica"], root, "bench", &ports);
    if metrics {
        for (r, port) in cluster.replicas.values_mut().zip(free_ports(3)?) {
            r.metrics_addr = Some(format!("127.0.0.1:{port}"));
        }
    }
    if mode == Security::Insecure {
        cluster.set_insecure();
    }
    if let BenchCommand::Failover { replica_args, .. } | BenchCommand::Submit { replica_args, .. } =
        command
    {
        cluster.extra_args = replica_args.split_whitespace().map(str::to_owned).collect();
    }
    let encoding_compare = matches!(
        command,
        BenchCommand::Placement {
            encoding_compare: true,
            ..
        }
    );
    if encoding_compare {
        // Every entry of the run stays in the log, to be read back after it.
        cluster.extra_args = vec!["--snapshot-every".into(), "1000000000".into()];
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let scraper = metrics.then(|| {
        let targets: Vec<String> = cluster
            .replicas
            .values()
            .filter_map(|r| r.metrics_addr.clone())
            .collect();
        runtime.spawn(scrape_every_second(targets))
    });
    let result = runtime.block_on(async {
        cluster.wait_for_leader(Duration::from_secs(30)).await?;
        match command {
            BenchCommand::Failover {
                kills,
                hosts,
                rate,
                cpu_hog,
                steady,
                ..
            } => {
                let args = super::bench_failover::Args {
                    kills: *kills,
                    hosts: *hosts,
                    rate: *rate,
                    cpu_hog: *cpu_hog,
                    steady: steady.unwrap_or_default(),
                };
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
                ..
            } => {
                let args = super::bench_placement::Args {
                    hosts: *hosts,
                    jobs: *jobs,
                    preset: preset.clone(),
                    finish: *finish,
                    submit_concurrency: *submit_concurrency,
                    heartbeat: heartbeat_ms.map(Duration::from_millis),
                };
                let (mut text, mut json) = super::bench_placement::run(&cluster, args).await?;
                if encoding_compare {
                    let (t, j) = compare_encodings(&mut cluster).await?;
                    text.push_str(&t);
                    json["encoding"] = j;
                }
                Ok(Report { text, json })
            }
            BenchCommand::Submit {
                clients,
                seconds,
                etcd_compare: true,
                ..
            } => {
                let clients = if clients.is_empty() {
                    vec![1, 64, 256]
                } else {
                    clients.clone()
                };
                let (text, json) =
                    super::bench_etcd::run(&cluster, &clients, Duration::from_secs(*seconds), root)
                        .await?;
                Ok(Report { text, json })
            }
            BenchCommand::Submit {
                rates,
                clients,
                via,
                seconds,
                ..
            } => {
                let duration = Duration::from_secs(*seconds);
                let rates = match (rates, clients.is_empty()) {
                    (Some(r), _) => r.clone(),
                    (None, true) => vec![100, 1000, 5000],
                    (None, false) => Vec::new(),
                };
                let mut text = String::new();
                let mut json = json!({"benchmark": "submit", "replicas": cluster.replicas.len()});
                if !clients.is_empty() {
                    let (t, j) =
                        super::bench_submit_closed::run(&cluster, clients, duration).await?;
                    text.push_str(&t);
                    json["closed_loop"] = j;
                }
                if !rates.is_empty() {
                    let args = super::bench_submit::Args {
                        rates,
                        vias: via.clone(),
                        duration,
                    };
                    let (t, j) = super::bench_submit::run(&cluster, args).await?;
                    text.push_str(&t);
                    // The open-loop report's fields stay at the top level, as before.
                    if let (Some(obj), Some(open)) = (json.as_object_mut(), j.as_object()) {
                        obj.extend(open.clone());
                    }
                }
                Ok(Report { text, json })
            }
            BenchCommand::Scheduler { .. }
            | BenchCommand::StatusPage { .. }
            | BenchCommand::Memory { .. }
            | BenchCommand::Membership { .. }
            | BenchCommand::Scale { .. }
            | BenchCommand::E2e { .. }
            | BenchCommand::Rollout { .. }
            | BenchCommand::Service { .. } => {
                unreachable!("runs in process, above")
            }
        }
    });
    let mut report = result?;
    if let Some(scraper) = scraper {
        scraper.abort();
        let _ = runtime.block_on(scraper);
        let (scrapes, bytes) = SCRAPES.with_counts();
        report.json["metrics_scrapes"] = json!({"scrapes": scrapes, "bytes": bytes});
        report
            .text
            .push_str(&format!("metrics exporter on: {scrapes} scrapes of the replicas ({bytes} bytes) during the run\n"));
    }
    Ok(report)
}

/// Scrapes counted by [`scrape_every_second`] in this process (one benchmark at a time).
struct ScrapeCounts {
    scrapes: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
}

static SCRAPES: ScrapeCounts = ScrapeCounts {
    scrapes: std::sync::atomic::AtomicU64::new(0),
    bytes: std::sync::atomic::AtomicU64::new(0),
};

impl ScrapeCounts {
    /// The counts so far, reset.
    fn with_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.scrapes.swap(0, Relaxed), self.bytes.swap(0, Relaxed))
    }
}

/// Scrapes every target's `/metrics` once a second, as a Prometheus with a 1 s interval would
/// (15 s is the usual interval): what the exporter costs under load, measured harshly.
async fn scrape_every_second(targets: Vec<String>) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        for t in &targets {
            let Ok(addr) = t.parse() else { continue };
            if let Ok((200, body)) = node_agent::observe::http_get(addr, "/metrics").await {
                SCRAPES.scrapes.fetch_add(1, Relaxed);
                SCRAPES.bytes.fetch_add(body.len() as u64, Relaxed);
            }
        }
    }
}

/// Stops a follower once the run is over and compares the encodings of its log's entries
/// (`bench_encoding`).
async fn compare_encodings(
    cluster: &mut LocalCluster,
) -> anyhow::Result<(String, serde_json::Value)> {
    let leader = cluster
        .wait_for_leader(Duration::from_secs(30))
        .await?
        .leader;
    let follower = *cluster
        .replicas
        .keys()
        .find(|id| **id != leader)
        .context("no follower")?;
    // Its log holds every committed entry the leader's does, once it has applied them all.
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.stop(follower, Duration::from_secs(30))?;
    let data_dir = cluster.replicas[&follower].data_dir.clone();
    let name = cluster.cluster.clone();
    let followers = cluster.replicas.len() - 1;
    tokio::task::spawn_blocking(move || {
        let entries = super::bench_encoding::read_log(&data_dir, &name, follower)?;
        super::bench_encoding::compare(&entries, followers)
    })
    .await?
}

/// The reports of several security modes, one after the other, with the figures that
/// compare them in a table of their own.
fn side_by_side(reports: &[(String, Report)]) -> (String, serde_json::Value) {
    let mut text = String::new();
    let mut by_mode = serde_json::Map::new();
    for (mode, r) in reports {
        text.push_str(&format!("=== {mode} ===\n{}\n", r.text));
        by_mode.insert(mode.clone(), r.json.clone());
    }
    // The figures a reader compares: committed writes per second (closed loop), p99 latency
    // (open loop), failover to first placement.
    type Extract = fn(&serde_json::Value) -> Vec<(String, f64)>;
    let figures: [(&str, Extract); 4] = [
        ("placements/s", |j| {
            j["placements_per_sec"]
                .as_f64()
                .map(|v| ("burst".to_owned(), v))
                .into_iter()
                .collect()
        }),
        ("committed/s", |j| {
            j["closed_loop"]["runs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    (
                        format!("{} clients", r["clients"]),
                        r["committed_per_sec"].as_f64().unwrap_or(f64::NAN),
                    )
                })
                .collect()
        }),
        ("p99 ms", |j| {
            j["runs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["offered_per_sec"].is_u64())
                .map(|r| {
                    (
                        format!(
                            "{}/s via {}",
                            r["offered_per_sec"],
                            r["via"].as_str().unwrap_or("?")
                        ),
                        r["latency_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
                    )
                })
                .collect()
        }),
        ("failover p50/p99 ms", |j| {
            let p = &j["to_first_placement_ms"];
            if p.is_null() {
                return Vec::new();
            }
            vec![
                (
                    "first placement p50".into(),
                    p["p50"].as_f64().unwrap_or(f64::NAN),
                ),
                (
                    "first placement p99".into(),
                    p["p99"].as_f64().unwrap_or(f64::NAN),
                ),
            ]
        }),
    ];
    let mut rows = Vec::new();
    let mut comparison = Vec::new();
    for (unit, extract) in figures {
        let per_mode: Vec<Vec<(String, f64)>> =
            reports.iter().map(|(_, r)| extract(&r.json)).collect();
        let Some(first) = per_mode.first() else {
            continue;
        };
        for (i, (case, _)) in first.iter().enumerate() {
            let values: Vec<f64> = per_mode
                .iter()
                .map(|v| v.get(i).map_or(f64::NAN, |(_, x)| *x))
                .collect();
            let ratio = values[0] / values[values.len() - 1];
            let mut row = vec![unit.to_owned(), case.clone()];
            row.extend(values.iter().map(|v| format!("{v:.1}")));
            row.push(format!("{ratio:.3}"));
            rows.push(row);
            comparison.push(json!({"figure": unit, "case": case, "values": values, "ratio_first_to_last": ratio}));
        }
    }
    if !rows.is_empty() {
        let names: Vec<&str> = reports.iter().map(|(m, _)| m.as_str()).collect();
        let mut headers = vec!["FIGURE", "CASE"];
        headers.extend(names.iter().copied());
        let ratio_header = format!("{}/{}", names[0], names[names.len() - 1]);
        headers.push(&ratio_header);
        text.push_str(&format!("=== side by side ===\n{}", table(&headers, &rows)));
    }
    let json = json!({
        "security": reports.iter().map(|(m, _)| m.as_str()).collect::<Vec<_>>(),
        "by_security": by_mode,
        "comparison": comparison,
    });
    (text, json)
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
