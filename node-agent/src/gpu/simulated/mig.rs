//! MIG profiles of the GPUs this project simulates, and whether a set of profiles fits on one
//! GPU.
//!
//! Numbers follow NVIDIA's MIG user guide and `nvidia-smi mig -lgip` / `-lgipp` output: a
//! MIG-capable GPU has 7 compute slices and 8 memory slices, each profile takes a fixed number
//! of each, may start only at certain memory slices (its placements), and some profiles are
//! limited in count (the `+me` profiles own the GPU's only media engines). Memory sizes are
//! what `nvidia-smi mig -lgip` reports, in MiB.

/// One GPU instance profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfile {
    pub name: &'static str,
    pub compute_slices: u32,
    pub memory_slices: u32,
    pub memory_mib: u64,
    /// At most this many instances of the profile on one GPU.
    pub max_instances: u32,
    /// Memory slices at which an instance may start.
    pub placements: &'static [u32],
}

/// The MIG profiles of one GPU model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigGpu {
    pub name: &'static str,
    pub profiles: &'static [MigProfile],
}

pub const COMPUTE_SLICES: u32 = 7;
pub const MEMORY_SLICES: u32 = 8;

// Placements as `nvidia-smi mig -lgipp` lists them; identical on A100 and H100.
const ONE_SLICE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const ONE_G_TWO_MEM: &[u32] = &[0, 2, 4, 6];
const TWO_G: &[u32] = &[0, 2, 4];
const THREE_G: &[u32] = &[0, 4];
const START_ONLY: &[u32] = &[0];

const fn p(
    name: &'static str,
    compute_slices: u32,
    memory_slices: u32,
    memory_mib: u64,
    max_instances: u32,
    placements: &'static [u32],
) -> MigProfile {
    MigProfile {
        name,
        compute_slices,
        memory_slices,
        memory_mib,
        max_instances,
        placements,
    }
}

pub const A100_40GB: MigGpu = MigGpu {
    name: "A100 40GB",
    profiles: &[
        p("1g.5gb", 1, 1, 4864, 7, ONE_SLICE),
        p("1g.5gb+me", 1, 1, 4864, 1, ONE_SLICE),
        p("1g.10gb", 1, 2, 9856, 4, ONE_G_TWO_MEM),
        p("2g.10gb", 2, 2, 9856, 3, TWO_G),
        p("3g.20gb", 3, 4, 19968, 2, THREE_G),
        p("4g.20gb", 4, 4, 19968, 1, START_ONLY),
        p("7g.40gb", 7, 8, 40192, 1, START_ONLY),
    ],
};

pub const A100_80GB: MigGpu = MigGpu {
    name: "A100 80GB",
    profiles: &[
        p("1g.10gb", 1, 1, 9728, 7, ONE_SLICE),
        p("1g.10gb+me", 1, 1, 9728, 1, ONE_SLICE),
        p("1g.20gb", 1, 2, 19968, 4, ONE_G_TWO_MEM),
        p("2g.20gb", 2, 2, 19968, 3, TWO_G),
        p("3g.40gb", 3, 4, 40192, 2, THREE_G),
        p("4g.40gb", 4, 4, 40192, 1, START_ONLY),
        p("7g.80gb", 7, 8, 81152, 1, START_ONLY),
    ],
};

pub const H100_80GB: MigGpu = MigGpu {
    name: "H100 80GB",
    profiles: &[
        p("1g.10gb", 1, 1, 9984, 7, ONE_SLICE),
        p("1g.10gb+me", 1, 1, 9984, 1, ONE_SLICE),
        p("1g.20gb", 1, 2, 20096, 4, ONE_G_TWO_MEM),
        p("2g.20gb", 2, 2, 20096, 3, TWO_G),
        p("3g.40gb", 3, 4, 40448, 2, THREE_G),
        p("4g.40gb", 4, 4, 40448, 1, START_ONLY),
        p("7g.80gb", 7, 8, 81152, 1, START_ONLY),
    ],
};

/// The MIG table for a GPU model, or `None` if the model has no MIG (V100, L40S, ...) or is
/// one this table does not know. `memory_mib` tells the 40 GB A100 from the 80 GB one.
pub fn mig_gpu_for(model: &str, memory_mib: u64) -> Option<&'static MigGpu> {
    let model = model.to_ascii_uppercase();
    if model.contains("A100") {
        Some(if memory_mib > 60_000 {
            &A100_80GB
        } else {
            &A100_40GB
        })
    } else if model.contains("H100") && (70_000..=90_000).contains(&memory_mib) {
        // H100 NVL (94 GB) and GH200 (96 GB) have other profiles; not simulated.
        Some(&H100_80GB)
    } else {
        None
    }
}

impl MigGpu {
    pub fn profile(&self, name: &str) -> Option<&'static MigProfile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    fn profile_names(&self) -> String {
        self.profiles
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks that `requested` profiles fit on one GPU together and returns, per request in
    /// order, its profile and the memory slice it starts at. Errors say which rule the layout
    /// breaks.
    pub fn place(&self, requested: &[String]) -> Result<Vec<(&'static MigProfile, u32)>, String> {
        let mut profiles = Vec::with_capacity(requested.len());
        for name in requested {
            let profile = self.profile(name).ok_or_else(|| {
                format!(
                    "unknown MIG profile `{name}` for {} (known: {})",
                    self.name,
                    self.profile_names()
                )
            })?;
            profiles.push(profile);
        }
        for profile in self.profiles {
            let count = profiles.iter().filter(|p| p.name == profile.name).count();
            if count > profile.max_instances as usize {
                return Err(format!(
                    "{count} × {} requested, but a {} holds at most {}",
                    profile.name, self.name, profile.max_instances
                ));
            }
        }
        let compute: u32 = profiles.iter().map(|p| p.compute_slices).sum();
        if compute > COMPUTE_SLICES {
            return Err(format!(
                "[{}] need {compute} compute slices, a {} has {COMPUTE_SLICES}",
                requested.join(", "),
                self.name
            ));
        }
        let memory: u32 = profiles.iter().map(|p| p.memory_slices).sum();
        if memory > MEMORY_SLICES {
            return Err(format!(
                "[{}] need {memory} memory slices, a {} has {MEMORY_SLICES}",
                requested.join(", "),
                self.name
            ));
        }

        // Place the largest instances first: they have the fewest placements.
        let mut order: Vec<usize> = (0..profiles.len()).collect();
        order.sort_by_key(|&i| {
            (
                std::cmp::Reverse(profiles[i].memory_slices),
                profiles[i].placements.len(),
            )
        });
        let mut starts = vec![0; profiles.len()];
        if place_from(&profiles, &order, 0, 0, &mut starts) {
            Ok(profiles.into_iter().zip(starts).collect())
        } else {
            Err(format!(
                "[{}] fit the slice counts but not NVIDIA's fixed placements on a {} (e.g. \
                 2g instances start only at memory slices 0, 2 or 4, and 1g instances never \
                 use slice 7)",
                requested.join(", "),
                self.name
            ))
        }
    }
}

/// Backtracking over placements; `used` has one bit per memory slice. At most 7 instances
/// with at most 7 placements each, so the search is tiny.
fn place_from(
    profiles: &[&MigProfile],
    order: &[usize],
    next: usize,
    used: u32,
    starts: &mut [u32],
) -> bool {
    let Some(&i) = order.get(next) else {
        return true;
    };
    let profile = profiles[i];
    for &start in profile.placements {
        let mask = ((1u32 << profile.memory_slices) - 1) << start;
        if start + profile.memory_slices > MEMORY_SLICES || used & mask != 0 {
            continue;
        }
        starts[i] = start;
        if place_from(profiles, order, next + 1, used | mask, starts) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn models_map_to_tables() {
        assert_eq!(
            mig_gpu_for("NVIDIA A100-SXM4-40GB", 40960),
            Some(&A100_40GB)
        );
        assert_eq!(
            mig_gpu_for("NVIDIA A100 80GB PCIe", 81920),
            Some(&A100_80GB)
        );
        assert_eq!(
            mig_gpu_for("NVIDIA H100 80GB HBM3", 81559),
            Some(&H100_80GB)
        );
        assert_eq!(mig_gpu_for("NVIDIA H100 NVL", 95830), None);
        assert_eq!(mig_gpu_for("Tesla V100-SXM2-32GB", 32768), None);
        assert_eq!(mig_gpu_for("NVIDIA L40S", 46068), None);
    }

    #[test]
    fn every_profile_is_consistent() {
        for gpu in [A100_40GB, A100_80GB, H100_80GB] {
            for p in gpu.profiles {
                assert!(
                    p.compute_slices <= COMPUTE_SLICES,
                    "{} {}",
                    gpu.name,
                    p.name
                );
                assert!(p.memory_slices <= MEMORY_SLICES, "{} {}", gpu.name, p.name);
                assert!(
                    p.placements
                        .iter()
                        .all(|s| s + p.memory_slices <= MEMORY_SLICES),
                    "{} {}",
                    gpu.name,
                    p.name
                );
                assert!(p.name.starts_with(&format!("{}g.", p.compute_slices)));
                // As many instances as placements allow, and every one of them placeable.
                let max = vec![p.name.to_string(); p.max_instances as usize];
                assert!(gpu.place(&max).is_ok(), "{} × {}", p.max_instances, p.name);
            }
        }
    }

    /// (gpu, profiles, Ok(starts) or Err(words the message must contain))
    type LayoutCase = (
        MigGpu,
        &'static [&'static str],
        Result<Vec<u32>, &'static [&'static str]>,
    );

    #[test]
    fn layouts() {
        let cases: Vec<LayoutCase> = vec![
            (A100_40GB, &["7g.40gb"], Ok(vec![0])),
            (A100_40GB, &["4g.20gb", "3g.20gb"], Ok(vec![0, 4])),
            (A100_40GB, &["3g.20gb", "3g.20gb"], Ok(vec![0, 4])),
            // 1g instances never use slice 7, so the 3g moves to slices 4-7.
            (
                A100_40GB,
                &["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"],
                Ok(vec![4, 0, 2, 3]),
            ),
            (
                A100_40GB,
                &["3g.20gb", "2g.10gb", "2g.10gb"],
                Ok(vec![4, 0, 2]),
            ),
            (
                A100_40GB,
                &["2g.10gb", "2g.10gb", "2g.10gb", "1g.5gb"],
                Ok(vec![0, 2, 4, 6]),
            ),
            (A100_80GB, &["1g.10gb"; 7], Ok(vec![0, 1, 2, 3, 4, 5, 6])),
            (
                H100_80GB,
                &["1g.10gb", "1g.10gb+me", "1g.20gb", "3g.40gb"],
                Ok(vec![4, 5, 6, 0]),
            ),
            (H100_80GB, &[], Ok(vec![])),
            (
                A100_40GB,
                &["4g.20gb", "4g.20gb"],
                Err(&["2 × 4g.20gb", "at most 1"]),
            ),
            (A100_40GB, &["1g.5gb"; 8], Err(&["8 × 1g.5gb", "at most 7"])),
            (
                A100_40GB,
                &["4g.20gb", "3g.20gb", "1g.5gb"],
                Err(&["8 compute slices", "has 7"]),
            ),
            (
                H100_80GB,
                &["3g.40gb", "3g.40gb", "1g.10gb"],
                Err(&["9 memory slices", "has 8"]),
            ),
            (
                A100_80GB,
                &["1g.10gb+me", "1g.10gb+me"],
                Err(&["at most 1"]),
            ),
            (
                A100_80GB,
                &["7g.40gb"],
                Err(&["unknown MIG profile `7g.40gb`", "7g.80gb"]),
            ),
        ];
        for (gpu, requested, want) in cases {
            let got = gpu.place(&names(requested)).map(|placed| {
                placed
                    .into_iter()
                    .map(|(_, start)| start)
                    .collect::<Vec<_>>()
            });
            match (got, want) {
                (Ok(starts), Ok(expected)) => {
                    assert_eq!(starts, expected, "{} {requested:?}", gpu.name)
                }
                (Err(e), Err(words)) => {
                    for word in words {
                        assert!(e.contains(word), "{requested:?}: `{e}` lacks `{word}`");
                    }
                }
                (got, want) => panic!("{} {requested:?}: got {got:?}, want {want:?}", gpu.name),
            }
        }
    }

    /// The count limits catch every impossible layout of NVIDIA's real profiles before the
    /// placement search runs; the search still refuses what the placements cannot hold.
    #[test]
    fn placement_search_respects_fixed_starts() {
        let one = A100_40GB.profile("1g.5gb").expect("known profile");
        let eight = vec![one; 8];
        let order: Vec<usize> = (0..8).collect();
        let mut starts = vec![0; 8];
        assert!(
            !place_from(&eight, &order, 0, 0, &mut starts),
            "1g never uses slice 7"
        );
        let seven = &eight[..7];
        assert!(place_from(seven, &order[..7], 0, 0, &mut starts[..7]));
    }
}
