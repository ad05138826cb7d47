//! Why a job is pending, through the API and gpuctl: impossible jobs are refused with their
//! reason and write nothing, or wait as `Unfit` when held, and run once a node that fits
//! joins; a job behind a higher-priority one says `Priority`, a tenant at its limit
//! `QuotaExceeded`.

use std::time::Duration;

use control_plane::client::{Client, with_timeout};
use control_plane::local_cluster::free_ports;
use proto::v1 as pb;

use crate::util::*;

async fn why(client: &mut Client, id: u64) -> pb::WhyJobResponse {
    client
        .call(|mut c, t| async move { c.why_job(with_timeout(pb::WhyJobRequest { id }, t)).await })
        .await
        .expect("why")
}

/// Waits until the job's reason starts with `prefix` (the next pass computes it).
async fn wait_reason(client: &mut Client, id: u64, prefix: &str) -> pb::Job {
    wait_job(
        client,
        id,
        Duration::from_secs(20),
        &format!("showed {prefix:?}"),
        |j| j.pending_reason.starts_with(prefix),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_jobs_say_why_and_impossible_ones_are_refused_or_held() {
    let mut c = start_with_agents(&[("n1", "dgx-h100"), ("n2", "dgx-h100")]).await;
    let mut client = c.client().unwrap();

    step("jobs no node could ever hold are refused with the reason, writing nothing");
    let before = leader_status(&c).await;
    let cases: Vec<(&str, &str, pb::JobSpec)> = vec![
        (
            "resources",
            "its 3 tasks of 8 GPUs need more than the cluster has",
            pb::JobSpec {
                tasks: 3,
                ..spec("gang", 8)
            },
        ),
        (
            "resources",
            "2 too few CPUs",
            pb::JobSpec {
                cpu_milli_per_task: 1_000_000_000_000,
                ..spec("cpus", 1)
            },
        ),
        (
            "resources",
            "2 too little memory",
            pb::JobSpec {
                memory_mib_per_task: 99_999_999 * 1024 * 1024,
                ..spec("mem", 1)
            },
        ),
        (
            "partition",
            "PartitionEmpty: partition nowhere has no nodes",
            pb::JobSpec {
                partition: "nowhere".into(),
                ..spec("part", 1)
            },
        ),
        (
            "gpus_per_task",
            "9 GPUs per task, but the largest node has 8",
            spec("nine", 9),
        ),
    ];
    for (field, want, s) in cases {
        let err = submit(&mut client, s, "").await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().starts_with(field), "{err:?}");
        assert!(err.message().contains(want), "{want:?} in {err:?}");
    }
    let (ok, _, err) = gpuctl(&c, &["cancel", "0"]);
    assert!(!ok);
    assert!(err.contains("job 0"), "{err}");
    let (ok, _, err) = gpuctl(&c, &["node", "drain", "nosuchnode"]);
    assert!(!ok);
    assert!(err.contains("nosuchnode"), "{err}");
    assert_nothing_written(&c, &before, "refused requests").await;

    step("held if unfit: accepted, pending as Unfit");
    let held = submit(
        &mut client,
        pb::JobSpec {
            tasks: 3,
            hold_if_unfit: true,
            ..spec("held", 8)
        },
        "",
    )
    .await
    .unwrap()
    .id;
    let j = wait_reason(&mut client, held, "Unfit:").await;
    assert!(
        j.pending_reason.contains("at most 2 such tasks"),
        "{}",
        j.pending_reason
    );
    let w = why(&mut client, held).await;
    assert!(
        w.lines.iter().any(|l| l.starts_with("can never run")),
        "{w:?}"
    );

    step("a tenant at its limit: QuotaExceeded");
    let (ok, _, err) = gpuctl(&c, &["tenant", "set", "vision", "--max", "2"]);
    assert!(ok, "{err}");
    let (ok, _, err) = gpuctl(&c, &["tenant", "set", "team-a"]);
    assert!(ok, "{err}");
    let vision = |gpus| pb::JobSpec {
        tenant: "vision".into(),
        ..spec("v", gpus)
    };
    let v1 = submit(&mut client, vision(2), "").await.unwrap().id;
    wait_job(&mut client, v1, Duration::from_secs(20), "placed", |j| {
        j.state != "pending"
    })
    .await;
    let v2 = submit(&mut client, vision(1), "").await.unwrap().id;
    let j = wait_reason(&mut client, v2, "QuotaExceeded:").await;
    assert_eq!(
        j.pending_reason,
        "QuotaExceeded: tenant vision at 2/2 GPUs, the job needs 1 more"
    );

    step("behind a higher-priority job: Priority");
    // n1 and n2 have 14 GPUs left: fill them.
    let a = submit(&mut client, spec("fill-a", 8), "").await.unwrap().id;
    let b = submit(&mut client, spec("fill-b", 6), "").await.unwrap().id;
    for id in [a, b] {
        wait_job(&mut client, id, Duration::from_secs(20), "placed", |j| {
            j.state != "pending"
        })
        .await;
    }
    let head = submit(
        &mut client,
        pb::JobSpec {
            priority_class: "high".into(),
            ..spec("head", 8)
        },
        "",
    )
    .await
    .unwrap()
    .id;
    let behind = submit(&mut client, spec("behind", 8), "").await.unwrap().id;
    let j = wait_reason(&mut client, head, "Resources:").await;
    assert_eq!(
        j.pending_reason,
        "Resources: 0/2 nodes have 8 free GPUs (2 GPUs busy)"
    );
    let j = wait_reason(&mut client, behind, "Priority:").await;
    assert_eq!(j.pending_reason, format!("Priority: behind job {head}"));

    step("gpuctl queue and gpuctl why show them");
    let (ok, out, err) = gpuctl(&c, &["queue"]);
    assert!(ok, "{err}");
    assert!(out.contains("NODES/REASON"), "{out}");
    assert!(
        out.contains(&format!("Priority: behind job {head}")),
        "{out}"
    );
    assert!(out.contains("Unfit: its 3 tasks"), "{out}");
    let (ok, out, err) = gpuctl(&c, &["why", &head.to_string()]);
    assert!(ok, "{err}");
    assert!(out.starts_with(&format!("job {head}: PENDING\n")), "{out}");
    assert!(out.contains("needs 8 GPUs on one node"), "{out}");
    assert!(out.contains("closest node n"), "{out}");

    step("a stale read on a follower says the reason is the leader's");
    // gpuctl may ask any replica: a follower says where the reason is, the leader gives it.
    let (ok, out, err) = gpuctl(&c, &["queue", "--stale"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("reason known on the leader") || out.contains("Priority: behind job"),
        "{out}"
    );

    step("a third host joins: the held job runs");
    for id in [v1, a, b, head, behind, v2] {
        let (ok, _, err) = gpuctl(&c, &["cancel", &id.to_string()]);
        assert!(ok, "{err}");
    }
    let port = free_ports(1).unwrap()[0];
    c.add_agent(
        "n3",
        "dgx-h100",
        port,
        &["--stop-grace-secs", "1", "--fence-grace-ms", "500"],
    );
    c.start_agent("n3").unwrap();
    let j = wait_job(&mut client, held, Duration::from_secs(30), "placed", |j| {
        j.state != "pending"
    })
    .await;
    assert_eq!(j.pending_reason, "");
    assert_eq!(j.allocations.len(), 3, "{j:?}");
}
