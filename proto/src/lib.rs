//! Generated gRPC types and services. Domain code converts at the edge (control-plane's `api/`)
//! and never passes these types inward. `transport` holds the channel, retry and shutdown
//! helpers both the control plane and the agents use; `tls` the mutual TLS every connection
//! runs over (certificates, identities, reloading).

pub mod tls;
pub mod transport;

/// Client API (`gpucp.v1`).
pub mod v1 {
    tonic::include_proto!("gpucp.v1");
}

/// Raft peer RPC (`gpucp.raft.v1`).
pub mod raft {
    tonic::include_proto!("gpucp.raft.v1");
}

/// Node agents ↔ control plane (`gpucp.agent.v1`).
pub mod agent {
    tonic::include_proto!("gpucp.agent.v1");
}

/// etcd's key-value API, the part `gpuctl bench submit --etcd-compare` measures etcd with
/// (`etcdserverpb`, client side only).
pub mod etcd {
    tonic::include_proto!("etcdserverpb");
}
