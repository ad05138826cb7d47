//! The supervisor shim: `node-agent shim [--await-go] --exit-file F --stdout F --stderr F --
//! command...`. One shim runs per allocation, between the agent and the command, so that the
//! command outlives the agent and its end is still recorded when no agent is running.
//!
//! What it does, in order:
//! 1. leads a process group of its own (the runtime starts it as one; started by hand, it
//!    becomes a session leader), so the whole allocation is one process group, apart from
//!    the agent's: a restart or SIGKILL of the agent, or a Ctrl-C in the agent's terminal,
//!    does not touch it;
//! 2. with `--await-go`, reads one byte from stdin and starts nothing unless it is `G`. The
//!    runtime sends it only after persisting the shim's pid, so a command never runs without
//!    a record of it (an agent crash in between closes the pipe: EOF, the shim exits);
//! 3. spawns the command in its process group, stdin `/dev/null`, stdout/stderr appended to
//!    the log files;
//! 4. ignores SIGTERM/SIGINT/SIGHUP, so a SIGTERM sent to the group stops the command but not
//!    the shim, which then records how the command ended. The signals are blocked *before*
//!    the command is started and only ignored after it: the command starts with default
//!    dispositions and an empty mask (`spawn.rs`), and a signal arriving in between stays
//!    pending and is then discarded rather than killing the shim;
//! 5. waits for the command and writes its status atomically to the exit file;
//! 6. SIGKILLs its own process group, itself included, so processes the command left behind
//!    (daemonised helpers, background jobs) cannot keep using the allocation's GPUs after its
//!    exit is reported (invariant 1).

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::process::now_ms;
use super::record::{ChildStatus, ShimExitRecord, write_atomic_via};
use super::spawn::{ConfinedCommand, spawn};

/// Shim exit codes other than 0. The runtime only shows them in a `Vanished` reason: what
/// matters is the exit file.
pub(crate) const EXIT_USAGE: i32 = 2;
const EXIT_NOT_RELEASED: i32 = 3;
const EXIT_NO_RECORD: i32 = 4;

const USAGE: &str = "usage: node-agent shim [--await-go] --exit-file FILE --stdout FILE --stderr FILE -- COMMAND [ARG...]";

/// Signals the shim must outlive to record how its command ended.
const SHIELDED_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShimArgs {
    pub await_go: bool,
    pub exit_file: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub command: Vec<String>,
    /// The agent's lease file; when the expiry it holds passes, the shim stops the command.
    pub lease_file: Option<PathBuf>,
    /// SIGTERM → SIGKILL grace when the shim fences the command itself.
    pub fence_grace: Duration,
    /// The allocation's cgroup: the command joins it before its first instruction, and
    /// everything left in it is killed when the command ends (whatever session or process
    /// group it moved to).
    pub cgroup: Option<crate::cgroup::AllocationCgroup>,
}

impl ShimArgs {
    /// The arguments the runtime passes (after `shim_args`); the inverse of [`Self::parse`].
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.await_go {
            args.push("--await-go".to_string());
        }
        for (flag, path) in [
            ("--exit-file", &self.exit_file),
            ("--stdout", &self.stdout),
            ("--stderr", &self.stderr),
        ] {
            args.push(flag.to_string());
            args.push(path.to_string_lossy().into_owned());
        }
        if let Some(lease) = &self.lease_file {
            args.push("--lease-file".to_string());
            args.push(lease.to_string_lossy().into_owned());
            args.push("--fence-grace-ms".to_string());
            args.push(self.fence_grace.as_millis().to_string());
        }
        if let Some(cg) = &self.cgroup {
            args.push("--cgroup".to_string());
            args.push(serde_json::to_string(cg).expect("a cgroup serializes"));
        }
        args.push("--".to_string());
        args.extend(self.command.iter().cloned());
        args
    }

    pub(crate) fn parse(args: &[String]) -> Result<ShimArgs, String> {
        let mut await_go = false;
        let (mut exit_file, mut stdout, mut stderr, mut lease_file) = (None, None, None, None);
        let mut fence_grace = Duration::from_secs(30);
        let mut cgroup = None;
        let mut iter = args.iter();
        loop {
            let Some(arg) = iter.next() else {
                return Err("missing `--` before the command".to_string());
            };
            let slot = match arg.as_str() {
                "--" => break,
                "--await-go" => {
                    await_go = true;
                    continue;
                }
                "--exit-file" => &mut exit_file,
                "--stdout" => &mut stdout,
                "--stderr" => &mut stderr,
                "--lease-file" => &mut lease_file,
                "--fence-grace-ms" => {
                    let value = iter.next().ok_or("option --fence-grace-ms needs a value")?;
                    let ms: u64 = value
                        .parse()
                        .map_err(|_| format!("--fence-grace-ms {value:?} is not a number"))?;
                    fence_grace = Duration::from_millis(ms);
                    continue;
                }
                "--cgroup" => {
                    let value = iter.next().ok_or("option --cgroup needs a value")?;
                    cgroup = Some(
                        serde_json::from_str(value)
                            .map_err(|e| format!("--cgroup {value:?} is not a cgroup: {e}"))?,
                    );
                    continue;
                }
                other => return Err(format!("unknown option {other:?}")),
            };
            let value = iter
                .next()
                .ok_or_else(|| format!("option {arg} needs a value"))?;
            *slot = Some(PathBuf::from(value));
        }
        let command: Vec<String> = iter.cloned().collect();
        if command.is_empty() {
            return Err("no command after `--`".to_string());
        }
        Ok(ShimArgs {
            await_go,
            exit_file: exit_file.ok_or("--exit-file is required")?,
            stdout: stdout.ok_or("--stdout is required")?,
            stderr: stderr.ok_or("--stderr is required")?,
            command,
            lease_file,
            fence_grace,
            cgroup,
        })
    }
}

/// Identifies the shim's interface with the agent (its arguments, the exit record): a hash of
/// the sources that define it, so an agent never starts a dedicated `gpucp-shim` left over
/// from another build (see [`shim_command`]).
pub const SHIM_PROTOCOL: u64 = fnv1a(include_bytes!("shim.rs"))
    ^ fnv1a(include_bytes!("record.rs")).rotate_left(21)
    ^ fnv1a(include_bytes!("process.rs")).rotate_left(42)
    ^ fnv1a(include_bytes!("../cgroup/mod.rs")).rotate_left(13)
    ^ fnv1a(include_bytes!("launcher.rs")).rotate_left(34);

/// `gpucp-shim --protocol` prints [`SHIM_PROTOCOL`].
pub const SHIM_PROTOCOL_FLAG: &str = "--protocol";

/// File name of the dedicated shim executable.
pub const SHIM_EXECUTABLE: &str = "gpucp-shim";

const fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash
}

/// The program and leading arguments an agent whose executable is `own_exe` starts as each
/// allocation's shim: `gpucp-shim` beside it when that answers `--protocol` with this build's
/// [`SHIM_PROTOCOL`], else `own_exe` with `subcommand` (the same code, in a larger binary).
/// Checked once, when the agent starts.
pub fn shim_command(own_exe: PathBuf, subcommand: &str) -> (PathBuf, Vec<String>) {
    let fallback = |why: String| {
        tracing::info!(
            program = %own_exe.display(),
            "workload shim: {why}; using the agent's own executable"
        );
        (own_exe.clone(), vec![subcommand.to_owned()])
    };
    let Some(dedicated) = own_exe.parent().map(|dir| dir.join(SHIM_EXECUTABLE)) else {
        return fallback("the agent's executable has no directory".into());
    };
    if !dedicated.is_file() {
        return fallback(format!("no {SHIM_EXECUTABLE} beside it"));
    }
    let answer = Command::new(&dedicated)
        .arg(SHIM_PROTOCOL_FLAG)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    match answer {
        Ok(out) if out.status.success() => {
            let theirs = String::from_utf8_lossy(&out.stdout);
            if theirs.trim() == SHIM_PROTOCOL.to_string() {
                tracing::info!(program = %dedicated.display(), "workload shim");
                (dedicated, Vec::new())
            } else {
                fallback(format!(
                    "{} was built from other sources (protocol {}, this agent's {SHIM_PROTOCOL})",
                    dedicated.display(),
                    theirs.trim()
                ))
            }
        }
        Ok(out) => fallback(format!(
            "{} --protocol failed ({})",
            dedicated.display(),
            out.status
        )),
        Err(e) => fallback(format!("{} does not run: {e}", dedicated.display())),
    }
}

/// Entry point of the hidden `node-agent shim ...` subcommand; `args` excludes `shim`.
/// Returns the shim's exit code (in practice it usually ends by its own group SIGKILL, see
/// the module documentation).
pub fn shim_main(args: Vec<String>) -> i32 {
    // `--launcher [STATE_DIR]`: the directory only labels the launcher's command line.
    if (1..=2).contains(&args.len()) && args[0] == super::launcher::LAUNCHER_FLAG {
        return super::launcher::launcher_main();
    }
    match ShimArgs::parse(&args) {
        Ok(args) => run_shim(args, None),
        Err(message) => {
            eprintln!("node-agent shim: {message}\n{USAGE}");
            EXIT_USAGE
        }
    }
}

/// The shim's steps 1 to 6 (see the module documentation). `env`: the command's whole
/// environment, where the shim's own is not it (a shim forked by the launcher).
pub(crate) fn run_shim(args: ShimArgs, env: Option<Vec<(String, String)>>) -> i32 {
    become_group_leader();
    if args.await_go {
        match await_go() {
            Ok(true) => {}
            Ok(false) => {
                eprintln!(
                    "node-agent shim: the agent went away before confirming the launch; the \
                     command was not started"
                );
                return EXIT_NOT_RELEASED;
            }
            Err(e) => {
                eprintln!("node-agent shim: cannot read the launch confirmation: {e}");
                return EXIT_NOT_RELEASED;
            }
        }
    }

    let (status, fenced) = run_command(&args, env);
    // Before the exit is recorded: once the agent reports it, the allocation's GPUs are
    // placed again, and nothing of this job may still hold them (invariant 1).
    if let Some(cg) = &args.cgroup
        && let Err(e) = cg.kill_all()
    {
        eprintln!("node-agent shim: stopping what the command left in its cgroup failed: {e}");
    }
    let record = ShimExitRecord {
        status,
        at_ms: now_ms(),
        fenced,
    };
    // The job's log directory (stdout's), where the temporary file goes: see
    // `write_atomic_via`.
    let job_dir = args.stdout.parent().unwrap_or(Path::new("."));
    let code = match serde_json::to_vec(&record)
        .map_err(io::Error::other)
        .and_then(|bytes| write_atomic_via(job_dir, &args.exit_file, &bytes))
    {
        Ok(()) => 0,
        Err(e) => {
            eprintln!(
                "node-agent shim: cannot write exit file {}: {e}",
                args.exit_file.display()
            );
            EXIT_NO_RECORD
        }
    };
    kill_leftovers();
    code
}

/// Makes the shim the leader of its own process group (see step 1).
fn become_group_leader() {
    // SAFETY: getpgid/getpid/setsid take no pointers and only affect this process.
    unsafe {
        if libc::getpgid(0) == libc::getpid() {
            return; // The runtime started us leading a process group of our own.
        }
        if libc::setsid() < 0 {
            // Only fails when we already lead a process group (started by an interactive
            // shell); the group is then ours anyway.
            eprintln!(
                "node-agent shim: setsid failed: {}",
                io::Error::last_os_error()
            );
        }
    }
}

fn await_go() -> io::Result<bool> {
    let mut byte = [0u8; 1];
    loop {
        match io::stdin().lock().read(&mut byte) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(byte[0] == b'G'),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Steps 3 to 5: runs the command and returns how it ended. A command that cannot be started
/// ends like it would in a shell: 127 (not found) or 126 (not executable), with the reason
/// in the stderr log.
/// Whether the agent's lease, as published in `path`, has expired. A missing or unreadable
/// file is no evidence of expiry (the agent may be writing it): keep running.
fn lease_expired(path: &std::path::Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .is_some_and(|expires_at_ms| now_ms() > expires_at_ms)
}

/// Runs the command; returns how it ended and whether the shim fenced it (lease expired).
fn run_command(args: &ShimArgs, env: Option<Vec<(String, String)>>) -> (ChildStatus, bool) {
    let open_log = |path: &PathBuf| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| format!("cannot open log file {}: {e}", path.display()))
    };
    let logs = open_log(&args.stdout).and_then(|out| Ok((out, open_log(&args.stderr)?)));
    let (stdout, stderr) = match logs {
        Ok(files) => files,
        Err(message) => {
            eprintln!("node-agent shim: {message}");
            return (ChildStatus::Exited { code: 126 }, false);
        }
    };
    let join = args
        .cgroup
        .as_ref()
        .map(crate::cgroup::AllocationCgroup::procs_files_c)
        .unwrap_or_default();
    // The command joins the allocation's cgroup before its first instruction (a command that
    // cannot be confined does not run: reported as 126) and starts with the shielded signals
    // unblocked and at their default disposition: a job that traps SIGTERM to checkpoint
    // must see it.
    let request = ConfinedCommand {
        args: &args.command,
        env: env.as_deref(),
        cgroup_procs: &join,
        stdout: &stdout,
        stderr: &stderr,
    };
    let previous_mask = block_shielded_signals();
    let spawned = spawn(&request);
    if spawned.is_ok() {
        ignore_shielded_signals();
    }
    restore_mask(previous_mask);
    drop((stdout, stderr));

    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            eprintln!("node-agent shim: cannot start {:?}: {e}", args.command[0]);
            let code = if e.kind() == io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            return (ChildStatus::Exited { code }, false);
        }
    };
    // Without a lease file, block in wait(); with one, poll so the lease can be checked,
    // waking as soon as the command exits (not only every LEASE_POLL).
    let exit_fd = args
        .lease_file
        .as_ref()
        .and_then(|_| super::process::pidfd_open(child.id()));
    let mut fenced_at: Option<std::time::Instant> = None;
    let mut killed = false;
    loop {
        let waited = match &args.lease_file {
            None => child.wait().map(Some),
            Some(_) => child.try_wait(),
        };
        match waited {
            Ok(Some(status)) => {
                use std::os::unix::process::ExitStatusExt;
                let status = match (status.code(), status.signal()) {
                    (Some(code), _) => ChildStatus::Exited { code },
                    (None, Some(signal)) => ChildStatus::Signaled { signal },
                    // Stopped/continued are not reported by wait(); keep a defined answer.
                    (None, None) => ChildStatus::Exited { code: -1 },
                };
                return (status, fenced_at.is_some());
            }
            Ok(None) => {
                if let Some(lease) = &args.lease_file {
                    match fenced_at {
                        None if lease_expired(lease) => {
                            eprintln!(
                                "node-agent shim: the agent's lease expired; stopping the command (self-fencing)"
                            );
                            // SIGTERM to the whole group; the shim itself ignores it.
                            // SAFETY: kill(2) on our own process group.
                            unsafe { libc::kill(0, libc::SIGTERM) };
                            fenced_at = Some(std::time::Instant::now());
                        }
                        Some(t) if !killed && t.elapsed() >= args.fence_grace => {
                            // SAFETY: kill(2) on our own child; the rest of the group is
                            // killed after the exit record is written (kill_leftovers).
                            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
                            killed = true;
                        }
                        _ => {}
                    }
                }
                wait_for_exit(exit_fd.as_ref(), LEASE_POLL);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Cannot happen for our own child; without a status we cannot claim one.
                eprintln!("node-agent shim: waiting for the command failed: {e}");
                return (ChildStatus::Exited { code: -1 }, fenced_at.is_some());
            }
        }
    }
}

/// How often a shim with a lease file checks the lease and its command.
const LEASE_POLL: Duration = Duration::from_millis(100);

/// Sleeps until the command exits or `timeout` passes, whichever is first, so that a short
/// job's exit is recorded at once rather than up to a whole poll interval later.
fn wait_for_exit(exit_fd: Option<&OwnedFd>, timeout: Duration) {
    match exit_fd {
        // A failed poll returns early: the caller checks the child and waits again.
        Some(fd) => drop(super::process::wait_readable(fd.as_raw_fd(), timeout)),
        None => std::thread::sleep(timeout),
    }
}

fn shielded_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set before sigaddset reads it; both only write
    // into the local `set`.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in SHIELDED_SIGNALS {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

fn block_shielded_signals() -> libc::sigset_t {
    let set = shielded_set();
    // SAFETY: both pointers refer to valid sigset_t values owned by this frame.
    unsafe {
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut previous);
        previous
    }
}

fn restore_mask(previous: libc::sigset_t) {
    // SAFETY: `previous` is a valid sigset_t; a null old-set pointer is allowed.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
    }
}

fn ignore_shielded_signals() {
    for signal in SHIELDED_SIGNALS {
        // SAFETY: SIG_IGN installs no handler code; pending instances are discarded.
        unsafe {
            libc::signal(signal, libc::SIG_IGN);
        }
    }
}

/// Step 6: SIGKILL the whole group, the shim included, once the exit is recorded.
fn kill_leftovers() {
    // SAFETY: getpgrp/getpid/kill take no pointers.
    unsafe {
        // Only when we lead the group, so a shim started by hand inside someone else's
        // process group never kills that group.
        if libc::getpgrp() == libc::getpid() {
            libc::kill(0, libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn parses_and_round_trips() {
        let args = ShimArgs::parse(&strings(&[
            "--await-go",
            "--exit-file",
            "/s/1.exit.json",
            "--stdout",
            "/s/out",
            "--stderr",
            "/s/err",
            "--",
            "sh",
            "-c",
            "echo --stdout",
        ]))
        .expect("parse");
        assert!(args.await_go);
        assert_eq!(args.exit_file, PathBuf::from("/s/1.exit.json"));
        assert_eq!(args.command, strings(&["sh", "-c", "echo --stdout"]));
        assert_eq!(ShimArgs::parse(&args.to_args()), Ok(args));
    }

    #[test]
    fn rejects_incomplete_arguments() {
        assert!(ShimArgs::parse(&strings(&["--exit-file", "x", "--", "true"])).is_err());
        assert!(
            ShimArgs::parse(&strings(&[
                "--exit-file",
                "x",
                "--stdout",
                "o",
                "--stderr",
                "e",
                "--"
            ]))
            .is_err()
        );
        assert!(ShimArgs::parse(&strings(&["--bogus", "--", "true"])).is_err());
        assert!(ShimArgs::parse(&strings(&["--stdout"])).is_err());
    }
}
