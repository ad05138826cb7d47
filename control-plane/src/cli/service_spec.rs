//! The flags of `gpuctl service create` and `service update` to the API's `ServiceSpec`.
//! One function, [`apply_flags`], changes a spec by what was given: `create` applies it to a
//! fresh spec (one replica, one GPU, as `submit`), `update` to the spec the cluster has, so
//! the two never disagree on what a flag means. Resources, memory sizes and environment are
//! parsed by `submit`'s and `parse`'s functions; durations take `500ms`, `1s`, `10m` or
//! seconds. Pure: no I/O beyond the working directory `create` defaults to.

use std::path::PathBuf;

use anyhow::{Context, bail};
use proto::v1 as pb;

use super::output::printable;
use super::parse::{parse_duration_ms, parse_mem_mib};
use super::probe_spec::{ProbeArg, parse_probe};
use super::submit::{cpu_milli, env_pair, gpu_model_list, parse_mount};

/// Everything about a service that `create` sets and `update` may change.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServiceFlags {
    /// Replicas to keep running (with autoscaling: where it starts, within --min..--max).
    #[arg(long, short = 'r', value_name = "N")]
    pub replicas: Option<u32>,
    /// GPUs per replica (MIG slices with --mig); default 1.
    #[arg(long, short = 'G', value_name = "N", allow_negative_numbers = true)]
    pub gpus: Option<i64>,
    /// A share of one GPU per replica, in milli-GPU (1-999; 0 goes back to whole GPUs):
    /// shares are packed onto GPUs up to 1000 milli and their memory.
    #[arg(
        long,
        alias = "gpu-share",
        value_name = "MILLI",
        conflicts_with = "mig"
    )]
    pub gpu_milli: Option<u32>,
    /// GPU memory a share may use (MiB, or with K/M/G/T suffix); default: in proportion.
    #[arg(long, value_name = "SIZE")]
    pub gpu_mem: Option<String>,
    /// Run on MIG slices of this profile (`1g.10gb`); --gpus counts slices (`none`: whole
    /// GPUs again).
    #[arg(long, value_name = "PROFILE")]
    pub mig: Option<String>,
    /// CPUs per replica (fractions allowed; 0: none reserved).
    #[arg(long, short = 'c', value_name = "C")]
    pub cpus: Option<f64>,
    /// Host memory per replica: MiB, or with K/M/G/T suffix (0: none reserved).
    #[arg(long, value_name = "SIZE")]
    pub mem: Option<String>,
    /// Run each replica in a container of this image (`none`: as a process again).
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// With --image: bind-mount a host path, SRC:DST[:ro] (repeatable; replaces the mounts).
    #[arg(long = "mount", value_name = "SRC:DST[:ro]")]
    pub mounts: Vec<String>,
    /// A named host port for each replica (repeatable; replaces the list): the replica finds
    /// it in `PORT` (the first) and `GPUCP_PORT_<NAME>`; probes and the autoscaler name it.
    #[arg(long = "port", value_name = "NAME")]
    pub ports: Vec<String>,
    /// An environment variable, KEY=VALUE (repeatable); `KEY-` removes one (update).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Partition to run in (empty: any).
    #[arg(long, short = 'p')]
    pub partition: Option<String>,
    /// Acceptable GPU models, e.g. `A100|H100` (repeat or separate with `|`; replaces the list).
    #[arg(long = "gpu-model", short = 'C', value_name = "MODEL")]
    pub gpu_models: Vec<String>,
    /// Priority class: low, normal or high.
    #[arg(long, value_name = "CLASS")]
    pub priority: Option<String>,
    /// Replicas may be stopped for higher-priority work (`--preemptible=false` to undo).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub preemptible: Option<bool>,
    /// All GPUs of a replica on one NUMA node (`--single-numa=false` to undo).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub single_numa: Option<bool>,
    /// Working directory of the replicas on their hosts (create's default: the current
    /// directory for a process, the image's for a container).
    #[arg(long, short = 'D', value_name = "DIR")]
    pub chdir: Option<PathBuf>,
    /// Readiness probe: http:PORT[:/PATH], tcp:PORT, exec:COMMAND, or none. A replica gets
    /// traffic and counts for rollouts once it passes.
    #[arg(long, value_name = "PROBE")]
    pub readiness: Option<String>,
    /// Liveness probe (same forms): a replica that fails it is restarted.
    #[arg(long, value_name = "PROBE")]
    pub liveness: Option<String>,
    /// How often every probe runs (500ms, 1s, 10s); default 1s.
    #[arg(long, value_name = "DURATION")]
    pub probe_period: Option<String>,
    /// How long a probe may take; default 1s.
    #[arg(long, value_name = "DURATION")]
    pub probe_timeout: Option<String>,
    /// Wait after a replica starts before probing it; default 0.
    #[arg(long, value_name = "DURATION")]
    pub probe_initial_delay: Option<String>,
    /// Failures in a row that make a probe fail; default 3.
    #[arg(long, value_name = "N")]
    pub probe_failure_threshold: Option<u32>,
    /// Successes in a row that make a probe pass again; default 1.
    #[arg(long, value_name = "N")]
    pub probe_success_threshold: Option<u32>,
    /// Replicas beyond --replicas a rollout may start: N, or P% of the replicas (rounded up);
    /// default 1.
    #[arg(long, value_name = "N|P%")]
    pub max_surge: Option<String>,
    /// Replicas a rollout may take away below --replicas: N, or P% (rounded down); default 0.
    #[arg(long, value_name = "N|P%")]
    pub max_unavailable: Option<String>,
    /// A rollout with no new replica ready for this long is paused; default 10m.
    #[arg(long, value_name = "DURATION")]
    pub progress_deadline: Option<String>,
    /// Wait before the second restart in a row of a replica, doubling after; default 1s.
    #[arg(long, value_name = "DURATION")]
    pub restart_backoff: Option<String>,
    /// The longest wait between restarts; default 5m.
    #[arg(long, value_name = "DURATION")]
    pub restart_backoff_max: Option<String>,
    /// Failures in a row after which a replica is crash-looping (and a rollout that brought
    /// it pauses); default 5.
    #[arg(long, value_name = "N")]
    pub crash_loop_after: Option<u32>,
    /// A replica that ran this long starts its count of failures afresh; default 10m.
    #[arg(long, value_name = "DURATION")]
    pub restart_reset_after: Option<String>,
    /// Autoscale: fewest replicas.
    #[arg(long, value_name = "N")]
    pub min: Option<u32>,
    /// Autoscale: most replicas.
    #[arg(long, value_name = "N")]
    pub max: Option<u32>,
    /// Autoscale on this gauge of the replicas' Prometheus text (`queue_length`).
    #[arg(long, value_name = "NAME")]
    pub metric: Option<String>,
    /// Autoscale: the gauge's average per ready replica to aim at.
    #[arg(long, value_name = "X")]
    pub target: Option<f64>,
    /// Autoscale: the port (a --port name) to scrape; default the first.
    #[arg(long, value_name = "NAME")]
    pub metric_port: Option<String>,
    /// Autoscale: the path to scrape; default /metrics.
    #[arg(long, value_name = "PATH")]
    pub metric_path: Option<String>,
    /// Autoscale: scale down only to the highest count recommended over this window;
    /// default 5m.
    #[arg(long, value_name = "DURATION")]
    pub scale_down_window: Option<String>,
    /// Autoscale: scale up only to the lowest count recommended over this window; default 0.
    #[arg(long, value_name = "DURATION")]
    pub scale_up_window: Option<String>,
    /// Stop autoscaling (update): the replicas stay where they are.
    #[arg(long, conflicts_with_all = ["min", "max", "metric", "target"])]
    pub no_autoscale: bool,
    /// The replica's program and its arguments, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

impl ServiceFlags {
    fn changes_probe_timing(&self) -> bool {
        self.probe_period.is_some()
            || self.probe_timeout.is_some()
            || self.probe_initial_delay.is_some()
            || self.probe_failure_threshold.is_some()
            || self.probe_success_threshold.is_some()
    }

    fn changes_autoscale(&self) -> bool {
        self.min.is_some()
            || self.max.is_some()
            || self.metric.is_some()
            || self.target.is_some()
            || self.metric_port.is_some()
            || self.metric_path.is_some()
            || self.scale_down_window.is_some()
            || self.scale_up_window.is_some()
    }
}

/// A new service's spec: `flags` over one replica of one GPU at normal priority, running in
/// `cwd` (a process; a container starts in its image's directory).
pub fn create_spec(
    name: &str,
    tenant: Option<&str>,
    flags: &ServiceFlags,
    cwd: impl FnOnce() -> anyhow::Result<PathBuf>,
) -> anyhow::Result<pb::ServiceSpec> {
    if flags.command.is_empty() {
        bail!(
            "give the replicas' program after `--`: gpuctl service create {name} --replicas 2 -- python serve.py"
        );
    }
    let mut spec = pb::ServiceSpec {
        tenant: tenant.unwrap_or_default().to_owned(),
        name: name.to_owned(),
        template: Some(pb::JobSpec {
            gpus_per_task: 1,
            tasks: 1,
            priority_class: "normal".into(),
            ..Default::default()
        }),
        replicas: 1,
        ..Default::default()
    };
    if flags.chdir.is_none() && flags.image.as_deref().is_none_or(|i| i == "none") {
        let dir = cwd()?;
        spec.template.get_or_insert_default().workdir = path_text(&dir)?;
    }
    apply_flags(&mut spec, flags)?;
    Ok(spec)
}

fn path_text(dir: &std::path::Path) -> anyhow::Result<String> {
    dir.to_str()
        .map(str::to_owned)
        .with_context(|| format!("working directory {} is not UTF-8", dir.display()))
}

/// Changes `spec` by what `flags` give; what they do not give stays as it was.
pub fn apply_flags(spec: &mut pb::ServiceSpec, f: &ServiceFlags) -> anyhow::Result<()> {
    if let Some(r) = f.replicas {
        spec.replicas = r;
    }
    let t = spec.template.get_or_insert_default();
    // GPUs: --gpus counts GPUs (or MIG slices); a share is one GPU's part; a MIG profile and
    // a share exclude each other (clap refuses both at once).
    if let Some(g) = f.gpus {
        t.gpus_per_task = g;
        if g != 1 {
            t.gpu_milli = 0;
            t.gpu_memory_mib = 0;
        }
    }
    if let Some(m) = &f.mig {
        t.mig_profile = if m == "none" {
            String::new()
        } else {
            m.clone()
        };
        t.gpu_milli = 0;
        t.gpu_memory_mib = 0;
    }
    if let Some(milli) = f.gpu_milli {
        t.gpu_milli = milli;
        if milli == 0 {
            t.gpu_memory_mib = 0;
        } else {
            t.mig_profile.clear();
            if f.gpus.is_none() {
                t.gpus_per_task = 1;
            }
        }
    }
    if let Some(m) = &f.gpu_mem {
        t.gpu_memory_mib = parse_mem_mib(m)?;
    }
    if let Some(c) = f.cpus {
        t.cpu_milli_per_task = cpu_milli(c)?;
    }
    if let Some(m) = &f.mem {
        t.memory_mib_per_task = i64::try_from(parse_mem_mib(m)?)
            .with_context(|| format!("--mem {m:?} is too large"))?;
    }
    match f.image.as_deref() {
        Some("none") | Some("") => {
            if !f.mounts.is_empty() {
                bail!("--mount needs a container: give --image IMAGE");
            }
            t.container = None;
        }
        Some(image) => {
            let c = t.container.get_or_insert_default();
            c.image = image.to_owned();
        }
        None => {}
    }
    if !f.mounts.is_empty() {
        let Some(c) = t.container.as_mut() else {
            bail!("--mount needs a container: give --image IMAGE");
        };
        c.mounts = f
            .mounts
            .iter()
            .map(|m| parse_mount(m))
            .collect::<anyhow::Result<_>>()?;
    }
    if !f.ports.is_empty() {
        t.ports = f.ports.clone();
    }
    for kv in &f.env {
        match kv.strip_suffix('-') {
            Some(key) if !kv.contains('=') => {
                t.env.remove(key);
            }
            _ => {
                let (k, v) = env_pair(kv)?;
                t.env.insert(k, v);
            }
        }
    }
    if let Some(p) = &f.partition {
        t.partition = p.clone();
    }
    if !f.gpu_models.is_empty() {
        t.gpu_models = gpu_model_list(&f.gpu_models);
    }
    if let Some(p) = &f.priority {
        t.priority_class = p.clone();
    }
    if let Some(p) = f.preemptible {
        t.preemptible = p;
    }
    if let Some(n) = f.single_numa {
        t.single_numa = n;
    }
    if let Some(dir) = &f.chdir {
        let dir = if t.container.is_some() {
            dir.clone()
        } else {
            std::path::absolute(dir).with_context(|| format!("--chdir {}", dir.display()))?
        };
        t.workdir = path_text(&dir)?;
    }
    if !f.command.is_empty() {
        t.command = f.command.clone();
    }
    apply_probes(spec, f)?;
    apply_autoscale(spec, f)?;
    apply_strategy(spec, f)?;
    let r = spec.restart.get_or_insert_default();
    if let Some(d) = &f.restart_backoff {
        r.backoff_initial_ms = flag_ms("--restart-backoff", d)?;
    }
    if let Some(d) = &f.restart_backoff_max {
        r.backoff_max_ms = flag_ms("--restart-backoff-max", d)?;
    }
    if let Some(n) = f.crash_loop_after {
        r.crash_loop_after = n;
    }
    if let Some(d) = &f.restart_reset_after {
        r.reset_after_ms = flag_ms("--restart-reset-after", d)?;
    }
    Ok(())
}

fn flag_ms(flag: &str, text: &str) -> anyhow::Result<u64> {
    parse_duration_ms(text).with_context(|| flag.to_owned())
}

fn apply_probes(spec: &mut pb::ServiceSpec, f: &ServiceFlags) -> anyhow::Result<()> {
    for (flag, given, probe) in [
        ("--readiness", &f.readiness, &mut spec.readiness),
        ("--liveness", &f.liveness, &mut spec.liveness),
    ] {
        let Some(text) = given else { continue };
        match parse_probe(text).with_context(|| flag.to_owned())? {
            ProbeArg::Remove => *probe = None,
            // A new check keeps the timings of the probe it replaces.
            ProbeArg::Check(check) => probe.get_or_insert_default().check = Some(check),
        }
    }
    if !f.changes_probe_timing() {
        return Ok(());
    }
    if spec.readiness.is_none() && spec.liveness.is_none() {
        bail!("--probe-* settings apply to probes: give --readiness or --liveness too");
    }
    for p in [&mut spec.readiness, &mut spec.liveness]
        .into_iter()
        .flatten()
    {
        if let Some(d) = &f.probe_period {
            p.period_ms = flag_ms("--probe-period", d)?;
        }
        if let Some(d) = &f.probe_timeout {
            p.timeout_ms = flag_ms("--probe-timeout", d)?;
        }
        if let Some(d) = &f.probe_initial_delay {
            p.initial_delay_ms = flag_ms("--probe-initial-delay", d)?;
        }
        if let Some(n) = f.probe_failure_threshold {
            p.failure_threshold = n;
        }
        if let Some(n) = f.probe_success_threshold {
            p.success_threshold = n;
        }
    }
    Ok(())
}

fn apply_autoscale(spec: &mut pb::ServiceSpec, f: &ServiceFlags) -> anyhow::Result<()> {
    if f.no_autoscale {
        spec.autoscale = None;
        return Ok(());
    }
    if !f.changes_autoscale() {
        return Ok(());
    }
    let a = spec.autoscale.get_or_insert_default();
    if let Some(n) = f.min {
        a.min = n;
    }
    if let Some(n) = f.max {
        a.max = n;
    }
    if let Some(m) = &f.metric {
        a.metric = m.clone();
    }
    if let Some(x) = f.target {
        a.target = x;
    }
    if let Some(p) = &f.metric_port {
        a.port = p.clone();
    }
    if let Some(p) = &f.metric_path {
        a.path = p.clone();
    }
    if let Some(d) = &f.scale_down_window {
        a.scale_down_window_ms = Some(flag_ms("--scale-down-window", d)?);
    }
    if let Some(d) = &f.scale_up_window {
        a.scale_up_window_ms = flag_ms("--scale-up-window", d)?;
    }
    let missing: Vec<&str> = [
        (a.metric.is_empty(), "--metric NAME"),
        (a.target == 0.0, "--target X"),
        (a.min == 0, "--min N"),
        (a.max == 0, "--max N"),
    ]
    .into_iter()
    .filter_map(|(missing, flag)| missing.then_some(flag))
    .collect();
    if !missing.is_empty() {
        bail!(
            "autoscaling needs {} as well (e.g. --min 1 --max 8 --metric queue_length --target 5)",
            missing.join(", ")
        );
    }
    // Where the count starts: what was asked, else the current count held in the range.
    if f.replicas.is_none() && a.min <= a.max {
        spec.replicas = spec.replicas.clamp(a.min, a.max);
    }
    Ok(())
}

fn apply_strategy(spec: &mut pb::ServiceSpec, f: &ServiceFlags) -> anyhow::Result<()> {
    let replicas = spec.replicas;
    let s = spec.strategy.get_or_insert_default();
    let surge = f
        .max_surge
        .as_deref()
        .map(|t| int_or_percent("--max-surge", t, replicas, Rounding::Up))
        .transpose()?;
    let unavailable = f
        .max_unavailable
        .as_deref()
        .map(|t| int_or_percent("--max-unavailable", t, replicas, Rounding::Down))
        .transpose()?;
    if let Some(surge) = surge {
        s.max_surge = Some(surge.value);
    }
    if let Some(unavailable) = unavailable {
        s.max_unavailable = Some(unavailable.value);
    }
    // Kubernetes: percentages that both come to 0 let one replica be unavailable, or a
    // rollout could never replace one (two explicit zeros are refused by the cluster).
    let by_percent = surge.is_some_and(|s| s.percent) || unavailable.is_some_and(|u| u.percent);
    if by_percent && s.max_surge == Some(0) && s.max_unavailable.unwrap_or(0) == 0 {
        s.max_unavailable = Some(1);
    }
    if let Some(d) = &f.progress_deadline {
        s.progress_deadline_ms = flag_ms("--progress-deadline", d)?;
    }
    Ok(())
}

/// How a percentage of the replicas becomes a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// maxSurge: more copies rather than fewer.
    Up,
    /// maxUnavailable: fewer replicas away rather than more.
    Down,
}

/// A count from `N` or `P%` of `replicas`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub value: u32,
    pub percent: bool,
}

/// `N` or `P%` (of `replicas`, rounded as Kubernetes rounds maxSurge up and maxUnavailable
/// down) as a count; `what` names the setting in errors.
pub fn int_or_percent(
    what: &str,
    text: &str,
    replicas: u32,
    rounding: Rounding,
) -> anyhow::Result<Resolved> {
    let text = text.trim();
    let bad = || {
        format!(
            "{what} {:?} is not a count (2) or a percentage of the replicas (25%)",
            printable(text)
        )
    };
    if let Some(p) = text.strip_suffix('%') {
        let p: u64 = p
            .trim()
            .parse()
            .ok()
            .filter(|p| *p <= 100)
            .with_context(bad)?;
        let scaled = p * u64::from(replicas);
        let value = match rounding {
            Rounding::Up => scaled.div_ceil(100),
            Rounding::Down => scaled / 100,
        };
        return Ok(Resolved {
            // At most 100% of a u32 count: fits.
            value: u32::try_from(value).unwrap_or(u32::MAX),
            percent: true,
        });
    }
    Ok(Resolved {
        value: text.parse().ok().with_context(bad)?,
        percent: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `gpuctl service create web ARGS` as the CLI parses it.
    fn flags(args: &[&str]) -> ServiceFlags {
        let cli = crate::cli::Cli::try_parse_from(
            ["gpuctl", "service", "create", "web"]
                .iter()
                .chain(args)
                .copied(),
        )
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        match cli.command {
            crate::cli::Command::Service {
                command: crate::cli::service::ServiceCommand::Create(c),
            } => c.flags,
            _ => panic!("not service create"),
        }
    }

    fn create(args: &[&str]) -> pb::ServiceSpec {
        create_spec("web", None, &flags(args), || Ok(PathBuf::from("/home/me"))).unwrap()
    }

    #[test]
    fn the_briefest_create_is_one_replica_of_one_gpu_in_the_current_directory() {
        let s = create(&["--", "python", "serve.py"]);
        let t = s.template.as_ref().unwrap();
        assert_eq!((s.name.as_str(), s.replicas), ("web", 1));
        assert_eq!((t.gpus_per_task, t.tasks), (1, 1));
        assert_eq!(t.command, ["python", "serve.py"]);
        assert_eq!(t.workdir, "/home/me");
        assert_eq!(t.priority_class, "normal");
        assert!(s.readiness.is_none() && s.autoscale.is_none());
        // What the cluster would make of it is a valid service.
        let mut wire = s.clone();
        wire.tenant = "default".into();
        let domain = crate::api::convert_service::service_spec_from_proto(wire).unwrap();
        assert_eq!(
            crate::state::service::validate_service_spec(&domain),
            Ok(())
        );
    }

    #[test]
    fn every_create_flag_lands_in_the_spec() {
        let s = create(&[
            "--replicas",
            "4",
            "--gpu-milli",
            "500",
            "--gpu-mem",
            "20G",
            "--cpus",
            "2",
            "--mem",
            "8G",
            "--image",
            "srv:1",
            "--port",
            "http",
            "--port",
            "metrics",
            "-e",
            "A=1",
            "-e",
            "B=x=y",
            "-p",
            "inference",
            "-C",
            "A100|H100",
            "--priority",
            "high",
            "--preemptible",
            "--readiness",
            "http:http:/ready",
            "--liveness",
            "tcp:http",
            "--probe-period",
            "500ms",
            "--probe-timeout",
            "2s",
            "--probe-initial-delay",
            "5",
            "--probe-failure-threshold",
            "4",
            "--probe-success-threshold",
            "2",
            "--max-surge",
            "25%",
            "--max-unavailable",
            "25%",
            "--progress-deadline",
            "5m",
            "--restart-backoff",
            "2s",
            "--restart-backoff-max",
            "1m",
            "--crash-loop-after",
            "3",
            "--restart-reset-after",
            "30m",
            "--min",
            "2",
            "--max",
            "8",
            "--metric",
            "queue_length",
            "--target",
            "5",
            "--metric-port",
            "metrics",
            "--metric-path",
            "/m",
            "--scale-down-window",
            "1m",
            "--scale-up-window",
            "10s",
            "--",
            "serve",
            "--fast",
        ]);
        let t = s.template.as_ref().unwrap();
        assert_eq!(s.replicas, 4);
        assert_eq!(
            (t.gpus_per_task, t.gpu_milli, t.gpu_memory_mib),
            (1, 500, 20_480)
        );
        assert_eq!(
            (t.cpu_milli_per_task, t.memory_mib_per_task),
            (2_000, 8_192)
        );
        assert_eq!(t.container.as_ref().unwrap().image, "srv:1");
        assert_eq!(t.workdir, "", "a container starts in its image's directory");
        assert_eq!(t.ports, ["http", "metrics"]);
        assert_eq!((t.env["A"].as_str(), t.env["B"].as_str()), ("1", "x=y"));
        assert_eq!(t.partition, "inference");
        assert_eq!(t.gpu_models, ["A100", "H100"]);
        assert_eq!(t.priority_class, "high");
        assert!(t.preemptible);
        assert_eq!(t.command, ["serve", "--fast"]);
        for p in [s.readiness.as_ref().unwrap(), s.liveness.as_ref().unwrap()] {
            assert_eq!(
                (p.period_ms, p.timeout_ms, p.initial_delay_ms),
                (500, 2_000, 5_000)
            );
            assert_eq!((p.failure_threshold, p.success_threshold), (4, 2));
        }
        let st = s.strategy.unwrap();
        // 25% of 4: surge rounds up to 1, unavailable down to 1.
        assert_eq!((st.max_surge, st.max_unavailable), (Some(1), Some(1)));
        assert_eq!(st.progress_deadline_ms, 300_000);
        let r = s.restart.unwrap();
        assert_eq!(
            (
                r.backoff_initial_ms,
                r.backoff_max_ms,
                r.crash_loop_after,
                r.reset_after_ms
            ),
            (2_000, 60_000, 3, 1_800_000)
        );
        let a = s.autoscale.unwrap();
        assert_eq!(
            (a.min, a.max, a.metric.as_str(), a.target),
            (2, 8, "queue_length", 5.0)
        );
        assert_eq!((a.port.as_str(), a.path.as_str()), ("metrics", "/m"));
        assert_eq!(
            (a.scale_down_window_ms, a.scale_up_window_ms),
            (Some(60_000), 10_000)
        );
    }

    #[test]
    fn an_update_changes_only_what_was_given() {
        let mut s = create(&[
            "--replicas",
            "3",
            "--gpu-milli",
            "250",
            "--port",
            "http",
            "-e",
            "A=1",
            "-e",
            "B=2",
            "--readiness",
            "http:http:/ready",
            "--probe-period",
            "2s",
            "--",
            "serve",
        ]);
        let before = s.clone();
        apply_flags(&mut s, &flags(&["-e", "A-", "-e", "C=3"])).unwrap();
        let t = s.template.as_ref().unwrap();
        assert!(!t.env.contains_key("A"));
        assert_eq!((t.env["B"].as_str(), t.env["C"].as_str()), ("2", "3"));
        assert_eq!(t.command, ["serve"], "no command given: the old one stays");
        assert_eq!(s.replicas, 3);
        // A new check keeps the probe's timings; `none` removes a probe.
        apply_flags(&mut s, &flags(&["--readiness", "tcp:http"])).unwrap();
        assert_eq!(s.readiness.as_ref().unwrap().period_ms, 2_000);
        apply_flags(&mut s, &flags(&["--readiness", "none"])).unwrap();
        assert!(s.readiness.is_none());
        // Whole GPUs again, then a MIG slice: the share goes.
        let mut s = before.clone();
        apply_flags(&mut s, &flags(&["--gpus", "2"])).unwrap();
        let t = s.template.as_ref().unwrap();
        assert_eq!((t.gpus_per_task, t.gpu_milli), (2, 0));
        let mut s = before;
        apply_flags(&mut s, &flags(&["--mig", "1g.10gb"])).unwrap();
        let t = s.template.as_ref().unwrap();
        assert_eq!(
            (t.mig_profile.as_str(), t.gpu_milli, t.gpus_per_task),
            ("1g.10gb", 0, 1)
        );
    }

    #[test]
    fn autoscaling_needs_its_four_settings_and_starts_within_its_range() {
        let f = flags(&["--max", "8", "--metric", "q", "--", "serve"]);
        let e = create_spec("web", None, &f, || Ok(PathBuf::from("/"))).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("--target X") && e.contains("--min N"), "{e}");
        let s = create(&[
            "--min", "2", "--max", "8", "--metric", "q", "--target", "1.5", "--", "s",
        ]);
        assert_eq!(s.replicas, 2, "starts at its minimum");
        let mut s2 = s.clone();
        apply_flags(&mut s2, &flags(&["--no-autoscale"])).unwrap();
        assert!(s2.autoscale.is_none());
        assert_eq!(s2.replicas, 2);
    }

    #[test]
    fn percentages_round_as_kubernetes_does() {
        let r = |t, n, up| int_or_percent("x", t, n, up).unwrap().value;
        assert_eq!(r("25%", 10, Rounding::Up), 3);
        assert_eq!(r("25%", 10, Rounding::Down), 2);
        assert_eq!(r("100%", 7, Rounding::Down), 7);
        assert_eq!(r("0%", 7, Rounding::Up), 0);
        assert_eq!(r("3", 7, Rounding::Up), 3);
        for bad in ["150%", "-1", "x%", "", "1.5"] {
            assert!(int_or_percent("x", bad, 4, Rounding::Up).is_err(), "{bad}");
        }
        // Both percentages come to 0 of 3 replicas: one may be unavailable.
        let s = create(&[
            "--replicas",
            "3",
            "--max-surge",
            "0%",
            "--max-unavailable",
            "10%",
            "--",
            "s",
        ]);
        let st = s.strategy.unwrap();
        assert_eq!((st.max_surge, st.max_unavailable), (Some(0), Some(1)));
    }

    #[test]
    fn mistakes_are_refused_with_what_to_write() {
        let f = flags(&["--replicas", "2"]);
        let e = create_spec("web", None, &f, || Ok(PathBuf::from("/"))).unwrap_err();
        assert!(e.to_string().contains("after `--`"), "{e}");
        let f = flags(&["--probe-period", "1s", "--", "s"]);
        let e = create_spec("web", None, &f, || Ok(PathBuf::from("/"))).unwrap_err();
        assert!(e.to_string().contains("give --readiness"), "{e}");
        let f = flags(&["--mount", "/a:/b", "--", "s"]);
        let e = create_spec("web", None, &f, || Ok(PathBuf::from("/"))).unwrap_err();
        assert!(e.to_string().contains("--image"), "{e}");
        let f = flags(&["--readiness", "ftp:x", "--", "s"]);
        let e = format!(
            "{:#}",
            create_spec("web", None, &f, || Ok(PathBuf::from("/"))).unwrap_err()
        );
        assert!(e.contains("--readiness") && e.contains("ftp"), "{e}");
        let f = flags(&["--progress-deadline", "soon", "--", "s"]);
        let e = format!(
            "{:#}",
            create_spec("web", None, &f, || Ok(PathBuf::from("/"))).unwrap_err()
        );
        assert!(
            e.contains("--progress-deadline") && e.contains("soon"),
            "{e}"
        );
        // A share and a MIG slice at once: clap says so.
        assert!(
            crate::cli::Cli::try_parse_from([
                "gpuctl",
                "service",
                "create",
                "web",
                "--gpu-milli",
                "5",
                "--mig",
                "1g.10gb",
                "--",
                "s"
            ])
            .is_err()
        );
    }
}
