//! The agent picks the dedicated `gpucp-shim` beside its executable only when that shim was
//! built from the same sources; otherwise it runs its own executable's `shim` subcommand.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use node_agent::runtime::{SHIM_EXECUTABLE, SHIM_PROTOCOL, shim_command};

/// A directory with a stand-in agent executable and, when given, `shim` linked in as
/// `gpucp-shim` (links, not copies: a freshly written executable can fail to start with
/// ETXTBSY while other test threads fork).
fn agent_dir(shim: Option<&Path>) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let agent = dir.path().join("node-agent");
    std::fs::write(&agent, "").unwrap();
    if let Some(shim) = shim {
        symlink(shim, dir.path().join(SHIM_EXECUTABLE)).unwrap();
    }
    (dir, agent)
}

#[test]
fn the_real_shim_answers_with_this_builds_protocol_and_is_used() {
    let shim = Path::new(env!("CARGO_BIN_EXE_gpucp-shim"));
    let out = std::process::Command::new(shim)
        .arg("--protocol")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SHIM_PROTOCOL.to_string()
    );
    let (dir, agent) = agent_dir(Some(shim));
    let (program, args) = shim_command(agent, "shim");
    assert_eq!(program, dir.path().join(SHIM_EXECUTABLE));
    assert!(args.is_empty(), "the dedicated shim takes no subcommand");
}

#[test]
fn a_shim_that_answers_otherwise_or_none_at_all_is_not_used() {
    // `echo --protocol` answers "--protocol": a program that is not this build's shim.
    let (_dir, agent) = agent_dir(Some(Path::new("/bin/echo")));
    assert_eq!(
        shim_command(agent.clone(), "shim"),
        (agent, vec!["shim".to_owned()])
    );
    let (_dir, agent) = agent_dir(Some(Path::new("/bin/false")));
    assert_eq!(
        shim_command(agent.clone(), "shim"),
        (agent, vec!["shim".to_owned()])
    );
    let (_dir, agent) = agent_dir(None);
    assert_eq!(
        shim_command(agent.clone(), "shim"),
        (agent, vec!["shim".to_owned()])
    );
}
