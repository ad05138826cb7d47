//! `CompactJobs`: finished jobs are archived, then forgotten, and nothing that must hold for a
//! finished job (idempotent retries, dependencies, fair-share usage) changes when they are.

use super::*;

const SECOND: u64 = 1000;

/// Keeps a finished job whole for 10 s, archived for 100 s; caps far away.
fn short() -> JobRetention {
    JobRetention {
        full_record_ms: 10 * SECOND,
        max_full_records: 1_000,
        archive_ms: 100 * SECOND,
        max_archived: 1_000,
    }
}

impl Harness {
    fn compact(&mut self, retention: JobRetention) {
        let applied = self.apply(Command::CompactJobs {
            retention,
            limit: None,
        });
        assert_eq!(applied.outcome, Outcome::Done);
        assert!(applied.changed_jobs.is_empty(), "{applied:?}");
    }

    /// Moves the leader clock forward (the next command is stamped after it).
    fn wait(&mut self, ms: u64) {
        self.at += ms;
    }

    /// A job run on GPU 0 of a2 to the end with `outcome`.
    fn finished(&mut self, spec: JobSpec, outcome: TaskOutcome) -> JobId {
        let (id, allocs) = self.running(spec, vec![task("a2", &[0])]);
        self.exit(allocs[0], outcome);
        assert!(self.job(id).state.is_final());
        id
    }
}

#[test]
fn a_finished_job_is_archived_after_its_retention_then_forgotten_after_the_archives() {
    let mut h = Harness::fleet();
    let id = h.finished(job(1).name("done").spec(), TaskOutcome::Succeeded);
    let ended = h.job(id).last_change_at();

    h.compact(short());
    assert!(
        h.state.jobs.contains_key(&id),
        "archived before its retention"
    );
    assert!(!h.state.compaction_due(&short(), h.at));

    h.wait(10 * SECOND);
    assert!(h.state.compaction_due(&short(), h.at + 1000));
    h.compact(short());
    assert!(!h.state.jobs.contains_key(&id));
    let a = &h.state.archived[&id];
    assert_eq!(
        (a.state, a.tenant(), a.name(), a.ended_at),
        (JobState::Succeeded, "ml", "done", ended)
    );
    assert_eq!(a.reason(), "all tasks exited 0");
    assert_eq!(a.idempotency_key(), None);
    assert_eq!(h.state.job_outcome(id), Some((JobState::Succeeded, ended)));
    assert!(
        h.state.missing_job(id).contains("archived"),
        "{}",
        h.state.missing_job(id)
    );

    h.wait(100 * SECOND);
    h.compact(short());
    assert!(!h.state.archived.contains_key(&id));
    assert_eq!(h.state.job_outcome(id), None);
    let why = h.state.missing_job(id);
    assert!(why.contains("purged"), "{why}");
    assert!(h.state.missing_job(id + 1).contains("does not exist"));
    assert!(h.state.index.finished.is_empty() && h.state.index.archived_by_end.is_empty());
}

#[test]
fn a_retry_with_the_key_of_an_archived_job_returns_it_until_the_archive_forgets_it() {
    let mut h = Harness::fleet();
    let spec = job(1).name("keyed").spec();
    let id = h.submit_with_key(spec.clone(), Some("k1"));
    let allocs = h.place(id, vec![task("a2", &[0])]);
    h.exit(allocs[0], failed(3));
    h.wait(10 * SECOND);
    h.compact(short());
    assert!(h.state.archived.contains_key(&id));

    let retry = h.apply(Command::submit(spec.clone(), Some("k1".into())));
    assert_eq!(retry.outcome, Outcome::JobSubmitted { id, created: false });
    let other = job(2).name("keyed").spec();
    let r = h.reject(Command::submit(other, Some("k1".into())));
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    assert!(r.message.contains("different spec"), "{r}");

    // The archive's retention is the key's window: after it, the key is free again.
    h.wait(100 * SECOND);
    h.compact(short());
    assert_eq!(h.state.job_for_key("ml", "k1"), None);
    let again = h.submit_with_key(spec, Some("k1"));
    assert!(again > id);
}

#[test]
fn a_job_that_pending_jobs_wait_on_keeps_its_full_record_until_they_leave_the_queue() {
    let mut h = Harness::fleet();
    let first = h.submit(job(1).spec());
    let allocs = h.place(first, vec![task("a2", &[0])]);
    let waiting = h.submit(job(1).after_ok(first).spec());
    h.exit(allocs[0], TaskOutcome::Succeeded);
    h.wait(60 * SECOND);
    h.compact(short());
    assert!(
        h.state.jobs.contains_key(&first),
        "archived while job {waiting} waits on it"
    );
    assert!(crate::scheduler::dependencies_met(&h.state, h.job(waiting)));

    h.place(waiting, vec![task("a2", &[1])]);
    h.compact(short());
    assert!(h.state.archived.contains_key(&first));
}

#[test]
fn a_new_job_may_depend_on_an_archived_one_and_resolves_from_its_final_state() {
    let mut h = Harness::fleet();
    let ok = h.finished(job(1).spec(), TaskOutcome::Succeeded);
    let bad = h.finished(job(1).spec(), failed(1));
    h.wait(10 * SECOND);
    h.compact(short());
    assert!(h.state.archived.contains_key(&ok) && h.state.archived.contains_key(&bad));

    let after_ok = h.submit(job(1).after_ok(ok).spec());
    assert_eq!(h.job(after_ok).state, JobState::Pending);
    assert!(crate::scheduler::dependencies_met(
        &h.state,
        h.job(after_ok)
    ));

    let never = h.submit(job(1).after_ok(bad).spec());
    assert_eq!(h.job(never).state, JobState::Failed);
    let reason = &h.job(never).history.last().unwrap().reason;
    assert!(reason.contains("can never be satisfied"), "{reason}");

    h.wait(100 * SECOND);
    h.compact(short());
    let r = h.reject(Command::submit(job(1).after_ok(ok).spec(), None));
    assert!(r.message.contains("purged"), "{r}");
}

#[test]
fn a_cancelled_job_stays_whole_while_its_tasks_stop_and_compaction_leaves_usage_alone() {
    let mut h = Harness::fleet();
    let (id, allocs) = h.running(job(2).spec(), vec![task("a2", &[0, 1])]);
    h.wait(30 * SECOND);
    h.apply(Command::cancel(id, ""));
    h.wait(30 * SECOND);
    h.compact(short());
    assert!(
        h.state.jobs.contains_key(&id),
        "archived while its tasks still hold GPUs"
    );

    h.exit(allocs[0], TaskOutcome::Stopped);
    let usage = h.state.tenant_usage.clone();
    assert!(usage["ml"].milli_gpu_seconds > 0);
    let held = h.state.gpu_milli_held_by_tenant("ml");
    h.compact(short());
    assert!(h.state.archived.contains_key(&id));
    assert_eq!(h.state.tenant_usage, usage);
    assert_eq!(h.state.gpu_milli_held_by_tenant("ml"), held);
    let r = h.reject(Command::cancel(id, ""));
    assert!(r.message.contains("archived"), "{r}");
}

#[test]
fn the_caps_archive_and_forget_the_oldest_first_even_within_the_retention() {
    let mut h = Harness::fleet();
    let ids: Vec<JobId> = (0..5)
        .map(|_| h.finished(job(1).spec(), TaskOutcome::Succeeded))
        .collect();
    let capped = JobRetention {
        full_record_ms: 3600 * SECOND,
        max_full_records: 2,
        archive_ms: 3600 * SECOND,
        max_archived: 2,
    };
    h.compact(capped);
    let whole: Vec<JobId> = h.state.jobs.keys().copied().collect();
    let archived: Vec<JobId> = h.state.archived.keys().copied().collect();
    assert_eq!(whole, ids[3..]);
    assert_eq!(archived, ids[1..3]);
    assert_eq!(h.state.job_outcome(ids[0]), None);
}

#[test]
fn a_snapshot_keeps_the_archive_and_one_written_before_the_archive_still_loads() {
    let mut h = Harness::fleet();
    let spec = job(1).spec();
    let id = h.submit_with_key(spec.clone(), Some("k"));
    let allocs = h.place(id, vec![task("a2", &[0])]);
    h.exit(allocs[0], TaskOutcome::TimedOut);
    h.finished(job(1).spec(), TaskOutcome::Succeeded);

    // A snapshot written before the archive existed has no `archived` field.
    let mut old = serde_json::to_value(&h.state).unwrap();
    old.as_object_mut().unwrap().remove("archived");
    let mut old: ClusterState = serde_json::from_value(old).unwrap();
    old.rebuild_indexes();
    assert_eq!(old, h.state);

    h.wait(10 * SECOND);
    h.compact(short());
    assert_eq!(h.state.archived.len(), 2);
    let mut back: ClusterState =
        serde_json::from_slice(&serde_json::to_vec(&h.state).unwrap()).unwrap();
    back.rebuild_indexes();
    assert_eq!(back, h.state);
    back.check_consistency().unwrap();
    assert_eq!(
        back.apply(
            &Command::submit(spec, Some("k".into())),
            h.at + 1,
            h.index + 1
        )
        .outcome,
        Outcome::JobSubmitted { id, created: false }
    );
}

#[test]
fn the_spec_fingerprint_is_stable_and_tells_specs_apart() {
    let spec = job(1).spec();
    // Pinned: it is stored in snapshots, so a change of encoding must be deliberate.
    assert_eq!(spec_fingerprint(&spec), spec_fingerprint(&spec.clone()));
    assert_ne!(spec_fingerprint(&spec), spec_fingerprint(&job(2).spec()));
    assert_ne!(
        spec_fingerprint(&spec),
        spec_fingerprint(&job(1).tenant("other").spec())
    );
}

#[test]
fn a_limited_compaction_takes_the_oldest_first_and_the_rest_in_later_entries() {
    let mut h = Harness::fleet();
    h.state.cluster_version = crate::state::format::ClusterVersion(2);
    let ids: Vec<JobId> = (0..5)
        .map(|i| {
            h.wait(SECOND);
            h.finished(job(1).name(&format!("j{i}")).spec(), TaskOutcome::Succeeded)
        })
        .collect();
    h.wait(20 * SECOND);
    let limited = |h: &mut Harness| {
        let applied = h.apply(Command::CompactJobs {
            retention: short(),
            limit: Some(2),
        });
        assert_eq!(applied.outcome, Outcome::Done);
    };
    limited(&mut h);
    let kept: Vec<bool> = ids.iter().map(|id| h.state.jobs.contains_key(id)).collect();
    assert_eq!(
        kept,
        vec![false, false, true, true, true],
        "the two oldest go first"
    );
    assert!(h.state.compaction_due(&short(), h.at));
    limited(&mut h);
    limited(&mut h);
    assert!(ids.iter().all(|id| h.state.archived.contains_key(id)));
    assert!(!h.state.compaction_due(&short(), h.at));
}

#[test]
fn at_cluster_version_1_a_limit_is_ignored_as_a_format_1_replica_would() {
    let mut h = Harness::fleet();
    h.state.cluster_version = crate::state::format::ClusterVersion(1);
    let ids: Vec<JobId> = (0..3)
        .map(|_| h.finished(job(1).spec(), TaskOutcome::Succeeded))
        .collect();
    h.wait(20 * SECOND);
    h.apply(Command::CompactJobs {
        retention: short(),
        limit: Some(1),
    });
    assert!(ids.iter().all(|id| h.state.archived.contains_key(id)));
}
