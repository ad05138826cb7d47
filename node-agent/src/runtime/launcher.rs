//! The shim launcher: one long-lived, single-threaded process per agent that forks each
//! allocation's shim instead of the agent exec'ing a new shim program for every job.
//!
//! Why: an exec'd shim pays for the kernel's exec, the dynamic loader's relocations and
//! glibc's start-up probing of the CPU (`cpuid`, which traps to the hypervisor on a virtual
//! machine) before it does anything; on a 2-core host turning over 32 one-GPU jobs that was
//! a fifth of all CPU in `gpuctl bench e2e`. A fork of an already-started, small,
//! single-threaded process costs a fraction of that. The agent itself cannot fork shims: it
//! is multi-threaded (a fork would copy its page tables and could inherit locks held by
//! other threads).
//!
//! Process model: `agent ─spawn→ launcher ─fork→ shim ─spawn→ command`. Everything else
//! is as with an exec'd shim (see `shim.rs`): the shim leads its own process group, waits
//! for the go byte before starting the command, writes the exit file, and outlives the agent
//! and the launcher. The runtime finds shims by pid and start time, so a shim forked by a
//! launcher is supervised, stopped and re-adopted exactly like one the agent started.
//!
//! Protocol, one JSON object per line: the agent writes [`Request`]s to the launcher's stdin
//! and reads one [`Reply`] per request from its stdout. The launcher first writes
//! [`Reply::Ready`] with [`SHIM_PROTOCOL`], so an agent never uses a launcher from another
//! build. The go byte travels through the launcher: it holds the write end of each shim's
//! stdin pipe until [`Request::Go`]; if the agent (and so the launcher) dies before that,
//! the pipe closes and the shim exits without starting the command, as an exec'd one does.
//!
//! Exits: the shims are the launcher's children, so the launcher reaps them (no zombies)
//! and forwards each SIGCHLD to the agent, whose tick wakes on SIGCHLD as for its own
//! children. The exit itself is read from the exit file, as for re-adopted shims.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::process::wait_readable;
use super::shim::{SHIM_PROTOCOL, ShimArgs, run_shim};

/// The shim's argument that turns it into a launcher.
pub const LAUNCHER_FLAG: &str = "--launcher";

/// How long the agent waits for a launcher's reply before giving up on it (a launcher that
/// does not answer is killed and shims are exec'd directly again).
const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the agent asks of the launcher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Request {
    /// Fork a shim for one allocation; it waits for [`Request::Go`].
    Spawn(SpawnRequest),
    /// Release the shim `pid`: its command starts.
    Go(u32),
    /// Close shim `pid`'s go pipe without releasing it and SIGKILL it: it starts nothing.
    /// Killed here, where it cannot have been reaped yet (so the pid is still its own).
    Abort(u32),
}

/// One shim to fork: its arguments (as `shim` takes them), and what an exec'd shim would
/// have had from its spawn: environment and working directory. Its own diagnostics go to
/// the job's stderr log (`--stderr` among the arguments), as an exec'd shim's do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SpawnRequest {
    pub args: Vec<String>,
    /// The command's whole environment (nothing is inherited from the agent).
    pub env: Vec<(String, String)>,
    pub workdir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Reply {
    /// First line: the launcher runs and speaks this protocol.
    Ready {
        protocol: u64,
    },
    /// Done; for a spawn, the shim's pid.
    Ok(u32),
    Err(String),
}

// ---------------------------------------------------------------------------------------
// The agent's side.

/// A running launcher, owned by the runtime. Dropping it kills it; its shims carry on
/// (reparented), like the shims of an agent that exits, and those not yet released see
/// their go pipe close and start nothing.
#[derive(Debug)]
pub(crate) struct Launcher {
    child: Child,
    requests: ChildStdin,
    replies: BufReader<ChildStdout>,
}

impl Launcher {
    /// Starts `program args... --launcher STATE_DIR` and waits for its [`Reply::Ready`]. The
    /// state directory is there for whoever reads the command line (`ps`, or a test harness
    /// finding an agent's processes), as an exec'd shim's names its files there.
    pub(crate) fn start(program: &Path, args: &[String], state_dir: &Path) -> io::Result<Launcher> {
        let mut child = Command::new(program)
            .args(args)
            .arg(LAUNCHER_FLAG)
            .arg(state_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // Its own process group: a Ctrl-C meant for the agent's terminal does not reach
            // it (nor, as before, the shims, which lead groups of their own).
            .process_group(0)
            .spawn()?;
        let (Some(requests), Some(replies)) = (child.stdin.take(), child.stdout.take()) else {
            unreachable!("both were piped above");
        };
        let mut launcher = Launcher {
            child,
            requests,
            replies: BufReader::new(replies),
        };
        match launcher.read_reply() {
            Ok(Reply::Ready { protocol }) if protocol == SHIM_PROTOCOL => Ok(launcher),
            Ok(Reply::Ready { protocol }) => Err(io::Error::other(format!(
                "{} speaks shim protocol {protocol}, this agent {SHIM_PROTOCOL}",
                program.display()
            ))),
            Ok(other) => Err(io::Error::other(format!(
                "{} answered {other:?} instead of announcing itself",
                program.display()
            ))),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn spawn(&mut self, request: SpawnRequest) -> io::Result<u32> {
        self.call(&Request::Spawn(request))
    }

    pub(crate) fn go(&mut self, pid: u32) -> io::Result<()> {
        self.call(&Request::Go(pid)).map(|_| ())
    }

    pub(crate) fn abort(&mut self, pid: u32) -> io::Result<()> {
        self.call(&Request::Abort(pid)).map(|_| ())
    }

    fn call(&mut self, request: &Request) -> io::Result<u32> {
        let mut line = serde_json::to_vec(request).map_err(io::Error::other)?;
        line.push(b'\n');
        self.requests.write_all(&line)?;
        match self.read_reply()? {
            Reply::Ok(value) => Ok(value),
            Reply::Err(message) => Err(io::Error::other(message)),
            Reply::Ready { .. } => Err(io::Error::other("the launcher announced itself again")),
        }
    }

    fn read_reply(&mut self) -> io::Result<Reply> {
        if self.replies.buffer().is_empty()
            && !wait_readable(self.replies.get_ref().as_raw_fd(), REPLY_TIMEOUT)?
        {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the launcher did not answer within {}s",
                    REPLY_TIMEOUT.as_secs()
                ),
            ));
        }
        let mut line = String::new();
        if self.replies.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the launcher exited",
            ));
        }
        serde_json::from_str(&line)
            .map_err(|e| io::Error::other(format!("the launcher answered {:?}: {e}", line.trim())))
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        // Killed rather than sent EOF: it may be dropped because it stopped answering.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// The launcher's side.

/// Entry point of `shim --launcher`. Returns when the agent closes its stdin.
pub(crate) fn launcher_main() -> i32 {
    match serve() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("node-agent shim launcher: {e}");
            1
        }
    }
}

fn serve() -> io::Result<()> {
    // SIGCHLD is read from a signalfd, so it must not be delivered as a signal. Every shim
    // unblocks it again before anything else (see `become_shim`).
    let sigchld = block_sigchld_into_signalfd()?;
    // Requests and replies use their own handles on fds 0 and 1 rather than std's global
    // stdin/stdout: a forked shim reads its go byte through std's stdin, which must not hold
    // bytes buffered here.
    // SAFETY: fds 0 and 1 are this process's stdin and stdout, open for its whole life; the
    // handles are never dropped in a forked shim (it leaves with `_exit`).
    let mut requests = BufReader::new(unsafe { File::from_raw_fd(0) });
    let mut replies = unsafe { File::from_raw_fd(1) };
    let mut go_pipes: HashMap<u32, OwnedFd> = HashMap::new();
    send(
        &mut replies,
        &Reply::Ready {
            protocol: SHIM_PROTOCOL,
        },
    )?;
    loop {
        if requests.buffer().is_empty() {
            let mut fds = [
                libc::pollfd {
                    fd: 0,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: sigchld.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if fds[1].revents != 0 {
                drain(&sigchld);
                reap_shims(&mut go_pipes);
            }
            if fds[0].revents == 0 {
                continue;
            }
        }
        let mut line = String::new();
        if requests.read_line(&mut line)? == 0 {
            return Ok(()); // The agent is gone.
        }
        let reply = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Spawn(spawn)) => match fork_shim(spawn) {
                Ok((pid, go)) => {
                    go_pipes.insert(pid, go);
                    Reply::Ok(pid)
                }
                Err(e) => Reply::Err(format!("cannot fork a shim: {e}")),
            },
            Ok(Request::Go(pid)) => match go_pipes.remove(&pid) {
                Some(go) => match File::from(go).write_all(b"G") {
                    Ok(()) => Reply::Ok(pid),
                    Err(e) => Reply::Err(format!("cannot release shim {pid}: {e}")),
                },
                None => Reply::Err(format!("shim {pid} is not waiting to be released")),
            },
            Ok(Request::Abort(pid)) => {
                if go_pipes.remove(&pid).is_some() {
                    // SAFETY: kill(2) of our own child, not reaped yet: it still has its go
                    // pipe, which `reap_shims` drops when it reaps it.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
                Reply::Ok(pid)
            }
            Err(e) => Reply::Err(format!("cannot read request {:?}: {e}", line.trim())),
        };
        send(&mut replies, &reply)?;
    }
}

fn send(out: &mut File, reply: &Reply) -> io::Result<()> {
    let mut line = serde_json::to_vec(reply).map_err(io::Error::other)?;
    line.push(b'\n');
    out.write_all(&line)
}

fn block_sigchld_into_signalfd() -> io::Result<OwnedFd> {
    // SAFETY: the set is initialised by sigemptyset before use; signalfd returns a new
    // descriptor or -1.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

fn drain(signalfd: &OwnedFd) {
    let mut buf = [0u8; 128 * 8];
    // SAFETY: reads into a local buffer of the given size; non-blocking descriptor.
    while unsafe { libc::read(signalfd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
}

/// Reaps every exited shim, drops the go pipe of any that died unreleased, and tells the
/// agent (SIGCHLD to the parent) that it should look at its allocations.
fn reap_shims(go_pipes: &mut HashMap<u32, OwnedFd>) {
    let mut any = false;
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            break;
        }
        go_pipes.remove(&(pid as u32));
        any = true;
    }
    if any {
        // SAFETY: kill(2) of our parent with a harmless signal. If the agent is gone, the
        // parent is init or a subreaper, which ignores an unexpected SIGCHLD.
        unsafe { libc::kill(libc::getppid(), libc::SIGCHLD) };
    }
}

/// Forks one shim; returns its pid and the write end of its go pipe.
fn fork_shim(request: SpawnRequest) -> io::Result<(u32, OwnedFd)> {
    let args = ShimArgs::parse(&request.args).map_err(io::Error::other)?;
    // The forked shim's command line, as an exec'd shim's would read: this program as it
    // was started, before `--launcher`, then the shim's arguments.
    let mut title = Vec::new();
    for arg in std::env::args_os()
        .take_while(|a| a != LAUNCHER_FLAG)
        .chain(request.args.iter().map(Into::into))
    {
        title.extend_from_slice(arg.as_bytes());
        title.push(0);
    }
    // Everything the child needs is prepared before the fork, so that the child only makes
    // system calls before it becomes the shim.
    let workdir = c_path(&request.workdir)?;
    let stderr = c_path(&args.stderr)?;
    let devnull = c_path(Path::new("/dev/null"))?;
    let mut ends = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are new descriptors owned here.
    let (go_read, go_write) =
        unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    // SAFETY: this process is single-threaded (the launcher never starts a thread), so the
    // child may allocate and run ordinary code; it never returns into the serve loop.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        let code = match become_shim(&go_read, &workdir, &stderr, &devnull) {
            Ok(()) => {
                set_command_line(&title);
                run_shim(args, Some(request.env))
            }
            Err(e) => {
                eprintln!("node-agent shim: cannot set up the forked shim: {e}");
                super::shim::EXIT_USAGE
            }
        };
        // SAFETY: leaves without running the launcher's exit path (its buffers, its fds).
        unsafe { libc::_exit(code) };
    }
    // The same as the child's own setpgid: whichever runs first makes the group, so a stop
    // signalled to the group right after this reply reaches the shim.
    // SAFETY: setpgid on our own child.
    unsafe { libc::setpgid(pid, pid) };
    Ok((pid as u32, go_write))
}

/// In the forked child: what an exec'd shim gets from its spawn.
fn become_shim(
    go_read: &OwnedFd,
    workdir: &CString,
    stderr: &CString,
    devnull: &CString,
) -> io::Result<()> {
    let check = |r: libc::c_int| {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    };
    // SAFETY: plain system calls on descriptors and paths owned by this (child) process.
    unsafe {
        check(libc::setpgid(0, 0))?;
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        check(libc::sigprocmask(
            libc::SIG_SETMASK,
            &empty,
            std::ptr::null_mut(),
        ))?;
        check(libc::dup2(go_read.as_raw_fd(), 0))?;
        let null = check(libc::open(
            devnull.as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        ))?;
        check(libc::dup2(null, 1))?;
        let err = check(libc::open(
            stderr.as_ptr(),
            libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_CLOEXEC,
            0o666 as libc::c_uint,
        ))?;
        check(libc::dup2(err, 2))?;
        // Nothing of the launcher's stays open in the shim: not its request and reply pipes,
        // not the go pipes of other shims (whose release must not wait for this one).
        check(libc::close_range(3, libc::c_uint::MAX, 0))?;
        check(libc::chdir(workdir.as_ptr()))?;
    }
    Ok(())
}

/// Points this process's command line (`/proc/self/cmdline`, what `ps` shows) at `title`:
/// NUL-separated arguments that stay in memory for the rest of the process's life. Needs
/// CAP_SYS_RESOURCE (an agent running as root has it); without it the shim keeps the
/// launcher's command line, which still names the agent's state directory.
fn set_command_line(title: &[u8]) {
    let start = title.as_ptr() as libc::c_ulong;
    let end = start + title.len() as libc::c_ulong;
    // SAFETY: prctl only records the addresses; `title` is never freed in this process (it
    // ends with `_exit` before the frame holding it returns). The start is set first: the
    // kernel checks start <= end against the current end, and heap addresses lie below the
    // stack where the original arguments are.
    unsafe {
        if libc::prctl(libc::PR_SET_MM, libc::PR_SET_MM_ARG_START, start, 0, 0) == 0 {
            libc::prctl(libc::PR_SET_MM, libc::PR_SET_MM_ARG_END, end, 0, 0);
        }
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::other(format!("{} contains a NUL byte", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip() {
        let spawn = Request::Spawn(SpawnRequest {
            args: vec![
                "--exit-file".into(),
                "/x".into(),
                "--".into(),
                "true".into(),
            ],
            env: vec![("PATH".into(), "/bin".into())],
            workdir: "/tmp".into(),
        });
        for request in [spawn, Request::Go(7), Request::Abort(8)] {
            let line = serde_json::to_string(&request).unwrap();
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), request);
        }
        for reply in [
            Reply::Ready { protocol: 3 },
            Reply::Ok(9),
            Reply::Err("no".into()),
        ] {
            let line = serde_json::to_string(&reply).unwrap();
            assert_eq!(serde_json::from_str::<Reply>(&line).unwrap(), reply);
        }
    }
}
