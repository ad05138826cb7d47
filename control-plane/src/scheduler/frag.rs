//! The fragmentation measure of FGD (Weng et al., "Beware of Fragmentation: Scheduling
//! GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC '23).
//!
//! Free GPU capacity is *fragmented for a task* when the task cannot use it: all of a node's
//! free GPU milli when the task cannot run there at all (too little CPU or memory, the wrong GPU
//! model, not enough GPUs with enough free milli), and otherwise the free milli on the GPUs that
//! have less free than the task needs on one GPU. A node's fragmentation is the expectation of
//! that amount over a target [`Workload`]: the task types the cluster runs, with their
//! frequencies. FGD places each task where this expectation grows least.
//!
//! As in the paper's artifact, a CPU-only task type counts all of a node's free GPU milli as
//! fragmented (it can never use a GPU); this adds the same amount to every placement of a given
//! task, so it shifts scores without changing which node wins.
//!
//! Pure code: no I/O, no clock.

use std::collections::BTreeMap;

use super::score::{Demand, FULL_GPU_MILLI, NodeResources};

/// One task type of a workload, with its share of the workload's tasks.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskType {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// 0 for CPU-only types.
    pub gpus: u32,
    /// Milli per GPU: 1000 for whole GPUs, less for a share; 0 for CPU-only types.
    pub milli_per_gpu: u32,
    /// Acceptable GPU models, sorted; empty: any (always empty for CPU-only types).
    pub models: Vec<String>,
    /// Frequency among the workload's tasks; a workload's weights sum to 1.
    pub weight: f64,
}

impl TaskType {
    pub fn demand(&self) -> Demand<'_> {
        Demand {
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
            gpus: self.gpus,
            milli_per_gpu: self.milli_per_gpu,
            models: &self.models,
        }
    }
}

/// The target workload: task types and how often each occurs. Built from observed or expected
/// demands; identical demands merge into one type.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Most frequent first (ties: smaller CPU, then GPU milli, GPUs, memory, models).
    types: Vec<TaskType>,
    /// Each type's weight in fixed point (units of 2^-32), what `fragmentation` sums with.
    units: Vec<u64>,
    /// CPU milli the workload's GPU tasks ask per GPU milli (ratio of the frequency-weighted
    /// sums; 0 without GPU types): what filling a node's free GPUs will cost in CPU, the
    /// look-ahead of [`stranded`].
    cpu_per_gpu_milli: f64,
    /// Memory MiB per GPU milli, likewise.
    mem_per_gpu_milli: f64,
    /// GPU milli of a GPU task, on average.
    gpu_milli_per_task: f64,
    /// Variance of a GPU task's CPU beyond its GPU share at the mean ratio,
    /// `E[(cpu − ratio × gpu milli)²]`: how far the CPU that fills a node's GPUs strays from
    /// the ratio.
    cpu_residual_var: f64,
    /// Likewise for memory.
    mem_residual_var: f64,
    /// The horizon of [`horizon_waste`]: GPU tasks that arrive, on average, while the
    /// workload's shares take one whole GPU's worth of milli (`1000 / E[share milli per GPU
    /// task]`); infinite without shares.
    horizon_tasks: f64,
    /// Indexes of the GPU types by milli per GPU, ascending (ties: index order), so that the
    /// weight of the types a fragment is too small for is a suffix sum.
    by_need: Vec<usize>,
}

impl Default for Workload {
    /// No task types (and so an unbounded horizon: no shares).
    fn default() -> Self {
        Workload::with_types(Vec::new())
    }
}

/// Fixed-point scale of the weights in `fragmentation`.
const WEIGHT_SCALE: f64 = (1u64 << 32) as f64;

/// The key identical demands share.
type TypeKey = (u64, u32, u32, u64, Vec<String>);

fn key_of(d: &Demand) -> TypeKey {
    if d.uses_gpu() {
        let mut models: Vec<String> = d.models.to_vec();
        models.sort();
        models.dedup();
        (
            d.cpu_milli,
            d.milli_per_gpu.min(FULL_GPU_MILLI),
            d.gpus,
            d.memory_mib,
            models,
        )
    } else {
        (d.cpu_milli, 0, 0, d.memory_mib, Vec::new())
    }
}

impl Workload {
    /// One task per demand; identical demands (same CPU, memory, GPUs, milli and set of models)
    /// merge into one type whose weight is its share of the demands.
    pub fn from_demands<'a>(demands: impl IntoIterator<Item = Demand<'a>>) -> Workload {
        Workload::from_weighted(demands.into_iter().map(|d| (d, 1.0)))
    }

    /// Demands with relative weights (any positive scale; non-positive weights are dropped);
    /// identical demands merge, weights are normalised to sum to 1.
    pub fn from_weighted<'a>(demands: impl IntoIterator<Item = (Demand<'a>, f64)>) -> Workload {
        let mut merged: BTreeMap<TypeKey, f64> = BTreeMap::new();
        for (d, w) in demands {
            if w > 0.0 && w.is_finite() {
                *merged.entry(key_of(&d)).or_default() += w;
            }
        }
        let total: f64 = merged.values().sum();
        let mut types: Vec<TaskType> = merged
            .into_iter()
            .map(|((cpu, milli, gpus, mem, models), w)| TaskType {
                cpu_milli: cpu,
                memory_mib: mem,
                gpus,
                milli_per_gpu: milli,
                models,
                weight: w / total,
            })
            .collect();
        // The BTreeMap order is the tie-break (a stable sort keeps it).
        types.sort_by(|a, b| b.weight.total_cmp(&a.weight));
        Workload::with_types(types)
    }

    fn with_types(types: Vec<TaskType>) -> Workload {
        let units = types
            .iter()
            .map(|t| (t.weight * WEIGHT_SCALE).round() as u64)
            .collect();
        let (mut cpu, mut mem, mut gpu) = (0.0, 0.0, 0.0);
        // GPU task types only: CPU-only tasks take no GPU, and where they go is the policy's
        // choice (the look-ahead steers them to nodes with CPU to spare).
        let gpu_types = || types.iter().filter(|t| t.gpus > 0 && t.milli_per_gpu > 0);
        for t in gpu_types() {
            let g = f64::from(t.gpus) * f64::from(t.milli_per_gpu);
            cpu += t.weight * t.cpu_milli as f64;
            mem += t.weight * t.memory_mib as f64;
            gpu += t.weight * g;
        }
        let per_gpu = |x: f64| if gpu > 0.0 { x / gpu } else { 0.0 };
        let (rc, rm) = (per_gpu(cpu), per_gpu(mem));
        let (mut vc, mut vm, mut wsum) = (0.0, 0.0, 0.0);
        for t in gpu_types() {
            let g = f64::from(t.gpus) * f64::from(t.milli_per_gpu);
            vc += t.weight * (t.cpu_milli as f64 - rc * g).powi(2);
            vm += t.weight * (t.memory_mib as f64 - rm * g).powi(2);
            wsum += t.weight;
        }
        let per_task = |x: f64| if wsum > 0.0 { x / wsum } else { 0.0 };
        // Share milli per GPU task: the GPU tasks of one GPU's worth of shares are the
        // horizon.
        let share_milli: f64 = gpu_types()
            .filter(|t| t.milli_per_gpu < FULL_GPU_MILLI)
            .map(|t| t.weight * f64::from(t.gpus) * f64::from(t.milli_per_gpu))
            .sum();
        let horizon_tasks = if share_milli > 0.0 && wsum > 0.0 {
            (f64::from(FULL_GPU_MILLI) * wsum / share_milli).max(1.0)
        } else {
            f64::INFINITY
        };
        let mut by_need: Vec<usize> = (0..types.len())
            .filter(|&i| types[i].gpus > 0 && types[i].milli_per_gpu > 0)
            .collect();
        by_need.sort_by_key(|&i| (types[i].milli_per_gpu.min(FULL_GPU_MILLI), i));
        Workload {
            types,
            units,
            cpu_per_gpu_milli: rc,
            mem_per_gpu_milli: rm,
            gpu_milli_per_task: per_task(gpu),
            cpu_residual_var: per_task(vc),
            mem_residual_var: per_task(vm),
            horizon_tasks,
            by_need,
        }
    }

    /// CPU milli the workload's GPU tasks ask per GPU milli (0 without GPU types).
    pub fn cpu_per_gpu_milli(&self) -> f64 {
        self.cpu_per_gpu_milli
    }

    /// Memory MiB the workload's GPU tasks ask per GPU milli (0 without GPU types).
    pub fn mem_per_gpu_milli(&self) -> f64 {
        self.mem_per_gpu_milli
    }

    /// The look-ahead horizon of [`horizon_waste`], in GPU tasks: `1000 / E[share milli]`
    /// over the GPU tasks (at least 1; infinite for a workload without shares).
    pub fn horizon_tasks(&self) -> f64 {
        self.horizon_tasks
    }

    /// The most frequent types that together make up at least `coverage` (0..=1) of the tasks,
    /// re-weighted to sum to 1: the artifact's "typical pods" (it keeps 95%), which drops the
    /// long tail of rare shapes from the expectation.
    pub fn typical(&self, coverage: f64) -> Workload {
        let mut kept = Vec::new();
        let mut cumulative = 0.0;
        for t in &self.types {
            // A small tolerance so that e.g. 0.95 of 100 equal tasks keeps 95 types, not 96.
            if !kept.is_empty() && cumulative >= coverage - 1e-9 {
                break;
            }
            cumulative += t.weight;
            kept.push(t.clone());
        }
        for t in &mut kept {
            t.weight /= cumulative;
        }
        Workload::with_types(kept)
    }

    pub fn types(&self) -> &[TaskType] {
        &self.types
    }

    pub fn len(&self) -> usize {
        self.types.len()
    }

    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }
}

/// How a node relates to one task type: the artifact's categories, with memory counted
/// alongside CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// The task needs GPUs of another model.
    NoAccess,
    /// Q1: neither enough CPU/memory nor enough GPU.
    LackBoth,
    /// Q2: enough CPU and memory, not enough GPU.
    LackGpu,
    /// Q3: the task fits; only GPUs with less free than it needs are fragmented for it.
    Satisfied,
    /// Q4: enough GPU, not enough CPU or memory.
    LackCpu,
    /// XL: a CPU-only task that fits (all free GPU milli still counts: it cannot use them).
    CpuOnlySatisfied,
    /// XR: a CPU-only task that does not fit.
    CpuOnlyLackCpu,
}

/// The category of `node` for a task of shape `task`.
pub fn classify(node: &NodeResources, task: &Demand) -> Category {
    let cpu_ok = node.cpu_milli >= task.cpu_milli && node.memory_mib >= task.memory_mib;
    if !task.uses_gpu() {
        return if cpu_ok {
            Category::CpuOnlySatisfied
        } else {
            Category::CpuOnlyLackCpu
        };
    }
    if !task.accepts_model(node.model) {
        return Category::NoAccess;
    }
    let need = task.milli_per_gpu.min(FULL_GPU_MILLI);
    let gpu_ok = node.gpu_milli.iter().filter(|&&m| m >= need).count() >= task.gpus as usize;
    match (cpu_ok, gpu_ok) {
        (true, true) => Category::Satisfied,
        (false, true) => Category::LackCpu,
        (true, false) => Category::LackGpu,
        (false, false) => Category::LackBoth,
    }
}

/// GPU milli on `node` that a task of shape `task` could not use: all free milli unless the
/// task fits ([`Category::Satisfied`]), then the free milli of GPUs with less free than the
/// task needs per GPU.
pub fn task_fragmentation(node: &NodeResources, task: &Demand) -> u64 {
    let total = node.free_gpu_milli();
    if total == 0 {
        return 0;
    }
    match classify(node, task) {
        Category::Satisfied => {
            let need = task.milli_per_gpu.min(FULL_GPU_MILLI);
            node.gpu_milli
                .iter()
                .filter(|&&m| m < need)
                .map(|&m| u64::from(m))
                .sum()
        }
        _ => total,
    }
}

/// Expected GPU milli on `node` that a task drawn from `workload` could not use:
/// `Σ weight × task_fragmentation`. Zero on a node without free GPU milli.
///
/// Computed in fixed point (weights rounded to multiples of 2^-32, exact integer sums), so the
/// result is exact and placements whose fragmentation changes by the same amount get exactly
/// equal scores: float rounding must not break ties between nodes (it would, systematically,
/// in favour of particular node states).
pub fn fragmentation(node: &NodeResources, workload: &Workload) -> f64 {
    let total = node.free_gpu_milli();
    if total == 0 {
        return 0.0;
    }
    let mut frag: u128 = 0;
    for (t, &units) in workload.types.iter().zip(&workload.units) {
        // A CPU-only task can use none of the free GPU capacity; a task that cannot run here at
        // all (CPU, memory, model) neither.
        let amount = if t.gpus == 0
            || t.milli_per_gpu == 0
            || node.cpu_milli < t.cpu_milli
            || node.memory_mib < t.memory_mib
            || !(t.models.is_empty() || t.models.iter().any(|m| m == node.model))
        {
            total
        } else {
            // One pass: GPUs that fit the task, and the milli on those that do not.
            let need = t.milli_per_gpu.min(FULL_GPU_MILLI);
            let mut fitting = 0u32;
            let mut unusable = 0u64;
            for &m in node.gpu_milli {
                if m >= need {
                    fitting += 1;
                } else {
                    unusable += u64::from(m);
                }
            }
            if fitting >= t.gpus { unusable } else { total }
        };
        frag += u128::from(units) * u128::from(amount);
    }
    // Exact below 2^53, i.e. for nodes with less than about two million free milli.
    frag as f64 / WEIGHT_SCALE
}

/// Free GPU milli on `node` that the workload's GPU tasks are expected to leave unused for
/// want of CPU or memory: a look-ahead over the arrival distribution where FGD's measure only
/// asks whether the *next* task fits.
///
/// Filling the node's `T` free GPU milli takes about `n = T / ḡ` tasks (`ḡ`: the workload's
/// mean GPU milli per task), which ask for CPU `D ≈ ρT + ε`: `ρ` the workload's CPU per GPU
/// milli, `ε` the sum of the `n` tasks' residuals `cpu − ρ·gpu` (mean 0, variance `n·σ²`,
/// taken as normal). The CPU short of that, `E[max(0, D − C)]` for `C` free CPU, strands
/// `E[max(0, D − C)] / ρ` GPU milli. Likewise for memory; the larger of the two counts, at
/// most `T`. No constant is chosen: `ρ`, `ḡ` and `σ²` are the workload's. 0 for a workload
/// without GPU types.
pub fn stranded(node: &NodeResources, workload: &Workload) -> f64 {
    let total = node.free_gpu_milli();
    if total == 0 || workload.gpu_milli_per_task <= 0.0 {
        return 0.0;
    }
    let t = total as f64;
    let n = t / workload.gpu_milli_per_task;
    let short = |free: u64, ratio: f64, var: f64| -> f64 {
        if ratio <= 0.0 {
            return 0.0;
        }
        let mean = ratio * t - free as f64;
        let sd = (n * var).sqrt();
        expected_positive_part(mean, sd) / ratio
    };
    let s = short(
        node.cpu_milli,
        workload.cpu_per_gpu_milli,
        workload.cpu_residual_var,
    )
    .max(short(
        node.memory_mib,
        workload.mem_per_gpu_milli,
        workload.mem_residual_var,
    ));
    s.min(t)
}

/// `E[max(0, X)]` for `X ~ N(mean, sd²)` (`max(0, mean)` when `sd` is 0).
fn expected_positive_part(mean: f64, sd: f64) -> f64 {
    if sd <= 0.0 {
        return mean.max(0.0);
    }
    let z = mean / sd;
    let pdf = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
    mean * normal_cdf(z) + sd * pdf
}

/// The standard normal CDF, through `erfc` (`libm`, a port of musl's).
fn normal_cdf(z: f64) -> f64 {
    0.5 * libm::erfc(-z / std::f64::consts::SQRT_2)
}

/// FGD's expected fragmentation ([`fragmentation`]) with the look-ahead of [`stranded`]: the
/// larger of the two estimates of the free GPU milli that will go unused, the milli the next
/// task could not use and the milli the node's CPU (memory) will not stretch to. Equals
/// `fragmentation` wherever CPU and memory are not the binding constraint, so FGD's gradient
/// is left alone there; where they are, placements that use up CPU without GPUs (or with few
/// GPU milli for their CPU) cost what they will strand.
pub fn lookahead_fragmentation(node: &NodeResources, workload: &Workload) -> f64 {
    fragmentation(node, workload).max(stranded(node, workload))
}

/// Expected GPU milli of `node` left unused at the end, with a look-ahead over the arrival
/// distribution for every free fragment (each GPU's free milli), where FGD's measure only asks
/// whether the *next* task can use it; and with [`stranded`]'s look-ahead for CPU and memory
/// (the larger of the two counts).
///
/// FGD counts a fragment of `f` free milli as `f ×` the share of task types that cannot use
/// it. That penalises a 530-milli gap, which the stream's 470, 460 and 320 shares will fill,
/// more than a 190-milli gap, which almost nothing fills, and treats a fragment that a few
/// frequent types can still use (CPU running short on the node) as nearly lost. Here the
/// fragment is lost only if none of the next `k` GPU tasks can use it: with `u` the share of
/// the GPU types that cannot (too little free milli on that GPU, too little CPU or memory on
/// the node, the wrong model), with probability `u^k`. If it is used, what its first user
/// leaves (`f − m`, drawn over the types that can use it by frequency) is counted the same
/// way, so filling a gap and leaving a sliver costs what the sliver will waste, and opening a
/// whole GPU for a share is never free. A whole free GPU has no such remainder (a whole-GPU
/// task may take it), as in FGD.
///
/// `k` is the workload's: the GPU tasks that arrive while its shares take one GPU's worth of
/// milli ([`Workload::horizon_tasks`]), i.e. how many arrivals a partly used GPU can expect
/// before the shares have opened as much capacity again. Multi-GPU types that do not fit the
/// node (too few free GPUs, CPU, memory, model) count all free milli as FGD does (they need
/// the node as a whole, not one fragment), CPU-only types too (they never use a GPU: the same
/// amount for every placement of a task). With `k = 1` and no remainder this is FGD's measure.
/// Pure and cheap: one pass over the workload's types, then a binary search per fragment and
/// per type that fits a partly used GPU.
pub fn horizon_waste(node: &NodeResources, workload: &Workload) -> f64 {
    fragment_waste(node, workload).max(stranded(node, workload))
}

/// The fragment part of [`horizon_waste`].
pub fn fragment_waste(node: &NodeResources, workload: &Workload) -> f64 {
    let total = node.free_gpu_milli();
    if total == 0 {
        return 0.0;
    }
    let k = workload.horizon_tasks;
    // `linear`: weight of the types that count every free milli (CPU-only types, multi-GPU
    // types that do not fit); `blocked`: single-fragment types that cannot run here at all;
    // `needs`/`prefix`: the others by milli per GPU, with running weight sums.
    let (mut all, mut linear, mut blocked) = (0.0, 0.0, 0.0);
    for t in &workload.types {
        all += t.weight;
        if t.gpus == 0 || t.milli_per_gpu == 0 {
            linear += t.weight;
        } else if !node_fits(node, t) {
            if t.gpus > 1 {
                linear += t.weight;
            } else {
                blocked += t.weight;
            }
        }
    }
    let rest = all - linear;
    if all <= 0.0 {
        return 0.0;
    }
    if rest <= 0.0 {
        return total as f64 * linear / all;
    }
    let mut needs: Vec<u32> = Vec::with_capacity(workload.by_need.len());
    let mut prefix: Vec<f64> = Vec::with_capacity(workload.by_need.len() + 1);
    prefix.push(0.0);
    for &i in &workload.by_need {
        let t = &workload.types[i];
        if node_fits(node, t) {
            needs.push(t.milli_per_gpu.min(FULL_GPU_MILLI));
            prefix.push(prefix[prefix.len() - 1] + t.weight);
        }
    }
    let fitting = prefix[prefix.len() - 1];
    // Share of the per-fragment types that cannot use a fragment of `x` milli, and the
    // chance that none of the next `k` tasks can.
    let usable = |x: u32| needs.partition_point(|&n| n <= x);
    let lost = |x: u32| {
        let u = (blocked + fitting - prefix[usable(x)]) / rest;
        u.clamp(0.0, 1.0).powf(k)
    };
    let mut waste = 0.0;
    let mut seen: [(u32, f64); INLINE_SEEN] = [(0, 0.0); INLINE_SEEN];
    let mut n_seen = 0;
    for &f in node.gpu_milli {
        if f == 0 {
            continue;
        }
        if let Some(&(_, v)) = seen[..n_seen].iter().find(|(m, _)| *m == f) {
            waste += v;
            continue;
        }
        let q = lost(f);
        let mut v = f64::from(f) * (linear + rest * q);
        if f < FULL_GPU_MILLI && q < 1.0 {
            // The remainder its first user leaves, counted the same way.
            let n = usable(f);
            let (mut left, mut weight) = (0.0, 0.0);
            for (j, &m) in needs[..n].iter().enumerate() {
                let w = prefix[j + 1] - prefix[j];
                left += w * f64::from(f - m) * lost(f - m);
                weight += w;
            }
            if weight > 0.0 {
                v += rest * (1.0 - q) * left / weight;
            }
        }
        let v = v / all;
        if n_seen < INLINE_SEEN {
            seen[n_seen] = (f, v);
            n_seen += 1;
        }
        waste += v;
    }
    waste
}

/// Distinct fragment sizes [`fragment_waste`] remembers per node (more are recomputed).
const INLINE_SEEN: usize = 8;

/// Whether a task of type `t` fits `node` (CPU, memory, model, enough GPUs with its milli).
fn node_fits(node: &NodeResources, t: &TaskType) -> bool {
    let need = t.milli_per_gpu.min(FULL_GPU_MILLI);
    node.cpu_milli >= t.cpu_milli
        && node.memory_mib >= t.memory_mib
        && (t.models.is_empty() || t.models.iter().any(|m| m == node.model))
        && node.gpu_milli.iter().filter(|&&m| m >= need).count() >= t.gpus as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    const T4: &str = "T4";

    fn node<'a>(cpu: u64, mem: u64, gpus: &'a [u32]) -> NodeResources<'a> {
        NodeResources {
            cpu_milli: cpu,
            memory_mib: mem,
            model: T4,
            gpu_milli: gpus,
        }
    }

    fn demand(cpu: u64, mem: u64, gpus: u32, milli: u32) -> Demand<'static> {
        Demand {
            cpu_milli: cpu,
            memory_mib: mem,
            gpus,
            milli_per_gpu: milli,
            models: &[],
        }
    }

    fn single(d: Demand) -> Workload {
        Workload::from_demands([d])
    }

    // The node of most examples: 16 CPUs, 64 GiB, 4 GPUs with 1000, 1000, 500 and 200 milli
    // free (2700 in all).
    const GPUS: [u32; 4] = [1000, 1000, 500, 200];

    #[test]
    fn share_that_fits_leaves_the_smaller_gpus_fragmented() {
        let n = node(16_000, 65_536, &GPUS);
        // 600 milli fits on the two whole GPUs; 500 + 200 cannot hold it.
        let t = demand(1_000, 1_024, 1, 600);
        assert_eq!(classify(&n, &t), Category::Satisfied);
        assert_eq!(task_fragmentation(&n, &t), 700);
        assert_eq!(fragmentation(&n, &single(t)), 700.0);
        // 500 also fits on the 500 GPU: only the 200 is lost.
        assert_eq!(task_fragmentation(&n, &demand(1_000, 1_024, 1, 500)), 200);
        // 100 fits everywhere: nothing is fragmented.
        assert_eq!(task_fragmentation(&n, &demand(1_000, 1_024, 1, 100)), 0);
    }

    #[test]
    fn whole_gpu_tasks_cannot_use_partial_gpus() {
        let n = node(16_000, 65_536, &GPUS);
        assert_eq!(task_fragmentation(&n, &demand(1_000, 1_024, 1, 1000)), 700);
        assert_eq!(task_fragmentation(&n, &demand(1_000, 1_024, 2, 1000)), 700);
        // Four whole GPUs: only two are free, so nothing here is usable (Q2).
        let four = demand(1_000, 1_024, 4, 1000);
        assert_eq!(classify(&n, &four), Category::LackGpu);
        assert_eq!(task_fragmentation(&n, &four), 2700);
    }

    #[test]
    fn lack_of_cpu_or_memory_fragments_everything() {
        let n = node(16_000, 65_536, &GPUS);
        let cpu_heavy = demand(32_000, 1_024, 1, 100);
        assert_eq!(classify(&n, &cpu_heavy), Category::LackCpu);
        assert_eq!(task_fragmentation(&n, &cpu_heavy), 2700);
        let mem_heavy = demand(1_000, 100_000, 1, 100);
        assert_eq!(classify(&n, &mem_heavy), Category::LackCpu);
        assert_eq!(task_fragmentation(&n, &mem_heavy), 2700);
        let both = demand(32_000, 1_024, 4, 1000);
        assert_eq!(classify(&n, &both), Category::LackBoth);
        assert_eq!(task_fragmentation(&n, &both), 2700);
        assert_eq!(fragmentation(&n, &single(both)), 2700.0);
    }

    #[test]
    fn cpu_only_tasks_count_all_free_gpu_milli() {
        let n = node(16_000, 65_536, &GPUS);
        let fits = demand(1_000, 1_024, 0, 0);
        assert_eq!(classify(&n, &fits), Category::CpuOnlySatisfied);
        assert_eq!(task_fragmentation(&n, &fits), 2700);
        let too_big = demand(64_000, 1_024, 0, 0);
        assert_eq!(classify(&n, &too_big), Category::CpuOnlyLackCpu);
        assert_eq!(fragmentation(&n, &single(too_big)), 2700.0);
    }

    #[test]
    fn gpu_model_must_be_acceptable() {
        let n = node(16_000, 65_536, &GPUS);
        let v100 = ["V100".to_string()];
        let either = ["V100".to_string(), "T4".to_string()];
        let mut t = demand(1_000, 1_024, 1, 600);
        t.models = &v100;
        assert_eq!(classify(&n, &t), Category::NoAccess);
        assert_eq!(task_fragmentation(&n, &t), 2700);
        assert_eq!(fragmentation(&n, &single(t)), 2700.0);
        t.models = &either;
        assert_eq!(task_fragmentation(&n, &t), 700);
        assert_eq!(fragmentation(&n, &single(t)), 700.0);
    }

    #[test]
    fn expectation_weights_task_types_by_frequency() {
        let n = node(16_000, 65_536, &GPUS);
        // 2 × share 600 (700 each), 1 × four GPUs (2700), 1 × share 100 (0):
        // 0.5 × 700 + 0.25 × 2700 + 0.25 × 0 = 1025.
        let w = Workload::from_demands([
            demand(1_000, 1_024, 1, 600),
            demand(1_000, 1_024, 4, 1000),
            demand(1_000, 1_024, 1, 600),
            demand(1_000, 1_024, 1, 100),
        ]);
        assert_eq!(w.len(), 3);
        assert_eq!(fragmentation(&n, &w), 1025.0);
    }

    #[test]
    fn nodes_without_free_gpu_have_no_fragmentation() {
        let w = Workload::from_demands([demand(1_000, 1_024, 1, 600), demand(1, 1, 0, 0)]);
        assert_eq!(fragmentation(&node(16_000, 65_536, &[]), &w), 0.0);
        assert_eq!(fragmentation(&node(16_000, 65_536, &[0, 0]), &w), 0.0);
        assert_eq!(
            task_fragmentation(&node(0, 0, &[0]), &demand(1, 1, 1, 5)),
            0
        );
        assert_eq!(
            fragmentation(&node(16_000, 65_536, &GPUS), &Workload::default()),
            0.0
        );
    }

    #[test]
    fn identical_demands_merge_and_weights_sum_to_one() {
        let a = ["A".to_string(), "B".to_string()];
        let b = ["B".to_string(), "A".to_string(), "A".to_string()];
        let mut x = demand(4_000, 8_192, 1, 500);
        let mut y = x;
        x.models = &a;
        y.models = &b; // the same set of models, in another order
        let z = demand(8_000, 8_192, 2, 1000);
        let w = Workload::from_demands([x, z, y, y]);
        assert_eq!(w.len(), 2);
        let t = &w.types()[0];
        assert_eq!((t.cpu_milli, t.gpus, t.milli_per_gpu), (4_000, 1, 500));
        assert_eq!(t.models, vec!["A".to_string(), "B".to_string()]);
        assert_eq!(t.weight, 0.75);
        assert_eq!(w.types()[1].weight, 0.25);
        // CPU-only demands ignore models and milli.
        let c = Workload::from_demands([demand(1, 2, 0, 300), demand(1, 2, 3, 0)]);
        assert_eq!(c.len(), 1);
        assert_eq!((c.types()[0].gpus, c.types()[0].milli_per_gpu), (0, 0));
        // Weighted input.
        let v = Workload::from_weighted([(x, 3.0), (z, 1.0), (z, 0.0), (z, -5.0)]);
        assert_eq!(v.types()[0].weight, 0.75);
        assert_eq!(v.types()[1].weight, 0.25);
    }

    #[test]
    fn workload_ratios_come_from_its_gpu_types() {
        // Two GPU types: 1 GPU / 8 CPUs and a share of 500 / 2 CPUs, equally frequent; and a
        // CPU-only type that does not count.
        let w = Workload::from_demands([
            demand(8_000, 4_096, 1, 1000),
            demand(2_000, 1_024, 1, 500),
            demand(30_000, 1_024, 0, 0),
        ]);
        // (8000 + 2000) CPU per (1000 + 500) GPU milli.
        assert!((w.cpu_per_gpu_milli() - 10_000.0 / 1_500.0).abs() < 1e-9);
        assert!((w.mem_per_gpu_milli() - 5_120.0 / 1_500.0).abs() < 1e-9);
        assert_eq!(Workload::default().cpu_per_gpu_milli(), 0.0);
        assert_eq!(
            Workload::from_demands([demand(1_000, 1, 0, 0)]).cpu_per_gpu_milli(),
            0.0
        );
    }

    #[test]
    fn stranded_forecasts_gpus_the_cpu_will_not_stretch_to() {
        // Every GPU task: one whole GPU with 8 CPUs (no spread: the forecast is exact).
        let w = single(demand(8_000, 1_024, 1, 1000));
        let gpus = [1000, 1000, 1000, 1000];
        // 32 CPUs feed all four GPUs; 20 CPUs feed 2.5 of them: 1500 milli stranded.
        assert_eq!(stranded(&node(32_000, 65_536, &gpus), &w), 0.0);
        assert!((stranded(&node(20_000, 65_536, &gpus), &w) - 1_500.0).abs() < 1e-6);
        // Memory counts too, and the forecast never exceeds the free milli.
        assert!((stranded(&node(32_000, 2_048, &gpus), &w) - 2_000.0).abs() < 1e-6);
        assert_eq!(stranded(&node(0, 0, &gpus), &w), 4_000.0);
        assert_eq!(stranded(&node(0, 0, &[0, 0]), &w), 0.0);
        assert_eq!(stranded(&node(0, 0, &gpus), &Workload::default()), 0.0);
        // With a spread of CPU per task, a node with just enough CPU on average still expects
        // some shortfall, and more CPU means less.
        let spread = Workload::from_demands([
            demand(4_000, 1_024, 1, 1000),
            demand(12_000, 1_024, 1, 1000),
        ]);
        let tight = stranded(&node(32_000, 65_536, &gpus), &spread);
        let roomy = stranded(&node(48_000, 65_536, &gpus), &spread);
        assert!(tight > 100.0 && tight < 1_000.0, "{tight}");
        assert!(roomy < tight && roomy >= 0.0, "{roomy}");
    }

    #[test]
    fn lookahead_fragmentation_is_fgd_unless_cpu_binds() {
        let w = single(demand(8_000, 1_024, 1, 1000));
        let gpus = [1000, 1000, 500, 0];
        // Enough CPU: FGD's 500 (the half GPU a whole-GPU task cannot use).
        let roomy = node(64_000, 65_536, &gpus);
        assert_eq!(
            lookahead_fragmentation(&roomy, &w),
            fragmentation(&roomy, &w)
        );
        assert_eq!(fragmentation(&roomy, &w), 500.0);
        // 10 CPUs for 2500 free milli: 1250 stranded, more than FGD's 500.
        let tight = node(10_000, 65_536, &gpus);
        assert_eq!(fragmentation(&tight, &w), 500.0);
        assert!((lookahead_fragmentation(&tight, &w) - 1_250.0).abs() < 1e-6);
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.96) - 0.975).abs() < 1e-4);
        assert!((expected_positive_part(0.0, 1.0) - 0.398_942_28).abs() < 1e-6);
    }

    #[test]
    fn typical_keeps_the_most_frequent_types_up_to_the_coverage() {
        // Counts 50, 30, 15, 5: 95% coverage keeps the first three (50 + 30 + 15 = 95).
        let mut ds = Vec::new();
        for (n, milli) in [(5, 100), (50, 200), (15, 300), (30, 400)] {
            ds.extend(std::iter::repeat_n(demand(1_000, 1_024, 1, milli), n));
        }
        let w = Workload::from_demands(ds);
        let t = w.typical(0.95);
        let millis: Vec<u32> = t.types().iter().map(|t| t.milli_per_gpu).collect();
        assert_eq!(millis, vec![200, 400, 300]);
        let weights: Vec<f64> = t.types().iter().map(|t| t.weight).collect();
        assert!((weights[0] - 50.0 / 95.0).abs() < 1e-12);
        assert!((weights[1] - 30.0 / 95.0).abs() < 1e-12);
        assert!((weights.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // 50% keeps one type, full coverage keeps all, any coverage keeps at least one.
        assert_eq!(w.typical(0.5).len(), 1);
        assert_eq!(w.typical(1.0).len(), 4);
        assert_eq!(w.typical(0.0).len(), 1);
        assert_eq!(w.typical(0.0).types()[0].weight, 1.0);
    }

    #[test]
    fn horizon_is_gpu_tasks_per_gpu_of_shares() {
        // Half whole GPUs, half 500-milli shares: 250 share milli per GPU task, so four GPU
        // tasks arrive while the shares take one GPU's worth. CPU-only types do not count.
        let w = Workload::from_demands([
            demand(8_000, 1_024, 1, 1000),
            demand(2_000, 1_024, 1, 500),
            demand(4_000, 1_024, 0, 0),
        ]);
        assert!(
            (w.horizon_tasks() - 4.0).abs() < 1e-9,
            "{}",
            w.horizon_tasks()
        );
        // Never below one task; unbounded without shares.
        let shares = Workload::from_demands([demand(1_000, 1_024, 4, 900)]);
        assert_eq!(shares.horizon_tasks(), 1.0);
        let whole = Workload::from_demands([demand(8_000, 1_024, 1, 1000)]);
        assert_eq!(whole.horizon_tasks(), f64::INFINITY);
        assert_eq!(Workload::default().horizon_tasks(), f64::INFINITY);
    }

    /// Half whole-GPU tasks, 40% 470-milli shares, 10% 810-milli shares (k = 1000 / 269).
    fn sharing_workload() -> Workload {
        let mut ds = Vec::new();
        ds.extend(std::iter::repeat_n(demand(8_000, 1_024, 1, 1000), 5));
        ds.extend(std::iter::repeat_n(demand(8_000, 1_024, 1, 470), 4));
        ds.push(demand(3_000, 1_024, 1, 810));
        Workload::from_demands(ds)
    }

    #[test]
    fn a_gap_the_stream_fills_costs_less_than_one_nothing_fills() {
        let w = sharing_workload();
        let k = 1000.0 / 269.0;
        assert!((w.horizon_tasks() - k).abs() < 1e-9);
        let gap = |f: u32| {
            let gpus = [f];
            fragment_waste(&node(16_000, 65_536, &gpus), &w)
        };
        // FGD: a 530 gap is lost for 60% of the tasks (318), a 190 gap for all (190).
        let fgd = |f: u32| fragmentation(&node(16_000, 65_536, &[f]), &w);
        assert!((fgd(530) - 318.0).abs() < 1e-6 && fgd(190) == 190.0);
        // Here a 530 gap is lost only if none of the next k tasks is a 470 share (0.6^k);
        // otherwise the share leaves 60 that nothing uses.
        let q = 0.6f64.powf(k);
        let expected = 530.0 * q + (1.0 - q) * 60.0;
        assert!(
            (gap(530) - expected).abs() < 1e-6,
            "{} {expected}",
            gap(530)
        );
        assert!(gap(530) < gap(190), "{} {}", gap(530), gap(190));
        assert_eq!(gap(190), 190.0);
        // A whole free GPU some task can use is not lost; a fully used one has nothing.
        assert_eq!(gap(1000), 0.0);
        assert_eq!(gap(0), 0.0);
        // The fragments of a node add up, equal ones computed once.
        let gpus = [530, 190, 530, 530, 530, 530, 530, 530, 530, 530, 1000];
        let many = fragment_waste(&node(16_000, 65_536, &gpus), &w);
        assert!((many - (9.0 * gap(530) + gap(190))).abs() < 1e-6);
    }

    #[test]
    fn opening_a_whole_gpu_for_a_share_is_not_free() {
        // A 470 share on [1000, 530]: into the gap (60 left, lost) or onto the whole GPU
        // (two 530 gaps, each likely to end with 60 left, and one whole GPU fewer).
        let w = sharing_workload();
        let fill = fragment_waste(&node(8_000, 65_536, &[1000, 60]), &w);
        let open = fragment_waste(&node(8_000, 65_536, &[530, 530]), &w);
        assert_eq!(fill, 60.0);
        assert!(open > fill, "{open} {fill}");
    }

    #[test]
    fn fragments_no_task_can_use_for_cpu_or_model_are_lost() {
        let w = sharing_workload();
        let gpus = [1000, 1000];
        // Every task needs 3 CPUs or more: with 2 left nothing can use the GPUs.
        assert_eq!(fragment_waste(&node(2_000, 65_536, &gpus), &w), 2_000.0);
        // With 4 CPUs only the 810 shares fit: a whole free GPU is lost only if none of the
        // next k tasks is one (0.9^k).
        let q = 0.9f64.powf(w.horizon_tasks());
        let cpu_short = fragment_waste(&node(4_000, 65_536, &gpus), &w);
        assert!((cpu_short - 2.0 * 1000.0 * q).abs() < 1e-6, "{cpu_short}");
        // A model no GPU type accepts: everything lost.
        let a100 = ["A100".to_string()];
        let mut d = demand(1_000, 1_024, 1, 500);
        d.models = &a100;
        let only_a100 = Workload::from_demands([d]);
        assert_eq!(
            fragment_waste(&node(16_000, 65_536, &gpus), &only_a100),
            2_000.0
        );
    }

    #[test]
    fn multi_gpu_and_cpu_only_types_count_as_in_fgd() {
        // A quarter each: one whole GPU, eight whole GPUs, a 500 share, CPU-only.
        let w = Workload::from_demands([
            demand(1_000, 1_024, 1, 1000),
            demand(1_000, 1_024, 8, 1000),
            demand(1_000, 1_024, 1, 500),
            demand(1_000, 1_024, 0, 0),
        ]);
        // Four whole free GPUs: the 8-GPU type cannot run here and the CPU-only type never
        // uses a GPU, so half of the 4000 free milli counts, as in FGD; the others can use
        // every GPU.
        let four = node(16_000, 65_536, &[1000, 1000, 1000, 1000]);
        assert_eq!(fragmentation(&four, &w), 2_000.0);
        assert!((fragment_waste(&four, &w) - 2_000.0).abs() < 1e-9);
        // Eight: the 8-GPU type fits, only the CPU-only quarter counts.
        let eight = node(16_000, 65_536, &[1000; 8]);
        assert!((fragment_waste(&eight, &w) - 2_000.0).abs() < 1e-9);
        // No free GPU milli, nothing to lose.
        assert_eq!(fragment_waste(&node(16_000, 65_536, &[0, 0]), &w), 0.0);
        assert_eq!(fragment_waste(&four, &Workload::default()), 0.0);
    }

    #[test]
    fn horizon_waste_keeps_the_cpu_forecast() {
        // Whole GPUs with 8 CPUs each, no spread: 20 CPUs feed 2.5 of 4 GPUs. A task that
        // fits still fits, so no fragment is lost, but the forecast strands 1500 milli.
        let w = single(demand(8_000, 1_024, 1, 1000));
        let gpus = [1000, 1000, 1000, 1000];
        let tight = node(20_000, 65_536, &gpus);
        assert_eq!(fragment_waste(&tight, &w), 0.0);
        assert!((horizon_waste(&tight, &w) - 1_500.0).abs() < 1e-6);
        let roomy = node(64_000, 65_536, &gpus);
        assert_eq!(horizon_waste(&roomy, &w), 0.0);
    }
}
