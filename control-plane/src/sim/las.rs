//! A Tiresias-style two-dimensional least-attained-service (2D-LAS) scheduler, as a baseline for
//! the replay (Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep Learning",
//! NSDI '19). Simulator-only: it plans on the same `ClusterState`, with the scheduler's own
//! fleet view and node fit checks (`placement::evaluate_node`), and the replay applies its
//! plan through the state machine like the real scheduler's.
//!
//! - **Attained service** of a job: its GPUs × the time it has run, over all its runs, read from
//!   its history (placement to requeue or end), so the policy keeps no state of its own.
//! - **Discretized queues**: a job with less than `thresholds_gpu_s[0]` GPU-seconds is in queue
//!   0, below `thresholds_gpu_s[1]` in queue 1, and so on. Lower queues first; within a queue,
//!   submission order (FIFO). Defaults: 3,250 GPU-s, the first queue limit of the authors'
//!   simulator (github.com/SymbioticLab/Tiresias, `simulator/jobs.py`), and 18,000 GPU-s, the
//!   threshold of the Tiresias re-implementation in the Helios artifact
//!   (github.com/S-Lab-System-Group/HeliosArtifact): three queues.
//! - **Preemption**: a waiting job that does not fit may stop running jobs of *lower* queues
//!   (lowest first, on the node that needs the fewest); they are requeued and keep their
//!   attained service. Jobs of its own queue are never stopped for it, so two jobs of one
//!   queue cannot take turns stopping each other.
//! - **Starvation guard**: a job in a lower queue that has waited `starve_limit` × the time it
//!   has run since its last promotion goes back to queue 0, its service counted from zero (as
//!   the authors' simulator does with `solve_starvation`). Their simulator ships with the
//!   guard off; the default here, 10, is this module's choice.
//! - Work conserving, no reservations: a job that fits starts even if an earlier one cannot.
//!   Jobs that wait for stopping jobs keep the room those free, so the room is not taken
//!   from them before they start. Gangs are all-or-nothing, each task on the node that fits
//!   it best (best fit).
//!
//! Simplifications, stated: Tiresias' placement also weighs model skew for consolidation
//! (every gang task here is a whole host, so every gang is as consolidated as it can be);
//! promotions and demotions take effect at the replay's next event, not between events.

use std::collections::{BTreeMap, BTreeSet};

use crate::scheduler::fleet::{Fleet, NodeFree, NodeIdx};
use crate::scheduler::placement::{Scorer, Shape, TaskFit, evaluate_node, take, unit_uuids};
use crate::scheduler::queue::{dependencies_met, eligible};
use crate::state::{
    ClusterState, Job, JobId, JobPlacement, JobState, MILLI_PER_GPU, TaskPlacement, Timestamp,
};

/// Settings of the baseline.
#[derive(Debug, Clone, PartialEq)]
pub struct LasConfig {
    /// Upper bounds, in GPU-seconds of attained service, of every queue but the last.
    pub thresholds_gpu_s: Vec<u64>,
    /// Promote a lower-queue job that has waited this many times its run time since its last
    /// promotion (0: never).
    pub starve_limit: u64,
    /// Whether a waiting job may stop running jobs of lower queues.
    pub preemption: bool,
}

impl Default for LasConfig {
    fn default() -> Self {
        LasConfig {
            thresholds_gpu_s: vec![3_250, 18_000],
            starve_limit: 10,
            preemption: true,
        }
    }
}

/// What one pass decided: jobs to start, and running jobs to stop and requeue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LasPlan {
    pub placements: Vec<JobPlacement>,
    pub stop: Vec<JobId>,
}

/// A job's service since its last promotion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attained {
    /// GPU-milliseconds of service.
    pub service_gpu_ms: u64,
    /// Milliseconds run.
    pub run_ms: u64,
    /// Milliseconds waited after it had run.
    pub waited_ms: u64,
    /// Promotions by the starvation guard over the job's life.
    pub promotions: u32,
}

/// The queue of a job with `service_gpu_ms` of attained service.
pub fn queue_of(service_gpu_ms: u64, cfg: &LasConfig) -> usize {
    cfg.thresholds_gpu_s
        .iter()
        .position(|&t| service_gpu_ms < t * 1000)
        .unwrap_or(cfg.thresholds_gpu_s.len())
}

/// The job's runs as (start, end): from its placement to the next change that is not a start
/// (requeue or end); a run still going ends at `now`.
fn runs(job: &Job, now: Timestamp) -> Vec<(Timestamp, Timestamp)> {
    let mut out = Vec::new();
    let mut open = None;
    for h in &job.history {
        match h.state {
            JobState::Scheduled | JobState::Running => {
                open.get_or_insert(h.at);
            }
            _ => {
                if let Some(start) = open.take() {
                    out.push((start, h.at));
                }
            }
        }
    }
    if let Some(start) = open {
        out.push((start, now.max(start)));
    }
    out
}

/// The job's service since its last promotion at `now`, replaying its waits and runs.
pub fn attained(job: &Job, now: Timestamp, cfg: &LasConfig) -> Attained {
    let milli = job.spec.total_gpu_milli();
    let mut a = Attained::default();
    let wait = |a: &mut Attained, from: Timestamp, to: Timestamp| {
        // As in Tiresias: waiting counts only once the job has run since its last promotion.
        if a.run_ms == 0 || to <= from {
            return;
        }
        a.waited_ms += to - from;
        if cfg.starve_limit > 0
            && queue_of(a.service_gpu_ms, cfg) > 0
            && a.waited_ms >= cfg.starve_limit * a.run_ms
        {
            *a = Attained {
                promotions: a.promotions + 1,
                ..Attained::default()
            };
        }
    };
    let mut cursor = job.submitted_at;
    let runs = runs(job, now);
    let running = job.state == JobState::Scheduled || job.state == JobState::Running;
    for &(start, end) in &runs {
        wait(&mut a, cursor, start);
        a.run_ms += end - start;
        a.service_gpu_ms += milli * (end - start) / MILLI_PER_GPU;
        cursor = end;
    }
    if !running {
        wait(&mut a, cursor, now);
    }
    a
}

/// Where each task of a job goes: its node and units.
type Fits = Vec<(NodeIdx, TaskFit)>;

/// One candidate of a pass: a waiting job, or a running one that keeps its GPUs unless a job
/// of a higher queue takes them.
struct Candidate<'a> {
    job: &'a Job,
    queue: usize,
    running: bool,
}

/// Free resources per fleet node, changed task by task and undone if a gang does not fit.
struct View<'f, 'a> {
    fleet: &'f Fleet<'a>,
    free: Vec<NodeFree>,
}

impl View<'_, '_> {
    /// The node that fits one task of `shape` best, and how.
    fn best(&self, sc: &Scorer, shape: &Shape) -> Option<(NodeIdx, TaskFit)> {
        self.fleet
            .nodes
            .iter()
            .zip(&self.free)
            .enumerate()
            .filter_map(|(i, (n, f))| evaluate_node(sc, n, f, shape).map(|fit| (i as NodeIdx, fit)))
            .min_by_key(|(i, fit)| (fit.key, *i))
    }

    fn take(&mut self, idx: NodeIdx, shape: &Shape, fit: &TaskFit) {
        let node = self.fleet.nodes[idx as usize].node;
        let f = &mut self.free[idx as usize];
        *f = take(node, f, shape, &fit.units);
    }

    /// All tasks of the job, or none (the view is left as it was).
    fn place_all(&mut self, sc: &Scorer, shape: &Shape, tasks: u32) -> Option<Fits> {
        let mut undo = Vec::new();
        let mut out = Vec::new();
        for _ in 0..tasks {
            let Some((idx, fit)) = self.best(sc, shape) else {
                for (i, f) in undo.into_iter().rev() {
                    self.free[i as usize] = f;
                }
                return None;
            };
            undo.push((idx, self.free[idx as usize]));
            self.take(idx, shape, &fit);
            out.push((idx, fit));
        }
        Some(out)
    }

    /// Gives back what the job's live allocations hold.
    fn release(&mut self, state: &ClusterState, job: &Job) {
        for rec in state.allocations_of(job.id) {
            if let Some(idx) = self.fleet.index_of.get(&rec.allocation.node) {
                let node = self.fleet.nodes[idx as usize].node;
                self.free[idx as usize].add_allocation(node, job, rec);
            }
        }
    }
}

fn whole_gpus(free: &NodeFree) -> u64 {
    free.milli().iter().filter(|&&m| m >= 1000).count() as u64
}

/// Whole GPUs a job needs, for the quick checks against free whole GPUs: 0 for shares and MIG
/// slices, which those counts do not see.
fn whole_gpu_demand(job: &Job) -> u64 {
    if job.spec.gpu_milli > 0 || job.spec.mig_profile.is_some() {
        0
    } else {
        job.spec.total_gpus()
    }
}

/// One pass of the baseline at `now`.
pub fn plan(state: &ClusterState, now: Timestamp, cfg: &LasConfig) -> LasPlan {
    let mut cands: Vec<Candidate> = state
        .pending_jobs()
        .filter(|j| eligible(j, now) && dependencies_met(state, j))
        .map(|job| Candidate {
            job,
            queue: queue_of(attained(job, now, cfg).service_gpu_ms, cfg),
            running: false,
        })
        .collect();
    let live: BTreeSet<JobId> = state
        .allocations
        .values()
        .map(|r| r.allocation.job)
        .collect();
    let fleet = Fleet::build(state);
    let mut free = View {
        free: fleet.nodes.iter().map(|n| n.free).collect(),
        fleet: &fleet,
    };
    // `soon`: what is free once the jobs already stopping have exited.
    let mut soon = View {
        free: free.free.clone(),
        fleet: &fleet,
    };
    for id in &live {
        let job = &state.jobs[id];
        if job.state.is_final() || job.ending.is_some() {
            soon.release(state, job);
        } else {
            cands.push(Candidate {
                job,
                queue: queue_of(attained(job, now, cfg).service_gpu_ms, cfg),
                running: true,
            });
        }
    }
    cands.sort_by_key(|c| (c.queue, c.job.submitted_at, c.job.id));
    // Running candidates by node, for the victim search.
    let mut on_node: BTreeMap<NodeIdx, Vec<usize>> = BTreeMap::new();
    for (k, c) in cands.iter().enumerate().filter(|(_, c)| c.running) {
        for rec in state.allocations_of(c.job.id) {
            if let Some(idx) = fleet.index_of.get(&rec.allocation.node) {
                on_node.entry(idx).or_default().push(k);
            }
        }
    }
    let sc = Scorer::fit_only();
    let mut out = LasPlan::default();
    let mut stopped = vec![false; cands.len()];
    // GPUs held by running candidates not yet passed in the walk, by queue.
    let mut victim_gpus = vec![0u64; cfg.thresholds_gpu_s.len() + 1];
    for c in cands.iter().filter(|c| c.running) {
        victim_gpus[c.queue] += whole_gpu_demand(c.job);
    }
    let mut free_gpus: u64 = free.free.iter().map(whole_gpus).sum();
    let mut soon_gpus: u64 = soon.free.iter().map(whole_gpus).sum();
    for k in 0..cands.len() {
        let c = &cands[k];
        let want = whole_gpu_demand(c.job);
        if c.running {
            // A job stopped earlier in the walk left the count when it was chosen.
            if !stopped[k] {
                victim_gpus[c.queue] -= want;
            }
            continue;
        }
        let shape = Shape::of(&c.job.spec);
        let tasks = c.job.spec.tasks;
        // Starts now on free resources.
        if want <= free_gpus
            && let Some(fits) = free.place_all(&sc, &shape, tasks)
        {
            for (idx, fit) in &fits {
                soon.take(*idx, &shape, fit);
            }
            out.placements.push(placement(&fleet, c.job.id, &fits));
            free_gpus = free_gpus.saturating_sub(want);
            soon_gpus = soon_gpus.saturating_sub(want);
            continue;
        }
        // Starts once the jobs already stopping have exited: keep that room for it.
        if want <= soon_gpus
            && let Some(fits) = soon.place_all(&sc, &shape, tasks)
        {
            for (idx, fit) in &fits {
                free.take(*idx, &shape, fit);
            }
            soon_gpus = soon_gpus.saturating_sub(want);
            free_gpus = free.free.iter().map(whole_gpus).sum();
            continue;
        }
        let lower: u64 = victim_gpus[c.queue + 1..].iter().sum();
        if !cfg.preemption || want > soon_gpus + lower {
            continue;
        }
        let Some((fits, victims)) = place_with_victims(
            state, &mut soon, &sc, &shape, tasks, k, &cands, &on_node, &stopped,
        ) else {
            continue;
        };
        for &v in &victims {
            stopped[v] = true;
            victim_gpus[cands[v].queue] -= whole_gpu_demand(cands[v].job);
            out.stop.push(cands[v].job.id);
        }
        for (idx, fit) in &fits {
            free.take(*idx, &shape, fit);
        }
        free_gpus = free.free.iter().map(whole_gpus).sum();
        soon_gpus = soon.free.iter().map(whole_gpus).sum();
    }
    out
}

/// Places every task of candidate `k` on `soon` with running jobs of lower queues stopped:
/// per task, a node where it fits as is, else the node where stopping the fewest of them
/// (lowest priority first) makes it fit. Returns the fits and the candidates to stop; on
/// failure `soon` is left as it was.
#[allow(clippy::too_many_arguments)]
fn place_with_victims(
    state: &ClusterState,
    soon: &mut View,
    sc: &Scorer,
    shape: &Shape,
    tasks: u32,
    k: usize,
    cands: &[Candidate],
    on_node: &BTreeMap<NodeIdx, Vec<usize>>,
    stopped: &[bool],
) -> Option<(Fits, Vec<usize>)> {
    let queue = cands[k].queue;
    let saved = soon.free.clone();
    let mut chosen: Vec<usize> = Vec::new();
    let mut fits = Vec::new();
    let may_stop = |v: usize, chosen: &[usize]| {
        cands[v].running && cands[v].queue > queue && !stopped[v] && !chosen.contains(&v)
    };
    for _ in 0..tasks {
        if let Some((idx, fit)) = soon.best(sc, shape) {
            soon.take(idx, shape, &fit);
            fits.push((idx, fit));
            continue;
        }
        // (victims, node, victims to stop there).
        let mut best: Option<(usize, NodeIdx, Vec<usize>)> = None;
        for (&idx, here) in on_node {
            let mut victims: Vec<usize> = here
                .iter()
                .copied()
                .filter(|&v| may_stop(v, &chosen))
                .collect();
            victims.sort_unstable();
            victims.dedup();
            // Lowest priority first: the last in the pass's order.
            victims.reverse();
            let node = soon.fleet.nodes[idx as usize].node;
            let mut acc = soon.free[idx as usize];
            for (n, &v) in victims.iter().enumerate() {
                // Nodes are visited in order: on a tie the first node found stays.
                if best.as_ref().is_some_and(|b| b.0 <= n + 1) {
                    break;
                }
                for rec in state.allocations_of(cands[v].job.id) {
                    if rec.allocation.node == node.spec.name {
                        acc.add_allocation(node, cands[v].job, rec);
                    }
                }
                if evaluate_node(sc, &soon.fleet.nodes[idx as usize], &acc, shape).is_some() {
                    best = Some((n + 1, idx, victims[..=n].to_vec()));
                    break;
                }
            }
        }
        let Some((_, idx, victims)) = best else {
            soon.free = saved;
            return None;
        };
        for v in victims {
            soon.release(state, cands[v].job);
            chosen.push(v);
        }
        let fit = evaluate_node(
            sc,
            &soon.fleet.nodes[idx as usize],
            &soon.free[idx as usize],
            shape,
        )
        .expect("fits once its victims have stopped");
        soon.take(idx, shape, &fit);
        fits.push((idx, fit));
    }
    Some((fits, chosen))
}

fn placement(fleet: &Fleet, job: JobId, fits: &[(NodeIdx, TaskFit)]) -> JobPlacement {
    JobPlacement {
        job,
        tasks: fits
            .iter()
            .map(|(idx, fit)| {
                let node = fleet.nodes[*idx as usize].node;
                TaskPlacement {
                    node: node.spec.name.clone(),
                    gpus: unit_uuids(node, &fit.units),
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::sim::replay::EPOCH_MS;
    use crate::state::{Command, JobChange, JobSpec, Outcome, TaskOutcome};
    use crate::synthetic::Driver;

    /// One node of `gpus` GPUs, one tenant, and the plans of the baseline applied to it.
    struct World {
        d: Driver,
        cfg: LasConfig,
    }

    impl World {
        fn new(gpus: u32) -> World {
            let mut d = Driver::new(EPOCH_MS);
            let spec = crate::sim::test_fleet::plain_node("n0", gpus);
            assert_eq!(
                d.apply(&Command::RegisterNode { spec }),
                Outcome::NodeRegistered
            );
            assert_eq!(
                d.apply(&Command::SetClusterVersion { version: 2 }),
                Outcome::Done
            );
            World {
                d,
                cfg: LasConfig::default(),
            }
        }

        fn at(&mut self, secs: u64) {
            self.d.now = EPOCH_MS + secs * 1000;
        }

        fn submit(&mut self, gpus: u32) -> JobId {
            self.submit_share(gpus, 0)
        }

        /// A job of `gpus` GPUs, or with `milli` > 0 a share of one GPU.
        fn submit_share(&mut self, gpus: u32, milli: u32) -> JobId {
            let spec = JobSpec {
                gpu_milli: milli,
                tenant: "t".into(),
                name: "j".into(),
                command: vec!["x".into()],
                gpus_per_task: gpus,
                tasks: 1,
                priority_class: "normal".into(),
                cpu_milli_per_task: 1000,
                memory_mib_per_task: 1024,
                ..JobSpec::default()
            };
            match self.d.apply(&Command::submit(spec, None)) {
                Outcome::JobSubmitted { id, .. } => id,
                o => panic!("submit: {o:?}"),
            }
        }

        fn plan(&self) -> LasPlan {
            plan(&self.d.state, self.d.now, &self.cfg)
        }

        /// Applies a plan: stops requested, placements accepted and started.
        fn apply(&mut self, p: &LasPlan) {
            if !p.stop.is_empty() {
                let o = self.d.apply(&Command::ChangeJobs {
                    jobs: p.stop.clone(),
                    change: JobChange::Requeue {
                        reason: "test".into(),
                    },
                });
                assert!(
                    matches!(o, Outcome::JobsChanged { ref refused, .. } if refused.is_empty()),
                    "{o:?}"
                );
            }
            if p.placements.is_empty() {
                return;
            }
            let o = self.d.apply(&Command::Place {
                term: 1,
                placements: p.placements.clone(),
            });
            assert!(
                matches!(o, Outcome::Placed { ref rejected, .. } if rejected.is_empty()),
                "{o:?}"
            );
            for jp in &p.placements {
                for allocation in self.d.state.jobs[&jp.job].allocations.clone() {
                    assert_eq!(
                        self.d.apply(&Command::AllocationStarted { allocation }),
                        Outcome::Done
                    );
                }
            }
        }

        /// Every task of `job` exits (stopped: requeued unless its stop said otherwise).
        fn exit(&mut self, job: JobId) {
            for allocation in self.d.state.jobs[&job].allocations.clone() {
                let o = self.d.apply(&Command::AllocationExited {
                    allocation,
                    outcome: TaskOutcome::Stopped,
                    usage: None,
                });
                assert_eq!(o, Outcome::Done);
            }
        }

        fn placed(p: &LasPlan) -> Vec<JobId> {
            p.placements.iter().map(|p| p.job).collect()
        }

        fn queue(&self, job: JobId) -> usize {
            let a = attained(&self.d.state.jobs[&job], self.d.now, &self.cfg);
            queue_of(a.service_gpu_ms, &self.cfg)
        }
    }

    #[test]
    fn queues_by_attained_gpu_seconds() {
        let cfg = LasConfig::default();
        assert_eq!(queue_of(0, &cfg), 0);
        assert_eq!(queue_of(3_249_999, &cfg), 0);
        assert_eq!(queue_of(3_250_000, &cfg), 1);
        assert_eq!(queue_of(17_999_999, &cfg), 1);
        assert_eq!(queue_of(18_000_000, &cfg), 2);
        // Service is GPUs × time: 4 GPUs for 1,000 s is 4,000 GPU-s, queue 1; one GPU for as
        // long is still queue 0.
        let mut w = World::new(8);
        let big = w.submit(4);
        let small = w.submit(1);
        let p = w.plan();
        assert_eq!(World::placed(&p), [big, small]);
        w.apply(&p);
        w.at(1000);
        let a = attained(&w.d.state.jobs[&big], w.d.now, &w.cfg);
        assert_eq!((a.service_gpu_ms, a.run_ms), (4_000_000, 1_000_000));
        assert_eq!((w.queue(big), w.queue(small)), (1, 0));
    }

    #[test]
    fn lower_queue_first_then_submission_order() {
        let mut w = World::new(4);
        let old = w.submit(4);
        w.apply(&w.plan());
        // `old` runs 1,000 s (4,000 GPU-s: queue 1), then is stopped by hand and requeued.
        w.at(1000);
        w.apply(&LasPlan {
            placements: vec![],
            stop: vec![old],
        });
        w.exit(old);
        assert_eq!(w.d.state.jobs[&old].state, JobState::Pending);
        w.at(1001);
        let first_new = w.submit(4);
        w.at(1002);
        let second_new = w.submit(4);
        // Both new jobs (queue 0) come before `old` (queue 1), the earlier one first; each
        // needs the whole node, so only the first starts.
        assert_eq!(w.queue(old), 1);
        let p = w.plan();
        assert_eq!(World::placed(&p), [first_new]);
        assert!(p.stop.is_empty());
        w.apply(&p);
        // `first_new` ends; the next in queue 0 is `second_new`, still ahead of `old`.
        w.at(1010);
        w.d.apply(&Command::AllocationExited {
            allocation: w.d.state.jobs[&first_new].allocations[0],
            outcome: TaskOutcome::Succeeded,
            usage: None,
        });
        assert_eq!(World::placed(&w.plan()), [second_new]);
    }

    #[test]
    fn a_waiting_job_stops_a_lower_queue_job_never_one_of_its_own() {
        let mut w = World::new(4);
        let long = w.submit(4);
        w.apply(&w.plan());
        // A newcomer of the same queue waits: no stop.
        w.at(100);
        let peer = w.submit(2);
        let p = w.plan();
        assert!(p.placements.is_empty() && p.stop.is_empty(), "{p:?}");
        // Once `long` has 4 × 1,000 GPU-s it is in queue 1: the waiting job stops it, and
        // waits for it to exit (nothing is placed on GPUs still held).
        w.at(1000);
        assert_eq!((w.queue(long), w.queue(peer)), (1, 0));
        let p = w.plan();
        assert_eq!(p.stop, [long]);
        assert!(p.placements.is_empty());
        w.apply(&p);
        // While `long` stops, the next pass does not stop anything else, nor place.
        w.at(1010);
        let p = w.plan();
        assert_eq!(p, LasPlan::default());
        // `long` exits and is requeued; `peer` starts. The 2 GPUs left do not hold `long`,
        // and `long` (queue 1) may not stop `peer` (queue 0).
        w.at(1030);
        w.exit(long);
        let p = w.plan();
        assert_eq!(World::placed(&p), [peer]);
        assert!(p.stop.is_empty());
        w.apply(&p);
        assert_eq!(w.plan(), LasPlan::default());
        // Its service survives the requeue.
        let a = attained(&w.d.state.jobs[&long], w.d.now, &w.cfg);
        assert_eq!(a.service_gpu_ms, 4 * 1_030_000);
        // Without preemption nothing is ever stopped.
        let mut w = World::new(4);
        w.cfg.preemption = false;
        let long = w.submit(4);
        w.apply(&w.plan());
        w.at(1000);
        w.submit(2);
        assert_eq!(w.queue(long), 1);
        assert_eq!(w.plan(), LasPlan::default());
    }

    #[test]
    fn shares_fill_a_partly_used_gpu() {
        // One GPU: a 600-milli share runs; no whole GPU is free, but a 400-milli share fits
        // beside it, and a 500-milli one does not.
        let mut w = World::new(1);
        let first = w.submit_share(1, 600);
        w.apply(&w.plan());
        let fits = w.submit_share(1, 400);
        let too_big = w.submit_share(1, 500);
        let p = w.plan();
        assert_eq!(World::placed(&p), [fits], "{p:?}");
        assert!(p.stop.is_empty());
        w.apply(&p);
        assert!(w.d.state.jobs[&first].allocations.len() == 1);
        assert!(w.d.state.jobs[&too_big].allocations.is_empty());
    }

    #[test]
    fn a_starved_job_is_promoted_to_the_first_queue() {
        let mut w = World::new(4);
        w.cfg.starve_limit = 3;
        let starved = w.submit(4);
        w.apply(&w.plan());
        // Runs 1,000 s (4,000 GPU-s: queue 1), is stopped, and a stream of new 4-GPU jobs
        // of queue 0 keeps it waiting.
        w.at(1000);
        w.apply(&LasPlan {
            placements: vec![],
            stop: vec![starved],
        });
        w.exit(starved);
        let blocker = w.submit(4);
        w.apply(&w.plan());
        assert_eq!(w.queue(starved), 1);
        // Waited 2,999 s of the 3 × 1,000 s that promote it: still queue 1.
        w.at(3999);
        let a = attained(&w.d.state.jobs[&starved], w.d.now, &w.cfg);
        assert_eq!((a.waited_ms, a.promotions), (2_999_000, 0));
        assert_eq!(w.queue(starved), 1);
        // At 3 × its run time it is promoted: service counted from zero, queue 0. Submitted
        // before the blocker, now in the same queue as it, it is next once the blocker ends.
        w.at(4000);
        let a = attained(&w.d.state.jobs[&starved], w.d.now, &w.cfg);
        assert_eq!(
            a,
            Attained {
                promotions: 1,
                ..Attained::default()
            }
        );
        assert_eq!(w.queue(starved), 0);
        let newcomer = w.submit(4);
        w.d.apply(&Command::AllocationExited {
            allocation: w.d.state.jobs[&blocker].allocations[0],
            outcome: TaskOutcome::Succeeded,
            usage: None,
        });
        assert_eq!(World::placed(&w.plan()), [starved]);
        assert_eq!(w.queue(newcomer), 0);
        // The guard off: it stays in queue 1 however long it waits.
        w.cfg.starve_limit = 0;
        assert_eq!(w.queue(starved), 1);
    }
}
