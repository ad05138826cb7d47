//! Wire ↔ domain conversions of services. Unset settings take the defaults written in
//! `state::service` (one place for every default); what the wire allows and the domain does
//! not (an unknown enum value, a target that is not a finite positive number) is refused here,
//! everything else by `validate_service_spec`.

use proto::v1 as pb;

use super::convert::{job_spec_from_proto, job_spec_to_proto};
use crate::state::service::{
    Autoscale, Probe, ProbeCheck, ReplicaTemplate, RestartPolicy, RolloutPhase, RolloutStrategy,
    Service, ServiceSpec,
};
use crate::state::{ClusterState, JobState, Rejection};

/// Default scale-down window of the autoscaler (Kubernetes' HPA: 5 minutes).
pub const DEFAULT_SCALE_DOWN_WINDOW_MS: u64 = 5 * 60 * 1000;

/// A service's request as the state keeps it; `tenant` is the caller's when the spec names
/// none (the handler decides which).
pub fn service_spec_from_proto(spec: pb::ServiceSpec) -> Result<ServiceSpec, Rejection> {
    let mut template = spec
        .template
        .ok_or_else(|| Rejection::invalid("template", "is missing: what each replica runs"))?;
    // A replica is one task; the template may leave it out.
    if template.tasks == 0 {
        template.tasks = 1;
    }
    template.tenant = spec.tenant.clone();
    template.name = spec.name.clone();
    let job = job_spec_from_proto(Some(template))?;
    let ports = job.ports.clone();
    let readiness = spec.readiness.map(probe_from_proto).transpose()?;
    let liveness = spec.liveness.map(probe_from_proto).transpose()?;
    let defaults = RolloutStrategy::default();
    let strategy = match spec.strategy {
        None => defaults,
        Some(s) => RolloutStrategy {
            max_surge: s.max_surge.unwrap_or(defaults.max_surge),
            max_unavailable: s.max_unavailable.unwrap_or(defaults.max_unavailable),
            progress_deadline_ms: nonzero_or(s.progress_deadline_ms, defaults.progress_deadline_ms),
        },
    };
    let d = RestartPolicy::default();
    let restart = match spec.restart {
        None => d,
        Some(r) => RestartPolicy {
            backoff_initial_ms: nonzero_or(r.backoff_initial_ms, d.backoff_initial_ms),
            backoff_max_ms: nonzero_or(r.backoff_max_ms, d.backoff_max_ms),
            crash_loop_after: if r.crash_loop_after == 0 {
                d.crash_loop_after
            } else {
                r.crash_loop_after
            },
            reset_after_ms: nonzero_or(r.reset_after_ms, d.reset_after_ms),
        },
    };
    let autoscale = spec
        .autoscale
        .map(|a| autoscale_from_proto(a, &ports))
        .transpose()?;
    Ok(ServiceSpec {
        tenant: spec.tenant,
        name: spec.name,
        template: ReplicaTemplate {
            job,
            readiness,
            liveness,
        },
        replicas: spec.replicas,
        strategy,
        restart,
        autoscale,
    })
}

fn nonzero_or(v: u64, default: u64) -> u64 {
    if v == 0 { default } else { v }
}

fn probe_from_proto(p: pb::ServiceProbe) -> Result<Probe, Rejection> {
    let check = match p.check {
        Some(pb::service_probe::Check::Http(h)) => ProbeCheck::Http {
            port: h.port,
            path: if h.path.is_empty() {
                "/".into()
            } else {
                h.path
            },
        },
        Some(pb::service_probe::Check::TcpPort(port)) => ProbeCheck::Tcp { port },
        Some(pb::service_probe::Check::Exec(e)) => ProbeCheck::Exec { command: e.command },
        None => {
            return Err(Rejection::invalid(
                "probe",
                "says nothing to check: give http, tcp_port or exec",
            ));
        }
    };
    let d = Probe::new(check);
    Ok(Probe {
        initial_delay_ms: p.initial_delay_ms,
        period_ms: nonzero_or(p.period_ms, d.period_ms),
        timeout_ms: nonzero_or(p.timeout_ms, d.timeout_ms),
        failure_threshold: if p.failure_threshold == 0 {
            d.failure_threshold
        } else {
            p.failure_threshold
        },
        success_threshold: if p.success_threshold == 0 {
            d.success_threshold
        } else {
            p.success_threshold
        },
        ..d
    })
}

pub fn probe_to_proto(p: &Probe) -> pb::ServiceProbe {
    pb::ServiceProbe {
        check: Some(match &p.check {
            ProbeCheck::Http { port, path } => pb::service_probe::Check::Http(pb::HttpProbe {
                port: port.clone(),
                path: path.clone(),
            }),
            ProbeCheck::Tcp { port } => pb::service_probe::Check::TcpPort(port.clone()),
            ProbeCheck::Exec { command } => pb::service_probe::Check::Exec(pb::ExecProbe {
                command: command.clone(),
            }),
        }),
        initial_delay_ms: p.initial_delay_ms,
        period_ms: p.period_ms,
        timeout_ms: p.timeout_ms,
        failure_threshold: p.failure_threshold,
        success_threshold: p.success_threshold,
    }
}

fn autoscale_from_proto(a: pb::Autoscale, ports: &[String]) -> Result<Autoscale, Rejection> {
    if !a.target.is_finite() || a.target <= 0.0 || a.target > 1e12 {
        return Err(Rejection::invalid(
            "autoscale.target",
            format!("{} is not a positive number", a.target),
        ));
    }
    Ok(Autoscale {
        min: a.min,
        max: a.max,
        metric: a.metric,
        port: if a.port.is_empty() {
            ports.first().cloned().unwrap_or_default()
        } else {
            a.port
        },
        path: if a.path.is_empty() {
            "/metrics".into()
        } else {
            a.path
        },
        target_milli: (a.target * 1000.0).round().max(1.0) as u64,
        scale_down_window_ms: a
            .scale_down_window_ms
            .unwrap_or(DEFAULT_SCALE_DOWN_WINDOW_MS),
        scale_up_window_ms: a.scale_up_window_ms,
    })
}

pub fn service_spec_to_proto(spec: &ServiceSpec) -> pb::ServiceSpec {
    pb::ServiceSpec {
        tenant: spec.tenant.clone(),
        name: spec.name.clone(),
        template: Some(job_spec_to_proto(&spec.template.job)),
        replicas: spec.replicas,
        readiness: spec.template.readiness.as_ref().map(probe_to_proto),
        liveness: spec.template.liveness.as_ref().map(probe_to_proto),
        strategy: Some(pb::RolloutStrategy {
            max_surge: Some(spec.strategy.max_surge),
            max_unavailable: Some(spec.strategy.max_unavailable),
            progress_deadline_ms: spec.strategy.progress_deadline_ms,
        }),
        restart: Some(pb::RestartPolicy {
            backoff_initial_ms: spec.restart.backoff_initial_ms,
            backoff_max_ms: spec.restart.backoff_max_ms,
            crash_loop_after: spec.restart.crash_loop_after,
            reset_after_ms: spec.restart.reset_after_ms,
        }),
        autoscale: spec.autoscale.as_ref().map(|a| pb::Autoscale {
            min: a.min,
            max: a.max,
            metric: a.metric.clone(),
            port: a.port.clone(),
            path: a.path.clone(),
            target: a.target_milli as f64 / 1000.0,
            scale_down_window_ms: Some(a.scale_down_window_ms),
            scale_up_window_ms: a.scale_up_window_ms,
        }),
    }
}

/// How a replica is described in a listing: `crash-loop` wins over its phase.
fn replica_state(job: &crate::state::Job, crash_looping: bool) -> &'static str {
    let ready = job.replica.as_ref().is_some_and(|r| r.ready);
    match job.state {
        s if s.is_final() => "stopping",
        _ if crash_looping => "crash-loop",
        JobState::Pending => "pending",
        _ if ready => "ready",
        _ => "starting",
    }
}

pub fn service_to_proto(s: &Service, cluster: &ClusterState, autoscaler: String) -> pb::Service {
    let mut ready = 0;
    let mut updated = 0;
    let replicas = s
        .replicas
        .iter()
        .filter_map(|(&ordinal, id)| {
            let job = cluster.jobs.get(id)?;
            let r = job.replica.as_ref()?;
            let crash_looping = r.crash_looping(&s.spec.restart);
            if r.ready {
                ready += 1;
            }
            if r.revision == s.revision && !job.state.is_final() {
                updated += 1;
            }
            let alloc = cluster.allocations_of(job.id).next().map(|a| &a.allocation);
            let host = alloc
                .and_then(|a| cluster.nodes.get(&a.node))
                .map(|n| agent_host(&n.spec.agent_address))
                .unwrap_or_default();
            let ports: Vec<pb::NamedPort> = alloc
                .map(|a| {
                    job.spec
                        .ports
                        .iter()
                        .zip(&a.ports)
                        .map(|(name, port)| pb::NamedPort {
                            name: name.clone(),
                            port: u32::from(*port),
                        })
                        .collect()
                })
                .unwrap_or_default();
            let endpoint = match (ports.first(), host.is_empty()) {
                (Some(p), false) => format!("{host}:{}", p.port),
                _ => String::new(),
            };
            Some(pb::Replica {
                ordinal,
                job_id: job.id,
                revision: r.revision,
                state: replica_state(job, crash_looping).to_owned(),
                ready: r.ready,
                restarts: r.restarts,
                node: alloc.map(|a| a.node.clone()).unwrap_or_default(),
                gpus: alloc.map(|a| a.gpus.clone()).unwrap_or_default(),
                ports,
                endpoint,
                last_exit: r.last_exit.clone().unwrap_or_default(),
                reason: job
                    .history
                    .last()
                    .map(|h| h.reason.clone())
                    .unwrap_or_default(),
                failures: r.failures,
            })
        })
        .collect();
    let (rollout_reason, rollout) = match &s.rollout {
        RolloutPhase::Paused { reason } => (reason.clone(), s.rollout.label()),
        other => (String::new(), other.label()),
    };
    pb::Service {
        spec: Some(service_spec_to_proto(&s.spec)),
        revision: s.revision,
        revisions: s
            .revisions
            .iter()
            .map(|r| pb::ServiceRevision {
                number: r.number,
                created_at_ms: r.created_at,
                template: Some(job_spec_to_proto(&r.template.job)),
                readiness: r.template.readiness.as_ref().map(probe_to_proto),
                liveness: r.template.liveness.as_ref().map(probe_to_proto),
            })
            .collect(),
        rollout: rollout.to_owned(),
        rollout_reason,
        replicas,
        created_at_ms: s.created_at,
        deleting: s.deleting,
        events: s
            .events
            .iter()
            .map(|e| pb::ServiceEvent {
                at_ms: e.at,
                message: e.message.clone(),
            })
            .collect(),
        ready,
        updated,
        progressed_at_ms: s.progressed_at,
        autoscaler,
        version: s.version,
    }
}

/// The host part of an agent's `host:port` address (an IPv6 address keeps its brackets).
pub fn agent_host(address: &str) -> String {
    match address.rsplit_once(':') {
        Some((host, _)) => host.to_owned(),
        None => address.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal() -> pb::ServiceSpec {
        pb::ServiceSpec {
            tenant: "vision".into(),
            name: "web".into(),
            template: Some(pb::JobSpec {
                command: vec!["serve".into()],
                gpus_per_task: 1,
                gpu_milli: 500,
                ports: vec!["http".into()],
                ..Default::default()
            }),
            replicas: 3,
            ..Default::default()
        }
    }

    #[test]
    fn unset_settings_take_the_defaults_and_the_template_is_one_task_of_the_service() {
        let s = service_spec_from_proto(minimal()).unwrap();
        assert_eq!(s.template.job.tasks, 1);
        assert_eq!(s.template.job.tenant, "vision");
        assert_eq!(s.template.job.name, "web");
        assert_eq!(s.strategy, RolloutStrategy::default());
        assert_eq!(s.restart, RestartPolicy::default());
        assert_eq!(crate::state::service::validate_service_spec(&s), Ok(()));
    }

    #[test]
    fn a_spec_survives_the_round_trip() {
        let mut p = minimal();
        p.readiness = Some(pb::ServiceProbe {
            check: Some(pb::service_probe::Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: "/ready".into(),
            })),
            period_ms: 500,
            ..Default::default()
        });
        p.autoscale = Some(pb::Autoscale {
            min: 1,
            max: 8,
            metric: "queue_length".into(),
            target: 2.5,
            ..Default::default()
        });
        let s = service_spec_from_proto(p).unwrap();
        let a = s.autoscale.as_ref().unwrap();
        assert_eq!(
            (a.port.as_str(), a.path.as_str(), a.target_milli),
            ("http", "/metrics", 2500)
        );
        assert_eq!(a.scale_down_window_ms, DEFAULT_SCALE_DOWN_WINDOW_MS);
        let back = service_spec_from_proto(service_spec_to_proto(&s)).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_probe_without_a_check_and_a_target_that_is_no_number_are_refused() {
        let mut p = minimal();
        p.liveness = Some(pb::ServiceProbe::default());
        assert!(
            service_spec_from_proto(p)
                .unwrap_err()
                .message
                .contains("nothing to check")
        );
        let mut p = minimal();
        p.autoscale = Some(pb::Autoscale {
            min: 1,
            max: 2,
            metric: "q".into(),
            target: f64::NAN,
            ..Default::default()
        });
        assert!(service_spec_from_proto(p).is_err());
    }
}
