//! Target `topology`: arbitrary text as `nvidia-smi topo -m` output, read by the node agent's
//! parser (`node_agent::gpu::topology::parse`) and, from a file, by
//! `SimulatedSpec::from_topology_file` and `SimulatedBackend::new` (which build a host's
//! inventory from it, with a MIG layout the input's last bytes choose).
//!
//! Checks: nothing panics; a matrix `parse` accepts passes `Topology::validate`, prints
//! (`Display`) as text that parses back equal, and builds a simulated host with one GPU per
//! row; the file path accepts what `parse` accepts (but may refuse more GPUs than a node can
//! have).

use std::cell::RefCell;
use std::path::PathBuf;

use node_agent::gpu::GpuBackend;
use node_agent::gpu::simulated::{SimulatedBackend, SimulatedSpec};
use node_agent::gpu::topology;

use super::{Features, Target, shape};
use crate::state::validate::MAX_GPUS_PER_NODE;

pub const TARGET: Target = Target {
    name: "topology",
    about: "text → nvidia-smi topo -m parser and simulated host from a topology file; \
            accepted matrices validate, print and parse back equal, build a host",
    max_len: 8192,
    dictionary: &[
        b"GPU0",
        b"GPU1",
        b"GPU2",
        b"GPU7",
        b"GPU10",
        b"\tGPU0\tGPU1",
        b"NIC0",
        b"mlx5_0",
        b" X ",
        b"X",
        b"NV1",
        b"NV12",
        b"NV18",
        b"NV99",
        b"SYS",
        b"NODE",
        b"PHB",
        b"PXB",
        b"PIX",
        b"\t",
        b"  ",
        b"\n",
        b"\r\n",
        b"CPU Affinity",
        b"NUMA Affinity",
        b"GPU NUMA ID",
        b"N/A",
        b"0-55,112-167",
        b"0-65535",
        b"Legend:",
        b"# ",
        b"\x1b[4m",
        b"\x1b[0m",
        b"\x1b",
    ],
    seeds,
    run,
};

/// The topology files shipped with the node agent.
fn seeds() -> Vec<Vec<u8>> {
    const SHIPPED: &[&str] = &[
        include_str!("../../../node-agent/topologies/dgx-h100.txt"),
        include_str!("../../../node-agent/topologies/dgx1-v100.txt"),
        include_str!("../../../node-agent/topologies/a100-pcie-4gpu-nvlink-pairs.txt"),
        include_str!("../../../node-agent/topologies/pcie-8gpu-2socket.txt"),
    ];
    let mut out: Vec<Vec<u8>> = SHIPPED.iter().map(|t| t.as_bytes().to_vec()).collect();
    // As a terminal paste: underlined header, spaces for tabs, a NIC row and the legend.
    out.push(
        b"\x1b[4m        GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID\x1b[0m\n\
          GPU0     X      NV4     PXB     0-31    0               N/A\n\
          GPU1    NV4      X      SYS     32-63   1               N/A\n\
          NIC0    PXB     SYS      X\n\nLegend:\n\n  X    = Self\n"
            .to_vec(),
    );
    out
}

thread_local! {
    /// A scratch file per thread for the file-reading path.
    static SCRATCH: RefCell<Option<(tempfile::TempDir, PathBuf)>> = const { RefCell::new(None) };
}

fn scratch_file() -> PathBuf {
    SCRATCH.with(|s| {
        s.borrow_mut()
            .get_or_insert_with(|| {
                let dir = super::record_log::scratch_dir();
                let path = dir.path().join("fuzz-topology.txt");
                (dir, path)
            })
            .1
            .clone()
    })
}

fn run(input: &[u8], features: &mut Features) -> Result<(), String> {
    let text = String::from_utf8_lossy(input);
    let parsed = topology::parse(&text);
    let path = scratch_file();
    std::fs::write(&path, input).map_err(|e| format!("scratch file: {e}"))?;
    let model = "NVIDIA H100 80GB HBM3";
    let from_file = SimulatedSpec::from_topology_file(&path, "fuzz-host", model, 81_920);
    let t = match parsed {
        Err(e) => {
            features.add(("parse error", shape(&e, 10)));
            if std::str::from_utf8(input).is_ok() && from_file.is_ok() {
                return Err(format!(
                    "parse refuses the text ({e}) but the file path accepts it"
                ));
            }
            return Ok(());
        }
        Ok(t) => t,
    };
    features.add(("parsed", t.gpu_count().min(20)));
    t.validate()
        .map_err(|e| format!("parse accepted a matrix that fails validate: {e}"))?;
    let printed = t.to_string();
    match topology::parse(&printed) {
        Ok(back) if back == t => {}
        Ok(back) => {
            return Err(format!(
                "the printed matrix parses back differently: {t:?} printed as {printed:?}, read as {back:?}"
            ));
        }
        Err(e) => {
            return Err(format!(
                "the printed matrix does not parse: {e}: {printed:?}"
            ));
        }
    }
    features.add(("cpus", t.affinity_cpu_count().is_some()));
    let Ok(mut spec) = from_file else {
        // A host description may be refused for more GPUs than a node can have (the
        // control plane refuses such registrations), or for bytes that are not UTF-8.
        if std::str::from_utf8(input).is_err() || t.gpu_count() > MAX_GPUS_PER_NODE as usize {
            features.add("file refused");
            return Ok(());
        }
        return Err(format!(
            "parse accepts the text but the file path refuses it: {}",
            from_file.err().map(|e| e.to_string()).unwrap_or_default()
        ));
    };
    if spec.topology != t {
        return Err("the file path read another matrix than parse".into());
    }
    let host = SimulatedBackend::new(spec.clone())
        .map_err(|e| format!("a parsed topology does not build a host: {e}"))?;
    let inventory = host.inventory().map_err(|e| e.to_string())?;
    if inventory.gpus.len() != t.gpu_count() {
        return Err(format!(
            "{} GPUs in the matrix, {} in the host",
            t.gpu_count(),
            inventory.gpus.len()
        ));
    }
    // A MIG layout from the input's last bytes (errors are fine: most layouts do not fit).
    if let [.., gpu, a, b] = input {
        const PROFILES: [&str; 6] = [
            "1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.20gb",
        ];
        let profiles = [*a, *b]
            .iter()
            .map(|p| PROFILES[*p as usize % PROFILES.len()].to_owned())
            .collect();
        spec.mig = vec![(u32::from(*gpu) % 9, profiles)];
        match SimulatedBackend::new(spec) {
            Ok(host) => features.add(("mig host", host.inventory().map(|i| i.gpus.len()).ok())),
            Err(e) => features.add(("mig refused", shape(&e.to_string(), 10))),
        }
    }
    Ok(())
}
