//! The device nodes of an assignment, for its cgroup's allow-list: the minors of its GPUs'
//! `/dev/nvidiaN` and of its MIG slices' `/dev/nvidia-caps/nvidia-capN`; and a simulated
//! host's stand-ins for both, real character devices in its state directory with no driver
//! behind them, so confinement is shown without a GPU.

use std::io;
use std::path::{Path, PathBuf};

use crate::cgroup::devices::{NVIDIA_MAJOR, NVIDIACTL_MINOR, SIMULATED_CAPS_MAJOR};
use crate::cgroup::mig_caps::{self, MigMinors};
use crate::gpu::HostInventory;

/// Where a simulated host publishes its MIG capability table, under its state directory:
/// the driver's path, as if the state directory were `/`.
pub const SIMULATED_MIG_MINORS: &str = "proc/driver/nvidia-caps/mig-minors";

/// The device minors (`/dev/nvidiaN`) of `uuids`: a GPU's index, a MIG slice's parent's.
pub fn gpu_minors(inventory: &HostInventory, uuids: &[String]) -> Vec<u32> {
    let mut minors: Vec<u32> = uuids
        .iter()
        .filter_map(|uuid| {
            inventory
                .gpus
                .iter()
                .find(|g| &g.uuid == uuid || g.mig_instances.iter().any(|m| &m.uuid == uuid))
                .map(|g| g.index)
        })
        .collect();
    minors.sort_unstable();
    minors.dedup();
    minors
}

/// The `nvidia-caps` minors of the MIG slices among `uuids`: each one's GPU instance and
/// compute instance access nodes, looked up in the driver's table by its parent GPU's minor
/// (its index, as for `/dev/nvidiaN`) and its ids. A slice whose ids or minors are unknown
/// adds none (its job cannot open it: fails closed), and is named in the error list.
pub fn mig_cap_minors(
    inventory: &HostInventory,
    table: &MigMinors,
    uuids: &[String],
) -> (Vec<u32>, Vec<String>) {
    let mut minors = Vec::new();
    let mut unknown = Vec::new();
    for uuid in uuids {
        let Some((gpu, slice)) = inventory.gpus.iter().find_map(|g| {
            g.mig_instances
                .iter()
                .find(|m| &m.uuid == uuid)
                .map(|m| (g, m))
        }) else {
            continue;
        };
        match (slice.gpu_instance_id, slice.compute_instance_id) {
            (Some(gi), Some(ci)) => match table.access(gpu.index, gi, ci) {
                Some(pair) => minors.extend(pair),
                None => unknown.push(uuid.clone()),
            },
            _ => unknown.push(uuid.clone()),
        }
    }
    minors.sort_unstable();
    minors.dedup();
    (minors, unknown)
}

/// Creates a simulated host's device nodes under `state_dir`, as the driver does in /dev:
/// `dev/nvidiactl` and `dev/nvidiaN` for each GPU (NVIDIA's major); with MIG slices, the
/// driver's table at [`SIMULATED_MIG_MINORS`] and `dev/nvidia-caps/nvidia-capN` for each
/// slice's two access minors ([`SIMULATED_CAPS_MAJOR`]). Opening one reaches no driver
/// (ENXIO) when the cgroup allows it, and stops at the cgroup (EPERM) when it does not.
/// Returns the `dev` directory, or `None` without CAP_MKNOD (then the host has no nodes).
pub fn simulated_nodes(state_dir: &Path, inventory: &HostInventory) -> Option<PathBuf> {
    let dir = state_dir.join("dev");
    match make_simulated_nodes(state_dir, &dir, inventory) {
        Ok(()) => Some(dir),
        Err(e) => {
            tracing::info!(dir = %dir.display(), error = %e, "no simulated GPU device nodes (mknod needs CAP_MKNOD)");
            None
        }
    }
}

fn make_simulated_nodes(state_dir: &Path, dir: &Path, inventory: &HostInventory) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    mknod(&dir.join("nvidiactl"), NVIDIA_MAJOR, NVIDIACTL_MINOR)?;
    for g in &inventory.gpus {
        mknod(
            &dir.join(format!("nvidia{}", g.index)),
            NVIDIA_MAJOR,
            g.index,
        )?;
    }
    if !inventory.gpus.iter().any(|g| !g.mig_instances.is_empty()) {
        return Ok(());
    }
    let gpus = inventory
        .gpus
        .iter()
        .map(|g| g.index + 1)
        .max()
        .unwrap_or(0);
    let text = mig_caps::driver_table(gpus);
    let table_path = state_dir.join(SIMULATED_MIG_MINORS);
    if let Some(parent) = table_path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&table_path, &text)?;
    let caps = dir.join("nvidia-caps");
    std::fs::create_dir_all(&caps)?;
    let all: Vec<String> = inventory
        .gpus
        .iter()
        .flat_map(|g| g.mig_instances.iter().map(|m| m.uuid.clone()))
        .collect();
    let (minors, _) = mig_cap_minors(inventory, &MigMinors::parse(&text), &all);
    for minor in minors {
        mknod(
            &caps.join(format!("nvidia-cap{minor}")),
            SIMULATED_CAPS_MAJOR,
            minor,
        )?;
    }
    Ok(())
}

/// A character device `path` (left as it is if it exists: a restarted agent reuses them).
fn mknod(path: &Path, major: u32, minor: u32) -> io::Result<()> {
    if path.exists() {
        return Ok(());
    }
    let c =
        std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated path; makedev only combines numbers.
    let rc = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        let e = io::Error::last_os_error();
        Err(io::Error::new(
            e.kind(),
            format!("mknod {}: {e}", path.display()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuBackend;
    use crate::gpu::simulated::SimulatedBackend;

    fn mig_host() -> HostInventory {
        SimulatedBackend::from_preset("h100-pcie-1gpu-mig", "n")
            .expect("preset")
            .inventory()
            .expect("inventory")
    }

    #[test]
    fn each_slice_gets_its_own_two_capability_minors_and_a_whole_gpu_none() {
        let inv = mig_host();
        let table = MigMinors::parse(&mig_caps::driver_table(1));
        let slices: Vec<String> = inv.gpus[0]
            .mig_instances
            .iter()
            .map(|m| m.uuid.clone())
            .collect();
        assert_eq!(slices.len(), 4);
        let mut all = std::collections::BTreeSet::new();
        for (i, s) in slices.iter().enumerate() {
            let (minors, unknown) = mig_cap_minors(&inv, &table, std::slice::from_ref(s));
            assert!(unknown.is_empty());
            assert_eq!(minors.len(), 2, "a GI and a CI access node: {minors:?}");
            let m = &inv.gpus[0].mig_instances[i];
            let want = table
                .access(
                    0,
                    m.gpu_instance_id.unwrap(),
                    m.compute_instance_id.unwrap(),
                )
                .unwrap();
            assert_eq!(minors, want.to_vec());
            for minor in &minors {
                assert!(all.insert(*minor), "minor {minor} shared by two slices");
            }
            // The parent GPU's node too, as before.
            assert_eq!(gpu_minors(&inv, std::slice::from_ref(s)), vec![0]);
        }
        let (two, _) = mig_cap_minors(&inv, &table, &slices[..2]);
        assert_eq!(two.len(), 4);
        // A whole GPU, or an unknown UUID: no capability node.
        let (none, unknown) =
            mig_cap_minors(&inv, &table, &[inv.gpus[0].uuid.clone(), "GPU-x".into()]);
        assert!(none.is_empty() && unknown.is_empty());
    }

    #[test]
    fn a_slice_the_table_or_the_driver_does_not_describe_gets_nothing_and_is_named() {
        let mut inv = mig_host();
        let slice = inv.gpus[0].mig_instances[0].uuid.clone();
        let (minors, unknown) =
            mig_cap_minors(&inv, &MigMinors::default(), std::slice::from_ref(&slice));
        assert!(minors.is_empty());
        assert_eq!(unknown, vec![slice.clone()]);
        inv.gpus[0].mig_instances[0].compute_instance_id = None;
        let table = MigMinors::parse(&mig_caps::driver_table(1));
        let (minors, unknown) = mig_cap_minors(&inv, &table, std::slice::from_ref(&slice));
        assert!(minors.is_empty());
        assert_eq!(unknown, vec![slice]);
    }
}
