//! Kubernetes habits: `gpuctl apply -f job.yaml`, `gpuctl get jobs [NAME]`, `gpuctl describe
//! job NAME`, `gpuctl delete job NAME`, on `kind: GpuJob` manifests (`manifest.rs`); the same
//! verbs on services (`kind: GpuService`, `service_manifest.rs`), which `service.rs` runs.
//!
//! A manifest's job is found again by its name in its namespace (tenant). `apply` is
//! idempotent by name: while a job of that name is pending or running, applying the same
//! spec changes nothing and applying another spec is refused (a submitted job does not
//! change: delete it and apply again). Once no job of that name is live, `apply` submits a
//! new one (running the manifest again, as re-creating a Kubernetes Job does). `delete`
//! cancels the live job of that name; `get NAME` shows the newest job of that name.

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::manifest;
use super::output::{self, Format};
use crate::client::{Client, with_timeout};

#[derive(clap::Args, Debug)]
pub struct ApplyArgs {
    /// The manifest (`-` reads standard input).
    #[arg(long, short = 'f', value_name = "FILE")]
    pub filename: String,
}

/// What `get`/`describe`/`delete` act on.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    #[value(alias = "jobs", alias = "gpujob", alias = "gpujobs")]
    Job,
    #[value(
        alias = "services",
        alias = "svc",
        alias = "gpuservice",
        alias = "gpuservices"
    )]
    Service,
}

#[derive(clap::Args, Debug)]
pub struct GetArgs {
    pub resource: Resource,
    /// A job's (or service's) name; none: every job that has not finished (with --all, every
    /// job), or every service.
    pub name: Option<String>,
    /// The tenant (Kubernetes' namespace).
    #[arg(long, short = 'n', alias = "namespace")]
    pub tenant: Option<String>,
    /// Finished jobs too.
    #[arg(long, short = 'A')]
    pub all: bool,
}

#[derive(clap::Args, Debug)]
pub struct NamedArgs {
    pub resource: Resource,
    pub name: String,
    #[arg(long, short = 'n', alias = "namespace")]
    pub tenant: Option<String>,
}

/// A key for this one `apply`, so gpuctl's own retries (across replicas, a failover) never
/// submit it twice.
fn idempotency_key(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("apply/{name}/{nanos:x}-{}", std::process::id())
}

fn is_live(job: &pb::Job) -> bool {
    matches!(job.state.as_str(), "pending" | "scheduled" | "running")
}

/// Whether live job `job` is what `wanted` describes (its tenant counts only where the
/// manifest names one).
fn same_spec(job: &pb::Job, wanted: &pb::JobSpec) -> bool {
    let Ok(mut have) = manifest::job_spec(&manifest::manifest_of(job)) else {
        return false;
    };
    if wanted.tenant.is_empty() {
        have.tenant.clear();
    }
    have == *wanted
}

/// The `kind` a manifest says it is (empty when it says none or is not YAML: the parser
/// of GpuJob then says what is wrong).
fn kind_of(text: &str) -> String {
    serde_norway::from_str::<serde_norway::Value>(text)
        .ok()
        .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_owned))
        .unwrap_or_default()
}

pub async fn apply(client: &mut Client, args: ApplyArgs, fmt: Format) -> anyhow::Result<()> {
    let text = if args.filename == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the manifest from stdin")?
    } else {
        std::fs::read_to_string(&args.filename)
            .with_context(|| format!("reading {}", args.filename))?
    };
    match kind_of(&text).as_str() {
        super::service_manifest::KIND => {
            return super::service::apply_manifest(client, &text, &args.filename, fmt).await;
        }
        "" | manifest::KIND => {}
        other => bail!(
            "{}: kind {:?}: gpuctl applies {} and {} manifests (apiVersion {})",
            args.filename,
            output::printable(other),
            manifest::KIND,
            super::service_manifest::KIND,
            manifest::API_VERSION
        ),
    }
    let m = manifest::parse(&text).with_context(|| args.filename.clone())?;
    let spec = manifest::job_spec(&m).with_context(|| args.filename.clone())?;
    let tenant = Some(spec.tenant.as_str()).filter(|t| !t.is_empty());
    let live = jobs_named(client, Some(&m.metadata.name), tenant, false)
        .await?
        .into_iter()
        .find(is_live);
    if let Some(job) = live {
        if !same_spec(&job, &spec) {
            bail!(
                "gpujob/{name} (job {id}) is {state} with a different spec, and a submitted job does not change: `gpuctl delete job {name}` and apply again",
                name = m.metadata.name,
                id = job.id,
                state = job.state
            );
        }
        match fmt {
            Format::Json | Format::Yaml => println!(
                "{}",
                json!({"name": m.metadata.name, "id": job.id, "created": false})
            ),
            Format::Table | Format::Wide => {
                println!(
                    "gpujob/{} unchanged (job {})",
                    output::printable(&m.metadata.name),
                    job.id
                )
            }
        }
        return Ok(());
    }
    let req = pb::SubmitJobRequest {
        spec: Some(spec),
        idempotency_key: idempotency_key(&m.metadata.name),
    };
    let resp = client
        .call(|mut c, t| {
            let req = req.clone();
            async move { c.submit_job(with_timeout(req, t)).await }
        })
        .await?;
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"name": m.metadata.name, "id": resp.id, "created": true})
        ),
        Format::Table | Format::Wide => {
            println!(
                "gpujob/{} created (job {})",
                output::printable(&m.metadata.name),
                resp.id
            )
        }
    }
    Ok(())
}

/// Jobs named `name` (every job when `None`) of `tenant`, newest first.
async fn jobs_named(
    client: &mut Client,
    name: Option<&str>,
    tenant: Option<&str>,
    finished: bool,
) -> anyhow::Result<Vec<pb::Job>> {
    let req = pb::ListJobsRequest {
        tenant: tenant.unwrap_or_default().to_owned(),
        include_finished: finished || name.is_some(),
        ..Default::default()
    };
    let mut jobs = client
        .call(|mut c, t| {
            let req = req.clone();
            async move { c.list_jobs(with_timeout(req, t)).await }
        })
        .await?
        .jobs;
    if let Some(name) = name {
        jobs.retain(|j| j.spec.as_ref().is_some_and(|s| s.name == name));
    }
    jobs.sort_by_key(|j| std::cmp::Reverse(j.id));
    Ok(jobs)
}

/// The one job called `name`: the newest, which is what `apply` made last.
async fn job_named(
    client: &mut Client,
    name: &str,
    tenant: Option<&str>,
) -> anyhow::Result<pb::Job> {
    jobs_named(client, Some(name), tenant, true)
        .await?
        .into_iter()
        .next()
        .with_context(|| {
            format!(
                "no job named {name:?}{}",
                tenant
                    .map(|t| format!(" in tenant {t}"))
                    .unwrap_or_default()
            )
        })
}

pub async fn get(client: &mut Client, args: GetArgs, fmt: Format) -> anyhow::Result<()> {
    if args.resource == Resource::Service {
        let a = super::service::GetArgs {
            name: args.name,
            tenant: args.tenant,
            stale: false,
        };
        return super::service::get(client, a, fmt).await;
    }
    let jobs = jobs_named(
        client,
        args.name.as_deref(),
        args.tenant.as_deref(),
        args.all,
    )
    .await?;
    if args.name.is_some() && jobs.is_empty() {
        bail!("no job named {:?}", args.name.unwrap_or_default());
    }
    let jobs = if args.name.is_some() {
        &jobs[..1]
    } else {
        &jobs[..]
    };
    match fmt {
        Format::Json => println!(
            "{}",
            json!({"jobs": jobs.iter().map(output::job_json).collect::<Vec<_>>()})
        ),
        Format::Yaml => {
            for (i, job) in jobs.iter().enumerate() {
                if i > 0 {
                    println!("---");
                }
                print!("{}", serde_norway::to_string(&manifest::manifest_of(job))?);
            }
        }
        Format::Table | Format::Wide => {
            let wide = fmt == Format::Wide;
            let rows: Vec<Vec<String>> = jobs
                .iter()
                .map(|j| {
                    let spec = j.spec.clone().unwrap_or_default();
                    let mut row = vec![
                        output::printable(&spec.name),
                        j.state.to_uppercase(),
                        format!("{}x{}", spec.tasks, spec.gpus_per_task),
                        j.id.to_string(),
                    ];
                    if wide {
                        let nodes: Vec<&str> =
                            j.allocations.iter().map(|a| a.node.as_str()).collect();
                        row.push(output::printable(&spec.tenant));
                        row.push(if nodes.is_empty() {
                            "-".into()
                        } else {
                            nodes.join(",")
                        });
                        row.push(
                            spec.container
                                .as_ref()
                                .map_or("-".into(), |c| output::printable(&c.image)),
                        );
                    }
                    row
                })
                .collect();
            let mut headers = vec!["NAME", "STATUS", "TASKSxGPUS", "JOB"];
            if wide {
                headers.extend(["TENANT", "NODES", "IMAGE"]);
            }
            print!("{}", output::table(&headers, &rows));
        }
    }
    Ok(())
}

pub async fn describe(client: &mut Client, args: NamedArgs, fmt: Format) -> anyhow::Result<()> {
    if args.resource == Resource::Service {
        let s = super::service::fetch(client, &args.name, args.tenant.as_deref(), false).await?;
        return super::service::describe_service(&s, fmt);
    }
    let job = job_named(client, &args.name, args.tenant.as_deref()).await?;
    match fmt {
        Format::Json => println!("{}", output::job_json(&job)),
        Format::Yaml => print!("{}", serde_norway::to_string(&manifest::manifest_of(&job))?),
        Format::Table | Format::Wide => print!("{}", output::job_details(&job)),
    }
    Ok(())
}

pub async fn delete(client: &mut Client, args: NamedArgs, fmt: Format) -> anyhow::Result<()> {
    if args.resource == Resource::Service {
        let a = super::service::DeleteArgs {
            name: args.name,
            tenant: args.tenant,
            wait: false,
        };
        return super::service::run(client, super::service::ServiceCommand::Delete(a), fmt).await;
    }
    let job = jobs_named(client, Some(&args.name), args.tenant.as_deref(), false)
        .await?
        .into_iter()
        .find(is_live)
        .with_context(|| format!("no pending or running job named {:?}", args.name))?;
    let id = job.id;
    client
        .call(|mut c, t| async move {
            c.cancel_job(with_timeout(
                pb::CancelJobRequest {
                    id,
                    reason: "deleted (gpuctl delete)".into(),
                    ..Default::default()
                },
                t,
            ))
            .await
        })
        .await?;
    match fmt {
        Format::Json | Format::Yaml => {
            println!("{}", json!({"name": args.name, "id": id, "deleted": true}))
        }
        Format::Table | Format::Wide => {
            println!(
                "gpujob/{} deleted (job {id})",
                output::printable(&args.name)
            )
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kind_picks_the_manifest_parser() {
        assert_eq!(super::kind_of("kind: GpuService\nspec: {}\n"), "GpuService");
        assert_eq!(
            super::kind_of("apiVersion: gpucp.io/v1\nkind: GpuJob\n"),
            "GpuJob"
        );
        assert_eq!(super::kind_of("[not, a, mapping]"), "");
        assert_eq!(super::kind_of(": : :"), "");
    }
}
