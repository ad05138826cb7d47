//! The Raft state machine: `ClusterState` in memory behind a lock, applied from committed
//! entries, with the latest snapshot persisted in sled. A restarted replica loads that snapshot
//! and openraft re-applies the committed entries after it.
//!
//! Readers (the API) take the lock briefly and never across an `.await`. Every applied change
//! to a job is also published on a broadcast channel for `WatchJobs`.

use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, EntryPayload, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};

use super::{Entry, LogId, NodeId, StorageError, TypeConfig};
use crate::state::{ClusterState, Job, Outcome};

/// The snapshot as one JSON document, its state bytes inside as a JSON array of numbers (about
/// four bytes of text per byte): how replicas stored it before `SNAPSHOT_META_KEY`. Still read.
const LEGACY_SNAPSHOT_KEY: &str = "current";
/// The snapshot's metadata (JSON) and its state (the JSON bytes as they are), written together
/// in one atomic sled batch.
const SNAPSHOT_META_KEY: &str = "current-meta";
const SNAPSHOT_DATA_KEY: &str = "current-data";
/// An apply that holds the state's write lock this long is logged.
const SLOW_APPLY: std::time::Duration = std::time::Duration::from_millis(100);
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
    fn get(&self) -> Result<Option<StoredSnapshot>, String> {
        match self {
            SnapshotStore::Sled(tree) => {
                let meta = tree.get(SNAPSHOT_META_KEY).map_err(|e| e.to_string())?;
                if let Some(meta) = meta {
                    let data = tree
                        .get(SNAPSHOT_DATA_KEY)
                        .map_err(|e| e.to_string())?
                        .ok_or("the snapshot's metadata is stored without its data")?;
                    let meta = serde_json::from_slice(&meta)
                        .map_err(|e| format!("the snapshot's metadata does not decode: {e}"))?;
                    return Ok(Some(StoredSnapshot {
                        meta,
                        data: data.to_vec(),
                    }));
                }
                match tree.get(LEGACY_SNAPSHOT_KEY).map_err(|e| e.to_string())? {
                    Some(bytes) => decode_stored(&bytes).map(Some),
                    None => Ok(None),
                }
            }
            SnapshotStore::Memory(slot) => {
                match slot.lock().expect("snapshot slot poisoned").as_deref() {
                    Some(bytes) => decode_stored(bytes).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    fn put(&self, stored: &StoredSnapshot) -> Result<(), String> {
        match self {
            SnapshotStore::Sled(tree) => {
                let meta = serde_json::to_vec(&stored.meta).map_err(|e| e.to_string())?;
                let mut batch = sled::Batch::default();
                batch.insert(SNAPSHOT_META_KEY, meta);
                batch.insert(SNAPSHOT_DATA_KEY, stored.data.as_slice());
                batch.remove(LEGACY_SNAPSHOT_KEY);
                tree.apply_batch(batch).map_err(|e| e.to_string())?;
                tree.flush().map_err(|e| e.to_string())?;
                Ok(())
            }
            SnapshotStore::Memory(slot) => {
                let bytes = serde_json::to_vec(stored).map_err(|e| e.to_string())?;
                *slot.lock().expect("snapshot slot poisoned") = Some(bytes);
                Ok(())
            }
        }
    }

    /// Whether encoding and writing a snapshot may leave the async runtime for a blocking
    /// thread: on disk, yes; in the deterministic simulation, no (another thread would make its
    /// runs unrepeatable, and its in-memory slot is cheap).
    fn offload(&self) -> bool {
        matches!(self, SnapshotStore::Sled(_))
    }
}

fn decode_stored(bytes: &[u8]) -> Result<StoredSnapshot, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("the stored snapshot does not decode: {e}"))
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
        if let Some(stored) = snapshots
            .get()
            .map_err(|e| format!("reading the snapshot: {e}"))?
        {
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

    /// Read access for async handlers on hot paths (heartbeats, reports, submissions,
    /// streams): waits for an apply in progress on the runtime's timer instead of parking the
    /// thread in the lock. Thousands of heartbeats a second would otherwise park every runtime
    /// thread behind one long apply (a plan placing 10,000 jobs), and a replica that cannot run
    /// its Raft tasks for a few hundred milliseconds triggers an election.
    pub async fn read_async(&self) -> RwLockReadGuard<'_, StateMachineData> {
        loop {
            match self.shared.data.try_read() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(_)) => panic!("state machine lock poisoned"),
                Err(TryLockError::WouldBlock) => {}
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// The write lock, taken without parking a runtime thread inside the lock. While a writer
    /// waits in it, std's `RwLock` makes every new reader wait too: behind one long reader (a
    /// scheduling pass on a large cluster) the apply task, then every API handler that reads
    /// the state, would park all of the runtime's threads, and the replica would stop sending
    /// Raft heartbeats until the pass ended. Retrying on the runtime's timer keeps readers
    /// flowing; the apply waits for the pass either way.
    async fn write_lock(&self) -> RwLockWriteGuard<'_, StateMachineData> {
        loop {
            match self.shared.data.try_write() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(_)) => panic!("state machine lock poisoned"),
                Err(TryLockError::WouldBlock) => {}
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<JobEvent> {
        self.shared.events.subscribe()
    }

    /// Changes whenever entries are applied (the value is the last applied index).
    pub fn watch_applied(&self) -> watch::Receiver<u64> {
        self.shared.applied.subscribe()
    }

    fn write_snapshot(&self, stored: &StoredSnapshot) -> Result<(), StorageError> {
        self.shared.snapshots.put(stored).map_err(|e| {
            StorageIOError::write_snapshot(Some(stored.meta.signature()), &std::io::Error::other(e))
                .into()
        })
    }
}

/// Encodes a copy of the state and writes it as the current snapshot.
fn encode_and_store(
    store: &StateMachineStore,
    data: &StateMachineData,
    seq: u64,
) -> Result<StoredSnapshot, StorageError> {
    let bytes = serde_json::to_vec(data).map_err(|e| StorageIOError::read_state_machine(&e))?;
    let snapshot_id = match data.last_applied {
        Some(l) => format!("{}-{}-{seq}", l.leader_id, l.index),
        None => format!("--{seq}"),
    };
    let stored = StoredSnapshot {
        meta: SnapshotMeta {
            last_log_id: data.last_applied,
            last_membership: data.last_membership.clone(),
            snapshot_id,
        },
        data: bytes,
    };
    store.write_snapshot(&stored)?;
    Ok(stored)
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    #[tracing::instrument(level = "info", skip_all, name = "raft.build_snapshot")]
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Copy under the read lock, encode and write outside it: an apply waits only for the
        // copy. Encoding a large state takes seconds on a loaded host; holding the lock that
        // long blocked the apply task's thread too, and with both runtime threads stuck the
        // replica missed heartbeats and triggered elections.
        let data = self.read().clone();
        let seq = self.shared.snapshot_seq.fetch_add(1, Ordering::Relaxed);
        let stored = if self.shared.snapshots.offload() {
            let store = self.clone();
            tokio::task::spawn_blocking(move || encode_and_store(&store, &data, seq))
                .await
                .map_err(|e| StorageIOError::read_state_machine(&std::io::Error::other(e)))??
        } else {
            encode_and_store(self, &data, seq)?
        };
        tracing::info!(bytes = stored.data.len(), index = ?stored.meta.last_log_id.map(|l| l.index), "snapshot built");
        Ok(Snapshot {
            meta: stored.meta,
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
        let mut data = self.write_lock().await;
        let locked_at = std::time::Instant::now();
        {
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
        drop(data);
        let held = locked_at.elapsed();
        if held >= SLOW_APPLY {
            tracing::info!(
                held_ms = held.as_millis() as u64,
                entries = replies.len(),
                "slow apply: the state was locked this long"
            );
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
        let Some(stored) = self
            .shared
            .snapshots
            .get()
            .map_err(|e| StorageIOError::read_snapshot(None, &std::io::Error::other(e)))?
        else {
            return Ok(None);
        };
        Ok(Some(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        }))
    }
}
