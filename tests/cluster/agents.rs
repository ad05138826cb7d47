//! Real agents on simulated GPU hosts running real processes: device binding, no GPU shared
//! (beyond milli-GPU shares that fit on it), MIG slices, agent crashes and restarts, Xid faults
//! (also on a shared GPU), time limits, drains, and a leader failover that must not disturb
//! running jobs.

use std::collections::BTreeSet;
use std::time::Duration;

use control_plane::client::with_timeout;
use node_agent::runtime::{UsageRecord, check_no_overlap, read_usage_journal};
use proto::v1 as pb;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(30);

fn journal(c: &TestCluster, agent: &str) -> Vec<UsageRecord> {
    read_usage_journal(&c.agents[agent].usage_journal()).unwrap_or_default()
}

fn starts_of(records: &[UsageRecord], job: u64) -> Vec<(u64, Vec<String>)> {
    records
        .iter()
        .filter_map(|r| match r {
            UsageRecord::Start {
                allocation,
                job: j,
                gpus,
                ..
            } if *j == job => Some((*allocation, gpus.clone())),
            _ => None,
        })
        .collect()
}

fn marker(c: &TestCluster, name: &str) -> std::path::PathBuf {
    c.root.join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_sees_exactly_its_own_gpus() {
    let c = start_with_agents(&[("a100", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let out = marker(&c, "env");
    std::fs::create_dir_all(&out).unwrap();

    step("two 2-GPU jobs that record the devices they see");
    let script = format!(
        "echo \"$CUDA_VISIBLE_DEVICES|$NVIDIA_VISIBLE_DEVICES|$GPUCP_GPUS\" > {}/$GPUCP_JOB_ID; sleep 0.5",
        out.display()
    );
    let a = submit(&mut client, shell_job(2, &script), "")
        .await
        .unwrap()
        .id;
    let b = submit(&mut client, shell_job(2, &script), "")
        .await
        .unwrap()
        .id;
    for id in [a, b] {
        wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
    }

    step("each saw its allocation's GPUs and nothing else; each got an NVLink pair");
    let nodes = list_nodes(&mut client).await;
    let index_of = |uuid: &str| {
        nodes[0]
            .gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .map(|g| g.index)
            .unwrap()
    };
    let records = journal(&c, "a100");
    let mut seen = Vec::new();
    for id in [a, b] {
        let starts = starts_of(&records, id);
        assert_eq!(starts.len(), 1, "job {id} started {starts:?}");
        let gpus = starts[0].1.clone();
        let line = std::fs::read_to_string(out.join(id.to_string())).unwrap();
        let parts: Vec<&str> = line.trim().split('|').collect();
        assert_eq!(parts[0], gpus.join(","), "CUDA_VISIBLE_DEVICES of job {id}");
        assert_eq!(
            parts[1],
            gpus.join(","),
            "NVIDIA_VISIBLE_DEVICES of job {id}"
        );
        let mut idx: Vec<u32> = gpus.iter().map(|u| index_of(u)).collect();
        idx.sort_unstable();
        assert!(
            idx == vec![0, 1] || idx == vec![2, 3],
            "job {id} got GPUs {idx:?}, not an NVLink pair"
        );
        seen.extend(gpus);
    }
    let distinct: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(distinct.len(), 4, "the two jobs shared a GPU: {seen:?}");

    step("gpuctl logs shows a job's output, fetched from its node");
    let id = submit(
        &mut client,
        shell_job(1, "echo hello-from-the-job; echo oops >&2"),
        "",
    )
    .await
    .unwrap()
    .id;
    wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    let (ok, out, err) = gpuctl(&c, &["logs", &id.to_string()]);
    assert!(ok, "{err}");
    assert_eq!(out, "hello-from-the-job\n");
    assert_eq!(err, "oops\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_processes_ever_share_a_gpu() {
    let c = start_with_agents(&[
        ("h100", "dgx-h100"),
        ("a100", "a100-pcie-4gpu-nvlink-pairs"),
    ])
    .await;
    let mut client = c.client().unwrap();
    step("40 jobs of 1-4 GPUs on 12 GPUs");
    let mut ids = Vec::new();
    for i in 0..40 {
        let gpus = 1 + (i % 4);
        ids.push(
            submit(&mut client, shell_job(gpus, "sleep 0.2"), &format!("k{i}"))
                .await
                .unwrap()
                .id,
        );
    }
    for id in &ids {
        wait_job(
            &mut client,
            *id,
            Duration::from_secs(60),
            "succeeded",
            |j| j.state == "succeeded",
        )
        .await;
    }
    step("the agents' own records show no overlap and one run per job");
    let mut all = Vec::new();
    for agent in ["h100", "a100"] {
        let records = journal(&c, agent);
        check_no_overlap(&records).unwrap_or_else(|e| panic!("agent {agent}: {e}"));
        all.extend(records);
    }
    for id in &ids {
        assert_eq!(starts_of(&all, *id).len(), 1, "job {id} ran more than once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agents_job_moves_only_after_its_lease_and_never_runs_twice() {
    let mut c = start_with_agents(&[
        ("n1", "a100-pcie-4gpu-nvlink-pairs"),
        ("n2", "a100-pcie-4gpu-nvlink-pairs"),
    ])
    .await;
    let mut client = c.client().unwrap();
    let m = marker(&c, "runs");
    let script = format!(
        "echo \"start $GPUCP_ALLOCATION_ID $(date +%s%3N)\" >> {m}; \
         trap 'echo \"stop $GPUCP_ALLOCATION_ID $(date +%s%3N)\" >> {m}; exit 143' TERM; \
         sleep 60 & wait",
        m = m.display()
    );
    let id = submit(&mut client, shell_job(4, &script), "")
        .await
        .unwrap()
        .id;
    let running = wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    let first = running.allocations[0].clone();

    step("SIGKILL the agent running the job");
    let killed_at = now_ms();
    c.kill_agent(&first.node).unwrap();

    step("the job runs again on the other node");
    let moved = wait_job(&mut client, id, JOB_TIMEOUT, "ran again elsewhere", |j| {
        j.state == "running" && j.allocations.first().is_some_and(|a| a.id != first.id)
    })
    .await;
    let second = moved.allocations[0].clone();
    assert_ne!(second.node, first.node);
    assert!(
        moved.history.iter().any(|h| h.reason.contains("requeued")),
        "{:?}",
        moved.history
    );

    step("the first copy stopped (fenced by its shim) before the second started, after the lease");
    // "running" is reported once the command is started; its first line follows.
    let started = format!("start {} ", second.id);
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    let lines = loop {
        let lines = std::fs::read_to_string(&m).unwrap();
        if lines.lines().any(|l| l.starts_with(&started)) {
            break lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the second copy never wrote its start:\n{lines}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let at = |what: &str, alloc: u64| -> u64 {
        lines
            .lines()
            .find_map(|l| {
                let p: Vec<&str> = l.split_whitespace().collect();
                (p[0] == what && p[1] == alloc.to_string()).then(|| p[2].parse().unwrap())
            })
            .unwrap_or_else(|| panic!("no {what} of allocation {alloc} in:\n{lines}"))
    };
    let first_stop = at("stop", first.id);
    let second_start = at("start", second.id);
    assert!(first_stop < second_start, "two copies overlapped:\n{lines}");
    assert!(
        second_start >= killed_at + LEASE_MS,
        "requeued before the lease expired:\n{lines}"
    );
    client
        .call(|mut c, t| async move {
            c.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id,
                    reason: String::new(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_keeps_its_job_running_and_reports_its_exit_once() {
    let mut c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let m = marker(&c, "restart");
    let script = format!(
        "echo start >> {m}; sleep 3; echo end >> {m}",
        m = m.display()
    );
    let id = submit(&mut client, shell_job(1, &script), "")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;

    step("SIGKILL the agent and start it again at once");
    c.kill_agent("n1").unwrap();
    c.start_agent("n1").unwrap();

    let done = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state.as_str() == "succeeded"
    })
    .await;
    let lines = std::fs::read_to_string(&m).unwrap();
    assert_eq!(lines, "start\nend\n", "the job was restarted or cut short");
    let states: Vec<&str> = done.history.iter().map(|h| h.state.as_str()).collect();
    assert_eq!(
        states,
        vec!["pending", "scheduled", "running", "succeeded"],
        "{:?}",
        done.history
    );
    assert!(
        c.agent_log("n1").contains("re-adopted"),
        "{}",
        c.agent_log("n1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_79_cordons_the_gpu_and_requeues_the_job_and_an_xid_13_fails_it() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let id = submit(&mut client, shell_job(1, "sleep 60"), "")
        .await
        .unwrap()
        .id;
    let job = wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    let first = job.allocations[0].clone();
    let nodes = list_nodes(&mut client).await;
    let gpu = nodes[0]
        .gpus
        .iter()
        .find(|g| g.uuid == first.gpus[0])
        .unwrap()
        .index;

    step(&format!("inject Xid 79 on GPU {gpu}, which runs the job"));
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
    let moved = wait_job(
        &mut client,
        id,
        JOB_TIMEOUT,
        "requeued onto another GPU",
        |j| j.state == "running" && j.allocations.first().is_some_and(|a| a.id != first.id),
    )
    .await;
    assert_ne!(moved.allocations[0].gpus, first.gpus);
    let nodes = list_nodes(&mut client).await;
    let g = nodes[0].gpus.iter().find(|g| g.index == gpu).unwrap();
    assert_eq!(g.health, "unhealthy", "{g:?}");
    assert!(g.health_reason.contains("79"), "{g:?}");

    step("the GPU recovers and returns to service");
    let (ok, _, err) = gpuctl(
        &c,
        &[
            "node",
            "inject",
            "n1",
            "--gpu",
            &gpu.to_string(),
            "--recover",
        ],
    );
    assert!(ok, "{err}");
    let deadline = tokio::time::Instant::now() + JOB_TIMEOUT;
    loop {
        let nodes = list_nodes(&mut client).await;
        if nodes[0]
            .gpus
            .iter()
            .any(|g| g.index == gpu && g.health == "healthy")
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "GPU {gpu} never recovered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    step("an Xid 13 (application error) fails the job and leaves the GPU healthy");
    let nodes = list_nodes(&mut client).await;
    let now_gpu = nodes[0]
        .gpus
        .iter()
        .find(|g| g.uuid == moved.allocations[0].gpus[0])
        .unwrap()
        .index;
    let (ok, _, err) = gpuctl(
        &c,
        &[
            "node",
            "inject",
            "n1",
            "--gpu",
            &now_gpu.to_string(),
            "--xid",
            "13",
        ],
    );
    assert!(ok, "{err}");
    let failed = wait_job(&mut client, id, JOB_TIMEOUT, "failed", |j| {
        j.state == "failed"
    })
    .await;
    assert!(
        failed.history.last().unwrap().reason.contains("13"),
        "{:?}",
        failed.history
    );
    let nodes = list_nodes(&mut client).await;
    assert!(
        nodes[0].gpus.iter().all(|g| g.health == "healthy"),
        "{:?}",
        nodes[0].gpus
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_time_limit_is_killed_and_reported_timed_out() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let job = pb::JobSpec {
        time_limit_secs: 1,
        ..shell_job(1, "sleep 60")
    };
    let id = submit(&mut client, job, "").await.unwrap().id;
    let done = wait_job(&mut client, id, JOB_TIMEOUT, "timed out", |j| {
        j.state == "timed_out"
    })
    .await;
    let ran = done
        .history
        .iter()
        .find(|h| h.state == "running")
        .unwrap()
        .at_ms;
    let ended = done.history.last().unwrap().at_ms;
    assert!(ended - ran < 10_000, "took {} ms", ended - ran);
    let nodes = list_nodes(&mut client).await;
    assert!(
        nodes[0].gpus.iter().all(|g| g.allocation == 0),
        "GPUs still held"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_failover_does_not_restart_running_jobs() {
    let mut c = start_with_agents(&[("n1", "dgx-h100")]).await;
    let mut client = c.client().unwrap();
    let m = marker(&c, "failover");
    let script = format!(
        "echo \"start $GPUCP_JOB_ID\" >> {m}; sleep 4; echo \"end $GPUCP_JOB_ID\" >> {m}",
        m = m.display()
    );
    let a = submit(&mut client, shell_job(2, &script), "")
        .await
        .unwrap()
        .id;
    let b = submit(&mut client, shell_job(2, &script), "")
        .await
        .unwrap()
        .id;
    for id in [a, b] {
        wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
            j.state == "running"
        })
        .await;
    }
    step("SIGKILL the leader while both run");
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap().leader;
    c.kill(leader).unwrap();
    c.wait_for_leader(LEADER_TIMEOUT).await.unwrap();
    for id in [a, b] {
        let done = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
        assert!(
            !done.history.iter().any(|h| h.reason.contains("requeued")),
            "{:?}",
            done.history
        );
    }
    let lines = std::fs::read_to_string(&m).unwrap();
    for id in [a, b] {
        assert_eq!(
            lines.matches(&format!("start {id}\n")).count(),
            1,
            "{lines}"
        );
        assert_eq!(lines.matches(&format!("end {id}\n")).count(), 1, "{lines}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_evict_moves_work_and_undrain_restores_the_node() {
    let c = start_with_agents(&[
        ("n1", "a100-pcie-4gpu-nvlink-pairs"),
        ("n2", "a100-pcie-4gpu-nvlink-pairs"),
    ])
    .await;
    let mut client = c.client().unwrap();
    let id = submit(&mut client, shell_job(4, "sleep 60"), "")
        .await
        .unwrap()
        .id;
    let job = wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    let from = job.allocations[0].node.clone();

    step(&format!("drain {from} with --evict"));
    let (ok, _, err) = gpuctl(&c, &["node", "drain", &from, "--evict"]);
    assert!(ok, "{err}");
    let moved = wait_job(&mut client, id, JOB_TIMEOUT, "moved", |j| {
        j.state == "running" && j.allocations.first().is_some_and(|a| a.node != from)
    })
    .await;
    assert!(
        moved.history.iter().any(|h| h.reason.contains("evicted")),
        "{:?}",
        moved.history
    );
    let nodes = list_nodes(&mut client).await;
    assert_eq!(
        nodes.iter().find(|n| n.name == from).unwrap().status,
        "drained"
    );

    step("undrain");
    let (ok, _, err) = gpuctl(&c, &["node", "undrain", &from]);
    assert!(ok, "{err}");
    let nodes = list_nodes(&mut client).await;
    assert_eq!(
        nodes.iter().find(|n| n.name == from).unwrap().status,
        "ready"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cancelled_before_its_agent_started_it_releases_its_gpus() {
    let mut c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();

    step("kill the agent; a job is placed on its node (still within the lease) and cancelled");
    c.kill_agent("n1").unwrap();
    let id = submit(&mut client, shell_job(4, "sleep 60"), "")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, id, JOB_TIMEOUT, "placed", |j| {
        !j.allocations.is_empty()
    })
    .await;
    client
        .call(|mut c, t| async move {
            c.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id,
                    reason: String::new(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await
        .unwrap();

    step("the agent comes back: it never starts the job, and the GPUs are released");
    c.start_agent("n1").unwrap();
    let deadline = tokio::time::Instant::now() + JOB_TIMEOUT;
    loop {
        let nodes = list_nodes(&mut client).await;
        if nodes[0].status == "ready" && nodes[0].gpus.iter().all(|g| g.allocation == 0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "GPUs still held: {:?}",
            nodes[0].gpus
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        starts_of(&journal(&c, "n1"), id).is_empty(),
        "the cancelled job was started"
    );
    assert_eq!(get_job(&mut client, id).await.state, "cancelled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_claiming_a_live_nodes_name_is_refused() {
    let mut c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let port = control_plane::local_cluster::free_ports(1).unwrap()[0];
    // Another agent (its own state directory, so its own incarnation) under the same name.
    c.add_agent(
        "n1-impostor",
        "a100-pcie-4gpu-nvlink-pairs",
        port,
        &["--name", "n1", "--fence-grace-ms", "500"],
    );
    c.start_agent("n1-impostor").unwrap();
    let deadline = tokio::time::Instant::now() + JOB_TIMEOUT;
    while !c
        .agent_log("n1-impostor")
        .contains("in use by another live agent")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "impostor not refused:\n{}",
            c.agent_log("n1-impostor")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut client = c.client().unwrap();
    let id = submit(&mut client, shell_job(1, "true"), "")
        .await
        .unwrap()
        .id;
    wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
}

/// Submits `gpuctl submit ARGS -- sh -c SCRIPT` and returns the new job's id.
fn gpuctl_submit(c: &TestCluster, args: &[&str], script: &str) -> u64 {
    let mut all = vec!["submit", "-o", "json"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "sh", "-c", script]);
    let (ok, out, err) = gpuctl(c, &all);
    assert!(ok, "gpuctl submit {args:?}: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON from gpuctl submit");
    v["id"].as_u64().expect("a job id")
}

/// A job script that writes `vars` (as `A|B|...`) to `DIR/seen-<job id>`, then holds its GPU
/// until the test creates `DIR/release-<job id>`.
fn hold_until_released(dir: &std::path::Path, vars: &[&str]) -> String {
    let values: Vec<String> = vars.iter().map(|v| format!("${v}")).collect();
    format!(
        "echo \"{values}\" > {d}/seen-$GPUCP_JOB_ID.tmp && mv {d}/seen-$GPUCP_JOB_ID.tmp \
         {d}/seen-$GPUCP_JOB_ID; while [ ! -e {d}/release-$GPUCP_JOB_ID ]; do sleep 0.05; done",
        values = values.join("|"),
        d = dir.display()
    )
}

/// What job `id` saw (its line from [`hold_until_released`]), once it has written it.
async fn seen_by(dir: &std::path::Path, id: u64) -> Vec<String> {
    let path = dir.join(format!("seen-{id}"));
    let deadline = tokio::time::Instant::now() + JOB_TIMEOUT;
    loop {
        if let Ok(line) = std::fs::read_to_string(&path) {
            return line.trim().split('|').map(str::to_owned).collect();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {id} never wrote {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn release(dir: &std::path::Path, id: u64) {
    std::fs::write(dir.join(format!("release-{id}")), "").unwrap();
}

/// Allocation ids of job `job`'s starts in `records`, and the index of each start line.
fn start_lines(records: &[UsageRecord], job: u64) -> Vec<(usize, u64)> {
    records
        .iter()
        .enumerate()
        .filter_map(|(i, r)| match r {
            UsageRecord::Start {
                allocation, job: j, ..
            } if *j == job => Some((i, *allocation)),
            _ => None,
        })
        .collect()
}

fn stop_line(records: &[UsageRecord], allocation: u64) -> Option<usize> {
    records
        .iter()
        .position(|r| matches!(r, UsageRecord::Stop { allocation: a, .. } if *a == allocation))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_quarter_shares_run_together_on_one_gpu_and_a_fifth_waits_for_one_to_end() {
    let c = start_with_agents(&[("h1", "h100-pcie-1gpu")]).await;
    let mut client = c.client().unwrap();
    let gpu = list_nodes(&mut client).await[0].gpus[0].clone();
    let dir = marker(&c, "shares");
    std::fs::create_dir_all(&dir).unwrap();
    let script = hold_until_released(
        &dir,
        &[
            "CUDA_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "GPUCP_GPU_MILLI",
            "GPUCP_GPU_MEMORY_MIB",
        ],
    );

    step("five jobs of 250 milli-GPU on a host with one GPU");
    let ids: Vec<u64> = (0..5)
        .map(|_| gpuctl_submit(&c, &["--gpu-milli", "250", "--gpus", "1"], &script))
        .collect();

    step("four run at once, sharing the GPU, each with its MPS limits");
    let deadline = tokio::time::Instant::now() + JOB_TIMEOUT;
    let (running, waiting) = loop {
        let mut jobs: Vec<pb::Job> = Vec::new();
        for id in &ids {
            jobs.push(get_job(&mut client, *id).await);
        }
        let running: Vec<u64> = jobs
            .iter()
            .filter(|j| j.state == "running")
            .map(|j| j.id)
            .collect();
        let waiting: Vec<u64> = jobs
            .iter()
            .filter(|j| j.state != "running")
            .map(|j| j.id)
            .collect();
        if running.len() == 4 {
            break (running, waiting);
        }
        assert!(
            running.len() < 5,
            "five shares of 250 milli ran on one GPU: {jobs:#?}"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "four shares never ran together: {jobs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let fifth = waiting[0];
    for id in &running {
        let job = get_job(&mut client, *id).await;
        let alloc = &job.allocations[0];
        assert_eq!(alloc.gpus, vec![gpu.uuid.clone()], "job {id}");
        assert_eq!(alloc.gpu_milli, 250, "job {id}");
        let seen = seen_by(&dir, *id).await;
        let limit = format!("{}={}M", gpu.uuid, alloc.gpu_memory_mib);
        assert_eq!(
            seen,
            [
                gpu.uuid.as_str(),
                gpu.uuid.as_str(),
                "25",
                limit.as_str(),
                "250",
                alloc.gpu_memory_mib.to_string().as_str()
            ],
            "what job {id} saw"
        );
    }
    let journal_now = journal(&c, "h1");
    assert!(
        start_lines(&journal_now, fifth).is_empty(),
        "the fifth share started while four held the GPU: {journal_now:#?}"
    );

    step("one share ends: the fifth runs in its place");
    release(&dir, running[0]);
    wait_job(&mut client, running[0], JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    wait_job(&mut client, fifth, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    assert_eq!(seen_by(&dir, fifth).await[0], gpu.uuid);
    for id in &ids {
        release(&dir, *id);
    }
    for id in &ids {
        wait_job(&mut client, *id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
    }

    step("the host's own journal: the four overlapped, the fifth started after one stopped");
    let records = journal(&c, "h1");
    check_no_overlap(&records).unwrap_or_else(|e| panic!("{e}"));
    let first_starts: Vec<usize> = running
        .iter()
        .map(|id| start_lines(&records, *id)[0].0)
        .collect();
    let first_stop = running
        .iter()
        .filter_map(|id| stop_line(&records, start_lines(&records, *id)[0].1))
        .min()
        .expect("the shares stopped");
    assert!(
        first_starts.iter().all(|s| *s < first_stop),
        "the four shares did not all run at once: {records:#?}"
    );
    let starts = start_lines(&records, fifth);
    assert_eq!(starts.len(), 1, "{records:#?}");
    let released = stop_line(&records, start_lines(&records, running[0])[0].1).unwrap();
    assert!(starts[0].0 > released, "{records:#?}");
    assert!(
        records.iter().all(|r| match r {
            UsageRecord::Start { share, .. } => share.is_some_and(|s| s.milli == 250),
            UsageRecord::Stop { .. } => true,
        }),
        "{records:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_jobs_see_their_own_slices_and_run_beside_each_other() {
    let c = start_with_agents(&[("m1", "h100-pcie-1gpu-mig")]).await;
    let mut client = c.client().unwrap();
    // The simulated host's slices, as its agent reported them (UUIDs derive from the name).
    let inventory = node_agent::gpu::GpuBackend::inventory(
        &node_agent::gpu::simulated::SimulatedBackend::from_preset("h100-pcie-1gpu-mig", "m1")
            .unwrap(),
    )
    .unwrap();
    let parent = inventory.gpus[0].uuid.clone();
    let small: Vec<String> = inventory.gpus[0]
        .mig_instances
        .iter()
        .filter(|m| m.profile == "1g.10gb")
        .map(|m| m.uuid.clone())
        .collect();
    assert_eq!(small.len(), 2, "{inventory:?}");
    let dir = marker(&c, "mig");
    std::fs::create_dir_all(&dir).unwrap();
    let script = hold_until_released(
        &dir,
        &[
            "CUDA_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        ],
    );

    step("two 1g.10gb jobs on a host whose one GPU has two 1g.10gb slices");
    let a = gpuctl_submit(&c, &["--mig", "1g.10gb", "--gpus", "1"], &script);
    let b = gpuctl_submit(&c, &["--mig", "1g.10gb", "--gpus", "1"], &script);
    let mut seen = Vec::new();
    for id in [a, b] {
        let job = wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
            j.state == "running"
        })
        .await;
        let slice = job.allocations[0].gpus.clone();
        assert_eq!(slice.len(), 1, "job {id}: {slice:?}");
        assert!(
            small.contains(&slice[0]),
            "job {id} got {slice:?}, not a 1g.10gb slice"
        );
        assert_eq!(
            seen_by(&dir, id).await,
            [slice[0].as_str(), slice[0].as_str(), ""],
            "what job {id} saw"
        );
        seen.push(slice[0].clone());
    }
    assert_ne!(seen[0], seen[1], "two jobs on one slice");
    for id in [a, b] {
        release(&dir, id);
        wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
            j.state == "succeeded"
        })
        .await;
    }

    step("the journal: both slices ran at once, under their GPU, and the rule holds");
    let records = journal(&c, "m1");
    check_no_overlap(&records).unwrap_or_else(|e| panic!("{e}"));
    let (start_b, _) = start_lines(&records, b)[0];
    let (_, alloc_a) = start_lines(&records, a)[0];
    assert!(
        stop_line(&records, alloc_a).is_some_and(|stop_a| start_b < stop_a),
        "the two slices never ran at once: {records:#?}"
    );
    for r in &records {
        if let UsageRecord::Start {
            gpus, mig_parents, ..
        } = r
        {
            assert!(
                gpus.iter().all(|g| mig_parents.get(g) == Some(&parent)),
                "{r:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_on_a_shared_gpu_stops_every_share_of_it() {
    let c = start_with_agents(&[("h1", "h100-pcie-1gpu")]).await;
    let mut client = c.client().unwrap();
    let ids: Vec<u64> = (0..2)
        .map(|_| gpuctl_submit(&c, &["--gpu-milli", "500", "--gpus", "1"], "sleep 60"))
        .collect();
    let mut first = Vec::new();
    for id in &ids {
        let job = wait_job(&mut client, *id, JOB_TIMEOUT, "running", |j| {
            j.state == "running"
        })
        .await;
        first.push(job.allocations[0].id);
    }

    step("Xid 79 on the GPU both shares run on: both are requeued, the GPU is cordoned");
    let (ok, _, err) = gpuctl(&c, &["node", "inject", "h1", "--gpu", "0", "--xid", "79"]);
    assert!(ok, "{err}");
    for id in &ids {
        let job = wait_job(&mut client, *id, JOB_TIMEOUT, "requeued", |j| {
            j.state == "pending" && j.history.iter().any(|h| h.reason.contains("requeued"))
        })
        .await;
        assert!(
            job.history.iter().any(|h| h.reason.contains("79")),
            "{:?}",
            job.history
        );
    }
    let records = journal(&c, "h1");
    for alloc in &first {
        assert!(stop_line(&records, *alloc).is_some(), "{records:#?}");
    }
    let nodes = list_nodes(&mut client).await;
    assert_eq!(nodes[0].gpus[0].health, "unhealthy", "{:?}", nodes[0].gpus);

    step("the GPU recovers: both run again, then an Xid 13 fails both, naming the sharing");
    let (ok, _, err) = gpuctl(&c, &["node", "inject", "h1", "--gpu", "0", "--recover"]);
    assert!(ok, "{err}");
    for id in &ids {
        wait_job(&mut client, *id, JOB_TIMEOUT, "running again", |j| {
            j.state == "running"
                && j.allocations
                    .first()
                    .is_some_and(|a| !first.contains(&a.id))
        })
        .await;
    }
    let (ok, _, err) = gpuctl(&c, &["node", "inject", "h1", "--gpu", "0", "--xid", "13"]);
    assert!(ok, "{err}");
    for id in &ids {
        let job = wait_job(&mut client, *id, JOB_TIMEOUT, "failed", |j| {
            j.state == "failed"
        })
        .await;
        let reason = &job.history.last().unwrap().reason;
        assert!(
            reason.contains("13") && reason.contains("share the GPU"),
            "{:?}",
            job.history
        );
    }
    check_no_overlap(&journal(&c, "h1")).unwrap_or_else(|e| panic!("{e}"));
    let nodes = list_nodes(&mut client).await;
    assert_eq!(nodes[0].gpus[0].health, "healthy", "{:?}", nodes[0].gpus);
}
