//! Election after a leader crash, in simulated time: the case that made `bench failover`'s
//! slow tail.
//!
//! Under load a leader often dies having sent its last entry to one follower but not the
//! other. The follower that lacks it may time out first; its candidacy (term T+1) is rejected
//! by the follower that has it, on log. Unpatched openraft 0.9 does not adopt a rejected
//! request's term, so the up-to-date follower then campaigns at T+1 too, loses to the stale
//! candidate on node id, adopts its vote and waits a whole election timeout before it tries
//! again at T+2 (`gpuctl bench failover`: 600–1,050 ms instead of about 330). The stale
//! candidate, for its part, keeps a "seen a greater log" backoff that unpatched openraft only
//! clears at its next campaign, which may be many leaders later, when its log is the longest.
//!
//! The patch in `third_party/openraft` (see its PATCHED.md) starts an election above every
//! term the node has rejected, and applies the backoff only while the node is still behind.
//! Each test below fails without the corresponding change.

use std::sync::Arc;
use std::time::Duration;

use super::cluster::SimCluster;
use super::net::{Endpoint, SimNet};
use super::params::Params;
use crate::raft::{NodeId, RaftTuning};
use crate::state::Command;

const HEARTBEAT_MS: u64 = 40;

/// Replica 1 leads; replica 3 will miss the last entry and has the shortest election
/// timeout; replica 2 has the entry and the longest.
const ELECTION_MS: [(NodeId, u64); 3] = [(1, 120), (2, 140), (3, 90)];

pub(super) fn tuning() -> RaftTuning {
    RaftTuning {
        heartbeat_ms: HEARTBEAT_MS,
        election_min_ms: 90,
        election_max_ms: 150,
        snapshot_every: 10_000,
        keep_behind_snapshot: 1_000,
    }
}

/// Runs `f` on a current-thread runtime with a paused clock, as `runner::run_seed` does.
pub(super) fn simulated<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("building a current-thread tokio runtime")
        .block_on(f)
}

/// Three replicas; replica 1 leads and has committed one entry that every replica applied.
pub(super) async fn started_cluster() -> (Arc<SimCluster>, SimNet) {
    started_cluster_tuned(tuning()).await
}

/// `started_cluster` with other Raft settings (snapshots, say).
pub(super) async fn started_cluster_tuned(tuning: RaftTuning) -> (Arc<SimCluster>, SimNet) {
    let net = SimNet::new(11, 0, 1);
    let replicas: Vec<(NodeId, u64, i64)> = ELECTION_MS.iter().map(|&(id, e)| (id, e, 0)).collect();
    let cluster = Arc::new(SimCluster::new(
        net.clone(),
        tuning,
        Params::default().leader_config(),
        &replicas,
    ));
    for id in cluster.ids() {
        cluster.start(id).await.expect("replica starts");
    }
    let one = cluster.running(1).expect("replica 1 runs");
    one.replica
        .raft
        .initialize(cluster.members())
        .await
        .expect("initializing the cluster");
    assert_eq!(
        one.replica.wait_for_leader(Duration::from_secs(5)).await,
        Some(1),
        "replica 1 campaigns first at initialization"
    );
    write_tenant(&cluster, 1).await;
    wait_all_caught_up(&cluster).await;
    (cluster, net)
}

pub(super) async fn write_tenant(cluster: &SimCluster, leader: NodeId) {
    let tenant = super::workload::tenants().remove(0);
    cluster
        .running(leader)
        .expect("the leader runs")
        .replica
        .write(Command::PutTenant { tenant })
        .await
        .expect("a write with a quorum up");
}

pub(super) fn last_log_index(cluster: &SimCluster, id: NodeId) -> Option<u64> {
    let running = cluster.running(id).expect("replica runs");
    running.replica.raft.metrics().borrow().last_log_index
}

/// Waits until every running replica holds the same log, so that the next round starts with
/// only the difference it makes itself.
async fn wait_all_caught_up(cluster: &SimCluster) {
    for _ in 0..200 {
        let ends: Vec<_> = cluster
            .all_running()
            .iter()
            .map(|r| {
                r.replica
                    .raft
                    .metrics()
                    .borrow()
                    .last_applied
                    .map(|l| l.index)
            })
            .collect();
        if ends.windows(2).all(|w| w[0] == w[1]) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(HEARTBEAT_MS)).await;
    }
    panic!("the replicas did not catch up within 8 s of simulated time");
}

/// Crashes `leader` right after it committed an entry that `behind` did not receive, and
/// returns the new leader, the simulated time from the crash until a survivor knows it, and
/// the terms before and after.
async fn crash_leader_with_one_follower_behind(
    cluster: &SimCluster,
    net: &SimNet,
    leader: NodeId,
    behind: NodeId,
) -> (NodeId, Duration, u64, u64) {
    let witness = cluster
        .ids()
        .into_iter()
        .find(|&id| id != leader && id != behind)
        .expect("three replicas");
    let term_before = cluster
        .running(leader)
        .expect("the leader runs")
        .replica
        .raft
        .metrics()
        .borrow()
        .current_term;
    net.cut(Endpoint::Replica(leader), Endpoint::Replica(behind));
    write_tenant(cluster, leader).await;
    let crashed_at = tokio::time::Instant::now();
    cluster.crash(leader).await;
    net.heal(Endpoint::Replica(leader), Endpoint::Replica(behind));
    assert!(
        last_log_index(cluster, behind) < last_log_index(cluster, witness),
        "replica {behind} must lack the last entry for this case"
    );

    let mut metrics = cluster
        .running(witness)
        .expect("the witness runs")
        .replica
        .raft
        .metrics();
    loop {
        let m = metrics.borrow().clone();
        if let Some(new_leader) = m.current_leader
            && new_leader != leader
        {
            return (
                new_leader,
                crashed_at.elapsed(),
                term_before,
                m.current_term,
            );
        }
        tokio::time::timeout(Duration::from_secs(10), metrics.changed())
            .await
            .expect("a new leader within 10 s of simulated time")
            .expect("the witness's metrics stay open");
    }
}

#[test]
fn the_follower_with_the_longer_log_wins_its_first_campaign_after_a_stale_one() {
    let (leader, elapsed, term_before, term_after) = simulated(async {
        let (cluster, net) = started_cluster().await;
        crash_leader_with_one_follower_behind(&cluster, &net, 1, 3).await
    });
    assert_eq!(leader, 2, "only replica 2 holds every committed entry");
    // Replica 2 campaigns once its leader lease (141 ms) and its election timeout (140 ms)
    // have passed without a heartbeat, seen on openraft's 60 ms tick: 281–341 ms after its
    // last heartbeat, which came at most one heartbeat before the crash. Losing a round to
    // replica 3's stale candidacy would add another election timeout and tick (200 ms).
    assert!(
        elapsed <= Duration::from_millis(350),
        "replica 2 led only {elapsed:?} after the crash: it needed more than one campaign \
         (terms {term_before} -> {term_after})"
    );
    assert!(
        term_after >= term_before + 2,
        "replica 3's stale candidacy should have taken term {}",
        term_before + 1
    );
}

#[test]
fn a_candidate_that_was_once_behind_campaigns_without_backoff_once_it_caught_up() {
    let elapsed = simulated(async {
        let (cluster, net) = started_cluster().await;
        // Round 1 leaves replica 3 having seen a greater log than its own (its stale
        // candidacy was rejected by replica 2).
        let (leader, _, _, _) = crash_leader_with_one_follower_behind(&cluster, &net, 1, 3).await;
        assert_eq!(leader, 2);
        cluster.start(1).await.expect("replica 1 restarts");
        write_tenant(&cluster, 2).await;
        wait_all_caught_up(&cluster).await;
        // Round 2: replica 3 now holds every entry and replica 1 misses the last one.
        let (leader, elapsed, _, _) =
            crash_leader_with_one_follower_behind(&cluster, &net, 2, 1).await;
        assert_eq!(leader, 3, "only replica 3 holds every committed entry");
        elapsed
    });
    // Replica 3 campaigns 91 + 90 ms after its last heartbeat, seen on a 60 ms tick: at most
    // 241 ms after the crash. Unpatched openraft kept the "seen a greater log" flag from
    // round 1 until replica 3's next campaign and added 182 ms to it (at least 323 ms).
    assert!(
        elapsed <= Duration::from_millis(300),
        "replica 3 led only {elapsed:?} after the crash: its backoff from round 1 still applied"
    );
}
