//! `gpuctl bench submit --clients N,...`: committed submissions per second with N concurrent
//! clients, closed loop (each client sends its next submission when the previous one is
//! acknowledged), the clients spread over the three replicas as users' clients would be.
//! This is the throughput figure (how many writes the cluster commits), where the open-loop
//! runs of `bench_submit` measure latency at a given load.

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use super::bench::{percentile, submit_request};
use super::output::table;
use crate::client::{Client, with_timeout};
use crate::local_cluster::LocalCluster;

/// A run's first second is not counted: connections open and the replicas' caches fill.
const WARM_UP: Duration = Duration::from_secs(1);

/// Result of one closed-loop run.
pub struct ClosedRun {
    pub clients: usize,
    pub committed: u64,
    pub errors: u64,
    pub per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl ClosedRun {
    pub fn json(&self) -> serde_json::Value {
        json!({
            "clients": self.clients, "committed": self.committed, "errors": self.errors,
            "committed_per_sec": self.per_sec, "latency_ms": {"p50": self.p50_ms, "p99": self.p99_ms},
        })
    }
}

/// One closed-loop run of `clients` clients for `duration` (after a warm-up).
pub async fn run_one(
    cluster: &LocalCluster,
    clients: usize,
    duration: Duration,
    prefix: &str,
) -> anyhow::Result<ClosedRun> {
    let endpoints = cluster.endpoints();
    let credentials = cluster.credentials()?;
    let prefix = prefix.to_owned();
    closed_loop(
        clients,
        duration,
        |c| {
            // Client c starts at replica c mod 3: a third of the clients reach the leader
            // directly, the rest through a follower, which forwards.
            let mut rotated = endpoints.clone();
            rotated.rotate_left(c % endpoints.len());
            let mut client = Client::new(&rotated, &credentials)?;
            client.deadline = Duration::from_secs(10);
            Ok((client, format!("{prefix}-c{c}")))
        },
        |(mut client, prefix): (Client, String), i| async move {
            let req = submit_request(i, &prefix);
            let ok = client
                .call(|mut c, t| {
                    let r = req.clone();
                    async move { c.submit_job(with_timeout(r, t)).await }
                })
                .await
                .is_ok();
            ((client, prefix), ok)
        },
    )
    .await
}

/// `clients` concurrent clients, each made by `connect(c)` and then calling `op` in a loop,
/// the next call once the last has answered, for `duration` after a warm-up. `op` hands the
/// client back with whether the call succeeded. Only calls sent and answered inside the
/// counted window are counted.
pub async fn closed_loop<C, F, Fut>(
    clients: usize,
    duration: Duration,
    connect: impl Fn(usize) -> anyhow::Result<C>,
    op: F,
) -> anyhow::Result<ClosedRun>
where
    C: Send + 'static,
    F: Fn(C, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = (C, bool)> + Send,
{
    if clients == 0 {
        bail!("--clients must be at least 1");
    }
    let start = Instant::now();
    let counted_from = start + WARM_UP;
    let end = counted_from + duration;
    let mut tasks = Vec::with_capacity(clients);
    for c in 0..clients {
        let mut client = connect(c)?;
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut i = 0u64;
            loop {
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let (back, ok) = op(client, i).await;
                client = back;
                i += 1;
                let done = Instant::now();
                if sent < counted_from || done > end {
                    continue;
                }
                if ok {
                    latencies.push((done - sent).as_secs_f64() * 1000.0);
                } else {
                    errors += 1;
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        latencies.extend(l);
        errors += e;
    }
    latencies.sort_by(|a, b| a.total_cmp(b));
    Ok(ClosedRun {
        clients,
        committed: latencies.len() as u64,
        errors,
        per_sec: latencies.len() as f64 / duration.as_secs_f64(),
        p50_ms: percentile(&latencies, 50.0),
        p99_ms: percentile(&latencies, 99.0),
    })
}

/// Every client count in turn; the table and JSON of the runs.
pub async fn run(
    cluster: &LocalCluster,
    clients: &[usize],
    duration: Duration,
) -> anyhow::Result<(String, serde_json::Value)> {
    let mut runs = Vec::new();
    for (k, &n) in clients.iter().enumerate() {
        runs.push(run_one(cluster, n, duration, &format!("closed-{k}")).await?);
    }
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.clients.to_string(),
                r.committed.to_string(),
                r.errors.to_string(),
                format!("{:.0}", r.per_sec),
                format!("{:.2}", r.p50_ms),
                format!("{:.2}", r.p99_ms),
            ]
        })
        .collect();
    let text = format!(
        "closed-loop submissions through 3 replicas (durable, loopback), clients spread over the replicas, {}s per run\n{}",
        duration.as_secs_f64(),
        table(
            &[
                "CLIENTS",
                "COMMITTED",
                "ERRORS",
                "COMMITTED/S",
                "P50_MS",
                "P99_MS"
            ],
            &rows
        )
    );
    let json = json!({
        "mode": "closed-loop",
        "runs": runs.iter().map(ClosedRun::json).collect::<Vec<_>>(),
    });
    Ok((text, json))
}
