//! A StarFish cluster of real processes for one benchmark configuration: `starfish element`
//! per site, an emulated link ([`netem::Proxy`], in this process) in front of every site with a
//! delay or a rate, and `starfish host` exporting `vol0`. Dropping it stops the host, the
//! links and the elements, in that order, and removes the data.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::process::{free_port, wait_port, Child, ScratchDir};

const START_TIMEOUT: Duration = Duration::from_secs(30);
const IN_SYNC_TIMEOUT: Duration = Duration::from_secs(60);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(3);

/// One element and the emulated link between it and the host element.
#[derive(Debug, Clone, PartialEq)]
pub struct Site {
    pub name: &'static str,
    pub delay_ms: f64,
    pub rate_mbit: Option<f64>,
}

impl Site {
    pub fn new(name: &'static str, delay_ms: f64, rate_mbit: Option<f64>) -> Site {
        Site { name, delay_ms, rate_mbit }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSpec {
    pub sites: Vec<Site>,
    pub quorum: usize,
    pub volume_bytes: u64,
    /// `None`: the host element's default read cache.
    pub read_cache_bytes: Option<u64>,
    /// Mutual TLS between the processes and NBD over TLS (`starfish certs init` in the
    /// cluster's directory).
    pub tls: bool,
    /// More flags for the host element.
    pub host_extra: Vec<String>,
}

/// Fields drop in declaration order: host element first, then links, elements, data.
#[derive(Debug)]
pub struct Cluster {
    host: Child,
    _links: Vec<netem::Proxy>,
    _elements: Vec<Child>,
    dir: ScratchDir,
    nbd: SocketAddr,
    admin: SocketAddr,
    /// With TLS: a home directory whose `.pki/libnbd` holds an operator's certificate, where
    /// libnbd (fio's nbd engine) looks for one when not run as root.
    client_home: Option<PathBuf>,
}

impl Cluster {
    pub fn start(bin: &Path, work: &Path, spec: &ClusterSpec) -> Result<Cluster> {
        let dir = ScratchDir::create(work, "starfish-bench")?;
        let certs = dir.path().join("certs");
        let client_home = if spec.tls { Some(make_certificates(bin, dir.path(), spec)?) } else { None };
        let tls_dir = |name: &str| -> Vec<String> {
            if spec.tls {
                vec!["--tls-dir".into(), certs.join(name).display().to_string()]
            } else {
                Vec::new()
            }
        };
        let mut elements = Vec::new();
        let mut links = Vec::new();
        let mut element_flags = Vec::new();
        for site in &spec.sites {
            let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
            let mut cmd = Command::new(bin);
            cmd.arg("element").arg("--listen").arg(listen.to_string()).arg("--data").arg(dir.path().join(site.name));
            cmd.args(tls_dir(site.name));
            let log = dir.path().join(format!("{}.log", site.name));
            let mut child = Child::spawn(&format!("element {}", site.name), &mut cmd, &log)?;
            wait_port(listen, START_TIMEOUT, &mut child)?;
            elements.push(child);
            let address = if site.delay_ms == 0.0 && site.rate_mbit.is_none() {
                listen
            } else {
                let params = netem::LinkParams {
                    delay_ms_one_way: site.delay_ms,
                    rate_mbit: site.rate_mbit,
                    ..netem::LinkParams::default()
                };
                let any = SocketAddr::from(([127, 0, 0, 1], 0));
                let proxy = netem::Proxy::start(any, listen, params)
                    .with_context(|| format!("emulated link to the {} element", site.name))?;
                let address = proxy.address();
                links.push(proxy);
                address
            };
            element_flags.push(format!("{}={address}", site.name));
        }
        let nbd = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut cmd = Command::new(bin);
        cmd.arg("host").arg("--nbd").arg(nbd.to_string()).arg("--admin").arg(admin.to_string());
        for flag in &element_flags {
            cmd.arg("--element").arg(flag);
        }
        cmd.arg("--quorum").arg(spec.quorum.to_string()).arg("--volume").arg(format!("vol0:{}", spec.volume_bytes));
        if let Some(bytes) = spec.read_cache_bytes {
            cmd.arg("--read-cache").arg(bytes.to_string());
        }
        cmd.args(tls_dir("host"));
        cmd.args(&spec.host_extra);
        let mut host = Child::spawn("host element", &mut cmd, &dir.path().join("host.log"))?;
        wait_port(nbd, START_TIMEOUT, &mut host)?;
        wait_in_sync(admin, &mut host)?;
        Ok(Cluster { host, _links: links, _elements: elements, dir, nbd, admin, client_home })
    }

    /// The NBD URI of the volume (`nbds://` with TLS: the client finds its certificate in
    /// [`Cluster::client_home`]).
    pub fn uri(&self) -> String {
        match self.client_home {
            Some(_) => format!("nbds://{}/vol0", self.nbd),
            None => format!("nbd://{}/vol0", self.nbd),
        }
    }

    /// With TLS: the `HOME` of a client run as a user that is not root.
    pub fn client_home(&self) -> Option<&Path> {
        self.client_home.as_deref()
    }

    /// A directory for scratch files that goes away with the cluster.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// Writes (and trims) the host element has acknowledged on all volumes: the sum of their
    /// acknowledged sequences.
    pub fn acked_writes(&self) -> Result<u64> {
        let doc: Value = serde_json::from_str(&admin_get(self.admin, "/status")?).context("bad JSON from /status")?;
        let volumes = doc["volumes"].as_array().context("/status has no volumes")?;
        Ok(volumes.iter().filter_map(|v| v["acked_sequence"].as_u64()).sum())
    }

    /// The round-trip time the host element measures to an element (its heartbeats, through the
    /// emulated link), in milliseconds.
    pub fn element_rtt_ms(&self, name: &str) -> Result<Option<f64>> {
        let doc: Value = serde_json::from_str(&admin_get(self.admin, "/status")?).context("bad JSON from /status")?;
        let elements = doc["elements"].as_array().context("/status has no elements")?;
        Ok(elements.iter().find(|e| e["name"] == name).and_then(|e| e["rtt_ms"].as_f64()))
    }

    /// The host element's admin address.
    pub fn admin(&self) -> SocketAddr {
        self.admin
    }

    /// Fails with the host element's log if it died (a benchmark figure would be meaningless).
    pub fn check_alive(&mut self) -> Result<()> {
        self.host.check_alive()
    }
}

/// The cluster's certificates in `dir/certs`, and a client home directory with the operator's
/// (readable by anyone: fio runs as an unprivileged user to find it).
fn make_certificates(bin: &Path, dir: &Path, spec: &ClusterSpec) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let certs = dir.join("certs");
    let mut cmd = Command::new(bin);
    cmd.arg("certs").arg("init").arg(&certs).arg("--host").arg("host").arg("--client").arg("admin");
    for site in &spec.sites {
        cmd.arg("--element").arg(site.name);
    }
    let out = cmd.output().context("starting starfish certs init")?;
    if !out.status.success() {
        bail!("starfish certs init failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let home = dir.join("client-home");
    let pki = home.join(".pki").join("libnbd");
    std::fs::create_dir_all(&pki).context("creating the client's certificate directory")?;
    for name in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        std::fs::copy(certs.join("admin").join(name), pki.join(name)).with_context(|| format!("copying {name}"))?;
        std::fs::set_permissions(pki.join(name), std::fs::Permissions::from_mode(0o644))?;
    }
    for path in [dir, &home, &home.join(".pki"), &pki] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(home)
}

fn wait_in_sync(admin: SocketAddr, host: &mut Child) -> Result<()> {
    let deadline = Instant::now() + IN_SYNC_TIMEOUT;
    loop {
        host.check_alive()?;
        let last = match admin_get(admin, "/status") {
            Ok(body) => match serde_json::from_str::<Value>(&body) {
                Ok(doc) if all_in_sync(&doc) => return Ok(()),
                Ok(doc) => doc.to_string(),
                Err(e) => format!("bad JSON from the admin endpoint: {e}"),
            },
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!("the cluster did not get in sync within {} s; last status: {last}", IN_SYNC_TIMEOUT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every element in sync and every volume read-write (the `/status` document's shape).
pub fn all_in_sync(doc: &Value) -> bool {
    let elements = doc["elements"].as_array();
    let volumes = doc["volumes"].as_array();
    match (elements, volumes) {
        (Some(elements), Some(volumes)) => {
            !elements.is_empty()
                && !volumes.is_empty()
                && elements.iter().all(|e| e["state"] == "in-sync")
                && volumes.iter().all(|v| v["mode"] == "read-write")
        }
        _ => false,
    }
}

fn admin_get(admin: SocketAddr, path: &str) -> Result<String> {
    admin_request(admin, "GET", path, ADMIN_TIMEOUT)
}

/// One HTTP/1.0 request to a host element's admin endpoint: the body of a 200 answer.
pub fn admin_request(admin: SocketAddr, method: &str, path: &str, timeout: Duration) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&admin, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(format!("{method} {path} HTTP/1.0\r\nHost: {admin}\r\nContent-Length: 0\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").context("admin endpoint sent no header end")?;
    if head.split(' ').nth(1) != Some("200") {
        bail!("admin endpoint answered: {}: {}", head.lines().next().unwrap_or(""), body.trim());
    }
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_sync_needs_every_element_and_volume() {
        let check = |text: &str, expected: bool| {
            let doc: Value = serde_json::from_str(text).expect("test JSON");
            assert_eq!(all_in_sync(&doc), expected, "{text}");
        };
        check(r#"{"elements":[{"state":"in-sync"},{"state":"in-sync"}],"volumes":[{"mode":"read-write"}]}"#, true);
        check(r#"{"elements":[{"state":"in-sync"},{"state":"recovering"}],"volumes":[{"mode":"read-write"}]}"#, false);
        check(r#"{"elements":[{"state":"in-sync"}],"volumes":[{"mode":"read-only"}]}"#, false);
        check(r#"{"elements":[],"volumes":[{"mode":"read-write"}]}"#, false);
        check(r#"{}"#, false);
    }
}
