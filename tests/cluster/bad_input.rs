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
    // Read from the leader once the new cluster's version entry is in: a follower's status
    // may not yet count the partition just written, and the version entry may land later.
    let mid = leader_status(&c).await;
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
    // No tenant at all: the error says which flag names one, and the tenants there are.
    let (ok, _, err) = gpuctl(&c, &["submit", "--", "x"]);
    assert!(!ok);
    assert!(
        err.contains("names no tenant") && err.contains("--tenant NAME") && err.contains("team-a"),
        "{err}"
    );

    step("gpuctl reports a bad time limit before sending anything");
    let (ok, _, err) = gpuctl(&c, &["submit", "--time", "soon", "--", "x"]);
    assert!(!ok);
    assert!(err.contains("time limit"), "{err}");

    step("nothing was written");
    assert_eq!(before.jobs, 0);
    assert_eq!(mid.jobs, 0, "a rejected submission wrote a job");
    assert_nothing_written(&c, &mid, "rejected requests").await;
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

/// Every file under `dir` with its bytes.
fn files(dir: &std::path::Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Puts `dir` back to exactly `saved` (sled adds files of its own when it opens).
fn restore(dir: &std::path::Path, saved: &std::collections::BTreeMap<std::path::PathBuf, Vec<u8>>) {
    for p in files(dir).keys() {
        if !saved.contains_key(p) {
            std::fs::remove_file(p).unwrap();
        }
    }
    for (p, b) in saved {
        std::fs::write(p, b).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_or_bit_flipped_data_directory_stops_the_replica_with_a_message_not_a_panic() {
    let mut c = start(3, &[]).await;
    let mut client = c.client().unwrap();
    for i in 0..5 {
        submit(&mut client, spec(&format!("j{i}"), 1), "")
            .await
            .unwrap();
    }
    let victim = follower_of(&c.wait_for_leader(LEADER_TIMEOUT).await.unwrap());
    c.stop(victim, Duration::from_secs(5)).unwrap();
    let dir = c.replicas[&victim].data_dir.clone();
    let saved = files(&dir);
    let meta = dir.join("cluster.json");
    let db = dir.join("raft").join("db");

    type Damage = Box<dyn Fn()>;
    let (m, d, conf) = (meta.clone(), db.clone(), dir.join("raft").join("conf"));
    let cut = |path: std::path::PathBuf, keep: fn(usize) -> usize| -> Damage {
        Box::new(move || {
            let b = std::fs::read(&path).unwrap();
            std::fs::write(&path, &b[..keep(b.len())]).unwrap();
        })
    };
    // (what, damage, what the log says, whether the directory is left byte for byte as it
    // was: damage datadir finds before sled opens the database is; sled recovers a damaged
    // log on open by rewriting it, before the damage is reported.)
    let cases: Vec<(&str, Damage, &str, bool)> = vec![
        (
            "cluster.json cut in half (a torn write)",
            cut(m.clone(), |n| n / 2),
            "cluster.json does not parse: EOF while parsing",
            true,
        ),
        (
            "cluster.json empty",
            cut(m.clone(), |_| 0),
            "cluster.json does not parse: EOF while parsing a value at line 1 column 0",
            true,
        ),
        (
            "cluster.json with a flipped bit",
            Box::new(move || {
                let mut b = std::fs::read(&m).unwrap();
                b[0] ^= 0x01;
                std::fs::write(&m, b).unwrap();
            }),
            "cluster.json does not parse",
            true,
        ),
        (
            "sled's conf garbage",
            Box::new(move || std::fs::write(&conf, b"\xff\xfe garbage").unwrap()),
            "the sled database does not open",
            true,
        ),
        (
            "the Raft database cut to 10 bytes",
            cut(d.clone(), |_| 10),
            "is corrupt: ",
            false,
        ),
        (
            "a flipped bit in the Raft database's first record",
            Box::new(move || {
                let mut b = std::fs::read(&d).unwrap();
                b[8] ^= 0x10;
                std::fs::write(&d, b).unwrap();
            }),
            "the Raft database has lost its identity record",
            false,
        ),
    ];
    for (what, damage, want, untouched) in cases {
        step(what);
        restore(&dir, &saved);
        damage();
        let damaged = files(&dir);
        let log_before = c.log(victim).len();
        c.start(victim, StartMode::Initial).unwrap();
        let status = c.wait_exit(victim, Duration::from_secs(20)).unwrap();
        assert_eq!(status.code(), Some(1), "{what}: {status:?}");
        let log = c.log(victim)[log_before..].to_owned();
        let error = log
            .lines()
            .find(|l| l.starts_with("control-plane: error: "))
            .unwrap_or_else(|| panic!("{what}: no error in the log:\n{log}"));
        assert!(
            error.starts_with(&format!(
                "control-plane: error: data directory {} is corrupt: ",
                dir.display()
            )) && error.contains(want)
                && error.ends_with(
                    "restore it from a backup or wipe it and rejoin the replica with --join"
                ),
            "{what}: {error}"
        );
        assert!(!log.contains("panicked"), "{what}: {log}");
        if untouched {
            assert!(
                files(&dir) == damaged,
                "{what}: the directory was rewritten"
            );
        }
    }

    step("put back as it was, the replica starts and catches up: nothing else was lost");
    restore(&dir, &saved);
    c.start(victim, StartMode::Initial).unwrap();
    submit(&mut client, spec("after", 1), "").await.unwrap();
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let s = wait_applied(&c, victim, leader.commit_index, Duration::from_secs(20)).await;
    assert_eq!(s.jobs, 6);
}
