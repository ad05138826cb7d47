//! The fault schedule and its injection into a [`LocalCluster`] of real processes.
//!
//! Faults run one at a time, spread over the run; each one ends with the cluster whole again
//! (every replica running and caught up, one agreed leader, every agent running and reachable)
//! so the next fault starts from a known state and its failover time is its own.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use control_plane::client::{Client, Credentials, with_timeout};
use control_plane::local_cluster::{LocalCluster, StartMode};
use proto::v1 as pb;

use crate::history::{Event, FaultKind, Recorder, now_ms};
use crate::partition::Partitioner;
use crate::workload::Rng;

/// How many faults of each kind a run injects.
#[derive(Debug, Clone, Default)]
pub struct FaultCounts {
    pub counts: BTreeMap<FaultKind, usize>,
}

impl FaultCounts {
    pub fn total(&self) -> usize {
        self.counts.values().sum()
    }
    pub fn get(&self, k: FaultKind) -> usize {
        self.counts.get(&k).copied().unwrap_or(0)
    }
    pub fn needs_partitions(&self) -> bool {
        self.get(FaultKind::LeaderPartition) + self.get(FaultKind::AgentPartition) > 0
    }
}

/// The faults in the order they are injected: a deterministic shuffle of the counts.
pub fn schedule(counts: &FaultCounts, rng: &mut Rng) -> Vec<FaultKind> {
    let mut list: Vec<FaultKind> = counts
        .counts
        .iter()
        .flat_map(|(k, n)| std::iter::repeat_n(*k, *n))
        .collect();
    for i in (1..list.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        list.swap(i, j);
    }
    list
}

/// How long faults last. The agent partition outlasts the node lease plus grace, so the
/// control plane declares the node lost and reschedules its jobs while the agent, cut off,
/// must have fenced (stopped) them itself.
#[derive(Debug, Clone)]
pub struct Timings {
    pub follower_down: Duration,
    pub pause_after_failover: Duration,
    pub partition_after_failover: Duration,
    pub agent_partition: Duration,
    pub agent_down_max: Duration,
    /// Limit for the cluster to become whole again after a fault.
    pub recover: Duration,
}

impl Default for Timings {
    fn default() -> Timings {
        Timings {
            follower_down: Duration::from_millis(500),
            pause_after_failover: Duration::from_millis(1000),
            partition_after_failover: Duration::from_millis(1000),
            agent_partition: Duration::from_millis(4500),
            agent_down_max: Duration::from_millis(4000),
            recover: Duration::from_secs(60),
        }
    }
}

pub struct Injector<'a> {
    pub cluster: &'a mut LocalCluster,
    pub partitioner: Option<&'a Partitioner>,
    pub replica_ips: BTreeMap<u64, Ipv4Addr>,
    pub agent_ips: BTreeMap<String, Ipv4Addr>,
    pub recorder: Recorder,
    pub rng: Rng,
    pub timings: Timings,
    /// Failover times measured so far (ms), for progress lines.
    pub failovers_ms: Vec<f64>,
}

impl Injector<'_> {
    pub async fn inject(&mut self, kind: FaultKind) -> anyhow::Result<()> {
        match kind {
            FaultKind::LeaderKill => self.leader_fault(kind).await,
            FaultKind::LeaderPause => self.leader_fault(kind).await,
            FaultKind::LeaderPartition => self.leader_fault(kind).await,
            FaultKind::FollowerKill => self.follower_kill().await,
            FaultKind::AgentPartition => self.agent_partition().await,
            FaultKind::AgentKill => self.agent_kill().await,
            FaultKind::ReplicaWipe => self.replica_wipe().await,
            FaultKind::RollingRestart => self.rolling_restart().await,
        }
    }

    fn fault(&self, kind: FaultKind, target: String, at_ms: u64, detail: String) {
        self.recorder.record(&Event::Fault {
            kind,
            target,
            at_ms,
            healed_ms: Some(now_ms()),
            detail,
        });
    }

    async fn leader(&self) -> anyhow::Result<pb::ClusterStatusResponse> {
        self.cluster
            .wait_for_leader(self.timings.recover)
            .await
            .context("waiting for the cluster to agree on a leader")
    }

    /// SIGKILL, SIGSTOP or isolate the leader; time the first write committed through the
    /// others; then undo the fault and wait for the cluster to be whole.
    async fn leader_fault(&mut self, kind: FaultKind) -> anyhow::Result<()> {
        let before = self.leader().await?;
        let old = before.leader;
        let survivors: Vec<String> = self
            .cluster
            .replicas
            .values()
            .filter(|r| r.id != old)
            .map(|r| r.addr.clone())
            .collect();
        let injected_ms = now_ms();
        let t0 = Instant::now();
        match kind {
            FaultKind::LeaderKill => self.cluster.kill(old)?,
            FaultKind::LeaderPause => self.cluster.signal(old, libc::SIGSTOP)?,
            FaultKind::LeaderPartition => {
                let p = self.partitioner.context("partitions are disabled")?;
                p.isolate(self.replica_ips[&old])?;
            }
            _ => bail!("{kind:?} is not a leader fault"),
        }
        let probe = probe_commit(
            &survivors,
            &self.cluster.credentials()?,
            self.timings.recover,
        )
        .await;
        let elapsed = t0.elapsed();
        // Undo the fault before looking at the result, so an error leaves no fault behind.
        let hold = match kind {
            FaultKind::LeaderPause => self.timings.pause_after_failover,
            FaultKind::LeaderPartition => self.timings.partition_after_failover,
            _ => Duration::ZERO,
        };
        tokio::time::sleep(hold).await;
        match kind {
            FaultKind::LeaderKill => self.cluster.start(old, StartMode::Initial)?,
            FaultKind::LeaderPause => self.cluster.signal(old, libc::SIGCONT)?,
            FaultKind::LeaderPartition => {
                if let Some(p) = self.partitioner {
                    p.heal(self.replica_ips[&old])?;
                }
            }
            _ => {}
        }
        let (new_leader, new_term, committed_ms) = probe?;
        self.recorder.record(&Event::Failover {
            fault: kind,
            old_leader: old,
            old_term: before.term,
            new_leader,
            new_term,
            injected_ms,
            committed_ms,
        });
        self.failovers_ms.push(elapsed.as_secs_f64() * 1000.0);
        self.fault(
            kind,
            format!("replica {old}"),
            injected_ms,
            format!(
                "leader {old} (term {}); replica {new_leader} committed a write {} ms later",
                before.term,
                committed_ms.saturating_sub(injected_ms)
            ),
        );
        self.whole_again().await
    }

    async fn follower_kill(&mut self) -> anyhow::Result<()> {
        let s = self.leader().await?;
        let victim = self.pick_follower(&s);
        let at = now_ms();
        self.cluster.kill(victim)?;
        tokio::time::sleep(self.timings.follower_down).await;
        self.cluster.start(victim, StartMode::Initial)?;
        self.fault(
            FaultKind::FollowerKill,
            format!("replica {victim}"),
            at,
            format!("SIGKILL, restarted after {:?}", self.timings.follower_down),
        );
        self.whole_again().await
    }

    async fn replica_wipe(&mut self) -> anyhow::Result<()> {
        let s = self.leader().await?;
        let victim = self.pick_follower(&s);
        let at = now_ms();
        self.cluster.kill(victim)?;
        let dir = self.cluster.replicas[&victim].data_dir.clone();
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("wiping replica {victim}'s data directory {dir:?}"))?;
        // The operator's procedure: take the lost replica out of the membership, then let it
        // join again empty. Rejoining under its old membership entry makes the leader see the
        // follower's log go backwards, which openraft refuses (its leader task panics in debug
        // builds, see README "Findings").
        let survivors: Vec<String> = self
            .cluster
            .replicas
            .values()
            .filter(|r| r.id != victim)
            .map(|r| r.addr.clone())
            .collect();
        let mut client = Client::new(&survivors, &self.cluster.credentials()?)?;
        client.deadline = self.timings.recover;
        client
            .call(|mut c, t| async move {
                c.remove_replica(with_timeout(
                    pb::RemoveReplicaRequest {
                        id: victim,
                        force: false,
                    },
                    t,
                ))
                .await
            })
            .await
            .with_context(|| format!("removing wiped replica {victim} from the membership"))?;
        // An empty replica must not bootstrap a cluster of its own: it joins through the leader.
        let leader = self.leader_among(&survivors).await?;
        let via = self.cluster.addr(leader);
        self.cluster.start(victim, StartMode::Join(via))?;
        self.fault(
            FaultKind::ReplicaWipe,
            format!("replica {victim}"),
            at,
            "SIGKILL, removed from the membership, data directory deleted, joined again".into(),
        );
        self.whole_again().await
    }

    async fn rolling_restart(&mut self) -> anyhow::Result<()> {
        let s = self.leader().await?;
        let at = now_ms();
        // Followers first, the leader last: one leader change, as an operator would do it.
        let mut order: Vec<u64> = self
            .cluster
            .replicas
            .keys()
            .copied()
            .filter(|id| *id != s.leader)
            .collect();
        order.push(s.leader);
        for id in &order {
            self.cluster.stop(*id, Duration::from_secs(5))?;
            self.cluster.start(*id, StartMode::Initial)?;
            self.whole_again().await?;
        }
        self.fault(
            FaultKind::RollingRestart,
            "all replicas".into(),
            at,
            format!("SIGTERM and restart, in order {order:?}"),
        );
        Ok(())
    }

    async fn agent_partition(&mut self) -> anyhow::Result<()> {
        let name = self.pick_agent().await;
        let p = self.partitioner.context("partitions are disabled")?;
        let at = now_ms();
        p.isolate(self.agent_ips[&name])?;
        tokio::time::sleep(self.timings.agent_partition).await;
        p.heal(self.agent_ips[&name])?;
        self.fault(
            FaultKind::AgentPartition,
            format!("agent {name}"),
            at,
            format!(
                "cut off from every replica for {:?}",
                self.timings.agent_partition
            ),
        );
        Ok(())
    }

    async fn agent_kill(&mut self) -> anyhow::Result<()> {
        let name = self.pick_agent().await;
        let down = Duration::from_millis(
            300 + self
                .rng
                .below(self.timings.agent_down_max.as_millis() as u64),
        );
        let at = now_ms();
        self.cluster.kill_agent(&name)?;
        tokio::time::sleep(down).await;
        self.cluster.start_agent(&name)?;
        self.fault(
            FaultKind::AgentKill,
            format!("agent {name}"),
            at,
            format!("SIGKILL, restarted after {} ms", down.as_millis()),
        );
        Ok(())
    }

    /// The leader as the given replicas see it (while another replica is down).
    async fn leader_among(&self, addrs: &[String]) -> anyhow::Result<u64> {
        let mut client = Client::new(addrs, &self.cluster.credentials()?)?;
        client.deadline = self.timings.recover;
        let deadline = Instant::now() + self.timings.recover;
        loop {
            let s = client
                .call(|mut c, t| async move {
                    c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
                        .await
                })
                .await?;
            if s.leader != 0 {
                return Ok(s.leader);
            }
            if Instant::now() > deadline {
                bail!(
                    "no leader among {addrs:?} within {:?}",
                    self.timings.recover
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn pick_follower(&mut self, s: &pb::ClusterStatusResponse) -> u64 {
        let followers: Vec<u64> = self
            .cluster
            .replicas
            .keys()
            .copied()
            .filter(|id| *id != s.leader)
            .collect();
        followers[self.rng.below(followers.len() as u64) as usize]
    }

    /// The agent running the most allocations (a random one when none runs anything): a
    /// fault on an idle host tests little, one on a busy host tests fencing and rescheduling.
    async fn pick_agent(&mut self) -> String {
        let names: Vec<String> = self.cluster.agents.keys().cloned().collect();
        let random = names[self.rng.below(names.len() as u64) as usize].clone();
        let Ok(mut client) = self.cluster.client() else {
            return random;
        };
        client.deadline = Duration::from_secs(2);
        let req = pb::ListJobsRequest {
            states: vec!["running".into()],
            ..Default::default()
        };
        let Ok(jobs) = client
            .call(|mut c, t| {
                let r = req.clone();
                async move { c.list_jobs(with_timeout(r, t)).await }
            })
            .await
        else {
            return random;
        };
        let mut load: BTreeMap<String, usize> = BTreeMap::new();
        for a in jobs.jobs.iter().flat_map(|j| j.allocations.iter()) {
            *load.entry(a.node.clone()).or_default() += 1;
        }
        load.into_iter()
            .filter(|(n, _)| names.contains(n))
            .max_by_key(|(_, count)| *count)
            .map_or(random, |(n, _)| n)
    }

    /// Every replica running, one agreed leader, every replica caught up with it.
    pub async fn whole_again(&mut self) -> anyhow::Result<()> {
        for (id, status) in self.cluster.reap_exited() {
            eprintln!("chaos: replica {id} had exited by itself ({status}); restarting it");
            self.cluster.start(id, StartMode::Initial)?;
        }
        let s = self.leader().await?;
        let deadline = Instant::now() + self.timings.recover;
        for id in self.cluster.replicas.keys().copied().collect::<Vec<_>>() {
            loop {
                if let Some(r) = self.cluster.status(id).await
                    && r.applied_index >= s.commit_index
                {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "replica {id} did not catch up to index {} within {:?}",
                        s.commit_index,
                        self.timings.recover
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }
}

/// Writes through `survivors` until one commits; returns (leader, term, commit time in ms).
/// The write is a tenant update: it goes through the Raft log like any decision but adds no
/// job to the workload the checker looks at.
pub async fn probe_commit(
    survivors: &[String],
    credentials: &Credentials,
    timeout: Duration,
) -> anyhow::Result<(u64, u64, u64)> {
    let mut client = Client::new(survivors, credentials)?;
    client.attempt_timeout = Duration::from_millis(300);
    client.deadline = timeout;
    let tenant = pb::Tenant {
        name: "chaos-probe".into(),
        weight: 1,
        quota_gpus: 0,
        max_gpus: 0,
    };
    client
        .call(|mut c, t| {
            let r = tenant.clone();
            async move { c.put_tenant(with_timeout(r, t)).await }
        })
        .await
        .context("no write committed through the remaining replicas")?;
    let committed_ms = now_ms();
    let s = client
        .call(|mut c, t| async move {
            c.cluster_status(with_timeout(pb::ClusterStatusRequest {}, t))
                .await
        })
        .await?;
    Ok((s.leader, s.term, committed_ms))
}
