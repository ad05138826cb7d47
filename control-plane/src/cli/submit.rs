//! `gpuctl submit`: Slurm-like flags to a `JobSpec`, with an idempotency key so that retries
//! across replicas (and after a leader failover) never create a second job.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use super::parse::{parse_dependencies, parse_mem_mib, parse_time_limit};
use crate::client::{Client, with_timeout};

#[derive(clap::Args)]
pub struct SubmitArgs {
    /// GPUs per task (Slurm's `--gpus-per-task`).
    #[arg(
        long,
        short = 'G',
        alias = "gpus-per-task",
        default_value_t = 1,
        allow_negative_numbers = true
    )]
    pub gpus: i64,
    /// Number of tasks; tasks of one job are placed all together or not at all.
    #[arg(
        long,
        short = 'n',
        alias = "ntasks",
        default_value_t = 1,
        allow_negative_numbers = true
    )]
    pub tasks: i64,
    /// Time limit: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (or 90s, 30m, 12h, 2d).
    #[arg(long, short = 't')]
    pub time: Option<String>,
    #[arg(long, short = 'p')]
    pub partition: Option<String>,
    /// Tenant (team or account) the job is charged to. Default: a user token's own tenant,
    /// or `default`.
    #[arg(long, short = 'A', alias = "account", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    /// Job name (defaults to the program's name).
    #[arg(long, short = 'J', alias = "job-name")]
    pub name: Option<String>,
    /// Acceptable GPU models, e.g. `A100|H100` (repeat or separate with `|`).
    #[arg(long = "gpu-model", short = 'C', alias = "constraint")]
    pub gpu_models: Vec<String>,
    /// Priority class: low, normal or high.
    #[arg(long, default_value = "normal")]
    pub priority: String,
    /// CPUs per task (fractions allowed, e.g. 0.5).
    #[arg(long, short = 'c', alias = "cpus-per-task")]
    pub cpus: Option<f64>,
    /// Host memory per task: MiB, or with K/M/G/T suffix.
    #[arg(long)]
    pub mem: Option<String>,
    /// Working directory of the tasks on the GPU hosts (default: the current directory, as
    /// sbatch does). A host without it runs the task in its scratch directory and says so.
    #[arg(long, short = 'D', alias = "workdir", value_name = "DIR")]
    pub chdir: Option<PathBuf>,
    /// A share of one GPU per task, in milli-GPU (1-999; `--gpus` must be 1): shares are packed
    /// onto one GPU up to 1000 milli and its memory.
    #[arg(long, alias = "gpu-share", value_name = "MILLI")]
    pub gpu_milli: Option<u32>,
    /// GPU memory a share may use (MiB, or with K/M/G/T suffix); default: in proportion to
    /// `--gpu-milli`.
    #[arg(long, value_name = "SIZE")]
    pub gpu_mem: Option<String>,
    /// Run on MIG slices of this profile (`1g.10gb`, `3g.40gb`, ...): `--gpus` counts slices.
    #[arg(long, value_name = "PROFILE")]
    pub mig: Option<String>,
    /// The job may be stopped and requeued to make room for higher-priority work.
    #[arg(long)]
    pub preemptible: bool,
    /// All GPUs of a task must sit on one NUMA node (otherwise only preferred).
    #[arg(long)]
    pub single_numa: bool,
    /// Run each task in a container of this image, through the GPU hosts' container engine,
    /// with exactly its GPUs' device nodes; only nodes with an engine take the job.
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// With --image: bind-mount a host path, SRC:DST[:ro] (repeatable). The node must allow
    /// SRC (its agent's --container-mount-prefix).
    #[arg(long = "mount", value_name = "SRC:DST[:ro]", requires = "image")]
    pub mounts: Vec<String>,
    /// Accept the job even if no node could ever hold it (too many GPUs, CPUs or memory, an
    /// empty partition, no container engine): it pends as `Unfit: ...` until a node that
    /// fits joins. Without it such a job is refused with the reason.
    #[arg(long)]
    pub hold_if_unfit: bool,
    /// Dependencies: afterok:ID[:ID...],afterany:ID,afternotok:ID.
    #[arg(long, short = 'd')]
    pub dependency: Option<String>,
    /// Environment variables for the job, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// A retry with the same key returns the job the first attempt created. Generated when
    /// omitted, so gpuctl's own retries are safe.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// `--mount SRC:DST[:ro]` (`:rw` also accepted) as the API takes it.
fn parse_mount(text: &str) -> anyhow::Result<pb::ContainerMount> {
    let parts: Vec<&str> = text.split(':').collect();
    let (source, target, read_only) = match parts.as_slice() {
        [source, target] => (*source, *target, false),
        [source, target, "ro"] => (*source, *target, true),
        [source, target, "rw"] => (*source, *target, false),
        _ => bail!("--mount {text:?} is not SRC:DST or SRC:DST:ro"),
    };
    let source = std::path::absolute(source).with_context(|| format!("--mount {text}"))?;
    Ok(pb::ContainerMount {
        source: source
            .to_str()
            .with_context(|| format!("--mount {text}: the source is not UTF-8"))?
            .to_owned(),
        target: target.to_owned(),
        read_only,
    })
}

/// A key unique enough for one client's retries: time, process id and a counter.
fn generated_key() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "gpuctl-{nanos:x}-{:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn build_request(args: SubmitArgs) -> anyhow::Result<pb::SubmitJobRequest> {
    let time_limit_secs = match &args.time {
        Some(t) => parse_time_limit(t)? as i64,
        None => 0,
    };
    let cpu_milli_per_task = match args.cpus {
        Some(c) if !(c.is_finite() && c >= 0.0) => bail!("--cpus {c} is not a CPU count"),
        Some(c) => (c * 1000.0).round() as i64,
        None => 0,
    };
    let memory_mib_per_task = match &args.mem {
        Some(m) => parse_mem_mib(m)? as i64,
        None => 0,
    };
    let gpu_memory_mib = match &args.gpu_mem {
        Some(m) => parse_mem_mib(m)?,
        None => 0,
    };
    let dependencies = match &args.dependency {
        Some(d) => parse_dependencies(d)?,
        None => Vec::new(),
    };
    let mut env = HashMap::new();
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--env {kv:?} is not KEY=VALUE"))?;
        env.insert(k.to_owned(), v.to_owned());
    }
    let gpu_models = args
        .gpu_models
        .iter()
        .flat_map(|m| m.split('|'))
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty())
        .collect();
    let name = args.name.unwrap_or_else(|| {
        args.command
            .first()
            .map(|c| c.rsplit('/').next().unwrap_or(c).to_owned())
            .unwrap_or_default()
    });
    let container = match &args.image {
        Some(image) => Some(pb::ContainerSpec {
            image: image.clone(),
            mounts: args
                .mounts
                .iter()
                .map(|m| parse_mount(m))
                .collect::<anyhow::Result<_>>()?,
        }),
        None => None,
    };
    let workdir = match args.chdir {
        Some(dir) if container.is_some() => dir,
        Some(dir) => {
            std::path::absolute(&dir).with_context(|| format!("--chdir {}", dir.display()))?
        }
        // A container starts in its image's directory: the submitter's is not in it.
        None if container.is_some() => PathBuf::new(),
        None => std::env::current_dir().context("finding the current directory (give --chdir)")?,
    };
    let workdir = workdir
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("working directory {} is not UTF-8", workdir.display()))?
        .to_owned();
    Ok(pb::SubmitJobRequest {
        spec: Some(pb::JobSpec {
            tenant: args.tenant.unwrap_or_default(),
            name,
            command: args.command,
            gpus_per_task: args.gpus,
            tasks: args.tasks,
            gpu_models,
            partition: args.partition.unwrap_or_default(),
            priority_class: args.priority,
            time_limit_secs,
            dependencies,
            cpu_milli_per_task,
            memory_mib_per_task,
            env,
            gpu_milli: args.gpu_milli.unwrap_or(0),
            gpu_memory_mib,
            mig_profile: args.mig.unwrap_or_default(),
            preemptible: args.preemptible,
            single_numa: args.single_numa,
            workdir,
            container,
            hold_if_unfit: args.hold_if_unfit,
        }),
        idempotency_key: args.idempotency_key.unwrap_or_else(generated_key),
    })
}

pub async fn run(client: &mut Client, args: SubmitArgs, fmt: Format) -> anyhow::Result<()> {
    let req = build_request(args)?;
    let resp = client
        .call(|mut c, t| {
            let req = req.clone();
            async move { c.submit_job(with_timeout(req, t)).await }
        })
        .await?;
    match fmt {
        Format::Json => println!("{}", json!({"id": resp.id, "created": resp.created})),
        Format::Table if resp.created => println!("Submitted job {}", resp.id),
        Format::Table => println!("Job {} already exists for this idempotency key", resp.id),
    }
    Ok(())
}
