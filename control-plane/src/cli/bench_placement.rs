//! `gpuctl bench placement`: committed placements per second through three replicas (durable
//! storage, loopback) for a burst of one-GPU jobs on a fleet of simulated hosts.
//!
//! The burst. Every job is submitted (and committed) while the fleet cannot take it: the
//! benchmark's tenant is capped at one GPU, so the whole queue waits. Releasing the cap is one
//! committed write, and the clock starts when that write is sent. It stops when the last job is
//! seen placed through the API: a `WatchJobs` stream on the first replica (at the start, the
//! leader; after an election, possibly a follower). A replica applies an entry only once a
//! majority has it on disk, so "seen placed" means placed *and* committed; a follower that
//! falls behind shows it late (a stall names every replica's applied index). Submission is
//! timed separately, and a second figure counts from the first submission to the last
//! placement. The job or two the cap lets through before the release are reported and left out
//! of the timed count.
//!
//! Fleet size. With `--finish` each host reports a job started and then succeeded as soon as it
//! is assigned, so the GPUs turn over through the log (two more committed writes per job) and a
//! fleet smaller than the burst still places every job. That is the default when the burst has
//! more jobs than the fleet has GPUs; otherwise jobs keep their GPUs and the figure is pure
//! placement.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, stream};
use proto::v1 as pb;
use serde_json::json;
use tokio::sync::watch;

use super::bench_hosts::{FleetOptions, SimulatedFleet};
use super::output::table;
use crate::client::Credentials;
use crate::client::{Client, with_timeout};
use crate::local_cluster::LocalCluster;

const TENANT: &str = "bench";
/// Fail rather than wait forever when placements stop progressing for this long.
const STALL_LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Finish {
    /// When the burst has more jobs than the fleet has GPUs.
    Auto,
    Yes,
    No,
}

pub struct Args {
    pub hosts: usize,
    pub jobs: usize,
    pub preset: String,
    pub finish: Finish,
    /// Submissions in flight at once.
    pub submit_concurrency: usize,
    pub heartbeat: Option<Duration>,
}

/// What the job watch has seen.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// Jobs listed or streamed, in any state.
    known: usize,
    placed: usize,
    finished: usize,
    /// When the latest job was first seen placed / finished.
    last_placed_at: Option<Instant>,
    last_finished_at: Option<Instant>,
    /// Log entries that placed at least one job (seen while streaming, not in a listing).
    place_entries: usize,
    restarts: usize,
}

pub async fn run(
    cluster: &LocalCluster,
    args: Args,
) -> anyhow::Result<(String, serde_json::Value)> {
    if args.jobs == 0 || args.hosts == 0 {
        bail!("--hosts and --jobs must be at least 1");
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(30)).await?;
    // The leader first: every write would be forwarded to it anyway.
    let leader_addr = cluster.addr(leader.leader);
    let mut endpoints = vec![leader_addr.clone()];
    endpoints.extend(
        cluster
            .endpoints()
            .into_iter()
            .filter(|e| *e != leader_addr),
    );
    let mut client = Client::new(&endpoints, &cluster.credentials()?)?;
    put_tenant(&mut client, 1).await?;

    let fleet_options = FleetOptions {
        hosts: args.hosts,
        preset: args.preset.clone(),
        prefix: "sim".into(),
        heartbeat: args.heartbeat,
    };
    let mut fleet = SimulatedFleet::start(cluster, &fleet_options)
        .await
        .context("registering the simulated hosts")?;
    let gpus = fleet.total_gpus();
    let finish = match args.finish {
        Finish::Auto => args.jobs > gpus,
        Finish::Yes => true,
        Finish::No => false,
    };
    if !finish && args.jobs > gpus {
        bail!(
            "{} jobs cannot all hold one of {gpus} GPUs at once: add hosts or let hosts finish jobs (--finish yes)",
            args.jobs
        );
    }
    eprintln!(
        "{} hosts ({gpus} GPUs) registered in {:.1} s; heartbeat every {} ms",
        fleet.hosts(),
        fleet.registration_time.as_secs_f64(),
        fleet.heartbeat_period.as_millis()
    );

    let first_submission = Instant::now();
    submit_all(&client, args.jobs, args.submit_concurrency.max(1)).await?;
    let submit_time = first_submission.elapsed();
    eprintln!(
        "{} jobs submitted and committed in {:.1} s ({:.0}/s)",
        args.jobs,
        submit_time.as_secs_f64(),
        args.jobs as f64 / submit_time.as_secs_f64()
    );

    let (seen_tx, mut seen) = watch::channel(Seen::default());
    let credentials = cluster.credentials()?;
    let watcher = tokio::spawn(watch_jobs(
        endpoints[0].clone(),
        credentials.clone(),
        seen_tx,
    ));
    if finish {
        fleet.finish_jobs()?;
        // Every host follows its assignments before the release, so the window holds no
        // stream set-up.
        let deadline = Instant::now() + Duration::from_secs(60);
        while (load(&fleet.counters.watch_connects) as usize) < fleet.hosts() {
            if Instant::now() > deadline {
                bail!("the simulated hosts could not all open their assignment streams");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The initial listing must be in before the release, or it would count as placements.
    wait_for(&mut seen, Duration::from_secs(60), |s| s.known >= args.jobs)
        .await
        .context("the job watch did not list the submitted jobs")?;

    let before = seen.borrow().clone();
    let released = Instant::now();
    put_tenant(&mut client, 0).await?;
    let outcome = wait_for(&mut seen, STALL_LIMIT, |s| {
        s.placed >= args.jobs && (!finish || s.finished >= args.jobs)
    })
    .await;
    watcher.abort();
    let after = seen.borrow().clone();
    if let Err(e) = outcome {
        return Err(e.context(format!(
            "placements stalled: {} of {} jobs placed, {} finished, as seen on {}; the \
             simulated hosts saw {} failed reports (refused for good: {}) and {} failed \
             heartbeats; replicas: {}",
            after.placed,
            args.jobs,
            after.finished,
            endpoints[0],
            load(&fleet.counters.report_errors),
            fleet.counters.refusals_summary(),
            load(&fleet.counters.heartbeat_errors),
            replica_states(&endpoints, &credentials).await,
        )));
    }

    let last_placed = after.last_placed_at.context("no placement seen")?;
    let window = last_placed.duration_since(released).as_secs_f64();
    let timed = args.jobs - before.placed;
    let per_sec = timed as f64 / window;
    let from_first = last_placed.duration_since(first_submission).as_secs_f64();
    let completion = after
        .last_finished_at
        .filter(|_| finish)
        .map(|t| t.duration_since(released).as_secs_f64());
    let c = &fleet.counters;
    let j = json!({
        "benchmark": "placement",
        "hosts": fleet.hosts(),
        "gpus": gpus,
        "jobs": args.jobs,
        "finish": finish,
        "registration_seconds": fleet.registration_time.as_secs_f64(),
        "submit_seconds": submit_time.as_secs_f64(),
        "submissions_per_sec": args.jobs as f64 / submit_time.as_secs_f64(),
        "placed_before_release": before.placed,
        "placed": after.placed,
        "placement_seconds": window,
        "placements_per_sec": per_sec,
        "place_entries": after.place_entries,
        "from_first_submission_seconds": from_first,
        "from_first_submission_per_sec": args.jobs as f64 / from_first,
        "all_finished_seconds": completion,
        "finished": after.finished,
        "heartbeat_period_ms": fleet.heartbeat_period.as_millis() as u64,
        "heartbeats": load(&c.heartbeats),
        "heartbeat_errors": load(&c.heartbeat_errors),
        "reregistrations": load(&c.reregistrations),
        "reports": load(&c.started) + load(&c.finished) + load(&c.stopped),
        "report_errors": load(&c.report_errors),
        "watch_restarts": after.restarts,
    });
    let mut rows = vec![
        vec![
            "submit (all jobs, committed)".to_owned(),
            args.jobs.to_string(),
            format!("{:.2}", submit_time.as_secs_f64()),
            format!("{:.0}", args.jobs as f64 / submit_time.as_secs_f64()),
        ],
        vec![
            "place after release (committed)".to_owned(),
            timed.to_string(),
            format!("{window:.2}"),
            format!("{per_sec:.0}"),
        ],
        vec![
            "first submission to last placement".to_owned(),
            args.jobs.to_string(),
            format!("{from_first:.2}"),
            format!("{:.0}", args.jobs as f64 / from_first),
        ],
    ];
    if let Some(done) = completion {
        rows.push(vec![
            "release to every job succeeded".to_owned(),
            args.jobs.to_string(),
            format!("{done:.2}"),
            format!("{:.0}", args.jobs as f64 / done),
        ]);
    }
    let text = format!(
        "{} jobs of 1 GPU on {} simulated hosts ({gpus} GPUs), 3 replicas (durable, loopback); {}\n{}\
         {} Raft entries carried the placements; {} placed before the release; heartbeats {} ok, {} failed\n",
        args.jobs,
        fleet.hosts(),
        if finish {
            "hosts finish each job as soon as it is assigned (started + succeeded reports)"
        } else {
            "jobs keep their GPUs"
        },
        table(&["PHASE", "JOBS", "SECONDS", "PER_SEC"], &rows),
        after.place_entries,
        before.placed,
        load(&c.heartbeats),
        load(&c.heartbeat_errors),
    );
    Ok((text, j))
}

async fn put_tenant(client: &mut Client, max_gpus: u32) -> anyhow::Result<()> {
    let tenant = pb::Tenant {
        name: TENANT.into(),
        weight: 1,
        quota_gpus: 0,
        max_gpus,
    };
    client
        .call(|mut c, t| {
            let r = tenant.clone();
            async move { c.put_tenant(with_timeout(r, t)).await }
        })
        .await
        .with_context(|| format!("setting tenant {TENANT}'s GPU limit to {max_gpus}"))?;
    Ok(())
}

fn job(i: usize) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest {
        spec: Some(pb::JobSpec {
            tenant: TENANT.into(),
            name: format!("burst-{i}"),
            command: vec!["true".into()],
            gpus_per_task: 1,
            tasks: 1,
            priority_class: "normal".into(),
            ..Default::default()
        }),
        idempotency_key: format!("burst-{i}"),
    }
}

/// Submits jobs 0..n with `concurrency` in flight, each waiting for its commit.
async fn submit_all(client: &Client, n: usize, concurrency: usize) -> anyhow::Result<()> {
    let results: Vec<anyhow::Result<()>> = stream::iter(0..n)
        .map(|i| {
            let mut client = client.clone();
            async move {
                let req = job(i);
                // A retry of a submission whose first attempt committed (across a leader
                // change) answers with the job that attempt created: still one job per key.
                client
                    .call(|mut c, t| {
                        let r = req.clone();
                        async move { c.submit_job(with_timeout(r, t)).await }
                    })
                    .await
                    .with_context(|| format!("submitting job {i}"))?;
                Ok(())
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    results.into_iter().collect()
}

/// A fleet counter's current value.
fn load(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(std::sync::atomic::Ordering::Relaxed)
}

/// Each replica's role, term and applied index, for the message of a stalled run.
async fn replica_states(endpoints: &[String], credentials: &Credentials) -> String {
    let mut states = Vec::new();
    for addr in endpoints {
        let state = replica_state(addr, credentials)
            .await
            .unwrap_or_else(|why| why);
        states.push(format!("{addr}: {state}"));
    }
    states.join("; ")
}

async fn replica_state(addr: &str, credentials: &Credentials) -> Result<String, String> {
    let mut client = credentials
        .api_client(addr)
        .map_err(|e| format!("bad address ({e})"))?;
    let request = with_timeout(pb::ClusterStatusRequest {}, Duration::from_secs(2));
    let r = client
        .cluster_status(request)
        .await
        .map_err(|s| format!("no answer ({})", s.message()))?
        .into_inner();
    // The leader's view of each member's log: whether it believes a lagging follower has the
    // entries tells a stuck send from a stuck follower.
    let matched: Vec<String> = r
        .members
        .iter()
        .filter(|_| r.leader == r.id)
        .map(|m| format!("{}={}", m.id, m.matched_index))
        .collect();
    let matched = if matched.is_empty() {
        String::new()
    } else {
        format!(", members matched {}", matched.join(" "))
    };
    Ok(format!(
        "{} {} term {} applied {} of {} committed{matched}",
        r.id, r.state, r.term, r.applied_index, r.commit_index
    ))
}

/// Follows every job of the benchmark's tenant on one replica and publishes what it has seen.
/// A watch that falls behind is opened again with a fresh listing.
async fn watch_jobs(
    addr: String,
    credentials: Credentials,
    out: watch::Sender<Seen>,
) -> anyhow::Result<()> {
    let mut api = credentials.api_client(&addr)?;
    let mut known: HashSet<u64> = HashSet::new();
    let mut placed: HashSet<u64> = HashSet::new();
    let mut finished: HashSet<u64> = HashSet::new();
    let mut entries: BTreeSet<u64> = BTreeSet::new();
    let mut restarts = 0;
    loop {
        let mut events = api
            .watch_jobs(pb::WatchJobsRequest {
                tenant: TENANT.into(),
                initial: true,
            })
            .await
            .with_context(|| format!("watching jobs on {addr}"))?
            .into_inner();
        // The listing comes first, every job of it stamped with the index it was taken at;
        // only changes streamed after it count as entries that placed jobs.
        let mut listed_at: Option<u64> = None;
        while let Some(Ok(event)) = events.next().await {
            let Some(job) = event.job else { continue };
            let listing = *listed_at.get_or_insert(event.log_index) >= event.log_index;
            let now = Instant::now();
            let mut changed = known.insert(job.id);
            if job.state != "pending" && placed.insert(job.id) {
                changed = true;
                if !listing {
                    entries.insert(event.log_index);
                }
                out.send_modify(|s| s.last_placed_at = Some(now));
            }
            if job.state == "succeeded" && finished.insert(job.id) {
                changed = true;
                out.send_modify(|s| s.last_finished_at = Some(now));
            }
            if changed {
                out.send_modify(|s| {
                    s.known = known.len();
                    s.placed = placed.len();
                    s.finished = finished.len();
                    s.place_entries = entries.len();
                    s.restarts = restarts;
                });
            }
        }
        restarts += 1;
    }
}

/// Waits until `done` holds for what the watch has seen, failing after `stall` without any
/// change.
async fn wait_for(
    seen: &mut watch::Receiver<Seen>,
    stall: Duration,
    done: impl Fn(&Seen) -> bool,
) -> anyhow::Result<()> {
    loop {
        if done(&seen.borrow_and_update()) {
            return Ok(());
        }
        match tokio::time::timeout(stall, seen.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => bail!("the job watch ended"),
            Err(_) => bail!("no progress for {stall:?}"),
        }
    }
}
