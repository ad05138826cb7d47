//! Unit tests of `ClusterState::apply`, one rule per test.
//!
//! Fixtures: `node(name, gpus, model)` builds a node spec, `job(gpus_per_task)` a job spec, and
//! `Harness` applies commands as consecutive log entries (index and leader time both grow by one
//! step per command). Every expected rejection goes through `Harness::reject` or
//! `Harness::reject_plan`, which also assert that the state did not change.

use super::validate::DEFAULT_PRIORITY_CLASS;
use super::*;

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// UUID of GPU `index` of node `node` in these fixtures.
fn uuid(node: &str, index: u32) -> String {
    format!("GPU-{node}-{index}")
}

struct NodeBuilder {
    spec: NodeSpec,
}

/// A node named `name` with `gpus` healthy GPUs of `model`, UUIDs `uuid(name, 0..gpus)`.
fn node(name: &str, gpus: u32, model: &str) -> NodeBuilder {
    NodeBuilder {
        spec: NodeSpec {
            agent_release: String::new(),
            enforcement: String::new(),
            container_runtime: String::new(),
            service_ports: None,
            name: name.into(),
            gpus: (0..gpus)
                .map(|i| Gpu {
                    uuid: uuid(name, i),
                    index: i,
                    model: model.into(),
                    memory_mib: 81_920,
                    numa_node: Some(i / 4),
                    pci_bus_id: format!("0000:{:02x}:00.0", i + 1),
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
        },
    }
}

impl NodeBuilder {
    fn partition(mut self, p: &str) -> Self {
        self.spec.partition = Some(p.into());
        self
    }

    fn unhealthy(mut self, index: u32) -> Self {
        self.spec.gpus[index as usize].health = GpuHealth::Unhealthy {
            reason: "Xid 79: fell off the bus".into(),
        };
        self
    }

    /// Drops GPU `index` from the report (as a re-registration after a GPU vanished would).
    fn without_gpu(mut self, index: u32) -> Self {
        self.spec.gpus.retain(|g| g.index != index);
        self
    }

    /// Adds a GPU with an arbitrary UUID (for instance one that another node owns).
    fn extra_gpu(mut self, uuid: &str) -> Self {
        let mut gpu = self.spec.gpus[0].clone();
        gpu.uuid = uuid.into();
        gpu.index = self.spec.gpus.len() as u32;
        self.spec.gpus.push(gpu);
        self
    }

    fn spec(self) -> NodeSpec {
        self.spec
    }
}

struct JobBuilder {
    spec: JobSpec,
}

/// A one-task job asking for `gpus_per_task` GPUs of any model, tenant "ml".
fn job(gpus_per_task: u32) -> JobBuilder {
    JobBuilder {
        spec: JobSpec {
            tenant: "ml".into(),
            name: "train".into(),
            command: vec!["python".into(), "train.py".into()],
            gpus_per_task,
            tasks: 1,
            priority_class: DEFAULT_PRIORITY_CLASS.into(),
            cpu_milli_per_task: 1000,
            ..JobSpec::default()
        },
    }
}

impl JobBuilder {
    fn tasks(mut self, n: u32) -> Self {
        self.spec.tasks = n;
        self
    }

    fn tenant(mut self, t: &str) -> Self {
        self.spec.tenant = t.into();
        self
    }

    fn name(mut self, n: &str) -> Self {
        self.spec.name = n.into();
        self
    }

    fn models(mut self, models: &[&str]) -> Self {
        self.spec.gpu_models = models.iter().map(|m| m.to_string()).collect();
        self
    }

    fn partition(mut self, p: &str) -> Self {
        self.spec.partition = Some(p.into());
        self
    }

    fn after_ok(mut self, job: JobId) -> Self {
        self.spec.dependencies.push(Dependency {
            kind: DependencyKind::AfterOk,
            job,
        });
        self
    }

    fn spec(self) -> JobSpec {
        self.spec
    }
}

/// One task on `node`, on the GPUs with the given indexes.
fn task(node: &str, gpus: &[u32]) -> TaskPlacement {
    TaskPlacement {
        node: node.into(),
        gpus: gpus.iter().map(|i| uuid(node, *i)).collect(),
    }
}

fn placement(job: JobId, tasks: Vec<TaskPlacement>) -> JobPlacement {
    JobPlacement { job, tasks }
}

fn failed(code: i32) -> TaskOutcome {
    TaskOutcome::Failed {
        exit_code: Some(code),
        signal: None,
        reason: "CUDA error".into(),
    }
}

fn lost() -> TaskOutcome {
    TaskOutcome::Lost {
        reason: "node lost its lease".into(),
    }
}

const TERM: u64 = 7;

/// Applies commands as consecutive log entries.
struct Harness {
    state: ClusterState,
    index: u64,
    at: Timestamp,
}

impl Harness {
    fn new() -> Self {
        Harness {
            state: ClusterState::default(),
            index: 0,
            at: 1_700_000_000_000,
        }
    }

    /// The usual fleet: a1 (4×A100, partition "train"), a2 (4×A100), h1 (8×H100).
    fn fleet() -> Self {
        Self::with_nodes([
            node("a1", 4, "A100").partition("train"),
            node("a2", 4, "A100"),
            node("h1", 8, "H100"),
        ])
    }

    fn with_nodes(nodes: impl IntoIterator<Item = NodeBuilder>) -> Self {
        let mut h = Harness::new();
        for n in nodes {
            h.register(n.spec());
        }
        h
    }

    fn apply(&mut self, command: Command) -> Applied {
        self.index += 1;
        self.at += 1000;
        let applied = self.state.apply(&command, self.at, self.index);
        self.state
            .check_consistency()
            .unwrap_or_else(|e| panic!("inconsistent after {command}: {e}"));
        applied
    }

    fn register(&mut self, spec: NodeSpec) {
        let name = spec.name.clone();
        let applied = self.apply(Command::RegisterNode { spec });
        assert_eq!(applied.outcome, Outcome::NodeRegistered, "register {name}");
    }

    fn submit(&mut self, spec: JobSpec) -> JobId {
        self.submit_with_key(spec, None)
    }

    fn submit_with_key(&mut self, spec: JobSpec, key: Option<&str>) -> JobId {
        match self
            .apply(Command::submit(spec, key.map(str::to_owned)))
            .outcome
        {
            Outcome::JobSubmitted { id, created: true } => id,
            other => panic!("submission not created: {other:?}"),
        }
    }

    /// Places one job and returns its new allocations.
    fn place(&mut self, job: JobId, tasks: Vec<TaskPlacement>) -> Vec<AllocationId> {
        let applied = self.apply(Command::Place {
            term: TERM,
            placements: vec![placement(job, tasks)],
        });
        assert_eq!(
            applied.outcome,
            Outcome::Placed {
                accepted: vec![job],
                rejected: vec![]
            }
        );
        self.state.jobs[&job].allocations.clone()
    }

    fn start(&mut self, allocation: AllocationId) -> Applied {
        let applied = self.apply(Command::AllocationStarted { allocation });
        assert_eq!(applied.outcome, Outcome::Done);
        applied
    }

    fn exit(&mut self, allocation: AllocationId, outcome: TaskOutcome) -> Applied {
        let applied = self.apply(Command::AllocationExited {
            allocation,
            outcome,
            usage: None,
        });
        assert_eq!(applied.outcome, Outcome::Done);
        applied
    }

    /// A job placed on the given tasks with every task started: Running.
    fn running(&mut self, spec: JobSpec, tasks: Vec<TaskPlacement>) -> (JobId, Vec<AllocationId>) {
        let id = self.submit(spec);
        let allocs = self.place(id, tasks);
        for a in &allocs {
            self.start(*a);
        }
        assert_eq!(self.job(id).state, JobState::Running);
        (id, allocs)
    }

    /// Applies a command that must be rejected, checks that the state did not change and
    /// returns the rejection.
    fn reject(&mut self, command: Command) -> Rejection {
        let before = self.state.clone();
        let applied = self.apply(command.clone());
        assert_unchanged(&before, &self.state, &command.to_string());
        assert!(applied.changed_jobs.is_empty(), "{command}: {applied:?}");
        match applied.outcome {
            Outcome::Rejected(r) => r,
            other => panic!("{command} was not rejected: {other:?}"),
        }
    }

    /// Applies a one-job plan that must be refused, checks that the state did not change and
    /// returns the reason.
    fn reject_plan(&mut self, p: JobPlacement) -> String {
        let job = p.job;
        let before = self.state.clone();
        let applied = self.apply(Command::Place {
            term: TERM,
            placements: vec![p.clone()],
        });
        assert_unchanged(&before, &self.state, &format!("{p:?}"));
        assert!(applied.changed_jobs.is_empty(), "{p:?}: {applied:?}");
        match applied.outcome {
            Outcome::Placed { accepted, rejected } if accepted.is_empty() => {
                assert_eq!(rejected.len(), 1, "{rejected:?}");
                assert_eq!(rejected[0].0, job);
                rejected[0].1.clone()
            }
            other => panic!("plan {p:?} was not refused: {other:?}"),
        }
    }

    fn job(&self, id: JobId) -> &Job {
        &self.state.jobs[&id]
    }

    fn alloc(&self, id: AllocationId) -> &AllocationRecord {
        &self.state.allocations[&id]
    }

    fn holder(&self, node: &str, gpu: u32) -> Option<AllocationId> {
        self.state.gpu_holder.get(&uuid(node, gpu)).copied()
    }
}

/// `after` equals `before`, also serialized byte for byte, except `last_applied_at`: a command
/// that is accepted but does nothing (a plan whose placements all fail) still advances it.
fn assert_unchanged(before: &ClusterState, after: &ClusterState, what: &str) {
    let mut after = after.clone();
    after.last_applied_at = before.last_applied_at;
    assert_eq!(&after, before, "{what} changed the state");
    assert_eq!(
        serde_json::to_vec(&after).unwrap(),
        serde_json::to_vec(before).unwrap(),
        "{what} changed the serialized state"
    );
}

fn assert_reason(reason: &str, expected: &str) {
    assert!(
        reason.contains(expected),
        "reason {reason:?} does not mention {expected:?}"
    );
}

fn last_reason(job: &Job) -> &str {
    &job.history.last().unwrap().reason
}

// ---------------------------------------------------------------------------------------------
// SubmitJob
// ---------------------------------------------------------------------------------------------

#[test]
fn submit_assigns_increasing_ids_from_the_log() {
    let mut h = Harness::fleet();
    for expected in 1..=3 {
        let applied = h.apply(Command::submit(job(1).spec(), None));
        assert_eq!(
            applied.outcome,
            Outcome::JobSubmitted {
                id: expected,
                created: true
            }
        );
        assert_eq!(applied.changed_jobs, vec![expected]);
        let j = h.job(expected);
        assert_eq!(j.id, expected);
        assert_eq!(j.state, JobState::Pending);
        assert_eq!(j.version, h.index);
        assert_eq!(j.submitted_at, h.at);
        assert_eq!(j.history.len(), 1);
        assert!(j.allocations.is_empty());
    }
    assert_eq!(h.state.last_job_id, 3);
    assert_eq!(h.state.jobs.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
}

#[test]
fn submit_retry_with_same_key_returns_same_job_without_creating_another() {
    let mut h = Harness::fleet();
    let id = h.submit_with_key(job(2).spec(), Some("req-1"));
    assert_eq!(h.state.job_for_key("ml", "req-1"), Some(id));
    assert_eq!(h.job(id).idempotency_key.as_deref(), Some("req-1"));

    let before = h.state.clone();
    let retry = h.apply(Command::submit(job(2).spec(), Some("req-1".into())));
    assert_eq!(retry.outcome, Outcome::JobSubmitted { id, created: false });
    assert!(retry.changed_jobs.is_empty());
    assert_unchanged(&before, &h.state, "retry");
}

#[test]
fn submit_retry_returns_the_job_even_after_it_ended() {
    let mut h = Harness::fleet();
    let id = h.submit_with_key(job(2).spec(), Some("req-1"));
    h.apply(Command::cancel(id, ""));
    let retry = h.apply(Command::submit(job(2).spec(), Some("req-1".into())));
    assert_eq!(retry.outcome, Outcome::JobSubmitted { id, created: false });
    assert_eq!(h.state.jobs.len(), 1);
}

#[test]
fn submit_rejects_a_different_spec_reusing_a_key() {
    let mut h = Harness::fleet();
    let id = h.submit_with_key(job(2).spec(), Some("req-1"));
    let r = h.reject(Command::submit(job(3).spec(), Some("req-1".into())));
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    assert!(r.message.contains("req-1"), "{r}");
    assert!(r.message.contains(&format!("job {id}")), "{r}");
    assert_eq!(h.state.jobs.len(), 1);
}

#[test]
fn submit_scopes_idempotency_keys_per_tenant() {
    let mut h = Harness::fleet();
    let a = h.submit_with_key(job(1).tenant("ml").spec(), Some("k"));
    let b = h.submit_with_key(job(1).tenant("vision").spec(), Some("k"));
    assert_ne!(a, b);
    assert_eq!(h.state.job_for_key("ml", "k"), Some(a));
    assert_eq!(h.state.job_for_key("vision", "k"), Some(b));
}

#[test]
fn idempotency_keys_are_derived_from_the_jobs_not_stored_in_snapshots() {
    let mut h = Harness::fleet();
    let a = h.submit_with_key(job(1).tenant("ml").spec(), Some("k"));
    let json = serde_json::to_value(&h.state).unwrap();
    assert!(json.get("idempotency").is_none(), "keys are not serialized");
    let mut loaded: ClusterState = serde_json::from_value(json.clone()).unwrap();
    loaded.rebuild_indexes();
    assert_eq!(loaded.job_for_key("ml", "k"), Some(a));
    assert_eq!(loaded, h.state);
    // Snapshots written before kept the keys as a field of their own: still read.
    let mut old = json;
    old["idempotency"] = serde_json::json!({ "ml": { "k": a } });
    let mut loaded: ClusterState = serde_json::from_value(old).unwrap();
    loaded.rebuild_indexes();
    assert_eq!(loaded.job_for_key("ml", "k"), Some(a));
    loaded.check_consistency().unwrap();
}

#[test]
fn submit_without_key_always_creates_a_new_job() {
    let mut h = Harness::fleet();
    let a = h.submit(job(1).spec());
    let b = h.submit(job(1).spec());
    assert_eq!((a, b), (1, 2));
    assert!(h.state.index.idempotency.is_empty());
}

#[test]
fn submit_rejects_an_overlong_idempotency_key() {
    let mut h = Harness::fleet();
    let key = "k".repeat(validate::MAX_IDEMPOTENCY_KEY_LEN + 1);
    let r = h.reject(Command::submit(job(1).spec(), Some(key)));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("idempotency_key"));
}

#[test]
fn submit_rejects_a_spec_that_fails_validation() {
    let mut h = Harness::fleet();
    let r = h.reject(Command::submit(job(1).tasks(0).spec(), None));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("tasks"));
    assert_eq!(h.state.last_job_id, 0);
}

#[test]
fn submit_accepts_any_tenant_and_partition_while_none_are_configured() {
    let mut h = Harness::fleet();
    h.submit(job(1).tenant("anyone").partition("anywhere").spec());
}

#[test]
fn submit_rejects_an_unknown_tenant_once_tenants_are_configured() {
    let mut h = Harness::fleet();
    let tenant = Tenant {
        name: "ml".into(),
        weight: 1,
        quota_gpus: 8,
        max_gpus: 16,
    };
    assert_eq!(
        h.apply(Command::PutTenant { tenant }).outcome,
        Outcome::Done
    );
    h.submit(job(1).tenant("ml").spec());

    let r = h.reject(Command::submit(job(1).tenant("other").spec(), None));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("tenant"));
    assert!(r.message.contains("ml"), "lists the known tenants: {r}");
}

#[test]
fn submit_rejects_a_job_larger_than_its_tenants_limit() {
    let mut h = Harness::fleet();
    let tenant = Tenant {
        name: "ml".into(),
        weight: 1,
        quota_gpus: 2,
        max_gpus: 4,
    };
    assert_eq!(
        h.apply(Command::PutTenant { tenant }).outcome,
        Outcome::Done
    );
    h.submit(job(4).tenant("ml").spec());
    let r = h.reject(Command::submit(job(2).tenant("ml").tasks(3).spec(), None));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("gpus"));
    assert!(r.message.contains("max_gpus 4"), "{r}");
    assert_eq!(h.state.last_job_id, 1, "a refused job changes nothing");
}

#[test]
fn submit_rejects_an_unknown_partition_once_partitions_are_configured() {
    let mut h = Harness::fleet();
    let partition = Partition {
        name: "train".into(),
        description: "training nodes".into(),
    };
    assert_eq!(
        h.apply(Command::PutPartition { partition }).outcome,
        Outcome::Done
    );
    h.submit(job(1).partition("train").spec());
    h.submit(job(1).spec());

    let r = h.reject(Command::submit(job(1).partition("infer").spec(), None));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("partition"));
    assert!(
        r.message.contains("train"),
        "lists the known partitions: {r}"
    );
}

#[test]
fn submit_rejects_more_gpus_per_task_than_the_largest_node_has() {
    let mut h = Harness::fleet();
    h.submit(job(8).spec());
    let r = h.reject(Command::submit(job(9).spec(), None));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("gpus_per_task"));
    assert!(r.message.contains("largest node has 8"), "{r}");
}

#[test]
fn submit_does_not_check_node_size_before_any_node_registered() {
    let mut h = Harness::new();
    h.submit(job(16).spec());
}

#[test]
fn submit_rejects_a_dependency_on_an_unknown_job() {
    let mut h = Harness::fleet();
    let first = h.submit(job(1).spec());
    h.submit(job(1).after_ok(first).spec());

    let r = h.reject(Command::submit(job(1).after_ok(99).spec(), None));
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("dependencies"));
    assert!(r.message.contains("99"), "{r}");
}

// ---------------------------------------------------------------------------------------------
// CancelJob
// ---------------------------------------------------------------------------------------------

#[test]
fn cancel_of_a_pending_job_ends_it_at_once() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let applied = h.apply(Command::cancel(id, "not needed"));
    assert_eq!(applied.outcome, Outcome::JobCancelled { id });
    assert_eq!(applied.changed_jobs, vec![id]);
    let j = h.job(id);
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(j.version, h.index);
    assert_eq!(last_reason(j), "not needed");
}

#[test]
fn cancel_without_reason_says_cancelled_by_user() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    h.apply(Command::cancel(id, ""));
    assert_eq!(last_reason(h.job(id)), "cancelled by user");
}

#[test]
fn cancel_of_a_running_job_keeps_its_gpus_held_until_the_exit_is_reported() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(
        job(2).tasks(2).spec(),
        vec![task("a2", &[0, 1]), task("h1", &[4, 5])],
    );

    let applied = h.apply(Command::cancel(id, "user"));
    assert_eq!(applied.outcome, Outcome::JobCancelled { id });
    assert_eq!(h.job(id).state, JobState::Cancelled);
    for a in &allocs {
        assert!(h.alloc(*a).stop_requested);
    }
    assert_eq!(h.holder("a2", 0), Some(allocs[0]));
    assert_eq!(h.holder("h1", 5), Some(allocs[1]));

    // No new work lands on a GPU whose old process may still run.
    let other = h.submit(job(2).spec());
    let reason = h.reject_plan(placement(other, vec![task("a2", &[0, 1])]));
    assert_reason(&reason, "already held");

    let applied = h.exit(allocs[0], failed(137));
    assert_eq!(applied.changed_jobs, vec![id]);
    assert_eq!(h.holder("a2", 0), None);
    assert_eq!(h.holder("h1", 4), Some(allocs[1]));
    assert_eq!(
        h.job(id).state,
        JobState::Cancelled,
        "an exit after cancel does not re-end the job"
    );

    h.exit(allocs[1], TaskOutcome::Succeeded);
    assert_eq!(h.job(id).state, JobState::Cancelled);
    assert!(h.state.gpu_holder.is_empty());
    assert!(h.state.allocations.is_empty());
    assert!(h.job(id).allocations.is_empty());

    h.place(other, vec![task("a2", &[0, 1])]);
}

#[test]
fn cancel_rejects_a_job_that_already_ended() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    h.apply(Command::cancel(id, ""));
    let r = h.reject(Command::cancel(id, "again"));
    assert_eq!(r.kind, RejectKind::FailedPrecondition);

    let (done, allocs) = h.running(job(1).spec(), vec![task("a2", &[0])]);
    h.exit(allocs[0], TaskOutcome::Succeeded);
    assert_eq!(h.job(done).state, JobState::Succeeded);
    let r = h.reject(Command::cancel(done, ""));
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    assert!(r.message.contains("succeeded"), "{r}");
}

#[test]
fn cancel_rejects_an_unknown_job() {
    let mut h = Harness::fleet();
    h.submit(job(1).spec());
    let r = h.reject(Command::cancel(2, ""));
    assert_eq!(r.kind, RejectKind::NotFound);
    let r = h.reject(Command::cancel(0, ""));
    assert_eq!(r.kind, RejectKind::NotFound);
}

// ---------------------------------------------------------------------------------------------
// Place
// ---------------------------------------------------------------------------------------------

#[test]
fn place_schedules_a_pending_job_and_holds_its_gpus() {
    let mut h = Harness::fleet();
    let id = h.submit(job(2).tasks(2).spec());
    let applied = h.apply(Command::Place {
        term: TERM,
        placements: vec![placement(
            id,
            vec![task("h1", &[0, 1]), task("h1", &[2, 3])],
        )],
    });
    assert_eq!(
        applied.outcome,
        Outcome::Placed {
            accepted: vec![id],
            rejected: vec![]
        }
    );
    assert_eq!(applied.changed_jobs, vec![id]);

    let j = h.job(id);
    assert_eq!(j.state, JobState::Scheduled);
    assert_eq!(j.version, h.index);
    assert_eq!(j.allocations, vec![1, 2]);
    assert_eq!(last_reason(j), "placed on h1,h1");
    assert_eq!(h.state.last_allocation_id, 2);
    for (a, gpus) in [(1, [0, 1]), (2, [2, 3])] {
        let rec = h.alloc(a);
        assert_eq!(rec.allocation.job, id);
        assert_eq!(rec.allocation.node, "h1");
        assert_eq!(rec.allocation.term, TERM);
        assert_eq!(rec.allocation.created_at, h.at);
        assert!(!rec.started && !rec.stop_requested);
        for g in gpus {
            assert_eq!(h.holder("h1", g), Some(a));
        }
    }
    assert_eq!(h.state.gpu_holder.len(), 4);
}

#[test]
fn place_accepts_a_cpu_only_task_without_gpus() {
    let mut h = Harness::fleet();
    let id = h.submit(job(0).spec());
    let allocs = h.place(id, vec![task("a2", &[])]);
    assert!(h.alloc(allocs[0]).allocation.gpus.is_empty());
    assert!(h.state.gpu_holder.is_empty());
}

#[test]
fn apply_rejects_plan_onto_held_gpu() {
    let mut h = Harness::fleet();
    let first = h.submit(job(2).spec());
    let allocs = h.place(first, vec![task("a2", &[0, 1])]);
    let second = h.submit(job(2).spec());
    let reason = h.reject_plan(placement(second, vec![task("a2", &[1, 2])]));
    assert_reason(&reason, &uuid("a2", 1));
    assert_reason(
        &reason,
        &format!("already held by allocation {}", allocs[0]),
    );
}

#[test]
fn apply_rejects_plan_onto_gpu_of_another_node() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let reason = h.reject_plan(placement(
        id,
        vec![TaskPlacement {
            node: "a2".into(),
            gpus: vec![uuid("h1", 0)],
        }],
    ));
    assert_reason(&reason, "is not on node a2");
}

#[test]
fn apply_rejects_plan_onto_unknown_gpu() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let reason = h.reject_plan(placement(id, vec![task("a2", &[9])]));
    assert_reason(&reason, "is not on node a2");
}

#[test]
fn apply_rejects_plan_onto_unhealthy_gpu() {
    let mut h = Harness::with_nodes([node("a2", 4, "A100").unhealthy(3)]);
    let id = h.submit(job(1).spec());
    let reason = h.reject_plan(placement(id, vec![task("a2", &[3])]));
    assert_reason(&reason, "unhealthy");
    h.place(id, vec![task("a2", &[2])]);
}

#[test]
fn apply_rejects_plan_onto_wrong_gpu_model() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).models(&["H100"]).spec());
    let reason = h.reject_plan(placement(id, vec![task("a2", &[0])]));
    assert_reason(&reason, "is a A100");
    h.place(id, vec![task("h1", &[0])]);
}

#[test]
fn apply_rejects_plan_onto_drained_or_down_node() {
    for status in [NodeStatus::Drained, NodeStatus::Down] {
        let mut h = Harness::fleet();
        h.state.nodes.get_mut("a2").unwrap().status = status;
        let id = h.submit(job(1).spec());
        let reason = h.reject_plan(placement(id, vec![task("a2", &[0])]));
        assert_reason(&reason, &format!("node a2 is {}", status.as_str()));
    }
}

#[test]
fn apply_rejects_plan_onto_absent_node() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let reason = h.reject_plan(placement(id, vec![task("zz", &[0])]));
    assert_reason(&reason, "node zz does not exist");
}

#[test]
fn apply_rejects_plan_outside_the_job_partition() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).partition("train").spec());
    let reason = h.reject_plan(placement(id, vec![task("a2", &[0])]));
    assert_reason(&reason, "not in partition train");
    h.place(id, vec![task("a1", &[0])]);
}

#[test]
fn place_puts_a_job_without_partition_on_any_node() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    h.place(id, vec![task("a1", &[0])]);
}

#[test]
fn apply_rejects_plan_with_wrong_task_count() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).tasks(2).spec());
    let reason = h.reject_plan(placement(id, vec![task("h1", &[0])]));
    assert_reason(&reason, "has 2 tasks but the plan places 1");
    let reason = h.reject_plan(placement(
        id,
        vec![task("h1", &[0]), task("h1", &[1]), task("h1", &[2])],
    ));
    assert_reason(&reason, "places 3");
}

#[test]
fn apply_rejects_plan_with_wrong_gpus_per_task() {
    let mut h = Harness::fleet();
    let id = h.submit(job(2).spec());
    for gpus in [&[0][..], &[0, 1, 2][..], &[][..]] {
        let reason = h.reject_plan(placement(id, vec![task("h1", gpus)]));
        assert_reason(
            &reason,
            &format!("gets {} GPUs, job asks for 2", gpus.len()),
        );
    }
}

#[test]
fn apply_rejects_plan_using_the_same_gpu_twice() {
    let mut h = Harness::fleet();
    let one_task = h.submit(job(2).spec());
    let reason = h.reject_plan(placement(one_task, vec![task("h1", &[3, 3])]));
    assert_reason(&reason, "placed twice in one plan");

    let gang = h.submit(job(1).tasks(2).spec());
    let reason = h.reject_plan(placement(gang, vec![task("h1", &[5]), task("h1", &[5])]));
    assert_reason(&reason, "placed twice in one plan");
}

#[test]
fn apply_rejects_plan_for_a_job_that_is_not_pending() {
    let mut h = Harness::fleet();
    let scheduled = h.submit(job(1).spec());
    h.place(scheduled, vec![task("h1", &[0])]);
    let reason = h.reject_plan(placement(scheduled, vec![task("h1", &[1])]));
    assert_reason(&reason, "is scheduled, not pending");

    let cancelled = h.submit(job(1).spec());
    h.apply(Command::cancel(cancelled, ""));
    let reason = h.reject_plan(placement(cancelled, vec![task("h1", &[1])]));
    assert_reason(&reason, "is cancelled, not pending");

    let reason = h.reject_plan(placement(42, vec![task("h1", &[1])]));
    assert_reason(&reason, "job 42 does not exist");
}

#[test]
fn apply_accepts_part_of_a_plan_and_lists_the_rest_as_rejected() {
    let mut h = Harness::fleet();
    let a = h.submit(job(2).spec());
    let b = h.submit(job(2).spec());
    let b_version = h.index;
    let c = h.submit(job(1).spec());
    let applied = h.apply(Command::Place {
        term: TERM,
        placements: vec![
            placement(a, vec![task("a2", &[0, 1])]),
            // Collides with `a`, placed earlier in the same plan.
            placement(b, vec![task("a2", &[1, 2])]),
            placement(c, vec![task("a2", &[3])]),
            // `a` again: no longer pending.
            placement(a, vec![task("h1", &[0, 1])]),
        ],
    });
    let Outcome::Placed { accepted, rejected } = applied.outcome else {
        panic!("{:?}", applied.outcome);
    };
    assert_eq!(accepted, vec![a, c]);
    assert_eq!(rejected.len(), 2);
    assert_eq!(rejected[0].0, b);
    assert_reason(&rejected[0].1, "already held");
    assert_eq!(rejected[1].0, a);
    assert_reason(&rejected[1].1, "not pending");
    assert_eq!(applied.changed_jobs, vec![a, c]);

    assert_eq!(h.job(a).state, JobState::Scheduled);
    assert_eq!(h.job(a).allocations.len(), 1);
    assert_eq!(h.job(b).state, JobState::Pending);
    assert!(h.job(b).allocations.is_empty());
    assert_eq!(h.job(b).version, b_version, "the refused job is untouched");
    assert_eq!(h.job(c).state, JobState::Scheduled);
    assert_eq!(h.holder("a2", 2), None);
    assert!(h.state.gpu_holder.keys().all(|g| !g.starts_with("GPU-h1")));
}

#[test]
fn place_treats_a_gang_as_all_or_nothing() {
    let mut h = Harness::fleet();
    let blocker = h.submit(job(1).spec());
    h.place(blocker, vec![task("a2", &[0])]);

    let gang = h.submit(job(2).tasks(3).spec());
    // Two tasks fit, the third lands on a held GPU: nothing of the gang is placed.
    let reason = h.reject_plan(placement(
        gang,
        vec![
            task("h1", &[0, 1]),
            task("h1", &[2, 3]),
            task("a2", &[0, 1]),
        ],
    ));
    assert_reason(&reason, "already held");
    assert_eq!(h.state.last_allocation_id, 1);
    assert_eq!(h.state.gpu_holder.len(), 1);

    let allocs = h.place(
        gang,
        vec![
            task("h1", &[0, 1]),
            task("h1", &[2, 3]),
            task("a2", &[2, 3]),
        ],
    );
    assert_eq!(allocs, vec![2, 3, 4]);
    assert_eq!(h.state.gpu_holder.len(), 7);
}

// ---------------------------------------------------------------------------------------------
// AllocationStarted / AllocationExited
// ---------------------------------------------------------------------------------------------

#[test]
fn allocation_started_moves_the_job_to_running_once_every_task_started() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).tasks(2).spec());
    let allocs = h.place(id, vec![task("h1", &[0]), task("a2", &[0])]);

    let applied = h.start(allocs[0]);
    assert!(applied.changed_jobs.is_empty());
    assert!(h.alloc(allocs[0]).started);
    assert_eq!(h.job(id).state, JobState::Scheduled);

    let applied = h.start(allocs[1]);
    assert_eq!(applied.changed_jobs, vec![id]);
    assert_eq!(h.job(id).state, JobState::Running);
    assert_eq!(last_reason(h.job(id)), "all tasks started");
    assert_eq!(h.job(id).version, h.index);

    // A repeated report changes nothing.
    let before = h.state.clone();
    let applied = h.start(allocs[1]);
    assert!(applied.changed_jobs.is_empty());
    assert_unchanged(&before, &h.state, "repeated start");
}

#[test]
fn allocation_started_rejects_an_unknown_allocation() {
    let mut h = Harness::fleet();
    let (_, allocs) = h.running(job(1).spec(), vec![task("h1", &[0])]);
    let r = h.reject(Command::AllocationStarted { allocation: 99 });
    assert_eq!(r.kind, RejectKind::NotFound);
    h.exit(allocs[0], TaskOutcome::Succeeded);
    let r = h.reject(Command::AllocationStarted {
        allocation: allocs[0],
    });
    assert_eq!(r.kind, RejectKind::NotFound, "an exited allocation is gone");
}

#[test]
fn job_succeeds_when_every_task_exits_successfully() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(
        job(2).tasks(2).spec(),
        vec![task("h1", &[0, 1]), task("a2", &[0, 1])],
    );

    let applied = h.exit(allocs[0], TaskOutcome::Succeeded);
    assert_eq!(applied.changed_jobs, vec![id]);
    assert_eq!(h.job(id).state, JobState::Running);
    assert_eq!(h.job(id).allocations, vec![allocs[1]]);
    assert_eq!(h.holder("h1", 0), None);
    assert_eq!(h.holder("a2", 0), Some(allocs[1]));

    h.exit(allocs[1], TaskOutcome::Succeeded);
    let j = h.job(id);
    assert_eq!(j.state, JobState::Succeeded);
    assert_eq!(j.version, h.index);
    assert_eq!(last_reason(j), "all tasks exited 0");
    assert!(j.allocations.is_empty());
    assert!(j.ending.is_none());
    assert!(h.state.gpu_holder.is_empty());
    assert!(h.state.allocations.is_empty());
}

#[test]
fn one_failed_task_stops_the_others_and_fails_the_job_after_the_last_exit() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(
        job(2).tasks(3).spec(),
        vec![
            task("h1", &[0, 1]),
            task("h1", &[2, 3]),
            task("a2", &[0, 1]),
        ],
    );

    h.exit(allocs[0], failed(3));
    let j = h.job(id);
    assert_eq!(
        j.state,
        JobState::Running,
        "the job ends only once every task exited"
    );
    assert_eq!(j.ending.as_ref().unwrap().state, JobState::Failed);
    assert!(h.alloc(allocs[1]).stop_requested);
    assert!(h.alloc(allocs[2]).stop_requested);
    assert_eq!(h.holder("h1", 0), None);
    assert_eq!(h.holder("h1", 2), Some(allocs[1]));
    assert_eq!(h.holder("a2", 1), Some(allocs[2]));

    // The stopped tasks exit 0 (they were killed cleanly): the job still failed.
    h.exit(allocs[1], TaskOutcome::Succeeded);
    assert_eq!(h.job(id).state, JobState::Running);
    assert_eq!(h.holder("h1", 2), None);
    assert_eq!(h.holder("a2", 1), Some(allocs[2]));

    h.exit(allocs[2], TaskOutcome::Succeeded);
    let j = h.job(id);
    assert_eq!(j.state, JobState::Failed);
    assert_eq!(last_reason(j), "exit code 3, CUDA error");
    assert!(j.ending.is_none());
    assert!(h.state.gpu_holder.is_empty());
}

#[test]
fn the_first_ending_wins_when_several_tasks_fail() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(
        job(1).tasks(3).spec(),
        vec![task("h1", &[0]), task("h1", &[1]), task("h1", &[2])],
    );
    h.exit(allocs[0], TaskOutcome::TimedOut);
    h.exit(allocs[1], failed(1));
    h.exit(allocs[2], lost());
    let j = h.job(id);
    assert_eq!(j.state, JobState::TimedOut);
    assert_eq!(last_reason(j), "time limit reached");
}

#[test]
fn failure_description_names_signal_and_defaults_to_failed() {
    let cases = [
        (Some(1), None, "", "exit code 1"),
        (None, Some(9), "OOM", "signal 9, OOM"),
        (None, None, "", "failed"),
    ];
    for (exit_code, signal, reason, expected) in cases {
        let mut h = Harness::fleet();
        let (id, allocs) = h.running(job(1).spec(), vec![task("h1", &[0])]);
        h.exit(
            allocs[0],
            TaskOutcome::Failed {
                exit_code,
                signal,
                reason: reason.into(),
            },
        );
        assert_eq!(h.job(id).state, JobState::Failed);
        assert_eq!(last_reason(h.job(id)), expected);
    }
}

#[test]
fn a_lost_task_requeues_the_job_after_every_task_exited() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(
        job(2).tasks(2).spec(),
        vec![task("a2", &[0, 1]), task("h1", &[0, 1])],
    );

    h.exit(allocs[0], lost());
    assert_eq!(h.job(id).state, JobState::Running);
    assert!(h.alloc(allocs[1]).stop_requested);
    assert_eq!(h.holder("h1", 1), Some(allocs[1]));
    // Still not pending: no plan may place it while its other task runs.
    let reason = h.reject_plan(placement(
        id,
        vec![task("h1", &[4, 5]), task("h1", &[6, 7])],
    ));
    assert_reason(&reason, "not pending");

    h.exit(allocs[1], failed(143));
    let j = h.job(id);
    assert_eq!(j.state, JobState::Pending);
    assert_eq!(last_reason(j), "requeued: node lost its lease");
    assert!(j.ending.is_none());
    assert!(j.allocations.is_empty());
    assert!(h.state.gpu_holder.is_empty());

    let again = h.place(id, vec![task("h1", &[0, 1]), task("h1", &[2, 3])]);
    assert!(
        again.iter().all(|a| *a > allocs[1]),
        "allocation ids only grow"
    );
    assert_eq!(h.job(id).state, JobState::Scheduled);
}

#[test]
fn a_single_lost_task_requeues_the_job_at_once() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(job(1).spec(), vec![task("h1", &[0])]);
    let applied = h.exit(allocs[0], lost());
    assert_eq!(applied.changed_jobs, vec![id]);
    assert_eq!(h.job(id).state, JobState::Pending);
}

#[test]
fn an_exit_before_start_still_ends_the_job() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let allocs = h.place(id, vec![task("h1", &[0])]);
    h.exit(allocs[0], failed(127));
    assert_eq!(h.job(id).state, JobState::Failed);
    assert!(h.state.gpu_holder.is_empty());
}

#[test]
fn allocation_exited_rejects_an_unknown_or_already_exited_allocation() {
    let mut h = Harness::fleet();
    let (_, allocs) = h.running(job(1).spec(), vec![task("h1", &[0])]);
    let r = h.reject(Command::AllocationExited {
        allocation: 99,
        outcome: TaskOutcome::Succeeded,
        usage: None,
    });
    assert_eq!(r.kind, RejectKind::NotFound);
    h.exit(allocs[0], TaskOutcome::Succeeded);
    let r = h.reject(Command::AllocationExited {
        allocation: allocs[0],
        outcome: failed(1),
        usage: None,
    });
    assert_eq!(r.kind, RejectKind::NotFound);
}

// ---------------------------------------------------------------------------------------------
// RegisterNode
// ---------------------------------------------------------------------------------------------

#[test]
fn register_node_adds_a_ready_node_and_records_who_owns_each_gpu() {
    let mut h = Harness::new();
    let applied = h.apply(Command::RegisterNode {
        spec: node("a1", 2, "A100").spec(),
    });
    assert_eq!(applied.outcome, Outcome::NodeRegistered);
    assert!(applied.changed_jobs.is_empty());
    let n = &h.state.nodes["a1"];
    assert_eq!(n.status, NodeStatus::Ready);
    assert_eq!(n.registered_at, h.at);
    assert_eq!(h.state.gpu_node[&uuid("a1", 0)], "a1");
    assert_eq!(h.state.gpu_node[&uuid("a1", 1)], "a1");
    assert_eq!(h.state.gpu_node.len(), 2);
    assert_eq!(h.state.total_gpus(), 2);
}

#[test]
fn register_node_rejects_a_gpu_uuid_that_another_node_owns() {
    let mut h = Harness::fleet();
    let r = h.reject(Command::RegisterNode {
        spec: node("b1", 2, "A100").extra_gpu(&uuid("a2", 3)).spec(),
    });
    assert_eq!(r.kind, RejectKind::InvalidArgument);
    assert_eq!(r.field.as_deref(), Some("node.gpus.uuid"));
    assert!(r.message.contains("a2"), "{r}");
    assert!(!h.state.nodes.contains_key("b1"));
}

#[test]
fn register_node_rejects_dropping_a_held_gpu() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let allocs = h.place(id, vec![task("a2", &[1])]);
    let r = h.reject(Command::RegisterNode {
        spec: node("a2", 4, "A100").without_gpu(1).spec(),
    });
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    assert!(r.message.contains(&uuid("a2", 1)), "{r}");
    assert!(
        r.message.contains(&format!("allocation {}", allocs[0])),
        "{r}"
    );
}

#[test]
fn register_node_forgets_a_dropped_free_gpu_so_another_node_can_claim_it() {
    let mut h = Harness::fleet();
    h.register(node("a2", 4, "A100").without_gpu(3).spec());
    assert_eq!(h.state.nodes["a2"].spec.gpus.len(), 3);
    assert!(!h.state.gpu_node.contains_key(&uuid("a2", 3)));

    h.register(node("b1", 1, "A100").extra_gpu(&uuid("a2", 3)).spec());
    assert_eq!(h.state.gpu_node[&uuid("a2", 3)], "b1");
}

#[test]
fn register_node_keeps_drained_status_on_reregistration() {
    let mut h = Harness::fleet();
    h.apply(Command::SetNodeStatus {
        node: "a2".into(),
        status: NodeStatus::Drained,
        evict: false,
        reason: String::new(),
    });
    h.register(node("a2", 4, "A100").spec());
    assert_eq!(h.state.nodes["a2"].status, NodeStatus::Drained);
    assert_eq!(h.state.nodes["a2"].registered_at, h.at);

    h.state.nodes.get_mut("h1").unwrap().status = NodeStatus::Down;
    h.register(node("h1", 8, "H100").spec());
    assert_eq!(
        h.state.nodes["h1"].status,
        NodeStatus::Ready,
        "a down node comes back"
    );
}

#[test]
fn register_node_rejects_an_invalid_spec() {
    let mut h = Harness::fleet();
    let r = h.reject(Command::RegisterNode {
        spec: node("b1", 2, "A100").extra_gpu(&uuid("b1", 0)).spec(),
    });
    assert_eq!(r.field.as_deref(), Some("node.gpus.uuid"));
    let r = h.reject(Command::RegisterNode {
        spec: node("bad name", 1, "A100").spec(),
    });
    assert_eq!(r.field.as_deref(), Some("node.name"));
}

#[test]
fn reregistration_keeps_held_gpus_held() {
    let mut h = Harness::fleet();
    let id = h.submit(job(1).spec());
    let allocs = h.place(id, vec![task("a2", &[1])]);
    h.register(node("a2", 4, "A100").spec());
    assert_eq!(h.holder("a2", 1), Some(allocs[0]));
}

// ---------------------------------------------------------------------------------------------
// Every rejection, whatever the command, leaves the state as it was.
// ---------------------------------------------------------------------------------------------

/// A state with some of everything: tenants, partitions, pending, scheduled, running, cancelled
/// (still holding GPUs), failing (one task exited) and finished jobs, and idempotency keys.
fn busy_cluster() -> Harness {
    let mut h = Harness::fleet();
    h.apply(Command::PutTenant {
        tenant: Tenant {
            name: "ml".into(),
            weight: 1,
            quota_gpus: 4,
            max_gpus: 8,
        },
    });
    h.apply(Command::PutPartition {
        partition: Partition {
            name: "train".into(),
            description: String::new(),
        },
    });
    let pending = h.submit_with_key(job(2).spec(), Some("pending"));
    assert_eq!(pending, 1);
    let scheduled = h.submit(job(1).spec());
    h.place(scheduled, vec![task("a1", &[0])]);
    h.running(job(2).name("running").spec(), vec![task("h1", &[0, 1])]);
    let (cancelled, _) = h.running(job(1).name("cancelled").spec(), vec![task("a2", &[0])]);
    h.apply(Command::cancel(cancelled, ""));
    let (_, failing) = h.running(
        job(1).tasks(2).spec(),
        vec![task("h1", &[2]), task("h1", &[3])],
    );
    h.exit(failing[0], failed(1));
    let (_, done) = h.running(job(1).name("done").spec(), vec![task("a2", &[1])]);
    h.exit(done[0], TaskOutcome::Succeeded);
    h
}

#[test]
fn every_rejected_command_leaves_the_state_unchanged() {
    let commands = vec![
        Command::submit(job(1).spec(), Some("k".repeat(1000))),
        Command::submit(job(3).spec(), Some("pending".into())),
        Command::submit(job(1).tenant("nobody").spec(), None),
        Command::submit(job(1).partition("nowhere").spec(), None),
        Command::submit(job(9).spec(), None),
        Command::submit(job(1).after_ok(1000).spec(), None),
        Command::submit(job(1).tasks(0).spec(), None),
        Command::cancel(1000, ""),
        Command::cancel(6, ""),
        Command::cancel(4, ""),
        Command::AllocationStarted { allocation: 1000 },
        Command::AllocationExited {
            allocation: 1000,
            outcome: TaskOutcome::Succeeded,
            usage: None,
        },
        Command::RegisterNode {
            spec: node("b1", 1, "A100").extra_gpu(&uuid("h1", 0)).spec(),
        },
        Command::RegisterNode {
            spec: node("h1", 8, "H100").without_gpu(0).spec(),
        },
        Command::RegisterNode {
            spec: node("", 1, "A100").spec(),
        },
        Command::PutTenant {
            tenant: Tenant {
                name: "ml".into(),
                weight: 0,
                quota_gpus: 0,
                max_gpus: 0,
            },
        },
        Command::PutPartition {
            partition: Partition {
                name: "a b".into(),
                description: String::new(),
            },
        },
    ];
    let template = busy_cluster();
    for command in commands {
        let mut h = Harness {
            state: template.state.clone(),
            index: template.index,
            at: template.at,
        };
        // `reject` asserts the outcome is a rejection and the state is unchanged.
        let r = h.reject(command.clone());
        assert!(!r.message.is_empty(), "{command}");
    }
}

#[test]
fn a_plan_refused_in_full_leaves_the_state_unchanged() {
    let template = busy_cluster();
    let mut h = Harness {
        state: template.state.clone(),
        index: template.index,
        at: template.at,
    };
    let before = h.state.clone();
    let applied = h.apply(Command::Place {
        term: TERM,
        placements: vec![
            placement(1, vec![task("h1", &[0, 1])]),
            placement(1, vec![task("a2", &[0, 2])]),
            placement(2, vec![task("h1", &[7])]),
            placement(1000, vec![task("h1", &[7])]),
        ],
    });
    let Outcome::Placed { accepted, rejected } = applied.outcome else {
        panic!("{:?}", applied.outcome);
    };
    assert!(accepted.is_empty());
    assert_eq!(
        rejected.iter().map(|r| r.0).collect::<Vec<_>>(),
        [1, 1, 2, 1000]
    );
    assert!(applied.changed_jobs.is_empty());
    assert_unchanged(&before, &h.state, "refused plan");
}

#[test]
fn a_rejected_command_at_an_unchanged_leader_time_leaves_the_state_byte_identical() {
    // With a leader clock that does not advance, even `last_applied_at` stays put.
    let mut h = busy_cluster();
    let before = serde_json::to_vec(&h.state).unwrap();
    let at = h.state.last_applied_at;
    let applied = h.state.apply(&Command::cancel(1000, ""), at, h.index + 1);
    assert!(matches!(applied.outcome, Outcome::Rejected(_)));
    assert_eq!(serde_json::to_vec(&h.state).unwrap(), before);
}

#[test]
fn re_registration_keeps_a_cordoned_gpu_cordoned_and_a_drained_node_drained() {
    let mut h = Harness::with_nodes([node("n1", 4, "H100")]);
    let gpu = uuid("n1", 2);
    h.apply(Command::SetGpuHealth {
        node: "n1".into(),
        gpu: gpu.clone(),
        health: GpuHealth::Unhealthy {
            reason: "Xid 79".into(),
        },
    });
    h.apply(Command::SetNodeStatus {
        node: "n1".into(),
        status: NodeStatus::Drained,
        evict: false,
        reason: String::new(),
    });
    // The agent restarts and reports every GPU healthy, as agents do.
    h.register(node("n1", 4, "H100").spec());
    let n = &h.state.nodes["n1"];
    assert_eq!(n.status, NodeStatus::Drained);
    let g = n.spec.gpus.iter().find(|g| g.uuid == gpu).unwrap();
    assert!(matches!(g.health, GpuHealth::Unhealthy { .. }), "{g:?}");
}

#[test]
fn node_lost_is_refused_for_a_node_that_registered_again_since() {
    let mut h = Harness::with_nodes([node("n1", 4, "H100")]);
    let judged = h.state.nodes["n1"].registered_at;
    h.register(node("n1", 4, "H100").spec());
    assert_ne!(h.state.nodes["n1"].registered_at, judged);
    let applied = h.apply(Command::NodeLost {
        node: "n1".into(),
        reason: "silent".into(),
        registered_at: judged,
    });
    assert!(
        matches!(applied.outcome, Outcome::Rejected(_)),
        "{:?}",
        applied.outcome
    );
    assert_eq!(h.state.nodes["n1"].status, NodeStatus::Ready);
}

#[test]
fn another_agent_registering_a_node_ends_the_allocations_of_the_one_before() {
    let mut h = Harness::with_nodes([node("n1", 4, "H100")]);
    let mut first = node("n1", 4, "H100").spec();
    first.incarnation = "agent-a".into();
    h.register(first.clone());
    let (id, allocs) = h.running(job(1).spec(), vec![task("n1", &[0])]);

    // The same agent again (a restart that kept its state directory) adopts its processes.
    h.register(first);
    assert_eq!(h.job(id).state, JobState::Running);
    assert_eq!(h.holder("n1", 0), Some(allocs[0]));

    // Another agent (another state directory) cannot: the job is requeued, the GPU freed.
    let mut second = node("n1", 4, "H100").spec();
    second.incarnation = "agent-b".into();
    let applied = h.apply(Command::RegisterNode { spec: second });
    assert_eq!(applied.outcome, Outcome::NodeRegistered);
    assert_eq!(applied.changed_jobs, vec![id]);
    let j = h.job(id);
    assert_eq!(j.state, JobState::Pending);
    assert!(
        last_reason(j).contains("registered again by another agent"),
        "{}",
        last_reason(j)
    );
    assert_eq!(h.holder("n1", 0), None);
    assert!(!h.state.allocations.contains_key(&allocs[0]));
    assert_eq!(h.state.nodes["n1"].status, NodeStatus::Ready);
}

#[test]
fn another_agent_may_register_a_node_without_a_gpu_the_old_one_held() {
    let mut h = Harness::with_nodes([node("n1", 4, "H100")]);
    let (id, _) = h.running(job(1).spec(), vec![task("n1", &[3])]);
    // The same agent may not drop a GPU its allocation holds...
    let r = h.reject(Command::RegisterNode {
        spec: node("n1", 3, "H100").spec(),
    });
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    assert_eq!(h.job(id).state, JobState::Running);
    // ...but another agent's registration ends that allocation first.
    let mut other = node("n1", 3, "H100").spec();
    other.incarnation = "agent-b".into();
    h.register(other);
    assert_eq!(h.job(id).state, JobState::Pending);
    assert_eq!(h.state.total_gpus(), 3);
}

#[test]
fn the_same_agent_may_not_drop_a_gpu_that_shares_hold() {
    // Shares are not in `gpu_holder` (several allocations hold one GPU), and a fuzz campaign
    // found re-registration forgetting a GPU that quarter-shares were running on.
    let mut h = Harness::with_nodes([node("n1", 4, "H100")]);
    let mut quarter = job(1).spec();
    quarter.gpu_milli = 250;
    let (id, _) = h.running(quarter, vec![task("n1", &[3])]);
    let r = h.reject(Command::RegisterNode {
        spec: node("n1", 3, "H100").spec(),
    });
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    assert!(r.message.contains("no longer reports GPU"), "{}", r.message);
    assert_eq!(h.job(id).state, JobState::Running);
    assert_eq!(h.state.total_gpus(), 4);
}

#[test]
fn undrain_does_not_revive_a_node_that_is_down() {
    let mut h = Harness::with_nodes([node("n1", 4, "H100")]);
    let registered_at = h.state.nodes["n1"].registered_at;
    h.apply(Command::NodeLost {
        node: "n1".into(),
        reason: "silent".into(),
        registered_at,
    });
    h.apply(Command::SetNodeStatus {
        node: "n1".into(),
        status: NodeStatus::Ready,
        evict: false,
        reason: String::new(),
    });
    assert_eq!(h.state.nodes["n1"].status, NodeStatus::Down);
}

/// Compaction of finished jobs (`retention.rs`), with the fixtures above.
mod retention_tests;
/// Tokens, the audit trail and commands attributed to agents (`access.rs`, `audit.rs`).
mod security_tests;

// ---------------------------------------------------------------------------------------------
// Batches (group commit)
// ---------------------------------------------------------------------------------------------

#[test]
fn a_batch_answers_each_command_in_order_and_a_rejection_stops_nothing() {
    let mut h = Harness::fleet();
    let applied = h.apply(Command::Batch {
        commands: vec![
            Command::submit(job(1).spec(), Some("k1".into())),
            Command::submit(job(64).spec(), None),
            Command::submit(job(2).spec(), None),
            Command::submit(job(1).spec(), Some("k1".into())),
        ],
    });
    let Outcome::Batch(outcomes) = applied.outcome else {
        panic!("a batch was answered with {:?}", applied.outcome);
    };
    assert_eq!(outcomes.len(), 4);
    assert_eq!(
        outcomes[0],
        Outcome::JobSubmitted {
            id: 1,
            created: true
        }
    );
    assert!(
        matches!(&outcomes[1], Outcome::Rejected(r) if r.kind == RejectKind::InvalidArgument),
        "an impossible job is refused inside a batch: {:?}",
        outcomes[1]
    );
    assert_eq!(
        outcomes[2],
        Outcome::JobSubmitted {
            id: 2,
            created: true
        }
    );
    assert_eq!(
        outcomes[3],
        Outcome::JobSubmitted {
            id: 1,
            created: false
        }
    );
    assert_eq!(applied.changed_jobs, vec![1, 2]);
    // Every member is applied at the batch's index and time.
    assert_eq!(h.job(1).version, h.index);
    assert_eq!(h.job(2).version, h.index);
    assert_eq!(h.job(2).submitted_at, h.at);
}

#[test]
fn a_batch_inside_a_batch_is_refused_and_changes_nothing() {
    let mut h = Harness::fleet();
    let before = h.state.clone();
    let applied = h.apply(Command::Batch {
        commands: vec![Command::Batch {
            commands: vec![Command::submit(job(1).spec(), None)],
        }],
    });
    let Outcome::Batch(outcomes) = applied.outcome else {
        panic!("a batch was answered with {:?}", applied.outcome);
    };
    assert!(matches!(&outcomes[..], [Outcome::Rejected(r)] if r.message.contains("another batch")));
    assert_unchanged(&before, &h.state, "nested batch");
}
/// Services: replicas, restarts, rollouts, scaling (`service_apply.rs`).
mod service_tests;
/// Arrays, holds, begin times, requeue, update, node lists, exclusive nodes.
mod slurm_control_tests;
/// The cluster version and what it gates (`format.rs`).
mod version_tests;
