//! One chaos run end to end: start a local cluster of real processes on distinct loopback
//! addresses, run the workload and the fault schedule side by side while an observer records
//! the replicated state, let the cluster settle, collect the agents' journals, and check.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use control_plane::client::{Client, with_timeout};
use control_plane::local_cluster::{LocalCluster, free_ports};
use proto::v1 as pb;

use crate::check::{Report, check};
use crate::faults::{Builds, FaultCounts, Injector, Timings, schedule};
use crate::history::{Event, FaultKind, JobView, Member, Recorder, now_ms, read};
use crate::members::{Build, Endpoints};
use crate::partition::{Addresses, Partitioner};
use crate::summary::{Summary, summarize};
use crate::workload::{Rng, Workload, WorkloadConfig, tenant_limits, tenants};

/// Simulated GPU hosts: 16 GPUs in all, of two kinds.
pub const AGENTS: [(&str, &str); 3] = [
    ("h100-1", "dgx-h100"),
    ("a100-1", "a100-pcie-4gpu-nvlink-pairs"),
    ("a100-2", "a100-pcie-4gpu-nvlink-pairs"),
];

/// Replica flags: short node leases so agent faults play out within seconds, and frequent
/// snapshots so a wiped replica catches up through one.
const REPLICA_ARGS: [&str; 8] = [
    "--node-lease-ms",
    "1500",
    "--node-grace-ms",
    "1500",
    "--agent-heartbeat-ms",
    "200",
    "--snapshot-every",
    "500",
];
/// Agent flags: the agent fences its workloads quickly once its lease lapses.
const AGENT_ARGS: [&str; 4] = ["--stop-grace-secs", "1", "--fence-grace-ms", "500"];

#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The program that runs `replica`, `agent` and `shim` (the chaos binary itself).
    pub program: PathBuf,
    /// How to reach an attached cluster (`endpoints`); a cluster the run starts itself has
    /// TLS on and its own admin certificate.
    pub credentials: control_plane::client::Credentials,
    pub duration: Duration,
    pub jobs: usize,
    pub clients: usize,
    pub faults: FaultCounts,
    pub seed: u64,
    /// Where replicas and agents keep their data; a temporary directory when None.
    pub dir: Option<PathBuf>,
    /// Where the history goes; `<dir>/history.jsonl` when None.
    pub history: Option<PathBuf>,
    /// Limit for the cluster to finish every job once the faults stop.
    pub settle: Duration,
    pub timings: Timings,
    /// Attach to these replicas instead of starting a cluster (no faults, no agent journals).
    pub endpoints: Option<Vec<String>>,
    /// Progress lines on stderr.
    pub verbose: bool,
    /// A directory with the previous release's `control-plane` (and `node-agent`): the
    /// replicas start on it and `replica_upgrade` moves them between it and this build.
    pub previous_release: Option<PathBuf>,
}

pub struct RunResult {
    pub history: PathBuf,
    /// The data directory, kept when there were violations or when asked for.
    pub kept_dir: Option<PathBuf>,
    pub events: Vec<Event>,
    pub report: Report,
    pub summary: Summary,
}

macro_rules! progress {
    ($opts:expr, $($arg:tt)*) => {
        if $opts.verbose {
            eprintln!("chaos: {}", format!($($arg)*));
        }
    };
}

pub fn run(opts: RunOptions, stop: Arc<AtomicBool>) -> anyhow::Result<RunResult> {
    let tmp = tempfile::Builder::new().prefix("gpucp-chaos-").tempdir()?;
    let dir = opts.dir.clone().unwrap_or_else(|| tmp.path().to_owned());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let history = opts
        .history
        .clone()
        .unwrap_or_else(|| dir.join("history.jsonl"));
    let recorder = Recorder::create(&history)?;
    if let Some(endpoints) = opts.endpoints.clone() {
        if opts.faults.total() > 0 {
            bail!(
                "--endpoints attaches to a cluster this run did not start, so it cannot kill, \
                 pause or partition its processes: pass --no-faults (or every fault count 0)"
            );
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        runtime.block_on(drive_attached(&opts, endpoints, recorder, stop))?;
        let events = read(&history)?;
        let report = check(&events);
        let summary = summarize(&events, &report);
        let kept_dir = if report.violations() > 0 || opts.dir.is_some() {
            Some(if opts.dir.is_some() { dir } else { tmp.keep() })
        } else {
            None
        };
        return Ok(RunResult {
            history,
            kept_dir,
            events,
            report,
            summary,
        });
    }

    let partitioner = if opts.faults.needs_partitions() {
        Some(Partitioner::new()?)
    } else {
        None
    };
    let addrs = Addresses::for_this_process();
    // Replicas added during the run get ids 4, 5, ... and addresses kept for them now.
    let spares = opts.faults.get(FaultKind::ReplicaAddRemove);
    let ports = free_ports(3 + AGENTS.len() + spares)?;
    let replica_ips: BTreeMap<u64, std::net::Ipv4Addr> =
        (1..=3).map(|id| (id, addrs.replica(id))).collect();
    let replica_addrs: Vec<String> = (1..=3u64)
        .map(|id| format!("{}:{}", replica_ips[&id], ports[id as usize - 1]))
        .collect();
    let spare_addrs: BTreeMap<u64, (String, std::net::Ipv4Addr)> = (0..spares)
        .map(|i| {
            let id = 4 + i as u64;
            let ip = addrs.replica(id);
            (id, (format!("{ip}:{}", ports[3 + AGENTS.len() + i]), ip))
        })
        .collect();
    let mut cluster =
        LocalCluster::new_at(&opts.program, &["replica"], &dir, "chaos", &replica_addrs);
    cluster.extra_args = REPLICA_ARGS.iter().map(|s| s.to_string()).collect();
    cluster.bind_source = true;
    cluster.agent_program = Some((opts.program.clone(), vec!["agent".into()]));
    if spares > 0 {
        // Agents find the leader by trying every address they were given: as a deployment
        // lists every address a replica may take, they get the spares' too.
        cluster.agent_endpoints = Some(
            replica_addrs
                .iter()
                .cloned()
                .chain(spare_addrs.values().map(|(a, _)| a.clone()))
                .collect(),
        );
    }
    let mut builds = Builds {
        current: opts.program.clone(),
        previous: None,
        bin_dir: dir.join("bin"),
        running: BTreeMap::new(),
        copies: 0,
        rollbacks: 0,
    };
    if let Some(prev) = &opts.previous_release {
        let (wrapper, control_plane) = previous_release_wrapper(prev, &dir.join("bin"))?;
        for r in cluster.replicas.values_mut() {
            r.program = Some(wrapper.clone());
            builds.running.insert(r.id, Build::Previous);
        }
        builds.previous = Some((wrapper, control_plane));
        // Agents may lag the control plane by one release, not lead it (docs/UPGRADING.md).
        let agent = prev.join("node-agent");
        if agent.is_file() {
            cluster.agent_program = Some((agent, vec![]));
        }
    }
    let mut agent_ips = BTreeMap::new();
    for (i, (name, preset)) in AGENTS.iter().enumerate() {
        let ip = addrs.agent(i);
        cluster.add_agent_at(name, preset, &format!("{ip}:{}", ports[3 + i]), &AGENT_ARGS);
        agent_ips.insert(name.to_string(), ip);
    }
    let retired = Arc::new(std::sync::Mutex::new(Vec::new()));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let outcome = runtime.block_on(drive(
        &opts,
        &mut cluster,
        partitioner.as_ref(),
        Placement {
            replica_ips,
            agent_ips,
            spare_addrs,
            builds,
            retired: retired.clone(),
        },
        recorder.clone(),
        stop,
    ));
    // A panic is a finding whatever else happened: record it with the message that follows.
    let retired = retired.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let crashes = find_panics(&cluster, &retired);
    for (process, line) in &crashes {
        recorder.record(&Event::Crash {
            process: process.clone(),
            line: line.clone(),
        });
    }
    // Processes stop before the history is read back below; the rules go with them.
    drop(cluster);
    drop(partitioner);
    if let Err(e) = outcome {
        let kept = if opts.dir.is_some() { dir } else { tmp.keep() };
        let panics: String = crashes
            .iter()
            .map(|(p, l)| format!("\n  {p}: {l}"))
            .collect();
        let panics = if panics.is_empty() {
            String::new()
        } else {
            format!("; processes that crashed:{panics}")
        };
        return Err(e.context(format!(
            "the run failed; logs, data and the history are kept in {}{panics}",
            kept.display()
        )));
    }
    let events = read(&history)?;
    let report = check(&events);
    let summary = summarize(&events, &report);
    let kept_dir = if report.violations() > 0 || opts.dir.is_some() {
        Some(if opts.dir.is_some() { dir } else { tmp.keep() })
    } else {
        None
    };
    Ok(RunResult {
        history,
        kept_dir,
        events,
        report,
        summary,
    })
}

/// Where the run's processes live and what they run, handed to the fault injector.
struct Placement {
    replica_ips: BTreeMap<u64, std::net::Ipv4Addr>,
    agent_ips: BTreeMap<String, std::net::Ipv4Addr>,
    spare_addrs: BTreeMap<u64, (String, std::net::Ipv4Addr)>,
    builds: Builds,
    retired: Arc<std::sync::Mutex<Vec<(String, PathBuf)>>>,
}

/// A program that runs the previous release's replica where this build's runs: the harness
/// starts replicas as `PROGRAM replica FLAGS...`, the previous release as `control-plane
/// FLAGS...`. The script drops `replica` and execs `control-plane` (same pid, so
/// /proc/PID/exe names it). Returns (wrapper, control-plane).
fn previous_release_wrapper(
    dir: &std::path::Path,
    bin_dir: &std::path::Path,
) -> anyhow::Result<(PathBuf, PathBuf)> {
    let control_plane = std::fs::canonicalize(dir.join("control-plane")).with_context(|| {
        format!(
            "--previous-release {}: no control-plane binary there (build it with \
             tests/upgrade/build-previous-release.sh COMMIT OUT_DIR; the binaries are in \
             OUT_DIR/target/debug)",
            dir.display()
        )
    })?;
    std::fs::create_dir_all(bin_dir)?;
    let wrapper = bin_dir.join("previous-replica");
    let quoted = control_plane.display().to_string().replace('\'', "'\\''");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n# chaos: the previous release's replica\nshift\nexec '{quoted}' \"$@\"\n"
        ),
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    Ok((wrapper, control_plane))
}

async fn drive(
    opts: &RunOptions,
    cluster: &mut LocalCluster,
    partitioner: Option<&Partitioner>,
    placement: Placement,
    recorder: Recorder,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    progress!(
        opts,
        "starting 3 replicas and {} agents in {}",
        AGENTS.len(),
        cluster.root.display()
    );
    cluster.start_all()?;
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .context("the replicas did not elect a leader")?;
    let endpoints = cluster.endpoints();
    let credentials = cluster.credentials()?;
    let mut client = Client::new(&endpoints, &credentials)?;
    put_tenants(&mut client)
        .await
        .context("creating the workload's tenants")?;
    for (name, _) in AGENTS {
        cluster.start_agent(name)?;
    }
    wait_agents_ready(&mut client, Duration::from_secs(30)).await?;
    recorder.record(&Event::Config {
        at_ms: now_ms(),
        seed: opts.seed,
        replicas: cluster
            .replicas
            .values()
            .map(|r| Member {
                name: format!("replica {}", r.id),
                addr: r.addr.clone(),
            })
            .collect(),
        agents: cluster
            .agents
            .values()
            .map(|a| Member {
                name: a.name.clone(),
                addr: a.addr.clone(),
            })
            .collect(),
        tenants: tenant_limits(),
    });

    let next_op = Arc::new(AtomicU64::new(1));
    let members = Endpoints::new(endpoints.clone());
    let workload = Workload {
        endpoints: members.clone(),
        credentials: credentials.clone(),
        recorder: recorder.clone(),
        next_op,
        stop: stop.clone(),
    };
    let wcfg = WorkloadConfig {
        jobs: opts.jobs,
        clients: opts.clients,
        duration: opts.duration,
        cancel_every: 12,
        resend_every: 10,
        seed: opts.seed,
    };
    progress!(
        opts,
        "workload: {} jobs over {:?}; {} faults",
        opts.jobs,
        opts.duration,
        opts.faults.total()
    );
    let workload_task = tokio::spawn(async move { workload.run(wcfg).await });
    // The long-running service beside the batch work: a change every few seconds until the
    // batch workload is done.
    let service_stop = Arc::new(AtomicBool::new(false));
    let service_task = tokio::spawn(crate::services::run(
        endpoints.clone(),
        credentials.clone(),
        recorder.clone(),
        (opts.duration / 8).clamp(Duration::from_secs(3), Duration::from_secs(20)),
        opts.seed,
        service_stop.clone(),
    ));
    let observing = Arc::new(AtomicBool::new(true));
    let observer = tokio::spawn(observe(
        members.clone(),
        credentials.clone(),
        recorder.clone(),
        observing.clone(),
    ));

    let mut rng = Rng::new(opts.seed);
    let plan = schedule(&opts.faults, &mut rng);
    let mut injector = Injector {
        ever_used: cluster.replicas.keys().copied().collect(),
        cluster,
        partitioner,
        replica_ips: placement.replica_ips,
        agent_ips: placement.agent_ips,
        recorder: recorder.clone(),
        rng,
        timings: opts.timings.clone(),
        failovers_ms: Vec::new(),
        endpoints: members.clone(),
        spare_addrs: placement.spare_addrs,
        retired: placement.retired,
        replica_changes: 0,
        builds: placement.builds,
    };
    // Faults spread over the first 90% of the run, after a short quiet start.
    let start = tokio::time::Instant::now();
    let lead_in = Duration::from_secs(2).min(opts.duration / 10);
    let span = (opts.duration * 9 / 10).saturating_sub(lead_in);
    let slot = span / plan.len().max(1) as u32;
    let mut fault_error = None;
    for (i, kind) in plan.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        tokio::time::sleep_until(start + lead_in + slot * i as u32).await;
        let t = std::time::Instant::now();
        if let Err(e) = injector.inject(*kind).await {
            fault_error = Some(e.context(format!("injecting fault {} ({kind:?})", i + 1)));
            break;
        }
        progress!(
            opts,
            "fault {}/{}: {} done in {} ms{}",
            i + 1,
            plan.len(),
            kind.as_str(),
            t.elapsed().as_millis(),
            injector
                .failovers_ms
                .last()
                .filter(|_| matches!(
                    kind,
                    crate::history::FaultKind::LeaderKill
                        | crate::history::FaultKind::LeaderPause
                        | crate::history::FaultKind::LeaderPartition
                ))
                .map(|f| format!(" (failover {f:.0} ms)"))
                .unwrap_or_default()
        );
    }
    // Faults are over: heal everything, whatever happened above.
    if let Some(p) = injector.partitioner {
        p.heal_all()?;
    }
    for name in injector.cluster.agents.keys().cloned().collect::<Vec<_>>() {
        if injector.cluster.agents[&name].pid().is_none() {
            injector.cluster.start_agent(&name)?;
        }
    }
    for id in injector
        .cluster
        .replicas
        .keys()
        .copied()
        .collect::<Vec<_>>()
    {
        if !injector.cluster.is_running(id) {
            injector.restart(id)?;
        }
    }
    let stats = workload_task.await??;
    service_stop.store(true, Ordering::Relaxed);
    let _ = service_task.await;
    progress!(
        opts,
        "workload done: {} submitted, {} acknowledged, {} cancels",
        stats.submitted,
        stats.acknowledged,
        stats.cancels
    );
    if let Some(e) = fault_error {
        observing.store(false, Ordering::Relaxed);
        let _ = observer.await;
        return Err(e);
    }
    injector.whole_again().await?;

    // The final state comes from the members as they are now: a removed replica's data is
    // not a member's.
    let mut client = Client::new(&injector.cluster.endpoints(), &credentials)?;
    // The observer keeps recording while the cluster settles.
    settle_and_record_final(opts, &mut client, &recorder).await;
    // The service's replicas run until stopped: stop them before the processes are.
    if !crate::services::delete_and_wait(&mut client, Duration::from_secs(30)).await {
        progress!(opts, "the service was not deleted within 30 s");
    }
    observing.store(false, Ordering::Relaxed);
    let _ = observer.await;
    // What the agents actually ran.
    for a in injector.cluster.agents.values() {
        let records = node_agent::runtime::read_usage_journal(&a.usage_journal())
            .with_context(|| format!("reading agent {}'s usage journal", a.name))?;
        for record in records {
            recorder.record(&Event::Usage {
                node: a.name.clone(),
                record,
            });
        }
        // Exit files: `runtime/logs/<id>.exit.json`, kept after the allocation is forgotten;
        // a shim started by an agent before the record log wrote
        // `runtime/allocations/<id>.exit.json` (deleted once forgotten).
        let runtime_dir = a.state_dir.join("runtime");
        let mut exit_files: Vec<(u64, std::path::PathBuf)> = Vec::new();
        for dir in ["logs", "allocations"] {
            for entry in std::fs::read_dir(runtime_dir.join(dir))
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = entry.file_name().to_string_lossy().into_owned();
                if let Some(Ok(allocation)) = name.strip_suffix(".exit.json").map(str::parse::<u64>)
                {
                    exit_files.push((allocation, entry.path()));
                }
            }
        }
        for (allocation, path) in exit_files {
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            if let Some(at_ms) = v["at_ms"].as_u64() {
                recorder.record(&Event::ProcessExit {
                    node: a.name.clone(),
                    allocation,
                    at_ms,
                    fenced: v["fenced"].as_bool().unwrap_or(false),
                });
            }
        }
    }
    Ok(())
}

/// (process, message) of every panic and fatal error in the replicas' and agents' logs.
/// `retired`: (process, log) of replicas removed during the run.
fn find_panics(cluster: &LocalCluster, retired: &[(String, PathBuf)]) -> Vec<(String, String)> {
    let mut logs: Vec<(String, PathBuf)> = cluster
        .replicas
        .values()
        .map(|r| (format!("replica {}", r.id), r.log_path.clone()))
        .collect();
    logs.extend(retired.iter().cloned());
    logs.extend(
        cluster
            .agents
            .values()
            .map(|a| (format!("agent {}", a.name), a.log_path.clone())),
    );
    let mut found = Vec::new();
    for (process, path) in logs {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.contains("panicked at") {
                // The message is on the next line.
                let msg = lines.get(i + 1).copied().unwrap_or_default();
                found.push((process.clone(), format!("{} {}", line.trim(), msg.trim())));
            } else if line.starts_with("chaos: error:") {
                // A replica or agent that refused to go on (e.g. a corrupt data directory).
                found.push((process.clone(), line.trim().to_owned()));
            }
        }
    }
    found
}

/// Progress: waits until every batch job has left the queue (and, the jobs being short,
/// finished) and every service is back at its replicas, then records the final state.
async fn settle_and_record_final(opts: &RunOptions, client: &mut Client, recorder: &Recorder) {
    progress!(
        opts,
        "faults stopped; waiting up to {:?} for every job to finish and every service to be restored",
        opts.settle
    );
    let deadline = tokio::time::Instant::now() + opts.settle;
    let (settled, jobs, services) = loop {
        let jobs = list_jobs(client, true).await;
        let services = crate::services::list(client).await;
        if let (Ok(jobs), Ok(services)) = (&jobs, &services)
            && jobs.iter().all(|j| {
                j.replica.is_some()
                    || !matches!(j.state.as_str(), "pending" | "scheduled" | "running")
            })
            && services.iter().all(|s| s.restored())
        {
            break (true, jobs.clone(), services.clone());
        }
        if tokio::time::Instant::now() >= deadline {
            break (
                false,
                jobs.unwrap_or_default(),
                services.unwrap_or_default(),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    recorder.record(&Event::Final {
        at_ms: now_ms(),
        settled,
        jobs: jobs.iter().map(JobView::from_proto).collect(),
        services,
    });
}

/// `chaos run --endpoints`: the workload, the observer and the checks against a cluster this
/// run did not start. Without its processes there are no faults to inject and no agent
/// journals to read; the checks of the replicated state and of the clients' history remain.
async fn drive_attached(
    opts: &RunOptions,
    endpoints: Vec<String>,
    recorder: Recorder,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let credentials = opts.credentials.clone();
    let mut client = Client::new(&endpoints, &credentials)?;
    put_tenants(&mut client)
        .await
        .with_context(|| format!("creating the workload's tenants through {endpoints:?}"))?;
    recorder.record(&Event::Config {
        at_ms: now_ms(),
        seed: opts.seed,
        replicas: endpoints
            .iter()
            .map(|e| Member {
                name: e.clone(),
                addr: e.clone(),
            })
            .collect(),
        agents: Vec::new(),
        tenants: tenant_limits(),
    });
    let members = Endpoints::new(endpoints.clone());
    let workload = Workload {
        endpoints: members.clone(),
        credentials: credentials.clone(),
        recorder: recorder.clone(),
        next_op: Arc::new(AtomicU64::new(1)),
        stop,
    };
    let observing = Arc::new(AtomicBool::new(true));
    let observer = tokio::spawn(observe(
        members,
        credentials.clone(),
        recorder.clone(),
        observing.clone(),
    ));
    progress!(
        opts,
        "workload: {} jobs over {:?} against {endpoints:?}",
        opts.jobs,
        opts.duration
    );
    let stats = workload
        .run(WorkloadConfig {
            jobs: opts.jobs,
            clients: opts.clients,
            duration: opts.duration,
            cancel_every: 12,
            resend_every: 10,
            seed: opts.seed,
        })
        .await?;
    progress!(
        opts,
        "workload done: {} submitted, {} acknowledged, {} cancels",
        stats.submitted,
        stats.acknowledged,
        stats.cancels
    );
    // The observer keeps recording while the cluster settles.
    settle_and_record_final(opts, &mut client, &recorder).await;
    observing.store(false, Ordering::Relaxed);
    let _ = observer.await;
    Ok(())
}

async fn wait_agents_ready(client: &mut Client, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let nodes = client
            .call(|mut c, t| async move {
                c.list_nodes(with_timeout(pb::ListNodesRequest { read: None }, t))
                    .await
            })
            .await
            .map(|r| r.nodes)
            .unwrap_or_default();
        if AGENTS
            .iter()
            .all(|(n, _)| nodes.iter().any(|x| x.name == *n && x.status == "ready"))
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            let seen: Vec<(String, String)> =
                nodes.into_iter().map(|n| (n.name, n.status)).collect();
            bail!("the agents did not register within {timeout:?}; nodes: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn list_jobs(
    client: &mut Client,
    include_finished: bool,
) -> Result<Vec<pb::Job>, tonic::Status> {
    let req = pb::ListJobsRequest {
        include_finished,
        ..Default::default()
    };
    client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.list_jobs(with_timeout(r, t)).await }
        })
        .await
        .map(|r| r.jobs)
}

/// Records the live jobs every 250 ms, from whichever current member answers (any member's
/// applied state is a prefix of the log, so every view must satisfy the invariants; a removed
/// replica is no member and is no longer asked).
async fn observe(
    endpoints: Endpoints,
    credentials: control_plane::client::Credentials,
    recorder: Recorder,
    running: Arc<AtomicBool>,
) {
    let (mut seen, addrs) = endpoints.get();
    let Ok(mut client) = Client::new(&addrs, &credentials) else {
        return;
    };
    client.attempt_timeout = Duration::from_millis(500);
    client.deadline = Duration::from_secs(2);
    while running.load(Ordering::Relaxed) {
        if let Some(c) = endpoints.refreshed(&mut seen, &client, &credentials) {
            client = c;
        }
        if let Ok(jobs) = list_jobs(&mut client, false).await {
            recorder.record(&Event::Snapshot {
                at_ms: now_ms(),
                jobs: jobs.iter().map(JobView::from_proto).collect(),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Creates (or updates) the workload's tenants, so its quotas and limits hold from the start.
async fn put_tenants(client: &mut Client) -> anyhow::Result<()> {
    for t in tenants() {
        client
            .call(|mut c, to| {
                let t = t.clone();
                async move { c.put_tenant(with_timeout(t, to)).await }
            })
            .await?;
    }
    Ok(())
}
