//! How `gpuctl` prints things: aligned tables for people, JSON for programs.

use proto::v1 as pb;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    /// Manifests for `get`/`describe` (`kind: GpuJob`, `kind: GpuService`); elsewhere JSON,
    /// which is YAML too.
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

/// JSON null for 0 (an unset number).
fn non_zero(v: impl Into<u64>) -> Value {
    match v.into() {
        0 => Value::Null,
        v => json!(v),
    }
}

/// JSON null for "" (an unset string).
fn non_empty(s: &str) -> Value {
    if s.is_empty() { Value::Null } else { json!(s) }
}

pub fn job_json(j: &pb::Job) -> Value {
    let spec = j.spec.clone().unwrap_or_default();
    let mut v = json!({
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
        "workdir": non_empty(&spec.workdir),
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
        "held": j.held,
        "array": j.array_task.as_ref().map(|t| json!({
            "array_id": t.array_id, "index": t.index, "count": t.count,
            "spec": spec.array.as_ref().map(array_text),
        })),
        "nodelist": spec.nodelist,
        "exclude": spec.exclude,
        "exclusive": spec.exclusive,
        "begin_at_ms": (spec.begin_at_ms > 0).then_some(spec.begin_at_ms),
        "history": j.history.iter().map(|h| json!({"at_ms": h.at_ms, "state": h.state, "reason": h.reason})).collect::<Vec<_>>(),
        "allocations": j.allocations.iter().map(|a| json!({
            "id": a.id, "node": a.node, "gpus": a.gpus, "term": a.term, "epoch": a.epoch, "created_at_ms": a.created_at_ms,
            "gpu_milli": non_zero(a.gpu_milli),
            "gpu_memory_mib": non_zero(a.gpu_memory_mib),
            "enforcement": a.enforcement,
        })).collect::<Vec<_>>(),
        "usage": j.usage.as_ref().map(|u| json!({
            "cpu_ms": u.cpu_ms, "peak_memory_bytes": u.peak_memory_bytes,
            "oom_kills": u.oom_kills, "tasks_measured": u.tasks_measured,
            "gpu_sm_percent_avg": u.gpu_sm_percent_avg, "gpu_peak_memory_bytes": u.gpu_peak_memory_bytes,
            "gpu_samples": u.gpu_samples,
        })),
    });
    // Shares, MIG, placement constraints, output files, attempts (one json! holds so many).
    let more = json!({
        "gpu_milli": non_zero(spec.gpu_milli),
        "gpu_memory_mib": non_zero(spec.gpu_memory_mib),
        "mig_profile": non_empty(&spec.mig_profile),
        "preemptible": spec.preemptible,
        "single_numa": spec.single_numa,
        "hold_if_unfit": spec.hold_if_unfit,
        "stdout_path": non_empty(&spec.stdout_path),
        "stderr_path": non_empty(&spec.stderr_path),
        "attempts": j.attempts,
    });
    if let (Value::Object(v), Value::Object(more)) = (&mut v, more) {
        v.extend(more);
    }
    v
}

/// The default `gpuctl queue` table (`columns::DEFAULT_JOB_COLUMNS`).
pub fn jobs_table(jobs: &[pb::Job], now_ms: u64) -> String {
    use super::columns::{DEFAULT_JOB_COLUMNS, JOBS, JobContext};
    JOBS.render(
        &JOBS.named(DEFAULT_JOB_COLUMNS),
        jobs,
        &JobContext { now_ms },
    )
}

/// An array's indices and limit as sbatch spells them: `0-99:2,200%8`.
pub fn array_text(a: &pb::ArraySpec) -> String {
    super::slurm_syntax::array_spec(a).text()
}

pub fn job_details(j: &pb::Job) -> String {
    let spec = j.spec.clone().unwrap_or_default();
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<14} {v}\n"));
    kv("Job:", j.id.to_string());
    if let Some(t) = &j.array_task {
        kv(
            "Array:",
            format!(
                "{}_{} (index {} of array {}: {} jobs, {})",
                t.array_id,
                t.index,
                t.index,
                t.array_id,
                t.count,
                spec.array.as_ref().map(array_text).unwrap_or_default()
            ),
        );
    }
    kv(
        "State:",
        if j.held {
            format!("{} (held)", j.state.to_uppercase())
        } else {
            j.state.to_uppercase()
        },
    );
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
        if !spec.stdout_path.is_empty() {
            kv("Stdout:", printable(&spec.stdout_path));
        }
        if !spec.stderr_path.is_empty() {
            kv("Stderr:", printable(&spec.stderr_path));
        }
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
    if spec.gpu_milli > 0 {
        kv(
            "GPU share:",
            format!(
                "{} milli of one GPU, {}",
                spec.gpu_milli,
                if spec.gpu_memory_mib > 0 {
                    format!("{} MiB of its memory", spec.gpu_memory_mib)
                } else {
                    "GPU memory in proportion".to_owned()
                }
            ),
        );
    }
    if !spec.mig_profile.is_empty() {
        kv(
            "MIG profile:",
            format!("{} (each GPU is a slice)", printable(&spec.mig_profile)),
        );
    }
    let mut placement = Vec::new();
    if spec.single_numa {
        placement.push("all GPUs of a task on one NUMA node");
    }
    if spec.preemptible {
        placement.push("preemptible");
    }
    if spec.hold_if_unfit {
        placement.push("held while no node could fit it");
    }
    if !placement.is_empty() {
        kv("Placement:", placement.join(", "));
    }
    kv(
        "GPU models:",
        if spec.gpu_models.is_empty() {
            "any".into()
        } else {
            printable(&spec.gpu_models.join("|"))
        },
    );
    kv(
        "Partition:",
        if spec.partition.is_empty() {
            "-".into()
        } else {
            printable(&spec.partition)
        },
    );
    kv("Priority:", printable(&spec.priority_class));
    kv("Time limit:", format_duration(spec.time_limit_secs as u64));
    if !spec.nodelist.is_empty() {
        kv("Node list:", printable(&spec.nodelist.join(",")));
    }
    if !spec.exclude.is_empty() {
        kv("Excluded:", printable(&spec.exclude.join(",")));
    }
    if spec.exclusive {
        kv("Exclusive:", "yes: its nodes run nothing else".into());
    }
    if spec.begin_at_ms > 0 {
        kv("Begin:", format_time(spec.begin_at_ms));
    }
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
        kv("Idem. key:", printable(&j.idempotency_key));
    }
    if j.attempts > 0 {
        kv("Attempts:", j.attempts.to_string());
    }
    for a in &j.allocations {
        let share = if a.gpu_milli > 0 {
            format!(
                ", {} milli{}",
                a.gpu_milli,
                if a.gpu_memory_mib > 0 {
                    format!(" and {} MiB", a.gpu_memory_mib)
                } else {
                    String::new()
                }
            )
        } else {
            String::new()
        };
        kv(
            "Allocation:",
            printable(&format!(
                "{} on {} GPUs [{}]{share} (term {})",
                a.id,
                a.node,
                a.gpus.join(", "),
                a.term
            )),
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
        "driver": n.driver,
        "agent_address": n.agent_address,
        "gpus": n.gpus.iter().map(|g| json!({
            "uuid": g.uuid, "index": g.index, "model": g.model, "memory_mib": g.memory_mib,
            "numa_node": if g.numa_node < 0 { Value::Null } else { json!(g.numa_node) },
            "pci_bus_id": g.pci_bus_id, "health": g.health, "health_reason": g.health_reason,
            "allocation": if g.allocation == 0 { Value::Null } else { json!(g.allocation) },
            "shared_milli": g.shared_milli,
            "shared_memory_mib": g.shared_memory_mib,
            "share_allocations": g.share_allocations,
            "mig": g.mig.iter().map(|m| json!({
                "uuid": m.uuid, "profile": m.profile, "memory_mib": m.memory_mib,
                "allocation": if m.allocation == 0 { Value::Null } else { json!(m.allocation) },
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        // Rows of the link matrix, GPU by GPU, as `nvidia-smi topo -m` writes the cells.
        "topology": n.topology.iter().map(|row| row.split_whitespace().collect::<Vec<_>>()).collect::<Vec<_>>(),
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

/// The default `gpuctl nodes` table (`columns::DEFAULT_NODE_COLUMNS`).
pub fn nodes_table(nodes: &[pb::Node], control_plane_release: Option<&str>) -> String {
    use super::columns::{DEFAULT_NODE_COLUMNS, NODES, NodeContext};
    NODES.render(
        &NODES.named(DEFAULT_NODE_COLUMNS),
        nodes,
        &NodeContext {
            control_plane_release: control_plane_release.map(str::to_owned),
        },
    )
}

/// One node in detail (`gpuctl node show`): its facts, each GPU (NUMA node, PCI bus, health,
/// holder, shares, MIG slices) and the link matrix as `nvidia-smi topo -m` prints it.
pub fn node_details(n: &pb::Node, control_plane_release: &str) -> String {
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<14} {v}\n"));
    kv("Node:", printable(&n.name));
    kv("Status:", printable(&n.status.to_uppercase()));
    kv(
        "Partition:",
        if n.partition.is_empty() {
            "-".into()
        } else {
            printable(&n.partition)
        },
    );
    let mut labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    if !labels.is_empty() {
        kv("Labels:", printable(&labels.join(", ")));
    }
    kv(
        "Resources:",
        format!(
            "{} GPUs, {} mCPU, {} MiB",
            n.gpus.len(),
            n.cpu_milli,
            n.memory_mib
        ),
    );
    kv(
        "Agent:",
        agent_cell(&n.agent_release, control_plane_release),
    );
    kv("Address:", printable(&n.agent_address));
    kv("Driver:", printable(&n.driver));
    kv(
        "Enforced:",
        if n.enforcement.is_empty() {
            "not reported by the node's agent".into()
        } else {
            printable(&n.enforcement)
        },
    );
    if !n.container_runtime.is_empty() {
        kv("Containers:", printable(&n.container_runtime));
    }
    kv("Registered:", format_time(n.registered_at_ms));
    out.push('\n');
    let rows: Vec<Vec<String>> = n
        .gpus
        .iter()
        .map(|g| {
            let held = if g.allocation != 0 {
                format!("allocation {}", g.allocation)
            } else if g.shared_milli > 0 {
                let ids: Vec<String> = g.share_allocations.iter().map(u64::to_string).collect();
                format!("{} milli shared ({})", g.shared_milli, ids.join(","))
            } else {
                "-".into()
            };
            let mig: Vec<String> = g
                .mig
                .iter()
                .map(|m| {
                    if m.allocation == 0 {
                        printable(&m.profile)
                    } else {
                        format!("{}@{}", printable(&m.profile), m.allocation)
                    }
                })
                .collect();
            vec![
                g.index.to_string(),
                printable(&g.model),
                format!("{}", g.memory_mib),
                if g.numa_node < 0 {
                    "?".into()
                } else {
                    g.numa_node.to_string()
                },
                if g.pci_bus_id.is_empty() {
                    "-".into()
                } else {
                    printable(&g.pci_bus_id)
                },
                if g.health == "healthy" {
                    "healthy".into()
                } else {
                    printable(&format!("{}: {}", g.health, g.health_reason))
                },
                held,
                if mig.is_empty() {
                    "-".into()
                } else {
                    mig.join(",")
                },
                printable(&g.uuid),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "GPU", "MODEL", "MEM_MIB", "NUMA", "PCI", "HEALTH", "HELD_BY", "MIG", "UUID",
        ],
        &rows,
    ));
    if !n.topology.is_empty() {
        out.push_str("\nTopology (nvidia-smi topo -m):\n");
        out.push_str(&topology_matrix(n));
    }
    out
}

/// The link matrix with a GPU header and each row's NUMA affinity, as `nvidia-smi topo -m`.
pub fn topology_matrix(n: &pb::Node) -> String {
    let count = n.topology.len();
    let mut headers: Vec<String> = vec![String::new()];
    headers.extend((0..count).map(|i| format!("GPU{i}")));
    headers.push("NUMA Affinity".into());
    let rows: Vec<Vec<String>> = n
        .topology
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let mut cells = vec![format!("GPU{i}")];
            cells.extend(row.split_whitespace().map(printable));
            cells.resize(count + 1, "?".into());
            let numa = n
                .gpus
                .iter()
                .find(|g| g.index as usize == i)
                .filter(|g| g.numa_node >= 0)
                .map_or("N/A".into(), |g| g.numa_node.to_string());
            cells.push(numa);
            cells
        })
        .collect();
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    table(&headers, &rows)
}

/// A node's enforcement for a table: the hierarchy ("cgroup-v1"), "UNENFORCED" (the reason is
/// in `-o json` and the agent's log), or "?" from an agent that does not report it.
pub(crate) fn enforcement_cell(enforcement: &str) -> String {
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
pub(crate) fn agent_cell(agent_release: &str, control_plane_release: &str) -> String {
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
    fn node_details_show_numa_shares_mig_and_the_matrix() {
        let gpu = |index: u32, numa: i32| pb::Gpu {
            index,
            uuid: format!("GPU-{index}"),
            model: "A100".into(),
            memory_mib: 81_920,
            numa_node: numa,
            health: "healthy".into(),
            ..Default::default()
        };
        let mut g1 = gpu(1, 1);
        g1.shared_milli = 500;
        g1.share_allocations = vec![7, 9];
        let mut g0 = gpu(0, 0);
        g0.mig = vec![pb::MigSlice {
            profile: "3g.40gb".into(),
            allocation: 4,
            ..Default::default()
        }];
        let n = pb::Node {
            name: "gpu-1".into(),
            status: "ready".into(),
            gpus: vec![g0, g1],
            topology: vec![
                " X NV12".replace(' ', "\t").trim().replace('\t', " "),
                "NV12 X".into(),
            ],
            ..Default::default()
        };
        let text = node_details(&n, "0.2.0");
        assert!(text.contains("500 milli shared (7,9)"), "{text}");
        assert!(text.contains("3g.40gb@4"), "{text}");
        let matrix = topology_matrix(&n);
        assert_eq!(
            matrix,
            "      GPU0  GPU1  NUMA Affinity\nGPU0  X     NV12  0\nGPU1  NV12  X     1\n"
        );
    }

    /// A hostile name or reason (newlines, terminal escapes) can neither add a row nor reach
    /// the terminal raw, in the queue, in `show` or in `node show`.
    #[test]
    fn user_strings_cannot_forge_rows() {
        let evil = "x\n99  alice  f  RUNNING\u{1b}[2J";
        let j = pb::Job {
            id: 1,
            state: "pending".into(),
            pending_reason: evil.into(),
            spec: Some(pb::JobSpec {
                tenant: "t".into(),
                name: evil.into(),
                command: vec![evil.into()],
                workdir: evil.into(),
                stdout_path: evil.into(),
                gpu_models: vec![evil.into()],
                ..Default::default()
            }),
            history: vec![pb::StateChange {
                reason: evil.into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let queue = jobs_table(std::slice::from_ref(&j), 0);
        assert_eq!(queue.lines().count(), 2, "{queue}");
        let show = job_details(&j);
        assert!(!show.contains('\u{1b}') && !show.contains("\n99"), "{show}");
        let n = pb::Node {
            name: evil.into(),
            labels: [(String::from("k"), evil.to_owned())].into(),
            topology: vec![evil.into()],
            gpus: vec![pb::Gpu {
                model: evil.into(),
                health: "unhealthy".into(),
                health_reason: evil.into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let nodes = nodes_table(std::slice::from_ref(&n), None);
        assert_eq!(nodes.lines().count(), 2, "{nodes}");
        let details = node_details(&n, "0.2.0");
        assert!(
            !details.contains('\u{1b}') && !details.contains("\n99"),
            "{details}"
        );
    }

    #[test]
    fn durations_read_like_slurm() {
        assert_eq!(format_duration(86_400 + 3661), "1-01:01:01");
        assert_eq!(format_duration(59), "00:00:59");
        assert_eq!(format_duration(0), "-");
    }
}
