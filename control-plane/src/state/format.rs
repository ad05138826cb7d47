//! Format versions of the replicated data: Raft log entries, snapshots (stored, sent to a
//! follower, or saved as a backup) and the commands they may hold.
//!
//! A rolling upgrade runs two releases side by side, so a replica may be handed data written by
//! a newer binary. serde ignores fields it does not know, so a binary that decoded newer data
//! "as best it could" would apply it differently from its peers: the replicas would diverge
//! without a word. Instead every entry and snapshot names its format, and a binary refuses one
//! it does not read (`check_readable`), with a message that says to upgrade it.
//!
//! Which format the cluster writes is replicated state, the *cluster version*
//! (`ClusterState::cluster_version`). It starts at the version of the oldest binary that could
//! be a member and is raised (`Command::SetClusterVersion`) only once every member reports a
//! binary that reads the new format, the way Kubernetes gates a feature until every API server
//! knows it. Commands introduced by a format (`Command::introduced_in`) are refused until the
//! cluster version reaches it; fields introduced by a format are left out of the entry below it.
//!
//! Format 1 is every release before versions existed: an entry is `{"at":…,"command":…}` and a
//! snapshot is the bare state. From format 2 on, both are wrapped in an envelope whose first
//! field is `format`. The envelope has a different shape on purpose: a binary of format 1,
//! which knows nothing of versions, fails to decode it (a missing field) instead of quietly
//! applying it.

use serde::{Deserialize, Serialize};

/// A format version of replicated data. It doubles as the cluster version.
pub type FormatVersion = u32;

/// Unversioned data, written by every release before 0.2.
pub const LEGACY: FormatVersion = 1;

/// The newest format this binary writes and reads. Format 2 (release 0.2): entries and
/// snapshots in a versioned envelope, `SetClusterVersion`, and each node's agent release.
pub const CURRENT: FormatVersion = 2;

/// The oldest format this binary still reads. A cluster on an older one must first be
/// upgraded through a release that reads both.
pub const OLDEST_READABLE: FormatVersion = LEGACY;

/// The release of this binary (the workspace version), shown next to formats so that an
/// operator can tell which binary to install.
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");

/// The cluster version as replicated state: format 1 until a `SetClusterVersion` raises it.
/// A new cluster starts there too and is raised by its first leader, so that every replica
/// derives the version from the log alone, whether it starts from a snapshot or replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClusterVersion(pub FormatVersion);

impl Default for ClusterVersion {
    fn default() -> ClusterVersion {
        ClusterVersion(LEGACY)
    }
}

impl ClusterVersion {
    /// Format 1, which state written before versions existed does not name.
    pub fn is_legacy(&self) -> bool {
        self.0 <= LEGACY
    }

    /// Whether data and commands of `format` may be written.
    pub fn allows(self, format: FormatVersion) -> bool {
        format <= self.0
    }
}

/// Whether this binary can read `what` written in `format`; the error says what to do.
pub fn check_readable(what: &str, format: FormatVersion) -> Result<(), String> {
    if format > CURRENT {
        return Err(format!(
            "{what} is in format {format}, but this binary (release {RELEASE}) reads formats \
             {OLDEST_READABLE} to {CURRENT}: it was written by a newer release. Upgrade this \
             replica's binary; it refuses the data rather than misapply it"
        ));
    }
    if format < OLDEST_READABLE {
        return Err(format!(
            "{what} is in format {format}, older than the oldest this binary (release \
             {RELEASE}) reads ({OLDEST_READABLE}): upgrade through an intermediate release"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_this_binary_writes_are_readable() {
        for format in OLDEST_READABLE..=CURRENT {
            assert_eq!(check_readable("an entry", format), Ok(()));
        }
    }

    #[test]
    fn a_newer_format_is_refused_with_what_to_do() {
        let error = check_readable("log entry 7", CURRENT + 1).unwrap_err();
        assert!(error.contains("log entry 7"), "{error}");
        assert!(
            error.contains(&format!("format {}", CURRENT + 1)),
            "{error}"
        );
        assert!(error.contains("Upgrade this replica's binary"), "{error}");
        assert!(check_readable("x", 0).is_err());
    }
}
