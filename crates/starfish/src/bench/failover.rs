//! `starfish bench failover`: how long a takeover takes, with real processes — three elements,
//! an active host element and a standby on the same NBD address (one machine), a real etcd for
//! the automatic rows — and what an unmodified client sees: qemu-io with `reconnect-delay`
//! writing 4 KiB every 20 ms to `vol0` throughout.
//!
//! Rows: `manual` (kill -9 of the active, then `POST /failover` to the standby at once: an
//! operator's reaction time is not counted), `graceful` (`POST /failover` with the active alive:
//! it drains first), `automatic` (kill -9; the standby, elected through etcd, sees the elements
//! lose the active and takes over by itself); each with 1 and 4 volumes (the paper's 2.1–2.2 s
//! and 2.1–3.2 s, manual).
//!
//! - `takeover_ms`: from the kill (graceful: the command) until the new host element's status
//!   says every volume is read-write, polled every 5 ms: from then on it acknowledges writes.
//! - `client_gap_ms`: the longest pause between two of qemu-io's completed writes around the
//!   event, less the 20 ms it sleeps between writes: what the client's disk saw.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::cluster::admin_request;
use super::process::{find_tool, free_port, require_tools, wait_port, Child, ScratchDir};
use super::{cell, new_row, set_number, text_table, Bench, Mode, Row};

const START_TIMEOUT: Duration = Duration::from_secs(30);
const TAKEOVER_TIMEOUT: Duration = Duration::from_secs(30);
/// qemu-io's pause between writes.
const WRITE_INTERVAL_MS: u64 = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Manual,
    Graceful,
    Automatic,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Manual => "manual",
            Kind::Graceful => "graceful",
            Kind::Automatic => "automatic",
        }
    }
}

pub fn run(bench: &Bench) -> Result<Vec<Row>> {
    require_tools(&[("qemu-io", "qemu-utils"), ("stdbuf", "coreutils")])?;
    let etcd = find_tool("etcd");
    let volume_counts: &[usize] = if bench.mode == Mode::Quick { &[1] } else { &[1, 4] };
    let mut rows = Vec::new();
    for kind in [Kind::Manual, Kind::Graceful, Kind::Automatic] {
        for &volumes in volume_counts {
            if kind == Kind::Automatic && etcd.is_none() {
                bench.progress("no `etcd` (install etcd-server): automatic rows skipped");
                continue;
            }
            bench.progress(&format!("{} takeover, {volumes} volume(s)", kind.name()));
            rows.push(one(bench, kind, volumes, etcd.as_deref())?);
        }
    }
    Ok(rows)
}

/// The status document of a host element, if it answers.
fn status(admin: SocketAddr) -> Option<Value> {
    let body = admin_request(admin, "GET", "/status", Duration::from_secs(2)).ok()?;
    serde_json::from_str(&body).ok()
}

fn serving(doc: &Value) -> bool {
    doc["role"] == "active"
        && doc["volumes"].as_array().is_some_and(|v| !v.is_empty() && v.iter().all(|v| v["mode"] == "read-write"))
}

fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !check()? {
        if Instant::now() > deadline {
            bail!("{what}: not within {} s", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

fn one(bench: &Bench, kind: Kind, volumes: usize, etcd_bin: Option<&Path>) -> Result<Row> {
    let dir = ScratchDir::create(&bench.work, "starfish-bench-failover")?;
    // Fields drop in reverse order of creation below: hosts, then etcd and elements.
    let mut elements = Vec::new();
    let mut element_flags = Vec::new();
    for name in ["local", "near", "far"] {
        let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut cmd = Command::new(&bench.bin);
        cmd.arg("element").arg("--listen").arg(listen.to_string()).arg("--data").arg(dir.path().join(name));
        let mut child = Child::spawn(&format!("element {name}"), &mut cmd, &dir.path().join(format!("{name}.log")))?;
        wait_port(listen, START_TIMEOUT, &mut child)?;
        elements.push(child);
        element_flags.push(format!("{name}={listen}"));
    }
    let mut etcd = None;
    let mut etcd_url = None;
    if kind == Kind::Automatic {
        let bin = etcd_bin.context("etcd")?;
        let (client, peer) = (free_port()?, free_port()?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new(bin);
        cmd.arg("--name")
            .arg("bench")
            .arg("--data-dir")
            .arg(dir.path().join("etcd"))
            .arg("--listen-client-urls")
            .arg(&url)
            .arg("--advertise-client-urls")
            .arg(&url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("bench={peer_url}"));
        let mut child = Child::spawn("etcd", &mut cmd, &dir.path().join("etcd.log"))?;
        wait_port(SocketAddr::from(([127, 0, 0, 1], client)), START_TIMEOUT, &mut child)?;
        etcd = Some(child);
        etcd_url = Some(url);
    }
    let nbd = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let admins = [SocketAddr::from(([127, 0, 0, 1], free_port()?)), SocketAddr::from(([127, 0, 0, 1], free_port()?))];
    let host = |name: &str, admin: SocketAddr, standby: bool| -> Result<Child> {
        let mut cmd = Command::new(&bench.bin);
        cmd.arg("host").arg("--nbd").arg(nbd.to_string()).arg("--admin").arg(admin.to_string());
        for flag in &element_flags {
            cmd.arg("--element").arg(flag);
        }
        cmd.arg("--quorum").arg("2");
        for v in 0..volumes {
            cmd.arg("--volume").arg(format!("vol{v}:256MiB"));
        }
        if let Some(url) = &etcd_url {
            cmd.arg("--etcd").arg(url);
        } else if standby {
            cmd.arg("--standby");
        }
        Child::spawn(&format!("host element {name}"), &mut cmd, &dir.path().join(format!("host-{name}.log")))
    };
    let mut a = host("a", admins[0], false)?;
    wait_for("host element a serving", START_TIMEOUT, || {
        a.check_alive()?;
        Ok(status(admins[0]).is_some_and(|d| serving(&d)))
    })?;
    let mut b = host("b", admins[1], true)?;
    wait_for("host element b a standby that knows the active one", START_TIMEOUT, || {
        b.check_alive()?;
        Ok(status(admins[1]).is_some_and(|d| d["role"] == "standby" && !d["active"].is_null()))
    })?;

    // A standby runs long before it is needed: let it settle (etcd: see `FRESH_CLAIM_GRACE`).
    std::thread::sleep(Duration::from_secs(2));
    // The client: qemu-io, told nothing, reconnecting by itself.
    let writes = 200;
    let image = format!(
        "driver=raw,file.driver=nbd,file.server.type=inet,file.server.host=127.0.0.1,\
         file.server.port={},file.export=vol0,file.reconnect-delay=30",
        nbd.port()
    );
    let mut cmd = Command::new("stdbuf");
    cmd.arg("-oL").arg("qemu-io").arg("--image-opts").arg(&image);
    for i in 0..writes {
        cmd.arg("-c").arg(format!("write -P {} {} 4k", i % 251, (i % 1024) * 4096));
        cmd.arg("-c").arg(format!("sleep {WRITE_INTERVAL_MS}"));
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut qemu = Child::spawn_piped("qemu-io", &mut cmd)?;
    let stdout = qemu.take_stdout().context("qemu-io's output")?;
    let completions: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let completions = completions.clone();
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if line.starts_with("wrote ") {
                    completions.lock().unwrap_or_else(|e| e.into_inner()).push(Instant::now());
                } else if line.contains("error") || line.contains("failed") {
                    failures.push(line);
                }
            }
            failures
        })
    };
    // Let the client run a while, then the event.
    std::thread::sleep(Duration::from_millis(1500));
    let event = Instant::now();
    match kind {
        Kind::Manual => {
            a.kill9();
            admin_request(admins[1], "POST", "/failover", Duration::from_secs(30))?;
        }
        Kind::Graceful => {
            admin_request(admins[1], "POST", "/failover", Duration::from_secs(30))?;
        }
        Kind::Automatic => a.kill9(),
    }
    wait_for("the standby serving", TAKEOVER_TIMEOUT, || {
        b.check_alive()?;
        Ok(status(admins[1]).is_some_and(|d| serving(&d)))
    })?;
    let takeover = event.elapsed();
    let exited = qemu.wait_bounded(Duration::from_secs(120))?;
    let failures = reader.join().unwrap_or_default();
    if !exited.success() || !failures.is_empty() {
        bail!("qemu-io failed across the takeover ({exited}): {}", failures.join("; "));
    }
    let times = completions.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if times.len() != writes {
        bail!("qemu-io completed {} of {writes} writes", times.len());
    }
    let gap = times
        .windows(2)
        .filter(|w| w[1] >= event)
        .map(|w| w[1].duration_since(w[0]))
        .max()
        .unwrap_or_default()
        .saturating_sub(Duration::from_millis(WRITE_INTERVAL_MS));
    drop(b);
    drop(a);
    drop(etcd);
    drop(elements);
    let mut row = new_row("failover", &format!("{} {volumes}", kind.name()));
    row.insert("mode".into(), Value::from(kind.name()));
    row.insert("volumes".into(), Value::from(volumes as u64));
    set_number(&mut row, "takeover_ms", takeover.as_secs_f64() * 1000.0);
    set_number(&mut row, "client_gap_ms", gap.as_secs_f64() * 1000.0);
    Ok(row)
}

pub fn text(rows: &[Row]) -> String {
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r["mode"].as_str().unwrap_or("?").to_string(),
                r["volumes"].to_string(),
                cell(r, "takeover_ms", 0),
                cell(r, "client_gap_ms", 0),
            ]
        })
        .collect();
    let notes = vec![
        "takeover_ms: from the kill -9 (graceful: the failover command) until the new host element serves every \
         volume read-write (polled every 5 ms)."
            .to_string(),
        "client_gap_ms: the longest pause qemu-io (reconnect-delay=30, a 4 KiB write every 20 ms) saw; it includes \
         qemu's own reconnect back-off."
            .to_string(),
        "The paper's manual failover: 2.1-2.2 s with one volume, 2.1-3.2 s with four.".to_string(),
    ];
    text_table(
        "Failover (3 elements, Q=2, both host elements on one machine)",
        &["MODE", "VOLUMES", "TAKEOVER ms", "CLIENT GAP ms"],
        &body,
        &notes,
    )
}
