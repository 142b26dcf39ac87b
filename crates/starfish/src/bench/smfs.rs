//! `starfish bench smfs`: the SMFS paper's evaluation (section 5) side by side, with real
//! processes. A primary site (this machine's root namespace: the host element and the local
//! element) mirrors to a far element across an emulated WAN link (`netem::Link`: network
//! namespaces, 50 ms one way, 100 Mbit/s, random loss), in five modes: the far element
//! `local-sync` (Q = 1: never waited for) over TCP or over the far link with FEC,
//! `remote-sync` (Q = 2: durable at the far site) over TCP or FEC, and `network-sync` (Q = 2:
//! durable locally and, at the far site, the data and its repair packets on the wire); and, to
//! show what the far link adds, network-sync over TCP (counted once written into the socket).
//!
//! - **Rolling disaster** (SMFS Fig. 6–7): a writer of 4 KiB blocks (8 in flight) runs; the
//!   link's loss is raised for 0.5 s; then every process of the primary site is killed
//!   (SIGKILL) and the link takes no more packets (those on the wire still arrive: the site
//!   is gone, the network is not). The far element is then opened alone by a new host element
//!   and every block the writer saw acknowledged is read back: `acked_lost` counts those
//!   absent.
//! - **Latency** (Fig. 8): one write at a time, acknowledgement latency percentiles per mode
//!   and loss.
//! - **Throughput** (Fig. 9–11): 16 writes in flight; what the host acknowledges and what
//!   reaches the far element, per mode against loss and against one-way delay.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::cluster::admin_request;
use super::nbd_client::{NbdClient, WriteOutcome};
use super::process::{free_port, wait_port, Child, ScratchDir};
use super::{cell, new_row, set_number, text_table, Bench, Mode, Row};

const BLOCK_BYTES: u32 = 4096;
const VOLUME_BYTES: u64 = 256 << 20;
const DELAY_MS: f64 = 50.0;
const RATE_MBIT: f64 = 100.0;
const R: u8 = 8;
const START_TIMEOUT: Duration = Duration::from_secs(30);
const IO_TIMEOUT: Duration = Duration::from_secs(20);
/// A block's first bytes: this tag and its index (the rest is filler).
const STAMP: &[u8; 8] = b"SMFSblk\0";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MirrorMode {
    name: &'static str,
    ack: &'static str,
    fec: bool,
    quorum: usize,
}

const MODES: [MirrorMode; 6] = [
    MirrorMode { name: "local-sync", ack: "local-sync", fec: false, quorum: 1 },
    MirrorMode { name: "local-sync+FEC", ack: "local-sync", fec: true, quorum: 1 },
    MirrorMode { name: "remote-sync", ack: "remote-sync", fec: false, quorum: 2 },
    MirrorMode { name: "remote-sync+FEC", ack: "remote-sync", fec: true, quorum: 2 },
    // What "network-sync" would mean without the far link: written into a TCP socket.
    MirrorMode { name: "network-sync over TCP", ack: "network-sync", fec: false, quorum: 2 },
    MirrorMode { name: "network-sync", ack: "network-sync", fec: true, quorum: 2 },
];

fn params(delay_ms: f64, loss_pct: f64) -> netem::LinkParams {
    netem::LinkParams {
        delay_ms_one_way: delay_ms,
        rate_mbit: Some(RATE_MBIT),
        loss_percent: loss_pct,
        ..netem::LinkParams::default()
    }
}

/// The primary site (host element, local element) and the far element behind the link.
/// Fields drop in order: host, local, far, the link, the data.
struct Mirror {
    host: Option<Child>,
    local: Option<Child>,
    far: Option<Child>,
    link: netem::Link,
    dir: ScratchDir,
    far_listen: SocketAddr,
    nbd: SocketAddr,
    admin: SocketAddr,
    bin: std::path::PathBuf,
    far_starts: u32,
}

impl Mirror {
    fn start(bench: &Bench, mode: MirrorMode, c: u8, link: netem::LinkParams) -> Result<Mirror> {
        let dir = ScratchDir::create(&bench.work, "starfish-smfs")?;
        let link = netem::Link::create(netem::LinkSpec { params: link, end_a: netem::EndA::RootNamespace, seed: 1 })
            .context("the emulated far link (needs root, iproute2 and /dev/net/tun)")?;
        let far_ip = link.end(netem::Side::B).address;
        let far_listen = SocketAddr::from((far_ip, free_port()?));
        let mut mirror = Mirror {
            host: None,
            local: None,
            far: None,
            link,
            dir,
            far_listen,
            nbd: SocketAddr::from(([127, 0, 0, 1], free_port()?)),
            admin: SocketAddr::from(([127, 0, 0, 1], free_port()?)),
            bin: bench.bin.clone(),
            far_starts: 0,
        };
        let local_listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut cmd = Command::new(&bench.bin);
        cmd.arg("element")
            .arg("--listen")
            .arg(local_listen.to_string())
            .arg("--data")
            .arg(mirror.dir.path().join("local"));
        let mut local = Child::spawn("local element", &mut cmd, &mirror.dir.path().join("local.log"))?;
        wait_port(local_listen, START_TIMEOUT, &mut local)?;
        mirror.local = Some(local);
        mirror.start_far()?;
        let far = if mode.fec {
            format!("far={},ack={},fec={R}:{c},rate={RATE_MBIT}Mbit", mirror.far_listen, mode.ack)
        } else {
            format!("far={},ack={}", mirror.far_listen, mode.ack)
        };
        let local = format!("local={local_listen}");
        mirror.start_host(&[local.as_str(), far.as_str()], mode.quorum, "host")?;
        Ok(mirror)
    }

    fn start_far(&mut self) -> Result<()> {
        let namespace = self.link.end(netem::Side::B).namespace.clone().context("end B has a namespace")?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &namespace]).arg(&self.bin).arg("element");
        cmd.arg("--listen").arg(self.far_listen.to_string()).arg("--data").arg(self.dir.path().join("far"));
        cmd.arg("--insecure"); // not loopback, but inside a namespace of our own
        self.far_starts += 1;
        let log = self.dir.path().join(format!("far-{}.log", self.far_starts));
        let mut far = Child::spawn("far element", &mut cmd, &log)?;
        wait_port(self.far_listen, START_TIMEOUT, &mut far)?;
        self.far = Some(far);
        Ok(())
    }

    fn start_host(&mut self, elements: &[&str], quorum: usize, log: &str) -> Result<()> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("host").arg("--nbd").arg(self.nbd.to_string()).arg("--admin").arg(self.admin.to_string());
        for element in elements {
            cmd.arg("--element").arg(element);
        }
        cmd.arg("--quorum").arg(quorum.to_string()).arg("--volume").arg(format!("vol0:{VOLUME_BYTES}"));
        let mut host = Child::spawn("host element", &mut cmd, &self.dir.path().join(format!("{log}.log")))?;
        wait_port(self.nbd, START_TIMEOUT, &mut host)?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            host.check_alive()?;
            if let Ok(doc) = self.status() {
                if doc["volumes"][0]["mode"] == "read-write"
                    && doc["elements"].as_array().is_some_and(|e| e.iter().all(|e| e["state"] == "in-sync"))
                {
                    break;
                }
            }
            if Instant::now() > deadline {
                bail!("the mirror did not get in sync; host log:\n{}", host.log_tail(20));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.host = Some(host);
        Ok(())
    }

    fn status(&self) -> Result<Value> {
        Ok(serde_json::from_str(&admin_request(self.admin, "GET", "/status", Duration::from_secs(3))?)?)
    }

    /// The far element's applied sequence of vol0.
    fn far_applied(&self) -> Result<u64> {
        let doc = self.status()?;
        let far = doc["elements"].as_array().and_then(|e| e.iter().find(|e| e["name"] == "far")).cloned();
        far.and_then(|f| f["applied_sequence"]["vol0"].as_u64()).context("no far element in status")
    }

    fn client(&self) -> Result<NbdClient> {
        NbdClient::connect(self.nbd, "vol0", IO_TIMEOUT)
    }
}

fn block(index: u64) -> Vec<u8> {
    let mut data = vec![(index % 251) as u8; BLOCK_BYTES as usize];
    data[..8].copy_from_slice(STAMP);
    data[8..16].copy_from_slice(&index.to_le_bytes());
    data
}

fn holds(data: &[u8], index: u64) -> bool {
    data.len() >= 16 && &data[..8] == STAMP && data[8..16] == index.to_le_bytes()
}

/// Write blocks (`depth` in flight) on another thread until `stop` is set or the volume is
/// full; the outcomes come back from the handle.
fn writer(client: NbdClient, depth: usize, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Vec<WriteOutcome>> {
    std::thread::spawn(move || {
        let mut client = client;
        let count = VOLUME_BYTES / BLOCK_BYTES as u64;
        client.write_blocks(count, BLOCK_BYTES, depth, block, || stop.load(Ordering::Relaxed))
    })
}

fn join(handle: std::thread::JoinHandle<Vec<WriteOutcome>>) -> Result<Vec<WriteOutcome>> {
    handle.join().map_err(|_| anyhow::anyhow!("the writer thread panicked"))
}

/// One rolling disaster: the row with `acked` and `acked_lost`.
fn disaster(bench: &Bench, mode: MirrorMode, loss_pct: f64, c: u8) -> Result<Row> {
    let quick = bench.mode == Mode::Quick;
    let mut mirror = Mirror::start(bench, mode, c, params(DELAY_MS, 0.0))?;
    let stop = Arc::new(AtomicBool::new(false));
    let handle = writer(mirror.client()?, 8, stop.clone());
    std::thread::sleep(Duration::from_millis(if quick { 1000 } else { 2000 }));
    mirror.link.set(params(DELAY_MS, loss_pct))?;
    std::thread::sleep(Duration::from_millis(500));
    // The disaster: the primary site's processes die at once; what they sent is on the wire.
    if let Some(host) = mirror.host.as_mut() {
        host.kill9();
    }
    if let Some(local) = mirror.local.as_mut() {
        local.kill9();
    }
    std::thread::sleep(Duration::from_millis(50));
    mirror.link.close_entries();
    stop.store(true, Ordering::Relaxed);
    let outcomes = join(handle)?;
    // Everything on the wire arrives within the delay and the queue.
    std::thread::sleep(Duration::from_millis(1000));
    if let Some(mut far) = mirror.far.take() {
        far.stop(Duration::from_secs(10));
    }
    mirror.link.heal();
    mirror.host = None;
    mirror.start_far()?;
    // The far site alone, opened by a new host element (over TCP: the far link is not needed
    // to read it back).
    let far = format!("far={}", mirror.far_listen);
    mirror.start_host(&[far.as_str()], 1, "host-after")?;
    let acked: Vec<u64> = outcomes.iter().filter(|o| o.ok && o.answered.is_some()).map(|o| o.index).collect();
    let highest = outcomes.iter().map(|o| o.index + 1).max().unwrap_or(0);
    let mut present = vec![false; highest as usize];
    let mut client = mirror.client()?;
    let chunk_blocks = 256u64;
    for first in (0..highest).step_by(chunk_blocks as usize) {
        let n = chunk_blocks.min(highest - first);
        let data = client.read(first * BLOCK_BYTES as u64, (n * BLOCK_BYTES as u64) as u32)?;
        for i in 0..n {
            let at = (i * BLOCK_BYTES as u64) as usize;
            present[(first + i) as usize] = holds(&data[at..at + BLOCK_BYTES as usize], first + i);
        }
    }
    client.disconnect();
    let lost = acked.iter().filter(|&&i| !present[i as usize]).count();
    let mut row = mode_row(mode);
    row.insert("kind".into(), "disaster".into());
    row.insert("mode".into(), mode.name.into());
    set_number(&mut row, "loss_pct", loss_pct);
    row.insert("fec_c".into(), if mode.fec { c.into() } else { Value::Null });
    row.insert("acked".into(), (acked.len() as u64).into());
    row.insert("acked_lost".into(), (lost as u64).into());
    row.insert("far_holds".into(), (present.iter().filter(|&&p| p).count() as u64).into());
    Ok(row)
}

fn mode_row(mode: MirrorMode) -> Row {
    let mut row = new_row("smfs", mode.name);
    row.insert("elements".into(), 2.into());
    row.insert("quorum".into(), mode.quorum.into());
    row
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Latency at each loss, and throughput against loss and delay, on one mirror of `mode`.
fn steady(bench: &Bench, mode: MirrorMode, losses: &[f64], delays: &[f64], rows: &mut Vec<Row>) -> Result<()> {
    let quick = bench.mode == Mode::Quick;
    let seconds = if quick { 1.5 } else { 3.0 };
    let mirror = Mirror::start(bench, mode, 3, params(DELAY_MS, 0.0))?;
    let run = |depth: usize| -> Result<(Vec<WriteOutcome>, f64, u64)> {
        let stop = Arc::new(AtomicBool::new(false));
        let before = mirror.far_applied()?;
        let started = Instant::now();
        let handle = writer(mirror.client()?, depth, stop.clone());
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        let far = mirror.far_applied()? - before;
        let elapsed = started.elapsed().as_secs_f64();
        Ok((join(handle)?, elapsed, far))
    };
    for &loss in losses {
        mirror.link.set(params(DELAY_MS, loss))?;
        bench.progress(&format!("smfs: {} at {loss} % loss: latency, then throughput", mode.name));
        let (outcomes, _, _) = run(1)?;
        let mut ms: Vec<f64> = outcomes
            .iter()
            .filter(|o| o.ok)
            .filter_map(|o| o.answered.map(|a| (a - o.sent).as_secs_f64() * 1e3))
            .collect();
        ms.sort_by(f64::total_cmp);
        let mut row = mode_row(mode);
        row.insert("kind".into(), "latency".into());
        row.insert("mode".into(), mode.name.into());
        set_number(&mut row, "loss_pct", loss);
        row.insert("writes".into(), (ms.len() as u64).into());
        if !ms.is_empty() {
            set_number(&mut row, "mean_ms", ms.iter().sum::<f64>() / ms.len() as f64);
            set_number(&mut row, "p50_ms", percentile(&ms, 0.5));
            set_number(&mut row, "p90_ms", percentile(&ms, 0.9));
            set_number(&mut row, "p99_ms", percentile(&ms, 0.99));
        }
        rows.push(row);
        rows.push(throughput_row(mode, loss, DELAY_MS, run(16)?));
    }
    for &delay in delays {
        mirror.link.set(params(delay, 0.0))?;
        bench.progress(&format!("smfs: {} at {delay} ms one way: throughput", mode.name));
        rows.push(throughput_row(mode, 0.0, delay, run(16)?));
    }
    Ok(())
}

fn throughput_row(
    mode: MirrorMode,
    loss: f64,
    delay: f64,
    (outcomes, seconds, far): (Vec<WriteOutcome>, f64, u64),
) -> Row {
    let acked = outcomes.iter().filter(|o| o.ok).count() as f64;
    let mut row = mode_row(mode);
    row.insert("kind".into(), "throughput".into());
    row.insert("mode".into(), mode.name.into());
    set_number(&mut row, "loss_pct", loss);
    set_number(&mut row, "delay_ms", delay);
    set_number(&mut row, "acked_mbit_s", acked * BLOCK_BYTES as f64 * 8.0 / seconds / 1e6);
    set_number(&mut row, "far_mbit_s", far as f64 * BLOCK_BYTES as f64 * 8.0 / seconds / 1e6);
    row
}

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    let quick = bench.mode == Mode::Quick;
    let mut rows = Vec::new();
    let (modes, losses): (Vec<MirrorMode>, Vec<f64>) =
        if quick { (vec![MODES[0], MODES[5]], vec![1.0]) } else { (MODES.to_vec(), vec![0.1, 0.5, 1.0]) };
    for mode in &modes {
        for &loss in &losses {
            bench.progress(&format!("smfs: rolling disaster, {} at {loss} % loss", mode.name));
            rows.push(disaster(bench, *mode, loss, 3)?);
        }
    }
    if !quick {
        for c in 0..3 {
            bench.progress(&format!("smfs: rolling disaster, network-sync with c = {c} at 1 % loss"));
            rows.push(disaster(bench, MODES[5], 1.0, c)?);
        }
    }
    let (latency_losses, delays): (Vec<f64>, Vec<f64>) =
        if quick { (vec![1.0], vec![]) } else { (vec![0.0, 0.1, 1.0], vec![10.0, 25.0]) };
    for mode in &modes {
        steady(bench, *mode, &latency_losses, &delays, &mut rows)?;
    }
    Ok(rows)
}

pub fn text(rows: &[Row]) -> String {
    fn kind<'a>(rows: &'a [Row], k: &'static str) -> impl Iterator<Item = &'a Row> {
        rows.iter().filter(move |r| r["kind"] == k)
    }
    let name = |r: &Row| r["mode"].as_str().unwrap_or("?").to_string();
    let mut out = String::new();
    let disaster: Vec<Vec<String>> = kind(rows, "disaster")
        .map(|r| {
            vec![
                name(r),
                cell(r, "loss_pct", 1),
                r["fec_c"].as_u64().map_or("-".into(), |c| c.to_string()),
                cell(r, "acked", 0),
                cell(r, "acked_lost", 0),
            ]
        })
        .collect();
    out += &text_table(
        &format!("SMFS rolling disaster: {DELAY_MS} ms one way, {RATE_MBIT} Mbit/s, loss for 0.5 s, then the primary site dies"),
        &["mode", "loss_pct", "fec_c", "acked", "acked_lost"],
        &disaster,
        &[],
    );
    let latency: Vec<Vec<String>> = kind(rows, "latency")
        .map(|r| {
            vec![
                name(r),
                cell(r, "loss_pct", 1),
                cell(r, "writes", 0),
                cell(r, "mean_ms", 2),
                cell(r, "p50_ms", 2),
                cell(r, "p90_ms", 2),
                cell(r, "p99_ms", 2),
            ]
        })
        .collect();
    out += "\n";
    out += &text_table(
        "Acknowledgement latency, one 4 KiB write at a time (ms)",
        &["mode", "loss_pct", "writes", "mean", "p50", "p90", "p99"],
        &latency,
        &[],
    );
    let throughput: Vec<Vec<String>> = kind(rows, "throughput")
        .map(|r| {
            vec![
                name(r),
                cell(r, "loss_pct", 1),
                cell(r, "delay_ms", 0),
                cell(r, "acked_mbit_s", 1),
                cell(r, "far_mbit_s", 1),
            ]
        })
        .collect();
    out += "\n";
    out += &text_table(
        "Throughput, 16 writes of 4 KiB in flight (Mbit/s acknowledged to the host, and reaching the far element)",
        &["mode", "loss_pct", "delay_ms", "acked", "far"],
        &throughput,
        &[format!(
            "goal at 1 % loss: far ≥ 0.9 × {RATE_MBIT} × {R}/({R}+3) = {:.1} Mbit/s",
            0.9 * RATE_MBIT * 8.0 / 11.0
        )],
    );
    out
}
