//! The environment an allocation's command runs with, and launch-spec validation. Pure
//! functions, so the rules are unit-tested without starting processes.
//!
//! The agent's own environment is *not* inherited wholesale: it may hold the agent's
//! credentials, its `RUST_LOG`, proxy settings or an operator's `CUDA_VISIBLE_DEVICES`, none
//! of which belong to a tenant's job, and an inherited variable would make a job's
//! behaviour depend on how the agent was started. Only the basics a program needs to run
//! like a login session ([`INHERITED_ENV`]) pass through; everything else comes from the
//! launch spec.
//!
//! # GPU shares (CUDA MPS) and MIG slices
//!
//! A share of a GPU ([`LaunchSpec::share`]) runs as a CUDA MPS client. The MPS control daemon
//! (`nvidia-cuda-mps-control -d`, usually with the GPU in `EXCLUSIVE_PROCESS` compute mode so
//! that no context bypasses it) is the host operator's setup, like the driver itself: the agent
//! neither starts nor checks it. What the agent guarantees regardless, on every host:
//! - the command sees exactly its one GPU (`CUDA_VISIBLE_DEVICES` = its UUID);
//! - it gets the limits an MPS client obeys, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` = its milli
//!   rounded up to a percent and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` = `<GPU UUID>=<MiB>M`
//!   (NVIDIA's MPS guide, "Environment Variables": the limit variable takes device ordinals
//!   and/or UUIDs like `CUDA_VISIBLE_DEVICES`, each with `=limit`, e.g. `0=1G,1=512MB`; the
//!   UUID is used because ordinals are renumbered by `CUDA_VISIBLE_DEVICES` and by an MPS
//!   server started with its own `CUDA_VISIBLE_DEVICES`). A client can only lower, never raise,
//!   a limit the daemon sets, and the job cannot set these variables itself ([`RESERVED_ENV`]);
//! - it learns its share as `GPUCP_GPU_MILLI` and `GPUCP_GPU_MEMORY_MIB`, for frameworks that
//!   size themselves (e.g. PyTorch's per-process memory fraction) where no MPS daemon runs;
//! - the runtime never starts it while the GPU is used whole, nor beyond 1000 milli or the
//!   GPU's memory together with the other shares (`ledger.rs`), whatever the control plane says.
//!
//! The MPS pipe and log directories (`CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`) are
//! where the operator's daemon listens, so they come from the agent's environment when set
//! there, for every allocation (a CUDA program connects to a running daemon whether or not it
//! holds a share), and a job cannot point them elsewhere.
//!
//! A MIG slice is addressed by its own UUID (`MIG-...`), which is what `CUDA_VISIBLE_DEVICES`
//! and `NVIDIA_VISIBLE_DEVICES` take for MIG devices, so slices need nothing beyond the list of
//! UUIDs. CUDA enumerates only one MIG instance per process, so a process given several slices
//! uses the first (a job that wants several runs one process per slice).

use std::collections::{BTreeMap, BTreeSet};

use super::ledger::MILLI_PER_GPU;
use super::types::{LaunchSpec, RuntimeError};

/// Variables copied from the agent's environment when present: the search path, the
/// identity of the user, locale, time zone, temporary directory and terminal type.
pub const INHERITED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TMPDIR",
    "TERM",
];

/// The host's MPS setup, copied from the agent's environment when present (see the module
/// documentation); a launch spec cannot override them.
pub const HOST_MPS_ENV: &[&str] = &["CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"];

/// `PATH` used when the agent itself has none (e.g. started by a minimal init).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Variables the runtime always sets itself; a launch spec cannot override them, because a
/// job that could set `CUDA_VISIBLE_DEVICES` could use GPUs it does not hold (invariant 1).
pub const RESERVED_ENV: &[&str] = &[
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "GPUCP_JOB_ID",
    "GPUCP_ALLOCATION_ID",
    "GPUCP_JOB_NAME",
    "GPUCP_TENANT",
    "GPUCP_GPUS",
    "GPUCP_GPU_MILLI",
    "GPUCP_GPU_MEMORY_MIB",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
];

/// The complete environment of the command, built from (lowest precedence first) the
/// inherited basics looked up through `parent`, `spec.env`, and the reserved variables.
///
/// With zero GPUs the command gets `CUDA_VISIBLE_DEVICES=` (CUDA then sees no device) and
/// `NVIDIA_VISIBLE_DEVICES=void` (the NVIDIA container runtime's "no GPU" value), so a
/// CPU-only allocation cannot reach a GPU another allocation holds. A share also gets its
/// MPS limits and `GPUCP_GPU_MILLI`/`GPUCP_GPU_MEMORY_MIB` (see the module documentation).
pub fn command_env(
    spec: &LaunchSpec,
    parent: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for key in INHERITED_ENV {
        if let Some(value) = parent(key) {
            env.insert((*key).to_string(), value);
        }
    }
    env.entry("PATH".to_string())
        .or_insert_with(|| DEFAULT_PATH.to_string());
    for (key, value) in &spec.env {
        if !RESERVED_ENV.contains(&key.as_str()) {
            env.insert(key.clone(), value.clone());
        }
    }
    let gpus = spec.gpus.join(",");
    let nvidia = if spec.gpus.is_empty() {
        "void".to_string()
    } else {
        gpus.clone()
    };
    env.insert("CUDA_VISIBLE_DEVICES".to_string(), gpus.clone());
    env.insert("NVIDIA_VISIBLE_DEVICES".to_string(), nvidia);
    env.insert("GPUCP_JOB_ID".to_string(), spec.job_id.to_string());
    env.insert(
        "GPUCP_ALLOCATION_ID".to_string(),
        spec.allocation_id.to_string(),
    );
    env.insert("GPUCP_JOB_NAME".to_string(), spec.job_name.clone());
    env.insert("GPUCP_TENANT".to_string(), spec.tenant.clone());
    env.insert("GPUCP_GPUS".to_string(), gpus);
    for key in HOST_MPS_ENV {
        if let Some(value) = parent(key) {
            env.insert((*key).to_string(), value);
        }
    }
    if let Some(share) = &spec.share {
        env.insert(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_string(),
            active_thread_percentage(share.milli).to_string(),
        );
        if share.memory_mib > 0 {
            let limits: Vec<String> = spec
                .gpus
                .iter()
                .map(|gpu| format!("{gpu}={}M", share.memory_mib))
                .collect();
            env.insert(
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
                limits.join(","),
            );
        }
        env.insert("GPUCP_GPU_MILLI".to_string(), share.milli.to_string());
        env.insert(
            "GPUCP_GPU_MEMORY_MIB".to_string(),
            share.memory_mib.to_string(),
        );
    }
    env
}

/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` for a share of `milli`: the percentage rounded up, so
/// that a small share still gets some threads (1 milli → 1 %), capped at 100.
pub fn active_thread_percentage(milli: u32) -> u32 {
    milli.div_ceil(10).min(100)
}

/// Rejects specs that cannot be launched faithfully, before anything is written to disk:
/// strings with NUL bytes cannot be passed to `exec`, a `=` in a variable name would be
/// split differently by the command, and a comma inside a GPU id would let one id expand
/// into several entries of `CUDA_VISIBLE_DEVICES`.
pub fn validate_spec(spec: &LaunchSpec) -> Result<(), RuntimeError> {
    let invalid = |message: String| RuntimeError::InvalidSpec {
        allocation: spec.allocation_id,
        message,
    };
    match spec.command.first() {
        None => return Err(invalid("the command is empty".to_string())),
        Some(program) if program.is_empty() => {
            return Err(invalid("the command's program name is empty".to_string()));
        }
        Some(_) => {}
    }
    if let Some(arg) = spec.command.iter().find(|a| a.contains('\0')) {
        return Err(invalid(format!(
            "command argument {arg:?} contains a NUL byte"
        )));
    }
    for (key, value) in &spec.env {
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            return Err(invalid(format!(
                "environment variable name {key:?} is empty or contains '=' or NUL"
            )));
        }
        if value.contains('\0') {
            return Err(invalid(format!(
                "value of environment variable {key} contains a NUL byte"
            )));
        }
    }
    for (what, text) in [("job name", &spec.job_name), ("tenant", &spec.tenant)] {
        if text.contains('\0') {
            return Err(invalid(format!("{what} {text:?} contains a NUL byte")));
        }
    }
    let mut seen = BTreeSet::new();
    for gpu in &spec.gpus {
        if gpu.is_empty() || gpu.contains(',') || gpu.contains('\0') || gpu.trim() != gpu {
            return Err(invalid(format!(
                "GPU id {gpu:?} is empty or contains a comma, NUL or surrounding spaces"
            )));
        }
        if !seen.insert(gpu.as_str()) {
            return Err(invalid(format!("GPU {gpu} is listed twice")));
        }
    }
    for (slice, parent) in &spec.mig_parents {
        if !seen.contains(slice.as_str()) {
            return Err(invalid(format!(
                "MIG slice {slice} has a parent GPU but is not one of the allocation's GPUs"
            )));
        }
        if parent.is_empty() || parent == slice || seen.contains(parent.as_str()) {
            return Err(invalid(format!(
                "MIG slice {slice} names {parent:?} as its parent GPU, which is empty, itself, \
                 or also used whole by the allocation"
            )));
        }
    }
    if let Some(share) = &spec.share {
        if spec.gpus.len() != 1 {
            return Err(invalid(format!(
                "a share of a GPU names exactly one GPU, not {}",
                spec.gpus.len()
            )));
        }
        if !(1..MILLI_PER_GPU).contains(&share.milli) {
            return Err(invalid(format!(
                "a share of a GPU is 1 to {} milli, not {}",
                MILLI_PER_GPU - 1,
                share.milli
            )));
        }
        if !spec.mig_parents.is_empty() {
            return Err(invalid(
                "a MIG slice cannot be shared: a share names a whole GPU".to_string(),
            ));
        }
        if share.gpu_memory_mib > 0 && share.memory_mib > share.gpu_memory_mib {
            return Err(invalid(format!(
                "the share's GPU memory limit ({} MiB) exceeds the GPU's memory ({} MiB)",
                share.memory_mib, share.gpu_memory_mib
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::types::GpuShare;

    fn spec(gpus: &[&str]) -> LaunchSpec {
        LaunchSpec {
            allocation_id: 42,
            job_id: 7,
            job_name: "train".to_string(),
            tenant: "vision".to_string(),
            command: vec!["true".to_string()],
            env: BTreeMap::new(),
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            time_limit: None,
            share: None,
            mig_parents: BTreeMap::new(),
            cpu_milli: 0,
            memory_mib: 0,
            gpu_minors: Vec::new(),
            mig_cap_minors: Vec::new(),
            workdir: None,
            numa_node: None,
            container: None,
            stdout_path: None,
            stderr_path: None,
        }
    }

    fn share_spec(milli: u32, memory_mib: u64) -> LaunchSpec {
        LaunchSpec {
            share: Some(GpuShare {
                milli,
                memory_mib,
                gpu_memory_mib: 81_559,
            }),
            ..spec(&["GPU-a"])
        }
    }

    fn parent(key: &str) -> Option<String> {
        match key {
            "PATH" => Some("/opt/bin:/usr/bin".to_string()),
            "HOME" => Some("/home/agent".to_string()),
            "AWS_SECRET_ACCESS_KEY" => Some("secret".to_string()),
            "CUDA_VISIBLE_DEVICES" => Some("0,1,2,3".to_string()),
            _ => None,
        }
    }

    #[test]
    fn gpus_and_job_identity_are_exported() {
        let env = command_env(&spec(&["GPU-a", "MIG-b"]), parent);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-a,MIG-b");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-a,MIG-b");
        assert_eq!(env["GPUCP_GPUS"], "GPU-a,MIG-b");
        assert_eq!(env["GPUCP_JOB_ID"], "7");
        assert_eq!(env["GPUCP_ALLOCATION_ID"], "42");
        assert_eq!(env["GPUCP_JOB_NAME"], "train");
        assert_eq!(env["GPUCP_TENANT"], "vision");
    }

    #[test]
    fn zero_gpus_hide_every_gpu() {
        let env = command_env(&spec(&[]), parent);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "void");
        assert_eq!(env["GPUCP_GPUS"], "");
    }

    #[test]
    fn only_basics_are_inherited() {
        let env = command_env(&spec(&["GPU-a"]), parent);
        assert_eq!(env["PATH"], "/opt/bin:/usr/bin");
        assert_eq!(env["HOME"], "/home/agent");
        assert!(!env.contains_key("AWS_SECRET_ACCESS_KEY"));
        // The agent's own CUDA_VISIBLE_DEVICES must not leak into the job.
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-a");
    }

    #[test]
    fn default_path_when_agent_has_none() {
        let env = command_env(&spec(&[]), |_| None);
        assert_eq!(env["PATH"], DEFAULT_PATH);
        assert!(!env.contains_key("HOME"));
    }

    #[test]
    fn spec_env_overrides_basics_but_not_reserved_variables() {
        let mut s = spec(&["GPU-a"]);
        s.env.insert("PATH".to_string(), "/job/bin".to_string());
        s.env.insert("NCCL_DEBUG".to_string(), "INFO".to_string());
        s.env
            .insert("CUDA_VISIBLE_DEVICES".to_string(), "GPU-other".to_string());
        s.env
            .insert("GPUCP_TENANT".to_string(), "someone-else".to_string());
        let env = command_env(&s, parent);
        assert_eq!(env["PATH"], "/job/bin");
        assert_eq!(env["NCCL_DEBUG"], "INFO");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-a");
        assert_eq!(env["GPUCP_TENANT"], "vision");
    }

    #[test]
    fn a_share_gets_its_gpu_and_mps_limits() {
        let env = command_env(&share_spec(250, 20_389), parent);
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-a");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "GPU-a=20389M");
        assert_eq!(env["GPUCP_GPU_MILLI"], "250");
        assert_eq!(env["GPUCP_GPU_MEMORY_MIB"], "20389");

        // No memory limit: no pinned-memory variable, the rest as before.
        let env = command_env(&share_spec(500, 0), parent);
        assert!(!env.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
        assert_eq!(env["GPUCP_GPU_MEMORY_MIB"], "0");
    }

    #[test]
    fn thread_percentage_rounds_up_and_stays_within_100() {
        let cases = [
            (1, 1),
            (9, 1),
            (10, 1),
            (11, 2),
            (250, 25),
            (333, 34),
            (999, 100),
        ];
        for (milli, percent) in cases {
            assert_eq!(active_thread_percentage(milli), percent, "{milli} milli");
        }
        assert_eq!(active_thread_percentage(1000), 100);
        assert_eq!(active_thread_percentage(u32::MAX), 100);
    }

    #[test]
    fn exclusive_gpus_get_no_share_variables_and_jobs_cannot_forge_them() {
        let mut s = spec(&["GPU-a"]);
        for key in [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "GPUCP_GPU_MILLI",
            "GPUCP_GPU_MEMORY_MIB",
            "CUDA_MPS_PIPE_DIRECTORY",
        ] {
            s.env.insert(key.to_string(), "forged".to_string());
        }
        let env = command_env(&s, parent);
        assert!(
            !env.values().any(|v| v == "forged"),
            "a job set a reserved variable: {env:?}"
        );
        assert!(!env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
        assert!(!env.contains_key("GPUCP_GPU_MILLI"));

        // A share cannot raise its own limits either.
        let mut s = share_spec(100, 1000);
        s.env.insert(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_string(),
            "100".to_string(),
        );
        s.env.insert(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
            "0=80G".to_string(),
        );
        let env = command_env(&s, parent);
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "10");
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "GPU-a=1000M");
    }

    #[test]
    fn the_hosts_mps_directories_come_from_the_agent() {
        let host = |key: &str| match key {
            "CUDA_MPS_PIPE_DIRECTORY" => Some("/run/nvidia-mps".to_string()),
            "CUDA_MPS_LOG_DIRECTORY" => Some("/var/log/nvidia-mps".to_string()),
            other => parent(other),
        };
        for s in [spec(&["GPU-a"]), share_spec(250, 100)] {
            let env = command_env(&s, host);
            assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/run/nvidia-mps");
            assert_eq!(env["CUDA_MPS_LOG_DIRECTORY"], "/var/log/nvidia-mps");
        }
        // Not set on the agent: not set for the job (CUDA uses its default).
        assert!(
            !command_env(&share_spec(250, 100), parent).contains_key("CUDA_MPS_PIPE_DIRECTORY")
        );
    }

    #[test]
    fn mig_slices_are_visible_by_their_own_uuids() {
        let mut s = spec(&["MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000001"]);
        s.mig_parents.insert(
            "MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000001".to_string(),
            "GPU-parent".to_string(),
        );
        assert!(validate_spec(&s).is_ok());
        let env = command_env(&s, parent);
        assert_eq!(
            env["CUDA_VISIBLE_DEVICES"],
            "MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000001"
        );
        assert_eq!(
            env["NVIDIA_VISIBLE_DEVICES"],
            "MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000001"
        );
        assert!(!env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
    }

    #[test]
    fn validation_rejects_impossible_shares_and_slices() {
        assert!(validate_spec(&share_spec(1, 1)).is_ok());
        assert!(validate_spec(&share_spec(999, 81_559)).is_ok());
        for (what, bad) in [
            ("0 milli", share_spec(0, 100)),
            ("a whole GPU", share_spec(1000, 100)),
            ("more memory than the GPU", share_spec(500, 81_560)),
            (
                "two GPUs",
                LaunchSpec {
                    gpus: vec!["GPU-a".into(), "GPU-b".into()],
                    ..share_spec(500, 100)
                },
            ),
            (
                "no GPU",
                LaunchSpec {
                    gpus: Vec::new(),
                    ..share_spec(500, 100)
                },
            ),
            (
                "a MIG slice",
                LaunchSpec {
                    mig_parents: BTreeMap::from([("GPU-a".into(), "GPU-p".into())]),
                    cpu_milli: 0,
                    memory_mib: 0,
                    gpu_minors: Vec::new(),
                    mig_cap_minors: Vec::new(),
                    workdir: None,
                    numa_node: None,
                    container: None,
                    stdout_path: None,
                    stderr_path: None,
                    ..share_spec(500, 100)
                },
            ),
        ] {
            assert!(validate_spec(&bad).is_err(), "{what} accepted");
        }
        let slice = |parent: &str| {
            let mut s = spec(&["MIG-a", "GPU-b"]);
            s.mig_parents.insert("MIG-a".into(), parent.into());
            s
        };
        assert!(validate_spec(&slice("GPU-p")).is_ok());
        assert!(validate_spec(&slice("GPU-b")).is_err(), "parent also whole");
        assert!(validate_spec(&slice("")).is_err());
        assert!(validate_spec(&slice("MIG-a")).is_err());
        let mut s = spec(&["GPU-b"]);
        s.mig_parents.insert("MIG-x".into(), "GPU-p".into());
        assert!(validate_spec(&s).is_err(), "a parent for a GPU not listed");
    }

    #[test]
    fn validation_rejects_unlaunchable_specs() {
        assert!(validate_spec(&spec(&["GPU-a", "GPU-b"])).is_ok());
        let mut s = spec(&[]);
        s.command.clear();
        assert!(validate_spec(&s).is_err());
        let mut s = spec(&[]);
        s.command = vec![String::new()];
        assert!(validate_spec(&s).is_err());
        let mut s = spec(&[]);
        s.command.push("a\0b".to_string());
        assert!(validate_spec(&s).is_err());
        let mut s = spec(&[]);
        s.env.insert("A=B".to_string(), "x".to_string());
        assert!(validate_spec(&s).is_err());
        assert!(validate_spec(&spec(&["GPU-a,GPU-b"])).is_err());
        assert!(validate_spec(&spec(&["GPU-a", "GPU-a"])).is_err());
        assert!(validate_spec(&spec(&[""])).is_err());
    }
}
