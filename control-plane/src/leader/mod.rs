//! Loops that run only on the leader, for as long as it leads one term:
//!
//! - scheduling: plan on the leader's applied state (an optimistic view) and propose the plan as
//!   one Raft entry; `apply` re-validates every placement against the committed state, so a
//!   plan computed on a view that is a few entries old can lose placements but never double-book;
//! - node liveness: heartbeats live in this process's memory (`Liveness`), never in the log; a
//!   node whose agent has not been heard for lease + grace is declared lost through the log, and
//!   every node gets a fresh lease + grace when a new leader takes over.
//!
//! Time limits are enforced by the agents, which own the processes.

pub mod cluster_version;
pub mod liveness;
pub mod services;

use std::sync::Arc;
use std::time::Duration;

// tokio's Instant is std's in production; under the simulation's paused clock it follows
// simulated time, so the same loops run in both.
use tokio::time::Instant;

use openraft::ServerState;
use tokio::task::JoinHandle;

use crate::replica::{ApiError, Replica};
use crate::scheduler;
use crate::state::{Command, JobRetention, NodeStatus, Outcome};
pub use liveness::Liveness;

#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// An agent that cannot renew its lease for this long stops its workloads.
    pub node_lease: Duration,
    /// Extra time the control plane waits after a lease expires before it releases the node's
    /// GPUs, so a fenced agent has certainly stopped its processes.
    pub node_grace: Duration,
    /// How often agents heartbeat.
    pub agent_heartbeat: Duration,
    /// Scheduling passes run on every applied change, and at least this often.
    pub schedule_interval: Duration,
    /// A leader that has not heard from a quorum for longer than this stops vouching for
    /// node leases (heartbeats, assignment streams).
    pub max_quorum_silence: Duration,
    /// The scheduling policy's settings.
    pub policy: scheduler::Policy,
    /// How long finished jobs are kept (proposed in each `CompactJobs`).
    pub retention: JobRetention,
    /// How often to check whether finished jobs are due for compaction.
    pub compaction_interval: Duration,
    /// How long the audit trail keeps records (proposed in each `CompactAudit`).
    pub audit_retention: crate::state::AuditRetention,
}

/// Watches Raft metrics and runs the leader loops while this replica leads.
pub fn spawn(
    replica: Arc<Replica>,
    liveness: Arc<Liveness>,
    config: LeaderConfig,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut metrics = replica.raft.metrics();
        let mut running: Option<(u64, JoinHandle<()>)> = None;
        loop {
            let (leading, term) = {
                let m = metrics.borrow();
                (m.state == ServerState::Leader, m.current_term)
            };
            let current = running.as_ref().map(|(t, _)| *t);
            if !leading || current != Some(term) {
                if let Some((t, handle)) = running.take() {
                    handle.abort();
                    tracing::info!(term = t, "no longer leading: leader loops stopped");
                }
                if leading {
                    liveness.start_term(term);
                    replica.services.start_term();
                    tracing::info!(term, "leading: starting scheduling and liveness loops");
                    let loops = tokio::spawn(leader_loops(
                        replica.clone(),
                        liveness.clone(),
                        config.clone(),
                        term,
                    ));
                    running = Some((term, loops));
                }
            }
            if metrics.changed().await.is_err() {
                break;
            }
        }
        if let Some((_, handle)) = running {
            handle.abort();
        }
    })
}

async fn leader_loops(
    replica: Arc<Replica>,
    liveness: Arc<Liveness>,
    config: LeaderConfig,
    term: u64,
) {
    // Decide nothing before this replica has applied everything committed before its term.
    while let Err(e) = replica.linearize().await {
        tracing::debug!(?e, "waiting to catch up before scheduling");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut applied = replica.sm.watch_applied();
    let mut last_pass = Instant::now() - config.schedule_interval;
    let mut last_liveness_check = Instant::now();
    let mut last_compaction = Instant::now();
    let mut last_version_check: Option<Instant> = None;
    let mut last_service_tick = Instant::now();
    let mut version_wait: Option<String> = None;
    // How long to let changes land before the next pass: a pass that proposed something is
    // followed at once (more work is likely placeable); after one that found nothing to do,
    // wait `IDLE_SETTLE_FACTOR` times as long as that pass took (up to the interval), so that
    // on a large cluster with a long blocked queue, a stream of submissions cannot keep the
    // leader planning back to back: a pass holds the state's read lock, and every apply (every
    // acknowledged write) waits for it.
    let mut settle = MIN_SETTLE;
    loop {
        tokio::select! {
            // Biased: tokio's fair select draws from a per-runtime random seed the simulation
            // cannot fix; either branch leads to the same pass, so the order costs nothing.
            biased;
            _ = applied.changed() => {
                // Let a burst of submissions land before planning once for all of them.
                tokio::time::sleep(settle).await;
            }
            _ = tokio::time::sleep(config.schedule_interval.saturating_sub(last_pass.elapsed())) => {}
        }
        last_pass = Instant::now();
        match schedule_once(&replica, term, &config.policy).await {
            Ok(pass) => {
                settle = if pass.proposed {
                    MIN_SETTLE
                } else {
                    (pass.took * IDLE_SETTLE_FACTOR).clamp(MIN_SETTLE, config.schedule_interval)
                };
                if pass.refused {
                    // Placements were proposed but none stuck (the view was stale): do not
                    // spin on the applied-index change that our own entry caused.
                    tokio::time::sleep(config.schedule_interval).await;
                }
            }
            Err(ApiError::NotLeader { .. }) => return,
            Err(e) => tracing::warn!(?e, "scheduling pass failed"),
        }
        // A leader whose process was paused (SIGSTOP, a long stall) heard no heartbeats while
        // it could not listen: that silence is its own, not the nodes'.
        let stall_limit = (config.agent_heartbeat * 2).max(Duration::from_secs(1));
        if last_liveness_check.elapsed() > stall_limit {
            tracing::warn!(
                stalled_ms = last_liveness_check.elapsed().as_millis() as u64,
                "leader loop stalled: granting every node a fresh grace period"
            );
            liveness.start_term(term);
        }
        last_liveness_check = Instant::now();
        if let Err(ApiError::NotLeader { .. }) = check_liveness(&replica, &liveness, &config).await
        {
            return;
        }
        if last_compaction.elapsed() >= config.compaction_interval {
            match compact_jobs(&replica, &config).await {
                Err(ApiError::NotLeader { .. }) => return,
                // More is due than one entry takes: the next batch on the next pass.
                Ok(true) => {}
                _ => last_compaction = Instant::now(),
            }
        }
        if last_service_tick.elapsed() >= SERVICE_TICK_INTERVAL {
            last_service_tick = Instant::now();
            if let Err(ApiError::NotLeader { .. }) = services::tick(&replica).await {
                return;
            }
        }
        if last_version_check.is_none_or(|t| t.elapsed() >= VERSION_CHECK_INTERVAL) {
            last_version_check = Some(Instant::now());
            match cluster_version::raise_when_due(&replica, &mut version_wait).await {
                Err(ApiError::NotLeader { .. }) => return,
                Err(e) => tracing::warn!(?e, "raising the cluster version failed"),
                Ok(()) => {}
            }
        }
    }
}

/// How often the leader runs the services' autoscalers and checks their rollouts' deadlines.
const SERVICE_TICK_INTERVAL: Duration = Duration::from_millis(1_000);

/// How often the leader checks whether the cluster version can be raised: after the last
/// replica of a rolling upgrade restarts, within a second of its first answer.
const VERSION_CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// Jobs one `CompactJobs` entry archives or forgets at most: about a quarter of a second of
/// apply on the 2-core development machine (a million took 5 s in one entry).
pub const COMPACT_BATCH: u64 = 50_000;

/// Proposes a `CompactJobs` with this leader's retention when finished jobs are due for it
/// (at most [`COMPACT_BATCH`] of them), and a `CompactAudit` when the audit trail is.
/// Returns whether more jobs are still due.
async fn compact_jobs(replica: &Replica, config: &LeaderConfig) -> Result<bool, ApiError> {
    let (jobs_due, audit_due) = {
        let data = replica.sm.read();
        let now = replica.now_ms();
        (
            data.cluster.compaction_due(&config.retention, now),
            data.cluster
                .audit_compaction_due(&config.audit_retention, now),
        )
    };
    let limit = (replica.sm.cluster_version() >= 2).then_some(COMPACT_BATCH);
    let commands = [
        jobs_due.then_some(Command::CompactJobs {
            retention: config.retention,
            limit,
        }),
        audit_due.then_some(Command::CompactAudit {
            retention: config.audit_retention,
        }),
    ];
    for command in commands.into_iter().flatten() {
        if let Err(e) = replica.write(command).await {
            tracing::warn!(?e, "compacting finished jobs or the audit trail failed");
            return Err(e);
        }
    }
    let more = replica
        .sm
        .read()
        .cluster
        .compaction_due(&config.retention, replica.now_ms());
    Ok(jobs_due && more && limit.is_some())
}

/// A pass that takes this long is logged (with the placements it found).
const SLOW_PASS: Duration = Duration::from_millis(250);

use crate::off_runtime::off_runtime;

/// Shortest wait after an applied change before the next pass.
const MIN_SETTLE: Duration = Duration::from_millis(2);

/// After a pass that found nothing to do, the next waits this many times as long as that pass
/// took: passes then hold the state lock at most a fifth of the time, so writes keep flowing
/// behind a long blocked queue.
const IDLE_SETTLE_FACTOR: u32 = 4;

/// What one scheduling pass did.
struct Pass {
    /// The plan had placements or preemptions, and they were proposed.
    proposed: bool,
    /// Proposed, and every one of them was refused at apply.
    refused: bool,
    /// Time spent planning (not proposing).
    took: Duration,
}

/// One scheduling pass.
async fn schedule_once(
    replica: &Replica,
    term: u64,
    policy: &scheduler::Policy,
) -> Result<Pass, ApiError> {
    let started = Instant::now();
    let plan = off_runtime(|| {
        let now = replica.now_ms();
        let (plan, reasons) = {
            let data = replica.sm.read();
            // No node takes new work (none registered yet, or every one drained or down, as
            // in a maintenance window): nothing can be placed, so nothing is worth preempting
            // either. Skip the pass rather than hold the state lock over a queue that cannot
            // move.
            let schedulable = data
                .cluster
                .nodes
                .values()
                .any(|n| n.status == NodeStatus::Ready);
            if schedulable {
                let (plan, _, reasons) = scheduler::plan_explained(&data.cluster, now, policy);
                (plan, reasons)
            } else {
                let reasons = scheduler::ReasonLog {
                    no_ready_node: true,
                    ..Default::default()
                };
                (scheduler::Plan::default(), reasons)
            }
        };
        // Published after the state lock is released: the map is built while writes apply.
        replica.publish_reasons(scheduler::Board::new(
            term,
            now,
            reasons,
            policy.max_jobs_per_pass,
        ));
        plan
    });
    let took = started.elapsed();
    replica.metrics.scheduler_pass(took);
    if took >= SLOW_PASS {
        tracing::info!(
            pass_ms = took.as_millis() as u64,
            placements = plan.placements.len(),
            "slow scheduling pass"
        );
    }
    if plan.is_empty() {
        return Ok(Pass {
            proposed: false,
            refused: false,
            took,
        });
    }
    if let Some(r) = &plan.reservation {
        tracing::debug!(job = r.job, start_at = r.start_at, nodes = ?r.nodes, "backfill reservation");
    }
    let mut refused = true;
    // Preemptions first: they were chosen against the state the plan saw, before this pass's
    // placements (a quota reclaim judged after them could be refused). Victims keep their GPUs
    // until they exit, so the placements stay valid either way.
    for p in plan.preemptions {
        let command = Command::Preempt {
            for_job: p.for_job,
            victims: p.victims,
            reason: String::new(),
        };
        match replica.write(command).await? {
            Outcome::Preempted { accepted, rejected } => {
                for (job, reason) in &rejected {
                    tracing::debug!(job, reason, "preemption refused at apply");
                }
                tracing::info!(for_job = p.for_job, victims = ?accepted, "preempted");
                replica.metrics.preempted(accepted.len());
                refused &= accepted.is_empty();
            }
            other => tracing::warn!(?other, "unexpected outcome of a preemption"),
        }
    }
    if !plan.placements.is_empty() {
        let proposed = plan.placements.len();
        let placements = plan.placements;
        match replica.write(Command::Place { term, placements }).await? {
            Outcome::Placed { accepted, rejected } => {
                for (job, reason) in &rejected {
                    tracing::debug!(job, reason, "placement refused at apply");
                }
                tracing::debug!(proposed, accepted = accepted.len(), "scheduling pass");
                replica.metrics.placed(accepted.len(), &rejected);
                refused &= accepted.is_empty();
            }
            other => tracing::warn!(?other, "unexpected outcome of a plan"),
        }
    }
    Ok(Pass {
        proposed: true,
        refused,
        took,
    })
}

/// Declares lost every node whose agent has been silent for lease + grace.
async fn check_liveness(
    replica: &Replica,
    liveness: &Liveness,
    config: &LeaderConfig,
) -> Result<(), ApiError> {
    let limit = config.node_lease + config.node_grace;
    let now_ms = replica.now_ms();
    let expired: Vec<(String, Duration, u64)> = {
        let data = replica.sm.read();
        data.cluster
            .nodes
            .values()
            .filter(|n| n.status != NodeStatus::Down)
            .filter_map(|n| {
                let silent = liveness.silence(&n.spec.name, now_ms, n.registered_at);
                (silent > limit).then(|| (n.spec.name.clone(), silent, n.registered_at))
            })
            .collect()
    };
    for (node, silent, registered_at) in expired {
        tracing::warn!(
            node,
            silent_ms = silent.as_millis() as u64,
            "node lease and grace expired: declaring it lost"
        );
        replica.metrics.node_lost();
        let reason = format!(
            "no heartbeat for {:.1} s (lease {:.1} s + grace {:.1} s)",
            silent.as_secs_f64(),
            config.node_lease.as_secs_f64(),
            config.node_grace.as_secs_f64()
        );
        replica
            .write(Command::NodeLost {
                node,
                reason,
                registered_at,
            })
            .await?;
    }
    Ok(())
}
