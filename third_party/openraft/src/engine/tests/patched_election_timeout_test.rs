//! PATCHED 8 and 9 (PATCHED.md): the election timeout is drawn again at every change of
//! vote, and a split vote is retried after a shorter draw.

use std::sync::Arc;
use std::time::Duration;

use maplit::btreeset;

use crate::core::ServerState;
use crate::engine::testing::UTConfig;
use crate::engine::Engine;
use crate::engine::LogIdList;
use crate::raft::VoteResponse;
use crate::testing::log_id;
use crate::utime::UTime;
use crate::CommittedLeaderId;
use crate::EffectiveMembership;
use crate::LogId;
use crate::Membership;
use crate::TokioInstant;
use crate::Vote;

const RANGE_MS: (u64, u64) = (90, 150);

fn eng(range_ms: (u64, u64)) -> Engine<UTConfig> {
    let mut eng = Engine::<UTConfig>::default();
    eng.state.enable_validation(false);
    eng.state.log_ids = LogIdList::new([LogId::new(CommittedLeaderId::new(0, 0), 0)]);
    eng.config.id = 1;
    eng.config.timer_config.election_timeout_range_ms = range_ms;
    eng.config.timer_config.election_timeout = Duration::from_millis(range_ms.0);
    eng.state.membership_state.set_effective(Arc::new(EffectiveMembership::new(
        Some(log_id(1, 1, 1)),
        Membership::<u64, ()>::new(vec![btreeset! {1,2,3}], None),
    )));
    eng
}

/// Node 1, campaigning at term 2, has its own vote.
fn candidate_at_term_2(range_ms: (u64, u64)) -> Engine<UTConfig> {
    let mut eng = eng(range_ms);
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new(2, 1));
    let voting = eng.new_candidate(*eng.state.vote_ref());
    voting.grant_by(&1);
    eng.state.server_state = ServerState::Candidate;
    eng
}

/// A candidate at term 2 whose request node 2, itself campaigning at term 2, refused.
fn split_at_term_2(range_ms: (u64, u64)) -> Engine<UTConfig> {
    let mut eng = candidate_at_term_2(range_ms);
    eng.handle_vote_resp(2, VoteResponse::new(Vote::new(2, 2), Some(log_id(1, 1, 1)), false));
    eng
}

fn timeout_ms(eng: &Engine<UTConfig>) -> u64 {
    eng.config.timer_config.election_timeout.as_millis() as u64
}

#[test]
fn every_change_of_vote_draws_the_election_timeout_again_within_its_range() {
    let mut eng = eng(RANGE_MS);
    let mut drawn = std::collections::BTreeSet::new();
    for term in 1..=200 {
        eng.vote_handler().update_vote(&Vote::new(term, 2)).unwrap();
        let ms = timeout_ms(&eng);
        assert!((RANGE_MS.0..RANGE_MS.1).contains(&ms), "{ms} ms is outside {RANGE_MS:?}");
        drawn.insert(ms);
    }
    // 200 draws from 60 values: all equal only if nothing is drawn.
    assert!(drawn.len() > 10, "only {drawn:?} drawn");
}

#[test]
fn the_same_vote_again_keeps_the_timeout() {
    let mut eng = eng(RANGE_MS);
    eng.vote_handler().update_vote(&Vote::new_committed(3, 2)).unwrap();
    let before = timeout_ms(&eng);
    for _ in 0..50 {
        // A heartbeat from the same leader only touches the vote.
        eng.vote_handler().update_vote(&Vote::new_committed(3, 2)).unwrap();
        assert_eq!(before, timeout_ms(&eng));
    }
}

#[test]
fn a_split_vote_is_retried_after_a_draw_from_the_lower_part_of_the_range() {
    let floor = RANGE_MS.0 / 3;
    let spread = RANGE_MS.1 - RANGE_MS.0;
    for _ in 0..100 {
        let eng = split_at_term_2(RANGE_MS);
        // Votes of one term are ordered by node id: node 1 adopts node 2's and follows, but
        // nobody leads term 2, so it campaigns again soon.
        assert_eq!(Vote::new(2, 2), *eng.state.vote_ref());
        let ms = timeout_ms(&eng);
        assert!((floor..floor + spread).contains(&ms), "{ms} ms is outside the retry range");
    }
}

#[test]
fn a_refusal_by_a_granted_leader_or_from_a_greater_term_is_no_split() {
    let mut eng = candidate_at_term_2(RANGE_MS);
    // Node 2 follows a leader of term 2 (its lease refused us): a leader exists.
    eng.handle_vote_resp(2, VoteResponse::new(Vote::new_committed(2, 3), Some(log_id(1, 1, 1)), false));
    let ms = timeout_ms(&eng);
    assert!((RANGE_MS.0..RANGE_MS.1).contains(&ms), "{ms} ms is a split's retry");

    let mut eng = candidate_at_term_2(RANGE_MS);
    // A candidate of a greater term: the ordinary timeout (drawn anew, as the vote changed).
    eng.handle_vote_resp(2, VoteResponse::new(Vote::new(3, 2), Some(log_id(1, 1, 1)), false));
    assert_eq!(Vote::new(3, 2), *eng.state.vote_ref());
    let ms = timeout_ms(&eng);
    assert!((RANGE_MS.0..RANGE_MS.1).contains(&ms), "{ms} ms is a split's retry");
}

#[test]
fn a_fixed_timeout_is_left_alone() {
    // No range to draw from (the project's deterministic simulation): a split changes nothing,
    // as shortening every candidate's timeout alike would make them collide again.
    let eng = split_at_term_2((100, 101));
    assert_eq!(100, timeout_ms(&eng));
}
