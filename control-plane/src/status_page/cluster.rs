//! `/`: the cluster at a glance: its replicas and who leads, term and commit, the cluster
//! version, nodes and GPUs by state, and the queue in numbers. A follower serves it from
//! its applied state and says so.

use std::collections::BTreeMap;

use maud::html;

use super::Page;
use super::gpu::{CellState, gpu_view, node_status};
use super::html::{count, page};
use crate::state::JobState;

pub fn render_cluster(p: &Page) -> String {
    let c = p.cluster;
    let s = p.view.status;
    let mut nodes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut cells: BTreeMap<&str, usize> = BTreeMap::new();
    for n in c.nodes.values() {
        *nodes.entry(node_status(n)).or_default() += 1;
        for g in &n.spec.gpus {
            *cells.entry(gpu_view(c, n, g).state.as_str()).or_default() += 1;
        }
    }
    let mut jobs: BTreeMap<JobState, usize> = BTreeMap::new();
    for j in c.jobs.values() {
        *jobs.entry(j.state).or_default() += 1;
    }
    // Defined tenants, and any other that holds GPUs (jobs may name undefined tenants
    // until the first is defined).
    let tenants: std::collections::BTreeSet<&String> = c
        .tenants
        .keys()
        .chain(c.index.tenant_held_milli.keys())
        .collect();
    let applied_lag = s.commit_index.saturating_sub(s.applied_index);
    let body = html! {
        h1 { "Cluster " (s.cluster) }
        @if !p.view.is_leader() {
            p.notice {
                "Served by replica " (s.id) ", a " (s.state) ", from the state it applied (index " (s.applied_index) "). "
                @match (s.leader, p.view.leader_address()) {
                    (0, _) => "No leader is known right now.",
                    (l, Some(a)) => { "Replica " (l) " leads (" code { (a) } "); pending reasons are known there." },
                    (l, None) => { "Replica " (l) " leads; pending reasons are known there." },
                }
            }
        }
        @if !s.removed.is_empty() { p.bad { (s.removed) } }
        div.tiles {
            div.tile { div.big { @if s.leader == 0 { "none" } @else { "replica " (s.leader) } } div { "leader" } }
            div.tile { div.big { (s.term) } div { "term" } }
            div.tile { div.big { (s.commit_index) } div { "commit index" @if applied_lag > 0 { " (" (applied_lag) " to apply)" } } }
            div.tile { div.big { "v" (s.cluster_version) } div { "cluster version (release " (s.release) ")" } }
            div.tile { div.big { (count(c.nodes.len())) } div { "nodes" } }
            div.tile { div.big { (count(cells.values().sum())) } div { "GPUs" } }
            div.tile { div.big { (count(c.index.pending.len())) } div { "pending jobs" } }
        }
        @if !s.cluster_version_pending.is_empty() { p.muted { "Cluster version not raised yet: " (s.cluster_version_pending) } }
        h2 { "Replicas" }
        table.list {
            thead { tr { th { "id" } th { "address" } th { "role" } th { "state" } th { "reachable" } th { "matched index" } th { "lag" } th { "release" } } }
            tbody { @for m in &s.members {
                tr {
                    td { (m.id) }
                    td { code { (m.address) } }
                    td { (m.role) }
                    td { @if m.id == s.leader { b { "leader" } } @if m.id == s.id { " (this replica)" } }
                    td { @if m.reachable { span.ok { "yes" } } @else { span.bad { "no" } } }
                    td.num { (m.matched_index) }
                    td.num { @if p.view.is_leader() { (m.lag) } @else { "-" } }
                    td { (m.release) }
                }
            } }
        }
        div.cols {
            div {
                h2 { a href="/nodes" { "Nodes" } }
                table.list.narrow { tbody {
                    @for st in ["ready", "drained", "down"] { tr { th { (st) } td.num { (nodes.get(st).copied().unwrap_or(0)) } } }
                } }
            }
            div {
                h2 { a href="/nodes" { "GPUs" } }
                table.list.narrow { tbody {
                    @for st in CellState::ALL {
                        tr {
                            th { span class={ "dot " (st.as_str()) } {} a href={ "/nodes?state=" (st.as_str()) } { (st.as_str()) } }
                            td.num { (count(cells.get(st.as_str()).copied().unwrap_or(0))) }
                        }
                    }
                } }
            }
            div {
                h2 { a href="/queue" { "Jobs" } }
                table.list.narrow { tbody {
                    @for st in JobState::ALL { tr { th { (st.as_str()) } td.num { (count(jobs.get(&st).copied().unwrap_or(0))) } } }
                    tr { th { "archived" } td.num { (count(c.archived.len())) } }
                } }
            }
            div {
                h2 { a href="/tenants" { "Tenants" } }
                table.list.narrow { tbody {
                    @for t in &tenants {
                        tr { th { (t) } td.num { (super::html::gpus(c.index.tenant_held_milli.get(*t).copied().unwrap_or(0))) " GPUs held" } }
                    }
                    @if tenants.is_empty() { tr { td.muted { "none defined, none holding GPUs" } } }
                } }
            }
        }
        p.muted.small { "Also on this port: " a href="/metrics" { "/metrics" } " · " a href="/healthz" { "/healthz" } " · " a href="/readyz" { "/readyz" } }
    };
    page(&p.view, "/", "Cluster", body)
}
