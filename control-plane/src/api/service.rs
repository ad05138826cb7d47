//! The `ControlPlane` gRPC service.

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use proto::v1 as pb;
use proto::v1::control_plane_client::ControlPlaneClient;
use proto::v1::control_plane_server::ControlPlane;
use tokio::sync::broadcast::error::RecvError;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::auth::{Action, Caller, authenticate, authenticate_caller};
use super::convert;
use super::route::{current_leader_state, error_status, route};
use crate::membership;
use crate::replica::{ApiError, Replica};
use crate::scheduler::reasons::{self, ShapeMemo};
use crate::state::validate::{validate_idempotency_key, validate_job_spec};
use crate::state::{
    ClusterState, Command, GpuHealth, Job, JobChange, JobState, NodeStatus, Outcome, Rejection,
};

pub struct ControlPlaneService {
    replica: Arc<Replica>,
    /// One backup copy at a time on this replica (each holds about the state's size in memory).
    backups: Arc<tokio::sync::Semaphore>,
}

impl ControlPlaneService {
    pub fn new(replica: Arc<Replica>) -> Self {
        ControlPlaneService {
            replica,
            backups: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }
}

fn unexpected(outcome: Outcome) -> ApiError {
    match outcome {
        Outcome::Rejected(r) => ApiError::Rejected(r),
        other => ApiError::Internal(format!("unexpected outcome {other:?}")),
    }
}

pub(super) async fn read_barrier(
    replica: &Replica,
    read: &Option<pb::ReadOptions>,
) -> Result<(), ApiError> {
    if read.as_ref().is_some_and(|r| r.stale) {
        return Ok(());
    }
    replica.linearize().await
}

/// A read from this replica's applied state, for a caller allowed `action`: linearizable
/// unless the request asks for a stale read, forwarded to the leader when this replica cannot
/// confirm it leads.
async fn read_route<Req, Resp, B, R, RF>(
    r: &Replica,
    request: Request<Req>,
    action: Action,
    options: fn(&Req) -> Option<pb::ReadOptions>,
    build: B,
    remote: R,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    B: FnOnce(&Caller, &Req, &ClusterState) -> Result<Resp, ApiError>,
    R: FnOnce(tonic::transport::Channel, Request<Req>) -> RF,
    RF: std::future::Future<Output = Result<Response<Resp>, Status>>,
{
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(action)?;
            read_barrier(r, &options(&req)).await?;
            let data = r.sm.read();
            build(&caller, &req, &data.cluster)
        },
        remote,
    )
    .await
}

/// A job as `caller` may see it: whole, or with another tenant's details withheld.
fn job_view(caller: &Caller, job: &Job, cluster: &ClusterState) -> pb::Job {
    let mut view = convert::job_to_proto(job, cluster);
    if !caller.sees_job_details(&job.spec.tenant) {
        convert::redact_job(&mut view);
    }
    view
}

/// A pending job's reason as the leader's last pass found it. On a stale read from a follower
/// (or a former leader) the reasons are not here: they are the leader's soft state.
fn pending_reason(
    r: &Replica,
    stale: bool,
    cluster: &ClusterState,
    job: &Job,
    memo: &mut ShapeMemo,
) -> String {
    if job.state != JobState::Pending {
        return String::new();
    }
    let board = r.current_reasons();
    if board.is_none() && stale {
        return "reason known on the leader (read without --stale)".into();
    }
    reasons::explain(cluster, board.as_deref(), job, r.now_ms(), memo)
}

fn archived_view(caller: &Caller, job: &crate::state::ArchivedJob) -> pb::Job {
    let mut view = convert::archived_job_to_proto(job);
    if !caller.sees_job_details(job.tenant()) {
        convert::redact_job(&mut view);
    }
    view
}

/// The tenant of a job this replica knows (kept whole or archived).
fn job_tenant(cluster: &ClusterState, id: u64) -> Option<&str> {
    cluster
        .job(id)
        .map(|j| j.spec.tenant.as_str())
        .or_else(|| cluster.archived.get(&id).map(|a| a.tenant()))
}

/// Where task `task` of attempt `attempt` (1-based; `None`: the latest) of `job` ran: its
/// node, its allocation (0 where not recorded: the agent then reads the job's latest
/// allocation on that node), and the attempt's number of how many there were.
struct TaskLocation {
    node: String,
    allocation_id: u64,
    attempt: u32,
    attempts: u32,
}

fn locate_task(
    job: &Job,
    cluster: &ClusterState,
    task: usize,
    attempt: Option<u32>,
) -> Result<TaskLocation, Rejection> {
    // Every placement left a "placed on n1,n2" history entry, one node per task.
    let placements: Vec<Vec<&str>> = job
        .history
        .iter()
        .filter_map(|h| h.reason.strip_prefix("placed on "))
        .map(|nodes| nodes.split(',').collect())
        .collect();
    let attempts = placements.len();
    if attempts == 0 {
        return Err(Rejection::precondition(format!(
            "job {} has not run anywhere yet (state {})",
            job.id,
            job.state.as_str()
        )));
    }
    let number = match attempt {
        None => attempts,
        Some(k) if (1..=attempts).contains(&(k as usize)) => k as usize,
        Some(k) => {
            return Err(Rejection::invalid(
                "attempt",
                format!(
                    "job {} has had {attempts} attempt(s): give one from 1 to {attempts} (not {k})",
                    job.id
                ),
            ));
        }
    };
    let nodes = &placements[number - 1];
    let Some(node) = nodes.get(task) else {
        return Err(Rejection::invalid(
            "task",
            format!(
                "attempt {number} of job {} ran {} task(s): give a task from 0 to {}",
                job.id,
                nodes.len(),
                nodes.len() - 1
            ),
        ));
    };
    // The recorded allocations cover the latest placements (`job.attempts` is shorter when
    // the first ones predate it, or were dropped as old).
    let recorded = (number + job.attempts.len())
        .checked_sub(attempts + 1)
        .and_then(|i| job.attempts.get(i));
    let allocation_id = match recorded.and_then(|ids| ids.get(task)) {
        Some(id) => *id,
        // The latest attempt's live allocations are known even unrecorded.
        None if number == attempts => {
            let mut live: Vec<u64> = cluster
                .allocations_of(job.id)
                .map(|r| r.allocation.id)
                .collect();
            live.sort_unstable();
            live.get(task).copied().unwrap_or(0)
        }
        None => {
            return Err(Rejection::precondition(format!(
                "attempt {number} of job {} predates the record of its allocations (kept for the last {} attempts, from cluster version 2 on); its logs are on node {node}",
                job.id,
                crate::state::MAX_RECORDED_ATTEMPTS
            )));
        }
    };
    Ok(TaskLocation {
        node: (*node).to_owned(),
        allocation_id,
        attempt: number as u32,
        attempts: attempts as u32,
    })
}

/// A channel to `node`'s agent, which must hold that node's certificate.
fn agent_channel(
    r: &Replica,
    cluster: &ClusterState,
    node: &str,
) -> Result<tonic::transport::Channel, ApiError> {
    let n = cluster
        .nodes
        .get(node)
        .ok_or_else(|| Rejection::not_found(format!("node {node} is not registered")))?;
    if n.spec.agent_address.is_empty() {
        return Err(
            Rejection::precondition(format!("node {node} registered no agent address")).into(),
        );
    }
    r.transport
        .channel(
            &n.spec.agent_address,
            proto::tls::ExpectedPeer::Node(node.to_owned()),
        )
        .map_err(|e| {
            ApiError::Internal(format!(
                "node {node}'s agent address {:?} is invalid: {e}",
                n.spec.agent_address
            ))
        })
}

/// An agent's refusal or failure, said as the client should hear it.
fn agent_status(node: &str, s: Status) -> ApiError {
    match s.code() {
        tonic::Code::NotFound => Rejection::not_found(s.message().to_owned()).into(),
        tonic::Code::InvalidArgument => {
            Rejection::invalid("request", s.message().to_owned()).into()
        }
        tonic::Code::FailedPrecondition => Rejection::precondition(s.message().to_owned()).into(),
        _ => ApiError::Unavailable(format!(
            "the agent of node {node} did not answer: {}",
            s.message()
        )),
    }
}

/// How long a log read waits for the agent that holds the logs.
const AGENT_LOGS_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads a task's logs from the agent of the node it ran on, from this replica's applied
/// state: `ReadJobLogs` (after its read barrier) and the status page's job view share it.
/// `allowed` is asked about the job's tenant before anything is read; `timeout` bounds the
/// agent's answer.
pub(crate) async fn read_logs(
    r: &Replica,
    req: &pb::ReadJobLogsRequest,
    timeout: Duration,
    allowed: impl FnOnce(&str) -> Result<(), ApiError>,
) -> Result<pb::ReadJobLogsResponse, ApiError> {
    let (place, job_state, channel) = {
        let data = r.sm.read();
        let cluster = &data.cluster;
        let tenant = job_tenant(cluster, req.job_id)
            .ok_or_else(|| Rejection::not_found(cluster.missing_job(req.job_id)))?;
        allowed(tenant)?;
        let job = cluster.job(req.job_id).ok_or_else(|| {
            Rejection::not_found(format!(
                "job {} was archived: its record no longer names the node that ran it",
                req.job_id
            ))
        })?;
        let task = req.task.unwrap_or(0) as usize;
        let place = locate_task(job, cluster, task, req.attempt)?;
        let channel = agent_channel(r, cluster, &place.node)?;
        (place, job.state.as_str(), channel)
    };
    let node = place.node.clone();
    let mut agent = proto::agent::node_agent_client::NodeAgentClient::new(channel);
    let mut call = Request::new(proto::agent::ReadLogsRequest {
        job_id: req.job_id,
        tail_bytes: req.tail_bytes,
        allocation_id: place.allocation_id,
        stdout_from: req.stdout_from,
        stderr_from: req.stderr_from,
    });
    call.set_timeout(timeout);
    let logs = agent
        .read_logs(call)
        .await
        .map_err(|s| agent_status(&node, s))?
        .into_inner();
    Ok(pb::ReadJobLogsResponse {
        stdout: logs.stdout,
        stderr: logs.stderr,
        node,
        allocation_id: logs.allocation_id,
        attempt: place.attempt,
        attempts: place.attempts,
        stdout_size: logs.stdout_size,
        stderr_size: logs.stderr_size,
        job_state: job_state.to_owned(),
    })
}

/// A token's secret part: 24 random bytes in hex.
fn random_hex(bytes: usize) -> Result<String, ApiError> {
    let mut buf = vec![0u8; bytes];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut buf)
        .map_err(|_| ApiError::Internal("the system's random source failed".into()))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn token_to_proto(t: &crate::state::TokenRecord) -> pb::Token {
    pb::Token {
        id: t.id.clone(),
        role: t.role.as_str().to_owned(),
        tenant: t.tenant.clone().unwrap_or_default(),
        description: t.description.clone(),
        created_at_ms: t.created_at,
        created_by: t.created_by.clone(),
        expires_at_ms: t.expires_at.unwrap_or(0),
        revoked_at_ms: t.revoked_at.unwrap_or(0),
        revoked_by: t.revoked_by.clone().unwrap_or_default(),
    }
}

fn audit_to_proto(a: &crate::state::AuditRecord) -> pb::AuditRecord {
    pb::AuditRecord {
        seq: a.seq,
        at_ms: a.at,
        principal: a.actor.principal.clone(),
        role: a.actor.role.clone(),
        tenant: a.actor.tenant.clone().unwrap_or_default(),
        from: a.actor.from.clone(),
        action: a.action.clone(),
        target: a.target.clone(),
        job_id: a.job.unwrap_or(0),
        detail: a.detail.clone(),
    }
}

/// Longest reason a cancel or drain may carry (it is kept in the job's history).
/// The jobs a request naming job `id` acts on: every job of the array when `id` is an
/// array's id (as `scancel` and `scontrol` take it), unless `only_this_job`.
fn job_targets(cluster: &ClusterState, id: u64, only_this_job: bool) -> Vec<u64> {
    match cluster.job(id).and_then(|j| j.array_task) {
        Some(t) if t.array_id == id && !only_this_job => cluster
            .jobs
            .range(id..id.saturating_add(u64::from(t.count)))
            .map(|(id, _)| *id)
            .collect(),
        _ => vec![id],
    }
}

/// `targets` split into those `change` applies to and those it is refused for (with why).
fn split_by_refusal(
    cluster: &ClusterState,
    targets: &[u64],
    change: &JobChange,
) -> (Vec<u64>, Vec<(u64, String)>) {
    let mut ok = Vec::new();
    let mut refused = Vec::new();
    for &id in targets {
        match cluster.change_refusal(id, change) {
            None => ok.push(id),
            Some(r) => refused.push((id, r.message)),
        }
    }
    (ok, refused)
}

/// The change a `ChangeJobRequest` asks for, checked.
fn job_change_from_proto(
    change: Option<pb::change_job_request::Change>,
) -> Result<JobChange, Rejection> {
    use pb::change_job_request::Change;
    Ok(match change {
        None => {
            return Err(Rejection::invalid(
                "change",
                "names no change: hold, release, requeue or update",
            ));
        }
        Some(Change::Hold(_)) => JobChange::Hold,
        Some(Change::Release(_)) => JobChange::Release,
        Some(Change::Requeue(q)) => {
            validate_reason(&q.reason)?;
            JobChange::Requeue { reason: q.reason }
        }
        Some(Change::Update(u)) => {
            let u = convert::job_update_from_proto(u);
            for list in [&u.nodelist, &u.exclude].into_iter().flatten() {
                crate::state::validate::validate_node_lists(list, &[])?;
            }
            if u.is_empty() {
                return Err(Rejection::invalid("update", "changes nothing"));
            }
            JobChange::Update(u)
        }
    })
}

const MAX_REASON_BYTES: usize = 1024;

pub(super) fn validate_reason(reason: &str) -> Result<(), Rejection> {
    if reason.len() > MAX_REASON_BYTES {
        return Err(Rejection::invalid(
            "reason",
            format!(
                "{} is longer than {MAX_REASON_BYTES} bytes",
                crate::state::validate::shown(reason)
            ),
        ));
    }
    Ok(())
}

/// Default and largest number of audit records one call returns.
const DEFAULT_AUDIT_LIMIT: usize = 1_000;
const MAX_AUDIT_LIMIT: usize = 100_000;

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
    #[tracing::instrument(level = "info", skip_all, name = "rpc.PutService")]
    async fn put_service(
        &self,
        request: Request<pb::PutServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        super::services::put_service(&self.replica, request).await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.ScaleService")]
    async fn scale_service(
        &self,
        request: Request<pb::ScaleServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        super::services::scale_service(&self.replica, request).await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.DeleteService")]
    async fn delete_service(
        &self,
        request: Request<pb::DeleteServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        super::services::delete_service(&self.replica, request).await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.ServiceRollout")]
    async fn service_rollout(
        &self,
        request: Request<pb::ServiceRolloutRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        super::services::service_rollout(&self.replica, request).await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.GetService")]
    async fn get_service(
        &self,
        request: Request<pb::GetServiceRequest>,
    ) -> Result<Response<pb::Service>, Status> {
        super::services::get_service(&self.replica, request).await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.ListServices")]
    async fn list_services(
        &self,
        request: Request<pb::ListServicesRequest>,
    ) -> Result<Response<pb::ListServicesResponse>, Status> {
        super::services::list_services(&self.replica, request).await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.SubmitJob")]
    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let r = &self.replica;
        let started = std::time::Instant::now();
        let answer = route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::SubmitJob)?;
                current_leader_state(r).await?;
                let mut spec = convert::job_spec_from_proto(req.spec)?;
                // No tenant given: a user's own, or `default`.
                let tenant_defaulted = spec.tenant.is_empty() && caller.tenant_scope().is_none();
                if spec.tenant.is_empty() {
                    spec.tenant = caller.tenant_scope().unwrap_or("default").to_owned();
                }
                caller.require_tenant(&spec.tenant, "submit jobs on behalf")?;
                validate_job_spec(&spec)?;
                if r.sm.cluster_version() < 2 {
                    // Format 1 has no working directory nor output files; the entry keeps
                    // its shape.
                    spec.workdir = None;
                    spec.stdout_path = None;
                    spec.stderr_path = None;
                }
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
                        if tenant_defaulted {
                            defaulted_tenant_refusal(&data.cluster)?;
                        }
                        data.cluster.check_submission(&spec)?;
                        // A job no node could ever hold is refused with the reason, unless
                        // held (`hold_if_unfit`); checked here only, see `admission_refusal`.
                        if let Some(refusal) =
                            crate::scheduler::capacity::admission_refusal(&data.cluster, &spec)
                        {
                            return Err(refusal.into());
                        }
                    }
                }
                match r
                    .write(Command::submit(spec, key).by(caller.actor()))
                    .await?
                {
                    Outcome::JobSubmitted { id, created } => {
                        let jobs =
                            r.sm.read()
                                .cluster
                                .job(id)
                                .and_then(|j| j.array_task)
                                .map_or(1, |t| t.count);
                        Ok(pb::SubmitJobResponse { id, created, jobs })
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).submit_job(req).await },
        )
        .await;
        // Accepted submissions only: a refusal's latency says nothing about the write path.
        if answer.is_ok() {
            r.metrics.submitted(started.elapsed());
        }
        answer
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
            |caller, req| async move {
                caller.require(Action::CancelJob)?;
                validate_reason(&req.reason)?;
                // On the leader, whose applied state holds every job a client can know of: a
                // refused cancel is answered without adding an entry to the log. A follower
                // may lag, so it leaves the question to the leader.
                current_leader_state(r).await?;
                let array = {
                    let data = r.sm.read_async().await;
                    // A job's tenant never changes, so this check cannot go stale before the
                    // write.
                    if let Some(t) = job_tenant(&data.cluster, req.id) {
                        caller.require_tenant(t, "cancel jobs")?;
                    }
                    let targets = job_targets(&data.cluster, req.id, req.only_this_job);
                    if targets.len() > 1 {
                        let change = JobChange::Cancel {
                            reason: req.reason.clone(),
                        };
                        let (live, _) = split_by_refusal(&data.cluster, &targets, &change);
                        if live.is_empty() {
                            return Err(Rejection::precondition(format!(
                                "every job of array {} has already ended",
                                req.id
                            ))
                            .into());
                        }
                        Some(Command::ChangeJobs { jobs: live, change })
                    } else {
                        if let Some(refusal) = data.cluster.cancel_refusal(req.id) {
                            return Err(refusal.into());
                        }
                        None
                    }
                };
                let command = array
                    .unwrap_or_else(|| Command::cancel(req.id, req.reason))
                    .by(caller.actor());
                match r.write(command).await? {
                    Outcome::JobCancelled { .. } | Outcome::JobsChanged { .. } => {
                        let id = req.id;
                        let data = r.sm.read();
                        let job = data
                            .cluster
                            .job(id)
                            .map(|j| job_view(&caller, j, &data.cluster));
                        Ok(pb::CancelJobResponse { job })
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).cancel_job(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.ChangeJob")]
    async fn change_job(
        &self,
        request: Request<pb::ChangeJobRequest>,
    ) -> Result<Response<pb::ChangeJobResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ChangeJobs)?;
                let change = job_change_from_proto(req.change)?;
                if let JobChange::Update(u) = &change
                    && u.max_running.is_some()
                    && req.only_this_job
                {
                    return Err(Rejection::invalid(
                        "max_running",
                        "the limit of running jobs is the array's: update the array's id",
                    )
                    .into());
                }
                // On the leader, as for a cancel: a refused change adds nothing to the log.
                current_leader_state(r).await?;
                let (jobs, mut refused) = {
                    let data = r.sm.read_async().await;
                    if let Some(t) = job_tenant(&data.cluster, req.id) {
                        caller.require_tenant(t, "change jobs")?;
                    }
                    let mut targets = job_targets(&data.cluster, req.id, req.only_this_job);
                    // Of a whole array, the jobs that already ended are no one's concern
                    // unless they are to be queued again.
                    if targets.len() > 1 && !matches!(change, JobChange::Requeue { .. }) {
                        targets.retain(|id| {
                            data.cluster.job(*id).is_some_and(|j| !j.state.is_final())
                        });
                    }
                    let (jobs, refused) = split_by_refusal(&data.cluster, &targets, &change);
                    if jobs.is_empty() {
                        let first = targets
                            .first()
                            .and_then(|&id| data.cluster.change_refusal(id, &change));
                        return Err(match (targets.len(), first) {
                            (1, Some(refusal)) => refusal.into(),
                            (0, _) => Rejection::precondition(format!(
                                "every job of array {} has already ended",
                                req.id
                            ))
                            .into(),
                            _ => Rejection::precondition(format!(
                                "no job of array {} can be changed: {}",
                                req.id,
                                refused
                                    .first()
                                    .map_or("", |(_, why): &(u64, String)| why.as_str())
                            ))
                            .into(),
                        });
                    }
                    (jobs, refused)
                };
                let command = Command::ChangeJobs { jobs, change }.by(caller.actor());
                match r.write(command).await? {
                    Outcome::JobsChanged {
                        changed,
                        refused: at_apply,
                    } => {
                        refused.extend(at_apply);
                        refused.sort_unstable();
                        Ok(pb::ChangeJobResponse {
                            changed,
                            refused: refused
                                .into_iter()
                                .map(|(id, reason)| pb::JobRefusal { id, reason })
                                .collect(),
                        })
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).change_job(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.GetJob")]
    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        let r = &self.replica;
        let stale = request.get_ref().read.as_ref().is_some_and(|o| o.stale);
        read_route(
            r,
            request,
            Action::ReadJobs,
            |req| req.read,
            |caller, req, cluster| {
                if let Some(j) = cluster.job(req.id) {
                    let mut view = job_view(caller, j, cluster);
                    let mut memo = ShapeMemo::default();
                    view.pending_reason = pending_reason(r, stale, cluster, j, &mut memo);
                    return Ok(view);
                }
                cluster
                    .archived
                    .get(&req.id)
                    .map(|a| archived_view(caller, a))
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
        let r = &self.replica;
        let stale = request.get_ref().read.as_ref().is_some_and(|o| o.stale);
        read_route(
            r,
            request,
            Action::ReadJobs,
            |req| req.read,
            |caller, req, cluster| {
                let states = parse_states(&req.states)?;
                // One diagnosis per shape of the listing, not per job.
                let mut memo = ShapeMemo::default();
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
                    .map(|j| {
                        let mut view = job_view(caller, j, cluster);
                        view.pending_reason = pending_reason(r, stale, cluster, j, &mut memo);
                        view
                    })
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
                    .map(|a| archived_view(caller, a));
                let mut jobs: Vec<pb::Job> = jobs;
                jobs.extend(archived);
                jobs.sort_by_key(|j| j.id);
                Ok(pb::ListJobsResponse { jobs })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_jobs(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.WhyJob")]
    async fn why_job(
        &self,
        request: Request<pb::WhyJobRequest>,
    ) -> Result<Response<pb::WhyJobResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ReadJobs)?;
                // The reasons live on the leader only: a follower forwards the call.
                current_leader_state(r).await?;
                let board = r.current_reasons();
                let data = r.sm.read_async().await;
                let cluster = &data.cluster;
                let Some(job) = cluster.job(req.id) else {
                    return Err(Rejection::not_found(cluster.missing_job(req.id)).into());
                };
                let now = r.now_ms();
                let mut memo = ShapeMemo::default();
                let reason = reasons::explain(cluster, board.as_deref(), job, now, &mut memo);
                let lines = reasons::why_lines(cluster, board.as_deref(), job, now);
                Ok(pb::WhyJobResponse {
                    id: job.id,
                    state: job.state.as_str().to_owned(),
                    reason,
                    lines,
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).why_job(req).await },
        )
        .await
    }

    type WatchJobsStream = JobEventStream;
    type SaveSnapshotStream = super::backup::SnapshotChunkStream;

    #[tracing::instrument(level = "info", skip_all, name = "rpc.SaveSnapshot")]
    async fn save_snapshot(
        &self,
        request: Request<pb::SaveSnapshotRequest>,
    ) -> Result<Response<Self::SaveSnapshotStream>, Status> {
        super::backup::save_snapshot(self.replica.clone(), self.backups.clone(), request).await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.WatchJobs")]
    async fn watch_jobs(
        &self,
        request: Request<pb::WatchJobsRequest>,
    ) -> Result<Response<Self::WatchJobsStream>, Status> {
        let r = &self.replica;
        let caller = authenticate(r, &request)
            .await
            .map_err(|e| error_status(r, e))?;
        caller
            .require(Action::ReadJobs)
            .map_err(|e| error_status(r, e))?;
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
                    job: Some(job_view(&caller, j, &data.cluster)),
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
                            job_view(&caller, &ev.job, &data.cluster)
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
            Action::ReadCluster,
            |req| req.read,
            |_, _, cluster| {
                Ok(pb::ListNodesResponse {
                    nodes: cluster
                        .nodes
                        .values()
                        .map(|n| convert::node_to_proto(n, cluster))
                        .collect(),
                    release: crate::state::format::RELEASE.to_owned(),
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_nodes(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "debug", skip_all, name = "rpc.ClusterStatus")]
    async fn cluster_status(
        &self,
        request: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        let r = &self.replica;
        // Answered even by a removed replica, which says so.
        let caller = authenticate_caller(r, &request)
            .await
            .map_err(|e| error_status(r, e))?;
        caller
            .require(Action::ReadCluster)
            .map_err(|e| error_status(r, e))?;
        Ok(Response::new(membership::status(r)))
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.AddReplica")]
    async fn add_replica(
        &self,
        request: Request<pb::AddReplicaRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        let r = &self.replica;
        // Catching up may take minutes; a forwarded add waits as long as the leader may take.
        let longest = r.membership.longest_add() + Duration::from_secs(30);
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ManageReplicas)?;
                // A replica certificate may only add its own replica (`--join`).
                if let super::auth::Principal::Replica(name) = &caller.principal
                    && *name != format!("replica-{}", req.id)
                {
                    return Err(ApiError::PermissionDenied(format!(
                        "the certificate of {name} may add only itself, not replica {}",
                        req.id
                    )));
                }
                // In a task of its own, so that a caller that gives up leaves no half-done add.
                tokio::spawn(membership::add(r.clone(), caller, req))
                    .await
                    .map_err(|e| ApiError::Internal(format!("the add task failed: {e}")))?
            },
            |ch, mut req| async move {
                req.set_timeout(longest);
                ControlPlaneClient::new(ch).add_replica(req).await
            },
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
            |caller, req| async move {
                caller.require(Action::ManageReplicas)?;
                tokio::spawn(membership::remove(r.clone(), caller, req))
                    .await
                    .map_err(|e| ApiError::Internal(format!("the remove task failed: {e}")))?
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
            |caller, req| async move {
                caller.require(Action::ManageTenants)?;
                let tenant = convert::tenant_from_proto(req);
                crate::state::validate::validate_tenant(&tenant)?;
                let command = Command::PutTenant {
                    tenant: tenant.clone(),
                };
                match r.write(command.by(caller.actor())).await? {
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
            Action::ReadCluster,
            |req| req.read,
            |_, _, cluster| {
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
            |caller, req| async move {
                caller.require(Action::ManagePartitions)?;
                let partition = convert::partition_from_proto(req);
                crate::state::validate::validate_partition(&partition)?;
                let command = Command::PutPartition {
                    partition: partition.clone(),
                };
                match r.write(command.by(caller.actor())).await? {
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
            |caller, req| async move {
                caller.require(Action::ManageNodes)?;
                validate_reason(&req.reason)?;
                let command = Command::SetNodeStatus {
                    node: req.node.clone(),
                    status: NodeStatus::Drained,
                    evict: req.evict,
                    reason: req.reason,
                };
                node_after(r, command.by(caller.actor()), &req.node, None).await
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
            |caller, req| async move {
                caller.require(Action::ManageNodes)?;
                let command = Command::SetNodeStatus {
                    node: req.node.clone(),
                    status: NodeStatus::Ready,
                    evict: false,
                    reason: String::new(),
                };
                node_after(r, command.by(caller.actor()), &req.node, None).await
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
            |caller, req| async move {
                caller.require(Action::ManageNodes)?;
                let gpu = req.gpu.clone();
                let command = Command::SetGpuHealth {
                    node: req.node.clone(),
                    gpu: req.gpu,
                    health: GpuHealth::Healthy,
                };
                node_after(r, command.by(caller.actor()), &req.node, Some(&gpu)).await
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
            Action::ReadCluster,
            |req| req.read,
            |_, _, cluster| {
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

    #[tracing::instrument(level = "info", skip_all, name = "rpc.CreateToken")]
    async fn create_token(
        &self,
        request: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ManageTokens)?;
                current_leader_state(r).await?;
                let role = crate::state::ApiRole::parse(&req.role).ok_or_else(|| {
                    Rejection::invalid(
                        "role",
                        format!("{:?} is not admin, operator or user", req.role),
                    )
                })?;
                let secret = random_hex(24)?;
                let expires_at = (req.ttl_secs > 0)
                    .then(|| r.now_ms().saturating_add(req.ttl_secs.saturating_mul(1000)));
                let token = crate::state::TokenRecord {
                    id: random_hex(8)?,
                    secret_sha256: super::auth::secret_hash(&secret),
                    role,
                    tenant: (!req.tenant.is_empty()).then_some(req.tenant),
                    description: req.description,
                    created_at: 0,
                    created_by: caller.principal_name(),
                    expires_at,
                    revoked_at: None,
                    revoked_by: None,
                };
                crate::state::access::validate_token(&token)?;
                let id = token.id.clone();
                match r
                    .write(Command::CreateToken { token }.by(caller.actor()))
                    .await?
                {
                    Outcome::Done => {
                        let data = r.sm.read();
                        let token = data.cluster.tokens.get(&id).map(token_to_proto);
                        Ok(pb::CreateTokenResponse {
                            token,
                            secret: format!("{}.{id}.{secret}", super::auth::TOKEN_PREFIX),
                        })
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).create_token(req).await },
        )
        .await
    }

    async fn list_tokens(
        &self,
        request: Request<pb::ListTokensRequest>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        read_route(
            &self.replica,
            request,
            Action::ManageTokens,
            |req| req.read,
            |_, _, cluster| {
                Ok(pb::ListTokensResponse {
                    tokens: cluster.tokens.values().map(token_to_proto).collect(),
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_tokens(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.RevokeToken")]
    async fn revoke_token(
        &self,
        request: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::Token>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ManageTokens)?;
                let command = Command::RevokeToken {
                    id: req.id.clone(),
                    by: caller.principal_name(),
                };
                match r.write(command.by(caller.actor())).await? {
                    Outcome::Done => {
                        r.sm.read()
                            .cluster
                            .tokens
                            .get(&req.id)
                            .map(token_to_proto)
                            .ok_or_else(|| ApiError::Internal("a revoked token vanished".into()))
                    }
                    other => Err(unexpected(other)),
                }
            },
            |ch, req| async move { ControlPlaneClient::new(ch).revoke_token(req).await },
        )
        .await
    }

    async fn list_audit(
        &self,
        request: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        read_route(
            &self.replica,
            request,
            Action::ReadAudit,
            |req| req.read,
            |caller, req, cluster| {
                let limit = match req.limit as usize {
                    0 => DEFAULT_AUDIT_LIMIT,
                    n => n.min(MAX_AUDIT_LIMIT),
                };
                let own = caller.tenant_scope();
                let mut records: Vec<pb::AuditRecord> = cluster
                    .audit
                    .values()
                    .rev()
                    .filter(|a| a.at >= req.since_ms)
                    .filter(|a| req.job_id == 0 || a.job == Some(req.job_id))
                    // A user sees what its tenant did and what was done to its jobs.
                    .filter(|a| match own {
                        None => true,
                        Some(t) => {
                            a.actor.tenant.as_deref() == Some(t)
                                || a.job.and_then(|j| job_tenant(cluster, j)) == Some(t)
                        }
                    })
                    .take(limit)
                    .map(audit_to_proto)
                    .collect();
                records.reverse();
                Ok(pb::ListAuditResponse { records })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).list_audit(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.ReadJobLogs")]
    async fn read_job_logs(
        &self,
        request: Request<pb::ReadJobLogsRequest>,
    ) -> Result<Response<pb::ReadJobLogsResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ReadLogs)?;
                read_barrier(r, &None).await?;
                read_logs(r, &req, AGENT_LOGS_TIMEOUT, |tenant| {
                    caller.require_tenant(tenant, "read the logs of jobs")
                })
                .await
            },
            |ch, req| async move { ControlPlaneClient::new(ch).read_job_logs(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.InjectFault")]
    async fn inject_fault(
        &self,
        request: Request<pb::InjectFaultRequest>,
    ) -> Result<Response<pb::InjectFaultResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ManageNodes)?;
                use proto::agent::inject_fault_request::Fault as AgentFault;
                let fault = match req.fault {
                    Some(pb::inject_fault_request::Fault::Xid(x)) => AgentFault::Xid(x),
                    Some(pb::inject_fault_request::Fault::FallOffBus(b)) => {
                        AgentFault::FallOffBus(b)
                    }
                    Some(pb::inject_fault_request::Fault::Recover(b)) => AgentFault::Recover(b),
                    None => {
                        return Err(Rejection::invalid(
                            "fault",
                            "give an xid, fall_off_bus or recover",
                        )
                        .into());
                    }
                };
                let channel = agent_channel(r, &r.sm.read().cluster, &req.node)?;
                let mut agent = proto::agent::node_agent_client::NodeAgentClient::new(channel);
                let mut call = Request::new(proto::agent::InjectFaultRequest {
                    gpu_index: req.gpu_index,
                    fault: Some(fault),
                });
                call.set_timeout(std::time::Duration::from_secs(10));
                let resp = agent
                    .inject_fault(call)
                    .await
                    .map_err(|s| agent_status(&req.node, s))?
                    .into_inner();
                tracing::info!(node = %req.node, gpu = req.gpu_index, by = %caller.principal_name(), "fault injected");
                Ok(pb::InjectFaultResponse {
                    gpu_uuid: resp.gpu_uuid,
                })
            },
            |ch, req| async move { ControlPlaneClient::new(ch).inject_fault(req).await },
        )
        .await
    }

    #[tracing::instrument(level = "info", skip_all, name = "rpc.RestartAgent")]
    async fn restart_agent(
        &self,
        request: Request<pb::RestartAgentRequest>,
    ) -> Result<Response<pb::RestartAgentResponse>, Status> {
        let r = &self.replica;
        route(
            r,
            request,
            |caller, req| async move {
                caller.require(Action::ManageNodes)?;
                let connect = || agent_channel(r, &r.sm.read().cluster, &req.node);
                super::agent_restart::restart_agent(
                    &req.node,
                    connect,
                    &req,
                    caller.principal_name(),
                )
                .await
            },
            |ch, req| async move { ControlPlaneClient::new(ch).restart_agent(req).await },
        )
        .await
    }

    async fn who_am_i(
        &self,
        request: Request<pb::WhoAmIRequest>,
    ) -> Result<Response<pb::WhoAmIResponse>, Status> {
        let r = &self.replica;
        let caller = authenticate(r, &request)
            .await
            .map_err(|e| error_status(r, e))?;
        let actor = caller.actor();
        Ok(Response::new(pb::WhoAmIResponse {
            principal: actor.principal,
            role: actor.role,
            tenant: actor.tenant.unwrap_or_default(),
            from: actor.from,
            security_enforced: r.security.enforced,
        }))
    }
}

/// A job that names no tenant is charged to `default`; once tenants exist and `default` is
/// not one, say how to name one rather than only that `default` is unknown.
fn defaulted_tenant_refusal(cluster: &ClusterState) -> Result<(), Rejection> {
    if cluster.tenants.is_empty() || cluster.tenants.contains_key("default") {
        return Ok(());
    }
    let known: Vec<&str> = cluster.tenants.keys().map(String::as_str).collect();
    Err(Rejection::invalid(
        "tenant",
        format!(
            "the job names no tenant and this cluster has tenants: give one with --tenant NAME \
             (-A; #SBATCH --account in a script; metadata.namespace in a manifest), one of: {}",
            known.join(", ")
        ),
    ))
}

/// Applies a node command and returns the node as it is afterwards. A command naming a node
/// (or GPU) that does not exist is answered without adding an entry to the log, on the leader
/// (a follower may not have applied a new node yet; it forwards).
async fn node_after(
    r: &Replica,
    command: Command,
    node: &str,
    gpu: Option<&str>,
) -> Result<pb::Node, ApiError> {
    current_leader_state(r).await?;
    if let Some(refusal) = r.sm.read_async().await.cluster.node_refusal(node, gpu) {
        return Err(refusal.into());
    }
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
