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

use super::route::{error_status, route};
use crate::leader::{LeaderConfig, Liveness};
use crate::replica::{ApiError, Replica};
use crate::state::{
    ClusterState, Command, Gpu, GpuHealth, MigSlice, NodeSpec, NodeStatus, Outcome, Rejection,
    TaskOutcome,
};

/// How often an unchanged assignment set is re-sent, so agents notice a dead stream quickly.
const ASSIGNMENT_KEEPALIVE: Duration = Duration::from_secs(1);

pub struct AgentService {
    replica: Arc<Replica>,
    liveness: Arc<Liveness>,
    config: LeaderConfig,
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

fn node_spec_from_proto(req: pa::RegisterNodeRequest) -> NodeSpec {
    NodeSpec {
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
    }
}

/// The allocations `node` should run, as the agent sees them.
pub fn assignments_for(cluster: &ClusterState, node: &str, term: u64) -> pa::Assignments {
    let allocations = cluster
        .allocations
        .values()
        .filter(|r| r.allocation.node == node && !r.stop_requested)
        .filter_map(|r| {
            let job = cluster.jobs.get(&r.allocation.job)?;
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
            })
        })
        .collect();
    pa::Assignments {
        term,
        epoch: cluster.last_allocation_id,
        allocations,
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
            |req| async move {
                r.require_leader()?;
                let spec = node_spec_from_proto(req);
                crate::state::validate::validate_node_spec(&spec)?;
                let name = spec.name.clone();
                match r.write(Command::RegisterNode { spec }).await? {
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
            |req| async move {
                r.require_leader()?;
                check_node_exists(&r.sm.read().cluster, &req.node)?;
                liveness.heartbeat(&req.node);
                Ok(pa::HeartbeatResponse {
                    term: r.raft.metrics().borrow().current_term,
                    lease_ms: config.node_lease.as_millis() as u64,
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
        let node = request.into_inner().node;
        r.require_leader().map_err(|e| error_status(&r, e))?;
        // Everything committed before this term must be applied first, or the first set could
        // omit a live allocation and make the agent stop it.
        r.linearize().await.map_err(|e| error_status(&r, e))?;
        check_node_exists(&r.sm.read().cluster, &node).map_err(|e| error_status(&r, e))?;
        let term = r.raft.metrics().borrow().current_term;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut applied = r.sm.watch_applied();
            let mut metrics = r.raft.metrics();
            let mut last: Option<pa::Assignments> = None;
            loop {
                {
                    let m = metrics.borrow();
                    if m.state != ServerState::Leader || m.current_term != term {
                        let _ = tx.try_send(Err(Status::unavailable(
                            "this replica stopped leading; reconnect",
                        )));
                        return;
                    }
                }
                let set = assignments_for(&r.sm.read().cluster, &node, term);
                if last.as_ref() != Some(&set) {
                    if tx.send(Ok(set.clone())).await.is_err() {
                        return;
                    }
                    last = Some(set);
                }
                tokio::select! {
                    _ = applied.changed() => {}
                    _ = metrics.changed() => {}
                    _ = tokio::time::sleep(ASSIGNMENT_KEEPALIVE) => {
                        // Keepalive: resend the unchanged set.
                        if let Some(set) = &last
                            && tx.send(Ok(set.clone())).await.is_err()
                        {
                            return;
                        }
                    }
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
            |req| async move {
                {
                    let data = r.sm.read();
                    match data.cluster.allocations.get(&req.allocation_id) {
                        // Already released (reported before, or the node was declared lost):
                        // nothing left to do, and the agent may forget it.
                        None => return Ok(pa::ReportResponse {}),
                        Some(rec) if rec.allocation.node != req.node => {
                            return Err(Rejection::precondition(format!(
                                "allocation {} belongs to node {}, not {}",
                                req.allocation_id, rec.allocation.node, req.node
                            ))
                            .into());
                        }
                        Some(_) => {}
                    }
                }
                use pa::allocation_report::Event;
                let allocation = req.allocation_id;
                let outcome = match Event::try_from(req.event) {
                    Ok(Event::Started) => None,
                    Ok(Event::Succeeded) => Some(TaskOutcome::Succeeded),
                    Ok(Event::Failed) => Some(TaskOutcome::Failed {
                        exit_code: req.has_exit_code.then_some(req.exit_code),
                        signal: (req.signal != 0).then_some(req.signal),
                        reason: req.reason,
                    }),
                    Ok(Event::TimedOut) => Some(TaskOutcome::TimedOut),
                    Ok(Event::Lost) => Some(TaskOutcome::Lost { reason: req.reason }),
                    Ok(Event::Stopped) => Some(TaskOutcome::Stopped),
                    _ => {
                        return Err(Rejection::invalid(
                            "event",
                            format!("unknown event {}", req.event),
                        )
                        .into());
                    }
                };
                let command = match outcome {
                    None => Command::AllocationStarted { allocation },
                    Some(outcome) => Command::AllocationExited {
                        allocation,
                        outcome,
                    },
                };
                match r.write(command).await? {
                    Outcome::Done
                    | Outcome::Rejected(Rejection {
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
            |req| async move {
                let health = if req.healthy {
                    GpuHealth::Healthy
                } else {
                    GpuHealth::Unhealthy { reason: req.reason }
                };
                match r
                    .write(Command::SetGpuHealth {
                        node: req.node,
                        gpu: req.gpu_uuid,
                        health,
                    })
                    .await?
                {
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
