//! The environment an allocation's command runs with, and launch-spec validation. Pure
//! functions, so the rules are unit-tested without starting processes.
//!
//! The agent's own environment is *not* inherited wholesale: it may hold the agent's
//! credentials, its `RUST_LOG`, proxy settings or an operator's `CUDA_VISIBLE_DEVICES`, none
//! of which belong to a tenant's job, and an inherited variable would make a job's
//! behaviour depend on how the agent was started. Only the basics a program needs to run
//! like a login session ([`INHERITED_ENV`]) pass through; everything else comes from the
//! launch spec.

use std::collections::{BTreeMap, BTreeSet};

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
];

/// The complete environment of the command, built from (lowest precedence first) the
/// inherited basics looked up through `parent`, `spec.env`, and the reserved variables.
///
/// With zero GPUs the command gets `CUDA_VISIBLE_DEVICES=` (CUDA then sees no device) and
/// `NVIDIA_VISIBLE_DEVICES=void` (the NVIDIA container runtime's "no GPU" value), so a
/// CPU-only allocation cannot reach a GPU another allocation holds.
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
    env
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
