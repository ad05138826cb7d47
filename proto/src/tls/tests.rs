//! Real TLS connections on loopback: which certificates a server and a client accept, what
//! the server learns about its peer, and reloading.

use std::path::Path;
use std::time::Duration;

use tonic::{Request, Response, Status};

use super::pki::{self, CaFiles, IdentityFiles, IssueRequest};
use super::*;
use crate::raft::RaftMessage;
use crate::raft::raft_peer_client::RaftPeerClient;
use crate::raft::raft_peer_server::{RaftPeer, RaftPeerServer};
use crate::transport::Transport;

/// Answers every call with the caller's identity as the connection named it.
struct WhoAmI;

fn who(request: &Request<RaftMessage>) -> String {
    match request.extensions().get::<ConnInfo>() {
        Some(ConnInfo { peer: Some(p), .. }) => p.subject(),
        Some(ConnInfo { tls: true, .. }) => "tls without certificate".into(),
        Some(_) => "plain".into(),
        None => "no connection info".into(),
    }
}

#[tonic::async_trait]
impl RaftPeer for WhoAmI {
    async fn append_entries(
        &self,
        r: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        Ok(Response::new(RaftMessage {
            format_max: 0,
            release: String::new(),
            cluster: who(&r),
            payload: Vec::new(),
        }))
    }
    async fn vote(&self, r: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        self.append_entries(r).await
    }
    async fn install_snapshot(
        &self,
        r: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        self.append_entries(r).await
    }
    async fn notify_removed(
        &self,
        r: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        self.append_entries(r).await
    }
}

fn write(dir: &Path, files: &IdentityFiles) -> TlsFiles {
    files.write(dir).expect("writing identity");
    TlsFiles::in_dir(dir)
}

fn ctx(files: TlsFiles, auth: ClientAuth) -> TlsContext {
    TlsContext::load(files, auth).expect("loading TLS files")
}

struct Pki {
    dir: tempfile::TempDir,
    ca: CaFiles,
}

impl Pki {
    fn new() -> Pki {
        Pki {
            dir: tempfile::tempdir().unwrap(),
            ca: pki::create_ca("test", 30).unwrap(),
        }
    }

    fn identity(&self, dir: &str, req: IssueRequest) -> TlsFiles {
        write(
            &self.dir.path().join(dir),
            &pki::issue(&self.ca, &req).unwrap(),
        )
    }
}

/// Serves `WhoAmI` with `transport`; returns its address.
async fn serve(transport: Transport) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let incoming = transport.incoming(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RaftPeerServer::new(WhoAmI))
            .serve_with_incoming(incoming),
    );
    addr
}

async fn call(transport: &Transport, addr: &str, expect: ExpectedPeer) -> Result<String, String> {
    let channel = transport.channel(addr, expect).unwrap();
    let mut client = RaftPeerClient::new(channel);
    let mut req = Request::new(RaftMessage::default());
    req.set_timeout(Duration::from_secs(5));
    match client.vote(req).await {
        Ok(r) => Ok(r.into_inner().cluster),
        Err(s) => {
            use std::error::Error;
            let mut msg = s.message().to_owned();
            let mut src = s.source();
            while let Some(e) = src {
                msg.push_str(&format!(": {e}"));
                src = e.source();
            }
            Err(msg)
        }
    }
}

#[test]
fn identities_read_back_from_the_certificates() {
    let pki = Pki::new();
    let cases = [
        (
            IssueRequest::new(CertRole::Replica, "replica-2"),
            None,
            None,
        ),
        (IssueRequest::new(CertRole::Node, "gpu-1"), None, None),
        (IssueRequest::new(CertRole::Client, "ci-bot"), None, None),
        (
            IssueRequest::client("alice", "user", Some("vision")),
            Some("user"),
            Some("vision"),
        ),
        (
            IssueRequest::client("root", "admin", None),
            Some("admin"),
            None,
        ),
    ];
    for (req, role, tenant) in cases {
        let files = pki::issue(&pki.ca, &req).unwrap();
        let der =
            rustls_pki_types::CertificateDer::from_pem_slice(files.cert_pem.as_bytes()).unwrap();
        let id = parse_identity(&der).unwrap();
        assert_eq!(id.role, req.role);
        assert_eq!(id.name, req.name);
        assert_eq!(id.client_role.as_deref(), role);
        assert_eq!(id.tenant.as_deref(), tenant);
        let days = (id.not_after_ms - now_ms()) / 86_400_000;
        assert!((364..=365).contains(&days), "{days}");
    }
}

#[test]
fn bad_issue_requests_are_refused_with_the_reason() {
    let pki = Pki::new();
    let cases: Vec<(IssueRequest, &str)> = vec![
        (IssueRequest::new(CertRole::Replica, "cp-1"), "replica-<id>"),
        (IssueRequest::client("a", "root", None), "--role"),
        (IssueRequest::client("a", "user", None), "needs --tenant"),
        (
            IssueRequest::client("a", "admin", Some("t")),
            "--tenant goes",
        ),
        (IssueRequest::new(CertRole::Node, ""), "--name"),
        (
            IssueRequest {
                days: 0,
                ..IssueRequest::new(CertRole::Node, "n")
            },
            "--days",
        ),
    ];
    for (req, want) in cases {
        let err = pki::issue(&pki.ca, &req)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains(want), "{req:?}: {err}");
    }
}

#[tokio::test]
async fn the_server_names_its_peer_and_refuses_strangers() {
    let pki = Pki::new();
    let replica = ctx(
        pki.identity("r1", IssueRequest::new(CertRole::Replica, "replica-1")),
        ClientAuth::Required,
    );
    let addr = serve(Transport::Tls(replica.clone())).await;

    // Each role is named by its certificate.
    for (dir, req, want) in [
        (
            "n1",
            IssueRequest::new(CertRole::Node, "gpu-7"),
            "node:gpu-7",
        ),
        (
            "c1",
            IssueRequest::client("alice", "admin", None),
            "client:alice",
        ),
        (
            "r2",
            IssueRequest::new(CertRole::Replica, "replica-2"),
            "replica:replica-2",
        ),
    ] {
        let t = Transport::Tls(ctx(pki.identity(dir, req), ClientAuth::Required));
        assert_eq!(call(&t, &addr, ExpectedPeer::Replica).await.unwrap(), want);
    }
    let before = replica.handshake_failures();

    // No certificate: refused at the handshake.
    let token_only = TlsFiles {
        cert: None,
        key: None,
        ..pki.identity("c2", IssueRequest::new(CertRole::Client, "x"))
    };
    let t = Transport::Tls(ctx(token_only, ClientAuth::Required));
    let err = call(&t, &addr, ExpectedPeer::Replica).await.unwrap_err();
    assert!(
        err.contains("transport error") || err.contains("connect"),
        "{err}"
    );

    // A certificate from another CA: refused.
    let other = Pki::new();
    let t = Transport::Tls(ctx(
        other.identity("x", IssueRequest::client("mallory", "admin", None)),
        ClientAuth::Required,
    ));
    assert!(call(&t, &addr, ExpectedPeer::Replica).await.is_err());

    // An expired certificate of the right CA: refused.
    let now = pki::OffsetDateTime::now_utc();
    let expired = pki::issue_valid(
        &pki.ca,
        &IssueRequest::client("old", "admin", None),
        now - time::Duration::days(10),
        now - time::Duration::days(1),
    )
    .unwrap();
    let t = Transport::Tls(ctx(
        write(&pki.dir.path().join("old"), &expired),
        ClientAuth::Required,
    ));
    assert!(call(&t, &addr, ExpectedPeer::Replica).await.is_err());

    // A plaintext client: refused.
    assert!(
        call(&Transport::Plain, &addr, ExpectedPeer::Replica)
            .await
            .is_err()
    );
    // Handshake failures are counted (the plaintext one when its handshake times out, later).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while replica.handshake_failures() < before + 3 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_token_only_client_is_let_in_where_certificates_are_optional() {
    let pki = Pki::new();
    let replica = ctx(
        pki.identity("r1", IssueRequest::new(CertRole::Replica, "replica-1")),
        ClientAuth::Optional,
    );
    let addr = serve(Transport::Tls(replica)).await;
    let token_only = TlsFiles {
        cert: None,
        key: None,
        ..pki.identity("c", IssueRequest::new(CertRole::Client, "x"))
    };
    let t = Transport::Tls(ctx(token_only, ClientAuth::Required));
    assert_eq!(
        call(&t, &addr, ExpectedPeer::Replica).await.unwrap(),
        "tls without certificate"
    );
}

#[tokio::test]
async fn clients_refuse_a_server_of_the_wrong_role_or_node() {
    let pki = Pki::new();
    let node = ctx(
        pki.identity("n", IssueRequest::new(CertRole::Node, "gpu-1")),
        ClientAuth::Required,
    );
    let agent = serve(Transport::Tls(node)).await;
    let replica = Transport::Tls(ctx(
        pki.identity("r", IssueRequest::new(CertRole::Replica, "replica-1")),
        ClientAuth::Required,
    ));
    assert_eq!(
        call(&replica, &agent, ExpectedPeer::Node("gpu-1".into()))
            .await
            .unwrap(),
        "replica:replica-1"
    );
    let err = call(&replica, &agent, ExpectedPeer::Node("gpu-2".into()))
        .await
        .unwrap_err();
    assert!(err.contains("node \"gpu-1\", not \"gpu-2\""), "{err}");
    let err = call(&replica, &agent, ExpectedPeer::Replica)
        .await
        .unwrap_err();
    assert!(
        err.contains("presented a node certificate (\"gpu-1\") where a replica was expected"),
        "{err}"
    );
}

#[tokio::test]
async fn a_reload_gives_new_connections_the_new_certificate() {
    let pki = Pki::new();
    let server = ctx(
        pki.identity("r", IssueRequest::new(CertRole::Replica, "replica-1")),
        ClientAuth::Required,
    );
    let addr = serve(Transport::Tls(server)).await;
    let client_files = pki.identity("c", IssueRequest::client("first", "admin", None));
    let client = ctx(client_files.clone(), ClientAuth::Required);
    let t = Transport::Tls(client.clone());
    assert_eq!(
        call(&t, &addr, ExpectedPeer::Replica).await.unwrap(),
        "client:first"
    );
    assert!(!client.reload_if_changed().unwrap(), "nothing changed yet");

    // A broken file is reported and the old material stays in use.
    std::fs::write(client_files.cert.as_ref().unwrap(), "not a certificate").unwrap();
    let err = client.reload_if_changed().unwrap_err().to_string();
    assert!(err.contains("cert.pem"), "{err}");
    assert_eq!(client.identity().unwrap().name, "first");

    pki::issue(&pki.ca, &IssueRequest::client("second", "admin", None))
        .unwrap()
        .write(&pki.dir.path().join("c"))
        .unwrap();
    assert!(client.reload_if_changed().unwrap());
    assert_eq!(client.identity().unwrap().name, "second");
    // A new channel (a new connection) presents the new certificate.
    assert_eq!(
        call(&t, &addr, ExpectedPeer::Replica).await.unwrap(),
        "client:second"
    );
}

#[test]
fn expiry_is_warned_about_a_month_ahead() {
    let day = 86_400_000;
    let now = 1_000 * day;
    assert!(expiry_warning("x", now + 60 * day, now).is_none());
    assert!(
        expiry_warning("x", now + 10 * day, now)
            .unwrap()
            .contains("10.0 days")
    );
    assert!(
        expiry_warning("x", now - 1, now)
            .unwrap()
            .contains("EXPIRED")
    );
    assert!(expiry_warning("x", u64::MAX, now).is_none());
}

#[test]
fn missing_or_mismatched_files_name_the_file() {
    let pki = Pki::new();
    let files = pki.identity("a", IssueRequest::new(CertRole::Node, "n"));
    let missing = TlsFiles {
        ca: pki.dir.path().join("nope.pem"),
        ..files.clone()
    };
    let err = TlsContext::load(missing, ClientAuth::Required)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("nope.pem") && err.contains("cannot be read"),
        "{err}"
    );
    // Another certificate's key: the pair is unusable.
    let other = pki.identity("b", IssueRequest::new(CertRole::Node, "m"));
    let mixed = TlsFiles {
        key: other.key,
        ..files
    };
    let err = TlsContext::load(mixed, ClientAuth::Required)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("usable pair"), "{err}");
}

#[tokio::test]
async fn a_ca_rotation_keeps_old_and_new_certificates_talking_while_both_are_trusted() {
    let old = Pki::new();
    let new_ca = pki::create_ca("test-2", 30).unwrap();
    // Step 1: the server's certificate comes from the new CA; `write` adds the new CA to the
    // bundle already in its directory (the old one).
    let server_dir = old.dir.path().join("r");
    old.identity("r", IssueRequest::new(CertRole::Replica, "replica-1"));
    pki::issue(&new_ca, &IssueRequest::new(CertRole::Replica, "replica-1"))
        .unwrap()
        .write(&server_dir)
        .unwrap();
    let bundle = std::fs::read_to_string(server_dir.join(pki::CA_CERT_FILE)).unwrap();
    assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 2, "{bundle}");
    let server = ctx(TlsFiles::in_dir(&server_dir), ClientAuth::Required);
    let addr = serve(Transport::Tls(server)).await;
    // A client still on the old CA, which trusts both: it reaches the new-CA server, and the
    // server takes its old-CA certificate.
    let client_dir = old.dir.path().join("c");
    old.identity("c", IssueRequest::client("alice", "admin", None));
    let mut both = std::fs::read_to_string(client_dir.join(pki::CA_CERT_FILE)).unwrap();
    both.push_str(&new_ca.cert_pem);
    std::fs::write(client_dir.join(pki::CA_CERT_FILE), both).unwrap();
    let t = Transport::Tls(ctx(TlsFiles::in_dir(&client_dir), ClientAuth::Required));
    assert_eq!(
        call(&t, &addr, ExpectedPeer::Replica).await.unwrap(),
        "client:alice"
    );
    // A client that trusts the old CA only is refused by... itself: it cannot verify the
    // server. That is the step the bundle exists for.
    let lone = old.identity("l", IssueRequest::client("bob", "admin", None));
    let t = Transport::Tls(ctx(lone, ClientAuth::Required));
    assert!(call(&t, &addr, ExpectedPeer::Replica).await.is_err());
}

#[tokio::test]
async fn a_revoked_certificate_is_refused_once_the_crl_is_in_place() {
    let pki = Pki::new();
    let ca_dir = pki.dir.path().join("ca");
    pki.ca.write(&ca_dir).unwrap();
    let server = ctx(
        pki.identity("r", IssueRequest::new(CertRole::Replica, "replica-1")),
        ClientAuth::Required,
    );
    let addr = serve(Transport::Tls(server.clone())).await;
    let files = pki.identity("c", IssueRequest::client("stolen", "admin", None));
    let client = ctx(files, ClientAuth::Required);
    let t = Transport::Tls(client.clone());
    assert_eq!(
        call(&t, &addr, ExpectedPeer::Replica).await.unwrap(),
        "client:stolen"
    );
    let serial = client.identity().unwrap().serial;
    let crl = pki::revoke(&ca_dir, &serial, 30).unwrap();
    std::fs::copy(&crl, pki.dir.path().join("r").join(CRL_FILE)).unwrap();
    assert!(server.reload_if_changed().unwrap(), "the CRL is picked up");
    let err = call(&t, &addr, ExpectedPeer::Replica).await.unwrap_err();
    assert!(!err.is_empty());
    // Another certificate of the same CA still works.
    let other = ctx(
        pki.identity("d", IssueRequest::client("fine", "admin", None)),
        ClientAuth::Required,
    );
    assert_eq!(
        call(&Transport::Tls(other), &addr, ExpectedPeer::Replica)
            .await
            .unwrap(),
        "client:fine"
    );
}
