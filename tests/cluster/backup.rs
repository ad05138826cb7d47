//! Backup and restore (`gpuctl cluster snapshot save | restore`): a cluster saved, stopped
//! whole, and restored onto new data directories and ports holds every job (with its state and
//! history), node, tenant, token and audit record, hands out job ids after the saved ones, and
//! places pending work once agents register. A restore refuses a truncated or damaged file, a
//! directory that is not empty and an id outside the members, and writes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use control_plane::client::{Client, Credentials, with_timeout};
use control_plane::local_cluster::{LocalCluster, free_ports};
use proto::v1 as pb;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs gpuctl with `env` only (restore and inspect need no cluster and no credentials).
fn gpuctl_with(env: &[(String, String)], args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(gpuctl_bin())
        .args(args)
        .env_remove("GPUCTL_ENDPOINTS")
        .env_remove("GPUCTL_TLS_DIR")
        .env_remove("GPUCTL_TOKEN")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("running gpuctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every file under `dir` with its bytes (empty when `dir` does not exist).
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.insert(p.clone(), Vec::new());
                todo.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

async fn put_tenant(client: &mut Client, name: &str, quota: u32) {
    let t = pb::Tenant {
        name: name.into(),
        weight: 2,
        quota_gpus: quota,
        max_gpus: 0,
    };
    client
        .call(|mut c, to| {
            let t = t.clone();
            async move { c.put_tenant(with_timeout(t, to)).await }
        })
        .await
        .expect("putting a tenant");
}

async fn list_tenants(client: &mut Client) -> Vec<pb::Tenant> {
    client
        .call(|mut c, t| async move {
            c.list_tenants(with_timeout(pb::ListTenantsRequest { read: None }, t))
                .await
        })
        .await
        .expect("listing tenants")
        .tenants
}

async fn create_token(client: &mut Client, role: &str, tenant: &str) -> String {
    let req = pb::CreateTokenRequest {
        role: role.into(),
        tenant: tenant.into(),
        description: format!("backup test {role}"),
        ttl_secs: 0,
    };
    client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.create_token(with_timeout(r, t)).await }
        })
        .await
        .expect("creating a token")
        .secret
}

async fn list_tokens(client: &mut Client) -> Vec<pb::Token> {
    client
        .call(|mut c, t| async move {
            c.list_tokens(with_timeout(pb::ListTokensRequest { read: None }, t))
                .await
        })
        .await
        .expect("listing tokens")
        .tokens
}

async fn list_audit(client: &mut Client) -> Vec<pb::AuditRecord> {
    client
        .call(|mut c, t| async move {
            c.list_audit(with_timeout(
                pb::ListAuditRequest {
                    limit: 10_000,
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .expect("listing the audit trail")
        .records
}

/// A job as it must survive a restore: everything but what changes after (its state, history
/// and allocations are compared separately).
fn identity(j: &pb::Job) -> (u64, Option<pb::JobSpec>, String, u64) {
    (
        j.id,
        j.spec.clone(),
        j.idempotency_key.clone(),
        j.submitted_at_ms,
    )
}

/// The restore command line for replica `id` of `members`.
fn restore_args<'a>(file: &'a str, dir: &'a str, id: &'a str, members: &'a str) -> Vec<&'a str> {
    vec![
        "cluster",
        "snapshot",
        "restore",
        file,
        "--data-dir",
        dir,
        "--id",
        id,
        "--cluster",
        "test",
        "--members",
        members,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_restored_from_a_backup_has_every_record_and_places_pending_work() {
    let mut c = start_with_agents(&[("gpu-a", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();

    step("tenants, a token, and jobs that finished, run and wait");
    put_tenant(&mut client, "team-a", 0).await;
    put_tenant(&mut client, "vision", 1).await;
    let user_token = create_token(&mut client, "user", "team-a").await;
    let finished = submit(&mut client, shell_job(1, "true"), "done")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, finished, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    let running = submit(&mut client, shell_job(1, "sleep 600"), "run")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, running, JOB_TIMEOUT, "ran", |j| {
        j.state == "running"
    })
    .await;
    let cancelled = submit(&mut client, spec("to-cancel", 4), "")
        .await
        .unwrap()
        .id;
    client
        .call(|mut cl, t| async move {
            cl.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id: cancelled,
                    reason: "not needed".into(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .unwrap();
    // All four GPUs of the only host, one of which the running job holds.
    let pending = submit(&mut client, spec("waits-for-4-gpus", 4), "wait")
        .await
        .unwrap()
        .id;

    step("save through a follower (forwarded to the leader)");
    let status = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    let follower = follower_of(&status);
    let backup = c._dir.path().join("cluster.backup");
    let backup_s = backup.display().to_string();
    let mut env = c.gpuctl_env().unwrap();
    env.retain(|(k, _)| k != "GPUCTL_ENDPOINTS");
    env.push(("GPUCTL_ENDPOINTS".into(), c.addr(follower)));
    let (ok, out, err) = gpuctl_with(&env, &["cluster", "snapshot", "save", &backup_s]);
    assert!(ok, "save failed: {out}{err}");
    print!("{out}");
    assert!(out.contains("saved cluster \"test\" at log index"), "{out}");
    assert!(out.contains("4 jobs"), "{out}");
    assert!(out.contains("1 nodes") && out.contains("1 tokens"), "{out}");

    step("what the cluster held when the save returned");
    // The save came after every write above was acknowledged, so the copy holds them all; the
    // only change since is the running job's (none: it sleeps).
    let saved_jobs = list_jobs(&mut client, false).await;
    assert_eq!(saved_jobs.len(), 4);
    let saved_nodes = list_nodes(&mut client).await;
    let saved_tenants = list_tenants(&mut client).await;
    let saved_tokens = list_tokens(&mut client).await;
    let saved_audit = list_audit(&mut client).await;
    assert!(!saved_audit.is_empty());
    let (ok, out, err) = gpuctl_with(&[], &["cluster", "snapshot", "inspect", &backup_s]);
    assert!(ok, "inspect failed: {err}");
    print!("{out}");
    assert!(
        out.contains("(checked)") && out.contains("members then:"),
        "{out}"
    );
    assert!(out.contains(&format!("last job id:  {pending}")), "{out}");

    step("stop the whole cluster: agents, then replicas");
    c.kill_agent("gpu-a").unwrap();
    for id in [1, 2, 3] {
        c.stop(id, Duration::from_secs(10)).unwrap();
    }
    let old_agent_dir = c.agents["gpu-a"].state_dir.clone();

    step("restore three replicas on new directories and ports");
    let new_root = tempfile::tempdir().unwrap();
    copy_dir(&c.root.join("tls"), &new_root.path().join("tls"));
    let ports = free_ports(3).unwrap();
    let members = ports
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let mut r = TestCluster {
        cluster: LocalCluster::new(&control_plane_bin(), &[], new_root.path(), "test", &ports),
        _dir: new_root,
    };
    r.extra_args = FAST_LEASES.iter().map(|s| s.to_string()).collect();
    for id in [1u64, 2, 3] {
        let dir = r.replicas[&id].data_dir.display().to_string();
        let (ok, out, err) = gpuctl_with(
            &[],
            &restore_args(&backup_s, &dir, &id.to_string(), &members),
        );
        assert!(ok, "restore of replica {id} failed: {out}{err}");
        assert!(out.contains(&format!("restored replica {id}")), "{out}");
        print!("{out}");
    }
    r.start_all().unwrap();
    let restored_status = r.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    assert!(restored_status.term > status.term, "{restored_status:?}");
    let mut members_now: Vec<String> = restored_status
        .members
        .iter()
        .map(|m| format!("{}={}", m.id, m.address))
        .collect();
    members_now.sort();
    assert_eq!(members_now.join(","), members);

    step("every job, node, tenant, token and audit record is there");
    let mut rc = r.client().unwrap();
    let jobs = list_jobs(&mut rc, false).await;
    assert_eq!(
        jobs.iter().map(identity).collect::<Vec<_>>(),
        saved_jobs.iter().map(identity).collect::<Vec<_>>()
    );
    for (saved, now) in saved_jobs.iter().zip(&jobs) {
        // Jobs that ended, or wait, are as they were; the running job may have moved on
        // since (the liveness rules judge its node), but its history up to the save is kept.
        if saved.id != running {
            assert_eq!(saved.state, now.state, "job {}", saved.id);
            assert_eq!(saved.history, now.history, "job {}", saved.id);
        } else {
            assert_eq!(
                &now.history[..saved.history.len()],
                &saved.history[..],
                "job {}",
                saved.id
            );
        }
    }
    let find = |id: u64| jobs.iter().find(|j| j.id == id).unwrap().state.clone();
    assert_eq!(find(finished), "succeeded");
    assert_eq!(find(cancelled), "cancelled");
    assert_eq!(find(pending), "pending");
    let nodes = list_nodes(&mut rc).await;
    assert_eq!(
        nodes
            .iter()
            .map(|n| (&n.name, n.gpus.len()))
            .collect::<Vec<_>>(),
        saved_nodes
            .iter()
            .map(|n| (&n.name, n.gpus.len()))
            .collect::<Vec<_>>()
    );
    assert_eq!(list_tenants(&mut rc).await, saved_tenants);
    assert_eq!(list_tokens(&mut rc).await, saved_tokens);
    let audit = list_audit(&mut rc).await;
    assert_eq!(&audit[..saved_audit.len()], &saved_audit[..]);

    step("the token made before the save works on the restored cluster");
    let creds = Credentials::from_dir(&r.admin_tls_dir().unwrap(), None)
        .unwrap()
        .with_token(user_token);
    let mut as_user = Client::new(&r.endpoints(), &creds).unwrap();
    let me = as_user
        .call(|mut cl, t| async move { cl.who_am_i(with_timeout(pb::WhoAmIRequest {}, t)).await })
        .await
        .expect("the saved token is accepted");
    assert_eq!(me.role, "user", "{me:?}");

    step("a new job gets an id above every saved one");
    let new = submit(&mut rc, spec("after-restore", 1), "after")
        .await
        .unwrap();
    assert!(new.created);
    let highest = saved_jobs.iter().map(|j| j.id).max().unwrap();
    assert!(
        new.id > highest,
        "new job {} reuses an id (saved up to {highest})",
        new.id
    );

    step("with no agent heartbeating, the node is judged lost and the running job requeued");
    // What happens to work that ran when the backup was taken: the restored state says it
    // runs, on a node whose agent has not heartbeated to this cluster; after the node's lease
    // and grace the leader marks the node down and requeues the job (the liveness rules).
    let requeued = wait_job(&mut rc, running, JOB_TIMEOUT, "requeued", |j| {
        j.state == "pending"
    })
    .await;
    assert!(
        requeued
            .history
            .last()
            .is_some_and(|h| h.reason.starts_with("requeued")),
        "{requeued:#?}"
    );
    let down = list_nodes(&mut rc).await;
    assert_eq!(down[0].status, "down", "{down:#?}");

    step("agents register: the old host (same state directory) and a new 8-GPU host");
    r.agent_program = Some((gpuctl_bin(), vec!["agent".into()]));
    let agent_ports = free_ports(2).unwrap();
    let agent_args = ["--stop-grace-secs", "1", "--fence-grace-ms", "500"];
    r.add_agent(
        "gpu-a",
        "a100-pcie-4gpu-nvlink-pairs",
        agent_ports[0],
        &agent_args,
    );
    r.agents.get_mut("gpu-a").unwrap().state_dir = old_agent_dir;
    r.add_agent("gpu-b", "pcie-8gpu-2socket", agent_ports[1], &agent_args);
    r.start_agent("gpu-a").unwrap();
    r.start_agent("gpu-b").unwrap();

    step("the pending jobs are placed and run");
    wait_job(&mut rc, pending, JOB_TIMEOUT, "ran", |j| {
        j.state == "running"
    })
    .await;
    let again = wait_job(&mut rc, running, JOB_TIMEOUT, "ran again", |j| {
        j.state == "running"
    })
    .await;
    assert_eq!(again.allocations.len(), 1, "{again:#?}");
    let nodes = list_nodes(&mut rc).await;
    assert!(
        nodes.iter().all(|n| n.status == "ready") && nodes.len() == 2,
        "{nodes:#?}"
    );
}

/// Copies a directory tree (the test CA and certificates).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_refuses_bad_files_full_directories_and_strangers_and_writes_nothing() {
    let c = start(3, &[]).await;
    let mut client = c.client().unwrap();
    submit(&mut client, spec("one", 1), "one").await.unwrap();

    step("only an admin may save");
    let operator = create_token(&mut client, "operator", "").await;
    let root = c._dir.path().to_owned();
    let refused = root.join("refused.backup");
    let mut env = c.gpuctl_env().unwrap();
    env.push(("GPUCTL_TOKEN".into(), operator));
    let (ok, _, err) = gpuctl_with(
        &env,
        &[
            "cluster",
            "snapshot",
            "save",
            &refused.display().to_string(),
        ],
    );
    assert!(!ok);
    assert!(
        err.contains("may not save a backup of the cluster's state"),
        "{err}"
    );
    assert!(!refused.exists());

    step("a good backup");
    let good = root.join("good.backup");
    let good_s = good.display().to_string();
    let (ok, out, err) = gpuctl(&c, &["cluster", "snapshot", "save", &good_s]);
    assert!(ok, "{out}{err}");
    let bytes = std::fs::read(&good).unwrap();
    let members = "1=127.0.0.1:1,2=127.0.0.1:2,3=127.0.0.1:3";

    let full_dir = root.join("full");
    std::fs::create_dir_all(&full_dir).unwrap();
    std::fs::write(full_dir.join("keep.txt"), "an old replica's files").unwrap();
    let mut flipped = bytes.clone();
    let last = flipped.len() - 10;
    flipped[last] ^= 0x20;
    let mut newer = bytes.clone();
    newer[8] = 99;
    // (what, the file's bytes, the data directory if not a new one, the id, the message)
    type Case<'a> = (&'a str, Vec<u8>, Option<&'a Path>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            "truncated",
            bytes[..bytes.len() / 2].to_vec(),
            None,
            "1",
            "is truncated",
        ),
        (
            "a flipped byte",
            flipped,
            None,
            "1",
            "is damaged: its state's SHA-256",
        ),
        (
            "an unknown format version",
            newer,
            None,
            "1",
            "a backup of format 99, which this gpuctl does not read",
        ),
        (
            "a directory that is not empty",
            bytes.clone(),
            Some(&full_dir),
            "1",
            "exists and is not empty",
        ),
        (
            "an id not in --members",
            bytes.clone(),
            None,
            "4",
            "replica 4 is not in --members (1, 2, 3)",
        ),
    ];
    for (i, (what, file_bytes, dir, id, want)) in cases.into_iter().enumerate() {
        step(&format!("refused: {what}"));
        let file = root.join(format!("case-{i}.backup"));
        std::fs::write(&file, &file_bytes).unwrap();
        let dir = dir
            .map(Path::to_owned)
            .unwrap_or(root.join(format!("restored-{i}")));
        let before = files(&dir);
        let existed = dir.exists();
        let (ok, out, err) = gpuctl_with(
            &[],
            &restore_args(
                &file.display().to_string(),
                &dir.display().to_string(),
                id,
                members,
            ),
        );
        assert!(!ok, "{what}: restore succeeded: {out}");
        assert!(err.contains(want), "{what}: {err}");
        assert_eq!(
            dir.exists(),
            existed,
            "{what}: the directory appeared or vanished"
        );
        assert_eq!(files(&dir), before, "{what}: the directory changed");
        assert_eq!(
            std::fs::read(&file).unwrap(),
            file_bytes,
            "{what}: the file changed"
        );
    }

    step("the good file restores into an empty directory that exists");
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (ok, out, err) = gpuctl_with(
        &[],
        &restore_args(&good_s, &empty.display().to_string(), "2", members),
    );
    assert!(ok, "{out}{err}");
    assert!(empty.join("cluster.json").exists());
}
