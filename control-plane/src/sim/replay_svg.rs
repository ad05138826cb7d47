//! The replay's plot as SVG (`plotters`): GPU utilization (top panel) and unallocatable GPU
//! share (bottom panel) over simulated time, one line per run, each point a time-weighted mean
//! over an equal window; the legend on the right.

use plotters::prelude::*;

use super::replay::RunResult;
use super::svg::COLOURS;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 560;
const LEGEND_WIDTH: u32 = 200;

/// An SVG document of `runs` over `bins` windows.
pub fn plot(title: &str, runs: &[RunResult], bins: usize) -> String {
    let mut out = String::new();
    draw(&mut out, title, runs, bins).expect("drawing into a string cannot fail");
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

fn draw(
    out: &mut String,
    title: &str,
    runs: &[RunResult],
    bins: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let end_s = runs.iter().map(|r| r.end_s).fold(0.0, f64::max).max(1.0);
    let (unit, scale) = if end_s > 3.0 * 86_400.0 {
        ("days", 86_400.0)
    } else if end_s > 3.0 * 3600.0 {
        ("hours", 3600.0)
    } else {
        ("seconds", 1.0)
    };
    let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 14))?;
    let (plots, legend) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
    let panels = plots.split_evenly((2, 1));
    let series: Vec<Vec<(f64, f64, f64)>> = runs.iter().map(|r| r.binned(bins)).collect();
    for (p, (area, name)) in panels
        .iter()
        .zip(["GPU utilization", "unallocatable GPU share"])
        .enumerate()
    {
        let mut chart = ChartBuilder::on(area)
            .margin(8)
            .x_label_area_size(if p == 1 { 40 } else { 25 })
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..end_s / scale, 0.0..100.0)?;
        let mut mesh = chart.configure_mesh();
        mesh.x_labels(6)
            .y_labels(5)
            .max_light_lines(0)
            .bold_line_style(RGBColor(0xee, 0xee, 0xee))
            .label_style(("sans-serif", 12))
            .y_desc(name)
            .y_label_formatter(&|v| format!("{v:.0}%"))
            .x_label_formatter(&|v| format!("{v:.1}"));
        if p == 1 {
            mesh.x_desc(format!("simulated time ({unit})"));
        }
        mesh.draw()?;
        for (i, points) in series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            chart.draw_series(LineSeries::new(
                points.iter().map(|&(t, u, f)| {
                    let v = if p == 0 { u } else { f };
                    (t / scale, v.clamp(0.0, 1.0) * 100.0)
                }),
                colour.stroke_width(2),
            ))?;
        }
    }
    for (i, r) in runs.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let y = 20 + i as i32 * 18;
        legend.draw(&PathElement::new(
            [(10, y), (30, y)],
            colour.stroke_width(3),
        ))?;
        legend.draw(&Text::new(r.label.clone(), (36, y - 6), ("sans-serif", 12)))?;
    }
    root.present()?;
    Ok(())
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
        // Two runs in two panels, and two legend samples.
        assert_eq!(svg.matches("stroke=\"#D62728\"").count(), 2 + 1, "{svg}");
        assert_eq!(svg.matches("stroke=\"#1F77B4\"").count(), 2 + 1);
        let text = svg.replace('\n', "");
        assert!(
            text.contains(">a&lt;b</text>") && svg.ends_with("</svg>\n"),
            "{svg}"
        );
        assert!(text.contains(">simulated time (seconds)</text>"));
    }
}
