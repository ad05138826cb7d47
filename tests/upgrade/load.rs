//! The steady write load that runs through the whole upgrade: one client submitting short
//! jobs at a fixed pace, one at a time, round robin over the hosts' partitions, each with an
//! idempotency key. Every acknowledgement is recorded with its time, so the largest gap
//! between two consecutive ones bounds any write outage.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use control_plane::client::Client;
use proto::v1 as pb;

use crate::util::submit;

/// One acknowledged submission.
#[derive(Debug, Clone)]
pub struct Ack {
    pub id: u64,
    pub partition: String,
    pub at: Instant,
}

pub struct LoadReport {
    pub started: Instant,
    pub stopped: Instant,
    pub acks: Vec<Ack>,
    /// Submissions the client gave up on after its deadline (each then retried with the same
    /// key); they show up as gaps too.
    pub errors: Vec<String>,
}

impl LoadReport {
    /// Every interval between consecutive acknowledgements (the first measured from the start
    /// of the load), each with the time it ended.
    fn gaps(&self) -> Vec<(Duration, Instant)> {
        let mut prev = self.started;
        let mut gaps = Vec::with_capacity(self.acks.len());
        for a in &self.acks {
            gaps.push((a.at.duration_since(prev), a.at));
            prev = a.at;
        }
        gaps
    }

    /// The largest gap between consecutive acknowledgements, and when it ended.
    pub fn max_gap(&self) -> (Duration, Instant) {
        self.largest_gaps(1)
            .first()
            .copied()
            .unwrap_or((Duration::ZERO, self.started))
    }

    /// The `n` largest gaps, largest first.
    pub fn largest_gaps(&self, n: usize) -> Vec<(Duration, Instant)> {
        let mut gaps = self.gaps();
        gaps.sort_by_key(|g| std::cmp::Reverse(g.0));
        gaps.truncate(n);
        gaps
    }
}

pub struct Load {
    stop: Arc<AtomicBool>,
    acks: Arc<Mutex<Vec<Ack>>>,
    task: tokio::task::JoinHandle<(Vec<String>, Instant)>,
    started: Instant,
}

/// A short job for `partition`: long enough that several run at any time, short enough that
/// hundreds complete during the upgrade.
fn short_job(i: u64, partition: &str) -> pb::JobSpec {
    pb::JobSpec {
        tenant: "team-a".into(),
        name: format!("load-{i}"),
        command: vec!["sleep".into(), "0.5".into()],
        gpus_per_task: 1,
        tasks: 1,
        partition: partition.into(),
        ..Default::default()
    }
}

/// Starts submitting: one job every `pace` (or right after the previous acknowledgement when
/// that took longer), never two in flight, so an outage is one long wait, not a burst.
pub fn start(mut client: Client, partitions: Vec<String>, pace: Duration) -> Load {
    // An attempt against a replica that is going away must not eat the gap budget: give up on
    // it soon and try the next one.
    client.attempt_timeout = Duration::from_millis(500);
    client.deadline = Duration::from_secs(30);
    let stop = Arc::new(AtomicBool::new(false));
    let acks = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let task = tokio::spawn(run(client, partitions, pace, stop.clone(), acks.clone()));
    Load {
        stop,
        acks,
        task,
        started,
    }
}

async fn run(
    mut client: Client,
    partitions: Vec<String>,
    pace: Duration,
    stop: Arc<AtomicBool>,
    acks: Arc<Mutex<Vec<Ack>>>,
) -> (Vec<String>, Instant) {
    let mut errors = Vec::new();
    let mut tick = tokio::time::interval(pace);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let partition = &partitions[i as usize % partitions.len()];
        let key = format!("load-{i}");
        // Retried with the same key until acknowledged: the key makes a retry of a write that
        // did commit return the same job.
        loop {
            match submit(&mut client, short_job(i, partition), &key).await {
                Ok(r) => {
                    acks.lock().unwrap().push(Ack {
                        id: r.id,
                        partition: partition.clone(),
                        at: Instant::now(),
                    });
                    break;
                }
                Err(e) if control_plane::client::retryable(&e) => {
                    errors.push(format!("{key}: {}", e.message()));
                }
                Err(e) => panic!("submission {key} refused for good: {e}"),
            }
        }
        i += 1;
    }
    (errors, Instant::now())
}

impl Load {
    pub fn acked(&self) -> usize {
        self.acks.lock().unwrap().len()
    }

    /// The acknowledgements so far.
    pub fn acks(&self) -> Vec<Ack> {
        self.acks.lock().unwrap().clone()
    }

    /// Waits until at least `n` submissions were acknowledged.
    pub async fn wait_acked(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.acked() < n {
            assert!(
                Instant::now() < deadline,
                "the load got only {} of {n} submissions acknowledged within {timeout:?}",
                self.acked()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn stop(self) -> LoadReport {
        self.stop.store(true, Ordering::Relaxed);
        let (errors, stopped) = self.task.await.expect("the load task panicked");
        let acks = self.acks.lock().unwrap().clone();
        LoadReport {
            started: self.started,
            stopped,
            acks,
            errors,
        }
    }
}
