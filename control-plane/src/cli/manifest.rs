//! Kubernetes-shaped job manifests (`kind: GpuJob`), for `gpuctl apply -f job.yaml` and
//! `gpuctl get/describe/delete job NAME`. Pure: YAML text in, the API's `JobSpec` out (and a
//! job back out as a manifest for `-o yaml`).
//!
//! The shape follows a Kubernetes Job's pod template where a field means the same thing,
//! so a Kubernetes user's habits carry over:
//!
//! ```yaml
//! apiVersion: gpucp.io/v1
//! kind: GpuJob
//! metadata:
//!   name: resnet-sweep-7          # the job's name; `apply` is idempotent by it
//!   namespace: vision             # the tenant
//! spec:
//!   priorityClassName: high       # low | normal | high
//!   partition: a100
//!   tasks: 2                      # a gang: all placed together or none
//!   activeDeadlineSeconds: 86400  # time limit
//!   preemptible: true
//!   singleNuma: true
//!   image: registry.example/ml/trainer:1.4   # optional: run in a container
//!   command: [python, train.py]
//!   args: [--lr, "0.1"]
//!   workingDir: /home/ml/run
//!   env: [{name: WANDB_MODE, value: offline}]
//!   gpuModels: [H100, A100]       # nodeSelector-like: any of these models
//!   resources:
//!     limits:
//!       nvidia.com/gpu: 2         # per task; or nvidia.com/mig-1g.10gb: 1
//!       cpu: "8"                  # or 500m
//!       memory: 64Gi
//! ```
//!
//! A share of one GPU is `nvidia.com/gpu-milli: 250` (1-999 thousandths of a GPU) with an
//! optional `nvidia.com/gpu-memory: 10Gi` (its part of the GPU's memory; default in
//! proportion), in place of `nvidia.com/gpu`. `kind: GpuService` manifests
//! (`service_manifest.rs`) take the same resources.
//!
//! Unknown fields are refused by name (a typo must not silently drop a limit).

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde::{Deserialize, Serialize};

pub const API_VERSION: &str = "gpucp.io/v1";
pub const KIND: &str = "GpuJob";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Manifest {
    pub api_version: String,
    pub kind: String,
    pub metadata: Metadata,
    pub spec: Spec,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metadata {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_deadline_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub single_numa: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_models: Vec<String>,
    #[serde(default)]
    pub resources: Resources,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvVar {
    pub name: String,
    #[serde(default)]
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// `nvidia.com/gpu`, `nvidia.com/mig-<profile>`, `cpu`, `memory` (Kubernetes' names and
    /// quantities). `requests` are accepted as the same thing: the scheduler reserves what a
    /// job asks for and the cgroup enforces it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
}

/// A Kubernetes quantity: a number or a string such as `500m`, `8`, `64Gi`, `1.5`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Quantity {
    /// Whole numbers first, so `-o yaml` prints `2`, not `2.0`.
    Whole(i64),
    Number(f64),
    Text(String),
}

impl Quantity {
    pub fn text(&self) -> String {
        match self {
            Quantity::Whole(n) => n.to_string(),
            Quantity::Number(n) => n.to_string(),
            Quantity::Text(t) => t.trim().to_owned(),
        }
    }
}

/// Reads a manifest; the error names what is wrong and where.
pub fn parse(text: &str) -> anyhow::Result<Manifest> {
    let m: Manifest = serde_norway::from_str(text).context("not a GpuJob manifest")?;
    if m.api_version != API_VERSION {
        bail!("apiVersion {:?} is not {API_VERSION:?}", m.api_version);
    }
    if m.kind != KIND {
        bail!("kind {:?} is not {KIND:?}", m.kind);
    }
    if m.metadata.name.is_empty() {
        bail!("metadata.name is empty: a manifest's job is found again by its name");
    }
    Ok(m)
}

/// What a manifest's `resources` ask for, per task (or per replica).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Asked {
    /// `nvidia.com/gpu` (or the count of a MIG profile); unset: 1.
    pub gpus: Option<i64>,
    pub mig_profile: String,
    pub gpu_milli: u32,
    pub gpu_memory_mib: u64,
    pub cpu_milli: i64,
    pub memory_mib: i64,
}

impl Asked {
    /// Sets what was asked on `spec`.
    pub fn apply_to(&self, spec: &mut pb::JobSpec) {
        spec.gpus_per_task = self.gpus.unwrap_or(1);
        spec.mig_profile = self.mig_profile.clone();
        spec.gpu_milli = self.gpu_milli;
        spec.gpu_memory_mib = self.gpu_memory_mib;
        spec.cpu_milli_per_task = self.cpu_milli;
        spec.memory_mib_per_task = self.memory_mib;
    }
}

const RESOURCE_NAMES: &str = "nvidia.com/gpu, nvidia.com/mig-PROFILE, nvidia.com/gpu-milli, nvidia.com/gpu-memory, cpu, memory";

/// Reads `resources` (requests first, limits over them: both mean "what the job gets").
pub fn asked(resources: &Resources) -> anyhow::Result<Asked> {
    let mut a = Asked::default();
    for (key, q) in resources.requests.iter().chain(&resources.limits) {
        let text = q.text();
        match key.as_str() {
            "nvidia.com/gpu" => a.gpus = Some(whole("nvidia.com/gpu", &text)?),
            "nvidia.com/gpu-milli" => {
                a.gpu_milli = whole(key, &text)?
                    .try_into()
                    .ok()
                    .filter(|m| (1..1000).contains(m))
                    .with_context(|| {
                        format!("resources: nvidia.com/gpu-milli {text:?} is not 1 to 999 thousandths of a GPU")
                    })?
            }
            "nvidia.com/gpu-memory" => a.gpu_memory_mib = memory_mib_of(&text)?,
            "cpu" => a.cpu_milli = cpu_milli_of(&text)?,
            "memory" => {
                a.memory_mib = i64::try_from(memory_mib_of(&text)?)
                    .with_context(|| format!("resources: memory {text:?} is too large"))?
            }
            k if k.starts_with("nvidia.com/mig-") => {
                a.mig_profile = k["nvidia.com/mig-".len()..].to_owned();
                a.gpus = Some(whole(k, &text)?);
            }
            other => bail!("resources: {other:?} is not a resource here ({RESOURCE_NAMES})"),
        }
    }
    if a.gpu_milli > 0 && !a.mig_profile.is_empty() {
        bail!("resources: a GPU share (nvidia.com/gpu-milli) and MIG slices exclude each other");
    }
    if a.gpu_memory_mib > 0 && a.gpu_milli == 0 {
        bail!(
            "resources: nvidia.com/gpu-memory is a share's part of its GPU: give nvidia.com/gpu-milli too"
        );
    }
    Ok(a)
}

/// The `resources.limits` that ask for what `spec` asks for (`-o yaml`).
pub fn limits_of(spec: &pb::JobSpec) -> BTreeMap<String, Quantity> {
    let mut limits = BTreeMap::new();
    if spec.gpu_milli > 0 {
        limits.insert(
            "nvidia.com/gpu-milli".to_owned(),
            Quantity::Whole(i64::from(spec.gpu_milli)),
        );
        if spec.gpu_memory_mib > 0 {
            limits.insert(
                "nvidia.com/gpu-memory".to_owned(),
                Quantity::Text(format!("{}Mi", spec.gpu_memory_mib)),
            );
        }
    } else {
        let gpu_key = if spec.mig_profile.is_empty() {
            "nvidia.com/gpu".to_owned()
        } else {
            format!("nvidia.com/mig-{}", spec.mig_profile)
        };
        limits.insert(gpu_key, Quantity::Whole(spec.gpus_per_task));
    }
    if spec.cpu_milli_per_task > 0 {
        limits.insert(
            "cpu".into(),
            Quantity::Text(format!("{}m", spec.cpu_milli_per_task)),
        );
    }
    if spec.memory_mib_per_task > 0 {
        limits.insert(
            "memory".into(),
            Quantity::Text(format!("{}Mi", spec.memory_mib_per_task)),
        );
    }
    limits
}

/// A map of environment variables as a manifest's sorted `env` list.
pub fn env_list(env: &std::collections::HashMap<String, String>) -> Vec<EnvVar> {
    let mut list: Vec<EnvVar> = env
        .iter()
        .map(|(name, value)| EnvVar {
            name: name.clone(),
            value: value.clone(),
        })
        .collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list
}

/// The job a manifest asks for.
pub fn job_spec(m: &Manifest) -> anyhow::Result<pb::JobSpec> {
    let s = &m.spec;
    let asked = asked(&s.resources)?;
    let mut command = s.command.clone();
    command.extend(s.args.iter().cloned());
    if command.is_empty() {
        bail!("spec.command is empty: give the program to run");
    }
    let mut spec = pb::JobSpec {
        tenant: m.metadata.namespace.clone().unwrap_or_default(),
        name: m.metadata.name.clone(),
        command,
        tasks: i64::from(s.tasks.unwrap_or(1)),
        gpu_models: s.gpu_models.clone(),
        partition: s.partition.clone().unwrap_or_default(),
        priority_class: s
            .priority_class_name
            .clone()
            .unwrap_or_else(|| "normal".into()),
        time_limit_secs: i64::try_from(s.active_deadline_seconds.unwrap_or(0))
            .context("spec.activeDeadlineSeconds is too large")?,
        env: s
            .env
            .iter()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect(),
        preemptible: s.preemptible,
        single_numa: s.single_numa,
        workdir: s.working_dir.clone().unwrap_or_default(),
        container: s.image.as_ref().map(|image| pb::ContainerSpec {
            image: image.clone(),
            mounts: Vec::new(),
        }),
        ..Default::default()
    };
    asked.apply_to(&mut spec);
    Ok(spec)
}

/// A job as a manifest (`gpuctl get job NAME -o yaml`): what `apply` would take back.
pub fn manifest_of(job: &pb::Job) -> Manifest {
    let spec = job.spec.clone().unwrap_or_default();
    let limits = limits_of(&spec);
    let env = env_list(&spec.env);
    Manifest {
        api_version: API_VERSION.into(),
        kind: KIND.into(),
        metadata: Metadata {
            name: spec.name.clone(),
            namespace: Some(spec.tenant.clone()).filter(|t| !t.is_empty()),
            labels: BTreeMap::new(),
        },
        spec: Spec {
            priority_class_name: Some(spec.priority_class.clone()).filter(|p| !p.is_empty()),
            partition: Some(spec.partition.clone()).filter(|p| !p.is_empty()),
            tasks: Some(spec.tasks as u32),
            active_deadline_seconds: (spec.time_limit_secs > 0)
                .then_some(spec.time_limit_secs as u64),
            preemptible: spec.preemptible,
            single_numa: spec.single_numa,
            image: spec.container.as_ref().map(|c| c.image.clone()),
            command: spec.command.clone(),
            args: Vec::new(),
            working_dir: Some(spec.workdir.clone()).filter(|w| !w.is_empty()),
            env,
            gpu_models: spec.gpu_models.clone(),
            resources: Resources {
                limits,
                requests: BTreeMap::new(),
            },
        },
    }
}

pub(crate) fn whole(key: &str, text: &str) -> anyhow::Result<i64> {
    text.parse::<i64>()
        .ok()
        .filter(|n| *n >= 0)
        .with_context(|| format!("resources: {key} {text:?} is not a whole number"))
}

/// `500m`, `2`, `1.5` CPUs as milli-CPUs.
pub(crate) fn cpu_milli_of(text: &str) -> anyhow::Result<i64> {
    let bad = || format!("resources: cpu {text:?} is not a CPU quantity (2, 1.5, 500m)");
    if let Some(milli) = text.strip_suffix('m') {
        return milli
            .parse::<i64>()
            .ok()
            .filter(|m| *m >= 0)
            .with_context(bad);
    }
    let cpus: f64 = text
        .parse()
        .ok()
        .filter(|c: &f64| c.is_finite() && *c >= 0.0)
        .with_context(bad)?;
    Ok((cpus * 1000.0).round() as i64)
}

/// `64Gi`, `512Mi`, `1G`, `1000000` (bytes) as MiB, rounded up.
pub(crate) fn memory_mib_of(text: &str) -> anyhow::Result<u64> {
    const UNITS: [(&str, u128); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("K", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (number, unit) = UNITS
        .iter()
        .find_map(|(suffix, unit)| text.strip_suffix(suffix).map(|n| (n, *unit)))
        .unwrap_or((text, 1));
    let bytes = number
        .parse::<u128>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .with_context(|| {
            format!("resources: memory {text:?} is not a quantity (64Gi, 512Mi, 1G)")
        })?;
    u64::try_from(bytes.div_ceil(1 << 20))
        .with_context(|| format!("resources: memory {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
apiVersion: gpucp.io/v1
kind: GpuJob
metadata:
  name: resnet-sweep-7
  namespace: vision
spec:
  priorityClassName: high
  partition: a100
  tasks: 2
  activeDeadlineSeconds: 86400
  preemptible: true
  command: [python, train.py]
  args: [--lr, "0.1"]
  workingDir: /home/ml/run
  env:
    - {name: WANDB_MODE, value: offline}
  gpuModels: [H100]
  resources:
    limits:
      nvidia.com/gpu: 2
      cpu: 500m
      memory: 64Gi
"#;

    #[test]
    fn a_manifest_becomes_the_job_it_describes() {
        let spec = job_spec(&parse(EXAMPLE).unwrap()).unwrap();
        assert_eq!(
            (spec.name.as_str(), spec.tenant.as_str()),
            ("resnet-sweep-7", "vision")
        );
        assert_eq!(spec.command, ["python", "train.py", "--lr", "0.1"]);
        assert_eq!((spec.tasks, spec.gpus_per_task), (2, 2));
        assert_eq!(
            (spec.cpu_milli_per_task, spec.memory_mib_per_task),
            (500, 65536)
        );
        assert_eq!(spec.priority_class, "high");
        assert_eq!(spec.time_limit_secs, 86400);
        assert!(spec.preemptible);
        assert_eq!(spec.env["WANDB_MODE"], "offline");
        assert_eq!(spec.gpu_models, ["H100"]);
        assert_eq!(spec.workdir, "/home/ml/run");
        assert!(spec.container.is_none());
    }

    #[test]
    fn mig_slices_images_and_quantities_map_as_kubernetes_spells_them() {
        let text = EXAMPLE
            .replace("nvidia.com/gpu: 2", "nvidia.com/mig-1g.10gb: 3")
            .replace("cpu: 500m", "cpu: 1.5")
            .replace("memory: 64Gi", "memory: 1G")
            .replace("  preemptible: true", "  image: trainer:1.4");
        let spec = job_spec(&parse(&text).unwrap()).unwrap();
        assert_eq!(
            (spec.mig_profile.as_str(), spec.gpus_per_task),
            ("1g.10gb", 3)
        );
        assert_eq!(spec.cpu_milli_per_task, 1500);
        assert_eq!(
            spec.memory_mib_per_task, 954,
            "10^9 bytes, rounded up to MiB"
        );
        assert_eq!(spec.container.unwrap().image, "trainer:1.4");
    }

    #[test]
    fn typos_unknown_resources_and_wrong_kinds_are_refused_by_name() {
        let e = format!(
            "{:#}",
            parse(&EXAMPLE.replace("activeDeadlineSeconds", "activeDeadline")).unwrap_err()
        );
        assert!(e.contains("activeDeadline"), "{e}");
        let e = job_spec(&parse(&EXAMPLE.replace("cpu: 500m", "amd.com/gpu: 1")).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("amd.com/gpu"), "{e}");
        let e = parse(&EXAMPLE.replace("kind: GpuJob", "kind: Job"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"Job\""), "{e}");
        let e = job_spec(&parse(&EXAMPLE.replace("memory: 64Gi", "memory: lots")).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("lots"), "{e}");
        assert!(parse(&EXAMPLE.replace("name: resnet-sweep-7", "name: \"\"")).is_err());
    }

    #[test]
    fn a_gpu_share_is_its_milli_and_memory_and_round_trips() {
        let text = EXAMPLE.replace(
            "nvidia.com/gpu: 2",
            "nvidia.com/gpu-milli: 250\n      nvidia.com/gpu-memory: 10Gi",
        );
        let spec = job_spec(&parse(&text).unwrap()).unwrap();
        assert_eq!(
            (spec.gpus_per_task, spec.gpu_milli, spec.gpu_memory_mib),
            (1, 250, 10_240)
        );
        let job = pb::Job {
            spec: Some(spec.clone()),
            ..Default::default()
        };
        let yaml = serde_norway::to_string(&manifest_of(&job)).unwrap();
        assert!(yaml.contains("nvidia.com/gpu-milli: 250\n"), "{yaml}");
        assert_eq!(job_spec(&parse(&yaml).unwrap()).unwrap(), spec, "{yaml}");
        for (bad, says) in [
            ("nvidia.com/gpu-milli: 1000", "1 to 999"),
            ("nvidia.com/gpu-memory: 1Gi", "give nvidia.com/gpu-milli"),
        ] {
            let text = EXAMPLE.replace("nvidia.com/gpu: 2", bad);
            let e = job_spec(&parse(&text).unwrap()).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let text = EXAMPLE.replace(
            "nvidia.com/gpu: 2",
            "nvidia.com/gpu-milli: 5\n      nvidia.com/mig-1g.10gb: 1",
        );
        let e = job_spec(&parse(&text).unwrap()).unwrap_err().to_string();
        assert!(e.contains("exclude each other"), "{e}");
    }

    #[test]
    fn a_job_printed_as_a_manifest_applies_back_to_the_same_spec() {
        let spec = job_spec(&parse(EXAMPLE).unwrap()).unwrap();
        let job = pb::Job {
            spec: Some(spec.clone()),
            ..Default::default()
        };
        let text = serde_norway::to_string(&manifest_of(&job)).unwrap();
        let again = job_spec(&parse(&text).unwrap()).unwrap();
        assert_eq!(again, spec, "{text}");
    }
}
