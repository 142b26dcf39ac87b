//! Host element configuration: the TOML file, the flag syntaxes (`NAME=ADDRESS`,
//! `NAME:SIZE`), sizes with units, and validation into [`HostOptions`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use proto::{Epoch, HostId, VolumeSpec};
use serde::Deserialize;
use shell::host::{FailoverOptions, HostOptions};
use starfish_core::{AckPolicy, HostConfig};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFile {
    pub nbd: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    pub quorum: Option<usize>,
    /// Sizes as strings with units ("128MiB") or plain byte counts.
    pub write_queue: Option<String>,
    pub read_cache: Option<String>,
    /// Pace of recovery traffic per recovering volume, e.g. "100MiB" (per second); unlimited if absent.
    pub recovery_rate: Option<String>,
    /// Background scrub of every volume, e.g. "7d" (the default), "12h"; "0" turns it off.
    pub scrub_interval: Option<String>,
    /// Pace of scrubs, e.g. "32MiB" (per second, the default); "0": unlimited.
    pub scrub_rate: Option<String>,
    /// When intentions of volume operations are written: "group" (the default), "single" or
    /// "none".
    pub intention_log: Option<String>,
    /// How long requests are held while starting before they fail with EIO (milliseconds).
    pub startup_timeout_ms: Option<u64>,
    /// How long an NBD client may stall inside a request or leave a reply untaken, e.g. "30s"
    /// (the default), "5s".
    pub nbd_stall_timeout: Option<String>,
    /// How long an element may send nothing (no heartbeat answer, no reply) before the host
    /// element fails it, e.g. "3s" (the default), "30s".
    pub heartbeat_timeout: Option<String>,
    /// Start as a standby (see `starfish failover`).
    pub standby: Option<bool>,
    /// etcd endpoint for automatic failover, e.g. "http://127.0.0.1:2379".
    pub etcd: Option<String>,
    /// The cluster's name in etcd (default "starfish").
    pub cluster: Option<String>,
    /// With etcd: how long the elements must have missed the active host element before a
    /// standby takes over (milliseconds, default 300).
    pub takeover_after_ms: Option<u64>,
    /// Directory with the cluster CA and this host element's certificate and key: mutual TLS
    /// toward the elements, NBD over TLS only, admin orders by certificate.
    pub tls_dir: Option<PathBuf>,
    /// With tls_dir: NBD clients must present a certificate of the cluster CA.
    pub nbd_tls_verify_peer: Option<bool>,
    /// Serve plain TCP beyond loopback (only on a network protected otherwise).
    pub insecure: Option<bool>,
    /// Reach elements on this machine over their local socket (default true).
    pub local_socket: Option<bool>,
    #[serde(default)]
    pub element: Vec<ElementEntry>,
    #[serde(default)]
    pub volume: Vec<VolumeEntry>,
    /// Consistency groups: volumes that share one sequence space.
    #[serde(default)]
    pub group: Vec<GroupEntry>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupEntry {
    pub name: String,
    pub volumes: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ElementEntry {
    pub name: String,
    pub address: SocketAddr,
    /// Its ack policy: "durable" (the default), "received", "remote-sync", "network-sync" or
    /// "local-sync".
    #[serde(default)]
    pub ack: Option<String>,
    /// Reach it over the far link, UDP with FEC: "R:C" data and repair packets per group,
    /// e.g. "8:3" (the SMFS default). Absent: TCP.
    #[serde(default)]
    pub fec: Option<String>,
    /// With `fec`: the far link's rate, to pace to, e.g. "100Mbit" (absent: unpaced).
    #[serde(default)]
    pub rate: Option<String>,
}

impl ElementEntry {
    /// The far-link parameters, if this element is reached over one.
    pub fn far_link(&self) -> Result<Option<shell::far_link::FarLinkOptions>> {
        let Some(fec) = &self.fec else {
            if self.rate.is_some() {
                bail!("element {}: rate= paces the far link; give fec=R:C too (e.g. fec=8:3)", self.name);
            }
            return Ok(None);
        };
        let (r, c) = fec
            .split_once(':')
            .and_then(|(r, c)| Some((r.parse::<u8>().ok()?, c.parse::<u8>().ok()?)))
            .with_context(|| format!("element {}: fec={fec:?}: expected R:C, e.g. 8:3", self.name))?;
        let rate_bytes_per_s = match &self.rate {
            Some(rate) => parse_rate_bits(rate).with_context(|| format!("element {}", self.name))? / 8,
            None => 0,
        };
        let options = shell::far_link::FarLinkOptions { r, c, rate_bytes_per_s };
        options.link_config().check().map_err(anyhow::Error::msg).with_context(|| format!("element {}", self.name))?;
        Ok(Some(options))
    }
}

/// A link rate in bits per second: "100Mbit", "1Gbit", "500kbit" or a number of bit/s.
pub fn parse_rate_bits(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_lowercase();
    let (number, scale) = if let Some(n) = t.strip_suffix("gbit") {
        (n, 1e9)
    } else if let Some(n) = t.strip_suffix("mbit") {
        (n, 1e6)
    } else if let Some(n) = t.strip_suffix("kbit") {
        (n, 1e3)
    } else {
        (t.strip_suffix("bit").unwrap_or(&t), 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
        .with_context(|| format!("rate {s:?}: expected a positive rate such as 100Mbit, 1Gbit or 500kbit"))?;
    let bits = value * scale;
    if !(100_000.0..=100e9).contains(&bits) {
        bail!("rate {s:?}: out of range (100kbit to 100Gbit)");
    }
    Ok(bits as u64)
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeEntry {
    pub name: String,
    pub size: String,
}

impl HostFile {
    pub fn load(path: &Path) -> Result<HostFile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// The options of a host element start. Its epoch is not chosen here: it offers epoch 1
    /// and, starting, raises it above whatever the elements follow. Its identity is random.
    pub fn into_options(self) -> Result<HostOptions> {
        let nbd = self.nbd.context("the NBD address is missing (--nbd or nbd = \"...\")")?;
        let admin = self.admin.context("the admin address is missing (--admin or admin = \"...\")")?;
        if self.element.is_empty() {
            bail!("no elements configured (--element NAME=ADDRESS, repeatable)");
        }
        if self.volume.is_empty() {
            bail!("no volumes configured (--volume NAME:SIZE, repeatable)");
        }
        let quorum = self.quorum.unwrap_or(self.element.len() / 2 + 1);
        let mut volumes = Vec::new();
        for v in &self.volume {
            let size_bytes =
                parse_size(&v.size).map_err(anyhow::Error::msg).with_context(|| format!("volume {}", v.name))?;
            volumes.push(VolumeSpec { name: v.name.clone(), size_bytes, clone_of: None, at_least: false });
        }
        let groups: Vec<starfish_core::groups::GroupSpec> = self
            .group
            .iter()
            .map(|g| starfish_core::groups::GroupSpec { name: g.name.clone(), volumes: g.volumes.clone() })
            .collect();
        let (storage, exports) = starfish_core::groups::layout(&volumes, &groups).map_err(anyhow::Error::msg)?;
        let mut config =
            HostConfig::new(Epoch(1), quorum, self.element.iter().map(|e| e.name.clone()).collect(), storage);
        if !groups.is_empty() {
            config.exports = exports;
        }
        config.ack_policies = self
            .element
            .iter()
            .map(|e| match &e.ack {
                Some(p) => {
                    AckPolicy::parse(p).map_err(anyhow::Error::msg).with_context(|| format!("element {}", e.name))
                }
                None => Ok(AckPolicy::Durable),
            })
            .collect::<Result<_>>()?;
        config.host_id = fresh_host_id();
        if let Some(ms) = self.startup_timeout_ms {
            config.startup_timeout_ms = ms;
        }
        if let Some(s) = &self.write_queue {
            config.write_queue_bytes = parse_size(s).map_err(anyhow::Error::msg).context("write queue")?;
        }
        if let Some(s) = &self.read_cache {
            config.read_cache_bytes = parse_size(s).map_err(anyhow::Error::msg).context("read cache")?;
        }
        if let Some(s) = &self.recovery_rate {
            config.recovery_rate_bytes_per_s = parse_size(s).map_err(anyhow::Error::msg).context("recovery rate")?;
        }
        if let Some(s) = &self.scrub_interval {
            config.scrub_interval_ms = parse_interval_ms(s).context("scrub interval")?;
        }
        if let Some(s) = &self.scrub_rate {
            config.scrub_rate_bytes_per_s = parse_size(s).map_err(anyhow::Error::msg).context("scrub rate")?;
        }
        if let Some(s) = &self.heartbeat_timeout {
            let timeout = parse_duration_within(s, "heartbeat timeout", "3s or 30s", &HEARTBEAT_TIMEOUT_RANGE)?;
            config.heartbeat_timeout_ms = timeout.as_millis() as u64;
        }
        config.element_addresses = self.element.iter().map(|e| e.address.to_string()).collect();
        config.validate().map_err(anyhow::Error::msg)?;
        let cluster = self.cluster.unwrap_or_else(|| "starfish".into());
        if cluster.is_empty() || !cluster.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            bail!("cluster name {cluster:?}: use letters, digits, '-' and '_'");
        }
        let takeover_after_ms = self.takeover_after_ms.unwrap_or(starfish_core::limits::TAKEOVER_AFTER_MS_DEFAULT);
        if let Some(etcd) = &self.etcd {
            if etcd.is_empty() {
                bail!("--etcd needs an endpoint, e.g. http://127.0.0.1:2379");
            }
        }
        let failover =
            FailoverOptions { standby: self.standby.unwrap_or(false), etcd: self.etcd, cluster, takeover_after_ms };
        let tls = load_tls(self.tls_dir.as_deref())?;
        let intention_log = match &self.intention_log {
            Some(s) => starfish_core::catalog::LogPolicy::parse(s).map_err(anyhow::Error::msg)?,
            None => starfish_core::catalog::LogPolicy::Group,
        };
        let nbd_stall_timeout = match &self.nbd_stall_timeout {
            Some(s) => parse_duration_within(s, "nbd stall timeout", "30s or 2min", &NBD_STALL_TIMEOUT_RANGE)?,
            None => NBD_STALL_TIMEOUT_DEFAULT,
        };
        let nbd_tls_verify_peer = self.nbd_tls_verify_peer.unwrap_or(false);
        if nbd_tls_verify_peer && tls.is_none() {
            bail!("--nbd-tls-verify-peer needs --tls-dir");
        }
        Ok(HostOptions {
            nbd,
            admin,
            element_addresses: self.element.iter().map(|e| e.address).collect(),
            element_links: self.element.iter().map(|e| e.far_link()).collect::<Result<_>>()?,
            config,
            failover,
            tls,
            nbd_tls_verify_peer,
            insecure: self.insecure.unwrap_or(false),
            intention_log,
            local_socket: self.local_socket.unwrap_or(true),
            nbd_stall_timeout,
        })
    }
}

/// An element's configuration file: the same settings as `starfish element`'s flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ElementFile {
    pub listen: Option<SocketAddr>,
    pub data: Option<PathBuf>,
    /// Bytes of recent writes kept for peers' replay recovery, e.g. "256MiB".
    pub replay_log: Option<String>,
    /// Bytes of log after which the live segment is sealed and checkpointed, e.g. "64MiB".
    pub checkpoint_log: Option<String>,
    pub overcommit: Option<bool>,
    /// Write large writes into holes once (`store::StoreOptions::placed_writes`).
    pub placed_writes: Option<bool>,
    /// Directory with the cluster CA and this element's certificate and key.
    pub tls_dir: Option<PathBuf>,
    /// Serve plain TCP beyond loopback (only on a network protected otherwise).
    pub insecure: Option<bool>,
    /// On a loopback address, listen on the local socket too (default true).
    pub local_socket: Option<bool>,
}

impl ElementFile {
    pub fn load(path: &Path) -> Result<ElementFile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn into_options(self) -> Result<shell::element::ElementOptions> {
        let listen = self.listen.context("the listen address is missing (--listen or listen = \"...\")")?;
        let data = self.data.context("the data directory is missing (--data or data = \"...\")")?;
        let mut store = store::StoreOptions::default();
        if let Some(size) = &self.replay_log {
            store.replay_log_bytes = parse_size(size).map_err(anyhow::Error::msg).context("replay log")?;
        }
        if let Some(size) = &self.checkpoint_log {
            store.checkpoint_log_bytes = parse_size(size).map_err(anyhow::Error::msg).context("checkpoint log")?;
            // Checked here, so that a bad size is refused before anything starts.
            store.check().map_err(anyhow::Error::msg).with_context(|| format!("checkpoint log {size}"))?;
        }
        store.overcommit = self.overcommit.unwrap_or(false);
        store.placed_writes = self.placed_writes.unwrap_or(false);
        Ok(shell::element::ElementOptions {
            listen,
            data,
            store,
            tls: load_tls(self.tls_dir.as_deref())?,
            insecure: self.insecure.unwrap_or(false),
            local_socket: self.local_socket.unwrap_or(true),
        })
    }
}

/// Load a TLS directory (`--tls-dir`) if one is given.
pub fn load_tls(dir: Option<&Path>) -> Result<Option<shell::tls::TlsContext>> {
    dir.map(|dir| shell::tls::TlsContext::load(dir).map_err(anyhow::Error::msg)).transpose()
}

/// A random, non-zero host element identity.
fn fresh_host_id() -> HostId {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return HostId(id);
        }
    }
}

/// `NAME=ADDRESS[,ack=POLICY][,fec=R:C][,rate=RATE]`, e.g.
/// `far=10.0.0.3:7103,ack=network-sync,fec=8:3,rate=100Mbit`.
pub fn parse_element(s: &str) -> Result<ElementEntry> {
    let (name, rest) = s.split_once('=').with_context(|| {
        format!("element {s:?}: expected NAME=ADDRESS[,ack=POLICY][,fec=R:C][,rate=RATE], e.g. near=127.0.0.1:7102")
    })?;
    if name.is_empty() {
        bail!("element {s:?}: the name is empty");
    }
    let mut parts = rest.split(',');
    let address = parts.next().unwrap_or_default();
    let address = address.parse().with_context(|| format!("element {s:?}: bad address {address:?}"))?;
    let mut entry = ElementEntry { name: name.to_string(), address, ack: None, fec: None, rate: None };
    for option in parts {
        match option.split_once('=') {
            Some(("ack", policy)) => {
                AckPolicy::parse(policy).map_err(anyhow::Error::msg).with_context(|| format!("element {s:?}"))?;
                entry.ack = Some(policy.to_string());
            }
            Some(("fec", fec)) => entry.fec = Some(fec.to_string()),
            Some(("rate", rate)) => entry.rate = Some(rate.to_string()),
            _ => bail!("element {s:?}: unknown option {option:?} (they are ack=POLICY, fec=R:C and rate=RATE)"),
        }
    }
    entry.far_link()?;
    Ok(entry)
}

/// `NAME:VOL,VOL…`, e.g. `db:data,wal`.
pub fn parse_group(s: &str) -> Result<GroupEntry> {
    let (name, volumes) =
        s.split_once(':').with_context(|| format!("group {s:?}: expected NAME:VOLUME,VOLUME…, e.g. db:data,wal"))?;
    let volumes: Vec<String> = volumes.split(',').map(str::to_string).collect();
    if name.is_empty() || volumes.iter().any(String::is_empty) {
        bail!("group {s:?}: expected NAME:VOLUME,VOLUME…, e.g. db:data,wal");
    }
    Ok(GroupEntry { name: name.to_string(), volumes })
}

pub fn parse_volume(s: &str) -> Result<VolumeEntry> {
    let (name, size) =
        s.rsplit_once(':').with_context(|| format!("volume {s:?}: expected NAME:SIZE, e.g. vol0:1GiB"))?;
    parse_size(size).map_err(anyhow::Error::msg).with_context(|| format!("volume {s:?}"))?;
    Ok(VolumeEntry { name: name.to_string(), size: size.to_string() })
}

/// `4096`, `64KiB`, `512MiB`, `1GiB`, `2TiB` (also `K`, `M`, `G`, `T`, `KB`… as binary units).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: u64 = number.parse().map_err(|_| format!("bad size {s:?}: expected e.g. 1GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("bad size {s:?}: unknown unit {other:?} (use KiB, MiB, GiB or TiB)")),
    };
    number.checked_mul(1u64 << shift).ok_or_else(|| format!("size {s:?} is too large"))
}

/// An interval such as `7d`, `12h`, `30min` (humantime's syntax); `0` or `off`: never.
pub fn parse_interval_ms(s: &str) -> Result<u64> {
    match s.trim() {
        "0" | "off" => Ok(0),
        t => {
            let d = humantime::parse_duration(t)
                .with_context(|| format!("bad interval {s:?}: expected e.g. 7d, 12h, 30min or 0"))?;
            if d.as_millis() == 0 {
                return Ok(0);
            }
            u64::try_from(d.as_millis()).map_err(|_| anyhow::anyhow!("interval {s:?} is too long"))
        }
    }
}

/// How long an NBD client may stall by default (`--nbd-stall-timeout`).
pub const NBD_STALL_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// The range `--nbd-stall-timeout` takes: shorter would close clients on a busy machine's
/// hiccup; longer lets a stalled client hold its memory (up to 64 MiB) for longer than anyone
/// waits for a disk.
const NBD_STALL_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(3600);

/// The range `--heartbeat-timeout` takes: well above the heartbeat interval (100 ms), so a busy
/// machine's hiccup fails no element; at most 10 min, so a hung element is failed within it
/// even when nothing else notices (a full write queue fails it sooner, `Failure::TooSlow`).
const HEARTBEAT_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(600);

/// A duration flag such as `--nbd-stall-timeout` ("30s", "2min"), within its range; `what` names
/// it in errors, `examples` shows the syntax.
fn parse_duration_within(
    s: &str,
    what: &str,
    examples: &str,
    range: &std::ops::RangeInclusive<Duration>,
) -> Result<Duration> {
    let value = humantime::parse_duration(s.trim())
        .with_context(|| format!("{what} {s:?}: expected a duration such as {examples}"))?;
    if !range.contains(&value) {
        bail!(
            "{what} {s:?}: must be from {} to {}",
            humantime::format_duration(*range.start()),
            humantime::format_duration(*range.end())
        );
    }
    Ok(value)
}

/// A volume name as a URL query value: unreserved characters as they are, the rest `%XX`.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Bytes in the largest binary unit that keeps one decimal, e.g. `1.5GiB`, `300.0MiB`.
pub fn format_size_approx(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while unit + 1 < UNITS.len() && value >= 1024.0 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.1}{}", UNITS[unit])
    }
}

pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while unit + 1 < UNITS.len() && value >= 1024 && value.is_multiple_of(1024) {
        value /= 1024;
        unit += 1;
    }
    format!("{value}{}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        fn check(s: &str, want: Option<u64>) {
            assert_eq!(parse_size(s).ok(), want, "{s}");
        }
        check("4096", Some(4096));
        check("1GiB", Some(1 << 30));
        check("64KiB", Some(64 << 10));
        check("512M", Some(512 << 20));
        check("1.5GiB", None);
        check("GiB", None);
        check("3 parsecs", None);
        check("99999999999TiB", None);
        assert_eq!(format_size(1 << 30), "1GiB");
        assert_eq!(format_size(1000), "1000B");
    }

    #[test]
    fn an_element_checkpoint_log_is_taken_within_its_range_and_refused_outside_it() {
        let file = |size: &str| ElementFile {
            listen: Some("127.0.0.1:7101".parse().expect("valid")),
            data: Some("/tmp/unused".into()),
            checkpoint_log: Some(size.into()),
            ..ElementFile::default()
        };
        let options = file("16MiB").into_options().expect("valid");
        assert_eq!(options.store.checkpoint_log_bytes, 16 << 20);
        assert_eq!(options.store.replay_log_bytes, store::REPLAY_LOG_BYTES_DEFAULT);
        let options = ElementFile { checkpoint_log: None, ..file("") }.into_options().expect("valid");
        assert_eq!(options.store.checkpoint_log_bytes, store::CHECKPOINT_LOG_BYTES_DEFAULT);
        for (size, ok) in [("64KiB", true), ("4GiB", true), ("60KiB", false), ("5GiB", false), ("lots", false)] {
            let result = file(size).into_options();
            assert_eq!(result.is_ok(), ok, "{size}");
            if let Err(error) = result {
                let error = format!("{error:#}");
                assert!(error.contains("checkpoint log"), "{size}: {error}");
            }
        }
    }

    #[test]
    fn far_links_parse_and_bad_ones_are_refused_with_the_reason() {
        let e = parse_element("far=10.0.0.3:7103,ack=network-sync,fec=8:3,rate=100Mbit").expect("valid");
        let far = e.far_link().expect("valid").expect("a far link");
        assert_eq!((far.r, far.c, far.rate_bytes_per_s), (8, 3, 12_500_000));
        let e = parse_element("far=10.0.0.3:7103,fec=4:0").expect("valid: no repair packets");
        assert_eq!(e.far_link().expect("valid").map(|f| (f.r, f.c, f.rate_bytes_per_s)), Some((4, 0, 0)));
        assert!(parse_element("near=127.0.0.1:7102").expect("valid").far_link().expect("valid").is_none());
        for (bad, says) in [
            ("far=10.0.0.3:7103,rate=100Mbit", "give fec=R:C too"),
            ("far=10.0.0.3:7103,fec=8", "expected R:C"),
            ("far=10.0.0.3:7103,fec=0:3", "1 ≤ r"),
            ("far=10.0.0.3:7103,fec=60:10", "r + c ≤ 64"),
            ("far=10.0.0.3:7103,fec=8:3,rate=fast", "positive rate"),
            ("far=10.0.0.3:7103,fec=8:3,rate=10bit", "out of range"),
            ("far=10.0.0.3:7103,mtu=9000", "fec=R:C and rate=RATE"),
        ] {
            let error = format!("{:#}", parse_element(bad).expect_err(bad));
            assert!(error.contains(says), "{bad}: {error}");
        }
        assert_eq!(parse_rate_bits("1Gbit").expect("valid"), 1_000_000_000);
        assert_eq!(parse_rate_bits("2.5 mbit").expect("valid"), 2_500_000);
    }

    #[test]
    fn flags_and_file_agree() {
        let file: HostFile = toml::from_str(
            r#"
            nbd = "127.0.0.1:10809"
            admin = "127.0.0.1:7100"
            quorum = 2
            [[element]]
            name = "local"
            address = "127.0.0.1:7101"
            [[element]]
            name = "near"
            address = "127.0.0.1:7102"
            [[element]]
            name = "far"
            address = "127.0.0.1:7103"
            [[volume]]
            name = "vol0"
            size = "1GiB"
            "#,
        )
        .expect("valid TOML");
        let mut from_file = file.into_options().expect("valid");
        let from_flags = HostFile {
            nbd: Some("127.0.0.1:10809".parse().unwrap()),
            admin: Some("127.0.0.1:7100".parse().unwrap()),
            quorum: Some(2),
            element: ["local=127.0.0.1:7101", "near=127.0.0.1:7102", "far=127.0.0.1:7103"]
                .iter()
                .map(|s| parse_element(s).unwrap())
                .collect(),
            volume: vec![parse_volume("vol0:1GiB").unwrap()],
            ..HostFile::default()
        }
        .into_options()
        .expect("valid");
        assert_ne!(from_file.config.host_id, from_flags.config.host_id, "each start has its own identity");
        from_file.config.host_id = from_flags.config.host_id;
        assert_eq!(format!("{from_file:?}"), format!("{from_flags:?}"));
    }

    #[test]
    fn bad_configuration_is_explained() {
        let err = |f: HostFile| f.into_options().unwrap_err().to_string();
        assert!(err(HostFile::default()).contains("NBD address"));
        let base = || HostFile {
            nbd: Some("127.0.0.1:1".parse().unwrap()),
            admin: Some("127.0.0.1:2".parse().unwrap()),
            element: vec![parse_element("a=127.0.0.1:3").unwrap()],
            volume: vec![parse_volume("v:1MiB").unwrap()],
            ..HostFile::default()
        };
        assert!(err(HostFile { quorum: Some(2), ..base() }).contains("quorum"));
        assert!(err(HostFile { volume: vec![], ..base() }).contains("no volumes"));
        assert!(parse_element("nonsense").is_err());
        assert!(parse_volume("vol0").is_err());
        assert!(toml::from_str::<HostFile>("quorom = 2").is_err(), "typos are rejected");
    }

    /// The smallest valid host element file: one element, one volume.
    fn minimal_host_file() -> HostFile {
        HostFile {
            nbd: Some("127.0.0.1:1".parse().expect("valid")),
            admin: Some("127.0.0.1:2".parse().expect("valid")),
            element: vec![parse_element("a=127.0.0.1:3").expect("valid")],
            volume: vec![parse_volume("v:1MiB").expect("valid")],
            ..HostFile::default()
        }
    }

    #[test]
    fn the_nbd_stall_timeout_is_taken_within_its_range_and_refused_outside_it() {
        let timeout = |t: Option<&str>| {
            HostFile { nbd_stall_timeout: t.map(String::from), ..minimal_host_file() }
                .into_options()
                .map(|o| o.nbd_stall_timeout)
        };
        assert_eq!(timeout(None).expect("valid"), NBD_STALL_TIMEOUT_DEFAULT);
        assert_eq!(timeout(Some("5s")).expect("valid"), Duration::from_secs(5));
        assert_eq!(timeout(Some("1s")).expect("valid"), Duration::from_secs(1));
        assert_eq!(timeout(Some("1h")).expect("valid"), Duration::from_secs(3600));
        for bad in ["500ms", "2h", "0s"] {
            let message = timeout(Some(bad)).expect_err(bad).to_string();
            assert!(message.contains("must be from 1s to 1h"), "{bad}: {message}");
        }
        let message = timeout(Some("soon")).expect_err("not a duration").to_string();
        assert!(message.contains("expected a duration"), "{message}");
    }

    #[test]
    fn the_heartbeat_timeout_is_taken_within_its_range_and_refused_outside_it() {
        let timeout = |t: Option<&str>| {
            HostFile { heartbeat_timeout: t.map(String::from), ..minimal_host_file() }
                .into_options()
                .map(|o| o.config.heartbeat_timeout_ms)
        };
        assert_eq!(timeout(None).expect("valid"), starfish_core::limits::HEARTBEAT_TIMEOUT_MS_DEFAULT);
        assert_eq!(timeout(Some("30s")).expect("valid"), 30_000);
        assert_eq!(timeout(Some("1s")).expect("valid"), 1_000);
        assert_eq!(timeout(Some("1500ms")).expect("valid"), 1_500);
        assert_eq!(timeout(Some("10min")).expect("valid"), 600_000);
        for bad in ["500ms", "11min", "0s"] {
            let message = timeout(Some(bad)).expect_err(bad).to_string();
            assert!(
                message.contains("heartbeat timeout") && message.contains("must be from 1s to 10m"),
                "{bad}: {message}"
            );
        }
        let message = timeout(Some("never")).expect_err("not a duration").to_string();
        assert!(message.contains("expected a duration such as 3s"), "{message}");
    }
}
