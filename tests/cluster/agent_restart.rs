//! `gpuctl node restart-agent`: an agent restarts in place onto the binary installed at its
//! path, without touching its jobs; a binary that does not run, or is of a release the
//! control plane does not support, is refused and the running agent kept.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(30);

/// Installs `content` at `path` as a package manager does: a new file renamed over the old
/// one (the running agent keeps the old inode).
fn install(path: &Path, content: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, content).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The file a process runs, as the kernel sees it ("... (deleted)" once replaced).
fn running_program(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/exe")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restarts_onto_its_newly_installed_binary_and_keeps_its_job() {
    let bin_dir = tempfile::tempdir().unwrap();
    let program = bin_dir.path().join("gpuctl");
    let gpuctl_bytes = std::fs::read(gpuctl_bin()).unwrap();
    install(&program, &gpuctl_bytes);
    let c = start_with_agent_program(
        &[("n1", "a100-pcie-4gpu-nvlink-pairs")],
        (program.clone(), vec!["agent".into()]),
    )
    .await;
    let mut client = c.client().unwrap();
    let marker = c.root.join("marker");
    let release = c.root.join("release");
    let script = format!(
        "echo start >> {m}; while [ ! -e {r} ]; do sleep 0.05; done; echo end >> {m}",
        m = marker.display(),
        r = release.display()
    );
    let id = submit(&mut client, shell_job(1, &script), "")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    let pid = c.agents["n1"].pid().unwrap();

    step("a binary of a release newer than the control plane is refused");
    install(&program, b"#!/bin/sh\necho gpuctl 99.0.0\n");
    let (ok, out, err) = gpuctl(&c, &["node", "restart-agent", "n1"]);
    assert!(!ok, "restarting into release 99.0.0 must be refused");
    assert!(out.contains("Upgrade the control plane first"), "{out}");
    assert!(out.contains("nothing was restarted"), "{out}");
    assert!(err.contains("1 node(s) failed"), "{err}");

    step("a binary that does not run is refused, naming it");
    install(&program, b"#!/bin/sh\necho broken >&2\nexit 3\n");
    let (ok, out, err) = gpuctl(&c, &["node", "restart-agent", "--all", "--check"]);
    assert!(!ok, "a failing binary must fail the check: {out}");
    assert!(
        out.contains("--version failed") && out.contains("broken"),
        "{out}"
    );
    assert!(err.contains("1 node(s) failed"), "{err}");
    assert_eq!(c.agents["n1"].pid(), Some(pid));
    assert!(
        running_program(pid)
            .to_string_lossy()
            .ends_with("(deleted)"),
        "the agent still runs the first binary"
    );

    step("a new build installed at the path: restart in place onto it");
    install(&program, &gpuctl_bytes);
    let (ok, out, err) = gpuctl(
        &c,
        &["node", "restart-agent", "--all", "--max-unavailable", "1"],
    );
    assert!(ok, "restart-agent failed: {out}{err}");
    assert!(
        out.contains("n1: 0.") && out.contains("workloads 1 -> 1"),
        "{out}"
    );
    assert!(out.contains("restarted 1 of 1 agents"), "{out}");
    // Same process (a supervisor sees nothing), now running the file at the path.
    assert_eq!(c.agents["n1"].pid(), Some(pid));
    assert_eq!(running_program(pid), program);
    assert_eq!(
        std::fs::metadata(format!("/proc/{pid}/exe")).unwrap().ino(),
        std::fs::metadata(&program).unwrap().ino()
    );
    let log = c.agent_log("n1");
    assert!(log.contains("restarting in place"), "{log}");
    assert!(log.contains("re-adopted running workloads"), "{log}");

    step("the restarted agent takes new work, and the first job ends untouched");
    let second = submit(&mut client, shell_job(1, "true"), "")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, second, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    std::fs::write(&release, "").unwrap();
    let done = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "start\nend\n",
        "the job was restarted or cut short"
    );
    let states: Vec<&str> = done.history.iter().map(|h| h.state.as_str()).collect();
    assert_eq!(
        states,
        vec!["pending", "scheduled", "running", "succeeded"],
        "{:?}",
        done.history
    );
}
