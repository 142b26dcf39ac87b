//! `starfish bench volume-ops`: what the intention log costs, in the shape of the Slice paper's
//! Fig. 4 — operation latency against offered load for the three coordinator logging policies
//! (`--intention-log none`, `single`, `group`), with real processes: three elements on this
//! machine's disk (every store fsyncs), quorum 2, no emulated links. The operations are `volume
//! create` of a 1 MiB volume, then `volume resize` of those volumes to 2 MiB (`grow`) and back
//! to 1 MiB (`shrink`: the tail zeroed through the elements' write stream before the answer),
//! then `volume delete` of them, each sent to the admin endpoint open-loop at a fixed rate (one
//! thread per request, so a slow answer never delays the next request), each policy on a fresh
//! cluster, the loads in increasing order. Resizes are always logged, so policy `none` has no
//! resize rows.
//!
//! Rows: `op` (create, grow, shrink, delete), `policy`, `offered_ops_s`, `ops`,
//! `achieved_ops_s`, `latency_mean_ms`, `latency_p50_ms`, `latency_p99_ms`, `failed`.
//!
//! Part 2, what snapshots cost the writes of their volume: on a fresh cluster (`group`), a
//! volume created while running and filled with 1 MiB writes; then, with 0, 1 and 8 snapshots
//! (the newest taken just before), 4 KiB random writes at QD1 for a while (the first write to a
//! block after the newest snapshot copies the block first), then 1 MiB sequential writes over
//! the whole volume (every block not copied yet is). Rows: `op` `snapshot-cost`, `snapshots`,
//! `rw` (randwrite-4k, write-1m), `iops`, `latency_mean_ms`, `throughput_mb_s`. Then the same
//! two runs on a clone of the newest snapshot (`starfish volume clone`), which starts sharing
//! every block with it: rows with `op` `clone-cost`, and how long the clone took to make
//! (`clone_ms`).

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::cluster::{admin_request, Cluster, ClusterSpec, Site};
use super::fio::{self, Job};
use super::{cell, new_row, number, set_number, text_table, Bench, Mode, Row};

const POLICIES: [&str; 3] = ["none", "single", "group"];
/// In this order, on the same volumes.
const OPS: [&str; 4] = ["create", "grow", "shrink", "delete"];
const ADMIN_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    let (loads, ops): (&[u32], usize) = match bench.mode {
        Mode::Quick => (&[20, 100], 10),
        // A host element serves at most 192 created volumes (CATALOG_VOLUMES_MAX): every
        // policy's cluster stays below; and fewer than the admin endpoint's 32 connections are
        // ever in flight.
        Mode::Default => (&[10, 50, 100, 200, 400], 30),
        Mode::Full => (&[10, 25, 50, 100, 200, 400, 800], 26),
    };
    let mut rows = Vec::new();
    for policy in POLICIES {
        let spec = cluster_spec(policy);
        bench.progress(&format!("intention log {policy}: starting a cluster"));
        let mut cluster = Cluster::start(&bench.bin, &bench.work, &spec)?;
        for &load in loads {
            for op in OPS {
                if policy == "none" && matches!(op, "grow" | "shrink") {
                    continue;
                }
                bench.progress(&format!("intention log {policy}: {ops} × volume {op} at {load}/s"));
                let latencies = offer(&cluster, op, policy, load, ops)?;
                cluster.check_alive()?;
                let mut row = new_row("volume-ops", policy);
                row.insert("quorum".into(), 2.into());
                row.insert("elements".into(), 3.into());
                row.insert("op".into(), op.into());
                row.insert("policy".into(), policy.into());
                row.insert("offered_ops_s".into(), load.into());
                row.insert("ops".into(), ops.into());
                let (ok, elapsed): (Vec<f64>, f64) = latencies;
                row.insert("failed".into(), (ops - ok.len()).into());
                if ok.is_empty() {
                    bail!("intention log {policy}: every volume {op} at {load}/s failed (see the host element's log)");
                }
                let mut sorted = ok.clone();
                sorted.sort_by(f64::total_cmp);
                let pick = |q: f64| sorted[((sorted.len() as f64 - 1.0) * q).round() as usize];
                set_number(&mut row, "achieved_ops_s", ok.len() as f64 / elapsed);
                set_number(&mut row, "latency_mean_ms", ok.iter().sum::<f64>() / ok.len() as f64);
                set_number(&mut row, "latency_p50_ms", pick(0.5));
                set_number(&mut row, "latency_p99_ms", pick(0.99));
                rows.push(row);
            }
        }
    }
    rows.extend(snapshot_cost(bench)?);
    Ok(rows)
}

/// Three elements on this disk, quorum 2, no emulated links, the intention log `policy`.
fn cluster_spec(policy: &str) -> ClusterSpec {
    ClusterSpec {
        sites: vec![Site::new("local", 0.0, None), Site::new("near", 0.0, None), Site::new("far", 0.0, None)],
        quorum: 2,
        volume_bytes: 64 << 20,
        read_cache_bytes: Some(0),
        tls: false,
        host_extra: vec!["--intention-log".into(), policy.into()],
    }
}

/// Snapshot counts part 2 measures, in this order (snapshots are only added).
const SNAPSHOT_COUNTS: [u32; 3] = [0, 1, 8];

/// Part 2 (see the module's documentation).
fn snapshot_cost(bench: &Bench) -> Result<Vec<Row>> {
    let (volume_bytes, runtime_s): (u64, u64) = match bench.mode {
        Mode::Quick => (32 << 20, 1),
        Mode::Default => (256 << 20, 8),
        Mode::Full => (1 << 30, 15),
    };
    let spec = cluster_spec("group");
    bench.progress("snapshots: starting a cluster");
    let mut cluster = Cluster::start(&bench.bin, &bench.work, &spec)?;
    let admin = cluster.admin();
    admin_request(admin, "POST", &format!("/volumes/create?name=snapbench&size={volume_bytes}"), ADMIN_TIMEOUT)?;
    let uri = cluster.uri().replace("/vol0", "/snapbench");
    let sequential = Job {
        rw: "write",
        block_bytes: 1 << 20,
        jobs: 1,
        range_bytes: volume_bytes,
        ios_per_job: Some(volume_bytes >> 20),
        runtime_s: 300,
        ramp_s: 0,
        iodepth: 1,
    };
    let random = Job {
        rw: "randwrite",
        block_bytes: 4096,
        jobs: 1,
        range_bytes: volume_bytes,
        ios_per_job: None,
        runtime_s,
        ramp_s: 0,
        iodepth: 1,
    };
    bench.progress(&format!("snapshots: filling a {} MiB volume", volume_bytes >> 20));
    fio::run(&uri, &sequential, cluster.scratch())?;
    // Once unmeasured, so that the first measured run does not pay for the fill's writeback.
    fio::run(&uri, &random, cluster.scratch())?;
    let mut rows = Vec::new();
    let mut taken = 0;
    for count in SNAPSHOT_COUNTS {
        while taken < count {
            let path = format!("/snapshots/create?volume=snapbench&name=s{taken}");
            admin_request(admin, "POST", &path, ADMIN_TIMEOUT)?;
            taken += 1;
        }
        for (rw, job) in [("randwrite-4k", &random), ("write-1m", &sequential)] {
            bench.progress(&format!("snapshots: {count} snapshot(s), {rw}"));
            let figures = fio::run(&uri, job, cluster.scratch())?;
            cluster.check_alive()?;
            let mut row = cost_row("snapshot-cost", rw, volume_bytes, job, &figures);
            row.insert("snapshots".into(), count.into());
            rows.push(row);
        }
    }
    // A clone of the newest snapshot: writes to blocks it shares, then to its own.
    let newest = SNAPSHOT_COUNTS[SNAPSHOT_COUNTS.len() - 1] - 1;
    let asked = Instant::now();
    let path = format!("/volumes/clone?snapshot=snapbench%40s{newest}&name=clonebench");
    admin_request(admin, "POST", &path, ADMIN_TIMEOUT)?;
    let clone_ms = asked.elapsed().as_secs_f64() * 1000.0;
    let uri = cluster.uri().replace("/vol0", "/clonebench");
    for (rw, job) in [("randwrite-4k", &random), ("write-1m", &sequential)] {
        bench.progress(&format!("snapshots: a clone, {rw}"));
        let figures = fio::run(&uri, job, cluster.scratch())?;
        cluster.check_alive()?;
        let mut row = cost_row("clone-cost", rw, volume_bytes, job, &figures);
        set_number(&mut row, "clone_ms", clone_ms);
        rows.push(row);
    }
    Ok(rows)
}

/// A row of part 2: `op` (`snapshot-cost`, `clone-cost`), the writes `rw` of `job` and what fio
/// measured of them.
fn cost_row(op: &str, rw: &str, volume_bytes: u64, job: &Job, figures: &fio::Figures) -> Row {
    let mut row = new_row("volume-ops", "group");
    row.insert("quorum".into(), 2.into());
    row.insert("elements".into(), 3.into());
    row.insert("op".into(), op.into());
    row.insert("rw".into(), rw.into());
    row.insert("volume_bytes".into(), volume_bytes.into());
    set_number(&mut row, "iops", figures.throughput_mb_s * 1e6 / job.block_bytes as f64);
    set_number(&mut row, "latency_mean_ms", figures.latency_ms);
    set_number(&mut row, "throughput_mb_s", figures.throughput_mb_s);
    row
}

/// Part 2's table.
fn snapshot_text(rows: &[&Row]) -> String {
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let clone = r.get("op").and_then(|v| v.as_str()) == Some("clone-cost");
            vec![
                if clone { "a clone".to_string() } else { cell(r, "snapshots", 0) },
                r.get("rw").and_then(|v| v.as_str()).unwrap_or("?").to_string(),
                cell(r, "iops", 0),
                cell(r, "latency_mean_ms", 3),
                cell(r, "throughput_mb_s", 1),
            ]
        })
        .collect();
    let at = |count: f64, rw: &str, key: &str| {
        rows.iter()
            .find(|r| number(r, "snapshots") == Some(count) && r.get("rw").and_then(|v| v.as_str()) == Some(rw))
            .and_then(|r| number(r, key))
    };
    let of_clone = |rw: &str, key: &str| {
        rows.iter()
            .find(|r| {
                r.get("op").and_then(|v| v.as_str()) == Some("clone-cost")
                    && r.get("rw").and_then(|v| v.as_str()) == Some(rw)
            })
            .and_then(|r| number(r, key))
    };
    let mut notes = vec![
        "a volume created while running, filled; the newest snapshot is taken just before each pair of runs: 4 KiB random writes at QD1 (the first write to a block after it copies the block first), then 1 MiB sequential writes over the whole volume (every block not copied yet is). Three elements on this disk, Q=2.".to_string(),
    ];
    for count in [1.0, 8.0] {
        for (rw, key) in [("randwrite-4k", "iops"), ("write-1m", "throughput_mb_s")] {
            if let (Some(none), Some(with)) = (at(0.0, rw, key), at(count, rw, key)) {
                notes.push(format!("{rw} with {count:.0} snapshot(s): {:.2}x the {key} without", with / none));
            }
        }
    }
    for (rw, key) in [("randwrite-4k", "iops"), ("write-1m", "throughput_mb_s")] {
        if let (Some(none), Some(clone)) = (at(0.0, rw, key), of_clone(rw, key)) {
            notes.push(format!(
                "{rw} on a clone of the newest snapshot: {:.2}x the volume's {key} without snapshots",
                clone / none
            ));
        }
    }
    if let Some(ms) = of_clone("randwrite-4k", "clone_ms") {
        notes.push(format!("the clone took {ms:.0} ms to make (volume clone, answered once a write quorum holds it)"));
    }
    text_table(
        "Writes to a volume with snapshots (issue 15, part 2)",
        &["snapshots", "writes", "IOPS", "mean ms", "MB/s"],
        &table,
        &notes,
    )
}

/// `ops` operations (`create`, or `delete` of the volumes `create` made at this load) at
/// `load` per second, open-loop: (latencies of those that succeeded, in milliseconds; seconds
/// from the first request to the last answer).
fn offer(cluster: &Cluster, op: &str, policy: &str, load: u32, ops: usize) -> Result<(Vec<f64>, f64)> {
    let admin = cluster.admin();
    let start = Instant::now();
    let gap = Duration::from_secs_f64(1.0 / load as f64);
    let handles: Vec<_> = (0..ops)
        .map(|i| {
            let due = start + gap * i as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let name = format!("{policy}-{load}-{i}");
            let path = match op {
                "create" => format!("/volumes/create?name={name}&size={}", 1 << 20),
                "grow" => format!("/volumes/resize?name={name}&size={}", 2 << 20),
                "shrink" => format!("/volumes/resize?name={name}&size={}&shrink=1", 1 << 20),
                _ => format!("/volumes/delete?name={name}"),
            };
            std::thread::spawn(move || {
                let sent = Instant::now();
                let result = admin_request(admin, "POST", &path, ADMIN_TIMEOUT);
                (result, sent.elapsed().as_secs_f64() * 1000.0)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut first_error = None;
    for handle in handles {
        match handle.join() {
            Ok((Ok(_), ms)) => latencies.push(ms),
            Ok((Err(e), _)) => {
                first_error.get_or_insert(e.to_string());
            }
            Err(_) => bail!("a request thread panicked"),
        }
    }
    if let Some(e) = first_error {
        eprintln!("bench: some of volume {op} failed; the first: {e}");
    }
    Ok((latencies, start.elapsed().as_secs_f64()))
}

pub fn text(rows: &[Row]) -> String {
    let part_2 = |r: &&Row| matches!(r.get("op").and_then(|v| v.as_str()), Some("snapshot-cost" | "clone-cost"));
    let (cost, rows): (Vec<&Row>, Vec<&Row>) = rows.iter().partition(part_2);
    let mut out = operations_text(&rows);
    if !cost.is_empty() {
        out.push('\n');
        out.push_str(&snapshot_text(&cost));
    }
    out
}

/// Part 1's table.
fn operations_text(rows: &[&Row]) -> String {
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.get("op").and_then(|v| v.as_str()).unwrap_or("create").to_string(),
                r.get("policy").and_then(|v| v.as_str()).unwrap_or("?").to_string(),
                cell(r, "offered_ops_s", 0),
                cell(r, "achieved_ops_s", 1),
                cell(r, "latency_mean_ms", 1),
                cell(r, "latency_p50_ms", 1),
                cell(r, "latency_p99_ms", 1),
                cell(r, "failed", 0),
            ]
        })
        .collect();
    let mut notes = vec![
        "volume create (1 MiB), volume resize of those volumes to 2 MiB (grow) and back (shrink), then volume delete of them, open-loop against the admin endpoint; three elements on this disk, Q=2.".to_string(),
        "resizes are always logged: policy none has no grow or shrink rows.".to_string(),
        "none: no intention logged before executing (a crash mid-way leaves an orphan); single: one catalog write + FLUSH per intention; group: up to 10 ms or 5 intentions per write.".to_string(),
    ];
    // Rows from before deletions were measured have no `op`: they are creations.
    let at = |op: &str, policy: &str, load: f64| {
        rows.iter()
            .find(|r| {
                r.get("op").and_then(|v| v.as_str()).unwrap_or("create") == op
                    && r.get("policy").and_then(|v| v.as_str()) == Some(policy)
                    && number(r, "offered_ops_s") == Some(load)
            })
            .and_then(|r| number(r, "latency_mean_ms"))
    };
    if let Some(top) = rows.iter().filter_map(|r| number(r, "offered_ops_s")).reduce(f64::max) {
        for op in OPS {
            if let (Some(single), Some(group)) = (at(op, "single", top), at(op, "group", top)) {
                notes.push(format!(
                    "volume {op} at {top:.0}/s: group commit {:.2}x the latency of single commit",
                    group / single
                ));
            }
        }
    }
    text_table(
        "Volume operations: latency against offered load (Slice Fig. 4 shape)",
        &["op", "policy", "offered/s", "achieved/s", "mean ms", "p50 ms", "p99 ms", "failed"],
        &table,
        &notes,
    )
}
