//! A replica's plain-HTTP port (`--metrics-listen`): `/metrics` for Prometheus, `/healthz`
//! (the process answers and its Raft core runs) and `/readyz` (a ready member that knows its
//! leader: the same verdict the gRPC health service serves, `health`).
//!
//! [`router`] builds the routes from [`HttpState`], served by `node_agent::observe::serve`;
//! the status page (`status_page`, unless `--status-page` makes it off) adds its own.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use axum::routing::get;
use node_agent::observe::{metrics_response, probe_response};

use crate::health::{HealthSettings, Verdict, assess, observe};
use crate::leader::Liveness;
use crate::metrics::ReplicaMetrics;
use crate::replica::Replica;

/// What the routes read. Cheap to clone (handles only).
#[derive(Clone)]
pub struct HttpState {
    pub replica: Arc<Replica>,
    pub metrics: Arc<ReplicaMetrics>,
    /// The leader's record of agent heartbeats (`leader::liveness`).
    pub liveness: Arc<Liveness>,
    pub health: HealthSettings,
    /// How often agents heartbeat: a node silent for two intervals counts as overdue.
    pub agent_heartbeat: Duration,
    /// What the status page shows (`--status-page`); off: its routes are not served.
    pub status_page: crate::status_page::Mode,
}

pub fn router(state: HttpState) -> Router {
    let routes = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    crate::status_page::handlers::routes(routes, state.status_page).with_state(state)
}

fn verdict(s: &HttpState) -> Verdict {
    let open = s.replica.raft.metrics().has_changed().is_ok();
    assess(&observe(&s.replica, open), &s.health)
}

async fn healthz(State(s): State<HttpState>) -> Response {
    probe_response(if verdict(&s).live {
        Ok(())
    } else {
        Err("the Raft core has stopped; restart the replica".into())
    })
}

async fn readyz(State(s): State<HttpState>) -> Response {
    probe_response(verdict(&s).ready.map_err(|why| why.to_string()))
}

async fn metrics(State(s): State<HttpState>) -> Response {
    let raft = s.replica.raft.metrics().borrow().clone();
    let m = &s.metrics;
    m.set_raft(&raft, s.replica.commit_index());
    m.ready.set(i64::from(verdict(&s).ready.is_ok()));
    let leading = raft.current_leader == Some(raft.id);
    let replica = s.replica.clone();
    let (liveness, heartbeat) = (s.liveness.clone(), s.agent_heartbeat);
    // Off the async workers: on a large cluster this walks every node under the state's read
    // lock (a few ms at 10,000 nodes), like a small scheduling pass.
    let (levels, overdue) = tokio::task::spawn_blocking(move || {
        let board = replica
            .pending_reasons
            .read()
            .ok()
            .and_then(|b| b.clone())
            .filter(|_| leading);
        let data = replica.sm.read();
        let mut levels = crate::metrics::levels::levels(&data.cluster);
        // The leader's last pass says why pending jobs wait (followers have no board).
        levels.pending_by_reason = board.map(|b| crate::metrics::levels::pending_by_reason(&b));
        let overdue = leading.then(|| {
            let now = replica.now_ms();
            data.cluster
                .nodes
                .values()
                .filter(|n| n.status != crate::state::NodeStatus::Down)
                .filter(|n| liveness.silence(&n.spec.name, now, n.registered_at) > heartbeat * 2)
                .count()
        });
        (levels, overdue)
    })
    .await
    .unwrap_or_default();
    m.set_levels(&levels);
    m.heartbeats_overdue.set(overdue.unwrap_or(0) as i64);
    metrics_response(&m.registry)
}
