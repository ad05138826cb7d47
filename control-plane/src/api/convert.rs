//! Wire ↔ domain conversions. Incoming messages are checked for what the wire types allow but
//! the domain does not (negative counts, unknown enum values); everything else is validated by
//! `state::validate`.

use proto::v1 as pb;

use crate::state::validate::DEFAULT_PRIORITY_CLASS;
use crate::state::{
    self, ClusterState, Dependency, DependencyKind, GpuHealth, JobSpec, Partition, Rejection,
    Tenant,
};

fn count(field: &str, value: i64, max: u64) -> Result<u64, Rejection> {
    if value < 0 {
        return Err(Rejection::invalid(field, format!("{value} is negative")));
    }
    let v = value as u64;
    if v > max {
        return Err(Rejection::invalid(
            field,
            format!("{v} is larger than {max}"),
        ));
    }
    Ok(v)
}

fn non_empty(s: String) -> Option<String> {
    if s.is_empty() { None } else { Some(s) }
}

pub fn job_spec_from_proto(spec: Option<pb::JobSpec>) -> Result<JobSpec, Rejection> {
    let spec = spec.ok_or_else(|| Rejection::invalid("spec", "is missing"))?;
    let mut dependencies = Vec::with_capacity(spec.dependencies.len());
    for d in &spec.dependencies {
        let kind = match pb::dependency::Kind::try_from(d.kind) {
            Ok(pb::dependency::Kind::AfterOk) => DependencyKind::AfterOk,
            Ok(pb::dependency::Kind::AfterAny) => DependencyKind::AfterAny,
            Ok(pb::dependency::Kind::AfterNotOk) => DependencyKind::AfterNotOk,
            _ => {
                return Err(Rejection::invalid(
                    "dependencies",
                    format!("unknown dependency kind {}", d.kind),
                ));
            }
        };
        dependencies.push(Dependency {
            kind,
            job: d.job_id,
        });
    }
    let priority_class = if spec.priority_class.is_empty() {
        DEFAULT_PRIORITY_CLASS.to_owned()
    } else {
        spec.priority_class
    };
    Ok(JobSpec {
        tenant: spec.tenant,
        name: spec.name,
        command: spec.command,
        gpus_per_task: count("gpus_per_task", spec.gpus_per_task, u32::MAX as u64)? as u32,
        tasks: count("tasks", spec.tasks, u32::MAX as u64)? as u32,
        gpu_models: spec.gpu_models,
        partition: non_empty(spec.partition),
        priority_class,
        time_limit_secs: match count("time_limit", spec.time_limit_secs, u64::MAX)? {
            0 => None,
            t => Some(t),
        },
        dependencies,
        cpu_milli_per_task: count("cpu_milli_per_task", spec.cpu_milli_per_task, u64::MAX)?,
        memory_mib_per_task: count("memory_mib_per_task", spec.memory_mib_per_task, u64::MAX)?,
        env: spec.env.into_iter().collect(),
        gpu_milli: spec.gpu_milli,
        gpu_memory_mib: spec.gpu_memory_mib,
        mig_profile: non_empty(spec.mig_profile),
        preemptible: spec.preemptible,
        single_numa: spec.single_numa,
        workdir: non_empty(spec.workdir),
        container: spec.container.map(|c| state::ContainerSpec {
            image: c.image,
            mounts: c
                .mounts
                .into_iter()
                .map(|m| state::ContainerMount {
                    source: m.source,
                    target: m.target,
                    read_only: m.read_only,
                })
                .collect(),
        }),
        stdout_path: non_empty(spec.stdout_path),
        stderr_path: non_empty(spec.stderr_path),
        hold_if_unfit: spec.hold_if_unfit,
        nodelist: sorted_names(spec.nodelist),
        exclude: sorted_names(spec.exclude),
        exclusive: spec.exclusive,
        begin_at: (spec.begin_at_ms > 0).then_some(spec.begin_at_ms),
        hold: spec.hold,
        array: spec.array.as_ref().map(array_spec_from_proto),
        ports: spec.ports,
    })
}

/// Node names as the state keeps them: sorted, distinct.
pub fn sorted_names(mut names: Vec<String>) -> Vec<String> {
    names.sort();
    names.dedup();
    names
}

pub fn array_spec_from_proto(a: &pb::ArraySpec) -> state::ArraySpec {
    state::ArraySpec {
        ranges: a
            .ranges
            .iter()
            .map(|r| state::ArrayRange {
                first: r.first,
                last: r.last,
                step: r.step,
            })
            .collect(),
        max_running: a.max_running,
    }
}

fn array_spec_to_proto(a: &state::ArraySpec) -> pb::ArraySpec {
    pb::ArraySpec {
        ranges: a
            .ranges
            .iter()
            .map(|r| pb::ArrayRange {
                first: r.first,
                last: r.last,
                step: r.step,
            })
            .collect(),
        max_running: a.max_running,
    }
}

/// An update as the state applies it (node lists sorted).
pub fn job_update_from_proto(u: pb::JobUpdate) -> state::JobUpdate {
    state::JobUpdate {
        name: u.name,
        time_limit_secs: u.time_limit_secs,
        priority_class: u.priority_class,
        partition: u.partition,
        begin_at: u.begin_at_ms,
        nodelist: u.nodelist.map(|l| sorted_names(l.nodes)),
        exclude: u.exclude.map(|l| sorted_names(l.nodes)),
        max_running: u.max_running,
    }
}

pub fn job_spec_to_proto(spec: &JobSpec) -> pb::JobSpec {
    pb::JobSpec {
        tenant: spec.tenant.clone(),
        name: spec.name.clone(),
        command: spec.command.clone(),
        gpus_per_task: i64::from(spec.gpus_per_task),
        tasks: i64::from(spec.tasks),
        gpu_models: spec.gpu_models.clone(),
        partition: spec.partition.clone().unwrap_or_default(),
        priority_class: spec.priority_class.clone(),
        time_limit_secs: spec.time_limit_secs.unwrap_or(0) as i64,
        dependencies: spec
            .dependencies
            .iter()
            .map(|d| pb::Dependency {
                kind: match d.kind {
                    DependencyKind::AfterOk => pb::dependency::Kind::AfterOk,
                    DependencyKind::AfterAny => pb::dependency::Kind::AfterAny,
                    DependencyKind::AfterNotOk => pb::dependency::Kind::AfterNotOk,
                } as i32,
                job_id: d.job,
            })
            .collect(),
        cpu_milli_per_task: spec.cpu_milli_per_task as i64,
        memory_mib_per_task: spec.memory_mib_per_task as i64,
        env: spec.env.clone().into_iter().collect(),
        gpu_milli: spec.gpu_milli,
        gpu_memory_mib: spec.gpu_memory_mib,
        mig_profile: spec.mig_profile.clone().unwrap_or_default(),
        preemptible: spec.preemptible,
        single_numa: spec.single_numa,
        workdir: spec.workdir.clone().unwrap_or_default(),
        container: spec.container.as_ref().map(|c| pb::ContainerSpec {
            image: c.image.clone(),
            mounts: c
                .mounts
                .iter()
                .map(|m| pb::ContainerMount {
                    source: m.source.clone(),
                    target: m.target.clone(),
                    read_only: m.read_only,
                })
                .collect(),
        }),
        stdout_path: spec.stdout_path.clone().unwrap_or_default(),
        stderr_path: spec.stderr_path.clone().unwrap_or_default(),
        hold_if_unfit: spec.hold_if_unfit,
        nodelist: spec.nodelist.clone(),
        exclude: spec.exclude.clone(),
        exclusive: spec.exclusive,
        begin_at_ms: spec.begin_at.unwrap_or(0),
        hold: spec.hold,
        array: spec.array.as_ref().map(array_spec_to_proto),
        ports: spec.ports.clone(),
    }
}

pub fn allocation_to_proto(a: &state::Allocation) -> pb::Allocation {
    pb::Allocation {
        id: a.id,
        job_id: a.job,
        node: a.node.clone(),
        gpus: a.gpus.clone(),
        term: a.term,
        epoch: a.id,
        created_at_ms: a.created_at,
        gpu_milli: a.gpu_milli,
        gpu_memory_mib: a.gpu_memory_mib,
        enforcement: String::new(),
        ports: a.ports.iter().map(|p| u32::from(*p)).collect(),
        start_after_ms: a.start_after.unwrap_or(0),
    }
}

pub fn job_to_proto(job: &state::Job, cluster: &ClusterState) -> pb::Job {
    pb::Job {
        id: job.id,
        spec: Some(job_spec_to_proto(&job.spec)),
        idempotency_key: job.idempotency_key.clone().unwrap_or_default(),
        state: job.state.as_str().to_owned(),
        submitted_at_ms: job.submitted_at,
        history: job
            .history
            .iter()
            .map(|h| pb::StateChange {
                at_ms: h.at,
                state: h.state.as_str().to_owned(),
                reason: h.reason.clone(),
            })
            .collect(),
        allocations: cluster
            .allocations_of(job.id)
            .map(|r| pb::Allocation {
                enforcement: cluster
                    .nodes
                    .get(&r.allocation.node)
                    .map(|n| allocation_enforcement(&job.spec, &n.spec))
                    .unwrap_or_default(),
                ..allocation_to_proto(&r.allocation)
            })
            .collect(),
        version: job.version,
        redacted: false,
        usage: job.usage.map(|u| pb::JobUsage {
            cpu_ms: u.cpu_ms,
            peak_memory_bytes: u.peak_memory_bytes,
            oom_kills: u.oom_kills,
            tasks_measured: u.tasks_measured,
            gpu_sm_percent_avg: u.gpu_sm_percent_sum.checked_div(u.gpu_samples).unwrap_or(0),
            gpu_peak_memory_bytes: u.gpu_peak_memory_bytes,
            gpu_samples: u.gpu_samples,
        }),
        pending_reason: String::new(),
        held: job.held,
        array_task: job.array_task.map(|t| pb::ArrayTask {
            array_id: t.array_id,
            index: t.index,
            count: t.count,
        }),
        exit: job.exit.map(|e| pb::JobExit {
            code: e.code,
            signal: e.signal,
        }),
        attempts: job.attempts.len() as u32,
        replica: job.replica.as_ref().map(|r| pb::ReplicaOf {
            service: r.service.clone(),
            ordinal: r.ordinal,
            revision: r.revision,
            ready: r.ready,
            restarts: r.restarts,
            failures: r.failures,
            last_exit: r.last_exit.clone().unwrap_or_default(),
        }),
    }
}

/// Withholds what only the job's tenant (and admins) may see: its name, command,
/// environment and idempotency key. Resources, state and placement stay visible, so other
/// tenants can tell why their own jobs wait.
pub fn redact_job(job: &mut pb::Job) {
    if let Some(spec) = job.spec.as_mut() {
        spec.name.clear();
        spec.command.clear();
        spec.env.clear();
        // Image names and mounted paths say as much about the work as its command.
        spec.container = None;
        spec.workdir.clear();
    }
    job.idempotency_key.clear();
    job.redacted = true;
}

/// An archived job as the API shows it: its outcome, with a last history entry that says the
/// rest of the record (spec, full history, placement) was dropped by retention.
pub fn archived_job_to_proto(job: &state::ArchivedJob) -> pb::Job {
    let change = |at_ms, state: state::JobState, reason: &str| pb::StateChange {
        at_ms,
        state: state.as_str().to_owned(),
        reason: reason.to_owned(),
    };
    pb::Job {
        id: job.id,
        spec: Some(pb::JobSpec {
            tenant: job.tenant().to_owned(),
            name: job.name().to_owned(),
            ..Default::default()
        }),
        idempotency_key: job.idempotency_key().unwrap_or_default().to_owned(),
        state: job.state.as_str().to_owned(),
        submitted_at_ms: job.submitted_at,
        history: vec![
            change(job.submitted_at, state::JobState::Pending, "submitted"),
            change(job.ended_at, job.state, job.reason()),
            change(
                job.archived_at,
                job.state,
                "archived: only the outcome is kept; spec, history and placement were \
                 dropped after the retention period",
            ),
        ],
        allocations: Vec::new(),
        version: 0,
        redacted: false,
        usage: None,
        pending_reason: String::new(),
        held: false,
        array_task: None,
        exit: None,
        attempts: 0,
        replica: None,
    }
}

pub fn node_to_proto(node: &state::Node, cluster: &ClusterState) -> pb::Node {
    pb::Node {
        name: node.spec.name.clone(),
        gpus: node
            .spec
            .gpus
            .iter()
            .map(|g| {
                let (health, reason) = match &g.health {
                    GpuHealth::Healthy => ("healthy", String::new()),
                    GpuHealth::Unhealthy { reason } => ("unhealthy", reason.clone()),
                };
                pb::Gpu {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    numa_node: g.numa_node.map(|n| n as i32).unwrap_or(-1),
                    pci_bus_id: g.pci_bus_id.clone(),
                    health: health.to_owned(),
                    health_reason: reason,
                    allocation: cluster.gpu_holder.get(&g.uuid).copied().unwrap_or(0),
                    shared_milli: cluster.shared_milli(&g.uuid),
                    shared_memory_mib: cluster
                        .index
                        .gpu_shares
                        .get(&g.uuid)
                        .map_or(0, |s| s.memory_mib),
                    share_allocations: cluster
                        .index
                        .gpu_shares
                        .get(&g.uuid)
                        .map_or(vec![], |s| s.allocations.iter().copied().collect()),
                    mig: g
                        .mig
                        .iter()
                        .map(|m| pb::MigSlice {
                            uuid: m.uuid.clone(),
                            profile: m.profile.clone(),
                            memory_mib: m.memory_mib,
                            allocation: cluster.gpu_holder.get(&m.uuid).copied().unwrap_or(0),
                        })
                        .collect(),
                }
            })
            .collect(),
        cpu_milli: node.spec.cpu_milli,
        memory_mib: node.spec.memory_mib,
        partition: node.spec.partition.clone().unwrap_or_default(),
        labels: node.spec.labels.clone().into_iter().collect(),
        status: node.status.as_str().to_owned(),
        registered_at_ms: node.registered_at,
        agent_address: node.spec.agent_address.clone(),
        driver: node.spec.driver.clone(),
        topology: node.spec.topology.iter().map(|row| row.join(" ")).collect(),
        agent_release: node.spec.agent_release.clone(),
        enforcement: node.spec.enforcement.clone(),
        container_runtime: node.spec.container_runtime.clone(),
        service_ports: node
            .spec
            .service_ports
            .map(|r| format!("{}-{}", r.first, r.last))
            .unwrap_or_default(),
    }
}

/// What was enforced on a job's allocation on a node: the node's cgroups, and for a
/// container job the engine whose device cgroup confines it to its GPUs' nodes.
fn allocation_enforcement(job: &JobSpec, node: &state::NodeSpec) -> String {
    match &job.container {
        Some(c) if !node.enforcement.is_empty() => format!(
            "{}; container {} on {} (devices: only its GPUs' nodes are in the container)",
            node.enforcement, c.image, node.container_runtime
        ),
        _ => node.enforcement.clone(),
    }
}

pub fn tenant_from_proto(t: pb::Tenant) -> Tenant {
    Tenant {
        name: t.name,
        weight: if t.weight == 0 { 1 } else { t.weight },
        quota_gpus: t.quota_gpus,
        max_gpus: t.max_gpus,
    }
}

pub fn tenant_to_proto(t: &Tenant) -> pb::Tenant {
    pb::Tenant {
        name: t.name.clone(),
        weight: t.weight,
        quota_gpus: t.quota_gpus,
        max_gpus: t.max_gpus,
    }
}

pub fn partition_from_proto(p: pb::Partition) -> Partition {
    Partition {
        name: p.name,
        description: p.description,
    }
}

pub fn partition_to_proto(p: &Partition) -> pb::Partition {
    pb::Partition {
        name: p.name.clone(),
        description: p.description.clone(),
    }
}

/// The registration an agent whose inventory is `spec` sends (the simulated hosts of the
/// deterministic simulation and of the benchmarks; real agents build theirs from the GPU
/// inventory they discovered). Callers set what their host does differently.
pub fn registration_from_spec(spec: &state::NodeSpec) -> proto::agent::RegisterNodeRequest {
    use proto::agent as pa;
    pa::RegisterNodeRequest {
        name: spec.name.clone(),
        gpus: spec
            .gpus
            .iter()
            .map(|g| pa::GpuInfo {
                uuid: g.uuid.clone(),
                index: g.index,
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                pci_bus_id: g.pci_bus_id.clone(),
                numa_node: g.numa_node.map_or(-1, |n| n as i32),
                mig_enabled: !g.mig.is_empty(),
                mig_instances: g
                    .mig
                    .iter()
                    .map(|m| pa::MigInstance {
                        uuid: m.uuid.clone(),
                        profile: m.profile.clone(),
                        memory_mib: m.memory_mib,
                    })
                    .collect(),
            })
            .collect(),
        topology: spec
            .topology
            .iter()
            .map(|row| pa::LinkRow { links: row.clone() })
            .collect(),
        cpu_milli: spec.cpu_milli,
        memory_mib: spec.memory_mib,
        partition: spec.partition.clone().unwrap_or_default(),
        labels: spec.labels.clone().into_iter().collect(),
        agent_address: spec.agent_address.clone(),
        driver: spec.driver.clone(),
        fence_grace_ms: 0,
        incarnation: spec.incarnation.clone(),
        // Simulated hosts run this release's agent code.
        agent_release: crate::state::format::RELEASE.to_owned(),
        // They start no process, so there is nothing to confine.
        enforcement: "unenforced: a simulated host in process, with no workloads".into(),
        container_runtime: String::new(),
        service_ports: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_counts_are_rejected_naming_the_field() {
        let spec = pb::JobSpec {
            tenant: "t".into(),
            command: vec!["x".into()],
            gpus_per_task: -1,
            tasks: 1,
            ..Default::default()
        };
        let err = job_spec_from_proto(Some(spec)).unwrap_err();
        assert_eq!(err.field.as_deref(), Some("gpus_per_task"));
    }

    #[test]
    fn a_spec_round_trips_through_the_wire_type() {
        let spec = JobSpec {
            tenant: "ml".into(),
            name: "train".into(),
            command: vec!["python".into(), "train.py".into()],
            gpus_per_task: 8,
            tasks: 2,
            gpu_models: vec!["H100".into(), "A100".into()],
            partition: Some("h100".into()),
            priority_class: "high".into(),
            time_limit_secs: Some(3600),
            dependencies: vec![Dependency {
                kind: DependencyKind::AfterNotOk,
                job: 4,
            }],
            cpu_milli_per_task: 8000,
            memory_mib_per_task: 64_000,
            env: [("A".to_owned(), "1".to_owned())].into_iter().collect(),
            gpu_milli: 0,
            gpu_memory_mib: 0,
            mig_profile: Some("3g.40gb".into()),
            preemptible: true,
            single_numa: true,
            workdir: Some("/home/ml/run-7".into()),
            container: Some(crate::state::ContainerSpec {
                image: "registry.example/ml/trainer:1.4".into(),
                mounts: vec![crate::state::ContainerMount {
                    source: "/data/imagenet".into(),
                    target: "/data".into(),
                    read_only: true,
                }],
            }),
            stdout_path: Some("out-%j.txt".into()),
            stderr_path: Some("/logs/%x-%j.err".into()),
            hold_if_unfit: true,
            nodelist: vec!["gpu01".into(), "gpu02".into()],
            exclude: vec!["gpu09".into()],
            exclusive: true,
            begin_at: Some(1_800_000_000_000),
            hold: true,
            array: Some(crate::state::ArraySpec {
                ranges: vec![crate::state::ArrayRange {
                    first: 0,
                    last: 99,
                    step: 3,
                }],
                max_running: 8,
            }),
            ports: vec!["http".into(), "metrics".into()],
        };
        let back = job_spec_from_proto(Some(job_spec_to_proto(&spec))).unwrap();
        assert_eq!(back, spec);
    }
}
