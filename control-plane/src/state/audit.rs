//! The audit trail: who changed what, from where, kept in the replicated state so every
//! replica answers `gpuctl audit` alike and a snapshot carries it. A command arrives from the
//! API wrapped in `Command::Attributed` with the caller (token id or certificate subject, its
//! role and tenant, the address the call came from); apply records it when the command
//! changed the state. Commands the leader makes by itself (scheduling plans, node loss,
//! compaction) are not attributed: their effects are in each job's history.
//!
//! Retention is bounded both ways, by age and by count (`AuditRetention`): the count at every
//! record, the age when the leader proposes `CompactAudit` with its settings.

use serde::{Deserialize, Serialize};

use super::command::{Command, Outcome};
use super::{ClusterState, JobId, Timestamp};

/// Who made a change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    /// `token:<id>`, `cert:<role>:<name>` (client certificates), `node:<name>`,
    /// `replica:<name>`, or `anonymous` (security off).
    pub principal: String,
    /// The API role it acted with (`admin`, `operator`, `user`), or `node`/`replica`.
    pub role: String,
    pub tenant: Option<String>,
    /// The address the call came from, as the first replica it reached saw it.
    pub from: String,
}

impl Actor {
    /// The node an agent acts as (`node:<name>`).
    pub fn node(&self) -> Option<&str> {
        self.principal.strip_prefix("node:")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Position in the trail; grows by one per record and is never reused.
    pub seq: u64,
    /// The leader's time of the entry.
    pub at: Timestamp,
    pub actor: Actor,
    /// The command's kind (`submit_job`, `cancel_job`, `revoke_token`, ...).
    pub action: String,
    /// What it acted on (`job 12`, `node gpu-1`, `tenant vision`, `token 1a2b...`).
    pub target: String,
    /// The job it concerned, if any (for `gpuctl audit --job`).
    pub job: Option<JobId>,
    /// The command in one line, shortened.
    pub detail: String,
}

/// How much of the trail is kept. Proposed by the leader; the state remembers the last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRetention {
    pub max_age_ms: u64,
    pub max_records: u64,
}

impl Default for AuditRetention {
    fn default() -> Self {
        AuditRetention {
            max_age_ms: crate::config::Defaults::AUDIT_RETENTION_SECS * 1000,
            max_records: crate::config::Defaults::MAX_AUDIT_RECORDS,
        }
    }
}

/// Longest `detail` kept, in characters.
const MAX_DETAIL: usize = 240;

fn shorten(s: String) -> String {
    if s.chars().count() <= MAX_DETAIL {
        return s;
    }
    let mut out: String = s.chars().take(MAX_DETAIL - 1).collect();
    out.push('…');
    out
}

impl ClusterState {
    /// What a command acts on, read before it applies (an exit removes its allocation).
    pub(super) fn audit_target(&self, command: &Command) -> (String, Option<JobId>) {
        let job_of = |alloc: &u64| self.allocations.get(alloc).map(|r| r.allocation.job);
        match command {
            Command::SubmitJob { spec, .. } => (format!("tenant {}", spec.tenant), None),
            Command::CancelJob { job, .. } => (format!("job {job}"), Some(*job)),
            Command::RegisterNode { spec } => (format!("node {}", spec.name), None),
            Command::AllocationStarted { allocation }
            | Command::AllocationExited { allocation, .. } => {
                let job = job_of(allocation);
                (
                    job.map_or(format!("allocation {allocation}"), |j| format!("job {j}")),
                    job,
                )
            }
            Command::PutTenant { tenant } => (format!("tenant {}", tenant.name), None),
            Command::SetNodeStatus { node, .. } | Command::NodeLost { node, .. } => {
                (format!("node {node}"), None)
            }
            Command::SetGpuHealth { node, gpu, .. } => (format!("node {node} gpu {gpu}"), None),
            Command::PutPartition { partition } => (format!("partition {}", partition.name), None),
            Command::Preempt { for_job, .. } => (format!("job {for_job}"), Some(*for_job)),
            Command::ChangeJobs { jobs, .. } => match jobs.as_slice() {
                [one] => (format!("job {one}"), Some(*one)),
                [first, .., last] => (format!("jobs {first}..{last}"), Some(*first)),
                [] => (String::new(), None),
            },
            Command::CreateToken { token } => (format!("token {}", token.id), None),
            Command::RevokeToken { id, .. } => (format!("token {id}"), None),
            Command::AuditNote { target, .. } => (target.clone(), None),
            Command::PutService { spec, .. } => (format!("service {}", spec.key()), None),
            Command::ScaleService { service, .. }
            | Command::DeleteService { service }
            | Command::ServiceRollout { service, .. } => (format!("service {service}"), None),
            Command::ReplicaReadiness { allocation, .. } => {
                let job = job_of(allocation);
                (
                    job.map_or(format!("allocation {allocation}"), |j| format!("job {j}")),
                    job,
                )
            }
            Command::Place { .. }
            | Command::CompactJobs { .. }
            | Command::CompactAudit { .. }
            | Command::SetClusterVersion { .. }
            | Command::Batch { .. }
            | Command::Attributed { .. } => (String::new(), None),
        }
    }

    /// Refuses a command an agent makes for another node than its own. The API checks this
    /// too, but only apply sees the allocation a report names once its placement is applied:
    /// an agent could otherwise report on an allocation of another node that the replica had
    /// not applied when it checked.
    pub(super) fn check_node_acts_for(
        &self,
        node: &str,
        command: &Command,
    ) -> Result<(), super::Rejection> {
        let acts_for = match command {
            Command::RegisterNode { spec } => Some(spec.name.as_str()),
            Command::SetGpuHealth { node, .. } => Some(node.as_str()),
            Command::AllocationStarted { allocation }
            | Command::AllocationExited { allocation, .. }
            | Command::ReplicaReadiness { allocation, .. } => self
                .allocations
                .get(allocation)
                .map(|r| r.allocation.node.as_str()),
            _ => None,
        };
        match acts_for {
            Some(other) if other != node => Err(super::Rejection::precondition(format!(
                "node {node} may not act for node {other}"
            ))),
            _ => Ok(()),
        }
    }

    /// Appends a record for a command that `actor` made and that changed the state.
    pub(super) fn record_audit(
        &mut self,
        actor: &Actor,
        command: &Command,
        (target, job): (String, Option<JobId>),
        outcome: &Outcome,
        at: Timestamp,
    ) {
        let (job, target) = match outcome {
            Outcome::JobSubmitted { id, .. } => (Some(*id), format!("job {id} ({target})")),
            _ => (job, target),
        };
        let detail = match command {
            Command::AuditNote { detail, .. } => detail.clone(),
            other => other.to_string(),
        };
        self.last_audit_seq += 1;
        let record = AuditRecord {
            seq: self.last_audit_seq,
            at,
            actor: actor.clone(),
            action: match command {
                Command::AuditNote { action, .. } => action.clone(),
                other => other.kind().to_owned(),
            },
            target,
            job,
            detail: shorten(detail),
        };
        self.audit.insert(record.seq, record);
        self.trim_audit(at);
    }

    /// Drops records past the retention the state knows (count always; age as of `at`).
    fn trim_audit(&mut self, at: Timestamp) {
        let limits = self.audit_retention;
        let cutoff = at.saturating_sub(limits.max_age_ms);
        while let Some(&seq) = self.audit.keys().next() {
            let old = self.audit.get(&seq).is_some_and(|r| r.at < cutoff);
            if self.audit.len() as u64 > limits.max_records || old {
                self.audit.remove(&seq);
            } else {
                break;
            }
        }
    }

    pub(super) fn compact_audit(&mut self, retention: &AuditRetention, at: Timestamp) -> Outcome {
        if retention.max_records == 0 {
            return Outcome::Rejected(super::Rejection::invalid(
                "retention.max_records",
                "must be at least 1",
            ));
        }
        self.audit_retention = *retention;
        self.trim_audit(at);
        Outcome::Done
    }

    /// Whether the leader should propose a `CompactAudit`: records past their age, or the
    /// state's limits differ from the leader's.
    pub fn audit_compaction_due(&self, retention: &AuditRetention, now: Timestamp) -> bool {
        self.audit_retention != *retention
            || self
                .audit
                .values()
                .next()
                .is_some_and(|r| r.at < now.saturating_sub(retention.max_age_ms))
    }
}
