//! The replica set as it changes during a run (`replica_add_remove`, `replica_upgrade`): the
//! endpoints the workload and the observer talk to, and the pure choices the two faults make
//! (which id a new replica gets, which replica is removed, which build a replica is restarted
//! on).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use control_plane::client::{Client, Credentials};

use crate::workload::Rng;

/// The addresses of the current members, shared by the fault injector (which changes them)
/// and every client of the run (which follow them). A generation number tells a client that
/// its list is out of date.
#[derive(Debug, Clone)]
pub struct Endpoints(Arc<Mutex<(u64, Vec<String>)>>);

impl Endpoints {
    pub fn new(addrs: Vec<String>) -> Endpoints {
        Endpoints(Arc::new(Mutex::new((0, addrs))))
    }

    pub fn set(&self, addrs: Vec<String>) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        g.1 = addrs;
    }

    /// (generation, addresses).
    pub fn get(&self) -> (u64, Vec<String>) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A client over the current members, with `client`'s timeouts, when the members changed
    /// since generation `seen` (which is updated); None when they did not.
    pub fn refreshed(
        &self,
        seen: &mut u64,
        client: &Client,
        credentials: &Credentials,
    ) -> Option<Client> {
        let (generation, addrs) = self.get();
        if generation == *seen {
            return None;
        }
        let mut fresh = Client::new(&addrs, credentials).ok()?;
        *seen = generation;
        fresh.deadline = client.deadline;
        fresh.attempt_timeout = client.attempt_timeout;
        fresh.retry_deadline_exceeded = client.retry_deadline_exceeded;
        Some(fresh)
    }
}

/// The id of a new replica: one above every id ever used in this run, removed ones included.
/// An id is never reused: a replica that joins under an id used before replays memberships
/// that exclude it (see `control-plane/src/membership.rs`), and the history names replicas by
/// id.
pub fn next_replica_id(ever_used: &BTreeSet<u64>) -> u64 {
    ever_used.iter().next_back().copied().unwrap_or(0) + 1
}

/// Which replica the `k`-th membership change (0-based) removes once `added` is a voter:
/// never the one just added; the leader on every other change, starting with the first
/// (removing the leader is the case that needs an election), otherwise a follower picked by
/// `rng`. None when there is no other member.
pub fn removal_target(
    k: usize,
    members: &[u64],
    leader: u64,
    added: u64,
    rng: &mut Rng,
) -> Option<u64> {
    if k.is_multiple_of(2) && leader != added && members.contains(&leader) {
        return Some(leader);
    }
    let followers: Vec<u64> = members
        .iter()
        .copied()
        .filter(|id| *id != leader && *id != added)
        .collect();
    if followers.is_empty() {
        return members.iter().copied().find(|id| *id != added);
    }
    Some(followers[rng.below(followers.len() as u64) as usize])
}

/// A build a replica can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// The previous release (`--previous-release DIR`).
    Previous,
    /// This tree's build (the chaos binary itself, or a fresh copy of it).
    Current,
}

/// The build a replica running `running` is restarted on by `replica_upgrade`:
/// previous -> current (the upgrade); current -> previous (a rollback, which makes the cluster
/// mixed again) only when the previous release is there, another member still runs it, and the
/// cluster version is still 1 (docs/UPGRADING.md: once raised it is never lowered, and an old
/// binary would stop on the first entry it cannot read); otherwise current -> a fresh copy of
/// current.
pub fn next_build(
    running: Build,
    have_previous: bool,
    others_run_previous: bool,
    cluster_version: u32,
) -> Build {
    match running {
        Build::Previous => Build::Current,
        Build::Current if have_previous && others_run_previous && cluster_version <= 1 => {
            Build::Previous
        }
        Build::Current => Build::Current,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn clients_follow_the_members_once_per_change() {
        let eps = Endpoints::new(vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()]);
        let creds = Credentials::insecure();
        let (mut seen, addrs) = eps.get();
        let mut client = Client::new(&addrs, &creds).unwrap();
        client.deadline = std::time::Duration::from_secs(7);
        assert!(eps.refreshed(&mut seen, &client, &creds).is_none());
        eps.set(vec!["127.0.0.1:2".into(), "127.0.0.1:3".into()]);
        let fresh = eps.refreshed(&mut seen, &client, &creds).unwrap();
        assert_eq!(fresh.endpoints(), ["127.0.0.1:2", "127.0.0.1:3"]);
        assert_eq!(fresh.deadline, client.deadline);
        assert!(eps.refreshed(&mut seen, &fresh, &creds).is_none());
    }

    #[test]
    fn new_ids_are_never_reused() {
        assert_eq!(next_replica_id(&BTreeSet::new()), 1);
        assert_eq!(next_replica_id(&BTreeSet::from([1, 2, 3])), 4);
        // Replica 4 was added and later removed: the next one is 5, not 4 again.
        assert_eq!(next_replica_id(&BTreeSet::from([1, 2, 3, 4])), 5);
        assert_eq!(next_replica_id(&BTreeSet::from([2, 7])), 8);
    }

    #[test]
    fn every_other_change_removes_the_leader_never_the_new_replica() {
        let mut rng = Rng::new(1);
        let members = [1, 2, 3, 4];
        assert_eq!(removal_target(0, &members, 2, 4, &mut rng), Some(2));
        assert_eq!(removal_target(2, &members, 3, 4, &mut rng), Some(3));
        for _ in 0..50 {
            let t = removal_target(1, &members, 2, 4, &mut rng).unwrap();
            assert!(t == 1 || t == 3, "{t}");
        }
        // The new replica became the leader: a follower goes, never the new one.
        for _ in 0..50 {
            let t = removal_target(0, &members, 4, 4, &mut rng).unwrap();
            assert!([1, 2, 3].contains(&t), "{t}");
        }
        assert_eq!(removal_target(1, &[4], 4, 4, &mut rng), None);
    }

    #[test]
    fn followers_are_picked_evenly_enough() {
        let mut rng = Rng::new(9);
        let mut seen = BTreeSet::new();
        for _ in 0..100 {
            seen.insert(removal_target(1, &[1, 2, 3, 4], 1, 4, &mut rng).unwrap());
        }
        assert_eq!(seen, BTreeSet::from([2, 3]));
    }

    #[test]
    fn no_rollback_once_the_cluster_version_was_raised() {
        use Build::*;
        // Without the previous release: always a fresh copy of the current build.
        assert_eq!(next_build(Current, false, false, 1), Current);
        // Upgrades always go forward.
        assert_eq!(next_build(Previous, true, true, 1), Current);
        assert_eq!(next_build(Previous, true, false, 1), Current);
        // A rollback keeps the cluster mixed, while another member still runs the previous
        // release and the version is 1.
        assert_eq!(next_build(Current, true, true, 1), Previous);
        // Every other member is current (the version may be raised any moment), or it was.
        assert_eq!(next_build(Current, true, false, 1), Current);
        assert_eq!(next_build(Current, true, true, 2), Current);
    }
}
