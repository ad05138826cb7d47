//! `gpuctl sacct`: one line per job (elapsed time, GPU-hours, exit code), and `gpuctl
//! accounting` (alias `sreport`): what each tenant's jobs used, as Slurm's `sreport` sums
//! `sacct`: jobs by final state, GPU-hours held (from each job's time running, times
//! the GPUs its tasks held), and, from the cgroups of enforcing nodes, CPU-hours, the
//! largest memory peak and OOM kills. Computed by the client from the jobs the control
//! plane still holds in full; archived jobs keep no history or usage and are counted only.

use std::collections::BTreeMap;

use proto::v1 as pb;
use serde_json::json;

use super::output::{Format, printable, table};
use crate::client::{Client, with_timeout};

#[derive(clap::Args, Debug, Clone)]
pub struct AccountingArgs {
    /// Only this tenant's jobs.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only jobs submitted at or after this time (RFC 3339, e.g. 2026-12-01T00:00:00Z).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<u64>,
}

fn parse_time(s: &str) -> Result<u64, String> {
    humantime::parse_rfc3339_weak(s)
        .map_err(|e| format!("{s:?}: {e} (give e.g. 2026-12-01T00:00:00Z)"))
        .and_then(|t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .map_err(|_| format!("{s:?} is before 1970"))
        })
}

/// One tenant's sums.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TenantUse {
    pub jobs: u64,
    pub by_state: BTreeMap<String, u64>,
    /// GPU-milliseconds held while running (a share counts its fraction of the GPU).
    pub gpu_ms: u128,
    pub cpu_ms: u64,
    pub peak_memory_bytes: u64,
    pub oom_kills: u64,
    /// Jobs with at least one measured task.
    pub measured: u64,
}

/// GPUs one task of `spec` holds, in thousandths (a share: its milli; whole GPUs × 1000).
fn gpu_milli_per_task(spec: &pb::JobSpec) -> u64 {
    if spec.gpu_milli > 0 {
        u64::from(spec.gpu_milli)
    } else {
        (spec.gpus_per_task.max(0) as u64) * 1000
    }
}

/// Milliseconds `job` spent running, from its history: each `running` entry until the next
/// entry (or `now_ms` while it still runs).
fn running_ms(job: &pb::Job, now_ms: u64) -> u64 {
    let mut total = 0;
    let h = &job.history;
    for (i, entry) in h.iter().enumerate() {
        if entry.state == "running" {
            let end = h.get(i + 1).map_or(now_ms, |n| n.at_ms);
            total += end.saturating_sub(entry.at_ms);
        }
    }
    total
}

/// GPU-milliseconds a job held while running (every task, a share at its fraction).
fn gpu_ms_of(job: &pb::Job, now_ms: u64) -> u128 {
    let spec = job.spec.clone().unwrap_or_default();
    let tasks = spec.tasks.max(1) as u128;
    u128::from(running_ms(job, now_ms)) * tasks * u128::from(gpu_milli_per_task(&spec)) / 1000
}

/// `gpuctl sacct`: one job a line, as Slurm's sacct prints them.
#[derive(clap::Args, Debug, Clone)]
pub struct SacctArgs {
    /// Only this tenant's jobs.
    #[arg(long, short = 'A', alias = "account")]
    pub tenant: Option<String>,
    /// Only jobs submitted at or after this time (RFC 3339; default: every job the control
    /// plane still holds in full).
    #[arg(long, short = 'S', alias = "starttime", value_parser = parse_time)]
    pub since: Option<u64>,
    /// Only jobs in these states (succeeded, failed, cancelled, timed_out, running, ...).
    #[arg(long = "state", short = 's', value_delimiter = ',')]
    pub states: Vec<String>,
}

/// One line of sacct: the job, how long it ran, what it held, how it ended. Pure.
pub fn sacct_row(j: &pb::Job, now_ms: u64) -> Vec<String> {
    let spec = j.spec.clone().unwrap_or_default();
    let gpus = if spec.gpu_milli > 0 {
        format!("{}x{}m", spec.tasks, spec.gpu_milli)
    } else {
        format!("{}x{}", spec.tasks, spec.gpus_per_task)
    };
    let ended = j
        .history
        .last()
        .filter(|h| {
            matches!(
                h.state.as_str(),
                "succeeded" | "failed" | "cancelled" | "timed_out"
            )
        })
        .map_or("-".to_owned(), |h| super::output::format_time(h.at_ms));
    vec![
        super::slurm_syntax::job_id_text(j),
        if j.redacted {
            "(hidden)".into()
        } else {
            printable(&spec.name)
        },
        printable(&spec.tenant),
        if spec.partition.is_empty() {
            "-".into()
        } else {
            printable(&spec.partition)
        },
        j.state.to_uppercase(),
        super::output::format_duration(running_ms(j, now_ms) / 1000),
        gpus,
        format!("{:.2}", gpu_ms_of(j, now_ms) as f64 / 3_600_000.0),
        j.exit
            .as_ref()
            .map_or("-".into(), |e| format!("{}:{}", e.code, e.signal)),
        ended,
    ]
}

pub async fn sacct(client: &mut Client, args: SacctArgs, fmt: Format) -> anyhow::Result<()> {
    let tenant = args.tenant.clone().unwrap_or_default();
    let states = args.states.clone();
    let resp = client
        .call(|mut c, t| {
            let (tenant, states) = (tenant.clone(), states.clone());
            async move {
                let req = pb::ListJobsRequest {
                    tenant,
                    states,
                    include_finished: true,
                    ..Default::default()
                };
                c.list_jobs(with_timeout(req, t)).await
            }
        })
        .await?;
    let now_ms = crate::replica::now_ms();
    let jobs: Vec<&pb::Job> = resp
        .jobs
        .iter()
        .filter(|j| args.since.is_none_or(|s| j.submitted_at_ms >= s))
        .collect();
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"jobs": jobs.iter().map(|j| json!({
                "id": j.id,
                "job": super::slurm_syntax::job_id_text(j),
                "name": j.spec.as_ref().map(|s| s.name.clone()),
                "tenant": j.spec.as_ref().map(|s| s.tenant.clone()),
                "state": j.state,
                "elapsed_secs": running_ms(j, now_ms) / 1000,
                "gpu_hours": gpu_ms_of(j, now_ms) as f64 / 3_600_000.0,
                "exit_code": j.exit.as_ref().map(|e| e.code),
                "exit_signal": j.exit.as_ref().map(|e| e.signal),
                "usage": j.usage.as_ref().map(|u| json!({
                    "cpu_ms": u.cpu_ms, "peak_memory_bytes": u.peak_memory_bytes,
                    "oom_kills": u.oom_kills,
                })),
            })).collect::<Vec<_>>()})
        ),
        Format::Table | Format::Wide => {
            let rows: Vec<Vec<String>> = jobs.iter().map(|j| sacct_row(j, now_ms)).collect();
            print!(
                "{}",
                table(
                    &[
                        "JOBID",
                        "NAME",
                        "TENANT",
                        "PARTITION",
                        "STATE",
                        "ELAPSED",
                        "TASKSxGPUS",
                        "GPU_HOURS",
                        "EXITCODE",
                        "END",
                    ],
                    &rows
                )
            );
        }
    }
    Ok(())
}

/// Sums `jobs` by tenant. Pure, so it is tested on its own.
pub fn sum_by_tenant(jobs: &[pb::Job], now_ms: u64) -> BTreeMap<String, TenantUse> {
    let mut out: BTreeMap<String, TenantUse> = BTreeMap::new();
    for j in jobs {
        let spec = j.spec.clone().unwrap_or_default();
        let t = out.entry(spec.tenant.clone()).or_default();
        t.jobs += 1;
        *t.by_state.entry(j.state.clone()).or_default() += 1;
        t.gpu_ms += gpu_ms_of(j, now_ms);
        if let Some(u) = &j.usage {
            t.cpu_ms += u.cpu_ms;
            t.peak_memory_bytes = t.peak_memory_bytes.max(u.peak_memory_bytes);
            t.oom_kills += u.oom_kills;
            t.measured += 1;
        }
    }
    out
}

pub async fn run(client: &mut Client, args: AccountingArgs, fmt: Format) -> anyhow::Result<()> {
    let tenant = args.tenant.clone().unwrap_or_default();
    let resp = client
        .call(|mut c, t| {
            let tenant = tenant.clone();
            async move {
                let req = pb::ListJobsRequest {
                    tenant,
                    include_finished: true,
                    ..Default::default()
                };
                c.list_jobs(with_timeout(req, t)).await
            }
        })
        .await?;
    let jobs: Vec<pb::Job> = resp
        .jobs
        .into_iter()
        .filter(|j| args.since.is_none_or(|s| j.submitted_at_ms >= s))
        .collect();
    let now_ms = crate::replica::now_ms();
    let sums = sum_by_tenant(&jobs, now_ms);
    match fmt {
        Format::Json | Format::Yaml => println!(
            "{}",
            json!({"tenants": sums.iter().map(|(name, u)| json!({
                "tenant": name, "jobs": u.jobs, "by_state": u.by_state,
                "gpu_hours": u.gpu_ms as f64 / 3_600_000.0,
                "cpu_hours": u.cpu_ms as f64 / 3_600_000.0,
                "peak_memory_bytes": u.peak_memory_bytes, "oom_kills": u.oom_kills,
                "jobs_measured": u.measured,
            })).collect::<Vec<_>>()})
        ),
        Format::Table | Format::Wide => {
            let rows: Vec<Vec<String>> = sums
                .iter()
                .map(|(name, u)| {
                    let states: Vec<String> =
                        u.by_state.iter().map(|(s, n)| format!("{s}={n}")).collect();
                    vec![
                        printable(name),
                        u.jobs.to_string(),
                        states.join(" "),
                        format!("{:.2}", u.gpu_ms as f64 / 3_600_000.0),
                        format!("{:.2}", u.cpu_ms as f64 / 3_600_000.0),
                        format!("{}", u.peak_memory_bytes / (1 << 20)),
                        u.oom_kills.to_string(),
                        format!("{}/{}", u.measured, u.jobs),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &[
                        "TENANT",
                        "JOBS",
                        "STATES",
                        "GPU_HOURS",
                        "CPU_HOURS",
                        "MAX_PEAK_MIB",
                        "OOM_KILLS",
                        "MEASURED",
                    ],
                    &rows
                )
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(
        tenant: &str,
        state: &str,
        gpus: i64,
        tasks: i64,
        history: &[(&str, u64)],
        usage: Option<(u64, u64, u64)>,
    ) -> pb::Job {
        pb::Job {
            spec: Some(pb::JobSpec {
                tenant: tenant.into(),
                gpus_per_task: gpus,
                tasks,
                ..Default::default()
            }),
            state: state.into(),
            history: history
                .iter()
                .map(|(s, at)| pb::StateChange {
                    at_ms: *at,
                    state: (*s).into(),
                    reason: String::new(),
                })
                .collect(),
            usage: usage.map(|(cpu_ms, peak, oom)| pb::JobUsage {
                cpu_ms,
                peak_memory_bytes: peak,
                oom_kills: oom,
                tasks_measured: 1,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn gpu_hours_count_each_running_stretch_times_the_gpus_held() {
        let hour = 3_600_000;
        let jobs = vec![
            // 2 tasks x 4 GPUs for 1 h: 8 GPU-hours.
            job(
                "vision",
                "succeeded",
                4,
                2,
                &[("pending", 0), ("running", hour), ("succeeded", 2 * hour)],
                Some((7_200_000, 1 << 30, 0)),
            ),
            // Ran 1 h, requeued, ran 0.5 h more: 1.5 GPU-hours.
            job(
                "vision",
                "failed",
                1,
                1,
                &[
                    ("running", 0),
                    ("pending", hour),
                    ("running", 2 * hour),
                    ("failed", 2 * hour + hour / 2),
                ],
                Some((1000, 2 << 30, 1)),
            ),
            // Still running since 1 h before now: 1 GPU-hour so far.
            job("nlp", "running", 1, 1, &[("running", 9 * hour)], None),
        ];
        let sums = sum_by_tenant(&jobs, 10 * hour);
        let v = &sums["vision"];
        assert_eq!(v.jobs, 2);
        assert_eq!(v.gpu_ms, (8 * hour + hour + hour / 2) as u128);
        assert_eq!(v.cpu_ms, 7_201_000);
        assert_eq!(v.peak_memory_bytes, 2 << 30);
        assert_eq!(v.oom_kills, 1);
        assert_eq!(v.measured, 2);
        assert_eq!(v.by_state["failed"], 1);
        assert_eq!(sums["nlp"].gpu_ms, hour as u128);
        assert_eq!(sums["nlp"].measured, 0);
    }

    #[test]
    fn a_share_counts_its_fraction_of_the_gpu() {
        let mut j = job(
            "t",
            "succeeded",
            1,
            1,
            &[("running", 0), ("succeeded", 1000)],
            None,
        );
        j.spec.as_mut().unwrap().gpu_milli = 250;
        assert_eq!(sum_by_tenant(&[j], 0)["t"].gpu_ms, 250);
    }

    #[test]
    fn sacct_shows_elapsed_gpu_hours_and_the_exit_code() {
        let hour = 3_600_000;
        let mut j = job(
            "vision",
            "failed",
            2,
            2,
            &[("pending", 0), ("running", hour), ("failed", 3 * hour)],
            None,
        );
        j.id = 45;
        j.array_task = Some(pb::ArrayTask {
            array_id: 41,
            index: 4,
            count: 8,
        });
        j.exit = Some(pb::JobExit { code: 3, signal: 0 });
        j.spec.as_mut().unwrap().name = "sweep\x1b[2J".into();
        let row = sacct_row(&j, 10 * hour);
        assert_eq!(row[0], "41_4");
        assert!(!row[1].contains('\x1b'), "names are escaped: {}", row[1]);
        assert_eq!(row[4], "FAILED");
        assert_eq!(row[5], "02:00:00");
        assert_eq!(row[6], "2x2");
        assert_eq!(row[7], "8.00");
        assert_eq!(row[8], "3:0");
        assert_ne!(row[9], "-");
        let running = job("t", "running", 1, 1, &[("running", 9 * hour)], None);
        let row = sacct_row(&running, 10 * hour);
        assert_eq!((row[8].as_str(), row[9].as_str()), ("-", "-"));
    }

    #[test]
    fn since_takes_rfc3339_and_refuses_nonsense() {
        assert_eq!(parse_time("1970-01-01T00:00:01Z"), Ok(1000));
        assert!(
            parse_time("yesterday")
                .unwrap_err()
                .contains("2026-12-01T00:00:00Z")
        );
    }
}
