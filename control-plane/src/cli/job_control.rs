//! `gpuctl cancel|hold|release|requeue|update`: Slurm's `scancel` and `scontrol` verbs on jobs
//! named as Slurm users name them (`41`, `41_7`). An array's id names every job of the array,
//! as `scancel 41` does; `41_7` names one.

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use super::parse::parse_time_limit;
use super::slurm_syntax::{self, JobRef};
use crate::client::{Client, with_timeout};

/// What `gpuctl update` changes (flags, or scontrol's `KEY=VALUE` words).
#[derive(clap::Args, Debug)]
pub struct UpdateArgs {
    /// The job (`41`, or `41_7` for one job of an array; an array's id updates all of it).
    pub job: JobRef,
    /// scontrol's spelling, e.g. `TimeLimit=2:00:00 Partition=a100 Nice=...`: TimeLimit,
    /// Partition, Name (JobName), Priority (low|normal|high), StartTime (BeginTime),
    /// NodeList (ReqNodeList), ExcNodeList, ArrayTaskThrottle.
    #[arg(value_name = "KEY=VALUE")]
    pub settings: Vec<String>,
    /// New time limit (same forms as submit's --time; `UNLIMITED` or 0 for none).
    #[arg(long, short = 't')]
    pub time: Option<String>,
    #[arg(long, short = 'p')]
    pub partition: Option<String>,
    #[arg(long, short = 'J', alias = "job-name")]
    pub name: Option<String>,
    /// Priority class: low, normal or high.
    #[arg(long)]
    pub priority: Option<String>,
    /// New begin time (as submit's --begin; `now` clears it).
    #[arg(long, short = 'b')]
    pub begin: Option<String>,
    /// New node list (a host list; empty clears it).
    #[arg(long, short = 'w')]
    pub nodelist: Option<String>,
    /// New excluded nodes (a host list; empty clears it).
    #[arg(long, short = 'x')]
    pub exclude: Option<String>,
    /// An array's limit of jobs running at once (0: none).
    #[arg(long, value_name = "N")]
    pub array_throttle: Option<u32>,
}

/// The request's update, from flags and `KEY=VALUE` words (a word wins over a flag, as it
/// comes later).
pub fn build_update(args: &UpdateArgs) -> anyhow::Result<pb::JobUpdate> {
    let mut time = args.time.clone();
    let mut partition = args.partition.clone();
    let mut name = args.name.clone();
    let mut priority = args.priority.clone();
    let mut begin = args.begin.clone();
    let mut nodelist = args.nodelist.clone();
    let mut exclude = args.exclude.clone();
    let mut throttle = args.array_throttle;
    for word in &args.settings {
        let (key, value) = word
            .split_once('=')
            .with_context(|| format!("{word:?} is not KEY=VALUE (e.g. TimeLimit=2:00:00)"))?;
        let value = value.to_owned();
        match key.to_ascii_lowercase().as_str() {
            "timelimit" => time = Some(value),
            "partition" => partition = Some(value),
            "name" | "jobname" => name = Some(value),
            "priority" => priority = Some(value),
            "starttime" | "begintime" | "begin" => begin = Some(value),
            "nodelist" | "reqnodelist" => nodelist = Some(value),
            "excnodelist" | "exclude" => exclude = Some(value),
            "arraytaskthrottle" => {
                throttle = Some(
                    value
                        .parse()
                        .with_context(|| format!("ArrayTaskThrottle={value:?} is not a count"))?,
                )
            }
            "jobid" => {}
            other => bail!(
                "gpuctl update does not change {other:?}; it changes TimeLimit, Partition, Name, \
                 Priority, StartTime, NodeList, ExcNodeList and ArrayTaskThrottle"
            ),
        }
    }
    let time_limit_secs = match time.as_deref() {
        None => None,
        Some(t) if t.eq_ignore_ascii_case("unlimited") || t == "0" => Some(0),
        Some(t) => Some(parse_time_limit(t)?),
    };
    let hosts = |list: Option<String>| -> anyhow::Result<Option<pb::NodeList>> {
        Ok(match list {
            None => None,
            Some(l) if l.trim().is_empty() => Some(pb::NodeList { nodes: Vec::new() }),
            Some(l) => Some(pb::NodeList {
                nodes: slurm_syntax::expand_hostlist(&l)?,
            }),
        })
    };
    let begin_at_ms = match begin.as_deref() {
        None => None,
        Some(b) if b.eq_ignore_ascii_case("now") => Some(0),
        Some(b) => Some(slurm_syntax::parse_begin(b, &jiff::ZonedDateTime::now())?),
    };
    let update = pb::JobUpdate {
        name,
        time_limit_secs,
        priority_class: priority,
        partition,
        begin_at_ms,
        nodelist: hosts(nodelist)?,
        exclude: hosts(exclude)?,
        max_running: throttle,
    };
    if update == pb::JobUpdate::default() {
        bail!(
            "nothing to update: give --time, --partition, --name, --priority, --begin, --nodelist, --exclude or --array-throttle (or KEY=VALUE)"
        );
    }
    Ok(update)
}

/// The id a reference names, and whether it names that one job only (`41_7`, resolved
/// through the array's first job) or, for an array's id, every job of the array.
pub async fn resolve(client: &mut Client, job: JobRef) -> anyhow::Result<(u64, bool)> {
    let Some(index) = job.array_index else {
        return Ok((job.id, false));
    };
    let head = client
        .call(|mut c, t| async move {
            c.get_job(with_timeout(
                pb::GetJobRequest {
                    id: job.id,
                    read: None,
                },
                t,
            ))
            .await
        })
        .await?;
    Ok((slurm_syntax::array_member_id(&head, index)?, true))
}

/// The id of the one job a reference names (for `show`, `why`, `logs`).
pub async fn resolve_one(client: &mut Client, job: JobRef) -> anyhow::Result<u64> {
    Ok(resolve(client, job).await?.0)
}

/// `gpuctl cancel JOB...`.
pub async fn cancel(
    client: &mut Client,
    jobs: Vec<JobRef>,
    reason: String,
    fmt: Format,
) -> anyhow::Result<()> {
    let mut failed = 0;
    let mut results = Vec::new();
    for job in jobs {
        let answer = match resolve(client, job).await {
            Ok((id, only_this_job)) => {
                let req = pb::CancelJobRequest {
                    id,
                    reason: reason.clone(),
                    only_this_job,
                };
                client
                    .call(|mut c, t| {
                        let req = req.clone();
                        async move { c.cancel_job(with_timeout(req, t)).await }
                    })
                    .await
                    .map(|_| ())
                    .map_err(|s| s.message().to_owned())
            }
            Err(e) => Err(format!("{e:#}")),
        };
        match answer {
            Ok(()) => {
                results.push(json!({"id": job.to_string(), "cancelled": true}));
                if fmt.is_table() {
                    println!("job {job} cancelled");
                }
            }
            Err(e) => {
                failed += 1;
                results.push(json!({"id": job.to_string(), "cancelled": false, "error": e}));
                if fmt.is_table() {
                    eprintln!("job {job}: {e}");
                }
            }
        }
    }
    if fmt.is_json() {
        println!("{}", json!({ "results": results }));
    }
    if failed > 0 {
        bail!("{failed} job(s) could not be cancelled");
    }
    Ok(())
}

/// `gpuctl hold|release|requeue|update`: one request per reference.
pub async fn change(
    client: &mut Client,
    jobs: Vec<JobRef>,
    change: pb::change_job_request::Change,
    fmt: Format,
) -> anyhow::Result<()> {
    let verb = match &change {
        pb::change_job_request::Change::Hold(_) => "held",
        pb::change_job_request::Change::Release(_) => "released",
        pb::change_job_request::Change::Requeue(_) => "requeued",
        pb::change_job_request::Change::Update(_) => "updated",
    };
    let mut failed = 0;
    let mut results = Vec::new();
    for job in jobs {
        let answer = match resolve(client, job).await {
            Ok((id, only_this_job)) => {
                let req = pb::ChangeJobRequest {
                    id,
                    only_this_job,
                    change: Some(change.clone()),
                };
                client
                    .call(|mut c, t| {
                        let req = req.clone();
                        async move { c.change_job(with_timeout(req, t)).await }
                    })
                    .await
                    .map_err(|s| s.message().to_owned())
            }
            Err(e) => Err(format!("{e:#}")),
        };
        match answer {
            Ok(resp) => {
                results.push(json!({
                    "id": job.to_string(),
                    "changed": resp.changed,
                    "refused": resp.refused.iter().map(|r| json!({"id": r.id, "reason": r.reason})).collect::<Vec<_>>(),
                }));
                if fmt.is_table() {
                    match resp.changed.as_slice() {
                        [one] if job.array_index.is_some() || *one == job.id => {
                            println!("job {job} {verb}")
                        }
                        many => println!("array {job}: {} job(s) {verb}", many.len()),
                    }
                    for r in &resp.refused {
                        println!(
                            "  job {} left alone: {}",
                            r.id,
                            super::output::printable(&r.reason)
                        );
                    }
                }
            }
            Err(e) => {
                failed += 1;
                results.push(json!({"id": job.to_string(), "error": e}));
                if fmt.is_table() {
                    eprintln!("job {job}: {e}");
                }
            }
        }
    }
    if fmt.is_json() {
        println!("{}", json!({ "results": results }));
    }
    if failed > 0 {
        bail!("{failed} job(s) could not be {verb}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> UpdateArgs {
        use clap::Parser;
        let cli =
            crate::cli::Cli::try_parse_from(["gpuctl", "update"].iter().chain(words).copied())
                .unwrap();
        let crate::cli::Command::Update(a) = cli.command else {
            panic!("not an update")
        };
        a
    }

    #[test]
    fn updates_take_flags_and_scontrol_words() {
        let u = build_update(&args(&["41_3", "--time", "2:00:00", "Partition=a100"])).unwrap();
        assert_eq!(u.time_limit_secs, Some(7200));
        assert_eq!(u.partition.as_deref(), Some("a100"));
        let u = build_update(&args(&["41", "TimeLimit=UNLIMITED", "NodeList=g[1-2]"])).unwrap();
        assert_eq!(u.time_limit_secs, Some(0));
        assert_eq!(u.nodelist.unwrap().nodes, ["g1", "g2"]);
        let u = build_update(&args(&["41", "ExcNodeList=", "ArrayTaskThrottle=4"])).unwrap();
        assert_eq!(u.exclude.unwrap().nodes, Vec::<String>::new());
        assert_eq!(u.max_running, Some(4));
        let e = build_update(&args(&["41", "Nice=5"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not change \"nice\""), "{e}");
        let e = build_update(&args(&["41"])).unwrap_err().to_string();
        assert!(e.contains("nothing to update"), "{e}");
        assert!(build_update(&args(&["41", "TimeLimit"])).is_err());
    }
}
