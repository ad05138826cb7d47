//! Synthetic traces for the replay: the shapes the public trace lacks (multi-node gangs,
//! priorities, tenants, time limits, dependency chains), deterministic from a seed.
//!
//! Arrivals are a Poisson process whose rate is chosen so that the offered GPU load (GPU
//! capacity × seconds the jobs would hold, per second) is `load` × the fleet's GPU capacity.
//! Durations are log-uniform from 1 minute to 8 hours. Most jobs get a time limit 1.2–3× their
//! duration; one in eight gets a limit below it and is stopped there (`TimedOut`).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;

use super::csv_table::{CsvRow, CsvTable};
use crate::scheduler::score::SplitMix64;
use crate::state::{Gpu, GpuHealth, JobSpec, MILLI_PER_GPU, NodeSpec};

/// One job of a trace: what is submitted, when, and how long it would run.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceJob {
    /// Dependencies are left empty here; see `after`.
    pub spec: JobSpec,
    /// Submission time, ms from the start of the trace.
    pub arrival_ms: u64,
    /// How long the job runs once started if nothing stops it.
    pub duration_ms: u64,
    /// Index (in the trace) of an earlier job this one waits for (`afterany`).
    pub after: Option<usize>,
}

impl TraceJob {
    /// How long it holds its resources: its duration, cut at its time limit.
    pub fn run_ms(&self) -> u64 {
        match self.spec.time_limit_secs {
            Some(l) => self.duration_ms.min(l * 1000),
            None => self.duration_ms,
        }
    }
}

/// A uniform draw in [0, 1).
pub(super) fn unit(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// `n` jobs offering `load` × `capacity_gpus` of GPU work per unit of time.
pub fn synthetic(n: usize, capacity_gpus: usize, load: f64, seed: u64) -> Vec<TraceJob> {
    let mut rng = SplitMix64::new(seed ^ 0x005e_ed0f_7ace);
    let mut jobs = Vec::with_capacity(n);
    let mut last_of_tenant: [Option<usize>; 8] = [None; 8];
    for i in 0..n {
        let (gpus, tasks, milli) = match rng.below(100) {
            0..=33 => (1, 1, 0),
            34..=47 => (2, 1, 0),
            48..=57 => (4, 1, 0),
            58..=67 => (8, 1, 0),
            68..=71 => (8, 2, 0),
            72..=73 => (8, 4, 0),
            74..=83 => (1, 1, 250),
            84..=94 => (1, 1, 500),
            _ => (0, 1, 0),
        };
        let priority = match rng.below(10) {
            0..=5 => "normal",
            6..=7 => "low",
            _ => "high",
        };
        // Log-uniform from 60 s to 8 h.
        let duration_ms = (60_000.0 * (480.0f64).powf(unit(&mut rng))) as u64;
        let factor = if rng.below(8) == 0 {
            0.5 + 0.4 * unit(&mut rng)
        } else {
            1.2 + 1.8 * unit(&mut rng)
        };
        let limit_s = ((duration_ms as f64 * factor / 1000.0 / 60.0).ceil() as u64).max(1) * 60;
        let tenant = rng.below(8) as usize;
        let preemptible = rng.below(4) == 0;
        let mut spec =
            crate::synthetic::job_spec(i, tenant as u64, (gpus, tasks, milli), priority, limit_s);
        spec.preemptible = preemptible;
        // One job in twelve waits for its tenant's previous job.
        let after = if rng.below(12) == 0 {
            last_of_tenant[tenant]
        } else {
            None
        };
        last_of_tenant[tenant] = Some(i);
        jobs.push(TraceJob {
            spec,
            arrival_ms: 0,
            duration_ms,
            after,
        });
    }
    poisson_arrivals(&mut jobs, capacity_gpus, load, &mut rng);
    jobs
}

/// Sets the jobs' arrival times, in order, as a Poisson process whose rate makes the offered
/// GPU work `load` × `capacity_gpus`: load × capacity (milli-GPU) / the mean milli-GPU-ms a
/// job holds.
pub(super) fn poisson_arrivals(
    jobs: &mut [TraceJob],
    capacity_gpus: usize,
    load: f64,
    rng: &mut SplitMix64,
) {
    let work: f64 = jobs
        .iter()
        .map(|j| j.spec.total_gpu_milli() as f64 * j.run_ms() as f64)
        .sum::<f64>()
        / jobs.len().max(1) as f64;
    let rate_per_ms = load * (capacity_gpus as u64 * MILLI_PER_GPU) as f64 / work.max(1.0);
    let mut t = 0.0f64;
    for j in jobs.iter_mut() {
        j.arrival_ms = t as u64;
        t += -(1.0 - unit(rng)).ln() / rate_per_ms;
    }
}

/// The trace's CSV (`csv_table`), with fields read by column and parse errors naming
/// `FILE:LINE` and the field.
struct Csv {
    table: CsvTable,
    path: String,
}

type Row = CsvRow;

impl Csv {
    fn read(path: &Path) -> anyhow::Result<Csv> {
        Ok(Csv {
            table: CsvTable::read(path)?,
            path: path.display().to_string(),
        })
    }

    fn rows(&self) -> &[Row] {
        &self.table.rows
    }

    fn column(&self, name: &str) -> anyhow::Result<usize> {
        self.table
            .column(name)
            .with_context(|| format!("{}: no column {name:?} in the header", self.path))
    }

    /// Field `col` of a row, parsed; `None` when empty.
    fn get<T: std::str::FromStr>(&self, row: &Row, col: usize) -> anyhow::Result<Option<T>> {
        let name = &self.table.header[col];
        let line = row.line;
        let f = row
            .fields
            .get(col)
            .with_context(|| format!("{}:{line}: field {name} missing", self.path))?;
        if f.is_empty() {
            return Ok(None);
        }
        f.parse()
            .map(Some)
            .map_err(|_| anyhow::anyhow!("{}:{line}: field {name}: cannot parse {f:?}", self.path))
    }

    fn need<T: std::str::FromStr>(&self, row: &Row, col: usize) -> anyhow::Result<T> {
        self.get(row, col)?.with_context(|| {
            format!(
                "{}:{}: field {} is empty",
                self.path, row.line, self.table.header[col]
            )
        })
    }
}

/// Nodes of the public trace's node list (`sn, cpu_milli, memory_mib, gpu, model`): `gpu` GPUs
/// of `model` each (16 GiB of memory, no topology).
pub fn trace_nodes(path: &Path) -> anyhow::Result<Vec<NodeSpec>> {
    let csv = Csv::read(path)?;
    let [sn, cpu, mem, gpu, model] =
        ["sn", "cpu_milli", "memory_mib", "gpu", "model"].map(|c| csv.column(c));
    let (sn, cpu, mem, gpu, model) = (sn?, cpu?, mem?, gpu?, model?);
    let mut nodes = Vec::with_capacity(csv.rows().len());
    for row in csv.rows() {
        let name: String = csv.need(row, sn)?;
        let model: String = csv.need(row, model)?;
        let gpus: u32 = csv.need(row, gpu)?;
        nodes.push(NodeSpec {
            agent_release: String::new(),
            enforcement: String::new(),
            container_runtime: String::new(),
            service_ports: None,
            gpus: (0..gpus)
                .map(|i| Gpu {
                    uuid: format!("GPU-{name}-{i}"),
                    index: i,
                    model: model.clone(),
                    memory_mib: 16_384,
                    numa_node: None,
                    pci_bus_id: String::new(),
                    health: GpuHealth::Healthy,
                    mig: vec![],
                })
                .collect(),
            name,
            cpu_milli: csv.need(row, cpu)?,
            memory_mib: csv.need(row, mem)?,
            partition: None,
            labels: BTreeMap::new(),
            topology: vec![],
            agent_address: String::new(),
            driver: "simulated".into(),
            incarnation: String::new(),
        });
    }
    Ok(nodes)
}

/// Jobs of the public trace's pod list, tenant `tenant`: arrival `creation_time`, duration
/// `deletion_time − scheduled_time`; a `gpu_milli` below 1000 on a one-GPU pod is a share.
/// Rows without both times (or ending before they start) are skipped; returns how many. At
/// most `max` jobs (the earliest), sorted by arrival. With `limit_factor`, each job gets a time
/// limit of its duration × the factor (rounded up to a second); without, none.
pub fn trace_pods(
    path: &Path,
    tenant: &str,
    max: Option<usize>,
    limit_factor: Option<f64>,
) -> anyhow::Result<(Vec<TraceJob>, usize)> {
    let csv = Csv::read(path)?;
    let col = |c| csv.column(c);
    let (name, cpu, mem, num_gpu, gpu_milli) = (
        col("name")?,
        col("cpu_milli")?,
        col("memory_mib")?,
        col("num_gpu")?,
        col("gpu_milli")?,
    );
    let (created, deleted, scheduled) = (
        col("creation_time")?,
        col("deletion_time")?,
        col("scheduled_time")?,
    );
    let spec_col = csv.column("gpu_spec").ok();
    let mut jobs = Vec::new();
    let mut skipped = 0;
    for row in csv.rows() {
        let times: (Option<u64>, Option<u64>, Option<u64>) = (
            csv.get(row, created)?,
            csv.get(row, deleted)?,
            csv.get(row, scheduled)?,
        );
        let (Some(arrival), Some(end), Some(start)) = times else {
            skipped += 1;
            continue;
        };
        if end < start {
            skipped += 1;
            continue;
        }
        let gpus: u32 = csv.need(row, num_gpu)?;
        let milli: u32 = csv.get(row, gpu_milli)?.unwrap_or(0);
        let models: Vec<String> = match spec_col {
            Some(c) if gpus > 0 => row.fields.get(c).map_or(vec![], |s| {
                s.split('|')
                    .filter(|m| !m.is_empty())
                    .map(str::to_owned)
                    .collect()
            }),
            _ => vec![],
        };
        let duration_ms = (end - start) * 1000;
        jobs.push(TraceJob {
            spec: JobSpec {
                tenant: tenant.into(),
                name: csv.need(row, name)?,
                command: vec!["pod".into()],
                gpus_per_task: gpus,
                tasks: 1,
                gpu_models: models,
                priority_class: "normal".into(),
                time_limit_secs: limit_factor
                    .map(|f| ((duration_ms as f64 * f / 1000.0).ceil() as u64).max(1)),
                cpu_milli_per_task: csv.need(row, cpu)?,
                memory_mib_per_task: csv.need(row, mem)?,
                gpu_milli: if gpus == 1 && milli > 0 && milli < 1000 {
                    milli
                } else {
                    0
                },
                ..JobSpec::default()
            },
            arrival_ms: arrival * 1000,
            duration_ms,
            after: None,
        });
    }
    jobs.sort_by_key(|j| j.arrival_ms);
    if let Some(max) = max {
        jobs.truncate(max);
    }
    Ok((jobs, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_at_the_target_load() {
        let a = synthetic(3000, 512, 0.9, 7);
        assert_eq!(a, synthetic(3000, 512, 0.9, 7));
        assert_ne!(a, synthetic(3000, 512, 0.9, 8));
        let span = a.last().unwrap().arrival_ms as f64;
        let work: f64 = a
            .iter()
            .map(|j| j.spec.total_gpu_milli() as f64 * j.run_ms() as f64)
            .sum();
        let offered = work / span / 512_000.0;
        assert!((offered - 0.9).abs() < 0.15, "offered load {offered}");
        assert!(a.iter().any(|j| j.spec.tasks > 1));
        assert!(a.iter().any(|j| j.after.is_some()));
        assert!(a.iter().any(|j| j.run_ms() < j.duration_ms));
    }

    #[test]
    fn trace_csv_reading() {
        let dir = std::env::temp_dir().join(format!("replay-csv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pods = dir.join("pods.csv");
        std::fs::write(
            &pods,
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
             p0,1000,2048,1,460,,LS,Running,5,100,10\n\
             p1,1000,2048,2,1000,,LS,Pending,3,,\n\
             p2,1000,2048,0,0,,LS,Running,1,50,2\n",
        )
        .unwrap();
        let (jobs, skipped) = trace_pods(&pods, "t", None, Some(2.0)).unwrap();
        assert_eq!(skipped, 1);
        assert_eq!(jobs.len(), 2);
        assert_eq!(
            (
                jobs[0].spec.name.as_str(),
                jobs[0].arrival_ms,
                jobs[0].duration_ms
            ),
            ("p2", 1000, 48_000)
        );
        assert_eq!(
            (jobs[1].spec.gpu_milli, jobs[1].spec.time_limit_secs),
            (460, Some(180))
        );
        std::fs::write(&pods, "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time,scheduled_time\np0,x,1,1,1,1,1,1\n").unwrap();
        let e = trace_pods(&pods, "t", None, None).unwrap_err().to_string();
        assert!(e.contains("pods.csv:2: field cpu_milli"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
