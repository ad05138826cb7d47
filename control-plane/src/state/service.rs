//! Long-running services: plain data and the checks of a service's request that need no
//! cluster state. A service keeps a number of *replicas* running; each replica is a job of
//! one task with a stable ordinal (`Job::replica`), restarted in place when it exits,
//! replaced when its node or GPU is lost, and replaced revision by revision when the service's
//! template changes (a rolling update). The rules that change services live in
//! `service_apply.rs`; which replicas to start and stop is decided by the pure planner in
//! `service_plan.rs`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::command::Rejection;
use super::types::{JobId, JobSpec, Timestamp};
use super::validate::{self, shown, validate_job_spec, validate_name};

/// A replica's place in its service: stable for the replica's life, unique among the live
/// copies of the service (never two copies of one ordinal at once).
pub type Ordinal = u32;

/// Most replicas one service may ask for (or scale to).
pub const MAX_REPLICAS: u32 = 1_000;
/// Named ports one replica may ask for.
pub const MAX_PORTS: usize = 16;
/// Revisions a service keeps for `rollout undo` (the current one included).
pub const KEPT_REVISIONS: usize = 10;
/// Events a service keeps for `service describe`.
pub const KEPT_EVENTS: usize = 32;
/// History entries a replica job keeps: a replica that restarts for a week would otherwise
/// grow its job record without bound (the first entry, its creation, is always kept).
pub const KEPT_REPLICA_HISTORY: usize = 64;

/// A readiness or liveness check the node's agent runs against a replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProbeCheck {
    /// `GET http://127.0.0.1:PORT/PATH` answers 2xx or 3xx within the timeout.
    Http { port: String, path: String },
    /// A TCP connection to the port is accepted within the timeout.
    Tcp { port: String },
    /// The command exits 0 within the timeout. It runs beside the replica, with its
    /// environment and working directory (in its container for a container replica).
    Exec { command: Vec<String> },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    pub check: ProbeCheck,
    /// Time after the replica starts before the first check.
    pub initial_delay_ms: u64,
    pub period_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive failures that make a ready replica not ready (readiness) or restart it
    /// (liveness).
    pub failure_threshold: u32,
    /// Consecutive successes that make a replica ready again.
    pub success_threshold: u32,
}

impl Probe {
    /// Kubernetes' defaults, except a 1 s period: replicas here are expected to answer fast,
    /// and a rollout waits on readiness.
    pub fn new(check: ProbeCheck) -> Probe {
        Probe {
            check,
            initial_delay_ms: 0,
            period_ms: 1_000,
            timeout_ms: 1_000,
            failure_threshold: 3,
            success_threshold: 1,
        }
    }
}

/// How a template change replaces replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStrategy {
    /// Copies beyond `replicas` that may run during a rollout.
    pub max_surge: u32,
    /// Replicas that may be unready during a rollout, below `replicas`.
    pub max_unavailable: u32,
    /// A rollout that makes no progress (no new replica ready) for this long is paused.
    pub progress_deadline_ms: u64,
}

impl Default for RolloutStrategy {
    fn default() -> Self {
        RolloutStrategy {
            max_surge: 1,
            max_unavailable: 0,
            progress_deadline_ms: 10 * 60 * 1000,
        }
    }
}

/// What happens when a replica's process exits (any exit: a service is meant to run for ever).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    /// Wait before the second restart in a row; doubles with each further failure.
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// Failures in a row after which the replica is shown as crash-looping (it keeps being
    /// restarted with the longest back-off), and a rollout that brought it is paused.
    pub crash_loop_after: u32,
    /// A replica that ran this long before it exited starts its count of failures afresh.
    pub reset_after_ms: u64,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            backoff_initial_ms: 1_000,
            backoff_max_ms: 5 * 60 * 1000,
            crash_loop_after: 5,
            reset_after_ms: 10 * 60 * 1000,
        }
    }
}

impl RestartPolicy {
    /// Wait before restarting a replica that has failed `failures` times in a row (1 for the
    /// first failure, which restarts at once, as the kubelet does).
    pub fn backoff_ms(&self, failures: u32) -> u64 {
        if failures <= 1 {
            return 0;
        }
        let doublings = (failures - 2).min(40);
        self.backoff_initial_ms
            .saturating_mul(1u64 << doublings)
            .min(self.backoff_max_ms)
    }
}

/// Scaling between `min` and `max` replicas from a gauge the replicas expose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Autoscale {
    pub min: u32,
    pub max: u32,
    /// The gauge's name in the replicas' Prometheus text (`queue_length`); a labelled series
    /// is summed over its labels.
    pub metric: String,
    /// The port (by name) and path the agent scrapes it from.
    pub port: String,
    pub path: String,
    /// The average of the gauge per ready replica that the autoscaler aims at, in thousandths
    /// (so the replicated state holds no float).
    pub target_milli: u64,
    /// A scale-down takes the highest recommendation of this window (Kubernetes' HPA waits
    /// 5 minutes by default), so a dip does not remove replicas only to add them back.
    pub scale_down_window_ms: u64,
    /// A scale-up takes the lowest recommendation of this window (0: at once).
    pub scale_up_window_ms: u64,
}

/// What each replica of one revision runs: changing any of it is a rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaTemplate {
    /// The replica's request as a job of one task: command, GPUs (whole, a share with its
    /// memory, or a MIG slice), CPU, memory, environment, image, partition, models, priority.
    /// Its tenant and name are the service's; it has no time limit, dependency or array.
    pub job: JobSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<Probe>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<Probe>,
}

/// What a user asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceSpec {
    pub tenant: String,
    pub name: String,
    pub template: ReplicaTemplate,
    /// Replicas wanted (with autoscaling: where it starts, within min..=max).
    pub replicas: u32,
    #[serde(default)]
    pub strategy: RolloutStrategy,
    #[serde(default)]
    pub restart: RestartPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<Autoscale>,
}

impl ServiceSpec {
    /// The state's key of a service: `tenant/name` (names are unique within a tenant).
    pub fn key(&self) -> String {
        service_key(&self.tenant, &self.name)
    }

    /// Replicas below which the service may preempt preemptible batch work.
    pub fn min_replicas(&self) -> u32 {
        self.autoscale.as_ref().map_or(self.replicas, |a| a.min)
    }
}

pub fn service_key(tenant: &str, name: &str) -> String {
    format!("{tenant}/{name}")
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceRevision {
    pub number: u64,
    pub template: ReplicaTemplate,
    pub created_at: Timestamp,
}

/// Where the service's current rollout stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutPhase {
    /// Every replica runs the current revision and is ready.
    Complete,
    /// Replicas are being started, replaced or made ready.
    Progressing,
    /// Stopped half-way: nothing more is replaced until `rollout resume` or `rollout undo`.
    Paused { reason: String },
}

impl RolloutPhase {
    pub fn label(&self) -> &'static str {
        match self {
            RolloutPhase::Complete => "complete",
            RolloutPhase::Progressing => "progressing",
            RolloutPhase::Paused { .. } => "paused",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceEvent {
    pub at: Timestamp,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Service {
    pub spec: ServiceSpec,
    /// The current revision: `spec.template` is its template.
    pub revision: u64,
    /// The last [`KEPT_REVISIONS`] revisions, oldest first, the current one included.
    pub revisions: Vec<ServiceRevision>,
    /// Live copies by ordinal: a job that has not ended, or ended and still holds an
    /// allocation that is stopping. An ordinal is free again once its copy has fully stopped.
    pub replicas: BTreeMap<Ordinal, JobId>,
    pub rollout: RolloutPhase,
    /// When the rollout last made progress (started, or a replica of the current revision
    /// became ready): the progress deadline counts from here.
    pub progressed_at: Timestamp,
    pub created_at: Timestamp,
    /// Raft log index of the last change.
    pub version: u64,
    /// Being deleted: every replica is stopped, then the service is forgotten.
    #[serde(default, skip_serializing_if = "super::types::is_false")]
    pub deleting: bool,
    /// The last [`KEPT_EVENTS`] things that happened to it, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<ServiceEvent>,
}

impl Service {
    pub fn key(&self) -> String {
        self.spec.key()
    }

    pub fn revision_template(&self, number: u64) -> Option<&ReplicaTemplate> {
        self.revisions
            .iter()
            .find(|r| r.number == number)
            .map(|r| &r.template)
    }

    pub fn record_event(&mut self, at: Timestamp, message: impl Into<String>) {
        if self.events.len() >= KEPT_EVENTS {
            self.events.remove(0);
        }
        self.events.push(ServiceEvent {
            at,
            message: message.into(),
        });
    }
}

/// A job that is a replica of a service: where it belongs and how it has fared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaOf {
    /// The service's key (`tenant/name`).
    pub service: String,
    pub ordinal: Ordinal,
    /// The revision whose template it runs.
    pub revision: u64,
    /// Its readiness probe passes (without a probe: it runs). False whenever it is not running.
    #[serde(default, skip_serializing_if = "super::types::is_false")]
    pub ready: bool,
    /// Times it was restarted after its process exited.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub restarts: u32,
    /// Exits since it last ran for the policy's `reset_after_ms`.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub failures: u32,
    /// Why it last exited ("exit code 1", "liveness probe failed: ...").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
}

impl ReplicaOf {
    /// Whether it has failed often enough in a row to be shown as crash-looping, and is not
    /// ready now: a replica that came back up and passes its probe is serving, whatever its
    /// count of failures (which restarts only at its next exit, after `reset_after_ms`).
    pub fn crash_looping(&self, policy: &RestartPolicy) -> bool {
        !self.ready && policy.crash_loop_after > 0 && self.failures >= policy.crash_loop_after
    }
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// Longest probe path, metric name and port name accepted.
const MAX_PROBE_TEXT: usize = 256;
/// The longest back-off, deadline, window or probe interval accepted: a day. Longer ones are
/// almost always a unit mistake (milliseconds given as seconds).
const MAX_INTERVAL_MS: u64 = 24 * 3600 * 1000;

/// Checks a service's request on its own (no cluster state): the API before proposing, and
/// apply again.
pub fn validate_service_spec(spec: &ServiceSpec) -> Result<(), Rejection> {
    validate_name("tenant", &spec.tenant)?;
    validate_name("name", &spec.name)?;
    if spec.replicas > MAX_REPLICAS {
        return Err(Rejection::invalid(
            "replicas",
            format!(
                "{} is more than the {MAX_REPLICAS} one service may have",
                spec.replicas
            ),
        ));
    }
    let job = &spec.template.job;
    if job.tenant != spec.tenant || job.name != spec.name {
        return Err(Rejection::invalid(
            "template",
            "the replica template's tenant and name must be the service's",
        ));
    }
    if job.tasks != 1 {
        return Err(Rejection::invalid(
            "tasks",
            "a replica is one task; ask for more replicas instead",
        ));
    }
    let batch_only = [
        (job.time_limit_secs.is_some(), "a time limit"),
        (!job.dependencies.is_empty(), "dependencies"),
        (job.array.is_some(), "an array"),
        (job.hold, "a hold"),
        (job.begin_at.is_some(), "a begin time"),
        (job.hold_if_unfit, "--hold-if-unfit"),
    ];
    if let Some((_, what)) = batch_only.iter().find(|(set, _)| *set) {
        return Err(Rejection::invalid(
            "template",
            format!("a service's replicas run until it is deleted: {what} is for batch jobs"),
        ));
    }
    if job.gpus_per_task == 0 && job.cpu_milli_per_task == 0 && job.memory_mib_per_task == 0 {
        return Err(Rejection::invalid(
            "template",
            "a replica asks for no GPU, CPU or memory: give --gpus, --gpu-milli, --cpus or --mem",
        ));
    }
    validate_job_spec(job)?;
    validate_ports(&job.ports)?;
    for (field, probe) in [
        ("readiness", &spec.template.readiness),
        ("liveness", &spec.template.liveness),
    ] {
        if let Some(p) = probe {
            validate_probe(field, p, &job.ports)?;
        }
    }
    let s = &spec.strategy;
    if s.max_surge == 0 && s.max_unavailable == 0 {
        return Err(Rejection::invalid(
            "strategy",
            "max_surge and max_unavailable are both 0: a rollout could never replace a replica (give --max-surge 1 or --max-unavailable 1)",
        ));
    }
    if s.max_surge > MAX_REPLICAS || s.max_unavailable > MAX_REPLICAS {
        return Err(Rejection::invalid(
            "strategy",
            format!("max_surge and max_unavailable are at most {MAX_REPLICAS}"),
        ));
    }
    check_interval("progress_deadline", s.progress_deadline_ms, 1_000)?;
    let r = &spec.restart;
    check_interval("restart_backoff", r.backoff_initial_ms, 0)?;
    check_interval("restart_backoff_max", r.backoff_max_ms, 0)?;
    check_interval("restart_reset_after", r.reset_after_ms, 0)?;
    if r.backoff_initial_ms > r.backoff_max_ms {
        return Err(Rejection::invalid(
            "restart_backoff",
            "the first back-off is longer than the longest",
        ));
    }
    if let Some(a) = &spec.autoscale {
        validate_autoscale(a, &job.ports)?;
        if !(a.min..=a.max).contains(&spec.replicas) {
            return Err(Rejection::invalid(
                "replicas",
                format!(
                    "{} is outside the autoscaler's range {}..={}",
                    spec.replicas, a.min, a.max
                ),
            ));
        }
    }
    Ok(())
}

fn check_interval(field: &str, ms: u64, least: u64) -> Result<(), Rejection> {
    if ms < least || ms > MAX_INTERVAL_MS {
        return Err(Rejection::invalid(
            field,
            format!("{ms} ms is outside {least} ms..=1 day"),
        ));
    }
    Ok(())
}

/// Port names: what a replica's environment (`GPUCP_PORT_<NAME>`) and probes refer to.
pub fn validate_ports(ports: &[String]) -> Result<(), Rejection> {
    if ports.len() > MAX_PORTS {
        return Err(Rejection::invalid(
            "ports",
            format!("{} ports; a task takes at most {MAX_PORTS}", ports.len()),
        ));
    }
    for (i, p) in ports.iter().enumerate() {
        if p.is_empty()
            || p.len() > 32
            || !p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            || p.starts_with(|c: char| c.is_ascii_digit())
        {
            return Err(Rejection::invalid(
                "ports",
                format!(
                    "{} is not a port name: letters, digits and '_', not starting with a digit, at most 32",
                    shown(p)
                ),
            ));
        }
        if ports[..i].iter().any(|q| q.eq_ignore_ascii_case(p)) {
            return Err(Rejection::invalid(
                "ports",
                format!("port {} is named twice", shown(p)),
            ));
        }
    }
    Ok(())
}

fn require_port(field: &str, port: &str, ports: &[String]) -> Result<(), Rejection> {
    if ports.iter().any(|p| p == port) {
        return Ok(());
    }
    Err(Rejection::invalid(
        field,
        format!(
            "names port {}, which the replicas do not ask for (their ports: {})",
            shown(port),
            if ports.is_empty() {
                "none; add --port NAME".to_owned()
            } else {
                ports.join(", ")
            }
        ),
    ))
}

fn validate_probe(field: &str, p: &Probe, ports: &[String]) -> Result<(), Rejection> {
    match &p.check {
        ProbeCheck::Http { port, path } => {
            require_port(field, port, ports)?;
            if !path.starts_with('/')
                || path.len() > MAX_PROBE_TEXT
                || path.chars().any(|c| c.is_control() || c == ' ')
            {
                return Err(Rejection::invalid(
                    field,
                    format!("{} is not an HTTP path such as /healthz", shown(path)),
                ));
            }
        }
        ProbeCheck::Tcp { port } => require_port(field, port, ports)?,
        ProbeCheck::Exec { command } => {
            if command.is_empty() || command.len() > 256 {
                return Err(Rejection::invalid(
                    field,
                    "an exec probe needs a command (1 to 256 arguments)",
                ));
            }
            let bytes: usize = command.iter().map(String::len).sum();
            if bytes > validate::MAX_COMMAND_BYTES || command.iter().any(|a| a.contains('\0')) {
                return Err(Rejection::invalid(
                    field,
                    "the probe's command is too long or holds a NUL byte",
                ));
            }
        }
    }
    check_interval(&format!("{field}.period"), p.period_ms, 100)?;
    check_interval(&format!("{field}.timeout"), p.timeout_ms, 10)?;
    check_interval(&format!("{field}.initial_delay"), p.initial_delay_ms, 0)?;
    if !(1..=100).contains(&p.failure_threshold) || !(1..=100).contains(&p.success_threshold) {
        return Err(Rejection::invalid(
            field,
            "failure and success thresholds are 1 to 100",
        ));
    }
    Ok(())
}

fn validate_autoscale(a: &Autoscale, ports: &[String]) -> Result<(), Rejection> {
    if a.min == 0 || a.min > a.max || a.max > MAX_REPLICAS {
        return Err(Rejection::invalid(
            "autoscale",
            format!(
                "min {} and max {} must satisfy 1 <= min <= max <= {MAX_REPLICAS}",
                a.min, a.max
            ),
        ));
    }
    if a.metric.is_empty()
        || a.metric.len() > MAX_PROBE_TEXT
        || !a
            .metric
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return Err(Rejection::invalid(
            "autoscale.metric",
            format!("{} is not a Prometheus metric name", shown(&a.metric)),
        ));
    }
    require_port("autoscale.port", &a.port, ports)?;
    if !a.path.starts_with('/') || a.path.len() > MAX_PROBE_TEXT {
        return Err(Rejection::invalid(
            "autoscale.path",
            format!("{} is not an HTTP path such as /metrics", shown(&a.path)),
        ));
    }
    if a.target_milli == 0 {
        return Err(Rejection::invalid(
            "autoscale.target",
            "the target per replica must be above 0",
        ));
    }
    check_interval("autoscale.scale_down_window", a.scale_down_window_ms, 0)?;
    check_interval("autoscale.scale_up_window", a.scale_up_window_ms, 0)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn spec(name: &str, replicas: u32) -> ServiceSpec {
        ServiceSpec {
            tenant: "default".into(),
            name: name.into(),
            template: ReplicaTemplate {
                job: JobSpec {
                    tenant: "default".into(),
                    name: name.into(),
                    command: vec!["serve".into()],
                    gpus_per_task: 1,
                    tasks: 1,
                    gpu_milli: 500,
                    priority_class: "normal".into(),
                    ports: vec!["http".into()],
                    ..Default::default()
                },
                readiness: None,
                liveness: None,
            },
            replicas,
            strategy: RolloutStrategy::default(),
            restart: RestartPolicy::default(),
            autoscale: None,
        }
    }

    #[test]
    fn a_plain_service_is_valid() {
        assert_eq!(validate_service_spec(&spec("web", 4)), Ok(()));
    }

    #[test]
    fn batch_only_fields_and_gangs_are_refused_with_the_reason() {
        let mut s = spec("web", 2);
        s.template.job.time_limit_secs = Some(60);
        let e = validate_service_spec(&s).unwrap_err();
        assert!(e.message.contains("a time limit is for batch jobs"), "{e}");
        let mut s = spec("web", 2);
        s.template.job.tasks = 2;
        assert!(
            validate_service_spec(&s)
                .unwrap_err()
                .message
                .contains("one task")
        );
    }

    #[test]
    fn a_rollout_that_could_never_replace_a_replica_is_refused() {
        let mut s = spec("web", 2);
        s.strategy.max_surge = 0;
        s.strategy.max_unavailable = 0;
        assert!(
            validate_service_spec(&s)
                .unwrap_err()
                .message
                .contains("could never replace")
        );
    }

    #[test]
    fn probes_and_the_autoscaler_must_name_a_port_the_replicas_have() {
        let mut s = spec("web", 2);
        s.template.readiness = Some(Probe::new(ProbeCheck::Http {
            port: "grpc".into(),
            path: "/ready".into(),
        }));
        let e = validate_service_spec(&s).unwrap_err();
        assert!(e.message.contains("their ports: http"), "{e}");
        let mut s = spec("web", 2);
        s.autoscale = Some(Autoscale {
            min: 1,
            max: 4,
            metric: "queue_length".into(),
            port: "http".into(),
            path: "/metrics".into(),
            target_milli: 5_000,
            scale_down_window_ms: 0,
            scale_up_window_ms: 0,
        });
        assert_eq!(validate_service_spec(&s), Ok(()));
        s.replicas = 9;
        assert!(
            validate_service_spec(&s)
                .unwrap_err()
                .message
                .contains("outside")
        );
    }

    #[test]
    fn port_names_are_checked() {
        assert!(validate_ports(&["http".into(), "metrics_1".into()]).is_ok());
        assert!(validate_ports(&["9x".into()]).is_err());
        assert!(validate_ports(&["a b".into()]).is_err());
        assert!(validate_ports(&["http".into(), "HTTP".into()]).is_err());
    }

    #[test]
    fn backoff_restarts_at_once_then_doubles_up_to_its_cap() {
        let p = RestartPolicy {
            backoff_initial_ms: 1_000,
            backoff_max_ms: 10_000,
            crash_loop_after: 5,
            reset_after_ms: 60_000,
        };
        let waits: Vec<u64> = (1..=7).map(|f| p.backoff_ms(f)).collect();
        assert_eq!(waits, [0, 1_000, 2_000, 4_000, 8_000, 10_000, 10_000]);
        assert_eq!(p.backoff_ms(u32::MAX), 10_000, "no overflow");
    }
}
