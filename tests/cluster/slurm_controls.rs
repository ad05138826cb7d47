//! Slurm's job controls as a Slurm user types them, through gpuctl against a real cluster: job
//! arrays with a limit (`--array=0-5%2`, `SLURM_ARRAY_TASK_ID`, `%A_%a` output files, `41_7`,
//! cancel of a whole array), `--hold`/`release`, `--begin`/`update StartTime=now`, `requeue`
//! of a failed job and sacct's exit code, `update TimeLimit=`, `-w`/`-x`/`--exclusive`, and
//! refusals that write nothing.

use std::time::Duration;

use proto::v1 as pb;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(60);

/// `gpuctl ARGS` that must succeed: its stdout.
fn ok(c: &TestCluster, args: &[&str]) -> String {
    let (success, out, err) = gpuctl(c, args);
    assert!(success, "gpuctl {args:?} failed: {err}\n{out}");
    out
}

/// `gpuctl ARGS` that must fail: its stderr.
fn refused(c: &TestCluster, args: &[&str]) -> String {
    let (success, out, err) = gpuctl(c, args);
    assert!(!success, "gpuctl {args:?} succeeded: {out}");
    err
}

/// `gpuctl -o json submit ARGS`: the job (or array) id and how many jobs it made.
fn submit_json(c: &TestCluster, args: &[&str]) -> (u64, u64) {
    let mut all = vec!["-o", "json", "submit"];
    all.extend_from_slice(args);
    let v: serde_json::Value = serde_json::from_str(&ok(c, &all)).unwrap();
    (v["id"].as_u64().unwrap(), v["jobs"].as_u64().unwrap())
}

/// Leader times at which each job held allocations: from its placement to its end.
fn held_interval(j: &pb::Job) -> (u64, u64) {
    let start = j
        .history
        .iter()
        .find(|h| h.state == "scheduled")
        .map(|h| h.at_ms)
        .unwrap_or_else(|| panic!("job {} was never placed: {j:?}", j.id));
    let end = j.history.last().map(|h| h.at_ms).unwrap();
    (start, end)
}

/// Most intervals that overlap at any instant (an interval ends before one that starts at the
/// same instant: apply frees before it places).
fn most_at_once(intervals: &[(u64, u64)]) -> usize {
    let mut events: Vec<(u64, i32)> = intervals
        .iter()
        .flat_map(|&(s, e)| [(s, 1), (e, -1)])
        .collect();
    events.sort_by_key(|&(at, d)| (at, d));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in events {
        now += d;
        most = most.max(now);
    }
    most as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_array_runs_each_index_within_its_limit_and_cancels_as_one() {
    let c = start_with_agents(&[("n1", "dgx-h100")]).await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let workdir = dir.path().display().to_string();

    step("an array of six, at most two at once, each writing its own file");
    let (array, jobs) = submit_json(
        &c,
        &[
            "--array",
            "0-10:2%2",
            "-G",
            "1",
            "-D",
            &workdir,
            "--stdout",
            "out-%A_%a.txt",
            "--",
            "sh",
            "-c",
            "echo index=$SLURM_ARRAY_TASK_ID of=$SLURM_ARRAY_JOB_ID count=$SLURM_ARRAY_TASK_COUNT; sleep 0.3",
        ],
    );
    assert_eq!(jobs, 6);
    let mut intervals = Vec::new();
    for (n, id) in (array..array + 6).enumerate() {
        let j = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
        let index = 2 * n as u32;
        assert_eq!(
            j.array_task
                .as_ref()
                .map(|t| (t.array_id, t.index, t.count)),
            Some((array, index, 6))
        );
        let file = dir.path().join(format!("out-{array}_{index}.txt"));
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert_eq!(
            text.trim(),
            format!("index={index} of={array} count=6"),
            "{}",
            file.display()
        );
        intervals.push(held_interval(&j));
    }
    assert!(
        most_at_once(&intervals) <= 2,
        "more than 2 of the array held GPUs at once: {intervals:?}"
    );

    step("sacct and show name a job of an array as ARRAY_INDEX");
    let sacct = ok(&c, &["sacct"]);
    assert!(sacct.contains(&format!("{array}_10")), "{sacct}");
    let show = ok(&c, &["show", &format!("{array}_4")]);
    assert!(
        show.contains(&format!("Job:           {}", array + 2)),
        "{show}"
    );
    assert!(show.contains("0-10:2%2"), "{show}");
    let err = refused(&c, &["show", &format!("{array}_5")]);
    assert!(err.contains("has no index 5"), "{err}");

    step("cancel of one index, then of the whole array by its id");
    let (second, _) = submit_json(&c, &["--array", "0-3", "-G", "1", "--", "sleep", "60"]);
    ok(&c, &["cancel", &format!("{second}_2")]);
    let j = wait_job(&mut client, second + 2, JOB_TIMEOUT, "cancelled", |j| {
        j.state == "cancelled"
    })
    .await;
    assert_eq!(j.array_task.unwrap().index, 2);
    let queue = ok(&c, &["queue"]);
    assert!(queue.contains(&format!("{second}_0")), "{queue}");
    ok(&c, &["cancel", &second.to_string()]);
    for id in second..second + 4 {
        wait_job(&mut client, id, JOB_TIMEOUT, "cancelled", |j| {
            j.state == "cancelled"
        })
        .await;
    }
    let err = refused(&c, &["cancel", &second.to_string()]);
    assert!(err.contains("already ended"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_begin_times_requeue_and_update_act_as_scontrol_does() {
    let c = start_with_agents(&[("n1", "dgx-h100")]).await;
    let mut client = c.client().unwrap();

    step("--hold: pending as JobHeldUser until released");
    let held = gpuctl_submit(&c, &["submit", "--hold", "-G", "1", "--", "sleep", "60"]);
    let j = wait_job(&mut client, held, JOB_TIMEOUT, "shown held", |j| {
        j.pending_reason.starts_with("JobHeldUser")
    })
    .await;
    assert!(j.held);
    ok(&c, &["release", &held.to_string()]);
    wait_job(&mut client, held, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;

    step("a refused hold (the job runs) says why and writes nothing");
    let before = leader_status(&c).await;
    let err = refused(&c, &["hold", &held.to_string()]);
    assert!(err.contains("only a pending job can be held"), "{err}");
    let after = leader_status(&c).await;
    assert!(
        after.last_log_index - before.last_log_index <= after.term - before.term,
        "a refused hold reached the log: {} -> {}",
        before.last_log_index,
        after.last_log_index
    );

    step("--begin in an hour: BeginTime; StartTime=now lets it run");
    let later = gpuctl_submit(
        &c,
        &[
            "submit",
            "--begin",
            "now+1hour",
            "-G",
            "1",
            "--",
            "sleep",
            "60",
        ],
    );
    wait_job(
        &mut client,
        later,
        JOB_TIMEOUT,
        "shown waiting for its time",
        |j| j.pending_reason.starts_with("BeginTime: not before"),
    )
    .await;
    let queue = ok(&c, &["queue"]);
    assert!(queue.contains("BeginTime"), "{queue}");
    ok(
        &c,
        &[
            "update",
            &later.to_string(),
            "StartTime=now",
            "TimeLimit=10:00",
        ],
    );
    let j = wait_job(&mut client, later, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    assert_eq!(j.spec.unwrap().time_limit_secs, 600);

    step("a failed job shows its exit code in sacct, and runs again when requeued");
    let failing = gpuctl_submit(&c, &["submit", "-G", "1", "--", "sh", "-c", "exit 3"]);
    wait_job(&mut client, failing, JOB_TIMEOUT, "failed", |j| {
        j.state == "failed"
    })
    .await;
    let sacct = ok(&c, &["sacct", "--state", "failed"]);
    let line = sacct
        .lines()
        .find(|l| l.starts_with(&format!("{failing} ")))
        .unwrap_or_else(|| panic!("job {failing} not in sacct: {sacct}"));
    assert!(line.contains("FAILED") && line.contains("3:0"), "{line}");
    ok(
        &c,
        &["requeue", &failing.to_string(), "--reason", "input fixed"],
    );
    let j = wait_job(&mut client, failing, JOB_TIMEOUT, "failed again", |j| {
        j.state == "failed" && j.history.iter().any(|h| h.reason.contains("input fixed"))
    })
    .await;
    let runs = j.history.iter().filter(|h| h.state == "running").count();
    assert_eq!(runs, 2, "{:?}", j.history);

    step("update of a running job's request is refused with what to do");
    let err = refused(&c, &["update", &held.to_string(), "--time", "5:00"]);
    assert!(err.contains("requeue it first"), "{err}");
    let err = refused(&c, &["update", &held.to_string(), "Nice=3"]);
    assert!(err.contains("does not change"), "{err}");
    ok(&c, &["cancel", &held.to_string(), &later.to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_lists_and_exclusive_nodes_decide_where_tasks_run() {
    let c = start_with_agents(&[
        ("gpu1", "a100-pcie-4gpu-nvlink-pairs"),
        ("gpu2", "a100-pcie-4gpu-nvlink-pairs"),
    ])
    .await;
    let mut client = c.client().unwrap();
    let node_of = |j: &pb::Job| j.allocations.first().map(|a| a.node.clone());
    let running = |j: &pb::Job| j.state == "running";

    step("-w gpu2 and -x gpu[1] both land on gpu2");
    let listed = gpuctl_submit(
        &c,
        &["submit", "-w", "gpu2", "-G", "1", "--", "sleep", "60"],
    );
    let excluded = gpuctl_submit(
        &c,
        &["submit", "-x", "gpu[1]", "-G", "1", "--", "sleep", "60"],
    );
    for id in [listed, excluded] {
        let j = wait_job(&mut client, id, JOB_TIMEOUT, "running", running).await;
        assert_eq!(node_of(&j).as_deref(), Some("gpu2"), "job {id}");
    }

    step("--exclusive takes the idle node; nothing joins it");
    let exclusive = gpuctl_submit(
        &c,
        &["submit", "--exclusive", "-G", "1", "--", "sleep", "60"],
    );
    let j = wait_job(&mut client, exclusive, JOB_TIMEOUT, "running", running).await;
    assert_eq!(node_of(&j).as_deref(), Some("gpu1"));
    let beside = gpuctl_submit(&c, &["submit", "-G", "2", "--", "sleep", "60"]);
    let j = wait_job(&mut client, beside, JOB_TIMEOUT, "running", running).await;
    assert_eq!(
        node_of(&j).as_deref(),
        Some("gpu2"),
        "not beside the exclusive job"
    );
    let waits = gpuctl_submit(&c, &["submit", "-G", "1", "--", "sleep", "60"]);
    let j = wait_job(
        &mut client,
        waits,
        JOB_TIMEOUT,
        "pending with a reason",
        |j| j.pending_reason.starts_with("Resources"),
    )
    .await;
    assert_eq!(j.state, "pending");

    step("a node list naming an unknown node is refused at submit, as Slurm refuses it");
    let err = refused(&c, &["submit", "-w", "gpu[1-3]", "-G", "1", "--", "true"]);
    assert!(err.contains("node \"gpu3\" is not registered"), "{err}");
    let err = refused(&c, &["submit", "-w", "gpu[1-", "-G", "1", "--", "true"]);
    assert!(err.contains("is not closed"), "{err}");

    step("an #SBATCH script's -w and --array are taken as options");
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("sweep.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n#SBATCH --array=1-2\n#SBATCH -w gpu2\n#SBATCH -G 1\necho $SLURM_ARRAY_TASK_ID\n",
    )
    .unwrap();
    ok(
        &c,
        &[
            "cancel",
            &exclusive.to_string(),
            &waits.to_string(),
            &beside.to_string(),
        ],
    );
    let (sweep, jobs) = submit_json(&c, &[script.to_str().unwrap()]);
    assert_eq!(jobs, 2);
    for id in [sweep, sweep + 1] {
        let j = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
        assert_eq!(node_of(&j), None);
        let placed = j.history.iter().find(|h| h.state == "scheduled").unwrap();
        assert!(placed.reason.contains("gpu2"), "{:?}", j.history);
    }
    ok(&c, &["cancel", &listed.to_string(), &excluded.to_string()]);
}
