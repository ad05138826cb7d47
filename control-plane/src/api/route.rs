//! Runs an operation on this replica, or forwards the whole call to the leader when this
//! replica is not it. A call that was already forwarded once is never forwarded again: if the
//! leader moved meanwhile, the client gets `Unavailable` with the new leader and retries.

use std::future::Future;
use std::time::Duration;

use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use super::auth::{Caller, authenticate};
use crate::replica::{ApiError, Replica};
use crate::state::{RejectKind, Rejection};

/// Metadata key marking a call forwarded by another replica.
pub const FORWARDED: &str = "x-gpucp-forwarded-by";
/// Response metadata a follower adds to the answer of a call it forwarded: the leader's
/// advertised address. A long-lived client (`client::Client`) whose endpoints include that
/// address sends its next calls there, so a forwarded call is the exception rather than
/// two thirds of a client population's calls (each forward costs the follower a second RPC
/// and the leader a second TLS stream per call).
pub const LEADER_HINT: &str = "x-gpucp-leader";
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

pub fn rejection_status(r: &Rejection) -> Status {
    let code = match r.kind {
        RejectKind::InvalidArgument => Code::InvalidArgument,
        RejectKind::NotFound => Code::NotFound,
        RejectKind::FailedPrecondition => Code::FailedPrecondition,
    };
    Status::new(code, r.to_string())
}

pub fn error_status(replica: &Replica, e: ApiError) -> Status {
    match e {
        ApiError::Rejected(r) => rejection_status(&r),
        ApiError::NotLeader {
            leader: Some((id, addr)),
        } => Status::unavailable(format!(
            "replica {} is not the leader; the leader is replica {id} at {addr}; retry there",
            replica.id
        )),
        ApiError::NotLeader { leader: None } => Status::unavailable(format!(
            "replica {} knows no leader yet (election in progress or no quorum); retry shortly",
            replica.id
        )),
        ApiError::Unavailable(m) => Status::unavailable(m),
        ApiError::DeadlineExceeded(m) => Status::deadline_exceeded(m),
        ApiError::Internal(m) => Status::internal(m),
        ApiError::Unauthenticated(m) => Status::unauthenticated(m),
        ApiError::PermissionDenied(m) => Status::permission_denied(m),
    }
}

/// Authenticates the caller, runs `local` with it, and forwards the call to the leader when
/// `local` says this replica is not it (with the caller's identity, see `auth`).
pub async fn route<Req, Resp, L, LF, R, RF>(
    replica: &Replica,
    request: Request<Req>,
    local: L,
    remote: R,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    L: FnOnce(Caller, Req) -> LF,
    LF: Future<Output = Result<Resp, ApiError>>,
    R: FnOnce(Channel, Request<Req>) -> RF,
    RF: Future<Output = Result<Response<Resp>, Status>>,
{
    let forwarded = request.metadata().contains_key(FORWARDED);
    let caller = authenticate(replica, &request)
        .await
        .map_err(|e| error_status(replica, e))?;
    let message = request.into_inner();
    match local(caller.clone(), message.clone()).await {
        Ok(resp) => Ok(Response::new(resp)),
        Err(ApiError::NotLeader {
            leader: Some((leader, addr)),
        }) if !forwarded && leader != replica.id => {
            let channel = replica
                .leader_channel(&addr)
                .map_err(|e| error_status(replica, e))?;
            let mut req = Request::new(message);
            req.set_timeout(FORWARD_TIMEOUT);
            caller.forward_into(req.metadata_mut());
            req.metadata_mut().insert(
                FORWARDED,
                replica
                    .id
                    .to_string()
                    .parse()
                    .expect("a decimal number is valid metadata"),
            );
            tracing::debug!(leader, %addr, "forwarding to the leader");
            let hint = addr.parse::<tonic::metadata::MetadataValue<_>>().ok();
            match remote(channel, req).await {
                Ok(mut resp) => {
                    if let Some(hint) = hint {
                        resp.metadata_mut().insert(LEADER_HINT, hint);
                    }
                    Ok(resp)
                }
                Err(s) if s.code() == Code::Unavailable || s.code() == Code::Unknown => {
                    Err(Status::unavailable(format!(
                        "forwarding to leader {leader} at {addr} failed: {}",
                        s.message()
                    )))
                }
                // The leader answered (a refusal, say): it still leads.
                Err(mut s) => {
                    if let Some(hint) = hint {
                        s.metadata_mut().insert(LEADER_HINT, hint);
                    }
                    Err(s)
                }
            }
        }
        Err(e) => Err(error_status(replica, e)),
    }
}

/// For writes: fails with `NotLeader` naming the leader when this replica knows that another
/// replica leads, so that `route` forwards the call at once. Asking this replica's Raft would
/// give the same answer, but only after the request has queued behind whatever the follower's
/// Raft core is busy with (mostly flushing the entries the leader sends), which adds up to a
/// log flush to every forwarded write. When no leader is known, or this replica believes it
/// leads, the write goes to Raft as before, and Raft decides.
pub fn forward_if_follower(replica: &Replica) -> Result<(), ApiError> {
    match replica.leader() {
        Some((leader, addr)) if leader != replica.id => Err(ApiError::NotLeader {
            leader: Some((leader, addr)),
        }),
        _ => Ok(()),
    }
}

/// Longest a new leader waits for its state to include its predecessors' entries before it
/// answers "retry" instead of checking a request against that state.
const CURRENT_STATE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// For writes checked against this replica's state before they are proposed (a refusal then
/// adds nothing to the log): forwards when another replica leads, and on the leader waits
/// until its state machine has applied an entry of its own term. A leader just elected may
/// still be applying entries its predecessor committed; a check against that state would
/// refuse, say, a dependency on or a cancel of a job that was acknowledged moments ago.
pub async fn current_leader_state(replica: &Replica) -> Result<(), ApiError> {
    forward_if_follower(replica)?;
    type Metrics = openraft::RaftMetrics<u64, openraft::BasicNode>;
    let current = |m: &Metrics| {
        m.current_leader == Some(replica.id)
            && m.last_applied.map(|l| l.leader_id.term) == Some(m.current_term)
    };
    let mut metrics = replica.raft.metrics();
    if current(&metrics.borrow()) {
        return Ok(());
    }
    // Also wakes when another replica is known to lead, to forward to it.
    let settled = |m: &Metrics| current(m) || m.current_leader.is_some_and(|l| l != replica.id);
    let waited = tokio::time::timeout(CURRENT_STATE_WAIT, metrics.wait_for(settled)).await;
    // `wait_for` answers with a borrow of the metrics, which holds their lock for reading. It
    // must be gone before anything reads them again: `forward_if_follower` does, and if the
    // Raft core reported new metrics in between, its write waited for this borrow and the
    // second read waited for the write. That froze this runtime thread and the core's, and with
    // them the whole replica, for good (`bench failover --cpu-hog`, once in about 250 kills).
    let is_current = matches!(&waited, Ok(Ok(m)) if current(m));
    drop(waited);
    forward_if_follower(replica)?;
    if is_current {
        Ok(())
    } else {
        // Still no leader with a current state: the caller retries, and finds one.
        Err(ApiError::NotLeader { leader: None })
    }
}
