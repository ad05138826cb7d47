//! Chaos harness for gpu-control-plane: real `control-plane` replicas and node agents on
//! loopback, a workload, faults on a schedule (kills, pauses, partitions, wipes, rolling
//! restarts), a recorded history and a checker of the invariants of `docs/ARCHITECTURE.md`.
//! See `chaos/README.md`.

pub mod check;
pub mod faults;
pub mod history;
pub mod members;
pub mod partition;
pub mod scenario;
pub mod services;
pub mod summary;
pub mod workload;
