//! An in-memory Raft log store for the simulation. Its `Disk` outlives a simulated crash, as
//! a replica's data directory does: a restarted replica finds its log, vote and purge point.
//! Each incarnation writes through an `alive` flag, so tasks of a crashed incarnation that are
//! still unwinding cannot write to the disk its successor uses.
//!
//! Every write is durable when it returns (the callback of `append` fires only after the
//! entries are in `Disk`), matching the sled store's contract of flushing before acknowledging.

// openraft's StorageError is large by design, as in `raft/`.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader, Vote};

use crate::raft::{Entry, LogId, NodeId, StorageError, TypeConfig};

/// What a replica keeps on disk.
#[derive(Default)]
pub struct Disk {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId>,
    last_purged: Option<LogId>,
    logs: BTreeMap<u64, Entry>,
    /// How long an append takes to become durable (simulated time): a slow disk.
    pub sync_delay: std::time::Duration,
}

#[derive(Clone)]
pub struct MemLogStore {
    disk: Arc<Mutex<Disk>>,
    alive: Arc<AtomicBool>,
    committed_index: Arc<AtomicU64>,
}

impl MemLogStore {
    pub fn new(disk: Arc<Mutex<Disk>>, alive: Arc<AtomicBool>) -> MemLogStore {
        MemLogStore {
            disk,
            alive,
            committed_index: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed_index.clone()
    }

    fn disk(&self) -> MutexGuard<'_, Disk> {
        self.disk.lock().expect("simulated disk lock poisoned")
    }

    /// Writes only while this incarnation is alive.
    fn write(&self, f: impl FnOnce(&mut Disk)) {
        if self.alive.load(Ordering::Relaxed) {
            f(&mut self.disk());
        }
    }
}

impl RaftLogReader<TypeConfig> for MemLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(self
            .disk()
            .logs
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }
}

impl RaftLogStorage<TypeConfig> for MemLogStore {
    type LogReader = MemLogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let d = self.disk();
        let last = d
            .logs
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(d.last_purged);
        Ok(LogState {
            last_purged_log_id: d.last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.write(|d| d.vote = Some(*vote));
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(self.disk().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        if let Some(c) = committed {
            self.committed_index.store(c.index, Ordering::Relaxed);
        }
        self.write(|d| d.committed = committed);
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        let c = self.disk().committed;
        if let Some(c) = c {
            self.committed_index.store(c.index, Ordering::Relaxed);
        }
        Ok(c)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let sync_delay = self.disk().sync_delay;
        if !sync_delay.is_zero() {
            tokio::time::sleep(sync_delay).await;
        }
        self.write(|d| {
            for e in entries {
                d.logs.insert(e.log_id.index, e);
            }
        });
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.write(|d| {
            d.logs.split_off(&log_id.index);
        });
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.write(|d| {
            d.last_purged = Some(log_id);
            d.logs = d.logs.split_off(&(log_id.index + 1));
        });
        Ok(())
    }
}
