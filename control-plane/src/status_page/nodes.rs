//! `/nodes`: every node as a small card of GPU cells, coloured by what each GPU is doing and
//! labelled with the job that holds it; a summary line on top and filters by partition, GPU
//! state and node status in the query string. Made to stay readable (and fast) at 1,000
//! hosts and 8,000 GPUs: one compact card per host, a few hundred bytes per GPU.

use std::collections::BTreeMap;

use maud::{Markup, Render, html};

use super::Page;
use super::gpu::{CellState, GpuView, Occupancy, gpu_view, node_status};
use super::html::{count, node_link, page};
use crate::state::{GpuHealth, Node};

/// `?partition=P&state=S&status=U`: which nodes the grid shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodesFilter {
    pub partition: Option<String>,
    /// Nodes with at least one GPU in this state.
    pub state: Option<CellState>,
    /// Nodes of this status: ready, drained or down.
    pub status: Option<String>,
}

const STATUSES: [&str; 3] = ["ready", "drained", "down"];

impl NodesFilter {
    /// The filter from the query's values (empty means any), or what is wrong with them.
    pub fn parse(
        partition: Option<&str>,
        state: Option<&str>,
        status: Option<&str>,
    ) -> Result<NodesFilter, String> {
        let some = |v: Option<&str>| v.filter(|s| !s.is_empty()).map(str::to_owned);
        let state = match some(state) {
            None => None,
            Some(s) => Some(CellState::parse(&s).ok_or_else(|| {
                let known: Vec<&str> = CellState::ALL.iter().map(|c| c.as_str()).collect();
                format!(
                    "state={:?} is not a GPU state; give one of {}",
                    crate::cli::output::printable(&s),
                    known.join(", ")
                )
            })?),
        };
        let status = some(status);
        if let Some(s) = &status
            && !STATUSES.contains(&s.as_str())
        {
            return Err(format!(
                "status={:?} is not a node status; give one of {}",
                crate::cli::output::printable(s),
                STATUSES.join(", ")
            ));
        }
        Ok(NodesFilter {
            partition: some(partition),
            state,
            status,
        })
    }

    fn keeps(&self, node: &Node, cells: &[GpuView]) -> bool {
        self.partition
            .as_ref()
            .is_none_or(|p| node.spec.partition.as_ref() == Some(p))
            && self.status.as_ref().is_none_or(|s| node_status(node) == s)
            && self
                .state
                .is_none_or(|st| cells.iter().any(|c| c.state == st))
    }
}

/// The grid of every node the filter keeps.
pub fn render_nodes(p: &Page, filter: &NodesFilter) -> String {
    let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_status: BTreeMap<&str, usize> = BTreeMap::new();
    let mut gpus = 0;
    let mut shown_nodes = 0;
    let mut cards = String::with_capacity(p.cluster.nodes.len() * 1200);
    for node in p.cluster.nodes.values() {
        let cells: Vec<GpuView> = node
            .spec
            .gpus
            .iter()
            .map(|g| gpu_view(p.cluster, node, g))
            .collect();
        *by_status.entry(node_status(node)).or_default() += 1;
        for c in &cells {
            *by_state.entry(c.state.as_str()).or_default() += 1;
        }
        gpus += cells.len();
        if filter.keeps(node, &cells) {
            shown_nodes += 1;
            host_card(node, &cells).render_to(&mut cards);
        }
    }
    // Defined partitions and any a node names (a node may name one never defined).
    let partitions: std::collections::BTreeSet<&String> = p
        .cluster
        .partitions
        .keys()
        .chain(
            p.cluster
                .nodes
                .values()
                .filter_map(|n| n.spec.partition.as_ref()),
        )
        .collect();
    let nodes = p.cluster.nodes.len();
    let body = html! {
        h1 { "Nodes" }
        p.summary {
            b { (count(nodes)) " nodes" }
            @for s in STATUSES {
                @if let Some(n) = by_status.get(s) { " · " (count(*n)) " " (s) }
            }
            " — " b { (count(gpus)) " GPUs" }
            @for st in CellState::ALL {
                @if let Some(n) = by_state.get(st.as_str()) {
                    " · " span class={ "dot " (st.as_str()) } {} (count(*n)) " " (st.as_str())
                }
            }
        }
        form.filters method="get" action="/nodes" {
            label { "partition " select name="partition" {
                option value="" { "any" }
                @for part in &partitions {
                    option value=(part) selected[filter.partition.as_ref() == Some(*part)] { (part) }
                }
            } }
            label { " GPU state " select name="state" {
                option value="" { "any" }
                @for st in CellState::ALL {
                    option value=(st.as_str()) selected[filter.state == Some(st)] { (st.as_str()) }
                }
            } }
            label { " node " select name="status" {
                option value="" { "any" }
                @for s in STATUSES {
                    option value=(s) selected[filter.status.as_deref() == Some(s)] { (s) }
                }
            } }
            " " button type="submit" { "filter" }
            @if shown_nodes != nodes { " showing " (count(shown_nodes)) " of " (count(nodes)) " nodes · " a href="/nodes" { "all" } }
        }
        p.legend {
            @for st in CellState::ALL { span class={ "g " (st.as_str()) } { (st.as_str()) } " " }
            " cells: one per GPU, labelled with the job holding it; MIG GPUs show one stripe per slice"
        }
        @if nodes == 0 {
            p.empty { "No node has registered yet: start a node agent (`gpuctl agent`), or `gpuctl dev` for simulated hosts." }
        }
        div.hosts { (maud::PreEscaped(cards)) }
    };
    page(&p.view, "/nodes", "Nodes", body)
}

/// One host: its name, status and partition, then a cell per GPU.
fn host_card(node: &Node, cells: &[GpuView]) -> Markup {
    let status = node_status(node);
    let free = cells.iter().filter(|c| c.state == CellState::Free).count();
    let model = node
        .spec
        .gpus
        .first()
        .map(|g| short_model(&g.model))
        .unwrap_or("no GPUs");
    html! {
        div class={ "host " (status) } {
            div.hh {
                (node_link(&node.spec.name))
                @if status != "ready" { " " span class={ "ns " (status) } { (status) } }
                span.meta {
                    (model)
                    @if let Some(p) = &node.spec.partition { " · " (p) }
                    " · " (free) "/" (cells.len()) " free"
                }
            }
            div.cells { @for c in cells { (cell(c)) } }
        }
    }
}

/// The model without the vendor prefix ("H100 80GB HBM3").
pub fn short_model(model: &str) -> &str {
    model.strip_prefix("NVIDIA ").unwrap_or(model)
}

/// One GPU's cell: its colour, the holding job as text and link, the details in its title.
pub fn cell(c: &GpuView) -> Markup {
    let g = c.gpu;
    let state = c.state.as_str();
    let health = match &g.health {
        GpuHealth::Healthy => String::new(),
        GpuHealth::Unhealthy { reason } => format!(" · unhealthy: {reason}"),
    };
    let base = format!("GPU {} · {}{}", g.index, short_model(&g.model), health);
    match &c.occupancy {
        Occupancy::Whole(h) => html! {
            a class={ "g " (state) } href={ "/jobs/" (h.job) } title={ (base) " · job " (h.job) " (" (h.tenant) ")" } { (h.job) }
        },
        Occupancy::Shared { milli, holders } => {
            let pct = (u64::from(*milli) * 100 / 1000).min(100);
            let jobs: Vec<String> = holders
                .iter()
                .map(|h| format!("job {} ({})", h.job, h.tenant))
                .collect();
            let title = format!("{base} · shared {pct}%: {}", jobs.join(", "));
            match holders.first() {
                Some(h) => html! {
                    a class={ "g share " (state) } href={ "/jobs/" (h.job) } title=(title) style={ "--f:" (pct) "%" } { (h.job) @if holders.len() > 1 { "+" } }
                },
                None => {
                    html! { span class={ "g share " (state) } title=(title) style={ "--f:" (pct) "%" } { (pct) "%" } }
                }
            }
        }
        Occupancy::Mig(slices) => html! {
            span class={ "g mig " (state) } title={ (base) " · MIG, " (slices.len()) " slices" } {
                @for (profile, h) in slices {
                    @match h {
                        Some(h) => a.s.held href={ "/jobs/" (h.job) } title={ "GPU " (g.index) " slice " (profile) " · job " (h.job) " (" (h.tenant) ")" } {},
                        None => span.s title={ "GPU " (g.index) " slice " (profile) " · free" } {},
                    }
                }
            }
        },
        Occupancy::Free => {
            let text = match c.state {
                CellState::Unhealthy => "!",
                CellState::Down => "–",
                _ => "",
            };
            let what = match c.state {
                CellState::Free => " · free",
                CellState::Drained => " · free, node drained",
                CellState::Down => " · node down",
                _ => "",
            };
            html! { span class={ "g " (state) } title={ (base) (what) } { (text) } }
        }
    }
}
