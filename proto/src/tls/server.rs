//! The server side: accepted connections, TLS or plain, each tagged with who is on the other
//! end ([`ConnInfo`], which tonic puts in every request's extensions).
//!
//! Handshakes run in their own tasks, so a slow or silent client never holds up the accept
//! loop; a failed handshake (no certificate, another CA, expired, revoked) is logged with the
//! caller's address and counted, and the connection is dropped before any RPC is read.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use super::TlsContext;
use super::identity::{PeerIdentity, parse_identity};

/// A client has this long to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Who is on the other end of a connection, as the server saw it at the handshake.
#[derive(Debug, Clone, Default)]
pub struct ConnInfo {
    pub remote: Option<SocketAddr>,
    /// The peer's verified certificate; `None` on a plain connection or a token-only client.
    pub peer: Option<Arc<PeerIdentity>>,
    /// Whether the connection is TLS (a plain one carries no identity at all).
    pub tls: bool,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// One accepted connection.
pub struct Conn {
    io: Io,
    info: ConnInfo,
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match &mut $self.get_mut().io {
            Io::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Io::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
        }
    };
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

/// Connections tonic serves (`Server::serve_with_incoming*`).
pub type Incoming = ReceiverStream<Result<Conn, io::Error>>;

/// Accepts connections on `listener` until the returned stream is dropped: TLS handshakes
/// under `tls`, or plain connections when it is `None`. Nagle's algorithm is off on every
/// connection (see `transport::incoming` for why that matters).
pub fn incoming(listener: TcpListener, tls: Option<TlsContext>) -> Incoming {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off rather than spin.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            match &tls {
                None => {
                    let conn = Conn {
                        io: Io::Plain(tcp),
                        info: ConnInfo {
                            remote: Some(remote),
                            peer: None,
                            tls: false,
                        },
                    };
                    if tx.send(Ok(conn)).await.is_err() {
                        return;
                    }
                }
                Some(ctx) => {
                    let (ctx, tx) = (ctx.clone(), tx.clone());
                    tokio::spawn(async move {
                        if let Some(conn) = handshake(&ctx, tcp, remote).await {
                            let _ = tx.send(Ok(conn)).await;
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

async fn handshake(ctx: &TlsContext, tcp: TcpStream, remote: SocketAddr) -> Option<Conn> {
    let Some(config) = ctx.current().server.clone() else {
        tracing::error!("this process has no certificate to serve TLS with");
        return None;
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let refused = |why: String| {
        ctx.count_handshake_failure();
        tracing::info!(%remote, "refused a connection: {why}");
        None
    };
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return refused(format!("TLS handshake failed: {e}")),
        Err(_) => {
            return refused(format!(
                "no TLS handshake within {HANDSHAKE_TIMEOUT:?} (a plaintext client?)"
            ));
        }
    };
    let peer = match tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
        None => None,
        Some(leaf) => match parse_identity(leaf) {
            Ok(id) => Some(Arc::new(id)),
            Err(e) => return refused(format!("client certificate: {e}")),
        },
    };
    Some(Conn {
        io: Io::Tls(Box::new(tls)),
        info: ConnInfo {
            remote: Some(remote),
            peer,
            tls: true,
        },
    })
}
