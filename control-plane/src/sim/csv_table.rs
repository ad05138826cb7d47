//! A header-indexed CSV table on the `csv` crate, for the trace files: columns are found by
//! name (case-insensitive, trimmed; extra columns are ignored), fields are trimmed, blank lines
//! are skipped, a UTF-8 byte-order mark is dropped, and every row keeps the line it started on,
//! so an error can name `FILE:LINE` and the field.

use std::path::{Path, PathBuf};

/// Why a table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CsvError {
    #[error("reading {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: empty file (expected a header line naming the columns)", path.display())]
    Empty { path: PathBuf },
    #[error("{}:{line}: {reason}", path.display())]
    Syntax {
        path: PathBuf,
        line: u64,
        reason: String,
    },
}

/// A parsed table: the lower-cased header names, and each non-blank data row with its line.
pub struct CsvTable {
    pub path: PathBuf,
    pub header: Vec<String>,
    pub rows: Vec<CsvRow>,
}

/// One data row: its 1-based line number and its trimmed fields (a short row has fewer).
pub struct CsvRow {
    pub line: u64,
    pub fields: Vec<String>,
}

impl CsvTable {
    /// Reads `path` whole.
    pub fn read(path: &Path) -> Result<CsvTable, CsvError> {
        let text = std::fs::read_to_string(path).map_err(|source| CsvError::Io {
            path: path.to_owned(),
            source,
        })?;
        CsvTable::parse(&text, path)
    }

    /// Parses `text`; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<CsvTable, CsvError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            // Rows may be short (a missing trailing field reads as empty) or long.
            .flexible(true)
            .trim(csv::Trim::All)
            .from_reader(text.as_bytes());
        // The reader's positions count a record from the end of the one before it (blank lines
        // included), so a record's line is found from its first byte.
        let bytes = text.as_bytes();
        let newlines: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] == b'\n').collect();
        let line_at = |pos: Option<&csv::Position>| -> u64 {
            let mut at = pos.map_or(0, |p| p.byte() as usize).min(bytes.len());
            while at < bytes.len() && matches!(bytes[at], b'\r' | b'\n') {
                at += 1;
            }
            newlines.partition_point(|&n| n < at) as u64 + 1
        };
        let mut records = Vec::new();
        for record in reader.records() {
            let record = record.map_err(|e| CsvError::Syntax {
                path: path.to_owned(),
                line: line_at(e.position()),
                reason: match e.kind() {
                    csv::ErrorKind::Utf8 { err, .. } => format!("not UTF-8: {err}"),
                    _ => e.to_string(),
                },
            })?;
            if record.iter().all(str::is_empty) {
                continue;
            }
            let line = line_at(record.position());
            records.push(CsvRow {
                line,
                fields: record.iter().map(str::to_owned).collect(),
            });
        }
        let mut rows = records.into_iter();
        let Some(header) = rows.next() else {
            return Err(CsvError::Empty {
                path: path.to_owned(),
            });
        };
        Ok(CsvTable {
            path: path.to_owned(),
            header: header
                .fields
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
            rows: rows.collect(),
        })
    }

    /// Index of column `name`, if the header has it.
    pub fn column(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }
}

impl CsvRow {
    /// Field `index`; a missing trailing field reads as empty.
    pub fn field(&self, index: usize) -> &str {
        self.fields.get(index).map_or("", String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> CsvTable {
        CsvTable::parse(text, Path::new("t.csv")).unwrap()
    }

    #[test]
    fn quotes_bom_blank_lines_and_line_numbers() {
        let t = parse("\u{feff}\"A\", b ,C\r\n\n x ,\"y,z\",\"q\"\"r\"\n\n3\n");
        assert_eq!(t.header, vec!["a", "b", "c"]);
        assert_eq!(t.column("c"), Some(2));
        assert_eq!(t.column("d"), None);
        assert_eq!(t.rows.len(), 2);
        assert_eq!(t.rows[0].line, 3);
        assert_eq!(t.rows[0].fields, vec!["x", "y,z", "q\"r"]);
        assert_eq!(t.rows[1].line, 5);
        assert_eq!((t.rows[1].field(0), t.rows[1].field(2)), ("3", ""));
    }

    #[test]
    fn errors_name_the_file() {
        let empty = CsvTable::parse(" \n\n", Path::new("t.csv")).err().unwrap();
        assert_eq!(
            empty.to_string(),
            "t.csv: empty file (expected a header line naming the columns)"
        );
        let missing = CsvTable::read(Path::new("/nonexistent/t.csv"))
            .err()
            .unwrap();
        assert!(
            missing
                .to_string()
                .starts_with("reading /nonexistent/t.csv: "),
            "{missing}"
        );
    }
}
