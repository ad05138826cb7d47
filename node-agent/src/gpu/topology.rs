//! The GPU link matrix and its text format: what `nvidia-smi topo -m` prints.
//!
//! This module owns [`LinkKind`] (one cell of the matrix), [`Topology`] (the matrix plus each
//! GPU's CPU and NUMA affinity) and [`parse`], which reads both the tidy files shipped under
//! `node-agent/topologies/` and what an operator pastes from a real host: tab- or
//! space-separated columns, ANSI underline codes, NIC columns and rows (`NIC0`, `mlx5_0`), the
//! `GPU NUMA ID` column and the legend footer. `Display` on [`Topology`] writes the same format
//! back, so a matrix read from NVML can be shown to an operator exactly as `nvidia-smi` would.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How two GPUs reach each other, as one cell of `nvidia-smi topo -m` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LinkKind {
    /// `X`: the GPU itself (the diagonal).
    SelfLink,
    /// `NV#`: a bonded set of `#` NVLinks (through NVSwitch on HGX/DGX boards).
    NvLink(u32),
    /// `PIX`: at most one PCIe bridge.
    Pix,
    /// `PXB`: several PCIe bridges, without the host bridge.
    Pxb,
    /// `PHB`: through a PCIe host bridge (typically the CPU).
    Phb,
    /// `NODE`: between PCIe host bridges within one NUMA node.
    Node,
    /// `SYS`: across the SMP interconnect between NUMA nodes (QPI/UPI).
    Sys,
}

impl LinkKind {
    /// Higher is better connected: NVLink (more links better) > PIX > PXB > PHB > NODE > SYS.
    ///
    /// The scheduler compares ranks, never the numbers themselves, so only the order matters.
    /// `SelfLink` ranks above everything: a GPU is best connected to itself.
    pub fn rank(self) -> u32 {
        match self {
            LinkKind::SelfLink => u32::MAX,
            // Offset above every PCIe level; capped below SelfLink for absurd link counts.
            LinkKind::NvLink(n) => 10u32.saturating_add(n).min(u32::MAX - 1),
            LinkKind::Pix => 5,
            LinkKind::Pxb => 4,
            LinkKind::Phb => 3,
            LinkKind::Node => 2,
            LinkKind::Sys => 1,
        }
    }

    /// Number of NVLinks, 0 for PCIe-only paths and the diagonal.
    pub fn nvlinks(self) -> u32 {
        match self {
            LinkKind::NvLink(n) => n,
            _ => 0,
        }
    }
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkKind::SelfLink => f.write_str("X"),
            LinkKind::NvLink(n) => write!(f, "NV{n}"),
            LinkKind::Pix => f.write_str("PIX"),
            LinkKind::Pxb => f.write_str("PXB"),
            LinkKind::Phb => f.write_str("PHB"),
            LinkKind::Node => f.write_str("NODE"),
            LinkKind::Sys => f.write_str("SYS"),
        }
    }
}

const EXPECTED_TOKENS: &str = "X, NV<n>, PIX, PXB, PHB, NODE or SYS";

/// Longest piece of the input an error quotes.
const QUOTED_CHARS: usize = 60;

/// Input text as an error quotes it: whole when short, else its start and its length, so that
/// a file of garbage (one 10 MB line) gives a message a person can read.
fn quoted(text: &str) -> String {
    if text.chars().count() <= QUOTED_CHARS {
        return format!("`{text}`");
    }
    let start: String = text.chars().take(QUOTED_CHARS).collect();
    format!("`{start}…` ({} bytes)", text.len())
}

impl FromStr for LinkKind {
    type Err = String;

    fn from_str(token: &str) -> Result<Self, String> {
        let token = token.trim();
        Ok(match token {
            "X" => LinkKind::SelfLink,
            "PIX" => LinkKind::Pix,
            "PXB" => LinkKind::Pxb,
            "PHB" => LinkKind::Phb,
            "NODE" => LinkKind::Node,
            "SYS" => LinkKind::Sys,
            // Drivers before ~2017 printed SOC ("socket") where today's print SYS.
            "SOC" => LinkKind::Sys,
            _ => match token.strip_prefix("NV").map(str::parse::<u32>) {
                Some(Ok(n)) if n > 0 => LinkKind::NvLink(n),
                Some(Ok(_)) => {
                    return Err(format!(
                        "{} is not a link: an NVLink bond has at least one link",
                        quoted(token)
                    ));
                }
                _ => {
                    return Err(format!(
                        "unknown link {} (expected {EXPECTED_TOKENS})",
                        quoted(token)
                    ));
                }
            },
        })
    }
}

/// The link matrix between a host's GPUs, indexed like `nvidia-smi` numbers them.
///
/// Invariant (checked by [`parse`] and [`Topology::validate`]): `links` is square and
/// symmetric with `SelfLink` exactly on the diagonal, and `cpu_affinity` and `numa_affinity`
/// have one entry per GPU (`""` / `None` where the source did not say).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    pub links: Vec<Vec<LinkKind>>,
    /// CPU list local to each GPU, as printed (`0-55,112-167`); `""` when unknown.
    pub cpu_affinity: Vec<String>,
    /// NUMA node local to each GPU; `None` when unknown or not a single node.
    pub numa_affinity: Vec<Option<u32>>,
}

impl Topology {
    pub fn gpu_count(&self) -> usize {
        self.links.len()
    }

    /// The path between GPUs `a` and `b`; `None` if either index is out of range.
    pub fn link(&self, a: usize, b: usize) -> Option<LinkKind> {
        self.links.get(a)?.get(b).copied()
    }

    /// The NUMA node local to `gpu`, if known.
    pub fn numa_node(&self, gpu: usize) -> Option<u32> {
        self.numa_affinity.get(gpu).copied().flatten()
    }

    /// Number of distinct CPUs named by all GPUs' CPU affinity lists: on a host where every
    /// socket has a GPU this is the host's CPU count. `None` when no list is known or one
    /// cannot be read.
    pub fn affinity_cpu_count(&self) -> Option<u32> {
        let mut cpus = BTreeSet::new();
        for list in &self.cpu_affinity {
            if list.is_empty() {
                continue;
            }
            cpus.extend(parse_cpu_list(list)?);
        }
        if cpus.is_empty() {
            None
        } else {
            u32::try_from(cpus.len()).ok()
        }
    }

    /// Checks the invariant documented on the type; for topologies that arrive over the
    /// network or from a config file rather than through [`parse`].
    pub fn validate(&self) -> Result<(), String> {
        let n = self.links.len();
        if self.cpu_affinity.len() != n || self.numa_affinity.len() != n {
            return Err(format!(
                "{n} GPUs in the link matrix but {} CPU affinity and {} NUMA affinity entries",
                self.cpu_affinity.len(),
                self.numa_affinity.len()
            ));
        }
        check_matrix(&self.links, &|_| None)
    }
}

/// Writes the `nvidia-smi topo -m` format: a tab-separated header, one row per GPU, and the
/// affinity columns. [`parse`] reads it back unchanged.
impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for i in 0..self.gpu_count() {
            write!(f, "\tGPU{i}")?;
        }
        writeln!(f, "\tCPU Affinity\tNUMA Affinity")?;
        for (i, row) in self.links.iter().enumerate() {
            write!(f, "GPU{i}")?;
            for link in row {
                match link {
                    // nvidia-smi pads the diagonal to the width of the other cells.
                    LinkKind::SelfLink => f.write_str("\t X ")?,
                    other => write!(f, "\t{other}")?,
                }
            }
            let cpus = self.cpu_affinity.get(i).map(String::as_str).unwrap_or("");
            let cpus = if cpus.is_empty() { "N/A" } else { cpus };
            match self.numa_node(i) {
                Some(node) => writeln!(f, "\t{cpus}\t{node}")?,
                None => writeln!(f, "\t{cpus}\tN/A")?,
            }
        }
        Ok(())
    }
}

/// Reads a CPU list such as `0-55,112-167` into CPU ids. `None` if it is malformed or
/// absurdly large (a typo such as `0-4000000000` must not allocate gigabytes).
pub fn parse_cpu_list(list: &str) -> Option<Vec<u32>> {
    const MAX_CPUS: u32 = 1 << 16;
    let mut cpus: Vec<u32> = Vec::new();
    for part in list.trim().split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (
                lo.trim().parse::<u32>().ok()?,
                hi.trim().parse::<u32>().ok()?,
            ),
            None => {
                let cpu = part.parse::<u32>().ok()?;
                (cpu, cpu)
            }
        };
        // Bounded in all, not only per range: `0-65535` repeated a thousand times in one
        // 16 KB cell would otherwise expand to hundreds of megabytes.
        if lo > hi || hi >= MAX_CPUS || cpus.len() + (hi - lo) as usize >= MAX_CPUS as usize {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    Some(cpus)
}

/// Square, diagonal and symmetry checks shared by [`parse`] (which says where, with line
/// numbers) and [`Topology::validate`]. `line_of(row)` is the source line of a row, if any.
fn check_matrix(
    links: &[Vec<LinkKind>],
    line_of: &dyn Fn(usize) -> Option<usize>,
) -> Result<(), String> {
    let at = |r: usize| {
        line_of(r)
            .map(|l| format!("line {l}: "))
            .unwrap_or_default()
    };
    let paren = |r: usize| {
        line_of(r)
            .map(|l| format!(" (line {l})"))
            .unwrap_or_default()
    };
    let n = links.len();
    for (r, row) in links.iter().enumerate() {
        if row.len() != n {
            return Err(format!(
                "{}row GPU{r} has {} GPU cells but there are {n} GPUs: the matrix is not square",
                at(r),
                row.len()
            ));
        }
        for (c, link) in row.iter().enumerate() {
            if r == c && *link != LinkKind::SelfLink {
                return Err(format!(
                    "{}GPU{r} to itself must be X (the diagonal), found {link}",
                    at(r)
                ));
            }
            if r != c && *link == LinkKind::SelfLink {
                return Err(format!(
                    "{}row GPU{r}, column GPU{c} is X, but X belongs only on the diagonal",
                    at(r)
                ));
            }
        }
    }
    for (r, row) in links.iter().enumerate() {
        for (c, &there) in row.iter().enumerate().skip(r + 1) {
            let back = links[c][r];
            if there != back {
                return Err(format!(
                    "the matrix is not symmetric: GPU{r} to GPU{c} is {there}{} but GPU{c} to \
                     GPU{r} is {back}{}",
                    paren(r),
                    paren(c)
                ));
            }
        }
    }
    Ok(())
}

/// One column of the header row.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Column {
    Gpu,
    CpuAffinity,
    NumaAffinity,
    /// `GPU NUMA ID`, NIC columns, `mlx5_0`, anything a newer driver adds: read past.
    Other,
}

/// `GPU<n>` → `Some(n)`.
fn gpu_label(token: &str) -> Option<usize> {
    let digits = token.strip_prefix("GPU")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Removes ANSI escape sequences: `nvidia-smi` underlines the header when it writes to a
/// terminal, and pastes keep the codes (`ESC[4mGPU0 ... ESC[0m`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(ch) = chars.next() {
        if ch != '\u{1b}' {
            out.push(ch);
            continue;
        }
        // CSI: ESC '[' parameters... final byte in '@'..='~'. A lone ESC is dropped.
        if chars.clone().next() == Some('[') {
            chars.next();
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) {
                    break;
                }
            }
        }
    }
    out
}

/// Splits the header into column names. Tab-separated lines keep multi-word names as they
/// are; space-separated ones (a terminal paste turns tabs into spaces) rejoin the multi-word
/// names `nvidia-smi` is known to print.
fn header_columns(line: &str) -> Vec<String> {
    if line.contains('\t') {
        return line
            .split('\t')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(String::from)
            .collect();
    }
    const MULTI_WORD: [&[&str]; 3] = [
        &["GPU", "NUMA", "ID"],
        &["CPU", "Affinity"],
        &["NUMA", "Affinity"],
    ];
    let tokens: Vec<&str> = line.split_whitespace().collect();
    let mut columns = Vec::new();
    let mut i = 0;
    'next: while i < tokens.len() {
        for words in MULTI_WORD {
            if tokens[i..].starts_with(words) {
                columns.push(words.join(" "));
                i += words.len();
                continue 'next;
            }
        }
        columns.push(tokens[i].to_string());
        i += 1;
    }
    columns
}

fn classify_column(name: &str) -> Column {
    if gpu_label(name).is_some() {
        Column::Gpu
    } else if name.eq_ignore_ascii_case("CPU Affinity") {
        Column::CpuAffinity
    } else if name.eq_ignore_ascii_case("NUMA Affinity") {
        Column::NumaAffinity
    } else {
        Column::Other
    }
}

/// `0` → `Some(0)`; `N/A`, empty, or a multi-node list such as `0-1` → `None` (the GPU is not
/// local to one node, which for placement is the same as not knowing).
fn parse_numa(cell: &str) -> Result<Option<u32>, String> {
    let cell = cell.trim();
    if cell.is_empty() || cell.eq_ignore_ascii_case("N/A") {
        return Ok(None);
    }
    if let Ok(node) = cell.parse::<u32>() {
        return Ok(Some(node));
    }
    if parse_cpu_list(cell).is_some() {
        return Ok(None);
    }
    Err(format!(
        "NUMA affinity {} is neither a node number, a node list nor N/A",
        quoted(cell)
    ))
}

/// Parses `nvidia-smi topo -m` output.
///
/// Accepted: `#` comment lines; blank lines before the header; a header row naming
/// `GPU0`..`GPUn` in order, optionally followed or interleaved with other columns (NICs,
/// `CPU Affinity`, `NUMA Affinity`, `GPU NUMA ID`); one row per GPU; non-GPU rows (NICs) which
/// are skipped. The table ends at the first blank line or `Legend` line after the header, so
/// the legend that a real host prints is ignored. Errors name the line.
pub fn parse(text: &str) -> Result<Topology, String> {
    struct Header {
        line_no: usize,
        columns: Vec<Column>,
        gpu_count: usize,
    }
    struct GpuRow {
        line_no: usize,
        cells: Vec<String>,
    }

    let mut header: Option<Header> = None;
    let mut rows: Vec<GpuRow> = Vec::new();

    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = strip_ansi(raw);
        let trimmed = line.trim();
        if trimmed.starts_with('#') {
            continue;
        }
        let Some(head) = &header else {
            if trimmed.is_empty() {
                continue;
            }
            let names = header_columns(&line);
            if names.first().map(String::as_str) != Some("GPU0") {
                return Err(format!(
                    "line {line_no}: expected the header row listing GPU0, GPU1, ... as \
                     `nvidia-smi topo -m` prints it, found {}",
                    quoted(trimmed)
                ));
            }
            let mut gpu_count = 0;
            for name in &names {
                if let Some(index) = gpu_label(name) {
                    if index != gpu_count {
                        return Err(format!(
                            "line {line_no}: header column {name} where GPU{gpu_count} was \
                             expected (GPU columns must be GPU0, GPU1, ... in order)"
                        ));
                    }
                    gpu_count += 1;
                }
            }
            header = Some(Header {
                line_no,
                columns: names.iter().map(|n| classify_column(n)).collect(),
                gpu_count,
            });
            continue;
        };
        if trimmed.is_empty() || trimmed.starts_with("Legend") {
            // End of the table; what follows is the legend a real host prints.
            break;
        }

        // Data cells never contain spaces, and real output pads some cells with an extra tab
        // (`0\t\tN/A`), so whitespace splitting reads tab- and space-separated rows alike.
        let mut tokens = trimmed.split_whitespace();
        let Some(label) = tokens.next() else { continue };
        let Some(index) = gpu_label(label) else {
            if label.starts_with("GPU") {
                return Err(format!(
                    "line {line_no}: row label {} is not GPU<number>",
                    quoted(label)
                ));
            }
            // NIC rows (`NIC0`, `mlx5_0`): not part of the GPU matrix.
            continue;
        };
        if index != rows.len() {
            return Err(format!(
                "line {line_no}: row {label} where GPU{} was expected (rows must be GPU0, \
                 GPU1, ... in order, each once)",
                rows.len()
            ));
        }
        if index >= head.gpu_count {
            return Err(format!(
                "line {line_no}: row {label}, but the header (line {}) has only {} GPU \
                 columns: the matrix is not square",
                head.line_no, head.gpu_count
            ));
        }
        let cells: Vec<String> = tokens.map(String::from).collect();
        if cells.len() > head.columns.len() {
            return Err(format!(
                "line {line_no}: row {label} has {} cells but the header (line {}) has {} \
                 columns",
                cells.len(),
                head.line_no,
                head.columns.len()
            ));
        }
        rows.push(GpuRow { line_no, cells });
    }

    let Some(head) = header else {
        return Err(
            "no header row found: expected a line listing GPU0, GPU1, ... as \
                    `nvidia-smi topo -m` prints it"
                .to_string(),
        );
    };
    if rows.len() != head.gpu_count {
        return Err(format!(
            "the header (line {}) names {} GPUs but {} GPU rows follow: the matrix is not \
             square",
            head.line_no,
            head.gpu_count,
            rows.len()
        ));
    }

    let mut topology = Topology::default();
    for (r, row) in rows.iter().enumerate() {
        let mut links = Vec::with_capacity(head.gpu_count);
        let mut cpus = String::new();
        let mut numa = None;
        for (c, kind) in head.columns.iter().enumerate() {
            let cell = row.cells.get(c).map(String::as_str);
            match kind {
                Column::Gpu => {
                    let col = links.len();
                    let Some(cell) = cell else {
                        return Err(format!(
                            "line {}: row GPU{r} ends after {} cells, before column GPU{col}: \
                             the matrix is not square",
                            row.line_no,
                            row.cells.len()
                        ));
                    };
                    let link = cell.parse::<LinkKind>().map_err(|e| {
                        format!("line {}: row GPU{r}, column GPU{col}: {e}", row.line_no)
                    })?;
                    links.push(link);
                }
                Column::CpuAffinity => {
                    // `N/A` and a missing cell both mean unknown, stored as "".
                    cpus = match cell {
                        Some(list) if !list.eq_ignore_ascii_case("N/A") => list.to_string(),
                        _ => String::new(),
                    };
                }
                Column::NumaAffinity => {
                    numa = parse_numa(cell.unwrap_or(""))
                        .map_err(|e| format!("line {}: row GPU{r}: {e}", row.line_no))?;
                }
                Column::Other => {}
            }
        }
        topology.links.push(links);
        topology.cpu_affinity.push(cpus);
        topology.numa_affinity.push(numa);
    }

    check_matrix(&topology.links, &|r| rows.get(r).map(|row| row.line_no))?;
    Ok(topology)
}

#[cfg(test)]
mod tests {
    use super::LinkKind::*;
    use super::*;

    const A100_PAIRS: &str = include_str!("../../topologies/a100-pcie-4gpu-nvlink-pairs.txt");
    const DGX_H100: &str = include_str!("../../topologies/dgx-h100.txt");
    const DGX1_V100: &str = include_str!("../../topologies/dgx1-v100.txt");
    const PCIE_8GPU: &str = include_str!("../../topologies/pcie-8gpu-2socket.txt");

    #[test]
    fn shipped_files_parse_to_the_documented_shapes() {
        struct Case {
            name: &'static str,
            text: &'static str,
            gpus: usize,
            /// (a, b, expected link)
            links: &'static [(usize, usize, LinkKind)],
            numa: &'static [Option<u32>],
            cpu0: &'static str,
            cpus: u32,
        }
        let cases = [
            Case {
                name: "a100-pcie-4gpu-nvlink-pairs",
                text: A100_PAIRS,
                gpus: 4,
                links: &[
                    (0, 1, NvLink(12)),
                    (2, 3, NvLink(12)),
                    (0, 2, Sys),
                    (1, 3, Sys),
                ],
                numa: &[Some(0), Some(0), Some(1), Some(1)],
                cpu0: "0-15",
                cpus: 32,
            },
            Case {
                name: "dgx-h100",
                text: DGX_H100,
                gpus: 8,
                links: &[(0, 7, NvLink(18)), (3, 4, NvLink(18)), (5, 5, SelfLink)],
                numa: &[
                    Some(0),
                    Some(0),
                    Some(0),
                    Some(0),
                    Some(1),
                    Some(1),
                    Some(1),
                    Some(1),
                ],
                cpu0: "0-55,112-167",
                cpus: 224,
            },
            Case {
                name: "dgx1-v100",
                text: DGX1_V100,
                gpus: 8,
                links: &[
                    (0, 1, NvLink(1)),
                    (0, 3, NvLink(2)),
                    (0, 4, NvLink(2)),
                    (0, 5, Sys),
                    (2, 6, NvLink(1)),
                    (5, 7, NvLink(1)),
                    (6, 7, NvLink(2)),
                ],
                numa: &[
                    Some(0),
                    Some(0),
                    Some(0),
                    Some(0),
                    Some(1),
                    Some(1),
                    Some(1),
                    Some(1),
                ],
                cpu0: "0-19,40-59",
                cpus: 80,
            },
            Case {
                name: "pcie-8gpu-2socket",
                text: PCIE_8GPU,
                gpus: 8,
                links: &[
                    (0, 1, Pix),
                    (0, 2, Node),
                    (0, 4, Sys),
                    (6, 7, Pix),
                    (4, 6, Node),
                ],
                numa: &[
                    Some(0),
                    Some(0),
                    Some(0),
                    Some(0),
                    Some(1),
                    Some(1),
                    Some(1),
                    Some(1),
                ],
                cpu0: "0-31",
                cpus: 64,
            },
        ];
        for case in cases {
            let topo = parse(case.text).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert_eq!(topo.gpu_count(), case.gpus, "{}", case.name);
            assert_eq!(topo.validate(), Ok(()), "{}", case.name);
            for &(a, b, want) in case.links {
                assert_eq!(topo.link(a, b), Some(want), "{} GPU{a}-GPU{b}", case.name);
                assert_eq!(topo.link(b, a), Some(want), "{} GPU{b}-GPU{a}", case.name);
            }
            assert_eq!(topo.numa_affinity, case.numa, "{}", case.name);
            assert_eq!(topo.cpu_affinity[0], case.cpu0, "{}", case.name);
            assert_eq!(topo.affinity_cpu_count(), Some(case.cpus), "{}", case.name);
            assert_eq!(topo.link(0, case.gpus), None, "{}: out of range", case.name);
            // What Display writes, parse reads back unchanged.
            assert_eq!(
                parse(&topo.to_string()),
                Ok(topo),
                "{}: round trip",
                case.name
            );
        }
    }

    #[test]
    fn rank_orders_links_best_to_worst() {
        let best_to_worst = [
            SelfLink,
            NvLink(18),
            NvLink(2),
            NvLink(1),
            Pix,
            Pxb,
            Phb,
            Node,
            Sys,
        ];
        for pair in best_to_worst.windows(2) {
            assert!(pair[0].rank() > pair[1].rank(), "{} > {}", pair[0], pair[1]);
        }
        assert!(NvLink(u32::MAX).rank() < SelfLink.rank());
    }

    #[test]
    fn tokens_round_trip_through_display_and_from_str() {
        for (token, kind) in [
            ("X", SelfLink),
            ("NV1", NvLink(1)),
            ("NV18", NvLink(18)),
            ("PIX", Pix),
            ("PXB", Pxb),
            ("PHB", Phb),
            ("NODE", Node),
            ("SYS", Sys),
        ] {
            assert_eq!(token.parse::<LinkKind>(), Ok(kind));
            assert_eq!(kind.to_string(), token);
        }
        assert_eq!(" X ".parse::<LinkKind>(), Ok(SelfLink));
        assert_eq!("SOC".parse::<LinkKind>(), Ok(Sys), "legacy name for SYS");
        for bad in ["NV0", "NV", "NVx", "nv4", "PCI", ""] {
            assert!(bad.parse::<LinkKind>().is_err(), "{bad:?} must not parse");
        }
    }

    /// A DGX H100 as an operator pastes it: ANSI underline codes around the header, NIC columns
    /// between the GPUs and the affinity columns, the `GPU NUMA ID` column with the extra tab
    /// nvidia-smi puts before it, NIC rows, and the legend footer.
    #[test]
    fn real_host_paste_with_nics_and_legend() {
        let paste = "\t\u{1b}[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tNIC2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\u{1b}[0m\n\
GPU0\t X \tNV18\tNV18\tNV18\tPIX\tNODE\tSYS\t0-55,112-167\t0\t\tN/A\n\
GPU1\tNV18\t X \tNV18\tNV18\tNODE\tPIX\tSYS\t0-55,112-167\t0\t\tN/A\n\
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tPIX\t56-111,168-223\t1\t\tN/A\n\
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tPIX\t56-111,168-223\t1\t\tN/A\n\
NIC0\tPIX\tNODE\tSYS\tSYS\t X \tNODE\tSYS\t\t\t\t\n\
NIC1\tNODE\tPIX\tSYS\tSYS\tNODE\t X \tSYS\t\t\t\t\n\
NIC2\tSYS\tSYS\tPIX\tPIX\tSYS\tSYS\t X \t\t\t\t\n\
\n\
Legend:\n\
\n\
  X    = Self\n\
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n\
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n\
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n\
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n\
  PIX  = Connection traversing at most a single PCIe bridge\n\
  NV#  = Connection traversing a bonded set of # NVLinks\n\
\n\
NIC Legend:\n\
\n\
  NIC0: mlx5_0\n\
  NIC1: mlx5_1\n\
  NIC2: mlx5_2\n";
        let topo = parse(paste).expect("real paste parses");
        assert_eq!(topo.gpu_count(), 4);
        assert!(
            topo.links
                .iter()
                .flatten()
                .all(|l| matches!(l, SelfLink | NvLink(18)))
        );
        assert_eq!(topo.numa_affinity, [Some(0), Some(0), Some(1), Some(1)]);
        assert_eq!(topo.cpu_affinity[2], "56-111,168-223");
        assert_eq!(topo.affinity_cpu_count(), Some(224));
    }

    /// An older driver's output copied from a terminal: tabs became spaces, NICs are named by
    /// device (`mlx5_0`), there is no NUMA column, CRLF line ends, and the legend follows.
    #[test]
    fn space_separated_paste_with_mlx_columns() {
        let paste = "        GPU0    GPU1    mlx5_0  mlx5_1  CPU Affinity\r\n\
GPU0     X      PHB     PHB     SYS     0-11\r\n\
GPU1    PHB      X      PHB     SYS     0-11\r\n\
mlx5_0  PHB     PHB      X      SYS\r\n\
mlx5_1  SYS     SYS     SYS      X\r\n\
\r\n\
Legend:\r\n\
  X    = Self\r\n";
        let topo = parse(paste).expect("space-separated paste parses");
        assert_eq!(topo.links, vec![vec![SelfLink, Phb], vec![Phb, SelfLink]]);
        assert_eq!(topo.cpu_affinity, ["0-11", "0-11"]);
        assert_eq!(topo.numa_affinity, [None, None]);
    }

    #[test]
    fn numa_affinity_forms() {
        let text = "GPU0 GPU1 GPU2 CPU Affinity NUMA Affinity\n\
GPU0 X SYS SYS 0-7 N/A\n\
GPU1 SYS X SYS 8-15 0-1\n\
GPU2 SYS SYS X 16-23 3\n";
        let topo = parse(text).expect("parses");
        assert_eq!(topo.numa_affinity, [None, None, Some(3)]);
        assert_eq!(topo.numa_node(2), Some(3));
        assert_eq!(topo.numa_node(9), None);
    }

    #[test]
    fn unknown_affinities_round_trip() {
        let text = "GPU0 GPU1 CPU Affinity NUMA Affinity\nGPU0 X PHB N/A N/A\nGPU1 PHB X N/A N/A\n";
        let topo = parse(text).expect("parses");
        assert_eq!(topo.cpu_affinity, ["", ""]);
        assert_eq!(topo.affinity_cpu_count(), None);
        assert_eq!(parse(&topo.to_string()), Ok(topo.clone()));
        let json = serde_json::to_string(&topo).expect("serialize");
        assert_eq!(
            serde_json::from_str::<Topology>(&json).expect("deserialize"),
            topo
        );
    }

    #[test]
    fn single_gpu_host() {
        let topo = parse("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-63\t0\n")
            .expect("one GPU parses");
        assert_eq!(topo.gpu_count(), 1);
        assert_eq!(topo.link(0, 0), Some(SelfLink));
    }

    #[test]
    fn errors_name_the_line_and_the_problem() {
        let cases: &[(&str, &str, &[&str])] = &[
            ("empty", "# only a comment\n\n", &["no header row"]),
            (
                "not a header",
                "# c\nhello world\n",
                &["line 2", "expected the header row", "hello world"],
            ),
            (
                "unknown token",
                "GPU0 GPU1\nGPU0 X NVX\nGPU1 NVX X\n",
                &[
                    "line 2",
                    "row GPU0, column GPU1",
                    "unknown link `NVX`",
                    "PIX",
                ],
            ),
            (
                "missing X on the diagonal",
                "GPU0 GPU1\nGPU0 X PIX\nGPU1 PIX PIX\n",
                &["line 3", "GPU1 to itself must be X", "found PIX"],
            ),
            (
                "X off the diagonal",
                "GPU0 GPU1\nGPU0 X X\nGPU1 X X\n",
                &["line 2", "row GPU0, column GPU1 is X"],
            ),
            (
                "asymmetric",
                "# header next\nGPU0 GPU1 GPU2\nGPU0 X NV1 SYS\nGPU1 NV1 X PIX\nGPU2 SYS PXB X\n",
                &[
                    "not symmetric",
                    "GPU1 to GPU2 is PIX (line 4)",
                    "GPU2 to GPU1 is PXB (line 5)",
                ],
            ),
            (
                "missing row",
                "GPU0 GPU1 GPU2\nGPU0 X PIX PIX\nGPU1 PIX X PIX\n",
                &["line 1", "names 3 GPUs but 2 GPU rows", "not square"],
            ),
            (
                "short row",
                "GPU0 GPU1 GPU2\nGPU0 X PIX PIX\nGPU1 PIX X\nGPU2 PIX PIX X\n",
                &[
                    "line 3",
                    "row GPU1 ends after 2 cells, before column GPU2",
                    "not square",
                ],
            ),
            (
                "extra row",
                "GPU0 GPU1\nGPU0 X PIX\nGPU1 PIX X\nGPU2 PIX PIX\n",
                &[
                    "line 4",
                    "header (line 1) has only 2 GPU columns",
                    "not square",
                ],
            ),
            (
                "too many cells",
                "GPU0 GPU1\nGPU0 X PIX PIX\nGPU1 PIX X\n",
                &["line 2", "3 cells", "2 columns"],
            ),
            (
                "rows out of order",
                "GPU0 GPU1\nGPU1 PIX X\nGPU0 X PIX\n",
                &["line 2", "row GPU1 where GPU0 was expected"],
            ),
            (
                "header columns out of order",
                "GPU0 GPU2\n",
                &["line 1", "GPU2 where GPU1 was expected"],
            ),
            ("bad row label", "GPU0\nGPUx X\n", &["line 2", "`GPUx`"]),
            (
                "bad NUMA",
                "GPU0 CPU Affinity NUMA Affinity\nGPU0 X 0-3 socket0\n",
                &["line 2", "NUMA affinity `socket0`"],
            ),
        ];
        for (name, text, needles) in cases {
            let err = parse(text).expect_err(name);
            for needle in *needles {
                assert!(
                    err.contains(needle),
                    "{name}: `{err}` should mention `{needle}`"
                );
            }
        }
    }

    #[test]
    fn validate_rejects_bad_deserialized_topologies() {
        let mut topo = parse(A100_PAIRS).expect("parses");
        topo.links[0][3] = Pix;
        assert!(topo.validate().unwrap_err().contains("not symmetric"));
        let mut topo = parse(A100_PAIRS).expect("parses");
        topo.numa_affinity.pop();
        assert!(
            topo.validate()
                .unwrap_err()
                .contains("NUMA affinity entries")
        );
        assert_eq!(Topology::default().validate(), Ok(()));
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,8"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("0-4000000000"), None);
        assert_eq!(parse_cpu_list("N/A"), None);
    }

    #[test]
    fn hostile_files_are_refused_quickly_with_a_short_message() {
        // One 10 MB line of garbage: the message quotes its start only.
        let line = "Z".repeat(10 * 1024 * 1024);
        let err = parse(&line).unwrap_err();
        assert!(err.starts_with("line 1: expected the header row"), "{err}");
        assert!(err.contains("(10485760 bytes)") && err.len() < 300, "{err}");
        // A 10 MB cell where a link belongs.
        let text = format!("GPU0 GPU1\nGPU0 X {line}\nGPU1 PIX X\n");
        let err = parse(&text).unwrap_err();
        assert!(
            err.starts_with("line 2: row GPU0, column GPU1: unknown link `ZZZ") && err.len() < 300,
            "{err}"
        );
        // A CPU list that names 65,536 CPUs thousands of times over (a 16 KB cell that used to
        // take gigabytes and minutes): unknown affinity, at once.
        let bomb = vec!["0-65535"; 2000].join(",");
        assert_eq!(parse_cpu_list(&bomb), None);
        let text = format!("GPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t{bomb}\t0\n");
        let started = std::time::Instant::now();
        let topo = parse(&text).expect("the matrix itself is fine");
        assert_eq!(topo.affinity_cpu_count(), None);
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        assert_eq!(parse_cpu_list("0-65535").map(|c| c.len()), Some(65536));
        assert_eq!(parse_cpu_list("0-65535,0"), None);
        // Binary garbage that happens to be text, an empty file, a NUL in a cell.
        for (text, needle) in [
            ("", "no header row found"),
            ("\u{0}\u{1}\u{7f}", "line 1: expected the header row"),
            (
                "GPU0\nGPU0 X\u{0}\n",
                "line 2: row GPU0, column GPU0: unknown link",
            ),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }
}
