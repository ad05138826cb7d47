//! Enforced isolation on real agents (simulated GPUs with real device nodes, real processes,
//! the host's real cgroup hierarchy): a job opens only its own GPU's device node, even with
//! `CUDA_VISIBLE_DEVICES` unset, and a job on a MIG slice only its slice's capability nodes;
//! a cancelled job leaves nothing behind, even a process that
//! left its session; `--mem` is a hard limit reported as "out of memory"; and the node says
//! what it enforces.

use std::time::Duration;

use proto::v1 as pb;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(30);

fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_opens_only_its_own_gpus_device_node_even_without_cuda_visible_devices() {
    if !is_root() {
        eprintln!("creating cgroups and device nodes needs root; not run");
        return;
    }
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();

    step("the node registered what it enforces");
    // A node that registered before the new cluster's version was raised (its first second)
    // registers again at its next heartbeat after the raise, with its release and enforcement.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let node = loop {
        let node = list_nodes(&mut client).await.remove(0);
        if !node.enforcement.is_empty() {
            break node;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the node never reported what it enforces: {node:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        node.enforcement
            .starts_with("cgroup v1: devices, memory, cpu, kill"),
        "{node:?}"
    );
    let (ok, out, _) = gpuctl(&c, &["nodes"]);
    assert!(
        ok && out.contains("ENFORCED") && out.contains("cgroup-v1"),
        "{out}"
    );

    step("a one-GPU job tries every GPU's device node, with CUDA_VISIBLE_DEVICES unset");
    let script = "echo \"mine $CUDA_VISIBLE_DEVICES\"; unset CUDA_VISIBLE_DEVICES NVIDIA_VISIBLE_DEVICES; \
                  for n in 0 1 2 3; do echo \"nvidia$n $(cat $GPUCP_DEVICE_DIR/nvidia$n 2>&1 </dev/null)\"; done; \
                  echo \"nvidiactl $(cat $GPUCP_DEVICE_DIR/nvidiactl 2>&1 </dev/null)\"";
    let id = submit(&mut client, shell_job(1, script), "")
        .await
        .unwrap()
        .id;
    let done = wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    let usage = done.usage.expect("usage measured by the job's cgroup");
    assert!(usage.cpu_ms > 0 || usage.peak_memory_bytes > 0, "{usage:?}");
    let out = job_logs(&mut client, id).await.0;
    let mine_uuid = out
        .lines()
        .find_map(|l| l.strip_prefix("mine "))
        .expect("the job printed its GPU");
    let mine = node
        .gpus
        .iter()
        .find(|g| g.uuid == mine_uuid)
        .expect("its GPU is the node's")
        .index;
    for n in 0..4u32 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("nvidia{n} ")))
            .unwrap_or_else(|| panic!("no line for nvidia{n}: {out}"));
        if n == mine {
            assert!(
                line.contains("No such device"),
                "its own GPU's node must pass the cgroup (and find no driver): {line}"
            );
        } else {
            assert!(
                line.contains("Operation not permitted"),
                "another GPU's node must be refused by the cgroup: {line}"
            );
        }
    }
    assert!(
        out.contains("nvidiactl")
            && !out
                .lines()
                .any(|l| l.starts_with("nvidiactl") && l.contains("not permitted")),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_a_mig_slice_opens_its_slices_capability_nodes_and_no_other() {
    if !is_root() {
        eprintln!("creating cgroups and device nodes needs root; not run");
        return;
    }
    // One GPU cut into four slices: the simulated host makes dev/nvidia-caps/nvidia-capN
    // for each slice's GPU instance and compute instance, and a driver table saying which.
    let c = start_with_agents(&[("m1", "h100-pcie-1gpu-mig")]).await;
    let mut client = c.client().unwrap();
    let inventory = node_agent::gpu::GpuBackend::inventory(
        &node_agent::gpu::simulated::SimulatedBackend::from_preset("h100-pcie-1gpu-mig", "m1")
            .unwrap(),
    )
    .unwrap();
    let table = node_agent::cgroup::mig_caps::MigMinors::parse(
        &node_agent::cgroup::mig_caps::driver_table(1),
    );

    step("a 1g.10gb job tries every capability node, and its parent GPU's node");
    let script = "echo \"mine $CUDA_VISIBLE_DEVICES\"; \
                  for f in $GPUCP_DEVICE_DIR/nvidia-caps/nvidia-cap*; do echo \"$(basename $f) $(cat $f 2>&1 </dev/null)\"; done; \
                  echo \"nvidia0 $(cat $GPUCP_DEVICE_DIR/nvidia0 2>&1 </dev/null)\"";
    let id = submit(
        &mut client,
        pb::JobSpec {
            mig_profile: "1g.10gb".into(),
            ..shell_job(1, script)
        },
        "",
    )
    .await
    .unwrap()
    .id;
    wait_job(&mut client, id, JOB_TIMEOUT, "succeeded", |j| {
        j.state == "succeeded"
    })
    .await;
    let out = job_logs(&mut client, id).await.0;
    let mine = out
        .lines()
        .find_map(|l| l.strip_prefix("mine "))
        .expect("the job printed its slice");
    let slice = inventory.gpus[0]
        .mig_instances
        .iter()
        .find(|m| m.uuid == mine)
        .unwrap_or_else(|| panic!("{mine} is not a slice of the host: {out}"));
    let own = table
        .access(
            0,
            slice.gpu_instance_id.unwrap(),
            slice.compute_instance_id.unwrap(),
        )
        .unwrap();
    let caps: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("nvidia-cap"))
        .collect();
    assert_eq!(
        caps.len(),
        8,
        "two nodes for each of the four slices: {out}"
    );
    for line in caps {
        let minor: u32 = line["nvidia-cap".len()..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        if own.contains(&minor) {
            assert!(
                line.contains("No such device"),
                "its own slice's capability node must pass the cgroup: {line}"
            );
        } else {
            assert!(
                line.contains("Operation not permitted"),
                "another slice's capability node must be refused: {line}"
            );
        }
    }
    let parent = out
        .lines()
        .find(|l| l.starts_with("nvidia0 "))
        .expect("the parent GPU's line");
    assert!(parent.contains("No such device"), "{parent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_leaves_no_process_behind_even_one_that_left_its_session() {
    if !is_root() {
        eprintln!("creating cgroups needs root; not run");
        return;
    }
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let pid_file = c.root.join("escaped.pid");
    let script = format!(
        "setsid sh -c 'echo $$ > {p}.tmp && mv {p}.tmp {p}; exec sleep 1000' & sleep 1000",
        p = pid_file.display()
    );
    let id = submit(&mut client, shell_job(1, &script), "")
        .await
        .unwrap()
        .id;
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    let pid: i32 = loop {
        if let Ok(text) = std::fs::read_to_string(&pid_file) {
            break text.trim().parse().expect("a pid");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job never wrote its escaped pid"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());

    step("cancel: the process in its own session dies with the job");
    let (ok, _, err) = gpuctl(&c, &["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    wait_job(&mut client, id, JOB_TIMEOUT, "cancelled", |j| {
        j.state == "cancelled"
    })
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next().map(str::to_owned))
            });
        if state.as_deref().is_none_or(|s| s == "Z") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid}, which left the job's session, survived its cancel (state {state:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_past_its_memory_limit_is_reported_out_of_memory() {
    if !is_root() {
        eprintln!("creating cgroups needs root; not run");
        return;
    }
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let job = pb::JobSpec {
        memory_mib_per_task: 32,
        // dd fills a 256 MiB buffer.
        ..shell_job(1, "dd if=/dev/zero of=/dev/null bs=256M count=1")
    };
    let id = submit(&mut client, job, "").await.unwrap().id;
    let done = wait_job(&mut client, id, JOB_TIMEOUT, "failed", |j| {
        j.state == "failed"
    })
    .await;
    let reason = &done.history.last().unwrap().reason;
    assert!(reason.contains("out of memory"), "{done:#?}");
    assert!(reason.contains("32 MiB"), "{reason}");
    let usage = done
        .usage
        .expect("the cgroup's accounting, reported with the exit");
    assert_eq!(usage.oom_kills, 1, "{usage:?}");
    assert!(usage.peak_memory_bytes <= 32 << 20, "{usage:?}");
    let (ok, out, _) = gpuctl(&c, &["show", &id.to_string()]);
    assert!(ok && out.contains("out of memory"), "{out}");
    assert!(out.contains("1 OOM kill(s)"), "{out}");

    step("accounting sums it for the tenant");
    let (ok, out, err) = gpuctl(&c, &["-o", "json", "accounting"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let t = &v["tenants"][0];
    assert_eq!(t["tenant"], "team-a", "{v}");
    assert_eq!(t["oom_kills"], 1, "{v}");
    assert_eq!(t["by_state"]["failed"], 1, "{v}");
    assert_eq!(t["jobs_measured"], 1, "{v}");
}
