//! A fleet of simulated GPU hosts living inside the benchmark process: each host registers
//! through the real `AgentApi` (the inventory a simulated node agent of the same preset would
//! report), keeps its lease with heartbeats, and, when asked, follows its assignments and
//! reports every allocation started then succeeded the moment it sees it (a job that exits at
//! once), so GPUs turn over through the log. No node-agent processes and no workloads: a
//! thousand agent processes would measure the host, not the control plane.
//!
//! With TLS on, each host holds a node certificate of its own and talks over its own
//! connections, as separate agents would (the control plane takes a node's reports only from
//! that node's certificate); plaintext fleets share connections between hosts.
//!
//! Heartbeats are spread evenly over the heartbeat period (a few hundred hosts per tick, a
//! bounded number in flight) so that 12,500 hosts cost a steady trickle of small RPCs instead
//! of a burst every period. The period defaults to half the lease the control plane announces:
//! a host keeps its lease with room for one lost heartbeat, and the leader declares a node lost
//! only after lease + grace of silence.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::{StreamExt, stream};
use proto::agent as pa;
use proto::agent::agent_api_client::AgentApiClient;
use proto::tls::{CertRole, ExpectedPeer};
use proto::transport::{Transport, retryable};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::local_cluster::LocalCluster;
use crate::state::NodeSpec;
use crate::synthetic::node_from_preset;

/// RPCs of one kind (registrations, heartbeats) in flight at once.
const IN_FLIGHT: usize = 64;
/// Heartbeats go out in this many slices per period.
const TICKS_PER_PERIOD: u32 = 20;
/// Pause before a broken assignment stream is opened again (a failover takes longer).
const RECONNECT_PAUSE: Duration = Duration::from_millis(5);
/// Hosts following their assignments over one connection per replica.
const HOSTS_PER_CONNECTION: usize = 64;

#[derive(Debug, Clone)]
pub struct FleetOptions {
    pub hosts: usize,
    /// Simulated host preset (`dgx-h100`: 8 H100 SXM on NVLink).
    pub preset: String,
    /// Hosts are called `{prefix}-{i}`.
    pub prefix: String,
    /// Heartbeat period of every host; `None`: half the lease the control plane announces.
    pub heartbeat: Option<Duration>,
}

/// What the fleet has done, for the benchmark's report and its sanity checks.
#[derive(Debug, Default)]
pub struct FleetCounters {
    pub heartbeats: AtomicU64,
    pub heartbeat_errors: AtomicU64,
    pub reregistrations: AtomicU64,
    /// Distinct allocations the hosts were assigned.
    pub assigned: AtomicU64,
    pub started: AtomicU64,
    pub finished: AtomicU64,
    pub stopped: AtomicU64,
    pub report_errors: AtomicU64,
    /// Reports refused with a code that is not retried, by code: how many, and the first
    /// message. Each is a finish the control plane never heard of.
    pub report_refusals: Mutex<BTreeMap<String, (u64, String)>>,
    /// Assignment streams opened (the first per host included).
    pub watch_connects: AtomicU64,
}

impl FleetCounters {
    fn refused(&self, status: &Status) {
        let mut refusals = self.report_refusals.lock().expect("fleet lock poisoned");
        let entry = refusals
            .entry(format!("{:?}", status.code()))
            .or_insert_with(|| (0, status.message().to_owned()));
        entry.0 += 1;
    }

    /// The refusals in one line, e.g. `Internal x3 ("...")`; "none" when there were none.
    pub fn refusals_summary(&self) -> String {
        let refusals = self.report_refusals.lock().expect("fleet lock poisoned");
        if refusals.is_empty() {
            return "none".to_owned();
        }
        refusals
            .iter()
            .map(|(code, (n, first))| format!("{code} x{n} (first: {first:?})"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The `AgentApi` of every replica, tried in turn: followers forward registrations, heartbeats
/// and reports to the leader; only the leader serves assignment streams.
#[derive(Clone)]
struct AgentEndpoints {
    clients: Arc<Vec<AgentApiClient<Channel>>>,
    /// The endpoint that answered last, tried first next time (usually the leader).
    preferred: Arc<AtomicUsize>,
}

impl AgentEndpoints {
    fn new(endpoints: &[String], transport: &Transport) -> anyhow::Result<AgentEndpoints> {
        let clients = endpoints
            .iter()
            .map(|e| {
                transport
                    .channel(e, ExpectedPeer::Replica)
                    .map(AgentApiClient::new)
                    .with_context(|| format!("endpoint {e:?} is not HOST:PORT"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(AgentEndpoints {
            clients: Arc::new(clients),
            preferred: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Runs `call` against the endpoints until one answers or fails for a reason retrying
    /// cannot fix, for at most `deadline`.
    async fn call<T, F, Fut>(&self, deadline: Duration, mut call: F) -> Result<T, Status>
    where
        F: FnMut(AgentApiClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let start = Instant::now();
        let n = self.clients.len();
        let mut backoff = Duration::from_millis(5);
        loop {
            let first = self.preferred.load(Ordering::Relaxed);
            let mut last = None;
            for k in 0..n {
                let i = (first + k) % n;
                let attempt = tokio::time::timeout(deadline, call(self.clients[i].clone())).await;
                match attempt {
                    Ok(Ok(resp)) => {
                        self.preferred.store(i, Ordering::Relaxed);
                        return Ok(resp.into_inner());
                    }
                    Ok(Err(s)) if retryable(&s) => last = Some(s),
                    Ok(Err(s)) => return Err(s),
                    Err(_) => last = Some(Status::deadline_exceeded("no answer in time")),
                }
            }
            if start.elapsed() >= deadline {
                return Err(last.unwrap_or_else(|| Status::unavailable("no endpoint answered")));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
    }
}

/// One simulated host: its registration, fixed for the fleet's life.
struct Host {
    registration: pa::RegisterNodeRequest,
    /// The host's own connections (TLS: with its node certificate); `None` on a plaintext
    /// fleet, whose hosts share the fleet's.
    own: Option<AgentEndpoints>,
}

impl Host {
    fn name(&self) -> &str {
        &self.registration.name
    }

    fn api<'a>(&'a self, shared: &'a AgentEndpoints) -> &'a AgentEndpoints {
        self.own.as_ref().unwrap_or(shared)
    }
}

/// A registered fleet whose hosts heartbeat until it is dropped.
pub struct SimulatedFleet {
    addresses: Vec<String>,
    endpoints: AgentEndpoints,
    hosts: Arc<Vec<Host>>,
    pub counters: Arc<FleetCounters>,
    /// When the first allocation created in each leader term was first seen by a host.
    first_seen_in_term: Arc<Mutex<BTreeMap<u64, Instant>>>,
    pub gpus_per_host: usize,
    pub heartbeat_period: Duration,
    /// How long registering every host took.
    pub registration_time: Duration,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for SimulatedFleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl SimulatedFleet {
    /// Registers every host (through any replica of `cluster`) and starts their heartbeats.
    /// On a cluster with TLS each host gets a node certificate of its own.
    pub async fn start(cluster: &LocalCluster, options: &FleetOptions) -> anyhow::Result<Self> {
        let endpoints = cluster.endpoints();
        let api = AgentEndpoints::new(&endpoints, &Transport::Plain)?;
        // Unique per run, so a host of an earlier run in the same data directory is told apart.
        let incarnation = format!(
            "bench-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        );
        let hosts: Vec<Host> = (0..options.hosts)
            .map(|i| {
                let name = format!("{}-{i}", options.prefix);
                let spec = node_from_preset(&options.preset, &name, None, BTreeMap::new())
                    .with_context(|| format!("building simulated host {name}"))?;
                let own = match cluster.is_secure() {
                    false => None,
                    true => Some(AgentEndpoints::new(
                        &endpoints,
                        &host_transport(cluster, &name)?,
                    )?),
                };
                Ok(Host {
                    registration: registration(&spec, &incarnation),
                    own,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        let gpus_per_host = hosts
            .first()
            .map(|h| h.registration.gpus.len())
            .unwrap_or(0);

        let started = Instant::now();
        let answers: Vec<Result<pa::RegisterNodeResponse, Status>> =
            stream::iter(hosts.iter().map(|h| register(h.api(&api), h)))
                .buffer_unordered(IN_FLIGHT)
                .collect()
                .await;
        let mut lease = None;
        for (answer, host) in answers.into_iter().zip(&hosts) {
            let answer = answer.with_context(|| format!("registering host {}", host.name()))?;
            lease = Some(Duration::from_millis(answer.lease_ms));
        }
        let registration_time = started.elapsed();
        let heartbeat_period = options
            .heartbeat
            .or(lease.map(|l| l / 2))
            .unwrap_or(Duration::from_secs(1))
            .max(Duration::from_millis(50));

        let mut fleet = SimulatedFleet {
            addresses: endpoints.clone(),
            endpoints: api,
            hosts: Arc::new(hosts),
            counters: Arc::default(),
            first_seen_in_term: Arc::default(),
            gpus_per_host,
            heartbeat_period,
            registration_time,
            tasks: Vec::new(),
        };
        let heartbeats = tokio::spawn(heartbeat_loop(
            fleet.endpoints.clone(),
            fleet.hosts.clone(),
            fleet.counters.clone(),
            heartbeat_period,
        ));
        fleet.tasks.push(heartbeats);
        Ok(fleet)
    }

    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }

    pub fn total_gpus(&self) -> usize {
        self.hosts.len() * self.gpus_per_host
    }

    /// Every host follows its assignments from now on and reports each new allocation started,
    /// then succeeded (an allocation it is asked to stop: stopped), as soon as it sees it.
    pub fn finish_jobs(&mut self) -> anyhow::Result<()> {
        let mut group = self.endpoints.clone();
        for i in 0..self.hosts.len() {
            // Each group of hosts gets its own connections, as separate agents would have:
            // thousands of long-lived streams on one HTTP/2 connection would serialize them.
            // (Hosts with certificates of their own use their own connections anyway.)
            if let Some(own) = &self.hosts[i].own {
                group = own.clone();
            } else if i % HOSTS_PER_CONNECTION == 0 {
                group = AgentEndpoints::new(&self.addresses, &Transport::Plain)?;
            }
            let task = tokio::spawn(follow_assignments(
                group.clone(),
                self.hosts.clone(),
                i,
                self.counters.clone(),
                self.first_seen_in_term.clone(),
            ));
            self.tasks.push(task);
        }
        Ok(())
    }

    /// When a host first saw an allocation placed by a leader of a term after `term`.
    pub fn first_placement_after_term(&self, term: u64) -> Option<Instant> {
        let seen = self.first_seen_in_term.lock().expect("fleet lock poisoned");
        seen.range(term + 1..).map(|(_, at)| *at).min()
    }
}

/// TLS with a node certificate for `name`, issued under the cluster's CA.
fn host_transport(cluster: &LocalCluster, name: &str) -> anyhow::Result<Transport> {
    let dir = cluster.identity(
        &format!("node-{name}"),
        &proto::tls::pki::IssueRequest::new(CertRole::Node, name),
    )?;
    let ctx = proto::tls::TlsContext::load(
        proto::tls::TlsFiles::in_dir(&dir),
        proto::tls::ClientAuth::Required,
    )?;
    Ok(Transport::Tls(ctx))
}

/// What a simulated node agent of this inventory would send when it registers.
fn registration(spec: &NodeSpec, incarnation: &str) -> pa::RegisterNodeRequest {
    pa::RegisterNodeRequest {
        labels: Default::default(),
        agent_address: String::new(),
        // No processes to fence: any value under the control plane's node grace will do.
        fence_grace_ms: 1_000,
        incarnation: incarnation.to_owned(),
        ..crate::api::convert::registration_from_spec(spec)
    }
}

async fn register(api: &AgentEndpoints, host: &Host) -> Result<pa::RegisterNodeResponse, Status> {
    let req = host.registration.clone();
    api.call(Duration::from_secs(30), |mut c| {
        let r = req.clone();
        async move { c.register_node(r).await }
    })
    .await
}

/// Heartbeats every host once per `period`, a slice of the fleet per tick.
async fn heartbeat_loop(
    api: AgentEndpoints,
    hosts: Arc<Vec<Host>>,
    counters: Arc<FleetCounters>,
    period: Duration,
) {
    let tick = period / TICKS_PER_PERIOD;
    let per_tick = hosts.len().div_ceil(TICKS_PER_PERIOD as usize).max(1);
    let mut next = 0usize;
    let mut ticker = tokio::time::interval(tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let slice: Vec<usize> = (0..per_tick.min(hosts.len()))
            .map(|k| (next + k) % hosts.len())
            .collect();
        next = (next + per_tick) % hosts.len().max(1);
        // Each tick's slice runs on its own: a slow answer (a busy or changing leader) must not
        // delay the next slices, or their hosts would fall silent past lease and grace.
        let beats: Vec<_> = slice
            .into_iter()
            .map(|i| {
                let (api, hosts, counters) = (api.clone(), hosts.clone(), counters.clone());
                async move { heartbeat(hosts[i].api(&api), &hosts[i], &counters).await }
            })
            .collect();
        tokio::spawn(
            stream::iter(beats)
                .buffer_unordered(IN_FLIGHT)
                .collect::<Vec<()>>(),
        );
    }
}

async fn heartbeat(api: &AgentEndpoints, host: &Host, counters: &FleetCounters) {
    let req = pa::HeartbeatRequest {
        node: host.registration.name.clone(),
        // The control plane does not read it; the allocations these hosts "run" end at once.
        running: Vec::new(),
        incarnation: host.registration.incarnation.clone(),
        replica_metrics: Vec::new(),
    };
    let answer = api
        .call(Duration::from_secs(2), |mut c| {
            let r = req.clone();
            async move { c.heartbeat(r).await }
        })
        .await;
    match answer {
        Ok(_) => {
            counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        }
        // Declared lost, or unknown: register again, as an agent would.
        Err(s) if matches!(s.code(), Code::NotFound | Code::FailedPrecondition) => {
            counters.reregistrations.fetch_add(1, Ordering::Relaxed);
            if register(api, host).await.is_err() {
                counters.heartbeat_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        Err(_) => {
            counters.heartbeat_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Follows one host's assignment stream (served by the leader only) for as long as the fleet
/// lives, reconnecting through every replica when it breaks (a failover), and reports each new
/// allocation started then succeeded.
async fn follow_assignments(
    api: AgentEndpoints,
    hosts: Arc<Vec<Host>>,
    index: usize,
    counters: Arc<FleetCounters>,
    first_seen_in_term: Arc<Mutex<BTreeMap<u64, Instant>>>,
) {
    let host = &hosts[index];
    let node = host.name().to_owned();
    // Allocations already reported; pruned to those still in the latest set.
    let mut reported: BTreeSet<u64> = BTreeSet::new();
    let mut endpoint = api.preferred.load(Ordering::Relaxed);
    loop {
        let mut client = api.clients[endpoint % api.clients.len()].clone();
        let opened = client
            .watch_assignments(pa::WatchAssignmentsRequest { node: node.clone() })
            .await;
        let mut stream = match opened {
            Ok(s) => s.into_inner(),
            Err(_) => {
                // Not the leader (or down): try the next replica.
                endpoint += 1;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        counters.watch_connects.fetch_add(1, Ordering::Relaxed);
        while let Some(Ok(set)) = stream.next().await {
            let seen_at = Instant::now();
            let current: BTreeSet<u64> = set.allocations.iter().map(|a| a.allocation_id).collect();
            reported.retain(|id| current.contains(id));
            let fresh: Vec<&pa::Assignment> = set
                .allocations
                .iter()
                .filter(|a| !reported.contains(&a.allocation_id))
                .collect();
            if fresh.is_empty() {
                continue;
            }
            {
                let mut seen = first_seen_in_term.lock().expect("fleet lock poisoned");
                for a in &fresh {
                    seen.entry(a.term).or_insert(seen_at);
                }
            }
            counters
                .assigned
                .fetch_add(fresh.len() as u64, Ordering::Relaxed);
            let reports = fresh
                .iter()
                .map(|a| finish(&api, &node, a.allocation_id, a.stop, &counters));
            futures::future::join_all(reports).await;
            reported.extend(fresh.iter().map(|a| a.allocation_id));
        }
        // The stream ended (leader change, replica killed): reconnect, leader first.
        endpoint = api.preferred.load(Ordering::Relaxed);
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}

/// Reports one allocation started then succeeded (or, if the control plane wants it stopped,
/// stopped), each a committed write. A report that could not get through (no leader answered
/// in time: an election, an overloaded replica) is sent again until one does, as an agent
/// keeps its reports until they are acknowledged. Giving up would leave the allocation
/// holding its GPUs for good, and with enough of those the run stalls for want of GPUs.
async fn finish(
    api: &AgentEndpoints,
    node: &str,
    allocation: u64,
    stop: bool,
    counters: &FleetCounters,
) {
    use pa::allocation_report::Event;
    let events: &[Event] = if stop {
        &[Event::Stopped]
    } else {
        &[Event::Started, Event::Succeeded]
    };
    for event in events {
        let req = pa::AllocationReport {
            node: node.to_owned(),
            allocation_id: allocation,
            event: *event as i32,
            has_exit_code: *event == Event::Succeeded,
            ..Default::default()
        };
        let answer = loop {
            let answer = api
                .call(Duration::from_secs(30), |mut c| {
                    let r = req.clone();
                    async move { c.report_allocation(r).await }
                })
                .await;
            match answer {
                Err(s) if retryable(&s) => {
                    counters.report_errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                }
                other => break other,
            }
        };
        match (answer, event) {
            // Refused for good (not retryable): nothing to send again.
            (Err(s), _) => {
                counters.report_errors.fetch_add(1, Ordering::Relaxed);
                counters.refused(&s);
                return;
            }
            (Ok(_), Event::Started) => counters.started.fetch_add(1, Ordering::Relaxed),
            (Ok(_), Event::Stopped) => counters.stopped.fetch_add(1, Ordering::Relaxed),
            (Ok(_), _) => counters.finished.fetch_add(1, Ordering::Relaxed),
        };
    }
}
