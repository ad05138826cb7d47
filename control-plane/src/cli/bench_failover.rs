//! `gpuctl bench failover`: SIGKILL the leader while work flows, and time the recovery.
//!
//! Work flowing means a fleet of simulated hosts (registered through the agent API, keeping
//! their leases, finishing each job as soon as it is assigned) and a steady stream of one-GPU
//! submissions. Each round waits until the leader is placing jobs, kills it, and measures from
//! the SIGKILL to:
//! - a new leader (a survivor reports a leader of a later term),
//! - the first new commit (a probe submission through the survivors commits),
//! - the first new placement (a host is assigned an allocation that a leader of a later term
//!   placed, seen on its assignment stream, so the host's reconnection counts too).
//!
//! The killed replica restarts and catches up between rounds. Reported as p50/p99/max.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::bench::{submit_request, summary};
use super::bench_hosts::{FleetOptions, SimulatedFleet};
use super::output::table;
use crate::client::{Client, with_timeout};
use crate::local_cluster::{LocalCluster, StartMode};

pub struct Args {
    pub kills: usize,
    pub hosts: usize,
    /// Submissions per second of the steady job stream.
    pub rate: u64,
    /// Load one core with a busy loop for the whole run, as a busy host would be.
    pub cpu_hog: bool,
    /// After the kills, keep the work flowing this long without faults and count the
    /// elections that happen anyway (spurious ones: nothing failed).
    pub steady: Duration,
}

/// A busy loop on one core for as long as it lives (a shell spinning: no I/O, no sleeps).
struct CpuHog(std::process::Child);

impl CpuHog {
    fn start() -> anyhow::Result<CpuHog> {
        let child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(std::process::Stdio::null())
            .spawn()
            .context("starting the CPU hog (sh)")?;
        Ok(CpuHog(child))
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Most submissions of the steady stream in flight (during a failover they wait).
const STREAM_IN_FLIGHT: u64 = 256;

pub async fn run(
    cluster: &mut LocalCluster,
    args: Args,
) -> anyhow::Result<(String, serde_json::Value)> {
    if args.hosts == 0 || args.rate == 0 {
        bail!("--hosts and --rate must be at least 1");
    }
    cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let mut fleet = SimulatedFleet::start(
        cluster,
        &FleetOptions {
            hosts: args.hosts,
            preset: "dgx-h100".into(),
            prefix: "sim".into(),
            heartbeat: None,
        },
    )
    .await
    .context("registering the simulated hosts")?;
    fleet.finish_jobs()?;
    let stream = JobStream::start(cluster.client()?, args.rate);
    let _hog = args.cpu_hog.then(CpuHog::start).transpose()?;

    let mut to_leader = Vec::new();
    let mut to_commit = Vec::new();
    let mut to_placement = Vec::new();
    let mut seq = 0u64;
    for round in 0..args.kills {
        let before = cluster.wait_for_leader(Duration::from_secs(30)).await?;
        // Every replica current, and the leader placing work, before the kill.
        for id in cluster.replicas.keys().copied().collect::<Vec<_>>() {
            wait_applied(cluster, id, before.commit_index).await?;
        }
        wait_until(Duration::from_secs(30), || {
            fleet.first_placement_after_term(before.term - 1).is_some()
        })
        .await
        .with_context(|| {
            format!(
                "leader {} placed no job in term {}",
                before.leader, before.term
            )
        })?;

        let killed = before.leader;
        let survivors: Vec<String> = cluster
            .replicas
            .values()
            .filter(|r| r.id != killed)
            .map(|r| r.addr.clone())
            .collect();
        let mut probe = Client::new(&survivors, &cluster.credentials()?)?;
        probe.attempt_timeout = Duration::from_millis(300);
        probe.deadline = Duration::from_secs(30);
        let t0 = Instant::now();
        cluster.kill(killed)?;

        let leader_watch = tokio::spawn(new_leader(
            survivors.clone(),
            cluster.credentials()?,
            killed,
            before.term,
        ));
        seq += 1;
        let req = submit_request(seq, "probe");
        probe
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.submit_job(with_timeout(r, t)).await }
            })
            .await
            .context("the probe submission after the kill")?;
        let committed = t0.elapsed();
        let (elected_at, new_leader) = leader_watch.await?;
        let elected = elected_at.duration_since(t0).min(committed);
        wait_until(Duration::from_secs(30), || {
            fleet.first_placement_after_term(before.term).is_some()
        })
        .await
        .context("no placement by the new leader")?;
        let placed = fleet
            .first_placement_after_term(before.term)
            .expect("just seen")
            .duration_since(t0);
        to_leader.push(ms(elected));
        to_commit.push(ms(committed));
        to_placement.push(ms(placed));
        eprintln!(
            "kill {}/{}: leader {killed} killed; replica {new_leader} leads after {:.0} ms; first commit after {:.0} ms; first placement after {:.0} ms",
            round + 1,
            args.kills,
            ms(elected),
            ms(committed),
            ms(placed),
        );
        cluster.start(killed, StartMode::Initial)?;
    }
    let steady = if args.steady.is_zero() {
        serde_json::Value::Null
    } else {
        steady_run(cluster, &fleet, args.steady).await?
    };
    let submitted = stream.stop();
    let c = &fleet.counters;
    let j = json!({
        "benchmark": "failover",
        "kills": args.kills,
        "hosts": fleet.hosts(),
        "stream_rate_per_sec": args.rate,
        "stream_submitted": submitted,
        "jobs_finished": c.finished.load(Ordering::Relaxed),
        "heartbeat_errors": c.heartbeat_errors.load(Ordering::Relaxed),
        "reregistrations": c.reregistrations.load(Ordering::Relaxed),
        "to_new_leader_ms": summary(to_leader),
        "to_first_commit_ms": summary(to_commit),
        "to_first_placement_ms": summary(to_placement),
        "cpu_hog": args.cpu_hog,
        "steady": steady,
    });
    let row = |name: &str, v: &serde_json::Value| {
        vec![
            name.to_owned(),
            format!("{:.0}", v["p50"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.0}", v["p99"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.0}", v["max"].as_f64().unwrap_or(f64::NAN)),
        ]
    };
    let text = table(
        &[
            "FROM SIGKILL OF THE LEADER TO",
            "P50_MS",
            "P99_MS",
            "MAX_MS",
        ],
        &[
            row("a new leader", &j["to_new_leader_ms"]),
            row("first committed write", &j["to_first_commit_ms"]),
            row(
                "first new placement (seen by a host)",
                &j["to_first_placement_ms"],
            ),
        ],
    );
    let steady_text = if j["steady"].is_null() {
        String::new()
    } else {
        format!(
            "steady run without faults, {:.0} s: {} elections (terms {} to {}), {} leader changes, {} jobs placed\n",
            j["steady"]["seconds"].as_f64().unwrap_or(0.0),
            j["steady"]["elections"],
            j["steady"]["first_term"],
            j["steady"]["last_term"],
            j["steady"]["leader_changes"],
            j["steady"]["placed"],
        )
    };
    Ok((
        format!(
            "{} leader kills, 3 replicas; {} simulated hosts finishing jobs, {} submissions/s{}\n{text}{steady_text}",
            args.kills,
            fleet.hosts(),
            args.rate,
            if args.cpu_hog {
                "; a busy loop on one core throughout"
            } else {
                ""
            }
        ),
        j,
    ))
}

/// Work flows for `length` with no fault injected; every replica's term is read every
/// 100 ms. Any term change is an election nobody needed: a leader that missed its
/// heartbeats under load, or a follower that timed out.
async fn steady_run(
    cluster: &LocalCluster,
    fleet: &SimulatedFleet,
    length: Duration,
) -> anyhow::Result<serde_json::Value> {
    let start = cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let placed_before = fleet.counters.finished.load(Ordering::Relaxed);
    let (mut term, mut leader) = (start.term, start.leader);
    let mut leader_changes = 0u64;
    let t0 = Instant::now();
    let mut next_report = Duration::from_secs(60);
    while t0.elapsed() < length {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for id in cluster.replicas.keys().copied() {
            if let Some(s) = cluster.status(id).await {
                if s.term > term {
                    eprintln!(
                        "steady run: term {} -> {} at +{:.1} s (seen on replica {id})",
                        term,
                        s.term,
                        t0.elapsed().as_secs_f64()
                    );
                    term = s.term;
                }
                if s.leader != 0 && s.leader != leader && s.term >= term {
                    leader_changes += 1;
                    leader = s.leader;
                }
            }
        }
        if t0.elapsed() >= next_report {
            eprintln!(
                "steady run: {:.0} of {:.0} s, {} elections so far",
                t0.elapsed().as_secs_f64(),
                length.as_secs_f64(),
                term - start.term
            );
            next_report += Duration::from_secs(60);
        }
    }
    Ok(json!({
        "seconds": t0.elapsed().as_secs_f64(),
        "first_term": start.term,
        "last_term": term,
        "elections": term - start.term,
        "leader_changes": leader_changes,
        "placed": fleet.counters.finished.load(Ordering::Relaxed) - placed_before,
    }))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Polls the survivors until one names a leader of a later term than `term` other than
/// `killed`; returns when and which.
async fn new_leader(
    addrs: Vec<String>,
    credentials: crate::client::Credentials,
    killed: u64,
    term: u64,
) -> (Instant, u64) {
    loop {
        for a in &addrs {
            if let Ok(mut c) = Client::new(std::slice::from_ref(a), &credentials) {
                c.deadline = Duration::from_millis(100);
                c.attempt_timeout = Duration::from_millis(100);
                if let Ok(s) = c
                    .call(|mut c, t| async move {
                        c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
                            .await
                    })
                    .await
                    && s.leader != 0
                    && s.leader != killed
                    && s.term > term
                {
                    return (Instant::now(), s.leader);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn wait_until(limit: Duration, done: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            bail!("not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

async fn wait_applied(cluster: &LocalCluster, id: u64, index: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = cluster.status(id).await
            && s.applied_index >= index
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("replica {id} did not catch up to index {index}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One-GPU jobs submitted at a steady rate through every replica, in the background.
struct JobStream {
    stop: Arc<AtomicBool>,
    submitted: Arc<AtomicU64>,
}

impl JobStream {
    fn start(client: Client, rate: u64) -> JobStream {
        let stop = Arc::new(AtomicBool::new(false));
        let submitted = Arc::new(AtomicU64::new(0));
        let in_flight = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), submitted.clone());
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                ticker.tick().await;
                if in_flight.load(Ordering::Relaxed) >= STREAM_IN_FLIGHT {
                    continue;
                }
                i += 1;
                in_flight.fetch_add(1, Ordering::Relaxed);
                let (mut c, n, in_flight) = (client.clone(), n.clone(), in_flight.clone());
                c.deadline = Duration::from_secs(30);
                tokio::spawn(async move {
                    let req = submit_request(i, "stream");
                    let done = c
                        .call(|mut c, t| {
                            let r = req.clone();
                            async move { c.submit_job(with_timeout(r, t)).await }
                        })
                        .await;
                    if done.is_ok() {
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        JobStream { stop, submitted }
    }

    /// Stops the stream; returns how many submissions committed.
    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.submitted.load(Ordering::Relaxed)
    }
}
