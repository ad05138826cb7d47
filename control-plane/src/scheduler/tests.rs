//! Table tests of the first scheduling policy.

use std::collections::BTreeMap;

use super::*;
use crate::state::{
    Command, Dependency, DependencyKind, Gpu, GpuHealth, JobSpec, NodeSpec, Outcome, TaskOutcome,
};

const DGX1: &str = "X NV1 NV1 NV2 NV2 SYS SYS SYS
NV1 X NV2 NV1 SYS NV2 SYS SYS
NV1 NV2 X NV2 SYS SYS NV1 SYS
NV2 NV1 NV2 X SYS SYS SYS NV1
NV2 SYS SYS SYS X NV1 NV1 NV2
SYS NV2 SYS SYS NV1 X NV2 NV1
SYS SYS NV1 SYS NV1 NV2 X NV2
SYS SYS SYS NV1 NV2 NV1 NV2 X";

const A100_PAIRS: &str = "X NV12 SYS SYS
NV12 X SYS SYS
SYS SYS X NV12
SYS SYS NV12 X";

fn matrix(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

struct World {
    state: ClusterState,
    index: u64,
}

impl World {
    fn new() -> World {
        World {
            state: ClusterState::default(),
            index: 0,
        }
    }

    fn apply(&mut self, c: Command) -> Outcome {
        self.index += 1;
        self.state.apply(&c, 1000 + self.index, self.index).outcome
    }

    fn node(
        &mut self,
        name: &str,
        gpus: u32,
        model: &str,
        topology: &str,
        partition: Option<&str>,
    ) {
        let spec = NodeSpec {
            name: name.into(),
            gpus: (0..gpus)
                .map(|i| Gpu {
                    uuid: format!("{name}-gpu{i}"),
                    index: i,
                    model: model.into(),
                    memory_mib: 81_920,
                    numa_node: None,
                    pci_bus_id: String::new(),
                    health: GpuHealth::Healthy,
                    mig: Vec::new(),
                })
                .collect(),
            cpu_milli: 64_000,
            memory_mib: 512 * 1024,
            partition: partition.map(str::to_owned),
            labels: BTreeMap::new(),
            topology: matrix(topology),
            agent_address: String::new(),
            driver: String::new(),
            incarnation: String::new(),
        };
        assert_eq!(
            self.apply(Command::RegisterNode { spec }),
            Outcome::NodeRegistered
        );
    }

    fn submit(&mut self, spec: JobSpec) -> u64 {
        match self.apply(Command::submit(spec, None)) {
            Outcome::JobSubmitted { id, .. } => id,
            other => panic!("submit refused: {other:?}"),
        }
    }

    /// Plans and commits the plan, as the leader does.
    fn schedule(&mut self) -> Vec<JobPlacement> {
        let plan = plan(&self.state, 0);
        let outcome = self.apply(Command::Place {
            term: 1,
            placements: plan.clone(),
        });
        match outcome {
            Outcome::Placed { rejected, .. } => {
                assert!(rejected.is_empty(), "apply refused {rejected:?}")
            }
            other => panic!("{other:?}"),
        }
        plan
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

fn gpu_indexes(p: &JobPlacement) -> Vec<u32> {
    let mut v: Vec<u32> = p.tasks[0]
        .gpus
        .iter()
        .map(|u| u.rsplit("gpu").next().unwrap().parse().unwrap())
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn a_four_gpu_job_on_a_dgx1_gets_a_fully_nvlinked_quad() {
    let mut w = World::new();
    w.node("dgx", 8, "V100", DGX1, None);
    // Hold GPU 1 so the first quad is broken: the job must take the other one.
    let blocker = w.submit(job(1));
    let p = w.schedule();
    assert_eq!(p[0].job, blocker);
    assert_eq!(gpu_indexes(&p[0]), vec![0]);
    let quad = w.submit(job(4));
    let p = w.schedule();
    assert_eq!(p[0].job, quad);
    let set = gpu_indexes(&p[0]);
    let m = matrix(DGX1);
    for a in &set {
        for b in &set {
            assert!(
                a == b || m[*a as usize][*b as usize].starts_with("NV"),
                "{set:?} has a non-NVLink pair"
            );
        }
    }
    assert_eq!(set, vec![4, 5, 6, 7]);
}

#[test]
fn a_two_gpu_job_on_a_paired_a100_board_gets_an_nvlink_pair() {
    let mut w = World::new();
    w.node("a100", 4, "A100", A100_PAIRS, None);
    let one = w.submit(job(1));
    w.schedule();
    let pair = w.submit(job(2));
    let p = w.schedule();
    assert_eq!(p[0].job, pair);
    let held = gpu_indexes(&plan_of(&w, one));
    assert_eq!(held, vec![0]);
    assert_eq!(gpu_indexes(&p[0]), vec![2, 3]);
}

fn plan_of(w: &World, job: u64) -> JobPlacement {
    let gpus = w
        .state
        .allocations_of(job)
        .flat_map(|a| a.allocation.gpus.clone())
        .collect();
    JobPlacement {
        job,
        tasks: vec![TaskPlacement {
            node: String::new(),
            gpus,
        }],
    }
}

#[test]
fn higher_priority_is_served_first_then_submission_order() {
    let mut w = World::new();
    w.node("n", 2, "H100", "", None);
    let low = w.submit(JobSpec {
        priority_class: "low".into(),
        ..job(2)
    });
    let normal = w.submit(job(2));
    let high = w.submit(JobSpec {
        priority_class: "high".into(),
        ..job(2)
    });
    let order: Vec<u64> = queue_order(&w.state).iter().map(|j| j.id).collect();
    assert_eq!(order, vec![high, normal, low]);
    let p = w.schedule();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].job, high);
}

#[test]
fn best_fit_keeps_the_emptier_node_whole() {
    let mut w = World::new();
    w.node("big", 8, "H100", "", None);
    w.node("small", 2, "H100", "", None);
    w.submit(job(1));
    let p = w.schedule();
    assert_eq!(p[0].tasks[0].node, "small");
    let eight = w.submit(job(8));
    let p = w.schedule();
    assert_eq!((p[0].job, p[0].tasks[0].node.as_str()), (eight, "big"));
}

#[test]
fn a_gang_is_placed_whole_or_not_at_all() {
    let mut w = World::new();
    w.node("a", 4, "H100", "", None);
    w.node("b", 4, "H100", "", None);
    let gang = w.submit(JobSpec { tasks: 3, ..job(4) });
    assert!(
        plan(&w.state, 0).is_empty(),
        "three 4-GPU tasks cannot fit on two 4-GPU nodes"
    );
    let two = w.submit(JobSpec { tasks: 2, ..job(4) });
    let p = w.schedule();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].job, two);
    let nodes: Vec<&str> = p[0].tasks.iter().map(|t| t.node.as_str()).collect();
    assert_eq!(nodes, vec!["a", "b"]);
    assert!(w.state.jobs[&gang].allocations.is_empty());
}

#[test]
fn partitions_models_and_health_are_respected() {
    let mut w = World::new();
    w.node("v100", 4, "V100", "", Some("old"));
    w.node("h100", 4, "H100", "", Some("new"));
    let wants_old = w.submit(JobSpec {
        partition: Some("old".into()),
        ..job(1)
    });
    let wants_h100 = w.submit(JobSpec {
        gpu_models: vec!["H100".into()],
        ..job(1)
    });
    let p = w.schedule();
    let node_of = |id: u64| {
        p.iter().find(|x| x.job == id).unwrap().tasks[0]
            .node
            .clone()
    };
    assert_eq!(node_of(wants_old), "v100");
    assert_eq!(node_of(wants_h100), "h100");

    assert_eq!(
        w.apply(Command::SetGpuHealth {
            node: "h100".into(),
            gpu: "h100-gpu1".into(),
            health: GpuHealth::Unhealthy {
                reason: "Xid 79".into()
            },
        }),
        Outcome::Done
    );
    let three = w.submit(JobSpec {
        gpu_models: vec!["H100".into()],
        ..job(3)
    });
    assert!(
        plan(&w.state, 0).iter().all(|p| p.job != three),
        "only 2 healthy free H100s remain"
    );
}

#[test]
fn dependencies_hold_a_job_until_they_are_met() {
    let mut w = World::new();
    w.node("n", 4, "H100", "", None);
    let first = w.submit(job(1));
    let after_ok = w.submit(JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterOk,
            job: first,
        }],
        ..job(1)
    });
    let after_not_ok = w.submit(JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterNotOk,
            job: first,
        }],
        ..job(1)
    });
    let p = w.schedule();
    assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![first]);
    let alloc = w.state.jobs[&first].allocations[0];
    w.apply(Command::AllocationStarted { allocation: alloc });
    w.apply(Command::AllocationExited {
        allocation: alloc,
        outcome: TaskOutcome::Succeeded,
    });
    let p = w.schedule();
    assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![after_ok]);
    assert!(w.state.jobs[&after_not_ok].allocations.is_empty());
}

#[test]
fn drained_nodes_get_no_new_work() {
    let mut w = World::new();
    w.node("n", 4, "H100", "", None);
    w.apply(Command::SetNodeStatus {
        node: "n".into(),
        status: crate::state::NodeStatus::Drained,
        evict: false,
        reason: String::new(),
    });
    w.submit(job(1));
    assert!(plan(&w.state, 0).is_empty());
}

#[test]
fn a_tenant_never_exceeds_its_gpu_limit() {
    let mut w = World::new();
    w.node("n", 8, "H100", "", None);
    w.apply(Command::PutTenant {
        tenant: crate::state::Tenant {
            name: "t".into(),
            weight: 1,
            quota_gpus: 2,
            max_gpus: 3,
        },
    });
    let a = w.submit(job(2));
    let b = w.submit(job(2));
    let c = w.submit(job(1));
    let placed: Vec<u64> = w.schedule().iter().map(|p| p.job).collect();
    // 2 + 2 would be 4 > 3: the second job waits, the 1-GPU job fits under the limit.
    assert_eq!(placed, vec![a, c]);
    assert!(w.state.jobs[&b].allocations.is_empty());
    assert_eq!(w.state.gpus_held_by_tenant("t"), 3);
    // Apply refuses a plan that would break the limit, whoever proposes it.
    let free: Vec<String> = (3..5).map(|i| format!("n-gpu{i}")).collect();
    let outcome = w.apply(Command::Place {
        term: 1,
        placements: vec![JobPlacement {
            job: b,
            tasks: vec![TaskPlacement {
                node: "n".into(),
                gpus: free,
            }],
        }],
    });
    assert!(
        matches!(outcome, Outcome::Placed { ref accepted, .. } if accepted.is_empty()),
        "{outcome:?}"
    );
}
