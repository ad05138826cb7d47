//! The fault schedule and its injection into a [`LocalCluster`] of real processes.
//!
//! Faults run one at a time, spread over the run; each one ends with the cluster whole again
//! (every replica running and caught up, one agreed leader, every agent running and reachable)
//! so the next fault starts from a known state and its failover time is its own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use control_plane::client::{Client, Credentials, with_timeout};
use control_plane::local_cluster::{LocalCluster, StartMode};
use proto::v1 as pb;

use crate::history::{Event, FaultKind, Member, Recorder, now_ms};
use crate::members::{Build, Endpoints, next_build, next_replica_id, removal_target};
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
    /// How long a removed replica is watched for campaigning (its term must not climb):
    /// several election timeouts (90-150 ms).
    pub removed_watch: Duration,
    /// Limit for a removed replica to say it was removed, or exit.
    pub removed_stop: Duration,
    /// SIGTERM to SIGKILL when stopping a replica of this build, and of the previous release
    /// (whose leader may hang on SIGTERM, docs/UPGRADING.md).
    pub stop_grace: Duration,
    pub previous_stop_grace: Duration,
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
            removed_watch: Duration::from_millis(1000),
            removed_stop: Duration::from_secs(10),
            stop_grace: Duration::from_secs(5),
            previous_stop_grace: Duration::from_secs(2),
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
    /// The current members' addresses, which the workload and the observer follow.
    pub endpoints: Endpoints,
    /// Addresses kept for replicas added during the run, by id (the agents were given them
    /// all at start, as they would be given every address a replica may take).
    pub spare_addrs: BTreeMap<u64, (String, Ipv4Addr)>,
    /// Every replica id used in this run, removed ones included (ids are never reused).
    pub ever_used: BTreeSet<u64>,
    /// (process, log) of removed replicas, still searched for panics at the end.
    pub retired: Arc<Mutex<Vec<(String, PathBuf)>>>,
    /// Membership changes done so far.
    pub replica_changes: usize,
    pub builds: Builds,
}

/// The builds `replica_upgrade` restarts replicas on.
#[derive(Debug, Clone)]
pub struct Builds {
    /// This tree's build: the program that runs `replica` (the chaos binary).
    pub current: PathBuf,
    /// A program that runs the previous release's replica with the same arguments (a wrapper
    /// that drops `replica` and execs its `control-plane`), and that `control-plane` itself.
    pub previous: Option<(PathBuf, PathBuf)>,
    /// Where fresh copies of the current build are installed.
    pub bin_dir: PathBuf,
    /// The build each replica runs (absent: the current one).
    pub running: BTreeMap<u64, Build>,
    /// Copies installed so far (names the next one), and rollbacks to the previous release.
    pub copies: usize,
    pub rollbacks: usize,
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
            FaultKind::ReplicaAddRemove => self.replica_add_remove().await,
            FaultKind::ReplicaUpgrade => self.replica_upgrade().await,
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
            FaultKind::LeaderKill => self.restart(old)?,
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
        self.restart(victim)?;
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
            self.restart(*id)?;
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

    /// Starts a member again on its data directory: an initial member with `--peers` (which
    /// does not bootstrap a directory that holds a cluster), a replica added during the run
    /// with neither `--peers` nor `--join` (it is not among the initial peers, and its
    /// directory knows the cluster).
    pub fn restart(&mut self, id: u64) -> anyhow::Result<()> {
        let mode = if id <= 3 {
            StartMode::Initial
        } else {
            StartMode::Pristine
        };
        self.cluster.start(id, mode)
    }

    /// The addresses of the current members, for clients.
    fn member_addrs(&self, except: Option<u64>) -> Vec<String> {
        self.cluster
            .replicas
            .values()
            .filter(|r| Some(r.id) != except)
            .map(|r| r.addr.clone())
            .collect()
    }

    /// Start a new replica empty, add it as `gpuctl cluster add` does (a learner, a voter once
    /// caught up), then remove another member (the leader on every other change): the
    /// removed process must say it was removed or exit, and must not campaign. Ends with three
    /// caught-up voters, the new one among them, and every client following the new members.
    async fn replica_add_remove(&mut self) -> anyhow::Result<()> {
        let at = now_ms();
        let id = next_replica_id(&self.ever_used);
        let (addr, ip) = self.spare_addrs.get(&id).cloned().with_context(|| {
            format!("no address was kept for replica {id}: more changes than --replica-changes")
        })?;
        let others = self.member_addrs(None);
        self.ever_used.insert(id);
        self.replica_ips.insert(id, ip);
        self.cluster.add_replica_at(id, &addr)?;
        self.cluster.start(id, StartMode::Pristine)?;

        // As `gpuctl cluster add`: the leader answers once the replica is a voter, or says why
        // not (a DeadlineExceeded from it is final).
        let mut client = Client::new(&others, &self.cluster.credentials()?)?;
        client.attempt_timeout = self.timings.recover;
        client.deadline = self.timings.recover;
        client.retry_deadline_exceeded = false;
        let t_add = Instant::now();
        let req = pb::AddReplicaRequest {
            id,
            address: addr.clone(),
            learner_only: false,
            force: false,
        };
        // A leader change during the add (an election storm on a loaded machine) fails it;
        // the operator runs it again, and so does the harness (an add of a learner goes on
        // from where it stopped).
        let deadline = t_add + self.timings.recover;
        let mut add_tries = 0;
        let s = loop {
            add_tries += 1;
            let added = client
                .call(|mut c, t| {
                    let r = req.clone();
                    async move { c.add_replica(with_timeout(r, t)).await }
                })
                .await;
            let s = self.leader().await?;
            if s.members.iter().any(|m| m.id == id && m.role == "voter") {
                break s;
            }
            match added {
                Ok(_) => bail!(
                    "AddReplica answered, yet replica {id} is not a voter: {:?}",
                    s.members
                ),
                Err(e) if Instant::now() > deadline => {
                    return Err(anyhow::anyhow!("{e}"))
                        .with_context(|| format!("adding replica {id} at {addr}"));
                }
                Err(e) => {
                    eprintln!("chaos: adding replica {id} failed ({e}); trying again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        let promoted_after = t_add.elapsed();

        let members: Vec<u64> = self.cluster.replicas.keys().copied().collect();
        let victim = removal_target(self.replica_changes, &members, s.leader, id, &mut self.rng)
            .context("no replica to remove")?;
        let was_leader = victim == s.leader;
        let survivors = self.member_addrs(Some(victim));
        let mut client = Client::new(&self.member_addrs(None), &self.cluster.credentials()?)?;
        client.attempt_timeout = self.timings.recover;
        client.deadline = self.timings.recover;
        client.retry_deadline_exceeded = false;
        let t_remove = Instant::now();
        let mut remove_tries = 0;
        loop {
            remove_tries += 1;
            let removed = client
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
                .await;
            let Err(e) = removed else { break };
            // Already gone (a retried call finds it "not a member")? Ask the others.
            let leader = self.leader_among(&survivors).await?;
            let gone = self
                .cluster
                .status(leader)
                .await
                .is_some_and(|s| !s.members.iter().any(|m| m.id == victim));
            if gone {
                break;
            }
            if t_remove.elapsed() > self.timings.recover {
                return Err(anyhow::anyhow!("{e}"))
                    .with_context(|| format!("removing replica {victim}"));
            }
            eprintln!("chaos: removing replica {victim} failed ({e}); trying again");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let answered = Instant::now();

        // The removed process must say it was removed (or exit), and then stay out.
        let (stopped_after, mut exited, term_when_stopped) = loop {
            if self.cluster.wait_exit(victim, Duration::ZERO).is_ok() {
                break (Some(answered.elapsed()), true, 0);
            }
            if let Some(r) = self.cluster.status(victim).await
                && !r.removed.is_empty()
            {
                break (Some(answered.elapsed()), false, r.term);
            }
            if answered.elapsed() > self.timings.removed_stop {
                let term = self.cluster.status(victim).await.map_or(0, |r| r.term);
                break (None, false, term);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let mut term_after = term_when_stopped;
        if !exited {
            tokio::time::sleep(self.timings.removed_watch).await;
            if self.cluster.wait_exit(victim, Duration::ZERO).is_ok() {
                exited = true;
            } else if let Some(r) = self.cluster.status(victim).await {
                term_after = r.term;
            }
        }
        // Done with it: stop the inert process and forget it (its log is still searched for
        // panics); clients follow the remaining members.
        self.cluster.stop(victim, self.timings.stop_grace)?;
        if let Some(r) = self.cluster.replicas.remove(&victim) {
            self.retired
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((format!("replica {victim}"), r.log_path));
        }
        self.builds.running.remove(&victim);
        self.endpoints.set(self.cluster.endpoints());
        self.replica_changes += 1;

        // Three caught-up voters again: the new one and the two that stayed.
        self.whole_again().await?;
        let want: BTreeSet<u64> = self.cluster.replicas.keys().copied().collect();
        let ms = |d: Duration| d.as_millis() as u64;
        self.recorder.record(&Event::MemberChange {
            at_ms: at,
            added: id,
            promoted_after_ms: ms(promoted_after),
            removed: victim,
            removed_was_leader: was_leader,
            stopped_after_ms: stopped_after.map(ms),
            exited_by_itself: exited,
            term_when_stopped,
            term_after_watch: term_after,
            watched_ms: ms(self.timings.removed_watch),
            members: self
                .cluster
                .replicas
                .values()
                .map(|r| Member {
                    name: format!("replica {}", r.id),
                    addr: r.addr.clone(),
                })
                .collect(),
        });
        self.fault(
            FaultKind::ReplicaAddRemove,
            format!("replica {id} added, replica {victim} removed"),
            at,
            format!(
                "replica {id} a voter {} ms after AddReplica ({add_tries} call(s)); replica \
                 {victim}{} removed ({remove_tries} call(s)), {} {} ms after the answer; \
                 members now {:?}",
                ms(promoted_after),
                if was_leader { " (the leader)" } else { "" },
                if exited {
                    "exited"
                } else {
                    "said it was removed"
                },
                stopped_after.map_or(-1, |d| d.as_millis() as i64),
                want
            ),
        );
        Ok(())
    }

    /// SIGTERM a replica (the leader on every other upgrade), wait for it to exit (SIGKILL
    /// after a grace: a previous-release leader may hang), restart it on another build, check
    /// through /proc/PID/exe that the process runs that file, and wait until it caught up.
    async fn replica_upgrade(&mut self) -> anyhow::Result<()> {
        let s = self.leader().await?;
        let members: Vec<u64> = self.cluster.replicas.keys().copied().collect();
        let done = self.builds.copies + self.builds.rollbacks;
        let victim = removal_target(done, &members, s.leader, 0, &mut self.rng)
            .context("no replica to upgrade")?;
        let was_leader = victim == s.leader;
        let running = self.builds.build_of(victim);
        let others_previous = members
            .iter()
            .any(|id| *id != victim && self.builds.build_of(*id) == Build::Previous);
        let target = next_build(
            running,
            self.builds.previous.is_some(),
            others_previous,
            s.cluster_version,
        );
        let from = self
            .builds
            .describe(self.cluster.replicas[&victim].program.as_deref());
        let (program, exe_want) = match (&self.builds.previous, target) {
            (Some((wrapper, control_plane)), Build::Previous) => {
                self.builds.rollbacks += 1;
                (wrapper.clone(), control_plane.clone())
            }
            _ => {
                let copy = self.builds.install_copy()?;
                (copy.clone(), copy)
            }
        };
        let at = now_ms();
        let t0 = Instant::now();
        let grace = match running {
            Build::Previous => self.timings.previous_stop_grace,
            Build::Current => self.timings.stop_grace,
        };
        let exit = self.cluster.stop(victim, grace)?;
        let exited_after = t0.elapsed();
        let sigkilled = exit.is_none();
        if let Some(st) = exit
            && !st.success()
        {
            eprintln!("chaos: replica {victim} exited with {st} after SIGTERM");
        }
        self.cluster
            .replicas
            .get_mut(&victim)
            .context("the replica vanished")?
            .program = Some(program.clone());
        self.restart(victim)?;
        self.builds.running.insert(victim, target);
        let pid = self.cluster.replicas[&victim]
            .pid()
            .context("the restarted replica has no pid")?;
        let exe = wait_for_exe(pid, &exe_want, Duration::from_secs(10)).await?;
        self.whole_again().await?;
        let caught_up_after = t0.elapsed();
        let version = self.leader().await?.cluster_version;
        self.builds.remove_unused_copies(self.cluster);
        let to = self.builds.describe(Some(&program));
        let ms = |d: Duration| d.as_millis() as u64;
        self.recorder.record(&Event::Upgrade {
            at_ms: at,
            replica: victim,
            was_leader,
            from: from.clone(),
            to: to.clone(),
            exe: exe.display().to_string(),
            sigkilled,
            exited_after_ms: ms(exited_after),
            caught_up_after_ms: ms(caught_up_after),
            cluster_version: version,
        });
        self.fault(
            FaultKind::ReplicaUpgrade,
            format!("replica {victim}"),
            at,
            format!(
                "{}: {from} -> {to}; exited {} ms after SIGTERM{}, caught up after {} ms; \
                 cluster version {version}",
                if was_leader { "leader" } else { "follower" },
                ms(exited_after),
                if sigkilled { " (SIGKILL)" } else { "" },
                ms(caught_up_after)
            ),
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
            self.restart(id)?;
        }
        // Every replica the harness runs is a voter, and nothing else is a member: a replica
        // that rejoined (a wipe) and answers as a caught-up learner is not a spare yet, and a
        // leader fault then would leave no quorum.
        let deadline = Instant::now() + self.timings.recover;
        let want: BTreeSet<u64> = self.cluster.replicas.keys().copied().collect();
        let s = loop {
            let s = self.leader().await?;
            let voters: BTreeSet<u64> = s
                .members
                .iter()
                .filter(|m| m.role == "voter")
                .map(|m| m.id)
                .collect();
            if voters == want && s.members.len() == want.len() {
                break s;
            }
            if Instant::now() > deadline {
                bail!(
                    "the members are {:?}, not the voters {want:?}, after {:?}",
                    s.members
                        .iter()
                        .map(|m| (m.id, m.role.clone()))
                        .collect::<Vec<_>>(),
                    self.timings.recover
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
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

impl Builds {
    pub fn build_of(&self, id: u64) -> Build {
        self.running.get(&id).copied().unwrap_or(Build::Current)
    }

    /// What a replica's program is, for the history.
    fn describe(&self, program: Option<&Path>) -> String {
        match program {
            Some(p) if self.previous.as_ref().is_some_and(|(w, _)| w == p) => format!(
                "previous release ({})",
                self.previous
                    .as_ref()
                    .map_or(String::new(), |(_, cp)| cp.display().to_string())
            ),
            Some(p) => format!("current build, copy {}", p.display()),
            None => format!("current build {}", self.current.display()),
        }
    }

    /// Installs a fresh copy of the current build, as an upgrade installs a file: written
    /// beside its final name and renamed into place (a new inode).
    fn install_copy(&mut self) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(&self.bin_dir)?;
        self.copies += 1;
        let path = self.bin_dir.join(format!("chaos-{}", self.copies));
        let tmp = self.bin_dir.join(format!(".chaos-{}.tmp", self.copies));
        std::fs::copy(&self.current, &tmp)
            .with_context(|| format!("copying {} to {}", self.current.display(), tmp.display()))?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }

    /// Deletes installed copies that no replica runs any more (their processes may still be
    /// running elsewhere: a deleted file's inode lives as long as they do).
    fn remove_unused_copies(&self, cluster: &LocalCluster) {
        let used: BTreeSet<&Path> = cluster
            .replicas
            .values()
            .filter_map(|r| r.program.as_deref())
            .collect();
        for entry in std::fs::read_dir(&self.bin_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("chaos-") && !used.contains(path.as_path()) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

/// Waits until process `pid` runs the file `want` (a wrapper script execs it): /proc/PID/exe
/// names it and is the same inode. Returns what /proc/PID/exe names.
async fn wait_for_exe(pid: u32, want: &Path, timeout: Duration) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let want_ino = std::fs::metadata(want)
        .with_context(|| format!("reading {}", want.display()))?
        .ino();
    let want = std::fs::canonicalize(want).unwrap_or_else(|_| want.to_owned());
    let link = format!("/proc/{pid}/exe");
    let deadline = Instant::now() + timeout;
    loop {
        let exe = std::fs::read_link(&link);
        let ino = std::fs::metadata(&link).map(|m| m.ino());
        if let (Ok(exe), Ok(ino)) = (&exe, &ino)
            && *exe == want
            && *ino == want_ino
        {
            return Ok(exe.clone());
        }
        if Instant::now() > deadline {
            bail!(
                "replica process {pid} does not run {} (inode {want_ino}): /proc/{pid}/exe is \
                 {exe:?} (inode {ino:?})",
                want.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn builds(dir: &Path) -> Builds {
        Builds {
            current: std::env::current_exe().unwrap(),
            previous: None,
            bin_dir: dir.join("bin"),
            running: BTreeMap::new(),
            copies: 0,
            rollbacks: 0,
        }
    }

    #[test]
    fn an_installed_copy_is_a_new_file_and_unused_copies_go() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let mut b = builds(dir.path());
        let first = b.install_copy().unwrap();
        let second = b.install_copy().unwrap();
        assert_ne!(first, second);
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_ne!(ino(&first), ino(&b.current));
        assert_ne!(ino(&first), ino(&second));
        assert_eq!(
            std::fs::metadata(&first).unwrap().len(),
            std::fs::metadata(&b.current).unwrap().len()
        );
        // No replica runs either copy: both are deleted, nothing else in the directory is.
        let other = b.bin_dir.join("previous-replica");
        std::fs::write(&other, "#!/bin/sh\n").unwrap();
        let cluster = LocalCluster::new(&b.current, &["replica"], dir.path(), "t", &[1]);
        b.remove_unused_copies(&cluster);
        assert!(!first.exists() && !second.exists());
        assert!(other.exists());
    }

    #[test]
    fn a_copy_in_use_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = builds(dir.path());
        let copy = b.install_copy().unwrap();
        let mut cluster = LocalCluster::new(&b.current, &["replica"], dir.path(), "t", &[1]);
        cluster.replicas.get_mut(&1).unwrap().program = Some(copy.clone());
        b.remove_unused_copies(&cluster);
        assert!(copy.exists());
        assert!(b.describe(Some(&copy)).contains("copy"));
        assert!(b.describe(None).starts_with("current build"));
    }

    #[tokio::test]
    async fn the_running_file_is_told_by_path_and_inode() {
        let me = std::env::current_exe().unwrap();
        let exe = wait_for_exe(std::process::id(), &me, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(exe, std::fs::canonicalize(&me).unwrap());
        // A copy of the same bytes is another file: this process does not run it.
        let dir = tempfile::tempdir().unwrap();
        let copy = builds(dir.path()).install_copy().unwrap();
        let err = wait_for_exe(std::process::id(), &copy, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("does not run"), "{err}");
    }
}
