//! Progress bars for gpuctl's long operations (simulations, benchmarks, a restore, a rollout),
//! drawn on stderr with `indicatif`. Shown only to a person watching: both stdout and stderr
//! are terminals and the output is not machine-readable (`-o json`/`yaml`); otherwise every
//! bar is hidden and costs nothing, so piped and scripted output stays exactly as it was.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use super::output::Format;

/// Whether bars are drawn for output in `fmt`.
pub fn shown(fmt: Format) -> bool {
    visible(
        fmt,
        std::io::stdout().is_terminal(),
        std::io::stderr().is_terminal(),
    )
}

/// The rule itself, apart from the terminal checks.
fn visible(fmt: Format, stdout_tty: bool, stderr_tty: bool) -> bool {
    fmt.is_table() && stdout_tty && stderr_tty
}

/// A bar of `len` steps labelled `what` ("seeds", "runs", "nodes"); hidden unless `shown`.
pub fn bar(len: u64, what: &str, fmt: Format) -> ProgressBar {
    if !shown(fmt) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len).with_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed}, about {eta} left)",
        )
        .expect("the template is valid")
        .progress_chars("=> "),
    );
    bar.set_prefix(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// A spinner for a step of unknown length, labelled `what`; hidden unless `shown`.
pub fn spinner(what: &str, fmt: Format) -> ProgressBar {
    if !shown(fmt) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {prefix} {msg} ({elapsed})")
            .expect("the template is valid"),
    );
    bar.set_prefix(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_only_for_people_at_a_terminal() {
        assert!(visible(Format::Table, true, true));
        assert!(visible(Format::Wide, true, true));
        assert!(!visible(Format::Json, true, true));
        assert!(!visible(Format::Yaml, true, true));
        assert!(!visible(Format::Table, false, true));
        assert!(!visible(Format::Table, true, false));
    }

    #[test]
    fn hidden_bars_count_without_drawing() {
        // Tests never run with both streams on a terminal and JSON is never shown.
        let b = bar(3, "runs", Format::Json);
        assert!(b.is_hidden());
        b.inc(2);
        assert_eq!(b.position(), 2);
        assert!(spinner("restoring", Format::Json).is_hidden());
    }
}
