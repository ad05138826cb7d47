//! `gpuctl`: command-line client of gpu-control-plane (see `control_plane::cli`).

use clap::Parser;

fn main() {
    let cli = control_plane::cli::Cli::parse();
    if let Err(e) = control_plane::cli::main(cli) {
        // Errors from the API carry a message meant for people; show it plainly with its code.
        match e.downcast_ref::<tonic::Status>() {
            Some(s) => eprintln!("gpuctl: error: {} ({:?})", s.message(), s.code()),
            None => eprintln!("gpuctl: error: {e:#}"),
        }
        std::process::exit(1);
    }
}
