//! Long-running services on a real cluster (issue 22): three replicas, simulated GPU hosts
//! whose agents hand out ports, and `gpuctl demo-server` as the replicas' program (it serves
//! `/`, `/ready`, `/healthz` and `/metrics` on `$PORT`). Each test drives the gRPC API and
//! checks what the replicas themselves answer over HTTP, not only what the state says.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use control_plane::client::{Client, with_timeout};
use proto::v1 as pb;

use crate::util::{LEASE_MS, gpuctl_bin, start_with_agents, step};

/// Longest wait for a service to settle (replicas placed, started, probes passing).
const SETTLE: Duration = Duration::from_secs(60);

fn service_name(name: &str) -> Option<pb::ServiceName> {
    Some(pb::ServiceName {
        tenant: String::new(),
        name: name.into(),
    })
}

/// A service of `replicas` demo servers, each half a GPU, with readiness on `/ready` and
/// liveness on `/healthz`; `args` are the demo server's own flags.
fn demo(name: &str, replicas: u32, args: &[&str]) -> pb::ServiceSpec {
    let mut command = vec![gpuctl_bin().display().to_string(), "demo-server".to_owned()];
    command.extend(args.iter().map(|a| a.to_string()));
    pb::ServiceSpec {
        tenant: String::new(),
        name: name.into(),
        template: Some(pb::JobSpec {
            command,
            gpus_per_task: 1,
            gpu_milli: 500,
            ports: vec!["http".into()],
            ..Default::default()
        }),
        replicas,
        readiness: Some(pb::ServiceProbe {
            check: Some(pb::service_probe::Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: "/ready".into(),
            })),
            period_ms: 200,
            ..Default::default()
        }),
        liveness: Some(pb::ServiceProbe {
            check: Some(pb::service_probe::Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: "/healthz".into(),
            })),
            period_ms: 200,
            ..Default::default()
        }),
        strategy: None,
        restart: Some(pb::RestartPolicy {
            backoff_initial_ms: 200,
            backoff_max_ms: 1_000,
            crash_loop_after: 3,
            reset_after_ms: 60_000,
        }),
        autoscale: None,
    }
}

async fn put(client: &mut Client, spec: pb::ServiceSpec, create_only: bool) -> pb::Service {
    let req = pb::PutServiceRequest {
        spec: Some(spec),
        create_only,
    };
    client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.put_service(with_timeout(r, t)).await }
        })
        .await
        .expect("put service")
}

async fn get(client: &mut Client, name: &str) -> Result<pb::Service, tonic::Status> {
    let req = pb::GetServiceRequest {
        service: service_name(name),
        read: None,
    };
    client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.get_service(with_timeout(r, t)).await }
        })
        .await
}

/// Polls the service until `done` holds, checking `always` on every look; panics after
/// `timeout` showing the service.
async fn wait_service(
    client: &mut Client,
    name: &str,
    timeout: Duration,
    what: &str,
    mut always: impl FnMut(&pb::Service),
    done: impl Fn(&pb::Service) -> bool,
) -> pb::Service {
    let deadline = Instant::now() + timeout;
    loop {
        let s = get(client, name).await.expect("get service");
        always(&s);
        if done(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "service {name} never {what}: {s:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn all_ready(s: &pb::Service, n: usize) -> bool {
    s.replicas.len() == n
        && s.replicas.iter().all(|r| r.ready && !r.endpoint.is_empty())
        && s.rollout == "complete"
}

/// `GET path` from a replica's `host:port`: the status code and body (one short answer).
fn http_get(endpoint: &str, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(endpoint).map_err(|e| format!("{endpoint}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {endpoint}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    let code = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not HTTP: {answer:?}"))?;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    Ok((code, body))
}

/// A replica's process id, as its demo server says at `/` (`pid=N`).
fn replica_pid(endpoint: &str) -> i32 {
    let (code, body) = http_get(endpoint, "/").expect("the replica answers");
    assert_eq!(code, 200, "{body}");
    body.split_whitespace()
        .find_map(|w| w.strip_prefix("pid="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid= in {body:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_service_keeps_its_replicas_serving_restarts_them_in_place_and_scales() {
    let c = start_with_agents(&[("h1", "dgx-h100"), ("h2", "dgx-h100")]).await;
    let mut client = c.client().unwrap();

    step("a service of three replicas: each placed, started, ready, with its own endpoint");
    let created = put(&mut client, demo("web", 3, &[]), true).await;
    assert_eq!(created.revision, 1);
    let s = wait_service(
        &mut client,
        "web",
        SETTLE,
        "became ready",
        |_| {},
        |s| all_ready(s, 3),
    )
    .await;
    let ordinals: Vec<u32> = s.replicas.iter().map(|r| r.ordinal).collect();
    assert_eq!(ordinals, [0, 1, 2]);
    for r in &s.replicas {
        let (code, body) = http_get(&r.endpoint, "/").expect("a replica answers");
        assert_eq!(code, 200);
        assert!(body.contains(&format!("replica={}", r.ordinal)), "{body}");
    }

    step("a second create of the same name is refused, and nothing changes");
    let again = pb::PutServiceRequest {
        spec: Some(demo("web", 5, &[])),
        create_only: true,
    };
    let refused = client
        .call(|mut c, t| {
            let r = again.clone();
            async move { c.put_service(with_timeout(r, t)).await }
        })
        .await
        .unwrap_err();
    assert!(refused.message().contains("already exists"), "{refused}");
    assert_eq!(
        get(&mut client, "web")
            .await
            .unwrap()
            .spec
            .unwrap()
            .replicas,
        3
    );

    step("kill -9 of a replica's process: restarted in place, same node, GPU and port");
    let victim = s.replicas[1].clone();
    let pid = replica_pid(&victim.endpoint);
    // SAFETY: kill(2) with a pid the replica itself reported.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed_at = Instant::now();
    let s = wait_service(
        &mut client,
        "web",
        SETTLE,
        "restarted the replica",
        |_| {},
        |s| {
            s.replicas
                .iter()
                .any(|r| r.ordinal == victim.ordinal && r.restarts == 1 && r.ready)
        },
    )
    .await;
    eprintln!(
        "replica ready again {:?} after kill -9",
        killed_at.elapsed()
    );
    let back = s
        .replicas
        .iter()
        .find(|r| r.ordinal == victim.ordinal)
        .unwrap();
    assert_eq!(
        (&back.node, &back.gpus, &back.endpoint, back.job_id),
        (&victim.node, &victim.gpus, &victim.endpoint, victim.job_id),
        "the same copy, restarted where it was"
    );
    assert_ne!(replica_pid(&back.endpoint), pid, "a new process");
    assert!(back.last_exit.contains("signal 9"), "{back:?}");

    step("scale to 5, then to 2");
    let scale = |n: u32| pb::ScaleServiceRequest {
        service: service_name("web"),
        replicas: n,
        reason: "test".into(),
    };
    for (n, expect) in [(5u32, 5usize), (2, 2)] {
        let req = scale(n);
        client
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.scale_service(with_timeout(r, t)).await }
            })
            .await
            .expect("scale");
        wait_service(
            &mut client,
            "web",
            SETTLE,
            "scaled",
            |_| {},
            |s| all_ready(s, expect),
        )
        .await;
    }

    step("delete: every replica stops and the service is forgotten");
    let req = pb::DeleteServiceRequest {
        service: service_name("web"),
    };
    client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.delete_service(with_timeout(r, t)).await }
        })
        .await
        .expect("delete");
    let deadline = Instant::now() + SETTLE;
    while get(&mut client, "web").await.is_ok() {
        assert!(Instant::now() < deadline, "the service was never forgotten");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let jobs = crate::util::list_jobs(&mut client, false).await;
    let live: Vec<&pb::Job> = jobs
        .iter()
        .filter(|j| j.replica.is_some() && (j.state != "cancelled" || !j.allocations.is_empty()))
        .collect();
    assert!(live.is_empty(), "replica jobs still live: {live:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_update_keeps_every_replica_ready_and_a_broken_one_is_paused_and_undone() {
    let c = start_with_agents(&[("h1", "dgx-h100"), ("h2", "dgx-h100")]).await;
    let mut client = c.client().unwrap();
    put(&mut client, demo("api", 4, &["--message", "v1"]), true).await;
    wait_service(
        &mut client,
        "api",
        SETTLE,
        "became ready",
        |_| {},
        |s| all_ready(s, 4),
    )
    .await;

    step("revision 2: replaced one at a time (surge 1, unavailable 0)");
    let started = Instant::now();
    put(&mut client, demo("api", 4, &["--message", "v2"]), false).await;
    let mut min_ready = u32::MAX;
    let mut max_copies = 0;
    let s = wait_service(
        &mut client,
        "api",
        SETTLE * 2,
        "rolled out",
        |s| {
            min_ready = min_ready.min(s.ready);
            max_copies = max_copies.max(s.replicas.len());
        },
        |s| s.revision == 2 && s.updated == 4 && all_ready(s, 4),
    )
    .await;
    eprintln!(
        "rolling update of 4 replicas: {:?}, at least {min_ready} ready, at most {max_copies} copies",
        started.elapsed()
    );
    assert!(min_ready >= 4, "a replica went unready during the rollout");
    assert!(max_copies <= 5, "more than replicas + surge");
    for r in &s.replicas {
        let (_, body) = http_get(&r.endpoint, "/").unwrap();
        assert!(body.contains("message=v2"), "{body}");
    }

    step("revision 3 crashes at once: the rollout pauses, the old replicas keep serving");
    put(
        &mut client,
        demo("api", 4, &["--message", "v3", "--fail-after", "0s"]),
        false,
    )
    .await;
    let s = wait_service(
        &mut client,
        "api",
        SETTLE,
        "paused",
        |_| {},
        |s| s.rollout == "paused",
    )
    .await;
    assert!(s.rollout_reason.contains("crash-looping"), "{s:#?}");
    assert!(s.ready >= 4, "{s:#?}");

    step("undo: back to revision 2");
    let req = pb::ServiceRolloutRequest {
        service: service_name("api"),
        action: pb::service_rollout_request::Action::Undo as i32,
        to_revision: 0,
        reason: String::new(),
    };
    let undone = client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.service_rollout(with_timeout(r, t)).await }
        })
        .await
        .expect("undo");
    assert_eq!(undone.revision, 2);
    let s = wait_service(
        &mut client,
        "api",
        SETTLE,
        "settled on revision 2",
        |_| {},
        |s| all_ready(s, 4) && s.replicas.iter().all(|r| r.revision == 2),
    )
    .await;
    assert!(
        s.events.iter().any(|e| e.message.contains("rolled back")),
        "{s:#?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_autoscaler_follows_the_replicas_gauge_and_a_failing_liveness_probe_restarts() {
    let c = start_with_agents(&[("h1", "dgx-h100")]).await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let queue = dir.path().join("queue");
    std::fs::write(&queue, "0").unwrap();
    let sick = dir.path().join("sick");

    step("an autoscaled service between 1 and 3 replicas, aiming at 5 queued per replica");
    let mut spec = demo("auto", 1, &["--queue-file", &queue.display().to_string()]);
    spec.autoscale = Some(pb::Autoscale {
        min: 1,
        max: 3,
        metric: "queue_length".into(),
        target: 5.0,
        scale_down_window_ms: Some(2_000),
        ..Default::default()
    });
    // Liveness through an exec probe: the replica is sick while the file exists.
    spec.liveness = Some(pb::ServiceProbe {
        check: Some(pb::service_probe::Check::Exec(pb::ExecProbe {
            command: vec![
                "sh".into(),
                "-c".into(),
                format!("test ! -e {}", sick.display()),
            ],
        })),
        period_ms: 200,
        failure_threshold: 2,
        ..Default::default()
    });
    put(&mut client, spec, true).await;
    wait_service(
        &mut client,
        "auto",
        SETTLE,
        "became ready",
        |_| {},
        |s| all_ready(s, 1),
    )
    .await;

    step("12 queued on one replica: the autoscaler adds two (ceil(12 / 5) = 3)");
    std::fs::write(&queue, "12").unwrap();
    let crossed = Instant::now();
    let s = wait_service(
        &mut client,
        "auto",
        SETTLE,
        "scaled up",
        |_| {},
        |s| all_ready(s, 3),
    )
    .await;
    eprintln!(
        "metric over the threshold to 3 ready replicas: {:?}",
        crossed.elapsed()
    );
    assert!(
        s.events.iter().any(|e| e.message.contains("autoscaler")),
        "{s:#?}"
    );
    assert!(s.autoscaler.contains("queue_length"), "{s:#?}");

    step("the queue drains: back to the minimum once the scale-down window has passed");
    std::fs::write(&queue, "0").unwrap();
    wait_service(
        &mut client,
        "auto",
        SETTLE,
        "scaled down",
        |_| {},
        |s| all_ready(s, 1),
    )
    .await;

    step("a failing liveness probe restarts the replica");
    std::fs::write(&sick, "").unwrap();
    let s = wait_service(
        &mut client,
        "auto",
        SETTLE,
        "restarted by liveness",
        |_| {},
        |s| s.replicas.iter().any(|r| r.last_exit.contains("liveness")),
    )
    .await;
    assert!(s.replicas.iter().all(|r| r.restarts >= 1), "{s:#?}");
    std::fs::remove_file(&sick).unwrap();
    wait_service(
        &mut client,
        "auto",
        SETTLE,
        "recovered",
        |_| {},
        |s| all_ready(s, 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_on_a_host_that_is_cut_off_is_replaced_on_another_host() {
    let mut c = start_with_agents(&[("h1", "dgx-h100"), ("h2", "dgx-h100")]).await;
    let mut client = c.client().unwrap();
    put(&mut client, demo("web", 2, &[]), true).await;
    let s = wait_service(
        &mut client,
        "web",
        SETTLE,
        "became ready",
        |_| {},
        |s| all_ready(s, 2),
    )
    .await;

    step("the agent of one replica's host is killed: after lease and grace, replaced elsewhere");
    let lost = s.replicas[0].clone();
    let other = if lost.node == "h1" { "h2" } else { "h1" };
    c.kill_agent(&lost.node).unwrap();
    let cut_at = Instant::now();
    let s = wait_service(
        &mut client,
        "web",
        SETTLE,
        "replaced the replica",
        |_| {},
        |s| all_ready(s, 2) && s.replicas.iter().all(|r| r.node == other),
    )
    .await;
    let took = cut_at.elapsed();
    eprintln!("replica replaced {took:?} after its host was cut off");
    assert!(
        took >= Duration::from_millis(LEASE_MS),
        "not before the lease ran out"
    );
    let moved = s
        .replicas
        .iter()
        .find(|r| r.ordinal == lost.ordinal)
        .unwrap();
    assert_eq!(moved.job_id, lost.job_id, "the same copy, placed again");
}
