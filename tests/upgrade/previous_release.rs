//! The previous release's binaries, built from this repository's own history by
//! `build-previous-release.sh` into a target directory of their own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Names the previous release: the next release bumps this one file.
const PREVIOUS_RELEASE_FILE: &str = "tests/upgrade/PREVIOUS_RELEASE";
const BUILD_SCRIPT: &str = "tests/upgrade/build-previous-release.sh";

pub struct PreviousRelease {
    pub commit: String,
    pub control_plane: PathBuf,
    /// `node-agent`, which is also the shim of the workloads it starts.
    pub node_agent: PathBuf,
    /// How long materialising and building took (a no-op build when already built).
    pub build_time: Duration,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("control-plane/ sits in the repository root")
        .to_owned()
}

/// The target directory this test was built into (`$CARGO_TARGET_DIR` or `target`): the
/// directory above the profile directory that holds the test's own binaries.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_control-plane"))
        .parent()
        .and_then(Path::parent)
        .expect("binaries live in <target>/<profile>/")
        .to_owned()
}

/// The commit named in PREVIOUS_RELEASE (its first line that is neither blank nor a comment).
fn previous_commit(root: &Path) -> String {
    let path = root.join(PREVIOUS_RELEASE_FILE);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or_else(|| panic!("{} names no commit", path.display()))
        .to_owned()
}

/// Builds (or finds already built) the previous release's `control-plane` and `node-agent`
/// under `<target>/previous-release`. Fails, never skips, when the commit is not in the clone:
/// the script's message says how to fetch it.
pub fn build() -> PreviousRelease {
    let root = repo_root();
    let commit = previous_commit(&root);
    let out = target_dir().join("previous-release");
    let started = Instant::now();
    let run = Command::new("bash")
        .arg(root.join(BUILD_SCRIPT))
        .arg(&commit)
        .arg(&out)
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("cannot run bash {BUILD_SCRIPT}: {e}"));
    let build_time = started.elapsed();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "building the previous release ({commit}) failed ({}):\n{}",
        run.status,
        tail(&stderr, 60)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    let bin_dir = PathBuf::from(
        stdout
            .lines()
            .last()
            .unwrap_or_else(|| panic!("{BUILD_SCRIPT} printed no binary directory")),
    );
    let release = PreviousRelease {
        commit,
        control_plane: bin_dir.join("control-plane"),
        node_agent: bin_dir.join("node-agent"),
        build_time,
    };
    for bin in [&release.control_plane, &release.node_agent] {
        assert!(bin.is_file(), "{BUILD_SCRIPT} built no {}", bin.display());
    }
    println!(
        "previous release {} built in {:.1} s (into {})",
        release.commit,
        build_time.as_secs_f64(),
        out.display()
    );
    release
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
