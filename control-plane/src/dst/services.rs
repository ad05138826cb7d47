//! A seed's long-running service, beside the batch workload: one client creates it, then
//! scales it, rolls out new revisions, undoes one and sometimes deletes it, through the real
//! `ControlPlane` service with retries across leader changes, while faults happen. The
//! simulated hosts run its replicas until told to stop (some crash now and then and are
//! restarted in place).
//!
//! Its invariants (checked by `check::Observer` on the hosts and `check::check_state` on every
//! replica's applied state):
//! - never two running copies of one ordinal;
//! - never more running copies than `replicas + max_surge` (counted with every value the
//!   service's `replicas` may have had while the copy was placed);
//! - once faults stop, the desired count is restored within the liveness budget: exactly
//!   `replicas` copies of the current revision, all ready and running on the hosts (or, when
//!   the client deleted it, no copy at all).
//!
//! Its replicas run on the A100 hosts but the first (`service_hosts`), and the batch jobs that
//! name hosts (`--nodelist`, `--exclude`) name only the others: a service holds its GPUs for
//! ever, and a batch job bound to a host it fills would never run, nor the seed settle.

use std::sync::Arc;
use std::time::Duration;

use proto::v1 as pb;
use proto::v1::control_plane_server::ControlPlane;
use tonic::{Code, Status};

use super::cluster::sim_request_as;
use super::net::Endpoint;
use super::world::World;
use crate::api::convert_service::service_spec_to_proto;
use crate::raft::NodeId;
use crate::scheduler::score::SplitMix64;
use crate::state::{
    ClusterState, JobState, ReplicaTemplate, RestartPolicy, RolloutPhase, RolloutStrategy,
    ServiceSpec, service_key,
};

/// The simulated service's tenant (the one without a GPU limit) and name.
pub const TENANT: &str = "t1";
pub const NAME: &str = "svc";

/// The preset of the hosts a service's replicas may use.
const SERVICE_HOSTS: &str = "a100-pcie-4gpu-nvlink-pairs";

/// One change the service's client makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Scale(u32),
    /// A new revision: the template's environment carries `VERSION=n`.
    Update(u32),
    /// Back to revision 1 (a rollout undo).
    UndoToFirst,
    Delete,
}

#[derive(Debug, Clone)]
pub struct ServicePlan {
    pub spec: ServiceSpec,
    pub create_at_ms: u64,
    pub changes: Vec<(u64, Change)>,
}

impl ServicePlan {
    /// The service's `replicas` once every change applied; `None` once deleted.
    pub fn final_replicas(&self) -> Option<u32> {
        let mut replicas = Some(self.spec.replicas);
        for (_, c) in &self.changes {
            match c {
                Change::Scale(n) => replicas = replicas.map(|_| *n),
                Change::Delete => replicas = None,
                Change::Update(_) | Change::UndoToFirst => {}
            }
        }
        replicas
    }
}

/// The hosts (by index) the service's replicas may run on: every A100 host but the first.
pub fn service_hosts(hosts: &[&str]) -> Vec<usize> {
    hosts
        .iter()
        .enumerate()
        .filter(|(_, p)| **p == SERVICE_HOSTS)
        .map(|(i, _)| i)
        .skip(1)
        .collect()
}

/// The seed's service, or none when no host may hold its replicas. Drawn from `rng`, a stream
/// of its own.
pub fn plan(rng: &mut SplitMix64, hosts: &[&str], window_ms: u64) -> Option<ServicePlan> {
    let nodelist: Vec<String> = service_hosts(hosts)
        .into_iter()
        .map(|i| format!("host-{i}"))
        .collect();
    if nodelist.is_empty() {
        return None;
    }
    let (gpus, milli, memory) = match rng.below(3) {
        0 => (1, 0, 0),
        1 => (1, 500, 10 * 1024),
        _ => (1, 250, 5 * 1024),
    };
    let mut job = crate::synthetic::job_spec(0, 1, (gpus, 1, milli), "normal", 0);
    job.tenant = TENANT.into();
    job.name = NAME.into();
    job.command = vec!["serve".into()];
    job.time_limit_secs = None;
    job.gpu_memory_mib = memory;
    job.nodelist = nodelist;
    job.env.insert("VERSION".into(), "0".into());
    let strategy = match rng.below(3) {
        0 => (1, 0),
        1 => (0, 1),
        _ => (2, 1),
    };
    let spec = ServiceSpec {
        tenant: TENANT.into(),
        name: NAME.into(),
        template: ReplicaTemplate {
            job,
            readiness: None,
            liveness: None,
        },
        replicas: 2 + rng.below(2) as u32,
        strategy: RolloutStrategy {
            max_surge: strategy.0,
            max_unavailable: strategy.1,
            // A rollout is never paused for slowness here: faults may stall one for a while,
            // and a paused rollout would wait for a person.
            progress_deadline_ms: 24 * 3600 * 1000,
        },
        restart: RestartPolicy {
            backoff_initial_ms: 200,
            backoff_max_ms: 2_000,
            crash_loop_after: 4,
            reset_after_ms: 5_000,
        },
        autoscale: None,
    };
    let create_at_ms = 500 + rng.below(2_000);
    let mut changes = Vec::new();
    let mut at = create_at_ms;
    let mut version = 0;
    // An undo goes back to revision 1 only while another is current (the server refuses an
    // undo to the current revision).
    let mut off_first = false;
    for _ in 0..2 + rng.below(3) {
        at += 1_000 + rng.below(window_ms / 4 + 1);
        let change = match rng.below(10) {
            0..=3 => Change::Scale(1 + rng.below(4) as u32),
            4..=7 => {
                version += 1;
                off_first = true;
                Change::Update(version)
            }
            _ if off_first => {
                off_first = false;
                Change::UndoToFirst
            }
            _ => Change::Scale(1 + rng.below(4) as u32),
        };
        changes.push((at, change));
    }
    if rng.below(5) == 0 {
        changes.push((at + 1_000 + rng.below(3_000), Change::Delete));
    }
    Some(ServicePlan {
        spec,
        create_at_ms,
        changes,
    })
}

/// Whether some running replica's state has every host of `names` registered.
fn hosts_registered(world: &World, names: &[String]) -> bool {
    world.cluster.all_running().iter().any(|r| {
        let data = r.replica.sm.read();
        names.iter().all(|n| data.cluster.nodes.contains_key(n))
    })
}

/// The most copies the service may run while its `replicas` is `replicas`.
fn bound(spec: &ServiceSpec, replicas: u32) -> u32 {
    replicas + spec.strategy.max_surge
}

/// Creates the service and makes its changes, each retried until a replica answers it.
pub async fn run_client(world: Arc<World>, plan: ServicePlan, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    // The client after the batch workload's ones.
    let me = Endpoint::Client(world.params.clients);
    let mut target: NodeId = world.cluster.ids()[0];
    let key = service_key(TENANT, NAME);
    let mut spec = plan.spec.clone();
    let started = world.now_ms();
    world
        .observer()
        .service_bound_changed(&key, started, bound(&spec, spec.replicas));
    // A service naming hosts is refused until they have registered: wait for them, as an
    // operator creates a service on a running cluster.
    while !world.stopped() && !hosts_registered(&world, &spec.template.job.nodelist) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let create = ServiceRequest::Put(Box::new(spec.clone()));
    if !send(&world, me, &mut target, &mut rng, create, plan.create_at_ms).await {
        return;
    }
    for (at, change) in &plan.changes {
        let request = match change {
            Change::Scale(n) => {
                spec.replicas = *n;
                ServiceRequest::Scale(*n)
            }
            Change::Update(v) => {
                spec.template
                    .job
                    .env
                    .insert("VERSION".into(), v.to_string());
                ServiceRequest::Put(Box::new(spec.clone()))
            }
            Change::UndoToFirst => {
                spec.template = plan.spec.template.clone();
                ServiceRequest::UndoTo(1)
            }
            Change::Delete => ServiceRequest::Delete,
        };
        let sent = world.now_ms().max(*at);
        if let Change::Scale(n) = change {
            world
                .observer()
                .service_bound_changed(&key, sent, bound(&spec, *n));
        }
        if !send(&world, me, &mut target, &mut rng, request, *at).await {
            return;
        }
        let acked = world.now_ms();
        world.observer().service_change_acked(&key, acked);
    }
    world
        .observer()
        .record(world.now_ms(), ("service client done",));
    world.observer().service_client_done = true;
}

#[derive(Clone)]
enum ServiceRequest {
    Put(Box<ServiceSpec>),
    Scale(u32),
    UndoTo(u64),
    Delete,
}

impl std::fmt::Debug for ServiceRequest {
    /// Short, for the history: a put by its replicas and version.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceRequest::Put(spec) => write!(
                f,
                "Put(replicas {}, VERSION={})",
                spec.replicas,
                spec.template
                    .job
                    .env
                    .get("VERSION")
                    .map_or("-", |v| v.as_str())
            ),
            ServiceRequest::Scale(n) => write!(f, "Scale({n})"),
            ServiceRequest::UndoTo(r) => write!(f, "UndoTo({r})"),
            ServiceRequest::Delete => write!(f, "Delete"),
        }
    }
}

/// Sends `request` at `at_ms` until it is answered; false if the run stopped first. A refusal
/// of the request itself is a violation: every request the client makes is valid.
async fn send(
    world: &World,
    me: Endpoint,
    target: &mut NodeId,
    rng: &mut SplitMix64,
    request: ServiceRequest,
    at_ms: u64,
) -> bool {
    let wait = at_ms.saturating_sub(world.now_ms());
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let timeout = Duration::from_millis(world.params.call_timeout_ms);
    let identity = super::workload::user_identity(TENANT);
    let name = || {
        Some(pb::ServiceName {
            tenant: TENANT.into(),
            name: NAME.into(),
        })
    };
    while !world.stopped() {
        let sent = request.clone();
        let identity = identity.clone();
        let result: Result<pb::Service, Status> = world
            .cluster
            .call(me, *target, timeout, |r| async move {
                let api = &r.client_api;
                match sent {
                    ServiceRequest::Put(spec) => {
                        let m = pb::PutServiceRequest {
                            spec: Some(service_spec_to_proto(&spec)),
                            create_only: false,
                        };
                        api.put_service(sim_request_as(&identity, m)).await
                    }
                    ServiceRequest::Scale(replicas) => {
                        let m = pb::ScaleServiceRequest {
                            service: name(),
                            replicas,
                            reason: "scaled by the simulated client".into(),
                        };
                        api.scale_service(sim_request_as(&identity, m)).await
                    }
                    ServiceRequest::UndoTo(revision) => {
                        let m = pb::ServiceRolloutRequest {
                            service: name(),
                            action: pb::service_rollout_request::Action::Undo as i32,
                            to_revision: revision,
                            reason: "undone by the simulated client".into(),
                        };
                        api.service_rollout(sim_request_as(&identity, m)).await
                    }
                    ServiceRequest::Delete => {
                        let m = pb::DeleteServiceRequest { service: name() };
                        api.delete_service(sim_request_as(&identity, m)).await
                    }
                }
            })
            .await;
        match result {
            Ok(_) => {
                let at = world.now_ms();
                world
                    .observer()
                    .record(at, ("service request answered", format!("{request:?}")));
                return true;
            }
            // An undo or delete sent again after its answer was lost: it applied the first
            // time (the deleted service may be forgotten already).
            Err(status)
                if matches!(request, ServiceRequest::UndoTo(_))
                    && status.code() == Code::FailedPrecondition
                    && status.message().contains("is already service")
                    || matches!(request, ServiceRequest::Delete)
                        && status.code() == Code::NotFound =>
            {
                return true;
            }
            Err(status) if matches!(status.code(), Code::InvalidArgument | Code::NotFound) => {
                let at = world.now_ms();
                world.observer().violation(
                    "service requests are answered",
                    at,
                    format!("{request:?} was refused: {}", status.message()),
                );
                return false;
            }
            // Not the leader, unreachable, or the cluster's format does not have services yet
            // (FailedPrecondition, while the new format is being raised): try again.
            Err(status) => {
                *target = super::workload::next_target(world, *target, &status);
                tokio::time::sleep(Duration::from_millis(50 + rng.below(200))).await;
            }
        }
    }
    false
}

/// Whether the services in `state` are where their client left them: the reason they are not.
/// `running` counts the copies the hosts run, by ordinal.
pub fn settled(
    state: &ClusterState,
    plan: &ServicePlan,
    client_done: bool,
    running: &[u32],
) -> Result<(), String> {
    if !client_done {
        return Err("the service's client has changes left to make".into());
    }
    let key = service_key(TENANT, NAME);
    let Some(want) = plan.final_replicas() else {
        if let Some(s) = state.services.get(&key) {
            return Err(format!(
                "service {key} was deleted but {} cop(ies) are still stopping",
                s.replicas.len()
            ));
        }
        if !running.is_empty() {
            return Err(format!(
                "service {key} was deleted but the hosts still run ordinals {running:?}"
            ));
        }
        return Ok(());
    };
    let Some(s) = state.services.get(&key) else {
        return Err(format!("service {key} is missing"));
    };
    if s.spec.replicas != want {
        return Err(format!(
            "service {key} wants {} replicas, its client last asked for {want}",
            s.spec.replicas
        ));
    }
    if s.rollout != RolloutPhase::Complete {
        return Err(format!("service {key}'s rollout is {:?}", s.rollout));
    }
    let mut ready = 0;
    for (ordinal, id) in &s.replicas {
        let job = state.jobs.get(id);
        let ok = job.is_some_and(|j| {
            j.state == JobState::Running
                && j.replica
                    .as_ref()
                    .is_some_and(|r| r.ready && r.revision == s.revision)
        });
        if !ok {
            return Err(format!(
                "replica {ordinal} (job {id}) of {key} is not a ready copy of revision {}: {:?}",
                s.revision,
                job.map(|j| (j.state, &j.replica))
            ));
        }
        ready += 1;
    }
    if ready != want as usize {
        return Err(format!(
            "service {key} has {ready} ready replicas, wants {want}"
        ));
    }
    if running.len() != want as usize {
        return Err(format!(
            "service {key} wants {want} replicas and the hosts run ordinals {running:?}"
        ));
    }
    Ok(())
}
