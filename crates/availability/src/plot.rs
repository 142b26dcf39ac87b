//! The paper's Figures 3 and 4 as PNG files, each with a second panel that shows the same
//! curves as unavailability on a log scale (the count of nines), where the paper's linear
//! availability axis shows nothing but 1.0. Optionally with simulated points and their 95 %
//! intervals.
//!
//! Text is drawn with the DejaVu Sans font embedded by the `dejavu` crate, so the output does
//! not depend on the fonts installed on the machine.

use std::path::Path;

use num_rational::BigRational;
use plotters::prelude::*;

use crate::decimal::to_f64;
use crate::model::{read_only_unavailability, write_quorum_unavailability, Component, Deployment};
use crate::simulate::{simulate, Estimate, Rates, SimulationConfig, SimulationError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    /// Availability with Q = 1, N = 1..6, against the element load ρ (Eq. 1).
    Three,
    /// Availability with N = 3, Q = 1..3 and read-only consistency, against the HE load (Eq. 2).
    Four,
}

/// Simulated points to draw over the closed-form curves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlay {
    pub years: f64,
    pub seed: u64,
    pub mean_repair_hours: f64,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlotOptions {
    pub overlay: Option<Overlay>,
    /// Figure 4's element loads (one curve family each); default 1 and 0.1.
    pub element_loads: Vec<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot draw the figure: {0}")]
    Draw(String),
    #[error("element load ρ must be a positive finite number, got {0}")]
    Load(f64),
    #[error("simulation for the figure: {0}")]
    Simulation(#[from] SimulationError),
}

fn draw_error<E: std::fmt::Display>(error: E) -> PlotError {
    PlotError::Draw(error.to_string())
}

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 640;
const POINTS: usize = 241;
const FONT: &str = "sans-serif";
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One curve of a panel.
struct Curve {
    label: String,
    color: RGBColor,
    dashed: bool,
    /// (x, unavailability)
    points: Vec<(f64, f64)>,
    /// (x, simulated unavailability with its interval)
    simulated: Vec<(f64, Estimate)>,
}

struct Panels {
    title: String,
    x_description: String,
    x_range: (f64, f64),
    availability_min: f64,
    unavailability_min: f64,
    /// Where each panel's legend covers no curve.
    legends: [SeriesLabelPosition; 2],
    curves: Vec<Curve>,
    footnote: String,
}

fn log_space(low: f64, high: f64, count: usize) -> Vec<f64> {
    let (a, b) = (low.log10(), high.log10());
    (0..count).map(|i| 10f64.powf(a + (b - a) * i as f64 / (count - 1) as f64)).collect()
}

fn component_of_load(load: f64) -> Result<Component, PlotError> {
    let exact = BigRational::from_float(load).filter(|_| load > 0.0).ok_or(PlotError::Load(load))?;
    Component::from_load(&exact).map_err(|_| PlotError::Load(load))
}

pub fn render(figure: Figure, options: &PlotOptions, path: &Path) -> Result<(), PlotError> {
    let panels = match figure {
        Figure::Three => figure_3(options)?,
        Figure::Four => figure_4(options)?,
    };
    draw(&panels, path)
}

fn figure_3(options: &PlotOptions) -> Result<Panels, PlotError> {
    let x_range = (1e-3, 1.0);
    let simulated_loads = [0.1, 0.2, 0.5, 1.0];
    let mut curves = Vec::new();
    for n in 1..=6u32 {
        let deployment = Deployment::new(n, 1).expect("1 ≤ Q ≤ N");
        let mut points = Vec::with_capacity(POINTS);
        for load in log_space(x_range.0, x_range.1, POINTS) {
            let element = component_of_load(load)?;
            points.push((load, to_f64(write_quorum_unavailability(deployment, &element).exact())));
        }
        let mut simulated = Vec::new();
        // The paper validated Eq. 1 by simulation up to N = 3.
        if let (Some(overlay), true) = (options.overlay, n <= 3) {
            for (index, &load) in simulated_loads.iter().enumerate() {
                let rates = Rates::from_component(&component_of_load(load)?, overlay.mean_repair_hours)?;
                let report = simulate(&SimulationConfig {
                    deployment,
                    element: rates,
                    he: rates,
                    years: overlay.years,
                    seed: overlay.seed.wrapping_add(u64::from(n) * 100 + index as u64),
                })?;
                simulated.push((load, report.write_quorum));
            }
        }
        curves.push(Curve {
            label: format!("N = {n}"),
            color: PALETTE[(n - 1) as usize],
            dashed: false,
            points,
            simulated,
        });
    }
    let footnote = match options.overlay {
        Some(o) => format!(
            "Lines: Eq. 1. Dots: simulation (N ≤ 3, {} years per point, seed {}, mean repair {} h), with 95 % interval bars where wider than the dot.",
            o.years, o.seed, o.mean_repair_hours
        ),
        None => "Lines: Eq. 1.".to_string(),
    };
    Ok(Panels {
        title: "Figure 3: availability with write quorum Q = 1, N = 1–6 elements (Eq. 1)".to_string(),
        x_description: "element load ρ = λ/μ".to_string(),
        x_range,
        availability_min: 0.5,
        unavailability_min: 1e-18,
        legends: [SeriesLabelPosition::LowerLeft, SeriesLabelPosition::LowerRight],
        curves,
        footnote,
    })
}

fn figure_4(options: &PlotOptions) -> Result<Panels, PlotError> {
    let x_range = (1e-3, 1.0);
    let loads = if options.element_loads.is_empty() { vec![1.0, 0.1] } else { options.element_loads.clone() };
    let simulated_he_loads = [0.01, 0.1, 0.3, 1.0];
    let mut curves = Vec::new();
    for (family, &load) in loads.iter().enumerate() {
        let element = component_of_load(load)?;
        for q in 1..=3u32 {
            let deployment = Deployment::new(3, q).expect("1 ≤ Q ≤ N");
            let mut points = Vec::with_capacity(POINTS);
            for he_load in log_space(x_range.0, x_range.1, POINTS) {
                let he = component_of_load(he_load)?;
                points.push((he_load, to_f64(read_only_unavailability(deployment, &element, &he).exact())));
            }
            let mut simulated = Vec::new();
            // Simulate the first family only: it is the one a simulation resolves quickly.
            if let (Some(overlay), 0) = (options.overlay, family) {
                let rates = Rates::from_component(&element, overlay.mean_repair_hours)?;
                for (index, &he_load) in simulated_he_loads.iter().enumerate() {
                    let he = Rates::from_component(&component_of_load(he_load)?, overlay.mean_repair_hours)?;
                    let report = simulate(&SimulationConfig {
                        deployment,
                        element: rates,
                        he,
                        years: overlay.years,
                        seed: overlay.seed.wrapping_add(u64::from(q) * 100 + index as u64),
                    })?;
                    simulated.push((he_load, report.read_only));
                }
            }
            curves.push(Curve {
                label: format!("Q = {q}, ρ = {load}"),
                color: PALETTE[(q - 1) as usize],
                dashed: family > 0,
                points,
                simulated,
            });
        }
    }
    let footnote = match options.overlay {
        Some(o) => format!(
            "Lines: Eq. 2. Dots: simulation (ρ = {}, {} years per point, seed {}, mean repair {} h), with 95 % interval bars where wider than the dot.",
            loads[0], o.years, o.seed, o.mean_repair_hours
        ),
        None => "Lines: Eq. 2.".to_string(),
    };
    Ok(Panels {
        title: "Figure 4: availability with N = 3, Q = 1–3, read-only consistency (Eq. 2)".to_string(),
        x_description: "HE load ρ(HE) = λ(HE)/μ(HE)".to_string(),
        x_range,
        availability_min: 0.65,
        unavailability_min: 1e-5,
        legends: [SeriesLabelPosition::LowerLeft, SeriesLabelPosition::LowerRight],
        curves,
        footnote,
    })
}

fn draw(panels: &Panels, path: &Path) -> Result<(), PlotError> {
    plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| PlotError::Draw("the embedded DejaVu Sans font does not load".to_string()))?;
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_error)?;
    let (top, rest) = root.split_vertically(50);
    top.titled(&panels.title, (FONT, 26)).map_err(draw_error)?;
    let (body, bottom) = rest.split_vertically(HEIGHT - 50 - 34);
    bottom.draw_text(&panels.footnote, &(FONT, 16).into_text_style(&bottom), (20, 8)).map_err(draw_error)?;
    let (left, right) = body.split_horizontally(WIDTH / 2);
    let (x_low, x_high) = panels.x_range;
    // A hair below the first power of ten, so that the axis labels it.
    let x_axis_low = x_low * 0.999;

    // Left: the paper's view, availability on a linear axis.
    let mut chart = ChartBuilder::on(&left)
        .caption("availability (the paper's axis)", (FONT, 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((x_axis_low..x_high).log_scale(), panels.availability_min..1.0)
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc(&panels.x_description)
        .y_desc("availability")
        .axis_desc_style((FONT, 18))
        .label_style((FONT, 15))
        .x_label_formatter(&|x| format!("{x}"))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .draw()
        .map_err(draw_error)?;
    for curve in &panels.curves {
        let points = curve.points.iter().map(|&(x, u)| (x, 1.0 - u));
        let marks = curve.simulated.iter().map(|&(x, e)| {
            let (low, high) = e.interval_95();
            (x, 1.0 - e.unavailability, 1.0 - high, 1.0 - low)
        });
        draw_curve(&mut chart, curve, points, marks)?;
    }
    chart
        .configure_series_labels()
        .position(panels.legends[0].clone())
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(draw_error)?;

    // Right: unavailability on a log axis, where the nines show.
    let mut chart = ChartBuilder::on(&right)
        .caption("unavailability 1 − A (10⁻ᵏ: k nines)", (FONT, 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((x_axis_low..x_high).log_scale(), (panels.unavailability_min * 0.999..1.0).log_scale())
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc(&panels.x_description)
        .y_desc("unavailability")
        .axis_desc_style((FONT, 18))
        .label_style((FONT, 15))
        .x_label_formatter(&|x| format!("{x}"))
        .y_label_formatter(&|y| format!("{y:.0e}"))
        .draw()
        .map_err(draw_error)?;
    let floor = panels.unavailability_min;
    for curve in &panels.curves {
        let points = curve.points.iter().filter(|&&(_, u)| u >= floor).copied();
        let marks = curve.simulated.iter().filter(|(_, e)| e.unavailability > 0.0).map(|&(x, e)| {
            let (low, high) = e.interval_95();
            (x, e.unavailability, low.max(floor), high)
        });
        draw_curve(&mut chart, curve, points, marks)?;
    }
    chart
        .configure_series_labels()
        .position(panels.legends[1].clone())
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(draw_error)?;
    root.present().map_err(draw_error)?;
    Ok(())
}

type Chart<'a, 'b, Y> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<plotters::coord::combinators::LogCoord<f64>, Y>>;

/// Draws one curve and its simulated points: (x, value, interval low, interval high).
fn draw_curve<'a, 'b, Y>(
    chart: &mut Chart<'a, 'b, Y>,
    curve: &Curve,
    points: impl Iterator<Item = (f64, f64)>,
    marks: impl Iterator<Item = (f64, f64, f64, f64)>,
) -> Result<(), PlotError>
where
    Y: Ranged<ValueType = f64>,
{
    let style = curve.color.stroke_width(2);
    let points: Vec<(f64, f64)> = points.collect();
    if curve.dashed {
        chart
            .draw_series(DashedLineSeries::new(points, 8, 5, style))
            .map_err(draw_error)?
            .label(&curve.label)
            .legend(move |(x, y)| plotters::element::DashedPathElement::new(vec![(x, y), (x + 22, y)], 8, 5, style));
    } else {
        chart
            .draw_series(LineSeries::new(points, style))
            .map_err(draw_error)?
            .label(&curve.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], style));
    }
    let color = curve.color;
    for (x, value, low, high) in marks {
        chart
            .draw_series(std::iter::once(PathElement::new(vec![(x, low), (x, high)], BLACK.stroke_width(1))))
            .map_err(draw_error)?;
        chart.draw_series(std::iter::once(Circle::new((x, value), 4, color.filled()))).map_err(draw_error)?;
        chart.draw_series(std::iter::once(Circle::new((x, value), 4, BLACK.stroke_width(1)))).map_err(draw_error)?;
    }
    Ok(())
}
