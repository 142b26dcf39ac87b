//! Table 6: micro-benchmarks with N=3 on dark fiber — read hit (random 8 KiB reads over 100 MiB
//! after warming the host element's cache), read miss (random 8 KiB reads over a larger range,
//! cache off, page cache dropped), write (random 8 KiB writes over that range); single-thread
//! latency and 8-thread throughput; with the same-run baselines.

use std::time::Duration;

use anyhow::Result;
use serde_json::Value;

use super::cluster::{Cluster, ClusterSpec, Site};
use super::fio::{self, Job};
use super::process::{require_tools, run_bounded};
use super::{cell, new_row, number, set_number, text_table, Bench, Mode, Row};

const BLOCK_BYTES: u64 = 8192;
const THREADS: u32 = 8;
const FIO_RUNTIME_MAX_S: u64 = 60;

/// Sizes and counts of a run (the paper: 100 MB hit range, 2.5 GB miss/write range, 50,000
/// hits, 10,000 misses, 10,000 writes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub hit_range_bytes: u64,
    pub range_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub writes: u64,
}

pub fn scale(mode: Mode) -> Scale {
    const MIB: u64 = 1 << 20;
    match mode {
        Mode::Quick => Scale { hit_range_bytes: 16 * MIB, range_bytes: 32 * MIB, hits: 2000, misses: 400, writes: 200 },
        Mode::Default => {
            Scale { hit_range_bytes: 100 * MIB, range_bytes: 512 * MIB, hits: 20_000, misses: 4000, writes: 2000 }
        }
        Mode::Full => {
            Scale { hit_range_bytes: 100 * MIB, range_bytes: 2560 * MIB, hits: 50_000, misses: 10_000, writes: 10_000 }
        }
    }
}

/// A StarFish configuration: N=3, local 0 ms, dark fiber to near and far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    pub quorum: usize,
    pub near_ms: f64,
    pub far_ms: f64,
}

pub fn grid(mode: Mode) -> Vec<Config> {
    let delays: &[(f64, f64)] = match mode {
        Mode::Quick => &[(1.0, 8.0)],
        Mode::Default => &[(1.0, 8.0)],
        Mode::Full => &[(1.0, 4.0), (4.0, 12.0), (8.0, 8.0)],
    };
    let quorums: &[usize] = if mode == Mode::Quick { &[2] } else { &[1, 2] };
    let mut configs = Vec::new();
    for &quorum in quorums {
        for &(near_ms, far_ms) in delays {
            configs.push(Config { quorum, near_ms, far_ms });
        }
    }
    configs
}

/// The six figures of one configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub hit: fio::Figures,
    pub hit_threads: fio::Figures,
    pub miss: fio::Figures,
    pub miss_threads: fio::Figures,
    pub write: fio::Figures,
    pub write_threads: fio::Figures,
}

pub const OPS: [&str; 3] = ["read_hit", "read_miss", "write"];

impl Figures {
    /// (single-thread latency, 8-thread throughput) of an operation.
    pub fn of(&self, op: &str) -> (f64, f64) {
        match op {
            "read_hit" => (self.hit.latency_ms, self.hit_threads.throughput_mb_s),
            "read_miss" => (self.miss.latency_ms, self.miss_threads.throughput_mb_s),
            "write" => (self.write.latency_ms, self.write_threads.throughput_mb_s),
            other => unreachable!("unknown Table 6 operation {other}"),
        }
    }
}

fn job(rw: &'static str, range_bytes: u64, total_ios: u64, threads: u32) -> Job {
    Job {
        rw,
        block_bytes: BLOCK_BYTES,
        jobs: threads,
        range_bytes,
        ios_per_job: Some((total_ios / u64::from(threads)).max(1)),
        runtime_s: FIO_RUNTIME_MAX_S,
        ramp_s: 0,
        iodepth: 1,
    }
}

/// Sequential 1 MiB writes over `range_bytes`, so reads find data, not holes.
fn fill(cluster: &Cluster, range_bytes: u64) -> Result<()> {
    let job = Job {
        rw: "write",
        block_bytes: 1 << 20,
        jobs: 1,
        range_bytes,
        ios_per_job: None,
        runtime_s: 600,
        ramp_s: 0,
        iodepth: 8,
    };
    let mut args = job.args(&cluster.uri());
    args.retain(|a| a != "--time_based");
    let mut cmd = std::process::Command::new("fio");
    cmd.args(args);
    run_bounded("fio fill", &mut cmd, Duration::from_secs(660), cluster.scratch())?;
    Ok(())
}

/// Drops the kernel's page cache so the element's reads go to the disk (needs root); says
/// whether it could.
fn drop_page_cache() -> bool {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok()
}

fn measure(bench: &Bench, sites: Vec<Site>, quorum: usize, label: &str) -> Result<(Figures, bool)> {
    let s = scale(bench.mode);
    let volume_bytes = s.range_bytes.max(s.hit_range_bytes);
    // Misses and writes: the cache off, the range filled first.
    let spec = ClusterSpec {
        sites: sites.clone(),
        quorum,
        volume_bytes,
        read_cache_bytes: Some(0),
        tls: false,
        host_extra: Vec::new(),
    };
    let mut cluster = Cluster::start(&bench.bin, &bench.work, &spec)?;
    let uri = cluster.uri();
    fill(&cluster, s.range_bytes)?;
    let write = fio::run(&uri, &job("randwrite", s.range_bytes, s.writes, 1), cluster.scratch())?;
    let write_threads = fio::run(&uri, &job("randwrite", s.range_bytes, s.writes, THREADS), cluster.scratch())?;
    let dropped = drop_page_cache();
    let miss = fio::run(&uri, &job("randread", s.range_bytes, s.misses, 1), cluster.scratch())?;
    drop_page_cache();
    let miss_threads = fio::run(&uri, &job("randread", s.range_bytes, s.misses, THREADS), cluster.scratch())?;
    cluster.check_alive()?;
    drop(cluster);
    // Hits: the default cache (256 MiB), warmed by writing the range (write-through) and reading it.
    let spec = ClusterSpec { sites, quorum, volume_bytes, read_cache_bytes: None, tls: false, host_extra: Vec::new() };
    let mut cluster = Cluster::start(&bench.bin, &bench.work, &spec)?;
    fill(&cluster, s.hit_range_bytes)?;
    let warm = Job { rw: "read", block_bytes: 1 << 20, ..job("read", s.hit_range_bytes, s.hit_range_bytes >> 20, 1) };
    fio::run(&cluster.uri(), &warm, cluster.scratch())?;
    let hit = fio::run(&cluster.uri(), &job("randread", s.hit_range_bytes, s.hits, 1), cluster.scratch())?;
    let hit_threads =
        fio::run(&cluster.uri(), &job("randread", s.hit_range_bytes, s.hits, THREADS), cluster.scratch())?;
    cluster.check_alive()?;
    let figures = Figures { hit, hit_threads, miss, miss_threads, write, write_threads };
    bench.progress(&format!(
        "t6 {label}: latency ms hit {:.3} miss {:.3} write {:.3}; 8-thread MB/s hit {:.1} miss {:.1} write {:.1}",
        hit.latency_ms,
        miss.latency_ms,
        write.latency_ms,
        hit_threads.throughput_mb_s,
        miss_threads.throughput_mb_s,
        write_threads.throughput_mb_s
    ));
    Ok((figures, dropped))
}

fn latency_key(op: &str) -> &'static str {
    if op == "write" {
        "write_latency_ms"
    } else {
        "read_latency_ms"
    }
}

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    require_tools(&[("fio", "fio")])?;
    let configs = grid(bench.mode);
    let (direct, dropped) = measure(bench, vec![Site::new("local", 0.0, None)], 1, "direct-attached")?;
    let mut near_delays: Vec<f64> = configs.iter().map(|c| c.near_ms).collect();
    near_delays.sort_by(f64::total_cmp);
    near_delays.dedup();
    let mut near_disk = Vec::new();
    for near_ms in near_delays {
        let (figures, _) = measure(
            bench,
            vec![Site::new("near", near_ms, None)],
            1,
            &format!("one disk at the near site, {near_ms} ms"),
        )?;
        near_disk.push((near_ms, figures));
    }
    let mut rows = Vec::new();
    for op in OPS {
        rows.push(baseline_row("direct", op, None, &direct, None, dropped));
    }
    for (near_ms, figures) in &near_disk {
        for op in OPS {
            rows.push(baseline_row("near_disk", op, Some(*near_ms), figures, Some(&direct), dropped));
        }
    }
    for config in &configs {
        let label = format!("Q={} near {} ms far {} ms", config.quorum, config.near_ms, config.far_ms);
        let (figures, _) = measure(bench, sites(config), config.quorum, &label)?;
        let near = near_disk.iter().find(|(d, _)| *d == config.near_ms).map(|(_, f)| f);
        for op in OPS {
            rows.push(config_row(config, op, &figures, &direct, near, dropped));
        }
    }
    Ok(rows)
}

fn sites(config: &Config) -> Vec<Site> {
    vec![Site::new("local", 0.0, None), Site::new("near", config.near_ms, None), Site::new("far", config.far_ms, None)]
}

fn baseline_row(
    config: &str,
    op: &str,
    near_ms: Option<f64>,
    f: &Figures,
    direct: Option<&Figures>,
    dropped: bool,
) -> Row {
    let mut row = new_row("t6", config);
    row.insert("elements".into(), Value::from(1));
    row.insert("quorum".into(), Value::from(1));
    row.insert("op".into(), Value::from(op));
    if let Some(near_ms) = near_ms {
        set_number(&mut row, "near_delay_ms", near_ms);
    }
    let (latency, throughput) = f.of(op);
    set_number(&mut row, latency_key(op), latency);
    set_number(&mut row, "throughput_mb_s", throughput);
    if let Some(direct) = direct {
        let (latency, throughput) = direct.of(op);
        set_number(&mut row, &format!("direct_{}", latency_key(op)), latency);
        set_number(&mut row, "direct_throughput_mb_s", throughput);
    }
    row.insert("page_cache_dropped".into(), Value::from(dropped));
    row
}

pub fn config_row(
    config: &Config,
    op: &str,
    f: &Figures,
    direct: &Figures,
    near_disk: Option<&Figures>,
    dropped: bool,
) -> Row {
    let mut row = new_row("t6", "dark_fiber");
    row.insert("elements".into(), Value::from(3));
    row.insert("quorum".into(), Value::from(config.quorum));
    set_number(&mut row, "near_delay_ms", config.near_ms);
    set_number(&mut row, "far_delay_ms", config.far_ms);
    row.insert("op".into(), Value::from(op));
    let key = latency_key(op);
    let (latency, throughput) = f.of(op);
    set_number(&mut row, key, latency);
    set_number(&mut row, "throughput_mb_s", throughput);
    let (latency, throughput) = direct.of(op);
    set_number(&mut row, &format!("direct_{key}"), latency);
    set_number(&mut row, "direct_throughput_mb_s", throughput);
    if let Some(near) = near_disk {
        let (latency, throughput) = near.of(op);
        set_number(&mut row, &format!("near_disk_{key}"), latency);
        set_number(&mut row, "near_disk_throughput_mb_s", throughput);
    }
    row.insert("page_cache_dropped".into(), Value::from(dropped));
    row
}

/// The paper's shape: one line per configuration, single-thread latencies then 8-thread
/// throughputs.
pub fn text(rows: &[Row]) -> String {
    let mut lines: Vec<Vec<String>> = Vec::new();
    let mut keys: Vec<String> = Vec::new();
    for row in rows {
        let config = row["config"].as_str().unwrap_or("?");
        let name = match config {
            "direct" => "direct-attached (N=1)".to_string(),
            "near_disk" => format!("one disk at near site {} ms (N=1)", cell(row, "near_delay_ms", 0)),
            _ => format!(
                "dark fiber N=3 Q={} near {} ms far {} ms",
                cell(row, "quorum", 0),
                cell(row, "near_delay_ms", 0),
                cell(row, "far_delay_ms", 0)
            ),
        };
        let index = match keys.iter().position(|k| *k == name) {
            Some(i) => i,
            None => {
                keys.push(name.clone());
                lines.push(vec![name, "-".into(), "-".into(), "-".into(), "-".into(), "-".into(), "-".into()]);
                lines.len() - 1
            }
        };
        let column = match row["op"].as_str() {
            Some("read_miss") => 1,
            Some("read_hit") => 2,
            _ => 3,
        };
        let latency = number(row, "read_latency_ms").or(number(row, "write_latency_ms"));
        lines[index][column] = latency.map_or("-".into(), |v| format!("{v:.3}"));
        lines[index][column + 3] = cell(row, "throughput_mb_s", 1);
    }
    let dropped = rows.iter().all(|r| r["page_cache_dropped"] == true);
    text_table(
        "Table 6: micro-benchmarks, 8 KiB random I/O (fio nbd engine); latency single thread, throughput 8 threads",
        &["configuration", "miss ms", "hit ms", "write ms", "miss MB/s", "hit MB/s", "write MB/s"],
        &lines,
        &[
            format!(
                "(page cache {} before the read-miss runs; the paper: RAID 7.2/0.4/3.0 ms, 4.9/25.6 MB/s; StarFish 9.4/0.4/3.0 ms, 4.6/26.3 MB/s)",
                if dropped { "dropped" } else { "NOT dropped (not root)" }
            ),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_name_the_latency_by_direction() {
        let f = |ms: f64, mb: f64| fio::Figures { latency_ms: ms, throughput_mb_s: mb, ios: 1 };
        let figures = Figures {
            hit: f(0.1, 0.0),
            hit_threads: f(0.0, 90.0),
            miss: f(0.3, 0.0),
            miss_threads: f(0.0, 40.0),
            write: f(2.5, 0.0),
            write_threads: f(0.0, 20.0),
        };
        let config = Config { quorum: 2, near_ms: 1.0, far_ms: 8.0 };
        let write = config_row(&config, "write", &figures, &figures, None, true);
        assert_eq!(number(&write, "write_latency_ms"), Some(2.5));
        assert_eq!(number(&write, "direct_write_latency_ms"), Some(2.5));
        assert_eq!(number(&write, "throughput_mb_s"), Some(20.0));
        let hit = config_row(&config, "read_hit", &figures, &figures, Some(&figures), true);
        assert_eq!(number(&hit, "read_latency_ms"), Some(0.1));
        assert_eq!(number(&hit, "near_disk_read_latency_ms"), Some(0.1));
        assert!(hit.get("write_latency_ms").is_none());
        let text = text(&[write, hit]);
        assert!(text.contains("dark fiber N=3 Q=2 near 1 ms far 8 ms"), "{text}");
        assert_eq!(grid(Mode::Default).len(), 2);
    }
}
