//! The simulated replicas: each is the production stack — openraft with the real state
//! machine store (`StateMachineStore`, applying through `ClusterState::apply`), a `Replica`,
//! the leader loops (`leader::spawn`: scheduler `plan_with`, node liveness) and the gRPC
//! service implementations (`AgentService`, `ControlPlaneService`) called in-process — with
//! only the disk (`store::Disk`, an in-memory snapshot slot), the peer network (`net`) and the
//! clock (`Clock::Simulated`) replaced.
//!
//! A crash stops the incarnation abruptly (its leader loops aborted, Raft shut down, its
//! network endpoint gone) and keeps the disk; a restart opens a new incarnation over it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::BasicNode;
use proto::tls::{CertRole, ConnInfo, PeerIdentity};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

use super::net::{Delivery, Endpoint, SimNet, SimNetworkFactory};
use super::store::{Disk, MemLogStore};
use crate::api::route::FORWARDED;
use crate::api::{AgentService, ControlPlaneService};
use crate::leader::{LeaderConfig, Liveness};
use crate::raft::state_machine::{SnapshotStore, StateMachineStore};
use crate::raft::{NodeId, Raft, RaftTuning};
use crate::replica::{Clock, Replica};

/// A replica's durable data and per-replica settings, kept across crashes.
struct Slot {
    disk: Arc<Mutex<Disk>>,
    snapshot: Arc<Mutex<Option<Vec<u8>>>>,
    /// Fixed per replica: openraft draws its election timeout from `thread_rng` within
    /// [min, max); a one-millisecond range makes the draw constant, and the seed varies it.
    election_ms: u64,
    skew_ms: i64,
    running: Option<Running>,
    incarnations: u64,
}

/// One live incarnation.
#[derive(Clone)]
pub struct Running {
    pub incarnation: u64,
    pub replica: Arc<Replica>,
    pub agent_api: Arc<AgentService>,
    pub client_api: Arc<ControlPlaneService>,
    leader_task: Arc<JoinHandle<()>>,
    alive: Arc<AtomicBool>,
}

/// Leader time at the start of every seed, 2026-01-01T00:00:00Z: timestamps look like real
/// ones (a job's `--begin` is written in them).
pub const EPOCH_MS: u64 = 1_767_225_600_000;

pub struct SimCluster {
    pub net: SimNet,
    pub name: String,
    tuning: RaftTuning,
    pub leader_config: LeaderConfig,
    clock_origin: tokio::time::Instant,
    epoch_ms: u64,
    slots: Mutex<BTreeMap<NodeId, Slot>>,
}

/// A simulated call from `identity`, as a TLS connection with that certificate would carry
/// it. It is marked as forwarded so that `api::route` answers "not the leader" instead of
/// forwarding over a real tonic channel; the caller retries elsewhere, as `gpuctl` does.
pub fn sim_request_as<T>(identity: &Arc<PeerIdentity>, message: T) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut()
        .insert(FORWARDED, "sim".parse().expect("ASCII is valid metadata"));
    req.extensions_mut().insert(ConnInfo {
        remote: None,
        peer: Some(identity.clone()),
        tls: true,
    });
    req
}

/// The certificate identity of a simulated process: an agent's node certificate, or a
/// client's admin certificate.
pub fn sim_identity(role: CertRole, name: &str) -> Arc<PeerIdentity> {
    Arc::new(PeerIdentity {
        role,
        name: name.to_owned(),
        client_role: (role == CertRole::Client).then(|| "admin".to_owned()),
        tenant: None,
        serial: "51".into(),
        not_after_ms: u64::MAX,
    })
}

impl SimCluster {
    pub fn new(
        net: SimNet,
        tuning: RaftTuning,
        leader_config: LeaderConfig,
        replicas: &[(NodeId, u64, i64)],
    ) -> SimCluster {
        let slots = replicas
            .iter()
            .map(|&(id, election_ms, skew_ms)| {
                (
                    id,
                    Slot {
                        disk: Arc::default(),
                        snapshot: Arc::default(),
                        election_ms,
                        skew_ms,
                        running: None,
                        incarnations: 0,
                    },
                )
            })
            .collect();
        SimCluster {
            net,
            name: "dst".into(),
            tuning,
            leader_config,
            clock_origin: tokio::time::Instant::now(),
            epoch_ms: EPOCH_MS,
            slots: Mutex::new(slots),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, Slot>> {
        self.slots.lock().expect("cluster lock poisoned")
    }

    pub fn ids(&self) -> Vec<NodeId> {
        self.slots().keys().copied().collect()
    }

    pub fn members(&self) -> BTreeMap<NodeId, BasicNode> {
        self.ids()
            .into_iter()
            .map(|id| (id, BasicNode::new(format!("sim-{id}"))))
            .collect()
    }

    pub fn running(&self, id: NodeId) -> Option<Running> {
        self.slots().get(&id).and_then(|s| s.running.clone())
    }

    /// Every later log append on replica `id` takes `delay` to become durable.
    pub fn slow_disk(&self, id: NodeId, delay: std::time::Duration) {
        if let Some(slot) = self.slots().get(&id) {
            slot.disk
                .lock()
                .expect("simulated disk lock poisoned")
                .sync_delay = delay;
        }
    }

    pub fn all_running(&self) -> Vec<Running> {
        self.slots()
            .values()
            .filter_map(|s| s.running.clone())
            .collect()
    }

    /// Starts (or restarts) a replica over its disk.
    pub async fn start(&self, id: NodeId) -> anyhow::Result<()> {
        let (disk, snapshot, election_ms, skew_ms, incarnation) = {
            let mut slots = self.slots();
            let slot = slots
                .get_mut(&id)
                .ok_or_else(|| anyhow::anyhow!("no replica {id}"))?;
            anyhow::ensure!(slot.running.is_none(), "replica {id} is already running");
            slot.incarnations += 1;
            (
                slot.disk.clone(),
                slot.snapshot.clone(),
                slot.election_ms,
                slot.skew_ms,
                slot.incarnations,
            )
        };
        let alive = Arc::new(AtomicBool::new(true));
        let log = MemLogStore::new(disk, alive.clone());
        let committed = log.committed_index();
        let sm = StateMachineStore::open_with(SnapshotStore::Memory(snapshot))
            .map_err(|e| anyhow::anyhow!("replica {id}: {e}"))?;
        let mut tuning = self.tuning.clone();
        tuning.election_min_ms = election_ms;
        tuning.election_max_ms = election_ms + 1;
        let mut config = tuning.openraft_config(&self.name)?;
        // The simulated network sends every chunk with openraft's one timeout and models no
        // slow install: the per-chunk timeout the peer network gives chunks before the last.
        config.install_snapshot_timeout = crate::config::Defaults::SNAPSHOT_CHUNK_TIMEOUT_MS;
        let config = Arc::new(config);
        let peers = Arc::new(crate::raft::peers::PeerState::for_timing(
            tuning.heartbeat_ms,
            tuning.election_max_ms,
        ));
        let network = SimNetworkFactory {
            net: self.net.clone(),
            from: id,
            peers: peers.clone(),
        };
        let raft = Raft::new(id, config, network, log, sm.clone()).await?;
        let replica = Arc::new(
            Replica::new(
                id,
                self.name.clone(),
                format!("sim-{id}"),
                raft.clone(),
                sm,
                committed,
                Clock::Simulated {
                    epoch_ms: self.epoch_ms,
                    origin: self.clock_origin,
                    skew_ms,
                },
                // The simulation calls the services in process; callers carry the identities their
                // certificates would give them (`sim_request_as`), and every check is enforced.
                proto::transport::Transport::Plain,
                Arc::new(crate::api::auth::Security::enforced_without_tls()),
            )
            .with_membership(peers, Default::default()),
        );
        let liveness = Arc::new(Liveness::default());
        let leader_task = crate::leader::spawn(
            replica.clone(),
            liveness.clone(),
            self.leader_config.clone(),
        );
        let running = Running {
            incarnation,
            agent_api: Arc::new(AgentService::new(
                replica.clone(),
                liveness,
                self.leader_config.clone(),
            )),
            client_api: Arc::new(ControlPlaneService::new(replica.clone())),
            replica,
            leader_task: Arc::new(leader_task),
            alive,
        };
        self.net.set_replica(id, Some((incarnation, raft)));
        if let Some(slot) = self.slots().get_mut(&id) {
            slot.running = Some(running);
        }
        Ok(())
    }

    /// Crashes a replica: nothing not on its disk survives.
    pub async fn crash(&self, id: NodeId) {
        let Some(running) = self.slots().get_mut(&id).and_then(|s| s.running.take()) else {
            return;
        };
        self.net.set_replica(id, None);
        running.alive.store(false, Ordering::Relaxed);
        running.leader_task.abort();
        // Stops the core task; in-flight calls into it fail, as their connections would.
        let _ = running.replica.raft.shutdown().await;
    }

    /// Sends a request from `from` to replica `to`, runs it there with `call` (bounded by
    /// `timeout`, as a client deadline), and carries the answer back. Lost messages and calls
    /// that hang (a write waiting for a quorum) end in `DeadlineExceeded` after `timeout`.
    pub async fn call<T, F, Fut>(
        &self,
        from: Endpoint,
        to: NodeId,
        timeout: Duration,
        call: F,
    ) -> Result<T, Status>
    where
        F: FnOnce(Running) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let target = Endpoint::Replica(to);
        match self.net.hop(from, target).await {
            Delivery::Delivered => {}
            Delivery::Lost => {
                tokio::time::sleep_until(deadline).await;
                return Err(Status::deadline_exceeded("request lost"));
            }
            Delivery::Refused => {
                return Err(Status::unavailable(format!(
                    "replica {to} refused the connection"
                )));
            }
        }
        let Some(running) = self.running(to) else {
            return Err(Status::unavailable(format!("replica {to} is down")));
        };
        let incarnation = running.incarnation;
        let result = match tokio::time::timeout_at(deadline, call(running)).await {
            Ok(r) => r,
            Err(_) => return Err(Status::deadline_exceeded("no answer before the deadline")),
        };
        if self.running(to).map(|r| r.incarnation) != Some(incarnation) {
            return Err(Status::unavailable(format!("replica {to} crashed")));
        }
        match self.net.hop(target, from).await {
            Delivery::Delivered => result.map(Response::into_inner),
            Delivery::Lost => {
                tokio::time::sleep_until(deadline).await;
                Err(Status::deadline_exceeded("response lost"))
            }
            Delivery::Refused => Err(Status::unavailable("connection reset")),
        }
    }
}

/// The leader a `Status` from `api::route` names ("the leader is replica N at ..."), so that
/// simulated callers go there next, as `client.rs` does with real endpoints.
pub fn leader_hint(status: &Status) -> Option<NodeId> {
    let rest = status.message().split("the leader is replica ").nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}
