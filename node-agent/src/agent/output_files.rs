//! A job's output files (sbatch's `-o`/`-e`), named by pattern: `%j` the job id, `%t` the
//! task, `%N` the node, `%x` the job name, `%A` the array's id and `%a` the job's index in it
//! (outside an array: the job's own id, and nothing), `%%` a `%`; any other `%` sequence is kept as
//! written (sbatch's unknown ones are too). A relative name is relative to the job's working
//! directory. Pure.

use std::path::{Path, PathBuf};

/// What the patterns of one task expand to.
pub struct TaskNames<'a> {
    pub job: u64,
    pub task: u32,
    pub node: &'a str,
    pub job_name: &'a str,
    /// For a job of an array: the array's id and this job's index.
    pub array: Option<(u64, u32)>,
}

pub fn expand(pattern: &str, names: &TaskNames<'_>, workdir: Option<&Path>) -> PathBuf {
    let mut out = String::with_capacity(pattern.len());
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.peek().copied() {
            Some('j') => out.push_str(&names.job.to_string()),
            Some('t') => out.push_str(&names.task.to_string()),
            Some('N') => out.push_str(names.node),
            // A name may hold '/': it must not reach another directory.
            Some('x') => out.push_str(&names.job_name.replace('/', "_")),
            Some('A') => out.push_str(&names.array.map_or(names.job, |(a, _)| a).to_string()),
            Some('a') => {
                if let Some((_, index)) = names.array {
                    out.push_str(&index.to_string());
                }
            }
            Some('%') => out.push('%'),
            _ => {
                out.push('%');
                continue;
            }
        }
        chars.next();
    }
    let path = PathBuf::from(out);
    match workdir {
        Some(dir) if path.is_relative() => dir.join(path),
        _ => path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: TaskNames<'static> = TaskNames {
        job: 42,
        task: 3,
        node: "gpu-7",
        job_name: "train/v2",
        array: None,
    };

    #[test]
    fn patterns_expand_to_the_tasks_names() {
        assert_eq!(
            expand("/out/%x-%j.%t.%N.log", &NAMES, None),
            PathBuf::from("/out/train_v2-42.3.gpu-7.log")
        );
        assert_eq!(
            expand("100%%-%q-%", &NAMES, None),
            PathBuf::from("100%-%q-%")
        );
    }

    #[test]
    fn array_jobs_name_their_array_and_index() {
        let names = TaskNames {
            job: 45,
            array: Some((41, 12)),
            ..NAMES
        };
        assert_eq!(
            expand("out-%A_%a.%j.log", &names, None),
            PathBuf::from("out-41_12.45.log")
        );
        assert_eq!(expand("out-%A_%a", &NAMES, None), PathBuf::from("out-42_"));
    }

    #[test]
    fn a_relative_name_is_in_the_working_directory() {
        assert_eq!(
            expand("slurm-%j.out", &NAMES, Some(Path::new("/home/u/run"))),
            PathBuf::from("/home/u/run/slurm-42.out")
        );
        assert_eq!(
            expand("slurm-%j.out", &NAMES, None),
            PathBuf::from("slurm-42.out")
        );
    }
}
