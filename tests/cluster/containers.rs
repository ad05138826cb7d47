//! Container jobs on real agents and the host's real Docker engine: a container sees only
//! its own GPUs' device nodes (and one it forges with mknod is refused), mounts what the node
//! allows and nothing else, its memory limit is a hard limit reported as "out of memory",
//! and a cancel after an agent restart removes it.
//!
//! The image is built `FROM scratch` out of this machine's own shell and coreutils (no
//! registry is reachable). Without a Docker engine (or not as root) these tests say so and
//! pass, unless `CI` is set or `GPUCP_REQUIRE_DOCKER=1` (what `.ci/run` sets once it has
//! started the engine).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(60);
const IMAGE: &str = "gpucp-test/tools:1";

/// The programs the test image carries, from this host.
const TOOLS: &[&str] = &["sh", "cat", "ls", "sleep", "mknod", "dd", "echo"];

/// Builds [`IMAGE`] if the engine answers; `None` (after saying why) where there is no
/// engine and the run does not require one.
fn test_image() -> Option<&'static str> {
    // SAFETY: geteuid has no arguments and cannot fail.
    let root = unsafe { libc::geteuid() == 0 };
    // As the compose smoke: CI (or `.ci/run` having found an engine) requires one.
    let required = std::env::var("GPUCP_REQUIRE_DOCKER").is_ok_and(|v| v == "1")
        || std::env::var_os("CI").is_some();
    let reachable = control_plane::host_image::engine_available();
    if !(root && reachable) {
        assert!(
            !required,
            "a Docker engine is required here but not usable (root: {root}, engine answers: {reachable})"
        );
        eprintln!("no Docker engine reachable as root here; container tests not run");
        return None;
    }
    static BUILT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| control_plane::host_image::build(IMAGE, TOOLS).expect("the test image"));
    Some(IMAGE)
}

/// Containers of job `id` of cluster `c` the engine knows, running or not (other test
/// clusters on this engine have jobs of the same ids).
fn containers_of(c: &TestCluster, id: u64) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-a",
            "--format",
            "{{.ID}} {{.Label \"gpucp.state-dir\"}}",
            "--filter",
        ])
        .arg(format!("label=gpucp.job={id}"))
        .output()
        .unwrap();
    let root = c.root.display().to_string();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, dir)| dir.starts_with(&root))
        .map(|(id, _)| id.to_owned())
        .collect()
}

async fn start(mount_prefix: &Path) -> TestCluster {
    start_with_agent_args(
        &[("n1", "a100-pcie-4gpu-nvlink-pairs")],
        (gpuctl_bin(), vec!["agent".into()]),
        &[
            "--containers",
            "require",
            "--image-pull",
            "never",
            "--container-mount-prefix",
            mount_prefix.to_str().unwrap(),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_job_sees_only_its_own_gpus_and_mounts_what_the_node_allows() {
    let Some(image) = test_image() else { return };
    let shared = tempfile::tempdir().unwrap();
    let c = start(shared.path()).await;
    let mut client = c.client().unwrap();

    step("the node registered its container engine");
    let node = list_nodes(&mut client).await.remove(0);
    assert!(node.container_runtime.starts_with("docker "), "{node:?}");
    let (ok, out, _) = gpuctl(&c, &["nodes"]);
    assert!(ok && out.contains("cgroup-v1+docker"), "{out}");

    step("a one-GPU container job tries every GPU, forging the others' nodes with mknod");
    std::fs::write(shared.path().join("hello"), "from the host\n").unwrap();
    let script = "echo \"mine $CUDA_VISIBLE_DEVICES\"; ls /dev; \
                  for n in 0 1 2 3; do \
                    if [ -e /dev/nvidia$n ]; then echo \"nvidia$n present $(cat /dev/nvidia$n 2>&1)\"; \
                    else mknod /dev/forged$n c 195 $n && echo \"nvidia$n forged $(cat /dev/forged$n 2>&1)\"; fi; \
                  done; cat /data/hello";
    let mount = format!("{}:/data:ro", shared.path().display());
    let id = gpuctl_submit(
        &c,
        &[
            "submit", "-G", "1", "--image", image, "--mount", &mount, "--", "sh", "-c", script,
        ],
    );
    wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    let (out, err) = job_logs(&mut client, id).await;
    let mine_uuid = out
        .lines()
        .find_map(|l| l.strip_prefix("mine "))
        .unwrap_or_else(|| panic!("the job printed no GPU: {out} {err}"));
    let mine = node
        .gpus
        .iter()
        .find(|g| g.uuid == mine_uuid)
        .expect("its GPU is the node's")
        .index;
    for n in 0..4u32 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("nvidia{n} ")))
            .unwrap_or_else(|| panic!("no line for nvidia{n}: {out}"));
        if n == mine {
            assert!(
                line.starts_with(&format!("nvidia{n} present")) && line.contains("No such device"),
                "its own GPU's node is in the container and opens (no driver behind it): {line}"
            );
        } else {
            assert!(
                line.starts_with(&format!("nvidia{n} forged"))
                    && line.contains("Operation not permitted"),
                "another GPU's node is not in the container, and a forged one is refused: {line}"
            );
        }
    }
    assert!(
        out.contains("nvidiactl"),
        "the control node is mapped: {out}"
    );
    assert!(out.contains("from the host"), "the allowed mount: {out}");
    assert!(
        containers_of(&c, id).is_empty(),
        "the container was removed"
    );
    let (ok, show, _) = gpuctl(&c, &["show", &id.to_string()]);
    assert!(
        ok && show.contains(&format!("Container:     {image}")),
        "{show}"
    );
    assert!(
        show.contains("Mount:         ") && show.contains("(read-only)"),
        "{show}"
    );

    step("a mount outside what the node allows fails the job, saying why");
    let id = gpuctl_submit(
        &c,
        &[
            "submit",
            "-G",
            "1",
            "--image",
            image,
            "--mount",
            "/etc:/host-etc",
            "--",
            "ls",
            "/host-etc",
        ],
    );
    let reason = &final_reason(&mut client, id, JOB_TIMEOUT, "failed").await;
    assert!(
        reason.contains("mount source /etc is not under a directory this node allows")
            && reason.contains(shared.path().to_str().unwrap()),
        "{reason}"
    );

    step("a container past its --mem is reported out of memory; an exit code comes through");
    let id = gpuctl_submit(
        &c,
        &[
            "submit",
            "-G",
            "1",
            "--mem",
            "32M",
            "--image",
            image,
            "--",
            "dd",
            "if=/dev/zero",
            "of=/dev/null",
            "bs=256M",
            "count=1",
        ],
    );
    let reason = &final_reason(&mut client, id, JOB_TIMEOUT, "failed").await;
    assert!(
        reason.contains("out of memory") && reason.contains("32 MiB"),
        "{reason}"
    );
    let id = gpuctl_submit(
        &c,
        &[
            "submit", "-G", "1", "--image", image, "--", "sh", "-c", "exit 3",
        ],
    );
    let reason = &final_reason(&mut client, id, JOB_TIMEOUT, "failed").await;
    assert!(reason.contains("exit code 3"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_job_outlives_an_agent_restart_and_its_cancel_removes_it() {
    let Some(image) = test_image() else { return };
    let shared = tempfile::tempdir().unwrap();
    let mut c = start(shared.path()).await;
    let mut client = c.client().unwrap();
    let id = gpuctl_submit(
        &c,
        &[
            "submit",
            "-G",
            "1",
            "--image",
            image,
            "--",
            "sh",
            "-c",
            "echo started; sleep 1000",
        ],
    );
    wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    while !job_logs(&mut client, id).await.0.contains("started") {
        assert!(
            std::time::Instant::now() < deadline,
            "the container never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let container = containers_of(&c, id);
    assert!(!container.is_empty());
    let (ok, show, _) = gpuctl(&c, &["show", &id.to_string()]);
    assert!(
        ok && show.contains("; container gpucp-test/tools:1 on docker"),
        "what was enforced names the container: {show}"
    );

    step("SIGKILL the agent and start it again: the container runs on, re-adopted");
    c.kill_agent("n1").unwrap();
    c.start_agent("n1").unwrap();
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    while !c.agent_log("n1").contains("re-adopted") {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            c.agent_log("n1")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        containers_of(&c, id),
        container,
        "the same container, still there"
    );
    assert_eq!(get_job(&mut client, id).await.state, "running");

    step("cancel: the job ends cancelled and its container is gone");
    let (ok, _, err) = gpuctl(&c, &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    wait_job(&mut client, id, JOB_TIMEOUT, "cancelled", |j| {
        j.state == "cancelled"
    })
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !containers_of(&c, id).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "container {container:?} of the cancelled job is still there"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
