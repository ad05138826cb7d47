//! The fleet as one scheduling pass sees it: what is free on every ready node, and nodes grouped
//! by identical free resources so that a placement is evaluated once per group, not once per
//! node. On a 10,000-node fleet of a few host types a pass deals with tens of groups.
//!
//! Every change of a node's free resources goes through [`Fleet::set_free`], which moves the
//! node between groups and appends to an event log that the per-shape rankings
//! (`placement::Ranking`) replay, so they stay current without rescanning the fleet.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::fit::rank_matrix;

use crate::state::{ClusterState, Node, NodeStatus};

/// A fast, non-cryptographic hasher for the pass's in-memory maps (the multiply-rotate of
/// rustc's FxHash): keys are the scheduler's own values, never attacker-chosen, and SipHash
/// showed up in profiles of 10,000-node passes. Iteration order of these maps never decides
/// anything.
#[derive(Default, Clone, Copy)]
pub struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    /// Eight bytes at a time, little-endian, the last word zero-padded. Whole words are read
    /// in place and the tail is assembled byte by byte: copying each chunk into a buffer cost a
    /// `memcpy` call per word, and keys such as `NodeFree` (arrays of GPU milli and memory) are
    /// hashed for every fit question of a pass.
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.write_u64(u64::from_le_bytes(w));
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            let word = tail
                .iter()
                .enumerate()
                .fold(0u64, |w, (i, &b)| w | (u64::from(b) << (8 * i)));
            self.write_u64(word);
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

    /// The multiply leaves the low bits depending only on the low bits of the last word, and
    /// hashbrown picks buckets by the low bits: names that differ only in their last characters
    /// ("h-00017", "h-00018") would share buckets and probe long chains. Rotating brings the
    /// well-mixed high bits down (as rustc-hash 2 does).
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
}

pub type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

pub type NodeIdx = u32;

/// Node name → index in the fleet. Short names (nearly all) are keyed by their bytes held
/// inline in the table, so a lookup compares against the table itself instead of following
/// a pointer to the node's name on the heap: the live-allocation walk looks up every
/// allocation's node, and those cache misses were a fifth of its time.
#[derive(Debug, Default)]
pub struct NodeNames<'a> {
    short: FastMap<ShortName, NodeIdx>,
    long: FastMap<&'a str, NodeIdx>,
}

/// A name of at most `ShortName::MAX` bytes: its length, then its bytes, zero-padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ShortName([u8; 24]);

impl ShortName {
    const MAX: usize = 23;

    fn of(name: &str) -> Option<ShortName> {
        let bytes = name.as_bytes();
        if bytes.len() > Self::MAX {
            return None;
        }
        let mut key = [0u8; 24];
        key[0] = bytes.len() as u8;
        key[1..=bytes.len()].copy_from_slice(bytes);
        Some(ShortName(key))
    }
}

impl<'a> NodeNames<'a> {
    fn with_capacity(n: usize) -> NodeNames<'a> {
        NodeNames {
            short: FastMap::with_capacity_and_hasher(n, Default::default()),
            long: FastMap::default(),
        }
    }

    fn insert(&mut self, name: &'a str, idx: NodeIdx) {
        match ShortName::of(name) {
            Some(key) => self.short.insert(key, idx),
            None => self.long.insert(name, idx),
        };
    }

    /// The index of the node named `name`, if it is in the fleet.
    pub fn get(&self, name: &str) -> Option<NodeIdx> {
        match ShortName::of(name) {
            Some(key) => self.short.get(&key).copied(),
            None => self.long.get(name).copied(),
        }
    }
}
pub type GroupId = u32;

/// Link ranks between a node's GPUs, shared by every host of its hardware class.
pub type Ranks = Arc<Vec<Vec<u32>>>;

pub use crate::state::free::{MAX_GPUS, MAX_SLICES, NodeFree};

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
    /// Model of the node's GPUs (the first GPU's; hosts carry one model).
    pub model: &'a str,
    pub free: NodeFree,
    pub group: GroupId,
    /// Link ranks between the node's GPUs (shared by every host of its hardware class).
    pub ranks: Arc<Vec<Vec<u32>>>,
    /// Held back for a backfill reservation: not in any group; evaluated one by one, against
    /// `shadow` for work that would still run at the reservation's start.
    /// Boxed: few nodes are held, and a fleet node is copied into place for every node of
    /// every pass (an inline `NodeFree` doubled its size).
    pub shadow: Option<Box<NodeFree>>,
}

#[derive(Debug)]
pub struct Fleet<'a> {
    pub nodes: Vec<FleetNode<'a>>,
    pub index_of: NodeNames<'a>,
    pub groups: Vec<Group<'a>>,
    group_of: FastMap<GroupKey<'a>, GroupId>,
    pub events: Vec<GroupEvent>,
    /// Nodes held for the reservation, in index order.
    pub reserved: BTreeSet<NodeIdx>,
    /// Counts changes to the held nodes (which, and what is free on them or in their shadow),
    /// so that answers about them can be kept until the next change.
    held_version: u64,
    /// Whether any node carries a `rack` label (gangs then prefer one rack); found on first
    /// use.
    has_racks: OnceCell<bool>,
    /// The nodes' racks, found on first use: a node's labels are a map on the heap, and only
    /// a gang that fits somewhere asks for racks (a full fleet's pass never does).
    racks: OnceCell<Racks<'a>>,
}

#[derive(Debug)]
struct Racks<'a> {
    /// Per node, its rack.
    of: Vec<Option<&'a str>>,
    /// Rack → its nodes, in index order.
    nodes: BTreeMap<&'a str, Vec<NodeIdx>>,
}

/// Label naming a node's rack.
pub const RACK_LABEL: &str = "rack";

impl<'a> Fleet<'a> {
    /// The ready nodes of `state` and what is free on them.
    pub fn build(state: &'a ClusterState) -> Fleet<'a> {
        let mut fleet = Fleet {
            nodes: Vec::with_capacity(state.nodes.len()),
            index_of: NodeNames::with_capacity(state.nodes.len()),
            groups: Vec::new(),
            group_of: FastMap::default(),
            events: Vec::new(),
            reserved: BTreeSet::new(),
            held_version: 0,
            has_racks: OnceCell::new(),
            racks: OnceCell::new(),
        };
        let mut ranks_of: FastMap<u64, Arc<Vec<Vec<u32>>>> = FastMap::default();
        // The first GPU's model, per hardware class (the class fingerprints every GPU's
        // model): reading it from each node's GPU list was a cache miss per node.
        let mut model_of: FastMap<u64, &'a str> = FastMap::default();
        // The indexes are keyed by node name like `nodes`: walk them alongside instead of
        // looking each node up (string-keyed lookups were a third of this function's time).
        // They hold exactly the nodes of `nodes` (`check_consistency` verifies it against
        // indexes derived from the data), so when their sizes agree they are zipped without
        // comparing names at all; otherwise they are merge-walked by name.
        let aligned = state.index.node_free.len() == state.nodes.len()
            && state.index.hardware_class.len() == state.nodes.len();
        // The last group met of each hardware class (the first `RECENT` classes): hosts of one
        // class in the same state are common, and classes alternate along the names ("eight
        // DGX, one V100, one L40S"), so comparing with that group's key spares most hashing of
        // keys (a node's free resources are a few hundred bytes).
        const RECENT: usize = 16;
        let mut recent: Vec<(u64, GroupId)> = Vec::new();
        // The previous node's hardware class, model and link ranks: neighbours usually share
        // their class, and then need no lookup.
        let mut previous_class: Option<(u64, &'a str, Ranks)> = None;
        // Each group's members, in index order, turned into sets at the end: inserting ten
        // thousand nodes one by one into sets showed in profiles.
        let mut members: Vec<Vec<NodeIdx>> = Vec::new();
        let mut frees = state.index.node_free.iter().peekable();
        let mut classes = state.index.hardware_class.iter().peekable();
        for (name, node) in &state.nodes {
            let (free, class) = if aligned {
                let free = frees.next();
                let class = classes.next();
                debug_assert!(free.is_some_and(|(n, _)| n == name));
                debug_assert!(class.is_some_and(|(n, _)| n == name));
                (free.map(|(_, f)| f), class.map(|(_, c)| *c))
            } else {
                while frees.next_if(|(n, _)| *n < name).is_some() {}
                while classes.next_if(|(n, _)| *n < name).is_some() {}
                let free = frees.next_if(|(n, _)| *n == name).map(|(_, f)| f);
                let class = classes.next_if(|(n, _)| *n == name).map(|(_, c)| *c);
                (free, class)
            };
            let hardware = class.unwrap_or(0);
            if node.status != NodeStatus::Ready {
                continue;
            }
            // Borrowed from the index: a node's free resources are copied once, into the fleet.
            let capacity;
            let free: &NodeFree = match free {
                Some(f) => f,
                None => {
                    capacity = NodeFree::capacity(node);
                    &capacity
                }
            };
            let idx = fleet.nodes.len() as NodeIdx;
            let (model, ranks) = match (&previous_class, class) {
                (Some((c, model, ranks)), Some(class)) if *c == class => (*model, ranks.clone()),
                _ => {
                    let first_model = || node.spec.gpus.first().map_or("", |g| g.model.as_str());
                    let model = match class {
                        Some(c) => *model_of.entry(c).or_insert_with(first_model),
                        None => first_model(),
                    };
                    let ranks = ranks_of
                        .entry(hardware)
                        .or_insert_with(|| Arc::new(rank_matrix(&node.spec.topology)))
                        .clone();
                    if let Some(c) = class {
                        previous_class = Some((c, model, ranks.clone()));
                    }
                    (model, ranks)
                }
            };
            let partition = node.spec.partition.as_deref();
            let last = recent.iter().position(|&(h, _)| h == hardware);
            let group = match last.map(|i| recent[i].1) {
                Some(g)
                    if fleet.groups[g as usize].key.partition == partition
                        && fleet.groups[g as usize].key.free == *free =>
                {
                    g
                }
                _ => {
                    let key = GroupKey {
                        hardware,
                        partition,
                        free: *free,
                    };
                    let g = fleet.group_for(key, idx);
                    match last {
                        Some(i) => recent[i].1 = g,
                        None if recent.len() < RECENT => recent.push((hardware, g)),
                        None => {}
                    }
                    g
                }
            };
            if members.len() <= group as usize {
                members.resize_with(group as usize + 1, Vec::new);
            }
            members[group as usize].push(idx);
            fleet.nodes.push(FleetNode {
                node,
                model,
                free: *free,
                group,
                ranks,
                shadow: None,
            });
            fleet.index_of.insert(node.spec.name.as_str(), idx);
        }
        for (group, members) in fleet.groups.iter_mut().zip(members) {
            // Sorted input: the set is built in one go.
            group.members = members.into_iter().collect();
        }
        fleet
    }

    /// The group of `key`, created (and announced as filled) if there is none: for
    /// [`Fleet::build`], which adds the members itself.
    fn group_for(&mut self, key: GroupKey<'a>, idx: NodeIdx) -> GroupId {
        let known = self.groups.len();
        let g = self.group_of_key(key, idx);
        if g as usize == known {
            self.events.push(GroupEvent::Filled(g));
        }
        g
    }

    /// The group of `key`, created empty with `idx` as its sample if there is none.
    fn group_of_key(&mut self, key: GroupKey<'a>, idx: NodeIdx) -> GroupId {
        if let Some(&g) = self.group_of.get(&key) {
            return g;
        }
        let g = self.groups.len() as GroupId;
        self.group_of.insert(key.clone(), g);
        self.groups.push(Group {
            key,
            members: BTreeSet::new(),
            sample: idx,
        });
        g
    }

    fn join(&mut self, key: GroupKey<'a>, idx: NodeIdx) -> GroupId {
        let gid = self.group_of_key(key, idx);
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
            self.held_version += 1;
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
        self.nodes[idx as usize].shadow = Some(Box::new(shadow));
        self.reserved.insert(idx);
        self.held_version += 1;
    }

    /// Replaces a held node's shadow.
    pub fn set_shadow(&mut self, idx: NodeIdx, shadow: Option<NodeFree>) {
        self.nodes[idx as usize].shadow = shadow.map(Box::new);
        self.held_version += 1;
    }

    /// Changes with every change to the held nodes (see `held_version`).
    pub fn held_version(&self) -> u64 {
        self.held_version
    }

    /// Whether any node carries a `rack` label.
    pub fn has_racks(&self) -> bool {
        *self.has_racks.get_or_init(|| {
            self.nodes
                .iter()
                .any(|n| n.node.spec.labels.contains_key(RACK_LABEL))
        })
    }

    fn racks(&self) -> &Racks<'a> {
        self.racks.get_or_init(|| {
            let of: Vec<Option<&'a str>> = self
                .nodes
                .iter()
                .map(|n| n.node.spec.labels.get(RACK_LABEL).map(String::as_str))
                .collect();
            let mut nodes: BTreeMap<&'a str, Vec<NodeIdx>> = BTreeMap::new();
            for (idx, rack) in of.iter().enumerate() {
                if let Some(r) = rack {
                    nodes.entry(r).or_default().push(idx as NodeIdx);
                }
            }
            Racks { of, nodes }
        })
    }

    /// The node's rack, if it has one.
    pub fn rack_of(&self, idx: NodeIdx) -> Option<&'a str> {
        self.racks().of[idx as usize]
    }

    /// A rack's nodes, in index order.
    pub fn rack_nodes(&self, rack: &str) -> Vec<NodeIdx> {
        self.racks().nodes.get(rack).cloned().unwrap_or_default()
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
