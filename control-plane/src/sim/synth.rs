//! Variants of a pod list with another mix of task kinds: the trace family the FGD paper
//! evaluates beside its default list (more GPU-sharing tasks, more multi-GPU tasks, more tasks
//! that name a GPU model, more CPU-only tasks), synthesised here from any pod list so that a
//! placement policy can be checked on workloads it was not developed on.
//!
//! Every synthetic task is a copy of a task of the source list, so shapes (CPU, memory, GPU
//! milli, GPU counts) stay those the trace has; only the proportions of the kinds change:
//!
//! - `sharing`: `fraction` of the GPU tasks are shares of one GPU (the default list: 44%);
//! - `multi-gpu`: `fraction` of the GPU tasks ask for several whole GPUs (default list: 1%);
//! - `constrained`: `fraction` of the GPU tasks accept one GPU model only, drawn among the
//!   models of the node list (by GPU count) on which some node can hold the task (default
//!   list: none);
//! - `cpu-heavy`: `fraction` of all tasks are CPU-only (default list: 13%).
//!
//! The other proportions stay those of the source list. Deterministic per seed.

use std::fmt;
use std::str::FromStr;

use super::trace::{TraceNode, TracePod};
use crate::scheduler::score::{FULL_GPU_MILLI, SplitMix64, mix64};

/// Which kind of task a variant has more of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    Sharing,
    MultiGpu,
    Constrained,
    CpuHeavy,
}

impl Mix {
    pub const NAMES: [&'static str; 4] = ["sharing", "multi-gpu", "constrained", "cpu-heavy"];
    pub const ALL: [Mix; 4] = [Mix::Sharing, Mix::MultiGpu, Mix::Constrained, Mix::CpuHeavy];

    pub fn name(self) -> &'static str {
        match self {
            Mix::Sharing => "sharing",
            Mix::MultiGpu => "multi-gpu",
            Mix::Constrained => "constrained",
            Mix::CpuHeavy => "cpu-heavy",
        }
    }

    /// The fraction used when none is given: well beyond the default list's, about where the
    /// FGD paper's variants go (sharing 60% of GPU tasks, multi-GPU 20%, one model 33%,
    /// CPU-only 30% of tasks).
    pub fn default_fraction(self) -> f64 {
        match self {
            Mix::Sharing => 0.6,
            Mix::MultiGpu => 0.2,
            Mix::Constrained => 0.33,
            Mix::CpuHeavy => 0.3,
        }
    }
}

impl fmt::Display for Mix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mix {
    type Err = SynthError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Mix::ALL
            .into_iter()
            .find(|m| m.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| SynthError::UnknownMix(s.to_owned()))
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SynthError {
    #[error("unknown mix `{0}` (expected one of: sharing, multi-gpu, constrained, cpu-heavy)")]
    UnknownMix(String),
    #[error("fraction must be in [0, 1], got {0}")]
    BadFraction(f64),
    #[error("the source pod list has no {0} task to copy")]
    EmptyPool(&'static str),
    #[error("no task of the source list fits any node, so no model can be named")]
    NothingFits,
}

/// Kinds of source tasks.
struct Pools<'a> {
    cpu_only: Vec<&'a TracePod>,
    share: Vec<&'a TracePod>,
    whole_one: Vec<&'a TracePod>,
    multi: Vec<&'a TracePod>,
}

impl<'a> Pools<'a> {
    fn of(pods: &'a [TracePod]) -> Pools<'a> {
        let mut p = Pools {
            cpu_only: Vec::new(),
            share: Vec::new(),
            whole_one: Vec::new(),
            multi: Vec::new(),
        };
        for pod in pods {
            if pod.num_gpu == 0 || pod.gpu_milli == 0 {
                p.cpu_only.push(pod);
            } else if pod.num_gpu == 1 && pod.gpu_milli < FULL_GPU_MILLI {
                p.share.push(pod);
            } else if pod.num_gpu == 1 {
                p.whole_one.push(pod);
            } else {
                p.multi.push(pod);
            }
        }
        p
    }

    fn gpu_tasks(&self) -> usize {
        self.share.len() + self.whole_one.len() + self.multi.len()
    }
}

fn draw<'a>(rng: &mut SplitMix64, pool: &[&'a TracePod]) -> &'a TracePod {
    pool[rng.below(pool.len() as u64) as usize]
}

fn unit(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Draws from the union of `pools`, each task equally likely.
fn draw_union<'a>(rng: &mut SplitMix64, pools: &[&[&'a TracePod]]) -> &'a TracePod {
    let total: usize = pools.iter().map(|p| p.len()).sum();
    let mut k = rng.below(total as u64) as usize;
    for p in pools {
        if k < p.len() {
            return p[k];
        }
        k -= p.len();
    }
    unreachable!("k < total")
}

/// With probability `fraction` a task of the `favoured` pool (named, for the error when it
/// is empty), otherwise one of the `others`; the favoured pool again where they are empty.
fn draw_favouring<'a>(
    rng: &mut SplitMix64,
    fraction: f64,
    (favoured, name): (&[&'a TracePod], &'static str),
    others: &[&[&'a TracePod]],
) -> Result<&'a TracePod, SynthError> {
    if unit(rng) < fraction {
        if favoured.is_empty() {
            return Err(SynthError::EmptyPool(name));
        }
        Ok(draw(rng, favoured))
    } else if others.iter().any(|p| !p.is_empty()) {
        Ok(draw_union(rng, others))
    } else {
        Ok(draw(rng, favoured))
    }
}

/// `count` tasks of the `mix` variant of `pods` (`fraction`: `None` for the mix's default),
/// named `synth-<mix>-<i>`. `nodes` is the cluster the variant is meant for (the models a
/// constrained task may name).
pub fn synthesize(
    pods: &[TracePod],
    nodes: &[TraceNode],
    mix: Mix,
    fraction: Option<f64>,
    count: usize,
    seed: u64,
) -> Result<Vec<TracePod>, SynthError> {
    let fraction = fraction.unwrap_or(mix.default_fraction());
    if !(0.0..=1.0).contains(&fraction) {
        return Err(SynthError::BadFraction(fraction));
    }
    let pools = Pools::of(pods);
    if pools.gpu_tasks() == 0 {
        return Err(SynthError::EmptyPool("GPU"));
    }
    let cpu_share = pools.cpu_only.len() as f64 / pods.len() as f64;
    let mut rng = SplitMix64::new(mix64(seed ^ 0x7379_6e74));
    let mut out = Vec::with_capacity(count);
    // Models by GPU count, for constrained tasks.
    let mut models: Vec<(String, u64)> = Vec::new();
    for n in nodes.iter().filter(|n| n.gpus > 0) {
        match models.iter_mut().find(|(m, _)| *m == n.model) {
            Some((_, g)) => *g += u64::from(n.gpus),
            None => models.push((n.model.clone(), u64::from(n.gpus))),
        }
    }
    for i in 0..count {
        let cpu_first = match mix {
            Mix::CpuHeavy => fraction,
            _ => cpu_share,
        };
        let mut pod = if !pools.cpu_only.is_empty() && unit(&mut rng) < cpu_first {
            draw(&mut rng, &pools.cpu_only).clone()
        } else {
            match mix {
                Mix::Sharing => draw_favouring(
                    &mut rng,
                    fraction,
                    (&pools.share, "GPU-sharing"),
                    &[&pools.whole_one, &pools.multi],
                )?
                .clone(),
                Mix::MultiGpu => draw_favouring(
                    &mut rng,
                    fraction,
                    (&pools.multi, "multi-GPU"),
                    &[&pools.share, &pools.whole_one],
                )?
                .clone(),
                Mix::Constrained | Mix::CpuHeavy => {
                    let all: [&[&TracePod]; 3] = [&pools.share, &pools.whole_one, &pools.multi];
                    let mut pod = draw_union(&mut rng, &all).clone();
                    if mix == Mix::Constrained && unit(&mut rng) < fraction {
                        pod.gpu_spec = vec![pick_model(&mut rng, &pod, nodes, &models)?];
                    }
                    pod
                }
            }
        };
        pod.name = format!("synth-{}-{i:05}", mix.name());
        out.push(pod);
    }
    Ok(out)
}

/// A model, drawn by GPU count among those with a node that could hold `pod` when empty; any
/// model when none could (the task is then unplaceable whatever it names).
fn pick_model(
    rng: &mut SplitMix64,
    pod: &TracePod,
    nodes: &[TraceNode],
    models: &[(String, u64)],
) -> Result<String, SynthError> {
    let holds = |m: &str| {
        nodes.iter().any(|n| {
            n.model == m
                && n.gpus >= pod.num_gpu
                && n.cpu_milli >= pod.cpu_milli
                && n.memory_mib >= pod.memory_mib
        })
    };
    let fitting: Vec<&(String, u64)> = models.iter().filter(|(m, _)| holds(m)).collect();
    let candidates: Vec<&(String, u64)> = if fitting.is_empty() {
        models.iter().collect()
    } else {
        fitting
    };
    let total: u64 = candidates.iter().map(|(_, g)| g).sum();
    if total == 0 {
        return Err(SynthError::NothingFits);
    }
    let mut k = rng.below(total);
    for (m, g) in candidates {
        if k < *g {
            return Ok(m.clone());
        }
        k -= g;
    }
    unreachable!("k < total")
}

/// The pod list as CSV, in the trace's column order (the columns `trace::load_pods` reads).
pub fn to_csv(pods: &[TracePod]) -> String {
    let mut s = String::from("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n");
    for p in pods {
        s.push_str(&format!(
            "{},{},{},{},{},{}\n",
            p.name,
            p.cpu_milli,
            p.memory_mib,
            p.num_gpu,
            p.gpu_milli,
            p.gpu_spec.join("|")
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn pod(cpu: u64, num_gpu: u32, milli: u32) -> TracePod {
        TracePod {
            name: "p".into(),
            cpu_milli: cpu,
            memory_mib: 1024,
            num_gpu,
            gpu_milli: milli,
            gpu_spec: Vec::new(),
        }
    }

    fn node(model: &str, gpus: u32, cpu: u64) -> TraceNode {
        TraceNode {
            name: "n".into(),
            cpu_milli: cpu,
            memory_mib: 1 << 20,
            gpus,
            model: model.into(),
        }
    }

    /// 10 CPU-only, 40 shares, 45 whole single GPUs, 5 multi-GPU tasks.
    fn source() -> Vec<TracePod> {
        let mut v = Vec::new();
        v.extend(std::iter::repeat_n(pod(8_000, 0, 0), 10));
        v.extend(std::iter::repeat_n(pod(2_000, 1, 500), 40));
        v.extend(std::iter::repeat_n(pod(4_000, 1, 1000), 45));
        v.extend(std::iter::repeat_n(pod(32_000, 4, 1000), 5));
        v
    }

    fn nodes() -> Vec<TraceNode> {
        vec![
            node("A", 8, 96_000),
            node("A", 8, 96_000),
            node("B", 2, 16_000),
        ]
    }

    fn share_of(pods: &[TracePod], f: impl Fn(&TracePod) -> bool, among_gpu: bool) -> f64 {
        let base: Vec<&TracePod> = pods
            .iter()
            .filter(|p| !among_gpu || p.num_gpu > 0)
            .collect();
        base.iter().filter(|p| f(p)).count() as f64 / base.len() as f64
    }

    #[test]
    fn each_mix_reaches_its_fraction_and_keeps_the_rest() {
        let src = source();
        let n = 20_000;
        let s = synthesize(&src, &nodes(), Mix::Sharing, Some(0.8), n, 1).unwrap();
        assert!((share_of(&s, |p| p.gpu_milli < 1000, true) - 0.8).abs() < 0.02);
        assert!((share_of(&s, |p| p.num_gpu == 0, false) - 0.1).abs() < 0.02);
        let m = synthesize(&src, &nodes(), Mix::MultiGpu, None, n, 1).unwrap();
        assert!((share_of(&m, |p| p.num_gpu > 1, true) - 0.2).abs() < 0.02);
        let c = synthesize(&src, &nodes(), Mix::CpuHeavy, Some(0.5), n, 1).unwrap();
        assert!((share_of(&c, |p| p.num_gpu == 0, false) - 0.5).abs() < 0.02);
        // Among GPU tasks the source proportions stay (40 : 45 : 5).
        assert!((share_of(&c, |p| p.gpu_milli < 1000, true) - 40.0 / 90.0).abs() < 0.02);
        let k = synthesize(&src, &nodes(), Mix::Constrained, None, n, 1).unwrap();
        assert!((share_of(&k, |p| !p.gpu_spec.is_empty(), true) - 0.33).abs() < 0.02);
        assert!(k.iter().all(|p| p.num_gpu > 0 || p.gpu_spec.is_empty()));
        // Every task is a copy of a source shape.
        for p in s.iter().chain(&m).chain(&c).chain(&k) {
            assert!(
                src.iter().any(|q| (q.cpu_milli, q.num_gpu, q.gpu_milli)
                    == (p.cpu_milli, p.num_gpu, p.gpu_milli))
            );
        }
    }

    #[test]
    fn constrained_tasks_name_a_model_that_can_hold_them() {
        let k = synthesize(&source(), &nodes(), Mix::Constrained, Some(1.0), 5_000, 3).unwrap();
        let named = |m: &str| k.iter().filter(|p| p.gpu_spec == [m.to_string()]).count();
        // 4-GPU and 32-CPU tasks only fit model A; the rest by GPU count (16 : 2).
        for p in k.iter().filter(|p| p.num_gpu == 4) {
            assert_eq!(p.gpu_spec, vec!["A".to_string()]);
        }
        let (a, b) = (named("A") as f64, named("B") as f64);
        assert!(b > 0.0 && a / (a + b) > 0.85, "{a} {b}");
    }

    #[test]
    fn deterministic_per_seed_and_round_trips_through_csv() {
        let a = synthesize(&source(), &nodes(), Mix::Constrained, None, 300, 7).unwrap();
        let b = synthesize(&source(), &nodes(), Mix::Constrained, None, 300, 7).unwrap();
        let c = synthesize(&source(), &nodes(), Mix::Constrained, None, 300, 8).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let parsed = super::super::trace::parse_pods(&to_csv(&a), Path::new("x.csv")).unwrap();
        assert_eq!(parsed, a);
    }

    #[test]
    fn bad_requests_are_refused() {
        let src = source();
        assert_eq!(
            synthesize(&src, &nodes(), Mix::Sharing, Some(1.5), 10, 0),
            Err(SynthError::BadFraction(1.5))
        );
        let no_multi: Vec<TracePod> = src.iter().filter(|p| p.num_gpu < 2).cloned().collect();
        assert_eq!(
            synthesize(&no_multi, &nodes(), Mix::MultiGpu, None, 10, 0),
            Err(SynthError::EmptyPool("multi-GPU"))
        );
        assert_eq!("Multi-GPU".parse::<Mix>(), Ok(Mix::MultiGpu));
        assert!("gpu".parse::<Mix>().is_err());
        for name in Mix::NAMES {
            assert_eq!(name.parse::<Mix>().unwrap().name(), name);
        }
    }
}
