//! The run summary: faults by kind, operations, jobs, failover times, violations. Computed
//! from the history alone, so `chaos check` prints the same summary as the run did.

use std::collections::BTreeMap;

use serde_json::json;

use crate::check::Report;
use crate::history::{Event, FaultKind, OpKind, Outcome};

/// Percentile by nearest rank over a sorted slice (as `gpuctl bench` reports them).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub faults: BTreeMap<&'static str, usize>,
    pub submits_ok: usize,
    pub submits_failed: usize,
    pub submits_unknown: usize,
    pub resends_same_job: usize,
    pub cancels: usize,
    pub jobs: usize,
    pub jobs_by_state: BTreeMap<String, usize>,
    pub process_starts: usize,
    /// Jobs whose processes started more often than they have tasks (requeued after a node
    /// was declared lost, or preempted): allowed, but worth seeing.
    pub jobs_rerun: usize,
    /// The service beside the batch work: changes answered (and sent), replica jobs, and
    /// replica processes started (restarts in place included).
    pub service_changes: usize,
    pub service_changes_answered: usize,
    pub service_replica_jobs: usize,
    pub service_replica_starts: usize,
    pub failover_ms: Vec<f64>,
    /// `replica_add_remove`: AddReplica call to voter, and removal's answer to the removed
    /// replica saying so (or exiting); the removals that took the leader out.
    pub promotion_ms: Vec<f64>,
    pub removed_stop_ms: Vec<f64>,
    pub leader_removals: usize,
    /// `replica_upgrade`: signal to caught up on the new build; "from -> to" of each; how
    /// many needed SIGKILL.
    pub upgrade_ms: Vec<f64>,
    pub upgrades: Vec<String>,
    pub upgrades_sigkilled: usize,
    pub violations: usize,
    pub by_invariant: Vec<(&'static str, usize)>,
    pub wall_s: f64,
}

pub fn summarize(events: &[Event], report: &Report) -> Summary {
    let mut s = Summary::default();
    for k in FaultKind::ALL {
        s.faults.insert(k.as_str(), 0);
    }
    let (mut first, mut last) = (u64::MAX, 0u64);
    for e in events {
        match e {
            Event::Fault { kind, .. } => *s.faults.entry(kind.as_str()).or_default() += 1,
            Event::Op {
                kind,
                outcome,
                invoked_ms,
                completed_ms,
                ..
            } => {
                first = first.min(*invoked_ms);
                last = last.max(completed_ms.unwrap_or(*invoked_ms));
                match (kind, outcome) {
                    (OpKind::Submit { .. }, Outcome::Ok { created: false, .. }) => {
                        s.submits_ok += 1;
                        s.resends_same_job += 1;
                    }
                    (OpKind::Submit { .. }, Outcome::Ok { .. }) => s.submits_ok += 1,
                    (OpKind::Submit { .. }, Outcome::Fail { .. }) => s.submits_failed += 1,
                    (OpKind::Submit { .. }, Outcome::Unknown { .. }) => s.submits_unknown += 1,
                    (OpKind::Cancel { .. }, _) => s.cancels += 1,
                }
            }
            Event::Failover {
                injected_ms,
                committed_ms,
                ..
            } => s
                .failover_ms
                .push(committed_ms.saturating_sub(*injected_ms) as f64),
            Event::MemberChange {
                promoted_after_ms,
                stopped_after_ms,
                removed_was_leader,
                ..
            } => {
                s.promotion_ms.push(*promoted_after_ms as f64);
                if let Some(t) = stopped_after_ms {
                    s.removed_stop_ms.push(*t as f64);
                }
                s.leader_removals += usize::from(*removed_was_leader);
            }
            Event::Upgrade {
                replica,
                was_leader,
                from,
                to,
                sigkilled,
                caught_up_after_ms,
                ..
            } => {
                s.upgrade_ms.push(*caught_up_after_ms as f64);
                s.upgrades.push(format!(
                    "replica {replica}{}: {from} -> {to}",
                    if *was_leader { " (leader)" } else { "" }
                ));
                s.upgrades_sigkilled += usize::from(*sigkilled);
            }
            Event::Usage { record, .. } => {
                if matches!(record, node_agent::runtime::UsageRecord::Start { .. }) {
                    s.process_starts += 1;
                }
            }
            Event::Config { at_ms, .. } => first = first.min(*at_ms),
            Event::Final { at_ms, jobs, .. } => {
                last = last.max(*at_ms);
                s.jobs = jobs.len();
                for j in jobs {
                    *s.jobs_by_state.entry(j.state.clone()).or_default() += 1;
                }
            }
            Event::ServiceChange { answered_ms, .. } => {
                s.service_changes += 1;
                s.service_changes_answered += usize::from(answered_ms.is_some());
            }
            _ => {}
        }
    }
    let mut starts: BTreeMap<u64, usize> = BTreeMap::new();
    for e in events {
        if let Event::Usage {
            record: node_agent::runtime::UsageRecord::Start { job, .. },
            ..
        } = e
        {
            *starts.entry(*job).or_default() += 1;
        }
    }
    if let Some(Event::Final { jobs, .. }) = events
        .iter()
        .rev()
        .find(|e| matches!(e, Event::Final { .. }))
    {
        // A replica restarted in place starts again by design: counted on its own.
        s.jobs_rerun = jobs
            .iter()
            .filter(|j| j.replica.is_none())
            .filter(|j| starts.get(&j.id).copied().unwrap_or(0) as i64 > j.tasks.max(1))
            .count();
        let replicas: Vec<u64> = jobs
            .iter()
            .filter(|j| j.replica.is_some())
            .map(|j| j.id)
            .collect();
        s.service_replica_jobs = replicas.len();
        s.service_replica_starts = replicas
            .iter()
            .map(|id| starts.get(id).copied().unwrap_or(0))
            .sum();
    }
    for v in [
        &mut s.failover_ms,
        &mut s.promotion_ms,
        &mut s.removed_stop_ms,
        &mut s.upgrade_ms,
    ] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    s.violations = report.violations();
    s.by_invariant = report
        .invariants
        .iter()
        .map(|i| (i.name, i.violations))
        .collect();
    if last >= first && first != u64::MAX {
        s.wall_s = (last - first) as f64 / 1000.0;
    }
    s
}

impl Summary {
    fn failover(&self) -> (f64, f64, f64) {
        let f = &self.failover_ms;
        (
            percentile(f, 50.0),
            percentile(f, 99.0),
            f.last().copied().unwrap_or(f64::NAN),
        )
    }

    pub fn json(&self) -> serde_json::Value {
        let (p50, p99, max) = self.failover();
        let num = |x: f64| if x.is_finite() { json!(x) } else { json!(null) };
        json!({
            "faults": self.faults,
            "faults_total": self.faults.values().sum::<usize>(),
            "operations": {
                "submits_acknowledged": self.submits_ok,
                "submits_refused": self.submits_failed,
                "submits_unknown": self.submits_unknown,
                "resends_answered_with_the_same_job": self.resends_same_job,
                "cancels": self.cancels,
            },
            "jobs": self.jobs,
            "jobs_completed": self.jobs_by_state.get("succeeded").copied().unwrap_or(0),
            "jobs_by_state": self.jobs_by_state,
            "process_starts": self.process_starts,
            "jobs_rerun": self.jobs_rerun,
            "service": {
                "changes": self.service_changes,
                "changes_answered": self.service_changes_answered,
                "replica_jobs": self.service_replica_jobs,
                "replica_process_starts": self.service_replica_starts,
            },
            "failover_ms": {"n": self.failover_ms.len(), "p50": num(p50), "p99": num(p99), "max": num(max)},
            "replica_changes": {
                "n": self.promotion_ms.len(),
                "leader_removals": self.leader_removals,
                "promotion_ms": self.promotion_ms,
                "removed_stop_ms": self.removed_stop_ms,
            },
            "replica_upgrades": {
                "n": self.upgrade_ms.len(),
                "caught_up_ms": self.upgrade_ms,
                "sigkilled": self.upgrades_sigkilled,
                "steps": self.upgrades,
            },
            "invariants": self.by_invariant.iter().map(|(n, v)| (n.to_string(), *v)).collect::<BTreeMap<_, _>>(),
            "violations": self.violations,
            "wall_s": self.wall_s,
        })
    }

    pub fn text(&self, report: &Report) -> String {
        let (p50, p99, max) = self.failover();
        let mut out = String::new();
        out.push_str("faults injected:\n");
        for (k, n) in &self.faults {
            out.push_str(&format!("  {k:<18} {n}\n"));
        }
        out.push_str(&format!(
            "operations: {} submissions acknowledged ({} re-sends answered with the same job), \
             {} refused, {} unknown; {} cancels\n",
            self.submits_ok,
            self.resends_same_job,
            self.submits_failed,
            self.submits_unknown,
            self.cancels
        ));
        out.push_str(&format!(
            "jobs: {} in the final state {:?}; {} workload processes started; {} jobs ran \
             again (requeued after a lost node)\n",
            self.jobs, self.jobs_by_state, self.process_starts, self.jobs_rerun
        ));
        out.push_str(&format!(
            "service: {} changes sent ({} answered; scale and rollout), {} replica jobs, {} \
             replica processes started (restarts in place included)\n",
            self.service_changes,
            self.service_changes_answered,
            self.service_replica_jobs,
            self.service_replica_starts
        ));
        out.push_str(&format!(
            "failover (leader fault -> first write committed via the new leader), {} \
             failovers: p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms\n",
            self.failover_ms.len()
        ));
        if !self.promotion_ms.is_empty() {
            out.push_str(&format!(
                "replica changes: {} ({} removed the leader); promotion to voter {:?} ms; \
                 removed replica stopped after {:?} ms\n",
                self.promotion_ms.len(),
                self.leader_removals,
                self.promotion_ms,
                self.removed_stop_ms
            ));
        }
        if !self.upgrade_ms.is_empty() {
            out.push_str(&format!(
                "replica upgrades: {} ({} needed SIGKILL); caught up after {:?} ms: {}\n",
                self.upgrade_ms.len(),
                self.upgrades_sigkilled,
                self.upgrade_ms,
                self.upgrades.join("; ")
            ));
        }
        out.push_str("invariants:\n");
        for i in &report.invariants {
            let verdict = if i.violations == 0 {
                "ok".to_owned()
            } else {
                format!("VIOLATED ({})", i.violations)
            };
            out.push_str(&format!("  {:<42} {verdict}\n", i.name));
            for e in &i.evidence {
                out.push_str(&format!("      {e}\n"));
            }
        }
        out.push_str(&format!("violations: {}\n", self.violations));
        out
    }
}
