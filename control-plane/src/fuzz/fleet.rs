//! The cluster the API and state targets start from: built once by applying ordinary commands
//! (tenants, a partition, three nodes, jobs placed by the real scheduler), then cloned per
//! case.
//!
//! - `n0`: 4 × A100 (partition `gpu`), NUMA 0/0/1/1, with a link matrix;
//! - `n1`: 2 × H100, GPU 1 in MIG mode (three `1g.10gb` and one `3g.40gb` slice);
//! - `n2`: 8 × H100 (partition `gpu`).
//!
//! Tenants `ta` (quota 4, at most 8 GPUs) and `tb` (weight 2, no limit). Jobs 1–5 are placed
//! and started (job 5 then succeeded), jobs 6 and 7 wait. GPU UUIDs are `GPU-<node>-<i>`,
//! slices `MIG-<node>-<gpu>-<slot>`.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::scheduler;
use crate::state::validate::DEFAULT_PRIORITY_CLASS;
use crate::state::{
    Actor, ClusterState, Command, Dependency, DependencyKind, Gpu, GpuHealth, JobSpec, MigSlice,
    NodeSpec, Partition, TaskOutcome, Tenant, Timestamp,
};

/// Leader time of the first setup command.
pub const START: Timestamp = 1_700_000_000_000;
pub const TERM: u64 = 2;
pub const NODES: [&str; 3] = ["n0", "n1", "n2"];
pub const PARTITION: &str = "gpu";

/// The built cluster and where its log and clock stand.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub state: ClusterState,
    /// Index of the last applied entry.
    pub index: u64,
    /// Leader time of the last applied entry.
    pub at: Timestamp,
}

impl Fleet {
    /// Applies `command` as the next entry, `step_ms` after the last.
    pub fn apply(&mut self, command: &Command, step_ms: u64) -> crate::state::Applied {
        self.index += 1;
        self.at += step_ms;
        self.state.apply(command, self.at, self.index)
    }
}

pub fn gpu_uuid(node: &str, i: u32) -> String {
    format!("GPU-{node}-{i}")
}

pub fn mig_uuid(node: &str, gpu: u32, slot: u32) -> String {
    format!("MIG-{node}-{gpu}-{slot}")
}

/// An administrator calling the client API.
pub fn admin() -> Actor {
    Actor {
        principal: "token:0123456789abcdef".into(),
        role: "admin".into(),
        tenant: None,
        from: "10.0.0.9:40000".into(),
    }
}

/// The agent of `node`, as the agent API attributes its calls.
pub fn agent(node: &str) -> Actor {
    Actor {
        principal: format!("node:{node}"),
        role: "node".into(),
        tenant: None,
        from: "10.0.1.1:50000".into(),
    }
}

/// The spec node `k` (0..3) of the fleet reports.
pub fn node_spec(k: usize) -> NodeSpec {
    let name = NODES[k % NODES.len()];
    let (count, model, partition) = match k % NODES.len() {
        0 => (4, "A100", Some(PARTITION)),
        1 => (2, "H100", None),
        _ => (8, "H100", Some(PARTITION)),
    };
    let gpus = (0..count)
        .map(|i| Gpu {
            uuid: gpu_uuid(name, i),
            index: i,
            model: model.into(),
            memory_mib: 81_920,
            numa_node: Some(i * 2 / count),
            pci_bus_id: format!("0000:{:02x}:00.0", i + 1),
            health: GpuHealth::Healthy,
            mig: if k == 1 && i == 1 {
                ["1g.10gb", "1g.10gb", "1g.10gb", "3g.40gb"]
                    .iter()
                    .zip(0..)
                    .map(|(p, slot)| MigSlice {
                        uuid: mig_uuid(name, i, slot),
                        profile: (*p).into(),
                        memory_mib: if p.starts_with('3') { 40_960 } else { 10_240 },
                    })
                    .collect()
            } else {
                Vec::new()
            },
        })
        .collect();
    let topology = if k == 0 {
        (0..4)
            .map(|r| {
                (0..4)
                    .map(|c| match (r, c) {
                        (r, c) if r == c => "X".to_owned(),
                        (r, c) if r / 2 == c / 2 => "NV12".to_owned(),
                        _ => "SYS".to_owned(),
                    })
                    .collect()
            })
            .collect()
    } else {
        Vec::new()
    };
    NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name: name.into(),
        gpus,
        cpu_milli: 64_000,
        memory_mib: 512 * 1024,
        partition: partition.map(str::to_owned),
        labels: BTreeMap::from([("rack".to_owned(), format!("r{k}"))]),
        topology,
        agent_address: format!("10.0.1.{k}:7070"),
        driver: "550.54.15".into(),
        incarnation: format!("inc-{k}"),
    }
}

/// A plain job spec of `tenant`.
pub fn job(tenant: &str, tasks: u32, gpus: u32) -> JobSpec {
    JobSpec {
        tenant: tenant.into(),
        name: format!("job-{tasks}x{gpus}"),
        command: vec!["python".into(), "train.py".into()],
        gpus_per_task: gpus,
        tasks,
        priority_class: DEFAULT_PRIORITY_CLASS.into(),
        cpu_milli_per_task: 2000,
        memory_mib_per_task: 8192,
        env: BTreeMap::from([("EPOCHS".to_owned(), "3".to_owned())]),
        ..JobSpec::default()
    }
}

/// The commands that set the fleet up, in order, before its jobs are placed.
pub fn setup_commands() -> Vec<Command> {
    let mut cmds = vec![
        Command::PutTenant {
            tenant: Tenant {
                name: "ta".into(),
                weight: 1,
                quota_gpus: 4,
                max_gpus: 8,
            },
        },
        Command::PutTenant {
            tenant: Tenant {
                name: "tb".into(),
                weight: 2,
                quota_gpus: 2,
                max_gpus: 0,
            },
        },
        Command::PutPartition {
            partition: Partition {
                name: PARTITION.into(),
                description: "GPU nodes".into(),
            },
        },
    ];
    for k in 0..NODES.len() {
        cmds.push(Command::RegisterNode { spec: node_spec(k) });
    }
    let share = JobSpec {
        gpu_milli: 500,
        ..job("tb", 1, 1)
    };
    let mig = JobSpec {
        mig_profile: Some("1g.10gb".into()),
        ..job("ta", 1, 1)
    };
    let gang = JobSpec {
        gpu_models: vec!["H100".into()],
        preemptible: true,
        ..job("tb", 2, 4)
    };
    let cpu_only = job("ta", 1, 0);
    for (spec, key) in [
        (job("ta", 1, 2), Some("first")),
        (share, None),
        (mig, None),
        (gang, Some("gang")),
        (cpu_only, None),
    ] {
        cmds.push(Command::submit(spec, key.map(str::to_owned)).by(admin()));
    }
    cmds
}

/// The fleet, built on first use.
pub fn fleet() -> &'static Fleet {
    static FLEET: OnceLock<Fleet> = OnceLock::new();
    FLEET.get_or_init(build)
}

fn build() -> Fleet {
    let mut f = Fleet {
        state: ClusterState::default(),
        index: 0,
        at: START,
    };
    for c in setup_commands() {
        f.apply(&c, 1000);
    }
    let plan = scheduler::plan(&f.state, f.at);
    f.apply(
        &Command::Place {
            term: TERM,
            placements: plan.placements,
        },
        1000,
    );
    let allocations: Vec<u64> = f.state.allocations.keys().copied().collect();
    for a in &allocations {
        f.apply(&Command::AllocationStarted { allocation: *a }, 1000);
    }
    // The CPU-only job (5) succeeds: something to depend on.
    if let Some(a) = f
        .state
        .jobs
        .get(&5)
        .and_then(|j| j.allocations.first().copied())
    {
        f.apply(
            &Command::AllocationExited {
                allocation: a,
                outcome: TaskOutcome::Succeeded,
                usage: None,
            },
            1000,
        );
    }
    let waiting = JobSpec {
        dependencies: vec![Dependency {
            kind: DependencyKind::AfterOk,
            job: 1,
        }],
        ..job("ta", 1, 1)
    };
    f.apply(&Command::submit(waiting, None).by(admin()), 1000);
    f.apply(&Command::submit(job("tb", 1, 8), None).by(admin()), 1000);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::JobState;

    #[test]
    fn the_fleet_has_running_finished_and_waiting_jobs() {
        let f = fleet();
        f.state.check_consistency().unwrap();
        assert_eq!(f.state.nodes.len(), 3);
        let state = |id| f.state.jobs[&id].state;
        for id in 1..=4 {
            assert_eq!(state(id), JobState::Running, "job {id}");
        }
        assert_eq!(state(5), JobState::Succeeded);
        assert_eq!(state(6), JobState::Pending);
        assert_eq!(state(7), JobState::Pending);
    }
}
