//! Who is calling, and may they? Every API call is authenticated here before it runs or is
//! forwarded, and each handler asks its caller for the permission its action needs.
//!
//! A caller is named by, in order: a bearer token (`authorization: Bearer gpucp.<id>.<secret>`,
//! checked against this replica's applied state, so a revocation takes effect everywhere once
//! applied), else its TLS client certificate (a node certificate names a node; a client
//! certificate may grant a role by itself, `gpuctl certs issue client --role`). A call that a
//! follower forwards to the leader arrives over the follower's replica certificate; the
//! follower attaches the original caller's certificate identity and address
//! (`x-gpucp-caller-bin`), which the leader believes only from a replica certificate, and
//! the token travels unchanged, so the leader checks it against its own state again.
//!
//! With `--insecure` nothing is authenticated: every caller is an anonymous admin, and the
//! replica says so in its log at start-up.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use proto::tls::{CertRole, ConnInfo, PeerIdentity, TlsContext};
use serde::{Deserialize, Serialize};
use tonic::Request;
use tonic::metadata::{MetadataMap, MetadataValue};

use crate::replica::{ApiError, Replica};
use crate::state::validate::shown;
use crate::state::{Actor, ApiRole, ClusterState, TokenRecord};

/// Metadata carrying the original caller of a forwarded call (JSON of [`ForwardedCaller`]).
pub const CALLER_HEADER: &str = "x-gpucp-caller-bin";
pub const AUTHORIZATION: &str = "authorization";
/// Prefix of every token's text: `gpucp.<16 hex id>.<48 hex secret>`.
pub const TOKEN_PREFIX: &str = "gpucp";

/// Refusals this replica made, by kind (shown by `gpuctl cluster status`).
#[derive(Debug, Default)]
pub struct Counters {
    /// No credentials, or a token that is unknown, revoked, expired or malformed.
    pub unauthenticated: AtomicU64,
    /// Authenticated, but the role does not allow the action (or another tenant's job).
    pub permission_denied: AtomicU64,
    /// A node certificate acting for another node.
    pub node_mismatch: AtomicU64,
    /// A certificate of the wrong role for the service (a client certificate on Raft RPC,
    /// a node certificate on the client API).
    pub wrong_role: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        vec![
            (
                "unauthenticated",
                self.unauthenticated.load(Ordering::Relaxed),
            ),
            (
                "permission_denied",
                self.permission_denied.load(Ordering::Relaxed),
            ),
            ("node_mismatch", self.node_mismatch.load(Ordering::Relaxed)),
            ("wrong_role", self.wrong_role.load(Ordering::Relaxed)),
        ]
    }
}

/// A replica's security settings and what it has observed.
pub struct Security {
    /// Off with `--insecure`: every caller is an anonymous admin.
    pub enforced: bool,
    pub tls: Option<TlsContext>,
    pub counters: Counters,
    /// Certificates seen on incoming connections (subject → expiry, ms), for expiry warnings
    /// in `cluster status`.
    seen: Mutex<BTreeMap<String, u64>>,
}

impl Security {
    pub fn new(tls: Option<TlsContext>) -> Security {
        Security {
            enforced: tls.is_some(),
            tls,
            counters: Counters::default(),
            seen: Mutex::new(BTreeMap::new()),
        }
    }

    /// Enforcement without TLS: identities come from the connection info a test harness puts
    /// on each request (the deterministic simulation calls the services in process).
    pub fn enforced_without_tls() -> Security {
        Security {
            enforced: true,
            ..Security::new(None)
        }
    }

    fn saw(&self, peer: &PeerIdentity) {
        let mut seen = self.seen.lock().expect("seen certificates lock poisoned");
        // Bounded: a fleet has thousands of nodes, not millions.
        if seen.len() < 100_000 || seen.contains_key(&peer.subject()) {
            seen.insert(peer.subject(), peer.not_after_ms);
        }
    }

    /// Certificates seen so far with their expiry, this replica's own first.
    pub fn certificates(&self) -> Vec<(String, u64)> {
        let own = self
            .tls
            .as_ref()
            .and_then(|t| t.identity())
            .map(|id| (id.subject(), id.not_after_ms));
        let ca = self
            .tls
            .as_ref()
            .map(|t| ("ca".to_owned(), t.current().ca_not_after_ms));
        let seen = self.seen.lock().expect("seen certificates lock poisoned");
        own.into_iter()
            .chain(ca)
            .chain(seen.iter().map(|(s, t)| (s.clone(), *t)))
            .collect()
    }

    fn refuse(&self, counter: &AtomicU64, caller: &str, message: String) -> String {
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(caller, "refused: {message}");
        message
    }

    fn unauthenticated(&self, caller: &str, message: String) -> ApiError {
        ApiError::Unauthenticated(self.refuse(&self.counters.unauthenticated, caller, message))
    }

    fn denied(&self, counter: &AtomicU64, caller: &str, message: String) -> ApiError {
        ApiError::PermissionDenied(self.refuse(counter, caller, message))
    }
}

/// Who a caller is, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Security is off.
    Anonymous,
    Token {
        id: String,
        role: ApiRole,
        tenant: Option<String>,
    },
    /// A client certificate that grants a role by itself.
    ClientCert {
        name: String,
        role: ApiRole,
        tenant: Option<String>,
    },
    Node(String),
    Replica(String),
}

/// An authenticated caller of one request.
#[derive(Clone)]
pub struct Caller {
    pub principal: Principal,
    /// Where the call came from (the first replica's view).
    pub from: String,
    /// The certificate of the original connection, forwarded along with the call.
    peer: Option<PeerIdentity>,
    /// The bearer token as received, forwarded unchanged.
    authorization: Option<MetadataValue<tonic::metadata::Ascii>>,
    security: Arc<Security>,
}

/// What a follower tells the leader about the caller of a forwarded call.
#[derive(Debug, Serialize, Deserialize)]
struct ForwardedCaller {
    from: String,
    peer: Option<ForwardedPeer>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ForwardedPeer {
    role: String,
    name: String,
    client_role: Option<String>,
    tenant: Option<String>,
    serial: String,
    not_after_ms: u64,
}

impl From<&PeerIdentity> for ForwardedPeer {
    fn from(p: &PeerIdentity) -> Self {
        ForwardedPeer {
            role: p.role.as_str().to_owned(),
            name: p.name.clone(),
            client_role: p.client_role.clone(),
            tenant: p.tenant.clone(),
            serial: p.serial.clone(),
            not_after_ms: p.not_after_ms,
        }
    }
}

impl ForwardedPeer {
    fn identity(self) -> Option<PeerIdentity> {
        Some(PeerIdentity {
            role: CertRole::parse(&self.role)?,
            name: self.name,
            client_role: self.client_role,
            tenant: self.tenant,
            serial: self.serial,
            not_after_ms: self.not_after_ms,
        })
    }
}

/// Reads `gpucp.<id>.<secret>` from an `authorization: Bearer ...` value.
fn parse_bearer(value: &str) -> Result<(&str, &str), String> {
    let token = value
        .strip_prefix("Bearer ")
        .ok_or("the authorization header is not `Bearer <token>`")?
        .trim();
    let mut parts = token.splitn(3, '.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(TOKEN_PREFIX), Some(id), Some(secret)) if !id.is_empty() && !secret.is_empty() => {
            Ok((id, secret))
        }
        _ => Err("the token is not of the form gpucp.<id>.<secret>".into()),
    }
}

/// SHA-256 of a token's secret, lowercase hex (what the state stores).
pub fn secret_hash(secret: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, secret.as_bytes())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks a presented token against the state's record.
fn check_token(
    cluster: &ClusterState,
    id: &str,
    secret: &str,
    now: u64,
) -> Result<TokenRecord, String> {
    let record = cluster
        .tokens
        .get(id)
        .ok_or_else(|| format!("token {id:?} is unknown to this cluster"))?;
    // Both sides are hashes of fixed length: comparing them leaks nothing about the secret.
    if record.secret_sha256 != secret_hash(secret) {
        return Err(format!("token {id:?} has a wrong secret"));
    }
    record.usable_at(now)?;
    Ok(record.clone())
}

/// The caller of `request`. Errors are `Unauthenticated`, counted and logged; a replica that
/// was removed from the cluster refuses every call with `Unavailable`, saying so (clients then
/// try another replica).
pub async fn authenticate<T>(replica: &Replica, request: &Request<T>) -> Result<Caller, ApiError> {
    if let Some(why) = replica.removed() {
        return Err(ApiError::Unavailable(why));
    }
    authenticate_caller(replica, request).await
}

/// `authenticate`, also on a removed replica (for `ClusterStatus`, which says it was removed).
pub async fn authenticate_caller<T>(
    replica: &Replica,
    request: &Request<T>,
) -> Result<Caller, ApiError> {
    let security = replica.security.clone();
    let conn = request.extensions().get::<ConnInfo>();
    let remote = conn
        .and_then(|c| c.remote)
        .map(|a| a.to_string())
        .unwrap_or_else(|| "unknown".into());
    let conn_peer = conn.and_then(|c| c.peer.as_deref().cloned());
    if let Some(p) = &conn_peer {
        security.saw(p);
    }
    // A follower forwarding a call names the original caller; only replicas are believed.
    let forwarded = match (&conn_peer, request.metadata().get_bin(CALLER_HEADER)) {
        (Some(p), Some(v)) if p.role == CertRole::Replica => v
            .to_bytes()
            .ok()
            .and_then(|b| serde_json::from_slice::<ForwardedCaller>(&b).ok()),
        _ => None,
    };
    let (peer, from) = match forwarded {
        Some(f) => (f.peer.and_then(ForwardedPeer::identity), f.from),
        None => (conn_peer, remote),
    };
    let authorization = request.metadata().get(AUTHORIZATION).cloned();
    let caller = |principal| Caller {
        principal,
        from: from.clone(),
        peer: peer.clone(),
        authorization: authorization.clone(),
        security: security.clone(),
    };
    if !security.enforced {
        return Ok(caller(Principal::Anonymous));
    }
    let who = peer.as_ref().map_or_else(
        || format!("unknown caller from {from}"),
        |p| format!("{} from {from}", p.subject()),
    );
    if let Some(value) = &authorization {
        let value = value.to_str().map_err(|_| {
            security.unauthenticated(&who, "the authorization header is not text".into())
        })?;
        let (id, secret) = parse_bearer(value).map_err(|m| security.unauthenticated(&who, m))?;
        let record = {
            let data = replica.sm.read_async().await;
            check_token(&data.cluster, id, secret, replica.now_ms())
        }
        .map_err(|m| security.unauthenticated(&who, m))?;
        return Ok(caller(Principal::Token {
            id: record.id,
            role: record.role,
            tenant: record.tenant,
        }));
    }
    let principal = match &peer {
        None => {
            return Err(security.unauthenticated(
                &who,
                "no credentials: give a token (--token or GPUCTL_TOKEN) or a client certificate with a role (--tls-dir)".into(),
            ));
        }
        Some(p) => match p.role {
            CertRole::Node => Principal::Node(p.name.clone()),
            CertRole::Replica => Principal::Replica(p.name.clone()),
            CertRole::Client => {
                let role = p.client_role.as_deref().and_then(ApiRole::parse).ok_or_else(|| {
                    security.unauthenticated(
                        &who,
                        format!(
                            "client certificate {:?} grants no role by itself; give a token (--token or GPUCTL_TOKEN)",
                            p.name
                        ),
                    )
                })?;
                if role == ApiRole::User && p.tenant.is_none() {
                    return Err(security.unauthenticated(
                        &who,
                        format!(
                            "client certificate {:?} has role user but no tenant",
                            p.name
                        ),
                    ));
                }
                Principal::ClientCert {
                    name: p.name.clone(),
                    role,
                    tenant: p.tenant.clone(),
                }
            }
        },
    };
    Ok(caller(principal))
}

/// What a client-API caller wants to do; [`allowed`] says which roles may.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    SubmitJob,
    CancelJob,
    /// Hold, release, requeue or update jobs.
    ChangeJobs,
    ReadJobs,
    ReadLogs,
    ReadCluster,
    ManageReplicas,
    ManageTenants,
    ManagePartitions,
    ManageNodes,
    ManageTokens,
    ReadAudit,
    /// Copy the whole replicated state (token hashes and audit trail included) for a backup.
    SaveBackup,
    /// Create, change, scale, roll back or delete long-running services.
    ManageServices,
}

impl Action {
    pub const ALL: [Action; 14] = [
        Action::SubmitJob,
        Action::CancelJob,
        Action::ChangeJobs,
        Action::ReadJobs,
        Action::ReadLogs,
        Action::ReadCluster,
        Action::ManageReplicas,
        Action::ManageTenants,
        Action::ManagePartitions,
        Action::ManageNodes,
        Action::ManageTokens,
        Action::ReadAudit,
        Action::SaveBackup,
        Action::ManageServices,
    ];

    pub fn describe(self) -> &'static str {
        match self {
            Action::SubmitJob => "submit jobs",
            Action::CancelJob => "cancel jobs",
            Action::ChangeJobs => "hold, release, requeue or update jobs",
            Action::ReadJobs => "read jobs",
            Action::ReadLogs => "read job logs",
            Action::ReadCluster => "read nodes, tenants, partitions and cluster status",
            Action::ManageReplicas => "add or remove replicas",
            Action::ManageTenants => "create or change tenants",
            Action::ManagePartitions => "create or change partitions",
            Action::ManageNodes => {
                "manage nodes (drain, undrain, uncordon, restart agents, inject faults)"
            }
            Action::ManageTokens => "manage tokens (create, list, revoke)",
            Action::ReadAudit => "read the audit trail",
            Action::SaveBackup => "save a backup of the cluster's state",
            Action::ManageServices => "create, change, scale or delete services",
        }
    }
}

/// The role table (docs/SECURITY.md prints it). User actions on jobs are further limited to
/// the user's own tenant by the handlers.
pub fn allowed(role: ApiRole, action: Action) -> bool {
    use Action::*;
    match role {
        ApiRole::Admin => true,
        ApiRole::Operator => matches!(
            action,
            ReadJobs | ReadCluster | ManagePartitions | ManageNodes | ReadAudit
        ),
        ApiRole::User => matches!(
            action,
            SubmitJob
                | CancelJob
                | ChangeJobs
                | ReadJobs
                | ReadLogs
                | ReadCluster
                | ReadAudit
                | ManageServices
        ),
    }
}

impl Caller {
    /// A caller for work a replica does on its own behalf in tests and tools.
    pub fn anonymous(security: Arc<Security>) -> Caller {
        Caller {
            principal: Principal::Anonymous,
            from: "local".into(),
            peer: None,
            authorization: None,
            security,
        }
    }

    /// The API role the caller acts with (`None` for nodes and replicas).
    pub fn role(&self) -> Option<ApiRole> {
        match &self.principal {
            Principal::Anonymous => Some(ApiRole::Admin),
            Principal::Token { role, .. } | Principal::ClientCert { role, .. } => Some(*role),
            Principal::Node(_) | Principal::Replica(_) => None,
        }
    }

    /// The tenant a `user` caller is confined to; `None` for everyone else.
    pub fn tenant_scope(&self) -> Option<&str> {
        match &self.principal {
            Principal::Token {
                role: ApiRole::User,
                tenant,
                ..
            }
            | Principal::ClientCert {
                role: ApiRole::User,
                tenant,
                ..
            } => tenant.as_deref(),
            _ => None,
        }
    }

    /// How logs and the audit trail name the caller.
    pub fn principal_name(&self) -> String {
        match &self.principal {
            Principal::Anonymous => "anonymous".into(),
            Principal::Token { id, .. } => format!("token:{id}"),
            Principal::ClientCert { name, .. } => format!("cert:client:{name}"),
            Principal::Node(n) => format!("node:{n}"),
            Principal::Replica(n) => format!("replica:{n}"),
        }
    }

    fn describe(&self) -> String {
        match self.role() {
            Some(role) => match self.tenant_scope() {
                Some(t) => format!("{} ({}, tenant {t})", self.principal_name(), role.as_str()),
                None => format!("{} ({})", self.principal_name(), role.as_str()),
            },
            None => self.principal_name(),
        }
    }

    /// The audit trail's record of this caller.
    pub fn actor(&self) -> Actor {
        Actor {
            principal: self.principal_name(),
            role: match (&self.principal, self.role()) {
                (_, Some(r)) => r.as_str().to_owned(),
                (Principal::Node(_), None) => "node".into(),
                _ => "replica".into(),
            },
            tenant: self.tenant_scope().map(str::to_owned),
            from: self.from.clone(),
        }
    }

    /// Fails with `PermissionDenied` unless the caller's role allows `action`.
    pub fn require(&self, action: Action) -> Result<(), ApiError> {
        match (&self.principal, self.role()) {
            (_, Some(role)) if allowed(role, action) => Ok(()),
            // A replica asking to add itself (`--join`).
            (Principal::Replica(_), None)
                if matches!(action, Action::ManageReplicas | Action::ReadCluster) =>
            {
                Ok(())
            }
            (Principal::Node(_) | Principal::Replica(_), None) => Err(self.security.denied(
                &self.security.counters.wrong_role,
                &self.describe(),
                format!(
                    "{} certificates may not {}: the client API takes client certificates and tokens",
                    if matches!(self.principal, Principal::Node(_)) { "node" } else { "replica" },
                    action.describe()
                ),
            )),
            (_, Some(role)) => Err(self.security.denied(
                &self.security.counters.permission_denied,
                &self.describe(),
                format!(
                    "{} may not {}: role {} does not allow it",
                    self.describe(),
                    action.describe(),
                    role.as_str()
                ),
            )),
            (_, None) => unreachable!("principals without a role are nodes or replicas"),
        }
    }

    /// Fails unless the caller may act on `tenant`'s jobs (users only on their own).
    pub fn require_tenant(&self, tenant: &str, what: &str) -> Result<(), ApiError> {
        match self.tenant_scope() {
            Some(own) if own != tenant => Err(self.security.denied(
                &self.security.counters.permission_denied,
                &self.describe(),
                format!(
                    "{} acts for tenant {own:?} and may not {what} of tenant {}",
                    self.describe(),
                    shown(tenant)
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Whether the caller sees `tenant`'s jobs whole (command, environment, name); others
    /// see them with those fields withheld.
    pub fn sees_job_details(&self, tenant: &str) -> bool {
        match self.role() {
            Some(ApiRole::Admin) => true,
            Some(ApiRole::User) => self.tenant_scope() == Some(tenant),
            _ => false,
        }
    }

    /// Fails unless the caller is the agent of `node` (node certificates act for their own
    /// node only, as Kubernetes' node authorizer has it).
    pub fn require_node(&self, node: &str) -> Result<(), ApiError> {
        match &self.principal {
            Principal::Anonymous => Ok(()),
            Principal::Node(own) if own == node => Ok(()),
            Principal::Node(own) => Err(self.security.denied(
                &self.security.counters.node_mismatch,
                &self.describe(),
                format!(
                    "the certificate of node {own:?} may not act for node {}: an agent registers, heartbeats and reports for the node its certificate names",
                    shown(node)
                ),
            )),
            _ => Err(self.security.denied(
                &self.security.counters.wrong_role,
                &self.describe(),
                format!(
                    "the agent API takes node certificates only ({} is not one)",
                    self.describe()
                ),
            )),
        }
    }

    /// Adds what the leader needs to know about this caller to a forwarded call.
    pub fn forward_into(&self, metadata: &mut MetadataMap) {
        let forwarded = ForwardedCaller {
            from: self.from.clone(),
            peer: self.peer.as_ref().map(ForwardedPeer::from),
        };
        if let Ok(json) = serde_json::to_vec(&forwarded) {
            metadata.insert_bin(CALLER_HEADER, MetadataValue::from_bytes(&json));
        }
        if let Some(a) = &self.authorization {
            metadata.insert(AUTHORIZATION, a.clone());
        }
    }
}

/// Whether a Raft peer call comes from a replica; when security is on, only replica
/// certificates may append entries, vote or install snapshots.
pub fn require_replica_peer(security: &Security, conn: Option<&ConnInfo>) -> Result<(), String> {
    if !security.enforced {
        return Ok(());
    }
    let remote = conn
        .and_then(|c| c.remote)
        .map_or_else(|| "unknown".into(), |a| a.to_string());
    match conn.and_then(|c| c.peer.as_deref()) {
        Some(p) if p.role == CertRole::Replica => Ok(()),
        Some(p) => Err(security.refuse(
            &security.counters.wrong_role,
            &format!("{} from {remote}", p.subject()),
            format!(
                "Raft peer RPC takes replica certificates only; {} is a {} certificate",
                p.name, p.role
            ),
        )),
        None => Err(security.refuse(
            &security.counters.unauthenticated,
            &format!("unknown caller from {remote}"),
            "Raft peer RPC takes replica certificates only; the caller presented none".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_parse_and_malformed_ones_say_why() {
        assert_eq!(
            parse_bearer("Bearer gpucp.0123456789abcdef.s3cr3t").unwrap(),
            ("0123456789abcdef", "s3cr3t")
        );
        for bad in [
            "gpucp.a.b",
            "Bearer ",
            "Bearer gpucp..x",
            "Bearer other.a.b",
            "Bearer gpucp.a",
        ] {
            assert!(parse_bearer(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_role_table_gives_operators_the_fleet_and_users_their_jobs() {
        for action in Action::ALL {
            assert!(allowed(ApiRole::Admin, action));
        }
        assert!(allowed(ApiRole::Operator, Action::ManageNodes));
        assert!(allowed(ApiRole::Operator, Action::ManagePartitions));
        assert!(!allowed(ApiRole::Operator, Action::SubmitJob));
        assert!(!allowed(ApiRole::Operator, Action::ManageTokens));
        assert!(!allowed(ApiRole::Operator, Action::ReadLogs));
        assert!(allowed(ApiRole::User, Action::SubmitJob));
        assert!(allowed(ApiRole::User, Action::CancelJob));
        assert!(!allowed(ApiRole::User, Action::ManageNodes));
        assert!(!allowed(ApiRole::User, Action::ManageTenants));
        assert!(!allowed(ApiRole::User, Action::ManageReplicas));
        assert!(!allowed(ApiRole::Operator, Action::SaveBackup));
        assert!(!allowed(ApiRole::User, Action::SaveBackup));
    }

    #[test]
    fn a_token_is_checked_against_its_hash_revocation_and_expiry() {
        let mut cluster = ClusterState::default();
        let record = TokenRecord {
            id: "0123456789abcdef".into(),
            secret_sha256: secret_hash("s3cret"),
            role: ApiRole::User,
            tenant: Some("vision".into()),
            description: String::new(),
            created_at: 0,
            created_by: "test".into(),
            expires_at: Some(1_000),
            revoked_at: None,
            revoked_by: None,
        };
        cluster.tokens.insert(record.id.clone(), record.clone());
        assert!(check_token(&cluster, &record.id, "s3cret", 10).is_ok());
        assert!(
            check_token(&cluster, &record.id, "guess", 10)
                .unwrap_err()
                .contains("wrong secret")
        );
        assert!(
            check_token(&cluster, "ffffffffffffffff", "s3cret", 10)
                .unwrap_err()
                .contains("unknown")
        );
        assert!(
            check_token(&cluster, &record.id, "s3cret", 1_000)
                .unwrap_err()
                .contains("expired")
        );
        cluster.tokens.get_mut(&record.id).unwrap().revoked_at = Some(5);
        assert!(
            check_token(&cluster, &record.id, "s3cret", 10)
                .unwrap_err()
                .contains("revoked")
        );
    }
}
