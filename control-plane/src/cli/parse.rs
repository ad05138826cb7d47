//! Parsers for Slurm-style flag values: time limits, memory sizes, dependencies.

use anyhow::{Context, bail};
use proto::v1::{Dependency, dependency::Kind};

/// Parses a time limit the way Slurm's `--time` does: `MINUTES`, `MINUTES:SECONDS`,
/// `HOURS:MINUTES:SECONDS`, `DAYS-HOURS`, `DAYS-HOURS:MINUTES`, `DAYS-HOURS:MINUTES:SECONDS`.
/// Also accepts a plain suffix form (`90s`, `30m`, `12h`, `2d`). Returns seconds.
pub fn parse_time_limit(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let bad =
        || format!("time limit {s:?} is not MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS");
    if s.is_empty() {
        bail!(bad());
    }
    if let Some(last) = s.chars().last()
        && matches!(last, 's' | 'm' | 'h' | 'd')
        && s.len() > 1
    {
        let n: u64 = s[..s.len() - 1].parse().with_context(bad)?;
        let unit = match last {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            _ => 86_400,
        };
        return Ok(n * unit);
    }
    let num = |p: &str| -> anyhow::Result<u64> { p.parse::<u64>().with_context(bad) };
    let (days, rest) = match s.split_once('-') {
        Some((d, rest)) => (num(d)?, Some(rest)),
        None => (0, None),
    };
    let secs = match rest {
        Some(rest) => {
            let parts: Vec<&str> = rest.split(':').collect();
            match parts.as_slice() {
                [h] => num(h)? * 3600,
                [h, m] => num(h)? * 3600 + num(m)? * 60,
                [h, m, sec] => num(h)? * 3600 + num(m)? * 60 + num(sec)?,
                _ => bail!(bad()),
            }
        }
        None => {
            let parts: Vec<&str> = s.split(':').collect();
            match parts.as_slice() {
                [m] => num(m)? * 60,
                [m, sec] => num(m)? * 60 + num(sec)?,
                [h, m, sec] => num(h)? * 3600 + num(m)? * 60 + num(sec)?,
                _ => bail!(bad()),
            }
        }
    };
    let total = days * 86_400 + secs;
    if total == 0 {
        bail!("time limit {s:?} is zero");
    }
    Ok(total)
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
        for bad in ["", "abc", "1:2:3:4", "0", "-5", "1-2:3:4:5"] {
            assert!(parse_time_limit(bad).is_err(), "{bad:?} should be refused");
        }
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
