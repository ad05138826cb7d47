//! The size and timing of one simulated seed, in one place. Chosen so that 1,000 seeds run in
//! a few minutes of a debug build on two cores while still covering elections, snapshots,
//! node loss (a host silent for longer than lease + grace) and requeues.

use std::time::Duration;

use crate::leader::LeaderConfig;
use crate::raft::RaftTuning;
use crate::scheduler::Policy;

#[derive(Debug, Clone)]
pub struct Params {
    pub replicas: u64,
    /// Host presets (`node_agent::gpu::simulated::PRESETS`), one host each. The service's
    /// replicas run on every A100 host but the first (`dst::services::service_hosts`).
    pub hosts: Vec<&'static str>,
    pub jobs: usize,
    pub clients: usize,
    /// Submissions arrive over this window (ms after the start).
    pub submit_window_ms: u64,
    /// Faults start in this window; each lasts at most `max_fault_ms`.
    pub fault_window_ms: (u64, u64),
    pub max_fault_ms: u64,
    pub faults: (u64, u64),
    /// Once faults stop, every acknowledged job must end within this much simulated time.
    pub liveness_budget_ms: u64,
    /// Simulated task run time range.
    pub task_ms: (u64, u64),
    pub raft_heartbeat_ms: u64,
    /// Election timeouts are drawn per replica from this range (each fixed for the seed).
    pub election_ms: (u64, u64),
    pub snapshot_every: u64,
    pub keep_behind_snapshot: u64,
    pub node_lease_ms: u64,
    pub node_grace_ms: u64,
    pub agent_heartbeat_ms: u64,
    pub schedule_interval_ms: u64,
    /// Client-side deadline of one call.
    pub call_timeout_ms: u64,
    /// How often the replica-state invariants are checked.
    pub check_every_ms: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            replicas: 3,
            hosts: vec![
                "a100-pcie-4gpu-nvlink-pairs",
                "a100-pcie-4gpu-nvlink-pairs",
                "dgx-h100",
                "h100-pcie-1gpu-mig",
                // With host 1, where the seed's service runs its replicas (`dst::services`).
                "a100-pcie-4gpu-nvlink-pairs",
            ],
            jobs: 30,
            clients: 2,
            submit_window_ms: 20_000,
            fault_window_ms: (2_000, 25_000),
            max_fault_ms: 8_000,
            faults: (2, 5),
            liveness_budget_ms: 90_000,
            task_ms: (1_000, 8_000),
            raft_heartbeat_ms: 100,
            election_ms: (300, 600),
            snapshot_every: 150,
            keep_behind_snapshot: 30,
            node_lease_ms: 2_000,
            node_grace_ms: 2_000,
            agent_heartbeat_ms: 500,
            schedule_interval_ms: 300,
            call_timeout_ms: 2_000,
            check_every_ms: 1_000,
        }
    }
}

impl Params {
    pub fn tuning(&self) -> RaftTuning {
        RaftTuning {
            heartbeat_ms: self.raft_heartbeat_ms,
            election_min_ms: self.election_ms.0,
            election_max_ms: self.election_ms.1,
            snapshot_every: self.snapshot_every,
            keep_behind_snapshot: self.keep_behind_snapshot,
        }
    }

    pub fn leader_config(&self) -> LeaderConfig {
        LeaderConfig {
            node_lease: Duration::from_millis(self.node_lease_ms),
            node_grace: Duration::from_millis(self.node_grace_ms),
            agent_heartbeat: Duration::from_millis(self.agent_heartbeat_ms),
            schedule_interval: Duration::from_millis(self.schedule_interval_ms),
            // As `config.rs` derives it: two (longest) election timeouts.
            max_quorum_silence: Duration::from_millis(2 * self.election_ms.1),
            policy: Policy::default(),
            retention: crate::config::Defaults::job_retention(),
            compaction_interval: Duration::from_millis(
                crate::config::Defaults::COMPACTION_INTERVAL_MS,
            ),
            audit_retention: crate::state::AuditRetention::default(),
        }
    }
}
