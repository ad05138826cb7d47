//! Who a certificate says its holder is. Every certificate of a cluster comes from the
//! cluster's CA and names one of three roles in its subject's organization, and a name in its
//! common name:
//!
//! | role    | subject                                   | serves as            |
//! | ------- | ----------------------------------------- | -------------------- |
//! | replica | `O=gpucp-replica, CN=replica-<id>`        | `replica.gpucp` SAN  |
//! | node    | `O=gpucp-node, CN=<node name>`            | `node.gpucp` SAN     |
//! | client  | `O=gpucp-client, CN=<who>[, OU=role=admin][, OU=tenant=vision]` | (client only) |
//!
//! Servers check the role (and for agents, the node name) after the TLS layer has verified the
//! chain and the validity period; clients check that the server holds the role they meant to
//! reach (a node certificate cannot pose as a replica: it lacks `replica.gpucp`). Kubernetes'
//! `system:node:<name>` and Nomad's `server.<region>.nomad` are the models.

use std::fmt;

use x509_parser::prelude::{FromDer, X509Certificate};

/// The name every replica certificate carries, and that clients verify a replica against,
/// whatever address they dialled (so certificates need not list IP addresses or host names).
pub const REPLICA_SERVER_NAME: &str = "replica.gpucp";
/// The name every node (agent) certificate carries, verified by replicas that call an agent;
/// the node's own name is then checked against the certificate's common name.
pub const NODE_SERVER_NAME: &str = "node.gpucp";

const ORG_REPLICA: &str = "gpucp-replica";
const ORG_NODE: &str = "gpucp-node";
const ORG_CLIENT: &str = "gpucp-client";
/// Keys in a client certificate's organizational unit: `role=user tenant=vision` (one
/// unit, words separated by spaces: rcgen keeps one value per attribute type).
const OU_ROLE: &str = "role=";
const OU_TENANT: &str = "tenant=";

/// Which kind of process a certificate belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CertRole {
    Replica,
    Node,
    Client,
}

impl CertRole {
    pub const ALL: [CertRole; 3] = [CertRole::Replica, CertRole::Node, CertRole::Client];

    pub fn as_str(self) -> &'static str {
        match self {
            CertRole::Replica => "replica",
            CertRole::Node => "node",
            CertRole::Client => "client",
        }
    }

    pub fn parse(s: &str) -> Option<CertRole> {
        CertRole::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The subject organization that marks this role.
    pub fn organization(self) -> &'static str {
        match self {
            CertRole::Replica => ORG_REPLICA,
            CertRole::Node => ORG_NODE,
            CertRole::Client => ORG_CLIENT,
        }
    }

    fn from_organization(o: &str) -> Option<CertRole> {
        CertRole::ALL.into_iter().find(|r| r.organization() == o)
    }

    /// The DNS name a server certificate of this role carries (clients have none).
    pub fn server_name(self) -> Option<&'static str> {
        match self {
            CertRole::Replica => Some(REPLICA_SERVER_NAME),
            CertRole::Node => Some(NODE_SERVER_NAME),
            CertRole::Client => None,
        }
    }
}

impl fmt::Display for CertRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one certificate says about its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    pub role: CertRole,
    /// The common name: `replica-<id>`, the node's name, or the client's name.
    pub name: String,
    /// Client certificates only: the API role the certificate grants by itself (`admin`,
    /// `operator`, `user`); none means the client must present a token.
    pub client_role: Option<String>,
    /// Client certificates only: the tenant a `user` certificate acts for.
    pub tenant: Option<String>,
    /// Serial number, hex, for audit records and revocation.
    pub serial: String,
    /// End of the validity period, ms since the Unix epoch.
    pub not_after_ms: u64,
}

impl PeerIdentity {
    /// How audit records and logs name the holder: `node:gpu-1`, `client:alice`.
    pub fn subject(&self) -> String {
        format!("{}:{}", self.role, self.name)
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} certificate {:?}", self.role, self.name)?;
        if let Some(r) = &self.client_role {
            write!(f, " (role {r}")?;
            if let Some(t) = &self.tenant {
                write!(f, ", tenant {t}")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

/// Why a certificate does not name an identity of this cluster's scheme.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("the certificate cannot be parsed: {0}")]
    Unparsable(String),
    #[error(
        "the certificate's subject has no organization naming a role (gpucp-replica, gpucp-node or gpucp-client); issue it with `gpuctl certs issue`"
    )]
    NoRole,
    #[error("the certificate's subject has no common name")]
    NoName,
}

/// Reads the identity from a DER-encoded certificate (chain and dates are the TLS layer's
/// business; this only reads the subject).
pub fn parse_identity(der: &[u8]) -> Result<PeerIdentity, IdentityError> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| IdentityError::Unparsable(e.to_string()))?;
    let subject = cert.subject();
    let role = subject
        .iter_organization()
        .filter_map(|a| a.as_str().ok())
        .find_map(CertRole::from_organization)
        .ok_or(IdentityError::NoRole)?;
    let name = subject
        .iter_common_name()
        .find_map(|a| a.as_str().ok())
        .filter(|n| !n.is_empty())
        .ok_or(IdentityError::NoName)?
        .to_owned();
    let mut client_role = None;
    let mut tenant = None;
    if role == CertRole::Client {
        for ou in subject
            .iter_organizational_unit()
            .filter_map(|a| a.as_str().ok())
            .flat_map(str::split_whitespace)
        {
            if let Some(r) = ou.strip_prefix(OU_ROLE) {
                client_role = Some(r.to_owned());
            } else if let Some(t) = ou.strip_prefix(OU_TENANT) {
                tenant = Some(t.to_owned());
            }
        }
    }
    let not_after = cert.validity().not_after.timestamp();
    Ok(PeerIdentity {
        role,
        name,
        client_role,
        tenant,
        serial: cert.raw_serial_as_string().replace(':', ""),
        not_after_ms: u64::try_from(not_after).unwrap_or(0).saturating_mul(1000),
    })
}

/// The organizational unit that gives a client certificate an API role (and tenant).
pub fn client_unit(role: Option<&str>, tenant: Option<&str>) -> Option<String> {
    let words: Vec<String> = role
        .map(|r| format!("{OU_ROLE}{r}"))
        .into_iter()
        .chain(tenant.map(|t| format!("{OU_TENANT}{t}")))
        .collect();
    (!words.is_empty()).then(|| words.join(" "))
}
