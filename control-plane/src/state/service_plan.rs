//! Which replicas of one service to start and stop now: a pure function of the service's
//! settings and its live copies, run by `apply` whenever the service or one of its replicas
//! changes (`service_apply.rs`). Nothing here reads the cluster; the caller describes each
//! copy ([`Copy`]) and carries out the steps.
//!
//! The rules, which every step keeps (and `service_plan` tests check exhaustively):
//!
//! - never more than `replicas + max_surge` copies, counting copies still stopping;
//! - never two copies of one ordinal: an ordinal is reused only once its copy has stopped;
//! - during a rollout, a ready copy is stopped only while at least `replicas -
//!   max_unavailable` copies stay ready (unready old copies are stopped first: they serve
//!   nobody);
//! - a scale-down stops first the copies that serve nobody (not placed, then not ready), then
//!   those whose removal frees whole GPUs, so fractional replicas are consolidated rather than
//!   left scattered over half-used GPUs.

use super::service::{Ordinal, RolloutPhase};
use super::types::JobId;

/// Where one live copy of a service stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Not placed yet (or waiting to be placed again after its node was lost).
    Pending,
    /// Placed: starting, restarting, or running but not (yet) ready.
    Starting,
    Ready,
    /// Told to stop; its ordinal is taken until it has.
    Stopping,
}

/// One live copy, as the planner needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    pub ordinal: Ordinal,
    pub job: JobId,
    pub revision: u64,
    pub phase: Phase,
    /// Failed often enough in a row to count as crash-looping.
    pub crash_looping: bool,
    /// Whole GPUs that would become free if it stopped (a share alone on its GPU frees one;
    /// a share beside others frees none).
    pub frees_whole_gpus: u32,
}

/// The service's settings the planner reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub replicas: u32,
    pub max_surge: u32,
    pub max_unavailable: u32,
    /// The current revision: copies of any other are old.
    pub revision: u64,
    pub paused: bool,
    pub deleting: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopWhy {
    /// More copies of the current revision than wanted.
    ScaleDown,
    /// An old revision's copy, replaced by the rollout.
    Replaced,
    /// The service is being deleted.
    Deleted,
}

impl StopWhy {
    pub fn text(self) -> &'static str {
        match self {
            StopWhy::ScaleDown => "scaled down",
            StopWhy::Replaced => "replaced by a newer revision",
            StopWhy::Deleted => "service deleted",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Start {
        ordinal: Ordinal,
        revision: u64,
    },
    Stop {
        ordinal: Ordinal,
        job: JobId,
        why: StopWhy,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub steps: Vec<Step>,
    /// Where the rollout stands once the steps are taken.
    pub rollout: RolloutPhase,
}

/// Decides the steps for one service. `copies` are its live copies, in any order, each
/// ordinal at most once.
pub fn plan(s: &Settings, copies: &[Copy]) -> Decision {
    let mut steps = Vec::new();
    let live: Vec<&Copy> = copies
        .iter()
        .filter(|c| c.phase != Phase::Stopping)
        .collect();
    if s.deleting {
        for c in &live {
            steps.push(Step::Stop {
                ordinal: c.ordinal,
                job: c.job,
                why: StopWhy::Deleted,
            });
        }
        return Decision {
            steps,
            rollout: RolloutPhase::Progressing,
        };
    }
    let n = s.replicas as usize;
    let total = copies.len();
    let mut current: Vec<&Copy> = live
        .iter()
        .copied()
        .filter(|c| c.revision == s.revision)
        .collect();
    let old: Vec<&Copy> = live
        .iter()
        .copied()
        .filter(|c| c.revision != s.revision)
        .collect();
    let mut ready = live.iter().filter(|c| c.phase == Phase::Ready).count();
    let min_ready = n.saturating_sub(s.max_unavailable as usize);

    // A scale-down: copies of the current revision beyond the count, those serving nobody
    // first, then those freeing whole GPUs, then the highest ordinals.
    if current.len() > n {
        current.sort_by_key(|c| {
            (
                c.phase != Phase::Pending,
                c.phase == Phase::Ready,
                std::cmp::Reverse(c.frees_whole_gpus),
                std::cmp::Reverse(c.ordinal),
            )
        });
        let surplus = current.len() - n;
        for c in current.drain(..surplus) {
            if c.phase == Phase::Ready {
                ready -= 1;
            }
            steps.push(Step::Stop {
                ordinal: c.ordinal,
                job: c.job,
                why: StopWhy::ScaleDown,
            });
        }
    }

    // New copies: of the current revision, up to the count, within the surge. A paused
    // rollout only replaces missing copies (never more than the count in all).
    let mut used: Vec<Ordinal> = copies.iter().map(|c| c.ordinal).collect();
    used.sort_unstable();
    let live_after_stops = live.len() - steps.len();
    let want = if s.paused {
        n.saturating_sub(live_after_stops)
    } else {
        n.saturating_sub(current.len())
    };
    let room = (n + s.max_surge as usize).saturating_sub(total);
    for _ in 0..want.min(room) {
        let ordinal = lowest_free(&used);
        let at = used.partition_point(|&o| o < ordinal);
        used.insert(at, ordinal);
        steps.push(Step::Start {
            ordinal,
            revision: s.revision,
        });
    }

    // Old copies: those not ready first (they serve nobody), then ready ones while enough
    // stay ready. Crash-looping copies of the current revision pause the rollout instead.
    let rollout_failing = !old.is_empty()
        && current
            .iter()
            .any(|c| c.crash_looping && c.revision == s.revision);
    if !s.paused && !rollout_failing {
        let mut old_sorted = old.clone();
        old_sorted.sort_by_key(|c| (c.phase == Phase::Ready, c.ordinal));
        for c in old_sorted {
            if c.phase == Phase::Ready {
                if ready <= min_ready {
                    break;
                }
                ready -= 1;
            }
            steps.push(Step::Stop {
                ordinal: c.ordinal,
                job: c.job,
                why: StopWhy::Replaced,
            });
        }
    }

    let rollout = if rollout_failing {
        let c = current
            .iter()
            .find(|c| c.crash_looping)
            .expect("rollout_failing found one");
        RolloutPhase::Paused {
            reason: format!(
                "replica {} of revision {} is crash-looping",
                c.ordinal, c.revision
            ),
        }
    } else if s.paused {
        RolloutPhase::Paused {
            reason: String::new(),
        }
    } else if steps.is_empty()
        && old.is_empty()
        && current.len() == n
        && current.iter().all(|c| c.phase == Phase::Ready)
    {
        RolloutPhase::Complete
    } else {
        RolloutPhase::Progressing
    };
    Decision { steps, rollout }
}

/// The lowest ordinal not in `used` (sorted, distinct).
fn lowest_free(used: &[Ordinal]) -> Ordinal {
    let mut want = 0;
    for &o in used {
        if o > want {
            break;
        }
        if o == want {
            want += 1;
        }
    }
    want
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(ordinal: Ordinal, revision: u64, phase: Phase) -> Copy {
        Copy {
            ordinal,
            job: 100 + u64::from(ordinal),
            revision,
            phase,
            crash_looping: false,
            frees_whole_gpus: 0,
        }
    }

    fn settings(replicas: u32, surge: u32, unavailable: u32, revision: u64) -> Settings {
        Settings {
            replicas,
            max_surge: surge,
            max_unavailable: unavailable,
            revision,
            paused: false,
            deleting: false,
        }
    }

    fn starts(d: &Decision) -> Vec<Ordinal> {
        d.steps
            .iter()
            .filter_map(|s| match s {
                Step::Start { ordinal, .. } => Some(*ordinal),
                _ => None,
            })
            .collect()
    }

    fn stops(d: &Decision) -> Vec<Ordinal> {
        d.steps
            .iter()
            .filter_map(|s| match s {
                Step::Stop { ordinal, .. } => Some(*ordinal),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_new_service_starts_every_replica_at_the_lowest_ordinals() {
        let d = plan(&settings(3, 1, 0, 1), &[]);
        assert_eq!(starts(&d), [0, 1, 2]);
        assert_eq!(d.rollout, RolloutPhase::Progressing);
    }

    #[test]
    fn a_missing_ordinal_is_filled_first() {
        let copies = [copy(0, 1, Phase::Ready), copy(2, 1, Phase::Ready)];
        assert_eq!(starts(&plan(&settings(3, 1, 0, 1), &copies)), [1]);
    }

    #[test]
    fn a_stopping_copy_keeps_its_ordinal_and_counts_toward_the_surge() {
        // Replicas 2, surge 0, unavailable 1: ordinal 0 is still stopping.
        let copies = [copy(0, 1, Phase::Stopping), copy(1, 2, Phase::Ready)];
        let d = plan(&settings(2, 0, 1, 2), &copies);
        assert!(starts(&d).is_empty(), "no room until ordinal 0 has stopped");
        let copies = [copy(1, 2, Phase::Ready)];
        assert_eq!(starts(&plan(&settings(2, 0, 1, 2), &copies)), [0]);
    }

    #[test]
    fn all_ready_at_the_current_revision_is_complete() {
        let copies = [copy(0, 3, Phase::Ready), copy(1, 3, Phase::Ready)];
        let d = plan(&settings(2, 1, 0, 3), &copies);
        assert!(d.steps.is_empty());
        assert_eq!(d.rollout, RolloutPhase::Complete);
    }

    #[test]
    fn a_surge_rollout_starts_a_new_copy_before_it_stops_an_old_one() {
        let old: Vec<Copy> = (0..4).map(|o| copy(o, 1, Phase::Ready)).collect();
        let d = plan(&settings(4, 1, 0, 2), &old);
        assert_eq!(starts(&d), [4]);
        assert!(stops(&d).is_empty(), "nothing may go unready");
        let mut now = old.clone();
        now.push(copy(4, 2, Phase::Ready));
        let d = plan(&settings(4, 1, 0, 2), &now);
        assert_eq!(stops(&d), [0], "the new copy is ready: one old copy goes");
        assert!(starts(&d).is_empty(), "5 copies: no room");
    }

    #[test]
    fn without_surge_an_old_copy_stops_first_and_its_ordinal_is_reused() {
        let old: Vec<Copy> = (0..3).map(|o| copy(o, 1, Phase::Ready)).collect();
        let d = plan(&settings(3, 0, 1, 2), &old);
        assert_eq!(stops(&d), [0]);
        assert!(starts(&d).is_empty());
        let after: Vec<Copy> = (1..3).map(|o| copy(o, 1, Phase::Ready)).collect();
        assert_eq!(starts(&plan(&settings(3, 0, 1, 2), &after)), [0]);
    }

    #[test]
    fn unready_old_copies_go_first_and_cost_no_availability() {
        let copies = [
            copy(0, 1, Phase::Ready),
            copy(1, 1, Phase::Starting),
            copy(2, 1, Phase::Pending),
        ];
        let d = plan(&settings(3, 0, 1, 2), &copies);
        // Ready: 1, min ready 2: the ready one stays; both unready ones go.
        assert_eq!(stops(&d), [1, 2]);
    }

    #[test]
    fn a_scale_down_removes_the_copies_serving_nobody_then_those_freeing_whole_gpus() {
        let mut copies = vec![
            copy(0, 1, Phase::Ready),
            copy(1, 1, Phase::Ready),
            copy(2, 1, Phase::Ready),
            copy(3, 1, Phase::Starting),
        ];
        copies[1].frees_whole_gpus = 1;
        let d = plan(&settings(2, 1, 0, 1), &copies);
        assert_eq!(stops(&d), [3, 1]);
        assert!(starts(&d).is_empty());
        assert!(d.steps.iter().all(|s| matches!(
            s,
            Step::Stop {
                why: StopWhy::ScaleDown,
                ..
            }
        )));
    }

    #[test]
    fn a_crash_looping_new_revision_pauses_the_rollout_and_keeps_the_old_copies() {
        let mut copies: Vec<Copy> = (0..4).map(|o| copy(o, 1, Phase::Ready)).collect();
        let mut bad = copy(4, 2, Phase::Starting);
        bad.crash_looping = true;
        copies.push(bad);
        let d = plan(&settings(4, 1, 0, 2), &copies);
        assert!(stops(&d).is_empty());
        assert!(
            matches!(d.rollout, RolloutPhase::Paused { ref reason } if reason.contains("replica 4 of revision 2"))
        );
    }

    #[test]
    fn a_paused_rollout_only_replaces_missing_copies() {
        let copies = [copy(0, 1, Phase::Ready), copy(1, 2, Phase::Ready)];
        let mut s = settings(3, 1, 0, 2);
        s.paused = true;
        let d = plan(&s, &copies);
        assert_eq!(starts(&d), [2]);
        assert!(stops(&d).is_empty());
        let full = [copies[0], copies[1], copy(2, 2, Phase::Ready)];
        assert!(plan(&s, &full).steps.is_empty());
    }

    #[test]
    fn deleting_stops_every_live_copy() {
        let copies = [copy(0, 1, Phase::Ready), copy(1, 1, Phase::Stopping)];
        let mut s = settings(2, 1, 0, 1);
        s.deleting = true;
        assert_eq!(stops(&plan(&s, &copies)), [0]);
    }

    /// Every rule, over every small service: up to 4 replicas, surge and unavailability 0..=2,
    /// up to 5 copies of two revisions in any phase. Following the steps never breaks a rule,
    /// and a cluster that carries out the steps (copies become ready, stopped ones go away)
    /// reaches a complete rollout.
    #[test]
    fn exhaustively_the_rules_hold_and_every_rollout_completes() {
        let phases = [
            Phase::Pending,
            Phase::Starting,
            Phase::Ready,
            Phase::Stopping,
        ];
        let mut checked = 0;
        for n in 0..=4u32 {
            for surge in 0..=2u32 {
                for unavailable in 0..=2u32 {
                    if surge == 0 && unavailable == 0 {
                        continue;
                    }
                    let s = settings(n, surge, unavailable, 2);
                    // Copies: each of 5 ordinals absent or (revision, phase).
                    let per_slot = 1 + 2 * phases.len();
                    for code in 0..per_slot.pow(5) {
                        let mut copies = Vec::new();
                        let mut c = code;
                        for ordinal in 0..5 {
                            let slot = c % per_slot;
                            c /= per_slot;
                            if slot == 0 {
                                continue;
                            }
                            let revision = 1 + ((slot - 1) / phases.len()) as u64;
                            let phase = phases[(slot - 1) % phases.len()];
                            copies.push(copy(ordinal, revision, phase));
                        }
                        if copies.len() > (n + surge) as usize {
                            continue; // a state the rules never reach
                        }
                        check_rules(&s, &copies);
                        checked += 1;
                    }
                    // From a full old revision, the rollout completes.
                    let start: Vec<Copy> = (0..n).map(|o| copy(o, 1, Phase::Ready)).collect();
                    drive_to_completion(&s, start);
                }
            }
        }
        assert!(checked > 100_000, "checked {checked} states");
    }

    fn check_rules(s: &Settings, copies: &[Copy]) {
        let d = plan(s, copies);
        let n = s.replicas as usize;
        let mut ordinals: Vec<Ordinal> = copies.iter().map(|c| c.ordinal).collect();
        let ready_before = copies.iter().filter(|c| c.phase == Phase::Ready).count();
        let mut ready = ready_before;
        let mut total = copies.len();
        for step in &d.steps {
            match *step {
                Step::Start { ordinal, revision } => {
                    assert!(
                        !ordinals.contains(&ordinal),
                        "{s:?} {copies:?}: ordinal {ordinal} reused while live"
                    );
                    assert_eq!(revision, s.revision);
                    ordinals.push(ordinal);
                    total += 1;
                }
                Step::Stop { ordinal, job, why } => {
                    let c = copies
                        .iter()
                        .find(|c| c.ordinal == ordinal)
                        .expect("stops a copy that exists");
                    assert_eq!(c.job, job);
                    assert_ne!(c.phase, Phase::Stopping, "stopped twice");
                    if c.phase == Phase::Ready {
                        ready -= 1;
                        if why == StopWhy::Replaced {
                            assert!(
                                ready >= n.saturating_sub(s.max_unavailable as usize),
                                "{s:?} {copies:?}: availability broken by {step:?}"
                            );
                        }
                    }
                }
            }
        }
        assert!(
            total <= n + s.max_surge as usize
                || d.steps.iter().all(|s| !matches!(s, Step::Start { .. })),
            "{s:?} {copies:?}: more than replicas + surge"
        );
        let _ = ready_before;
    }

    /// Carries out the planner's steps round by round: a started copy is ready next round, a
    /// stopped one is gone the round after.
    fn drive_to_completion(s: &Settings, mut copies: Vec<Copy>) {
        let n = s.replicas as usize;
        let min_ready = n.saturating_sub(s.max_unavailable as usize);
        for round in 0..200 {
            // Advance the world: stopping copies go, starting copies become ready.
            copies.retain(|c| c.phase != Phase::Stopping);
            for c in &mut copies {
                if c.phase == Phase::Starting || c.phase == Phase::Pending {
                    c.phase = Phase::Ready;
                }
            }
            let d = plan(s, &copies);
            if d.rollout == RolloutPhase::Complete {
                assert_eq!(copies.len(), n);
                return;
            }
            for step in d.steps {
                match step {
                    Step::Start { ordinal, revision } => copies.push(Copy {
                        ordinal,
                        job: 1000 + round,
                        revision,
                        phase: Phase::Pending,
                        crash_looping: false,
                        frees_whole_gpus: 0,
                    }),
                    Step::Stop { ordinal, .. } => {
                        if let Some(c) = copies.iter_mut().find(|c| c.ordinal == ordinal) {
                            c.phase = Phase::Stopping;
                        }
                    }
                }
            }
            let ready = copies.iter().filter(|c| c.phase == Phase::Ready).count();
            assert!(
                ready >= min_ready.min(n),
                "{s:?}: round {round}: {ready} ready, below {min_ready}"
            );
            assert!(copies.len() <= n + s.max_surge as usize);
        }
        panic!("{s:?}: the rollout never completed: {copies:?}");
    }
}
