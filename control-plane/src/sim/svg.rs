//! The allocation curves of the fragmentation experiment as an SVG line plot (`plotters`):
//! allocated GPU share against arrived workload, one line per policy, with axes, grid, a
//! legend and the ideal (everything that arrives is placed, up to capacity) dashed.

use plotters::prelude::*;
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

const WIDTH: u32 = 760;
const HEIGHT: u32 = 500;
/// Distinguishable in colour and in greyscale.
pub(crate) const COLOURS: [RGBColor; 8] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];
const IDEAL: RGBColor = RGBColor(0x88, 0x88, 0x88);

/// The allocation plot: `series` against x in `0..=x_max`, with the ideal line `y = min(x,
/// 100)` dashed.
pub fn allocation_plot(axes: &Axes, series: &[Series]) -> String {
    let mut out = String::new();
    draw(&mut out, axes, series).expect("drawing into a string cannot fail");
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

fn draw(
    out: &mut String,
    axes: &Axes,
    series: &[Series],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let x_max = axes.x_max.max(f64::MIN_POSITIVE);
    let mut chart = ChartBuilder::on(&root)
        .caption(axes.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..x_max, axes.y_min..axes.y_max)?;
    let ticks = |span: f64, step: f64| (span / step).round() as usize + 1;
    chart
        .configure_mesh()
        .x_labels(ticks(x_max, axes.x_step))
        .y_labels(ticks(axes.y_max - axes.y_min, axes.y_step))
        .max_light_lines(0)
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 13))
        .bold_line_style(RGBColor(0xe5, 0xe5, 0xe5))
        .x_desc(axes.x_label)
        .y_desc(axes.y_label)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let ideal: Vec<(f64, f64)> = [0.0, 100.0, x_max]
        .into_iter()
        .filter(|&x| x <= x_max)
        .map(|x| (x, x.min(100.0)))
        .collect();
    for (i, line) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let clamp = |&(x, y): &(f64, f64)| (x.clamp(0.0, x_max), y.clamp(axes.y_min, axes.y_max));
        chart
            .draw_series(LineSeries::new(
                line.points.iter().map(clamp),
                colour.stroke_width(2),
            ))?
            .label(line.name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], colour.stroke_width(2)));
    }
    chart
        .draw_series(DashedLineSeries::new(ideal, 5, 4, IDEAL.stroke_width(1)))?
        .label("ideal")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], IDEAL.stroke_width(1)));
    // Lower right: where allocation curves never go.
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE)
        .border_style(RGBColor(0x99, 0x99, 0x99))
        .label_font(("sans-serif", 13))
        .draw()?;
    root.present()?;
    Ok(())
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
        // plotters puts each text on a line of its own.
        let text = svg.replace('\n', "");
        assert!(svg.starts_with("<svg "), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        // Each series is one polyline in its colour (and a legend sample in it).
        assert_eq!(
            svg.matches("<polyline fill=\"none\" opacity=\"1\" stroke=\"#D62728\"")
                .count(),
            2,
            "{svg}"
        );
        assert_eq!(svg.matches("stroke=\"#1F77B4\"").count(), 2);
        assert!(text.contains(">fgd</text>"), "{text}");
        assert!(text.contains(">best-fit</text>"), "{text}");
        assert!(text.contains(">ideal</text>"), "{text}");
        assert!(svg.contains("a &lt;title&gt; &amp; more"));
        // x ticks 0..=130 by 10, y ticks 0..=100 by 10.
        assert!(text.contains(">130</text>"), "{text}");
        assert!(text.contains(">100</text>"), "{text}");
        assert!(text.contains(">arrived</text>"), "{text}");
    }
}
