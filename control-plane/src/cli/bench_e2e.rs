//! `gpuctl bench e2e`: end-to-end jobs per second, ours and Slurm's, side by side in one run.
//!
//! The same shape on both: `--hosts` hosts of `--gpus-per-host` GPUs, `--jobs` jobs that each
//! run `sleep 0` on one GPU, timed from release to all completed.
//!
//! Ours: three replica processes (durable storage on loopback) and one real agent process per
//! simulated host (`gpuctl agent --simulated PRESET`, the node agent's code, launching every
//! job through its shim). The system has no per-job hold, so the jobs are held the way an
//! operator holds a cluster's work: every node is drained while the jobs are submitted, and
//! the clock starts when the nodes are undrained (the undrain writes are inside the timing).
//! Completion is observed through the API (a `WatchJobs` stream on the leader).
//!
//! Slurm's: see `bench_slurm` (`sbatch --hold`, then `scontrol release`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::bench_slurm;
use super::output::{Format, table};
use crate::client::with_timeout;
use crate::local_cluster::{LocalCluster, free_ports};

pub struct Args {
    pub hosts: usize,
    pub gpus_per_host: usize,
    pub jobs: usize,
    pub skip_slurm: bool,
    /// Also run ours with the agents' cgroups off, to measure what enforcement costs a job.
    pub without_cgroups_too: bool,
    /// Also run ours with every job in a container (an image of this host's `sleep`), to
    /// measure what a container costs a job.
    pub with_containers_too: bool,
    /// Also run ours with shims exec'd per job instead of forked by the agents' launchers, to
    /// measure what the launcher saves a job.
    pub with_exec_shims_too: bool,
}

/// How our side runs its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Processes, each in a cgroup of its own (where the host allows).
    Enforced,
    /// Processes, the agents' cgroups off.
    Unenforced,
    /// Each job in a container of [`BENCH_IMAGE`], with cgroups.
    Containers,
    /// Processes with cgroups, each job's shim exec'd rather than forked by the launcher.
    ExecShims,
}

impl Variant {
    /// Its row in the table.
    fn label(self) -> &'static str {
        match self {
            Variant::Enforced => "gpu-control-plane",
            Variant::Unenforced => "gpu-control-plane (--cgroups off)",
            Variant::Containers => "gpu-control-plane (--image: containers)",
            Variant::ExecShims => "gpu-control-plane (--shim-start exec)",
        }
    }

    /// Prefix of its figures in the JSON.
    fn json_key(self) -> &'static str {
        match self {
            Variant::Enforced => "gpucp",
            Variant::Unenforced => "gpucp_without_cgroups",
            Variant::Containers => "gpucp_containers",
            Variant::ExecShims => "gpucp_exec_shims",
        }
    }

    /// What it changes in a job's time against the default side (cgroups, forked shims).
    fn difference(self) -> Option<Difference> {
        let (json_key, words, slower) = match self {
            Variant::Enforced => return None,
            Variant::Unenforced => (
                "enforcement_cost_ms_per_job",
                "enforcement cost per job (cgroup created, joined, emptied, read, removed)",
                false,
            ),
            Variant::Containers => (
                "container_cost_ms_per_job",
                "container cost per job over a process with cgroups (create, attach, start, wait, remove through the engine)",
                true,
            ),
            Variant::ExecShims => (
                "launcher_saving_ms_per_job",
                "what forking shims from the launcher saves per job (against exec'ing each)",
                true,
            ),
        };
        Some(Difference {
            json_key,
            words,
            variant_is_slower: slower,
        })
    }
}

/// A side's difference from the default one, reported as the slower side's extra time.
struct Difference {
    json_key: &'static str,
    words: &'static str,
    /// The variant adds the time (containers, exec'd shims) rather than saves it (no cgroups).
    variant_is_slower: bool,
}

/// The image container jobs run: this host's `sleep` and its libraries.
const BENCH_IMAGE: &str = "gpucp-bench/sleep:1";

/// Tenant of the benchmark's jobs (no limit is set for it).
const TENANT: &str = "bench-e2e";
/// Concurrent submitters while the jobs are held (submission is not timed).
const SUBMITTERS: usize = 32;
/// Longest wait for the jobs of one side to complete once released.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// What one side measured.
pub struct SideResult {
    pub seconds: f64,
    pub succeeded: usize,
    /// Jobs that ended otherwise (failed, cancelled, ...), with their final state.
    pub other: Vec<(String, String)>,
    /// What the agents enforced, as the first node registered it (ours only).
    pub enforcement: String,
}

impl SideResult {
    pub fn jobs_per_sec(&self) -> f64 {
        self.succeeded as f64 / self.seconds
    }
}

/// A simulated host preset with `gpus` GPUs.
fn preset_for(gpus: usize) -> anyhow::Result<&'static str> {
    Ok(match gpus {
        8 => "dgx-h100",
        4 => "a100-pcie-4gpu-nvlink-pairs",
        1 => "h100-pcie-1gpu",
        n => bail!(
            "--gpus-per-host {n}: simulated hosts come in presets of 1, 4 or 8 GPUs; pick one of those"
        ),
    })
}

pub fn run(args: Args, keep_data: Option<PathBuf>, fmt: Format) -> anyhow::Result<()> {
    if args.hosts == 0 || args.jobs == 0 {
        bail!("--hosts and --jobs must be at least 1");
    }
    let preset = preset_for(args.gpus_per_host)?;
    eprintln!(
        "gpu-control-plane: {} hosts × {} GPUs ({preset}), {} jobs of `sleep 0`...",
        args.hosts, args.gpus_per_host, args.jobs
    );
    // Our side's files are deleted only once Slurm's side has run too. On the journal-less
    // ext4 of the machines this runs on, creating a file scans past every inode deleted in the
    // last minutes, so deleting our thousands of job files first would slow Slurm's side (it
    // creates files for every job as well).
    let ours_dir = tempfile::Builder::new()
        .prefix("gpucp-bench-e2e-")
        .tempdir()?;
    let data_dir = keep_data
        .clone()
        .unwrap_or_else(|| ours_dir.path().to_owned());
    let ours = run_ours(&args, preset, data_dir.clone(), Variant::Enforced)
        .context("the gpu-control-plane side of the benchmark failed")?;
    eprintln!(
        "gpu-control-plane: {} jobs in {:.2} s ({:.0} jobs/s); {}",
        ours.succeeded,
        ours.seconds,
        ours.jobs_per_sec(),
        ours.enforcement
    );
    let mut variants = Vec::new();
    if args.without_cgroups_too {
        variants.push(Variant::Unenforced);
    }
    if args.with_exec_shims_too {
        variants.push(Variant::ExecShims);
    }
    if args.with_containers_too {
        if !crate::host_image::engine_available() {
            bail!("--with-containers-too needs the local Docker engine, which does not answer");
        }
        crate::host_image::build(BENCH_IMAGE, &["sleep"])?;
        variants.push(Variant::Containers);
    }
    let mut others = Vec::new();
    for variant in variants {
        eprintln!("{}: same shape...", variant.label());
        let dir = data_dir.join(variant.json_key());
        let r = run_ours(&args, preset, dir, variant)
            .with_context(|| format!("the side {:?} failed", variant.label()))?;
        eprintln!(
            "{}: {} jobs in {:.2} s ({:.1} jobs/s)",
            variant.label(),
            r.succeeded,
            r.seconds,
            r.jobs_per_sec()
        );
        others.push((variant, r));
    }
    let slurm = if args.skip_slurm {
        None
    } else {
        eprintln!("Slurm: same shape...");
        let r = bench_slurm::run(&bench_slurm::Shape {
            hosts: args.hosts,
            gpus_per_host: args.gpus_per_host,
            jobs: args.jobs,
            keep_dir: keep_data.map(|d| d.join("slurm")),
        })
        .context("the Slurm side of the benchmark failed (use --skip-slurm to run ours alone)")?;
        eprintln!(
            "Slurm: {} jobs in {:.2} s ({:.1} jobs/s)",
            r.succeeded,
            r.seconds,
            r.jobs_per_sec()
        );
        Some(r)
    };
    drop(ours_dir);
    let (text, json) = report(&args, &ours, &others, slurm.as_ref());
    match fmt {
        Format::Json | Format::Yaml => println!("{json}"),
        Format::Table | Format::Wide => print!("{text}"),
    }
    // The smoke run in CI relies on this: every job of each side must have succeeded.
    let sides = [(Variant::Enforced.label(), Some(&ours))]
        .into_iter()
        .chain(others.iter().map(|(v, r)| (v.label(), Some(r))))
        .chain([("Slurm", slurm.as_ref())]);
    for (side, r) in sides {
        if let Some(r) = r
            && (r.succeeded != args.jobs || !r.other.is_empty())
        {
            bail!(
                "{side}: {} of {} jobs succeeded; others: {:?}",
                r.succeeded,
                args.jobs,
                &r.other[..r.other.len().min(10)]
            );
        }
    }
    Ok(())
}

fn report(
    args: &Args,
    ours: &SideResult,
    others: &[(Variant, SideResult)],
    slurm: Option<&SideResult>,
) -> (String, serde_json::Value) {
    let row = |label: String, r: &SideResult| {
        vec![
            label,
            r.succeeded.to_string(),
            format!("{:.2}", r.seconds),
            format!("{:.1}", r.jobs_per_sec()),
        ]
    };
    let mut rows = vec![row(
        format!("{} ({})", Variant::Enforced.label(), ours.enforcement),
        ours,
    )];
    // Each GPU runs its jobs one after another, so the extra wall time per job on one GPU is
    // the difference in run time times the GPUs, over the jobs.
    let gpus = (args.hosts * args.gpus_per_host) as f64;
    let per_job_ms = |more: f64, less: f64| (more - less) * gpus / args.jobs as f64 * 1000.0;
    let mut json = serde_json::Map::new();
    let mut costs = Vec::new();
    for (variant, r) in others {
        rows.push(row(variant.label().to_owned(), r));
        let key = variant.json_key();
        json.insert(format!("{key}_seconds"), json!(r.seconds));
        json.insert(format!("{key}_jobs_per_sec"), json!(r.jobs_per_sec()));
        if let Some(d) = variant.difference() {
            let ms = if d.variant_is_slower {
                per_job_ms(r.seconds, ours.seconds)
            } else {
                per_job_ms(ours.seconds, r.seconds)
            };
            json.insert(d.json_key.to_owned(), json!(ms));
            costs.push(format!("{}: {ms:.1} ms of GPU time\n", d.words));
        }
    }
    if let Some(s) = slurm {
        rows.push(row("slurm (tuned)".to_owned(), s));
    }
    let ratio = slurm.map(|s| ours.jobs_per_sec() / s.jobs_per_sec());
    let mut text = format!(
        "{} hosts x {} GPUs, {} jobs of `sleep 0` on one GPU each, from release to all completed\n",
        args.hosts, args.gpus_per_host, args.jobs
    );
    text.push_str(&table(
        &["SYSTEM", "COMPLETED", "SECONDS", "JOBS_PER_SEC"],
        &rows,
    ));
    if let Some(r) = ratio {
        text.push_str(&format!("ratio (ours / Slurm's jobs/s): {r:.1}x\n"));
    }
    for line in costs {
        text.push_str(&line);
    }
    json.extend(
        [
            ("benchmark", json!("e2e")),
            ("hosts", json!(args.hosts)),
            ("gpus_per_host", json!(args.gpus_per_host)),
            ("jobs", json!(args.jobs)),
            ("gpucp_seconds", json!(ours.seconds)),
            ("gpucp_completed", json!(ours.succeeded)),
            ("gpucp_jobs_per_sec", json!(ours.jobs_per_sec())),
            ("gpucp_enforcement", json!(ours.enforcement)),
            ("slurm_seconds", json!(slurm.map(|s| s.seconds))),
            ("slurm_completed", json!(slurm.map(|s| s.succeeded))),
            ("slurm_jobs_per_sec", json!(slurm.map(|s| s.jobs_per_sec()))),
            (
                "slurm_scheduler_parameters",
                json!(slurm.map(|_| bench_slurm::SCHEDULER_PARAMETERS)),
            ),
            ("ratio", json!(ratio)),
            (
                "hold",
                json!("nodes drained during submission, undrained at release"),
            ),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    let json = serde_json::Value::Object(json);
    (text, json)
}

fn run_ours(
    args: &Args,
    preset: &str,
    dir: PathBuf,
    variant: Variant,
) -> anyhow::Result<SideResult> {
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let ports = free_ports(3 + args.hosts)?;
    let mut cluster = LocalCluster::new(&exe, &["replica"], &dir, "bench-e2e", &ports[..3]);
    cluster.agent_program = Some((exe.clone(), vec!["agent".into()]));
    let names: Vec<String> = (1..=args.hosts).map(|i| format!("host-{i}")).collect();
    for (name, port) in names.iter().zip(&ports[3..]) {
        cluster.add_agent(
            name,
            preset,
            *port,
            &[
                "--stop-grace-secs",
                "10",
                "--cgroups",
                if variant == Variant::Unenforced {
                    "off"
                } else {
                    "auto"
                },
                "--containers",
                if variant == Variant::Containers {
                    "require"
                } else {
                    "off"
                },
                "--shim-start",
                if variant == Variant::ExecShims {
                    "exec"
                } else {
                    "fork"
                },
                "--image-pull",
                "never",
            ],
        );
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let status = cluster.wait_for_leader(Duration::from_secs(30)).await?;
        for name in &names {
            cluster.start_agent(name)?;
        }
        cluster
            .wait_for_nodes(&names, Some(args.gpus_per_host), Duration::from_secs(30))
            .await
            .with_context(|| {
                format!(
                    "the simulated hosts did not register; see the agent logs in {}",
                    dir.display()
                )
            })?;
        let mut client = cluster.client()?;
        // Hold: no node takes work while the jobs are submitted.
        for name in &names {
            let req = pb::DrainNodeRequest {
                node: name.clone(),
                evict: false,
                reason: "bench e2e: holding the jobs until release".into(),
            };
            client
                .call(|mut c, t| {
                    let r = req.clone();
                    async move { c.drain_node(with_timeout(r, t)).await }
                })
                .await
                .with_context(|| format!("draining {name}"))?;
        }
        submit_all(&cluster, args.jobs, variant == Variant::Containers).await?;
        // Watch from the leader (it applies a commit first), starting with the current jobs.
        let mut watch = JobWatch::new(
            cluster.addr(status.leader),
            cluster.credentials()?,
            args.jobs,
        );
        watch.connect().await?;

        let t0 = Instant::now();
        let undrains = names.iter().map(|name| {
            let mut client = client.clone();
            let req = pb::UndrainNodeRequest { node: name.clone() };
            async move {
                client
                    .call(|mut c, t| {
                        let r = req.clone();
                        async move { c.undrain_node(with_timeout(r, t)).await }
                    })
                    .await
                    .with_context(|| format!("undraining {}", req.node))
            }
        });
        for r in futures::future::join_all(undrains).await {
            r?;
        }
        watch
            .until_all_final(t0 + RUN_TIMEOUT)
            .await
            .with_context(|| format!("see the replica and agent logs in {}", dir.display()))?;
        let seconds = t0.elapsed().as_secs_f64();
        let enforcement = client
            .call(|mut c, t| async move {
                c.list_nodes(with_timeout(pb::ListNodesRequest::default(), t))
                    .await
            })
            .await?
            .nodes
            .first()
            .map(|n| n.enforcement.clone())
            .unwrap_or_default();
        Ok(SideResult {
            enforcement,
            ..watch.result(seconds)
        })
    })
}

async fn submit_all(cluster: &LocalCluster, jobs: usize, containers: bool) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for w in 0..SUBMITTERS.min(jobs) {
        let mut client = cluster.client()?;
        tasks.push(tokio::spawn(async move {
            for i in (w..jobs).step_by(SUBMITTERS) {
                let req = pb::SubmitJobRequest {
                    spec: Some(pb::JobSpec {
                        tenant: TENANT.into(),
                        name: format!("e2e-{i}"),
                        command: vec!["sleep".into(), "0".into()],
                        gpus_per_task: 1,
                        tasks: 1,
                        priority_class: "normal".into(),
                        container: containers.then(|| pb::ContainerSpec {
                            image: BENCH_IMAGE.into(),
                            mounts: Vec::new(),
                        }),
                        ..Default::default()
                    }),
                    idempotency_key: format!("e2e-{i}"),
                };
                client
                    .call(|mut c, t| {
                        let r = req.clone();
                        async move { c.submit_job(with_timeout(r, t)).await }
                    })
                    .await
                    .with_context(|| format!("submitting job {i}"))?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Follows the benchmark's jobs through `WatchJobs` until every one is in a final state.
struct JobWatch {
    addr: String,
    credentials: crate::client::Credentials,
    expected: usize,
    /// Job id → latest state seen.
    states: HashMap<u64, String>,
    stream: Option<tonic::Streaming<pb::JobEvent>>,
}

fn is_final(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled" | "timed_out")
}

impl JobWatch {
    fn new(addr: String, credentials: crate::client::Credentials, expected: usize) -> JobWatch {
        JobWatch {
            addr,
            credentials,
            expected,
            states: HashMap::new(),
            stream: None,
        }
    }

    /// (Re)opens the stream; its initial listing refreshes every job's state, so a watch that
    /// fell behind loses nothing by reconnecting.
    async fn connect(&mut self) -> anyhow::Result<()> {
        let mut c = self.credentials.api_client(&self.addr)?;
        let stream = c
            .watch_jobs(pb::WatchJobsRequest {
                tenant: TENANT.into(),
                initial: true,
            })
            .await
            .with_context(|| format!("watching jobs on {}", self.addr))?
            .into_inner();
        self.stream = Some(stream);
        Ok(())
    }

    fn finished(&self) -> usize {
        self.states.values().filter(|s| is_final(s)).count()
    }

    async fn until_all_final(&mut self, deadline: Instant) -> anyhow::Result<()> {
        while self.states.len() < self.expected || self.finished() < self.expected {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "only {} of {} jobs completed within {RUN_TIMEOUT:?}",
                    self.finished(),
                    self.expected
                );
            }
            let stream = self.stream.as_mut().context("watch not connected")?;
            match tokio::time::timeout(left, stream.message()).await {
                Err(_) => continue,
                Ok(Ok(Some(ev))) => {
                    if let Some(job) = ev.job {
                        self.states.insert(job.id, job.state);
                    }
                }
                Ok(Ok(None)) | Ok(Err(_)) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    self.connect().await?;
                }
            }
        }
        Ok(())
    }

    fn result(&self, seconds: f64) -> SideResult {
        let succeeded = self.states.values().filter(|s| *s == "succeeded").count();
        let other = self
            .states
            .iter()
            .filter(|(_, s)| *s != "succeeded")
            .map(|(id, s)| (id.to_string(), s.clone()))
            .collect();
        SideResult {
            seconds,
            succeeded,
            other,
            enforcement: String::new(),
        }
    }
}
