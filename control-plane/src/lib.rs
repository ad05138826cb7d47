//! gpu-control-plane's control plane: a Raft-replicated GPU cluster scheduler.
//!
//! Layout (each folder readable alone):
//! - `state/`: the replicated state machine — plain data and a deterministic `apply`.
//! - `scheduler/`: pure placement policy — `plan(&ClusterState, now)`.
//! - `leader/`: loops only the leader runs — scheduling passes, node liveness (leases).
//! - `raft/`: openraft wiring — type config, sled log store and state machine, peer network.
//! - `api/`: gRPC services for clients and agents; validation, leader forwarding, conversions.
//! - `replica`, `server`, `config`, `datadir`: one replica process and its data directory.
//! - `status_page`: the HTML status page on the metrics port (cluster, GPU grid, queue, jobs).
//! - `health`: the gRPC health protocol — readiness and liveness for probes.
//! - `membership`: adding and removing replicas safely; what `cluster status` reports.
//! - `client`: the client library `gpuctl` and tests use (endpoint failover, retries).
//! - `cli/`: `gpuctl`'s commands and their output, `gpuctl dev` and `gpuctl bench`.
//! - `local_cluster`: replicas and simulated hosts as local processes (dev, benches, tests).
//! - `telemetry`: tracing and the optional OTLP export.
//! - `fuzz/`: fuzz targets for hostile input and their stable-Rust harness (`gpucp-fuzz`).

pub mod api;
pub mod backup;
pub mod cli;
pub mod client;
pub mod config;
pub mod datadir;
pub mod dst;
pub mod fuzz;
pub mod group_commit;
pub mod health;
pub mod host_image;
pub mod http;
pub mod leader;
pub mod local_cluster;
pub mod membership;
pub mod metrics;
pub mod off_runtime;
pub mod raft;
pub mod release;
pub mod replica;
pub mod scheduler;
pub mod server;
pub mod sim;
pub mod state;
pub mod status_page;
pub mod synthetic;
pub mod telemetry;
