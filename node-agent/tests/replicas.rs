//! The whole agent (`node_agent::agent::run`, in this process) against a fake control plane
//! (a tonic server of the agent API on loopback) running service replicas as real processes
//! under real shims: its ports and place in the environment, its readiness probe reported as
//! READY/NOT_READY after STARTED, its gauge in the heartbeats, a failed liveness probe
//! reported as FAILED with the probe's reason (also by an agent restarted during the stop),
//! a replica held back until its start time or abandoned before it, and one re-adopted by a
//! restarted agent and probed again. Every wait is on a condition with a deadline.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::Stream;
use node_agent::agent::{AgentConfig, CgroupMode, cli::ServicePorts, containers};
use node_agent::gpu::simulated::SimulatedBackend;
use proto::agent as pa;
use proto::agent::agent_api_server::{AgentApi, AgentApiServer};
use tonic::{Request, Response, Status};

const SHIM: &str = env!("CARGO_BIN_EXE_node-agent");
/// Generous: the test machine may be busy compiling other crates.
const DEADLINE: Duration = Duration::from_secs(30);
/// SIGTERM → SIGKILL: long enough for a test to restart its agent while a replica that
/// ignores SIGTERM is being stopped.
const GRACE: Duration = Duration::from_secs(5);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A report as the fake control plane received it, with when (this host's clock).
#[derive(Debug, Clone)]
struct Got {
    report: pa::AllocationReport,
    at_ms: u64,
}

/// What the fake control plane hands out and what it was told.
struct Cp {
    set: tokio::sync::watch::Sender<pa::Assignments>,
    reports: Mutex<Vec<Got>>,
    metrics: Mutex<Vec<pa::ReplicaMetric>>,
    registrations: Mutex<Vec<pa::RegisterNodeRequest>>,
}

impl Cp {
    fn assign(&self, allocations: Vec<pa::Assignment>) {
        // Read apart from the replace: a borrow held across it deadlocks the channel.
        let before = self.set.borrow().epoch;
        let epoch = allocations
            .iter()
            .map(|a| a.allocation_id)
            .max()
            .unwrap_or(0);
        self.set.send_replace(pa::Assignments {
            term: 1,
            epoch: epoch.max(before),
            allocations,
        });
    }

    fn reports(&self) -> Vec<Got> {
        self.reports.lock().unwrap().clone()
    }

    /// The reports of `allocation`, as (event, reason).
    fn events(&self, allocation: u64) -> Vec<(pa::allocation_report::Event, String)> {
        self.reports()
            .into_iter()
            .filter(|g| g.report.allocation_id == allocation)
            .map(|g| (g.report.event(), g.report.reason))
            .collect()
    }

    async fn wait_for_event(&self, allocation: u64, event: pa::allocation_report::Event) -> Got {
        wait_until(&format!("{event:?} of allocation {allocation}"), || {
            self.reports()
                .into_iter()
                .find(|g| g.report.allocation_id == allocation && g.report.event() == event)
        })
        .await
    }
}

#[derive(Clone)]
struct Api(Arc<Cp>);

type SetStream = Pin<Box<dyn Stream<Item = Result<pa::Assignments, Status>> + Send>>;

#[tonic::async_trait]
impl AgentApi for Api {
    async fn register_node(
        &self,
        request: Request<pa::RegisterNodeRequest>,
    ) -> Result<Response<pa::RegisterNodeResponse>, Status> {
        self.0
            .registrations
            .lock()
            .unwrap()
            .push(request.into_inner());
        Ok(Response::new(pa::RegisterNodeResponse {
            lease_ms: 10_000,
            heartbeat_interval_ms: 100,
            term: 1,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pa::HeartbeatRequest>,
    ) -> Result<Response<pa::HeartbeatResponse>, Status> {
        let hb = request.into_inner();
        self.0.metrics.lock().unwrap().extend(hb.replica_metrics);
        Ok(Response::new(pa::HeartbeatResponse {
            term: 1,
            lease_ms: 10_000,
            register_again: false,
        }))
    }

    type WatchAssignmentsStream = SetStream;

    async fn watch_assignments(
        &self,
        _request: Request<pa::WatchAssignmentsRequest>,
    ) -> Result<Response<SetStream>, Status> {
        // The current set at once, then on every change and at least each second (as the
        // leader re-sends it).
        let rx = self.0.set.subscribe();
        let stream = futures::stream::unfold((rx, true), |(mut rx, first)| async move {
            if !first {
                let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
            }
            let set = rx.borrow_and_update().clone();
            Some((Ok(set), (rx, false)))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_allocation(
        &self,
        request: Request<pa::AllocationReport>,
    ) -> Result<Response<pa::ReportResponse>, Status> {
        self.0.reports.lock().unwrap().push(Got {
            report: request.into_inner(),
            at_ms: now_ms(),
        });
        Ok(Response::new(pa::ReportResponse {}))
    }

    async fn report_gpu_health(
        &self,
        _request: Request<pa::GpuHealthReport>,
    ) -> Result<Response<pa::ReportResponse>, Status> {
        Ok(Response::new(pa::ReportResponse {}))
    }
}

/// Starts the fake control plane; returns it and its address.
async fn control_plane() -> (Arc<Cp>, String) {
    let cp = Arc::new(Cp {
        set: tokio::sync::watch::Sender::new(pa::Assignments {
            term: 1,
            epoch: 0,
            allocations: Vec::new(),
        }),
        reports: Mutex::new(Vec::new()),
        metrics: Mutex::new(Vec::new()),
        registrations: Mutex::new(Vec::new()),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let api = Api(cp.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(AgentApiServer::new(api))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    (cp, addr)
}

/// A running agent; `stop` shuts it down (its workloads keep running under their shims).
struct Agent {
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<node_agent::agent::Stopped>>,
}

impl Agent {
    async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let stopped = tokio::time::timeout(DEADLINE, &mut self.task)
            .await
            .expect("the agent stops in time")
            .expect("the agent task ends");
        stopped.expect("the agent ran");
    }
}

fn config(cp: &str, state_dir: &Path, stop_grace: Duration) -> AgentConfig {
    AgentConfig {
        name: "n1".into(),
        control_plane: vec![cp.to_owned()],
        listen: "127.0.0.1:0".into(),
        advertise: "127.0.0.1:0".into(),
        state_dir: state_dir.to_path_buf(),
        partition: None,
        labels: BTreeMap::new(),
        shim_program: PathBuf::from(SHIM),
        shim_args: vec!["shim".into()],
        shim_launcher: true,
        stop_grace,
        fence_grace: Duration::from_millis(500),
        transport: proto::transport::Transport::Plain,
        reexec: None,
        cgroups: CgroupMode::Off,
        containers: containers::ContainerOptions {
            mode: containers::ContainerMode::Off,
            ..Default::default()
        },
        metrics_listen: None,
        service_ports: Some(ServicePorts {
            first: 61_000,
            last: 61_099,
        }),
    }
}

/// Starts an agent on `state_dir`. A previous agent on the same directory may still be
/// letting go of it (its runtime's lock): retried until it opens.
async fn start_agent(cp: &str, state_dir: &Path, stop_grace: Duration) -> Agent {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let sim = Arc::new(SimulatedBackend::from_preset("h100-pcie-1gpu", "n1").expect("preset"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(node_agent::agent::run(
            config(cp, state_dir, stop_grace),
            sim.clone(),
            Some(sim),
            async move {
                let _ = rx.await;
            },
        ));
        // Running (serving) or refused at once.
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !task.is_finished() {
            return Agent {
                shutdown: Some(tx),
                task,
            };
        }
        let refused = task.await.expect("the agent task ends");
        assert!(
            Instant::now() < deadline,
            "the agent did not start: {refused:?}"
        );
    }
}

async fn wait_until<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(t) = found() {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replica's HTTP server, played by the test: `/ready` answers with the status set,
/// `/metrics` with a gauge of two series.
struct Server {
    port: u16,
    ready: Arc<AtomicU16>,
}

async fn replica_server() -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let ready = Arc::new(AtomicU16::new(503));
    let status = ready.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let status = status.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]);
                let (code, body) = if request.starts_with("GET /metrics ") {
                    (
                        200,
                        "# TYPE queue_length gauge\nqueue_length{shard=\"a\"} 2\nqueue_length{shard=\"b\"} 3.5\n",
                    )
                } else if request.starts_with("GET /ready ") {
                    (status.load(Ordering::SeqCst), "")
                } else {
                    (404, "")
                };
                let reply = format!(
                    "HTTP/1.1 {code} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
            });
        }
    });
    Server { port, ready }
}

fn probe(check: pa::probe_spec::Check, failures: u32) -> pa::ProbeSpec {
    pa::ProbeSpec {
        check: Some(check),
        initial_delay_ms: 0,
        period_ms: 100,
        timeout_ms: 2_000,
        failure_threshold: failures,
        success_threshold: 1,
    }
}

/// Replica `id` of service t/web: runs `script` with `WORK` set, its port `http` at
/// `port`, ready when `GET /ready` passes, alive while `$WORK/alive-ID` exists, scraped for
/// `queue_length`.
fn replica(id: u64, port: u16, work: &Path, script: &str) -> pa::Assignment {
    pa::Assignment {
        allocation_id: id,
        job_id: 100 + id,
        job_name: format!("web-{id}"),
        tenant: "t".into(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: [("WORK".to_owned(), work.display().to_string())].into(),
        term: 1,
        ports: vec![pa::NamedPort {
            name: "http".into(),
            port: u32::from(port),
        }],
        replica: Some(pa::ReplicaInfo {
            service: "t/web".into(),
            ordinal: id as u32,
            revision: 2,
            readiness: Some(probe(
                pa::probe_spec::Check::Http(pa::HttpCheck {
                    port: u32::from(port),
                    path: "/ready".into(),
                }),
                1,
            )),
            liveness: Some(probe(
                pa::probe_spec::Check::Exec(pa::ExecCheck {
                    command: vec![
                        "sh".into(),
                        "-c".into(),
                        format!("test -e \"$WORK/alive-{id}\""),
                    ],
                }),
                2,
            )),
            metric: Some(pa::MetricScrape {
                port: u32::from(port),
                path: "/metrics".into(),
                metric: "queue_length".into(),
            }),
        }),
        ..Default::default()
    }
}

fn stopped(mut a: pa::Assignment) -> pa::Assignment {
    a.stop = true;
    a
}

use pa::allocation_report::Event;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_probed_scraped_restarted_on_liveness_and_started_on_time() {
    let (cp, addr) = control_plane().await;
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let server = replica_server().await;
    let agent = start_agent(&addr, state.path(), GRACE).await;

    let registered = wait_until("a registration", || {
        cp.registrations.lock().unwrap().first().cloned()
    })
    .await;
    assert_eq!(
        registered.service_ports,
        Some(pa::PortRange {
            first: 61_000,
            last: 61_099
        })
    );

    std::fs::write(work.path().join("alive-1"), "").expect("write");
    let one = replica(
        1,
        server.port,
        work.path(),
        "env > \"$WORK/env-1.tmp\" && mv \"$WORK/env-1.tmp\" \"$WORK/env-1\"; exec sleep 600",
    );
    cp.assign(vec![one.clone()]);
    cp.wait_for_event(1, Event::Started).await;

    // Its ports and place.
    let env = wait_until("the replica's environment", || {
        std::fs::read_to_string(work.path().join("env-1")).ok()
    })
    .await;
    for want in [
        format!("PORT={}", server.port),
        format!("GPUCP_PORT_HTTP={}", server.port),
        "GPUCP_SERVICE=t/web".into(),
        "GPUCP_SERVICE_NAME=web".into(),
        "GPUCP_REPLICA=1".into(),
        "GPUCP_REVISION=2".into(),
    ] {
        assert!(env.lines().any(|l| l == want), "no {want} in\n{env}");
    }

    // Not ready while /ready answers 503 (its failures change nothing: it starts unready);
    // ready once it answers 200, after its start.
    assert!(
        !cp.events(1).iter().any(|(e, _)| *e == Event::Ready),
        "{:?}",
        cp.events(1)
    );
    assert!(
        cp.metrics.lock().unwrap().is_empty(),
        "an unready replica's gauge is not scraped (the autoscaler reads ready ones)"
    );
    server.ready.store(200, Ordering::SeqCst);
    cp.wait_for_event(1, Event::Ready).await;
    // Ready, its gauge is scraped and rides the heartbeats: 2 + 3.5 over its two series.
    wait_until("the replica's gauge in a heartbeat", || {
        cp.metrics
            .lock()
            .unwrap()
            .iter()
            .find(|m| m.allocation_id == 1 && m.error.is_empty() && m.value == 5.5)
            .cloned()
    })
    .await;

    server.ready.store(503, Ordering::SeqCst);
    let unready = cp.wait_for_event(1, Event::NotReady).await;
    assert!(
        unready.report.reason.ends_with("/ready answered 503"),
        "{unready:?}"
    );
    let events: Vec<Event> = cp.events(1).into_iter().map(|(e, _)| e).collect();
    assert_eq!(
        events,
        [Event::Started, Event::Ready, Event::NotReady],
        "transitions only, in order"
    );

    // The liveness probe fails twice in a row: stopped, and reported failed with why.
    std::fs::remove_file(work.path().join("alive-1")).expect("remove");
    let failed = cp.wait_for_event(1, Event::Failed).await;
    assert_eq!(
        failed.report.reason,
        "liveness probe failed: the check's command exited with code 1"
    );
    assert_eq!(
        cp.events(1)
            .iter()
            .filter(|(e, _)| matches!(e, Event::Failed | Event::Stopped | Event::Succeeded))
            .count(),
        1,
        "{:?}",
        cp.events(1)
    );

    // The control plane restarts it as allocation 2, not before its back-off has passed;
    // allocation 3 waits an hour and is stopped before then.
    std::fs::write(work.path().join("alive-2"), "").expect("write");
    let due = now_ms() + 1_500;
    let mut two = replica(2, server.port, work.path(), "exec sleep 600");
    two.start_after_ms = due;
    let mut three = replica(
        3,
        server.port,
        work.path(),
        "touch \"$WORK/ran-3\"; exec sleep 600",
    );
    three.start_after_ms = now_ms() + 3_600_000;
    cp.assign(vec![one.clone(), two.clone(), three.clone()]);
    let started = cp.wait_for_event(2, Event::Started).await;
    assert!(
        started.at_ms >= due,
        "started {} ms before its start time",
        due - started.at_ms
    );
    cp.assign(vec![two.clone(), stopped(three.clone())]);
    cp.wait_for_event(3, Event::Stopped).await;
    assert_eq!(
        cp.events(3),
        [(Event::Stopped, String::new())],
        "never started"
    );
    assert!(!work.path().join("ran-3").exists());

    // Stop what still runs.
    cp.assign(vec![stopped(two)]);
    cp.wait_for_event(2, Event::Stopped).await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_keeps_probing_its_replica_and_reports_a_liveness_stop_it_inherits() {
    let (cp, addr) = control_plane().await;
    let state = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let server = replica_server().await;
    server.ready.store(200, Ordering::SeqCst);
    let agent = start_agent(&addr, state.path(), GRACE).await;

    // A replica that outlives SIGTERM (so a liveness stop lasts the grace), marking it.
    std::fs::write(work.path().join("alive-5"), "").expect("write");
    let five = replica(
        5,
        server.port,
        work.path(),
        "trap 'touch \"$WORK/term-5\"' TERM; while :; do sleep 0.05; done",
    );
    cp.assign(vec![five.clone()]);
    cp.wait_for_event(5, Event::Started).await;
    cp.wait_for_event(5, Event::Ready).await;

    // Restarted: the replica keeps running, is not started again, and is probed again (its
    // readiness is unknown to the new agent, so it says it once more).
    agent.stop().await;
    let reports_before = cp.reports().len();
    let agent = start_agent(&addr, state.path(), GRACE).await;
    wait_until("a READY from the restarted agent", || {
        cp.reports()[reports_before..]
            .iter()
            .find(|g| g.report.allocation_id == 5 && g.report.event() == Event::Ready)
            .cloned()
    })
    .await;

    // Its liveness probe fails; the agent is restarted while the replica takes its grace.
    std::fs::remove_file(work.path().join("alive-5")).expect("remove");
    wait_until("SIGTERM to the replica", || {
        work.path().join("term-5").exists().then_some(())
    })
    .await;
    agent.stop().await;
    let inherited_at = now_ms();
    let agent = start_agent(&addr, state.path(), GRACE).await;
    let failed = cp.wait_for_event(5, Event::Failed).await;
    assert!(
        failed.at_ms >= inherited_at,
        "reported by the agent that inherited the stop"
    );
    assert_eq!(
        failed.report.reason,
        "liveness probe failed: the check's command exited with code 1"
    );
    let events: Vec<Event> = cp.events(5).into_iter().map(|(e, _)| e).collect();
    assert_eq!(
        events.iter().filter(|e| **e == Event::Started).count(),
        1,
        "{events:?}"
    );
    assert!(
        !events.contains(&Event::Stopped),
        "a liveness stop is a failure: {events:?}"
    );
    agent.stop().await;
}
