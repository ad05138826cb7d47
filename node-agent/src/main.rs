//! `node-agent`: the agent that runs on every GPU host (see `node_agent::agent`).
//!
//! `node-agent shim ...` is the per-allocation supervisor the workload runtime starts; it is
//! this same binary so a host needs only one file.

use std::process::ExitCode;

use clap::Parser;
use node_agent::agent::cli::{AgentArgs, run_agent_process};

#[derive(Parser)]
#[command(
    name = "node-agent",
    version,
    about = "GPU host agent of gpu-control-plane"
)]
struct Cli {
    #[command(flatten)]
    agent: AgentArgs,
}

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let first = args.next();
    let entry: Option<fn(Vec<String>) -> i32> = match first.as_ref().and_then(|f| f.to_str()) {
        Some("shim") => Some(node_agent::runtime::shim_main),
        // A container job's runner: the command its shim supervises.
        Some(node_agent::runtime::container::RUNNER_SUBCOMMAND) => {
            Some(node_agent::runtime::container_runner::runner_main)
        }
        _ => None,
    };
    if let Some(entry) = entry {
        let rest: Result<Vec<String>, _> = args.map(|a| a.into_string()).collect();
        let code = match rest {
            Ok(rest) => entry(rest),
            Err(bad) => {
                eprintln!("node-agent: argument {bad:?} is not valid UTF-8");
                2
            }
        };
        // Exit codes outside 0..=255 cannot be expressed; report a generic failure.
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = Cli::parse();
    let shim = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "node-agent: error: cannot find its own executable (used as the workload shim): {e}"
            );
            return ExitCode::from(1);
        }
    };
    match run_agent_process(cli.agent, shim, "shim") {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("node-agent: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
