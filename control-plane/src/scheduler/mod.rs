//! Scheduling policy: pure code that looks at the cluster state and proposes placements.
//! `plan(&ClusterState, now) -> Vec<JobPlacement>`; the leader proposes the result as one Raft
//! entry and `apply` re-checks every placement against the state at that point in the log, so a
//! plan computed on a slightly stale view can never double-book a GPU.
//!
//! This first policy is deliberately plain: queue order by priority class then submission,
//! dependencies honoured, whole GPUs, partitions and GPU models, all-or-nothing gangs, best-fit
//! node choice (fewest free GPUs that still fit) and, inside a node, the best-connected free set
//! according to its link matrix. Fair share, quotas, backfill reservations, preemption, MIG and
//! fragmentation-aware scoring belong to the scheduling-policy work and will replace `order`
//! and `score` here.

mod fit;

use std::collections::BTreeMap;

use crate::state::{
    ClusterState, DependencyKind, Job, JobPlacement, JobState, NodeStatus, TaskPlacement, Timestamp,
};
pub use fit::{NodeFree, best_gpu_set, link_rank};

/// Most jobs one pass looks at, so a pass stays cheap however long the queue is.
const MAX_JOBS_PER_PASS: usize = 10_000;

fn priority_rank(class: &str) -> u8 {
    match class {
        "high" => 2,
        "normal" => 1,
        _ => 0,
    }
}

/// Whether a pending job's dependencies allow it to start now.
pub fn dependencies_met(state: &ClusterState, job: &Job) -> bool {
    job.spec.dependencies.iter().all(|d| {
        let Some(dep) = state.jobs.get(&d.job) else {
            return false;
        };
        match d.kind {
            DependencyKind::AfterOk => dep.state == JobState::Succeeded,
            DependencyKind::AfterAny => dep.state.is_final(),
            DependencyKind::AfterNotOk => dep.state.is_final() && dep.state != JobState::Succeeded,
        }
    })
}

/// Pending jobs in the order the queue serves them.
pub fn queue_order(state: &ClusterState) -> Vec<&Job> {
    let mut pending: Vec<&Job> = state
        .jobs
        .values()
        .filter(|j| j.state == JobState::Pending && j.allocations.is_empty())
        .collect();
    pending.sort_by_key(|j| {
        (
            std::cmp::Reverse(priority_rank(&j.spec.priority_class)),
            j.id,
        )
    });
    pending.truncate(MAX_JOBS_PER_PASS);
    pending
}

/// One scheduling pass.
pub fn plan(state: &ClusterState, _now: Timestamp) -> Vec<JobPlacement> {
    // CPU and memory in use per node, in one pass over the allocations.
    let mut usage: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for rec in state.allocations.values() {
        if let Some(job) = state.jobs.get(&rec.allocation.job) {
            let u = usage.entry(rec.allocation.node.as_str()).or_default();
            u.0 += job.spec.cpu_milli_per_task;
            u.1 += job.spec.memory_mib_per_task;
        }
    }
    let mut free: BTreeMap<&str, NodeFree> = state
        .nodes
        .values()
        .filter(|n| n.status == NodeStatus::Ready)
        .map(|n| {
            let used = usage.get(n.spec.name.as_str()).copied().unwrap_or((0, 0));
            (n.spec.name.as_str(), NodeFree::of(state, n, used))
        })
        .collect();
    // Nothing free anywhere: skip ordering the queue (a pass runs after every applied entry,
    // and a long queue on a full cluster must not cost a sort each time).
    if free.values().all(|f| f.gpus.is_empty() && f.cpu_milli == 0) {
        return Vec::new();
    }
    let mut placements = Vec::new();
    // GPUs each limited tenant holds, updated as this pass places its jobs.
    let mut held: BTreeMap<&str, u64> = BTreeMap::new();
    for job in queue_order(state) {
        if !dependencies_met(state, job) {
            continue;
        }
        let tenant = job.spec.tenant.as_str();
        let limit = state
            .tenants
            .get(tenant)
            .map(|t| u64::from(t.max_gpus))
            .filter(|m| *m > 0);
        if let Some(limit) = limit {
            let h = *held
                .entry(tenant)
                .or_insert_with(|| state.gpus_held_by_tenant(tenant));
            if h + job.spec.total_gpus() > limit {
                continue;
            }
        }
        if let Some(p) = place_job(state, job, &mut free) {
            if limit.is_some() {
                *held.entry(tenant).or_default() += job.spec.total_gpus();
            }
            placements.push(p);
        }
    }
    placements
}

/// Places every task of `job` or none. Only the nodes the job touches are copied, so a gang
/// that does not fit leaves `free` as it was without cloning the whole fleet per job.
fn place_job<'a>(
    state: &ClusterState,
    job: &Job,
    free: &mut BTreeMap<&'a str, NodeFree>,
) -> Option<JobPlacement> {
    let mut touched: BTreeMap<&'a str, NodeFree> = BTreeMap::new();
    let mut tasks = Vec::with_capacity(job.spec.tasks as usize);
    for _ in 0..job.spec.tasks {
        // Best fit: the eligible node with the fewest free GPUs that still holds the task, so
        // large free blocks stay whole for large jobs. Ties go to the node name (stable).
        let name = free
            .iter()
            .map(|(name, f)| (*name, touched.get(name).unwrap_or(f)))
            .filter(|(name, f)| eligible(state, job, name) && f.fits(job))
            .map(|(name, f)| (name, f.free_gpu_count(job)))
            .min_by_key(|(name, count)| (*count, *name))
            .map(|(name, _)| name)?;
        let node = touched.entry(name).or_insert_with(|| free[name].clone());
        let gpus = node.choose_gpus(job)?;
        node.take(job, &gpus);
        tasks.push(TaskPlacement {
            node: name.to_owned(),
            gpus,
        });
    }
    free.extend(touched);
    Some(JobPlacement { job: job.id, tasks })
}

fn eligible(state: &ClusterState, job: &Job, node: &str) -> bool {
    let Some(n) = state.nodes.get(node) else {
        return false;
    };
    match &job.spec.partition {
        Some(p) => n.spec.partition.as_deref() == Some(p.as_str()),
        None => true,
    }
}

#[cfg(test)]
mod tests;
