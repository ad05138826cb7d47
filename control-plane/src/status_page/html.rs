//! What every page shares: the document shell with its navigation bar and banner (which
//! replica answers, who leads), the embedded style sheet, and small formatting helpers.

use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::View;
use crate::state::{JobState, MILLI_PER_GPU, Timestamp};

const STYLE: &str = include_str!("style.css");

/// The pages of the navigation bar: (path, label).
const NAV: [(&str, &str); 5] = [
    ("/", "Cluster"),
    ("/nodes", "Nodes"),
    ("/queue", "Queue"),
    ("/services", "Services"),
    ("/tenants", "Tenants"),
];

/// A whole document: `title`, the navigation bar (with `current` marked), a line that says
/// which replica answered and who leads, then `body`.
pub fn page(view: &View, current: &str, title: &str, body: Markup) -> String {
    let s = view.status;
    let role = if view.is_leader() {
        "leader".to_owned()
    } else if s.state == "removed" {
        "removed from the cluster".to_owned()
    } else {
        match (s.leader, view.leader_address()) {
            (0, _) => "follower; no leader is known".to_owned(),
            (l, Some(addr)) => format!("follower; replica {l} ({addr}) leads"),
            (l, None) => format!("follower; replica {l} leads"),
        }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · " (s.cluster) " · gpu-control-plane" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    span.brand { "gpu-control-plane" }
                    nav {
                        @for (path, label) in NAV {
                            a.current[path == current] href=(path) { (label) }
                        }
                    }
                    span.who {
                        "cluster " b { (s.cluster) } " · replica " b { (s.id) } " · " (role)
                        " · term " (s.term)
                    }
                }
                @if view.mode != super::Mode::Full {
                    p.notice {
                        "Summary view (--status-page summary): job names, commands, environment and logs are withheld, as this port is unauthenticated (docs/SECURITY.md). gpuctl shows them to whoever may see them."
                    }
                }
                main { (body) }
            }
        }
    }
    .into_string()
}

/// The page for a missing job or node (served with 404).
pub fn not_found(view: &View, current: &str, what: &str) -> String {
    page(
        view,
        current,
        "not found",
        html! { h1 { "Not found" } p { (what) } },
    )
}

/// GPUs from milli-GPU: "3", or "2.5" for shares.
pub fn gpus(milli: u64) -> String {
    if milli.is_multiple_of(MILLI_PER_GPU) {
        (milli / MILLI_PER_GPU).to_string()
    } else {
        let s = format!("{:.3}", milli as f64 / MILLI_PER_GPU as f64);
        s.trim_end_matches('0').to_owned()
    }
}

/// How long ago `at` was, from `now`: "5s", "3m", "2h", "4d" (as `gpuctl` prints ages).
pub fn ago(at: Timestamp, now: Timestamp) -> String {
    crate::cli::output::age(at, now)
}

/// A leader timestamp as UTC, to the second.
pub fn utc(at: Timestamp) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(at))
        .to_string()
}

/// A job state as a coloured label.
pub fn state_badge(state: JobState) -> Markup {
    html! { span class={ "st " (state.as_str()) } { (state.as_str()) } }
}

/// A number with thousands separators (8,000).
pub fn count(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A link to a job's page.
pub fn job_link(id: u64) -> Markup {
    html! { a href={ "/jobs/" (id) } { (id) } }
}

/// A link to a node's page. The name is escaped in the text and in the path (node names are
/// validated to DNS-like labels, but the page does not rely on it).
pub fn node_link(name: &str) -> Markup {
    html! { a href={ "/nodes/" (path_segment(name)) } { (name) } }
}

/// `s` percent-encoded for one path segment.
pub fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A bar that fills `part` of `whole` (a quota, a GPU), with a text label.
pub fn bar(part: u64, whole: u64, label: &str) -> Markup {
    let pct = part
        .saturating_mul(100)
        .checked_div(whole)
        .unwrap_or(0)
        .min(100);
    let over = whole > 0 && part > whole;
    html! {
        span.bar title=(label) {
            span.fill.over[over] style={ "width:" (pct) "%" } {}
        }
        " " span.barlabel { (label) }
    }
}

/// What a job asks for, per task and in tasks: "8 GPUs", "2 × 4 GPUs", "0.5 GPU share",
/// "1g.10gb MIG slice", "CPU only".
pub fn shape(spec: &crate::state::JobSpec) -> String {
    let per_task = if spec.is_share() {
        format!("{} GPU share", gpus(u64::from(spec.gpu_milli)))
    } else if let Some(profile) = &spec.mig_profile {
        match spec.gpus_per_task {
            1 => format!("{profile} MIG slice"),
            n => format!("{n} × {profile} MIG slices"),
        }
    } else {
        match spec.gpus_per_task {
            0 => "CPU only".to_owned(),
            1 => "1 GPU".to_owned(),
            n => format!("{n} GPUs"),
        }
    };
    match spec.tasks {
        1 => per_task,
        t => format!("{t} × {per_task}"),
    }
}

/// A job's name as the page may show it: withheld in the summary view.
pub fn job_name<'a>(view: &View, name: &'a str) -> &'a str {
    if view.mode.shows_details() {
        name
    } else {
        "(withheld)"
    }
}
