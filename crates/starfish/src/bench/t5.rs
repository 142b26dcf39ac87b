//! Table 5: write latency of single-threaded 8 KiB random writes (fio, nbd engine, iodepth 1)
//! with N=3 elements (local 0 ms, near, far) for Q=1 and Q=2, on dark-fiber links (near and
//! far delay) and Internet links (near 1 ms; far delay and rate), with the same-run baselines.

use anyhow::Result;
use serde_json::Value;

use super::cluster::{Cluster, ClusterSpec, Site};
use super::fio::{self, Job};
use super::process::require_tools;
use super::{cell, new_row, number, set_number, text_table, Bench, Mode, Row};

const VOLUME_BYTES: u64 = 1 << 30;
const BLOCK_BYTES: u64 = 8192;

/// One StarFish configuration of Table 5.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub quorum: usize,
    pub near_ms: f64,
    pub far_ms: f64,
    /// `Some`: an Internet link to the far site; `None`: dark fiber (delay only).
    pub far_rate_mbit: Option<f64>,
}

impl Config {
    pub fn kind(&self) -> &'static str {
        if self.far_rate_mbit.is_some() {
            "internet"
        } else {
            "dark_fiber"
        }
    }

    pub fn sites(&self) -> Vec<Site> {
        vec![
            Site::new("local", 0.0, None),
            Site::new("near", self.near_ms, None),
            Site::new("far", self.far_ms, self.far_rate_mbit),
        ]
    }
}

/// The configurations of a run, in the paper's row order (dark fiber Q=1, Q=2, Internet Q=1,
/// Q=2). The default set is a subset: every near delay with far 8 ms, and four of the fifteen
/// Internet links, spanning the delays and rates.
pub fn grid(mode: Mode) -> Vec<Config> {
    // (near ms, far ms) of dark fiber; (far ms, far Mb/s) of Internet links.
    type Links = Vec<(f64, f64)>;
    let (dark, internet): (Links, Links) = match mode {
        Mode::Quick => (vec![(1.0, 8.0)], vec![]),
        Mode::Default => (
            vec![(1.0, 8.0), (2.0, 8.0), (4.0, 8.0), (8.0, 8.0)],
            vec![(23.0, 124.0), (36.0, 62.0), (65.0, 51.0), (65.0, 31.0)],
        ),
        Mode::Full => {
            let mut dark = Vec::new();
            for near in [1.0, 2.0, 4.0] {
                for far in [4.0, 8.0, 12.0] {
                    dark.push((near, far));
                }
            }
            dark.push((8.0, 8.0));
            let mut internet = Vec::new();
            for far in [23.0, 36.0, 65.0] {
                for rate in [31.0, 51.0, 62.0, 93.0, 124.0] {
                    internet.push((far, rate));
                }
            }
            (dark, internet)
        }
    };
    let mut configs = Vec::new();
    for quorum in [1, 2] {
        for &(near_ms, far_ms) in &dark {
            configs.push(Config { quorum, near_ms, far_ms, far_rate_mbit: None });
        }
    }
    for quorum in [1, 2] {
        for &(far_ms, rate) in &internet {
            configs.push(Config { quorum, near_ms: 1.0, far_ms, far_rate_mbit: Some(rate) });
        }
    }
    configs
}

/// The near delays of a grid, each once, ascending: one near-disk baseline each.
pub fn near_delays(configs: &[Config]) -> Vec<f64> {
    let mut delays: Vec<f64> = configs.iter().map(|c| c.near_ms).collect();
    delays.sort_by(f64::total_cmp);
    delays.dedup();
    delays
}

fn job(mode: Mode) -> Job {
    let (runtime_s, ramp_s) = match mode {
        Mode::Quick => (2, 0),
        Mode::Default | Mode::Full => (6, 1),
    };
    Job {
        rw: "randwrite",
        block_bytes: BLOCK_BYTES,
        jobs: 1,
        range_bytes: VOLUME_BYTES,
        ios_per_job: None,
        runtime_s,
        ramp_s,
        iodepth: 1,
    }
}

/// The mean write latency, and the round trip the host element measured to the near element
/// (heartbeats through the emulated link, idle again after the run).
fn measure(bench: &Bench, sites: Vec<Site>, quorum: usize, label: &str) -> Result<(f64, Option<f64>)> {
    let spec = ClusterSpec {
        sites,
        quorum,
        volume_bytes: VOLUME_BYTES,
        read_cache_bytes: None,
        tls: false,
        host_extra: Vec::new(),
    };
    let mut cluster = Cluster::start(&bench.bin, &bench.work, &spec)?;
    let figures = fio::run(&cluster.uri(), &job(bench.mode), cluster.scratch())?;
    cluster.check_alive()?;
    let near_rtt_ms = cluster.element_rtt_ms("near")?;
    bench.progress(&format!(
        "t5 {label}: write latency {:.3} ms ({} writes); near round trip {}",
        figures.latency_ms,
        figures.ios,
        near_rtt_ms.map_or("-".into(), |ms| format!("{ms:.2} ms"))
    ));
    Ok((figures.latency_ms, near_rtt_ms))
}

fn set_rtt(row: &mut Row, near_rtt_ms: Option<f64>) {
    if let Some(ms) = near_rtt_ms {
        set_number(row, "near_rtt_ms", ms);
    }
}

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    require_tools(&[("fio", "fio")])?;
    let configs = grid(bench.mode);
    let mut rows = Vec::new();
    let (direct, _) = measure(bench, vec![Site::new("local", 0.0, None)], 1, "direct-attached")?;
    let mut baseline = new_row("t5", "direct");
    baseline.insert("elements".into(), Value::from(1));
    baseline.insert("quorum".into(), Value::from(1));
    set_number(&mut baseline, "write_latency_ms", direct);
    rows.push(baseline);
    let mut near_disk = Vec::new();
    for near_ms in near_delays(&configs) {
        let (latency, rtt) = measure(
            bench,
            vec![Site::new("near", near_ms, None)],
            1,
            &format!("one disk at the near site, {near_ms} ms"),
        )?;
        let mut row = new_row("t5", "near_disk");
        row.insert("elements".into(), Value::from(1));
        row.insert("quorum".into(), Value::from(1));
        set_number(&mut row, "near_delay_ms", near_ms);
        set_number(&mut row, "write_latency_ms", latency);
        set_number(&mut row, "direct_write_latency_ms", direct);
        set_rtt(&mut row, rtt);
        rows.push(row);
        near_disk.push((near_ms, latency));
    }
    for config in &configs {
        let label = format!(
            "{} Q={} near {} ms far {} ms{}",
            config.kind(),
            config.quorum,
            config.near_ms,
            config.far_ms,
            config.far_rate_mbit.map_or(String::new(), |r| format!(" {r} Mb/s"))
        );
        let (latency, rtt) = measure(bench, config.sites(), config.quorum, &label)?;
        let near = near_disk.iter().find(|(d, _)| *d == config.near_ms).map(|(_, l)| *l);
        let mut row = config_row(config, latency, direct, near);
        set_rtt(&mut row, rtt);
        rows.push(row);
    }
    Ok(rows)
}

/// A StarFish row with its baselines and, for Q=2, the overhead over the floor the paper names:
/// direct-attached + one near round trip (2 × the one-way delay).
pub fn config_row(config: &Config, latency_ms: f64, direct_ms: f64, near_disk_ms: Option<f64>) -> Row {
    let mut row = new_row("t5", config.kind());
    row.insert("elements".into(), Value::from(3));
    row.insert("quorum".into(), Value::from(config.quorum));
    set_number(&mut row, "near_delay_ms", config.near_ms);
    set_number(&mut row, "far_delay_ms", config.far_ms);
    if let Some(rate) = config.far_rate_mbit {
        set_number(&mut row, "far_rate_mbit", rate);
    }
    set_number(&mut row, "write_latency_ms", latency_ms);
    set_number(&mut row, "direct_write_latency_ms", direct_ms);
    if let Some(near) = near_disk_ms {
        set_number(&mut row, "near_disk_write_latency_ms", near);
    }
    if config.quorum == 2 {
        set_number(&mut row, "overhead_ms", latency_ms - (direct_ms + 2.0 * config.near_ms));
    }
    row
}

pub fn text(rows: &[Row]) -> String {
    let header = [
        "configuration",
        "Q",
        "near ms",
        "far ms/Mb/s",
        "write ms",
        "direct ms",
        "near disk ms",
        "over direct+2×near ms",
        "near RTT ms",
    ];
    let mut lines = Vec::new();
    for row in rows {
        let config = row["config"].as_str().unwrap_or("?");
        let name = match config {
            "direct" => "direct-attached (N=1)",
            "near_disk" => "one disk at near site (N=1)",
            "dark_fiber" => "dark fiber (N=3)",
            "internet" => "Internet (N=3)",
            other => other,
        };
        let far = match (number(row, "far_delay_ms"), number(row, "far_rate_mbit")) {
            (Some(d), Some(r)) => format!("{d}/{r}"),
            (Some(d), None) => format!("{d}"),
            _ => "-".to_string(),
        };
        let quorum = if config == "direct" || config == "near_disk" { "-".to_string() } else { cell(row, "quorum", 0) };
        lines.push(vec![
            name.to_string(),
            quorum,
            cell(row, "near_delay_ms", 0),
            far,
            cell(row, "write_latency_ms", 2),
            cell(row, "direct_write_latency_ms", 2),
            cell(row, "near_disk_write_latency_ms", 2),
            cell(row, "overhead_ms", 2),
            cell(row, "near_rtt_ms", 2),
        ]);
    }
    text_table(
        "Table 5: write latency, single thread, 8 KiB random writes (fio nbd engine, iodepth 1); local element 0 ms",
        &header,
        &lines,
        &["(the paper, Q=2: RAID 2.6 ms; near 1/2/4/8 ms → 3.4/5.3/9.2/17.2 ms)".to_string()],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_hold_the_papers_configurations() {
        // (mode, configurations, Internet ones, near delays)
        let check = |mode: Mode, total: usize, internet: usize, near: &[f64]| {
            let configs = grid(mode);
            assert_eq!(configs.len(), total, "{mode:?}");
            assert_eq!(configs.iter().filter(|c| c.kind() == "internet").count(), internet, "{mode:?}");
            assert_eq!(near_delays(&configs), near, "{mode:?}");
            for c in &configs {
                assert!(c.quorum == 1 || c.quorum == 2);
                if c.kind() == "internet" {
                    assert_eq!(c.near_ms, 1.0);
                }
            }
        };
        check(Mode::Quick, 2, 0, &[1.0]);
        check(Mode::Default, 16, 8, &[1.0, 2.0, 4.0, 8.0]);
        check(Mode::Full, 2 * 10 + 2 * 15, 30, &[1.0, 2.0, 4.0, 8.0]);
    }

    #[test]
    fn q2_rows_carry_the_overhead_over_the_floor() {
        let config = Config { quorum: 2, near_ms: 4.0, far_ms: 8.0, far_rate_mbit: None };
        let row = config_row(&config, 9.0, 0.5, Some(8.7));
        assert_eq!(number(&row, "overhead_ms"), Some(0.5));
        assert_eq!(number(&row, "near_disk_write_latency_ms"), Some(8.7));
        assert!(row.get("far_rate_mbit").is_none());
        let q1 = config_row(&Config { quorum: 1, ..config }, 0.6, 0.5, None);
        assert!(q1.get("overhead_ms").is_none());
        assert!(text(&[row, q1]).contains("dark fiber (N=3)"));
    }
}
