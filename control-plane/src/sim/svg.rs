//! A hand-written SVG line plot: the allocation curves of the fragmentation experiment
//! (allocated GPU share against arrived workload, one line per policy), with axes, grid,
//! a legend and the ideal (everything that arrives is placed, up to capacity) dashed.

use std::fmt::Write;

/// One line of the plot.
pub struct Series<'a> {
    pub name: &'a str,
    /// (x, y) points in data units, in x order.
    pub points: Vec<(f64, f64)>,
}

/// Axis ranges and labels.
pub struct Axes<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub x_max: f64,
    pub y_min: f64,
    pub y_max: f64,
    /// Distance between ticks (and grid lines) on each axis.
    pub x_step: f64,
    pub y_step: f64,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 500.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
/// Distinguishable in colour and in greyscale.
const COLOURS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// The allocation plot: `series` against x in `0..=x_max`, with the ideal line `y = min(x,
/// 100)` dashed.
pub fn allocation_plot(axes: &Axes, series: &[Series]) -> String {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let sx = |x: f64| LEFT + x.clamp(0.0, axes.x_max) / axes.x_max * plot_w;
    let sy = |y: f64| {
        let y = y.clamp(axes.y_min, axes.y_max);
        TOP + (axes.y_max - y) / (axes.y_max - axes.y_min) * plot_h
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(axes.title)
    );
    // Grid and ticks.
    let mut x = 0.0;
    while x <= axes.x_max + 1e-9 {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{x}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 18.0
        );
        x += axes.x_step;
    }
    let mut y = axes.y_min;
    while y <= axes.y_max + 1e-9 {
        let py = sy(y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{y}</text>"##,
            LEFT + plot_w,
            LEFT - 8.0,
            py + 4.0
        );
        y += axes.y_step;
    }
    // Axes and labels.
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 15.0,
        escape(axes.x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + plot_h / 2.0,
        escape(axes.y_label)
    );
    // Clip lines to the plot area.
    let _ = writeln!(
        s,
        r#"<clipPath id="plot"><rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/></clipPath>"#
    );
    let ideal: Vec<(f64, f64)> = [0.0, 100.0, axes.x_max]
        .into_iter()
        .filter(|&x| x <= axes.x_max)
        .map(|x| (x, x.min(100.0)))
        .collect();
    let _ = writeln!(
        s,
        r##"<polyline clip-path="url(#plot)" fill="none" stroke="#888" stroke-width="1" stroke-dasharray="5 4" points="{}"/>"##,
        points(&ideal, &sx, &sy)
    );
    for (i, line) in series.iter().enumerate() {
        let _ = writeln!(
            s,
            r#"<polyline clip-path="url(#plot)" fill="none" stroke="{}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
            COLOURS[i % COLOURS.len()],
            points(&line.points, &sx, &sy),
            escape(line.name)
        );
    }
    // Legend, inside the plot at the lower right (where curves never go).
    let lx = LEFT + plot_w - 190.0;
    let ly = TOP + plot_h - 20.0 - 20.0 * (series.len() as f64 + 1.0);
    let _ = writeln!(
        s,
        r##"<rect x="{lx:.1}" y="{ly:.1}" width="180" height="{:.1}" fill="white" stroke="#999"/>"##,
        20.0 * (series.len() as f64 + 1.0) + 8.0
    );
    let mut entries: Vec<(String, String, bool)> = series
        .iter()
        .enumerate()
        .map(|(i, l)| {
            (
                l.name.to_owned(),
                COLOURS[i % COLOURS.len()].to_owned(),
                false,
            )
        })
        .collect();
    entries.push(("ideal".into(), "#888".into(), true));
    for (i, (name, colour, dashed)) in entries.iter().enumerate() {
        let y = ly + 16.0 + 20.0 * i as f64;
        let dash = if *dashed {
            r#" stroke-dasharray="5 4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 10.0,
            lx + 40.0,
            lx + 48.0,
            y + 4.0,
            escape(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn points(pts: &[(f64, f64)], sx: &impl Fn(f64) -> f64, sy: &impl Fn(f64) -> f64) -> String {
    let mut out = String::new();
    for (i, &(x, y)) in pts.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let _ = write!(out, "{:.1},{:.1}", sx(x), sy(y));
    }
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plot_has_one_line_per_series_and_a_legend() {
        let axes = Axes {
            title: "a <title> & more",
            x_label: "arrived",
            y_label: "allocated",
            x_max: 130.0,
            y_min: 0.0,
            y_max: 100.0,
            x_step: 10.0,
            y_step: 10.0,
        };
        let series = [
            Series {
                name: "fgd",
                points: vec![(0.0, 0.0), (100.0, 95.0), (130.0, 96.0)],
            },
            Series {
                name: "best-fit",
                points: vec![(0.0, 0.0), (130.0, 93.0)],
            },
        ];
        let svg = allocation_plot(&axes, &series);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        // Two series and the ideal line.
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains("<title>fgd</title>"));
        assert!(svg.contains(">best-fit</text>"));
        assert!(svg.contains(">ideal</text>"));
        assert!(svg.contains("a &lt;title&gt; &amp; more"));
        // x ticks 0..=130 by 10, y ticks 0..=100 by 10.
        assert!(svg.contains(">130</text>"));
        assert_eq!(svg.matches("stroke=\"#e5e5e5\"").count(), 14 + 11);
        // Points map to the plot area: (0, 0) is the lower left corner.
        assert!(svg.contains(&format!("points=\"{LEFT:.1},{:.1} ", HEIGHT - BOTTOM)));
    }
}
