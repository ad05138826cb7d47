//! The Raft state machine: `ClusterState` in memory behind a lock, applied from committed
//! entries, with the latest snapshot persisted in sled. A restarted replica loads that snapshot
//! and openraft re-applies the committed entries after it.
//!
//! Readers (the API) take the lock briefly and never across an `.await`. Every applied change
//! to a job is also published on a broadcast channel for `WatchJobs`.

use std::borrow::Cow;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, EntryPayload, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};

pub use super::snapshot_store::SnapshotStore;
use super::snapshot_store::{
    ChunkedBuf, Pacing, SnapshotData, Snapshots, StoredReader, release_freed_memory,
};
use super::state_codec;
use super::{Entry, LogId, NodeId, StorageError, TypeConfig};
use crate::off_runtime::at_background_priority;
use crate::state::format::{self, FormatVersion};
use crate::state::{ClusterState, Command, Job, Outcome};

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

/// An apply that holds the state's write lock this long is logged.
const SLOW_APPLY: std::time::Duration = std::time::Duration::from_millis(100);

/// Writes a snapshot's header and meta in the current format; the state's JSON follows.
/// Returns the header's length (where the data starts).
fn write_header(out: &mut (impl Write + ?Sized), meta: &Meta) -> std::io::Result<u64> {
    let meta = serde_json::to_vec(meta)?;
    let meta_len = u32::try_from(meta.len()).expect("snapshot meta under 4 GiB");
    out.write_all(SNAPSHOT_FORMAT_V2)?;
    out.write_all(&meta_len.to_le_bytes())?;
    out.write_all(&meta)?;
    Ok((SNAPSHOT_FORMAT_V2.len() + 4 + meta.len()) as u64)
}

/// Reads a current-format header from the start of a stored snapshot: its meta and where its
/// data starts, or `None` if it is in the first format.
fn read_header(r: &mut impl Read) -> Result<Option<(Meta, u64)>, String> {
    let mut tag = Vec::with_capacity(SNAPSHOT_FORMAT_V2.len());
    r.by_ref()
        .take(SNAPSHOT_FORMAT_V2.len() as u64)
        .read_to_end(&mut tag)
        .map_err(|e| e.to_string())?;
    if tag != SNAPSHOT_FORMAT_V2 {
        return Ok(None);
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .map_err(|e| format!("the snapshot ends inside its header: {e}"))?;
    let len = u32::from_le_bytes(len) as usize;
    let mut meta = vec![0u8; len];
    r.read_exact(&mut meta)
        .map_err(|e| format!("the snapshot ends inside its meta: {e}"))?;
    let meta = serde_json::from_slice(&meta).map_err(|e| format!("its meta: {e}"))?;
    Ok(Some((meta, (SNAPSHOT_FORMAT_V2.len() + 4 + len) as u64)))
}

/// The meta and the state's JSON of a snapshot held whole in memory, in either format. The
/// data is borrowed from `bytes` in the current format (no copy).
fn unframe(bytes: &[u8]) -> Result<(Meta, Cow<'_, [u8]>), String> {
    let mut r = bytes;
    let Some((meta, offset)) = read_header(&mut r)? else {
        let old: StoredSnapshot = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        return Ok((old.meta, Cow::Owned(old.data)));
    };
    Ok((meta, Cow::Borrowed(&bytes[offset as usize..])))
}

/// A stored snapshot's meta and its data: read from the store a chunk at a time (current
/// format), or decoded whole (first format).
fn open_stored(mut reader: StoredReader) -> Result<(Meta, SnapshotData), String> {
    match read_header(&mut reader)? {
        Some((meta, offset)) => Ok((
            meta,
            SnapshotData::stored(reader, offset).map_err(|e| e.to_string())?,
        )),
        None => {
            let bytes = reader.into_bytes().map_err(|e| e.to_string())?;
            let (meta, data) = unframe(&bytes)?;
            Ok((meta, SnapshotData::from_bytes(data.into_owned())))
        }
    }
}

/// Decodes a snapshot's state from its JSON, read a buffer at a time: the JSON of a large
/// state is never whole in memory next to the state decoded from it.
fn decode_state(data: impl Read) -> Result<StateMachineData, String> {
    state_codec::read_state(data)
}

/// Decodes a state stored as a snapshot stores it and checks it as a restart does (indexes
/// rebuilt, consistency checked): what a replica would start from. `what` names the source in
/// the error ("the stored snapshot").
pub fn decode_checked_state(data: impl Read, what: &str) -> Result<StateMachineData, String> {
    let mut data =
        decode_state(data).map_err(|e| format!("{what}'s state does not decode: {e}"))?;
    data.cluster.rebuild_indexes();
    data.cluster
        .check_consistency()
        .map_err(|e| format!("{what} is inconsistent: {e}"))?;
    Ok(data)
}

/// The state in a snapshot received from the leader, checked as a stored one is on a restart.
fn decode_received(bytes: &[u8]) -> std::io::Result<StateMachineData> {
    let invalid = |what: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "the received snapshot ({} bytes) is refused: {what}; this replica keeps its state",
                bytes.len()
            ),
        )
    };
    let mut data: StateMachineData = state_codec::read_state(bytes).map_err(|e| {
        invalid(format!(
            "its state does not decode (cut short or damaged?): {e}"
        ))
    })?;
    data.cluster.rebuild_indexes();
    data.cluster
        .check_consistency()
        .map_err(|e| invalid(format!("its state is inconsistent: {e}")))?;
    Ok(data)
}

/// Stops this replica before it applies an entry that raises the cluster version past what its
/// binary reads: the entries after it are in a format it cannot decode, and applying the
/// raise while refusing what follows would leave its state behind its peers' unnoticed. The
/// storage error stops its Raft with this message in its log.
fn refuse_unknown_cluster_version(entries: &[Entry]) -> Result<(), StorageError> {
    for entry in entries {
        let EntryPayload::Normal(request) = &entry.payload else {
            continue;
        };
        if let Command::SetClusterVersion { version } = request.command.unattributed()
            && *version > format::CURRENT
        {
            let message = format!(
                "log entry {} raises the cluster version to {version}, but this binary (release {}) reads formats up to {}: upgrade this replica's binary to a release that reads format {version}",
                entry.log_id.index,
                format::RELEASE,
                format::CURRENT
            );
            tracing::error!("{message}");
            return Err(
                StorageIOError::apply(entry.log_id, &std::io::Error::other(message)).into(),
            );
        }
    }
    Ok(())
}

/// A job as it was right after a log entry changed it.
#[derive(Debug, Clone)]
pub struct JobEvent {
    pub job: Job,
    pub log_index: u64,
}

struct Shared {
    data: RwLock<StateMachineData>,
    snapshots: Snapshots,
    events: broadcast::Sender<JobEvent>,
    /// Last applied log index, for loops that react to any change (scheduling, assignments).
    applied: watch::Sender<u64>,
    snapshot_seq: AtomicU64,
    /// How long the last snapshot built held the state's read lock, in microseconds.
    snapshot_locked_us: AtomicU64,
    /// The applied cluster version, readable without the state's lock: the format new
    /// entries are proposed in (`group_commit`).
    cluster_version: AtomicU32,
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
        let snapshots = Snapshots::new(snapshots);
        let mut data = StateMachineData::default();
        if let Some(reader) = snapshots
            .reader()
            .map_err(|e| format!("reading the snapshot: {e}"))?
        {
            let (_, state) = open_stored(reader)
                .map_err(|e| format!("the stored snapshot does not decode: {e}"))?;
            data = decode_checked_state(state, "the stored snapshot")?;
            release_freed_memory();
        }
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let (applied, _) = watch::channel(data.last_applied.map(|l| l.index).unwrap_or(0));
        let cluster_version = data.cluster.cluster_version.0;
        Ok(StateMachineStore {
            shared: Arc::new(Shared {
                data: RwLock::new(data),
                snapshots,
                events,
                applied,
                snapshot_seq: AtomicU64::new(0),
                snapshot_locked_us: AtomicU64::new(0),
                cluster_version: AtomicU32::new(cluster_version),
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

    /// How long the last snapshot built held the state's read lock (applies wait that long).
    pub fn last_snapshot_locked(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.shared.snapshot_locked_us.load(Ordering::Relaxed))
    }

    /// The applied cluster version: the format to propose new entries in.
    pub fn cluster_version(&self) -> FormatVersion {
        self.shared.cluster_version.load(Ordering::Acquire)
    }

    /// Changes whenever entries are applied (the value is the last applied index).
    pub fn watch_applied(&self) -> watch::Receiver<u64> {
        self.shared.applied.subscribe()
    }
}

fn write_error<E: std::error::Error + 'static>(meta: &Meta, e: &E) -> StorageError {
    StorageIOError::write_snapshot(Some(meta.signature()), e).into()
}

fn read_error<E: std::error::Error + 'static>(meta: Option<&Meta>, e: &E) -> StorageError {
    StorageIOError::read_snapshot(meta.map(|m| m.signature()), e).into()
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    #[tracing::instrument(level = "info", skip_all, name = "raft.build_snapshot")]
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Copy the state under the read lock (applies wait, readers do not): the large maps
        // share their records with the live state (`CowMap`), so the copy takes a pointer per
        // record and applies go on while it is serialized. Serialize into memory, in chunks,
        // then store them, freeing each as it is stored: sled stores a chunk more slowly than
        // serde_json writes one. Both run on a blocking thread: at a million job records they
        // take seconds of CPU that the runtime's workers need for Raft.
        let (meta, copy, locked) = {
            let data = self.read();
            let locked_at = std::time::Instant::now();
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
            let copy = StateMachineData {
                last_applied: data.last_applied,
                last_membership: data.last_membership.clone(),
                cluster: data.cluster.snapshot_copy(),
            };
            (meta, copy, locked_at.elapsed())
        };
        self.shared
            .snapshot_locked_us
            .store(locked.as_micros() as u64, Ordering::Relaxed);
        let encode_meta = meta.clone();
        let encoded = at_background_priority(move || encode_snapshot(&encode_meta, copy))
            .await
            .map_err(|e| write_error(&meta, &e))??;
        let shared = self.shared.clone();
        let store_meta = meta.clone();
        let stored =
            tokio::task::spawn_blocking(move || store_snapshot(&shared, &store_meta, encoded))
                .await
                .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let (data, bytes) = stored?;
        release_freed_memory();
        tracing::info!(
            bytes,
            locked_ms = locked.as_millis() as u64,
            index = ?meta.last_log_id.map(|l| l.index),
            "snapshot built"
        );
        Ok(Snapshot {
            meta,
            snapshot: Box::new(data),
        })
    }
}

/// The applied state's bytes exactly as a stored snapshot holds them after its header, for a
/// backup: the same encoding (`encode_snapshot`), so whatever versioning it has applies to
/// backups too. Held in memory in chunks, as a snapshot being built is.
pub struct EncodedState {
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub chunks: Vec<Vec<u8>>,
}

impl EncodedState {
    pub fn len(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl StateMachineStore {
    /// A copy of the applied state consistent at its last applied entry, and a snapshot meta
    /// describing it. Cheap under the read lock: the large maps share their records with the
    /// live state, as `build_snapshot`'s copy does.
    pub fn consistent_copy(&self) -> (Meta, StateMachineData) {
        let data = self.read();
        let meta = SnapshotMeta {
            last_log_id: data.last_applied,
            last_membership: data.last_membership.clone(),
            snapshot_id: match data.last_applied {
                Some(l) => format!("{}-{}-backup", l.leader_id, l.index),
                None => "--backup".into(),
            },
        };
        let copy = StateMachineData {
            last_applied: data.last_applied,
            last_membership: data.last_membership.clone(),
            cluster: data.cluster.snapshot_copy(),
        };
        (meta, copy)
    }
}

/// Encodes a copy of the state as a snapshot stores it, without the snapshot's own header
/// (pure CPU, like `encode_snapshot`: run it off the async runtime).
pub fn encode_state(meta: Meta, copy: StateMachineData) -> Result<EncodedState, String> {
    let encoded = encode_snapshot(&meta, copy).map_err(|e| e.to_string())?;
    let mut skip = encoded.offset as usize;
    let mut chunks = Vec::new();
    for mut chunk in encoded.bytes.into_chunks() {
        let cut = skip.min(chunk.len());
        skip -= cut;
        chunk.drain(..cut);
        if !chunk.is_empty() {
            chunks.push(chunk);
        }
    }
    Ok(EncodedState { meta, chunks })
}

/// Stores `data` as the snapshot of a store that has none (an offline restore), encoded and
/// stored as `build_snapshot` does, then reopens the store to check that a replica starts
/// from it. Returns the stored length.
pub fn seed_snapshot(db: &sled::Db, data: StateMachineData) -> Result<u64, String> {
    let tree = db
        .open_tree("snapshot")
        .map_err(|e| format!("opening the snapshot tree: {e}"))?;
    let snapshots = Snapshots::new(SnapshotStore::Sled(tree));
    if snapshots
        .reader()
        .map_err(|e| format!("reading the snapshot tree: {e}"))?
        .is_some()
    {
        return Err("the database already holds a snapshot".into());
    }
    let meta = SnapshotMeta {
        last_log_id: data.last_applied,
        last_membership: data.last_membership.clone(),
        snapshot_id: match data.last_applied {
            Some(l) => format!("{}-{}-restored", l.leader_id, l.index),
            None => "--restored".into(),
        },
    };
    let expected = data.last_applied;
    let encoded = encode_snapshot(&meta, data).map_err(|e| e.to_string())?;
    let mut writer = snapshots
        .writer(Pacing::Urgent)
        .map_err(|e| format!("storing the snapshot: {e}"))?;
    encoded
        .bytes
        .store_into(&mut writer)
        .map_err(|e| format!("storing the snapshot: {e}"))?;
    let stored = writer
        .finish()
        .map_err(|e| format!("storing the snapshot: {e}"))?;
    let bytes = stored.len();
    drop(stored);
    let reopened = StateMachineStore::open(db)?;
    let applied = reopened.read().last_applied;
    if applied != expected {
        return Err(format!(
            "the stored snapshot reloads at {applied:?}, not at {expected:?}"
        ));
    }
    Ok(bytes)
}

/// A snapshot serialized in memory: the header, then the state's JSON from `offset`.
struct EncodedSnapshot {
    bytes: ChunkedBuf,
    offset: u64,
}

/// Serializes a snapshot's copy of the state (pure CPU; run at background priority). The
/// copy's records are released when it returns, not after storing: records the state changed
/// meanwhile exist twice until then.
fn encode_snapshot(meta: &Meta, copy: StateMachineData) -> Result<EncodedSnapshot, StorageError> {
    let mut bytes = ChunkedBuf::default();
    let offset = write_header(&mut bytes, meta).map_err(|e| write_error(meta, &e))?;
    state_codec::write_state(&mut bytes, &copy)
        .map_err(|e| StorageIOError::read_state_machine(&e))?;
    Ok(EncodedSnapshot { bytes, offset })
}

/// Stores an encoded snapshot (at normal priority: it writes through sled's IO buffers, which
/// the Raft log's appends share); returns what openraft sends to followers (the state's JSON
/// alone, read from the store) and the stored length.
fn store_snapshot(
    shared: &Shared,
    meta: &Meta,
    encoded: EncodedSnapshot,
) -> Result<(SnapshotData, u64), StorageError> {
    let mut writer = shared
        .snapshots
        .writer(Pacing::Background)
        .map_err(|e| write_error(meta, &e))?;
    let len = encoded.bytes.len();
    encoded
        .bytes
        .store_into(&mut writer)
        .map_err(|e| write_error(meta, &e))?;
    let stored = writer.finish().map_err(|e| write_error(meta, &e))?;
    let bytes = stored.len();
    debug_assert_eq!(bytes, len);
    let data = SnapshotData::stored(stored, encoded.offset).map_err(|e| write_error(meta, &e))?;
    Ok((data, bytes))
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
        let entries: Vec<Entry> = entries.into_iter().collect();
        refuse_unknown_cluster_version(&entries)?;
        let heavy = entries.iter().any(|e| match &e.payload {
            EntryPayload::Normal(r) => r.command.is_heavy(),
            _ => false,
        });
        let mut data = self.write_lock().await;
        // A plan placing thousands of jobs takes hundreds of milliseconds to apply on a slow
        // 2-core host; run on a runtime worker, it held up that worker's other tasks (Raft
        // heartbeats among them) and leadership churned. Such entries are applied where the
        // worker hands its other tasks on first, as the scheduling pass is.
        let apply_all = || {
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
        };
        if heavy {
            crate::off_runtime::off_runtime(apply_all);
        } else {
            apply_all();
        }
        self.shared
            .cluster_version
            .store(data.cluster.cluster_version.0, Ordering::Release);
        drop(data);
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

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
        // Checked (decoded) when the last chunk is in, before openraft's core sees it: an
        // install that fails would stop this replica's Raft (see `SnapshotData::receiving`).
        Ok(Box::new(SnapshotData::receiving(Box::new(|bytes| {
            decode_received(bytes).map(|data| Box::new(data) as Box<dyn std::any::Any + Send>)
        }))))
    }

    #[tracing::instrument(level = "info", skip_all, name = "raft.install_snapshot")]
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<SnapshotData>,
    ) -> Result<(), StorageError> {
        let mut snapshot = snapshot;
        let checked = snapshot
            .take_checked()
            .and_then(|d| d.downcast::<StateMachineData>().ok());
        let bytes = snapshot
            .into_bytes()
            .map_err(|e| read_error(Some(meta), &e))?;
        let new_data = match checked {
            Some(data) => *data,
            None => decode_received(&bytes).map_err(|e| read_error(Some(meta), &e))?,
        };
        // Stored as received, a chunk at a time behind the header.
        {
            let mut writer = self
                .shared
                .snapshots
                .writer(Pacing::Urgent)
                .map_err(|e| write_error(meta, &e))?;
            write_header(&mut writer, meta).map_err(|e| write_error(meta, &e))?;
            writer
                .write_all(&bytes)
                .map_err(|e| write_error(meta, &e))?;
            drop(bytes);
            writer.finish().map_err(|e| write_error(meta, &e))?;
        }
        // Watchers re-learn every job; with none, copying a million records would be waste.
        let jobs: Vec<Job> = if self.shared.events.receiver_count() > 0 {
            new_data.cluster.jobs.values().cloned().collect()
        } else {
            Vec::new()
        };
        let index = meta.last_log_id.map(|l| l.index).unwrap_or(0);
        let cluster_version = new_data.cluster.cluster_version.0;
        *self
            .shared
            .data
            .write()
            .expect("state machine lock poisoned") = new_data;
        self.shared
            .cluster_version
            .store(cluster_version, Ordering::Release);
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
        let Some(reader) = self
            .shared
            .snapshots
            .reader()
            .map_err(|e| read_error(None, &e))?
        else {
            return Ok(None);
        };
        // The data is read from the store as openraft streams it to the follower.
        let (meta, data) =
            open_stored(reader).map_err(|e| read_error(None, &std::io::Error::other(e)))?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(data),
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
        let mut out = Vec::new();
        let offset = write_header(&mut out, &s.meta).unwrap();
        assert_eq!(offset as usize, out.len());
        out.extend_from_slice(&s.data);
        out
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

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_built_snapshot_is_streamed_to_sled_and_reloads() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let mut sm = StateMachineStore::open(&db).unwrap();
        // A state larger than a chunk, so that it spans several.
        {
            let mut data = sm.shared.data.write().unwrap();
            let tenant = crate::state::Tenant {
                name: "t0".into(),
                weight: 1,
                quota_gpus: 0,
                max_gpus: 0,
            };
            data.cluster
                .apply(&crate::state::Command::PutTenant { tenant }, 1, 1);
            for i in 1..4000u64 {
                let mut spec = crate::synthetic::job_spec(i as usize, 0, (1, 1, 0), "normal", 60);
                spec.name = format!("job-{i}-{}", "x".repeat(200));
                let command = crate::state::Command::submit(spec, Some(format!("k{i}")));
                let applied = data.cluster.apply(&command, 1, i + 1);
                assert!(
                    !matches!(applied.outcome, Outcome::Rejected(_)),
                    "{:?}",
                    applied.outcome
                );
            }
        }
        let expected = serde_json::to_vec(&*sm.read()).unwrap();
        let chunk = super::super::snapshot_store::SNAPSHOT_CHUNK_BYTES;
        assert!(expected.len() > 2 * chunk, "{} bytes", expected.len());

        let built = block_on(sm.build_snapshot()).unwrap();
        assert_eq!(built.snapshot.len(), expected.len() as u64);
        assert_eq!(built.snapshot.into_bytes().unwrap(), expected);
        let current = block_on(sm.get_current_snapshot()).unwrap().unwrap();
        assert_eq!(current.meta, built.meta);
        assert_eq!(current.snapshot.into_bytes().unwrap(), expected);

        let reopened = StateMachineStore::open(&db).unwrap();
        assert_eq!(
            serde_json::to_vec(&*reopened.read()).unwrap(),
            expected,
            "the reloaded state differs"
        );
    }

    #[test]
    fn an_installed_snapshot_is_stored_and_reloads() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let mut sm = StateMachineStore::open(&db).unwrap();
        let s = stored(cluster_with_a_job());
        let meta = SnapshotMeta {
            snapshot_id: "1-1-0".into(),
            ..Default::default()
        };
        let mut received = block_on(sm.begin_receiving_snapshot()).unwrap();
        block_on(tokio::io::AsyncWriteExt::write_all(&mut *received, &s.data)).unwrap();
        block_on(sm.install_snapshot(&meta, received)).unwrap();
        let current = block_on(sm.get_current_snapshot()).unwrap().unwrap();
        assert_eq!(current.meta, meta);
        assert_eq!(current.snapshot.into_bytes().unwrap(), s.data);
        let reopened = StateMachineStore::open(&db).unwrap();
        assert_eq!(reopened.read().cluster, sm.read().cluster);
    }

    #[test]
    fn a_truncated_snapshot_is_an_error_not_a_panic() {
        let bytes = encode(&stored(ClusterState::default()));
        assert!(unframe(&bytes[..10]).is_err());
        assert!(unframe(&bytes[..14]).is_err());
    }
}
