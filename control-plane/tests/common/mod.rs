//! What the benchmark smoke tests share: running `gpuctl bench` and reading its JSON.

use std::process::Command;

/// Runs `gpuctl -o json bench ARGS`, fails the test unless it succeeds, and returns the JSON
/// object on the last line of its stdout.
pub fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_gpuctl"))
        .args(["--output", "json", "bench"])
        .args(args)
        .output()
        .expect("running gpuctl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gpuctl bench {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last line of stdout is not JSON ({e}): {last:?}\n{stderr}"))
}
