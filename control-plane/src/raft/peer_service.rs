//! Incoming Raft RPCs: decodes the envelope, refuses other clusters, hands the request to the
//! local openraft instance and encodes its result (success or Raft error) back as JSON.

use std::sync::Arc;

use proto::raft::RaftMessage;
use proto::raft::raft_peer_server::RaftPeer;
use proto::tls::ConnInfo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Request, Response, Status};

use super::Raft;
use crate::api::auth::{Security, require_replica_peer};

/// An AppendEntries that takes this long to handle is logged (the leader's timeout for it is
/// one heartbeat interval, 40 ms by default).
const SLOW_APPEND: std::time::Duration = std::time::Duration::from_millis(20);

pub struct PeerService {
    pub cluster: String,
    pub raft: Raft,
    /// Only replica certificates may call (when security is on).
    pub security: Arc<Security>,
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
        serde_json::from_slice(&msg.payload)
            .map_err(|e| Status::invalid_argument(format!("undecodable Raft payload: {e}")))
    }

    fn encode<T: Serialize>(&self, result: &T) -> Result<Response<RaftMessage>, Status> {
        let payload = serde_json::to_vec(result)
            .map_err(|e| Status::internal(format!("encoding Raft response: {e}")))?;
        Ok(Response::new(RaftMessage {
            cluster: self.cluster.clone(),
            payload,
        }))
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
        let req = self.decode(&request)?;
        let result = self.raft.vote(req).await;
        self.encode(&result)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let req = self.decode(&request)?;
        let result = self.raft.install_snapshot(req).await;
        self.encode(&result)
    }
}
