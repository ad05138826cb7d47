//! The environment a job's tasks start in: the submitter's directory (or `--chdir`), and the
//! rank variables of multi-task jobs that torchrun and Slurm scripts read.

use std::time::Duration;

use proto::v1 as pb;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(30);

/// `gpuctl -o json submit ARGS -- sh -c SCRIPT`, run from `cwd`; returns the job id.
fn submit_from(c: &TestCluster, cwd: &std::path::Path, args: &[&str], script: &str) -> u64 {
    let out = std::process::Command::new(gpuctl_bin())
        .current_dir(cwd)
        .args(["-o", "json", "submit"])
        .args(args)
        .args(["--", "sh", "-c", script])
        .envs(c.gpuctl_env().unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_starts_in_the_submitters_directory_or_its_chdir() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let here = tempfile::tempdir().unwrap();
    let there = tempfile::tempdir().unwrap();

    step("by default, where gpuctl submit ran");
    let a = submit_from(&c, here.path(), &["-G", "1"], "pwd");
    step("--chdir elsewhere");
    let b = submit_from(
        &c,
        here.path(),
        &["-G", "1", "--chdir", &there.path().display().to_string()],
        "pwd",
    );
    step("a directory the host lacks: the job runs anyway, and says where");
    let d = submit_from(
        &c,
        here.path(),
        &["-G", "1", "--chdir", "/nonexistent/dir"],
        "pwd",
    );
    for id in [a, b, d] {
        wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
    }
    assert_eq!(
        job_logs(&mut client, a).await.0.trim(),
        here.path().display().to_string()
    );
    assert_eq!(
        job_logs(&mut client, b).await.0.trim(),
        there.path().display().to_string()
    );
    let (out, err) = job_logs(&mut client, d).await;
    assert!(
        err.contains("working directory /nonexistent/dir does not exist on this host"),
        "{err}"
    );
    assert!(
        !out.trim().is_empty() && out.trim() != "/nonexistent/dir",
        "{out}"
    );

    step("a relative --chdir is made absolute by gpuctl; nonsense is refused by the API");
    let job = pb::JobSpec {
        workdir: "relative/dir".into(),
        ..shell_job(1, "true")
    };
    let err = submit(&mut client, job, "").await.unwrap_err();
    assert!(err.message().contains("not an absolute path"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tasks_of_a_job_find_their_ranks_and_the_rendezvous_address() {
    let c = start_with_agents(&[
        ("n1", "a100-pcie-4gpu-nvlink-pairs"),
        ("n2", "a100-pcie-4gpu-nvlink-pairs"),
    ])
    .await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // 3 tasks of 4 GPUs on two 4-GPU hosts cannot fit; 2 tasks of 4 GPUs take one host each.
    let script = format!(
        "echo task $RANK; echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $SLURM_PROCID $SLURM_NTASKS $GPUCP_TASK_COUNT\" > {d}/rank-$RANK",
        d = dir.path().display()
    );
    let job = pb::JobSpec {
        tasks: 2,
        ..shell_job(4, &script)
    };
    let id = submit(&mut client, job, "").await.unwrap().id;
    wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    step("each task's own log: gpuctl logs --task N");
    for rank in 0..2 {
        let (ok, out, err) = gpuctl(&c, &["logs", &id.to_string(), "--task", &rank.to_string()]);
        assert!(ok, "{err}");
        assert_eq!(out.trim(), format!("task {rank}"), "task {rank}'s log");
    }
    let (ok, _, err) = gpuctl(&c, &["logs", &id.to_string(), "--task", "2"]);
    assert!(
        !ok && err.contains("ran 2 task(s): give a task from 0 to 1"),
        "{err}"
    );
    let port = 20_000 + id % 12_000;
    for rank in 0..2 {
        let line = std::fs::read_to_string(dir.path().join(format!("rank-{rank}")))
            .unwrap_or_else(|e| panic!("task {rank} wrote nothing: {e}"));
        assert_eq!(
            line.trim(),
            format!("{rank} 2 0 1 127.0.0.1 {port} {rank} 2 2"),
            "task {rank}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_tasks_log_is_read_from_its_own_allocation() {
    let c = start_with_agents(&[
        ("n1", "a100-pcie-4gpu-nvlink-pairs"),
        ("n2", "a100-pcie-4gpu-nvlink-pairs"),
    ])
    .await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let script = format!(
        "echo running task $RANK; touch {d}/up-$RANK; while [ ! -e {r} ]; do sleep 0.05; done",
        d = dir.path().display(),
        r = release.display()
    );
    let job = pb::JobSpec {
        tasks: 2,
        ..shell_job(4, &script)
    };
    let id = submit(&mut client, job, "").await.unwrap().id;
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    while !(dir.path().join("up-0").exists() && dir.path().join("up-1").exists()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tasks never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for rank in 0..2 {
        let (ok, out, err) = gpuctl(&c, &["logs", &id.to_string(), "--task", &rank.to_string()]);
        assert!(ok, "{err}");
        assert_eq!(out.trim(), format!("running task {rank}"));
    }
    std::fs::write(&release, "").unwrap();
    wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempts_logs_are_kept_and_a_follower_sees_lines_as_they_come() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");

    step("a job runs, is requeued by an Xid 79 on its GPU, and runs again");
    let script = format!(
        "echo attempt in allocation $GPUCP_ALLOCATION_ID; while [ ! -e {g} ]; do sleep 0.05; done; \
         for i in 1 2 3; do echo line $i; sleep 0.2; done",
        g = go.display()
    );
    let id = submit(&mut client, shell_job(1, &script), "")
        .await
        .unwrap()
        .id;
    let first = wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await
    .allocations[0]
        .clone();
    let gpu = list_nodes(&mut client).await[0]
        .gpus
        .iter()
        .find(|g| g.uuid == first.gpus[0])
        .unwrap()
        .index;
    let (ok, _, err) = gpuctl(
        &c,
        &[
            "node",
            "inject",
            "n1",
            "--gpu",
            &gpu.to_string(),
            "--xid",
            "79",
        ],
    );
    assert!(ok, "{err}");
    let second = wait_job(&mut client, id, JOB_TIMEOUT, "running again", |j| {
        j.state == "running" && j.allocations.first().is_some_and(|a| a.id != first.id)
    })
    .await
    .allocations[0]
        .clone();

    step("--attempt 1 and --attempt 2 read each placement's own output");
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    for (attempt, allocation) in [(1, first.id), (2, second.id)] {
        loop {
            let (ok, out, err) = gpuctl(
                &c,
                &["logs", &id.to_string(), "--attempt", &attempt.to_string()],
            );
            assert!(ok, "{err}");
            if out.contains("attempt in") {
                assert_eq!(out.trim(), format!("attempt in allocation {allocation}"));
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "attempt {attempt}: {out}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let (ok, _, err) = gpuctl(&c, &["logs", &id.to_string(), "--attempt", "3"]);
    assert!(
        !ok && err.contains("has had 2 attempt(s): give one from 1 to 2"),
        "{err}"
    );

    step("-f prints the latest attempt's lines as they come and ends with the job");
    let follower = std::process::Command::new(gpuctl_bin())
        .args(["logs", "-f", &id.to_string()])
        .envs(c.gpuctl_env().unwrap())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::fs::write(&go, "").unwrap();
    let out = tokio::task::spawn_blocking(move || follower.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout,
        format!(
            "attempt in allocation {}\nline 1\nline 2\nline 3\n",
            second.id
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(get_job(&mut client, id).await.state, "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_script_runs_with_its_sbatch_directives_and_writes_its_output_file() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("train.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         #SBATCH --job-name=nightly -G 2\n\
         #SBATCH -o out-%j.txt --time=10\n\
         echo \"gpus $CUDA_VISIBLE_DEVICES args $*\"\n\
         echo to-stderr >&2\n",
    )
    .unwrap();
    let workdir = dir.path().to_str().unwrap();

    step("sbatch SCRIPT ARGS: the directives shape the job, the script's text runs");
    let id = gpuctl_submit(
        &c,
        &[
            "sbatch",
            "--chdir",
            workdir,
            script.to_str().unwrap(),
            "a",
            "--b",
        ],
    );
    let job = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    let spec = job.spec.unwrap();
    assert_eq!((spec.name.as_str(), spec.gpus_per_task), ("nightly", 2));
    assert_eq!(spec.time_limit_secs, 600);
    let written = std::fs::read_to_string(dir.path().join(format!("out-{id}.txt"))).unwrap();
    assert!(written.starts_with("gpus GPU-"), "{written}");
    assert!(
        written.contains(',') && written.trim_end().ends_with("args a --b"),
        "{written}"
    );
    let (logs, errors) = job_logs(&mut client, id).await;
    assert_eq!(logs, written, "gpuctl logs reads the output file");
    assert_eq!(errors.trim(), "to-stderr");

    step("the command line overrides a directive; an unknown directive is refused by name");
    let id = gpuctl_submit(
        &c,
        &[
            "submit",
            "-G",
            "1",
            "--chdir",
            workdir,
            script.to_str().unwrap(),
        ],
    );
    let job = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    assert_eq!(job.spec.unwrap().gpus_per_task, 1);
    let bad = dir.path().join("bad.sh");
    std::fs::write(&bad, "#!/bin/sh\n#SBATCH --frobnicate\ntrue\n").unwrap();
    let (ok, _, err) = gpuctl(&c, &["sbatch", bad.to_str().unwrap()]);
    assert!(
        !ok && err.contains("bad.sh") && err.contains("--frobnicate"),
        "{err}"
    );
}
