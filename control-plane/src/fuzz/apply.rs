//! Target `apply`: `ClusterState::apply` over command sequences that the bytes program. A
//! generator (`Gen`, over a `ByteReader`) makes every `Command` variant — batches and
//! attributed commands included, nested where apply must refuse them — naming mostly things
//! that exist (pending jobs, live allocations, the nodes' GPUs and MIG slices) so that
//! commands get past the first lookups, and sometimes anything at all. A `Plan` step runs the
//! real scheduler and applies its plan and preemptions, as the leader does.
//!
//! The first byte picks the start (the fleet of `fleet`, or an empty state). Entries get
//! increasing indexes; the leader clock moves forward, and now and then back a little (a
//! failover to a leader with a slower clock). After each entry: `check_consistency`, no tenant
//! pushed past its limit, the invariants below, and that a rejected command changed nothing.
//! At the end: the log replayed on the start state gives the same outcomes and state, and a
//! snapshot (serde_json, `rebuild_indexes`) reads back equal and consistent.

use std::collections::{BTreeMap, BTreeSet};

use super::fleet::{self, Fleet};
use super::{ByteReader, Features, Target, shape};
use crate::dst::check::describe_difference;
use crate::scheduler;
use crate::state::{
    Actor, AllocationId, ApiRole, ArrayRange, ArraySpec, AuditRetention, ClusterState, Command,
    Dependency, DependencyKind, Gpu, GpuHealth, JobChange, JobId, JobPlacement, JobRetention,
    JobSpec, JobState, JobUpdate, MigSlice, NodeSpec, NodeStatus, Outcome, Partition, TaskOutcome,
    TaskPlacement, Tenant, TokenRecord,
};

pub const TARGET: Target = Target {
    name: "apply",
    about: "bytes program a sequence of every Command variant (and scheduler passes) → apply; \
            consistency and invariants after each, replay and snapshot round trip at the end",
    max_len: 2048,
    dictionary: &[],
    seeds,
    run,
};

/// Most generator steps per case (a plan step applies more than one entry).
const MAX_STEPS: usize = 48;

const NODE_NAMES: [&str; 5] = ["n0", "n1", "n2", "n3", "n4"];
const TENANTS: [&str; 5] = ["ta", "tb", "ghost", "default", ""];
const MODELS: [&str; 3] = ["A100", "H100", "V100"];
const PROFILES: [&str; 6] = ["1g.10gb", "3g.40gb", "7g.80gb", "2g.20gb", "0g.5gb", "9g"];
const KEYS: [&str; 3] = ["k0", "k1", "first"];
const TOKEN_IDS: [&str; 4] = [
    "0123456789abcdef",
    "fedcba9876543210",
    "0123456789ABCDEF",
    "0123",
];

/// Programs: each step's opcode followed by zeros (every variant once, with its first
/// choices), and a few longer random ones.
fn seeds() -> Vec<Vec<u8>> {
    let mut every = vec![0u8];
    for op in 0..OPS {
        every.push(op);
        every.extend_from_slice(&[0; 12]);
    }
    let mut out = vec![every.clone(), {
        let mut empty_start = every;
        empty_start[0] = 1;
        empty_start
    }];
    // Submit, plan, start and exit, over and over: a busy cluster.
    let mut busy = vec![0u8];
    for i in 0..10u8 {
        busy.extend_from_slice(&[30, op::SUBMIT, i, 1, 0, 0, 1, 0]);
        busy.extend_from_slice(&[30, op::PLAN, 30, op::STARTED, i, 30, op::EXITED, i, i % 6]);
    }
    out.push(busy);
    let mut rng = crate::scheduler::score::SplitMix64::new(7);
    for len in [64, 256, 1024] {
        out.push((0..len).map(|_| rng.next_u64() as u8).collect());
    }
    out
}

/// Opcodes of generator steps (the step's first byte, modulo `OPS`).
mod op {
    pub const SUBMIT: u8 = 0;
    pub const RESUBMIT: u8 = 1;
    pub const CANCEL: u8 = 2;
    pub const REGISTER: u8 = 3;
    pub const PLACE: u8 = 4;
    pub const PLAN: u8 = 5;
    pub const STARTED: u8 = 6;
    pub const EXITED: u8 = 7;
    pub const TENANT: u8 = 8;
    pub const NODE_STATUS: u8 = 9;
    pub const NODE_LOST: u8 = 10;
    pub const GPU_HEALTH: u8 = 11;
    pub const PARTITION: u8 = 12;
    pub const PREEMPT: u8 = 13;
    pub const COMPACT_JOBS: u8 = 14;
    pub const BATCH: u8 = 15;
    pub const CREATE_TOKEN: u8 = 16;
    pub const REVOKE_TOKEN: u8 = 17;
    pub const AUDIT_NOTE: u8 = 18;
    pub const COMPACT_AUDIT: u8 = 19;
    pub const CHANGE_JOBS: u8 = 20;
    pub const ATTRIBUTED: u8 = 21;
}
const OPS: u8 = op::ATTRIBUTED + 1;

fn run(input: &[u8], features: &mut Features) -> Result<(), String> {
    let mut r = ByteReader::new(input);
    let start = if r.u8() & 1 == 0 {
        fleet::fleet().clone()
    } else {
        Fleet {
            state: ClusterState::default(),
            index: 0,
            at: fleet::START,
        }
    };
    let mut g = Gen {
        f: start.clone(),
        log: Vec::new(),
        submissions: Vec::new(),
    };
    let mut steps = 0;
    while !r.is_empty() && steps < MAX_STEPS {
        steps += 1;
        let clock = r.u8();
        let step_ms = match clock {
            // Back a little: the next leader's clock is behind.
            0..=7 => None,
            8..=199 => Some(u64::from(clock) * 10),
            _ => Some(u64::from(r.u16()) * 1000),
        };
        let code = r.u8() % OPS;
        let commands = if code == op::PLAN {
            g.plan()
        } else {
            vec![g.command_of(code, &mut r, 0)]
        };
        for command in commands {
            g.apply(&command, step_ms, features)?;
        }
    }
    g.finish(&start)
}

/// The state being built and the log that built it.
struct Gen {
    f: Fleet,
    /// (command, leader time, index, outcome) of every entry.
    log: Vec<(Command, u64, u64, Outcome)>,
    /// Submissions made so far, for retries.
    submissions: Vec<Command>,
}

impl Gen {
    fn state(&self) -> &ClusterState {
        &self.f.state
    }

    /// Applies one entry and checks what must hold after it.
    fn apply(
        &mut self,
        command: &Command,
        step_ms: Option<u64>,
        features: &mut Features,
    ) -> Result<(), String> {
        let before = self.f.state.clone();
        self.f.index += 1;
        self.f.at = match step_ms {
            Some(ms) => self.f.at.saturating_add(ms),
            None => self.f.at.saturating_sub(5000),
        };
        let applied = self.f.state.apply(command, self.f.at, self.f.index);
        outcome_features(features, command, &applied.outcome);
        if let Command::SubmitJob { .. } = command.unattributed() {
            self.submissions.push(command.clone());
        }
        let after = &self.f.state;
        let fail = |e: String| format!("{e} (after {command})");
        after.check_consistency().map_err(fail)?;
        match command {
            // A batch may lower a limit after a placement it made under the old one: the
            // limit holds at each command, so it is checked at each (apply runs a batch's
            // commands one by one; a batch nested in a batch is refused and changes nothing).
            Command::Batch { commands } => {
                let mut at_step = before.clone();
                for inner in commands
                    .iter()
                    .filter(|c| !matches!(c, Command::Batch { .. }))
                {
                    let previous = at_step.clone();
                    at_step.apply(inner, self.f.at, self.f.index);
                    quotas(&previous, &at_step).map_err(fail)?;
                }
            }
            _ => quotas(&before, after).map_err(fail)?,
        }
        invariants(after).map_err(fail)?;
        if matches!(applied.outcome, Outcome::Rejected(_)) && *after != before {
            return Err(fail(format!(
                "a rejected command changed the state ({})",
                describe_difference(&before, after)
            )));
        }
        self.log
            .push((command.clone(), self.f.at, self.f.index, applied.outcome));
        Ok(())
    }

    /// Replay and snapshot checks, once the program has run.
    fn finish(&self, start: &Fleet) -> Result<(), String> {
        let mut replica = start.state.clone();
        for (command, at, index, outcome) in &self.log {
            let applied = replica.apply(command, *at, *index);
            if &applied.outcome != outcome {
                return Err(format!(
                    "replaying {command} gave {:?}, the first run {outcome:?}",
                    applied.outcome
                ));
            }
        }
        if replica != self.f.state {
            return Err(format!(
                "replaying the log gave another state: {}",
                describe_difference(&replica, &self.f.state)
            ));
        }
        let json = serde_json::to_vec(&self.f.state).map_err(|e| format!("serialize: {e}"))?;
        let mut restored: ClusterState =
            serde_json::from_slice(&json).map_err(|e| format!("deserialize a snapshot: {e}"))?;
        restored.rebuild_indexes();
        if restored != self.f.state {
            return Err(format!(
                "a snapshot reads back as another state: {}",
                describe_difference(&restored, &self.f.state)
            ));
        }
        restored
            .check_consistency()
            .map_err(|e| format!("a restored snapshot is inconsistent: {e}"))?;
        let again = serde_json::to_vec(&restored).map_err(|e| format!("serialize: {e}"))?;
        if again != json {
            return Err("a restored snapshot serializes differently".into());
        }
        Ok(())
    }

    /// What the leader's scheduling pass proposes now: its plan, then its preemptions.
    fn plan(&self) -> Vec<Command> {
        let plan = scheduler::plan(self.state(), self.f.at);
        let mut out = vec![Command::Place {
            term: fleet::TERM,
            placements: plan.placements,
        }];
        for p in plan.preemptions {
            out.push(Command::Preempt {
                for_job: p.for_job,
                victims: p.victims,
                reason: "higher priority work".into(),
            });
        }
        out
    }

    /// One command; `depth` > 0 inside a batch or an attribution (where another one is
    /// allowed only to be refused).
    fn command(&self, r: &mut ByteReader, depth: u8) -> Command {
        let code = r.u8() % OPS;
        self.command_of(code, r, depth)
    }

    /// The command of opcode `code` (a plan step inside a batch is a submission).
    fn command_of(&self, code: u8, r: &mut ByteReader, depth: u8) -> Command {
        match code {
            op::SUBMIT | op::PLAN => Command::SubmitJob {
                spec: self.spec(r),
                idempotency_key: match r.u8() % 4 {
                    0 | 1 => None,
                    2 => Some(r.pick(&KEYS).to_string()),
                    _ => Some(r.string(300)),
                },
            },
            op::RESUBMIT => match self.submissions.len() {
                0 => Command::submit(self.spec(r), None),
                n => self.submissions[r.below(n)].clone(),
            },
            op::CANCEL => Command::CancelJob {
                job: self.job(r),
                reason: r.string(8),
            },
            op::REGISTER => Command::RegisterNode {
                spec: self.node_spec(r),
            },
            op::PLACE => Command::Place {
                term: if r.chance(32) {
                    r.number()
                } else {
                    fleet::TERM
                },
                placements: (0..=r.below(3)).map(|_| self.placement(r)).collect(),
            },
            op::STARTED => Command::AllocationStarted {
                allocation: self.allocation(r),
            },
            op::EXITED => Command::AllocationExited {
                allocation: self.allocation(r),
                outcome: outcome(r),
                usage: None,
            },
            op::TENANT => Command::PutTenant {
                tenant: Tenant {
                    name: self.tenant(r),
                    weight: small(r, &[0, 1, 2, 100]) as u32,
                    quota_gpus: small(r, &[0, 1, 4, 16]) as u32,
                    max_gpus: small(r, &[0, 2, 8, 64]) as u32,
                },
            },
            op::NODE_STATUS => Command::SetNodeStatus {
                node: self.node_name(r),
                status: *r.pick(&[NodeStatus::Ready, NodeStatus::Drained, NodeStatus::Down]),
                evict: r.bool(),
                reason: r.string(8),
            },
            op::NODE_LOST => {
                let node = self.node_name(r);
                let registered_at = match self.state().nodes.get(&node) {
                    Some(n) if !r.chance(32) => n.registered_at,
                    _ => r.number(),
                };
                Command::NodeLost {
                    node,
                    reason: r.string(8),
                    registered_at,
                }
            }
            op::GPU_HEALTH => {
                let node = self.node_name(r);
                Command::SetGpuHealth {
                    gpu: self.unit(r, &node),
                    node,
                    health: if r.bool() {
                        GpuHealth::Healthy
                    } else {
                        GpuHealth::Unhealthy {
                            reason: "Xid 79".into(),
                        }
                    },
                }
            }
            op::PARTITION => Command::PutPartition {
                partition: Partition {
                    name: if r.bool() {
                        fleet::PARTITION.into()
                    } else {
                        r.string(10)
                    },
                    description: if r.chance(16) {
                        "d".repeat(1025)
                    } else {
                        r.string(10)
                    },
                },
            },
            op::PREEMPT => Command::Preempt {
                for_job: self.job(r),
                victims: (0..r.below(4)).map(|_| self.job(r)).collect(),
                reason: r.string(8),
            },
            op::COMPACT_JOBS => Command::CompactJobs {
                limit: [None, Some(0), Some(1), Some(3)][r.u8() as usize % 4],
                retention: JobRetention {
                    full_record_ms: small(r, &[0, 1000, 3_600_000, u64::MAX]),
                    max_full_records: small(r, &[0, 1, 5, u64::MAX]),
                    archive_ms: small(r, &[0, 1000, 3_600_000, u64::MAX]),
                    max_archived: small(r, &[0, 1, 5, u64::MAX]),
                },
            },
            op::BATCH => {
                let n = if depth < 2 { r.below(5) } else { 0 };
                Command::Batch {
                    commands: (0..n).map(|_| self.command(r, depth + 1)).collect(),
                }
            }
            op::CREATE_TOKEN => Command::CreateToken {
                token: self.token(r),
            },
            op::REVOKE_TOKEN => Command::RevokeToken {
                id: r.pick(&TOKEN_IDS).to_string(),
                by: "token:0123456789abcdef".into(),
            },
            op::AUDIT_NOTE => Command::AuditNote {
                action: r.pick(&["add_voter", "remove_voter", ""]).to_string(),
                target: r.string(16),
                detail: r.string(300),
            },
            op::COMPACT_AUDIT => Command::CompactAudit {
                retention: AuditRetention {
                    max_age_ms: small(r, &[0, 1000, 86_400_000, u64::MAX]),
                    max_records: small(r, &[0, 1, 10, u64::MAX]),
                },
            },
            op::CHANGE_JOBS => Command::ChangeJobs {
                jobs: (0..r.below(4)).map(|_| self.job(r)).collect(),
                change: match r.u8() % 5 {
                    0 => JobChange::Hold,
                    1 => JobChange::Release,
                    2 => JobChange::Requeue {
                        reason: r.string(6),
                    },
                    3 => JobChange::Cancel {
                        reason: r.string(6),
                    },
                    _ => JobChange::Update(JobUpdate {
                        name: r.chance(4).then(|| r.string(6)),
                        time_limit_secs: r.chance(4).then(|| small(r, &[0, 60, 3600, u64::MAX])),
                        priority_class: r
                            .chance(4)
                            .then(|| r.pick(&["low", "high", "vip"]).to_string()),
                        partition: r
                            .chance(4)
                            .then(|| r.pick(&["", fleet::PARTITION, "nope"]).to_string()),
                        begin_at: r.chance(4).then(|| fleet::START + r.below(120_000) as u64),
                        nodelist: r.chance(4).then(|| self.node_list(r)),
                        exclude: r.chance(4).then(|| self.node_list(r)),
                        max_running: r.chance(4).then(|| r.below(4) as u32),
                    }),
                },
            },
            _ => {
                let actor = self.actor(r);
                let inner = if depth < 2 {
                    self.command(r, depth + 1)
                } else {
                    Command::AuditNote {
                        action: "note".into(),
                        target: String::new(),
                        detail: String::new(),
                    }
                };
                Command::Attributed {
                    actor,
                    command: Box::new(inner),
                }
            }
        }
    }

    fn spec(&self, r: &mut ByteReader) -> JobSpec {
        let gpu_milli = match r.u8() % 8 {
            0..=3 => 0,
            4 => 250,
            5 => 500,
            6 => 999,
            _ => r.number() as u32,
        };
        JobSpec {
            tenant: self.tenant(r),
            name: if r.chance(8) {
                "n".repeat(257)
            } else {
                r.string(6)
            },
            command: match r.u8() % 8 {
                0 => Vec::new(),
                1 => vec!["  ".into()],
                2 => vec![r.string(12)],
                _ => vec!["python".into(), "train.py".into()],
            },
            gpus_per_task: if r.chance(16) {
                r.number() as u32
            } else {
                r.below(6) as u32
            },
            tasks: if r.chance(16) {
                r.number() as u32
            } else {
                r.below(3) as u32 + 1
            },
            gpu_models: (0..r.below(3))
                .map(|_| {
                    if r.chance(16) {
                        String::new()
                    } else {
                        r.pick(&MODELS).to_string()
                    }
                })
                .collect(),
            partition: match r.u8() % 4 {
                0 | 1 => None,
                2 => Some(fleet::PARTITION.into()),
                _ => Some(r.string(6)),
            },
            priority_class: r.pick(&["normal", "low", "high", "", "vip"]).to_string(),
            time_limit_secs: r.bool().then(|| r.number()),
            dependencies: (0..r.below(3))
                .map(|_| Dependency {
                    kind: *r.pick(&[
                        DependencyKind::AfterOk,
                        DependencyKind::AfterAny,
                        DependencyKind::AfterNotOk,
                    ]),
                    job: self.job(r),
                })
                .collect(),
            cpu_milli_per_task: small(r, &[0, 1000, 64_000, 100_000]),
            memory_mib_per_task: small(r, &[0, 1024, 512 * 1024, 1 << 40]),
            env: (0..r.below(3))
                .map(|_| (r.pick(&["A", "B=C", "", "D\0"]).to_string(), r.string(4)))
                .collect(),
            gpu_milli,
            gpu_memory_mib: match r.u8() % 8 {
                0..=4 => 0,
                5 => 10_240,
                6 => 81_920,
                _ => r.number(),
            },
            mig_profile: match r.u8() % 4 {
                0 | 1 => None,
                2 => Some(r.pick(&PROFILES).to_string()),
                _ => Some(r.string(8)),
            },
            preemptible: r.bool(),
            single_numa: r.chance(32),
            workdir: None,
            container: None,
            stdout_path: None,
            stderr_path: None,
            hold_if_unfit: false,
            nodelist: self.node_list(r),
            exclude: self.node_list(r),
            exclusive: r.chance(16),
            begin_at: r.chance(16).then(|| fleet::START + r.below(120_000) as u64),
            hold: r.chance(16),
            array: r.chance(16).then(|| ArraySpec {
                ranges: (0..r.below(3))
                    .map(|_| {
                        let first = r.below(8) as u32;
                        ArrayRange {
                            first,
                            last: if r.chance(16) {
                                r.number() as u32
                            } else {
                                first + r.below(8) as u32
                            },
                            step: r.below(3) as u32,
                        }
                    })
                    .collect(),
                max_running: r.below(4) as u32,
            }),
            ports: match r.below(16) {
                0 => vec!["http".into()],
                1 => vec!["http".into(), "metrics".into()],
                2 => vec!["9bad".into()],
                _ => Vec::new(),
            },
        }
    }

    /// A fleet node's spec (or `n3`, `n4`: new ones), changed a little.
    fn node_spec(&self, r: &mut ByteReader) -> NodeSpec {
        let k = r.below(5);
        let mut spec = match self.state().nodes.get(NODE_NAMES[k]) {
            Some(n) if r.bool() => n.spec.clone(),
            _ => fleet::node_spec(k.min(2)),
        };
        if k >= 3 {
            spec.name = NODE_NAMES[k].into();
            for (i, g) in spec.gpus.iter_mut().enumerate() {
                g.uuid = fleet::gpu_uuid(NODE_NAMES[k], i as u32);
            }
        }
        for _ in 0..r.below(4) {
            let gpus = spec.gpus.len();
            match r.u8() % 12 {
                0 if gpus > 0 => {
                    spec.gpus.remove(r.below(gpus));
                }
                1 => spec.gpus.push(Gpu {
                    uuid: {
                        let node = NODE_NAMES[r.below(5)];
                        self.unit(r, node)
                    },
                    index: gpus as u32,
                    model: r.pick(&MODELS).to_string(),
                    memory_mib: small(r, &[0, 40_960, 81_920, u64::MAX]),
                    numa_node: r.bool().then(|| r.below(3) as u32),
                    pci_bus_id: String::new(),
                    health: GpuHealth::Healthy,
                    mig: Vec::new(),
                }),
                2 if gpus > 0 => {
                    let i = r.below(gpus);
                    let slices = (0..r.below(4))
                        .map(|slot| MigSlice {
                            uuid: if r.chance(32) {
                                let node = NODE_NAMES[r.below(5)];
                                self.unit(r, node)
                            } else {
                                fleet::mig_uuid(&spec.name, i as u32, slot as u32)
                            },
                            profile: r.pick(&PROFILES).to_string(),
                            memory_mib: small(r, &[0, 10_240, 40_960, u64::MAX]),
                        })
                        .collect();
                    spec.gpus[i].mig = slices;
                }
                3 if gpus > 0 => {
                    let i = r.below(gpus);
                    spec.gpus[i].memory_mib = small(r, &[0, 1, 81_920, u64::MAX]);
                }
                4 if gpus > 0 => {
                    let i = r.below(gpus);
                    spec.gpus[i].model = r.pick(&MODELS).to_string();
                }
                5 if gpus > 0 => {
                    let i = r.below(gpus);
                    spec.gpus[i].health = GpuHealth::Unhealthy {
                        reason: "Xid 48".into(),
                    };
                }
                6 => spec.incarnation = r.pick(&["inc-0", "inc-1", "other", ""]).to_string(),
                7 => {
                    spec.partition = match r.u8() % 3 {
                        0 => None,
                        1 => Some(fleet::PARTITION.into()),
                        _ => Some(r.string(6)),
                    }
                }
                8 => spec.cpu_milli = small(r, &[0, 1000, 64_000, u64::MAX]),
                9 => spec.memory_mib = small(r, &[0, 1024, 512 * 1024, u64::MAX]),
                10 if gpus > 0 => {
                    let i = r.below(gpus);
                    spec.gpus[i].numa_node = r.bool().then(|| r.u8() as u32);
                }
                _ => spec.name = r.string(8),
            }
        }
        spec
    }

    /// A placement: usually of a pending job, on units that fit its kind.
    fn placement(&self, r: &mut ByteReader) -> JobPlacement {
        let s = self.state();
        let pending: Vec<JobId> = s.index.pending.iter().copied().collect();
        let job = if !pending.is_empty() && !r.chance(32) {
            pending[r.below(pending.len())]
        } else {
            self.job(r)
        };
        let spec = s.jobs.get(&job).map(|j| j.spec.clone());
        let tasks = spec.as_ref().map_or(1, |j| j.tasks as usize).min(8);
        let tasks = if r.chance(16) { tasks + 1 } else { tasks };
        let mut taken: BTreeSet<String> = BTreeSet::new();
        let tasks = (0..tasks)
            .map(|_| {
                let node = self.node_name(r);
                let want = spec
                    .as_ref()
                    .map_or(1, |j| j.gpus_per_task as usize)
                    .min(16);
                let want = if r.chance(16) { want + 1 } else { want };
                let mut units = self.fitting_units(&node, spec.as_ref(), &taken);
                let gpus: Vec<String> = (0..want)
                    .map(|_| {
                        if units.is_empty() || r.chance(24) {
                            self.unit(r, &node)
                        } else {
                            units.remove(r.below(units.len()))
                        }
                    })
                    .collect();
                if spec.as_ref().is_none_or(|j| !j.is_share()) {
                    taken.extend(gpus.iter().cloned());
                }
                TaskPlacement { node, gpus }
            })
            .collect();
        JobPlacement { job, tasks }
    }

    /// Units of `node` that a task of `spec` could take: free slices of its profile, or GPUs
    /// not in MIG mode and not held whole.
    fn fitting_units(
        &self,
        node: &str,
        spec: Option<&JobSpec>,
        taken: &BTreeSet<String>,
    ) -> Vec<String> {
        let s = self.state();
        let Some(n) = s.nodes.get(node) else {
            return Vec::new();
        };
        let free = |u: &String| !s.gpu_holder.contains_key(u) && !taken.contains(u);
        match spec.and_then(|j| j.mig_profile.as_deref()) {
            Some(profile) => n
                .spec
                .gpus
                .iter()
                .flat_map(|g| &g.mig)
                .filter(|m| m.profile == profile)
                .map(|m| m.uuid.clone())
                .filter(free)
                .collect(),
            None => n
                .spec
                .gpus
                .iter()
                .filter(|g| g.mig.is_empty())
                .map(|g| g.uuid.clone())
                .filter(free)
                .collect(),
        }
    }

    fn token(&self, r: &mut ByteReader) -> TokenRecord {
        let role = *r.pick(&ApiRole::ALL);
        TokenRecord {
            id: r.pick(&TOKEN_IDS).to_string(),
            secret_sha256: if r.chance(16) {
                "x".repeat(64)
            } else {
                "a".repeat(64)
            },
            role,
            tenant: match (role, r.chance(32)) {
                (ApiRole::User, false) | (_, true) => Some(self.tenant(r)),
                _ => None,
            },
            description: if r.chance(16) {
                "line\nbreak".into()
            } else {
                r.string(8)
            },
            created_at: r.number(),
            created_by: "token:0123456789abcdef".into(),
            expires_at: r.bool().then(|| self.f.at.saturating_add(r.number())),
            revoked_at: r.chance(16).then(|| r.number()),
            revoked_by: None,
        }
    }

    fn actor(&self, r: &mut ByteReader) -> Actor {
        match r.u8() % 4 {
            0 => fleet::admin(),
            1 => fleet::agent(NODE_NAMES[r.below(NODE_NAMES.len())]),
            2 => Actor {
                principal: "token:fedcba9876543210".into(),
                role: "user".into(),
                tenant: Some(self.tenant(r)),
                from: "10.0.0.7:1234".into(),
            },
            _ => Actor {
                principal: "anonymous".into(),
                role: "admin".into(),
                tenant: None,
                from: String::new(),
            },
        }
    }

    fn tenant(&self, r: &mut ByteReader) -> String {
        if r.chance(8) {
            r.string(10)
        } else {
            r.pick(&TENANTS).to_string()
        }
    }

    fn node_name(&self, r: &mut ByteReader) -> String {
        if r.chance(8) {
            r.string(6)
        } else {
            r.pick(&NODE_NAMES).to_string()
        }
    }

    /// A job id: mostly one the state knows (whole or archived), sometimes any number.
    /// Mostly no list; else a node or two of the fleet, sometimes unsorted or unknown.
    fn node_list(&self, r: &mut ByteReader) -> Vec<String> {
        if !r.chance(8) {
            return Vec::new();
        }
        let mut list: Vec<String> = (0..r.below(3) + 1)
            .map(|_| {
                if r.chance(16) {
                    r.string(4)
                } else {
                    r.pick(&fleet::NODES).to_string()
                }
            })
            .collect();
        if r.bool() {
            list.sort();
            list.dedup();
        }
        list
    }

    fn job(&self, r: &mut ByteReader) -> JobId {
        let s = self.state();
        let known = s.jobs.len() + s.archived.len();
        if known == 0 || r.chance(24) {
            return r.number();
        }
        let i = r.below(known);
        match s.jobs.keys().nth(i) {
            Some(id) => *id,
            None => s
                .archived
                .keys()
                .nth(i - s.jobs.len())
                .copied()
                .unwrap_or(0),
        }
    }

    /// An allocation id: mostly a live one, sometimes any number.
    fn allocation(&self, r: &mut ByteReader) -> AllocationId {
        let s = self.state();
        if s.allocations.is_empty() || r.chance(24) {
            return r.number();
        }
        *s.allocations
            .keys()
            .nth(r.below(s.allocations.len()))
            .unwrap_or(&0)
    }

    /// A GPU or MIG slice UUID: mostly one `node` reports, sometimes another's or nonsense.
    fn unit(&self, r: &mut ByteReader, node: &str) -> String {
        let units: Vec<String> = self.state().nodes.get(node).map_or(Vec::new(), |n| {
            n.spec
                .gpus
                .iter()
                .flat_map(|g| {
                    std::iter::once(g.uuid.clone()).chain(g.mig.iter().map(|m| m.uuid.clone()))
                })
                .collect()
        });
        match r.u8() % 8 {
            _ if units.is_empty() => fleet::gpu_uuid(node, r.below(9) as u32),
            0 => fleet::gpu_uuid(NODE_NAMES[r.below(5)], r.below(9) as u32),
            1 => r.string(10),
            _ => units[r.below(units.len())].clone(),
        }
    }
}

fn outcome(r: &mut ByteReader) -> TaskOutcome {
    match r.u8() % 6 {
        0 => TaskOutcome::Succeeded,
        1 => TaskOutcome::Failed {
            exit_code: r.bool().then(|| r.u32() as i32),
            signal: r.bool().then(|| r.u8() as i32),
            reason: r.string(8),
        },
        2 => TaskOutcome::TimedOut,
        3 => TaskOutcome::Lost {
            reason: r.string(8),
        },
        _ => TaskOutcome::Stopped,
    }
}

/// One of `values`, or (one time in eight) any number.
fn small(r: &mut ByteReader, values: &[u64]) -> u64 {
    if r.chance(32) {
        r.number()
    } else {
        *r.pick(values)
    }
}

fn outcome_features(features: &mut Features, command: &Command, outcome: &Outcome) {
    let kind = command.kind();
    match outcome {
        Outcome::Rejected(r) => features.add((kind, r.kind as u8, shape(&r.message, 5))),
        Outcome::Placed { accepted, rejected } | Outcome::Preempted { accepted, rejected } => {
            features.add((kind, !accepted.is_empty(), rejected.len().min(3)));
            for (_, why) in rejected {
                features.add((kind, shape(why, 5)));
            }
        }
        Outcome::Batch(outcomes) => {
            for o in outcomes {
                features.add((kind, std::mem::discriminant(o)));
            }
        }
        other => features.add((kind, std::mem::discriminant(other))),
    }
}

/// No command takes a tenant past its GPU limit. (A limit lowered below what the tenant holds
/// is allowed: running work is not evicted for it, so the tenant may stay above it until
/// that work ends; `dst::check::check_state`, whose tenants never change, counts that as a
/// breach.)
fn quotas(before: &ClusterState, after: &ClusterState) -> Result<(), String> {
    for t in after.tenants.values().filter(|t| t.max_gpus > 0) {
        let held = after.gpu_milli_held_by_tenant(&t.name);
        let limit = u64::from(t.max_gpus) * crate::state::MILLI_PER_GPU;
        if held > limit && held > before.gpu_milli_held_by_tenant(&t.name) {
            return Err(format!(
                "tenant {} went to {held} milli-GPU, past its limit of {} GPUs",
                t.name, t.max_gpus
            ));
        }
    }
    Ok(())
}

/// What must hold after every entry, checked from the data itself (after `check_invariants`
/// of `state/proptests.rs`, which is test-only, extended to MIG slices).
fn invariants(s: &ClusterState) -> Result<(), String> {
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
            if a.gpu_milli == 0
                && let Some(other) = holder.insert(gpu, *id)
            {
                return Err(format!("GPU {gpu} is in allocations {other} and {id}"));
            }
            let reported = node
                .spec
                .gpus
                .iter()
                .any(|g| &g.uuid == gpu || g.mig.iter().any(|m| &m.uuid == gpu));
            if !reported {
                return Err(format!(
                    "allocation {id} holds {gpu}, which {} does not report",
                    a.node
                ));
            }
        }
    }
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
        return Err("gpu_node differs from the nodes' reports".into());
    }
    for job in s.jobs.values() {
        let recs: Vec<_> = job
            .allocations
            .iter()
            .filter_map(|a| s.allocations.get(a))
            .collect();
        if recs.iter().any(|r| r.allocation.job != job.id) {
            return Err(format!("job {} lists another job's allocation", job.id));
        }
        if job.history.last().map(|h| h.state) != Some(job.state) {
            return Err(format!(
                "job {} history does not end in {}",
                job.id, job.state
            ));
        }
        match job.state {
            JobState::Pending if job.ending.is_some() => {
                return Err(format!("pending job {} has an ending", job.id));
            }
            JobState::Scheduled | JobState::Running
                if recs.is_empty() || recs.len() > job.spec.tasks as usize =>
            {
                return Err(format!(
                    "{} job {} has {} allocations for {} tasks",
                    job.state,
                    job.id,
                    recs.len(),
                    job.spec.tasks
                ));
            }
            JobState::Running if !recs.iter().all(|r| r.started) => {
                return Err(format!("running job {} has an unstarted task", job.id));
            }
            JobState::Cancelled if !recs.iter().all(|r| r.stop_requested) => {
                return Err(format!(
                    "cancelled job {} has a task not told to stop",
                    job.id
                ));
            }
            JobState::Succeeded | JobState::Failed | JobState::TimedOut if !recs.is_empty() => {
                return Err(format!(
                    "{} job {} still holds allocations",
                    job.state, job.id
                ));
            }
            _ => {}
        }
    }
    Ok(())
}
