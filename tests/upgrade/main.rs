//! Rolling upgrade from the previous release to this tree (issue 19), with real processes.
//!
//! Builds the previous release (tests/upgrade/PREVIOUS_RELEASE) from git, starts 3 replicas
//! and 8 simulated GPU hosts on it with mutual TLS, puts one long-running job on every host
//! and a steady stream of short jobs on all of them, then upgrades the replicas one at a time
//! (followers first, the leader last), shows that old agents keep working against the new
//! control plane, and upgrades the agents one at a time. Checked at the end: no acknowledged
//! job lost, no job restarted or moved, no gap between acknowledged writes of 1 s or more,
//! every agent registered again. The policy this proves is docs/UPGRADING.md.
//!
//! Every stage passes through [`Upgrade::check_stage`]: the one place to add checks of what
//! each stage must report (format versions, the cluster version).

#[path = "../cluster/util.rs"]
#[allow(dead_code)] // the cluster tests' fixtures; this test uses some of them
mod util;

mod load;
mod previous_release;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use control_plane::client::{Client, with_timeout};
use control_plane::local_cluster::{StartMode, free_ports};
use node_agent::runtime::{UsageRecord, read_usage_journal};
use proto::v1 as pb;

use util::{TestCluster, describe, get_job, gpuctl_bin, list_jobs, list_nodes, submit};

/// Eight hosts in the presets the other tests use: 4 DGX H100 (8 GPUs), 4 A100 PCIe (4 GPUs).
const AGENTS: [(&str, &str); 8] = [
    ("h100-1", "dgx-h100"),
    ("h100-2", "dgx-h100"),
    ("h100-3", "dgx-h100"),
    ("h100-4", "dgx-h100"),
    ("a100-1", "a100-pcie-4gpu-nvlink-pairs"),
    ("a100-2", "a100-pcie-4gpu-nvlink-pairs"),
    ("a100-3", "a100-pcie-4gpu-nvlink-pairs"),
    ("a100-4", "a100-pcie-4gpu-nvlink-pairs"),
];
/// One submission per interval: 10 writes a second, through every step of the upgrade.
const PACE: Duration = Duration::from_millis(100);
/// The bound on a write outage.
const MAX_WRITE_GAP: Duration = Duration::from_secs(1);
/// Deadline of each wait on a condition (a replica catching up, an agent registering).
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a SIGTERMed process may take to exit before it counts as hung.
const STOP_GRACE: Duration = Duration::from_secs(10);
const FINAL_STATES: [&str; 4] = ["succeeded", "failed", "cancelled", "timed_out"];

/// Previous releases whose leader does not exit on SIGTERM while agents are connected: it
/// stopped serving yet went on leading, so no write and no agent heartbeat got through until
/// it was killed, and every agent fenced its jobs once its lease ran out. (Fixed after
/// a5cb34a: a stopping replica leaves Raft first, `server::stop_on`.) Upgrading from one of
/// these, the old leader is stopped with SIGKILL, as docs/UPGRADING.md tells operators: safe,
/// since every acknowledged write is on disk, and the failover tests' own case.
const LEADER_HANGS_ON_SIGTERM: &[&str] = &["a5cb34a"];

/// Each host has a partition of its own, so the test can put work on a chosen host (a long
/// job on every one, skew probes on every old agent, load spread over all).
fn partition_of(agent: &str) -> String {
    format!("host-{agent}")
}

/// Program (and leading arguments) of each process kind, before and after the upgrade.
struct Binaries {
    old_replica: PathBuf,
    new_replica: PathBuf,
    old_agent: (PathBuf, Vec<String>),
    /// `gpuctl agent`: the same agent code as `node-agent` (cargo gives an integration test
    /// the binaries of its own package only), and it is its own shim as node-agent is.
    new_agent: (PathBuf, Vec<String>),
}

/// A long-running job started before the upgrade, as it must still be after it.
struct LongJob {
    id: u64,
    agent: String,
    allocation: pb::Allocation,
    /// The shim's pid from the agent's journal: the same process throughout.
    shim_pid: u32,
}

/// The cluster under upgrade and how far the upgrade has got.
struct Upgrade {
    c: TestCluster,
    bins: Binaries,
    /// The previous release's commit, as PREVIOUS_RELEASE names it.
    old_commit: String,
    client: Client,
    new_replicas: BTreeSet<u64>,
    new_agents: BTreeSet<String>,
    /// (when, what) of every step, to tell in which step a write gap fell.
    timeline: Vec<(Instant, String)>,
    started: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_from_the_previous_release_loses_and_restarts_nothing() {
    let old = previous_release::build();
    let bins = Binaries {
        old_replica: old.control_plane.clone(),
        new_replica: util::control_plane_bin(),
        old_agent: (old.node_agent.clone(), vec![]),
        new_agent: (gpuctl_bin(), vec!["agent".into()]),
    };
    let mut u = Upgrade::start_on_old_binaries(bins, &old.commit).await;
    u.check_stage("every process on the previous release");
    let long = u.start_long_jobs().await;

    let load = load::start(u.c.client().unwrap(), partitions(), PACE);
    load.wait_acked(10, STEP_TIMEOUT).await;
    let upgrade_started = Instant::now();
    u.upgrade_replicas(&load).await;
    let replicas_done = Instant::now();
    let skew_jobs = u.old_agents_work_with_the_new_control_plane().await;
    let skew_done = Instant::now();
    u.upgrade_agents(&long, &load).await;
    let upgrade_wall = upgrade_started.elapsed();
    // The next upgrade's leader step, on this release; not part of this upgrade's time.
    let new_leader_exit = u.restart_the_new_leader_with_sigterm().await;
    // The next upgrade's agent step, on this release: in place, under load, long jobs kept.
    u.restart_agents_in_place().await;
    u.mark("upgrade done; stopping the load");
    let report = load.stop().await;

    u.every_agent_registered().await;
    let acked: Vec<u64> = report
        .acks
        .iter()
        .map(|a| a.id)
        .chain(skew_jobs.iter().copied())
        .chain(long.iter().map(|l| l.id))
        .collect();
    let long_ids: BTreeSet<u64> = long.iter().map(|l| l.id).collect();
    let jobs = u.wait_settled(&acked, &long_ids).await;
    let lost: Vec<u64> = acked
        .iter()
        .copied()
        .filter(|id| !jobs.contains_key(id))
        .collect();
    let restarted = u.restarted_jobs(&jobs);
    let (gap, gap_end) = report.max_gap();

    Figures {
        commit: &old.commit,
        build_time: old.build_time,
        replicas: replicas_done - upgrade_started,
        skew: skew_done - replicas_done,
        agents: upgrade_wall - (skew_done - upgrade_started),
        gaps: report
            .largest_gaps(3)
            .into_iter()
            .map(|(g, end)| (g, u.step_at(end)))
            .collect(),
        new_leader_exit,
        report: &report,
        skew_jobs: skew_jobs.len(),
        long_jobs: long.len(),
        lost: lost.len(),
        restarted: restarted.len(),
    }
    .print();

    assert!(lost.is_empty(), "acknowledged jobs lost: {lost:?}");
    assert!(restarted.is_empty(), "jobs restarted: {restarted:?}");
    u.check_long_jobs_kept(&long).await;
    let load_ids: Vec<u64> = report.acks.iter().map(|a| a.id).collect();
    u.check_all_succeeded(&jobs, &load_ids, "load");
    u.check_all_succeeded(&jobs, &skew_jobs, "skew probe");
    assert!(
        gap < MAX_WRITE_GAP,
        "a write gap of {} ms (ending in step: {}); errors meanwhile: {:?}",
        gap.as_millis(),
        u.step_at(gap_end),
        report.errors
    );
    u.new_agents_stop_adopted_jobs(&long).await;
    u.a_replica_on_the_previous_release_cannot_join().await;
}

/// What the issue asks to report, printed before the assertions so a failing run shows them.
struct Figures<'a> {
    commit: &'a str,
    build_time: Duration,
    replicas: Duration,
    skew: Duration,
    agents: Duration,
    /// The largest write gaps, each with the step it ended in.
    gaps: Vec<(Duration, String)>,
    new_leader_exit: Duration,
    report: &'a load::LoadReport,
    skew_jobs: usize,
    long_jobs: usize,
    lost: usize,
    restarted: usize,
}

impl Figures<'_> {
    fn print(&self) {
        let secs = |d: Duration| d.as_secs_f64();
        println!("rolling upgrade figures (3 replicas, 8 agents, debug build, TLS):");
        println!(
            "  previous release {}: materialised and built in {:.1} s",
            self.commit,
            secs(self.build_time)
        );
        println!(
            "  upgrade wall time {:.1} s: replicas {:.1} s, old agents against the new control plane {:.1} s, agents {:.1} s",
            secs(self.replicas + self.skew + self.agents),
            secs(self.replicas),
            secs(self.skew),
            secs(self.agents)
        );
        for (i, (gap, step)) in self.gaps.iter().enumerate() {
            let what = if i == 0 { "max write gap" } else { "next gap" };
            println!("  {what} {} ms, ending in step: {step}", gap.as_millis());
        }
        println!(
            "  the new leader exited {} ms after SIGTERM (agents connected, jobs running)",
            self.new_leader_exit.as_millis()
        );
        println!(
            "  jobs: {} submitted by the load in {:.1} s ({} submissions timed out and were retried), {} skew probes, {} long-running; lost {}, restarted {}",
            self.report.acks.len(),
            secs(self.report.stopped - self.report.started),
            self.report.errors.len(),
            self.skew_jobs,
            self.long_jobs,
            self.lost,
            self.restarted
        );
    }
}

fn partitions() -> Vec<String> {
    AGENTS.iter().map(|(n, _)| partition_of(n)).collect()
}

impl Upgrade {
    /// 3 replicas and 8 agents, every one on the previous release's binaries, TLS on (the
    /// local cluster's default, as `gpuctl dev`), the deployment's default leases and timings.
    async fn start_on_old_binaries(bins: Binaries, old_commit: &str) -> Upgrade {
        let mut c = describe(3, &[]);
        for r in c.cluster.replicas.values_mut() {
            r.program = Some(bins.old_replica.clone());
        }
        assert!(
            c.is_secure(),
            "the local cluster should default to mutual TLS"
        );
        c.agent_program = Some(bins.new_agent.clone());
        let ports = free_ports(AGENTS.len()).expect("free ports");
        for ((name, preset), port) in AGENTS.iter().zip(ports) {
            let partition = partition_of(name);
            c.add_agent(
                name,
                preset,
                port,
                &["--stop-grace-secs", "1", "--partition", &partition],
            );
            c.agents.get_mut(*name).unwrap().program = Some(bins.old_agent.clone());
        }
        c.start_all().expect("starting replicas");
        c.wait_for_leader(STEP_TIMEOUT).await.expect("a leader");
        for (name, _) in AGENTS {
            c.start_agent(name).expect("starting agent");
        }
        let client = c.client().unwrap();
        let mut u = Upgrade {
            c,
            bins,
            old_commit: old_commit.to_owned(),
            client,
            new_replicas: BTreeSet::new(),
            new_agents: BTreeSet::new(),
            timeline: Vec::new(),
            started: Instant::now(),
        };
        for (name, _) in AGENTS {
            u.wait_registered(name, None).await;
        }
        u.mark("3 replicas and 8 agents up on the previous release");
        u
    }

    /// Records a step and prints it with the time since the cluster started.
    fn mark(&mut self, what: impl Into<String>) {
        let what = what.into();
        println!(
            "=== [{:6.1} s] {what}",
            self.started.elapsed().as_secs_f64()
        );
        self.timeline.push((Instant::now(), what));
    }

    /// The step that was under way at `at`.
    fn step_at(&self, at: Instant) -> String {
        self.timeline
            .iter()
            .rev()
            .find(|(t, _)| *t <= at)
            .map(|(_, s)| s.clone())
            .unwrap_or_else(|| "before the first step".into())
    }

    /// What must hold at every stage: each process runs the binary the plan says (the mixed
    /// cluster really is mixed). Checks of what the replicas report about versions (format
    /// versions, the cluster version raised once every replica runs the new binary) belong
    /// here, keyed on `self.new_replicas` and `self.new_agents`.
    fn check_stage(&self, stage: &str) {
        for (id, r) in &self.c.replicas {
            let want = if self.new_replicas.contains(id) {
                &self.bins.new_replica
            } else {
                &self.bins.old_replica
            };
            let pid = r
                .pid()
                .unwrap_or_else(|| panic!("{stage}: replica {id} is not running"));
            check_exe(pid, want, &format!("{stage}: replica {id}"));
        }
        for (name, a) in &self.c.agents {
            let want = if self.new_agents.contains(name) {
                &self.bins.new_agent.0
            } else {
                &self.bins.old_agent.0
            };
            let pid = a
                .pid()
                .unwrap_or_else(|| panic!("{stage}: agent {name} is not running"));
            check_exe(pid, want, &format!("{stage}: agent {name}"));
        }
    }

    /// One job per host that runs through the whole upgrade; returns them once running.
    async fn start_long_jobs(&mut self) -> Vec<LongJob> {
        self.mark("one long-running job on every host");
        let mut ids = Vec::new();
        for (name, _) in AGENTS {
            // Each start appends a line: a restarted job leaves two.
            let script = format!(
                "echo \"$GPUCP_ALLOCATION_ID\" >> {}/long-$GPUCP_JOB_ID; exec sleep 3600",
                self.c.root.display()
            );
            let spec = pb::JobSpec {
                name: format!("long-{name}"),
                command: vec!["sh".into(), "-c".into(), script],
                partition: partition_of(name),
                ..util::spec("long", 1)
            };
            let id = submit(&mut self.client, spec, &format!("long-{name}"))
                .await
                .expect("submitting a long-running job")
                .id;
            ids.push((id, name));
        }
        let mut long = Vec::new();
        for (id, name) in ids {
            let job = util::wait_job(&mut self.client, id, STEP_TIMEOUT, "running", |j| {
                j.state == "running"
            })
            .await;
            let allocation = job.allocations[0].clone();
            assert_eq!(allocation.node, name, "job {id} ran outside its partition");
            let shim_pid = self.wait_shim_pid(name, allocation.id).await;
            long.push(LongJob {
                id,
                agent: name.to_owned(),
                allocation,
                shim_pid,
            });
        }
        long
    }

    /// The pid the agent's journal records for an allocation's start.
    async fn wait_shim_pid(&self, agent: &str, allocation: u64) -> u32 {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let pid = self.journal(agent).iter().find_map(|r| match r {
                UsageRecord::Start {
                    allocation: a, pid, ..
                } if *a == allocation => Some(*pid),
                _ => None,
            });
            if let Some(pid) = pid {
                return pid;
            }
            assert!(
                Instant::now() < deadline,
                "agent {agent} journaled no start of allocation {allocation}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn journal(&self, agent: &str) -> Vec<UsageRecord> {
        read_usage_journal(&self.c.agents[agent].usage_journal()).unwrap_or_default()
    }

    /// Replicas one at a time, followers first and the leader last, each a caught-up member
    /// again before the next one goes down.
    async fn upgrade_replicas(&mut self, load: &load::Load) {
        while let Some(id) = self.next_replica().await {
            self.upgrade_replica(id).await;
            self.check_stage(&format!("replica {id} upgraded"));
            if self.new_replicas.len() < self.c.replicas.len() {
                // An old replica is still a member: the new ones must keep writing format 1,
                // which it reads.
                self.expect_cluster_version_1(id).await;
            }
            self.wait_writes_in_this_configuration(load).await;
        }
        self.check_stage("every replica upgraded, every agent on the previous release");
        self.wait_cluster_version(control_plane::state::format::CURRENT)
            .await;
    }

    /// While any member runs the previous release, the cluster stays at format 1, and a new
    /// replica says why it does not raise it.
    async fn expect_cluster_version_1(&self, id: u64) {
        let status = self
            .c
            .status(id)
            .await
            .unwrap_or_else(|| panic!("replica {id} does not answer its status"));
        assert_eq!(
            status.cluster_version, 1,
            "cluster version raised while a replica runs the previous release"
        );
    }

    /// Until the leader reports cluster version `want`: raised once every replica runs the new
    /// release, within a few checks of the last one's first answer.
    async fn wait_cluster_version(&mut self, want: u32) {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            if let Ok(l) = self.c.wait_for_leader(STEP_TIMEOUT).await
                && l.cluster_version == want
            {
                self.mark(format!("cluster version {want}"));
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster version did not reach {want} after every replica was upgraded"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A replica not yet upgraded, the leader only when no other is left. Asked afresh each
    /// time: leadership may have moved since the last step.
    async fn next_replica(&self) -> Option<u64> {
        let leader = self
            .c
            .wait_for_leader(STEP_TIMEOUT)
            .await
            .expect("a leader")
            .leader;
        let old: Vec<u64> = self
            .c
            .replicas
            .keys()
            .copied()
            .filter(|id| !self.new_replicas.contains(id))
            .collect();
        old.iter()
            .copied()
            .find(|id| *id != leader)
            .or(old.first().copied())
    }

    async fn upgrade_replica(&mut self, id: u64) {
        let leader = self
            .c
            .wait_for_leader(STEP_TIMEOUT)
            .await
            .expect("a leader")
            .leader;
        let role = if id == leader {
            "the leader"
        } else {
            "a follower"
        };
        if id == leader && self.old_leader_hangs_on_sigterm() {
            self.mark(format!(
                "replica {id} ({role}): SIGKILL (release {}'s leader hangs on SIGTERM), restart on the new binary",
                self.old_commit
            ));
            self.c.kill(id).expect("killing the old leader");
        } else {
            self.mark(format!(
                "replica {id} ({role}): SIGTERM, restart on the new binary"
            ));
            self.stop_replica(id);
        }
        self.c.replicas.get_mut(&id).unwrap().program = Some(self.bins.new_replica.clone());
        // Same data directory; `--peers` does not bootstrap a directory that holds a cluster.
        self.c
            .start(id, StartMode::Initial)
            .expect("restarting a replica");
        self.new_replicas.insert(id);
        self.wait_caught_up(id).await;
        self.mark(format!("replica {id}: a caught-up voter on the new binary"));
    }

    fn old_leader_hangs_on_sigterm(&self) -> bool {
        LEADER_HANGS_ON_SIGTERM
            .iter()
            .any(|c| self.old_commit.starts_with(c) || c.starts_with(self.old_commit.as_str()))
    }

    /// SIGTERM; the replica must exit by itself, with success, within [`STOP_GRACE`].
    /// Returns how long it took.
    fn stop_replica(&mut self, id: u64) -> Duration {
        let asked = Instant::now();
        let exit = self.c.stop(id, STOP_GRACE).expect("stopping a replica");
        assert!(
            exit.is_some_and(|s| s.success()),
            "replica {id} did not exit cleanly within {STOP_GRACE:?} of SIGTERM ({exit:?}):\n{}",
            self.c.log(id)
        );
        asked.elapsed()
    }

    /// The next upgrade's leader step, on this release: SIGTERM to the leader while agents
    /// are connected and jobs run; it must exit by itself, and the cluster go on writing.
    /// Returns how long the exit took.
    async fn restart_the_new_leader_with_sigterm(&mut self) -> Duration {
        let leader = self
            .c
            .wait_for_leader(STEP_TIMEOUT)
            .await
            .expect("a leader")
            .leader;
        self.mark(format!(
            "replica {leader} (the leader, new binary): SIGTERM, restart"
        ));
        let took = self.stop_replica(leader);
        self.c
            .start(leader, StartMode::Initial)
            .expect("restarting the leader");
        self.wait_caught_up(leader).await;
        self.mark(format!(
            "replica {leader}: exited {} ms after SIGTERM, a caught-up voter again",
            took.as_millis()
        ));
        self.check_stage("the new leader restarted");
        took
    }

    /// Until the leader counts `id` as a reachable voter and `id` follows it and has applied
    /// everything the leader had committed when asked.
    async fn wait_caught_up(&self, id: u64) {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let leader = self.c.wait_for_leader(STEP_TIMEOUT).await.ok();
            let own = self.c.status(id).await;
            if let (Some(l), Some(own)) = (&leader, &own) {
                let voter = l
                    .members
                    .iter()
                    .any(|m| m.id == id && m.role == "voter" && m.reachable);
                if voter && own.leader == l.leader && own.applied_index >= l.commit_index {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "replica {id} did not become a caught-up member within {STEP_TIMEOUT:?}: \
                 leader says {leader:?}, it says {own:?}\nits log:\n{}",
                self.c.log(id)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One release of skew: with every replica new and every agent old, a new job on each
    /// host is placed on its old agent and completes there. Returns the probes' ids.
    async fn old_agents_work_with_the_new_control_plane(&mut self) -> Vec<u64> {
        self.mark("new control plane, old agents: one new job on every old agent");
        let mut probes = Vec::new();
        for (name, _) in AGENTS {
            let spec = pb::JobSpec {
                name: format!("skew-{name}"),
                command: vec!["sleep".into(), "0.2".into()],
                partition: partition_of(name),
                ..util::spec("skew", 1)
            };
            let id = submit(&mut self.client, spec, &format!("skew-{name}"))
                .await
                .expect("submitting a skew probe")
                .id;
            probes.push((id, name));
        }
        for (id, name) in &probes {
            let job = util::wait_job(&mut self.client, *id, STEP_TIMEOUT, "succeeded", |j| {
                FINAL_STATES.contains(&j.state.as_str())
            })
            .await;
            assert_eq!(
                job.state, "succeeded",
                "probe {id} on old agent {name}: {job:#?}"
            );
            assert_eq!(
                placements(&job),
                vec![format!("placed on {name}")],
                "probe {id} should have been placed once, on old agent {name}: {job:#?}"
            );
        }
        self.check_stage("skew probes done: every replica new, every agent old");
        probes.into_iter().map(|(id, _)| id).collect()
    }

    /// Agents one at a time: SIGTERM to the old one, the new one on the same state directory;
    /// it must register again and re-adopt the running jobs, the long one still on its
    /// allocation.
    async fn upgrade_agents(&mut self, long: &[LongJob], load: &load::Load) {
        for (name, _) in AGENTS {
            let job = long
                .iter()
                .find(|l| l.agent == name)
                .expect("a long job per host");
            let upgraded_at = Instant::now();
            self.upgrade_agent(name, job).await;
            self.check_stage(&format!("agent {name} upgraded"));
            self.wait_new_work_done_by(name, upgraded_at, load).await;
        }
        self.check_stage("every process on the new release");
    }

    async fn upgrade_agent(&mut self, name: &str, long: &LongJob) {
        let registered_at = self.registered_at(name).await;
        let log_before = self.c.agent_log(name).len();
        self.mark(format!("agent {name}: SIGTERM, restart on the new binary"));
        let exit = self
            .c
            .stop_agent(name, STOP_GRACE)
            .expect("stopping an agent");
        assert!(
            exit.is_some(),
            "agent {name} ignored SIGTERM for {STOP_GRACE:?}"
        );
        self.c.agents.get_mut(name).unwrap().program = Some(self.bins.new_agent.clone());
        self.c.start_agent(name).expect("starting the new agent");
        self.new_agents.insert(name.to_owned());
        self.wait_registered(name, registered_at).await;
        self.wait_readopted(name, log_before).await;
        self.check_long_job(long).await;
        self.mark(format!(
            "agent {name}: registered again, its jobs re-adopted"
        ));
    }

    /// Before the next step: the load got writes acknowledged with the cluster as it is now
    /// (a few, so each mixed configuration really took writes, not just the first one).
    async fn wait_writes_in_this_configuration(&self, load: &load::Load) {
        let now = load.acked();
        load.wait_acked(now + 5, STEP_TIMEOUT).await;
    }

    /// Until a load job submitted once agent `name` was upgraded has run to success there:
    /// the new agent starts new work, as well as keeping the old.
    async fn wait_new_work_done_by(&mut self, name: &str, since: Instant, load: &load::Load) {
        let partition = partition_of(name);
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let ids: Vec<u64> = load
                .acks()
                .into_iter()
                .filter(|a| a.partition == partition && a.at >= since)
                .map(|a| a.id)
                .collect();
            for id in ids {
                if get_job(&mut self.client, id).await.state == "succeeded" {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no job submitted after agent {name}'s upgrade succeeded there within {STEP_TIMEOUT:?}:\n{}",
                self.c.agent_log(name)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The node's registration time, which every registration renews.
    async fn registered_at(&mut self, name: &str) -> Option<u64> {
        list_nodes(&mut self.client)
            .await
            .into_iter()
            .find(|n| n.name == name)
            .map(|n| n.registered_at_ms)
    }

    /// Until node `name` is ready with a registration newer than `before`.
    async fn wait_registered(&mut self, name: &str, before: Option<u64>) {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let nodes = list_nodes(&mut self.client).await;
            let node = nodes.iter().find(|n| n.name == name);
            if node.is_some_and(|n| n.status == "ready" && Some(n.registered_at_ms) != before) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "agent {name} did not register (again) within {STEP_TIMEOUT:?}: {node:?}\nits log:\n{}",
                self.c.agent_log(name)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Until the new agent's part of the log says it re-adopted the running workloads.
    async fn wait_readopted(&self, name: &str, log_before: usize) {
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let log = self.c.agent_log(name);
            if log
                .get(log_before..)
                .is_some_and(|l| l.contains("re-adopted"))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the new agent {name} did not re-adopt its running jobs:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A long job still runs on the allocation it started on, in the same shim, started once.
    async fn check_long_job(&mut self, long: &LongJob) {
        let job = get_job(&mut self.client, long.id).await;
        assert_eq!(
            job.state, "running",
            "long job {} no longer runs: {job:#?}",
            long.id
        );
        // What the node enforces is the agent's, and changes with it (an old agent reports
        // nothing); the allocation itself must not.
        let same_placement = |a: &pb::Allocation| pb::Allocation {
            enforcement: String::new(),
            ..a.clone()
        };
        assert_eq!(
            job.allocations
                .iter()
                .map(same_placement)
                .collect::<Vec<_>>(),
            vec![same_placement(&long.allocation)],
            "long job {} moved or was placed again",
            long.id
        );
        let starts: Vec<u32> = self
            .journal(&long.agent)
            .iter()
            .filter_map(|r| match r {
                UsageRecord::Start { job, pid, .. } if *job == long.id => Some(*pid),
                _ => None,
            })
            .collect();
        assert_eq!(
            starts,
            vec![long.shim_pid],
            "long job {} started again",
            long.id
        );
        let marker = self.c.root.join(format!("long-{}", long.id));
        let runs = std::fs::read_to_string(&marker).unwrap_or_default();
        assert_eq!(
            runs,
            format!("{}\n", long.allocation.id),
            "long job {}'s command ran more than once",
            long.id
        );
        assert!(
            process_alive(long.shim_pid),
            "long job {}'s shim (pid {}) is gone",
            long.id,
            long.shim_pid
        );
    }

    async fn check_long_jobs_kept(&mut self, long: &[LongJob]) {
        for l in long {
            self.check_long_job(l).await;
        }
    }

    async fn every_agent_registered(&mut self) {
        let nodes = list_nodes(&mut self.client).await;
        for (name, _) in AGENTS {
            assert!(
                nodes.iter().any(|n| n.name == name && n.status == "ready"),
                "agent {name} is not registered and ready at the end: {nodes:?}"
            );
        }
    }

    /// Every job of `ids` the cluster knows, once each is final, or running for those of
    /// `may_run` (the long jobs).
    async fn wait_settled(
        &mut self,
        ids: &[u64],
        may_run: &BTreeSet<u64>,
    ) -> BTreeMap<u64, pb::Job> {
        let wanted: BTreeSet<u64> = ids.iter().copied().collect();
        let deadline = Instant::now() + STEP_TIMEOUT;
        loop {
            let jobs: BTreeMap<u64, pb::Job> = list_jobs(&mut self.client, false)
                .await
                .into_iter()
                .filter(|j| wanted.contains(&j.id))
                .map(|j| (j.id, j))
                .collect();
            let unsettled: Vec<(u64, &str)> = jobs
                .values()
                .filter(|j| {
                    let running = j.state == "running" && may_run.contains(&j.id);
                    !running && !FINAL_STATES.contains(&j.state.as_str())
                })
                .map(|j| (j.id, j.state.as_str()))
                .collect();
            if unsettled.is_empty() {
                return jobs;
            }
            assert!(
                Instant::now() < deadline,
                "jobs not final within {STEP_TIMEOUT:?} after the load stopped: {unsettled:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Jobs that started more than once (by the agents' journals) or went back to the queue
    /// (by their history).
    fn restarted_jobs(&self, jobs: &BTreeMap<u64, pb::Job>) -> Vec<u64> {
        let mut starts: BTreeMap<u64, usize> = BTreeMap::new();
        for (name, _) in AGENTS {
            for r in self.journal(name) {
                if let UsageRecord::Start { job, .. } = r {
                    *starts.entry(job).or_default() += 1;
                }
            }
        }
        jobs.values()
            .filter(|j| {
                starts.get(&j.id).copied().unwrap_or(0) > 1
                    || placements(j).len() > 1
                    || j.history.iter().any(|h| h.reason.contains("requeued"))
            })
            .map(|j| j.id)
            .collect()
    }

    fn check_all_succeeded(&self, jobs: &BTreeMap<u64, pb::Job>, ids: &[u64], what: &str) {
        let failed: Vec<(u64, &str)> = ids
            .iter()
            .filter_map(|id| jobs.get(id))
            .filter(|j| j.state != "succeeded")
            .map(|j| (j.id, j.state.as_str()))
            .collect();
        assert!(
            failed.is_empty(),
            "{what} jobs that did not succeed: {failed:?}"
        );
    }

    /// `gpuctl node restart-agent --all`: every (new) agent restarts in place, two at a time,
    /// under the load (so the workload counts move with short jobs); the long jobs' shims and
    /// allocations are checked unchanged at the end.
    async fn restart_agents_in_place(&mut self) {
        self.mark("restart every agent in place, 2 at a time");
        let (ok, out, err) = util::gpuctl(
            &self.c,
            &["node", "restart-agent", "--all", "--max-unavailable", "2"],
        );
        assert!(ok, "gpuctl node restart-agent failed:\n{out}{err}");
        let restarted = format!("restarted {n} of {n} agents", n = AGENTS.len());
        assert!(out.contains(&restarted), "{out}");
        println!("{out}");
    }

    /// Once the cluster writes format 2, a replica on the previous release (which reads
    /// format 1 only) is refused at `cluster add` at once, saying why, and the membership
    /// stays as it was.
    async fn a_replica_on_the_previous_release_cannot_join(&mut self) {
        self.mark("add a replica running the previous release");
        let before = self.c.wait_for_leader(STEP_TIMEOUT).await.unwrap();
        let port = free_ports(1).unwrap()[0];
        let id = self.c.add_spare(port);
        self.c.replicas.get_mut(&id).unwrap().program = Some(self.bins.old_replica.clone());
        self.c.start(id, StartMode::Pristine).unwrap();
        let addr = self.c.addr(id);
        let started = Instant::now();
        let (ok, out, err) = util::gpuctl(
            &self.c,
            &[
                "cluster",
                "add",
                "--id",
                &id.to_string(),
                "--address",
                &addr,
            ],
        );
        let took = started.elapsed();
        println!("adding a previous-release replica was answered in {took:?}: {err}");
        assert!(!ok, "an old replica was added: {out}");
        assert!(err.contains("cannot read the log"), "{err}");
        assert!(err.contains("membership is unchanged"), "{err}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        // It answers status as a learner of no cluster; stopped, it is out of the picture.
        self.c.kill(id).unwrap();
        let after = self.c.wait_for_leader(STEP_TIMEOUT).await.unwrap();
        let ids = |s: &pb::ClusterStatusResponse| -> BTreeSet<u64> {
            s.members.iter().map(|m| m.id).collect()
        };
        assert_eq!(ids(&after), ids(&before));
    }

    /// The new agents control the jobs they re-adopted from the old ones: a cancel stops
    /// each long job, and its agent journals the stop.
    async fn new_agents_stop_adopted_jobs(&mut self, long: &[LongJob]) {
        self.mark("cancel the long jobs: their new agents stop them");
        for l in long {
            let req = pb::CancelJobRequest {
                id: l.id,
                reason: "upgrade test done".into(),
                ..Default::default()
            };
            self.client
                .call(|mut c, t| {
                    let req = req.clone();
                    async move { c.cancel_job(with_timeout(req, t)).await }
                })
                .await
                .expect("cancelling a long job");
        }
        for l in long {
            let deadline = Instant::now() + STEP_TIMEOUT;
            while !self.journal(&l.agent).iter().any(
                |r| matches!(r, UsageRecord::Stop { allocation, .. } if *allocation == l.allocation.id),
            ) {
                assert!(
                    Instant::now() < deadline,
                    "the new agent {} did not stop re-adopted job {}:\n{}",
                    l.agent,
                    l.id,
                    self.c.agent_log(&l.agent)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Why the job was placed, each time it was ("placed on NODE"), from its history: a finished
/// job keeps no allocations.
fn placements(job: &pb::Job) -> Vec<String> {
    job.history
        .iter()
        .filter(|h| h.state == "scheduled")
        .map(|h| h.reason.clone())
        .collect()
}

/// Fails unless process `pid` runs the executable `want`.
fn check_exe(pid: u32, want: &Path, what: &str) {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .unwrap_or_else(|e| panic!("{what}: cannot read /proc/{pid}/exe: {e}"));
    let want = std::fs::canonicalize(want).unwrap_or_else(|_| want.to_owned());
    assert_eq!(exe, want, "{what} runs the wrong binary");
}

fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}
