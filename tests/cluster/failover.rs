//! Losing replicas: a SIGKILLed leader loses no acknowledged job, and a killed replica that
//! restarts catches up with everything committed while it was down.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::util::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_job_survives_a_leader_sigkill() {
    let mut c = start(3, &[]).await;
    let mut client = c.client().unwrap();

    step("submit 40 jobs");
    let mut acknowledged = BTreeSet::new();
    for i in 0..40 {
        let r = submit(&mut client, spec(&format!("job-{i}"), 1), &format!("k{i}"))
            .await
            .unwrap();
        acknowledged.insert(r.id);
    }
    assert_eq!(acknowledged.len(), 40);

    step("SIGKILL the leader");
    let old = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    c.kill(old.leader).unwrap();

    step("a new leader has every acknowledged job, once");
    let new = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    assert_ne!(new.leader, old.leader);
    assert!(new.term > old.term);
    let mut via_new = c.client_for(new.leader).unwrap();
    let jobs = list_jobs(&mut via_new, false).await;
    let ids: Vec<u64> = jobs.iter().map(|j| j.id).collect();
    let unique: BTreeSet<u64> = ids.iter().copied().collect();
    assert_eq!(ids.len(), unique.len(), "a job appears twice: {ids:?}");
    assert_eq!(unique, acknowledged);

    step("retrying an acknowledged submission after failover returns the same job");
    let r = submit(&mut client, spec("job-7", 1), "k7").await.unwrap();
    assert!(!r.created);
    assert!(acknowledged.contains(&r.id));

    step("the cluster keeps accepting work with two replicas");
    let r = submit(&mut client, spec("after", 1), "after")
        .await
        .unwrap();
    assert!(r.created);
    assert!(r.id > *acknowledged.iter().max().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_restarts_and_catches_up() {
    let mut c = start(3, &[]).await;
    let status = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let victim = follower_of(&status);
    let mut client = c.client_for(status.leader).unwrap();
    submit(&mut client, spec("before", 1), "").await.unwrap();

    step("SIGKILL a follower and keep writing");
    c.kill(victim).unwrap();
    for i in 0..20 {
        submit(&mut client, spec(&format!("while-down-{i}"), 1), "")
            .await
            .unwrap();
    }
    let leader_status = c.status(status.leader).await.unwrap();

    step("restart it: it recovers its own log and catches up");
    c.start(victim, control_plane::local_cluster::StartMode::Initial)
        .unwrap();
    let s = wait_applied(
        &c,
        victim,
        leader_status.commit_index,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(s.leader, status.leader);
    let mut local = c.client_for(victim).unwrap();
    assert_eq!(list_jobs(&mut local, true).await.len(), 21);
}
