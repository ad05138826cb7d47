//! The `AgentApi` gRPC service that node agents call. Registration, heartbeats and reports
//! work through any replica (followers forward to the leader); the assignment stream is served
//! by the leader alone, since only it knows which agents are alive.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use openraft::ServerState;
use proto::agent as pa;
use proto::agent::agent_api_client::AgentApiClient;
use proto::agent::agent_api_server::AgentApi;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::auth::authenticate;
use super::route::{error_status, route};
use crate::leader::{LeaderConfig, Liveness};
use crate::replica::{ApiError, Replica};
use crate::state::{
    ClusterState, Command, Gpu, GpuHealth, MigSlice, NodeSpec, NodeStatus, Outcome, Rejection,
    TaskOutcome, TaskUsage,
};

/// How much shorter than the node grace an agent's fence grace must be.
const FENCE_MARGIN_MS: u64 = 500;

/// How often an unchanged assignment set is re-sent, so agents notice a dead stream quickly.
const ASSIGNMENT_KEEPALIVE: Duration = Duration::from_secs(1);
/// How often an open assignment stream re-checks that this replica still leads.
const LEADERSHIP_CHECK: Duration = Duration::from_millis(100);

pub struct AgentService {
    replica: Arc<Replica>,
    liveness: Arc<Liveness>,
    config: LeaderConfig,
}

/// Fails unless this replica leads *and* heard from a quorum recently. openraft 0.9 has no
/// check-quorum step-down, so a leader cut off from the majority still believes it leads; if
/// it kept renewing agent leases, an agent in its minority partition would never fence while
/// the majority's leader places its jobs elsewhere.
fn require_live_leader(r: &Replica, config: &LeaderConfig) -> Result<(), ApiError> {
    r.require_leader()?;
    let silent = r.raft.metrics().borrow().millis_since_quorum_ack;
    match silent {
        Some(ms) if ms <= config.max_quorum_silence.as_millis() as u64 => Ok(()),
        _ => Err(ApiError::Unavailable(format!(
            "replica {} has not heard from a quorum for {silent:?} ms; it cannot vouch for node leases",
            r.id
        ))),
    }
}

impl AgentService {
    pub fn new(replica: Arc<Replica>, liveness: Arc<Liveness>, config: LeaderConfig) -> Self {
        AgentService {
            replica,
            liveness,
            config,
        }
    }
}

/// The node a registration describes (validated by the caller: `validate_node_spec`).
pub fn node_spec_from_proto(req: pa::RegisterNodeRequest) -> NodeSpec {
    NodeSpec {
        agent_release: req.agent_release,
        enforcement: req.enforcement,
        container_runtime: req.container_runtime,
        // A range the wire cannot hold as ports is no range (validation refuses it by name).
        service_ports: req.service_ports.map(|r| crate::state::PortRange {
            first: u16::try_from(r.first).unwrap_or(0),
            last: u16::try_from(r.last).unwrap_or(0),
        }),
        name: req.name,
        gpus: req
            .gpus
            .into_iter()
            .map(|g| Gpu {
                uuid: g.uuid,
                index: g.index,
                model: g.model,
                memory_mib: g.memory_mib,
                numa_node: u32::try_from(g.numa_node).ok(),
                pci_bus_id: g.pci_bus_id,
                health: GpuHealth::Healthy,
                mig: g
                    .mig_instances
                    .into_iter()
                    .map(|m| MigSlice {
                        uuid: m.uuid,
                        profile: m.profile,
                        memory_mib: m.memory_mib,
                    })
                    .collect(),
            })
            .collect(),
        cpu_milli: req.cpu_milli,
        memory_mib: req.memory_mib,
        partition: if req.partition.is_empty() {
            None
        } else {
            Some(req.partition)
        },
        labels: req.labels.into_iter().collect(),
        topology: req.topology.into_iter().map(|r| r.links).collect(),
        agent_address: req.agent_address,
        driver: req.driver,
        incarnation: req.incarnation,
    }
}

/// Why an agent's fence grace is refused, if it is: a fenced job must be dead before the
/// control plane may place its GPUs elsewhere.
pub fn fence_grace_refusal(fence_grace_ms: u64, node_grace_ms: u64) -> Option<Rejection> {
    (fence_grace_ms.saturating_add(FENCE_MARGIN_MS) > node_grace_ms).then(|| {
        Rejection::precondition(format!(
            "the agent's fence grace ({fence_grace_ms} ms) must be at least {FENCE_MARGIN_MS} ms shorter than the control plane's node grace ({node_grace_ms} ms): a fenced job could still be running when it is placed elsewhere"
        ))
    })
}

/// Why `node` may not report for `allocation`, if it may not. The node of an allocation never
/// changes, so even a replica that is behind answers this correctly; a missing allocation is
/// left to apply (this replica may not have applied its placement yet).
pub fn allocation_node_refusal(
    cluster: &ClusterState,
    allocation: u64,
    node: &str,
) -> Option<Rejection> {
    let rec = cluster.allocations.get(&allocation)?;
    (rec.allocation.node != node).then(|| {
        Rejection::precondition(format!(
            "allocation {allocation} belongs to node {}, not {node}",
            rec.allocation.node
        ))
    })
}

/// The command an allocation report asks for. `with_usage`: the cluster version records
/// usage (format 2); otherwise the entry keeps format 1's shape.
pub fn report_command(req: pa::AllocationReport, with_usage: bool) -> Result<Command, Rejection> {
    use pa::allocation_report::Event;
    let allocation = req.allocation_id;
    let outcome = match Event::try_from(req.event) {
        Ok(Event::Started) => return Ok(Command::AllocationStarted { allocation }),
        Ok(e @ (Event::Ready | Event::NotReady)) => {
            return Ok(Command::ReplicaReadiness {
                allocation,
                ready: e == Event::Ready,
                reason: req.reason,
            });
        }
        Ok(Event::Succeeded) => TaskOutcome::Succeeded,
        Ok(Event::Failed) => TaskOutcome::Failed {
            exit_code: req.has_exit_code.then_some(req.exit_code),
            signal: (req.signal != 0).then_some(req.signal),
            reason: req.reason,
        },
        Ok(Event::TimedOut) => TaskOutcome::TimedOut,
        Ok(Event::Lost) => TaskOutcome::Lost { reason: req.reason },
        Ok(Event::Stopped) => TaskOutcome::Stopped,
        _ => {
            return Err(Rejection::invalid(
                "event",
                format!("unknown event {}", req.event),
            ));
        }
    };
    let usage = req.usage.filter(|_| with_usage).map(|u| TaskUsage {
        cpu_ms: u.cpu_ms,
        peak_memory_bytes: u.peak_memory_bytes,
        oom_kills: u.oom_kills,
        gpu_samples: u.gpu_samples,
        gpu_sm_percent_avg: u.gpu_sm_percent_avg,
        gpu_peak_memory_bytes: u.gpu_peak_memory_bytes,
    });
    Ok(Command::AllocationExited {
        allocation,
        outcome,
        usage,
    })
}

/// The allocations `node` should run, as the agent sees them.
pub fn assignments_for(cluster: &ClusterState, node: &str, term: u64) -> pa::Assignments {
    let allocations = cluster
        .allocations_on(node)
        .filter_map(|r| {
            let job = cluster.jobs.get(&r.allocation.job)?;
            let (task_index, task_nodes, task_hosts) =
                task_layout(cluster, job.id, r.allocation.id);
            Some(pa::Assignment {
                allocation_id: r.allocation.id,
                job_id: job.id,
                job_name: job.spec.name.clone(),
                tenant: job.spec.tenant.clone(),
                command: job.spec.command.clone(),
                env: job.spec.env.clone().into_iter().collect(),
                gpus: r.allocation.gpus.clone(),
                time_limit_secs: job.spec.time_limit_secs.unwrap_or(0),
                term: r.allocation.term,
                stop: r.stop_requested,
                gpu_milli: r.allocation.gpu_milli,
                gpu_memory_mib: r.allocation.gpu_memory_mib,
                cpu_milli: job.spec.cpu_milli_per_task,
                memory_mib: job.spec.memory_mib_per_task,
                workdir: job.spec.workdir.clone().unwrap_or_default(),
                task_index,
                task_count: u32::try_from(task_hosts.len()).unwrap_or(u32::MAX),
                task_hosts,
                task_nodes,
                container: job.spec.container.as_ref().map(|c| pa::WorkloadContainer {
                    image: c.image.clone(),
                    mounts: c
                        .mounts
                        .iter()
                        .map(|m| pa::WorkloadMount {
                            source: m.source.clone(),
                            target: m.target.clone(),
                            read_only: m.read_only,
                        })
                        .collect(),
                }),
                stdout_path: job.spec.stdout_path.clone().unwrap_or_default(),
                stderr_path: job.spec.stderr_path.clone().unwrap_or_default(),
                ports: job
                    .spec
                    .ports
                    .iter()
                    .zip(&r.allocation.ports)
                    .map(|(name, port)| pa::NamedPort {
                        name: name.clone(),
                        port: u32::from(*port),
                    })
                    .collect(),
                start_after_ms: r.allocation.start_after.unwrap_or(0),
                replica: replica_info(cluster, job, &r.allocation),
                ..array_fields(job)
            })
        })
        .collect();
    pa::Assignments {
        term,
        epoch: cluster.last_allocation_id,
        allocations,
    }
}

/// What an agent needs to know of a service's replica: which it is, its probes (with the
/// ports they name resolved to the allocation's host ports) and the autoscaler's gauge.
fn replica_info(
    cluster: &ClusterState,
    job: &crate::state::Job,
    allocation: &crate::state::Allocation,
) -> Option<pa::ReplicaInfo> {
    use crate::state::{Probe, ProbeCheck};
    let r = job.replica.as_ref()?;
    let service = cluster.services.get(&r.service);
    let template = service.and_then(|s| s.revision_template(r.revision));
    let port_of = |name: &str| {
        job.spec
            .ports
            .iter()
            .position(|p| p == name)
            .and_then(|i| allocation.ports.get(i))
            .map_or(0, |p| u32::from(*p))
    };
    let probe = |p: &Probe| pa::ProbeSpec {
        check: Some(match &p.check {
            ProbeCheck::Http { port, path } => pa::probe_spec::Check::Http(pa::HttpCheck {
                port: port_of(port),
                path: path.clone(),
            }),
            ProbeCheck::Tcp { port } => pa::probe_spec::Check::TcpPort(port_of(port)),
            ProbeCheck::Exec { command } => pa::probe_spec::Check::Exec(pa::ExecCheck {
                command: command.clone(),
            }),
        }),
        initial_delay_ms: p.initial_delay_ms,
        period_ms: p.period_ms,
        timeout_ms: p.timeout_ms,
        failure_threshold: p.failure_threshold,
        success_threshold: p.success_threshold,
    };
    Some(pa::ReplicaInfo {
        service: r.service.clone(),
        ordinal: r.ordinal,
        revision: r.revision,
        readiness: template.and_then(|t| t.readiness.as_ref()).map(probe),
        liveness: template.and_then(|t| t.liveness.as_ref()).map(probe),
        metric: service
            .and_then(|s| s.spec.autoscale.as_ref())
            .map(|a| pa::MetricScrape {
                port: port_of(&a.port),
                path: a.path.clone(),
                metric: a.metric.clone(),
            }),
    })
}

/// The job-array fields of an assignment (all zero for a job outside an array): the array's
/// id and size, this job's index, the lowest and highest index.
fn array_fields(job: &crate::state::Job) -> pa::Assignment {
    let (Some(task), Some(array)) = (job.array_task, &job.spec.array) else {
        return pa::Assignment::default();
    };
    let (min, max) = array.index_bounds();
    pa::Assignment {
        array_job_id: task.array_id,
        array_task_id: task.index,
        array_task_count: task.count,
        array_task_min: min,
        array_task_max: max,
        ..Default::default()
    }
}

/// Allocation `id`'s task index among job `job`'s live allocations (by allocation id: the
/// order they were placed in, the same on every replica), each task's node, and each
/// task's host: its node's agent address without the port (where MASTER_ADDR is reached).
fn task_layout(cluster: &ClusterState, job: u64, id: u64) -> (u32, Vec<String>, Vec<String>) {
    let mut tasks: Vec<(u64, String, String)> = cluster
        .allocations_of(job)
        .map(|r| {
            let node = &r.allocation.node;
            let host = cluster
                .nodes
                .get(node)
                .map(|n| host_of(&n.spec.agent_address))
                .unwrap_or_default();
            (r.allocation.id, node.clone(), host)
        })
        .collect();
    tasks.sort();
    let index = tasks.iter().position(|(a, _, _)| *a == id).unwrap_or(0);
    let (nodes, hosts) = tasks.into_iter().map(|(_, n, h)| (n, h)).unzip();
    (u32::try_from(index).unwrap_or(u32::MAX), nodes, hosts)
}

/// "10.0.0.5:7100" → "10.0.0.5", "[fd00::1]:7100" → "fd00::1", "gpu-3" → "gpu-3".
fn host_of(address: &str) -> String {
    if let Some(rest) = address.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest).to_owned();
    }
    match address.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host.to_owned(),
        _ => address.to_owned(),
    }
}

fn check_node_exists(cluster: &ClusterState, node: &str) -> Result<(), ApiError> {
    match cluster.nodes.get(node) {
        None => Err(Rejection::not_found(format!(
            "node {node} is not registered; register it first"
        ))
        .into()),
        Some(n) if n.status == NodeStatus::Down => Err(Rejection::precondition(format!(
            "node {node} was declared lost; re-register it (its workloads were requeued)"
        ))
        .into()),
        Some(_) => Ok(()),
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<pa::Assignments, Status>> + Send>>;

#[tonic::async_trait]
impl AgentApi for AgentService {
    #[tracing::instrument(level = "info", skip_all, name = "rpc.RegisterNode")]
    async fn register_node(
        &self,
        request: Request<pa::RegisterNodeRequest>,
    ) -> Result<Response<pa::RegisterNodeResponse>, Status> {
        let (r, liveness, config) = (&self.replica, &self.liveness, &self.config);
        route(
            r,
            request,
            |caller, req| async move {
                caller.require_node(&req.name)?;
                require_live_leader(r, config)?;
                let node_grace = config.node_grace.as_millis() as u64;
                if let Some(refusal) = fence_grace_refusal(req.fence_grace_ms, node_grace) {
                    return Err(refusal.into());
                }
                {
                    let data = r.sm.read_async().await;
                    if let Some(existing) = data.cluster.nodes.get(&req.name)
                        && existing.spec.incarnation != req.incarnation
                        && existing.status != NodeStatus::Down
                        && liveness.silence(&req.name, r.now_ms(), existing.registered_at)
                            < config.node_lease + config.node_grace
                    {
                        return Err(Rejection::precondition(format!(
                            "node name {:?} is in use by another live agent (at {}); give this agent another --name, or stop the other one",
                            req.name, existing.spec.agent_address
                        ))
                        .into());
                    }
                }
                let spec = node_spec_from_proto(req);
                crate::state::validate::validate_node_spec(&spec)?;
                let name = spec.name.clone();
                match r.write(Command::RegisterNode { spec }.by(caller.actor())).await? {
                    Outcome::NodeRegistered => {}
                    Outcome::Rejected(rej) => return Err(rej.into()),
                    other => {
                        return Err(ApiError::Internal(format!("unexpected outcome {other:?}")));
                    }
                }
                liveness.heartbeat(&name);
                tracing::info!(node = %name, "node registered");
                Ok(pa::RegisterNodeResponse {
                    lease_ms: config.node_lease.as_millis() as u64,
                    heartbeat_interval_ms: config.agent_heartbeat.as_millis() as u64,
                    term: r.raft.metrics().borrow().current_term,
                })
            },
            |ch, req| async move { AgentApiClient::new(ch).register_node(req).await },
        )
        .await
    }

    async fn heartbeat(
        &self,
        request: Request<pa::HeartbeatRequest>,
    ) -> Result<Response<pa::HeartbeatResponse>, Status> {
        let (r, liveness, config) = (&self.replica, &self.liveness, &self.config);
        route(
            r,
            request,
            |caller, req| async move {
                caller.require_node(&req.node)?;
                require_live_leader(r, config)?;
                let (registered_at, register_again) = {
                    let data = r.sm.read_async().await;
                    check_node_exists(&data.cluster, &req.node)?;
                    let node = &data.cluster.nodes[&req.node];
                    if node.spec.incarnation != req.incarnation {
                        return Err(Rejection::precondition(format!(
                            "node {} is registered by another agent; re-register",
                            req.node
                        ))
                        .into());
                    }
                    // Registered while the cluster version was 1 (a cluster's first seconds, or
                    // before an upgrade finished): what format 2 records was left out.
                    let register_again = data.cluster.cluster_version.allows(2)
                        && node.spec.agent_release.is_empty();
                    (node.registered_at, register_again)
                };
                let limit = config.node_lease + config.node_grace;
                if let Err(silent) = liveness.renew(&req.node, limit, r.now_ms(), registered_at) {
                    // Its lease ran out a grace ago, so it has fenced its jobs; re-registering
                    // lets it take new ones (and makes a pending loss declaration stale).
                    return Err(Rejection::precondition(format!(
                        "node {} was silent for {:.1} s, past its lease and grace, and may be declared lost at any moment; re-register",
                        req.node,
                        silent.as_secs_f64()
                    ))
                    .into());
                }
                if !req.replica_metrics.is_empty() {
                    // Only gauges of the node's own allocations count: an agent speaks for
                    // its node alone.
                    let data = r.sm.read_async().await;
                    let own: Vec<pa::ReplicaMetric> = req
                        .replica_metrics
                        .iter()
                        .filter(|m| {
                            data.cluster
                                .allocations
                                .get(&m.allocation_id)
                                .is_some_and(|a| a.allocation.node == req.node)
                        })
                        .cloned()
                        .collect();
                    drop(data);
                    r.services.record_metrics(&own, r.now_ms());
                }
                Ok(pa::HeartbeatResponse {
                    term: r.raft.metrics().borrow().current_term,
                    lease_ms: config.node_lease.as_millis() as u64,
                    register_again,
                })
            },
            |ch, req| async move { AgentApiClient::new(ch).heartbeat(req).await },
        )
        .await
    }

    type WatchAssignmentsStream = AssignmentStream;

    #[tracing::instrument(level = "info", skip_all, name = "rpc.WatchAssignments")]
    async fn watch_assignments(
        &self,
        request: Request<pa::WatchAssignmentsRequest>,
    ) -> Result<Response<Self::WatchAssignmentsStream>, Status> {
        let r = self.replica.clone();
        let config = self.config.clone();
        let caller = authenticate(&r, &request)
            .await
            .map_err(|e| error_status(&r, e))?;
        let node = request.into_inner().node;
        caller
            .require_node(&node)
            .map_err(|e| error_status(&r, e))?;
        require_live_leader(&r, &config).map_err(|e| error_status(&r, e))?;
        // Everything committed before this term must be applied first, or the first set could
        // omit a live allocation and make the agent stop it.
        r.linearize().await.map_err(|e| error_status(&r, e))?;
        check_node_exists(&r.sm.read().cluster, &node).map_err(|e| error_status(&r, e))?;
        let term = r.raft.metrics().borrow().current_term;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut applied = r.sm.watch_applied();
            let metrics = r.raft.metrics();
            let mut last: Option<pa::Assignments> = None;
            let mut last_sent = tokio::time::Instant::now();
            loop {
                {
                    let m = metrics.borrow();
                    let quorum_silent = m
                        .millis_since_quorum_ack
                        .is_none_or(|ms| ms > config.max_quorum_silence.as_millis() as u64);
                    if m.state != ServerState::Leader || m.current_term != term || quorum_silent {
                        let _ = tx.try_send(Err(Status::unavailable(
                            "this replica stopped leading (or lost its quorum); reconnect",
                        )));
                        return;
                    }
                }
                let set = assignments_for(&r.sm.read_async().await.cluster, &node, term);
                // Send on change, and resend an unchanged set as a keepalive.
                if last.as_ref() != Some(&set) || last_sent.elapsed() >= ASSIGNMENT_KEEPALIVE {
                    if tx.send(Ok(set.clone())).await.is_err() {
                        return;
                    }
                    last = Some(set);
                    last_sent = tokio::time::Instant::now();
                }
                // Leadership is re-checked at least every LEADERSHIP_CHECK.
                tokio::select! {
                    // Biased so the deterministic simulation replays the same order (tokio's
                    // fair select uses an unseedable random source); both branches loop.
                    biased;
                    _ = applied.changed() => {}
                    _ = tokio::time::sleep(LEADERSHIP_CHECK) => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.ReportAllocation")]
    async fn report_allocation(
        &self,
        request: Request<pa::AllocationReport>,
    ) -> Result<Response<pa::ReportResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require_node(&req.node)?;
                {
                    // The node of an allocation never changes, so even a replica that is behind
                    // answers this check correctly. A missing allocation is left to apply: this
                    // replica may not have applied its placement yet, and apply's NotFound (an
                    // exit reported before, or a node declared lost) is answered as success.
                    let data = r.sm.read_async().await;
                    if let Some(refusal) =
                        allocation_node_refusal(&data.cluster, req.allocation_id, &req.node)
                    {
                        return Err(refusal.into());
                    }
                }
                let with_usage = r.sm.cluster_version() >= 2;
                let event = pa::allocation_report::Event::try_from(req.event).ok();
                let command = report_command(req, with_usage)?;
                match r.write(command.by(caller.actor())).await? {
                    Outcome::Done => {
                        // Counted where the entry was written (the leader), once per report
                        // that changed the state: a retried report answers NotFound below.
                        use pa::allocation_report::Event as E;
                        if let Some(e) =
                            event.filter(|e| !matches!(e, E::Started | E::Ready | E::NotReady))
                        {
                            r.metrics
                                .task_exit(node_agent::agent::metrics::exit_kind(e));
                        }
                        Ok(pa::ReportResponse {})
                    }
                    Outcome::Rejected(Rejection {
                        kind: crate::state::RejectKind::NotFound,
                        ..
                    }) => Ok(pa::ReportResponse {}),
                    Outcome::Rejected(rej) => Err(rej.into()),
                    other => Err(ApiError::Internal(format!("unexpected outcome {other:?}"))),
                }
            },
            |ch, req| async move { AgentApiClient::new(ch).report_allocation(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.ReportGpuHealth")]
    async fn report_gpu_health(
        &self,
        request: Request<pa::GpuHealthReport>,
    ) -> Result<Response<pa::ReportResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require_node(&req.node)?;
                r.metrics.xid_report(req.xid);
                let health = if req.healthy {
                    GpuHealth::Healthy
                } else {
                    GpuHealth::Unhealthy { reason: req.reason }
                };
                let command = Command::SetGpuHealth {
                    node: req.node,
                    gpu: req.gpu_uuid,
                    health,
                };
                match r.write(command.by(caller.actor())).await? {
                    Outcome::Done => Ok(pa::ReportResponse {}),
                    Outcome::Rejected(rej) => Err(rej.into()),
                    other => Err(ApiError::Internal(format!("unexpected outcome {other:?}"))),
                }
            },
            |ch, req| async move { AgentApiClient::new(ch).report_gpu_health(req).await },
        )
        .await
    }
}
