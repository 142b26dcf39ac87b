//! `starfish availability`: the paper's section 4 as a sizing tool. Parses nothing itself (the
//! binary mounts [`AvailabilityArgs`] as a subcommand); [`run`] writes human text or JSON.

use std::fmt::Write as _;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context as _;
use num_rational::BigRational;
use serde_json::{json, Value};

use crate::decimal::{format_percent, format_truncated, to_f64, Decimal};
use crate::model::{
    loss_exposure, paper_loss_bound, unavailability, write_quorum_unavailability, Component, Consistency, Deployment,
    Reading, Unavailability,
};
use crate::plot::{self, Overlay, PlotOptions};
use crate::recommend::{recommend, Recommendation};
use crate::simulate::{simulate, Estimate, Rates, SimulationConfig, SimulationReport};
use crate::table::{self, PaperTable, Table};

/// Simulated years when --years is not given.
pub const YEARS_DEFAULT: f64 = 10_000.0;
/// Mean time to repair when only an availability or a load is given, in hours: the paper's
/// "1-day outage every 4 months is 99 % available".
pub const MEAN_REPAIR_HOURS_DEFAULT: f64 = 24.0;
/// Seed when --seed is not given.
pub const SEED_DEFAULT: u64 = 1;

const EXAMPLES: &str = "\
Examples:
  starfish availability --elements 3 --quorum 2 --element-availability 99% --read-only
  starfish availability --elements 3 --quorum 1 --failure-rate 0.0004 --repair-rate 0.04 --json
  starfish availability --table 2 --paper-rho
  starfish availability --recommend --target-nines 6 --element-availability 99.9%
  starfish availability --elements 3 --quorum 2 --rho 0.1 --simulate --years 20000 --seed 7
  starfish availability --plot figure3 --out figure3.png --simulate";

/// Availability and reliability of N elements with write quorum Q (the StarFish paper, section 4).
///
/// Availabilities are fractions (0.99) or percentages (99%); rates are per hour. Without
/// --table, --recommend or --plot, evaluates one deployment (--elements, --quorum and the
/// elements' availability, load or rates).
#[derive(clap::Args, Debug, Clone, Default)]
#[command(after_help = EXAMPLES)]
pub struct AvailabilityArgs {
    /// Number of elements (replicas), N.
    #[arg(long, allow_negative_numbers = true, value_name = "N")]
    pub elements: Option<u32>,

    /// Write quorum, Q: how many elements acknowledge a write before the host is answered.
    #[arg(long, allow_negative_numbers = true, value_name = "Q")]
    pub quorum: Option<u32>,

    /// Read-only consistency (the paper's Eq. 2): with fewer than Q elements up the volume stays
    /// readable. Without it, availability is the write quorum's (Eq. 1).
    #[arg(long)]
    pub read_only: bool,

    /// Each element's availability A, e.g. 0.99 or 99%.
    #[arg(long, allow_negative_numbers = true, value_name = "A", conflicts_with_all = ["rho", "failure_rate", "repair_rate"])]
    pub element_availability: Option<Decimal>,

    /// Each element's load ρ = λ/μ, instead of --element-availability.
    #[arg(long, allow_negative_numbers = true, value_name = "RHO", conflicts_with_all = ["failure_rate", "repair_rate"])]
    pub rho: Option<Decimal>,

    /// Each element's failure rate λ per hour (with --repair-rate).
    #[arg(long, allow_negative_numbers = true, value_name = "LAMBDA", requires = "repair_rate")]
    pub failure_rate: Option<Decimal>,

    /// Each element's repair rate μ per hour (with --failure-rate).
    #[arg(long, allow_negative_numbers = true, value_name = "MU", requires = "failure_rate")]
    pub repair_rate: Option<Decimal>,

    /// The host element's availability (default: the elements'; for --table 2, 99.99%).
    #[arg(long, allow_negative_numbers = true, value_name = "B", conflicts_with_all = ["he_rho", "he_failure_rate", "he_repair_rate"])]
    pub he_availability: Option<Decimal>,

    /// The host element's load ρ_he, instead of --he-availability.
    #[arg(long, allow_negative_numbers = true, value_name = "RHO", conflicts_with_all = ["he_failure_rate", "he_repair_rate"])]
    pub he_rho: Option<Decimal>,

    /// The host element's failure rate per hour (with --he-repair-rate).
    #[arg(long, allow_negative_numbers = true, value_name = "LAMBDA", requires = "he_repair_rate")]
    pub he_failure_rate: Option<Decimal>,

    /// The host element's repair rate per hour (with --he-failure-rate).
    #[arg(long, allow_negative_numbers = true, value_name = "MU", requires = "he_failure_rate")]
    pub he_repair_rate: Option<Decimal>,

    /// Read every availability A the way the paper's tables do, as the load ρ = 1 − A
    /// (99% becomes ρ = 0.01, a true availability of 99.0099%).
    #[arg(long)]
    pub paper_rho: bool,

    /// Print the paper's Table 1 (write quorum) or Table 2 (read-only consistency), computed.
    #[arg(long, value_name = "1|2", value_parser = clap::value_parser!(u8).range(1..=2))]
    pub table: Option<u8>,

    /// The smallest N and Q that reach --target-nines, with and without read-only consistency.
    #[arg(long, requires = "target_nines")]
    pub recommend: bool,

    /// The availability to reach with --recommend, in nines (6 is 99.9999%).
    #[arg(long, value_name = "K", requires = "recommend")]
    pub target_nines: Option<u32>,

    /// Also simulate failures and repairs and report the simulated availability with a 95%
    /// confidence interval next to the closed form (with --plot: draw simulated points).
    #[arg(long)]
    pub simulate: bool,

    /// Seed of the simulation [default: 1]; a seed replays exactly.
    #[arg(long, value_name = "S", requires = "simulate")]
    pub seed: Option<u64>,

    /// Simulated time in years [default: 10000].
    #[arg(long, allow_negative_numbers = true, value_name = "Y", requires = "simulate")]
    pub years: Option<f64>,

    /// Mean time to repair in hours, for the simulation of components given by availability
    /// or load [default: 24].
    #[arg(long, allow_negative_numbers = true, value_name = "HOURS", requires = "simulate")]
    pub mttr_hours: Option<f64>,

    /// Draw the paper's Figure 3 or Figure 4 as a PNG into --out.
    #[arg(long, value_enum, value_name = "FIGURE", requires = "out")]
    pub plot: Option<PlotFigure>,

    /// The PNG file --plot writes.
    #[arg(long, value_name = "FILE.png", requires = "plot")]
    pub out: Option<PathBuf>,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotFigure {
    /// Q = 1, N = 1..6, availability against the element load ρ.
    Figure3,
    /// N = 3, Q = 1..3, read-only consistency, against the HE load.
    Figure4,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    #[error("choose one of --table, --recommend and --plot")]
    ModesConflict,
    #[error("{flag} does not apply to {mode}")]
    NotApplicable { flag: &'static str, mode: &'static str },
    #[error("{flag} is required {purpose}")]
    Missing { flag: &'static str, purpose: &'static str },
    #[error(
        "give the elements' availability: --element-availability A, --rho ρ, or --failure-rate λ \
         with --repair-rate μ"
    )]
    MissingElement,
    #[error("there is no Table {0}: --table takes 1 or 2")]
    NoSuchTable(u8),
}

enum Mode {
    Evaluate,
    Table(PaperTable),
    Recommend(u32),
    Plot(PlotFigure, PathBuf),
}

pub fn run(args: &AvailabilityArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let text = match mode(args)? {
        Mode::Evaluate => evaluate(args)?,
        Mode::Table(which) => print_table(args, which)?,
        Mode::Recommend(target) => print_recommendations(args, target)?,
        Mode::Plot(figure, path) => draw_plot(args, figure, &path)?,
    };
    out.write_all(text.as_bytes()).context("cannot write the output")?;
    Ok(())
}

fn mode(args: &AvailabilityArgs) -> Result<Mode, UsageError> {
    let chosen = [args.table.is_some(), args.recommend, args.plot.is_some()];
    if chosen.iter().filter(|&&c| c).count() > 1 {
        return Err(UsageError::ModesConflict);
    }
    let not_for = |mode: &'static str, flags: &[(&'static str, bool)]| match flags.iter().find(|(_, given)| *given) {
        Some(&(flag, _)) => Err(UsageError::NotApplicable { flag, mode }),
        None => Ok(()),
    };
    let deployment_flags =
        [("--elements", args.elements.is_some()), ("--quorum", args.quorum.is_some()), ("--read-only", args.read_only)];
    let element_flags = [
        ("--element-availability", args.element_availability.is_some()),
        ("--rho", args.rho.is_some()),
        ("--failure-rate", args.failure_rate.is_some()),
    ];
    if let Some(which) = args.table {
        not_for("--table", &deployment_flags)?;
        not_for("--table", &element_flags)?;
        not_for("--table", &[("--simulate", args.simulate)])?;
        let which = match which {
            1 => PaperTable::One,
            2 => PaperTable::Two,
            other => return Err(UsageError::NoSuchTable(other)),
        };
        if which == PaperTable::One {
            not_for(
                "--table 1 (Eq. 1 has no HE)",
                &[
                    ("--he-availability", args.he_availability.is_some()),
                    ("--he-rho", args.he_rho.is_some()),
                    ("--he-failure-rate", args.he_failure_rate.is_some()),
                ],
            )?;
        }
        return Ok(Mode::Table(which));
    }
    if args.recommend {
        not_for("--recommend", &deployment_flags[..2])?;
        not_for("--recommend", &[("--read-only (both are shown)", args.read_only), ("--simulate", args.simulate)])?;
        let target =
            args.target_nines.ok_or(UsageError::Missing { flag: "--target-nines", purpose: "with --recommend" })?;
        return Ok(Mode::Recommend(target));
    }
    if let Some(figure) = args.plot {
        let path = args.out.as_ref().ok_or(UsageError::Missing { flag: "--out", purpose: "with --plot" })?;
        not_for("--plot", &deployment_flags)?;
        not_for("--plot", &[("--json", args.json)])?;
        if figure == PlotFigure::Figure3 {
            not_for("--plot figure3 (it spans the element load)", &element_flags)?;
        }
        return Ok(Mode::Plot(figure, path.clone()));
    }
    const EVALUATE: &str = "to evaluate a deployment (or use --table, --recommend or --plot)";
    if args.elements.is_none() {
        return Err(UsageError::Missing { flag: "--elements", purpose: EVALUATE });
    }
    if args.quorum.is_none() {
        return Err(UsageError::Missing { flag: "--quorum", purpose: EVALUATE });
    }
    Ok(Mode::Evaluate)
}

/// A component as given on the command line, with how it was given.
struct Given {
    component: Component,
    /// Explicit rates per hour, if given as rates.
    rates: Option<(f64, f64)>,
    /// What to print about where the figure came from, if not from the user.
    note: Option<&'static str>,
}

fn reading(args: &AvailabilityArgs) -> Reading {
    if args.paper_rho {
        Reading::PaperLoad
    } else {
        Reading::Exact
    }
}

fn component(
    reading: Reading,
    names: [&'static str; 4],
    availability: Option<&Decimal>,
    load: Option<&Decimal>,
    rates: Option<(&Decimal, &Decimal)>,
) -> anyhow::Result<Option<Given>> {
    if let Some(a) = availability {
        let component =
            Component::from_availability_read(a.value(), reading).with_context(|| format!("{} {a}", names[0]))?;
        return Ok(Some(Given { component, rates: None, note: None }));
    }
    if let Some(rho) = load {
        let component = Component::from_load(rho.value()).with_context(|| format!("{} {rho}", names[1]))?;
        return Ok(Some(Given { component, rates: None, note: None }));
    }
    if let Some((failure, repair)) = rates {
        let component = Component::from_rates(failure.value(), repair.value())
            .with_context(|| format!("{} {failure} {} {repair}", names[2], names[3]))?;
        let rates = Some((to_f64(failure.value()), to_f64(repair.value())));
        return Ok(Some(Given { component, rates, note: None }));
    }
    Ok(None)
}

fn element(args: &AvailabilityArgs) -> anyhow::Result<Given> {
    let rates = args.failure_rate.as_ref().zip(args.repair_rate.as_ref());
    component(
        reading(args),
        ["--element-availability", "--rho", "--failure-rate", "--repair-rate"],
        args.element_availability.as_ref(),
        args.rho.as_ref(),
        rates,
    )?
    .ok_or_else(|| UsageError::MissingElement.into())
}

/// The HE as given, else `default` (with a note saying so).
fn he(args: &AvailabilityArgs, default: impl FnOnce() -> anyhow::Result<Given>) -> anyhow::Result<Given> {
    let rates = args.he_failure_rate.as_ref().zip(args.he_repair_rate.as_ref());
    let given = component(
        reading(args),
        ["--he-availability", "--he-rho", "--he-failure-rate", "--he-repair-rate"],
        args.he_availability.as_ref(),
        args.he_rho.as_ref(),
        rates,
    )?;
    match given {
        Some(given) => Ok(given),
        None => default(),
    }
}

fn simulation_rates(given: &Given, mean_repair_hours: f64) -> anyhow::Result<Rates> {
    Ok(match given.rates {
        Some((failure, repair)) => Rates::new(failure, repair)?,
        None => Rates::from_component(&given.component, mean_repair_hours)?,
    })
}

fn evaluate(args: &AvailabilityArgs) -> anyhow::Result<String> {
    let deployment =
        Deployment::new(args.elements.expect("checked by mode()"), args.quorum.expect("checked by mode()"))?;
    let consistency = if args.read_only { Consistency::ReadOnly } else { Consistency::WriteQuorum };
    let element = element(args)?;
    let he = he(args, || {
        Ok(Given { component: element.component.clone(), rates: element.rates, note: Some("same as the elements") })
    })?;
    let result = unavailability(deployment, consistency, &element.component, &he.component);
    let writes = write_quorum_unavailability(deployment, &element.component);
    let exposure = loss_exposure(deployment, &element.component, &he.component);
    let bound = paper_loss_bound(deployment);
    let simulation = if args.simulate {
        let mean_repair_hours = args.mttr_hours.unwrap_or(MEAN_REPAIR_HOURS_DEFAULT);
        Some(simulate(&SimulationConfig {
            deployment,
            element: simulation_rates(&element, mean_repair_hours)?,
            he: simulation_rates(&he, mean_repair_hours)?,
            years: args.years.unwrap_or(YEARS_DEFAULT),
            seed: args.seed.unwrap_or(SEED_DEFAULT),
        })?)
    } else {
        None
    };
    let closed_forms = ClosedForms {
        write_quorum: writes.clone(),
        read_only: crate::model::read_only_unavailability(deployment, &element.component, &he.component),
        exposure: exposure.clone(),
    };

    if args.json {
        let mut value = json!({
            "elements": deployment.elements(),
            "quorum": deployment.quorum(),
            "consistency": consistency.name(),
            "equation": consistency.equation(),
            "element": component_json(&element.component),
            "he": component_json(&he.component),
        });
        merge(&mut value, measure_json(&result));
        if consistency == Consistency::ReadOnly {
            value["write_quorum"] = measure_json(&writes);
        }
        value["reliability"] = json!({
            "data_loss_possible": deployment.can_lose_data(),
            "paper_loss_bound": bound.as_ref().map(to_f64),
            "loss_exposure": exposure.as_ref().map(to_f64),
        });
        if let Some(report) = &simulation {
            value["simulation"] = simulation_json(report, &closed_forms);
        }
        return Ok(format!("{}\n", serde_json::to_string_pretty(&value)?));
    }

    let mut text = String::new();
    let (n, q) = (deployment.elements(), deployment.quorum());
    let what = match consistency {
        Consistency::WriteQuorum => "available while Q elements are up (the paper's Eq. 1)",
        Consistency::ReadOnly => "read-only consistency (the paper's Eq. 2)",
    };
    writeln!(text, "N = {n} elements, write quorum Q = {q}: {what}")?;
    writeln!(text, "  element availability   {}", describe_component(&element))?;
    writeln!(text, "  HE availability        {}", describe_component(&he))?;
    writeln!(text)?;
    writeln!(text, "  availability           {} %  ({})", availability_percent(&result), nines(&result))?;
    writeln!(text, "  unavailability         {:.4e}", result.to_f64())?;
    writeln!(text, "  expected downtime      {} per year", duration(result.downtime_minutes_per_year()))?;
    match consistency {
        Consistency::WriteQuorum => writeln!(
            text,
            "  (Eq. 1 counts elements only: the paper assumes a backup HE always takes over.\n   \
             The HE's availability enters read-only consistency and the loss exposure.)"
        )?,
        Consistency::ReadOnly => writeln!(
            text,
            "  writes (Eq. 1)         {} %  ({}); reads go on without them",
            availability_percent(&writes),
            nines(&writes)
        )?,
    }
    writeln!(text)?;
    let half = n / 2;
    let holders = if q == 1 { "the element that holds".to_string() } else { format!("the {q} elements that hold") };
    match (&bound, &exposure) {
        (Some(bound), Some(exposure)) => {
            writeln!(text, "  data loss              possible, as Q = {q} ≤ ⌊N/2⌋ = {half}: if the HE and {holders}")?;
            writeln!(text, "                         the latest writes fail together, the writes still in the HE's")?;
            writeln!(text, "                         write queue are lost (the paper's section 4.2)")?;
            writeln!(text, "  paper's bound          1/4^Q = {}", to_f64(bound))?;
            writeln!(
                text,
                "  loss exposure          {:.4e}: steady-state probability that the HE and {holders}",
                to_f64(exposure)
            )?;
            writeln!(text, "                         the latest writes are down together")?;
        }
        _ => {
            writeln!(
                text,
                "  data loss              not possible while Q elements survive: Q = {q} > ⌊N/2⌋ = {half},"
            )?;
            writeln!(text, "                         so every two write quorums share an element")?;
        }
    }
    if let Some(report) = &simulation {
        writeln!(text)?;
        text.push_str(&simulation_text(report, &closed_forms, deployment));
    }
    Ok(text)
}

struct ClosedForms {
    write_quorum: Unavailability,
    read_only: Unavailability,
    exposure: Option<BigRational>,
}

fn simulation_text(report: &SimulationReport, closed: &ClosedForms, deployment: Deployment) -> String {
    let config = &report.config;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "Simulation: {} years, seed {}; elements λ = {:.4e}/h, μ = {:.4e}/h; HE λ = {:.4e}/h, μ = {:.4e}/h",
        config.years,
        config.seed,
        config.element.failure_per_hour(),
        config.element.repair_per_hour(),
        config.he.failure_per_hour(),
        config.he.repair_per_hour(),
    );
    let _ = writeln!(
        text,
        "  {:<22} {:>12}  {:<36} {:>9}",
        "unavailability", "closed form", "simulated [95 % interval]", "outages"
    );
    let mut rows = vec![
        ("write quorum (Eq. 1)", closed.write_quorum.to_f64(), report.write_quorum),
        ("read-only (Eq. 2)", closed.read_only.to_f64(), report.read_only),
    ];
    if let (true, Some(exposure)) = (deployment.can_lose_data(), &closed.exposure) {
        rows.push(("loss exposure", to_f64(exposure), report.loss_exposure));
    }
    for (name, expected, estimate) in rows {
        let (low, high) = estimate.interval_95();
        let simulated = format!("{:.4e} [{:.3e}, {:.3e}]", estimate.unavailability, low, high);
        let _ = writeln!(
            text,
            "  {name:<22} {expected:>12.4e}  {simulated:<36} {:>9}  {}",
            estimate.outages,
            verdict(&estimate, expected)
        );
    }
    let _ = writeln!(
        text,
        "  {} element failures, {} HE failures, {} events",
        report.element_failures, report.he_failures, report.events
    );
    text
}

fn verdict(estimate: &Estimate, expected: f64) -> &'static str {
    if estimate.outages == 0 {
        "no outage simulated: beyond what this run resolves"
    } else if estimate.outages < 100 {
        "few outages: a rough estimate"
    } else if estimate.contains(expected) {
        "agrees"
    } else {
        "outside the interval (expected 1 time in 20)"
    }
}

fn simulation_json(report: &SimulationReport, closed: &ClosedForms) -> Value {
    let estimate = |e: &Estimate, expected: f64| {
        let (low, high) = e.interval_95();
        json!({
            "closed_form": expected,
            "unavailability": e.unavailability,
            "interval_95": [low, high],
            "availability": 1.0 - e.unavailability,
            "outages": e.outages,
            "contains_closed_form": e.contains(expected),
        })
    };
    let config = &report.config;
    json!({
        "years": config.years,
        "seed": config.seed,
        "element_rates_per_hour": {"failure": config.element.failure_per_hour(), "repair": config.element.repair_per_hour()},
        "he_rates_per_hour": {"failure": config.he.failure_per_hour(), "repair": config.he.repair_per_hour()},
        "write_quorum": estimate(&report.write_quorum, closed.write_quorum.to_f64()),
        "read_only": estimate(&report.read_only, closed.read_only.to_f64()),
        "loss_exposure": closed.exposure.as_ref().map(|x| estimate(&report.loss_exposure, to_f64(x))),
        "element_failures": report.element_failures,
        "he_failures": report.he_failures,
        "events": report.events,
    })
}

fn print_table(args: &AvailabilityArgs, which: PaperTable) -> anyhow::Result<String> {
    let he = match (which, &args.he_availability, &args.he_rho, &args.he_failure_rate) {
        (PaperTable::Two, None, Some(_), _) | (PaperTable::Two, None, _, Some(_)) => {
            anyhow::bail!("--table 2 takes the HE as --he-availability")
        }
        (_, he, _, _) => he.as_ref().map(|d| d.value()),
    };
    let table = table::compute(which, reading(args), he).context("--he-availability")?;
    if args.json {
        return Ok(format!("{}\n", serde_json::to_string_pretty(&table_json(&table))?));
    }
    Ok(table.to_string())
}

fn table_json(table: &Table) -> Value {
    let rows: Vec<Value> = table
        .rows
        .iter()
        .map(|row| {
            let cells: Vec<Value> = row
                .cells
                .iter()
                .map(|cell| {
                    json!({
                        "quorum": cell.deployment.quorum(),
                        "elements": cell.deployment.elements(),
                        "nines": cell.unavailability.nines(),
                        "paper_nines": cell.paper_nines,
                        "unavailability": cell.unavailability.to_f64(),
                    })
                })
                .collect();
            json!({
                "element_availability": to_f64(&row.element_availability),
                "element": component_json(&row.element),
                "cells": cells,
            })
        })
        .collect();
    json!({
        "table": match table.which { PaperTable::One => 1, PaperTable::Two => 2 },
        "reading": match table.reading { Reading::Exact => "exact", Reading::PaperLoad => "paper-rho" },
        "he_availability": table.he_availability.as_ref().map(to_f64),
        "differences_from_paper": table.differences(),
        "rows": rows,
    })
}

fn print_recommendations(args: &AvailabilityArgs, target: u32) -> anyhow::Result<String> {
    let element = element(args)?;
    let he = he(args, || {
        Ok(Given { component: element.component.clone(), rates: None, note: Some("same as the elements") })
    })?;
    let recommendations = recommend(target, &element.component, &he.component)?;
    if args.json {
        let list: Vec<Value> = recommendations.iter().map(recommendation_json).collect();
        let value = json!({
            "target_nines": target,
            "element": component_json(&element.component),
            "he": component_json(&he.component),
            "recommendations": list,
        });
        return Ok(format!("{}\n", serde_json::to_string_pretty(&value)?));
    }
    let mut text = String::new();
    writeln!(text, "Smallest N, then Q, with at least {target} nines (unavailability ≤ 1e-{target})")?;
    writeln!(text, "  element availability   {}", describe_component(&element))?;
    writeln!(text, "  HE availability        {}", describe_component(&he))?;
    writeln!(text)?;
    writeln!(
        text,
        "  {:<36} {:>3} {:>3}  {:<14} {:<26} reads, read-only (Eq. 2)",
        "goal", "N", "Q", "can lose data", "writes (Eq. 1)"
    )?;
    for recommendation in &recommendations {
        let goal = recommendation.goal;
        let name = format!(
            "{}{}",
            match goal.consistency {
                Consistency::WriteQuorum => "write quorum",
                Consistency::ReadOnly => "read-only consistency",
            },
            if goal.loss_free { ", no data loss" } else { "" }
        );
        match &recommendation.choice {
            Some(choice) => {
                let d = choice.deployment;
                let show = |u: &Unavailability| format!("{} % ({}★9)", availability_percent(u), u.nines());
                writeln!(
                    text,
                    "  {name:<36} {:>3} {:>3}  {:<14} {:<26} {}",
                    d.elements(),
                    d.quorum(),
                    if d.can_lose_data() { "yes" } else { "no" },
                    show(&choice.write_quorum),
                    show(&choice.read_only),
                )?;
            }
            None => writeln!(text, "  {name:<36} not reachable with at most {} elements", crate::model::ELEMENTS_MAX)?,
        }
    }
    Ok(text)
}

fn recommendation_json(recommendation: &Recommendation) -> Value {
    let goal = recommendation.goal;
    let mut value = json!({
        "consistency": goal.consistency.name(),
        "loss_free_only": goal.loss_free,
    });
    match &recommendation.choice {
        Some(choice) => {
            let d = choice.deployment;
            value["elements"] = json!(d.elements());
            value["quorum"] = json!(d.quorum());
            value["can_lose_data"] = json!(d.can_lose_data());
            value["write_quorum"] = measure_json(&choice.write_quorum);
            value["read_only"] = measure_json(&choice.read_only);
        }
        None => {
            value["elements"] = Value::Null;
            value["quorum"] = Value::Null;
        }
    }
    value
}

fn draw_plot(args: &AvailabilityArgs, figure: PlotFigure, path: &std::path::Path) -> anyhow::Result<String> {
    let overlay = args.simulate.then(|| Overlay {
        years: args.years.unwrap_or(YEARS_DEFAULT),
        seed: args.seed.unwrap_or(SEED_DEFAULT),
        mean_repair_hours: args.mttr_hours.unwrap_or(MEAN_REPAIR_HOURS_DEFAULT),
    });
    let element_loads = match figure {
        PlotFigure::Figure3 => Vec::new(),
        PlotFigure::Figure4 => match (&args.element_availability, &args.rho, &args.failure_rate) {
            (None, None, None) => Vec::new(),
            _ => vec![to_f64(&element(args)?.component.load())],
        },
    };
    let figure = match figure {
        PlotFigure::Figure3 => plot::Figure::Three,
        PlotFigure::Figure4 => plot::Figure::Four,
    };
    plot::render(figure, &PlotOptions { overlay, element_loads }, path)
        .with_context(|| format!("--out {}", path.display()))?;
    Ok(format!("wrote {}\n", path.display()))
}

/// The fields every evaluated availability carries in JSON.
fn measure_json(u: &Unavailability) -> Value {
    let nines_fractional = u.nines_fractional();
    json!({
        "availability": u.availability_f64(),
        "unavailability": u.to_f64(),
        "nines": u.nines(),
        "nines_fractional": nines_fractional.is_finite().then_some(nines_fractional),
        "availability_percent": availability_percent(u),
        "downtime_minutes_per_year": u.downtime_minutes_per_year(),
    })
}

fn component_json(component: &Component) -> Value {
    json!({
        "availability": to_f64(&component.up()),
        "unavailability": to_f64(component.down()),
        "load": to_f64(&component.load()),
    })
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(into), Value::Object(from)) = (into, from) {
        into.extend(from);
    }
}

/// Availability in percent, truncated (never rounded up) three digits past its last nine.
fn availability_percent(u: &Unavailability) -> String {
    let nines = usize::try_from(u.nines().min(400)).expect("small");
    let percent = u.availability() * BigRational::from_integer(100.into());
    let text = format_truncated(&percent, nines.saturating_sub(2) + 3);
    let text = text.trim_end_matches('0');
    text.trim_end_matches('.').to_string()
}

fn describe_component(given: &Given) -> String {
    let c = &given.component;
    let mut text = format!(
        "{} %  (load ρ = {:.4e}, unavailability {:.4e})",
        format_percent(&c.up(), 6),
        to_f64(&c.load()),
        to_f64(c.down())
    );
    if let Some((failure, repair)) = given.rates {
        let _ = write!(text, ", λ = {failure}/h, μ = {repair}/h");
    }
    if let Some(note) = given.note {
        let _ = write!(text, ", {note}");
    }
    text
}

fn nines(u: &Unavailability) -> String {
    match u.nines() {
        1 => "1 nine".to_string(),
        k => format!("{k} nines"),
    }
}

/// A downtime per year in the unit that reads best.
fn duration(minutes: f64) -> String {
    if minutes < 1.0 / 60.0 {
        format!("{:.3e} s", minutes * 60.0)
    } else if minutes < 1.0 {
        format!("{:.1} s", minutes * 60.0)
    } else if minutes < 60.0 {
        format!("{minutes:.1} min")
    } else if minutes < 24.0 * 60.0 {
        format!("{:.1} h", minutes / 60.0)
    } else {
        format!("{:.1} days", minutes / (24.0 * 60.0))
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser, Subcommand};

    use super::*;

    /// How the `starfish` binary mounts the arguments: a subcommand beside others.
    #[derive(Parser)]
    struct Starfish {
        #[arg(long, global = true)]
        verbose: bool,
        #[command(subcommand)]
        command: Subcommands,
    }

    #[derive(Subcommand)]
    #[allow(clippy::large_enum_variant)] // as the binary's own enum will be
    enum Subcommands {
        Availability(AvailabilityArgs),
        Other,
    }

    /// Parses `args` as `starfish availability …` and runs it into a buffer.
    fn run_cli(args: &[&str]) -> Result<String, String> {
        let argv = ["starfish", "availability"].iter().chain(args);
        let parsed = Starfish::try_parse_from(argv).map_err(|e| e.to_string())?;
        let Subcommands::Availability(args) = parsed.command else { unreachable!("parsed availability") };
        let mut out = Vec::new();
        run(&args, &mut out).map_err(|e| format!("{e:#}"))?;
        Ok(String::from_utf8(out).expect("UTF-8 output"))
    }

    fn run_json(args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let text = run_cli(&all).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: {e}\n{text}"))
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-300)
    }

    #[test]
    fn arguments_are_valid_as_a_subcommand() {
        Starfish::command().debug_assert();
    }

    #[test]
    fn json_fields() {
        // (arguments, nines, unavailability)
        #[track_caller]
        fn check(args: &[&str], nines: u64, unavailability: f64) {
            let v = run_json(args);
            assert_eq!(v["nines"], nines, "{args:?}: {v}");
            let u = v["unavailability"].as_f64().expect("unavailability");
            assert!(close(u, unavailability), "{args:?}: {u} vs {unavailability}");
            let a = v["availability"].as_f64().expect("availability");
            assert!(close(a, 1.0 - unavailability), "{args:?}: {a}");
            let minutes = v["downtime_minutes_per_year"].as_f64().expect("downtime");
            assert!(close(minutes, unavailability * 525_960.0), "{args:?}: {minutes}");
        }
        check(&["--elements", "1", "--quorum", "1", "--element-availability", "99%"], 2, 1e-2);
        check(&["--elements", "3", "--quorum", "1", "--element-availability", "0.99"], 6, 1e-6);
        check(&["--elements", "3", "--quorum", "2", "--element-availability", "90%"], 1, 0.028);
        check(&["--elements", "3", "--quorum", "3", "--element-availability", "90%"], 0, 0.271);
        check(&["--elements", "3", "--quorum", "2", "--element-availability", "99%", "--read-only"], 5, 1.99e-6);
        check(
            &[
                "--elements",
                "3",
                "--quorum",
                "2",
                "--element-availability",
                "99%",
                "--he-availability",
                "99.99%",
                "--read-only",
            ],
            5,
            1.0099e-6,
        );
        // ρ = 0.01 is the paper's "99 %": 3ρ²/(1+ρ)³·… for Q = 2.
        check(&["--elements", "3", "--quorum", "1", "--rho", "0.01"], 6, 1.0 / 1.01f64.powi(3) * 1e-6);
        // λ = 1/99 per hour, μ = 1 per hour: p = 0.01.
        check(&["--elements", "2", "--quorum", "1", "--failure-rate", "1", "--repair-rate", "99"], 4, 1e-4);
        // Far beyond an f64's resolution next to 1: U is still exact.
        check(&["--elements", "7", "--quorum", "1", "--element-availability", "99.99%"], 28, 1e-28);
    }

    #[test]
    fn headline_claim() {
        // The paper: N = 3, Q = 2, read-only consistency, 99 % elements: 6★9.
        let base = [
            "--elements",
            "3",
            "--quorum",
            "2",
            "--read-only",
            "--element-availability",
            "99%",
            "--he-availability",
            "99.99%",
        ];
        assert_eq!(run_json(&base)["nines"], 5, "A = 99 % exactly falls just short");
        let mut paper = base.to_vec();
        paper.push("--paper-rho");
        assert_eq!(run_json(&paper)["nines"], 6, "ρ = 0.01 reaches it");
    }

    #[test]
    fn reliability_fields() {
        let v = run_json(&[
            "--elements",
            "3",
            "--quorum",
            "1",
            "--element-availability",
            "99%",
            "--he-availability",
            "90%",
        ]);
        assert_eq!(v["reliability"]["data_loss_possible"], true);
        assert!(close(v["reliability"]["paper_loss_bound"].as_f64().expect("bound"), 0.25));
        assert!(close(v["reliability"]["loss_exposure"].as_f64().expect("exposure"), 1e-3));
        let v = run_json(&["--elements", "3", "--quorum", "2", "--element-availability", "99%"]);
        assert_eq!(v["reliability"]["data_loss_possible"], false);
        assert!(v["reliability"]["paper_loss_bound"].is_null());
        assert!(v["reliability"]["loss_exposure"].is_null());
    }

    #[test]
    fn read_only_json_carries_writes_too() {
        let v = run_json(&["--elements", "3", "--quorum", "2", "--element-availability", "90%", "--read-only"]);
        assert_eq!(v["consistency"], "read-only");
        assert_eq!(v["write_quorum"]["nines"], 1);
        assert!(close(v["write_quorum"]["unavailability"].as_f64().expect("u"), 0.028));
    }

    #[test]
    fn tables() {
        // (arguments, cells that differ from the paper)
        #[track_caller]
        fn check(args: &[&str], differences: u64) {
            let v = run_json(args);
            assert_eq!(v["differences_from_paper"], differences, "{args:?}");
            assert_eq!(v["rows"].as_array().expect("rows").len(), 4);
        }
        check(&["--table", "1"], 1);
        check(&["--table", "1", "--paper-rho"], 0);
        check(&["--table", "2"], 20);
        check(&["--table", "2", "--paper-rho"], 0);
        check(&["--table", "2", "--paper-rho", "--he-availability", "99.99%"], 0);
        let text = run_cli(&["--table", "2", "--paper-rho"]).expect("runs");
        assert!(text.contains("Every cell matches the paper."), "{text}");
    }

    #[test]
    fn recommendations() {
        let v = run_json(&["--recommend", "--target-nines", "6", "--element-availability", "99%"]);
        let got: Vec<(u64, u64, bool)> = v["recommendations"]
            .as_array()
            .expect("list")
            .iter()
            .map(|r| {
                (
                    r["elements"].as_u64().expect("N"),
                    r["quorum"].as_u64().expect("Q"),
                    r["can_lose_data"].as_bool().expect("flag"),
                )
            })
            .collect();
        assert_eq!(got, [(3, 1, true), (7, 4, false), (3, 3, false), (3, 3, false)]);
        let text = run_cli(&["--recommend", "--target-nines", "6", "--element-availability", "99%"]).expect("runs");
        assert!(text.contains("write quorum, no data loss"), "{text}");
    }

    #[test]
    fn simulation_next_to_closed_form() {
        let v = run_json(&[
            "--elements",
            "3",
            "--quorum",
            "1",
            "--rho",
            "0.25",
            "--simulate",
            "--years",
            "1500",
            "--seed",
            "3",
        ]);
        let simulation = &v["simulation"];
        for what in ["write_quorum", "read_only", "loss_exposure"] {
            let estimate = &simulation[what];
            assert_eq!(estimate["contains_closed_form"], true, "{what}: {simulation}");
            assert!(estimate["outages"].as_u64().expect("outages") > 500, "{what}: {simulation}");
        }
        assert_eq!(simulation["seed"], 3);
        let text = run_cli(&["--elements", "3", "--quorum", "2", "--rho", "0.25", "--simulate", "--years", "300"])
            .expect("runs");
        assert!(text.contains("Simulation: 300 years, seed 1"), "{text}");
        assert!(text.contains("agrees"), "{text}");
    }

    #[test]
    fn human_output() {
        let text = run_cli(&["--elements", "3", "--quorum", "2", "--element-availability", "99%", "--read-only"])
            .expect("runs");
        for expected in
            ["availability           99.999801 %  (5 nines)", "writes (Eq. 1)", "data loss              not possible"]
        {
            assert!(text.contains(expected), "{expected:?} in\n{text}");
        }
        let text = run_cli(&["--elements", "2", "--quorum", "1", "--element-availability", "90%"]).expect("runs");
        assert!(text.contains("(2 nines)"), "{text}");
        assert!(text.contains("1/4^Q = 0.25"), "{text}");
    }

    #[test]
    fn plots_write_png_files() {
        let dir = std::env::temp_dir().join(format!("availability-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        for figure in ["figure3", "figure4"] {
            let path = dir.join(format!("{figure}.png"));
            let path_text = path.to_str().expect("UTF-8 path");
            let text = run_cli(&["--plot", figure, "--out", path_text]).expect("draws");
            assert!(text.starts_with("wrote "), "{text}");
            let bytes = std::fs::read(&path).expect("the PNG exists");
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{figure}");
            assert!(bytes.len() > 20_000, "{figure}: {} bytes", bytes.len());
        }
        let missing = dir.join("no-such-directory").join("f.png");
        let error =
            run_cli(&["--plot", "figure4", "--out", missing.to_str().expect("UTF-8")]).expect_err("cannot write");
        assert!(error.contains("--out"), "{error}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn arguments_built_in_code_are_checked_too() {
        // (arguments clap would have refused, part of the message)
        #[track_caller]
        fn check(args: AvailabilityArgs, message: &str) {
            let error = run(&args, &mut Vec::new()).expect_err("must fail").to_string();
            assert!(error.contains(message), "{error:?} lacks {message:?}");
        }
        check(
            AvailabilityArgs { plot: Some(PlotFigure::Figure3), ..Default::default() },
            "--out is required with --plot",
        );
        check(
            AvailabilityArgs { recommend: true, ..Default::default() },
            "--target-nines is required with --recommend",
        );
        check(AvailabilityArgs { table: Some(7), ..Default::default() }, "no Table 7");
        check(AvailabilityArgs::default(), "--elements is required");
    }

    #[test]
    fn bad_input_is_an_error_never_a_panic() {
        // (arguments, part of the message)
        #[track_caller]
        fn check(args: &[&str], message: &str) {
            let error = run_cli(args).expect_err("must fail");
            assert!(error.contains(message), "{args:?}: {error:?} lacks {message:?}");
        }
        let a = "--element-availability";
        check(&["--elements", "3", "--quorum", "2", a, "1.2"], "strictly between 0 and 1");
        check(&["--elements", "3", "--quorum", "2", a, "100%"], "strictly between 0 and 1");
        check(&["--elements", "3", "--quorum", "2", a, "0"], "strictly between 0 and 1");
        check(&["--elements", "3", "--quorum", "2", a, "-0.5"], "strictly between 0 and 1");
        check(&["--elements", "3", "--quorum", "2", a, "ninety"], "not a number");
        check(&["--elements", "3", "--quorum", "4", a, "0.9"], "1 ≤ Q ≤ N = 3, got Q = 4");
        check(&["--elements", "3", "--quorum", "0", a, "0.9"], "got Q = 0");
        check(&["--elements", "0", "--quorum", "1", a, "0.9"], "at least one element");
        check(&["--elements", "65", "--quorum", "1", a, "0.9"], "at most 64 elements");
        check(&["--elements", "-1", "--quorum", "1", a, "0.9"], "--elements");
        check(&["--quorum", "1", a, "0.9"], "--elements is required");
        check(&["--elements", "3", a, "0.9"], "--quorum is required");
        check(&["--elements", "3", "--quorum", "2"], "give the elements' availability");
        check(&["--elements", "3", "--quorum", "2", a, "0.9", "--rho", "0.1"], "cannot be used with");
        check(&["--elements", "3", "--quorum", "2", "--rho", "0"], "the load ρ must be greater than 0");
        check(&["--elements", "3", "--quorum", "2", "--failure-rate", "1"], "--repair-rate");
        check(
            &["--elements", "3", "--quorum", "2", "--failure-rate", "0", "--repair-rate", "1"],
            "failure rate must be greater than 0",
        );
        check(&["--elements", "3", "--quorum", "2", a, "0.9", "--he-availability", "1"], "--he-availability 1");
        check(
            &["--elements", "3", "--quorum", "2", a, "0.9", "--simulate", "--years", "-1"],
            "simulated time in years",
        );
        check(
            &["--elements", "3", "--quorum", "2", a, "0.9", "--simulate", "--mttr-hours", "0"],
            "mean time to repair",
        );
        check(&["--elements", "3", "--quorum", "2", "--rho", "1", "--simulate", "--years", "1e12"], "fewer years");
        check(&["--elements", "3", "--quorum", "2", a, "0.9", "--years", "10"], "--simulate");
        check(&["--table", "3"], "--table");
        check(&["--table", "1", "--elements", "3"], "--elements does not apply to --table");
        check(&["--table", "1", "--he-availability", "0.9"], "Eq. 1 has no HE");
        check(&["--table", "2", "--he-availability", "2"], "strictly between 0 and 1");
        check(&["--table", "1", "--recommend", "--target-nines", "3"], "choose one of");
        check(&["--recommend", a, "0.9"], "--target-nines");
        check(&["--recommend", "--target-nines", "0", a, "0.9"], "between 1 and 30 nines");
        check(&["--recommend", "--target-nines", "31", a, "0.9"], "between 1 and 30 nines");
        check(&["--recommend", "--target-nines", "3"], "give the elements' availability");
        check(&["--recommend", "--target-nines", "3", a, "0.9", "--elements", "3"], "--elements does not apply");
        check(&["--plot", "figure3"], "--out");
        check(&["--plot", "figure5", "--out", "x.png"], "figure5");
        check(&["--plot", "figure3", "--out", "x.png", a, "0.9"], "spans the element load");
        check(&["--out", "x.png"], "--plot");
    }
}
