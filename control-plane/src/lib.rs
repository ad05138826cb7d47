//! gpu-control-plane's control plane: a Raft-replicated GPU cluster scheduler.
//!
//! Layout (each folder readable alone):
//! - `state/`: the replicated state machine — plain data and a deterministic `apply`.
//! - `raft/`: openraft wiring — type config, sled log store and state machine, peer network.
//! - `api/`: gRPC services for clients; validation, leader forwarding, wire conversions.
//! - `server`: one replica process — config, data directory, Raft, API.
//! - `client`: the client library `gpuctl` and tests use (endpoint failover, retries).
//! - `cli/`: `gpuctl`'s commands and their output.
//! - `telemetry`: tracing and the optional OTLP export.

pub mod api;
pub mod cli;
pub mod client;
pub mod config;
pub mod datadir;
pub mod leader;
pub mod local_cluster;
pub mod raft;
pub mod replica;
pub mod scheduler;
pub mod server;
pub mod state;
pub mod telemetry;
