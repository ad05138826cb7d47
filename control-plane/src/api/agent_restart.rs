//! `RestartAgent`: one node's agent restarted in place, without touching its jobs, and
//! waited for until the new process is registered and following assignments again. A
//! rollout (`gpuctl node restart-agent --max-unavailable N`) is this, N nodes at a time.
//!
//! The replica that takes the call talks to the agent directly (agents take calls from
//! replicas only), so any replica serves it and nothing is written to the log: the node stays
//! schedulable throughout, and placements made while its agent restarts wait in the
//! assignment stream the new agent reads.

use std::time::{Duration, Instant};

use proto::agent as pa;
use proto::agent::node_agent_client::NodeAgentClient;
use proto::v1 as pb;
use tonic::Request;
use tonic::transport::Channel;

use crate::release::Skew;
use crate::replica::ApiError;
use crate::state::Rejection;
use crate::state::format::RELEASE;

/// Wait for the restarted agent when the request names none.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Limit of one call to the agent.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// How often the restarted agent is asked whether it is ready.
const POLL: Duration = Duration::from_millis(50);

/// Restarts `node`'s agent (or, with `check_only`, only checks that it could) and waits.
/// `connect` opens a channel to the agent; the wait opens a new one after each failed call,
/// because a channel whose connection the old process closed reconnects only after a backoff
/// (about a second) that would be counted as the agent's downtime.
pub async fn restart_agent(
    node: &str,
    connect: impl Fn() -> Result<Channel, ApiError>,
    req: &pb::RestartAgentRequest,
    requested_by: String,
) -> Result<pb::RestartAgentResponse, ApiError> {
    let mut agent = NodeAgentClient::new(connect()?);
    let before = call(node, agent.info(timed(pa::InfoRequest {})).await)?;
    let check = call(
        node,
        agent
            .restart(timed(pa::RestartRequest {
                check_only: true,
                requested_by: requested_by.clone(),
            }))
            .await,
    )?;
    refuse_unsupported_skew(node, &check.next_release)?;
    let mut resp = pb::RestartAgentResponse {
        node: node.to_owned(),
        previous_release: before.release.clone(),
        release: check.next_release.clone(),
        down_ms: 0,
        workloads_before: before.workloads,
        workloads_after: before.workloads,
        pid: before.pid,
        program: check.program.clone(),
    };
    if req.check_only {
        return Ok(resp);
    }
    let started = Instant::now();
    call(
        node,
        agent
            .restart(timed(pa::RestartRequest {
                check_only: false,
                requested_by,
            }))
            .await,
    )?;
    let timeout = match req.timeout_ms {
        0 => DEFAULT_TIMEOUT,
        ms => Duration::from_millis(ms),
    };
    let after = wait_ready(&connect, before.started_at_ms, started + timeout)
        .await
        .map_err(|last| {
            ApiError::DeadlineExceeded(format!(
                "node {node}'s agent did not come back ready within {timeout:?} of its restart \
                 (last: {last}); its jobs keep running under their shims until its lease passes. \
                 Look at the agent's log on the host (journalctl -u gpu-node-agent)"
            ))
        })?;
    resp.down_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    resp.release = after.release;
    resp.workloads_after = after.workloads;
    resp.pid = after.pid;
    tracing::info!(
        node,
        previous = %resp.previous_release,
        release = %resp.release,
        down_ms = resp.down_ms,
        workloads_before = resp.workloads_before,
        workloads_after = resp.workloads_after,
        "agent restarted in place"
    );
    Ok(resp)
}

/// The control plane is upgraded first; an agent may lag it by one minor release, never lead
/// it (docs/UPGRADING.md). A restart into a release outside that is refused before it starts.
fn refuse_unsupported_skew(node: &str, next_release: &str) -> Result<(), ApiError> {
    match Skew::of(next_release, RELEASE) {
        Skew::Same | Skew::OneBehind => Ok(()),
        Skew::Unsupported => Err(Rejection::precondition(format!(
            "node {node}'s agent binary is release {next_release}, and this control plane is \
             {RELEASE}: an agent may be at most one minor release older than the control plane \
             and never newer. Upgrade the control plane first (docs/UPGRADING.md); the agent \
             keeps running its current release"
        ))
        .into()),
    }
}

/// Polls until an agent other than the one that started at `old_start` answers ready. Returns
/// the last thing seen when the deadline passes.
async fn wait_ready(
    connect: &impl Fn() -> Result<Channel, ApiError>,
    old_start: u64,
    deadline: Instant,
) -> Result<pa::AgentInfo, String> {
    let mut agent: Option<NodeAgentClient<Channel>> = None;
    loop {
        let client = match agent.as_mut() {
            Some(c) => c,
            None => agent.insert(NodeAgentClient::new(
                connect().map_err(|e| format!("{e:?}"))?,
            )),
        };
        let last = match client.info(timed(pa::InfoRequest {})).await {
            Ok(info) => {
                let info = info.into_inner();
                if info.started_at_ms != old_start && info.ready {
                    return Ok(info);
                }
                if info.started_at_ms == old_start {
                    "the old agent still answers".to_owned()
                } else {
                    "the new agent answers but is not registered yet".to_owned()
                }
            }
            // Refused connections while the program starts again: expected, keep asking.
            Err(s) => {
                agent = None;
                format!("{}: {}", s.code(), s.message())
            }
        };
        if Instant::now() + POLL >= deadline {
            return Err(last);
        }
        tokio::time::sleep(POLL).await;
    }
}

fn timed<T>(message: T) -> Request<T> {
    let mut r = Request::new(message);
    r.set_timeout(CALL_TIMEOUT);
    r
}

/// An agent's answer, or its error as the caller should see it. Agents before this release
/// have no Restart/Info: they are restarted by their supervisor instead.
fn call<T>(node: &str, result: Result<tonic::Response<T>, tonic::Status>) -> Result<T, ApiError> {
    match result {
        Ok(r) => Ok(r.into_inner()),
        Err(s) if s.code() == tonic::Code::Unimplemented => Err(Rejection::precondition(format!(
            "node {node}'s agent is of a release that cannot restart itself in place; restart \
             it with its supervisor (systemctl restart gpu-node-agent: KillMode=process keeps \
             its jobs, and the new agent re-adopts them)"
        ))
        .into()),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => {
            Err(Rejection::precondition(s.message().to_owned()).into())
        }
        Err(s) => Err(ApiError::Unavailable(format!(
            "the agent of node {node} did not answer: {}",
            s.message()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_newer_than_the_control_plane_or_two_behind_is_refused() {
        let me = crate::release::Release::parse(RELEASE).unwrap();
        let newer = format!("{}.{}.0", me.major, me.minor + 1);
        let err = refuse_unsupported_skew("n1", &newer).unwrap_err();
        let ApiError::Rejected(r) = err else {
            panic!("a rejection")
        };
        assert!(
            r.message.contains("Upgrade the control plane first"),
            "{}",
            r.message
        );
        assert!(refuse_unsupported_skew("n1", RELEASE).is_ok());
        if me.minor >= 1 {
            let behind = format!("{}.{}.7", me.major, me.minor - 1);
            assert!(refuse_unsupported_skew("n1", &behind).is_ok());
        }
        if me.minor >= 2 {
            let far = format!("{}.{}.0", me.major, me.minor - 2);
            assert!(refuse_unsupported_skew("n1", &far).is_err());
        }
        assert!(refuse_unsupported_skew("n1", "garbage").is_err());
    }
}
