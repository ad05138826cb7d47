//! Black-box tests of real multi-process control planes on loopback: three (or more)
//! `control-plane` processes, driven through the gRPC client and `gpuctl`, with SIGKILLs,
//! restarts, wiped data directories and membership changes; `metrics` also runs a real
//! Prometheus against them.

mod agent_restart;
mod agents;
mod backup;
mod bad_input;
mod basic;
mod cli_output;
mod containers;
mod enforcement;
mod failover;
mod hostile_input;
mod job_env;
mod kube;
mod membership;
mod metrics;
mod pending_reasons;
mod security;
mod service_cli;
mod services;
mod slurm_controls;
mod status_page;
mod telemetry;
mod util;
