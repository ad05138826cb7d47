//! The replicated state machine: plain data (`ClusterState`) and one deterministic function,
//! `ClusterState::apply`. No clock, no randomness, no I/O: every replica that applies the same
//! log reaches the same state. Every rule that protects an invariant (no GPU held twice, no job
//! lost, idempotent submission) is enforced here, at apply time, whatever the proposer believed.

pub mod access;
mod apply;
#[cfg(test)]
mod apply_tests;
pub mod audit;
pub mod command;
pub mod cow_map;
mod envelope;
pub mod format;
pub mod free;
#[cfg(test)]
mod proptests;
mod retention;
pub mod service;
mod service_apply;
pub mod service_plan;
pub mod types;
pub mod validate;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use access::{ApiRole, TokenRecord};
pub use apply::{priority_rank, share_memory_for, share_memory_mib};
pub use audit::{Actor, AuditRecord, AuditRetention};
pub use command::{
    Command, JobChange, JobPlacement, JobUpdate, Outcome, RejectKind, Rejection, Request,
    RolloutAction, TaskOutcome, TaskPlacement, TaskUsage,
};
pub use cow_map::CowMap;
pub use retention::spec_fingerprint;
pub use service::{
    Autoscale, Ordinal, Probe, ProbeCheck, ReplicaOf, ReplicaTemplate, RestartPolicy, RolloutPhase,
    RolloutStrategy, Service, ServiceSpec, service_key,
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

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterState {
    pub nodes: CowMap<String, Node>,
    pub jobs: CowMap<JobId, Job>,
    pub allocations: BTreeMap<AllocationId, AllocationRecord>,
    /// GPU UUID → the live allocation holding it. Kept in step with `allocations` by `apply`;
    /// an index so that the double-booking check is a lookup, not a scan.
    pub gpu_holder: BTreeMap<String, AllocationId>,
    /// GPU UUID → node that reported it, so one GPU can never belong to two nodes.
    pub gpu_node: BTreeMap<String, String>,
    pub tenants: BTreeMap<String, Tenant>,
    pub partitions: BTreeMap<String, Partition>,
    /// Last job id handed out; ids come from the log, so every replica agrees on them.
    pub last_job_id: JobId,
    pub last_allocation_id: AllocationId,
    /// Timestamp of the last applied command (leader's clock).
    pub last_applied_at: Timestamp,
    /// Tenant → decayed GPU-seconds of finished allocations (fair share).
    #[serde(default)]
    pub tenant_usage: BTreeMap<String, DecayedUsage>,
    /// Finished jobs whose full record was dropped after its retention (`CompactJobs`), by id.
    /// A job is in `jobs` or here, never both; past the archive's own retention it is in
    /// neither (its id is still at most `last_job_id`, so "never existed" stays answerable).
    #[serde(default)]
    pub archived: CowMap<JobId, ArchivedJob>,
    /// API tokens by id (hashes only; see `access`).
    #[serde(default)]
    pub tokens: BTreeMap<String, TokenRecord>,
    /// The audit trail by sequence number, oldest first (see `audit`).
    #[serde(default)]
    pub audit: CowMap<u64, AuditRecord>,
    #[serde(default)]
    pub last_audit_seq: u64,
    /// The audit trail's limits, as last proposed by a leader.
    #[serde(default)]
    pub audit_retention: AuditRetention,
    /// The format the cluster writes its log entries and snapshots in, and the newest
    /// commands it accepts (`format`). Raised by `SetClusterVersion` only; absent (format 1)
    /// in state written before versions existed.
    #[serde(default, skip_serializing_if = "format::ClusterVersion::is_legacy")]
    pub cluster_version: format::ClusterVersion,
    /// Long-running services by key (`tenant/name`), format 2. Their replicas are jobs
    /// (`Job::replica`); see `service`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub services: BTreeMap<String, service::Service>,
    /// The greatest leader term of any plan applied. A placement that apply makes on its own
    /// (a replica restarted in place when its report applies) carries it, so allocations'
    /// terms never go down in log order, whoever decided them.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub placement_term: u64,
    /// Derived indexes, rebuilt from the data above after a snapshot is loaded
    /// (`rebuild_indexes`) and kept in step by `apply`. Not serialized.
    #[serde(skip)]
    pub index: Indexes,
    /// Jobs a command changed indirectly (dependents failed in a cascade), collected while it
    /// applies and handed to watchers with the rest. Always empty between commands.
    #[serde(skip)]
    cascaded: Vec<JobId>,
    /// Services whose settings or replicas a command changed, reconciled once the entry has
    /// applied (`service_apply`). Always empty between entries.
    #[serde(skip)]
    touched_services: Vec<String>,
}

/// Lookups the scheduler and `apply` need on every pass, so neither scans every job or
/// allocation: at 10,000 nodes and a million job records a scan per placement would not do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Indexes {
    /// GPU UUID → milli-GPU shares held on it.
    pub gpu_shares: BTreeMap<String, GpuShares>,
    /// Jobs in state `Pending`.
    pub pending: BTreeSet<JobId>,
    /// Node → live allocations on it.
    pub node_allocations: BTreeMap<String, BTreeSet<AllocationId>>,
    /// Tenant → GPU capacity its live allocations hold, in milli-GPU.
    pub tenant_held_milli: BTreeMap<String, u64>,
    /// Job → pending jobs that depend on it.
    pub dependents: BTreeMap<JobId, BTreeSet<JobId>>,
    /// Node → fingerprint of its hardware (GPU models, memory, NUMA, MIG layout, link matrix),
    /// so the scheduler can treat identical hosts alike without comparing matrices each pass.
    pub hardware_class: BTreeMap<String, u64>,
    /// Hardware class → the nodes of that class: "could any node ever run this?" looks at one
    /// node per class instead of every node.
    pub class_nodes: BTreeMap<u64, BTreeSet<String>>,
    /// Node → its free resources (CPU, memory, GPU milli and memory, MIG slices).
    pub node_free: BTreeMap<String, free::NodeFree>,
    /// Tenant → (milli-GPU of its live allocations, Σ milli × created_at): what running work
    /// has used so far is `now × first − second`, without visiting every allocation.
    pub tenant_running: BTreeMap<String, (u64, u128)>,
    /// Finished jobs that still have their full record, by (end time, id): compaction takes
    /// the oldest from the front instead of scanning every job.
    pub finished: BTreeSet<(Timestamp, JobId)>,
    /// Archived jobs by (end time, id), oldest first, for the same reason.
    pub archived_by_end: BTreeSet<(Timestamp, JobId)>,
    /// Tenant → idempotency key → the job (kept whole or archived) that carries it. Derived
    /// rather than stored: every such job carries its key, and a snapshot then neither holds
    /// nor copies a million keys twice. (Snapshots written before kept it as the state's
    /// `idempotency` field; loading ignores that and derives it.)
    pub idempotency: BTreeMap<String, BTreeMap<String, JobId>>,
}

/// Fingerprint of what a node's hardware offers the scheduler (not its health or usage).
pub fn hardware_class(spec: &NodeSpec) -> u64 {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same on every replica and run; only used in memory.
    let mut h = std::hash::DefaultHasher::new();
    for g in &spec.gpus {
        g.model.hash(&mut h);
        g.memory_mib.hash(&mut h);
        g.numa_node.hash(&mut h);
        for m in &g.mig {
            m.profile.hash(&mut h);
        }
        0xffu8.hash(&mut h);
    }
    spec.topology.hash(&mut h);
    // Whether it runs containers: container jobs fit only where it does, so two nodes that
    // differ in it are not interchangeable for placement.
    spec.container_runtime.is_empty().hash(&mut h);
    // Whether it hands out ports: tasks asking for ports fit only where it does.
    spec.service_ports.is_some().hash(&mut h);
    h.finish()
}

/// What applying one command did: the outcome for the proposer and which jobs changed (for
/// watchers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub outcome: Outcome,
    pub changed_jobs: Vec<JobId>,
}

impl ClusterState {
    /// The replicated data without the derived indexes, copied in a moment for a snapshot:
    /// the large maps share their records with the state ([`CowMap`]), so the copy costs a
    /// pointer per record, and serializing it can happen after the state's lock is released
    /// while applies go on. Every field is named (no `..`), so a new field cannot be left out
    /// of snapshots by accident.
    pub fn snapshot_copy(&self) -> ClusterState {
        ClusterState {
            nodes: self.nodes.clone(),
            jobs: self.jobs.clone(),
            allocations: self.allocations.clone(),
            gpu_holder: self.gpu_holder.clone(),
            gpu_node: self.gpu_node.clone(),
            tenants: self.tenants.clone(),
            partitions: self.partitions.clone(),
            last_job_id: self.last_job_id,
            last_allocation_id: self.last_allocation_id,
            last_applied_at: self.last_applied_at,
            tenant_usage: self.tenant_usage.clone(),
            archived: self.archived.clone(),
            tokens: self.tokens.clone(),
            audit: self.audit.clone(),
            last_audit_seq: self.last_audit_seq,
            audit_retention: self.audit_retention,
            cluster_version: self.cluster_version,
            services: self.services.clone(),
            placement_term: self.placement_term,
            index: Indexes::default(),
            cascaded: Vec::new(),
            touched_services: Vec::new(),
        }
    }

    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id)
    }

    /// The job an idempotency key already created, if any.
    pub fn job_for_key(&self, tenant: &str, key: &str) -> Option<JobId> {
        self.index.idempotency.get(tenant)?.get(key).copied()
    }

    pub fn allocations_of(&self, job: JobId) -> impl Iterator<Item = &AllocationRecord> {
        self.jobs
            .get(&job)
            .into_iter()
            .flat_map(|j| j.allocations.iter())
            .filter_map(|a| self.allocations.get(a))
    }

    /// GPUs held by live allocations of a tenant's jobs (stopping ones included: they still
    /// occupy the cards), in whole GPUs, rounded up.
    pub fn gpus_held_by_tenant(&self, tenant: &str) -> u64 {
        self.gpu_milli_held_by_tenant(tenant)
            .div_ceil(MILLI_PER_GPU)
    }

    /// GPU capacity held by a tenant's live allocations, in milli-GPU.
    pub fn gpu_milli_held_by_tenant(&self, tenant: &str) -> u64 {
        self.index
            .tenant_held_milli
            .get(tenant)
            .copied()
            .unwrap_or(0)
    }

    /// Live allocations on a node.
    pub fn allocations_on(&self, node: &str) -> impl Iterator<Item = &AllocationRecord> {
        self.index
            .node_allocations
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.allocations.get(id))
    }

    /// CPU (milli) and memory (MiB) requested by the live allocations on a node.
    pub fn node_usage(&self, node: &str) -> (u64, u64) {
        self.allocations_on(node)
            .filter_map(|r| self.jobs.get(&r.allocation.job))
            .fold((0, 0), |(c, m), j| {
                (
                    c + j.spec.cpu_milli_per_task,
                    m + j.spec.memory_mib_per_task,
                )
            })
    }

    /// Jobs that hold live allocations (each once).
    pub fn jobs_with_allocations(&self) -> impl Iterator<Item = &Job> {
        let mut last = None;
        self.allocations.values().filter_map(move |r| {
            let job = r.allocation.job;
            if last == Some(job) {
                return None;
            }
            last = Some(job);
            self.jobs.get(&job)
        })
    }

    /// One node of each hardware class.
    pub fn node_per_class(&self) -> impl Iterator<Item = &Node> {
        self.index
            .class_nodes
            .values()
            .filter_map(|names| names.first())
            .filter_map(|name| self.nodes.get(name))
    }

    /// Pending jobs, in id order.
    ///
    /// Pending jobs are usually the newest, their ids close together: then the job records
    /// between the first and the last pending id are walked in order alongside the pending
    /// set (comparing keys only), instead of searching the job map from its root for each one
    /// (a scheduling pass reads every pending job). Scattered ids are looked up one by one.
    pub fn pending_jobs(&self) -> impl Iterator<Item = &Job> {
        let pending = &self.index.pending;
        let dense = match (pending.first(), pending.last()) {
            (Some(&first), Some(&last)) => (last - first) / 4 < pending.len() as u64,
            _ => false,
        };
        let mut walk = dense.then(|| {
            let first = pending.first().copied().unwrap_or_default();
            let last = pending.last().copied().unwrap_or_default();
            self.jobs.range(first..=last).peekable()
        });
        pending.iter().filter_map(move |id| match &mut walk {
            Some(walk) => {
                while walk.next_if(|(k, _)| *k < id).is_some() {}
                walk.next_if(|(k, _)| *k == id).map(|(_, job)| job)
            }
            None => self.jobs.get(id),
        })
    }

    /// Milli-GPU of one GPU taken by shares (0 when none).
    pub fn shared_milli(&self, gpu: &str) -> u32 {
        self.index.gpu_shares.get(gpu).map_or(0, |s| s.milli)
    }

    /// Recomputes every derived index from the data: after loading a snapshot.
    pub fn rebuild_indexes(&mut self) {
        self.index = self.derive_indexes();
    }

    /// Every derived index, computed from the data alone (not from `self.index`).
    fn derive_indexes(&self) -> Indexes {
        let mut index = Indexes::default();
        for node in self.nodes.values() {
            let class = hardware_class(&node.spec);
            index.hardware_class.insert(node.spec.name.clone(), class);
            index
                .class_nodes
                .entry(class)
                .or_default()
                .insert(node.spec.name.clone());
        }
        for job in self.jobs.values() {
            if job.state == JobState::Pending {
                index.pending.insert(job.id);
                for dep in &job.spec.dependencies {
                    index.dependents.entry(dep.job).or_default().insert(job.id);
                }
            }
            if job.state.is_final() {
                index.finished.insert((job.last_change_at(), job.id));
            }
            if let Some(key) = &job.idempotency_key {
                index
                    .idempotency
                    .entry(job.spec.tenant.clone())
                    .or_default()
                    .insert(key.clone(), job.id);
            }
        }
        for a in self.archived.values() {
            index.archived_by_end.insert((a.ended_at, a.id));
            if let Some(key) = a.idempotency_key() {
                index
                    .idempotency
                    .entry(a.tenant().to_owned())
                    .or_default()
                    .insert(key.to_owned(), a.id);
            }
        }
        for rec in self.allocations.values() {
            index_allocation(&mut index, &self.jobs, &rec.allocation, true);
        }
        for (name, node) in &self.nodes {
            let free = self.node_free_of(node, index.node_allocations.get(name));
            index.node_free.insert(name.clone(), free);
        }
        index
    }

    /// A node's free resources given the ids of its live allocations.
    fn node_free_of(
        &self,
        node: &Node,
        allocations: Option<&BTreeSet<AllocationId>>,
    ) -> free::NodeFree {
        let mut free = free::NodeFree::capacity(node);
        for rec in allocations
            .into_iter()
            .flatten()
            .filter_map(|id| self.allocations.get(id))
        {
            if let Some(job) = self.jobs.get(&rec.allocation.job) {
                // A job with the node to itself (`--exclusive`) leaves nothing for others.
                if job.spec.exclusive {
                    return free::NodeFree::nothing(node);
                }
                free.remove_allocation(node, job, rec);
            }
        }
        free
    }

    /// Recomputes one node's free resources from its capacity, health and live allocations.
    pub fn refresh_node_free(&mut self, name: &str) {
        let Some(node) = self.nodes.get(name) else {
            self.index.node_free.remove(name);
            return;
        };
        let free = self.node_free_of(node, self.index.node_allocations.get(name));
        self.index.node_free.insert(name.to_owned(), free);
    }

    /// GPU-seconds a tenant's live allocations have used up to `now`.
    pub fn running_gpu_seconds(&self, tenant: &str, now: Timestamp) -> f64 {
        let Some(&(milli, weighted)) = self.index.tenant_running.get(tenant) else {
            return 0.0;
        };
        let milli_ms = (u128::from(now) * u128::from(milli)).saturating_sub(weighted);
        milli_ms as f64 / (MILLI_PER_GPU as f64 * 1000.0)
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
            // Shares are checked below, against their own index.
            let exclusive = rec.allocation.gpu_milli == 0;
            for gpu in rec.allocation.gpus.iter().filter(|_| exclusive) {
                if let Some(other) = derived_holder.insert(gpu.clone(), *id) {
                    return Err(format!("GPU {gpu} is held by allocations {other} and {id}"));
                }
            }
        }
        if derived_holder != self.gpu_holder {
            return Err("gpu_holder index differs from allocations".into());
        }
        // Derived without cloning the state: at a million job records a clone doubles the
        // replica's memory while a snapshot loads.
        let derived = self.derive_indexes();
        if derived != self.index {
            return Err(format!(
                "derived indexes differ from the data they index: {}",
                self.index.difference(&derived)
            ));
        }
        for (gpu, shares) in &self.index.gpu_shares {
            if shares.milli > MILLI_PER_GPU as u32 {
                return Err(format!(
                    "GPU {gpu} carries {} milli of shares",
                    shares.milli
                ));
            }
            if self.gpu_holder.contains_key(gpu) {
                return Err(format!("GPU {gpu} is both shared and held whole"));
            }
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
        // A job with its nodes to itself (`--exclusive`) shares none of them.
        for (node, allocations) in &self.index.node_allocations {
            let jobs: BTreeSet<JobId> = allocations
                .iter()
                .filter_map(|a| self.allocations.get(a))
                .map(|r| r.allocation.job)
                .collect();
            if jobs.len() > 1
                && let Some(exclusive) = jobs
                    .iter()
                    .find(|j| self.jobs.get(j).is_some_and(|j| j.spec.exclusive))
            {
                return Err(format!(
                    "node {node} runs exclusive job {exclusive} beside other jobs: {jobs:?}"
                ));
            }
        }
        self.check_services()?;
        self.check_archive()
    }

    /// Each service's live copies are replica jobs of it at their ordinals, and every replica
    /// job that has not fully stopped is one of its service's copies.
    fn check_services(&self) -> Result<(), String> {
        for (key, s) in &self.services {
            if *key != s.key() {
                return Err(format!("service {} is stored under {key}", s.key()));
            }
            for (ordinal, id) in &s.replicas {
                let job = self
                    .jobs
                    .get(id)
                    .ok_or_else(|| format!("service {key} lists missing job {id}"))?;
                match &job.replica {
                    Some(r) if r.service == *key && r.ordinal == *ordinal => {}
                    _ => {
                        return Err(format!(
                            "service {key} lists job {id} at ordinal {ordinal}, which is not that replica"
                        ));
                    }
                }
            }
        }
        for job in self.jobs.values() {
            let Some(r) = &job.replica else { continue };
            let stopped = job.state.is_final() && job.allocations.is_empty();
            if stopped {
                continue;
            }
            let listed = self
                .services
                .get(&r.service)
                .and_then(|s| s.replicas.get(&r.ordinal));
            if listed != Some(&job.id) {
                return Err(format!(
                    "job {} is live replica {} of service {} but the service lists {listed:?}",
                    job.id, r.ordinal, r.service
                ));
            }
        }
        Ok(())
    }
}

impl Indexes {
    /// The first index in which `self` (kept) and `derived` differ, with the first key, for
    /// the evidence of a consistency check.
    fn difference(&self, derived: &Indexes) -> String {
        fn first<K: Ord + std::fmt::Debug + Clone, V: PartialEq + std::fmt::Debug>(
            name: &str,
            kept: &BTreeMap<K, V>,
            derived: &BTreeMap<K, V>,
        ) -> Option<String> {
            let keys: BTreeSet<&K> = kept.keys().chain(derived.keys()).collect();
            keys.into_iter()
                .find(|k| kept.get(k) != derived.get(k))
                .map(|k| {
                    format!(
                        "{name}[{k:?}]: kept {:?}, derived {:?}",
                        kept.get(k),
                        derived.get(k)
                    )
                })
        }
        fn set<K: Ord + std::fmt::Debug>(
            name: &str,
            kept: &BTreeSet<K>,
            derived: &BTreeSet<K>,
        ) -> Option<String> {
            (kept != derived).then(|| {
                format!(
                    "{name}: kept only {:?}, derived only {:?}",
                    kept.difference(derived).take(5).collect::<Vec<_>>(),
                    derived.difference(kept).take(5).collect::<Vec<_>>()
                )
            })
        }
        first("gpu_shares", &self.gpu_shares, &derived.gpu_shares)
            .or_else(|| set("pending", &self.pending, &derived.pending))
            .or_else(|| {
                first(
                    "node_allocations",
                    &self.node_allocations,
                    &derived.node_allocations,
                )
            })
            .or_else(|| {
                first(
                    "tenant_held_milli",
                    &self.tenant_held_milli,
                    &derived.tenant_held_milli,
                )
            })
            .or_else(|| first("dependents", &self.dependents, &derived.dependents))
            .or_else(|| {
                first(
                    "hardware_class",
                    &self.hardware_class,
                    &derived.hardware_class,
                )
            })
            .or_else(|| first("class_nodes", &self.class_nodes, &derived.class_nodes))
            .or_else(|| first("node_free", &self.node_free, &derived.node_free))
            .or_else(|| {
                first(
                    "tenant_running",
                    &self.tenant_running,
                    &derived.tenant_running,
                )
            })
            .or_else(|| set("finished", &self.finished, &derived.finished))
            .or_else(|| {
                set(
                    "archived_by_end",
                    &self.archived_by_end,
                    &derived.archived_by_end,
                )
            })
            .or_else(|| first("idempotency", &self.idempotency, &derived.idempotency))
            .unwrap_or_else(|| "an index".into())
    }
}

/// Adds (or with `add == false` removes) an allocation's entries in the derived indexes.
pub(crate) fn index_allocation(
    index: &mut Indexes,
    jobs: &CowMap<JobId, Job>,
    allocation: &Allocation,
    add: bool,
) {
    let nodes = index
        .node_allocations
        .entry(allocation.node.clone())
        .or_default();
    if add {
        nodes.insert(allocation.id);
    } else {
        nodes.remove(&allocation.id);
        if nodes.is_empty() {
            index.node_allocations.remove(&allocation.node);
        }
    }
    if allocation.gpu_milli > 0 {
        for gpu in &allocation.gpus {
            let shares = index.gpu_shares.entry(gpu.clone()).or_default();
            if add {
                shares.milli += allocation.gpu_milli;
                shares.memory_mib += allocation.gpu_memory_mib;
                shares.allocations.insert(allocation.id);
            } else {
                shares.milli = shares.milli.saturating_sub(allocation.gpu_milli);
                shares.memory_mib = shares.memory_mib.saturating_sub(allocation.gpu_memory_mib);
                shares.allocations.remove(&allocation.id);
                if shares.allocations.is_empty() {
                    index.gpu_shares.remove(gpu);
                }
            }
        }
    }
    if let Some(job) = jobs.get(&allocation.job)
        && job.spec.gpu_milli_per_task() > 0
    {
        let milli = job.spec.gpu_milli_per_task();
        let weighted = u128::from(milli) * u128::from(allocation.created_at);
        let running = index
            .tenant_running
            .entry(job.spec.tenant.clone())
            .or_default();
        if add {
            running.0 += milli;
            running.1 += weighted;
        } else {
            running.0 = running.0.saturating_sub(milli);
            running.1 = running.1.saturating_sub(weighted);
            if running.0 == 0 {
                index.tenant_running.remove(&job.spec.tenant);
            }
        }
        let milli = job.spec.gpu_milli_per_task();
        let held = index
            .tenant_held_milli
            .entry(job.spec.tenant.clone())
            .or_default();
        if add {
            *held += milli;
        } else {
            *held = held.saturating_sub(milli);
            if *held == 0 {
                index.tenant_held_milli.remove(&job.spec.tenant);
            }
        }
    }
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}
