//! The Slurm side of `gpuctl bench e2e`: installs Slurm from Debian's packages when it is
//! missing, starts munged (unless one already answers), one slurmctld and one `slurmd -N nI` per
//! simulated host on this machine with fake GPU device files, submits the jobs held
//! (`sbatch --hold`), releases them all (`scontrol release`) and times until every one has
//! completed (`squeue`). Everything it started is stopped at the end, on error too.
//!
//! The configuration is `deploy/bench/slurm/` with Slurm's tuned scheduler settings
//! ([`SCHEDULER_PARAMETERS`]). The daemons run in the foreground as this process's children
//! (they die with it), and their config file is named [`CONF_NAME`] so that daemons a killed
//! earlier run left behind can be told apart from anybody else's and stopped.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::bench_e2e::SideResult;

/// Slurm's tuned settings: schedule on every submission and release, with no batching delay
/// and no minimum interval between passes (defaults: 3 s of batching, ~11 jobs/s here).
pub const SCHEDULER_PARAMETERS: &str = "batch_sched_delay=0,sched_min_interval=0";

const SLURM_CONF: &str = include_str!("../../../deploy/bench/slurm/slurm.conf");
const GRES_CONF: &str = include_str!("../../../deploy/bench/slurm/gres.conf");
/// File name of the generated configuration: it marks the daemons this benchmark starts.
const CONF_NAME: &str = "gpucp-bench-slurm.conf";
const SLURMCTLD_PORT: u16 = 16817;
const FIRST_SLURMD_PORT: u16 = 17001;
const MUNGE_SOCKET: &str = "/run/munge/munge.socket.2";
/// Concurrent `sbatch` processes while submitting (submission is not timed).
const SUBMITTERS: usize = 8;
const POLL: Duration = Duration::from_millis(200);
const RUN_TIMEOUT: Duration = Duration::from_secs(900);

pub struct Shape {
    pub hosts: usize,
    pub gpus_per_host: usize,
    pub jobs: usize,
    /// Keep the configuration, logs and job outputs here instead of a temporary directory.
    pub keep_dir: Option<PathBuf>,
}

pub fn run(shape: &Shape) -> anyhow::Result<SideResult> {
    if shape.hosts > 100 || shape.gpus_per_host > 8 || shape.jobs > 19_000 {
        bail!("the Slurm side runs at most 100 hosts of at most 8 GPUs and 19,000 jobs");
    }
    ensure_installed()?;
    let tmp = tempfile::Builder::new()
        .prefix("gpucp-bench-slurm-")
        .tempdir()?;
    let dir = match &shape.keep_dir {
        Some(d) => {
            fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            d.canonicalize()?
        }
        None => tmp.path().to_owned(),
    };
    stop_leftovers();
    let ports: Vec<u16> = std::iter::once(SLURMCTLD_PORT)
        .chain((0..shape.hosts as u16).map(|i| FIRST_SLURMD_PORT + i))
        .collect();
    for port in &ports {
        wait_port_free(*port).with_context(|| {
            format!(
                "Slurm's port {port} (from deploy/bench/slurm/slurm.conf) is taken by another program; stop it and retry"
            )
        })?;
    }
    let conf = write_config(&dir, shape)?;
    let mut daemons = Daemons::default();
    daemons.start_munge(&dir)?;
    daemons.start(
        "slurmctld",
        Command::new("slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&conf),
        &dir,
        &conf,
    )?;
    for i in 1..=shape.hosts {
        daemons.start(
            &format!("slurmd-n{i}"),
            Command::new("slurmd")
                .args(["-D", "-N", &format!("n{i}"), "-f"])
                .arg(&conf),
            &dir,
            &conf,
        )?;
    }
    let slurm = Slurm { conf, dir };
    let result = (|| {
        slurm.wait_nodes_idle(shape.hosts, &mut daemons)?;
        let ids = slurm.submit_held(shape.jobs)?;
        let t0 = Instant::now();
        slurm.release(&ids)?;
        let (succeeded, other) = slurm.wait_all_final(&ids, t0 + RUN_TIMEOUT, &mut daemons)?;
        Ok(SideResult {
            seconds: t0.elapsed().as_secs_f64(),
            succeeded,
            other,
            enforcement: String::new(),
        })
    })();
    let result = result.map_err(|e: anyhow::Error| {
        e.context(format!(
            "see the Slurm logs in {}",
            slurm.dir.join("log").display()
        ))
    });
    drop(daemons);
    if result.is_err() && shape.keep_dir.is_none() {
        // Keep the logs of a failed run for whoever reads the error.
        let kept = tmp.keep();
        eprintln!("Slurm's files kept in {}", kept.display());
    }
    result
}

/// Installs `slurm-wlm` and `munge` from the distribution when a program is missing.
fn ensure_installed() -> anyhow::Result<()> {
    super::apt::ensure_installed(
        "Slurm",
        &[
            "slurmctld",
            "slurmd",
            "sbatch",
            "squeue",
            "scontrol",
            "munged",
            "munge",
        ],
        &["slurm-wlm", "munge"],
        "pass --skip-slurm",
    )
}

fn fill(template: &str, dir: &Path, shape: &Shape) -> String {
    template
        .replace("@SLURM_DIR@", &dir.to_string_lossy())
        .replace("@HOST@", &short_host_name())
        .replace("@HOSTS@", &shape.hosts.to_string())
        .replace(
            "@LAST_SLURMD_PORT@",
            &(FIRST_SLURMD_PORT as usize + shape.hosts - 1).to_string(),
        )
        .replace("@GPUS@", &shape.gpus_per_host.to_string())
        .replace("@LAST_GPU@", &(shape.gpus_per_host - 1).to_string())
        .replace("@SCHEDULER_PARAMETERS@", SCHEDULER_PARAMETERS)
}

/// slurmctld compares `SlurmctldHost` with the short host name.
fn short_host_name() -> String {
    let name = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name = name.trim();
    name.split('.').next().unwrap_or(name).to_owned()
}

/// Writes slurm.conf, gres.conf (slurmd reads it from slurm.conf's directory), the state and
/// spool directories, and the fake GPU device files. Returns the path of slurm.conf.
fn write_config(dir: &Path, shape: &Shape) -> anyhow::Result<PathBuf> {
    for sub in ["state", "spool", "log", "dev", "jobs"] {
        fs::create_dir_all(dir.join(sub))?;
    }
    let conf = dir.join(CONF_NAME);
    fs::write(&conf, fill(SLURM_CONF, dir, shape))?;
    fs::write(dir.join("gres.conf"), fill(GRES_CONF, dir, shape))?;
    for g in 0..shape.gpus_per_host {
        let dev = dir.join("dev").join(format!("nvidia{g}"));
        if dev.exists() {
            continue;
        }
        let c = std::ffi::CString::new(dev.to_string_lossy().as_bytes())?;
        // A character device with /dev/null's numbers: Slurm only checks that the file exists.
        // SAFETY: mknod with a valid NUL-terminated path.
        let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        if rc != 0 {
            bail!(
                "mknod {} failed: {}",
                dev.display(),
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(conf)
}

/// Waits a little for a port a just-stopped daemon held.
fn wait_port_free(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match std::net::TcpListener::bind(("0.0.0.0", port)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Kills slurmctld and slurmd processes an earlier run of this benchmark left behind (killed
/// before it could stop them): those whose command line names [`CONF_NAME`].
fn stop_leftovers() {
    let Ok(entries) = fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let program = args
            .first()
            .map(|a| {
                String::from_utf8_lossy(a)
                    .rsplit('/')
                    .next()
                    .unwrap_or("")
                    .to_owned()
            })
            .unwrap_or_default();
        let ours = args.iter().any(|a| a.ends_with(CONF_NAME.as_bytes()));
        if ours && (program == "slurmctld" || program == "slurmd") {
            eprintln!("Slurm: stopping {program} (pid {pid}) left by an earlier run");
            // SAFETY: kill(2) on a process identified above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// The daemons this run started, stopped (SIGTERM, then SIGKILL) when dropped.
#[derive(Default)]
struct Daemons {
    children: Vec<(String, Child)>,
}

impl Daemons {
    fn start(
        &mut self,
        name: &str,
        cmd: &mut Command,
        dir: &Path,
        conf: &Path,
    ) -> anyhow::Result<()> {
        let out = fs::File::create(dir.join("log").join(format!("{name}.out")))?;
        cmd.env("SLURM_CONF", conf)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        die_with_parent(cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} (is Slurm installed?)"))?;
        self.children.push((name.to_owned(), child));
        Ok(())
    }

    /// Starts munged unless one already answers on the standard socket (the package's
    /// service, or one a previous run left: munged keeps no state worth resetting).
    fn start_munge(&mut self, dir: &Path) -> anyhow::Result<()> {
        if munge_works() {
            return Ok(());
        }
        let key = Path::new("/etc/munge/munge.key");
        if !key.exists() {
            run_ok(
                Command::new("mungekey")
                    .args(["--create", "--keyfile"])
                    .arg(key),
            )
            .context("creating the munge key")?;
            run_ok(Command::new("chown").args(["munge:munge"]).arg(key))?;
        }
        fs::create_dir_all("/run/munge").context("creating /run/munge")?;
        run_ok(Command::new("chown").args(["munge:munge", "/run/munge"]))?;
        // munged refuses to run as root; --force replaces a stale socket of a dead munged.
        self.start(
            "munged",
            Command::new("runuser").args([
                "-u",
                "munge",
                "--",
                "munged",
                "--foreground",
                "--force",
            ]),
            dir,
            Path::new("/dev/null"),
        )?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !munge_works() {
            if Instant::now() > deadline {
                bail!(
                    "munged did not come up; see {}",
                    dir.join("log/munged.out").display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Fails when a daemon has exited (it could not start: its log says why).
    fn check_running(&mut self) -> anyhow::Result<()> {
        for (name, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                bail!("{name} exited ({status})");
            }
        }
        Ok(())
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        // slurmds first, slurmctld, then munged: the reverse of the start order.
        for (_, child) in self.children.iter().rev() {
            // SAFETY: kill(2) on our own unreaped child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, child) in self.children.iter_mut().rev() {
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        eprintln!("Slurm: {name} ignored SIGTERM; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }
}

fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches only the child being set up.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

fn munge_works() -> bool {
    Path::new(MUNGE_SOCKET).exists()
        && Command::new("munge")
            .args(["-n", "-S", MUNGE_SOCKET])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

fn run_ok(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Client commands against the benchmark's Slurm.
struct Slurm {
    conf: PathBuf,
    dir: PathBuf,
}

impl Slurm {
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf)
            .current_dir(self.dir.join("jobs"));
        c
    }

    fn wait_nodes_idle(&self, hosts: usize, daemons: &mut Daemons) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        loop {
            daemons.check_running()?;
            if let Ok(out) = run_ok(self.command("sinfo").args(["-h", "-N", "-o", "%N %t"])) {
                let idle = out
                    .lines()
                    .filter(|l| l.split_whitespace().nth(1) == Some("idle"))
                    .count();
                if idle == hosts {
                    return Ok(());
                }
                last = out;
            }
            if Instant::now() > deadline {
                bail!("Slurm's nodes did not become idle within 60 s; sinfo says:\n{last}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Submits `jobs` held jobs; returns their ids.
    fn submit_held(&self, jobs: usize) -> anyhow::Result<Vec<String>> {
        let ids = std::thread::scope(|s| {
            let workers: Vec<_> = (0..SUBMITTERS.min(jobs))
                .map(|w| {
                    s.spawn(move || -> anyhow::Result<Vec<String>> {
                        let mut ids = Vec::new();
                        for _ in (w..jobs).step_by(SUBMITTERS) {
                            let out = run_ok(self.command("sbatch").args([
                                "--hold",
                                "--parsable",
                                "--job-name=e2e",
                                "--gres=gpu:1",
                                "-n1",
                                "--wrap",
                                "sleep 0",
                            ]))
                            .context("sbatch")?;
                            let id = out.trim().split(';').next().unwrap_or("").to_owned();
                            if id.is_empty() {
                                bail!("sbatch printed no job id");
                            }
                            ids.push(id);
                        }
                        Ok(ids)
                    })
                })
                .collect();
            let mut ids = Vec::new();
            for w in workers {
                ids.extend(w.join().expect("submitter panicked")?);
            }
            anyhow::Ok(ids)
        })?;
        Ok(ids)
    }

    fn release(&self, ids: &[String]) -> anyhow::Result<()> {
        run_ok(self.command("scontrol").args(["release", &ids.join(",")]))
            .context("releasing the held jobs")?;
        Ok(())
    }

    /// Polls `squeue` until every job is in a final state; returns the number that completed
    /// and the others with their states.
    fn wait_all_final(
        &self,
        ids: &[String],
        deadline: Instant,
        daemons: &mut Daemons,
    ) -> anyhow::Result<(usize, Vec<(String, String)>)> {
        let wanted: std::collections::HashSet<&str> = ids.iter().map(String::as_str).collect();
        loop {
            let out = run_ok(
                self.command("squeue")
                    .args(["-h", "-t", "all", "-o", "%i %T"]),
            )?;
            let states: Vec<(&str, &str)> = out
                .lines()
                .filter_map(|l| l.split_once(' '))
                .filter(|(id, _)| wanted.contains(id))
                .collect();
            let pending = states.iter().filter(|(_, s)| !is_final(s)).count();
            if states.len() == ids.len() && pending == 0 {
                let completed = states.iter().filter(|(_, s)| *s == "COMPLETED").count();
                let other = states
                    .iter()
                    .filter(|(_, s)| *s != "COMPLETED")
                    .map(|(id, s)| (id.to_string(), s.to_string()))
                    .collect();
                return Ok((completed, other));
            }
            if Instant::now() > deadline {
                bail!(
                    "{} of {} Slurm jobs not completed within {RUN_TIMEOUT:?}",
                    pending + ids.len() - states.len(),
                    ids.len()
                );
            }
            daemons.check_running()?;
            std::thread::sleep(POLL);
        }
    }
}

fn is_final(state: &str) -> bool {
    !matches!(
        state,
        "PENDING"
            | "RUNNING"
            | "CONFIGURING"
            | "COMPLETING"
            | "SUSPENDED"
            | "REQUEUED"
            | "RESIZING"
            | "SIGNALING"
            | "STAGE_OUT"
            | "STOPPED"
            | "REQUEUE_HOLD"
            | "REQUEUE_FED"
            | "RESV_DEL_HOLD"
            | "SPECIAL_EXIT"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_templates_are_filled_completely() {
        let shape = Shape {
            hosts: 4,
            gpus_per_host: 8,
            jobs: 10,
            keep_dir: None,
        };
        let conf = fill(SLURM_CONF, Path::new("/x"), &shape);
        let gres = fill(GRES_CONF, Path::new("/x"), &shape);
        for text in [&conf, &gres] {
            let settings = text.lines().filter(|l| !l.starts_with('#'));
            for line in settings {
                assert!(!line.contains('@'), "unfilled field in {line:?}");
            }
        }
        assert!(conf.contains("Port=[17001-17004]"), "{conf}");
        assert!(conf.contains("Gres=gpu:8"), "{conf}");
        assert!(conf.contains(&format!("SchedulerParameters={SCHEDULER_PARAMETERS}")));
        assert!(gres.contains("File=/x/dev/nvidia[0-7]"), "{gres}");
    }
}
