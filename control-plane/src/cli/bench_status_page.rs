//! `gpuctl bench status-page`: how long the status page takes to render, server side, on a
//! synthetic fleet of 8-GPU hosts (`synthetic::fleet`: DGX H100, DGX-1, PCIe L40S) with most
//! GPUs held by a mix of jobs (whole GPUs, gangs, shares), a queue of pending jobs with the
//! reasons of a real scheduling pass, some GPUs unhealthy, some nodes drained and one down.
//! Each page is rendered `--runs` times from the same state, as a replica's handler does
//! (the render under the state's read lock; the HTTP write is not counted), and reported as
//! p50/p99/max. `--html-dir` keeps one rendering of each page, for a browser to screenshot.

use std::path::PathBuf;
use std::time::Instant;

use proto::v1 as pb;
use serde_json::json;

use crate::scheduler::{Board, Policy, plan_explained};
use crate::state::{Command, GpuHealth, NodeStatus};
use crate::status_page::job::Logs;
use crate::status_page::nodes::NodesFilter;
use crate::status_page::{Mode, Page, View};
use crate::synthetic::{Driver, fleet, mixed_jobs, submit_all};

pub struct Args {
    pub hosts: usize,
    pub runs: usize,
    /// Fraction of the GPUs to fill with running work.
    pub fill: f64,
    pub pending: usize,
    pub html_dir: Option<PathBuf>,
}

const NOW: u64 = 1_700_000_000_000;

/// The fleet, filled, with a queue and a few faults, and the reasons of its last pass.
fn state(args: &Args) -> anyhow::Result<(Driver, Board)> {
    let mut driver = Driver::new(NOW);
    fleet(&mut driver, args.hosts)?;
    super::bench_scheduler::fill(&mut driver, args.fill, 7)?;
    let first = driver.state.last_job_id + 1;
    submit_all(&mut driver, &mixed_jobs(args.pending, 11, first))?;
    let names: Vec<String> = driver.state.nodes.keys().cloned().collect();
    // One host in 100 drained, one GPU in 200 unhealthy, and the last host down.
    for (i, name) in names.iter().enumerate() {
        if i % 100 == 50 {
            driver.apply(&Command::SetNodeStatus {
                node: name.clone(),
                status: NodeStatus::Drained,
                evict: false,
                reason: "bench: maintenance".into(),
            });
        }
        if i % 25 == 3 {
            let node = driver.state.nodes.get(name).expect("listed node");
            let gpu = node.spec.gpus[i % node.spec.gpus.len()].uuid.clone();
            driver.apply(&Command::SetGpuHealth {
                node: name.clone(),
                gpu,
                health: GpuHealth::Unhealthy {
                    reason: "Xid 79: GPU has fallen off the bus".into(),
                },
            });
        }
    }
    if let Some(last) = names.last() {
        let registered_at = driver.state.nodes.get(last).expect("node").registered_at;
        driver.apply(&Command::NodeLost {
            node: last.clone(),
            reason: "bench: lease expired".into(),
            registered_at,
        });
    }
    let policy = Policy::default();
    let (_, _, log) = plan_explained(&driver.state, NOW, &policy);
    let board = Board::new(1, NOW, log, policy.max_jobs_per_pass);
    Ok((driver, board))
}

/// A three-replica cluster's status as its leader, replica 1, answers it.
fn status() -> pb::ClusterStatusResponse {
    pb::ClusterStatusResponse {
        cluster: "bench".into(),
        id: 1,
        leader: 1,
        term: 4,
        commit_index: 123_456,
        applied_index: 123_456,
        state: "leader".into(),
        members: (1..=3)
            .map(|i| pb::Member {
                id: i,
                address: format!("10.0.0.{i}:7001"),
                role: "voter".into(),
                reachable: true,
                matched_index: 123_456,
                release: crate::state::format::RELEASE.into(),
                ..Default::default()
            })
            .collect(),
        cluster_version: 2,
        release: crate::state::format::RELEASE.into(),
        ..Default::default()
    }
}

pub fn run(args: Args) -> anyhow::Result<(String, serde_json::Value)> {
    anyhow::ensure!(args.hosts > 0, "--hosts must be at least 1");
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.fill),
        "--fill is a fraction of the GPUs, from 0 to 1 (not {})",
        args.fill
    );
    let built = Instant::now();
    let (driver, board) = state(&args)?;
    let build_s = built.elapsed().as_secs_f64();
    let st = status();
    let c = &driver.state;
    let page = Page {
        cluster: c,
        view: View {
            status: &st,
            board: Some(&board),
            now: NOW,
            mode: Mode::Full,
        },
    };
    let gpus: usize = c.nodes.values().map(|n| n.spec.gpus.len()).sum();
    let held = c.gpu_holder.len() + c.index.gpu_shares.len();
    let first_node = c.nodes.keys().next().cloned().unwrap_or_default();
    let running_job = c.allocations.values().next().map(|r| r.allocation.job);
    let page = &page;
    type Render<'a> = Box<dyn Fn() -> String + 'a>;
    let mut pages: Vec<(&str, Render)> = vec![
        (
            "nodes",
            Box::new(|| crate::status_page::nodes::render_nodes(page, &NodesFilter::default())),
        ),
        (
            "cluster",
            Box::new(|| crate::status_page::cluster::render_cluster(page)),
        ),
        (
            "queue",
            Box::new(|| crate::status_page::queue::render_queue(page)),
        ),
        (
            "tenants",
            Box::new(|| crate::status_page::tenants::render_tenants(page)),
        ),
        (
            "node",
            Box::new(|| {
                crate::status_page::node::render_node(page, &first_node).unwrap_or_default()
            }),
        ),
    ];
    if let Some(id) = running_job {
        pages.push((
            "job",
            Box::new(move || {
                crate::status_page::job::render_job(page, id, &Logs::Withheld).unwrap_or_else(|e| e)
            }),
        ));
    }
    if let Some(dir) = &args.html_dir {
        std::fs::create_dir_all(dir)?;
    }
    let mut rows = Vec::new();
    let mut results = serde_json::Map::new();
    for (name, render) in &pages {
        let mut ms = Vec::with_capacity(args.runs);
        let mut bytes = 0;
        for _ in 0..args.runs {
            let t = Instant::now();
            let html = std::hint::black_box(render());
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
            bytes = html.len();
        }
        if let Some(dir) = &args.html_dir {
            std::fs::write(dir.join(format!("{name}.html")), render())?;
        }
        let s = super::bench::summary(ms);
        rows.push(vec![
            (*name).to_owned(),
            format!("{:.1}", bytes as f64 / 1024.0),
            format!("{:.2}", s["p50"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.2}", s["p99"].as_f64().unwrap_or(f64::NAN)),
            format!("{:.2}", s["max"].as_f64().unwrap_or(f64::NAN)),
        ]);
        results.insert((*name).to_owned(), json!({"bytes": bytes, "ms": s}));
    }
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let mut text = format!(
        "status page render, {build} build: {} hosts, {} GPUs ({} held or shared), {} jobs ({} pending); {} runs per page (state built in {build_s:.1} s)\n",
        args.hosts,
        gpus,
        held,
        c.jobs.len(),
        c.index.pending.len(),
        args.runs
    );
    text.push_str(&super::output::table(
        &["page", "KiB", "p50 ms", "p99 ms", "max ms"],
        &rows,
    ));
    if let Some(dir) = &args.html_dir {
        text.push_str(&format!("pages written to {}\n", dir.display()));
    }
    let json = json!({
        "benchmark": "status-page",
        "build": build,
        "hosts": args.hosts,
        "gpus": gpus,
        "gpus_held": held,
        "jobs": c.jobs.len(),
        "pending": c.index.pending.len(),
        "runs": args.runs,
        "pages": results,
    });
    Ok((text, json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_fleet_renders_every_page_and_reports_its_timings() {
        let dir = tempfile::tempdir().unwrap();
        let (text, json) = run(Args {
            hosts: 10,
            runs: 3,
            fill: 0.9,
            pending: 20,
            html_dir: Some(dir.path().to_owned()),
        })
        .unwrap();
        assert_eq!(json["gpus"], 80, "{text}");
        assert!(json["gpus_held"].as_u64().unwrap() >= 60, "{text}");
        for page in ["nodes", "cluster", "queue", "tenants", "node", "job"] {
            let p = &json["pages"][page];
            assert_eq!(p["ms"]["n"], 3, "{page}: {text}");
            assert!(p["ms"]["max"].as_f64().unwrap() > 0.0, "{page}");
            let html = std::fs::read_to_string(dir.path().join(format!("{page}.html"))).unwrap();
            assert_eq!(html.len() as u64, p["bytes"].as_u64().unwrap(), "{page}");
        }
        let nodes = std::fs::read_to_string(dir.path().join("nodes.html")).unwrap();
        assert!(nodes.contains("<b>10 nodes</b>"), "{nodes}");
        assert!(nodes.contains("class=\"g unhealthy\""));
        assert!(nodes.contains("class=\"host down\""));
        assert!(text.contains("p50 ms"), "{text}");
    }

    #[test]
    fn bad_arguments_are_refused() {
        let args = |hosts, fill| Args {
            hosts,
            runs: 1,
            fill,
            pending: 0,
            html_dir: None,
        };
        assert!(
            run(args(0, 0.5))
                .unwrap_err()
                .to_string()
                .contains("--hosts")
        );
        assert!(
            run(args(1, 1.5))
                .unwrap_err()
                .to_string()
                .contains("--fill")
        );
    }
}
