//! `gpuctl demo-server` (hidden): a small HTTP server to run as a service's replica in tours,
//! tests and benchmarks, so services can be shown without a model server. It serves on
//! `$PORT` (what the agent gives a replica's first port) or `--port`:
//!
//! - `/`: who answers: its service, replica ordinal and revision (from the agent's
//!   `GPUCP_SERVICE`, `GPUCP_REPLICA`, `GPUCP_REVISION`), host name, process id (so a test
//!   or a tour can `kill -9` it) and `--message`;
//! - `/healthz`: liveness, always 200 while it runs;
//! - `/ready`: readiness, 503 until `--ready-after` has passed since start and while the
//!   `--unready-file` exists (so a tour can make a replica unready with `touch`);
//! - `/metrics`: Prometheus text with the gauge `queue_length` (read from `--queue-file` at
//!   each scrape, 0 when the file is absent: what an autoscaler follows) and the counter
//!   `requests_total` (answers to `/`).
//!
//! `--fail-after` makes it exit 1 after that long, to show restarts, back-off and crash loops.
//! It runs on one thread and answers SIGTERM by exiting 0 at once, so replicas start and stop
//! fast and cost little memory.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::parse::parse_duration_ms;

#[derive(clap::Args, Debug, Clone)]
pub struct DemoServerArgs {
    /// Port to serve on (default: $PORT, which the agent sets for a replica; else 8080).
    #[arg(long, env = "PORT", value_name = "PORT")]
    pub port: Option<u16>,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0", value_name = "ADDR")]
    pub listen: IpAddr,
    /// `/ready` answers 503 until this long after start (`5s`).
    #[arg(long, value_name = "DURATION")]
    pub ready_after: Option<String>,
    /// `/ready` answers 503 while this file exists.
    #[arg(long, value_name = "PATH")]
    pub unready_file: Option<PathBuf>,
    /// The `queue_length` gauge is the number in this file (0 when it is absent).
    #[arg(long, value_name = "PATH")]
    pub queue_file: Option<PathBuf>,
    /// Exit 1 after this long (`30s`), to show restarts and crash loops.
    #[arg(long, value_name = "DURATION")]
    pub fail_after: Option<String>,
    /// A word `/` answers with, to tell revisions apart (`--message v2`).
    #[arg(long, default_value = "")]
    pub message: String,
}

/// Who answers, as `/` says it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub service: String,
    pub replica: String,
    pub revision: String,
    pub hostname: String,
    pub message: String,
}

impl Identity {
    /// From the agent's environment; what it does not say is `-`.
    fn from_env(message: &str) -> Identity {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Identity {
            service: var("GPUCP_SERVICE").unwrap_or_else(|| "-".into()),
            replica: var("GPUCP_REPLICA").unwrap_or_else(|| "-".into()),
            revision: var("GPUCP_REVISION").unwrap_or_else(|| "-".into()),
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .or_else(|| var("HOSTNAME"))
                .unwrap_or_else(|| "-".into()),
            message: message.to_owned(),
        }
    }
}

/// The server's state: its settings, its start and its two metrics.
pub struct Demo {
    started: Instant,
    ready_after: Duration,
    unready_file: Option<PathBuf>,
    queue_file: Option<PathBuf>,
    identity: Identity,
    requests: Counter,
    queue_length: Gauge<f64, AtomicU64>,
    registry: Registry,
}

impl Demo {
    pub fn new(
        identity: Identity,
        ready_after: Duration,
        unready_file: Option<PathBuf>,
        queue_file: Option<PathBuf>,
    ) -> Demo {
        let requests = Counter::default();
        let queue_length = Gauge::<f64, AtomicU64>::default();
        let mut registry = Registry::default();
        // prometheus-client adds `_total` to a counter's name.
        registry.register("requests", "Requests answered on /", requests.clone());
        registry.register(
            "queue_length",
            "Work waiting, as read from --queue-file",
            queue_length.clone(),
        );
        Demo {
            started: Instant::now(),
            ready_after,
            unready_file,
            queue_file,
            identity,
            requests,
            queue_length,
            registry,
        }
    }

    /// `/`: who answers.
    pub fn hello(&self) -> String {
        self.requests.inc();
        let i = &self.identity;
        let mut text = format!(
            "service={} replica={} revision={} hostname={} pid={} uptime={}s",
            i.service,
            i.replica,
            i.revision,
            i.hostname,
            std::process::id(),
            self.started.elapsed().as_secs()
        );
        if !i.message.is_empty() {
            text.push_str(&format!(" message={}", i.message));
        }
        text.push('\n');
        text
    }

    /// `/ready`: why it is not ready, if it is not.
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(f) = &self.unready_file
            && f.exists()
        {
            return Err(format!("{} exists (--unready-file)", f.display()));
        }
        let up = self.started.elapsed();
        if up < self.ready_after {
            return Err(format!(
                "starting: ready in {:.1}s (--ready-after)",
                (self.ready_after - up).as_secs_f64()
            ));
        }
        Ok(())
    }

    /// The queue file's number (0 when it is absent, or not a number: said on stderr).
    pub fn queue_length(&self) -> f64 {
        let Some(path) = &self.queue_file else {
            return 0.0;
        };
        let Ok(text) = std::fs::read_to_string(path) else {
            return 0.0;
        };
        match text.trim().parse::<f64>() {
            Ok(v) if v.is_finite() => v,
            _ => {
                eprintln!(
                    "demo-server: {} holds {:?}, not a number; queue_length is 0",
                    path.display(),
                    text.trim().chars().take(40).collect::<String>()
                );
                0.0
            }
        }
    }

    /// `/metrics`: the registry after reading the queue file.
    pub fn metrics(&self) -> Response {
        self.queue_length.set(self.queue_length());
        node_agent::observe::metrics_response(&self.registry)
    }
}

/// The routes, over a shared `Demo`.
pub fn router(demo: Arc<Demo>) -> Router {
    Router::new()
        .route(
            "/",
            get(|State(d): State<Arc<Demo>>| async move { d.hello() }),
        )
        .route("/healthz", get(|| async { (StatusCode::OK, "ok\n") }))
        .route(
            "/ready",
            get(|State(d): State<Arc<Demo>>| async move {
                node_agent::observe::probe_response(d.readiness())
            }),
        )
        .route(
            "/metrics",
            get(|State(d): State<Arc<Demo>>| async move { d.metrics() }),
        )
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found: try /, /healthz, /ready or /metrics\n",
            )
                .into_response()
        })
        .with_state(demo)
}

fn duration(flag: &str, text: &Option<String>) -> anyhow::Result<Duration> {
    Ok(Duration::from_millis(match text {
        Some(t) => parse_duration_ms(t).with_context(|| flag.to_owned())?,
        None => 0,
    }))
}

/// Runs the server until SIGTERM or SIGINT (exit 0), or `--fail-after` (exit 1).
pub fn run(args: DemoServerArgs) -> anyhow::Result<()> {
    let ready_after = duration("--ready-after", &args.ready_after)?;
    let fail_after = args
        .fail_after
        .as_ref()
        .map(|_| duration("--fail-after", &args.fail_after))
        .transpose()?;
    let addr = SocketAddr::new(args.listen, args.port.unwrap_or(8080));
    let identity = Identity::from_env(&args.message);
    let demo = Arc::new(Demo::new(
        identity.clone(),
        ready_after,
        args.unready_file,
        args.queue_file,
    ));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
            format!("demo-server cannot listen on {addr} (give --port, or set PORT)")
        })?;
        let bound = listener.local_addr().unwrap_or(addr);
        eprintln!(
            "demo-server: serving on {bound}: replica {} of service {}, revision {}",
            identity.replica, identity.service, identity.revision
        );
        if let Some(after) = fail_after {
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                eprintln!(
                    "demo-server: exiting with status 1 after {} (--fail-after)",
                    super::probe_spec::millis_text(after.as_millis() as u64)
                );
                std::process::exit(1);
            });
        }
        axum::serve(listener, router(demo))
            .with_graceful_shutdown(stop_signal())
            .await
            .context("demo-server stopped serving")
    })
}

/// SIGTERM (how a replica is stopped) or SIGINT (Ctrl-C).
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without handlers the default action (exit) still stops it.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    eprintln!("demo-server: stopping");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            service: "ml/web".into(),
            replica: "2".into(),
            revision: "3".into(),
            hostname: "h1".into(),
            message: "v2".into(),
        }
    }

    #[test]
    fn hello_says_who_answers_and_counts() {
        let d = Demo::new(identity(), Duration::ZERO, None, None);
        let text = d.hello();
        let expected = format!(
            "service=ml/web replica=2 revision=3 hostname=h1 pid={} uptime=0s message=v2",
            std::process::id()
        );
        assert!(text.starts_with(&expected), "{text}");
        d.hello();
        assert_eq!(d.requests.get(), 2);
    }

    #[test]
    fn ready_after_a_delay_and_unready_while_the_file_exists() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("unready");
        let d = Demo::new(
            identity(),
            Duration::from_secs(3600),
            Some(file.clone()),
            None,
        );
        let e = d.readiness().unwrap_err();
        assert!(e.contains("starting: ready in"), "{e}");
        let d = Demo::new(identity(), Duration::ZERO, Some(file.clone()), None);
        assert_eq!(d.readiness(), Ok(()));
        std::fs::write(&file, "").unwrap();
        assert!(d.readiness().unwrap_err().contains("--unready-file"));
        std::fs::remove_file(&file).unwrap();
        assert_eq!(d.readiness(), Ok(()));
    }

    #[test]
    fn the_queue_gauge_reads_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("queue");
        let d = Demo::new(identity(), Duration::ZERO, None, Some(file.clone()));
        assert_eq!(d.queue_length(), 0.0, "absent: 0");
        std::fs::write(&file, "12.5\n").unwrap();
        assert_eq!(d.queue_length(), 12.5);
        std::fs::write(&file, "lots").unwrap();
        assert_eq!(d.queue_length(), 0.0, "not a number: 0");
    }

    /// The whole server over a real socket, as an agent's probes and scrapes reach it.
    #[tokio::test]
    async fn the_routes_answer_over_http() {
        use node_agent::observe::http_get;
        let dir = tempfile::tempdir().unwrap();
        let queue = dir.path().join("queue");
        let unready = dir.path().join("unready");
        std::fs::write(&queue, "7").unwrap();
        let demo = Arc::new(Demo::new(
            identity(),
            Duration::ZERO,
            Some(unready.clone()),
            Some(queue),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, router(demo)).await });
        let (status, body) = http_get(addr, "/").await.unwrap();
        assert_eq!(status, 200);
        assert!(body.contains("replica=2 revision=3"), "{body}");
        assert_eq!(http_get(addr, "/healthz").await.unwrap().0, 200);
        assert_eq!(http_get(addr, "/ready").await.unwrap().0, 200);
        std::fs::write(&unready, "").unwrap();
        let (status, body) = http_get(addr, "/ready").await.unwrap();
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("not ready"), "{body}");
        let (status, body) = http_get(addr, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        assert!(body.contains("\nqueue_length 7.0\n"), "{body}");
        assert!(body.contains("\nrequests_total 1\n"), "{body}");
        assert_eq!(http_get(addr, "/nope").await.unwrap().0, 404);
        server.abort();
    }

    #[test]
    fn the_hidden_subcommand_parses_its_flags() {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from([
            "gpuctl",
            "demo-server",
            "--port",
            "9000",
            "--ready-after",
            "5s",
            "--fail-after",
            "1m",
            "--queue-file",
            "/tmp/q",
            "--message",
            "v2",
        ])
        .unwrap();
        let crate::cli::Command::DemoServer(a) = cli.command else {
            panic!("not demo-server");
        };
        assert_eq!(a.port, Some(9000));
        assert_eq!(
            duration("--ready-after", &a.ready_after).unwrap(),
            Duration::from_secs(5)
        );
        let help = <crate::cli::Cli as clap::CommandFactory>::command()
            .render_help()
            .to_string();
        assert!(!help.contains("demo-server"), "hidden from help: {help}");
    }
}
