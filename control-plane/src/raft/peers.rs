//! What a replica knows about its peers beyond Raft's own state: when each one last answered
//! (or called), whether calls to it are failing now and why, and whether this replica itself
//! has been removed from the cluster.
//!
//! openraft 0.9 reports how far each follower has replicated but not when it last answered, so
//! the peer network (`network`) and the peer service (`peer_service`) record every exchange
//! here. The leader uses it to tell live replicas from dead ones (membership changes refuse to
//! leave the cluster without a live majority; `cluster status` shows it); a follower uses it to
//! name a leader only while it hears from one.
//!
//! A removed replica learns that it was removed in one of two ways, both ending in
//! `report_removal` (the membership module checks each report against the replica's own log
//! and then shuts its Raft down): the leader tells it (`NotifyRemoved`) right after the change
//! commits; or a peer refuses its vote request because the peer's committed membership no
//! longer has it (a replica that was down while it was removed, restarted, and campaigns).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::NodeId;
use crate::state::format::{self, FormatVersion};

/// gRPC metadata key on a refused vote request: the log index of the committed membership
/// that no longer includes the candidate.
pub const REMOVED_AT_HEADER: &str = "x-gpucp-removed-at";

/// The payload of `NotifyRemoved`: replica `id` is not in the membership committed at
/// `log_index`; `by` is the leader that removed it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemovedNotice {
    pub id: NodeId,
    pub log_index: u64,
    pub by: NodeId,
}

/// Word that this replica is no longer a member, before or after it was checked.
#[derive(Debug, Clone)]
pub struct Removal {
    /// The committed membership without this replica is at this log index.
    pub log_index: u64,
    /// How this replica learned it, for its log and its `cluster status`.
    pub how: String,
}

#[derive(Debug, Clone, Default)]
pub struct Contact {
    /// Last time the peer answered one of our calls or called us.
    pub last_ok: Option<Instant>,
    /// When our calls to the peer started failing (reset by the next answer).
    pub failing_since: Option<Instant>,
    /// The last failure, as text for an operator.
    pub last_error: Option<String>,
    /// Since when the last chunk of a snapshot sent to the peer awaits its answer: the peer
    /// is decoding and storing the whole state, and answers nothing else meanwhile.
    pub installing_since: Option<Instant>,
    /// When the last such chunk was answered or given up on.
    pub install_ended: Option<Instant>,
}

impl Contact {
    /// How long the peer has not been heard from, not counting time spent installing a
    /// snapshot (from the moment that install ends, if it ended since the last answer).
    pub fn silent_for(&self, since_start: Duration) -> Duration {
        if self.installing_since.is_some() {
            return Duration::ZERO;
        }
        let last = match (self.last_ok, self.install_ended) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        last.map_or(since_start, |t| t.elapsed())
    }
}

/// What a peer's binary is, as it last said in a Raft RPC (`RaftMessage`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerBinary {
    /// The newest format of replicated data it reads.
    pub format_max: FormatVersion,
    /// Its release; empty for releases before 0.2, which did not say.
    pub release: String,
}

impl PeerBinary {
    /// This process's own binary.
    pub fn this() -> PeerBinary {
        PeerBinary {
            format_max: format::CURRENT,
            release: format::RELEASE.to_owned(),
        }
    }

    /// From a message's fields: a release before 0.2 sends neither and reads format 1.
    pub fn from_message(format_max: u32, release: &str) -> PeerBinary {
        PeerBinary {
            format_max: format_max.max(format::LEGACY),
            release: release.to_owned(),
        }
    }

    /// The release for an operator: "0.2.0", or "before 0.2" when it did not say.
    pub fn release_text(&self) -> String {
        if self.release.is_empty() {
            "before 0.2".to_owned()
        } else {
            self.release.clone()
        }
    }
}

pub struct PeerState {
    contacts: Mutex<HashMap<NodeId, Contact>>,
    binaries: Mutex<HashMap<NodeId, PeerBinary>>,
    /// A peer counts as reachable when it answered within this window...
    window: Duration,
    /// ...and calls to it have not been failing for this long.
    failing_grace: Duration,
    reports: Mutex<Vec<Removal>>,
    removed: OnceLock<Removal>,
    changed: Notify,
}

impl PeerState {
    /// `window`: two election timeouts in production; `failing_grace`: two heartbeats.
    pub fn new(window: Duration, failing_grace: Duration) -> PeerState {
        PeerState {
            contacts: Mutex::new(HashMap::new()),
            binaries: Mutex::new(HashMap::new()),
            window,
            failing_grace,
            reports: Mutex::new(Vec::new()),
            removed: OnceLock::new(),
            changed: Notify::new(),
        }
    }

    /// Settings derived from Raft's timing.
    pub fn for_timing(heartbeat_ms: u64, election_max_ms: u64) -> PeerState {
        PeerState::new(
            Duration::from_millis(2 * election_max_ms),
            Duration::from_millis(2 * heartbeat_ms),
        )
    }

    pub fn window(&self) -> Duration {
        self.window
    }

    fn contacts(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, Contact>> {
        self.contacts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `id` answered a call of ours, or called us.
    pub fn heard_from(&self, id: NodeId) {
        let mut c = self.contacts();
        let e = c.entry(id).or_default();
        e.last_ok = Some(Instant::now());
        e.failing_since = None;
    }

    /// A call to `id` failed (it did not answer, or refused the call).
    pub fn failed(&self, id: NodeId, error: String) {
        let mut c = self.contacts();
        let e = c.entry(id).or_default();
        e.failing_since.get_or_insert_with(Instant::now);
        e.last_error = Some(error);
    }

    /// The last chunk of a snapshot is on its way to `id`; `installed` when it is answered or
    /// given up on (dropping the guard does it).
    pub fn installing(self: &std::sync::Arc<Self>, id: NodeId) -> InstallGuard {
        self.contacts()
            .entry(id)
            .or_default()
            .installing_since
            .get_or_insert_with(Instant::now);
        InstallGuard {
            peers: self.clone(),
            id,
        }
    }

    fn installed(&self, id: NodeId) {
        let mut c = self.contacts();
        let e = c.entry(id).or_default();
        e.installing_since = None;
        e.install_ended = Some(Instant::now());
    }

    /// Forgets what is known about `id` (a replica about to be added under an id used before).
    pub fn forget(&self, id: NodeId) {
        self.contacts().remove(&id);
        self.binaries().remove(&id);
    }

    fn binaries(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, PeerBinary>> {
        self.binaries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `id` said what its binary is (in an answer or a call of its own).
    pub fn report_binary(&self, id: NodeId, binary: PeerBinary) {
        let mut known = self.binaries();
        if known.get(&id) != Some(&binary) {
            if let Some(before) = known.get(&id) {
                tracing::info!(
                    peer = id,
                    from = %before.release_text(),
                    to = %binary.release_text(),
                    format_max = binary.format_max,
                    "a peer now runs another release"
                );
            }
            known.insert(id, binary);
        }
    }

    /// What `id` last said its binary is; `None` until it has answered once.
    pub fn binary(&self, id: NodeId) -> Option<PeerBinary> {
        self.binaries().get(&id).cloned()
    }

    pub fn contact(&self, id: NodeId) -> Contact {
        self.contacts().get(&id).cloned().unwrap_or_default()
    }

    /// Whether `id` answers now: it answered within the window and has not been failing since
    /// for longer than the grace.
    pub fn reachable(&self, id: NodeId) -> bool {
        let c = self.contact(id);
        c.last_ok.is_some_and(|t| t.elapsed() <= self.window)
            && c.failing_since
                .is_none_or(|t| t.elapsed() < self.failing_grace)
    }

    /// Someone says this replica is no longer a member; the membership watcher checks it.
    pub fn report_removal(&self, removal: Removal) {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(removal);
        self.changed.notify_one();
    }

    pub fn take_reports(&self) -> Vec<Removal> {
        std::mem::take(&mut *self.reports.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records that this replica is removed (the first record wins).
    pub fn set_removed(&self, removal: Removal) -> bool {
        self.removed.set(removal).is_ok()
    }

    /// Why this replica is no longer a member, once it is not.
    pub fn removed(&self) -> Option<&Removal> {
        self.removed.get()
    }

    /// Resolves after the next `report_removal`.
    pub async fn reported(&self) {
        self.changed.notified().await
    }
}

/// Marks the end of a snapshot's last chunk when dropped (see `PeerState::installing`).
pub struct InstallGuard {
    peers: std::sync::Arc<PeerState>,
    id: NodeId,
}

impl Drop for InstallGuard {
    fn drop(&mut self) {
        self.peers.installed(self.id);
    }
}

impl Default for PeerState {
    fn default() -> Self {
        PeerState::for_timing(
            crate::config::Defaults::HEARTBEAT_MS,
            crate::config::Defaults::ELECTION_MAX_MS,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_peer_is_reachable_while_it_answers() {
        let p = PeerState::new(Duration::from_millis(300), Duration::from_millis(80));
        assert!(!p.reachable(2), "never heard from");
        p.heard_from(2);
        assert!(p.reachable(2));
        tokio::time::advance(Duration::from_millis(200)).await;
        p.failed(2, "connection refused".into());
        assert!(p.reachable(2), "one failure within the grace");
        tokio::time::advance(Duration::from_millis(80)).await;
        assert!(!p.reachable(2), "failing for longer than the grace");
        p.heard_from(2);
        assert!(p.reachable(2));
        tokio::time::advance(Duration::from_millis(301)).await;
        assert!(!p.reachable(2), "silent for longer than the window");
        assert_eq!(
            p.contact(2).last_error.as_deref(),
            Some("connection refused")
        );
    }

    /// `cluster add` judges a learner by how long it has been silent; the time it spends on a
    /// snapshot's last chunk (decoding and storing the whole state) does not count.
    #[tokio::test(start_paused = true)]
    async fn a_peer_installing_a_snapshot_is_not_silent() {
        let p = std::sync::Arc::new(PeerState::default());
        let start = Duration::from_secs(1);
        assert_eq!(p.contact(2).silent_for(start), start, "never heard from");
        p.heard_from(2);
        let guard = p.installing(2);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(p.contact(2).silent_for(start), Duration::ZERO);
        drop(guard);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            p.contact(2).silent_for(start),
            Duration::from_secs(2),
            "silent since the install ended, not since the last answer before it"
        );
        p.heard_from(2);
        assert_eq!(p.contact(2).silent_for(start), Duration::ZERO);
    }
}
