//! `/tenants`: each tenant's GPUs held against its quota (guaranteed) and limit (`max_gpus`),
//! its jobs running and waiting, and its fair-share usage (decayed GPU-hours).

use std::collections::{BTreeMap, BTreeSet};

use maud::html;

use super::Page;
use super::html::{bar, gpus, page};
use crate::state::MILLI_PER_GPU;

#[derive(Default)]
struct Row {
    held_milli: u64,
    running: usize,
    pending: usize,
}

pub fn render_tenants(p: &Page) -> String {
    let c = p.cluster;
    let mut rows: BTreeMap<&str, Row> = c
        .tenants
        .keys()
        .map(|t| (t.as_str(), Row::default()))
        .collect();
    for (t, milli) in &c.index.tenant_held_milli {
        rows.entry(t.as_str()).or_default().held_milli = *milli;
    }
    let holding: BTreeSet<u64> = c.allocations.values().map(|r| r.allocation.job).collect();
    for j in holding.iter().filter_map(|id| c.job(*id)) {
        rows.entry(j.spec.tenant.as_str()).or_default().running += 1;
    }
    for j in c.index.pending.iter().filter_map(|id| c.job(*id)) {
        rows.entry(j.spec.tenant.as_str()).or_default().pending += 1;
    }
    let body = html! {
        h1 { "Tenants" }
        @if rows.is_empty() {
            p.muted { "No tenant is defined and no job holds or waits for GPUs. `gpuctl tenant set NAME --quota N` defines one (once any is defined, jobs must name a known tenant)." }
        } @else {
            table.list {
                thead { tr {
                    th { "tenant" } th { "weight" } th { "GPUs held / quota" } th { "limit" }
                    th { "running" } th { "pending" } th { "fair-share usage" }
                } }
                tbody { @for (name, r) in &rows {
                    @let t = c.tenants.get(*name);
                    @let quota = t.map_or(0, |t| u64::from(t.quota_gpus) * MILLI_PER_GPU);
                    tr {
                        td { b { (name) } @if t.is_none() { " " span.muted { "(no quota defined)" } } }
                        td.num { (t.map_or("-".to_owned(), |t| t.weight.to_string())) }
                        td {
                            @if quota == 0 {
                                (gpus(r.held_milli)) " GPUs " span.muted { "(no quota)" }
                            } @else {
                                @let label = format!("{} / {} GPUs", gpus(r.held_milli), gpus(quota));
                                (bar(r.held_milli, quota, &label))
                            }
                            @if quota > 0 && r.held_milli > quota { " " span.muted { "(borrowing " (gpus(r.held_milli - quota)) ")" } }
                        }
                        td.num { @match t.map(|t| t.max_gpus) { Some(0) | None => "none", Some(m) => (m) } }
                        td.num { (r.running) }
                        td.num { (r.pending) }
                        td.num {
                            @let h = c.tenant_usage.get(*name).map_or(0.0, |u| u.gpu_seconds_at(p.view.now)) / 3600.0;
                            (format!("{h:.1}")) " GPU-h"
                        }
                    }
                } }
            }
            p.legend.small { "Quota: GPUs guaranteed (work beyond it on borrowed GPUs may be preempted when another tenant needs its quota back). Limit: the most GPUs it may hold. Usage decays with a 24-hour half-life." }
        }
    };
    page(&p.view, "/tenants", "Tenants", body)
}
