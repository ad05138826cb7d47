//! A control plane made of local child processes on loopback: what `gpuctl dev`, the
//! benchmarks and the multi-process tests run. Each replica is a real process with its own data
//! directory and log file; this type starts, signals and restarts them and waits for a leader.
//!
//! Every simulated host shares the machine's ports, so each gets a block of host ports of its
//! own for service replicas ([`ServicePortBlock`]), outside the kernel's ephemeral range (where
//! [`free_ports`] finds the replicas' and agents' ports) and held for the cluster's life.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::tls::CertRole;
use proto::tls::pki::{self, CaFiles, IssueRequest};
use proto::v1 as pb;

use crate::client::{Client, Credentials, with_timeout};

/// How a replica process is started.
#[derive(Debug, Clone)]
pub enum StartMode {
    /// Member of the initial cluster (`--peers`, lowest id bootstraps on a fresh directory).
    Initial,
    /// Joins through an existing replica (`--join`).
    Join(String),
    /// Starts empty and waits to be added (`gpuctl cluster add`).
    Pristine,
}

pub struct ReplicaProcess {
    pub id: u64,
    pub addr: String,
    pub data_dir: PathBuf,
    pub log_path: PathBuf,
    /// Runs this replica instead of the cluster's program (same leading arguments), from its
    /// next start on: a rolling upgrade has two versions side by side.
    pub program: Option<PathBuf>,
    /// Given as `--metrics-listen` from its next start on (none: metrics off).
    pub metrics_addr: Option<String>,
    child: Option<Child>,
}

impl ReplicaProcess {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

/// A node agent process on a simulated host.
pub struct AgentProcess {
    pub name: String,
    pub preset: String,
    pub addr: String,
    pub state_dir: PathBuf,
    pub log_path: PathBuf,
    pub extra_args: Vec<String>,
    /// Program and leading arguments that run this agent instead of the cluster's
    /// `agent_program`, from its next start on (a rolling upgrade of agents).
    pub program: Option<(PathBuf, Vec<String>)>,
    /// The host ports it hands to service replicas (none: no block was free, and the agent
    /// is started with none).
    pub service_ports: Option<ServicePortBlock>,
    child: Option<Child>,
}

impl AgentProcess {
    /// The agent's GPU usage journal (one line per workload start and stop).
    pub fn usage_journal(&self) -> PathBuf {
        self.state_dir.join("runtime").join("gpu-usage.jsonl")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

pub struct LocalCluster {
    /// Program and leading arguments that run one replica (`control-plane`, or `gpuctl replica`).
    program: PathBuf,
    program_args: Vec<String>,
    pub root: PathBuf,
    pub cluster: String,
    /// Extra flags for every replica (timings, snapshot policy).
    pub extra_args: Vec<String>,
    /// Extra environment variables for every replica (e.g. `RUST_LOG`).
    pub env: Vec<(String, String)>,
    pub replicas: BTreeMap<u64, ReplicaProcess>,
    initial_peers: String,
    /// Program (and leading arguments) that runs a node agent (`gpuctl agent`, `node-agent`).
    pub agent_program: Option<(PathBuf, Vec<String>)>,
    pub agents: BTreeMap<String, AgentProcess>,
    /// What agents are given as `--control-plane` instead of the replicas' addresses (e.g.
    /// every address a replica may take during a run whose membership changes).
    pub agent_endpoints: Option<Vec<String>>,
    /// Each process binds its outgoing connections to the IP address it listens on
    /// (`GPUCP_SOURCE_ADDRESS`), so that traffic between two processes on distinct loopback
    /// addresses can be told apart (and cut) by address. Off by default.
    pub bind_source: bool,
    /// Mutual TLS and authentication, as a real deployment runs (the default): a CA under
    /// `root/tls/ca`, a certificate for each replica, agent and an admin client beside it,
    /// made when first needed. Off (`set_insecure`), everything is plaintext and
    /// unauthenticated: only for measuring what security costs.
    secure: bool,
    /// The admin credentials, loaded once (status polls make a client every few ms).
    credentials: std::sync::OnceLock<Credentials>,
}

/// Where a local cluster keeps its certificates, under its root.
pub const TLS_SUBDIR: &str = "tls";

/// Ports per simulated host's block (the first is the block's reservation, the rest its
/// range): a replica takes at most 16 named ports, and a dev host runs a few replicas.
pub const SERVICE_PORT_BLOCK: u16 = 32;
/// Where blocks are looked for: above the well-known and registered ports most local
/// services use, and outside 20000-32000 (an agent's default range, and where multi-task
/// jobs' MASTER_PORT lies) and the kernel's ephemeral range.
const SERVICE_PORTS_FROM: u16 = 10_000;
const AVOIDED: (u16, u16) = (20_000, 32_000);

/// A block of host ports one simulated host hands to service replicas (`--service-ports`,
/// through the agent's environment, which agents of older releases ignore). Its first port is
/// held bound for the block's life, which reserves the block machine-wide: another local
/// cluster (a test running beside this one, another `gpuctl dev`) finds that port taken and
/// moves on. Its range is the ports after it.
#[derive(Debug)]
pub struct ServicePortBlock {
    pub first: u16,
    pub last: u16,
    _reservation: TcpListener,
}

impl ServicePortBlock {
    /// The `--service-ports` value of the block.
    pub fn range(&self) -> String {
        format!("{}-{}", self.first, self.last)
    }

    /// Reserves the first free block outside `ephemeral` (the kernel's range, from
    /// `ip_local_port_range`; default Linux's 32768-60999) and 20000-32000.
    pub fn reserve() -> Option<ServicePortBlock> {
        let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| {
                let mut p = t.split_whitespace().map(|p| p.parse::<u16>().ok());
                Some((p.next()??, p.next()??))
            })
            .unwrap_or((32_768, 60_999));
        Self::reserve_outside(&[ephemeral, AVOIDED])
    }

    fn reserve_outside(avoid: &[(u16, u16)]) -> Option<ServicePortBlock> {
        let mut start = SERVICE_PORTS_FROM;
        while let Some(end) = start.checked_add(SERVICE_PORT_BLOCK - 1) {
            let clear = avoid.iter().all(|(a, b)| end < *a || start > *b);
            if clear && let Ok(reservation) = TcpListener::bind(("127.0.0.1", start)) {
                return Some(ServicePortBlock {
                    first: start + 1,
                    last: end,
                    _reservation: reservation,
                });
            }
            start = end.checked_add(1)?;
        }
        None
    }
}

/// Free loopback ports, found by binding port 0. The ports are released before the replicas
/// bind them; on a test machine nothing else races for them in that instant.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .context("finding free loopback ports")?;
    Ok(listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<_, _>>()?)
}

impl LocalCluster {
    /// Describes (does not start) `ports.len()` replicas with ids 1.. on the given ports.
    pub fn new(
        program: &Path,
        program_args: &[&str],
        root: &Path,
        cluster: &str,
        ports: &[u16],
    ) -> LocalCluster {
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        LocalCluster::new_at(program, program_args, root, cluster, &addrs)
    }

    /// Describes (does not start) `addrs.len()` replicas with ids 1.. listening on `addrs`.
    pub fn new_at(
        program: &Path,
        program_args: &[&str],
        root: &Path,
        cluster: &str,
        addrs: &[String],
    ) -> LocalCluster {
        let mut replicas = BTreeMap::new();
        for (i, addr) in addrs.iter().enumerate() {
            let id = i as u64 + 1;
            replicas.insert(
                id,
                ReplicaProcess {
                    id,
                    addr: addr.clone(),
                    data_dir: root.join(format!("replica-{id}")),
                    log_path: root.join(format!("replica-{id}.log")),
                    program: None,
                    metrics_addr: None,
                    child: None,
                },
            );
        }
        let initial_peers = replicas
            .values()
            .map(|r| format!("{}={}", r.id, r.addr))
            .collect::<Vec<_>>()
            .join(",");
        LocalCluster {
            program: program.to_owned(),
            program_args: program_args.iter().map(|s| s.to_string()).collect(),
            root: root.to_owned(),
            cluster: cluster.to_owned(),
            extra_args: Vec::new(),
            env: Vec::new(),
            replicas,
            initial_peers,
            agent_program: None,
            agents: BTreeMap::new(),
            agent_endpoints: None,
            bind_source: false,
            secure: true,
            credentials: std::sync::OnceLock::new(),
        }
    }

    /// Plaintext and no authentication for every process started from now on.
    pub fn set_insecure(&mut self) {
        self.secure = false;
        self.credentials = std::sync::OnceLock::new();
    }

    pub fn is_secure(&self) -> bool {
        self.secure
    }

    fn tls_root(&self) -> PathBuf {
        self.root.join(TLS_SUBDIR)
    }

    /// The cluster's CA, created on first use (and kept across runs, as `gpuctl dev` reuses
    /// its directory).
    pub fn ca(&self) -> anyhow::Result<CaFiles> {
        let dir = self.tls_root().join("ca");
        if let Ok(ca) = CaFiles::read(&dir) {
            return Ok(ca);
        }
        let ca = pki::create_ca(&self.cluster, 3650)?;
        ca.write(&dir)?;
        Ok(ca)
    }

    /// An identity directory for `req` under the cluster's TLS root, issued when missing,
    /// unreadable or within a month of expiring.
    pub fn identity(&self, dir_name: &str, req: &IssueRequest) -> anyhow::Result<PathBuf> {
        let dir = self.tls_root().join(dir_name);
        let current = proto::tls::TlsContext::load(
            proto::tls::TlsFiles::in_dir(&dir),
            proto::tls::ClientAuth::Required,
        )
        .ok()
        .and_then(|ctx| ctx.identity())
        .filter(|id| {
            id.role == req.role
                && id.name == req.name
                && id.client_role == req.client_role
                && id.not_after_ms > crate::replica::now_ms() + 31 * 86_400_000
        });
        if current.is_none() {
            pki::issue(&self.ca()?, req)?
                .write(&dir)
                .with_context(|| format!("writing certificates to {}", dir.display()))?;
        }
        Ok(dir)
    }

    /// The admin client identity (what `gpuctl` finds under a dev cluster's data directory).
    pub fn admin_tls_dir(&self) -> anyhow::Result<PathBuf> {
        self.identity("admin", &IssueRequest::client("admin", "admin", None))
    }

    /// How clients of this cluster authenticate: the admin certificate, or nothing.
    pub fn credentials(&self) -> anyhow::Result<Credentials> {
        if let Some(c) = self.credentials.get() {
            return Ok(c.clone());
        }
        let c = if self.secure {
            Credentials::from_dir(&self.admin_tls_dir()?, None)?
        } else {
            Credentials::insecure()
        };
        Ok(self.credentials.get_or_init(|| c).clone())
    }

    /// Environment for a `gpuctl` process talking to this cluster as its admin.
    pub fn gpuctl_env(&self) -> anyhow::Result<Vec<(String, String)>> {
        let mut env = vec![(
            crate::client::ENDPOINTS_ENV.to_owned(),
            self.endpoints().join(","),
        )];
        if self.secure {
            env.push((
                crate::client::TLS_DIR_ENV.to_owned(),
                self.admin_tls_dir()?.display().to_string(),
            ));
        } else {
            env.push((crate::client::INSECURE_ENV.to_owned(), "true".into()));
        }
        Ok(env)
    }

    /// `--tls-dir DIR` for a replica or agent, or `--insecure`.
    fn security_args(&self, dir_name: &str, req: IssueRequest) -> anyhow::Result<Vec<String>> {
        if !self.secure {
            return Ok(vec!["--insecure".into()]);
        }
        let dir = self.identity(dir_name, &req)?;
        Ok(vec!["--tls-dir".into(), dir.display().to_string()])
    }

    /// Describes a simulated GPU host (not started). `extra_args` go to every start.
    pub fn add_agent(&mut self, name: &str, preset: &str, port: u16, extra_args: &[&str]) {
        self.add_agent_at(name, preset, &format!("127.0.0.1:{port}"), extra_args);
    }

    /// As [`Self::add_agent`], listening on `addr` (HOST:PORT).
    pub fn add_agent_at(&mut self, name: &str, preset: &str, addr: &str, extra_args: &[&str]) {
        self.agents.insert(
            name.to_owned(),
            AgentProcess {
                name: name.to_owned(),
                preset: preset.to_owned(),
                addr: addr.to_owned(),
                state_dir: self.root.join(format!("agent-{name}")),
                log_path: self.root.join(format!("agent-{name}.log")),
                extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
                program: None,
                service_ports: ServicePortBlock::reserve(),
                child: None,
            },
        );
    }

    pub fn start_agent(&mut self, name: &str) -> anyhow::Result<()> {
        let (program, args) = self
            .agents
            .get(name)
            .and_then(|a| a.program.clone())
            .or_else(|| self.agent_program.clone())
            .context("no agent program configured for this cluster")?;
        let endpoints = self
            .agent_endpoints
            .clone()
            .unwrap_or_else(|| self.endpoints())
            .join(",");
        // The node name is the agent's key unless its extra args name it otherwise; its
        // certificate names the same node.
        let node_name = {
            let a = self
                .agents
                .get(name)
                .with_context(|| format!("no agent {name}"))?;
            a.extra_args
                .iter()
                .position(|x| x == "--name")
                .and_then(|i| a.extra_args.get(i + 1))
                .cloned()
                .unwrap_or_else(|| name.to_owned())
        };
        let security = self.security_args(
            &format!("node-{node_name}"),
            IssueRequest::new(CertRole::Node, node_name.clone()),
        )?;
        let a = self
            .agents
            .get_mut(name)
            .with_context(|| format!("no agent {name}"))?;
        if a.child.is_some() {
            bail!("agent {name} is already running");
        }
        let log = File::options()
            .create(true)
            .append(true)
            .open(&a.log_path)?;
        let mut cmd = Command::new(&program);
        cmd.args(&args);
        // The node name defaults to the agent's key; extra args may name it otherwise.
        if !a.extra_args.iter().any(|x| x == "--name") {
            cmd.args(["--name", name]);
        }
        cmd.args([
            "--simulated",
            &a.preset,
            "--listen",
            &a.addr,
            "--control-plane",
            &endpoints,
        ])
        .arg("--state-dir")
        .arg(&a.state_dir)
        .args(&security)
        .args(&a.extra_args)
        // Its own block (a `--service-ports` among the extra args wins); with none free,
        // none, rather than the default range every host would share.
        .env(
            node_agent::agent::cli::SERVICE_PORTS_ENV,
            a.service_ports
                .as_ref()
                .map_or_else(|| "off".to_owned(), ServicePortBlock::range),
        )
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .envs(source_env(self.bind_source, &a.addr))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
        // The agent dies with us; its workloads run in their own sessions and stop by
        // themselves once the agent's lease lapses.
        set_parent_death_signal(&mut cmd);
        a.child = Some(
            cmd.spawn()
                .with_context(|| format!("starting agent {name}"))?,
        );
        Ok(())
    }

    /// The running process of agent `name`, no longer tracked as running.
    fn take_agent_child(&mut self, name: &str) -> anyhow::Result<Child> {
        let a = self
            .agents
            .get_mut(name)
            .with_context(|| format!("no agent {name}"))?;
        a.child
            .take()
            .with_context(|| format!("agent {name} is not running"))
    }

    pub fn kill_agent(&mut self, name: &str) -> anyhow::Result<()> {
        let mut child = self.take_agent_child(name)?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// SIGTERM to an agent (what systemd or a DaemonSet's rollout sends), then waits up to
    /// `grace` for it to exit (SIGKILL after that; then None). Its workloads keep running.
    pub fn stop_agent(
        &mut self,
        name: &str,
        grace: Duration,
    ) -> anyhow::Result<Option<ExitStatus>> {
        let mut child = self.take_agent_child(name)?;
        terminate(&mut child, grace)
    }

    pub fn agent_log(&self, name: &str) -> String {
        std::fs::read_to_string(&self.agents[name].log_path).unwrap_or_default()
    }

    /// Adds the description of one more replica (not part of the initial peers).
    pub fn add_spare(&mut self, port: u16) -> u64 {
        let id = self.replicas.keys().last().copied().unwrap_or(0) + 1;
        self.replicas.insert(
            id,
            ReplicaProcess {
                id,
                addr: format!("127.0.0.1:{port}"),
                data_dir: self.root.join(format!("replica-{id}")),
                log_path: self.root.join(format!("replica-{id}.log")),
                program: None,
                metrics_addr: None,
                child: None,
            },
        );
        id
    }

    /// Describes replica `id` listening on `addr` (not started, not one of the initial peers),
    /// for callers that choose ids themselves (never reusing a removed replica's id).
    pub fn add_replica_at(&mut self, id: u64, addr: &str) -> anyhow::Result<()> {
        if self.replicas.contains_key(&id) {
            bail!("replica {id} is already described");
        }
        self.replicas.insert(
            id,
            ReplicaProcess {
                id,
                addr: addr.to_owned(),
                data_dir: self.root.join(format!("replica-{id}")),
                log_path: self.root.join(format!("replica-{id}.log")),
                program: None,
                metrics_addr: None,
                child: None,
            },
        );
        Ok(())
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.replicas.values().map(|r| r.addr.clone()).collect()
    }

    pub fn addr(&self, id: u64) -> String {
        self.replicas[&id].addr.clone()
    }

    pub fn start_all(&mut self) -> anyhow::Result<()> {
        let ids: Vec<u64> = self.replicas.keys().copied().collect();
        for id in ids {
            self.start(id, StartMode::Initial)?;
        }
        Ok(())
    }

    pub fn start(&mut self, id: u64, mode: StartMode) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.root)?;
        let security = self.security_args(
            &format!("replica-{id}"),
            IssueRequest::new(CertRole::Replica, format!("replica-{id}")),
        )?;
        let r = self
            .replicas
            .get_mut(&id)
            .with_context(|| format!("no replica {id}"))?;
        if r.child.is_some() {
            bail!("replica {id} is already running");
        }
        let log = File::options()
            .create(true)
            .append(true)
            .open(&r.log_path)
            .with_context(|| format!("opening {}", r.log_path.display()))?;
        let mut cmd = Command::new(r.program.as_ref().unwrap_or(&self.program));
        cmd.args(&self.program_args)
            .args([
                "--id",
                &id.to_string(),
                "--listen",
                &r.addr,
                "--cluster",
                &self.cluster,
            ])
            .arg("--data-dir")
            .arg(&r.data_dir)
            .args(&security)
            .args(&self.extra_args)
            .args(
                r.metrics_addr
                    .iter()
                    .flat_map(|a| ["--metrics-listen", a.as_str()]),
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(source_env(self.bind_source, &r.addr))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        match mode {
            StartMode::Initial => {
                cmd.args(["--peers", &self.initial_peers]);
            }
            StartMode::Join(via) => {
                cmd.args(["--join", &via]);
            }
            StartMode::Pristine => {}
        }
        set_parent_death_signal(&mut cmd);
        r.child = Some(
            cmd.spawn()
                .with_context(|| format!("starting replica {id}"))?,
        );
        Ok(())
    }

    /// Sends `signal` to a replica; for SIGKILL also reaps it.
    pub fn signal(&mut self, id: u64, signal: i32) -> anyhow::Result<()> {
        let r = self
            .replicas
            .get_mut(&id)
            .with_context(|| format!("no replica {id}"))?;
        let child = r
            .child
            .as_mut()
            .with_context(|| format!("replica {id} is not running"))?;
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        let rc = unsafe { libc::kill(child.id() as i32, signal) };
        if rc != 0 {
            bail!(
                "kill({}, {signal}) failed: {}",
                child.id(),
                std::io::Error::last_os_error()
            );
        }
        if signal == libc::SIGKILL {
            child.wait()?;
            r.child = None;
        }
        Ok(())
    }

    pub fn kill(&mut self, id: u64) -> anyhow::Result<()> {
        self.signal(id, libc::SIGKILL)
    }

    /// SIGTERM, then waits up to `grace` for a clean exit (SIGKILL after that).
    pub fn stop(&mut self, id: u64, grace: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let r = self
            .replicas
            .get_mut(&id)
            .with_context(|| format!("no replica {id}"))?;
        let Some(mut child) = r.child.take() else {
            return Ok(None);
        };
        terminate(&mut child, grace)
    }

    pub fn is_running(&self, id: u64) -> bool {
        self.replicas.get(&id).is_some_and(|r| r.child.is_some())
    }

    /// Reaps replicas that exited by themselves; returns (id, status) of each.
    pub fn reap_exited(&mut self) -> Vec<(u64, ExitStatus)> {
        let mut exited = Vec::new();
        for r in self.replicas.values_mut() {
            if let Some(c) = r.child.as_mut()
                && let Ok(Some(s)) = c.try_wait()
            {
                exited.push((r.id, s));
                r.child = None;
            }
        }
        exited
    }

    /// Waits for a replica that exits by itself (e.g. one refusing a bad data directory).
    pub fn wait_exit(&mut self, id: u64, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let r = self
            .replicas
            .get_mut(&id)
            .with_context(|| format!("no replica {id}"))?;
        let child = r
            .child
            .as_mut()
            .with_context(|| format!("replica {id} is not running"))?;
        loop {
            if let Some(s) = child.try_wait()? {
                r.child = None;
                return Ok(s);
            }
            if Instant::now() >= deadline {
                bail!("replica {id} is still running after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log(&self, id: u64) -> String {
        std::fs::read_to_string(&self.replicas[&id].log_path).unwrap_or_default()
    }

    /// A client that talks to the given replica only, as the cluster's admin.
    pub fn client_for(&self, id: u64) -> anyhow::Result<Client> {
        Client::new(&[self.addr(id)], &self.credentials()?)
    }

    /// A client over every replica, as the cluster's admin.
    pub fn client(&self) -> anyhow::Result<Client> {
        Client::new(&self.endpoints(), &self.credentials()?)
    }

    pub async fn status(&self, id: u64) -> Option<pb::ClusterStatusResponse> {
        let mut c = self.client_for(id).ok()?;
        c.deadline = Duration::from_millis(500);
        c.attempt_timeout = Duration::from_millis(500);
        c.call(|mut c, t| async move {
            c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
                .await
        })
        .await
        .ok()
    }

    /// Waits until every agent in `names` has registered its node completely: ready, with
    /// `gpus` GPUs where given, and with its agent's release on record. A node that registered
    /// in the cluster's first moments, before its version rose to 2, has no agent release,
    /// enforcement or container engine on record until its agent registers again (told so by
    /// the next heartbeat); a container job submitted before then is refused as one no node
    /// can ever run.
    pub async fn wait_for_nodes(
        &self,
        names: &[String],
        gpus: Option<usize>,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let mut client = self.client()?;
        let deadline = Instant::now() + timeout;
        loop {
            let nodes = client
                .call(|mut c, t| async move {
                    c.list_nodes(with_timeout(pb::ListNodesRequest::default(), t))
                        .await
                })
                .await?
                .nodes;
            let complete = |n: &String| {
                nodes.iter().any(|x| {
                    &x.name == n
                        && x.status == "ready"
                        && gpus.is_none_or(|g| x.gpus.len() == g)
                        && !x.agent_release.is_empty()
                })
            };
            if names.iter().all(complete) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let seen: Vec<(&str, &str)> = nodes
                    .iter()
                    .map(|n| (n.name.as_str(), n.status.as_str()))
                    .collect();
                bail!(
                    "nodes {names:?} not all registered within {timeout:?}; the control plane has {seen:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every running replica names the same live leader; returns its status.
    pub async fn wait_for_leader(
        &self,
        timeout: Duration,
    ) -> anyhow::Result<pb::ClusterStatusResponse> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut statuses = Vec::new();
            // Running replicas that did not answer this round.
            let mut silent = Vec::new();
            for id in self
                .replicas
                .keys()
                .copied()
                .filter(|id| self.is_running(*id))
            {
                let s = self.status(id).await;
                // A replica removed from the cluster takes no part any more.
                if s.as_ref().is_some_and(|s| !s.removed.is_empty()) {
                    continue;
                }
                if s.is_none() {
                    silent.push(id);
                }
                statuses.push(s);
            }
            if let Some(Some(first)) = statuses.first() {
                let leader = first.leader;
                let agreed = leader != 0
                    && self.is_running(leader)
                    && statuses
                        .iter()
                        .all(|s| s.as_ref().is_some_and(|s| s.leader == leader));
                if agreed
                    && let Some(s) = self.status(leader).await
                    && s.leader == leader
                {
                    return Ok(s);
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "no agreed leader within {timeout:?} (statuses: {statuses:?}){}",
                    self.log_tails(&silent)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// For an error: the last lines of the log of each of the replicas `silent`, which did
    /// not answer (one that could not bind its port, or crashed at start, says why there).
    fn log_tails(&self, silent: &[u64]) -> String {
        const LINES: usize = 5;
        let mut out = String::new();
        for (id, r) in silent
            .iter()
            .filter_map(|id| self.replicas.get_key_value(id))
        {
            let text = std::fs::read_to_string(&r.log_path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(LINES)..].join("\n  ");
            out.push_str(&format!(
                "\nreplica {id} does not answer; the end of {}:\n  {tail}",
                r.log_path.display()
            ));
        }
        out
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for a in self.agents.values_mut() {
            if let Some(mut c) = a.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        // Workloads outlive their agent by design; stop every shim the agents left behind.
        for a in self.agents.values() {
            kill_workloads(&a.state_dir);
        }
        let ids: Vec<u64> = self.replicas.keys().copied().collect();
        for id in &ids {
            if let Some(c) = self.replicas.get(id).and_then(|r| r.child.as_ref()) {
                // SAFETY: as in `signal`.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            }
        }
        for id in ids {
            let _ = self.stop(id, Duration::from_secs(5));
        }
    }
}

/// SIGTERM to a child, then SIGKILL if it has not exited within `grace`; reaps it. Returns
/// its exit status, or None when it took the SIGKILL.
fn terminate(child: &mut Child, grace: Duration) -> anyhow::Result<Option<ExitStatus>> {
    // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if Instant::now() >= deadline {
            child.kill()?;
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The `GPUCP_SOURCE_ADDRESS` setting for a process listening on `addr`, when asked for.
fn source_env(bind: bool, addr: &str) -> Option<(&'static str, String)> {
    let host = addr.rsplit_once(':').map(|(h, _)| h)?;
    bind.then(|| (proto::transport::SOURCE_ADDRESS_ENV, host.to_owned()))
}

/// Children die with their parent, even one killed with SIGKILL.
fn set_parent_death_signal(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches only the child being set up.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
    }
}

/// Kills the process groups of every workload recorded under an agent's state directory
/// (used when a local cluster is torn down; a real host keeps them).
pub fn kill_workloads(agent_state_dir: &Path) {
    let Ok(records) = node_agent::runtime::read_usage_journal(
        &agent_state_dir.join("runtime").join("gpu-usage.jsonl"),
    ) else {
        return;
    };
    for r in records {
        if let node_agent::runtime::UsageRecord::Start { pid, .. } = r {
            // Only a live shim of this agent (its command line names the state directory):
            // the pid of a finished one may belong to an unrelated process by now.
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains("shim") && cmdline.contains(&*agent_state_dir.to_string_lossy()) {
                // SAFETY: kill(2) with a negative pid signals the shim's process group.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            }
        }
    }
    // A container job's processes are the engine's children, not the shim's.
    let runtime_dir = agent_state_dir.join("runtime");
    let had_containers = std::fs::read_to_string(runtime_dir.join("allocations.log"))
        .is_ok_and(|log| log.contains("\"container\""));
    if had_containers {
        node_agent::runtime::container_runner::remove_all_of_blocking(None, &runtime_dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_port_blocks_are_disjoint_reserved_and_clear_of_the_avoided_ranges() {
        let ephemeral = (32_768, 60_999);
        let blocks: Vec<ServicePortBlock> = (0..3)
            .map(|_| ServicePortBlock::reserve_outside(&[ephemeral, AVOIDED]).expect("a block"))
            .collect();
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(b.last - b.first + 2, SERVICE_PORT_BLOCK, "{b:?}");
            for (a, z) in [ephemeral, AVOIDED] {
                assert!(b.last < a || b.first > z, "{b:?} overlaps {a}-{z}");
            }
            // The port before the range holds the reservation.
            assert!(TcpListener::bind(("127.0.0.1", b.first - 1)).is_err());
            for other in &blocks[i + 1..] {
                assert!(b.last < other.first - 1 || other.last < b.first - 1);
            }
        }
        assert_eq!(
            blocks[0].range(),
            format!("{}-{}", blocks[0].first, blocks[0].last)
        );
        // Nowhere left: none.
        assert!(ServicePortBlock::reserve_outside(&[(0, u16::MAX)]).is_none());
    }
}
