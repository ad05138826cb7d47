//! `gpuctl bench submit`: latency of job submissions at fixed offered rates, open loop.
//!
//! Requests are issued on a fixed schedule (request `i` is due at `start + i / rate`), each on
//! its own task, whether or not earlier requests have been answered; a slow reply therefore
//! never delays the requests behind it. Latency is measured from the time a request was *due*,
//! not from when it was actually sent, so a generator that falls behind (or a server that
//! stalls) shows up in the figures instead of being hidden (no coordinated omission).
//!
//! Each (rate, via) pair is one run against the same three-replica cluster:
//! - `via leader`: the client is pinned to the leader's endpoint;
//! - `via follower`: the client is pinned to a follower, which forwards every write to the
//!   leader (`api::route`), as it does for any client that happens to reach a follower.
//!
//! A submission is acknowledged only once committed (on disk, sled flushed, on a majority) and
//! applied on the leader; nothing about durability is relaxed for the benchmark.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::bench::percentile;
use super::output::table;
use crate::client::{Client, with_timeout};
use crate::local_cluster::LocalCluster;

/// Which replica the client sends its submissions to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Via {
    /// A follower, which forwards each write to the leader.
    Follower,
    /// The leader itself.
    Leader,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Follower => "follower",
            Via::Leader => "leader",
        }
    }
}

pub struct Args {
    /// Offered rates, submissions per second; each is run in turn.
    pub rates: Vec<u64>,
    pub vias: Vec<Via>,
    /// Length of the schedule of each run.
    pub duration: Duration,
}

/// How long one request may keep retrying (on the pinned replica) before it counts as an error.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

/// Outcome of one scheduled request.
struct Sample {
    /// When the schedule said to send it.
    due: Instant,
    /// From the time it was due to the committed reply, or the error that ended it.
    result: Result<Duration, String>,
    /// From the time it was due to the time its task started sending (the generator's lag).
    send_lag: Duration,
    /// When the reply (or the error) came.
    done: Instant,
}

/// Every sample of one run, and when its schedule started.
struct Run {
    start: Instant,
    /// The same moment on the wall clock, to find a stall in the replicas' logs.
    start_wall: std::time::SystemTime,
    samples: Vec<Sample>,
}

pub async fn run(
    cluster: &LocalCluster,
    args: Args,
) -> anyhow::Result<(String, serde_json::Value)> {
    if args.rates.is_empty() || args.rates.contains(&0) {
        bail!("--rates must list rates of at least 1 per second");
    }
    if args.vias.is_empty() {
        bail!("--via must name follower, leader or both");
    }
    if args.duration.is_zero() {
        bail!("--seconds must be at least 1");
    }
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    let mut notes = Vec::new();
    for &rate in &args.rates {
        for &via in &args.vias {
            settle(cluster).await;
            let status = cluster.wait_for_leader(Duration::from_secs(30)).await?;
            let target = match via {
                Via::Leader => status.leader,
                Via::Follower => *cluster
                    .replicas
                    .keys()
                    .find(|&&id| id != status.leader)
                    .context("the cluster has no follower")?,
            };
            let client = pinned_client(cluster, target)?;
            let prefix = format!("{}-{rate}-{}", via.name(), runs.len());
            warm_up(&client, &prefix)
                .await
                .with_context(|| format!("warm-up submission via {} failed", via.name()))?;
            let load = load_average();
            let cpu_before = replicas_cpu_seconds(cluster);
            let samples = open_loop(client, rate, args.duration, &prefix).await?;
            let cpu = replicas_cpu_seconds(cluster) - cpu_before;
            let after = cluster.wait_for_leader(Duration::from_secs(30)).await?;
            if after.leader != status.leader {
                eprintln!(
                    "warning: the leader changed from replica {} to {} during the {rate}/s run via {}",
                    status.leader,
                    after.leader,
                    via.name()
                );
            }
            let run = summarize(&samples);
            let episodes = slow_episodes(&samples);
            if let Some(worst) = episodes.iter().max_by_key(|e| e.max) {
                notes.push(format!(
                    "{} {rate}/s: {} requests over {} ms in {} episode(s); the worst at +{:.1} s, {} requests, up to {:.0} ms",
                    via.name(),
                    episodes.iter().map(|e| e.requests).sum::<usize>(),
                    SLOW_REQUEST.as_millis(),
                    episodes.len(),
                    worst.at.as_secs_f64(),
                    worst.requests,
                    worst.max.as_secs_f64() * 1000.0,
                ));
            }
            // CPU the three replicas used per committed write: unlike latency, it hardly
            // depends on what else the machine is running.
            let cpu_ms_per_write = cpu * 1000.0 / run.committed.max(1) as f64;
            rows.push(vec![
                via.name().to_owned(),
                rate.to_string(),
                run.requests.to_string(),
                run.committed.to_string(),
                run.errors.to_string(),
                format!("{:.0}", run.achieved_per_sec),
                format!("{:.2}", run.latency.p50),
                format!("{:.2}", run.latency.p99),
                format!("{:.2}", run.latency.max),
                format!("{cpu_ms_per_write:.2}"),
                format!("{load:.2}"),
            ]);
            runs.push(json!({
                "via": via.name(),
                "replica": target,
                "leader": status.leader,
                "leader_changed": after.leader != status.leader,
                "offered_per_sec": rate,
                "seconds": args.duration.as_secs_f64(),
                "requests": run.requests,
                "committed": run.committed,
                "errors": run.errors,
                "first_error": run.first_error,
                "achieved_per_sec": run.achieved_per_sec,
                "latency_ms": run.latency.json(),
                "send_lag_ms": run.send_lag.json(),
                "replica_cpu_ms_per_write": cpu_ms_per_write,
                "loadavg_1m": load,
                "slow_request_ms": SLOW_REQUEST.as_millis() as u64,
                "slow_episodes": episodes.iter().map(SlowEpisode::json).collect::<Vec<_>>(),
            }));
        }
    }
    let text = table(
        &[
            "VIA",
            "OFFERED/S",
            "SENT",
            "COMMITTED",
            "ERRORS",
            "ACHIEVED/S",
            "P50_MS",
            "P99_MS",
            "MAX_MS",
            "CPU_MS/W",
            "LOAD_1M",
        ],
        &rows,
    );
    let text = format!(
        "open-loop submissions through 3 replicas (durable, loopback), {}s per run; latency from \
         each request's scheduled send time to its committed reply{}\n{text}",
        args.duration.as_secs_f64(),
        if cluster.extra_args.is_empty() {
            String::new()
        } else {
            format!("; replicas run with {}", cluster.extra_args.join(" "))
        }
    );
    let text = if notes.is_empty() {
        text
    } else {
        format!("{text}{}\n", notes.join("\n"))
    };
    let json = json!({
        "benchmark": "submit",
        "mode": "open-loop",
        "replicas": cluster.replicas.len(),
        "replica_args": cluster.extra_args,
        "runs": runs,
    });
    Ok((text, json))
}

/// A client that talks to one replica only: its retries stay on that replica, so "via
/// follower" really goes through the follower's forwarding. One attempt may take the whole
/// deadline: a request is retried only when the replica answers that it cannot serve it now
/// (an election), never because it is slow. Retrying slow requests would add load exactly
/// when the cluster is behind (each retry is another Raft entry) and measure a retry storm
/// instead of the offered rate.
fn pinned_client(cluster: &LocalCluster, id: u64) -> anyhow::Result<Client> {
    let mut client = cluster.client_for(id)?;
    client.deadline = REQUEST_DEADLINE;
    client.attempt_timeout = REQUEST_DEADLINE;
    Ok(client)
}

/// Waits until the cluster has finished the previous run's work: past its capacity, requests
/// the client gave up on are still in the leader's queue and would be committed during the
/// next run. Settled means no replica applied anything for half a second; after two minutes
/// the run starts anyway, with a warning.
async fn settle(cluster: &LocalCluster) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last: Option<Vec<u64>> = None;
    while Instant::now() < deadline {
        let mut applied = Vec::new();
        for &id in cluster.replicas.keys() {
            applied.push(cluster.status(id).await.map_or(0, |s| s.applied_index));
        }
        if last.as_ref() == Some(&applied) && !applied.contains(&0) {
            return;
        }
        last = Some(applied);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "warning: the cluster was still applying entries after 120 s; starting the run anyway"
    );
}

/// One committed submission before the clock starts: connects the client to its replica and,
/// via a follower, the follower to the leader, so the first timed requests pay no handshakes.
async fn warm_up(client: &Client, prefix: &str) -> Result<(), tonic::Status> {
    submit(
        client.clone(),
        super::bench::submit_request(0, &format!("{prefix}-warm")),
    )
    .await
    .map(|_| ())
}

/// Issues `rate * duration` submissions on schedule and waits for every reply.
async fn open_loop(
    client: Client,
    rate: u64,
    duration: Duration,
    prefix: &str,
) -> anyhow::Result<Run> {
    let total = (rate as f64 * duration.as_secs_f64()).round().max(1.0) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let prefix: Arc<str> = prefix.into();
    let runtime = tokio::runtime::Handle::current();
    let start = Instant::now();
    let start_wall = std::time::SystemTime::now();
    // Paced from a thread of its own: tokio's timer rounds every deadline up to the next
    // millisecond tick, which alone would add up to 1 ms to each measured latency, whereas a
    // thread's sleep wakes within tens of microseconds. Each request then runs on its own task.
    let tasks = tokio::task::spawn_blocking(move || {
        let mut tasks = Vec::with_capacity(total as usize);
        for i in 0..total {
            let due = start + interval.mul_f64(i as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let client = client.clone();
            let request = super::bench::submit_request(i, &prefix);
            tasks.push(runtime.spawn(async move {
                let send_lag = due.elapsed();
                let result = submit(client, request)
                    .await
                    .map(|_| due.elapsed())
                    .map_err(|s| format!("{:?}: {}", s.code(), s.message()));
                Sample {
                    due,
                    result,
                    send_lag,
                    done: Instant::now(),
                }
            }));
        }
        tasks
    })
    .await
    .context("the pacing thread failed")?;
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        match t.await {
            Ok(s) => samples.push(s),
            Err(e) => samples.push(Sample {
                due: Instant::now(),
                result: Err(format!("request task failed: {e}")),
                send_lag: Duration::ZERO,
                done: Instant::now(),
            }),
        }
    }
    Ok(Run {
        start,
        start_wall,
        samples,
    })
}

async fn submit(
    mut client: Client,
    request: pb::SubmitJobRequest,
) -> Result<pb::SubmitJobResponse, tonic::Status> {
    client
        .call(|mut c, t| {
            let r = request.clone();
            async move { c.submit_job(with_timeout(r, t)).await }
        })
        .await
}

struct Summary {
    p50: f64,
    p99: f64,
    max: f64,
    mean: f64,
    n: usize,
}

impl Summary {
    fn of_ms(mut v: Vec<f64>) -> Summary {
        v.sort_by(|a, b| a.total_cmp(b));
        Summary {
            p50: percentile(&v, 50.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied().unwrap_or(f64::NAN),
            mean: v.iter().sum::<f64>() / v.len().max(1) as f64,
            n: v.len(),
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({"p50": self.p50, "p99": self.p99, "max": self.max, "mean": self.mean, "n": self.n})
    }
}

/// Requests slower than this are grouped into episodes: twice the p99 target of 10 ms, so
/// the episodes are what a missed p99 is made of.
const SLOW_REQUEST: Duration = Duration::from_millis(20);

/// Slow requests due within this long of each other belong to one episode.
const EPISODE_GAP: Duration = Duration::from_millis(100);

/// A stretch of the schedule in which requests were slow: usually one stall of the cluster
/// (a slow disk sync, a replication timeout, a snapshot) seen by every request in flight.
struct SlowEpisode {
    /// When the first slow request was due, from the schedule's start.
    at: Duration,
    /// The same moment on the wall clock, in Unix milliseconds (replica logs are in UTC).
    wall_unix_ms: u128,
    /// Slow requests in the episode.
    requests: usize,
    /// The slowest of them.
    max: Duration,
}

impl SlowEpisode {
    fn json(&self) -> serde_json::Value {
        json!({
            "at_ms": self.at.as_millis() as u64,
            "wall_unix_ms": self.wall_unix_ms as u64,
            "requests": self.requests,
            "max_ms": self.max.as_secs_f64() * 1000.0,
        })
    }
}

/// Groups the run's slow requests (over `SLOW_REQUEST`, or failed) into episodes, in schedule
/// order.
fn slow_episodes(run: &Run) -> Vec<SlowEpisode> {
    let mut slow: Vec<(Instant, Duration)> = run
        .samples
        .iter()
        .filter_map(|s| match &s.result {
            Ok(latency) if *latency <= SLOW_REQUEST => None,
            Ok(latency) => Some((s.due, *latency)),
            Err(_) => Some((s.due, s.done.saturating_duration_since(s.due))),
        })
        .collect();
    slow.sort_by_key(|(due, _)| *due);
    let mut episodes: Vec<SlowEpisode> = Vec::new();
    let mut last_due: Option<Instant> = None;
    for (due, latency) in slow {
        let joins = last_due.is_some_and(|last| due.duration_since(last) <= EPISODE_GAP);
        last_due = Some(due);
        if let (true, Some(e)) = (joins, episodes.last_mut()) {
            e.requests += 1;
            e.max = e.max.max(latency);
            continue;
        }
        let at = due.saturating_duration_since(run.start);
        let wall = run.start_wall + at;
        episodes.push(SlowEpisode {
            at,
            wall_unix_ms: wall
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis()),
            requests: 1,
            max: latency,
        });
    }
    episodes
}

struct RunSummary {
    requests: usize,
    committed: usize,
    errors: usize,
    first_error: Option<String>,
    achieved_per_sec: f64,
    latency: Summary,
    send_lag: Summary,
}

fn summarize(run: &Run) -> RunSummary {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let samples = &run.samples;
    let latencies: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.result.as_ref().ok().copied().map(ms))
        .collect();
    let errors: Vec<&String> = samples
        .iter()
        .filter_map(|s| s.result.as_ref().err())
        .collect();
    // Committed replies per second from the schedule's start to the last reply: a cluster
    // that keeps up achieves the offered rate, one that falls behind takes longer.
    let span = samples
        .iter()
        .map(|s| s.done.duration_since(run.start))
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    RunSummary {
        requests: samples.len(),
        committed: latencies.len(),
        errors: errors.len(),
        first_error: errors.first().map(|e| e.to_string()),
        achieved_per_sec: if span > 0.0 {
            latencies.len() as f64 / span
        } else {
            f64::NAN
        },
        latency: Summary::of_ms(latencies),
        send_lag: Summary::of_ms(samples.iter().map(|s| ms(s.send_lag)).collect()),
    }
}

/// User + system CPU seconds the running replicas have used so far (from /proc/PID/stat; NaN
/// where that is not available).
fn replicas_cpu_seconds(cluster: &LocalCluster) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut total = 0.0;
    for r in cluster.replicas.values() {
        let Some(pid) = r.pid() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return f64::NAN;
        };
        // Fields after the parenthesised command name; utime and stime are the 14th and 15th
        // fields of the whole line, so the 12th and 13th after it.
        let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
            return f64::NAN;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks_used: f64 = fields
            .get(11..13)
            .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
            .unwrap_or(f64::NAN);
        total += ticks_used / ticks;
    }
    total
}

/// The 1-minute load average of this machine (from /proc/loadavg), reported with every run:
/// figures taken on a busy machine are not comparable with figures from an idle one.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run with one request due every millisecond, each taking `latency_ms(i)`; `None` is an
    /// error after 50 ms.
    fn run_of(n: u64, latency_ms: impl Fn(u64) -> Option<u64>) -> Run {
        let start = Instant::now();
        let samples = (0..n)
            .map(|i| {
                let due = start + Duration::from_millis(i);
                let (result, done) = match latency_ms(i) {
                    Some(ms) => (
                        Ok(Duration::from_millis(ms)),
                        due + Duration::from_millis(ms),
                    ),
                    None => (Err("timed out".to_owned()), due + Duration::from_millis(50)),
                };
                Sample {
                    due,
                    result,
                    send_lag: Duration::ZERO,
                    done,
                }
            })
            .collect();
        Run {
            start,
            start_wall: std::time::UNIX_EPOCH + Duration::from_secs(1_000),
            samples,
        }
    }

    #[test]
    fn slow_requests_close_together_form_one_episode() {
        // Fast, except a stall at 100–149 ms (one request of it failed) and one slow request
        // at 400 ms, more than the episode gap after the stall.
        let run = run_of(1_000, |i| match i {
            120 => None,
            100..=149 => Some(30 + (149 - i)),
            400 => Some(25),
            i if i % 2 == 0 => Some(20), // at the threshold: not slow
            _ => Some(3),
        });
        let episodes = slow_episodes(&run);
        assert_eq!(episodes.len(), 2);
        assert_eq!(episodes[0].at, Duration::from_millis(100));
        assert_eq!(episodes[0].wall_unix_ms, 1_000_100);
        assert_eq!(episodes[0].requests, 50);
        assert_eq!(episodes[0].max, Duration::from_millis(79));
        assert_eq!(episodes[1].at, Duration::from_millis(400));
        assert_eq!(episodes[1].requests, 1);
        assert_eq!(episodes[1].max, Duration::from_millis(25));
    }

    #[test]
    fn a_run_without_slow_requests_has_no_episodes() {
        assert!(slow_episodes(&run_of(500, |_| Some(5))).is_empty());
    }
}
