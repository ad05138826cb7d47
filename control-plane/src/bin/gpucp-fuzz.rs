//! `gpucp-fuzz`: runs the fuzz targets of `control_plane::fuzz` (docs/FUZZING.md).
//!
//! ```text
//! gpucp-fuzz --target NAME|all --seconds N [--seed S] [--out DIR]
//! gpucp-fuzz --target NAME --replay FILE...
//! gpucp-fuzz --target NAME|all --export-seeds DIR
//! gpucp-fuzz --list
//! ```
//!
//! Prints, per target, the cases run, seconds, cases per second, CPU seconds and crashes;
//! writes each crash's input to DIR; exits 1 if any target crashed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use control_plane::fuzz::{self, Budget, TARGETS};

#[derive(Parser, Debug)]
#[command(
    name = "gpucp-fuzz",
    about = "Fuzz the control plane's and agent's input handling"
)]
struct Args {
    /// Target to run (see --list), or `all` for each in turn.
    #[arg(long, default_value = "all")]
    target: String,
    /// Seconds per target.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Cases per target (stops at whichever of --seconds and --cases comes first).
    #[arg(long)]
    cases: Option<u64>,
    /// Seed of the case generator: the same seed and budget give the same cases.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where crashing inputs are written.
    #[arg(long, default_value = "fuzz-crashes")]
    out: PathBuf,
    /// Run these inputs once each, with panics shown as usual, instead of fuzzing.
    #[arg(long, num_args = 1..)]
    replay: Vec<PathBuf>,
    /// Write each target's seed corpus to DIR/<target>/ (a starting corpus for a coverage-guided fuzzer) and exit.
    #[arg(long, value_name = "DIR")]
    export_seeds: Option<PathBuf>,
    /// List the targets and exit.
    #[arg(long)]
    list: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.list {
        for t in TARGETS {
            println!("{:<12} {}", t.name, t.about);
        }
        return ExitCode::SUCCESS;
    }
    let targets: Vec<&fuzz::Target> = if args.target == "all" {
        TARGETS.iter().collect()
    } else {
        match fuzz::target(&args.target) {
            Some(t) => vec![t],
            None => {
                let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
                eprintln!(
                    "gpucp-fuzz: no target {:?} (targets: {}, all)",
                    args.target,
                    names.join(", ")
                );
                return ExitCode::from(2);
            }
        }
    };
    if let Some(dir) = &args.export_seeds {
        return export_seeds(&targets, dir);
    }
    if !args.replay.is_empty() {
        return replay(&targets, &args.replay);
    }
    let budget = Budget {
        cases: args.cases,
        time: Some(Duration::from_secs(args.seconds)),
    };
    println!(
        "{:<12} {:>10} {:>8} {:>9} {:>7} {:>8} {:>8} {:>8} {:>9}",
        "target",
        "cases",
        "seconds",
        "cases/s",
        "cpu-s",
        "corpus",
        "features",
        "crashes",
        "slowest"
    );
    let mut crashed = false;
    for t in targets {
        let report = fuzz::run(t, args.seed, budget);
        let secs = report.wall.as_secs_f64();
        println!(
            "{:<12} {:>10} {:>8.1} {:>9.0} {:>7.1} {:>8} {:>8} {:>8} {:>7.1}ms",
            report.target,
            report.cases,
            secs,
            report.cases as f64 / secs.max(1e-9),
            report.cpu.as_secs_f64(),
            report.corpus,
            report.features,
            report.crashes(),
            report.slowest.0.as_secs_f64() * 1000.0
        );
        if report.findings.is_empty() {
            continue;
        }
        crashed = true;
        match fuzz::write_findings(&report, &args.out) {
            Ok(files) => {
                for (f, file) in report.findings.iter().zip(files) {
                    println!(
                        "  {:?} x{} {} -> {}\n    {}",
                        f.kind,
                        f.count,
                        f.signature,
                        file.display(),
                        f.message
                    );
                }
            }
            Err(e) => eprintln!("gpucp-fuzz: writing to {}: {e}", args.out.display()),
        }
    }
    if crashed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn export_seeds(targets: &[&fuzz::Target], dir: &std::path::Path) -> ExitCode {
    for t in targets {
        let sub = dir.join(t.name);
        let written = std::fs::create_dir_all(&sub).and_then(|()| {
            for (n, seed) in (t.seeds)().iter().enumerate() {
                std::fs::write(sub.join(format!("seed-{n}.bin")), seed)?;
            }
            Ok(())
        });
        if let Err(e) = written {
            eprintln!("gpucp-fuzz: writing {}: {e}", sub.display());
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

fn replay(targets: &[&fuzz::Target], files: &[PathBuf]) -> ExitCode {
    let [target] = targets else {
        eprintln!("gpucp-fuzz: --replay needs one --target");
        return ExitCode::from(2);
    };
    let mut failed = false;
    for file in files {
        let input = match std::fs::read(file) {
            Ok(input) => input,
            Err(e) => {
                eprintln!("gpucp-fuzz: {}: {e}", file.display());
                return ExitCode::from(2);
            }
        };
        match fuzz::replay(target, &input) {
            Ok(()) => println!("{}: ok", file.display()),
            Err(violation) => {
                println!("{}: violation: {violation}", file.display());
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
