//! Restarting the agent in place (`gpuctl node restart-agent`): the agent stops serving,
//! leaves every workload running under its shim, and executes the program at its path again
//! with its own arguments. After an upgrade installed a new binary at that path, the new
//! process is the new release; it keeps the pid (so systemd, a DaemonSet's container or any
//! other supervisor sees nothing) and re-adopts the workloads from the state directory, as
//! after any agent restart.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};

/// How to start this agent again: the program it was started from and its arguments.
#[derive(Debug, Clone)]
pub struct Reexec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

/// How long `PROGRAM --version` may take before the program counts as broken.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

impl Reexec {
    /// The running process's own program and arguments. `program` is resolved when the agent
    /// starts: once an upgrade replaced the file, `/proc/self/exe` names the deleted old one.
    pub fn of_this_process(program: PathBuf) -> Reexec {
        Reexec {
            program,
            args: std::env::args_os().skip(1).collect(),
        }
    }

    /// The release of the program a restart would run, from its `--version`. Refuses (and so
    /// keeps the running agent) a program that is missing, not executable, fails, or does not
    /// say a release: better a node on the old release than a node without an agent.
    pub async fn next_release(&self) -> anyhow::Result<String> {
        let program = &self.program;
        let run = tokio::process::Command::new(program)
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(VERSION_TIMEOUT, run)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "{} --version did not answer within {VERSION_TIMEOUT:?}",
                    program.display()
                )
            })?
            .with_context(|| format!("cannot run {}", program.display()))?;
        if !out.status.success() {
            bail!(
                "{} --version failed ({}): {}",
                program.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        release_from_version_output(&String::from_utf8_lossy(&out.stdout)).with_context(|| {
            format!(
                "{} --version printed no release ({:?})",
                program.display(),
                String::from_utf8_lossy(&out.stdout).trim()
            )
        })
    }

    /// Replaces this process with a new execution of the program. Returns only on failure.
    pub fn exec(&self) -> anyhow::Error {
        use std::os::unix::process::CommandExt;
        let err = std::process::Command::new(&self.program)
            .args(&self.args)
            .exec();
        anyhow::Error::new(err).context(format!("executing {} again", self.program.display()))
    }
}

/// "node-agent 0.2.0\n" → "0.2.0": the first line's last word, when it looks like a release
/// (digits, a dot, more).
pub fn release_from_version_output(text: &str) -> Option<String> {
    let word = text.lines().next()?.split_whitespace().last()?;
    let mut parts = word.split('.');
    let numeric =
        |p: Option<&str>| p.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    (numeric(parts.next()) && numeric(parts.next())).then(|| word.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_is_the_last_word_of_the_first_line() {
        assert_eq!(
            release_from_version_output("node-agent 0.2.0\n").as_deref(),
            Some("0.2.0")
        );
        assert_eq!(
            release_from_version_output("gpuctl 1.14.3-rc1\nmore").as_deref(),
            Some("1.14.3-rc1")
        );
        assert_eq!(release_from_version_output("usage: foo"), None);
        assert_eq!(release_from_version_output(""), None);
        assert_eq!(release_from_version_output("x v1.2"), None);
        assert_eq!(release_from_version_output("x 1."), None);
    }

    #[tokio::test]
    async fn a_program_that_says_no_release_is_refused_with_its_name() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let program = dir.path().join("agent");
        std::fs::write(&program, "#!/bin/sh\necho usage: agent [OPTIONS]\n").unwrap();
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let r = Reexec {
            program: program.clone(),
            args: vec![],
        };
        let err = r.next_release().await.unwrap_err().to_string();
        assert!(err.contains("--version printed no release"), "{err}");
        assert!(err.contains(&program.display().to_string()), "{err}");
        let missing = Reexec {
            program: "/nonexistent/node-agent".into(),
            args: vec![],
        };
        let err = format!("{:#}", missing.next_release().await.unwrap_err());
        assert!(err.contains("cannot run /nonexistent/node-agent"), "{err}");
    }
}
