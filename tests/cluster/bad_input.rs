//! Bad input changes nothing and says what is wrong: invalid requests get InvalidArgument
//! naming the field, and a data directory that is corrupt, from another cluster or from a newer
//! format makes the replica refuse to start.

use std::time::Duration;

use control_plane::local_cluster::StartMode;
use proto::v1 as pb;

use crate::util::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_refused_naming_the_field_and_write_nothing() {
    let c = start(3, &[]).await;
    let mut client = c.client().unwrap();
    let before = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();

    let cases: Vec<(&str, pb::JobSpec)> = vec![
        (
            "gpus_per_task",
            pb::JobSpec {
                gpus_per_task: -2,
                ..spec("neg", 1)
            },
        ),
        (
            "tasks",
            pb::JobSpec {
                tasks: -1,
                ..spec("neg-tasks", 1)
            },
        ),
        (
            "tasks",
            pb::JobSpec {
                tasks: 0,
                ..spec("zero-tasks", 1)
            },
        ),
        (
            "gpus_per_task",
            pb::JobSpec {
                gpus_per_task: 0,
                ..spec("nothing", 0)
            },
        ),
        (
            "gpus_per_task",
            pb::JobSpec {
                gpus_per_task: 64,
                ..spec("huge", 1)
            },
        ),
        (
            "command",
            pb::JobSpec {
                command: vec![],
                ..spec("empty", 1)
            },
        ),
        (
            "command",
            pb::JobSpec {
                command: vec!["x".repeat(100 * 1024)],
                ..spec("oversized", 1)
            },
        ),
        (
            "tenant",
            pb::JobSpec {
                // An empty tenant means "not given" (the caller's own, or `default`).
                tenant: "no such/tenant".into(),
                ..spec("bad-tenant", 1)
            },
        ),
        (
            "priority_class",
            pb::JobSpec {
                priority_class: "vip".into(),
                ..spec("prio", 1)
            },
        ),
        (
            "time_limit",
            pb::JobSpec {
                time_limit_secs: -5,
                ..spec("time", 1)
            },
        ),
        (
            "dependencies",
            pb::JobSpec {
                dependencies: vec![pb::Dependency {
                    kind: 1,
                    job_id: 999,
                }],
                ..spec("dep", 1)
            },
        ),
    ];
    for (field, s) in cases {
        let err = submit(&mut client, s, "").await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{field}: {err:?}");
        assert!(
            err.message().starts_with(field),
            "message {:?} should name {field}",
            err.message()
        );
    }
    let err = client
        .call(|mut c, t| async move {
            c.submit_job(control_plane::client::with_timeout(
                pb::SubmitJobRequest {
                    spec: None,
                    idempotency_key: String::new(),
                },
                t,
            ))
            .await
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    step("configured tenants and partitions make unknown ones invalid");
    let (ok, _, err) = gpuctl(&c, &["tenant", "set", "team-a", "--quota", "8"]);
    assert!(ok, "{err}");
    let (ok, _, err) = gpuctl(&c, &["partition", "set", "a100"]);
    assert!(ok, "{err}");
    let mid = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let err = submit(
        &mut client,
        pb::JobSpec {
            tenant: "team-z".into(),
            ..spec("t", 1)
        },
        "",
    )
    .await
    .unwrap_err();
    assert!(
        err.message().starts_with("tenant") && err.message().contains("team-a"),
        "{err:?}"
    );
    let err = submit(
        &mut client,
        pb::JobSpec {
            partition: "h100".into(),
            ..spec("p", 1)
        },
        "",
    )
    .await
    .unwrap_err();
    assert!(err.message().starts_with("partition"), "{err:?}");

    step("gpuctl reports a bad time limit before sending anything");
    let (ok, _, err) = gpuctl(&c, &["submit", "--time", "soon", "--", "x"]);
    assert!(!ok);
    assert!(err.contains("time limit"), "{err}");

    step("nothing was written");
    let after = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    assert_eq!(after.jobs, 0);
    assert_eq!(before.jobs, 0);
    assert_eq!(
        after.last_log_index, mid.last_log_index,
        "a rejected request reached the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_refuses_a_data_directory_it_cannot_trust() {
    let mut c = start(3, &[]).await;
    let mut client = c.client().unwrap();
    submit(&mut client, spec("j", 1), "").await.unwrap();
    let victim = follower_of(&c.wait_for_leader(LEADER_TIMEOUT).await.unwrap());
    c.stop(victim, Duration::from_secs(5)).unwrap();
    let dir = c.replicas[&victim].data_dir.clone();
    let meta_path = dir.join("cluster.json");
    let good_meta = std::fs::read(&meta_path).unwrap();

    let refused = |c: &mut TestCluster, want: &str| {
        c.start(victim, StartMode::Initial).unwrap();
        let status = c.wait_exit(victim, Duration::from_secs(20)).unwrap();
        assert!(!status.success());
        let log = c.log(victim);
        assert!(log.contains(want), "expected {want:?} in the log:\n{log}");
    };

    step("metadata from another cluster");
    std::fs::write(
        &meta_path,
        String::from_utf8(good_meta.clone())
            .unwrap()
            .replace("\"test\"", "\"prod\""),
    )
    .unwrap();
    refused(&mut c, "belongs to cluster \"prod\"");

    step("metadata from a newer format");
    std::fs::write(
        &meta_path,
        String::from_utf8(good_meta.clone())
            .unwrap()
            .replace("\"format_version\": 1", "\"format_version\": 7"),
    )
    .unwrap();
    refused(&mut c, "newer gpu-control-plane");

    step("garbage metadata");
    std::fs::write(&meta_path, b"\x7fELF garbage").unwrap();
    refused(&mut c, "is corrupt");

    step("a damaged Raft database");
    std::fs::write(&meta_path, &good_meta).unwrap();
    let db_file = dir.join("raft").join("db");
    let len = std::fs::metadata(&db_file).unwrap().len() as usize;
    std::fs::write(&db_file, vec![0xA5u8; len.max(4096)]).unwrap();
    refused(&mut c, "is corrupt");

    step("the other replicas kept serving");
    submit(&mut client, spec("still-up", 1), "").await.unwrap();
}
