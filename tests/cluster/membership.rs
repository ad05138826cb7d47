//! Changing the replica set: join, `gpuctl cluster add/remove`, and a replica whose data
//! directory was wiped rejoining through a snapshot.

use std::time::Duration;

use control_plane::local_cluster::{StartMode, free_ports};

use crate::util::*;

fn voters(s: &proto::v1::ClusterStatusResponse) -> Vec<u64> {
    s.members
        .iter()
        .filter(|m| m.role == "voter")
        .map(|m| m.id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpuctl_adds_a_replica_that_catches_up_and_removes_it() {
    let mut c = start(3, &[]).await;
    let mut client = c.client().unwrap();
    for i in 0..10 {
        submit(&mut client, spec(&format!("j{i}"), 1), "")
            .await
            .unwrap();
    }

    step("start a pristine fourth replica and add it with gpuctl");
    let port = free_ports(1).unwrap()[0];
    let id = c.add_spare(port);
    c.start(id, StartMode::Pristine).unwrap();
    let addr = c.addr(id);
    let (ok, out, err) = gpuctl(
        &c,
        &[
            "cluster",
            "add",
            "--id",
            &id.to_string(),
            "--address",
            &addr,
            "-o",
            "json",
        ],
    );
    assert!(ok, "gpuctl cluster add failed: {err}\n{}", c.log(id));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["members"].as_array().unwrap().len(), 4);

    step("it is a voter and has caught up");
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    assert_eq!(voters(&leader), vec![1, 2, 3, 4]);
    wait_applied(&c, id, leader.commit_index, Duration::from_secs(20)).await;
    let mut local = c.client_for(id).unwrap();
    assert_eq!(list_jobs(&mut local, true).await.len(), 10);

    step("adding it again under another address is refused");
    let (ok, _, err) = gpuctl(
        &c,
        &[
            "cluster",
            "add",
            "--id",
            &id.to_string(),
            "--address",
            "127.0.0.1:1",
        ],
    );
    assert!(!ok);
    assert!(err.contains("already a member"), "{err}");

    step("gpuctl cluster remove");
    let (ok, _, err) = gpuctl(&c, &["cluster", "remove", "--id", &id.to_string()]);
    assert!(ok, "{err}");
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    assert_eq!(voters(&leader), vec![1, 2, 3]);
    assert_eq!(leader.members.len(), 3);
    c.kill(id).unwrap();

    step("the three remaining replicas still commit");
    submit(&mut client, spec("after-remove", 1), "")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_with_join_becomes_a_voter() {
    let mut c = start(3, &[]).await;
    let port = free_ports(1).unwrap()[0];
    let id = c.add_spare(port);
    step("start replica 4 with --join through replica 2");
    let via = c.addr(2);
    c.start(id, StartMode::Join(via)).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
        if voters(&s).contains(&id) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replica {id} never became a voter:\n{}",
            c.log(id)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_replica_rejoins_through_a_snapshot() {
    // Snapshot every 20 entries so the log behind the snapshot is purged quickly.
    let mut c = start(3, &["--snapshot-every", "20"]).await;
    let status = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let victim = follower_of(&status);
    let mut client = c.client_for(status.leader).unwrap();

    step("kill a follower, wipe its data directory, and write past a snapshot");
    c.kill(victim).unwrap();
    std::fs::remove_dir_all(&c.replicas[&victim].data_dir).unwrap();
    for i in 0..1100 {
        submit(&mut client, spec(&format!("j{i}"), 1), "")
            .await
            .unwrap();
    }
    let leader = c.status(status.leader).await.unwrap();
    assert!(
        leader.snapshot_index > 0,
        "the leader built no snapshot: {leader:?}"
    );

    step("restart it empty with --join: it installs the snapshot and catches up");
    let via = c.addr(status.leader);
    c.start(victim, StartMode::Join(via)).unwrap();
    let s = wait_applied(&c, victim, leader.commit_index, Duration::from_secs(30)).await;
    assert!(
        s.snapshot_index > 0,
        "it caught up without a snapshot: {s:?}"
    );
    let mut local = c.client_for(victim).unwrap();
    assert_eq!(list_jobs(&mut local, true).await.len(), 1100);
}
