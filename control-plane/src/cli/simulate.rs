//! `gpuctl simulate`: trace-driven simulations of the scheduler's placement policies, run in
//! this process (no cluster needed).
//!
//! - `fragmentation`: the FGD paper's experiment on the Alibaba GPU trace: tasks arrive until
//!   their GPU requests reach 130% of capacity; how much capacity each policy allocates.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use serde_json::json;

use super::output::{Format, printable, table};
use super::progress;
use crate::scheduler::score::ScorePolicy;
use crate::sim::fragmentation::{self, Config, Report};
use crate::sim::{svg, trace};

#[derive(clap::Subcommand)]
pub enum SimulateCommand {
    /// Fragmentation experiment of the FGD paper (USENIX ATC '23): allocated GPU share as tasks
    /// sampled from a pod list arrive, per placement policy, averaged over seeds.
    Fragmentation(FragmentationArgs),
    /// Write a variant of a pod list with another mix of task kinds (more GPU sharing,
    /// multi-GPU, model-constrained or CPU-only tasks), seeded, for `simulate fragmentation`.
    SynthPods(SynthPodsArgs),
    /// Time-based replay through the state machine and scheduler: queueing delay, job
    /// completion time, GPU utilization and unallocatable share, with and without backfill.
    Replay(super::replay::ReplayArgs),
    /// Deterministic simulation of the whole control plane (Raft, state machine, scheduler,
    /// leader loops, agent and client APIs) with simulated hosts and clients, under seeded
    /// crashes, partitions and message loss; checks the six invariants of docs/ARCHITECTURE.md per seed.
    Cluster(ClusterArgs),
}

#[derive(clap::Args)]
pub struct ClusterArgs {
    /// Number of seeds, consecutive from --first-seed.
    #[arg(long, default_value_t = crate::dst::DEFAULT_SEEDS)]
    pub seeds: u64,
    #[arg(long, default_value_t = 0)]
    pub first_seed: u64,
    /// Run this one seed only (to rerun a failure); overrides --seeds and --first-seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Worker threads, one seed each at a time (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

#[derive(clap::Args)]
pub struct SynthPodsArgs {
    /// Source pod list CSV, e.g. the trace's `openb_pod_list_default.csv`.
    #[arg(long, value_name = "PODS.csv")]
    pub pods: PathBuf,
    /// Node list CSV of the cluster the variant is for (the models constrained tasks name).
    #[arg(long, value_name = "NODES.csv")]
    pub nodes: PathBuf,
    /// Which kind of task to have more of: sharing, multi-gpu, constrained, cpu-heavy.
    #[arg(long)]
    pub mix: crate::sim::synth::Mix,
    /// Its proportion, in percent (sharing, multi-gpu, constrained: of the GPU tasks;
    /// cpu-heavy: of all tasks); default 60, 20, 33, 30.
    #[arg(long, value_name = "PERCENT")]
    pub fraction: Option<f64>,
    /// Tasks to write (default: as many as the source list has).
    #[arg(long)]
    pub tasks: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output CSV file.
    #[arg(long, value_name = "OUT.csv")]
    pub out: PathBuf,
}

#[derive(clap::Args)]
pub struct FragmentationArgs {
    /// Node list CSV (`sn,cpu_milli,memory_mib,gpu,model`), e.g. the trace's
    /// `openb_node_list_gpu_node.csv`.
    #[arg(long, value_name = "NODES.csv")]
    pub nodes: PathBuf,
    /// Pod list CSV (`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec],...`), e.g.
    /// `openb_pod_list_default.csv`.
    #[arg(long, value_name = "PODS.csv")]
    pub pods: PathBuf,
    /// Number of seeds (runs per policy); seeds are consecutive from --first-seed.
    #[arg(long, default_value_t = 10)]
    pub seeds: u64,
    #[arg(long, default_value_t = 42)]
    pub first_seed: u64,
    /// Placement policies to compare, comma-separated: random-fit, best-fit, fgd, fgd-la, fgd-h.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "random-fit,best-fit,fgd,fgd-la,fgd-h"
    )]
    pub policies: Vec<ScorePolicy>,
    /// Tasks arrive until their GPU requests reach this percentage of GPU capacity.
    #[arg(long, default_value_t = 130, value_name = "PERCENT")]
    pub arrivals: u32,
    /// Share of the pod list's tasks (most frequent types first) in FGD's target workload, in
    /// percent; 100 keeps every task type.
    #[arg(long, default_value_t = 95.0, value_name = "PERCENT")]
    pub workload_coverage: f64,
    /// Stop each run after this many tasks (quick smoke runs).
    #[arg(long)]
    pub max_tasks: Option<usize>,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Also write the allocation curves as an SVG plot to this file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

pub fn run(command: SimulateCommand, fmt: Format) -> anyhow::Result<()> {
    match command {
        SimulateCommand::Fragmentation(args) => fragmentation(args, fmt),
        SimulateCommand::SynthPods(args) => synth_pods(args, fmt),
        SimulateCommand::Replay(args) => super::replay::run(args, fmt),
        SimulateCommand::Cluster(args) => cluster(args, fmt),
    }
}

fn cluster(args: ClusterArgs, fmt: Format) -> anyhow::Result<()> {
    let seeds: Vec<u64> = match args.seed {
        Some(s) => vec![s],
        None => (args.first_seed..args.first_seed.saturating_add(args.seeds)).collect(),
    };
    let threads = if args.threads == 0 {
        crate::dst::default_threads()
    } else {
        args.threads
    };
    let started = Instant::now();
    let done = std::sync::atomic::AtomicU64::new(0);
    let total = seeds.len() as u64;
    let bar = progress::bar(total, "seeds", fmt);
    let progress = |r: &crate::dst::SeedReport| {
        let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if !r.violations.is_empty() {
            bar.suspend(|| eprint!("{}", r.describe_failure()));
        }
        bar.inc(1);
        // Without a bar (a log, CI), a line now and then.
        if bar.is_hidden() && fmt.is_table() && (n.is_multiple_of(500) || n == total) {
            eprintln!(
                "{n}/{total} seeds, {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
    };
    let summary = crate::dst::run_seeds(&seeds, &crate::dst::Params::default(), threads, &progress);
    bar.finish_and_clear();
    let wall = started.elapsed().as_secs_f64();
    let failed: Vec<u64> = summary.failed.iter().map(|r| r.seed).collect();
    match fmt {
        Format::Json | Format::Yaml => {
            let v = json!({
                "seeds": summary.seeds,
                "first_seed": seeds.first(),
                "threads": threads,
                "wall_s": (wall * 1000.0).round() / 1000.0,
                "simulated_s": summary.sim_ms / 1000,
                "faults": summary.faults,
                "jobs_acknowledged": summary.jobs_acked,
                "jobs_refused": summary.jobs_refused,
                "jobs_succeeded": summary.jobs_succeeded,
                "client_retries": summary.client_retries,
                "processes_started": summary.processes_started,
                "service_replica_processes_started": summary.replica_processes_started,
                "messages": summary.messages,
                "messages_lost": summary.messages_lost,
                "violations": summary.violations(),
                "failed_seeds": failed,
            });
            println!("{v}");
        }
        Format::Table | Format::Wide => {
            println!(
                "{} seeds ({}..={}) on {threads} threads in {wall:.1} s; {:.0} simulated minutes",
                summary.seeds,
                seeds.first().copied().unwrap_or(0),
                seeds.last().copied().unwrap_or(0),
                summary.sim_ms as f64 / 60_000.0
            );
            let rows: Vec<Vec<String>> = summary
                .faults
                .iter()
                .map(|(k, v)| vec![(*k).to_owned(), v.to_string()])
                .collect();
            print!("{}", table(&["FAULT", "INJECTED"], &rows));
            println!(
                "jobs: {} acknowledged, {} refused at submission, {} succeeded; {} client retries; {} processes started ({} of them service replicas)",
                summary.jobs_acked,
                summary.jobs_refused,
                summary.jobs_succeeded,
                summary.client_retries,
                summary.processes_started,
                summary.replica_processes_started
            );
            println!(
                "messages: {} sent, {} lost",
                summary.messages, summary.messages_lost
            );
            println!(
                "violations: {} in {} seed(s){}",
                summary.violations(),
                failed.len(),
                if failed.is_empty() {
                    String::new()
                } else {
                    format!(": seeds {failed:?}")
                }
            );
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "{} seed(s) violated invariants; rerun one with `gpuctl simulate cluster --seed N`",
        failed.len()
    );
    Ok(())
}

fn synth_pods(args: SynthPodsArgs, fmt: Format) -> anyhow::Result<()> {
    let nodes = trace::load_nodes(&args.nodes)?;
    let pods = trace::load_pods(&args.pods)?;
    let tasks = args.tasks.unwrap_or(pods.len());
    let out = crate::sim::synth::synthesize(
        &pods,
        &nodes,
        args.mix,
        args.fraction.map(|f| f / 100.0),
        tasks,
        args.seed,
    )?;
    std::fs::write(&args.out, crate::sim::synth::to_csv(&out))
        .with_context(|| format!("writing {}", args.out.display()))?;
    let gpu = out.iter().filter(|p| p.num_gpu > 0).count().max(1) as f64;
    let share = |f: &dyn Fn(&trace::TracePod) -> bool| out.iter().filter(|p| f(p)).count() as f64;
    let v = json!({
        "out": args.out.display().to_string(),
        "mix": args.mix.name(),
        "seed": args.seed,
        "tasks": out.len(),
        "cpu_only_pct": (1000.0 * share(&|p| p.num_gpu == 0) / out.len().max(1) as f64).round() / 10.0,
        "sharing_pct_of_gpu_tasks": (1000.0 * share(&|p| p.num_gpu == 1 && p.gpu_milli < 1000) / gpu).round() / 10.0,
        "multi_gpu_pct_of_gpu_tasks": (1000.0 * share(&|p| p.num_gpu > 1) / gpu).round() / 10.0,
        "constrained_pct_of_gpu_tasks": (1000.0 * share(&|p| !p.gpu_spec.is_empty()) / gpu).round() / 10.0,
    });
    match fmt {
        Format::Json | Format::Yaml => println!("{v}"),
        Format::Table | Format::Wide => println!(
            "wrote {} tasks ({} mix, seed {}) to {}: CPU-only {}% of tasks; of GPU tasks: sharing {}%, multi-GPU {}%, one model {}%",
            v["tasks"],
            v["mix"].as_str().unwrap_or(""),
            args.seed,
            args.out.display(),
            v["cpu_only_pct"],
            v["sharing_pct_of_gpu_tasks"],
            v["multi_gpu_pct_of_gpu_tasks"],
            v["constrained_pct_of_gpu_tasks"]
        ),
    }
    Ok(())
}

fn fragmentation(args: FragmentationArgs, fmt: Format) -> anyhow::Result<()> {
    let started = Instant::now();
    let nodes = trace::load_nodes(&args.nodes)?;
    let pods = trace::load_pods(&args.pods)?;
    for (model, tasks) in trace::unknown_models(&nodes, &pods) {
        eprintln!(
            "warning: {tasks} task(s) of {} accept GPU model {} that no node of {} has",
            args.pods.display(),
            printable(&model),
            args.nodes.display()
        );
    }
    let config = Config {
        seeds: (args.first_seed..args.first_seed.saturating_add(args.seeds)).collect(),
        policies: args.policies,
        arrivals_pct: args.arrivals,
        workload_coverage: args.workload_coverage / 100.0,
        max_tasks: args.max_tasks,
        threads: args.threads,
    };
    let bar = progress::bar(fragmentation::run_count(&config) as u64, "runs", fmt);
    let report = fragmentation::run_with_progress(&nodes, &pods, &config, &|| bar.inc(1))?;
    bar.finish_and_clear();
    let wall = started.elapsed().as_secs_f64();
    if let Some(path) = &args.plot {
        std::fs::write(path, plot(&report))
            .with_context(|| format!("writing the plot to {}", path.display()))?;
    }
    match fmt {
        Format::Json | Format::Yaml => {
            let mut v = report.to_json();
            v["wall_s"] = json!((wall * 1000.0).round() / 1000.0);
            if let Some(path) = &args.plot {
                v["plot"] = json!(path.display().to_string());
            }
            println!("{v}");
        }
        Format::Table | Format::Wide => print!("{}", text(&report, wall, args.plot.as_ref())),
    }
    Ok(())
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.1}%"))
}

fn text(report: &Report, wall: f64, plot: Option<&PathBuf>) -> String {
    let c = &report.config;
    let runs = report.policies.first().map_or(0, |p| p.runs.len().max(1));
    let tasks = report
        .policies
        .first()
        .map_or(0, |p| p.runs.iter().map(|r| r.tasks).sum::<usize>() / runs);
    let mut out = format!(
        "cluster: {} nodes, {} GPUs; pod list: {} task types, FGD workload: {} typical types \
         ({}% of tasks)\n{} seeds ({}..{}), about {} tasks per run, arrivals up to {}% of GPU \
         capacity\n\n",
        report.nodes,
        report.gpus,
        report.task_types,
        report.workload_types,
        c.workload_coverage * 100.0,
        c.seeds.len(),
        c.seeds.first().copied().unwrap_or(0),
        c.seeds.last().copied().unwrap_or(0),
        tasks,
        c.arrivals_pct,
    );
    let end = c.arrivals_pct as usize;
    let end_header = format!("ALLOCATED@{end}%");
    let rows: Vec<Vec<String>> = report
        .policies
        .iter()
        .map(|p| {
            let at_end: Vec<f64> = p.runs.iter().filter_map(|r| r.allocated_at(end)).collect();
            let (lo, hi) = at_end
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
                    (a.min(x), b.max(x))
                });
            let failed: usize = p.runs.iter().map(|r| r.failed).sum();
            vec![
                p.policy.name().to_owned(),
                pct(p.mean_at(100)),
                pct(p.mean_at(end)),
                if at_end.is_empty() {
                    "-".into()
                } else {
                    format!("{lo:.1}-{hi:.1}%")
                },
                format!("{:.0}", failed as f64 / p.runs.len().max(1) as f64),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "POLICY",
            "ALLOCATED@100%",
            &end_header,
            "RANGE OVER SEEDS",
            "FAILED TASKS/RUN",
        ],
        &rows,
    ));
    out.push_str(
        "\nALLOCATED@N%: GPU capacity allocated once arrived GPU requests reach N% of it \
         (mean over seeds).\n",
    );
    if let Some(path) = plot {
        out.push_str(&format!("plot: {}\n", path.display()));
    }
    out.push_str(&format!("wall time: {wall:.1} s\n"));
    out
}

fn plot(report: &Report) -> String {
    let x_max = f64::from(report.config.arrivals_pct);
    let series: Vec<svg::Series> = report
        .policies
        .iter()
        .map(|p| svg::Series {
            name: p.policy.name(),
            points: p
                .mean_curve()
                .into_iter()
                .enumerate()
                .map(|(k, y)| (k as f64, y))
                .collect(),
        })
        .collect();
    let title = format!(
        "GPU allocation as tasks arrive ({} nodes, {} GPUs, mean of {} seeds)",
        report.nodes,
        report.gpus,
        report.config.seeds.len()
    );
    svg::allocation_plot(
        &svg::Axes {
            title: &title,
            x_label: "arrived GPU requests (% of GPU capacity)",
            y_label: "allocated GPU (% of capacity)",
            x_max,
            y_min: 0.0,
            y_max: 100.0,
            x_step: if x_max > 60.0 { 10.0 } else { 5.0 },
            y_step: 10.0,
        },
        &series,
    )
}
