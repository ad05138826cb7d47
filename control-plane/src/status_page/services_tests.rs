//! The services pages on a built state (`fixtures::with_service`): the list, a service's
//! replicas, revisions and events, the link from a replica's job page, hostile strings
//! rendered inert, and what the summary view withholds.

use super::Mode;
use super::fixtures::{EVIL, SERVICE, fixture, status, with_service};
use super::job::{Logs, render_job};
use super::services::{render_service, render_services, service_path};
use super::tests::page;

const ESCAPED: &str = "&lt;script&gt;alert(1)&lt;/script&gt;";

#[test]
fn the_list_shows_each_service_with_its_readiness_revision_and_rollout() {
    let mut f = fixture();
    with_service(&mut f);
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let html = render_services(&p);
    assert!(
        html.contains("<a class=\"current\" href=\"/services\">Services</a>"),
        "{html}"
    );
    let (tenant, name) = SERVICE;
    assert!(
        html.contains(&format!(
            "href=\"{}\"><b>{name}</b>",
            service_path(tenant, name)
        )),
        "{html}"
    );
    // One of three desired is ready; revision 2 is rolling out.
    assert!(html.contains("1 / 3"), "{html}");
    assert!(
        html.contains("<span class=\"st progressing\">progressing</span>"),
        "{html}"
    );
    assert!(!html.contains("<script"), "{html}");
}

#[test]
fn a_service_page_shows_replicas_with_their_node_endpoint_and_job_and_every_string_inert() {
    let mut f = fixture();
    with_service(&mut f);
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let (tenant, name) = SERVICE;
    let html = render_service(&p, tenant, name, &format!("3 replicas wanted: {EVIL}")).unwrap();
    assert!(!html.contains("<script"), "{html}");
    let s = &f.driver.state.services[&crate::state::service_key(tenant, name)];
    for job in s.replicas.values() {
        assert!(
            html.contains(&format!("href=\"/jobs/{job}\"")),
            "replica job {job}: {html}"
        );
    }
    for want in [
        "href=\"/nodes/s1\"",
        "<code>10.0.0.9:200",
        "<span class=\"st ready\">ready</span>",
        "<span class=\"st starting\">starting</span>",
        "<code>http:http:/ready</code>",
        "(current)",
        "(old)",
        "revision 2: the replica template changed",
        "scaled from 2 to 3 replicas: ",
        ESCAPED,
        "500m GPU per replica",
    ] {
        assert!(html.contains(want), "{want:?} missing: {html}");
    }
    // Two revisions, newest first.
    let revisions = html.split("<h2>Revisions</h2>").nth(1).unwrap();
    let first = revisions.find("--v2").unwrap();
    let second = revisions.find("--v1").unwrap();
    assert!(first < second, "{revisions}");
    assert!(render_service(&p, tenant, "nope", "").is_none());
    let missing = super::services::render_missing_service(&p, tenant, "nope");
    assert!(missing.contains("No service team-b/nope"), "{missing}");
}

#[test]
fn a_replicas_job_page_links_to_its_service() {
    let mut f = fixture();
    with_service(&mut f);
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Full);
    let (tenant, name) = SERVICE;
    let s = &f.driver.state.services[&crate::state::service_key(tenant, name)];
    let (ordinal, job) = s.replicas.iter().next().unwrap();
    let html = render_job(&p, *job, &Logs::Withheld).unwrap();
    assert!(
        html.contains(&format!(
            "service <a href=\"{}\">{name}</a>, replica {ordinal} at revision",
            service_path(tenant, name)
        )),
        "{html}"
    );
}

#[test]
fn the_summary_view_withholds_names_commands_environment_and_exec_probes() {
    let mut f = fixture();
    with_service(&mut f);
    let st = status(1, 1);
    let p = page(&f.driver.state, &st, Some(&f.board), Mode::Summary);
    let (tenant, name) = SERVICE;
    let list = render_services(&p);
    assert!(!list.contains(&service_path(tenant, name)), "{list}");
    assert!(list.contains("(withheld)"), "{list}");
    let html = render_service(&p, tenant, name, "").unwrap();
    for secret in ["serve", "--v2", "TOKEN", "test &lt;script"] {
        assert!(!html.contains(secret), "{secret} shown: {html}");
    }
    assert!(
        html.contains("exec <span class=\"muted\">(command withheld)</span>"),
        "{html}"
    );
    let job = *f.driver.state.services[&crate::state::service_key(tenant, name)]
        .replicas
        .values()
        .next()
        .unwrap();
    let job_page = render_job(&p, job, &Logs::Withheld).unwrap();
    assert!(!job_page.contains("/services/"), "{job_page}");
}
