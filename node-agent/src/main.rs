//! `node-agent`: the agent that runs on every GPU host.
//!
//! Not built yet: GPU discovery (NVML and simulated hosts), the workload runtime, leases and
//! Xid handling arrive with the node-agent issue. Until then this binary only says so, so that
//! nobody mistakes it for a working agent.

fn main() {
    eprintln!(
        "node-agent {}: the GPU host agent is not available in this release yet; \
         the control plane (control-plane, gpuctl) works without it",
        env!("CARGO_PKG_VERSION")
    );
    std::process::exit(2);
}
