//! Tests' fleet: plain simulated nodes (one GPU model, no MIG, no topology).

use std::collections::BTreeMap;

use crate::state::{Gpu, GpuHealth, NodeSpec};

/// Node `name` with `gpus` healthy 16 GiB GPUs of model `X`, 64 CPUs and 500 GiB of memory.
pub fn plain_node(name: &str, gpus: u32) -> NodeSpec {
    NodeSpec {
        agent_release: String::new(),
        enforcement: String::new(),
        container_runtime: String::new(),
        service_ports: None,
        name: name.into(),
        gpus: (0..gpus)
            .map(|i| Gpu {
                uuid: format!("GPU-{name}-{i}"),
                index: i,
                model: "X".into(),
                memory_mib: 16_384,
                numa_node: None,
                pci_bus_id: String::new(),
                health: GpuHealth::Healthy,
                mig: vec![],
            })
            .collect(),
        cpu_milli: 64_000,
        memory_mib: 512_000,
        partition: None,
        labels: BTreeMap::new(),
        topology: vec![],
        agent_address: String::new(),
        driver: "simulated".into(),
        incarnation: String::new(),
    }
}
