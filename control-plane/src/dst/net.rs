//! The simulated network: every message between replicas, agents and clients passes through
//! `SimNet::hop`, which decides from the seed's RNG whether it is delayed, lost, or refused
//! (a crashed target, a cut link). Raft RPCs use openraft's own `RaftNetwork` trait over direct
//! calls into the target replica's `Raft` handle.
//!
//! Failures are never reported to openraft as `Unreachable`: that error sends openraft 0.9's
//! replication into its backoff loop, whose `tokio::select!` is unbiased and draws from tokio's
//! per-runtime random seed, which cannot be fixed without `--cfg tokio_unstable`. A refused or
//! lost message is a `NetworkError` instead (what a reset connection looks like), after which
//! openraft retries on its next heartbeat.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::BasicNode;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};

use crate::raft::peers::{PeerBinary, PeerState};
use crate::raft::{NodeId, Raft, TypeConfig};
use crate::scheduler::score::{SplitMix64, mix64};

/// Something that sends or receives messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Endpoint {
    Replica(NodeId),
    Agent(usize),
    Client(usize),
}

impl Endpoint {
    fn code(self) -> u64 {
        match self {
            Endpoint::Replica(id) => id,
            Endpoint::Agent(i) => 1_000 + i as u64,
            Endpoint::Client(i) => 2_000 + i as u64,
        }
    }
}

/// What happened to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Delivered,
    /// Dropped on the way: the sender only learns by its timeout.
    Lost,
    /// The target is down or the link is cut at send time: the sender learns at once.
    Refused,
}

/// Message and fault counters, for the summary.
#[derive(Debug, Clone, Default)]
pub struct NetStats {
    pub sent: u64,
    pub lost: u64,
    pub refused: u64,
}

struct NetState {
    seed: u64,
    /// One random stream per directed link: the k-th message on a link meets the same fate
    /// whatever the interleaving with other links (see `runner` on why that matters).
    links: BTreeMap<(Endpoint, Endpoint), SplitMix64>,
    /// Directed links that are cut, with how many active faults cut them (faults overlap).
    cut: BTreeMap<(Endpoint, Endpoint), u32>,
    /// Directed links whose every message takes this many ms more (a slow follower).
    slow: BTreeMap<(Endpoint, Endpoint), u64>,
    loss_permille: u64,
    max_delay_ms: u64,
    /// Running replicas: incarnation number and Raft handle. Absent while crashed.
    replicas: BTreeMap<NodeId, (u64, Raft)>,
    stats: NetStats,
    /// Every message's fate, when `GPUCP_DST_TRACE` asks (to find where two runs part).
    pub trace: Option<Vec<String>>,
    origin: tokio::time::Instant,
}

/// Cheap to clone: every clone is the same network.
#[derive(Clone)]
pub struct SimNet(Arc<Mutex<NetState>>);

impl SimNet {
    pub fn new(seed: u64, loss_permille: u64, max_delay_ms: u64) -> SimNet {
        SimNet(Arc::new(Mutex::new(NetState {
            seed,
            links: BTreeMap::new(),
            cut: BTreeMap::new(),
            slow: BTreeMap::new(),
            loss_permille,
            max_delay_ms: max_delay_ms.max(1),
            replicas: BTreeMap::new(),
            stats: NetStats::default(),
            trace: std::env::var_os("GPUCP_DST_TRACE").map(|_| Vec::new()),
            origin: tokio::time::Instant::now(),
        })))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, NetState> {
        self.0.lock().expect("simulated network lock poisoned")
    }

    pub fn set_replica(&self, id: NodeId, running: Option<(u64, Raft)>) {
        let mut s = self.state();
        match running {
            Some(r) => s.replicas.insert(id, r),
            None => s.replicas.remove(&id),
        };
    }

    /// The running incarnation of a replica and its Raft handle.
    pub fn replica(&self, id: NodeId) -> Option<(u64, Raft)> {
        self.state().replicas.get(&id).cloned()
    }

    fn is_up(s: &NetState, e: Endpoint) -> bool {
        match e {
            Endpoint::Replica(id) => s.replicas.contains_key(&id),
            _ => true,
        }
    }

    pub fn link_ok(&self, from: Endpoint, to: Endpoint) -> bool {
        let s = self.state();
        Self::is_up(&s, from) && Self::is_up(&s, to) && !s.cut.contains_key(&(from, to))
    }

    pub fn cut(&self, from: Endpoint, to: Endpoint) {
        *self.state().cut.entry((from, to)).or_default() += 1;
    }

    pub fn heal(&self, from: Endpoint, to: Endpoint) {
        let mut s = self.state();
        if let Some(n) = s.cut.get_mut(&(from, to)) {
            *n -= 1;
            if *n == 0 {
                s.cut.remove(&(from, to));
            }
        }
    }

    /// Every later message on this directed link takes `extra_ms` more. Draws nothing from
    /// the seed's random streams, so the rest of a seed's run is unchanged.
    pub fn slow_down(&self, from: Endpoint, to: Endpoint, extra_ms: u64) {
        self.state().slow.insert((from, to), extra_ms);
    }

    pub fn set_loss(&self, permille: u64) {
        self.state().loss_permille = permille;
    }

    pub fn loss(&self) -> u64 {
        self.state().loss_permille
    }

    pub fn take_trace(&self) -> Vec<String> {
        self.state().trace.take().unwrap_or_default()
    }

    pub fn stats(&self) -> NetStats {
        self.state().stats.clone()
    }

    /// Sends one message: draws its fate and delay, waits the delay, and re-checks the link
    /// (a target that crashed or a link cut while the message was in flight loses it).
    pub async fn hop(&self, from: Endpoint, to: Endpoint) -> Delivery {
        let (delay, lost) = {
            let mut s = self.state();
            s.stats.sent += 1;
            if !(Self::is_up(&s, from) && Self::is_up(&s, to) && !s.cut.contains_key(&(from, to))) {
                s.stats.refused += 1;
                return Delivery::Refused;
            }
            let (max, loss, seed) = (s.max_delay_ms, s.loss_permille, s.seed);
            let rng = s
                .links
                .entry((from, to))
                .or_insert_with(|| SplitMix64::new(mix64(seed ^ (from.code() << 20) ^ to.code())));
            let drawn = 1 + rng.below(max);
            let lost = rng.below(1000) < loss;
            let delay = drawn + s.slow.get(&(from, to)).copied().unwrap_or(0);
            if lost {
                s.stats.lost += 1;
            }
            let at = s.origin.elapsed().as_micros();
            if let Some(t) = &mut s.trace {
                t.push(format!("{at} {from:?}->{to:?} delay={delay} lost={lost}"));
            }
            (delay, lost)
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if lost || !self.link_ok(from, to) {
            return Delivery::Lost;
        }
        Delivery::Delivered
    }
}

/// Pause before a refused Raft RPC reports its error: production's retry interval after an
/// unreachable peer (`raft::network`'s `PEER_RETRY_INTERVAL`).
const REFUSED_RETRY: Duration = Duration::from_millis(40);

/// Creates one `SimPeer` per target for a replica's Raft.
#[derive(Clone)]
pub struct SimNetworkFactory {
    pub net: SimNet,
    pub from: NodeId,
    /// The sending replica's record of its peers, fed from answers as `raft::network` does
    /// in production (the leader raises the cluster version from it).
    pub peers: Arc<PeerState>,
}

pub struct SimPeer {
    net: SimNet,
    from: NodeId,
    target: NodeId,
    peers: Arc<PeerState>,
}

impl RaftNetworkFactory<TypeConfig> for SimNetworkFactory {
    type Network = SimPeer;

    async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> SimPeer {
        SimPeer {
            net: self.net.clone(),
            from: self.from,
            target,
            peers: self.peers.clone(),
        }
    }
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

fn network_error<E>(what: &str) -> RPCError<NodeId, BasicNode, RaftError<NodeId, E>>
where
    E: std::error::Error,
{
    RPCError::Network(NetworkError::new(&std::io::Error::other(what.to_owned())))
}

impl SimPeer {
    /// Request hop, the call on the target's Raft, response hop. A lost message costs the
    /// RPC's time-to-live, as a silent peer does.
    async fn rpc<Resp, E, F, Fut>(&self, ttl: Duration, call: F) -> RpcResult<Resp, E>
    where
        E: std::error::Error,
        F: FnOnce(Raft) -> Fut,
        Fut: std::future::Future<Output = Result<Resp, RaftError<NodeId, E>>>,
    {
        let (from, to) = (Endpoint::Replica(self.from), Endpoint::Replica(self.target));
        match self.net.hop(from, to).await {
            Delivery::Delivered => {}
            Delivery::Lost => {
                tokio::time::sleep(ttl).await;
                return Err(network_error("request lost"));
            }
            Delivery::Refused => {
                // openraft retries a `NetworkError` at once; production backs off for
                // `PEER_RETRY_INTERVAL` after a refusal (`Unreachable`). Waiting here keeps
                // that pace (and keeps a refused peer from spinning the simulation).
                tokio::time::sleep(REFUSED_RETRY).await;
                return Err(network_error("connection refused"));
            }
        }
        let Some((incarnation, raft)) = self.net.replica(self.target) else {
            tokio::time::sleep(REFUSED_RETRY).await;
            return Err(network_error("connection refused"));
        };
        let result = call(raft).await;
        // A reply from an incarnation that crashed meanwhile never leaves the host.
        if self.net.replica(self.target).map(|(i, _)| i) != Some(incarnation) {
            tokio::time::sleep(REFUSED_RETRY).await;
            return Err(network_error("connection reset"));
        }
        match self.net.hop(to, from).await {
            Delivery::Delivered => {}
            Delivery::Lost => {
                tokio::time::sleep(ttl).await;
                return Err(network_error("response lost"));
            }
            Delivery::Refused => {
                tokio::time::sleep(REFUSED_RETRY).await;
                return Err(network_error("connection reset"));
            }
        }
        // Every simulated replica runs this binary.
        self.peers.heard_from(self.target);
        self.peers.report_binary(self.target, PeerBinary::this());
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for SimPeer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, openraft::error::Infallible> {
        self.rpc(option.hard_ttl(), |raft| async move {
            raft.append_entries(rpc).await
        })
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        self.rpc(option.hard_ttl(), |raft| async move {
            raft.install_snapshot(rpc).await
        })
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, openraft::error::Infallible> {
        self.rpc(
            option.hard_ttl(),
            |raft| async move { raft.vote(rpc).await },
        )
        .await
    }
}
