//! `chaos`: runs a fault-injection scenario against a local cluster of real processes and
//! checks the history (`chaos run`), or checks a saved history again (`chaos check`).
//!
//! The same binary also runs the cluster's processes (`chaos replica`, `chaos agent`, and the
//! agents' workload supervisor `chaos shim`), exactly as `gpuctl replica/agent/shim` do, so a
//! run needs nothing but this one executable.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use chaos::faults::{FaultCounts, Timings};
use chaos::history::FaultKind;
use chaos::scenario::{RunOptions, run};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "chaos",
    version,
    about = "Fault injection and invariant checking for gpu-control-plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Output {
    Text,
    Json,
}

// Parsed once per run; boxing the replica's many flags would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Start a local cluster (3 replicas, 3 simulated GPU hosts), run the workload and the
    /// faults, check the history. Exits 1 on any violation.
    Run(RunArgs),
    /// Check a history file written by `chaos run`. Exits 1 on any violation.
    Check {
        history: PathBuf,
        #[arg(long, value_enum, default_value = "text")]
        output: Output,
    },
    #[command(hide = true)]
    Replica(control_plane::config::ReplicaArgs),
    #[command(hide = true)]
    Agent(node_agent::agent::cli::AgentArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// How long the workload submits jobs (e.g. 40s, 10m); faults are spread over it.
    #[arg(long, default_value = "40s", value_parser = parse_duration)]
    duration: Duration,
    /// Jobs to submit; default: 5 per second of --duration.
    #[arg(long)]
    jobs: Option<usize>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// SIGKILL of the leader (restarted at once).
    #[arg(long, default_value_t = 10)]
    leader_kills: usize,
    /// SIGKILL of a follower (restarted after 0.5 s).
    #[arg(long, default_value_t = 2)]
    follower_kills: usize,
    /// SIGSTOP of the leader until a new leader committed, then SIGCONT.
    #[arg(long, default_value_t = 2)]
    leader_pauses: usize,
    /// The leader cut off from everything (iptables) until a new leader committed.
    #[arg(long, default_value_t = 1)]
    leader_partitions: usize,
    /// An agent cut off from the control plane for longer than its lease.
    #[arg(long, default_value_t = 1)]
    agent_partitions: usize,
    /// SIGKILL of an agent, restarted after 0.3-4.3 s.
    #[arg(long, default_value_t = 2)]
    agent_kills: usize,
    /// A follower SIGKILLed, its data directory deleted, rejoining empty.
    #[arg(long, default_value_t = 1)]
    wipes: usize,
    /// SIGTERM and restart of every replica in turn.
    #[arg(long, default_value_t = 1)]
    rolling_restarts: usize,
    /// A new replica added (a learner, then a voter), then another member removed (the leader
    /// every other time): the removed one must stop or go inert.
    #[arg(long, default_value_t = 1)]
    replica_changes: usize,
    /// A replica (the leader every other time) stopped with SIGTERM and restarted on another
    /// build: a fresh copy of this one, or with --previous-release, that release and back.
    #[arg(long, default_value_t = 1)]
    replica_upgrades: usize,
    /// Directory with the previous release's `control-plane` (and `node-agent`), e.g.
    /// target/previous-release/target/debug as tests/upgrade/build-previous-release.sh builds
    /// it: the replicas (and agents) start on it and --replica-upgrades moves replicas to this
    /// build (and back while the cluster version is 1).
    #[arg(long, value_name = "DIR")]
    previous_release: Option<PathBuf>,
    /// Seed of the workload and of the fault schedule.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep the cluster's data, logs and the history in this directory (by default a
    /// temporary one, kept only when there are violations).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Write the history here instead of `<dir>/history.jsonl`.
    #[arg(long)]
    history: Option<PathBuf>,
    /// Limit for every job to finish once faults stop (invariant 6).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    settle: Duration,
    /// Attach to a running cluster (HOST:PORT,...) instead of starting one. Only the workload
    /// and the checks of the replicated state run (needs --no-faults).
    #[arg(long, value_delimiter = ',')]
    endpoints: Option<Vec<String>>,
    /// Set every fault count to 0 (the workload and the checks only).
    #[arg(long)]
    no_faults: bool,
    /// With --endpoints: the TLS identity to use (ca.pem, cert.pem, key.pem), as gpuctl's.
    #[arg(long, env = "GPUCTL_TLS_DIR", value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// With --endpoints: an admin API token.
    #[arg(long, env = "GPUCTL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// With --endpoints: the cluster runs with --insecure.
    #[arg(long)]
    insecure: bool,
    /// text: a readable report; json: progress on stderr, and the last line of stdout a JSON
    /// summary with "violations".
    #[arg(long, value_enum, default_value = "text")]
    output: Output,
}

/// A duration as humantime writes it (`500ms`, `40s`, `10m`, `1h 30m`); a bare number is
/// seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 500ms, 40s, 10m or 1h: {e}"))
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("shim") {
        let code = node_agent::runtime::shim_main(args.collect());
        std::process::exit(code);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replica(args) => control_plane::server::run_replica_process(
            args,
            control_plane::config::Defaults::LOG_FILTER,
        )
        .map(|()| ExitCode::SUCCESS),
        Command::Agent(args) => std::env::current_exe()
            .context("finding the chaos binary's own path")
            .and_then(|exe| node_agent::agent::cli::run_agent_process(args, exe, "shim"))
            .map(|()| ExitCode::SUCCESS),
        Command::Check { history, output } => check(&history, output),
        Command::Run(args) => run_command(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("chaos: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn check(path: &std::path::Path, output: Output) -> anyhow::Result<ExitCode> {
    let events = chaos::history::read(path)?;
    let report = chaos::check::check(&events);
    let summary = chaos::summary::summarize(&events, &report);
    match output {
        Output::Text => print!("{}", summary.text(&report)),
        Output::Json => {
            eprint!("{}", summary.text(&report));
            println!("{}", summary.json());
        }
    }
    Ok(if report.violations() > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn run_command(a: RunArgs) -> anyhow::Result<ExitCode> {
    if a.duration.is_zero() {
        bail!("--duration must be more than zero");
    }
    let mut faults = FaultCounts::default();
    for (k, n) in [
        (FaultKind::LeaderKill, a.leader_kills),
        (FaultKind::FollowerKill, a.follower_kills),
        (FaultKind::LeaderPause, a.leader_pauses),
        (FaultKind::LeaderPartition, a.leader_partitions),
        (FaultKind::AgentPartition, a.agent_partitions),
        (FaultKind::AgentKill, a.agent_kills),
        (FaultKind::ReplicaWipe, a.wipes),
        (FaultKind::RollingRestart, a.rolling_restarts),
        (FaultKind::ReplicaAddRemove, a.replica_changes),
        (FaultKind::ReplicaUpgrade, a.replica_upgrades),
    ] {
        faults.counts.insert(k, if a.no_faults { 0 } else { n });
    }
    let stop = Arc::new(AtomicBool::new(false));
    install_interrupt_handler(stop.clone());
    let credentials = match &a.endpoints {
        Some(_) => control_plane::client::Credentials::resolve(a.insecure, a.tls_dir, a.token)?,
        None => control_plane::client::Credentials::insecure(),
    };
    let opts = RunOptions {
        program: std::env::current_exe().context("finding the chaos binary's own path")?,
        credentials,
        duration: a.duration,
        jobs: a
            .jobs
            .unwrap_or_else(|| (a.duration.as_secs_f64() * 5.0).ceil() as usize),
        clients: a.clients,
        faults,
        seed: a.seed,
        dir: a.dir,
        history: a.history,
        settle: a.settle,
        timings: Timings::default(),
        endpoints: a.endpoints,
        verbose: true,
        previous_release: a.previous_release,
    };
    let result = run(opts, stop)?;
    match a.output {
        Output::Text => print!("{}", result.summary.text(&result.report)),
        Output::Json => {
            eprint!("{}", result.summary.text(&result.report));
            println!("{}", result.summary.json());
        }
    }
    if result.history.exists() {
        eprintln!("chaos: history: {}", result.history.display());
    } else {
        eprintln!(
            "chaos: the history went with the temporary directory; pass --history FILE or \
             --dir DIR to keep it"
        );
    }
    if let Some(dir) = &result.kept_dir {
        eprintln!("chaos: data, logs and history kept in {}", dir.display());
    }
    Ok(if result.report.violations() > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// First Ctrl-C: stop injecting and submitting, heal, settle and check as usual. Second:
/// remove this run's iptables rules and exit at once (children die with us).
fn install_interrupt_handler(stop: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("chaos: interrupted; healing and checking (Ctrl-C again to quit now)");
            stop.store(true, Ordering::Relaxed);
            let _ = tokio::signal::ctrl_c().await;
            chaos::partition::remove_chain(&chaos::partition::chain_name());
            std::process::exit(130);
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("40").unwrap(), Duration::from_secs(40));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
        for bad in ["", "x", "-5s", "10 parsecs", &"9".repeat(400)] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
