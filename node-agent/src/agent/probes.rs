//! Readiness and liveness probes of a service's replica, as the kubelet runs them: the pure
//! state machine (when each check is due, and when consecutive outcomes change what the probe
//! says). The checks themselves (HTTP, TCP, exec) are `agent::checks`; the task that runs
//! both for each replica is `agent::replicas`.
//!
//! Semantics (Kubernetes' `prober` worker): the first check comes `initial_delay` after the
//! replica started, then one every `period`; a check that takes longer than `timeout` failed.
//! The probe's status changes only once an outcome has come `success_threshold` (to passing)
//! or `failure_threshold` (to failing) times in a row. A readiness probe reports each change;
//! a liveness probe that turns failing restarts the replica.

use std::time::Duration;

use proto::agent as pa;

/// The shortest period and timeout the agent uses, whatever an assignment says: a period of
/// 0 would make a probe spin (the control plane refuses less than 100 ms and 10 ms).
const MIN_PERIOD: Duration = Duration::from_millis(100);
const MIN_TIMEOUT: Duration = Duration::from_millis(10);

/// When and how often a probe checks, and how many outcomes in a row change its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeTiming {
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
    pub success_threshold: u32,
}

impl ProbeTiming {
    /// An assignment's probe timing, raised to workable minimums (at least one outcome to
    /// change the status, a period of 100 ms, a timeout of 10 ms).
    pub fn of(spec: &pa::ProbeSpec) -> ProbeTiming {
        ProbeTiming {
            initial_delay: Duration::from_millis(spec.initial_delay_ms),
            period: Duration::from_millis(spec.period_ms).max(MIN_PERIOD),
            timeout: Duration::from_millis(spec.timeout_ms).max(MIN_TIMEOUT),
            failure_threshold: spec.failure_threshold.max(1),
            success_threshold: spec.success_threshold.max(1),
        }
    }
}

/// What a probe says about its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Not known yet: the first outcome run to reach its threshold sets it (a replica
    /// re-adopted after an agent restart, about which the control plane may believe either).
    Unknown,
    Passing,
    Failing,
}

/// A change of a probe's status, with the error of the check that made it failing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Passing,
    Failing { reason: String },
}

/// One probe of one replica.
#[derive(Debug, Clone)]
pub struct ProbeState {
    timing: ProbeTiming,
    status: Status,
    /// The latest outcome (passed?) and how many times in a row it came.
    run: Option<(bool, u32)>,
    /// When the latest check started (ms since the Unix epoch), if one did.
    last_check_ms: Option<u64>,
}

impl ProbeState {
    /// A probe whose replica started at `started_at_ms`, with the status the control plane
    /// holds for it now (`Failing` for readiness of a fresh replica, `Unknown` otherwise).
    pub fn new(timing: ProbeTiming, initial: Status) -> ProbeState {
        ProbeState {
            timing,
            status: initial,
            run: None,
            last_check_ms: None,
        }
    }

    pub fn timing(&self) -> ProbeTiming {
        self.timing
    }

    /// Whether the probe passes now (an unknown status does not).
    pub fn passing(&self) -> bool {
        self.status == Status::Passing
    }

    #[cfg(test)]
    pub fn status(&self) -> Status {
        self.status
    }

    /// When the next check is due (ms since the Unix epoch), for a replica that started at
    /// `started_at_ms`: its initial delay after the start, then a period after the previous
    /// check started (at once if that is past: a check that ran long is not made up for).
    pub fn next_check_ms(&self, started_at_ms: u64) -> u64 {
        match self.last_check_ms {
            None => started_at_ms.saturating_add(millis(self.timing.initial_delay)),
            Some(last) => last.saturating_add(millis(self.timing.period)),
        }
    }

    /// Records a check that started at `at_ms` and ended with `outcome` (`Err`: why it
    /// failed); returns the status change it makes, if any.
    pub fn observe(&mut self, at_ms: u64, outcome: &Result<(), String>) -> Option<Change> {
        self.last_check_ms = Some(at_ms);
        let passed = outcome.is_ok();
        let count = match self.run {
            Some((last, n)) if last == passed => n.saturating_add(1),
            _ => 1,
        };
        self.run = Some((passed, count));
        let (threshold, target) = if passed {
            (self.timing.success_threshold, Status::Passing)
        } else {
            (self.timing.failure_threshold, Status::Failing)
        };
        if count < threshold || self.status == target {
            return None;
        }
        self.status = target;
        Some(match outcome {
            Ok(()) => Change::Passing,
            Err(reason) => Change::Failing {
                reason: reason.clone(),
            },
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(failures: u32, successes: u32) -> ProbeTiming {
        ProbeTiming {
            initial_delay: Duration::from_millis(500),
            period: Duration::from_millis(1_000),
            timeout: Duration::from_millis(200),
            failure_threshold: failures,
            success_threshold: successes,
        }
    }

    const OK: Result<(), String> = Ok(());

    fn bad(why: &str) -> Result<(), String> {
        Err(why.to_owned())
    }

    /// Feeds outcomes one period apart; returns the changes, by the check that made them.
    fn feed(p: &mut ProbeState, outcomes: &[Result<(), String>]) -> Vec<(usize, Change)> {
        outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, o)| p.observe(i as u64 * 1_000, o).map(|c| (i, c)))
            .collect()
    }

    #[test]
    fn the_first_check_waits_for_the_initial_delay_then_one_per_period() {
        let mut p = ProbeState::new(timing(3, 1), Status::Failing);
        assert_eq!(p.next_check_ms(10_000), 10_500);
        p.observe(10_500, &OK);
        assert_eq!(p.next_check_ms(10_000), 11_500);
        // A check that started late is followed a period after its own start.
        p.observe(12_300, &OK);
        assert_eq!(p.next_check_ms(10_000), 13_300);
    }

    #[test]
    fn readiness_turns_ready_after_enough_successes_and_unready_after_enough_failures() {
        let mut p = ProbeState::new(timing(3, 2), Status::Failing);
        let changes = feed(
            &mut p,
            &[
                bad("refused"),
                OK, // one success: not yet
                OK, // two in a row: ready
                OK,
                bad("503"),
                bad("503"),
                OK, // the failure run is broken: still ready
                bad("503"),
                bad("503"),
                bad("timed out"), // three in a row: unready, with the last error
                bad("timed out"),
            ],
        );
        assert_eq!(
            changes,
            vec![
                (2, Change::Passing),
                (
                    9,
                    Change::Failing {
                        reason: "timed out".into()
                    }
                ),
            ]
        );
        assert_eq!(p.status(), Status::Failing);
    }

    #[test]
    fn failures_of_a_replica_not_yet_ready_change_nothing() {
        let mut p = ProbeState::new(timing(1, 1), Status::Failing);
        assert!(feed(&mut p, &[bad("a"), bad("b"), bad("c")]).is_empty());
    }

    #[test]
    fn an_unknown_status_is_settled_by_the_first_run_to_reach_its_threshold() {
        let mut p = ProbeState::new(timing(2, 3), Status::Unknown);
        assert_eq!(
            feed(&mut p, &[OK, OK, bad("x"), bad("y")]),
            vec![(3, Change::Failing { reason: "y".into() })]
        );
        let mut p = ProbeState::new(timing(2, 3), Status::Unknown);
        assert_eq!(
            feed(&mut p, &[OK, bad("x"), OK, OK, OK]),
            vec![(4, Change::Passing)]
        );
    }

    #[test]
    fn liveness_fails_once_after_its_threshold_and_reports_nothing_before() {
        let mut p = ProbeState::new(timing(3, 1), Status::Unknown);
        let changes = feed(
            &mut p,
            &[OK, bad("a"), bad("b"), OK, bad("c"), bad("d"), bad("e")],
        );
        assert_eq!(
            changes,
            vec![
                (0, Change::Passing),
                (6, Change::Failing { reason: "e".into() })
            ]
        );
    }

    #[test]
    fn timings_from_the_wire_are_raised_to_workable_minimums() {
        let t = ProbeTiming::of(&pa::ProbeSpec {
            check: None,
            initial_delay_ms: 0,
            period_ms: 0,
            timeout_ms: 0,
            failure_threshold: 0,
            success_threshold: 0,
        });
        assert_eq!(t.period, MIN_PERIOD);
        assert_eq!(t.timeout, MIN_TIMEOUT);
        assert_eq!((t.failure_threshold, t.success_threshold), (1, 1));
        let mut p = ProbeState::new(t, Status::Failing);
        assert_eq!(p.observe(0, &OK), Some(Change::Passing));
        assert_eq!(p.next_check_ms(u64::MAX), 100, "no overflow either way");
        let p = ProbeState::new(t, Status::Failing);
        assert_eq!(p.next_check_ms(u64::MAX), u64::MAX);
    }
}
