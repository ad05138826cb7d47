//! Membership changes that cannot lose fault tolerance by accident, and what `cluster status`
//! says about the members.
//!
//! - **Add** (`add`): the new replica joins as a learner (no vote), and becomes a voter only
//!   once it is at most `max_lag` entries behind the leader's last log index *and* has stayed
//!   so, answering every call, for `stable`. A replica that does not answer the leader within
//!   `answer_timeout` (5 s by default: nothing listens at the address, a firewall, a
//!   certificate the replica refuses, another cluster) is not added: the learner is removed
//!   again and the call fails with `DeadlineExceeded`, naming the address, the last error and
//!   what to check, the membership as it was. (openraft's own "caught up" test, with its
//!   5,000-entry replication lag, promoted a replica nothing listened for 34 ms after the call.)
//! - **Remove** (`remove`): after the change commits the leader tells the removed replica
//!   (`NotifyRemoved`); a replica that was down meanwhile learns it from the first peer that
//!   refuses its vote request (`peer_service`); a leader that removed itself knows. Each then
//!   shuts its Raft down (it never campaigns again), says why in its log, and refuses every API
//!   call with that reason (`spawn_watcher`, `stop_removed`).
//! - **Quorum guard**: a change whose new voter set would not have a majority among the
//!   replicas that answer the leader now is refused (`FailedPrecondition`) unless `force`: such
//!   a change could not commit, and while it waited the cluster could commit nothing else.
//! - **Status** (`status`): each member's role, whether it answers, when it last did, its
//!   matched index and lag; and the leader only as this replica knows it *now* (itself while it
//!   hears from a quorum, or a leader it heard from within two election timeouts), never the
//!   leader it last heard of before an election.
//!
//! One change at a time per leader (`Replica::begin_membership_change`). The work runs in its
//! own task, so a client that gives up does not leave a half-done change behind.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use openraft::{ChangeMembers, ServerState};
use proto::raft::RaftMessage;
use proto::raft::raft_peer_client::RaftPeerClient;
use proto::tls::ExpectedPeer;
use proto::v1 as pb;
use tokio::time::Instant;

use crate::api::auth::{Caller, Principal};
use crate::config::Defaults;
use crate::raft::NodeId;
use crate::raft::peers::{PeerBinary, Removal, RemovedNotice};
use crate::replica::{ApiError, Replica};
use crate::state::{Command, Rejection};

/// How `cluster add` decides that a learner may vote, and how long membership calls wait.
#[derive(Debug, Clone)]
pub struct MembershipSettings {
    /// Most entries a learner may be behind the leader's last log index to be promoted.
    pub max_lag: u64,
    /// How long it must have stayed that close, answering, before it is.
    pub stable: Duration,
    /// A replica being added that has not answered for this long is not added; a change that
    /// has not committed after this long is answered with `DeadlineExceeded`.
    pub answer_timeout: Duration,
    /// A learner that answers but is still behind after this long is not promoted.
    pub catch_up_timeout: Duration,
}

impl Default for MembershipSettings {
    fn default() -> Self {
        MembershipSettings {
            max_lag: Defaults::PROMOTE_MAX_LAG,
            stable: Duration::from_millis(Defaults::PROMOTE_STABLE_MS),
            answer_timeout: Duration::from_millis(Defaults::MEMBER_ANSWER_TIMEOUT_MS),
            catch_up_timeout: Duration::from_secs(Defaults::CATCH_UP_TIMEOUT_SECS),
        }
    }
}

impl MembershipSettings {
    /// Longest an add may take on the leader (for callers' and forwarders' timeouts).
    pub fn longest_add(&self) -> Duration {
        self.catch_up_timeout + self.stable + 2 * self.answer_timeout
    }
}

/// How often a waiting membership call looks at the leader's replication state.
const POLL: Duration = Duration::from_millis(20);
/// How long the leader tries to tell a removed replica that it was removed.
const NOTICE_TIMEOUT: Duration = Duration::from_secs(2);

fn ids(set: &BTreeSet<NodeId>) -> String {
    let v: Vec<String> = set.iter().map(|i| i.to_string()).collect();
    format!("{{{}}}", v.join(", "))
}

/// Refuses membership requests that would corrupt the id → address mapping.
pub fn check_member_request(
    r: &Replica,
    id: NodeId,
    address: Option<&str>,
) -> Result<(), Rejection> {
    if id == 0 {
        return Err(Rejection::invalid("id", "replica ids start at 1"));
    }
    let membership = r.raft.metrics().borrow().membership_config.clone();
    let nodes: BTreeMap<NodeId, String> = membership
        .membership()
        .nodes()
        .map(|(id, n)| (*id, n.addr.clone()))
        .collect();
    match address {
        Some(addr) => {
            if addr.parse::<std::net::SocketAddr>().is_err() && !addr.contains(':') {
                return Err(Rejection::invalid(
                    "address",
                    format!("{addr:?} is not host:port"),
                ));
            }
            if let Some(existing) = nodes.get(&id)
                && existing != addr
            {
                return Err(Rejection::invalid(
                    "address",
                    format!(
                        "replica {id} is already a member at {existing}; remove it first to change its address"
                    ),
                ));
            }
            if let Some((other, _)) = nodes.iter().find(|(i, a)| **i != id && a.as_str() == addr) {
                return Err(Rejection::invalid(
                    "address",
                    format!("{addr} already belongs to replica {other}"),
                ));
            }
        }
        None => {
            if !nodes.contains_key(&id) {
                return Err(Rejection::not_found(format!(
                    "replica {id} is not a member"
                )));
            }
        }
    }
    Ok(())
}

pub fn membership_error<E>(r: &Replica, e: openraft::error::RaftError<NodeId, E>) -> ApiError
where
    E: std::fmt::Display
        + std::fmt::Debug
        + openraft::TryAsRef<openraft::error::ForwardToLeader<NodeId, openraft::BasicNode>>,
{
    if let Some(f) = e.forward_to_leader() {
        return crate::replica::not_leader(f);
    }
    ApiError::Rejected(Rejection::precondition(format!(
        "membership change on replica {} failed: {e}",
        r.id
    )))
}

/// Records a membership change in the audit trail (openraft applies the change itself, so it
/// has no command of its own). A failure to record is logged: the change has happened.
async fn note_membership(r: &Replica, caller: &Caller, action: &str, id: NodeId, detail: String) {
    let note = Command::AuditNote {
        action: action.to_owned(),
        target: format!("replica {id}"),
        detail,
    };
    if let Err(e) = r.write(note.by(caller.actor())).await {
        tracing::warn!(
            ?e,
            "recording a membership change in the audit trail failed"
        );
    }
}

/// Whether `id` answers this replica now (itself always does).
fn live(r: &Replica, id: NodeId) -> bool {
    id == r.id || r.peers.reachable(id)
}

/// The quorum guard: refuses a change whose voters would be `voters` unless a majority of
/// them answer now, or the caller forces it.
fn check_live_majority(
    r: &Replica,
    voters: &BTreeSet<NodeId>,
    force: bool,
    what: &str,
) -> Result<(), ApiError> {
    let alive: BTreeSet<NodeId> = voters.iter().copied().filter(|v| live(r, *v)).collect();
    let need = voters.len() / 2 + 1;
    if alive.len() >= need {
        return Ok(());
    }
    let silent: BTreeSet<NodeId> = voters.difference(&alive).copied().collect();
    if force {
        tracing::warn!(
            voters = %ids(voters),
            answering = %ids(&alive),
            "forced: {what} although a majority of the new voters does not answer"
        );
        return Ok(());
    }
    Err(ApiError::Rejected(Rejection::precondition(format!(
        "refusing to {what}: the voters would then be {}, of which only {} answer now ({} have not answered leader {} within the last {} ms); a majority is {need}, so the cluster could commit nothing, not even this change, until enough of them are back. Bring the silent replicas back (or remove dead ones first, one at a time), or repeat with --force to propose it anyway",
        ids(voters),
        ids(&alive),
        ids(&silent),
        r.id,
        r.peers.window().as_millis()
    ))))
}

/// Waits for `change` to commit (it runs in its own task and goes on if we stop waiting).
async fn commit_change(
    r: &Arc<Replica>,
    change: ChangeMembers<NodeId, openraft::BasicNode>,
    what: &str,
    voters: &BTreeSet<NodeId>,
) -> Result<u64, ApiError> {
    let raft = r.raft.clone();
    let mut task = tokio::spawn(async move { raft.change_membership(change, false).await });
    match tokio::time::timeout(r.membership.answer_timeout, &mut task).await {
        Ok(Ok(Ok(resp))) => Ok(resp.log_id.index),
        Ok(Ok(Err(e))) => Err(membership_error(r, e)),
        Ok(Err(e)) => Err(ApiError::Internal(format!(
            "the membership change task failed: {e}"
        ))),
        Err(_) => {
            let silent: BTreeSet<NodeId> =
                voters.iter().copied().filter(|v| !live(r, *v)).collect();
            Err(ApiError::DeadlineExceeded(format!(
                "{what}: proposed, but not committed within {} s: a majority of the voters {} must store it, and {} do not answer leader {}. It commits when enough of them are back; until then the cluster commits nothing else. `gpuctl cluster status` shows the members",
                r.membership.answer_timeout.as_secs_f64(),
                ids(voters),
                ids(&silent),
                r.id
            )))
        }
    }
}

/// `cluster add`: see the module header.
pub async fn add(
    r: Arc<Replica>,
    caller: Caller,
    req: pb::AddReplicaRequest,
) -> Result<pb::ClusterStatusResponse, ApiError> {
    check_member_request(&r, req.id, Some(&req.address))?;
    r.require_leader()?;
    let id = req.id;
    let m = r.raft.metrics().borrow().clone();
    let membership = m.membership_config.membership().clone();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    if voters.contains(&id) {
        // A voter already (a replica whose data was lost joining again): nothing to change.
        return Ok(status(&r));
    }
    let was_learner = membership.get_node(&id).is_some();
    if was_learner && req.learner_only {
        return Ok(status(&r));
    }
    let _busy = r.begin_membership_change(format!(
        "adding replica {id} at {}, since {}",
        req.address,
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    ))?;
    if !was_learner {
        r.peers.forget(id);
        tracing::info!(id, address = %req.address, "adding replica as a learner");
        r.raft
            .add_learner(id, openraft::BasicNode::new(req.address.clone()), false)
            .await
            .map_err(|e| membership_error(&r, e))?;
    }
    let outcome = wait_caught_up(&r, id, &req.address, req.learner_only)
        .await
        .and_then(|()| {
            if req.learner_only {
                return Ok(None);
            }
            let mut new_voters = voters.clone();
            new_voters.insert(id);
            check_live_majority(
                &r,
                &new_voters,
                req.force,
                &format!("make replica {id} a voter"),
            )
            .map(|()| Some(new_voters))
        });
    let new_voters = match outcome {
        Ok(v) => v,
        Err(e) => {
            if !was_learner {
                withdraw_learner(&r, id).await;
            }
            return Err(e);
        }
    };
    if let Some(new_voters) = new_voters {
        tracing::info!(id, "promoting replica to voter");
        commit_change(
            &r,
            ChangeMembers::AddVoterIds(BTreeSet::from([id])),
            &format!("making replica {id} a voter"),
            &new_voters,
        )
        .await?;
    }
    note_membership(
        &r,
        &caller,
        "add_replica",
        id,
        format!(
            "added replica {id} at {}{}",
            req.address,
            if req.learner_only {
                " as a learner"
            } else {
                ""
            }
        ),
    )
    .await;
    Ok(status(&r))
}

/// Removes a learner this add put in, when the add failed.
async fn withdraw_learner(r: &Replica, id: NodeId) {
    let removed = tokio::time::timeout(
        r.membership.answer_timeout,
        r.raft
            .change_membership(ChangeMembers::RemoveNodes(BTreeSet::from([id])), false),
    )
    .await;
    match removed {
        Ok(Ok(_)) => tracing::info!(
            id,
            "the replica that could not be added is a learner no more"
        ),
        Ok(Err(e)) => tracing::warn!(id, %e, "removing the learner that could not be added failed"),
        Err(_) => tracing::warn!(id, "removing the learner that could not be added timed out"),
    }
    r.peers.forget(id);
}

/// Waits until learner `id` has answered (and, unless `learner_only`, caught up and stayed
/// caught up for the stable period), or says why it will not.
async fn wait_caught_up(
    r: &Replica,
    id: NodeId,
    address: &str,
    learner_only: bool,
) -> Result<(), ApiError> {
    let settings = &r.membership;
    let start = Instant::now();
    let mut answered = false;
    let mut stable_since: Option<Instant> = None;
    let check = format!(
        "Check that it runs (`--id {id} --cluster {}`), listens on {address}, that {address} is reachable from replica {}, and that it has a replica certificate for replica-{id} from this cluster's CA",
        r.cluster, r.id
    );
    loop {
        let m = r.raft.metrics().borrow().clone();
        if m.state != ServerState::Leader || m.current_leader != Some(r.id) {
            return Err(ApiError::Unavailable(format!(
                "replica {} stopped leading while adding replica {id}; it may remain a learner: see `gpuctl cluster status` and repeat the add",
                r.id
            )));
        }
        let contact = r.peers.contact(id);
        let reachable = r.peers.reachable(id);
        answered |= contact.last_ok.is_some();
        refuse_unreadable_binary(r, id, address, contact.last_error.as_deref())?;
        let last = m.last_log_index.unwrap_or(0);
        let matched = m
            .replication
            .as_ref()
            .and_then(|rep| rep.get(&id).copied())
            .flatten()
            .map(|l| l.index);
        let lag = matched.map(|i| last.saturating_sub(i));
        if learner_only && reachable {
            return Ok(());
        }
        if reachable && lag.is_some_and(|l| l <= settings.max_lag) {
            let since = *stable_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= settings.stable {
                tracing::info!(
                    id,
                    lag = lag.unwrap_or(0),
                    took_ms = start.elapsed().as_millis() as u64,
                    "the learner has caught up and kept answering"
                );
                return Ok(());
            }
        } else {
            stable_since = None;
        }
        let last_error = contact
            .last_error
            .as_deref()
            .map(|e| format!(" (last error: {e})"))
            .unwrap_or_default();
        // A learner installing the snapshot answers nothing else until it is done; the time
        // that takes grows with the state and is bounded by the install timeout instead.
        let silent_for = contact.silent_for(start.elapsed());
        if silent_for >= settings.answer_timeout {
            let what = if answered {
                format!(
                    "replica {id} at {address} answered, then stopped answering leader {} for {:.1} s{last_error}",
                    r.id,
                    silent_for.as_secs_f64()
                )
            } else {
                format!(
                    "replica {id} at {address} did not answer leader {} within {:.1} s{last_error}",
                    r.id,
                    silent_for.as_secs_f64()
                )
            };
            return Err(ApiError::DeadlineExceeded(format!(
                "{what}; it was not added and the membership is unchanged. {check}"
            )));
        }
        if start.elapsed() >= settings.catch_up_timeout {
            return Err(ApiError::DeadlineExceeded(format!(
                "replica {id} at {address} answers but has not caught up within {} s: it is {} entries behind the leader (it must come within {} and stay there for {} ms); it was not added and the membership is unchanged. A replica slower than the cluster's write rate never catches up: check its disk and CPU, or add it while the cluster is quieter",
                settings.catch_up_timeout.as_secs(),
                lag.map_or("an unknown number of".to_owned(), |l| l.to_string()),
                settings.max_lag,
                settings.stable.as_millis()
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A new replica whose binary cannot read the format the cluster writes would refuse every
/// entry it is sent and never catch up: say so at once, instead of after the catch-up timeout.
fn refuse_unreadable_binary(
    r: &Replica,
    id: NodeId,
    address: &str,
    last_error: Option<&str>,
) -> Result<(), ApiError> {
    let writes = r.sm.cluster_version();
    // Releases before 0.2 say nothing about their binary; they only fail to decode what
    // they are sent. Later ones refuse a newer format by name.
    if let Some(e) = last_error
        && (e.contains("undecodable Raft payload") || e.contains("but this binary (release"))
    {
        return Err(ApiError::Rejected(Rejection::precondition(format!(
            "replica {id} at {address} cannot read the log: this cluster writes format {writes} (its cluster version), and the replica answered: {e}. It runs an older release; it was not added and the membership is unchanged. Start it on this release's binary ({}) and add it again",
            crate::state::format::RELEASE
        ))));
    }
    match r.peers.binary(id) {
        Some(b) if b.format_max < writes => {
            Err(ApiError::Rejected(Rejection::precondition(format!(
                "replica {id} at {address} runs release {} (reads formats up to {}), but this cluster writes format {writes} (its cluster version): it cannot read the log. It was not added and the membership is unchanged; start it on this release's binary ({}) and add it again",
                b.release_text(),
                b.format_max,
                crate::state::format::RELEASE
            ))))
        }
        _ => Ok(()),
    }
}

/// `cluster remove`: see the module header.
pub async fn remove(
    r: Arc<Replica>,
    caller: Caller,
    req: pb::RemoveReplicaRequest,
) -> Result<pb::ClusterStatusResponse, ApiError> {
    if let Principal::Replica(name) = &caller.principal {
        return Err(ApiError::PermissionDenied(format!(
            "the certificate of {name} may not remove replicas; use an admin token or certificate"
        )));
    }
    check_member_request(&r, req.id, None)?;
    r.require_leader()?;
    let id = req.id;
    let busy = r.begin_membership_change(format!(
        "removing replica {id}, since {}",
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    ))?;
    let membership = r.raft.metrics().borrow().membership_config.clone();
    let address = membership
        .membership()
        .get_node(&id)
        .map(|n| n.addr.clone())
        .unwrap_or_default();
    let voters: BTreeSet<NodeId> = membership.membership().voter_ids().collect();
    let (change, new_voters) = if voters.contains(&id) {
        if voters.len() == 1 {
            return Err(Rejection::precondition("cannot remove the last voting replica").into());
        }
        let mut rest = voters.clone();
        rest.remove(&id);
        check_live_majority(&r, &rest, req.force, &format!("remove replica {id}"))?;
        (ChangeMembers::RemoveVoters(BTreeSet::from([id])), rest)
    } else {
        (ChangeMembers::RemoveNodes(BTreeSet::from([id])), voters)
    };
    let detail = format!(
        "removed replica {id}{}",
        if req.force { " (forced)" } else { "" }
    );
    if id == r.id {
        // The leader removes itself: once the change commits it stops, and cannot record it.
        note_membership(&r, &caller, "remove_replica", id, detail.clone()).await;
    }
    tracing::info!(id, force = req.force, "removing replica");
    let what = format!("removing replica {id}");
    // The commit, the notice and the audit record finish even if the caller stops waiting;
    // the caller hears as soon as the change has committed.
    let (committed_tx, committed_rx) = tokio::sync::oneshot::channel();
    {
        let r = r.clone();
        tokio::spawn(async move {
            let _busy = busy;
            let at = match r.raft.change_membership(change, false).await {
                Ok(resp) => resp.log_id.index,
                Err(e) => {
                    let _ = committed_tx.send(Err(membership_error(&r, e)));
                    return;
                }
            };
            let _ = committed_tx.send(Ok(at));
            if id != r.id {
                notify_removed(&r, id, &address, at).await;
                note_membership(&r, &caller, "remove_replica", id, detail).await;
            } else {
                stop_removed(
                    &r,
                    Removal {
                        log_index: at,
                        how: "it removed itself as the leader".into(),
                    },
                )
                .await;
            }
            r.peers.forget(id);
        });
    }
    match tokio::time::timeout(r.membership.answer_timeout, committed_rx).await {
        Ok(Ok(Ok(_))) => {
            if id == r.id {
                // Let it stop first, so that the answer says so.
                let deadline = Instant::now() + Duration::from_secs(1);
                while r.removed().is_none() && Instant::now() < deadline {
                    tokio::time::sleep(POLL).await;
                }
            }
            Ok(status(&r))
        }
        Ok(Ok(Err(e))) => Err(e),
        Ok(Err(_)) => Err(ApiError::Internal(
            "the membership change task ended without an answer".into(),
        )),
        Err(_) => {
            let silent: BTreeSet<NodeId> = new_voters
                .iter()
                .copied()
                .filter(|v| !live(&r, *v))
                .collect();
            Err(ApiError::DeadlineExceeded(format!(
                "{what}: proposed, but not committed within {} s: a majority of the voters {} must store it, and {} do not answer leader {}. It commits when enough of them are back; until then the cluster commits nothing else. `gpuctl cluster status` shows the members",
                r.membership.answer_timeout.as_secs_f64(),
                ids(&new_voters),
                ids(&silent),
                r.id
            )))
        }
    }
}

/// Tells replica `id` at `address` that the membership committed at `log_index` no longer
/// has it, so that it stops now rather than when it next campaigns. Best effort: a replica
/// that is down learns it from its peers when it comes back.
async fn notify_removed(r: &Replica, id: NodeId, address: &str, log_index: u64) {
    let notice = RemovedNotice {
        id,
        log_index,
        by: r.id,
    };
    let sent = async {
        let channel = r
            .transport
            .channel(address, ExpectedPeer::Replica)
            .map_err(|e| e.to_string())?;
        let payload = serde_json::to_vec(&notice).map_err(|e| e.to_string())?;
        let mut request = tonic::Request::new(RaftMessage {
            cluster: r.cluster.clone(),
            payload,
            format_max: crate::state::format::CURRENT,
            release: crate::state::format::RELEASE.to_owned(),
        });
        request.set_timeout(NOTICE_TIMEOUT);
        RaftPeerClient::new(channel)
            .notify_removed(request)
            .await
            .map_err(|s| proto::transport::status_text(&s))?;
        Ok::<(), String>(())
    };
    match tokio::time::timeout(NOTICE_TIMEOUT, sent).await {
        Ok(Ok(())) => tracing::info!(id, %address, "told the removed replica it was removed"),
        Ok(Err(e)) => tracing::info!(
            id, %address, error = %e,
            "could not tell the removed replica it was removed; it will learn it from its peers if it comes back"
        ),
        Err(_) => tracing::info!(
            id, %address,
            "the removed replica did not take the notice in time; it will learn it from its peers if it comes back"
        ),
    }
}

/// Watches for word that this replica was removed (see `raft::peers`) and, once a report
/// holds up against its own log, shuts its Raft down so that it never campaigns, and says why
/// in its log.
///
/// Its own log alone is no evidence: a replica that joins again under an id used before
/// replays, entry by entry, memberships that exclude it before the one that adds it back.
/// (A leader that removes itself stops in `remove`.)
pub fn spawn_watcher(r: Arc<Replica>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            r.peers.reported().await;
            let m = r.raft.metrics().borrow().clone();
            let own = &m.membership_config;
            let own_index = own.log_id().map(|l| l.index);
            let includes_self = own.membership().get_node(&r.id).is_some();
            for report in r.peers.take_reports() {
                if includes_self && own_index.is_some_and(|i| i >= report.log_index) {
                    tracing::info!(
                        log_index = report.log_index,
                        own_membership_index = own_index,
                        how = %report.how,
                        "ignoring word that this replica was removed: its own log has a membership as late that includes it"
                    );
                    continue;
                }
                stop_removed(&r, report).await;
                return;
            }
        }
    })
}

async fn stop_removed(r: &Replica, removal: Removal) {
    let (log_index, how) = (removal.log_index, removal.how.clone());
    if !r.peers.set_removed(removal) {
        return;
    }
    tracing::warn!(
        id = r.id,
        log_index,
        "this replica (id {}) was removed from cluster {:?} at log index {log_index} ({how}); it will not campaign and serves nothing from now on. To bring it back, stop it, wipe its data directory and `gpuctl cluster add` it again",
        r.id,
        r.cluster
    );
    if let Err(e) = r.raft.shutdown().await {
        tracing::warn!(%e, "stopping Raft after the removal failed");
    }
}

/// Whether a majority of every configuration of `membership` answers this replica now.
fn hears_from_quorum(
    r: &Replica,
    membership: &openraft::Membership<NodeId, openraft::BasicNode>,
) -> bool {
    membership.get_joint_config().iter().all(|voters| {
        let alive = voters.iter().filter(|v| live(r, **v)).count();
        alive > voters.len() / 2
    })
}

/// What a member's binary is, as far as this replica knows (itself: its own).
fn member_binary(r: &Replica, id: NodeId) -> pb::Member {
    let binary = if id == r.id {
        Some(PeerBinary::this())
    } else {
        r.peers.binary(id)
    };
    binary
        .map(|b| pb::Member {
            release: b.release_text(),
            format_max: b.format_max,
            ..Default::default()
        })
        .unwrap_or_default()
}

/// The answer to `ClusterStatus` from this replica.
pub fn status(r: &Replica) -> pb::ClusterStatusResponse {
    let m = r.raft.metrics().borrow().clone();
    let membership = m.membership_config.membership();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    let removed = r.removed();
    let leading =
        removed.is_none() && m.state == ServerState::Leader && m.current_leader == Some(r.id);
    let last = m.last_log_index.unwrap_or(0);
    let matched: BTreeMap<NodeId, u64> = m
        .replication
        .as_ref()
        .map(|rep| {
            rep.iter()
                .map(|(id, log)| (*id, log.map(|l| l.index).unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    let members = membership
        .nodes()
        .map(|(id, node)| {
            let me = *id == r.id;
            let matched_index = if me {
                last
            } else {
                matched.get(id).copied().unwrap_or(0)
            };
            pb::Member {
                id: *id,
                address: node.addr.clone(),
                role: if voters.contains(id) {
                    "voter"
                } else {
                    "learner"
                }
                .to_owned(),
                matched_index,
                reachable: if me {
                    removed.is_none()
                } else {
                    r.peers.reachable(*id)
                },
                last_contact_ms_ago: if me {
                    Some(0)
                } else {
                    r.peers
                        .contact(*id)
                        .last_ok
                        .map(|t| t.elapsed().as_millis() as u64)
                },
                lag: if leading {
                    last.saturating_sub(matched_index)
                } else {
                    0
                },
                ..member_binary(r, *id)
            }
        })
        .collect();
    // The leader as known now: this replica while it hears from a quorum, or the leader it
    // heard from within the window; never one it has not heard from since an election.
    let leader = match m.current_leader {
        _ if removed.is_some() => 0,
        Some(l) if l == r.id && leading && hears_from_quorum(r, membership) => l,
        Some(l) if l != r.id && r.peers.reachable(l) => l,
        _ => 0,
    };
    let data = r.sm.read();
    pb::ClusterStatusResponse {
        cluster: r.cluster.clone(),
        id: r.id,
        leader,
        term: m.current_term,
        commit_index: r.commit_index(),
        applied_index: m.last_applied.map(|l| l.index).unwrap_or(0),
        last_log_index: last,
        snapshot_index: m.snapshot.map(|l| l.index).unwrap_or(0),
        state: if removed.is_some() {
            "removed".to_owned()
        } else {
            format!("{:?}", m.state).to_lowercase()
        },
        members,
        cluster_version: data.cluster.cluster_version.0,
        release: crate::state::format::RELEASE.to_owned(),
        cluster_version_pending: match leading.then(|| crate::leader::cluster_version::decision(r))
        {
            Some(crate::leader::cluster_version::Decision::Wait(why)) => why,
            _ => String::new(),
        },
        jobs: data.cluster.jobs.len() as u64,
        nodes: data.cluster.nodes.len() as u64,
        security_enforced: r.security.enforced,
        certificates: r
            .security
            .certificates()
            .into_iter()
            .map(|(subject, not_after_ms)| pb::CertificateInfo {
                subject,
                not_after_ms,
            })
            .collect(),
        refusals: r
            .security
            .counters
            .snapshot()
            .into_iter()
            .chain(
                r.security
                    .tls
                    .as_ref()
                    .map(|t| ("tls_handshake", t.handshake_failures())),
            )
            .map(|(name, value)| pb::Counter {
                name: name.to_owned(),
                value,
            })
            .collect(),
        removed: removed.unwrap_or_default(),
        reachable_window_ms: r.peers.window().as_millis() as u64,
    }
}
