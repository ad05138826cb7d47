//! The agent's Prometheus series (`gpucp_agent_*`), served on `--metrics-listen`
//! (`agent::http`). Counters and histograms are recorded where things happen (launch, exit, GPU
//! event); what is a level (allocations running, registration) is read when scraped, so the
//! hot paths pay for an atomic add at most.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use proto::agent as pa;

use crate::gpu::HostInventory;
use crate::observe::latency_buckets;

type Labels = Vec<(&'static str, String)>;

pub struct AgentMetrics {
    pub registry: Registry,
    pub allocations_running: Gauge,
    pub registered: Gauge,
    pub launches: Family<Labels, Counter>,
    pub launch_duration: Histogram,
    pub exits: Family<Labels, Counter>,
    pub xids: Family<Labels, Counter>,
    pub gpu_healthy: Family<Labels, Gauge>,
    pub probe_failures: Family<Labels, Counter>,
    pub liveness_restarts: Counter,
    pub scrape_failures: Counter,
}

impl AgentMetrics {
    pub fn new(node: &str, inventory: &HostInventory, enforcement: &str, containers: &str) -> Self {
        let mut registry = Registry::with_prefix("gpucp_agent");
        let m = AgentMetrics {
            registry: Registry::default(),
            allocations_running: Gauge::default(),
            registered: Gauge::default(),
            launches: Family::default(),
            launch_duration: Histogram::new(latency_buckets()),
            exits: Family::default(),
            xids: Family::default(),
            gpu_healthy: Family::default(),
            probe_failures: Family::default(),
            liveness_restarts: Counter::default(),
            scrape_failures: Counter::default(),
        };
        registry.register(
            "allocations_running",
            "Allocations whose workload runs on this host now",
            m.allocations_running.clone(),
        );
        registry.register(
            "registered",
            "1 while registered, within the lease and following the leader's assignments",
            m.registered.clone(),
        );
        registry.register(
            "launches",
            "Workload launches by result (ok, refused: the job cannot run here, failed: a host fault)",
            m.launches.clone(),
        );
        registry.register_with_unit(
            "launch_duration",
            "Time to start an allocation's supervisor shim (fork, cgroup, exec)",
            Unit::Seconds,
            m.launch_duration.clone(),
        );
        registry.register(
            "exits",
            "Workload exits reported, by kind (succeeded, failed, timed_out, lost, stopped)",
            m.exits.clone(),
        );
        registry.register(
            "gpu_xid_events",
            "Xid errors the driver reported, by GPU and code",
            m.xids.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 while this agent considers the GPU healthy, 0 after a fault until it recovers",
            m.gpu_healthy.clone(),
        );
        registry.register(
            "probe_failures",
            "Failed checks of service replicas' probes, by kind (readiness, liveness); a probe changes its status only after its threshold of failures in a row",
            m.probe_failures.clone(),
        );
        registry.register(
            "liveness_restarts",
            "Service replicas stopped because their liveness probe failed (the control plane then restarts them)",
            m.liveness_restarts.clone(),
        );
        registry.register(
            "metric_scrape_failures",
            "Scrapes of autoscaled replicas' gauges that found no value (page unreachable, gauge missing, not a number)",
            m.scrape_failures.clone(),
        );
        registry.register(
            "enforcement",
            "What this node enforces on allocations (mode: cgroup v1/v2/hybrid or unenforced) and its container engine",
            Info::new(vec![
                ("node", node.to_owned()),
                ("mode", enforcement_mode(enforcement).to_owned()),
                ("detail", enforcement.to_owned()),
                ("containers", containers.to_owned()),
                ("release", env!("CARGO_PKG_VERSION").to_owned()),
            ]),
        );
        for g in &inventory.gpus {
            m.gpu_healthy
                .get_or_create(&gpu_labels(&g.uuid, g.index, &g.model))
                .set(1);
        }
        AgentMetrics { registry, ..m }
    }

    pub fn launched(&self, result: &'static str, took: std::time::Duration) {
        self.launches
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
        if result == "ok" {
            self.launch_duration.observe(took.as_secs_f64());
        }
    }

    pub fn exited(&self, event: pa::allocation_report::Event) {
        self.exits
            .get_or_create(&vec![("kind", exit_kind(event).to_owned())])
            .inc();
    }

    pub fn probe_failed(&self, kind: &'static str) {
        self.probe_failures
            .get_or_create(&vec![("kind", kind.to_owned())])
            .inc();
    }

    pub fn xid(&self, gpu: &str, code: u32) {
        self.xids
            .get_or_create(&vec![("gpu", gpu.to_owned()), ("code", code.to_string())])
            .inc();
    }

    pub fn set_gpu_health(&self, inventory: &HostInventory, uuid: &str, healthy: bool) {
        if let Some(g) = inventory.gpus.iter().find(|g| g.uuid == uuid) {
            self.gpu_healthy
                .get_or_create(&gpu_labels(&g.uuid, g.index, &g.model))
                .set(i64::from(healthy));
        }
    }
}

fn gpu_labels(uuid: &str, index: u32, model: &str) -> Labels {
    vec![
        ("gpu", uuid.to_owned()),
        ("index", index.to_string()),
        ("model", model.to_owned()),
    ]
}

/// The label for an exit report's event: the wire name in lower case.
pub fn exit_kind(event: pa::allocation_report::Event) -> &'static str {
    use pa::allocation_report::Event;
    match event {
        Event::Succeeded => "succeeded",
        Event::Failed => "failed",
        Event::TimedOut => "timed_out",
        Event::Lost => "lost",
        Event::Stopped => "stopped",
        Event::Started => "started",
        Event::Ready => "ready",
        Event::NotReady => "not_ready",
        Event::Unspecified => "unknown",
    }
}

/// The mode part of the node's enforcement line ("cgroup v2: devices, memory" → "cgroup v2";
/// "unenforced: why" → "unenforced"), a short label for dashboards; the line itself is `detail`.
pub fn enforcement_mode(line: &str) -> &str {
    line.split(':').next().unwrap_or(line).trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforcement_lines_give_a_short_mode() {
        assert_eq!(
            enforcement_mode("cgroup v2: devices, memory, cpu"),
            "cgroup v2"
        );
        assert_eq!(
            enforcement_mode("unenforced: no cgroup hierarchy"),
            "unenforced"
        );
        assert_eq!(enforcement_mode("cgroup v1"), "cgroup v1");
    }

    #[test]
    fn series_are_named_with_prefix_and_units() {
        use crate::gpu::GpuBackend;
        let host = crate::gpu::simulated::SimulatedBackend::from_preset("dgx-h100", "n1").unwrap();
        let inv = host.inventory().unwrap();
        let m = AgentMetrics::new("n1", &inv, "unenforced: off", "");
        m.set_gpu_health(&inv, &inv.gpus[1].uuid, false);
        m.launched("ok", std::time::Duration::from_millis(3));
        m.exited(pa::allocation_report::Event::TimedOut);
        m.xid("GPU-1", 79);
        m.probe_failed("readiness");
        m.probe_failed("readiness");
        m.liveness_restarts.inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &m.registry).unwrap();
        for want in [
            "gpucp_agent_launches_total{result=\"ok\"} 1",
            "gpucp_agent_launch_duration_seconds_count 1",
            "gpucp_agent_exits_total{kind=\"timed_out\"} 1",
            "gpucp_agent_gpu_xid_events_total{gpu=\"GPU-1\",code=\"79\"} 1",
            "gpucp_agent_enforcement_info{node=\"n1\",mode=\"unenforced\"",
            "gpucp_agent_gpu_healthy{gpu=\"GPU-",
            "gpucp_agent_probe_failures_total{kind=\"readiness\"} 2",
            "gpucp_agent_liveness_restarts_total 1",
            "gpucp_agent_metric_scrape_failures_total 0",
        ] {
            assert!(text.contains(want), "no {want:?} in\n{text}");
        }
        let healthy = |v: &str| {
            text.lines()
                .filter(|l| l.starts_with("gpucp_agent_gpu_healthy{") && l.ends_with(v))
                .count()
        };
        assert_eq!(
            (healthy(" 1"), healthy(" 0")),
            (inv.gpus.len() - 1, 1),
            "{text}"
        );
    }
}
