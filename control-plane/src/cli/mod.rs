//! `gpuctl`: the command-line client. Slurm-like flags (`submit --gpus 2 --time 24:00:00
//! --partition a100 -- python train.py`), tables by default and `--output json` for scripts.
//! Each subcommand is a small function: build the request, call any replica through
//! `Client`, print the answer.

pub mod accounting;
pub mod agent_rollout;
mod apt;
mod backup;
mod batch_script;
mod bench;
mod bench_e2e;
mod bench_encoding;
mod bench_etcd;
mod bench_failover;
mod bench_hosts;
mod bench_membership;
mod bench_memory;
mod bench_placement;
mod bench_rollout;
mod bench_scale;
mod bench_scale_plot;
mod bench_scheduler;
mod bench_service;
mod bench_slurm;
mod bench_status_page;
mod bench_submit;
mod bench_submit_closed;
mod certs;
pub mod columns;
pub mod demo_server;
mod dev;
mod job_control;
mod kube;
mod logs;
mod manifest;
mod node;
pub mod output;
pub mod parse;
pub mod probe_spec;
pub mod progress;
pub mod replay;
mod service;
mod service_manifest;
pub mod service_output;
mod service_spec;
mod simulate;
pub mod slurm_syntax;
mod submit;
mod tokens;
mod why;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use proto::v1 as pb;
use serde_json::json;

use crate::client::{
    Client, Credentials, DEV_ENDPOINTS, ENDPOINTS_ENV, INSECURE_ENV, TLS_DIR_ENV, TOKEN_ENV,
    with_timeout,
};
use crate::config::ReplicaArgs;
use crate::replica::now_ms;
use output::Format;
use slurm_syntax::JobRef;

#[derive(Parser)]
#[command(
    name = "gpuctl",
    version,
    about = "Command-line client of gpu-control-plane",
    // An option given twice takes the last value: a batch script's #SBATCH directives come
    // first, so the command line's own options win, as with sbatch.
    args_override_self = true
)]
pub struct Cli {
    /// Control-plane replicas to talk to, comma-separated; any one of them will do.
    #[arg(long, global = true, env = ENDPOINTS_ENV, default_value = DEV_ENDPOINTS, value_name = "HOST:PORT,...")]
    pub endpoints: String,
    /// Output format.
    #[arg(long, short = 'o', global = true, value_enum, default_value = "table")]
    pub output: Format,
    /// Give up after this many seconds of retrying across replicas.
    #[arg(long, global = true, default_value_t = 15)]
    pub timeout: u64,
    /// Directory with ca.pem, cert.pem and key.pem (defaults to the admin identity `gpuctl
    /// dev` writes, ./dev-data/tls/admin). With only ca.pem there, give a --token.
    #[arg(long, global = true, env = TLS_DIR_ENV, value_name = "DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
    /// API token (`gpuctl token create` prints one): acts with its role and tenant.
    #[arg(long, global = true, env = TOKEN_ENV, value_name = "TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Talk plaintext, to a cluster run with --insecure.
    #[arg(long, global = true, env = INSECURE_ENV)]
    pub insecure: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// Where `gpuctl dev` keeps its data unless told otherwise (and where gpuctl looks for its
/// admin identity).
pub const DEV_DATA_DIR: &str = "./dev-data";

// Parsed once per run; boxing the replica's many flags would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Submit a `kind: GpuJob` manifest or create/change a `kind: GpuService` one
    /// (Kubernetes-shaped YAML), idempotent by its name.
    Apply(kube::ApplyArgs),
    /// Jobs or services by name, as `kubectl get` shows them (-o yaml: manifests; -o wide:
    /// more columns).
    Get(kube::GetArgs),
    /// One job or service by name, in full.
    Describe(kube::NamedArgs),
    /// Cancel the pending or running job of that name, or delete the service.
    Delete(kube::NamedArgs),
    /// Long-running services: replicas kept running and restarted, rolled out revision by
    /// revision, autoscaled (`gpuctl service create web --replicas 2 --port http -- serve`).
    Service {
        #[command(subcommand)]
        command: service::ServiceCommand,
    },
    /// Print a shell completion script: `gpuctl completions bash > /etc/bash_completion.d/gpuctl`
    /// (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Print gpuctl's man page (roff): `gpuctl man | man -l -`.
    Man,
    /// Submit a job: `gpuctl submit --gpus 2 --time 24:00:00 -- python train.py`, or a batch
    /// script with #SBATCH lines: `gpuctl submit train.sh` (alias: sbatch).
    #[command(visible_alias = "sbatch")]
    Submit(submit::SubmitArgs),
    /// List jobs (pending and running by default).
    #[command(alias = "squeue", alias = "list")]
    Queue(QueueArgs),
    /// Why a job is pending, and what would have to change for it to run.
    Why { job: JobRef },
    /// Show one job in detail (`41`, or `41_7` for index 7 of array 41).
    Show {
        job: JobRef,
        /// Read from the answering replica without a leader round-trip (may be slightly behind).
        #[arg(long)]
        stale: bool,
    },
    /// Cancel jobs (`41`; an array's id cancels every job of the array, `41_7` one of them).
    #[command(alias = "scancel")]
    Cancel {
        #[arg(required = true)]
        jobs: Vec<JobRef>,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Keep pending jobs from starting until released (scontrol hold).
    Hold {
        #[arg(required = true)]
        jobs: Vec<JobRef>,
    },
    /// Let held jobs start again; their queue time counts from now (scontrol release).
    Release {
        #[arg(required = true)]
        jobs: Vec<JobRef>,
    },
    /// Stop running jobs and queue them again, or queue finished ones again (scontrol
    /// requeue).
    Requeue {
        #[arg(required = true)]
        jobs: Vec<JobRef>,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Change a pending job's time limit, partition, priority, begin time or node lists, a
    /// job's name, or an array's limit (scontrol update).
    Update(job_control::UpdateArgs),
    /// Stream job changes as they are committed.
    Watch {
        #[arg(long, default_value = "")]
        tenant: String,
        /// Print every current job first.
        #[arg(long)]
        initial: bool,
    },
    /// List GPU nodes.
    #[command(alias = "sinfo")]
    Nodes {
        /// One node in detail instead (as `gpuctl node show NODE`).
        node: Option<String>,
        #[arg(long)]
        stale: bool,
        /// Columns of the table, `sinfo -N`-style: `--format "%N %t %G %c %m"`, or by name:
        /// `--format node,state,gres,numa`. `--format help` lists every column (tables only).
        #[arg(
            long,
            value_name = "SPEC",
            value_parser = columns::node_format,
            conflicts_with = "node"
        )]
        format: Option<String>,
    },
    /// Drain, undrain, uncordon GPUs, inject faults on simulated hosts.
    Node {
        #[command(subcommand)]
        command: NodeCommand,
    },
    /// Print a job's output (stdout and stderr), fetched through the control plane from the
    /// node that ran it.
    Logs(logs::LogsArgs),
    /// Replicas, leader, term and log indexes; add or remove replicas; back up and restore.
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Tenants and their quotas.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Partitions (pools of nodes).
    Partition {
        #[command(subcommand)]
        command: PartitionCommand,
    },
    /// API tokens: create (printed once), list, revoke. Admin only.
    Token {
        #[command(subcommand)]
        command: tokens::TokenCommand,
    },
    /// Who changed what, from where: the audit trail.
    Audit(tokens::AuditArgs),
    /// What each tenant's jobs used: jobs by state, GPU-hours, and from enforcing nodes'
    /// cgroups CPU-hours, memory peaks and OOM kills.
    #[command(alias = "sreport")]
    Accounting(accounting::AccountingArgs),
    /// Jobs one a line, finished ones included: elapsed time, GPU-hours, exit code (Slurm's
    /// sacct).
    Sacct(accounting::SacctArgs),
    /// Who the control plane takes you for (principal, role, tenant).
    Whoami,
    /// Create the cluster CA and certificates for replicas, nodes and clients (offline).
    Certs {
        #[command(subcommand)]
        command: certs::CertsCommand,
    },
    /// Run a local 3-replica control plane in the foreground (Ctrl-C stops it).
    Dev(dev::DevArgs),
    /// Benchmarks against a local cluster of real replica processes.
    Bench {
        /// Keep the replicas' data directories and logs here instead of a temporary directory.
        #[arg(long, value_name = "DIR")]
        keep_data: Option<std::path::PathBuf>,
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Trace-driven simulations of the scheduling policy, in this process (no cluster needed).
    Simulate {
        #[command(subcommand)]
        command: simulate::SimulateCommand,
    },
    /// Run one control-plane replica (what `gpuctl dev` starts; same flags as `control-plane`).
    #[command(hide = true)]
    Replica(ReplicaArgs),
    /// Run a node agent (what `gpuctl dev` starts for simulated hosts; same flags as `node-agent`).
    #[command(hide = true)]
    Agent(node_agent::agent::cli::AgentArgs),
    /// A small HTTP server to run as a service's replica in tours and tests: `/`, `/healthz`,
    /// `/ready`, `/metrics` (docs/SERVICES.md).
    #[command(hide = true)]
    DemoServer(demo_server::DemoServerArgs),
}

#[derive(clap::Args)]
pub struct QueueArgs {
    /// Include finished jobs.
    #[arg(long, short = 'a')]
    pub all: bool,
    /// Only jobs in these states (pending, scheduled, running, succeeded, failed, cancelled, timed_out).
    #[arg(long = "state", short = 't', value_delimiter = ',')]
    pub states: Vec<String>,
    #[arg(long, default_value = "")]
    pub tenant: String,
    #[arg(long, short = 'p', default_value = "")]
    pub partition: String,
    #[arg(long)]
    pub stale: bool,
    /// Columns of the table, squeue-style: `--format "%i %j %u %T %M %R"`, or by name:
    /// `--format id,name,state,time`. `--format help` lists every column (tables only).
    #[arg(long, value_name = "SPEC", value_parser = columns::job_format)]
    pub format: Option<String>,
}

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// The leader as known now, term, commit and applied index, and every member: role,
    /// whether it answers, when it last did, matched index and lag.
    Status,
    /// Add a replica: it joins as a learner, and becomes a voter once it has caught up and
    /// kept answering for a while; one that does not answer is not added.
    Add {
        #[arg(long)]
        id: u64,
        #[arg(long, value_name = "HOST:PORT")]
        address: String,
        /// Keep it a non-voting learner.
        #[arg(long)]
        learner: bool,
        /// Promote it even if the new voters would not have a majority that answers now.
        #[arg(long)]
        force: bool,
    },
    /// Remove a replica from the cluster; the removed replica stops taking part and says why.
    Remove {
        #[arg(long)]
        id: u64,
        /// Remove it even if the remaining voters would not have a majority that answers now
        /// (the change then commits only once enough of them are back).
        #[arg(long)]
        force: bool,
    },
    /// Backups: save the state to a file, restore replicas from one, inspect one.
    Snapshot {
        #[command(subcommand)]
        command: backup::SnapshotCommand,
    },
}

#[derive(Subcommand)]
pub enum NodeCommand {
    /// One node in detail: each GPU's NUMA node, PCI bus, health, holder, shares and MIG
    /// slices, and the GPU link matrix as `nvidia-smi topo -m` prints it.
    Show {
        node: String,
        #[arg(long)]
        stale: bool,
    },
    /// No new work on the node; with --evict, running work is stopped and requeued elsewhere.
    Drain {
        node: String,
        #[arg(long)]
        evict: bool,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Let the node take new work again.
    Undrain { node: String },
    /// Return an unhealthy GPU (UUID or index) to service.
    Uncordon { node: String, gpu: String },
    /// Restart agents in place (e.g. onto a newly installed binary) without touching their
    /// jobs, --max-unavailable at a time; each is checked first and waited for until ready.
    RestartAgent(agent_rollout::RestartAgentArgs),
    /// Simulated hosts only: inject a hardware fault on a GPU (by index).
    Inject {
        node: String,
        #[arg(long)]
        gpu: u32,
        /// Xid error code, e.g. 79 (fell off the bus), 48 (double-bit ECC), 13 (application).
        #[arg(long, conflicts_with_all = ["fall_off_bus", "recover"])]
        xid: Option<u32>,
        #[arg(long, conflicts_with = "recover")]
        fall_off_bus: bool,
        /// The GPU works again.
        #[arg(long)]
        recover: bool,
    },
}

#[derive(Subcommand)]
pub enum TenantCommand {
    /// Create or update a tenant. Once any tenant exists, jobs must name a known tenant.
    Set {
        name: String,
        #[arg(long, default_value_t = 1)]
        weight: u32,
        /// Guaranteed GPUs.
        #[arg(long, default_value_t = 0)]
        quota: u32,
        /// Most GPUs the tenant may hold, borrowing included (0: no limit).
        #[arg(long, default_value_t = 0)]
        max: u32,
    },
    List,
}

#[derive(Subcommand)]
pub enum PartitionCommand {
    /// Create or update a partition. Once any partition exists, jobs must name a known one.
    Set {
        name: String,
        #[arg(long, default_value = "")]
        description: String,
    },
    List,
}

/// Runs `gpuctl`. Returns the process exit code.
/// Parses gpuctl's command line. For `submit SCRIPT`, the script's `#SBATCH` directives are
/// read and placed before the command line's own options, which therefore win (sbatch's
/// rule); a directive gpuctl does not take is reported with the script's name.
pub fn parse_command_line() -> Cli {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = Cli::parse_from(&argv);
    let Command::Submit(args) = &cli.command else {
        return cli;
    };
    let Some(script) = args.script.first() else {
        return cli;
    };
    // A script that cannot be read is reported when the request is built.
    let Ok(text) = std::fs::read_to_string(script) else {
        return cli;
    };
    let directives = match batch_script::parse(script, &text, &[]) {
        Ok(b) => b.args,
        Err(e) => {
            eprintln!("gpuctl: error: {e:#}");
            std::process::exit(2);
        }
    };
    if directives.is_empty() {
        return cli;
    }
    // The directives alone, before a stand-in script: a word that is not an option would be
    // taken for the script itself.
    const STAND_IN: &str = "gpucp-directive-check.sh";
    let check = ["gpuctl", "submit"]
        .into_iter()
        .map(str::to_owned)
        .chain(directives.iter().cloned())
        .chain([STAND_IN.to_owned()]);
    let problem = match Cli::try_parse_from(check) {
        Err(e) => Some(e.to_string().lines().next().unwrap_or_default().to_owned()),
        Ok(Cli {
            command: Command::Submit(a),
            ..
        }) if a.script.first().is_some_and(|w| w != STAND_IN) => Some(format!(
            "{:?} is not an option of gpuctl submit",
            a.script[0]
        )),
        Ok(_) => None,
    };
    if let Some(problem) = problem {
        eprintln!("gpuctl: error: an #SBATCH directive of {script}: {problem}");
        std::process::exit(2);
    }
    let at = argv
        .iter()
        .position(|a| a == "submit" || a == "sbatch")
        .unwrap_or(1);
    let mut merged = argv[..=at].to_vec();
    merged.extend(directives.into_iter().map(Into::into));
    merged.extend(argv[at + 1..].iter().cloned());
    Cli::parse_from(merged)
}

pub fn main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Replica(args) => {
            return crate::server::run_replica_process(args, crate::config::Defaults::LOG_FILTER);
        }
        Command::Dev(args) => return dev::run(args),
        Command::DemoServer(args) => return demo_server::run(args),
        Command::Completions { shell } => {
            // Into a buffer first: the generator panics on a write error (`| head`).
            let mut script = Vec::new();
            clap_complete::generate(
                shell,
                &mut <Cli as clap::CommandFactory>::command(),
                "gpuctl",
                &mut script,
            );
            return write_stdout(&script);
        }
        Command::Man => {
            let mut page = Vec::new();
            clap_mangen::Man::new(<Cli as clap::CommandFactory>::command())
                .render(&mut page)
                .context("rendering the man page")?;
            return write_stdout(&page);
        }
        Command::Agent(args) => {
            let exe = std::env::current_exe().context("finding gpuctl's own path")?;
            return node_agent::agent::cli::run_agent_process(args, exe, "shim");
        }
        Command::Bench { command, keep_data } => return bench::run(command, keep_data, cli.output),
        Command::Simulate { command } => return simulate::run(command, cli.output),
        Command::Certs { command } => return certs::run(command, cli.output),
        Command::Cluster {
            command: ClusterCommand::Snapshot { command },
        } if backup::is_offline(&command) => return backup::run_offline(command, cli.output),
        // The column lists need no cluster.
        Command::Queue(QueueArgs {
            format: Some(ref f),
            ..
        }) if f == "help" => {
            print!("{}", columns::JOBS.help());
            return Ok(());
        }
        Command::Nodes {
            format: Some(ref f),
            ..
        } if f == "help" => {
            print!("{}", columns::NODES.help());
            return Ok(());
        }
        _ => {}
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_client_command(cli))
}

/// Writes `bytes` to stdout; a reader that went away (`| head`) is not an error.
fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    match std::io::stdout().write_all(bytes) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

fn print_json(v: serde_json::Value) {
    println!("{v}");
}

fn read(stale: bool) -> Option<pb::ReadOptions> {
    Some(pb::ReadOptions { stale })
}

async fn run_client_command(cli: Cli) -> anyhow::Result<()> {
    let endpoints = Client::parse_endpoints(&cli.endpoints);
    let credentials = Credentials::resolve(cli.insecure, cli.tls_dir.clone(), cli.token.clone())?;
    let mut client = Client::new(&endpoints, &credentials)?;
    client.deadline = Duration::from_secs(cli.timeout);
    let fmt = cli.output;
    match cli.command {
        Command::Submit(args) => submit::run(&mut client, args, fmt).await?,
        Command::Apply(args) => kube::apply(&mut client, args, fmt).await?,
        Command::Get(args) => kube::get(&mut client, args, fmt).await?,
        Command::Describe(args) => kube::describe(&mut client, args, fmt).await?,
        Command::Delete(args) => kube::delete(&mut client, args, fmt).await?,
        Command::Service { command } => service::run(&mut client, command, fmt).await?,
        Command::Queue(q) => {
            // Checked by clap already (`columns::job_format`); parsed again for the columns.
            let columns = match q.format.as_deref() {
                Some(spec) => Some(columns::JOBS.parse(spec).map_err(anyhow::Error::msg)?),
                None => None,
            };
            let req = pb::ListJobsRequest {
                states: q.states,
                tenant: q.tenant,
                partition: q.partition,
                include_finished: q.all,
                read: read(q.stale),
            };
            let resp = client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.list_jobs(with_timeout(req, t)).await }
                })
                .await?;
            match fmt {
                Format::Json | Format::Yaml => print_json(
                    json!({"jobs": resp.jobs.iter().map(output::job_json).collect::<Vec<_>>()}),
                ),
                Format::Table | Format::Wide => match columns {
                    Some(columns) => print!(
                        "{}",
                        columns::JOBS.render(
                            &columns,
                            &resp.jobs,
                            &columns::JobContext { now_ms: now_ms() }
                        )
                    ),
                    None => print!("{}", output::jobs_table(&resp.jobs, now_ms())),
                },
            }
        }
        Command::Why { job } => {
            let job = job_control::resolve_one(&mut client, job).await?;
            why::run(&mut client, job, fmt).await?
        }
        Command::Hold { jobs } => {
            let change = pb::change_job_request::Change::Hold(pb::HoldJob {});
            job_control::change(&mut client, jobs, change, fmt).await?
        }
        Command::Release { jobs } => {
            let change = pb::change_job_request::Change::Release(pb::ReleaseJob {});
            job_control::change(&mut client, jobs, change, fmt).await?
        }
        Command::Requeue { jobs, reason } => {
            let change = pb::change_job_request::Change::Requeue(pb::RequeueJob { reason });
            job_control::change(&mut client, jobs, change, fmt).await?
        }
        Command::Update(args) => {
            let change = pb::change_job_request::Change::Update(job_control::build_update(&args)?);
            job_control::change(&mut client, vec![args.job], change, fmt).await?
        }
        Command::Show { job, stale } => {
            let job = job_control::resolve_one(&mut client, job).await?;
            let j = client
                .call(|mut c, t| async move {
                    c.get_job(with_timeout(
                        pb::GetJobRequest {
                            id: job,
                            read: read(stale),
                        },
                        t,
                    ))
                    .await
                })
                .await?;
            match fmt {
                Format::Json | Format::Yaml => print_json(output::job_json(&j)),
                Format::Table | Format::Wide => print!("{}", output::job_details(&j)),
            }
        }
        Command::Cancel { jobs, reason } => {
            job_control::cancel(&mut client, jobs, reason, fmt).await?
        }
        Command::Watch { tenant, initial } => watch(&mut client, tenant, initial, fmt).await?,
        Command::Nodes {
            node: Some(node),
            stale,
            ..
        } => node::show(&mut client, &node, stale, fmt).await?,
        Command::Nodes {
            node: None,
            stale,
            format,
        } => {
            let columns = match format.as_deref() {
                Some(spec) => Some(columns::NODES.parse(spec).map_err(anyhow::Error::msg)?),
                None => None,
            };
            let resp = client
                .call(|mut c, t| async move {
                    c.list_nodes(with_timeout(pb::ListNodesRequest { read: read(stale) }, t))
                        .await
                })
                .await?;
            match fmt {
                Format::Json | Format::Yaml => print_json(json!({
                    "nodes": resp.nodes.iter().map(|n| output::node_json_with_skew(n, &resp.release)).collect::<Vec<_>>(),
                    "control_plane_release": resp.release,
                })),
                Format::Table | Format::Wide => match columns {
                    Some(columns) => print!(
                        "{}",
                        columns::NODES.render(
                            &columns,
                            &resp.nodes,
                            &columns::NodeContext {
                                control_plane_release: Some(resp.release.clone()),
                            }
                        )
                    ),
                    None => print!("{}", output::nodes_table(&resp.nodes, Some(&resp.release))),
                },
            }
        }
        Command::Cluster { command } => cluster(&mut client, command, fmt).await?,
        Command::Node { command } => node::run(&mut client, command, fmt).await?,
        Command::Logs(args) => logs::run(&mut client, args).await?,
        Command::Tenant { command } => tenant(&mut client, command, fmt).await?,
        Command::Accounting(args) => accounting::run(&mut client, args, fmt).await?,
        Command::Sacct(args) => accounting::sacct(&mut client, args, fmt).await?,
        Command::Partition { command } => partition(&mut client, command, fmt).await?,
        Command::Token { command } => tokens::run(&mut client, command, fmt).await?,
        Command::Audit(args) => tokens::audit(&mut client, args, fmt).await?,
        Command::Whoami => tokens::whoami(&mut client, fmt).await?,
        Command::Dev(_)
        | Command::Completions { .. }
        | Command::Man
        | Command::Replica(_)
        | Command::Agent(_)
        | Command::DemoServer(_)
        | Command::Bench { .. }
        | Command::Simulate { .. }
        | Command::Certs { .. } => {
            unreachable!("handled before the runtime starts")
        }
    }
    Ok(())
}

async fn watch(
    client: &mut Client,
    tenant: String,
    initial: bool,
    fmt: Format,
) -> anyhow::Result<()> {
    // Watches are served by one replica; if it goes away, reconnect to another and re-list.
    let mut first = true;
    loop {
        let req = pb::WatchJobsRequest {
            tenant: tenant.clone(),
            initial: initial || !first,
        };
        let mut stream = client
            .call(|mut c, _| {
                let req = req.clone();
                async move { c.watch_jobs(req).await }
            })
            .await?;
        first = false;
        loop {
            match stream.message().await {
                Ok(Some(ev)) => {
                    let Some(job) = ev.job else { continue };
                    match fmt {
                        Format::Json | Format::Yaml => print_json(
                            json!({"log_index": ev.log_index, "job": output::job_json(&job)}),
                        ),
                        Format::Table | Format::Wide => {
                            let reason =
                                job.history.last().map(|h| h.reason.as_str()).unwrap_or("");
                            println!(
                                "{:>8}  job {:<6} {:<10} {}",
                                ev.log_index,
                                job.id,
                                job.state.to_uppercase(),
                                output::printable(reason)
                            );
                        }
                    }
                }
                Ok(None) => break,
                Err(s) => {
                    eprintln!("watch interrupted ({}); reconnecting", s.message());
                    break;
                }
            }
        }
    }
}

/// How long `cluster status` waits for each replica.
const STATUS_TIMEOUT: Duration = Duration::from_millis(1500);

/// Asks every replica in `addrs` at once (each with a short timeout); answers in the order
/// given, or why one did not answer.
async fn ask_statuses(
    credentials: &crate::client::Credentials,
    addrs: &[String],
) -> Vec<Result<pb::ClusterStatusResponse, String>> {
    let asks = addrs.iter().map(|addr| async move {
        let mut c = credentials
            .api_client(addr)
            .map_err(|e| format!("{addr}: {e}"))?;
        match tokio::time::timeout(
            STATUS_TIMEOUT,
            c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, STATUS_TIMEOUT)),
        )
        .await
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(format!("{addr}: {}", proto::transport::status_text(&s))),
            Err(_) => Err(format!(
                "{addr}: no answer within {} ms",
                STATUS_TIMEOUT.as_millis()
            )),
        }
    });
    futures::future::join_all(asks).await
}

/// The answer of a replica that leads now (it says it is the leader and hears from a
/// quorum), with the highest term if several claim it.
fn current_leader(answers: &[pb::ClusterStatusResponse]) -> Option<pb::ClusterStatusResponse> {
    answers
        .iter()
        .filter(|s| s.leader != 0 && s.leader == s.id && s.removed.is_empty())
        .max_by_key(|s| s.term)
        .cloned()
}

/// `cluster status`: every endpoint is asked at once, and the answer shown is the current
/// leader's (only it knows how far each member has replicated and which ones answer). The
/// members' own addresses are asked next when no endpoint leads. Without a leader anywhere,
/// the answer with the highest term is shown; its leader is "none" until an election ends.
pub async fn cluster_status_now(client: &Client) -> anyhow::Result<pb::ClusterStatusResponse> {
    let credentials = &client.credentials;
    let endpoints = client.endpoints().to_vec();
    let mut errors = Vec::new();
    let mut answers = Vec::new();
    for a in ask_statuses(credentials, &endpoints).await {
        match a {
            Ok(s) => answers.push(s),
            Err(e) => errors.push(e),
        }
    }
    if let Some(s) = current_leader(&answers) {
        return Ok(s);
    }
    let asked: BTreeSet<String> = endpoints.iter().cloned().collect();
    let more: BTreeSet<String> = answers
        .iter()
        .flat_map(|s| s.members.iter().map(|m| m.address.clone()))
        .filter(|a| !asked.contains(a))
        .collect();
    let more: Vec<String> = more.into_iter().collect();
    for s in ask_statuses(credentials, &more).await.into_iter().flatten() {
        answers.push(s);
    }
    if let Some(s) = current_leader(&answers) {
        return Ok(s);
    }
    answers
        .into_iter()
        .filter(|s| s.removed.is_empty())
        .max_by_key(|s| (s.term, s.leader != 0))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no replica of [{}] answered: {}",
                endpoints.join(", "),
                errors.join("; ")
            )
        })
}

async fn cluster(client: &mut Client, command: ClusterCommand, fmt: Format) -> anyhow::Result<()> {
    let status = match command {
        ClusterCommand::Snapshot {
            command: backup::SnapshotCommand::Save { file },
        } => return backup::save(client, &file, fmt).await,
        ClusterCommand::Snapshot { .. } => unreachable!("offline commands run before this"),
        ClusterCommand::Status => cluster_status_now(client).await?,
        ClusterCommand::Add {
            id,
            address,
            learner,
            force,
        } => {
            // The leader answers once the replica has caught up (a large snapshot may take
            // minutes) or says why it has not; its `DeadlineExceeded` is final.
            client.attempt_timeout = client.deadline.max(Duration::from_secs(3600));
            client.retry_deadline_exceeded = false;
            let req = pb::AddReplicaRequest {
                id,
                address,
                learner_only: learner,
                force,
            };
            client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.add_replica(with_timeout(req, t)).await }
                })
                .await?
        }
        ClusterCommand::Remove { id, force } => {
            client.attempt_timeout = client.deadline.max(Duration::from_secs(60));
            client.retry_deadline_exceeded = false;
            client
                .call(|mut c, t| async move {
                    c.remove_replica(with_timeout(pb::RemoveReplicaRequest { id, force }, t))
                        .await
                })
                .await?
        }
    };
    match fmt {
        Format::Json | Format::Yaml => print_json(output::status_json(&status)),
        Format::Table | Format::Wide => print!("{}", output::status_text(&status)),
    }
    Ok(())
}

async fn tenant(client: &mut Client, command: TenantCommand, fmt: Format) -> anyhow::Result<()> {
    let tenants = match command {
        TenantCommand::Set {
            name,
            weight,
            quota,
            max,
        } => {
            let t = pb::Tenant {
                name,
                weight,
                quota_gpus: quota,
                max_gpus: max,
            };
            vec![
                client
                    .call(|mut c, to| {
                        let t = t.clone();
                        async move { c.put_tenant(with_timeout(t, to)).await }
                    })
                    .await?,
            ]
        }
        TenantCommand::List => {
            client
                .call(|mut c, t| async move {
                    c.list_tenants(with_timeout(pb::ListTenantsRequest { read: None }, t))
                        .await
                })
                .await?
                .tenants
        }
    };
    match fmt {
        Format::Json | Format::Yaml => print_json(json!({"tenants": tenants.iter().map(|t| json!({
            "name": t.name, "weight": t.weight, "quota_gpus": t.quota_gpus, "max_gpus": t.max_gpus,
        })).collect::<Vec<_>>()})),
        Format::Table | Format::Wide => {
            let rows: Vec<Vec<String>> = tenants
                .iter()
                .map(|t| {
                    vec![
                        output::printable(&t.name),
                        t.weight.to_string(),
                        t.quota_gpus.to_string(),
                        if t.max_gpus == 0 {
                            "-".into()
                        } else {
                            t.max_gpus.to_string()
                        },
                    ]
                })
                .collect();
            print!(
                "{}",
                output::table(&["TENANT", "WEIGHT", "QUOTA_GPUS", "MAX_GPUS"], &rows)
            );
        }
    }
    Ok(())
}

async fn partition(
    client: &mut Client,
    command: PartitionCommand,
    fmt: Format,
) -> anyhow::Result<()> {
    let partitions = match command {
        PartitionCommand::Set { name, description } => {
            let p = pb::Partition { name, description };
            vec![
                client
                    .call(|mut c, t| {
                        let p = p.clone();
                        async move { c.put_partition(with_timeout(p, t)).await }
                    })
                    .await?,
            ]
        }
        PartitionCommand::List => {
            client
                .call(|mut c, t| async move {
                    c.list_partitions(with_timeout(pb::ListPartitionsRequest { read: None }, t))
                        .await
                })
                .await?
                .partitions
        }
    };
    match fmt {
        Format::Json | Format::Yaml => print_json(
            json!({"partitions": partitions.iter().map(|p| json!({"name": p.name, "description": p.description})).collect::<Vec<_>>()}),
        ),
        Format::Table | Format::Wide => {
            let rows: Vec<Vec<String>> = partitions
                .iter()
                .map(|p| {
                    vec![
                        output::printable(&p.name),
                        output::printable(&p.description),
                    ]
                })
                .collect();
            print!("{}", output::table(&["PARTITION", "DESCRIPTION"], &rows));
        }
    }
    Ok(())
}
