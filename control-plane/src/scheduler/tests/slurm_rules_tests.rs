//! The pass and Slurm's job rules: holds, begin times, array limits, node lists and exclusive
//! nodes, and the reasons pending jobs show for them.

use super::*;
use crate::scheduler::reasons::{self, Board, ShapeMemo};
use crate::state::{ArrayRange, ArraySpec, JobChange};

fn v2() -> World {
    let mut w = World::new();
    assert_eq!(
        w.apply(Command::SetClusterVersion { version: 2 }),
        Outcome::Done
    );
    w
}

/// The reason job `id` shows after one pass at `now`.
fn reason(w: &World, id: u64) -> String {
    let (_, _, log) = plan_explained(&w.state, w.now(), &Policy::default());
    let board = Board::new(1, w.now(), log, Policy::default().max_jobs_per_pass);
    reasons::explain(
        &w.state,
        Some(&board),
        &w.state.jobs[&id],
        w.now(),
        &mut ShapeMemo::default(),
    )
}

fn placed_jobs(plan: &[JobPlacement]) -> Vec<u64> {
    plan.iter().map(|p| p.job).collect()
}

#[test]
fn held_and_not_yet_begun_jobs_wait_and_say_why() {
    let mut w = v2();
    w.node("n1", 8, "H100", DGX1, None);
    let mut held = job(1);
    held.hold = true;
    let held = w.submit(held);
    let mut later = job(1);
    later.begin_at = Some(w.now() + 3_600_000);
    let later = w.submit(later);
    let free = w.submit(job(1));
    assert_eq!(placed_jobs(&w.schedule()), [free]);
    let r = reason(&w, held);
    assert!(
        r.starts_with("JobHeldUser:") && r.contains("gpuctl release"),
        "{r}"
    );
    let r = reason(&w, later);
    assert!(
        r.starts_with("BeginTime: not before") && r.contains("in 1h"),
        "{r}"
    );
    w.apply(Command::ChangeJobs {
        jobs: vec![held],
        change: JobChange::Release,
    });
    assert_eq!(placed_jobs(&w.schedule()), [held]);
}

#[test]
fn a_pass_places_no_more_of_an_array_than_its_limit() {
    let mut w = v2();
    w.node("n1", 8, "H100", DGX1, None);
    let mut spec = job(1);
    spec.array = Some(ArraySpec {
        ranges: vec![ArrayRange {
            first: 0,
            last: 5,
            step: 1,
        }],
        max_running: 2,
    });
    let first = w.submit(spec);
    assert_eq!(placed_jobs(&w.schedule()), [first, first + 1]);
    assert!(w.schedule().is_empty(), "two run: the limit");
    let r = reason(&w, first + 2);
    assert!(
        r.starts_with("JobArrayTaskLimit: array") && r.contains("(%2)"),
        "{r}"
    );
}

#[test]
fn node_lists_steer_tasks_and_count_in_the_reason() {
    let mut w = v2();
    w.node("n1", 8, "H100", DGX1, None);
    w.node("n2", 8, "H100", DGX1, None);
    w.node("n3", 8, "H100", DGX1, None);
    let mut only = job(2);
    only.nodelist = vec!["n3".into()];
    let mut not = job(2);
    not.exclude = vec!["n1".into(), "n2".into()];
    let (only, not) = (w.submit(only), w.submit(not));
    let plan = w.schedule();
    assert_eq!(placed_jobs(&plan), [only, not]);
    assert!(plan.iter().all(|p| p.tasks[0].node == "n3"), "{plan:?}");
    // n3 has 4 GPUs left; a job only for n3 wanting 8 waits, and its reason counts the rest.
    let mut big = job(8);
    big.nodelist = vec!["n3".into()];
    let big = w.submit(big);
    assert!(w.schedule().is_empty());
    let r = reason(&w, big);
    assert!(
        r.contains("2 not in --nodelist") && r.contains("1 GPUs busy"),
        "{r}"
    );
}

#[test]
fn an_exclusive_job_takes_an_idle_node_and_keeps_others_off_it() {
    let mut w = v2();
    w.node("n1", 8, "H100", DGX1, None);
    w.node("n2", 8, "H100", DGX1, None);
    let small = w.submit(job(1));
    assert_eq!(placed_jobs(&w.schedule()), [small]);
    let mut ex = job(2);
    ex.exclusive = true;
    let ex = w.submit(ex);
    let after = w.submit(job(1));
    let plan = w.schedule();
    let node_of = |id| {
        plan.iter()
            .find(|p| p.job == id)
            .map(|p| p.tasks[0].node.clone())
    };
    let busy = w
        .state
        .allocations_of(small)
        .map(|a| a.allocation.node.clone())
        .next()
        .unwrap();
    assert_ne!(node_of(ex).as_deref(), Some(busy.as_str()), "{plan:?}");
    assert!(node_of(ex).is_some(), "the idle node takes it: {plan:?}");
    assert_eq!(
        node_of(after).as_deref(),
        Some(busy.as_str()),
        "nothing joins the exclusive job's node: {plan:?}"
    );
    // A second exclusive job finds no idle node, and says so.
    let mut ex2 = job(1);
    ex2.exclusive = true;
    let ex2 = w.submit(ex2);
    assert!(w.schedule().is_empty());
    let r = reason(&w, ex2);
    assert!(r.contains("not idle (--exclusive)"), "{r}");
}

#[test]
fn a_job_with_node_rules_never_takes_the_reservation_from_the_queue() {
    let mut w = v2();
    w.node("n1", 8, "H100", DGX1, None);
    let filler = w.submit(job(6));
    assert_eq!(placed_jobs(&w.schedule()), [filler]);
    let mut listed = job(4);
    listed.nodelist = vec!["n1".into()];
    let listed = w.submit(listed);
    let head = w.submit(job(8));
    let (plan, _, log) = plan_explained(&w.state, w.now(), &Policy::default());
    assert!(plan.placements.is_empty());
    assert_eq!(
        log.head,
        Some(head),
        "the job without rules is the head: {log:?}"
    );
    assert!(
        log.jobs.contains(&(listed, reasons::Why::NodeRules)),
        "{log:?}"
    );
}
