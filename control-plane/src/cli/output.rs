//! How `gpuctl` prints things: aligned tables for people, JSON for programs.

use proto::v1 as pb;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    /// Manifests for `get`/`describe` (`kind: GpuJob`); elsewhere JSON, which is YAML too.
    Yaml,
    /// More columns for `get`; elsewhere the table.
    Wide,
}

impl Format {
    /// Machine-readable output (json, or yaml where a command has no YAML of its own).
    pub fn is_json(self) -> bool {
        matches!(self, Format::Json | Format::Yaml)
    }

    /// Tables for people (table, or wide where a command has no wider one).
    pub fn is_table(self) -> bool {
        matches!(self, Format::Table | Format::Wide)
    }
}

/// Left-aligned columns separated by two spaces, like `squeue` and `kubectl get`: no borders,
/// no lines, no trailing blanks; widths are display widths (`comfy-table`), so wide
/// characters in a name keep the columns straight.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(headers.iter().copied());
    for row in rows {
        t.add_row(row.iter().take(headers.len()));
    }
    let last = headers.len().saturating_sub(1);
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((0, if i == last { 0 } else { 2 }));
    }
    let mut out = String::new();
    for line in t.lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// UTC time of a millisecond timestamp, as `2026-12-02 15:52:18`.
pub fn format_time(at_ms: u64) -> String {
    let at = i128::from(at_ms) * 1_000_000;
    match time::OffsetDateTime::from_unix_timestamp_nanos(at) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        // Beyond the year 9999: not a time anyone set on purpose.
        Err(_) => format!("{at_ms} ms after the epoch"),
    }
}

pub fn format_duration(secs: u64) -> String {
    if secs == 0 {
        return "-".into();
    }
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

/// Seconds since `at_ms`, as an age ("5s", "3m", "2h", "4d").
pub fn age(at_ms: u64, now_ms: u64) -> String {
    let s = now_ms.saturating_sub(at_ms) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

fn dependency_json(d: &pb::Dependency) -> Value {
    let kind = match pb::dependency::Kind::try_from(d.kind) {
        Ok(pb::dependency::Kind::AfterOk) => "afterok",
        Ok(pb::dependency::Kind::AfterAny) => "afterany",
        Ok(pb::dependency::Kind::AfterNotOk) => "afternotok",
        _ => "unknown",
    };
    json!({"kind": kind, "job": d.job_id})
}

pub fn job_json(j: &pb::Job) -> Value {
    let spec = j.spec.clone().unwrap_or_default();
    json!({
        "id": j.id,
        "tenant": spec.tenant,
        "name": spec.name,
        "state": j.state,
        "command": spec.command,
        "gpus_per_task": spec.gpus_per_task,
        "tasks": spec.tasks,
        "gpu_models": spec.gpu_models,
        "partition": spec.partition,
        "priority_class": spec.priority_class,
        "time_limit_secs": spec.time_limit_secs,
        "dependencies": spec.dependencies.iter().map(dependency_json).collect::<Vec<_>>(),
        "cpu_milli_per_task": spec.cpu_milli_per_task,
        "memory_mib_per_task": spec.memory_mib_per_task,
        "env": spec.env,
        "workdir": if spec.workdir.is_empty() { Value::Null } else { json!(spec.workdir) },
        "container": spec.container.as_ref().map(|c| json!({
            "image": c.image,
            "mounts": c.mounts.iter().map(|m| json!({
                "source": m.source, "target": m.target, "read_only": m.read_only,
            })).collect::<Vec<_>>(),
        })),
        "idempotency_key": j.idempotency_key,
        "submitted_at_ms": j.submitted_at_ms,
        "version": j.version,
        "redacted": j.redacted,
        "pending_reason": j.pending_reason,
        "history": j.history.iter().map(|h| json!({"at_ms": h.at_ms, "state": h.state, "reason": h.reason})).collect::<Vec<_>>(),
        "allocations": j.allocations.iter().map(|a| json!({
            "id": a.id, "node": a.node, "gpus": a.gpus, "term": a.term, "epoch": a.epoch, "created_at_ms": a.created_at_ms,
            "enforcement": a.enforcement,
        })).collect::<Vec<_>>(),
        "usage": j.usage.as_ref().map(|u| json!({
            "cpu_ms": u.cpu_ms, "peak_memory_bytes": u.peak_memory_bytes,
            "oom_kills": u.oom_kills, "tasks_measured": u.tasks_measured,
            "gpu_sm_percent_avg": u.gpu_sm_percent_avg, "gpu_peak_memory_bytes": u.gpu_peak_memory_bytes,
            "gpu_samples": u.gpu_samples,
        })),
    })
}

pub fn jobs_table(jobs: &[pb::Job], now_ms: u64) -> String {
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let spec = j.spec.clone().unwrap_or_default();
            let nodes: Vec<&str> = j.allocations.iter().map(|a| a.node.as_str()).collect();
            // A pending job shows why it is pending (the leader's last pass), as squeue's
            // NODELIST(REASON) does; others their last change.
            let reason = if j.pending_reason.is_empty() {
                j.history
                    .last()
                    .map(|h| h.reason.clone())
                    .unwrap_or_default()
            } else {
                j.pending_reason.clone()
            };
            vec![
                j.id.to_string(),
                printable(&spec.tenant),
                if j.redacted {
                    "(hidden)".into()
                } else if spec.name.is_empty() {
                    printable(&spec.command.first().cloned().unwrap_or_default())
                } else {
                    printable(&spec.name)
                },
                j.state.to_uppercase(),
                format!("{}x{}", spec.tasks, spec.gpus_per_task),
                if spec.partition.is_empty() {
                    "-".into()
                } else {
                    spec.partition
                },
                format_duration(spec.time_limit_secs as u64),
                age(j.submitted_at_ms, now_ms),
                if nodes.is_empty() {
                    printable(&reason)
                } else {
                    nodes.join(",")
                },
            ]
        })
        .collect();
    table(
        &[
            "JOBID",
            "TENANT",
            "NAME",
            "STATE",
            "TASKSxGPUS",
            "PARTITION",
            "TIME_LIMIT",
            "AGE",
            "NODES/REASON",
        ],
        &rows,
    )
}

pub fn job_details(j: &pb::Job) -> String {
    let spec = j.spec.clone().unwrap_or_default();
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<14} {v}\n"));
    kv("Job:", j.id.to_string());
    kv("State:", j.state.to_uppercase());
    if !j.pending_reason.is_empty() {
        kv("Reason:", printable(&j.pending_reason));
    }
    kv("Tenant:", printable(&spec.tenant));
    if j.redacted {
        kv(
            "Name:",
            "(withheld: another tenant's job; its name, command and environment are private)"
                .into(),
        );
    } else {
        kv("Name:", printable(&spec.name));
        kv("Command:", printable(&spec.command.join(" ")));
        if !spec.workdir.is_empty() {
            kv("Workdir:", printable(&spec.workdir));
        }
        if let Some(c) = &spec.container {
            kv("Container:", printable(&c.image));
            for m in &c.mounts {
                kv(
                    "Mount:",
                    printable(&format!(
                        "{} -> {}{}",
                        m.source,
                        m.target,
                        if m.read_only { " (read-only)" } else { "" }
                    )),
                );
            }
        }
    }
    kv(
        "Resources:",
        format!(
            "{} task(s) x {} GPU(s), {} mCPU, {} MiB per task",
            spec.tasks, spec.gpus_per_task, spec.cpu_milli_per_task, spec.memory_mib_per_task
        ),
    );
    kv(
        "GPU models:",
        if spec.gpu_models.is_empty() {
            "any".into()
        } else {
            spec.gpu_models.join("|")
        },
    );
    kv(
        "Partition:",
        if spec.partition.is_empty() {
            "-".into()
        } else {
            spec.partition.clone()
        },
    );
    kv("Priority:", spec.priority_class.clone());
    kv("Time limit:", format_duration(spec.time_limit_secs as u64));
    if !spec.dependencies.is_empty() {
        let deps: Vec<String> = spec
            .dependencies
            .iter()
            .map(|d| {
                let v = dependency_json(d);
                format!("{}:{}", v["kind"].as_str().unwrap_or("?"), d.job_id)
            })
            .collect();
        kv("Dependencies:", deps.join(","));
    }
    if !j.idempotency_key.is_empty() {
        kv("Idem. key:", j.idempotency_key.clone());
    }
    for a in &j.allocations {
        kv(
            "Allocation:",
            format!(
                "{} on {} GPUs [{}] (term {})",
                a.id,
                a.node,
                a.gpus.join(", "),
                a.term
            ),
        );
        kv(
            "Enforced:",
            if a.enforcement.is_empty() {
                "not reported by the node's agent".into()
            } else {
                printable(&a.enforcement)
            },
        );
    }
    if let Some(u) = &j.usage {
        kv("Usage:", usage_text(u));
    }
    out.push_str("History:\n");
    for h in &j.history {
        out.push_str(&format!(
            "  {}  {:<10} {}\n",
            format_time(h.at_ms),
            h.state.to_uppercase(),
            printable(&h.reason)
        ));
    }
    out
}

/// "CPU 12.3 s, peak memory 512 MiB (2 tasks measured), 1 OOM kill".
pub fn usage_text(u: &pb::JobUsage) -> String {
    let mut text = format!(
        "CPU {:.1} s, peak memory {} MiB ({} task(s) measured)",
        u.cpu_ms as f64 / 1000.0,
        u.peak_memory_bytes / (1 << 20),
        u.tasks_measured
    );
    if u.oom_kills > 0 {
        text.push_str(&format!(", {} OOM kill(s)", u.oom_kills));
    }
    if u.gpu_samples > 0 {
        text.push_str(&format!(
            "; GPU: {}% SM busy on average, peak {} MiB GPU memory ({} samples)",
            u.gpu_sm_percent_avg,
            u.gpu_peak_memory_bytes >> 20,
            u.gpu_samples
        ));
    }
    text
}

pub fn node_json(n: &pb::Node) -> Value {
    json!({
        "name": n.name,
        "status": n.status,
        "partition": n.partition,
        "labels": n.labels,
        "cpu_milli": n.cpu_milli,
        "memory_mib": n.memory_mib,
        "registered_at_ms": n.registered_at_ms,
        "agent_release": if n.agent_release.is_empty() { Value::Null } else { json!(n.agent_release) },
        "enforcement": if n.enforcement.is_empty() { Value::Null } else { json!(n.enforcement) },
        "container_runtime": if n.container_runtime.is_empty() { Value::Null } else { json!(n.container_runtime) },
        "gpus": n.gpus.iter().map(|g| json!({
            "uuid": g.uuid, "index": g.index, "model": g.model, "memory_mib": g.memory_mib,
            "numa_node": if g.numa_node < 0 { Value::Null } else { json!(g.numa_node) },
            "pci_bus_id": g.pci_bus_id, "health": g.health, "health_reason": g.health_reason,
            "allocation": if g.allocation == 0 { Value::Null } else { json!(g.allocation) },
        })).collect::<Vec<_>>(),
    })
}

/// `control_plane_release` is the answering replica's: each agent's release is flagged
/// against it (`release::Skew`).
/// `node_json` with the agent's skew against `control_plane_release`: "same", "one-behind"
/// or "unsupported".
pub fn node_json_with_skew(n: &pb::Node, control_plane_release: &str) -> Value {
    let mut value = node_json(n);
    value["agent_skew"] = json!(match crate::release::Skew::of(
        &n.agent_release,
        control_plane_release
    ) {
        crate::release::Skew::Same => "same",
        crate::release::Skew::OneBehind => "one-behind",
        crate::release::Skew::Unsupported => "unsupported",
    });
    value
}

pub fn nodes_table(nodes: &[pb::Node], control_plane_release: Option<&str>) -> String {
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let used = n.gpus.iter().filter(|g| g.allocation != 0).count();
            let unhealthy = n.gpus.iter().filter(|g| g.health != "healthy").count();
            let mut models: Vec<&str> = n.gpus.iter().map(|g| g.model.as_str()).collect();
            models.dedup();
            vec![
                n.name.clone(),
                n.status.to_uppercase(),
                if n.partition.is_empty() {
                    "-".into()
                } else {
                    n.partition.clone()
                },
                models.join(","),
                format!("{used}/{}", n.gpus.len()),
                unhealthy.to_string(),
                format!("{}", n.cpu_milli / 1000),
                format!("{}", n.memory_mib / 1024),
                match control_plane_release {
                    Some(cp) => agent_cell(&n.agent_release, cp),
                    None => crate::release::agent_release_text(&n.agent_release),
                },
                if n.container_runtime.is_empty() {
                    enforcement_cell(&n.enforcement)
                } else {
                    // The node also runs container jobs.
                    format!("{}+docker", enforcement_cell(&n.enforcement))
                },
            ]
        })
        .collect();
    table(
        &[
            "NODE",
            "STATUS",
            "PARTITION",
            "MODEL",
            "GPUS_USED",
            "UNHEALTHY",
            "CPUS",
            "MEM_GIB",
            "AGENT",
            "ENFORCED",
        ],
        &rows,
    )
}

/// A node's enforcement for a table: the hierarchy ("cgroup-v1"), "UNENFORCED" (the reason is
/// in `-o json` and the agent's log), or "?" from an agent that does not report it.
fn enforcement_cell(enforcement: &str) -> String {
    if enforcement.is_empty() {
        "?".into()
    } else if enforcement.starts_with("unenforced") {
        "UNENFORCED".into()
    } else if enforcement.contains("devices NOT enforced") {
        enforcement
            .split(':')
            .next()
            .unwrap_or_default()
            .replace(' ', "-")
            + "-no-devices"
    } else {
        printable(enforcement.split(':').next().unwrap_or_default()).replace(' ', "-")
    }
}

/// An agent's release, flagged when it is not the control plane's.
fn agent_cell(agent_release: &str, control_plane_release: &str) -> String {
    let text = crate::release::agent_release_text(agent_release);
    match crate::release::Skew::of(agent_release, control_plane_release) {
        crate::release::Skew::Same => text,
        skew => format!("{text} ({skew})"),
    }
}

pub fn status_json(s: &pb::ClusterStatusResponse) -> Value {
    let leads = s.leader != 0 && s.leader == s.id;
    json!({
        "cluster": s.cluster,
        "answered_by": s.id,
        "leader": if s.leader == 0 { Value::Null } else { json!(s.leader) },
        "term": s.term,
        "commit_index": s.commit_index,
        "applied_index": s.applied_index,
        "last_log_index": s.last_log_index,
        "snapshot_index": s.snapshot_index,
        "state": s.state,
        "removed": if s.removed.is_empty() { Value::Null } else { json!(s.removed) },
        "reachable_window_ms": s.reachable_window_ms,
        "jobs": s.jobs,
        "nodes": s.nodes,
        "members": s.members.iter().map(|m| json!({
            "id": m.id, "address": m.address, "role": m.role, "matched_index": m.matched_index,
            "leader": m.id == s.leader,
            "reachable": m.reachable,
            "last_contact_ms_ago": m.last_contact_ms_ago,
            "lag": if leads { json!(m.lag) } else { Value::Null },
            "release": if m.release.is_empty() { Value::Null } else { json!(m.release) },
            "format_max": if m.format_max == 0 { Value::Null } else { json!(m.format_max) },
        })).collect::<Vec<_>>(),
        "cluster_version": s.cluster_version,
        "release": s.release,
        "cluster_version_pending": if s.cluster_version_pending.is_empty() { Value::Null } else { json!(s.cluster_version_pending) },
        "security_enforced": s.security_enforced,
        "certificates": s.certificates.iter().map(|c| json!({
            "subject": c.subject, "not_after_ms": c.not_after_ms,
        })).collect::<Vec<_>>(),
        "refusals": s.refusals.iter().map(|c| (c.name.clone(), json!(c.value))).collect::<serde_json::Map<_, _>>(),
    })
}

/// How many more voters the cluster can lose, from the leader's view of who answers.
pub fn fault_tolerance_line(s: &pb::ClusterStatusResponse) -> Option<String> {
    if s.leader == 0 || s.leader != s.id {
        return None;
    }
    let voters: Vec<&pb::Member> = s.members.iter().filter(|m| m.role == "voter").collect();
    let answering = voters.iter().filter(|m| m.reachable).count();
    let quorum = voters.len() / 2 + 1;
    let spare = answering.saturating_sub(quorum);
    let mut line = format!(
        "{} voters, {answering} answering, a majority is {quorum}: ",
        voters.len()
    );
    if answering < quorum {
        line.push_str("NO QUORUM, the cluster cannot commit");
    } else if spare == 0 {
        line.push_str("WARNING: losing one more voter stops the cluster");
    } else {
        line.push_str(&format!("the cluster survives the loss of {spare} more"));
    }
    Some(line)
}

fn ago(ms: Option<u64>) -> String {
    match ms {
        None => "never".into(),
        Some(ms) if ms < 10_000 => format!("{ms} ms ago"),
        Some(ms) => format!("{} s ago", ms / 1000),
    }
}

/// Lines warning about certificates that expire within a month (or have expired).
pub fn certificate_warnings(s: &pb::ClusterStatusResponse, now_ms: u64) -> Vec<String> {
    s.certificates
        .iter()
        .filter_map(|c| {
            let what = if c.subject == "ca" {
                "the cluster CA certificate".to_owned()
            } else {
                format!("certificate {}", c.subject)
            };
            proto::tls::expiry_warning(&what, c.not_after_ms, now_ms)
        })
        .collect()
}

pub fn status_text(s: &pb::ClusterStatusResponse) -> String {
    let leads = s.leader != 0 && s.leader == s.id;
    let mut out = format!(
        "cluster {}: leader {}, term {}, commit index {}, applied {} (answered by replica {}, {})\n",
        s.cluster,
        if s.leader == 0 {
            "none known now".to_owned()
        } else {
            s.leader.to_string()
        },
        s.term,
        s.commit_index,
        s.applied_index,
        s.id,
        s.state
    );
    if !s.removed.is_empty() {
        out.push_str(&format!("REMOVED: {}\n", s.removed));
    }
    if !leads {
        out.push_str(
            "(not the leader's view: which members answer, and how far they have replicated, only the leader knows)\n",
        );
    }
    out.push('\n');
    let rows: Vec<Vec<String>> = s
        .members
        .iter()
        .map(|m| {
            vec![
                m.id.to_string(),
                m.address.clone(),
                if m.id == s.leader {
                    format!("{} (leader)", m.role)
                } else {
                    m.role.clone()
                },
                // A follower hears only from the leader: of the others it knows nothing.
                if !leads && m.id != s.id && m.id != s.leader {
                    "-".to_owned()
                } else if m.reachable {
                    "yes".to_owned()
                } else {
                    "NO".to_owned()
                },
                if !leads && m.id != s.id && m.id != s.leader {
                    "-".to_owned()
                } else {
                    ago(m.last_contact_ms_ago)
                },
                if leads {
                    m.matched_index.to_string()
                } else {
                    "-".into()
                },
                if leads { m.lag.to_string() } else { "-".into() },
                if m.release.is_empty() {
                    "-".to_owned()
                } else {
                    format!("{} (format {})", m.release, m.format_max)
                },
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "ID",
            "ADDRESS",
            "ROLE",
            "REACHABLE",
            "LAST_CONTACT",
            "MATCHED_INDEX",
            "LAG",
            "RELEASE",
        ],
        &rows,
    ));
    out.push_str(&format!(
        "\ncluster version {} (entries and snapshots are written in format {}){}\n",
        s.cluster_version,
        s.cluster_version,
        if s.cluster_version_pending.is_empty() {
            String::new()
        } else {
            format!("; not raised yet: {}", s.cluster_version_pending)
        }
    ));
    if let Some(line) = fault_tolerance_line(s) {
        out.push_str(&format!("\n{line}\n"));
    }
    out.push_str(&format!("\n{} jobs, {} nodes\n", s.jobs, s.nodes));
    if !s.security_enforced {
        out.push_str("\nSECURITY OFF: replica runs with --insecure (no TLS, no authentication)\n");
    } else {
        let refused: Vec<String> = s
            .refusals
            .iter()
            .filter(|c| c.value > 0)
            .map(|c| format!("{} {}", c.value, c.name))
            .collect();
        if !refused.is_empty() {
            out.push_str(&format!(
                "\nrefused by replica {}: {}\n",
                s.id,
                refused.join(", ")
            ));
        }
    }
    for w in certificate_warnings(s, crate::replica::now_ms()) {
        out.push_str(&format!("WARNING: {w}\n"));
    }
    out
}

/// A user-supplied string made safe for a terminal: control characters (escapes, newlines)
/// are shown escaped, so a value can neither forge a table row nor drive the terminal.
pub fn printable(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_owned();
    }
    s.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

pub fn token_json(t: &pb::Token) -> Value {
    json!({
        "id": t.id, "role": t.role, "tenant": t.tenant, "description": t.description,
        "created_at_ms": t.created_at_ms, "created_by": t.created_by,
        "expires_at_ms": t.expires_at_ms, "revoked_at_ms": t.revoked_at_ms,
        "revoked_by": t.revoked_by,
    })
}

pub fn tokens_table(tokens: &[pb::Token], now_ms: u64) -> String {
    let rows: Vec<Vec<String>> = tokens
        .iter()
        .map(|t| {
            let state = if t.revoked_at_ms != 0 {
                format!("revoked {}", format_time(t.revoked_at_ms))
            } else if t.expires_at_ms != 0 && t.expires_at_ms <= now_ms {
                "expired".into()
            } else if t.expires_at_ms != 0 {
                format!("expires {}", format_time(t.expires_at_ms))
            } else {
                "active".into()
            };
            vec![
                t.id.clone(),
                t.role.clone(),
                if t.tenant.is_empty() {
                    "-".into()
                } else {
                    printable(&t.tenant)
                },
                state,
                format_time(t.created_at_ms),
                printable(&t.created_by),
                printable(&t.description),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "ROLE",
            "TENANT",
            "STATE",
            "CREATED",
            "BY",
            "DESCRIPTION",
        ],
        &rows,
    )
}

pub fn audit_json(a: &pb::AuditRecord) -> Value {
    json!({
        "seq": a.seq, "at_ms": a.at_ms, "principal": a.principal, "role": a.role,
        "tenant": a.tenant, "from": a.from, "action": a.action, "target": a.target,
        "job_id": if a.job_id == 0 { Value::Null } else { json!(a.job_id) },
        "detail": a.detail,
    })
}

pub fn audit_table(records: &[pb::AuditRecord]) -> String {
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|a| {
            let who = if a.tenant.is_empty() {
                format!("{} ({})", a.principal, a.role)
            } else {
                format!("{} ({}, {})", a.principal, a.role, a.tenant)
            };
            vec![
                format_time(a.at_ms),
                printable(&who),
                printable(&a.from),
                a.action.clone(),
                printable(&a.target),
                printable(&a.detail),
            ]
        })
        .collect();
    table(
        &["TIME", "WHO", "FROM", "ACTION", "TARGET", "DETAIL"],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_columns_align() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONGER\nxyz  1\n");
    }

    #[test]
    fn tables_are_plain_and_width_aware() {
        let t = table(
            &["ID", "NAME", "STATE"],
            &[
                vec!["1".into(), "日本語".into(), "RUNNING".into()],
                vec!["22".into(), "".into(), "".into()],
            ],
        );
        assert_eq!(t, "ID  NAME    STATE\n1   日本語  RUNNING\n22\n");
        assert_eq!(table(&["A"], &[]), "A\n");
    }

    #[test]
    fn times_print_in_utc() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_time(1_796_226_738_000), "2026-12-02 15:52:18");
        assert_eq!(format_time(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(
            format_time(u64::MAX),
            "18446744073709551615 ms after the epoch"
        );
    }

    #[test]
    fn durations_read_like_slurm() {
        assert_eq!(format_duration(86_400 + 3661), "1-01:01:01");
        assert_eq!(format_duration(59), "00:00:59");
        assert_eq!(format_duration(0), "-");
    }
}
