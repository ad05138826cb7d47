//! Metrics and health over plain HTTP, shared by the agent and the replicas (`--metrics-listen`):
//! Prometheus' text format from a `prometheus-client` registry, `/healthz` and `/readyz`.
//!
//! Each process builds its own `axum::Router` from its own state (the agent's in
//! `agent::http`, a replica's in `control_plane::http`) and hands it to [`serve`]; adding a page
//! is adding a route there. The port is plaintext and unauthenticated on purpose: Prometheus and
//! kubelet probes cannot present the cluster's client certificates, and nothing served here
//! changes anything or shows more than counts and names (docs/OPERATIONS.md).

use std::net::SocketAddr;

use anyhow::Context;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Prometheus' own content type for the OpenMetrics text `prometheus-client` writes.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Binds `addr` now (a port conflict is reported at start-up, not on the first scrape) and
/// serves `router` there until the task is aborted. Returns the bound address (for port 0).
pub async fn serve(
    addr: &str,
    router: axum::Router,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    serve_on(bind(addr).await?, router)
}

/// Binds the metrics address, for a process that must bind before it has built its routes.
pub async fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} for metrics (--metrics-listen)"))
}

/// Serves `router` on a bound listener until the task is aborted.
pub fn serve_on(
    listener: TcpListener,
    router: axum::Router,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let bound = listener.local_addr().context("metrics listener address")?;
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "the metrics port stopped serving");
        }
    });
    Ok((bound, task))
}

/// The registry in the text exposition format, as a `/metrics` answer.
pub fn metrics_response(registry: &Registry) -> Response {
    let mut body = String::with_capacity(16 * 1024);
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {e}\n"),
        )
            .into_response(),
    }
}

/// A probe's answer: 200 with "ok", or 503 with why not (a person reads it with curl).
pub fn probe_response(verdict: Result<(), String>) -> Response {
    match verdict {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

/// Histogram buckets for latencies from 100 µs to about 13 s (powers of two): fsyncs,
/// scheduling passes, API calls and launches all fall in that range.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.0, 18)
}

/// A plain HTTP/1.0 GET of `path` at `addr`: (status, body). For scrapes by the benchmarks and
/// tests (small answers, loopback), without an HTTP client in the dependency tree.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limit = std::time::Duration::from_secs(10);
    let mut s = tokio::time::timeout(limit, tokio::net::TcpStream::connect(addr)).await??;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(limit, s.read_to_end(&mut out)).await??;
    let out = String::from_utf8_lossy(&out);
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_owned();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    #[tokio::test]
    async fn serves_a_router_and_encodes_a_registry() {
        let mut registry = Registry::with_prefix("gpucp");
        let c: Counter = Counter::default();
        registry.register("things", "Things seen", c.clone());
        c.inc_by(3);
        let registry = std::sync::Arc::new(registry);
        let router = axum::Router::new()
            .route(
                "/metrics",
                axum::routing::get({
                    let r = registry.clone();
                    move || async move { metrics_response(&r) }
                }),
            )
            .route(
                "/readyz",
                axum::routing::get(|| async { probe_response(Err("no leader".into())) }),
            );
        let (addr, task) = serve("127.0.0.1:0", router).await.unwrap();
        let (status, body) = http_get(addr, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        assert!(body.contains("gpucp_things_total 3"), "{body}");
        let (status, body) = http_get(addr, "/readyz").await.unwrap();
        assert_eq!(status, 503);
        assert!(body.contains("no leader"), "{body}");
        task.abort();
        // A second server on a taken port says which flag to change.
        let taken = serve(&addr.to_string(), axum::Router::new()).await;
        if let Err(e) = taken {
            assert!(format!("{e:#}").contains("--metrics-listen"), "{e:#}");
        }
    }
}
