//! Smoke run of every fuzz target (`control_plane::fuzz`, docs/FUZZING.md): a fixed seed and
//! a bounded number of cases each, so the run is the same every time, and zero crashes or
//! violations allowed. Longer campaigns are `gpucp-fuzz --seconds N`.
//!
//! The regression inputs are findings of earlier campaigns, kept so they stay fixed.

use control_plane::fuzz::{self, Budget, TARGETS};

/// Cases per target: the whole test stays within seconds in a debug build.
fn cases(target: &str) -> u64 {
    match target {
        "apply" => 1500,
        "request" => 20_000,
        // Every case opens a runtime on a state directory (fsyncs where there is no tmpfs).
        "record_log" => 1500,
        _ => 15_000,
    }
}

#[test]
fn every_target_runs_its_cases_without_a_crash() {
    let mut failures = Vec::new();
    for target in TARGETS {
        let report = fuzz::run(
            target,
            0x5eed,
            Budget {
                cases: Some(cases(target.name)),
                time: None,
            },
        );
        assert_eq!(report.cases, cases(target.name), "{}", target.name);
        assert!(report.features > 1, "{} shows no features", target.name);
        for f in &report.findings {
            failures.push(format!(
                "{}: {:?} x{}: {}\n  input (hex): {}",
                target.name,
                f.kind,
                f.count,
                f.message,
                fuzz::hex(&f.input)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Inputs that crashed or violated an invariant in earlier campaigns, by target.
const REGRESSIONS: &[(&str, &str)] = &[
    // A registration whose fence grace is near u64::MAX: `fence_grace_ms + FENCE_MARGIN_MS`
    // overflowed (a panic in debug builds, a wrapped sum that passed the check in release).
    ("request", "01500850ffffffffffffffffff01"),
    // A node re-registering without a GPU that shares hold: the GPU was forgotten while the
    // shares' allocations still held it.
    (
        "apply",
        "3841a9685d45701e68f2f89cbcfa1e5a689661fd90d077d8c908100fdcf038cda026e01265c63359b09bf0c990fd6303b0ce1a",
    ),
    // The same for a MIG slice an allocation holds.
    ("apply", "50756c332c367a757c6e"),
    // A batch that places under a tenant's limit and then lowers the limit: not a breach (the
    // limit held when the placement was made), which the harness's quota check took for one
    // when it compared the batch's end with its start (campaign of 2026-12-04).
    (
        "apply",
        "6609623722224e63682c6e3834557133477c767765766d2e556c75755536664e5677587033475020397c382262627c767765766d2e556c756f7c382262627c767765766d2e556c756f75553636664e56666f502e675677587033475020397c382262627c767765766d2e55756f755536664e56666f502e6756775870774e722e69776c56096f587755396c203656762d3655096f38554e556650332065370a6e5878752d6b346130562d6e7a0a6e2d763671386e58327a6d5065",
    ),
    // A share on a GPU whose reported memory is near u64::MAX: its part of the memory was a
    // product that overflowed (found by the smoke run of 2026-12-06, once the target also
    // generated Slurm's job rules).
    (
        "apply",
        "14d08303c5f57e2ef228363cc6cdc000cfccdd873eb05addd854cf1a3fc11947beb78bd06273201d43139fbdedaf873faac3d8c39c63a743e333b60a0912794bb6749536ad9214c537c0a743e36582a066620889",
    ),
];

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn earlier_findings_stay_fixed() {
    for (name, input) in REGRESSIONS {
        let target = fuzz::target(name).expect("a target");
        assert_eq!(
            fuzz::replay(target, &unhex(input)),
            Ok(()),
            "{name} {input}"
        );
    }
}
