//! Attacks on a running TLS cluster, each refused, and what the refusal looks like: no or
//! foreign or expired certificates, certificates of the wrong role, a node certificate acting
//! for another node, tokens used outside their tenant or after revocation, forged and replayed
//! Raft messages, and a forged forwarding header. docs/SECURITY.md lists them as a table.

use std::time::{Duration, Instant};

use control_plane::client::{Client, Credentials, with_timeout};
use control_plane::local_cluster::LocalCluster;
use proto::agent as pa;
use proto::agent::agent_api_client::AgentApiClient;
use proto::raft::RaftMessage;
use proto::raft::raft_peer_client::RaftPeerClient;
use proto::tls::pki::{self, IssueRequest};
use proto::tls::{CertRole, ClientAuth, ExpectedPeer, TlsContext, TlsFiles};
use proto::transport::Transport;
use proto::v1 as pb;
use tonic::Code;

use crate::util::*;

/// TLS with a fresh certificate for `req`, signed by the cluster's own CA.
fn transport_as(c: &LocalCluster, dir: &str, req: IssueRequest) -> Transport {
    let dir = c.identity(dir, &req).expect("issuing a certificate");
    Transport::Tls(TlsContext::load(TlsFiles::in_dir(&dir), ClientAuth::Required).unwrap())
}

/// TLS with files written to `dir` (certificates from another CA, expired ones).
fn transport_from(dir: &std::path::Path, files: &pki::IdentityFiles) -> Transport {
    files.write(dir).unwrap();
    Transport::Tls(TlsContext::load(TlsFiles::in_dir(dir), ClientAuth::Required).unwrap())
}

fn client_with(c: &LocalCluster, transport: Transport, token: Option<&str>) -> Client {
    let creds = Credentials {
        transport,
        token: None,
    };
    let creds = match token {
        Some(t) => creds.with_token(t),
        None => creds,
    };
    let mut client = Client::new(&c.endpoints(), &creds).unwrap();
    client.deadline = Duration::from_secs(3);
    client.attempt_timeout = Duration::from_secs(2);
    client
}

async fn whoami(client: &mut Client) -> Result<pb::WhoAmIResponse, tonic::Status> {
    client
        .call(|mut c, t| async move { c.who_am_i(with_timeout(pb::WhoAmIRequest {}, t)).await })
        .await
}

async fn create_token(client: &mut Client, role: &str, tenant: &str) -> String {
    let req = pb::CreateTokenRequest {
        role: role.into(),
        tenant: tenant.into(),
        description: format!("test {role} {tenant}"),
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

fn refusals(s: &pb::ClusterStatusResponse, name: &str) -> u64 {
    s.refusals
        .iter()
        .find(|c| c.name == name)
        .map_or(0, |c| c.value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_a_valid_certificate_are_refused_at_the_handshake() {
    let c = start(3, &[]).await;
    let jobs_before = list_jobs(&mut c.client().unwrap(), false).await.len();

    step("plaintext client");
    let mut plain = client_with(&c, Transport::Plain, None);
    let err = whoami(&mut plain).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("runs with TLS"), "{err:?}");

    step("TLS client without a certificate (the replicas require one)");
    let ca_only = TlsFiles {
        cert: None,
        key: None,
        ..TlsFiles::in_dir(&c.admin_tls_dir().unwrap())
    };
    let t = Transport::Tls(TlsContext::load(ca_only, ClientAuth::Required).unwrap());
    let err = whoami(&mut client_with(&c, t, None)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    step("a certificate from another CA");
    let other = pki::create_ca("mallory", 30).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let foreign = pki::issue(&other, &IssueRequest::client("mallory", "admin", None)).unwrap();
    let t = transport_from(dir.path(), &foreign);
    let err = whoami(&mut client_with(&c, t, None)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    step("an expired certificate of the cluster's CA");
    let now = pki::OffsetDateTime::now_utc();
    let expired = pki::issue_valid(
        &c.ca().unwrap(),
        &IssueRequest::client("old-admin", "admin", None),
        now - Duration::from_secs(30 * 86_400),
        now - Duration::from_secs(86_400),
    )
    .unwrap();
    let dir2 = tempfile::tempdir().unwrap();
    let t = transport_from(dir2.path(), &expired);
    let err = whoami(&mut client_with(&c, t, None)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    step("the handshake failures are counted, and nothing was written");
    let s = leader_status(&c).await;
    assert!(refusals(&s, "tls_handshake") >= 1, "{:?}", s.refusals);
    let total: u64 = {
        let mut sum = 0;
        for id in c.replicas.keys().copied().collect::<Vec<_>>() {
            sum += refusals(&c.status(id).await.unwrap(), "tls_handshake");
        }
        sum
    };
    assert!(total >= 4, "four handshakes refused in all: {total}");
    assert_eq!(
        list_jobs(&mut c.client().unwrap(), false).await.len(),
        jobs_before
    );
    assert!(
        c.log(1).contains("refused a connection") || c.log(2).contains("refused a connection"),
        "refusals are logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_that_grant_nothing_are_refused_with_unauthenticated() {
    let c = start(3, &[]).await;
    step("a client certificate without a role, and no token");
    let t = transport_as(&c, "bare", IssueRequest::new(CertRole::Client, "bare"));
    let err = whoami(&mut client_with(&c, t.clone(), None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("grants no role"), "{err:?}");

    step("made-up and malformed tokens");
    for token in [
        "gpucp.0123456789abcdef.000000000000000000000000000000000000000000000000",
        "not-a-token",
    ] {
        let err = whoami(&mut client_with(&c, t.clone(), Some(token)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{token}: {err:?}");
    }

    step("a real token's id with a guessed secret");
    let mut admin = c.client().unwrap();
    let good = create_token(&mut admin, "admin", "").await;
    let id = good.split('.').nth(1).unwrap();
    let guessed = format!("gpucp.{id}.{}", "1".repeat(48));
    let err = whoami(&mut client_with(&c, t.clone(), Some(&guessed)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("wrong secret"), "{err:?}");

    step("the same certificate with the real token works");
    let me = whoami(&mut client_with(&c, t, Some(&good))).await.unwrap();
    assert_eq!(me.principal, format!("token:{id}"));
    assert_eq!(me.role, "admin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_takes_certificates_of_its_own_role_only() {
    let c = start_with_agents(&[("gpu-1", "dgx-h100")]).await;
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap().leader;
    let addr = c.addr(leader);

    step("a node certificate on the client API");
    let node = transport_as(
        &c,
        "node-gpu-1-copy",
        IssueRequest::new(CertRole::Node, "gpu-1"),
    );
    let mut as_node = client_with(&c, node.clone(), None);
    let err = submit(&mut as_node, spec("x", 1), "").await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(
        err.message()
            .contains("node certificates may not submit jobs"),
        "{err:?}"
    );

    step("an admin client certificate on the agent API");
    let admin_t = transport_as(
        &c,
        "admin-2",
        IssueRequest::client("admin-2", "admin", None),
    );
    let mut agent_api = AgentApiClient::new(admin_t.channel(&addr, ExpectedPeer::Replica).unwrap());
    let err = agent_api
        .heartbeat(pa::HeartbeatRequest {
            node: "gpu-1".into(),
            running: vec![],
            incarnation: String::new(),
            replica_metrics: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("node certificates only"), "{err:?}");

    step("client and node certificates on Raft peer RPC");
    for t in [&admin_t, &node] {
        let mut raft = RaftPeerClient::new(t.channel(&addr, ExpectedPeer::Replica).unwrap());
        let err = raft
            .vote(RaftMessage {
                format_max: 0,
                release: String::new(),
                cluster: "test".into(),
                payload: b"{}".to_vec(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
        assert!(
            err.message().contains("replica certificates only"),
            "{err:?}"
        );
    }

    step("an admin client certificate on the agent's own port");
    let agent_addr = c.agents["gpu-1"].addr.clone();
    let mut direct = proto::agent::node_agent_client::NodeAgentClient::new(
        admin_t
            .channel(&agent_addr, ExpectedPeer::Node("gpu-1".into()))
            .unwrap(),
    );
    let err = direct
        .read_logs(pa::ReadLogsRequest {
            job_id: 1,
            tail_bytes: 0,
            allocation_id: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("replicas only"), "{err:?}");

    step("the refusals are counted by kind");
    let s = c.status(leader).await.unwrap();
    assert!(refusals(&s, "wrong_role") >= 4, "{:?}", s.refusals);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_acts_for_its_own_node_only() {
    let c = start_with_agents(&[("gpu-1", "dgx-h100"), ("gpu-2", "dgx-h100")]).await;
    let mut admin = c.client().unwrap();
    let job = submit(&mut admin, shell_job(1, "sleep 30"), "k")
        .await
        .unwrap()
        .id;
    let running = wait_job(&mut admin, job, Duration::from_secs(20), "ran", |j| {
        j.state == "running"
    })
    .await;
    let alloc = running.allocations[0].clone();
    let victim = alloc.node.clone();
    let thief = if victim == "gpu-1" { "gpu-2" } else { "gpu-1" };
    let before = leader_status(&c).await;

    let t = transport_as(
        &c,
        &format!("node-{thief}-copy"),
        IssueRequest::new(CertRole::Node, thief),
    );
    let calls: Vec<(&str, Result<(), tonic::Status>)> = {
        let leader_addr = c.addr(before.id);
        let mut api = AgentApiClient::new(t.channel(&leader_addr, ExpectedPeer::Replica).unwrap());
        let register = api
            .register_node(pa::RegisterNodeRequest {
                name: victim.clone(),
                fence_grace_ms: 500,
                incarnation: "thief".into(),
                ..Default::default()
            })
            .await
            .map(|_| ());
        let heartbeat = api
            .heartbeat(pa::HeartbeatRequest {
                node: victim.clone(),
                running: vec![],
                incarnation: "thief".into(),
                replica_metrics: Vec::new(),
            })
            .await
            .map(|_| ());
        let report = api
            .report_allocation(pa::AllocationReport {
                node: victim.clone(),
                allocation_id: alloc.id,
                event: pa::allocation_report::Event::Failed as i32,
                reason: "forged".into(),
                ..Default::default()
            })
            .await
            .map(|_| ());
        // Its own name with the other node's allocation: refused too (apply checks the
        // allocation's node).
        let own_name = api
            .report_allocation(pa::AllocationReport {
                node: thief.into(),
                allocation_id: alloc.id,
                event: pa::allocation_report::Event::Failed as i32,
                reason: "forged".into(),
                ..Default::default()
            })
            .await
            .map(|_| ());
        let watch = api
            .watch_assignments(pa::WatchAssignmentsRequest {
                node: victim.clone(),
            })
            .await
            .map(|_| ());
        let health = api
            .report_gpu_health(pa::GpuHealthReport {
                node: victim.clone(),
                gpu_uuid: alloc.gpus[0].clone(),
                healthy: false,
                reason: "forged".into(),
                xid: 79,
            })
            .await
            .map(|_| ());
        vec![
            ("register", register),
            ("heartbeat", heartbeat),
            ("report", report),
            ("report under its own name", own_name),
            ("watch", watch),
            ("gpu health", health),
        ]
    };
    for (what, result) in calls {
        let err = result.expect_err(what);
        assert!(
            matches!(
                err.code(),
                Code::PermissionDenied | Code::FailedPrecondition
            ),
            "{what}: {err:?}"
        );
        assert!(
            err.message()
                .contains(&format!("may not act for node {:?}", victim))
                || err
                    .message()
                    .contains(&format!("may not act for node {victim}"))
                || err
                    .message()
                    .contains(&format!("belongs to node {victim}, not {thief}")),
            "{what}: {err:?}"
        );
    }
    step("the job runs on, the GPU stays healthy, and the refusals are counted and logged");
    let j = get_job(&mut admin, job).await;
    assert_eq!(j.state, "running", "{j:?}");
    let nodes = list_nodes(&mut admin).await;
    let node = nodes.iter().find(|n| n.name == victim).unwrap();
    assert!(node.gpus.iter().all(|g| g.health == "healthy"), "{node:?}");
    let after = c.status(before.id).await.unwrap();
    assert!(
        refusals(&after, "node_mismatch") >= refusals(&before, "node_mismatch") + 5,
        "{:?}",
        after.refusals
    );
    assert!(c.log(before.id).contains("may not act for node"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_token_stays_inside_its_tenant() {
    let c = start_with_agents(&[("gpu-1", "dgx-h100")]).await;
    let mut admin = c.client().unwrap();
    for (name, max) in [("vision", 2), ("speech", 0)] {
        let t = pb::Tenant {
            name: name.into(),
            weight: 1,
            quota_gpus: 0,
            max_gpus: max,
        };
        admin
            .call(|mut cl, to| {
                let t = t.clone();
                async move { cl.put_tenant(with_timeout(t, to)).await }
            })
            .await
            .unwrap();
    }
    let secret_job = pb::JobSpec {
        tenant: "speech".into(),
        env: [("API_KEY".to_string(), "hunter2".to_string())].into(),
        ..shell_job(1, "echo speech-output; sleep 30")
    };
    let theirs = submit(&mut admin, secret_job, "s").await.unwrap().id;
    wait_job(&mut admin, theirs, Duration::from_secs(20), "ran", |j| {
        j.state == "running"
    })
    .await;
    let token = create_token(&mut admin, "user", "vision").await;
    let mut user = client_with(&c, c.credentials().unwrap().transport, Some(&token));

    step("its own jobs: submitted into its tenant without naming it");
    let mine = submit(
        &mut user,
        pb::JobSpec {
            tenant: String::new(),
            ..shell_job(1, "echo mine")
        },
        "m",
    )
    .await
    .unwrap()
    .id;
    let j = get_job(&mut user, mine).await;
    assert_eq!(j.spec.as_ref().unwrap().tenant, "vision");
    assert!(!j.redacted);

    step("another tenant's job: visible, but without name, command or environment");
    let j = get_job(&mut user, theirs).await;
    assert!(j.redacted, "{j:?}");
    let s = j.spec.unwrap();
    assert!(
        s.command.is_empty() && s.env.is_empty() && s.name.is_empty(),
        "{s:?}"
    );
    let listed = list_jobs(&mut user, false).await;
    let seen = listed.iter().find(|j| j.id == theirs).unwrap();
    assert!(seen.redacted && seen.spec.as_ref().unwrap().env.is_empty());

    step("cannot cancel it, read its logs, or submit into its tenant");
    let err = user
        .call(|mut cl, t| async move {
            cl.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id: theirs,
                    reason: String::new(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = user
        .call(|mut cl, t| async move {
            cl.read_job_logs(with_timeout(
                pb::ReadJobLogsRequest {
                    job_id: theirs,
                    tail_bytes: 0,
                    task: None,
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = submit(
        &mut user,
        pb::JobSpec {
            tenant: "speech".into(),
            ..shell_job(1, "true")
        },
        "x",
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    step("cannot exceed its tenant's limit, nor touch nodes, tenants or tokens");
    let err = submit(
        &mut user,
        pb::JobSpec {
            tenant: String::new(),
            ..shell_job(3, "true")
        },
        "big",
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("max_gpus"), "{err:?}");
    let (ok, _, err) = {
        let mut env = c.gpuctl_env().unwrap();
        env.push(("GPUCTL_TOKEN".into(), token.clone()));
        let out = std::process::Command::new(gpuctl_bin())
            .args(["node", "drain", "gpu-1"])
            .envs(env)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert!(!ok && err.contains("PermissionDenied"), "{err}");
    let err = user
        .call(|mut cl, t| async move {
            cl.list_tokens(with_timeout(pb::ListTokensRequest { read: None }, t))
                .await
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    step("the other tenant's job was untouched");
    let j = get_job(&mut admin, theirs).await;
    assert_eq!(j.state, "running");
    assert_eq!(j.spec.unwrap().env["API_KEY"], "hunter2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_stops_working_on_every_replica_within_a_second() {
    let c = start(3, &[]).await;
    let mut admin = c.client().unwrap();
    let token = create_token(&mut admin, "operator", "").await;
    let id = token.split('.').nth(1).unwrap().to_owned();
    let transport = c.credentials().unwrap().transport;
    let ids: Vec<u64> = c.replicas.keys().copied().collect();
    let per_replica = |rid: u64| {
        let creds = Credentials {
            transport: transport.clone(),
            token: None,
        }
        .with_token(&token);
        let mut client = Client::new(&[c.addr(rid)], &creds).unwrap();
        client.deadline = Duration::from_millis(500);
        client.attempt_timeout = Duration::from_millis(500);
        client
    };
    // The token is applied everywhere (each replica checks against its own state).
    for &rid in &ids {
        let deadline = Instant::now() + Duration::from_secs(5);
        while whoami(&mut per_replica(rid)).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "replica {rid} never took the token"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    step("revoke, then time each replica's first refusal");
    let revoked_at = Instant::now();
    admin
        .call(|mut cl, t| {
            let id = id.clone();
            async move {
                cl.revoke_token(with_timeout(pb::RevokeTokenRequest { id }, t))
                    .await
            }
        })
        .await
        .unwrap();
    for &rid in &ids {
        let mut client = per_replica(rid);
        loop {
            match whoami(&mut client).await {
                Err(s) if s.code() == Code::Unauthenticated => {
                    assert!(s.message().contains("revoked"), "{s:?}");
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
            assert!(
                revoked_at.elapsed() < Duration::from_secs(1),
                "replica {rid} still took the revoked token after 1 s"
            );
        }
        println!(
            "replica {rid} refuses the revoked token {:?} after the revocation was sent",
            revoked_at.elapsed()
        );
    }
    step("the revocation is in the audit trail, by whom");
    let (ok, out, err) = gpuctl(&c, &["audit", "-o", "json"]);
    assert!(ok, "{err}");
    assert!(out.contains("revoke_token") && out.contains(&id), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_replayed_raft_messages_change_nothing() {
    let c = start(3, &[]).await;
    let mut admin = c.client().unwrap();
    submit(&mut admin, spec("before", 1), "b").await.unwrap();
    let before = leader_status(&c).await;
    let leader_addr = c.addr(before.id);
    let follower = follower_of(&before);

    // An AppendEntries from an earlier term, as a recorded message replayed later would be.
    let stale = openraft::raft::AppendEntriesRequest::<control_plane::raft::TypeConfig> {
        vote: openraft::Vote::new_committed(0, follower),
        prev_log_id: None,
        entries: vec![],
        leader_commit: None,
    };
    let payload = serde_json::to_vec(&stale).unwrap();
    let msg = RaftMessage {
        format_max: 0,
        release: String::new(),
        cluster: "test".into(),
        payload,
    };

    step("from a client certificate: refused before Raft sees it");
    let client_t = transport_as(
        &c,
        "raft-forger",
        IssueRequest::client("forger", "admin", None),
    );
    let mut raft = RaftPeerClient::new(
        client_t
            .channel(&leader_addr, ExpectedPeer::Replica)
            .unwrap(),
    );
    let err = raft.append_entries(msg.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    step("replayed by a replica certificate: Raft answers with its newer term and keeps its log");
    let replica_t = transport_as(
        &c,
        "replica-9",
        IssueRequest::new(CertRole::Replica, "replica-9"),
    );
    let mut raft = RaftPeerClient::new(
        replica_t
            .channel(&leader_addr, ExpectedPeer::Replica)
            .unwrap(),
    );
    let resp = raft.append_entries(msg).await.unwrap().into_inner();
    let answer: Result<
        openraft::raft::AppendEntriesResponse<u64>,
        openraft::error::RaftError<u64>,
    > = serde_json::from_slice(&resp.payload).unwrap();
    match answer {
        Ok(openraft::raft::AppendEntriesResponse::HigherVote(v)) => {
            assert!(v.leader_id.term >= before.term, "{v:?}")
        }
        other => panic!("a stale AppendEntries was not refused: {other:?}"),
    }
    let after = leader_status(&c).await;
    assert_eq!(after.id, before.id, "the leader kept leading");
    assert_eq!(after.term, before.term);
    assert!(after.commit_index >= before.commit_index);
    assert_eq!(list_jobs(&mut admin, false).await.len(), 1);

    step("to another cluster's replica name: refused by the envelope");
    let mut raft = RaftPeerClient::new(
        replica_t
            .channel(&leader_addr, ExpectedPeer::Replica)
            .unwrap(),
    );
    let err = raft
        .vote(RaftMessage {
            format_max: 0,
            release: String::new(),
            cluster: "other".into(),
            payload: b"{}".to_vec(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_forwarding_header_is_believed_from_replicas_only() {
    let c = start(3, &[]).await;
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap().leader;
    let user_t = transport_as(
        &c,
        "user-cert",
        IssueRequest::client("eve", "user", Some("vision")),
    );
    let channel = user_t
        .channel(&c.addr(leader), ExpectedPeer::Replica)
        .unwrap();
    let mut api = proto::v1::control_plane_client::ControlPlaneClient::new(channel);
    // Claim to be a replica forwarding for an admin certificate.
    let forged = serde_json::json!({
        "from": "10.0.0.1:1",
        "peer": {"role": "client", "name": "root", "client_role": "admin", "tenant": null,
                 "serial": "01", "not_after_ms": u64::MAX},
    });
    let mut req = tonic::Request::new(pb::WhoAmIRequest {});
    req.metadata_mut().insert_bin(
        control_plane::api::auth::CALLER_HEADER,
        tonic::metadata::MetadataValue::from_bytes(forged.to_string().as_bytes()),
    );
    req.metadata_mut()
        .insert(control_plane::api::route::FORWARDED, "1".parse().unwrap());
    let me = api.who_am_i(req).await.unwrap().into_inner();
    assert_eq!(me.principal, "cert:client:eve");
    assert_eq!(me.role, "user");
    assert_eq!(me.tenant, "vision");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_without_a_restart_and_expiry_is_warned_about() {
    let c = start(3, &[]).await;
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap().leader;
    let own = |s: &pb::ClusterStatusResponse| {
        s.certificates
            .iter()
            .find(|x| x.subject == format!("replica:replica-{leader}"))
            .map(|x| x.not_after_ms)
            .unwrap()
    };
    let first = own(&c.status(leader).await.unwrap());

    step("replace the leader's certificate files with one that expires in 10 days");
    let dir = c.root.join("tls").join(format!("replica-{leader}"));
    let short = IssueRequest {
        days: 10,
        ..IssueRequest::new(CertRole::Replica, format!("replica-{leader}"))
    };
    pki::issue(&c.ca().unwrap(), &short)
        .unwrap()
        .write(&dir)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let rotated = loop {
        let s = c.status(leader).await.unwrap();
        if own(&s) != first {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the new certificate was not loaded"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let days = (own(&rotated) - now_ms()) / 86_400_000;
    assert!((9..=10).contains(&days), "{days}");
    assert_eq!(rotated.leader, leader, "no restart, no election");
    assert!(c.log(leader).contains("TLS files re-read"));

    step("new connections use it; `cluster status` warns; SIGHUP rereads at once");
    let (ok, out, err) = gpuctl(&c, &["cluster", "status"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!(
            "WARNING: certificate replica:replica-{leader} expires in"
        )),
        "{out}"
    );
    let mut c = c;
    let reloads = |c: &LocalCluster| c.log(leader).matches("TLS files re-read").count();
    let before_hup = reloads(&c);
    c.signal(leader, libc::SIGHUP).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while reloads(&c) == before_hup {
        assert!(Instant::now() < deadline, "SIGHUP did not reload");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut admin = c.client().unwrap();
    submit(&mut admin, spec("after-rotation", 1), "r")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpuctl_manages_tokens_and_shows_the_audit_trail() {
    let c = start(3, &[]).await;
    step("create, list, use, revoke");
    let (ok, out, err) = gpuctl(
        &c,
        &[
            "-o", "json", "token", "create", "--role", "user", "--tenant", "team-a", "--ttl", "1h",
        ],
    );
    assert!(ok, "{err}");
    let created: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let secret = created["secret"].as_str().unwrap().to_owned();
    let id = created["token"]["id"].as_str().unwrap().to_owned();
    assert!(created["token"]["expires_at_ms"].as_u64().unwrap() > now_ms());
    let (ok, out, _) = gpuctl(&c, &["token", "list"]);
    assert!(ok && out.contains(&id) && !out.contains(&secret), "{out}");

    let mut env = c.gpuctl_env().unwrap();
    env.push(("GPUCTL_TOKEN".into(), secret.clone()));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(gpuctl_bin())
            .args(args)
            .envs(env.clone())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = run(&["submit", "--gpus", "1", "--", "true"]);
    assert!(ok, "{err}");
    let job: u64 = out.trim().rsplit(' ').next().unwrap().parse().unwrap();
    let (ok, out, _) = run(&["whoami"]);
    assert!(
        ok && out.contains(&format!("token:{id} (user, tenant team-a)")),
        "{out}"
    );

    step("the audit trail names the token and where it came from");
    let (ok, out, err) = gpuctl(&c, &["-o", "json", "audit", "--job", &job.to_string()]);
    assert!(ok, "{err}");
    let records: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let first = &records["records"][0];
    assert_eq!(first["action"], "submit_job", "{records}");
    assert_eq!(first["principal"], format!("token:{id}"), "{records}");
    assert_eq!(first["tenant"], "team-a");
    assert!(first["from"].as_str().unwrap().starts_with("127.0.0.1:"));
    let (ok, out, _) = gpuctl(&c, &["audit", "--since", "1h"]);
    assert!(ok && out.contains("create_token"), "{out}");

    let (ok, _, err) = gpuctl(&c, &["token", "revoke", &id]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&["queue"]);
    assert!(!ok && err.contains("revoked"), "{err}");
    let (ok, _, err) = gpuctl(&c, &["token", "revoke", &id]);
    assert!(!ok && err.contains("revoked already"), "{err}");
}

#[test]
fn gpuctl_without_credentials_says_what_to_give() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(gpuctl_bin())
        .arg("queue")
        .current_dir(dir.path())
        .env_remove("GPUCTL_TLS_DIR")
        .env_remove("GPUCTL_TOKEN")
        .env("GPUCTL_ENDPOINTS", "127.0.0.1:1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--tls-dir") && err.contains("gpuctl dev") && err.contains("--insecure"),
        "{err}"
    );
}
