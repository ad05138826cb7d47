//! Whether a job could ever run on the cluster, and why it cannot run now: node by node, the
//! first filter that turns a task of the job away (Kubernetes' "0/3 nodes are available: 2
//! Insufficient nvidia.com/gpu, 1 node(s) didn't match node selector"), counted per filter.
//!
//! Two questions, both pure (no clock, no I/O):
//! - [`never_fits`]: with every GPU healthy and nothing running, could the registered nodes
//!   hold every task? Admission refuses a job that fails it (unless held with
//!   `hold_if_unfit`), and the pass does not make such a job the head of the queue (it would
//!   take the backfill reservation from a job that can run).
//! - [`diagnose`]: why no node takes a task now (down, drained, partition, model, GPUs busy,
//!   unhealthy, CPU, memory), and the node that comes closest, for `gpuctl why`.
//!
//! A few simplifications keep this cheap and are fine for an explanation, never for a
//! placement: a `--single-numa` task counts whole NUMA nodes' GPUs without the topology check
//! for GPUs of unknown NUMA node, and shares count per GPU without the packing order.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::placement::Shape;
use crate::state::free::NodeFree;
use crate::state::{ClusterState, GpuHealth, Node, NodeStatus, share_memory_for};

/// Why a node turns a task away: the first filter that fails, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Filter {
    Down,
    Drained,
    /// Not in the job's `--nodelist`.
    NotListed,
    /// In the job's `--exclude`.
    Excluded,
    Partition,
    Container,
    /// Hands out no host ports, and the task asks for named ports.
    NoPorts,
    Model,
    MigProfile,
    TooFewGpus,
    GpuMemory,
    TooFewCpus,
    TooLittleMemory,
    Unhealthy,
    GpusBusy,
    CpusBusy,
    MemoryBusy,
    /// Runs other work, and the job wants its nodes to itself (`--exclusive`).
    NotIdle,
}

impl Filter {
    /// The filter as a count reads: "2 GPUs busy".
    pub fn label(self) -> &'static str {
        match self {
            Filter::Down => "down",
            Filter::Drained => "draining",
            Filter::NotListed => "not in --nodelist",
            Filter::Excluded => "excluded",
            Filter::Partition => "other partition",
            Filter::Container => "no container engine",
            Filter::NoPorts => "no service ports",
            Filter::Model => "other GPU model",
            Filter::MigProfile => "no such MIG profile",
            Filter::TooFewGpus => "too few GPUs",
            Filter::GpuMemory => "too little GPU memory",
            Filter::TooFewCpus => "too few CPUs",
            Filter::TooLittleMemory => "too little memory",
            Filter::Unhealthy => "unhealthy GPUs",
            Filter::GpusBusy => "GPUs busy",
            Filter::CpusBusy => "CPUs busy",
            Filter::MemoryBusy => "memory busy",
            Filter::NotIdle => "not idle (--exclusive)",
        }
    }

    /// A filter that only a change of the node (its hardware, partition, engine) lifts.
    pub fn is_static(self) -> bool {
        matches!(
            self,
            Filter::Partition
                | Filter::NotListed
                | Filter::Excluded
                | Filter::Container
                | Filter::NoPorts
                | Filter::Model
                | Filter::MigProfile
                | Filter::TooFewGpus
                | Filter::GpuMemory
                | Filter::TooFewCpus
                | Filter::TooLittleMemory
        )
    }
}

/// What one GPU position offers a task, in one view of the node (capacity, healthy, free now).
#[derive(Clone, Copy)]
struct GpuOffer {
    /// Free milli of the GPU as a whole GPU or for shares (0: MIG mode, held or excluded).
    milli: u32,
    memory_mib: u64,
}

/// Tasks of `shape` that GPU offers allow (`u32::MAX` when the task takes no GPU).
fn gpu_tasks(
    node: &Node,
    shape: &Shape,
    offer: &dyn Fn(usize) -> GpuOffer,
    slice_free: &dyn Fn(usize, usize) -> bool,
) -> u32 {
    if shape.gpus == 0 {
        return u32::MAX;
    }
    let gpus = &node.spec.gpus;
    let model_ok = |p: usize| shape.models.is_empty() || shape.models.contains(&gpus[p].model);
    let numa = |p: usize| {
        if shape.single_numa {
            gpus[p].numa_node
        } else {
            None
        }
    };
    let k = shape.gpus as u64;
    if let Some(profile) = &shape.mig_profile {
        let mut per_numa: BTreeMap<Option<u32>, u64> = BTreeMap::new();
        for (p, g) in gpus.iter().enumerate().filter(|(p, _)| model_ok(*p)) {
            let n = g
                .mig
                .iter()
                .enumerate()
                .filter(|(s, m)| &m.profile == profile && slice_free(p, *s))
                .count() as u64;
            *per_numa.entry(numa(p)).or_default() += n;
        }
        return per_numa
            .values()
            .map(|n| n / k)
            .sum::<u64>()
            .min(u64::from(u32::MAX)) as u32;
    }
    if shape.gpu_milli > 0 {
        let mut tasks = 0u64;
        for p in (0..gpus.len()).filter(|&p| model_ok(p)) {
            let o = offer(p);
            let want = share_memory_for(shape.gpu_milli, shape.gpu_memory_mib, gpus[p].memory_mib);
            if want > gpus[p].memory_mib {
                continue;
            }
            let by_milli = u64::from(o.milli / shape.gpu_milli);
            let by_memory = o.memory_mib.checked_div(want).unwrap_or(u64::MAX);
            tasks += by_milli.min(by_memory);
        }
        return tasks.min(u64::from(u32::MAX)) as u32;
    }
    let mut per_numa: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for p in (0..gpus.len()).filter(|&p| model_ok(p) && offer(p).milli >= 1000) {
        *per_numa.entry(numa(p)).or_default() += 1;
    }
    per_numa
        .values()
        .map(|n| n / k)
        .sum::<u64>()
        .min(u64::from(u32::MAX)) as u32
}

fn ratio(have: u64, want: u64) -> u32 {
    have.checked_div(want)
        .unwrap_or(u64::MAX)
        .min(u64::from(u32::MAX)) as u32
}

/// Tasks of `shape` the node could hold with every GPU healthy and nothing running, or the
/// first filter that turns every task away.
pub fn capacity_of(node: &Node, shape: &Shape) -> Result<u32, Filter> {
    let spec = &node.spec;
    if !shape.allows_node(&spec.name) {
        let excluded = shape
            .excluded_nodes
            .binary_search_by(|n| n.as_str().cmp(&spec.name))
            .is_ok();
        return Err(if excluded {
            Filter::Excluded
        } else {
            Filter::NotListed
        });
    }
    if let Some(p) = &shape.partition
        && spec.partition.as_deref() != Some(p.as_str())
    {
        return Err(Filter::Partition);
    }
    if shape.container && spec.container_runtime.is_empty() {
        return Err(Filter::Container);
    }
    if shape.ports && spec.service_ports.is_none() {
        return Err(Filter::NoPorts);
    }
    if shape.gpus > 0 {
        let model_ok =
            |g: &crate::state::Gpu| shape.models.is_empty() || shape.models.contains(&g.model);
        if !spec.gpus.iter().any(model_ok) {
            return Err(Filter::Model);
        }
        if let Some(profile) = &shape.mig_profile
            && !spec
                .gpus
                .iter()
                .filter(|g| model_ok(g))
                .any(|g| g.mig.iter().any(|m| &m.profile == profile))
        {
            return Err(Filter::MigProfile);
        }
    }
    let whole = |p: usize| {
        let g = &spec.gpus[p];
        GpuOffer {
            milli: if g.mig.is_empty() { 1000 } else { 0 },
            memory_mib: if g.mig.is_empty() { g.memory_mib } else { 0 },
        }
    };
    let gpu = gpu_tasks(node, shape, &whole, &|_, _| true);
    if gpu == 0 {
        return Err(if shape.gpu_milli > 0 {
            Filter::GpuMemory
        } else {
            Filter::TooFewGpus
        });
    }
    let cpu = ratio(spec.cpu_milli, shape.cpu_milli);
    if cpu == 0 {
        return Err(Filter::TooFewCpus);
    }
    let memory = ratio(spec.memory_mib, shape.memory_mib);
    if memory == 0 {
        return Err(Filter::TooLittleMemory);
    }
    Ok(gpu.min(cpu).min(memory))
}

/// Tasks of `shape` the node holds now, with what is free on it, or the first filter that
/// turns every task away (its status, the static filters, unhealthy GPUs, then busy ones).
pub fn fits_now(node: &Node, free: &NodeFree, shape: &Shape) -> Result<u32, Filter> {
    match node.status {
        NodeStatus::Down => return Err(Filter::Down),
        NodeStatus::Drained => return Err(Filter::Drained),
        NodeStatus::Ready => {}
    }
    capacity_of(node, shape)?;
    let spec = &node.spec;
    let healthy = |p: usize| {
        let g = &spec.gpus[p];
        let ok = g.mig.is_empty() && g.health == GpuHealth::Healthy;
        GpuOffer {
            milli: if ok { 1000 } else { 0 },
            memory_mib: if ok { g.memory_mib } else { 0 },
        }
    };
    let healthy_slice = |p: usize, _| spec.gpus[p].health == GpuHealth::Healthy;
    if gpu_tasks(node, shape, &healthy, &healthy_slice) == 0 {
        return Err(Filter::Unhealthy);
    }
    if shape.exclusive && *free != NodeFree::capacity(node) {
        return Err(Filter::NotIdle);
    }
    let now = |p: usize| GpuOffer {
        milli: free.gpu_milli.get(p).copied().unwrap_or(0),
        memory_mib: free.gpu_memory_mib.get(p).copied().unwrap_or(0),
    };
    let slice_now = |p: usize, s: usize| {
        p < crate::state::free::MAX_GPUS
            && s < crate::state::free::MAX_SLICES
            && free
                .slices()
                .any(|(g, t)| g as usize == p && t as usize == s)
    };
    let gpu = gpu_tasks(node, shape, &now, &slice_now);
    if gpu == 0 {
        return Err(Filter::GpusBusy);
    }
    let cpu = ratio(free.cpu_milli, shape.cpu_milli);
    if cpu == 0 {
        return Err(Filter::CpusBusy);
    }
    let memory = ratio(free.memory_mib, shape.memory_mib);
    if memory == 0 {
        return Err(Filter::MemoryBusy);
    }
    Ok(gpu.min(cpu).min(memory))
}

/// Per filter, how many nodes it turned away; for display in filter order.
pub type FilterCounts = BTreeMap<Filter, u32>;

/// "1 GPUs busy, 1 draining".
pub fn counts_text(counts: &FilterCounts) -> String {
    let mut out = String::new();
    for (f, n) in counts {
        if !out.is_empty() {
            out.push_str(", ");
        }
        let _ = write!(out, "{n} {}", f.label());
    }
    out
}

/// What one task asks for, as a person says it: "8 H100", "2 1g.10gb MIG slices".
pub fn task_text(shape: &Shape) -> String {
    let models = if shape.models.is_empty() {
        None
    } else {
        Some(shape.models.join("|"))
    };
    let gpus = if let Some(p) = &shape.mig_profile {
        Some(format!("{} {p} MIG slice(s)", shape.gpus))
    } else if shape.gpu_milli > 0 {
        Some(format!(
            "a {}-milli share of a{} GPU",
            shape.gpu_milli,
            models
                .as_deref()
                .map(|m| format!(" {m}"))
                .unwrap_or_default()
        ))
    } else if shape.gpus > 0 {
        Some(format!(
            "{} {}",
            shape.gpus,
            models.as_deref().unwrap_or("GPUs")
        ))
    } else {
        None
    };
    let mut parts: Vec<String> = gpus.into_iter().collect();
    if shape.cpu_milli > 0 {
        parts.push(format!("{} CPUs", milli_text(shape.cpu_milli)));
    }
    if shape.memory_mib > 0 {
        parts.push(format!("{} MiB memory", shape.memory_mib));
    }
    parts.join(", ")
}

fn milli_text(milli: u64) -> String {
    if milli.is_multiple_of(1000) {
        (milli / 1000).to_string()
    } else {
        format!("{:.3}", milli as f64 / 1000.0)
    }
}

/// Why no set of registered nodes could ever hold the job: `PartitionEmpty` or `Unfit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NeverFits {
    /// The job names a partition that has no node.
    PartitionEmpty { partition: String },
    /// The nodes could hold `at_most` of its tasks (0: none), for the reasons counted.
    Unfit {
        at_most: u32,
        nodes: u32,
        counts: FilterCounts,
        /// The largest node's CPUs (milli), memory (MiB) and GPUs, for the message.
        largest: (u64, u64, usize),
    },
}

impl NeverFits {
    /// The reason's label: `PartitionEmpty` or `Unfit`.
    pub fn label(&self) -> &'static str {
        match self {
            NeverFits::PartitionEmpty { .. } => "PartitionEmpty",
            NeverFits::Unfit { .. } => "Unfit",
        }
    }

    /// What would have to change, in a sentence.
    pub fn text(&self, shape: &Shape, tasks: u32) -> String {
        match self {
            NeverFits::PartitionEmpty { partition } => {
                format!("partition {partition} has no nodes")
            }
            NeverFits::Unfit {
                at_most: 0,
                nodes,
                counts,
                largest,
            } => {
                let mut why = counts_text(counts);
                let (cpu, mem, gpus) = largest;
                if counts.contains_key(&Filter::TooFewGpus) {
                    let _ = write!(why, "; the largest node has {gpus} GPUs");
                }
                if counts.contains_key(&Filter::TooFewCpus) {
                    let _ = write!(why, "; the largest node has {} CPUs", milli_text(*cpu));
                }
                if counts.contains_key(&Filter::TooLittleMemory) {
                    let _ = write!(why, "; the largest node has {mem} MiB of memory");
                }
                format!(
                    "no node can ever hold a task of {} (0/{nodes} nodes: {why})",
                    task_text(shape)
                )
            }
            NeverFits::Unfit { at_most, nodes, .. } => format!(
                "its {tasks} tasks of {} need more than the cluster has: its {nodes} nodes can \
                 hold at most {at_most} such tasks at once",
                task_text(shape)
            ),
        }
    }
}

/// Whether the nodes of `state` could ever hold every task of a job of `shape` (every GPU
/// healthy, nothing running, any status: a node that is down may return). `None`: they
/// could, or no node is registered yet (nothing to judge by). Stops at the first nodes that
/// are enough, so a job that fits costs a few nodes' checks.
pub fn never_fits<'a>(
    nodes: impl Iterator<Item = &'a Node>,
    shape: &Shape,
    tasks: u32,
) -> Option<NeverFits> {
    let mut total = 0u32;
    let mut seen = 0u32;
    let mut counts = FilterCounts::new();
    let mut largest = (0u64, 0u64, 0usize);
    let mut in_partition = false;
    for node in nodes {
        seen += 1;
        if shape
            .partition
            .as_ref()
            .is_none_or(|p| node.spec.partition.as_deref() == Some(p.as_str()))
        {
            in_partition = true;
        }
        match capacity_of(node, shape) {
            Ok(n) => {
                total = total.saturating_add(n.min(tasks));
                if total >= tasks {
                    return None;
                }
            }
            Err(f) => {
                *counts.entry(f).or_default() += 1;
                largest.0 = largest.0.max(node.spec.cpu_milli);
                largest.1 = largest.1.max(node.spec.memory_mib);
                largest.2 = largest.2.max(node.spec.gpus.len());
            }
        }
    }
    if seen == 0 {
        return None;
    }
    if !in_partition && let Some(p) = &shape.partition {
        return Some(NeverFits::PartitionEmpty {
            partition: p.clone(),
        });
    }
    Some(NeverFits::Unfit {
        at_most: total,
        nodes: seen,
        counts,
        largest,
    })
}

/// The job's fit against the state as it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnosis {
    pub nodes: u32,
    /// Nodes with room for at least one task now.
    pub nodes_with_room: u32,
    /// Tasks the nodes hold now (capped at the job's tasks).
    pub tasks_now: u32,
    /// Why the other nodes turned a task away.
    pub counts: FilterCounts,
    /// The ready node that passes the static filters with the most free GPU units (then
    /// CPU) for the task: where the job comes closest to running.
    pub closest: Option<String>,
}

impl Diagnosis {
    /// No node is busy or fits: only down, drained or unhealthy ones could hold it.
    pub fn only_unhealthy(&self) -> bool {
        self.nodes_with_room == 0
            && !self.counts.is_empty()
            && self
                .counts
                .keys()
                .filter(|f| !f.is_static())
                .all(|f| matches!(f, Filter::Down | Filter::Drained | Filter::Unhealthy))
            && self
                .counts
                .keys()
                .any(|f| matches!(f, Filter::Down | Filter::Drained | Filter::Unhealthy))
    }

    /// "0/2 nodes have 8 free H100 (1 GPUs busy, 1 draining)".
    pub fn text(&self, shape: &Shape, tasks: u32) -> String {
        let mut out = format!(
            "{}/{} nodes have {}",
            self.nodes_with_room,
            self.nodes,
            free_text(shape)
        );
        if tasks > 1 && self.tasks_now > 0 {
            let _ = write!(out, ", room for {} of its {tasks} tasks", self.tasks_now);
        }
        if !self.counts.is_empty() {
            let _ = write!(out, " ({})", counts_text(&self.counts));
        }
        out
    }
}

/// "8 free H100", "room for 4 CPUs".
fn free_text(shape: &Shape) -> String {
    if shape.gpus == 0 {
        return format!("room for {}", task_text(shape));
    }
    if shape.mig_profile.is_none() && shape.gpu_milli == 0 {
        let models = if shape.models.is_empty() {
            "GPUs".to_owned()
        } else {
            shape.models.join("|")
        };
        return format!("{} free {models}", shape.gpus);
    }
    format!("{} free", task_text(shape))
}

/// Free GPU units of the task's kind on a node now (for "closest node"), then its CPU.
fn closeness(node: &Node, free: &NodeFree, shape: &Shape) -> (u32, u64) {
    let one = Shape {
        gpus: shape.gpus.min(1),
        cpu_milli: 0,
        memory_mib: 0,
        single_numa: false,
        ..shape.clone()
    };
    let now = |p: usize| GpuOffer {
        milli: free.gpu_milli.get(p).copied().unwrap_or(0),
        memory_mib: free.gpu_memory_mib.get(p).copied().unwrap_or(0),
    };
    let slice_now = |p: usize, s: usize| {
        free.slices()
            .any(|(g, t)| g as usize == p && t as usize == s)
    };
    let units = if shape.gpus == 0 {
        0
    } else {
        gpu_tasks(node, &one, &now, &slice_now)
    };
    (units, free.cpu_milli)
}

/// Why the job does not fit now, node by node (O(nodes): for one job's explanation, or once
/// per shape of a listing).
pub fn diagnose(state: &ClusterState, shape: &Shape, tasks: u32) -> Diagnosis {
    let mut d = Diagnosis {
        nodes: 0,
        nodes_with_room: 0,
        tasks_now: 0,
        counts: FilterCounts::new(),
        closest: None,
    };
    let mut best: Option<((u32, u64), &str)> = None;
    for node in state.nodes.values() {
        d.nodes += 1;
        let capacity;
        let free = match state.index.node_free.get(&node.spec.name) {
            Some(f) => f,
            None => {
                capacity = NodeFree::capacity(node);
                &capacity
            }
        };
        match fits_now(node, free, shape) {
            Ok(n) => {
                d.nodes_with_room += 1;
                d.tasks_now = d.tasks_now.saturating_add(n).min(tasks);
            }
            Err(f) => *d.counts.entry(f).or_default() += 1,
        }
        if node.status == NodeStatus::Ready && capacity_of(node, shape).is_ok() {
            let c = closeness(node, free, shape);
            if best.is_none_or(|(b, _)| c > b) {
                best = Some((c, node.spec.name.as_str()));
            }
        }
    }
    d.closest = best.map(|(_, n)| n.to_owned());
    d
}

/// Admission: why a job that no node of the cluster could ever hold is refused (`None`: it
/// could, it is held with `hold_if_unfit`, or no node is registered yet). The API asks before
/// it proposes, so a refusal adds nothing to the log. Not asked again at apply: the nodes a
/// replica knows are the leader's as of the same entry, but earlier binaries did not refuse
/// these jobs there, and entries they accepted must apply alike everywhere.
pub fn admission_refusal(
    state: &ClusterState,
    spec: &crate::state::JobSpec,
) -> Option<crate::state::Rejection> {
    if spec.hold_if_unfit {
        return None;
    }
    let shape = Shape::of(spec);
    let never = never_fits(state.nodes.values(), &shape, spec.tasks)?;
    let field = match &never {
        NeverFits::PartitionEmpty { .. } => "partition",
        NeverFits::Unfit { .. } => "resources",
    };
    Some(crate::state::Rejection::invalid(
        field,
        format!(
            "{}: {}; the job could never run (submit with --hold-if-unfit to keep it pending \
             until a node that fits joins)",
            never.label(),
            never.text(&shape, spec.tasks)
        ),
    ))
}
