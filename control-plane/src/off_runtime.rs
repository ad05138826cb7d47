//! Running CPU-bound work from async code without stalling the runtime.

/// Runs CPU-bound work (a scheduling pass, the apply of a large plan: up to seconds on a large
/// cluster) where it does not hold up one of the runtime's few threads: on a multi-threaded
/// runtime the thread hands its other tasks (Raft heartbeats, API calls) to another before `f`
/// runs. The deterministic simulation's single-threaded runtime runs `f` in place.
pub fn off_runtime<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}
