//! PNG plots of Tables 5 and 7 from the rows of a run. Text is drawn with the DejaVu Sans font
//! embedded by the `dejavu` crate (as in `availability::plot`), so no system font is needed.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use super::{number, Row};

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 700;
const FONT: &str = "sans-serif";
const Q1: RGBColor = RGBColor(31, 119, 180);
const Q2: RGBColor = RGBColor(214, 39, 40);
const BASELINE: RGBColor = RGBColor(90, 90, 90);
const FLOOR: RGBColor = RGBColor(44, 160, 44);

fn draw_error<E: std::fmt::Display>(error: E) -> anyhow::Error {
    anyhow!("drawing the plot: {error}")
}

fn register_font() -> Result<()> {
    plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow!("the embedded DejaVu Sans font does not load"))
}

fn config(row: &Row) -> &str {
    row["config"].as_str().unwrap_or("")
}

/// Write latency against the near site's one-way delay: StarFish Q=1 and Q=2 (dark fiber:
/// circles, Internet: triangles), the two baselines, and the floor direct + 2 × near delay.
pub fn t5(rows: &[Row], path: &Path) -> Result<()> {
    register_font()?;
    let direct = rows.iter().find(|r| config(r) == "direct").and_then(|r| number(r, "write_latency_ms"));
    let latency_max = rows.iter().filter_map(|r| number(r, "write_latency_ms")).fold(1.0, f64::max);
    let near_max = rows.iter().filter_map(|r| number(r, "near_delay_ms")).fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Table 5: write latency, 8 KiB random writes, one thread (N=3; local 0 ms)", (FONT, 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..near_max + 0.5, 0.0..latency_max * 1.15)
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc("near site one-way delay (ms)")
        .y_desc("mean write latency (ms)")
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .draw()
        .map_err(draw_error)?;
    if let Some(direct) = direct {
        chart
            .draw_series(LineSeries::new([(0.0, direct), (near_max + 0.5, direct)], BASELINE.stroke_width(1)))
            .map_err(draw_error)?
            .label(format!("direct-attached ({direct:.2} ms)"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BASELINE.stroke_width(1)));
        chart
            .draw_series(LineSeries::new(
                [(0.0, direct), (near_max + 0.5, direct + 2.0 * (near_max + 0.5))],
                FLOOR.stroke_width(1),
            ))
            .map_err(draw_error)?
            .label("direct + 2 × near delay (the Q=2 floor)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], FLOOR.stroke_width(1)));
    }
    let mut near_disk: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| config(r) == "near_disk")
        .filter_map(|r| Some((number(r, "near_delay_ms")?, number(r, "write_latency_ms")?)))
        .collect();
    near_disk.sort_by(|a, b| a.0.total_cmp(&b.0));
    if !near_disk.is_empty() {
        chart
            .draw_series(LineSeries::new(near_disk.clone(), BASELINE.stroke_width(2)))
            .map_err(draw_error)?
            .label("one disk at the near site")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BASELINE.stroke_width(2)));
        chart
            .draw_series(near_disk.iter().map(|&p| {
                Rectangle::new(
                    [(p.0 - 0.06, p.1 - latency_max * 0.008), (p.0 + 0.06, p.1 + latency_max * 0.008)],
                    BASELINE.filled(),
                )
            }))
            .map_err(draw_error)?;
    }
    for (kind, quorum, color) in
        [("dark_fiber", 1, Q1), ("dark_fiber", 2, Q2), ("internet", 1, Q1), ("internet", 2, Q2)]
    {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| config(r) == kind && r["quorum"] == quorum)
            .filter_map(|r| Some((number(r, "near_delay_ms")?, number(r, "write_latency_ms")?)))
            .collect();
        if points.is_empty() {
            continue;
        }
        let label =
            format!("StarFish Q={quorum}, {}", if kind == "internet" { "Internet far link" } else { "dark fiber" });
        if kind == "internet" {
            // Internet points sit at near 1 ms; shift them right a little so both kinds show.
            chart
                .draw_series(points.iter().map(|&(x, y)| TriangleMarker::new((x + 0.15, y), 8, color.filled())))
                .map_err(draw_error)?
                .label(label)
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, color.filled()));
        } else {
            chart
                .draw_series(points.iter().map(|&(x, y)| Circle::new((x, y), 6, color.filled())))
                .map_err(draw_error)?
                .label(label)
                .legend(move |(x, y)| Circle::new((x + 10, y), 5, color.filled()));
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 16))
        .draw()
        .map_err(draw_error)?;
    root.present().map_err(draw_error)?;
    Ok(())
}

fn t7_label(row: &Row) -> String {
    match config(row) {
        "direct" => "direct-attached".to_string(),
        "near_disk" => format!("near disk {} ms", number(row, "near_delay_ms").unwrap_or(0.0)),
        _ => {
            let mut label = format!("N={} Q={}", row["elements"], row["quorum"]);
            if let Some(far) = number(row, "far_delay_ms") {
                label.push_str(&format!(" far {far}"));
                if let Some(rate) = number(row, "far_rate_mbit") {
                    label.push_str(&format!("/{rate}Mb"));
                }
            }
            label
        }
    }
}

/// PostMark transactions per second per configuration, as bars (grey: baselines, blue: Q=1,
/// red: Q=2), with the share of direct-attached above each.
pub fn t7(rows: &[Row], path: &Path) -> Result<()> {
    register_font()?;
    let bars: Vec<(String, f64, Option<f64>, RGBColor)> = rows
        .iter()
        .filter_map(|r| {
            let color = match config(r) {
                "direct" | "near_disk" => BASELINE,
                _ if r["quorum"] == 1 => Q1,
                _ => Q2,
            };
            Some((t7_label(r), number(r, "postmark_tps")?, number(r, "fraction_of_direct"), color))
        })
        .collect();
    let tps_max = bars.iter().map(|b| b.1).fold(1.0, f64::max);
    let count = bars.len().max(1);
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Table 7: PostMark on ext4 (-o sync) over StarFish; near 1 ms", (FONT, 24))
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..count as f64 - 0.5, 0.0..tps_max * 1.2)
        .map_err(draw_error)?;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(count)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("transactions per second")
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 18))
        .draw()
        .map_err(draw_error)?;
    for (i, (_, tps, fraction, color)) in bars.iter().enumerate() {
        let x = i as f64;
        chart.draw_series([Rectangle::new([(x - 0.35, 0.0), (x + 0.35, *tps)], color.filled())]).map_err(draw_error)?;
        let text = match fraction {
            Some(f) => format!("{tps:.0} ({:.0} %)", 100.0 * f),
            None => format!("{tps:.0}"),
        };
        chart
            .draw_series([Text::new(text, (x - 0.3, *tps + tps_max * 0.05), (FONT, 15).into_font())])
            .map_err(draw_error)?;
    }
    root.present().map_err(draw_error)?;
    Ok(())
}

/// The SMFS evaluation: left, writes acknowledged but lost in the rolling disaster against the
/// loss rate; right, what reaches the far element against the loss rate (one line per mode).
pub fn smfs(rows: &[Row], path: &Path) -> Result<()> {
    register_font()?;
    const MODES: [(&str, RGBColor); 6] = [
        ("local-sync", RGBColor(255, 127, 14)),
        ("local-sync+FEC", RGBColor(188, 189, 34)),
        ("remote-sync", RGBColor(31, 119, 180)),
        ("remote-sync+FEC", RGBColor(23, 190, 207)),
        ("network-sync over TCP", RGBColor(148, 103, 189)),
        ("network-sync", RGBColor(214, 39, 40)),
    ];
    let series = |kind: &str, key: &str, mode: &str| -> Vec<(f64, f64)> {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r["kind"] == kind && r["mode"] == mode && number(r, "delay_ms").is_none_or(|d| d == 50.0))
            .filter(|r| kind != "disaster" || r["fec_c"].as_u64().is_none_or(|c| c == 3))
            .filter_map(|r| Some((number(r, "loss_pct")?, number(r, key)?)))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    };
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let root =
        root.titled("SMFS evaluation: far element behind 50 ms one way, 100 Mbit/s", (FONT, 24)).map_err(draw_error)?;
    let panels = root.split_evenly((1, 2));
    for (panel, (kind, key, title, y_desc)) in panels.iter().zip([
        (
            "disaster",
            "acked_lost",
            "Rolling disaster: acknowledged writes lost",
            "writes acknowledged, absent at the far site",
        ),
        ("throughput", "far_mbit_s", "Throughput reaching the far element", "Mbit/s (16 writes of 4 KiB in flight)"),
    ]) {
        let y_max = MODES.iter().flat_map(|(m, _)| series(kind, key, m)).map(|p| p.1).fold(1.0, f64::max);
        let x_max = MODES.iter().flat_map(|(m, _)| series(kind, key, m)).map(|p| p.0).fold(0.1, f64::max);
        let mut chart = ChartBuilder::on(panel)
            .caption(title, (FONT, 18))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max * 1.05, 0.0..y_max * 1.15)
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .x_desc("random loss on the link (%)")
            .y_desc(y_desc)
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()
            .map_err(draw_error)?;
        for (mode, color) in MODES {
            let points = series(kind, key, mode);
            if points.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(draw_error)?
                .label(mode)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(draw_error)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(draw_error)?;
    }
    root.present().map_err(draw_error)?;
    Ok(())
}
