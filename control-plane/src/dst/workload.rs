//! The seed's workload: tenants (two with GPU limits), a mix of job shapes (whole GPUs, gangs,
//! shares, MIG slices, preemptible low-priority and high-priority work), and clients that
//! submit through the real `ControlPlane` service with idempotency keys, retrying on another
//! replica after a timeout or refusal (as `gpuctl` does across leader changes). Some requests
//! are sent twice on purpose; some jobs are cancelled. Slurm's rules are on too: some
//! submissions are small arrays with a limit of one or two running, some are held and
//! released later, some begin later, some want their node to themselves or name or exclude a
//! host, and some running jobs are requeued.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::v1 as pb;
use proto::v1::control_plane_server::ControlPlane;
use tonic::{Code, Status};

use super::cluster::{EPOCH_MS, leader_hint, sim_request_as};
use super::net::Endpoint;
use super::world::World;
use crate::api::convert::job_spec_to_proto;
use crate::raft::NodeId;
use crate::scheduler::score::SplitMix64;
use crate::state::{ArrayRange, ArraySpec, JobId, JobSpec, Tenant};
use crate::synthetic::job_spec;

/// The tenants every seed uses: `t0` and `t2` have limits (invariant 5), `t1` has none.
pub fn tenants() -> Vec<Tenant> {
    vec![
        Tenant {
            name: "t0".into(),
            weight: 1,
            quota_gpus: 4,
            max_gpus: 6,
        },
        Tenant {
            name: "t1".into(),
            weight: 2,
            quota_gpus: 8,
            max_gpus: 0,
        },
        Tenant {
            name: "t2".into(),
            weight: 1,
            quota_gpus: 2,
            max_gpus: 3,
        },
    ]
}

/// One submission a client will make.
#[derive(Debug, Clone)]
pub struct Submission {
    pub key: String,
    pub spec: JobSpec,
    pub at_ms: u64,
    /// Send the request again after it was acknowledged (a client that lost the answer).
    pub duplicate: bool,
    /// Cancel the job this long after it was acknowledged.
    pub cancel_after_ms: Option<u64>,
    /// Submitted held: release it this long after it was acknowledged.
    pub release_after_ms: Option<u64>,
    /// Requeue it (`gpuctl requeue`) this long after it was acknowledged.
    pub requeue_after_ms: Option<u64>,
}

pub fn submissions(
    rng: &mut SplitMix64,
    jobs: usize,
    window_ms: u64,
    rule_hosts: &[usize],
) -> Vec<Submission> {
    let mut out = Vec::with_capacity(jobs);
    // Slurm's rules come from a stream of their own, so the job mix above is each seed's as
    // it was before they existed.
    let mut rules = SplitMix64::new(rng.clone().next_u64() ^ 0x5EED_5107);
    for i in 0..jobs {
        let mut tenant = rng.below(3);
        let (shape, mig) = match rng.below(100) {
            0..=29 => ((1, 1, 0), None),
            30..=44 => ((2, 1, 0), None),
            45..=54 => ((4, 1, 0), None),
            55..=59 => ((8, 1, 0), None),
            60..=67 => ((2, 2, 0), None),
            68..=73 => ((1, 1, 250), None),
            74..=79 => ((1, 1, 500), None),
            80..=86 => ((1, 1, 0), Some("1g.10gb")),
            87..=89 => ((1, 1, 0), Some("3g.40gb")),
            _ => ((1, 1, 0), None),
        };
        let priority = match rng.below(10) {
            0..=1 => "low",
            2 => "high",
            _ => "normal",
        };
        // A job larger than its tenant's limit could never start (submission does not refuse
        // it); such a job goes to the tenant without a limit so that liveness can be checked.
        let (gpus, tasks, _) = shape;
        let limit = tenants()[tenant as usize].max_gpus;
        if limit > 0 && gpus * tasks > limit {
            tenant = 1;
        }
        let mut spec = job_spec(i, tenant, shape, priority, 3600);
        spec.preemptible = priority == "low" || rng.below(10) == 0;
        if let Some(profile) = mig {
            spec.mig_profile = Some(profile.into());
            spec.cpu_milli_per_task = 1000;
            spec.memory_mib_per_task = 8192;
        }
        let at_ms = 1_000 + rng.below(window_ms.max(1));
        let duplicate = rng.below(10) == 0;
        let cancel_after_ms = (rng.below(100) < 8).then(|| rng.below(10_000));
        // Hosts a job names (`--nodelist`, `--exclude`) are never the service's: a job bound to a
        // host whose GPUs a service holds for ever would never run.
        let host = |r: &mut SplitMix64| {
            let i = r.below(rule_hosts.len().max(1) as u64) as usize;
            format!("host-{}", rule_hosts.get(i).copied().unwrap_or(0))
        };
        let mut release_after_ms = None;
        let mut requeue_after_ms = None;
        match rules.below(100) {
            0..=5 => {
                let last = 1 + rules.below(2) as u32;
                spec.array = Some(ArraySpec {
                    ranges: vec![ArrayRange {
                        first: 0,
                        last,
                        step: 1,
                    }],
                    max_running: 1 + rules.below(2) as u32,
                });
            }
            6..=10 => {
                spec.hold = true;
                release_after_ms = Some(500 + rules.below(5_000));
            }
            11..=14 => spec.begin_at = Some(EPOCH_MS + at_ms + 2_000 + rules.below(4_000)),
            15..=18 => spec.exclusive = true,
            19..=21 => spec.exclude = vec![host(&mut rules)],
            22..=24 => spec.nodelist = vec![host(&mut rules)],
            25..=28 => requeue_after_ms = Some(500 + rules.below(6_000)),
            _ => {}
        }
        out.push(Submission {
            key: format!("key-{i}"),
            spec,
            at_ms,
            duplicate,
            cancel_after_ms,
            release_after_ms,
            requeue_after_ms,
        });
    }
    out.sort_by_key(|s| s.at_ms);
    out
}

/// What clients were told, for the end-of-run checks.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Idempotency key → every id an acknowledgement returned for it.
    pub acked: BTreeMap<String, Vec<JobId>>,
    /// Keys whose submission was refused for good, with the reason.
    pub refused: BTreeMap<String, String>,
    /// Jobs whose cancel was acknowledged.
    pub cancelled: Vec<JobId>,
    pub retries: u64,
}

pub async fn run_client(
    world: Arc<World>,
    client: usize,
    plan: Vec<Submission>,
    ledger: Arc<Mutex<Ledger>>,
    seed: u64,
) {
    let mut rng = SplitMix64::new(seed);
    let ids = world.cluster.ids();
    let mut target = ids[client % ids.len()];
    let me = Endpoint::Client(client);
    for s in plan {
        let wait = s.at_ms.saturating_sub(world.now_ms());
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let rounds = if s.duplicate { 2 } else { 1 };
        let mut id = None;
        for _ in 0..rounds {
            match submit(&world, me, &mut target, &s, &mut rng, &ledger).await {
                Some(Ok(got)) => {
                    id = Some(got);
                    ledger
                        .lock()
                        .expect("ledger lock poisoned")
                        .acked
                        .entry(s.key.clone())
                        .or_default()
                        .push(got);
                    let at = world.now_ms();
                    world.observer().record(at, ("acked", &s.key, got));
                }
                Some(Err(reason)) => {
                    ledger
                        .lock()
                        .expect("ledger lock poisoned")
                        .refused
                        .insert(s.key.clone(), reason);
                    break;
                }
                None => return,
            }
        }
        if let Some(id) = id {
            world.observer().note_rules(id, &s.spec);
        }
        if let (Some(id), Some(after)) = (id, s.cancel_after_ms) {
            let world = world.clone();
            let ledger = ledger.clone();
            let start = target;
            let tenant = s.spec.tenant.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after)).await;
                cancel(&world, me, start, id, &tenant, &ledger).await;
            });
        }
        for (after, change) in [
            (
                s.release_after_ms,
                pb::change_job_request::Change::Release(pb::ReleaseJob {}),
            ),
            (
                s.requeue_after_ms,
                pb::change_job_request::Change::Requeue(pb::RequeueJob {
                    reason: "requeued by the simulated client".into(),
                }),
            ),
        ] {
            let (Some(id), Some(after)) = (id, after) else {
                continue;
            };
            let world = world.clone();
            let start = target;
            let tenant = s.spec.tenant.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after)).await;
                change_job(&world, me, start, id, &tenant, change).await;
            });
        }
    }
}

pub(super) fn next_target(world: &World, target: NodeId, status: &Status) -> NodeId {
    let ids = world.cluster.ids();
    match leader_hint(status) {
        Some(l) if l != target => l,
        _ => {
            let pos = ids.iter().position(|i| *i == target).unwrap_or(0);
            ids[(pos + 1) % ids.len()]
        }
    }
}

/// Submits until the answer is final: `Ok(id)`, `Err(reason)` for a refusal, `None` when the
/// run stopped first.
async fn submit(
    world: &World,
    me: Endpoint,
    target: &mut NodeId,
    s: &Submission,
    rng: &mut SplitMix64,
    ledger: &Mutex<Ledger>,
) -> Option<Result<JobId, String>> {
    let timeout = Duration::from_millis(world.params.call_timeout_ms);
    while !world.stopped() {
        let request = pb::SubmitJobRequest {
            spec: Some(job_spec_to_proto(&s.spec)),
            idempotency_key: s.key.clone(),
        };
        let identity = user_identity(&s.spec.tenant);
        let result = world
            .cluster
            .call(me, *target, timeout, |r| async move {
                r.client_api
                    .submit_job(sim_request_as(&identity, request))
                    .await
            })
            .await;
        match result {
            Ok(resp) => return Some(Ok(resp.id)),
            Err(status)
                if matches!(
                    status.code(),
                    Code::InvalidArgument | Code::FailedPrecondition | Code::NotFound
                ) =>
            {
                return Some(Err(status.message().to_owned()));
            }
            Err(status) => {
                ledger.lock().expect("ledger lock poisoned").retries += 1;
                *target = next_target(world, *target, &status);
                tokio::time::sleep(Duration::from_millis(20 + rng.below(200))).await;
            }
        }
    }
    None
}

/// A simulated client acts as a user of its submission's tenant (a client certificate with
/// role user), so the tenant checks of submit and cancel run on every seed.
pub(super) fn user_identity(tenant: &str) -> std::sync::Arc<proto::tls::PeerIdentity> {
    std::sync::Arc::new(proto::tls::PeerIdentity {
        role: proto::tls::CertRole::Client,
        name: format!("user-of-{tenant}"),
        client_role: Some("user".into()),
        tenant: Some(tenant.to_owned()),
        serial: "52".into(),
        not_after_ms: u64::MAX,
    })
}

/// Calls a replica with `rpc` (given the replica to try), moving to the leader it names or
/// the next replica after a timeout or refusal to serve, until the call answers: `Ok`, or a
/// refusal of the request itself (`FailedPrecondition`, `NotFound`, `InvalidArgument`: already
/// ended, unknown, not applicable). `None` when the run stopped first.
async fn until_answered<T, F, Fut>(
    world: &World,
    mut target: NodeId,
    rpc: F,
) -> Option<Result<T, Status>>
where
    F: Fn(NodeId) -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    while !world.stopped() {
        match rpc(target).await {
            Ok(answer) => return Some(Ok(answer)),
            Err(status)
                if matches!(
                    status.code(),
                    Code::FailedPrecondition | Code::NotFound | Code::InvalidArgument
                ) =>
            {
                return Some(Err(status));
            }
            Err(status) => {
                target = next_target(world, target, &status);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    None
}

/// Holds, releases or requeues a job (every job of an array, by its id); a refusal (already
/// released, not running yet, ended) is an answer.
async fn change_job(
    world: &World,
    me: Endpoint,
    target: NodeId,
    id: JobId,
    tenant: &str,
    change: pb::change_job_request::Change,
) {
    let timeout = Duration::from_millis(world.params.call_timeout_ms);
    let identity = user_identity(tenant);
    let answer = until_answered(world, target, |target| {
        let request = pb::ChangeJobRequest {
            id,
            only_this_job: false,
            change: Some(change.clone()),
        };
        let identity = identity.clone();
        world.cluster.call(me, target, timeout, |r| async move {
            r.client_api
                .change_job(sim_request_as(&identity, request))
                .await
        })
    })
    .await;
    if let Some(Ok(resp)) = answer {
        let at = world.now_ms();
        world
            .observer()
            .record(at, ("changed", id, format!("{change:?}"), resp.changed));
    }
}

/// Cancels a job; one that already ended, or is unknown, has nothing to cancel.
async fn cancel(
    world: &World,
    me: Endpoint,
    target: NodeId,
    id: JobId,
    tenant: &str,
    ledger: &Mutex<Ledger>,
) {
    let timeout = Duration::from_millis(world.params.call_timeout_ms);
    let identity = user_identity(tenant);
    let answer = until_answered(world, target, |target| {
        let request = pb::CancelJobRequest {
            id,
            reason: "cancelled by the simulated client".into(),
            ..Default::default()
        };
        let identity = identity.clone();
        world.cluster.call(me, target, timeout, |r| async move {
            r.client_api
                .cancel_job(sim_request_as(&identity, request))
                .await
        })
    })
    .await;
    if let Some(Ok(_)) = answer {
        ledger
            .lock()
            .expect("ledger lock poisoned")
            .cancelled
            .push(id);
        let at = world.now_ms();
        world.observer().record(at, ("cancelled", id));
    }
}
