//! Which GPUs a task should get inside a node: the best-connected free set by the link matrix.

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

/// The link matrix as ranks, parsed once per host type and pass rather than per evaluation.
pub fn rank_matrix(topology: &[Vec<String>]) -> Vec<Vec<u32>> {
    topology
        .iter()
        .map(|row| row.iter().map(|c| link_rank(c)).collect())
        .collect()
}

/// Picks `k` of the free GPU indexes whose weakest pairwise link is strongest (then the largest
/// sum of link ranks): greedy growth from every start, which finds the NVLink quad on a DGX-1
/// and an NVLink pair on a PCIe board. Without a matrix, the lowest indexes.
pub fn best_gpu_set(ranks: &[Vec<u32>], free: &[u32], k: usize) -> Option<Vec<u32>> {
    if k == 0 {
        return Some(Vec::new());
    }
    if free.len() < k {
        return None;
    }
    let rank = |a: u32, b: u32| -> u32 {
        ranks
            .get(a as usize)
            .and_then(|row| row.get(b as usize))
            .copied()
            .unwrap_or(0)
    };
    if ranks.is_empty() || k == 1 {
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
