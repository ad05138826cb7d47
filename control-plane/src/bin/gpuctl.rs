//! `gpuctl`: command-line client of gpu-control-plane (see `control_plane::cli`).

fn main() {
    // `gpuctl shim ...` is the workload supervisor of `gpuctl agent` (simulated hosts of
    // `gpuctl dev`); its arguments end with the workload's own command, so no flag parsing.
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("shim") => std::process::exit(node_agent::runtime::shim_main(args.collect())),
        // A container job's runner (the shim's command), likewise.
        Some(node_agent::runtime::container::RUNNER_SUBCOMMAND) => std::process::exit(
            node_agent::runtime::container_runner::runner_main(args.collect()),
        ),
        _ => {}
    }
    let cli = control_plane::cli::parse_command_line();
    if let Err(e) = control_plane::cli::main(cli) {
        // Errors from the API carry a message meant for people; show it plainly with its code.
        match e.downcast_ref::<tonic::Status>() {
            Some(s) => eprintln!("gpuctl: error: {} ({:?})", s.message(), s.code()),
            None => eprintln!("gpuctl: error: {e:#}"),
        }
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
