//! Node heartbeats, kept in the leader's memory only: a heartbeat is not a state change, so
//! it never costs a log entry. A new leader knows no heartbeats, so it counts every node's
//! silence from the moment it took over (a fresh grace period for everyone).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

// tokio's Instant: std's in production, simulated time under the deterministic simulation.
use tokio::time::Instant;

#[derive(Default)]
pub struct Liveness {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    last_seen: HashMap<String, Instant>,
    /// When this replica started leading its current term.
    leading_since: Option<Instant>,
}

impl Liveness {
    pub fn heartbeat(&self, node: &str) {
        let mut inner = self.inner.lock().expect("liveness lock poisoned");
        inner.last_seen.insert(node.to_owned(), Instant::now());
    }

    /// Forgets every heartbeat: silence is measured from now on.
    pub fn start_term(&self, _term: u64) {
        let mut inner = self.inner.lock().expect("liveness lock poisoned");
        inner.last_seen.clear();
        inner.leading_since = Some(Instant::now());
    }

    /// How long the node has been silent, as far as this leader can tell.
    pub fn silent_for(&self, node: &str) -> Duration {
        self.inner
            .lock()
            .expect("liveness lock poisoned")
            .silent_for(node)
    }

    /// How long the node has been silent ([`node_silence`]): the measure every decision about
    /// its lease uses, so that none of them reads a node as silent that has just registered.
    pub fn silence(&self, node: &str, now_ms: u64, registered_at: u64) -> Duration {
        node_silence(self.silent_for(node), now_ms, registered_at)
    }

    /// Records a heartbeat that renews the node's lease, unless the node has been silent
    /// ([`node_silence`]) longer than `limit` (lease + grace): from then on
    /// the leader may declare it lost at any moment, and a lease granted now could outlive
    /// that decision, leaving its jobs running on it while they are placed elsewhere (`gpuctl
    /// simulate cluster --seed 44473`). Checked and recorded under one lock, so the liveness
    /// check sees either the silence this refuses or the heartbeat this records. Returns the
    /// silence when it refuses.
    pub fn renew(
        &self,
        node: &str,
        limit: Duration,
        now_ms: u64,
        registered_at: u64,
    ) -> Result<(), Duration> {
        let mut inner = self.inner.lock().expect("liveness lock poisoned");
        let silent = node_silence(inner.silent_for(node), now_ms, registered_at);
        if silent > limit {
            return Err(silent);
        }
        inner.last_seen.insert(node.to_owned(), Instant::now());
        Ok(())
    }
}

impl Inner {
    fn silent_for(&self, node: &str) -> Duration {
        let since = match (self.last_seen.get(node), self.leading_since) {
            (Some(seen), Some(lead)) => (*seen).max(lead),
            (Some(seen), None) => *seen,
            (None, Some(lead)) => lead,
            (None, None) => return Duration::ZERO,
        };
        since.elapsed()
    }
}

/// How long a node has been silent: since the last heartbeat this leader heard (`heard` ago)
/// or since it registered (at `registered_at`, stamped by a leader's clock), whichever is
/// later. A registration is word from the node too, and the API records the heartbeat it
/// counts as only once the registration is applied: in between, a node read as silent since
/// before it registered, was declared lost with its new `registered_at` (which the state
/// machine accepts), and its allocations were placed elsewhere while its agent started them
/// (`gpuctl simulate cluster --seed 8306` found it).
pub fn node_silence(heard: Duration, now_ms: u64, registered_at: u64) -> Duration {
    heard.min(Duration::from_millis(now_ms.saturating_sub(registered_at)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_term_gives_every_node_a_fresh_grace_period() {
        let l = Liveness::default();
        assert_eq!(l.silent_for("n1"), Duration::ZERO);
        l.start_term(1);
        l.heartbeat("n1");
        std::thread::sleep(Duration::from_millis(20));
        assert!(l.silent_for("n1") >= Duration::from_millis(20));
        assert!(l.silent_for("never-seen") >= Duration::from_millis(20));
        l.start_term(2);
        assert!(l.silent_for("n1") < Duration::from_millis(20));
        assert!(l.silent_for("never-seen") < Duration::from_millis(20));
    }

    #[test]
    fn a_node_is_silent_since_its_last_heartbeat_or_its_registration_whichever_is_later() {
        let now = 1_767_225_600_000;
        // Heard from 5 s ago, registered an hour ago: silent 5 s.
        assert_eq!(
            node_silence(Duration::from_secs(5), now, now - 3_600_000),
            Duration::from_secs(5)
        );
        // Registered 20 ms ago, its heartbeat not yet recorded (last heard 9 s ago): 20 ms.
        assert_eq!(
            node_silence(Duration::from_secs(9), now, now - 20),
            Duration::from_millis(20)
        );
        // A registration stamped by a clock ahead of this one counts as just now.
        assert_eq!(
            node_silence(Duration::from_secs(9), now, now + 500),
            Duration::ZERO
        );
    }

    #[test]
    fn a_node_silent_past_the_limit_gets_no_lease_until_it_registers() {
        let l = Liveness::default();
        l.start_term(1);
        l.heartbeat("n1");
        let limit = Duration::from_millis(30);
        let now = 1_767_225_600_000;
        let an_hour_ago = now - 3_600_000;
        assert_eq!(l.renew("n1", limit, now, an_hour_ago), Ok(()));
        std::thread::sleep(Duration::from_millis(40));
        let refused = l
            .renew("n1", limit, now, an_hour_ago)
            .expect_err("silent past the limit");
        assert!(refused >= Duration::from_millis(40), "{refused:?}");
        // Refusing records nothing: still silent.
        assert!(l.silent_for("n1") >= Duration::from_millis(40));
        // A registration just applied is word from the node.
        assert_eq!(l.renew("n1", limit, now, now - 5), Ok(()));
        assert!(l.silent_for("n1") < Duration::from_millis(30));
    }
}
