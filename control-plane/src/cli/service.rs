//! `gpuctl service ...`: long-running services. `create`, `update` (fetch, change what the
//! flags give, put back: a changed template is a rolling update), `scale`, `delete`, `get`,
//! `describe`, `history`, and `rollout status|pause|resume|undo`; also what `gpuctl apply`
//! does with a `kind: GpuService` manifest. Each call is one API request; the cluster checks
//! every request before it is logged, so a refused one changes nothing.

use std::time::Duration;

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::output::{Format, printable};
use super::service_manifest;
use super::service_output::{
    history_table, rollout_line, service_details, service_json, services_table,
};
use super::service_spec::{ServiceFlags, apply_flags, create_spec};
use crate::client::{ApiClient, Client, with_timeout};
use crate::replica::now_ms;

/// One request through `client` (any replica, retried as `Client::call` does), with the
/// attempt's deadline on it.
async fn with_timeout_call<Req, T, F, Fut>(
    client: &mut Client,
    req: Req,
    f: F,
) -> Result<T, tonic::Status>
where
    Req: Clone,
    F: Fn(ApiClient, tonic::Request<Req>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    client.call(|c, t| f(c, with_timeout(req.clone(), t))).await
}

#[derive(clap::Subcommand, Debug)]
pub enum ServiceCommand {
    /// Create a service: `gpuctl service create web --replicas 4 --gpu-milli 500 --port http
    /// --readiness http:http:/ready -- python serve.py`.
    Create(CreateArgs),
    /// Services (or one), as a table: replicas ready/desired, up to date, revision, rollout,
    /// endpoints (-o wide: more; -o yaml: manifests; -o json).
    #[command(alias = "list", alias = "ls")]
    Get(GetArgs),
    /// One service in full: its spec, each replica (state, node, GPUs, endpoint, restarts,
    /// last exit), revisions, events and what its autoscaler sees.
    Describe(NameArgs),
    /// Change a service: the flags of `create`, and a new command after `--`. What is not
    /// given stays; a changed template (command, image, resources, ports, probes) rolls out.
    Update(UpdateArgs),
    /// Set the number of replicas (refused for an autoscaled service: change --min/--max).
    Scale(ScaleArgs),
    /// Delete a service: every replica is stopped, then the service is forgotten.
    Delete(DeleteArgs),
    /// The service's kept revisions and what changed in each.
    History(NameArgs),
    /// Follow, pause, resume or undo a rollout.
    Rollout {
        #[command(subcommand)]
        command: RolloutCommand,
    },
}

#[derive(clap::Subcommand, Debug)]
pub enum RolloutCommand {
    /// Where the rollout stands; with --watch, waits until it completes (exit 0) or pauses
    /// (exit 1, with the reason).
    Status(StatusArgs),
    /// Stop replacing replicas (those already replaced stay).
    Pause {
        #[command(flatten)]
        name: NameArgs,
        /// Why (shown in describe and events).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Go on replacing replicas after a pause (also after an automatic one, once its cause
    /// is fixed).
    Resume(NameArgs),
    /// Go back to the previous revision (or --to-revision N), rolled out as any change.
    Undo {
        #[command(flatten)]
        name: NameArgs,
        #[arg(long, value_name = "N")]
        to_revision: Option<u64>,
    },
}

/// A service by name, in a tenant.
#[derive(clap::Args, Debug, Clone)]
pub struct NameArgs {
    /// The service's name.
    pub name: String,
    /// The tenant (Kubernetes' namespace). Default: a user token's own tenant, or `default`.
    #[arg(long, short = 'A', alias = "namespace", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    /// Read from the answering replica without a leader round-trip (may be slightly behind).
    #[arg(long)]
    pub stale: bool,
}

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    /// The service's name (letters, digits, '-', '_', '.'); its replicas' jobs are NAME-ORDINAL.
    pub name: String,
    /// The tenant (Kubernetes' namespace). Default: a user token's own tenant, or `default`.
    #[arg(long, short = 'A', alias = "namespace", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    #[command(flatten)]
    pub flags: ServiceFlags,
}

#[derive(clap::Args, Debug)]
pub struct UpdateArgs {
    /// The service to change.
    pub name: String,
    /// The tenant (Kubernetes' namespace). Default: a user token's own tenant, or `default`.
    #[arg(long, short = 'A', alias = "namespace", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    #[command(flatten)]
    pub flags: ServiceFlags,
}

#[derive(clap::Args, Debug)]
pub struct GetArgs {
    /// One service; none: every service you may see.
    pub name: Option<String>,
    /// The tenant (Kubernetes' namespace). Default: a user token's own tenant, or `default`.
    #[arg(long, short = 'A', alias = "namespace", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    #[arg(long)]
    pub stale: bool,
}

#[derive(clap::Args, Debug)]
pub struct ScaleArgs {
    pub name: String,
    /// Replicas wanted.
    pub replicas: u32,
    /// The tenant (Kubernetes' namespace). Default: a user token's own tenant, or `default`.
    #[arg(long, short = 'A', alias = "namespace", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    /// Why (shown in events).
    #[arg(long, default_value = "")]
    pub reason: String,
}

#[derive(clap::Args, Debug)]
pub struct DeleteArgs {
    pub name: String,
    /// The tenant (Kubernetes' namespace). Default: a user token's own tenant, or `default`.
    #[arg(long, short = 'A', alias = "namespace", env = "GPUCTL_TENANT")]
    pub tenant: Option<String>,
    /// Wait until every replica has stopped and the service is gone.
    #[arg(long)]
    pub wait: bool,
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub name: NameArgs,
    /// Keep printing progress until the rollout completes or pauses.
    #[arg(long, short = 'w')]
    pub watch: bool,
    /// With --watch: give up (exit 1) after this long (`5m`); default: wait as long as it takes.
    #[arg(long, value_name = "DURATION")]
    pub watch_timeout: Option<String>,
}

/// How often `rollout status --watch` and `delete --wait` ask.
const POLL_EVERY: Duration = Duration::from_millis(500);

fn service_name(name: &str, tenant: Option<&str>) -> pb::ServiceName {
    pb::ServiceName {
        tenant: tenant.unwrap_or_default().to_owned(),
        name: name.to_owned(),
    }
}

/// The service `name`, or the cluster's refusal (NotFound when there is none).
pub async fn fetch(
    client: &mut Client,
    name: &str,
    tenant: Option<&str>,
    stale: bool,
) -> Result<pb::Service, tonic::Status> {
    let req = pb::GetServiceRequest {
        service: Some(service_name(name, tenant)),
        read: Some(pb::ReadOptions { stale }),
    };
    with_timeout_call(
        client,
        req,
        |mut c, r| async move { c.get_service(r).await },
    )
    .await
}

/// The service `name` if it exists; other errors are errors.
async fn find(
    client: &mut Client,
    name: &str,
    tenant: Option<&str>,
) -> anyhow::Result<Option<pb::Service>> {
    match fetch(client, name, tenant, false).await {
        Ok(s) => Ok(Some(s)),
        Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
        Err(s) => Err(s.into()),
    }
}

async fn put(
    client: &mut Client,
    spec: pb::ServiceSpec,
    create_only: bool,
) -> Result<pb::Service, tonic::Status> {
    let req = pb::PutServiceRequest {
        spec: Some(spec),
        create_only,
    };
    with_timeout_call(
        client,
        req,
        |mut c, r| async move { c.put_service(r).await },
    )
    .await
}

async fn rollout_action(
    client: &mut Client,
    name: &NameArgs,
    action: pb::service_rollout_request::Action,
    to_revision: u64,
    reason: String,
) -> Result<pb::Service, tonic::Status> {
    let req = pb::ServiceRolloutRequest {
        service: Some(service_name(&name.name, name.tenant.as_deref())),
        action: action as i32,
        to_revision,
        reason,
    };
    with_timeout_call(
        client,
        req,
        |mut c, r| async move { c.service_rollout(r).await },
    )
    .await
}

fn print_service_line(fmt: Format, s: &pb::Service, text: String) {
    if fmt.is_json() {
        println!("{}", service_json(s));
    } else {
        println!("{text}");
    }
}

pub async fn run(client: &mut Client, command: ServiceCommand, fmt: Format) -> anyhow::Result<()> {
    match command {
        ServiceCommand::Create(a) => {
            let spec = create_spec(&a.name, a.tenant.as_deref(), &a.flags, || {
                std::env::current_dir().context("finding the current directory (give --chdir)")
            })?;
            let s = put(client, spec, true).await?;
            let replicas = s.spec.as_ref().map_or(0, |s| s.replicas);
            print_service_line(
                fmt,
                &s,
                format!(
                    "service {} created: {replicas} replica(s) starting (`gpuctl service rollout status {} --watch` waits until they are ready)",
                    printable(&a.name),
                    printable(&a.name)
                ),
            );
        }
        ServiceCommand::Update(a) => update(client, a, fmt).await?,
        ServiceCommand::Get(a) => get(client, a, fmt).await?,
        ServiceCommand::Describe(a) => {
            let s = fetch(client, &a.name, a.tenant.as_deref(), a.stale).await?;
            describe_service(&s, fmt)?;
        }
        ServiceCommand::History(a) => {
            let s = fetch(client, &a.name, a.tenant.as_deref(), a.stale).await?;
            if fmt.is_json() {
                println!("{}", service_json(&s)["revisions"]);
            } else {
                print!("{}", history_table(&s));
            }
        }
        ServiceCommand::Scale(a) => {
            let req = pb::ScaleServiceRequest {
                service: Some(service_name(&a.name, a.tenant.as_deref())),
                replicas: a.replicas,
                reason: a.reason,
            };
            let s = with_timeout_call(
                client,
                req,
                |mut c, r| async move { c.scale_service(r).await },
            )
            .await?;
            print_service_line(
                fmt,
                &s,
                format!(
                    "service {} scaled to {} replica(s)",
                    printable(&a.name),
                    a.replicas
                ),
            );
        }
        ServiceCommand::Delete(a) => delete(client, a, fmt).await?,
        ServiceCommand::Rollout { command } => rollout(client, command, fmt).await?,
    }
    Ok(())
}

/// `describe` in the format asked (`-o yaml`: the manifest; `-o json`).
pub fn describe_service(s: &pb::Service, fmt: Format) -> anyhow::Result<()> {
    match fmt {
        Format::Json => println!("{}", service_json(s)),
        Format::Yaml => print!(
            "{}",
            serde_norway::to_string(&service_manifest::manifest_of(s))?
        ),
        Format::Table | Format::Wide => print!("{}", service_details(s, now_ms())),
    }
    Ok(())
}

/// `service get` and `get services`.
pub async fn get(client: &mut Client, a: GetArgs, fmt: Format) -> anyhow::Result<()> {
    let services = match &a.name {
        Some(name) => vec![fetch(client, name, a.tenant.as_deref(), a.stale).await?],
        None => {
            let req = pb::ListServicesRequest {
                tenant: a.tenant.clone().unwrap_or_default(),
                read: Some(pb::ReadOptions { stale: a.stale }),
            };
            let mut list =
                with_timeout_call(
                    client,
                    req,
                    |mut c, r| async move { c.list_services(r).await },
                )
                .await?
                .services;
            list.sort_by(|x, y| {
                let key = |s: &pb::Service| {
                    s.spec
                        .as_ref()
                        .map(|s| (s.tenant.clone(), s.name.clone()))
                        .unwrap_or_default()
                };
                key(x).cmp(&key(y))
            });
            list
        }
    };
    match fmt {
        Format::Json => println!(
            "{}",
            json!({"services": services.iter().map(service_json).collect::<Vec<_>>()})
        ),
        Format::Yaml => {
            for (i, s) in services.iter().enumerate() {
                if i > 0 {
                    println!("---");
                }
                print!(
                    "{}",
                    serde_norway::to_string(&service_manifest::manifest_of(s))?
                );
            }
        }
        Format::Table | Format::Wide => {
            if services.is_empty() {
                println!(
                    "No services. Create one: gpuctl service create NAME --replicas 2 --port http -- PROGRAM"
                );
            } else {
                print!(
                    "{}",
                    services_table(&services, now_ms(), fmt == Format::Wide)
                );
            }
        }
    }
    Ok(())
}

async fn update(client: &mut Client, a: UpdateArgs, fmt: Format) -> anyhow::Result<()> {
    let before = fetch(client, &a.name, a.tenant.as_deref(), false).await?;
    if before.deleting {
        bail!(
            "service {} is being deleted; create it again once its replicas have stopped",
            printable(&a.name)
        );
    }
    let have = before
        .spec
        .clone()
        .context("the cluster answered a service without its spec")?;
    if have.template.as_ref().is_none_or(|t| t.command.is_empty()) {
        bail!(
            "service {}'s command is withheld from you, so it cannot be changed in place: only its tenant's users and admins may update it",
            printable(&a.name)
        );
    }
    let mut wanted = have.clone();
    apply_flags(&mut wanted, &a.flags)?;
    if service_manifest::unchanged(&have, &wanted) {
        print_service_line(
            fmt,
            &before,
            format!("service {} unchanged", printable(&a.name)),
        );
        return Ok(());
    }
    let after = put(client, wanted, false).await?;
    print_service_line(fmt, &after, change_text(&a.name, &before, &after));
    Ok(())
}

/// What a put did, in words: a new revision rolling out, or settings only.
fn change_text(name: &str, before: &pb::Service, after: &pb::Service) -> String {
    let name = printable(name);
    if after.revision != before.revision {
        let paused = if after.rollout == "paused" {
            " (the rollout is paused: `gpuctl service rollout resume` starts it)"
        } else {
            ""
        };
        format!(
            "service {name} updated: revision {} -> {}, rolling out{paused}; `gpuctl service rollout status {name} --watch` follows it",
            before.revision, after.revision
        )
    } else {
        format!("service {name} updated (the replicas' template is the same: nothing rolls out)")
    }
}

/// `gpuctl apply -f` of a GpuService manifest: create it, leave it, or change it.
pub async fn apply_manifest(
    client: &mut Client,
    text: &str,
    source: &str,
    fmt: Format,
) -> anyhow::Result<()> {
    let m = service_manifest::parse(text).with_context(|| source.to_owned())?;
    let wanted = service_manifest::service_spec(&m).with_context(|| source.to_owned())?;
    let name = m.metadata.name.clone();
    let shown = printable(&name);
    let tenant = Some(wanted.tenant.as_str()).filter(|t| !t.is_empty());
    let (what, s) = match find(client, &name, tenant).await? {
        None => {
            let s = put(client, wanted, false).await?;
            ("created".to_owned(), s)
        }
        Some(s) if s.deleting => bail!(
            "gpuservice/{shown} is being deleted; apply again once its replicas have stopped (`gpuctl service get {shown}`)"
        ),
        Some(s)
            if s.spec
                .as_ref()
                .is_some_and(|h| service_manifest::unchanged(h, &wanted)) =>
        {
            ("unchanged".to_owned(), s)
        }
        Some(before) => {
            let after = put(client, wanted, false).await?;
            let what = if after.revision != before.revision {
                format!(
                    "configured: revision {} -> {}, rolling out (`gpuctl service rollout status {shown} --watch`)",
                    before.revision, after.revision
                )
            } else {
                "configured (the replicas' template is the same: nothing rolls out)".to_owned()
            };
            (what, after)
        }
    };
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"name": name, "result": what.split([':', ' ']).next(), "revision": s.revision})
        ),
        Format::Table | Format::Wide => println!("gpuservice/{shown} {what}"),
    }
    Ok(())
}

async fn delete(client: &mut Client, a: DeleteArgs, fmt: Format) -> anyhow::Result<()> {
    let req = pb::DeleteServiceRequest {
        service: Some(service_name(&a.name, a.tenant.as_deref())),
    };
    let s = with_timeout_call(
        client,
        req,
        |mut c, r| async move { c.delete_service(r).await },
    )
    .await?;
    let shown = printable(&a.name);
    print_service_line(
        fmt,
        &s,
        format!(
            "service {shown} deleted: {} replica(s) stopping",
            s.replicas.len()
        ),
    );
    if !a.wait {
        return Ok(());
    }
    while find(client, &a.name, a.tenant.as_deref()).await?.is_some() {
        tokio::time::sleep(POLL_EVERY).await;
    }
    if fmt.is_table() {
        println!("service {shown} is gone");
    }
    Ok(())
}

async fn rollout(client: &mut Client, command: RolloutCommand, fmt: Format) -> anyhow::Result<()> {
    use pb::service_rollout_request::Action;
    let (name, s, what) = match command {
        RolloutCommand::Status(a) => return rollout_status(client, a, fmt).await,
        RolloutCommand::Pause { name, reason } => {
            let s = rollout_action(client, &name, Action::Pause, 0, reason).await?;
            (
                name,
                s,
                "paused: no more replicas are replaced until `rollout resume`".to_owned(),
            )
        }
        RolloutCommand::Resume(name) => {
            let s = rollout_action(client, &name, Action::Resume, 0, String::new()).await?;
            (name, s, "resumed".to_owned())
        }
        RolloutCommand::Undo { name, to_revision } => {
            let s = rollout_action(
                client,
                &name,
                Action::Undo,
                to_revision.unwrap_or(0),
                String::new(),
            )
            .await?;
            let what = format!("rolled back to revision {}", s.revision);
            (name, s, what)
        }
    };
    print_service_line(
        fmt,
        &s,
        format!("service {}'s rollout {what}", printable(&name.name)),
    );
    Ok(())
}

/// `rollout status [--watch]`: prints each change of progress; an error (exit 1) when the
/// rollout is paused or the service is being deleted, or the watch timed out.
async fn rollout_status(client: &mut Client, a: StatusArgs, fmt: Format) -> anyhow::Result<()> {
    let limit = a
        .watch_timeout
        .as_deref()
        .map(|t| super::parse::parse_duration_ms(t).context("--watch-timeout"))
        .transpose()?
        .map(Duration::from_millis);
    let start = tokio::time::Instant::now();
    let shown = printable(&a.name.name);
    let mut last = String::new();
    loop {
        let s = fetch(client, &a.name.name, a.name.tenant.as_deref(), a.name.stale).await?;
        let line = rollout_line(&s);
        if line != last {
            if fmt.is_json() {
                println!(
                    "{}",
                    json!({
                        "name": a.name.name, "revision": s.revision,
                        "rollout": if s.deleting { "deleting" } else { s.rollout.as_str() },
                        "rollout_reason": s.rollout_reason, "ready": s.ready, "updated": s.updated,
                        "replicas": s.spec.as_ref().map_or(0, |s| s.replicas),
                    })
                );
            } else {
                println!("{line}");
            }
            last = line;
        }
        if s.deleting {
            bail!("service {shown} is being deleted");
        }
        match s.rollout.as_str() {
            "complete" => return Ok(()),
            "paused" => bail!(
                "the rollout of service {shown} is paused: {}. See `gpuctl service describe {shown}` (replicas, events), then `gpuctl service rollout resume {shown}` or `gpuctl service rollout undo {shown}`",
                printable(&s.rollout_reason)
            ),
            _ if !a.watch => return Ok(()),
            _ => {}
        }
        if let Some(limit) = limit
            && start.elapsed() >= limit
        {
            bail!(
                "the rollout of service {shown} did not complete within {}; it goes on (`gpuctl service describe {shown}`)",
                super::probe_spec::millis_text(limit.as_millis() as u64)
            );
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}
