//! Table tests of the first scheduling policy.

use std::collections::BTreeMap;

use super::*;
use crate::state::{
    Command, Dependency, DependencyKind, Gpu, GpuHealth, JobSpec, NodeSpec, Outcome, TaskOutcome,
};

pub(super) const DGX1: &str = "X NV1 NV1 NV2 NV2 SYS SYS SYS
NV1 X NV2 NV1 SYS NV2 SYS SYS
NV1 NV2 X NV2 SYS SYS NV1 SYS
NV2 NV1 NV2 X SYS SYS SYS NV1
NV2 SYS SYS SYS X NV1 NV1 NV2
SYS NV2 SYS SYS NV1 X NV2 NV1
SYS SYS NV1 SYS NV1 NV2 X NV2
SYS SYS SYS NV1 NV2 NV1 NV2 X";

pub(super) const A100_PAIRS: &str = "X NV12 SYS SYS
NV12 X SYS SYS
SYS SYS X NV12
SYS SYS NV12 X";

/// Four GPUs, two per socket.
const TWO_SOCKETS: &str = "X NODE SYS SYS
NODE X SYS SYS
SYS SYS X NODE
SYS SYS NODE X";

pub(super) fn matrix(text: &str) -> Vec<Vec<String>> {
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
            agent_release: String::new(),
            enforcement: String::new(),
            container_runtime: String::new(),
            service_ports: None,
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

    /// The leader's clock: just after the last applied command.
    fn now(&self) -> u64 {
        1000 + self.index
    }

    fn submit(&mut self, spec: JobSpec) -> u64 {
        match self.apply(Command::submit(spec, None)) {
            Outcome::JobSubmitted { id, .. } => id,
            other => panic!("submit refused: {other:?}"),
        }
    }

    /// Plans and commits the plan, as the leader does.
    fn schedule(&mut self) -> Vec<JobPlacement> {
        let plan = plan(&self.state, self.now()).placements;
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

/// Job ids in the order a pass would consider them.
fn queue_order(state: &ClusterState, now: u64) -> Vec<u64> {
    let mut q = queue::Queue::build(state, now, Policy::default().aging_step_ms, usize::MAX);
    std::iter::from_fn(|| q.next_job()).map(|j| j.id).collect()
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
    let order = queue_order(&w.state, w.now());
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
        plan(&w.state, w.now()).placements.is_empty(),
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
        plan(&w.state, w.now())
            .placements
            .iter()
            .all(|p| p.job != three),
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
        usage: None,
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
    assert!(plan(&w.state, w.now()).placements.is_empty());
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

// ---- Policy behaviour added with shares, MIG, fairness, backfill and preemption ----

impl World {
    /// Registers a node with explicit per-GPU NUMA nodes, MIG slices and labels.
    fn node_with(&mut self, name: &str, gpus: Vec<Gpu>, topology: &str, labels: &[(&str, &str)]) {
        let spec = NodeSpec {
            agent_release: String::new(),
            enforcement: String::new(),
            container_runtime: String::new(),
            service_ports: None,
            name: name.into(),
            gpus,
            cpu_milli: 64_000,
            memory_mib: 512 * 1024,
            partition: None,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
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

    fn tenant(&mut self, name: &str, weight: u32, quota: u32, max: u32) {
        self.apply(Command::PutTenant {
            tenant: crate::state::Tenant {
                name: name.into(),
                weight,
                quota_gpus: quota,
                max_gpus: max,
            },
        });
    }

    fn start_all(&mut self) {
        let ids: Vec<u64> = self
            .state
            .allocations
            .iter()
            .filter(|(_, r)| !r.started)
            .map(|(id, _)| *id)
            .collect();
        for allocation in ids {
            self.apply(Command::AllocationStarted { allocation });
        }
    }

    fn exit_all_of(&mut self, job: u64, outcome: TaskOutcome) {
        for allocation in self.state.jobs[&job].allocations.clone() {
            self.apply(Command::AllocationExited {
                allocation,
                outcome: outcome.clone(),
                usage: None,
            });
        }
    }

    /// Commits a plan's preemptions as the leader does.
    fn preempt(&mut self, plan: &Plan) -> Vec<u64> {
        let mut accepted = Vec::new();
        for p in &plan.preemptions {
            match self.apply(Command::Preempt {
                for_job: p.for_job,
                victims: p.victims.clone(),
                reason: String::new(),
            }) {
                Outcome::Preempted {
                    accepted: a,
                    rejected,
                } => {
                    assert!(rejected.is_empty(), "{rejected:?}");
                    accepted.extend(a);
                }
                other => panic!("{other:?}"),
            }
        }
        accepted
    }
}

fn gpu(node: &str, i: u32, numa: Option<u32>) -> Gpu {
    Gpu {
        uuid: format!("{node}-gpu{i}"),
        index: i,
        model: "A100".into(),
        memory_mib: 81_920,
        numa_node: numa,
        pci_bus_id: String::new(),
        health: GpuHealth::Healthy,
        mig: Vec::new(),
    }
}

fn share(milli: u32) -> JobSpec {
    JobSpec {
        gpu_milli: milli,
        ..job(1)
    }
}

#[test]
fn shares_pack_onto_one_gpu_up_to_a_thousand_milli() {
    let mut w = World::new();
    w.node("n", 2, "A100", "", None);
    let jobs: Vec<u64> = (0..4).map(|_| w.submit(share(250))).collect();
    let p = w.schedule();
    assert_eq!(p.len(), 4);
    let gpus: std::collections::BTreeSet<&str> =
        p.iter().map(|x| x.tasks[0].gpus[0].as_str()).collect();
    assert_eq!(gpus.len(), 1, "four quarter shares fill one GPU: {p:?}");
    assert_eq!(w.state.shared_milli(gpus.first().unwrap()), 1000);
    // A whole-GPU job takes the other GPU, and a fifth share has nowhere to go.
    let whole = w.submit(job(1));
    let fifth = w.submit(share(250));
    let p = w.schedule();
    assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![whole]);
    assert!(w.state.jobs[&fifth].allocations.is_empty());
    w.exit_all_of(jobs[0], TaskOutcome::Succeeded);
    let p = w.schedule();
    assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![fifth]);
    assert_eq!(w.state.check_consistency(), Ok(()));
}

#[test]
fn a_share_never_exceeds_the_gpus_memory() {
    let mut w = World::new();
    w.node("n", 1, "A100", "", None);
    let big = |w: &mut World| {
        w.submit(JobSpec {
            gpu_memory_mib: 50_000,
            ..share(200)
        })
    };
    let a = big(&mut w);
    let b = big(&mut w);
    let p = w.schedule();
    assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![a]);
    assert!(
        w.state.jobs[&b].allocations.is_empty(),
        "50 GB + 50 GB > 80 GB"
    );
}

#[test]
fn fgd_puts_a_share_where_it_fragments_least() {
    let mut w = World::new();
    w.node("n", 2, "A100", "", None);
    let half = w.submit(share(500));
    w.schedule();
    let first = w.state.allocations_of(half).next().unwrap().allocation.gpus[0].clone();
    // A second half share completes the used GPU rather than breaking the whole one.
    let other = w.submit(share(500));
    let p = w.schedule();
    assert_eq!(p[0].job, other);
    assert_eq!(p[0].tasks[0].gpus[0], first);
}

#[test]
fn mig_slices_are_scheduled_as_units() {
    let mut w = World::new();
    let mut g0 = gpu("m", 0, Some(0));
    g0.mig = (0..7)
        .map(|s| crate::state::MigSlice {
            uuid: format!("MIG-m-0-{s}"),
            profile: "1g.10gb".into(),
            memory_mib: 9_728,
        })
        .collect();
    w.node_with("m", vec![g0, gpu("m", 1, Some(0))], "", &[]);
    let slices = w.submit(JobSpec {
        mig_profile: Some("1g.10gb".into()),
        ..job(3)
    });
    let whole = w.submit(job(1));
    let p = w.schedule();
    let of = |id: u64| {
        p.iter().find(|x| x.job == id).unwrap().tasks[0]
            .gpus
            .clone()
    };
    let s = of(slices);
    assert_eq!(s.len(), 3);
    assert!(s.iter().all(|u| u.starts_with("MIG-m-0-")), "{s:?}");
    // The whole-GPU job cannot take the MIG-mode GPU.
    assert_eq!(of(whole), vec!["m-gpu1".to_owned()]);
    let more = w.submit(JobSpec {
        mig_profile: Some("1g.10gb".into()),
        ..job(4)
    });
    let p = w.schedule();
    assert_eq!(p[0].job, more);
    let too_many = w.submit(JobSpec {
        mig_profile: Some("1g.10gb".into()),
        ..job(1)
    });
    assert!(
        w.schedule().iter().all(|x| x.job != too_many),
        "all 7 slices are held"
    );
}

#[test]
fn a_single_numa_job_waits_rather_than_span_sockets() {
    let mut w = World::new();
    let gpus = vec![
        gpu("s", 0, Some(0)),
        gpu("s", 1, Some(0)),
        gpu("s", 2, Some(1)),
        gpu("s", 3, Some(1)),
    ];
    w.node_with("s", gpus, TWO_SOCKETS, &[]);
    // Hold one GPU on each socket.
    let a = w.submit(job(1));
    w.schedule();
    let b = w.submit(JobSpec {
        single_numa: true,
        ..job(2)
    });
    w.schedule();
    assert_eq!(
        w.state.jobs[&b].allocations.len(),
        1,
        "a same-socket pair was free"
    );
    let held: Vec<String> = [a, b]
        .iter()
        .flat_map(|j| {
            w.state
                .allocations_of(*j)
                .flat_map(|r| r.allocation.gpus.clone())
        })
        .collect();
    assert_eq!(held.len(), 3);
    let strict = w.submit(JobSpec {
        single_numa: true,
        ..job(1)
    });
    let p = w.schedule();
    assert_eq!(p[0].job, strict, "one GPU is always on one NUMA node");
    // Now one GPU on one socket... nothing left; a spanning pair would be refused anyway.
    assert!(w.state.check_consistency().is_ok());
}

#[test]
fn a_single_numa_pair_is_refused_when_only_a_cross_socket_pair_is_free() {
    let mut w = World::new();
    let gpus = vec![
        gpu("s", 0, Some(0)),
        gpu("s", 1, Some(0)),
        gpu("s", 2, Some(1)),
        gpu("s", 3, Some(1)),
    ];
    w.node_with("s", gpus, TWO_SOCKETS, &[]);
    let hold = w.submit(job(1));
    let hold2 = w.submit(job(1));
    w.schedule();
    // Free GPUs must now be one per socket; otherwise this test is moot.
    let mut held: Vec<u32> = [hold, hold2]
        .iter()
        .flat_map(|j| gpu_indexes(&plan_of(&w, *j)))
        .collect();
    held.sort_unstable();
    if held == vec![0, 2] || held == vec![1, 3] || held == vec![0, 3] || held == vec![1, 2] {
        let strict = w.submit(JobSpec {
            single_numa: true,
            ..job(2)
        });
        let loose = w.submit(job(2));
        let p = w.schedule();
        assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![loose]);
        assert!(w.state.jobs[&strict].allocations.is_empty());
    } else {
        // Best fit packed both onto one socket: the other socket's pair serves a strict job.
        let strict = w.submit(JobSpec {
            single_numa: true,
            ..job(2)
        });
        let p = w.schedule();
        assert_eq!(p[0].job, strict);
        let set = gpu_indexes(&p[0]);
        assert!(set == vec![0, 1] || set == vec![2, 3], "{set:?}");
    }
}

#[test]
fn a_gang_prefers_hosts_in_one_rack() {
    let mut w = World::new();
    for (name, rack) in [("a1", "ra"), ("b1", "rb"), ("a2", "ra"), ("b2", "rb")] {
        let gpus = (0..4).map(|i| gpu(name, i, Some(0))).collect();
        w.node_with(name, gpus, "", &[("rack", rack)]);
    }
    // Take one GPU on a1 so rack ra cannot hold two 4-GPU tasks.
    w.submit(job(1));
    w.schedule();
    let gang = w.submit(JobSpec { tasks: 2, ..job(4) });
    let p = w.schedule();
    let g = p.iter().find(|x| x.job == gang).unwrap();
    let mut nodes: Vec<&str> = g.tasks.iter().map(|t| t.node.as_str()).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, vec!["b1", "b2"], "both tasks in rack rb");
}

#[test]
fn aging_bounds_the_wait_of_low_priority_work() {
    let mut w = World::new();
    w.node("n", 1, "A100", "", None);
    let low = w.submit(JobSpec {
        priority_class: "low".into(),
        ..job(1)
    });
    let high = w.submit(JobSpec {
        priority_class: "high".into(),
        ..job(1)
    });
    let step = Policy::default().aging_step_ms;
    // Fresh: high first.
    assert_eq!(queue_order(&w.state, w.now()), vec![high, low]);
    // After three aging steps the low job has reached the aged level; a high job submitted
    // now is only at level 2 and waits behind it.
    let later = w.now() + 3 * step;
    assert_eq!(
        queue::level(&w.state.jobs[&low], 0, later, step),
        queue::AGED_LEVEL
    );
    let mut old_state = w.state.clone();
    let fresh_high = {
        let spec = JobSpec {
            priority_class: "high".into(),
            ..job(1)
        };
        match old_state
            .apply(&Command::submit(spec, None), later, w.index + 1)
            .outcome
        {
            Outcome::JobSubmitted { id, .. } => id,
            other => panic!("{other:?}"),
        }
    };
    let order = queue_order(&old_state, later);
    // Both old jobs are aged (FIFO among them: low was submitted first); the fresh one is last.
    assert_eq!(order, vec![low, high, fresh_high]);
}

#[test]
fn fair_share_alternates_tenants_and_favours_light_users() {
    let mut w = World::new();
    w.node("n", 8, "A100", "", None);
    w.tenant("heavy", 1, 0, 0);
    w.tenant("light", 1, 0, 0);
    // "heavy" ran 4 GPUs for an hour.
    let past = w.submit(JobSpec {
        tenant: "heavy".into(),
        ..job(4)
    });
    w.schedule();
    w.index += 3600 * 1000;
    w.exit_all_of(past, TaskOutcome::Succeeded);
    assert!(w.state.tenant_usage["heavy"].gpu_seconds_at(w.now()) > 14_000.0);
    let h: Vec<u64> = (0..3)
        .map(|_| {
            w.submit(JobSpec {
                tenant: "heavy".into(),
                ..job(1)
            })
        })
        .collect();
    let l: Vec<u64> = (0..3)
        .map(|_| {
            w.submit(JobSpec {
                tenant: "light".into(),
                ..job(1)
            })
        })
        .collect();
    let order = queue_order(&w.state, w.now());
    // The light tenant goes first; within a tenant, submission order.
    assert_eq!(order[0], l[0]);
    assert_eq!(
        order
            .iter()
            .filter(|j| h.contains(j))
            .copied()
            .collect::<Vec<_>>(),
        h
    );
    assert_eq!(
        order
            .iter()
            .filter(|j| l.contains(j))
            .copied()
            .collect::<Vec<_>>(),
        l
    );
}

#[test]
fn fair_share_follows_weights() {
    let mut w = World::new();
    w.node("n", 8, "A100", "", None);
    w.tenant("a", 3, 0, 0);
    w.tenant("b", 1, 0, 0);
    for t in ["a", "b"] {
        let j = w.submit(JobSpec {
            tenant: t.into(),
            ..job(2)
        });
        w.schedule();
        w.index += 3600 * 1000;
        w.exit_all_of(j, TaskOutcome::Succeeded);
    }
    // Equal usage, but "a" has three times the weight: it goes first.
    let b = w.submit(JobSpec {
        tenant: "b".into(),
        ..job(1)
    });
    let a = w.submit(JobSpec {
        tenant: "a".into(),
        ..job(1)
    });
    let order = queue_order(&w.state, w.now());
    assert_eq!(order, vec![a, b]);
}

#[test]
fn backfill_starts_short_jobs_but_never_delays_the_head_job() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    // Three GPUs busy for an hour.
    let running = w.submit(JobSpec {
        time_limit_secs: Some(3600),
        ..job(3)
    });
    w.schedule();
    w.start_all();
    // Head: needs all 4 GPUs; can start when `running` hits its limit.
    let head = w.submit(JobSpec {
        time_limit_secs: Some(3600),
        ..job(4)
    });
    // A 10-minute job fits in the free GPU and ends long before: backfilled.
    let short = w.submit(JobSpec {
        time_limit_secs: Some(600),
        ..job(1)
    });
    // A two-hour job would still hold the GPU when the head should start: not started.
    let long = w.submit(JobSpec {
        time_limit_secs: Some(7200),
        ..job(1)
    });
    let no_limit = w.submit(job(1));
    let plan = plan(&w.state, w.now());
    let r = plan
        .reservation
        .clone()
        .expect("the head job gets a reservation");
    assert_eq!(r.job, head);
    let created = w
        .state
        .allocations_of(running)
        .next()
        .unwrap()
        .allocation
        .created_at;
    assert_eq!(r.start_at, created + 3600 * 1000);
    assert_eq!(r.nodes.get("n"), Some(&1));
    let placed: Vec<u64> = plan.placements.iter().map(|p| p.job).collect();
    assert_eq!(placed, vec![short]);
    assert!(!placed.contains(&long) && !placed.contains(&no_limit));
    // Without backfill nothing behind the head starts.
    let strict = plan_with(
        &w.state,
        w.now(),
        &Policy {
            backfill: false,
            ..Policy::default()
        },
    );
    assert!(strict.placements.is_empty());
}

#[test]
fn backfill_lets_long_jobs_use_what_the_reservation_leaves() {
    let mut w = World::new();
    w.node("a", 4, "A100", "", None);
    let running = w.submit(JobSpec {
        time_limit_secs: Some(3600),
        ..job(2)
    });
    w.schedule();
    // Head wants 3 GPUs: at the reservation it gets the 2 freed plus one free now, so one GPU
    // stays spare even then, and a job with no limit may take it.
    let head = w.submit(job(3));
    let spare = w.submit(job(1));
    let p = plan(&w.state, w.now());
    assert_eq!(p.reservation.as_ref().map(|r| r.job), Some(head));
    assert_eq!(
        p.placements.iter().map(|x| x.job).collect::<Vec<_>>(),
        vec![spare]
    );
    let _ = running;
}

#[test]
fn a_high_priority_job_preempts_the_cheapest_low_priority_work() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    let old = w.submit(JobSpec {
        priority_class: "low".into(),
        preemptible: true,
        ..job(2)
    });
    w.schedule();
    w.start_all();
    w.index += 3600 * 1000;
    let young = w.submit(JobSpec {
        priority_class: "low".into(),
        preemptible: true,
        ..job(1)
    });
    let protected = w.submit(JobSpec {
        priority_class: "low".into(),
        ..job(1)
    });
    w.schedule();
    w.start_all();
    w.index += 60 * 1000;
    let high = w.submit(JobSpec {
        priority_class: "high".into(),
        ..job(1)
    });
    let p = plan(&w.state, w.now());
    assert!(p.placements.is_empty());
    // One GPU is needed: the youngest preemptible job loses least work.
    assert_eq!(
        p.preemptions,
        vec![Preemption {
            for_job: high,
            victims: vec![young]
        }]
    );
    assert_eq!(w.preempt(&p), vec![young]);
    // While the victim stops, no more victims are chosen.
    assert!(plan(&w.state, w.now()).preemptions.is_empty());
    w.exit_all_of(young, TaskOutcome::Stopped);
    assert_eq!(
        w.state.jobs[&young].state,
        crate::state::JobState::Pending,
        "requeued, not lost"
    );
    let p = w.schedule();
    assert_eq!(p[0].job, high);
    assert!(!w.state.jobs[&old].allocations.is_empty());
    assert!(!w.state.jobs[&protected].allocations.is_empty());
}

#[test]
fn non_preemptible_and_equal_priority_work_is_never_preempted() {
    let mut w = World::new();
    w.node("n", 2, "A100", "", None);
    w.submit(JobSpec {
        priority_class: "low".into(),
        ..job(2)
    });
    w.schedule();
    w.submit(JobSpec {
        priority_class: "high".into(),
        ..job(1)
    });
    assert!(plan(&w.state, w.now()).preemptions.is_empty());
    let mut w = World::new();
    w.node("n", 2, "A100", "", None);
    w.submit(JobSpec {
        preemptible: true,
        ..job(2)
    });
    w.schedule();
    w.submit(job(1));
    assert!(plan(&w.state, w.now()).preemptions.is_empty(), "same class");
}

/// A high-priority job of a tenant running on borrowed capacity does not preempt a job that
/// another tenant runs within its guarantee: that tenant would reclaim its quota at once, the
/// reclaimed job would preempt again by priority, and the two would stop each other forever
/// (the simulation's seed 160 did exactly that). A borrowing victim stays fair game.
#[test]
fn priority_preemption_across_tenants_respects_guarantees() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    w.tenant("owner", 1, 2, 4);
    w.tenant("rich", 1, 0, 4);
    let low = |tenant: &str| JobSpec {
        tenant: tenant.into(),
        priority_class: "low".into(),
        preemptible: true,
        ..job(1)
    };
    let guaranteed: Vec<u64> = (0..2).map(|_| w.submit(low("owner"))).collect();
    w.submit(JobSpec {
        tenant: "rich".into(),
        ..job(1)
    });
    let borrowed_low = w.submit(low("rich"));
    let (urgent, victims) = start_all_then_plan_for_an_urgent_rich_job(&mut w);
    assert_eq!(victims, vec![borrowed_low]);
    for &g in &guaranteed {
        let err = w
            .state
            .check_preemption(&w.state.jobs[&urgent], g)
            .expect_err("a guaranteed job of another tenant");
        assert!(err.contains("may not be preempted"), "{err}");
    }

    // The same urgent job may take the owner's lower-priority work once the owner borrows.
    let mut w2 = World::new();
    w2.node("n", 4, "A100", "", None);
    w2.tenant("owner", 1, 1, 4);
    w2.tenant("rich", 1, 0, 4);
    let over: Vec<u64> = (0..4).map(|_| w2.submit(low("owner"))).collect();
    let (_, victims) = start_all_then_plan_for_an_urgent_rich_job(&mut w2);
    assert!(over.contains(&victims[0]), "{victims:?}");
}

/// Places and starts what is queued, submits a high-priority one-GPU job of tenant "rich" and
/// returns it with the victims of the one preemption planned for it.
fn start_all_then_plan_for_an_urgent_rich_job(w: &mut World) -> (u64, Vec<u64>) {
    w.schedule();
    w.start_all();
    let urgent = w.submit(JobSpec {
        tenant: "rich".into(),
        priority_class: "high".into(),
        ..job(1)
    });
    let p = plan(&w.state, w.now());
    assert_eq!(p.preemptions.len(), 1, "{:?}", p.preemptions);
    assert_eq!(p.preemptions[0].for_job, urgent);
    (urgent, p.preemptions[0].victims.clone())
}

#[test]
fn a_tenant_reclaims_its_guaranteed_quota_from_borrowers() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    w.tenant("owner", 1, 2, 4);
    w.tenant("borrower", 1, 0, 4);
    let borrowed: Vec<u64> = (0..4)
        .map(|_| {
            w.submit(JobSpec {
                tenant: "borrower".into(),
                ..job(1)
            })
        })
        .collect();
    w.schedule();
    w.start_all();
    let mine = w.submit(JobSpec {
        tenant: "owner".into(),
        ..job(2)
    });
    let p = plan(&w.state, w.now());
    assert_eq!(p.preemptions.len(), 1);
    assert_eq!(p.preemptions[0].for_job, mine);
    assert_eq!(p.preemptions[0].victims.len(), 2);
    assert!(
        p.preemptions[0]
            .victims
            .iter()
            .all(|v| borrowed.contains(v))
    );
    // Beyond its quota the owner reclaims nothing.
    let mut w2 = World::new();
    w2.node("n", 4, "A100", "", None);
    w2.tenant("owner", 1, 1, 4);
    w2.tenant("borrower", 1, 0, 4);
    for _ in 0..4 {
        w2.submit(JobSpec {
            tenant: "borrower".into(),
            ..job(1)
        });
    }
    w2.schedule();
    w2.submit(JobSpec {
        tenant: "owner".into(),
        ..job(2)
    });
    assert!(plan(&w2.state, w2.now()).preemptions.is_empty());
}

#[test]
fn a_dependency_that_can_never_be_met_fails_the_job() {
    let mut w = World::new();
    w.node("n", 2, "A100", "", None);
    let first = w.submit(job(1));
    let after_ok = w.submit(JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterOk,
            job: first,
        }],
        ..job(1)
    });
    let chained = w.submit(JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterAny,
            job: after_ok,
        }],
        ..job(1)
    });
    w.schedule();
    w.exit_all_of(
        first,
        TaskOutcome::Failed {
            exit_code: Some(1),
            signal: None,
            reason: String::new(),
        },
    );
    let failed = &w.state.jobs[&after_ok];
    assert_eq!(failed.state, crate::state::JobState::Failed);
    assert!(
        failed
            .history
            .last()
            .unwrap()
            .reason
            .contains("can never be satisfied"),
        "{:?}",
        failed.history
    );
    // afterany is satisfied by the failure: the chain continues.
    assert_eq!(
        w.state.jobs[&chained].state,
        crate::state::JobState::Pending
    );
    let p = w.schedule();
    assert_eq!(p.iter().map(|x| x.job).collect::<Vec<_>>(), vec![chained]);
    // Submitting against an already failed job fails at once, with the reason.
    let late = w.submit(JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterOk,
            job: first,
        }],
        ..job(1)
    });
    assert_eq!(w.state.jobs[&late].state, crate::state::JobState::Failed);
    assert!(w.state.check_consistency().is_ok());
}

#[test]
fn a_preempted_job_stands_aside_until_the_job_it_was_stopped_for_has_started() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    let low = |w: &mut World| {
        w.submit(JobSpec {
            priority_class: "low".into(),
            preemptible: true,
            ..job(2)
        })
    };
    let (first, second) = (low(&mut w), low(&mut w));
    w.schedule();
    w.start_all();
    w.index += 60 * 1000;
    let high = w.submit(JobSpec {
        priority_class: "high".into(),
        ..job(4)
    });
    let p = plan(&w.state, w.now());
    assert_eq!(w.preempt(&p), vec![first, second]);
    // The first victim stops while the second still runs: the two GPUs it freed are not
    // given back to it (it would be preempted again as soon as the second one stopped).
    w.exit_all_of(first, TaskOutcome::Stopped);
    assert_eq!(w.state.jobs[&first].yielded_to, Some(high));
    assert!(queue::yielding(&w.state, &w.state.jobs[&first], w.now()));
    assert!(
        w.schedule().is_empty(),
        "nothing starts while the room is made"
    );
    w.exit_all_of(second, TaskOutcome::Stopped);
    assert_eq!(
        w.schedule().iter().map(|p| p.job).collect::<Vec<_>>(),
        vec![high]
    );
    // Once the preemptor runs, its victims queue normally again.
    assert!(!queue::yielding(&w.state, &w.state.jobs[&first], w.now()));
    assert_eq!(w.state.jobs[&high].yielded_to, None);
}

#[test]
fn jobs_that_preempted_each_other_do_not_wait_on_each_other() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    let a = w.submit(job(1));
    let b = w.submit(job(1));
    // Each was preempted for the other (one by priority, one reclaiming its quota) and both
    // wait: neither stands aside, or both would wait until the yield limit.
    w.state.jobs.get_mut(&a).unwrap().yielded_to = Some(b);
    w.state.jobs.get_mut(&b).unwrap().yielded_to = Some(a);
    assert!(!queue::yielding(&w.state, &w.state.jobs[&a], w.now()));
    assert!(!queue::yielding(&w.state, &w.state.jobs[&b], w.now()));
    let mut placed: Vec<u64> = w.schedule().iter().map(|p| p.job).collect();
    placed.sort_unstable();
    assert_eq!(placed, vec![a, b]);
}

#[test]
fn a_preempted_job_stops_standing_aside_after_the_yield_limit() {
    let mut w = World::new();
    w.node("n", 4, "A100", "", None);
    let victim = w.submit(job(1));
    let preemptor = w.submit(JobSpec {
        partition: Some("nowhere".into()),
        ..job(1)
    });
    w.state.jobs.get_mut(&victim).unwrap().yielded_to = Some(preemptor);
    assert!(queue::yielding(&w.state, &w.state.jobs[&victim], w.now()));
    w.index += crate::state::YIELD_LIMIT_MS;
    assert!(!queue::yielding(&w.state, &w.state.jobs[&victim], w.now()));
}

/// Holds, begin times, array limits, node lists and exclusive nodes in the pass.
mod slurm_rules_tests;

/// A service below its minimum replicas is restored first: its replica goes ahead of batch
/// work of its own class and may stop preemptible batch work of that class, which a batch job
/// of the same class never may.
#[test]
fn a_service_below_its_minimum_preempts_preemptible_batch_work_of_its_class() {
    use crate::state::{ReplicaTemplate, RestartPolicy, RolloutStrategy, ServiceSpec};
    let mut w = World::new();
    w.apply(Command::SetClusterVersion { version: 2 });
    w.node("n", 2, "A100", "", None);
    let batch = w.submit(JobSpec {
        preemptible: true,
        ..job(2)
    });
    w.schedule();
    let spec = ServiceSpec {
        tenant: "t".into(),
        name: "web".into(),
        template: ReplicaTemplate {
            job: JobSpec {
                name: "web".into(),
                ..job(1)
            },
            readiness: None,
            liveness: None,
        },
        replicas: 1,
        strategy: RolloutStrategy::default(),
        restart: RestartPolicy::default(),
        autoscale: None,
    };
    assert!(matches!(
        w.apply(Command::PutService {
            spec: Box::new(spec),
            create_only: true,
        }),
        Outcome::ServiceChanged { .. }
    ));
    // A batch job of the same class waits too: the replica, below its minimum, goes first.
    let later = w.submit(job(1));
    let replica = w.state.services["t/web"].replicas[&0];
    let order = queue_order(&w.state, w.now());
    assert_eq!(order, vec![replica, later]);
    let plan = plan(&w.state, w.now());
    assert_eq!(
        plan.preemptions,
        vec![crate::scheduler::Preemption {
            for_job: replica,
            victims: vec![batch],
        }]
    );
    assert_eq!(w.preempt(&plan), vec![batch]);
}
