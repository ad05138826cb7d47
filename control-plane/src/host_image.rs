//! A container image made of this host's own programs (`FROM scratch`, the programs and the
//! shared libraries they load), built with the local Docker engine's CLI: what the container
//! benchmark and tests run, on machines that reach no registry.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Whether the local Docker engine answers (`docker info`).
pub fn engine_available() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|out| out.status.success())
}

/// Builds image `tag` holding `programs` (looked up in /bin and /usr/bin) in `/bin`, and
/// every shared library `ldd` says they load, at the same paths.
pub fn build(tag: &str, programs: &[&str]) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let rootfs = dir.path().join("root");
    std::fs::create_dir_all(rootfs.join("bin"))?;
    let mut libraries = BTreeSet::new();
    for program in programs {
        let path = which(program)?;
        std::fs::copy(&path, rootfs.join("bin").join(program))
            .with_context(|| format!("copying {}", path.display()))?;
        let ldd = Command::new("ldd")
            .arg(&path)
            .output()
            .context("running ldd")?;
        libraries.extend(shared_libraries(&String::from_utf8_lossy(&ldd.stdout)));
    }
    for lib in libraries {
        let into = rootfs.join(lib.strip_prefix("/").unwrap_or(&lib));
        std::fs::create_dir_all(into.parent().unwrap_or(&rootfs))?;
        std::fs::copy(&lib, &into).with_context(|| format!("copying {}", lib.display()))?;
    }
    std::fs::write(
        dir.path().join("Dockerfile"),
        "FROM scratch\nCOPY root/ /\n",
    )?;
    let out = Command::new("docker")
        .args(["build", "-q", "-t", tag])
        .arg(dir.path())
        .output()
        .context("running docker build")?;
    if !out.status.success() {
        bail!(
            "docker build of {tag} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn which(program: &str) -> anyhow::Result<PathBuf> {
    ["/bin", "/usr/bin"]
        .iter()
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
        .with_context(|| format!("{program} is not in /bin or /usr/bin on this host"))
}

/// The absolute paths in `ldd` output: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)`
/// and the loader's own `/lib64/ld-linux-x86-64.so.2 (0x…)`.
fn shared_libraries(ldd: &str) -> Vec<PathBuf> {
    ldd.lines()
        .filter_map(|line| line.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_yields_each_library_and_the_loader() {
        let ldd = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f33)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f34)\n";
        assert_eq!(
            shared_libraries(ldd),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
    }
}
