//! The status page: server-rendered HTML views of the cluster, served by each replica on its
//! plain-HTTP port (`--metrics-listen`, [`crate::http`]) beside `/metrics`.
//!
//! Routes: `/` (cluster, replicas, leader), `/nodes` (the GPU grid), `/nodes/{name}` (one
//! node: its GPUs and NVLink/PCIe matrix), `/queue` (pending and running jobs with reasons),
//! `/jobs/{id}` (a job: spec, history, attempts, logs), `/services` and
//! `/services/{tenant}/{name}` (services, their replicas, revisions and events) and
//! `/tenants` (usage against quota).
//!
//! Layout: one file per page, each a pure `render_*` function from the replica's applied state
//! (and a [`View`] of this replica) to HTML: no I/O, unit-tested on built states. [`handlers`]
//! reads the replica and, for a job's logs, its agent, then calls them. HTML comes from
//! `maud`, which escapes every interpolated string: a job name cannot inject markup.
//!
//! What the page shows is set by `--status-page` ([`Mode`]): on a replica without
//! authentication everything; with authentication on, nothing unless the operator asks for the
//! summary, which withholds what the gRPC API withholds from another tenant's user (job
//! names, commands, environment, working directory, container) and every job's logs.

pub mod cluster;
mod gpu;
pub mod handlers;
mod html;
pub mod job;
pub mod node;
pub mod nodes;
pub mod queue;
pub mod services;
pub mod tenants;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod services_tests;
#[cfg(test)]
mod tests;

use proto::v1 as pb;

use crate::scheduler::Board;
use crate::state::{ClusterState, Timestamp};

/// `--status-page`: what the status page shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatusPageFlag {
    /// `full` on a replica run with `--insecure`, `off` where authentication is on.
    Auto,
    /// Not served.
    Off,
    /// Everything but job names, commands, environment, working directory, container and logs.
    Summary,
    /// Everything, job logs included. Refused where authentication is on: the page is plain
    /// HTTP without authentication, and would show every tenant's work to anyone who reaches
    /// the port.
    Full,
}

/// What this replica serves, once the flag is resolved against its security.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    Summary,
    Full,
}

impl Mode {
    /// The mode for `flag` on a replica whose API enforces authentication (`secured`), or why
    /// that combination is refused.
    pub fn resolve(flag: StatusPageFlag, secured: bool) -> Result<Mode, String> {
        Ok(match (flag, secured) {
            (StatusPageFlag::Auto, false) | (StatusPageFlag::Full, false) => Mode::Full,
            (StatusPageFlag::Auto, true) | (StatusPageFlag::Off, _) => Mode::Off,
            (StatusPageFlag::Summary, _) => Mode::Summary,
            (StatusPageFlag::Full, true) => {
                return Err("--status-page full shows every tenant's job commands and logs over plain, unauthenticated HTTP, so it is refused while authentication is on: use --status-page summary (no names, commands or logs) or off".into());
            }
        })
    }

    /// Whether job names, commands, environment and logs are shown.
    pub fn shows_details(self) -> bool {
        self == Mode::Full
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Summary => "summary",
            Mode::Full => "full",
        }
    }
}

/// This replica as every page shows it, besides the state it applied.
pub struct View<'a> {
    /// The replica's own answer to `ClusterStatus` (`membership::status`).
    pub status: &'a pb::ClusterStatusResponse,
    /// The leader's reasons for pending jobs (None on a follower, or before a pass).
    pub board: Option<&'a Board>,
    /// This replica's clock, ms since the Unix epoch.
    pub now: Timestamp,
    pub mode: Mode,
}

impl View<'_> {
    pub fn is_leader(&self) -> bool {
        self.status.leader != 0 && self.status.leader == self.status.id
    }

    /// The leader's client address, when some replica is known to lead.
    pub fn leader_address(&self) -> Option<&str> {
        let leader = self.status.leader;
        self.status
            .members
            .iter()
            .find(|m| m.id == leader && leader != 0)
            .map(|m| m.address.as_str())
    }
}

/// A state and a view of it: what every `render_*` reads.
pub struct Page<'a> {
    pub cluster: &'a ClusterState,
    pub view: View<'a>,
}
