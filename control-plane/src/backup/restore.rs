//! A new replica data directory from a backup (`gpuctl cluster snapshot restore`), offline, as
//! `etcdutl snapshot restore` makes one: the saved state becomes the directory's snapshot, with
//! the membership given on the command line in place of the saved one. Run once per replica
//! with the same backup and members; started on those directories, the replicas form a cluster
//! that holds everything the saved one held at the saved log entry.
//!
//! Everything that can be checked is checked before anything is written: the members, the
//! directory (missing or empty), the file (format, length, checksums) and the state itself
//! (it decodes and is consistent, as a replica checks its snapshot on start).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use openraft::storage::RaftLogStorage;
use openraft::{BasicNode, Membership, StoredMembership, Vote};

use super::BackupHeader;
use super::file::{BackupFile, BackupFileError};
use crate::datadir::{DataDir, DataDirError, is_empty_dir};
use crate::raft::NodeId;
use crate::raft::log_store::LogStore;
use crate::raft::state_machine::{decode_checked_state, seed_snapshot};

/// What to restore, and where.
pub struct RestoreRequest<'a> {
    pub backup: &'a Path,
    pub data_dir: &'a Path,
    pub replica_id: NodeId,
    pub cluster: &'a str,
    /// The new cluster's voters: id → address.
    pub members: &'a BTreeMap<NodeId, String>,
}

/// What a restore wrote.
#[derive(Debug)]
pub struct Restored {
    pub header: BackupHeader,
    pub data_dir: PathBuf,
    /// Length of the snapshot stored in the new directory.
    pub snapshot_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(
        "replica {id} is not in --members ({}); give the id of one of the new members",
        .members.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(", ")
    )]
    NotAMember { id: NodeId, members: Vec<NodeId> },
    #[error("--members is empty; give the new cluster's replicas as ID=HOST:PORT,...")]
    NoMembers,
    #[error(transparent)]
    File(#[from] BackupFileError),
    #[error("{path} holds a state a replica would refuse: {detail}; use another backup")]
    BadState { path: PathBuf, detail: String },
    #[error(transparent)]
    DataDir(#[from] DataDirError),
}

/// Checks everything, then writes the new data directory (see the module's header). On any
/// refusal nothing has been written.
pub fn restore(req: &RestoreRequest<'_>) -> Result<Restored, RestoreError> {
    if req.members.is_empty() {
        return Err(RestoreError::NoMembers);
    }
    if !req.members.contains_key(&req.replica_id) {
        return Err(RestoreError::NotAMember {
            id: req.replica_id,
            members: req.members.keys().copied().collect(),
        });
    }
    // Checked here as well as when creating it: a full directory is refused before the
    // (possibly long) read of the file.
    if req.data_dir.exists() && !is_empty_dir(req.data_dir) {
        return Err(DataDirError::NotEmpty {
            path: req.data_dir.to_owned(),
        }
        .into());
    }
    let mut file = BackupFile::open(req.backup)?;
    file.verify()?;
    let bad_state = |detail: String| RestoreError::BadState {
        path: req.backup.to_owned(),
        detail,
    };
    let state = file.state().map_err(|e| BackupFileError::Io {
        path: req.backup.to_owned(),
        source: e,
    })?;
    let mut data = decode_checked_state(state, "the backup").map_err(bad_state)?;
    let header = file.header.clone();
    if data.last_applied != Some(header.last_applied) {
        return Err(bad_state(format!(
            "its state was applied up to {:?}, and its header says {}",
            data.last_applied, header.last_applied
        )));
    }
    // The new members replace the saved ones, as of the saved entry: no log entry follows it,
    // so this is the membership each restored replica starts with.
    let voters: BTreeSet<NodeId> = req.members.keys().copied().collect();
    let nodes: BTreeMap<NodeId, BasicNode> = req
        .members
        .iter()
        .map(|(id, addr)| (*id, BasicNode::new(addr.clone())))
        .collect();
    data.last_membership = StoredMembership::new(
        Some(header.last_applied),
        Membership::new(vec![voters], nodes),
    );
    // A vote at the saved entry's term: the first election is then at a higher term, so the
    // new leader's entries order after the saved ones (openraft orders log ids by term first).
    let vote = Vote::new(header.last_applied.leader_id.term, req.replica_id);
    let mut snapshot_bytes = 0;
    DataDir::create_seeded(req.data_dir, req.cluster, req.replica_id, |db| {
        snapshot_bytes = seed_snapshot(db, data)?;
        save_vote(db, vote)
    })?;
    Ok(Restored {
        header,
        data_dir: req.data_dir.to_owned(),
        snapshot_bytes,
    })
}

/// Stores `vote` through the Raft log store, as openraft would.
fn save_vote(db: &sled::Db, vote: Vote<NodeId>) -> Result<(), String> {
    let mut log = LogStore::open(db).map_err(|e| format!("opening the Raft log: {e}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("starting a runtime to write the vote: {e}"))?;
    runtime
        .block_on(log.save_vote(&vote))
        .map_err(|e| format!("writing the vote: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup::file::BackupWriter;
    use crate::backup::{Counts, hex};
    use crate::raft::state_machine::{StateMachineData, StateMachineStore};
    use crate::state::{ClusterState, Command, JobSpec};

    /// A backup of a state with three jobs, applied up to index 7 of term 4.
    fn backup(dir: &Path, state: Option<&[u8]>) -> PathBuf {
        let mut cluster = ClusterState::default();
        for i in 1..=3u64 {
            let spec = JobSpec {
                tenant: "t".into(),
                name: format!("j{i}"),
                command: vec!["true".into()],
                tasks: 1,
                gpus_per_task: 1,
                priority_class: "normal".into(),
                ..Default::default()
            };
            let applied = cluster.apply(&Command::submit(spec, Some(format!("k{i}"))), i, i);
            assert!(
                !matches!(applied.outcome, crate::state::Outcome::Rejected(_)),
                "{:?}",
                applied.outcome
            );
        }
        let last_applied = openraft::LogId::new(openraft::CommittedLeaderId::new(4, 1), 7);
        let old_members: BTreeMap<NodeId, BasicNode> =
            [(1, BasicNode::new("old:1"))].into_iter().collect();
        let data = StateMachineData {
            last_applied: Some(last_applied),
            last_membership: StoredMembership::new(
                Some(last_applied),
                Membership::new(vec![[1].into_iter().collect()], old_members),
            ),
            cluster,
        };
        let good = serde_json::to_vec(&data).unwrap();
        let state = state.unwrap_or(&good);
        let header = BackupHeader {
            cluster: "old".into(),
            replica_id: 1,
            made_at_ms: 1,
            last_applied,
            membership: data.last_membership.clone(),
            state_bytes: state.len() as u64,
            state_sha256: hex(ring::digest::digest(&ring::digest::SHA256, state).as_ref()),
            counts: Counts::of(&data.cluster),
        };
        let path = dir.join("b.backup");
        let mut w = BackupWriter::create(&path, header).unwrap();
        w.write_state(state).unwrap();
        w.finish().unwrap()
    }

    fn members() -> BTreeMap<NodeId, String> {
        [(1, "new-1:7001"), (2, "new-2:7001"), (3, "new-3:7001")]
            .into_iter()
            .map(|(i, a)| (i, a.to_owned()))
            .collect()
    }

    #[test]
    fn a_restored_directory_starts_from_the_saved_state_with_the_new_members() {
        let dir = tempfile::tempdir().unwrap();
        let file = backup(dir.path(), None);
        let data_dir = dir.path().join("replica-2");
        let members = members();
        let restored = restore(&RestoreRequest {
            backup: &file,
            data_dir: &data_dir,
            replica_id: 2,
            cluster: "new",
            members: &members,
        })
        .unwrap();
        assert_eq!(restored.header.last_applied.index, 7);

        // What a replica opens on start: the identity, the snapshot, the vote.
        let opened = DataDir::open(&data_dir, "new", 2).unwrap();
        assert!(!opened.fresh, "a restored replica must not bootstrap");
        let sm = StateMachineStore::open(&opened.db).unwrap();
        let data = sm.read();
        assert_eq!(data.last_applied, Some(restored.header.last_applied));
        assert_eq!(data.cluster.jobs.len(), 3);
        assert_eq!(data.cluster.last_job_id, 3);
        let nodes: Vec<(NodeId, String)> = data
            .last_membership
            .membership()
            .nodes()
            .map(|(id, n)| (*id, n.addr.clone()))
            .collect();
        assert_eq!(nodes, members.into_iter().collect::<Vec<_>>());
        let mut log = LogStore::open(&opened.db).unwrap();
        let vote = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(log.read_vote())
            .unwrap();
        assert_eq!(vote, Some(Vote::new(4, 2)));
    }

    #[test]
    fn a_state_that_checksums_but_does_not_decode_is_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let file = backup(dir.path(), Some(b"{\"last_applied\": 12"));
        let data_dir = dir.path().join("replica-1");
        let err = restore(&RestoreRequest {
            backup: &file,
            data_dir: &data_dir,
            replica_id: 1,
            cluster: "new",
            members: &members(),
        })
        .unwrap_err();
        assert!(
            err.to_string().contains(
                "holds a state a replica would refuse: the backup's state does not decode"
            ),
            "{err}"
        );
        assert!(!data_dir.exists());
    }
}
