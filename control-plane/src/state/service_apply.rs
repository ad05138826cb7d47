//! How the service commands change the state, and how a service's replicas follow its
//! settings: after every entry, each service whose settings or replicas changed is
//! reconciled (`reconcile_touched_services`): the pure planner (`service_plan`) says which
//! replicas to start and stop, and this module carries that out by creating and cancelling
//! replica jobs. A replica that exits is restarted here too, in place: on the same node and
//! GPUs, after its back-off, as a new allocation (a new epoch, so an agent never confuses the
//! two runs).
//!
//! Everything happens inside `apply`, so every replica of the control plane makes the same
//! decisions from the same log, and the rules that keep a service safe (no more than
//! `replicas + max_surge` copies, never two copies of one ordinal, availability during a
//! rollout) hold in the replicated state itself, whoever proposed what.

use super::command::{JobPlacement, Outcome, Rejection, RolloutAction, TaskOutcome, TaskPlacement};
use super::service::{
    KEPT_REPLICA_HISTORY, KEPT_REVISIONS, Ordinal, ReplicaOf, RolloutPhase, Service,
    ServiceRevision, ServiceSpec, validate_service_spec,
};
use super::service_plan::{self, Copy, Phase, Settings, Step};
use super::types::*;
use super::{AllocationRecord, ClusterState};

/// Rounds of reconciling one entry may take: a round's own starts and stops touch the
/// services again, and the round after finds nothing to do.
const MAX_RECONCILE_ROUNDS: usize = 8;

impl ClusterState {
    /// Why `PutService` would be refused, if it would: the API asks before it proposes, and
    /// apply asks again.
    pub fn service_refusal(&self, spec: &ServiceSpec, create_only: bool) -> Option<Rejection> {
        if let Err(r) = validate_service_spec(spec) {
            return Some(r);
        }
        let key = spec.key();
        match self.services.get(&key) {
            Some(s) if s.deleting => {
                return Some(Rejection::precondition(format!(
                    "service {key} is being deleted; create it again once its replicas have stopped"
                )));
            }
            Some(_) if create_only => {
                return Some(Rejection::precondition(format!(
                    "service {key} already exists (change it with `gpuctl service update`, or apply its manifest)"
                )));
            }
            _ => {}
        }
        self.check_submission(&spec.template.job).err()
    }

    /// The service `key`, or why a command naming it is refused.
    pub fn service_or_refusal(&self, key: &str) -> Result<&Service, Rejection> {
        match self.services.get(key) {
            Some(s) if s.deleting => Err(Rejection::precondition(format!(
                "service {key} is being deleted"
            ))),
            Some(s) => Ok(s),
            None => Err(Rejection::not_found(format!(
                "service {} does not exist",
                super::validate::shown(key)
            ))),
        }
    }

    /// Whether `job` is a replica of a service that has fewer replicas placed than its
    /// minimum (`ServiceSpec::min_replicas`): such a replica may preempt batch work.
    pub fn service_below_minimum(&self, job: &Job) -> bool {
        let Some(r) = &job.replica else {
            return false;
        };
        let Some(s) = self.services.get(&r.service) else {
            return false;
        };
        let placed = s
            .replicas
            .values()
            .filter_map(|j| self.jobs.get(j))
            .filter(|j| !j.state.is_final() && !j.allocations.is_empty())
            .count();
        (placed as u32) < s.spec.min_replicas()
    }

    /// Why `ScaleService` would be refused, if it would.
    pub fn scale_refusal(&self, key: &str, replicas: u32) -> Option<Rejection> {
        let s = match self.service_or_refusal(key) {
            Ok(s) => s,
            Err(r) => return Some(r),
        };
        if replicas > super::service::MAX_REPLICAS {
            return Some(Rejection::invalid(
                "replicas",
                format!(
                    "{replicas} is more than the {} one service may have",
                    super::service::MAX_REPLICAS
                ),
            ));
        }
        if let Some(a) = &s.spec.autoscale
            && !(a.min..=a.max).contains(&replicas)
        {
            return Some(Rejection::precondition(format!(
                "service {key} is autoscaled between {} and {} replicas: change its range (service update --min/--max) instead",
                a.min, a.max
            )));
        }
        None
    }

    /// Why `ServiceRollout` would be refused, if it would.
    pub fn rollout_refusal(&self, key: &str, action: &RolloutAction) -> Option<Rejection> {
        let s = match self.service_or_refusal(key) {
            Ok(s) => s,
            Err(r) => return Some(r),
        };
        match action {
            RolloutAction::Pause { .. } if matches!(s.rollout, RolloutPhase::Paused { .. }) => {
                Some(Rejection::precondition(format!(
                    "service {key}'s rollout is already paused"
                )))
            }
            RolloutAction::Resume if !matches!(s.rollout, RolloutPhase::Paused { .. }) => Some(
                Rejection::precondition(format!("service {key}'s rollout is not paused")),
            ),
            RolloutAction::Undo { to_revision } => self.undo_target(s, *to_revision).err(),
            _ => None,
        }
    }

    /// The revision an undo goes back to: the one named, or the newest before the current.
    fn undo_target(&self, s: &Service, to: Option<u64>) -> Result<u64, Rejection> {
        let known: Vec<String> = s.revisions.iter().map(|r| r.number.to_string()).collect();
        let target = match to {
            Some(n) => n,
            None => s
                .revisions
                .iter()
                .map(|r| r.number)
                .filter(|&n| n != s.revision)
                .max()
                .ok_or_else(|| {
                    Rejection::precondition(format!(
                        "service {} has no earlier revision to go back to",
                        s.key()
                    ))
                })?,
        };
        if target == s.revision {
            return Err(Rejection::precondition(format!(
                "revision {target} is already service {}'s current one",
                s.key()
            )));
        }
        if s.revision_template(target).is_none() {
            return Err(Rejection::not_found(format!(
                "service {} keeps revisions {}; there is no revision {target}",
                s.key(),
                known.join(", ")
            )));
        }
        Ok(target)
    }

    pub(super) fn put_service(
        &mut self,
        spec: &ServiceSpec,
        create_only: bool,
        at: Timestamp,
        index: u64,
    ) -> Outcome {
        if let Some(r) = self.service_refusal(spec, create_only) {
            return Outcome::Rejected(r);
        }
        let key = spec.key();
        let (revision, created) = match self.services.get_mut(&key) {
            None => {
                let mut s = Service {
                    spec: spec.clone(),
                    revision: 1,
                    revisions: vec![ServiceRevision {
                        number: 1,
                        template: spec.template.clone(),
                        created_at: at,
                    }],
                    replicas: Default::default(),
                    rollout: RolloutPhase::Progressing,
                    progressed_at: at,
                    created_at: at,
                    version: index,
                    deleting: false,
                    events: Vec::new(),
                };
                s.record_event(at, format!("created with {} replicas", spec.replicas));
                self.services.insert(key.clone(), s);
                (1, true)
            }
            Some(s) => {
                let mut next = spec.clone();
                // An autoscaled service keeps the count its autoscaler reached (within the
                // new range): a changed template must not reset it.
                if let (Some(a), Some(_)) = (&next.autoscale, &s.spec.autoscale) {
                    next.replicas = s.spec.replicas.clamp(a.min, a.max);
                }
                if next.template != s.spec.template {
                    let number = s.revisions.iter().map(|r| r.number).max().unwrap_or(0) + 1;
                    if s.revisions.len() >= KEPT_REVISIONS {
                        s.revisions.remove(0);
                    }
                    s.revisions.push(ServiceRevision {
                        number,
                        template: next.template.clone(),
                        created_at: at,
                    });
                    s.revision = number;
                    if !matches!(s.rollout, RolloutPhase::Paused { .. }) {
                        s.rollout = RolloutPhase::Progressing;
                    }
                    s.progressed_at = at;
                    s.record_event(
                        at,
                        format!("revision {number}: the replica template changed"),
                    );
                }
                if next.replicas != s.spec.replicas {
                    s.record_event(
                        at,
                        format!(
                            "scaled from {} to {} replicas",
                            s.spec.replicas, next.replicas
                        ),
                    );
                }
                s.spec = next;
                s.version = index;
                (s.revision, false)
            }
        };
        self.touched_services.push(key.clone());
        Outcome::ServiceChanged {
            service: key,
            revision,
            created,
        }
    }

    pub(super) fn scale_service(
        &mut self,
        key: &str,
        replicas: u32,
        reason: &str,
        at: Timestamp,
        index: u64,
    ) -> Outcome {
        if let Some(r) = self.scale_refusal(key, replicas) {
            return Outcome::Rejected(r);
        }
        let Some(s) = self.services.get_mut(key) else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "service {key} does not exist"
            )));
        };
        if s.spec.replicas != replicas {
            let why = if reason.is_empty() {
                String::new()
            } else {
                format!(": {reason}")
            };
            s.record_event(
                at,
                format!(
                    "scaled from {} to {replicas} replicas{why}",
                    s.spec.replicas
                ),
            );
            s.spec.replicas = replicas;
            s.version = index;
        }
        let revision = s.revision;
        self.touched_services.push(key.to_owned());
        Outcome::ServiceChanged {
            service: key.to_owned(),
            revision,
            created: false,
        }
    }

    pub(super) fn delete_service(&mut self, key: &str, at: Timestamp, index: u64) -> Outcome {
        if let Err(r) = self.service_or_refusal(key) {
            return Outcome::Rejected(r);
        }
        let Some(s) = self.services.get_mut(key) else {
            return Outcome::Done;
        };
        s.deleting = true;
        s.version = index;
        s.record_event(at, "deleted: stopping every replica");
        let revision = s.revision;
        self.touched_services.push(key.to_owned());
        Outcome::ServiceChanged {
            service: key.to_owned(),
            revision,
            created: false,
        }
    }

    pub(super) fn service_rollout(
        &mut self,
        key: &str,
        action: &RolloutAction,
        at: Timestamp,
        index: u64,
    ) -> Outcome {
        if let Some(r) = self.rollout_refusal(key, action) {
            return Outcome::Rejected(r);
        }
        let target = match (action, self.services.get(key)) {
            (RolloutAction::Undo { to_revision }, Some(s)) => {
                match self.undo_target(s, *to_revision) {
                    Ok(t) => Some(t),
                    Err(r) => return Outcome::Rejected(r),
                }
            }
            _ => None,
        };
        let Some(s) = self.services.get_mut(key) else {
            return Outcome::Done;
        };
        match action {
            RolloutAction::Pause { reason } => {
                let reason = if reason.is_empty() {
                    "paused by the user".to_owned()
                } else {
                    reason.clone()
                };
                s.record_event(at, format!("rollout paused: {reason}"));
                s.rollout = RolloutPhase::Paused { reason };
            }
            RolloutAction::Resume => {
                s.record_event(at, "rollout resumed");
                s.rollout = RolloutPhase::Progressing;
                s.progressed_at = at;
            }
            RolloutAction::Undo { .. } => {
                let Some(target) = target else {
                    return Outcome::Done;
                };
                let Some(template) = s.revision_template(target).cloned() else {
                    return Outcome::Done;
                };
                s.record_event(
                    at,
                    format!("rolled back from revision {} to {target}", s.revision),
                );
                s.revision = target;
                s.spec.template = template;
                s.rollout = RolloutPhase::Progressing;
                s.progressed_at = at;
            }
        }
        s.version = index;
        let revision = s.revision;
        self.touched_services.push(key.to_owned());
        Outcome::ServiceChanged {
            service: key.to_owned(),
            revision,
            created: false,
        }
    }

    pub(super) fn replica_readiness(
        &mut self,
        allocation: AllocationId,
        ready: bool,
        reason: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) -> Outcome {
        let Some(rec) = self.allocations.get(&allocation) else {
            return Outcome::Rejected(Rejection::not_found(format!(
                "allocation {allocation} does not exist"
            )));
        };
        let job_id = rec.allocation.job;
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Outcome::Done;
        };
        let running = job.state == JobState::Running && !rec.stop_requested;
        let Some(replica) = job.replica.as_mut() else {
            return Outcome::Rejected(Rejection::precondition(format!(
                "job {job_id} is not a service's replica"
            )));
        };
        // A readiness report about a run that is not (or no longer) running changes nothing:
        // the replica is unready whenever it does not run.
        let ready = ready && running;
        if replica.ready == ready {
            return Outcome::Done;
        }
        replica.ready = ready;
        let service = replica.service.clone();
        let revision = replica.revision;
        let ordinal = replica.ordinal;
        job.version = index;
        job.history.push(StateChange {
            at,
            state: job.state,
            reason: if ready {
                "ready".to_owned()
            } else if reason.is_empty() {
                "not ready".to_owned()
            } else {
                format!("not ready: {reason}")
            },
        });
        trim_replica_history(job);
        changed.push(job_id);
        if let Some(s) = self.services.get_mut(&service) {
            if ready && revision == s.revision {
                s.progressed_at = at;
            }
            if !ready {
                let why = if reason.is_empty() { "" } else { reason };
                s.record_event(at, format!("replica {ordinal} not ready: {why}"));
            }
        }
        self.touched_services.push(service);
        Outcome::Done
    }

    /// Reconciles every service this entry touched, until none has anything left to do.
    pub(super) fn reconcile_touched_services(
        &mut self,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) {
        for _ in 0..MAX_RECONCILE_ROUNDS {
            if self.touched_services.is_empty() {
                return;
            }
            let mut keys = std::mem::take(&mut self.touched_services);
            keys.sort_unstable();
            keys.dedup();
            for key in keys {
                self.reconcile_service(&key, at, index, changed);
            }
        }
        // Left for the next entry that touches them; never a loop without end.
        self.touched_services.clear();
    }

    /// Brings one service's replicas a step closer to its settings.
    fn reconcile_service(
        &mut self,
        key: &str,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) {
        let Some(service) = self.services.get(key) else {
            return;
        };
        // An ordinal is free once its copy has ended and stopped (or was forgotten).
        let gone: Vec<Ordinal> = service
            .replicas
            .iter()
            .filter(|(_, job)| {
                self.jobs
                    .get(job)
                    .is_none_or(|j| j.state.is_final() && j.allocations.is_empty())
            })
            .map(|(o, _)| *o)
            .collect();
        if !gone.is_empty()
            && let Some(s) = self.services.get_mut(key)
        {
            for o in &gone {
                s.replicas.remove(o);
            }
        }
        let Some(service) = self.services.get(key) else {
            return;
        };
        if service.deleting && service.replicas.is_empty() {
            self.services.remove(key);
            return;
        }
        let copies: Vec<Copy> = service
            .replicas
            .iter()
            .filter_map(|(&ordinal, &job)| {
                Some(self.copy_view(service, ordinal, self.jobs.get(&job)?))
            })
            .collect();
        let settings = Settings {
            replicas: service.spec.replicas,
            max_surge: service.spec.strategy.max_surge,
            max_unavailable: service.spec.strategy.max_unavailable,
            revision: service.revision,
            paused: matches!(service.rollout, RolloutPhase::Paused { .. }),
            deleting: service.deleting,
        };
        let decision = service_plan::plan(&settings, &copies);
        let name = service.spec.name.clone();
        for step in decision.steps {
            match step {
                Step::Start { ordinal, revision } => {
                    self.start_replica(key, ordinal, revision, at, index, changed);
                }
                Step::Stop { ordinal, job, why } => {
                    let reason = format!("service {name}: replica {ordinal} {}", why.text());
                    let mut ended = Vec::new();
                    let _ = self.cancel(job, &reason, at, index, &mut ended);
                    changed.extend(ended);
                }
            }
        }
        let Some(s) = self.services.get_mut(key) else {
            return;
        };
        if s.deleting {
            return;
        }
        let paused_before = matches!(s.rollout, RolloutPhase::Paused { .. });
        match decision.rollout {
            // Paused by the planner (a crash-looping new revision).
            RolloutPhase::Paused { reason } if !paused_before && !reason.is_empty() => {
                s.record_event(at, format!("rollout paused: {reason}"));
                s.rollout = RolloutPhase::Paused { reason };
            }
            RolloutPhase::Complete if !paused_before && s.rollout != RolloutPhase::Complete => {
                s.record_event(
                    at,
                    format!(
                        "revision {}: {} replicas ready",
                        s.revision, s.spec.replicas
                    ),
                );
                s.rollout = RolloutPhase::Complete;
            }
            RolloutPhase::Progressing if !paused_before => {
                if s.rollout == RolloutPhase::Complete {
                    s.progressed_at = at;
                }
                s.rollout = RolloutPhase::Progressing;
            }
            _ => {}
        }
    }

    /// How the planner sees one live copy.
    fn copy_view(&self, service: &Service, ordinal: Ordinal, job: &Job) -> Copy {
        let replica = job.replica.as_ref();
        let phase = if job.state.is_final() {
            Phase::Stopping
        } else if job.state == JobState::Pending {
            Phase::Pending
        } else if replica.is_some_and(|r| r.ready) {
            Phase::Ready
        } else {
            Phase::Starting
        };
        Copy {
            ordinal,
            job: job.id,
            revision: replica.map_or(0, |r| r.revision),
            phase,
            crash_looping: replica.is_some_and(|r| r.crash_looping(&service.spec.restart)),
            frees_whole_gpus: self.whole_gpus_freed_by(job),
        }
    }

    /// Whole GPUs that stopping `job` would free: each GPU it holds whole, and each GPU it
    /// shares with nothing else.
    fn whole_gpus_freed_by(&self, job: &Job) -> u32 {
        job.allocations
            .iter()
            .filter_map(|a| self.allocations.get(a))
            .map(|rec| {
                let a = &rec.allocation;
                if a.gpu_milli == 0 {
                    a.gpus.len() as u32
                } else {
                    a.gpus
                        .iter()
                        .filter(|g| {
                            self.index
                                .gpu_shares
                                .get(*g)
                                .is_some_and(|s| s.allocations.len() == 1)
                        })
                        .count() as u32
                }
            })
            .sum()
    }

    /// Creates the job of a new replica at `ordinal`, running `revision`'s template.
    fn start_replica(
        &mut self,
        key: &str,
        ordinal: Ordinal,
        revision: u64,
        at: Timestamp,
        index: u64,
        changed: &mut Vec<JobId>,
    ) {
        let Some(s) = self.services.get(key) else {
            return;
        };
        let Some(template) = s.revision_template(revision) else {
            return;
        };
        let mut spec = template.job.clone();
        spec.name = format!("{}-{ordinal}", s.spec.name);
        let service_name = s.spec.name.clone();
        self.create_job(&spec, None, None, at, index, changed);
        let id = self.last_job_id;
        if let Some(job) = self.jobs.get_mut(&id) {
            job.replica = Some(ReplicaOf {
                service: key.to_owned(),
                ordinal,
                revision,
                ready: false,
                restarts: 0,
                failures: 0,
                last_exit: None,
            });
            if let Some(first) = job.history.first_mut() {
                first.reason =
                    format!("replica {ordinal} of service {service_name} (revision {revision})");
            }
        }
        if let Some(s) = self.services.get_mut(key) {
            s.replicas.insert(ordinal, id);
        }
    }

    /// A replica's process exited on its own (or its liveness probe failed): it is started
    /// again on the same node and GPUs after its back-off, as a new allocation. If they can
    /// no longer take it (the node was drained, a GPU went bad), it waits for the scheduler
    /// to place it elsewhere.
    pub(super) fn restart_replica(
        &mut self,
        job_id: JobId,
        ended: &AllocationRecord,
        outcome: &TaskOutcome,
        at: Timestamp,
        index: u64,
    ) -> Outcome {
        let Some(job) = self.jobs.get(&job_id) else {
            return Outcome::Done;
        };
        let Some(replica) = job.replica.clone() else {
            return Outcome::Done;
        };
        let policy = self
            .services
            .get(&replica.service)
            .map(|s| s.spec.restart)
            .unwrap_or_default();
        let a = &ended.allocation;
        let ran_from = a.start_after.unwrap_or(a.created_at).max(a.created_at);
        let ran_ms = at.saturating_sub(ran_from);
        let failures = if ran_ms >= policy.reset_after_ms {
            1
        } else {
            replica.failures.saturating_add(1)
        };
        let exit = describe_exit(outcome);
        let wait = policy.backoff_ms(failures);
        if let Some(job) = self.jobs.get_mut(&job_id)
            && let Some(r) = job.replica.as_mut()
        {
            r.failures = failures;
            r.restarts = r.restarts.saturating_add(1);
            r.last_exit = Some(exit.clone());
            r.ready = false;
        }
        let crash_loop = replica.failures.saturating_add(1) >= policy.crash_loop_after
            && policy.crash_loop_after > 0
            && ran_ms < policy.reset_after_ms;
        let state_note = if crash_loop { "CrashLoopBackOff: " } else { "" };
        let reason = if wait > 0 {
            format!(
                "{state_note}restarting after {exit} (restart {}, back-off {})",
                replica.restarts + 1,
                humantime::format_duration(std::time::Duration::from_millis(wait))
            )
        } else {
            format!("restarting after {exit} (restart {})", replica.restarts + 1)
        };
        self.transition(job_id, JobState::Pending, &reason, at, index);
        self.touched_services.push(replica.service.clone());
        let p = JobPlacement {
            job: job_id,
            tasks: vec![TaskPlacement {
                node: a.node.clone(),
                gpus: a.gpus.clone(),
            }],
        };
        if self.check_placement(&p, at).is_ok() {
            let start_after = (wait > 0).then(|| at.saturating_add(wait));
            // Not the old allocation's term: the newest plan's, so terms never go down in
            // log order (a deposed leader's decisions are told apart by theirs).
            self.commit_placement_with(
                self.placement_term.max(a.term),
                &p,
                at,
                index,
                super::apply::PlacementExtras {
                    start_after,
                    ports: Some(a.ports.clone()),
                    reason: Some(format!("restarting on {}", a.node)),
                },
            );
        }
        Outcome::Done
    }
}

/// Keeps a replica's history bounded: its first entry and the latest ones.
pub(super) fn trim_replica_history(job: &mut Job) {
    if job.replica.is_some() && job.history.len() > KEPT_REPLICA_HISTORY {
        let cut = job.history.len() - (KEPT_REPLICA_HISTORY - 1);
        job.history.drain(1..cut);
    }
}

fn describe_exit(outcome: &TaskOutcome) -> String {
    match outcome {
        TaskOutcome::Succeeded => "exit code 0".to_owned(),
        TaskOutcome::Failed {
            exit_code,
            signal,
            reason,
        } => super::apply::describe_failure(*exit_code, *signal, reason),
        TaskOutcome::TimedOut => "time limit".to_owned(),
        TaskOutcome::Lost { reason } => reason.clone(),
        TaskOutcome::Stopped => "stopped".to_owned(),
    }
}
