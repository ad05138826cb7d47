//! `gpuctl submit`: Slurm-like flags to a `JobSpec`, with an idempotency key so that retries
//! across replicas (and after a leader failover) never create a second job.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use super::parse::{parse_dependencies, parse_mem_mib, parse_time_limit};
use super::slurm_syntax;
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
    /// Slurm's generic resource, per node: `gpu:N` or `gpu:TYPE:N` (N GPUs per task, TYPE a
    /// GPU model).
    #[arg(long, value_name = "gpu[:TYPE]:N")]
    pub gres: Option<String>,
    /// GPUs on each node (Slurm's `--gpus-per-node`): GPUs per task, one task per node.
    #[arg(long, value_name = "N")]
    pub gpus_per_node: Option<i64>,
    /// Nodes (Slurm's `-N`): that many tasks, with `--gres`/`--gpus-per-node` GPUs each.
    #[arg(long, short = 'N', value_name = "N")]
    pub nodes: Option<i64>,
    /// A job array (sbatch's `--array`): one job per index, `0-99`, `1,3,5`, `0-15:4`, with
    /// `%N` for at most N of them running at once (`0-99%8`). Each job sees its index in
    /// `SLURM_ARRAY_TASK_ID`; `%A` and `%a` in --stdout/--stderr are the array's id and index.
    #[arg(long, short = 'a', value_name = "INDICES[%N]")]
    pub array: Option<String>,
    /// Not eligible before this time (sbatch's `--begin`): `now+1hour`, `now+600`, `16:00`,
    /// `2026-12-24T08:00`, `midnight`, `tomorrow` (local time).
    #[arg(long, short = 'b', value_name = "TIME")]
    pub begin: Option<String>,
    /// Submit the job held: it waits until `gpuctl release JOB`.
    #[arg(long, short = 'H')]
    pub hold: bool,
    /// Run only on these nodes (Slurm's `-w`): a host list such as `gpu[01-04],gpu07`.
    #[arg(long, short = 'w', value_name = "HOSTLIST")]
    pub nodelist: Option<String>,
    /// Never run on these nodes (Slurm's `-x`): a host list.
    #[arg(long, short = 'x', value_name = "HOSTLIST")]
    pub exclude: Option<String>,
    /// Have the job's nodes to itself: it starts only on idle nodes and nothing else is
    /// placed beside it while it runs.
    #[arg(long)]
    pub exclusive: bool,
    /// A named host port for each task, from its node's range (repeatable): the task finds it
    /// in `PORT` (the first) and `GPUCP_PORT_<NAME>`. Placed only on nodes whose agents hand
    /// out ports (`--service-ports`).
    #[arg(long = "port", value_name = "NAME")]
    pub ports: Vec<String>,
    /// Write the job's stdout to this file on the host that runs it (sbatch's `-o`; `-o` is
    /// gpuctl's output format). `%j` job id, `%t` task, `%N` node, `%x` job name, `%%` a `%`;
    /// relative to the working directory. `gpuctl logs` still reads it.
    #[arg(long, value_name = "FILE")]
    pub stdout: Option<String>,
    /// Write the job's stderr to this file (sbatch's `-e`; `-e` is gpuctl's `--env`).
    #[arg(long, value_name = "FILE")]
    pub stderr: Option<String>,
    /// A batch script and its arguments (`gpuctl submit job.sh`, or `gpuctl sbatch job.sh`):
    /// its `#SBATCH` lines are options (the command line's win), and the job runs its text.
    /// (Everything after the script is the script's, as with sbatch.)
    #[arg(
        value_name = "SCRIPT",
        conflicts_with = "command",
        allow_hyphen_values = true,
        num_args = 1..
    )]
    pub script: Vec<String>,
    /// The program and its arguments, after `--`.
    #[arg(
        last = true,
        required_unless_present = "script",
        value_name = "COMMAND"
    )]
    pub command: Vec<String>,
}

/// Applies Slurm's per-node spellings (`-N`, `--gres`, `--gpus-per-node`) to tasks, GPUs
/// per task and GPU models.
fn apply_slurm_shape(args: &mut SubmitArgs) -> anyhow::Result<()> {
    if let Some(gres) = &args.gres {
        let (model, count) = parse_gres(gres)?;
        args.gpus = count;
        if let Some(model) = model {
            args.gpu_models.push(model);
        }
    }
    if let Some(n) = args.gpus_per_node {
        args.gpus = n;
    }
    if let Some(n) = args.nodes {
        args.tasks = n;
    }
    Ok(())
}

/// `gpu:N` or `gpu:TYPE:N` (Slurm's `--gres`); other resources are refused by name.
pub fn parse_gres(text: &str) -> anyhow::Result<(Option<String>, i64)> {
    let parts: Vec<&str> = text.split(':').collect();
    let count = |n: &str| {
        n.parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .with_context(|| format!("--gres {text:?}: {n:?} is not a GPU count"))
    };
    match parts.as_slice() {
        ["gpu"] => Ok((None, 1)),
        ["gpu", n] if n.parse::<i64>().is_ok() => Ok((None, count(n)?)),
        ["gpu", model] => Ok((Some((*model).to_owned()), 1)),
        ["gpu", model, n] => Ok((Some((*model).to_owned()), count(n)?)),
        [other, ..] => bail!(
            "--gres {text:?}: only GPUs are generic resources here (gpu[:TYPE]:N), not {other:?}"
        ),
        [] => bail!("--gres is empty"),
    }
}

/// `--cpus C` (fractions allowed) as milli-CPUs.
pub(crate) fn cpu_milli(cpus: f64) -> anyhow::Result<i64> {
    if !(cpus.is_finite() && (0.0..=1e9).contains(&cpus)) {
        bail!("--cpus {cpus} is not a CPU count");
    }
    Ok((cpus * 1000.0).round() as i64)
}

/// One `--env KEY=VALUE`.
pub(crate) fn env_pair(kv: &str) -> anyhow::Result<(String, String)> {
    let (k, v) = kv
        .split_once('=')
        .with_context(|| format!("--env {kv:?} is not KEY=VALUE"))?;
    Ok((k.to_owned(), v.to_owned()))
}

/// `--gpu-model` values, repeated or separated by `|`, as a list of models.
pub(crate) fn gpu_model_list(values: &[String]) -> Vec<String> {
    values
        .iter()
        .flat_map(|m| m.split('|'))
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

/// `--mount SRC:DST[:ro]` (`:rw` also accepted) as the API takes it.
pub(crate) fn parse_mount(text: &str) -> anyhow::Result<pb::ContainerMount> {
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

pub fn build_request(mut args: SubmitArgs) -> anyhow::Result<pb::SubmitJobRequest> {
    apply_slurm_shape(&mut args)?;
    if !args.script.is_empty() {
        let path = &args.script[0];
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the batch script {path}"))?;
        let name = std::path::Path::new(path)
            .file_name()
            .map_or(path.clone(), |n| n.to_string_lossy().into_owned());
        args.command = super::batch_script::parse(&name, &text, &args.script[1..])?.command;
        if args.name.is_none() {
            args.name = Some(name);
        }
    }
    let time_limit_secs = match &args.time {
        Some(t) => parse_time_limit(t)? as i64,
        None => 0,
    };
    let cpu_milli_per_task = args.cpus.map(cpu_milli).transpose()?.unwrap_or(0);
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
        let (k, v) = env_pair(kv)?;
        env.insert(k, v);
    }
    let gpu_models = gpu_model_list(&args.gpu_models);
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
    let hosts = |list: &Option<String>| match list {
        Some(l) => slurm_syntax::expand_hostlist(l),
        None => Ok(Vec::new()),
    };
    let begin_at_ms = match &args.begin {
        Some(b) => slurm_syntax::parse_begin(b, &jiff::ZonedDateTime::now())?,
        None => 0,
    };
    let array = args
        .array
        .as_deref()
        .map(slurm_syntax::parse_array)
        .transpose()?;
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
            stdout_path: args.stdout.unwrap_or_default(),
            stderr_path: args.stderr.unwrap_or_default(),
            hold_if_unfit: args.hold_if_unfit,
            nodelist: hosts(&args.nodelist)?,
            exclude: hosts(&args.exclude)?,
            exclusive: args.exclusive,
            begin_at_ms,
            hold: args.hold,
            array,
            ports: args.ports,
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
        Format::Json | Format::Yaml => {
            println!(
                "{}",
                json!({"id": resp.id, "created": resp.created, "jobs": resp.jobs})
            )
        }
        Format::Table if resp.created && resp.jobs > 1 => println!(
            "Submitted array job {} ({} jobs: {}_INDEX; `gpuctl cancel {}` cancels them all)",
            resp.id, resp.jobs, resp.id, resp.id
        ),
        Format::Table if resp.created => println!("Submitted job {}", resp.id),
        Format::Table | Format::Wide => {
            println!("Job {} already exists for this idempotency key", resp.id)
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gres_names_gpus_with_an_optional_model() {
        assert_eq!(parse_gres("gpu:4").unwrap(), (None, 4));
        assert_eq!(parse_gres("gpu:a100:2").unwrap(), (Some("a100".into()), 2));
        assert_eq!(parse_gres("gpu").unwrap(), (None, 1));
        assert_eq!(parse_gres("gpu:h100").unwrap(), (Some("h100".into()), 1));
        let e = parse_gres("shard:4").unwrap_err().to_string();
        assert!(e.contains("only GPUs") && e.contains("shard"), "{e}");
        assert!(parse_gres("gpu:a100:-1").is_err());
    }

    fn parsed(args: &[&str]) -> pb::JobSpec {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from(["gpuctl", "submit"].iter().chain(args).copied())
            .unwrap();
        let crate::cli::Command::Submit(a) = cli.command else {
            panic!("not a submit")
        };
        build_request(a).unwrap().spec.unwrap()
    }

    #[test]
    fn slurms_per_node_spellings_set_tasks_gpus_and_models() {
        let s = parsed(&["-N", "2", "--gres=gpu:h100:8", "--", "true"]);
        assert_eq!((s.tasks, s.gpus_per_task), (2, 8));
        assert_eq!(s.gpu_models, ["h100"]);
        let s = parsed(&["--gpus-per-node", "4", "--", "true"]);
        assert_eq!(s.gpus_per_task, 4);
    }

    #[test]
    fn the_last_of_a_repeated_option_wins_so_the_command_line_beats_a_script() {
        let s = parsed(&["-G", "2", "-J", "from-script", "-G", "1", "--", "true"]);
        assert_eq!((s.gpus_per_task, s.name.as_str()), (1, "from-script"));
    }

    #[test]
    fn a_batch_script_is_the_job_and_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train.sh");
        std::fs::write(&script, "#!/bin/sh\n#SBATCH -G 2\necho hi\n").unwrap();
        let s = parsed(&[
            "--stdout",
            "out-%j",
            script.to_str().unwrap(),
            "a1",
            "--lr",
            "0.1",
        ]);
        assert_eq!(s.name, "train.sh");
        assert_eq!(s.command[..2], ["/bin/sh".to_string(), "-c".to_string()]);
        assert_eq!(
            s.command[3..],
            ["train.sh", "a1", "--lr", "0.1"].map(String::from)
        );
        assert_eq!(s.stdout_path, "out-%j");
        // After the script, even gpuctl's own flags are the script's, as with sbatch.
        let s = parsed(&[script.to_str().unwrap(), "-n", "3"]);
        assert_eq!(s.tasks, 1);
        assert_eq!(s.command[3..], ["train.sh", "-n", "3"].map(String::from));
    }
}

#[cfg(test)]
mod generated_docs_tests {
    #[test]
    fn completions_and_the_man_page_cover_the_commands() {
        let mut bash = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut <crate::cli::Cli as clap::CommandFactory>::command(),
            "gpuctl",
            &mut bash,
        );
        let bash = String::from_utf8(bash).unwrap();
        for word in ["submit", "sbatch", "apply", "--gres", "--attempt"] {
            assert!(bash.contains(word), "bash completion lacks {word}");
        }
        let mut man = Vec::new();
        clap_mangen::Man::new(<crate::cli::Cli as clap::CommandFactory>::command())
            .render(&mut man)
            .unwrap();
        let man = String::from_utf8(man).unwrap();
        assert!(
            man.contains(".TH gpuctl 1") && man.contains("submit"),
            "{man}"
        );
    }
}
