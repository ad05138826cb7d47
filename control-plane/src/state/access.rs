//! API tokens in the replicated state: who may call the client API, with which role and for
//! which tenant. Only a SHA-256 hash of each token's secret is stored (the secret is shown
//! once, when it is created), so a copy of the state, a snapshot or the log gives no working
//! token. Every replica checks tokens against its own applied state, so a revocation takes
//! effect everywhere as soon as its entry is applied — milliseconds after it commits.

use serde::{Deserialize, Serialize};

use super::Timestamp;
use super::command::{Outcome, Rejection};
use super::validate::validate_name;

/// What a caller may do (docs/SECURITY.md has the whole table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ApiRole {
    /// Everything.
    Admin,
    /// Nodes (drain, undrain, uncordon, faults), partitions, and reading everything except
    /// jobs' commands and environments.
    Operator,
    /// Submit, see and cancel its own tenant's jobs; read the cluster's nodes and status.
    User,
}

impl ApiRole {
    pub const ALL: [ApiRole; 3] = [ApiRole::Admin, ApiRole::Operator, ApiRole::User];

    pub fn as_str(self) -> &'static str {
        match self {
            ApiRole::Admin => "admin",
            ApiRole::Operator => "operator",
            ApiRole::User => "user",
        }
    }

    pub fn parse(s: &str) -> Option<ApiRole> {
        ApiRole::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// One API token. Its secret is `gpucp.<id>.<secret>`; the state keeps the id and a hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// Public id, 16 lowercase hex digits: how the token is listed, revoked and audited.
    pub id: String,
    /// SHA-256 of the secret part, lowercase hex.
    pub secret_sha256: String,
    pub role: ApiRole,
    /// The tenant a `user` token acts for (none for the other roles).
    pub tenant: Option<String>,
    pub description: String,
    /// Set by apply from the entry's time.
    pub created_at: Timestamp,
    /// Who created it (an audit principal).
    pub created_by: String,
    pub expires_at: Option<Timestamp>,
    pub revoked_at: Option<Timestamp>,
    #[serde(default)]
    pub revoked_by: Option<String>,
}

impl TokenRecord {
    /// Whether the token may be used at `now`: not revoked, not expired.
    pub fn usable_at(&self, now: Timestamp) -> Result<(), String> {
        if let Some(at) = self.revoked_at {
            return Err(format!("token {} was revoked (at {at} ms)", self.id));
        }
        if let Some(at) = self.expires_at
            && at <= now
        {
            return Err(format!("token {} expired (at {at} ms)", self.id));
        }
        Ok(())
    }
}

/// Most tokens the state keeps (revoked ones included), so the table cannot grow without
/// bound.
pub const MAX_TOKENS: usize = 10_000;
pub const MAX_TOKEN_DESCRIPTION: usize = 256;

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks a token record on its own (the state's checks are in `apply_create_token`).
pub fn validate_token(t: &TokenRecord) -> Result<(), Rejection> {
    if !is_lower_hex(&t.id, 16) {
        return Err(Rejection::invalid(
            "token.id",
            "must be 16 lowercase hex digits",
        ));
    }
    if !is_lower_hex(&t.secret_sha256, 64) {
        return Err(Rejection::invalid(
            "token.secret_sha256",
            "must be a SHA-256 in lowercase hex",
        ));
    }
    match (t.role, &t.tenant) {
        (ApiRole::User, None) => {
            return Err(Rejection::invalid(
                "tenant",
                "a user token acts for one tenant: give --tenant",
            ));
        }
        (ApiRole::User, Some(tenant)) => validate_name("tenant", tenant)?,
        (_, Some(_)) => {
            return Err(Rejection::invalid(
                "tenant",
                "only user tokens are bound to a tenant (admin and operator tokens act cluster-wide)",
            ));
        }
        (_, None) => {}
    }
    if t.description.chars().count() > MAX_TOKEN_DESCRIPTION
        || t.description.chars().any(char::is_control)
    {
        return Err(Rejection::invalid(
            "description",
            format!("at most {MAX_TOKEN_DESCRIPTION} printable characters"),
        ));
    }
    Ok(())
}

impl super::ClusterState {
    pub(super) fn create_token(&mut self, token: &TokenRecord, at: Timestamp) -> Outcome {
        if let Err(r) = validate_token(token) {
            return Outcome::Rejected(r);
        }
        if self.tokens.contains_key(&token.id) {
            return Outcome::Rejected(Rejection::precondition(format!(
                "a token with id {} exists already",
                token.id
            )));
        }
        if self.tokens.len() >= MAX_TOKENS {
            return Outcome::Rejected(Rejection::precondition(format!(
                "the cluster holds {MAX_TOKENS} tokens, the most it keeps; revoke and delete unused ones first"
            )));
        }
        if let Some(t) = &token.tenant
            && !self.tenants.is_empty()
            && !self.tenants.contains_key(t)
        {
            return Outcome::Rejected(Rejection::invalid(
                "tenant",
                format!("unknown tenant {t:?}; create it first with `gpuctl tenant set {t}`"),
            ));
        }
        let mut token = token.clone();
        token.created_at = at;
        token.revoked_at = None;
        token.revoked_by = None;
        self.tokens.insert(token.id.clone(), token);
        Outcome::Done
    }

    pub(super) fn revoke_token(&mut self, id: &str, by: &str, at: Timestamp) -> Outcome {
        let Some(token) = self.tokens.get_mut(id) else {
            return Outcome::Rejected(Rejection::not_found(format!("no token has id {id:?}")));
        };
        if token.revoked_at.is_some() {
            return Outcome::Rejected(Rejection::precondition(format!(
                "token {id} is revoked already"
            )));
        }
        token.revoked_at = Some(at);
        token.revoked_by = Some(by.to_owned());
        Outcome::Done
    }
}
