//! The seed's fault schedule, drawn up front from its RNG, and the task that applies it:
//! replica crashes (restarted over their disk), symmetric and one-way partitions between
//! replicas, a host cut off from the control plane (long enough, sometimes, for its lease and
//! grace to expire), host crashes, and bursts of message loss. Every fault ends by the close
//! of the fault window, after which the liveness budget starts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::net::Endpoint;
use super::params::Params;
use super::world::World;
use crate::raft::NodeId;
use crate::scheduler::score::SplitMix64;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fault {
    CrashReplica(NodeId),
    /// The replica can reach nobody and nobody can reach it.
    IsolateReplica(NodeId),
    /// Messages from the first replica to the second are dropped; the reverse path works.
    OneWay(NodeId, NodeId),
    /// The host's agent and the control plane cannot reach each other.
    PartitionHost(usize),
    CrashHost(usize),
    /// Message loss, in permille, on every link.
    Lossy(u64),
}

impl Fault {
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::CrashReplica(_) => "replica crash",
            Fault::IsolateReplica(_) => "replica partition (symmetric)",
            Fault::OneWay(..) => "replica partition (one-way)",
            Fault::PartitionHost(_) => "host partition",
            Fault::CrashHost(_) => "host crash",
            Fault::Lossy(_) => "message loss burst",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Scheduled {
    pub start_ms: u64,
    pub end_ms: u64,
    pub fault: Fault,
}

pub fn plan(rng: &mut SplitMix64, p: &Params) -> Vec<Scheduled> {
    let (lo, hi) = p.faults;
    let n = lo + rng.below(hi - lo + 1);
    let replicas: Vec<NodeId> = (1..=p.replicas).collect();
    let hosts = p.hosts.len() as u64;
    let (w0, w1) = p.fault_window_ms;
    let mut out = Vec::new();
    for _ in 0..n {
        let pick = |rng: &mut SplitMix64| replicas[rng.below(replicas.len() as u64) as usize];
        let fault = match rng.below(100) {
            0..=24 => Fault::CrashReplica(pick(rng)),
            25..=39 => Fault::IsolateReplica(pick(rng)),
            40..=54 => {
                let a = pick(rng);
                let mut b = pick(rng);
                if a == b {
                    b = replicas
                        [(replicas.iter().position(|r| *r == a).unwrap_or(0) + 1) % replicas.len()];
                }
                Fault::OneWay(a, b)
            }
            55..=74 => Fault::PartitionHost(rng.below(hosts) as usize),
            75..=84 => Fault::CrashHost(rng.below(hosts) as usize),
            _ => Fault::Lossy(100 + rng.below(200)),
        };
        let start_ms = w0 + rng.below(w1 - w0);
        let end_ms = (start_ms + 500 + rng.below(p.max_fault_ms)).min(w1 + p.max_fault_ms);
        out.push(Scheduled {
            start_ms,
            end_ms,
            fault,
        });
    }
    out.sort_by_key(|s| (s.start_ms, s.end_ms));
    out
}

/// When the last fault of the schedule ends.
pub fn end_ms(schedule: &[Scheduled]) -> u64 {
    schedule.iter().map(|s| s.end_ms).max().unwrap_or(0)
}

/// Applies the schedule: every start and end in time order.
pub async fn run(world: Arc<World>, schedule: Vec<Scheduled>) {
    let mut events: Vec<(u64, bool, usize)> = Vec::new();
    for (i, s) in schedule.iter().enumerate() {
        events.push((s.start_ms, true, i));
        events.push((s.end_ms, false, i));
    }
    events.sort();
    // Crash faults on one replica or host may overlap: it is down while any of them lasts.
    let mut down_replicas: BTreeMap<NodeId, u32> = BTreeMap::new();
    let mut down_hosts: BTreeMap<usize, u32> = BTreeMap::new();
    let mut loss_stack: Vec<u64> = Vec::new();
    let base_loss = world.cluster.net.loss();
    for (at, start, i) in events {
        let wait = at.saturating_sub(world.now_ms());
        tokio::time::sleep(Duration::from_millis(wait)).await;
        if world.stopped() {
            return;
        }
        let fault = &schedule[i].fault;
        world.observer().record(
            world.now_ms(),
            (if start { "fault" } else { "heal" }, fault),
        );
        let net = &world.cluster.net;
        match fault {
            Fault::CrashReplica(id) => {
                let n = down_replicas.entry(*id).or_default();
                if start {
                    *n += 1;
                    if *n == 1 {
                        world.cluster.crash(*id).await;
                    }
                } else {
                    *n -= 1;
                    if *n == 0
                        && let Err(e) = world.cluster.start(*id).await
                    {
                        let at = world.now_ms();
                        world.observer().violation(
                            "replica restarts",
                            at,
                            format!("replica {id} failed to restart over its disk: {e}"),
                        );
                    }
                }
            }
            Fault::IsolateReplica(id) => {
                let me = Endpoint::Replica(*id);
                for other in peers_of(&world, me) {
                    toggle(net, me, other, start);
                    toggle(net, other, me, start);
                }
            }
            Fault::OneWay(a, b) => {
                toggle(net, Endpoint::Replica(*a), Endpoint::Replica(*b), start);
            }
            Fault::PartitionHost(h) => {
                let me = Endpoint::Agent(*h);
                for id in world.cluster.ids() {
                    toggle(net, me, Endpoint::Replica(id), start);
                    toggle(net, Endpoint::Replica(id), me, start);
                }
            }
            Fault::CrashHost(h) => {
                let n = down_hosts.entry(*h).or_default();
                if start {
                    *n += 1;
                } else {
                    *n -= 1;
                }
                world.set_host_down(*h, *n > 0);
            }
            Fault::Lossy(permille) => {
                if start {
                    loss_stack.push(*permille);
                } else if let Some(pos) = loss_stack.iter().position(|p| p == permille) {
                    loss_stack.remove(pos);
                }
                net.set_loss(loss_stack.iter().copied().max().unwrap_or(base_loss));
            }
        }
    }
}

fn toggle(net: &super::net::SimNet, from: Endpoint, to: Endpoint, cut: bool) {
    if cut {
        net.cut(from, to);
    } else {
        net.heal(from, to);
    }
}

/// Every endpoint other than `me`: replicas, hosts and clients.
fn peers_of(world: &World, me: Endpoint) -> Vec<Endpoint> {
    let mut all: Vec<Endpoint> = world
        .cluster
        .ids()
        .into_iter()
        .map(Endpoint::Replica)
        .collect();
    all.extend((0..world.params.hosts.len()).map(Endpoint::Agent));
    all.extend((0..world.params.clients).map(Endpoint::Client));
    all.retain(|e| *e != me);
    all
}
