//! Target `record_log`: arbitrary bytes as a node agent's allocation record log
//! (`state_dir/allocations.log`, `node-agent/src/runtime/record_log.rs`), recovered by
//! `Runtime::open` in a scratch state directory: the replay, the cut of a torn last line, the
//! compaction, and the settling of each record found.
//!
//! The first byte picks how the rest is written. Even: as is, so most lines fail their
//! checksum (the framing and torn-line paths). Odd: each line is re-framed with a correct
//! checksum first, so its JSON reaches the record decoder and the runtime.
//!
//! Safety: a record that names a shim pid makes `open` signal that process group (it would be
//! re-adopting a workload). The harness never lets one through: before re-framing, a line
//! whose JSON gives a record a `shim_pid` (by name, or third in a sequence) has it removed.
//! Raw lines with a pid cannot pass their checksum. So the target never signals anything.
//!
//! Checks: nothing panics; a log `open` refuses as corrupt is left byte for byte as it was
//! (it may be the only trace of a process that still runs); a log `open` accepted opens again
//! (its recovery is complete) and reports the same allocations.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use node_agent::runtime::{
    ExitKind, LaunchSpec, Runtime, RuntimeConfig, RuntimeError, RuntimeEvent, StopReason,
    frame_line,
};
use serde_json::{Value, json};

use super::{Features, Target, shape};

pub const TARGET: Target = Target {
    name: "record_log",
    about: "bytes → the agent's allocation record log, recovered by Runtime::open; a corrupt \
            log is left untouched, a recovered one opens again with the same allocations",
    max_len: 8192,
    dictionary: &[
        b"\n",
        b" ",
        b"{\"put\":",
        b"{\"forget\":{\"id\":1}}",
        b"\"format\":1",
        b"\"format\":2",
        b"\"spec\":",
        b"\"allocation_id\":",
        b"\"exit\":",
        b"\"stop\":",
        b"null",
        b"true",
        b"\"kind\":\"vanished\"",
        b"\"reason\":\"requested\"",
        b"\"time_limit\":{\"secs\":1,\"nanos\":0}",
        b"[",
        b"]",
        b"}",
        b"{",
        b",",
        b"18446744073709551615",
        b"0000000000000000 ",
    ],
    seeds,
    run,
};

/// A scratch directory for targets that need files: on tmpfs where there is one (the runtime
/// syncs every append), else in the temporary directory.
pub fn scratch_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let builder = || {
        let mut b = tempfile::Builder::new();
        b.prefix("gpucp-fuzz-");
        b
    };
    match shm.is_dir().then(|| builder().tempdir_in(shm)) {
        Some(Ok(dir)) => dir,
        _ => builder().tempdir().expect("a temporary directory"),
    }
}

fn line(json: &Value) -> Vec<u8> {
    frame_line(&serde_json::to_vec(json).expect("a Value encodes"))
}

fn record(id: u64, stop: bool, exit: Option<ExitKind>) -> Value {
    let spec = LaunchSpec {
        allocation_id: id,
        job_id: id + 100,
        job_name: format!("job-{id}"),
        tenant: "ta".into(),
        command: vec!["sleep".into(), "60".into()],
        env: [("EPOCHS".to_owned(), "3".to_owned())]
            .into_iter()
            .collect(),
        gpus: vec![format!("GPU-n0-{id}")],
        time_limit: id.is_multiple_of(2).then(|| Duration::from_secs(600)),
        share: None,
        mig_parents: Default::default(),
        cpu_milli: 0,
        memory_mib: 0,
        gpu_minors: Vec::new(),
        mig_cap_minors: Vec::new(),
        workdir: None,
        container: None,
        stdout_path: None,
        stderr_path: None,
        numa_node: None,
    };
    json!({
        "format": 1,
        "spec": spec,
        "shim_pid": null,
        "shim_start_ticks": null,
        "started_at_ms": 1_700_000_000_000u64 + id,
        "stop": stop.then(|| json!({"reason": StopReason::Requested, "term_sent_at_ms": 1_700_000_000_500u64})),
        "kill_sent_at_ms": null,
        "exit": exit.map(|kind| json!({"kind": kind, "at_ms": 1_700_000_001_000u64})),
    })
}

fn seeds() -> Vec<Vec<u8>> {
    let mut log = Vec::new();
    for (id, stop, exit) in [
        (1, false, None),
        (2, true, None),
        (3, false, Some(ExitKind::Exited { code: 0 })),
        (4, true, Some(ExitKind::Stopped)),
        (
            5,
            false,
            Some(ExitKind::Vanished {
                reason: "gone".into(),
            }),
        ),
    ] {
        log.extend(line(&json!({ "put": record(id, stop, exit) })));
    }
    log.extend(line(&json!({"forget": {"id": 3}})));
    log.extend(line(
        &json!({ "put": record(2, true, Some(ExitKind::TimedOut)) }),
    ));
    // What the real writer makes of it: `open` settles each record (appending its exit) and
    // compacts the log.
    let dir = scratch_dir();
    let written = recover(dir.path(), &log).unwrap_or_default();
    let mut torn = log.clone();
    torn.truncate(torn.len() - 7);
    let mut out = Vec::new();
    for body in [log, written, torn] {
        for mode in [0u8, 1] {
            let mut seed = vec![mode];
            seed.extend_from_slice(&body);
            out.push(seed);
        }
    }
    out
}

/// Opens a runtime on a state directory holding `log`, and returns the log as it left it.
fn recover(dir: &Path, log: &[u8]) -> Option<Vec<u8>> {
    let state = fresh_state_dir(dir, log).ok()?;
    drop(Runtime::open(config(&state)).ok()?);
    std::fs::read(state.join("allocations.log")).ok()
}

fn fresh_state_dir(dir: &Path, log: &[u8]) -> std::io::Result<PathBuf> {
    let state = dir.join("state");
    match std::fs::remove_dir_all(&state) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::create_dir_all(&state)?;
    std::fs::write(state.join("allocations.log"), log)?;
    Ok(state)
}

fn config(state: &Path) -> RuntimeConfig {
    RuntimeConfig {
        state_dir: state.to_path_buf(),
        // Never run: opening launches nothing.
        shim_program: PathBuf::from("/bin/false"),
        shim_args: Vec::new(),
        launcher: false,
        stop_grace: Duration::from_secs(30),
        lease_file: None,
        fence_grace: Duration::from_secs(2),
        cgroups: None,
        driver_majors: Default::default(),
        containers: None,
    }
}

/// The JSON of a line with any shim pid removed (see the module doc), or the bytes as they
/// are when they name none (or are no JSON at all, which the decoder refuses as well).
fn without_pid(json: &[u8]) -> Cow<'_, [u8]> {
    let Ok(mut value) = serde_json::from_slice::<Value>(json) else {
        return Cow::Borrowed(json);
    };
    let changed = match value.get_mut("put") {
        Some(Value::Object(record)) => record.remove("shim_pid").is_some_and(|p| !p.is_null()),
        Some(Value::Array(fields)) => match fields.get_mut(2) {
            Some(pid) if !pid.is_null() => {
                *pid = Value::Null;
                true
            }
            _ => false,
        },
        _ => false,
    };
    if changed {
        Cow::Owned(serde_json::to_vec(&value).expect("a Value encodes"))
    } else {
        Cow::Borrowed(json)
    }
}

/// Each line (its JSON after `<checksum> `, or all of it) made pid-free and given the right
/// checksum; a last line without a newline stays without one.
fn reframe(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 64);
    let mut rest = body;
    while !rest.is_empty() {
        let (text, newline) = match rest.iter().position(|&b| b == b'\n') {
            Some(i) => {
                let text = &rest[..i];
                rest = &rest[i + 1..];
                (text, true)
            }
            None => {
                let text = rest;
                rest = &[];
                (text, false)
            }
        };
        let json = match text.get(16) {
            Some(b' ') => &text[17..],
            _ => text,
        };
        let json = without_pid(json);
        let framed = frame_line(&json);
        // `frame_line` ends the line; the input's last line may not have.
        out.extend_from_slice(if newline {
            &framed
        } else {
            &framed[..framed.len() - 1]
        });
    }
    out
}

thread_local! {
    static SCRATCH: tempfile::TempDir = scratch_dir();
}

/// Allocation ids of the exits a runtime reports.
fn exited(events: &[RuntimeEvent]) -> BTreeSet<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            RuntimeEvent::Exited { allocation_id, .. } => Some(*allocation_id),
            RuntimeEvent::Started { .. } => None,
        })
        .collect()
}

fn run(input: &[u8], features: &mut Features) -> Result<(), String> {
    let Some((&mode, body)) = input.split_first() else {
        return Ok(());
    };
    let log: Cow<'_, [u8]> = if mode & 1 == 0 {
        Cow::Borrowed(body)
    } else {
        Cow::Owned(reframe(body))
    };
    SCRATCH.with(|dir| {
        let state = fresh_state_dir(dir.path(), &log).map_err(|e| format!("scratch: {e}"))?;
        let path = state.join("allocations.log");
        let mut first = match Runtime::open(config(&state)) {
            Ok(runtime) => runtime,
            Err(e) => {
                if let RuntimeError::CorruptRecord { message, .. } = &e {
                    features.add(("corrupt", shape(message, 12)));
                    let now = std::fs::read(&path).map_err(|e| format!("read back: {e}"))?;
                    if now != *log {
                        return Err("open changed a log it refused as corrupt".into());
                    }
                } else {
                    features.add(("refused", shape(&e.to_string(), 12)));
                }
                return Ok(());
            }
        };
        let events = first.poll();
        let live = first.live();
        drop(first);
        let kept = std::fs::read(&path).map_err(|e| format!("read back: {e}"))?;
        let lines = kept.iter().filter(|&&b| b == b'\n').count();
        features.add(("opened", events.len().min(8), live.len().min(8)));
        features.add(("kept", lines.min(8), kept.len() == log.len(), kept.len() < log.len()));
        for e in &events {
            if let RuntimeEvent::Exited { kind, .. } = e {
                features.add(("exit", format!("{kind:?}").split([' ', '{']).next().map(str::to_owned)));
            }
        }
        let mut second = Runtime::open(config(&state))
            .map_err(|e| format!("a log open recovered does not open again: {e}"))?;
        let again = second.poll();
        if exited(&again) != exited(&events) || second.live() != live {
            return Err(format!(
                "reopening the recovered log reports other allocations: exits {:?} then {:?}, live {live:?} then {:?}",
                exited(&events),
                exited(&again),
                second.live()
            ));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_logs_open_and_a_pid_never_gets_through() {
        let seeds = seeds();
        let written = &seeds[2][1..];
        assert!(
            written.len() > 100,
            "the real writer's log: {:?}",
            String::from_utf8_lossy(written)
        );
        for seed in &seeds {
            let body = &seed[1..];
            let dir = scratch_dir();
            let state = fresh_state_dir(dir.path(), body).unwrap();
            let opened = Runtime::open(config(&state));
            assert!(
                opened.is_ok(),
                "{:?}: {:?}",
                String::from_utf8_lossy(body),
                opened.err()
            );
        }
        let put = br#"{"put":{"format":1,"shim_pid":7}}"#;
        assert!(!String::from_utf8_lossy(&reframe(put)).contains("shim_pid"));
        let seq = br#"{"put":[1,{},7,5]}"#;
        assert!(String::from_utf8_lossy(&reframe(seq)).contains("[1,{},null,5]"));
    }
}
