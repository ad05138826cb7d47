//! Levels read off the replicated state when scraped: queue depth, nodes, GPUs, fragmentation.
//! Pure (a `&ClusterState` in, counts out), so apply pays nothing for them and every replica,
//! leader or not, reports the same numbers for the same applied index.

use std::collections::BTreeMap;

use crate::state::{ClusterState, GpuHealth, JobState, NodeStatus};

/// What one scrape reports about the state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Levels {
    /// (state, tenant, partition) → jobs, for the states that are queue depth: pending,
    /// scheduled, running. Partition "" is the default (none named).
    pub jobs: BTreeMap<(&'static str, String, String), u64>,
    /// Pending jobs by why they wait, once the scheduler says (see [`pending_reasons`]).
    pub pending_by_reason: Option<BTreeMap<String, u64>>,
    /// Node status → nodes.
    pub nodes: BTreeMap<&'static str, u64>,
    /// (GPU model, allocated | idle | unhealthy | unavailable) → GPUs.
    pub gpus: BTreeMap<(String, &'static str), u64>,
    /// Free GPU capacity on ready nodes, in GPUs (shares count as fractions).
    pub free_gpus: f64,
    /// Of that, what the expected workload could not use (FGD's measure, `scheduler::frag`).
    pub fragmented_gpus: f64,
    /// Per service (`tenant/name`): its replicas and rollout, see [`ServiceLevels`].
    pub services: BTreeMap<String, ServiceLevels>,
}

/// One service's replicas as a scrape reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceLevels {
    pub desired: u64,
    /// Live copies (placed, pending or stopping).
    pub live: u64,
    pub ready: u64,
    /// Live copies running the current revision.
    pub updated: u64,
    pub crash_looping: u64,
    /// Restarts of its live copies, summed (each copy counts from its creation).
    pub restarts: u64,
    /// 1 while its rollout is paused.
    pub paused: bool,
}

/// Every service's levels, from its live copies (a few per service: no job scan).
pub fn service_levels(state: &ClusterState) -> BTreeMap<String, ServiceLevels> {
    state
        .services
        .iter()
        .map(|(key, s)| {
            let mut l = ServiceLevels {
                desired: u64::from(s.spec.replicas),
                paused: matches!(s.rollout, crate::state::RolloutPhase::Paused { .. }),
                ..Default::default()
            };
            for job in s.replicas.values().filter_map(|j| state.jobs.get(j)) {
                let Some(r) = &job.replica else { continue };
                l.live += 1;
                l.ready += u64::from(r.ready);
                l.updated += u64::from(r.revision == s.revision && !job.state.is_final());
                l.crash_looping += u64::from(r.crash_looping(&s.spec.restart));
                l.restarts += u64::from(r.restarts);
            }
            (key.clone(), l)
        })
        .collect()
}

pub fn levels(state: &ClusterState) -> Levels {
    let mut l = Levels::default();
    // The pending index and the live allocations, not every job record (a million finished
    // jobs would otherwise be walked on every scrape); counted under borrowed names, owned once
    // per distinct key, so a long queue costs no allocation per job.
    let mut jobs: BTreeMap<(&'static str, &str, &str), u64> = BTreeMap::new();
    for job in state.pending_jobs().chain(state.jobs_with_allocations()) {
        let s = match job.state {
            JobState::Pending => "pending",
            JobState::Scheduled => "scheduled",
            JobState::Running => "running",
            _ => continue,
        };
        let partition = job.spec.partition.as_deref().unwrap_or("");
        *jobs.entry((s, &job.spec.tenant, partition)).or_default() += 1;
    }
    l.jobs = jobs
        .into_iter()
        .map(|((s, t, p), n)| ((s, t.to_owned(), p.to_owned()), n))
        .collect();
    l.pending_by_reason = pending_reasons(state);
    for n in state.nodes.values() {
        *l.nodes.entry(n.status.as_str()).or_default() += 1;
        for g in &n.spec.gpus {
            let held = state.gpu_holder.contains_key(&g.uuid)
                || state
                    .index
                    .gpu_shares
                    .get(&g.uuid)
                    .is_some_and(|s| !s.allocations.is_empty())
                || g.mig.iter().any(|m| state.gpu_holder.contains_key(&m.uuid));
            let what = if matches!(g.health, GpuHealth::Unhealthy { .. }) {
                "unhealthy"
            } else if held {
                "allocated"
            } else if n.status != NodeStatus::Ready || n.drained {
                // Free, but on a node that takes no work: not capacity the queue can use.
                "unavailable"
            } else {
                "idle"
            };
            *l.gpus.entry((g.model.clone(), what)).or_default() += 1;
        }
    }
    let (free, fragmented) = crate::scheduler::fleet_fragmentation(state);
    l.free_gpus = free;
    l.fragmented_gpus = fragmented;
    l.services = service_levels(state);
    l
}

/// Pending reasons live on the leader's scheduling board, not in the replicated state: the
/// scrape fills them in from it (`http.rs`, [`pending_by_reason`]).
pub fn pending_reasons(_state: &ClusterState) -> Option<BTreeMap<String, u64>> {
    None
}

/// Pending jobs the leader's last pass looked at, by the kind of reason they wait for
/// (`gpucp_jobs_pending_by_reason{reason}`): bounded labels, never a job's own words.
pub fn pending_by_reason(board: &crate::scheduler::Board) -> BTreeMap<String, u64> {
    use crate::scheduler::reasons::Why;
    let mut by = BTreeMap::new();
    for why in board.by_job.values() {
        let label = match why {
            Why::Resources => "Resources",
            Why::Priority { .. } => "Priority",
            Why::Reservation { .. } => "Reservation",
            Why::Quota { .. } => "QuotaExceeded",
            Why::Unfit => "Unfit",
            Why::ArrayLimit { .. } => "JobArrayTaskLimit",
            Why::NodeRules => "NodeRules",
        };
        *by.entry(label.to_owned()).or_default() += 1;
    }
    by
}

/// A bounded label for why apply refused a placement of a plan (apply's free-text reasons
/// carry job, node and GPU names, which would make a series per job).
pub fn rejection_reason(reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    if r.contains("already held") || r.contains("placed twice") {
        "gpu_held"
    } else if r.contains("unhealthy") {
        "gpu_unhealthy"
    } else if r.contains("not pending") || r.contains("already ended") {
        "job_not_pending"
    } else if r.contains("does not exist") || r.contains("is not on node") {
        "missing"
    } else if r.contains("partition") {
        "partition"
    } else if r.contains("node ") && (r.contains(" is down") || r.contains(" is drained")) {
        "node_not_ready"
    } else if r.contains("quota") || r.contains("limit") {
        "quota"
    } else if r.contains("memory") || r.contains("cpu") || r.contains("share") {
        "resources"
    } else {
        "other"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;

    #[test]
    fn rejection_reasons_are_a_small_set() {
        for (text, want) in [
            ("GPU GPU-1 is already held by allocation 7", "gpu_held"),
            ("GPU GPU-1 is placed twice in one plan", "gpu_held"),
            ("GPU GPU-3 is unhealthy", "gpu_unhealthy"),
            ("job 4 is running, not pending", "job_not_pending"),
            ("node n9 does not exist", "missing"),
            ("node n1 is down", "node_not_ready"),
            ("node n1 is not in partition a", "partition"),
            ("something new", "other"),
        ] {
            assert_eq!(rejection_reason(text), want, "{text}");
        }
    }

    /// One DGX H100 (8 GPUs), three 2-GPU jobs of one tenant and then an 8-GPU job that cannot fit
    /// once they run; the plan placed and applied.
    #[test]
    fn queue_depth_nodes_gpus_and_fragmentation_follow_the_state() {
        use crate::synthetic::{Driver, job_spec, node_from_preset, submit_all};
        let mut d = Driver::new(1_000);
        let spec = node_from_preset("dgx-h100", "n1", None, BTreeMap::new()).unwrap();
        assert_eq!(
            d.apply(&Command::RegisterNode { spec }),
            crate::state::Outcome::NodeRegistered
        );
        d.apply(&Command::PutTenant {
            tenant: crate::state::Tenant {
                name: "t0".into(),
                weight: 1,
                quota_gpus: 8,
                max_gpus: 0,
            },
        });
        let idle = levels(&d.state);
        assert_eq!(idle.nodes.get("ready"), Some(&1));
        assert_eq!(idle.gpus.values().sum::<u64>(), 8);
        assert!(idle.gpus.keys().all(|(_, s)| *s == "idle"), "{idle:?}");
        assert_eq!(idle.free_gpus, 8.0);
        assert!(idle.jobs.is_empty());
        assert_eq!(idle.pending_by_reason, None);

        let jobs: Vec<_> = (0..3)
            .map(|i| job_spec(i, 0, (2, 1, 0), "normal", 600))
            .chain([job_spec(3, 0, (8, 1, 0), "normal", 600)])
            .collect();
        submit_all(&mut d, &jobs).unwrap();
        let queued = levels(&d.state);
        assert_eq!(
            queued.jobs.get(&("pending", "t0".into(), String::new())),
            Some(&4)
        );

        let plan = crate::scheduler::plan(&d.state, d.now);
        assert_eq!(plan.placements.len(), 3, "{plan:?}");
        d.apply(&Command::Place {
            term: 1,
            placements: plan.placements,
        });
        let placed = levels(&d.state);
        assert_eq!(
            placed.jobs.get(&("scheduled", "t0".into(), String::new())),
            Some(&3)
        );
        assert_eq!(
            placed.jobs.get(&("pending", "t0".into(), String::new())),
            Some(&1)
        );
        let by = |what| {
            placed
                .gpus
                .iter()
                .filter(|((_, s), _)| *s == what)
                .map(|(_, n)| n)
                .sum::<u64>()
        };
        assert_eq!((by("allocated"), by("idle")), (6, 2));
        assert_eq!(placed.free_gpus, 2.0);
        // The 8-GPU job in the expected workload cannot use the 2 GPUs left.
        assert!(
            placed.fragmented_gpus > 0.0 && placed.fragmented_gpus <= 2.0,
            "{placed:?}"
        );
    }

    /// A service's replicas as a scrape counts them: desired, live, placed-and-ready.
    #[test]
    fn service_levels_count_desired_live_and_ready_replicas() {
        use crate::state::{ReplicaTemplate, RestartPolicy, RolloutStrategy, ServiceSpec};
        use crate::synthetic::{Driver, node_from_preset};
        let mut d = Driver::new(1_000);
        d.apply(&Command::SetClusterVersion { version: 2 });
        let spec = node_from_preset("dgx-h100", "n1", None, BTreeMap::new()).unwrap();
        d.apply(&Command::RegisterNode { spec });
        let template = crate::state::JobSpec {
            tenant: "t0".into(),
            name: "web".into(),
            command: vec!["serve".into()],
            gpus_per_task: 1,
            tasks: 1,
            priority_class: "normal".into(),
            ..Default::default()
        };
        d.apply(&Command::PutService {
            spec: Box::new(ServiceSpec {
                tenant: "t0".into(),
                name: "web".into(),
                template: ReplicaTemplate {
                    job: template,
                    readiness: None,
                    liveness: None,
                },
                replicas: 2,
                strategy: RolloutStrategy::default(),
                restart: RestartPolicy::default(),
                autoscale: None,
            }),
            create_only: true,
        });
        let plan = crate::scheduler::plan(&d.state, d.now);
        d.apply(&Command::Place {
            term: 1,
            placements: plan.placements,
        });
        let first = d.state.services["t0/web"].replicas[&0];
        let allocation = d.state.jobs[&first].allocations[0];
        d.apply(&Command::AllocationStarted { allocation });
        let l = &levels(&d.state).services["t0/web"];
        assert_eq!((l.desired, l.live, l.ready, l.updated), (2, 2, 1, 2));
        assert!(!l.paused);
    }
}
