//! The cluster version: raised only, never past what this binary reads, and the fields and
//! commands of a format kept out of the state until the version reaches it.

use super::*;
use crate::state::format::{self, ClusterVersion};

#[test]
fn a_new_state_is_at_format_1_until_a_leader_raises_it() {
    let mut h = Harness::new();
    assert_eq!(h.state.cluster_version, ClusterVersion(format::LEGACY));
    assert_eq!(
        h.apply(Command::SetClusterVersion { version: 2 }).outcome,
        Outcome::Done
    );
    assert_eq!(h.state.cluster_version, ClusterVersion(2));
    // Raising to where it is already changes nothing and is no error.
    assert_eq!(
        h.apply(Command::SetClusterVersion { version: 2 }).outcome,
        Outcome::Done
    );
}

#[test]
fn the_cluster_version_is_never_lowered_nor_raised_past_this_binary() {
    let mut h = Harness::new();
    h.apply(Command::SetClusterVersion {
        version: format::CURRENT,
    });
    let r = h.reject(Command::SetClusterVersion {
        version: format::LEGACY,
    });
    assert!(r.message.contains("never lowered"), "{}", r.message);
    let r = h.reject(Command::SetClusterVersion {
        version: format::CURRENT + 1,
    });
    assert!(
        r.message.contains("newer than this release"),
        "{}",
        r.message
    );
}

/// A format-1 replica would drop the agent's release: every replica drops it until the
/// version says every binary keeps it, so their states stay equal.
#[test]
fn an_agents_release_is_recorded_only_from_format_2() {
    let mut h = Harness::new();
    let mut spec = node("n1", 2, "H100").spec();
    spec.agent_release = "0.2.0".into();
    h.register(spec.clone());
    assert_eq!(h.state.nodes["n1"].spec.agent_release, "");
    h.apply(Command::SetClusterVersion { version: 2 });
    h.register(spec);
    assert_eq!(h.state.nodes["n1"].spec.agent_release, "0.2.0");
}

#[test]
fn a_command_of_a_newer_format_is_refused_below_it_whole_batch_and_all() {
    // Every command kind this release has is in format 1 or is the raise itself; check the
    // gate on the raise's own rule and on a batch that carries something gated.
    let gated = Command::SetClusterVersion { version: 2 };
    assert_eq!(gated.introduced_in(), 2);
    let batch = Command::Batch {
        commands: vec![Command::cancel(1, "x"), gated.clone()],
    };
    assert_eq!(batch.introduced_in(), 2);
    assert!(
        Command::cancel(1, "x")
            .check_allowed_at(ClusterVersion(format::LEGACY))
            .is_ok()
    );
    // The raise is exempt: it is what moves the version.
    assert!(
        gated
            .check_allowed_at(ClusterVersion(format::LEGACY))
            .is_ok()
    );
    let r = batch
        .check_allowed_at(ClusterVersion(format::LEGACY))
        .unwrap_err();
    assert!(
        r.message.contains("needs cluster version 2"),
        "{}",
        r.message
    );
    assert!(batch.check_allowed_at(ClusterVersion(2)).is_ok());
}

#[test]
fn the_cluster_version_survives_a_snapshot_and_is_absent_at_format_1() {
    let mut h = Harness::new();
    let legacy = serde_json::to_value(&h.state).unwrap();
    assert!(legacy.get("cluster_version").is_none(), "{legacy}");
    h.apply(Command::SetClusterVersion { version: 2 });
    let json = serde_json::to_vec(&h.state).unwrap();
    let back: ClusterState = serde_json::from_slice(&json).unwrap();
    assert_eq!(back.cluster_version, ClusterVersion(2));
}
