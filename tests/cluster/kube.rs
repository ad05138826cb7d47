//! Kubernetes habits through `gpuctl`: a `kind: GpuJob` manifest applied twice makes one job,
//! `get`/`describe` find it by name (`-o yaml` prints the manifest back), a changed spec under
//! a live name is refused, and `delete` cancels it so the next apply runs it again.

use std::time::Duration;

use crate::util::*;

const JOB_TIMEOUT: Duration = Duration::from_secs(30);

const MANIFEST: &str = "apiVersion: gpucp.io/v1
kind: GpuJob
metadata:
  name: sweep-7
  namespace: vision
spec:
  priorityClassName: high
  command: [sh, -c]
  args: ['echo rank $RANK; sleep 30']
  env: [{name: MODE, value: offline}]
  resources:
    limits:
      nvidia.com/gpu: 2
      cpu: 500m
      memory: 1Gi
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_applies_once_by_name_and_get_describe_delete_find_it() {
    let c = start_with_agents(&[("n1", "a100-pcie-4gpu-nvlink-pairs")]).await;
    let mut client = c.client().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job.yaml");
    std::fs::write(&file, MANIFEST).unwrap();
    let path = file.to_str().unwrap();

    step("apply twice: one job");
    let (ok, out, err) = gpuctl(&c, &["apply", "-f", path]);
    assert!(ok, "{err}");
    assert!(out.starts_with("gpujob/sweep-7 created (job "), "{out}");
    let id: u64 = out
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .trim_end_matches(')')
        .parse()
        .unwrap();
    let (ok, out, err) = gpuctl(&c, &["apply", "-f", path]);
    assert!(
        ok && out.trim() == format!("gpujob/sweep-7 unchanged (job {id})"),
        "{out}{err}"
    );
    let job = wait_job(&mut client, id, JOB_TIMEOUT, "running", |j| {
        j.state == "running"
    })
    .await;
    let spec = job.spec.unwrap();
    assert_eq!(
        (
            spec.tenant.as_str(),
            spec.gpus_per_task,
            spec.priority_class.as_str()
        ),
        ("vision", 2, "high")
    );
    assert_eq!(
        (spec.cpu_milli_per_task, spec.memory_mib_per_task),
        (500, 1024)
    );

    step("get, get -o wide, get -o yaml, describe");
    let (ok, out, _) = gpuctl(&c, &["get", "jobs"]);
    assert!(
        ok && out.contains("sweep-7") && out.contains("RUNNING"),
        "{out}"
    );
    let (ok, out, _) = gpuctl(&c, &["-o", "wide", "get", "job", "sweep-7"]);
    assert!(ok && out.contains("TENANT") && out.contains("n1"), "{out}");
    let (ok, yaml, _) = gpuctl(&c, &["-o", "yaml", "get", "job", "sweep-7"]);
    assert!(
        ok && yaml.contains("kind: GpuJob") && yaml.contains("nvidia.com/gpu: 2"),
        "{yaml}"
    );
    let (ok, out, _) = gpuctl(&c, &["describe", "job", "sweep-7"]);
    assert!(ok && out.contains(&format!("Job:           {id}")), "{out}");

    step("what get -o yaml printed applies back as the same job");
    let again = dir.path().join("again.yaml");
    std::fs::write(&again, &yaml).unwrap();
    let (ok, out, err) = gpuctl(&c, &["apply", "-f", again.to_str().unwrap()]);
    assert!(ok && out.contains("unchanged"), "{out}{err}");

    step("a changed spec under the live name is refused");
    std::fs::write(
        &file,
        MANIFEST.replace("nvidia.com/gpu: 2", "nvidia.com/gpu: 1"),
    )
    .unwrap();
    let (ok, _, err) = gpuctl(&c, &["apply", "-f", path]);
    assert!(
        !ok && err.contains("different spec") && err.contains("gpuctl delete job sweep-7"),
        "{err}"
    );

    step("delete cancels it; applying again runs a new job");
    let (ok, out, err) = gpuctl(&c, &["delete", "job", "sweep-7"]);
    assert!(ok && out.contains("deleted"), "{out}{err}");
    wait_job(&mut client, id, JOB_TIMEOUT, "cancelled", |j| {
        j.state == "cancelled"
    })
    .await;
    let (ok, out, err) = gpuctl(&c, &["apply", "-f", path]);
    assert!(
        ok && out.contains("created") && !out.contains(&format!("(job {id})")),
        "{out}{err}"
    );
    let (ok, _, err) = gpuctl(&c, &["delete", "job", "no-such-job"]);
    assert!(
        !ok && err.contains("no pending or running job named \"no-such-job\""),
        "{err}"
    );
}
