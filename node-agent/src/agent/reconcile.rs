//! Desired (from the leader) against running (from the runtime), both ways: what to launch and
//! what to stop. Pure, so every rule is table-tested.

use std::collections::{BTreeMap, BTreeSet};

use proto::agent::{Assignment, Assignments};

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Launch(Box<Assignment>),
    Stop(u64),
    /// The control plane wants it stopped but it never started here: report it stopped so
    /// its GPUs are released.
    Abandon(u64),
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
/// exit report still lists them. `stopping`: allocations already being stopped.
pub fn reconcile(
    desired: &Assignments,
    live: &BTreeSet<u64>,
    finished: &BTreeSet<u64>,
    stopping: &BTreeSet<u64>,
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
        if !live.contains(id) && !finished.contains(id) {
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
        let actions = reconcile(&set(1, &[1, 2]), &ids(&[2, 3]), &ids(&[]), &ids(&[]));
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
        let actions = reconcile(&s, &ids(&[8]), &ids(&[]), &ids(&[]));
        assert_eq!(actions, vec![Action::Stop(8), Action::Abandon(7)]);
        assert!(reconcile(&s, &ids(&[]), &ids(&[7, 8]), &ids(&[])).is_empty());
    }

    #[test]
    fn a_finished_allocation_is_never_started_again() {
        assert!(reconcile(&set(1, &[4]), &ids(&[]), &ids(&[4]), &ids(&[])).is_empty());
    }

    #[test]
    fn a_stop_already_under_way_is_not_repeated() {
        assert!(reconcile(&set(1, &[]), &ids(&[5]), &ids(&[]), &ids(&[5])).is_empty());
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
