//! Synthetic fleets and workloads built through the real state machine (`apply`): the
//! scheduler benchmark and the time-based simulator use them for shapes the public trace lacks
//! (multi-node gangs, priorities, tenants, MIG, shares, dependencies).

use std::collections::BTreeMap;

use node_agent::gpu::GpuBackend;
use node_agent::gpu::simulated::{SimulatedBackend, SimulatedSpec};

use crate::scheduler::score::SplitMix64;
use crate::state::{
    ClusterState, Command, Dependency, DependencyKind, Gpu, GpuHealth, JobSpec, MigSlice, NodeSpec,
    Outcome, Tenant, Timestamp,
};

/// A node as a simulated host of `preset` would register it.
pub fn node_from_preset(
    preset: &str,
    host: &str,
    partition: Option<&str>,
    labels: BTreeMap<String, String>,
) -> anyhow::Result<NodeSpec> {
    let spec = SimulatedSpec::from_preset(preset, host)?;
    let inv = SimulatedBackend::new(spec)?.inventory()?;
    Ok(NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name: host.to_owned(),
        gpus: inv
            .gpus
            .into_iter()
            .map(|g| Gpu {
                uuid: g.uuid,
                index: g.index,
                model: g.model,
                memory_mib: g.memory_mib,
                numa_node: g.numa_node,
                pci_bus_id: g.pci_bus_id,
                health: GpuHealth::Healthy,
                mig: g
                    .mig_instances
                    .into_iter()
                    .map(|m| MigSlice {
                        uuid: m.uuid,
                        profile: m.profile,
                        memory_mib: m.memory_mib,
                    })
                    .collect(),
            })
            .collect(),
        cpu_milli: inv.cpu_milli,
        memory_mib: inv.memory_mib,
        partition: partition.map(str::to_owned),
        labels,
        topology: inv
            .topology
            .links
            .iter()
            .map(|row| row.iter().map(|l| l.to_string()).collect())
            .collect(),
        agent_address: String::new(),
        driver: "simulated".into(),
        incarnation: String::new(),
    })
}

/// Applies commands to a state the way a replica does, with a log index and leader clock.
pub struct Driver {
    pub state: ClusterState,
    pub index: u64,
    pub now: Timestamp,
}

impl Driver {
    pub fn new(now: Timestamp) -> Driver {
        Driver {
            state: ClusterState::default(),
            index: 0,
            now,
        }
    }

    pub fn apply(&mut self, command: &Command) -> Outcome {
        self.index += 1;
        self.state.apply(command, self.now, self.index).outcome
    }
}

/// A fleet of `hosts` 8-GPU hosts: mostly DGX H100s, a tenth DGX-1 V100s, a tenth L40S PCIe
/// servers; 32 hosts per rack; tenants t0..t7 with equal weights.
pub fn fleet(driver: &mut Driver, hosts: usize) -> anyhow::Result<()> {
    let templates = [
        ("dgx-h100", "h100"),
        ("dgx1-v100", "v100"),
        ("pcie-8gpu-2socket", "l40s"),
    ];
    let mut specs = Vec::new();
    for (preset, partition) in templates {
        specs.push(node_from_preset(
            preset,
            "template",
            Some(partition),
            BTreeMap::new(),
        )?);
    }
    for i in 0..hosts {
        let t = match i % 10 {
            8 => 1,
            9 => 2,
            _ => 0,
        };
        let host = format!("host-{i:05}");
        let mut spec = specs[t].clone();
        for g in &mut spec.gpus {
            g.uuid = format!("GPU-{host}-{}", g.index);
        }
        spec.name = host;
        spec.labels
            .insert("rack".into(), format!("rack-{:03}", i / 32));
        let outcome = driver.apply(&Command::RegisterNode { spec });
        anyhow::ensure!(outcome == Outcome::NodeRegistered, "register: {outcome:?}");
    }
    for t in 0..8 {
        driver.apply(&Command::PutTenant {
            tenant: Tenant {
                name: format!("t{t}"),
                weight: 1,
                quota_gpus: (hosts * 8 / 8) as u32,
                max_gpus: 0,
            },
        });
    }
    Ok(())
}

/// `n` jobs of mixed shapes: 1, 2, 4 and 8 GPUs, 2×8 gangs, quarter and half GPU shares,
/// CPU-only work; three priority classes, eight tenants, time limits from 10 minutes to a day,
/// and some dependency chains.
pub fn mixed_jobs(n: usize, seed: u64, first_id: u64) -> Vec<JobSpec> {
    let mut rng = SplitMix64::new(seed);
    let mut jobs = Vec::with_capacity(n);
    for i in 0..n {
        let r = rng.below(100);
        let (gpus, tasks, milli) = match r {
            0..=34 => (1, 1, 0),
            35..=49 => (2, 1, 0),
            50..=59 => (4, 1, 0),
            60..=69 => (8, 1, 0),
            70..=74 => (8, 2, 0),
            75..=84 => (1, 1, 250),
            85..=94 => (1, 1, 500),
            _ => (0, 1, 0),
        };
        let priority = match rng.below(10) {
            0..=5 => "normal",
            6..=7 => "low",
            _ => "high",
        };
        let limits = [600, 3600, 4 * 3600, 24 * 3600];
        let tenant = rng.below(8);
        let limit = limits[rng.below(4) as usize];
        let preemptible = rng.below(4) == 0;
        let mut spec = job_spec(i, tenant, (gpus, tasks, milli), priority, limit);
        spec.preemptible = preemptible;
        // One job in twenty waits for the one before it.
        if i > 0 && rng.below(20) == 0 {
            spec.dependencies = vec![Dependency {
                kind: DependencyKind::AfterAny,
                job: first_id + i as u64 - 1,
            }];
        }
        jobs.push(spec);
    }
    jobs
}

/// A job of the synthetic mixes: `shape` is (GPUs per task, tasks, share milli); CPU and
/// memory follow the GPUs (2 CPUs and 32 GiB per GPU; shares 1 CPU and 8 GiB; CPU-only jobs
/// 4 CPUs and 16 GiB).
pub fn job_spec(
    i: usize,
    tenant: u64,
    shape: (u32, u32, u32),
    priority: &str,
    limit_s: u64,
) -> JobSpec {
    let (gpus, tasks, milli) = shape;
    let (cpu, memory) = match (gpus, milli) {
        (0, _) => (4000, 16_384),
        (_, 1..) => (1000, 8192),
        (g, _) => (2000 * u64::from(g), 32_768 * u64::from(g)),
    };
    JobSpec {
        tenant: format!("t{tenant}"),
        name: format!("job-{i}"),
        command: vec!["train".into()],
        gpus_per_task: gpus,
        tasks,
        priority_class: priority.into(),
        time_limit_secs: Some(limit_s),
        cpu_milli_per_task: cpu,
        memory_mib_per_task: memory,
        gpu_milli: milli,
        ..JobSpec::default()
    }
}

/// Submits jobs and returns their ids.
pub fn submit_all(driver: &mut Driver, jobs: &[JobSpec]) -> anyhow::Result<Vec<u64>> {
    let mut ids = Vec::with_capacity(jobs.len());
    for spec in jobs {
        match driver.apply(&Command::submit(spec.clone(), None)) {
            Outcome::JobSubmitted { id, .. } => ids.push(id),
            other => anyhow::bail!("submit {}: {other:?}", spec.name),
        }
    }
    Ok(ids)
}
