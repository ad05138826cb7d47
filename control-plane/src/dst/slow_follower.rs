//! A follower that needs longer than a heartbeat interval to accept entries, in simulated
//! time.
//!
//! openraft 0.9 gave every AppendEntries one heartbeat interval. A follower slower than that
//! (a slow disk sync, a busy core) stored each batch but answered too late, the leader resent
//! the same batch, and its view of that follower never advanced: one more failure and the
//! cluster would have lost its quorum although the follower held every entry. Our openraft
//! patch (third_party/openraft/PATCHED.md, change 3) gives AppendEntries that carry entries
//! `Defaults::APPEND_ENTRIES_TIMEOUT_MS`; this test fails without it.

use std::time::Duration;

use super::elections::{last_log_index, simulated, started_cluster, write_tenant};
use super::net::Endpoint;

/// Longer than the 40 ms heartbeat interval, below the 150 ms AppendEntries timeout.
const SLOW_LINK_MS: u64 = 60;

#[test]
fn a_follower_slower_than_a_heartbeat_still_gets_its_entries_acknowledged() {
    let (matched, last) = simulated(async {
        let (cluster, net) = started_cluster().await;
        net.slow_down(Endpoint::Replica(1), Endpoint::Replica(3), SLOW_LINK_MS);
        for _ in 0..5 {
            write_tenant(&cluster, 1).await;
        }
        let last = last_log_index(&cluster, 1);
        let mut metrics = cluster
            .running(1)
            .expect("replica 1 runs")
            .replica
            .raft
            .metrics();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let matched = metrics
                .borrow()
                .replication
                .as_ref()
                .and_then(|r| r.get(&3).cloned().flatten())
                .map(|l| l.index);
            if matched == last || tokio::time::Instant::now() >= deadline {
                return (matched, last);
            }
            let _ = tokio::time::timeout_at(deadline, metrics.changed()).await;
        }
    });
    assert_eq!(
        matched, last,
        "within 5 s of simulated time the leader should know that replica 3 holds its whole log"
    );
}

/// Longer than openraft's leader lease plus the longest election timeout (150 + 150 ms).
const SLOW_SYNC_MS: u64 = 400;

/// A follower whose disk takes longer to sync than a follower waits before it campaigns. Its
/// Raft core waits for each sync and handles nothing else meanwhile; unpatched openraft then
/// saw only the ticks that had queued, found the leader silent since before the write, and
/// campaigned against a live leader after every slow sync (our openraft patch, PATCHED.md
/// change 4).
#[test]
fn a_follower_with_a_slow_disk_does_not_campaign_against_a_live_leader() {
    let (terms, leader) = simulated(async {
        let (cluster, _net) = started_cluster().await;
        let term = |id| {
            cluster
                .running(id)
                .expect("replica runs")
                .replica
                .raft
                .metrics()
                .borrow()
                .current_term
        };
        let before = term(1);
        cluster.slow_disk(3, Duration::from_millis(SLOW_SYNC_MS));
        for _ in 0..5 {
            write_tenant(&cluster, 1).await;
            tokio::time::sleep(Duration::from_millis(SLOW_SYNC_MS)).await;
        }
        let leader = cluster
            .running(3)
            .expect("replica 3 runs")
            .replica
            .raft
            .metrics()
            .borrow()
            .current_leader;
        ((before, term(1), term(3)), leader)
    });
    let (before, leader_term, slow_term) = terms;
    assert_eq!(
        (leader_term, slow_term),
        (before, before),
        "no election while the leader lives: terms moved from {before}"
    );
    assert_eq!(leader, Some(1));
}
