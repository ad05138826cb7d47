//! The Raft log in sled. Keys of the `logs` tree are big-endian indexes so sled's order is log
//! order; values are JSON-encoded entries. The vote, the commit index and the last purged log
//! id live in the `raft_meta` tree.
//!
//! Durability: `save_vote` and `truncate` flush sled (one fsync) before they return; `append`
//! writes the entries (readable at once) and reports them durable through openraft's callback
//! only once a flush that covers them has finished. The flushes of appends run on one thread
//! of their own, in order, each covering every append queued before it started (so appends
//! that arrive during a sync share the next one). openraft acknowledges a client write only
//! after a majority has reported its entry durable; a follower waits for the callback before
//! it answers its leader, and the leader replicates meanwhile (`third_party/openraft`,
//! PATCHED 7).
//!
//! Reads: openraft reads back every entry it sends a follower (once per follower) and every
//! entry it applies (on the Raft core's own task). The newest entries are kept decoded in
//! memory as they are appended ([`Tail`]), so those reads cost a reference count each instead
//! of a sled lookup and a JSON decode; older ones are read from sled.

use std::collections::VecDeque;
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader, StorageIOError, Vote};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Entry, LogId, NodeId, StorageError, TypeConfig};

const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const LAST_PURGED: &str = "last_purged";

/// A log flush that takes this long is logged (a heartbeat interval, by default).
const SLOW_FLUSH: std::time::Duration = std::time::Duration::from_millis(40);

/// Most entries the tail cache holds, and most encoded bytes they may stand for: a few
/// seconds of a busy leader's log (group commit makes an entry of up to 512 commands), so a
/// follower that is behind by less than that is caught up from memory.
const TAIL_MAX_ENTRIES: usize = 4096;
const TAIL_MAX_BYTES: usize = 64 << 20;

/// The newest entries of the log, decoded, contiguous from `first`: what was appended last,
/// minus what was truncated or purged since. A read wholly inside it is answered from here.
#[derive(Default)]
struct Tail {
    /// Index of `entries[0]`.
    first: u64,
    entries: VecDeque<Entry>,
    /// Encoded size of each of `entries`.
    sizes: VecDeque<usize>,
    bytes: usize,
}

impl Tail {
    fn end(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    /// Adds an entry just stored; one that does not follow the last starts the tail afresh.
    fn push(&mut self, entry: Entry, size: usize) {
        let index = entry.log_id.index;
        if self.entries.is_empty() || index != self.end() {
            self.clear_from(index);
        }
        self.entries.push_back(entry);
        self.sizes.push_back(size);
        self.bytes += size;
        while self.entries.len() > 1
            && (self.entries.len() > TAIL_MAX_ENTRIES || self.bytes > TAIL_MAX_BYTES)
        {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if self.entries.pop_front().is_some() {
            self.bytes -= self.sizes.pop_front().unwrap_or(0);
            self.first += 1;
        }
    }

    fn clear_from(&mut self, first: u64) {
        *self = Tail {
            first,
            ..Tail::default()
        };
    }

    /// Forgets the entries from `index` on (a truncated log).
    fn truncate(&mut self, index: u64) {
        while self.end() > index.max(self.first) {
            self.entries.pop_back();
            self.bytes -= self.sizes.pop_back().unwrap_or(0);
        }
    }

    /// Forgets the entries at or before `index` (a purged log).
    fn purge(&mut self, index: u64) {
        while !self.entries.is_empty() && self.first <= index {
            self.pop_front();
        }
        if self.entries.is_empty() {
            self.first = self.first.max(index + 1);
        }
    }

    /// Entries `[start, end)`, when the tail holds all of them.
    fn get(&self, start: u64, end: u64) -> Option<Vec<Entry>> {
        if start < self.first || end > self.end() || start > end {
            return None;
        }
        let from = (start - self.first) as usize;
        let to = (end - self.first) as usize;
        Some(self.entries.range(from..to).cloned().collect())
    }
}

#[derive(Clone)]
pub struct LogStore {
    db: sled::Db,
    logs: sled::Tree,
    meta: sled::Tree,
    /// Last commit index openraft reported, for status pages (0 when none).
    committed_index: Arc<AtomicU64>,
    /// The first index after the purge point (0 when nothing was purged): entries before it
    /// may still be stored until their background removal has finished, and readers skip
    /// them. Kept here so that reads, on every replication request, need not decode the
    /// stored purge point.
    first_kept: Arc<AtomicU64>,
    /// Where each flush's duration goes (`metrics`); none when metrics are off.
    flush_latency: Option<prometheus_client::metrics::histogram::Histogram>,
    /// The thread that flushes appended entries and reports them durable, in order; started
    /// by the first append (after `with_flush_histogram`).
    flusher: Arc<std::sync::OnceLock<Option<std::sync::mpsc::Sender<LogFlushed<TypeConfig>>>>>,
    /// The newest entries, decoded (see the module's header); shared with the log readers.
    tail: Arc<Mutex<Tail>>,
}

/// Records one flush's duration, and says so in the log when the disk was slow.
fn observe_flush(
    histogram: Option<&prometheus_client::metrics::histogram::Histogram>,
    took: std::time::Duration,
) {
    if let Some(h) = histogram {
        h.observe(took.as_secs_f64());
    }
    if took >= SLOW_FLUSH {
        // A follower waits for this flush before it answers the leader, who gives up on a
        // replication call after one heartbeat interval: a disk this slow shows up as
        // replication timeouts and, if it lasts, elections.
        tracing::info!(
            flush_ms = took.as_millis() as u64,
            "slow log flush: the disk took this long to sync the Raft log"
        );
    }
}

fn key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(bytes)
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(value)
}

impl LogStore {
    pub fn open(db: &sled::Db) -> Result<LogStore, sled::Error> {
        let meta = db.open_tree("raft_meta")?;
        // A purge point that does not decode counts as none here; openraft reads it through
        // `get_log_state` at start-up, which reports it as corrupt.
        let purged = meta.get(LAST_PURGED)?;
        let first_kept = purged
            .and_then(|v| decode::<LogId>(&v).ok())
            .map_or(0, |l| l.index + 1);
        let store = LogStore {
            db: db.clone(),
            logs: db.open_tree("logs")?,
            meta,
            committed_index: Arc::new(AtomicU64::new(0)),
            first_kept: Arc::new(AtomicU64::new(first_kept)),
            flush_latency: None,
            flusher: Arc::new(std::sync::OnceLock::new()),
            tail: Arc::new(Mutex::new(Tail::default())),
        };
        Ok(store)
    }

    /// Records every flush's duration in `histogram` (`gpucp_raft_log_flush_duration_seconds`).
    pub fn with_flush_histogram(
        mut self,
        histogram: Option<prometheus_client::metrics::histogram::Histogram>,
    ) -> Self {
        self.flush_latency = histogram;
        self
    }

    /// Records the purge point: from then on readers skip the entries at or before it.
    fn mark_purged(&self, log_id: &LogId) -> Result<(), StorageError> {
        self.put_meta(LAST_PURGED, log_id)?;
        self.first_kept.store(log_id.index + 1, Ordering::Relaxed);
        self.tail().purge(log_id.index);
        Ok(())
    }

    /// The tail cache. Its lock is only held to copy entries in or out; a panic while it was
    /// held leaves at worst a stale tail, so the lock is taken over rather than poisoned.
    fn tail(&self) -> MutexGuard<'_, Tail> {
        self.tail.lock().unwrap_or_else(|poisoned| {
            let mut tail = poisoned.into_inner();
            tail.clear_from(0);
            tail
        })
    }

    /// Reads every stored entry and the metadata once, so a damaged store is found at start-up
    /// rather than when the leader first needs an old entry.
    pub fn verify(&self) -> Result<(), String> {
        for item in self.logs.iter() {
            let (k, v) = item.map_err(|e| format!("reading the Raft log: {e}"))?;
            let entry: Entry = decode(&v).map_err(|e| {
                format!(
                    "Raft log entry at key {:?} does not decode: {e}",
                    k.as_ref()
                )
            })?;
            if k.as_ref() != key(entry.log_id.index) {
                return Err(format!(
                    "Raft log entry {} is stored under the wrong key",
                    entry.log_id.index
                ));
            }
        }
        if let Some(v) = self.meta.get(VOTE).map_err(|e| e.to_string())? {
            decode::<Vote<NodeId>>(&v).map_err(|e| format!("stored vote does not decode: {e}"))?;
        }
        Ok(())
    }

    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed_index.clone()
    }

    fn get_meta<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, StorageError> {
        let Some(bytes) = self.meta.get(name).map_err(|e| StorageIOError::read(&e))? else {
            return Ok(None);
        };
        decode(&bytes)
            .map(Some)
            .map_err(|e| StorageIOError::read(&e).into())
    }

    fn put_meta<T: Serialize>(&self, name: &str, value: &T) -> Result<(), StorageError> {
        let bytes = encode(value).map_err(|e| StorageIOError::write(&e))?;
        self.meta
            .insert(name, bytes)
            .map_err(|e| StorageIOError::write(&e))?;
        Ok(())
    }

    async fn flush(&self) -> Result<(), StorageError> {
        self.flush_db()
            .await
            .map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }

    /// `sled::Db::flush` (write and sync everything written so far) on tokio's blocking pool.
    /// Not sled's `flush_async`: that hands the same call to sled's own thread pool, whose queue
    /// wakes every idle pool thread (`notify_all`) for each job, and the leader flushes once per
    /// client write, so on a busy machine those wake-ups cost CPU and latency on every write.
    async fn flush_db(&self) -> Result<(), std::io::Error> {
        let db = self.db.clone();
        let started = std::time::Instant::now();
        let result = match tokio::task::spawn_blocking(move || db.flush()).await {
            Ok(flushed) => flushed.map(|_| ()).map_err(std::io::Error::other),
            Err(e) => Err(std::io::Error::other(format!("the flush task failed: {e}"))),
        };
        observe_flush(self.flush_latency.as_ref(), started.elapsed());
        result
    }

    /// The appends' flushing thread (see the module's header), started on first use; `None`
    /// if the thread could not be started (appends then flush where they are).
    fn flusher(&self) -> Option<&std::sync::mpsc::Sender<LogFlushed<TypeConfig>>> {
        self.flusher
            .get_or_init(|| {
                let (tx, rx) = std::sync::mpsc::channel::<LogFlushed<TypeConfig>>();
                let db = self.db.clone();
                let histogram = self.flush_latency.clone();
                let started = std::thread::Builder::new()
                    .name("raft-log-flush".into())
                    .spawn(move || {
                        // Ends when the last store handle (and with it the sender) is dropped.
                        while let Ok(first) = rx.recv() {
                            let mut waiting = vec![first];
                            waiting.extend(rx.try_iter());
                            let started = std::time::Instant::now();
                            let result = db.flush().map(|_| ());
                            observe_flush(histogram.as_ref(), started.elapsed());
                            for callback in waiting {
                                callback.log_io_completed(
                                    result
                                        .as_ref()
                                        .map(|_| ())
                                        .map_err(|e| std::io::Error::other(e.to_string())),
                                );
                            }
                        }
                    });
                match started {
                    Ok(_) => Some(tx),
                    Err(e) => {
                        tracing::warn!(
                            ?e,
                            "could not start the Raft log's flushing thread: appends flush inline"
                        );
                        None
                    }
                }
            })
            .as_ref()
    }

    /// Removes every entry from `from` on, atomically (one sled batch): a crash part way must
    /// not leave a hole in the log.
    fn remove_from(&self, from: u64) -> Result<(), StorageError> {
        // The cache first: a reader must never be served an entry sled no longer has.
        self.tail().truncate(from);
        let mut batch = sled::Batch::default();
        for item in self.logs.range(key(from)..) {
            let (k, _) = item.map_err(|e| StorageIOError::write_logs(&e))?;
            batch.remove(k);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }
}

/// Removes the entries at or before `upto` (already marked purged).
fn remove_purged(logs: &sled::Tree, upto: u64) {
    for k in logs.range(..=key(upto)).keys() {
        let removed = k.and_then(|k| logs.remove(k));
        if let Err(e) = removed {
            // Harmless: readers skip purged entries, and the next purge tries again.
            tracing::warn!(error = %e, upto, "removing purged Raft log entries failed");
            return;
        }
    }
}

impl LogStore {
    /// `range` from the tail cache, when it holds all of it (what openraft asks for when it
    /// replicates or applies: explicit, recent ranges).
    fn cached<RB: RangeBounds<u64>>(&self, range: &RB, first_kept: u64) -> Option<Vec<Entry>> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i.checked_add(1)?,
            Bound::Unbounded => 0,
        }
        .max(first_kept);
        let end = match range.end_bound() {
            Bound::Included(i) => i.checked_add(1)?,
            Bound::Excluded(i) => *i,
            Bound::Unbounded => return None,
        };
        if start >= end {
            return None;
        }
        self.tail().get(start, end)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        // Purged entries may still be stored until their background removal has finished.
        let first_kept = self.first_kept.load(Ordering::Relaxed);
        if let Some(entries) = self.cached(&range, first_kept) {
            return Ok(entries);
        }
        let start = match range.start_bound() {
            Bound::Included(i) => Bound::Included(key((*i).max(first_kept))),
            Bound::Excluded(i) if *i < first_kept => Bound::Included(key(first_kept)),
            Bound::Excluded(i) => Bound::Excluded(key(*i)),
            Bound::Unbounded => Bound::Included(key(first_kept)),
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(key(*i)),
            Bound::Excluded(i) => Bound::Excluded(key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let mut entries = Vec::new();
        for item in self.logs.range((start, end)) {
            let (_, v) = item.map_err(|e| StorageIOError::read_logs(&e))?;
            entries.push(decode(&v).map_err(|e| StorageIOError::read_logs(&e))?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged: Option<LogId> = self.get_meta(LAST_PURGED)?;
        let last = match self
            .logs
            .last()
            .map_err(|e| StorageIOError::read_logs(&e))?
        {
            Some((_, v)) => {
                let entry: Entry = decode(&v).map_err(|e| StorageIOError::read_logs(&e))?;
                Some(entry.log_id)
            }
            None => last_purged,
        };
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.put_meta(VOTE, vote)
            .map_err(|e| StorageIOError::write_vote(&e))?;
        self.flush_db()
            .await
            .map_err(|e| StorageIOError::write_vote(&e))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.get_meta(VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        if let Some(c) = committed {
            self.committed_index.store(c.index, Ordering::Relaxed);
        }
        // Not flushed: losing it only means re-learning the commit index from the leader.
        self.put_meta(COMMITTED, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        let committed: Option<Option<LogId>> = self.get_meta(COMMITTED)?;
        let committed = committed.flatten();
        if let Some(c) = committed {
            self.committed_index.store(c.index, Ordering::Relaxed);
        }
        Ok(committed)
    }

    #[tracing::instrument(level = "debug", skip_all, name = "raft.append")]
    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        // One insert per entry, not one `sled::Batch`: sled starts every batch by sealing its
        // IO buffer before and after the batch's manifest (`PageCache::pin_log`), so each
        // append became three synchronous disk writes (the commit index, the manifest, the
        // entries) instead of one. Atomicity is not needed here: entries are inserted in index
        // order and sled recovers a prefix of its log, so a crash mid-append leaves a shorter
        // contiguous log, which openraft expects of an append it was never told completed.
        for entry in entries {
            let bytes = encode(&entry).map_err(|e| StorageIOError::write_logs(&e))?;
            let size = bytes.len();
            self.logs
                .insert(key(entry.log_id.index), bytes)
                .map_err(|e| StorageIOError::write_logs(&e))?;
            // After sled: a reader that misses the cache finds the entry there.
            self.tail().push(entry, size);
        }
        // Durable once the flushing thread's next sync has finished; reported then.
        let callback = match self.flusher() {
            Some(flusher) => match flusher.send(callback) {
                Ok(()) => return Ok(()),
                Err(std::sync::mpsc::SendError(callback)) => callback,
            },
            None => callback,
        };
        self.flush().await?;
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.remove_from(log_id.index)?;
        self.flush().await
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // Record the purge point first: readers skip entries at or before it from then on, so
        // the entries themselves can go later, and a crash before they have gone leaves
        // nothing inconsistent (the next purge removes what is left).
        self.mark_purged(&log_id)?;
        // Removed in the background, one key at a time: openraft waits for `purge` before it
        // handles anything else, and removing the 9,000 entries behind a snapshot as one sled
        // batch (which also blocks every other sled writer) held a replica's Raft up for over
        // 40 ms, long enough for the leader's heartbeats to it to time out.
        let logs = self.logs.clone();
        tokio::task::spawn_blocking(move || remove_purged(&logs, log_id.index));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;

    fn entry(index: u64) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Blank,
        }
    }

    async fn indexes(
        store: &mut LogStore,
        range: impl RangeBounds<u64> + Clone + Debug + Send,
    ) -> Vec<u64> {
        let entries = store.try_get_log_entries(range).await.unwrap();
        entries.iter().map(|e| e.log_id.index).collect()
    }

    fn tail_indexes(tail: &Tail, start: u64, end: u64) -> Option<Vec<u64>> {
        tail.get(start, end)
            .map(|es| es.iter().map(|e| e.log_id.index).collect())
    }

    #[test]
    fn the_tail_answers_only_ranges_it_holds_whole() {
        let mut tail = Tail::default();
        for i in 5..=9 {
            tail.push(entry(i), 10);
        }
        assert_eq!(tail_indexes(&tail, 5, 10), Some(vec![5, 6, 7, 8, 9]));
        assert_eq!(tail_indexes(&tail, 7, 9), Some(vec![7, 8]));
        assert_eq!(tail_indexes(&tail, 9, 9), Some(vec![]));
        assert_eq!(tail_indexes(&tail, 4, 8), None, "starts before the tail");
        assert_eq!(tail_indexes(&tail, 8, 11), None, "ends after the tail");
    }

    #[test]
    fn the_tail_follows_truncation_purges_and_gaps() {
        let mut tail = Tail::default();
        for i in 1..=6 {
            tail.push(entry(i), 10);
        }
        tail.truncate(4);
        assert_eq!(tail_indexes(&tail, 1, 4), Some(vec![1, 2, 3]));
        assert_eq!(tail_indexes(&tail, 1, 5), None, "4 was truncated");
        assert_eq!(tail.bytes, 30);
        // A new leader's entries from 4 on follow what is left.
        tail.push(entry(4), 10);
        assert_eq!(tail_indexes(&tail, 2, 5), Some(vec![2, 3, 4]));
        tail.purge(2);
        assert_eq!(tail_indexes(&tail, 2, 5), None, "2 was purged");
        assert_eq!(tail_indexes(&tail, 3, 5), Some(vec![3, 4]));
        // An entry that does not follow the last (a store that skipped ahead) starts afresh.
        tail.push(entry(9), 10);
        assert_eq!(tail_indexes(&tail, 9, 10), Some(vec![9]));
        assert_eq!(tail_indexes(&tail, 3, 5), None);
        assert_eq!(tail.bytes, 10);
        // Purging past everything leaves an empty tail that the next entry restarts.
        tail.purge(20);
        assert!(tail.entries.is_empty());
        tail.push(entry(21), 10);
        assert_eq!(tail_indexes(&tail, 21, 22), Some(vec![21]));
    }

    #[test]
    fn the_tail_keeps_within_its_bounds() {
        let mut tail = Tail::default();
        for i in 1..=(TAIL_MAX_ENTRIES as u64 + 10) {
            tail.push(entry(i), 1);
        }
        assert_eq!(tail.entries.len(), TAIL_MAX_ENTRIES);
        assert_eq!(tail.first, 11);
        let mut big = Tail::default();
        for i in 1..=4 {
            big.push(entry(i), TAIL_MAX_BYTES / 3);
        }
        assert_eq!(big.entries.len(), 3);
        assert_eq!(big.first, 2);
        // One entry larger than the whole budget is still kept: it is the one being sent.
        big.push(entry(5), TAIL_MAX_BYTES * 2);
        assert_eq!(tail_indexes(&big, 5, 6), Some(vec![5]));
    }

    #[tokio::test]
    async fn reads_come_from_the_tail_and_never_return_what_was_truncated_or_purged() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let mut store = LogStore::open(&db).unwrap();
        for i in 1..=8 {
            let e = entry(i);
            store.logs.insert(key(i), encode(&e).unwrap()).unwrap();
            store.tail().push(e, 1);
        }
        // Served from the tail: sled no longer has 7, the cache does.
        store.logs.remove(key(7)).unwrap();
        assert_eq!(indexes(&mut store, 6..8).await, vec![6, 7]);
        store
            .logs
            .insert(key(7), encode(&entry(7)).unwrap())
            .unwrap();
        store.remove_from(6).unwrap();
        assert_eq!(indexes(&mut store, 1..=8).await, vec![1, 2, 3, 4, 5]);
        store.mark_purged(&entry(2).log_id).unwrap();
        assert_eq!(indexes(&mut store, 1..5).await, vec![3, 4]);
        assert_eq!(
            indexes(&mut store, ..).await,
            vec![3, 4, 5],
            "unbounded: from sled"
        );
    }

    #[tokio::test]
    async fn purged_entries_are_skipped_until_removed_and_then_gone() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let mut store = LogStore::open(&db).unwrap();
        for i in 1..=10 {
            store
                .logs
                .insert(key(i), encode(&entry(i)).unwrap())
                .unwrap();
        }
        // What `purge` leaves before its background removal has run.
        store.mark_purged(&entry(4).log_id).unwrap();
        assert_eq!(indexes(&mut store, ..).await, (5..=10).collect::<Vec<_>>());
        assert_eq!(indexes(&mut store, 2..7).await, vec![5, 6]);
        assert_eq!(indexes(&mut store, ..=4).await, Vec::<u64>::new());
        let from_three = (Bound::Excluded(3), Bound::Included(6));
        assert_eq!(indexes(&mut store, from_three).await, vec![5, 6]);
        let from_five = (Bound::Excluded(5), Bound::Unbounded);
        assert_eq!(
            indexes(&mut store, from_five).await,
            (6..=10).collect::<Vec<_>>()
        );
        assert_eq!(store.logs.len(), 10, "nothing removed yet");
        let mut reopened = LogStore::open(&db).unwrap();
        assert_eq!(
            indexes(&mut reopened, ..).await,
            (5..=10).collect::<Vec<_>>(),
            "the purge point is read back at open"
        );

        remove_purged(&store.logs, 4);
        assert_eq!(store.logs.len(), 6);
        assert_eq!(indexes(&mut store, ..).await, (5..=10).collect::<Vec<_>>());
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id.map(|l| l.index), Some(4));
        assert_eq!(state.last_log_id.map(|l| l.index), Some(10));
    }
}
