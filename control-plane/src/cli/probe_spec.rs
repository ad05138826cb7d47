//! A service's readiness and liveness probes as `gpuctl service create/update` spells them,
//! and back: `http:PORT[:/PATH]` (a GET on a named port), `tcp:PORT` (a connection is
//! accepted), `exec:COMMAND` (run through `/bin/sh -c`, exits 0), `none` (no probe; for
//! `update`, removes one). The timings (`--probe-period` ...) are flags of their own and
//! apply to every probe given on the command line; manifests give them per probe.

use anyhow::bail;
use proto::v1 as pb;

use super::output::printable;

/// What `--readiness`/`--liveness` asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum ProbeArg {
    /// `none`: no probe.
    Remove,
    Check(pb::service_probe::Check),
}

/// The forms, for error messages.
const FORMS: &str =
    "http:PORT[:/PATH], tcp:PORT, exec:COMMAND or none (PORT is one of --port's names)";

/// Parses one `--readiness`/`--liveness` value.
pub fn parse_probe(text: &str) -> anyhow::Result<ProbeArg> {
    use pb::service_probe::Check;
    if text.trim() == "none" {
        return Ok(ProbeArg::Remove);
    }
    let Some((kind, rest)) = text.split_once(':') else {
        bail!("probe {:?} is not {FORMS}", printable(text));
    };
    let check = match kind.trim() {
        "https" => {
            bail!(
                "probe {:?}: probes speak plain HTTP to the replica on its own host; write http:PORT:/PATH",
                printable(text)
            )
        }
        "http" => {
            let (port, path) = match rest.split_once(':') {
                Some((port, path)) => (port, path),
                None => (rest, "/"),
            };
            if port.is_empty() {
                bail!("probe {:?} names no port: http:PORT:/PATH", printable(text));
            }
            if !path.starts_with('/') {
                bail!(
                    "probe {:?}: the path {:?} must start with / (http:PORT:/healthz)",
                    printable(text),
                    printable(path)
                );
            }
            Check::Http(pb::HttpProbe {
                port: port.to_owned(),
                path: path.to_owned(),
            })
        }
        "tcp" => {
            if rest.is_empty() || rest.contains(':') {
                bail!("probe {:?} is not tcp:PORT", printable(text));
            }
            Check::TcpPort(rest.to_owned())
        }
        "exec" => {
            if rest.trim().is_empty() {
                bail!("probe {:?} has no command: exec:COMMAND", printable(text));
            }
            Check::Exec(pb::ExecProbe {
                command: vec!["/bin/sh".into(), "-c".into(), rest.to_owned()],
            })
        }
        other => bail!(
            "probe {:?}: {:?} is not a kind of probe; write {FORMS}",
            printable(text),
            printable(other)
        ),
    };
    Ok(ProbeArg::Check(check))
}

/// A probe's check as it would be typed (`http:http:/ready`, `tcp:grpc`, `exec:test -f x`);
/// an exec probe that is not a `/bin/sh -c` line shows its words, quoted where needed.
pub fn check_text(check: Option<&pb::service_probe::Check>) -> String {
    use pb::service_probe::Check;
    match check {
        None => "-".into(),
        Some(Check::Http(h)) => format!("http:{}:{}", h.port, h.path),
        Some(Check::TcpPort(p)) => format!("tcp:{p}"),
        Some(Check::Exec(e)) => match e.command.as_slice() {
            [sh, c, line] if (sh == "/bin/sh" || sh == "sh") && c == "-c" => format!("exec:{line}"),
            words => format!("exec:{}", shell_words(words)),
        },
    }
}

/// A probe in full, for `describe`: its check and timings.
pub fn probe_text(p: Option<&pb::ServiceProbe>) -> String {
    let Some(p) = p else {
        return "-".into();
    };
    printable(&format!(
        "{} (period {}, timeout {}, initial delay {}, {} failure(s) to fail, {} success(es) to pass)",
        check_text(p.check.as_ref()),
        millis_text(p.period_ms),
        millis_text(p.timeout_ms),
        millis_text(p.initial_delay_ms),
        p.failure_threshold,
        p.success_threshold
    ))
}

/// Milliseconds as a short duration: `500ms`, `1s`, `1m 30s`, `10m`, `0s`.
pub fn millis_text(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    humantime::format_duration(std::time::Duration::from_millis(ms)).to_string()
}

/// Words as a shell would read them back: those with spaces or quotes are single-quoted.
pub fn shell_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            if !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::service_probe::Check;

    fn check(text: &str) -> Check {
        match parse_probe(text).unwrap() {
            ProbeArg::Check(c) => c,
            ProbeArg::Remove => panic!("{text}: removed"),
        }
    }

    #[test]
    fn each_form_parses_and_prints_back_as_typed() {
        for text in [
            "http:http:/ready",
            "http:metrics:/a/b?x=1",
            "tcp:grpc",
            "exec:test -f /tmp/ready && echo ok",
        ] {
            let c = check(text);
            assert_eq!(check_text(Some(&c)), text);
        }
        assert_eq!(
            check("http:http"),
            Check::Http(pb::HttpProbe {
                port: "http".into(),
                path: "/".into()
            })
        );
        assert_eq!(
            check("exec:true"),
            Check::Exec(pb::ExecProbe {
                command: vec!["/bin/sh".into(), "-c".into(), "true".into()]
            })
        );
        assert_eq!(parse_probe("none").unwrap(), ProbeArg::Remove);
    }

    #[test]
    fn bad_probes_are_refused_with_the_forms() {
        for (text, says) in [
            ("http", "is not http:PORT"),
            ("ftp:x", "not a kind of probe"),
            ("http::/ready", "names no port"),
            ("http:web:ready", "must start with /"),
            ("tcp:", "is not tcp:PORT"),
            ("tcp:a:b", "is not tcp:PORT"),
            ("exec:  ", "has no command"),
            ("https:web:/", "plain HTTP"),
        ] {
            let e = parse_probe(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn hostile_text_is_escaped_in_errors_and_descriptions() {
        let e = parse_probe("ftp\u{1b}[2J:x").unwrap_err().to_string();
        assert!(!e.contains('\u{1b}'), "{e}");
        let p = pb::ServiceProbe {
            check: Some(Check::Exec(pb::ExecProbe {
                command: vec!["/bin/sh".into(), "-c".into(), "x\n\u{1b}[31mred".into()],
            })),
            period_ms: 1500,
            timeout_ms: 1000,
            failure_threshold: 3,
            success_threshold: 1,
            ..Default::default()
        };
        let t = probe_text(Some(&p));
        assert!(!t.contains('\u{1b}') && !t.contains('\n'), "{t}");
        assert!(t.contains("period 1s 500ms"), "{t}");
        let words = pb::ServiceProbe {
            check: Some(Check::Exec(pb::ExecProbe {
                command: vec!["pg_isready".into(), "-d".into(), "my db".into()],
            })),
            ..Default::default()
        };
        assert_eq!(
            check_text(words.check.as_ref()),
            "exec:pg_isready -d 'my db'"
        );
    }
}
