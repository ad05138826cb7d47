//! How `gpuctl service` prints services: the `get` table (and its wide form), `describe`
//! (spec, each replica, revisions, events, autoscaler), `history`, a rollout's progress line,
//! and JSON for programs. Every string a user or a node supplied goes through `printable`, so
//! a name or an exit reason can neither forge a row nor drive the terminal.

use proto::v1 as pb;
use serde_json::{Value, json};

use super::output::{age, format_time, printable, table};
use super::probe_spec::{check_text, millis_text, probe_text, shell_words};

/// Endpoints the `get` table lists before it says how many more there are.
const ENDPOINTS_SHOWN: usize = 3;

fn spec_of(s: &pb::Service) -> pb::ServiceSpec {
    s.spec.clone().unwrap_or_default()
}

/// What the service's rollout is doing, in one word (a deleted service says so).
pub fn rollout_label(s: &pb::Service) -> String {
    if s.deleting {
        "deleting".into()
    } else {
        printable(&s.rollout)
    }
}

/// A replica's per-GPU ask: "1 GPU", "2 GPUs", "500m GPU + 20480 MiB", "1g.10gb", "CPU only".
pub fn gpu_shape(t: &pb::JobSpec) -> String {
    if t.gpu_milli > 0 {
        let mem = if t.gpu_memory_mib > 0 {
            format!(" + {} MiB", t.gpu_memory_mib)
        } else {
            String::new()
        };
        return format!("{}m GPU{mem}", t.gpu_milli);
    }
    if !t.mig_profile.is_empty() {
        return match t.gpus_per_task {
            1 => printable(&t.mig_profile),
            n => format!("{n}x{}", printable(&t.mig_profile)),
        };
    }
    match t.gpus_per_task {
        0 => "CPU only".into(),
        1 => "1 GPU".into(),
        n => format!("{n} GPUs"),
    }
}

/// The ENDPOINTS cell: the first few `host:port`, then how many more.
fn endpoints_cell(s: &pb::Service) -> String {
    let all: Vec<&str> = s
        .replicas
        .iter()
        .map(|r| r.endpoint.as_str())
        .filter(|e| !e.is_empty())
        .collect();
    if all.is_empty() {
        return "-".into();
    }
    let mut cell = printable(&all[..all.len().min(ENDPOINTS_SHOWN)].join(","));
    if all.len() > ENDPOINTS_SHOWN {
        cell.push_str(&format!(" +{} more", all.len() - ENDPOINTS_SHOWN));
    }
    cell
}

/// `gpuctl service get` (and `get services`): NAME, REPLICAS ready/desired, UP-TO-DATE,
/// REVISION, ROLLOUT, AGE, ENDPOINTS; wide adds TENANT, GPUS, AUTOSCALE and IMAGE.
pub fn services_table(services: &[pb::Service], now_ms: u64, wide: bool) -> String {
    let rows: Vec<Vec<String>> = services
        .iter()
        .map(|s| {
            let spec = spec_of(s);
            let t = spec.template.clone().unwrap_or_default();
            let mut row = vec![
                printable(&spec.name),
                format!("{}/{}", s.ready, spec.replicas),
                s.updated.to_string(),
                s.revision.to_string(),
                rollout_label(s),
                age(s.created_at_ms, now_ms),
                endpoints_cell(s),
            ];
            if wide {
                row.push(printable(&spec.tenant));
                row.push(gpu_shape(&t));
                row.push(match &spec.autoscale {
                    Some(a) => format!("{}-{} on {}", a.min, a.max, printable(&a.metric)),
                    None => "-".into(),
                });
                row.push(
                    t.container
                        .as_ref()
                        .map_or("-".into(), |c| printable(&c.image)),
                );
            }
            row
        })
        .collect();
    let mut headers = vec![
        "NAME",
        "REPLICAS",
        "UP-TO-DATE",
        "REVISION",
        "ROLLOUT",
        "AGE",
        "ENDPOINTS",
    ];
    if wide {
        headers.extend(["TENANT", "GPUS", "AUTOSCALE", "IMAGE"]);
    }
    table(&headers, &rows)
}

/// One line of a rollout's progress, as `rollout status` prints it.
pub fn rollout_line(s: &pb::Service) -> String {
    let spec = spec_of(s);
    let name = printable(&spec.name);
    let counts = format!(
        "{} of {} replicas at revision {}, {} ready",
        s.updated, spec.replicas, s.revision, s.ready
    );
    match s.rollout.as_str() {
        _ if s.deleting => format!("service {name} is being deleted"),
        "complete" => format!("service {name} rolled out: {counts}"),
        "paused" => format!(
            "service {name}'s rollout is paused: {} ({counts})",
            printable(&s.rollout_reason)
        ),
        _ => format!("waiting for service {name}'s rollout: {counts}"),
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        printable(s)
    }
}

/// What a template asks for, in words: GPUs, CPUs, memory.
fn resources_text(t: &pb::JobSpec) -> String {
    let mut parts = vec![match (t.gpu_milli, t.mig_profile.is_empty()) {
        (m, _) if m > 0 => format!(
            "{m} milli of one GPU with {}",
            if t.gpu_memory_mib > 0 {
                format!("{} MiB of its memory", t.gpu_memory_mib)
            } else {
                "memory in proportion".to_owned()
            }
        ),
        (_, false) => format!(
            "{} MIG slice(s) {}",
            t.gpus_per_task,
            printable(&t.mig_profile)
        ),
        _ => format!("{} GPU(s)", t.gpus_per_task),
    }];
    if t.cpu_milli_per_task > 0 {
        parts.push(format!("{} CPUs", t.cpu_milli_per_task as f64 / 1000.0));
    }
    if t.memory_mib_per_task > 0 {
        parts.push(format!("{} MiB memory", t.memory_mib_per_task));
    }
    parts.join(", ")
}

/// `gpuctl service describe`: the spec, each replica, revisions, events and the autoscaler.
pub fn service_details(s: &pb::Service, now_ms: u64) -> String {
    let spec = spec_of(s);
    let t = spec.template.clone().unwrap_or_default();
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<14} {v}\n"));
    kv("Name:", printable(&spec.name));
    kv("Tenant:", printable(&spec.tenant));
    kv(
        "Created:",
        format!(
            "{} ({} ago)",
            format_time(s.created_at_ms),
            age(s.created_at_ms, now_ms)
        ),
    );
    kv(
        "Replicas:",
        format!(
            "{} desired, {} ready, {} at the current revision",
            spec.replicas, s.ready, s.updated
        ),
    );
    kv("Revision:", s.revision.to_string());
    kv(
        "Rollout:",
        match (s.deleting, s.rollout.as_str()) {
            (true, _) => "deleting: every replica is being stopped".into(),
            (false, "paused") => format!(
                "paused: {} (`gpuctl service rollout resume {name}` or `rollout undo {name}`)",
                printable(&s.rollout_reason),
                name = printable(&spec.name)
            ),
            (false, other) => printable(other),
        },
    );
    if t.command.is_empty() {
        kv(
            "Command:",
            "(withheld: another tenant's service; its command, environment and image are private)"
                .into(),
        );
    } else {
        kv("Command:", printable(&shell_words(&t.command)));
    }
    if let Some(c) = &t.container {
        kv("Image:", printable(&c.image));
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
    if !t.workdir.is_empty() {
        kv("Workdir:", printable(&t.workdir));
    }
    if !t.env.is_empty() {
        let mut env: Vec<_> = t.env.iter().collect();
        env.sort();
        let text: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        kv("Environment:", printable(&text.join(" ")));
    }
    kv("Resources:", resources_text(&t));
    kv("Ports:", or_dash(&t.ports.join(", ")));
    let mut placement = vec![format!("priority {}", or_dash(&t.priority_class))];
    if t.preemptible {
        placement.push("preemptible".into());
    }
    if t.single_numa {
        placement.push("one NUMA node".into());
    }
    if !t.partition.is_empty() {
        placement.push(format!("partition {}", printable(&t.partition)));
    }
    if !t.gpu_models.is_empty() {
        placement.push(format!("GPU models {}", printable(&t.gpu_models.join("|"))));
    }
    kv("Placement:", placement.join(", "));
    kv("Readiness:", probe_text(spec.readiness.as_ref()));
    kv("Liveness:", probe_text(spec.liveness.as_ref()));
    if let Some(st) = &spec.strategy {
        kv(
            "Strategy:",
            format!(
                "rolling: at most {} extra, {} unavailable; paused after {} without progress",
                st.max_surge.unwrap_or(1),
                st.max_unavailable.unwrap_or(0),
                millis_text(st.progress_deadline_ms)
            ),
        );
    }
    if let Some(r) = &spec.restart {
        kv(
            "Restarts:",
            format!(
                "at once, then after {} doubling to {}; crash-looping after {} failures in a row; the count resets after {} running",
                millis_text(r.backoff_initial_ms),
                millis_text(r.backoff_max_ms),
                r.crash_loop_after,
                millis_text(r.reset_after_ms)
            ),
        );
    }
    if let Some(a) = &spec.autoscale {
        kv(
            "Autoscale:",
            printable(&format!(
                "{}..{} replicas on {} (target {} per ready replica, from :{}{}); scale down over {}, up over {}",
                a.min,
                a.max,
                a.metric,
                a.target,
                a.port,
                a.path,
                millis_text(a.scale_down_window_ms.unwrap_or(0)),
                millis_text(a.scale_up_window_ms)
            )),
        );
        kv(
            "Autoscaler:",
            if s.autoscaler.is_empty() {
                "(no figures yet, or this replica is not the leader)".into()
            } else {
                printable(&s.autoscaler)
            },
        );
    }
    out.push_str("Replicas:\n");
    if s.replicas.is_empty() {
        out.push_str("  (none)\n");
    } else {
        out.push_str(&indent(&replicas_table(s)));
        out.push_str(&format!(
            "  (`gpuctl logs service/{name}/ORDINAL` or `gpuctl logs JOB` for a replica's output)\n",
            name = printable(&spec.name)
        ));
    }
    out.push_str("Revisions:\n");
    out.push_str(&indent(&history_table(s)));
    out.push_str("Events:\n");
    if s.events.is_empty() {
        out.push_str("  (none)\n");
    }
    for e in &s.events {
        out.push_str(&format!(
            "  {}  {}\n",
            format_time(e.at_ms),
            printable(&e.message)
        ));
    }
    out
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

fn replicas_table(s: &pb::Service) -> String {
    let rows: Vec<Vec<String>> = s
        .replicas
        .iter()
        .map(|r| {
            vec![
                r.ordinal.to_string(),
                r.job_id.to_string(),
                r.revision.to_string(),
                printable(&r.state),
                yes_no(r.ready).into(),
                r.restarts.to_string(),
                or_dash(&r.node),
                or_dash(&r.gpus.join(",")),
                or_dash(&r.endpoint),
                or_dash(&r.last_exit),
                or_dash(&r.reason),
            ]
        })
        .collect();
    table(
        &[
            "ORDINAL",
            "JOB",
            "REVISION",
            "STATE",
            "READY",
            "RESTARTS",
            "NODE",
            "GPUS",
            "ENDPOINT",
            "LAST EXIT",
            "REASON",
        ],
        &rows,
    )
}

/// What changed from one revision's template to the next, in words ("command, image").
pub fn revision_changes(before: &pb::ServiceRevision, after: &pb::ServiceRevision) -> String {
    let (a, b) = (
        before.template.clone().unwrap_or_default(),
        after.template.clone().unwrap_or_default(),
    );
    let mut changed = Vec::new();
    let mut note = |differs: bool, what: &'static str| {
        if differs {
            changed.push(what);
        }
    };
    note(a.command != b.command, "command");
    note(a.container != b.container, "image");
    note(a.env != b.env, "environment");
    note(a.workdir != b.workdir, "workdir");
    note(
        (
            a.gpus_per_task,
            a.gpu_milli,
            a.gpu_memory_mib,
            &a.mig_profile,
        ) != (
            b.gpus_per_task,
            b.gpu_milli,
            b.gpu_memory_mib,
            &b.mig_profile,
        ),
        "GPUs",
    );
    note(
        (a.cpu_milli_per_task, a.memory_mib_per_task)
            != (b.cpu_milli_per_task, b.memory_mib_per_task),
        "CPU/memory",
    );
    note(a.ports != b.ports, "ports");
    note(
        (
            &a.partition,
            &a.gpu_models,
            &a.priority_class,
            a.preemptible,
            a.single_numa,
        ) != (
            &b.partition,
            &b.gpu_models,
            &b.priority_class,
            b.preemptible,
            b.single_numa,
        ),
        "placement",
    );
    note(before.readiness != after.readiness, "readiness");
    note(before.liveness != after.liveness, "liveness");
    if changed.is_empty() {
        "-".into()
    } else {
        changed.join(", ")
    }
}

/// `gpuctl service history`: the kept revisions, oldest first, with what each changed.
pub fn history_table(s: &pb::Service) -> String {
    let rows: Vec<Vec<String>> = s
        .revisions
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let t = r.template.clone().unwrap_or_default();
            let change = match i {
                0 => "(oldest kept)".into(),
                _ => revision_changes(&s.revisions[i - 1], r),
            };
            vec![
                if r.number == s.revision {
                    format!("{} (current)", r.number)
                } else {
                    r.number.to_string()
                },
                format_time(r.created_at_ms),
                change,
                t.container
                    .as_ref()
                    .map_or("-".into(), |c| printable(&c.image)),
                if t.command.is_empty() {
                    "(withheld)".into()
                } else {
                    printable(&shell_words(&t.command))
                },
            ]
        })
        .collect();
    table(
        &["REVISION", "CREATED", "CHANGED", "IMAGE", "COMMAND"],
        &rows,
    )
}

fn probe_json(p: &pb::ServiceProbe) -> Value {
    json!({
        "check": check_text(p.check.as_ref()),
        "initial_delay_ms": p.initial_delay_ms,
        "period_ms": p.period_ms,
        "timeout_ms": p.timeout_ms,
        "failure_threshold": p.failure_threshold,
        "success_threshold": p.success_threshold,
    })
}

fn template_json(t: &pb::JobSpec) -> Value {
    json!({
        "command": t.command,
        "image": t.container.as_ref().map(|c| c.image.clone()),
        "env": t.env,
        "workdir": t.workdir,
        "gpus": t.gpus_per_task,
        "gpu_milli": t.gpu_milli,
        "gpu_memory_mib": t.gpu_memory_mib,
        "mig_profile": t.mig_profile,
        "cpu_milli": t.cpu_milli_per_task,
        "memory_mib": t.memory_mib_per_task,
        "ports": t.ports,
        "partition": t.partition,
        "gpu_models": t.gpu_models,
        "priority_class": t.priority_class,
        "preemptible": t.preemptible,
        "single_numa": t.single_numa,
    })
}

/// A service as JSON (`-o json`).
pub fn service_json(s: &pb::Service) -> Value {
    let spec = spec_of(s);
    json!({
        "name": spec.name,
        "tenant": spec.tenant,
        "replicas": spec.replicas,
        "ready": s.ready,
        "updated": s.updated,
        "revision": s.revision,
        "rollout": if s.deleting { "deleting" } else { s.rollout.as_str() },
        "rollout_reason": s.rollout_reason,
        "created_at_ms": s.created_at_ms,
        "version": s.version,
        "template": spec.template.as_ref().map(template_json),
        "readiness": spec.readiness.as_ref().map(probe_json),
        "liveness": spec.liveness.as_ref().map(probe_json),
        "strategy": spec.strategy.as_ref().map(|st| json!({
            "max_surge": st.max_surge, "max_unavailable": st.max_unavailable,
            "progress_deadline_ms": st.progress_deadline_ms,
        })),
        "restart": spec.restart.as_ref().map(|r| json!({
            "backoff_initial_ms": r.backoff_initial_ms, "backoff_max_ms": r.backoff_max_ms,
            "crash_loop_after": r.crash_loop_after, "reset_after_ms": r.reset_after_ms,
        })),
        "autoscale": spec.autoscale.as_ref().map(|a| json!({
            "min": a.min, "max": a.max, "metric": a.metric, "port": a.port, "path": a.path,
            "target": a.target, "scale_down_window_ms": a.scale_down_window_ms,
            "scale_up_window_ms": a.scale_up_window_ms,
        })),
        "autoscaler": s.autoscaler,
        "replicas_now": s.replicas.iter().map(|r| json!({
            "ordinal": r.ordinal, "job": r.job_id, "revision": r.revision, "state": r.state,
            "ready": r.ready, "restarts": r.restarts, "failures": r.failures, "node": r.node,
            "gpus": r.gpus, "endpoint": r.endpoint,
            "ports": r.ports.iter().map(|p| json!({"name": p.name, "port": p.port})).collect::<Vec<_>>(),
            "last_exit": r.last_exit, "reason": r.reason,
        })).collect::<Vec<_>>(),
        "revisions": s.revisions.iter().map(|r| json!({
            "number": r.number, "created_at_ms": r.created_at_ms,
            "template": r.template.as_ref().map(template_json),
        })).collect::<Vec<_>>(),
        "events": s.events.iter().map(|e| json!({"at_ms": e.at_ms, "message": e.message})).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub const EVIL: &str = "x\n99  evil  RUNNING\u{1b}[2J";

    /// A service of two replicas, one crash-looping, with a paused rollout, two revisions
    /// and hostile strings wherever a user or node supplies one.
    pub fn hostile_service() -> pb::Service {
        let template = |cmd: &str| pb::JobSpec {
            tenant: "ml".into(),
            name: EVIL.into(),
            command: vec!["serve".into(), cmd.into()],
            gpus_per_task: 1,
            gpu_milli: 500,
            ports: vec!["http".into()],
            env: [("K".to_owned(), EVIL.to_owned())].into(),
            container: Some(pb::ContainerSpec {
                image: EVIL.into(),
                mounts: vec![],
            }),
            partition: EVIL.into(),
            priority_class: "normal".into(),
            ..Default::default()
        };
        let probe = pb::ServiceProbe {
            check: Some(pb::service_probe::Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: format!("/{EVIL}"),
            })),
            period_ms: 1000,
            timeout_ms: 1000,
            failure_threshold: 3,
            success_threshold: 1,
            ..Default::default()
        };
        pb::Service {
            spec: Some(pb::ServiceSpec {
                tenant: "ml".into(),
                name: EVIL.into(),
                template: Some(template("--v2")),
                replicas: 2,
                readiness: Some(probe.clone()),
                strategy: Some(pb::RolloutStrategy {
                    max_surge: Some(1),
                    max_unavailable: Some(0),
                    progress_deadline_ms: 600_000,
                }),
                restart: Some(pb::RestartPolicy {
                    backoff_initial_ms: 1000,
                    backoff_max_ms: 300_000,
                    crash_loop_after: 5,
                    reset_after_ms: 600_000,
                }),
                autoscale: Some(pb::Autoscale {
                    min: 1,
                    max: 4,
                    metric: EVIL.into(),
                    port: "http".into(),
                    path: "/metrics".into(),
                    target: 5.0,
                    scale_down_window_ms: Some(300_000),
                    scale_up_window_ms: 0,
                }),
                ..Default::default()
            }),
            revision: 2,
            revisions: vec![
                pb::ServiceRevision {
                    number: 1,
                    created_at_ms: 1_000,
                    template: Some(template("--v1")),
                    readiness: Some(probe.clone()),
                    liveness: None,
                },
                pb::ServiceRevision {
                    number: 2,
                    created_at_ms: 2_000,
                    template: Some(template("--v2")),
                    readiness: Some(probe),
                    liveness: None,
                },
            ],
            rollout: "paused".into(),
            rollout_reason: EVIL.into(),
            replicas: vec![
                pb::Replica {
                    ordinal: 0,
                    job_id: 7,
                    revision: 1,
                    state: "ready".into(),
                    ready: true,
                    node: "h1".into(),
                    gpus: vec!["GPU-0".into()],
                    endpoint: "10.0.0.1:20000".into(),
                    reason: "ready".into(),
                    ..Default::default()
                },
                pb::Replica {
                    ordinal: 1,
                    job_id: 9,
                    revision: 2,
                    state: "crash-loop".into(),
                    restarts: 6,
                    failures: 6,
                    node: EVIL.into(),
                    last_exit: EVIL.into(),
                    reason: EVIL.into(),
                    endpoint: EVIL.into(),
                    ..Default::default()
                },
            ],
            created_at_ms: 1_000,
            events: vec![pb::ServiceEvent {
                at_ms: 2_000,
                message: EVIL.into(),
            }],
            ready: 1,
            updated: 1,
            autoscaler: EVIL.into(),
            ..Default::default()
        }
    }

    fn inert(text: &str) {
        assert!(!text.contains('\u{1b}'), "a raw escape: {text}");
        assert!(!text.contains("\n99"), "a forged line: {text}");
    }

    #[test]
    fn the_table_has_one_row_per_service_whatever_the_names() {
        let s = hostile_service();
        for wide in [false, true] {
            let t = services_table(std::slice::from_ref(&s), 61_000, wide);
            assert_eq!(t.lines().count(), 2, "{t}");
            inert(&t);
            let header = t.lines().next().unwrap();
            assert!(
                header.starts_with("NAME")
                    && header.contains("REPLICAS  UP-TO-DATE  REVISION  ROLLOUT  AGE  ENDPOINTS"),
                "{header}"
            );
            let row = t.lines().nth(1).unwrap();
            assert!(
                row.contains("1/2") && row.contains("paused") && row.contains("1m"),
                "{row}"
            );
            if wide {
                assert!(row.contains("500m GPU") && row.contains("1-4 on"), "{row}");
            }
        }
    }

    #[test]
    fn describe_shows_each_replica_revisions_events_and_the_autoscaler_inert() {
        let s = hostile_service();
        let d = service_details(&s, 10_000);
        inert(&d);
        for want in [
            "crash-loop",
            "10.0.0.1:20000",
            "paused: x\\n99",
            "gpuctl logs service/",
            "Revisions:",
            "2 (current)",
            "command",
            "Autoscaler:",
            "500 milli of one GPU",
            "http:http:/x\\n99",
        ] {
            assert!(d.contains(want), "{want:?} missing from\n{d}");
        }
        // One line per replica in the replica table: the hostile node cannot add any.
        let section = d.split("\nReplicas:\n").nth(1).unwrap();
        let section = section.split("  (`gpuctl logs").next().unwrap();
        assert_eq!(
            section.lines().count(),
            3,
            "a header and two replicas:\n{section}"
        );
        let h = history_table(&s);
        inert(&h);
        assert_eq!(h.lines().count(), 3, "{h}");
        assert!(h.contains("command"), "{h}");
    }

    #[test]
    fn the_rollout_line_says_what_it_waits_for() {
        let mut s = hostile_service();
        let l = rollout_line(&s);
        inert(&l);
        assert!(
            l.contains("paused") && l.contains("1 of 2 replicas at revision 2"),
            "{l}"
        );
        s.rollout = "complete".into();
        assert!(rollout_line(&s).contains("rolled out"));
        s.rollout = "progressing".into();
        assert!(rollout_line(&s).starts_with("waiting for service"));
    }

    #[test]
    fn json_carries_replicas_and_revisions() {
        let v = service_json(&hostile_service());
        assert_eq!(v["replicas"], 2);
        assert_eq!(v["replicas_now"][1]["state"], "crash-loop");
        assert_eq!(v["revisions"].as_array().unwrap().len(), 2);
        assert_eq!(v["template"]["gpu_milli"], 500);
        assert_eq!(v["readiness"]["check"], format!("http:http:/{EVIL}"));
    }
}
