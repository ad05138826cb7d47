//! `gpuctl bench service`: long-running services on a real cluster (three replicas, `--hosts`
//! simulated 8-GPU hosts with real agents), measured as an operator of online inference would
//! judge them. Every replica runs `gpuctl demo-server`, which answers HTTP on its port
//! (readiness on `/ready`, probed every 100 ms), and every figure is taken from the control
//! plane's view (`GetService`, polled every 20 ms):
//!
//! 1. **Restart after `kill -9`** of a replica's process (`--tries` times): from the SIGKILL to
//!    the replica ready again. Each kill comes after the replica has run longer than the
//!    service's `reset_after` (1 s here), so each is a first failure, restarted at once, as
//!    the kubelet does (later failures in a row wait out the back-off by design).
//! 2. **Replacement after a host is cut off** (`--tries` times): the agent of a replica's host
//!    is SIGKILLed, so the host stops heartbeating and its processes fence themselves when
//!    their lease runs out; from the SIGKILL to the replica ready on another host. This is
//!    bounded below by the node lease plus grace (the replica flags say how long: the default
//!    is 5 s + 5 s), which is what guarantees a replica never runs in two places. The agent
//!    is started again between tries.
//! 3. **A rolling update of `--replicas` replicas** (max surge 1, max unavailable 0): the time
//!    from the update to every replica at the new revision and ready, and the fewest ready
//!    replicas seen meanwhile (target: at least replicas − max unavailable throughout).
//! 4. **Autoscaling**: a service between 1 and 4 replicas aiming at 5 queued per replica; its
//!    gauge (the demo server reads it from a file) goes from 0 to 20, and the time is taken
//!    from that write to the first new replica ready; it then goes back to 0 and the service
//!    back to 1 replica (2 s scale-down window) before the next try.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::v1 as pb;
use serde_json::json;

use super::bench::summary;
use super::output::{Format, table};
use crate::client::{Client, with_timeout};
use crate::local_cluster::{LocalCluster, free_ports};

pub struct Args {
    pub hosts: usize,
    pub tries: usize,
    pub replicas: u32,
    pub replica_args: Vec<String>,
}

/// Longest wait for any one thing to settle.
const WAIT: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(20);

pub fn run(args: Args, keep_data: Option<PathBuf>, fmt: Format) -> anyhow::Result<()> {
    if args.hosts < 2 || args.tries == 0 || args.replicas == 0 {
        bail!(
            "--hosts must be at least 2 (a replica is replaced on another host), --tries and --replicas at least 1"
        );
    }
    let tmp;
    let dir = match keep_data {
        Some(d) => {
            std::fs::create_dir_all(&d)?;
            d
        }
        None => {
            tmp = tempfile::tempdir()?;
            tmp.path().to_owned()
        }
    };
    let exe = std::env::current_exe().context("finding gpuctl's own path")?;
    let ports = free_ports(3 + args.hosts)?;
    let mut cluster = LocalCluster::new(&exe, &["replica"], &dir, "bench-service", &ports[..3]);
    cluster.extra_args = args.replica_args.clone();
    cluster.agent_program = Some((exe.clone(), vec!["agent".into()]));
    let hosts: Vec<String> = (1..=args.hosts).map(|i| format!("host-{i}")).collect();
    for (name, port) in hosts.iter().zip(&ports[3..]) {
        // The fence grace must stay well under the control plane's node grace, which
        // --replica-args may shorten.
        cluster.add_agent(
            name,
            "dgx-h100",
            *port,
            &["--stop-grace-secs", "1", "--fence-grace-ms", "500"],
        );
    }
    cluster.start_all()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(measure(&mut cluster, &hosts, &args, &exe, &dir));
    let (text, json) = result.with_context(|| {
        format!(
            "the service benchmark failed; the replicas' and agents' logs are in {}",
            dir.display()
        )
    })?;
    match fmt {
        Format::Json | Format::Yaml => println!("{json}"),
        Format::Table | Format::Wide => print!("{text}"),
    }
    Ok(())
}

async fn measure(
    cluster: &mut LocalCluster,
    hosts: &[String],
    args: &Args,
    exe: &Path,
    dir: &Path,
) -> anyhow::Result<(String, serde_json::Value)> {
    cluster.wait_for_leader(WAIT).await?;
    for h in hosts {
        cluster.start_agent(h)?;
    }
    let mut client = cluster.client()?;
    if let Err(e) = wait_hosts(&mut client, hosts).await {
        // Say why, from the agent itself (a refused registration names its reason).
        let why: Vec<String> = hosts
            .iter()
            .filter_map(|h| {
                let log = cluster.agent_log(h);
                let last = log
                    .lines()
                    .rev()
                    .find(|l| l.contains("WARN") || l.contains("ERROR"))?;
                Some(format!("{h}: {}", last.trim()))
            })
            .collect();
        return Err(e.context(why.join("\n")));
    }
    let demo = |name: &str, replicas: u32, extra: &[&str]| demo_spec(exe, name, replicas, extra);

    eprintln!("1/4: kill -9 of a replica's process, {} tries", args.tries);
    put(&mut client, demo("restart", 1, &[])).await?;
    wait_until(&mut client, "restart", |s| all_ready(s, 1)).await?;
    let mut restart_ms = Vec::new();
    for _ in 0..args.tries {
        let s = get(&mut client, "restart").await?;
        let r = &s.replicas[0];
        // Past the service's reset-after: this failure is a first one.
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let pid = replica_pid(&r.endpoint).await?;
        let restarts = r.restarts;
        let t0 = Instant::now();
        // SAFETY: kill(2) with the pid the replica itself reported.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            bail!("could not kill the replica's process {pid}");
        }
        wait_until(&mut client, "restart", |s| {
            s.replicas
                .first()
                .is_some_and(|r| r.restarts > restarts && r.ready)
        })
        .await?;
        restart_ms.push(ms(t0.elapsed()));
    }

    eprintln!("2/4: a replica's host cut off, {} tries", args.tries);
    put(&mut client, demo("failover", 1, &[])).await?;
    wait_until(&mut client, "failover", |s| all_ready(s, 1)).await?;
    let mut replace_ms = Vec::new();
    for _ in 0..args.tries {
        let s = get(&mut client, "failover").await?;
        let node = s.replicas[0].node.clone();
        let t0 = Instant::now();
        cluster.kill_agent(&node)?;
        wait_until(&mut client, "failover", |s| {
            s.replicas
                .first()
                .is_some_and(|r| r.ready && !r.node.is_empty() && r.node != node)
        })
        .await?;
        replace_ms.push(ms(t0.elapsed()));
        cluster.start_agent(&node)?;
        wait_hosts(&mut client, hosts).await?;
    }

    eprintln!("3/4: a rolling update of {} replicas", args.replicas);
    put(
        &mut client,
        demo("roll", args.replicas, &["--message", "v1"]),
    )
    .await?;
    wait_until(&mut client, "roll", |s| {
        all_ready(s, args.replicas as usize)
    })
    .await?;
    let t0 = Instant::now();
    put(
        &mut client,
        demo("roll", args.replicas, &["--message", "v2"]),
    )
    .await?;
    let mut min_ready = u32::MAX;
    let mut max_copies = 0usize;
    loop {
        let s = get(&mut client, "roll").await?;
        min_ready = min_ready.min(s.ready);
        max_copies = max_copies.max(s.replicas.len());
        if s.revision == 2 && s.updated == args.replicas && all_ready(&s, args.replicas as usize) {
            break;
        }
        if t0.elapsed() > WAIT * 3 {
            bail!("the rolling update did not finish: {s:?}");
        }
        tokio::time::sleep(POLL).await;
    }
    let rollout_ms = ms(t0.elapsed());

    let tries = args.tries.min(5);
    eprintln!("4/4: autoscaling, {tries} tries");
    let queue = dir.join("queue-length");
    std::fs::write(&queue, "0")?;
    let mut spec = demo("auto", 1, &["--queue-file", &queue.display().to_string()]);
    spec.autoscale = Some(pb::Autoscale {
        min: 1,
        max: 4,
        metric: "queue_length".into(),
        target: 5.0,
        scale_down_window_ms: Some(2_000),
        ..Default::default()
    });
    put(&mut client, spec).await?;
    wait_until(&mut client, "auto", |s| all_ready(s, 1)).await?;
    let mut autoscale_ms = Vec::new();
    for _ in 0..tries {
        let t0 = Instant::now();
        std::fs::write(&queue, "20")?;
        wait_until(&mut client, "auto", |s| s.ready >= 2).await?;
        autoscale_ms.push(ms(t0.elapsed()));
        wait_until(&mut client, "auto", |s| all_ready(s, 4)).await?;
        std::fs::write(&queue, "0")?;
        wait_until(&mut client, "auto", |s| all_ready(s, 1)).await?;
    }

    let j = json!({
        "benchmark": "service",
        "hosts": hosts.len(),
        "replica_args": args.replica_args,
        "restart_after_kill_ms": summary(restart_ms),
        "replace_after_host_cut_off_ms": summary(replace_ms),
        "rolling_update": {
            "replicas": args.replicas,
            "max_surge": 1,
            "max_unavailable": 0,
            "ms": rollout_ms,
            "min_ready": min_ready,
            "max_copies": max_copies,
        },
        "autoscale_to_new_replica_ready_ms": summary(autoscale_ms),
    });
    let row = |name: &str, v: &serde_json::Value| {
        vec![
            name.to_owned(),
            v["n"].to_string(),
            format!("{:.0}", v["p50"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.0}", v["p99"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.0}", v["max"].as_f64().unwrap_or(f64::NAN)),
        ]
    };
    let text = format!(
        "services on 3 replicas and {} simulated 8-GPU hosts (real agents, `gpuctl demo-server` replicas){}\n{}\nrolling update of {} replicas (surge 1, unavailable 0): {:.1} s, at least {} ready throughout (target {}), at most {} copies\n",
        hosts.len(),
        if args.replica_args.is_empty() {
            String::new()
        } else {
            format!("; replicas run with {}", args.replica_args.join(" "))
        },
        table(
            &["FROM", "N", "P50_MS", "P99_MS", "MAX_MS"],
            &[
                row(
                    "kill -9 of a replica to ready again",
                    &j["restart_after_kill_ms"]
                ),
                row(
                    "host cut off to replaced and ready",
                    &j["replace_after_host_cut_off_ms"]
                ),
                row(
                    "gauge over target to a new replica ready",
                    &j["autoscale_to_new_replica_ready_ms"]
                ),
            ],
        ),
        args.replicas,
        rollout_ms / 1000.0,
        min_ready,
        args.replicas,
        max_copies,
    );
    Ok((text, j))
}

/// A service of `replicas` demo servers, each half a GPU, with readiness probed every 100 ms.
fn demo_spec(exe: &Path, name: &str, replicas: u32, extra: &[&str]) -> pb::ServiceSpec {
    let mut command = vec![exe.display().to_string(), "demo-server".to_owned()];
    command.extend(extra.iter().map(|a| a.to_string()));
    pb::ServiceSpec {
        tenant: String::new(),
        name: name.into(),
        template: Some(pb::JobSpec {
            command,
            gpus_per_task: 1,
            gpu_milli: 500,
            ports: vec!["http".into()],
            ..Default::default()
        }),
        replicas,
        readiness: Some(pb::ServiceProbe {
            check: Some(pb::service_probe::Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: "/ready".into(),
            })),
            period_ms: 100,
            ..Default::default()
        }),
        liveness: None,
        strategy: None,
        restart: Some(pb::RestartPolicy {
            backoff_initial_ms: 1_000,
            backoff_max_ms: 10_000,
            crash_loop_after: 5,
            reset_after_ms: 1_000,
        }),
        autoscale: None,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn all_ready(s: &pb::Service, n: usize) -> bool {
    s.replicas.len() == n && s.replicas.iter().all(|r| r.ready) && s.rollout == "complete"
}

async fn put(client: &mut Client, spec: pb::ServiceSpec) -> anyhow::Result<pb::Service> {
    let req = pb::PutServiceRequest {
        spec: Some(spec),
        create_only: false,
    };
    Ok(client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.put_service(with_timeout(r, t)).await }
        })
        .await?)
}

async fn get(client: &mut Client, name: &str) -> anyhow::Result<pb::Service> {
    let req = pb::GetServiceRequest {
        service: Some(pb::ServiceName {
            tenant: String::new(),
            name: name.into(),
        }),
        read: None,
    };
    Ok(client
        .call(|mut c, t| {
            let r = req.clone();
            async move { c.get_service(with_timeout(r, t)).await }
        })
        .await?)
}

async fn wait_until(
    client: &mut Client,
    name: &str,
    done: impl Fn(&pb::Service) -> bool,
) -> anyhow::Result<pb::Service> {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = get(client, name).await?;
        if done(&s) {
            return Ok(s);
        }
        if Instant::now() > deadline {
            bail!("service {name} did not settle within {WAIT:?}: {s:?}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Every host registered and ready under the current cluster version.
async fn wait_hosts(client: &mut Client, hosts: &[String]) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT;
    loop {
        let nodes = client
            .call(|mut c, t| async move {
                c.list_nodes(with_timeout(pb::ListNodesRequest { read: None }, t))
                    .await
            })
            .await?
            .nodes;
        let ready = hosts.iter().all(|h| {
            nodes.iter().any(|n| {
                n.name == *h
                    && n.status == "ready"
                    && !n.agent_release.is_empty()
                    && !n.service_ports.is_empty()
            })
        });
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the hosts did not register: {nodes:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replica's process id, as its demo server says at `/` (`pid=N`).
async fn replica_pid(endpoint: &str) -> anyhow::Result<i32> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(endpoint)
        .await
        .with_context(|| format!("connecting to the replica at {endpoint}"))?;
    s.write_all(
        format!("GET / HTTP/1.1\r\nHost: {endpoint}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut answer)).await??;
    answer
        .split_whitespace()
        .find_map(|w| w.strip_prefix("pid="))
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("the replica at {endpoint} did not say its pid: {answer:?}"))
}
