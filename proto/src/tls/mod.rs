//! Mutual TLS for every connection of the project: client API, agent API and Raft peer RPC on
//! a replica's port, and the agent's own port. rustls with ring (no OpenSSL), through
//! tokio-rustls — the crate tonic's TLS features wrap. We drive the handshake ourselves rather
//! than through `tonic::transport::ServerTlsConfig` for two reasons: tonic fixes the
//! certificate for the life of a server, so it could not be rotated without a restart; and
//! here each connection's peer certificate is parsed once, at the handshake, into the
//! [`PeerIdentity`] that every request on it carries ([`ConnInfo`]).
//!
//! - `identity`: what a certificate says (role, name, client role and tenant), and the names
//!   replicas and agents serve under.
//! - `pki`: creating the CA and role certificates (rcgen).
//! - `server`: the accept loop (TLS or plain) yielding connections tagged with [`ConnInfo`].
//! - `client`: the connector for tonic channels, verifying that the server holds the role
//!   (and node name) the caller meant to reach.
//!
//! [`TlsContext`] holds the files a process loaded and reloads them when they change or on
//! SIGHUP; connections made after a reload use the new certificate, connections already open
//! keep theirs.

pub mod client;
pub mod identity;
pub mod pki;
pub mod server;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use tokio_rustls::rustls;
use tokio_rustls::rustls::RootCertStore;
use tokio_rustls::rustls::server::WebPkiClientVerifier;

pub use client::ExpectedPeer;
pub use identity::{CertRole, PeerIdentity, parse_identity};
pub use server::{Conn, ConnInfo};

/// Where a process's TLS material lives. Every process has a CA bundle; servers and mTLS
/// clients also have a certificate and key. An optional CRL (`crl.pem` beside the others)
/// lists revoked certificates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Read when it exists (`gpuctl certs revoke` writes it).
    pub crl: Option<PathBuf>,
}

pub const CRL_FILE: &str = "crl.pem";

impl TlsFiles {
    /// The files of an identity directory: `ca.pem`, `cert.pem`, `key.pem` (and `crl.pem`
    /// when present), as `gpuctl certs issue` writes them.
    pub fn in_dir(dir: &Path) -> TlsFiles {
        TlsFiles {
            ca: dir.join(pki::CA_CERT_FILE),
            cert: Some(dir.join(pki::CERT_FILE)),
            key: Some(dir.join(pki::KEY_FILE)),
            crl: Some(dir.join(CRL_FILE)),
        }
    }

    fn paths(&self) -> impl Iterator<Item = &PathBuf> {
        std::iter::once(&self.ca)
            .chain(self.cert.iter())
            .chain(self.key.iter())
            .chain(self.crl.iter())
    }
}

/// Where a process's TLS files are: a directory, with single files overriding it. Shared by
/// replicas, agents and gpuctl.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsPaths {
    pub dir: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl TlsPaths {
    /// The files to load, or `None` when nothing was given.
    pub fn files(&self) -> Result<Option<TlsFiles>, TlsError> {
        let base = self.dir.as_deref().map(TlsFiles::in_dir);
        if base.is_none() && self.ca.is_none() && self.cert.is_none() && self.key.is_none() {
            return Ok(None);
        }
        let ca = self
            .ca
            .clone()
            .or_else(|| base.as_ref().map(|b| b.ca.clone()))
            .ok_or_else(|| {
                TlsError::Config(
                    "--tls-ca (or --tls-dir) is needed with --tls-cert/--tls-key".into(),
                )
            })?;
        Ok(Some(TlsFiles {
            ca,
            cert: self
                .cert
                .clone()
                .or_else(|| base.as_ref().and_then(|b| b.cert.clone())),
            key: self
                .key
                .clone()
                .or_else(|| base.as_ref().and_then(|b| b.key.clone())),
            crl: base.and_then(|b| b.crl),
        }))
    }
}

/// Whether a server insists on a client certificate. Agents' ports and Raft always do; a
/// replica's client API may also accept token-only clients (`client_cert_optional`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    Required,
    Optional,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{0}")]
    Config(String),
}

fn file_error(path: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.to_owned(),
        message: message.to_string(),
    }
}

/// The TLS material of a process as loaded at one moment.
pub struct Material {
    /// Who this process is; `None` for a token-only client.
    pub identity: Option<PeerIdentity>,
    /// End of the validity of the CA certificate that expires first, ms since the epoch.
    pub ca_not_after_ms: u64,
    roots: Arc<RootCertStore>,
    crls: Vec<CertificateRevocationListDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    key: Option<PrivateKeyDer<'static>>,
    server: Option<Arc<rustls::ServerConfig>>,
    /// Client configurations built from this material, by the peer they verify.
    client_configs: Mutex<HashMap<ExpectedPeer, Arc<rustls::ClientConfig>>>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| file_error(path, format!("cannot be read: {e}")))
}

impl Material {
    fn load(files: &TlsFiles, client_auth: ClientAuth) -> Result<Material, TlsError> {
        let ca_pem = read_file(&files.ca)?;
        let mut roots = RootCertStore::empty();
        let mut ca_not_after_ms = u64::MAX;
        for cert in CertificateDer::pem_slice_iter(&ca_pem) {
            let cert = cert.map_err(|e| file_error(&files.ca, format!("is not PEM: {e}")))?;
            if let Some(t) = not_after_ms(&cert) {
                ca_not_after_ms = ca_not_after_ms.min(t);
            }
            roots
                .add(cert)
                .map_err(|e| file_error(&files.ca, format!("holds an unusable CA: {e}")))?;
        }
        if roots.is_empty() {
            return Err(file_error(&files.ca, "holds no certificate"));
        }
        let crls = match &files.crl {
            Some(path) if path.exists() => {
                CertificateRevocationListDer::pem_slice_iter(&read_file(path)?)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| file_error(path, format!("is not a PEM CRL: {e}")))?
            }
            _ => Vec::new(),
        };
        let (chain, key, identity) = match (&files.cert, &files.key) {
            (Some(cert_path), Some(key_path)) => {
                let chain = CertificateDer::pem_slice_iter(&read_file(cert_path)?)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| file_error(cert_path, format!("is not PEM: {e}")))?;
                let leaf = chain
                    .first()
                    .ok_or_else(|| file_error(cert_path, "holds no certificate"))?;
                let identity = parse_identity(leaf).map_err(|e| file_error(cert_path, e))?;
                let key = PrivateKeyDer::from_pem_slice(&read_file(key_path)?)
                    .map_err(|e| file_error(key_path, format!("is not a PEM private key: {e}")))?;
                (chain, Some(key), Some(identity))
            }
            (None, None) => (Vec::new(), None, None),
            _ => {
                return Err(TlsError::Config(
                    "give both a certificate and its key, or neither".into(),
                ));
            }
        };
        let roots = Arc::new(roots);
        let mut material = Material {
            identity,
            ca_not_after_ms,
            roots,
            crls,
            chain,
            key,
            server: None,
            client_configs: Mutex::new(HashMap::new()),
        };
        if material.key.is_some() {
            material.server = Some(Arc::new(material.build_server(client_auth)?));
        }
        Ok(material)
    }

    fn build_server(&self, client_auth: ClientAuth) -> Result<rustls::ServerConfig, TlsError> {
        let mut verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
                .with_crls(self.crls.clone());
        if client_auth == ClientAuth::Optional {
            verifier = verifier.allow_unauthenticated();
        }
        let verifier = verifier
            .build()
            .map_err(|e| TlsError::Config(format!("client certificate verifier: {e}")))?;
        let key = self
            .key
            .as_ref()
            .expect("a server config is only built with a key")
            .clone_key();
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), key)
            .map_err(|e| {
                TlsError::Config(format!(
                    "the certificate and key do not make a usable pair: {e}"
                ))
            })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }

    /// The earliest expiry among this process's certificate and its CAs.
    pub fn not_after_ms(&self) -> u64 {
        self.identity
            .as_ref()
            .map_or(u64::MAX, |i| i.not_after_ms)
            .min(self.ca_not_after_ms)
    }
}

fn not_after_ms(cert: &CertificateDer<'_>) -> Option<u64> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, c) = X509Certificate::from_der(cert).ok()?;
    u64::try_from(c.validity().not_after.timestamp())
        .ok()
        .map(|s| s.saturating_mul(1000))
}

/// Size and modification time of each file, to notice a change.
type Stamps = Vec<Option<(u64, SystemTime)>>;

fn stamps(files: &TlsFiles) -> Stamps {
    files
        .paths()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.len(), m.modified().ok()?)))
        })
        .collect()
}

struct Inner {
    files: TlsFiles,
    client_auth: ClientAuth,
    current: RwLock<Arc<Material>>,
    /// The stamps of the last load attempt (successful or not), so a bad file is reported
    /// once, not on every poll.
    seen: Mutex<Stamps>,
    /// Incoming connections refused at the handshake (no certificate, wrong CA, expired).
    handshake_failures: AtomicU64,
    reloads: AtomicU64,
}

/// A process's TLS material, reloadable. Cheap to clone: every clone is the same context.
#[derive(Clone)]
pub struct TlsContext {
    inner: Arc<Inner>,
}

/// How long before an expiry it is warned about.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(30 * 24 * 3600);

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A line saying that something expires soon (or has expired), or nothing.
pub fn expiry_warning(what: &str, not_after_ms: u64, now_ms: u64) -> Option<String> {
    if not_after_ms == u64::MAX {
        return None;
    }
    if not_after_ms <= now_ms {
        return Some(format!("{what} has EXPIRED"));
    }
    let left = Duration::from_millis(not_after_ms - now_ms);
    (left <= EXPIRY_WARNING).then(|| {
        format!(
            "{what} expires in {:.1} days; issue a new one (`gpuctl certs issue`) and replace the files: they are re-read without a restart",
            left.as_secs_f64() / 86_400.0
        )
    })
}

impl TlsContext {
    /// Loads `files`; fails with a message naming the file at fault.
    pub fn load(files: TlsFiles, client_auth: ClientAuth) -> Result<TlsContext, TlsError> {
        let seen = stamps(&files);
        let material = Material::load(&files, client_auth)?;
        Ok(TlsContext {
            inner: Arc::new(Inner {
                files,
                client_auth,
                current: RwLock::new(Arc::new(material)),
                seen: Mutex::new(seen),
                handshake_failures: AtomicU64::new(0),
                reloads: AtomicU64::new(0),
            }),
        })
    }

    pub fn files(&self) -> &TlsFiles {
        &self.inner.files
    }

    pub fn current(&self) -> Arc<Material> {
        self.inner
            .current
            .read()
            .expect("TLS material lock poisoned")
            .clone()
    }

    /// This process's own identity (none for a token-only client).
    pub fn identity(&self) -> Option<PeerIdentity> {
        self.current().identity.clone()
    }

    /// Reads the files again and uses them from now on. On error the material in use stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        *self.inner.seen.lock().expect("stamps lock poisoned") = stamps(&self.inner.files);
        let material = Material::load(&self.inner.files, self.inner.client_auth)?;
        if let Some(id) = &material.identity {
            tracing::info!(identity = %id, not_after_ms = id.not_after_ms, "TLS certificate loaded");
        }
        *self
            .inner
            .current
            .write()
            .expect("TLS material lock poisoned") = Arc::new(material);
        self.inner.reloads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Reloads if any file changed since the last attempt; `Ok(true)` when it did reload.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let now = stamps(&self.inner.files);
        if *self.inner.seen.lock().expect("stamps lock poisoned") == now {
            return Ok(false);
        }
        self.reload().map(|()| true)
    }

    /// Lines about certificates that expire within [`EXPIRY_WARNING`].
    pub fn expiry_warnings(&self, now_ms: u64) -> Vec<String> {
        let m = self.current();
        let mut out = Vec::new();
        if let Some(id) = &m.identity
            && let Some(w) = expiry_warning(
                &format!("this process's certificate ({})", id.subject()),
                id.not_after_ms,
                now_ms,
            )
        {
            out.push(w);
        }
        if let Some(w) = expiry_warning("the cluster CA certificate", m.ca_not_after_ms, now_ms) {
            out.push(w);
        }
        out
    }

    /// Watches the files: reloads on change (checked every `interval`) and on SIGHUP, and
    /// warns about an expiring certificate at start and once a day. Runs until the runtime
    /// stops.
    pub fn spawn_reloader(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let ctx = self.clone();
        tokio::spawn(async move {
            #[cfg(unix)]
            let mut hup =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
            let mut last_warning: Option<tokio::time::Instant> = None;
            loop {
                let now = tokio::time::Instant::now();
                if last_warning.is_none_or(|t| now - t >= Duration::from_secs(24 * 3600)) {
                    for w in ctx.expiry_warnings(now_ms()) {
                        tracing::warn!("{w}");
                    }
                    last_warning = Some(now);
                }
                #[cfg(unix)]
                let hangup = async {
                    match hup.as_mut() {
                        Some(h) => {
                            h.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                #[cfg(not(unix))]
                let hangup = std::future::pending::<()>();
                let forced = tokio::select! {
                    _ = tokio::time::sleep(interval) => false,
                    _ = hangup => true,
                };
                let result = if forced {
                    ctx.reload().map(|()| true)
                } else {
                    ctx.reload_if_changed()
                };
                match result {
                    Ok(true) => {
                        last_warning = None;
                        tracing::info!(
                            signal = forced,
                            "TLS files re-read; new connections use them"
                        )
                    }
                    Ok(false) => {}
                    Err(e) => tracing::error!(
                        "TLS files changed but cannot be used (the previous ones stay in use): {e}"
                    ),
                }
            }
        })
    }

    pub fn handshake_failures(&self) -> u64 {
        self.inner.handshake_failures.load(Ordering::Relaxed)
    }

    pub fn reloads(&self) -> u64 {
        self.inner.reloads.load(Ordering::Relaxed)
    }

    fn count_handshake_failure(&self) {
        self.inner
            .handshake_failures
            .fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
