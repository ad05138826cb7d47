//! `gpuctl dev`: a local 3-replica control plane on loopback, in the foreground. Each replica
//! is a child process (this same binary, `gpuctl replica ...`) with its data and log under one
//! directory; Ctrl-C stops them all with SIGTERM (SIGKILL after a grace period).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::client::{ENDPOINTS_ENV, TLS_DIR_ENV};
use crate::local_cluster::LocalCluster;

#[derive(clap::Args)]
pub struct DevArgs {
    /// Where replicas keep their data and logs (reused on the next run).
    #[arg(long, default_value = super::DEV_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Port of replica 1; replica i listens on BASE_PORT + i - 1, simulated host i on
    /// BASE_PORT + 99 + i. Metrics and probes (HTTP): replica i on BASE_PORT + 199 + i, host i on
    /// BASE_PORT + 299 + i.
    #[arg(long, default_value_t = 7001)]
    pub base_port: u16,
    /// Serve no metrics (no `--metrics-listen` for the replicas and hosts).
    #[arg(long)]
    pub no_metrics: bool,
    #[arg(long, default_value_t = 3)]
    pub replicas: u16,
    /// Simulated GPU hosts to start, as presets (comma-separated; empty for none); the
    /// presets are listed from the agent's own table, so the help is never out of date.
    #[arg(
        long,
        default_value = "dgx-h100,pcie-8gpu-2socket",
        value_delimiter = ',',
        help = hosts_help(),
        long_help = hosts_long_help()
    )]
    pub hosts: Vec<String>,
    /// No TLS and no authentication (anyone who reaches the ports is an admin). By default
    /// the cluster makes a CA and certificates under DATA_DIR/tls and requires them.
    #[arg(long)]
    pub insecure: bool,
}

/// `--hosts` in `-h`: the preset names.
fn hosts_help() -> String {
    let names: Vec<&str> = node_agent::gpu::simulated::PRESETS
        .iter()
        .map(|p| p.name)
        .collect();
    format!(
        "Simulated GPU hosts to start, as presets (comma-separated; empty for none): {}",
        names.join(", ")
    )
}

/// `--hosts` in `--help`: each preset with its GPUs, CPUs and memory.
fn hosts_long_help() -> String {
    let mut help = String::from(
        "Simulated GPU hosts to start, as presets (comma-separated; empty for none). Each is a \
         link matrix from node-agent/topologies/ with the vendor's standard host:\n",
    );
    for p in node_agent::gpu::simulated::PRESETS {
        let gpus = p
            .topology_text
            .lines()
            .filter(|l| l.starts_with("GPU"))
            .count();
        let mig = if p.mig.is_empty() {
            String::new()
        } else {
            let slices: Vec<String> = p
                .mig
                .iter()
                .map(|(gpu, profiles)| format!("GPU{gpu}: {}", profiles.join(" + ")))
                .collect();
            format!(", MIG {}", slices.join("; "))
        };
        help.push_str(&format!(
            "\n  {:<28} {gpus} x {}, {} CPUs, {} GiB{mig}",
            p.name,
            p.model,
            p.cpu_milli / 1000,
            p.host_memory_mib / 1024
        ));
    }
    help
}

pub fn run(args: DevArgs) -> anyhow::Result<()> {
    if args.replicas == 0 {
        bail!("--replicas must be at least 1");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let data_dir = args.data_dir.canonicalize()?;
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let ports: Vec<u16> = (0..args.replicas).map(|i| args.base_port + i).collect();
    // A replica that cannot bind exits, and clients would then reach whatever else holds the
    // port (say, another `gpuctl dev`): refuse up front instead.
    let hosts = args.hosts.len() as u16;
    let metrics_ports: Vec<u16> = if args.no_metrics {
        Vec::new()
    } else {
        (0..args.replicas)
            .map(|i| args.base_port + 200 + i)
            .chain((0..hosts).map(|i| args.base_port + 300 + i))
            .collect()
    };
    for port in ports
        .iter()
        .copied()
        .chain((0..hosts).map(|i| args.base_port + 100 + i))
        .chain(metrics_ports.iter().copied())
    {
        if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            bail!(
                "port {port} is not free ({e}); is another `gpuctl dev` running? Use --base-port to pick other ports"
            );
        }
    }
    let mut cluster = LocalCluster::new(&exe, &["replica"], &data_dir, "dev", &ports);
    if !args.no_metrics {
        for (i, r) in cluster.replicas.values_mut().enumerate() {
            r.metrics_addr = Some(format!("127.0.0.1:{}", args.base_port + 200 + i as u16));
        }
    }
    if args.insecure {
        cluster.set_insecure();
    } else if !args.no_metrics {
        // A secured replica serves no status page unless asked; on loopback the summary
        // (no job names, commands or logs) is safe to show.
        cluster
            .extra_args
            .extend(["--status-page".into(), "summary".into()]);
    }
    cluster.agent_program = Some((exe.clone(), vec!["agent".into()]));
    for (i, preset) in args.hosts.iter().filter(|h| !h.is_empty()).enumerate() {
        if node_agent::gpu::simulated::preset(preset).is_none() {
            let names: Vec<&str> = node_agent::gpu::simulated::PRESETS
                .iter()
                .map(|p| p.name)
                .collect();
            bail!(
                "--hosts: {preset:?} is not a preset; known: {}",
                names.join(", ")
            );
        }
        let port = args.base_port + 100 + i as u16;
        let metrics = format!("127.0.0.1:{}", args.base_port + 300 + i as u16);
        let mut flags = vec!["--stop-grace-secs", "10"];
        if !args.no_metrics {
            flags.extend(["--metrics-listen", &metrics]);
        }
        cluster.add_agent(&format!("{preset}-{}", i + 1), preset, port, &flags);
    }
    cluster.start_all()?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let started = Instant::now();
        let status = loop {
            if let Some((id, status)) = cluster.reap_exited().into_iter().next() {
                bail!(
                    "replica {id} exited during start-up ({status}); see {}",
                    cluster.replicas[&id].log_path.display()
                );
            }
            match cluster.wait_for_leader(Duration::from_millis(500)).await {
                Ok(s) => break s,
                Err(e) if started.elapsed() > Duration::from_secs(30) => {
                    return Err(e.context(format!("the dev cluster did not start; see the logs in {}", data_dir.display())));
                }
                Err(_) => {}
            }
        };
        let names: Vec<String> = cluster.agents.keys().cloned().collect();
        for name in &names {
            cluster.start_agent(name)?;
        }
        // "Up" means a first `gpuctl submit` finds the hosts (container engine included).
        if let Err(e) = cluster
            .wait_for_nodes(&names, None, Duration::from_secs(30))
            .await
        {
            eprintln!(
                "gpuctl dev: warning: {e:#}; see the agent logs in {}",
                data_dir.display()
            );
        }
        println!(
            "gpu-control-plane dev cluster is up: {} replicas, leader is replica {} (term {}), ready in {:.1} s.",
            args.replicas,
            status.leader,
            status.term,
            started.elapsed().as_secs_f64()
        );
        println!("  replicas:  {}", cluster.endpoints().join("  "));
        if !names.is_empty() {
            println!("  simulated GPU hosts: {} (see `gpuctl nodes`)", names.join(", "));
            // Each host's own block, since they all share this machine's ports.
            let ranges: Vec<String> = cluster
                .agents
                .values()
                .map(|a| match &a.service_ports {
                    Some(block) => format!("{} {}", a.name, block.range()),
                    None => format!("{} none (no free block)", a.name),
                })
                .collect();
            println!("  service ports: {} (PORT, GPUCP_PORT_<NAME> of service replicas)", ranges.join(", "));
        }
        if !args.no_metrics {
            let urls: Vec<String> = cluster
                .replicas
                .values()
                .filter_map(|r| r.metrics_addr.as_ref())
                .chain(cluster.agents.values().filter_map(|a| {
                    let i = a.extra_args.iter().position(|x| x == "--metrics-listen")?;
                    a.extra_args.get(i + 1)
                }))
                .map(|a| format!("http://{a}/metrics"))
                .collect();
            let pages: Vec<String> = cluster
                .replicas
                .values()
                .filter_map(|r| r.metrics_addr.as_ref())
                .map(|a| format!("http://{a}/"))
                .collect();
            println!("  status page: {}", pages.join("  "));
            println!(
                "               {}",
                if args.insecure {
                    "(cluster, GPU grid, queue, jobs with their logs, tenants; any replica serves it)"
                } else {
                    "(summary: job names, commands and logs withheld while authentication is on; see docs/SECURITY.md)"
                }
            );
            println!("  metrics:   {}", urls.join("  "));
            println!("             (/healthz and /readyz beside each; deploy/prometheus, deploy/grafana)");
        }
        println!("  data/logs: {}", data_dir.display());
        let default_dir = std::path::Path::new(super::DEV_DATA_DIR)
            .canonicalize()
            .ok();
        if cluster.is_secure() {
            let admin = cluster.admin_tls_dir()?;
            println!(
                "  security:  mutual TLS on every connection (CA and certificates in {}), tokens and roles enforced",
                data_dir.join(crate::local_cluster::TLS_SUBDIR).display()
            );
            println!("  admin identity: {}", admin.display());
            if default_dir.as_deref() != Some(data_dir.as_path()) {
                println!(
                    "  (gpuctl looks in {}/tls/admin by default; from elsewhere: export {TLS_DIR_ENV}={})",
                    super::DEV_DATA_DIR,
                    admin.display()
                );
            }
        } else {
            println!("  security:  OFF (--insecure): no TLS, no authentication; use gpuctl --insecure");
        }
        println!();
        println!("In another terminal (gpuctl finds these replicas by default; elsewhere set {ENDPOINTS_ENV}):");
        println!("  gpuctl submit --gpus 2 --time 1:00:00 -- sh -c 'echo $CUDA_VISIBLE_DEVICES; sleep 30'");
        println!("  gpuctl queue");
        println!("  gpuctl nodes");
        println!("  gpuctl logs 1");
        println!("  gpuctl cluster status");
        println!("  gpuctl token create --role user --tenant default   # a token for a user of tenant default");
        println!("  gpuctl audit");
        println!();
        println!("Ctrl-C stops the cluster.");
        loop {
            tokio::select! {
                _ = crate::server::shutdown_signal() => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    for (id, status) in cluster.reap_exited() {
                        eprintln!("replica {id} exited ({status}); see {}", cluster.replicas[&id].log_path.display());
                    }
                    if cluster.replicas.keys().all(|id| !cluster.is_running(*id)) {
                        bail!("every replica has exited");
                    }
                }
            }
        }
        println!("\nstopping replicas...");
        Ok(())
    })?;
    drop(cluster);
    println!("stopped.");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command};

    #[test]
    fn help_lists_every_host_preset() {
        let mut cmd = super::DevArgs::augment_args(Command::new("dev"));
        let short = cmd.render_help().to_string();
        let long = cmd.render_long_help().to_string();
        for p in node_agent::gpu::simulated::PRESETS {
            assert!(
                short.contains(p.name),
                "{} missing from -h:\n{short}",
                p.name
            );
            assert!(
                long.contains(p.name),
                "{} missing from --help:\n{long}",
                p.name
            );
        }
        assert!(
            long.contains("8 x NVIDIA H100 80GB HBM3, 224 CPUs, 2048 GiB"),
            "{long}"
        );
        assert!(
            long.contains("MIG GPU0: 3g.40gb + 2g.20gb + 1g.10gb + 1g.10gb"),
            "{long}"
        );
    }
}
