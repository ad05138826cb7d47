//! Table columns by name, for `gpuctl queue --format` and `gpuctl nodes --format`: a registry
//! of columns (name, `squeue`/`sinfo` letter, header, extractor) and a parser for both spec
//! forms, Slurm's `"%i %j %T"` and names `"id,name,state"`. The default tables are column
//! lists of the same registries, so a column added here is at once available to `--format`.

use proto::v1 as pb;

use super::output::{age, format_duration, format_time, printable, table};

/// One column of a table of `T`, with what the extractor needs besides the row in `C`.
pub struct Column<T: 'static, C: 'static> {
    /// Its name in `--format id,name`, lower case.
    pub name: &'static str,
    /// Its letters in `--format "%i %j"` (Slurm's, where Slurm has one).
    pub letters: &'static [char],
    pub header: &'static str,
    pub about: &'static str,
    pub value: fn(&T, &C) -> String,
}

/// Every column of one kind of table.
pub struct Registry<T: 'static, C: 'static> {
    /// The command, for error messages ("gpuctl queue").
    pub command: &'static str,
    pub columns: &'static [Column<T, C>],
}

impl<T, C> Registry<T, C> {
    fn by_name(&self, name: &str) -> Option<&'static Column<T, C>> {
        self.columns.iter().find(|c| c.name == name)
    }

    fn by_letter(&self, letter: char) -> Option<&'static Column<T, C>> {
        self.columns.iter().find(|c| c.letters.contains(&letter))
    }

    /// The named columns, in order (the default tables).
    pub fn named(&self, names: &[&str]) -> Vec<&'static Column<T, C>> {
        names
            .iter()
            .map(|n| self.by_name(n).expect("default columns are registered"))
            .collect()
    }

    /// Parses a `--format` spec: Slurm's `%[.][WIDTH]LETTER` fields separated by blanks
    /// (`"%i %.20j %T"`), or column names separated by commas or blanks, each with an
    /// optional `:WIDTH` (`"id,name:20,state"`). Widths are accepted for Slurm's sake and not
    /// needed: columns take the width of their content.
    pub fn parse(&self, spec: &str) -> Result<Vec<&'static Column<T, C>>, String> {
        let columns = if spec.contains('%') {
            self.parse_letters(spec)?
        } else {
            self.parse_names(spec)?
        };
        if columns.is_empty() {
            return Err(format!(
                "--format {:?} names no column; {}",
                printable(spec),
                self.supported()
            ));
        }
        Ok(columns)
    }

    fn parse_letters(&self, spec: &str) -> Result<Vec<&'static Column<T, C>>, String> {
        let mut columns = Vec::new();
        let mut chars = spec.chars().peekable();
        while let Some(c) = chars.next() {
            if c.is_whitespace() {
                continue;
            }
            if c != '%' {
                return Err(format!(
                    "--format {:?}: {:?} is not a field; write %LETTER fields separated by \
                     blanks; {}",
                    printable(spec),
                    printable(&c.to_string()),
                    self.supported()
                ));
            }
            if chars.peek() == Some(&'.') {
                chars.next();
            }
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            let Some(letter) = chars.next() else {
                return Err(format!(
                    "--format {:?} ends in a % without a letter; {}",
                    printable(spec),
                    self.supported()
                ));
            };
            match self.by_letter(letter) {
                Some(column) => columns.push(column),
                None => {
                    return Err(format!(
                        "{} --format: no field %{}; {}",
                        self.command,
                        printable(&letter.to_string()),
                        self.supported()
                    ));
                }
            }
        }
        Ok(columns)
    }

    fn parse_names(&self, spec: &str) -> Result<Vec<&'static Column<T, C>>, String> {
        let mut columns = Vec::new();
        for word in spec
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| !w.is_empty())
        {
            let (name, width) = word.split_once(':').unwrap_or((word, ""));
            if !width.is_empty() && !width.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "--format: {:?} is not NAME or NAME:WIDTH",
                    printable(word)
                ));
            }
            match self.by_name(&name.to_ascii_lowercase()) {
                Some(column) => columns.push(column),
                None => {
                    return Err(format!(
                        "{} --format: no column {:?}; {}",
                        self.command,
                        printable(name),
                        self.supported()
                    ));
                }
            }
        }
        Ok(columns)
    }

    /// "supported: %i id, %j name, ..., shape, age": every column, with its letters.
    pub fn supported(&self) -> String {
        let all: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                let letters: Vec<String> = c.letters.iter().map(|l| format!("%{l}")).collect();
                if letters.is_empty() {
                    c.name.to_owned()
                } else {
                    format!("{} {}", letters.join("/"), c.name)
                }
            })
            .collect();
        format!("supported: {}", all.join(", "))
    }

    /// A reference of every column, one per line, for `--help`.
    pub fn help(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .columns
            .iter()
            .map(|c| {
                vec![
                    c.name.to_owned(),
                    c.letters
                        .iter()
                        .map(|l| format!("%{l}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                    c.header.to_owned(),
                    c.about.to_owned(),
                ]
            })
            .collect();
        table(&["NAME", "LETTER", "HEADER", "WHAT"], &rows)
    }

    /// The table of `items` in `columns`.
    pub fn render(&self, columns: &[&Column<T, C>], items: &[T], ctx: &C) -> String {
        let headers: Vec<&str> = columns.iter().map(|c| c.header).collect();
        let rows: Vec<Vec<String>> = items
            .iter()
            .map(|item| columns.iter().map(|c| (c.value)(item, ctx)).collect())
            .collect();
        table(&headers, &rows)
    }
}

/// `gpuctl queue --format`'s value parser: a spec is checked as gpuctl starts, before any
/// connection ("help" lists the columns).
pub fn job_format(spec: &str) -> Result<String, String> {
    if spec != "help" {
        JOBS.parse(spec)?;
    }
    Ok(spec.to_owned())
}

/// `gpuctl nodes --format`'s value parser.
pub fn node_format(spec: &str) -> Result<String, String> {
    if spec != "help" {
        NODES.parse(spec)?;
    }
    Ok(spec.to_owned())
}

/// What job columns need besides the job.
pub struct JobContext {
    pub now_ms: u64,
}

type JobColumn = Column<pb::Job, JobContext>;

fn spec(j: &pb::Job) -> &pb::JobSpec {
    static EMPTY: std::sync::OnceLock<pb::JobSpec> = std::sync::OnceLock::new();
    j.spec
        .as_ref()
        .unwrap_or_else(|| EMPTY.get_or_init(pb::JobSpec::default))
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        printable(s)
    }
}

/// When the job last started running, and when it ended (a final state after that).
fn run_span(j: &pb::Job) -> (Option<u64>, Option<u64>) {
    let start = j
        .history
        .iter()
        .rev()
        .find(|h| h.state == "running")
        .map(|h| h.at_ms);
    let end = match j.state.as_str() {
        "succeeded" | "failed" | "cancelled" | "timed_out" => j.history.last().map(|h| h.at_ms),
        _ => None,
    };
    (start, end)
}

/// Why it is pending (the leader's last pass), or its last change.
fn reason(j: &pb::Job) -> String {
    if j.pending_reason.is_empty() {
        j.history
            .last()
            .map(|h| h.reason.clone())
            .unwrap_or_default()
    } else {
        j.pending_reason.clone()
    }
}

fn nodelist(j: &pb::Job) -> String {
    let mut nodes: Vec<&str> = j.allocations.iter().map(|a| a.node.as_str()).collect();
    nodes.dedup();
    nodes.join(",")
}

/// Slurm's compact state codes.
fn compact_state(state: &str) -> String {
    match state {
        "pending" => "PD".into(),
        "scheduled" => "CF".into(),
        "running" => "R".into(),
        "succeeded" => "CD".into(),
        "failed" => "F".into(),
        "cancelled" => "CA".into(),
        "timed_out" => "TO".into(),
        other => printable(&other.to_uppercase()),
    }
}

/// The GPUs one task asks for, as Slurm's GRES: `gpu:2`, `gpu:h100|a100:2`, `gpu:500m`
/// (a share), `mig-1g.10gb:1`; `-` for none.
pub fn job_gres(s: &pb::JobSpec) -> String {
    if s.gpus_per_task == 0 {
        return "-".into();
    }
    if !s.mig_profile.is_empty() {
        return printable(&format!("mig-{}:{}", s.mig_profile, s.gpus_per_task));
    }
    let models = if s.gpu_models.is_empty() {
        String::new()
    } else {
        format!("{}:", s.gpu_models.join("|"))
    };
    if s.gpu_milli > 0 {
        printable(&format!("gpu:{models}{}m", s.gpu_milli))
    } else {
        printable(&format!("gpu:{models}{}", s.gpus_per_task))
    }
}

pub const JOBS: Registry<pb::Job, JobContext> = Registry {
    command: "gpuctl queue",
    columns: JOB_COLUMNS,
};

const JOB_COLUMNS: &[JobColumn] = &[
    Column {
        name: "id",
        letters: &['i'],
        header: "JOBID",
        about: "job id; ARRAY_INDEX (41_7) for a job of an array, as squeue's %i",
        value: |j, _| super::slurm_syntax::job_id_text(j),
    },
    Column {
        name: "job_id",
        letters: &['A'],
        header: "JOB",
        about: "the job's own id, also for a job of an array (squeue's %A)",
        value: |j, _| j.id.to_string(),
    },
    Column {
        name: "array_job_id",
        letters: &['F'],
        header: "ARRAY_JOB_ID",
        about: "its array's id (its own id outside an array)",
        value: |j, _| {
            j.array_task
                .as_ref()
                .map_or(j.id, |t| t.array_id)
                .to_string()
        },
    },
    Column {
        name: "array_index",
        letters: &['K'],
        header: "ARRAY_INDEX",
        about: "its index in its array (- outside an array)",
        value: |j, _| {
            j.array_task
                .as_ref()
                .map_or("-".to_owned(), |t| t.index.to_string())
        },
    },
    Column {
        name: "tenant",
        letters: &['u', 'a'],
        header: "TENANT",
        about: "tenant (Slurm's user and account)",
        value: |j, _| printable(&spec(j).tenant),
    },
    Column {
        name: "name",
        letters: &['j'],
        header: "NAME",
        about: "job name, else its command's first word; (hidden) for another tenant's",
        value: |j, _| {
            let s = spec(j);
            if j.redacted {
                "(hidden)".into()
            } else if s.name.is_empty() {
                printable(&s.command.first().cloned().unwrap_or_default())
            } else {
                printable(&s.name)
            }
        },
    },
    Column {
        name: "state",
        letters: &['T'],
        header: "STATE",
        about: "state (PENDING, RUNNING, ...)",
        value: |j, _| printable(&j.state.to_uppercase()),
    },
    Column {
        name: "st",
        letters: &['t'],
        header: "ST",
        about: "state, Slurm's compact code (PD, CF, R, CD, F, CA, TO)",
        value: |j, _| compact_state(&j.state),
    },
    Column {
        name: "shape",
        letters: &[],
        header: "TASKSxGPUS",
        about: "tasks x GPUs per task",
        value: |j, _| format!("{}x{}", spec(j).tasks, spec(j).gpus_per_task),
    },
    Column {
        name: "tasks",
        letters: &['D'],
        header: "TASKS",
        about: "tasks (one node each)",
        value: |j, _| spec(j).tasks.to_string(),
    },
    Column {
        name: "gres",
        letters: &['b'],
        header: "GRES",
        about: "GPUs per task: gpu:N, gpu:MODEL|MODEL:N, gpu:500m (a share), mig-PROFILE:N",
        value: |j, _| job_gres(spec(j)),
    },
    Column {
        name: "cpus",
        letters: &['C'],
        header: "CPUS",
        about: "CPUs of all tasks",
        value: |j, _| {
            let s = spec(j);
            let milli = s.cpu_milli_per_task.saturating_mul(s.tasks);
            if milli % 1000 == 0 {
                (milli / 1000).to_string()
            } else {
                format!("{:.1}", milli as f64 / 1000.0)
            }
        },
    },
    Column {
        name: "memory",
        letters: &['m'],
        header: "MIN_MEMORY",
        about: "memory per task (MiB)",
        value: |j, _| format!("{}M", spec(j).memory_mib_per_task),
    },
    Column {
        name: "partition",
        letters: &['P'],
        header: "PARTITION",
        about: "partition",
        value: |j, _| dash(&spec(j).partition),
    },
    Column {
        name: "priority",
        letters: &['q'],
        header: "PRIORITY",
        about: "priority class (Slurm's QOS)",
        value: |j, _| dash(&spec(j).priority_class),
    },
    Column {
        name: "preemptible",
        letters: &[],
        header: "PREEMPTIBLE",
        about: "whether it may be preempted",
        value: |j, _| if spec(j).preemptible { "yes" } else { "no" }.into(),
    },
    Column {
        name: "time_limit",
        letters: &['l'],
        header: "TIME_LIMIT",
        about: "time limit",
        value: |j, _| format_duration(spec(j).time_limit_secs.max(0) as u64),
    },
    Column {
        name: "time",
        letters: &['M'],
        header: "TIME",
        about: "time it has run (its last placement)",
        value: |j, ctx| match run_span(j) {
            (Some(start), end) => {
                let secs = end.unwrap_or(ctx.now_ms).saturating_sub(start) / 1000;
                if secs == 0 {
                    "0:00".into()
                } else {
                    format_duration(secs)
                }
            }
            (None, _) => "0:00".into(),
        },
    },
    Column {
        name: "age",
        letters: &[],
        header: "AGE",
        about: "since submission",
        value: |j, ctx| age(j.submitted_at_ms, ctx.now_ms),
    },
    Column {
        name: "submit_time",
        letters: &['V'],
        header: "SUBMIT_TIME",
        about: "submission time (UTC)",
        value: |j, _| format_time(j.submitted_at_ms),
    },
    Column {
        name: "start_time",
        letters: &['S'],
        header: "START_TIME",
        about: "when it last started running (UTC)",
        value: |j, _| run_span(j).0.map_or("-".into(), format_time),
    },
    Column {
        name: "end_time",
        letters: &['e'],
        header: "END_TIME",
        about: "when it ended (UTC)",
        value: |j, _| run_span(j).1.map_or("-".into(), format_time),
    },
    Column {
        name: "nodelist",
        letters: &['N'],
        header: "NODELIST",
        about: "nodes it runs on",
        value: |j, _| dash(&nodelist(j)),
    },
    Column {
        name: "reason",
        letters: &['r'],
        header: "REASON",
        about: "why it is pending, else its last change",
        value: |j, _| dash(&reason(j)),
    },
    Column {
        name: "nodes_reason",
        letters: &['R'],
        header: "NODES/REASON",
        about: "nodes it runs on, or why it is pending (squeue's NODELIST(REASON))",
        value: |j, _| {
            let nodes = nodelist(j);
            if nodes.is_empty() {
                printable(&reason(j))
            } else {
                printable(&nodes)
            }
        },
    },
    Column {
        name: "dependency",
        letters: &['E'],
        header: "DEPENDENCY",
        about: "jobs it waits for (afterok:12,...)",
        value: |j, _| {
            let deps: Vec<String> = spec(j)
                .dependencies
                .iter()
                .map(|d| {
                    let kind = match pb::dependency::Kind::try_from(d.kind) {
                        Ok(pb::dependency::Kind::AfterOk) => "afterok",
                        Ok(pb::dependency::Kind::AfterAny) => "afterany",
                        Ok(pb::dependency::Kind::AfterNotOk) => "afternotok",
                        _ => "unknown",
                    };
                    format!("{kind}:{}", d.job_id)
                })
                .collect();
            dash(&deps.join(","))
        },
    },
    Column {
        name: "command",
        letters: &['o'],
        header: "COMMAND",
        about: "command line",
        value: |j, _| {
            if j.redacted {
                "(hidden)".into()
            } else {
                dash(&spec(j).command.join(" "))
            }
        },
    },
    Column {
        name: "workdir",
        letters: &['Z'],
        header: "WORK_DIR",
        about: "working directory",
        value: |j, _| dash(&spec(j).workdir),
    },
    Column {
        name: "container",
        letters: &[],
        header: "CONTAINER",
        about: "container image",
        value: |j, _| dash(spec(j).container.as_ref().map_or("", |c| c.image.as_str())),
    },
];

/// The default `gpuctl queue` table.
pub const DEFAULT_JOB_COLUMNS: &[&str] = &[
    "id",
    "tenant",
    "name",
    "state",
    "shape",
    "partition",
    "time_limit",
    "age",
    "nodes_reason",
];

/// What node columns need besides the node: the answering replica's release, to flag agents'
/// skew against (`None`: not known).
pub struct NodeContext {
    pub control_plane_release: Option<String>,
}

type NodeColumn = Column<pb::Node, NodeContext>;

fn gpus_used(n: &pb::Node) -> usize {
    n.gpus.iter().filter(|g| g.allocation != 0).count()
}

fn models(n: &pb::Node) -> Vec<String> {
    let mut models: Vec<String> = n.gpus.iter().map(|g| printable(&g.model)).collect();
    models.dedup();
    models
}

/// sinfo's compact node state: idle, mix, alloc (by GPUs held), drain, down.
fn node_compact_state(n: &pb::Node) -> String {
    match n.status.as_str() {
        "ready" => {
            let used = gpus_used(n);
            if used == 0 {
                "idle"
            } else if used < n.gpus.len() {
                "mix"
            } else {
                "alloc"
            }
            .into()
        }
        "drained" => "drain".into(),
        other => printable(other),
    }
}

pub const NODES: Registry<pb::Node, NodeContext> = Registry {
    command: "gpuctl nodes",
    columns: NODE_COLUMNS,
};

const NODE_COLUMNS: &[NodeColumn] = &[
    Column {
        name: "node",
        letters: &['N', 'n'],
        header: "NODE",
        about: "node name",
        value: |n, _| printable(&n.name),
    },
    Column {
        name: "status",
        letters: &['T'],
        header: "STATUS",
        about: "READY, DRAINED or DOWN",
        value: |n, _| printable(&n.status.to_uppercase()),
    },
    Column {
        name: "state",
        letters: &['t'],
        header: "STATE",
        about: "sinfo's compact state: idle, mix, alloc (by GPUs held), drain, down",
        value: |n, _| node_compact_state(n),
    },
    Column {
        name: "partition",
        letters: &['P', 'R'],
        header: "PARTITION",
        about: "partition",
        value: |n, _| dash(&n.partition),
    },
    Column {
        name: "model",
        letters: &[],
        header: "MODEL",
        about: "GPU models",
        value: |n, _| models(n).join(","),
    },
    Column {
        name: "gres",
        letters: &['G'],
        header: "GRES",
        about: "GPUs as Slurm's GRES (gpu:MODEL:N)",
        value: |n, _| {
            let mut parts: Vec<String> = Vec::new();
            for m in models(n) {
                let count = n.gpus.iter().filter(|g| printable(&g.model) == m).count();
                parts.push(format!("gpu:{m}:{count}"));
            }
            dash(&parts.join(","))
        },
    },
    Column {
        name: "gpus_used",
        letters: &[],
        header: "GPUS_USED",
        about: "GPUs held / GPUs",
        value: |n, _| format!("{}/{}", gpus_used(n), n.gpus.len()),
    },
    Column {
        name: "gpus",
        letters: &[],
        header: "GPUS",
        about: "GPUs",
        value: |n, _| n.gpus.len().to_string(),
    },
    Column {
        name: "unhealthy",
        letters: &[],
        header: "UNHEALTHY",
        about: "unhealthy GPUs",
        value: |n, _| {
            n.gpus
                .iter()
                .filter(|g| g.health != "healthy")
                .count()
                .to_string()
        },
    },
    Column {
        name: "reason",
        letters: &['E'],
        header: "REASON",
        about: "why GPUs are unhealthy",
        value: |n, _| {
            let reasons: Vec<String> = n
                .gpus
                .iter()
                .filter(|g| g.health != "healthy")
                .map(|g| format!("gpu{}: {}", g.index, g.health_reason))
                .collect();
            dash(&reasons.join("; "))
        },
    },
    Column {
        name: "numa",
        letters: &[],
        header: "NUMA",
        about: "GPUs by NUMA node (0:0-3 1:4-7; ?: unknown)",
        value: |n, _| numa_groups(n),
    },
    Column {
        name: "cpus",
        letters: &['c'],
        header: "CPUS",
        about: "CPUs",
        value: |n, _| format!("{}", n.cpu_milli / 1000),
    },
    Column {
        name: "mem_gib",
        letters: &[],
        header: "MEM_GIB",
        about: "memory (GiB)",
        value: |n, _| format!("{}", n.memory_mib / 1024),
    },
    Column {
        name: "memory",
        letters: &['m'],
        header: "MEMORY",
        about: "memory (MiB, as sinfo)",
        value: |n, _| n.memory_mib.to_string(),
    },
    Column {
        name: "labels",
        letters: &['f'],
        header: "LABELS",
        about: "labels (sinfo's features)",
        value: |n, _| {
            let mut labels: Vec<String> =
                n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            labels.sort();
            dash(&labels.join(","))
        },
    },
    Column {
        name: "agent",
        letters: &[],
        header: "AGENT",
        about: "the agent's release, flagged when behind the control plane's",
        value: |n, ctx| match &ctx.control_plane_release {
            Some(cp) => super::output::agent_cell(&n.agent_release, cp),
            None => crate::release::agent_release_text(&n.agent_release),
        },
    },
    Column {
        name: "enforced",
        letters: &[],
        header: "ENFORCED",
        about: "what the agent enforces (cgroup-v2, UNENFORCED, ...; +docker: runs containers)",
        value: |n, _| {
            let cell = super::output::enforcement_cell(&n.enforcement);
            if n.container_runtime.is_empty() {
                cell
            } else {
                format!("{cell}+docker")
            }
        },
    },
    Column {
        name: "driver",
        letters: &[],
        header: "DRIVER",
        about: "GPU discovery (nvml, simulated)",
        value: |n, _| dash(&n.driver),
    },
    Column {
        name: "address",
        letters: &[],
        header: "AGENT_ADDRESS",
        about: "the agent's address",
        value: |n, _| dash(&n.agent_address),
    },
];

/// GPU indexes by NUMA node: `0:0-3 1:4-7`, `?:0,1` where unknown.
fn numa_groups(n: &pb::Node) -> String {
    let mut groups: std::collections::BTreeMap<i32, Vec<u32>> = Default::default();
    for g in &n.gpus {
        groups.entry(g.numa_node.max(-1)).or_default().push(g.index);
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(numa, mut idx)| {
            idx.sort_unstable();
            let node = if numa < 0 {
                "?".to_owned()
            } else {
                numa.to_string()
            };
            format!("{node}:{}", ranges(&idx))
        })
        .collect();
    dash(&parts.join(" "))
}

/// `0-3,6` from sorted indexes.
fn ranges(idx: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            idx[i].to_string()
        } else {
            format!("{}-{}", idx[i], idx[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The default `gpuctl nodes` table.
pub const DEFAULT_NODE_COLUMNS: &[&str] = &[
    "node",
    "status",
    "partition",
    "model",
    "gpus_used",
    "unhealthy",
    "cpus",
    "mem_gib",
    "agent",
    "enforced",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: u64, name: &str, state: &str) -> pb::Job {
        pb::Job {
            id,
            state: state.into(),
            spec: Some(pb::JobSpec {
                tenant: "ml".into(),
                name: name.into(),
                tasks: 2,
                gpus_per_task: 4,
                gpu_models: vec!["H100".into()],
                cpu_milli_per_task: 1500,
                ..Default::default()
            }),
            submitted_at_ms: 1_000,
            history: vec![
                pb::StateChange {
                    at_ms: 1_000,
                    state: "pending".into(),
                    reason: "submitted".into(),
                },
                pb::StateChange {
                    at_ms: 61_000,
                    state: "running".into(),
                    reason: "placed".into(),
                },
            ],
            ..Default::default()
        }
    }

    fn names(cols: &[&JobColumn]) -> Vec<&'static str> {
        cols.iter().map(|c| c.name).collect()
    }

    #[test]
    fn both_spec_forms() {
        let slurm = JOBS.parse("%i %.20j %u %T %M %R").unwrap();
        assert_eq!(
            names(&slurm),
            ["id", "name", "tenant", "state", "time", "nodes_reason"]
        );
        let by_name = JOBS.parse("id,NAME:20 state").unwrap();
        assert_eq!(names(&by_name), ["id", "name", "state"]);
    }

    #[test]
    fn unknown_fields_are_refused_with_the_list() {
        let e = JOBS.parse("%i %y").err().unwrap();
        assert!(
            e.starts_with("gpuctl queue --format: no field %y; supported: %i id, %A job_id, %F array_job_id, %K array_index, %u/%a tenant"),
            "{e}"
        );
        assert!(e.contains("shape"), "{e}");
        let e = JOBS.parse("id,colour").err().unwrap();
        assert!(e.contains("no column \"colour\""), "{e}");
        assert!(
            JOBS.parse("%i x %j")
                .err()
                .unwrap()
                .contains("\"x\" is not a field")
        );
        assert!(
            JOBS.parse("%i %")
                .err()
                .unwrap()
                .contains("without a letter")
        );
        assert!(JOBS.parse(" , ").err().unwrap().contains("names no column"));
        assert!(JOBS.parse("id:wide").err().unwrap().contains("NAME:WIDTH"));
        assert!(
            NODES
                .parse("%N %z")
                .err()
                .unwrap()
                .starts_with("gpuctl nodes --format: no field %z")
        );
    }

    #[test]
    fn every_column_is_reachable_and_unique() {
        fn check<T, C>(r: &Registry<T, C>) {
            let mut names = std::collections::BTreeSet::new();
            let mut letters = std::collections::BTreeSet::new();
            for c in r.columns {
                assert!(names.insert(c.name), "{} twice", c.name);
                assert_eq!(c.name, c.name.to_ascii_lowercase());
                for l in c.letters {
                    assert!(letters.insert(*l), "%{l} twice");
                }
                assert_eq!(r.parse(c.name).unwrap()[0].name, c.name);
            }
        }
        check(&JOBS);
        check(&NODES);
        JOBS.named(DEFAULT_JOB_COLUMNS);
        NODES.named(DEFAULT_NODE_COLUMNS);
    }

    /// docs/MIGRATING.md lists every letter, so the doc cannot fall behind the registry.
    #[test]
    fn the_migration_guide_lists_every_letter() {
        let doc = include_str!("../../../docs/MIGRATING.md");
        let row = doc
            .lines()
            .find(|l| l.contains("mapped: `--format`"))
            .expect("the --format row");
        let (jobs, nodes) = row.split_once("for jobs").expect("jobs, then nodes");
        let listed = |text: &str, letters: Vec<char>| {
            for l in letters {
                assert!(
                    text.contains(&format!("%{l} ")) || text.contains(&format!("%{l}`")),
                    "%{l} missing: {row}"
                );
            }
        };
        listed(
            jobs,
            JOBS.columns
                .iter()
                .flat_map(|c| c.letters.iter().copied())
                .collect(),
        );
        listed(
            nodes,
            NODES
                .columns
                .iter()
                .flat_map(|c| c.letters.iter().copied())
                .collect(),
        );
    }

    #[test]
    fn job_values() {
        let ctx = JobContext {
            now_ms: 3_661_000 + 61_000,
        };
        let mut j = job(7, "train\n7  FORGED", "running");
        j.allocations.push(pb::Allocation {
            node: "gpu-1".into(),
            ..Default::default()
        });
        let cols = JOBS.parse("%i %j %t %M %b %C %D %N %S %e").unwrap();
        let out = JOBS.render(&cols, &[j], &ctx);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        let cells: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "7",
                "train\\n7",
                "FORGED",
                "R",
                "01:01:01",
                "gpu:H100:4",
                "3",
                "2",
                "gpu-1",
                "1970-01-01",
                "00:01:01",
                "-"
            ]
        );
    }

    #[test]
    fn gres_forms() {
        let mut s = pb::JobSpec {
            gpus_per_task: 1,
            gpu_milli: 500,
            ..Default::default()
        };
        assert_eq!(job_gres(&s), "gpu:500m");
        s.gpu_milli = 0;
        s.mig_profile = "1g.10gb".into();
        assert_eq!(job_gres(&s), "mig-1g.10gb:1");
        s.gpus_per_task = 0;
        assert_eq!(job_gres(&s), "-");
    }

    #[test]
    fn node_values() {
        let gpu = |index, numa, allocation| pb::Gpu {
            index,
            model: "H100".into(),
            numa_node: numa,
            health: "healthy".into(),
            allocation,
            ..Default::default()
        };
        let n = pb::Node {
            name: "gpu-1".into(),
            status: "ready".into(),
            gpus: vec![
                gpu(0, 0, 5),
                gpu(1, 0, 0),
                gpu(2, 1, 0),
                gpu(3, 1, 0),
                gpu(4, -1, 0),
            ],
            cpu_milli: 64_000,
            memory_mib: 512 * 1024,
            ..Default::default()
        };
        let ctx = NodeContext {
            control_plane_release: None,
        };
        let cols = NODES.parse("node,state,gres,numa,memory").unwrap();
        let out = NODES.render(&cols, &[n], &ctx);
        assert_eq!(
            out.lines()
                .nth(1)
                .unwrap()
                .split_whitespace()
                .collect::<Vec<_>>(),
            [
                "gpu-1",
                "mix",
                "gpu:H100:5",
                "?:4",
                "0:0-1",
                "1:2-3",
                "524288"
            ]
        );
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
