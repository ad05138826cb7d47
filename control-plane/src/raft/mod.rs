//! openraft wiring: the type configuration, the sled-backed log store and state machine, and
//! the peer network over tonic.
//!
//! - `log_store`: the Raft log, vote and commit index in sled; an append is acknowledged only
//!   after sled has flushed it to disk.
//! - `state_machine`: the in-memory `ClusterState` behind a lock, applied from the log, with
//!   snapshots persisted in sled so a restart starts from the last snapshot.
//! - `network` / `peer_service`: Raft RPCs between replicas as tonic calls.
//! - `peers`: when each peer last answered, and whether this replica was removed.

// openraft's StorageError is large by design; boxing it at every call would only add noise.
#![allow(clippy::result_large_err)]

pub mod log_store;
pub mod network;
pub mod peer_service;
pub mod peers;
pub mod snapshot_store;
pub mod state_codec;
pub mod state_machine;
#[cfg(test)]
mod store_suite;

use std::sync::Arc;

use crate::state::{Outcome, Request};

pub type NodeId = u64;

/// A log entry's `Request` as openraft carries it: shared, so that the log's tail cache
/// (`log_store`), replication to each follower and the apply pass hand one decoded copy around
/// instead of each decoding the entry again from sled or deep-copying it. Encoded exactly as
/// the `Request` it holds: the log's format does not change.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedRequest(pub Arc<Request>);

impl std::ops::Deref for SharedRequest {
    type Target = Request;

    fn deref(&self) -> &Request {
        &self.0
    }
}

impl From<Request> for SharedRequest {
    fn from(r: Request) -> Self {
        SharedRequest(Arc::new(r))
    }
}

impl serde::Serialize for SharedRequest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for SharedRequest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Request::deserialize(d).map(SharedRequest::from)
    }
}

openraft::declare_raft_types!(
    /// Raft types of the control plane: entries carry a stamped `Command`, responses an `Outcome`.
    pub TypeConfig:
        D = SharedRequest,
        R = Outcome,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = snapshot_store::SnapshotData,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type RaftMetrics = openraft::RaftMetrics<NodeId, openraft::BasicNode>;
pub type LogId = openraft::LogId<NodeId>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type Entry = openraft::Entry<TypeConfig>;

/// Raft timing and log-compaction settings (every default lives in `config.rs`).
#[derive(Debug, Clone)]
pub struct RaftTuning {
    pub heartbeat_ms: u64,
    pub election_min_ms: u64,
    pub election_max_ms: u64,
    /// Build a snapshot after this many entries since the last one.
    pub snapshot_every: u64,
    /// Entries kept behind a snapshot, so a briefly lagging follower needs no snapshot.
    pub keep_behind_snapshot: u64,
}

impl RaftTuning {
    pub fn openraft_config(&self, cluster: &str) -> anyhow::Result<openraft::Config> {
        let config = openraft::Config {
            cluster_name: cluster.to_owned(),
            heartbeat_interval: self.heartbeat_ms,
            election_timeout_min: self.election_min_ms,
            election_timeout_max: self.election_max_ms,
            // A quarter of the heartbeat: openraft's own tick (1.5 heartbeats, 60 ms) added up
            // to 60 ms to every failover, since an election starts only at the first tick after
            // the timeout, and stretched the 40 ms heartbeat to 60 ms.
            tick_interval: (self.heartbeat_ms / 4).max(1),
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(self.snapshot_every),
            max_in_snapshot_log_to_keep: self.keep_behind_snapshot,
            max_payload_entries: crate::config::Defaults::MAX_ENTRIES_PER_APPEND,
            append_entries_timeout: crate::config::Defaults::APPEND_ENTRIES_TIMEOUT_MS,
            install_snapshot_timeout: crate::config::Defaults::INSTALL_SNAPSHOT_TIMEOUT_MS,
            ..Default::default()
        };
        Ok(config.validate()?)
    }
}
