//! `gpuctl why JOB`: why a job is pending, and what would have to change for it to run (the
//! leader's last scheduling pass, put into words by the leader: `WhyJob`).

use proto::v1 as pb;
use serde_json::json;

use super::output::Format;
use super::output::printable;
use crate::client::{Client, with_timeout};

pub async fn run(client: &mut Client, job: u64, fmt: Format) -> anyhow::Result<()> {
    let resp = client
        .call(|mut c, t| async move {
            c.why_job(with_timeout(pb::WhyJobRequest { id: job }, t))
                .await
        })
        .await?;
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"id": resp.id, "state": resp.state, "reason": resp.reason, "lines": resp.lines})
        ),
        Format::Table | Format::Wide => print!("{}", render(&resp)),
    }
    Ok(())
}

/// The answer as text: the reason on the first line, then what would have to change.
pub fn render(resp: &pb::WhyJobResponse) -> String {
    let mut out = format!("job {}: {}\n", resp.id, resp.state.to_uppercase());
    if !resp.reason.is_empty() {
        out.push_str(&format!("  reason: {}\n", printable(&resp.reason)));
    }
    // The first line repeats the reason; the rest say what it needs and what the nodes have.
    let skip = usize::from(!resp.reason.is_empty() && resp.lines.first() == Some(&resp.reason));
    for line in resp.lines.iter().skip(skip) {
        out.push_str(&format!("  {}\n", printable(line)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_reason_then_what_would_have_to_change() {
        let resp = pb::WhyJobResponse {
            id: 7,
            state: "pending".into(),
            reason: "Resources: 0/2 nodes have 8 free GPUs (2 GPUs busy)".into(),
            lines: vec![
                "Resources: 0/2 nodes have 8 free GPUs (2 GPUs busy)".into(),
                "needs 8 GPUs on one node".into(),
                "closest node n1: 6 free of 8 GPUs; 2 held by job 4 (ends in ≤ 1h)".into(),
            ],
        };
        assert_eq!(
            render(&resp),
            "job 7: PENDING\n  reason: Resources: 0/2 nodes have 8 free GPUs (2 GPUs busy)\n  \
             needs 8 GPUs on one node\n  closest node n1: 6 free of 8 GPUs; 2 held by job 4 \
             (ends in ≤ 1h)\n"
        );
    }

    #[test]
    fn a_job_that_is_not_pending_says_so() {
        let resp = pb::WhyJobResponse {
            id: 3,
            state: "running".into(),
            reason: String::new(),
            lines: vec!["job 3 is running, not pending".into()],
        };
        assert_eq!(
            render(&resp),
            "job 3: RUNNING\n  job 3 is running, not pending\n"
        );
    }
}
