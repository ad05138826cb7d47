//! The Raft state machine: `ClusterState` in memory behind a lock, applied from committed
//! entries, with the latest snapshot persisted in sled. A restarted replica loads that snapshot
//! and openraft re-applies the committed entries after it.
//!
//! Readers (the API) take the lock briefly and never across an `.await`. Every applied change
//! to a job is also published on a broadcast channel for `WatchJobs`.

use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, EntryPayload, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};

use super::{Entry, LogId, NodeId, StorageError, TypeConfig};
use crate::state::{ClusterState, Job, Outcome};

const SNAPSHOT_KEY: &str = "current";
/// How many job changes a slow watcher may fall behind before it is told to re-list.
const EVENT_BUFFER: usize = 16 * 1024;

/// Everything a snapshot holds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StateMachineData {
    pub last_applied: Option<LogId>,
    pub last_membership: StoredMembership<NodeId, BasicNode>,
    pub cluster: ClusterState,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

/// First bytes of a stored snapshot in the current format: this tag, the length of the meta's
/// JSON (u32, little endian), the meta's JSON, then the state's JSON as it is. The first format
/// was `StoredSnapshot` as one JSON object, whose `data` became an array of numbers (about 3.6
/// bytes of text per byte: a million finished jobs made a snapshot of gigabytes); it starts
/// with `{` and is still read.
const SNAPSHOT_FORMAT_V2: &[u8; 8] = b"GPUCPSN2";

impl StoredSnapshot {
    fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        let meta = serde_json::to_vec(&self.meta)?;
        let meta_len = u32::try_from(meta.len()).expect("snapshot meta under 4 GiB");
        let mut out =
            Vec::with_capacity(SNAPSHOT_FORMAT_V2.len() + 4 + meta.len() + self.data.len());
        out.extend_from_slice(SNAPSHOT_FORMAT_V2);
        out.extend_from_slice(&meta_len.to_le_bytes());
        out.extend_from_slice(&meta);
        out.extend_from_slice(&self.data);
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<StoredSnapshot, String> {
        let Some(rest) = bytes.strip_prefix(SNAPSHOT_FORMAT_V2.as_slice()) else {
            return serde_json::from_slice(bytes).map_err(|e| e.to_string());
        };
        let (len, rest) = rest
            .split_first_chunk::<4>()
            .ok_or("the snapshot ends inside its header")?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err("the snapshot ends inside its meta".into());
        }
        let (meta, data) = rest.split_at(len);
        Ok(StoredSnapshot {
            meta: serde_json::from_slice(meta).map_err(|e| format!("its meta: {e}"))?,
            data: data.to_vec(),
        })
    }
}

/// A job as it was right after a log entry changed it.
#[derive(Debug, Clone)]
pub struct JobEvent {
    pub job: Job,
    pub log_index: u64,
}

/// Where the latest snapshot is kept: sled in production; a shared in-memory slot in the
/// deterministic simulation, where it outlives a simulated crash as a disk would.
#[derive(Clone)]
pub enum SnapshotStore {
    Sled(sled::Tree),
    Memory(Arc<std::sync::Mutex<Option<Vec<u8>>>>),
}

impl SnapshotStore {
    fn get(&self) -> Result<Option<Vec<u8>>, String> {
        match self {
            SnapshotStore::Sled(tree) => tree
                .get(SNAPSHOT_KEY)
                .map(|v| v.map(|b| b.to_vec()))
                .map_err(|e| e.to_string()),
            SnapshotStore::Memory(slot) => Ok(slot.lock().expect("snapshot slot poisoned").clone()),
        }
    }

    fn put(&self, bytes: Vec<u8>) -> Result<(), String> {
        match self {
            SnapshotStore::Sled(tree) => {
                tree.insert(SNAPSHOT_KEY, bytes)
                    .map_err(|e| e.to_string())?;
                tree.flush().map_err(|e| e.to_string())?;
                Ok(())
            }
            SnapshotStore::Memory(slot) => {
                *slot.lock().expect("snapshot slot poisoned") = Some(bytes);
                Ok(())
            }
        }
    }
}

struct Shared {
    data: RwLock<StateMachineData>,
    snapshots: SnapshotStore,
    events: broadcast::Sender<JobEvent>,
    /// Last applied log index, for loops that react to any change (scheduling, assignments).
    applied: watch::Sender<u64>,
    snapshot_seq: AtomicU64,
}

/// Cheap to clone: every clone shares the same state.
#[derive(Clone)]
pub struct StateMachineStore {
    shared: Arc<Shared>,
}

impl StateMachineStore {
    /// Opens the state machine, loading the persisted snapshot if there is one. A snapshot
    /// that does not decode is an error: the replica must not start with empty state.
    pub fn open(db: &sled::Db) -> Result<StateMachineStore, String> {
        let snapshots = db
            .open_tree("snapshot")
            .map_err(|e| format!("opening the snapshot tree: {e}"))?;
        Self::open_with(SnapshotStore::Sled(snapshots))
    }

    /// Opens the state machine over any snapshot store, loading its snapshot if there is one.
    pub fn open_with(snapshots: SnapshotStore) -> Result<StateMachineStore, String> {
        let mut data = StateMachineData::default();
        if let Some(bytes) = snapshots
            .get()
            .map_err(|e| format!("reading the snapshot: {e}"))?
        {
            let stored = StoredSnapshot::decode(&bytes)
                .map_err(|e| format!("the stored snapshot does not decode: {e}"))?;
            data = serde_json::from_slice(&stored.data)
                .map_err(|e| format!("the stored snapshot's state does not decode: {e}"))?;
            data.cluster.rebuild_indexes();
            data.cluster
                .check_consistency()
                .map_err(|e| format!("the stored snapshot is inconsistent: {e}"))?;
        }
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let (applied, _) = watch::channel(data.last_applied.map(|l| l.index).unwrap_or(0));
        Ok(StateMachineStore {
            shared: Arc::new(Shared {
                data: RwLock::new(data),
                snapshots,
                events,
                applied,
                snapshot_seq: AtomicU64::new(0),
            }),
        })
    }

    /// Read access to the applied state. Keep the guard short and never hold it across `.await`.
    pub fn read(&self) -> RwLockReadGuard<'_, StateMachineData> {
        // A poisoned lock means an apply panicked half-way; the state cannot be trusted.
        self.shared
            .data
            .read()
            .expect("state machine lock poisoned")
    }

    pub fn subscribe(&self) -> broadcast::Receiver<JobEvent> {
        self.shared.events.subscribe()
    }

    /// Changes whenever entries are applied (the value is the last applied index).
    pub fn watch_applied(&self) -> watch::Receiver<u64> {
        self.shared.applied.subscribe()
    }

    fn write_snapshot(&self, stored: &StoredSnapshot) -> Result<(), StorageError> {
        let bytes = stored
            .encode()
            .map_err(|e| StorageIOError::write_snapshot(Some(stored.meta.signature()), &e))?;
        self.shared.snapshots.put(bytes).map_err(|e| {
            StorageIOError::write_snapshot(Some(stored.meta.signature()), &std::io::Error::other(e))
        })?;
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    #[tracing::instrument(level = "info", skip_all, name = "raft.build_snapshot")]
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Serialize under the read lock: applies wait, readers do not.
        let (bytes, last_applied, last_membership) = {
            let data = self.read();
            let bytes =
                serde_json::to_vec(&*data).map_err(|e| StorageIOError::read_state_machine(&e))?;
            (bytes, data.last_applied, data.last_membership.clone())
        };
        let seq = self.shared.snapshot_seq.fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{seq}", l.leader_id, l.index),
            None => format!("--{seq}"),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership,
            snapshot_id,
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: bytes,
        };
        self.write_snapshot(&stored)?;
        tracing::info!(bytes = stored.data.len(), index = ?last_applied.map(|l| l.index), "snapshot built");
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let data = self.read();
        Ok((data.last_applied, data.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        let mut events = Vec::new();
        let mut replies_last_index = None;
        {
            let mut data = self
                .shared
                .data
                .write()
                .expect("state machine lock poisoned");
            for entry in entries {
                data.last_applied = Some(entry.log_id);
                let index = entry.log_id.index;
                replies_last_index = Some(index);
                match entry.payload {
                    EntryPayload::Blank => replies.push(Outcome::Done),
                    EntryPayload::Normal(request) => {
                        let span = tracing::debug_span!(
                            "raft.apply",
                            index,
                            command = request.command.kind()
                        );
                        let _enter = span.enter();
                        let applied = data.cluster.apply(&request.command, request.at, index);
                        for id in applied.changed_jobs {
                            if let Some(job) = data.cluster.jobs.get(&id) {
                                events.push(JobEvent {
                                    job: job.clone(),
                                    log_index: index,
                                });
                            }
                        }
                        replies.push(applied.outcome);
                    }
                    EntryPayload::Membership(m) => {
                        data.last_membership = StoredMembership::new(Some(entry.log_id), m);
                        replies.push(Outcome::Done);
                    }
                }
            }
        }
        if let Some(last) = replies_last_index {
            self.shared.applied.send_replace(last);
        }
        if self.shared.events.receiver_count() > 0 {
            for e in events {
                // An error only means every watcher has gone away.
                let _ = self.shared.events.send(e);
            }
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    #[tracing::instrument(level = "info", skip_all, name = "raft.install_snapshot")]
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let bytes = snapshot.into_inner();
        let mut new_data: StateMachineData = serde_json::from_slice(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        new_data.cluster.rebuild_indexes();
        if let Err(e) = new_data.cluster.check_consistency() {
            return Err(StorageIOError::read_snapshot(
                Some(meta.signature()),
                &std::io::Error::other(format!("received snapshot is inconsistent: {e}")),
            )
            .into());
        }
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: bytes,
        };
        self.write_snapshot(&stored)?;
        let jobs: Vec<Job> = new_data.cluster.jobs.values().cloned().collect();
        let index = meta.last_log_id.map(|l| l.index).unwrap_or(0);
        *self
            .shared
            .data
            .write()
            .expect("state machine lock poisoned") = new_data;
        tracing::info!(index, "snapshot installed");
        self.shared.applied.send_replace(index);
        if self.shared.events.receiver_count() > 0 {
            for job in jobs {
                let _ = self.shared.events.send(JobEvent {
                    job,
                    log_index: index,
                });
            }
        }
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let Some(bytes) = self
            .shared
            .snapshots
            .get()
            .map_err(|e| StorageIOError::read_snapshot(None, &std::io::Error::other(e)))?
        else {
            return Ok(None);
        };
        let stored = StoredSnapshot::decode(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(None, &std::io::Error::other(e)))?;
        Ok(Some(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(cluster: ClusterState) -> StoredSnapshot {
        let data = StateMachineData {
            cluster,
            ..Default::default()
        };
        StoredSnapshot {
            meta: SnapshotMeta::default(),
            data: serde_json::to_vec(&data).unwrap(),
        }
    }

    fn cluster_with_a_job() -> ClusterState {
        let mut cluster = ClusterState::default();
        let spec = crate::state::JobSpec {
            tenant: "t".into(),
            name: "j".into(),
            command: vec!["true".into()],
            tasks: 1,
            priority_class: "normal".into(),
            ..Default::default()
        };
        cluster.apply(&crate::state::Command::submit(spec, Some("k".into())), 1, 1);
        cluster
    }

    #[test]
    fn a_snapshot_round_trips_in_the_current_format_and_is_not_json_numbers() {
        let s = stored(cluster_with_a_job());
        let bytes = s.encode().unwrap();
        assert!(bytes.starts_with(SNAPSHOT_FORMAT_V2));
        assert!(bytes.len() < s.data.len() + 1024, "{} bytes", bytes.len());
        let back = StoredSnapshot::decode(&bytes).unwrap();
        assert_eq!(back.data, s.data);
        assert_eq!(back.meta, s.meta);
    }

    #[test]
    fn a_snapshot_in_the_first_format_still_loads() {
        let cluster = cluster_with_a_job();
        let old = serde_json::to_vec(&stored(cluster.clone())).unwrap();
        let slot = Arc::new(std::sync::Mutex::new(Some(old)));
        let sm = StateMachineStore::open_with(SnapshotStore::Memory(slot)).unwrap();
        assert_eq!(sm.read().cluster, {
            let mut c = cluster;
            c.rebuild_indexes();
            c
        });
    }

    #[test]
    fn a_truncated_snapshot_is_an_error_not_a_panic() {
        let bytes = stored(ClusterState::default()).encode().unwrap();
        assert!(StoredSnapshot::decode(&bytes[..10]).is_err());
        assert!(StoredSnapshot::decode(&bytes[..14]).is_err());
    }
}
