//! A simulated GPU host: its agent speaks the real `AgentApi` (register, heartbeat, watch
//! assignments, report allocations) through the simulated network, and "runs" processes that
//! the observer sees start and stop on their GPUs.
//!
//! It follows the node agent's contract: it runs exactly the assignments of the newest term it
//! has seen; a stopped assignment is stopped and reported; it self-fences (stops every process)
//! once it has not renewed its lease for `lease` counted from when the last successful
//! heartbeat was *sent*, which is never later than when the leader heard it; a host crash kills
//! its processes and the agent comes back with a new incarnation.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use proto::agent as pa;
use proto::agent::agent_api_server::AgentApi;
use tokio::time::Instant;
use tonic::{Code, Status};

use super::check::Process;
use super::cluster::{leader_hint, sim_identity, sim_request_as};
use super::net::Endpoint;
use super::world::World;
use crate::raft::NodeId;
use crate::scheduler::score::SplitMix64;
use crate::state::NodeSpec;
use proto::tls::{CertRole, PeerIdentity};

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<pa::Assignments, Status>> + Send>>;

/// How long a replica that does not crash runs: longer than any seed.
const RUNS_UNTIL_STOPPED_MS: u64 = 30 * 24 * 3600 * 1000;

/// How often the agent loop wakes when nothing else happens.
const TICK: Duration = Duration::from_millis(100);

struct LocalProcess {
    ends_at: Instant,
    fails: bool,
}

struct Agent {
    world: Arc<World>,
    /// The node certificate this host's agent would hold.
    identity: Arc<PeerIdentity>,
    index: usize,
    me: Endpoint,
    spec: NodeSpec,
    rng: SplitMix64,
    target: NodeId,
    incarnation: u64,
    registered: bool,
    /// Send time of the last heartbeat (or registration) that succeeded.
    last_ok: Option<Instant>,
    lease: Duration,
    next_heartbeat: Instant,
    stream: Option<(NodeId, u64, AssignmentStream)>,
    max_term: u64,
    procs: BTreeMap<u64, LocalProcess>,
    /// Allocations this host already ran (or was told to stop): never started again.
    done: BTreeSet<u64>,
    reports: VecDeque<pa::AllocationReport>,
}

pub async fn run(world: Arc<World>, index: usize, spec: NodeSpec, seed: u64) {
    let ids = world.cluster.ids();
    let mut agent = Agent {
        me: Endpoint::Agent(index),
        target: ids[index % ids.len()],
        world,
        index,
        identity: sim_identity(CertRole::Node, &spec.name),
        spec,
        rng: SplitMix64::new(seed),
        incarnation: 1,
        registered: false,
        last_ok: None,
        lease: Duration::ZERO,
        next_heartbeat: Instant::now(),
        stream: None,
        max_term: 0,
        procs: BTreeMap::new(),
        done: BTreeSet::new(),
        reports: VecDeque::new(),
    };
    agent.run().await;
}

impl Agent {
    fn now_ms(&self) -> u64 {
        self.world.now_ms()
    }

    fn incarnation_id(&self) -> String {
        format!("{}-inc{}", self.spec.name, self.incarnation)
    }

    async fn run(&mut self) {
        while !self.world.stopped() {
            if self.world.host_down(self.index) {
                self.host_crashed();
                while self.world.host_down(self.index) && !self.world.stopped() {
                    tokio::time::sleep(TICK).await;
                }
                continue;
            }
            self.fence_if_expired();
            if !self.registered {
                self.register().await;
            } else if Instant::now() >= self.next_heartbeat {
                self.heartbeat().await;
            }
            self.fence_if_expired();
            self.finish_due();
            self.send_reports().await;
            if self.registered && self.stream.is_none() {
                self.open_stream().await;
            }
            self.wait_for_assignments().await;
        }
    }

    /// The next replica to try: the leader a refusal named, or the next one in turn.
    fn retarget(&mut self, status: &Status) {
        let ids = self.world.cluster.ids();
        self.target = match leader_hint(status) {
            Some(l) if l != self.target => l,
            _ => {
                let pos = ids.iter().position(|i| *i == self.target).unwrap_or(0);
                ids[(pos + 1) % ids.len()]
            }
        };
    }

    /// A call's deadline: one heartbeat interval (a lost message costs one retry, not the
    /// lease), and never past the lease, so the agent fences on time even while a call hangs.
    fn call_timeout(&self) -> Duration {
        let full = Duration::from_millis(self.world.params.agent_heartbeat_ms);
        match (self.registered, self.last_ok) {
            (true, Some(ok)) => {
                let left = (ok + self.lease).saturating_duration_since(Instant::now());
                full.min(left.max(Duration::from_millis(1)))
            }
            _ => full,
        }
    }

    fn host_crashed(&mut self) {
        let at = self.now_ms();
        let mut obs = self.world.observer();
        for id in std::mem::take(&mut self.procs).into_keys() {
            obs.stop(at, id, "host crashed");
        }
        obs.record(at, ("host crashed", self.index));
        drop(obs);
        // The agent's memory is gone with the host; its disk keeps nothing the sim needs.
        self.stream = None;
        self.reports.clear();
        self.done.clear();
        self.max_term = 0;
        self.registered = false;
        self.last_ok = None;
        self.incarnation += 1;
    }

    /// Self-fencing: no renewed lease for `lease` → every process stops, and their exits
    /// are reported as lost once the control plane is reachable again.
    fn fence_if_expired(&mut self) {
        let Some(ok) = self.last_ok else { return };
        if Instant::now() < ok + self.lease || self.procs.is_empty() && self.stream.is_none() {
            return;
        }
        let at = self.now_ms();
        let fenced: Vec<u64> = std::mem::take(&mut self.procs).into_keys().collect();
        {
            let mut obs = self.world.observer();
            for id in &fenced {
                obs.stop(at, *id, "fenced");
            }
            obs.record(at, ("fenced", self.index, fenced.len()));
        }
        for id in fenced {
            self.done.insert(id);
            self.reports
                .push_back(self.report(id, pa::allocation_report::Event::Lost));
        }
        // Assignments from a leader that cannot renew the lease are not to be trusted.
        self.stream = None;
    }

    fn report(&self, allocation: u64, event: pa::allocation_report::Event) -> pa::AllocationReport {
        pa::AllocationReport {
            node: self.spec.name.clone(),
            allocation_id: allocation,
            event: event as i32,
            exit_code: if event == pa::allocation_report::Event::Failed {
                1
            } else {
                0
            },
            has_exit_code: matches!(
                event,
                pa::allocation_report::Event::Succeeded | pa::allocation_report::Event::Failed
            ),
            signal: 0,
            reason: String::new(),
            usage: None,
        }
    }

    async fn register(&mut self) {
        let request = register_request(&self.spec, self.incarnation_id());
        let sent = Instant::now();
        let timeout = self.call_timeout();
        let identity = self.identity.clone();
        let result = self
            .world
            .cluster
            .call(self.me, self.target, timeout, |r| async move {
                r.agent_api
                    .register_node(sim_request_as(&identity, request))
                    .await
            })
            .await;
        match result {
            Ok(resp) => {
                self.registered = true;
                self.last_ok = Some(sent);
                self.lease = Duration::from_millis(resp.lease_ms);
                self.next_heartbeat =
                    sent + Duration::from_millis(resp.heartbeat_interval_ms.max(1));
                self.stream = None;
                let at = self.now_ms();
                self.world
                    .observer()
                    .record(at, ("registered", self.index, self.incarnation));
            }
            Err(status) => {
                self.retarget(&status);
                tokio::time::sleep(TICK).await;
            }
        }
    }

    async fn heartbeat(&mut self) {
        let request = pa::HeartbeatRequest {
            node: self.spec.name.clone(),
            running: self.procs.keys().copied().collect(),
            incarnation: self.incarnation_id(),
            replica_metrics: Vec::new(),
        };
        let sent = Instant::now();
        let timeout = self.call_timeout();
        let interval = Duration::from_millis(self.world.params.agent_heartbeat_ms);
        let identity = self.identity.clone();
        let result = self
            .world
            .cluster
            .call(self.me, self.target, timeout, |r| async move {
                r.agent_api
                    .heartbeat(sim_request_as(&identity, request))
                    .await
            })
            .await;
        match result {
            Ok(resp) => {
                self.last_ok = Some(sent);
                self.lease = Duration::from_millis(resp.lease_ms);
                self.next_heartbeat = sent + interval;
            }
            Err(status) if matches!(status.code(), Code::NotFound | Code::FailedPrecondition) => {
                // Declared lost, or another incarnation holds the name: register again. The
                // processes were fenced already (lost needs lease + grace of silence).
                self.registered = false;
                self.stream = None;
            }
            Err(status) => {
                if self.world.observer().trace.is_some() {
                    let at = self.now_ms();
                    let what = format!("{:?} {}", status.code(), status.message());
                    self.world
                        .observer()
                        .record(at, ("heartbeat failed", self.index, self.target, what));
                }
                self.retarget(&status);
                self.next_heartbeat = Instant::now() + TICK;
            }
        }
    }

    async fn open_stream(&mut self) {
        let request = pa::WatchAssignmentsRequest {
            node: self.spec.name.clone(),
        };
        let target = self.target;
        let timeout = self.call_timeout();
        let incarnation = self.world.cluster.running(target).map(|r| r.incarnation);
        let identity = self.identity.clone();
        let result = self
            .world
            .cluster
            .call(self.me, target, timeout, |r| async move {
                r.agent_api
                    .watch_assignments(sim_request_as(&identity, request))
                    .await
            })
            .await;
        match (result, incarnation) {
            (Ok(stream), Some(inc)) => self.stream = Some((target, inc, stream)),
            (Ok(_), None) => {}
            (Err(status), _) => self.retarget(&status),
        }
    }

    /// Waits up to one tick for the next assignment set; a set from a replica that crashed
    /// or whose link to this host is cut never arrives (the stream is dropped).
    async fn wait_for_assignments(&mut self) {
        let mut wait = TICK;
        if let Some(ok) = self.last_ok
            && self.registered
        {
            let left = (ok + self.lease).saturating_duration_since(Instant::now());
            wait = wait.min(left.max(Duration::from_millis(1)));
        }
        let Some((source, inc, stream)) = self.stream.as_mut() else {
            tokio::time::sleep(wait).await;
            return;
        };
        let (source, inc) = (*source, *inc);
        let item = tokio::select! {
            biased;
            item = stream.next() => Some(item),
            _ = tokio::time::sleep(wait) => None,
        };
        let Some(item) = item else { return };
        let link_ok = self
            .world
            .cluster
            .net
            .link_ok(Endpoint::Replica(source), self.me)
            && self.world.cluster.running(source).map(|r| r.incarnation) == Some(inc);
        match item {
            Some(Ok(set)) if link_ok => self.reconcile(source, set),
            Some(Err(status)) => {
                self.stream = None;
                self.retarget(&status);
            }
            _ => {
                self.stream = None;
                self.retarget(&Status::unavailable("stream ended"));
            }
        }
    }

    /// Runs exactly what the newest set says.
    fn reconcile(&mut self, source: NodeId, set: pa::Assignments) {
        if set.term < self.max_term {
            return;
        }
        self.max_term = set.term;
        let at = self.now_ms();
        // Without a valid lease the host starts nothing (it is fenced or about to be).
        let leased = self
            .last_ok
            .is_some_and(|ok| Instant::now() < ok + self.lease);
        let wanted: BTreeSet<u64> = set.allocations.iter().map(|a| a.allocation_id).collect();
        // Running processes the set no longer names were released: stop them.
        let gone: Vec<u64> = self
            .procs
            .keys()
            .filter(|id| !wanted.contains(id))
            .copied()
            .collect();
        for id in gone {
            self.procs.remove(&id);
            self.done.insert(id);
            self.world.observer().stop(at, id, "released");
        }
        let details = self.world.cluster.running(source);
        for a in set.allocations {
            let id = a.allocation_id;
            if a.stop {
                if self.procs.remove(&id).is_some() {
                    self.world.observer().stop(at, id, "stopped");
                }
                if self.done.insert(id) {
                    self.reports
                        .push_back(self.report(id, pa::allocation_report::Event::Stopped));
                }
                continue;
            }
            if !leased || self.procs.contains_key(&id) || self.done.contains(&id) {
                continue;
            }
            // What the observer needs beyond the assignment: which placement the allocation
            // belongs to, and what it counts against its tenant.
            let (placement, tenant_milli) = details
                .as_ref()
                .and_then(|r| {
                    let data = r.replica.sm.read();
                    let rec = data.cluster.allocations.get(&id)?;
                    let job = data.cluster.jobs.get(&rec.allocation.job)?;
                    Some((
                        (rec.allocation.term, rec.allocation.created_at),
                        job.spec.gpu_milli_per_task(),
                    ))
                })
                .unwrap_or((
                    (a.term, 0),
                    if a.gpu_milli > 0 {
                        u64::from(a.gpu_milli)
                    } else {
                        1000 * a.gpus.len() as u64
                    },
                ));
            let (lo, hi) = self.world.params.task_ms;
            let (run_ms, fails) = match &a.replica {
                // A service's replica runs until it is stopped; now and then one crashes
                // (after a task's run time) and is restarted in place. A replica that failed
                // twice in a row runs on, so no seed's service ends up crash-looping.
                Some(_) => {
                    let failures = details.as_ref().and_then(|r| {
                        let data = r.replica.sm.read();
                        let job = data.cluster.jobs.get(&a.job_id)?;
                        Some(job.replica.as_ref()?.failures)
                    });
                    if failures.unwrap_or(0) < 2 && self.rng.below(100) < 15 {
                        (lo + self.rng.below(hi - lo + 1), true)
                    } else {
                        (RUNS_UNTIL_STOPPED_MS, false)
                    }
                }
                None => (lo + self.rng.below(hi - lo + 1), self.rng.below(100) < 5),
            };
            self.world.observer().start(
                at,
                Process {
                    node: self.spec.name.clone(),
                    allocation: id,
                    job: a.job_id,
                    tenant: a.tenant.clone(),
                    gpus: a.gpus.clone(),
                    gpu_milli: a.gpu_milli,
                    tenant_milli,
                    placement,
                    replica: a.replica.as_ref().map(|r| (r.service.clone(), r.ordinal)),
                },
            );
            self.procs.insert(
                id,
                LocalProcess {
                    ends_at: Instant::now() + Duration::from_millis(run_ms),
                    fails,
                },
            );
            self.reports
                .push_back(self.report(id, pa::allocation_report::Event::Started));
        }
    }

    fn finish_due(&mut self) {
        let now = Instant::now();
        let due: Vec<u64> = self
            .procs
            .iter()
            .filter(|(_, p)| p.ends_at <= now)
            .map(|(id, _)| *id)
            .collect();
        let at = self.now_ms();
        for id in due {
            let Some(p) = self.procs.remove(&id) else {
                continue;
            };
            let (event, why) = if p.fails {
                (pa::allocation_report::Event::Failed, "failed")
            } else {
                (pa::allocation_report::Event::Succeeded, "succeeded")
            };
            self.world.observer().stop(at, id, why);
            self.done.insert(id);
            self.reports.push_back(self.report(id, event));
        }
    }

    /// Sends queued reports in order; stops at the first that fails (retried next tick).
    async fn send_reports(&mut self) {
        while let Some(report) = self.reports.front().cloned() {
            if !self.registered {
                return;
            }
            let what = (report.allocation_id, report.event);
            let timeout = self.call_timeout();
            let identity = self.identity.clone();
            let result = self
                .world
                .cluster
                .call(self.me, self.target, timeout, |r| async move {
                    r.agent_api
                        .report_allocation(sim_request_as(&identity, report))
                        .await
                })
                .await;
            if self.world.observer().trace.is_some() {
                let at = self.now_ms();
                let answer = match &result {
                    Ok(_) => "ok".to_owned(),
                    Err(s) => format!("{:?} {}", s.code(), s.message()),
                };
                self.world
                    .observer()
                    .record(at, ("report", self.index, self.target, what, answer));
            }
            match result {
                Ok(_) => {
                    self.reports.pop_front();
                }
                // A report the control plane refuses for good (another node's allocation)
                // is dropped; retrying cannot help.
                Err(status)
                    if matches!(
                        status.code(),
                        Code::FailedPrecondition | Code::InvalidArgument
                    ) =>
                {
                    self.reports.pop_front();
                }
                Err(status) => {
                    self.retarget(&status);
                    return;
                }
            }
        }
    }
}

/// The registration a simulated host of this spec sends.
fn register_request(spec: &NodeSpec, incarnation: String) -> pa::RegisterNodeRequest {
    pa::RegisterNodeRequest {
        agent_address: format!("sim-host-{}", spec.name),
        // The simulated host stops processes at once when it fences.
        fence_grace_ms: 0,
        incarnation,
        ..crate::api::convert::registration_from_spec(spec)
    }
}
