//! What is free on a node, and which GPUs a task should get there.

use std::collections::BTreeSet;

use crate::state::{ClusterState, GpuHealth, Job, Node};

/// Rank of a link as `nvidia-smi topo -m` prints it: higher is better connected.
pub fn link_rank(cell: &str) -> u32 {
    match cell {
        "X" => 1000,
        "PIX" => 40,
        "PXB" => 30,
        "PHB" => 20,
        "NODE" => 10,
        "SYS" => 0,
        other => match other.strip_prefix("NV").and_then(|n| n.parse::<u32>().ok()) {
            Some(links) => 100 + links,
            None => 0,
        },
    }
}

/// Free resources of one node during a pass.
#[derive(Debug, Clone)]
pub struct NodeFree {
    /// (index, uuid, model) of healthy GPUs no allocation holds.
    pub gpus: Vec<(u32, String, String)>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// Link matrix cells by GPU index, when the node reported one.
    pub topology: Vec<Vec<String>>,
}

impl NodeFree {
    /// `used`: CPU (milli) and memory (MiB) that live allocations already take on the node.
    pub fn of(state: &ClusterState, node: &Node, used: (u64, u64)) -> NodeFree {
        let gpus = node
            .spec
            .gpus
            .iter()
            .filter(|g| g.health == GpuHealth::Healthy && !state.gpu_holder.contains_key(&g.uuid))
            .map(|g| (g.index, g.uuid.clone(), g.model.clone()))
            .collect();
        let (cpu, mem) = used;
        NodeFree {
            gpus,
            cpu_milli: node.spec.cpu_milli.saturating_sub(cpu),
            memory_mib: node.spec.memory_mib.saturating_sub(mem),
            topology: node.spec.topology.clone(),
        }
    }

    fn usable(&self, job: &Job) -> impl Iterator<Item = &(u32, String, String)> {
        let models = &job.spec.gpu_models;
        self.gpus
            .iter()
            .filter(move |(_, _, model)| models.is_empty() || models.contains(model))
    }

    pub fn free_gpu_count(&self, job: &Job) -> usize {
        self.usable(job).count()
    }

    pub fn fits(&self, job: &Job) -> bool {
        self.free_gpu_count(job) >= job.spec.gpus_per_task as usize
            && self.cpu_milli >= job.spec.cpu_milli_per_task
            && self.memory_mib >= job.spec.memory_mib_per_task
    }

    /// The GPUs a task of `job` gets on this node: the best-connected free set.
    pub fn choose_gpus(&self, job: &Job) -> Option<Vec<String>> {
        let candidates: Vec<(u32, String)> =
            self.usable(job).map(|(i, u, _)| (*i, u.clone())).collect();
        let indexes: Vec<u32> = candidates.iter().map(|(i, _)| *i).collect();
        let chosen = best_gpu_set(&self.topology, &indexes, job.spec.gpus_per_task as usize)?;
        Some(
            chosen
                .into_iter()
                .filter_map(|i| {
                    candidates
                        .iter()
                        .find(|(ci, _)| *ci == i)
                        .map(|(_, u)| u.clone())
                })
                .collect(),
        )
    }

    pub fn take(&mut self, job: &Job, gpus: &[String]) {
        let taken: BTreeSet<&String> = gpus.iter().collect();
        self.gpus.retain(|(_, uuid, _)| !taken.contains(uuid));
        self.cpu_milli = self.cpu_milli.saturating_sub(job.spec.cpu_milli_per_task);
        self.memory_mib = self.memory_mib.saturating_sub(job.spec.memory_mib_per_task);
    }
}

/// Picks `k` of the free GPU indexes whose weakest pairwise link is strongest (then the largest
/// sum of link ranks): greedy growth from every start, which finds the NVLink quad on a DGX-1
/// and an NVLink pair on a PCIe board. Without a matrix, the lowest indexes.
pub fn best_gpu_set(topology: &[Vec<String>], free: &[u32], k: usize) -> Option<Vec<u32>> {
    if k == 0 {
        return Some(Vec::new());
    }
    if free.len() < k {
        return None;
    }
    let rank = |a: u32, b: u32| -> u32 {
        topology
            .get(a as usize)
            .and_then(|row| row.get(b as usize))
            .map(|c| link_rank(c))
            .unwrap_or(0)
    };
    if topology.is_empty() || k == 1 {
        let mut v = free.to_vec();
        v.sort_unstable();
        v.truncate(k);
        return Some(v);
    }
    let mut best: Option<((u32, u32), Vec<u32>)> = None;
    for &start in free {
        let mut set = vec![start];
        while set.len() < k {
            // Add the GPU that keeps the weakest link strongest, then the most total bandwidth.
            let next = free
                .iter()
                .filter(|g| !set.contains(g))
                .max_by_key(|&&g| {
                    let weakest = set.iter().map(|&s| rank(s, g)).min().unwrap_or(0);
                    let total: u32 = set.iter().map(|&s| rank(s, g)).sum();
                    (weakest, total, std::cmp::Reverse(g))
                })
                .copied()?;
            set.push(next);
        }
        let weakest = pairs(&set).map(|(a, b)| rank(a, b)).min().unwrap_or(0);
        let total: u32 = pairs(&set).map(|(a, b)| rank(a, b)).sum();
        set.sort_unstable();
        let better = match &best {
            None => true,
            Some((score, v)) => {
                (weakest, total) > *score || ((weakest, total) == *score && set < *v)
            }
        };
        if better {
            best = Some(((weakest, total), set));
        }
    }
    best.map(|(_, v)| v)
}

fn pairs(set: &[u32]) -> impl Iterator<Item = (u32, u32)> + '_ {
    set.iter()
        .enumerate()
        .flat_map(move |(i, &a)| set[i + 1..].iter().map(move |&b| (a, b)))
}
