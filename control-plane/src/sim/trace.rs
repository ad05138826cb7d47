//! Loading the cluster traces of the FGD paper (Alibaba `cluster-trace-gpu-v2023`): a node
//! list (`sn,cpu_milli,memory_mib,gpu,model`) and a pod list (`name,cpu_milli,memory_mib,
//! num_gpu,gpu_milli[,gpu_spec],...`). CSV with a header line (`csv_table`); columns are found
//! by name, extra columns are ignored. Errors name the file, the line and the field.

use std::path::{Path, PathBuf};

use super::csv_table::{CsvError, CsvRow, CsvTable};
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
    #[error("{}:{line}: {reason}", path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        reason: String,
    },
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

/// GPU models that some task of `pods` names in its `gpu_spec` and no node of `nodes` has,
/// with how many tasks name each: those tasks can never be placed (a typo, or a node list and
/// pod list from different clusters).
pub fn unknown_models(nodes: &[TraceNode], pods: &[TracePod]) -> Vec<(String, usize)> {
    let known: std::collections::BTreeSet<&str> = nodes
        .iter()
        .filter(|n| n.gpus > 0)
        .map(|n| n.model.as_str())
        .collect();
    let mut unknown = std::collections::BTreeMap::<String, usize>::new();
    for p in pods {
        for m in &p.gpu_spec {
            if !known.contains(m.as_str()) {
                *unknown.entry(m.clone()).or_default() += 1;
            }
        }
    }
    unknown.into_iter().collect()
}

/// Parses a node list; `path` only names the source in errors.
pub fn parse_nodes(text: &str, path: &Path) -> Result<Vec<TraceNode>, TraceError> {
    let table = Table::parse(
        text,
        path,
        &["sn", "cpu_milli", "memory_mib", "gpu", "model"],
        &[],
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
        &["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"],
        // Some pod lists have no model constraints at all.
        &["gpu_spec"],
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

/// A trace file's table with the columns a list needs located.
struct Table {
    csv: CsvTable,
    /// Column index of each wanted field (`None`: an optional column the file lacks).
    columns: Vec<(&'static str, Option<usize>)>,
}

struct Row<'a> {
    table: &'a Table,
    row: &'a CsvRow,
}

impl Table {
    /// `wanted` columns must be in the header; `optional` ones may be.
    fn parse(
        text: &str,
        path: &Path,
        wanted: &[&'static str],
        optional: &[&'static str],
    ) -> Result<Table, TraceError> {
        let csv = CsvTable::parse(text, path).map_err(TraceError::from)?;
        let mut columns = Vec::new();
        for &w in wanted {
            match csv.column(w) {
                Some(i) => columns.push((w, Some(i))),
                None => {
                    return Err(TraceError::MissingColumn {
                        path: path.to_owned(),
                        column: w,
                        header: csv.header.join(","),
                    });
                }
            }
        }
        for &o in optional {
            columns.push((o, csv.column(o)));
        }
        Ok(Table { csv, columns })
    }

    fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        self.csv.rows.iter().map(|row| Row { table: self, row })
    }
}

impl Row<'_> {
    fn index(&self, field: &'static str) -> Option<usize> {
        self.table
            .columns
            .iter()
            .find(|(f, _)| *f == field)
            .expect("field names come from the wanted list")
            .1
    }

    /// The field's text; a missing trailing field or optional column reads as empty.
    fn text(&self, field: &'static str) -> &str {
        self.index(field).map_or("", |i| self.row.field(i))
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
            path: self.table.csv.path.clone(),
            line: self.row.line as usize,
            field,
            reason,
        }
    }
}

impl From<CsvError> for TraceError {
    fn from(e: CsvError) -> TraceError {
        match e {
            CsvError::Io { path, source } => TraceError::Io { path, source },
            CsvError::Empty { path } => TraceError::Empty { path },
            CsvError::Syntax { path, line, reason } => TraceError::Syntax {
                path,
                line: line as usize,
                reason,
            },
        }
    }
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

    /// The copy of the public trace in `tests/traces/` (what README.md's commands use).
    #[test]
    fn the_public_trace_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/traces");
        let nodes = load_nodes(&dir.join("openb_node_list_gpu_node.csv")).unwrap();
        let pods = load_pods(&dir.join("openb_pod_list_default.csv")).unwrap();
        assert_eq!(nodes.len(), 1213);
        assert_eq!(nodes.iter().map(|n| u64::from(n.gpus)).sum::<u64>(), 6212);
        assert_eq!(pods.len(), 8152);
        assert!(pods.iter().any(|p| p.demand().is_share()));
        assert_eq!(unknown_models(&nodes, &pods), vec![]);
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
    fn gpu_spec_is_optional_and_unknown_models_are_found() {
        let pods = parse_pods(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nx,1000,100,1,500\n",
            p(),
        )
        .unwrap();
        assert!(pods[0].gpu_spec.is_empty());
        let nodes = parse_nodes(
            "sn,cpu_milli,memory_mib,gpu,model\nn,1000,1000,1,T4\nc,1000,1000,0,\n",
            Path::new("nodes.csv"),
        )
        .unwrap();
        let pods = parse_pods(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
             a,1,1,1,1000,T4|A100\nb,1,1,1,1000,A100\nc,1,1,1,1000,T4\nd,1,1,1,1000,\n",
            p(),
        )
        .unwrap();
        assert_eq!(unknown_models(&nodes, &pods), vec![("A100".to_owned(), 2)]);
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
}
