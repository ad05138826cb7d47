//! The service RPCs of the `ControlPlane` API (create, change, scale, roll out, delete, read).
//! Thin, as every handler: convert, check on the leader's state so a refusal adds nothing to
//! the log, propose, and answer with the service as it is once the entry applied.

use proto::v1 as pb;
use proto::v1::control_plane_client::ControlPlaneClient;
use tonic::{Request, Response, Status};

use super::auth::{Action, Caller};
use super::convert_service::{service_spec_from_proto, service_to_proto};
use super::route::{current_leader_state, route};
use crate::replica::{ApiError, Replica};
use crate::state::{
    ClusterState, Command, Outcome, Rejection, RolloutAction, Service, service_key,
};

/// A service's key from the request's name, its tenant defaulting to the caller's (a user's
/// own, or `default`).
fn key_of(caller: &Caller, name: Option<&pb::ServiceName>) -> Result<(String, String), ApiError> {
    let name = name.ok_or_else(|| Rejection::invalid("service", "is missing"))?;
    if name.name.is_empty() {
        return Err(Rejection::invalid("service.name", "must not be empty").into());
    }
    let tenant = if name.tenant.is_empty() {
        caller.tenant_scope().unwrap_or("default").to_owned()
    } else {
        name.tenant.clone()
    };
    Ok((service_key(&tenant, &name.name), tenant))
}

/// A service as `caller` may see it: another tenant's replica command, environment and image
/// are withheld, as a job's are.
pub fn service_view(
    caller: &Caller,
    s: &Service,
    cluster: &ClusterState,
    autoscaler: String,
) -> pb::Service {
    let mut view = service_to_proto(s, cluster, autoscaler);
    if !caller.sees_job_details(&s.spec.tenant) {
        let templates = view
            .spec
            .iter_mut()
            .filter_map(|s| s.template.as_mut())
            .chain(
                view.revisions
                    .iter_mut()
                    .filter_map(|r| r.template.as_mut()),
            );
        for t in templates {
            t.command.clear();
            t.env.clear();
            t.container = None;
            t.workdir.clear();
        }
    }
    view
}

/// The service `key` as it is now on this replica, for the answer to a write.
fn answer(r: &Replica, caller: &Caller, key: &str) -> Result<pb::Service, ApiError> {
    let data = r.sm.read();
    match data.cluster.services.get(key) {
        Some(s) => Ok(service_view(
            caller,
            s,
            &data.cluster,
            r.services.status(key),
        )),
        // Deleted and already forgotten (it had no replica left to stop).
        None => Ok(pb::Service {
            deleting: true,
            ..Default::default()
        }),
    }
}

/// Writes `command` (refused before it reaches the log if the cluster version lacks it) and
/// answers with the service.
async fn write_service_command(
    r: &Replica,
    caller: &Caller,
    key: &str,
    command: Command,
) -> Result<pb::Service, ApiError> {
    command.check_allowed_at(crate::state::format::ClusterVersion(r.sm.cluster_version()))?;
    match r.write(command.by(caller.actor())).await? {
        Outcome::ServiceChanged { service, .. } => answer(r, caller, &service),
        Outcome::Rejected(rej) => Err(rej.into()),
        other => Err(ApiError::Internal(format!(
            "unexpected outcome of a service command on {key}: {other:?}"
        ))),
    }
}

pub async fn put_service(
    r: &Replica,
    request: Request<pb::PutServiceRequest>,
) -> Result<Response<pb::Service>, Status> {
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(Action::ManageServices)?;
            current_leader_state(r).await?;
            let mut wire = req
                .spec
                .ok_or_else(|| Rejection::invalid("spec", "is missing"))?;
            if wire.tenant.is_empty() {
                wire.tenant = caller.tenant_scope().unwrap_or("default").to_owned();
            }
            let spec = service_spec_from_proto(wire)?;
            caller.require_tenant(&spec.tenant, "manage services")?;
            let key = spec.key();
            {
                let data = r.sm.read_async().await;
                if let Some(refusal) = data.cluster.service_refusal(&spec, req.create_only) {
                    return Err(refusal.into());
                }
                // A replica no node could ever hold is refused, as a job would be (services
                // have no --hold-if-unfit: a service that can never run is a mistake to fix).
                let job = &spec.template.job;
                let shape = crate::scheduler::placement::Shape::of(job);
                if let Some(never) =
                    crate::scheduler::capacity::never_fits(data.cluster.nodes.values(), &shape, 1)
                {
                    return Err(Rejection::invalid(
                        "template",
                        format!(
                            "{}: {}; no replica of this service could ever run: ask for less, or add a node that fits first",
                            never.label(),
                            never.text(&shape, 1)
                        ),
                    )
                    .into());
                }
            }
            let command = Command::PutService {
                spec: Box::new(spec),
                create_only: req.create_only,
            };
            write_service_command(r, &caller, &key, command).await
        },
        |ch, req| async move { ControlPlaneClient::new(ch).put_service(req).await },
    )
    .await
}

pub async fn scale_service(
    r: &Replica,
    request: Request<pb::ScaleServiceRequest>,
) -> Result<Response<pb::Service>, Status> {
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(Action::ManageServices)?;
            let (key, tenant) = key_of(&caller, req.service.as_ref())?;
            caller.require_tenant(&tenant, "manage services")?;
            super::service::validate_reason(&req.reason)?;
            current_leader_state(r).await?;
            if let Some(refusal) =
                r.sm.read_async()
                    .await
                    .cluster
                    .scale_refusal(&key, req.replicas)
            {
                return Err(refusal.into());
            }
            let reason = if req.reason.is_empty() {
                format!("by {}", caller.actor().principal)
            } else {
                req.reason
            };
            let command = Command::ScaleService {
                service: key.clone(),
                replicas: req.replicas,
                reason,
            };
            write_service_command(r, &caller, &key, command).await
        },
        |ch, req| async move { ControlPlaneClient::new(ch).scale_service(req).await },
    )
    .await
}

pub async fn delete_service(
    r: &Replica,
    request: Request<pb::DeleteServiceRequest>,
) -> Result<Response<pb::Service>, Status> {
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(Action::ManageServices)?;
            let (key, tenant) = key_of(&caller, req.service.as_ref())?;
            caller.require_tenant(&tenant, "manage services")?;
            current_leader_state(r).await?;
            if let Err(refusal) = r.sm.read_async().await.cluster.service_or_refusal(&key) {
                return Err(refusal.into());
            }
            let command = Command::DeleteService {
                service: key.clone(),
            };
            write_service_command(r, &caller, &key, command).await
        },
        |ch, req| async move { ControlPlaneClient::new(ch).delete_service(req).await },
    )
    .await
}

pub async fn service_rollout(
    r: &Replica,
    request: Request<pb::ServiceRolloutRequest>,
) -> Result<Response<pb::Service>, Status> {
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(Action::ManageServices)?;
            let (key, tenant) = key_of(&caller, req.service.as_ref())?;
            caller.require_tenant(&tenant, "manage services")?;
            super::service::validate_reason(&req.reason)?;
            use pb::service_rollout_request::Action as A;
            let action = match A::try_from(req.action) {
                Ok(A::Pause) => RolloutAction::Pause { reason: req.reason },
                Ok(A::Resume) => RolloutAction::Resume,
                Ok(A::Undo) => RolloutAction::Undo {
                    to_revision: (req.to_revision > 0).then_some(req.to_revision),
                },
                _ => {
                    return Err(Rejection::invalid(
                        "action",
                        format!(
                            "unknown rollout action {}: pause, resume or undo",
                            req.action
                        ),
                    )
                    .into());
                }
            };
            current_leader_state(r).await?;
            if let Some(refusal) =
                r.sm.read_async()
                    .await
                    .cluster
                    .rollout_refusal(&key, &action)
            {
                return Err(refusal.into());
            }
            let command = Command::ServiceRollout {
                service: key.clone(),
                action,
            };
            write_service_command(r, &caller, &key, command).await
        },
        |ch, req| async move { ControlPlaneClient::new(ch).service_rollout(req).await },
    )
    .await
}

pub async fn get_service(
    r: &Replica,
    request: Request<pb::GetServiceRequest>,
) -> Result<Response<pb::Service>, Status> {
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(Action::ReadJobs)?;
            let (key, tenant) = key_of(&caller, req.service.as_ref())?;
            caller.require_tenant(&tenant, "read services")?;
            super::service::read_barrier(r, &req.read).await?;
            let data = r.sm.read();
            let s = data.cluster.services.get(&key).ok_or_else(|| {
                Rejection::not_found(format!(
                    "service {} does not exist",
                    crate::state::validate::shown(&key)
                ))
            })?;
            Ok(service_view(
                &caller,
                s,
                &data.cluster,
                r.services.status(&key),
            ))
        },
        |ch, req| async move { ControlPlaneClient::new(ch).get_service(req).await },
    )
    .await
}

pub async fn list_services(
    r: &Replica,
    request: Request<pb::ListServicesRequest>,
) -> Result<Response<pb::ListServicesResponse>, Status> {
    route(
        r,
        request,
        |caller, req| async move {
            caller.require(Action::ReadJobs)?;
            super::service::read_barrier(r, &req.read).await?;
            let data = r.sm.read();
            let services = data
                .cluster
                .services
                .iter()
                .filter(|(_, s)| req.tenant.is_empty() || s.spec.tenant == req.tenant)
                // A user sees its own tenant's services; admins and operators every one.
                .filter(|(_, s)| caller.tenant_scope().is_none_or(|t| t == s.spec.tenant))
                .map(|(key, s)| service_view(&caller, s, &data.cluster, r.services.status(key)))
                .collect();
            Ok(pb::ListServicesResponse { services })
        },
        |ch, req| async move { ControlPlaneClient::new(ch).list_services(req).await },
    )
    .await
}
