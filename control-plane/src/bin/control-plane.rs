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

/// mimalloc instead of glibc's malloc: a replica's write path allocates and frees many
/// short-lived buffers on several threads (HTTP/2 frames, JSON of log entries, protobuf
/// messages), and glibc's arenas spent about 12% of the leader's CPU in `malloc`, `free` and
/// `malloc_consolidate` under `bench submit --clients 64`. Measured side by side: 15–18% more
/// committed writes per second at 64 and 256 clients (docs/PERFORMANCE.md, thirteenth session).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
