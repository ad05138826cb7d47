//! The gRPC health protocol (`grpc.health.v1.Health`, tonic-health): what Kubernetes' `grpc`
//! probes, load balancers and `grpc_health_probe` ask a replica (deploy/kubernetes).
//!
//! Two answers, under different service names:
//!
//! - **Readiness**, service `""` (the whole server, what a probe asks when it names no
//!   service) and the client and agent APIs' own names: SERVING while this replica is a
//!   member of the cluster, knows a leader that it hears from (or, leading, has heard from a
//!   quorum within `max_quorum_silence`), and has applied all but at most `max_apply_lag` of
//!   the entries it knows are committed. Readiness steers clients (a Service sends them only
//!   to ready replicas) and the StatefulSet's rolling update, which restarts the next replica
//!   only once the one before is ready again: a rollout does not take a second replica down
//!   while the first still catches up.
//! - **Liveness**, service [`LIVENESS`] and the Raft peer service's name: SERVING while the
//!   process answers and its Raft core runs. It does not depend on a leader or on peers:
//!   restarting a replica that is cut off from the others brings nothing back, so a partition
//!   fails readiness only. A Raft core that stopped on its own (a storage error openraft
//!   treats as fatal) fails liveness, and a restart is the remedy. A replica removed from the
//!   cluster stays live and never ready: restarting it would not make it a member again.
//!
//! Peers keep calling a replica that is not ready (Raft must reach it to catch it up), so
//! nothing here refuses a call: the answers are advice for whoever routes and restarts.
//!
//! Kubernetes' `grpc` probes speak plaintext HTTP/2 only, while the replica's port is mutual
//! TLS: [`ReplicaHealth::serve_plaintext`] serves the health service, and nothing else, on a
//! port of its own. Its answers say only SERVING or NOT_SERVING.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use crate::config::ReplicaConfig;
use crate::raft::NodeId;
use crate::replica::Replica;

/// The service name whose status is liveness (readiness is `""`, the whole server).
pub const LIVENESS: &str = "liveness";
/// The service name whose status is readiness: the whole server, as the protocol defines it.
pub const READINESS: &str = "";

/// Services that answer with readiness: clients and agents should go elsewhere while this
/// replica is not ready.
const READY_SERVICES: [&str; 3] = [
    READINESS,
    proto::v1::control_plane_server::SERVICE_NAME,
    proto::agent::agent_api_server::SERVICE_NAME,
];
/// Services that answer with liveness: peers must reach a replica that is not ready.
const LIVE_SERVICES: [&str; 2] = [LIVENESS, proto::raft::raft_peer_server::SERVICE_NAME];

/// When a replica counts as ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthSettings {
    /// Ready only while at most this many committed entries wait to be applied here.
    pub max_apply_lag: u64,
    /// A leader is ready only while a quorum acknowledged it within this long (the leader
    /// loops refuse agents' leases after the same silence).
    pub max_quorum_silence: Duration,
    /// How often the status is recomputed (reachability and quorum silence change with time
    /// alone, so this is a poll, not only a reaction to Raft's metrics).
    pub interval: Duration,
}

impl HealthSettings {
    /// An entry holds up to a few hundred submissions and applies in well under a
    /// millisecond; a replica this far behind is replaying or catching up, not serving.
    pub const DEFAULT_MAX_APPLY_LAG: u64 = 256;
    /// Well under the shortest probe period Kubernetes allows (1 s).
    pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);

    pub fn for_config(config: &ReplicaConfig) -> HealthSettings {
        HealthSettings {
            max_apply_lag: Self::DEFAULT_MAX_APPLY_LAG,
            max_quorum_silence: config.leader.max_quorum_silence,
            interval: Self::DEFAULT_INTERVAL,
        }
    }
}

/// Who this replica takes to be the leader, and whether that looks current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaderView {
    /// No leader known (an election is under way, or this replica hears from nobody).
    Unknown,
    /// This replica leads; a quorum last acknowledged it this many ms ago (`None`: not yet).
    Me {
        millis_since_quorum_ack: Option<u64>,
    },
    /// Another replica leads; `heard`: it called or answered within the peer window.
    Other { id: NodeId, heard: bool },
}

/// What the status is computed from: a snapshot of the replica's Raft state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    /// The Raft core runs (openraft reports no fatal error and its metrics are still sent).
    pub raft_running: bool,
    /// This replica learned that it was removed from the cluster.
    pub removed: bool,
    /// This replica is in the membership (a voter or a learner).
    pub member: bool,
    pub leader: LeaderView,
    /// Last log index applied to the state machine (0: none).
    pub applied: u64,
    /// Highest log index this replica knows is committed (0: none).
    pub committed: u64,
}

/// Why a replica is not ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotReady {
    RaftStopped,
    Removed,
    NotAMember,
    NoLeader,
    LeaderSilent {
        leader: NodeId,
    },
    NoQuorum {
        millis_since_quorum_ack: Option<u64>,
    },
    ApplyBehind {
        applied: u64,
        committed: u64,
    },
}

impl fmt::Display for NotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotReady::RaftStopped => write!(f, "the Raft core has stopped"),
            NotReady::Removed => write!(f, "this replica was removed from the cluster"),
            NotReady::NotAMember => write!(f, "this replica is not (yet) a member of the cluster"),
            NotReady::NoLeader => write!(f, "no leader is known"),
            NotReady::LeaderSilent { leader } => {
                write!(f, "leader {leader} has not been heard from lately")
            }
            NotReady::NoQuorum {
                millis_since_quorum_ack: Some(ms),
            } => write!(f, "leading, but no quorum acknowledged it for {ms} ms"),
            NotReady::NoQuorum {
                millis_since_quorum_ack: None,
            } => write!(f, "leading, but no quorum has acknowledged it yet"),
            NotReady::ApplyBehind { applied, committed } => write!(
                f,
                "applied up to {applied}, {} committed entries behind {committed}",
                committed - applied
            ),
        }
    }
}

/// The statuses for one observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub live: bool,
    pub ready: Result<(), NotReady>,
}

impl Verdict {
    pub fn readiness(&self) -> ServingStatus {
        serving(self.ready.is_ok())
    }

    pub fn liveness(&self) -> ServingStatus {
        serving(self.live)
    }
}

fn serving(yes: bool) -> ServingStatus {
    if yes {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// The status rules (module docs), as a pure function.
pub fn assess(o: &Observation, s: &HealthSettings) -> Verdict {
    if !o.raft_running {
        // A removed replica shuts its own Raft down on purpose; it stays live.
        let why = if o.removed {
            NotReady::Removed
        } else {
            NotReady::RaftStopped
        };
        return Verdict {
            live: o.removed,
            ready: Err(why),
        };
    }
    let ready = if o.removed {
        Err(NotReady::Removed)
    } else if !o.member {
        Err(NotReady::NotAMember)
    } else {
        match o.leader {
            LeaderView::Unknown => Err(NotReady::NoLeader),
            LeaderView::Other { id, heard: false } => Err(NotReady::LeaderSilent { leader: id }),
            LeaderView::Me {
                millis_since_quorum_ack,
            } if millis_since_quorum_ack
                .is_none_or(|ms| ms > s.max_quorum_silence.as_millis() as u64) =>
            {
                Err(NotReady::NoQuorum {
                    millis_since_quorum_ack,
                })
            }
            _ if o.committed.saturating_sub(o.applied) > s.max_apply_lag => {
                Err(NotReady::ApplyBehind {
                    applied: o.applied,
                    committed: o.committed,
                })
            }
            _ => Ok(()),
        }
    };
    Verdict { live: true, ready }
}

/// Reads the observation off a running replica.
pub fn observe(r: &Replica, metrics_open: bool) -> Observation {
    let m = r.raft.metrics().borrow().clone();
    let leader = match m.current_leader {
        None => LeaderView::Unknown,
        Some(l) if l == r.id => LeaderView::Me {
            millis_since_quorum_ack: m.millis_since_quorum_ack,
        },
        Some(l) => LeaderView::Other {
            id: l,
            heard: r.peers.reachable(l),
        },
    };
    Observation {
        raft_running: metrics_open && m.running_state.is_ok(),
        removed: r.removed().is_some(),
        member: m.membership_config.membership().get_node(&r.id).is_some(),
        leader,
        applied: m.last_applied.map(|l| l.index).unwrap_or(0),
        committed: r.commit_index(),
    }
}

/// The health service of one replica and the statuses it serves.
#[derive(Clone)]
pub struct ReplicaHealth {
    reporter: HealthReporter,
}

impl ReplicaHealth {
    /// Statuses before anything is known: live (the process answers), not ready.
    pub async fn new() -> ReplicaHealth {
        let health = ReplicaHealth {
            reporter: HealthReporter::new(),
        };
        health
            .publish(&Verdict {
                live: true,
                ready: Err(NotReady::NotAMember),
            })
            .await;
        health
    }

    /// The `grpc.health.v1.Health` service, for a tonic router (the TLS port's or the
    /// plaintext probe port's).
    pub fn service(&self) -> HealthServer<HealthService> {
        HealthServer::new(HealthService::from_health_reporter(self.reporter.clone()))
    }

    /// Sets every service's status from `verdict`.
    pub async fn publish(&self, verdict: &Verdict) {
        for name in READY_SERVICES {
            self.reporter
                .set_service_status(name, verdict.readiness())
                .await;
        }
        for name in LIVE_SERVICES {
            self.reporter
                .set_service_status(name, verdict.liveness())
                .await;
        }
    }

    /// Binds `addr` now (so a port conflict is reported at start-up) and serves the health
    /// service alone there, in plaintext, until the task is aborted. Returns the bound
    /// address (useful with port 0).
    pub async fn serve_plaintext(
        &self,
        addr: &str,
    ) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} for health probes"))?;
        let bound = listener.local_addr().context("health listener address")?;
        let service = self.service();
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "health probe port stopped serving");
            }
        });
        Ok((bound, task))
    }

    /// Keeps the statuses of `replica` current (every `settings.interval`) until aborted;
    /// logs each change of readiness or liveness with its reason.
    pub fn spawn_reporter(
        &self,
        replica: Arc<Replica>,
        settings: HealthSettings,
    ) -> JoinHandle<()> {
        let health = self.clone();
        tokio::spawn(async move {
            let metrics = replica.raft.metrics();
            let mut shown: Option<(ServingStatus, ServingStatus)> = None;
            let mut tick = tokio::time::interval(settings.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                // `has_changed` fails once the Raft core dropped its metrics sender.
                let open = metrics.has_changed().is_ok();
                let verdict = assess(&observe(&replica, open), &settings);
                let statuses = (verdict.readiness(), verdict.liveness());
                if shown != Some(statuses) {
                    match verdict.ready {
                        Ok(()) => tracing::info!(id = replica.id, "replica ready"),
                        Err(why) => tracing::info!(
                            id = replica.id,
                            live = verdict.live,
                            "replica not ready: {why}"
                        ),
                    }
                    health.publish(&verdict).await;
                    shown = Some(statuses);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> HealthSettings {
        HealthSettings {
            max_apply_lag: 10,
            max_quorum_silence: Duration::from_millis(300),
            interval: Duration::from_millis(50),
        }
    }

    /// A follower that hears its leader and has applied everything.
    fn healthy_follower() -> Observation {
        Observation {
            raft_running: true,
            removed: false,
            member: true,
            leader: LeaderView::Other { id: 1, heard: true },
            applied: 100,
            committed: 100,
        }
    }

    fn ready(o: Observation) -> Result<(), NotReady> {
        let v = assess(&o, &settings());
        assert!(v.live, "{o:?} must be live");
        v.ready
    }

    #[test]
    fn a_caught_up_follower_that_hears_its_leader_is_ready_and_live() {
        let v = assess(&healthy_follower(), &settings());
        assert_eq!(v.ready, Ok(()));
        assert_eq!(v.readiness(), ServingStatus::Serving);
        assert_eq!(v.liveness(), ServingStatus::Serving);
    }

    #[test]
    fn without_a_leader_or_hearing_from_it_a_replica_is_live_but_not_ready() {
        let o = Observation {
            leader: LeaderView::Unknown,
            ..healthy_follower()
        };
        assert_eq!(ready(o), Err(NotReady::NoLeader));
        let o = Observation {
            leader: LeaderView::Other {
                id: 2,
                heard: false,
            },
            ..healthy_follower()
        };
        assert_eq!(ready(o), Err(NotReady::LeaderSilent { leader: 2 }));
    }

    #[test]
    fn a_leader_is_ready_only_while_a_quorum_acknowledges_it() {
        let leading = |ack| Observation {
            leader: LeaderView::Me {
                millis_since_quorum_ack: ack,
            },
            ..healthy_follower()
        };
        assert_eq!(ready(leading(Some(40))), Ok(()));
        assert_eq!(ready(leading(Some(300))), Ok(()));
        assert_eq!(
            ready(leading(Some(301))),
            Err(NotReady::NoQuorum {
                millis_since_quorum_ack: Some(301)
            })
        );
        assert_eq!(
            ready(leading(None)),
            Err(NotReady::NoQuorum {
                millis_since_quorum_ack: None
            })
        );
    }

    #[test]
    fn applying_more_than_the_lag_behind_the_commit_index_is_not_ready() {
        let at = |applied, committed| Observation {
            applied,
            committed,
            ..healthy_follower()
        };
        assert_eq!(ready(at(90, 100)), Ok(()), "exactly the lag is still ready");
        assert_eq!(
            ready(at(89, 100)),
            Err(NotReady::ApplyBehind {
                applied: 89,
                committed: 100
            })
        );
        // The committed index is saved lazily and may trail what was applied.
        assert_eq!(ready(at(120, 100)), Ok(()));
        // A fresh replica: nothing committed, nothing applied.
        assert_eq!(ready(at(0, 0)), Ok(()));
        // The lag rule holds for a leader too.
        let o = Observation {
            leader: LeaderView::Me {
                millis_since_quorum_ack: Some(1),
            },
            ..at(0, 500)
        };
        assert!(matches!(ready(o), Err(NotReady::ApplyBehind { .. })));
    }

    #[test]
    fn a_replica_outside_the_membership_is_not_ready() {
        let o = Observation {
            member: false,
            ..healthy_follower()
        };
        assert_eq!(ready(o), Err(NotReady::NotAMember));
    }

    #[test]
    fn a_removed_replica_stays_live_and_is_never_ready_even_once_its_raft_stopped() {
        let o = Observation {
            removed: true,
            ..healthy_follower()
        };
        assert_eq!(ready(o), Err(NotReady::Removed));
        let o = Observation {
            removed: true,
            raft_running: false,
            ..healthy_follower()
        };
        assert_eq!(ready(o), Err(NotReady::Removed));
    }

    #[test]
    fn a_raft_core_that_stopped_on_its_own_fails_liveness() {
        let o = Observation {
            raft_running: false,
            ..healthy_follower()
        };
        let v = assess(&o, &settings());
        assert!(!v.live);
        assert_eq!(v.ready, Err(NotReady::RaftStopped));
        assert_eq!(v.liveness(), ServingStatus::NotServing);
        assert_eq!(v.readiness(), ServingStatus::NotServing);
    }

    #[test]
    fn reasons_read_as_sentences() {
        let text = NotReady::ApplyBehind {
            applied: 5,
            committed: 305,
        }
        .to_string();
        assert!(text.contains("300 committed entries behind"), "{text}");
        assert!(
            NotReady::LeaderSilent { leader: 3 }
                .to_string()
                .contains("leader 3")
        );
    }

    /// The plaintext probe port answers as Kubernetes' `grpc` probe asks: readiness under
    /// `""`, liveness under `liveness`, the API names too, and NOT_FOUND for other names.
    #[tokio::test]
    async fn the_probe_port_serves_readiness_and_liveness_under_their_names() {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_check_response::ServingStatus as Wire;
        use tonic_health::pb::health_client::HealthClient;

        let health = ReplicaHealth::new().await;
        let (addr, task) = health.serve_plaintext("127.0.0.1:0").await.unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = HealthClient::new(channel);
        let mut ask = async |service: &str| {
            client
                .check(HealthCheckRequest {
                    service: service.to_owned(),
                })
                .await
                .map(|r| r.into_inner().status())
        };
        assert_eq!(ask(READINESS).await.unwrap(), Wire::NotServing);
        assert_eq!(ask(LIVENESS).await.unwrap(), Wire::Serving);
        health
            .publish(&assess(&healthy_follower(), &settings()))
            .await;
        assert_eq!(ask(READINESS).await.unwrap(), Wire::Serving);
        assert_eq!(
            ask(proto::v1::control_plane_server::SERVICE_NAME)
                .await
                .unwrap(),
            Wire::Serving
        );
        health
            .publish(&assess(
                &Observation {
                    raft_running: false,
                    ..healthy_follower()
                },
                &settings(),
            ))
            .await;
        assert_eq!(ask(LIVENESS).await.unwrap(), Wire::NotServing);
        assert_eq!(
            ask(proto::raft::raft_peer_server::SERVICE_NAME)
                .await
                .unwrap(),
            Wire::NotServing
        );
        assert_eq!(
            ask("no.such.Service").await.unwrap_err().code(),
            tonic::Code::NotFound
        );
        task.abort();
    }
}
