//! Incoming Raft RPCs: decodes the envelope, refuses other clusters, hands the request to the
//! local openraft instance and encodes its result (success or Raft error) back as JSON.
//!
//! Two checks of its own, for membership: a vote request from a replica that this replica's
//! committed membership no longer has, and whose log does not reach that membership, is
//! refused before Raft sees it (no term is raised) with `REMOVED_AT_HEADER`, which tells the
//! candidate it was removed; and `NotifyRemoved`, the leader telling a replica just that.
//! Every call is recorded as contact with the caller (`PeerState`).

use std::sync::Arc;

use proto::raft::RaftMessage;
use proto::raft::raft_peer_server::RaftPeer;
use proto::tls::ConnInfo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Request, Response, Status};

use super::peers::{PeerBinary, PeerState, REMOVED_AT_HEADER, Removal, RemovedNotice};
use super::{NodeId, Raft};
use crate::api::auth::{Security, require_replica_peer};
use crate::state::format;

/// An AppendEntries that takes this long to handle is logged (the leader's timeout for it is
/// one heartbeat interval, 40 ms by default).
const SLOW_APPEND: std::time::Duration = std::time::Duration::from_millis(20);

pub struct PeerService {
    pub id: NodeId,
    pub cluster: String,
    pub raft: Raft,
    /// Only replica certificates may call (when security is on).
    pub security: Arc<Security>,
    pub peers: Arc<PeerState>,
}

impl PeerService {
    fn decode<T: DeserializeOwned>(&self, request: &Request<RaftMessage>) -> Result<T, Status> {
        require_replica_peer(&self.security, request.extensions().get::<ConnInfo>())
            .map_err(Status::permission_denied)?;
        let msg = request.get_ref();
        if msg.cluster != self.cluster {
            return Err(Status::failed_precondition(format!(
                "this replica belongs to cluster {:?}, the caller to {:?}",
                self.cluster, msg.cluster
            )));
        }
        serde_json::from_slice(&msg.payload).map_err(|e| {
            // Most often an entry or snapshot from a newer release (the error says so): the
            // leader keeps retrying, so say it here once per call, where the operator looks.
            tracing::warn!(
                sender_release = %PeerBinary::from_message(msg.format_max, &msg.release).release_text(),
                "refused a Raft message this binary cannot decode: {e}"
            );
            Status::failed_precondition(format!(
                "replica {} (release {}) cannot decode this Raft message: {e}",
                self.id,
                format::RELEASE
            ))
        })
    }

    fn encode<T: Serialize>(&self, result: &T) -> Result<Response<RaftMessage>, Status> {
        let payload = serde_json::to_vec(result)
            .map_err(|e| Status::internal(format!("encoding Raft response: {e}")))?;
        Ok(Response::new(RaftMessage {
            cluster: self.cluster.clone(),
            payload,
            format_max: format::CURRENT,
            release: format::RELEASE.to_owned(),
        }))
    }

    /// The refusal for a vote request from `candidate`, when this replica's committed
    /// membership does not have it and the candidate's log stops before that membership: the
    /// candidate was removed while it was away (a candidate that is a member again holds the
    /// newer membership entry that says so, so its log reaches past this one).
    fn removed_candidate(
        &self,
        candidate: NodeId,
        last_log_id: Option<super::LogId>,
    ) -> Option<Status> {
        let m = self.raft.metrics().borrow().clone();
        let log_id = (*m.membership_config.log_id())?;
        let membership = m.membership_config.membership();
        let committed = m.last_applied.is_some_and(|a| a.index >= log_id.index);
        if !committed || membership.get_node(&candidate).is_some() || last_log_id >= Some(log_id) {
            return None;
        }
        let voters: Vec<NodeId> = membership.voter_ids().collect();
        let mut status = Status::failed_precondition(format!(
            "replica {candidate} is not a member of cluster {:?}: the membership committed at log index {} (voters {voters:?}) does not include it, so replica {} refuses its vote request. It was removed; it must not campaign. To bring it back, stop it, wipe its data directory and `gpuctl cluster add` it again",
            self.cluster, log_id.index, self.id
        ));
        status.metadata_mut().insert(
            REMOVED_AT_HEADER,
            log_id
                .index
                .to_string()
                .parse()
                .expect("a decimal number is valid metadata"),
        );
        Some(status)
    }
}

#[tonic::async_trait]
impl RaftPeer for PeerService {
    async fn append_entries(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let received = std::time::Instant::now();
        let req: openraft::raft::AppendEntriesRequest<super::TypeConfig> = self.decode(&request)?;
        if let Some(leader) = req.vote.leader_id().voted_for() {
            self.peers.heard_from(leader);
            let msg = request.get_ref();
            self.peers.report_binary(
                leader,
                PeerBinary::from_message(msg.format_max, &msg.release),
            );
        }
        let entries = req.entries.len();
        let result = self.raft.append_entries(req).await;
        let took = received.elapsed();
        if took >= SLOW_APPEND {
            // Every write waiting on this follower waits this long too; past the leader's
            // AppendEntries timeout it gives up and resends the batch.
            tracing::info!(
                took_ms = took.as_millis() as u64,
                entries,
                "slow AppendEntries: this replica took this long to accept the leader's entries"
            );
        }
        self.encode(&result)
    }

    async fn vote(&self, request: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let req: openraft::raft::VoteRequest<NodeId> = self.decode(&request)?;
        if let Some(candidate) = req.vote.leader_id().voted_for() {
            if let Some(refusal) = self.removed_candidate(candidate, req.last_log_id) {
                tracing::info!(
                    candidate,
                    "refused a vote request from a replica that is no longer a member"
                );
                return Err(refusal);
            }
            self.peers.heard_from(candidate);
        }
        let result = self.raft.vote(req).await;
        self.encode(&result)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let req: openraft::raft::InstallSnapshotRequest<super::TypeConfig> =
            self.decode(&request)?;
        if let Some(leader) = req.vote.leader_id().voted_for() {
            self.peers.heard_from(leader);
        }
        let (received, done, bytes) = (std::time::Instant::now(), req.done, req.offset);
        let result = self.raft.install_snapshot(req).await;
        if done {
            // The last chunk's answer waits for the whole state to be decoded, checked and
            // stored; the leader waits `Defaults::INSTALL_SNAPSHOT_TIMEOUT_MS` for it.
            tracing::info!(
                took_ms = received.elapsed().as_millis() as u64,
                offset = bytes,
                ok = result.is_ok(),
                "received the last chunk of a snapshot"
            );
        }
        self.encode(&result)
    }

    async fn notify_removed(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let notice: RemovedNotice = self.decode(&request)?;
        if notice.id != self.id {
            return Err(Status::invalid_argument(format!(
                "this is replica {}, not replica {}",
                self.id, notice.id
            )));
        }
        self.peers.report_removal(Removal {
            log_index: notice.log_index,
            how: format!(
                "leader {} removed it from the membership at log index {}",
                notice.by, notice.log_index
            ),
        });
        self.encode(&())
    }
}
