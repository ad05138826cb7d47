//! The replicated state machine: plain data (`ClusterState`) and one deterministic function,
//! `ClusterState::apply`. No clock, no randomness, no I/O: every replica that applies the same
//! log reaches the same state. Every rule that protects an invariant (no GPU held twice, no job
//! lost, idempotent submission) is enforced here, at apply time, whatever the proposer believed.

mod apply;
#[cfg(test)]
mod apply_tests;
pub mod command;
#[cfg(test)]
mod proptests;
pub mod types;
pub mod validate;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use command::{
    Command, JobPlacement, Outcome, RejectKind, Rejection, Request, TaskOutcome, TaskPlacement,
};
pub use types::*;

/// Extra per-allocation bookkeeping that only the state machine needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationRecord {
    pub allocation: Allocation,
    /// The agent reported the task's process started.
    pub started: bool,
    /// The job ended (cancelled, failed elsewhere, lost); the agent must stop the task. The GPUs
    /// stay held until the agent reports the exit, so no new work lands on a GPU whose old
    /// process may still be running.
    pub stop_requested: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    pub nodes: BTreeMap<String, Node>,
    pub jobs: BTreeMap<JobId, Job>,
    pub allocations: BTreeMap<AllocationId, AllocationRecord>,
    /// GPU UUID → the live allocation holding it. Kept in step with `allocations` by `apply`;
    /// an index so that the double-booking check is a lookup, not a scan.
    pub gpu_holder: BTreeMap<String, AllocationId>,
    /// GPU UUID → node that reported it, so one GPU can never belong to two nodes.
    pub gpu_node: BTreeMap<String, String>,
    /// tenant → idempotency key → job.
    pub idempotency: BTreeMap<String, BTreeMap<String, JobId>>,
    pub tenants: BTreeMap<String, Tenant>,
    pub partitions: BTreeMap<String, Partition>,
    /// Last job id handed out; ids come from the log, so every replica agrees on them.
    pub last_job_id: JobId,
    pub last_allocation_id: AllocationId,
    /// Timestamp of the last applied command (leader's clock).
    pub last_applied_at: Timestamp,
}

/// What applying one command did: the outcome for the proposer and which jobs changed (for
/// watchers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub outcome: Outcome,
    pub changed_jobs: Vec<JobId>,
}

impl ClusterState {
    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id)
    }

    /// The job an idempotency key already created, if any.
    pub fn job_for_key(&self, tenant: &str, key: &str) -> Option<JobId> {
        self.idempotency.get(tenant)?.get(key).copied()
    }

    pub fn allocations_of(&self, job: JobId) -> impl Iterator<Item = &AllocationRecord> {
        self.jobs
            .get(&job)
            .into_iter()
            .flat_map(|j| j.allocations.iter())
            .filter_map(|a| self.allocations.get(a))
    }

    /// GPUs held by live allocations of a tenant's jobs (stopping ones included: they still
    /// occupy the cards).
    pub fn gpus_held_by_tenant(&self, tenant: &str) -> u64 {
        self.allocations
            .values()
            .filter(|r| {
                self.jobs
                    .get(&r.allocation.job)
                    .is_some_and(|j| j.spec.tenant == tenant)
            })
            .map(|r| r.allocation.gpus.len() as u64)
            .sum()
    }

    /// CPU (milli) and memory (MiB) requested by the live allocations on a node.
    pub fn node_usage(&self, node: &str) -> (u64, u64) {
        self.allocations
            .values()
            .filter(|r| r.allocation.node == node)
            .filter_map(|r| self.jobs.get(&r.allocation.job))
            .fold((0, 0), |(c, m), j| {
                (
                    c + j.spec.cpu_milli_per_task,
                    m + j.spec.memory_mib_per_task,
                )
            })
    }

    pub fn total_gpus(&self) -> usize {
        self.nodes.values().map(|n| n.spec.gpus.len()).sum()
    }

    /// Checks every internal index against the data it indexes. Used by tests and after loading
    /// a snapshot; returns the first inconsistency found.
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut derived_holder = BTreeMap::new();
        for (id, rec) in &self.allocations {
            if rec.allocation.id != *id {
                return Err(format!("allocation {id} is stored under the wrong id"));
            }
            let job = self
                .jobs
                .get(&rec.allocation.job)
                .ok_or_else(|| format!("allocation {id} names missing job"))?;
            if !job.allocations.contains(id) {
                return Err(format!("job {} does not list allocation {id}", job.id));
            }
            for gpu in &rec.allocation.gpus {
                if let Some(other) = derived_holder.insert(gpu.clone(), *id) {
                    return Err(format!("GPU {gpu} is held by allocations {other} and {id}"));
                }
            }
        }
        if derived_holder != self.gpu_holder {
            return Err("gpu_holder index differs from allocations".into());
        }
        for job in self.jobs.values() {
            for a in &job.allocations {
                if !self.allocations.contains_key(a) {
                    return Err(format!("job {} lists missing allocation {a}", job.id));
                }
            }
            if job.state == JobState::Pending && !job.allocations.is_empty() {
                return Err(format!("pending job {} holds allocations", job.id));
            }
        }
        Ok(())
    }
}
