//! Free resources per node, as the scheduler sees them: a plain value kept as a derived index
//! (`Indexes::node_free`), refreshed for a node whenever its allocations, health or
//! registration change, so a scheduling pass copies it instead of recomputing it from every
//! allocation.

use super::{AllocationRecord, GpuHealth, Job, Node};

/// Most GPUs per node the scheduler handles (the state machine refuses larger nodes).
pub const MAX_GPUS: usize = 16;
/// MIG slices per GPU the free-slice mask has room for (MIG has at most 7 instances).
pub const MAX_SLICES: usize = 8;

/// Free resources of one node: a plain value (no heap), so copying and hashing it per
/// placement stays cheap on large fleets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeFree {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// GPUs on the node: the used prefix of the arrays below.
    pub gpus: u8,
    /// Free milli per GPU position: 1000 = whole GPU free; 0 for a held, unhealthy or MIG-mode
    /// GPU.
    pub gpu_milli: [u32; MAX_GPUS],
    /// Free GPU memory per position (what shares may still claim).
    pub gpu_memory_mib: [u64; MAX_GPUS],
    /// Free MIG slices: bit `gpu * MAX_SLICES + slice`.
    pub mig_free: u128,
}

fn slice_bit(gpu: u8, slice: u8) -> u128 {
    1u128 << (gpu as usize * MAX_SLICES + slice as usize)
}

impl NodeFree {
    /// Everything on the node free, except unhealthy GPUs.
    pub fn capacity(node: &Node) -> NodeFree {
        let mut free = NodeFree {
            cpu_milli: node.spec.cpu_milli,
            memory_mib: node.spec.memory_mib,
            gpus: node.spec.gpus.len().min(MAX_GPUS) as u8,
            gpu_milli: [0; MAX_GPUS],
            gpu_memory_mib: [0; MAX_GPUS],
            mig_free: 0,
        };
        for (pos, g) in node.spec.gpus.iter().enumerate().take(MAX_GPUS) {
            let healthy = g.health == GpuHealth::Healthy;
            let whole = healthy && g.mig.is_empty();
            if whole {
                free.gpu_milli[pos] = 1000;
                free.gpu_memory_mib[pos] = g.memory_mib;
            }
            if healthy {
                for s in 0..g.mig.len().min(MAX_SLICES) {
                    free.mig_free |= slice_bit(pos as u8, s as u8);
                }
            }
        }
        free
    }

    /// Nothing free: a node that an exclusive job holds.
    pub fn nothing(node: &Node) -> NodeFree {
        NodeFree {
            cpu_milli: 0,
            memory_mib: 0,
            gpus: node.spec.gpus.len().min(MAX_GPUS) as u8,
            gpu_milli: [0; MAX_GPUS],
            gpu_memory_mib: [0; MAX_GPUS],
            mig_free: 0,
        }
    }

    /// Free milli of the node's GPUs, by position.
    pub fn milli(&self) -> &[u32] {
        &self.gpu_milli[..self.gpus as usize]
    }

    /// Free MIG slices as (GPU position, slice position), in order.
    pub fn slices(&self) -> impl Iterator<Item = (u8, u8)> + '_ {
        (0..self.gpus).flat_map(move |g| {
            (0..MAX_SLICES as u8)
                .filter(move |s| self.mig_free & slice_bit(g, *s) != 0)
                .map(move |s| (g, s))
        })
    }

    pub fn take_slice(&mut self, gpu: u8, slice: u8) {
        self.mig_free &= !slice_bit(gpu, slice);
    }

    pub fn give_slice(&mut self, gpu: u8, slice: u8) {
        self.mig_free |= slice_bit(gpu, slice);
    }

    /// Takes away what one live allocation holds.
    pub fn remove_allocation(&mut self, node: &Node, job: &Job, rec: &AllocationRecord) {
        self.cpu_milli = self.cpu_milli.saturating_sub(job.spec.cpu_milli_per_task);
        self.memory_mib = self.memory_mib.saturating_sub(job.spec.memory_mib_per_task);
        self.apply_gpus(node, rec, false);
    }

    /// Gives back what one live allocation holds (it will have ended).
    pub fn add_allocation(&mut self, node: &Node, job: &Job, rec: &AllocationRecord) {
        self.cpu_milli += job.spec.cpu_milli_per_task;
        self.memory_mib += job.spec.memory_mib_per_task;
        self.apply_gpus(node, rec, true);
    }

    fn apply_gpus(&mut self, node: &Node, rec: &AllocationRecord, give_back: bool) {
        let a = &rec.allocation;
        let gpus = &node.spec.gpus;
        // An allocation usually lists its GPUs in position order: each search starts after the
        // last match and wraps around, so a task's GPUs cost about one comparison each rather
        // than a scan from the first GPU (UUIDs are unique on a node: the match is the same).
        let mut next = 0;
        for uuid in &a.gpus {
            let found = (next..gpus.len())
                .chain(0..next)
                .find(|&p| gpus[p].uuid == *uuid);
            if let Some(pos) = found {
                next = pos + 1;
                if pos >= MAX_GPUS {
                    continue;
                }
                let healthy = node.spec.gpus[pos].health == GpuHealth::Healthy;
                if a.gpu_milli > 0 {
                    if give_back {
                        if healthy {
                            self.gpu_milli[pos] += a.gpu_milli;
                            self.gpu_memory_mib[pos] += a.gpu_memory_mib;
                        }
                    } else {
                        self.gpu_milli[pos] = self.gpu_milli[pos].saturating_sub(a.gpu_milli);
                        self.gpu_memory_mib[pos] =
                            self.gpu_memory_mib[pos].saturating_sub(a.gpu_memory_mib);
                    }
                } else if give_back {
                    if healthy {
                        self.gpu_milli[pos] = 1000;
                        self.gpu_memory_mib[pos] = node.spec.gpus[pos].memory_mib;
                    }
                } else {
                    self.gpu_milli[pos] = 0;
                    self.gpu_memory_mib[pos] = 0;
                }
                continue;
            }
            let slice = node.spec.gpus.iter().enumerate().find_map(|(p, g)| {
                g.mig
                    .iter()
                    .position(|m| &m.uuid == uuid)
                    .map(|s| (p as u8, s as u8))
            });
            if let Some((g, s)) = slice
                && (g as usize) < MAX_GPUS
                && (s as usize) < MAX_SLICES
            {
                if !give_back {
                    self.take_slice(g, s);
                } else if node.spec.gpus[g as usize].health == GpuHealth::Healthy {
                    self.give_slice(g, s);
                }
            }
        }
    }

    /// Elementwise minimum: what is free both now and in `other`.
    pub fn min(&self, other: &NodeFree) -> NodeFree {
        let mut m = *self;
        m.cpu_milli = self.cpu_milli.min(other.cpu_milli);
        m.memory_mib = self.memory_mib.min(other.memory_mib);
        for i in 0..MAX_GPUS {
            m.gpu_milli[i] = self.gpu_milli[i].min(other.gpu_milli[i]);
            m.gpu_memory_mib[i] = self.gpu_memory_mib[i].min(other.gpu_memory_mib[i]);
        }
        m.mig_free = self.mig_free & other.mig_free;
        m
    }
}
