//! `/jobs/{id}`: one job: what it asks for, its state (and why it waits), its history, its
//! attempts and their allocations, what it used, and the tail of its logs (read from the
//! agent by the handler; withheld in the summary view).

use maud::{Markup, html};

use super::Page;
use super::html::{ago, gpus, job_link, node_link, not_found, page, shape, state_badge, utc};
use crate::scheduler::reasons::{ShapeMemo, explain};
use crate::state::{ArchivedJob, DependencyKind, Job, JobState};

/// The tail of a task's logs, as its agent returned them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogTail {
    pub node: String,
    pub attempt: u32,
    pub attempts: u32,
    pub stdout: String,
    pub stderr: String,
}

/// What the page says about a job's logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Logs {
    /// The summary view shows no logs.
    Withheld,
    /// None to read, or reading failed: why.
    Unavailable(String),
    Tail(LogTail),
}

/// Bytes of each log the page shows (the end of it).
pub const LOG_TAIL_BYTES: u64 = 16 * 1024;

/// The page of job `id`: whole, archived, or a 404 page (`Err`) when this replica knows no
/// such job.
pub fn render_job(p: &Page, id: u64, logs: &Logs) -> Result<String, String> {
    if let Some(job) = p.cluster.job(id) {
        return Ok(page(
            &p.view,
            "/queue",
            &format!("Job {id}"),
            job_body(p, job, logs),
        ));
    }
    if let Some(a) = p.cluster.archived.get(&id) {
        return Ok(page(
            &p.view,
            "/queue",
            &format!("Job {id}"),
            archived_body(p, a),
        ));
    }
    Err(not_found(&p.view, "/queue", &p.cluster.missing_job(id)))
}

fn job_body(p: &Page, job: &Job, logs: &Logs) -> Markup {
    let s = &job.spec;
    let full = p.view.mode.shows_details();
    let reason = if job.state == JobState::Pending && p.view.is_leader() {
        explain(
            p.cluster,
            p.view.board,
            job,
            p.view.now,
            &mut ShapeMemo::default(),
        )
    } else if job.state == JobState::Pending {
        "known to the leader (this replica is a follower)".to_owned()
    } else {
        String::new()
    };
    let withheld = html! { span.muted { "(withheld)" } };
    html! {
        h1 { "Job " (job.id) " " (state_badge(job.state)) }
        @if !reason.is_empty() { p.reason { b { "Pending: " } (reason) } }
        @if let Some(e) = &job.ending { p.notice { "Ending: will become " (e.state.as_str()) " once its tasks have exited (" (e.reason) ")" } }
        table.kv {
            tr { th { "tenant" } td { (s.tenant) } }
            tr { th { "name" } td { @if full { (s.name) } @else { (withheld) } } }
            @if let Some(r) = &job.replica {
                tr { th { "replica of" } td {
                    @if full {
                        @let (tenant, name) = r.service.split_once('/').unwrap_or(("", &r.service));
                        "service " a href=(super::services::service_path(tenant, name)) { (name) }
                    } @else { "a service " (withheld) }
                    ", replica " (r.ordinal) " at revision " (r.revision) ": "
                    @if r.ready { "ready" } @else { "not ready" }
                    ", " (r.restarts) " restart(s)"
                    @if let Some(e) = &r.last_exit { ", last exit: " (e) }
                } }
            }
            tr { th { "command" } td { @if full { code { (shell_words(&s.command)) } } @else { (withheld) } } }
            tr { th { "asks for" } td {
                (shape(s))
                @if !s.gpu_models.is_empty() { " of " (s.gpu_models.join(" or ")) }
                @if s.cpu_milli_per_task > 0 || s.memory_mib_per_task > 0 {
                    ", " (s.cpu_milli_per_task as f64 / 1000.0) " CPUs and " (s.memory_mib_per_task) " MiB per task"
                }
                @if s.single_numa { ", one NUMA node per task" }
            } }
            tr { th { "partition" } td { (s.partition.as_deref().unwrap_or("(default)")) } }
            tr { th { "priority" } td { (s.priority_class) @if s.preemptible { ", preemptible" } } }
            tr { th { "time limit" } td { (s.time_limit_secs.map_or("none".to_owned(), |t| humantime::format_duration(std::time::Duration::from_secs(t)).to_string())) } }
            @if let (Some(t), Some(a)) = (job.array_task, &s.array) {
                tr { th { "array" } td {
                    (t.array_id) "_" (t.index) ": index " (t.index) " of array " (job_link(t.array_id))
                    " (" (t.count) " jobs, " code { (a.text()) } ")"
                } }
            }
            @if job.held { tr { th { "held" } td { "yes: waits for " code { "gpuctl release " (job.id) } } } }
            @if let Some(b) = s.begin_at { tr { th { "begins" } td { "not before " (utc(b)) } } }
            @if !s.nodelist.is_empty() { tr { th { "node list" } td { (s.nodelist.join(", ")) } } }
            @if !s.exclude.is_empty() { tr { th { "excluded" } td { (s.exclude.join(", ")) } } }
            @if s.exclusive { tr { th { "exclusive" } td { "yes: its nodes run nothing else" } } }
            @if let Some(e) = job.exit { tr { th { "exit code" } td { (e.code) ":" (e.signal) } } }
            @if !s.dependencies.is_empty() {
                tr { th { "after" } td {
                    @for (i, d) in s.dependencies.iter().enumerate() {
                        @if i > 0 { ", " }
                        (match d.kind { DependencyKind::AfterOk => "afterok ", DependencyKind::AfterAny => "afterany ", DependencyKind::AfterNotOk => "afternotok " })
                        (job_link(d.job))
                    }
                } }
            }
            @if full {
                @if let Some(w) = &s.workdir { tr { th { "workdir" } td { code { (w) } } } }
                @if let Some(c) = &s.container { tr { th { "container" } td { code { (c.image) } } } }
                @if !s.env.is_empty() { tr { th { "environment" } td { @for (k, v) in &s.env { code { (k) "=" (v) } " " } } } }
            }
            tr { th { "submitted" } td { (utc(job.submitted_at)) " (" (ago(job.submitted_at, p.view.now)) " ago)" } }
            @if let Some(u) = &job.usage {
                tr { th { "used" } td {
                    (u.cpu_ms / 1000) " CPU-seconds, peak memory " (u.peak_memory_bytes >> 20) " MiB"
                    @if u.oom_kills > 0 { ", " (u.oom_kills) " OOM kill(s)" }
                    @if u.gpu_samples > 0 { ", GPU SM " (u.gpu_sm_percent_sum / u.gpu_samples) "% on average, GPU memory peak " (u.gpu_peak_memory_bytes >> 20) " MiB" }
                    " (" (u.tasks_measured) " task(s) measured)"
                } }
            }
        }
        h2 { "Allocations" }
        @let live: Vec<_> = p.cluster.allocations_of(job.id).collect();
        @if live.is_empty() {
            p.muted { "None live." }
        } @else {
            table.list {
                thead { tr { th { "allocation" } th { "node" } th { "GPUs" } th { "since" } th { "state" } } }
                tbody { @for rec in &live {
                    @let a = &rec.allocation;
                    tr {
                        td { (a.id) }
                        td { (node_link(&a.node)) }
                        td {
                            @if a.gpu_milli > 0 { (gpus(u64::from(a.gpu_milli))) " of " }
                            @for (i, g) in a.gpus.iter().enumerate() { @if i > 0 { ", " } code.small { (g) } }
                        }
                        td.nowrap { (ago(a.created_at, p.view.now)) " ago" }
                        td { @if rec.stop_requested { "stopping" } @else if rec.started { "running" } @else { "starting" } }
                    }
                } }
            }
        }
        @if !job.attempts.is_empty() {
            h2 { "Attempts" }
            table.list {
                thead { tr { th { "attempt" } th { "allocations (one per task)" } } }
                tbody { @for (i, ids) in job.attempts.iter().enumerate() {
                    tr { td { (i + 1) } td { @for (k, a) in ids.iter().enumerate() { @if k > 0 { ", " } (a) } } }
                } }
            }
        }
        h2 { "History" }
        table.list {
            thead { tr { th { "at (UTC)" } th { "state" } th { "reason" } } }
            tbody { @for h in &job.history {
                tr { td.nowrap { (utc(h.at)) } td { (state_badge(h.state)) } td { (h.reason) } }
            } }
        }
        h2 { "Logs" }
        @match logs {
            Logs::Withheld => p.muted { "Withheld in the summary view: `gpuctl logs " (job.id) "` reads them with your credentials." },
            Logs::Unavailable(why) => p.muted { (why) },
            Logs::Tail(t) => {
                p.muted { "Task 0 of attempt " (t.attempt) " of " (t.attempts) " on " (node_link(&t.node)) ": the last " (LOG_TAIL_BYTES / 1024) " KiB of each stream (`gpuctl logs " (job.id) "` for all)." }
                h3 { "stdout" }
                pre.log { @if t.stdout.is_empty() { span.muted { "(empty)" } } @else { (t.stdout) } }
                @if !t.stderr.is_empty() { h3 { "stderr" } pre.log { (t.stderr) } }
            },
        }
    }
}

fn archived_body(p: &Page, a: &ArchivedJob) -> Markup {
    let full = p.view.mode.shows_details();
    html! {
        h1 { "Job " (a.id) " " (state_badge(a.state)) }
        p.notice { "Archived: its full record (spec, history, placement and logs' location) was dropped by retention; this is what is kept." }
        table.kv {
            tr { th { "tenant" } td { (a.tenant()) } }
            tr { th { "name" } td { @if full { (a.name()) } @else { span.muted { "(withheld)" } } } }
            tr { th { "submitted" } td { (utc(a.submitted_at)) } }
            tr { th { "ended" } td { (utc(a.ended_at)) " (" (ago(a.ended_at, p.view.now)) " ago)" } }
            tr { th { "reason" } td { (a.reason()) } }
        }
    }
}

/// A command as a shell would read it back: words with spaces or quotes are quoted.
fn shell_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            if !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
