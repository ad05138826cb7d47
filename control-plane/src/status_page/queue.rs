//! `/queue`: jobs waiting, with the reason the leader's last scheduling pass gives for each
//! (the same words as `gpuctl queue`: `scheduler::reasons::explain`), and jobs holding GPUs.

use std::collections::BTreeSet;

use maud::html;

use super::Page;
use super::html::{ago, count, job_link, job_name, page, shape, state_badge};
use crate::scheduler::reasons::{ShapeMemo, explain};
use crate::state::Job;

/// Most jobs of each table: a queue of a million jobs is a listing for `gpuctl queue`.
pub const MAX_ROWS: usize = 500;

/// Pending jobs by id, and jobs with live allocations, at most [`MAX_ROWS`] of each.
pub fn render_queue(p: &Page) -> String {
    let c = p.cluster;
    let pending: Vec<&Job> = c
        .index
        .pending
        .iter()
        .take(MAX_ROWS)
        .filter_map(|id| c.job(*id))
        .collect();
    let holding: BTreeSet<u64> = c.allocations.values().map(|r| r.allocation.job).collect();
    let running: Vec<&Job> = holding
        .iter()
        .take(MAX_ROWS)
        .filter_map(|id| c.job(*id))
        .collect();
    let leader = p.view.is_leader();
    let mut memo = ShapeMemo::default();
    let reasons: Vec<String> = pending
        .iter()
        .map(|j| {
            if leader {
                explain(c, p.view.board, j, p.view.now, &mut memo)
            } else {
                String::new()
            }
        })
        .collect();
    let body = html! {
        h1 { "Queue" }
        p.summary {
            b { (count(c.index.pending.len())) " pending" } " · "
            b { (count(holding.len())) " holding GPUs" }
            @if let Some(b) = p.view.board { " · last scheduling pass " (ago(b.at, p.view.now)) " ago" }
        }
        @if !leader {
            p.notice {
                "This replica is a follower: why jobs wait is known to the leader only (its last scheduling pass)"
                @match p.view.leader_address() {
                    Some(addr) => { ": replica " (p.view.status.leader) " at " code { (addr) } ", whose status page is on its --metrics-listen port, or `gpuctl queue`." },
                    None => "; no leader is known right now.",
                }
            }
        }
        h2 { "Pending" }
        @if pending.is_empty() {
            p.muted { "No job is waiting." }
        } @else {
            table.list {
                thead { tr { th { "job" } th { "tenant" } th { "name" } th { "asks for" } th { "priority" } th { "waiting" } th { "reason" } } }
                tbody {
                    @for (j, reason) in pending.iter().zip(&reasons) {
                        tr {
                            td { (job_link(j.id)) }
                            td { (j.spec.tenant) }
                            td { (job_name(&p.view, &j.spec.name)) }
                            td { (shape(&j.spec)) }
                            td { (j.spec.priority_class) }
                            td.num { (ago(j.submitted_at, p.view.now)) }
                            td.why { @if leader { (reason) } @else { span.muted { "known to the leader" } } }
                        }
                    }
                }
            }
            @if c.index.pending.len() > pending.len() { p.muted { "… and " (count(c.index.pending.len() - pending.len())) " more (gpuctl queue lists them all)." } }
        }
        h2 { "Holding GPUs" }
        @if running.is_empty() {
            p.muted { "No job holds GPUs." }
        } @else {
            table.list {
                thead { tr { th { "job" } th { "tenant" } th { "name" } th { "state" } th { "asks for" } th { "on" } th { "for" } } }
                tbody {
                    @for j in &running {
                        @let nodes: BTreeSet<&str> = c.allocations_of(j.id).map(|r| r.allocation.node.as_str()).collect();
                        tr {
                            td { (job_link(j.id)) }
                            td { (j.spec.tenant) }
                            td { (job_name(&p.view, &j.spec.name)) }
                            td { (state_badge(j.state)) }
                            td { (shape(&j.spec)) }
                            td { @for (i, n) in nodes.iter().enumerate() { @if i > 0 { ", " } (super::html::node_link(n)) } }
                            td.num { (ago(j.last_change_at(), p.view.now)) }
                        }
                    }
                }
            }
            @if holding.len() > running.len() { p.muted { "… and " (count(holding.len() - running.len())) " more." } }
        }
    };
    page(&p.view, "/queue", "Queue", body)
}
