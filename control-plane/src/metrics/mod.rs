//! A replica's Prometheus series (`gpucp_*`), served on `--metrics-listen` (`crate::http`).
//!
//! Three kinds, by where their cost falls:
//! - events counted where they happen, off the apply path (placements and refusals after a
//!   plan's entry applied, submit latency in the API, log flushes in the log store, exits and
//!   Xids as the leader receives them): an atomic add, or an uncontended histogram update;
//! - Raft's own levels (term, commit and applied index, replication lag per follower), read
//!   from openraft's metrics watch when scraped, and leader changes counted by a task that
//!   follows that watch;
//! - the state's levels (queue depth, nodes, GPUs, fragmentation: `levels`), computed from the
//!   applied state when scraped, so apply pays nothing for them.
//!
//! A replica without `--metrics-listen` gets [`ReplicaMetrics::disabled`]: every recording
//! method returns at its first branch (`gpuctl bench submit --metrics-compare` measures both).

pub mod levels;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use node_agent::observe::latency_buckets;

type Labels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

pub struct ReplicaMetrics {
    enabled: bool,
    pub registry: Registry,
    // Events.
    pub placements: Counter,
    pub plan_rejections: Family<Labels, Counter>,
    pub preemptions: Counter,
    pub scheduler_pass: Histogram,
    pub log_flush: Histogram,
    pub submit: Histogram,
    pub leader_changes: Counter,
    pub task_exits: Family<Labels, Counter>,
    pub xid_reports: Family<Labels, Counter>,
    pub nodes_lost: Counter,
    // Raft levels, set when scraped.
    pub term: Gauge,
    pub commit_index: Gauge,
    pub applied_index: Gauge,
    pub last_log_index: Gauge,
    pub is_leader: Gauge,
    pub has_leader: Gauge,
    pub ready: Gauge,
    pub replication_lag: Family<Labels, Gauge>,
    pub heartbeats_overdue: Gauge,
    // State levels, set when scraped.
    pub jobs: Family<Labels, Gauge>,
    pub pending_by_reason: Family<Labels, Gauge>,
    pub nodes: Family<Labels, Gauge>,
    pub gpus: Family<Labels, Gauge>,
    pub free_gpus: FloatGauge,
    pub fragmented_gpus: FloatGauge,
    pub service_replicas: Family<Labels, Gauge>,
    pub service_restarts: Family<Labels, Gauge>,
    pub service_rollout_paused: Family<Labels, Gauge>,
}

impl ReplicaMetrics {
    /// Records nothing; serves nothing. For replicas without `--metrics-listen`, tests and
    /// the simulation.
    pub fn disabled() -> ReplicaMetrics {
        ReplicaMetrics::build(false, 0)
    }

    /// The series of replica `id`, registered.
    pub fn enabled(id: u64) -> ReplicaMetrics {
        ReplicaMetrics::build(true, id)
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    fn build(enabled: bool, id: u64) -> ReplicaMetrics {
        let mut m = ReplicaMetrics {
            enabled,
            registry: Registry::default(),
            placements: Counter::default(),
            plan_rejections: Family::default(),
            preemptions: Counter::default(),
            scheduler_pass: Histogram::new(latency_buckets()),
            log_flush: Histogram::new(latency_buckets()),
            submit: Histogram::new(latency_buckets()),
            leader_changes: Counter::default(),
            task_exits: Family::default(),
            xid_reports: Family::default(),
            nodes_lost: Counter::default(),
            term: Gauge::default(),
            commit_index: Gauge::default(),
            applied_index: Gauge::default(),
            last_log_index: Gauge::default(),
            is_leader: Gauge::default(),
            has_leader: Gauge::default(),
            ready: Gauge::default(),
            replication_lag: Family::default(),
            heartbeats_overdue: Gauge::default(),
            jobs: Family::default(),
            pending_by_reason: Family::default(),
            nodes: Family::default(),
            gpus: Family::default(),
            free_gpus: FloatGauge::default(),
            fragmented_gpus: FloatGauge::default(),
            service_replicas: Family::default(),
            service_restarts: Family::default(),
            service_rollout_paused: Family::default(),
        };
        if !enabled {
            return m;
        }
        let mut r = Registry::with_prefix("gpucp");
        r.register(
            "replica",
            "This replica's id and release",
            Info::new(vec![
                ("replica", id.to_string()),
                ("release", env!("CARGO_PKG_VERSION").to_owned()),
            ]),
        );
        r.register(
            "placements",
            "Job placements the leader's plans got accepted at apply",
            m.placements.clone(),
        );
        r.register(
            "plan_rejections",
            "Placements of a plan that apply refused (the plan saw a stale state), by reason",
            m.plan_rejections.clone(),
        );
        r.register(
            "preemptions",
            "Jobs preempted by the leader's plans",
            m.preemptions.clone(),
        );
        r.register_with_unit(
            "scheduler_pass_duration",
            "Time one scheduling pass spent planning (the state's read lock is held meanwhile)",
            Unit::Seconds,
            m.scheduler_pass.clone(),
        );
        r.register_with_unit(
            "raft_log_flush_duration",
            "Time to append to the Raft log and fsync it (sled flush); every write waits for one",
            Unit::Seconds,
            m.log_flush.clone(),
        );
        r.register_with_unit(
            "api_submit_duration",
            "SubmitJob latency at the replica a client called (forwarding to the leader included)",
            Unit::Seconds,
            m.submit.clone(),
        );
        r.register(
            "raft_leader_changes",
            "Times this replica saw the leader change (including to none)",
            m.leader_changes.clone(),
        );
        r.register(
            "task_exits",
            "Task exits the leader recorded, by kind (succeeded, failed, timed_out, lost, stopped)",
            m.task_exits.clone(),
        );
        r.register(
            "gpu_xid_reports",
            "GPU health reports with an Xid the leader recorded, by code",
            m.xid_reports.clone(),
        );
        r.register(
            "nodes_lost",
            "Nodes this leader declared lost (no heartbeat for lease + grace)",
            m.nodes_lost.clone(),
        );
        r.register("raft_term", "Current Raft term", m.term.clone());
        r.register(
            "raft_commit_index",
            "Highest log index this replica knows is committed",
            m.commit_index.clone(),
        );
        r.register(
            "raft_applied_index",
            "Last log index applied to the state machine",
            m.applied_index.clone(),
        );
        r.register(
            "raft_last_log_index",
            "Last log index in this replica's log",
            m.last_log_index.clone(),
        );
        r.register("raft_is_leader", "1 on the leader", m.is_leader.clone());
        r.register(
            "raft_has_leader",
            "1 while this replica knows a leader",
            m.has_leader.clone(),
        );
        r.register(
            "ready",
            "1 while this replica is ready (the gRPC health service's readiness)",
            m.ready.clone(),
        );
        r.register(
            "raft_replication_lag_entries",
            "Leader only: entries each follower's log is behind the leader's",
            m.replication_lag.clone(),
        );
        r.register(
            "node_heartbeats_overdue",
            "Leader only: nodes not heard from for more than two heartbeat intervals (not yet lost)",
            m.heartbeats_overdue.clone(),
        );
        r.register(
            "jobs",
            "Queue depth: jobs pending, scheduled or running, by tenant and partition",
            m.jobs.clone(),
        );
        r.register(
            "jobs_pending_by_reason",
            "Pending jobs by why they wait (when the scheduler says)",
            m.pending_by_reason.clone(),
        );
        r.register(
            "nodes",
            "Nodes by status (ready, drained, down)",
            m.nodes.clone(),
        );
        r.register(
            "gpus",
            "GPUs by model and state (allocated, idle, unhealthy, unavailable)",
            m.gpus.clone(),
        );
        r.register(
            "free_gpus",
            "Free GPU capacity on ready nodes, in GPUs",
            m.free_gpus.clone(),
        );
        r.register(
            "fragmented_gpus",
            "Free GPU capacity the expected workload could not use (FGD fragmentation), in GPUs",
            m.fragmented_gpus.clone(),
        );
        r.register(
            "service_replicas",
            "Replicas of each service by state: desired, live, ready, updated (at the current revision), crash_looping",
            m.service_replicas.clone(),
        );
        r.register(
            "service_replica_restarts",
            "Restarts of each service's live replicas, summed",
            m.service_restarts.clone(),
        );
        r.register(
            "service_rollout_paused",
            "1 while a service's rollout is paused (by a person, a crash-looping new revision, or its progress deadline)",
            m.service_rollout_paused.clone(),
        );
        m.registry = r;
        m
    }

    /// What a plan's `Place` entry did at apply.
    pub fn placed(&self, accepted: usize, rejected: &[(u64, String)]) {
        if !self.enabled {
            return;
        }
        self.placements.inc_by(accepted as u64);
        for (_, reason) in rejected {
            let label = levels::rejection_reason(reason);
            self.plan_rejections
                .get_or_create(&vec![("reason", label.to_owned())])
                .inc();
        }
    }

    pub fn preempted(&self, victims: usize) {
        if self.enabled {
            self.preemptions.inc_by(victims as u64);
        }
    }

    pub fn scheduler_pass(&self, took: Duration) {
        if self.enabled {
            self.scheduler_pass.observe(took.as_secs_f64());
        }
    }

    pub fn submitted(&self, took: Duration) {
        if self.enabled {
            self.submit.observe(took.as_secs_f64());
        }
    }

    /// The log store's flush histogram: `None` when disabled, so the store skips the clock.
    pub fn log_flush_histogram(&self) -> Option<Histogram> {
        self.enabled.then(|| self.log_flush.clone())
    }

    pub fn task_exit(&self, kind: &'static str) {
        if self.enabled {
            self.task_exits
                .get_or_create(&vec![("kind", kind.to_owned())])
                .inc();
        }
    }

    pub fn xid_report(&self, code: u32) {
        if self.enabled && code != 0 {
            self.xid_reports
                .get_or_create(&vec![("code", code.to_string())])
                .inc();
        }
    }

    pub fn node_lost(&self) {
        if self.enabled {
            self.nodes_lost.inc();
        }
    }

    /// Sets the state's levels (`levels::levels`) for this scrape. Families are cleared
    /// first: a tenant whose queue emptied must drop out, not stay at its last count.
    pub fn set_levels(&self, l: &levels::Levels) {
        self.jobs.clear();
        for ((state, tenant, partition), n) in &l.jobs {
            self.jobs
                .get_or_create(&vec![
                    ("state", (*state).to_owned()),
                    ("tenant", tenant.clone()),
                    ("partition", partition.clone()),
                ])
                .set(*n as i64);
        }
        self.pending_by_reason.clear();
        for (reason, n) in l.pending_by_reason.iter().flatten() {
            self.pending_by_reason
                .get_or_create(&vec![("reason", reason.clone())])
                .set(*n as i64);
        }
        self.nodes.clear();
        for status in ["ready", "drained", "down"] {
            let n = l.nodes.get(status).copied().unwrap_or(0);
            self.nodes
                .get_or_create(&vec![("state", status.to_owned())])
                .set(n as i64);
        }
        self.gpus.clear();
        for ((model, state), n) in &l.gpus {
            self.gpus
                .get_or_create(&vec![
                    ("model", model.clone()),
                    ("state", (*state).to_owned()),
                ])
                .set(*n as i64);
        }
        self.free_gpus.set(l.free_gpus);
        self.fragmented_gpus.set(l.fragmented_gpus);
        self.service_replicas.clear();
        self.service_restarts.clear();
        self.service_rollout_paused.clear();
        for (service, s) in &l.services {
            for (state, n) in [
                ("desired", s.desired),
                ("live", s.live),
                ("ready", s.ready),
                ("updated", s.updated),
                ("crash_looping", s.crash_looping),
            ] {
                self.service_replicas
                    .get_or_create(&vec![
                        ("service", service.clone()),
                        ("state", state.to_owned()),
                    ])
                    .set(n as i64);
            }
            self.service_restarts
                .get_or_create(&vec![("service", service.clone())])
                .set(s.restarts as i64);
            self.service_rollout_paused
                .get_or_create(&vec![("service", service.clone())])
                .set(i64::from(s.paused));
        }
    }

    /// Sets Raft's levels from openraft's metrics and this replica's commit index.
    pub fn set_raft(&self, m: &crate::raft::RaftMetrics, committed: u64) {
        self.term.set(m.current_term as i64);
        self.commit_index.set(committed as i64);
        self.applied_index
            .set(m.last_applied.map(|l| l.index).unwrap_or(0) as i64);
        let last = m.last_log_index.unwrap_or(0);
        self.last_log_index.set(last as i64);
        self.is_leader
            .set(i64::from(m.current_leader == Some(m.id)));
        self.has_leader.set(i64::from(m.current_leader.is_some()));
        self.replication_lag.clear();
        for (follower, matched) in m.replication.iter().flatten() {
            if *follower == m.id {
                continue;
            }
            let matched = matched.map(|l| l.index).unwrap_or(0);
            self.replication_lag
                .get_or_create(&vec![("follower", follower.to_string())])
                .set(last.saturating_sub(matched) as i64);
        }
    }
}

/// Counts leader changes as this replica sees them (to another leader, or to none during an
/// election), until aborted. A replica that flaps between leaders shows here first.
pub fn spawn_leader_watch(
    raft: crate::raft::Raft,
    metrics: Arc<ReplicaMetrics>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut watch = raft.metrics();
        let mut leader = watch.borrow().current_leader;
        while watch.changed().await.is_ok() {
            let now = watch.borrow().current_leader;
            if now != leader {
                metrics.leader_changes.inc();
                leader = now;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &ReplicaMetrics) -> String {
        let mut t = String::new();
        prometheus_client::encoding::text::encode(&mut t, &m.registry).unwrap();
        t
    }

    #[test]
    fn a_disabled_registry_records_and_shows_nothing() {
        let m = ReplicaMetrics::disabled();
        m.placed(3, &[(1, "GPU x is unhealthy".into())]);
        m.submitted(Duration::from_millis(1));
        assert_eq!(m.placements.get(), 0);
        assert!(m.log_flush_histogram().is_none());
        assert!(!text(&m).contains("gpucp_"));
    }

    #[test]
    fn series_carry_the_prefix_units_and_bounded_labels() {
        let m = ReplicaMetrics::enabled(2);
        m.placed(
            2,
            &[
                (7, "GPU GPU-a is already held by allocation 3".into()),
                (8, "GPU GPU-b is already held by allocation 4".into()),
            ],
        );
        m.scheduler_pass(Duration::from_millis(3));
        m.task_exit("succeeded");
        m.xid_report(79);
        m.xid_report(0);
        let mut l = levels::Levels::default();
        l.jobs.insert(("pending", "t".into(), String::new()), 4);
        m.set_levels(&l);
        let t = text(&m);
        for want in [
            "gpucp_replica_info{replica=\"2\"",
            "gpucp_placements_total 2",
            "gpucp_plan_rejections_total{reason=\"gpu_held\"} 2",
            "gpucp_scheduler_pass_duration_seconds_count 1",
            "gpucp_raft_log_flush_duration_seconds_count 0",
            "gpucp_task_exits_total{kind=\"succeeded\"} 1",
            "gpucp_gpu_xid_reports_total{code=\"79\"} 1",
            "gpucp_jobs{state=\"pending\",tenant=\"t\",partition=\"\"} 4",
            "gpucp_nodes{state=\"down\"} 0",
        ] {
            assert!(t.contains(want), "no {want:?} in\n{t}");
        }
        assert!(!t.contains("code=\"0\""), "{t}");
        // A queue that emptied drops out at the next scrape.
        m.set_levels(&levels::Levels::default());
        assert!(!text(&m).contains("tenant=\"t\""));
    }
}
