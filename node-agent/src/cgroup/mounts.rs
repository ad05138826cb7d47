//! Which cgroup hierarchy a host runs, from `/proc/self/mountinfo`: cgroup v2 alone (the
//! unified hierarchy, current distributions), cgroup v1 (one mount per controller, or several
//! controllers on one mount such as `cpu,cpuacct`), or both ("hybrid": v1 controllers plus a
//! v2 mount that holds none of them). The choice is pure: [`choose`] decides from the parsed
//! mounts and the controllers the v2 root offers, and says why when nothing usable is there.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// A v1 controller the enforcement uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum V1Controller {
    Memory,
    Cpu,
    Cpuacct,
    Cpuset,
    Devices,
    Freezer,
    Pids,
}

impl V1Controller {
    pub const ALL: [V1Controller; 7] = [
        V1Controller::Memory,
        V1Controller::Cpu,
        V1Controller::Cpuacct,
        V1Controller::Cpuset,
        V1Controller::Devices,
        V1Controller::Freezer,
        V1Controller::Pids,
    ];

    pub fn name(self) -> &'static str {
        match self {
            V1Controller::Memory => "memory",
            V1Controller::Cpu => "cpu",
            V1Controller::Cpuacct => "cpuacct",
            V1Controller::Cpuset => "cpuset",
            V1Controller::Devices => "devices",
            V1Controller::Freezer => "freezer",
            V1Controller::Pids => "pids",
        }
    }

    /// Without these an allocation cannot be confined (devices, memory), stopped as a whole
    /// (freezer) or accounted (cpuacct); the others only limit more.
    pub fn required(self) -> bool {
        matches!(
            self,
            V1Controller::Memory
                | V1Controller::Devices
                | V1Controller::Freezer
                | V1Controller::Cpuacct
                | V1Controller::Cpu
        )
    }
}

/// v2 controllers the enforcement uses (devices are an eBPF program, not a controller).
pub const V2_CONTROLLERS: [&str; 4] = ["memory", "cpu", "cpuset", "pids"];

/// One cgroup mount from mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    pub mount_point: PathBuf,
    /// `cgroup2`, or `cgroup` (v1).
    pub v2: bool,
    /// v1: the controllers in the super options (`rw,cpu,cpuacct` → cpu, cpuacct).
    pub controllers: Vec<String>,
}

/// Parses `/proc/self/mountinfo`: fields before ` - ` are the mount's, after it the
/// filesystem type, source and super options. Lines that are not cgroup mounts are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            let mount_point = mount.split_whitespace().nth(4)?;
            let mut fs = fs.split_whitespace();
            let fstype = fs.next()?;
            let _source = fs.next();
            let options = fs.next().unwrap_or("");
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            let controllers = if v2 {
                Vec::new()
            } else {
                options
                    .split(',')
                    .filter(|o| V1Controller::ALL.iter().any(|c| c.name() == *o))
                    .map(str::to_owned)
                    .collect()
            };
            Some(CgroupMount {
                mount_point: unescape_octal(mount_point).into(),
                v2,
                controllers,
            })
        })
        .collect()
}

/// mountinfo writes spaces and other bytes in paths as `\040`-style octal escapes.
fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The hierarchy enforcement will use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// v1: where each controller is mounted.
    V1 {
        controllers: BTreeMap<V1Controller, PathBuf>,
    },
    /// v2: the unified hierarchy's mount point.
    V2 { root: PathBuf },
}

impl Hierarchy {
    pub fn name(&self) -> &'static str {
        match self {
            Hierarchy::V1 { .. } => "cgroup v1",
            Hierarchy::V2 { .. } => "cgroup v2",
        }
    }
}

/// Picks the hierarchy: v2 when a v2 mount offers every controller of [`V2_CONTROLLERS`]
/// (`v2_controllers` reads a mount's `cgroup.controllers`), else v1 when every required v1
/// controller is mounted, else an error naming what is missing.
pub fn choose(
    mounts: &[CgroupMount],
    v2_controllers: impl Fn(&std::path::Path) -> Option<String>,
) -> Result<Hierarchy, String> {
    let mut v2_seen = Vec::new();
    for m in mounts.iter().filter(|m| m.v2) {
        let offered = v2_controllers(&m.mount_point).unwrap_or_default();
        let offered: Vec<&str> = offered.split_whitespace().collect();
        if V2_CONTROLLERS.iter().all(|c| offered.contains(c)) {
            return Ok(Hierarchy::V2 {
                root: m.mount_point.clone(),
            });
        }
        v2_seen.push(format!(
            "{} offers [{}]",
            m.mount_point.display(),
            offered.join(" ")
        ));
    }
    let mut controllers = BTreeMap::new();
    for m in mounts.iter().filter(|m| !m.v2) {
        for c in V1Controller::ALL {
            if m.controllers.iter().any(|n| n == c.name()) {
                controllers
                    .entry(c)
                    .or_insert_with(|| m.mount_point.clone());
            }
        }
    }
    let missing: Vec<&str> = V1Controller::ALL
        .iter()
        .filter(|c| c.required() && !controllers.contains_key(c))
        .map(|c| c.name())
        .collect();
    if missing.is_empty() {
        return Ok(Hierarchy::V1 { controllers });
    }
    let v2 = if v2_seen.is_empty() {
        "no cgroup v2 mount".to_owned()
    } else {
        format!(
            "cgroup v2 lacks some of [{}] ({})",
            V2_CONTROLLERS.join(" "),
            v2_seen.join("; ")
        )
    };
    Err(format!(
        "no usable cgroup hierarchy: {v2}, and cgroup v1 lacks the {} controller(s)",
        missing.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This kind of machine: v1 controllers, one per mount, and a v2 mount with hugetlb only.
    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    /// A current distribution: the unified hierarchy only.
    const UNIFIED: &str = "\
25 23 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    /// Older distributions: cpu and cpuacct share a mount.
    const V1_COMBINED: &str = "\
30 24 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:12 - cgroup cgroup rw,cpu,cpuacct
31 24 0:27 / /sys/fs/cgroup/memory rw,nosuid shared:13 - cgroup cgroup rw,memory
32 24 0:28 / /sys/fs/cgroup/devices rw,nosuid shared:14 - cgroup cgroup rw,devices
33 24 0:29 / /sys/fs/cgroup/freezer rw,nosuid shared:15 - cgroup cgroup rw,freezer
";

    fn offers(list: &'static str) -> impl Fn(&std::path::Path) -> Option<String> {
        move |_| Some(list.to_owned())
    }

    #[test]
    fn a_hybrid_host_uses_v1_because_its_v2_mount_holds_no_controller() {
        let mounts = parse_mountinfo(HYBRID);
        assert_eq!(mounts.len(), 9, "the tmpfs is not a cgroup mount");
        let h = choose(&mounts, offers("hugetlb")).unwrap();
        let Hierarchy::V1 { controllers } = h else {
            panic!("v1 expected")
        };
        assert_eq!(controllers.len(), 7);
        assert_eq!(
            controllers[&V1Controller::Memory],
            PathBuf::from("/sys/fs/cgroup/memory")
        );
    }

    #[test]
    fn a_unified_host_uses_v2() {
        let h = choose(
            &parse_mountinfo(UNIFIED),
            offers("cpuset cpu io memory hugetlb pids rdma misc"),
        )
        .unwrap();
        assert_eq!(
            h,
            Hierarchy::V2 {
                root: "/sys/fs/cgroup".into()
            }
        );
    }

    #[test]
    fn combined_v1_mounts_serve_each_of_their_controllers() {
        let h = choose(&parse_mountinfo(V1_COMBINED), |_| None).unwrap();
        let Hierarchy::V1 { controllers } = h else {
            panic!("v1 expected")
        };
        assert_eq!(
            controllers[&V1Controller::Cpu],
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")
        );
        assert_eq!(
            controllers[&V1Controller::Cpuacct],
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")
        );
        assert!(!controllers.contains_key(&V1Controller::Pids));
    }

    #[test]
    fn nothing_usable_is_explained() {
        let err = choose(&parse_mountinfo(UNIFIED), offers("cpu io")).unwrap_err();
        assert!(
            err.contains("cgroup v2 lacks some of [memory cpu cpuset pids]"),
            "{err}"
        );
        assert!(err.contains("/sys/fs/cgroup offers [cpu io]"), "{err}");
        assert!(
            err.contains("cgroup v1 lacks the memory, cpu, cpuacct, devices, freezer"),
            "{err}"
        );
        let err = choose(&[], |_| None).unwrap_err();
        assert!(err.contains("no cgroup v2 mount"), "{err}");
    }

    #[test]
    fn escaped_mount_points_are_decoded() {
        let m = parse_mountinfo(
            "1 0 0:1 / /mnt/my\\040cgroups rw - cgroup2 cgroup2 rw\n\
             malformed line\n\
             2 0 0:2 / /proc rw - proc proc rw\n",
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/my cgroups"));
    }
}
