//! The fleet as one scheduling pass sees it: what is free on every ready node, and nodes grouped
//! by identical free resources so that a placement is evaluated once per group, not once per
//! node. On a 10,000-node fleet of a few host types a pass deals with tens of groups.
//!
//! Every change of a node's free resources goes through [`Fleet::set_free`], which moves the
//! node between groups and appends to an event log that the per-shape rankings
//! (`placement::Ranking`) replay, so they stay current without rescanning the fleet.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::state::{AllocationRecord, ClusterState, GpuHealth, Job, Node, NodeStatus};

pub type NodeIdx = u32;
pub type GroupId = u32;

/// Free resources of one node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeFree {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// Free milli per GPU position: 1000 = whole GPU free; 0 for a held, unhealthy or MIG-mode
    /// GPU.
    pub gpu_milli: Vec<u32>,
    /// Free GPU memory per position (what shares may still claim).
    pub gpu_memory_mib: Vec<u64>,
    /// Free MIG slices as (GPU position, slice position), sorted.
    pub mig_free: Vec<(u8, u8)>,
}

impl NodeFree {
    /// Everything on the node free, except unhealthy GPUs.
    fn capacity(node: &Node) -> NodeFree {
        let mut free = NodeFree {
            cpu_milli: node.spec.cpu_milli,
            memory_mib: node.spec.memory_mib,
            gpu_milli: Vec::with_capacity(node.spec.gpus.len()),
            gpu_memory_mib: Vec::with_capacity(node.spec.gpus.len()),
            mig_free: Vec::new(),
        };
        for (pos, g) in node.spec.gpus.iter().enumerate() {
            let healthy = g.health == GpuHealth::Healthy;
            let whole = healthy && g.mig.is_empty();
            free.gpu_milli.push(if whole { 1000 } else { 0 });
            free.gpu_memory_mib.push(if whole { g.memory_mib } else { 0 });
            if healthy {
                for s in 0..g.mig.len() {
                    free.mig_free.push((pos as u8, s as u8));
                }
            }
        }
        free
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
            if let Some(slice) = slice {
                if give_back {
                    if node.spec.gpus[slice.0 as usize].health == GpuHealth::Healthy
                        && let Err(at) = self.mig_free.binary_search(&slice)
                    {
                        self.mig_free.insert(at, slice);
                    }
                } else if let Ok(at) = self.mig_free.binary_search(&slice) {
                    self.mig_free.remove(at);
                }
            }
        }
    }

    /// Elementwise minimum: what is free both now and in `other`.
    pub fn min(&self, other: &NodeFree) -> NodeFree {
        NodeFree {
            cpu_milli: self.cpu_milli.min(other.cpu_milli),
            memory_mib: self.memory_mib.min(other.memory_mib),
            gpu_milli: self
                .gpu_milli
                .iter()
                .zip(&other.gpu_milli)
                .map(|(a, b)| *a.min(b))
                .collect(),
            gpu_memory_mib: self
                .gpu_memory_mib
                .iter()
                .zip(&other.gpu_memory_mib)
                .map(|(a, b)| *a.min(b))
                .collect(),
            mig_free: self
                .mig_free
                .iter()
                .filter(|s| other.mig_free.binary_search(s).is_ok())
                .copied()
                .collect(),
        }
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
    /// Held back for a backfill reservation: not in any group; evaluated one by one, against
    /// `shadow` for work that would still run at the reservation's start.
    pub shadow: Option<NodeFree>,
}

#[derive(Debug)]
pub struct Fleet<'a> {
    pub nodes: Vec<FleetNode<'a>>,
    pub index_of: HashMap<&'a str, NodeIdx>,
    pub groups: Vec<Group<'a>>,
    group_of: HashMap<GroupKey<'a>, GroupId>,
    pub events: Vec<GroupEvent>,
    /// Whether any node carries a `rack` label (gangs then prefer one rack).
    pub has_racks: bool,
    /// Nodes held for the reservation, in index order.
    pub reserved: BTreeSet<NodeIdx>,
}

/// Label naming a node's rack.
pub const RACK_LABEL: &str = "rack";

impl<'a> Fleet<'a> {
    /// The ready nodes of `state` and what is free on them.
    pub fn build(state: &'a ClusterState) -> Fleet<'a> {
        let mut fleet = Fleet {
            nodes: Vec::with_capacity(state.nodes.len()),
            index_of: HashMap::with_capacity(state.nodes.len()),
            groups: Vec::new(),
            group_of: HashMap::new(),
            events: Vec::new(),
            has_racks: false,
            reserved: BTreeSet::new(),
        };
        for node in state.nodes.values() {
            if node.status != NodeStatus::Ready {
                continue;
            }
            let mut free = NodeFree::capacity(node);
            for rec in state.allocations_on(&node.spec.name) {
                if let Some(job) = state.jobs.get(&rec.allocation.job) {
                    free.remove_allocation(node, job, rec);
                }
            }
            let idx = fleet.nodes.len() as NodeIdx;
            let rack = node.spec.labels.get(RACK_LABEL).map(String::as_str);
            fleet.has_racks |= rack.is_some();
            let key = GroupKey {
                hardware: state
                    .index
                    .hardware_class
                    .get(&node.spec.name)
                    .copied()
                    .unwrap_or_default(),
                partition: node.spec.partition.as_deref(),
                free: free.clone(),
            };
            let group = fleet.join(key, idx);
            fleet.nodes.push(FleetNode {
                node,
                rack,
                model: node.spec.gpus.first().map_or("", |g| g.model.as_str()),
                free,
                group,
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
            free: free.clone(),
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

    /// Nodes by rack, for gangs that prefer one rack (unreserved nodes only).
    pub fn racks(&self) -> BTreeMap<&'a str, Vec<NodeIdx>> {
        let mut racks: BTreeMap<&str, Vec<NodeIdx>> = BTreeMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(r) = n.rack
                && n.shadow.is_none()
            {
                racks.entry(r).or_default().push(i as NodeIdx);
            }
        }
        racks
    }
}
