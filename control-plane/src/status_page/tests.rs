//! The render layer on built states: content, escaping, empty cluster, MIG and share cells,
//! an unhealthy GPU, the follower's view and the summary mode.

use super::fixtures::{EVIL, Fixture, NOW, fixture, status};
use super::gpu::CellState;
use super::job::{LogTail, Logs, render_job};
use super::nodes::{NodesFilter, render_nodes};
use super::{Mode, Page, StatusPageFlag, View};
use crate::scheduler::Board;
use crate::state::ClusterState;

pub(super) fn page<'a>(
    cluster: &'a ClusterState,
    status: &'a proto::v1::ClusterStatusResponse,
    board: Option<&'a Board>,
    mode: Mode,
) -> Page<'a> {
    Page {
        cluster,
        view: View {
            status,
            board,
            now: NOW,
            mode,
        },
    }
}

fn all_pages(p: &Page, f: &Fixture) -> Vec<(String, String)> {
    let (whole, share, mig, pending) = f.jobs;
    let mut out = vec![
        ("/".into(), super::cluster::render_cluster(p)),
        ("/nodes".into(), render_nodes(p, &NodesFilter::default())),
        (
            "/nodes/h1".into(),
            super::node::render_node(p, "h1").unwrap(),
        ),
        (
            "/nodes/m1".into(),
            super::node::render_node(p, "m1").unwrap(),
        ),
        ("/queue".into(), super::queue::render_queue(p)),
        ("/services".into(), super::services::render_services(p)),
        ("/tenants".into(), super::tenants::render_tenants(p)),
    ];
    for id in [whole, share, mig, pending] {
        out.push((
            format!("/jobs/{id}"),
            render_job(p, id, &Logs::Withheld).unwrap(),
        ));
    }
    out
}

#[test]
fn a_job_named_like_a_script_renders_inert_on_every_page() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let logs = Logs::Tail(LogTail {
        node: "h1".into(),
        attempt: 1,
        attempts: 1,
        stdout: format!("{EVIL}\n"),
        stderr: String::new(),
    });
    let mut pages = all_pages(&p, &f);
    pages.push((
        "/jobs (logs)".into(),
        render_job(&p, f.jobs.0, &logs).unwrap(),
    ));
    for (path, html) in &pages {
        assert!(
            !html.contains("<script"),
            "{path} carries a live script tag"
        );
        assert!(html.starts_with("<!DOCTYPE html>"), "{path}");
    }
    let job = &pages.last().unwrap().1;
    assert!(
        job.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{job}"
    );
    let queue = &pages.iter().find(|(p, _)| p == "/queue").unwrap().1;
    assert!(queue.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
}

#[test]
fn the_grid_shows_each_gpu_with_its_holder_shares_mig_slices_and_an_unhealthy_gpu() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let (whole, share, mig, _) = f.jobs;
    let html = render_nodes(&p, &NodesFilter::default());
    // Nine GPUs: 4 held by the whole job, 1 shared, 1 unhealthy, 2 free; the MIG GPU partly held.
    assert!(html.contains("<b>2 nodes</b> · 2 ready"), "{html}");
    assert!(html.contains("<b>9 GPUs</b>"), "{html}");
    assert_eq!(
        html.matches(&format!("class=\"g allocated\" href=\"/jobs/{whole}\""))
            .count(),
        4,
        "{html}"
    );
    assert!(html.contains(&format!("job {whole} (team-a)")));
    assert!(
        html.contains(&format!("class=\"g share partial\" href=\"/jobs/{share}\"")),
        "{html}"
    );
    assert!(html.contains("style=\"--f:50%\""));
    assert!(html.contains("class=\"g mig partial\""), "{html}");
    assert!(
        html.contains(&format!("slice 1g.10gb · job {mig} (team-b)")),
        "{html}"
    );
    assert_eq!(
        html.matches("class=\"s\"").count(),
        3,
        "three MIG slices free"
    );
    assert!(html.contains("class=\"g unhealthy\""));
    assert!(html.contains("unhealthy: Xid 79: fell off the bus"));
    assert!(
        html.contains("dot unhealthy\"></span>1 unhealthy"),
        "{html}"
    );
}

#[test]
fn filters_keep_matching_nodes_and_bad_values_are_refused_with_the_choices() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let filter = NodesFilter::parse(None, Some("unhealthy"), None).unwrap();
    assert_eq!(filter.state, Some(CellState::Unhealthy));
    let html = render_nodes(&p, &filter);
    assert!(html.contains("href=\"/nodes/h1\""));
    assert!(!html.contains("href=\"/nodes/m1\""));
    assert!(html.contains("showing 1 of 2 nodes"));
    let e = NodesFilter::parse(None, Some("broken"), None).unwrap_err();
    assert!(
        e.contains("free, allocated, partial, unhealthy, drained, down"),
        "{e}"
    );
    let e = NodesFilter::parse(None, None, Some("up")).unwrap_err();
    assert!(e.contains("ready, drained, down"), "{e}");
    assert_eq!(
        NodesFilter::parse(Some(""), Some(""), Some("")),
        Ok(NodesFilter::default())
    );
}

#[test]
fn the_node_page_draws_the_link_matrix_with_numa_affinity() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let html = super::node::render_node(&p, "h1").unwrap();
    let topo = &f.driver.state.nodes.get("h1").unwrap().spec.topology;
    assert_eq!(topo.len(), 8);
    assert!(html.contains("<table class=\"topo\">"));
    assert_eq!(html.matches("<td class=\"self\">X</td>").count(), 8);
    assert!(
        html.contains(&format!("<td class=\"nv\">{}</td>", topo[0][1])),
        "{html}"
    );
    assert!(html.contains("NUMA affinity"));
    assert!(html.contains("unhealthy: Xid 79"));
    let mig = super::node::render_node(&p, "m1").unwrap();
    assert!(mig.contains("<code>3g.40gb</code>"), "{mig}");
    assert!(super::node::render_node(&p, "nope").is_none());
    assert!(
        super::node::render_missing_node(&p, "nope").contains("No node named &quot;nope&quot;")
    );
}

#[test]
fn the_queue_gives_the_leaders_reason_in_the_words_of_gpuctl() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let pending = f.driver.state.job(f.jobs.3).unwrap();
    let reason = crate::scheduler::reasons::explain(
        &f.driver.state,
        Some(&f.board),
        pending,
        NOW,
        &mut Default::default(),
    );
    // Eight GPUs wanted; h1 has 3 free of 8 and one of them went unhealthy.
    assert!(
        reason.starts_with("NodeUnhealthy: 0/2 nodes have 8 free GPUs"),
        "{reason}"
    );
    let html = super::queue::render_queue(&p);
    let escaped = maud::html! { (reason) }.into_string();
    assert!(html.contains(&escaped), "{html}");
    assert!(html.contains("<b>1 pending</b>"));
    assert!(
        render_job(&p, f.jobs.3, &Logs::Withheld)
            .unwrap()
            .contains(&escaped)
    );
}

#[test]
fn a_follower_says_it_follows_who_leads_and_that_reasons_are_the_leaders() {
    let f = fixture();
    let st = status(2, 1);
    let p = page(&f.driver.state, &st, None, Mode::Full);
    let html = super::cluster::render_cluster(&p);
    assert!(
        html.contains("follower; replica 1 (127.0.0.1:7001) leads"),
        "{html}"
    );
    assert!(html.contains("Served by replica 2, a follower"));
    let q = super::queue::render_queue(&p);
    assert!(q.contains("known to the leader only"), "{q}");
    assert!(q.contains("<code>127.0.0.1:7001</code>"));
    assert!(!q.contains("Resources:"));
    let none = status(2, 0);
    let p = page(&f.driver.state, &none, None, Mode::Full);
    assert!(super::cluster::render_cluster(&p).contains("No leader is known right now."));
}

#[test]
fn the_cluster_page_counts_replicas_nodes_gpus_and_jobs() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let html = super::cluster::render_cluster(&p);
    assert!(
        html.contains("replica <b>1</b> · leader · term 3"),
        "{html}"
    );
    assert!(html.contains("<div class=\"big\">replica 1</div>"));
    assert!(html.contains("<code>127.0.0.1:7003</code>"));
    assert!(
        html.contains("href=\"/nodes?state=unhealthy\">unhealthy</a></th><td class=\"num\">1</td>"),
        "{html}"
    );
    assert!(html.contains("<th>pending</th><td class=\"num\">1</td>"));
}

#[test]
fn tenants_show_gpus_held_against_quota_and_their_jobs() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let html = super::tenants::render_tenants(&p);
    assert!(html.contains("4 / 4 GPUs"), "{html}");
    // team-b: a half share and a 1g slice (1/7 of a GPU).
    assert!(html.contains("0.642 / 4 GPUs"), "{html}");
    let row_a = html.split("<b>team-a</b>").nth(1).unwrap();
    let cells: Vec<&str> = row_a.split("<td class=\"num\">").skip(3).take(2).collect();
    assert!(
        cells[0].starts_with("1<") && cells[1].starts_with("1<"),
        "{row_a}"
    );
}

#[test]
fn the_summary_mode_withholds_names_commands_and_logs() {
    let f = fixture();
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Summary);
    let job = render_job(&p, f.jobs.0, &Logs::Withheld).unwrap();
    assert!(!job.contains("echo"), "{job}");
    assert!(!job.contains("alert"), "{job}");
    assert!(job.contains("(withheld)"));
    assert!(job.contains("`gpuctl logs"));
    assert!(job.contains("Summary view"));
    let queue = super::queue::render_queue(&p);
    assert!(
        !queue.contains("alert") && !queue.contains(">big<"),
        "{queue}"
    );
    // The full view shows them.
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let job = render_job(&p, f.jobs.0, &Logs::Withheld).unwrap();
    assert!(
        job.contains("<code>sh -c 'echo &lt;script&gt;alert(1)&lt;/script&gt;'</code>"),
        "{job}"
    );
}

#[test]
fn an_empty_cluster_renders_every_page_and_says_what_to_do() {
    let empty = ClusterState::default();
    let st = status(1, 1);
    let p = page(&empty, &st, None, Mode::Full);
    assert!(render_nodes(&p, &NodesFilter::default()).contains("No node has registered yet"));
    assert!(super::queue::render_queue(&p).contains("No job is waiting."));
    assert!(super::tenants::render_tenants(&p).contains("No tenant is defined"));
    assert!(super::services::render_services(&p).contains("No service runs."));
    assert!(super::services::render_service(&p, "t", "web", "").is_none());
    assert!(
        super::cluster::render_cluster(&p).contains("<div class=\"big\">0</div><div>nodes</div>")
    );
    let missing = render_job(&p, 7, &Logs::Withheld).unwrap_err();
    assert!(missing.contains("job 7"), "{missing}");
}

#[test]
fn the_mode_follows_security_and_full_is_refused_with_authentication() {
    assert_eq!(Mode::resolve(StatusPageFlag::Auto, false), Ok(Mode::Full));
    assert_eq!(Mode::resolve(StatusPageFlag::Auto, true), Ok(Mode::Off));
    assert_eq!(
        Mode::resolve(StatusPageFlag::Summary, true),
        Ok(Mode::Summary)
    );
    assert_eq!(
        Mode::resolve(StatusPageFlag::Summary, false),
        Ok(Mode::Summary)
    );
    assert_eq!(Mode::resolve(StatusPageFlag::Off, false), Ok(Mode::Off));
    assert_eq!(Mode::resolve(StatusPageFlag::Full, false), Ok(Mode::Full));
    let e = Mode::resolve(StatusPageFlag::Full, true).unwrap_err();
    assert!(e.contains("--status-page summary"), "{e}");
}
