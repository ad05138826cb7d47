//! Backups of the replicated state, as etcd offers them: `gpuctl cluster snapshot save`
//! asks the leader for a consistent copy of its applied state and writes it to a file;
//! `gpuctl cluster snapshot restore` seeds fresh replica data directories from that file with a
//! new membership, offline.
//!
//! - `file`: the backup file's layout, written atomically and read back checked.
//! - `restore`: a new replica data directory from a backup.
//!
//! The state's bytes are those a Raft snapshot stores (`raft::state_machine::encode_state`),
//! so a backup holds everything the replicated state does: jobs, nodes, allocations, tenants,
//! partitions, token hashes and the audit trail.

pub mod file;
pub mod restore;

use openraft::{BasicNode, StoredMembership};
use proto::v1 as pb;
use serde::{Deserialize, Serialize};

use crate::raft::{LogId, NodeId};
use crate::state::ClusterState;

/// How much of each kind of record a backup holds (shown by `inspect` without decoding it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub jobs: u64,
    pub archived_jobs: u64,
    pub nodes: u64,
    pub tenants: u64,
    pub partitions: u64,
    pub tokens: u64,
    pub audit_records: u64,
    /// The last job id handed out: a restored cluster's next job gets a higher one.
    pub last_job_id: u64,
}

impl Counts {
    pub fn of(cluster: &ClusterState) -> Counts {
        Counts {
            jobs: cluster.jobs.len() as u64,
            archived_jobs: cluster.archived.len() as u64,
            nodes: cluster.nodes.len() as u64,
            tenants: cluster.tenants.len() as u64,
            partitions: cluster.partitions.len() as u64,
            tokens: cluster.tokens.len() as u64,
            audit_records: cluster.audit.len() as u64,
            last_job_id: cluster.last_job_id,
        }
    }
}

/// What a backup is: the cluster and the log entry it was copied at, the membership then,
/// and the length and SHA-256 of the state's bytes. Stored as JSON at the head of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupHeader {
    pub cluster: String,
    /// The replica that made the copy (the leader then).
    pub replica_id: u64,
    pub made_at_ms: u64,
    pub last_applied: LogId,
    pub membership: StoredMembership<NodeId, BasicNode>,
    pub state_bytes: u64,
    /// SHA-256 of the state's bytes, lowercase hex.
    pub state_sha256: String,
    pub counts: Counts,
}

impl BackupHeader {
    /// The first message of a `SaveSnapshot` stream.
    pub fn to_info(&self) -> pb::SnapshotInfo {
        let c = &self.counts;
        pb::SnapshotInfo {
            cluster: self.cluster.clone(),
            replica_id: self.replica_id,
            last_applied_json: serde_json::to_string(&self.last_applied)
                .expect("a log id always serializes"),
            last_applied_index: self.last_applied.index,
            membership_json: serde_json::to_string(&self.membership)
                .expect("a membership always serializes"),
            state_bytes: self.state_bytes,
            state_sha256: self.state_sha256.clone(),
            made_at_ms: self.made_at_ms,
            jobs: c.jobs,
            archived_jobs: c.archived_jobs,
            nodes: c.nodes,
            tenants: c.tenants,
            partitions: c.partitions,
            tokens: c.tokens,
            audit_records: c.audit_records,
            last_job_id: c.last_job_id,
        }
    }

    /// The header described by a `SaveSnapshot` stream's first message.
    pub fn from_info(info: &pb::SnapshotInfo) -> Result<BackupHeader, String> {
        let last_applied = serde_json::from_str(&info.last_applied_json)
            .map_err(|e| format!("the replica sent a log id that does not decode: {e}"))?;
        let membership = serde_json::from_str(&info.membership_json)
            .map_err(|e| format!("the replica sent a membership that does not decode: {e}"))?;
        if info.state_sha256.len() != 64 {
            return Err(format!(
                "the replica sent a checksum of {} characters, not a SHA-256",
                info.state_sha256.len()
            ));
        }
        Ok(BackupHeader {
            cluster: info.cluster.clone(),
            replica_id: info.replica_id,
            made_at_ms: info.made_at_ms,
            last_applied,
            membership,
            state_bytes: info.state_bytes,
            state_sha256: info.state_sha256.clone(),
            counts: Counts {
                jobs: info.jobs,
                archived_jobs: info.archived_jobs,
                nodes: info.nodes,
                tenants: info.tenants,
                partitions: info.partitions,
                tokens: info.tokens,
                audit_records: info.audit_records,
                last_job_id: info.last_job_id,
            },
        })
    }
}

/// SHA-256 in lowercase hex.
pub fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}
