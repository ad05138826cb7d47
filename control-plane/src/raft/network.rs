//! Outgoing Raft RPCs: one lazily connected tonic channel per peer. Payloads are openraft's
//! types as JSON inside a `RaftMessage` envelope that names the cluster.
//!
//! Error mapping follows openraft's expectations: a connection failure is `Unreachable` (Raft
//! backs off), an error the remote Raft returned is `RemoteError`.
//!
//! Every answer and every failure is recorded in `PeerState` (when each peer last answered);
//! a refused vote request that says this replica was removed is reported there too.

use std::sync::Arc;
use std::time::Duration;

use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use proto::raft::RaftMessage;
use proto::raft::raft_peer_client::RaftPeerClient;
use proto::tls::ExpectedPeer;
use proto::transport::Transport;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::transport::Channel;

use super::peers::{PeerBinary, PeerState, REMOVED_AT_HEADER, Removal};
use super::{NodeId, TypeConfig};
use crate::state::format;

/// Creates clients for peers. Cloned into openraft.
#[derive(Clone)]
pub struct PeerNetwork {
    pub cluster: String,
    /// TLS with this replica's certificate, expecting a replica's at the other end.
    pub transport: Transport,
    /// Where answers and failures are recorded.
    pub peers: Arc<PeerState>,
}

pub struct PeerClient {
    cluster: String,
    target: NodeId,
    addr: String,
    transport: Transport,
    client: Option<RaftPeerClient<Channel>>,
    peers: Arc<PeerState>,
}

pub use proto::transport::lazy_channel;

impl RaftNetworkFactory<TypeConfig> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        PeerClient {
            cluster: self.cluster.clone(),
            target,
            addr: node.addr.clone(),
            transport: self.transport.clone(),
            client: None,
            peers: self.peers.clone(),
        }
    }
}

/// The three peer RPCs; they share one envelope and one error mapping.
#[derive(Clone, Copy)]
enum Rpc {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

impl PeerClient {
    fn client(&mut self) -> Result<RaftPeerClient<Channel>, Unreachable> {
        if self.client.is_none() {
            let channel = self
                .transport
                .channel(&self.addr, ExpectedPeer::Replica)
                .map_err(|e| Unreachable::new(&e))?;
            self.client = Some(
                RaftPeerClient::new(channel)
                    .max_decoding_message_size(256 * 1024 * 1024)
                    .max_encoding_message_size(256 * 1024 * 1024),
            );
        }
        // Set just above.
        Ok(self.client.clone().expect("client was just created"))
    }

    async fn call<Req, Resp, E>(&mut self, rpc: Rpc, req: &Req, ttl: Duration) -> RpcResult<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let payload =
            serde_json::to_vec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut request = tonic::Request::new(RaftMessage {
            cluster: self.cluster.clone(),
            payload,
            format_max: format::CURRENT,
            release: format::RELEASE.to_owned(),
        });
        request.set_timeout(ttl);
        let mut client = match self.client() {
            Ok(c) => c,
            Err(e) => {
                self.peers.failed(self.target, e.to_string());
                return Err(RPCError::Unreachable(e));
            }
        };
        let sent = async {
            match rpc {
                Rpc::AppendEntries => client.append_entries(request).await,
                Rpc::Vote => client.vote(request).await,
                Rpc::InstallSnapshot => client.install_snapshot(request).await,
            }
        };
        // openraft bounds every call by its own timeout; a snapshot chunk other than the last
        // is given a shorter one here (`install_snapshot`).
        let response = if matches!(rpc, Rpc::InstallSnapshot) {
            tokio::time::timeout(ttl, sent).await.unwrap_or_else(|_| {
                Err(tonic::Status::deadline_exceeded(format!(
                    "no answer within {} ms",
                    ttl.as_millis()
                )))
            })
        } else {
            sent.await
        };
        let response = match response {
            Ok(r) => {
                self.peers.heard_from(self.target);
                let r = r.into_inner();
                self.peers.report_binary(
                    self.target,
                    PeerBinary::from_message(r.format_max, &r.release),
                );
                r
            }
            Err(status) => {
                self.peers
                    .failed(self.target, proto::transport::status_text(&status));
                if let Some(index) = status
                    .metadata()
                    .get(REMOVED_AT_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())
                {
                    self.peers.report_removal(Removal {
                        log_index: index,
                        how: format!(
                            "replica {} at {} refused its vote request: {}",
                            self.target,
                            self.addr,
                            status.message()
                        ),
                    });
                }
                return Err(match status.code() {
                    tonic::Code::Unavailable
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::Cancelled => RPCError::Unreachable(Unreachable::new(&status)),
                    _ => RPCError::Network(NetworkError::new(&status)),
                });
            }
        };
        let result: Result<Resp, RaftError<NodeId, E>> = serde_json::from_slice(&response.payload)
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                BasicNode::new(self.addr.clone()),
                e,
            ))
        })
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, openraft::error::Infallible> {
        self.call(Rpc::AppendEntries, &rpc, option.hard_ttl()).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        // The last chunk is answered once the follower has installed the whole state, which
        // openraft's timeout (`INSTALL_SNAPSHOT_TIMEOUT_MS`) allows for; any other chunk gets
        // `SNAPSHOT_CHUNK_TIMEOUT_MS`, and openraft resends it after a failure.
        let (ttl, _installing) = if rpc.done {
            (option.hard_ttl(), Some(self.peers.installing(self.target)))
        } else {
            let chunk = Duration::from_millis(crate::config::Defaults::SNAPSHOT_CHUNK_TIMEOUT_MS);
            (option.hard_ttl().min(chunk), None)
        };
        self.call(Rpc::InstallSnapshot, &rpc, ttl).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, openraft::error::Infallible> {
        self.call(Rpc::Vote, &rpc, option.hard_ttl()).await
    }

    /// After an unreachable peer, retry every 40 ms rather than openraft's default 500 ms. A
    /// replica that restarts must hear from the leader before its own election timer fires
    /// (300–400 ms after start); otherwise, lacking pre-vote in openraft 0.9, it campaigns and
    /// deposes a healthy leader. A refused loopback or LAN connection costs next to nothing.
    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(PEER_RETRY_INTERVAL))
    }
}

const PEER_RETRY_INTERVAL: Duration = Duration::from_millis(40);
