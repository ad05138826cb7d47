//! Runs one seed from start to verdict, and many seeds across threads.
//!
//! A seed runs on its own current-thread tokio runtime with time paused: the runtime jumps the
//! clock to the next timer whenever every task waits, so minutes of simulated time cost only
//! the work done in them, and the same seed schedules the same tasks in the same order.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::check::{self, Violation};
use super::cluster::SimCluster;
use super::faults;
use super::net::{NetStats, SimNet};
use super::params::Params;
use super::services;
use super::workload::{self, Ledger};
use super::world::World;
use crate::raft::NodeId;
use crate::scheduler::score::SplitMix64;
use crate::state::{Command, Outcome};
use crate::synthetic::node_from_preset;

/// What one seed did and found.
#[derive(Debug, Clone)]
pub struct SeedReport {
    pub seed: u64,
    pub violations: Vec<Violation>,
    /// Hash of the seed's event history (process starts and stops, acknowledgements, faults)
    /// and final state: equal for two runs of one seed.
    pub history_hash: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub jobs_acked: usize,
    pub jobs_refused: usize,
    pub jobs_succeeded: u64,
    pub client_retries: u64,
    pub processes_started: u64,
    pub replica_processes_started: u64,
    pub sim_ms: u64,
    pub net: NetStats,
}

/// The commands that rerun one seed.
pub fn rerun_command(seed: u64) -> String {
    format!(
        "GPUCP_DST_SEED={seed} cargo test -p control-plane --lib dst::tests::seeds -- --nocapture   (or: gpuctl simulate cluster --seed {seed})"
    )
}

impl SeedReport {
    /// The failure report: seed, each invariant with its evidence, and how to rerun it.
    pub fn describe_failure(&self) -> String {
        let mut s = format!(
            "seed {} violated {} invariant check(s):\n",
            self.seed,
            self.violations.len()
        );
        for v in &self.violations {
            s.push_str(&format!("  {v}\n"));
        }
        s.push_str(&format!("  rerun: {}\n", rerun_command(self.seed)));
        s
    }
}

/// Runs one seed to its verdict.
pub fn run_seed(seed: u64, params: &Params) -> SeedReport {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    // tokio draws from a per-runtime random generator in two places that matter here: which
    // of a `watch` channel's eight notifier shards a receiver waits on (so the order in which
    // receivers of one send wake up: openraft's metrics, the applied-index watch of the leader
    // loop and of every assignment stream), and the branch order of unbiased `select!`s.
    // Seeding that generator needs tokio's unstable API; with `--cfg tokio_unstable` a seed
    // replays bit for bit, without it the same seed replays the same workload, fault schedule
    // and per-link message fates, but ties between simultaneous wake-ups may break differently.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let runtime = builder
        .build()
        .expect("building a current-thread tokio runtime");
    let params = params.clone();
    runtime.block_on(simulate(seed, params))
}

/// Distinct election timeouts per replica: equal ones would let two candidates split the vote
/// in lockstep forever, since nothing else in the simulation is random.
fn election_timeouts(rng: &mut SplitMix64, p: &Params) -> Vec<u64> {
    let (lo, hi) = p.election_ms;
    let mut out: Vec<u64> = Vec::new();
    for _ in 0..p.replicas {
        let mut t = lo + rng.below(hi - lo);
        while out.iter().any(|o| o.abs_diff(t) < 20) {
            t = lo + (t - lo + 37) % (hi - lo);
        }
        out.push(t);
    }
    out
}

async fn simulate(seed: u64, params: Params) -> SeedReport {
    let mut rng = SplitMix64::new(seed);
    let net = SimNet::new(rng.next_u64(), rng.below(20), 1 + rng.below(10));
    let timeouts = election_timeouts(&mut rng, &params);
    let replicas: Vec<(NodeId, u64, i64)> = (1..=params.replicas)
        .zip(timeouts)
        .map(|(id, t)| (id, t, rng.below(101) as i64 - 50))
        .collect();
    let cluster = SimCluster::new(
        net.clone(),
        params.tuning(),
        params.leader_config(),
        &replicas,
    );
    let world = Arc::new(World::new(seed, params.clone(), cluster));
    let tenants = workload::tenants();
    if std::env::var_os("GPUCP_DST_TRACE").is_some() {
        world.observer().trace = Some(Vec::new());
    }
    world.observer().tenant_limits = tenants
        .iter()
        .map(|t| (t.name.clone(), t.max_gpus))
        .collect();

    if let Err(e) = setup(&world, &tenants).await {
        world
            .observer()
            .violation("setup", world.now_ms(), e.to_string());
        return finish(&world, BTreeMap::new(), &Ledger::default(), None).await;
    }

    for (i, preset) in params.hosts.iter().enumerate() {
        let spec = match host_spec(preset, i) {
            Ok(s) => s,
            Err(e) => {
                world
                    .observer()
                    .violation("setup", 0, format!("host {i} ({preset}): {e}"));
                continue;
            }
        };
        tokio::spawn(super::agent::run(world.clone(), i, spec, rng.next_u64()));
    }

    let service_hosts = services::service_hosts(&params.hosts);
    let rule_hosts: Vec<usize> = (0..params.hosts.len())
        .filter(|i| !service_hosts.contains(i))
        .collect();
    let plan = workload::submissions(&mut rng, params.jobs, params.submit_window_ms, &rule_hosts);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut clients = Vec::new();
    for c in 0..params.clients {
        let mine: Vec<_> = plan
            .iter()
            .enumerate()
            .filter(|(i, _)| i % params.clients == c)
            .map(|(_, s)| s.clone())
            .collect();
        clients.push(tokio::spawn(workload::run_client(
            world.clone(),
            c,
            mine,
            ledger.clone(),
            rng.next_u64(),
        )));
    }

    // The service comes from a stream of its own, so each seed's batch workload and fault
    // schedule are what they were before services existed.
    let mut service_rng = SplitMix64::new(seed ^ 0x5E41_1CE5);
    let service = services::plan(&mut service_rng, &params.hosts, params.submit_window_ms);
    world.observer().service_bound_slack_ms =
        params.node_lease_ms + params.node_grace_ms + params.call_timeout_ms;
    match &service {
        Some(plan) => {
            tokio::spawn(services::run_client(
                world.clone(),
                plan.clone(),
                service_rng.next_u64(),
            ));
        }
        None => world.observer().service_client_done = true,
    }

    let schedule = faults::plan(&mut rng, &params);
    let faults_end = faults::end_ms(&schedule).max(params.submit_window_ms + 1_000);
    let mut fault_counts: BTreeMap<&'static str, u64> = BTreeMap::new();
    for s in &schedule {
        *fault_counts.entry(s.fault.kind()).or_default() += 1;
    }
    tokio::spawn(faults::run(world.clone(), schedule));

    // Invariants on replicated state, checked all along; the run ends once faults have
    // stopped and everything settled, or when the liveness budget is spent.
    let deadline = faults_end + params.liveness_budget_ms;
    let tick = Duration::from_millis(params.check_every_ms);
    loop {
        tokio::time::sleep(tick).await;
        check_replicas(&world);
        let now = world.now_ms();
        if now < faults_end {
            continue;
        }
        let clients_done = clients.iter().all(|c| c.is_finished());
        let why = match settled(&world, service.as_ref()) {
            Ok(()) if clients_done => break,
            Ok(()) => "clients are still submitting".to_owned(),
            Err(why) => why,
        };
        if now >= deadline {
            world.observer().violation(
                "progress after faults stop",
                now,
                format!(
                    "{} ms after the last fault ended the cluster has not settled: {why}; raft: {}",
                    now - faults_end,
                    raft_summary(&world)
                ),
            );
            break;
        }
    }
    let ledger = std::mem::take(&mut *ledger.lock().expect("ledger lock poisoned"));
    finish(&world, fault_counts, &ledger, Some(faults_end)).await
}

/// Starts every replica, bootstraps the cluster and creates the tenants.
async fn setup(world: &World, tenants: &[crate::state::Tenant]) -> anyhow::Result<()> {
    for id in world.cluster.ids() {
        world.cluster.start(id).await?;
    }
    let first = world
        .cluster
        .running(1)
        .ok_or_else(|| anyhow::anyhow!("replica 1 did not start"))?;
    first
        .replica
        .raft
        .initialize(world.cluster.members())
        .await
        .map_err(|e| anyhow::anyhow!("initializing the cluster: {e}"))?;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    for tenant in tenants {
        loop {
            anyhow::ensure!(
                tokio::time::Instant::now() < give_up,
                "no leader accepted the tenants within 30 s of simulated time"
            );
            let leader = world
                .cluster
                .all_running()
                .into_iter()
                .find(|r| r.replica.require_leader().is_ok());
            if let Some(r) = leader {
                let write = r.replica.write(Command::PutTenant {
                    tenant: tenant.clone(),
                });
                if let Ok(Ok(Outcome::Done)) =
                    tokio::time::timeout(Duration::from_secs(2), write).await
                {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// A host of `preset` with UUIDs unique to host `i`.
fn host_spec(preset: &str, i: usize) -> anyhow::Result<crate::state::NodeSpec> {
    let name = format!("host-{i}");
    let mut spec = node_from_preset(preset, &name, None, BTreeMap::new())?;
    for g in &mut spec.gpus {
        g.uuid = format!("GPU-{name}-{}", g.index);
        for (k, m) in g.mig.iter_mut().enumerate() {
            m.uuid = format!("MIG-{name}-{}-{k}", g.index);
        }
    }
    Ok(spec)
}

/// Checks every live replica's applied state, and replicas at the same index against each
/// other.
fn check_replicas(world: &World) {
    let now = world.now_ms();
    let running = world.cluster.all_running();
    // Read guards of every replica at once: nothing applies meanwhile (one thread).
    let states: Vec<_> = running
        .iter()
        .map(|r| (r.replica.id, r.replica.sm.read()))
        .collect();
    let mut found = Vec::new();
    for (id, data) in &states {
        found.extend(check::check_state(*id, &data.cluster));
    }
    for (i, (a, da)) in states.iter().enumerate() {
        for (b, db) in &states[i + 1..] {
            if da.last_applied == db.last_applied && da.cluster != db.cluster {
                found.push((
                    "replicas agree",
                    format!(
                        "replicas {a} and {b} both applied index {} but differ: {}",
                        da.last_applied.map_or(0, |l| l.index),
                        check::describe_difference(&da.cluster, &db.cluster)
                    ),
                ));
            }
        }
    }
    drop(states);
    let mut obs = world.observer();
    for (invariant, evidence) in found {
        obs.violation(invariant, now, evidence);
    }
}

/// Each running replica's view of Raft, for a liveness failure's evidence: a cluster that
/// has not settled is either without a leader, or has one whose log does not advance.
fn raft_summary(world: &World) -> String {
    world
        .cluster
        .all_running()
        .iter()
        .map(|r| {
            let m = r.replica.raft.metrics().borrow().clone();
            format!(
                "replica {} {:?} term {} leader {:?} last log {} applied {} quorum ack {:?} ms ago, matched {:?}",
                r.replica.id,
                m.state,
                m.current_term,
                m.current_leader,
                m.last_log_index.unwrap_or(0),
                m.last_applied.map_or(0, |l| l.index),
                m.millis_since_quorum_ack,
                m.replication
                    .as_ref()
                    .map(|p| p.iter().map(|(id, l)| (*id, l.map_or(0, |l| l.index))).collect::<Vec<_>>()),
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether the cluster has settled: every replica up at one applied index, every batch job in
/// a final state, and the seed's service at what its client last asked for (`services`). The
/// reason it has not, otherwise.
fn settled(world: &World, service: Option<&services::ServicePlan>) -> Result<(), String> {
    let running = world.cluster.all_running();
    if running.len() as u64 != world.params.replicas {
        return Err("a replica is down".into());
    }
    let indexes: Vec<u64> = running
        .iter()
        .map(|r| r.replica.sm.read().last_applied.map_or(0, |l| l.index))
        .collect();
    if indexes.windows(2).any(|w| w[0] != w[1]) {
        return Err(format!("replicas at applied indexes {indexes:?}"));
    }
    let data = running[0].replica.sm.read();
    let (open, shown) = check::unfinished(&data.cluster, 5);
    if open > 0 {
        return Err(format!("{open} job(s) not finished: {shown}"));
    }
    if let Some(plan) = service {
        let obs = world.observer();
        let key = crate::state::service_key(services::TENANT, services::NAME);
        let running = obs.service_ordinals_running(&key);
        services::settled(&data.cluster, plan, obs.service_client_done, &running)?;
    }
    Ok(())
}

/// End-of-run checks, then the report. Stops every task of the seed.
async fn finish(
    world: &World,
    faults: BTreeMap<&'static str, u64>,
    ledger: &Ledger,
    faults_end: Option<u64>,
) -> SeedReport {
    world.stop();
    let now = world.now_ms();
    let running = world.cluster.all_running();
    let mut final_hash = DefaultHasher::new();
    let mut succeeded = 0;
    if let (Some(_), Some(r)) = (faults_end, running.first()) {
        let data = r.replica.sm.read();
        let state = &data.cluster;
        succeeded = check::completed(state);
        if let Ok(json) = serde_json::to_string(state) {
            json.hash(&mut final_hash);
        }
        let mut obs = world.observer();
        for (key, ids) in &ledger.acked {
            let first = ids[0];
            if ids.iter().any(|i| *i != first) {
                obs.violation(
                    "no lost job (idempotency)",
                    now,
                    format!("key {key} was acknowledged as different jobs {ids:?}"),
                );
            }
            match state.jobs.get(&first) {
                Some(j) if j.idempotency_key.as_deref() == Some(key.as_str()) => {}
                Some(j) => obs.violation(
                    "no lost job",
                    now,
                    format!(
                        "key {key} was acknowledged as job {first}, but job {first} carries key {:?}",
                        j.idempotency_key
                    ),
                ),
                None => obs.violation(
                    "no lost job",
                    now,
                    format!("key {key} was acknowledged as job {first}, which no longer exists"),
                ),
            }
        }
        let mut per_key: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
        for j in state.jobs.values() {
            if let Some(k) = &j.idempotency_key {
                per_key
                    .entry((j.spec.tenant.as_str(), k.as_str()))
                    .or_default()
                    .push(j.id);
            }
        }
        for ((tenant, key), ids) in per_key {
            if ids.len() > 1 {
                obs.violation(
                    "no lost job (idempotency)",
                    now,
                    format!("tenant {tenant} key {key} created jobs {ids:?}"),
                );
            }
        }
    }
    for r in &running {
        world.cluster.crash(r.replica.id).await;
    }
    let obs = world.observer();
    obs.history_hash().hash(&mut final_hash);
    for line in world.cluster.net.take_trace() {
        eprintln!("net seed {}: {line}", world.seed);
    }
    if let Some(trace) = &obs.trace {
        for line in trace {
            eprintln!("trace seed {}: {line}", world.seed);
        }
    }
    SeedReport {
        seed: world.seed,
        violations: obs.violations.clone(),
        history_hash: final_hash.finish(),
        faults,
        jobs_acked: ledger.acked.len(),
        jobs_refused: ledger.refused.len(),
        jobs_succeeded: succeeded,
        client_retries: ledger.retries,
        processes_started: obs.processes_started,
        replica_processes_started: obs.replica_processes_started,
        sim_ms: now,
        net: world.cluster.net.stats(),
    }
}

/// Totals over many seeds.
#[derive(Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    pub failed: Vec<SeedReport>,
    pub faults: BTreeMap<&'static str, u64>,
    pub jobs_acked: u64,
    pub jobs_refused: u64,
    pub jobs_succeeded: u64,
    pub client_retries: u64,
    pub processes_started: u64,
    pub replica_processes_started: u64,
    pub sim_ms: u64,
    pub messages: u64,
    pub messages_lost: u64,
}

impl Summary {
    fn add(&mut self, r: SeedReport) {
        self.seeds += 1;
        for (k, v) in &r.faults {
            *self.faults.entry(k).or_default() += v;
        }
        self.jobs_acked += r.jobs_acked as u64;
        self.jobs_refused += r.jobs_refused as u64;
        self.jobs_succeeded += r.jobs_succeeded;
        self.client_retries += r.client_retries;
        self.processes_started += r.processes_started;
        self.replica_processes_started += r.replica_processes_started;
        self.sim_ms += r.sim_ms;
        self.messages += r.net.sent;
        self.messages_lost += r.net.lost;
        if !r.violations.is_empty() {
            self.failed.push(r);
        }
    }

    pub fn violations(&self) -> usize {
        self.failed.iter().map(|r| r.violations.len()).sum()
    }
}

/// Runs `seeds` on `threads` threads (each seed on its own runtime); `progress` is told of
/// every finished seed. A seed that panics is reported as a violation, not a crash of the run.
pub fn run_seeds(
    seeds: &[u64],
    params: &Params,
    threads: usize,
    progress: &(dyn Fn(&SeedReport) + Sync),
) -> Summary {
    let next = AtomicUsize::new(0);
    let summary = Mutex::new(Summary::default());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&seed) = seeds.get(i) else { break };
                    let report = std::panic::catch_unwind(|| run_seed(seed, params))
                        .unwrap_or_else(|panic| panicked(seed, panic));
                    progress(&report);
                    summary.lock().expect("summary lock poisoned").add(report);
                }
            });
        }
    });
    let mut summary = summary.into_inner().expect("summary lock poisoned");
    summary.failed.sort_by_key(|r| r.seed);
    summary
}

fn panicked(seed: u64, panic: Box<dyn std::any::Any + Send>) -> SeedReport {
    let message = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "unknown panic".into());
    SeedReport {
        seed,
        violations: vec![Violation {
            invariant: "the simulation runs",
            at_ms: 0,
            evidence: format!("panicked: {message}"),
        }],
        history_hash: 0,
        faults: BTreeMap::new(),
        jobs_acked: 0,
        jobs_refused: 0,
        jobs_succeeded: 0,
        client_retries: 0,
        processes_started: 0,
        replica_processes_started: 0,
        sim_ms: 0,
        net: NetStats::default(),
    }
}
