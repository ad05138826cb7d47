//! Transport helpers every gRPC client and server of the project shares (replicas, gpuctl,
//! node agents), so connection and retry behaviour is defined once.

use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// A channel to `addr` (host:port) that connects on first use; building it cannot fail for a
/// well-formed address, so callers may create it before the peer is up.
pub fn lazy_channel(addr: &str) -> Result<Channel, tonic::transport::Error> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .local_address(source_address())
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .connect_lazy())
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
    )
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
