//! Which device nodes an allocation may open: the allocated GPUs' own nodes, the NVIDIA
//! control nodes every CUDA process opens, the MIG capability nodes of its slices, and the
//! handful of pseudo-devices any program needs. Everything else is denied, so a job that
//! unsets `CUDA_VISIBLE_DEVICES` or opens `/dev/nvidia3` directly gets EPERM. Pure: the
//! rules are data, written by the v1 layer as `devices.allow` lines (and, on v2, compiled
//! into the cgroup's device program).

use std::fmt;

/// NVIDIA's fixed character-device major: `/dev/nvidia0..N` are minors 0..N, `nvidiactl` is
/// 255 and `nvidia-modeset` 254. (nvidia-uvm and nvidia-caps get dynamic majors, read from
/// `/proc/devices`.)
pub const NVIDIA_MAJOR: u32 = 195;
pub const NVIDIACTL_MINOR: u32 = 255;
pub const NVIDIA_MODESET_MINOR: u32 = 254;

/// The `nvidia-caps` major of a simulated host's MIG capability nodes: 120 is in a range
/// Linux reserves for local and experimental use (120-127, Documentation/admin-guide/
/// devices.txt), which no driver registers, so an allowed open reaches no driver (ENXIO).
pub const SIMULATED_CAPS_MAJOR: u32 = 120;

/// One rule: a character device (major, and minor or any) with read/write/mknod access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceRule {
    pub major: u32,
    /// `None`: every minor of the major.
    pub minor: Option<u32>,
}

impl fmt::Display for DeviceRule {
    /// The v1 `devices.allow` form: `c 195:0 rwm`, `c 136:* rwm`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.minor {
            Some(m) => write!(f, "c {}:{} rwm", self.major, m),
            None => write!(f, "c {}:* rwm", self.major),
        }
    }
}

const fn dev(major: u32, minor: u32) -> DeviceRule {
    DeviceRule {
        major,
        minor: Some(minor),
    }
}

/// What every process may open: null, zero, full, random, urandom, tty, console, ptmx, and
/// the pseudo-terminals (the same set runc gives a container).
pub const BASIC: [DeviceRule; 9] = [
    dev(1, 3),
    dev(1, 5),
    dev(1, 7),
    dev(1, 8),
    dev(1, 9),
    dev(5, 0),
    dev(5, 1),
    dev(5, 2),
    DeviceRule {
        major: 136,
        minor: None,
    },
];

/// The dynamic majors the NVIDIA driver registered, from `/proc/devices`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverMajors {
    pub uvm: Option<u32>,
    pub caps: Option<u32>,
}

impl DriverMajors {
    /// Reads the "Character devices:" section of `/proc/devices` text.
    pub fn parse(proc_devices: &str) -> DriverMajors {
        let mut out = DriverMajors::default();
        let chars = proc_devices
            .split("Block devices:")
            .next()
            .unwrap_or_default();
        for line in chars.lines() {
            let mut words = line.split_whitespace();
            let (Some(major), Some(name)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(major) = major.parse() else { continue };
            match name {
                "nvidia-uvm" => out.uvm = Some(major),
                "nvidia-caps" => out.caps = Some(major),
                _ => {}
            }
        }
        out
    }
}

/// The rules for an allocation: [`BASIC`], the NVIDIA control nodes, the GPUs' minors (the
/// index of `/dev/nvidiaN`), and the capability minors of its MIG slices. An allocation
/// without GPUs gets no NVIDIA node at all.
pub fn allocation_rules(
    gpu_minors: &[u32],
    mig_cap_minors: &[u32],
    majors: DriverMajors,
) -> Vec<DeviceRule> {
    let mut rules: Vec<DeviceRule> = BASIC.to_vec();
    if !gpu_minors.is_empty() {
        rules.push(dev(NVIDIA_MAJOR, NVIDIACTL_MINOR));
        rules.push(dev(NVIDIA_MAJOR, NVIDIA_MODESET_MINOR));
        rules.extend(gpu_minors.iter().map(|m| dev(NVIDIA_MAJOR, *m)));
        if let Some(uvm) = majors.uvm {
            // nvidia-uvm and nvidia-uvm-tools: minors 0 and 1.
            rules.push(DeviceRule {
                major: uvm,
                minor: None,
            });
        }
        if let Some(caps) = majors.caps {
            rules.extend(mig_cap_minors.iter().map(|m| dev(caps, *m)));
        }
    }
    rules.sort();
    rules.dedup();
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC_DEVICES: &str = "Character devices:
  1 mem
  5 /dev/tty
136 pts
195 nvidia-frontend
234 nvidia-caps
237 nvidia-uvm
510 nvidia-nvswitch

Block devices:
237 not-a-char-device
";

    #[test]
    fn the_dynamic_majors_come_from_proc_devices_character_section() {
        assert_eq!(
            DriverMajors::parse(PROC_DEVICES),
            DriverMajors {
                uvm: Some(237),
                caps: Some(234)
            }
        );
        assert_eq!(
            DriverMajors::parse("Character devices:\n  1 mem\n"),
            DriverMajors::default()
        );
    }

    #[test]
    fn an_allocation_gets_its_own_gpus_the_control_nodes_and_nothing_else() {
        let rules = allocation_rules(&[2, 3], &[], DriverMajors::parse(PROC_DEVICES));
        let lines: Vec<String> = rules.iter().map(ToString::to_string).collect();
        for want in [
            "c 195:2 rwm",
            "c 195:3 rwm",
            "c 195:255 rwm",
            "c 195:254 rwm",
            "c 237:* rwm",
            "c 1:3 rwm",
            "c 136:* rwm",
        ] {
            assert!(
                lines.iter().any(|l| l == want),
                "{want} missing from {lines:?}"
            );
        }
        for other in 0..8 {
            if other != 2 && other != 3 {
                assert!(!lines.contains(&format!("c 195:{other} rwm")), "{lines:?}");
            }
        }
        assert!(!lines.iter().any(|l| l == "c 195:* rwm"));
    }

    #[test]
    fn mig_slices_add_their_capability_nodes_and_cpu_jobs_get_no_nvidia_node() {
        let rules = allocation_rules(&[0], &[21, 22], DriverMajors::parse(PROC_DEVICES));
        assert!(rules.contains(&dev(234, 21)) && rules.contains(&dev(234, 22)));
        let cpu_only = allocation_rules(&[], &[21], DriverMajors::parse(PROC_DEVICES));
        assert_eq!(cpu_only, {
            let mut b = BASIC.to_vec();
            b.sort();
            b
        });
    }
}
