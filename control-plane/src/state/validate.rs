//! Checks of user input that need no cluster state. The API runs them before proposing (so a
//! bad request never reaches the log) and `apply` runs them again (so a bad entry can never
//! change the state, whoever proposed it).

use super::command::Rejection;
use super::types::{
    ArraySpec, ContainerSpec, JobSpec, MILLI_PER_GPU, NodeSpec, Partition, Tenant,
    mig_compute_slices,
};

/// The most GPUs any host can have (HGX-2 class boards carry 16).
pub const MAX_GPUS_PER_NODE: u32 = 16;
pub const MAX_TASKS: u32 = 4096;
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
pub const MAX_COMMAND_ARGS: usize = 4096;
pub const MAX_ENV_BYTES: usize = 64 * 1024;
pub const MAX_ENV_VARS: usize = 4096;
pub const MAX_NAME_LEN: usize = 256;
pub const MAX_DEPENDENCIES: usize = 128;
pub const MAX_GPU_MODELS: usize = 16;
/// One year: longer limits are almost always a unit mistake.
pub const MAX_TIME_LIMIT_SECS: u64 = 366 * 24 * 3600;
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 256;
pub const PRIORITY_CLASSES: [&str; 3] = ["low", "normal", "high"];
pub const DEFAULT_PRIORITY_CLASS: &str = "normal";
/// Labels of one node, and the size of each label's key and value.
pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_KEY_LEN: usize = 128;
pub const MAX_LABEL_VALUE_LEN: usize = 256;
/// Free text a node reports about itself: agent address, driver version, GPU model, PCI bus
/// id, UUIDs, MIG profile names, topology cells.
pub const MAX_NODE_TEXT_LEN: usize = 256;
/// MIG instances of one GPU (an A100 or H100 has at most 7).
pub const MAX_MIG_PER_GPU: usize = 64;
/// Longest piece of a refused value that a message quotes.
const SHOWN_CHARS: usize = 64;

/// A refused value as a message quotes it: whole when short, else its start and its length,
/// so that a megabyte of input is never echoed back (gRPC carries the message in a header,
/// and an answer with a header that large never reaches the caller).
pub fn shown(value: &str) -> String {
    if value.chars().count() <= SHOWN_CHARS {
        return format!("{value:?}");
    }
    let start: String = value.chars().take(SHOWN_CHARS).collect();
    format!("{start:?}… ({} bytes)", value.len())
}

/// Names of tenants, partitions, nodes and labels: what a person would type in a shell.
pub fn validate_name(field: &str, value: &str) -> Result<(), Rejection> {
    if value.is_empty() {
        return Err(Rejection::invalid(field, "must not be empty"));
    }
    if value.len() > 63 {
        return Err(Rejection::invalid(
            field,
            format!("{} is longer than 63 characters", shown(value)),
        ));
    }
    if !value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(Rejection::invalid(
            field,
            format!(
                "{} may only contain letters, digits, '-', '_' and '.'",
                shown(value)
            ),
        ));
    }
    Ok(())
}

/// Longest working directory accepted (Linux's PATH_MAX).
const MAX_WORKDIR_LEN: usize = 4096;

fn validate_workdir(dir: &str) -> Result<(), Rejection> {
    if !dir.starts_with('/') {
        return Err(Rejection::invalid(
            "workdir",
            format!("{dir:?} is not an absolute path (give --chdir /path)"),
        ));
    }
    if dir.len() > MAX_WORKDIR_LEN || dir.contains('\0') {
        return Err(Rejection::invalid(
            "workdir",
            format!("longer than {MAX_WORKDIR_LEN} bytes, or holds a NUL byte"),
        ));
    }
    Ok(())
}

/// Longest image reference accepted (registry host, path, tag and digest together).
const MAX_IMAGE_LEN: usize = 512;
/// Most bind mounts one container job may ask for.
const MAX_MOUNTS: usize = 32;

fn validate_container(c: &ContainerSpec) -> Result<(), Rejection> {
    if c.image.is_empty() || c.image.len() > MAX_IMAGE_LEN {
        return Err(Rejection::invalid(
            "image",
            format!("must be 1 to {MAX_IMAGE_LEN} bytes"),
        ));
    }
    if let Some(bad) = c
        .image
        .chars()
        .find(|ch| !(ch.is_ascii_alphanumeric() || "._-/:@".contains(*ch)))
    {
        return Err(Rejection::invalid(
            "image",
            format!(
                "{} holds {bad:?}; an image reference is like registry.example/team/trainer:1.4",
                shown(&c.image)
            ),
        ));
    }
    if c.mounts.len() > MAX_MOUNTS {
        return Err(Rejection::invalid(
            "mounts",
            format!("more than {MAX_MOUNTS}"),
        ));
    }
    for m in &c.mounts {
        for (what, path) in [("source", &m.source), ("target", &m.target)] {
            let fine = path.starts_with('/')
                && path.len() <= MAX_WORKDIR_LEN
                && !path.contains(['\0', ':'])
                && !path.split('/').any(|part| part == "..");
            if !fine {
                return Err(Rejection::invalid(
                    "mounts",
                    format!(
                        "{what} {} must be an absolute path without `..` or ':'",
                        shown(path)
                    ),
                ));
            }
        }
        if m.target.trim_end_matches('/').is_empty() {
            return Err(Rejection::invalid(
                "mounts",
                "a mount cannot replace the container's root directory",
            ));
        }
    }
    Ok(())
}

pub fn validate_job_spec(spec: &JobSpec) -> Result<(), Rejection> {
    validate_name("tenant", &spec.tenant)?;
    if let Some(dir) = &spec.workdir {
        validate_workdir(dir)?;
    }
    if let Some(c) = &spec.container {
        validate_container(c)?;
    }
    for (field, path) in [
        ("stdout_path", &spec.stdout_path),
        ("stderr_path", &spec.stderr_path),
    ] {
        if let Some(path) = path
            && (path.is_empty() || path.len() > MAX_WORKDIR_LEN || path.contains('\0'))
        {
            return Err(Rejection::invalid(
                field,
                format!("must be 1 to {MAX_WORKDIR_LEN} bytes without a NUL byte"),
            ));
        }
    }
    if spec.name.len() > MAX_NAME_LEN {
        return Err(Rejection::invalid(
            "name",
            format!("longer than {MAX_NAME_LEN} bytes"),
        ));
    }
    if spec.command.is_empty() || spec.command[0].trim().is_empty() {
        return Err(Rejection::invalid(
            "command",
            "is empty: give the program to run",
        ));
    }
    if spec.command.len() > MAX_COMMAND_ARGS {
        return Err(Rejection::invalid(
            "command",
            format!("has more than {MAX_COMMAND_ARGS} arguments"),
        ));
    }
    let command_bytes: usize = spec.command.iter().map(|a| a.len()).sum();
    if command_bytes > MAX_COMMAND_BYTES {
        return Err(Rejection::invalid(
            "command",
            format!("is {command_bytes} bytes; the limit is {MAX_COMMAND_BYTES}"),
        ));
    }
    if spec.command.iter().any(|a| a.contains('\0')) {
        return Err(Rejection::invalid("command", "contains a NUL byte"));
    }
    if spec.gpus_per_task > MAX_GPUS_PER_NODE {
        return Err(Rejection::invalid(
            "gpus_per_task",
            format!(
                "{} GPUs per task is more than any node can have ({MAX_GPUS_PER_NODE}); \
                 use several tasks for a multi-node job",
                spec.gpus_per_task
            ),
        ));
    }
    if spec.tasks == 0 {
        return Err(Rejection::invalid("tasks", "must be at least 1"));
    }
    if spec.tasks > MAX_TASKS {
        return Err(Rejection::invalid(
            "tasks",
            format!("{} is more than the limit of {MAX_TASKS}", spec.tasks),
        ));
    }
    if spec.gpus_per_task == 0 && spec.cpu_milli_per_task == 0 && spec.memory_mib_per_task == 0 {
        return Err(Rejection::invalid(
            "gpus_per_task",
            "the job asks for nothing: request GPUs, CPU or memory",
        ));
    }
    if spec.gpu_models.len() > MAX_GPU_MODELS {
        return Err(Rejection::invalid(
            "gpu_models",
            format!("more than {MAX_GPU_MODELS} alternatives"),
        ));
    }
    for model in &spec.gpu_models {
        if model.trim().is_empty() || model.len() > 64 {
            return Err(Rejection::invalid(
                "gpu_models",
                format!("{} is not a GPU model name", shown(model)),
            ));
        }
    }
    if !spec.gpu_models.is_empty() && spec.gpus_per_task == 0 {
        return Err(Rejection::invalid(
            "gpu_models",
            "names GPU models but the job asks for no GPUs",
        ));
    }
    if let Some(partition) = &spec.partition {
        validate_name("partition", partition)?;
    }
    if !PRIORITY_CLASSES.contains(&spec.priority_class.as_str()) {
        return Err(Rejection::invalid(
            "priority_class",
            format!(
                "{} is not one of {}",
                shown(&spec.priority_class),
                PRIORITY_CLASSES.join(", ")
            ),
        ));
    }
    match spec.time_limit_secs {
        Some(0) => return Err(Rejection::invalid("time_limit", "must be positive")),
        Some(t) if t > MAX_TIME_LIMIT_SECS => {
            return Err(Rejection::invalid(
                "time_limit",
                format!("{t} s is more than a year"),
            ));
        }
        _ => {}
    }
    if spec.dependencies.len() > MAX_DEPENDENCIES {
        return Err(Rejection::invalid(
            "dependencies",
            format!("more than {MAX_DEPENDENCIES}"),
        ));
    }
    if spec.dependencies.iter().any(|d| d.job == 0) {
        return Err(Rejection::invalid(
            "dependencies",
            "job id 0 does not exist",
        ));
    }
    validate_gpu_kind(spec)?;
    validate_node_lists(&spec.nodelist, &spec.exclude)?;
    if let Some(array) = &spec.array {
        validate_array(array)?;
    }
    super::service::validate_ports(&spec.ports)?;
    if spec.env.len() > MAX_ENV_VARS {
        return Err(Rejection::invalid(
            "env",
            format!(
                "has {} variables; the limit is {MAX_ENV_VARS}",
                spec.env.len()
            ),
        ));
    }
    let mut env_bytes = 0;
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(Rejection::invalid(
                "env",
                format!("{} is not a valid variable name", shown(k)),
            ));
        }
        if v.contains('\0') {
            return Err(Rejection::invalid(
                "env",
                format!("the value of {} contains a NUL byte", shown(k)),
            ));
        }
        env_bytes += k.len() + v.len();
    }
    if env_bytes > MAX_ENV_BYTES {
        return Err(Rejection::invalid(
            "env",
            format!("is {env_bytes} bytes; the limit is {MAX_ENV_BYTES}"),
        ));
    }
    Ok(())
}

/// Most nodes one `--nodelist` or `--exclude` names.
pub const MAX_NODE_LIST: usize = 1024;
/// Most jobs one array submission creates (Slurm's default `MaxArraySize` is 1001).
pub const MAX_ARRAY_TASKS: usize = 10_000;
/// Largest array index (Slurm's limit on `MaxArraySize` is 4,000,001).
pub const MAX_ARRAY_INDEX: u32 = 4_000_000;
/// Most ranges in one `--array` (`0-9,20,30-39:3` is three).
pub const MAX_ARRAY_RANGES: usize = 64;

/// `--nodelist` and `--exclude`: node names, sorted and distinct (the API sorts them), and no
/// node in both.
pub fn validate_node_lists(nodelist: &[String], exclude: &[String]) -> Result<(), Rejection> {
    for (field, list) in [("nodelist", nodelist), ("exclude", exclude)] {
        if list.len() > MAX_NODE_LIST {
            return Err(Rejection::invalid(
                field,
                format!("names {} nodes; the limit is {MAX_NODE_LIST}", list.len()),
            ));
        }
        for name in list {
            validate_name(field, name)?;
        }
        if list.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Rejection::invalid(field, "must be sorted and distinct"));
        }
    }
    if let Some(both) = nodelist.iter().find(|n| exclude.binary_search(n).is_ok()) {
        return Err(Rejection::invalid(
            "exclude",
            format!("node {both} is both in the node list and excluded"),
        ));
    }
    Ok(())
}

/// A job array's ranges and limit.
pub fn validate_array(array: &ArraySpec) -> Result<(), Rejection> {
    if array.ranges.is_empty() {
        return Err(Rejection::invalid("array", "names no index"));
    }
    if array.ranges.len() > MAX_ARRAY_RANGES {
        return Err(Rejection::invalid(
            "array",
            format!("has more than {MAX_ARRAY_RANGES} ranges"),
        ));
    }
    let mut count: u64 = 0;
    for r in &array.ranges {
        if r.first > r.last {
            return Err(Rejection::invalid(
                "array",
                format!("range {}-{} runs backwards", r.first, r.last),
            ));
        }
        if r.step == 0 {
            return Err(Rejection::invalid("array", "a step must be at least 1"));
        }
        if r.last > MAX_ARRAY_INDEX {
            return Err(Rejection::invalid(
                "array",
                format!("index {} is above the limit of {MAX_ARRAY_INDEX}", r.last),
            ));
        }
        count += u64::from((r.last - r.first) / r.step) + 1;
    }
    // Counted before any index is listed, so a huge range costs nothing to refuse (ranges
    // that overlap count twice here).
    if count > MAX_ARRAY_TASKS as u64 {
        return Err(Rejection::invalid(
            "array",
            format!("would create more than {MAX_ARRAY_TASKS} jobs"),
        ));
    }
    Ok(())
}

/// Shares and MIG slices: each has its own rules and they exclude each other.
fn validate_gpu_kind(spec: &JobSpec) -> Result<(), Rejection> {
    if spec.gpu_milli > 0 {
        if u64::from(spec.gpu_milli) >= MILLI_PER_GPU {
            return Err(Rejection::invalid(
                "gpu_milli",
                format!(
                    "{} milli is a whole GPU or more: ask for whole GPUs instead",
                    spec.gpu_milli
                ),
            ));
        }
        if spec.gpus_per_task != 1 {
            return Err(Rejection::invalid(
                "gpu_milli",
                "a share is part of one GPU: set gpus_per_task to 1",
            ));
        }
        if spec.mig_profile.is_some() {
            return Err(Rejection::invalid(
                "gpu_milli",
                "ask for a share or a MIG slice, not both",
            ));
        }
    } else if spec.gpu_memory_mib > 0 {
        return Err(Rejection::invalid(
            "gpu_memory_mib",
            "a GPU memory limit applies to a share: set gpu_milli too",
        ));
    }
    if let Some(profile) = &spec.mig_profile {
        if mig_compute_slices(profile).is_none() || profile.len() > 32 {
            return Err(Rejection::invalid(
                "mig_profile",
                format!(
                    "{} is not a MIG profile name such as 1g.10gb or 3g.40gb",
                    shown(profile)
                ),
            ));
        }
        if spec.gpus_per_task == 0 {
            return Err(Rejection::invalid(
                "mig_profile",
                "names a MIG profile but the job asks for no GPUs",
            ));
        }
    }
    Ok(())
}

pub fn validate_idempotency_key(key: &str) -> Result<(), Rejection> {
    if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
        return Err(Rejection::invalid(
            "idempotency_key",
            format!("longer than {MAX_IDEMPOTENCY_KEY_LEN} bytes"),
        ));
    }
    Ok(())
}

pub fn validate_node_spec(spec: &NodeSpec) -> Result<(), Rejection> {
    validate_name("node.name", &spec.name)?;
    if let Some(r) = spec.service_ports
        && (r.first == 0 || r.first > r.last)
    {
        return Err(Rejection::invalid(
            "node.service_ports",
            format!(
                "{}-{} is not a range of ports (1 to 65535, first <= last)",
                r.first, r.last
            ),
        ));
    }
    if spec.gpus.len() > MAX_GPUS_PER_NODE as usize {
        return Err(Rejection::invalid(
            "node.gpus",
            format!("{} GPUs; the limit is {MAX_GPUS_PER_NODE}", spec.gpus.len()),
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for gpu in &spec.gpus {
        if gpu.uuid.is_empty() {
            return Err(Rejection::invalid("node.gpus.uuid", "must not be empty"));
        }
        node_text("node.gpus.uuid", &gpu.uuid)?;
        node_text("node.gpus.model", &gpu.model)?;
        node_text("node.gpus.pci_bus_id", &gpu.pci_bus_id)?;
        if gpu.mig.len() > MAX_MIG_PER_GPU {
            return Err(Rejection::invalid(
                "node.gpus.mig_instances",
                format!(
                    "GPU {} has {} MIG instances; the limit is {MAX_MIG_PER_GPU}",
                    gpu.index,
                    gpu.mig.len()
                ),
            ));
        }
        for m in &gpu.mig {
            node_text("node.gpus.mig_instances.uuid", &m.uuid)?;
            node_text("node.gpus.mig_instances.profile", &m.profile)?;
        }
        if !seen.insert(gpu.uuid.as_str()) {
            return Err(Rejection::invalid(
                "node.gpus.uuid",
                format!("{} appears twice", gpu.uuid),
            ));
        }
    }
    if let Some(p) = &spec.partition {
        validate_name("node.partition", p)?;
    }
    node_text("node.agent_address", &spec.agent_address)?;
    node_text("node.driver", &spec.driver)?;
    node_text("node.incarnation", &spec.incarnation)?;
    node_text("node.agent_release", &spec.agent_release)?;
    node_text("node.enforcement", &spec.enforcement)?;
    if spec.topology.len() > MAX_GPUS_PER_NODE as usize
        || spec
            .topology
            .iter()
            .any(|row| row.len() > MAX_GPUS_PER_NODE as usize)
    {
        return Err(Rejection::invalid(
            "node.topology",
            format!(
                "the link matrix is larger than {MAX_GPUS_PER_NODE} × {MAX_GPUS_PER_NODE} GPUs"
            ),
        ));
    }
    for cell in spec.topology.iter().flatten() {
        node_text("node.topology", cell)?;
    }
    validate_labels(&spec.labels)?;
    Ok(())
}

/// A string a node reports about itself: bounded, so that a registration cannot fill the log.
fn node_text(field: &str, value: &str) -> Result<(), Rejection> {
    if value.len() > MAX_NODE_TEXT_LEN {
        return Err(Rejection::invalid(
            field,
            format!("{} is longer than {MAX_NODE_TEXT_LEN} bytes", shown(value)),
        ));
    }
    Ok(())
}

/// A node's labels (`rack=r12`): a few, short, printable keys and values.
pub fn validate_labels(
    labels: &std::collections::BTreeMap<String, String>,
) -> Result<(), Rejection> {
    if labels.len() > MAX_LABELS {
        return Err(Rejection::invalid(
            "node.labels",
            format!("{} labels; the limit is {MAX_LABELS}", labels.len()),
        ));
    }
    for (k, v) in labels {
        if k.is_empty()
            || k.len() > MAX_LABEL_KEY_LEN
            || k.contains('=')
            || k.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(Rejection::invalid(
                "node.labels",
                format!(
                    "key {} is not a label key: give 1-{MAX_LABEL_KEY_LEN} bytes without \
                     '=', spaces or control characters",
                    shown(k)
                ),
            ));
        }
        if v.len() > MAX_LABEL_VALUE_LEN || v.chars().any(char::is_control) {
            return Err(Rejection::invalid(
                "node.labels",
                format!(
                    "the value of {} is {} bytes or holds control characters; a label value \
                     is at most {MAX_LABEL_VALUE_LEN} printable bytes",
                    shown(k),
                    v.len()
                ),
            ));
        }
    }
    Ok(())
}

pub fn validate_tenant(tenant: &Tenant) -> Result<(), Rejection> {
    validate_name("tenant.name", &tenant.name)?;
    if tenant.weight == 0 {
        return Err(Rejection::invalid("tenant.weight", "must be at least 1"));
    }
    if tenant.max_gpus != 0 && tenant.max_gpus < tenant.quota_gpus {
        return Err(Rejection::invalid(
            "tenant.max_gpus",
            format!(
                "{} is below the guaranteed quota of {}",
                tenant.max_gpus, tenant.quota_gpus
            ),
        ));
    }
    Ok(())
}

pub fn validate_partition(partition: &Partition) -> Result<(), Rejection> {
    validate_name("partition.name", &partition.name)?;
    if partition.description.len() > 1024 {
        return Err(Rejection::invalid(
            "partition.description",
            "longer than 1024 bytes",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> JobSpec {
        JobSpec {
            tenant: "ml".into(),
            command: vec!["python".into(), "train.py".into()],
            gpus_per_task: 2,
            tasks: 1,
            priority_class: DEFAULT_PRIORITY_CLASS.into(),
            ..JobSpec::default()
        }
    }

    fn rejected_field(s: &JobSpec) -> String {
        validate_job_spec(s).unwrap_err().field.unwrap()
    }

    #[test]
    fn a_plain_gpu_job_is_valid() {
        assert_eq!(validate_job_spec(&spec()), Ok(()));
    }

    #[test]
    fn each_bad_field_is_named() {
        type Mutation = Box<dyn Fn(&mut JobSpec)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("command", Box::new(|s| s.command.clear())),
            ("command", Box::new(|s| s.command = vec!["  ".into()])),
            (
                "command",
                Box::new(|s| s.command = vec!["x".repeat(MAX_COMMAND_BYTES + 1)]),
            ),
            ("gpus_per_task", Box::new(|s| s.gpus_per_task = 17)),
            ("tasks", Box::new(|s| s.tasks = 0)),
            ("gpus_per_task", Box::new(|s| s.gpus_per_task = 0)),
            ("tenant", Box::new(|s| s.tenant = String::new())),
            ("tenant", Box::new(|s| s.tenant = "a b".into())),
            (
                "priority_class",
                Box::new(|s| s.priority_class = "vip".into()),
            ),
            ("time_limit", Box::new(|s| s.time_limit_secs = Some(0))),
            ("partition", Box::new(|s| s.partition = Some("a/b".into()))),
            ("gpu_models", Box::new(|s| s.gpu_models = vec!["".into()])),
            (
                "env",
                Box::new(|s| {
                    s.env.insert("A=B".into(), "1".into());
                }),
            ),
        ];
        for (field, mutate) in cases {
            let mut s = spec();
            mutate(&mut s);
            assert_eq!(rejected_field(&s), field, "spec {s:?}");
        }
    }

    #[test]
    fn a_cpu_only_job_is_valid() {
        let mut s = spec();
        s.gpus_per_task = 0;
        s.cpu_milli_per_task = 4000;
        assert_eq!(validate_job_spec(&s), Ok(()));
    }
}
