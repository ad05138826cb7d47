//! Trace-driven simulation of the scheduling policy, on the scheduler's own code: no replicas,
//! no network, deterministic per seed.
//!
//! - `trace`: loading the node and pod lists of the Alibaba GPU trace (FGD paper).
//! - `fragmentation`: the FGD paper's fragmentation experiment — tasks arrive until 130% of
//!   GPU capacity is requested; how much of the capacity each policy manages to allocate. It
//!   drives `scheduler::score` directly, the scoring `plan()` uses.
//! - `svg`: the allocation curves as a plain SVG plot.
//! - `synth`: variants of a pod list with another mix of task kinds (more sharing, multi-GPU,
//!   model-constrained or CPU-only tasks), to check a placement policy beyond one trace.
//! - `replay`, `workload`, `replay_svg`: a time-based replay through the real state machine
//!   and `plan_with` (arrivals, durations, time limits, priorities, tenants, gangs,
//!   dependencies), with a synthetic workload generator, and its plot.
//!
//! - `dl_workload`: a deep-learning training workload shaped after the Philly and Helios
//!   characterisations; `las`: a Tiresias-style least-attained-service baseline scheduler;
//!   `compare`: ours, FIFO + backfill and that baseline side by side on one trace.
//!
//! `gpuctl simulate fragmentation` and `gpuctl simulate replay` are the command-line front ends.

pub mod compare;
pub mod csv_table;
pub mod dl_workload;
pub mod fragmentation;
pub mod las;
pub mod replay;
pub mod replay_svg;
pub mod svg;
pub mod synth;
#[cfg(test)]
mod test_fleet;
pub mod trace;
pub mod workload;
