//! Parsers for Slurm-style flag values: time limits, memory sizes, durations, dependencies.

use anyhow::{Context, bail};
use proto::v1::{Dependency, dependency::Kind};

/// Longest time limit accepted: what the API's `int64` seconds can hold.
pub const MAX_TIME_LIMIT_SECS: u64 = i64::MAX as u64;

/// Parses a time limit the way Slurm's `--time` does: `MINUTES`, `MINUTES:SECONDS`,
/// `HOURS:MINUTES:SECONDS`, `DAYS-HOURS`, `DAYS-HOURS:MINUTES`, `DAYS-HOURS:MINUTES:SECONDS`
/// (fields may exceed their unit, `90:00` is 90 minutes, as in Slurm). Also a human duration
/// (`humantime`: `90s`, `30m`, `12h`, `2d`, `1h 30m`), in whole seconds. Returns seconds, never
/// zero; a value too large for the API is refused rather than wrapped.
pub fn parse_time_limit(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let bad = || {
        format!(
            "time limit {s:?} is not MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS \
             or a duration such as 90s, 30m, 12h, 2d"
        )
    };
    if s.is_empty() {
        bail!(bad());
    }
    let total = if s.chars().any(|c| c.is_ascii_alphabetic()) {
        let d = humantime::parse_duration(s).map_err(|e| {
            anyhow::anyhow!("time limit {s:?}: {e} (write e.g. 90s, 30m, 12h, 2d or D-HH:MM:SS)")
        })?;
        if d.subsec_nanos() != 0 {
            bail!("time limit {s:?} is not a whole number of seconds");
        }
        d.as_secs()
    } else {
        slurm_time_secs(s).ok_or_else(|| anyhow::anyhow!(bad()))??
    };
    if total == 0 {
        bail!("time limit {s:?} is zero");
    }
    if total > MAX_TIME_LIMIT_SECS {
        bail!("time limit {s:?} is too long (at most {MAX_TIME_LIMIT_SECS} seconds)");
    }
    Ok(total)
}

/// Seconds of a Slurm time (digits, `:` and `-` only). `None`: not that syntax; `Some(Err)`:
/// that syntax, but more seconds than a u64 holds.
fn slurm_time_secs(s: &str) -> Option<anyhow::Result<u64>> {
    let num = |p: &str| -> Option<u64> {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        // Digits only: the one error left is overflow, which saturates (refused below).
        Some(p.parse::<u64>().unwrap_or(u64::MAX))
    };
    let (days, rest) = match s.split_once('-') {
        Some((d, rest)) => (num(d)?, Some(rest)),
        None => (0, None),
    };
    // (hours, minutes, seconds)
    let (h, m, sec) = match rest {
        Some(rest) => match rest.split(':').collect::<Vec<_>>().as_slice() {
            [h] => (num(h)?, 0, 0),
            [h, m] => (num(h)?, num(m)?, 0),
            [h, m, sec] => (num(h)?, num(m)?, num(sec)?),
            _ => return None,
        },
        None => match s.split(':').collect::<Vec<_>>().as_slice() {
            [m] => (0, num(m)?, 0),
            [m, sec] => (0, num(m)?, num(sec)?),
            [h, m, sec] => (num(h)?, num(m)?, num(sec)?),
            _ => return None,
        },
    };
    let total = days
        .checked_mul(86_400)
        .and_then(|t| t.checked_add(h.checked_mul(3600)?))
        .and_then(|t| t.checked_add(m.checked_mul(60)?))
        .and_then(|t| t.checked_add(sec));
    Some(total.ok_or_else(|| {
        anyhow::anyhow!("time limit {s:?} is too long (at most {MAX_TIME_LIMIT_SECS} seconds)")
    }))
}

/// Parses a duration for a setting measured in milliseconds (probe periods, back-offs,
/// deadlines, windows): a human duration (`humantime`: `500ms`, `1s`, `10m`, `1h 30m`) or a
/// bare number of seconds (`30`, `0.5`). Zero is allowed (the caller decides whether it means
/// "none"); a value beyond u64 milliseconds is refused, never wrapped.
pub fn parse_duration_ms(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let bad = || {
        format!(
            "duration {s:?} is not a number of seconds or a duration such as 500ms, 1s, 10m, 2h"
        )
    };
    if s.is_empty() {
        bail!(bad());
    }
    if !s.chars().any(|c| c.is_ascii_alphabetic()) {
        let secs: f64 = s
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v >= 0.0)
            .with_context(bad)?;
        let ms = (secs * 1000.0).round();
        if ms > u64::MAX as f64 {
            bail!("duration {s:?} is too long");
        }
        return Ok(ms as u64);
    }
    let d = humantime::parse_duration(s)
        .map_err(|e| anyhow::anyhow!("duration {s:?}: {e} (write e.g. 500ms, 1s, 10m, 2h)"))?;
    if d.subsec_nanos() % 1_000_000 != 0 {
        bail!("duration {s:?} is finer than a millisecond");
    }
    u64::try_from(d.as_millis()).map_err(|_| anyhow::anyhow!("duration {s:?} is too long"))
}

/// Parses a memory size as Slurm's `--mem` does: a number of MiB, or with a K/M/G/T suffix.
pub fn parse_mem_mib(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let bad = || format!("memory size {s:?} is not a number with an optional K, M, G or T suffix");
    let (num, mult_kib) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64),
        Some('M') => (&s[..s.len() - 1], 1024),
        Some('G') => (&s[..s.len() - 1], 1024 * 1024),
        Some('T') => (&s[..s.len() - 1], 1024 * 1024 * 1024),
        _ => (s, 1024),
    };
    let n: f64 = num.parse().with_context(bad)?;
    if !(n.is_finite() && n >= 0.0) {
        bail!(bad());
    }
    Ok(((n * mult_kib as f64) / 1024.0).ceil() as u64)
}

/// Parses Slurm's `--dependency`: `afterok:12:13,afterany:4,afternotok:7`.
pub fn parse_dependencies(s: &str) -> anyhow::Result<Vec<Dependency>> {
    let mut deps = Vec::new();
    for group in s.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        let mut parts = group.split(':');
        let kind = match parts.next().unwrap_or_default() {
            "afterok" => Kind::AfterOk,
            "afterany" => Kind::AfterAny,
            "afternotok" => Kind::AfterNotOk,
            other => bail!("dependency type {other:?} is not afterok, afterany or afternotok"),
        };
        let mut any = false;
        for id in parts {
            let job_id: u64 = id
                .parse()
                .with_context(|| format!("dependency {group:?}: {id:?} is not a job id"))?;
            deps.push(Dependency {
                kind: kind as i32,
                job_id,
            });
            any = true;
        }
        if !any {
            bail!("dependency {group:?} names no job (write e.g. afterok:12)");
        }
    }
    Ok(deps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_time_formats() {
        let cases = [
            ("30", 1800),
            ("5:30", 330),
            ("24:00:00", 86_400),
            ("1-12", 129_600),
            ("1-00:30", 88_200),
            ("2-01:02:03", 176_523),
            ("90s", 90),
            ("2h", 7200),
        ];
        for (input, want) in cases {
            assert_eq!(parse_time_limit(input).unwrap(), want, "{input}");
        }
        for bad in [
            "",
            "abc",
            "1:2:3:4",
            "0",
            "-5",
            "1-2:3:4:5",
            "1-",
            "-",
            ":",
            "1::2",
            "+5",
            "1.5",
            "5 :3",
            "1-2-3",
            "0:0",
            "1500ms",
            "0s",
        ] {
            assert!(parse_time_limit(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(parse_time_limit("1h 30m").unwrap(), 5400);
        assert_eq!(parse_time_limit("90:00").unwrap(), 5400);
    }

    #[test]
    fn huge_time_limits_are_refused_not_wrapped() {
        for huge in [
            "18446744073709551615",
            "99999999999999999999999",
            "213503982334601-0",
            "1-18446744073709551615:00:00",
            "153722867280912931",
            "9223372036854775808:0",
            "106751991167301d",
            "1000000000000000000000h",
        ] {
            let e = parse_time_limit(huge).unwrap_err().to_string();
            assert!(
                e.contains("too long") || e.contains("too large"),
                "{huge}: {e}"
            );
        }
        assert_eq!(
            parse_time_limit("9223372036854775807:0:0")
                .unwrap_err()
                .to_string(),
            "time limit \"9223372036854775807:0:0\" is too long (at most 9223372036854775807 seconds)"
        );
        assert_eq!(
            parse_time_limit("0:0:9223372036854775807").unwrap(),
            MAX_TIME_LIMIT_SECS
        );
    }

    proptest::proptest! {
        /// Every Slurm form, with any field values, is either the exact sum or refused as
        /// too long, never wrapped and never a panic.
        #[test]
        fn slurm_forms_sum_exactly(
            d in proptest::option::of(0u64..u64::MAX),
            h in 0u64..u64::MAX,
            m in 0u64..u64::MAX,
            sec in 0u64..u64::MAX,
            form in 0usize..6,
            small in proptest::bool::ANY,
        ) {
            // Half the cases in the range a person types, half anywhere.
            let f = |x: u64, cap: u64| if small { x % cap } else { x };
            let (d, h, m, sec) = (f(d.unwrap_or(0), 400), f(h, 100), f(m, 10_000), f(sec, 100_000));
            let (text, want): (String, u128) = match form {
                0 => (format!("{m}"), u128::from(m) * 60),
                1 => (format!("{m}:{sec}"), u128::from(m) * 60 + u128::from(sec)),
                2 => (format!("{h}:{m}:{sec}"), u128::from(h) * 3600 + u128::from(m) * 60 + u128::from(sec)),
                3 => (format!("{d}-{h}"), u128::from(d) * 86_400 + u128::from(h) * 3600),
                4 => (format!("{d}-{h}:{m}"), u128::from(d) * 86_400 + u128::from(h) * 3600 + u128::from(m) * 60),
                _ => (
                    format!("{d}-{h}:{m}:{sec}"),
                    u128::from(d) * 86_400 + u128::from(h) * 3600 + u128::from(m) * 60 + u128::from(sec),
                ),
            };
            match parse_time_limit(&text) {
                Ok(got) => proptest::prop_assert_eq!(u128::from(got), want),
                Err(e) => {
                    let e = e.to_string();
                    proptest::prop_assert!(
                        (want == 0 && e.contains("zero"))
                            || (want > u128::from(MAX_TIME_LIMIT_SECS) && e.contains("too long")),
                        "{} refused: {}", text, e
                    );
                }
            }
        }

        /// Arbitrary text never panics, and what parses is in range.
        #[test]
        fn any_text_is_parsed_or_refused(s in "[0-9:\\- a-z.]{0,24}") {
            if let Ok(secs) = parse_time_limit(&s) {
                proptest::prop_assert!(secs > 0 && secs <= MAX_TIME_LIMIT_SECS);
            }
        }
    }

    #[test]
    fn durations_in_milliseconds() {
        for (input, want) in [
            ("500ms", 500),
            ("1s", 1_000),
            ("10m", 600_000),
            ("1h 30m", 5_400_000),
            ("30", 30_000),
            ("0.25", 250),
            ("0", 0),
            (" 2s ", 2_000),
        ] {
            assert_eq!(parse_duration_ms(input).unwrap(), want, "{input}");
        }
        for bad in ["", "abc", "-1", "1.5.2", "5 parsecs", "NaN", "inf", "10us"] {
            assert!(parse_duration_ms(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(
            parse_duration_ms("99999999999999999999999s")
                .unwrap_err()
                .to_string()
                .contains("99999999999999999999999s")
        );
    }

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_mem_mib("512").unwrap(), 512);
        assert_eq!(parse_mem_mib("64G").unwrap(), 65_536);
        assert_eq!(parse_mem_mib("1.5g").unwrap(), 1536);
        assert_eq!(parse_mem_mib("2048K").unwrap(), 2);
        assert!(parse_mem_mib("lots").is_err());
    }

    #[test]
    fn dependencies() {
        let d = parse_dependencies("afterok:12:13,afternotok:4").unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d[2].kind, Kind::AfterNotOk as i32);
        assert!(parse_dependencies("after:1").is_err());
        assert!(parse_dependencies("afterok").is_err());
        assert!(parse_dependencies("afterok:x").is_err());
    }
}
