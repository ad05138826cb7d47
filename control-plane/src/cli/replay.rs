//! `gpuctl simulate replay`: the time-based replay (`sim::replay`) of a synthetic workload, the
//! deep-learning workload (`sim::dl_workload`) or the public trace, once per policy × backfill
//! setting, side by side: a table, or JSON (one object on the last line), and optionally an SVG
//! plot. With `--compare`, instead: ours, FIFO + backfill and a Tiresias-style LAS baseline on
//! the same trace (`sim::compare`), with ours/baseline ratios.

use std::path::PathBuf;

use serde_json::json;

use super::output::{self, Format};
use crate::scheduler::{Policy, ScorePolicy};
use crate::sim::compare::{self, CompareConfig, Comparison};
use crate::sim::replay::{self, RunConfig, RunResult, Scheduler, policy_name};
use crate::sim::{dl_workload, replay_svg, workload};
use crate::state::{ClusterState, Command, Outcome, Tenant};
use crate::synthetic::Driver;

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// `synthetic` (generated jobs on a synthetic fleet), `dl` (deep-learning training jobs
    /// shaped after the Philly and Helios traces, on the synthetic fleet) or `trace` (`--pods`,
    /// `--nodes`).
    #[arg(long, default_value = "synthetic")]
    pub workload: String,
    /// Compare queueing quality instead: ours (default policy), FIFO + EASY backfill (Slurm's
    /// default) and a Tiresias-style least-attained-service baseline on the same trace; JCT,
    /// queueing delay, utilization and ours/baseline ratios. Ignores --policies and --backfill.
    #[arg(long)]
    pub compare: bool,
    /// Synthetic and dl: number of jobs.
    #[arg(long, default_value_t = 2000)]
    pub jobs: usize,
    /// Synthetic: 8-GPU hosts (DGX H100 mostly, some DGX-1 and L40S; 32 per rack).
    #[arg(long, default_value_t = 64)]
    pub hosts: usize,
    /// Synthetic: offered GPU load as a fraction of capacity.
    #[arg(long, default_value_t = 0.9)]
    pub load: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Trace: the pod list (CSV with creation_time, deletion_time, scheduled_time, ...).
    #[arg(long, value_name = "PODS.csv")]
    pub pods: Option<PathBuf>,
    /// Trace: the node list (CSV: sn, cpu_milli, memory_mib, gpu, model).
    #[arg(long, value_name = "NODES.csv")]
    pub nodes: Option<PathBuf>,
    /// Trace: replay only the earliest N pods.
    #[arg(long)]
    pub max_pods: Option<usize>,
    /// Trace: give each pod a time limit of its duration × this factor (default: no limits).
    #[arg(long)]
    pub trace_limit_factor: Option<f64>,
    /// Trace: multiply arrival times by this (below 1 compresses the trace to raise the load;
    /// durations are kept).
    #[arg(long, default_value_t = 1.0)]
    pub trace_time_scale: f64,
    /// Scoring policies to compare, comma-separated: fgd, best-fit, random-fit.
    #[arg(long, default_value = "fgd", value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Backfill settings to compare: on, off or both.
    #[arg(long, default_value = "both")]
    pub backfill: String,
    /// Turn preemption off.
    #[arg(long)]
    pub no_preemption: bool,
    /// Seconds a preempted job takes to stop.
    #[arg(long, default_value_t = 30)]
    pub grace_s: u64,
    /// Also run a pass every N simulated seconds while work is pending (0: only at events and
    /// aging steps).
    #[arg(long, default_value_t = 0)]
    pub tick_s: u64,
    /// Aging step in seconds (default: the scheduler's).
    #[arg(long)]
    pub aging_step_s: Option<u64>,
    /// Write utilization and unallocatable share over time to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

fn scoring(name: &str) -> anyhow::Result<ScorePolicy> {
    Ok(match name {
        "fgd" => ScorePolicy::Fgd,
        "fgd-la" | "fgd-lookahead" => ScorePolicy::FgdLookahead,
        "fgd-h" | "fgd-horizon" => ScorePolicy::FgdHorizon,
        "best-fit" | "bestfit" => ScorePolicy::BestFit,
        "random-fit" | "random" => ScorePolicy::RandomFit { seed: 1 },
        other => {
            anyhow::bail!("unknown policy {other:?}: fgd, fgd-la, fgd-h, best-fit or random-fit")
        }
    })
}

pub fn run(args: ReplayArgs, fmt: Format) -> anyhow::Result<()> {
    let mut driver = Driver::new(replay::EPOCH_MS);
    let trace = args.pods.is_some() || args.workload == "trace";
    let (jobs, description) = if trace {
        let (Some(pods), Some(nodes)) = (&args.pods, &args.nodes) else {
            anyhow::bail!("the trace workload needs --pods and --nodes");
        };
        let nodes = workload::trace_nodes(nodes)?;
        let n_nodes = nodes.len();
        for spec in nodes {
            let name = spec.name.clone();
            let o = driver.apply(&Command::RegisterNode { spec });
            anyhow::ensure!(o == Outcome::NodeRegistered, "node {name}: {o:?}");
        }
        driver.apply(&Command::PutTenant {
            tenant: Tenant {
                name: "trace".into(),
                weight: 1,
                quota_gpus: 0,
                max_gpus: 0,
            },
        });
        let (mut jobs, skipped) =
            workload::trace_pods(pods, "trace", args.max_pods, args.trace_limit_factor)?;
        for j in &mut jobs {
            j.arrival_ms = (j.arrival_ms as f64 * args.trace_time_scale) as u64;
        }
        let d = json!({"kind": "trace", "pods": pods.display().to_string(), "nodes": n_nodes,
            "gpus": driver.state.total_gpus(), "jobs": jobs.len(), "skipped_rows": skipped,
            "time_limit_factor": args.trace_limit_factor, "time_scale": args.trace_time_scale});
        (jobs, d)
    } else {
        let generate = match args.workload.as_str() {
            "synthetic" => workload::synthetic,
            "dl" => dl_workload::dl,
            other => anyhow::bail!("--workload is synthetic, dl or trace, not {other:?}"),
        };
        crate::synthetic::fleet(&mut driver, args.hosts)?;
        let gpus = driver.state.total_gpus();
        let jobs = generate(args.jobs, gpus, args.load, args.seed);
        let d = json!({"kind": args.workload, "hosts": args.hosts, "gpus": gpus, "jobs": jobs.len(),
            "load": args.load, "seed": args.seed});
        (jobs, d)
    };
    let base: ClusterState = driver.state;
    if args.compare {
        return run_compare(&args, &base, &jobs, &description, fmt);
    }
    let backfills: &[bool] = match args.backfill.as_str() {
        "both" => &[true, false],
        "on" => &[true],
        "off" => &[false],
        other => anyhow::bail!("--backfill is on, off or both, not {other:?}"),
    };
    let mut runs: Vec<RunResult> = Vec::new();
    let bar = super::progress::bar((args.policies.len() * backfills.len()) as u64, "runs", fmt);
    for name in &args.policies {
        let scoring = scoring(name)?;
        for &backfill in backfills {
            let mut policy = Policy {
                backfill,
                preemption: !args.no_preemption,
                scoring: scoring.clone(),
                ..Policy::default()
            };
            if let Some(s) = args.aging_step_s {
                policy.aging_step_ms = s * 1000;
            }
            let cfg = RunConfig {
                label: format!(
                    "{} backfill={}",
                    policy_name(&policy.scoring),
                    if backfill { "on" } else { "off" }
                ),
                scheduler: Scheduler::Ours(policy),
                grace_ms: args.grace_s * 1000,
                tick_ms: args.tick_s * 1000,
                resume: false,
            };
            if bar.is_hidden() && fmt.is_table() {
                eprintln!("replaying {} jobs: {} ...", jobs.len(), cfg.label);
            }
            bar.set_message(cfg.label.clone());
            runs.push(replay::run(&base, &jobs, &cfg)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        let title = format!("replay of {} jobs ({})", jobs.len(), description["kind"]);
        std::fs::write(path, replay_svg::plot(&title, &runs, 200))
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    match fmt {
        Format::Json | Format::Yaml => {
            println!("{}", json!({"workload": description, "runs": runs}))
        }
        Format::Table | Format::Wide => {
            println!("{description}");
            let rows: Vec<Vec<String>> = runs
                .iter()
                .map(|r| {
                    vec![
                        r.label.clone(),
                        r.jobs.to_string(),
                        r.completed.to_string(),
                        r.timed_out.to_string(),
                        r.unfinished.to_string(),
                        r.preemptions.to_string(),
                        format!("{:.0}", r.mean_queue_delay_s),
                        format!("{:.0}", r.p99_queue_delay_s),
                        format!("{:.0}", r.mean_jct_s),
                        format!("{:.1}%", r.gpu_utilization * 100.0),
                        format!("{:.2}%", r.unallocatable_share * 100.0),
                        format!("{:.1}%", r.idle_while_pending_share * 100.0),
                        format!("{:.0}", r.makespan_s),
                        r.refused_placements.to_string(),
                        format!("{:.1}", r.wall_s),
                    ]
                })
                .collect();
            print!(
                "{}",
                output::table(
                    &[
                        "RUN",
                        "JOBS",
                        "DONE",
                        "TIMEOUT",
                        "UNFIN",
                        "PREEMPT",
                        "DELAY_S",
                        "P99_S",
                        "JCT_S",
                        "UTIL",
                        "UNALLOC",
                        "IDLE_PEND",
                        "MAKESPAN_S",
                        "REFUSED",
                        "WALL_S",
                    ],
                    &rows
                )
            );
            for r in runs.iter().filter(|r| !r.refusals.is_empty()) {
                eprintln!("{}: refused placements: {:?}", r.label, r.refusals);
            }
        }
    }
    Ok(())
}

/// `--compare`: the three schedulers on one trace, then the ratios of ours to each baseline.
fn run_compare(
    args: &ReplayArgs,
    base: &ClusterState,
    jobs: &[workload::TraceJob],
    description: &serde_json::Value,
    fmt: Format,
) -> anyhow::Result<()> {
    let mut cfg = CompareConfig {
        grace_ms: args.grace_s * 1000,
        tick_ms: args.tick_s * 1000,
        ..CompareConfig::default()
    };
    cfg.ours.preemption = !args.no_preemption;
    cfg.las.preemption = !args.no_preemption;
    if let Some(s) = args.aging_step_s {
        cfg.ours.aging_step_ms = s * 1000;
    }
    let bar = super::progress::bar(3, "runs", fmt);
    let mut runs_started = 0;
    let c: Comparison = compare::compare(base, jobs, &cfg, |label| {
        if bar.is_hidden() && fmt.is_table() {
            eprintln!("replaying {} jobs: {label} ...", jobs.len());
        }
        if runs_started > 0 {
            bar.inc(1);
        }
        runs_started += 1;
        bar.set_message(label.to_string());
    })?;
    bar.finish_and_clear();
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"workload": description, "runs": c.runs, "ratios": c.ratios})
        ),
        Format::Table | Format::Wide => {
            println!("{description}");
            let rows: Vec<Vec<String>> = c
                .runs
                .iter()
                .map(|r| {
                    vec![
                        r.label.clone(),
                        r.jobs.to_string(),
                        r.completed.to_string(),
                        r.unfinished.to_string(),
                        r.preemptions.to_string(),
                        format!("{:.0}", r.mean_jct_s),
                        format!("{:.0}", r.p99_jct_s),
                        format!("{:.0}", r.mean_queue_delay_s),
                        format!("{:.0}", r.p99_queue_delay_s),
                        format!("{:.1}%", r.gpu_utilization * 100.0),
                        format!("{:.0}", r.makespan_s),
                        r.refused_placements.to_string(),
                        format!("{:.1}", r.wall_s),
                    ]
                })
                .collect();
            print!(
                "{}",
                output::table(
                    &[
                        "SCHEDULER",
                        "JOBS",
                        "DONE",
                        "UNFIN",
                        "STOPPED",
                        "JCT_S",
                        "P99_JCT_S",
                        "DELAY_S",
                        "P99_DELAY_S",
                        "UTIL",
                        "MAKESPAN_S",
                        "REFUSED",
                        "WALL_S",
                    ],
                    &rows
                )
            );
            let shown = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.2}"));
            let rows: Vec<Vec<String>> = c
                .ratios
                .iter()
                .map(|r| {
                    vec![
                        format!("ours / {}", r.baseline),
                        shown(r.mean_jct),
                        shown(r.p99_jct),
                        shown(r.mean_queue_delay),
                        shown(r.p99_queue_delay),
                        shown(r.gpu_utilization),
                    ]
                })
                .collect();
            println!();
            print!(
                "{}",
                output::table(
                    &["RATIO", "JCT", "P99_JCT", "DELAY", "P99_DELAY", "UTIL"],
                    &rows
                )
            );
            for r in c.runs.iter().filter(|r| !r.refusals.is_empty()) {
                eprintln!("{}: refused placements: {:?}", r.label, r.refusals);
            }
        }
    }
    Ok(())
}
