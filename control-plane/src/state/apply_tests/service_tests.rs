//! Services in the state machine (`service_apply.rs`): replicas created and stopped as the
//! planner says, restarts in place with back-off, replacement after a lost node, rolling
//! updates within surge and availability, undo, scale-down, deletion and readiness, with the
//! fixtures of `apply_tests`. Every entry is followed by the consistency check, which also
//! checks each service's live copies against its replica jobs.

use super::*;
use crate::state::service::{Probe, ProbeCheck, RestartPolicy, RolloutStrategy};

/// Nodes that hand out ports, at cluster version 2.
fn fleet() -> Harness {
    let mut h = Harness::with_nodes([
        node("a1", 4, "A100").ports(20000, 20009),
        node("a2", 4, "A100").ports(20000, 20009),
        node("h1", 8, "H100").ports(21000, 21099),
    ]);
    assert_eq!(
        h.apply(Command::SetClusterVersion { version: 2 }).outcome,
        Outcome::Done
    );
    h
}

impl NodeBuilder {
    fn ports(mut self, first: u16, last: u16) -> Self {
        self.spec.service_ports = Some(PortRange { first, last });
        self
    }
}

fn web(replicas: u32) -> ServiceSpec {
    ServiceSpec {
        tenant: "ml".into(),
        name: "web".into(),
        template: ReplicaTemplate {
            job: JobSpec {
                tenant: "ml".into(),
                name: "web".into(),
                command: vec!["serve".into(), "--v1".into()],
                gpus_per_task: 1,
                tasks: 1,
                gpu_milli: 500,
                priority_class: DEFAULT_PRIORITY_CLASS.into(),
                ports: vec!["http".into()],
                ..JobSpec::default()
            },
            readiness: Some(Probe::new(ProbeCheck::Http {
                port: "http".into(),
                path: "/ready".into(),
            })),
            liveness: None,
        },
        replicas,
        strategy: RolloutStrategy::default(),
        restart: RestartPolicy::default(),
        autoscale: None,
    }
}

const KEY: &str = "ml/web";

impl Harness {
    fn put(&mut self, spec: ServiceSpec) -> Outcome {
        self.apply(Command::PutService {
            spec: Box::new(spec),
            create_only: false,
        })
        .outcome
    }

    fn service(&self) -> &Service {
        &self.state.services[KEY]
    }

    /// The live copies: ordinal → job.
    fn copies(&self) -> Vec<(Ordinal, JobId)> {
        self.service()
            .replicas
            .iter()
            .map(|(o, j)| (*o, *j))
            .collect()
    }

    /// Places every pending replica on the first GPU of `node` that takes it, starts it and
    /// reports it ready.
    fn bring_up(&mut self, node: &str) {
        let pending: Vec<JobId> = self
            .copies()
            .into_iter()
            .map(|(_, j)| j)
            .filter(|j| self.job(*j).state == JobState::Pending)
            .collect();
        for j in pending {
            let gpus = self.state.nodes[node].spec.gpus.len() as u32;
            let placed = (0..gpus).any(|g| {
                let p = placement(j, vec![task(node, &[g])]);
                if self.state.check_placement(&p, self.at).is_ok() {
                    self.place(j, p.tasks);
                    true
                } else {
                    false
                }
            });
            assert!(placed, "replica job {j} fits nowhere on {node}");
            let a = self.job(j).allocations[0];
            self.start(a);
            self.ready(a, true);
        }
    }

    fn ready(&mut self, allocation: AllocationId, ready: bool) {
        let applied = self.apply(Command::ReplicaReadiness {
            allocation,
            ready,
            reason: if ready {
                String::new()
            } else {
                "HTTP 503".into()
            },
        });
        assert_eq!(applied.outcome, Outcome::Done);
    }

    /// Reports the exit of every copy being stopped.
    fn finish_stops(&mut self) {
        let stopping: Vec<AllocationId> = self
            .state
            .allocations
            .values()
            .filter(|r| r.stop_requested)
            .map(|r| r.allocation.id)
            .collect();
        for a in stopping {
            self.exit(a, TaskOutcome::Stopped);
        }
    }

    fn ready_count(&self) -> usize {
        self.copies()
            .iter()
            .filter(|(_, j)| self.job(*j).replica.as_ref().is_some_and(|r| r.ready))
            .count()
    }
}

#[test]
fn a_new_service_creates_one_pending_replica_job_per_ordinal() {
    let mut h = fleet();
    assert_eq!(
        h.put(web(3)),
        Outcome::ServiceChanged {
            service: KEY.into(),
            revision: 1,
            created: true
        }
    );
    let copies = h.copies();
    assert_eq!(copies.iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1, 2]);
    for (ordinal, j) in copies {
        let job = h.job(j);
        assert_eq!(job.state, JobState::Pending);
        assert_eq!(job.spec.name, format!("web-{ordinal}"));
        let r = job.replica.as_ref().unwrap();
        assert_eq!(
            (r.service.as_str(), r.ordinal, r.revision),
            (KEY, ordinal, 1)
        );
    }
    assert_eq!(h.service().rollout, RolloutPhase::Progressing);
}

#[test]
fn a_service_is_refused_below_cluster_version_2_and_when_its_name_is_taken() {
    let mut h = Harness::with_nodes([node("a1", 4, "A100")]);
    let r = h.reject(Command::PutService {
        spec: Box::new(web(1)),
        create_only: false,
    });
    assert!(r.message.contains("cluster version 2"), "{r}");
    let mut h = fleet();
    h.put(web(1));
    let r = h.reject(Command::PutService {
        spec: Box::new(web(2)),
        create_only: true,
    });
    assert!(r.message.contains("already exists"), "{r}");
}

#[test]
fn replicas_get_ports_from_their_node_and_are_ready_only_when_reported() {
    let mut h = fleet();
    h.put(web(2));
    let j = h.copies()[0].1;
    let a = h.place(j, vec![task("a1", &[0])])[0];
    assert_eq!(h.alloc(a).allocation.ports, [20000]);
    h.start(a);
    assert!(
        !h.job(j).replica.as_ref().unwrap().ready,
        "running is not ready"
    );
    h.ready(a, true);
    assert!(h.job(j).replica.as_ref().unwrap().ready);
    // The other replica on the same node gets the next port.
    let j2 = h.copies()[1].1;
    let a2 = h.place(j2, vec![task("a1", &[0])])[0];
    assert_eq!(h.alloc(a2).allocation.ports, [20001]);
}

#[test]
fn a_node_without_ports_is_refused_for_a_replica_that_needs_one() {
    let mut h = fleet();
    h.register(node("plain", 4, "A100").spec());
    h.put(web(1));
    let j = h.copies()[0].1;
    let why = h.reject_plan(placement(j, vec![task("plain", &[0])]));
    assert!(why.contains("--service-ports"), "{why}");
}

#[test]
fn a_replica_that_exits_restarts_in_place_with_backoff_and_keeps_its_ordinal_and_port() {
    let mut h = fleet();
    h.put(web(1));
    h.bring_up("a1");
    let j = h.copies()[0].1;
    let first = h.job(j).allocations[0];
    let port = h.alloc(first).allocation.ports.clone();
    // First failure: restarted at once on the same GPU.
    h.exit(first, failed(1));
    let second = h.job(j).allocations[0];
    assert_ne!(first, second, "a new allocation: a new epoch");
    let rec = &h.alloc(second).allocation;
    assert_eq!(
        (rec.node.as_str(), rec.gpus.clone()),
        ("a1", vec![uuid("a1", 0)])
    );
    assert_eq!(rec.ports, port);
    assert_eq!(rec.start_after, None);
    assert_eq!(h.job(j).state, JobState::Scheduled);
    let r = h.job(j).replica.clone().unwrap();
    assert_eq!((r.restarts, r.failures, r.ready), (1, 1, false));
    assert_eq!(r.last_exit.as_deref(), Some("exit code 1, CUDA error"));
    // The second failure in a row waits out the back-off.
    h.start(second);
    h.exit(second, failed(1));
    let third = h.job(j).allocations[0];
    assert_eq!(h.alloc(third).allocation.start_after, Some(h.at + 1_000));
    assert_eq!(h.copies(), vec![(0, j)], "the same copy, the same ordinal");
}

#[test]
fn a_restart_in_place_carries_the_newest_plans_term_so_terms_never_go_down() {
    let mut h = fleet();
    h.put(web(1));
    h.bring_up("a1");
    let j = h.copies()[0].1;
    let first = h.job(j).allocations[0];
    assert_eq!(h.alloc(first).allocation.term, TERM);
    // A newer leader places a batch job meanwhile.
    let batch = h.submit(job(1).tenant("ml").spec());
    let newer = h.apply(Command::Place {
        term: TERM + 3,
        placements: vec![placement(batch, vec![task("h1", &[0])])],
    });
    assert!(matches!(newer.outcome, Outcome::Placed { .. }), "{newer:?}");
    h.exit(first, failed(1));
    let restarted = h.job(j).allocations[0];
    assert!(restarted > h.job(batch).allocations[0]);
    assert_eq!(
        h.alloc(restarted).allocation.term,
        TERM + 3,
        "a later allocation never carries an older term than an earlier one"
    );
}

#[test]
fn a_replica_failing_again_and_again_is_crash_looping_with_a_capped_backoff() {
    let mut h = fleet();
    let mut spec = web(1);
    spec.restart = RestartPolicy {
        backoff_initial_ms: 1_000,
        backoff_max_ms: 4_000,
        crash_loop_after: 3,
        reset_after_ms: 60_000,
    };
    h.put(spec);
    h.bring_up("a1");
    let j = h.copies()[0].1;
    for _ in 0..6 {
        let a = h.job(j).allocations[0];
        h.start(a);
        h.exit(a, failed(2));
    }
    let a = h.job(j).allocations[0];
    assert_eq!(h.alloc(a).allocation.start_after, Some(h.at + 4_000));
    let r = h.job(j).replica.clone().unwrap();
    assert_eq!(r.failures, 6);
    assert!(r.crash_looping(&h.service().spec.restart));
    assert!(
        h.job(j)
            .history
            .iter()
            .any(|c| c.reason.starts_with("CrashLoopBackOff")),
        "{:?}",
        h.job(j).history
    );
}

#[test]
fn a_replica_on_a_lost_node_is_placed_again_elsewhere_as_the_same_copy() {
    let mut h = fleet();
    h.put(web(1));
    h.bring_up("a1");
    let j = h.copies()[0].1;
    let a = h.job(j).allocations[0];
    let registered_at = h.state.nodes["a1"].registered_at;
    h.apply(Command::NodeLost {
        node: "a1".into(),
        reason: "lease expired".into(),
        registered_at,
    });
    assert!(!h.state.allocations.contains_key(&a));
    assert_eq!(h.job(j).state, JobState::Pending, "waits for the scheduler");
    assert_eq!(h.copies(), vec![(0, j)]);
    h.bring_up("a2");
    assert_eq!(h.alloc(h.job(j).allocations[0]).allocation.node, "a2");
}

#[test]
fn a_surge_rollout_keeps_every_replica_ready_and_never_exceeds_replicas_plus_surge() {
    let mut h = fleet();
    h.put(web(4));
    h.bring_up("h1");
    assert_eq!(h.service().rollout, RolloutPhase::Complete);
    let mut v2 = web(4);
    v2.template.job.command = vec!["serve".into(), "--v2".into()];
    assert_eq!(
        h.put(v2),
        Outcome::ServiceChanged {
            service: KEY.into(),
            revision: 2,
            created: false
        }
    );
    let mut rounds = 0;
    while h.service().rollout != RolloutPhase::Complete {
        rounds += 1;
        assert!(rounds < 20, "the rollout never completed");
        assert!(h.copies().len() <= 5, "more than replicas + surge");
        assert!(h.ready_count() >= 4, "a replica went unready");
        h.bring_up("h1");
        h.finish_stops();
    }
    for (_, j) in h.copies() {
        assert_eq!(h.job(j).replica.as_ref().unwrap().revision, 2);
        assert_eq!(h.job(j).spec.command[1], "--v2");
    }
    assert_eq!(h.copies().len(), 4);
}

#[test]
fn a_crash_looping_new_revision_pauses_the_rollout_and_undo_brings_back_the_old_one() {
    let mut h = fleet();
    let mut spec = web(2);
    spec.restart.crash_loop_after = 2;
    h.put(spec.clone());
    h.bring_up("h1");
    spec.template.job.command = vec!["serve".into(), "--broken".into()];
    h.put(spec);
    // The surge copy of revision 2 starts and keeps failing.
    let new = h
        .copies()
        .into_iter()
        .find(|(_, j)| h.job(*j).replica.as_ref().unwrap().revision == 2)
        .unwrap()
        .1;
    h.place(new, vec![task("h1", &[4])]);
    for _ in 0..2 {
        let a = h.job(new).allocations[0];
        h.start(a);
        h.exit(a, failed(1));
    }
    assert!(
        matches!(&h.service().rollout, RolloutPhase::Paused { reason } if reason.contains("crash-looping")),
        "{:?}",
        h.service().rollout
    );
    assert_eq!(h.ready_count(), 2, "the old replicas still serve");
    // Undo: back to revision 1; the broken copy is stopped, nothing else changes.
    let applied = h.apply(Command::ServiceRollout {
        service: KEY.into(),
        action: RolloutAction::Undo { to_revision: None },
    });
    assert!(matches!(
        applied.outcome,
        Outcome::ServiceChanged { revision: 1, .. }
    ));
    h.finish_stops();
    assert_eq!(h.service().rollout, RolloutPhase::Complete);
    assert!(
        h.copies()
            .iter()
            .all(|(_, j)| h.job(*j).spec.command[1] == "--v1")
    );
}

#[test]
fn scaling_down_stops_the_replica_whose_removal_frees_a_whole_gpu() {
    let mut h = fleet();
    h.put(web(3));
    // Two replicas share GPU 0 of a1, the third is alone on GPU 1.
    let copies = h.copies();
    for (i, (_, j)) in copies.iter().enumerate() {
        let gpu = if i < 2 { 0 } else { 1 };
        let a = h.place(*j, vec![task("a1", &[gpu])])[0];
        h.start(a);
        h.ready(a, true);
    }
    let alone = copies[2];
    let applied = h.apply(Command::ScaleService {
        service: KEY.into(),
        replicas: 2,
        reason: "test".into(),
    });
    assert!(matches!(applied.outcome, Outcome::ServiceChanged { .. }));
    assert_eq!(h.job(alone.1).state, JobState::Cancelled);
    h.finish_stops();
    assert!(!h.copies().contains(&alone));
    assert_eq!(h.copies().len(), 2);
    assert!(
        h.service()
            .events
            .iter()
            .any(|e| e.message.contains("scaled from 3 to 2"))
    );
}

#[test]
fn deleting_a_service_stops_its_replicas_and_then_forgets_it() {
    let mut h = fleet();
    h.put(web(2));
    h.bring_up("a1");
    h.apply(Command::DeleteService {
        service: KEY.into(),
    });
    assert!(h.service().deleting);
    h.finish_stops();
    assert!(!h.state.services.contains_key(KEY));
    let r = h.reject(Command::ScaleService {
        service: KEY.into(),
        replicas: 3,
        reason: String::new(),
    });
    assert_eq!(r.kind, RejectKind::NotFound);
}

#[test]
fn a_cancelled_replica_is_replaced_at_its_ordinal_once_it_has_stopped() {
    let mut h = fleet();
    let mut spec = web(2);
    spec.strategy.max_surge = 0;
    spec.strategy.max_unavailable = 1;
    h.put(spec);
    h.bring_up("a1");
    let (ordinal, j) = h.copies()[0];
    h.apply(Command::cancel(j, "by hand"));
    assert_eq!(
        h.copies()[0],
        (ordinal, j),
        "the ordinal is held until it stops"
    );
    assert_eq!(h.copies().len(), 2, "no surge: the replacement waits");
    h.finish_stops();
    let (o2, j2) = h.copies()[0];
    assert_eq!(o2, ordinal);
    assert_ne!(j2, j);
}

#[test]
fn with_surge_a_cancelled_replica_is_replaced_at_once_under_a_new_ordinal() {
    let mut h = fleet();
    h.put(web(2));
    h.bring_up("a1");
    let (_, j) = h.copies()[0];
    h.apply(Command::cancel(j, "by hand"));
    let ordinals: Vec<Ordinal> = h.copies().iter().map(|c| c.0).collect();
    assert_eq!(ordinals, [0, 1, 2], "ordinal 0 stops while 2 starts");
    h.finish_stops();
    let ordinals: Vec<Ordinal> = h.copies().iter().map(|c| c.0).collect();
    assert_eq!(ordinals, [1, 2]);
}

#[test]
fn a_replica_job_is_changed_through_its_service_not_by_hold_or_update() {
    let mut h = fleet();
    h.put(web(1));
    let j = h.copies()[0].1;
    let r = h.reject(Command::ChangeJobs {
        jobs: vec![j],
        change: JobChange::Hold,
    });
    assert!(r.message.contains("change the service"), "{r}");
}

#[test]
fn readiness_from_a_replica_that_is_not_running_changes_nothing() {
    let mut h = fleet();
    h.put(web(1));
    let j = h.copies()[0].1;
    let a = h.place(j, vec![task("a1", &[0])])[0];
    h.ready(a, true);
    assert!(
        !h.job(j).replica.as_ref().unwrap().ready,
        "scheduled, not running"
    );
}

#[test]
fn a_pause_stops_the_rollout_and_a_resume_finishes_it() {
    let mut h = fleet();
    h.put(web(2));
    h.bring_up("h1");
    h.apply(Command::ServiceRollout {
        service: KEY.into(),
        action: RolloutAction::Pause {
            reason: String::new(),
        },
    });
    let mut v2 = web(2);
    v2.template.job.command[1] = "--v2".into();
    h.put(v2);
    h.bring_up("h1");
    h.finish_stops();
    assert!(
        h.copies()
            .iter()
            .all(|(_, j)| h.job(*j).replica.as_ref().unwrap().revision == 1),
        "paused: nothing replaced"
    );
    h.apply(Command::ServiceRollout {
        service: KEY.into(),
        action: RolloutAction::Resume,
    });
    for _ in 0..10 {
        h.bring_up("h1");
        h.finish_stops();
    }
    assert_eq!(h.service().rollout, RolloutPhase::Complete);
}

#[test]
fn a_service_survives_a_snapshot_round_trip() {
    let mut h = fleet();
    h.put(web(2));
    h.bring_up("a1");
    let json = serde_json::to_vec(&h.state).unwrap();
    let mut back: ClusterState = serde_json::from_slice(&json).unwrap();
    back.rebuild_indexes();
    back.check_consistency().unwrap();
    assert_eq!(back.services, h.state.services);
}
