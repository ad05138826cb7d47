//! Batch scripts as `sbatch` reads them: `#SBATCH` directives at the top of a script are
//! options of the submission, and the script itself is the job. Pure: text in, arguments
//! and a command out.
//!
//! - Directives are read from the lines after the shebang up to the first line that is
//!   neither a comment nor blank (sbatch stops there too); `#SBATCH` lines after it are
//!   ordinary comments. Each directive's words are split as a shell would split them
//!   (quotes honoured), so `#SBATCH --job-name="my run"` is one value.
//! - Options given on the command line override the script's (sbatch's rule): the caller
//!   puts the directives *before* its own arguments when parsing.
//! - The job runs the script's text through its interpreter (the shebang, else `/bin/sh`)
//!   with `-c`, so the GPU hosts need not share the submitter's filesystem: the job carries
//!   the script, as sbatch copies it.
//! - In directives, `-o`/`--output` and `-e`/`--error` are sbatch's output files; on the
//!   command line `-o` stays gpuctl's output format (so `-o json` keeps working) and the
//!   files are `--stdout`/`--stderr`.

use anyhow::{Context, bail};

/// What a batch script contributes to a submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchScript {
    /// Directive words, rewritten into gpuctl's flags (see [`rewrite`]).
    pub args: Vec<String>,
    /// The job's command: interpreter, `-c`, the script's text, its name (`$0`), its
    /// arguments.
    pub command: Vec<String>,
}

/// Reads `text` (the script at `name`, run with `script_args`).
pub fn parse(name: &str, text: &str, script_args: &[String]) -> anyhow::Result<BatchScript> {
    let mut lines = text.lines();
    let mut interpreter = vec!["/bin/sh".to_owned()];
    let mut args = Vec::new();
    let mut first = true;
    for (number, line) in (1..).zip(lines.by_ref()) {
        if first && let Some(shebang) = line.strip_prefix("#!") {
            first = false;
            let words: Vec<String> = shebang.split_whitespace().map(str::to_owned).collect();
            if words.is_empty() {
                bail!("{name}:1: the #! line names no interpreter");
            }
            interpreter = words;
            continue;
        }
        first = false;
        let trimmed = line.trim_start();
        if let Some(directive) = trimmed.strip_prefix("#SBATCH") {
            // A comment after the options (`#SBATCH -G 2 # two GPUs`) is not an option.
            let directive = directive.split(" #").next().unwrap_or_default();
            let words =
                shell_words(directive).with_context(|| format!("{name}:{number}: {line}"))?;
            args.extend(rewrite(words));
            continue;
        }
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        break;
    }
    let mut command = interpreter;
    command.push("-c".into());
    command.push(text.to_owned());
    command.push(name.to_owned());
    command.extend(script_args.iter().cloned());
    Ok(BatchScript { args, command })
}

/// sbatch's spellings that differ from gpuctl's, rewritten: `-o`/`--output` and
/// `-e`/`--error` (output files) become `--stdout`/`--stderr`; `--gres=gpu:...` and
/// `--gpus-per-node` keep their names (gpuctl reads them). Words are `--opt=value` or
/// `--opt value` or `-x value`.
pub fn rewrite(words: Vec<String>) -> Vec<String> {
    let mut out = Vec::with_capacity(words.len());
    for word in words {
        let (flag, value) = match word.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (word.clone(), None),
        };
        let renamed = match flag.as_str() {
            "-o" | "--output" => Some("--stdout"),
            "-e" | "--error" => Some("--stderr"),
            _ => None,
        };
        match (renamed, value) {
            (Some(r), Some(v)) => out.push(format!("{r}={v}")),
            (Some(r), None) => out.push(r.to_owned()),
            (None, _) => out.push(word),
        }
    }
    out
}

/// Splits `text` into words as a POSIX shell would for plain words: whitespace separates,
/// single quotes keep everything, double quotes keep everything but `\"` and `\\`, a
/// backslash outside quotes escapes the next character. No expansions.
pub fn shell_words(text: &str) -> anyhow::Result<Vec<String>> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => bail!("a single quote is not closed"),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => word.push(c),
                            Some(c) => {
                                word.push('\\');
                                word.push(c);
                            }
                            None => bail!("a double quote is not closed"),
                        },
                        Some(c) => word.push(c),
                        None => bail!("a double quote is not closed"),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(c) = chars.next() {
                    word.push(c);
                }
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        words.push(word);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn directives_at_the_top_become_options_and_the_script_is_the_job() {
        let text = "#!/bin/bash\n\
                    # a comment\n\
                    #SBATCH --job-name=\"my run\" -G 2\n\
                    \n\
                    #SBATCH --time=1:00:00 # an hour\n\
                    #SBATCH -o run-%j.out --error=run-%j.err\n\
                    echo hello\n\
                    #SBATCH --gpus 8\n";
        let s = parse("train.sh", text, &strings(&["--lr", "0.1"])).unwrap();
        assert_eq!(
            s.args,
            strings(&[
                "--job-name=my run",
                "-G",
                "2",
                "--time=1:00:00",
                "--stdout",
                "run-%j.out",
                "--stderr=run-%j.err"
            ]),
            "directives after the first command are comments"
        );
        assert_eq!(
            s.command,
            strings(&["/bin/bash", "-c", text, "train.sh", "--lr", "0.1"])
        );
    }

    #[test]
    fn a_script_without_shebang_runs_in_sh_and_env_shebangs_keep_their_words() {
        let s = parse("x", "echo hi\n", &[]).unwrap();
        assert_eq!(s.command[..2], strings(&["/bin/sh", "-c"]));
        assert!(s.args.is_empty());
        let s = parse("x", "#!/usr/bin/env python3\nprint(1)\n", &[]).unwrap();
        assert_eq!(s.command[..3], strings(&["/usr/bin/env", "python3", "-c"]));
        assert!(parse("x", "#!\necho\n", &[]).is_err());
    }

    #[test]
    fn a_directive_with_an_unclosed_quote_names_its_line() {
        let e = parse("job.sh", "#!/bin/sh\n#SBATCH -J 'oops\n", &[]).unwrap_err();
        assert!(format!("{e:#}").contains("job.sh:2"), "{e:#}");
    }

    #[test]
    fn words_split_as_a_shell_splits_plain_words() {
        assert_eq!(
            shell_words(r#"a 'b c' "d \"e\" \\ \x" f\ g"#).unwrap(),
            strings(&["a", "b c", r#"d "e" \ \x"#, "f g"])
        );
        assert_eq!(shell_words("  ").unwrap(), Vec::<String>::new());
        assert_eq!(shell_words("''").unwrap(), strings(&[""]));
        assert!(shell_words("\"x").is_err());
    }

    #[test]
    fn sbatch_output_flags_become_gpuctls_stdout_and_stderr() {
        assert_eq!(
            rewrite(strings(&[
                "-o",
                "a.out",
                "--output=b.out",
                "-e",
                "c",
                "--error=d",
                "-G",
                "1"
            ])),
            strings(&[
                "--stdout",
                "a.out",
                "--stdout=b.out",
                "--stderr",
                "c",
                "--stderr=d",
                "-G",
                "1"
            ])
        );
    }
}
