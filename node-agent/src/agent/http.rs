//! The agent's metrics and health port (`--metrics-listen`): `/metrics`, `/healthz` (the
//! process answers) and `/readyz` (registered, within its lease, following the leader's
//! assignments: what `gpuctl node restart-agent` also waits for). More pages: more routes here.

use std::sync::Arc;

use axum::Router;
use axum::routing::get;

use super::Agent;
use crate::observe::{metrics_response, probe_response};

pub fn router(agent: Arc<Agent>) -> Router {
    let metrics = agent.clone();
    let ready = agent;
    Router::new()
        .route(
            "/metrics",
            get(move || async move {
                metrics.refresh_levels();
                metrics_response(&metrics.metrics.registry)
            }),
        )
        .route("/healthz", get(|| async { probe_response(Ok(())) }))
        .route(
            "/readyz",
            get(move || async move {
                probe_response(if ready.ready() {
                    Ok(())
                } else {
                    Err("not registered with a leader, or its lease lapsed".into())
                })
            }),
        )
}
