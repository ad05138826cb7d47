//! `ClusterState::apply`: the single entry point that changes replicated state.
//!
//! Business rejections (bad input, unknown job, GPU already held) are returned as
//! `Outcome::Rejected` and leave the state untouched; apply itself never fails.

use std::collections::BTreeSet;

use super::command::{Command, JobPlacement, Outcome, Rejection, TaskOutcome};
use super::types::*;
use super::validate;
use super::{AllocationRecord, Applied, ClusterState};

impl ClusterState {
    /// Applies `command`, proposed at leader time `at`, as log entry `index`.
    pub fn apply(&mut self, command: &Command, at: Timestamp, index: u64) -> Applied {
        let mut changed = Vec::new();
        let outcome = match command {
            Command::SubmitJob {
                spec,
                idempotency_key,
            } => {
                // An empty key is no key (protobuf's default string).
                let key = idempotency_key.as_deref().filter(|k| !k.is_empty());
                self.submit(spec, key, at, index, &mut changed)
            }
            Command::CancelJob { job, reason } => {
                self.cancel(*job, reason, at, index, &mut changed)
            }
            Command::RegisterNode { spec } => self.register_node(spec, at),
            Command::Place { term, placements } => {
                self.place(*term, placements, at, index, &mut changed)
            }
            Command::AllocationStarted { allocation } => {
                self.allocation_started(*allocation, at, index, &mut changed)
            }
            Command::AllocationExited {
                allocation,
                outcome,
            } => self.allocation_exited(*allocation, outcome, at, index, &mut changed),
            Command::PutTenant { tenant } => match validate::validate_tenant(tenant) {
                Ok(()) => {
                    self.tenants.insert(tenant.name.clone(), tenant.clone());
                    Outcome::Done
                }
                Err(r) => Outcome::Rejected(r),
            },
            Command::SetNodeStatus {
                node,
                status,
                evict,
                reason,
            } => self.set_node_status(node, *status, *evict, reason, at, index, &mut changed),
            Command::NodeLost {
                node,
                reason,
                registered_at,
            } => match self.nodes.get(node) {
                Some(n) if n.registered_at != *registered_at => {
                    Outcome::Rejected(Rejection::precondition(format!(
                        "node {node} registered again since it was judged silent"
                    )))
                }
                _ => self.node_lost(node, reason, at, index, &mut changed),
            },
            Command::SetGpuHealth { node, gpu, health } => self.set_gpu_health(node, gpu, health),
            Command::PutPartition { partition } => match validate::validate_partition(partition) {
                Ok(()) => {
                    self.partitions
                        .insert(partition.name.clone(), partition.clone());
                    Outcome::Done
                }
                Err(r) => Outcome::Rejected(r),
            },
        };
        if !matches!(outcome, Outcome::Rejected(_)) {
            self.last_applied_at = self.last_applied_at.max(at);
        }
        changed.sort_unstable();
        changed.dedup();
        Applied {
            outcome,
            changed_jobs: changed,
        }
    }

    /// Checks a job spec against the cluster: what `validate_job_spec` cannot know alone.
    pub fn check_submission(&self, spec: &JobSpec) -> Result<(), Rejection> {
        validate::validate_job_spec(spec)?;
        if !self.tenants.is_empty() && !self.tenants.contains_key(&spec.tenant) {
            return Err(Rejection::invalid(
                "tenant",
                format!(
                    "unknown tenant {:?}; known tenants: {}",
                    spec.tenant,
                    join_keys(self.tenants.keys())
                ),
            ));
        }
        if let Some(p) = &spec.partition
            && !self.partitions.is_empty()
            && !self.partitions.contains_key(p)
        {
            return Err(Rejection::invalid(
                "partition",
                format!(
                    "unknown partition {p:?}; known partitions: {}",
                    join_keys(self.partitions.keys())
                ),
            ));
        }
        if !self.nodes.is_empty() {
            let largest = self
                .nodes
                .values()
                .map(|n| n.spec.gpus.len())
                .max()
                .unwrap_or(0);
            if spec.gpus_per_task as usize > largest {
                return Err(Rejection::invalid(
                    "gpus_per_task",
                    format!(
                        "{} GPUs per task, but the largest node has {largest}; \
                         use several tasks for a multi-node job",
                        spec.gpus_per_task
                    ),
                ));
            }
        }
        for dep in &spec.dependencies {
            if !self.jobs.contains_key(&dep.job) {
                return Err(Rejection::invalid(
                    "dependencies",
                    format!("job {} does not exist", dep.job),
                ));
            }
        }
        Ok(())
    }

    fn submit(
        &mut self,
        spec: &JobSpec,
        key: Option<&str>,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        if let Some(key) = key {
            if let Err(r) = validate::validate_idempotency_key(key) {
                return Outcome::Rejected(r);
            }
            if let Some(id) = self.job_for_key(&spec.tenant, key) {
                // A retry must be the same request; a different one reusing the key is a bug in
                // the client that we surface instead of silently returning an unrelated job.
                return match self.jobs.get(&id) {
                    Some(job) if job.spec == *spec => Outcome::JobSubmitted { id, created: false },
                    _ => Outcome::Rejected(Rejection::precondition(format!(
                        "idempotency key {key:?} was already used for job {id} with a different spec"
                    ))),
                };
            }
        }
        if let Err(r) = self.check_submission(spec) {
            return Outcome::Rejected(r);
        }
        self.last_job_id += 1;
        let id = self.last_job_id;
        let job = Job {
            id,
            spec: spec.clone(),
            idempotency_key: key.map(str::to_owned),
            state: JobState::Pending,
            submitted_at: at,
            history: vec![StateChange {
                at,
                state: JobState::Pending,
                reason: "submitted".into(),
            }],
            allocations: Vec::new(),
            version: index,
            ending: None,
        };
        self.jobs.insert(id, job);
        if let Some(key) = key {
            self.idempotency
                .entry(spec.tenant.clone())
                .or_default()
                .insert(key.to_owned(), id);
        }
        changed.push(id);
        Outcome::JobSubmitted { id, created: true }
    }

    fn cancel(
        &mut self,
        id: JobId,
        reason: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(job) = self.jobs.get(&id) else {
            return Outcome::Rejected(Rejection::not_found(format!("job {id} does not exist")));
        };
        if job.state.is_final() {
            return Outcome::Rejected(Rejection::precondition(format!(
                "job {id} already ended ({})",
                job.state
            )));
        }
        let reason = if reason.is_empty() {
            "cancelled by user"
        } else {
            reason
        };
        self.request_stop_of_all(id);
        if let Some(job) = self.jobs.get_mut(&id) {
            // The user's cancel decides the final state, whatever a failing task had set.
            job.ending = None;
        }
        self.transition(id, JobState::Cancelled, reason, at, index);
        changed.push(id);
        Outcome::JobCancelled { id }
    }

    fn register_node(&mut self, spec: &NodeSpec, at: Timestamp) -> Outcome {
        if let Err(r) = validate::validate_node_spec(spec) {
            return Outcome::Rejected(r);
        }
        for gpu in &spec.gpus {
            if let Some(owner) = self.gpu_node.get(&gpu.uuid)
                && owner != &spec.name
            {
                return Outcome::Rejected(Rejection::invalid(
                    "node.gpus.uuid",
                    format!("GPU {} is already registered by node {owner}", gpu.uuid),
                ));
            }
        }
        // GPUs a re-registration no longer reports are forgotten unless an allocation holds
        // them: a held GPU disappearing is a fault the agent reports separately.
        if let Some(old) = self.nodes.get(&spec.name) {
            let reported: BTreeSet<&str> = spec.gpus.iter().map(|g| g.uuid.as_str()).collect();
            for gpu in &old.spec.gpus {
                if !reported.contains(gpu.uuid.as_str()) && self.gpu_holder.contains_key(&gpu.uuid)
                {
                    return Outcome::Rejected(Rejection::precondition(format!(
                        "node {} no longer reports GPU {}, which allocation {} holds",
                        spec.name, gpu.uuid, self.gpu_holder[&gpu.uuid]
                    )));
                }
            }
            for gpu in &old.spec.gpus {
                if !reported.contains(gpu.uuid.as_str()) {
                    self.gpu_node.remove(&gpu.uuid);
                }
            }
        }
        for gpu in &spec.gpus {
            self.gpu_node.insert(gpu.uuid.clone(), spec.name.clone());
        }
        let mut spec = spec.clone();
        let drained = self.nodes.get(&spec.name).is_some_and(|n| n.drained);
        if let Some(old) = self.nodes.get(&spec.name) {
            // Health is the control plane's record (Xid reports, uncordon), not the agent's:
            // a GPU that failed stays cordoned across an agent restart or re-registration.
            for gpu in &mut spec.gpus {
                if let Some(known) = old.spec.gpus.iter().find(|g| g.uuid == gpu.uuid) {
                    gpu.health = known.health.clone();
                }
            }
        }
        let status = if drained {
            NodeStatus::Drained
        } else {
            NodeStatus::Ready
        };
        self.nodes.insert(
            spec.name.clone(),
            Node {
                spec,
                status,
                registered_at: at,
                drained,
            },
        );
        Outcome::NodeRegistered
    }

    fn place(
        &mut self,
        term: u64,
        placements: &[JobPlacement],
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        for p in placements {
            match self.check_placement(p) {
                Ok(()) => {
                    self.commit_placement(term, p, at, index);
                    accepted.push(p.job);
                    changed.push(p.job);
                }
                Err(reason) => rejected.push((p.job, reason)),
            }
        }
        Outcome::Placed { accepted, rejected }
    }

    /// The fit check that `apply` re-runs on every placement of a plan, against current state.
    pub fn check_placement(&self, p: &JobPlacement) -> Result<(), String> {
        let job = self
            .jobs
            .get(&p.job)
            .ok_or_else(|| format!("job {} does not exist", p.job))?;
        if job.state != JobState::Pending || !job.allocations.is_empty() {
            return Err(format!("job {} is {}, not pending", job.id, job.state));
        }
        // Invariant 5: a tenant never holds more than its limit.
        if let Some(t) = self.tenants.get(&job.spec.tenant)
            && t.max_gpus > 0
        {
            let held = self.gpus_held_by_tenant(&t.name);
            if held + job.spec.total_gpus() > u64::from(t.max_gpus) {
                return Err(format!(
                    "tenant {} holds {held} GPUs; {} more would exceed its limit of {}",
                    t.name,
                    job.spec.total_gpus(),
                    t.max_gpus
                ));
            }
        }
        if p.tasks.len() != job.spec.tasks as usize {
            return Err(format!(
                "job {} has {} tasks but the plan places {}",
                job.id,
                job.spec.tasks,
                p.tasks.len()
            ));
        }
        let mut in_plan = BTreeSet::new();
        let mut tasks_per_node: std::collections::BTreeMap<&str, u64> = Default::default();
        for task in &p.tasks {
            *tasks_per_node.entry(task.node.as_str()).or_default() += 1;
        }
        for (name, count) in &tasks_per_node {
            if let Some(node) = self.nodes.get(*name) {
                let (cpu, mem) = self.node_usage(name);
                let want_cpu = cpu + count * job.spec.cpu_milli_per_task;
                let want_mem = mem + count * job.spec.memory_mib_per_task;
                if want_cpu > node.spec.cpu_milli || want_mem > node.spec.memory_mib {
                    return Err(format!(
                        "node {name} lacks CPU or memory: {want_cpu} of {} mCPU, {want_mem} of {} MiB",
                        node.spec.cpu_milli, node.spec.memory_mib
                    ));
                }
            }
        }
        for task in &p.tasks {
            let node = self
                .nodes
                .get(&task.node)
                .ok_or_else(|| format!("node {} does not exist", task.node))?;
            if node.status != NodeStatus::Ready {
                return Err(format!("node {} is {}", task.node, node.status.as_str()));
            }
            if let Some(part) = &job.spec.partition
                && node.spec.partition.as_deref() != Some(part.as_str())
            {
                return Err(format!("node {} is not in partition {part}", task.node));
            }
            if task.gpus.len() != job.spec.gpus_per_task as usize {
                return Err(format!(
                    "task on {} gets {} GPUs, job asks for {}",
                    task.node,
                    task.gpus.len(),
                    job.spec.gpus_per_task
                ));
            }
            for uuid in &task.gpus {
                let gpu = node
                    .spec
                    .gpus
                    .iter()
                    .find(|g| &g.uuid == uuid)
                    .ok_or_else(|| format!("GPU {uuid} is not on node {}", task.node))?;
                if gpu.health != GpuHealth::Healthy {
                    return Err(format!("GPU {uuid} is unhealthy"));
                }
                if !job.spec.gpu_models.is_empty() && !job.spec.gpu_models.contains(&gpu.model) {
                    return Err(format!(
                        "GPU {uuid} is a {}, job wants {:?}",
                        gpu.model, job.spec.gpu_models
                    ));
                }
                if let Some(holder) = self.gpu_holder.get(uuid) {
                    return Err(format!("GPU {uuid} is already held by allocation {holder}"));
                }
                if !in_plan.insert(uuid.as_str()) {
                    return Err(format!("GPU {uuid} is placed twice in one plan"));
                }
            }
        }
        Ok(())
    }

    fn commit_placement(&mut self, term: u64, p: &JobPlacement, at: Timestamp, index: u64) {
        let mut ids = Vec::with_capacity(p.tasks.len());
        for task in &p.tasks {
            self.last_allocation_id += 1;
            let id = self.last_allocation_id;
            for gpu in &task.gpus {
                self.gpu_holder.insert(gpu.clone(), id);
            }
            self.allocations.insert(
                id,
                AllocationRecord {
                    allocation: Allocation {
                        id,
                        job: p.job,
                        node: task.node.clone(),
                        gpus: task.gpus.clone(),
                        term,
                        created_at: at,
                    },
                    started: false,
                    stop_requested: false,
                },
            );
            ids.push(id);
        }
        if let Some(job) = self.jobs.get_mut(&p.job) {
            job.allocations = ids;
        }
        let nodes: Vec<&str> = p.tasks.iter().map(|t| t.node.as_str()).collect();
        let reason = format!("placed on {}", nodes.join(","));
        self.transition(p.job, JobState::Scheduled, &reason, at, index);
    }

    fn allocation_started(
        &mut self,
        id: AllocationId,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(rec) = self.allocations.get_mut(&id) else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "allocation {id} does not exist"
            )));
        };
        rec.started = true;
        let job_id = rec.allocation.job;
        let all_started = self.allocations_of(job_id).all(|r| r.started);
        if let Some(job) = self.jobs.get(&job_id)
            && job.state == JobState::Scheduled
            && job.ending.is_none()
            && all_started
        {
            self.transition(job_id, JobState::Running, "all tasks started", at, index);
            changed.push(job_id);
        }
        Outcome::Done
    }

    fn allocation_exited(
        &mut self,
        id: AllocationId,
        outcome: &TaskOutcome,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(rec) = self.allocations.remove(&id) else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "allocation {id} does not exist"
            )));
        };
        for gpu in &rec.allocation.gpus {
            self.gpu_holder.remove(gpu);
        }
        let job_id = rec.allocation.job;
        changed.push(job_id);
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Outcome::Done;
        };
        job.allocations.retain(|a| *a != id);
        job.version = index;
        let remaining = job.allocations.len();
        if job.state.is_final() {
            // Cancelled (or otherwise ended) earlier; this exit only frees the GPUs.
            return Outcome::Done;
        }
        // What this task's end means for the whole job.
        let ending = match outcome {
            TaskOutcome::Succeeded => None,
            TaskOutcome::Failed {
                exit_code,
                signal,
                reason,
            } => Some(Ending {
                state: JobState::Failed,
                reason: describe_failure(*exit_code, *signal, reason),
            }),
            TaskOutcome::TimedOut => Some(Ending {
                state: JobState::TimedOut,
                reason: "time limit reached".into(),
            }),
            TaskOutcome::Lost { reason } => Some(Ending {
                state: JobState::Pending,
                reason: format!("requeued: {reason}"),
            }),
            // Stopped on request: the ending recorded with the request decides; a stop nobody
            // asked for (none recorded) requeues, which never loses work.
            TaskOutcome::Stopped => Some(Ending {
                state: JobState::Pending,
                reason: "requeued: task stopped".into(),
            }),
        };
        if let Some(e) = ending
            && job.ending.is_none()
        {
            job.ending = Some(e);
            self.request_stop_of_all(job_id);
        }
        if remaining > 0 {
            // A task that exited had started, even if its start report was never applied: once
            // every remaining task has started too, the job is running.
            let all_started = self.allocations_of(job_id).all(|r| r.started);
            if let Some(job) = self.jobs.get(&job_id)
                && job.state == JobState::Scheduled
                && job.ending.is_none()
                && all_started
            {
                self.transition(job_id, JobState::Running, "all tasks started", at, index);
            }
            return Outcome::Done;
        }
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Outcome::Done;
        };
        let end = job.ending.take().unwrap_or(Ending {
            state: JobState::Succeeded,
            reason: "all tasks exited 0".into(),
        });
        self.transition(job_id, end.state, &end.reason, at, index);
        Outcome::Done
    }

    #[allow(clippy::too_many_arguments)]
    fn set_node_status(
        &mut self,
        name: &str,
        status: NodeStatus,
        evict: bool,
        reason: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(node) = self.nodes.get_mut(name) else {
            return Outcome::Rejected(Rejection::not_found(format!("node {name} does not exist")));
        };
        if status == NodeStatus::Down {
            return self.node_lost(name, reason, at, index, changed);
        }
        node.drained = status == NodeStatus::Drained;
        // A node that is down stays down until its agent registers again.
        if node.status != NodeStatus::Down {
            node.status = status;
        }
        if evict {
            let reason = if reason.is_empty() {
                "evicted: node drained"
            } else {
                reason
            };
            for job in self.jobs_on_node(name) {
                self.end_job_requeue(job, reason);
                changed.push(job);
            }
        }
        Outcome::Done
    }

    /// Releases every allocation on a node whose lease expired. Only the leader's liveness loop
    /// proposes this, after lease + grace, by which time the agent has stopped its processes.
    fn node_lost(
        &mut self,
        name: &str,
        reason: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(node) = self.nodes.get_mut(name) else {
            return Outcome::Rejected(Rejection::not_found(format!("node {name} does not exist")));
        };
        node.status = NodeStatus::Down;
        let on_node: Vec<AllocationId> = self
            .allocations
            .values()
            .filter(|r| r.allocation.node == name)
            .map(|r| r.allocation.id)
            .collect();
        let reason = if reason.is_empty() {
            "node lost"
        } else {
            reason
        };
        for id in on_node {
            self.allocation_exited(
                id,
                &TaskOutcome::Lost {
                    reason: format!("node {name}: {reason}"),
                },
                at,
                index,
                changed,
            );
        }
        Outcome::Done
    }

    fn set_gpu_health(&mut self, node: &str, gpu: &str, health: &GpuHealth) -> Outcome {
        let Some(n) = self.nodes.get_mut(node) else {
            return Outcome::Rejected(Rejection::not_found(format!("node {node} does not exist")));
        };
        let Some(g) = n
            .spec
            .gpus
            .iter_mut()
            .find(|g| g.uuid == gpu || g.index.to_string() == gpu)
        else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "node {node} has no GPU {gpu}"
            )));
        };
        // The allocation on an unhealthy GPU is not released here: the agent stops the process
        // and reports the exit, and only then is the GPU free (never two processes on a GPU).
        g.health = health.clone();
        Outcome::Done
    }

    fn jobs_on_node(&self, node: &str) -> Vec<JobId> {
        let mut jobs: Vec<JobId> = self
            .allocations
            .values()
            .filter(|r| r.allocation.node == node)
            .map(|r| r.allocation.job)
            .collect();
        jobs.sort_unstable();
        jobs.dedup();
        jobs
    }

    /// Asks every task of a running job to stop and requeues the job once they have.
    pub(super) fn end_job_requeue(&mut self, job: JobId, reason: &str) {
        let Some(j) = self.jobs.get_mut(&job) else {
            return;
        };
        if j.state.is_final() {
            return;
        }
        if j.ending.is_none() {
            j.ending = Some(Ending {
                state: JobState::Pending,
                reason: format!("requeued: {reason}"),
            });
        }
        self.request_stop_of_all(job);
    }

    fn request_stop_of_all(&mut self, job: JobId) {
        let ids: Vec<AllocationId> = self
            .jobs
            .get(&job)
            .map(|j| j.allocations.clone())
            .unwrap_or_default();
        for id in ids {
            if let Some(rec) = self.allocations.get_mut(&id) {
                rec.stop_requested = true;
            }
        }
    }

    fn transition(&mut self, id: JobId, state: JobState, reason: &str, at: Timestamp, index: u64) {
        if let Some(job) = self.jobs.get_mut(&id) {
            job.state = state;
            job.version = index;
            job.history.push(StateChange {
                at,
                state,
                reason: reason.to_owned(),
            });
        }
    }
}

fn describe_failure(exit_code: Option<i32>, signal: Option<i32>, reason: &str) -> String {
    let mut parts = Vec::new();
    if let Some(c) = exit_code {
        parts.push(format!("exit code {c}"));
    }
    if let Some(s) = signal {
        parts.push(format!("signal {s}"));
    }
    if !reason.is_empty() {
        parts.push(reason.to_owned());
    }
    if parts.is_empty() {
        "failed".into()
    } else {
        parts.join(", ")
    }
}

fn join_keys<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = keys.map(String::as_str).collect();
    v.join(", ")
}
