//! `control-plane`: one replica of the replicated control plane.

use clap::Parser;
use control_plane::config::{Defaults, ReplicaArgs};

#[derive(Parser)]
#[command(
    version,
    about = "One replica of gpu-control-plane's Raft-replicated control plane"
)]
struct Cli {
    #[command(flatten)]
    replica: ReplicaArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = control_plane::server::run_replica_process(cli.replica, Defaults::LOG_FILTER) {
        eprintln!("control-plane: error: {e:#}");
        std::process::exit(1);
    }
}
