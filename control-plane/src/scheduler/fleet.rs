//! The fleet as one scheduling pass sees it: what is free on every ready node, and nodes grouped
//! by identical free resources so that a placement is evaluated once per group, not once per
//! node. On a 10,000-node fleet of a few host types a pass deals with tens of groups.
//!
//! Every change of a node's free resources goes through [`Fleet::set_free`], which moves the
//! node between groups and appends to an event log that the per-shape rankings
//! (`placement::Ranking`) replay, so they stay current without rescanning the fleet.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::fit::rank_matrix;

use crate::state::{AllocationRecord, ClusterState, GpuHealth, Job, Node, NodeStatus};

/// A fast, non-cryptographic hasher for the pass's in-memory maps (the multiply-rotate of
/// rustc's FxHash): keys are the scheduler's own values, never attacker-chosen, and SipHash
/// showed up in profiles of 10,000-node passes. Iteration order of these maps never decides
/// anything.
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

pub type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

pub type NodeIdx = u32;
pub type GroupId = u32;

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
    fn capacity(node: &Node) -> NodeFree {
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
        for uuid in &a.gpus {
            if let Some(pos) = node.spec.gpus.iter().position(|g| &g.uuid == uuid) {
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

/// What makes two nodes interchangeable for placement: same hardware, same partition, same
/// free resources.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupKey<'a> {
    pub hardware: u64,
    pub partition: Option<&'a str>,
    pub free: NodeFree,
}

#[derive(Debug)]
pub struct Group<'a> {
    pub key: GroupKey<'a>,
    pub members: BTreeSet<NodeIdx>,
    /// The first node that ever joined: members share hardware and partition, so it stands
    /// for them when the group is evaluated, even once it is empty.
    pub sample: NodeIdx,
}

/// A change the rankings must learn about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupEvent {
    /// The group gained its first member (or was created).
    Filled(GroupId),
    /// The group lost its last member.
    Emptied(GroupId),
}

#[derive(Debug)]
pub struct FleetNode<'a> {
    pub node: &'a Node,
    pub rack: Option<&'a str>,
    /// Model of the node's GPUs (the first GPU's; hosts carry one model).
    pub model: &'a str,
    pub free: NodeFree,
    pub group: GroupId,
    /// Link ranks between the node's GPUs (shared by every host of its hardware class).
    pub ranks: Arc<Vec<Vec<u32>>>,
    /// Held back for a backfill reservation: not in any group; evaluated one by one, against
    /// `shadow` for work that would still run at the reservation's start.
    pub shadow: Option<NodeFree>,
}

#[derive(Debug)]
pub struct Fleet<'a> {
    pub nodes: Vec<FleetNode<'a>>,
    pub index_of: FastMap<&'a str, NodeIdx>,
    pub groups: Vec<Group<'a>>,
    group_of: FastMap<GroupKey<'a>, GroupId>,
    pub events: Vec<GroupEvent>,
    /// Whether any node carries a `rack` label (gangs then prefer one rack).
    pub has_racks: bool,
    /// Nodes held for the reservation, in index order.
    pub reserved: BTreeSet<NodeIdx>,
    /// Rack → its nodes, in index order.
    pub rack_nodes: BTreeMap<&'a str, Vec<NodeIdx>>,
}

/// Label naming a node's rack.
pub const RACK_LABEL: &str = "rack";

impl<'a> Fleet<'a> {
    /// The ready nodes of `state` and what is free on them.
    pub fn build(state: &'a ClusterState) -> Fleet<'a> {
        let mut fleet = Fleet {
            nodes: Vec::with_capacity(state.nodes.len()),
            index_of: FastMap::default(),
            groups: Vec::new(),
            group_of: FastMap::default(),
            events: Vec::new(),
            has_racks: false,
            reserved: BTreeSet::new(),
            rack_nodes: BTreeMap::new(),
        };
        let mut ranks_of: FastMap<u64, Arc<Vec<Vec<u32>>>> = FastMap::default();
        // The indexes are keyed by node name like `nodes`: walk them alongside instead of
        // looking each node up (string-keyed lookups were a third of this function's time).
        let mut allocations = state.index.node_allocations.iter().peekable();
        let mut classes = state.index.hardware_class.iter().peekable();
        for (name, node) in &state.nodes {
            while allocations.next_if(|(n, _)| *n < name).is_some() {}
            while classes.next_if(|(n, _)| *n < name).is_some() {}
            let on_node = allocations.next_if(|(n, _)| *n == name).map(|(_, ids)| ids);
            let hardware = classes
                .next_if(|(n, _)| *n == name)
                .map_or(0, |(_, class)| *class);
            if node.status != NodeStatus::Ready {
                continue;
            }
            let mut free = NodeFree::capacity(node);
            for rec in on_node.into_iter().flatten().filter_map(|id| state.allocations.get(id)) {
                if let Some(job) = state.jobs.get(&rec.allocation.job) {
                    free.remove_allocation(node, job, rec);
                }
            }
            let idx = fleet.nodes.len() as NodeIdx;
            let rack = node.spec.labels.get(RACK_LABEL).map(String::as_str);
            if let Some(r) = rack {
                fleet.has_racks = true;
                fleet.rack_nodes.entry(r).or_default().push(idx);
            }
            let ranks = ranks_of
                .entry(hardware)
                .or_insert_with(|| Arc::new(rank_matrix(&node.spec.topology)))
                .clone();
            let key = GroupKey {
                hardware,
                partition: node.spec.partition.as_deref(),
                free,
            };
            let group = fleet.join(key, idx);
            fleet.nodes.push(FleetNode {
                node,
                rack,
                model: node.spec.gpus.first().map_or("", |g| g.model.as_str()),
                free,
                group,
                ranks,
                shadow: None,
            });
            fleet.index_of.insert(node.spec.name.as_str(), idx);
        }
        fleet
    }

    fn join(&mut self, key: GroupKey<'a>, idx: NodeIdx) -> GroupId {
        let gid = match self.group_of.get(&key) {
            Some(g) => *g,
            None => {
                let g = self.groups.len() as GroupId;
                self.group_of.insert(key.clone(), g);
                self.groups.push(Group {
                    key,
                    members: BTreeSet::new(),
                    sample: idx,
                });
                g
            }
        };
        let members = &mut self.groups[gid as usize].members;
        if members.is_empty() {
            self.events.push(GroupEvent::Filled(gid));
        }
        members.insert(idx);
        gid
    }

    fn leave(&mut self, idx: NodeIdx) {
        let gid = self.nodes[idx as usize].group;
        let members = &mut self.groups[gid as usize].members;
        if members.remove(&idx) && members.is_empty() {
            self.events.push(GroupEvent::Emptied(gid));
        }
    }

    /// Records the node's new free resources and moves it to the matching group.
    pub fn set_free(&mut self, idx: NodeIdx, free: NodeFree) {
        let n = &self.nodes[idx as usize];
        if n.shadow.is_some() {
            self.nodes[idx as usize].free = free;
            return;
        }
        let key = GroupKey {
            hardware: self.groups[n.group as usize].key.hardware,
            partition: n.node.spec.partition.as_deref(),
            free,
        };
        self.leave(idx);
        let g = self.join(key, idx);
        let n = &mut self.nodes[idx as usize];
        n.group = g;
        n.free = free;
    }

    /// Takes a node out of the groups for a backfill reservation.
    pub fn reserve(&mut self, idx: NodeIdx, shadow: NodeFree) {
        self.leave(idx);
        self.nodes[idx as usize].shadow = Some(shadow);
        self.reserved.insert(idx);
    }

    /// Free resources that members of `g` all have.
    pub fn group_free(&self, g: GroupId) -> &NodeFree {
        &self.groups[g as usize].key.free
    }

    /// Any member of the group (the lowest index, so the choice is stable).
    pub fn representative(&self, g: GroupId) -> Option<NodeIdx> {
        self.groups[g as usize].members.first().copied()
    }
}
