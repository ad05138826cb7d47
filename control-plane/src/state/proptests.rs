//! Property tests of `ClusterState::apply` over random command sequences.
//!
//! A sequence is generated as abstract operations (`Op`) that name jobs, allocations, nodes and
//! GPUs by position; `Driver` turns each into a concrete `Command` against the state reached so
//! far (so most commands are plausible: placements of pending jobs on real GPUs, exits of live
//! allocations), applies it, and records it. The recorded log is what the determinism property
//! replays on a fresh state.
//!
//! Fleet: tenants `ta` and `tb`, partition `gpu`, and three nodes of four GPUs each: `n0` (A100,
//! partition `gpu`), `n1` (A100, no partition, GPU 3 unhealthy) and `n2` (H100, partition
//! `gpu`). A fourth node `n3` (6×H100) may join through a random `RegisterNode`.

use std::collections::{BTreeMap, BTreeSet};

use proptest::array::uniform3;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::validate::DEFAULT_PRIORITY_CLASS;
use super::*;

const CASES: u32 = 256;
const MAX_OPS: usize = 60;

const NODE_NAMES: [&str; 4] = ["n0", "n1", "n2", "n3"];
const MODELS: [&str; 2] = ["A100", "H100"];
const PARTITION: &str = "gpu";
/// The third tenant is never configured.
const TENANTS: [&str; 3] = ["ta", "tb", "ghost"];
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
const TERM: u64 = 3;

fn uuid(node: &str, index: u32) -> String {
    format!("GPU-{node}-{index}")
}

/// The spec node `k` (0..4) reports when nothing is wrong with it.
fn fleet_node(k: usize) -> NodeSpec {
    let name = NODE_NAMES[k];
    let (count, model, partition) = match k {
        0 => (4, MODELS[0], Some(PARTITION)),
        1 => (4, MODELS[0], None),
        2 => (4, MODELS[1], Some(PARTITION)),
        _ => (6, MODELS[1], None),
    };
    NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name: name.into(),
        gpus: (0..count)
            .map(|i| Gpu {
                uuid: uuid(name, i),
                index: i,
                model: model.into(),
                memory_mib: 81_920,
                numa_node: Some(i / 2),
                pci_bus_id: format!("0000:{:02x}:00.0", i + 1),
                health: if k == 1 && i == 3 {
                    GpuHealth::Unhealthy {
                        reason: "Xid 48".into(),
                    }
                } else {
                    GpuHealth::Healthy
                },
                mig: Vec::new(),
            })
            .collect(),
        cpu_milli: 32_000,
        memory_mib: 256 * 1024,
        partition: partition.map(str::to_owned),
        labels: BTreeMap::new(),
        topology: Vec::new(),
        agent_address: String::new(),
        driver: String::new(),
        incarnation: String::new(),
    }
}

fn setup_commands() -> Vec<Command> {
    let mut cmds = Vec::new();
    for name in &TENANTS[..2] {
        cmds.push(Command::PutTenant {
            tenant: Tenant {
                name: (*name).into(),
                weight: 1,
                quota_gpus: 4,
                max_gpus: 8,
            },
        });
    }
    cmds.push(Command::PutPartition {
        partition: Partition {
            name: PARTITION.into(),
            description: "the GPU partition".into(),
        },
    });
    for k in 0..3 {
        cmds.push(Command::RegisterNode {
            spec: fleet_node(k),
        });
    }
    cmds
}

// ---------------------------------------------------------------------------------------------
// Abstract operations and their generators
// ---------------------------------------------------------------------------------------------

/// Names a job or an allocation: by position among the plausible ones, or by raw id (which may
/// not exist).
#[derive(Debug, Clone, Copy)]
enum Pick {
    Existing(usize),
    Raw(u64),
}

#[derive(Debug, Clone)]
struct SubmitOp {
    tenant: usize,
    tasks: u32,
    gpus: u32,
    cpu: bool,
    /// 0: any model, 1: A100, 2: H100, 3: either.
    models: u8,
    /// 0: none, 1: the configured partition, 2: an unknown one.
    partition: u8,
    key: Option<usize>,
    dependency: Option<u64>,
    name: u8,
}

#[derive(Debug, Clone)]
struct PlaceOp {
    job: Pick,
    /// (node choice, GPU offset) per task; only the first `tasks` are used.
    tasks: [(usize, usize); 3],
    /// Which kind of placement to build; see `Driver::placement`.
    mode: u8,
}

#[derive(Debug, Clone)]
enum Op {
    Submit(SubmitOp),
    /// The exact command of an earlier submission again: a client retry.
    Resubmit(usize),
    Cancel(Pick),
    Place(Vec<PlaceOp>),
    Started(Pick),
    Exited(Pick, u8),
    Register {
        node: usize,
        variant: u8,
        gpu: usize,
    },
    /// `CompactJobs` with one of a few short retentions (see `retention_variant`).
    Compact(u8),
}

/// One generated step: the operation and how far the leader clock moved (it may move back, as
/// after a failover to a leader with a slower clock).
#[derive(Debug, Clone)]
struct Step {
    op: Op,
    clock: i64,
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        5 => any::<u8>().prop_map(|i| Pick::Existing(i as usize)),
        1 => (0u64..80).prop_map(Pick::Raw),
    ]
}

fn submit_op() -> impl Strategy<Value = SubmitOp> {
    (
        prop_oneof![5 => 0usize..2, 1 => Just(2usize)],
        1u32..=3,
        prop_oneof![9 => 0u32..=4, 1 => Just(5u32)],
        any::<bool>(),
        0u8..4,
        prop_oneof![3 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8)],
        proptest::option::weighted(0.4, 0usize..KEYS.len()),
        proptest::option::weighted(0.15, 0u64..40),
        0u8..3,
    )
        .prop_map(
            |(tenant, tasks, gpus, cpu, models, partition, key, dependency, name)| SubmitOp {
                tenant,
                tasks,
                gpus,
                cpu,
                models,
                partition,
                key,
                dependency,
                name,
            },
        )
}

fn place_op() -> impl Strategy<Value = PlaceOp> {
    (pick(), uniform3((0usize..4, 0usize..8)), 0u8..10).prop_map(|(job, tasks, mode)| PlaceOp {
        job,
        tasks,
        mode,
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => submit_op().prop_map(Op::Submit),
        1 => any::<u8>().prop_map(|i| Op::Resubmit(i as usize)),
        1 => pick().prop_map(Op::Cancel),
        4 => vec(place_op(), 1..=3).prop_map(Op::Place),
        3 => pick().prop_map(Op::Started),
        3 => (pick(), 0u8..7).prop_map(|(p, o)| Op::Exited(p, o)),
        1 => (0usize..4, 0u8..6, 0usize..8)
            .prop_map(|(node, variant, gpu)| Op::Register { node, variant, gpu }),
        1 => (0u8..81).prop_map(Op::Compact),
    ]
}

/// Retentions short enough for a generated sequence (steps move the clock up to 2 s): each of
/// the four settings takes one of three values, chosen by `variant`'s base-3 digits.
fn retention_variant(variant: u8) -> JobRetention {
    let digit = |i: u32| usize::from(variant / 3u8.pow(i) % 3);
    JobRetention {
        full_record_ms: [0, 3_000, 20_000][digit(0)],
        max_full_records: [0, 2, 1_000][digit(1)],
        archive_ms: [0, 8_000, 60_000][digit(2)],
        max_archived: [1, 4, 1_000][digit(3)],
    }
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    vec(
        (
            op(),
            prop_oneof![8 => 1i64..2000, 1 => Just(0i64), 1 => -5000i64..0],
        )
            .prop_map(|(op, clock)| Step { op, clock }),
        1..=MAX_OPS,
    )
}

// ---------------------------------------------------------------------------------------------
// Turning operations into commands
// ---------------------------------------------------------------------------------------------

/// One applied log entry, with the states around it.
struct Entry<'a> {
    before: &'a ClusterState,
    command: &'a Command,
    at: Timestamp,
    index: u64,
    applied: &'a Applied,
    after: &'a ClusterState,
}

/// Everything a run produced: the log (command, leader time, index) and each outcome.
struct Run {
    log: Vec<(Command, Timestamp, u64)>,
    outcomes: Vec<Applied>,
    state: ClusterState,
}

struct Driver {
    state: ClusterState,
    at: Timestamp,
    index: u64,
    run: Run,
}

impl Driver {
    fn new() -> Self {
        Driver {
            state: ClusterState::default(),
            at: 1_700_000_000_000,
            index: 0,
            run: Run {
                log: Vec::new(),
                outcomes: Vec::new(),
                state: ClusterState::default(),
            },
        }
    }

    fn apply(
        &mut self,
        command: Command,
        clock: i64,
        check: &mut impl FnMut(&Entry) -> Result<(), TestCaseError>,
    ) -> Result<(), TestCaseError> {
        self.index += 1;
        self.at = self.at.saturating_add_signed(clock);
        let before = self.state.clone();
        let applied = self.state.apply(&command, self.at, self.index);
        check(&Entry {
            before: &before,
            command: &command,
            at: self.at,
            index: self.index,
            applied: &applied,
            after: &self.state,
        })?;
        self.run.log.push((command, self.at, self.index));
        self.run.outcomes.push(applied);
        Ok(())
    }

    fn command(&self, op: &Op) -> Command {
        match op {
            Op::Submit(s) => submit_command(s),
            Op::Resubmit(i) => {
                let earlier: Vec<&Command> = self
                    .run
                    .log
                    .iter()
                    .map(|(c, _, _)| c)
                    .filter(|c| matches!(c, Command::SubmitJob { .. }))
                    .collect();
                if earlier.is_empty() {
                    submit_command(&SubmitOp {
                        tenant: 0,
                        tasks: 1,
                        gpus: 1,
                        cpu: false,
                        models: 0,
                        partition: 0,
                        key: Some(0),
                        dependency: None,
                        name: 0,
                    })
                } else {
                    earlier[i % earlier.len()].clone()
                }
            }
            Op::Cancel(p) => {
                let live: Vec<JobId> = self
                    .state
                    .jobs
                    .values()
                    .filter(|j| !j.state.is_final())
                    .map(|j| j.id)
                    .collect();
                Command::cancel(self.job_id(*p, &live), "")
            }
            Op::Place(ops) => Command::Place {
                term: TERM,
                placements: ops.iter().map(|p| self.placement(p)).collect(),
            },
            Op::Started(p) => Command::AllocationStarted {
                allocation: self.allocation_id(*p),
            },
            Op::Exited(p, o) => Command::AllocationExited {
                allocation: self.allocation_id(*p),
                outcome: match o {
                    0..=2 => TaskOutcome::Succeeded,
                    3 => TaskOutcome::Failed {
                        exit_code: Some(1),
                        signal: None,
                        reason: String::new(),
                    },
                    4 => TaskOutcome::Failed {
                        exit_code: None,
                        signal: Some(9),
                        reason: "OOM".into(),
                    },
                    5 => TaskOutcome::TimedOut,
                    _ => TaskOutcome::Lost {
                        reason: "GPU fell off the bus".into(),
                    },
                },
                usage: None,
            },
            Op::Register { node, variant, gpu } => Command::RegisterNode {
                spec: node_variant(*node, *variant, *gpu),
            },
            Op::Compact(variant) => Command::CompactJobs {
                retention: retention_variant(*variant),
                // Batches of one and three, or everything due: the same end state once due
                // compaction is repeated, and never more than the limit per entry.
                limit: [None, Some(1), Some(3)][*variant as usize % 3],
            },
        }
    }

    /// `Existing(i)`: the i-th (modulo) of `preferred`, or of all jobs when none is preferred.
    fn job_id(&self, p: Pick, preferred: &[JobId]) -> JobId {
        let all: Vec<JobId> = self.state.jobs.keys().copied().collect();
        let from = if preferred.is_empty() {
            &all
        } else {
            preferred
        };
        match p {
            Pick::Existing(i) if !from.is_empty() => from[i % from.len()],
            Pick::Existing(i) => i as u64,
            Pick::Raw(id) => id % (self.state.last_job_id + 2),
        }
    }

    fn allocation_id(&self, p: Pick) -> AllocationId {
        let live: Vec<AllocationId> = self.state.allocations.keys().copied().collect();
        match p {
            Pick::Existing(i) if !live.is_empty() => live[i % live.len()],
            Pick::Existing(i) => i as u64,
            Pick::Raw(id) => id % (self.state.last_allocation_id + 2),
        }
    }

    /// A placement of (usually) a pending job. Modes 0–4 use free healthy GPUs of a node that
    /// suits the job; 5–6 any GPUs of a random node (often held or unsuitable); 7 the wrong task
    /// count; 8 a GPU of another node; 9 the same GPU twice.
    fn placement(&self, p: &PlaceOp) -> JobPlacement {
        let pending: Vec<JobId> = self
            .state
            .jobs
            .values()
            .filter(|j| j.state == JobState::Pending)
            .map(|j| j.id)
            .collect();
        let job = self.job_id(p.job, &pending);
        let (tasks, gpus) = self.state.jobs.get(&job).map_or((1, 1), |j| {
            (j.spec.tasks as usize, j.spec.gpus_per_task as usize)
        });
        let nodes: Vec<&Node> = self.state.nodes.values().collect();
        let suits = |n: &Node| {
            self.state.jobs.get(&job).is_none_or(|j| {
                j.spec
                    .partition
                    .as_ref()
                    .is_none_or(|part| n.spec.partition.as_ref() == Some(part))
                    && (j.spec.gpu_models.is_empty()
                        || n.spec
                            .gpus
                            .iter()
                            .any(|g| j.spec.gpu_models.contains(&g.model)))
            })
        };
        let suitable: Vec<&Node> = nodes.iter().copied().filter(|n| suits(n)).collect();
        let smart = p.mode <= 4 && !suitable.is_empty();
        let mut placed = Vec::new();
        for (t, &(node_choice, offset)) in p.tasks.iter().take(tasks).enumerate() {
            let node = if smart {
                suitable[node_choice % suitable.len()]
            } else {
                nodes[node_choice % nodes.len()]
            };
            let mut candidates: Vec<&Gpu> = node.spec.gpus.iter().collect();
            if smart {
                candidates.retain(|g| {
                    g.health == GpuHealth::Healthy
                        && !self.state.gpu_holder.contains_key(&g.uuid)
                        && !placed
                            .iter()
                            .any(|tp: &TaskPlacement| tp.gpus.contains(&g.uuid))
                });
            }
            let len = candidates.len().max(1);
            let mut uuids: Vec<String> = candidates
                .iter()
                .cycle()
                .skip(offset % len)
                .take(gpus.min(candidates.len()))
                .map(|g| g.uuid.clone())
                .collect();
            if t == 0 {
                match p.mode {
                    8 => {
                        let other = &nodes[(node_choice + 1) % nodes.len()];
                        if let (Some(slot), Some(g)) = (uuids.first_mut(), other.spec.gpus.first())
                        {
                            *slot = g.uuid.clone();
                        }
                    }
                    9 if uuids.len() >= 2 => uuids[1] = uuids[0].clone(),
                    _ => {}
                }
            }
            placed.push(TaskPlacement {
                node: node.spec.name.clone(),
                gpus: uuids,
            });
        }
        if p.mode == 7 {
            if placed.len() > 1 {
                placed.pop();
            } else if let Some(first) = placed.first().cloned() {
                placed.push(first);
            }
        }
        JobPlacement { job, tasks: placed }
    }
}

fn submit_command(s: &SubmitOp) -> Command {
    let gpu_models = match s.models {
        1 => vec![MODELS[0].to_owned()],
        2 => vec![MODELS[1].to_owned()],
        3 => MODELS.iter().map(|m| m.to_string()).collect(),
        _ => vec![],
    };
    let partition = match s.partition {
        1 => Some(PARTITION.to_owned()),
        2 => Some("nowhere".to_owned()),
        _ => None,
    };
    let spec = JobSpec {
        tenant: TENANTS[s.tenant].into(),
        name: format!("job-{}", s.name),
        command: vec!["./run".into()],
        gpus_per_task: s.gpus,
        tasks: s.tasks,
        gpu_models,
        partition,
        priority_class: DEFAULT_PRIORITY_CLASS.into(),
        dependencies: s
            .dependency
            .map(|job| Dependency {
                kind: DependencyKind::AfterAny,
                job,
            })
            .into_iter()
            .collect(),
        cpu_milli_per_task: if s.cpu { 500 } else { 0 },
        ..JobSpec::default()
    };
    Command::submit(spec, s.key.map(|k| KEYS[k].to_owned()))
}

/// Node `node` re-registering (or `n3` joining) in one of a few shapes: as it was (0), without a
/// GPU (1), with a GPU turned unhealthy (2), also claiming another node's GPU (3), with its
/// partition toggled (4), with every GPU healthy (5).
fn node_variant(node: usize, variant: u8, gpu: usize) -> NodeSpec {
    let mut spec = fleet_node(node);
    let g = gpu % spec.gpus.len();
    match variant {
        1 => {
            spec.gpus.remove(g);
        }
        2 => {
            spec.gpus[g].health = GpuHealth::Unhealthy {
                reason: "Xid 79".into(),
            };
        }
        3 => {
            let other = NODE_NAMES[(node + 1 + gpu % 3) % 4];
            let mut stolen = spec.gpus[0].clone();
            stolen.uuid = uuid(other, (gpu % 4) as u32);
            stolen.index = spec.gpus.len() as u32;
            spec.gpus.push(stolen);
        }
        4 => {
            spec.partition = match spec.partition {
                Some(_) => None,
                None => Some(PARTITION.into()),
            };
        }
        5 => {
            for g in &mut spec.gpus {
                g.health = GpuHealth::Healthy;
            }
        }
        _ => {}
    }
    spec
}

/// Applies the fleet setup, then every step, calling `check` after each entry.
fn execute(
    steps: &[Step],
    mut check: impl FnMut(&Entry) -> Result<(), TestCaseError>,
) -> Result<Run, TestCaseError> {
    let mut d = Driver::new();
    for command in setup_commands() {
        d.apply(command, 1, &mut check)?;
        let outcome = &d.run.outcomes.last().unwrap().outcome;
        prop_assert!(
            !matches!(outcome, Outcome::Rejected(_)),
            "setup rejected: {outcome:?}"
        );
    }
    for step in steps {
        let command = d.command(&step.op);
        d.apply(command, step.clock, &mut check)?;
    }
    d.run.state = d.state;
    Ok(d.run)
}

// ---------------------------------------------------------------------------------------------
// Invariants
// ---------------------------------------------------------------------------------------------

/// What must hold after every entry, checked from the data itself and not only via indexes.
fn check_invariants(s: &ClusterState) -> Result<(), String> {
    s.check_consistency()?;

    // No GPU in two live allocations, and every held GPU belongs to the allocation's node.
    let mut holder: BTreeMap<&str, AllocationId> = BTreeMap::new();
    for (id, rec) in &s.allocations {
        let a = &rec.allocation;
        if *id > s.last_allocation_id {
            return Err(format!("allocation {id} is above last_allocation_id"));
        }
        let node = s
            .nodes
            .get(&a.node)
            .ok_or_else(|| format!("allocation {id} is on unknown node {}", a.node))?;
        for gpu in &a.gpus {
            if let Some(other) = holder.insert(gpu, *id) {
                return Err(format!("GPU {gpu} is in allocations {other} and {id}"));
            }
            if !node.spec.gpus.iter().any(|g| &g.uuid == gpu) {
                return Err(format!(
                    "allocation {id} holds {gpu}, not reported by {}",
                    a.node
                ));
            }
        }
    }

    // Each GPU UUID belongs to exactly one node, and `gpu_node` says which.
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for n in s.nodes.values() {
        for g in &n.spec.gpus {
            if let Some(other) = owner.insert(g.uuid.clone(), n.spec.name.clone()) {
                return Err(format!(
                    "GPU {} reported by {other} and {}",
                    g.uuid, n.spec.name
                ));
            }
        }
    }
    if owner != s.gpu_node {
        return Err(format!(
            "gpu_node {:?} differs from the nodes' reports {owner:?}",
            s.gpu_node
        ));
    }

    for job in s.jobs.values() {
        let recs: Vec<&AllocationRecord> =
            job.allocations.iter().map(|a| &s.allocations[a]).collect();
        if recs.iter().any(|r| r.allocation.job != job.id) {
            return Err(format!("job {} lists another job's allocation", job.id));
        }
        let distinct: BTreeSet<_> = job.allocations.iter().collect();
        if distinct.len() != job.allocations.len() {
            return Err(format!("job {} lists an allocation twice", job.id));
        }
        if job.history.last().map(|h| h.state) != Some(job.state) {
            return Err(format!(
                "job {} history does not end in {}",
                job.id, job.state
            ));
        }
        match job.state {
            JobState::Pending => {
                if job.ending.is_some() {
                    return Err(format!("pending job {} has an ending", job.id));
                }
            }
            JobState::Scheduled | JobState::Running => {
                if recs.is_empty() || recs.len() > job.spec.tasks as usize {
                    return Err(format!(
                        "{} job {} has {} allocations for {} tasks",
                        job.state,
                        job.id,
                        recs.len(),
                        job.spec.tasks
                    ));
                }
                if job.state == JobState::Running && !recs.iter().all(|r| r.started) {
                    return Err(format!("running job {} has an unstarted task", job.id));
                }
                if job.ending.is_some() && !recs.iter().all(|r| r.stop_requested) {
                    return Err(format!("ending job {} has a task not told to stop", job.id));
                }
            }
            JobState::Cancelled => {
                if !recs.iter().all(|r| r.stop_requested) {
                    return Err(format!(
                        "cancelled job {} has a task not told to stop",
                        job.id
                    ));
                }
            }
            JobState::Succeeded | JobState::Failed | JobState::TimedOut => {
                if !recs.is_empty() {
                    return Err(format!(
                        "{} job {} still holds allocations",
                        job.state, job.id
                    ));
                }
            }
        }
    }
    Ok(())
}

/// `after` equals `before`; `last_applied_at` may only advance to `at`, and only for a command
/// that was accepted but had nothing to do (a retry, a plan whose placements all failed).
fn unchanged_but_clock(
    before: &ClusterState,
    after: &ClusterState,
    at: Timestamp,
    rejected: bool,
) -> bool {
    let mut after = after.clone();
    let clock_ok = after.last_applied_at == before.last_applied_at
        || (!rejected && after.last_applied_at == before.last_applied_at.max(at));
    after.last_applied_at = before.last_applied_at;
    clock_ok && after == *before
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        // Shrinking long sequences in debug builds can take minutes; a shorter search still
        // gives a readable counterexample.
        max_shrink_iters: 2048,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    /// (a) After every entry the indexes match the data and no GPU is double-booked.
    #[test]
    fn every_entry_keeps_the_state_consistent_and_no_gpu_double_booked(steps in steps()) {
        execute(&steps, |e| {
            check_invariants(e.after)
                .map_err(|err| TestCaseError::fail(format!("after {}: {err}", e.command)))
        })?;
    }

    /// (b) Every acknowledged job stays in the state until it has finished and a `CompactJobs`
    /// archives it (then until one forgets it), and ids never repeat.
    #[test]
    fn no_acknowledged_job_is_ever_lost(steps in steps()) {
        let mut acknowledged: Vec<JobId> = Vec::new();
        let mut forgotten: BTreeSet<JobId> = BTreeSet::new();
        execute(&steps, |e| {
            let compaction = matches!(e.command, Command::CompactJobs { .. });
            if let Outcome::JobSubmitted { id, created } = e.applied.outcome {
                if created {
                    prop_assert_eq!(id, e.before.last_job_id + 1, "ids come from the log");
                    prop_assert_eq!(e.after.jobs[&id].version, e.index);
                    acknowledged.push(id);
                } else {
                    prop_assert!(
                        e.before.jobs.contains_key(&id) || e.before.archived.contains_key(&id),
                        "a retry names an existing job"
                    );
                }
            }
            for id in &acknowledged {
                if e.after.jobs.contains_key(id) {
                    continue;
                }
                if let Some(a) = e.after.archived.get(id) {
                    if let Some(job) = e.before.jobs.get(id) {
                        prop_assert!(compaction, "job {} archived by {}", id, e.command);
                        prop_assert!(job.state.is_final() && job.allocations.is_empty());
                        prop_assert_eq!(a.state, job.state);
                        prop_assert_eq!(a.spec_fingerprint, spec_fingerprint(&job.spec));
                    }
                    continue;
                }
                prop_assert!(
                    forgotten.contains(id) || compaction,
                    "job {} lost by {}", id, e.command
                );
                if let Some(job) = e.before.jobs.get(id) {
                    prop_assert!(job.state.is_final(), "unfinished job {} forgotten", id);
                }
                forgotten.insert(*id);
            }
            let kept: BTreeSet<JobId> =
                e.after.jobs.keys().chain(e.after.archived.keys()).copied().collect();
            prop_assert_eq!(
                kept.len(),
                e.after.jobs.len() + e.after.archived.len(),
                "a job is both whole and archived"
            );
            prop_assert!(
                kept.iter().copied().chain(forgotten.iter().copied()).collect::<BTreeSet<_>>()
                    .into_iter().eq(1..=e.after.last_job_id),
                "job ids {:?} (forgotten {:?}) are not 1..={}",
                kept, forgotten, e.after.last_job_id
            );
            for (id, job) in &e.after.jobs {
                prop_assert_eq!(*id, job.id);
            }
            prop_assert!(e.after.last_allocation_id >= e.before.last_allocation_id);
            Ok(())
        })?;
    }

    /// (c) Each (tenant, key) names at most one job, and a retry with the same spec returns it.
    #[test]
    fn an_idempotency_key_names_at_most_one_job(steps in steps()) {
        execute(&steps, |e| {
            let mut keyed: BTreeMap<(&str, &str), JobId> = BTreeMap::new();
            let whole = e.after.jobs.values().map(|j| (j.id, j.spec.tenant.as_str(), j.idempotency_key.as_deref()));
            let archived = e.after.archived.values().map(|a| (a.id, a.tenant(), a.idempotency_key()));
            for (id, tenant, key) in whole.chain(archived) {
                if let Some(key) = key {
                    let previous = keyed.insert((tenant, key), id);
                    prop_assert!(
                        previous.is_none(),
                        "tenant {} key {} names jobs {:?} and {}",
                        tenant, key, previous, id
                    );
                    prop_assert_eq!(e.after.job_for_key(tenant, key), Some(id));
                }
            }
            let indexed: usize = e.after.index.idempotency.values().map(BTreeMap::len).sum();
            prop_assert_eq!(indexed, keyed.len(), "the index has keys no job carries");

            if let Command::SubmitJob { spec, idempotency_key: Some(key) } = e.command
                && let Some(existing) = e.before.job_for_key(&spec.tenant, key)
            {
                let fingerprint = match (e.before.jobs.get(&existing), e.before.archived.get(&existing)) {
                    (Some(job), _) => spec_fingerprint(&job.spec),
                    (None, Some(a)) => a.spec_fingerprint,
                    (None, None) => unreachable!("check_consistency: a key names a kept job"),
                };
                match &e.applied.outcome {
                    Outcome::JobSubmitted { id, created } => {
                        prop_assert_eq!(*id, existing);
                        prop_assert!(!*created);
                        prop_assert_eq!(fingerprint, spec_fingerprint(spec));
                        if let Some(job) = e.before.jobs.get(&existing) {
                            prop_assert_eq!(&job.spec, spec);
                        }
                    }
                    Outcome::Rejected(r) => {
                        prop_assert_eq!(r.kind, RejectKind::FailedPrecondition);
                        prop_assert_ne!(fingerprint, spec_fingerprint(spec));
                    }
                    other => prop_assert!(false, "unexpected outcome {:?}", other),
                }
            }
            Ok(())
        })?;
    }

    /// (d) Replaying the log on a fresh state gives the same outcomes and the same state, and a
    /// snapshot (serde_json) of any reached state reads back equal.
    #[test]
    fn replaying_the_log_gives_the_same_state_and_outcomes(steps in steps()) {
        let mut snapshots = 0;
        let run = execute(&steps, |e| {
            if e.index % 8 == 0 {
                let bytes = serde_json::to_vec(e.after).expect("serialize");
                let mut back: ClusterState = serde_json::from_slice(&bytes).expect("deserialize");
                back.rebuild_indexes();
                prop_assert_eq!(&back, e.after, "snapshot round trip after {}", e.command);
                snapshots += 1;
            }
            Ok(())
        })?;
        let mut replica = ClusterState::default();
        for ((command, at, index), original) in run.log.iter().zip(&run.outcomes) {
            let applied = replica.apply(command, *at, *index);
            prop_assert_eq!(&applied, original, "outcome of {} differs on replay", command);
        }
        prop_assert_eq!(&replica, &run.state);

        let json = serde_json::to_string(&run.state).expect("serialize");
        let mut restored: ClusterState = serde_json::from_str(&json).expect("deserialize");
        restored.rebuild_indexes();
        prop_assert_eq!(&restored, &run.state);
        prop_assert!(restored.check_consistency().is_ok());
        prop_assert_eq!(serde_json::to_string(&restored).expect("serialize"), json);
        prop_assert!(snapshots > 0 || run.log.len() < 8);
    }

    /// (e) A rejected command, a plan refused in full and an idempotent retry change nothing
    /// (but the applied-at clock).
    #[test]
    fn a_rejected_command_changes_nothing(steps in steps()) {
        execute(&steps, |e| {
            let no_op = match &e.applied.outcome {
                Outcome::Rejected(_) => true,
                Outcome::JobSubmitted { created: false, .. } => true,
                Outcome::Placed { accepted, .. } => accepted.is_empty(),
                _ => false,
            };
            if no_op {
                prop_assert!(
                    unchanged_but_clock(e.before, e.after, e.at, matches!(e.applied.outcome, Outcome::Rejected(_))),
                    "{} ({:?}) changed the state",
                    e.command,
                    e.applied.outcome
                );
                prop_assert!(e.applied.changed_jobs.is_empty());
            }
            if let (Command::Place { placements, .. }, Outcome::Placed { accepted, rejected }) =
                (e.command, &e.applied.outcome)
            {
                prop_assert_eq!(accepted.len() + rejected.len(), placements.len());
            }
            Ok(())
        })?;
    }

    /// Watchers learn of every job change: a job that differs after an entry is listed in
    /// `changed_jobs`, and its version is the entry's index.
    #[test]
    fn changed_jobs_lists_every_job_that_changed(steps in steps()) {
        execute(&steps, |e| {
            for (id, job) in &e.after.jobs {
                if e.before.jobs.get(id) != Some(job) {
                    prop_assert!(
                        e.applied.changed_jobs.contains(id),
                        "{} changed job {} without listing it in {:?}",
                        e.command, id, e.applied.changed_jobs
                    );
                    prop_assert_eq!(job.version, e.index);
                }
            }
            Ok(())
        })?;
    }
}

proptest! {
    #![proptest_config(config())]

    /// (g) A `Batch` entry (group commit) changes the state exactly as its commands would, applied
    /// one by one at the same index and time: same outcomes in order, same changed jobs, same
    /// state. Rejected members change nothing and do not stop the rest.
    #[test]
    fn a_batch_applies_like_its_commands_one_by_one(
        steps in steps(),
        cuts in vec(1usize..6, 1..40),
    ) {
        let run = execute(&steps, |_| Ok(()))?;
        let mut one_by_one = ClusterState::default();
        let mut batched = ClusterState::default();
        let mut log = run.log.iter().map(|(c, at, _)| (c.clone(), *at));
        let mut index = 0;
        for cut in cuts.iter().cycle() {
            let chunk: Vec<(Command, Timestamp)> = log.by_ref().take(*cut).collect();
            let Some(&(_, at)) = chunk.last() else { break };
            index += 1;
            let mut outcomes = Vec::new();
            let mut changed = BTreeSet::new();
            for (command, _) in &chunk {
                let applied = one_by_one.apply(command, at, index);
                outcomes.push(applied.outcome);
                changed.extend(applied.changed_jobs);
            }
            let commands = chunk.into_iter().map(|(c, _)| c).collect();
            let applied = batched.apply(&Command::Batch { commands }, at, index);
            prop_assert_eq!(&applied.outcome, &Outcome::Batch(outcomes));
            prop_assert_eq!(
                applied.changed_jobs.into_iter().collect::<BTreeSet<_>>(),
                changed
            );
            prop_assert!(batched == one_by_one, "states differ after batch {}", index);
        }
        check_invariants(&batched).map_err(TestCaseError::fail)?;
    }
}

/// The generator is not vacuous: over a few dozen sequences it reaches every kind of outcome the
/// properties above are about.
#[test]
fn random_sequences_reach_the_interesting_outcomes() {
    use std::cell::RefCell;

    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let seen: RefCell<BTreeSet<&'static str>> = RefCell::default();
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 64,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    runner
        .run(&steps(), |steps| {
            execute(&steps, |e| {
                let mut seen = seen.borrow_mut();
                match (&e.command, &e.applied.outcome) {
                    (_, Outcome::Placed { accepted, rejected }) => {
                        for id in accepted {
                            seen.insert("placed");
                            if e.after.jobs[id].spec.tasks > 1 {
                                seen.insert("gang placed");
                            }
                        }
                        if rejected.iter().any(|(_, r)| r.contains("already held")) {
                            seen.insert("plan onto held GPU refused");
                        }
                    }
                    (_, Outcome::JobSubmitted { id, created: false }) => {
                        seen.insert("retry");
                        if e.before.archived.contains_key(id) {
                            seen.insert("retry of an archived job");
                        }
                    }
                    (Command::SubmitJob { .. }, Outcome::Rejected(r))
                        if r.kind == RejectKind::FailedPrecondition =>
                    {
                        seen.insert("key reused with another spec");
                    }
                    (Command::RegisterNode { .. }, Outcome::Rejected(_)) => {
                        seen.insert("registration refused");
                    }
                    _ => {}
                }
                if e.after.archived.len() > e.before.archived.len() {
                    seen.insert("archived");
                }
                if e.before
                    .archived
                    .keys()
                    .any(|id| !e.after.archived.contains_key(id))
                {
                    seen.insert("forgotten");
                }
                for (id, job) in &e.after.jobs {
                    let was = e.before.jobs.get(id).map(|j| j.state);
                    if was == Some(job.state) {
                        continue;
                    }
                    seen.insert(match job.state {
                        JobState::Pending if was.is_some() => "requeued",
                        JobState::Pending => "submitted",
                        JobState::Scheduled => "scheduled",
                        JobState::Running => "running",
                        JobState::Succeeded => "succeeded",
                        JobState::Failed => "failed",
                        JobState::Cancelled if job.allocations.is_empty() => "cancelled",
                        JobState::Cancelled => "cancelled while holding GPUs",
                        JobState::TimedOut => "timed out",
                    });
                }
                Ok(())
            })?;
            Ok(())
        })
        .unwrap();
    let seen = seen.into_inner();
    for expected in [
        "placed",
        "gang placed",
        "plan onto held GPU refused",
        "retry",
        "key reused with another spec",
        "registration refused",
        "requeued",
        "submitted",
        "scheduled",
        "running",
        "succeeded",
        "failed",
        "cancelled",
        "cancelled while holding GPUs",
        "timed out",
        "archived",
        "forgotten",
        "retry of an archived job",
    ] {
        assert!(
            seen.contains(expected),
            "no sequence reached {expected:?}; saw {seen:?}"
        );
    }
}
