//! Creating a cluster's certificates: one CA, and certificates of the three roles signed by it
//! (`gpuctl certs init|issue`, `gpuctl dev`, the test and benchmark clusters). Keys are ECDSA
//! P-256, made by rcgen with ring.
//!
//! On disk a CA is a directory with `ca.pem` and `ca-key.pem`; an identity is a directory
//! with `ca.pem` (the CA bundle it trusts), `cert.pem` and `key.pem` — what `--tls-dir` of
//! every process reads (see [`super::TlsFiles`]).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose,
    RevocationReason, RevokedCertParams, SerialNumber,
};
use time::Duration;
pub use time::OffsetDateTime;

use super::identity::{CertRole, client_unit};

pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca-key.pem";
pub const CERT_FILE: &str = "cert.pem";
pub const KEY_FILE: &str = "key.pem";
/// In a CA directory: the serials revoked so far, one hex serial per line.
pub const REVOKED_FILE: &str = "revoked.txt";

/// Roles a client certificate may grant by itself (the API's roles).
pub const CLIENT_ROLES: [&str; 3] = ["admin", "operator", "user"];

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{0}")]
    Invalid(String),
    #[error("generating the certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A CA's certificate and private key, PEM-encoded.
#[derive(Clone)]
pub struct CaFiles {
    pub cert_pem: String,
    pub key_pem: String,
}

/// One issued certificate with its private key, and the CA bundle to trust.
#[derive(Clone)]
pub struct IdentityFiles {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// What to put in a certificate.
#[derive(Debug, Clone)]
pub struct IssueRequest {
    pub role: CertRole,
    /// Common name: `replica-<id>`, the node's name, or the client's name.
    pub name: String,
    /// More DNS names or IP addresses the holder serves under (besides its role's name).
    pub extra_sans: Vec<String>,
    /// Client certificates: the API role the certificate grants without a token.
    pub client_role: Option<String>,
    /// Client certificates with role `user`: the tenant.
    pub tenant: Option<String>,
    pub days: u32,
}

impl IssueRequest {
    /// A certificate of `role` named `name`, valid for a year, with no extras.
    pub fn new(role: CertRole, name: impl Into<String>) -> IssueRequest {
        IssueRequest {
            role,
            name: name.into(),
            extra_sans: Vec::new(),
            client_role: None,
            tenant: None,
            days: 365,
        }
    }

    /// A client certificate that grants `role` (and acts for `tenant`) without a token.
    pub fn client(name: impl Into<String>, role: &str, tenant: Option<&str>) -> IssueRequest {
        IssueRequest {
            client_role: Some(role.to_owned()),
            tenant: tenant.map(str::to_owned),
            ..IssueRequest::new(CertRole::Client, name)
        }
    }
}

fn random_serial() -> Result<SerialNumber, PkiError> {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| PkiError::Invalid("the system's random source failed".into()))?;
    // Positive and non-zero, as RFC 5280 asks.
    bytes[0] = (bytes[0] & 0x7f) | 0x01;
    Ok(SerialNumber::from_slice(&bytes))
}

/// Validity from an hour ago (clocks of a fleet differ) for `days`.
fn validity(days: u32) -> Result<(OffsetDateTime, OffsetDateTime), PkiError> {
    if days == 0 {
        return Err(PkiError::Invalid("--days must be at least 1".into()));
    }
    let now = OffsetDateTime::now_utc();
    Ok((
        now - Duration::hours(1),
        now + Duration::days(i64::from(days)),
    ))
}

/// Creates a CA for `cluster`, valid for `days`.
pub fn create_ca(cluster: &str, days: u32) -> Result<CaFiles, PkiError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("gpu-control-plane CA ({cluster})"),
    );
    dn.push(DnType::OrganizationName, "gpu-control-plane");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.serial_number = Some(random_serial()?);
    (params.not_before, params.not_after) = validity(days)?;
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(CaFiles {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

fn check_request(req: &IssueRequest) -> Result<(), PkiError> {
    let name = &req.name;
    if name.is_empty() || name.len() > 128 || name.chars().any(|c| c.is_control() || c == ',') {
        return Err(PkiError::Invalid(format!(
            "--name {name:?}: give 1-128 printable characters without commas"
        )));
    }
    match req.role {
        CertRole::Client => {
            if let Some(t) = &req.tenant
                && (t.is_empty() || t.chars().any(|c| c.is_whitespace() || c.is_control()))
            {
                return Err(PkiError::Invalid(format!(
                    "--tenant {t:?} is not a tenant name"
                )));
            }
            if let Some(r) = &req.client_role
                && !CLIENT_ROLES.contains(&r.as_str())
            {
                return Err(PkiError::Invalid(format!(
                    "--role {r:?}: one of {}",
                    CLIENT_ROLES.join(", ")
                )));
            }
            match (req.client_role.as_deref(), &req.tenant) {
                (Some("user"), None) => {
                    return Err(PkiError::Invalid(
                        "a client certificate with role user needs --tenant".into(),
                    ));
                }
                (Some("admin" | "operator") | None, Some(_)) => {
                    return Err(PkiError::Invalid(
                        "--tenant goes with --role user only".into(),
                    ));
                }
                _ => {}
            }
        }
        CertRole::Replica | CertRole::Node => {
            if req.client_role.is_some() || req.tenant.is_some() {
                return Err(PkiError::Invalid(
                    "--role and --tenant are for client certificates".into(),
                ));
            }
        }
    }
    if req.role == CertRole::Replica && !name.starts_with("replica-") {
        return Err(PkiError::Invalid(format!(
            "a replica certificate's name is replica-<id> (e.g. replica-1), not {name:?}"
        )));
    }
    Ok(())
}

/// Issues a certificate for `req`, signed by `ca`.
pub fn issue(ca: &CaFiles, req: &IssueRequest) -> Result<IdentityFiles, PkiError> {
    let (not_before, not_after) = validity(req.days)?;
    issue_valid(ca, req, not_before, not_after)
}

/// As [`issue`], valid from `not_before` to `not_after` exactly (tests of expired
/// certificates use a period in the past).
pub fn issue_valid(
    ca: &CaFiles,
    req: &IssueRequest,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> Result<IdentityFiles, PkiError> {
    check_request(req)?;
    let ca_key = KeyPair::from_pem(&ca.key_pem)
        .map_err(|e| PkiError::Invalid(format!("the CA key cannot be read: {e}")))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, &ca_key)
        .map_err(|e| PkiError::Invalid(format!("the CA certificate cannot be read: {e}")))?;
    let sans: Vec<String> = req
        .role
        .server_name()
        .map(str::to_owned)
        .into_iter()
        .chain(req.extra_sans.iter().cloned())
        .collect();
    let mut params = CertificateParams::new(sans).map_err(|e| {
        PkiError::Invalid(format!(
            "--san {:?}: not DNS names or IP addresses ({e})",
            req.extra_sans
        ))
    })?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, req.name.clone());
    dn.push(DnType::OrganizationName, req.role.organization());
    if let Some(ou) = client_unit(req.client_role.as_deref(), req.tenant.as_deref()) {
        dn.push(DnType::OrganizationalUnitName, ou);
    }
    params.distinguished_name = dn;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = match req.role {
        CertRole::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
        // Replicas and agents both serve and call.
        CertRole::Replica | CertRole::Node => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    };
    params.use_authority_key_identifier_extension = true;
    params.serial_number = Some(random_serial()?);
    params.not_before = not_before;
    params.not_after = not_after;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok(IdentityFiles {
        ca_pem: ca.cert_pem.clone(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Writes a private key readable by its owner only.
fn write_private(path: &Path, pem: &str) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("pem.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_error(&tmp))?;
    f.write_all(pem.as_bytes()).map_err(io_error(&tmp))?;
    f.sync_all().map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_error(path))
}

/// Replaces a file in one step (a process re-reading it never sees half a file).
fn write_public(path: &Path, pem: &str) -> Result<(), PkiError> {
    let tmp = path.with_extension("pem.tmp");
    std::fs::write(&tmp, pem).map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_error(path))
}

impl CaFiles {
    pub fn write(&self, dir: &Path) -> Result<(), PkiError> {
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        write_private(&dir.join(CA_KEY_FILE), &self.key_pem)?;
        write_public(&dir.join(CA_CERT_FILE), &self.cert_pem)
    }

    pub fn read(dir: &Path) -> Result<CaFiles, PkiError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(io_error(&path))
        };
        Ok(CaFiles {
            cert_pem: read(CA_CERT_FILE)?,
            key_pem: read(CA_KEY_FILE)?,
        })
    }
}

impl IdentityFiles {
    /// Writes `ca.pem`, `cert.pem` and `key.pem`; the key last but one and the certificate
    /// last, so a process reloading on change sees a matching pair once `cert.pem` changes.
    ///
    /// A `ca.pem` already there is kept, with the issuing CA added if it is not in it yet:
    /// during a CA rotation a process trusts the old and the new CA while its own certificate
    /// is replaced (docs/SECURITY.md, "Rotating the CA").
    pub fn write(&self, dir: &Path) -> Result<(), PkiError> {
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        let ca_path = dir.join(CA_CERT_FILE);
        let bundle = match std::fs::read_to_string(&ca_path) {
            Ok(existing) if existing.contains(self.ca_pem.trim()) => None,
            Ok(existing) => Some(format!("{}\n{}", existing.trim_end(), self.ca_pem)),
            Err(_) => Some(self.ca_pem.clone()),
        };
        if let Some(bundle) = bundle {
            write_public(&ca_path, &bundle)?;
        }
        write_private(&dir.join(KEY_FILE), &self.key_pem)?;
        write_public(&dir.join(CERT_FILE), &self.cert_pem)
    }
}

/// Parses a certificate serial as `gpuctl certs show` prints it (hex, colons allowed).
fn parse_serial(s: &str) -> Result<Vec<u8>, PkiError> {
    let hex: String = s.chars().filter(|c| *c != ':').collect();
    if hex.is_empty() || !hex.len().is_multiple_of(2) || !hex.chars().all(|c| c.is_ascii_hexdigit())
    {
        return Err(PkiError::Invalid(format!(
            "serial {s:?} is not hex (copy it from `gpuctl certs show`)"
        )));
    }
    Ok((0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("checked hex"))
        .collect())
}

/// A CRL, signed by `ca`, listing `serials` (hex), valid for `days`. Every process that has
/// it as `crl.pem` in its TLS directory refuses those certificates from its next handshake
/// on (the file is re-read on change).
pub fn revocation_list(ca: &CaFiles, serials: &[String], days: u32) -> Result<String, PkiError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)
        .map_err(|e| PkiError::Invalid(format!("the CA key cannot be read: {e}")))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, &ca_key)
        .map_err(|e| PkiError::Invalid(format!("the CA certificate cannot be read: {e}")))?;
    let (this_update, next_update) = validity(days)?;
    let revoked_certs = serials
        .iter()
        .map(|s| {
            Ok(RevokedCertParams {
                serial_number: SerialNumber::from_slice(&parse_serial(s)?),
                revocation_time: this_update,
                reason_code: Some(RevocationReason::Unspecified),
                invalidity_date: None,
            })
        })
        .collect::<Result<Vec<_>, PkiError>>()?;
    let params = CertificateRevocationListParams {
        this_update,
        next_update,
        crl_number: random_serial()?,
        issuing_distribution_point: None,
        revoked_certs,
        key_identifier_method: KeyIdMethod::Sha256,
    };
    Ok(params.signed_by(&issuer)?.pem()?)
}

/// Adds `serial` to the CA directory's revoked list and writes its CRL (`crl.pem` there);
/// returns the CRL's path.
pub fn revoke(ca_dir: &Path, serial: &str, days: u32) -> Result<PathBuf, PkiError> {
    let ca = CaFiles::read(ca_dir)?;
    parse_serial(serial)?;
    let list = ca_dir.join(REVOKED_FILE);
    let mut serials: Vec<String> = match std::fs::read_to_string(&list) {
        Ok(text) => text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_error(&list)(e)),
    };
    let normal = serial.replace(':', "").to_ascii_lowercase();
    if !serials.contains(&normal) {
        serials.push(normal);
    }
    let crl = revocation_list(&ca, &serials, days)?;
    write_public(&list, &(serials.join("\n") + "\n"))?;
    let path = ca_dir.join(super::CRL_FILE);
    write_public(&path, &crl)?;
    Ok(path)
}
