//! The client workload: concurrent clients submitting a mix of jobs (shapes, priorities,
//! tenants) with idempotency keys, retrying on failure with the same key, re-sending some
//! acknowledged submissions (which must return the same job), and cancelling some jobs.
//! Every attempt is one operation in the history, with its invocation and completion times.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use control_plane::client::{Client, retryable, with_timeout};
use proto::v1 as pb;

use crate::history::{Event, OpKind, Outcome, Recorder, TenantLimit, now_ms};

/// Tenants the workload submits as; `team-a` and `team-b` have hard limits the checker
/// verifies (invariant 5).
pub fn tenants() -> Vec<pb::Tenant> {
    vec![
        pb::Tenant {
            name: "team-a".into(),
            weight: 1,
            quota_gpus: 2,
            max_gpus: 4,
        },
        pb::Tenant {
            name: "team-b".into(),
            weight: 2,
            quota_gpus: 4,
            max_gpus: 8,
        },
        pb::Tenant {
            name: "team-c".into(),
            weight: 1,
            quota_gpus: 0,
            max_gpus: 0,
        },
    ]
}

pub fn tenant_limits() -> Vec<TenantLimit> {
    tenants()
        .into_iter()
        .map(|t| TenantLimit {
            name: t.name,
            max_gpus: t.max_gpus,
        })
        .collect()
}

/// A small deterministic generator (xorshift64*): the same seed gives the same workload and
/// fault schedule, without a dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub jobs: usize,
    pub clients: usize,
    /// Submissions are spread evenly over this time.
    pub duration: Duration,
    /// One acknowledged job in this many is cancelled.
    pub cancel_every: u64,
    /// One acknowledged submission in this many is sent again with its key.
    pub resend_every: u64,
    pub seed: u64,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct WorkloadStats {
    pub submitted: u64,
    pub acknowledged: u64,
    pub cancels: u64,
}

/// Job `i` of the mix.
pub fn job_spec(i: u64, rng: &mut Rng) -> pb::JobSpec {
    let tenant = ["team-a", "team-b", "team-c"][rng.below(3) as usize];
    let priority = ["low", "normal", "normal", "high"][rng.below(4) as usize];
    // Mostly short jobs of every shape. One in eight is a long single-GPU job that outlives
    // an agent's lease plus grace (3 s in a chaos run) by several seconds, so a partitioned
    // or killed host is still running it when the control plane gives up on the host and
    // places it elsewhere: without self-fencing it would then run twice.
    let long = rng.below(8) == 0;
    let (gpus, tasks, milli) = match rng.below(20) {
        _ if long => (1, 1, 0),
        0..=8 => (1, 1, 0),
        9..=12 => (2, 1, 0),
        13..=14 => (4, 1, 0),
        15..=16 => (1, 2, 0),
        _ => (1, 1, 500),
    };
    let secs = if long {
        8.0 + rng.below(60) as f64 * 0.1
    } else {
        0.2 + rng.below(13) as f64 * 0.1
    };
    let mut spec = pb::JobSpec {
        tenant: tenant.into(),
        name: format!("chaos-{i}"),
        command: vec!["sleep".into(), format!("{secs:.1}")],
        gpus_per_task: gpus,
        tasks,
        gpu_milli: milli,
        priority_class: priority.into(),
        ..Default::default()
    };
    // Slurm's rules ride along: one job in sixteen is submitted held (its client releases it
    // a second later), one in sixteen is an array of three running one at a time.
    match rng.below(16) {
        0 => spec.hold = true,
        1 => {
            spec.array = Some(pb::ArraySpec {
                ranges: vec![pb::ArrayRange {
                    first: 0,
                    last: 2,
                    step: 1,
                }],
                max_running: 1,
            })
        }
        _ => {}
    }
    spec
}

pub struct Workload {
    /// The current members (they change with `replica_add_remove`).
    pub endpoints: crate::members::Endpoints,
    /// How the workload's clients authenticate (the cluster's admin, or an attached
    /// cluster's credentials).
    pub credentials: control_plane::client::Credentials,
    pub recorder: Recorder,
    pub next_op: Arc<AtomicU64>,
    /// Set to stop early (Ctrl-C).
    pub stop: Arc<AtomicBool>,
}

impl Workload {
    pub async fn run(&self, cfg: WorkloadConfig) -> anyhow::Result<WorkloadStats> {
        let start = tokio::time::Instant::now();
        let clients = cfg.clients.max(1);
        let interval = cfg.duration / cfg.jobs.max(1) as u32;
        let mut tasks = Vec::new();
        for c in 0..clients {
            let (mut seen, addrs) = self.endpoints.get();
            let mut client = Client::new(&addrs, &self.credentials)?;
            let endpoints = self.endpoints.clone();
            let credentials = self.credentials.clone();
            // Short attempts, so a client stuck on a dead or isolated replica moves on quickly;
            // the deadline is long enough to ride out any failover.
            client.attempt_timeout = Duration::from_millis(800);
            client.deadline = Duration::from_secs(10);
            let recorder = self.recorder.clone();
            let next_op = self.next_op.clone();
            let stop = self.stop.clone();
            let cfg = cfg.clone();
            tasks.push(tokio::spawn(async move {
                let mut stats = WorkloadStats::default();
                let mut rng = Rng::new(cfg.seed ^ ((c as u64 + 1) * 7919));
                let mut acked: Vec<(pb::SubmitJobRequest, u64)> = Vec::new();
                let mut i = c as u64;
                while (i as usize) < cfg.jobs && !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep_until(start + interval * i as u32).await;
                    if let Some(c) = endpoints.refreshed(&mut seen, &client, &credentials) {
                        client = c;
                    }
                    let req = pb::SubmitJobRequest {
                        spec: Some(job_spec(i, &mut rng)),
                        idempotency_key: format!("chaos-{}-{i}", cfg.seed),
                    };
                    stats.submitted += 1;
                    let held = req.spec.as_ref().is_some_and(|s| s.hold);
                    // Retry with the same key until acknowledged or definitely refused.
                    for _attempt in 0..6 {
                        match submit(&mut client, &req, c as u32, &recorder, &next_op).await {
                            Some(Ok(id)) => {
                                stats.acknowledged += 1;
                                acked.push((req.clone(), id));
                                if held {
                                    let (_, addrs) = endpoints.get();
                                    let credentials = credentials.clone();
                                    tokio::spawn(async move {
                                        tokio::time::sleep(Duration::from_secs(1)).await;
                                        release(&addrs, &credentials, id).await;
                                    });
                                }
                                break;
                            }
                            Some(Err(())) => break,
                            None => continue,
                        }
                    }
                    // Re-send an earlier acknowledged submission: same key, same job.
                    if rng.below(cfg.resend_every) == 0
                        && let Some((old, _)) = acked.get(rng.below(acked.len() as u64) as usize)
                    {
                        let old = old.clone();
                        submit(&mut client, &old, c as u32, &recorder, &next_op).await;
                    }
                    if rng.below(cfg.cancel_every) == 0
                        && let Some((_, id)) = acked.last()
                    {
                        stats.cancels += 1;
                        cancel(&mut client, *id, c as u32, &recorder, &next_op).await;
                    }
                    i += clients as u64;
                }
                stats
            }));
        }
        let mut total = WorkloadStats::default();
        for t in tasks {
            let s = t.await?;
            total.submitted += s.submitted;
            total.acknowledged += s.acknowledged;
            total.cancels += s.cancels;
        }
        Ok(total)
    }
}

/// One submission attempt, recorded. Some(Ok(id)): acknowledged; Some(Err): refused for good;
/// None: outcome unknown (worth retrying with the same key).
async fn submit(
    client: &mut Client,
    req: &pb::SubmitJobRequest,
    c: u32,
    recorder: &Recorder,
    next_op: &AtomicU64,
) -> Option<Result<u64, ()>> {
    let spec = req.spec.clone().unwrap_or_default();
    let kind = OpKind::Submit {
        key: req.idempotency_key.clone(),
        tenant: spec.tenant.clone(),
        priority: spec.priority_class.clone(),
        gpus_per_task: spec.gpus_per_task,
        tasks: spec.tasks,
        gpu_milli: spec.gpu_milli,
    };
    let op = next_op.fetch_add(1, Ordering::Relaxed);
    let invoked_ms = now_ms();
    let result = client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.submit_job(with_timeout(r, t)).await }
        })
        .await;
    let (outcome, ret) = match result {
        Ok(r) => (
            Outcome::Ok {
                job: r.id,
                created: r.created,
            },
            Some(Ok(r.id)),
        ),
        Err(s) if retryable(&s) => (
            Outcome::Unknown {
                error: s.message().to_owned(),
            },
            None,
        ),
        Err(s) => (
            Outcome::Fail {
                error: format!("{:?}: {}", s.code(), s.message()),
            },
            Some(Err(())),
        ),
    };
    recorder.record(&Event::Op {
        op,
        client: c,
        kind,
        invoked_ms,
        completed_ms: Some(now_ms()),
        outcome,
    });
    ret
}

/// Releases a held job, retrying across replicas (a refusal, such as one for a job cancelled
/// meanwhile, is an answer). Not an operation of the history: nothing is checked of it but
/// that the job then runs (progress).
async fn release(addrs: &[String], credentials: &control_plane::client::Credentials, job: u64) {
    let Ok(mut client) = Client::new(addrs, credentials) else {
        return;
    };
    client.attempt_timeout = Duration::from_millis(800);
    client.deadline = Duration::from_secs(30);
    let req = pb::ChangeJobRequest {
        id: job,
        only_this_job: false,
        change: Some(pb::change_job_request::Change::Release(pb::ReleaseJob {})),
    };
    let _ = client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.change_job(with_timeout(r, t)).await }
        })
        .await;
}

async fn cancel(client: &mut Client, job: u64, c: u32, recorder: &Recorder, next_op: &AtomicU64) {
    let op = next_op.fetch_add(1, Ordering::Relaxed);
    let invoked_ms = now_ms();
    let result = client
        .call(|mut cl, t| async move {
            cl.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id: job,
                    reason: "chaos workload".into(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await;
    let outcome = match result {
        Ok(_) => Outcome::Ok {
            job,
            created: false,
        },
        Err(s) if retryable(&s) => Outcome::Unknown {
            error: s.message().to_owned(),
        },
        // Cancelling a job that already ended is refused; that is not a fault.
        Err(s) => Outcome::Fail {
            error: format!("{:?}: {}", s.code(), s.message()),
        },
    };
    recorder.record(&Event::Op {
        op,
        client: c,
        kind: OpKind::Cancel { job },
        invoked_ms,
        completed_ms: Some(now_ms()),
        outcome,
    });
}
