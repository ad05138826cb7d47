//! Metrics and probes, scraped by a real Prometheus: three replicas and a simulated host, each
//! with `--metrics-listen`; Prometheus (Debian's `prometheus` package) scrapes them every
//! second with the shipped alerting rules loaded, and the series are read back through its
//! query API while jobs run. Without the binary the test says "not run" (or fails, with
//! GPUCP_REQUIRE_PROMETHEUS=1, as CI sets it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use control_plane::local_cluster::free_ports;
use node_agent::observe::http_get;

use crate::util::*;

/// The shipped alerting rules (`deploy/prometheus/alerts.yml`).
fn alerts_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/alerts.yml")
}

/// Whether `program` runs here; otherwise "not run", or a failure when `require_env` is 1.
fn available(program: &str, require_env: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var(require_env).as_deref() != Ok("1"),
            "{program} is not installed but {require_env}=1: install Debian's `prometheus` package (apt-get install -y prometheus), as .ci/run does"
        );
        println!("not run: {program} is not installed (apt-get install -y prometheus)");
    }
    found
}

fn encode_query(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!("----- prometheus log (tail) -----");
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
    }
}

impl Prometheus {
    fn start(dir: &Path, replicas: &[String], agents: &[String]) -> Prometheus {
        let list = |t: &[String]| {
            t.iter()
                .map(|a| format!("'{a}'"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - '{}'\nscrape_configs:\n  - job_name: gpucp-replicas\n    static_configs:\n      - targets: [{}]\n  - job_name: gpucp-agents\n    static_configs:\n      - targets: [{}]\n",
            alerts_file().display(),
            list(replicas),
            list(agents)
        );
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let port = free_ports(1).unwrap()[0];
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let log = dir.join("prometheus.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("starting prometheus");
        Prometheus { child, addr, log }
    }

    async fn get_json(&self, path: &str) -> Option<serde_json::Value> {
        let (status, body) = http_get(self.addr, path).await.ok()?;
        (status == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// The value of an instant query that yields one number (`None`: no result yet).
    async fn scalar(&self, query: &str) -> Option<f64> {
        let v = self
            .get_json(&format!("/api/v1/query?query={}", encode_query(query)))
            .await?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    }

    /// Polls `query` until `pred` holds for its value, or panics after `timeout` saying what
    /// it last saw.
    async fn wait_for(&self, query: &str, timeout: Duration, pred: impl Fn(f64) -> bool) -> f64 {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let v = self.scalar(query).await;
            if let Some(v) = v
                && pred(v)
            {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus query {query:?} never satisfied its condition within {timeout:?}; last value {v:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until every target has been scraped successfully.
    async fn wait_targets_up(&self, n: usize, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let seen = self.get_json("/api/v1/targets").await;
            let up = seen
                .as_ref()
                .and_then(|v| v["data"]["activeTargets"].as_array().cloned())
                .unwrap_or_default();
            if up.len() == n && up.iter().all(|t| t["health"] == "up") {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus did not see {n} targets up within {timeout:?}: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_replicas_and_agents_and_the_series_move() {
    if !available("prometheus", "GPUCP_REQUIRE_PROMETHEUS") {
        return;
    }
    step("three replicas and one simulated 8-GPU host, each with --metrics-listen");
    let mut c = describe(3, &FAST_LEASES);
    c.agent_program = Some((gpuctl_bin(), vec!["agent".into()]));
    let ports = free_ports(6).unwrap();
    let replica_metrics: Vec<String> = ports[..3]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    for (r, addr) in c.replicas.values_mut().zip(&replica_metrics) {
        r.metrics_addr = Some(addr.clone());
    }
    let agent_metrics = format!("127.0.0.1:{}", ports[3]);
    c.add_agent(
        "h1",
        "dgx-h100",
        ports[4],
        &[
            "--stop-grace-secs",
            "1",
            "--fence-grace-ms",
            "500",
            "--metrics-listen",
            &agent_metrics,
        ],
    );
    c.start_all().unwrap();
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap().leader;
    c.start_agent("h1").unwrap();
    let mut client = c.client().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !list_nodes(&mut client)
        .await
        .iter()
        .any(|n| n.name == "h1" && n.status == "ready")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "h1 did not register"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    step("probes: /healthz and /readyz answer 200 on a ready leader and a registered agent");
    let leader_metrics: SocketAddr = replica_metrics[leader as usize - 1].parse().unwrap();
    let agent_addr: SocketAddr = agent_metrics.parse().unwrap();
    for (addr, path) in [
        (leader_metrics, "/healthz"),
        (leader_metrics, "/readyz"),
        (agent_addr, "/healthz"),
        (agent_addr, "/readyz"),
    ] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) = http_get(addr, path).await.unwrap();
            if status == 200 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{addr}{path} answered {status}: {body}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    step("Prometheus scrapes all four targets, with the shipped alerting rules loaded");
    let dir = tempfile::tempdir().unwrap();
    let prom = Prometheus::start(
        dir.path(),
        &replica_metrics,
        std::slice::from_ref(&agent_metrics),
    );
    prom.wait_targets_up(4, Duration::from_secs(60)).await;
    let wait = Duration::from_secs(30);
    prom.wait_for("sum(gpucp_raft_is_leader)", wait, |v| v == 1.0)
        .await;
    prom.wait_for("count(gpucp_raft_replication_lag_entries)", wait, |v| {
        v == 2.0
    })
    .await;
    prom.wait_for(r#"max(gpucp_nodes{state="ready"})"#, wait, |v| v == 1.0)
        .await;
    prom.wait_for(r#"max(gpucp_gpus{state="idle"})"#, wait, |v| v == 8.0)
        .await;
    prom.wait_for("count(gpucp_agent_enforcement_info)", wait, |v| v == 1.0)
        .await;
    let applied_before = prom
        .wait_for("max(gpucp_raft_applied_index)", wait, |v| v > 0.0)
        .await;
    let placements_before = prom
        .scalar("sum(gpucp_placements_total)")
        .await
        .unwrap_or(0.0);

    step("three short jobs run to success; an 8-GPU job runs while another waits behind it");
    let mut ids = Vec::new();
    for i in 0..3 {
        let r = submit(&mut client, shell_job(1, "exit 0"), &format!("short-{i}"))
            .await
            .unwrap();
        ids.push(r.id);
    }
    for id in &ids {
        wait_job(
            &mut client,
            *id,
            Duration::from_secs(30),
            "succeeded",
            |j| j.state == "succeeded",
        )
        .await;
    }
    let long = submit(&mut client, spec("long", 8), "long")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, long, Duration::from_secs(30), "ran", |j| {
        j.state == "running"
    })
    .await;
    submit(&mut client, spec("waits", 8), "waits")
        .await
        .unwrap();

    step("the series moved, as Prometheus recorded them");
    prom.wait_for("sum(gpucp_placements_total)", wait, |v| {
        v >= placements_before + 4.0
    })
    .await;
    prom.wait_for("max(gpucp_raft_applied_index)", wait, |v| {
        v > applied_before
    })
    .await;
    prom.wait_for(
        r#"sum(gpucp_task_exits_total{kind="succeeded"})"#,
        wait,
        |v| v >= 3.0,
    )
    .await;
    prom.wait_for(
        r#"max(gpucp_jobs{state="pending",tenant="team-a"})"#,
        wait,
        |v| v == 1.0,
    )
    .await;
    prom.wait_for(r#"max(gpucp_jobs{state="running"})"#, wait, |v| v == 1.0)
        .await;
    prom.wait_for(r#"max(gpucp_gpus{state="allocated"})"#, wait, |v| v == 8.0)
        .await;
    prom.wait_for("sum(gpucp_api_submit_duration_seconds_count)", wait, |v| {
        v >= 5.0
    })
    .await;
    prom.wait_for(
        "sum(gpucp_scheduler_pass_duration_seconds_count)",
        wait,
        |v| v >= 1.0,
    )
    .await;
    prom.wait_for(
        "min(gpucp_raft_log_flush_duration_seconds_count)",
        wait,
        |v| v >= 1.0,
    )
    .await;
    prom.wait_for("sum(gpucp_agent_allocations_running)", wait, |v| v == 1.0)
        .await;
    prom.wait_for(
        r#"sum(gpucp_agent_launches_total{result="ok"})"#,
        wait,
        |v| v >= 4.0,
    )
    .await;
    prom.wait_for(
        r#"sum(gpucp_agent_exits_total{kind="succeeded"})"#,
        wait,
        |v| v >= 3.0,
    )
    .await;
    prom.wait_for("sum(gpucp_agent_registered)", wait, |v| v == 1.0)
        .await;
    prom.wait_for("sum(gpucp_ready)", wait, |v| v == 3.0).await;

    step("every query of the shipped Grafana dashboard is valid PromQL");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/gpu-control-plane.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(exprs.len() >= 20, "{exprs:?}");
    let mut empty = Vec::new();
    for e in &exprs {
        let v = prom
            .get_json(&format!("/api/v1/query?query={}", encode_query(e)))
            .await;
        assert!(
            v.as_ref().is_some_and(|v| v["status"] == "success"),
            "dashboard query {e:?} failed: {v:?}"
        );
        if v.is_some_and(|v| v["data"]["result"].as_array().is_none_or(|r| r.is_empty())) {
            empty.push(e.clone());
        }
    }
    println!("dashboard queries with no data yet (nothing of that kind happened): {empty:#?}");

    step(
        "every shipped alerting rule evaluates without error, and none fires on a healthy cluster",
    );
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let rules = prom.get_json("/api/v1/rules").await;
        let all: Vec<serde_json::Value> = rules
            .as_ref()
            .and_then(|v| v["data"]["groups"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = !all.is_empty() && all.iter().all(|r| r["health"] == "ok");
        if evaluated {
            let firing: Vec<&serde_json::Value> =
                all.iter().filter(|r| r["state"] == "firing").collect();
            assert!(
                firing.is_empty(),
                "alerts fire on a healthy cluster: {firing:#?}"
            );
            break;
        }
        let bad: Vec<_> = all.iter().filter(|r| r["health"] == "err").collect();
        assert!(bad.is_empty(), "alerting rules fail to evaluate: {bad:#?}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the alerting rules were not evaluated: {rules:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    step("an Xid on a GPU shows on the agent, on the leader and in the GPU states");
    let (ok, out, err) = gpuctl(&c, &["node", "inject", "h1", "--gpu", "7", "--xid", "48"]);
    assert!(ok, "injecting an Xid failed: {out}{err}");
    prom.wait_for(
        r#"sum(gpucp_agent_gpu_xid_events_total{code="48"})"#,
        wait,
        |v| v == 1.0,
    )
    .await;
    prom.wait_for("min(gpucp_agent_gpu_healthy)", wait, |v| v == 0.0)
        .await;
    prom.wait_for(
        r#"sum(gpucp_gpu_xid_reports_total{code="48"})"#,
        wait,
        |v| v == 1.0,
    )
    .await;
    prom.wait_for(r#"max(gpucp_gpus{state="unhealthy"})"#, wait, |v| v == 1.0)
        .await;
}

/// The shipped rules file passes `promtool check rules`.
#[test]
fn the_alerting_rules_pass_promtool() {
    if !available("promtool", "GPUCP_REQUIRE_PROMETHEUS") {
        return;
    }
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(alerts_file())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules {}:\n{}{}",
        alerts_file().display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
