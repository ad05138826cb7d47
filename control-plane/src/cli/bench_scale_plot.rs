//! The cost curve of `gpuctl bench scale` as one SVG (`plotters`): four panels against the
//! number of hosts — the scheduling pass, replica memory (with the 2 GiB limit dashed), the
//! snapshot's build and a restart's time to a leader, and a wiped replica's rejoin.

use plotters::prelude::*;
use serde_json::Value;

use crate::sim::svg::COLOURS;

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 720;
const LIMIT: RGBColor = RGBColor(0x88, 0x88, 0x88);

/// One line of a panel: its label and the JSON pointer of its value in a case.
struct Line {
    label: &'static str,
    pointer: &'static str,
}

struct Panel {
    title: &'static str,
    y_label: &'static str,
    lines: &'static [Line],
    /// A horizontal limit line (value, label), dashed.
    limit: Option<(f64, &'static str)>,
}

const PANELS: [Panel; 4] = [
    Panel {
        title: "scheduling pass over the full fleet and queue",
        y_label: "ms",
        lines: &[
            Line {
                label: "in process, p50",
                pointer: "/build/pass_ms/p50",
            },
            Line {
                label: "running leader, mean",
                pointer: "/leader_pass_ms_mean",
            },
        ],
        limit: None,
    },
    Panel {
        title: "replica memory",
        y_label: "MiB",
        lines: &[
            Line {
                label: "largest RSS",
                pointer: "/rss/max_mib",
            },
            Line {
                label: "largest peak (VmHWM)",
                pointer: "/rss/hwm_max_mib",
            },
        ],
        limit: Some((super::bench_scale::TARGET_RSS_MIB, "limit 2 GiB")),
    },
    Panel {
        title: "snapshot and restart",
        y_label: "seconds",
        lines: &[
            Line {
                label: "snapshot build",
                pointer: "/build/snapshot_seconds",
            },
            Line {
                label: "restart to a leader",
                pointer: "/first_leader_seconds",
            },
            Line {
                label: "cluster snapshot save",
                pointer: "/save/seconds",
            },
        ],
        limit: None,
    },
    Panel {
        title: "a wiped replica joins again",
        y_label: "seconds from its start",
        lines: &[
            Line {
                label: "snapshot installed",
                pointer: "/rejoin/add/installed_s",
            },
            Line {
                label: "voter",
                pointer: "/rejoin/add/promoted_s",
            },
        ],
        limit: None,
    },
];

/// The plot of a `bench scale` report (its JSON): cases that failed are left out.
pub fn cost_curve(report: &Value) -> String {
    let cases: Vec<&Value> = report["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c.get("error").is_none())
        .collect();
    let mut out = String::new();
    draw(&mut out, report, &cases).expect("drawing into a string cannot fail");
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

fn draw(
    out: &mut String,
    report: &Value,
    cases: &[&Value],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "gpuctl bench scale: 3 replicas, full fleet of 8-GPU hosts, {} pending jobs",
        report["pending"]
    );
    let root = root.titled(&title, ("sans-serif", 16))?;
    let x_max = cases
        .iter()
        .filter_map(|c| c["hosts"].as_f64())
        .fold(1.0, f64::max)
        * 1.05;
    for (area, panel) in root.split_evenly((2, 2)).iter().zip(&PANELS) {
        let series: Vec<(&str, Vec<(f64, f64)>)> = panel
            .lines
            .iter()
            .map(|l| {
                let points = cases
                    .iter()
                    .filter_map(|c| Some((c["hosts"].as_f64()?, c.pointer(l.pointer)?.as_f64()?)))
                    .collect();
                (l.label, points)
            })
            .collect();
        let y_top = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|&(_, y)| y))
            .chain(panel.limit.map(|(v, _)| v))
            .fold(0.0, f64::max);
        let y_max = if y_top > 0.0 { y_top * 1.15 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 14))
            .margin(10)
            .x_label_area_size(38)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .label_style(("sans-serif", 11))
            .axis_desc_style(("sans-serif", 12))
            .bold_line_style(RGBColor(0xe5, 0xe5, 0xe5))
            .x_desc("hosts (8 GPUs each)")
            .y_desc(panel.y_label)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| {
                if y_max < 10.0 {
                    format!("{y:.1}")
                } else {
                    format!("{y:.0}")
                }
            })
            .draw()?;
        for (i, (label, points)) in series.into_iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            chart.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, colour.filled())),
            )?;
        }
        if let Some((value, label)) = panel.limit {
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, value), (x_max, value)],
                    5,
                    4,
                    LIMIT.stroke_width(1),
                ))?
                .label(label)
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], LIMIT.stroke_width(1)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE)
            .border_style(RGBColor(0x99, 0x99, 0x99))
            .label_font(("sans-serif", 11))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn case(hosts: u64, rss: f64) -> Value {
        json!({
            "hosts": hosts,
            "build": {"pass_ms": {"p50": hosts as f64 / 100.0}, "snapshot_seconds": 0.5},
            "leader_pass_ms_mean": hosts as f64 / 90.0,
            "first_leader_seconds": 2.0,
            "save": {"seconds": 1.0},
            "rss": {"max_mib": rss, "hwm_max_mib": rss * 1.3},
            "rejoin": {"add": {"installed_s": 3.0, "promoted_s": 4.0}},
        })
    }

    #[test]
    fn four_panels_with_a_line_per_measure_and_the_memory_limit() {
        let report = json!({
            "pending": 100000,
            "cases": [case(1000, 300.0), case(20000, 1500.0), {"hosts": 40000, "error": "x"}],
        });
        let svg = cost_curve(&report);
        assert!(svg.starts_with("<svg "), "{svg}");
        for title in PANELS.iter().map(|p| p.title) {
            assert!(svg.contains(title), "no panel {title:?}");
        }
        // Nine measured lines, each a polyline in the plot and a sample in its legend.
        let lines: usize = PANELS.iter().map(|p| p.lines.len()).sum();
        assert_eq!(lines, 9);
        assert!(svg.contains("limit 2 GiB"));
        // The failed case is not drawn: no x tick reaches 40000.
        assert!(!svg.contains(">40000<"));
        // Two points per line (a circle each).
        assert_eq!(svg.matches("<circle").count(), 2 * lines, "{svg}");
    }

    #[test]
    fn an_empty_report_still_draws_the_axes() {
        let svg = cost_curve(&json!({"pending": 0, "cases": []}));
        assert!(svg.contains("replica memory"));
        assert_eq!(svg.matches("<circle").count(), 0);
    }
}
