//! What every task of one seed shares: the cluster, the observer, the hosts that are down, the
//! clock origin and the stop flag. Locks are never held across an `.await`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::check::Observer;
use super::cluster::SimCluster;
use super::params::Params;

pub struct World {
    pub seed: u64,
    pub params: Params,
    pub cluster: SimCluster,
    pub observer: Mutex<Observer>,
    /// Hosts whose machine is down (crashed, rebooting).
    pub hosts_down: Mutex<BTreeSet<usize>>,
    stop: AtomicBool,
    origin: tokio::time::Instant,
}

impl World {
    pub fn new(seed: u64, params: Params, cluster: SimCluster) -> World {
        World {
            seed,
            params,
            cluster,
            observer: Mutex::default(),
            hosts_down: Mutex::default(),
            stop: AtomicBool::new(false),
            origin: tokio::time::Instant::now(),
        }
    }

    /// Simulated milliseconds since the seed started.
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    pub fn observer(&self) -> MutexGuard<'_, Observer> {
        self.observer.lock().expect("observer lock poisoned")
    }

    pub fn host_down(&self, host: usize) -> bool {
        self.hosts_down
            .lock()
            .expect("host lock poisoned")
            .contains(&host)
    }

    pub fn set_host_down(&self, host: usize, down: bool) {
        let mut hosts = self.hosts_down.lock().expect("host lock poisoned");
        if down {
            hosts.insert(host);
        } else {
            hosts.remove(&host);
        }
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
