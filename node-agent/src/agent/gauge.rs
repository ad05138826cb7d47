//! Finds one gauge in a page of Prometheus' text exposition format (what an autoscaled
//! replica serves on its metrics path) and sums its series over their label sets. Pure.
//!
//! Hand-written rather than a crate: the one small parser on crates.io
//! (`prometheus-parse`) reads names with `\w+` (so `:` in a recording-rule style name, which
//! the control plane accepts, is never found) and cuts label sets at the first `}` or `,`
//! even inside a quoted value; a full OpenMetrics parser is far more than one gauge needs.
//! The grammar read here is the format's own (prometheus.io, "Exposition formats"):
//!
//! ```text
//! # HELP / # TYPE / any other comment      (skipped)
//! name{label="value",...} value [timestamp]
//! ```
//!
//! Names are `[a-zA-Z_:][a-zA-Z0-9_:]*`; label values are quoted with `\\`, `\"` and `\n`
//! escapes; values are Go floats (`NaN`, `+Inf`, `-Inf`, exponents). OpenMetrics pages read
//! the same (their `# EOF` is a comment). A line of another metric that does not parse is
//! skipped, as Prometheus' own tolerant readers do; a broken line of the gauge sought is an
//! error, since summing the rest would report a wrong value.

/// Most bytes of a metrics page the agent reads (a page larger than this is an error).
pub const MAX_PAGE_BYTES: usize = 4 << 20;

/// The sum of every series of `metric` in `page`. Errors say what is wrong in words a
/// service's owner can act on: the gauge missing, a series that is NaN or infinite, a line
/// of it that does not parse.
pub fn sum_gauge(page: &str, metric: &str) -> Result<f64, String> {
    let mut sum = 0.0;
    let mut series = 0usize;
    for (n, raw) in page.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(line.len());
        if &line[..name_end] != metric {
            continue;
        }
        let value = sample_value(&line[name_end..])
            .map_err(|why| format!("line {} of the metrics page: {why}: {raw:?}", n + 1))?;
        if !value.is_finite() {
            return Err(format!(
                "{metric} is {value} on line {} of the metrics page",
                n + 1
            ));
        }
        sum += value;
        series += 1;
    }
    if series == 0 {
        return Err(format!("the metrics page has no {metric}"));
    }
    Ok(sum)
}

/// The value of a sample line, given what follows its name: an optional label set, the
/// value, an optional timestamp.
fn sample_value(rest: &str) -> Result<f64, String> {
    let rest = match rest.strip_prefix('{') {
        Some(labels) => skip_labels(labels)?,
        None => rest,
    };
    if !rest.starts_with([' ', '\t']) {
        return Err("no space before the value".into());
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    if let Some(ts) = fields.next()
        && ts.parse::<i64>().is_err()
    {
        return Err(format!("{ts:?} is not a timestamp"));
    }
    if fields.next().is_some() {
        return Err("more than a value and a timestamp".into());
    }
    parse_value(value)
}

/// What follows a label set whose `{` has been read: checks `name="value"` pairs (escapes
/// included) up to the closing `}`.
fn skip_labels(s: &str) -> Result<&str, String> {
    let mut chars = s.char_indices().peekable();
    loop {
        // A label name, or the end of the set (also after a trailing comma).
        while chars.next_if(|(_, c)| *c == ' ').is_some() {}
        match chars.next() {
            Some((i, '}')) => return Ok(&s[i + 1..]),
            Some((_, c)) if c.is_ascii_alphabetic() || c == '_' => {}
            _ => return Err("a label set is not name=\"value\" pairs".into()),
        }
        while chars
            .next_if(|(_, c)| c.is_ascii_alphanumeric() || *c == '_')
            .is_some()
        {}
        while chars.next_if(|(_, c)| *c == ' ').is_some() {}
        if chars.next().map(|(_, c)| c) != Some('=') {
            return Err("a label has no '='".into());
        }
        while chars.next_if(|(_, c)| *c == ' ').is_some() {}
        if chars.next().map(|(_, c)| c) != Some('"') {
            return Err("a label's value is not quoted".into());
        }
        loop {
            match chars.next() {
                Some((_, '"')) => break,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\' | '"' | 'n')) => {}
                    _ => return Err("a label's value has a bad escape".into()),
                },
                Some(_) => {}
                None => return Err("a label's value is not closed".into()),
            }
        }
        while chars.next_if(|(_, c)| *c == ' ').is_some() {}
        match chars.peek() {
            Some((_, ',')) => {
                chars.next();
            }
            Some((_, '}')) => {}
            _ => return Err("labels are not separated by ','".into()),
        }
    }
}

/// A value as Go's `strconv.ParseFloat` writes it: Rust's float syntax, except that Go
/// spells infinity `+Inf`/`-Inf` and Rust reads `inf`/`NaN` case-insensitively already.
fn parse_value(v: &str) -> Result<f64, String> {
    v.parse::<f64>()
        .map_err(|_| format!("{v:?} is not a number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP queue_length Requests waiting.
# TYPE queue_length gauge
queue_length{model="a",path="/v1/{x},y"} 3
queue_length{model="b\"quoted\\",} 4.5 1712345678000
queue_length_total 100
other_metric{x="1"} 7
queue_length2 9
job:queue_length:sum 12
"#;

    #[test]
    fn series_of_the_gauge_are_summed_over_their_labels() {
        assert_eq!(sum_gauge(PAGE, "queue_length"), Ok(7.5));
        // Names that only start with it are other metrics.
        assert_eq!(sum_gauge(PAGE, "queue_length_total"), Ok(100.0));
        assert_eq!(sum_gauge(PAGE, "queue_length2"), Ok(9.0));
        // ':' belongs to names (recording rules).
        assert_eq!(sum_gauge(PAGE, "job:queue_length:sum"), Ok(12.0));
    }

    #[test]
    fn an_unlabelled_gauge_comments_blank_lines_and_an_openmetrics_end_are_read() {
        let page = "\n# a comment\n  inflight 2\n\n# EOF\n";
        assert_eq!(sum_gauge(page, "inflight"), Ok(2.0));
        assert_eq!(sum_gauge("x{} 1e3\nx -2.5e-1", "x"), Ok(999.75));
        assert_eq!(sum_gauge("x\t4", "x"), Ok(4.0), "tabs separate too");
    }

    #[test]
    fn a_missing_gauge_is_an_error_that_names_it() {
        let e = sum_gauge(PAGE, "gpu_busy").unwrap_err();
        assert_eq!(e, "the metrics page has no gpu_busy");
        assert!(sum_gauge("", "x").is_err());
        assert!(
            sum_gauge("# TYPE x gauge\n", "x").is_err(),
            "a TYPE line is no sample"
        );
    }

    #[test]
    fn nan_and_infinite_values_are_errors_not_numbers() {
        for (page, shown) in [
            ("x{a=\"1\"} 1\nx{a=\"2\"} NaN\n", "NaN"),
            ("x +Inf\n", "inf"),
            ("x -Inf\n", "-inf"),
        ] {
            let e = sum_gauge(page, "x").unwrap_err();
            assert!(e.starts_with(&format!("x is {shown}")), "{e}");
        }
    }

    #[test]
    fn a_broken_line_of_the_gauge_is_an_error_and_of_another_metric_is_skipped() {
        for bad in [
            "x{a=\"1\" 3",
            "x{a=1} 3",
            "x{a=\"1} 3",
            "x{a=\"\\q\"} 3",
            "x{=\"1\"} 3",
            "x{a=\"1\"}3",
            "x",
            "x three",
            "x 3 not-a-time",
            "x 3 1 2",
        ] {
            let e = sum_gauge(bad, "x").unwrap_err();
            assert!(e.starts_with("line 1 of the metrics page"), "{bad}: {e}");
        }
        assert_eq!(sum_gauge("y{broken 3\nx 1", "x"), Ok(1.0));
    }
}
