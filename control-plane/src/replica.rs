//! One running replica: its Raft instance, state machine and the operations the API needs
//! (stamped writes, linearizable reads, leader lookup). Knows nothing about gRPC messages.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use openraft::error::{ClientWriteError, RaftError};
use proto::tls::ExpectedPeer;
use proto::transport::Transport;
use tonic::transport::Channel;

use crate::api::auth::Security;
use crate::group_commit::GroupCommit;
use crate::membership::MembershipSettings;
use crate::raft::peers::PeerState;
use crate::raft::state_machine::StateMachineStore;
use crate::raft::{NodeId, Raft};
use crate::state::{Command, Outcome, Rejection};

/// Why an API operation did not complete. `NotLeader` is routed to the leader by the API layer.
#[derive(Debug, Clone)]
pub enum ApiError {
    NotLeader {
        leader: Option<(NodeId, String)>,
    },
    Rejected(Rejection),
    Unavailable(String),
    /// An operation that did not finish in time (a membership change whose new replica never
    /// answered, or that could not commit).
    DeadlineExceeded(String),
    Internal(String),
    /// No credentials, or ones that are not (or no longer) valid.
    Unauthenticated(String),
    /// Valid credentials that do not allow the action.
    PermissionDenied(String),
}

impl From<Rejection> for ApiError {
    fn from(r: Rejection) -> Self {
        ApiError::Rejected(r)
    }
}

pub struct Replica {
    pub id: NodeId,
    pub cluster: String,
    pub advertise: String,
    pub raft: Raft,
    pub sm: StateMachineStore,
    committed: Arc<AtomicU64>,
    /// The clock that stamps proposals (`Request::at`) and scheduling passes.
    clock: Clock,
    /// Channels to the leader (by address) for forwarded calls; connections are reused.
    leader_channels: Mutex<HashMap<String, Channel>>,
    /// Where writes queue to share log entries.
    group_commit: GroupCommit,
    /// How this replica reaches the leader and agents (TLS with its replica certificate).
    pub transport: Transport,
    /// Authentication settings and refusal counters.
    pub security: Arc<Security>,
    /// When each peer last answered, and whether this replica was removed.
    pub peers: Arc<PeerState>,
    /// How membership changes wait for a new replica (`membership`).
    pub membership: MembershipSettings,
    /// The membership change this replica is carrying out, if any (one at a time).
    membership_busy: Mutex<Option<String>>,
    /// Why pending jobs are pending, as the leader's last scheduling pass found: soft state,
    /// never in the log (it changes every pass). Written by the scheduling loop while this
    /// replica leads; read by the API, which shows it only for the term that wrote it.
    pub pending_reasons: std::sync::RwLock<Option<Arc<crate::scheduler::Board>>>,
    /// Prometheus series (`metrics`); disabled unless `--metrics-listen` is given.
    pub metrics: Arc<crate::metrics::ReplicaMetrics>,
    /// The leader's soft state about services: the replicas' autoscaling gauges as agents
    /// report them with heartbeats, and what the autoscaler last decided. Never in the log.
    pub services: Arc<crate::leader::services::ServiceSoftState>,
}

/// Holds `Replica::membership_busy` for one change; clears it when dropped.
pub struct MembershipChange(Arc<Replica>);

impl Drop for MembershipChange {
    fn drop(&mut self) {
        *self
            .0
            .membership_busy
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The API's `NotLeader` for openraft's hint of who leads (the API layer forwards to it).
pub(crate) fn not_leader(
    f: &openraft::error::ForwardToLeader<NodeId, openraft::BasicNode>,
) -> ApiError {
    ApiError::NotLeader {
        leader: f
            .leader_id
            .zip(f.leader_node.as_ref().map(|n| n.addr.clone())),
    }
}

/// Maps openraft's error for a refused or failed write on replica `id` to the API's error.
pub(crate) fn client_write_error(
    id: NodeId,
    e: RaftError<NodeId, ClientWriteError<NodeId, openraft::BasicNode>>,
) -> ApiError {
    if let Some(f) = e.forward_to_leader() {
        return not_leader(f);
    }
    match e {
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => {
            ApiError::Rejected(Rejection::precondition(c.to_string()))
        }
        RaftError::Fatal(f) => ApiError::Unavailable(format!("replica {id} is stopping: {f}")),
        other => ApiError::Internal(other.to_string()),
    }
}

/// Where a replica's leader timestamps come from. Production reads the wall clock; the
/// deterministic simulation (`dst`) derives them from tokio's (paused, auto-advancing) clock so
/// that the same seed stamps the same times, optionally skewed per replica.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    System,
    Simulated {
        /// Milliseconds since the Unix epoch at `origin`.
        epoch_ms: u64,
        origin: tokio::time::Instant,
        /// This replica's clock error, in ms (may be negative).
        skew_ms: i64,
    },
}

impl Clock {
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System => now_ms(),
            Clock::Simulated {
                epoch_ms,
                origin,
                skew_ms,
            } => {
                let elapsed = origin.elapsed().as_millis() as u64;
                (epoch_ms + elapsed).saturating_add_signed(*skew_ms)
            }
        }
    }
}

impl Replica {
    /// A replica over `raft` and `sm`, stamping with `clock`; starts the task that proposes
    /// queued writes (`group_commit`), so it must be called on a tokio runtime.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: NodeId,
        cluster: String,
        advertise: String,
        raft: Raft,
        sm: StateMachineStore,
        committed: Arc<AtomicU64>,
        clock: Clock,
        transport: Transport,
        security: Arc<Security>,
    ) -> Replica {
        let group_commit = GroupCommit::start(id, raft.clone(), sm.clone(), clock);
        Replica {
            id,
            cluster,
            advertise,
            raft,
            sm,
            committed,
            clock,
            leader_channels: Mutex::new(HashMap::new()),
            group_commit,
            transport,
            security,
            peers: Arc::new(PeerState::default()),
            membership: MembershipSettings::default(),
            membership_busy: Mutex::new(None),
            pending_reasons: std::sync::RwLock::new(None),
            metrics: Arc::new(crate::metrics::ReplicaMetrics::disabled()),
            services: Arc::new(crate::leader::services::ServiceSoftState::default()),
        }
    }

    /// The same replica sharing `peers` with its Raft network and peer service, and changing
    /// membership with `settings`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::ReplicaMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn with_membership(mut self, peers: Arc<PeerState>, settings: MembershipSettings) -> Self {
        self.peers = peers;
        self.membership = settings;
        self
    }

    /// Why this replica no longer serves, once it was removed from the cluster.
    pub fn removed(&self) -> Option<String> {
        self.peers.removed().map(|r| {
            format!(
                "replica {} was removed from cluster {:?} (membership at log index {}; {}); it takes no part in Raft and serves nothing: use another replica. To bring it back, stop it, wipe its data directory and `gpuctl cluster add` it again",
                self.id, self.cluster, r.log_index, r.how
            )
        })
    }

    /// Starts a membership change described by `what`, or refuses while another is under way.
    pub fn begin_membership_change(
        self: &Arc<Self>,
        what: String,
    ) -> Result<MembershipChange, ApiError> {
        let mut busy = self
            .membership_busy
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(other) = busy.as_ref() {
            return Err(ApiError::Rejected(Rejection::precondition(format!(
                "another membership change is under way on leader {} ({other}); retry when it has finished (`gpuctl cluster status` shows the members)",
                self.id
            ))));
        }
        *busy = Some(what);
        Ok(MembershipChange(self.clone()))
    }

    /// This replica's notion of now, in ms since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Publishes the reasons of a scheduling pass (leader only).
    pub fn publish_reasons(&self, board: crate::scheduler::Board) {
        let mut slot = self
            .pending_reasons
            .write()
            .unwrap_or_else(|e| e.into_inner());
        *slot = Some(Arc::new(board));
    }

    /// The reasons of this leader's last pass, if this replica leads in the term that
    /// computed them (a former leader's board is stale, a follower has none).
    pub fn current_reasons(&self) -> Option<Arc<crate::scheduler::Board>> {
        // Copied out: a borrow of the metrics holds their lock, and is never kept while
        // another lock is taken (see `api::route::current_leader_state`).
        let (leader, term) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            (m.current_leader, m.current_term)
        };
        if leader != Some(self.id) {
            return None;
        }
        let board = self
            .pending_reasons
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        (board.term == term).then_some(board)
    }

    pub fn commit_index(&self) -> u64 {
        self.committed.load(Ordering::Relaxed)
    }

    /// Proposes `command` stamped with this (leader's) clock and waits until it is committed
    /// and applied; returns what apply said. Concurrent writes share log entries
    /// (`group_commit`).
    #[tracing::instrument(level = "debug", skip_all, fields(command = command.kind()), name = "raft.write")]
    pub async fn write(&self, command: Command) -> Result<Outcome, ApiError> {
        // Refused before it costs an entry; apply checks again against the state it meets.
        let version = crate::state::format::ClusterVersion(self.sm.cluster_version());
        if let Err(r) = command.check_allowed_at(version) {
            return Err(ApiError::Rejected(r));
        }
        self.group_commit.write(command).await
    }

    /// Waits until this replica has confirmed it is the leader and applied everything committed
    /// before the call, so a read that follows sees every acknowledged write.
    pub async fn linearize(&self) -> Result<(), ApiError> {
        match self.raft.ensure_linearizable().await {
            Ok(_) => Ok(()),
            Err(e) => {
                if let Some(f) = e.forward_to_leader() {
                    return Err(not_leader(f));
                }
                Err(ApiError::Unavailable(format!(
                    "replica {} cannot confirm leadership: {e}",
                    self.id
                )))
            }
        }
    }

    /// The leader this replica knows of, with its address.
    pub fn leader(&self) -> Option<(NodeId, String)> {
        // Read in place: every write asks (`route::forward_if_follower`), and cloning the
        // metrics would copy the membership's maps each time.
        let metrics = self.raft.metrics();
        let m = metrics.borrow();
        let leader = m.current_leader?;
        let addr = m
            .membership_config
            .membership()
            .get_node(&leader)
            .map(|n| n.addr.clone())?;
        Some((leader, addr))
    }

    /// Fails with `NotLeader` unless this replica is the leader (for membership changes).
    pub fn require_leader(&self) -> Result<(), ApiError> {
        match self.leader() {
            Some((id, _)) if id == self.id => Ok(()),
            leader => Err(ApiError::NotLeader { leader }),
        }
    }

    pub fn leader_channel(&self, addr: &str) -> Result<Channel, ApiError> {
        let mut channels = self
            .leader_channels
            .lock()
            .expect("channel cache lock poisoned");
        if let Some(c) = channels.get(addr) {
            return Ok(c.clone());
        }
        let channel = self
            .transport
            .channel(addr, ExpectedPeer::Replica)
            .map_err(|e| ApiError::Internal(format!("leader address {addr:?} is invalid: {e}")))?;
        channels.insert(addr.to_owned(), channel.clone());
        Ok(channel)
    }

    /// Waits (bounded) until some leader is known; used at start-up and by membership calls.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Option<NodeId> {
        let mut rx = self.raft.metrics();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(l) = rx.borrow().current_leader {
                return Some(l);
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return None;
            }
        }
    }
}
