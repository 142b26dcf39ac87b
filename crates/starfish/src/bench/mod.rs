//! `starfish bench t5|t6|t7`: the StarFish paper's section 6 (Tables 5–7) on this machine, with
//! real processes — elements and a host element started from this binary, emulated WAN links
//! ([`netem::Proxy`]) in front of the near and far elements, and real NBD clients (fio's nbd
//! engine; nbdfuse + loop + ext4 + PostMark) — side by side with two baselines measured in the
//! same run: direct-attached (one local element, N=1 Q=1, no link) and one disk at the near
//! site (the same, behind the near link).

mod cluster;
mod failover;
mod fio;
mod nbd_client;
mod plot;
mod process;
mod smfs;
mod t5;
mod t6;
mod t7;
mod tls;
mod volume_ops;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use serde_json::{Map, Value};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Which of the paper's tables to reproduce.
    #[arg(value_enum)]
    table: Table,
    /// A reduced set that runs in well under a minute (tiny counts, one or two configurations).
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    /// The paper's whole grid of configurations (T5: about 8 minutes).
    #[arg(long)]
    full: bool,
    /// One JSON object per row (JSON lines) instead of tables.
    #[arg(long)]
    json: bool,
    /// Also write PNG plots into this directory (t5.png, t7.png).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Where element data and scratch directories go (removed afterwards).
    #[arg(long, default_value = "/tmp")]
    work_dir: PathBuf,
    /// Print (and with --plot draw) the rows of an earlier `--json` run of this table, saved in
    /// FILE, instead of running it.
    #[arg(long, value_name = "FILE")]
    rows: Option<PathBuf>,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    T5,
    T6,
    T7,
    /// Takeover times and the client's gap: manual, graceful and automatic (etcd).
    Failover,
    /// What mutual TLS and NBD over TLS cost: the same fio jobs against a plain and a TLS
    /// cluster in one run.
    Tls,
    /// The SMFS evaluation: rolling disaster, latency and throughput of the far-site
    /// mirroring modes over an emulated lossy WAN link (needs root).
    Smfs,
    /// The Slice paper's Fig. 4 shape: volume-creation latency against offered load with no
    /// intention log, single commit and group commit.
    VolumeOps,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Quick,
    Default,
    Full,
}

/// What every table's run needs.
#[derive(Debug)]
pub struct Bench {
    /// This binary: `starfish element` and `starfish host` are started from it.
    pub bin: PathBuf,
    pub work: PathBuf,
    pub mode: Mode,
}

impl Bench {
    /// Progress goes to stderr, so stdout holds only the table or the JSON lines.
    pub fn progress(&self, message: &str) {
        eprintln!("bench: {message}");
    }
}

/// One row of a table: the configuration and its figures, as the JSON object `--json` prints.
pub type Row = Map<String, Value>;

pub fn new_row(table: &str, config: &str) -> Row {
    let mut row = Map::new();
    row.insert("table".into(), Value::from(table));
    row.insert("config".into(), Value::from(config));
    row
}

/// Figures are rounded to 4 decimals: more is noise on this machine.
pub fn set_number(row: &mut Row, key: &str, value: f64) {
    let rounded = (value * 1e4).round() / 1e4;
    row.insert(key.into(), Value::from(rounded));
}

pub fn number(row: &Row, key: &str) -> Option<f64> {
    row.get(key).and_then(Value::as_f64)
}

/// A figure for a text table: `-` when absent.
pub fn cell(row: &Row, key: &str, decimals: usize) -> String {
    number(row, key).map_or("-".to_string(), |v| format!("{v:.decimals$}"))
}

pub fn json_lines(rows: &[Row]) -> String {
    let mut out = String::new();
    for row in rows {
        let _ = writeln!(out, "{}", Value::Object(row.clone()));
    }
    out
}

/// A text table: a header line and rows of cells, columns padded to their widest cell.
pub fn text_table(title: &str, header: &[&str], rows: &[Vec<String>], notes: &[String]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| -> String {
        let padded: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = widths[i] - c.chars().count();
                if i == 0 {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect();
        padded.join("  ").trim_end().to_string()
    };
    let mut out = format!("{title}\n");
    let _ = writeln!(out, "{}", line(header.iter().map(|s| s.to_string()).collect()));
    let _ = writeln!(out, "{}", line(widths.iter().map(|w| "-".repeat(*w)).collect()));
    for row in rows {
        let _ = writeln!(out, "{}", line(row.clone()));
    }
    for note in notes {
        let _ = writeln!(out, "{note}");
    }
    out
}

pub fn run(args: BenchArgs) -> Result<()> {
    let mode = match (args.quick, args.full) {
        (true, _) => Mode::Quick,
        (false, true) => Mode::Full,
        (false, false) => Mode::Default,
    };
    let bin = std::env::current_exe().context("finding this binary (to start elements and host elements)")?;
    if !args.work_dir.is_dir() {
        anyhow::bail!("--work-dir {} is not a directory", args.work_dir.display());
    }
    let bench = Bench { bin, work: args.work_dir.clone(), mode };
    let rows = if let Some(file) = &args.rows { read_rows(file, args.table)? } else { run_table(&bench, args.table)? };
    if args.json {
        print!("{}", json_lines(&rows));
    } else {
        let text = match args.table {
            Table::T5 => t5::text(&rows),
            Table::T6 => t6::text(&rows),
            Table::T7 => t7::text(&rows),
            Table::Failover => failover::text(&rows),
            Table::Tls => tls::text(&rows),
            Table::Smfs => smfs::text(&rows),
            Table::VolumeOps => volume_ops::text(&rows),
        };
        print!("{text}");
    }
    if let Some(dir) = &args.plot {
        write_plot(args.table, &rows, dir)?;
    }
    Ok(())
}

fn run_table(bench: &Bench, table: Table) -> Result<Vec<Row>> {
    bench.progress(&format!("load average at the start: {}", load_average()));
    let rows = match table {
        Table::T5 => t5::run(bench)?,
        Table::T6 => t6::run(bench)?,
        Table::T7 => t7::run(bench)?,
        Table::Failover => failover::run(bench)?,
        Table::Tls => tls::run(bench)?,
        Table::Smfs => smfs::run(bench)?,
        Table::VolumeOps => volume_ops::run(bench)?,
    };
    bench.progress(&format!("load average at the end: {}", load_average()));
    Ok(rows)
}

/// The rows of an earlier `--json` run (one JSON object per line).
fn read_rows(file: &Path, table: Table) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let name = table.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let value: Value =
            serde_json::from_str(line).with_context(|| format!("{} line {}: not JSON", file.display(), i + 1))?;
        let Value::Object(row) = value else { anyhow::bail!("{} line {}: not a JSON object", file.display(), i + 1) };
        if row.get("table").and_then(Value::as_str) != Some(name.as_str()) {
            anyhow::bail!("{} line {}: a row of another table than {name}", file.display(), i + 1);
        }
        rows.push(row);
    }
    Ok(rows)
}

/// The machine is shared: the load average says how much the figures can be trusted.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

fn write_plot(table: Table, rows: &[Row], dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = match table {
        Table::T5 => dir.join("t5.png"),
        Table::T7 => dir.join("t7.png"),
        Table::Smfs => dir.join("smfs.png"),
        Table::T6 | Table::Failover | Table::Tls | Table::VolumeOps => {
            eprintln!("bench: no plot for this table (plots are drawn for Tables 5 and 7 and smfs)");
            return Ok(());
        }
    };
    match table {
        Table::T5 => plot::t5(rows, &path)?,
        Table::Smfs => plot::smfs(rows, &path)?,
        _ => plot::t7(rows, &path)?,
    }
    eprintln!("bench: wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_print_as_json_lines_with_rounded_figures() {
        let mut a = new_row("t5", "dark_fiber");
        a.insert("quorum".into(), Value::from(2));
        set_number(&mut a, "write_latency_ms", 3.123456789);
        let b = new_row("t5", "direct");
        let text = json_lines(&[a, b]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        let first: Value = serde_json::from_str(lines[0]).expect("a JSON object per line");
        assert_eq!(first["table"], "t5");
        assert_eq!(first["quorum"], 2);
        assert_eq!(first["write_latency_ms"], 3.1235);
        let second: Value = serde_json::from_str(lines[1]).expect("a JSON object per line");
        assert_eq!(second["config"], "direct");
    }

    #[test]
    fn text_tables_align_columns() {
        let rows = vec![vec!["direct".to_string(), "0.41".to_string()], vec!["Q=2".to_string(), "12.50".to_string()]];
        let text = text_table("T", &["config", "ms"], &rows, &["note".to_string()]);
        assert_eq!(text, "T\nconfig     ms\n------  -----\ndirect   0.41\nQ=2     12.50\nnote\n");
    }
}
