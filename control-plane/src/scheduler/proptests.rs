//! Property tests of the scheduling policy.
//!
//! Every state here is reached through `ClusterState::apply`, as a replica reaches it: a random
//! cluster (1–6 nodes of 1–8 GPUs, link matrices, MIG-mode and unhealthy GPUs, NUMA nodes, racks,
//! partitions), 1–3 tenants with weights, quotas and limits, jobs of every kind, and running work
//! obtained by earlier passes of the scheduler itself (`plan` + `Place`, some allocations started,
//! some stopping, some exited). A plan is then computed at a later `now` and applied the way the
//! leader applies it (`Place`, then `Preempt`).
//!
//! Properties:
//! 1. no double booking: apply accepts every placement of a plan computed on the same state, and
//!    no GPU, MIG slice or share capacity is handed out twice;
//! 2. quotas: a placement never takes a tenant past `max_gpus`, over successive passes;
//! 3. gangs: a job is placed with all its tasks or not at all;
//! 4. backfill: the reserved job can start at its reservation, with and without the jobs this
//!    pass backfilled;
//! 5. aging: a low-priority job's wait is bounded under an adversarial high-priority stream, and
//!    the queue serves the aged level first, in eligibility order;
//! 6. determinism: a snapshot round trip does not change the plan (invariant 4);
//!
//! plus preemption: victims pass apply's check and their exits make room for the preemptor.
//!
//! The runs are deterministic (a fixed seed, no persistence file); set `PROPTEST_RNG_SEED` to
//! explore other cases and `SCHEDULER_PROPTEST_SCALE` to multiply the case counts.
//!
//! The fixed cases at the end are the minimal inputs of bugs these properties found (multi-task
//! shares on one GPU, a requeued victim overtaking its preemptor, backfill using the head
//! tenant's limit, a quota reclaim invalidated by the pass's own placements, single-NUMA MIG).

use std::collections::{BTreeMap, BTreeSet};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestCaseError};

use super::*;
use crate::state::{
    AllocationId, Command, Dependency, DependencyKind, Gpu, GpuHealth, JobId, JobSpec, JobState,
    MigSlice, NodeSpec, NodeStatus, Outcome, Partition, TaskOutcome, Tenant, share_memory_for,
};

/// Leader clock at the start of every run.
const T0: Timestamp = 1_700_000_000_000;
const MINUTE: u64 = 60_000;

const MODELS: [&str; 2] = ["A100", "H100"];
const PARTITIONS: [&str; 2] = ["pa", "pb"];
const PRIORITIES: [&str; 3] = ["low", "normal", "high"];
const MIG_PROFILE: &str = "1g.10gb";

use super::tests::{A100_PAIRS, DGX1, matrix};

/// `cases`, times `SCHEDULER_PROPTEST_SCALE` when set (for longer searches by hand).
fn config(cases: u32) -> ProptestConfig {
    let default = ProptestConfig::default();
    let scale = std::env::var("SCHEDULER_PROPTEST_SCALE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(1);
    ProptestConfig {
        cases: cases * scale,
        max_shrink_iters: 1024,
        // Deterministic unless PROPTEST_RNG_SEED asks for another seed.
        rng_seed: match default.rng_seed {
            RngSeed::Random => RngSeed::Fixed(0x5c4e_d01e),
            seed => seed,
        },
        failure_persistence: None,
        ..default
    }
}

// ---------------------------------------------------------------------------------------------
// Applying commands as a replica does
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct Sim {
    state: ClusterState,
    index: u64,
}

impl Sim {
    fn new() -> Sim {
        Sim {
            state: ClusterState::default(),
            index: 0,
        }
    }

    fn apply(&mut self, command: Command, at: Timestamp) -> Outcome {
        self.index += 1;
        self.state.apply(&command, at, self.index).outcome
    }

    fn submit(&mut self, spec: JobSpec, at: Timestamp) -> Option<JobId> {
        match self.apply(Command::submit(spec, None), at) {
            Outcome::JobSubmitted { id, .. } => Some(id),
            _ => None,
        }
    }

    /// Commits a plan's placements as the leader does: apply must accept every one of them, in
    /// order, since the plan was computed on this very state.
    fn place(&mut self, plan: &Plan, at: Timestamp) -> Result<(), TestCaseError> {
        if plan.placements.is_empty() {
            return Ok(());
        }
        let want: Vec<JobId> = plan.placements.iter().map(|p| p.job).collect();
        let command = Command::Place {
            term: 1,
            placements: plan.placements.clone(),
        };
        match self.apply(command, at) {
            Outcome::Placed { accepted, rejected } => {
                prop_assert!(
                    rejected.is_empty(),
                    "apply refused placements of a plan computed on the same state: {:?}\nplan: {:?}",
                    rejected,
                    plan.placements
                );
                prop_assert_eq!(accepted, want);
                Ok(())
            }
            other => Err(TestCaseError::fail(format!("Place answered {other:?}"))),
        }
    }

    /// Commits a plan's preemptions (before its placements, as the leader does); returns the
    /// victims apply refused.
    fn preempt(&mut self, plan: &Plan, at: Timestamp) -> Vec<(JobId, String)> {
        let mut refused = Vec::new();
        for p in &plan.preemptions {
            let command = Command::Preempt {
                for_job: p.for_job,
                victims: p.victims.clone(),
                reason: String::new(),
            };
            match self.apply(command, at) {
                Outcome::Preempted { rejected, .. } => refused.extend(rejected),
                Outcome::Rejected(r) => refused.push((p.for_job, r.message)),
                other => refused.push((p.for_job, format!("{other:?}"))),
            }
        }
        refused
    }

    /// One leader pass: plan, preempt, place.
    fn pass(&mut self, at: Timestamp, policy: &Policy) -> Result<Plan, TestCaseError> {
        let plan = plan_with(&self.state, at, policy);
        check_plan(&self.state, &plan)?;
        self.preempt(&plan, at);
        self.place(&plan, at)?;
        Ok(plan)
    }

    fn exit(&mut self, allocation: AllocationId, outcome: TaskOutcome, at: Timestamp) {
        self.apply(
            Command::AllocationExited {
                allocation,
                outcome,
                usage: None,
            },
            at,
        );
    }

    fn live(&self) -> Vec<AllocationId> {
        self.state.allocations.keys().copied().collect()
    }

    fn start_some(&mut self, dice: &mut Dice, at: Timestamp) {
        let fresh: Vec<AllocationId> = self
            .state
            .allocations
            .values()
            .filter(|r| !r.started)
            .map(|r| r.allocation.id)
            .collect();
        for allocation in fresh {
            if !dice.next().is_multiple_of(4) {
                self.apply(Command::AllocationStarted { allocation }, at);
            }
        }
    }
}

/// Random choices made while building a state, from a generated list (so they shrink).
struct Dice<'a> {
    rolls: &'a [u8],
    at: usize,
}

impl<'a> Dice<'a> {
    fn new(rolls: &'a [u8]) -> Dice<'a> {
        Dice { rolls, at: 0 }
    }

    fn next(&mut self) -> u8 {
        if self.rolls.is_empty() {
            return 0;
        }
        let r = self.rolls[self.at % self.rolls.len()];
        self.at += 1;
        // Vary a cycled list a little so long runs do not repeat exactly.
        r.wrapping_add((self.at / self.rolls.len()) as u8)
    }
}

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct NodeGen {
    gpus: u32,
    h100: bool,
    small_gpus: bool,
    topology: bool,
    /// Per GPU: 0 MIG mode (7 × 1g.10gb), 1 unhealthy, anything else a healthy plain GPU.
    kinds: Vec<u8>,
    numa: bool,
    rack: Option<u8>,
    partition: Option<u8>,
    big_host: bool,
}

fn node_gen() -> impl Strategy<Value = NodeGen> {
    (
        prop_oneof![3 => Just(8u32), 2 => Just(4u32), 3 => 1u32..=8],
        any::<bool>(),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.6),
        vec(0u8..14, 8),
        any::<bool>(),
        proptest::option::weighted(0.4, 0u8..2),
        proptest::option::weighted(0.25, 0u8..2),
        any::<bool>(),
    )
        .prop_map(
            |(gpus, h100, small_gpus, topology, kinds, numa, rack, partition, big_host)| NodeGen {
                gpus,
                h100,
                small_gpus,
                topology,
                kinds,
                numa,
                rack,
                partition,
                big_host,
            },
        )
}

fn node_name(i: usize) -> String {
    format!("n{i}")
}

fn node_spec(i: usize, g: &NodeGen) -> NodeSpec {
    let name = node_name(i);
    let model = MODELS[usize::from(g.h100)];
    let memory_mib = if g.small_gpus { 40_960 } else { 81_920 };
    let gpus = (0..g.gpus)
        .map(|k| {
            let kind = g.kinds[k as usize];
            Gpu {
                uuid: format!("GPU-{name}-{k}"),
                index: k,
                model: model.into(),
                memory_mib,
                numa_node: g.numa.then_some(k * 2 / g.gpus),
                pci_bus_id: String::new(),
                health: if kind == 1 {
                    GpuHealth::Unhealthy {
                        reason: "Xid 79".into(),
                    }
                } else {
                    GpuHealth::Healthy
                },
                mig: if kind == 0 {
                    (0..7)
                        .map(|s| MigSlice {
                            uuid: format!("MIG-{name}-{k}-{s}"),
                            profile: MIG_PROFILE.into(),
                            memory_mib: 9_728,
                        })
                        .collect()
                } else {
                    Vec::new()
                },
            }
        })
        .collect();
    let topology = match (g.topology, g.gpus) {
        (true, 8) => matrix(DGX1),
        (true, 4) => matrix(A100_PAIRS),
        _ => Vec::new(),
    };
    NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name,
        gpus,
        cpu_milli: if g.big_host { 128_000 } else { 32_000 },
        memory_mib: if g.big_host { 1 << 20 } else { 256 * 1024 },
        partition: g.partition.map(|p| PARTITIONS[p as usize].to_owned()),
        labels: g
            .rack
            .map(|r| (fleet::RACK_LABEL.to_owned(), format!("r{r}")))
            .into_iter()
            .collect(),
        topology,
        agent_address: String::new(),
        driver: String::new(),
        incarnation: String::new(),
    }
}

#[derive(Debug, Clone)]
struct TenantGen {
    weight: u32,
    quota: u32,
    /// `max_gpus` beyond the quota; None: no limit.
    extra: Option<u32>,
}

fn tenant_gen() -> impl Strategy<Value = TenantGen> {
    (
        1u32..=4,
        0u32..=4,
        proptest::option::weighted(0.6, 0u32..=4),
    )
        .prop_map(|(weight, quota, extra)| TenantGen {
            weight,
            quota,
            extra,
        })
}

fn tenant(i: usize, t: &TenantGen) -> Tenant {
    Tenant {
        name: format!("t{i}"),
        weight: t.weight,
        quota_gpus: t.quota,
        // 0 is "no limit": a quota of 0 with no extra stays unlimited.
        max_gpus: t.extra.map_or(0, |e| t.quota + e),
    }
}

#[derive(Debug, Clone)]
enum GpuAsk {
    Whole(u32),
    Share { milli: u32, memory_mib: Option<u64> },
    Mig(u32),
}

#[derive(Debug, Clone)]
struct JobGen {
    tenant: usize,
    ask: GpuAsk,
    tasks: u32,
    priority: u8,
    preemptible: bool,
    limit_secs: Option<u64>,
    cpu_milli: u64,
    memory_mib: u64,
    model: Option<u8>,
    partition: Option<u8>,
    single_numa: bool,
    /// (kind, which earlier job).
    dependency: Option<(u8, usize)>,
}

fn gpu_ask() -> impl Strategy<Value = GpuAsk> {
    prop_oneof![
        6 => prop_oneof![1 => Just(0u32), 6 => 1u32..=4, 2 => 5u32..=8].prop_map(GpuAsk::Whole),
        3 => (100u32..=900, proptest::option::weighted(0.3, 5_000u64..=60_000))
            .prop_map(|(milli, memory_mib)| GpuAsk::Share { milli, memory_mib }),
        1 => (1u32..=4).prop_map(GpuAsk::Mig),
    ]
}

fn job_gen() -> impl Strategy<Value = JobGen> {
    job_gen_with(false)
}

/// `share_gangs`: whether a share job may have several tasks. Off in the general generators:
/// the scheduler may put two tasks of one share job on one GPU, which apply refuses (see
/// `a_share_gang_plan_is_accepted_by_apply`), and that would mask everything else.
fn job_gen_with(share_gangs: bool) -> impl Strategy<Value = JobGen> {
    (
        0usize..3,
        gpu_ask(),
        prop_oneof![6 => Just(1u32), 2 => Just(2u32), 1 => Just(3u32)],
        0u8..3,
        prop::bool::weighted(0.4),
        proptest::option::weighted(0.8, prop_oneof![1u64..=30, 31u64..=240]),
        prop_oneof![2 => Just(0u64), 1 => 1_000u64..=16_000],
        prop_oneof![2 => Just(0u64), 1 => 1_024u64..=131_072],
        proptest::option::weighted(0.15, 0u8..2),
        proptest::option::weighted(0.1, 0u8..2),
        prop::bool::weighted(0.2),
        proptest::option::weighted(0.1, (0u8..3, any::<usize>())),
    )
        .prop_map(
            move |(
                tenant,
                ask,
                tasks,
                priority,
                preemptible,
                minutes,
                cpu_milli,
                memory_mib,
                model,
                partition,
                single_numa,
                dependency,
            )| JobGen {
                tenant,
                priority,
                preemptible,
                limit_secs: minutes.map(|m| m * 60),
                tasks: if matches!(ask, GpuAsk::Share { .. }) && !share_gangs {
                    1
                } else {
                    tasks
                },
                cpu_milli,
                memory_mib,
                model,
                partition,
                single_numa,
                dependency,
                ask,
            },
        )
}

fn job_spec(j: &JobGen, tenants: usize, earlier: &[JobId]) -> JobSpec {
    let (gpus, gpu_milli, gpu_memory_mib, mig_profile) = match &j.ask {
        GpuAsk::Whole(g) => (*g, 0, 0, None),
        GpuAsk::Share { milli, memory_mib } => (1, *milli, memory_mib.unwrap_or(0), None),
        GpuAsk::Mig(n) => (*n, 0, 0, Some(MIG_PROFILE.to_owned())),
    };
    let kinds = [
        DependencyKind::AfterOk,
        DependencyKind::AfterAny,
        DependencyKind::AfterNotOk,
    ];
    JobSpec {
        tenant: format!("t{}", j.tenant % tenants.max(1)),
        command: vec!["train".into()],
        gpus_per_task: gpus,
        tasks: j.tasks,
        gpu_models: j
            .model
            .filter(|_| gpus > 0)
            .map(|m| vec![MODELS[m as usize].to_owned()])
            .unwrap_or_default(),
        partition: j.partition.map(|p| PARTITIONS[p as usize].to_owned()),
        priority_class: PRIORITIES[j.priority as usize].into(),
        time_limit_secs: j.limit_secs,
        dependencies: j
            .dependency
            .filter(|_| !earlier.is_empty())
            .map(|(k, i)| Dependency {
                kind: kinds[k as usize],
                job: earlier[i % earlier.len()],
            })
            .into_iter()
            .collect(),
        // A job must ask for something.
        cpu_milli_per_task: if gpus == 0 {
            j.cpu_milli.max(500)
        } else {
            j.cpu_milli
        },
        memory_mib_per_task: j.memory_mib,
        gpu_milli,
        gpu_memory_mib,
        mig_profile,
        preemptible: j.preemptible,
        single_numa: j.single_numa,
        ..JobSpec::default()
    }
}

/// A random cluster with running work and a pending queue.
#[derive(Debug, Clone)]
struct Scenario {
    nodes: Vec<NodeGen>,
    tenants: Vec<TenantGen>,
    /// Submitted, then placed by a first pass.
    first: Vec<JobGen>,
    /// Submitted after the first pass, placed by a second.
    second: Vec<JobGen>,
    /// Submitted last: the bulk of the pending queue.
    pending: Vec<JobGen>,
    /// Minutes before the first pass, the second pass, the last submissions, and `now`.
    gaps: [u64; 4],
    dice: Vec<u8>,
    /// How nodes are scored: the default (fgd-h), plain FGD or best-fit.
    scoring: ScorePolicy,
    /// A GPU that fails after the first pass (its holder keeps it until it exits).
    sick: Option<(usize, u32)>,
    /// A node drained after the first pass.
    drain: Option<usize>,
}

fn scenario_with(
    nodes: std::ops::RangeInclusive<usize>,
    first: std::ops::RangeInclusive<usize>,
    pending: std::ops::RangeInclusive<usize>,
    share_gangs: bool,
) -> impl Strategy<Value = Scenario> {
    (
        vec(node_gen(), nodes),
        vec(tenant_gen(), 1..=3),
        vec(job_gen_with(share_gangs), first),
        vec(job_gen_with(share_gangs), 0..=6),
        vec(job_gen_with(share_gangs), pending),
        [0u64..=60, 0u64..=90, 0u64..=60, 0u64..=120],
        vec(any::<u8>(), 1..=24),
        prop_oneof![
            2 => Just(ScorePolicy::FgdHorizon),
            1 => Just(ScorePolicy::Fgd),
            1 => Just(ScorePolicy::BestFit),
        ],
        proptest::option::weighted(0.15, (any::<usize>(), 0u32..8)),
        proptest::option::weighted(0.1, any::<usize>()),
    )
        .prop_map(
            |(nodes, tenants, first, second, pending, gaps, dice, scoring, sick, drain)| Scenario {
                nodes,
                tenants,
                first,
                second,
                pending,
                gaps,
                dice,
                scoring,
                sick,
                drain,
            },
        )
}

fn scenario() -> impl Strategy<Value = Scenario> {
    scenario_with(1..=6, 0..=10, 1..=12, false)
}

/// Few nodes and much running work: most passes leave a head job that cannot start now
/// (reservations, preemptions).
/// Running work is mostly low or normal priority, often preemptible, and always has a time
/// limit (the second wave's may not); MIG-mode and unhealthy GPUs only in position 0; no
/// partitions; gangs no wider than the fleet; little aging. So most passes leave a head job that can start later (reservations) or could start by
/// evicting lower-priority work (preemptions).
fn busy_scenario() -> impl Strategy<Value = Scenario> {
    scenario_with(1..=3, 4..=14, 2..=12, false).prop_map(|mut s| {
        let nodes = s.nodes.len() as u32;
        for n in &mut s.nodes {
            n.partition = None;
            for k in n.kinds.iter_mut().skip(1) {
                *k = (*k).max(2);
            }
        }
        for j in s
            .first
            .iter_mut()
            .chain(&mut s.second)
            .chain(&mut s.pending)
        {
            j.partition = None;
            j.tasks = j.tasks.min(nodes);
        }
        for j in &mut s.first {
            j.priority %= 2;
            j.preemptible |= j.priority == 0;
            j.limit_secs = j.limit_secs.or(Some(4 * 3600));
            j.dependency = None;
        }
        for g in &mut s.gaps {
            *g %= 20;
        }
        s
    })
}

/// A busy scenario where the running work is mostly low priority and preemptible and the
/// pending work mostly high priority, and tenant limits are loose: most heads may preempt.
fn contended_scenario() -> impl Strategy<Value = Scenario> {
    busy_scenario().prop_map(|mut s| {
        for t in &mut s.tenants {
            t.extra = t.extra.map(|e| e + 6);
        }
        for j in &mut s.first {
            j.priority /= 2;
            j.preemptible |= j.priority == 0;
        }
        for j in &mut s.pending {
            j.priority = 2 - j.priority / 2;
        }
        s
    })
}

/// A built scenario: the state, the time of the pass under test, the policy.
struct Built {
    sim: Sim,
    now: Timestamp,
    policy: Policy,
    /// Tenants in the order generated.
    tenants: usize,
}

fn build(s: &Scenario) -> Result<Built, TestCaseError> {
    let mut sim = Sim::new();
    let mut at = T0;
    for p in PARTITIONS {
        sim.apply(
            Command::PutPartition {
                partition: Partition {
                    name: p.into(),
                    description: String::new(),
                },
            },
            at,
        );
    }
    for (i, t) in s.tenants.iter().enumerate() {
        sim.apply(
            Command::PutTenant {
                tenant: tenant(i, t),
            },
            at,
        );
    }
    for (i, n) in s.nodes.iter().enumerate() {
        let outcome = sim.apply(
            Command::RegisterNode {
                spec: node_spec(i, n),
            },
            at,
        );
        prop_assert_eq!(outcome, Outcome::NodeRegistered);
    }
    let policy = Policy {
        scoring: s.scoring.clone(),
        ..Policy::default()
    };
    let tenants = s.tenants.len();
    let mut dice = Dice::new(&s.dice);
    let mut ids: Vec<JobId> = Vec::new();
    let mut submit = |sim: &mut Sim, jobs: &[JobGen], at: &mut Timestamp| {
        for j in jobs {
            *at += 1000;
            if let Some(id) = sim.submit(job_spec(j, tenants, &ids), *at) {
                ids.push(id);
            }
        }
    };
    submit(&mut sim, &s.first, &mut at);
    at += s.gaps[0] * MINUTE + 1000;
    sim.pass(at, &policy)?;
    at += 1000;
    sim.start_some(&mut dice, at);
    if let Some((n, g)) = s.sick {
        let node = node_name(n % s.nodes.len());
        sim.apply(
            Command::SetGpuHealth {
                node,
                gpu: g.to_string(),
                health: GpuHealth::Unhealthy {
                    reason: "Xid 48".into(),
                },
            },
            at,
        );
    }
    if let Some(n) = s.drain {
        sim.apply(
            Command::SetNodeStatus {
                node: node_name(n % s.nodes.len()),
                status: NodeStatus::Drained,
                evict: false,
                reason: String::new(),
            },
            at,
        );
    }
    // Some running jobs are cancelled: their allocations stay held, stopping.
    let running: Vec<JobId> = sim.state.jobs_with_allocations().map(|j| j.id).collect();
    for job in running {
        if dice.next().is_multiple_of(6) {
            sim.apply(Command::cancel(job, "changed my mind"), at);
        }
    }
    submit(&mut sim, &s.second, &mut at);
    at += s.gaps[1] * MINUTE + 1000;
    sim.pass(at, &policy)?;
    at += 1000;
    sim.start_some(&mut dice, at);
    // Some tasks end, each its own way (a gang's other tasks are then asked to stop).
    for allocation in sim.live() {
        let outcome = match dice.next() % 10 {
            0 | 1 => TaskOutcome::Succeeded,
            2 => TaskOutcome::Failed {
                exit_code: Some(1),
                signal: None,
                reason: String::new(),
            },
            3 => TaskOutcome::Stopped,
            4 => TaskOutcome::Lost {
                reason: "GPU fell off the bus".into(),
            },
            _ => continue,
        };
        at += 1000;
        sim.exit(allocation, outcome, at);
    }
    at += s.gaps[2] * MINUTE;
    submit(&mut sim, &s.pending, &mut at);
    let now = at + s.gaps[3] * MINUTE + 1;
    Ok(Built {
        sim,
        now,
        policy,
        tenants,
    })
}

// ---------------------------------------------------------------------------------------------
// Checks shared by the properties
// ---------------------------------------------------------------------------------------------

fn tenant_limit(state: &ClusterState, tenant: &str) -> Option<u64> {
    state
        .tenants
        .get(tenant)
        .map(|t| u64::from(t.max_gpus) * MILLI_PER_GPU)
        .filter(|m| *m > 0)
}

/// What a plan must satisfy against the state it was computed on, before it is applied
/// (properties 1, 2 and 3, judged on the plan itself rather than on apply's re-check).
fn check_plan(state: &ClusterState, plan: &Plan) -> Result<(), TestCaseError> {
    check_plan_with(state, plan, false)
}

/// `mig_numa`: also hold MIG jobs to `single_numa` (known bug: see
/// `a_single_numa_mig_task_stays_on_one_numa_node`).
fn check_plan_with(state: &ClusterState, plan: &Plan, mig_numa: bool) -> Result<(), TestCaseError> {
    let mut placed = BTreeSet::new();
    // Whole GPUs and MIG slices handed out by this plan.
    let mut exclusive: BTreeSet<&str> = BTreeSet::new();
    // Shares handed out by this plan: GPU → (milli, MiB).
    let mut shares: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut milli_of_tenant: BTreeMap<&str, u64> = BTreeMap::new();
    for p in &plan.placements {
        prop_assert!(
            placed.insert(p.job),
            "job {} placed twice in one plan",
            p.job
        );
        let job = &state.jobs[&p.job];
        let spec = &job.spec;
        prop_assert_eq!(job.state, JobState::Pending);
        prop_assert!(job.allocations.is_empty());
        prop_assert!(
            dependencies_met(state, job),
            "job {} placed before its dependencies are met",
            job.id
        );
        // Property 3: the whole gang, each task with all its units.
        prop_assert_eq!(
            p.tasks.len(),
            spec.tasks as usize,
            "job {} is a gang of {} tasks",
            job.id,
            spec.tasks
        );
        for task in &p.tasks {
            prop_assert_eq!(task.gpus.len(), spec.gpus_per_task as usize);
            let node = &state.nodes[&task.node];
            prop_assert_eq!(node.status, NodeStatus::Ready);
            let mut numa = BTreeSet::new();
            for uuid in &task.gpus {
                let gpu = node
                    .spec
                    .gpus
                    .iter()
                    .find(|g| &g.uuid == uuid || g.mig.iter().any(|m| &m.uuid == uuid));
                prop_assert!(gpu.is_some(), "{} is not on {}", uuid, task.node);
                let gpu = gpu.unwrap();
                numa.insert(gpu.numa_node);
                if spec.is_share() {
                    let want =
                        share_memory_for(spec.gpu_milli, spec.gpu_memory_mib, gpu.memory_mib);
                    let s = shares.entry(uuid.as_str()).or_default();
                    s.0 += u64::from(spec.gpu_milli);
                    s.1 += want;
                    prop_assert!(
                        !exclusive.contains(uuid.as_str()),
                        "{} is shared and held whole",
                        uuid
                    );
                } else {
                    prop_assert!(
                        exclusive.insert(uuid.as_str()),
                        "{} is handed out twice in one plan",
                        uuid
                    );
                    prop_assert!(
                        !shares.contains_key(uuid.as_str()),
                        "{} is shared and held whole",
                        uuid
                    );
                }
            }
            if spec.single_numa && (mig_numa || spec.mig_profile.is_none()) {
                prop_assert!(
                    numa.len() <= 1,
                    "single-NUMA job {} spans NUMA nodes {:?}",
                    job.id,
                    numa
                );
            }
        }
        *milli_of_tenant.entry(spec.tenant.as_str()).or_default() += spec.total_gpu_milli();
    }
    // Property 1 for shares: existing plus planned never beyond one GPU.
    for (uuid, (milli, memory)) in &shares {
        let held = state.index.gpu_shares.get(*uuid);
        let held_milli = held.map_or(0, |s| u64::from(s.milli));
        let held_memory = held.map_or(0, |s| s.memory_mib);
        prop_assert!(
            held_milli + milli <= MILLI_PER_GPU,
            "{}: {} milli held + {} planned",
            uuid,
            held_milli,
            milli
        );
        let capacity = state
            .nodes
            .values()
            .flat_map(|n| n.spec.gpus.iter())
            .find(|g| &g.uuid == uuid)
            .map_or(0, |g| g.memory_mib);
        prop_assert!(
            held_memory + memory <= capacity,
            "{} memory overbooked",
            uuid
        );
    }
    // Property 2 on the plan alone: a tenant that gets anything stays within its limit.
    for (tenant, milli) in milli_of_tenant {
        if let Some(limit) = tenant_limit(state, tenant)
            && milli > 0
        {
            let held = state.gpu_milli_held_by_tenant(tenant);
            prop_assert!(
                held + milli <= limit,
                "tenant {} holds {} milli, the plan adds {}, its limit is {}",
                tenant,
                held,
                milli,
                limit
            );
        }
    }
    Ok(())
}

/// What must hold once a plan's placements are applied (properties 1 and 3).
fn check_applied(
    before: &ClusterState,
    after: &ClusterState,
    plan: &Plan,
) -> Result<(), TestCaseError> {
    if let Err(e) = after.check_consistency() {
        return Err(TestCaseError::fail(format!(
            "inconsistent after Place: {e}"
        )));
    }
    for (uuid, s) in &after.index.gpu_shares {
        prop_assert!(
            u64::from(s.milli) <= MILLI_PER_GPU,
            "{} carries {} milli",
            uuid,
            s.milli
        );
        let capacity = after
            .nodes
            .values()
            .flat_map(|n| n.spec.gpus.iter())
            .find(|g| &g.uuid == uuid)
            .map_or(0, |g| g.memory_mib);
        prop_assert!(s.memory_mib <= capacity, "{} memory overbooked", uuid);
    }
    for node in after.nodes.values() {
        let (cpu, memory) = after.node_usage(&node.spec.name);
        let (cpu_before, memory_before) = before.node_usage(&node.spec.name);
        if (cpu, memory) != (cpu_before, memory_before) {
            prop_assert!(cpu <= node.spec.cpu_milli && memory <= node.spec.memory_mib);
        }
    }
    let placed: BTreeSet<JobId> = plan.placements.iter().map(|p| p.job).collect();
    for (id, job) in &after.jobs {
        if placed.contains(id) {
            prop_assert_eq!(job.allocations.len(), job.spec.tasks as usize);
            for rec in after.allocations_of(*id) {
                prop_assert_eq!(rec.allocation.gpus.len(), job.spec.gpus_per_task as usize);
            }
        } else {
            // Jobs outside the plan hold exactly what they held.
            prop_assert_eq!(&job.allocations, &before.jobs[id].allocations);
            prop_assert_eq!(job.state, before.jobs[id].state);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Property 4: the reservation
// ---------------------------------------------------------------------------------------------

/// Plans at the reservation's start on a copy of `sim` where the reserved job is the only
/// pending job and the work that ends by then (by its time limit, or because it is stopping)
/// has ended; the reserved job must be placed.
fn check_reservation_holds(
    mut sim: Sim,
    r: &Reservation,
    policy: &Policy,
    what: &str,
) -> Result<(), TestCaseError> {
    let start = r.start_at;
    let ending: Vec<AllocationId> = sim
        .state
        .allocations
        .values()
        .filter(|rec| {
            rec.stop_requested
                || sim
                    .state
                    .jobs
                    .get(&rec.allocation.job)
                    .and_then(|j| j.spec.time_limit_secs)
                    .is_some_and(|l| rec.allocation.created_at + l * 1000 <= start)
        })
        .map(|rec| rec.allocation.id)
        .collect();
    for a in ending {
        sim.exit(a, TaskOutcome::Succeeded, start);
    }
    // After the exits: a stopped job may have been requeued.
    let others: Vec<JobId> = sim
        .state
        .index
        .pending
        .iter()
        .copied()
        .filter(|&j| j != r.job)
        .collect();
    for j in others {
        sim.apply(Command::cancel(j, "experiment"), start);
    }
    let plan = plan_with(&sim.state, start, policy);
    if plan.placements.iter().any(|p| p.job == r.job) {
        return Ok(());
    }
    let job = &sim.state.jobs[&r.job];
    let tenant = job.spec.tenant.as_str();
    Err(TestCaseError::fail(format!(
        "{what}: job {} reserved at {} (nodes {:?}) cannot start then: tenant {} holds {} milli \
         (limit {:?}) and asks for {}; running then: {:?}; plan then: {:?}",
        r.job,
        start,
        r.nodes,
        tenant,
        sim.state.gpu_milli_held_by_tenant(tenant),
        tenant_limit(&sim.state, tenant),
        job.spec.total_gpu_milli(),
        sim.state
            .allocations
            .values()
            .map(|a| (
                a.allocation.job,
                a.allocation.node.clone(),
                a.allocation.gpus.clone()
            ))
            .collect::<Vec<_>>(),
        plan
    )))
}

/// Property 4.
fn backfill_property(s: &Scenario) -> Result<(), TestCaseError> {
    let b = build(s)?;
    let plan = plan_with(&b.sim.state, b.now, &b.policy);
    let Some(r) = &plan.reservation else {
        return Ok(());
    };
    prop_assert!(r.start_at >= b.now);
    prop_assert!(!plan.placements.iter().any(|p| p.job == r.job));
    prop_assert_eq!(
        r.nodes.values().sum::<u32>(),
        b.sim.state.jobs[&r.job].spec.tasks
    );
    check_reservation_holds(b.sim.clone(), r, &b.policy, "before the plan")?;
    let mut after = b.sim.clone();
    after.place(&plan, b.now)?;
    check_reservation_holds(after, r, &b.policy, "after the plan's placements")
}

/// The preemption property.
fn preemption_property(s: &Scenario) -> Result<(), TestCaseError> {
    let b = build(s)?;
    let state = &b.sim.state;
    let plan = plan_with(state, b.now, &b.policy);
    prop_assert!(plan.preemptions.len() <= 1);
    let Some(p) = plan.preemptions.first() else {
        return Ok(());
    };
    let head = &state.jobs[&p.for_job];
    prop_assert_eq!(head.state, JobState::Pending);
    prop_assert!(!plan.placements.iter().any(|x| x.job == head.id));
    prop_assert!(!p.victims.is_empty());
    for v in &p.victims {
        prop_assert!(
            state.check_preemption(head, *v).is_ok(),
            "victim {} not allowed",
            v
        );
    }
    let mut sim = b.sim.clone();
    let refused = sim.preempt(&plan, b.now);
    sim.place(&plan, b.now)?;
    if !refused.is_empty() {
        return Err(TestCaseError::fail(format!(
            "apply refused victims {refused:?} of {p:?}"
        )));
    }
    let stopping: Vec<AllocationId> = p
        .victims
        .iter()
        .flat_map(|v| sim.state.jobs[v].allocations.clone())
        .collect();
    for a in stopping {
        prop_assert!(sim.state.allocations[&a].stop_requested);
        sim.exit(a, TaskOutcome::Stopped, b.now + 1000);
    }
    for v in &p.victims {
        prop_assert_eq!(
            sim.state.jobs[v].state,
            JobState::Pending,
            "victim {} requeued",
            v
        );
    }
    let others: Vec<JobId> = sim
        .state
        .index
        .pending
        .iter()
        .copied()
        .filter(|&j| j != head.id)
        .collect();
    for j in others {
        sim.apply(Command::cancel(j, "experiment"), b.now + 1000);
    }
    let next = plan_with(&sim.state, b.now + 2000, &b.policy);
    if next.placements.iter().any(|x| x.job == head.id) {
        return Ok(());
    }
    Err(TestCaseError::fail(format!(
        "preemptor {} not placed after its victims {:?} stopped; plan {:?}",
        head.id, p.victims, next
    )))
}

// ---------------------------------------------------------------------------------------------
// Property 5: aging
// ---------------------------------------------------------------------------------------------

/// One pass every tick.
const TICK: u64 = MINUTE;
/// Longest time limit in the aging simulation, in ticks.
const MAX_LIMIT_TICKS: u64 = 6;

#[derive(Debug, Clone)]
struct AgingCase {
    gpus: u32,
    step_ticks: u64,
    low_gpus: u32,
    low_limit: u64,
    /// Arrivals per tick before the low job's: (class, GPUs, limit in ticks). These are the
    /// jobs that can be ahead of it at the aged level.
    backlog: Vec<Vec<(u8, u32, u64)>>,
    /// High-priority arrivals per tick from the low job's submission on (cycled): (GPUs, limit).
    stream: Vec<Vec<(u32, u64)>>,
}

fn aging_case() -> impl Strategy<Value = AgingCase> {
    (
        1u32..=4,
        2u64..=4,
        1u32..=4,
        1u64..=MAX_LIMIT_TICKS,
        vec(
            vec((0u8..3, 1u32..=4, 1u64..=MAX_LIMIT_TICKS), 0..=3),
            0..=3,
        ),
        vec(vec((1u32..=4, 1u64..=MAX_LIMIT_TICKS), 1..=2), 1..=6),
    )
        .prop_map(
            |(gpus, step_ticks, low_gpus, low_limit, backlog, stream)| AgingCase {
                gpus,
                step_ticks,
                low_gpus,
                low_limit,
                backlog,
                stream,
            },
        )
}

fn sim_job(class: &str, gpus: u32, limit_ticks: u64) -> JobSpec {
    JobSpec {
        time_limit_secs: Some(limit_ticks * TICK / 1000),
        ..spec("t", class, gpus, 1)
    }
}

/// One minute of the aging simulation at `t`: work that reached its time limit exits (every
/// job runs exactly its limit), then a pass is planned and committed and its allocations start.
fn tick(sim: &mut Sim, t: Timestamp, policy: &Policy) -> Result<Plan, TestCaseError> {
    let due: Vec<AllocationId> = sim
        .state
        .allocations
        .values()
        .filter(|r| {
            let limit = sim.state.jobs[&r.allocation.job]
                .spec
                .time_limit_secs
                .unwrap_or(0);
            r.allocation.created_at + limit * 1000 <= t
        })
        .map(|r| r.allocation.id)
        .collect();
    for a in due {
        sim.exit(a, TaskOutcome::Succeeded, t);
    }
    let plan = plan_with(&sim.state, t, policy);
    sim.place(&plan, t)?;
    for allocation in sim.live() {
        if !sim.state.allocations[&allocation].started {
            sim.apply(Command::AllocationStarted { allocation }, t);
        }
    }
    Ok(plan)
}

/// The jobs ahead of `low` in the aged FIFO: pending, eligible before it.
fn ahead_of(state: &ClusterState, low: &Job) -> Vec<JobId> {
    state
        .pending_jobs()
        .filter(|j| (expected_since(state, j), j.id) < (expected_since(state, low), low.id))
        .map(|j| j.id)
        .collect()
}

/// Runs the simulation; returns (the low job's wait, the number of jobs ahead of it at the aged
/// level when it got there, the longest time limit).
fn run_aging(c: &AgingCase) -> Result<(u64, u64, u64), TestCaseError> {
    let mut sim = Sim::new();
    let gpus = c.gpus;
    let clamp = |g: u32| (g - 1) % gpus + 1;
    sim.apply(
        Command::RegisterNode {
            spec: plain_node("solo", gpus, None),
        },
        T0,
    );
    let policy = Policy {
        aging_step_ms: c.step_ticks * TICK,
        ..Policy::default()
    };
    let max_limit = c
        .backlog
        .iter()
        .flatten()
        .map(|a| a.2)
        .chain(c.stream.iter().flatten().map(|a| a.1))
        .chain([c.low_limit])
        .max()
        .unwrap_or(1)
        * TICK;
    let t0 = T0 + c.backlog.len() as u64 * TICK;
    let aged_at = t0 + 3 * policy.aging_step_ms;
    let mut low: Option<JobId> = None;
    let mut ahead: Option<u64> = None;
    let mut t = T0;
    let mut minute = 0usize;
    loop {
        if minute < c.backlog.len() {
            for &(class, g, limit) in &c.backlog[minute] {
                sim.submit(sim_job(PRIORITIES[class as usize], clamp(g), limit), t);
            }
        } else {
            if t == t0 {
                low = sim.submit(sim_job("low", clamp(c.low_gpus), c.low_limit), t);
                prop_assert!(low.is_some());
            }
            for &(g, limit) in &c.stream[(minute - c.backlog.len()) % c.stream.len()] {
                sim.submit(sim_job("high", clamp(g), limit), t);
            }
        }
        let low_id = low.unwrap_or(JobId::MAX);
        if t == aged_at && sim.state.jobs[&low_id].state == JobState::Pending {
            ahead = Some(ahead_of(&sim.state, &sim.state.jobs[&low_id]).len() as u64);
        }
        tick(&mut sim, t, &policy)?;
        if low.is_some() && sim.state.jobs[&low_id].state != JobState::Pending {
            return Ok((t - t0, ahead.unwrap_or(0), max_limit));
        }
        let k = ahead.unwrap_or(0);
        prop_assert!(
            t <= aged_at + (k + 1) * max_limit,
            "the low job still waits {} ms after its submission",
            t - t0
        );
        t += TICK;
        minute += 1;
    }
}

/// A job's level as queue.rs documents it, computed independently.
fn expected_level(job: &Job, since: Timestamp, now: Timestamp, step: u64) -> u8 {
    let base = match job.spec.priority_class.as_str() {
        "high" => 2,
        "normal" => 1,
        _ => 0,
    };
    (base + now.saturating_sub(since) / step).min(u64::from(queue::AGED_LEVEL)) as u8
}

/// When a job became eligible: its submission or the last change of a dependency.
fn expected_since(state: &ClusterState, job: &Job) -> Timestamp {
    job.spec
        .dependencies
        .iter()
        .filter_map(|d| state.jobs.get(&d.job))
        .filter_map(|d| d.history.last().map(|h| h.at))
        .fold(job.submitted_at, Timestamp::max)
}

#[derive(Debug, Clone)]
struct QueueJob {
    tenant: usize,
    priority: u8,
    /// Submission, minutes after T0 (not in id order: leader clocks differ after a failover).
    submitted_min: u64,
    dependency: Option<(u8, usize)>,
    /// 0–1: stays pending; 2: runs and succeeds; 3: runs and fails; 4: cancelled.
    fate: u8,
    /// How long after its submission the fate happens, in minutes.
    fate_after_min: u64,
}

#[derive(Debug, Clone)]
struct QueueCase {
    weights: Vec<u32>,
    jobs: Vec<QueueJob>,
    step_min: u64,
    now_min: u64,
    limit: usize,
}

fn queue_case() -> impl Strategy<Value = QueueCase> {
    let job = (
        0usize..3,
        0u8..3,
        0u64..=240,
        proptest::option::weighted(0.3, (0u8..3, any::<usize>())),
        0u8..5,
        0u64..=120,
    )
        .prop_map(
            |(tenant, priority, submitted_min, dependency, fate, fate_after_min)| QueueJob {
                tenant,
                priority,
                submitted_min,
                dependency,
                fate,
                fate_after_min,
            },
        );
    (
        vec(1u32..=4, 1..=3),
        vec(job, 1..=30),
        1u64..=60,
        0u64..=600,
        1usize..=30,
    )
        .prop_map(|(weights, jobs, step_min, now_min, limit)| QueueCase {
            weights,
            jobs,
            step_min,
            now_min,
            limit,
        })
}

fn build_queue_state(c: &QueueCase) -> Sim {
    let mut sim = Sim::new();
    for (i, w) in c.weights.iter().enumerate() {
        sim.apply(
            Command::PutTenant {
                tenant: Tenant {
                    name: format!("t{i}"),
                    weight: *w,
                    quota_gpus: 0,
                    max_gpus: 0,
                },
            },
            T0,
        );
    }
    let spec = NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name: "big".into(),
        gpus: (0..16)
            .map(|k| Gpu {
                uuid: format!("GPU-big-{k}"),
                index: k,
                model: "H100".into(),
                memory_mib: 81_920,
                numa_node: None,
                pci_bus_id: String::new(),
                health: GpuHealth::Healthy,
                mig: Vec::new(),
            })
            .collect(),
        cpu_milli: 1_000_000,
        memory_mib: 1 << 30,
        partition: None,
        labels: BTreeMap::new(),
        topology: Vec::new(),
        agent_address: String::new(),
        driver: String::new(),
        incarnation: String::new(),
    };
    sim.apply(Command::RegisterNode { spec }, T0);
    let kinds = [
        DependencyKind::AfterOk,
        DependencyKind::AfterAny,
        DependencyKind::AfterNotOk,
    ];
    let mut ids = Vec::new();
    for j in &c.jobs {
        let at = T0 + j.submitted_min * MINUTE;
        let spec = JobSpec {
            tenant: format!("t{}", j.tenant % c.weights.len()),
            command: vec!["train".into()],
            gpus_per_task: 1,
            tasks: 1,
            priority_class: PRIORITIES[j.priority as usize].into(),
            dependencies: j
                .dependency
                .filter(|_| !ids.is_empty())
                .map(|(k, i)| Dependency {
                    kind: kinds[k as usize],
                    job: ids[i % ids.len()],
                })
                .into_iter()
                .collect(),
            ..JobSpec::default()
        };
        let Some(id) = sim.submit(spec, at) else {
            continue;
        };
        ids.push(id);
        let fate_at = at + j.fate_after_min * MINUTE;
        match j.fate {
            2 | 3
                if sim.state.jobs[&id].state == JobState::Pending
                    && dependencies_met(&sim.state, &sim.state.jobs[&id]) =>
            {
                let free = (0..16)
                    .map(|k| format!("GPU-big-{k}"))
                    .find(|u| !sim.state.gpu_holder.contains_key(u))
                    .expect("one job runs at a time");
                sim.apply(
                    Command::Place {
                        term: 1,
                        placements: vec![JobPlacement {
                            job: id,
                            tasks: vec![TaskPlacement {
                                node: "big".into(),
                                gpus: vec![free],
                            }],
                        }],
                    },
                    at,
                );
                let allocation = sim.state.jobs[&id].allocations[0];
                let outcome = if j.fate == 2 {
                    TaskOutcome::Succeeded
                } else {
                    TaskOutcome::Failed {
                        exit_code: Some(1),
                        signal: None,
                        reason: String::new(),
                    }
                };
                sim.exit(allocation, outcome, fate_at);
            }
            4 => {
                sim.apply(Command::cancel(id, ""), fate_at);
            }
            _ => {}
        }
    }
    sim
}

// ---------------------------------------------------------------------------------------------
// The properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(256))]

    /// Property 1: a plan computed on a state is accepted whole by apply on that state, hands
    /// out no GPU or MIG slice twice and no GPU beyond 1000 milli or its memory, and leaves the
    /// state consistent.
    #[test]
    fn a_plan_never_double_books(s in scenario()) {
        let b = build(&s)?;
        let before = b.sim.state.clone();
        let plan = plan_with(&before, b.now, &b.policy);
        check_plan(&before, &plan)?;
        let mut sim = b.sim;
        sim.place(&plan, b.now)?;
        check_applied(&before, &sim.state, &plan)?;
    }

    /// Property 4: when the plan holds a reservation for job H at `start_at`, H can start at
    /// `start_at` once the work that ends by then has ended, both on the state the plan was
    /// computed on (the reservation is right) and after the plan's placements, backfilled jobs
    /// included, were applied at `now` (backfill never delays it).
    #[test]
    fn a_backfilled_job_never_delays_the_reservation(s in busy_scenario()) {
        backfill_property(&s)?;
    }

    /// Preemption: every victim passes apply's own rule on the state the plan was computed on;
    /// committed as the leader commits a plan (preemptions first), apply refuses none; once the
    /// victims have stopped they are pending again (requeued, not lost), and with nothing else
    /// competing the preemptor starts in the next pass.
    #[test]
    fn preemption_victims_are_accepted_and_make_room(s in contended_scenario()) {
        preemption_property(&s)?;
    }

    /// Property 5 (simulation): one node, every job running exactly its time limit, a pass
    /// every minute, a stream of high-priority arrivals every minute that alone keeps the node
    /// busy, and one low-priority job submitted at t0.
    ///
    /// The bound, from queue.rs: the low job reaches the aged level at `t0 + 3 × aging_step`;
    /// from then on only the k jobs eligible before it (the backlog still pending then) come
    /// before it, and nothing new can: every later arrival is eligible later. The first job in
    /// queue order is either placed or is the head; its reservation starts once running work
    /// ends, at most one longest time limit M away (everything running started before; with
    /// the reservation, backfilled work cannot push it back), and at that pass it starts. So
    /// each of the k jobs ahead and then the low job starts within M of the previous:
    ///
    ///     wait ≤ 3 × aging_step + (k + 1) × M.
    ///
    /// (Not `Σ limits of the jobs ahead + M`: while a job ahead waits for its reservation, work
    /// backfilled beside it may run up to M past its start and hold what the next one needs;
    /// see `the_wait_behind_aged_jobs_can_exceed_the_sum_of_their_limits`. With nothing ahead,
    /// k = 0, the two agree.)
    #[test]
    fn a_low_priority_job_waits_a_bounded_time(c in aging_case()) {
        let (wait, k, m) = run_aging(&c)?;
        let bound = 3 * c.step_ticks * TICK + (k + 1) * m;
        prop_assert!(wait <= bound, "waited {} ms, bound {} ms (k = {}, M = {} ms)", wait, bound, k, m);
    }

    /// Property 5 (queue order): `Queue::build(..).next_job()` yields each pending job whose
    /// dependencies are met exactly once; levels never rise along the order; the aged level
    /// comes first, in (eligible_since, id) order; within a lower level each tenant's jobs come
    /// in submission order and together (no pass charges here); and a pass limit keeps the
    /// oldest of each level from the highest down, in the same relative order.
    #[test]
    fn the_queue_serves_aged_jobs_first_in_eligibility_order(c in queue_case()) {
        let sim = build_queue_state(&c);
        let state = &sim.state;
        let step = c.step_min * MINUTE;
        let now = T0 + c.now_min * MINUTE;
        let mut q = queue::Queue::build(state, now, step, usize::MAX);
        let order: Vec<&Job> = std::iter::from_fn(|| q.next_job()).collect();
        let ids: Vec<JobId> = order.iter().map(|j| j.id).collect();
        let unique: BTreeSet<JobId> = ids.iter().copied().collect();
        prop_assert_eq!(unique.len(), ids.len(), "a job served twice: {:?}", ids);
        let expected: BTreeSet<JobId> = state
            .jobs
            .values()
            .filter(|j| j.state == JobState::Pending)
            .filter(|j| {
                j.spec.dependencies.iter().all(|d| {
                    let s = state.jobs[&d.job].state;
                    match d.kind {
                        DependencyKind::AfterOk => s == JobState::Succeeded,
                        DependencyKind::AfterAny => s.is_final(),
                        DependencyKind::AfterNotOk => s.is_final() && s != JobState::Succeeded,
                    }
                })
            })
            .map(|j| j.id)
            .collect();
        prop_assert_eq!(&unique, &expected);
        let keyed: Vec<(u8, Timestamp, &Job)> = order
            .iter()
            .map(|j| {
                let since = expected_since(state, j);
                (expected_level(j, since, now, step), since, *j)
            })
            .collect();
        for w in keyed.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            prop_assert!(a.0 >= b.0, "level rises from job {} to job {}", a.2.id, b.2.id);
            if a.0 == queue::AGED_LEVEL && b.0 == queue::AGED_LEVEL {
                prop_assert!((a.1, a.2.id) < (b.1, b.2.id), "aged jobs {} and {} out of order", a.2.id, b.2.id);
            }
            if a.0 == b.0 && a.0 < queue::AGED_LEVEL && a.2.spec.tenant == b.2.spec.tenant {
                prop_assert!(a.2.id < b.2.id);
            }
        }
        // Tenants' turns within a level: contiguous without charges.
        for lvl in 0..queue::AGED_LEVEL {
            let tenants: Vec<&str> = keyed
                .iter()
                .filter(|k| k.0 == lvl)
                .map(|k| k.2.spec.tenant.as_str())
                .collect();
            let mut seen = BTreeSet::new();
            for (i, t) in tenants.iter().enumerate() {
                if i > 0 && tenants[i - 1] != *t {
                    prop_assert!(seen.insert(*t), "tenant {} served twice at level {}", t, lvl);
                } else if i == 0 {
                    seen.insert(*t);
                }
            }
        }
        // A pass limit: the oldest of each level, highest level first.
        let mut limited = queue::Queue::build(state, now, step, c.limit);
        let kept: Vec<JobId> = std::iter::from_fn(|| limited.next_job()).map(|j| j.id).collect();
        let mut want: BTreeSet<JobId> = BTreeSet::new();
        for lvl in (0..=queue::AGED_LEVEL).rev() {
            let mut at_level: Vec<(Timestamp, JobId)> = keyed
                .iter()
                .filter(|k| k.0 == lvl)
                .map(|k| (if lvl == queue::AGED_LEVEL { k.1 } else { 0 }, k.2.id))
                .collect();
            at_level.sort_unstable();
            for (_, id) in at_level {
                if want.len() < c.limit {
                    want.insert(id);
                }
            }
        }
        prop_assert_eq!(kept.iter().copied().collect::<BTreeSet<_>>(), want.clone());
        let filtered: Vec<JobId> = ids.iter().copied().filter(|j| want.contains(j)).collect();
        prop_assert_eq!(kept, filtered);
    }
}

proptest! {
    #![proptest_config(config(128))]

    /// Property 3: every placed job gets all its tasks, each with all its GPUs; no other job's
    /// allocations change. Checked on the plan and on the state after apply, in a second pass
    /// too (after the first one's placements start and some exit).
    #[test]
    fn a_gang_is_never_partially_placed(s in scenario()) {
        let b = build(&s)?;
        let mut sim = b.sim;
        let mut now = b.now;
        for _ in 0..2 {
            let before = sim.state.clone();
            let plan = plan_with(&before, now, &b.policy);
            check_plan(&before, &plan)?;
            sim.place(&plan, now)?;
            check_applied(&before, &sim.state, &plan)?;
            for p in &plan.placements {
                let job = &sim.state.jobs[&p.job];
                prop_assert_eq!(job.state, JobState::Scheduled);
                let nodes: Vec<&str> = sim
                    .state
                    .allocations_of(p.job)
                    .map(|r| r.allocation.node.as_str())
                    .collect();
                let planned: Vec<&str> = p.tasks.iter().map(|t| t.node.as_str()).collect();
                prop_assert_eq!(nodes, planned);
            }
            // One task of a gang fails: the others are stopped, and the job holds nothing once
            // they exit (no partial gang left running).
            if let Some(p) = plan.placements.iter().find(|p| p.tasks.len() > 1) {
                let allocations = sim.state.jobs[&p.job].allocations.clone();
                now += 1000;
                sim.exit(allocations[0], TaskOutcome::Lost { reason: "Xid 79".into() }, now);
                for a in &allocations[1..] {
                    prop_assert!(sim.state.allocations[a].stop_requested);
                    sim.exit(*a, TaskOutcome::Stopped, now);
                }
                prop_assert_eq!(sim.state.jobs[&p.job].state, JobState::Pending);
                prop_assert!(sim.state.jobs[&p.job].allocations.is_empty());
            }
            now += 10 * MINUTE;
        }
    }

    /// Property 6 (invariant 4): a replica that loads the state from a snapshot computes the
    /// same plan, and so does the same replica twice.
    #[test]
    fn a_snapshot_round_trip_gives_the_same_plan(s in scenario()) {
        let b = build(&s)?;
        let state = &b.sim.state;
        let json = serde_json::to_string(state).expect("state serializes");
        let mut loaded: ClusterState = serde_json::from_str(&json).expect("state deserializes");
        loaded.rebuild_indexes();
        prop_assert_eq!(&loaded, state);
        let here = plan_with(state, b.now, &b.policy);
        prop_assert_eq!(&plan_with(&loaded, b.now, &b.policy), &here);
        prop_assert_eq!(&plan_with(state, b.now, &b.policy), &here);
    }
}

proptest! {
    #![proptest_config(config(96))]

    /// Property 2: over successive passes with exits, arrivals and lowered limits in between,
    /// a placement never takes a tenant beyond `max_gpus` (whatever it held before, which may
    /// exceed a limit lowered since).
    #[test]
    fn quotas_are_never_exceeded(s in scenario(), rounds in rounds()) {
        let b = build(&s)?;
        let mut sim = b.sim;
        let mut now = b.now;
        let mut dice = Dice::new(&s.dice);
        let mut ids: Vec<JobId> = sim.state.jobs.keys().copied().collect();
        for round in &rounds {
            let held: BTreeMap<String, u64> = sim
                .state
                .tenants
                .keys()
                .map(|t| (t.clone(), sim.state.gpu_milli_held_by_tenant(t)))
                .collect();
            // `pass` checks the plan against the limits before applying it.
            let plan = sim.pass(now, &b.policy)?;
            let mut gained: BTreeSet<&str> = BTreeSet::new();
            for p in &plan.placements {
                let spec = &sim.state.jobs[&p.job].spec;
                if spec.total_gpu_milli() > 0 {
                    gained.insert(spec.tenant.as_str());
                }
            }
            for (tenant, before) in &held {
                let Some(limit) = tenant_limit(&sim.state, tenant) else {
                    continue;
                };
                let after = sim.state.gpu_milli_held_by_tenant(tenant);
                if gained.contains(tenant.as_str()) {
                    prop_assert!(after <= limit, "tenant {} holds {} > limit {}", tenant, after, limit);
                } else {
                    prop_assert!(after <= (*before).max(limit));
                }
            }
            // Between passes: allocations start, some end, new work arrives.
            sim.start_some(&mut dice, now + 500);
            now += round.minutes * MINUTE;
            for allocation in sim.live() {
                let outcome = match dice.next() % 6 {
                    0 | 1 => TaskOutcome::Succeeded,
                    2 => TaskOutcome::Stopped,
                    3 => TaskOutcome::TimedOut,
                    _ => continue,
                };
                sim.exit(allocation, outcome, now);
            }
            for j in &round.arrivals {
                if let Some(id) = sim.submit(job_spec(j, b.tenants, &ids), now) {
                    ids.push(id);
                }
            }
            if let Some(t) = round.lower {
                let mut tenant = sim.state.tenants.values().nth(t % b.tenants).unwrap().clone();
                tenant.max_gpus = tenant.quota_gpus.max(1);
                sim.apply(Command::PutTenant { tenant }, now);
            }
            now += 1;
        }
    }
}

#[derive(Debug, Clone)]
struct Round {
    arrivals: Vec<JobGen>,
    minutes: u64,
    /// A tenant whose limit is lowered to its quota before the pass.
    lower: Option<usize>,
}

fn rounds() -> impl Strategy<Value = Vec<Round>> {
    vec(
        (
            vec(job_gen(), 0..=4),
            1u64..=90,
            proptest::option::weighted(0.2, any::<usize>()),
        )
            .prop_map(|(arrivals, minutes, lower)| Round {
                arrivals,
                minutes,
                lower,
            }),
        2..=4,
    )
}

// ---------------------------------------------------------------------------------------------
// Concrete cases the generators rarely reach
// ---------------------------------------------------------------------------------------------

fn plain_node(name: &str, gpus: u32, rack: Option<&str>) -> NodeSpec {
    NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name: name.into(),
        gpus: (0..gpus)
            .map(|k| Gpu {
                uuid: format!("GPU-{name}-{k}"),
                index: k,
                model: "A100".into(),
                memory_mib: 81_920,
                numa_node: Some(k * 2 / gpus),
                pci_bus_id: String::new(),
                health: GpuHealth::Healthy,
                mig: Vec::new(),
            })
            .collect(),
        cpu_milli: 64_000,
        memory_mib: 512 * 1024,
        partition: None,
        labels: rack
            .map(|r| (fleet::RACK_LABEL.to_owned(), r.to_owned()))
            .into_iter()
            .collect(),
        topology: Vec::new(),
        agent_address: String::new(),
        driver: String::new(),
        incarnation: String::new(),
    }
}

fn spec(tenant: &str, class: &str, gpus: u32, tasks: u32) -> JobSpec {
    JobSpec {
        tenant: tenant.into(),
        command: vec!["train".into()],
        gpus_per_task: gpus,
        tasks,
        priority_class: class.into(),
        ..JobSpec::default()
    }
}

fn run_ok(r: Result<(), TestCaseError>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// A high-priority gang needs room on two nodes held by low-priority preemptible work (and a
/// non-preemptible job that must survive): the victims pass apply's check, stop, are requeued,
/// and the gang starts in the next pass on the room they left.
#[test]
fn a_gang_preempts_across_nodes_and_starts_when_the_victims_stop() {
    run_ok((|| {
        let mut sim = Sim::new();
        let mut now = T0;
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("a", 4, Some("r0")),
            },
            now,
        );
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("b", 4, Some("r1")),
            },
            now,
        );
        let low = |gpus| JobSpec {
            preemptible: true,
            ..spec("t", "low", gpus, 1)
        };
        let mut victims_pool = Vec::new();
        for g in [2, 1, 1, 2, 1] {
            victims_pool.push(sim.submit(low(g), now).unwrap());
        }
        let keeper = sim.submit(spec("t", "normal", 1, 1), now).unwrap();
        let policy = Policy::default();
        now += 1000;
        let plan = sim.pass(now, &policy)?;
        prop_assert_eq!(plan.placements.len(), 6, "{:?}", plan);
        prop_assert_eq!(sim.state.allocations.len(), 6);
        // Soon after (so aging has not raised the victims: see
        // `a_requeued_victim_never_overtakes_its_preemptor`).
        now += 5 * MINUTE;
        // Two 3-GPU tasks: needs three free GPUs on each node.
        let gang = sim.submit(spec("t", "high", 3, 2), now).unwrap();
        now += 1000;
        let plan = plan_with(&sim.state, now, &policy);
        prop_assert!(plan.placements.is_empty());
        prop_assert_eq!(plan.preemptions.len(), 1);
        let p = plan.preemptions[0].clone();
        prop_assert_eq!(p.for_job, gang);
        prop_assert!(!p.victims.contains(&keeper));
        prop_assert!(p.victims.iter().all(|v| victims_pool.contains(v)));
        let refused = sim.preempt(&plan, now);
        prop_assert!(refused.is_empty(), "{:?}", refused);
        // While they stop, no further victims.
        prop_assert!(
            plan_with(&sim.state, now + 1, &policy)
                .preemptions
                .is_empty()
        );
        let stopping: Vec<AllocationId> = p
            .victims
            .iter()
            .flat_map(|v| sim.state.jobs[v].allocations.clone())
            .collect();
        now += 30_000;
        for a in stopping {
            sim.exit(a, TaskOutcome::Stopped, now);
        }
        for v in &p.victims {
            prop_assert_eq!(sim.state.jobs[v].state, JobState::Pending);
        }
        now += 1000;
        let plan = sim.pass(now, &policy)?;
        prop_assert!(plan.placements.iter().any(|x| x.job == gang), "{:?}", plan);
        prop_assert_eq!(sim.state.jobs[&gang].allocations.len(), 2);
        prop_assert!(!sim.state.jobs[&keeper].allocations.is_empty());
        prop_assert_eq!(sim.state.check_consistency(), Ok(()));
        Ok(())
    })());
}

/// Why the aging bound has (k + 1) × M rather than the sum of the limits of the k jobs ahead
/// plus M: one 3-GPU node, aging step 10 min, every limit at most M = 6 min. A1 (2 GPUs, 1 min)
/// and A2 (3 GPUs, 1 min) were submitted just before the low job L (2 GPUs, 6 min); when L
/// reaches the aged level (T3) the node is held by R (GPUs 0–1, until T3+5) and R' (GPU 2,
/// until T3+4), and 1-GPU 6-minute high jobs keep arriving. A1 is the head, reserved at T3+5 on
/// GPUs 0–1; at T3+4 GPU 2 frees and a high job H backfills it, legitimately (A1 never needs
/// it) until T3+10. A1 runs T3+5..T3+6, then A2 needs all three GPUs and waits for H until
/// T3+10, and L starts at T3+11: 3 × step + 11 min, past 3 × step + (1 + 1) + 6 = 3 × step + 8
/// min, within 3 × step + 3 × 6.
#[test]
fn the_wait_behind_aged_jobs_can_exceed_the_sum_of_their_limits() {
    run_ok((|| {
        let mut sim = Sim::new();
        let step = 10 * TICK;
        let policy = Policy {
            aging_step_ms: step,
            ..Policy::default()
        };
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("n", 3, None),
            },
            T0 - TICK,
        );
        let a1 = sim.submit(sim_job("low", 2, 1), T0 - TICK).unwrap();
        let a2 = sim.submit(sim_job("low", 3, 1), T0 - TICK).unwrap();
        let t0 = T0;
        let low = sim.submit(sim_job("low", 2, 6), t0).unwrap();
        let t3 = t0 + 3 * step;
        // R' and R, placed by hand just before T3 (as a pass would have, had they been first).
        let r1 = sim.submit(sim_job("high", 1, 6), t0).unwrap();
        let r2 = sim.submit(sim_job("high", 2, 6), t0).unwrap();
        let place = |job: JobId, gpus: &[u32]| JobPlacement {
            job,
            tasks: vec![TaskPlacement {
                node: "n".into(),
                gpus: gpus.iter().map(|g| format!("GPU-n-{g}")).collect(),
            }],
        };
        sim.place(
            &Plan {
                placements: vec![place(r1, &[2])],
                ..Plan::default()
            },
            t3 - 2 * TICK,
        )?;
        sim.place(
            &Plan {
                placements: vec![place(r2, &[0, 1])],
                ..Plan::default()
            },
            t3 - TICK,
        )?;
        prop_assert_eq!(ahead_of(&sim.state, &sim.state.jobs[&low]), vec![a1, a2]);
        let mut t = t3;
        let started = loop {
            sim.submit(sim_job("high", 1, 6), t).unwrap();
            tick(&mut sim, t, &policy)?;
            if sim.state.jobs[&low].state != JobState::Pending {
                break t;
            }
            prop_assert!(t < t3 + 30 * TICK);
            t += TICK;
        };
        let wait = started - t0;
        prop_assert_eq!(wait, 3 * step + 11 * TICK);
        prop_assert!(wait > 3 * step + (1 + 1) * TICK + 6 * TICK);
        prop_assert!(wait <= 3 * step + (2 + 1) * 6 * TICK);
        Ok(())
    })());
}

// ---------------------------------------------------------------------------------------------
// Bugs these properties found, fixed: each case is its minimal input
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(96))]

    /// Property 1 with share jobs of several tasks.
    #[test]
    fn a_share_gang_plan_is_accepted_by_apply(s in scenario_with(1..=6, 0..=10, 1..=12, true)) {
        let b = build(&s)?;
        let before = b.sim.state.clone();
        let plan = plan_with(&before, b.now, &b.policy);
        check_plan(&before, &plan)?;
        let mut sim = b.sim;
        sim.place(&plan, b.now)?;
        check_applied(&before, &sim.state, &plan)?;
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Property 1's plan check with `single_numa` held for MIG jobs too.
    #[test]
    fn a_single_numa_mig_plan_stays_on_one_numa_node(s in scenario()) {
        let b = build(&s)?;
        let plan = plan_with(&b.sim.state, b.now, &b.policy);
        check_plan_with(&b.sim.state, &plan, true)?;
    }
}

/// Minimal input: one node whose GPU 0 (NUMA 0) and GPU 1 (NUMA 1) are both in MIG mode with
/// seven 1g.10gb slices; a job holds six slices of GPU 0. A `single_numa` job asking for two
/// slices gets the last slice of GPU 0 and one of GPU 1 — two NUMA nodes — although GPU 1 alone
/// has seven free: `evaluate_mig` packs onto the GPUs with the fewest free slices and never
/// looks at `single_numa` (whole-GPU jobs go through `single_numa_set`; MIG jobs do not).
#[test]
fn a_single_numa_mig_task_stays_on_one_numa_node() {
    run_ok((|| {
        let mut sim = Sim::new();
        let mut node = plain_node("m", 2, None);
        for (k, gpu) in node.gpus.iter_mut().enumerate() {
            gpu.mig = (0..7)
                .map(|s| MigSlice {
                    uuid: format!("MIG-m-{k}-{s}"),
                    profile: MIG_PROFILE.into(),
                    memory_mib: 9_728,
                })
                .collect();
        }
        sim.apply(Command::RegisterNode { spec: node }, T0);
        let mig = |slices: u32, single_numa: bool| JobSpec {
            mig_profile: Some(MIG_PROFILE.into()),
            single_numa,
            ..spec("t", "normal", slices, 1)
        };
        let six = sim.submit(mig(6, false), T0).unwrap();
        sim.pass(T0, &Policy::default())?;
        let held: Vec<String> = sim
            .state
            .allocations_of(six)
            .flat_map(|r| r.allocation.gpus.clone())
            .collect();
        prop_assert!(held.iter().all(|u| u.starts_with("MIG-m-0-")), "{:?}", held);
        sim.submit(mig(2, true), T0 + 1000).unwrap();
        let plan = plan_with(&sim.state, T0 + 2000, &Policy::default());
        prop_assert_eq!(plan.placements.len(), 1);
        check_plan_with(&sim.state, &plan, true)
    })());
}

/// Minimal input: one node with one GPU, one job of two tasks with a 100-milli share each.
/// The scheduler puts both shares on GPU 0 (200 milli: they fit); apply's `check_placement`
/// refuses "GPU GPU-n-0 is placed twice in one plan", and since the plan is the same every pass
/// the job never starts while the leader re-proposes it forever.
#[test]
fn two_shares_of_one_job_on_one_gpu_are_accepted() {
    run_ok((|| {
        let mut sim = Sim::new();
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("n", 1, None),
            },
            T0,
        );
        let job = sim
            .submit(
                JobSpec {
                    gpu_milli: 100,
                    ..spec("t", "normal", 1, 2)
                },
                T0,
            )
            .unwrap();
        let plan = sim.pass(T0 + 1000, &Policy::default())?;
        prop_assert_eq!(plan.placements.len(), 1);
        prop_assert_eq!(sim.state.jobs[&job].allocations.len(), 2);
        Ok(())
    })());
}

/// Minimal input: one node with one GPU; a low-priority preemptible job L starts at T0; a
/// high-priority job H arrives at T0 + 90 min (default aging step 30 min) and preempts L. L is
/// requeued with its aging measured from its submission — the 90 minutes it *ran* count as
/// waiting — so it is at the aged level (0 + 3) while H is at 2: the next pass gives the GPU back
/// to L, and the pass after that preempts L again, for ever (H never starts; L loses its work
/// every cycle). The same happens below the aged level within one tenant (L's lower id wins at
/// an equal level) once L has run for two steps.
#[test]
fn a_requeued_victim_never_overtakes_its_preemptor() {
    run_ok((|| {
        let mut sim = Sim::new();
        let policy = Policy::default();
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("n", 1, None),
            },
            T0,
        );
        let low = sim
            .submit(
                JobSpec {
                    preemptible: true,
                    ..spec("t", "low", 1, 1)
                },
                T0,
            )
            .unwrap();
        sim.pass(T0, &policy)?;
        let mut now = T0 + 90 * MINUTE;
        let high = sim.submit(spec("t", "high", 1, 1), now).unwrap();
        for cycle in 0..3 {
            let plan = sim.pass(now, &policy)?;
            prop_assert_eq!(
                plan.preemptions
                    .iter()
                    .map(|p| (p.for_job, p.victims.clone()))
                    .collect::<Vec<_>>(),
                vec![(high, vec![low])],
                "cycle {}",
                cycle
            );
            now += 30_000;
            let stopping = sim.state.jobs[&low].allocations.clone();
            for a in stopping {
                sim.exit(a, TaskOutcome::Stopped, now);
            }
            now += 1000;
            let plan = sim.pass(now, &policy)?;
            prop_assert_eq!(
                plan.placements.iter().map(|p| p.job).collect::<Vec<_>>(),
                vec![high],
                "cycle {}: the GPU went back to the victim",
                cycle
            );
            if plan.placements.iter().any(|p| p.job == high) {
                return Ok(());
            }
            now += MINUTE;
        }
        Ok(())
    })());
}

/// Minimal input: one 8-GPU node; tenant `t` with `max_gpus` 4, tenant `u` unlimited. `u` runs
/// 6 GPUs for an hour. `t` submits H (4 GPUs, 1 h limit) then J (1 GPU, no limit). The pass
/// reserves the node for H at the hour and backfills J: J is "long" but fits beside H in what
/// the reservation leaves (8 − 4 GPUs). At the hour `t` holds 1 GPU (J), and 1 + 4 > 4: H cannot
/// start — it is then skipped as over its limit, not even the head, so it loses the reservation
/// and waits for J, which has no end. `plan_with` charges a tenant's limit only for jobs it
/// places; the head's demand is not set aside for its tenant when later jobs are backfilled.
#[test]
fn a_backfilled_job_of_the_same_tenant_never_blocks_the_reservation_by_quota() {
    run_ok((|| {
        let mut sim = Sim::new();
        let policy = Policy::default();
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("n", 8, None),
            },
            T0,
        );
        for (name, max_gpus) in [("t", 4), ("u", 0)] {
            let tenant = Tenant {
                name: name.into(),
                weight: 1,
                quota_gpus: 0,
                max_gpus,
            };
            sim.apply(Command::PutTenant { tenant }, T0);
        }
        let hour = Some(3600);
        sim.submit(
            JobSpec {
                time_limit_secs: hour,
                ..spec("u", "normal", 6, 1)
            },
            T0,
        )
        .unwrap();
        sim.pass(T0, &Policy::default())?;
        let now = T0 + MINUTE;
        let head = sim
            .submit(
                JobSpec {
                    time_limit_secs: hour,
                    ..spec("t", "normal", 4, 1)
                },
                now,
            )
            .unwrap();
        sim.submit(spec("t", "normal", 1, 1), now).unwrap();
        let plan = plan_with(&sim.state, now, &policy);
        let r = plan.reservation.clone().expect("H gets a reservation");
        prop_assert_eq!(r.job, head);
        check_reservation_holds(sim.clone(), &r, &policy, "before the plan")?;
        sim.place(&plan, now)?;
        check_reservation_holds(sim, &r, &policy, "after the plan's placements")
    })());
}

/// Minimal input: one 5-GPU node; tenant `own` with a guaranteed quota of 2 GPUs, tenant `bor`
/// with none; `bor` runs four 1-GPU jobs (normal, not preemptible). `own` submits H (2 GPUs)
/// then J (1 GPU). The pass places J on the free GPU and proposes to reclaim 2 GPUs from `bor`
/// for H, judged on the state before the pass (`own` holds 0, 0 + 2 ≤ 2). The leader applies
/// `Place` first, so `own` holds 1 when `Preempt` applies, 1 + 2 > 2, and apply refuses both
/// victims: the plan proposes preemptions that its own placements invalidate.
#[test]
fn a_quota_reclaim_is_not_invalidated_by_the_same_passs_placements() {
    run_ok((|| {
        let mut sim = Sim::new();
        let policy = Policy::default();
        sim.apply(
            Command::RegisterNode {
                spec: plain_node("n", 5, None),
            },
            T0,
        );
        for (name, quota_gpus) in [("own", 2), ("bor", 0)] {
            let tenant = Tenant {
                name: name.into(),
                weight: 1,
                quota_gpus,
                max_gpus: 0,
            };
            sim.apply(Command::PutTenant { tenant }, T0);
        }
        for _ in 0..4 {
            sim.submit(
                JobSpec {
                    time_limit_secs: Some(3600),
                    ..spec("bor", "normal", 1, 1)
                },
                T0,
            )
            .unwrap();
        }
        sim.pass(T0, &policy)?;
        let now = T0 + MINUTE;
        let head = sim.submit(spec("own", "normal", 2, 1), now).unwrap();
        sim.submit(spec("own", "normal", 1, 1), now).unwrap();
        let plan = plan_with(&sim.state, now, &policy);
        prop_assert_eq!(plan.preemptions.len(), 1);
        prop_assert_eq!(plan.preemptions[0].for_job, head);
        let refused = sim.preempt(&plan, now);
        sim.place(&plan, now)?;
        prop_assert!(refused.is_empty(), "apply refused {:?}", refused);
        Ok(())
    })());
}
