//! Built states for the render tests, through the real state machine and scheduler: a DGX
//! H100 and a MIG-mode H100, two tenants, jobs running whole, as a share and as a MIG slice,
//! one pending behind them, and one GPU marked unhealthy.

use std::collections::BTreeMap;

use proto::v1 as pb;

use crate::scheduler::{Board, Policy, plan_explained};
use crate::state::{Command, GpuHealth, JobSpec, Outcome, Tenant};
use crate::synthetic::{Driver, node_from_preset};

pub const NOW: u64 = 1_750_000_000_000;
pub const EVIL: &str = "<script>alert(1)</script>";

pub struct Fixture {
    pub driver: Driver,
    pub board: Board,
    /// (whole 4-GPU job named EVIL, share, MIG slice, pending 8-GPU job)
    pub jobs: (u64, u64, u64, u64),
}

fn spec(tenant: &str, name: &str, gpus: u32) -> JobSpec {
    JobSpec {
        tenant: tenant.into(),
        name: name.into(),
        command: vec!["sh".into(), "-c".into(), format!("echo {EVIL}")],
        gpus_per_task: gpus,
        tasks: 1,
        priority_class: "normal".into(),
        cpu_milli_per_task: 1000,
        memory_mib_per_task: 1024,
        ..JobSpec::default()
    }
}

fn submit(d: &mut Driver, s: JobSpec) -> u64 {
    match d.apply(&Command::submit(s, None)) {
        Outcome::JobSubmitted { id, .. } => id,
        other => panic!("submit: {other:?}"),
    }
}

/// One scheduling pass, applied; returns its reasons as the leader would publish them.
pub fn pass(d: &mut Driver) -> Board {
    let (plan, _, log) = plan_explained(&d.state, d.now, &Policy::default());
    if !plan.placements.is_empty() {
        let o = d.apply(&Command::Place {
            term: 3,
            placements: plan.placements,
        });
        assert!(matches!(o, Outcome::Placed { .. }), "{o:?}");
    }
    Board::new(3, d.now, log, Policy::default().max_jobs_per_pass)
}

pub fn fixture() -> Fixture {
    let mut d = Driver::new(NOW - 60_000);
    for (preset, host) in [("dgx-h100", "h1"), ("h100-pcie-1gpu-mig", "m1")] {
        let spec = node_from_preset(preset, host, None, BTreeMap::new()).unwrap();
        assert_eq!(
            d.apply(&Command::RegisterNode { spec }),
            Outcome::NodeRegistered
        );
    }
    for name in ["team-a", "team-b"] {
        d.apply(&Command::PutTenant {
            tenant: Tenant {
                name: name.into(),
                weight: 1,
                quota_gpus: 4,
                max_gpus: 0,
            },
        });
    }
    let whole = submit(&mut d, spec("team-a", EVIL, 4));
    let share = submit(
        &mut d,
        JobSpec {
            gpu_milli: 500,
            ..spec("team-b", "share", 1)
        },
    );
    let mig = submit(
        &mut d,
        JobSpec {
            mig_profile: Some("1g.10gb".into()),
            ..spec("team-b", "mig", 1)
        },
    );
    pass(&mut d);
    let pending = submit(&mut d, spec("team-a", "big", 8));
    d.now = NOW;
    let board = pass(&mut d);
    let gpu = d.state.nodes.get("h1").unwrap().spec.gpus[7].uuid.clone();
    d.apply(&Command::SetGpuHealth {
        node: "h1".into(),
        gpu,
        health: GpuHealth::Unhealthy {
            reason: "Xid 79: fell off the bus".into(),
        },
    });
    Fixture {
        driver: d,
        board,
        jobs: (whole, share, mig, pending),
    }
}

/// What `membership::status` answers on replica `id` of three, with replica `leader` leading.
pub fn status(id: u64, leader: u64) -> pb::ClusterStatusResponse {
    pb::ClusterStatusResponse {
        cluster: "test".into(),
        id,
        leader,
        term: 3,
        commit_index: 42,
        applied_index: 42,
        state: if id == leader { "leader" } else { "follower" }.into(),
        members: (1..=3)
            .map(|i| pb::Member {
                id: i,
                address: format!("127.0.0.1:700{i}"),
                role: "voter".into(),
                reachable: true,
                matched_index: 42,
                release: "0.2.0".into(),
                ..Default::default()
            })
            .collect(),
        cluster_version: 2,
        release: "0.2.0".into(),
        ..Default::default()
    }
}

/// The service `with_service` adds: tenant, name and key.
pub const SERVICE: (&str, &str) = ("team-b", "web");

/// Adds a node that hands out ports and a service of two replicas on it: revision 1 placed,
/// started, one of them ready; then a new command (revision 2, rolling out, its surge copy
/// placed), and a scale to 3 with a hostile reason (an event). The cluster version is raised first,
/// as a leader does once every replica reads services.
pub fn with_service(f: &mut Fixture) {
    use crate::state::{
        PortRange, Probe, ProbeCheck, ReplicaTemplate, RestartPolicy, RolloutStrategy, ServiceSpec,
    };
    let d = &mut f.driver;
    assert_eq!(
        d.apply(&Command::SetClusterVersion { version: 2 }),
        Outcome::Done
    );
    let mut node = node_from_preset("dgx-h100", "s1", None, BTreeMap::new()).unwrap();
    node.service_ports = Some(PortRange {
        first: 20000,
        last: 20099,
    });
    node.agent_address = "10.0.0.9:7100".into();
    assert_eq!(
        d.apply(&Command::RegisterNode { spec: node }),
        Outcome::NodeRegistered
    );
    let (tenant, name) = SERVICE;
    let template = |version: &str| ReplicaTemplate {
        job: JobSpec {
            tenant: tenant.into(),
            name: name.into(),
            command: vec!["serve".into(), version.into(), EVIL.into()],
            gpus_per_task: 1,
            tasks: 1,
            gpu_milli: 500,
            priority_class: "normal".into(),
            ports: vec!["http".into()],
            env: [("TOKEN".to_owned(), EVIL.to_owned())].into(),
            ..JobSpec::default()
        },
        readiness: Some(Probe::new(ProbeCheck::Http {
            port: "http".into(),
            path: "/ready".into(),
        })),
        liveness: Some(Probe::new(ProbeCheck::Exec {
            command: vec!["/bin/sh".into(), "-c".into(), format!("test {EVIL}")],
        })),
    };
    let spec = |version: &str| ServiceSpec {
        tenant: tenant.into(),
        name: name.into(),
        template: template(version),
        replicas: 2,
        strategy: RolloutStrategy::default(),
        restart: RestartPolicy::default(),
        autoscale: None,
    };
    let put = |d: &mut Driver, s: ServiceSpec| {
        let o = d.apply(&Command::PutService {
            spec: Box::new(s),
            create_only: false,
        });
        assert!(matches!(o, Outcome::ServiceChanged { .. }), "{o:?}");
    };
    put(d, spec("--v1"));
    pass(d);
    let key = crate::state::service_key(tenant, name);
    let replica_allocations = |d: &Driver| -> Vec<u64> {
        d.state.services[&key]
            .replicas
            .values()
            .flat_map(|j| d.state.allocations_of(*j).map(|a| a.allocation.id))
            .collect()
    };
    let placed = replica_allocations(d);
    assert_eq!(placed.len(), 2, "both replicas placed");
    for a in &placed {
        assert_eq!(
            d.apply(&Command::AllocationStarted { allocation: *a }),
            Outcome::Done
        );
    }
    assert_eq!(
        d.apply(&Command::ReplicaReadiness {
            allocation: placed[0],
            ready: true,
            reason: String::new(),
        }),
        Outcome::Done
    );
    put(d, spec("--v2"));
    pass(d);
    let o = d.apply(&Command::ScaleService {
        service: key,
        replicas: 3,
        reason: EVIL.into(),
    });
    assert!(matches!(o, Outcome::ServiceChanged { .. }), "{o:?}");
}
