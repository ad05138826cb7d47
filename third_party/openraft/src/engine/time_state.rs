use std::time::Duration;

#[derive(Clone, Debug)]
#[derive(PartialEq, Eq)]
pub(crate) struct Config {
    /// The time interval after which the next election will be initiated once the current lease has
    /// expired.
    pub(crate) election_timeout: Duration,

    /// PATCHED: the range `election_timeout` is drawn from, in milliseconds, so that it can be
    /// drawn again whenever the vote changes (see `VoteHandler::update_vote`).
    pub(crate) election_timeout_range_ms: (u64, u64),

    /// If this node has a smaller last-log-id than others, it will be less likely to be elected as
    /// a leader. In this case, it is necessary to sleep for a longer period of time
    /// `smaller_log_timeout` so that other nodes with a greater last-log-id have a chance to elect
    /// themselves.
    ///
    /// Note that this value should be greater than the `election_timeout` of every other node.
    pub(crate) smaller_log_timeout: Duration,

    /// The duration of an active leader's lease.
    ///
    /// When a follower or learner perceives an active leader, such as by receiving an AppendEntries
    /// message, it should not grant another candidate to become the leader during this period.
    pub(crate) leader_lease: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            election_timeout: Duration::from_millis(150),
            election_timeout_range_ms: (150, 300),
            smaller_log_timeout: Duration::from_millis(200),
            leader_lease: Duration::from_millis(150),
        }
    }
}

impl Config {
    /// PATCHED: draws `election_timeout` again from `[from, from + width)` milliseconds, the
    /// one place patches 8 (`VoteHandler::update_vote`) and 9 (`Engine::split_vote_retry`)
    /// draw it. A range of at most 1 ms (a fixed timeout, as in the project's deterministic
    /// simulation) leaves it alone.
    pub(crate) fn redraw_election_timeout<RT: crate::AsyncRuntime>(&mut self, from: u64, width: u64) {
        use rand::Rng;
        if width > 1 {
            let ms = RT::thread_rng().gen_range(from..from + width);
            self.election_timeout = Duration::from_millis(ms);
        }
    }
}
