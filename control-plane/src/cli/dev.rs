//! `gpuctl dev`: a local 3-replica control plane on loopback, in the foreground. Each replica
//! is a child process (this same binary, `gpuctl replica ...`) with its data and log under one
//! directory; Ctrl-C stops them all with SIGTERM (SIGKILL after a grace period).

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;

use crate::client::{Client, ENDPOINTS_ENV, with_timeout};

#[derive(clap::Args)]
pub struct DevArgs {
    /// Where replicas keep their data and logs (reused on the next run).
    #[arg(long, default_value = "./dev-data")]
    pub data_dir: PathBuf,
    /// Port of replica 1; replica i listens on BASE_PORT + i - 1.
    #[arg(long, default_value_t = 7001)]
    pub base_port: u16,
    #[arg(long, default_value_t = 3)]
    pub replicas: u16,
}

struct Children(Vec<(u64, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &self.0 {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (id, c) in &mut self.0 {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    _ => {
                        eprintln!("replica {id} did not stop in time; killing it");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
    }
}

pub fn run(args: DevArgs) -> anyhow::Result<()> {
    if args.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = args.data_dir.canonicalize()?;
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let addrs: Vec<String> = (0..args.replicas)
        .map(|i| format!("127.0.0.1:{}", args.base_port + i))
        .collect();
    let peers: Vec<String> = addrs.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect();
    let peers = peers.join(",");

    let mut children = Children(Vec::new());
    for (i, addr) in addrs.iter().enumerate() {
        let id = i as u64 + 1;
        let log_path = data_dir.join(format!("replica-{id}.log"));
        let log = File::options().create(true).append(true).open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let mut cmd = Command::new(&exe);
        cmd.arg("replica")
            .args(["--id", &id.to_string(), "--listen", addr, "--peers", &peers, "--cluster", "dev"])
            .arg("--data-dir")
            .arg(data_dir.join(format!("replica-{id}")))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        set_parent_death_signal(&mut cmd);
        let child = cmd.spawn().with_context(|| format!("starting replica {id}"))?;
        children.0.push((id, child));
    }

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let endpoints = addrs.clone();
        let mut client = Client::new(&endpoints)?;
        client.deadline = Duration::from_secs(1);
        let started = Instant::now();
        let status = loop {
            for (id, c) in &mut children.0 {
                if let Some(status) = c.try_wait()? {
                    bail!(
                        "replica {id} exited during start-up ({status}); see {}",
                        data_dir.join(format!("replica-{id}.log")).display()
                    );
                }
            }
            let s = client
                .call(|mut c, t| async move { c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t)).await })
                .await;
            if let Ok(s) = s
                && s.leader != 0
            {
                break s;
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!("no leader was elected within 30 s; see the logs in {}", data_dir.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        println!(
            "gpu-control-plane dev cluster is up: {} replicas, leader is replica {} (term {}), elected in {:.1} s.",
            args.replicas,
            status.leader,
            status.term,
            started.elapsed().as_secs_f64()
        );
        println!("  replicas:  {}", addrs.join("  "));
        println!("  data/logs: {}", data_dir.display());
        println!();
        println!("In another terminal (gpuctl finds these replicas by default; elsewhere set {ENDPOINTS_ENV}):");
        println!("  gpuctl submit --gpus 2 --time 1:00:00 -- python train.py");
        println!("  gpuctl queue");
        println!("  gpuctl cluster status");
        println!();
        println!("Ctrl-C stops the cluster.");
        loop {
            tokio::select! {
                _ = crate::server::shutdown_signal() => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    for (id, c) in &mut children.0 {
                        if let Some(status) = c.try_wait()? {
                            eprintln!("replica {id} exited ({status}); the others keep running. See {}",
                                data_dir.join(format!("replica-{id}.log")).display());
                        }
                    }
                    children.0.retain_mut(|(_, c)| matches!(c.try_wait(), Ok(None)));
                    if children.0.is_empty() {
                        bail!("every replica has exited");
                    }
                }
            }
        }
        println!("\nstopping replicas...");
        Ok(())
    })?;
    drop(children);
    println!("stopped.");
    Ok(())
}

/// Children die with `gpuctl dev`, even if it is killed with SIGKILL.
fn set_parent_death_signal(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches only the child being set up.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
    }
}
