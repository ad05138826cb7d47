//! Slurm's little languages, as sbatch and scontrol take them: host lists (`gpu[01-04,07]`),
//! job arrays (`0-99:2%8`) and begin times (`now+1hour`, `16:00`, `2026-12-24T08:00`), and job
//! references (`41`, `41_7`). Pure: the clock is a parameter.

use anyhow::{Context, bail};
use jiff::civil::{Date, DateTime, Time};
use jiff::{ToSpan, ZonedDateTime as Zoned};
use proto::v1 as pb;

/// Most names one host list may expand to (the control plane takes 1,024 per list).
pub const MAX_HOSTS: usize = 1024;

/// A Slurm host list: comma-separated names, each with bracketed ranges and single numbers
/// (`gpu[01-04,07]`, `rack[1-2]-n[1-8]`), zero-padded as the range's first number is.
/// Sorted and distinct.
pub fn expand_hostlist(text: &str) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for item in split_top_level(text)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        for name in expand_item(item).with_context(|| format!("host list {text:?}"))? {
            out.push(name);
            if out.len() > MAX_HOSTS {
                bail!("host list {text:?} names more than {MAX_HOSTS} hosts");
            }
        }
    }
    if out.is_empty() {
        bail!("host list {text:?} names no host");
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Splits at commas outside brackets.
fn split_top_level(text: &str) -> anyhow::Result<Vec<&str>> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            bail!("host list {text:?}: brackets do not pair up (or are nested)");
        }
    }
    if depth != 0 {
        bail!("host list {text:?}: a '[' is not closed");
    }
    parts.push(&text[start..]);
    Ok(parts)
}

/// One name with bracket groups, expanded left to right (the cartesian product).
fn expand_item(item: &str) -> anyhow::Result<Vec<String>> {
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            bail!("{item:?} has a ']' without a '['");
        }
        return Ok(vec![item.to_owned()]);
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .with_context(|| format!("{item:?}: a '[' is not closed"))?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut numbers = Vec::new();
    for range in ranges.split(',') {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        let width = if first.len() > 1 && first.starts_with('0') {
            first.len()
        } else {
            0
        };
        let parse = |n: &str| {
            n.parse::<u64>()
                .ok()
                .filter(|_| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .with_context(|| format!("{item:?}: {n:?} is not a number"))
        };
        let (a, b) = (parse(first)?, parse(last)?);
        if a > b {
            bail!("{item:?}: range {a}-{b} runs backwards");
        }
        if b - a >= MAX_HOSTS as u64 {
            bail!("{item:?}: range {first}-{last} names more than {MAX_HOSTS} hosts");
        }
        numbers.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    let tails = expand_item(rest)?;
    let mut out = Vec::with_capacity(numbers.len() * tails.len());
    for n in &numbers {
        for t in &tails {
            out.push(format!("{prefix}{n}{t}"));
            if out.len() > MAX_HOSTS {
                bail!("{item:?} names more than {MAX_HOSTS} hosts");
            }
        }
    }
    Ok(out)
}

/// `--array`: comma-separated indices and ranges `first-last[:step]`, then an optional `%N`
/// limit of jobs running at once (`0-99%8`, `1,3,5`, `0-15:4`).
pub fn parse_array(text: &str) -> anyhow::Result<pb::ArraySpec> {
    let (ranges_text, limit) = match text.split_once('%') {
        Some((r, l)) => (
            r,
            l.parse::<u32>()
                .ok()
                .filter(|n| *n > 0)
                .with_context(|| format!("--array {text:?}: %{l} is not a positive count"))?,
        ),
        None => (text, 0),
    };
    let number = |n: &str| {
        n.trim()
            .parse::<u32>()
            .with_context(|| format!("--array {text:?}: {n:?} is not an index"))
    };
    let mut ranges = Vec::new();
    for part in ranges_text.split(',') {
        let (span, step) = match part.split_once(':') {
            Some((span, step)) => (span, number(step)?),
            None => (part, 1),
        };
        let (first, last) = match span.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let n = number(span)?;
                (n, n)
            }
        };
        if first > last {
            bail!("--array {text:?}: {first}-{last} runs backwards");
        }
        if step == 0 {
            bail!("--array {text:?}: a step must be at least 1");
        }
        ranges.push(pb::ArrayRange { first, last, step });
    }
    Ok(pb::ArraySpec {
        ranges,
        max_running: limit,
    })
}

/// `--begin`, as sbatch takes it, in the local time zone of `now`: `now`, `now+N[unit]`
/// (seconds by default; units seconds, minutes, hours, days, weeks, or s, m, h, d, w),
/// `HH:MM[:SS]` (today, or tomorrow if that has passed), `YYYY-MM-DD[THH:MM[:SS]]`,
/// `midnight`, `noon`, `teatime` (16:00), `today`, `tomorrow`. Milliseconds since the epoch.
pub fn parse_begin(text: &str, now: &Zoned) -> anyhow::Result<u64> {
    let t = text.trim().to_ascii_lowercase();
    let at = if let Some(rest) = t.strip_prefix("now") {
        let rest = rest.trim();
        if rest.is_empty() {
            now.clone()
        } else {
            let offset = rest
                .strip_prefix('+')
                .with_context(|| format!("--begin {text:?}: after `now` comes +N[unit]"))?;
            let digits = offset.len()
                - offset
                    .trim_start_matches(|c: char| c.is_ascii_digit())
                    .len();
            let n: i64 = offset[..digits]
                .parse()
                .ok()
                .filter(|n| *n <= 100_000_000)
                .with_context(|| format!("--begin {text:?}: {offset:?} is not now+N[unit]"))?;
            let secs = match offset[digits..].trim() {
                "" | "s" | "sec" | "secs" | "second" | "seconds" => n,
                "m" | "min" | "mins" | "minute" | "minutes" => n * 60,
                "h" | "hour" | "hours" => n * 3600,
                "d" | "day" | "days" => n * 86_400,
                "w" | "week" | "weeks" => n * 7 * 86_400,
                unit => bail!(
                    "--begin {text:?}: unknown unit {unit:?} (seconds, minutes, hours, days, weeks)"
                ),
            };
            now.checked_add(secs.seconds())
                .with_context(|| format!("--begin {text:?} is out of range"))?
        }
    } else {
        let today = now.date();
        let at_time = |time: Time, date: Date| -> anyhow::Result<Zoned> {
            date.to_datetime(time)
                .to_zoned_datetime(now.time_zone().clone())
                .with_context(|| format!("--begin {text:?}"))
        };
        let next = |time: Time| -> anyhow::Result<Zoned> {
            let z = at_time(time, today)?;
            if z < *now {
                let tomorrow = today
                    .tomorrow()
                    .with_context(|| format!("--begin {text:?}"))?;
                return at_time(time, tomorrow);
            }
            Ok(z)
        };
        match t.as_str() {
            "midnight" => next(Time::midnight())?,
            "noon" => next(Time::constant(12, 0, 0, 0))?,
            "teatime" => next(Time::constant(16, 0, 0, 0))?,
            "today" => at_time(Time::midnight(), today)?,
            "tomorrow" => at_time(
                Time::midnight(),
                today
                    .tomorrow()
                    .with_context(|| format!("--begin {text:?}"))?,
            )?,
            _ if t.contains('-') => {
                let dt: DateTime = if t.contains('t') {
                    let with_seconds = if t.matches(':').count() == 1 {
                        format!("{t}:00")
                    } else {
                        t.clone()
                    };
                    with_seconds.parse().with_context(|| {
                        format!("--begin {text:?} is not YYYY-MM-DD[THH:MM[:SS]]")
                    })?
                } else {
                    let d: Date = t
                        .parse()
                        .with_context(|| format!("--begin {text:?} is not YYYY-MM-DD"))?;
                    d.to_datetime(Time::midnight())
                };
                dt.to_zoned_datetime(now.time_zone().clone())
                    .with_context(|| format!("--begin {text:?}"))?
            }
            _ if t.contains(':') => {
                let with_seconds = if t.matches(':').count() == 1 {
                    format!("{t}:00")
                } else {
                    t.clone()
                };
                let time: Time = with_seconds
                    .parse()
                    .with_context(|| format!("--begin {text:?} is not HH:MM[:SS]"))?;
                next(time)?
            }
            _ => bail!(
                "--begin {text:?}: give now+N[unit], HH:MM[:SS], YYYY-MM-DD[THH:MM[:SS]], \
                 midnight, noon, teatime, today or tomorrow"
            ),
        }
    };
    let ms = at.timestamp().as_millisecond();
    u64::try_from(ms).with_context(|| format!("--begin {text:?} is before 1970"))
}

/// A job as Slurm users name one: `41`, or `41_7` for index 7 of array 41.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobRef {
    pub id: u64,
    pub array_index: Option<u32>,
}

impl std::str::FromStr for JobRef {
    type Err = String;

    fn from_str(s: &str) -> Result<JobRef, String> {
        let bad = || format!("{s:?} is not a job id (41) or an array job (41_7)");
        let (id, index) = match s.split_once('_') {
            Some((id, index)) => (id, Some(index.parse::<u32>().map_err(|_| bad())?)),
            None => (s, None),
        };
        Ok(JobRef {
            id: id.parse().map_err(|_| bad())?,
            array_index: index,
        })
    }
}

impl std::fmt::Display for JobRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.array_index {
            Some(i) => write!(f, "{}_{i}", self.id),
            None => write!(f, "{}", self.id),
        }
    }
}

/// How a job's id prints: `41_7` for index 7 of array 41, else its id.
pub fn job_id_text(job: &pb::Job) -> String {
    match &job.array_task {
        Some(t) => format!("{}_{}", t.array_id, t.index),
        None => job.id.to_string(),
    }
}

/// The id of index `index` of the array whose first job is `head` (ids follow the indices in
/// ascending order), or why there is none.
pub fn array_member_id(head: &pb::Job, index: u32) -> anyhow::Result<u64> {
    let (Some(task), Some(array)) = (
        &head.array_task,
        head.spec.as_ref().and_then(|s| s.array.as_ref()),
    ) else {
        bail!("job {} is not a job array", head.id);
    };
    if task.array_id != head.id {
        bail!(
            "job {} is index {} of array {}: name it {}_{} or {}",
            head.id,
            task.index,
            task.array_id,
            task.array_id,
            task.index,
            head.id
        );
    }
    let spec = array_spec(array);
    let position = spec
        .indices()
        .binary_search(&index)
        .map_err(|_| anyhow::anyhow!("array {} has no index {index} ({})", head.id, spec.text()))?;
    Ok(head.id + position as u64)
}

/// An array as the state holds it (its indices and spelling are computed there).
pub use crate::api::convert::array_spec_from_proto as array_spec;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists_expand_ranges_with_their_padding() {
        assert_eq!(
            expand_hostlist("gpu[01-03,07]").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu07"]
        );
        assert_eq!(
            expand_hostlist("n[1-2]-g[8-9],login").unwrap(),
            ["login", "n1-g8", "n1-g9", "n2-g8", "n2-g9"]
        );
        assert_eq!(expand_hostlist("a,b,a").unwrap(), ["a", "b"]);
        assert_eq!(expand_hostlist("h[9-10]").unwrap(), ["h10", "h9"]);
        for bad in [
            "",
            "gpu[1-",
            "gpu]1",
            "gpu[3-1]",
            "gpu[a-b]",
            "g[[1]]",
            "x[0-99999]",
        ] {
            assert!(expand_hostlist(bad).is_err(), "{bad:?}");
        }
        let e = expand_hostlist("a[0-400],b[0-400],c[0-400]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("names more than"), "{e}");
        let ok = expand_hostlist("n[0000-1023]").unwrap();
        assert_eq!((ok.len(), ok[0].as_str()), (1024, "n0000"));
    }

    #[test]
    fn arrays_take_ranges_steps_lists_and_a_limit() {
        let a = parse_array("0-99%8").unwrap();
        assert_eq!(a.max_running, 8);
        assert_eq!(
            (a.ranges[0].first, a.ranges[0].last, a.ranges[0].step),
            (0, 99, 1)
        );
        let a = parse_array("1,3,10-20:5").unwrap();
        assert_eq!(a.ranges.len(), 3);
        assert_eq!(a.ranges[2].step, 5);
        for bad in ["", "5-1", "1-9:0", "a", "1%0", "1%x", "-3", "1-"] {
            assert!(parse_array(bad).is_err(), "{bad:?}");
        }
    }

    fn at(text: &str) -> Zoned {
        text.parse().unwrap()
    }

    #[test]
    fn begin_times_read_as_sbatch_reads_them() {
        let now = at("2026-12-06T10:30:00+00:00[UTC]");
        let ms = |z: &str| u64::try_from(at(z).timestamp().as_millisecond()).unwrap();
        assert_eq!(
            parse_begin("now", &now).unwrap(),
            ms("2026-12-06T10:30:00+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("now+90", &now).unwrap(),
            ms("2026-12-06T10:31:30+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("now+1hour", &now).unwrap(),
            ms("2026-12-06T11:30:00+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("NOW+2days", &now).unwrap(),
            ms("2026-12-08T10:30:00+00:00[UTC]")
        );
        // A time of day that has passed means tomorrow.
        assert_eq!(
            parse_begin("16:00", &now).unwrap(),
            ms("2026-12-06T16:00:00+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("09:15:30", &now).unwrap(),
            ms("2026-12-07T09:15:30+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("2026-12-24T08:00", &now).unwrap(),
            ms("2026-12-24T08:00:00+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("2027-01-01", &now).unwrap(),
            ms("2027-01-01T00:00:00+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("teatime", &now).unwrap(),
            ms("2026-12-06T16:00:00+00:00[UTC]")
        );
        assert_eq!(
            parse_begin("tomorrow", &now).unwrap(),
            ms("2026-12-07T00:00:00+00:00[UTC]")
        );
        for bad in [
            "later",
            "now-5",
            "now+5fortnights",
            "25:00",
            "2026-13-01",
            "now+",
        ] {
            assert!(parse_begin(bad, &now).is_err(), "{bad:?}");
        }
        let e = parse_begin("now+99999999999", &now)
            .unwrap_err()
            .to_string();
        assert!(e.contains("now+N"), "{e}");
    }

    #[test]
    fn job_refs_name_a_job_or_an_array_index() {
        assert_eq!(
            "41".parse::<JobRef>().unwrap(),
            JobRef {
                id: 41,
                array_index: None
            }
        );
        let r: JobRef = "41_7".parse().unwrap();
        assert_eq!(
            (r.id, r.array_index, r.to_string().as_str()),
            (41, Some(7), "41_7")
        );
        for bad in ["", "x", "41_", "_7", "41_7_1", "-1"] {
            assert!(bad.parse::<JobRef>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_array_index_names_the_job_at_its_position() {
        let head = pb::Job {
            id: 41,
            array_task: Some(pb::ArrayTask {
                array_id: 41,
                index: 0,
                count: 4,
            }),
            spec: Some(pb::JobSpec {
                array: Some(parse_array("0,10-30:10").unwrap()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(array_member_id(&head, 0).unwrap(), 41);
        assert_eq!(array_member_id(&head, 20).unwrap(), 43);
        let e = array_member_id(&head, 5).unwrap_err().to_string();
        assert!(e.contains("no index 5") && e.contains("0,10-30:10"), "{e}");
        let plain = pb::Job {
            id: 3,
            ..Default::default()
        };
        assert!(array_member_id(&plain, 0).is_err());
    }
}
