//! The replay's plot, as hand-written SVG: GPU utilization (top panel) and unallocatable GPU
//! share (bottom panel) over simulated time, one line per run, each point a time-weighted mean
//! over an equal window.

use std::fmt::Write;

use super::replay::RunResult;

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG document of `runs` over `bins` windows.
pub fn plot(title: &str, runs: &[RunResult], bins: usize) -> String {
    let (w, h, left, right, top, panel, gap) = (900.0, 560.0, 70.0, 200.0, 40.0, 220.0, 50.0);
    let plot_w = w - left - right;
    let end_s = runs.iter().map(|r| r.end_s).fold(0.0, f64::max).max(1.0);
    let (unit, scale) = if end_s > 3.0 * 86_400.0 {
        ("days", 86_400.0)
    } else if end_s > 3.0 * 3600.0 {
        ("hours", 3600.0)
    } else {
        ("seconds", 1.0)
    };
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>
"#,
        left + plot_w / 2.0,
        escape(title)
    );
    let panels = [
        ("GPU utilization", 0usize),
        ("unallocatable GPU share", 1usize),
    ];
    for (p, (name, which)) in panels.iter().enumerate() {
        let y0 = top + p as f64 * (panel + gap);
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y0}" width="{plot_w}" height="{panel}" fill="none" stroke="#888"/>
<text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">{name}</text>"##,
            left - 45.0,
            y0 + panel / 2.0,
            left - 45.0,
            y0 + panel / 2.0
        );
        for k in 0..=4 {
            let v = k as f64 / 4.0;
            let y = y0 + panel * (1.0 - v);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{:.0}%</text>"##,
                left + plot_w,
                left - 5.0,
                y + 4.0,
                v * 100.0
            );
        }
        for k in 0..=5 {
            let x = left + plot_w * k as f64 / 5.0;
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{:.1}</text>"#,
                y0 + panel + 15.0,
                end_s / scale * k as f64 / 5.0
            );
        }
        for (i, r) in runs.iter().enumerate() {
            let pts: Vec<String> = r
                .binned(bins)
                .iter()
                .map(|&(t, u, f)| {
                    let v = if *which == 0 { u } else { f };
                    format!(
                        "{:.1},{:.1}",
                        left + plot_w * t / end_s,
                        y0 + panel * (1.0 - v.clamp(0.0, 1.0))
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                COLORS[i % COLORS.len()],
                pts.join(" ")
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">simulated time ({unit})</text>"#,
        left + plot_w / 2.0,
        top + 2.0 * panel + gap + 32.0
    );
    for (i, r) in runs.iter().enumerate() {
        let y = top + 10.0 + i as f64 * 18.0;
        let x = left + plot_w + 15.0;
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 20.0,
            COLORS[i % COLORS.len()],
            x + 25.0,
            y + 4.0,
            escape(&r.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_polyline_per_run_and_panel() {
        let r = RunResult {
            label: "a<b".into(),
            series: vec![(0.0, 500, 0), (10.0, 1000, 250)],
            capacity_milli: 1000,
            end_s: 20.0,
            ..RunResult::default()
        };
        let svg = plot("t", &[r.clone(), r], 10);
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert!(svg.contains("a&lt;b") && svg.ends_with("</svg>\n"));
    }
}
