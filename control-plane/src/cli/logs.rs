//! `gpuctl logs JOB [--task N] [--attempt K] [--tail BYTES] [-f]`: a task's output, read from
//! the agent of the node that ran it, through the control plane (which checks the caller
//! may read the job, and knows which allocation each task of each attempt was).

use std::io::Write;
use std::time::Duration;

use proto::v1 as pb;

use crate::client::{Client, with_timeout};

#[derive(clap::Args, Debug, Clone)]
pub struct LogsArgs {
    /// The job (`41`, or `41_7` for index 7 of array 41).
    pub job: super::slurm_syntax::JobRef,
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
    let job = super::job_control::resolve_one(client, args.job).await?;
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
