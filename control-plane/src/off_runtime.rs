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

/// Runs CPU-bound background work (serializing a snapshot: 100 ms of CPU at 10,000 jobs,
/// seconds at a million) on a thread of its own at the lowest CPU priority, so that it uses
/// the CPU the replica's Raft and API threads leave idle instead of taking turns with them.
/// Every replica snapshots at the same log index, so at normal priority three serializations
/// at once held up every write for 100–200 ms on a 2-core host.
///
/// `f` must not take locks or resources that normal-priority threads wait for (sled's IO
/// buffers among them): a preempted low-priority thread would hold them up (priority
/// inversion). Pure computation on data it owns is the intended use.
pub async fn at_background_priority<R: Send + 'static>(
    f: impl FnOnce() -> R + Send + 'static,
) -> std::io::Result<R> {
    // A fresh thread, since a thread's priority cannot be raised again without privileges;
    // joined from a blocking task, because tokio does not advance a paused clock (the
    // deterministic simulation's) while a blocking task runs, and would while a bare thread
    // did.
    let joined = tokio::task::spawn_blocking(move || {
        std::thread::Builder::new()
            .name("background".into())
            .spawn(move || {
                lower_this_threads_priority();
                f()
            })?
            .join()
            .map_err(|_| std::io::Error::other("the background thread panicked"))
    })
    .await;
    joined.map_err(|e| std::io::Error::other(format!("the background task failed: {e}")))?
}

/// Nice 19 for the calling thread only (on Linux, `setpriority` on a thread id applies to that
/// thread). Best effort: where it fails, the work runs at normal priority, as it used to.
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority have no memory-safety preconditions.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn background_work_runs_at_the_lowest_priority_and_returns_its_result() {
        let (value, nice) = at_background_priority(|| {
            // SAFETY: gettid and getpriority have no memory-safety preconditions.
            let nice = unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::getpriority(libc::PRIO_PROCESS, tid)
            };
            (6 * 7, nice)
        })
        .await
        .unwrap();
        assert_eq!(value, 42);
        assert_eq!(nice, 19);
        // SAFETY: as above; 0 is the calling process, which must be left as it was.
        let caller = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        assert_ne!(caller, 19);
    }
}
