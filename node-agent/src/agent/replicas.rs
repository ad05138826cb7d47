//! The agent's watch over its service replicas: for each running replica whose assignment
//! carries probes or an autoscaling gauge, one task that runs its readiness and liveness
//! probes (`probes` decides, `checks` checks) and, while it is ready (the leader's autoscaler
//! reads ready replicas only), scrapes its gauge about once a second, and
//! tells a [`ReplicaSink`] (the agent) what it found: readiness changes, a failed liveness
//! probe, each failed check (for the metrics), the gauge's latest value.
//!
//! The agent keeps the set of watches equal to its running replicas ([`Watches::sync`],
//! from its tick): a watch starts once its replica's start has been queued for report (so a
//! READY never overtakes its STARTED) and ends when the replica stops or exits.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proto::agent as pa;

use super::checks;
use super::probes::{Change, ProbeState, ProbeTiming, Status};
use crate::runtime::ExecTarget;
use crate::runtime::process::now_ms;

/// How often an autoscaled replica's gauge is scraped, and how long one scrape may take.
pub const SCRAPE_EVERY: Duration = Duration::from_secs(1);
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(1);

/// Which of a replica's probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    Readiness,
    Liveness,
}

impl ProbeKind {
    pub fn label(self) -> &'static str {
        match self {
            ProbeKind::Readiness => "readiness",
            ProbeKind::Liveness => "liveness",
        }
    }
}

/// What a watch tells the agent.
pub trait ReplicaSink: Send + Sync + 'static {
    /// The readiness probe changed its status (reported READY / NOT_READY).
    fn readiness(&self, allocation: u64, change: Change);
    /// The liveness probe failed `failure_threshold` times in a row, the last for `reason`:
    /// the replica must be stopped and its exit reported as that failure.
    fn liveness_failed(&self, allocation: u64, reason: String);
    /// One check of a probe failed (counted; the probe's status may not change).
    fn check_failed(&self, allocation: u64, kind: ProbeKind, reason: &str);
    /// The gauge's value (or why there is none), scraped at `at_ms`.
    fn gauge(&self, allocation: u64, value: Result<f64, String>, at_ms: u64);
}

/// What one watch needs: the replica's checks and where it runs.
pub struct WatchSpec {
    pub allocation_id: u64,
    pub replica: pa::ReplicaInfo,
    /// When its command started (its probes' initial delay counts from here).
    pub started_at_ms: u64,
    /// What the control plane holds of its readiness now: `Failing` for a replica this agent
    /// started and has not watched before (every new run starts unready), `Unknown` for one
    /// re-adopted after a restart, or watched before (its last report may have said either).
    pub readiness: Status,
    pub exec: Option<ExecTarget>,
}

/// Whether a replica's assignment asks the agent to watch it at all.
pub fn wants_watch(replica: &pa::ReplicaInfo) -> bool {
    replica.readiness.is_some() || replica.liveness.is_some() || replica.metric.is_some()
}

/// The running watches, by allocation.
pub struct Watches {
    handle: tokio::runtime::Handle,
    running: BTreeMap<u64, tokio::task::AbortHandle>,
    /// Allocations that had a watch: a later one starts with readiness `Unknown`.
    watched: BTreeSet<u64>,
}

impl Watches {
    /// Watches whose tasks run on `handle` (the agent's runtime; `sync` is called from its
    /// blocking tick).
    pub fn new(handle: tokio::runtime::Handle) -> Watches {
        Watches {
            handle,
            running: BTreeMap::new(),
            watched: BTreeSet::new(),
        }
    }

    /// Makes the watches those of `wanted`: ends the others, and starts the missing ones when
    /// `may_start` (with the spec `make` gives; `None`: not now). Returns the allocations
    /// whose watch ended.
    pub fn sync(
        &mut self,
        wanted: &BTreeSet<u64>,
        may_start: bool,
        mut make: impl FnMut(u64, bool) -> Option<WatchSpec>,
        sink: &Arc<dyn ReplicaSink>,
    ) -> Vec<u64> {
        let ended: Vec<u64> = self
            .running
            .keys()
            .filter(|id| !wanted.contains(id))
            .copied()
            .collect();
        for id in &ended {
            if let Some(task) = self.running.remove(id) {
                task.abort();
            }
        }
        // Forget allocations that are gone for good (ids only grow; a watched id no longer
        // wanted never comes back once it has exited).
        self.watched
            .retain(|id| wanted.contains(id) || self.running.contains_key(id));
        if may_start {
            for id in wanted {
                if self.running.contains_key(id) {
                    continue;
                }
                let Some(spec) = make(*id, self.watched.contains(id)) else {
                    continue;
                };
                self.watched.insert(*id);
                let task = self.handle.spawn(watch(spec, sink.clone()));
                self.running.insert(*id, task.abort_handle());
            }
        }
        ended
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.running.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }
}

impl Watches {
    /// Ends every watch (the agent stops).
    pub fn clear(&mut self) {
        for (_, task) in std::mem::take(&mut self.running) {
            task.abort();
        }
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        self.clear();
    }
}

/// One replica's watch: its probes and its gauge, side by side, until aborted (or, for the
/// liveness probe, until it fails).
pub async fn watch(spec: WatchSpec, sink: Arc<dyn ReplicaSink>) {
    let exec = checks::Exec::new(spec.exec);
    let id = spec.allocation_id;
    // Without a readiness probe a running replica is ready.
    let ready = AtomicBool::new(spec.replica.readiness.is_none());
    let readiness = async {
        if let Some(p) = &spec.replica.readiness {
            probe_loop(
                id,
                ProbeKind::Readiness,
                p,
                spec.readiness,
                spec.started_at_ms,
                &exec,
                &*sink,
                Some(&ready),
            )
            .await;
        }
    };
    let liveness = async {
        if let Some(p) = &spec.replica.liveness {
            probe_loop(
                id,
                ProbeKind::Liveness,
                p,
                Status::Unknown,
                spec.started_at_ms,
                &exec,
                &*sink,
                None,
            )
            .await;
        }
    };
    let gauge = async {
        if let Some(m) = &spec.replica.metric {
            scrape_loop(id, m, &ready, &*sink).await;
        }
    };
    tokio::join!(readiness, liveness, gauge);
}

/// Runs one probe until aborted (a liveness probe: until it fails). `passing`, if given,
/// follows the probe's status.
#[allow(clippy::too_many_arguments)]
async fn probe_loop(
    id: u64,
    kind: ProbeKind,
    probe: &pa::ProbeSpec,
    initial: Status,
    started_at_ms: u64,
    exec: &checks::Exec,
    sink: &dyn ReplicaSink,
    passing: Option<&AtomicBool>,
) {
    let Some(check) = &probe.check else {
        tracing::warn!(
            allocation = id,
            probe = kind.label(),
            "the probe names no check (an HTTP path, a TCP port or a command); it is not run"
        );
        return;
    };
    let mut state = ProbeState::new(ProbeTiming::of(probe), initial);
    loop {
        let due = state.next_check_ms(started_at_ms);
        tokio::time::sleep(Duration::from_millis(due.saturating_sub(now_ms()))).await;
        let at = now_ms();
        let outcome = checks::run(check, state.timing().timeout, exec).await;
        if let Err(why) = &outcome {
            sink.check_failed(id, kind, why);
        }
        let change = state.observe(at, &outcome);
        if let Some(passing) = passing {
            passing.store(state.passing(), Ordering::SeqCst);
        }
        match (kind, change) {
            (ProbeKind::Readiness, Some(change)) => sink.readiness(id, change),
            (ProbeKind::Liveness, Some(Change::Failing { reason })) => {
                sink.liveness_failed(id, reason);
                return;
            }
            _ => {}
        }
    }
}

/// Scrapes the gauge every [`SCRAPE_EVERY`] while the replica is `ready`.
async fn scrape_loop(
    id: u64,
    metric: &pa::MetricScrape,
    ready: &AtomicBool,
    sink: &dyn ReplicaSink,
) {
    let mut every = tokio::time::interval(SCRAPE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if !ready.load(Ordering::SeqCst) {
            continue;
        }
        let at = now_ms();
        let value = checks::scrape(metric.port, &metric.path, &metric.metric, SCRAPE_TIMEOUT).await;
        sink.gauge(id, value, at);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Seen {
        events: Mutex<Vec<String>>,
    }

    impl Seen {
        fn push(&self, s: String) {
            self.events.lock().unwrap().push(s);
        }
        fn all(&self) -> Vec<String> {
            self.events.lock().unwrap().clone()
        }
    }

    impl ReplicaSink for Seen {
        fn readiness(&self, allocation: u64, change: Change) {
            self.push(format!("{allocation} {change:?}"));
        }
        fn liveness_failed(&self, allocation: u64, reason: String) {
            self.push(format!("{allocation} liveness failed: {reason}"));
        }
        fn check_failed(&self, allocation: u64, kind: ProbeKind, _reason: &str) {
            self.push(format!("{allocation} {} check failed", kind.label()));
        }
        fn gauge(&self, allocation: u64, value: Result<f64, String>, _at_ms: u64) {
            self.push(format!("{allocation} gauge {value:?}"));
        }
    }

    async fn wait_for(seen: &Seen, what: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !seen.all().iter().any(|e| e == what) {
            assert!(
                std::time::Instant::now() < deadline,
                "no {what:?} in {:?}",
                seen.all()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn exec_probe(script: &str, failures: u32) -> pa::ProbeSpec {
        pa::ProbeSpec {
            check: Some(pa::probe_spec::Check::Exec(pa::ExecCheck {
                command: vec!["sh".into(), "-c".into(), script.into()],
            })),
            initial_delay_ms: 0,
            period_ms: 100,
            timeout_ms: 5_000,
            failure_threshold: failures,
            success_threshold: 1,
        }
    }

    fn spec(dir: &std::path::Path, replica: pa::ReplicaInfo) -> WatchSpec {
        WatchSpec {
            allocation_id: 7,
            replica,
            started_at_ms: now_ms(),
            readiness: Status::Failing,
            exec: Some(ExecTarget::Host {
                env: [("PATH".to_owned(), crate::runtime::DEFAULT_PATH.to_owned())].into(),
                workdir: dir.to_path_buf(),
                cgroup_procs: Vec::new(),
            }),
        }
    }

    #[tokio::test]
    async fn a_watch_reports_readiness_changes_and_a_failed_liveness_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let seen = Arc::new(Seen::default());
        let sink: Arc<dyn ReplicaSink> = seen.clone();
        let replica = pa::ReplicaInfo {
            readiness: Some(exec_probe("test -e ready", 1)),
            liveness: Some(exec_probe("test -e alive", 2)),
            ..Default::default()
        };
        std::fs::write(dir.path().join("alive"), "").expect("write");
        let task = tokio::spawn(watch(spec(dir.path(), replica), sink));
        wait_for(&seen, "7 readiness check failed").await;
        std::fs::write(dir.path().join("ready"), "").expect("write");
        wait_for(&seen, "7 Passing").await;
        std::fs::remove_file(dir.path().join("ready")).expect("remove");
        wait_for(
            &seen,
            "7 Failing { reason: \"the check's command exited with code 1\" }",
        )
        .await;
        std::fs::remove_file(dir.path().join("alive")).expect("remove");
        wait_for(
            &seen,
            "7 liveness failed: the check's command exited with code 1",
        )
        .await;
        let events = seen.all();
        assert_eq!(
            events.iter().filter(|e| e.contains("Passing")).count(),
            1,
            "changes only, not every check: {events:?}"
        );
        assert_eq!(
            events
                .iter()
                .filter(|e| e.contains("liveness failed"))
                .count(),
            1
        );
        let liveness_failures = events
            .iter()
            .filter(|e| e.ends_with("liveness check failed"))
            .count();
        assert!(liveness_failures >= 2, "two failures in a row: {events:?}");
        task.abort();
    }

    #[tokio::test]
    async fn the_gauge_is_scraped_only_while_the_replica_is_ready() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nq 3\n",
                    )
                    .await;
            }
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let seen = Arc::new(Seen::default());
        let sink: Arc<dyn ReplicaSink> = seen.clone();
        let replica = pa::ReplicaInfo {
            readiness: Some(exec_probe("test -e ready", 1)),
            metric: Some(pa::MetricScrape {
                port: u32::from(port),
                path: "/metrics".into(),
                metric: "q".into(),
            }),
            ..Default::default()
        };
        let task = tokio::spawn(watch(spec(dir.path(), replica), sink));
        // Three failed checks: 200 ms and more after the first scrape would have been made.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while seen
            .all()
            .iter()
            .filter(|e| e.ends_with("readiness check failed"))
            .count()
            < 3
        {
            assert!(std::time::Instant::now() < deadline, "{:?}", seen.all());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            !seen.all().iter().any(|e| e.contains("gauge")),
            "scraped while unready: {:?}",
            seen.all()
        );
        std::fs::write(dir.path().join("ready"), "").expect("write");
        wait_for(&seen, "7 gauge Ok(3.0)").await;
        task.abort();
    }

    #[tokio::test]
    async fn watches_follow_the_wanted_set_and_start_only_when_allowed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let seen = Arc::new(Seen::default());
        let sink: Arc<dyn ReplicaSink> = seen.clone();
        let mut watches = Watches::new(tokio::runtime::Handle::current());
        let replica = pa::ReplicaInfo {
            liveness: Some(exec_probe("true", 1)),
            ..Default::default()
        };
        let mut made = Vec::new();
        let mut make = |id: u64, before: bool| {
            made.push((id, before));
            let mut s = spec(dir.path(), replica.clone());
            s.allocation_id = id;
            Some(s)
        };
        let wanted: BTreeSet<u64> = [1, 2].into();
        assert!(watches.sync(&wanted, false, &mut make, &sink).is_empty());
        assert!(watches.is_empty(), "nothing starts while not allowed");
        assert!(watches.sync(&wanted, true, &mut make, &sink).is_empty());
        assert_eq!(watches.len(), 2);
        // Again: nothing new.
        watches.sync(&wanted, true, &mut make, &sink);
        assert_eq!(watches.len(), 2);
        // 1 ends; 2 stays even while starting is not allowed.
        let ended = watches.sync(&[2].into(), false, &mut make, &sink);
        assert_eq!(ended, vec![1]);
        assert_eq!(watches.len(), 1);
        assert_eq!(made, vec![(1, false), (2, false)]);
    }

    #[test]
    fn only_replicas_with_probes_or_a_gauge_are_watched() {
        assert!(!wants_watch(&pa::ReplicaInfo::default()));
        assert!(wants_watch(&pa::ReplicaInfo {
            metric: Some(pa::MetricScrape::default()),
            ..Default::default()
        }));
    }
}
