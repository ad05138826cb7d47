//! `gpuctl logs JOB [--task N] [--attempt K] [--tail BYTES] [-f]`: a task's output, read from
//! the agent of the node that ran it, through the control plane (which checks the caller
//! may read the job, and knows which allocation each task of each attempt was). A service's
//! replica is named `service/NAME/ORDINAL` (or `service/TENANT/NAME/ORDINAL`): its job now.

use std::io::Write;
use std::time::Duration;

use proto::v1 as pb;

use super::slurm_syntax::JobRef;
use crate::client::{Client, with_timeout};

/// What `gpuctl logs` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    Job(JobRef),
    /// A service's replica by ordinal: whichever job holds that ordinal now.
    Replica {
        tenant: Option<String>,
        name: String,
        ordinal: u32,
    },
}

impl std::str::FromStr for LogTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<LogTarget, String> {
        let Some(rest) = s
            .strip_prefix("service/")
            .or_else(|| s.strip_prefix("svc/"))
        else {
            return s
                .parse::<JobRef>()
                .map(LogTarget::Job)
                .map_err(|e| format!("{e}, nor a service's replica (service/NAME/ORDINAL)"));
        };
        let bad = || {
            format!(
                "{:?} is not service/NAME/ORDINAL (or service/TENANT/NAME/ORDINAL), e.g. service/web/0",
                super::output::printable(s)
            )
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let (tenant, name, ordinal) = match parts.as_slice() {
            [name, ordinal] => (None, *name, *ordinal),
            [tenant, name, ordinal] if !tenant.is_empty() => {
                (Some((*tenant).to_owned()), *name, *ordinal)
            }
            _ => return Err(bad()),
        };
        if name.is_empty() {
            return Err(bad());
        }
        Ok(LogTarget::Replica {
            tenant,
            name: name.to_owned(),
            ordinal: ordinal.parse().map_err(|_| bad())?,
        })
    }
}

impl LogTarget {
    /// The job whose logs to read.
    async fn job(&self, client: &mut Client) -> anyhow::Result<u64> {
        match self {
            LogTarget::Job(r) => super::job_control::resolve_one(client, *r).await,
            LogTarget::Replica {
                tenant,
                name,
                ordinal,
            } => {
                let s = super::service::fetch(client, name, tenant.as_deref(), false).await?;
                replica_job(&s, *ordinal)
            }
        }
    }
}

/// The job of replica `ordinal` of `s`, or which ordinals there are.
fn replica_job(s: &pb::Service, ordinal: u32) -> anyhow::Result<u64> {
    if let Some(r) = s.replicas.iter().find(|r| r.ordinal == ordinal) {
        return Ok(r.job_id);
    }
    let name = s.spec.as_ref().map_or("", |s| s.name.as_str());
    let ordinals: Vec<String> = s.replicas.iter().map(|r| r.ordinal.to_string()).collect();
    anyhow::bail!(
        "service {} has no replica {ordinal} now (its replicas: {})",
        super::output::printable(name),
        if ordinals.is_empty() {
            "none".to_owned()
        } else {
            ordinals.join(", ")
        }
    )
}

#[derive(clap::Args, Debug, Clone)]
pub struct LogsArgs {
    /// The job (`41`, or `41_7` for index 7 of array 41), or a service's replica
    /// (`service/web/0`, `service/TENANT/web/0`).
    pub job: LogTarget,
    /// Only the last N bytes of each stream.
    #[arg(long, default_value_t = 0)]
    pub tail: u64,
    /// The task (as RANK numbers them) whose logs to show.
    #[arg(long, default_value_t = 0)]
    pub task: u32,
    /// The attempt (1 for the first placement, more after requeues) whose logs to show;
    /// default: the latest.
    #[arg(long)]
    pub attempt: Option<u32>,
    /// Keep printing output as it is written, until the attempt ends (waits for a pending
    /// job to start).
    #[arg(long, short = 'f')]
    pub follow: bool,
}

/// How often a follower asks for more.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

pub async fn run(client: &mut Client, args: LogsArgs) -> anyhow::Result<()> {
    let job = args.job.job(client).await?;
    let mut request = pb::ReadJobLogsRequest {
        job_id: job,
        tail_bytes: args.tail,
        task: Some(args.task),
        attempt: args.attempt,
        stdout_from: None,
        stderr_from: None,
    };
    let mut announced = false;
    loop {
        let answer = client
            .call(|mut c, t| async move { c.read_job_logs(with_timeout(request, t)).await })
            .await;
        let resp = match answer {
            Ok(resp) => resp,
            // Not started yet: a follower waits for it.
            Err(s)
                if args.follow
                    && s.code() == tonic::Code::FailedPrecondition
                    && s.message().contains("has not run anywhere yet") =>
            {
                tokio::time::sleep(FOLLOW_EVERY).await;
                continue;
            }
            Err(s) => return Err(s.into()),
        };
        if args.follow && !announced && resp.attempts > 1 {
            eprintln!(
                "gpuctl: job {} attempt {} of {} on {}",
                job,
                resp.attempt,
                resp.attempts,
                super::output::printable(&resp.node)
            );
        }
        announced = true;
        std::io::stdout().write_all(&resp.stdout)?;
        std::io::stdout().flush()?;
        std::io::stderr().write_all(&resp.stderr)?;
        if !args.follow {
            return Ok(());
        }
        let nothing_new = resp.stdout.is_empty() && resp.stderr.is_empty();
        // The attempt followed is over: its job ended, or it was requeued (a later attempt
        // exists), and everything it wrote has been read.
        let attempt_over =
            is_final(&resp.job_state) || request.attempt.is_some_and(|a| resp.attempts > a);
        if nothing_new && attempt_over {
            return Ok(());
        }
        // From now on, this attempt and what follows what was read.
        request.attempt = Some(resp.attempt).filter(|a| *a > 0);
        request.stdout_from = Some(resp.stdout_size);
        request.stderr_from = Some(resp.stderr_size);
        if nothing_new {
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
    }
}

fn is_final(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled" | "timed_out")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_is_named_by_service_and_ordinal() {
        assert_eq!(
            "41_7".parse::<LogTarget>().unwrap(),
            LogTarget::Job(JobRef {
                id: 41,
                array_index: Some(7)
            })
        );
        assert_eq!(
            "service/web/2".parse::<LogTarget>().unwrap(),
            LogTarget::Replica {
                tenant: None,
                name: "web".into(),
                ordinal: 2
            }
        );
        assert_eq!(
            "svc/ml/web/0".parse::<LogTarget>().unwrap(),
            LogTarget::Replica {
                tenant: Some("ml".into()),
                name: "web".into(),
                ordinal: 0
            }
        );
        for bad in [
            "service/web",
            "service//0",
            "service/web/x",
            "service/a/b/c/1",
            "web/0",
        ] {
            let e = bad.parse::<LogTarget>().unwrap_err();
            assert!(e.contains("service/NAME/ORDINAL"), "{bad}: {e}");
        }
        let e = "service/\u{1b}[2J/x".parse::<LogTarget>().unwrap_err();
        assert!(!e.contains('\u{1b}'), "{e}");
    }

    #[test]
    fn a_missing_ordinal_names_the_ones_there_are() {
        let s = pb::Service {
            spec: Some(pb::ServiceSpec {
                name: "web".into(),
                ..Default::default()
            }),
            replicas: vec![
                pb::Replica {
                    ordinal: 0,
                    job_id: 12,
                    ..Default::default()
                },
                pb::Replica {
                    ordinal: 2,
                    job_id: 15,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(replica_job(&s, 2).unwrap(), 15);
        let e = replica_job(&s, 1).unwrap_err().to_string();
        assert!(e.contains("no replica 1") && e.contains("0, 2"), "{e}");
    }
}
