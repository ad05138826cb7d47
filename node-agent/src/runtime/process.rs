//! Thin, checked wrappers over the Linux process interfaces the runtime needs: reading
//! `/proc/<pid>/stat` (state and start time, to detect pid reuse), signalling a process
//! group, reaping our own children without blocking, and the wall clock.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch. Wall clock, because the values are persisted and
/// compared across agent restarts (a monotonic clock restarts with the host).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The fields of `/proc/<pid>/stat` the runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    /// Field 22: start time in clock ticks since boot; with the pid it names a process
    /// uniquely until reboot.
    pub start_ticks: u64,
}

/// Parses the content of `/proc/<pid>/stat`. Field 2 (the command name in parentheses) may
/// itself contain spaces and parentheses, so the fields are counted from the *last* `)`.
pub(crate) fn parse_stat(text: &str) -> Option<ProcStat> {
    let close = text.rfind(')')?;
    let fields: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    // fields[0] is field 3 of the man page, so field N is fields[N - 3].
    let state = fields.first()?.chars().next()?;
    let start_ticks = fields.get(19)?.parse().ok()?;
    Some(ProcStat { state, start_ticks })
}

/// `Ok(None)` when there is no such process.
pub(crate) fn read_stat(pid: u32) -> io::Result<Option<ProcStat>> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => parse_stat(&text).map(Some).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected /proc/{pid}/stat format: {text:?}"),
            )
        }),
        // ESRCH: the process exited between opening and reading the file.
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// What became of a process the runtime started (identified by pid + start time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    Running,
    /// Exited but not yet reaped by its parent; the pid (and so the process group id) is
    /// still reserved, which makes signalling the group safe.
    Zombie,
    /// No process with this pid.
    Gone,
    /// The pid belongs to a different process now: never signal it.
    Reused,
}

pub(crate) fn probe(pid: u32, start_ticks: u64) -> Probe {
    match read_stat(pid) {
        Ok(None) => Probe::Gone,
        Ok(Some(stat)) if stat.start_ticks != start_ticks => Probe::Reused,
        Ok(Some(stat)) if matches!(stat.state, 'Z' | 'X' | 'x') => Probe::Zombie,
        Ok(Some(_)) => Probe::Running,
        Err(e) => {
            // Claiming an exit we did not see could free GPUs still in use (invariant 1);
            // assuming it still runs only delays the report until /proc is readable again.
            tracing::warn!(pid, error = %e, "cannot read process state; assuming it still runs");
            Probe::Running
        }
    }
}

/// How a process ended, as `waitpid` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitStatus {
    Exited(i32),
    Signaled(i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reap {
    /// Not a child of this process (re-adopted after an agent restart, or already reaped).
    NotOurChild,
    StillRunning,
    Reaped(WaitStatus),
}

/// `waitpid(pid, WNOHANG)`: reaps `pid` if it is our exited child, so shims started in this
/// life do not stay zombies; returns at once in every case.
pub(crate) fn try_reap(pid: u32) -> Reap {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return Reap::NotOurChild;
    };
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid, writable c_int; waitpid has no other memory effects.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            return Reap::Reaped(if libc::WIFSIGNALED(status) {
                WaitStatus::Signaled(libc::WTERMSIG(status))
            } else {
                WaitStatus::Exited(libc::WEXITSTATUS(status))
            });
        }
        if rc == 0 {
            return Reap::StillRunning;
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return Reap::NotOurChild;
    }
}

/// Sends `signal` to every process of the group led by `pgid`. `Ok(false)`: the group has no
/// member left. Refuses group ids 0 and 1, which `killpg` would take as "my own group" and
/// "init's group".
pub(crate) fn signal_group(pgid: u32, signal: i32) -> io::Result<bool> {
    let group = libc::pid_t::try_from(pgid)
        .ok()
        .filter(|g| *g > 1)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("refusing to signal process group {pgid}"),
            )
        })?;
    // SAFETY: killpg only sends a signal; no memory is shared with the callee.
    if unsafe { libc::killpg(group, signal) } == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) {
        Ok(false)
    } else {
        Err(err)
    }
}

/// A pidfd of process `pid` (Linux 5.3), readable once that process has exited; `None` where
/// the kernel has none or the process is gone. Unlike the pid, it can never come to name
/// another process. Close-on-exec, so no later child inherits it.
pub(crate) fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a non-negative result is a descriptor we own and nothing else closes.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Waits until `fd` is readable (or has hung up): `Ok(false)` once `timeout` has passed
/// without it. Interrupted waits go on until the deadline.
pub(crate) fn wait_readable(
    fd: std::os::fd::RawFd,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pollfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        match unsafe { libc::poll(&mut pollfd, 1, left.as_millis() as libc::c_int) } {
            1.. => return Ok(true),
            0 => return Ok(false),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_command_names() {
        let text = "1234 (my (weird) cmd) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    555666 1000000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let stat = parse_stat(text).expect("parse");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.start_ticks, 555_666);
        assert_eq!(parse_stat("1234 (truncated) S 1"), None);
    }

    #[test]
    fn reads_own_stat_and_detects_reuse() {
        let me = std::process::id();
        let stat = read_stat(me).expect("read").expect("exists");
        assert_eq!(probe(me, stat.start_ticks), Probe::Running);
        assert_eq!(probe(me, stat.start_ticks + 1), Probe::Reused);
        // Pids are below /proc/sys/kernel/pid_max (at most 2^22), so this one never exists.
        assert_eq!(probe(u32::MAX - 1, 0), Probe::Gone);
    }

    #[test]
    fn refuses_to_signal_own_or_init_group() {
        assert!(signal_group(0, 0).is_err());
        assert!(signal_group(1, 0).is_err());
    }

    #[test]
    fn reaping_a_stranger_is_not_our_child() {
        assert_eq!(try_reap(1), Reap::NotOurChild);
    }
}
