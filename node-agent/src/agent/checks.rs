//! One check against a service's replica, bounded by its timeout: an HTTP GET (answered
//! 2xx or 3xx), a TCP connection, or a command that exits 0; and the scrape of its
//! autoscaling gauge. Each returns `Err` with what went wrong in words (the reason a
//! NOT_READY report or a liveness restart carries).
//!
//! Where an exec check runs (the `ExecTarget` the runtime gives):
//! - a process replica: on the host, with the replica's environment and working directory,
//!   in its cgroup (joined between fork and exec, as the shim does for the replica itself),
//!   so the check is confined and accounted like the replica and killed with it; a check
//!   that outlives its timeout is killed with its process group;
//! - a container replica: inside its container through the engine's exec API (bollard), as
//!   `docker exec` does: the container's environment, working directory and user. The engine
//!   has no call to stop an exec, so a check that outlives its timeout is killed by its host
//!   pid (from the exec's inspection), which the agent, as root, may signal.
//!
//! Every address is 127.0.0.1: a replica runs on this host (in the host's network namespace
//! for a container), on host ports given to it alone.

use std::time::Duration;

use bollard::Docker;
use futures::StreamExt;
use http_body_util::BodyExt;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use proto::agent::probe_spec::Check;
use tokio::io::AsyncReadExt;

use crate::runtime::ExecTarget;

/// Most output of an exec check kept for its failure reason.
const OUTPUT_SHOWN: usize = 256;

/// The replica's side of an exec check: where it runs, and the engine client for a container
/// (connected on first use, then reused).
pub struct Exec {
    target: Option<ExecTarget>,
    docker: tokio::sync::OnceCell<Docker>,
}

impl Exec {
    /// `None`: the allocation is gone, and exec checks fail saying so.
    pub fn new(target: Option<ExecTarget>) -> Exec {
        Exec {
            target,
            docker: tokio::sync::OnceCell::new(),
        }
    }
}

/// Runs `check` once, failing it if it takes longer than `timeout`.
pub async fn run(check: &Check, timeout: Duration, exec: &Exec) -> Result<(), String> {
    match check {
        Check::Http(h) => {
            let port = port(h.port)?;
            let status = within(timeout, http_get(port, &h.path, 0)).await?.0;
            if (200..400).contains(&status) {
                Ok(())
            } else {
                Err(format!(
                    "GET http://127.0.0.1:{port}{} answered {status}",
                    h.path
                ))
            }
        }
        Check::TcpPort(p) => {
            let port = port(*p)?;
            within(timeout, async {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .map(drop)
                    .map_err(|e| format!("cannot connect to 127.0.0.1:{port}: {e}"))
            })
            .await
        }
        Check::Exec(e) => {
            let Some(program) = e.command.first() else {
                return Err("the exec check has no command".into());
            };
            match &exec.target {
                None => Err("the replica is no longer running here".into()),
                Some(ExecTarget::Host {
                    env,
                    workdir,
                    cgroup_procs,
                }) => {
                    let mut cmd = tokio::process::Command::new(program);
                    cmd.args(&e.command[1..])
                        .env_clear()
                        .envs(env)
                        .current_dir(workdir);
                    exec_on_host(cmd, cgroup_procs, timeout).await
                }
                Some(ExecTarget::Container { socket, name }) => {
                    let docker = exec
                        .docker
                        .get_or_try_init(|| async {
                            crate::runtime::container_runner::connect(socket.as_deref())
                                .await
                                .map_err(|e| format!("cannot reach the container engine: {e}"))
                        })
                        .await?;
                    exec_in_container(docker, name, &e.command, timeout).await
                }
            }
        }
    }
}

/// Scrapes `GET http://127.0.0.1:PORT/PATH` and sums gauge `metric` over its series.
pub async fn scrape(port: u32, path: &str, metric: &str, timeout: Duration) -> Result<f64, String> {
    let port = self::port(port)?;
    let (status, body) =
        within(timeout, http_get(port, path, super::gauge::MAX_PAGE_BYTES)).await?;
    if status != 200 {
        return Err(format!(
            "GET http://127.0.0.1:{port}{path} answered {status}"
        ));
    }
    let page = std::str::from_utf8(&body)
        .map_err(|_| format!("the metrics page at 127.0.0.1:{port}{path} is not UTF-8"))?;
    super::gauge::sum_gauge(page, metric)
}

fn port(p: u32) -> Result<u16, String> {
    u16::try_from(p)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| format!("{p} is not a port (the assignment names no port for the check)"))
}

async fn within<T>(
    timeout: Duration,
    f: impl Future<Output = Result<T, String>>,
) -> Result<T, String> {
    tokio::time::timeout(timeout, f)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} ms", timeout.as_millis())))
}

/// Aborts a spawned task when dropped (a check given up on its timeout leaves nothing behind).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `GET path` over HTTP/1.1 on 127.0.0.1:`port`: the status, and up to `max_body` bytes of
/// the body (0: the body is not read; a longer one is an error).
async fn http_get(port: u16, path: &str, max_body: usize) -> Result<(u16, Bytes), String> {
    let url = format!("http://127.0.0.1:{port}{path}");
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("cannot connect to 127.0.0.1:{port}: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let _connection = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, format!("127.0.0.1:{port}"))
        .header(
            hyper::header::USER_AGENT,
            concat!("gpucp-node-agent/", env!("CARGO_PKG_VERSION")),
        )
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| format!("{path:?} is not an HTTP path: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status().as_u16();
    if max_body == 0 {
        return Ok((status, Bytes::new()));
    }
    let body = http_body_util::Limited::new(response.into_body(), max_body)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                format!("GET {url}: the page is larger than {max_body} bytes")
            } else {
                format!("GET {url}: reading the page: {e}")
            }
        })?
        .to_bytes();
    Ok((status, body))
}

/// Runs an exec check on the host, in the allocation's cgroup where it has one.
async fn exec_on_host(
    mut cmd: tokio::process::Command,
    cgroup_procs: &[std::path::PathBuf],
    timeout: Duration,
) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let join: Vec<std::ffi::CString> = cgroup_procs
        .iter()
        .filter_map(|p| std::ffi::CString::new(p.as_os_str().as_bytes()).ok())
        .collect();
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        // Its own group, so that a timeout kills what it started too.
        .process_group(0)
        .kill_on_drop(true);
    if !join.is_empty() {
        // SAFETY: join_current_process makes only async-signal-safe calls (open, write,
        // close) on memory allocated before the fork.
        unsafe {
            cmd.pre_exec(move || crate::cgroup::join_current_process(&join));
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run the check's command: {e}"))?;
    let pid = child.id();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let output = async {
        let (out, err) = tokio::join!(keep_head(stdout), keep_head(stderr));
        let mut shown = out;
        shown.extend(err);
        shown
    };
    let finished = async {
        let status = child.wait().await;
        // Output a daemonised grandchild keeps open is not waited for long.
        let output = tokio::time::timeout(Duration::from_millis(100), output)
            .await
            .unwrap_or_default();
        (status, output)
    };
    match tokio::time::timeout(timeout, finished).await {
        Ok((Ok(status), output)) if status.success() => {
            let _ = output;
            Ok(())
        }
        Ok((Ok(status), output)) => Err(format!(
            "the check's command {}{}",
            match (
                status.code(),
                std::os::unix::process::ExitStatusExt::signal(&status)
            ) {
                (Some(code), _) => format!("exited with code {code}"),
                (None, Some(signal)) => format!("was killed by signal {signal}"),
                (None, None) => "ended".to_owned(),
            },
            shown_output(&output)
        )),
        Ok((Err(e), _)) => Err(format!("waiting for the check's command: {e}")),
        Err(_) => {
            if let Some(pid) = pid.and_then(|p| libc::pid_t::try_from(p).ok()) {
                // SAFETY: the group is the check's own (process_group(0) above), and the
                // child is not reaped yet (kill_on_drop reaps it), so its id is not reused.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
            }
            Err(format!(
                "the check's command did not finish within {} ms",
                timeout.as_millis()
            ))
        }
    }
}

/// Reads a pipe to its end, keeping its first [`OUTPUT_SHOWN`] bytes (the rest is read and
/// dropped, so the command never blocks on a full pipe).
async fn keep_head(pipe: Option<impl tokio::io::AsyncRead + Unpin>) -> Vec<u8> {
    let mut kept = Vec::new();
    let Some(mut pipe) = pipe else {
        return kept;
    };
    let mut buf = [0u8; 4096];
    while let Ok(n) = pipe.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let room = OUTPUT_SHOWN.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
    kept
}

fn shown_output(output: &[u8]) -> String {
    let text = String::from_utf8_lossy(output);
    let text = text.trim();
    if text.is_empty() {
        String::new()
    } else {
        format!(": {}", text.replace('\n', " | "))
    }
}

/// Runs an exec check inside container `name`, as `docker exec` does.
async fn exec_in_container(
    docker: &Docker,
    name: &str,
    command: &[String],
    timeout: Duration,
) -> Result<(), String> {
    let created = docker
        .create_exec(
            name,
            bollard::exec::CreateExecOptions::<String> {
                cmd: Some(command.to_vec()),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("cannot run the check in container {name}: {e}"))?;
    let id = created.id;
    let run = async {
        let mut shown = Vec::new();
        match docker.start_exec(&id, None).await {
            Ok(bollard::exec::StartExecResults::Attached { mut output, .. }) => {
                while let Some(Ok(chunk)) = output.next().await {
                    let bytes = chunk.into_bytes();
                    let room = OUTPUT_SHOWN.saturating_sub(shown.len());
                    shown.extend_from_slice(&bytes[..bytes.len().min(room)]);
                }
            }
            Ok(bollard::exec::StartExecResults::Detached) => {}
            Err(e) => return Err(format!("cannot start the check in container {name}: {e}")),
        }
        let inspected = docker
            .inspect_exec(&id)
            .await
            .map_err(|e| format!("cannot read the check's result in container {name}: {e}"))?;
        match inspected.exit_code {
            Some(0) => Ok(()),
            Some(code) => Err(format!(
                "the check's command exited with code {code}{}",
                shown_output(&shown)
            )),
            None => Err("the container engine did not say how the check ended".into()),
        }
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(result) => result,
        Err(_) => {
            // The engine cannot stop an exec; its host pid can be.
            if let Ok(info) = docker.inspect_exec(&id).await
                && info.running == Some(true)
                && let Some(pid) = info.pid.and_then(|p| libc::pid_t::try_from(p).ok())
                && pid > 1
            {
                // SAFETY: kill(2) on the pid the engine just named as this exec's process.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            Err(format!(
                "the check's command did not finish within {} ms",
                timeout.as_millis()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proto::agent as pa;

    use super::*;

    /// A one-shot HTTP server on a free port answering every request with `status` and
    /// `body`; returns the port.
    async fn serve(status: u16, body: &'static str) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                    let reply = format!(
                        "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(reply.as_bytes()).await;
                });
            }
        });
        port
    }

    fn http(port: u16) -> Check {
        Check::Http(pa::HttpCheck {
            port: u32::from(port),
            path: "/healthz".into(),
        })
    }

    const T: Duration = Duration::from_secs(5);

    fn host(dir: &std::path::Path) -> Exec {
        Exec::new(Some(ExecTarget::Host {
            env: BTreeMap::from([
                ("PATH".into(), crate::runtime::DEFAULT_PATH.into()),
                ("MARK".into(), "ok".into()),
            ]),
            workdir: dir.to_path_buf(),
            cgroup_procs: Vec::new(),
        }))
    }

    #[tokio::test]
    async fn http_checks_pass_on_2xx_and_3xx_and_fail_on_the_rest() {
        let none = Exec::new(None);
        for (status, ok) in [
            (200, true),
            (204, true),
            (302, true),
            (404, false),
            (503, false),
        ] {
            let port = serve(status, "").await;
            let r = run(&http(port), T, &none).await;
            assert_eq!(r.is_ok(), ok, "{status}: {r:?}");
            if let Err(e) = r {
                assert!(e.ends_with(&format!("/healthz answered {status}")), "{e}");
            }
        }
    }

    #[tokio::test]
    async fn a_closed_port_or_a_silent_server_fails_the_check_with_the_reason() {
        let none = Exec::new(None);
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let e = run(&http(closed), T, &none).await.unwrap_err();
        assert!(
            e.starts_with(&format!("cannot connect to 127.0.0.1:{closed}")),
            "{e}"
        );
        let e = run(&Check::TcpPort(u32::from(closed)), T, &none)
            .await
            .unwrap_err();
        assert!(e.contains("cannot connect"), "{e}");
        // Accepts (the kernel's backlog) but never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = silent.local_addr().expect("addr").port();
        let e = run(&http(port), Duration::from_millis(50), &none)
            .await
            .unwrap_err();
        assert_eq!(e, "no answer within 50 ms");
        assert_eq!(
            run(&Check::TcpPort(u32::from(port)), T, &none).await,
            Ok(())
        );
        let e = run(&Check::TcpPort(0), T, &none).await.unwrap_err();
        assert!(e.contains("0 is not a port"), "{e}");
    }

    #[tokio::test]
    async fn exec_checks_run_with_the_replicas_environment_and_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exec = host(dir.path());
        let sh = |script: &str| {
            Check::Exec(pa::ExecCheck {
                command: vec!["sh".into(), "-c".into(), script.into()],
            })
        };
        assert_eq!(run(&sh("test \"$MARK\" = ok"), T, &exec).await, Ok(()));
        std::fs::write(dir.path().join("alive"), "").expect("write");
        assert_eq!(run(&sh("test -e alive"), T, &exec).await, Ok(()));
        let e = run(&sh("echo not well >&2; exit 3"), T, &exec)
            .await
            .unwrap_err();
        assert_eq!(e, "the check's command exited with code 3: not well");
        let e = run(&sh("sleep 30"), Duration::from_millis(100), &exec)
            .await
            .unwrap_err();
        assert_eq!(e, "the check's command did not finish within 100 ms");
        let e = run(
            &Check::Exec(pa::ExecCheck {
                command: vec!["/no/such/program".into()],
            }),
            T,
            &exec,
        )
        .await
        .unwrap_err();
        assert!(e.starts_with("cannot run the check's command"), "{e}");
        let e = run(&sh("true"), T, &Exec::new(None)).await.unwrap_err();
        assert_eq!(e, "the replica is no longer running here");
    }

    /// Builds a `FROM scratch` image of this host's `sh` and `sleep` (and the libraries they
    /// load) with the Docker CLI, if an engine answers as root; `None` (saying why) otherwise,
    /// unless the run requires an engine (`GPUCP_REQUIRE_DOCKER=1` or `CI`, as `.ci/run`).
    fn exec_test_image() -> Option<&'static str> {
        use std::process::Command;
        const IMAGE: &str = "gpucp-test/agent-exec:1";
        // SAFETY: geteuid has no arguments and cannot fail.
        let root = unsafe { libc::geteuid() == 0 };
        let engine = Command::new("docker")
            .args(["info", "--format", "{{.ServerVersion}}"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !(root && engine) {
            let required = std::env::var("GPUCP_REQUIRE_DOCKER").is_ok_and(|v| v == "1")
                || std::env::var_os("CI").is_some();
            assert!(!required, "a Docker engine is required here but not usable");
            eprintln!("no Docker engine reachable as root here; container exec checks not run");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let rootfs = dir.path().join("root");
        std::fs::create_dir_all(rootfs.join("bin")).expect("mkdir");
        for program in ["sh", "sleep"] {
            let path = ["/bin", "/usr/bin"]
                .iter()
                .map(|d| std::path::Path::new(d).join(program))
                .find(|p| p.is_file())
                .expect("the program on this host");
            std::fs::copy(&path, rootfs.join("bin").join(program)).expect("copy");
            let ldd = Command::new("ldd").arg(&path).output().expect("ldd");
            for lib in String::from_utf8_lossy(&ldd.stdout)
                .lines()
                .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
            {
                let into = rootfs.join(lib.trim_start_matches('/'));
                std::fs::create_dir_all(into.parent().expect("a parent")).expect("mkdir");
                std::fs::copy(lib, &into).expect("copy library");
            }
        }
        std::fs::write(
            dir.path().join("Dockerfile"),
            "FROM scratch\nCOPY root/ /\n",
        )
        .expect("write");
        let built = Command::new("docker")
            .args(["build", "-q", "-t", IMAGE])
            .arg(dir.path())
            .output()
            .expect("docker build");
        assert!(
            built.status.success(),
            "{}",
            String::from_utf8_lossy(&built.stderr)
        );
        Some(IMAGE)
    }

    #[tokio::test]
    async fn exec_checks_of_a_container_replica_run_inside_it_and_are_killed_past_their_timeout() {
        use std::process::Command;
        let Some(image) = exec_test_image() else {
            return;
        };
        let name = format!("gpucp-exec-check-{}", std::process::id());
        let started = Command::new("docker")
            .args([
                "run",
                "-d",
                "--rm",
                "--network",
                "host",
                "-e",
                "MARK=inside",
            ])
            .args(["--name", &name, image, "sleep", "600"])
            .output()
            .expect("docker run");
        assert!(
            started.status.success(),
            "{}",
            String::from_utf8_lossy(&started.stderr)
        );
        let exec = Exec::new(Some(ExecTarget::Container {
            socket: None,
            name: name.clone(),
        }));
        let sh = |script: &str| {
            Check::Exec(pa::ExecCheck {
                command: vec!["sh".into(), "-c".into(), script.into()],
            })
        };
        // The container's environment, not the agent's.
        let inside = run(&sh("test \"$MARK\" = inside"), T, &exec).await;
        let failed = run(&sh("echo unwell >&2; exit 4"), T, &exec).await;
        // Past its timeout: failed, and its process (seen from the host) killed.
        let slow = run(
            &Check::Exec(pa::ExecCheck {
                command: vec!["sleep".into(), "31.25".into()],
            }),
            Duration::from_millis(500),
            &exec,
        )
        .await;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let sleeping = || {
            std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| {
                    std::fs::read(e.path().join("cmdline"))
                        .is_ok_and(|c| c == b"sleep\x0031.25\x00")
                })
        };
        while sleeping() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let left = sleeping();
        let _ = Command::new("docker").args(["rm", "-f", &name]).output();
        let gone = run(&sh("true"), T, &exec).await;
        assert_eq!(inside, Ok(()));
        assert_eq!(
            failed,
            Err("the check's command exited with code 4: unwell".into())
        );
        assert_eq!(
            slow,
            Err("the check's command did not finish within 500 ms".into())
        );
        assert!(!left, "the timed-out check still runs");
        let gone = gone.unwrap_err();
        assert!(
            gone.starts_with(&format!("cannot run the check in container {name}")),
            "{gone}"
        );
    }

    #[tokio::test]
    async fn a_scrape_sums_the_gauge_and_says_why_it_has_none() {
        let port = serve(200, "# TYPE q gauge\nq{a=\"1\"} 2\nq{a=\"2\"} 3\n").await;
        assert_eq!(scrape(u32::from(port), "/metrics", "q", T).await, Ok(5.0));
        let e = scrape(u32::from(port), "/metrics", "missing", T)
            .await
            .unwrap_err();
        assert_eq!(e, "the metrics page has no missing");
        let port = serve(500, "oops").await;
        let e = scrape(u32::from(port), "/metrics", "q", T)
            .await
            .unwrap_err();
        assert!(e.ends_with("/metrics answered 500"), "{e}");
    }
}
