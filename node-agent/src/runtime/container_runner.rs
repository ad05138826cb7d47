//! The container runner: `node-agent container-run --spec JSON`, the command a container
//! job's shim supervises (see `container.rs` for why it is shaped so). It
//!
//! 1. creates the container through the engine's API (pulling the image first if the host
//!    lacks it and the node's policy allows), named after the allocation;
//! 2. attaches to its output *before* starting it, so no line is lost, and copies stdout and
//!    stderr to its own (which the shim appended to the allocation's log files);
//! 3. forwards SIGTERM/SIGINT/SIGHUP to the container's processes: a cancel, a time limit or
//!    a fence reaches the job as it would a process job; the SIGKILL that follows a grace
//!    kills this runner and, through the allocation's cgroup, the container too;
//! 4. waits for the exit, removes the container and exits with its code (docker's own
//!    convention: 125 the engine failed, 126 not executable, 127 not found, 128+N a signal).

use std::collections::HashMap;
use std::io::Write;
use std::time::Duration;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, DeviceMapping, HostConfig, MountType};
use bollard::query_parameters as q;
use futures::StreamExt;

use super::container::{PullPolicy, RunnerSpec};

/// Exit codes of the runner itself, as `docker run` uses them.
const EXIT_ENGINE: i32 = 125;
const EXIT_NOT_EXECUTABLE: i32 = 126;
const EXIT_NOT_FOUND: i32 = 127;

/// How long a call to the engine may take before the runner gives up on it.
const ENGINE_TIMEOUT_SECS: u64 = 120;

/// The runner's entry point: `args` follow the subcommand. Returns the process exit code.
pub fn runner_main(args: Vec<String>) -> i32 {
    let spec = match args.as_slice() {
        [flag, json] if flag == "--spec" => match serde_json::from_str::<RunnerSpec>(json) {
            Ok(spec) => spec,
            Err(e) => {
                eprintln!("gpucp container-run: --spec is not a valid container spec: {e}");
                return EXIT_ENGINE;
            }
        },
        _ => {
            eprintln!("usage: node-agent container-run --spec JSON");
            return EXIT_ENGINE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpucp container-run: cannot start: {e}");
            return EXIT_ENGINE;
        }
    };
    runtime.block_on(run(spec))
}

/// Connects to the engine at `socket` (`None`: `DOCKER_HOST` or the default socket) and
/// agrees on an API version both speak (engines in the field are years apart).
pub async fn connect(socket: Option<&str>) -> Result<Docker, bollard::errors::Error> {
    let docker = match socket {
        Some(path) => {
            Docker::connect_with_unix(path, ENGINE_TIMEOUT_SECS, bollard::API_DEFAULT_VERSION)?
        }
        None => Docker::connect_with_local_defaults()?,
    };
    docker.negotiate_version().await
}

async fn run(spec: RunnerSpec) -> i32 {
    let docker = match connect(spec.socket.as_deref()).await {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpucp: cannot reach the container engine on this host: {e}");
            return EXIT_ENGINE;
        }
    };
    if let Err(code) = create(&docker, &spec).await {
        return code;
    }
    let attach = docker
        .attach_container(
            &spec.name,
            Some(
                q::AttachContainerOptionsBuilder::default()
                    .stdout(true)
                    .stderr(true)
                    .stream(true)
                    .logs(true)
                    .build(),
            ),
        )
        .await;
    let output = match attach {
        Ok(results) => results.output,
        Err(e) => {
            eprintln!("gpucp: cannot attach to container {}: {e}", spec.name);
            remove(&docker, &spec.name).await;
            return EXIT_ENGINE;
        }
    };
    let copy = tokio::spawn(copy_output(output));
    if let Err(e) = docker
        .start_container(&spec.name, None::<q::StartContainerOptions>)
        .await
    {
        let code = start_failure_code(&e.to_string());
        eprintln!("gpucp: container {} did not start: {e}", spec.name);
        remove(&docker, &spec.name).await;
        return code;
    }
    let code = wait_forwarding_signals(&docker, &spec.name).await;
    // The output stream ends when the container does; what is buffered is still written.
    let _ = tokio::time::timeout(Duration::from_secs(5), copy).await;
    if let Ok(info) = docker
        .inspect_container(&spec.name, None::<q::InspectContainerOptions>)
        .await
        && info.state.and_then(|s| s.oom_killed) == Some(true)
    {
        eprintln!("gpucp: the container was killed for exceeding its memory limit");
        if let Some(marker) = &spec.oom_marker
            && let Err(e) = std::fs::write(marker, b"")
        {
            eprintln!(
                "gpucp: cannot record the OOM kill in {}: {e}",
                marker.display()
            );
        }
    }
    remove(&docker, &spec.name).await;
    code
}

/// Creates the container, pulling its image first when the host lacks it and the policy
/// allows. `Err` holds the exit code, the reason already written to stderr.
async fn create(docker: &Docker, spec: &RunnerSpec) -> Result<(), i32> {
    let options = || {
        Some(
            q::CreateContainerOptionsBuilder::default()
                .name(&spec.name)
                .build(),
        )
    };
    let mut pulled = false;
    loop {
        match docker.create_container(options(), create_body(spec)).await {
            Ok(_) => return Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) if !pulled && spec.pull == PullPolicy::Missing => {
                eprintln!("gpucp: pulling image {} (not on this host)", spec.image);
                pull(docker, &spec.image).await?;
                pulled = true;
            }
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404,
                message,
            }) => {
                eprintln!(
                    "gpucp: image {} is not on this host ({message}); load it with `docker load` or let the node pull it (--image-pull missing)",
                    spec.image
                );
                return Err(EXIT_ENGINE);
            }
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 409, ..
            }) => {
                // A container of this allocation left by a runner killed before it could
                // remove it: it is not running this attempt, so it goes.
                remove(docker, &spec.name).await;
            }
            Err(e) => {
                eprintln!("gpucp: cannot create the container: {e}");
                return Err(EXIT_ENGINE);
            }
        }
    }
}

async fn pull(docker: &Docker, image: &str) -> Result<(), i32> {
    let mut progress = docker.create_image(
        Some(
            q::CreateImageOptionsBuilder::default()
                .from_image(image)
                .build(),
        ),
        None,
        None,
    );
    while let Some(step) = progress.next().await {
        if let Err(e) = step {
            eprintln!("gpucp: image {image} is not on this host and could not be pulled: {e}");
            return Err(EXIT_ENGINE);
        }
    }
    Ok(())
}

/// The engine's create request for `spec`.
pub(crate) fn create_body(spec: &RunnerSpec) -> ContainerCreateBody {
    let devices = spec
        .devices
        .iter()
        .map(|(host, inside)| DeviceMapping {
            path_on_host: Some(host.display().to_string()),
            path_in_container: Some(inside.display().to_string()),
            cgroup_permissions: Some("rwm".into()),
        })
        .collect();
    let mounts = spec
        .mounts
        .iter()
        .map(|m| bollard::models::Mount {
            source: Some(m.source.display().to_string()),
            target: Some(m.target.display().to_string()),
            typ: Some(MountType::BIND),
            read_only: Some(m.read_only),
            ..Default::default()
        })
        .collect();
    let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        cmd: (!spec.command.is_empty()).then(|| spec.command.clone()),
        env: Some(spec.env.clone()),
        working_dir: spec.workdir.clone(),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        labels: Some(
            spec.labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<HashMap<_, _>>(),
        ),
        host_config: Some(HostConfig {
            devices: Some(devices),
            mounts: Some(mounts),
            cgroup_parent: spec.cgroup_parent.clone(),
            memory: spec.memory_bytes.map(to_i64),
            // No swap: the memory limit is a hard limit, as for a process job.
            memory_swap: spec.memory_bytes.map(to_i64),
            nano_cpus: spec.nano_cpus.map(to_i64),
            cpuset_cpus: spec.cpuset_cpus.clone(),
            cpuset_mems: spec.cpuset_mems.clone(),
            // The other tasks of a job and their rendezvous (MASTER_ADDR) are on the hosts'
            // own addresses, as for process jobs.
            network_mode: Some("host".into()),
            shm_size: Some(to_i64(spec.shm_bytes)),
            // `--init`: a PID 1 that reaps and forwards signals, so a job's shell script
            // stops on SIGTERM as it would outside a container.
            init: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The exit code for a start that failed with `message`, as `docker run` picks it.
fn start_failure_code(message: &str) -> i32 {
    let m = message.to_ascii_lowercase();
    if m.contains("executable file not found") || m.contains("no such file or directory") {
        EXIT_NOT_FOUND
    } else if m.contains("permission denied") {
        EXIT_NOT_EXECUTABLE
    } else {
        EXIT_ENGINE
    }
}

/// Copies the container's output to the runner's stdout and stderr, flushing each chunk so
/// `gpuctl logs -f` sees lines as they come.
async fn copy_output(
    mut output: std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>,
    >,
) {
    while let Some(Ok(chunk)) = output.next().await {
        let _ = match chunk {
            LogOutput::StdErr { message } => {
                let mut err = std::io::stderr().lock();
                err.write_all(&message).and_then(|()| err.flush())
            }
            LogOutput::StdOut { message } | LogOutput::Console { message } => {
                let mut out = std::io::stdout().lock();
                out.write_all(&message).and_then(|()| out.flush())
            }
            LogOutput::StdIn { .. } => Ok(()),
        };
    }
}

/// Waits for the container to stop, forwarding SIGTERM, SIGINT and SIGHUP to it. Returns
/// its exit code.
async fn wait_forwarding_signals(docker: &Docker, name: &str) -> i32 {
    use tokio::signal::unix::{SignalKind, signal};
    // Each forwarded signal's listener feeds one channel, which the wait loop selects on.
    let (sender, mut received) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
    for (kind, name) in [
        (SignalKind::terminate(), "SIGTERM"),
        (SignalKind::interrupt(), "SIGINT"),
        (SignalKind::hangup(), "SIGHUP"),
    ] {
        match signal(kind) {
            Ok(mut listener) => {
                let sender = sender.clone();
                tokio::spawn(async move {
                    while listener.recv().await.is_some() {
                        if sender.send(name).is_err() {
                            return;
                        }
                    }
                });
            }
            Err(e) => eprintln!("gpucp: cannot forward {name} to the container: {e}"),
        }
    }
    let mut wait = docker.wait_container(
        name,
        Some(
            q::WaitContainerOptionsBuilder::default()
                .condition("not-running")
                .build(),
        ),
    );
    loop {
        tokio::select! {
            exit = wait.next() => {
                return match exit {
                    Some(Ok(response)) => i32::try_from(response.status_code).unwrap_or(EXIT_ENGINE),
                    Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => {
                        i32::try_from(code).unwrap_or(EXIT_ENGINE)
                    }
                    Some(Err(e)) => {
                        eprintln!("gpucp: lost the container engine while waiting for the container: {e}");
                        EXIT_ENGINE
                    }
                    None => {
                        eprintln!("gpucp: the container engine ended the wait without an exit code");
                        EXIT_ENGINE
                    }
                };
            }
            Some(signal) = received.recv() => {
                if let Err(e) = docker
                    .kill_container(name, Some(q::KillContainerOptionsBuilder::default().signal(signal).build()))
                    .await
                {
                    eprintln!("gpucp: cannot send {signal} to the container: {e}");
                }
            }
        }
    }
}

/// Removes the container (stopping it if it still runs); one already gone is fine.
pub async fn remove(docker: &Docker, name: &str) {
    let options = q::RemoveContainerOptionsBuilder::default()
        .force(true)
        .build();
    match docker.remove_container(name, Some(options)).await {
        Ok(()) => {}
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => {}
        // 409: removal already in progress.
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 409, ..
        }) => {}
        Err(e) => eprintln!("gpucp: cannot remove container {name}: {e}"),
    }
}

/// [`remove`] from synchronous code (the runtime's exit path).
pub fn remove_blocking(socket: Option<String>, name: String) {
    with_engine_blocking(socket, move |docker| async move {
        remove(&docker, &name).await;
    });
}

/// Removes every container whose runtime state directory is `state_dir` (label
/// `gpucp.state-dir`), running or not: a local cluster's teardown.
pub fn remove_all_of_blocking(socket: Option<String>, state_dir: &std::path::Path) {
    let label = format!("gpucp.state-dir={}", state_dir.display());
    with_engine_blocking(socket, move |docker| async move {
        let options = q::ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&HashMap::from([("label", vec![label.as_str()])]))
            .build();
        let Ok(found) = docker.list_containers(Some(options)).await else {
            return;
        };
        for name in found.into_iter().filter_map(|c| c.id) {
            remove(&docker, &name).await;
        }
    });
}

/// Runs `work` against the engine from synchronous code: on a thread of its own, since the
/// caller may already be inside an async runtime, and for at most 10 s.
fn with_engine_blocking<F, Fut>(socket: Option<String>, work: F)
where
    F: FnOnce(Docker) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let worker = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let job = async {
                match connect(socket.as_deref()).await {
                    Ok(docker) => work(docker).await,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot reach the container engine to remove containers")
                    }
                }
            };
            if tokio::time::timeout(Duration::from_secs(10), job)
                .await
                .is_err()
            {
                tracing::warn!("the container engine did not answer within 10 s");
            }
        });
    });
    let _ = worker.join();
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::super::container::Mount;
    use super::*;

    fn spec() -> RunnerSpec {
        RunnerSpec {
            name: "gpucp-7-0badf00d".into(),
            socket: None,
            image: "trainer:1".into(),
            pull: PullPolicy::Never,
            command: vec!["python".into(), "train.py".into()],
            env: vec!["CUDA_VISIBLE_DEVICES=GPU-a".into()],
            workdir: Some("/work".into()),
            devices: vec![(
                PathBuf::from("/sim/dev/nvidia3"),
                PathBuf::from("/dev/nvidia3"),
            )],
            mounts: vec![Mount {
                source: "/data/x".into(),
                target: "/x".into(),
                read_only: true,
            }],
            cgroup_parent: Some("/gpucp/host-0.1234abcd/alloc-7".into()),
            memory_bytes: None,
            nano_cpus: None,
            cpuset_cpus: None,
            cpuset_mems: None,
            shm_bytes: 1 << 30,
            labels: [("gpucp.job".to_string(), "3".to_string())].into(),
            oom_marker: None,
        }
    }

    #[test]
    fn the_create_request_maps_devices_mounts_limits_and_the_host_network() {
        let body = create_body(&spec());
        assert_eq!(body.image.as_deref(), Some("trainer:1"));
        assert_eq!(
            body.cmd.as_deref(),
            Some(&["python".to_string(), "train.py".to_string()][..])
        );
        let host = body.host_config.unwrap();
        let device = &host.devices.as_ref().unwrap()[0];
        assert_eq!(device.path_on_host.as_deref(), Some("/sim/dev/nvidia3"));
        assert_eq!(device.path_in_container.as_deref(), Some("/dev/nvidia3"));
        let mount = &host.mounts.as_ref().unwrap()[0];
        assert_eq!(mount.read_only, Some(true));
        assert_eq!(mount.typ, Some(MountType::BIND));
        assert_eq!(
            host.cgroup_parent.as_deref(),
            Some("/gpucp/host-0.1234abcd/alloc-7")
        );
        assert_eq!(host.network_mode.as_deref(), Some("host"));
        assert_eq!(host.shm_size, Some(1 << 30));
        assert_eq!(host.memory, None);
        assert_eq!(body.labels.unwrap()["gpucp.job"], "3");

        let mut own_limits = spec();
        own_limits.cgroup_parent = None;
        own_limits.memory_bytes = Some(2 << 30);
        own_limits.nano_cpus = Some(1_500_000_000);
        let host = create_body(&own_limits).host_config.unwrap();
        assert_eq!(host.memory, Some(2 << 30));
        assert_eq!(host.memory_swap, Some(2 << 30), "no swap beyond the limit");
        assert_eq!(host.nano_cpus, Some(1_500_000_000));
    }

    #[test]
    fn an_empty_command_runs_the_images_own() {
        let mut s = spec();
        s.command.clear();
        assert_eq!(create_body(&s).cmd, None);
    }

    #[test]
    fn start_failures_get_docker_runs_exit_codes() {
        assert_eq!(
            start_failure_code(
                "OCI runtime create failed: exec: \"nope\": executable file not found in $PATH"
            ),
            127
        );
        assert_eq!(start_failure_code("exec /x: permission denied"), 126);
        assert_eq!(start_failure_code("driver failed programming"), 125);
    }
}
