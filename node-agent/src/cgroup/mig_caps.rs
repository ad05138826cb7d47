//! Which `/dev/nvidia-caps/nvidia-capN` nodes a MIG slice's processes open. With MIG, a
//! process reaches its slice through capability devices (the `nvidia-caps` major) besides
//! its parent GPU's `/dev/nvidiaN`: one for the GPU instance (GI) and one for the compute
//! instance (CI) it runs on. The driver publishes their minors in
//! `/proc/driver/nvidia-caps/mig-minors`, one `path minor` a line:
//!
//! ```text
//! config 1
//! monitor 2
//! gpu0/gi0/access 3
//! gpu0/gi0/ci0/access 4
//! ...
//! gpu0/gi1/access 12
//! gpu0/gi1/ci0/access 13
//! ```
//!
//! `gpuN` is the parent GPU's minor (`/dev/nvidiaN`). `config` and `monitor` (creating MIG
//! instances, and watching every one) are for administrators and never allowed to a job.
//! Pure: parsing the table, and writing one as the driver does for simulated hosts.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Where the driver publishes the table.
pub const MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

/// The driver's table: access minors by (GPU minor, GI id) and (GPU minor, GI id, CI id).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors {
    gi: BTreeMap<(u32, u32), u32>,
    ci: BTreeMap<(u32, u32, u32), u32>,
}

impl MigMinors {
    /// Reads the table's text. Lines it does not know (`config`, `monitor`, anything a later
    /// driver adds) or cannot read are skipped: a slice whose minors are missing is then
    /// simply not granted them, so a job on it fails to open its slice (fails closed).
    pub fn parse(text: &str) -> MigMinors {
        let mut out = MigMinors::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(path), Some(minor), None) = (words.next(), words.next(), words.next()) else {
                continue;
            };
            let Ok(minor) = minor.parse::<u32>() else {
                continue;
            };
            let parts: Vec<&str> = path.split('/').collect();
            let id = |part: &str, prefix: &str| part.strip_prefix(prefix)?.parse::<u32>().ok();
            match parts.as_slice() {
                [gpu, gi, "access"] => {
                    if let (Some(gpu), Some(gi)) = (id(gpu, "gpu"), id(gi, "gi")) {
                        out.gi.insert((gpu, gi), minor);
                    }
                }
                [gpu, gi, ci, "access"] => {
                    if let (Some(gpu), Some(gi), Some(ci)) =
                        (id(gpu, "gpu"), id(gi, "gi"), id(ci, "ci"))
                    {
                        out.ci.insert((gpu, gi, ci), minor);
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// The capability minors a process on compute instance `ci` of GPU instance `gi` of GPU
    /// `gpu` (its minor) opens: the GI's access node and the CI's. `None` when the table
    /// lacks either.
    pub fn access(&self, gpu: u32, gi: u32, ci: u32) -> Option<[u32; 2]> {
        Some([*self.gi.get(&(gpu, gi))?, *self.ci.get(&(gpu, gi, ci))?])
    }

    pub fn is_empty(&self) -> bool {
        self.gi.is_empty() && self.ci.is_empty()
    }
}

/// GPU instances per GPU and compute instances per GPU instance the driver numbers minors
/// for (whether or not they exist): 15 × (1 + 8) minors per GPU after `config` and `monitor`.
pub const DRIVER_GIS: u32 = 15;
pub const DRIVER_CIS: u32 = 8;

/// The table as the driver writes it for GPUs `0..gpus`, for a simulated host.
pub fn driver_table(gpus: u32) -> String {
    let mut text = String::from("config 1\nmonitor 2\n");
    let mut minor = 3;
    for gpu in 0..gpus {
        for gi in 0..DRIVER_GIS {
            let _ = writeln!(text, "gpu{gpu}/gi{gi}/access {minor}");
            minor += 1;
            for ci in 0..DRIVER_CIS {
                let _ = writeln!(text, "gpu{gpu}/gi{gi}/ci{ci}/access {minor}");
                minor += 1;
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi0/ci0/access 4
gpu0/gi0/ci1/access 5
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu1/gi2/access 156
gpu1/gi2/ci3/access 160
";

    #[test]
    fn a_slice_gets_its_gpu_instances_and_its_compute_instances_access_minors() {
        let t = MigMinors::parse(SAMPLE);
        assert_eq!(t.access(0, 1, 0), Some([12, 13]));
        assert_eq!(t.access(0, 0, 1), Some([3, 5]));
        assert_eq!(t.access(1, 2, 3), Some([156, 160]));
        // Another GPU's, another GI's, a CI the table lacks: nothing.
        assert_eq!(t.access(1, 1, 0), None);
        assert_eq!(t.access(0, 1, 1), None);
        assert_eq!(t.access(2, 0, 0), None);
        assert!(!t.is_empty());
    }

    #[test]
    fn config_monitor_and_unreadable_lines_grant_nothing() {
        let t = MigMinors::parse(
            "config 1\nmonitor 2\n\ngpu0/gi1/access\ngpu0/gi1/access x\ngpuX/gi1/access 9\n\
             gpu0/giY/ci0/access 9\ngpu0/gi1/ci0/access 13 extra\ngpu0/gi1/ci0/other 14\n\
             gpu0/gi1/ci0 15\n/gpu0/gi1/access 16\ngpu0/gi1/access -3\n",
        );
        assert!(t.is_empty(), "{t:?}");
        assert!(MigMinors::parse("").is_empty());
        // A GI without its CI line (or the reverse) is not enough to run on.
        let half = MigMinors::parse("gpu0/gi1/access 12\ngpu0/gi2/ci0/access 22\n");
        assert_eq!(half.access(0, 1, 0), None);
        assert_eq!(half.access(0, 2, 0), None);
    }

    #[test]
    fn the_driver_numbering_is_reproduced_and_reads_back() {
        let text = driver_table(2);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines.len() as u32,
            2 + 2 * DRIVER_GIS * (1 + DRIVER_CIS),
            "config, monitor, then every GI and CI of each GPU"
        );
        assert_eq!(
            &lines[..4],
            [
                "config 1",
                "monitor 2",
                "gpu0/gi0/access 3",
                "gpu0/gi0/ci0/access 4"
            ]
        );
        // The driver's own example lines.
        assert!(lines.contains(&"gpu0/gi1/access 12"));
        assert!(lines.contains(&"gpu0/gi1/ci0/access 13"));
        let t = MigMinors::parse(&text);
        assert_eq!(t.access(0, 1, 0), Some([12, 13]));
        assert_eq!(t.access(1, 0, 0), Some([138, 139]));
        // Every (gpu, gi, ci) has two minors of its own, shared with no other.
        let mut seen = std::collections::BTreeSet::new();
        for gpu in 0..2 {
            for gi in 0..DRIVER_GIS {
                for ci in 0..DRIVER_CIS {
                    let [g, c] = t.access(gpu, gi, ci).expect("in the table");
                    assert!(g > 2 && c > g);
                    seen.insert((gpu, gi, g));
                    assert!(seen.insert((gpu, 99, c)), "CI minor {c} twice");
                }
            }
        }
        assert_eq!(t.access(2, 0, 0), None);
    }
}
