//! Installing a peer's programs from Debian's packages, for the benchmarks that measure a peer
//! side by side with this control plane (Slurm for `bench e2e`, etcd for `bench submit
//! --etcd-compare`): nothing is installed by hand on a fresh machine, and nothing at all when
//! the programs are already there.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::bail;

/// `name` on `PATH` or in the system's program directories.
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Installs `packages` with apt-get when one of `programs` is missing (`peer` names them in
/// messages; `otherwise` says how to run the benchmark without them).
pub fn ensure_installed(
    peer: &str,
    programs: &[&str],
    packages: &[&str],
    otherwise: &str,
) -> anyhow::Result<()> {
    if programs.iter().all(|p| find_program(p).is_some()) {
        return Ok(());
    }
    let command = format!("apt-get install -y {}", packages.join(" "));
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "{peer} is not installed and installing it needs root: run `{command}` as root (or run this benchmark as root), or {otherwise}"
        );
    }
    eprintln!("{peer}: installing {} with apt-get...", packages.join(" "));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()
    };
    let ok = install().is_ok_and(|s| s.success())
        || (Command::new("apt-get")
            .arg("update")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
            && install().is_ok_and(|s| s.success()));
    let missing: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|p| find_program(p).is_none())
        .collect();
    if !ok || !missing.is_empty() {
        bail!(
            "could not install {peer} (`{command}` failed or left {missing:?} missing); install it by hand, or {otherwise}"
        );
    }
    Ok(())
}
