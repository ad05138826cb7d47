//! `/nodes/{name}`: one node: its status and resources, each GPU with what holds it, and the
//! link matrix between its GPUs as the agent reported it (`nvidia-smi topo -m`), with each
//! GPU's NUMA node.

use maud::html;

use super::Page;
use super::gpu::{Occupancy, gpu_view, node_status};
use super::html::{ago, gpus, job_link, not_found, page};
use super::nodes::cell;
use crate::state::GpuHealth;

/// A CSS class for a link cell: NVLink (`NV12`), same PCIe switch (`PIX`, `PXB`), through the
/// host bridge (`PHB`), the NUMA node's interconnect (`NODE`) or across sockets (`SYS`).
fn link_class(link: &str) -> &'static str {
    match link {
        "X" => "self",
        l if l.starts_with("NV") => "nv",
        "PIX" | "PXB" => "pix",
        "PHB" => "phb",
        "NODE" => "node",
        "SYS" => "sys",
        _ => "other",
    }
}

/// The page of node `name` (`None`: it is not registered).
pub fn render_node(p: &Page, name: &str) -> Option<String> {
    let node = p.cluster.nodes.get(name)?;
    let spec = &node.spec;
    let views: Vec<_> = spec
        .gpus
        .iter()
        .map(|g| gpu_view(p.cluster, node, g))
        .collect();
    let free = p.cluster.index.node_free.get(name);
    let allocations: Vec<_> = p
        .cluster
        .index
        .node_allocations
        .get(name)
        .into_iter()
        .flatten()
        .filter_map(|a| p.cluster.allocations.get(a))
        .collect();
    let status = node_status(node);
    let body = html! {
        h1 { "Node " (spec.name) " " span class={ "ns " (status) } { (status) } }
        table.kv {
            tr { th { "partition" } td { (spec.partition.as_deref().unwrap_or("(default)")) } }
            tr { th { "GPUs" } td { (spec.gpus.len()) @if let Some(g) = spec.gpus.first() { " × " (g.model) } } }
            tr { th { "CPU" } td {
                (spec.cpu_milli / 1000) " cores"
                @if let Some(f) = free { " (" (f.cpu_milli / 1000) " free)" }
            } }
            tr { th { "memory" } td {
                (spec.memory_mib / 1024) " GiB"
                @if let Some(f) = free { " (" (f.memory_mib / 1024) " GiB free)" }
            } }
            tr { th { "registered" } td { (ago(node.registered_at, p.view.now)) " ago" } }
            @if !spec.labels.is_empty() {
                tr { th { "labels" } td {
                    @for (k, v) in &spec.labels { code { (k) "=" (v) } " " }
                } }
            }
            tr { th { "driver" } td { (spec.driver) } }
            @if !spec.agent_release.is_empty() { tr { th { "agent release" } td { (spec.agent_release) } } }
            @if !spec.enforcement.is_empty() { tr { th { "enforcement" } td { (spec.enforcement) } } }
            @if !spec.container_runtime.is_empty() { tr { th { "containers" } td { (spec.container_runtime) } } }
            @if !spec.agent_address.is_empty() { tr { th { "agent" } td { code { (spec.agent_address) } } } }
        }
        h2 { "GPUs" }
        div.cells.big { @for v in &views { (cell(v)) } }
        table.list {
            thead { tr { th { "GPU" } th { "model" } th { "memory" } th { "NUMA" } th { "PCI bus" } th { "health" } th { "held by" } th { "UUID" } } }
            tbody {
                @for v in &views {
                    tr {
                        td { (v.gpu.index) }
                        td.nowrap { (v.gpu.model) }
                        td.num.nowrap { (v.gpu.memory_mib / 1024) " GiB" }
                        td { (v.gpu.numa_node.map_or("-".to_owned(), |n| n.to_string())) }
                        td { code { (v.gpu.pci_bus_id) } }
                        td {
                            @match &v.gpu.health {
                                GpuHealth::Healthy => span.ok { "healthy" },
                                GpuHealth::Unhealthy { reason } => span.bad { "unhealthy: " (reason) },
                            }
                        }
                        td.nowrap {
                            @match &v.occupancy {
                                Occupancy::Free => span.muted { "free" },
                                Occupancy::Whole(h) => { "job " (job_link(h.job)) " (" (h.tenant) ")" },
                                Occupancy::Shared { milli, holders } => {
                                    "shares: " (gpus(u64::from(*milli))) " of 1 GPU"
                                    @for h in holders { " · job " (job_link(h.job)) " (" (h.tenant) ")" }
                                },
                                Occupancy::Mig(slices) => {
                                    "MIG: "
                                    @for (i, (profile, h)) in slices.iter().enumerate() {
                                        @if i > 0 { " · " }
                                        code { (profile) } " "
                                        @match h {
                                            Some(h) => { "job " (job_link(h.job)) " (" (h.tenant) ")" },
                                            None => span.muted { "free" },
                                        }
                                    }
                                },
                            }
                        }
                        td.nowrap { code.small { (v.gpu.uuid) } }
                    }
                }
            }
        }
        h2 { "Topology" }
        @if spec.topology.is_empty() {
            p.muted { "The agent reported no link matrix for this node." }
        } @else {
            table.topo {
                thead { tr {
                    th {}
                    @for g in &spec.gpus { th { "GPU" (g.index) } }
                    th { "NUMA affinity" }
                } }
                tbody {
                    @for (i, row) in spec.topology.iter().enumerate() {
                        tr {
                            th { "GPU" (spec.gpus.get(i).map_or(i as u32, |g| g.index)) }
                            @for link in row { td class=(link_class(link)) { (link) } }
                            td { (spec.gpus.get(i).and_then(|g| g.numa_node).map_or("-".to_owned(), |n| n.to_string())) }
                        }
                    }
                }
            }
            p.legend.small {
                "X = self · NV# = NVLink (# bonded links) · PIX/PXB = through PCIe switches · PHB = through the CPU's host bridge · NODE = across host bridges within a NUMA node · SYS = across the socket interconnect"
            }
        }
        h2 { "Allocations" }
        @if allocations.is_empty() {
            p.muted { "None." }
        } @else {
            table.list {
                thead { tr { th { "allocation" } th { "job" } th { "tenant" } th { "GPUs" } th { "since" } th { "state" } } }
                tbody {
                    @for rec in &allocations {
                        @let a = &rec.allocation;
                        tr {
                            td { (a.id) }
                            td { (job_link(a.job)) }
                            td { (p.cluster.job(a.job).map_or("", |j| j.spec.tenant.as_str())) }
                            td {
                                @if a.gpu_milli > 0 { (gpus(u64::from(a.gpu_milli))) " of " }
                                (a.gpus.len()) @if a.gpus.len() == 1 && a.gpu_milli == 0 { " GPU" } @else if a.gpu_milli == 0 { " GPUs" } @else { " GPU" }
                            }
                            td { (ago(a.created_at, p.view.now)) " ago" }
                            td { @if rec.stop_requested { "stopping" } @else if rec.started { "running" } @else { "starting" } }
                        }
                    }
                }
            }
        }
    };
    Some(page(&p.view, "/nodes", &format!("Node {name}"), body))
}

/// The 404 page for a node that is not registered.
pub fn render_missing_node(p: &Page, name: &str) -> String {
    not_found(
        &p.view,
        "/nodes",
        &format!("No node named {name:?} is registered."),
    )
}
