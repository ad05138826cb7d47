//! `gpucp-shim`: the per-allocation workload supervisor on its own (see
//! `node_agent::runtime::shim_main`), the same code as `node-agent shim`.
//!
//! The agent starts one shim per job. As a subcommand of the agent's own binary (25 MB for
//! `gpuctl`), each start paid for mapping and relocating that binary: on a 2-core host this
//! was over a third of all CPU in `gpuctl bench e2e`, two and a half times what the job's own
//! `sleep 0` cost. This binary holds only the shim. The agent uses it when it sits beside the
//! agent's executable and was built from the same sources (`--protocol`), else falls back to
//! the subcommand.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Result<Vec<String>, _> = std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect();
    let args = match args {
        Ok(args) => args,
        Err(bad) => {
            eprintln!("gpucp-shim: argument {bad:?} is not valid UTF-8");
            return ExitCode::from(2);
        }
    };
    if args.len() == 1 && args[0] == node_agent::runtime::SHIM_PROTOCOL_FLAG {
        println!("{}", node_agent::runtime::SHIM_PROTOCOL);
        return ExitCode::SUCCESS;
    }
    let code = node_agent::runtime::shim_main(args);
    // Exit codes outside 0..=255 cannot be expressed; report a generic failure.
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
