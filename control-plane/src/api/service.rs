//! The `ControlPlane` gRPC service.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use openraft::ChangeMembers;
use proto::v1 as pb;
use proto::v1::control_plane_client::ControlPlaneClient;
use proto::v1::control_plane_server::ControlPlane;
use tokio::sync::broadcast::error::RecvError;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::convert;
use super::route::{forward_if_follower, route};
use crate::raft::NodeId;
use crate::replica::{ApiError, Replica};
use crate::state::validate::{validate_idempotency_key, validate_job_spec};
use crate::state::{ClusterState, Command, GpuHealth, JobState, NodeStatus, Outcome, Rejection};

pub struct ControlPlaneService {
    replica: Arc<Replica>,
}

impl ControlPlaneService {
    pub fn new(replica: Arc<Replica>) -> Self {
        ControlPlaneService { replica }
    }
}

fn unexpected(outcome: Outcome) -> ApiError {
    match outcome {
        Outcome::Rejected(r) => ApiError::Rejected(r),
        other => ApiError::Internal(format!("unexpected outcome {other:?}")),
    }
}

async fn read_barrier(replica: &Replica, read: &Option<pb::ReadOptions>) -> Result<(), ApiError> {
    if read.as_ref().is_some_and(|r| r.stale) {
        return Ok(());
    }
    replica.linearize().await
}

/// A read from this replica's applied state: linearizable unless the request asks for a stale
/// read, forwarded to the leader when this replica cannot confirm it leads.
async fn read_route<Req, Resp, B, R, RF>(
    r: &Replica,
    request: Request<Req>,
    options: fn(&Req) -> Option<pb::ReadOptions>,
    build: B,
    remote: R,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    B: FnOnce(&Req, &ClusterState) -> Result<Resp, ApiError>,
    R: FnOnce(tonic::transport::Channel, Request<Req>) -> RF,
    RF: std::future::Future<Output = Result<Response<Resp>, Status>>,
{
    route(
        r,
        request,
        |req| async move {
            read_barrier(r, &options(&req)).await?;
            let data = r.sm.read();
            build(&req, &data.cluster)
        },
        remote,
    )
    .await
}

fn parse_states(names: &[String]) -> Result<BTreeSet<JobState>, Rejection> {
    names
        .iter()
        .map(|n| {
            JobState::parse(&n.to_ascii_lowercase()).ok_or_else(|| {
                let known: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
                Rejection::invalid(
                    "states",
                    format!("unknown state {n:?}; one of {}", known.join(", ")),
                )
            })
        })
        .collect()
}

type JobEventStream = Pin<Box<dyn Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

#[tonic::async_trait]
impl ControlPlane for ControlPlaneService {
    #[tracing::instrument(level = "info", skip_all, name = "rpc.SubmitJob")]
    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                forward_if_follower(r)?;
                let spec = convert::job_spec_from_proto(req.spec)?;
                validate_job_spec(&spec)?;
                let key = if req.idempotency_key.is_empty() {
                    None
                } else {
                    validate_idempotency_key(&req.idempotency_key)?;
                    Some(req.idempotency_key)
                };
                // Checks against current state first so that a request the state would reject
                // is answered without adding an entry to the log. Apply checks again.
                {
                    let data = r.sm.read_async().await;
                    let known = key
                        .as_deref()
                        .and_then(|k| data.cluster.job_for_key(&spec.tenant, k));
                    if known.is_none() {
                        data.cluster.check_submission(&spec)?;
                    }
                }
                match r.write(Command::submit(spec, key)).await? {
                    Outcome::JobSubmitted { id, created } => {
                        Ok(pb::SubmitJobResponse { id, created })
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).submit_job(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.CancelJob")]
    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                match r.write(Command::cancel(req.id, req.reason)).await? {
                    Outcome::JobCancelled { id } => {
                        let data = r.sm.read();
                        let job = data
                            .cluster
                            .job(id)
                            .map(|j| convert::job_to_proto(j, &data.cluster));
                        Ok(pb::CancelJobResponse { job })
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).cancel_job(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.GetJob")]
    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        read_route(
            &self.replica,
            request,
            |req| req.read,
            |req, cluster| {
                if let Some(j) = cluster.job(req.id) {
                    return Ok(convert::job_to_proto(j, cluster));
                }
                cluster
                    .archived
                    .get(&req.id)
                    .map(convert::archived_job_to_proto)
                    .ok_or_else(|| Rejection::not_found(cluster.missing_job(req.id)).into())
            },
            |ch, req| async move { ControlPlaneClient::new(ch).get_job(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.ListJobs")]
    async fn list_jobs(
        &self,
        request: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        read_route(
            &self.replica,
            request,
            |req| req.read,
            |req, cluster| {
                let states = parse_states(&req.states)?;
                let jobs = cluster
                    .jobs
                    .values()
                    .filter(|j| {
                        if states.is_empty() {
                            req.include_finished || !j.state.is_final()
                        } else {
                            states.contains(&j.state)
                        }
                    })
                    .filter(|j| req.tenant.is_empty() || j.spec.tenant == req.tenant)
                    .filter(|j| {
                        req.partition.is_empty()
                            || j.spec.partition.as_deref() == Some(req.partition.as_str())
                    })
                    .map(|j| convert::job_to_proto(j, cluster))
                    .collect();
                let archived = cluster
                    .archived
                    .values()
                    .filter(|a| {
                        if states.is_empty() {
                            req.include_finished
                        } else {
                            states.contains(&a.state)
                        }
                    })
                    .filter(|a| req.tenant.is_empty() || a.tenant() == req.tenant)
                    // The partition is not kept in the archive: a partition filter skips it.
                    .filter(|_| req.partition.is_empty())
                    .map(convert::archived_job_to_proto);
                let mut jobs: Vec<pb::Job> = jobs;
                jobs.extend(archived);
                jobs.sort_by_key(|j| j.id);
                Ok(pb::ListJobsResponse { jobs })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_jobs(req).await },
        )
        .await
    }

    type WatchJobsStream = JobEventStream;

    #[tracing::instrument(level = "info", skip_all, name = "rpc.WatchJobs")]
    async fn watch_jobs(
        &self,
        request: Request<pb::WatchJobsRequest>,
    ) -> Result<Response<Self::WatchJobsStream>, Status> {
        let req = request.into_inner();
        // Subscribe before taking the initial listing so no change falls between the two.
        let mut events = self.replica.sm.subscribe();
        let initial: Vec<pb::JobEvent> = if req.initial {
            let data = self.replica.sm.read();
            let index = data.last_applied.map(|l| l.index).unwrap_or(0);
            data.cluster
                .jobs
                .values()
                .filter(|j| req.tenant.is_empty() || j.spec.tenant == req.tenant)
                .map(|j| pb::JobEvent {
                    job: Some(convert::job_to_proto(j, &data.cluster)),
                    log_index: index,
                })
                .collect()
        } else {
            Vec::new()
        };
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let replica = self.replica.clone();
        tokio::spawn(async move {
            for e in initial {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            loop {
                match events.recv().await {
                    Ok(ev) => {
                        if !req.tenant.is_empty() && ev.job.spec.tenant != req.tenant {
                            continue;
                        }
                        let job = {
                            let data = replica.sm.read_async().await;
                            convert::job_to_proto(&ev.job, &data.cluster)
                        };
                        let msg = pb::JobEvent {
                            job: Some(job),
                            log_index: ev.log_index,
                        };
                        if tx.send(Ok(msg)).await.is_err() {
                            return;
                        }
                    }
                    Err(RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::data_loss(format!(
                                "this watch fell {n} changes behind; list the jobs again and start a new watch"
                            ))))
                            .await;
                        return;
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.ListNodes")]
    async fn list_nodes(
        &self,
        request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        read_route(
            &self.replica,
            request,
            |req| req.read,
            |_, cluster| {
                Ok(pb::ListNodesResponse {
                    nodes: cluster
                        .nodes
                        .values()
                        .map(|n| convert::node_to_proto(n, cluster))
                        .collect(),
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_nodes(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.ClusterStatus")]
    async fn cluster_status(
        &self,
        _request: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        Ok(Response::new(cluster_status(&self.replica)))
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.AddReplica")]
    async fn add_replica(
        &self,
        request: Request<pb::AddReplicaRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                check_member_request(r, req.id, Some(&req.address))?;
                r.require_leader()?;
                let node = openraft::BasicNode::new(req.address.clone());
                tracing::info!(id = req.id, address = %req.address, "adding replica as learner");
                r.raft
                    .add_learner(req.id, node, true)
                    .await
                    .map_err(|e| membership_error(r, e))?;
                if !req.learner_only {
                    tracing::info!(id = req.id, "promoting replica to voter");
                    r.raft
                        .change_membership(
                            ChangeMembers::AddVoterIds(BTreeSet::from([req.id])),
                            false,
                        )
                        .await
                        .map_err(|e| membership_error(r, e))?;
                }
                Ok(cluster_status(r))
            },
            |ch, req| async move { ControlPlaneClient::new(ch).add_replica(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.RemoveReplica")]
    async fn remove_replica(
        &self,
        request: Request<pb::RemoveReplicaRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                check_member_request(r, req.id, None)?;
                r.require_leader()?;
                let membership = r.raft.metrics().borrow().membership_config.clone();
                let voters: BTreeSet<NodeId> = membership.membership().voter_ids().collect();
                let change = if voters.contains(&req.id) {
                    if voters.len() == 1 {
                        return Err(Rejection::precondition(
                            "cannot remove the last voting replica",
                        )
                        .into());
                    }
                    ChangeMembers::RemoveVoters(BTreeSet::from([req.id]))
                } else {
                    ChangeMembers::RemoveNodes(BTreeSet::from([req.id]))
                };
                tracing::info!(id = req.id, "removing replica");
                r.raft
                    .change_membership(change, false)
                    .await
                    .map_err(|e| membership_error(r, e))?;
                Ok(cluster_status(r))
            },
            |ch, req| async move { ControlPlaneClient::new(ch).remove_replica(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.PutTenant")]
    async fn put_tenant(
        &self,
        request: Request<pb::Tenant>,
    ) -> Result<Response<pb::Tenant>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                let tenant = convert::tenant_from_proto(req);
                crate::state::validate::validate_tenant(&tenant)?;
                match r
                    .write(Command::PutTenant {
                        tenant: tenant.clone(),
                    })
                    .await?
                {
                    Outcome::Done => Ok(convert::tenant_to_proto(&tenant)),
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).put_tenant(req).await },
        )
        .await
    }

    async fn list_tenants(
        &self,
        request: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        read_route(
            &self.replica,
            request,
            |req| req.read,
            |_, cluster| {
                Ok(pb::ListTenantsResponse {
                    tenants: cluster
                        .tenants
                        .values()
                        .map(convert::tenant_to_proto)
                        .collect(),
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_tenants(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.PutPartition")]
    async fn put_partition(
        &self,
        request: Request<pb::Partition>,
    ) -> Result<Response<pb::Partition>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                let partition = convert::partition_from_proto(req);
                crate::state::validate::validate_partition(&partition)?;
                match r
                    .write(Command::PutPartition {
                        partition: partition.clone(),
                    })
                    .await?
                {
                    Outcome::Done => Ok(convert::partition_to_proto(&partition)),
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).put_partition(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.DrainNode")]
    async fn drain_node(
        &self,
        request: Request<pb::DrainNodeRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                let command = Command::SetNodeStatus {
                    node: req.node.clone(),
                    status: NodeStatus::Drained,
                    evict: req.evict,
                    reason: req.reason,
                };
                node_after(r, command, &req.node).await
            },
            |ch, req| async move { ControlPlaneClient::new(ch).drain_node(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.UndrainNode")]
    async fn undrain_node(
        &self,
        request: Request<pb::UndrainNodeRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                let command = Command::SetNodeStatus {
                    node: req.node.clone(),
                    status: NodeStatus::Ready,
                    evict: false,
                    reason: String::new(),
                };
                node_after(r, command, &req.node).await
            },
            |ch, req| async move { ControlPlaneClient::new(ch).undrain_node(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.UncordonGpu")]
    async fn uncordon_gpu(
        &self,
        request: Request<pb::UncordonGpuRequest>,
    ) -> Result<Response<pb::Node>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |req| async move {
                let command = Command::SetGpuHealth {
                    node: req.node.clone(),
                    gpu: req.gpu,
                    health: GpuHealth::Healthy,
                };
                node_after(r, command, &req.node).await
            },
            |ch, req| async move { ControlPlaneClient::new(ch).uncordon_gpu(req).await },
        )
        .await
    }

    async fn list_partitions(
        &self,
        request: Request<pb::ListPartitionsRequest>,
    ) -> Result<Response<pb::ListPartitionsResponse>, Status> {
        read_route(
            &self.replica,
            request,
            |req| req.read,
            |_, cluster| {
                Ok(pb::ListPartitionsResponse {
                    partitions: cluster
                        .partitions
                        .values()
                        .map(convert::partition_to_proto)
                        .collect(),
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_partitions(req).await },
        )
        .await
    }
}

/// Applies a node command and returns the node as it is afterwards.
async fn node_after(r: &Replica, command: Command, node: &str) -> Result<pb::Node, ApiError> {
    match r.write(command).await? {
        Outcome::Done => {
            let data = r.sm.read();
            data.cluster
                .nodes
                .get(node)
                .map(|n| convert::node_to_proto(n, &data.cluster))
                .ok_or_else(|| Rejection::not_found(format!("node {node} does not exist")).into())
        }
        other => Err(unexpected(other)),
    }
}

fn membership_error<E>(r: &Replica, e: openraft::error::RaftError<NodeId, E>) -> ApiError
where
    E: std::fmt::Display
        + std::fmt::Debug
        + openraft::TryAsRef<openraft::error::ForwardToLeader<NodeId, openraft::BasicNode>>,
{
    if let Some(f) = e.forward_to_leader() {
        return crate::replica::not_leader(f);
    }
    ApiError::Rejected(Rejection::precondition(format!(
        "membership change on replica {} failed: {e}",
        r.id
    )))
}

/// Refuses membership requests that would corrupt the id → address mapping.
fn check_member_request(r: &Replica, id: NodeId, address: Option<&str>) -> Result<(), Rejection> {
    if id == 0 {
        return Err(Rejection::invalid("id", "replica ids start at 1"));
    }
    let membership = r.raft.metrics().borrow().membership_config.clone();
    let nodes: BTreeMap<NodeId, String> = membership
        .membership()
        .nodes()
        .map(|(id, n)| (*id, n.addr.clone()))
        .collect();
    match address {
        Some(addr) => {
            if addr.parse::<std::net::SocketAddr>().is_err() && !addr.contains(':') {
                return Err(Rejection::invalid(
                    "address",
                    format!("{addr:?} is not host:port"),
                ));
            }
            if let Some(existing) = nodes.get(&id)
                && existing != addr
            {
                return Err(Rejection::invalid(
                    "address",
                    format!(
                        "replica {id} is already a member at {existing}; remove it first to change its address"
                    ),
                ));
            }
            if let Some((other, _)) = nodes.iter().find(|(i, a)| **i != id && a.as_str() == addr) {
                return Err(Rejection::invalid(
                    "address",
                    format!("{addr} already belongs to replica {other}"),
                ));
            }
        }
        None => {
            if !nodes.contains_key(&id) {
                return Err(Rejection::not_found(format!(
                    "replica {id} is not a member"
                )));
            }
        }
    }
    Ok(())
}

pub fn cluster_status(r: &Replica) -> pb::ClusterStatusResponse {
    let m = r.raft.metrics().borrow().clone();
    let membership = m.membership_config.membership();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    let matched: BTreeMap<NodeId, u64> = m
        .replication
        .as_ref()
        .map(|rep| {
            rep.iter()
                .map(|(id, log)| (*id, log.map(|l| l.index).unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    let members = membership
        .nodes()
        .map(|(id, node)| pb::Member {
            id: *id,
            address: node.addr.clone(),
            role: if voters.contains(id) {
                "voter"
            } else {
                "learner"
            }
            .to_owned(),
            matched_index: matched.get(id).copied().unwrap_or(0),
        })
        .collect();
    let data = r.sm.read();
    pb::ClusterStatusResponse {
        cluster: r.cluster.clone(),
        id: r.id,
        leader: m.current_leader.unwrap_or(0),
        term: m.current_term,
        commit_index: r.commit_index(),
        applied_index: m.last_applied.map(|l| l.index).unwrap_or(0),
        last_log_index: m.last_log_index.unwrap_or(0),
        snapshot_index: m.snapshot.map(|l| l.index).unwrap_or(0),
        state: format!("{:?}", m.state).to_lowercase(),
        members,
        jobs: data.cluster.jobs.len() as u64,
        nodes: data.cluster.nodes.len() as u64,
    }
}
