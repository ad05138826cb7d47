//! The Raft state machine: `ClusterState` in memory behind a lock, applied from committed
//! entries, with the latest snapshot persisted in sled. A restarted replica loads that snapshot
//! and openraft re-applies the committed entries after it.
//!
//! Readers (the API) take the lock briefly and never across an `.await`. Every applied change
//! to a job is also published on a broadcast channel for `WatchJobs`.

use std::borrow::Cow;
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

type Meta = SnapshotMeta<NodeId, BasicNode>;

/// Frames a snapshot: header and meta, then whatever `write_data` appends (the state's JSON).
/// Returns the framed bytes and where the data starts in them.
/// An apply that holds the state's write lock this long is logged.
const SLOW_APPLY: std::time::Duration = std::time::Duration::from_millis(100);

fn frame(
    meta: &SnapshotMeta<NodeId, BasicNode>,
    write_data: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
) -> Result<(Vec<u8>, usize), serde_json::Error> {
    let meta = serde_json::to_vec(meta)?;
    let meta_len = u32::try_from(meta.len()).expect("snapshot meta under 4 GiB");
    let mut out = Vec::new();
    out.extend_from_slice(SNAPSHOT_FORMAT_V2);
    out.extend_from_slice(&meta_len.to_le_bytes());
    out.extend_from_slice(&meta);
    let offset = out.len();
    write_data(&mut out)?;
    Ok((out, offset))
}

/// The meta and the state's JSON of a stored snapshot, in either format. The data is borrowed
/// from `bytes` in the current format (a snapshot may be hundreds of megabytes: no copy).
fn unframe(bytes: &[u8]) -> Result<(Meta, Cow<'_, [u8]>), String> {
    let Some(rest) = bytes.strip_prefix(SNAPSHOT_FORMAT_V2.as_slice()) else {
        let old: StoredSnapshot = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        return Ok((old.meta, Cow::Owned(old.data)));
    };
    let (len, rest) = rest
        .split_first_chunk::<4>()
        .ok_or("the snapshot ends inside its header")?;
    let len = u32::from_le_bytes(*len) as usize;
    if rest.len() < len {
        return Err("the snapshot ends inside its meta".into());
    }
    let (meta, data) = rest.split_at(len);
    let meta = serde_json::from_slice(meta).map_err(|e| format!("its meta: {e}"))?;
    Ok((meta, Cow::Borrowed(data)))
}

/// Hands memory freed by a large snapshot (its buffers, the old state's many small blocks) back
/// to the OS: glibc keeps freed heap memory otherwise, and the replica's RSS would stay at the
/// snapshot's peak.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
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
            SnapshotStore::Sled(tree) => read_chunked(tree).map_err(|e| e.to_string()),
            SnapshotStore::Memory(slot) => Ok(slot.lock().expect("snapshot slot poisoned").clone()),
        }
    }

    fn put(&self, bytes: &[u8]) -> Result<(), String> {
        match self {
            SnapshotStore::Sled(tree) => write_chunked(tree, bytes).map_err(|e| e.to_string()),
            SnapshotStore::Memory(slot) => {
                *slot.lock().expect("snapshot slot poisoned") = Some(bytes.to_vec());
                Ok(())
            }
        }
    }
}

/// In sled, a snapshot is stored in chunks of this size under `chunk/GENERATION/N`, and
/// `SNAPSHOT_KEY` holds a pointer to the generation (`CHUNKED_POINTER`, generation, chunk count,
/// length). sled copies a value at least twice on insert and keeps it in its cache: one value of
/// hundreds of megabytes cost as much memory again as the state it was made from.
const SNAPSHOT_CHUNK_BYTES: usize = 4 * 1024 * 1024;
const CHUNKED_POINTER: &[u8; 8] = b"GPUCPSC1";
const FLUSH_EVERY_CHUNKS: u32 = 4;
const CHUNK_PREFIX: &[u8] = b"chunk/";

fn chunk_key(generation: u64, n: u32) -> Vec<u8> {
    let mut key = CHUNK_PREFIX.to_vec();
    key.extend_from_slice(&generation.to_be_bytes());
    key.extend_from_slice(&n.to_be_bytes());
    key
}

/// (generation, chunks, length) from a pointer value, or `None` for a snapshot stored whole
/// (before chunks).
fn parse_pointer(value: &[u8]) -> Option<(u64, u32, usize)> {
    let rest = value.strip_prefix(CHUNKED_POINTER.as_slice())?;
    let (generation, rest) = rest.split_first_chunk::<8>()?;
    let (chunks, rest) = rest.split_first_chunk::<4>()?;
    let (len, _) = rest.split_first_chunk::<8>()?;
    Some((
        u64::from_le_bytes(*generation),
        u32::from_le_bytes(*chunks),
        u64::from_le_bytes(*len) as usize,
    ))
}

/// Writes the new chunks, flushes, then switches the pointer (flushed) and removes the old
/// generation: a crash at any point leaves the previous or the new snapshot whole.
fn write_chunked(tree: &sled::Tree, bytes: &[u8]) -> Result<(), sled::Error> {
    let generation = match tree.get(SNAPSHOT_KEY)?.as_deref().and_then(parse_pointer) {
        Some((g, _, _)) => g + 1,
        None => 1,
    };
    let mut chunks = 0u32;
    for chunk in bytes.chunks(SNAPSHOT_CHUNK_BYTES) {
        tree.insert(chunk_key(generation, chunks), chunk)?;
        chunks += 1;
        // sled holds what is not yet flushed in memory: bound it to a few chunks.
        if chunks.is_multiple_of(FLUSH_EVERY_CHUNKS) {
            tree.flush()?;
        }
    }
    tree.flush()?;
    let mut pointer = CHUNKED_POINTER.to_vec();
    pointer.extend_from_slice(&generation.to_le_bytes());
    pointer.extend_from_slice(&chunks.to_le_bytes());
    pointer.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    tree.insert(SNAPSHOT_KEY, pointer)?;
    tree.flush()?;
    // Chunks of older generations, and of a write that crashed before its pointer switch.
    let current = chunk_key(generation, 0);
    for key in tree.scan_prefix(CHUNK_PREFIX).keys() {
        let key = key?;
        if key[..current.len() - 4] != current[..current.len() - 4] {
            tree.remove(key)?;
        }
    }
    tree.flush()?;
    Ok(())
}

fn read_chunked(tree: &sled::Tree) -> Result<Option<Vec<u8>>, String> {
    let Some(value) = tree.get(SNAPSHOT_KEY).map_err(|e| e.to_string())? else {
        return Ok(None);
    };
    let Some((generation, chunks, len)) = parse_pointer(&value) else {
        return Ok(Some(value.to_vec()));
    };
    let mut out = Vec::with_capacity(len);
    for n in 0..chunks {
        let chunk = tree
            .get(chunk_key(generation, n))
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("chunk {n} of snapshot generation {generation} is missing"))?;
        out.extend_from_slice(&chunk);
    }
    if out.len() != len {
        return Err(format!(
            "snapshot generation {generation} has {} bytes, its pointer says {len}",
            out.len()
        ));
    }
    Ok(Some(out))
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
            let (_, state) =
                unframe(&bytes).map_err(|e| format!("the stored snapshot does not decode: {e}"))?;
            data = serde_json::from_slice(&state)
                .map_err(|e| format!("the stored snapshot's state does not decode: {e}"))?;
            drop(state);
            drop(bytes);
            data.cluster.rebuild_indexes();
            data.cluster
                .check_consistency()
                .map_err(|e| format!("the stored snapshot is inconsistent: {e}"))?;
            release_freed_memory();
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

    /// Persists a framed snapshot (flushed before this returns).
    fn write_snapshot(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        framed: &[u8],
    ) -> Result<(), StorageError> {
        self.shared.snapshots.put(framed).map_err(|e| {
            StorageIOError::write_snapshot(Some(meta.signature()), &std::io::Error::other(e))
        })?;
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    #[tracing::instrument(level = "info", skip_all, name = "raft.build_snapshot")]
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Serialize under the read lock (applies wait, readers do not), straight into the
        // framed buffer that is stored: one copy of a possibly large state, not three.
        let (meta, mut framed, offset) = {
            let data = self.read();
            let seq = self.shared.snapshot_seq.fetch_add(1, Ordering::Relaxed);
            let snapshot_id = match data.last_applied {
                Some(l) => format!("{}-{}-{seq}", l.leader_id, l.index),
                None => format!("--{seq}"),
            };
            let meta = SnapshotMeta {
                last_log_id: data.last_applied,
                last_membership: data.last_membership.clone(),
                snapshot_id,
            };
            let (framed, offset) = frame(&meta, |buf| serde_json::to_writer(buf, &*data))
                .map_err(|e| StorageIOError::read_state_machine(&e))?;
            (meta, framed, offset)
        };
        self.write_snapshot(&meta, &framed)?;
        // What openraft sends to followers is the state's JSON alone: drop the frame in place.
        framed.drain(..offset);
        release_freed_memory();
        tracing::info!(bytes = framed.len(), index = ?meta.last_log_id.map(|l| l.index), "snapshot built");
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(framed)),
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
            let mut data = self.write_lock().await;
            let locked_at = std::time::Instant::now();
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
            let held = locked_at.elapsed();
            if held >= SLOW_APPLY {
                tracing::info!(
                    held_ms = held.as_millis() as u64,
                    entries = replies.len(),
                    "slow apply: the state was locked this long"
                );
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
        let (framed, _) = frame(meta, |buf| {
            buf.extend_from_slice(&bytes);
            Ok(())
        })
        .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        drop(bytes);
        self.write_snapshot(meta, &framed)?;
        drop(framed);
        // Watchers re-learn every job; with none, copying a million records would be waste.
        let jobs: Vec<Job> = if self.shared.events.receiver_count() > 0 {
            new_data.cluster.jobs.values().cloned().collect()
        } else {
            Vec::new()
        };
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
        let (meta, data) = unframe(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(None, &std::io::Error::other(e)))?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data.into_owned())),
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

    fn encode(s: &StoredSnapshot) -> Vec<u8> {
        frame(&s.meta, |buf| {
            buf.extend_from_slice(&s.data);
            Ok(())
        })
        .unwrap()
        .0
    }

    #[test]
    fn a_snapshot_round_trips_in_the_current_format_and_is_not_json_numbers() {
        let s = stored(cluster_with_a_job());
        let bytes = encode(&s);
        assert!(bytes.starts_with(SNAPSHOT_FORMAT_V2));
        assert!(bytes.len() < s.data.len() + 1024, "{} bytes", bytes.len());
        let (meta, data) = unframe(&bytes).unwrap();
        assert_eq!(*data, *s.data);
        assert_eq!(meta, s.meta);
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
    fn sled_keeps_a_snapshot_in_chunks_and_only_the_latest_generation() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let tree = db.open_tree("snapshot").unwrap();
        // A snapshot stored whole, as before chunks, still reads.
        tree.insert(SNAPSHOT_KEY, b"whole".as_slice()).unwrap();
        assert_eq!(read_chunked(&tree).unwrap().unwrap(), b"whole");

        let big: Vec<u8> = (0..2 * SNAPSHOT_CHUNK_BYTES + 7).map(|i| i as u8).collect();
        write_chunked(&tree, &big).unwrap();
        assert_eq!(read_chunked(&tree).unwrap().unwrap(), big);
        assert_eq!(tree.scan_prefix(CHUNK_PREFIX).count(), 3);

        write_chunked(&tree, b"small").unwrap();
        assert_eq!(read_chunked(&tree).unwrap().unwrap(), b"small");
        assert_eq!(
            tree.scan_prefix(CHUNK_PREFIX).count(),
            1,
            "old chunks left behind"
        );

        let value = tree.get(SNAPSHOT_KEY).unwrap().unwrap();
        let (generation, _, _) = parse_pointer(&value).unwrap();
        tree.remove(chunk_key(generation, 0)).unwrap();
        let err = read_chunked(&tree).unwrap_err();
        assert!(err.contains("missing"), "{err}");
    }

    #[test]
    fn a_truncated_snapshot_is_an_error_not_a_panic() {
        let bytes = encode(&stored(ClusterState::default()));
        assert!(unframe(&bytes[..10]).is_err());
        assert!(unframe(&bytes[..14]).is_err());
    }
}
