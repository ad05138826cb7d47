//! The client side: a connector for tonic channels that dials TCP (from the process's source
//! address, when one is set), runs the TLS handshake with the process's current certificate,
//! and accepts the server only if its certificate has the role the caller meant to reach — a
//! replica for every call to the control plane, and for a replica calling an agent, that
//! agent's node name.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::{DigitallySignedStruct, SignatureScheme};
use tonic::codegen::http::Uri;

use super::identity::{CertRole, parse_identity};
use super::{Material, TlsContext, TlsError, provider};

/// Whom a connection is meant to reach.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExpectedPeer {
    /// Any replica of the cluster.
    Replica,
    /// The agent of this node.
    Node(String),
}

impl ExpectedPeer {
    fn role(&self) -> CertRole {
        match self {
            ExpectedPeer::Replica => CertRole::Replica,
            ExpectedPeer::Node(_) => CertRole::Node,
        }
    }
}

/// Verifies the chain against the cluster CA for the role's server name, then the role and,
/// for an agent, its node name.
#[derive(Debug)]
struct PeerVerifier {
    inner: Arc<WebPkiServerVerifier>,
    expect: ExpectedPeer,
}

fn rejected(message: String) -> rustls::Error {
    rustls::Error::General(message)
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let role = self.expect.role();
        let role_name = ServerName::try_from(role.server_name().expect("servers have a name"))
            .expect("the role names are valid DNS names");
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            &role_name,
            ocsp_response,
            now,
        );
        // The chain and dates decide; the subject only explains a refusal or names the node.
        let identity = parse_identity(end_entity);
        if let Ok(id) = &identity
            && id.role != role
        {
            return Err(rejected(format!(
                "the server presented a {} certificate ({:?}) where a {} was expected",
                id.role, id.name, role
            )));
        }
        let verified = verified?;
        let id = identity.map_err(|e| rejected(format!("the server's certificate: {e}")))?;
        if let ExpectedPeer::Node(name) = &self.expect
            && id.name != *name
        {
            return Err(rejected(format!(
                "the agent at this address holds the certificate of node {:?}, not {name:?}",
                id.name
            )));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

impl Material {
    pub(super) fn build_client(
        &self,
        expect: &ExpectedPeer,
    ) -> Result<rustls::ClientConfig, TlsError> {
        let inner = WebPkiServerVerifier::builder_with_provider(self.roots.clone(), provider())
            .with_crls(self.crls.clone())
            .build()
            .map_err(|e| TlsError::Config(format!("server certificate verifier: {e}")))?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier {
                inner,
                expect: expect.clone(),
            }));
        let mut config = match &self.key {
            Some(key) => builder
                .with_client_auth_cert(self.chain.clone(), key.clone_key())
                .map_err(|e| {
                    TlsError::Config(format!(
                        "the certificate and key do not make a usable pair: {e}"
                    ))
                })?,
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

impl TlsContext {
    /// The client configuration for reaching `expect` with the current material (built once
    /// per material and peer, so TLS sessions can be resumed).
    pub fn client_config(
        &self,
        expect: &ExpectedPeer,
    ) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let material = self.current();
        let mut cache = material
            .client_configs
            .lock()
            .expect("client config cache poisoned");
        if let Some(c) = cache.get(expect) {
            return Ok(c.clone());
        }
        let config = Arc::new(material.build_client(expect)?);
        cache.insert(expect.clone(), config.clone());
        Ok(config)
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A tonic connector: TCP, then TLS for `expect`.
#[derive(Clone)]
pub struct TlsConnector {
    pub(crate) ctx: TlsContext,
    pub(crate) expect: ExpectedPeer,
}

impl tower_service::Service<Uri> for TlsConnector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (ctx, expect) = (self.ctx.clone(), self.expect.clone());
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| format!("{uri} has no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().ok_or_else(|| format!("{uri} has no port"))?;
            let tcp = connect_tcp(&host, port).await?;
            let config = ctx.client_config(&expect)?;
            // The name is only sent as SNI; the verifier checks the role's name whatever the
            // dialled address (see PeerVerifier).
            let name = ServerName::try_from(
                expect
                    .role()
                    .server_name()
                    .expect("servers have a name")
                    .to_owned(),
            )?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS handshake with {host}:{port} failed: {e}"))?;
            Ok(TokioIo::new(tls))
        })
    }
}

/// Connects to `host:port`, from the process's source address when one is set
/// (`transport::SOURCE_ADDRESS_ENV`), with Nagle's algorithm off.
pub async fn connect_tcp(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        let socket = match addr {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        if let Some(src) = crate::transport::source_address()
            && src.is_ipv4() == addr.is_ipv4()
        {
            socket.bind(SocketAddr::new(src, 0))?;
        }
        match socket.connect(addr).await {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{host} resolves to no address"),
        )
    }))
}
