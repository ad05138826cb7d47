//! Everyday operations through any replica: submit through a follower, idempotent retries,
//! linearizable and stale reads, watching, and gpuctl's JSON interface.

use std::time::Duration;

use control_plane::client::with_timeout;
use proto::v1 as pb;

use crate::util::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_submitted_through_a_follower_is_on_every_replica() {
    let c = start(3, &[]).await;
    let status = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let follower = follower_of(&status);

    step("submit through a follower only");
    let mut via_follower = c.client_for(follower).unwrap();
    let resp = submit(&mut via_follower, spec("through-follower", 2), "")
        .await
        .unwrap();
    assert!(resp.created);

    step("a linearizable read through the follower sees it at once");
    let jobs = list_jobs(&mut via_follower, false).await;
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![resp.id]);
    assert_eq!(jobs[0].state, "pending");
    assert_eq!(jobs[0].spec.as_ref().unwrap().gpus_per_task, 2);

    step("every replica applies it");
    let leader_status = c.status(status.leader).await.unwrap();
    for id in [1, 2, 3] {
        wait_applied(&c, id, leader_status.commit_index, Duration::from_secs(10)).await;
        let mut client = c.client_for(id).unwrap();
        let local = list_jobs(&mut client, true).await;
        assert_eq!(local.len(), 1, "replica {id} has {local:?}");
        assert_eq!(local[0].id, resp.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reached_a_follower_sends_its_next_calls_to_the_leader() {
    let c = start(3, &[]).await;
    let status = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let follower = follower_of(&status);

    step("a client over every replica, the follower first");
    let mut endpoints = vec![c.addr(follower)];
    endpoints.extend(c.endpoints().into_iter().filter(|e| *e != c.addr(follower)));
    let mut client =
        control_plane::client::Client::new(&endpoints, &c.credentials().unwrap()).unwrap();
    assert_eq!(client.preferred_endpoint(), c.addr(follower));

    step("the follower forwards the first submission and names the leader");
    let first = submit(&mut client, spec("hinted-1", 1), "").await.unwrap();
    assert!(first.created);
    assert_eq!(client.preferred_endpoint(), c.addr(status.leader));

    step("a refusal forwarded by a follower names the leader too");
    let mut refused =
        control_plane::client::Client::new(&endpoints, &c.credentials().unwrap()).unwrap();
    let err = submit(&mut refused, spec("too-many-gpus", -1), "")
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert_eq!(refused.preferred_endpoint(), c.addr(status.leader));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_the_same_idempotency_key_returns_the_same_job() {
    let c = start(3, &[]).await;
    let mut clients: Vec<_> = [1, 2, 3]
        .iter()
        .map(|id| c.client_for(*id).unwrap())
        .collect();

    step("the same request through each replica");
    let mut ids = Vec::new();
    for client in &mut clients {
        ids.push(submit(client, spec("retry", 1), "key-1").await.unwrap());
    }
    assert!(ids[0].created);
    assert!(
        ids.iter().skip(1).all(|r| !r.created && r.id == ids[0].id),
        "{ids:?}"
    );

    step("a different request reusing the key is refused");
    let err = submit(&mut clients[0], spec("other", 4), "key-1")
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");

    step("exactly one job exists");
    let jobs = list_jobs(&mut clients[1], false).await;
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0].idempotency_key, "key-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_committed_changes_from_any_replica() {
    let c = start(3, &[]).await;
    let status = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let follower = follower_of(&status);

    step("watch on a follower");
    let mut watcher = c.client_for(follower).unwrap();
    let mut stream = watcher
        .call(|mut c, _| async move {
            c.watch_jobs(pb::WatchJobsRequest {
                tenant: "team-a".into(),
                initial: false,
            })
            .await
        })
        .await
        .unwrap();

    step("submit and cancel through the leader");
    let mut leader = c.client_for(status.leader).unwrap();
    let id = submit(&mut leader, spec("watched", 1), "")
        .await
        .unwrap()
        .id;
    leader
        .call(|mut c, t| async move {
            c.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id,
                    reason: "test".into(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .unwrap();

    let mut seen = Vec::new();
    while seen.len() < 2 {
        let ev = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("an event within 10 s")
            .unwrap()
            .expect("stream open");
        let job = ev.job.unwrap();
        assert_eq!(job.id, id);
        seen.push(job.state);
    }
    assert_eq!(seen, vec!["pending", "cancelled"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpuctl_prints_json_other_tools_can_rely_on() {
    let c = start(3, &[]).await;

    step("gpuctl submit --output json");
    let (ok, out, err) = gpuctl(
        &c,
        &[
            "submit",
            "--gpus",
            "2",
            "--time",
            "24:00:00",
            "--idempotency-key",
            "k",
            "-o",
            "json",
            "--",
            "python",
            "train.py",
        ],
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let id = v["id"].as_u64().expect("an id");
    let (ok, out, _) = gpuctl(
        &c,
        &[
            "submit",
            "--gpus",
            "2",
            "--time",
            "24:00:00",
            "--idempotency-key",
            "k",
            "-o",
            "json",
            "--",
            "python",
            "train.py",
        ],
    );
    assert!(ok);
    let again: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(again["id"].as_u64(), Some(id));

    step("gpuctl cancel, then queue with and without --all");
    let (ok, _, err) = gpuctl(&c, &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    let (_, out, _) = gpuctl(&c, &["queue", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["jobs"].as_array().unwrap().len(), 0);
    let (_, out, _) = gpuctl(&c, &["queue", "--all", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0]["state"], "cancelled");
    assert_eq!(jobs[0]["time_limit_secs"], 86_400);

    step("gpuctl cluster status --output json");
    let (ok, out, _) = gpuctl(&c, &["cluster", "status", "-o", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let leader = v["leader"].as_u64().unwrap();
    assert!((1..=3).contains(&leader));
    assert!(v["term"].as_u64().unwrap() >= 1);
    let members = v["members"].as_array().unwrap();
    assert_eq!(members.len(), 3);
    for m in members {
        assert!(m["address"].as_str().unwrap().starts_with("127.0.0.1:"));
    }
}
