//! The status page in a real browser: a three-replica cluster without authentication (the
//! page's full view) with two simulated hosts (a DGX H100 and a MIG-mode H100), a job
//! running, one waiting with a reason, one on a MIG slice and an unhealthy GPU; headless
//! Chromium (Debian's `chromium` package) loads every page from the leader and a follower,
//! the test checks what a person would look for and keeps screenshots. Without Chromium the
//! test says "not run" (or fails, with GPUCP_REQUIRE_CHROMIUM=1, as CI sets it).
//!
//! A second test, without a browser, checks what a secured cluster serves: nothing by
//! default, the summary (no commands) when asked, and a refusal to start for `full`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use control_plane::local_cluster::{LocalCluster, free_ports};
use node_agent::observe::http_get;
use proto::v1 as pb;

use crate::util::*;

/// Whether Chromium runs here; otherwise "not run", or a failure with GPUCP_REQUIRE_CHROMIUM=1.
fn chromium_available() -> bool {
    let found = Command::new("chromium")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("GPUCP_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "chromium is not installed but GPUCP_REQUIRE_CHROMIUM=1: install Debian's `chromium` package (apt-get install -y chromium), as .ci/run does"
        );
        println!("not run: chromium not installed (apt-get install -y chromium)");
    }
    found
}

struct Browser {
    profile: tempfile::TempDir,
    shots: PathBuf,
}

impl Browser {
    fn run(&self, args: &[String]) -> String {
        let out = Command::new("timeout")
            .arg("120")
            .arg("chromium")
            .args([
                "--headless",
                "--disable-gpu",
                "--no-sandbox",
                "--hide-scrollbars",
                "--no-first-run",
            ])
            .arg(format!("--user-data-dir={}", self.profile.path().display()))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running chromium");
        assert!(
            out.status.success(),
            "chromium {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The page's DOM once loaded, as the browser built it.
    fn dom(&self, url: &str) -> String {
        let dom = self.run(&["--dump-dom".into(), url.into()]);
        assert!(
            dom.contains("gpu-control-plane"),
            "{url} did not load: {dom}"
        );
        // Nothing user-supplied became markup: the page has no script at all.
        assert!(
            !dom.contains("<script"),
            "{url} carries a script element: {dom}"
        );
        dom
    }

    /// A screenshot of the page at 1280 × `height`, as `name`.png in the screenshot folder.
    fn screenshot(&self, url: &str, name: &str, height: u32) -> PathBuf {
        let file = self.shots.join(format!("{name}.png"));
        self.run(&[
            format!("--screenshot={}", file.display()),
            format!("--window-size=1280,{height}"),
            url.into(),
        ]);
        let png = std::fs::read(&file).expect("the screenshot was written");
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 5_000,
            "{name}: {} bytes",
            png.len()
        );
        file
    }
}

/// Waits until the leader's state lists `agents` ready, with the cluster version raised (so
/// nodes carry format 2's fields).
async fn wait_registered(c: &LocalCluster, agents: &[&str]) {
    let mut client = c.client().unwrap();
    leader_status(c).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = list_nodes(&mut client).await;
        if agents.iter().all(|a| {
            nodes
                .iter()
                .any(|n| n.name == *a && n.status == "ready" && !n.agent_release.is_empty())
        }) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "agents did not register: {nodes:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `s` as the DOM serialises text: `&`, `<` and `>` escaped.
fn escaped(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_loads_every_page_of_a_running_cluster() {
    if !chromium_available() {
        return;
    }
    step(
        "three replicas without authentication, each serving the status page; two simulated hosts",
    );
    let mut c = describe(3, &FAST_LEASES);
    c.set_insecure();
    c.agent_program = Some((gpuctl_bin(), vec!["agent".into()]));
    let ports = free_ports(5).unwrap();
    let pages: Vec<String> = ports[..3]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    for (r, addr) in c.replicas.values_mut().zip(&pages) {
        r.metrics_addr = Some(addr.clone());
    }
    let agent_args = ["--stop-grace-secs", "1", "--fence-grace-ms", "500"];
    c.add_agent("h1", "dgx-h100", ports[3], &agent_args);
    c.add_agent("m1", "h100-pcie-1gpu-mig", ports[4], &agent_args);
    c.start_all().unwrap();
    let leader = c.wait_for_leader(LEADER_TIMEOUT).await.unwrap().leader;
    c.start_agent("h1").unwrap();
    c.start_agent("m1").unwrap();
    wait_registered(&c, &["h1", "m1"]).await;
    let leader = c
        .wait_for_leader(LEADER_TIMEOUT)
        .await
        .map_or(leader, |s| s.leader);
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let base = |id: u64| format!("http://{}", pages[id as usize - 1]);

    let (ok, _, err) = gpuctl(&c, &["tenant", "set", "team-a", "--quota", "4"]);
    assert!(ok, "tenant set: {err}");

    step("a job named like a script holds 4 GPUs and logs a line; a MIG job holds a slice");
    let evil = "<script>alert(1)</script>";
    let mut client = c.client().unwrap();
    let running = submit(
        &mut client,
        pb::JobSpec {
            name: evil.into(),
            ..shell_job(4, "echo status-page-log-line; sleep 300")
        },
        "evil",
    )
    .await
    .unwrap()
    .id;
    let mig = submit(
        &mut client,
        pb::JobSpec {
            mig_profile: "1g.10gb".into(),
            ..shell_job(1, "sleep 300")
        },
        "mig",
    )
    .await
    .unwrap()
    .id;
    for id in [running, mig] {
        wait_job(&mut client, id, Duration::from_secs(30), "running", |j| {
            j.state == "running"
        })
        .await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !job_logs(&mut client, running)
        .await
        .0
        .contains("status-page-log-line")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job's log line never came"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    step("GPU 7 of h1 falls off the bus (fault injection); an 8-GPU job then waits");
    let (ok, _, err) = gpuctl(&c, &["node", "inject", "h1", "--gpu", "7", "--xid", "79"]);
    assert!(ok, "inject: {err}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let nodes = list_nodes(&mut client).await;
        let h1 = nodes.iter().find(|n| n.name == "h1").unwrap();
        if h1
            .gpus
            .iter()
            .any(|g| g.index == 7 && g.health != "healthy")
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "GPU 7 never unhealthy: {h1:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pending = submit(&mut client, spec("big", 8), "big").await.unwrap().id;
    let reason = loop {
        let j = get_job(&mut client, pending).await;
        if j.pending_reason.starts_with("Resources")
            || j.pending_reason.starts_with("NodeUnhealthy")
        {
            break j.pending_reason;
        }
        assert!(
            tokio::time::Instant::now() < deadline + Duration::from_secs(10),
            "no reason: {j:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let shots = match std::env::var_os("GPUCP_STATUS_PAGE_SCREENSHOTS") {
        Some(dir) => PathBuf::from(dir),
        None => std::env::temp_dir().join(format!("gpucp-status-page-{}", std::process::id())),
    };
    std::fs::create_dir_all(&shots).unwrap();
    let browser = Browser {
        profile: tempfile::tempdir().unwrap(),
        shots,
    };

    step("/ on the leader names it, its term and the replicas; a follower says whom it follows");
    let l = base(leader);
    let dom = browser.dom(&format!("{l}/"));
    assert!(
        dom.contains(&format!("replica <b>{leader}</b> · leader")),
        "{dom}"
    );
    assert!(
        dom.contains(&format!("<div class=\"big\">replica {leader}</div>")),
        "{dom}"
    );
    assert!(dom.contains(&c.replicas[&follower].addr), "{dom}");
    let dom = browser.dom(&format!("{}/", base(follower)));
    assert!(
        dom.contains(&format!(
            "follower; replica {leader} ({}) leads",
            c.replicas[&leader].addr
        )),
        "{dom}"
    );
    let dom = browser.dom(&format!("{}/queue", base(follower)));
    assert!(dom.contains("known to the leader only"), "{dom}");

    step("/nodes: the job's GPUs link to it, the MIG slice is held, GPU 7 is unhealthy");
    let dom = browser.dom(&format!("{l}/nodes"));
    assert_eq!(
        dom.matches(&format!("class=\"g allocated\" href=\"/jobs/{running}\""))
            .count(),
        4,
        "{dom}"
    );
    assert!(dom.contains(&format!("href=\"/jobs/{mig}\"")), "{dom}");
    assert!(dom.contains("class=\"g mig partial\""), "{dom}");
    assert!(dom.contains("class=\"g unhealthy\""), "{dom}");
    assert!(dom.contains("<b>2 nodes</b> · 2 ready"), "{dom}");
    let dom = browser.dom(&format!("{l}/nodes?state=unhealthy"));
    assert!(
        dom.contains("showing 1 of 2 nodes") && !dom.contains("href=\"/nodes/m1\""),
        "{dom}"
    );

    step("/nodes/h1: its GPUs and the NVLink matrix with NUMA affinity");
    let dom = browser.dom(&format!("{l}/nodes/h1"));
    assert!(dom.contains("<td class=\"nv\">NV18</td>"), "{dom}");
    assert_eq!(dom.matches("<td class=\"self\">X</td>").count(), 8, "{dom}");
    assert!(dom.contains("NUMA affinity"), "{dom}");
    assert!(dom.contains("unhealthy: "), "{dom}");

    step("/queue: the waiting job with the reason gpuctl gives");
    let dom = browser.dom(&format!("{l}/queue"));
    assert!(
        dom.contains(&escaped(&reason)),
        "reason {reason:?} not in {dom}"
    );
    assert!(dom.contains(&format!("href=\"/jobs/{pending}\"")), "{dom}");

    step("/jobs/ID: the job's spec (its name inert), history and its log line");
    let dom = browser.dom(&format!("{l}/jobs/{running}"));
    assert!(
        dom.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{dom}"
    );
    assert!(dom.contains("status-page-log-line"), "{dom}");
    assert!(dom.contains("placed on h1"), "{dom}");
    let dom = browser.dom(&format!("{l}/jobs/999999"));
    assert!(dom.contains("Not found"), "{dom}");

    step("/tenants: team-a holds 4 GPUs and a 1g slice (1/7 of one) against a quota of 4");
    let dom = browser.dom(&format!("{l}/tenants"));
    assert!(dom.contains("<b>team-a</b>"), "{dom}");
    assert!(dom.contains("4.142 / 4 GPUs"), "{dom}");
    assert!(dom.contains("(borrowing 0.142)"), "{dom}");

    step("/services: none runs yet, and the page says how to start one");
    let dom = browser.dom(&format!("{l}/services"));
    assert!(dom.contains("No service runs."), "{dom}");
    assert!(
        dom.contains("<a class=\"current\" href=\"/services\">Services</a>"),
        "{dom}"
    );

    step("screenshots of each page");
    for (path, name, height) in [
        ("/".to_owned(), "cluster", 760),
        ("/nodes".into(), "nodes", 420),
        ("/nodes/h1".into(), "node-h1", 1300),
        ("/queue".into(), "queue", 520),
        (format!("/jobs/{running}"), "job", 1000),
        ("/tenants".into(), "tenants", 360),
        ("/services".into(), "services", 300),
    ] {
        let f = browser.screenshot(&format!("{l}{path}"), name, height);
        println!("screenshot of {path}: {}", f.display());
    }
    assert!(Path::new(&browser.shots).join("nodes.png").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secured_cluster_serves_no_page_by_default_and_never_commands() {
    step("three secured replicas asked for the summary view");
    let mut c = describe(3, &["--status-page", "summary"]);
    let ports = free_ports(3).unwrap();
    let addrs: Vec<SocketAddr> = ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
        .collect();
    for (r, a) in c.replicas.values_mut().zip(&addrs) {
        r.metrics_addr = Some(a.to_string());
    }
    c.start_all().unwrap();
    // A held job (`hold_if_unfit`) needs the raised cluster version.
    let leader = leader_status(&c).await.leader;
    let mut client = c.client().unwrap();
    let id = submit(
        &mut client,
        pb::JobSpec {
            hold_if_unfit: true,
            name: "secret-name".into(),
            ..shell_job(1, "echo secret-command")
        },
        "held",
    )
    .await
    .unwrap()
    .id;
    let on = addrs[leader as usize - 1];
    let get = |addr, path: String| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) = http_get(addr, &path).await.unwrap();
            if status != 404 || tokio::time::Instant::now() > deadline || !path.starts_with("/jobs")
            {
                return (status, body);
            }
            // The job may not be applied on this replica yet.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (status, body) = get(on, format!("/jobs/{id}")).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Summary view"), "{body}");
    assert!(
        !body.contains("secret-command") && !body.contains("secret-name"),
        "{body}"
    );
    assert!(body.contains("Withheld in the summary view"), "{body}");
    let (status, body) = get(on, "/queue".into()).await;
    assert_eq!(status, 200);
    assert!(!body.contains("secret-name"), "{body}");

    step("restarted without the flag, a secured replica serves /metrics but no status page");
    let other = (1..=3).find(|i| *i != leader).unwrap();
    c.stop(other, Duration::from_secs(10)).unwrap();
    c.extra_args.clear();
    c.start(other, control_plane::local_cluster::StartMode::Initial)
        .unwrap();
    let addr = addrs[other as usize - 1];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _)) = http_get(addr, "/metrics").await {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replica {other} did not serve /metrics"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for path in ["/", "/nodes", &format!("/jobs/{id}")] {
        let (status, _) = http_get(addr, path).await.unwrap();
        assert_eq!(status, 404, "{path} is served without --status-page");
    }

    step("--status-page full is refused where authentication is on, with what to use instead");
    c.stop(other, Duration::from_secs(10)).unwrap();
    c.extra_args = vec!["--status-page".into(), "full".into()];
    c.start(other, control_plane::local_cluster::StartMode::Initial)
        .unwrap();
    let log = c.replicas[&other].log_path.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("--status-page full shows every tenant's job commands and logs") {
            assert!(text.contains("use --status-page summary"), "{text}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no refusal in {}: {text}",
            log.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
