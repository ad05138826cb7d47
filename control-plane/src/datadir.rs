//! A replica's data directory: `cluster.json` (format version, cluster name, replica id) and
//! the sled database under `raft/`. Opening checks that the directory belongs to this cluster
//! and replica and was written by a format this binary understands; anything else is refused
//! with a message, never silently started empty.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Bump when the on-disk layout changes incompatibly.
pub const FORMAT_VERSION: u32 = 1;
const META_FILE: &str = "cluster.json";
const RAFT_DIR: &str = "raft";
const IDENTITY_KEY: &str = "gpucp.identity";

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Meta {
    format_version: u32,
    cluster: String,
    replica_id: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("cannot use data directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "data directory {path} is not empty but has no {META_FILE}: it is not a control-plane data directory (or its metadata was lost); point --data-dir at an empty or existing replica directory"
    )]
    Foreign { path: PathBuf },
    #[error(
        "data directory {path} is corrupt: {detail}; restore it from a backup or wipe it and rejoin the replica with --join"
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "data directory {path} belongs to cluster {found:?}, but this replica is configured for cluster {expected:?}; refusing to mix clusters"
    )]
    OtherCluster {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error(
        "data directory {path} belongs to replica {found}, but this replica has --id {expected}"
    )]
    OtherReplica {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error(
        "data directory {path} was written by a newer gpu-control-plane (format {found}; this binary understands up to {FORMAT_VERSION}); upgrade the binary"
    )]
    NewerFormat { path: PathBuf, found: u32 },
    #[error(
        "data directory {path} exists and is not empty; a restore writes only into a new or empty directory: move the old one aside (or give another --data-dir) and run it again"
    )]
    NotEmpty { path: PathBuf },
    #[error("cannot create data directory {path}: {detail}")]
    Seeding { path: PathBuf, detail: String },
}

pub struct DataDir {
    pub path: PathBuf,
    /// Created by this start: the replica has never been part of a cluster.
    pub fresh: bool,
    pub db: sled::Db,
}

impl DataDir {
    pub fn open(path: &Path, cluster: &str, replica_id: u64) -> Result<DataDir, DataDirError> {
        let io = |source| DataDirError::Io {
            path: path.to_owned(),
            source,
        };
        fs::create_dir_all(path).map_err(io)?;
        let meta_path = path.join(META_FILE);
        let fresh = match fs::read(&meta_path) {
            Ok(bytes) => {
                let meta: Meta =
                    serde_json::from_slice(&bytes).map_err(|e| DataDirError::Corrupt {
                        path: path.to_owned(),
                        detail: format!("{META_FILE} does not parse: {e}"),
                    })?;
                if meta.format_version > FORMAT_VERSION {
                    return Err(DataDirError::NewerFormat {
                        path: path.to_owned(),
                        found: meta.format_version,
                    });
                }
                if meta.cluster != cluster {
                    return Err(DataDirError::OtherCluster {
                        path: path.to_owned(),
                        found: meta.cluster,
                        expected: cluster.to_owned(),
                    });
                }
                if meta.replica_id != replica_id {
                    return Err(DataDirError::OtherReplica {
                        path: path.to_owned(),
                        found: meta.replica_id,
                        expected: replica_id,
                    });
                }
                if !path.join(RAFT_DIR).is_dir() {
                    return Err(DataDirError::Corrupt {
                        path: path.to_owned(),
                        detail: format!(
                            "{META_FILE} is present but the {RAFT_DIR}/ database is missing"
                        ),
                    });
                }
                false
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                if fs::read_dir(path).map_err(io)?.next().is_some() {
                    return Err(DataDirError::Foreign {
                        path: path.to_owned(),
                    });
                }
                // Written to a temporary name and renamed, so a crash never leaves half a file.
                write_meta_durably(path, cluster, replica_id).map_err(io)?;
                true
            }
            Err(e) => return Err(io(e)),
        };
        let corrupt = |detail: String| DataDirError::Corrupt {
            path: path.to_owned(),
            detail,
        };
        let db = open_sled(&path.join(RAFT_DIR)).map_err(corrupt)?;
        // The database carries its own copy of the identity. sled recovers a damaged file by
        // dropping what it cannot read, which could otherwise look like a replica that simply
        // has no data yet; a missing or different identity record exposes that.
        let identity = serde_json::to_vec(&Meta {
            format_version: FORMAT_VERSION,
            cluster: cluster.to_owned(),
            replica_id,
        })
        .expect("Meta always serializes");
        if fresh {
            db.insert(IDENTITY_KEY, identity)
                .and_then(|_| db.flush())
                .map_err(|e| corrupt(format!("writing the identity record: {e}")))?;
        } else {
            let stored = db
                .get(IDENTITY_KEY)
                .map_err(|e| corrupt(format!("reading the identity record: {e}")))?;
            let stored: Option<Meta> = stored.and_then(|b| serde_json::from_slice(&b).ok());
            match stored {
                Some(m) if m.cluster == cluster && m.replica_id == replica_id => {}
                Some(m) => {
                    return Err(corrupt(format!(
                        "the Raft database belongs to replica {} of cluster {:?}, not to this directory's {cluster:?}/{replica_id}",
                        m.replica_id, m.cluster
                    )));
                }
                None => {
                    return Err(corrupt(
                        "the Raft database has lost its identity record (damaged, replaced or emptied)".into(),
                    ));
                }
            }
        }
        Ok(DataDir {
            path: path.to_owned(),
            fresh,
            db,
        })
    }

    /// Creates the data directory of a replica that has never run, its database holding
    /// what `fill` writes (an offline restore): on start, the replica takes it as its own
    /// and does not bootstrap. `path` must be missing or an empty directory. The metadata file
    /// is written last, so a restore that fails or is killed half-way leaves no directory a
    /// replica would start from (a failure also removes what was written).
    pub fn create_seeded(
        path: &Path,
        cluster: &str,
        replica_id: u64,
        fill: impl FnOnce(&sled::Db) -> Result<(), String>,
    ) -> Result<(), DataDirError> {
        let existed = path.exists();
        if existed && !is_empty_dir(path) {
            return Err(DataDirError::NotEmpty {
                path: path.to_owned(),
            });
        }
        let seeding = |detail: String| DataDirError::Seeding {
            path: path.to_owned(),
            detail,
        };
        let created = (|| {
            fs::create_dir_all(path).map_err(|e| e.to_string())?;
            let db = open_sled(&path.join(RAFT_DIR))?;
            let identity = serde_json::to_vec(&Meta {
                format_version: FORMAT_VERSION,
                cluster: cluster.to_owned(),
                replica_id,
            })
            .expect("Meta always serializes");
            db.insert(IDENTITY_KEY, identity)
                .map_err(|e| format!("writing the identity record: {e}"))?;
            fill(&db)?;
            db.flush()
                .map_err(|e| format!("flushing the database: {e}"))?;
            drop(db);
            write_meta_durably(path, cluster, replica_id).map_err(|e| e.to_string())
        })();
        if let Err(detail) = created {
            // Leave the directory as it was found: gone, or empty.
            if existed {
                if let Ok(entries) = fs::read_dir(path) {
                    for e in entries.flatten() {
                        let p = e.path();
                        let _ = if p.is_dir() {
                            fs::remove_dir_all(&p)
                        } else {
                            fs::remove_file(&p)
                        };
                    }
                }
            } else {
                let _ = fs::remove_dir_all(path);
            }
            return Err(seeding(detail));
        }
        Ok(())
    }

    pub fn corrupt(&self, detail: String) -> DataDirError {
        DataDirError::Corrupt {
            path: self.path.clone(),
            detail,
        }
    }
}

/// Whether `path` is a directory with nothing in it.
pub fn is_empty_dir(path: &Path) -> bool {
    fs::read_dir(path).is_ok_and(|mut entries| entries.next().is_none())
}

/// Writes `cluster.json` under a temporary name, syncs it and renames it into place, then
/// syncs the directory: once this returns, the directory is a replica's.
fn write_meta_durably(path: &Path, cluster: &str, replica_id: u64) -> std::io::Result<()> {
    let meta = Meta {
        format_version: FORMAT_VERSION,
        cluster: cluster.to_owned(),
        replica_id,
    };
    let tmp = path.join(format!("{META_FILE}.tmp"));
    let bytes = serde_json::to_vec_pretty(&meta).expect("Meta always serializes");
    let mut file = fs::File::create(&tmp)?;
    std::io::Write::write_all(&mut file, &bytes)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&tmp, path.join(META_FILE))?;
    fs::File::open(path)?.sync_all()
}

fn open_sled(path: &Path) -> Result<sled::Db, String> {
    // A handle of this process that was just dropped releases the file lock only when sled's
    // background flusher thread exits, a moment later; another process holding it does not let
    // go. So a lock conflict is retried for a short, bounded time before it is reported.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match open_sled_once(path) {
            Err(e)
                if e.contains("could not acquire lock") && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) if e.contains("could not acquire lock") => {
                return Err(format!(
                    "{e} (is another control-plane process using this data directory?)"
                ));
            }
            other => return other,
        }
    }
}

fn open_sled_once(path: &Path) -> Result<sled::Db, String> {
    let path = path.to_owned();
    // sled can panic instead of returning an error on some damaged files; either way the
    // directory is unusable and the operator gets the same message.
    std::panic::catch_unwind(move || {
        sled::Config::new()
            .path(path)
            .cache_capacity(crate::config::Defaults::SLED_CACHE_BYTES)
            .open()
    })
    .map_err(|_| "the sled database panicked while opening".to_owned())?
    .map_err(|e| format!("the sled database does not open: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_directory_is_fresh_and_reopens_as_not_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let d = DataDir::open(dir.path(), "c", 1).unwrap();
        assert!(d.fresh);
        drop(d);
        let d = DataDir::open(dir.path(), "c", 1).unwrap();
        assert!(!d.fresh);
    }

    #[test]
    fn another_clusters_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(DataDir::open(dir.path(), "prod", 1).unwrap());
        let err = DataDir::open(dir.path(), "staging", 1).err().unwrap();
        assert!(matches!(err, DataDirError::OtherCluster { .. }), "{err}");
        let err = DataDir::open(dir.path(), "prod", 2).err().unwrap();
        assert!(matches!(err, DataDirError::OtherReplica { .. }), "{err}");
    }

    #[test]
    fn newer_format_and_garbage_metadata_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(DataDir::open(dir.path(), "c", 1).unwrap());
        let meta = dir.path().join(META_FILE);
        fs::write(
            &meta,
            r#"{"format_version": 99, "cluster": "c", "replica_id": 1}"#,
        )
        .unwrap();
        let err = DataDir::open(dir.path(), "c", 1).err().unwrap();
        assert!(
            matches!(err, DataDirError::NewerFormat { found: 99, .. }),
            "{err}"
        );
        fs::write(&meta, b"\x00\x01garbage").unwrap();
        let err = DataDir::open(dir.path(), "c", 1).err().unwrap();
        assert!(matches!(err, DataDirError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn an_emptied_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(DataDir::open(dir.path(), "c", 1).unwrap());
        fs::remove_dir_all(dir.path().join(RAFT_DIR)).unwrap();
        fs::create_dir(dir.path().join(RAFT_DIR)).unwrap();
        let err = DataDir::open(dir.path(), "c", 1).err().unwrap();
        assert!(err.to_string().contains("identity record"), "{err}");
    }

    #[test]
    fn a_non_empty_directory_without_metadata_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("notes.txt"), "hello").unwrap();
        let err = DataDir::open(dir.path(), "c", 1).err().unwrap();
        assert!(matches!(err, DataDirError::Foreign { .. }), "{err}");
    }

    /// Every file under `dir` with its bytes.
    fn files(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
        let mut out = std::collections::BTreeMap::new();
        let mut todo = vec![dir.to_owned()];
        while let Some(d) = todo.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    todo.push(p);
                } else {
                    out.insert(p.clone(), fs::read(&p).unwrap());
                }
            }
        }
        out
    }

    /// A directory that has been used: an identity record and some data, flushed.
    fn used_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let d = DataDir::open(dir.path(), "c", 1).unwrap();
        for i in 0..200u32 {
            d.db.insert(i.to_be_bytes(), vec![7u8; 100]).unwrap();
        }
        d.db.flush().unwrap();
        drop(d);
        dir
    }

    /// The files that differ between two listings.
    fn changed(
        before: &std::collections::BTreeMap<PathBuf, Vec<u8>>,
        after: &std::collections::BTreeMap<PathBuf, Vec<u8>>,
    ) -> Vec<String> {
        let mut names: Vec<String> = after
            .iter()
            .filter(|(p, b)| before.get(*p) != Some(*b))
            .chain(before.iter().filter(|(p, _)| !after.contains_key(*p)))
            .map(|(p, _)| p.display().to_string())
            .collect();
        names.dedup();
        names
    }

    #[test]
    fn torn_metadata_and_a_damaged_database_are_refused_and_left_as_they_were() {
        type Damage = fn(&Path);
        // (what, damage, what the message says, whether the directory is left as it was:
        // damage found before sled opens the database is; sled itself recovers a damaged log
        // on open by rewriting it, before it reports the damage.)
        let cases: [(&str, Damage, &str, bool); 5] = [
            (
                "cluster.json cut in half (a torn write)",
                |d| {
                    let p = d.join(META_FILE);
                    let b = fs::read(&p).unwrap();
                    fs::write(&p, &b[..b.len() / 2]).unwrap();
                },
                "cluster.json does not parse: EOF while parsing",
                true,
            ),
            (
                "cluster.json empty",
                |d| fs::write(d.join(META_FILE), b"").unwrap(),
                "cluster.json does not parse: EOF while parsing a value",
                true,
            ),
            (
                "cluster.json with a flipped bit",
                |d| {
                    let p = d.join(META_FILE);
                    let mut b = fs::read(&p).unwrap();
                    b[0] ^= 0x01;
                    fs::write(&p, b).unwrap();
                },
                "cluster.json does not parse",
                true,
            ),
            (
                "sled's conf garbage",
                |d| fs::write(d.join(RAFT_DIR).join("conf"), b"\xff\xfe garbage").unwrap(),
                "the sled database does not open",
                true,
            ),
            (
                "sled's database cut to 10 bytes",
                |d| {
                    let p = d.join(RAFT_DIR).join("db");
                    let b = fs::read(&p).unwrap();
                    fs::write(&p, &b[..10]).unwrap();
                },
                "the Raft database has lost its identity record",
                false,
            ),
        ];
        for (what, damage, want, untouched) in cases {
            let dir = used_dir();
            damage(dir.path());
            let before = files(dir.path());
            let err = DataDir::open(dir.path(), "c", 1).err().expect(what);
            assert!(matches!(err, DataDirError::Corrupt { .. }), "{what}: {err}");
            let text = err.to_string();
            assert!(
                text.contains("is corrupt") && text.contains(want),
                "{what}: {text}"
            );
            assert!(text.contains("restore it from a backup"), "{what}: {text}");
            let changed = changed(&before, &files(dir.path()));
            if untouched {
                assert!(changed.is_empty(), "{what}: rewritten: {changed:?}");
            }
        }
    }

    #[test]
    fn damage_at_the_start_of_the_database_is_refused() {
        // The identity record is the first thing written: a flipped bit before it makes sled
        // drop it (and everything after), which the identity check reports.
        for offset in [0usize, 8, 100] {
            let dir = used_dir();
            let p = dir.path().join(RAFT_DIR).join("db");
            let mut b = fs::read(&p).unwrap();
            b[offset] ^= 0x10;
            fs::write(&p, b).unwrap();
            let err = DataDir::open(dir.path(), "c", 1).err().expect("refused");
            assert!(
                err.to_string().contains("lost its identity record"),
                "flip at {offset}: {err}"
            );
        }
    }
}
