//! Starting a shim's command: in the allocation's cgroups from its first instruction, with
//! every signal at its default disposition and an empty signal mask, stdin from `/dev/null`,
//! stdout and stderr to the job's logs, and the program found on `PATH` as `execvp` finds it
//! (a file without a `#!` line runs under `/bin/sh`).
//!
//! Why not `std::process::Command`: joining the cgroups has to happen in the child between
//! clone and exec (a `pre_exec` hook), and with a hook std *forks*: the kernel copies the
//! shim's page tables, and shim and child both take copy-on-write faults until the child
//! execs, which then tears the copy down. Here the child shares the shim's memory (`clone`
//! with `CLONE_VM | CLONE_VFORK`, which is how glibc's `posix_spawn` starts its children),
//! runs on a stack of its own, and makes only system calls on data prepared before the clone;
//! the shim is suspended until the child has exec'd or exited. The shims' CPU per job fell by
//! 16–20% (docs/PERFORMANCE.md, twelfth session). The child has its own copy of the
//! signal dispositions (no `CLONE_SIGHAND`) and of the descriptor table (no `CLONE_FILES`),
//! and every signal is blocked across the clone, so no handler of the shim ever runs on the
//! child's side.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// Where `execvp` looks when `PATH` is unset (glibc's default).
const DEFAULT_PATH: &[u8] = b"/bin:/usr/bin";

/// The child's stack: far more than the system call wrappers it runs need.
const CHILD_STACK_BYTES: usize = 256 * 1024;

/// What to start and how (not the launcher's `SpawnRequest`, which starts a shim).
pub(crate) struct ConfinedCommand<'a> {
    /// `args[0]` is the program: a path, or a name looked up on `PATH`.
    pub args: &'a [String],
    /// The command's whole environment; `None`: the shim's own.
    pub env: Option<&'a [(String, String)]>,
    /// `cgroup.procs` files the child writes itself into before it execs.
    pub cgroup_procs: &'a [CString],
    pub stdout: &'a File,
    pub stderr: &'a File,
}

/// A started command, waited for by pid.
#[derive(Debug)]
pub(crate) struct SpawnedChild {
    pid: libc::pid_t,
}

impl SpawnedChild {
    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// Blocks until the command exits.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.waitpid(0)? {
                return Ok(status);
            }
        }
    }

    /// The command's status if it has exited, without blocking.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.waitpid(libc::WNOHANG)
    }

    fn waitpid(&self, flags: libc::c_int) -> io::Result<Option<ExitStatus>> {
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid, writable c_int.
        let rc = unsafe { libc::waitpid(self.pid, &mut status, flags) };
        match rc {
            0 => Ok(None),
            rc if rc == self.pid => Ok(Some(ExitStatus::from_raw(status))),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
        }
    }
}

/// Everything the child touches, built before the clone: it must not allocate (the
/// allocator's locks may be held by the suspended shim), so every string and pointer array
/// is ready here.
struct ChildPlan<'a> {
    /// Paths to try in order (one for a program named by path).
    candidates: Vec<CString>,
    /// `argv` as pointers, NULL-terminated, into `args`.
    argv: Vec<*const libc::c_char>,
    /// `/bin/sh <candidate> args[1..]`, NULL-terminated; slot 1 is filled in by the child
    /// with the candidate that failed with `ENOEXEC`.
    sh_argv: Vec<*const libc::c_char>,
    /// `envp`, NULL-terminated; `None`: the shim's `environ`.
    envp: Option<Vec<*const libc::c_char>>,
    /// Joined with `cgroup::join_current_process`, which only opens, writes and closes.
    cgroup_procs: &'a [CString],
    dev_null: libc::c_int,
    stdout: libc::c_int,
    stderr: libc::c_int,
    /// Set by the child when it could not exec: the `errno`. Read by the shim once the clone
    /// returns (`CLONE_VFORK`: the child has exec'd or exited by then).
    error: libc::c_int,
}

static SH: &[u8] = b"/bin/sh\0";

/// Signals the kernel knows (`_NSIG` on x86-64 and arm64) and the size of its signal set.
const KERNEL_SIGNALS: libc::c_int = 64;
const KERNEL_SIGSET_BYTES: libc::size_t = 8;

/// Starts the command. An error is what exec (or joining the cgroups) failed with; the child
/// is reaped before it is returned. `NotFound` means no candidate existed, as from `Command`.
pub(crate) fn spawn(request: &ConfinedCommand) -> io::Result<SpawnedChild> {
    let program = request
        .args
        .first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no command"))?;
    let cstring = |bytes: &[u8]| {
        CString::new(bytes).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "an argument or environment variable contains a NUL byte",
            )
        })
    };
    let args: Vec<CString> = request
        .args
        .iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<io::Result<_>>()?;
    let env: Option<Vec<CString>> = request
        .env
        .map(|vars| {
            vars.iter()
                .map(|(k, v)| cstring(format!("{k}={v}").as_bytes()))
                .collect::<io::Result<_>>()
        })
        .transpose()?;
    let path_var: Option<OsString> = match request.env {
        Some(vars) => vars
            .iter()
            .rev()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| OsString::from(v)),
        None => std::env::var_os("PATH"),
    };
    let candidates = candidates(program.as_bytes(), path_var.as_deref())
        .into_iter()
        .map(|c| cstring(&c))
        .collect::<io::Result<Vec<_>>>()?;
    if candidates.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::ENOENT));
    }
    let dev_null = File::open("/dev/null")?;

    let nul_terminated = |strings: &[CString]| -> Vec<*const libc::c_char> {
        strings
            .iter()
            .map(|s| s.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let argv = nul_terminated(&args);
    let mut sh_argv = vec![SH.as_ptr().cast::<libc::c_char>(), std::ptr::null()];
    sh_argv.extend(args.iter().skip(1).map(|a| a.as_ptr()));
    sh_argv.push(std::ptr::null());
    let mut plan = ChildPlan {
        candidates,
        argv,
        sh_argv,
        envp: env.as_deref().map(nul_terminated),
        cgroup_procs: request.cgroup_procs,
        dev_null: dev_null.as_raw_fd(),
        stdout: request.stdout.as_raw_fd(),
        stderr: request.stderr.as_raw_fd(),
        error: 0,
    };

    let mut stack = vec![0u8; CHILD_STACK_BYTES];
    // The stack grows down on every architecture this runs on; 16-byte aligned top.
    let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
    let all = full_signal_set();
    // SAFETY: `previous` is written by pthread_sigmask before it is read.
    let mut previous: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid sigset pointers owned by this frame.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous) };
    // SAFETY: `child_main` runs on `stack` (alive until the clone returns, which with
    // CLONE_VFORK is after the child has exec'd or exited) and only reads `plan`, which
    // outlives the call, and writes its `error` field; everything it calls is a system call
    // wrapper that is async-signal-safe.
    let pid = unsafe {
        libc::clone(
            child_main,
            top as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&mut plan as *mut ChildPlan<'_>).cast(),
        )
    };
    let clone_error = io::Error::last_os_error();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut()) };
    drop(stack);
    drop(dev_null);
    if pid < 0 {
        return Err(clone_error);
    }
    // SAFETY: the child has exec'd or exited (CLONE_VFORK); nothing else writes `error`.
    let error = unsafe { std::ptr::read_volatile(&plan.error) };
    let mut child = SpawnedChild { pid };
    if error != 0 {
        let _ = child.wait();
        return Err(io::Error::from_raw_os_error(error));
    }
    Ok(child)
}

fn full_signal_set() -> libc::sigset_t {
    // SAFETY: sigfillset initialises the whole set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        set
    }
}

/// The paths `execvp` would try for `program`: itself if it names a path (contains `/`),
/// else `DIR/program` for each directory of `path` (`/bin:/usr/bin` when unset; an empty
/// entry is the current directory).
fn candidates(program: &[u8], path: Option<&OsStr>) -> Vec<Vec<u8>> {
    if program.is_empty() {
        return Vec::new();
    }
    if program.contains(&b'/') {
        return vec![program.to_vec()];
    }
    let path = path.map_or(DEFAULT_PATH.to_vec(), |p| p.as_bytes().to_vec());
    path.split(|&b| b == b':')
        .map(|dir| {
            let dir = if dir.is_empty() { &b"."[..] } else { dir };
            let mut full = dir.to_vec();
            if !full.ends_with(b"/") {
                full.push(b'/');
            }
            full.extend_from_slice(program);
            full
        })
        .collect()
}

/// The child, between clone and exec. Only system call wrappers, on `plan`'s prepared data.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildPlan` the parent keeps alive and does not touch until this
    // child has exec'd or exited (CLONE_VFORK).
    let plan = unsafe { &mut *arg.cast::<ChildPlan<'_>>() };
    // SAFETY: each call below is an async-signal-safe system call wrapper on pointers into
    // `plan`, whose strings are NUL-terminated and arrays NULL-terminated.
    unsafe {
        let fail_with = |plan: &mut ChildPlan<'_>, errno: libc::c_int| -> ! {
            std::ptr::write_volatile(&mut plan.error, if errno == 0 { libc::EIO } else { errno });
            libc::_exit(127)
        };
        let fail = |plan: &mut ChildPlan<'_>| -> ! { fail_with(plan, *libc::__errno_location()) };
        // Into the allocation's cgroups first: a command that cannot be confined does not run.
        if let Err(e) = crate::cgroup::join_current_process(plan.cgroup_procs) {
            fail_with(plan, e.raw_os_error().unwrap_or(0));
        }
        for (from, to) in [(plan.dev_null, 0), (plan.stdout, 1), (plan.stderr, 2)] {
            // dup2 clears close-on-exec on `to`; when `from == to` it does nothing, so the
            // flag is cleared by hand.
            let ok = if from == to {
                libc::fcntl(to, libc::F_SETFD, 0) == 0
            } else {
                libc::dup2(from, to) == to
            };
            if !ok {
                fail(plan);
            }
        }
        // Every disposition back to the default: an ignored signal stays ignored across
        // exec (Rust programs ignore SIGPIPE; the shim ignores SIGTERM once its command
        // runs), and a pipeline or a job that expects SIGTERM to stop it must not inherit
        // that. Through the system call, since glibc refuses its own two real-time signals.
        // A zeroed `struct sigaction` of the kernel is SIG_DFL, no flags, an empty mask.
        let default_action = [0u64; 4];
        for signal in 1..=KERNEL_SIGNALS {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    signal,
                    default_action.as_ptr(),
                    std::ptr::null_mut::<libc::c_void>(),
                    KERNEL_SIGSET_BYTES,
                );
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());

        let envp = match &plan.envp {
            Some(envp) => envp.as_ptr(),
            None => environ,
        };
        // As execvp: go on past a directory without the program (or not a directory, or
        // not searchable); remember a permission error; run a file without `#!` under sh.
        let mut denied = false;
        for i in 0..plan.candidates.len() {
            let path = plan.candidates[i].as_ptr();
            libc::execve(path, plan.argv.as_ptr(), envp);
            match *libc::__errno_location() {
                libc::ENOEXEC => {
                    plan.sh_argv[1] = path;
                    libc::execve(SH.as_ptr().cast(), plan.sh_argv.as_ptr(), envp);
                    fail(plan);
                }
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => fail(plan),
            }
        }
        if denied {
            *libc::__errno_location() = libc::EACCES;
        }
        fail(plan)
    }
}

unsafe extern "C" {
    /// The shim's environment, handed to a command that inherits it.
    static environ: *const *const libc::c_char;
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use super::*;

    /// Runs `args` (environment `env`, or this process's) with its output in `dir`; returns
    /// the exit status and stdout, or the spawn error.
    fn run(
        dir: &Path,
        args: &[&str],
        env: Option<&[(String, String)]>,
        cgroup_procs: &[CString],
    ) -> io::Result<(ExitStatus, String)> {
        let out = dir.join("stdout");
        let stdout = File::create(&out)?;
        let stderr = File::create(dir.join("stderr"))?;
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let mut child = spawn(&ConfinedCommand {
            args: &args,
            env,
            cgroup_procs,
            stdout: &stdout,
            stderr: &stderr,
        })?;
        let status = child.wait()?;
        Ok((status, std::fs::read_to_string(out)?))
    }

    #[test]
    fn the_command_starts_with_no_signal_ignored_or_blocked_and_its_exit_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        // Rust programs ignore SIGPIPE; a command must not inherit that (a pipeline would
        // see EPIPE errors instead of ending quietly).
        let (status, out) = run(
            dir.path(),
            &[
                "sh",
                "-c",
                "grep -E '^Sig(Ign|Blk)' /proc/self/status; exit 7",
            ],
            None,
            &[],
        )
        .unwrap();
        assert_eq!(status.code(), Some(7));
        assert_eq!(
            out, "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n",
            "{out}"
        );
    }

    #[test]
    fn the_command_gets_exactly_the_environment_given_and_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let env = [
            ("JOB".to_string(), "7".to_string()),
            ("PATH".to_string(), "/usr/bin:/bin".to_string()),
        ];
        let (status, out) = run(dir.path(), &["sh", "-c", "env | sort"], Some(&env), &[]).unwrap();
        assert!(status.success());
        // sh adds PWD (and may add SHLVL, _); nothing of this process's environment passes.
        let inherited: Vec<&str> = out
            .lines()
            .filter(|l| {
                !["JOB=", "PATH=", "PWD=", "SHLVL=", "_="]
                    .iter()
                    .any(|k| l.starts_with(k))
            })
            .collect();
        assert!(inherited.is_empty(), "{out}");
        assert!(out.contains("JOB=7\n"), "{out}");
        // The program is looked up on the command's PATH, not the shim's.
        let lost = [("PATH".to_string(), "/nonexistent".to_string())];
        let err = run(dir.path(), &["sh", "-c", "true"], Some(&lost), &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    #[test]
    fn a_script_without_interpreter_line_runs_under_sh_and_a_file_not_executable_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train");
        std::fs::write(&script, "echo from-sh \"$1\"\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = script.to_str().unwrap();
        let (status, out) = run(dir.path(), &[path, "epoch-1"], None, &[]).unwrap();
        assert!(status.success());
        assert_eq!(out, "from-sh epoch-1\n");

        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
        // Root may execute a file without execute bits only if some x bit is set: refused.
        let err = run(dir.path(), &[path], None, &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        let err = run(dir.path(), &["/nonexistent/trainer"], None, &[]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
    }

    #[test]
    fn a_command_that_cannot_join_its_cgroup_does_not_run() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        let procs = CString::new(
            dir.path()
                .join("no-such-cgroup/cgroup.procs")
                .to_str()
                .unwrap(),
        )
        .unwrap();
        let touch = format!("touch {}", marker.display());
        let err = run(dir.path(), &["sh", "-c", &touch], None, &[procs]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        assert!(!marker.exists(), "the command ran outside its cgroup");
    }

    fn strings(v: &[&[u8]]) -> Vec<Vec<u8>> {
        v.iter().map(|s| s.to_vec()).collect()
    }

    #[test]
    fn a_program_named_by_path_is_tried_alone() {
        assert_eq!(
            candidates(b"./train.sh", Some(OsStr::new("/usr/bin"))),
            strings(&[b"./train.sh"])
        );
        assert_eq!(candidates(b"", None), Vec::<Vec<u8>>::new());
    }

    #[test]
    fn a_bare_name_is_looked_up_on_path_in_order() {
        assert_eq!(
            candidates(b"python", Some(OsStr::new("/opt/conda/bin::/usr/bin/"))),
            strings(&[b"/opt/conda/bin/python", b"./python", b"/usr/bin/python"])
        );
        assert_eq!(
            candidates(b"sleep", None),
            strings(&[b"/bin/sleep", b"/usr/bin/sleep"])
        );
    }
}
