//! What gpuctl prints about a live cluster: `queue --format` and `nodes --format` columns,
//! `node show` (GPUs with NUMA node, holder and MIG slices, the link matrix), and every job
//! and GPU field in `-o json`.

use std::time::Duration;

use proto::v1 as pb;

use crate::util::*;

/// The rows of a table (header first), each split into whitespace-separated words.
fn rows(out: &str) -> Vec<Vec<&str>> {
    out.lines()
        .map(|l| l.split_whitespace().collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_node_details_and_json_carry_every_field() {
    let c = start_with_agents(&[("n1", "dgx-h100"), ("n2", "h100-pcie-1gpu-mig")]).await;
    let mut client = c.client().unwrap();
    let timeout = Duration::from_secs(30);

    step("a 2-GPU job on one NUMA node and a MIG job run");
    let whole = submit(
        &mut client,
        pb::JobSpec {
            single_numa: true,
            preemptible: true,
            ..spec("whole", 2)
        },
        "",
    )
    .await
    .unwrap()
    .id;
    let mig = submit(
        &mut client,
        pb::JobSpec {
            mig_profile: "1g.10gb".into(),
            ..spec("slice", 1)
        },
        "",
    )
    .await
    .unwrap()
    .id;
    for id in [whole, mig] {
        wait_job(&mut client, id, timeout, "running", |j| {
            j.state == "running"
        })
        .await;
    }

    step("queue --format, in squeue letters and by name");
    let (ok, out, err) = gpuctl(&c, &["queue", "--format", "%i %j %t %b %N"]);
    assert!(ok, "{err}");
    let table = rows(&out);
    assert_eq!(
        table[0],
        ["JOBID", "NAME", "ST", "GRES", "NODELIST"],
        "{out}"
    );
    assert!(
        table.contains(&vec![
            whole.to_string().as_str(),
            "whole",
            "R",
            "gpu:2",
            "n1"
        ]),
        "{out}"
    );
    assert!(
        table.contains(&vec![
            mig.to_string().as_str(),
            "slice",
            "R",
            "mig-1g.10gb:1",
            "n2"
        ]),
        "{out}"
    );
    let (ok, out, err) = gpuctl(&c, &["queue", "--format", "id,state,preemptible"]);
    assert!(ok, "{err}");
    assert!(
        rows(&out).contains(&vec![whole.to_string().as_str(), "RUNNING", "yes"]),
        "{out}"
    );
    let (ok, _, err) = gpuctl(&c, &["queue", "--format", "%i %y"]);
    assert!(!ok);
    assert!(
        err.contains("no field %y") && err.contains("%j name"),
        "{err}"
    );

    step("nodes --format");
    let (ok, out, err) = gpuctl(&c, &["nodes", "--format", "%N %t numa cpus"]);
    assert!(!ok, "a mix of letters and names is refused: {out}");
    assert!(err.contains("is not a field"), "{err}");
    let (ok, out, err) = gpuctl(&c, &["nodes", "--format", "node,state,gpus_used,numa"]);
    assert!(ok, "{err}");
    let table = rows(&out);
    assert!(
        table.contains(&vec!["n1", "mix", "2/8", "0:0-3", "1:4-7"]),
        "{out}"
    );

    step("node show: GPUs with their holder and NUMA node, MIG slices, the link matrix");
    let (ok, out, err) = gpuctl(&c, &["node", "show", "n1"]);
    assert!(ok, "{err}");
    assert!(out.contains("Topology (nvidia-smi topo -m):"), "{out}");
    let matrix: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("Topology"))
        .skip(1)
        .collect();
    assert_eq!(matrix.len(), 9, "{out}");
    assert!(
        matrix[0].contains("GPU7") && matrix[0].ends_with("NUMA Affinity"),
        "{out}"
    );
    assert_eq!(
        matrix[1].split_whitespace().collect::<Vec<_>>()[..3],
        ["GPU0", "X", "NV18"]
    );
    assert!(matrix[8].ends_with(" 1"), "GPU7 is on NUMA node 1: {out}");
    assert_eq!(
        out.matches("allocation ").count(),
        2,
        "two GPUs held: {out}"
    );
    let (ok, out, err) = gpuctl(&c, &["nodes", "n2"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("1g.10gb@"),
        "the held slice names its allocation: {out}"
    );
    let (ok, _, err) = gpuctl(&c, &["node", "show", "nosuchnode"]);
    assert!(
        !ok && err.contains("no node \"nosuchnode\"") && err.contains("n1, n2"),
        "{err}"
    );

    step("-o json: every job and GPU field");
    let (ok, out, err) = gpuctl(&c, &["-o", "json", "show", &whole.to_string()]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (j["single_numa"].as_bool(), j["preemptible"].as_bool()),
        (Some(true), Some(true)),
        "{j}"
    );
    assert_eq!(j["attempts"], 1, "{j}");
    assert_eq!(
        j["allocations"][0]["gpus"].as_array().map(Vec::len),
        Some(2),
        "{j}"
    );
    let (ok, out, err) = gpuctl(&c, &["-o", "json", "show", &mig.to_string()]);
    assert!(ok, "{err}");
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(j["mig_profile"], "1g.10gb", "{j}");
    let (ok, out, err) = gpuctl(&c, &["-o", "json", "nodes"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let node = |name: &str| {
        v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == name)
            .cloned()
            .unwrap()
    };
    let n1 = node("n1");
    assert_eq!(n1["topology"].as_array().map(Vec::len), Some(8), "{n1}");
    assert_eq!(n1["gpus"][7]["numa_node"], 1, "{n1}");
    let n2 = node("n2");
    let slices = n2["gpus"][0]["mig"].as_array().unwrap();
    assert_eq!(slices.len(), 4, "{n2}");
    assert_eq!(
        slices.iter().filter(|s| s["allocation"].is_u64()).count(),
        1,
        "one slice held: {n2}"
    );
}
