//! Who uses which GPU on this host, and the one rule that decides whether another use may
//! start now. The runtime checks every launch against its live allocations with it, and the
//! usage-journal checker replays a host's history through it, so the guarantee the agent
//! enforces and the one tests verify are the same rule (invariant 1).
//!
//! A device UUID in an allocation is used in one of three ways:
//! - **exclusive**: a whole GPU; nothing else may use that GPU (no other allocation, no share,
//!   no MIG slice of it) at the same time;
//! - **share**: the allocation's one GPU, used through CUDA MPS with a fraction of its compute
//!   (milli-GPU) and a GPU memory limit; shares may overlap on one GPU exactly when every use
//!   of it is a share and together they hold at most [`MILLI_PER_GPU`] milli and, when the GPU's
//!   memory is known, at most its memory;
//! - **MIG slice**: a MIG instance UUID, its own unit (two slices of one GPU never conflict),
//!   exclusive to one allocation; a slice never overlaps a whole-GPU use of its parent (neither
//!   an exclusive use nor a share: a GPU in MIG mode cannot be used whole).

use std::collections::BTreeMap;

use super::types::GpuShare;

/// A GPU's compute in milli-GPU: what all shares of one GPU may hold together.
pub const MILLI_PER_GPU: u32 = 1000;

/// A refused use: the device it concerns, the allocations in the way, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The GPU or MIG slice UUID of the new allocation that cannot be used now.
    pub gpu: String,
    /// Allocations whose uses stand in the way, in id order (at least one).
    pub holders: Vec<u64>,
    pub reason: String,
}

/// The uses of one physical GPU (or of one MIG slice, which then has only `exclusive`).
#[derive(Debug, Default, Clone)]
struct Users {
    /// (allocation, since ms) using it whole, or holding the MIG slice.
    exclusive: Option<(u64, u64)>,
    /// allocation → (its share, since ms).
    shares: BTreeMap<u64, (GpuShare, u64)>,
    /// MIG slices of this GPU in use: slice UUID → allocation.
    slices: BTreeMap<String, u64>,
}

impl Users {
    fn is_empty(&self) -> bool {
        self.exclusive.is_none() && self.shares.is_empty() && self.slices.is_empty()
    }

    /// Every allocation using this GPU in any way, in id order, without repeats.
    fn allocations(&self) -> Vec<u64> {
        let mut all: Vec<u64> = self
            .exclusive
            .iter()
            .map(|(a, _)| *a)
            .chain(self.shares.keys().copied())
            .chain(self.slices.values().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// One device use of one allocation, as it was recorded (so release undoes exactly it).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Claim {
    Exclusive(String),
    Share(String, GpuShare),
    Slice { slice: String, parent: String },
}

/// The current uses of every GPU, built up by [`GpuLedger::claim`] and torn down by
/// [`GpuLedger::release`].
#[derive(Debug, Default, Clone)]
pub(crate) struct GpuLedger {
    devices: BTreeMap<String, Users>,
    held: BTreeMap<u64, Vec<Claim>>,
}

impl GpuLedger {
    /// Records that `allocation` uses `gpus` from `at_ms` on: as a share of its one GPU when
    /// `share` is given, each GPU named in `mig_parents` as a MIG slice of that parent, every
    /// other one whole. Refused (and nothing recorded) when a use conflicts with the ones
    /// already recorded, or with another use of the same allocation.
    pub(crate) fn claim(
        &mut self,
        allocation: u64,
        at_ms: u64,
        gpus: &[String],
        share: Option<&GpuShare>,
        mig_parents: &BTreeMap<String, String>,
    ) -> Result<(), Conflict> {
        if self.held.contains_key(&allocation) {
            return Err(Conflict {
                gpu: gpus.first().cloned().unwrap_or_default(),
                holders: vec![allocation],
                reason: format!("allocation {allocation} already uses its GPUs"),
            });
        }
        self.held.insert(allocation, Vec::new());
        for gpu in gpus {
            let claim = match (mig_parents.get(gpu), share) {
                (Some(parent), _) => Claim::Slice {
                    slice: gpu.clone(),
                    parent: parent.clone(),
                },
                (None, Some(share)) => Claim::Share(gpu.clone(), *share),
                (None, None) => Claim::Exclusive(gpu.clone()),
            };
            if let Err(conflict) = self.apply(allocation, at_ms, &claim) {
                self.release(allocation);
                return Err(conflict);
            }
            self.held.entry(allocation).or_default().push(claim);
        }
        Ok(())
    }

    /// Forgets every use of `allocation`; a no-op for one that holds nothing.
    pub(crate) fn release(&mut self, allocation: u64) {
        for claim in self.held.remove(&allocation).unwrap_or_default() {
            match claim {
                Claim::Exclusive(gpu) => {
                    if let Some(users) = self.devices.get_mut(&gpu)
                        && users.exclusive.is_some_and(|(a, _)| a == allocation)
                    {
                        users.exclusive = None;
                    }
                    self.prune(&gpu);
                }
                Claim::Share(gpu, _) => {
                    if let Some(users) = self.devices.get_mut(&gpu) {
                        users.shares.remove(&allocation);
                    }
                    self.prune(&gpu);
                }
                Claim::Slice { slice, parent } => {
                    if let Some(users) = self.devices.get_mut(&slice)
                        && users.exclusive.is_some_and(|(a, _)| a == allocation)
                    {
                        users.exclusive = None;
                    }
                    if let Some(users) = self.devices.get_mut(&parent)
                        && users.slices.get(&slice) == Some(&allocation)
                    {
                        users.slices.remove(&slice);
                    }
                    self.prune(&slice);
                    self.prune(&parent);
                }
            }
        }
    }

    /// Allocations using `gpu` in any way: whole, as a share, through one of its MIG slices, or
    /// (for a slice UUID) holding that slice. In id order.
    pub(crate) fn users_of(&self, gpu: &str) -> Vec<u64> {
        self.devices
            .get(gpu)
            .map(Users::allocations)
            .unwrap_or_default()
    }

    fn prune(&mut self, gpu: &str) {
        if self.devices.get(gpu).is_some_and(Users::is_empty) {
            self.devices.remove(gpu);
        }
    }

    fn apply(&mut self, allocation: u64, at_ms: u64, claim: &Claim) -> Result<(), Conflict> {
        match claim {
            Claim::Exclusive(gpu) => {
                let users = self.devices.entry(gpu.clone()).or_default();
                if !users.is_empty() {
                    return Err(busy(gpu, users, "whole"));
                }
                users.exclusive = Some((allocation, at_ms));
            }
            Claim::Share(gpu, share) => {
                let users = self.devices.entry(gpu.clone()).or_default();
                if users.exclusive.is_some() || !users.slices.is_empty() {
                    return Err(busy(gpu, users, "as a share"));
                }
                let milli: u32 = users.shares.values().map(|(s, _)| s.milli).sum();
                if milli + share.milli > MILLI_PER_GPU {
                    return Err(Conflict {
                        gpu: gpu.clone(),
                        holders: users.allocations(),
                        reason: format!(
                            "its shares hold {milli} of its {MILLI_PER_GPU} milli; {} more do \
                             not fit",
                            share.milli
                        ),
                    });
                }
                // The GPU's memory, if any share of it knows it.
                let capacity = std::iter::once(share.gpu_memory_mib)
                    .chain(users.shares.values().map(|(s, _)| s.gpu_memory_mib))
                    .find(|m| *m > 0);
                let memory: u64 = users.shares.values().map(|(s, _)| s.memory_mib).sum();
                if let Some(capacity) = capacity
                    && memory + share.memory_mib > capacity
                {
                    return Err(Conflict {
                        gpu: gpu.clone(),
                        holders: users.allocations(),
                        reason: format!(
                            "its shares hold {memory} MiB of its {capacity} MiB; {} MiB more \
                             do not fit",
                            share.memory_mib
                        ),
                    });
                }
                users.shares.insert(allocation, (*share, at_ms));
            }
            Claim::Slice { slice, parent } => {
                if let Some(users) = self.devices.get(slice)
                    && !users.is_empty()
                {
                    return Err(busy(slice, users, "as a MIG slice"));
                }
                if let Some(users) = self.devices.get(parent)
                    && (users.exclusive.is_some() || !users.shares.is_empty())
                {
                    let mut conflict = busy(parent, users, "as a MIG slice");
                    conflict.gpu = slice.clone();
                    conflict.reason =
                        format!("its parent GPU {parent} is used whole: {}", conflict.reason);
                    return Err(conflict);
                }
                self.devices.entry(slice.clone()).or_default().exclusive =
                    Some((allocation, at_ms));
                self.devices
                    .entry(parent.clone())
                    .or_default()
                    .slices
                    .insert(slice.clone(), allocation);
            }
        }
        Ok(())
    }
}

/// Why `gpu` cannot be used `how` while `users` use it.
fn busy(gpu: &str, users: &Users, how: &str) -> Conflict {
    let mut uses = Vec::new();
    if let Some((a, since)) = users.exclusive {
        uses.push(format!("allocation {a} holds it (since {since} ms)"));
    }
    if !users.shares.is_empty() {
        let shares: Vec<String> = users
            .shares
            .iter()
            .map(|(a, (s, since))| format!("{a} ({} milli since {since} ms)", s.milli))
            .collect();
        uses.push(format!("shared by allocations {}", shares.join(", ")));
    }
    if !users.slices.is_empty() {
        let slices: Vec<String> = users
            .slices
            .iter()
            .map(|(slice, a)| format!("{slice} by {a}"))
            .collect();
        uses.push(format!("MIG slices in use: {}", slices.join(", ")));
    }
    Conflict {
        gpu: gpu.to_string(),
        holders: users.allocations(),
        reason: format!("it cannot be used {how} while {}", uses.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(milli: u32, memory_mib: u64) -> GpuShare {
        GpuShare {
            milli,
            memory_mib,
            gpu_memory_mib: 80_000,
        }
    }

    fn gpus(list: &[&str]) -> Vec<String> {
        list.iter().map(|g| g.to_string()).collect()
    }

    fn none() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    #[test]
    fn a_conflicting_claim_records_nothing_and_release_frees_exactly_its_uses() {
        let mut l = GpuLedger::default();
        l.claim(1, 0, &gpus(&["GPU-a"]), None, &none())
            .expect("free");
        // GPU-b is free but GPU-a is not: allocation 2 gets neither.
        let err = l
            .claim(2, 1, &gpus(&["GPU-b", "GPU-a"]), None, &none())
            .expect_err("GPU-a is held");
        assert_eq!((err.gpu.as_str(), err.holders.clone()), ("GPU-a", vec![1]));
        assert!(l.users_of("GPU-b").is_empty());
        l.claim(3, 2, &gpus(&["GPU-b"]), None, &none())
            .expect("GPU-b is still free");
        l.release(1);
        l.release(1);
        assert!(l.users_of("GPU-a").is_empty());
        assert_eq!(l.users_of("GPU-b"), vec![3]);
        l.release(99);
        assert_eq!(l.users_of("GPU-b"), vec![3]);
    }

    #[test]
    fn the_same_allocation_cannot_claim_twice() {
        let mut l = GpuLedger::default();
        l.claim(1, 0, &gpus(&["GPU-a"]), None, &none())
            .expect("free");
        assert!(l.claim(1, 1, &gpus(&["GPU-b"]), None, &none()).is_err());
        assert!(l.users_of("GPU-b").is_empty());
        assert_eq!(l.users_of("GPU-a"), vec![1], "the first claim stays");
    }

    #[test]
    fn users_of_a_gpu_include_its_shares_and_its_mig_slices() {
        let mut l = GpuLedger::default();
        let s = share(300, 100);
        l.claim(1, 0, &gpus(&["GPU-a"]), Some(&s), &none())
            .expect("share");
        l.claim(2, 0, &gpus(&["GPU-a"]), Some(&s), &none())
            .expect("share");
        let parents = BTreeMap::from([
            ("MIG-1".to_string(), "GPU-m".to_string()),
            ("MIG-2".to_string(), "GPU-m".to_string()),
        ]);
        l.claim(3, 0, &gpus(&["MIG-1"]), None, &parents)
            .expect("slice");
        l.claim(4, 0, &gpus(&["MIG-2"]), None, &parents)
            .expect("another slice of the same GPU");
        assert_eq!(l.users_of("GPU-a"), vec![1, 2]);
        assert_eq!(l.users_of("GPU-m"), vec![3, 4]);
        assert_eq!(l.users_of("MIG-1"), vec![3]);
        l.release(3);
        assert_eq!(l.users_of("GPU-m"), vec![4]);
        assert!(l.users_of("MIG-1").is_empty());
    }
}
