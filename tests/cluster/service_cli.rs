//! `gpuctl service` against real replicas and a simulated host: create, get, describe, logs
//! of a replica by ordinal, update (a new revision), history, pause and the exit code of
//! `rollout status`, resume, undo, `get -o yaml` applied back unchanged, scale, refusals
//! that name what to do, and delete. The replicas run `gpuctl demo-server`. Readiness and
//! ports come from the agents' side of services, so this test asserts nothing that needs them
//! (ready counts, endpoints); it checks the commands and what the cluster records.

use std::time::Duration;

use crate::util::*;

/// Waits until `check` holds for `gpuctl ARGS`'s standard output.
async fn wait_output(
    c: &TestCluster,
    args: &[&str],
    what: &str,
    check: impl Fn(&str) -> bool,
) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (ok, out, err) = gpuctl(c, args);
        if ok && check(&out) {
            return out;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: gpuctl {args:?} said {out}{err}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_commands_create_change_roll_back_and_delete_a_service() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let demo = gpuctl_bin();
    let demo = demo.to_str().unwrap();

    step("create: two replicas of a quarter GPU each, running the demo server");
    let (ok, out, err) = gpuctl(
        &c,
        &[
            "service",
            "create",
            "web",
            "--replicas",
            "2",
            "--gpu-milli",
            "250",
            "-e",
            "MODE=demo",
            "--readiness",
            "exec:true",
            "--",
            demo,
            "demo-server",
            "--port",
            "0",
        ],
    );
    assert!(ok, "{out}{err}");
    assert!(
        out.starts_with("service web created: 2 replica(s) starting"),
        "{out}"
    );
    let (ok, _, err) = gpuctl(&c, &["service", "create", "web", "--", "true"]);
    assert!(
        !ok && err.contains("already exists") && err.contains("service update"),
        "{err}"
    );

    step("get, describe: two replica jobs placed on n1");
    let described = wait_output(
        &c,
        &["service", "describe", "web"],
        "replicas placed",
        |out| out.matches(" n1 ").count() >= 2,
    )
    .await;
    assert!(described.contains("250 milli of one GPU"), "{described}");
    assert!(described.contains("exec:true"), "{described}");
    let (ok, out, _) = gpuctl(&c, &["service", "get"]);
    assert!(
        ok && out
            .lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("web ") && l.contains("/2")),
        "{out}"
    );
    let (ok, out, _) = gpuctl(&c, &["queue"]);
    assert!(
        ok && out.contains("web-0") && out.contains("web-1"),
        "{out}"
    );

    step("logs service/web/0: the replica's own output");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (ok, out, err) = gpuctl(&c, &["logs", "service/web/0"]);
        if ok && format!("{out}{err}").contains("demo-server: serving on") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no log line: {out}{err}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (ok, _, err) = gpuctl(&c, &["logs", "service/web/7"]);
    assert!(
        !ok && err.contains("no replica 7") && err.contains("0, 1"),
        "{err}"
    );

    step("update: a new command is revision 2; an update that changes nothing is no write");
    let (ok, out, err) = gpuctl(
        &c,
        &[
            "service",
            "update",
            "web",
            "--",
            demo,
            "demo-server",
            "--port",
            "0",
            "--message",
            "v2",
        ],
    );
    assert!(
        ok && out.contains("revision 1 -> 2, rolling out"),
        "{out}{err}"
    );
    let (ok, out, _) = gpuctl(&c, &["service", "update", "web"]);
    assert!(ok && out.trim() == "service web unchanged", "{out}");
    let (ok, out, _) = gpuctl(&c, &["service", "history", "web"]);
    assert!(
        ok && out.contains("2 (current)") && out.contains("command"),
        "{out}"
    );

    step("pause: rollout status exits 1 with the reason; resume; undo to revision 1");
    let (ok, _, err) = gpuctl(
        &c,
        &[
            "service",
            "rollout",
            "pause",
            "web",
            "--reason",
            "checking v2",
        ],
    );
    assert!(ok, "{err}");
    let (ok, out, err) = gpuctl(&c, &["service", "rollout", "status", "web"]);
    assert!(!ok, "a paused rollout is a failure: {out}");
    assert!(
        err.contains("paused: checking v2") && err.contains("rollout resume web"),
        "{err}"
    );
    let (ok, _, err) = gpuctl(&c, &["service", "rollout", "resume", "web"]);
    assert!(ok, "{err}");
    let (ok, out, err) = gpuctl(&c, &["service", "rollout", "undo", "web"]);
    assert!(
        ok && out.contains("rolled back to revision 1"),
        "{out}{err}"
    );

    step("get -o yaml applies back unchanged; a changed count is applied without a rollout");
    let (ok, yaml, err) = gpuctl(&c, &["-o", "yaml", "get", "service", "web"]);
    assert!(
        ok && yaml.contains("kind: GpuService") && yaml.contains("nvidia.com/gpu-milli: 250"),
        "{yaml}{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("web.yaml");
    std::fs::write(&file, &yaml).unwrap();
    let path = file.to_str().unwrap();
    let (ok, out, err) = gpuctl(&c, &["apply", "-f", path]);
    assert!(ok && out.trim() == "gpuservice/web unchanged", "{out}{err}");
    std::fs::write(&file, yaml.replace("replicas: 2", "replicas: 3")).unwrap();
    let (ok, out, err) = gpuctl(&c, &["apply", "-f", path]);
    assert!(ok && out.contains("nothing rolls out"), "{out}{err}");
    let (ok, out, _) = gpuctl(&c, &["service", "describe", "web"]);
    assert!(ok && out.contains("3 desired"), "{out}");

    step("refusals say what to do and change nothing");
    let (ok, _, err) = gpuctl(&c, &["service", "update", "web", "--readiness", "tcp:grpc"]);
    assert!(!ok && err.contains("their ports: none"), "{err}");
    let (ok, _, err) = gpuctl(&c, &["service", "scale", "nope", "2"]);
    assert!(!ok && err.contains("does not exist"), "{err}");

    step("delete --wait: every replica stops, then the service is gone");
    let (ok, out, err) = gpuctl(&c, &["service", "delete", "web", "--wait"]);
    assert!(ok && out.contains("service web is gone"), "{out}{err}");
    let (ok, out, _) = gpuctl(&c, &["service", "get"]);
    assert!(ok && out.starts_with("No services."), "{out}");
    let (ok, out, _) = gpuctl(&c, &["queue"]);
    assert!(ok && !out.contains("web-0"), "{out}");
}
