//! Transport helpers every gRPC client and server of the project shares (replicas, gpuctl,
//! node agents), so connection and retry behaviour is defined once.

use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::tls::client::TlsConnector;
use crate::tls::{ExpectedPeer, TlsContext};

/// How long dialling a peer may take, TCP and TLS handshake together.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

fn endpoint(addr: &str) -> Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10)))
}

/// A plaintext channel to `addr` (host:port) that connects on first use; building it cannot
/// fail for a well-formed address, so callers may create it before the peer is up.
pub fn lazy_channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(endpoint(addr)?
        .local_address(source_address())
        .connect_lazy())
}

/// How a process talks to the others: mutual TLS with its certificate (the default
/// everywhere), or plaintext (`--insecure`: for benchmarks of the TLS cost and for trusted
/// test networks; nothing is authenticated then).
#[derive(Clone)]
pub enum Transport {
    Plain,
    Tls(TlsContext),
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Plain => f.write_str("Plain"),
            Transport::Tls(ctx) => write!(f, "Tls({:?})", ctx.identity().map(|i| i.subject())),
        }
    }
}

impl Transport {
    /// A lazily connecting channel to `addr`, which must hold `expect`'s certificate.
    pub fn channel(
        &self,
        addr: &str,
        expect: ExpectedPeer,
    ) -> Result<Channel, tonic::transport::Error> {
        match self {
            Transport::Plain => lazy_channel(addr),
            Transport::Tls(ctx) => Ok(endpoint(addr)?.connect_with_connector_lazy(TlsConnector {
                ctx: ctx.clone(),
                expect,
            })),
        }
    }

    /// The connections a server accepts on `listener` (TLS handshakes done, peers named).
    pub fn incoming(&self, listener: tokio::net::TcpListener) -> crate::tls::server::Incoming {
        crate::tls::server::incoming(listener, self.tls().cloned())
    }

    pub fn tls(&self) -> Option<&TlsContext> {
        match self {
            Transport::Plain => None,
            Transport::Tls(ctx) => Some(ctx),
        }
    }
}

/// The connections a gRPC server accepts on `listener`, with Nagle's algorithm off.
/// `Server::builder().tcp_nodelay(true)` does not apply to a listener the caller bound itself
/// (tonic ignores it for `serve_with_incoming*`), and with Nagle on, a response written in two
/// small pieces (headers, then data and trailers) waits for the peer's delayed ACK, 40 ms on
/// Linux: exactly the leader's timeout for an AppendEntries, so replication stalled and backed
/// off every few hundred writes.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Environment variable naming the local IP address every outgoing connection of this process
/// binds to. Unset (the default), the kernel picks the source address. The chaos harness gives
/// each replica and agent its own loopback address (127.x.y.z) and sets this to it, so that
/// iptables rules can cut the traffic of one process without touching the others: on loopback
/// the kernel would otherwise use 127.0.0.1 as the source of every connection.
pub const SOURCE_ADDRESS_ENV: &str = "GPUCP_SOURCE_ADDRESS";

/// The address of [`SOURCE_ADDRESS_ENV`], read once. A value that is not an IP address is
/// ignored with a warning rather than failing every connection.
pub fn source_address() -> Option<IpAddr> {
    static SOURCE: OnceLock<Option<IpAddr>> = OnceLock::new();
    *SOURCE.get_or_init(|| {
        let value = std::env::var(SOURCE_ADDRESS_ENV).ok()?;
        match value.trim().parse() {
            Ok(ip) => Some(ip),
            Err(_) => {
                eprintln!(
                    "warning: {SOURCE_ADDRESS_ENV}={value:?} is not an IP address; ignoring it"
                );
                None
            }
        }
    })
}

/// Whether another attempt (possibly at another replica) may succeed.
pub fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
    ) || refused_by_goaway(status)
}

/// A call the server turned away with an HTTP/2 GOAWAY, as a replica that is shutting down
/// (a rolling restart or upgrade) does with every new call on its open connections. tonic
/// reports it as `Internal` ("h2 protocol error"), yet the call was not served there, and
/// another replica, or this one once restarted, can serve it.
fn refused_by_goaway(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_go_away() && h2.is_remote();
        }
        source = e.source();
    }
    false
}

/// A status's message with the errors beneath it: a failed connection says only "transport
/// error" at the top, and why (refused, a certificate the server rejected) below.
pub fn status_text(status: &Status) -> String {
    use std::error::Error;
    let mut message = status.message().to_owned();
    let mut cause = status.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        cause = e.source();
    }
    message
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
