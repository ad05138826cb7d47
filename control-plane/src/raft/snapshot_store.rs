//! Where the latest snapshot's bytes are kept, written and read a chunk at a time.
//!
//! In sled a snapshot is stored in chunks under `chunk/GENERATION/N`, and `SNAPSHOT_KEY` holds a
//! pointer to the generation (`CHUNKED_POINTER`, generation, chunk count, length). sled copies a
//! value at least twice on insert and keeps it in its cache: one value of hundreds of megabytes
//! cost as much memory again as the state it was made from. A snapshot is also never whole in
//! memory: [`SnapshotWriter`] stores each chunk as soon as it is full (the state is serialized
//! straight into it), and [`SnapshotData`] reads a stored snapshot back a chunk at a time (for
//! a restart, and for openraft to stream it to a follower).
//!
//! A generation being read stays on disk until its readers are gone, even when a newer snapshot
//! replaces it: a follower's transfer of the previous snapshot does not fail half-way.

use std::any::Any;
use std::collections::BTreeMap;
use std::io::{self, Cursor, Read, Seek, SeekFrom, Write};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncSeek, AsyncWrite, ReadBuf};

pub(crate) const SNAPSHOT_KEY: &str = "current";
/// Chunk size of new snapshots. sled keeps a leaf of up to 17 entries and rewrites it whole
/// every few changes, so the chunk size sets what each insert costs: 256 KiB stored a 240 MiB
/// snapshot faster than 1 or 4 MiB (`gpuctl bench memory`), and much faster than chunks small
/// enough for sled to keep inline (4 KiB: over twice as long, with the state locked). Readers
/// take the size of a stored snapshot's chunks from its first chunk: snapshots written with
/// other sizes (4 MiB before streaming) still read.
pub(crate) const SNAPSHOT_CHUNK_BYTES: usize = 256 * 1024;
/// A stored snapshot's memory goes back to the OS every this many chunks (8 MiB).
const TRIM_EVERY_CHUNKS: usize = 32;

/// After flushing a chunk, a snapshot's writer waits this many times as long as the flush
/// took before it writes the next, leaving the disk to the Raft log most of the time.
const STORE_PACING_FACTOR: u32 = 2;

const CHUNKED_POINTER: &[u8; 8] = b"GPUCPSC1";
pub(crate) const CHUNK_PREFIX: &[u8] = b"chunk/";

/// Hands memory freed by a large snapshot (its buffers, the old state's many small blocks) back
/// to the OS: glibc keeps freed heap memory otherwise, and the replica's RSS would stay at the
/// snapshot's peak.
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

pub(crate) fn chunk_key(generation: u64, n: u32) -> Vec<u8> {
    let mut key = CHUNK_PREFIX.to_vec();
    key.extend_from_slice(&generation.to_be_bytes());
    key.extend_from_slice(&n.to_be_bytes());
    key
}

fn generation_of(key: &[u8]) -> Option<u64> {
    let rest = key.strip_prefix(CHUNK_PREFIX)?;
    let (generation, _) = rest.split_first_chunk::<8>()?;
    Some(u64::from_be_bytes(*generation))
}

/// (generation, chunks, length) from a pointer value, or `None` for a snapshot stored whole
/// (before chunks).
pub(crate) fn parse_pointer(value: &[u8]) -> Option<(u64, u32, u64)> {
    let rest = value.strip_prefix(CHUNKED_POINTER.as_slice())?;
    let (generation, rest) = rest.split_first_chunk::<8>()?;
    let (chunks, rest) = rest.split_first_chunk::<4>()?;
    let (len, _) = rest.split_first_chunk::<8>()?;
    Some((
        u64::from_le_bytes(*generation),
        u32::from_le_bytes(*chunks),
        u64::from_le_bytes(*len),
    ))
}

/// Where the latest snapshot is kept: sled in production; a shared in-memory slot in the
/// deterministic simulation, where it outlives a simulated crash as a disk would.
#[derive(Clone)]
pub enum SnapshotStore {
    Sled(sled::Tree),
    Memory(Arc<Mutex<Option<Vec<u8>>>>),
}

/// A snapshot store and what is being done with it: one writer at a time, and the generations
/// that readers still need.
#[derive(Clone)]
pub(crate) struct Snapshots {
    store: SnapshotStore,
    writing: Arc<Mutex<()>>,
    /// Readers per generation (sled only).
    readers: Arc<Mutex<BTreeMap<u64, usize>>>,
}

fn sled_io(e: sled::Error) -> io::Error {
    io::Error::other(e.to_string())
}

impl Snapshots {
    pub(crate) fn new(store: SnapshotStore) -> Snapshots {
        Snapshots {
            store,
            writing: Arc::default(),
            readers: Arc::default(),
        }
    }

    fn readers(&self) -> MutexGuard<'_, BTreeMap<u64, usize>> {
        self.readers.lock().expect("snapshot readers poisoned")
    }

    /// Starts a new snapshot; it replaces the current one when [`SnapshotWriter::finish`]
    /// returns. Until then, and if the writer is dropped unfinished, the current one stays.
    /// Writers wait for each other. `pacing` says whether the writer leaves the disk to the
    /// Raft log between chunks (a snapshot this replica built: background work) or writes as
    /// fast as it can (a snapshot received from the leader, which this replica needs to
    /// catch up).
    pub(crate) fn writer(&self, pacing: Pacing) -> io::Result<SnapshotWriter<'_>> {
        let guard = self.writing.lock().expect("snapshot writer poisoned");
        let generation = match &self.store {
            // After the current generation and after any chunks left by a write that did not
            // finish (their generation is removed when this one is made current).
            SnapshotStore::Sled(tree) => {
                let current = tree
                    .get(SNAPSHOT_KEY)
                    .map_err(sled_io)?
                    .as_deref()
                    .and_then(parse_pointer)
                    .map_or(0, |(g, _, _)| g);
                let last = match tree.scan_prefix(CHUNK_PREFIX).keys().next_back() {
                    Some(key) => generation_of(&key.map_err(sled_io)?).unwrap_or(0),
                    None => 0,
                };
                current.max(last) + 1
            }
            SnapshotStore::Memory(_) => 0,
        };
        Ok(SnapshotWriter {
            snapshots: self,
            _writing: guard,
            buf: Vec::new(),
            sink: Sink {
                tree: match &self.store {
                    SnapshotStore::Sled(tree) => Some(tree.clone()),
                    SnapshotStore::Memory(_) => None,
                },
                whole: Vec::new(),
                generation,
                chunks: 0,
                len: 0,
                pacing,
            },
        })
    }

    /// The stored snapshot, whole bytes from the start, or `None` if there is none.
    pub(crate) fn reader(&self) -> io::Result<Option<StoredReader>> {
        match &self.store {
            SnapshotStore::Memory(slot) => Ok(slot
                .lock()
                .expect("snapshot slot poisoned")
                .clone()
                .map(|bytes| StoredReader::Bytes(Cursor::new(bytes)))),
            SnapshotStore::Sled(tree) => {
                // Under the readers' lock: a writer cannot remove this generation between
                // reading the pointer and registering the reader.
                let mut readers = self.readers();
                let Some(value) = tree.get(SNAPSHOT_KEY).map_err(sled_io)? else {
                    return Ok(None);
                };
                let Some((generation, chunks, len)) = parse_pointer(&value) else {
                    return Ok(Some(StoredReader::Bytes(Cursor::new(value.to_vec()))));
                };
                let chunk_size = if chunks > 1 {
                    let first = tree
                        .get(chunk_key(generation, 0))
                        .map_err(sled_io)?
                        .ok_or_else(|| missing(generation, 0))?;
                    first.len() as u64
                } else {
                    len.max(1)
                };
                *readers.entry(generation).or_default() += 1;
                Ok(Some(StoredReader::Chunks(ChunkReader {
                    _pin: ReadPin {
                        snapshots: self.clone(),
                        generation,
                    },
                    tree: tree.clone(),
                    generation,
                    chunks,
                    chunk_size,
                    len,
                    pos: 0,
                    chunk: None,
                })))
            }
        }
    }

    /// Removes the chunks of every generation but `current` that no reader needs (older ones,
    /// and those of a write that crashed or was dropped before its pointer switch).
    fn remove_unused(&self, tree: &sled::Tree, current: u64) -> Result<(), sled::Error> {
        let readers = self.readers();
        for key in tree.scan_prefix(CHUNK_PREFIX).keys() {
            let key = key?;
            match generation_of(&key) {
                Some(g) if g == current || readers.contains_key(&g) => {}
                _ => {
                    tree.remove(key)?;
                }
            }
        }
        Ok(())
    }
}

fn missing(generation: u64, n: u32) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("chunk {n} of snapshot generation {generation} is missing"),
    )
}

/// How a snapshot writer shares the disk with the Raft log (see [`Snapshots::writer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pacing {
    /// After each chunk, wait `STORE_PACING_FACTOR` times as long as its flush took.
    Background,
    /// No pauses.
    Urgent,
}

/// Stores a snapshot's chunks as they come (sled), or keeps the whole (memory).
struct Sink {
    /// `None`: the memory store, kept whole in `whole`.
    tree: Option<sled::Tree>,
    whole: Vec<u8>,
    generation: u64,
    chunks: u32,
    len: u64,
    pacing: Pacing,
}

impl Sink {
    /// Stores one chunk (all but the last of a snapshot must have the same size).
    fn put(&mut self, chunk: &[u8]) -> io::Result<()> {
        self.len += chunk.len() as u64;
        let Some(tree) = &self.tree else {
            self.whole.extend_from_slice(chunk);
            return Ok(());
        };
        tree.insert(chunk_key(self.generation, self.chunks), chunk)
            .map_err(sled_io)?;
        self.chunks += 1;
        // The Raft log shares sled's IO buffers, and a log append's flush first writes
        // everything inserted before it. Flushed chunk by chunk, with a pause after each, a
        // snapshot never puts more than one 256 KiB chunk in front of an append. Written in
        // one go, three replicas' 6 MB snapshots (10,000 jobs) held appends up for 70–200 ms
        // on a virtual disk (`gpuctl bench submit`), and replication timed out.
        let started = std::time::Instant::now();
        tree.flush().map_err(sled_io)?;
        if self.pacing == Pacing::Background {
            std::thread::sleep(started.elapsed() * STORE_PACING_FACTOR);
        }
        Ok(())
    }
}

/// Writes a snapshot a chunk at a time (see [`Snapshots::writer`]).
pub(crate) struct SnapshotWriter<'a> {
    snapshots: &'a Snapshots,
    _writing: MutexGuard<'a, ()>,
    /// The chunk being filled.
    buf: Vec<u8>,
    sink: Sink,
}

impl SnapshotWriter<'_> {
    /// Stores what is left, flushes, then switches the pointer (flushed) and removes the old
    /// generation: a crash at any point leaves the previous or the new snapshot whole.
    /// Returns a reader of the snapshot just stored (taken before another writer can replace
    /// it).
    pub(crate) fn finish(mut self) -> io::Result<StoredReader> {
        if !self.buf.is_empty() {
            let last = std::mem::take(&mut self.buf);
            self.sink.put(&last)?;
        }
        let len = self.sink.len;
        match &self.snapshots.store {
            SnapshotStore::Memory(slot) => {
                *slot.lock().expect("snapshot slot poisoned") =
                    Some(std::mem::take(&mut self.sink.whole));
            }
            SnapshotStore::Sled(tree) => {
                tree.flush().map_err(sled_io)?;
                let mut pointer = CHUNKED_POINTER.to_vec();
                pointer.extend_from_slice(&self.sink.generation.to_le_bytes());
                pointer.extend_from_slice(&self.sink.chunks.to_le_bytes());
                pointer.extend_from_slice(&len.to_le_bytes());
                tree.insert(SNAPSHOT_KEY, pointer).map_err(sled_io)?;
                tree.flush().map_err(sled_io)?;
                self.snapshots
                    .remove_unused(tree, self.sink.generation)
                    .map_err(sled_io)?;
                tree.flush().map_err(sled_io)?;
            }
        }
        let reader = self
            .snapshots
            .reader()?
            .ok_or_else(|| io::Error::other("the snapshot just stored is not there"))?;
        debug_assert_eq!(reader.len(), len);
        Ok(reader)
    }
}

/// Fills chunks of `SNAPSHOT_CHUNK_BYTES`, calling `full` with each one as it fills.
fn fill_chunks(
    buf: &mut Vec<u8>,
    mut data: &[u8],
    mut full: impl FnMut(Vec<u8>) -> io::Result<()>,
) -> io::Result<()> {
    let size = SNAPSHOT_CHUNK_BYTES;
    while !data.is_empty() {
        if buf.capacity() < size {
            buf.reserve_exact(size - buf.len());
        }
        let n = (size - buf.len()).min(data.len());
        buf.extend_from_slice(&data[..n]);
        data = &data[n..];
        if buf.len() == size {
            let chunk = std::mem::replace(buf, Vec::with_capacity(size));
            full(chunk)?;
        }
    }
    Ok(())
}

impl Write for SnapshotWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let sink = &mut self.sink;
        fill_chunks(&mut self.buf, data, |chunk| sink.put(&chunk))?;
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Bytes in memory, in chunks of `SNAPSHOT_CHUNK_BYTES`: a snapshot serialized under the
/// state's lock, to be stored after it is released. Chunks, not one buffer: no reallocation
/// copies the bytes while they grow, and each chunk is freed as soon as it is stored.
#[derive(Default)]
pub(crate) struct ChunkedBuf {
    full: Vec<Vec<u8>>,
    buf: Vec<u8>,
}

impl ChunkedBuf {
    pub(crate) fn len(&self) -> u64 {
        (self.full.len() * SNAPSHOT_CHUNK_BYTES + self.buf.len()) as u64
    }

    /// Stores the bytes through `writer`, freeing each chunk once it is written, and handing
    /// the freed memory back to the OS every `TRIM_EVERY_CHUNKS` chunks. Once glibc has raised
    /// its mmap threshold (it does when any mapped block of that size is freed), the chunks
    /// come from the heap, and freed heap memory stays resident: at a million jobs the peak
    /// was the snapshot twice over: 1,068 MiB, against 871 with this trim (`gpuctl bench memory`).
    pub(crate) fn store_into(self, writer: &mut SnapshotWriter<'_>) -> io::Result<()> {
        for (n, chunk) in self.full.into_iter().chain([self.buf]).enumerate() {
            writer.write_all(&chunk)?;
            drop(chunk);
            if (n + 1) % TRIM_EVERY_CHUNKS == 0 {
                release_freed_memory();
            }
        }
        Ok(())
    }
}

impl ChunkedBuf {
    /// The bytes as they were written, a chunk at a time (each `SNAPSHOT_CHUNK_BYTES` but the
    /// last).
    pub(crate) fn into_chunks(self) -> impl Iterator<Item = Vec<u8>> {
        self.full.into_iter().chain([self.buf])
    }
}

impl Write for ChunkedBuf {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let full = &mut self.full;
        fill_chunks(&mut self.buf, data, |chunk| {
            full.push(chunk);
            Ok(())
        })?;
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Keeps a generation's chunks on disk while it is read.
struct ReadPin {
    snapshots: Snapshots,
    generation: u64,
}

impl Drop for ReadPin {
    fn drop(&mut self) {
        let mut readers = self.snapshots.readers();
        if let Some(n) = readers.get_mut(&self.generation) {
            *n -= 1;
            if *n == 0 {
                readers.remove(&self.generation);
            }
        }
        // A generation replaced while it was read is removed by the next snapshot written.
    }
}

/// A stored snapshot's bytes, read a chunk at a time.
pub(crate) struct ChunkReader {
    _pin: ReadPin,
    tree: sled::Tree,
    generation: u64,
    chunks: u32,
    chunk_size: u64,
    len: u64,
    pos: u64,
    chunk: Option<(u32, sled::IVec)>,
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos >= self.len || out.is_empty() {
            return Ok(0);
        }
        let n = u32::try_from(self.pos / self.chunk_size)
            .map_err(|_| io::Error::other("snapshot position past its chunks"))?;
        if n >= self.chunks {
            return Err(io::Error::other(format!(
                "snapshot generation {} has fewer bytes than its pointer says",
                self.generation
            )));
        }
        if self.chunk.as_ref().is_none_or(|(c, _)| *c != n) {
            self.chunk = None;
            let chunk = self
                .tree
                .get(chunk_key(self.generation, n))
                .map_err(sled_io)?
                .ok_or_else(|| missing(self.generation, n))?;
            self.chunk = Some((n, chunk));
        }
        let (_, chunk) = self.chunk.as_ref().expect("chunk just read");
        let at = (self.pos - u64::from(n) * self.chunk_size) as usize;
        if at >= chunk.len() {
            return Err(io::Error::other(format!(
                "chunk {n} of snapshot generation {} is shorter than its others",
                self.generation
            )));
        }
        let k = (chunk.len() - at)
            .min(out.len())
            .min((self.len - self.pos) as usize);
        out[..k].copy_from_slice(&chunk[at..at + k]);
        self.pos += k as u64;
        Ok(k)
    }
}

fn seek_to(pos: u64, len: u64, to: SeekFrom) -> io::Result<u64> {
    let target = match to {
        SeekFrom::Start(n) => Some(n),
        SeekFrom::End(d) => len.checked_add_signed(d),
        SeekFrom::Current(d) => pos.checked_add_signed(d),
    };
    target.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before the start"))
}

impl Seek for ChunkReader {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        self.pos = seek_to(self.pos, self.len, to)?;
        Ok(self.pos)
    }
}

/// A stored snapshot from its first byte: chunks in sled, or bytes already in memory (a
/// snapshot stored whole before chunks, or the simulation's store).
pub(crate) enum StoredReader {
    Bytes(Cursor<Vec<u8>>),
    Chunks(ChunkReader),
}

impl Read for StoredReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        match self {
            StoredReader::Bytes(c) => c.read(out),
            StoredReader::Chunks(c) => c.read(out),
        }
    }
}

impl Seek for StoredReader {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        match self {
            StoredReader::Bytes(c) => c.seek(to),
            StoredReader::Chunks(c) => c.seek(to),
        }
    }
}

impl StoredReader {
    pub(crate) fn len(&self) -> u64 {
        match self {
            StoredReader::Bytes(c) => c.get_ref().len() as u64,
            StoredReader::Chunks(c) => c.len,
        }
    }

    /// All of it, from the start.
    pub(crate) fn into_bytes(self) -> io::Result<Vec<u8>> {
        match self {
            StoredReader::Bytes(c) => Ok(c.into_inner()),
            StoredReader::Chunks(mut c) => {
                let mut out = Vec::with_capacity(c.len as usize);
                c.seek(SeekFrom::Start(0))?;
                c.read_to_end(&mut out)?;
                Ok(out)
            }
        }
    }
}

/// Checks the bytes of a snapshot received from the leader once the last chunk is in, and
/// returns what it decoded them to (kept for the install, so they are decoded once).
pub(crate) type ReceivedCheck = Box<dyn FnOnce(&[u8]) -> io::Result<Box<dyn Any + Send>> + Send>;

/// openraft's snapshot data: what a follower receives (in memory), or the data of a stored
/// snapshot from `offset` on, read from its chunks as openraft streams it to a follower.
/// Positions are relative to the data's start.
pub struct SnapshotData {
    inner: StoredReader,
    offset: u64,
    /// A snapshot being received: checked when openraft shuts the writer down after the last
    /// chunk, *before* it hands the snapshot to its core. openraft's core treats an install
    /// that fails as a storage failure and stops (and it has already moved its commit index
    /// and membership to the snapshot's by then), so a snapshot cut short or damaged must be
    /// refused here, where the error goes back to the sender and nothing has changed.
    check: Option<ReceivedCheck>,
    /// What `check` decoded.
    checked: Option<Box<dyn Any + Send>>,
}

impl SnapshotData {
    /// Bytes in memory (what a follower receives).
    pub fn from_bytes(bytes: Vec<u8>) -> SnapshotData {
        SnapshotData {
            inner: StoredReader::Bytes(Cursor::new(bytes)),
            offset: 0,
            check: None,
            checked: None,
        }
    }

    /// An empty buffer for a snapshot about to be received, whose bytes `check` checks once
    /// they are complete (see [`SnapshotData::check`]).
    pub(crate) fn receiving(check: ReceivedCheck) -> SnapshotData {
        SnapshotData {
            check: Some(check),
            ..SnapshotData::from_bytes(Vec::new())
        }
    }

    /// What the check of a received snapshot decoded, if it ran.
    pub(crate) fn take_checked(&mut self) -> Option<Box<dyn Any + Send>> {
        self.checked.take()
    }

    /// A stored snapshot's data, which starts at `offset` in it.
    pub(crate) fn stored(mut inner: StoredReader, offset: u64) -> io::Result<SnapshotData> {
        inner.seek(SeekFrom::Start(offset))?;
        Ok(SnapshotData {
            inner,
            offset,
            check: None,
            checked: None,
        })
    }

    /// The data's length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len().saturating_sub(self.offset)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All of the data, in memory.
    pub fn into_bytes(self) -> io::Result<Vec<u8>> {
        match self.inner {
            StoredReader::Bytes(c) if self.offset == 0 => Ok(c.into_inner()),
            StoredReader::Bytes(c) => Ok(c.into_inner().split_off(self.offset as usize)),
            StoredReader::Chunks(mut c) => {
                let mut out = Vec::with_capacity(c.len.saturating_sub(self.offset) as usize);
                c.seek(SeekFrom::Start(self.offset))?;
                c.read_to_end(&mut out)?;
                Ok(out)
            }
        }
    }
}

impl Read for SnapshotData {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        self.inner.read(out)
    }
}

impl Seek for SnapshotData {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let len = self.len();
        let current = self.inner.stream_position()? - self.offset;
        let target = seek_to(current, len, to)?;
        Ok(self.inner.seek(SeekFrom::Start(self.offset + target))? - self.offset)
    }
}

// openraft drives these from its tasks; every operation completes at once (a chunk read from
// sled is a short blocking read, as every sled access in this crate is).
impl AsyncRead for SnapshotData {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let n = this.read(buf.initialize_unfilled())?;
        buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncSeek for SnapshotData {
    fn start_seek(self: Pin<&mut Self>, to: SeekFrom) -> io::Result<()> {
        self.get_mut().seek(to).map(|_| ())
    }

    fn poll_complete(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<u64>> {
        let this = self.get_mut();
        Poll::Ready(this.inner.stream_position().map(|p| p - this.offset))
    }
}

impl AsyncWrite for SnapshotData {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match &mut this.inner {
            StoredReader::Bytes(c) if this.offset == 0 => Poll::Ready(c.write(data)),
            _ => Poll::Ready(Err(io::Error::other("a stored snapshot is read-only"))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// openraft shuts a received snapshot's writer down after its last chunk: the moment to
    /// check it (see [`SnapshotData::check`]). An error here is answered to the sender.
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(check) = this.check.take() {
            let StoredReader::Bytes(received) = &this.inner else {
                return Poll::Ready(Err(io::Error::other("a stored snapshot is read-only")));
            };
            this.checked = Some(check(received.get_ref())?);
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sled_store() -> (sled::Db, sled::Tree, Snapshots) {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let tree = db.open_tree("snapshot").unwrap();
        let s = Snapshots::new(SnapshotStore::Sled(tree.clone()));
        (db, tree, s)
    }

    fn put(s: &Snapshots, bytes: &[u8]) {
        let mut w = s.writer(Pacing::Urgent).unwrap();
        // In uneven pieces, as serde_json writes.
        for piece in bytes.chunks(7777) {
            w.write_all(piece).unwrap();
        }
        assert_eq!(w.finish().unwrap().into_bytes().unwrap(), bytes);
    }

    fn get(s: &Snapshots) -> Option<Vec<u8>> {
        s.reader().unwrap().map(|r| r.into_bytes().unwrap())
    }

    #[test]
    fn sled_keeps_a_snapshot_in_chunks_and_only_the_latest_generation() {
        let (_db, tree, s) = sled_store();
        // A snapshot stored whole, as before chunks, still reads.
        tree.insert(SNAPSHOT_KEY, b"whole".as_slice()).unwrap();
        assert_eq!(get(&s).unwrap(), b"whole");

        let big: Vec<u8> = (0..2 * SNAPSHOT_CHUNK_BYTES + 7).map(|i| i as u8).collect();
        put(&s, &big);
        assert_eq!(get(&s).unwrap(), big);
        assert_eq!(tree.scan_prefix(CHUNK_PREFIX).count(), 3);

        put(&s, b"small");
        assert_eq!(get(&s).unwrap(), b"small");
        assert_eq!(
            tree.scan_prefix(CHUNK_PREFIX).count(),
            1,
            "old chunks left behind"
        );

        let value = tree.get(SNAPSHOT_KEY).unwrap().unwrap();
        let (generation, _, _) = parse_pointer(&value).unwrap();
        tree.remove(chunk_key(generation, 0)).unwrap();
        let err = s.reader().unwrap().unwrap().into_bytes().unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn an_unfinished_write_leaves_the_previous_snapshot() {
        let (_db, tree, s) = sled_store();
        put(&s, b"first");
        {
            let mut w = s.writer(Pacing::Urgent).unwrap();
            w.write_all(&vec![1u8; 3 * SNAPSHOT_CHUNK_BYTES]).unwrap();
            // Dropped: a build that failed half-way.
        }
        assert_eq!(get(&s).unwrap(), b"first");
        put(&s, b"second");
        assert_eq!(get(&s).unwrap(), b"second");
        assert_eq!(tree.scan_prefix(CHUNK_PREFIX).count(), 1);
    }

    #[test]
    fn chunks_of_another_size_still_read_and_seek() {
        // As a snapshot written with 4 MiB chunks before: the reader takes the size from the
        // first chunk.
        let (_db, tree, s) = sled_store();
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for (n, chunk) in bytes.chunks(4096).enumerate() {
            tree.insert(chunk_key(5, n as u32), chunk).unwrap();
        }
        let mut pointer = CHUNKED_POINTER.to_vec();
        pointer.extend_from_slice(&5u64.to_le_bytes());
        pointer.extend_from_slice(&3u32.to_le_bytes());
        pointer.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        tree.insert(SNAPSHOT_KEY, pointer).unwrap();
        assert_eq!(get(&s).unwrap(), bytes);

        let mut data = SnapshotData::stored(s.reader().unwrap().unwrap(), 100).unwrap();
        assert_eq!(data.len(), bytes.len() as u64 - 100);
        assert_eq!(data.seek(SeekFrom::End(0)).unwrap(), data.len());
        assert_eq!(data.seek(SeekFrom::Start(5000)).unwrap(), 5000);
        let mut buf = vec![0; 3000];
        data.read_exact(&mut buf).unwrap();
        assert_eq!(buf, bytes[5100..8100]);
        assert_eq!(data.into_bytes().unwrap(), bytes[100..]);
    }

    #[test]
    fn a_generation_being_read_outlives_a_newer_snapshot() {
        let (_db, tree, s) = sled_store();
        let old: Vec<u8> = (0..SNAPSHOT_CHUNK_BYTES + 10).map(|i| i as u8).collect();
        put(&s, &old);
        let reader = s.reader().unwrap().unwrap();
        let StoredReader::Chunks(c) = &reader else {
            panic!("not chunked")
        };
        let generation = c.generation;
        put(&s, b"newer");
        assert_eq!(get(&s).unwrap(), b"newer");
        assert_eq!(
            reader.into_bytes().unwrap(),
            old,
            "the old generation was removed"
        );
        // Once its reader is gone, the next snapshot removes it.
        put(&s, b"newest");
        assert_eq!(tree.scan_prefix(CHUNK_PREFIX).count(), 1);
        assert!(tree.get(chunk_key(generation, 0)).unwrap().is_none());
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn tree_contents(tree: &sled::Tree) -> Vec<(Vec<u8>, Vec<u8>)> {
        tree.iter()
            .map(|kv| {
                let (k, v) = kv.unwrap();
                (k.to_vec(), v.to_vec())
            })
            .collect()
    }

    #[test]
    fn a_stored_snapshot_cut_short_or_damaged_is_refused_on_open_and_left_as_it_was() {
        use crate::raft::state_machine::StateMachineStore;
        use openraft::RaftSnapshotBuilder;
        let db = sled::Config::new().temporary(true).open().unwrap();
        let mut sm = StateMachineStore::open(&db).unwrap();
        block_on(sm.build_snapshot()).unwrap();
        drop(sm);
        let tree = db.open_tree("snapshot").unwrap();
        let good = tree_contents(&tree);
        let pointer = tree.get(SNAPSHOT_KEY).unwrap().unwrap().to_vec();
        let (generation, chunks, len) = parse_pointer(&pointer).unwrap();
        assert_eq!(chunks, 1);
        let chunk = tree
            .get(chunk_key(generation, 0))
            .unwrap()
            .unwrap()
            .to_vec();
        let with_pointer = |chunks: u32, len: u64| {
            let mut p = CHUNKED_POINTER.to_vec();
            p.extend_from_slice(&generation.to_le_bytes());
            p.extend_from_slice(&chunks.to_le_bytes());
            p.extend_from_slice(&len.to_le_bytes());
            p
        };
        type Damage<'a> = Box<dyn Fn(&sled::Tree) + 'a>;
        let half = chunk.len() / 2;
        let cases: Vec<(&str, Damage<'_>, &str)> = vec![
            (
                "cut in half (a torn write)",
                Box::new(|t| {
                    t.insert(chunk_key(generation, 0), &chunk[..half]).unwrap();
                    t.insert(SNAPSHOT_KEY, with_pointer(1, half as u64))
                        .unwrap();
                }),
                "the stored snapshot's state does not decode",
            ),
            (
                "cut inside its header",
                Box::new(|t| {
                    t.insert(chunk_key(generation, 0), &chunk[..10]).unwrap();
                    t.insert(SNAPSHOT_KEY, with_pointer(1, 10)).unwrap();
                }),
                "the snapshot ends inside its header",
            ),
            (
                "shorter than its pointer says",
                Box::new(|t| {
                    t.insert(SNAPSHOT_KEY, with_pointer(2, len + 1000)).unwrap();
                }),
                "missing",
            ),
            (
                "its chunk lost",
                Box::new(|t| {
                    t.remove(chunk_key(generation, 0)).unwrap();
                }),
                "chunk 0 of snapshot generation",
            ),
            (
                "a flipped byte",
                Box::new(|t| {
                    let mut c = chunk.clone();
                    *c.last_mut().unwrap() ^= 0x40;
                    t.insert(chunk_key(generation, 0), c).unwrap();
                }),
                "the stored snapshot's state does not decode",
            ),
        ];
        for (what, damage, want) in cases {
            tree.clear().unwrap();
            for (k, v) in &good {
                tree.insert(k, v.as_slice()).unwrap();
            }
            damage(&tree);
            let damaged = tree_contents(&tree);
            let err = StateMachineStore::open(&db).err().expect(what);
            assert!(err.contains(want), "{what}: {err}");
            assert_eq!(
                tree_contents(&tree),
                damaged,
                "{what}: the store was rewritten"
            );
        }
    }

    #[test]
    fn a_received_snapshot_cut_short_is_refused_before_it_is_installed() {
        use crate::raft::state_machine::StateMachineStore;
        use openraft::storage::RaftStateMachine;
        use tokio::io::AsyncWriteExt;
        let db = sled::Config::new().temporary(true).open().unwrap();
        let mut sm = StateMachineStore::open(&db).unwrap();
        let state = serde_json::to_vec(&*sm.read()).unwrap();
        for cut in [0, 1, state.len() / 2, state.len() - 1] {
            let mut received = block_on(sm.begin_receiving_snapshot()).unwrap();
            block_on(received.write_all(&state[..cut])).unwrap();
            let err = block_on(received.shutdown()).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{cut}: {err}");
            assert!(
                err.to_string()
                    .starts_with(&format!("the received snapshot ({cut} bytes) is refused")),
                "{cut}: {err}"
            );
        }
        assert!(
            db.open_tree("snapshot").unwrap().is_empty(),
            "nothing was stored"
        );
        // Whole, it is checked once and installed from what the check decoded.
        let mut received = block_on(sm.begin_receiving_snapshot()).unwrap();
        block_on(received.write_all(&state)).unwrap();
        block_on(received.shutdown()).unwrap();
        assert!(received.checked.is_some());
        let meta = openraft::SnapshotMeta {
            snapshot_id: "whole".into(),
            ..Default::default()
        };
        block_on(sm.install_snapshot(&meta, received)).unwrap();
        assert_eq!(serde_json::to_vec(&*sm.read()).unwrap(), state);
    }

    #[test]
    fn the_memory_store_keeps_the_whole_snapshot() {
        let slot = Arc::new(Mutex::new(None));
        let s = Snapshots::new(SnapshotStore::Memory(slot.clone()));
        assert!(get(&s).is_none());
        put(&s, b"abc");
        assert_eq!(slot.lock().unwrap().as_deref(), Some(b"abc".as_slice()));
        assert_eq!(get(&s).unwrap(), b"abc");
    }
}
