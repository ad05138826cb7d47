//! Kubernetes-shaped service manifests (`kind: GpuService`), for `gpuctl apply -f svc.yaml`
//! and `gpuctl get/describe/delete service NAME`. Pure: YAML text in, the API's
//! `ServiceSpec` out, and a service back out as a manifest for `-o yaml` (which `apply` takes
//! back unchanged).
//!
//! The shape follows a Deployment (with an HPA folded in) where a field means the same:
//!
//! ```yaml
//! apiVersion: gpucp.io/v1
//! kind: GpuService
//! metadata:
//!   name: web                     # the service's name; `apply` is idempotent by it
//!   namespace: ml                 # the tenant
//! spec:
//!   replicas: 4                   # with autoscaling: where it starts (default: minReplicas)
//!   priorityClassName: high       # low | normal | high
//!   preemptible: false
//!   partition: inference
//!   gpuModels: [L40S, A100]
//!   singleNuma: false
//!   ports: [http, metrics]        # named host ports; PORT and GPUCP_PORT_<NAME> in the replica
//!   template:                     # the container, as a GpuJob's
//!     image: registry.example/ml/server:2.1   # optional: run in a container
//!     command: [python, serve.py]
//!     args: [--model, resnet50]
//!     env: [{name: LOG_LEVEL, value: info}]
//!     workingDir: /srv
//!     mounts: [{hostPath: /models, mountPath: /models, readOnly: true}]
//!     resources:
//!       limits:
//!         nvidia.com/gpu-milli: 500    # half a GPU; or nvidia.com/gpu: 1, nvidia.com/mig-1g.10gb: 1
//!         nvidia.com/gpu-memory: 20Gi  # the share's part of the GPU's memory
//!         cpu: "2"
//!         memory: 8Gi
//!   readinessProbe:               # Kubernetes' probe shape; ports by name
//!     httpGet: {path: /ready, port: http}     # or tcpSocket: {port: http}, exec: {command: [...]}
//!     initialDelaySeconds: 0
//!     periodSeconds: 1            # default 1 (Kubernetes: 10); fractions allowed (0.5)
//!     timeoutSeconds: 1
//!     failureThreshold: 3
//!     successThreshold: 1
//!   livenessProbe:
//!     httpGet: {path: /healthz, port: http}
//!   strategy:
//!     type: RollingUpdate         # the only type
//!     rollingUpdate: {maxSurge: 25%, maxUnavailable: 0}   # counts or percentages
//!   progressDeadlineSeconds: 600
//!   restart: {backoffSeconds: 1, maxBackoffSeconds: 300, crashLoopAfter: 5, resetAfterSeconds: 600}
//!   autoscaling:                  # an HPA folded in, on one gauge the replicas expose
//!     minReplicas: 2
//!     maxReplicas: 8
//!     metric: {name: queue_length, port: metrics, path: /metrics, target: 5}
//!     behavior:
//!       scaleDown: {stabilizationWindowSeconds: 300}
//!       scaleUp: {stabilizationWindowSeconds: 0}
//! ```
//!
//! Percentages resolve against `replicas` as Kubernetes resolves them: maxSurge rounds up,
//! maxUnavailable down, and if both come to 0 one replica may be unavailable. Unknown fields
//! are refused by name, as in GpuJob manifests: a typo must not silently drop a probe.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde::{Deserialize, Serialize};

use super::manifest::{API_VERSION, EnvVar, Metadata, Quantity, asked, env_list, limits_of};
use super::service_spec::{Resolved, Rounding, int_or_percent};
use crate::api::convert_service::{
    DEFAULT_SCALE_DOWN_WINDOW_MS, service_spec_from_proto, service_spec_to_proto,
};
use crate::state::service::{Probe, ProbeCheck, RestartPolicy, RolloutStrategy};

pub const KIND: &str = "GpuService";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceManifest {
    pub api_version: String,
    pub kind: String,
    pub metadata: Metadata,
    pub spec: Spec,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_models: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub single_numa: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<String>,
    pub template: Container,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<ProbeYaml>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_probe: Option<ProbeYaml>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline_seconds: Option<Seconds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<Restart>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
}

/// What each replica runs: a GpuJob's container fields.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Container {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default)]
    pub resources: super::manifest::Resources,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub mount_path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// Kubernetes' probe: one of `httpGet`, `tcpSocket`, `exec`, and its timings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProbeYaml {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpGet>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_socket: Option<TcpSocket>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<Exec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_delay_seconds: Option<Seconds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period_seconds: Option<Seconds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<Seconds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_threshold: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success_threshold: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpGet {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    pub port: PortRef,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpSocket {
    pub port: PortRef,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exec {
    pub command: Vec<String>,
}

/// A probe's port: Kubernetes takes a number or a name; here only names (ports are handed
/// out by each node, so no number is known in advance).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortRef {
    Name(String),
    Number(i64),
}

impl PortRef {
    fn name(&self, field: &str) -> anyhow::Result<String> {
        match self {
            PortRef::Name(n) => Ok(n.clone()),
            PortRef::Number(n) => bail!(
                "{field}: port {n} is a number; name one of spec.ports instead (each node hands out the port numbers)"
            ),
        }
    }
}

/// Seconds, whole (`10`) or not (`0.5`): Kubernetes' fields are whole seconds, but a service
/// here may probe every half second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Seconds {
    Whole(u64),
    Fraction(f64),
}

impl Seconds {
    fn ms(self, field: &str) -> anyhow::Result<u64> {
        match self {
            Seconds::Whole(s) => s
                .checked_mul(1000)
                .with_context(|| format!("{field}: {s} seconds is too long")),
            Seconds::Fraction(f) if f.is_finite() && f >= 0.0 && f * 1000.0 < u64::MAX as f64 => {
                Ok((f * 1000.0).round() as u64)
            }
            Seconds::Fraction(f) => bail!("{field}: {f} is not a number of seconds"),
        }
    }

    fn of_ms(ms: u64) -> Seconds {
        if ms.is_multiple_of(1000) {
            Seconds::Whole(ms / 1000)
        } else {
            Seconds::Fraction(ms as f64 / 1000.0)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Strategy {
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolling_update: Option<RollingUpdate>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RollingUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<IntOrPercent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrPercent>,
}

/// Kubernetes' IntOrString: `2` or `"25%"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum IntOrPercent {
    Int(u32),
    Text(String),
}

impl IntOrPercent {
    fn resolve(&self, field: &str, replicas: u32, rounding: Rounding) -> anyhow::Result<Resolved> {
        let text = match self {
            IntOrPercent::Int(n) => n.to_string(),
            IntOrPercent::Text(t) => t.clone(),
        };
        int_or_percent(field, &text, replicas, rounding)
    }
}

/// How replicas are restarted (not Kubernetes' `restartPolicy`, which is always `Always`
/// for a Deployment): the back-off and when a replica counts as crash-looping.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Restart {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_seconds: Option<Seconds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_backoff_seconds: Option<Seconds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash_loop_after: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_after_seconds: Option<Seconds>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Autoscaling {
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub metric: Metric,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behavior: Option<Behavior>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metric {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The gauge's average per ready replica to aim at (the HPA's `averageValue`).
    pub target: f64,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Behavior {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down: Option<Window>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_up: Option<Window>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Window {
    pub stabilization_window_seconds: Seconds,
}

/// Reads a GpuService manifest; the error names what is wrong and where.
pub fn parse(text: &str) -> anyhow::Result<ServiceManifest> {
    let m: ServiceManifest = serde_norway::from_str(text).context("not a GpuService manifest")?;
    if m.api_version != API_VERSION {
        bail!("apiVersion {:?} is not {API_VERSION:?}", m.api_version);
    }
    if m.kind != KIND {
        bail!("kind {:?} is not {KIND:?}", m.kind);
    }
    if m.metadata.name.is_empty() {
        bail!("metadata.name is empty: a manifest's service is found again by its name");
    }
    Ok(m)
}

/// The service a manifest asks for, as `PutService` takes it (unset settings left for the
/// cluster's defaults).
pub fn service_spec(m: &ServiceManifest) -> anyhow::Result<pb::ServiceSpec> {
    let s = &m.spec;
    let c = &s.template;
    let mut command = c.command.clone();
    command.extend(c.args.iter().cloned());
    if command.is_empty() {
        bail!("spec.template.command is empty: give the program each replica runs");
    }
    if !c.mounts.is_empty() && c.image.is_none() {
        bail!("spec.template.mounts: mounts are for containers; give spec.template.image");
    }
    let mut template = pb::JobSpec {
        tenant: m.metadata.namespace.clone().unwrap_or_default(),
        name: m.metadata.name.clone(),
        command,
        tasks: 1,
        gpu_models: s.gpu_models.clone(),
        partition: s.partition.clone().unwrap_or_default(),
        priority_class: s
            .priority_class_name
            .clone()
            .unwrap_or_else(|| "normal".into()),
        env: c
            .env
            .iter()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect(),
        preemptible: s.preemptible,
        single_numa: s.single_numa,
        workdir: c.working_dir.clone().unwrap_or_default(),
        container: c.image.as_ref().map(|image| pb::ContainerSpec {
            image: image.clone(),
            mounts: c
                .mounts
                .iter()
                .map(|m| pb::ContainerMount {
                    source: m.host_path.clone(),
                    target: m.mount_path.clone(),
                    read_only: m.read_only,
                })
                .collect(),
        }),
        ports: s.ports.clone(),
        ..Default::default()
    };
    asked(&c.resources)
        .context("spec.template")?
        .apply_to(&mut template);
    let replicas = s
        .replicas
        .or(s.autoscaling.as_ref().map(|a| a.min_replicas))
        .unwrap_or(1);
    let mut strategy = pb::RolloutStrategy::default();
    if let Some(st) = &s.strategy {
        if let Some(kind) = st.kind.as_deref().filter(|k| *k != "RollingUpdate") {
            bail!(
                "spec.strategy.type {kind:?}: services roll replicas over one by one (RollingUpdate); for Recreate's effect use rollingUpdate: {{maxSurge: 0, maxUnavailable: 100%}}"
            );
        }
        if let Some(ru) = &st.rolling_update {
            let surge = ru
                .max_surge
                .as_ref()
                .map(|v| {
                    v.resolve(
                        "spec.strategy.rollingUpdate.maxSurge",
                        replicas,
                        Rounding::Up,
                    )
                })
                .transpose()?;
            let unavailable = ru
                .max_unavailable
                .as_ref()
                .map(|v| {
                    v.resolve(
                        "spec.strategy.rollingUpdate.maxUnavailable",
                        replicas,
                        Rounding::Down,
                    )
                })
                .transpose()?;
            strategy.max_surge = surge.map(|r| r.value);
            strategy.max_unavailable = unavailable.map(|r| r.value);
            let by_percent =
                surge.is_some_and(|r| r.percent) || unavailable.is_some_and(|r| r.percent);
            if by_percent
                && strategy.max_surge == Some(0)
                && strategy.max_unavailable.unwrap_or(0) == 0
            {
                strategy.max_unavailable = Some(1);
            }
        }
    }
    if let Some(d) = s.progress_deadline_seconds {
        strategy.progress_deadline_ms = d.ms("spec.progressDeadlineSeconds")?;
    }
    let restart = match &s.restart {
        None => None,
        Some(r) => Some(pb::RestartPolicy {
            backoff_initial_ms: opt_ms(r.backoff_seconds, "spec.restart.backoffSeconds")?,
            backoff_max_ms: opt_ms(r.max_backoff_seconds, "spec.restart.maxBackoffSeconds")?,
            crash_loop_after: r.crash_loop_after.unwrap_or(0),
            reset_after_ms: opt_ms(r.reset_after_seconds, "spec.restart.resetAfterSeconds")?,
        }),
    };
    let autoscale = match &s.autoscaling {
        None => None,
        Some(a) => {
            let behavior = a.behavior.clone().unwrap_or_default();
            Some(pb::Autoscale {
                min: a.min_replicas,
                max: a.max_replicas,
                metric: a.metric.name.clone(),
                port: a.metric.port.clone().unwrap_or_default(),
                path: a.metric.path.clone().unwrap_or_default(),
                target: a.metric.target,
                scale_down_window_ms: behavior
                    .scale_down
                    .map(|w| {
                        w.stabilization_window_seconds
                            .ms("spec.autoscaling.behavior.scaleDown")
                    })
                    .transpose()?,
                scale_up_window_ms: behavior
                    .scale_up
                    .map(|w| {
                        w.stabilization_window_seconds
                            .ms("spec.autoscaling.behavior.scaleUp")
                    })
                    .transpose()?
                    .unwrap_or(0),
            })
        }
    };
    Ok(pb::ServiceSpec {
        tenant: template.tenant.clone(),
        name: m.metadata.name.clone(),
        template: Some(template),
        replicas,
        readiness: s
            .readiness_probe
            .as_ref()
            .map(|p| probe_of(p, "spec.readinessProbe"))
            .transpose()?,
        liveness: s
            .liveness_probe
            .as_ref()
            .map(|p| probe_of(p, "spec.livenessProbe"))
            .transpose()?,
        strategy: Some(strategy),
        restart,
        autoscale,
    })
}

fn opt_ms(s: Option<Seconds>, field: &str) -> anyhow::Result<u64> {
    s.map(|s| s.ms(field))
        .transpose()
        .map(Option::unwrap_or_default)
}

fn probe_of(p: &ProbeYaml, field: &str) -> anyhow::Result<pb::ServiceProbe> {
    use pb::service_probe::Check;
    let checks: Vec<Check> = [
        p.http_get.as_ref().map(|h| -> anyhow::Result<Check> {
            Ok(Check::Http(pb::HttpProbe {
                port: h.port.name(&format!("{field}.httpGet"))?,
                path: h.path.clone().unwrap_or_else(|| "/".into()),
            }))
        }),
        p.tcp_socket.as_ref().map(|t| -> anyhow::Result<Check> {
            Ok(Check::TcpPort(t.port.name(&format!("{field}.tcpSocket"))?))
        }),
        p.exec.as_ref().map(|e| -> anyhow::Result<Check> {
            Ok(Check::Exec(pb::ExecProbe {
                command: e.command.clone(),
            }))
        }),
    ]
    .into_iter()
    .flatten()
    .collect::<anyhow::Result<_>>()?;
    let [check] = <[Check; 1]>::try_from(checks).map_err(|c| {
        anyhow::anyhow!(
            "{field}: give exactly one of httpGet, tcpSocket or exec (found {})",
            c.len()
        )
    })?;
    Ok(pb::ServiceProbe {
        check: Some(check),
        initial_delay_ms: opt_ms(
            p.initial_delay_seconds,
            &format!("{field}.initialDelaySeconds"),
        )?,
        period_ms: opt_ms(p.period_seconds, &format!("{field}.periodSeconds"))?,
        timeout_ms: opt_ms(p.timeout_seconds, &format!("{field}.timeoutSeconds"))?,
        failure_threshold: p.failure_threshold.unwrap_or(0),
        success_threshold: p.success_threshold.unwrap_or(0),
    })
}

/// `spec` with the cluster's defaults filled in, as the cluster would keep it (the same
/// conversion the API runs), or `None` where the cluster would refuse it (it then says why).
pub fn normalized(spec: &pb::ServiceSpec) -> Option<pb::ServiceSpec> {
    service_spec_from_proto(spec.clone())
        .ok()
        .map(|s| service_spec_to_proto(&s))
}

/// Whether applying `wanted` to a service that has `have` would change nothing. An
/// autoscaled service keeps the count its autoscaler reached, so that count is not a change.
pub fn unchanged(have: &pb::ServiceSpec, wanted: &pb::ServiceSpec) -> bool {
    let mut wanted = wanted.clone();
    if wanted.tenant.is_empty() {
        wanted.tenant = have.tenant.clone();
    }
    let (Some(have), Some(mut wanted)) = (normalized(have), normalized(&wanted)) else {
        return false;
    };
    if let (Some(a), Some(_)) = (&wanted.autoscale, &have.autoscale) {
        wanted.replicas = have.replicas.clamp(a.min, a.max.max(a.min));
    }
    have == wanted
}

/// A service as a manifest (`gpuctl get service NAME -o yaml`): what `apply` would take back.
/// Settings at their defaults are left out, as a person would write it.
pub fn manifest_of(service: &pb::Service) -> ServiceManifest {
    let spec = service.spec.clone().unwrap_or_default();
    let t = spec.template.clone().unwrap_or_default();
    let default_strategy = RolloutStrategy::default();
    let strategy = spec.strategy.unwrap_or_default();
    let surge = strategy.max_surge.unwrap_or(default_strategy.max_surge);
    let unavailable = strategy
        .max_unavailable
        .unwrap_or(default_strategy.max_unavailable);
    let r = spec.restart.unwrap_or_default();
    let d = RestartPolicy::default();
    let restart = Restart {
        backoff_seconds: (r.backoff_initial_ms != d.backoff_initial_ms && r.backoff_initial_ms > 0)
            .then(|| Seconds::of_ms(r.backoff_initial_ms)),
        max_backoff_seconds: (r.backoff_max_ms != d.backoff_max_ms && r.backoff_max_ms > 0)
            .then(|| Seconds::of_ms(r.backoff_max_ms)),
        crash_loop_after: (r.crash_loop_after != d.crash_loop_after && r.crash_loop_after > 0)
            .then_some(r.crash_loop_after),
        reset_after_seconds: (r.reset_after_ms != d.reset_after_ms && r.reset_after_ms > 0)
            .then(|| Seconds::of_ms(r.reset_after_ms)),
    };
    ServiceManifest {
        api_version: API_VERSION.into(),
        kind: KIND.into(),
        metadata: Metadata {
            name: spec.name.clone(),
            namespace: Some(spec.tenant.clone()).filter(|t| !t.is_empty()),
            labels: BTreeMap::new(),
        },
        spec: Spec {
            replicas: Some(spec.replicas),
            priority_class_name: Some(t.priority_class.clone()).filter(|p| !p.is_empty()),
            preemptible: t.preemptible,
            partition: Some(t.partition.clone()).filter(|p| !p.is_empty()),
            gpu_models: t.gpu_models.clone(),
            single_numa: t.single_numa,
            ports: t.ports.clone(),
            template: Container {
                image: t.container.as_ref().map(|c| c.image.clone()),
                command: t.command.clone(),
                args: Vec::new(),
                env: env_list(&t.env),
                working_dir: Some(t.workdir.clone()).filter(|w| !w.is_empty()),
                mounts: t
                    .container
                    .iter()
                    .flat_map(|c| &c.mounts)
                    .map(|m| Mount {
                        host_path: m.source.clone(),
                        mount_path: m.target.clone(),
                        read_only: m.read_only,
                    })
                    .collect(),
                resources: super::manifest::Resources {
                    limits: limits_of(&t),
                    requests: BTreeMap::<String, Quantity>::new(),
                },
            },
            readiness_probe: spec.readiness.as_ref().map(probe_yaml),
            liveness_probe: spec.liveness.as_ref().map(probe_yaml),
            strategy: (surge != default_strategy.max_surge
                || unavailable != default_strategy.max_unavailable)
                .then_some(Strategy {
                    kind: None,
                    rolling_update: Some(RollingUpdate {
                        max_surge: Some(IntOrPercent::Int(surge)),
                        max_unavailable: Some(IntOrPercent::Int(unavailable)),
                    }),
                }),
            progress_deadline_seconds: (strategy.progress_deadline_ms
                != default_strategy.progress_deadline_ms
                && strategy.progress_deadline_ms > 0)
                .then(|| Seconds::of_ms(strategy.progress_deadline_ms)),
            restart: (restart != Restart::default()).then_some(restart),
            autoscaling: spec.autoscale.as_ref().map(|a| {
                let down = a
                    .scale_down_window_ms
                    .unwrap_or(DEFAULT_SCALE_DOWN_WINDOW_MS);
                let behavior = Behavior {
                    scale_down: (down != DEFAULT_SCALE_DOWN_WINDOW_MS).then(|| Window {
                        stabilization_window_seconds: Seconds::of_ms(down),
                    }),
                    scale_up: (a.scale_up_window_ms != 0).then(|| Window {
                        stabilization_window_seconds: Seconds::of_ms(a.scale_up_window_ms),
                    }),
                };
                Autoscaling {
                    min_replicas: a.min,
                    max_replicas: a.max,
                    metric: Metric {
                        name: a.metric.clone(),
                        port: Some(a.port.clone()).filter(|p| !p.is_empty()),
                        path: Some(a.path.clone()).filter(|p| !p.is_empty() && p != "/metrics"),
                        target: a.target,
                    },
                    behavior: (behavior != Behavior::default()).then_some(behavior),
                }
            }),
        },
    }
}

fn probe_yaml(p: &pb::ServiceProbe) -> ProbeYaml {
    use pb::service_probe::Check;
    let d = Probe::new(ProbeCheck::Tcp {
        port: String::new(),
    });
    let (http_get, tcp_socket, exec) = match &p.check {
        Some(Check::Http(h)) => (
            Some(HttpGet {
                path: Some(h.path.clone()),
                port: PortRef::Name(h.port.clone()),
            }),
            None,
            None,
        ),
        Some(Check::TcpPort(port)) => (
            None,
            Some(TcpSocket {
                port: PortRef::Name(port.clone()),
            }),
            None,
        ),
        Some(Check::Exec(e)) => (
            None,
            None,
            Some(Exec {
                command: e.command.clone(),
            }),
        ),
        None => (None, None, None),
    };
    let secs = |ms: u64, default: u64| (ms != default && ms > 0).then(|| Seconds::of_ms(ms));
    ProbeYaml {
        http_get,
        tcp_socket,
        exec,
        initial_delay_seconds: secs(p.initial_delay_ms, d.initial_delay_ms),
        period_seconds: secs(p.period_ms, d.period_ms),
        timeout_seconds: secs(p.timeout_ms, d.timeout_ms),
        failure_threshold: (p.failure_threshold != d.failure_threshold && p.failure_threshold > 0)
            .then_some(p.failure_threshold),
        success_threshold: (p.success_threshold != d.success_threshold && p.success_threshold > 0)
            .then_some(p.success_threshold),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the module's header.
    const EXAMPLE: &str = r#"
apiVersion: gpucp.io/v1
kind: GpuService
metadata:
  name: web
  namespace: ml
spec:
  replicas: 4
  priorityClassName: high
  partition: inference
  gpuModels: [L40S, A100]
  ports: [http, metrics]
  template:
    image: registry.example/ml/server:2.1
    command: [python, serve.py]
    args: [--model, resnet50]
    env: [{name: LOG_LEVEL, value: info}]
    workingDir: /srv
    mounts: [{hostPath: /models, mountPath: /models, readOnly: true}]
    resources:
      limits:
        nvidia.com/gpu-milli: 500
        nvidia.com/gpu-memory: 20Gi
        cpu: "2"
        memory: 8Gi
  readinessProbe:
    httpGet: {path: /ready, port: http}
    initialDelaySeconds: 0
    periodSeconds: 0.5
    timeoutSeconds: 1
    failureThreshold: 3
    successThreshold: 1
  livenessProbe:
    httpGet: {path: /healthz, port: http}
    periodSeconds: 5
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxSurge: 25%, maxUnavailable: 0}
  progressDeadlineSeconds: 600
  restart: {backoffSeconds: 2, maxBackoffSeconds: 300, crashLoopAfter: 4, resetAfterSeconds: 600}
  autoscaling:
    minReplicas: 2
    maxReplicas: 8
    metric: {name: queue_length, port: metrics, path: /metrics, target: 5}
    behavior:
      scaleDown: {stabilizationWindowSeconds: 60}
      scaleUp: {stabilizationWindowSeconds: 0}
"#;

    fn spec_of(text: &str) -> anyhow::Result<pb::ServiceSpec> {
        service_spec(&parse(text)?)
    }

    #[test]
    fn the_example_becomes_the_service_it_describes() {
        let s = spec_of(EXAMPLE).unwrap();
        assert_eq!(
            (s.name.as_str(), s.tenant.as_str(), s.replicas),
            ("web", "ml", 4)
        );
        let t = s.template.as_ref().unwrap();
        assert_eq!(t.command, ["python", "serve.py", "--model", "resnet50"]);
        assert_eq!(
            (t.gpus_per_task, t.gpu_milli, t.gpu_memory_mib),
            (1, 500, 20_480)
        );
        assert_eq!(
            (t.cpu_milli_per_task, t.memory_mib_per_task),
            (2_000, 8_192)
        );
        assert_eq!(t.ports, ["http", "metrics"]);
        assert_eq!(t.priority_class, "high");
        assert_eq!(t.gpu_models, ["L40S", "A100"]);
        let c = t.container.as_ref().unwrap();
        assert_eq!(c.image, "registry.example/ml/server:2.1");
        assert!(c.mounts[0].read_only && c.mounts[0].target == "/models");
        let r = s.readiness.as_ref().unwrap();
        assert_eq!(r.period_ms, 500);
        assert_eq!(
            r.check,
            Some(pb::service_probe::Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: "/ready".into()
            }))
        );
        assert_eq!(s.liveness.as_ref().unwrap().period_ms, 5_000);
        let st = s.strategy.unwrap();
        // 25% of 4 rounds up to 1.
        assert_eq!((st.max_surge, st.max_unavailable), (Some(1), Some(0)));
        assert_eq!(st.progress_deadline_ms, 600_000);
        assert_eq!(s.restart.unwrap().crash_loop_after, 4);
        let a = s.autoscale.unwrap();
        assert_eq!((a.min, a.max, a.target), (2, 8, 5.0));
        assert_eq!(a.scale_down_window_ms, Some(60_000));
        // The cluster takes it as it is.
        let mut wire = spec_of(EXAMPLE).unwrap();
        wire.tenant = "ml".into();
        let domain = service_spec_from_proto(wire).unwrap();
        assert_eq!(
            crate::state::service::validate_service_spec(&domain),
            Ok(())
        );
    }

    /// What the cluster would answer for `spec` (defaults filled), as a service.
    fn served(spec: pb::ServiceSpec) -> pb::Service {
        pb::Service {
            spec: Some(normalized(&spec).expect("valid")),
            revision: 1,
            ..Default::default()
        }
    }

    #[test]
    fn get_o_yaml_applies_back_unchanged() {
        for text in [
            EXAMPLE.to_owned(),
            // The smallest manifest: every default.
            "apiVersion: gpucp.io/v1\nkind: GpuService\nmetadata: {name: tiny}\nspec:\n  template:\n    command: [serve]\n    resources: {limits: {cpu: 1}}\n".to_owned(),
            EXAMPLE.replace("nvidia.com/gpu-milli: 500\n        nvidia.com/gpu-memory: 20Gi", "nvidia.com/mig-1g.10gb: 2"),
        ] {
            let mut wanted = spec_of(&text).unwrap();
            if wanted.tenant.is_empty() {
                wanted.tenant = "default".into();
            }
            let service = served(wanted.clone());
            let yaml = serde_norway::to_string(&manifest_of(&service)).unwrap();
            let again = spec_of(&yaml).unwrap_or_else(|e| panic!("{e:#}\n{yaml}"));
            assert!(
                unchanged(service.spec.as_ref().unwrap(), &again),
                "{yaml}\n{again:#?}"
            );
            assert!(unchanged(service.spec.as_ref().unwrap(), &wanted));
            // And printed again, the same text.
            let twice = serde_norway::to_string(&manifest_of(&served({
                let mut a = again.clone();
                if a.tenant.is_empty() {
                    a.tenant = "default".into();
                }
                a
            })))
            .unwrap();
            assert_eq!(yaml, twice);
        }
        // Defaults are left out of the printed manifest.
        let tiny = "apiVersion: gpucp.io/v1\nkind: GpuService\nmetadata: {name: tiny}\nspec:\n  template:\n    command: [serve]\n";
        let mut s = spec_of(tiny).unwrap();
        s.tenant = "default".into();
        let yaml = serde_norway::to_string(&manifest_of(&served(s))).unwrap();
        for absent in ["strategy", "restart", "progressDeadline", "readinessProbe"] {
            assert!(!yaml.contains(absent), "{absent} in\n{yaml}");
        }
    }

    #[test]
    fn a_changed_template_is_a_change_and_an_autoscaled_count_is_not() {
        let mut have = spec_of(EXAMPLE).unwrap();
        have.tenant = "ml".into();
        let have = normalized(&have).unwrap();
        let mut wanted = spec_of(EXAMPLE).unwrap();
        wanted.replicas = 7; // the autoscaler keeps its own count
        assert!(unchanged(&have, &wanted));
        let changed = spec_of(&EXAMPLE.replace("server:2.1", "server:2.2")).unwrap();
        assert!(!unchanged(&have, &changed));
        let scaled = spec_of(&EXAMPLE.replace("maxReplicas: 8", "maxReplicas: 9")).unwrap();
        assert!(!unchanged(&have, &scaled));
    }

    #[test]
    fn typos_numbers_for_ports_and_unsupported_shapes_are_refused_by_name() {
        for (from, to, says) in [
            ("periodSeconds: 5", "periodSecond: 5", "periodSecond"),
            ("port: http}", "port: 8080}", "8080 is a number"),
            ("type: RollingUpdate", "type: Recreate", "Recreate"),
            ("maxSurge: 25%", "maxSurge: lots", "lots"),
            ("memory: 8Gi", "amd.com/gpu: 1", "amd.com/gpu"),
            (
                "command: [python, serve.py]\n    args: [--model, resnet50]",
                "command: []",
                "command is empty",
            ),
            ("kind: GpuService", "kind: Deployment", "Deployment"),
            (
                "    image: registry.example/ml/server:2.1\n",
                "",
                "mounts are for containers",
            ),
            (
                "livenessProbe:\n    httpGet: {path: /healthz, port: http}",
                "livenessProbe:\n    tcpSocket: {port: http}\n    httpGet: {path: /healthz, port: http}",
                "exactly one",
            ),
            (
                "template:\n",
                "template:\n    spec: {}\n",
                "unknown field `spec`",
            ),
        ] {
            assert!(EXAMPLE.contains(from), "{from}");
            let text = EXAMPLE.replace(from, to);
            let e = format!("{:#}", spec_of(&text).unwrap_err());
            assert!(e.contains(says), "{to}: {e}");
        }
    }

    #[test]
    fn percentages_resolve_against_the_replicas_like_kubernetes() {
        let with = |surge: &str, unavailable: &str, replicas: u32| {
            let text = EXAMPLE
                .replace("maxSurge: 25%", &format!("maxSurge: {surge}"))
                .replace(
                    "maxUnavailable: 0",
                    &format!("maxUnavailable: {unavailable}"),
                )
                .replace("replicas: 4", &format!("replicas: {replicas}"));
            let st = spec_of(&text).unwrap().strategy.unwrap();
            (st.max_surge.unwrap(), st.max_unavailable.unwrap())
        };
        assert_eq!(with("25%", "25%", 10), (3, 2));
        assert_eq!(with("\"50%\"", "1", 3), (2, 1));
        assert_eq!(
            with("0%", "10%", 3),
            (0, 1),
            "both 0: one may be unavailable"
        );
        assert_eq!(with("2", "0", 3), (2, 0));
    }
}
