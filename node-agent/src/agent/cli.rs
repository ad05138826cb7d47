//! Flags of `node-agent` (and of `gpuctl agent`, which `gpuctl dev` starts for simulated hosts).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};

use super::AgentConfig;
use crate::gpu::GpuBackend;
use crate::gpu::nvml::NvmlBackend;
use crate::gpu::simulated::{SimulatedBackend, SimulatedSpec, preset};

#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// Node name, unique in the cluster (defaults to the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Control-plane replicas, comma-separated; any one will do.
    #[arg(
        long,
        value_name = "HOST:PORT,...",
        default_value = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003"
    )]
    pub control_plane: String,
    /// Address of this agent's own API (logs, fault injection).
    #[arg(long, default_value = "127.0.0.1:7100")]
    pub listen: String,
    /// Address the control plane and gpuctl should use for this agent (defaults to --listen).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Serve Prometheus metrics (`/metrics`) and health probes (`/healthz`, `/readyz`) over
    /// plain HTTP on this address, e.g. 0.0.0.0:9401. Off unless given.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Where running workloads, their logs and exit records live; must survive agent restarts.
    #[arg(long, default_value = "/var/lib/gpu-node-agent")]
    pub state_dir: PathBuf,
    #[arg(long)]
    pub partition: Option<String>,
    /// Labels as KEY=VALUE (repeatable), e.g. rack=r12.
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// Simulate a host from a preset: dgx-h100, dgx1-v100, a100-pcie-4gpu-nvlink-pairs,
    /// pcie-8gpu-2socket, h100-pcie-1gpu, h100-pcie-1gpu-mig (its GPU cut into MIG slices).
    #[arg(long, value_name = "PRESET", conflicts_with = "simulated_topology")]
    pub simulated: Option<String>,
    /// Simulate a host from an `nvidia-smi topo -m` file (e.g. pasted from a real host).
    #[arg(long, value_name = "FILE")]
    pub simulated_topology: Option<PathBuf>,
    /// GPU model of a --simulated-topology host.
    #[arg(long, default_value = "NVIDIA H100 80GB HBM3")]
    pub gpu_model: String,
    /// GPU memory of a --simulated-topology host, MiB.
    #[arg(long, default_value_t = 81_559)]
    pub gpu_memory_mib: u64,
    /// MIG layout of a simulated host: INDEX=PROFILE+PROFILE (repeatable), e.g. 0=3g.40gb+4g.40gb;
    /// replaces a preset's layout for that GPU (INDEX= with no profiles: MIG mode, no slices).
    #[arg(long = "mig", value_name = "INDEX=PROFILES")]
    pub mig: Vec<String>,
    /// Seconds between SIGTERM and SIGKILL when stopping a workload.
    #[arg(long, default_value_t = 30)]
    pub stop_grace_secs: u64,
    /// How shims are started: `fork` from one pre-started launcher process (the default;
    /// falls back to `exec` where the launcher cannot run), or `exec` the shim program for
    /// every workload.
    #[arg(long, value_enum, default_value = "fork")]
    pub shim_start: ShimStart,
    /// Enforcement with a cgroup per allocation (devices, memory, CPU; stopping every
    /// process of a job): auto (use cgroups where the host allows, else register the node
    /// as unenforced and say why), require (refuse to start without them), off (unenforced).
    #[arg(long, value_enum, default_value = "auto")]
    pub cgroups: super::CgroupMode,
    /// Container jobs (`gpuctl submit --image`) through the local Docker engine: auto (where
    /// the engine answers at start-up; otherwise the node takes process jobs only), require
    /// (refuse to start without it), off.
    #[arg(long, value_enum, default_value = "auto")]
    pub containers: super::containers::ContainerMode,
    /// The container engine's Unix socket (default: DOCKER_HOST, else /var/run/docker.sock).
    #[arg(long, value_name = "PATH")]
    pub container_socket: Option<String>,
    /// A host directory under which container jobs may mount paths (`--mount SRC:DST`);
    /// repeatable. None given: container jobs may mount nothing (a mount of / would hand a
    /// job the host).
    #[arg(long = "container-mount-prefix", value_name = "DIR")]
    pub container_mount_prefixes: Vec<PathBuf>,
    /// When to pull an image the host lacks: missing (pull it), never (the job fails, for
    /// hosts whose images are loaded beforehand).
    #[arg(long, value_enum, default_value = "missing")]
    pub image_pull: crate::runtime::container::PullPolicy,
    /// Milliseconds between SIGTERM and SIGKILL when the agent fences itself (lease expired);
    /// must be shorter than the control plane's node grace.
    #[arg(long, default_value_t = 2000)]
    pub fence_grace_ms: u64,
    /// Directory with this node's TLS identity: ca.pem, cert.pem, key.pem (and crl.pem), as
    /// `gpuctl certs issue node --name NODE` writes it. The certificate names the node: the
    /// control plane takes registrations, heartbeats and reports for that node only.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// CA bundle (overrides the one in --tls-dir).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Certificate (overrides the one in --tls-dir).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (overrides the one in --tls-dir).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Talk to the control plane and serve without TLS (the control plane must run with
    /// --insecure too). For benchmarks and throwaway test networks only.
    #[arg(long)]
    pub insecure: bool,
    /// Host ports this node hands to tasks that ask for named ports (a service's replicas,
    /// `PORT` and `GPUCP_PORT_<NAME>`), as FIRST-LAST; `off`: none, and such tasks are not
    /// placed here. Keep the range out of the kernel's ephemeral range
    /// (/proc/sys/net/ipv4/ip_local_port_range), whose ports outgoing connections take.
    #[arg(
        long,
        value_name = "FIRST-LAST|off",
        default_value = "20000-32000",
        env = SERVICE_PORTS_ENV
    )]
    pub service_ports: String,
}

/// The environment variable that gives `--service-ports` when the flag is absent: what a
/// local cluster sets for its simulated hosts, since an agent of an older release (a rolling
/// upgrade test) would refuse the flag but ignores the variable.
pub const SERVICE_PORTS_ENV: &str = "GPUCP_AGENT_SERVICE_PORTS";

/// How the agent starts each workload's shim (`--shim-start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShimStart {
    /// Forked by one pre-started launcher process: no exec and no dynamic loading per job.
    Fork,
    /// A new process of the shim program for every workload.
    Exec,
}

/// A node's range of host ports for named task ports, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServicePorts {
    pub first: u16,
    pub last: u16,
}

impl ServicePorts {
    /// `--service-ports`: `FIRST-LAST` (1 to 65535, first <= last) or `off` (`None`).
    pub fn parse(text: &str) -> anyhow::Result<Option<ServicePorts>> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        let usage = || {
            format!(
                "--service-ports {text:?} is not a range of ports: give FIRST-LAST (e.g. 20000-32000, ports 1 to 65535) or off"
            )
        };
        let (first, last) = text.split_once('-').with_context(usage)?;
        let port = |p: &str| p.trim().parse::<u16>().ok().filter(|p| *p > 0);
        let (Some(first), Some(last)) = (port(first), port(last)) else {
            bail!(usage());
        };
        if first > last {
            bail!("--service-ports {text:?}: the first port is above the last; give FIRST-LAST");
        }
        Ok(Some(ServicePorts { first, last }))
    }

    /// The part of the range inside `ephemeral` (the kernel's range for outgoing
    /// connections, from `ip_local_port_range`), if any: a replica given such a port may
    /// find it taken by a connection.
    pub fn overlap(&self, ephemeral: (u16, u16)) -> Option<(u16, u16)> {
        let first = self.first.max(ephemeral.0);
        let last = self.last.min(ephemeral.1);
        (first <= last).then_some((first, last))
    }
}

/// The kernel's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`).
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
    Some((parts.next()??, parts.next()??))
}

/// The agent's transport and the node name its certificate gives.
fn load_transport(
    args: &AgentArgs,
) -> anyhow::Result<(proto::transport::Transport, Option<String>)> {
    use proto::tls::{CertRole, ClientAuth, TlsContext, TlsPaths};
    let paths = TlsPaths {
        dir: args.tls_dir.clone(),
        ca: args.tls_ca.clone(),
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    };
    match (args.insecure, paths.files()?) {
        (true, Some(_)) => bail!("give either --insecure or TLS files (--tls-dir), not both"),
        (true, None) => Ok((proto::transport::Transport::Plain, None)),
        (false, None) => bail!(
            "no TLS identity: give --tls-dir DIR with ca.pem, cert.pem and key.pem (`gpuctl certs issue node --name NODE` makes them), or --insecure"
        ),
        (false, Some(files)) => {
            // Only replicas call an agent, and they always present a certificate.
            let ctx = TlsContext::load(files, ClientAuth::Required).context("loading TLS files")?;
            let id = ctx
                .identity()
                .context("an agent needs a certificate and key (--tls-cert, --tls-key)")?;
            if id.role != CertRole::Node {
                bail!(
                    "the agent's certificate is the {id}; it needs a node certificate (`gpuctl certs issue node --name NODE`)"
                );
            }
            Ok((proto::transport::Transport::Tls(ctx), Some(id.name)))
        }
    }
}

pub struct Built {
    pub config: AgentConfig,
    pub backend: Arc<dyn GpuBackend>,
    pub simulated: Option<Arc<SimulatedBackend>>,
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "node".into())
}

impl AgentArgs {
    pub fn build(self, shim_program: PathBuf, shim_args: Vec<String>) -> anyhow::Result<Built> {
        let (transport, cert_name) = load_transport(&self)?;
        let name = match (self.name.clone(), cert_name) {
            (Some(flag), Some(cert)) if flag != cert => bail!(
                "--name {flag:?} does not match the node certificate, which is for {cert:?}: the control plane accepts this agent as {cert:?} only"
            ),
            (Some(n), _) | (None, Some(n)) => n,
            (None, None) => host_name(),
        };
        let mut labels = BTreeMap::new();
        for kv in &self.labels {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--label {kv:?} is not KEY=VALUE"))?;
            labels.insert(k.to_owned(), v.to_owned());
        }
        let mut mig = Vec::new();
        for m in &self.mig {
            let (idx, profiles) = m
                .split_once('=')
                .with_context(|| format!("--mig {m:?} is not INDEX=PROFILE+PROFILE"))?;
            let idx: u32 = idx
                .parse()
                .with_context(|| format!("--mig {m:?}: {idx:?} is not a GPU index"))?;
            let profiles = profiles
                .split('+')
                .filter(|p| !p.is_empty())
                .map(str::to_owned)
                .collect();
            mig.push((idx, profiles));
        }
        let sim_spec: Option<SimulatedSpec> = match (&self.simulated, &self.simulated_topology) {
            (Some(p), _) => {
                let preset = preset(p).with_context(|| {
                    let names: Vec<&str> = crate::gpu::simulated::PRESETS
                        .iter()
                        .map(|p| p.name)
                        .collect();
                    format!(
                        "--simulated {p:?} is not a preset; known: {}",
                        names.join(", ")
                    )
                })?;
                Some(preset.spec(&name)?)
            }
            (None, Some(path)) => Some(SimulatedSpec::from_topology_file(
                path,
                &name,
                &self.gpu_model,
                self.gpu_memory_mib,
            )?),
            (None, None) => None,
        };
        let (backend, simulated): (Arc<dyn GpuBackend>, _) = match sim_spec {
            Some(mut spec) => {
                // A preset's own layout, except for the GPUs the flags describe.
                spec.mig
                    .retain(|(gpu, _)| !mig.iter().any(|(flagged, _)| flagged == gpu));
                spec.mig.extend(mig);
                let sim = Arc::new(SimulatedBackend::new(spec)?);
                (sim.clone(), Some(sim))
            }
            None => {
                if !mig.is_empty() {
                    bail!(
                        "--mig describes simulated hosts; on a real host configure MIG with nvidia-smi"
                    );
                }
                (Arc::new(NvmlBackend::new()?), None)
            }
        };
        let service_ports = ServicePorts::parse(&self.service_ports)?;
        if let (Some(range), Some(ephemeral)) = (service_ports, ephemeral_ports())
            && let Some((first, last)) = range.overlap(ephemeral)
        {
            tracing::warn!(
                "--service-ports {}-{}: ports {first}-{last} are in the kernel's ephemeral range {}-{} (net.ipv4.ip_local_port_range), which outgoing connections take ports from: a replica may find its port taken; move the range or set net.ipv4.ip_local_reserved_ports",
                range.first,
                range.last,
                ephemeral.0,
                ephemeral.1
            );
        }
        let endpoints: Vec<String> = self
            .control_plane
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        Ok(Built {
            config: AgentConfig {
                name,
                control_plane: endpoints,
                advertise: self.advertise.unwrap_or_else(|| self.listen.clone()),
                listen: self.listen,
                state_dir: self.state_dir,
                partition: self.partition,
                labels,
                shim_program,
                shim_args,
                shim_launcher: self.shim_start == ShimStart::Fork,
                stop_grace: Duration::from_secs(self.stop_grace_secs),
                fence_grace: Duration::from_millis(self.fence_grace_ms),
                transport,
                reexec: None,
                cgroups: self.cgroups,
                containers: super::containers::ContainerOptions {
                    mode: self.containers,
                    socket: self.container_socket,
                    mount_prefixes: self.container_mount_prefixes,
                    pull: self.image_pull,
                },
                metrics_listen: self.metrics_listen,
                service_ports,
            },
            backend,
            simulated,
        })
    }
}

/// The whole life of an agent process: flags, logging, runtime, run until SIGTERM/Ctrl-C.
pub fn run_agent_process(
    args: AgentArgs,
    own_exe: PathBuf,
    shim_subcommand: &str,
) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,h2=warn,tower=warn,hyper=warn")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
    let reexec = super::restart::Reexec::of_this_process(own_exe.clone());
    let (shim_program, shim_args) = crate::runtime::shim_command(own_exe, shim_subcommand);
    let mut built = args.build(shim_program, shim_args)?;
    built.config.reexec = Some(reexec.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let stopped = runtime.block_on(async move {
        super::run(
            built.config,
            built.backend,
            built.simulated,
            proto::transport::shutdown_signal(),
        )
        .await
    })?;
    if stopped == super::Stopped::Restart {
        // Tasks still blocked (a GPU event wait, a stuck file read) must not hold the restart.
        runtime.shutdown_timeout(Duration::from_secs(2));
        tracing::info!(program = %reexec.program.display(), "restarting in place; workloads keep running under their shims");
        return Err(reexec.exec());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentArgs,
    }

    fn build(args: &[&str]) -> anyhow::Result<Built> {
        let cli = Cli::try_parse_from(
            ["node-agent", "--insecure"]
                .into_iter()
                .chain(args.iter().copied()),
        )?;
        cli.agent.build("/bin/true".into(), Vec::new())
    }

    fn slices(built: &Built) -> Vec<(u32, Vec<String>)> {
        built
            .backend
            .inventory()
            .expect("inventory")
            .gpus
            .iter()
            .filter(|g| g.mig_enabled)
            .map(|g| {
                (
                    g.index,
                    g.mig_instances.iter().map(|m| m.profile.clone()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn service_ports_are_a_range_or_off_and_a_bad_one_says_how_to_write_it() {
        let sim = ["--name", "s", "--simulated", "h100-pcie-1gpu"];
        let built = build(&sim).expect("builds");
        assert_eq!(
            built.config.service_ports,
            Some(ServicePorts {
                first: 20_000,
                last: 32_000
            }),
            "Nomad's dynamic port range by default"
        );
        let with = |range: &str| {
            let mut args = sim.to_vec();
            args.extend(["--service-ports", range]);
            build(&args).map(|b| b.config.service_ports)
        };
        assert_eq!(
            with("40000-40099").expect("builds"),
            Some(ServicePorts {
                first: 40_000,
                last: 40_099
            })
        );
        assert_eq!(
            with("7-7").expect("builds"),
            Some(ServicePorts { first: 7, last: 7 })
        );
        assert_eq!(with("off").expect("builds"), None);
        assert_eq!(with("OFF").expect("builds"), None);
        for bad in ["40000", "0-10", "10-70000", "a-b", "9-8", "", "-", "1-2-3"] {
            let e = with(bad).expect_err(bad).to_string();
            assert!(e.contains("--service-ports"), "{bad}: {e}");
            assert!(
                e.contains("FIRST-LAST"),
                "{bad}: the message says what to give: {e}"
            );
        }
    }

    #[test]
    fn a_range_in_the_ephemeral_range_is_found() {
        let r = ServicePorts {
            first: 20_000,
            last: 40_000,
        };
        assert_eq!(r.overlap((32_768, 60_999)), Some((32_768, 40_000)));
        assert_eq!(r.overlap((40_000, 60_999)), Some((40_000, 40_000)));
        assert_eq!(r.overlap((40_001, 60_999)), None);
        assert_eq!(r.overlap((1_024, 19_999)), None);
    }

    #[test]
    fn a_mig_preset_starts_with_its_slices_and_flags_replace_a_gpus_layout() {
        let built = build(&["--name", "m", "--simulated", "h100-pcie-1gpu-mig"]).expect("builds");
        assert_eq!(
            slices(&built),
            vec![(
                0,
                vec!["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
                    .into_iter()
                    .map(String::from)
                    .collect()
            )]
        );
        let built = build(&[
            "--name",
            "m",
            "--simulated",
            "h100-pcie-1gpu-mig",
            "--mig",
            "0=1g.10gb+1g.10gb",
        ])
        .expect("builds");
        assert_eq!(
            slices(&built),
            vec![(0, vec!["1g.10gb".to_string(), "1g.10gb".to_string()])]
        );
        let built = build(&[
            "--name",
            "m",
            "--simulated",
            "h100-pcie-1gpu-mig",
            "--mig",
            "0=",
        ])
        .expect("builds");
        assert_eq!(slices(&built), vec![(0, Vec::new())]);
        // A whole-GPU preset gets slices only from flags.
        let built = build(&[
            "--name",
            "a",
            "--simulated",
            "dgx-h100",
            "--mig",
            "3=7g.80gb",
        ])
        .expect("builds");
        assert_eq!(slices(&built), vec![(3, vec!["7g.80gb".to_string()])]);
        assert!(build(&["--simulated", "h100-pcie-1gpu", "--mig", "1=1g.10gb"]).is_err());
    }
}
