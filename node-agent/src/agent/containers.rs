//! Finding the host's container engine at start-up (`--containers`), so the node registers
//! what it can run: a node with no engine is never sent a container job, and one whose
//! engine vanished later fails such a job with the engine's own error in its log.

use std::path::PathBuf;
use std::time::Duration;

use crate::runtime::container::{ContainerRuntime, PullPolicy};

/// Whether the node runs container jobs (`--containers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ContainerMode {
    /// Where the engine answers at start-up; otherwise the node registers without one.
    Auto,
    /// The agent does not start without a reachable engine.
    Require,
    /// Never: container jobs are not placed on this node.
    Off,
}

/// The container options of the agent's command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerOptions {
    pub mode: ContainerMode,
    /// The engine's Unix socket (`None`: `DOCKER_HOST`, else `/var/run/docker.sock`).
    pub socket: Option<String>,
    pub mount_prefixes: Vec<PathBuf>,
    pub pull: PullPolicy,
}

impl Default for ContainerOptions {
    fn default() -> Self {
        ContainerOptions {
            mode: ContainerMode::Auto,
            socket: None,
            mount_prefixes: Vec::new(),
            pull: PullPolicy::Missing,
        }
    }
}

/// How long start-up waits for the engine to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Asks the engine for its version and cgroup driver. `Ok(None)`: no container jobs on this
/// node (off, or auto without an engine, said in the log).
pub async fn setup_containers(
    options: &ContainerOptions,
    runner_program: PathBuf,
    runner_args: Vec<String>,
    device_dir: PathBuf,
) -> anyhow::Result<Option<ContainerRuntime>> {
    if options.mode == ContainerMode::Off {
        tracing::info!("container jobs are off (--containers off)");
        return Ok(None);
    }
    let probe = async {
        let docker = crate::runtime::container_runner::connect(options.socket.as_deref()).await?;
        docker.info().await
    };
    let info = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Ok(Ok(info)) => Ok(info),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the engine did not answer within {}s",
            PROBE_TIMEOUT.as_secs()
        )),
    };
    let info = match info {
        Ok(info) => info,
        Err(e) if options.mode == ContainerMode::Require => anyhow::bail!(
            "--containers require: cannot reach the container engine ({e}). Start the Docker engine, point --container-socket at it, or use --containers auto"
        ),
        Err(e) => {
            tracing::info!(reason = %e, "no container engine: this node takes process jobs only (--containers require refuses to start instead)");
            return Ok(None);
        }
    };
    let driver = info
        .cgroup_driver
        .map(|d| d.to_string())
        .unwrap_or_default();
    let description = format!(
        "docker {} ({})",
        info.server_version.as_deref().unwrap_or("unknown"),
        if driver.is_empty() {
            "cgroup driver unknown"
        } else {
            &driver
        }
    );
    tracing::info!(engine = %description, mount_prefixes = ?options.mount_prefixes, "container jobs run through the local engine");
    Ok(Some(ContainerRuntime {
        runner_program,
        runner_args,
        socket: options.socket.clone(),
        device_dir,
        cgroupfs_driver: driver == "cgroupfs",
        mount_prefixes: options.mount_prefixes.clone(),
        pull: options.pull,
        description,
    }))
}
