//! The compose deployment end to end: `deploy/compose/smoke.sh` builds the two images FROM
//! scratch from this build's binaries, starts 3 replicas and 4 simulated GPU hosts with TLS,
//! submits 50 jobs, `docker kill`s the leader's container, waits for every job to succeed and
//! takes everything down again (containers, network, volumes, images).
//!
//! It needs a Docker daemon, `docker compose` or docker-compose, and python3. Without them the
//! test says why and passes, unless `CI` is set: CI must run it, so there it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The whole script, build of the images included; its own deadlines are shorter.
const SMOKE_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// One probe of the tools (`docker info` waits on the daemon).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `cmd` to its end or until `timeout`: `Ok` when it exits 0, else why (with the first
/// line of its stderr).
fn probe(mut cmd: Command, timeout: Duration) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{shown}: {e}"))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let out = child.wait_with_output().map_err(|e| e.to_string())?;
                let err = String::from_utf8_lossy(&out.stderr);
                let first = err.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("{shown}: {status}: {first}"))
                };
            }
            Ok(None) if started.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{shown}: no answer within {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("{shown}: {e}")),
        }
    }
}

fn command(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// Why the smoke test cannot run here, if it cannot.
fn missing_tools() -> Option<String> {
    if let Err(e) = probe(command("docker", &["info"]), PROBE_TIMEOUT) {
        return Some(format!("no Docker daemon answers: {e}"));
    }
    let v2 = probe(command("docker", &["compose", "version"]), PROBE_TIMEOUT);
    let v1 = probe(command("docker-compose", &["version"]), PROBE_TIMEOUT);
    if let (Err(v2), Err(v1)) = (v2, v1) {
        return Some(format!("no compose: {v2}; {v1}"));
    }
    if let Err(e) = probe(command("python3", &["--version"]), PROBE_TIMEOUT) {
        return Some(format!(
            "no python3 (the script reads gpuctl's JSON with it): {e}"
        ));
    }
    None
}

/// The cargo flag that selects the profile whose output directory is `dir`.
fn profile_flags(dir: &Path) -> Vec<String> {
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => Vec::new(),
        Some("release") => vec!["--release".into()],
        Some(other) => vec!["--profile".into(), other.into()],
    }
}

/// The directory with this build's binaries. `control-plane` and `gpuctl` are this package's
/// (cargo builds them for integration tests); `node-agent` is built beside them by
/// `cargo test --workspace` (node-agent has integration tests too), and here when it is not.
fn bin_dir(repo: &Path) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_gpuctl"))
        .parent()
        .expect("gpuctl has a directory")
        .to_path_buf();
    assert!(
        Path::new(env!("CARGO_BIN_EXE_control-plane")).starts_with(&dir),
        "control-plane and gpuctl are built in different directories"
    );
    let agent = dir.join("node-agent");
    if !agent.is_file() {
        eprintln!(
            "compose smoke: no {} yet; building it (cargo build -p node-agent --bins)",
            agent.display()
        );
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(repo)
            .args(["build", "-p", "node-agent", "--bins"])
            .args(profile_flags(&dir))
            .status()
            .expect("running cargo");
        assert!(status.success(), "cargo build -p node-agent failed");
        assert!(
            agent.is_file(),
            "cargo build -p node-agent did not write {}",
            agent.display()
        );
    }
    dir
}

#[test]
fn compose_deployment_runs_every_job_through_a_leader_kill() {
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    if let Some(why) = missing_tools() {
        assert!(
            !ci,
            "CI is set, so the compose smoke test must run, but it cannot: {why}"
        );
        eprintln!("compose smoke test skipped: {why} (with CI set, this is a failure)");
        return;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf();
    let bins = bin_dir(&repo);
    let script = repo.join("deploy/compose/smoke.sh");
    // The script's output goes straight to the test's: its figures belong in the CI log.
    let mut child = Command::new("bash")
        .arg(&script)
        .arg("--bin-dir")
        .arg(&bins)
        .current_dir(&repo)
        .stdin(Stdio::null())
        .spawn()
        .expect("starting deploy/compose/smoke.sh");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for smoke.sh") {
            break status;
        }
        if started.elapsed() > SMOKE_TIMEOUT {
            // SIGTERM: the script's trap takes the deployment down before it exits.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let status = child.wait().expect("waiting for smoke.sh");
            panic!("smoke.sh took longer than {SMOKE_TIMEOUT:?} and was stopped ({status})");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "deploy/compose/smoke.sh failed ({status}); its output above says where"
    );
}
