//! Why a pending job is pending: Slurm's squeue REASON, with Kubernetes-style counts of why
//! nodes turned it away.
//!
//! Reasons change with every scheduling pass, so they are soft state on the leader and never
//! go through the Raft log (one entry per pass would flood it). The pass records, for each job
//! it looked at and did not place, a small value ([`Why`]: no strings, no lookups), and the
//! leader publishes the pass's [`ReasonLog`] as a [`Board`] that the API reads. The text is
//! made when someone asks ([`explain`]), from the board and the leader's state: counting nodes
//! per filter is O(nodes), done per shape of a listing, never in the pass.
//!
//! Pure: no clock (the caller passes `now`), no I/O.

use std::collections::HashMap;

use super::capacity::{self, NeverFits};
use super::placement::Shape;
use super::queue;
use crate::state::{ClusterState, Job, JobId, JobState, MILLI_PER_GPU, Timestamp};

/// What one pass found for a job it did not place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The first job in queue order that could not start (the head): waits for resources.
    Resources,
    /// Behind the head, and no room for it either.
    Priority { behind: JobId },
    /// There is room now, but only where the head's backfill reservation holds it.
    Reservation { for_job: JobId },
    /// Its tenant would go past its `max_gpus`.
    Quota { held_milli: u64, max_gpus: u32 },
    /// No ready node could ever hold it (it is not made the head).
    Unfit,
    /// Its array has `max` jobs running, its limit (`%N`).
    ArrayLimit { array: JobId, max: u32 },
    /// It names its nodes or wants them to itself, and none that it allows has room now (it
    /// is not made the head: reservations do not follow node rules).
    NodeRules,
}

/// What one pass decided about the jobs it did not place.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReasonLog {
    /// Jobs looked at and left pending, in queue order.
    pub jobs: Vec<(JobId, Why)>,
    /// The head job (the first that could not start), if any.
    pub head: Option<JobId>,
    /// How many jobs the pass looked at: at its limit (`Policy::max_jobs_per_pass`), the
    /// jobs it did not reach wait for a later pass.
    pub jobs_considered: usize,
    /// The pass did not run: no node is ready.
    pub no_ready_node: bool,
}

/// The reasons of the leader's last pass, as the API reads them.
#[derive(Debug, Clone, Default)]
pub struct Board {
    /// The leader's term that computed them: a board of another term is not shown.
    pub term: u64,
    /// Leader time of the pass.
    pub at: Timestamp,
    pub by_job: HashMap<JobId, Why>,
    pub head: Option<JobId>,
    pub no_ready_node: bool,
    pub jobs_considered: usize,
    pub max_jobs_per_pass: usize,
}

impl Board {
    pub fn new(term: u64, at: Timestamp, log: ReasonLog, max_jobs_per_pass: usize) -> Board {
        Board {
            term,
            at,
            by_job: log.jobs.into_iter().collect(),
            head: log.head,
            no_ready_node: log.no_ready_node,
            jobs_considered: log.jobs_considered,
            max_jobs_per_pass,
        }
    }
}

/// The first dependency of a pending job that is not met yet.
pub fn waiting_for(state: &ClusterState, job: &Job) -> Option<JobId> {
    job.spec
        .dependencies
        .iter()
        .find(|d| !queue::dependency_met(state, d))
        .map(|d| d.job)
}

/// Per shape, what the state says about jobs of it: computed once per explanation or listing,
/// for at most `MAX_SHAPES` shapes (each costs a walk over the nodes), so a listing of a
/// queue with thousands of distinct shapes stays cheap; the rest get the short reason.
#[derive(Default)]
pub struct ShapeMemo {
    never: HashMap<(Shape, u32), Option<NeverFits>>,
    now: HashMap<(Shape, u32), capacity::Diagnosis>,
}

/// Most shapes one listing diagnoses in full.
pub const MAX_SHAPES: usize = 256;

impl ShapeMemo {
    /// Why no node could ever hold the job, if so (not asked beyond `MAX_SHAPES` shapes).
    pub fn never_fits(
        &mut self,
        state: &ClusterState,
        shape: &Shape,
        tasks: u32,
    ) -> Option<&NeverFits> {
        let key = (shape.clone(), tasks);
        if !self.never.contains_key(&key) && self.never.len() >= MAX_SHAPES {
            return None;
        }
        self.never
            .entry(key)
            .or_insert_with(|| capacity::never_fits(state.nodes.values(), shape, tasks))
            .as_ref()
    }

    /// The node-by-node diagnosis (None beyond `MAX_SHAPES` shapes).
    pub fn diagnose(
        &mut self,
        state: &ClusterState,
        shape: &Shape,
        tasks: u32,
    ) -> Option<&capacity::Diagnosis> {
        let key = (shape.clone(), tasks);
        if !self.now.contains_key(&key) && self.now.len() >= MAX_SHAPES {
            return None;
        }
        Some(
            self.now
                .entry(key)
                .or_insert_with(|| capacity::diagnose(state, shape, tasks)),
        )
    }
}

/// The reason a pending job shows: `Label: detail`. `board` is the leader's last pass (None:
/// no pass yet in this term). Jobs that are not pending have no reason (empty).
pub fn explain(
    state: &ClusterState,
    board: Option<&Board>,
    job: &Job,
    now: Timestamp,
    memo: &mut ShapeMemo,
) -> String {
    if job.state != JobState::Pending {
        return String::new();
    }
    if job.held {
        let name = match job.array_task {
            Some(t) => format!("{}_{}", t.array_id, t.index),
            None => job.id.to_string(),
        };
        return format!("JobHeldUser: held; `gpuctl release {name}` lets it run");
    }
    if let Some(begin) = job.spec.begin_at
        && begin > now
    {
        // UTC, to the second: the leader's clock is UTC and so is the log.
        let when = i64::try_from(begin / 1000)
            .ok()
            .and_then(|s| jiff::Timestamp::from_second(s).ok())
            .map_or_else(|| format!("{begin} ms"), |t| t.to_string());
        return format!(
            "BeginTime: not before {when} (in {})",
            duration_text(begin - now)
        );
    }
    if let Some(dep) = waiting_for(state, job) {
        return format!("Dependency: waiting for job {dep}");
    }
    if queue::yielding(state, job, now)
        && let Some(to) = job.yielded_to
    {
        return format!("Preempted: standing aside until job {to} starts");
    }
    let shape = Shape::of(&job.spec);
    let tasks = job.spec.tasks;
    if let Some(never) = memo.never_fits(state, &shape, tasks) {
        return format!("{}: {}", never.label(), never.text(&shape, tasks));
    }
    let Some(board) = board else {
        return "Pending: no scheduling pass yet on this leader".into();
    };
    if state.nodes.is_empty() {
        return "Resources: no node is registered yet".into();
    }
    if board.no_ready_node {
        return match memo.diagnose(state, &shape, tasks) {
            Some(d) => format!(
                "NodeUnhealthy: no node is ready ({})",
                capacity::counts_text(&d.counts)
            ),
            None => "NodeUnhealthy: no node is ready".into(),
        };
    }
    match board.by_job.get(&job.id) {
        Some(Why::Quota {
            held_milli,
            max_gpus,
        }) => format!(
            "QuotaExceeded: tenant {} at {}/{max_gpus} GPUs, the job needs {} more",
            job.spec.tenant,
            gpus_text(*held_milli),
            gpus_text(job.spec.total_gpu_milli())
        ),
        Some(Why::Reservation { for_job }) => format!("Reservation for job {for_job}"),
        Some(Why::ArrayLimit { array, max }) => {
            format!("JobArrayTaskLimit: array {array} has {max} jobs running, its limit (%{max})")
        }
        Some(Why::Priority { behind }) => format!("Priority: behind job {behind}"),
        Some(Why::Resources) | Some(Why::Unfit) | Some(Why::NodeRules) => {
            match memo.diagnose(state, &shape, tasks) {
                Some(d) => {
                    let label = if d.only_unhealthy() {
                        "NodeUnhealthy"
                    } else {
                        "Resources"
                    };
                    format!("{label}: {}", d.text(&shape, tasks))
                }
                None => format!("Resources: details with `gpuctl why {}`", job.id),
            }
        }
        None => match board.head {
            Some(head) if head != job.id => format!("Priority: behind job {head}"),
            // Placed since the pass, or not reached by it.
            _ if board.jobs_considered >= board.max_jobs_per_pass => format!(
                "Priority: not reached yet (a pass looks at the first {} jobs in queue order)",
                board.max_jobs_per_pass
            ),
            _ => "Pending: placed by the last pass or submitted since; next pass decides".into(),
        },
    }
}

fn gpus_text(milli: u64) -> String {
    if milli.is_multiple_of(MILLI_PER_GPU) {
        (milli / MILLI_PER_GPU).to_string()
    } else {
        format!("{:.3}", milli as f64 / MILLI_PER_GPU as f64)
    }
}

/// `gpuctl why`: the reason, then what would have to change for the job to run, line by line.
pub fn why_lines(
    state: &ClusterState,
    board: Option<&Board>,
    job: &Job,
    now: Timestamp,
) -> Vec<String> {
    let mut memo = ShapeMemo::default();
    let reason = explain(state, board, job, now, &mut memo);
    if job.state != JobState::Pending {
        return vec![format!("job {} is {}, not pending", job.id, job.state)];
    }
    let mut lines = vec![reason];
    let shape = Shape::of(&job.spec);
    let tasks = job.spec.tasks;
    let per_task = capacity::task_text(&shape);
    let where_ = match &shape.partition {
        Some(p) => format!(" in partition {p}"),
        None => String::new(),
    };
    let container = if shape.container {
        " with a container engine"
    } else {
        ""
    };
    if tasks > 1 {
        lines.push(format!(
            "needs {tasks} tasks of {per_task}, each on one node{where_}{container}, all at once"
        ));
    } else {
        lines.push(format!("needs {per_task} on one node{where_}{container}"));
    }
    if let Some(never) = memo.never_fits(state, &shape, tasks).cloned() {
        lines.push(format!(
            "can never run on this cluster: {}; it runs once a node that fits joins",
            never.text(&shape, tasks)
        ));
        return lines;
    }
    let Some(d) = memo.diagnose(state, &shape, tasks).cloned() else {
        return lines;
    };
    lines.push(format!("now: {}", d.text(&shape, tasks)));
    if let Some(name) = &d.closest
        && let Some(node) = state.nodes.get(name)
    {
        lines.push(closest_line(state, node, &shape, now));
    }
    if let Some(b) = board
        && let Some(Why::Quota { .. }) = b.by_job.get(&job.id)
        && let Some(t) = state.tenants.get(&job.spec.tenant)
    {
        lines.push(format!(
            "runs once tenant {} holds at most {} GPUs (its max is {}), or its max is raised",
            t.name,
            gpus_text(
                (u64::from(t.max_gpus) * MILLI_PER_GPU).saturating_sub(job.spec.total_gpu_milli())
            ),
            t.max_gpus
        ));
    }
    lines
}

/// "closest node n3: 6 free; 2 held by job 40 (ends in ≤ 1h), ..."
fn closest_line(
    state: &ClusterState,
    node: &crate::state::Node,
    shape: &Shape,
    now: Timestamp,
) -> String {
    let free = state
        .index
        .node_free
        .get(&node.spec.name)
        .copied()
        .unwrap_or_else(|| crate::state::free::NodeFree::capacity(node));
    let mut line = format!(
        "closest node {}: {} free of {} GPUs, {} of {} CPUs, {} of {} MiB free",
        node.spec.name,
        free.milli().iter().filter(|m| **m >= 1000).count(),
        node.spec.gpus.len(),
        free.cpu_milli / 1000,
        node.spec.cpu_milli / 1000,
        free.memory_mib,
        node.spec.memory_mib
    );
    let mut holders: Vec<String> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for rec in state.allocations_on(&node.spec.name) {
        let a = &rec.allocation;
        if !seen.insert(a.job) || holders.len() >= 5 {
            continue;
        }
        let ends = state
            .jobs
            .get(&a.job)
            .and_then(|j| j.spec.time_limit_secs)
            .map(|s| {
                let end = a.created_at.saturating_add(s.saturating_mul(1000));
                format!("ends in ≤ {}", duration_text(end.saturating_sub(now)))
            })
            .unwrap_or_else(|| "no time limit".into());
        holders.push(format!("{} held by job {} ({ends})", a.gpus.len(), a.job));
    }
    if !holders.is_empty() {
        line.push_str("; ");
        line.push_str(&holders.join(", "));
    }
    let _ = shape;
    line
}

fn duration_text(ms: u64) -> String {
    let s = ms.div_ceil(1000);
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s.div_ceil(60)),
        _ => format!("{}h", s.div_ceil(3600)),
    }
}
