//! Where one task goes: filters (partition, GPU model, CPU, memory, GPU units), the placement
//! score (fragmentation, `score.rs`) and, inside the chosen node, the best-connected GPUs
//! (`fit.rs`). Jobs of one shape are ranked over the fleet's groups once and the ranking is kept
//! current from the fleet's event log, so a pass over 10,000 pending jobs costs a lookup per
//! job rather than a scan of 10,000 nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound::{Excluded, Unbounded};

use super::fit::{best_gpu_set, link_rank};
use super::fleet::{
    FastMap, Fleet, FleetNode, GroupEvent, GroupId, GroupKey, MAX_GPUS, NodeFree, NodeIdx,
};
use super::frag::Workload;
use super::score::{self, Demand, NodeResources, ScorePolicy};
use crate::state::{JobSpec, Node, share_memory_for};

/// What one task of a job asks of a node; jobs with equal shapes place identically.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// GPUs (or MIG slices) per task.
    pub gpus: u32,
    /// Share of one GPU, in milli; 0 for whole GPUs.
    pub gpu_milli: u32,
    /// Requested GPU memory of a share; 0: in proportion to `gpu_milli`.
    pub gpu_memory_mib: u64,
    pub mig_profile: Option<String>,
    pub models: Vec<String>,
    pub partition: Option<String>,
    pub single_numa: bool,
    /// Runs in a container: only nodes with a container engine hold it.
    pub container: bool,
    /// Asks for named host ports: only nodes that hand out ports hold it.
    pub ports: bool,
    /// Nodes it may use (`--nodelist`; empty: any), sorted.
    pub only_nodes: Vec<String>,
    /// Nodes it never uses (`--exclude`), sorted.
    pub excluded_nodes: Vec<String>,
    /// Only idle nodes, and nothing else beside it (`--exclusive`).
    pub exclusive: bool,
}

impl Shape {
    pub fn of(spec: &JobSpec) -> Shape {
        let mut models = spec.gpu_models.clone();
        models.sort();
        models.dedup();
        Shape {
            cpu_milli: spec.cpu_milli_per_task,
            memory_mib: spec.memory_mib_per_task,
            gpus: spec.gpus_per_task,
            gpu_milli: spec.gpu_milli,
            gpu_memory_mib: spec.gpu_memory_mib,
            mig_profile: spec.mig_profile.clone(),
            models,
            partition: spec.partition.clone(),
            single_numa: spec.single_numa,
            container: spec.container.is_some(),
            ports: !spec.ports.is_empty(),
            only_nodes: spec.nodelist.clone(),
            excluded_nodes: spec.exclude.clone(),
            exclusive: spec.exclusive,
        }
    }

    /// Whether the job names nodes or wants them to itself: then nodes that are otherwise
    /// alike are not interchangeable, and it is placed node by node.
    pub fn has_node_rules(&self) -> bool {
        !self.only_nodes.is_empty() || !self.excluded_nodes.is_empty() || self.exclusive
    }

    /// Whether the node lists let a task on node `name`.
    pub fn allows_node(&self, name: &str) -> bool {
        let listed = |list: &[String]| list.binary_search_by(|n| n.as_str().cmp(name)).is_ok();
        (self.only_nodes.is_empty() || listed(&self.only_nodes)) && !listed(&self.excluded_nodes)
    }

    fn is_share(&self) -> bool {
        self.gpu_milli > 0
    }

    /// The demand as the workload model sees it (with its acceptable models).
    pub fn scored_demand(&self) -> Demand<'_> {
        Demand {
            models: &self.models,
            ..self.demand()
        }
    }

    /// The demand as the placement score sees it (models are filtered before scoring).
    fn demand(&self) -> Demand<'static> {
        Demand {
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
            gpus: self.gpus,
            milli_per_gpu: if self.gpus == 0 {
                0
            } else if self.is_share() {
                self.gpu_milli
            } else {
                1000
            },
            models: &[],
        }
    }
}

/// The GPU units a task takes on its node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Units {
    /// GPU positions (whole GPUs, or the one GPU of a share).
    Gpus(Vec<u8>),
    /// MIG slices as (GPU position, slice position).
    Slices(Vec<(u8, u8)>),
}

/// Order of candidates, lower is better: the score (scaled to an integer so ties are exact and
/// the order total); on a tie, the node left with the least free GPU capacity (best fit, so big
/// free blocks stay whole even when the expected workload has no big jobs yet); then how weakly
/// connected the chosen GPUs are.
pub type ScoreKey = (i64, u64, u32);

#[derive(Debug, Clone, PartialEq)]
pub struct TaskFit {
    pub key: ScoreKey,
    pub units: Units,
}

/// The placement score in use and the workload it measures fragmentation against.
pub struct Scorer {
    pub policy: ScorePolicy,
    pub workload: Workload,
    /// Only whether a task fits matters (not which GPUs are best): skips the topology search.
    pub fit_only: bool,
}

impl Scorer {
    /// A scorer for "does it fit" questions only (backfill timelines, preemption): best fit
    /// costs a few arithmetic operations, where the fragmentation measure walks the workload.
    pub fn fit_only() -> Scorer {
        Scorer {
            policy: ScorePolicy::BestFit,
            workload: Workload::default(),
            fit_only: true,
        }
    }
}

fn scaled(score: f64) -> i64 {
    (score * 1e6).round() as i64
}

/// Whether a task of `shape` fits on the node `n` with free resources `free`, and where.
pub fn evaluate_node(
    sc: &Scorer,
    n: &FleetNode,
    free: &NodeFree,
    shape: &Shape,
) -> Option<TaskFit> {
    let node = n.node;
    if let Some(p) = &shape.partition
        && node.spec.partition.as_deref() != Some(p.as_str())
    {
        return None;
    }
    if shape.container && node.spec.container_runtime.is_empty() {
        return None;
    }
    if shape.ports && node.spec.service_ports.is_none() {
        return None;
    }
    if shape.has_node_rules()
        && (!shape.allows_node(&node.spec.name)
            || (shape.exclusive && *free != NodeFree::capacity(node)))
    {
        return None;
    }
    if free.cpu_milli < shape.cpu_milli || free.memory_mib < shape.memory_mib {
        return None;
    }
    let gpus = &node.spec.gpus;
    let model_ok = |pos: usize| shape.models.is_empty() || shape.models.contains(&gpus[pos].model);
    if let Some(profile) = &shape.mig_profile {
        return evaluate_mig(node, free, shape, profile, &model_ok);
    }
    let mut view = [0u32; MAX_GPUS];
    let view = &mut view[..free.gpus as usize];
    for (pos, v) in view.iter_mut().enumerate() {
        let mut m = if model_ok(pos) {
            free.gpu_milli[pos]
        } else {
            0
        };
        if shape.is_share() {
            let want =
                share_memory_for(shape.gpu_milli, shape.gpu_memory_mib, gpus[pos].memory_mib);
            if free.gpu_memory_mib[pos] < want {
                m = 0;
            }
        }
        *v = m;
    }
    let res = NodeResources {
        cpu_milli: free.cpu_milli,
        memory_mib: free.memory_mib,
        model: n.model,
        gpu_milli: view,
    };
    let demand = shape.demand();
    let choice = score::evaluate(&sc.policy, &res, &demand, &sc.workload, 0)?;
    let score = scaled(choice.score);
    let left = res.free_gpu_milli() - demand.total_gpu_milli();
    if shape.gpus == 0 {
        return Some(TaskFit {
            key: (score, left, 0),
            units: Units::Gpus(Vec::new()),
        });
    }
    if shape.is_share() {
        return Some(TaskFit {
            key: (score, left, 0),
            units: Units::Gpus(choice.gpus.iter().map(|&p| p as u8).collect()),
        });
    }
    // Whole GPUs: any fully free ones leave the same fragmentation, so pick by interconnect.
    let candidates: Vec<u32> = (0..view.len())
        .filter(|&p| view[p] >= 1000)
        .map(|p| p as u32)
        .collect();
    let k = shape.gpus as usize;
    // Fit-only questions skip the topology search, except where the topology decides whether
    // it fits at all (single NUMA without NUMA information: no cross-socket link allowed).
    let ranks: &[Vec<u32>] = if sc.fit_only && !shape.single_numa {
        &[]
    } else {
        &n.ranks
    };
    let set = if shape.single_numa {
        single_numa_set(node, ranks, &candidates, k)?
    } else {
        best_gpu_set(ranks, &candidates, k)?
    };
    let weakest = weakest_link(ranks, &set);
    Some(TaskFit {
        key: (score, left, 1000u32.saturating_sub(weakest)),
        units: Units::Gpus(set.into_iter().map(|p| p as u8).collect()),
    })
}

/// The weakest link rank inside a set (1000 for sets of one, or without a matrix).
fn weakest_link(ranks: &[Vec<u32>], set: &[u32]) -> u32 {
    if ranks.is_empty() {
        return 1000;
    }
    let mut weakest = 1000;
    for (i, &a) in set.iter().enumerate() {
        for &b in &set[i + 1..] {
            let r = ranks
                .get(a as usize)
                .and_then(|r| r.get(b as usize))
                .copied()
                .unwrap_or(0);
            weakest = weakest.min(r);
        }
    }
    weakest
}

/// The best-connected set of `k` free GPUs that all sit on one NUMA node. GPUs whose NUMA node
/// is unknown count as one node only if no pair among them crosses sockets (`SYS`).
fn single_numa_set(
    node: &Node,
    ranks: &[Vec<u32>],
    candidates: &[u32],
    k: usize,
) -> Option<Vec<u32>> {
    let mut by_numa: BTreeMap<Option<u32>, Vec<u32>> = BTreeMap::new();
    for &c in candidates {
        by_numa
            .entry(node.spec.gpus[c as usize].numa_node)
            .or_default()
            .push(c);
    }
    let sys = link_rank("SYS");
    by_numa
        .into_iter()
        .filter_map(|(numa, free)| {
            let set = best_gpu_set(ranks, &free, k)?;
            if numa.is_none() && k > 1 && !ranks.is_empty() && weakest_link(ranks, &set) == sys {
                return None;
            }
            Some(set)
        })
        .max_by_key(|set| (weakest_link(ranks, set), std::cmp::Reverse(set.clone())))
}

/// MIG slices of `profile`: packed onto the GPUs that already have the fewest such slices free,
/// so whole free GPUs stay whole; the node left with the fewest free slices wins (best fit).
fn evaluate_mig(
    node: &Node,
    free: &NodeFree,
    shape: &Shape,
    profile: &str,
    model_ok: &dyn Fn(usize) -> bool,
) -> Option<TaskFit> {
    // Free slices of the profile per GPU, per NUMA node when the task must stay on one.
    let mut per_numa: BTreeMap<Option<u32>, BTreeMap<u8, Vec<u8>>> = BTreeMap::new();
    for (g, s) in free.slices() {
        let gpu = &node.spec.gpus[g as usize];
        if model_ok(g as usize)
            && gpu
                .mig
                .get(s as usize)
                .is_some_and(|m| m.profile == profile)
        {
            let numa = if shape.single_numa {
                gpu.numa_node
            } else {
                None
            };
            per_numa
                .entry(numa)
                .or_default()
                .entry(g)
                .or_default()
                .push(s);
        }
    }
    let k = shape.gpus as usize;
    // The NUMA node (or the whole node) with the fewest free slices that still hold the task.
    let per_gpu = per_numa
        .into_values()
        .filter(|gpus| gpus.values().map(Vec::len).sum::<usize>() >= k)
        .min_by_key(|gpus| gpus.values().map(Vec::len).sum::<usize>())?;
    let total: usize = free
        .slices()
        .filter(|&(g, s)| {
            model_ok(g as usize)
                && node.spec.gpus[g as usize]
                    .mig
                    .get(s as usize)
                    .is_some_and(|m| m.profile == profile)
        })
        .count();
    let mut order: Vec<(usize, u8)> = per_gpu.iter().map(|(g, v)| (v.len(), *g)).collect();
    order.sort_unstable();
    let mut slices = Vec::with_capacity(k);
    for (_, g) in order {
        for &s in &per_gpu[&g] {
            if slices.len() < k {
                slices.push((g, s));
            }
        }
    }
    slices.sort_unstable();
    Some(TaskFit {
        key: (((total - k) as i64) * 1_000_000, 0, 0),
        units: Units::Slices(slices),
    })
}

/// `free` after a task of `shape` takes `units`.
pub fn take(node: &Node, free: &NodeFree, shape: &Shape, units: &Units) -> NodeFree {
    let mut f = *free;
    f.cpu_milli = f.cpu_milli.saturating_sub(shape.cpu_milli);
    f.memory_mib = f.memory_mib.saturating_sub(shape.memory_mib);
    match units {
        Units::Gpus(ps) => {
            for &p in ps {
                let p = p as usize;
                if shape.is_share() {
                    let want = share_memory_for(
                        shape.gpu_milli,
                        shape.gpu_memory_mib,
                        node.spec.gpus[p].memory_mib,
                    );
                    f.gpu_milli[p] = f.gpu_milli[p].saturating_sub(shape.gpu_milli);
                    f.gpu_memory_mib[p] = f.gpu_memory_mib[p].saturating_sub(want);
                } else {
                    f.gpu_milli[p] = 0;
                    f.gpu_memory_mib[p] = 0;
                }
            }
        }
        Units::Slices(ss) => {
            for &(g, s) in ss {
                f.take_slice(g, s);
            }
        }
    }
    f
}

/// `free` after a task of `shape` that held `units` gives them back.
pub fn give_back(node: &Node, free: &NodeFree, shape: &Shape, units: &Units) -> NodeFree {
    let mut f = *free;
    f.cpu_milli += shape.cpu_milli;
    f.memory_mib += shape.memory_mib;
    match units {
        Units::Gpus(ps) => {
            for &p in ps {
                let p = p as usize;
                let gpu = &node.spec.gpus[p];
                if shape.is_share() {
                    f.gpu_milli[p] += shape.gpu_milli;
                    f.gpu_memory_mib[p] +=
                        share_memory_for(shape.gpu_milli, shape.gpu_memory_mib, gpu.memory_mib);
                } else {
                    f.gpu_milli[p] = 1000;
                    f.gpu_memory_mib[p] = gpu.memory_mib;
                }
            }
        }
        Units::Slices(ss) => {
            for &(g, s) in ss {
                f.give_slice(g, s);
            }
        }
    }
    f
}

/// The UUIDs a task's units name, for the plan.
pub fn unit_uuids(node: &Node, units: &Units) -> Vec<String> {
    match units {
        Units::Gpus(ps) => ps
            .iter()
            .map(|&p| node.spec.gpus[p as usize].uuid.clone())
            .collect(),
        Units::Slices(ss) => ss
            .iter()
            .map(|&(g, s)| node.spec.gpus[g as usize].mig[s as usize].uuid.clone())
            .collect(),
    }
}

/// The fleet's groups ordered by how well a task of one shape fits them, kept current from the
/// fleet's event log.
#[derive(Default)]
pub struct Ranking {
    /// Per group: not evaluated yet (`None`), does not fit (`Some(None)`), or the fit.
    evals: Vec<Option<Option<TaskFit>>>,
    ranked: BTreeSet<(ScoreKey, GroupId)>,
    cursor: usize,
    /// (group, cap) → tasks of the shape a node of the group holds, up to cap.
    capacity: FastMap<(GroupId, u32), u32>,
    /// The fits on the nodes held for the reservation, for short (`[0]`) and long (`[1]`)
    /// tasks, as of the fleet's `held_version`: every job asks about every held node, and
    /// their resources change only when a job lands on one.
    held: [Option<HeldFits>; 2],
    /// Whether a task fits now when the reservation is ignored, as of (event count, held
    /// version): for the pending reason of jobs backfill turns away, asked of every one of
    /// them and changing only when the fleet does.
    unreserved_fit: Option<((usize, u64), bool)>,
}

/// The fit of a task on each node held for the reservation (in index order), as of one
/// `Fleet::held_version`.
struct HeldFits {
    version: u64,
    fits: Vec<(NodeIdx, Option<TaskFit>)>,
}

impl Ranking {
    fn sync(&mut self, fleet: &Fleet, sc: &Scorer, shape: &Shape) {
        while let Some(event) = fleet.events.get(self.cursor) {
            self.cursor += 1;
            match *event {
                GroupEvent::Filled(g) => {
                    if let Some(key) = self.eval(fleet, sc, shape, g).map(|fit| fit.key) {
                        self.ranked.insert((key, g));
                    }
                }
                GroupEvent::Emptied(g) => {
                    if let Some(Some(Some(fit))) = self.evals.get(g as usize) {
                        self.ranked.remove(&(fit.key, g));
                    }
                }
            }
        }
    }

    /// Brings the fits on the held nodes up to date for tasks of `shape` (for a long task,
    /// only what the reservation leaves there counts).
    fn refresh_held(&mut self, fleet: &Fleet, sc: &Scorer, shape: &Shape, long: bool) {
        let cached = &mut self.held[usize::from(long)];
        if cached
            .as_ref()
            .is_some_and(|h| h.version == fleet.held_version())
        {
            return;
        }
        let fits = fleet
            .reserved
            .iter()
            .map(|&idx| {
                let n = &fleet.nodes[idx as usize];
                let view = match (&n.shadow, long) {
                    (Some(shadow), true) => n.free.min(shadow),
                    _ => n.free,
                };
                (idx, evaluate_node(sc, n, &view, shape))
            })
            .collect();
        *cached = Some(HeldFits {
            version: fleet.held_version(),
            fits,
        });
    }

    /// The fits on the held nodes, as of the last `refresh_held`.
    fn held(&self, long: bool) -> &[(NodeIdx, Option<TaskFit>)] {
        self.held[usize::from(long)]
            .as_ref()
            .map_or(&[], |h| &h.fits)
    }

    fn eval(&mut self, fleet: &Fleet, sc: &Scorer, shape: &Shape, g: GroupId) -> Option<&TaskFit> {
        let i = g as usize;
        if self.evals.len() <= i {
            self.evals.resize(i + 1, None);
        }
        if self.evals[i].is_none() {
            let sample = &fleet.nodes[fleet.groups[i].sample as usize];
            self.evals[i] = Some(evaluate_node(sc, sample, fleet.group_free(g), shape));
        }
        self.evals[i].as_ref().and_then(Option::as_ref)
    }
}

/// [`count_fit`] results by (hardware class, partition, free resources) and cap, for the
/// fit-only questions of backfill and preemption. Nodes of one hardware class in the same
/// state hold the same tasks, and on a large fleet release timelines and victim searches
/// revisit the same few states ("all eight GPUs free") thousands of times.
#[derive(Default)]
pub struct FitMemo<'a> {
    counts: FastMap<(GroupKey<'a>, u32), u32>,
    /// The same answers for nodes as the fleet has them, by their group: a group's key is
    /// exactly the (hardware, partition, free) triple above, and looking it up by id saves
    /// hashing the free resources.
    by_group: FastMap<(GroupId, u32), u32>,
}

impl<'a> FitMemo<'a> {
    pub fn count(
        &mut self,
        placer: &Placer<'a>,
        idx: NodeIdx,
        free: &NodeFree,
        shape: &Shape,
        max: u32,
    ) -> u32 {
        let n = &placer.fleet.nodes[idx as usize];
        let key = GroupKey {
            hardware: placer.fleet.groups[n.group as usize].key.hardware,
            partition: n.node.spec.partition.as_deref(),
            free: *free,
        };
        *self
            .counts
            .entry((key, max))
            .or_insert_with(|| count_fit(placer, idx, free, shape, max).0)
    }

    /// [`FitMemo::count`] for node `idx` with the free resources the fleet has for it now.
    pub fn count_as_is(
        &mut self,
        placer: &Placer<'a>,
        idx: NodeIdx,
        shape: &Shape,
        max: u32,
    ) -> u32 {
        let n = &placer.fleet.nodes[idx as usize];
        // A held node left its group; its own free resources decide.
        if n.shadow.is_some() {
            return self.count(placer, idx, &n.free, shape, max);
        }
        if let Some(&count) = self.by_group.get(&(n.group, max)) {
            return count;
        }
        let count = self.count(placer, idx, &n.free, shape, max);
        self.by_group.insert((n.group, max), count);
        count
    }

    /// Whether one task of `shape` fits on node `idx` with the free resources the fleet has
    /// for it now.
    pub fn fits_as_is(&mut self, placer: &Placer<'a>, idx: NodeIdx, shape: &Shape) -> bool {
        self.count_as_is(placer, idx, shape, 1) > 0
    }

    /// Whether one task of `shape` fits on node `idx` with `free`.
    pub fn fits(
        &mut self,
        placer: &Placer<'a>,
        idx: NodeIdx,
        free: &NodeFree,
        shape: &Shape,
    ) -> bool {
        self.count(placer, idx, free, shape, 1) > 0
    }
}

/// How many tasks of `shape` fit on a node with `free`, up to `max`.
pub fn count_fit(
    placer: &Placer,
    idx: NodeIdx,
    free: &NodeFree,
    shape: &Shape,
    max: u32,
) -> (u32, NodeFree) {
    let n = &placer.fleet.nodes[idx as usize];
    let fit_only = Scorer::fit_only();
    let mut f = *free;
    let mut count = 0;
    while count < max {
        match evaluate_node(&fit_only, n, &f, shape) {
            Some(fit) => {
                f = take(n.node, &f, shape, &fit.units);
                count += 1;
            }
            None => break,
        }
    }
    (count, f)
}

/// One pass's placement state: the fleet, the score, and a ranking per shape.
pub struct Placer<'a> {
    pub fleet: Fleet<'a>,
    pub scorer: Scorer,
    /// Shape → its ranking's position in `rankings` (one hash of the shape per question).
    shape_ids: FastMap<Shape, usize>,
    rankings: Vec<Ranking>,
}

/// A placed task: node and units.
pub type PlacedTask = (NodeIdx, Units);

impl<'a> Placer<'a> {
    pub fn new(fleet: Fleet<'a>, scorer: Scorer) -> Placer<'a> {
        Placer {
            fleet,
            scorer,
            shape_ids: FastMap::default(),
            rankings: Vec::new(),
        }
    }

    /// The position of the shape's ranking, synced with the fleet.
    fn ranking_id(&mut self, shape: &Shape) -> usize {
        let id = match self.shape_ids.get(shape) {
            Some(&id) => id,
            None => {
                let id = self.rankings.len();
                self.shape_ids.insert(shape.clone(), id);
                self.rankings.push(Ranking::default());
                id
            }
        };
        self.rankings[id].sync(&self.fleet, &self.scorer, shape);
        id
    }

    /// Where a task would go (without taking it). `long`: the task would still run when the
    /// backfill reservation starts, so on reserved nodes it may only use what the reservation
    /// leaves.
    pub fn best_for_task(&mut self, shape: &Shape, long: bool) -> Option<(NodeIdx, TaskFit)> {
        let id = self.ranking_id(shape);
        self.rankings[id].refresh_held(&self.fleet, &self.scorer, shape, long);
        let ranking = &self.rankings[id];
        let mut best: Option<(ScoreKey, NodeIdx, &TaskFit)> = None;
        if let Some(&(key, g)) = ranking.ranked.first()
            && let Some(Some(Some(fit))) = ranking.evals.get(g as usize)
            && let Some(idx) = self.fleet.representative(g)
        {
            best = Some((key, idx, fit));
        }
        for (idx, fit) in ranking.held(long) {
            if let Some(fit) = fit
                && best.is_none_or(|(k, i, _)| (fit.key, *idx) < (k, i))
            {
                best = Some((fit.key, *idx, fit));
            }
        }
        best.map(|(_, idx, fit)| (idx, fit.clone()))
    }

    /// Whether one task of `shape` fits now somewhere, the reservation ignored (held nodes
    /// offer all they have free). The answer depends only on which fitting groups have
    /// members (the event log) and on the held nodes (their version), so it is kept until
    /// either changes.
    pub fn fits_ignoring_reservation(&mut self, shape: &Shape) -> bool {
        if shape.has_node_rules() {
            return self.best_node_by_node(shape, false, true).is_some();
        }
        let id = self.ranking_id(shape);
        let stamp = (self.fleet.events.len(), self.fleet.held_version());
        if let Some((s, answer)) = self.rankings[id].unreserved_fit
            && s == stamp
        {
            return answer;
        }
        let answer = self.best_for_task(shape, false).is_some();
        self.rankings[id].unreserved_fit = Some((stamp, answer));
        answer
    }

    /// Takes a task's units on a node (and on a reserved node, out of its shadow too when the
    /// task is long).
    pub fn commit(&mut self, idx: NodeIdx, shape: &Shape, units: &Units, long: bool) {
        let n = &self.fleet.nodes[idx as usize];
        let free = take(n.node, &n.free, shape, units);
        if long && let Some(shadow) = &n.shadow {
            let shadow = take(n.node, shadow, shape, units);
            self.fleet.set_shadow(idx, Some(shadow));
        }
        self.fleet.set_free(idx, free);
    }

    fn restore(&mut self, undo: Vec<(NodeIdx, NodeFree, Option<NodeFree>)>) {
        for (idx, free, shadow) in undo.into_iter().rev() {
            if self.fleet.nodes[idx as usize].shadow.is_some() {
                self.fleet.set_shadow(idx, shadow);
            }
            self.fleet.set_free(idx, free);
        }
    }

    fn snapshot(&self, idx: NodeIdx) -> (NodeIdx, NodeFree, Option<NodeFree>) {
        let n = &self.fleet.nodes[idx as usize];
        (idx, n.free, n.shadow.as_deref().copied())
    }

    /// Places all `tasks` tasks of a shape or none: a gang across hosts prefers one rack.
    pub fn place(&mut self, shape: &Shape, tasks: u32, long: bool) -> Option<Vec<PlacedTask>> {
        if shape.has_node_rules() {
            return self.place_node_by_node(shape, tasks, long);
        }
        if tasks > 1
            && self.fleet.has_racks()
            && let Some(placed) = self.place_in_one_rack(shape, tasks, long)
        {
            return Some(placed);
        }
        let mut undo = Vec::new();
        // Allocated on the first task found: on a full fleet most jobs find none.
        let mut placed = Vec::new();
        for _ in 0..tasks {
            let Some((idx, fit)) = self.best_for_task(shape, long) else {
                self.restore(undo);
                return None;
            };
            undo.push(self.snapshot(idx));
            self.commit(idx, shape, &fit.units, long);
            if placed.capacity() == 0 {
                placed.reserve_exact(tasks as usize);
            }
            placed.push((idx, fit.units));
        }
        Some(placed)
    }

    /// The best node for one task of a shape with node rules, each allowed node evaluated on
    /// its own (groups of alike nodes do not tell allowed ones from the rest). A long task
    /// skips nodes held for the reservation (it could delay it); `ignore_reservation` offers
    /// them with all they have free. O(allowed nodes): node lists are short, and a job with
    /// `--exclude` or `--exclusive` alone pays one walk of the fleet per task.
    fn best_node_by_node(
        &self,
        shape: &Shape,
        long: bool,
        ignore_reservation: bool,
    ) -> Option<(NodeIdx, TaskFit)> {
        let candidates: Vec<NodeIdx> = if shape.only_nodes.is_empty() {
            (0..self.fleet.nodes.len() as NodeIdx).collect()
        } else {
            shape
                .only_nodes
                .iter()
                .filter_map(|name| self.fleet.index_of.get(name))
                .collect()
        };
        let mut best: Option<(NodeIdx, TaskFit)> = None;
        for idx in candidates {
            let n = &self.fleet.nodes[idx as usize];
            if n.shadow.is_some() && long && !ignore_reservation {
                continue;
            }
            if let Some(fit) = evaluate_node(&self.scorer, n, &n.free, shape)
                && best
                    .as_ref()
                    .is_none_or(|(i, b)| (fit.key, idx) < (b.key, *i))
            {
                best = Some((idx, fit));
            }
        }
        best
    }

    /// All tasks of a shape with node rules, or none. An exclusive job's nodes are emptied
    /// in this pass's view once it is placed, so nothing else lands beside it.
    fn place_node_by_node(
        &mut self,
        shape: &Shape,
        tasks: u32,
        long: bool,
    ) -> Option<Vec<PlacedTask>> {
        let mut undo = Vec::new();
        let mut placed: Vec<PlacedTask> = Vec::new();
        // An exclusive job's own tasks may share a node: the first task needs an idle node,
        // later ones may also join a node this job took.
        let mut own: Vec<NodeIdx> = Vec::new();
        for _ in 0..tasks {
            let mut pick = self.best_node_by_node(shape, long, false);
            if shape.exclusive {
                let relaxed = Shape {
                    exclusive: false,
                    ..shape.clone()
                };
                for &idx in &own {
                    let n = &self.fleet.nodes[idx as usize];
                    if let Some(fit) = evaluate_node(&self.scorer, n, &n.free, &relaxed)
                        && pick
                            .as_ref()
                            .is_none_or(|(i, b)| (fit.key, idx) < (b.key, *i))
                    {
                        pick = Some((idx, fit));
                    }
                }
            }
            let Some((idx, fit)) = pick else {
                self.restore(undo);
                return None;
            };
            undo.push(self.snapshot(idx));
            self.commit(idx, shape, &fit.units, long);
            if !own.contains(&idx) {
                own.push(idx);
            }
            placed.push((idx, fit.units));
        }
        if shape.exclusive {
            for &idx in &own {
                let n = &self.fleet.nodes[idx as usize];
                let empty = NodeFree::nothing(n.node);
                if long && n.shadow.is_some() {
                    self.fleet.set_shadow(idx, Some(empty));
                }
                self.fleet.set_free(idx, empty);
            }
        }
        Some(placed)
    }

    /// How many tasks of `shape` fit on a node of group `g` (up to `max`), cached per group.
    fn tasks_per_node(&mut self, shape: &Shape, id: usize, g: GroupId, max: u32) -> u32 {
        if let Some(&n) = self.rankings[id].capacity.get(&(g, max)) {
            return n;
        }
        let sample = self.fleet.groups[g as usize].sample;
        let n = count_fit(self, sample, self.fleet.group_free(g), shape, max).0;
        self.rankings[id].capacity.insert((g, max), n);
        n
    }

    /// A gang inside one rack. Groups are scanned best score first and their nodes credited to
    /// their racks; the first rack whose credited nodes can hold every task is tried (a few at
    /// most), so the gang lands where the fleet fits it best while staying in one rack. None
    /// when no rack is found this way.
    fn place_in_one_rack(
        &mut self,
        shape: &Shape,
        tasks: u32,
        long: bool,
    ) -> Option<Vec<PlacedTask>> {
        const MAX_TRIALS: usize = 8;
        let id = self.ranking_id(shape);
        let groups: Vec<GroupId> = self.rankings[id].ranked.iter().map(|(_, g)| *g).collect();
        let mut credit: BTreeMap<&str, u32> = BTreeMap::new();
        let mut tried = 0;
        for g in groups {
            let per_node = self.tasks_per_node(shape, id, g, tasks);
            if per_node == 0 {
                continue;
            }
            // Walk the group's members from a cursor rather than copying them: a group of
            // identical free nodes may hold thousands, and a rack is usually ready after a few.
            let mut cursor: Option<NodeIdx> = None;
            loop {
                let members = &self.fleet.groups[g as usize].members;
                let rest = match cursor {
                    None => members.range(..),
                    Some(c) => members.range((Excluded(c), Unbounded)),
                };
                let mut ready = None;
                for &idx in rest {
                    cursor = Some(idx);
                    let Some(rack) = self.fleet.rack_of(idx) else {
                        continue;
                    };
                    let c = credit.entry(rack).or_default();
                    if *c >= tasks {
                        continue;
                    }
                    *c += per_node;
                    if *c >= tasks {
                        ready = Some(rack);
                        break;
                    }
                }
                let Some(rack) = ready else { break };
                if let Some(placed) = self.try_rack(shape, tasks, long, rack) {
                    return Some(placed);
                }
                tried += 1;
                if tried >= MAX_TRIALS {
                    return None;
                }
            }
        }
        None
    }

    /// Places every task on nodes of one rack, best node first, or nothing.
    fn try_rack(
        &mut self,
        shape: &Shape,
        tasks: u32,
        long: bool,
        rack: &str,
    ) -> Option<Vec<PlacedTask>> {
        let nodes = self.fleet.rack_nodes(rack);
        let mut undo = Vec::new();
        let mut placed = Vec::new();
        for _ in 0..tasks {
            // One lookup of the shape's ranking per task, not one per node of the rack.
            let id = self.ranking_id(shape);
            let ranking = &mut self.rankings[id];
            let mut pick: Option<(ScoreKey, NodeIdx)> = None;
            for &idx in &nodes {
                let n = &self.fleet.nodes[idx as usize];
                if n.shadow.is_some() {
                    continue;
                }
                if let Some(fit) = ranking.eval(&self.fleet, &self.scorer, shape, n.group)
                    && pick.is_none_or(|(k, i)| (fit.key, idx) < (k, i))
                {
                    pick = Some((fit.key, idx));
                }
            }
            let pick = pick.and_then(|(key, idx)| {
                let g = self.fleet.nodes[idx as usize].group;
                let fit = ranking.eval(&self.fleet, &self.scorer, shape, g)?;
                Some((key, idx, fit.units.clone()))
            });
            let Some((_, idx, units)) = pick else {
                self.restore(undo);
                return None;
            };
            undo.push(self.snapshot(idx));
            self.commit(idx, shape, &units, long);
            placed.push((idx, units));
        }
        Some(placed)
    }
}
