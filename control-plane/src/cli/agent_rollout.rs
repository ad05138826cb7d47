//! `gpuctl node restart-agent`: restart agents in place across a fleet, `--max-unavailable`
//! at a time, as a DaemonSet's `RollingUpdate` does, without touching their jobs.
//!
//! Every chosen node is checked first (its agent answers, the program at its path runs and
//! is a release the control plane supports), so a rollout never stops halfway because node
//! 40 of 64 had no new binary. Then a sliding window of at most N restarts runs; each ends
//! when the new agent is registered and following assignments again. The first failure
//! pauses the rollout: restarts in flight finish, no new one starts, and the failures are
//! named, like a DaemonSet rollout stuck on an unready pod.

use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use proto::v1 as pb;
use serde_json::json;

use super::output::{self, Format};
use crate::client::{Client, with_timeout};

/// How many nodes are checked at once before a rollout.
const CHECK_CONCURRENCY: usize = 16;

#[derive(clap::Args, Debug, Clone)]
pub struct RestartAgentArgs {
    /// Nodes whose agents to restart.
    pub nodes: Vec<String>,
    /// Every node that is not down (optionally only those of --partition).
    #[arg(long, conflicts_with = "nodes")]
    pub all: bool,
    /// With --all: only the nodes of this partition.
    #[arg(long, requires = "all")]
    pub partition: Option<String>,
    /// Agents restarting at the same time: a count, or a percentage of the chosen nodes
    /// ("10%", rounded up, as a DaemonSet's maxUnavailable).
    #[arg(long, default_value = "1", value_parser = MaxUnavailable::parse)]
    pub max_unavailable: MaxUnavailable,
    /// Longest wait, per node, for its restarted agent to be ready.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
    /// Only check every chosen node (the agent answers, its new binary runs and is a
    /// supported release) and say what a restart would run; restart nothing.
    #[arg(long)]
    pub check: bool,
}

/// `--max-unavailable`: how many agents may restart at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxUnavailable {
    Count(usize),
    Percent(u32),
}

impl MaxUnavailable {
    pub fn parse(text: &str) -> Result<MaxUnavailable, String> {
        let bad =
            || format!("{text:?}: give a count of at least 1 or a percentage from 1% to 100%");
        match text.strip_suffix('%') {
            Some(p) => match p.trim().parse::<u32>() {
                Ok(p @ 1..=100) => Ok(MaxUnavailable::Percent(p)),
                _ => Err(bad()),
            },
            None => match text.trim().parse::<usize>() {
                Ok(n @ 1..) => Ok(MaxUnavailable::Count(n)),
                _ => Err(bad()),
            },
        }
    }

    /// The count for a rollout over `nodes` nodes: a percentage rounds up, and is never 0.
    pub fn of(self, nodes: usize) -> usize {
        match self {
            MaxUnavailable::Count(n) => n,
            MaxUnavailable::Percent(p) => (nodes * p as usize).div_ceil(100).max(1),
        }
    }
}

/// One node's restart (or check) as the control plane reported it.
#[derive(Debug, Clone)]
pub struct NodeRestart {
    pub node: String,
    pub result: Result<pb::RestartAgentResponse, String>,
}

/// What a rollout did.
#[derive(Debug, Clone, Default)]
pub struct RolloutReport {
    pub checked: Vec<NodeRestart>,
    pub restarted: Vec<NodeRestart>,
    /// Nodes not restarted because the rollout paused on a failure.
    pub not_started: Vec<String>,
    pub elapsed: Duration,
    /// Most restarts in flight at once.
    pub peak_unavailable: usize,
}

impl RolloutReport {
    pub fn failures(&self) -> impl Iterator<Item = (&str, &str)> {
        self.checked.iter().chain(&self.restarted).filter_map(|r| {
            r.result
                .as_ref()
                .err()
                .map(|e| (r.node.as_str(), e.as_str()))
        })
    }
}

/// Restarts `nodes`' agents, at most `max_unavailable` at a time (after checking all of
/// them); `on_done` sees each restart as it ends.
pub async fn rollout(
    client: &Client,
    nodes: &[String],
    max_unavailable: usize,
    timeout: Duration,
    check_only: bool,
    mut on_done: impl FnMut(&NodeRestart),
) -> RolloutReport {
    let started = Instant::now();
    let mut report = RolloutReport {
        checked: check_all(client, nodes, timeout).await,
        ..RolloutReport::default()
    };
    if check_only || report.failures().next().is_some() {
        report.not_started = if check_only { vec![] } else { nodes.to_vec() };
        report.elapsed = started.elapsed();
        return report;
    }
    let max = max_unavailable.max(1);
    let mut pending = nodes.iter();
    let mut in_flight = FuturesUnordered::new();
    let mut paused = false;
    loop {
        while !paused && in_flight.len() < max {
            let Some(node) = pending.next() else { break };
            in_flight.push(restart_one(client.clone(), node.clone(), timeout, false));
            report.peak_unavailable = report.peak_unavailable.max(in_flight.len());
        }
        let Some(done) = in_flight.next().await else {
            break;
        };
        on_done(&done);
        paused |= done.result.is_err();
        report.restarted.push(done);
    }
    report.not_started = pending.cloned().collect();
    report.elapsed = started.elapsed();
    report
}

/// Checks every node, [`CHECK_CONCURRENCY`] at a time; the results in node order.
async fn check_all(client: &Client, nodes: &[String], timeout: Duration) -> Vec<NodeRestart> {
    let mut out: Vec<NodeRestart> = futures::stream::iter(nodes.iter().cloned())
        .map(|n| restart_one(client.clone(), n, timeout, true))
        .buffer_unordered(CHECK_CONCURRENCY)
        .collect()
        .await;
    out.sort_by(|a, b| a.node.cmp(&b.node));
    out
}

async fn restart_one(
    mut client: Client,
    node: String,
    timeout: Duration,
    check_only: bool,
) -> NodeRestart {
    // One attempt covers the whole wait; a restart that timed out is a verdict, not retried.
    client.attempt_timeout = timeout + Duration::from_secs(20);
    client.deadline = timeout + Duration::from_secs(30);
    client.retry_deadline_exceeded = false;
    let req = pb::RestartAgentRequest {
        node: node.clone(),
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        check_only,
    };
    let result = client
        .call(|mut c, t| {
            let req = req.clone();
            async move { c.restart_agent(with_timeout(req, t)).await }
        })
        .await
        .map_err(|s| proto::transport::status_text(&s));
    NodeRestart { node, result }
}

/// The nodes `--all [--partition P]` names: every node that is not down, by name.
pub async fn all_nodes(
    client: &mut Client,
    partition: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    let resp = client
        .call(|mut c, t| async move {
            c.list_nodes(with_timeout(pb::ListNodesRequest::default(), t))
                .await
        })
        .await?;
    let mut nodes: Vec<String> = resp
        .nodes
        .into_iter()
        .filter(|n| n.status != "down")
        .filter(|n| partition.is_none_or(|p| n.partition == p))
        .map(|n| n.name)
        .collect();
    nodes.sort();
    if nodes.is_empty() {
        anyhow::bail!(
            "no node to restart{}",
            partition.map_or(String::new(), |p| format!(" in partition {p}"))
        );
    }
    Ok(nodes)
}

/// `gpuctl node restart-agent`.
pub async fn run(client: &mut Client, args: RestartAgentArgs, fmt: Format) -> anyhow::Result<()> {
    let nodes = if args.all {
        all_nodes(client, args.partition.as_deref()).await?
    } else if args.nodes.is_empty() {
        anyhow::bail!("name the nodes whose agents to restart, or give --all");
    } else {
        args.nodes.clone()
    };
    let table = fmt.is_table();
    let bar = super::progress::bar(nodes.len() as u64, "agents", fmt);
    let report = rollout(
        client,
        &nodes,
        args.max_unavailable.of(nodes.len()),
        args.wait,
        args.check,
        |r| {
            if table {
                bar.suspend(|| print!("{}", progress_line(r)));
            }
            bar.inc(1);
        },
    )
    .await;
    bar.finish_and_clear();
    match fmt {
        Format::Json | Format::Yaml => println!("{}", report_json(&report)),
        Format::Table | Format::Wide => print!("{}", summary(&report, args.check)),
    }
    let failed = report.failures().count();
    if failed > 0 {
        anyhow::bail!(
            "{failed} node(s) failed{}",
            if report.not_started.is_empty() {
                String::new()
            } else {
                format!(
                    "; the rollout paused with {} node(s) not restarted",
                    report.not_started.len()
                )
            }
        );
    }
    Ok(())
}

fn progress_line(r: &NodeRestart) -> String {
    match &r.result {
        Ok(a) => format!(
            "{}: {} -> {}, ready after {} ms, workloads {} -> {}\n",
            output::printable(&r.node),
            output::printable(&a.previous_release),
            output::printable(&a.release),
            a.down_ms,
            a.workloads_before,
            a.workloads_after
        ),
        Err(e) => format!(
            "{}: FAILED: {}\n",
            output::printable(&r.node),
            output::printable(e)
        ),
    }
}

fn summary(report: &RolloutReport, check_only: bool) -> String {
    if check_only || report.restarted.is_empty() {
        let rows: Vec<Vec<String>> = report
            .checked
            .iter()
            .map(|r| match &r.result {
                Ok(a) => vec![
                    output::printable(&r.node),
                    output::printable(&a.previous_release),
                    output::printable(&a.release),
                    output::printable(&a.program),
                    "ok".into(),
                ],
                Err(e) => vec![
                    output::printable(&r.node),
                    String::new(),
                    String::new(),
                    String::new(),
                    output::printable(e),
                ],
            })
            .collect();
        let mut out = output::table(&["NODE", "RUNNING", "NEXT", "PROGRAM", "CHECK"], &rows);
        if !check_only {
            out.push_str("nothing was restarted: fix the nodes above, or leave them out\n");
        }
        return out;
    }
    let ok: Vec<&pb::RestartAgentResponse> = report
        .restarted
        .iter()
        .filter_map(|r| r.result.as_ref().ok())
        .collect();
    let slowest = ok.iter().map(|a| a.down_ms).max().unwrap_or(0);
    let before: u32 = ok.iter().map(|a| a.workloads_before).sum();
    let after: u32 = ok.iter().map(|a| a.workloads_after).sum();
    format!(
        "restarted {} of {} agents in {:.1} s, at most {} at a time; slowest back in {} ms; workloads {} before, {} after{}\n",
        ok.len(),
        report.restarted.len() + report.not_started.len(),
        report.elapsed.as_secs_f64(),
        report.peak_unavailable,
        slowest,
        before,
        after,
        if report.not_started.is_empty() {
            String::new()
        } else {
            format!("; paused, not restarted: {}", report.not_started.join(", "))
        }
    )
}

fn report_json(report: &RolloutReport) -> serde_json::Value {
    let node = |r: &NodeRestart| match &r.result {
        Ok(a) => json!({
            "node": r.node, "ok": true, "previous_release": a.previous_release,
            "release": a.release, "down_ms": a.down_ms, "workloads_before": a.workloads_before,
            "workloads_after": a.workloads_after, "pid": a.pid, "program": a.program,
        }),
        Err(e) => json!({"node": r.node, "ok": false, "error": e}),
    };
    json!({
        "checked": report.checked.iter().map(node).collect::<Vec<_>>(),
        "restarted": report.restarted.iter().map(node).collect::<Vec<_>>(),
        "not_started": report.not_started,
        "elapsed_ms": report.elapsed.as_millis() as u64,
        "peak_unavailable": report.peak_unavailable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_unavailable_is_a_count_or_a_percentage_rounded_up() {
        assert_eq!(MaxUnavailable::parse("8"), Ok(MaxUnavailable::Count(8)));
        assert_eq!(
            MaxUnavailable::parse("10%"),
            Ok(MaxUnavailable::Percent(10))
        );
        for bad in ["0", "0%", "101%", "-1", "x", "%", ""] {
            assert!(MaxUnavailable::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(MaxUnavailable::Percent(10).of(64), 7);
        assert_eq!(MaxUnavailable::Percent(10).of(3), 1);
        assert_eq!(MaxUnavailable::Percent(100).of(64), 64);
        assert_eq!(MaxUnavailable::Count(8).of(3), 8);
    }
}
