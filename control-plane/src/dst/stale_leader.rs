//! A leader cut off with a write in flight, brought back by a snapshot, in simulated time.
//!
//! The cut-off leader has appended the write's entry but cannot commit it. The others elect a
//! leader, go on, and compact their logs into snapshots. When the old leader is reachable
//! again its log is behind the new leader's purged prefix, so it receives a snapshot, and its
//! own entry is purged under it: never applied here and never truncated as a conflict, the two
//! ways openraft 0.9 answers a waiting write. Unpatched, the write waited forever, and with it
//! a group-commit slot: in `gpuctl simulate cluster` (seed 17989) both slots of the leader
//! were taken this way and the cluster accepted no write again. Our openraft patch
//! (third_party/openraft/PATCHED.md, change 5) answers it; this test fails without it.

use std::time::Duration;

use super::elections::{simulated, started_cluster_tuned, tuning, write_tenant};
use super::net::Endpoint;
use crate::raft::{NodeId, RaftTuning};
use crate::replica::ApiError;
use crate::state::Command;

/// Snapshots every few entries and no log kept behind them, so that a replica that missed a
/// few writes can only catch up by snapshot.
fn compacting() -> RaftTuning {
    RaftTuning {
        snapshot_every: 4,
        keep_behind_snapshot: 0,
        ..tuning()
    }
}

fn isolate(net: &super::net::SimNet, id: NodeId, others: &[NodeId], cut: bool) {
    for &other in others {
        for (a, b) in [(id, other), (other, id)] {
            let (from, to) = (Endpoint::Replica(a), Endpoint::Replica(b));
            if cut {
                net.cut(from, to);
            } else {
                net.heal(from, to);
            }
        }
    }
}

#[test]
fn a_write_whose_entry_a_snapshot_replaced_is_answered() {
    let answer = simulated(async {
        let (cluster, net) = started_cluster_tuned(compacting()).await;
        isolate(&net, 1, &[2, 3], true);
        let old_leader = cluster.running(1).expect("replica 1 runs").replica;
        let stranded = tokio::spawn(async move {
            let tenant = super::workload::tenants().remove(1);
            old_leader.write(Command::PutTenant { tenant }).await
        });

        // Replicas 2 and 3 elect one of them and go on, compacting as they go.
        let mut metrics = cluster
            .running(3)
            .expect("replica 3 runs")
            .replica
            .raft
            .metrics();
        let new_leader = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(l) = metrics.borrow().current_leader.filter(|l| *l != 1) {
                    return l;
                }
                let _ = metrics.changed().await;
            }
        })
        .await
        .expect("replicas 2 and 3 elect a leader within 5 s");
        for _ in 0..12 {
            write_tenant(&cluster, new_leader).await;
        }
        let purged = cluster
            .running(new_leader)
            .expect("the new leader runs")
            .replica
            .raft
            .metrics()
            .borrow()
            .purged
            .map(|l| l.index);
        assert!(
            purged > Some(2),
            "the new leader compacted its log past the old leader's entry (purged up to {purged:?})"
        );

        isolate(&net, 1, &[2, 3], false);
        tokio::time::timeout(Duration::from_secs(10), stranded).await
    });
    let result = answer
        .expect("the old leader's write is answered within 10 s of its return")
        .expect("the writing task does not panic");
    assert!(
        matches!(result, Err(ApiError::NotLeader { leader: None })),
        "the write's outcome is unknown to the old leader, which names no leader to resend it to: {result:?}"
    );
}
