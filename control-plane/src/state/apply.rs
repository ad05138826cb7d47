//! `ClusterState::apply`: the single entry point that changes replicated state.
//!
//! Business rejections (bad input, unknown job, GPU already held) are returned as
//! `Outcome::Rejected` and leave the state untouched; apply itself never fails.

use std::collections::BTreeSet;

use super::command::{
    Command, JobChange, JobPlacement, JobUpdate, Outcome, Rejection, TaskOutcome, TaskUsage,
};
use super::format;
use super::types::*;
use super::validate;
use super::{AllocationRecord, Applied, ClusterState, index_allocation};

impl ClusterState {
    /// Applies `command`, proposed at leader time `at`, as log entry `index`.
    pub fn apply(&mut self, command: &Command, at: Timestamp, index: u64) -> Applied {
        let mut changed = Vec::new();
        let outcome = match command {
            Command::Batch { commands } => Outcome::Batch(
                commands
                    .iter()
                    .map(|c| self.apply_one(c, at, index, &mut changed))
                    .collect(),
            ),
            single => self.apply_one(single, at, index, &mut changed),
        };
        self.reconcile_touched_services(at, index, &mut changed);
        changed.append(&mut self.cascaded);
        changed.sort_unstable();
        changed.dedup();
        Applied {
            outcome,
            changed_jobs: changed,
        }
    }

    /// Applies one command that is not a batch, recording the jobs it changed in `changed`.
    fn apply_one(
        &mut self,
        command: &Command,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        // Every replica refuses alike, whatever binary it runs, so the states never differ.
        if let Err(r) = command.check_allowed_at(self.cluster_version) {
            return Outcome::Rejected(r);
        }
        let outcome = match command {
            Command::SubmitJob {
                spec,
                idempotency_key,
            } => {
                // An empty key is no key (protobuf's default string).
                let key = idempotency_key.as_deref().filter(|k| !k.is_empty());
                if (spec.workdir.is_some()
                    || spec.stdout_path.is_some()
                    || spec.stderr_path.is_some())
                    && !self.cluster_version.allows(2)
                {
                    // Format 1 has no working directory nor output files; a format-1 replica
                    // would not keep them.
                    let mut spec = spec.clone();
                    spec.workdir = None;
                    spec.stdout_path = None;
                    spec.stderr_path = None;
                    return self.submit(&spec, key, at, index, changed);
                }
                self.submit(spec, key, at, index, changed)
            }
            Command::CancelJob { job, reason } => self.cancel(*job, reason, at, index, changed),
            Command::RegisterNode { spec } => self.register_node(spec, at, index, changed),
            Command::Place { term, placements } => {
                let outcome = self.place(*term, placements, at, index, changed);
                // Only a plan that placed something counts: a refused one changes nothing.
                if matches!(&outcome, Outcome::Placed { accepted, .. } if !accepted.is_empty()) {
                    self.placement_term = self.placement_term.max(*term);
                }
                outcome
            }
            Command::AllocationStarted { allocation } => {
                self.allocation_started(*allocation, at, index, changed)
            }
            Command::AllocationExited {
                allocation,
                outcome,
                usage,
            } => {
                // Format 1 has no usage; a format-1 replica would not keep it.
                let usage = usage.filter(|_| self.cluster_version.allows(2));
                self.allocation_exited(*allocation, outcome, usage, at, index, changed)
            }
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
            } => self.set_node_status(node, *status, *evict, reason, at, index, changed),
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
                _ => self.node_lost(node, reason, at, index, changed),
            },
            Command::SetGpuHealth { node, gpu, health } => self.set_gpu_health(node, gpu, health),
            Command::Preempt {
                for_job,
                victims,
                reason,
            } => self.preempt(*for_job, victims, reason, at, index, changed),
            Command::PutPartition { partition } => match validate::validate_partition(partition) {
                Ok(()) => {
                    self.partitions
                        .insert(partition.name.clone(), partition.clone());
                    Outcome::Done
                }
                Err(r) => Outcome::Rejected(r),
            },
            Command::CompactJobs { retention, limit } => {
                // Format 1 has no limit; a format-1 replica would compact everything due.
                let limit = limit.filter(|_| self.cluster_version.allows(2));
                self.compact_jobs(retention, limit, at)
            }
            Command::Batch { .. } => Outcome::Rejected(Rejection::invalid(
                "command",
                "a batch cannot contain another batch",
            )),
            Command::CreateToken { token } => self.create_token(token, at),
            Command::RevokeToken { id, by } => self.revoke_token(id, by, at),
            // Nothing to change: the audit record is the point.
            Command::AuditNote { .. } => Outcome::Done,
            Command::CompactAudit { retention } => self.compact_audit(retention, at),
            Command::SetClusterVersion { version } => self.set_cluster_version(*version),
            Command::ChangeJobs { jobs, change } => {
                self.change_jobs(jobs, change, at, index, changed)
            }
            Command::PutService { spec, create_only } => {
                self.put_service(spec, *create_only, at, index)
            }
            Command::ScaleService {
                service,
                replicas,
                reason,
            } => self.scale_service(service, *replicas, reason, at, index),
            Command::DeleteService { service } => self.delete_service(service, at, index),
            Command::ServiceRollout { service, action } => {
                self.service_rollout(service, action, at, index)
            }
            Command::ReplicaReadiness {
                allocation,
                ready,
                reason,
            } => self.replica_readiness(*allocation, *ready, reason, at, index, changed),
            Command::Attributed { actor, command } => match **command {
                Command::Batch { .. } | Command::Attributed { .. } => Outcome::Rejected(
                    Rejection::invalid("command", "an attributed command holds one plain command"),
                ),
                ref inner => {
                    if let Some(node) = actor.node()
                        && let Err(r) = self.check_node_acts_for(node, inner)
                    {
                        return Outcome::Rejected(r);
                    }
                    let target = self.audit_target(inner);
                    let outcome = self.apply_one(inner, at, index, changed);
                    if !matches!(outcome, Outcome::Rejected(_)) {
                        self.record_audit(actor, inner, target, &outcome, at);
                    }
                    outcome
                }
            },
        };
        if !matches!(outcome, Outcome::Rejected(_)) {
            self.last_applied_at = self.last_applied_at.max(at);
        }
        outcome
    }

    /// Raises the cluster version; never lowers it, and never past what this binary reads
    /// (the state machine stops before applying such an entry: `raft::state_machine`).
    fn set_cluster_version(&mut self, version: format::FormatVersion) -> Outcome {
        if version > format::CURRENT {
            return Outcome::Rejected(Rejection::precondition(format!(
                "cluster version {version} is newer than this release reads ({})",
                format::CURRENT
            )));
        }
        if version < self.cluster_version.0 {
            return Outcome::Rejected(Rejection::precondition(format!(
                "the cluster version is {} and is never lowered (asked for {version})",
                self.cluster_version.0
            )));
        }
        self.cluster_version = format::ClusterVersion(version);
        Outcome::Done
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
        // A job larger than its tenant's limit could never start: refuse it now rather than
        // leave it pending forever.
        if let Some(t) = self.tenants.get(&spec.tenant)
            && t.max_gpus > 0
            && spec.total_gpu_milli() > u64::from(t.max_gpus) * MILLI_PER_GPU
        {
            return Err(Rejection::invalid(
                "gpus",
                format!(
                    "the job needs {} GPUs in all, more than tenant {:?} may hold (max_gpus {}); \
                     ask for fewer or raise the tenant's limit",
                    spec.total_gpu_milli().div_ceil(MILLI_PER_GPU),
                    t.name,
                    t.max_gpus
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
        // Held if unfit: accepted whatever the nodes are, pending until one fits (or until
        // the nodes it names join).
        if spec.hold_if_unfit {
            return self.check_dependencies(spec);
        }
        self.check_named_nodes(spec)?;
        if !self.nodes.is_empty() && spec.mig_profile.is_none() {
            let largest = self
                .candidate_nodes(spec)
                .map(|n| n.spec.gpus.len())
                .max()
                .unwrap_or(0);
            if spec.gpus_per_task as usize > largest {
                return Err(Rejection::invalid(
                    "gpus_per_task",
                    format!(
                        "{} GPUs per task, but the largest node{} has {largest}; \
                         use several tasks for a multi-node job",
                        spec.gpus_per_task,
                        if spec.nodelist.is_empty() && spec.exclude.is_empty() {
                            ""
                        } else {
                            " its --nodelist/--exclude allows"
                        }
                    ),
                ));
            }
        }
        if !self.nodes.is_empty() {
            self.check_some_node_fits(spec)?;
        }
        self.check_dependencies(spec)
    }

    /// Every node a `--nodelist` or `--exclude` names is registered (a typo would otherwise
    /// leave the job pending for ever, or not exclude what was meant).
    fn check_named_nodes(&self, spec: &JobSpec) -> Result<(), Rejection> {
        if self.nodes.is_empty() {
            return Ok(());
        }
        for (field, list) in [("nodelist", &spec.nodelist), ("exclude", &spec.exclude)] {
            if let Some(unknown) = list.iter().find(|n| !self.nodes.contains_key(*n)) {
                return Err(Rejection::invalid(
                    field,
                    format!(
                        "node {} is not registered ({} nodes are; `gpuctl nodes` lists them)",
                        validate::shown(unknown),
                        self.nodes.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The nodes that could hold a task of the job as far as its node lists say: one node of
    /// each hardware class when it names none (they are alike), else every node it allows.
    fn candidate_nodes<'a>(&'a self, spec: &'a JobSpec) -> Box<dyn Iterator<Item = &'a Node> + 'a> {
        if spec.nodelist.is_empty() && spec.exclude.is_empty() {
            return Box::new(self.node_per_class());
        }
        Box::new(
            self.nodes
                .values()
                .filter(|n| spec.allows_node(&n.spec.name)),
        )
    }

    /// Every dependency names a job this state knows (kept whole or archived).
    fn check_dependencies(&self, spec: &JobSpec) -> Result<(), Rejection> {
        for dep in &spec.dependencies {
            if self.job_outcome(dep.job).is_none() {
                return Err(Rejection::invalid(
                    "dependencies",
                    self.missing_job(dep.job),
                ));
            }
        }
        Ok(())
    }

    /// An impossible job is refused at submission, with the reason, rather than left pending
    /// forever: no node has the GPU models, MIG slices or GPU memory it asks for.
    fn check_some_node_fits(&self, spec: &JobSpec) -> Result<(), Rejection> {
        let model_ok = |g: &Gpu| spec.gpu_models.is_empty() || spec.gpu_models.contains(&g.model);
        let units = |n: &Node| -> usize {
            match &spec.mig_profile {
                Some(p) => n
                    .spec
                    .gpus
                    .iter()
                    .filter(|g| model_ok(g))
                    .flat_map(|g| g.mig.iter())
                    .filter(|m| &m.profile == p)
                    .count(),
                None => n
                    .spec
                    .gpus
                    .iter()
                    .filter(|g| model_ok(g) && g.mig.is_empty())
                    .filter(|g| {
                        !spec.is_share() || share_memory_mib(spec, g.memory_mib) <= g.memory_mib
                    })
                    .count(),
            }
        };
        if spec.gpus_per_task == 0
            || self
                .candidate_nodes(spec)
                .any(|n| units(n) >= spec.gpus_per_task as usize)
        {
            return Ok(());
        }
        let what = match (&spec.mig_profile, spec.is_share()) {
            (Some(p), _) => format!("{} MIG slices of profile {p}", spec.gpus_per_task),
            (None, true) => format!(
                "a GPU with {} MiB of memory for the share",
                spec.gpu_memory_mib
            ),
            (None, false) => format!("{} GPUs", spec.gpus_per_task),
        };
        let models = if spec.gpu_models.is_empty() {
            String::new()
        } else {
            format!(" of model {}", spec.gpu_models.join("|"))
        };
        Err(Rejection::invalid(
            "gpus_per_task",
            format!("no node has {what}{models}; the job could never start"),
        ))
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
                // An archived job kept only its spec's fingerprint, which is enough to tell.
                let same = match (self.jobs.get(&id), self.archived.get(&id)) {
                    (Some(job), _) => job.spec == *spec,
                    (None, Some(a)) => a.spec_fingerprint == super::spec_fingerprint(spec),
                    (None, None) => false,
                };
                return match same {
                    true => Outcome::JobSubmitted { id, created: false },
                    false => Outcome::Rejected(Rejection::precondition(format!(
                        "idempotency key {key:?} was already used for job {id} with a different spec"
                    ))),
                };
            }
        }
        if let Err(r) = self.check_submission(spec) {
            return Outcome::Rejected(r);
        }
        // An array is one job per index, with consecutive ids; the first id is the array's
        // and carries the idempotency key.
        let indices = spec.array.as_ref().map(ArraySpec::indices);
        let first = self.last_job_id + 1;
        let count = indices.as_ref().map_or(1, Vec::len) as u32;
        let array_tasks: Vec<Option<ArrayTask>> = match &indices {
            None => vec![None],
            Some(indices) => indices
                .iter()
                .map(|&i| {
                    Some(ArrayTask {
                        array_id: first,
                        index: i,
                        count,
                    })
                })
                .collect(),
        };
        for (n, array_task) in array_tasks.into_iter().enumerate() {
            let key = if n == 0 { key } else { None };
            self.create_job(spec, key, array_task, at, index, changed);
        }
        Outcome::JobSubmitted {
            id: first,
            created: true,
        }
    }

    /// Adds one pending job (a submission, or one job of an array) with the next id.
    pub(super) fn create_job(
        &mut self,
        spec: &JobSpec,
        key: Option<&str>,
        array_task: Option<ArrayTask>,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) {
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
                reason: if spec.hold {
                    "submitted held".into()
                } else {
                    "submitted".into()
                },
            }],
            allocations: Vec::new(),
            version: index,
            ending: None,
            yielded_to: None,
            usage: None,
            attempts: Vec::new(),
            held: spec.hold,
            array_task,
            exit: None,
            replica: None,
        };
        self.jobs.insert(id, job);
        self.index.pending.insert(id);
        for dep in &spec.dependencies {
            self.index.dependents.entry(dep.job).or_default().insert(id);
        }
        if let Some(key) = key {
            self.index
                .idempotency
                .entry(spec.tenant.clone())
                .or_default()
                .insert(key.to_owned(), id);
        }
        changed.push(id);
        // A dependency that already ended the wrong way can never be satisfied.
        if let Some(reason) = self.unsatisfiable_dependency(id) {
            self.transition(id, JobState::Failed, &reason, at, index);
            self.fail_unsatisfiable_dependents(id, at, index, changed);
        }
    }

    /// Why cancelling job `id` would be refused, if it would: the API asks before it proposes,
    /// so a refused cancel adds nothing to the log, and apply asks again.
    pub fn cancel_refusal(&self, id: JobId) -> Option<Rejection> {
        let Some(job) = self.jobs.get(&id) else {
            if let Some(a) = self.archived.get(&id) {
                return Some(Rejection::precondition(format!(
                    "job {id} already ended ({}) and is archived",
                    a.state
                )));
            }
            return Some(Rejection::not_found(self.missing_job(id)));
        };
        job.state
            .is_final()
            .then(|| Rejection::precondition(format!("job {id} already ended ({})", job.state)))
    }

    /// Why a command naming node `name` (and, when given, its GPU `gpu` by UUID or index)
    /// would be refused for naming something that does not exist.
    pub fn node_refusal(&self, name: &str, gpu: Option<&str>) -> Option<Rejection> {
        let Some(node) = self.nodes.get(name) else {
            return Some(Rejection::not_found(format!(
                "node {} does not exist",
                validate::shown(name)
            )));
        };
        let gpu = gpu?;
        (!node
            .spec
            .gpus
            .iter()
            .any(|g| g.uuid == gpu || g.index.to_string() == gpu))
        .then(|| Rejection::not_found(format!("node {name} has no GPU {}", validate::shown(gpu))))
    }

    pub(super) fn cancel(
        &mut self,
        id: JobId,
        reason: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        if let Some(refusal) = self.cancel_refusal(id) {
            return Outcome::Rejected(refusal);
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

    /// Applies `Command::ChangeJobs`: the change to each job it applies to.
    fn change_jobs(
        &mut self,
        jobs: &[JobId],
        change: &JobChange,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        if jobs.is_empty() {
            return Outcome::Rejected(Rejection::invalid("jobs", "names no job"));
        }
        if jobs.len() > validate::MAX_ARRAY_TASKS {
            return Outcome::Rejected(Rejection::invalid(
                "jobs",
                format!(
                    "names {} jobs; one change takes at most {}",
                    jobs.len(),
                    validate::MAX_ARRAY_TASKS
                ),
            ));
        }
        let mut done = Vec::new();
        let mut refused: Vec<(JobId, String)> = Vec::new();
        let mut first_refusal = None;
        for &id in jobs {
            match self.change_job(id, change, at, index) {
                Ok(()) => {
                    done.push(id);
                    changed.push(id);
                }
                Err(r) => {
                    refused.push((id, r.message.clone()));
                    first_refusal.get_or_insert(r);
                }
            }
        }
        match (done.is_empty(), first_refusal) {
            (true, Some(r)) => Outcome::Rejected(r),
            _ => Outcome::JobsChanged {
                changed: done,
                refused,
            },
        }
    }

    /// Why `change` would be refused for job `id`, if it would: the API asks before it
    /// proposes (a refused change adds nothing to the log), and apply asks again.
    pub fn change_refusal(&self, id: JobId, change: &JobChange) -> Option<Rejection> {
        if let JobChange::Cancel { .. } = change {
            return self.cancel_refusal(id);
        }
        let verb = change.verb();
        let Some(job) = self.jobs.get(&id) else {
            if self.archived.contains_key(&id) {
                return Some(Rejection::precondition(format!(
                    "job {id} ended long ago and is archived: nothing to {verb}"
                )));
            }
            return Some(Rejection::not_found(self.missing_job(id)));
        };
        let precondition = |m: String| Some(Rejection::precondition(m));
        if let Some(r) = &job.replica
            && matches!(
                change,
                JobChange::Hold | JobChange::Release | JobChange::Update(_)
            )
        {
            return precondition(format!(
                "job {id} is replica {} of service {}: change the service instead (gpuctl service update, scale)",
                r.ordinal, r.service
            ));
        }
        match change {
            JobChange::Hold if job.state != JobState::Pending => precondition(format!(
                "job {id} is {}: only a pending job can be held",
                job.state
            )),
            JobChange::Hold if job.held => precondition(format!("job {id} is already held")),
            JobChange::Release if job.state != JobState::Pending => {
                precondition(format!("job {id} is {}: nothing to release", job.state))
            }
            JobChange::Release if !job.held => precondition(format!("job {id} is not held")),
            JobChange::Requeue { .. } if job.state == JobState::Pending => {
                precondition(format!("job {id} is already pending"))
            }
            // A cancelled job whose tasks still stop: its allocations end it as it is.
            JobChange::Requeue { .. } if job.state.is_final() && !job.allocations.is_empty() => {
                precondition(format!(
                    "job {id} is {} and its tasks are still stopping; requeue it once they have",
                    job.state
                ))
            }
            JobChange::Requeue { .. } if !job.state.is_final() && job.ending.is_some() => {
                precondition(format!(
                    "job {id} is already ending ({}); requeue it once it has",
                    job.ending.as_ref().map_or("", |e| e.reason.as_str())
                ))
            }
            JobChange::Update(u) => self.update_refusal(job, u).err(),
            _ => None,
        }
    }

    /// The spec job `job` would have after update `u`, or why the update is refused.
    fn update_refusal(&self, job: &Job, u: &JobUpdate) -> Result<JobSpec, Rejection> {
        if u.is_empty() {
            return Err(Rejection::invalid("update", "changes nothing"));
        }
        if job.state.is_final() {
            return Err(Rejection::precondition(format!(
                "job {} already ended ({}): nothing to update",
                job.id, job.state
            )));
        }
        if job.state != JobState::Pending && !u.only_running_fields() {
            return Err(Rejection::precondition(format!(
                "job {} is {}: only a pending job's request changes (a running job's name \
                 and its array's limit do); requeue it first",
                job.id, job.state
            )));
        }
        let mut spec = job.spec.clone();
        if let Some(name) = &u.name {
            spec.name = name.clone();
        }
        if let Some(t) = u.time_limit_secs {
            spec.time_limit_secs = (t > 0).then_some(t);
        }
        if let Some(p) = &u.priority_class {
            spec.priority_class = p.clone();
        }
        if let Some(p) = &u.partition {
            spec.partition = (!p.is_empty()).then(|| p.clone());
        }
        if let Some(b) = u.begin_at {
            spec.begin_at = (b > 0).then_some(b);
        }
        if let Some(list) = &u.nodelist {
            spec.nodelist = list.clone();
        }
        if let Some(list) = &u.exclude {
            spec.exclude = list.clone();
        }
        if let Some(max) = u.max_running {
            match spec.array.as_mut() {
                Some(a) => a.max_running = max,
                None => {
                    return Err(Rejection::invalid(
                        "max_running",
                        format!("job {} is not part of an array", job.id),
                    ));
                }
            }
        }
        if job.state == JobState::Pending {
            self.check_submission(&spec)?;
        } else {
            validate::validate_job_spec(&spec)?;
        }
        Ok(spec)
    }

    /// Applies `change` to one job, or refuses it, changing nothing.
    fn change_job(
        &mut self,
        id: JobId,
        change: &JobChange,
        at: Timestamp,
        index: u64,
    ) -> Result<(), Rejection> {
        if let Some(r) = self.change_refusal(id, change) {
            return Err(r);
        }
        let note = |s: &mut Self, reason: String| {
            if let Some(job) = s.jobs.get_mut(&id) {
                job.version = index;
                job.history.push(StateChange {
                    at,
                    state: job.state,
                    reason,
                });
            }
        };
        match change {
            JobChange::Hold => {
                if let Some(job) = self.jobs.get_mut(&id) {
                    job.held = true;
                }
                note(self, "held".into());
            }
            // Waiting again from now: its queue time (aging, `eligible_since`) restarts, as
            // Slurm resets a released job's eligible time.
            JobChange::Release => {
                if let Some(job) = self.jobs.get_mut(&id) {
                    job.held = false;
                }
                note(self, "released".into());
            }
            JobChange::Requeue { reason } => {
                let reason = if reason.is_empty() {
                    "asked by the user"
                } else {
                    reason
                };
                let Some(job) = self.jobs.get(&id) else {
                    return Ok(());
                };
                if job.state.is_final() {
                    let ended = job.last_change_at();
                    self.index.finished.remove(&(ended, id));
                    if let Some(job) = self.jobs.get_mut(&id) {
                        job.yielded_to = None;
                    }
                    self.transition(
                        id,
                        JobState::Pending,
                        &format!("requeued: {reason}"),
                        at,
                        index,
                    );
                } else {
                    // Its tasks are asked to stop; the job goes back to the queue, with this
                    // reason, once they have (no history entry until then: a running job's
                    // history has one `running` entry per run).
                    self.stop_and_requeue(id, reason, None);
                    if let Some(job) = self.jobs.get_mut(&id) {
                        job.version = index;
                    }
                }
            }
            JobChange::Cancel { reason } => {
                let mut changed = Vec::new();
                if let Outcome::Rejected(r) = self.cancel(id, reason, at, index, &mut changed) {
                    return Err(r);
                }
                self.cascaded.extend(changed);
            }
            JobChange::Update(u) => {
                let Some(job) = self.jobs.get(&id) else {
                    return Ok(());
                };
                let spec = self.update_refusal(job, u)?;
                if let Some(job) = self.jobs.get_mut(&id) {
                    job.spec = spec;
                    job.version = index;
                }
            }
        }
        Ok(())
    }

    fn register_node(
        &mut self,
        spec: &NodeSpec,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        if let Err(r) = validate::validate_node_spec(spec) {
            return Outcome::Rejected(r);
        }
        // Another incarnation is another agent, with another state directory: it cannot find
        // the processes of the allocations placed on the node before, so it must not be handed
        // them (it would start each one again while the scheduler may already have placed it
        // elsewhere). The API accepts such a registration only once the previous agent has been
        // silent past lease and grace, so its processes have fenced themselves: the node's
        // allocations end as lost, as if the node had been declared lost first.
        let previous_agent_gone = self
            .nodes
            .get(&spec.name)
            .is_some_and(|old| old.spec.incarnation != spec.incarnation);
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
        // GPUs (and MIG slices) a re-registration no longer reports are forgotten unless an
        // allocation holds them: a held GPU disappearing is a fault the agent reports
        // separately.
        if let Some(old) = self.nodes.get(&spec.name) {
            let reported: BTreeSet<&str> = spec.gpus.iter().map(|g| g.uuid.as_str()).collect();
            let reported_slices: BTreeSet<&str> = spec
                .gpus
                .iter()
                .flat_map(|g| &g.mig)
                .map(|m| m.uuid.as_str())
                .collect();
            let gone = old
                .spec
                .gpus
                .iter()
                .map(|g| g.uuid.as_str())
                .filter(|u| !reported.contains(u))
                .chain(
                    old.spec
                        .gpus
                        .iter()
                        .flat_map(|g| &g.mig)
                        .map(|m| m.uuid.as_str())
                        .filter(|u| !reported_slices.contains(u)),
                );
            for uuid in gone.filter(|_| !previous_agent_gone) {
                // Held whole (or as a slice), or by shares, which `gpu_holder` does not list.
                let holder = self.gpu_holder.get(uuid).copied().or_else(|| {
                    let shares = self.index.gpu_shares.get(uuid)?;
                    shares.allocations.first().copied()
                });
                if let Some(holder) = holder {
                    return Outcome::Rejected(Rejection::precondition(format!(
                        "node {} no longer reports GPU {uuid}, which allocation {holder} holds",
                        spec.name
                    )));
                }
            }
            for gpu in &old.spec.gpus {
                if !reported.contains(gpu.uuid.as_str()) {
                    self.gpu_node.remove(&gpu.uuid);
                }
            }
        }
        if previous_agent_gone {
            let reason = format!(
                "node {}: registered again by another agent (incarnation {:?}); the previous agent's processes were fenced when its lease ran out",
                spec.name, spec.incarnation
            );
            self.lose_allocations_on(&spec.name, reason, at, index, changed);
        }
        for gpu in &spec.gpus {
            self.gpu_node.insert(gpu.uuid.clone(), spec.name.clone());
        }
        let mut spec = spec.clone();
        if !self.cluster_version.allows(2) {
            // Format 1 has no such field; a format-1 replica would not keep it.
            spec.agent_release.clear();
            spec.enforcement.clear();
            spec.container_runtime.clear();
        }
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
        let class = super::hardware_class(&spec);
        if let Some(old) = self.index.hardware_class.insert(spec.name.clone(), class)
            && let Some(names) = self.index.class_nodes.get_mut(&old)
        {
            names.remove(&spec.name);
            if names.is_empty() {
                self.index.class_nodes.remove(&old);
            }
        }
        self.index
            .class_nodes
            .entry(class)
            .or_default()
            .insert(spec.name.clone());
        let name = spec.name.clone();
        self.nodes.insert(
            spec.name.clone(),
            Node {
                spec,
                status,
                registered_at: at,
                drained,
            },
        );
        self.refresh_node_free(&name);
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
            match self.check_placement(p, at) {
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

    /// The fit check that `apply` re-runs on every placement of a plan, against current state
    /// at leader time `at`.
    pub fn check_placement(&self, p: &JobPlacement, at: Timestamp) -> Result<(), String> {
        let job = self
            .jobs
            .get(&p.job)
            .ok_or_else(|| format!("job {} does not exist", p.job))?;
        if job.state != JobState::Pending || !job.allocations.is_empty() {
            return Err(format!("job {} is {}, not pending", job.id, job.state));
        }
        self.check_job_may_start(job, at)?;
        // Invariant 5: a tenant never holds more than its limit.
        if let Some(t) = self.tenants.get(&job.spec.tenant)
            && t.max_gpus > 0
        {
            let held = self.gpu_milli_held_by_tenant(&t.name);
            let limit = u64::from(t.max_gpus) * MILLI_PER_GPU;
            if held + job.spec.total_gpu_milli() > limit {
                return Err(format!(
                    "tenant {} holds {} GPUs; {} more would exceed its limit of {}",
                    t.name,
                    milli_as_gpus(held),
                    milli_as_gpus(job.spec.total_gpu_milli()),
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
        // Shares this plan already gives out per GPU (a gang of shares may share a GPU).
        let mut shared_in_plan: std::collections::BTreeMap<&str, (u32, u64)> = Default::default();
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
        if !job.spec.ports.is_empty() {
            for (name, count) in &tasks_per_node {
                let want = job.spec.ports.len() * *count as usize;
                let ranged = self.nodes.get(*name).and_then(|n| n.spec.service_ports);
                if ranged.is_none() {
                    return Err(format!(
                        "node {name} hands out no ports (its agent has no --service-ports)"
                    ));
                }
                if self.free_ports(name, want, &[]).is_none() {
                    return Err(format!(
                        "node {name} has fewer than {want} service ports free"
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
            self.check_node_sharing(job, &task.node)?;
            if task.gpus.len() != job.spec.gpus_per_task as usize {
                return Err(format!(
                    "task on {} gets {} GPUs, job asks for {}",
                    task.node,
                    task.gpus.len(),
                    job.spec.gpus_per_task
                ));
            }
            for uuid in &task.gpus {
                let extra = shared_in_plan.get(uuid.as_str()).copied().unwrap_or((0, 0));
                let memory = self.check_gpu_unit(job, node, uuid, extra)?;
                if job.spec.is_share() {
                    let e = shared_in_plan.entry(uuid.as_str()).or_default();
                    e.0 += job.spec.gpu_milli;
                    e.1 += memory;
                } else if !in_plan.insert(uuid.as_str()) {
                    return Err(format!("GPU {uuid} is placed twice in one plan"));
                }
            }
        }
        Ok(())
    }

    /// What a job's own request and state say about starting now, whatever the nodes: held,
    /// a begin time in the future, or its array at its limit of running jobs.
    fn check_job_may_start(&self, job: &Job, at: Timestamp) -> Result<(), String> {
        if job.held {
            return Err(format!("job {} is held", job.id));
        }
        if let Some(begin) = job.spec.begin_at
            && begin > at
        {
            return Err(format!("job {} may not start before {begin}", job.id));
        }
        if let (Some(task), Some(array)) = (job.array_task, &job.spec.array)
            && array.max_running > 0
        {
            let running = self.array_jobs_running(task);
            if running >= array.max_running {
                return Err(format!(
                    "array {} has {running} of at most {} jobs running",
                    task.array_id, array.max_running
                ));
            }
        }
        Ok(())
    }

    /// Jobs of an array that hold allocations (placed, running or stopping).
    pub fn array_jobs_running(&self, task: ArrayTask) -> u32 {
        let end = task.array_id.saturating_add(u64::from(task.count));
        self.jobs
            .range(task.array_id..end)
            .filter(|(_, j)| !j.allocations.is_empty())
            .count() as u32
    }

    /// Whether a task of `job` may go on `node` as far as node lists and exclusive use say.
    fn check_node_sharing(&self, job: &Job, node: &str) -> Result<(), String> {
        if !job.spec.allows_node(node) {
            return Err(format!(
                "node {node} is not allowed for job {} (its --nodelist/--exclude)",
                job.id
            ));
        }
        let mut others = self
            .index
            .node_allocations
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|a| self.allocations.get(a))
            .map(|rec| rec.allocation.job)
            .filter(|&j| j != job.id);
        if job.spec.exclusive {
            if let Some(other) = others.next() {
                return Err(format!(
                    "job {} wants node {node} to itself, and job {other} runs there",
                    job.id
                ));
            }
        } else if let Some(other) =
            others.find(|j| self.jobs.get(j).is_some_and(|j| j.spec.exclusive))
        {
            return Err(format!("node {node} is held exclusively by job {other}"));
        }
        Ok(())
    }

    /// Whether one GPU unit of a task (a whole GPU, a MIG slice or a share of a GPU, by the
    /// job's kind) can be given to `job` on `node` now; `extra`: milli and memory of shares
    /// the same plan already puts on this GPU. Returns the GPU memory the unit takes (shares).
    fn check_gpu_unit(
        &self,
        job: &Job,
        node: &Node,
        uuid: &str,
        extra: (u32, u64),
    ) -> Result<u64, String> {
        let spec = &job.spec;
        // A MIG slice is named by its own UUID, under its parent GPU.
        let (gpu, slice) = match &spec.mig_profile {
            Some(profile) => {
                let (gpu, slice) = node
                    .spec
                    .gpus
                    .iter()
                    .find_map(|g| g.mig.iter().find(|m| m.uuid == uuid).map(|m| (g, m)))
                    .ok_or_else(|| format!("MIG slice {uuid} is not on node {}", node.spec.name))?;
                if &slice.profile != profile {
                    return Err(format!(
                        "MIG slice {uuid} is a {}, job wants {profile}",
                        slice.profile
                    ));
                }
                (gpu, Some(slice))
            }
            None => {
                let gpu = node
                    .spec
                    .gpus
                    .iter()
                    .find(|g| g.uuid == uuid)
                    .ok_or_else(|| format!("GPU {uuid} is not on node {}", node.spec.name))?;
                if !gpu.mig.is_empty() {
                    return Err(format!(
                        "GPU {uuid} is in MIG mode: ask for one of its slices (--mig PROFILE)"
                    ));
                }
                (gpu, None)
            }
        };
        if gpu.health != GpuHealth::Healthy {
            return Err(format!("GPU {} is unhealthy", gpu.uuid));
        }
        if !spec.gpu_models.is_empty() && !spec.gpu_models.contains(&gpu.model) {
            return Err(format!(
                "GPU {} is a {}, job wants {:?}",
                gpu.uuid, gpu.model, spec.gpu_models
            ));
        }
        if let Some(holder) = self.gpu_holder.get(uuid) {
            return Err(format!("GPU {uuid} is already held by allocation {holder}"));
        }
        if slice.is_some() {
            return Ok(0);
        }
        let shares = self.index.gpu_shares.get(uuid);
        if !spec.is_share() {
            return match shares {
                Some(s) => Err(format!(
                    "GPU {uuid} is shared by allocations {:?}",
                    s.allocations
                )),
                None => Ok(0),
            };
        }
        let (milli, memory) = shares.map_or((0, 0), |s| (s.milli, s.memory_mib));
        let (milli, memory) = (milli + extra.0, memory + extra.1);
        if u64::from(milli + spec.gpu_milli) > MILLI_PER_GPU {
            return Err(format!(
                "GPU {uuid} has {} milli free, the share asks for {}",
                MILLI_PER_GPU - u64::from(milli),
                spec.gpu_milli
            ));
        }
        let want = share_memory_mib(spec, gpu.memory_mib);
        if memory + want > gpu.memory_mib {
            return Err(format!(
                "GPU {uuid} has {} MiB of memory free, the share asks for {want}",
                gpu.memory_mib.saturating_sub(memory)
            ));
        }
        Ok(want)
    }

    fn commit_placement(&mut self, term: u64, p: &JobPlacement, at: Timestamp, index: u64) {
        self.commit_placement_with(term, p, at, index, PlacementExtras::default());
    }

    /// Commits a placement that `check_placement` accepted, with what a restart in place adds.
    pub(super) fn commit_placement_with(
        &mut self,
        term: u64,
        p: &JobPlacement,
        at: Timestamp,
        index: u64,
        extras: PlacementExtras,
    ) {
        let mut ids = Vec::with_capacity(p.tasks.len());
        let Some(job) = self.jobs.get(&p.job) else {
            return;
        };
        let spec = job.spec.clone();
        // Ports given out by this placement so far, per node (tasks of a gang may share one).
        let mut taken: std::collections::BTreeMap<&str, Vec<u16>> = Default::default();
        for task in &p.tasks {
            let ports = if spec.ports.is_empty() {
                Vec::new()
            } else {
                let mine = taken.entry(task.node.as_str()).or_default();
                let keep = extras
                    .ports
                    .as_ref()
                    .filter(|ports| ports.len() == spec.ports.len())
                    .filter(|ports| {
                        let used = self.ports_in_use(&task.node);
                        ports.iter().all(|p| !used.contains(p) && !mine.contains(p))
                    });
                let ports = match keep {
                    Some(ports) => ports.clone(),
                    None => self
                        .free_ports(&task.node, spec.ports.len(), mine)
                        .unwrap_or_default(),
                };
                mine.extend(&ports);
                ports
            };
            self.last_allocation_id += 1;
            let id = self.last_allocation_id;
            let (gpu_milli, gpu_memory_mib) = if spec.is_share() {
                let gpu_memory = task
                    .gpus
                    .first()
                    .and_then(|u| {
                        self.nodes
                            .get(&task.node)?
                            .spec
                            .gpus
                            .iter()
                            .find(|g| &g.uuid == u)
                    })
                    .map_or(0, |g| g.memory_mib);
                (spec.gpu_milli, share_memory_mib(&spec, gpu_memory))
            } else {
                for gpu in &task.gpus {
                    self.gpu_holder.insert(gpu.clone(), id);
                }
                (0, 0)
            };
            let allocation = Allocation {
                id,
                job: p.job,
                node: task.node.clone(),
                gpus: task.gpus.clone(),
                term,
                created_at: at,
                gpu_milli,
                gpu_memory_mib,
                ports,
                start_after: extras.start_after,
            };
            index_allocation(&mut self.index, &self.jobs, &allocation, true);
            self.allocations.insert(
                id,
                AllocationRecord {
                    allocation,
                    started: false,
                    stop_requested: false,
                },
            );
            ids.push(id);
        }
        let record_attempt = self.cluster_version.allows(2);
        if let Some(job) = self.jobs.get_mut(&p.job) {
            if record_attempt {
                if job.attempts.len() == MAX_RECORDED_ATTEMPTS {
                    job.attempts.remove(0);
                }
                job.attempts.push(ids.clone());
            }
            job.allocations = ids;
            job.yielded_to = None;
            // A new attempt: how the last one exited no longer describes the job.
            job.exit = None;
        }
        let mut nodes: Vec<&str> = p.tasks.iter().map(|t| t.node.as_str()).collect();
        nodes.sort_unstable();
        nodes.dedup();
        for node in nodes {
            self.refresh_node_free(node);
        }
        let nodes: Vec<&str> = p.tasks.iter().map(|t| t.node.as_str()).collect();
        let reason = extras
            .reason
            .unwrap_or_else(|| format!("placed on {}", nodes.join(",")));
        self.transition(p.job, JobState::Scheduled, &reason, at, index);
    }

    /// Host ports held by the live allocations on `node`.
    fn ports_in_use(&self, node: &str) -> std::collections::BTreeSet<u16> {
        self.allocations_on(node)
            .flat_map(|r| r.allocation.ports.iter().copied())
            .collect()
    }

    /// The lowest `count` ports of `node`'s range that no live allocation holds and that are
    /// not in `also_taken`; `None` when the range has fewer free.
    fn free_ports(&self, node: &str, count: usize, also_taken: &[u16]) -> Option<Vec<u16>> {
        let range = self.nodes.get(node)?.spec.service_ports?;
        let used = self.ports_in_use(node);
        let free: Vec<u16> = (range.first..=range.last)
            .filter(|p| !used.contains(p) && !also_taken.contains(p))
            .take(count)
            .collect();
        (free.len() == count).then_some(free)
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
        usage: Option<TaskUsage>,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(rec) = self.allocations.remove(&id) else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "allocation {id} does not exist"
            )));
        };
        if rec.allocation.gpu_milli == 0 {
            for gpu in &rec.allocation.gpus {
                self.gpu_holder.remove(gpu);
            }
        }
        index_allocation(&mut self.index, &self.jobs, &rec.allocation, false);
        self.refresh_node_free(&rec.allocation.node);
        let job_id = rec.allocation.job;
        // Fair share: the GPU-seconds this task held count against its tenant.
        if let Some(job) = self.jobs.get(&job_id) {
            let held_ms = at.saturating_sub(rec.allocation.created_at);
            let milli = job.spec.gpu_milli_per_task();
            if milli > 0 {
                self.tenant_usage
                    .entry(job.spec.tenant.clone())
                    .or_default()
                    .add(at, milli.saturating_mul(held_ms) / 1000);
            }
        }
        changed.push(job_id);
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Outcome::Done;
        };
        job.allocations.retain(|a| *a != id);
        job.version = index;
        if let Some(u) = &usage {
            job.usage.get_or_insert_with(JobUsage::default).add(u);
        }
        let remaining = job.allocations.len();
        if let Some(r) = &job.replica {
            // The service may now reuse the ordinal, or must restart or replace the copy.
            self.touched_services.push(r.service.clone());
        }
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Outcome::Done;
        };
        if job.state.is_final() {
            // Cancelled (or otherwise ended) earlier; this exit only frees the GPUs.
            return Outcome::Done;
        }
        // A service's replica that exited on its own is started again; lost or stopped on
        // request, it follows the job's ending like any job (requeued, or ended).
        if job.replica.is_some()
            && job.ending.is_none()
            && remaining == 0
            && matches!(
                outcome,
                TaskOutcome::Succeeded | TaskOutcome::Failed { .. } | TaskOutcome::TimedOut
            )
        {
            return self.restart_replica(job_id, &rec, outcome, at, index);
        }
        // The first failing task's status is the job's (sacct's ExitCode); format 2.
        if let TaskOutcome::Failed {
            exit_code, signal, ..
        } = outcome
            && job.exit.is_none_or(|e| e == JobExit { code: 0, signal: 0 })
            && self.cluster_version.allows(2)
        {
            job.exit = Some(JobExit {
                code: exit_code.unwrap_or(0),
                signal: signal.unwrap_or(0),
            });
        } else if matches!(outcome, TaskOutcome::Succeeded)
            && job.exit.is_none()
            && self.cluster_version.allows(2)
        {
            job.exit = Some(JobExit { code: 0, signal: 0 });
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
                preempted_for: None,
            }),
            TaskOutcome::TimedOut => Some(Ending {
                state: JobState::TimedOut,
                reason: "time limit reached".into(),
                preempted_for: None,
            }),
            TaskOutcome::Lost { reason } => Some(Ending {
                state: JobState::Pending,
                reason: format!("requeued: {reason}"),
                preempted_for: None,
            }),
            // Stopped on request: the ending recorded with the request decides; a stop nobody
            // asked for (none recorded) requeues, which never loses work.
            TaskOutcome::Stopped => Some(Ending {
                state: JobState::Pending,
                reason: "requeued: task stopped".into(),
                preempted_for: None,
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
            preempted_for: None,
        });
        job.yielded_to = end.preempted_for.filter(|_| end.state == JobState::Pending);
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
        let reason = if reason.is_empty() {
            "node lost"
        } else {
            reason
        };
        self.lose_allocations_on(name, format!("node {name}: {reason}"), at, index, changed);
        Outcome::Done
    }

    /// Ends every allocation on `node` as lost, for `reason`: its processes are gone (the
    /// agent fenced them), so their jobs are requeued.
    fn lose_allocations_on(
        &mut self,
        node: &str,
        reason: String,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) {
        let on_node: Vec<AllocationId> =
            self.allocations_on(node).map(|r| r.allocation.id).collect();
        let outcome = TaskOutcome::Lost { reason };
        for id in on_node {
            self.allocation_exited(id, &outcome, None, at, index, changed);
        }
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
        self.refresh_node_free(node);
        Outcome::Done
    }

    fn jobs_on_node(&self, node: &str) -> Vec<JobId> {
        let mut jobs: Vec<JobId> = self
            .allocations_on(node)
            .map(|r| r.allocation.job)
            .collect();
        jobs.sort_unstable();
        jobs.dedup();
        jobs
    }

    /// Asks every task of a running job to stop and requeues the job once they have.
    pub(super) fn end_job_requeue(&mut self, job: JobId, reason: &str) {
        self.stop_and_requeue(job, reason, None);
    }

    fn stop_and_requeue(&mut self, job: JobId, reason: &str, preempted_for: Option<JobId>) {
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
                preempted_for,
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

    /// Moves a job to `state`; a job that ends fails the dependents it leaves unsatisfiable.
    pub(super) fn transition(
        &mut self,
        id: JobId,
        state: JobState,
        reason: &str,
        at: Timestamp,
        index: u64,
    ) {
        if self.set_state(id, state, reason, at, index) {
            let mut failed = Vec::new();
            self.fail_unsatisfiable_dependents(id, at, index, &mut failed);
            self.cascaded.extend(failed);
        }
    }

    /// Moves a job to `state` and keeps the indexes in step; true when the job has just
    /// reached a final state (its dependents are the caller's to look at).
    fn set_state(
        &mut self,
        id: JobId,
        state: JobState,
        reason: &str,
        at: Timestamp,
        index: u64,
    ) -> bool {
        let Some(job) = self.jobs.get_mut(&id) else {
            return false;
        };
        let was = job.state;
        job.state = state;
        job.version = index;
        job.history.push(StateChange {
            at,
            state,
            reason: reason.to_owned(),
        });
        if let Some(r) = job.replica.as_mut() {
            // Ready only while it runs; without a readiness probe, as soon as it runs (with
            // one, once its agent says the probe passes). Its service reconsiders it whenever
            // it changes.
            if state != JobState::Running {
                r.ready = false;
            } else if let Some(s) = self.services.get_mut(&r.service)
                && s.revision_template(r.revision)
                    .is_some_and(|t| t.readiness.is_none())
            {
                r.ready = true;
                if r.revision == s.revision {
                    s.progressed_at = at;
                }
            }
            self.touched_services.push(r.service.clone());
            super::service_apply::trim_replica_history(job);
        }
        if was == JobState::Pending && state != JobState::Pending {
            self.index.pending.remove(&id);
            for dep in &job.spec.dependencies {
                if let Some(waiting) = self.index.dependents.get_mut(&dep.job) {
                    waiting.remove(&id);
                    if waiting.is_empty() {
                        self.index.dependents.remove(&dep.job);
                    }
                }
            }
        } else if was != JobState::Pending && state == JobState::Pending {
            self.index.pending.insert(id);
            for dep in &job.spec.dependencies {
                self.index.dependents.entry(dep.job).or_default().insert(id);
            }
        }
        let ended = state.is_final() && !was.is_final();
        if ended {
            self.index.finished.insert((at, id));
        }
        ended
    }

    /// Why a job's dependencies can never all be met, if they cannot: a dependency that ended
    /// the wrong way for its kind.
    fn unsatisfiable_dependency(&self, id: JobId) -> Option<String> {
        let job = self.jobs.get(&id)?;
        job.spec.dependencies.iter().find_map(|d| {
            // An archived dependency still answers with its final state.
            let (dep_state, _) = self.job_outcome(d.job)?;
            let never = match d.kind {
                DependencyKind::AfterOk => dep_state.is_final() && dep_state != JobState::Succeeded,
                DependencyKind::AfterNotOk => dep_state == JobState::Succeeded,
                DependencyKind::AfterAny => false,
            };
            never.then(|| {
                let kind = match d.kind {
                    DependencyKind::AfterOk => "afterok",
                    DependencyKind::AfterNotOk => "afternotok",
                    DependencyKind::AfterAny => "afterany",
                };
                format!(
                    "dependency can never be satisfied: {kind}:{} but job {} {}",
                    d.job, d.job, dep_state
                )
            })
        })
    }

    /// Fails every pending job that waits on `ended` and can now never start, and so on down
    /// the chain of dependents, however long.
    fn fail_unsatisfiable_dependents(
        &mut self,
        ended: JobId,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) {
        let mut work = vec![ended];
        while let Some(job) = work.pop() {
            let waiting: Vec<JobId> = self
                .index
                .dependents
                .get(&job)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            for dependent in waiting {
                if let Some(reason) = self.unsatisfiable_dependency(dependent) {
                    // A work list, not recursion: a chain of a hundred thousand jobs is a
                    // longer list, not a deeper stack (a recursive cascade overflowed the
                    // stack of every replica at once at 5,000 jobs).
                    if self.set_state(dependent, JobState::Failed, &reason, at, index) {
                        work.push(dependent);
                    }
                    changed.push(dependent);
                }
            }
        }
    }

    /// Stops lower-priority (or borrowing) jobs so that `for_job` can start; each victim is
    /// requeued once its tasks have stopped (the agents give them their stop grace period).
    /// Victims the rules do not allow are skipped and named in the outcome.
    fn preempt(
        &mut self,
        for_job: JobId,
        victims: &[JobId],
        reason: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(preemptor) = self.jobs.get(&for_job) else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "job {for_job} does not exist"
            )));
        };
        if preemptor.state != JobState::Pending {
            return Outcome::Rejected(Rejection::precondition(format!(
                "job {for_job} is {}, not pending: it preempts nothing",
                preemptor.state
            )));
        }
        let preemptor = preemptor.clone();
        let mut accepted = Vec::new();
        let mut rejected = Vec::new();
        for &victim in victims {
            match self.check_preemption(&preemptor, victim) {
                Ok(why) => {
                    let reason = if reason.is_empty() {
                        format!("preempted by job {for_job} ({why})")
                    } else {
                        format!("preempted by job {for_job}: {reason}")
                    };
                    self.stop_and_requeue(victim, &reason, Some(for_job));
                    changed.push(victim);
                    accepted.push(victim);
                }
                Err(e) => rejected.push((victim, e)),
            }
        }
        let _ = (at, index);
        Outcome::Preempted { accepted, rejected }
    }

    /// Whether `preemptor` may stop `victim`, and on which grounds.
    pub fn check_preemption(&self, preemptor: &Job, victim: JobId) -> Result<&'static str, String> {
        let v = self
            .jobs
            .get(&victim)
            .ok_or_else(|| format!("job {victim} does not exist"))?;
        self.check_preemption_of(preemptor, v)
    }

    /// [`Self::check_preemption`] for a victim already looked up (the scheduler checks tens of
    /// thousands of running jobs per pass on a full cluster).
    pub fn check_preemption_of(&self, preemptor: &Job, v: &Job) -> Result<&'static str, String> {
        let victim = v.id;
        if v.state.is_final() || v.allocations.is_empty() {
            return Err(format!("job {victim} is {} and holds nothing", v.state));
        }
        if v.ending.is_some() {
            return Err(format!("job {victim} is already stopping"));
        }
        let same_tenant = v.spec.tenant == preemptor.spec.tenant;
        // Across tenants, both rules depend on who runs within its guarantee.
        let (preemptor_within_guarantee, victim_borrowing) = if same_tenant {
            (true, true)
        } else {
            let quota = |tenant: &str| {
                self.tenants
                    .get(tenant)
                    .map_or(0, |t| u64::from(t.quota_gpus) * MILLI_PER_GPU)
            };
            let owner_held = self.gpu_milli_held_by_tenant(&preemptor.spec.tenant);
            (
                owner_held + preemptor.spec.total_gpu_milli() <= quota(&preemptor.spec.tenant),
                self.gpu_milli_held_by_tenant(&v.spec.tenant) > quota(&v.spec.tenant),
            )
        };
        // Priority: a preemptible job of lower priority. Across tenants, not a job its tenant
        // runs within its guarantee when the preemptor's tenant would then be borrowing: the
        // victim's tenant could reclaim that quota at once (below), the reclaimed job could
        // preempt again by priority, and the two would stop each other forever (found by the
        // simulation, seed 160 with 32-entry appends).
        if v.spec.preemptible
            && priority_rank(&v.spec.priority_class) < priority_rank(&preemptor.spec.priority_class)
            && (victim_borrowing || preemptor_within_guarantee)
        {
            return Ok("lower priority, preemptible");
        }
        // A service below its minimum replicas takes room from preemptible batch work of no
        // higher priority (an online service outranks the training that shares its fleet).
        if v.spec.preemptible
            && v.replica.is_none()
            && priority_rank(&v.spec.priority_class)
                <= priority_rank(&preemptor.spec.priority_class)
            && (victim_borrowing || preemptor_within_guarantee)
            && self.service_below_minimum(preemptor)
        {
            return Ok("a service below its minimum replicas");
        }
        // Quota reclaim: the preemptor's tenant is within its guarantee and the victim's tenant
        // holds more than its own, i.e. runs on borrowed capacity.
        if !same_tenant
            && self.tenants.contains_key(&preemptor.spec.tenant)
            && preemptor_within_guarantee
            && victim_borrowing
        {
            return Ok("reclaiming quota from borrowed capacity");
        }
        Err(format!(
            "job {victim} ({} priority{}, tenant {}) may not be preempted by job {}",
            v.spec.priority_class,
            if v.spec.preemptible {
                ""
            } else {
                ", not preemptible"
            },
            v.spec.tenant,
            preemptor.id
        ))
    }
}

/// What a restart in place (a service's replica) adds to a placement.
#[derive(Debug, Default)]
pub(super) struct PlacementExtras {
    /// Not to be started before this leader time (the replica's back-off).
    pub start_after: Option<Timestamp>,
    /// The ports it had, kept when still free (a replica keeps its endpoint across restarts).
    pub ports: Option<Vec<u16>>,
    /// The history entry's reason instead of "placed on NODE".
    pub reason: Option<String>,
}

pub(super) fn describe_failure(
    exit_code: Option<i32>,
    signal: Option<i32>,
    reason: &str,
) -> String {
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

/// Rank of a priority class: higher is served first.
pub fn priority_rank(class: &str) -> u8 {
    match class {
        "high" => 2,
        "normal" => 1,
        _ => 0,
    }
}

/// GPU memory a share gets on a GPU of `gpu_memory_mib`: what it asked for, or in proportion to
/// its milli when it did not say.
pub fn share_memory_mib(spec: &JobSpec, gpu_memory_mib: u64) -> u64 {
    share_memory_for(spec.gpu_milli, spec.gpu_memory_mib, gpu_memory_mib)
}

/// See [`share_memory_mib`]: `requested` 0 means in proportion to `milli`.
pub fn share_memory_for(milli: u32, requested: u64, gpu_memory_mib: u64) -> u64 {
    if requested > 0 {
        requested
    } else {
        // In u128: a node may report any memory size, and a product that wrapped would give
        // the share a sliver of the GPU's memory instead of its part.
        let part = u128::from(gpu_memory_mib) * u128::from(milli) / u128::from(MILLI_PER_GPU);
        u64::try_from(part).unwrap_or(u64::MAX)
    }
}

fn milli_as_gpus(milli: u64) -> String {
    if milli.is_multiple_of(MILLI_PER_GPU) {
        (milli / MILLI_PER_GPU).to_string()
    } else {
        format!("{:.3}", milli as f64 / MILLI_PER_GPU as f64)
    }
}

fn join_keys<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = keys.map(String::as_str).collect();
    v.join(", ")
}
