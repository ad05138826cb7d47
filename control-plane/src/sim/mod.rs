//! Simulation: replaying workloads through the real scheduler and state machine.

pub mod replay;
pub mod replay_svg;
pub mod workload;
