//! `/services`: every service (tenant, replicas ready of desired, revision, rollout) and
//! `/services/{tenant}/{name}`: one service, its replicas (state, node, GPUs, endpoint,
//! restarts, last exit, each linked to its job), what it asks for, its revisions and events.
//! Replicas are described as the API describes them (`api::convert_service`), so the page and
//! `gpuctl service describe` never disagree on a replica's state or endpoint.
//!
//! In the summary view a service's name (its replicas' job name), command, environment and
//! image are withheld, and the list links to no service page (the link would carry the name).

use maud::{Markup, html};
use proto::v1 as pb;

use super::Page;
use super::html::{ago, count, job_link, node_link, not_found, page, path_segment, utc};
use crate::api::convert_service::service_to_proto;
use crate::cli::probe_spec::{check_text, millis_text, shell_words};
use crate::cli::service_output::gpu_shape;
use crate::state::Service;

/// Most services listed: a listing beyond that is for `gpuctl service get`.
pub const MAX_ROWS: usize = 500;

/// The path of a service's page.
pub fn service_path(tenant: &str, name: &str) -> String {
    format!("/services/{}/{}", path_segment(tenant), path_segment(name))
}

/// A rollout's (or a replica's) state as a coloured label.
fn badge(label: &str) -> Markup {
    html! { span class={ "st " (label) } { (label) } }
}

fn rollout_label(s: &Service) -> &'static str {
    if s.deleting {
        "deleting"
    } else {
        s.rollout.label()
    }
}

pub fn render_services(p: &Page) -> String {
    let c = p.cluster;
    let full = p.view.mode.shows_details();
    let services: Vec<&Service> = c.services.values().take(MAX_ROWS).collect();
    let body = html! {
        h1 { "Services" }
        p.summary { b { (count(c.services.len())) " services" } }
        @if services.is_empty() {
            p.muted { "No service runs. `gpuctl service create NAME --replicas 2 --port http -- PROGRAM` starts one (docs/SERVICES.md)." }
        } @else {
            table.list {
                thead { tr {
                    th { "service" } th { "tenant" } th { "ready / desired" } th { "up to date" }
                    th { "revision" } th { "rollout" } th { "age" }
                } }
                tbody { @for s in &services {
                    @let view = service_to_proto(s, c, String::new());
                    tr {
                        td { @if full { a href=(service_path(&s.spec.tenant, &s.spec.name)) { b { (s.spec.name) } } } @else { span.muted { "(withheld)" } } }
                        td { (s.spec.tenant) }
                        td.num { (view.ready) " / " (s.spec.replicas) }
                        td.num { (view.updated) }
                        td.num { (s.revision) }
                        td {
                            (badge(rollout_label(s)))
                            @if !view.rollout_reason.is_empty() { " " span.muted { (view.rollout_reason) } }
                        }
                        td.nowrap { (ago(s.created_at, p.view.now)) }
                    }
                } }
            }
            @if c.services.len() > MAX_ROWS { p.muted { "The first " (MAX_ROWS) " are shown; `gpuctl service get` lists them all." } }
        }
    };
    page(&p.view, "/services", "Services", body)
}

/// The page of service `tenant/name` (its autoscaler's view as the leader gives it, empty
/// on a follower), or `None` when this replica knows no such service.
pub fn render_service(p: &Page, tenant: &str, name: &str, autoscaler: &str) -> Option<String> {
    let key = crate::state::service_key(tenant, name);
    let s = p.cluster.services.get(&key)?;
    let view = service_to_proto(s, p.cluster, autoscaler.to_owned());
    let title = if p.view.mode.shows_details() {
        format!("Service {name}")
    } else {
        "Service".to_owned()
    };
    Some(page(
        &p.view,
        "/services",
        &title,
        service_body(p, s, &view),
    ))
}

/// The 404 page for a service this replica does not know.
pub fn render_missing_service(p: &Page, tenant: &str, name: &str) -> String {
    not_found(
        &p.view,
        "/services",
        &format!(
            "No service {tenant}/{name} on this replica: it may have been deleted (or not yet reached this replica)."
        ),
    )
}

fn service_body(p: &Page, s: &Service, view: &pb::Service) -> Markup {
    let full = p.view.mode.shows_details();
    let spec = view.spec.clone().unwrap_or_default();
    let t = spec.template.clone().unwrap_or_default();
    let withheld = html! { span.muted { "(withheld)" } };
    html! {
        h1 {
            "Service " @if full { (s.spec.name) } @else { (withheld) }
            " " (badge(rollout_label(s)))
        }
        @if !view.rollout_reason.is_empty() {
            p.reason { b { "Paused: " } (view.rollout_reason) " — " code { "gpuctl service rollout resume" } " once fixed, or " code { "rollout undo" } "." }
        }
        table.kv {
            tr { th { "tenant" } td { (s.spec.tenant) } }
            tr { th { "replicas" } td { (view.ready) " ready of " (s.spec.replicas) " desired, " (view.updated) " at revision " (s.revision) } }
            tr { th { "command" } td { @if full { code { (shell_words(&t.command)) } } @else { (withheld) } } }
            @if full { @if let Some(c) = &t.container { tr { th { "image" } td { code { (c.image) } } } } }
            tr { th { "asks for" } td {
                (gpu_shape(&t)) " per replica"
                @if t.cpu_milli_per_task > 0 || t.memory_mib_per_task > 0 {
                    ", " (t.cpu_milli_per_task as f64 / 1000.0) " CPUs and " (t.memory_mib_per_task) " MiB"
                }
            } }
            tr { th { "ports" } td { @if t.ports.is_empty() { "none" } @else { (t.ports.join(", ")) } } }
            tr { th { "priority" } td { (t.priority_class) @if t.preemptible { ", preemptible" } } }
            tr { th { "readiness" } td { (probe_cell(spec.readiness.as_ref(), full)) } }
            tr { th { "liveness" } td { (probe_cell(spec.liveness.as_ref(), full)) } }
            tr { th { "rollout strategy" } td {
                "at most " (s.spec.strategy.max_surge) " extra, " (s.spec.strategy.max_unavailable) " unavailable; paused after "
                (millis_text(s.spec.strategy.progress_deadline_ms)) " without progress"
            } }
            @if let Some(a) = &s.spec.autoscale {
                tr { th { "autoscale" } td {
                    (a.min) "–" (a.max) " replicas on " code { (a.metric) } " (target " (a.target_milli as f64 / 1000.0) " per ready replica)"
                    @if !view.autoscaler.is_empty() { br; span.muted { (view.autoscaler) } }
                } }
            }
            tr { th { "created" } td { (utc(s.created_at)) " (" (ago(s.created_at, p.view.now)) " ago)" } }
        }
        h2 { "Replicas" }
        @if view.replicas.is_empty() {
            p.muted { "None running." }
        } @else {
            table.list {
                thead { tr {
                    th { "ordinal" } th { "job" } th { "revision" } th { "state" } th { "restarts" }
                    th { "node" } th { "GPUs" } th { "endpoint" } th { "last exit" } th { "reason" }
                } }
                tbody { @for r in &view.replicas {
                    tr {
                        td.num { (r.ordinal) }
                        td { (job_link(r.job_id)) }
                        td.num { (r.revision) @if r.revision != s.revision { " " span.muted { "(old)" } } }
                        td { (badge(&r.state)) }
                        td.num { (r.restarts) }
                        td { @if r.node.is_empty() { span.muted { "-" } } @else { (node_link(&r.node)) } }
                        td { @for (i, g) in r.gpus.iter().enumerate() { @if i > 0 { ", " } code.small { (g) } } }
                        td { @if r.endpoint.is_empty() { span.muted { "-" } } @else { code { (r.endpoint) } } }
                        td { (r.last_exit) }
                        td.why { (r.reason) }
                    }
                } }
            }
        }
        h2 { "Revisions" }
        table.list {
            thead { tr { th { "revision" } th { "created (UTC)" } th { "command" } th { "image" } } }
            tbody { @for r in view.revisions.iter().rev() {
                @let rt = r.template.clone().unwrap_or_default();
                tr {
                    td.num { (r.number) @if r.number == s.revision { " " span.muted { "(current)" } } }
                    td.nowrap { (utc(r.created_at_ms)) }
                    td { @if full { code { (shell_words(&rt.command)) } } @else { (withheld) } }
                    td { @if full { @if let Some(c) = &rt.container { code { (c.image) } } } @else { (withheld) } }
                }
            } }
        }
        h2 { "Events" }
        @if view.events.is_empty() {
            p.muted { "None." }
        } @else {
            table.list {
                thead { tr { th { "at (UTC)" } th { "event" } } }
                tbody { @for e in view.events.iter().rev() {
                    tr { td.nowrap { (utc(e.at_ms)) } td { (e.message) } }
                } }
            }
        }
    }
}

/// A probe's check and period; an exec probe's command is withheld in the summary view.
fn probe_cell(p: Option<&pb::ServiceProbe>, full: bool) -> Markup {
    let exec = |p: &pb::ServiceProbe| matches!(p.check, Some(pb::service_probe::Check::Exec(_)));
    match p {
        None => html! { span.muted { "none" } },
        Some(p) if exec(p) && !full => html! { "exec " span.muted { "(command withheld)" } },
        Some(p) => html! {
            code { (check_text(p.check.as_ref())) }
            " every " (millis_text(p.period_ms)) ", " (p.failure_threshold) " failure(s) to fail"
        },
    }
}
