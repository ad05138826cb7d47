//! Raising the cluster version (`state::format`) once every member can follow it, as
//! Consul's autopilot finishes an upgrade or Kubernetes enables a gated feature once every API
//! server knows it.
//!
//! Every member must answer now and have said which formats its binary reads (each Raft RPC
//! carries it: `raft::peers::PeerBinary`). A member that is down is waited for, not assumed:
//! it may come back on the old binary, and it could not read what the new format writes. Once
//! raised, the version is never lowered, so a replica can no longer be rolled back to a release
//! that does not read it (docs/UPGRADING.md).

use crate::raft::NodeId;
use crate::raft::peers::PeerBinary;
use crate::replica::{ApiError, Replica};
use crate::state::format::FormatVersion;
use crate::state::{Command, Outcome};

/// What the leader should do about the cluster version now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Every member reads this newer format: propose `SetClusterVersion`.
    Raise(FormatVersion),
    /// A newer format is possible but not yet safe; why, for the log and `cluster status`.
    Wait(String),
    /// The cluster writes the newest format this leader's binary knows, or the newest that
    /// every member reads.
    Stay,
}

/// One member as the leader sees it.
#[derive(Debug, Clone)]
pub struct MemberView {
    pub id: NodeId,
    /// What it last said its binary is; `None` if it never answered this leader.
    pub binary: Option<PeerBinary>,
    /// It answers now.
    pub reachable: bool,
}

/// Decides from the applied cluster version `current`, the leader's own binary and every
/// other member (voters and learners alike: a learner is promoted without a check).
pub fn decide(current: FormatVersion, leader: &PeerBinary, others: &[MemberView]) -> Decision {
    if leader.format_max <= current {
        return Decision::Stay;
    }
    let mut target = leader.format_max;
    for member in others {
        let Some(binary) = member.binary.as_ref().filter(|_| member.reachable) else {
            return Decision::Wait(format!(
                "replica {} does not answer, and could come back on a release that does not read format {}",
                member.id, leader.format_max
            ));
        };
        target = target.min(binary.format_max);
    }
    if target > current {
        return Decision::Raise(target);
    }
    let behind: Vec<String> = others
        .iter()
        .filter_map(|m| {
            let b = m.binary.as_ref()?;
            (b.format_max <= current).then(|| format!("replica {} runs {}", m.id, b.release_text()))
        })
        .collect();
    Decision::Wait(format!(
        "{}; upgrade it to release {} to move the cluster to format {}",
        behind.join(", "),
        leader.release_text(),
        leader.format_max
    ))
}

/// Every member but `r` itself, as `r` sees it now.
pub fn others(r: &Replica) -> Vec<MemberView> {
    let metrics = r.raft.metrics().borrow().clone();
    metrics
        .membership_config
        .membership()
        .nodes()
        .map(|(id, _)| *id)
        .filter(|id| *id != r.id)
        .map(|id| MemberView {
            id,
            binary: r.peers.binary(id),
            reachable: r.peers.reachable(id),
        })
        .collect()
}

/// What `r`, leading, would decide now.
pub fn decision(r: &Replica) -> Decision {
    decide(r.sm.cluster_version(), &PeerBinary::this(), &others(r))
}

/// Proposes the raise when it is due. `last_wait` keeps the last reason for waiting, so that
/// it is logged when it changes rather than on every check.
pub async fn raise_when_due(r: &Replica, last_wait: &mut Option<String>) -> Result<(), ApiError> {
    match decision(r) {
        Decision::Stay => Ok(()),
        Decision::Wait(why) => {
            if last_wait.as_deref() != Some(why.as_str()) {
                tracing::info!(
                    cluster_version = r.sm.cluster_version(),
                    "cluster version not raised yet: {why}"
                );
                *last_wait = Some(why);
            }
            Ok(())
        }
        Decision::Raise(version) => {
            let from = r.sm.cluster_version();
            match r.write(Command::SetClusterVersion { version }).await? {
                Outcome::Rejected(why) => {
                    tracing::warn!(
                        from,
                        to = version,
                        "raising the cluster version was refused: {why:?}"
                    )
                }
                _ => tracing::info!(
                    from,
                    to = version,
                    "cluster version raised: every member reads the new format"
                ),
            }
            *last_wait = None;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binary(format_max: FormatVersion, release: &str) -> PeerBinary {
        PeerBinary {
            format_max,
            release: release.into(),
        }
    }

    fn member(id: NodeId, b: Option<PeerBinary>, reachable: bool) -> MemberView {
        MemberView {
            id,
            binary: b,
            reachable,
        }
    }

    #[test]
    fn raises_once_every_member_reads_the_new_format() {
        let new = binary(2, "0.2.0");
        let others = [
            member(2, Some(new.clone()), true),
            member(3, Some(new.clone()), true),
        ];
        assert_eq!(decide(1, &new, &others), Decision::Raise(2));
        assert_eq!(decide(2, &new, &others), Decision::Stay);
    }

    #[test]
    fn a_single_replica_cluster_raises_at_once() {
        assert_eq!(decide(1, &binary(2, "0.2.0"), &[]), Decision::Raise(2));
    }

    #[test]
    fn waits_for_an_old_binary_and_names_it() {
        let new = binary(2, "0.2.0");
        let others = [
            member(2, Some(new.clone()), true),
            member(3, Some(binary(1, "")), true),
        ];
        let Decision::Wait(why) = decide(1, &new, &others) else {
            panic!("raised with an old member");
        };
        assert!(why.contains("replica 3 runs before 0.2"), "{why}");
        assert!(why.contains("upgrade it to release 0.2.0"), "{why}");
    }

    #[test]
    fn waits_for_a_member_that_does_not_answer_or_never_said() {
        let new = binary(2, "0.2.0");
        for others in [
            vec![member(2, Some(new.clone()), false)],
            vec![member(2, None, true)],
            vec![member(2, None, false)],
        ] {
            assert!(
                matches!(decide(1, &new, &others), Decision::Wait(w) if w.contains("replica 2 does not answer")),
                "{others:?}"
            );
        }
    }

    #[test]
    fn raises_only_as_far_as_the_oldest_member_reads() {
        let newest = binary(4, "0.4.0");
        let others = [
            member(2, Some(binary(3, "0.3.0")), true),
            member(3, Some(newest.clone()), true),
        ];
        assert_eq!(decide(2, &newest, &others), Decision::Raise(3));
        assert!(matches!(decide(3, &newest, &others), Decision::Wait(_)));
    }

    #[test]
    fn a_leader_on_an_older_binary_never_raises() {
        // A leader that reads less than the cluster already writes cannot be leading (it
        // could not have applied the log), but it must not try either way.
        let old = binary(1, "");
        assert_eq!(decide(2, &old, &[]), Decision::Stay);
        assert_eq!(decide(1, &old, &[]), Decision::Stay);
    }
}
