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
        let inner = self.inner.lock().expect("liveness lock poisoned");
        let since = match (inner.last_seen.get(node), inner.leading_since) {
            (Some(seen), Some(lead)) => (*seen).max(lead),
            (Some(seen), None) => *seen,
            (None, Some(lead)) => lead,
            (None, None) => return Duration::ZERO,
        };
        since.elapsed()
    }
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
}
