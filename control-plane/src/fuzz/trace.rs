//! Target `trace`: arbitrary bytes as the trace CSVs of the fragmentation simulation
//! (`sim::trace::parse_nodes`, `parse_pods`). Up to the first NUL byte the input is the node
//! list, after it the pod list (without a NUL, both parsers read all of it). When both parse
//! and the cluster is small, a short fragmentation run (`sim::fragmentation::run`, one seed,
//! one thread, every policy) is made on them.
//!
//! Checks: nothing panics; what parses has the shape the parsers promise (a GPU node names
//! its model, a task's milli is in range); a run's figures are percentages.

use std::path::Path;

use super::{Features, Target, shape};
use crate::scheduler::ScorePolicy;
use crate::scheduler::score::FULL_GPU_MILLI;
use crate::sim::fragmentation::{self, Config};
use crate::sim::trace::{self, TraceError};

pub const TARGET: Target = Target {
    name: "trace",
    about: "bytes → node list / pod list CSV parsers, then a short fragmentation run on \
            what parses; parsed rows are in range, figures are percentages",
    max_len: 4096,
    dictionary: &[
        b"sn,cpu_milli,memory_mib,gpu,model\n",
        b"name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n",
        b",", b"\"", b"\"\"", b"\n", b"\r\n", b"\xef\xbb\xbf", b"\0", b"|", b"P100|V100",
        b"G2", b"T4", b"1000", b"999", b"4294967295", b"4294967296", b"18446744073709551615",
        b"-1", b"LS", b"Running",
    ],
    seeds,
    run,
};

/// The traces' headers and first lines (`tests/traces/*.csv`), and variations the parsers
/// accept (quotes, CRLF, a byte-order mark, extra columns, shares and model lists, no
/// `gpu_spec` column).
fn seeds() -> Vec<Vec<u8>> {
    let nodes = "sn,cpu_milli,memory_mib,gpu,model\n\
                 openb-node-0000,64000,262144,2,P100\n\
                 openb-node-0001,96000,786432,8,G2\n\
                 openb-node-0227,32000,131072,0,\n";
    let pods = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
                openb-pod-0000,12000,16384,1,1000,,LS,Running,0,12537496,0\n\
                openb-pod-0001,6000,12288,1,460,,LS,Running,427061,12902960,427061\n\
                openb-pod-0017,88000,327680,8,1000,G2,BE,Running,3412,99999,3412\n\
                openb-pod-0042,4000,8192,0,0,,BE,Failed,10,20,10\n\
                openb-pod-0051,8000,30720,1,500,P100|V100M16,LS,Running,1,2,1\n";
    let quoted = "\u{feff}\"sn\",\"cpu_milli\",memory_mib,gpu,model,extra\r\n\"n,1\",1000,1024,1,\"T4\",x\r\n";
    // A pod list without model constraints (no `gpu_spec` column).
    let no_spec = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n\
                   p0,12000,16384,1,1000\n\
                   p1,6000,12288,1,460\n";
    vec![
        format!("{nodes}\0{pods}").into_bytes(),
        format!("{nodes}\0{no_spec}").into_bytes(),
        nodes.as_bytes().to_vec(),
        pods.as_bytes().to_vec(),
        format!("{quoted}\0{pods}").into_bytes(),
    ]
}

fn error_feature(features: &mut Features, which: &str, e: &TraceError) {
    let what = match e {
        TraceError::Io { .. } => "io".to_owned(),
        TraceError::Empty { .. } => "empty".to_owned(),
        TraceError::MissingColumn { column, .. } => format!("missing {column}"),
        TraceError::Field { field, reason, .. } => format!("{field}: {}", shape(reason, 6)),
        TraceError::NoRows { .. } => "no rows".to_owned(),
        TraceError::Syntax { reason, .. } => format!("syntax: {}", shape(reason, 6)),
    };
    features.add((which, what));
}

/// Largest cluster (GPUs) and pod list a case runs the simulation on: a trace that names a
/// billion GPUs is meant to allocate for them.
const MAX_SIM_GPUS: u64 = 4096;
const MAX_SIM_NODES: usize = 256;

fn run(input: &[u8], features: &mut Features) -> Result<(), String> {
    let (node_bytes, pod_bytes) = match input.iter().position(|&b| b == 0) {
        Some(i) => (&input[..i], &input[i + 1..]),
        None => (input, input),
    };
    let node_text = String::from_utf8_lossy(node_bytes);
    let pod_text = String::from_utf8_lossy(pod_bytes);
    let nodes = trace::parse_nodes(&node_text, Path::new("nodes.csv"));
    let pods = trace::parse_pods(&pod_text, Path::new("pods.csv"));
    if let Err(e) = &nodes {
        error_feature(features, "nodes", e);
        // Errors print: the CLI shows them.
        let _ = e.to_string();
    }
    if let Err(e) = &pods {
        error_feature(features, "pods", e);
        let _ = e.to_string();
    }
    let (Ok(nodes), Ok(pods)) = (nodes, pods) else {
        return Ok(());
    };
    for n in &nodes {
        if n.gpus > 0 && n.model.is_empty() {
            return Err(format!("node {} has GPUs but no model", n.name));
        }
    }
    for p in &pods {
        let ok = match p.num_gpu {
            0 => p.gpu_milli == 0,
            1 => (1..=FULL_GPU_MILLI).contains(&p.gpu_milli),
            _ => p.gpu_milli == FULL_GPU_MILLI,
        };
        if !ok {
            return Err(format!(
                "pod {} parsed with {} GPUs of {} milli",
                p.name, p.num_gpu, p.gpu_milli
            ));
        }
    }
    let gpus: u64 = nodes.iter().map(|n| u64::from(n.gpus)).sum();
    features.add(("parsed", nodes.len().min(8), pods.len().min(8), gpus > 0));
    if gpus > MAX_SIM_GPUS || nodes.len() > MAX_SIM_NODES || pods.len() > 1024 {
        return Ok(());
    }
    let config = Config {
        seeds: vec![1],
        policies: vec![
            ScorePolicy::RandomFit { seed: 0 },
            ScorePolicy::BestFit,
            ScorePolicy::Fgd,
            ScorePolicy::FgdLookahead,
            ScorePolicy::FgdHorizon,
        ],
        max_tasks: Some(64),
        threads: 1,
        ..Config::default()
    };
    match fragmentation::run(&nodes, &pods, &config) {
        Err(e) => features.add(("sim refused", e.to_string())),
        Ok(report) => {
            for p in &report.policies {
                for r in &p.runs {
                    let pct = |x: f64| x.is_finite() && (0.0..=100.0 + 1e-9).contains(&x);
                    if !pct(r.allocated_pct) || !r.curve.iter().all(|c| pct(*c)) {
                        return Err(format!(
                            "{}: allocated {}% (curve {:?}) is not a percentage",
                            p.policy.name(),
                            r.allocated_pct,
                            r.curve
                        ));
                    }
                    if r.failed > r.tasks {
                        return Err(format!("{} of {} tasks failed", r.failed, r.tasks));
                    }
                }
            }
            features.add(("simulated", report.task_types.min(8)));
            let _ = report.to_json();
        }
    }
    Ok(())
}
