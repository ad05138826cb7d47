//! What the leader does for services beyond what `apply` does by itself: it pauses a rollout
//! that made no progress within its deadline, and it runs the autoscalers.
//!
//! An autoscaler follows a gauge the replicas expose (`queue_length`, requests in flight):
//! each node's agent scrapes its replicas and sends the latest values with its heartbeats,
//! and they stay in this process's memory, like heartbeats (`ServiceSoftState`), never in the
//! log. Once a second the leader computes, for each autoscaled service, how many replicas
//! would bring the average per ready replica to the target (Kubernetes' HPA rule, with its
//! 10% tolerance), smooths it over the service's windows (a scale-down takes the highest
//! recommendation of its window, a scale-up the lowest of its own) and proposes a
//! `ScaleService` when the count should change. A new leader starts with empty windows, so
//! it scales down only after a full window of its own observations: a failover never removes
//! replicas on the strength of a predecessor's stale figures.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use proto::agent as pa;

use crate::replica::{ApiError, Replica};
use crate::state::{
    AllocationId, ClusterState, Command, JobState, RolloutAction, RolloutPhase, Service, Timestamp,
};

/// A gauge older than this (leader time since it arrived) is not used: its replica's agent
/// has stopped reporting it.
pub const SAMPLE_MAX_AGE_MS: u64 = 15_000;
/// The HPA's tolerance: no change while the ratio of the average to the target is within it.
pub const TOLERANCE: f64 = 0.1;

#[derive(Debug, Clone)]
struct Sample {
    value: Result<f64, String>,
    /// Leader time it arrived.
    at_ms: u64,
}

#[derive(Debug, Default)]
struct Inner {
    samples: HashMap<AllocationId, Sample>,
    /// Per service: (leader time, recommended replicas), oldest first.
    recommendations: HashMap<String, VecDeque<(u64, u32)>>,
    /// Per service: what the autoscaler saw and decided last, for `service describe`.
    status: HashMap<String, String>,
}

/// The leader's soft state about services (see the module's header).
#[derive(Debug, Default)]
pub struct ServiceSoftState {
    inner: Mutex<Inner>,
}

impl ServiceSoftState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding it leaves plain maps: still consistent enough to read.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps the gauges one heartbeat carried.
    pub fn record_metrics(&self, metrics: &[pa::ReplicaMetric], now_ms: u64) {
        if metrics.is_empty() {
            return;
        }
        let mut inner = self.lock();
        for m in metrics {
            let value = if m.error.is_empty() && m.value.is_finite() {
                Ok(m.value)
            } else if m.error.is_empty() {
                Err(format!("{} is not a number", m.value))
            } else {
                Err(m.error.clone())
            };
            inner.samples.insert(
                m.allocation_id,
                Sample {
                    value,
                    at_ms: now_ms,
                },
            );
        }
    }

    /// A new term: this leader's windows start empty (see the module's header).
    pub fn start_term(&self) {
        let mut inner = self.lock();
        inner.recommendations.clear();
        inner.status.clear();
    }

    /// What the autoscaler last saw and decided for a service (empty: nothing on this replica).
    pub fn status(&self, key: &str) -> String {
        self.lock().status.get(key).cloned().unwrap_or_default()
    }

    /// The value of a replica's gauge, if fresh, or why there is none.
    fn sample(&self, allocation: AllocationId, now_ms: u64) -> Result<f64, String> {
        match self.lock().samples.get(&allocation) {
            None => Err("no value reported yet".into()),
            Some(s) if now_ms.saturating_sub(s.at_ms) > SAMPLE_MAX_AGE_MS => Err(format!(
                "last value {} s old",
                now_ms.saturating_sub(s.at_ms) / 1000
            )),
            Some(s) => s.value.clone(),
        }
    }

    /// Drops gauges of allocations that no longer exist.
    fn forget_except(&self, live: &dyn Fn(AllocationId) -> bool) {
        self.lock().samples.retain(|id, _| live(*id));
    }
}

/// The replicas that would bring the average per ready replica to `target`: the sum of the
/// values over the target, rounded up, clamped to `min..=max`; the current count while the
/// average is within the tolerance of the target. `None` without a value to go on.
pub fn recommend(current: u32, values: &[f64], target: f64, min: u32, max: u32) -> Option<u32> {
    if values.is_empty() || target <= 0.0 {
        return None;
    }
    let sum: f64 = values.iter().sum();
    let average = sum / values.len() as f64;
    if ((average / target) - 1.0).abs() <= TOLERANCE && (min..=max).contains(&current) {
        return Some(current);
    }
    let wanted = (sum / target).ceil().clamp(0.0, f64::from(u32::MAX)) as u32;
    Some(wanted.clamp(min, max))
}

/// The count to scale to, from the recommendations of the windows: a scale-up takes the
/// lowest recommendation within `up_window_ms` (so a spike must last), a scale-down the
/// highest within `down_window_ms` (so a dip must last).
pub fn stabilize(
    current: u32,
    history: &VecDeque<(u64, u32)>,
    now_ms: u64,
    up_window_ms: u64,
    down_window_ms: u64,
) -> u32 {
    let within = |window: u64| {
        history
            .iter()
            .filter(move |(at, _)| now_ms.saturating_sub(*at) <= window)
            .map(|(_, r)| *r)
    };
    let up = within(up_window_ms).min().unwrap_or(current);
    let down = within(down_window_ms).max().unwrap_or(current);
    if up > current {
        up
    } else if down < current {
        down
    } else {
        current
    }
}

/// What the leader should propose for one service now.
fn autoscale_one(
    soft: &ServiceSoftState,
    cluster: &ClusterState,
    key: &str,
    s: &Service,
    now_ms: u64,
) -> Option<Command> {
    let a = s.spec.autoscale.as_ref()?;
    if s.deleting {
        return None;
    }
    let mut values = Vec::new();
    let mut missing = Vec::new();
    for (ordinal, job) in &s.replicas {
        let Some(job) = cluster.jobs.get(job) else {
            continue;
        };
        if !job.replica.as_ref().is_some_and(|r| r.ready) || job.state != JobState::Running {
            continue;
        }
        for alloc in &job.allocations {
            match soft.sample(*alloc, now_ms) {
                Ok(v) => values.push(v),
                Err(why) => missing.push(format!("replica {ordinal}: {why}")),
            }
        }
    }
    let target = a.target_milli as f64 / 1000.0;
    let current = s.spec.replicas;
    let Some(recommended) = recommend(current, &values, target, a.min, a.max) else {
        let status = if missing.is_empty() {
            format!("{}: no ready replica to read it from", a.metric)
        } else {
            format!("{}: {}", a.metric, missing.join("; "))
        };
        soft.lock().status.insert(key.to_owned(), status);
        return None;
    };
    let desired = {
        let mut inner = soft.lock();
        let window = a.scale_down_window_ms.max(a.scale_up_window_ms);
        let history = inner.recommendations.entry(key.to_owned()).or_default();
        history.push_back((now_ms, recommended));
        while history
            .front()
            .is_some_and(|(at, _)| now_ms.saturating_sub(*at) > window)
        {
            history.pop_front();
        }
        let desired = stabilize(
            current,
            history,
            now_ms,
            a.scale_up_window_ms,
            a.scale_down_window_ms,
        );
        let average = values.iter().sum::<f64>() / values.len() as f64;
        let mut status = format!(
            "{} averages {average:.2} over {} ready replicas (target {target}): recommends {recommended}",
            a.metric,
            values.len()
        );
        if desired != recommended {
            status.push_str(&format!(", {desired} after stabilisation"));
        }
        if !missing.is_empty() {
            status.push_str(&format!(" ({} without a value)", missing.len()));
        }
        inner.status.insert(key.to_owned(), status);
        desired
    };
    (desired != current).then(|| {
        let average = values.iter().sum::<f64>() / values.len() as f64;
        Command::ScaleService {
            service: key.to_owned(),
            replicas: desired,
            reason: format!(
                "autoscaler: {} averages {average:.2} per ready replica, target {target}",
                a.metric
            ),
        }
    })
}

/// A rollout that has made no progress for longer than its deadline: the pause to propose.
fn stalled_rollout(key: &str, s: &Service, cluster: &ClusterState, now_ms: u64) -> Option<Command> {
    if s.deleting || s.rollout != RolloutPhase::Progressing {
        return None;
    }
    let deadline = s.spec.strategy.progress_deadline_ms;
    let idle = now_ms.saturating_sub(s.progressed_at);
    if idle <= deadline {
        return None;
    }
    let waiting: Vec<String> = s
        .replicas
        .iter()
        .filter_map(|(o, j)| Some((o, cluster.jobs.get(j)?)))
        .filter(|(_, j)| {
            !j.state.is_final()
                && j.replica
                    .as_ref()
                    .is_some_and(|r| !r.ready && r.revision == s.revision)
        })
        .map(|(o, j)| format!("replica {o} {}", j.state))
        .collect();
    let detail = if waiting.is_empty() {
        String::new()
    } else {
        format!(" ({})", waiting.join(", "))
    };
    Some(Command::ServiceRollout {
        service: key.to_owned(),
        action: RolloutAction::Pause {
            reason: format!(
                "no replica of revision {} became ready within the progress deadline of {}{detail}",
                s.revision,
                humantime::format_duration(std::time::Duration::from_millis(deadline))
            ),
        },
    })
}

/// One round of the leader's service duties: stalled rollouts, then autoscalers.
pub async fn tick(replica: &Replica) -> Result<(), ApiError> {
    let now_ms: Timestamp = replica.now_ms();
    let soft = &replica.services;
    let commands: Vec<Command> = {
        let data = replica.sm.read();
        let cluster = &data.cluster;
        if cluster.services.is_empty() {
            return Ok(());
        }
        soft.forget_except(&|a| cluster.allocations.contains_key(&a));
        let services: &BTreeMap<String, Service> = &cluster.services;
        services
            .iter()
            .flat_map(|(key, s)| {
                [
                    stalled_rollout(key, s, cluster, now_ms),
                    autoscale_one(soft, cluster, key, s, now_ms),
                ]
            })
            .flatten()
            .collect()
    };
    for command in commands {
        match replica.write(command).await {
            Ok(_) => {}
            Err(e @ ApiError::NotLeader { .. }) => return Err(e),
            Err(e) => tracing::warn!(?e, "a service's autoscaler or deadline check failed"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recommendation_brings_the_average_to_the_target() {
        // 3 replicas at 10 each, target 5: 30 / 5 = 6.
        assert_eq!(recommend(3, &[10.0, 10.0, 10.0], 5.0, 1, 10), Some(6));
        // Within 10% of the target: no change.
        assert_eq!(recommend(3, &[5.4, 5.2, 5.0], 5.0, 1, 10), Some(3));
        // Idle: down to the minimum.
        assert_eq!(recommend(4, &[0.0; 4], 5.0, 2, 10), Some(2));
        // Clamped to the maximum.
        assert_eq!(recommend(2, &[100.0, 100.0], 5.0, 1, 8), Some(8));
        assert_eq!(recommend(2, &[], 5.0, 1, 8), None);
    }

    #[test]
    fn a_scale_down_waits_for_its_window_and_a_scale_up_does_not() {
        let mut h = VecDeque::new();
        h.push_back((0, 6));
        h.push_back((1_000, 2));
        // Scale-down window 5 s: 6 is still in it, so no scale-down yet.
        assert_eq!(stabilize(6, &h, 1_000, 0, 5_000), 6);
        // Once 6 has left the window, the dip counts.
        assert_eq!(stabilize(6, &h, 6_000, 0, 5_000), 2);
        // A scale-up with a zero window takes the latest recommendation at once.
        let mut h = VecDeque::new();
        h.push_back((0, 3));
        h.push_back((1_000, 9));
        assert_eq!(stabilize(3, &h, 1_000, 0, 300_000), 9);
        // With a 2 s scale-up window, the lowest of the window holds it back.
        assert_eq!(stabilize(3, &h, 1_000, 2_000, 300_000), 3);
    }

    #[test]
    fn stale_and_failed_samples_are_not_used() {
        let soft = ServiceSoftState::default();
        soft.record_metrics(
            &[
                pa::ReplicaMetric {
                    allocation_id: 1,
                    value: 4.0,
                    error: String::new(),
                    at_ms: 0,
                },
                pa::ReplicaMetric {
                    allocation_id: 2,
                    value: 0.0,
                    error: "connection refused".into(),
                    at_ms: 0,
                },
            ],
            1_000,
        );
        assert_eq!(soft.sample(1, 2_000), Ok(4.0));
        assert_eq!(soft.sample(2, 2_000), Err("connection refused".into()));
        assert!(soft.sample(1, 1_000 + SAMPLE_MAX_AGE_MS + 1).is_err());
        assert!(soft.sample(3, 0).is_err());
    }
}
