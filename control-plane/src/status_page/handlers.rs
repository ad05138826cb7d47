//! The status page's routes: each reads this replica's applied state (and, for a job's logs,
//! the agent that holds them) and hands it to a page's pure `render_*`. Rendering runs off
//! the async workers, under the state's read lock, like the metrics handler's walk.

use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use proto::v1 as pb;

use super::job::{LOG_TAIL_BYTES, LogTail, Logs};
use super::nodes::NodesFilter;
use super::{Mode, Page, View};
use crate::http::HttpState;

/// How long the job page waits for an agent's logs before it says they did not come.
const LOGS_TIMEOUT: Duration = Duration::from_secs(3);

/// The status page's routes, added to the HTTP port's router (none when the mode is off).
pub fn routes(router: Router<HttpState>, mode: Mode) -> Router<HttpState> {
    if mode == Mode::Off {
        return router;
    }
    router
        .route("/", get(cluster))
        .route("/status", get(cluster))
        .route("/nodes", get(nodes))
        .route("/nodes/{name}", get(node))
        .route("/queue", get(queue))
        .route("/jobs/{id}", get(job))
        .route("/services", get(services))
        .route("/services/{tenant}/{name}", get(service))
        .route("/tenants", get(tenants))
}

/// Renders with `render` over this replica's state and view.
async fn render<F>(s: HttpState, render: F) -> Response
where
    F: FnOnce(&Page) -> (StatusCode, String) + Send + 'static,
{
    let replica = s.replica.clone();
    let mode = s.status_page;
    let done = tokio::task::spawn_blocking(move || {
        // `status` reads the state itself: taken before this read lock, not under it.
        let status = crate::membership::status(&replica);
        let board = replica.current_reasons();
        let now = replica.now_ms();
        let data = replica.sm.read();
        let page = Page {
            cluster: &data.cluster,
            view: View {
                status: &status,
                board: board.as_deref(),
                now,
                mode,
            },
        };
        render(&page)
    })
    .await;
    match done {
        Ok((code, html)) => (code, Html(html)).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the status page failed to render: {e}"),
        )
            .into_response(),
    }
}

async fn cluster(State(s): State<HttpState>) -> Response {
    render(s, |p| (StatusCode::OK, super::cluster::render_cluster(p))).await
}

#[derive(serde::Deserialize)]
struct NodesQuery {
    partition: Option<String>,
    state: Option<String>,
    status: Option<String>,
}

async fn nodes(State(s): State<HttpState>, Query(q): Query<NodesQuery>) -> Response {
    match NodesFilter::parse(
        q.partition.as_deref(),
        q.state.as_deref(),
        q.status.as_deref(),
    ) {
        Ok(filter) => {
            render(s, move |p| {
                (StatusCode::OK, super::nodes::render_nodes(p, &filter))
            })
            .await
        }
        Err(why) => (StatusCode::BAD_REQUEST, why).into_response(),
    }
}

async fn node(State(s): State<HttpState>, Path(name): Path<String>) -> Response {
    render(s, move |p| match super::node::render_node(p, &name) {
        Some(html) => (StatusCode::OK, html),
        None => (
            StatusCode::NOT_FOUND,
            super::node::render_missing_node(p, &name),
        ),
    })
    .await
}

async fn queue(State(s): State<HttpState>) -> Response {
    render(s, |p| (StatusCode::OK, super::queue::render_queue(p))).await
}

async fn services(State(s): State<HttpState>) -> Response {
    render(s, |p| (StatusCode::OK, super::services::render_services(p))).await
}

async fn service(
    State(s): State<HttpState>,
    Path((tenant, name)): Path<(String, String)>,
) -> Response {
    // What the leader's autoscaler sees (empty on a follower), read before the state's lock.
    let autoscaler = s
        .replica
        .services
        .status(&crate::state::service_key(&tenant, &name));
    render(s, move |p| {
        match super::services::render_service(p, &tenant, &name, &autoscaler) {
            Some(html) => (StatusCode::OK, html),
            None => (
                StatusCode::NOT_FOUND,
                super::services::render_missing_service(p, &tenant, &name),
            ),
        }
    })
    .await
}

async fn tenants(State(s): State<HttpState>) -> Response {
    render(s, |p| (StatusCode::OK, super::tenants::render_tenants(p))).await
}

async fn job(State(s): State<HttpState>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "{:?} is not a job id: give a number, as /jobs/42",
                crate::cli::output::printable(&id)
            ),
        )
            .into_response();
    };
    let logs = if s.status_page.shows_details() {
        job_logs(&s, id).await
    } else {
        Logs::Withheld
    };
    render(s, move |p| match super::job::render_job(p, id, &logs) {
        Ok(html) => (StatusCode::OK, html),
        Err(html) => (StatusCode::NOT_FOUND, html),
    })
    .await
}

/// The tail of task 0's logs of the job's latest attempt, read as `gpuctl logs` reads them.
async fn job_logs(s: &HttpState, id: u64) -> Logs {
    let req = pb::ReadJobLogsRequest {
        job_id: id,
        tail_bytes: LOG_TAIL_BYTES,
        ..Default::default()
    };
    // The deadline travels to the agent; this bounds the connection too (a host that does not
    // answer at all must not hold the page).
    let read = crate::api::read_logs(&s.replica, &req, LOGS_TIMEOUT, |_| Ok(()));
    let Ok(read) = tokio::time::timeout(LOGS_TIMEOUT + Duration::from_secs(1), read).await else {
        return Logs::Unavailable(format!(
            "The job's agent did not answer within {} s; `gpuctl logs {id}` tries again.",
            LOGS_TIMEOUT.as_secs() + 1
        ));
    };
    match read {
        Ok(l) => Logs::Tail(LogTail {
            node: l.node,
            attempt: l.attempt,
            attempts: l.attempts,
            stdout: String::from_utf8_lossy(&l.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&l.stderr).into_owned(),
        }),
        Err(e) => Logs::Unavailable(
            crate::api::route::error_status(&s.replica, e)
                .message()
                .to_owned(),
        ),
    }
}
