//! The backup file. Layout, in order:
//!
//! | bytes | what |
//! | --- | --- |
//! | 8 | `GPUCPBAK` |
//! | 4 | the backup format version, u32 little endian (`FORMAT_VERSION`) |
//! | 4 | length of the header's JSON, u32 little endian |
//! | n | the header's JSON ([`BackupHeader`]) |
//! | 32 | SHA-256 of the header's JSON |
//! | `state_bytes` | the state, as a Raft snapshot stores it; its SHA-256 is in the header |
//!
//! Nothing follows. A file is written under a temporary name in the same directory, synced,
//! and renamed into place, so a crash or a broken stream never leaves a file that looks whole.

use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Take, Write};
use std::path::{Path, PathBuf};

use super::{BackupHeader, hex};

pub const MAGIC: &[u8; 8] = b"GPUCPBAK";
/// Bump when the layout above or the meaning of a header field changes.
pub const FORMAT_VERSION: u32 = 1;
/// A header is a few hundred bytes (a membership of a handful of replicas); a length beyond
/// this is damage, refused before anything is allocated for it.
const MAX_HEADER_BYTES: u32 = 1024 * 1024;
const DIGEST_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum BackupFileError {
    #[error("cannot read backup {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "{path} is not a gpu-control-plane backup: it does not start with {:?}",
        String::from_utf8_lossy(MAGIC)
    )]
    NotABackup { path: PathBuf },
    #[error(
        "{path} is a backup of format {found}, which this gpuctl does not read (it reads format {FORMAT_VERSION}); use a gpuctl of the release that saved it"
    )]
    UnknownFormat { path: PathBuf, found: u32 },
    #[error(
        "{path} is truncated: {detail}; the save did not finish or the copy was cut short; use another backup"
    )]
    Truncated { path: PathBuf, detail: String },
    #[error("{path} is damaged: {detail}; use another backup")]
    Damaged { path: PathBuf, detail: String },
}

/// A backup file opened for reading, its header checked (not yet its state: [`Self::verify`]).
pub struct BackupFile {
    pub path: PathBuf,
    pub header: BackupHeader,
    /// Where the state's bytes start.
    state_offset: u64,
    file: File,
}

fn read_exact_or_truncated(
    path: &Path,
    r: &mut impl Read,
    buf: &mut [u8],
    what: &str,
) -> Result<(), BackupFileError> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            BackupFileError::Truncated {
                path: path.to_owned(),
                detail: format!("it ends inside its {what}"),
            }
        } else {
            BackupFileError::Io {
                path: path.to_owned(),
                source: e,
            }
        }
    })
}

impl BackupFile {
    /// Opens `path` and checks its magic, format version, header checksum and length.
    pub fn open(path: &Path) -> Result<BackupFile, BackupFileError> {
        let io_err = |source| BackupFileError::Io {
            path: path.to_owned(),
            source,
        };
        let damaged = |detail: String| BackupFileError::Damaged {
            path: path.to_owned(),
            detail,
        };
        let mut file = File::open(path).map_err(io_err)?;
        let file_len = file.metadata().map_err(io_err)?.len();
        let mut r = BufReader::new(&mut file);
        let mut magic = [0u8; 8];
        // A file shorter than the magic is no backup at all, or the start of one.
        if file_len < MAGIC.len() as u64 {
            return Err(if MAGIC.starts_with(&fs::read(path).map_err(io_err)?) {
                BackupFileError::Truncated {
                    path: path.to_owned(),
                    detail: format!("it is {file_len} bytes long"),
                }
            } else {
                BackupFileError::NotABackup {
                    path: path.to_owned(),
                }
            });
        }
        read_exact_or_truncated(path, &mut r, &mut magic, "magic")?;
        if &magic != MAGIC {
            return Err(BackupFileError::NotABackup {
                path: path.to_owned(),
            });
        }
        let mut word = [0u8; 4];
        read_exact_or_truncated(path, &mut r, &mut word, "format version")?;
        let version = u32::from_le_bytes(word);
        if version != FORMAT_VERSION {
            return Err(BackupFileError::UnknownFormat {
                path: path.to_owned(),
                found: version,
            });
        }
        read_exact_or_truncated(path, &mut r, &mut word, "header length")?;
        let header_len = u32::from_le_bytes(word);
        if header_len > MAX_HEADER_BYTES {
            return Err(damaged(format!(
                "its header length is {header_len} bytes (at most {MAX_HEADER_BYTES} are valid)"
            )));
        }
        let mut json = vec![0u8; header_len as usize];
        read_exact_or_truncated(path, &mut r, &mut json, "header")?;
        let mut digest = [0u8; DIGEST_BYTES];
        read_exact_or_truncated(path, &mut r, &mut digest, "header checksum")?;
        if ring::digest::digest(&ring::digest::SHA256, &json).as_ref() != digest {
            return Err(damaged("its header does not match its checksum".into()));
        }
        let header: BackupHeader = serde_json::from_slice(&json)
            .map_err(|e| damaged(format!("its header does not decode: {e}")))?;
        drop(r);
        let state_offset = (MAGIC.len() + 8 + json.len() + DIGEST_BYTES) as u64;
        let expected = state_offset + header.state_bytes;
        if file_len < expected {
            return Err(BackupFileError::Truncated {
                path: path.to_owned(),
                detail: format!(
                    "it is {file_len} bytes long, and its header says {expected} ({} bytes of state)",
                    header.state_bytes
                ),
            });
        }
        if file_len > expected {
            return Err(damaged(format!(
                "it is {file_len} bytes long, {} more than its header says",
                file_len - expected
            )));
        }
        Ok(BackupFile {
            path: path.to_owned(),
            header,
            state_offset,
            file,
        })
    }

    /// Reads the whole state once and checks it against the header's SHA-256.
    pub fn verify(&mut self) -> Result<(), BackupFileError> {
        let path = self.path.clone();
        let expected = self.header.state_sha256.clone();
        let mut r = self.state().map_err(|source| BackupFileError::Io {
            path: path.clone(),
            source,
        })?;
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        let mut buf = vec![0u8; 1024 * 1024];
        loop {
            let n = r.read(&mut buf).map_err(|source| BackupFileError::Io {
                path: path.clone(),
                source,
            })?;
            if n == 0 {
                break;
            }
            ctx.update(&buf[..n]);
        }
        let found = hex(ctx.finish().as_ref());
        if found != expected {
            return Err(BackupFileError::Damaged {
                path,
                detail: format!("its state's SHA-256 is {found}, and its header says {expected}"),
            });
        }
        Ok(())
    }

    /// The state's bytes, from the start.
    pub fn state(&mut self) -> io::Result<Take<BufReader<&mut File>>> {
        self.file.seek(SeekFrom::Start(self.state_offset))?;
        Ok(BufReader::with_capacity(256 * 1024, &mut self.file).take(self.header.state_bytes))
    }
}

/// Writes a backup under a temporary name beside `path`; [`Self::finish`] checks the state's
/// length and checksum against the header, syncs and renames it into place. Dropped
/// unfinished, it removes the temporary file.
pub struct BackupWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    header: BackupHeader,
    written: u64,
    digest: ring::digest::Context,
}

impl BackupWriter {
    pub fn create(path: &Path, header: BackupHeader) -> io::Result<BackupWriter> {
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::other(format!("{} names no file", path.display())))?;
        let tmp = path.with_file_name(format!(
            ".{}.partial-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = File::options().write(true).create_new(true).open(&tmp)?;
        let mut writer = BackupWriter {
            path: path.to_owned(),
            tmp,
            out: Some(BufWriter::with_capacity(1024 * 1024, file)),
            header,
            written: 0,
            digest: ring::digest::Context::new(&ring::digest::SHA256),
        };
        let json = serde_json::to_vec(&writer.header).map_err(io::Error::other)?;
        let len = u32::try_from(json.len())
            .ok()
            .filter(|l| *l <= MAX_HEADER_BYTES)
            .ok_or_else(|| io::Error::other("the backup header is too large"))?;
        let out = writer.out.as_mut().expect("open until finished");
        out.write_all(MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_le_bytes())?;
        out.write_all(&len.to_le_bytes())?;
        out.write_all(&json)?;
        out.write_all(ring::digest::digest(&ring::digest::SHA256, &json).as_ref())?;
        Ok(writer)
    }

    /// Appends the next bytes of the state.
    pub fn write_state(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.written += bytes.len() as u64;
        if self.written > self.header.state_bytes {
            return Err(io::Error::other(format!(
                "more state than announced ({} bytes)",
                self.header.state_bytes
            )));
        }
        self.digest.update(bytes);
        self.out
            .as_mut()
            .expect("open until finished")
            .write_all(bytes)
    }

    /// Checks what was written against the header, syncs, and renames the file into place.
    pub fn finish(mut self) -> io::Result<PathBuf> {
        if self.written != self.header.state_bytes {
            return Err(io::Error::other(format!(
                "the stream ended after {} of {} bytes of state",
                self.written, self.header.state_bytes
            )));
        }
        let digest = std::mem::replace(
            &mut self.digest,
            ring::digest::Context::new(&ring::digest::SHA256),
        );
        let found = hex(digest.finish().as_ref());
        if found != self.header.state_sha256 {
            return Err(io::Error::other(format!(
                "the state received has SHA-256 {found}, and the replica announced {}",
                self.header.state_sha256
            )));
        }
        let out = self.out.take().expect("open until finished");
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&self.tmp, &self.path)?;
        // The rename is durable once the directory is synced.
        let dir = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        File::open(dir)?.sync_all()?;
        Ok(self.path.clone())
    }
}

impl Drop for BackupWriter {
    fn drop(&mut self) {
        if self.out.is_some() {
            drop(self.out.take());
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup::Counts;

    fn header(state: &[u8]) -> BackupHeader {
        BackupHeader {
            cluster: "c".into(),
            replica_id: 1,
            made_at_ms: 5,
            last_applied: openraft::LogId::new(openraft::CommittedLeaderId::new(3, 1), 42),
            membership: Default::default(),
            state_bytes: state.len() as u64,
            state_sha256: hex(ring::digest::digest(&ring::digest::SHA256, state).as_ref()),
            counts: Counts::default(),
        }
    }

    fn write(dir: &Path, state: &[u8]) -> PathBuf {
        let path = dir.join("b.bak");
        let mut w = BackupWriter::create(&path, header(state)).unwrap();
        for part in state.chunks(7) {
            w.write_state(part).unwrap();
        }
        w.finish().unwrap()
    }

    fn read_state(path: &Path) -> Result<Vec<u8>, BackupFileError> {
        let mut f = BackupFile::open(path)?;
        f.verify()?;
        let mut out = Vec::new();
        f.state().unwrap().read_to_end(&mut out).unwrap();
        Ok(out)
    }

    #[test]
    fn a_backup_round_trips_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = b"{\"the\":\"state\", \"padding\": \"0123456789\"}".to_vec();
        let path = write(dir.path(), &state);
        assert_eq!(read_state(&path).unwrap(), state);
        assert_eq!(BackupFile::open(&path).unwrap().header, header(&state));
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_stream_that_ends_early_or_differs_writes_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = b"0123456789".to_vec();
        let path = dir.path().join("b.bak");
        let mut w = BackupWriter::create(&path, header(&state)).unwrap();
        w.write_state(&state[..4]).unwrap();
        let err = w.finish().unwrap_err();
        assert!(err.to_string().contains("ended after 4 of 10"), "{err}");
        let mut w = BackupWriter::create(&path, header(&state)).unwrap();
        w.write_state(b"0123456788").unwrap();
        assert!(w.finish().unwrap_err().to_string().contains("SHA-256"));
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn truncation_damage_and_unknown_formats_are_refused_with_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let state = vec![b'x'; 1000];
        let path = write(dir.path(), &state);
        let whole = fs::read(&path).unwrap();
        let state_at = whole.len() - state.len();
        let case = |bytes: Vec<u8>| {
            let p = dir.path().join("case.bak");
            fs::write(&p, bytes).unwrap();
            read_state(&p).unwrap_err()
        };
        for cut in [0, 3, 10, 14, 20, state_at - 1, state_at, whole.len() - 1] {
            let err = case(whole[..cut].to_vec());
            assert!(
                matches!(err, BackupFileError::Truncated { .. }),
                "cut at {cut}: {err}"
            );
        }
        let mut flipped = whole.clone();
        flipped[state_at + 500] ^= 0x01;
        let err = case(flipped);
        assert!(
            matches!(&err, BackupFileError::Damaged { detail, .. } if detail.contains("SHA-256")),
            "{err}"
        );
        let mut flipped = whole.clone();
        flipped[20] ^= 0x01;
        let err = case(flipped);
        assert!(
            matches!(&err, BackupFileError::Damaged { detail, .. } if detail.contains("header")),
            "{err}"
        );
        let mut longer = whole.clone();
        longer.push(0);
        assert!(matches!(case(longer), BackupFileError::Damaged { .. }));
        let mut newer = whole.clone();
        newer[8] = 2;
        let err = case(newer);
        assert!(
            matches!(err, BackupFileError::UnknownFormat { found: 2, .. }),
            "{err}"
        );
        let err = case(b"{\"jobs\": []}".to_vec());
        assert!(matches!(err, BackupFileError::NotABackup { .. }), "{err}");
    }
}
