//! Loading the cluster traces of the FGD paper (Alibaba `cluster-trace-gpu-v2023`): a node
//! list (`sn,cpu_milli,memory_mib,gpu,model`) and a pod list (`name,cpu_milli,memory_mib,
//! num_gpu,gpu_milli,gpu_spec,...`). Plain comma-separated text with a header line; columns are
//! found by name, extra columns are ignored. Errors name the file, the line and the field.

use std::path::{Path, PathBuf};

use crate::scheduler::score::{Demand, FULL_GPU_MILLI};

/// One GPU node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceNode {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: u32,
    /// GPU model (empty for a node without GPUs).
    pub model: String,
}

/// One task of the pod list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracePod {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// 0 for a CPU-only task.
    pub num_gpu: u32,
    /// Milli per GPU: 1000 for whole GPUs, 1..=999 for a share of one GPU, 0 when CPU-only.
    pub gpu_milli: u32,
    /// Acceptable GPU models; empty: any.
    pub gpu_spec: Vec<String>,
}

impl TracePod {
    pub fn demand(&self) -> Demand<'_> {
        Demand {
            cpu_milli: self.cpu_milli,
            memory_mib: self.memory_mib,
            gpus: self.num_gpu,
            milli_per_gpu: self.gpu_milli,
            models: &self.gpu_spec,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: empty file (expected a header line naming the columns)", path.display())]
    Empty { path: PathBuf },
    #[error("{}:1: no `{column}` column in the header (columns: {header})", path.display())]
    MissingColumn {
        path: PathBuf,
        column: &'static str,
        header: String,
    },
    #[error("{}:{line}: field `{field}`: {reason}", path.display())]
    Field {
        path: PathBuf,
        line: usize,
        field: &'static str,
        reason: String,
    },
    #[error("{}: no data lines after the header", path.display())]
    NoRows { path: PathBuf },
}

/// Reads the node list.
pub fn load_nodes(path: &Path) -> Result<Vec<TraceNode>, TraceError> {
    parse_nodes(&read(path)?, path)
}

/// Reads the pod list.
pub fn load_pods(path: &Path) -> Result<Vec<TracePod>, TraceError> {
    parse_pods(&read(path)?, path)
}

fn read(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Parses a node list; `path` only names the source in errors.
pub fn parse_nodes(text: &str, path: &Path) -> Result<Vec<TraceNode>, TraceError> {
    let table = Table::parse(
        text,
        path,
        &["sn", "cpu_milli", "memory_mib", "gpu", "model"],
    )?;
    let mut nodes = Vec::new();
    for row in table.rows() {
        let gpus: u32 = row.number("gpu")?;
        let model = row.text("model").to_owned();
        if gpus > 0 && model.is_empty() {
            return Err(row.error("model", "empty, but the node has GPUs".into()));
        }
        nodes.push(TraceNode {
            name: row.text("sn").to_owned(),
            cpu_milli: row.number("cpu_milli")?,
            memory_mib: row.number("memory_mib")?,
            gpus,
            model,
        });
    }
    if nodes.is_empty() {
        return Err(TraceError::NoRows {
            path: path.to_owned(),
        });
    }
    Ok(nodes)
}

/// Parses a pod list; `path` only names the source in errors.
pub fn parse_pods(text: &str, path: &Path) -> Result<Vec<TracePod>, TraceError> {
    let table = Table::parse(
        text,
        path,
        &[
            "name",
            "cpu_milli",
            "memory_mib",
            "num_gpu",
            "gpu_milli",
            "gpu_spec",
        ],
    )?;
    let mut pods = Vec::new();
    for row in table.rows() {
        let num_gpu: u32 = row.number("num_gpu")?;
        let gpu_milli: u32 = row.number("gpu_milli")?;
        if num_gpu == 0 && gpu_milli != 0 {
            return Err(row.error(
                "gpu_milli",
                format!("{gpu_milli} for a task without GPUs (num_gpu 0)"),
            ));
        }
        if num_gpu > 0 && !(1..=FULL_GPU_MILLI).contains(&gpu_milli) {
            return Err(row.error(
                "gpu_milli",
                format!("{gpu_milli}, expected 1..=1000 milli per GPU"),
            ));
        }
        if num_gpu > 1 && gpu_milli != FULL_GPU_MILLI {
            return Err(row.error(
                "gpu_milli",
                format!("{gpu_milli} with num_gpu {num_gpu}: only a one-GPU task may take a share"),
            ));
        }
        let gpu_spec = row
            .text("gpu_spec")
            .split('|')
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .map(str::to_owned)
            .collect();
        pods.push(TracePod {
            name: row.text("name").to_owned(),
            cpu_milli: row.number("cpu_milli")?,
            memory_mib: row.number("memory_mib")?,
            num_gpu,
            gpu_milli,
            gpu_spec,
        });
    }
    if pods.is_empty() {
        return Err(TraceError::NoRows {
            path: path.to_owned(),
        });
    }
    Ok(pods)
}

/// A header-indexed CSV text.
struct Table {
    path: PathBuf,
    /// Column index of each wanted field, in the order asked.
    columns: Vec<(&'static str, usize)>,
    /// (1-based line number, fields) of each non-blank data line.
    lines: Vec<(usize, Vec<String>)>,
}

struct Row<'a> {
    table: &'a Table,
    line: usize,
    fields: &'a [String],
}

impl Table {
    fn parse(text: &str, path: &Path, wanted: &[&'static str]) -> Result<Table, TraceError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
            .filter(|(_, l)| !l.trim().is_empty());
        let Some((_, header)) = lines.next() else {
            return Err(TraceError::Empty {
                path: path.to_owned(),
            });
        };
        let names: Vec<String> = split_csv(header)
            .into_iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .collect();
        let mut columns = Vec::new();
        for &w in wanted {
            match names.iter().position(|n| n == w) {
                Some(i) => columns.push((w, i)),
                None => {
                    return Err(TraceError::MissingColumn {
                        path: path.to_owned(),
                        column: w,
                        header: names.join(","),
                    });
                }
            }
        }
        Ok(Table {
            path: path.to_owned(),
            columns,
            lines: lines.map(|(n, l)| (n, split_csv(l))).collect(),
        })
    }

    fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        self.lines.iter().map(|(line, fields)| Row {
            table: self,
            line: *line,
            fields,
        })
    }
}

impl Row<'_> {
    fn index(&self, field: &'static str) -> usize {
        self.table
            .columns
            .iter()
            .find(|(f, _)| *f == field)
            .map(|(_, i)| *i)
            .expect("field names come from the wanted list")
    }

    /// The field's text, trimmed; a missing trailing field reads as empty.
    fn text(&self, field: &'static str) -> &str {
        self.fields
            .get(self.index(field))
            .map(|s| s.trim())
            .unwrap_or("")
    }

    fn number<T: std::str::FromStr>(&self, field: &'static str) -> Result<T, TraceError> {
        let text = self.text(field);
        if text.is_empty() {
            return Err(self.error(field, "missing (expected a non-negative integer)".into()));
        }
        text.parse().map_err(|_| {
            self.error(
                field,
                format!("`{text}` is not a non-negative integer in range"),
            )
        })
    }

    fn error(&self, field: &'static str, reason: String) -> TraceError {
        TraceError::Field {
            path: self.table.path.clone(),
            line: self.line,
            field,
            reason,
        }
    }
}

/// Splits one CSV line: commas separate fields; double quotes may enclose a field (with `""`
/// for a quote inside).
fn split_csv(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    fields.push(cur);
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("pods.csv")
    }

    #[test]
    fn parses_the_trace_formats() {
        let nodes = parse_nodes(
            "sn,cpu_milli,memory_mib,gpu,model\nn-0,64000,262144,2,P100\r\n\nn-1,96000,786432,8,G2\n",
            Path::new("nodes.csv"),
        )
        .unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(
            nodes[1],
            TraceNode {
                name: "n-1".into(),
                cpu_milli: 96_000,
                memory_mib: 786_432,
                gpus: 8,
                model: "G2".into(),
            }
        );
        let pods = parse_pods(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase\n\
             a,12000,16384,1,1000,,LS,Running\n\
             b,6000,12288,1,460,\"V100M16|V100M32\",LS,Running\n\
             c,8000,30517,0,0,,BE,Failed\n\
             d,88000,327680,8,1000,G2,LS,Running\n",
            p(),
        )
        .unwrap();
        assert_eq!(pods.len(), 4);
        assert_eq!(pods[1].gpu_spec, vec!["V100M16", "V100M32"]);
        assert_eq!(pods[1].demand().milli_per_gpu, 460);
        assert!(pods[1].demand().is_share());
        assert!(!pods[2].demand().uses_gpu());
        assert_eq!(pods[3].demand().total_gpu_milli(), 8000);
    }

    #[test]
    fn columns_are_found_by_name() {
        let pods = parse_pods(
            "gpu_spec,num_gpu,gpu_milli,name,memory_mib,cpu_milli\nT4,1,500,x,100,2000\n",
            p(),
        )
        .unwrap();
        assert_eq!(pods[0].cpu_milli, 2000);
        assert_eq!(pods[0].gpu_spec, vec!["T4"]);
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n";
        let err = |body: &str| {
            parse_pods(&format!("{header}{body}"), p())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("a,1,1,0,0,\nb,12x,1,1,1000,\n"),
            "pods.csv:3: field `cpu_milli`: `12x` is not a non-negative integer in range"
        );
        assert_eq!(
            err("a,1,1,1,1500,\n"),
            "pods.csv:2: field `gpu_milli`: 1500, expected 1..=1000 milli per GPU"
        );
        assert_eq!(
            err("a,1,1,2,500,\n"),
            "pods.csv:2: field `gpu_milli`: 500 with num_gpu 2: only a one-GPU task may take a share"
        );
        assert_eq!(
            err("a,1,1,0,300,\n"),
            "pods.csv:2: field `gpu_milli`: 300 for a task without GPUs (num_gpu 0)"
        );
        assert_eq!(
            err("a,1,1,-1,0,\n"),
            "pods.csv:2: field `num_gpu`: `-1` is not a non-negative integer in range"
        );
        assert_eq!(
            err("a,1,1\n"),
            "pods.csv:2: field `num_gpu`: missing (expected a non-negative integer)"
        );
        assert_eq!(
            parse_pods("name,cpu_milli\n", p()).unwrap_err().to_string(),
            "pods.csv:1: no `memory_mib` column in the header (columns: name,cpu_milli)"
        );
        assert_eq!(
            parse_pods("", p()).unwrap_err().to_string(),
            "pods.csv: empty file (expected a header line naming the columns)"
        );
        assert_eq!(
            parse_pods(header, p()).unwrap_err().to_string(),
            "pods.csv: no data lines after the header"
        );
        assert_eq!(
            parse_nodes(
                "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,\n",
                Path::new("nodes.csv")
            )
            .unwrap_err()
            .to_string(),
            "nodes.csv:2: field `model`: empty, but the node has GPUs"
        );
        let missing = load_pods(Path::new("/nonexistent/pods.csv")).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("reading /nonexistent/pods.csv: "),
            "{missing}"
        );
    }

    #[test]
    fn csv_quotes() {
        assert_eq!(
            split_csv("a,\"b,c\",\"d\"\"e\","),
            vec!["a", "b,c", "d\"e", ""]
        );
    }
}
