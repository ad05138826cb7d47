//! Desired (from the leader) against running (from the runtime), both ways: what to launch,
//! what to stop, and what waits for its start time (a service replica restarting after its
//! back-off). Pure, with the clock passed in, so every rule is table-tested.

use std::collections::{BTreeMap, BTreeSet};

use proto::agent::{Assignment, Assignments};

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Launch(Box<Assignment>),
    Stop(u64),
    /// The control plane wants it stopped but it never started here: report it stopped so
    /// its GPUs are released.
    Abandon(u64),
    /// Wanted, but not to be started before `until_ms` (ms since the Unix epoch, the leader's
    /// clock): launched by a later pass once due. A stop before then abandons it.
    Wait {
        id: u64,
        until_ms: u64,
    },
}

/// Fencing state: the newest (term, epoch) an assignment set came with.
#[derive(Debug, Default, Clone)]
pub struct Fence {
    pub term: u64,
    pub epoch: u64,
}

impl Fence {
    /// Whether a set may be acted on: never one from an older leader than one already obeyed,
    /// nor, from the same leader, one older than the newest allocation epoch already seen.
    pub fn admit(&mut self, set: &Assignments) -> bool {
        if (set.term, set.epoch) < (self.term, self.epoch) {
            return false;
        }
        self.term = set.term;
        self.epoch = set.epoch;
        true
    }
}

/// `live`: allocations whose processes run (or are stopping). `finished`: allocations that ran
/// on this node and ended; they are never started again, even if a set computed before their
/// exit report still lists them. `stopping`: allocations already being stopped. `now_ms`: this
/// host's clock, against which each assignment's `start_after_ms` is read (a host whose
/// clock runs behind the leader's starts a delayed replica that much later).
pub fn reconcile(
    desired: &Assignments,
    live: &BTreeSet<u64>,
    finished: &BTreeSet<u64>,
    stopping: &BTreeSet<u64>,
    now_ms: u64,
) -> Vec<Action> {
    let wanted: BTreeMap<u64, &Assignment> = desired
        .allocations
        .iter()
        .filter(|a| !a.stop)
        .map(|a| (a.allocation_id, a))
        .collect();
    let mut actions = Vec::new();
    for id in live {
        if !wanted.contains_key(id) && !stopping.contains(id) {
            actions.push(Action::Stop(*id));
        }
    }
    for (id, a) in &wanted {
        if live.contains(id) || finished.contains(id) {
            continue;
        }
        if a.start_after_ms > now_ms {
            actions.push(Action::Wait {
                id: *id,
                until_ms: a.start_after_ms,
            });
        } else {
            actions.push(Action::Launch(Box::new((*a).clone())));
        }
    }
    for a in desired.allocations.iter().filter(|a| a.stop) {
        let id = a.allocation_id;
        if !live.contains(&id) && !finished.contains(&id) {
            actions.push(Action::Abandon(id));
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(term: u64, ids: &[u64]) -> Assignments {
        Assignments {
            term,
            epoch: ids.iter().copied().max().unwrap_or(0),
            allocations: ids
                .iter()
                .map(|id| Assignment {
                    allocation_id: *id,
                    job_id: *id * 10,
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn ids(v: &[u64]) -> BTreeSet<u64> {
        v.iter().copied().collect()
    }

    #[test]
    fn launches_what_is_missing_and_stops_what_is_not_wanted() {
        let actions = reconcile(&set(1, &[1, 2]), &ids(&[2, 3]), &ids(&[]), &ids(&[]), 0);
        assert_eq!(actions.len(), 2);
        assert!(actions.contains(&Action::Stop(3)));
        assert!(matches!(&actions[1], Action::Launch(a) if a.allocation_id == 1));
    }

    #[test]
    fn an_allocation_to_stop_that_never_started_is_abandoned_and_a_running_one_stopped() {
        let mut s = set(1, &[7, 8]);
        for a in &mut s.allocations {
            a.stop = true;
        }
        let actions = reconcile(&s, &ids(&[8]), &ids(&[]), &ids(&[]), 0);
        assert_eq!(actions, vec![Action::Stop(8), Action::Abandon(7)]);
        assert!(reconcile(&s, &ids(&[]), &ids(&[7, 8]), &ids(&[]), 0).is_empty());
    }

    #[test]
    fn a_finished_allocation_is_never_started_again() {
        assert!(reconcile(&set(1, &[4]), &ids(&[]), &ids(&[4]), &ids(&[]), 0).is_empty());
    }

    #[test]
    fn a_stop_already_under_way_is_not_repeated() {
        assert!(reconcile(&set(1, &[]), &ids(&[5]), &ids(&[]), &ids(&[5]), 0).is_empty());
    }

    #[test]
    fn a_replica_waits_for_its_start_time_and_a_stop_before_then_abandons_it() {
        let mut s = set(1, &[3, 4]);
        s.allocations[0].start_after_ms = 5_000;
        let none = ids(&[]);
        // Not yet due: it waits (4, due at once, launches).
        let actions = reconcile(&s, &none, &none, &none, 4_999);
        assert_eq!(actions.len(), 2, "{actions:?}");
        assert_eq!(
            actions[0],
            Action::Wait {
                id: 3,
                until_ms: 5_000
            }
        );
        assert!(matches!(&actions[1], Action::Launch(a) if a.allocation_id == 4));
        // Due at its time exactly.
        let actions = reconcile(&s, &ids(&[4]), &none, &none, 5_000);
        assert!(
            matches!(actions.as_slice(), [Action::Launch(a)] if a.allocation_id == 3),
            "{actions:?}"
        );
        // Started already (e.g. before an agent restart): neither waits nor starts again.
        assert!(reconcile(&s, &ids(&[3, 4]), &none, &none, 0).is_empty());
        // Stopped before it was due: reported stopped, never started.
        s.allocations[0].stop = true;
        assert_eq!(
            reconcile(&s, &ids(&[4]), &none, &none, 0),
            vec![Action::Abandon(3)]
        );
    }

    #[test]
    fn sets_from_an_older_term_are_ignored() {
        let mut f = Fence::default();
        assert!(f.admit(&set(3, &[1])));
        assert!(!f.admit(&set(2, &[])));
        assert!(f.admit(&set(3, &[1])));
        assert!(f.admit(&set(4, &[])));
        assert_eq!(f.term, 4);
    }

    #[test]
    fn a_set_older_than_the_newest_epoch_of_the_same_leader_is_ignored() {
        let mut f = Fence::default();
        assert!(f.admit(&set(2, &[5, 7])));
        assert!(!f.admit(&set(2, &[5])), "epoch 5 < 7 from the same term");
        assert!(f.admit(&set(3, &[1])), "a newer leader decides anew");
    }
}
