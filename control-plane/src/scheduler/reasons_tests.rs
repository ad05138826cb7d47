//! Table tests of admission (`capacity::never_fits`, `admission_refusal`), the per-node
//! diagnosis, the reasons a pass records (`plan_explained`) and their text (`reasons`).

use std::collections::BTreeMap;

use super::capacity::{self, Filter, NeverFits};
use super::placement::Shape;
use super::reasons::{self, Board, ShapeMemo, Why};
use super::*;
use crate::state::{
    Command, ContainerSpec, Dependency, DependencyKind, Gpu, GpuHealth, JobSpec, MigSlice,
    NodeSpec, NodeStatus, Outcome, Tenant,
};

struct World {
    state: ClusterState,
    index: u64,
}

impl World {
    fn new() -> World {
        let mut w = World {
            state: ClusterState::default(),
            index: 0,
        };
        // Format 2: `hold_if_unfit` and containers.
        assert_eq!(
            w.apply(Command::SetClusterVersion { version: 2 }),
            Outcome::Done
        );
        w
    }

    fn apply(&mut self, c: Command) -> Outcome {
        self.index += 1;
        self.state.apply(&c, self.now(), self.index).outcome
    }

    fn now(&self) -> u64 {
        1_000_000 + self.index
    }

    fn node_spec(name: &str, gpus: u32) -> NodeSpec {
        NodeSpec {
            agent_release: String::new(),
            enforcement: String::new(),
            container_runtime: String::new(),
            service_ports: None,
            name: name.into(),
            gpus: (0..gpus)
                .map(|i| Gpu {
                    uuid: format!("{name}-gpu{i}"),
                    index: i,
                    model: "H100".into(),
                    memory_mib: 81_920,
                    numa_node: None,
                    pci_bus_id: String::new(),
                    health: GpuHealth::Healthy,
                    mig: Vec::new(),
                })
                .collect(),
            cpu_milli: 64_000,
            memory_mib: 512 * 1024,
            partition: None,
            labels: BTreeMap::new(),
            topology: Vec::new(),
            agent_address: String::new(),
            driver: String::new(),
            incarnation: String::new(),
        }
    }

    fn register(&mut self, spec: NodeSpec) {
        assert_eq!(
            self.apply(Command::RegisterNode { spec }),
            Outcome::NodeRegistered
        );
    }

    fn node(&mut self, name: &str, gpus: u32) {
        self.register(World::node_spec(name, gpus));
    }

    fn submit(&mut self, spec: JobSpec) -> u64 {
        match self.apply(Command::submit(spec, None)) {
            Outcome::JobSubmitted { id, .. } => id,
            other => panic!("submit refused: {other:?}"),
        }
    }

    /// Plans with reasons and commits the placements, as the leader does.
    fn pass(&mut self) -> (Plan, ReasonLog) {
        let (plan, _, log) = plan_explained(&self.state, self.now(), &Policy::default());
        if !plan.placements.is_empty() {
            let outcome = self.apply(Command::Place {
                term: 1,
                placements: plan.placements.clone(),
            });
            assert!(matches!(outcome, Outcome::Placed { ref rejected, .. } if rejected.is_empty()));
        }
        (plan, log)
    }

    fn board(&self, log: ReasonLog) -> Board {
        Board::new(1, self.now(), log, Policy::default().max_jobs_per_pass)
    }

    fn reason(&self, board: Option<&Board>, id: u64) -> String {
        let job = self.state.job(id).expect("job");
        reasons::explain(
            &self.state,
            board,
            job,
            self.now(),
            &mut ShapeMemo::default(),
        )
    }
}

fn job(gpus: u32) -> JobSpec {
    JobSpec {
        tenant: "t".into(),
        command: vec!["train".into()],
        gpus_per_task: gpus,
        tasks: 1,
        priority_class: "normal".into(),
        ..JobSpec::default()
    }
}

fn two_hosts() -> World {
    let mut w = World::new();
    w.node("n1", 8);
    w.node("n2", 8);
    w
}

fn never(w: &World, spec: &JobSpec) -> Option<NeverFits> {
    capacity::never_fits(w.state.nodes.values(), &Shape::of(spec), spec.tasks)
}

fn refusal(w: &World, spec: &JobSpec) -> Option<String> {
    capacity::admission_refusal(&w.state, spec).map(|r| r.to_string())
}

// --- admission: could the cluster ever hold it? ---

#[test]
fn three_tasks_of_eight_gpus_never_fit_two_eight_gpu_hosts() {
    let w = two_hosts();
    let spec = JobSpec { tasks: 3, ..job(8) };
    let n = never(&w, &spec).expect("unfit");
    assert!(
        matches!(
            n,
            NeverFits::Unfit {
                at_most: 2,
                nodes: 2,
                ..
            }
        ),
        "{n:?}"
    );
    let msg = refusal(&w, &spec).expect("refused");
    assert!(
        msg.starts_with("resources: Unfit: its 3 tasks of 8 GPUs"),
        "{msg}"
    );
    assert!(msg.contains("can hold at most 2 such tasks"), "{msg}");
    assert!(msg.contains("--hold-if-unfit"), "{msg}");
}

#[test]
fn two_tasks_of_eight_gpus_fit_two_hosts_and_two_of_four_fit_one() {
    let w = two_hosts();
    assert_eq!(never(&w, &JobSpec { tasks: 2, ..job(8) }), None);
    let mut one = World::new();
    one.node("n1", 8);
    assert_eq!(never(&one, &JobSpec { tasks: 2, ..job(4) }), None);
    assert!(never(&one, &JobSpec { tasks: 3, ..job(4) }).is_some());
}

#[test]
fn a_billion_cpus_never_fit() {
    let w = two_hosts();
    let spec = JobSpec {
        cpu_milli_per_task: 1_000_000_000_000,
        ..job(1)
    };
    match never(&w, &spec) {
        Some(NeverFits::Unfit {
            at_most: 0, counts, ..
        }) => assert_eq!(counts, BTreeMap::from([(Filter::TooFewCpus, 2)])),
        other => panic!("{other:?}"),
    }
    let msg = refusal(&w, &spec).unwrap();
    assert!(msg.contains("0/2 nodes: 2 too few CPUs"), "{msg}");
    assert!(msg.contains("the largest node has 64 CPUs"), "{msg}");
}

#[test]
fn memory_beyond_any_node_never_fits() {
    let w = two_hosts();
    let spec = JobSpec {
        memory_mib_per_task: 99_999_999 * 1024 * 1024,
        ..job(1)
    };
    let msg = refusal(&w, &spec).unwrap();
    assert!(msg.contains("2 too little memory"), "{msg}");
    assert!(
        msg.contains("the largest node has 524288 MiB of memory"),
        "{msg}"
    );
}

#[test]
fn an_empty_partition_is_partition_empty() {
    let mut w = two_hosts();
    let mut spec = World::node_spec("p1", 8);
    spec.partition = Some("big".into());
    w.register(spec);
    let job = JobSpec {
        partition: Some("small".into()),
        ..job(1)
    };
    assert_eq!(
        never(&w, &job),
        Some(NeverFits::PartitionEmpty {
            partition: "small".into()
        })
    );
    let msg = refusal(&w, &job).unwrap();
    assert!(
        msg.starts_with("partition: PartitionEmpty: partition small has no nodes"),
        "{msg}"
    );
    // A partition that has a node is fine.
    let ok = JobSpec {
        partition: Some("big".into()),
        ..job
    };
    assert_eq!(never(&w, &ok), None);
}

#[test]
fn a_container_job_needs_a_node_with_an_engine() {
    let mut w = two_hosts();
    let spec = JobSpec {
        container: Some(ContainerSpec {
            image: "trainer:1".into(),
            mounts: Vec::new(),
        }),
        ..job(1)
    };
    let msg = refusal(&w, &spec).unwrap();
    assert!(msg.contains("2 no container engine"), "{msg}");
    let mut engine = World::node_spec("c1", 1);
    engine.container_runtime = "docker 24".into();
    w.register(engine);
    assert_eq!(refusal(&w, &spec), None);
}

#[test]
fn models_and_mig_profiles_are_filters() {
    let mut w = two_hosts();
    let a100 = JobSpec {
        gpu_models: vec!["A100".into()],
        ..job(1)
    };
    assert!(refusal(&w, &a100).unwrap().contains("2 other GPU model"));
    let mig = JobSpec {
        mig_profile: Some("1g.10gb".into()),
        ..job(2)
    };
    assert!(refusal(&w, &mig).unwrap().contains("2 no such MIG profile"));
    let mut m = World::node_spec("m1", 1);
    m.gpus[0].mig = vec![MigSlice {
        uuid: "MIG-1".into(),
        profile: "1g.10gb".into(),
        memory_mib: 10_000,
    }];
    w.register(m);
    // One slice of the profile; the task asks for two.
    let r = refusal(&w, &mig).unwrap();
    assert!(r.contains("1 too few GPUs"), "{r}");
    assert_eq!(
        refusal(
            &w,
            &JobSpec {
                gpus_per_task: 1,
                ..mig
            }
        ),
        None
    );
}

#[test]
fn a_share_bigger_than_any_gpu_memory_never_fits() {
    let w = two_hosts();
    let spec = JobSpec {
        gpu_milli: 500,
        gpu_memory_mib: 100_000,
        ..job(1)
    };
    assert!(
        refusal(&w, &spec)
            .unwrap()
            .contains("2 too little GPU memory")
    );
    let ok = JobSpec {
        gpu_memory_mib: 40_000,
        ..spec
    };
    assert_eq!(refusal(&w, &ok), None);
}

#[test]
fn held_if_unfit_no_nodes_and_down_nodes_are_not_refused() {
    let mut w = two_hosts();
    let held = JobSpec {
        tasks: 3,
        hold_if_unfit: true,
        ..job(8)
    };
    assert_eq!(refusal(&w, &held), None);
    assert!(never(&w, &held).is_some());
    assert_eq!(
        refusal(&World::new(), &JobSpec { tasks: 3, ..job(8) }),
        None
    );
    // A node that is down may come back: it still counts.
    w.node("n3", 8);
    w.apply(Command::SetNodeStatus {
        node: "n3".into(),
        status: NodeStatus::Down,
        evict: false,
        reason: String::new(),
    });
    assert_eq!(never(&w, &JobSpec { tasks: 3, ..job(8) }), None);
}

#[test]
fn nine_gpus_stay_refused_at_apply_as_before_unless_held() {
    let mut w = two_hosts();
    match w.apply(Command::submit(job(9), None)) {
        Outcome::Rejected(r) => assert!(
            r.to_string()
                .contains("9 GPUs per task, but the largest node has 8"),
            "{r}"
        ),
        other => panic!("{other:?}"),
    }
    let id = w.submit(JobSpec {
        hold_if_unfit: true,
        ..job(9)
    });
    assert_eq!(
        w.reason(None, id),
        "Unfit: no node can ever hold a task of 9 GPUs (0/2 nodes: 2 too few GPUs; the \
         largest node has 8 GPUs)"
    );
}

#[test]
fn hold_if_unfit_needs_cluster_version_2() {
    let mut state = ClusterState::default();
    let c = Command::submit(
        JobSpec {
            hold_if_unfit: true,
            ..job(1)
        },
        None,
    );
    assert_eq!(c.introduced_in(), 2);
    match state.apply(&c, 1, 1).outcome {
        Outcome::Rejected(r) => assert!(r.message.contains("needs cluster version 2"), "{r}"),
        other => panic!("{other:?}"),
    }
}

// --- diagnosis: why not now ---

#[test]
fn busy_gpus_are_counted_per_node() {
    let mut w = two_hosts();
    w.submit(job(8));
    w.submit(job(8));
    let blocked = w.submit(job(8));
    let (_, log) = w.pass();
    assert_eq!(log.jobs, vec![(blocked, Why::Resources)]);
    assert_eq!(log.head, Some(blocked));
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), blocked),
        "Resources: 0/2 nodes have 8 free GPUs (2 GPUs busy)"
    );
}

#[test]
fn drained_down_and_unhealthy_nodes_say_node_unhealthy() {
    let mut w = World::new();
    w.node("a", 8);
    w.node("b", 8);
    let mut sick = World::node_spec("c", 8);
    sick.gpus[0].health = GpuHealth::Unhealthy {
        reason: "Xid 79".into(),
    };
    w.register(sick);
    w.apply(Command::SetNodeStatus {
        node: "a".into(),
        status: NodeStatus::Drained,
        evict: false,
        reason: String::new(),
    });
    w.apply(Command::SetNodeStatus {
        node: "b".into(),
        status: NodeStatus::Down,
        evict: false,
        reason: String::new(),
    });
    let id = w.submit(job(8));
    let (plan, log) = w.pass();
    assert!(plan.placements.is_empty());
    let d = capacity::diagnose(&w.state, &Shape::of(&job(8)), 1);
    assert_eq!(
        d.counts,
        BTreeMap::from([
            (Filter::Down, 1),
            (Filter::Drained, 1),
            (Filter::Unhealthy, 1)
        ])
    );
    assert!(d.only_unhealthy());
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), id),
        "NodeUnhealthy: 0/3 nodes have 8 free GPUs (1 down, 1 draining, 1 unhealthy GPUs)"
    );
}

#[test]
fn cpu_and_memory_in_use_are_their_own_filters() {
    let mut w = World::new();
    w.node("a", 8);
    w.node("b", 8);
    let cpu = JobSpec {
        cpu_milli_per_task: 60_000,
        ..job(1)
    };
    let mem = JobSpec {
        memory_mib_per_task: 500 * 1024,
        ..job(1)
    };
    w.submit(cpu.clone());
    w.submit(mem.clone());
    w.pass();
    let d = capacity::diagnose(&w.state, &Shape::of(&cpu), 1);
    assert_eq!(d.nodes_with_room, 1);
    assert_eq!(d.counts, BTreeMap::from([(Filter::CpusBusy, 1)]));
    let d = capacity::diagnose(&w.state, &Shape::of(&mem), 2);
    assert_eq!(d.counts, BTreeMap::from([(Filter::MemoryBusy, 1)]));
    assert_eq!(
        d.text(&Shape::of(&mem), 2),
        "1/2 nodes have 1 free GPUs, room for 1 of its 2 tasks (1 memory busy)"
    );
}

#[test]
fn the_closest_node_names_what_holds_it_and_when_it_ends() {
    let mut w = World::new();
    w.node("n1", 8);
    w.node("n2", 8);
    w.submit(JobSpec {
        time_limit_secs: Some(3000),
        ..job(2)
    });
    w.submit(job(8));
    let (_, log) = w.pass();
    let blocked = w.submit(job(8));
    let (_, log2) = w.pass();
    assert!(log.jobs.is_empty());
    let board = w.board(log2);
    let job = w.state.job(blocked).unwrap().clone();
    let lines = reasons::why_lines(&w.state, Some(&board), &job, w.now());
    assert_eq!(
        lines[0],
        "Resources: 0/2 nodes have 8 free GPUs (2 GPUs busy)"
    );
    assert_eq!(lines[1], "needs 8 GPUs on one node");
    assert!(lines[3].starts_with("closest node n"), "{lines:?}");
    assert!(lines[3].contains("6 free of 8 GPUs"), "{lines:?}");
    assert!(
        lines[3].contains("2 held by job 1 (ends in ≤ 50m)"),
        "{lines:?}"
    );
}

// --- what a pass records ---

#[test]
fn a_job_behind_the_blocked_head_waits_for_priority() {
    let mut w = two_hosts();
    w.submit(job(8));
    w.submit(job(8));
    w.pass();
    let head = w.submit(JobSpec {
        priority_class: "high".into(),
        ..job(8)
    });
    let behind = w.submit(job(8));
    let (_, log) = w.pass();
    assert_eq!(
        log.jobs,
        vec![
            (head, Why::Resources),
            (behind, Why::Priority { behind: head })
        ]
    );
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), behind),
        format!("Priority: behind job {head}")
    );
}

#[test]
fn room_kept_for_the_reservation_says_reservation() {
    let mut w = World::new();
    w.node("n1", 8);
    // 4 GPUs busy for an hour; the head needs all 8: reserved on n1.
    w.submit(JobSpec {
        time_limit_secs: Some(3600),
        ..job(4)
    });
    w.pass();
    let head = w.submit(job(8));
    // Fits in the 4 free GPUs now, but runs past the reservation's start.
    let long = w.submit(JobSpec {
        time_limit_secs: Some(7200),
        ..job(4)
    });
    let (plan, log) = w.pass();
    assert!(plan.placements.is_empty());
    assert_eq!(plan.reservation.as_ref().map(|r| r.job), Some(head));
    assert_eq!(
        log.jobs,
        vec![
            (head, Why::Resources),
            (long, Why::Reservation { for_job: head })
        ]
    );
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), long),
        format!("Reservation for job {head}")
    );
}

#[test]
fn a_tenant_at_its_limit_says_quota_exceeded() {
    let mut w = two_hosts();
    w.apply(Command::PutTenant {
        tenant: Tenant {
            name: "vision".into(),
            weight: 1,
            quota_gpus: 4,
            max_gpus: 8,
        },
    });
    let vision = |gpus| JobSpec {
        tenant: "vision".into(),
        ..job(gpus)
    };
    w.submit(vision(8));
    w.pass();
    let over = w.submit(vision(2));
    let (_, log) = w.pass();
    assert_eq!(
        log.jobs,
        vec![(
            over,
            Why::Quota {
                held_milli: 8000,
                max_gpus: 8
            }
        )]
    );
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), over),
        "QuotaExceeded: tenant vision at 8/8 GPUs, the job needs 2 more"
    );
    let job = w.state.job(over).unwrap().clone();
    let lines = reasons::why_lines(&w.state, Some(&board), &job, w.now());
    assert!(
        lines
            .last()
            .unwrap()
            .contains("runs once tenant vision holds at most 6 GPUs"),
        "{lines:?}"
    );
}

#[test]
fn an_unfit_held_job_does_not_take_the_head_and_runs_once_a_node_fits() {
    let mut w = two_hosts();
    w.submit(JobSpec {
        time_limit_secs: Some(600),
        ..job(8)
    });
    w.pass();
    let held = w.submit(JobSpec {
        tasks: 3,
        hold_if_unfit: true,
        ..job(8)
    });
    let big = w.submit(JobSpec { tasks: 2, ..job(8) });
    let (plan, log) = w.pass();
    assert_eq!(log.jobs, vec![(held, Why::Unfit), (big, Why::Resources)]);
    assert_eq!(log.head, Some(big));
    assert_eq!(plan.reservation.map(|r| r.job), Some(big));
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), held),
        "Unfit: its 3 tasks of 8 GPUs need more than the cluster has: its 2 nodes can hold at \
         most 2 such tasks at once"
    );
    // Two more hosts join: the held job fits the cluster and runs.
    w.node("n3", 8);
    w.node("n4", 8);
    let (plan, _) = w.pass();
    let placed: Vec<u64> = plan.placements.iter().map(|p| p.job).collect();
    assert!(placed.contains(&held), "{placed:?}");
}

#[test]
fn dependencies_and_no_pass_and_non_pending_jobs() {
    let mut w = two_hosts();
    let first = w.submit(job(8));
    let second = w.submit(JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterOk,
            job: first,
        }],
        ..job(1)
    });
    assert_eq!(
        w.reason(None, second),
        format!("Dependency: waiting for job {first}")
    );
    let other = w.submit(job(1));
    assert_eq!(
        w.reason(None, other),
        "Pending: no scheduling pass yet on this leader"
    );
    w.pass();
    assert_eq!(w.reason(None, first), "");
}

#[test]
fn no_ready_node_and_no_node_at_all() {
    let mut w = World::new();
    let id = w.submit(job(1));
    let board = Board {
        no_ready_node: true,
        ..Board::default()
    };
    assert_eq!(
        w.reason(Some(&board), id),
        "Resources: no node is registered yet"
    );
    w.node("a", 8);
    w.apply(Command::SetNodeStatus {
        node: "a".into(),
        status: NodeStatus::Drained,
        evict: false,
        reason: String::new(),
    });
    assert_eq!(
        w.reason(Some(&board), id),
        "NodeUnhealthy: no node is ready (1 draining)"
    );
}

#[test]
fn jobs_the_pass_did_not_reach_wait_behind_the_head() {
    let mut w = two_hosts();
    w.submit(job(8));
    w.submit(job(8));
    w.pass();
    let head = w.submit(job(8));
    let later = w.submit(job(1));
    let policy = Policy {
        backfill: false,
        ..Policy::default()
    };
    // Strict order: the pass stops at the head and never looks at `later`.
    let (_, _, log) = plan_explained(&w.state, w.now(), &policy);
    assert_eq!(log.jobs, vec![(head, Why::Resources)]);
    let board = w.board(log);
    assert_eq!(
        w.reason(Some(&board), later),
        format!("Priority: behind job {head}")
    );
}

#[test]
fn a_listing_diagnoses_a_bounded_number_of_shapes() {
    let mut w = two_hosts();
    let mut memo = ShapeMemo::default();
    for cpus in 0..reasons::MAX_SHAPES as u64 {
        let spec = JobSpec {
            cpu_milli_per_task: 1 + cpus,
            ..job(8)
        };
        assert!(memo.diagnose(&w.state, &Shape::of(&spec), 1).is_some());
    }
    let one_more = JobSpec {
        cpu_milli_per_task: 50_000,
        ..job(8)
    };
    assert!(memo.diagnose(&w.state, &Shape::of(&one_more), 1).is_none());
    // Shapes already diagnosed still answer.
    assert!(
        memo.diagnose(
            &w.state,
            &Shape::of(&JobSpec {
                cpu_milli_per_task: 1,
                ..job(8)
            }),
            1
        )
        .is_some()
    );
    // Past the bound a blocked job still says Resources, and where to ask.
    w.submit(job(8));
    w.submit(job(8));
    let blocked = w.submit(one_more);
    let (_, log) = w.pass();
    let board = w.board(log);
    let job = w.state.job(blocked).unwrap();
    assert_eq!(
        reasons::explain(&w.state, Some(&board), job, w.now(), &mut memo),
        format!("Resources: details with `gpuctl why {blocked}`")
    );
}

#[test]
fn jobs_beyond_the_pass_limit_say_they_were_not_reached() {
    let mut w = World::new();
    w.node("n1", 8);
    let first = w.submit(job(1));
    let second = w.submit(job(1));
    let policy = Policy {
        max_jobs_per_pass: 1,
        ..Policy::default()
    };
    let (plan, _, log) = plan_explained(&w.state, w.now(), &policy);
    assert_eq!(plan.placements.len(), 1);
    assert_eq!(plan.placements[0].job, first);
    assert_eq!(log.jobs_considered, 1);
    let board = Board::new(1, w.now(), log, policy.max_jobs_per_pass);
    assert_eq!(
        w.reason(Some(&board), second),
        "Priority: not reached yet (a pass looks at the first 1 jobs in queue order)"
    );
}
