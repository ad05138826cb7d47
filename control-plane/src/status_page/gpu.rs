//! What one GPU is doing, as the grid and the node page draw it: free, held whole (by which
//! job), shared (how much, by whom), split into MIG slices (each free or held), unhealthy, or
//! on a node that is down.

use crate::state::{ClusterState, Gpu, GpuHealth, JobId, MILLI_PER_GPU, Node, NodeStatus};

/// Who holds a GPU, a slice or a share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub job: JobId,
    pub tenant: String,
    pub allocation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Occupancy {
    Free,
    Whole(Holder),
    /// Shares of the GPU: the milli-GPU they hold together, and who holds them.
    Shared {
        milli: u32,
        holders: Vec<Holder>,
    },
    /// MIG mode: each slice (profile) and its holder, if held.
    Mig(Vec<(String, Option<Holder>)>),
}

/// The cell's state: what colours it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellState {
    Free,
    Allocated,
    /// Part of it is held (shares, or some MIG slices).
    Partial,
    Unhealthy,
    /// On a drained node: no new work lands here.
    Drained,
    /// On a node that is down (its allocations were released).
    Down,
}

impl CellState {
    pub const ALL: [CellState; 6] = [
        CellState::Free,
        CellState::Allocated,
        CellState::Partial,
        CellState::Unhealthy,
        CellState::Drained,
        CellState::Down,
    ];

    /// The CSS class and `?state=` filter value.
    pub fn as_str(self) -> &'static str {
        match self {
            CellState::Free => "free",
            CellState::Allocated => "allocated",
            CellState::Partial => "partial",
            CellState::Unhealthy => "unhealthy",
            CellState::Drained => "drained",
            CellState::Down => "down",
        }
    }

    pub fn parse(s: &str) -> Option<CellState> {
        CellState::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

pub struct GpuView<'a> {
    pub gpu: &'a Gpu,
    pub occupancy: Occupancy,
    pub state: CellState,
}

fn holder(cluster: &ClusterState, allocation: u64) -> Option<Holder> {
    let rec = cluster.allocations.get(&allocation)?;
    let job = rec.allocation.job;
    let tenant = cluster
        .job(job)
        .map(|j| j.spec.tenant.clone())
        .unwrap_or_default();
    Some(Holder {
        job,
        tenant,
        allocation,
    })
}

/// What `gpu` of `node` is doing in `cluster`.
pub fn gpu_view<'a>(cluster: &ClusterState, node: &Node, gpu: &'a Gpu) -> GpuView<'a> {
    let occupancy = if !gpu.mig.is_empty() {
        Occupancy::Mig(
            gpu.mig
                .iter()
                .map(|s| {
                    let h = cluster
                        .gpu_holder
                        .get(&s.uuid)
                        .and_then(|a| holder(cluster, *a));
                    (s.profile.clone(), h)
                })
                .collect(),
        )
    } else if let Some(a) = cluster.gpu_holder.get(&gpu.uuid) {
        match holder(cluster, *a) {
            Some(h) => Occupancy::Whole(h),
            None => Occupancy::Free,
        }
    } else if let Some(shares) = cluster
        .index
        .gpu_shares
        .get(&gpu.uuid)
        .filter(|s| s.milli > 0)
    {
        Occupancy::Shared {
            milli: shares.milli,
            holders: shares
                .allocations
                .iter()
                .filter_map(|a| holder(cluster, *a))
                .collect(),
        }
    } else {
        Occupancy::Free
    };
    let busy = match &occupancy {
        Occupancy::Free => None,
        Occupancy::Whole(_) => Some(CellState::Allocated),
        Occupancy::Shared { milli, .. } if u64::from(*milli) >= MILLI_PER_GPU => {
            Some(CellState::Allocated)
        }
        Occupancy::Shared { .. } => Some(CellState::Partial),
        Occupancy::Mig(slices) => {
            let held = slices.iter().filter(|(_, h)| h.is_some()).count();
            match held {
                0 => None,
                n if n == slices.len() => Some(CellState::Allocated),
                _ => Some(CellState::Partial),
            }
        }
    };
    let state = if node.status == NodeStatus::Down {
        CellState::Down
    } else if matches!(gpu.health, GpuHealth::Unhealthy { .. }) {
        CellState::Unhealthy
    } else if let Some(b) = busy {
        b
    } else if node.drained || node.status == NodeStatus::Drained {
        CellState::Drained
    } else {
        CellState::Free
    };
    GpuView {
        gpu,
        occupancy,
        state,
    }
}

/// The node's status as shown: up (ready), drained or down.
pub fn node_status(node: &Node) -> &'static str {
    match node.status {
        NodeStatus::Down => "down",
        _ if node.drained => "drained",
        s => s.as_str(),
    }
}
