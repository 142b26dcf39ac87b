//! `starfish bench tls`: what mutual TLS and NBD over TLS cost. Two clusters side by side in
//! one run — the same three elements, quorum 2, no emulated links — one plain and one with
//! `--tls-dir` everywhere; fio's nbd engine runs the same jobs against each, alternating
//! (plain, TLS, TLS, plain…) so the machine's drift falls on both.

use anyhow::Result;

use super::cluster::{Cluster, ClusterSpec, Site};
use super::fio::{self, Figures, Job};
use super::{cell, new_row, number, set_number, text_table, Bench, Mode, Row};

/// (name, rw, block bytes, iodepth)
const JOBS: [(&str, &str, u64, u32); 4] = [
    ("4K randwrite QD1", "randwrite", 4096, 1),
    ("4K randwrite QD16", "randwrite", 4096, 16),
    ("4K randread QD16", "randread", 4096, 16),
    ("1M write QD16", "write", 1 << 20, 16),
];

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    let (volume_bytes, runtime_s, rounds) = match bench.mode {
        Mode::Quick => (256 << 20, 2, 1),
        Mode::Default => (1 << 30, 8, 2),
        Mode::Full => (1 << 30, 20, 3),
    };
    let spec = |tls| ClusterSpec {
        sites: vec![Site::new("local", 0.0, None), Site::new("near", 0.0, None), Site::new("far", 0.0, None)],
        quorum: 2,
        volume_bytes,
        read_cache_bytes: Some(0),
        tls,
        host_extra: Vec::new(),
    };
    bench.progress("starting a plain cluster and a TLS cluster");
    let mut plain = Cluster::start(&bench.bin, &bench.work, &spec(false))?;
    let mut tls = Cluster::start(&bench.bin, &bench.work, &spec(true))?;
    let mut rows = Vec::new();
    for (name, rw, block_bytes, iodepth) in JOBS {
        let job = Job {
            rw,
            block_bytes,
            jobs: 1,
            range_bytes: volume_bytes,
            ios_per_job: None,
            runtime_s,
            ramp_s: 1,
            iodepth,
        };
        let mut sums = [Vec::<Figures>::new(), Vec::new()];
        for round in 0..rounds * 2 {
            // plain, tls, tls, plain, plain, tls…
            let use_tls = (round % 4 == 1) || (round % 4 == 2);
            let cluster = if use_tls { &mut tls } else { &mut plain };
            bench.progress(&format!("{name}: {} (round {})", if use_tls { "TLS" } else { "plain" }, round / 2 + 1));
            let figures = fio::run_as(&cluster.uri(), &job, cluster.scratch(), cluster.client_home())?;
            cluster.check_alive()?;
            sums[use_tls as usize].push(figures);
        }
        let mean = |runs: &[Figures]| {
            let n = runs.len() as f64;
            (
                runs.iter().map(|f| f.throughput_mb_s).sum::<f64>() / n,
                runs.iter().map(|f| f.latency_ms).sum::<f64>() / n,
            )
        };
        let (plain_mb_s, plain_ms) = mean(&sums[0]);
        let (tls_mb_s, tls_ms) = mean(&sums[1]);
        let mut row = new_row("tls", name);
        let iops = |mb_s: f64| mb_s * 1e6 / block_bytes as f64;
        set_number(&mut row, "plain_iops", iops(plain_mb_s));
        set_number(&mut row, "tls_iops", iops(tls_mb_s));
        set_number(&mut row, "plain_mb_s", plain_mb_s);
        set_number(&mut row, "tls_mb_s", tls_mb_s);
        set_number(&mut row, "plain_latency_ms", plain_ms);
        set_number(&mut row, "tls_latency_ms", tls_ms);
        set_number(&mut row, "tls_over_plain", tls_mb_s / plain_mb_s);
        rows.push(row);
    }
    Ok(rows)
}

pub fn text(rows: &[Row]) -> String {
    let header = ["job", "plain IOPS", "TLS IOPS", "plain MB/s", "TLS MB/s", "plain ms", "TLS ms", "TLS/plain"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r["config"].as_str().unwrap_or("?").to_string(),
                cell(r, "plain_iops", 0),
                cell(r, "tls_iops", 0),
                cell(r, "plain_mb_s", 1),
                cell(r, "tls_mb_s", 1),
                cell(r, "plain_latency_ms", 3),
                cell(r, "tls_latency_ms", 3),
                number(r, "tls_over_plain").map_or("-".into(), |v| format!("{v:.2}")),
            ]
        })
        .collect();
    let notes = vec![
        "same run: a plain cluster and a TLS cluster (mutual TLS between the processes, NBD over TLS), 3 elements, Q=2, no link delay, read cache off; fio nbd engine, alternating".to_string(),
    ];
    text_table("TLS against plain TCP", &header, &cells, &notes)
}
