//! `gpuctl bench submit --etcd-compare`: committed writes of this control plane side by side
//! with etcd, the Raft store under Kubernetes, in one run on one machine. etcd is installed
//! from Debian's packages when missing (`etcd-server`), started as three members on loopback
//! with its defaults (every write fsynced to its WAL on a quorum before it is acknowledged,
//! as our log is), and driven over its own gRPC API (`proto/proto/etcd_kv.proto`) with puts
//! of a value the size of one of our submission log entries. Each client count runs our
//! closed loop (`bench_submit_closed`) and then etcd's, both with one connection per client
//! spread over the three members, so the two see the same machine within seconds of each
//! other. The members are stopped at the end, on error too (they are this process's
//! children, killed on drop).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use proto::etcd::kv_client::KvClient;
use proto::etcd::{PutRequest, RangeRequest};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

use super::bench_submit_closed::{ClosedRun, closed_loop, run_one};
use super::output::table;
use crate::local_cluster::{LocalCluster, free_ports};

/// Three members, on loopback, killed when dropped.
pub struct EtcdCluster {
    members: Vec<Child>,
    /// Each member's client URL, `http://127.0.0.1:PORT`.
    pub client_urls: Vec<String>,
    pub version: String,
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            let _ = m.kill();
            let _ = m.wait();
        }
    }
}

const START_TIMEOUT: Duration = Duration::from_secs(60);

impl EtcdCluster {
    /// Installs etcd if needed and starts three members with data under `dir`.
    pub async fn start(dir: &Path) -> anyhow::Result<EtcdCluster> {
        super::apt::ensure_installed(
            "etcd",
            &["etcd"],
            &["etcd-server"],
            "run bench submit without --etcd-compare",
        )?;
        let etcd = super::apt::find_program("etcd").context("etcd is not installed")?;
        let version = Command::new(&etcd)
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_else(|| "etcd (version unknown)".into());
        let ports = free_ports(6)?;
        let peer = |i: usize| format!("http://127.0.0.1:{}", ports[3 + i]);
        let initial: Vec<String> = (0..3).map(|i| format!("m{i}={}", peer(i))).collect();
        let client_urls: Vec<String> = (0..3)
            .map(|i| format!("http://127.0.0.1:{}", ports[i]))
            .collect();
        let mut cluster = EtcdCluster {
            members: Vec::new(),
            client_urls: client_urls.clone(),
            version,
        };
        for (i, client_url) in client_urls.iter().enumerate() {
            let data = dir.join(format!("etcd-m{i}"));
            std::fs::create_dir_all(&data)
                .with_context(|| format!("creating {}", data.display()))?;
            let log = std::fs::File::create(dir.join(format!("etcd-m{i}.log")))?;
            let child = Command::new(&etcd)
                .arg("--name")
                .arg(format!("m{i}"))
                .arg("--data-dir")
                .arg(&data)
                .arg("--listen-client-urls")
                .arg(client_url)
                .arg("--advertise-client-urls")
                .arg(client_url)
                .arg("--listen-peer-urls")
                .arg(peer(i))
                .arg("--initial-advertise-peer-urls")
                .arg(peer(i))
                .arg("--initial-cluster")
                .arg(initial.join(","))
                .arg("--initial-cluster-state")
                .arg("new")
                .arg("--initial-cluster-token")
                .arg("gpucp-bench")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {}", etcd.display()))?;
            cluster.members.push(child);
        }
        cluster.wait_ready(dir).await?;
        Ok(cluster)
    }

    /// Waits until a linearizable read answers on every member (a leader was elected and
    /// every member follows it).
    async fn wait_ready(&mut self, dir: &Path) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        for (i, url) in self.client_urls.clone().iter().enumerate() {
            loop {
                if let Some(status) = self.members[i].try_wait()? {
                    bail!(
                        "etcd member m{i} exited with {status} while starting: see {}",
                        dir.join(format!("etcd-m{i}.log")).display()
                    );
                }
                let ready = async {
                    let mut kv = KvClient::new(channel(url)?);
                    kv.range(RangeRequest {
                        key: b"/ready".to_vec(),
                        count_only: true,
                        ..Default::default()
                    })
                    .await?;
                    anyhow::Ok(())
                };
                if tokio::time::timeout(Duration::from_secs(2), ready)
                    .await
                    .is_ok_and(|r| r.is_ok())
                {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "etcd member m{i} did not answer within {} s: see {}",
                        START_TIMEOUT.as_secs(),
                        dir.join(format!("etcd-m{i}.log")).display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

fn channel(url: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_lazy())
}

/// `clients` closed-loop clients putting `value` under keys of their own, spread over the
/// members.
pub async fn put_loop(
    etcd: &EtcdCluster,
    clients: usize,
    duration: Duration,
    value: &[u8],
    prefix: &str,
) -> anyhow::Result<ClosedRun> {
    let urls = etcd.client_urls.clone();
    let value = value.to_vec();
    let prefix = prefix.to_owned();
    closed_loop(
        clients,
        duration,
        |c| Ok((KvClient::new(channel(&urls[c % urls.len()])?), c)),
        move |(mut kv, c): (KvClient<Channel>, usize), i| {
            let put = PutRequest {
                key: format!("/bench/{prefix}/c{c}/{i}").into_bytes(),
                value: value.clone(),
                lease: 0,
            };
            async move {
                let ok = kv.put(put).await.is_ok();
                ((kv, c), ok)
            }
        },
    )
    .await
}

/// The size of one submission's log entry: the value etcd is given, so both store as much
/// per write.
pub fn job_sized_value() -> Vec<u8> {
    let spec =
        crate::api::convert::job_spec_from_proto(super::bench::submit_request(0, "bench").spec)
            .unwrap_or_default();
    let entry = crate::state::Request::new(
        crate::replica::now_ms(),
        crate::state::Command::submit(spec, Some("bench-closed-0-c0-0".into())),
    );
    // A log entry is the request's JSON (its envelope names the format).
    let len = serde_json::to_vec(&entry).map_or(256, |b| b.len());
    vec![b'x'; len]
}

/// Ours and etcd's, per client count, side by side.
pub async fn run(
    cluster: &LocalCluster,
    clients: &[usize],
    duration: Duration,
    dir: &Path,
) -> anyhow::Result<(String, serde_json::Value)> {
    let value = job_sized_value();
    let etcd_dir: PathBuf = dir.join("etcd");
    std::fs::create_dir_all(&etcd_dir)?;
    let etcd = EtcdCluster::start(&etcd_dir).await?;
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    for (k, &n) in clients.iter().enumerate() {
        let ours = run_one(cluster, n, duration, &format!("vs-etcd-{k}")).await?;
        let theirs = put_loop(&etcd, n, duration, &value, &format!("r{k}")).await?;
        let ratio = ours.per_sec / theirs.per_sec.max(f64::MIN_POSITIVE);
        rows.push(vec![
            n.to_string(),
            format!("{:.0}", ours.per_sec),
            format!("{:.0}", theirs.per_sec),
            format!("{ratio:.2}"),
            format!("{:.2} / {:.2}", ours.p50_ms, ours.p99_ms),
            format!("{:.2} / {:.2}", theirs.p50_ms, theirs.p99_ms),
            format!("{} / {}", ours.errors, theirs.errors),
        ]);
        runs.push(json!({
            "clients": n,
            "ours": ours.json(),
            "etcd": theirs.json(),
            "ratio": ratio,
        }));
    }
    let text = format!(
        "committed writes, closed loop, side by side: our submissions through 3 replicas vs {} puts of {} bytes through 3 members (both durable: fsync on a quorum before the answer; loopback; one connection per client, spread over the members), {} s per run\n{}",
        etcd.version,
        value.len(),
        duration.as_secs_f64(),
        table(
            &[
                "CLIENTS",
                "OURS/S",
                "ETCD/S",
                "RATIO",
                "OURS P50/P99 MS",
                "ETCD P50/P99 MS",
                "ERRORS",
            ],
            &rows,
        )
    );
    let json = json!({
        "mode": "etcd-compare",
        "etcd_version": etcd.version,
        "value_bytes": value.len(),
        "runs": runs,
    });
    Ok((text, json))
}
