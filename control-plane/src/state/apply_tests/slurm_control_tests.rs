//! Slurm's job controls in the state machine: arrays, holds, begin times, requeue, update,
//! node lists and exclusive nodes (format 2), with the fixtures of `apply_tests`.

use super::*;

/// The usual fleet, at cluster version 2 (where these commands and fields exist).
fn fleet() -> Harness {
    let mut h = Harness::fleet();
    assert_eq!(
        h.apply(Command::SetClusterVersion { version: 2 }).outcome,
        Outcome::Done
    );
    h
}

fn change(jobs: &[JobId], change: JobChange) -> Command {
    Command::ChangeJobs {
        jobs: jobs.to_vec(),
        change,
    }
}

fn array(text_ranges: &[(u32, u32, u32)], max_running: u32) -> ArraySpec {
    ArraySpec {
        ranges: text_ranges
            .iter()
            .map(|&(first, last, step)| ArrayRange { first, last, step })
            .collect(),
        max_running,
    }
}

#[test]
fn an_array_is_one_job_per_index_with_consecutive_ids_and_one_key() {
    let mut h = fleet();
    let mut spec = job(1).spec();
    spec.array = Some(array(&[(0, 9, 3), (20, 20, 1)], 0));
    let id = h.submit_with_key(spec.clone(), Some("sweep"));
    let indices: Vec<u32> = (id..id + 5)
        .map(|j| h.job(j).array_task.unwrap().index)
        .collect();
    assert_eq!(indices, [0, 3, 6, 9, 20]);
    for j in id..id + 5 {
        let task = h.job(j).array_task.unwrap();
        assert_eq!((task.array_id, task.count), (id, 5));
        assert_eq!(h.job(j).state, JobState::Pending);
    }
    assert_eq!(h.job(id).idempotency_key.as_deref(), Some("sweep"));
    assert_eq!(h.job(id + 1).idempotency_key, None);
    // A retry of the submission is the same array, not a second one.
    assert_eq!(
        h.apply(Command::submit(spec, Some("sweep".into()))).outcome,
        Outcome::JobSubmitted { id, created: false }
    );
    assert_eq!(h.state.jobs.len(), 5);
}

#[test]
fn impossible_arrays_are_refused_whole() {
    let mut h = fleet();
    for (a, why) in [
        (array(&[], 0), "names no index"),
        (array(&[(5, 1, 1)], 0), "runs backwards"),
        (array(&[(0, 9, 0)], 0), "step"),
        (array(&[(0, 20_000, 1)], 0), "more than 10000 jobs"),
        (array(&[(0, 5_000_000, 1_000_000)], 0), "above the limit"),
    ] {
        let mut spec = job(1).spec();
        spec.array = Some(a);
        let r = h.reject(Command::submit(spec, None));
        assert!(r.message.contains(why), "{why}: {}", r.message);
    }
}

#[test]
fn an_array_never_runs_more_than_its_limit_at_once() {
    let mut h = fleet();
    let mut spec = job(1).spec();
    spec.array = Some(array(&[(0, 3, 1)], 2));
    let id = h.submit(spec);
    h.place(id, vec![task("h1", &[0])]);
    h.place(id + 1, vec![task("h1", &[1])]);
    let why = h.reject_plan(placement(id + 2, vec![task("h1", &[2])]));
    assert!(why.contains("2 of at most 2 jobs running"), "{why}");
    // Once one ends, the next may start.
    let a = h.job(id).allocations[0];
    h.start(a);
    h.exit(a, TaskOutcome::Succeeded);
    h.place(id + 2, vec![task("h1", &[2])]);
    // Raising the limit lets a third run beside the two.
    let ids: Vec<JobId> = (id..id + 4).collect();
    h.apply(change(
        &ids,
        JobChange::Update(JobUpdate {
            max_running: Some(3),
            ..Default::default()
        }),
    ));
    h.place(id + 3, vec![task("h1", &[3])]);
}

#[test]
fn a_held_job_waits_until_released_and_its_queue_time_restarts() {
    let mut h = fleet();
    let mut spec = job(1).spec();
    spec.hold = true;
    let id = h.submit(spec);
    assert!(h.job(id).held);
    assert_eq!(h.job(id).history[0].reason, "submitted held");
    let why = h.reject_plan(placement(id, vec![task("h1", &[0])]));
    assert!(why.contains("is held"), "{why}");
    let r = h.reject(change(&[id], JobChange::Hold));
    assert!(r.message.contains("already held"), "{}", r.message);
    h.apply(change(&[id], JobChange::Release));
    assert!(!h.job(id).held);
    let released_at = h.at;
    assert_eq!(
        crate::scheduler::queue::eligible_since(&h.state, h.job(id)),
        released_at
    );
    let r = h.reject(change(&[id], JobChange::Release));
    assert!(r.message.contains("not held"), "{}", r.message);
    h.place(id, vec![task("h1", &[0])]);
    let r = h.reject(change(&[id], JobChange::Hold));
    assert!(r.message.contains("only a pending job"), "{}", r.message);
    // A held job that was cancelled has nothing to release (its record stays as it ended).
    let mut spec = job(1).spec();
    spec.hold = true;
    let gone = h.submit(spec);
    h.apply(Command::cancel(gone, ""));
    let r = h.reject(change(&[gone], JobChange::Release));
    assert!(r.message.contains("nothing to release"), "{}", r.message);
}

#[test]
fn a_cancelled_job_still_stopping_is_not_requeued_under_its_tasks() {
    let mut h = fleet();
    let (id, allocs) = h.running(job(1).spec(), vec![task("h1", &[0])]);
    h.apply(Command::cancel(id, ""));
    let r = h.reject(change(
        &[id],
        JobChange::Requeue {
            reason: String::new(),
        },
    ));
    assert!(r.message.contains("still stopping"), "{}", r.message);
    h.exit(allocs[0], TaskOutcome::Stopped);
    h.apply(change(
        &[id],
        JobChange::Requeue {
            reason: String::new(),
        },
    ));
    assert_eq!(h.job(id).state, JobState::Pending);
}

#[test]
fn a_job_with_a_begin_time_is_not_placed_before_it() {
    let mut h = fleet();
    let mut spec = job(1).spec();
    spec.begin_at = Some(h.at + 10_500);
    let id = h.submit(spec);
    let why = h.reject_plan(placement(id, vec![task("h1", &[0])]));
    assert!(why.contains("may not start before"), "{why}");
    // Ten steps of the harness' clock later it may.
    for _ in 0..10 {
        h.apply(Command::AuditNote {
            action: "tick".into(),
            target: String::new(),
            detail: String::new(),
        });
    }
    h.place(id, vec![task("h1", &[0])]);
}

#[test]
fn a_change_applies_to_the_jobs_it_fits_and_says_why_not_for_the_rest() {
    let mut h = fleet();
    let a = h.submit(job(1).spec());
    let (b, _) = h.running(job(1).spec(), vec![task("h1", &[0])]);
    let applied = h.apply(change(&[a, b, 999], JobChange::Hold));
    let Outcome::JobsChanged { changed, refused } = applied.outcome else {
        panic!("{:?}", applied.outcome);
    };
    assert_eq!(changed, [a]);
    assert_eq!(refused.len(), 2);
    assert!(refused[0].1.contains("running"), "{refused:?}");
    assert_eq!(applied.changed_jobs, [a]);
    // Nothing it applies to: refused whole, nothing changes.
    let r = h.reject(change(&[b], JobChange::Hold));
    assert_eq!(r.kind, RejectKind::FailedPrecondition);
    let r = h.reject(change(&[], JobChange::Release));
    assert!(r.message.contains("names no job"), "{}", r.message);
}

#[test]
fn requeue_stops_a_running_job_and_queues_a_finished_one_again() {
    let mut h = fleet();
    let (id, allocs) = h.running(job(1).spec(), vec![task("h1", &[0])]);
    h.apply(change(
        &[id],
        JobChange::Requeue {
            reason: String::new(),
        },
    ));
    assert!(h.alloc(allocs[0]).stop_requested);
    h.exit(allocs[0], TaskOutcome::Stopped);
    assert_eq!(h.job(id).state, JobState::Pending);
    assert!(
        h.job(id)
            .history
            .last()
            .unwrap()
            .reason
            .contains("requeued: asked by the user"),
        "{:?}",
        h.job(id).history
    );
    let r = h.reject(change(
        &[id],
        JobChange::Requeue {
            reason: String::new(),
        },
    ));
    assert!(r.message.contains("already pending"), "{}", r.message);
    // Run it to a failure, then requeue the finished job.
    let allocs = h.place(id, vec![task("h1", &[1])]);
    h.start(allocs[0]);
    h.exit(allocs[0], failed(3));
    assert_eq!(h.job(id).state, JobState::Failed);
    assert_eq!(h.job(id).exit, Some(JobExit { code: 3, signal: 0 }));
    assert!(h.state.index.finished.iter().any(|(_, j)| *j == id));
    h.apply(change(
        &[id],
        JobChange::Requeue {
            reason: "fixed the data".into(),
        },
    ));
    assert_eq!(h.job(id).state, JobState::Pending);
    assert!(
        !h.state.index.finished.iter().any(|(_, j)| *j == id),
        "a requeued job is no longer finished (compaction must not archive it)"
    );
    let allocs = h.place(id, vec![task("h1", &[2])]);
    assert_eq!(h.job(id).exit, None, "a new attempt forgets the last exit");
    h.start(allocs[0]);
    h.exit(allocs[0], TaskOutcome::Succeeded);
    assert_eq!(h.job(id).exit, Some(JobExit { code: 0, signal: 0 }));
}

#[test]
fn update_changes_a_pending_request_and_checks_it_as_a_submission() {
    let mut h = fleet();
    let id = h.submit(job(2).spec());
    h.apply(change(
        &[id],
        JobChange::Update(JobUpdate {
            time_limit_secs: Some(600),
            priority_class: Some("high".into()),
            partition: Some("train".into()),
            name: Some("renamed".into()),
            ..Default::default()
        }),
    ));
    let spec = &h.job(id).spec;
    assert_eq!(spec.time_limit_secs, Some(600));
    assert_eq!(spec.priority_class, "high");
    assert_eq!(spec.partition.as_deref(), Some("train"));
    assert_eq!(spec.name, "renamed");
    h.apply(change(
        &[id],
        JobChange::Update(JobUpdate {
            time_limit_secs: Some(0),
            partition: Some(String::new()),
            ..Default::default()
        }),
    ));
    assert_eq!(h.job(id).spec.time_limit_secs, None);
    assert_eq!(h.job(id).spec.partition, None);
    for (u, why) in [
        (
            JobUpdate {
                priority_class: Some("vip".into()),
                ..Default::default()
            },
            "is not one of",
        ),
        (
            JobUpdate {
                nodelist: Some(vec!["nosuch".into()]),
                ..Default::default()
            },
            "not registered",
        ),
        (
            JobUpdate {
                max_running: Some(2),
                ..Default::default()
            },
            "not part of an array",
        ),
        (JobUpdate::default(), "changes nothing"),
    ] {
        let r = h.reject(change(&[id], JobChange::Update(u)));
        assert!(r.message.contains(why), "{why}: {}", r.message);
    }
    // While it runs only its name may change.
    let allocs = h.place(id, vec![task("h1", &[0, 1])]);
    h.start(allocs[0]);
    let r = h.reject(change(
        &[id],
        JobChange::Update(JobUpdate {
            time_limit_secs: Some(60),
            ..Default::default()
        }),
    ));
    assert!(r.message.contains("requeue it first"), "{}", r.message);
    h.apply(change(
        &[id],
        JobChange::Update(JobUpdate {
            name: Some("still-running".into()),
            ..Default::default()
        }),
    ));
    assert_eq!(h.job(id).spec.name, "still-running");
}

#[test]
fn node_lists_bound_where_tasks_go() {
    let mut h = fleet();
    let mut spec = job(1).spec();
    spec.nodelist = vec!["a2".into()];
    let id = h.submit(spec);
    let why = h.reject_plan(placement(id, vec![task("h1", &[0])]));
    assert!(why.contains("not allowed"), "{why}");
    h.place(id, vec![task("a2", &[0])]);
    let mut spec = job(1).spec();
    spec.exclude = vec!["a2".into(), "h1".into()];
    let id = h.submit(spec);
    let why = h.reject_plan(placement(id, vec![task("h1", &[1])]));
    assert!(why.contains("not allowed"), "{why}");
    // Names must be nodes the cluster knows, and sorted (the API sorts them).
    let mut spec = job(1).spec();
    spec.nodelist = vec!["gpu-typo".into()];
    let r = h.reject(Command::submit(spec, None));
    assert!(r.message.contains("not registered"), "{}", r.message);
    let mut spec = job(1).spec();
    spec.nodelist = vec!["h1".into(), "a2".into()];
    let r = h.reject(Command::submit(spec, None));
    assert!(r.message.contains("sorted"), "{}", r.message);
    let mut spec = job(1).spec();
    spec.nodelist = vec!["a2".into()];
    spec.exclude = vec!["a2".into()];
    let r = h.reject(Command::submit(spec, None));
    assert!(r.message.contains("both"), "{}", r.message);
    // A node list too small for the job is refused like any job no node can hold.
    let mut spec = job(8).spec();
    spec.nodelist = vec!["a2".into()];
    let r = h.reject(Command::submit(spec, None));
    assert!(
        r.message.contains("--nodelist/--exclude allows has 4"),
        "{}",
        r.message
    );
}

#[test]
fn an_exclusive_job_has_its_nodes_to_itself() {
    let mut h = fleet();
    let other = h.submit(job(1).spec());
    h.place(other, vec![task("h1", &[0])]);
    let mut spec = job(2).spec();
    spec.exclusive = true;
    spec.tasks = 2;
    let id = h.submit(spec);
    let why = h.reject_plan(placement(
        id,
        vec![task("h1", &[1, 2]), task("a2", &[0, 1])],
    ));
    assert!(why.contains("runs there"), "{why}");
    // Both tasks on one idle node is fine: it is the job's own.
    h.place(id, vec![task("a2", &[0, 1]), task("a2", &[2, 3])]);
    assert_eq!(
        h.state.index.node_free["a2"],
        crate::state::free::NodeFree::nothing(&h.state.nodes["a2"]),
        "nothing is free beside an exclusive job"
    );
    let late = h.submit(job(1).spec());
    let why = h.reject_plan(placement(late, vec![task("a2", &[0])]));
    assert!(why.contains("held exclusively by job"), "{why}");
}

#[test]
fn format_1_refuses_the_new_fields_and_commands() {
    let mut h = Harness::fleet();
    let mut spec = job(1).spec();
    spec.hold = true;
    let r = h.reject(Command::submit(spec, None));
    assert!(r.message.contains("cluster version 2"), "{}", r.message);
    let id = h.submit(job(1).spec());
    let r = h.reject(change(&[id], JobChange::Hold));
    assert!(r.message.contains("cluster version 2"), "{}", r.message);
}
