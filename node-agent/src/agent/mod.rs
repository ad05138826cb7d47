//! The agent's main loop: register the host, heartbeat, follow the leader's assignment
//! stream, reconcile it against the runtime, report starts, exits and GPU faults, and fence
//! itself (stop every workload) when its lease to the control plane expires.
//!
//! Tasks, each waiting on its work and on shutdown:
//! - session: register, then heartbeat every interval; re-register when told the node is
//!   unknown or was declared lost;
//! - assignments: find the leader, stream the desired set, reconcile on every set;
//! - tick (every 100 ms, and at once when a shim exits or a launch was made): poll the
//!   runtime (exits, stop escalation, time limits), re-run reconcile (a launch waiting for a
//!   GPU whose old process is still stopping), check the lease;
//! - reports: send starts and exits in order, retrying; an exit is forgotten only once the
//!   control plane has acknowledged it, so it is reported exactly once in effect. Reports of
//!   distinct allocations go out together (see `report_loop`);
//! - GPU events: classify Xids, report health, stop what ran on a failed GPU;
//! - replica watches (`replicas`): one task per running service replica with probes or an
//!   autoscaling gauge, started and ended by the tick; readiness changes go out as reports
//!   (after the replica's start), a failed liveness probe stops the replica as failed, gauge
//!   values ride the heartbeats.
//!
//! An assignment not to be started before its `start_after_ms` (a replica restarting after
//! its back-off) waits in the desired set: reconcile launches it once due, the tick loop
//! wakes for that moment, and a stop before then reports it stopped without starting it.

mod checks;
pub mod cli;
pub mod containers;
pub mod control;
mod devices;
mod gauge;
mod gpu_usage;
mod http;
pub mod metrics;
mod output_files;
mod probes;
pub mod reconcile;
mod replicas;
pub mod restart;
mod service;
pub mod task_env;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use proto::agent as pa;
use tokio::sync::Notify;

use crate::gpu::simulated::SimulatedBackend;
use crate::gpu::{GpuBackend, GpuEvent, HostInventory};
use crate::health;
use crate::runtime::process::now_ms;
use crate::runtime::{
    ExitKind, GpuShare, LaunchSpec, Runtime, RuntimeConfig, RuntimeEvent, StopReason,
};
use control::ControlPlane;
use reconcile::{Action, Fence, reconcile};

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Node name, unique in the cluster.
    pub name: String,
    /// Control-plane replicas (any will do).
    pub control_plane: Vec<String>,
    /// Where this agent serves its own API (logs, fault injection).
    pub listen: String,
    /// Address the control plane and gpuctl use to reach this agent.
    pub advertise: String,
    pub state_dir: PathBuf,
    pub partition: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Program (and leading arguments) that runs the supervisor shim.
    pub shim_program: PathBuf,
    pub shim_args: Vec<String>,
    /// Fork shims from a launcher (see `runtime::launcher`) rather than exec each one.
    pub shim_launcher: bool,
    /// SIGTERM → SIGKILL grace when stopping a workload.
    pub stop_grace: Duration,
    /// SIGTERM → SIGKILL grace when fencing (lease expired); below the control plane's node
    /// grace, which registration checks.
    pub fence_grace: Duration,
    /// TLS with the node's certificate (or plaintext with --insecure), both ways.
    pub transport: proto::transport::Transport,
    /// How this agent starts itself again for an in-place restart; `None` where it runs
    /// inside another program (tests), which then cannot restart it.
    pub reexec: Option<restart::Reexec>,
    pub cgroups: CgroupMode,
    pub containers: containers::ContainerOptions,
    /// Plain HTTP address for `/metrics`, `/healthz` and `/readyz` (`agent::http`); none: off.
    pub metrics_listen: Option<String>,
    /// Host ports the node hands to tasks with named ports (`--service-ports`); none: such
    /// tasks are not placed here.
    pub service_ports: Option<cli::ServicePorts>,
}

/// Whether allocations get cgroups of their own (`--cgroups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CgroupMode {
    /// Where the host allows; otherwise the node registers as unenforced, saying why.
    Auto,
    /// The agent does not start without them.
    Require,
    /// Never: the node registers as unenforced.
    Off,
}

/// Sets up enforcement as `mode` asks. Returns the cgroups to use (if any) and the line the
/// node registers with: what is enforced, or "unenforced: why".
/// The node's parent cgroup is `gpucp/<node>.<incarnation prefix>`: one per agent state
/// directory, so several simulated hosts on one machine (or two test clusters that both
/// have a node "n1") never share allocation cgroups.
fn setup_enforcement(
    mode: CgroupMode,
    node: &str,
    incarnation: &str,
) -> anyhow::Result<(Option<crate::cgroup::Cgroups>, String)> {
    if mode == CgroupMode::Off {
        tracing::warn!(
            "cgroups are off (--cgroups off): jobs are not confined to their GPUs, CPUs or memory, and a cancel may leave processes behind"
        );
        return Ok((None, "unenforced: --cgroups off".into()));
    }
    let short = incarnation.get(..8).unwrap_or(incarnation);
    let parent = std::path::Path::new("gpucp").join(format!("{node}.{short}"));
    match crate::cgroup::Cgroups::detect(&parent) {
        Ok(c) => {
            let line = c.capabilities();
            tracing::info!(enforcement = %line, "each allocation gets a cgroup of its own");
            if let Err(why) = c.devices_enforced() {
                tracing::warn!(reason = %why, "device nodes are NOT confined on this host: a job can open every GPU's device node, whatever CUDA_VISIBLE_DEVICES says");
            }
            Ok((Some(c), line))
        }
        Err(e) if mode == CgroupMode::Require => anyhow::bail!(
            "--cgroups require: {e}. Run the agent as root on a host with a writable cgroup hierarchy, or use --cgroups auto to register the node as unenforced"
        ),
        Err(e) => {
            tracing::warn!(reason = %e, "cgroups cannot be used: this node registers as UNENFORCED (jobs are not confined to their GPUs, CPUs or memory); --cgroups require refuses to start instead");
            Ok((None, format!("unenforced: {e}")))
        }
    }
}

/// Why [`run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// The shutdown future resolved (SIGTERM, Ctrl-C).
    Shutdown,
    /// An in-place restart was asked for: the caller executes the agent's program again.
    Restart,
}

/// This agent's release, reported at registration and by the Info RPC.
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");

const TICK: Duration = Duration::from_millis(100);
/// How often the agent looks at its TLS files for a change (SIGHUP rereads at once).
const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// A report waiting to be acknowledged by the control plane. One ordered queue for both
/// kinds, so a GPU's health reaches the control plane before the exit of the job it killed
/// (otherwise the freed GPU could be placed on while still marked healthy).
#[derive(Debug, Clone)]
enum Report {
    Allocation(AllocationReport),
    Health(pa::GpuHealthReport),
}

#[derive(Debug, Clone)]
struct AllocationReport {
    allocation_id: u64,
    event: pa::allocation_report::Event,
    exit_code: Option<i32>,
    signal: i32,
    reason: String,
    /// An exit: forget the allocation once acknowledged.
    exit: bool,
    /// What the allocation's cgroup measured (exits on an enforcing node).
    usage: Option<crate::cgroup::Usage>,
    /// What the driver saw it use of its GPUs (exits on an NVML host).
    gpu_usage: Option<gpu_usage::GpuUsage>,
}

/// Why the agent stopped an allocation, so its exit is reported with the right meaning.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StopCause {
    NotAssigned,
    Fenced,
    /// The GPU failed under the job: requeue it elsewhere.
    GpuFault(String),
    /// An application error (e.g. Xid 13): the job fails, the GPU stays healthy.
    JobFault(String),
    /// The replica's liveness probe failed (the reason says how): it fails, and the
    /// control plane restarts it.
    Liveness(String),
}

struct State {
    runtime: Runtime,
    fence: Fence,
    last_set: Option<pa::Assignments>,
    finished: BTreeSet<u64>,
    stopping: HashMap<u64, StopCause>,
    reports: VecDeque<Report>,
    /// When the last heartbeat that succeeded was sent; the lease counts from there.
    lease_renewed: Option<Instant>,
    lease: Duration,
    fenced: bool,
    /// job id → latest allocation id on this node (for `gpuctl logs`).
    job_allocations: BTreeMap<u64, u64>,
    /// GPU use of the live allocations, from the driver's per-process samples.
    gpu_usage: gpu_usage::GpuUsageTracker,
    /// Allocations found running when the agent started (re-adopted): the control plane may
    /// hold either readiness for them.
    adopted: BTreeSet<u64>,
    /// Assignments waiting for their start time (so each wait is logged once).
    waiting: BTreeSet<u64>,
}

impl State {
    /// Whether what a replica's watch finds still matters: the replica runs, is not being
    /// stopped (a stopping or ended replica is unready anyway) and the agent is not fenced.
    fn watchable(&self, allocation: u64) -> bool {
        !self.fenced
            && !self.finished.contains(&allocation)
            && !self.stopping.contains_key(&allocation)
            && !self.runtime.is_stopping(allocation)
            && self.runtime.started_at_ms(allocation).is_some()
    }
}

pub struct Agent {
    config: AgentConfig,
    /// Random id kept in the state directory; tells this agent apart from another one that
    /// claims the same node name.
    incarnation: String,
    inventory: HostInventory,
    state: Mutex<State>,
    reports_ready: Notify,
    /// Asks for a tick now (a launch's start is then reported without waiting for the timer).
    tick_now: Notify,
    simulated: Option<Arc<SimulatedBackend>>,
    /// When this execution of the agent started (an in-place restart keeps the pid, so this
    /// is what tells the restarted agent from the old one).
    started_at_ms: u64,
    /// Set by the Restart RPC; stops the server, after which [`run`] returns `Restart`.
    restart: Notify,
    restart_requested: std::sync::atomic::AtomicBool,
    /// A simulated host's GPU device nodes: real character devices with NVIDIA's major and
    /// each GPU's index as minor (and its MIG slices' capability nodes), so device
    /// confinement can be shown without a GPU.
    device_dir: Option<PathBuf>,
    /// The driver's MIG capability table (`/proc/driver/nvidia-caps/mig-minors`, or a
    /// simulated host's), read at start: which `nvidia-caps` minors each slice opens.
    mig_minors: crate::cgroup::mig_caps::MigMinors,
    /// What this node enforces on its allocations ("cgroup v1: devices, memory, cpu, cpuset"),
    /// or "unenforced: why"; sent with every registration.
    enforcement: String,
    /// The container engine jobs run in ("docker 20.10.24 (cgroupfs)"); empty: none.
    container_runtime: String,
    /// Registrations so far. The assignment stream opens after the first: a registration
    /// drops the sets received before it, so a stream opened earlier would leave the agent
    /// without a set (not ready) until the leader re-sends it a second later.
    registrations: tokio::sync::watch::Sender<u64>,
    /// Prometheus series (`agent::metrics`).
    metrics: metrics::AgentMetrics,
    /// The watches over running service replicas (`agent::replicas`).
    watches: Mutex<replicas::Watches>,
    /// The latest gauge value of each autoscaled replica, sent with every heartbeat.
    gauges: Mutex<BTreeMap<u64, pa::ReplicaMetric>>,
    /// When the earliest waiting assignment is due (ms since the epoch; 0: none waits): the
    /// tick loop wakes then.
    next_launch_at: AtomicU64,
}

impl Agent {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("agent state lock poisoned")
    }

    /// Asks [`run`] to stop serving and return [`Stopped::Restart`]; the Restart RPC in
    /// progress is answered first (the server drains in-flight calls before it stops).
    fn request_restart(&self) {
        self.restart_requested
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.restart.notify_one();
    }

    /// Registered, within its lease, and holding an assignment set of the current leader:
    /// what a restarted agent must reach before a rollout moves to the next node.
    /// Sets the series that are levels, not events, just before a scrape.
    fn refresh_levels(&self) {
        let running = self.lock().runtime.live().len();
        self.metrics.allocations_running.set(running as i64);
        self.metrics.registered.set(i64::from(self.ready()));
    }

    fn ready(&self) -> bool {
        let st = self.lock();
        !st.fenced
            && st.last_set.is_some()
            && st.lease_renewed.is_some_and(|t| t.elapsed() < st.lease)
    }

    fn lease_file(&self) -> PathBuf {
        self.config.state_dir.join("lease")
    }

    /// Writes the lease expiry (ms since the epoch) where the shims can read it: a shim whose
    /// agent died or lost the control plane stops its workload when the lease passes.
    fn publish_lease(&self, expires_at_ms: u64) {
        let tmp = self.config.state_dir.join("lease.tmp");
        if std::fs::write(&tmp, expires_at_ms.to_string())
            .and_then(|_| std::fs::rename(&tmp, self.lease_file()))
            .is_err()
        {
            tracing::warn!("could not write the lease file; shims may fence early");
        }
    }

    fn registration(&self) -> pa::RegisterNodeRequest {
        let inv = &self.inventory;
        pa::RegisterNodeRequest {
            name: self.config.name.clone(),
            gpus: inv
                .gpus
                .iter()
                .map(|g| pa::GpuInfo {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    pci_bus_id: g.pci_bus_id.clone(),
                    numa_node: g.numa_node.map(|n| n as i32).unwrap_or(-1),
                    mig_enabled: g.mig_enabled,
                    mig_instances: g
                        .mig_instances
                        .iter()
                        .map(|m| pa::MigInstance {
                            uuid: m.uuid.clone(),
                            profile: m.profile.clone(),
                            memory_mib: m.memory_mib,
                        })
                        .collect(),
                })
                .collect(),
            topology: inv
                .topology
                .links
                .iter()
                .map(|row| pa::LinkRow {
                    links: row.iter().map(|l| l.to_string()).collect(),
                })
                .collect(),
            cpu_milli: inv.cpu_milli,
            memory_mib: inv.memory_mib,
            partition: self.config.partition.clone().unwrap_or_default(),
            labels: self.config.labels.clone().into_iter().collect(),
            agent_address: self.config.advertise.clone(),
            driver: inv.driver.clone(),
            fence_grace_ms: self.config.fence_grace.as_millis() as u64,
            incarnation: self.incarnation.clone(),
            agent_release: RELEASE.to_owned(),
            enforcement: self.enforcement.clone(),
            container_runtime: self.container_runtime.clone(),
            service_ports: self.config.service_ports.map(|r| pa::PortRange {
                first: u32::from(r.first),
                last: u32::from(r.last),
            }),
        }
    }

    /// The gauges to send with a heartbeat: the latest of each running replica (`running`),
    /// or why it is missing when its scrapes stopped coming (a stuck scrape must not pass an
    /// old value off as current: the leader dates a value by the heartbeat that carries it).
    /// Gauges of allocations no longer running are dropped (one a watch's last scrape left).
    fn heartbeat_gauges(&self, now_ms: u64, running: &[u64]) -> Vec<pa::ReplicaMetric> {
        let mut gauges = self.gauges.lock().expect("gauges lock poisoned");
        gauges.retain(|id, _| running.contains(id));
        gauges.values().map(|m| gauge_as_sent(m, now_ms)).collect()
    }

    /// Starts a watch for each running replica that has probes or a gauge and ends those of
    /// replicas no longer running. `live` is the runtime's set taken with the events whose
    /// starts the caller has just queued, so every replica watched has its STARTED queued
    /// before anything its probes report.
    fn sync_watches(self: &Arc<Self>, live: &[u64]) {
        let (wanted, may_start) = {
            let st = self.lock();
            let set = st.last_set.as_ref();
            let wanted: BTreeSet<u64> = live
                .iter()
                .copied()
                .filter(|id| {
                    !st.stopping.contains_key(id)
                        && !st.finished.contains(id)
                        // Stopped by an earlier life of the agent (e.g. for its liveness).
                        && !st.runtime.is_stopping(*id)
                })
                .filter(|id| match set {
                    Some(set) => set.allocations.iter().any(|a| {
                        a.allocation_id == *id
                            && !a.stop
                            && a.replica.as_ref().is_some_and(replicas::wants_watch)
                    }),
                    // No set now (a restart, a new registration): keep what runs.
                    None => true,
                })
                .collect();
            (wanted, set.is_some() && !st.fenced)
        };
        let sink: Arc<dyn replicas::ReplicaSink> = self.clone();
        let ended = {
            let mut watches = self.watches.lock().expect("watches lock poisoned");
            watches.sync(
                &wanted,
                may_start,
                |id, watched_before| {
                    let st = self.lock();
                    let a = st
                        .last_set
                        .as_ref()?
                        .allocations
                        .iter()
                        .find(|a| a.allocation_id == id)?;
                    let fresh = !watched_before && !st.adopted.contains(&id);
                    Some(replicas::WatchSpec {
                        allocation_id: id,
                        replica: a.replica.clone()?,
                        started_at_ms: st.runtime.started_at_ms(id)?,
                        readiness: if fresh {
                            probes::Status::Failing
                        } else {
                            probes::Status::Unknown
                        },
                        exec: st.runtime.exec_target(id),
                    })
                },
                &sink,
            )
        };
        if !ended.is_empty() {
            let mut gauges = self.gauges.lock().expect("gauges lock poisoned");
            for id in ended {
                gauges.remove(&id);
            }
        }
    }

    fn queue_exit(&self, st: &mut State, report: AllocationReport) {
        self.metrics.exited(report.event);
        st.reports.push_back(Report::Allocation(report));
        self.reports_ready.notify_one();
    }

    fn queue_report(&self, report: Report) {
        self.lock().reports.push_back(report);
        self.reports_ready.notify_one();
    }

    /// Applies the latest admitted assignment set (unless fenced).
    fn reconcile_now(&self) {
        let mut st = self.lock();
        if st.fenced {
            return;
        }
        let Some(set) = st.last_set.clone() else {
            return;
        };
        let live: BTreeSet<u64> = st.runtime.live().into_iter().collect();
        let stopping: BTreeSet<u64> = st.stopping.keys().copied().collect();
        let actions = reconcile(&set, &live, &st.finished, &stopping, now_ms());
        tracing::trace!(?live, stops = ?set.allocations.iter().filter(|a| a.stop).map(|a| a.allocation_id).collect::<Vec<_>>(), ?actions, "reconcile");
        let mut waiting = BTreeSet::new();
        let mut next_due = u64::MAX;
        for action in actions {
            match action {
                Action::Wait { id, until_ms } => {
                    if !st.waiting.contains(&id) {
                        tracing::info!(
                            allocation = id,
                            in_ms = until_ms.saturating_sub(now_ms()),
                            "not to be started yet (a restart's back-off): waiting"
                        );
                    }
                    waiting.insert(id);
                    next_due = next_due.min(until_ms);
                }
                Action::Stop(id) => {
                    tracing::info!(allocation = id, "no longer assigned: stopping");
                    st.stopping.insert(id, StopCause::NotAssigned);
                    if let Err(e) = st.runtime.stop(id, StopReason::Requested) {
                        tracing::warn!(allocation = id, error = %e, "stop failed");
                    }
                }
                Action::Abandon(id) => {
                    tracing::info!(allocation = id, "stopped before it started here");
                    st.waiting.remove(&id);
                    st.finished.insert(id);
                    self.queue_exit(
                        &mut st,
                        AllocationReport::exit(id, pa::allocation_report::Event::Stopped, ""),
                    );
                }
                Action::Launch(a) => {
                    if let Some(foreign) =
                        a.gpus.iter().find(|g| {
                            !self.inventory.gpus.iter().any(|x| {
                                &x.uuid == *g || x.mig_instances.iter().any(|m| &m.uuid == *g)
                            })
                        })
                    {
                        // Never run anything on a device this host does not have (e.g. two
                        // agents registered under one name).
                        tracing::error!(allocation = a.allocation_id, gpu = %foreign, "assignment names a GPU this host does not have");
                        st.finished.insert(a.allocation_id);
                        let reason = format!("GPU {foreign} is not on node {}", self.config.name);
                        self.queue_exit(
                            &mut st,
                            AllocationReport::exit(
                                a.allocation_id,
                                pa::allocation_report::Event::Failed,
                                &reason,
                            ),
                        );
                        continue;
                    }
                    let mut spec = launch_spec(&self.inventory, &self.mig_minors, &a);
                    let names = output_files::TaskNames {
                        job: a.job_id,
                        task: a.task_index,
                        node: &self.config.name,
                        job_name: &a.job_name,
                        array: (a.array_job_id > 0).then_some((a.array_job_id, a.array_task_id)),
                    };
                    let workdir = spec.workdir.clone();
                    let expand = |p: &str| output_files::expand(p, &names, workdir.as_deref());
                    spec.stdout_path = (!a.stdout_path.is_empty()).then(|| expand(&a.stdout_path));
                    spec.stderr_path = (!a.stderr_path.is_empty()).then(|| expand(&a.stderr_path));
                    if let Some(dir) = &self.device_dir {
                        // Where a simulated host's device nodes are (real hosts: /dev).
                        spec.env
                            .insert("GPUCP_DEVICE_DIR".into(), dir.display().to_string());
                    }
                    if let Err(busy @ crate::runtime::RuntimeError::GpuBusy { .. }) =
                        st.runtime.check_gpus_free(&spec)
                    {
                        // Its previous user is still stopping (or, for a share, the shares
                        // still running leave too little of the GPU); retried on the next tick.
                        tracing::debug!(allocation = a.allocation_id, error = %busy, "GPU still in use; launch deferred");
                        continue;
                    }
                    let launch_started = std::time::Instant::now();
                    let launched = st.runtime.launch(spec);
                    let took = launch_started.elapsed();
                    match launched {
                        Ok(()) => {
                            self.metrics.launched("ok", took);
                            tracing::info!(allocation = a.allocation_id, job = a.job_id, gpus = ?a.gpus, "launched");
                            st.job_allocations.insert(a.job_id, a.allocation_id);
                            self.tick_now.notify_one();
                        }
                        // Already started in this or an earlier life of the agent: never twice.
                        Err(crate::runtime::RuntimeError::AlreadyKnown(_)) => {}
                        // The assignment itself cannot be run (e.g. a share of two GPUs): it
                        // would fail the same way on any node, so the job fails rather than
                        // being requeued for ever.
                        Err(
                            e @ (crate::runtime::RuntimeError::InvalidSpec { .. }
                            | crate::runtime::RuntimeError::Container { .. }),
                        ) => {
                            tracing::warn!(allocation = a.allocation_id, error = %e, "launch refused");
                            self.metrics.launched("refused", took);
                            st.finished.insert(a.allocation_id);
                            let reason = format!("node {} cannot run it: {e}", self.config.name);
                            self.queue_exit(
                                &mut st,
                                AllocationReport::exit(
                                    a.allocation_id,
                                    pa::allocation_report::Event::Failed,
                                    &reason,
                                ),
                            );
                        }
                        Err(e) => {
                            // A fault of this host (spawn failure, full disk), not of the job:
                            // requeue it rather than fail it.
                            tracing::warn!(allocation = a.allocation_id, error = %e, "launch failed");
                            self.metrics.launched("failed", took);
                            st.finished.insert(a.allocation_id);
                            let reason =
                                format!("node {} could not start it: {e}", self.config.name);
                            self.queue_exit(
                                &mut st,
                                AllocationReport::exit(
                                    a.allocation_id,
                                    pa::allocation_report::Event::Lost,
                                    &reason,
                                ),
                            );
                        }
                    }
                }
            }
        }
        st.waiting = waiting;
        self.next_launch_at.store(
            if next_due == u64::MAX { 0 } else { next_due },
            Ordering::SeqCst,
        );
    }

    /// Stops every workload: the lease to the control plane has expired.
    fn fence(&self) {
        let mut st = self.lock();
        if st.fenced {
            return;
        }
        st.fenced = true;
        // Whatever was assigned before the lease expired may have been placed elsewhere since:
        // act again only on a set received after the lease is renewed.
        st.last_set = None;
        let live = st.runtime.live();
        tracing::warn!(
            running = live.len(),
            "lease expired: fencing (stopping every workload)"
        );
        for id in live {
            st.stopping.insert(id, StopCause::Fenced);
            if let Err(e) = st.runtime.stop(id, StopReason::Fenced) {
                tracing::warn!(allocation = id, error = %e, "stop failed");
            }
        }
    }

    fn tick(self: &Arc<Self>) {
        // Poll and record exits under one lock, so a reconcile in between never sees an
        // allocation that is neither live nor finished (and tries to start it again). What
        // runs is read under the same lock: its launches' starts are among these events.
        let (events, live) = {
            let mut st = self.lock();
            let events = st.runtime.poll();
            for ev in &events {
                if let RuntimeEvent::Exited { allocation_id, .. } = ev {
                    st.finished.insert(*allocation_id);
                }
            }
            (events, st.runtime.live())
        };
        for ev in events {
            match ev {
                RuntimeEvent::Started { allocation_id, pid } => {
                    tracing::debug!(allocation = allocation_id, pid, "started");
                    self.queue_report(Report::Allocation(AllocationReport {
                        allocation_id,
                        event: pa::allocation_report::Event::Started,
                        exit_code: None,
                        signal: 0,
                        reason: String::new(),
                        exit: false,
                        usage: None,
                        gpu_usage: None,
                    }));
                }
                RuntimeEvent::Exited {
                    allocation_id,
                    kind,
                    usage,
                    failure,
                    ..
                } => {
                    let cause = {
                        let mut st = self.lock();
                        st.finished.insert(allocation_id);
                        st.adopted.remove(&allocation_id);
                        st.stopping.remove(&allocation_id)
                    };
                    // The runtime kept the failure it was stopped for: an agent restarted
                    // during the stop still reports it as that failure.
                    let cause = cause.or_else(|| failure.map(StopCause::Liveness));
                    let mut report = exit_report(allocation_id, &kind, cause);
                    report.usage = usage;
                    report.gpu_usage = self.lock().gpu_usage.take(allocation_id);
                    tracing::info!(allocation = allocation_id, ?kind, event = ?report.event, "exited");
                    self.metrics.exited(report.event);
                    self.queue_report(Report::Allocation(report));
                }
            }
        }
        let expired = {
            let st = self.lock();
            !st.fenced && st.lease_renewed.is_some_and(|t| t.elapsed() > st.lease)
        };
        if expired {
            self.fence();
        }
        // After the starts above are queued: a watch's first report follows its STARTED.
        self.sync_watches(&live);
        self.reconcile_now();
    }

    fn on_gpu_event(&self, event: GpuEvent) {
        let verdict = health::gpu_health_after(&event);
        let (uuid, xid) = match &event {
            GpuEvent::Xid { gpu_uuid, code, .. } => (gpu_uuid.clone(), *code),
            GpuEvent::FellOffBus { gpu_uuid } | GpuEvent::Recovered { gpu_uuid } => {
                (gpu_uuid.clone(), 0)
            }
        };
        tracing::warn!(gpu = %uuid, ?event, ?verdict, "GPU event");
        if let GpuEvent::Xid { code, .. } = &event {
            self.metrics.xid(&uuid, *code);
        }
        if verdict.gpu_unhealthy || verdict.gpu_recovered {
            self.metrics
                .set_gpu_health(&self.inventory, &uuid, !verdict.gpu_unhealthy);
        }
        // Health first, then the stop: the control plane must cordon the GPU before the job's
        // exit frees it.
        if verdict.gpu_unhealthy || verdict.gpu_recovered {
            self.queue_report(Report::Health(pa::GpuHealthReport {
                node: self.config.name.clone(),
                gpu_uuid: uuid.clone(),
                healthy: !verdict.gpu_unhealthy,
                reason: verdict.reason.clone(),
                xid,
            }));
        }
        let mut st = self.lock();
        let on_gpu = st.runtime.allocations_on(&uuid);
        for (id, cause) in fault_stops(&verdict, &on_gpu) {
            st.stopping.insert(id, cause);
            if let Err(e) = st.runtime.stop(id, StopReason::GpuFault) {
                tracing::warn!(allocation = id, error = %e, "stop failed");
            }
        }
    }
}

/// What the replica watches find, acted on (while [`State::watchable`]): readiness changes
/// become reports, a failed liveness probe stops the replica as failed; gauges wait for the
/// next heartbeat.
impl replicas::ReplicaSink for Agent {
    fn readiness(&self, allocation: u64, change: probes::Change) {
        use pa::allocation_report::Event;
        let (event, reason) = match change {
            probes::Change::Passing => (Event::Ready, String::new()),
            probes::Change::Failing { reason } => (Event::NotReady, reason),
        };
        let mut st = self.lock();
        if !st.watchable(allocation) {
            return;
        }
        tracing::info!(allocation, ?event, %reason, "replica readiness changed");
        st.reports.push_back(Report::Allocation(AllocationReport {
            allocation_id: allocation,
            event,
            exit_code: None,
            signal: 0,
            reason,
            exit: false,
            usage: None,
            gpu_usage: None,
        }));
        drop(st);
        self.reports_ready.notify_one();
    }

    fn liveness_failed(&self, allocation: u64, reason: String) {
        let reason = format!("liveness probe failed: {reason}");
        let mut st = self.lock();
        if !st.watchable(allocation) {
            return;
        }
        tracing::warn!(allocation, %reason, "stopping the replica");
        self.metrics.liveness_restarts.inc();
        st.stopping
            .insert(allocation, StopCause::Liveness(reason.clone()));
        if let Err(e) = st.runtime.stop_failed(allocation, reason) {
            tracing::warn!(allocation, error = %e, "stop failed");
        }
    }

    fn check_failed(&self, allocation: u64, kind: replicas::ProbeKind, reason: &str) {
        tracing::debug!(allocation, probe = kind.label(), %reason, "probe check failed");
        self.metrics.probe_failed(kind.label());
    }

    fn gauge(&self, allocation: u64, value: Result<f64, String>, at_ms: u64) {
        let (value, error) = match value {
            Ok(v) => (v, String::new()),
            Err(e) => {
                tracing::debug!(allocation, error = %e, "scraping the replica's gauge failed");
                self.metrics.scrape_failures.inc();
                (0.0, e)
            }
        };
        self.gauges.lock().expect("gauges lock poisoned").insert(
            allocation,
            pa::ReplicaMetric {
                allocation_id: allocation,
                value,
                error,
                at_ms,
            },
        );
    }
}

/// A replica's latest gauge as a heartbeat sends it at `now_ms`: as scraped, or, when the
/// scrape is more than five scrape periods old, an error saying so.
fn gauge_as_sent(m: &pa::ReplicaMetric, now_ms: u64) -> pa::ReplicaMetric {
    let stale_after = 5 * replicas::SCRAPE_EVERY.as_millis() as u64;
    let age = now_ms.saturating_sub(m.at_ms);
    if age <= stale_after {
        return m.clone();
    }
    pa::ReplicaMetric {
        value: 0.0,
        error: format!(
            "the agent's last scrape of the gauge was {} s ago",
            age / 1000
        ),
        ..m.clone()
    }
}

/// What the runtime launches for assignment `a`: its command and GPUs, its share of a GPU
/// (with the GPU's memory, so that the runtime can check that the shares fit), the parent
/// GPU of each MIG slice, as this host's inventory says, and the device minors its cgroup
/// allows (its MIG slices' from the driver's table `mig_minors`).
fn launch_spec(
    inventory: &HostInventory,
    mig_minors: &crate::cgroup::mig_caps::MigMinors,
    a: &pa::Assignment,
) -> LaunchSpec {
    let gpus = &inventory.gpus;
    let share = (a.gpu_milli > 0).then(|| GpuShare {
        milli: a.gpu_milli,
        memory_mib: a.gpu_memory_mib,
        gpu_memory_mib: a
            .gpus
            .first()
            .and_then(|uuid| gpus.iter().find(|g| &g.uuid == uuid))
            .map_or(0, |g| g.memory_mib),
    });
    let mig_parents = a
        .gpus
        .iter()
        .filter_map(|uuid| {
            gpus.iter()
                .find(|g| g.mig_instances.iter().any(|m| &m.uuid == uuid))
                .map(|g| (uuid.clone(), g.uuid.clone()))
        })
        .collect();
    let (mig_cap_minors, unknown) = devices::mig_cap_minors(inventory, mig_minors, &a.gpus);
    if !unknown.is_empty() {
        tracing::warn!(allocation = a.allocation_id, slices = ?unknown, "the driver's MIG table (mig-minors) does not describe these slices: a confined job cannot open them");
    }
    let mut env: BTreeMap<String, String> = a.env.clone().into_iter().collect();
    env.extend(task_env::task_env(
        a.job_id,
        a.task_index,
        &a.task_nodes,
        &a.task_hosts,
        &env,
    ));
    let ports: Vec<(String, u32)> = a.ports.iter().map(|p| (p.name.clone(), p.port)).collect();
    let place = a.replica.as_ref().map(|r| task_env::ReplicaPlace {
        service: &r.service,
        ordinal: r.ordinal,
        revision: r.revision,
    });
    env.extend(task_env::service_env(&ports, place.as_ref()));
    if a.array_job_id > 0 {
        env.extend(task_env::array_env(
            &task_env::ArrayPlace {
                array_id: a.array_job_id,
                index: a.array_task_id,
                count: a.array_task_count,
                min: a.array_task_min,
                max: a.array_task_max,
            },
            &env,
        ));
    }
    LaunchSpec {
        allocation_id: a.allocation_id,
        job_id: a.job_id,
        job_name: a.job_name.clone(),
        tenant: a.tenant.clone(),
        command: a.command.clone(),
        env,
        gpus: a.gpus.clone(),
        time_limit: (a.time_limit_secs > 0).then(|| Duration::from_secs(a.time_limit_secs)),
        share,
        mig_parents,
        cpu_milli: a.cpu_milli,
        memory_mib: a.memory_mib,
        gpu_minors: devices::gpu_minors(inventory, &a.gpus),
        mig_cap_minors,
        workdir: (!a.workdir.is_empty()).then(|| PathBuf::from(&a.workdir)),
        numa_node: shared_numa_node(inventory, &a.gpus),
        container: a.container.as_ref().map(container_spec),
        // Expanded by the caller, which knows the node.
        stdout_path: None,
        stderr_path: None,
    }
}

/// The driver's MIG capability table at `path`; empty (with a warning where the host has MIG
/// slices, whose confined jobs then cannot open them) when it cannot be read.
fn read_mig_minors(
    path: &std::path::Path,
    inventory: &HostInventory,
) -> crate::cgroup::mig_caps::MigMinors {
    let has_mig = inventory.gpus.iter().any(|g| !g.mig_instances.is_empty());
    match std::fs::read_to_string(path) {
        Ok(text) => crate::cgroup::mig_caps::MigMinors::parse(&text),
        Err(e) => {
            if has_mig {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the driver's MIG capability table: jobs on MIG slices are not granted their /dev/nvidia-caps nodes, and cannot use their slices where devices are confined");
            }
            Default::default()
        }
    }
}

/// The NUMA node all of `uuids` (GPUs, or MIG slices: their parent's) are attached to, if
/// they share one and it is known.
fn shared_numa_node(inventory: &HostInventory, uuids: &[String]) -> Option<u32> {
    let mut nodes = uuids.iter().map(|uuid| {
        inventory
            .gpus
            .iter()
            .find(|g| &g.uuid == uuid || g.mig_instances.iter().any(|m| &m.uuid == uuid))
            .and_then(|g| g.numa_node)
    });
    let first = nodes.next()??;
    nodes.all(|n| n == Some(first)).then_some(first)
}

/// The runtime's form of an assignment's container.
fn container_spec(c: &pa::WorkloadContainer) -> crate::runtime::container::ContainerSpec {
    crate::runtime::container::ContainerSpec {
        image: c.image.clone(),
        mounts: c
            .mounts
            .iter()
            .map(|m| crate::runtime::container::Mount {
                source: PathBuf::from(&m.source),
                target: PathBuf::from(&m.target),
                read_only: m.read_only,
            })
            .collect(),
    }
}

/// What a GPU event does to the allocations on that GPU (`on_gpu`: whole-GPU users, every
/// share of it, and those on its MIG slices): all of them stop when the event fails the job or
/// makes the GPU unhealthy. An MPS fault reaches every client of the GPU and the MPS server
/// takes no new client there until all of them have exited; the event names the GPU, not a
/// MIG instance. A GPU fault requeues them; an application error fails them, and when several
/// share the GPU the reason says the fault could not be pinned on one of them.
fn fault_stops(verdict: &health::HealthVerdict, on_gpu: &[u64]) -> Vec<(u64, StopCause)> {
    if !(verdict.job_fails || verdict.gpu_unhealthy) {
        return Vec::new();
    }
    let cause = if verdict.gpu_unhealthy {
        StopCause::GpuFault(verdict.reason.clone())
    } else if on_gpu.len() > 1 {
        StopCause::JobFault(format!(
            "{}; {} allocations share the GPU, and the fault reaches all of them without \
             saying which one caused it",
            verdict.reason,
            on_gpu.len()
        ))
    } else {
        StopCause::JobFault(verdict.reason.clone())
    };
    on_gpu.iter().map(|id| (*id, cause.clone())).collect()
}

impl AllocationReport {
    fn exit(
        allocation_id: u64,
        event: pa::allocation_report::Event,
        reason: &str,
    ) -> AllocationReport {
        AllocationReport {
            allocation_id,
            event,
            exit_code: None,
            signal: 0,
            reason: reason.to_owned(),
            exit: true,
            usage: None,
            gpu_usage: None,
        }
    }
}

fn exit_report(allocation_id: u64, kind: &ExitKind, cause: Option<StopCause>) -> AllocationReport {
    use pa::allocation_report::Event;
    let mut r = AllocationReport {
        allocation_id,
        event: Event::Failed,
        exit_code: None,
        signal: 0,
        reason: String::new(),
        exit: true,
        usage: None,
        gpu_usage: None,
    };
    match (kind, cause) {
        (ExitKind::Exited { code: 0 }, None) => r.event = Event::Succeeded,
        (ExitKind::Exited { code }, None) => {
            r.exit_code = Some(*code);
            r.reason = format!("exited with code {code}");
        }
        (ExitKind::Signaled { signal }, None) => {
            r.signal = *signal;
            r.reason = format!("killed by signal {signal}");
        }
        (ExitKind::TimedOut, _) => r.event = Event::TimedOut,
        (_, Some(StopCause::JobFault(reason) | StopCause::Liveness(reason))) => r.reason = reason,
        (_, Some(StopCause::GpuFault(reason))) => {
            r.event = Event::Lost;
            r.reason = reason;
        }
        (_, Some(StopCause::Fenced)) => {
            r.event = Event::Lost;
            r.reason = "the agent lost its lease to the control plane and stopped the job".into();
        }
        (_, Some(StopCause::NotAssigned)) | (ExitKind::Stopped, None) => r.event = Event::Stopped,
        (ExitKind::OutOfMemory { limit_mib }, None) => {
            r.signal = libc::SIGKILL;
            r.reason = format!(
                "out of memory: the job went past its memory limit of {limit_mib} MiB (--mem) and the kernel's OOM killer killed it"
            );
        }
        (ExitKind::Vanished { reason }, None) => {
            r.event = Event::Lost;
            r.reason = format!("process vanished: {reason}");
        }
    }
    r
}

/// Runs the agent until `shutdown` resolves or a restart is asked for. Workloads keep
/// running across an agent restart.
pub async fn run(
    config: AgentConfig,
    backend: Arc<dyn GpuBackend>,
    simulated: Option<Arc<SimulatedBackend>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Stopped> {
    std::fs::create_dir_all(&config.state_dir)
        .with_context(|| format!("creating state directory {}", config.state_dir.display()))?;
    let inventory = backend.inventory().context("discovering GPUs")?;
    tracing::info!(node = %config.name, gpus = inventory.gpus.len(), driver = %inventory.driver, "GPU inventory");
    let incarnation = load_or_create_incarnation(&config.state_dir)?;
    let (cgroups, enforcement) = setup_enforcement(config.cgroups, &config.name, &incarnation)?;
    let mut driver_majors = crate::cgroup::devices::DriverMajors::parse(
        &std::fs::read_to_string("/proc/devices").unwrap_or_default(),
    );
    let (device_dir, mig_minors_path) = match &simulated {
        Some(_) => {
            let dir = devices::simulated_nodes(&config.state_dir, &inventory);
            if dir.is_some() {
                // Its capability nodes have a major of their own, not the host's driver's.
                driver_majors.caps = Some(crate::cgroup::devices::SIMULATED_CAPS_MAJOR);
            }
            (dir, config.state_dir.join(devices::SIMULATED_MIG_MINORS))
        }
        None => (None, PathBuf::from(crate::cgroup::mig_caps::MIG_MINORS)),
    };
    let mig_minors = read_mig_minors(&mig_minors_path, &inventory);
    // The runner is a subcommand of the agent's own program (the dedicated shim binary
    // holds only the shim).
    let runner_program = std::env::current_exe().context("finding the agent's own executable")?;
    let container_runtime = containers::setup_containers(
        &config.containers,
        runner_program,
        Vec::new(),
        device_dir.clone().unwrap_or_else(|| PathBuf::from("/dev")),
    )
    .await?;
    let runtime = Runtime::open(RuntimeConfig {
        state_dir: config.state_dir.join("runtime"),
        shim_program: config.shim_program.clone(),
        shim_args: config.shim_args.clone(),
        launcher: config.shim_launcher,
        stop_grace: config.stop_grace,
        lease_file: Some(config.state_dir.join("lease")),
        fence_grace: config.fence_grace,
        cgroups,
        driver_majors,
        containers: container_runtime.clone(),
    })
    .context("opening the workload runtime")?;
    let readopted = runtime.live();
    if !readopted.is_empty() {
        tracing::info!(allocations = ?readopted, "re-adopted running workloads");
    }
    let adopted: BTreeSet<u64> = readopted.iter().copied().collect();
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let container_description = container_runtime
        .as_ref()
        .map(|c| c.description.clone())
        .unwrap_or_default();
    let metrics = metrics::AgentMetrics::new(
        &config.name,
        &inventory,
        &enforcement,
        &container_description,
    );
    let agent = Arc::new(Agent {
        metrics,
        incarnation,
        inventory,
        state: Mutex::new(State {
            runtime,
            fence: Fence::default(),
            last_set: None,
            finished: BTreeSet::new(),
            stopping: HashMap::new(),
            reports: VecDeque::new(),
            lease_renewed: None,
            lease: Duration::from_secs(5),
            fenced: false,
            job_allocations: load_job_index(&config.state_dir),
            gpu_usage: Default::default(),
            adopted,
            waiting: BTreeSet::new(),
        }),
        watches: Mutex::new(replicas::Watches::new(tokio::runtime::Handle::current())),
        gauges: Mutex::new(BTreeMap::new()),
        next_launch_at: AtomicU64::new(0),
        reports_ready: Notify::new(),
        tick_now: Notify::new(),
        simulated,
        config,
        started_at_ms: now_ms(),
        restart: Notify::new(),
        restart_requested: std::sync::atomic::AtomicBool::new(false),
        registrations: tokio::sync::watch::Sender::new(0),
        enforcement,
        container_runtime: container_description,
        device_dir,
        mig_minors,
    });
    let transport = agent.config.transport.clone();
    let restart_asked = {
        let agent = agent.clone();
        async move {
            tokio::select! {
                () = shutdown => {}
                () = agent.restart.notified() => {}
            }
        }
    };
    let control = ControlPlane::new(&agent.config.control_plane, &transport)?;
    let reloader = transport
        .tls()
        .map(|t| t.spawn_reloader(TLS_RELOAD_INTERVAL));

    let server = tonic::transport::Server::builder()
        .add_service(proto::agent::node_agent_server::NodeAgentServer::new(
            service::NodeAgentService::new(agent.clone()),
        ))
        .serve_with_incoming_shutdown(transport.incoming(listener), restart_asked);

    let metrics_port = match &agent.config.metrics_listen {
        Some(addr) => {
            let (bound, task) = crate::observe::serve(addr, http::router(agent.clone())).await?;
            tracing::info!(%bound, "metrics and health on http://{bound}/metrics");
            Some(task)
        }
        None => None,
    };
    let tasks = vec![
        tokio::spawn(session_loop(agent.clone(), control.clone())),
        tokio::spawn(assignment_loop(agent.clone(), control.clone())),
        tokio::spawn(tick_loop(agent.clone())),
        tokio::spawn(report_loop(agent.clone(), control.clone())),
        tokio::spawn(gpu_event_loop(agent.clone(), backend.clone())),
        tokio::spawn(gpu_usage_loop(agent.clone(), backend)),
    ];
    let served = server.await;
    for t in tasks.into_iter().chain(reloader).chain(metrics_port) {
        t.abort();
    }
    // Their tasks hold the agent (and so its runtime's lock on the state directory).
    agent.watches.lock().expect("watches lock poisoned").clear();
    save_job_index(&agent.config.state_dir, &agent.lock().job_allocations);
    tracing::info!("agent stopping; workloads keep running under their shims");
    served.context("serving the agent API")?;
    if agent
        .restart_requested
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        Ok(Stopped::Restart)
    } else {
        Ok(Stopped::Shutdown)
    }
}

/// A random id, created once and kept in the state directory.
fn load_or_create_incarnation(dir: &std::path::Path) -> anyhow::Result<String> {
    let path = dir.join("incarnation");
    if let Ok(s) = std::fs::read_to_string(&path)
        && !s.trim().is_empty()
    {
        return Ok(s.trim().to_owned());
    }
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .context("reading /dev/urandom")?;
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&path, &id).with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

fn load_job_index(dir: &std::path::Path) -> BTreeMap<u64, u64> {
    std::fs::read(dir.join("jobs.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn save_job_index(dir: &std::path::Path, index: &BTreeMap<u64, u64>) {
    if let Ok(bytes) = serde_json::to_vec(index) {
        let tmp = dir.join("jobs.json.tmp");
        let _ =
            std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, dir.join("jobs.json")));
    }
}

async fn session_loop(agent: Arc<Agent>, mut control: ControlPlane) {
    let mut backoff = Duration::from_millis(100);
    loop {
        // Register (again): first start, unknown to a new leader, or declared lost.
        let reg = agent.registration();
        let resp = control
            .call(CALL_TIMEOUT, |mut c| {
                let reg = reg.clone();
                async move { c.register_node(reg).await }
            })
            .await;
        let resp = match resp {
            Ok(r) => r,
            Err(s) => {
                tracing::warn!(code = ?s.code(), message = s.message(), "registration failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        let lease = Duration::from_millis(resp.lease_ms.max(1));
        let interval = Duration::from_millis(resp.heartbeat_interval_ms.max(10));
        {
            let mut st = agent.lock();
            st.lease = lease;
            st.lease_renewed = Some(Instant::now());
            st.fenced = false;
            // Act only on sets from streams of this registration's leader or later.
            st.last_set = None;
            st.fence.term = st.fence.term.max(resp.term);
        }
        agent.publish_lease(now_ms() + lease.as_millis() as u64);
        agent.registrations.send_modify(|n| *n += 1);
        tracing::info!(node = %agent.config.name, lease_ms = resp.lease_ms, term = resp.term, "registered");
        loop {
            tokio::time::sleep(interval).await;
            let sent_at = Instant::now();
            let sent_at_ms = now_ms();
            let running = agent.lock().runtime.live();
            let hb = pa::HeartbeatRequest {
                node: agent.config.name.clone(),
                replica_metrics: agent.heartbeat_gauges(sent_at_ms, &running),
                running,
                incarnation: agent.incarnation.clone(),
            };
            match control
                .call(interval.max(Duration::from_millis(200)), |mut c| {
                    let hb = hb.clone();
                    async move { c.heartbeat(hb).await }
                })
                .await
            {
                Ok(resp) => {
                    let mut st = agent.lock();
                    st.lease_renewed = Some(sent_at);
                    if st.fenced {
                        tracing::info!("lease renewed after fencing");
                        st.fenced = false;
                    }
                    drop(st);
                    agent.publish_lease(sent_at_ms + lease.as_millis() as u64);
                    if resp.register_again {
                        tracing::info!(
                            "the control plane now records more of this node (its cluster version was raised); registering again"
                        );
                        break;
                    }
                }
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::NotFound | tonic::Code::FailedPrecondition
                    ) =>
                {
                    tracing::warn!(
                        message = s.message(),
                        "the control plane does not know this node; re-registering"
                    );
                    break;
                }
                Err(s) => {
                    tracing::debug!(code = ?s.code(), message = s.message(), "heartbeat failed")
                }
            }
        }
    }
}

async fn assignment_loop(agent: Arc<Agent>, control: ControlPlane) {
    let _ = agent.registrations.subscribe().wait_for(|n| *n > 0).await;
    loop {
        for (index, endpoint, mut client) in control.rotation() {
            let req = pa::WatchAssignmentsRequest {
                node: agent.config.name.clone(),
            };
            let mut stream = match client.watch_assignments(req).await {
                Ok(s) => s.into_inner(),
                Err(s) => {
                    tracing::debug!(%endpoint, message = s.message(), "no assignment stream here");
                    continue;
                }
            };
            tracing::info!(%endpoint, "following assignments");
            control.set_leader(Some(index));
            // The leader re-sends the set every second; five silent seconds mean it is gone.
            while let Ok(Ok(Some(set))) =
                tokio::time::timeout(Duration::from_secs(5), stream.message()).await
            {
                let admitted = {
                    let mut st = agent.lock();
                    let ok = st.fence.admit(&set);
                    if ok {
                        st.last_set = Some(set);
                    }
                    ok
                };
                if admitted {
                    agent.reconcile_now();
                } else {
                    tracing::warn!(%endpoint, "ignored assignments from an older leader");
                }
            }
            control.set_leader(None);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn tick_loop(agent: Arc<Agent>) {
    let mut tick = tokio::time::interval(TICK);
    // Shims are this process's children: SIGCHLD says one has exited, and a short job's exit
    // is then reported at once rather than up to a tick later. Re-adopted shims (from before
    // a restart) are not our children; the timer still finds their exits.
    let mut child_exited =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok();
    if child_exited.is_none() {
        tracing::warn!("cannot watch SIGCHLD; exits are noticed on the 100 ms tick only");
    }
    loop {
        // A launch waiting for its start time is made when due, not up to a tick later.
        let due = agent.next_launch_at.load(Ordering::SeqCst);
        let launch_due = async {
            if due == 0 {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(due.saturating_sub(now_ms()))).await;
        };
        tokio::select! {
            _ = tick.tick() => {}
            _ = agent.tick_now.notified() => {}
            () = launch_due => {}
            Some(()) = async {
                match child_exited.as_mut() {
                    Some(s) => s.recv().await,
                    None => std::future::pending().await,
                }
            } => {}
        }
        let a = agent.clone();
        // The runtime reads /proc and files: keep it off the async workers.
        if tokio::task::spawn_blocking(move || a.tick()).await.is_err() {
            tracing::error!("runtime tick panicked");
        }
    }
}

/// Most reports in flight at once.
const REPORT_BATCH: usize = 64;

/// The reports at the front of the queue that may be in flight together: reports of distinct
/// allocations (one allocation's own reports stay in order, its start before its exit), up to
/// the first GPU health report, which goes alone once everything before it is acknowledged, so
/// that a GPU is cordoned before any later exit frees it.
fn next_batch(reports: &VecDeque<Report>) -> Vec<Report> {
    let mut batch = Vec::new();
    let mut allocations = BTreeSet::new();
    for report in reports.iter().take(REPORT_BATCH) {
        match report {
            Report::Health(_) => {
                if batch.is_empty() {
                    batch.push(report.clone());
                }
                break;
            }
            Report::Allocation(r) => {
                if !allocations.insert(r.allocation_id) {
                    break;
                }
                batch.push(report.clone());
            }
        }
    }
    batch
}

async fn send_report(
    node: String,
    report: Report,
    mut control: ControlPlane,
) -> (Result<(), tonic::Status>, ControlPlane) {
    let result = match &report {
        Report::Allocation(r) => {
            let req = pa::AllocationReport {
                node,
                allocation_id: r.allocation_id,
                event: r.event as i32,
                exit_code: r.exit_code.unwrap_or(0),
                has_exit_code: r.exit_code.is_some(),
                signal: r.signal,
                reason: r.reason.clone(),
                usage: (r.usage.is_some() || r.gpu_usage.is_some()).then(|| {
                    let u = r.usage.unwrap_or_default();
                    let g = r.gpu_usage.unwrap_or_default();
                    pa::ResourceUsage {
                        cpu_ms: u.cpu_ns / 1_000_000,
                        peak_memory_bytes: u.peak_memory_bytes,
                        oom_kills: u.oom_kills,
                        gpu_samples: g.samples,
                        gpu_sm_percent_avg: g.sm_percent_avg(),
                        gpu_peak_memory_bytes: g.peak_memory_bytes,
                    }
                }),
            };
            control
                .call(CALL_TIMEOUT, |mut c| {
                    let req = req.clone();
                    async move { c.report_allocation(req).await }
                })
                .await
                .map(|_| ())
        }
        Report::Health(h) => control
            .call(CALL_TIMEOUT, |mut c| {
                let h = h.clone();
                async move { c.report_gpu_health(h).await }
            })
            .await
            .map(|_| ()),
    };
    (result, control)
}

/// Sends the queued reports, a batch at a time ([`next_batch`]): each report is one Raft write
/// on the control plane, and writes in flight together share the leader's log flushes, where
/// one at a time each would wait for its own.
async fn report_loop(agent: Arc<Agent>, mut control: ControlPlane) {
    loop {
        let batch = next_batch(&agent.lock().reports);
        if batch.is_empty() {
            agent.reports_ready.notified().await;
            continue;
        }
        let mut sends = tokio::task::JoinSet::new();
        for (i, report) in batch.iter().enumerate() {
            let send = send_report(agent.config.name.clone(), report.clone(), control.clone());
            sends.spawn(async move { (i, send.await) });
        }
        let mut done = vec![false; batch.len()];
        let mut retry = false;
        while let Some(joined) = sends.join_next().await {
            let Ok((i, (result, used))) = joined else {
                retry = true; // A send panicked: its report stays queued.
                continue;
            };
            match result {
                Ok(()) => {
                    done[i] = true;
                    control = used;
                }
                Err(s) if control::retryable(&s) => {
                    tracing::debug!(code = ?s.code(), message = s.message(), "report failed; retrying");
                    retry = true;
                }
                // Refused for good (e.g. the allocation belongs to another node): retrying
                // would block every later report behind it.
                Err(s) => {
                    let report = &batch[i];
                    tracing::error!(?report, code = ?s.code(), message = s.message(), "the control plane refused a report; dropping it");
                    done[i] = true;
                }
            }
        }
        {
            // Only this loop removes reports, so the batch is still the queue's front.
            let mut st = agent.lock();
            for (i, report) in batch.iter().enumerate().rev() {
                if !done[i] {
                    continue;
                }
                st.reports.remove(i);
                if let Report::Allocation(r) = report
                    && r.exit
                    && let Err(e) = st.runtime.forget(r.allocation_id)
                {
                    tracing::warn!(allocation = r.allocation_id, error = %e, "forgetting a reported exit failed");
                }
            }
        }
        if retry {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// How often the driver is asked which processes use the GPUs.
const GPU_USAGE_EVERY: Duration = Duration::from_secs(5);

/// Samples per-process GPU use every [`GPU_USAGE_EVERY`] and charges it to the allocations
/// whose cgroups hold those processes (hosts without per-process samples, such as
/// simulated ones, cost nothing: no sample, no cgroup read).
async fn gpu_usage_loop(agent: Arc<Agent>, backend: Arc<dyn GpuBackend>) {
    let mut every = tokio::time::interval(GPU_USAGE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let sampler = backend.clone();
        let Ok(samples) = tokio::task::spawn_blocking(move || sampler.process_samples()).await
        else {
            continue;
        };
        if samples.is_empty() {
            continue;
        }
        let agent = agent.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let mut st = agent.lock();
            let members = st.runtime.allocation_processes();
            st.gpu_usage.record(&members, &samples);
        })
        .await;
    }
}

async fn gpu_event_loop(agent: Arc<Agent>, backend: Arc<dyn GpuBackend>) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    std::thread::spawn(move || {
        loop {
            match backend.next_event(Duration::from_millis(500)) {
                Ok(Some(ev)) => {
                    if tx.blocking_send(ev).is_err() {
                        return;
                    }
                }
                Ok(None) => {
                    if tx.is_closed() {
                        return;
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "reading GPU events failed; retrying in 5 s");
                    std::thread::sleep(Duration::from_secs(5));
                }
            }
        }
    });
    while let Some(ev) = rx.recv().await {
        agent.on_gpu_event(ev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(job_fails: bool, gpu_unhealthy: bool) -> health::HealthVerdict {
        health::HealthVerdict {
            job_fails,
            gpu_unhealthy,
            gpu_recovered: false,
            reason: "Xid".to_string(),
        }
    }

    #[test]
    fn a_batch_holds_distinct_allocations_and_stops_at_a_health_report() {
        let started = |id| {
            Report::Allocation(AllocationReport {
                allocation_id: id,
                event: pa::allocation_report::Event::Started,
                exit_code: None,
                signal: 0,
                reason: String::new(),
                exit: false,
                usage: None,
                gpu_usage: None,
            })
        };
        let exited = |id| {
            Report::Allocation(AllocationReport::exit(
                id,
                pa::allocation_report::Event::Succeeded,
                "",
            ))
        };
        let health = Report::Health(pa::GpuHealthReport::default());
        let ids = |batch: Vec<Report>| -> Vec<(u64, bool)> {
            batch
                .iter()
                .map(|r| match r {
                    Report::Allocation(a) => (a.allocation_id, a.exit),
                    Report::Health(_) => (0, false),
                })
                .collect()
        };
        // One allocation's exit waits for its start to be acknowledged.
        let q = VecDeque::from([started(1), started(2), exited(1), started(3)]);
        assert_eq!(ids(next_batch(&q)), [(1, false), (2, false)]);
        // A health report waits for what is before it, then goes alone.
        let q = VecDeque::from([exited(1), health.clone(), exited(2)]);
        assert_eq!(ids(next_batch(&q)), [(1, true)]);
        let q = VecDeque::from([health, exited(2)]);
        assert_eq!(ids(next_batch(&q)), [(0, false)]);
        assert!(next_batch(&VecDeque::new()).is_empty());
        let many: VecDeque<Report> = (0..200).map(started).collect();
        assert_eq!(next_batch(&many).len(), REPORT_BATCH);
    }

    #[test]
    fn a_gpu_fault_stops_every_allocation_on_the_gpu() {
        // Unhealthy GPU: all of them, requeued.
        for unhealthy in [verdict(true, true), verdict(false, true)] {
            assert_eq!(
                fault_stops(&unhealthy, &[3, 5, 9]),
                [3, 5, 9].map(|id| (id, StopCause::GpuFault("Xid".into())))
            );
        }
        // An application error of the only user fails it, with the Xid's reason.
        assert_eq!(
            fault_stops(&verdict(true, false), &[4]),
            vec![(4, StopCause::JobFault("Xid".into()))]
        );
        // Of a shared GPU: all of its users fail, told why.
        let stops = fault_stops(&verdict(true, false), &[4, 6]);
        assert_eq!(stops.len(), 2);
        for (id, (got, cause)) in [4, 6].iter().zip(&stops) {
            assert_eq!(got, id);
            assert!(
                matches!(cause, StopCause::JobFault(r) if r.starts_with("Xid") && r.contains("2 allocations share the GPU")),
                "{cause:?}"
            );
        }
        // Informational: nobody stops.
        assert!(fault_stops(&verdict(false, false), &[1, 2]).is_empty());
        assert!(fault_stops(&verdict(true, true), &[]).is_empty());
    }

    #[test]
    fn launch_specs_carry_device_minors_the_shared_numa_node_and_task_ranks() {
        let inv = SimulatedBackend::from_preset("dgx-h100", "n")
            .expect("preset")
            .inventory()
            .expect("inventory");
        let uuid = |i: usize| inv.gpus[i].uuid.clone();
        let numa = |i: usize| inv.gpus[i].numa_node;
        assert_ne!(numa(0), numa(7), "the preset spans two NUMA nodes");
        let a = pa::Assignment {
            allocation_id: 9,
            job_id: 4,
            command: vec!["true".into()],
            gpus: vec![uuid(1), uuid(0)],
            cpu_milli: 2000,
            memory_mib: 512,
            workdir: "/home/u".into(),
            task_index: 1,
            task_count: 2,
            task_nodes: vec!["a".into(), "n".into()],
            task_hosts: vec!["10.0.0.1".into(), "10.0.0.2".into()],
            ..Default::default()
        };
        let s = launch_spec(&inv, &Default::default(), &a);
        assert_eq!(s.gpu_minors, vec![0, 1]);
        assert_eq!(s.numa_node, numa(0));
        assert_eq!((s.cpu_milli, s.memory_mib), (2000, 512));
        assert_eq!(s.workdir, Some(PathBuf::from("/home/u")));
        assert_eq!(s.env["RANK"], "1");
        assert_eq!(s.env["MASTER_ADDR"], "10.0.0.1");
        let across = pa::Assignment {
            gpus: vec![uuid(0), uuid(7)],
            ..a
        };
        assert_eq!(
            launch_spec(&inv, &Default::default(), &across).numa_node,
            None
        );
    }

    #[test]
    fn a_liveness_stop_is_reported_failed_with_its_reason_whoever_noticed_the_exit() {
        use pa::allocation_report::Event;
        let why = "liveness probe failed: GET http://127.0.0.1:20001/healthz answered 503";
        for kind in [
            ExitKind::Stopped,
            ExitKind::Signaled { signal: 9 },
            ExitKind::Exited { code: 0 },
        ] {
            let r = exit_report(5, &kind, Some(StopCause::Liveness(why.into())));
            assert_eq!(
                (r.event, r.reason.as_str()),
                (Event::Failed, why),
                "{kind:?}"
            );
            assert!(r.exit);
        }
        // Without the agent's cause (it restarted during the stop) a plain stop is STOPPED:
        // the tick then takes the cause from the runtime's record of the failure.
        assert_eq!(
            exit_report(5, &ExitKind::Stopped, None).event,
            Event::Stopped
        );
    }

    #[test]
    fn a_gauge_goes_out_as_scraped_until_it_is_old_then_as_an_error() {
        let m = pa::ReplicaMetric {
            allocation_id: 4,
            value: 7.5,
            error: String::new(),
            at_ms: 100_000,
        };
        assert_eq!(gauge_as_sent(&m, 105_000), m);
        let old = gauge_as_sent(&m, 112_000);
        assert_eq!(old.allocation_id, 4);
        assert_eq!(old.at_ms, 100_000);
        assert_eq!(
            old.error,
            "the agent's last scrape of the gauge was 12 s ago"
        );
        // A clock that went back is no age.
        assert_eq!(gauge_as_sent(&m, 0), m);
    }

    #[test]
    fn launch_specs_of_replicas_carry_their_ports_and_place() {
        let inv = SimulatedBackend::from_preset("h100-pcie-1gpu", "n")
            .expect("preset")
            .inventory()
            .expect("inventory");
        let a = pa::Assignment {
            allocation_id: 11,
            job_id: 6,
            command: vec!["serve".into()],
            env: [("PORT".to_owned(), "8080".to_owned())].into(),
            ports: vec![
                pa::NamedPort {
                    name: "http".into(),
                    port: 20_004,
                },
                pa::NamedPort {
                    name: "grpc".into(),
                    port: 20_005,
                },
            ],
            replica: Some(pa::ReplicaInfo {
                service: "t/web".into(),
                ordinal: 2,
                revision: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let s = launch_spec(&inv, &Default::default(), &a);
        assert_eq!(
            s.env["PORT"], "20004",
            "the given port wins over the template's"
        );
        assert_eq!(s.env["GPUCP_PORT_HTTP"], "20004");
        assert_eq!(s.env["GPUCP_PORT_GRPC"], "20005");
        assert_eq!(s.env["GPUCP_SERVICE"], "t/web");
        assert_eq!(s.env["GPUCP_SERVICE_NAME"], "web");
        assert_eq!(s.env["GPUCP_REPLICA"], "2");
        assert_eq!(s.env["GPUCP_REVISION"], "3");
        // A batch job without ports keeps its own PORT and gets none of these.
        let plain = pa::Assignment {
            ports: Vec::new(),
            replica: None,
            ..a
        };
        let s = launch_spec(&inv, &Default::default(), &plain);
        assert_eq!(s.env["PORT"], "8080");
        assert!(
            !s.env
                .keys()
                .any(|k| k.starts_with("GPUCP_PORT_") || k.starts_with("GPUCP_SERVICE"))
        );
    }

    #[test]
    fn launch_specs_carry_the_share_and_the_parents_of_mig_slices() {
        let inventory = SimulatedBackend::from_preset("h100-pcie-1gpu-mig", "n")
            .expect("preset")
            .inventory()
            .expect("inventory");
        let gpu = &inventory.gpus[0];
        let slice = gpu.mig_instances[1].uuid.clone();
        let a = pa::Assignment {
            allocation_id: 7,
            job_id: 3,
            command: vec!["true".into()],
            gpus: vec![slice.clone()],
            time_limit_secs: 60,
            ..Default::default()
        };
        let table =
            crate::cgroup::mig_caps::MigMinors::parse(&crate::cgroup::mig_caps::driver_table(1));
        let s = launch_spec(&inventory, &table, &a);
        assert_eq!(s.gpus, vec![slice.clone()]);
        assert_eq!(s.mig_parents, BTreeMap::from([(slice, gpu.uuid.clone())]));
        assert_eq!(s.share, None);
        assert_eq!(s.time_limit, Some(Duration::from_secs(60)));
        // Its parent GPU's node, and its own GPU instance's and compute instance's caps
        // (simulated slot 1: GI 2, CI 0 → gpu0/gi2/access 21, gpu0/gi2/ci0/access 22).
        assert_eq!(s.gpu_minors, vec![0]);
        assert_eq!(s.mig_cap_minors, vec![21, 22]);
        // Without the driver's table: none (the job cannot open its slice; warned).
        let s = launch_spec(&inventory, &Default::default(), &a);
        assert!(s.mig_cap_minors.is_empty());

        let whole = SimulatedBackend::from_preset("h100-pcie-1gpu", "n")
            .expect("preset")
            .inventory()
            .expect("inventory");
        let a = pa::Assignment {
            allocation_id: 8,
            gpus: vec![whole.gpus[0].uuid.clone()],
            gpu_milli: 250,
            gpu_memory_mib: 20_389,
            ..Default::default()
        };
        let s = launch_spec(&whole, &Default::default(), &a);
        assert_eq!(
            s.share,
            Some(GpuShare {
                milli: 250,
                memory_mib: 20_389,
                gpu_memory_mib: whole.gpus[0].memory_mib,
            })
        );
        assert!(s.mig_parents.is_empty());
        // An exclusive assignment: no share.
        let a = pa::Assignment { gpu_milli: 0, ..a };
        assert_eq!(launch_spec(&whole, &Default::default(), &a).share, None);
    }
}
