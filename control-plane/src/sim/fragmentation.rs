//! The fragmentation experiment of the FGD paper (Weng et al., USENIX ATC '23, §6 and its
//! artifact), run on the scheduler's own scoring code (`scheduler::score`).
//!
//! For each seed, tasks are drawn (with replacement) from the pod list until their GPU requests
//! add up to `arrivals_pct` (130) percent of the cluster's GPU capacity. Each task is placed on
//! arrival on the node the policy scores best (CPU, memory and GPUs must fit on one node; a
//! share must fit on one GPU; whole-GPU tasks take fully free GPUs) or fails; tasks never leave.
//! The figure of merit is the share of GPU capacity allocated as arrivals grow: a policy that
//! fragments less places more before the cluster stops accepting work.
//!
//! Every policy sees the same task sequence and the same node order for a given seed (the node
//! order is a seeded shuffle, as the artifact's random node names; the lowest score wins and
//! ties go to the first node in that order). FGD's target workload is the pod list's task
//! types with their frequencies, restricted to the most frequent types covering
//! `workload_coverage` of the tasks (the artifact's "typical pods", 95%). Runs are
//! deterministic per seed, whatever the number of threads.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use super::trace::{TraceNode, TracePod};
use crate::scheduler::frag::Workload;
use crate::scheduler::score::{
    Demand, FULL_GPU_MILLI, NodeResources, ScorePolicy, SplitMix64, evaluate, evaluate_score, mix64,
};

/// Independent random streams derived from one seed.
const TASK_STREAM: u64 = 0x7461_736b;
const ORDER_STREAM: u64 = 0x6f72_6465;
const POLICY_STREAM: u64 = 0x706f_6c69;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// One run per seed and policy.
    pub seeds: Vec<u64>,
    pub policies: Vec<ScorePolicy>,
    /// Sampling stops once arrived GPU requests reach this percentage of GPU capacity.
    pub arrivals_pct: u32,
    /// Share of the pod list's tasks that FGD's target workload covers (most frequent types
    /// first); 1.0 keeps every type.
    pub workload_coverage: f64,
    /// Stop each run after this many tasks (smoke runs); `None`: until `arrivals_pct`.
    pub max_tasks: Option<usize>,
    /// Worker threads (runs are independent); 0: one per available core.
    pub threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            seeds: (42..52).collect(),
            policies: vec![
                ScorePolicy::RandomFit { seed: 0 },
                ScorePolicy::BestFit,
                ScorePolicy::Fgd,
                ScorePolicy::FgdLookahead,
                ScorePolicy::FgdHorizon,
            ],
            arrivals_pct: 130,
            workload_coverage: 0.95,
            max_tasks: None,
            threads: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error("the node list has no GPUs")]
    NoGpuCapacity,
    #[error("no task in the pod list asks for a GPU, so arrivals never grow")]
    NoGpuTasks,
    #[error("no seeds to run")]
    NoSeeds,
    #[error("no policies to run")]
    NoPolicies,
    #[error("arrivals must be a positive percentage of GPU capacity")]
    NoArrivals,
    #[error("workload coverage must be in (0, 1], got {0}")]
    BadCoverage(f64),
}

/// One run: one policy, one seed.
#[derive(Debug, Clone, PartialEq)]
pub struct SeedRun {
    pub seed: u64,
    /// Tasks that arrived.
    pub tasks: usize,
    /// Tasks that could not be placed.
    pub failed: usize,
    /// `curve[k]`: allocated GPU milli as a percentage of capacity when arrived GPU requests
    /// first reached k percent of capacity (k = 0, 1, ... as far as the run got).
    pub curve: Vec<f64>,
    /// Arrived GPU requests at the end, percent of capacity.
    pub arrived_pct: f64,
    /// Allocated GPU milli at the end, percent of capacity.
    pub allocated_pct: f64,
}

impl SeedRun {
    /// Allocated percentage when arrivals reached `pct` percent, if they did.
    pub fn allocated_at(&self, pct: usize) -> Option<f64> {
        self.curve.get(pct).copied()
    }
}

/// All runs of one policy, by seed in the configured order.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyReport {
    pub policy: ScorePolicy,
    pub runs: Vec<SeedRun>,
}

impl PolicyReport {
    /// Mean over seeds of the allocated percentage at `pct` percent arrivals; `None` unless
    /// every run got there.
    pub fn mean_at(&self, pct: usize) -> Option<f64> {
        let values: Option<Vec<f64>> = self.runs.iter().map(|r| r.allocated_at(pct)).collect();
        values.filter(|v| !v.is_empty()).map(|v| mean(&v))
    }

    /// Mean curve over seeds, as far as every run got.
    pub fn mean_curve(&self) -> Vec<f64> {
        let len = self.runs.iter().map(|r| r.curve.len()).min().unwrap_or(0);
        (0..len)
            .map(|k| mean(&self.runs.iter().map(|r| r.curve[k]).collect::<Vec<_>>()))
            .collect()
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub nodes: usize,
    pub gpus: u64,
    pub capacity_milli: u64,
    /// Distinct task types in the pod list.
    pub task_types: usize,
    /// Task types in FGD's target workload.
    pub workload_types: usize,
    pub config: Config,
    pub policies: Vec<PolicyReport>,
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn opt3(x: Option<f64>) -> Value {
    x.map(|v| json!(round3(v))).unwrap_or(Value::Null)
}

impl Report {
    /// `{"policies": [{"policy", "allocated_at_100", "allocated_at_130", "allocated_at_end",
    /// "curve", "seeds": [...]}, ...], "seeds", "nodes", "gpus", ...}`; percentages of GPU
    /// capacity, `null` where arrivals never got that far.
    pub fn to_json(&self) -> Value {
        let policies: Vec<Value> = self
            .policies
            .iter()
            .map(|p| {
                let seeds: Vec<Value> = p
                    .runs
                    .iter()
                    .map(|r| {
                        json!({
                            "seed": r.seed,
                            "allocated_at_100": opt3(r.allocated_at(100)),
                            "allocated_at_130": opt3(r.allocated_at(130)),
                            "allocated_at_end": round3(r.allocated_pct),
                            "arrived_at_end": round3(r.arrived_pct),
                            "tasks": r.tasks,
                            "failed": r.failed,
                        })
                    })
                    .collect();
                json!({
                    "policy": p.policy.name(),
                    "allocated_at_100": opt3(p.mean_at(100)),
                    "allocated_at_130": opt3(p.mean_at(130)),
                    "allocated_at_end": round3(mean(&p.runs.iter().map(|r| r.allocated_pct).collect::<Vec<_>>())),
                    "curve": p.mean_curve().into_iter().map(round3).collect::<Vec<_>>(),
                    "seeds": seeds,
                })
            })
            .collect();
        json!({
            "policies": policies,
            "seeds": self.config.seeds,
            "arrivals_pct": self.config.arrivals_pct,
            "workload_coverage": self.config.workload_coverage,
            "max_tasks": self.config.max_tasks,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "task_types": self.task_types,
            "workload_types": self.workload_types,
        })
    }
}

/// What every run shares: the cluster, the task types and FGD's workload.
struct Prepared<'a> {
    nodes: &'a [TraceNode],
    demands: Vec<Demand<'a>>,
    /// Task type (index) of each pod, for the per-node score cache.
    type_of: Vec<usize>,
    types: usize,
    workload: Workload,
    capacity: u64,
    /// First GPU of each node in the flat per-GPU array.
    offsets: Vec<usize>,
    gpu_count: usize,
}

/// Runs every (seed, policy) pair, in parallel.
pub fn run(nodes: &[TraceNode], pods: &[TracePod], config: &Config) -> Result<Report, SimError> {
    run_with_progress(nodes, pods, config, &|| {})
}

/// How many (seed, policy) runs `config` makes.
pub fn run_count(config: &Config) -> usize {
    config.seeds.len() * config.policies.len()
}

/// `run`, calling `on_run` (from a worker thread) as each of the `run_count` runs ends.
pub fn run_with_progress(
    nodes: &[TraceNode],
    pods: &[TracePod],
    config: &Config,
    on_run: &(dyn Fn() + Sync),
) -> Result<Report, SimError> {
    if config.seeds.is_empty() {
        return Err(SimError::NoSeeds);
    }
    if config.policies.is_empty() {
        return Err(SimError::NoPolicies);
    }
    if config.arrivals_pct == 0 {
        return Err(SimError::NoArrivals);
    }
    if !(config.workload_coverage > 0.0 && config.workload_coverage <= 1.0) {
        return Err(SimError::BadCoverage(config.workload_coverage));
    }
    let prep = prepare(nodes, pods, config)?;
    let jobs: Vec<(usize, usize)> = (0..config.seeds.len())
        .flat_map(|s| (0..config.policies.len()).map(move |p| (s, p)))
        .collect();
    let threads = if config.threads > 0 {
        config.threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
    .min(jobs.len());
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<SeedRun>> = vec![None; jobs.len()];
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let j = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(s, p)) = jobs.get(j) else { break };
                        let run = simulate(&prep, &config.policies[p], config.seeds[s], config);
                        on_run();
                        done.push((j, run));
                    }
                    done
                })
            })
            .collect();
        for w in workers {
            for (j, run) in w.join().expect("simulation worker panicked") {
                results[j] = Some(run);
            }
        }
    });
    let mut policies: Vec<PolicyReport> = config
        .policies
        .iter()
        .map(|p| PolicyReport {
            policy: p.clone(),
            runs: Vec::new(),
        })
        .collect();
    for (&(_, p), run) in jobs.iter().zip(results) {
        policies[p].runs.push(run.expect("every job ran"));
    }
    Ok(Report {
        nodes: nodes.len(),
        gpus: nodes.iter().map(|n| u64::from(n.gpus)).sum(),
        capacity_milli: prep.capacity,
        task_types: prep.types,
        workload_types: prep.workload.len(),
        config: config.clone(),
        policies,
    })
}

fn prepare<'a>(
    nodes: &'a [TraceNode],
    pods: &'a [TracePod],
    config: &Config,
) -> Result<Prepared<'a>, SimError> {
    let capacity: u64 = nodes
        .iter()
        .map(|n| u64::from(n.gpus) * u64::from(FULL_GPU_MILLI))
        .sum();
    if capacity == 0 {
        return Err(SimError::NoGpuCapacity);
    }
    let demands: Vec<Demand> = pods.iter().map(TracePod::demand).collect();
    if !demands.iter().any(|d| d.total_gpu_milli() > 0) {
        return Err(SimError::NoGpuTasks);
    }
    type Key = (u64, u64, u32, u32, Vec<String>);
    let mut ids: BTreeMap<Key, usize> = BTreeMap::new();
    let type_of = demands
        .iter()
        .map(|d| {
            let mut models = d.models.to_vec();
            models.sort();
            let key = (d.cpu_milli, d.memory_mib, d.gpus, d.milli_per_gpu, models);
            let next = ids.len();
            *ids.entry(key).or_insert(next)
        })
        .collect();
    let workload =
        Workload::from_demands(demands.iter().copied()).typical(config.workload_coverage);
    let mut offsets = Vec::with_capacity(nodes.len());
    let mut gpu_count = 0;
    for n in nodes {
        offsets.push(gpu_count);
        gpu_count += n.gpus as usize;
    }
    Ok(Prepared {
        nodes,
        demands,
        type_of,
        types: ids.len(),
        workload,
        capacity,
        offsets,
        gpu_count,
    })
}

/// The seed's task sequence: pod indexes drawn with replacement until arrived GPU requests
/// reach `arrivals_pct` percent of capacity (or `max_tasks`).
fn sample_tasks(prep: &Prepared, seed: u64, config: &Config) -> Vec<usize> {
    let mut rng = SplitMix64::new(mix64(seed ^ TASK_STREAM));
    let target = u128::from(config.arrivals_pct) * u128::from(prep.capacity);
    let mut arrived: u128 = 0;
    let mut tasks = Vec::new();
    while arrived * 100 < target && config.max_tasks.is_none_or(|m| tasks.len() < m) {
        let i = rng.below(prep.demands.len() as u64) as usize;
        arrived += u128::from(prep.demands[i].total_gpu_milli());
        tasks.push(i);
    }
    tasks
}

/// The seed's node order (a Fisher-Yates shuffle): candidates are scanned in this order and
/// the first of equal scores wins.
fn node_order(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(mix64(seed ^ ORDER_STREAM));
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// One run. Scores of the deterministic policies are cached per (node, task type) and
/// recomputed only after the node changes: placing a task changes one node, so a decision
/// costs a scan of cached values plus the few nodes placed on since that type last came.
fn simulate(prep: &Prepared, policy: &ScorePolicy, seed: u64, config: &Config) -> SeedRun {
    let tasks = sample_tasks(prep, seed, config);
    let order = node_order(prep.nodes.len(), seed);
    let policy = match policy {
        ScorePolicy::RandomFit { .. } => ScorePolicy::RandomFit {
            seed: mix64(seed ^ POLICY_STREAM),
        },
        p => p.clone(),
    };
    let n = prep.nodes.len();
    let mut cpu: Vec<u64> = prep.nodes.iter().map(|n| n.cpu_milli).collect();
    let mut mem: Vec<u64> = prep.nodes.iter().map(|n| n.memory_mib).collect();
    let mut gpus: Vec<u32> = vec![FULL_GPU_MILLI; prep.gpu_count];
    let mut version = vec![0u32; n];
    let cacheable = policy.is_deterministic();
    let slots = if cacheable { n * prep.types } else { 0 };
    // A slot is valid when its stamp is the node's version + 1.
    let mut stamp = vec![0u32; slots];
    let mut cached = vec![f64::NAN; slots];

    let capacity = prep.capacity;
    let max_point = config.arrivals_pct as u64;
    let pct = |milli: u64| milli as f64 * 100.0 / capacity as f64;
    let mut curve = Vec::with_capacity(max_point as usize + 1);
    let mut arrived = 0u64;
    let mut allocated = 0u64;
    let mut failed = 0;
    let record = |arrived: u64, allocated: u64, curve: &mut Vec<f64>| {
        while (curve.len() as u64) <= max_point
            && u128::from(arrived) * 100 >= curve.len() as u128 * u128::from(capacity)
        {
            curve.push(pct(allocated));
        }
    };
    record(0, 0, &mut curve);

    for (k, &pod) in tasks.iter().enumerate() {
        let d = &prep.demands[pod];
        let t = prep.type_of[pod];
        let nonce = |i: usize| ((k as u64) << 32) | i as u64;
        let mut best: Option<(f64, usize)> = None;
        for &i in &order {
            let score = if cacheable {
                let slot = i * prep.types + t;
                if stamp[slot] != version[i] + 1 {
                    let node = resources(prep, i, &cpu, &mem, &gpus);
                    cached[slot] =
                        evaluate_score(&policy, &node, d, &prep.workload, 0).unwrap_or(f64::NAN);
                    stamp[slot] = version[i] + 1;
                }
                cached[slot]
            } else {
                let node = resources(prep, i, &cpu, &mem, &gpus);
                evaluate_score(&policy, &node, d, &prep.workload, nonce(i)).unwrap_or(f64::NAN)
            };
            if !score.is_nan() && best.is_none_or(|(b, _)| score < b) {
                best = Some((score, i));
            }
        }
        match best {
            Some((_, i)) => {
                let node = resources(prep, i, &cpu, &mem, &gpus);
                let choice = evaluate(&policy, &node, d, &prep.workload, nonce(i))
                    .expect("the chosen node was scored, so the task fits");
                cpu[i] -= d.cpu_milli;
                mem[i] -= d.memory_mib;
                if d.uses_gpu() {
                    let take = d.milli_per_gpu.min(FULL_GPU_MILLI);
                    for g in choice.gpus {
                        gpus[prep.offsets[i] + g] -= take;
                    }
                }
                allocated += d.total_gpu_milli();
                version[i] += 1;
            }
            None => failed += 1,
        }
        arrived += d.total_gpu_milli();
        debug_assert!(allocated <= capacity);
        record(arrived, allocated, &mut curve);
    }
    SeedRun {
        seed,
        tasks: tasks.len(),
        failed,
        curve,
        arrived_pct: pct(arrived),
        allocated_pct: pct(allocated),
    }
}

/// Node `i` as it stands.
fn resources<'a>(
    prep: &'a Prepared,
    i: usize,
    cpu: &[u64],
    mem: &[u64],
    gpus: &'a [u32],
) -> NodeResources<'a> {
    let first = prep.offsets[i];
    NodeResources {
        cpu_milli: cpu[i],
        memory_mib: mem[i],
        model: &prep.nodes[i].model,
        gpu_milli: &gpus[first..first + prep.nodes[i].gpus as usize],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cpu: u64, gpus: u32) -> TraceNode {
        TraceNode {
            name: name.into(),
            cpu_milli: cpu,
            memory_mib: 1 << 20,
            gpus,
            model: "T4".into(),
        }
    }

    fn pod(cpu: u64, num_gpu: u32, milli: u32) -> TracePod {
        TracePod {
            name: String::new(),
            cpu_milli: cpu,
            memory_mib: 1024,
            num_gpu,
            gpu_milli: milli,
            gpu_spec: Vec::new(),
        }
    }

    /// 24 nodes of 8 GPUs. Tasks: shares of 600 and 400 milli (which pair up on one GPU only
    /// when placed with care) and whole 4- and 8-GPU tasks that need GPUs no share has touched.
    fn fragmenting_case() -> (Vec<TraceNode>, Vec<TracePod>) {
        let nodes = (0..24).map(|i| node(&format!("n{i}"), 64_000, 8)).collect();
        let mut pods = Vec::new();
        pods.extend(std::iter::repeat_n(pod(1_000, 1, 600), 6));
        pods.extend(std::iter::repeat_n(pod(1_000, 1, 400), 6));
        pods.extend(std::iter::repeat_n(pod(4_000, 4, 1000), 2));
        pods.extend(std::iter::repeat_n(pod(8_000, 8, 1000), 1));
        pods.extend(std::iter::repeat_n(pod(2_000, 0, 0), 2));
        (nodes, pods)
    }

    fn config(policies: &str, seeds: std::ops::Range<u64>) -> Config {
        Config {
            seeds: seeds.collect(),
            policies: policies.split(',').map(|p| p.parse().unwrap()).collect(),
            threads: 2,
            ..Config::default()
        }
    }

    #[test]
    fn fgd_beats_best_fit_beats_random_fit_where_fragmentation_matters() {
        let (nodes, pods) = fragmenting_case();
        let report = run(&nodes, &pods, &config("random-fit,best-fit,fgd", 0..6)).unwrap();
        let at = |p: usize, k: usize| report.policies[p].mean_at(k).unwrap();
        let (random, best, fgd) = (at(0, 130), at(1, 130), at(2, 130));
        assert!(fgd > best && best > random, "{random} {best} {fgd}");
        assert!(fgd > 97.0, "{fgd}");
        // Below capacity the fragmentation-aware policy still places everything.
        assert!(at(2, 50) > 49.0, "{}", at(2, 50));
    }

    #[test]
    fn allocation_never_exceeds_capacity_nor_arrivals() {
        let (nodes, pods) = fragmenting_case();
        let report = run(&nodes, &pods, &config("random-fit,best-fit,fgd", 0..3)).unwrap();
        for p in &report.policies {
            for r in &p.runs {
                assert_eq!(r.curve.len(), 131);
                assert_eq!(r.curve[0], 0.0);
                assert!(r.arrived_pct >= 130.0 && r.arrived_pct < 130.0 + 8.0 * 100.0 / 192.0);
                assert!(r.allocated_pct <= 100.0);
                for (k, w) in r.curve.windows(2).enumerate() {
                    // Monotone (tasks never leave), at most the arrivals, at most capacity.
                    assert!(w[0] <= w[1], "{} seed {}: {w:?}", p.policy, r.seed);
                    assert!(w[1] <= 100.0);
                    assert!(w[1] <= (k + 1) as f64 + 8.0 * 100.0 / 192.0);
                }
                assert_eq!(r.curve[130], r.allocated_pct);
                assert!(r.failed > 0);
            }
        }
    }

    #[test]
    fn runs_are_deterministic_per_seed_and_independent_of_threads() {
        let (nodes, pods) = fragmenting_case();
        let mut c = config("random-fit,best-fit,fgd", 5..8);
        let a = run(&nodes, &pods, &c).unwrap();
        c.threads = 1;
        let b = run(&nodes, &pods, &c).unwrap();
        assert_eq!(a.policies, b.policies);
        // The same seed alone gives the same run as within a batch.
        let single = run(&nodes, &pods, &config("fgd", 6..7)).unwrap();
        assert_eq!(single.policies[0].runs[0], a.policies[2].runs[1]);
        // Another seed, another task sequence.
        assert_ne!(a.policies[0].runs[0].curve, a.policies[0].runs[1].curve);
        // Every policy saw the same number of tasks for a seed.
        for s in 0..3 {
            let tasks: Vec<usize> = a.policies.iter().map(|p| p.runs[s].tasks).collect();
            assert!(tasks.windows(2).all(|w| w[0] == w[1]), "{tasks:?}");
        }
    }

    #[test]
    fn max_tasks_cuts_runs_short() {
        let (nodes, pods) = fragmenting_case();
        let mut c = config("fgd", 0..2);
        c.max_tasks = Some(40);
        let report = run(&nodes, &pods, &c).unwrap();
        let p = &report.policies[0];
        assert!(p.runs.iter().all(|r| r.tasks == 40 && r.curve.len() < 101));
        assert_eq!(p.mean_at(100), None);
        let json = report.to_json();
        assert_eq!(json["policies"][0]["allocated_at_130"], Value::Null);
        assert_eq!(json["policies"][0]["policy"], "fgd");
    }

    #[test]
    fn report_json_has_the_documented_shape() {
        let (nodes, pods) = fragmenting_case();
        let report = run(&nodes, &pods, &config("best-fit,fgd", 0..2)).unwrap();
        let json = report.to_json();
        let p = &json["policies"];
        assert_eq!(p.as_array().unwrap().len(), 2);
        assert_eq!(p[0]["policy"], "best-fit");
        assert!(p[1]["allocated_at_100"].as_f64().unwrap() > 90.0);
        assert!(p[1]["allocated_at_130"].as_f64().unwrap() <= 100.0);
        assert_eq!(p[1]["curve"].as_array().unwrap().len(), 131);
        assert_eq!(p[1]["seeds"].as_array().unwrap().len(), 2);
        assert_eq!(json["gpus"], 192);
        assert_eq!(json["seeds"], json!([0, 1]));
    }

    #[test]
    fn bad_inputs_are_reported() {
        let (nodes, pods) = fragmenting_case();
        let cpu_only = vec![pod(1_000, 0, 0)];
        assert_eq!(
            run(&nodes, &cpu_only, &Config::default()),
            Err(SimError::NoGpuTasks)
        );
        let no_gpus = vec![node("c", 1_000, 0)];
        assert_eq!(
            run(&no_gpus, &pods, &Config::default()),
            Err(SimError::NoGpuCapacity)
        );
        let mut c = Config::default();
        c.seeds.clear();
        assert_eq!(run(&nodes, &pods, &c), Err(SimError::NoSeeds));
        let c = Config {
            workload_coverage: 0.0,
            ..Config::default()
        };
        assert_eq!(run(&nodes, &pods, &c), Err(SimError::BadCoverage(0.0)));
    }
}
