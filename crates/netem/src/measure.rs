//! Measures what a link does, to compare with what it was configured to do: the one-way delay
//! (half the round trip of small messages over TCP, idle and while a bulk transfer fills the
//! link) and the rate (goodput of a bulk transfer at the receiver, and the IP bytes the relay
//! delivered over the same interval). Used by `starfish link --measure`, the fidelity tests and
//! docs/link-emulation.md.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::link::{Link, LinkStats, Side};
use crate::model::PathStats;
use crate::params::LinkParams;
use crate::proxy::Proxy;
use crate::{sys, LinkError};

/// Bytes of a ping and its echo.
const PING_BYTES: usize = 64;
/// Bytes per write of the bulk sender.
const BULK_WRITE_BYTES: usize = 64 * 1024;
/// How long the helpers wait for a peer before giving up.
const PEER_TIMEOUT: Duration = Duration::from_secs(20);

/// What to measure.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MeasureOptions {
    /// Round trips for the idle delay.
    pub samples: usize,
    /// Pause between round trips, so that they do not queue behind each other.
    pub gap: Duration,
    /// Length of the bulk transfer; 0 skips it.
    pub bulk: Duration,
    /// Start of the bulk transfer not counted (slow start).
    pub warmup: Duration,
}

impl Default for MeasureOptions {
    fn default() -> Self {
        MeasureOptions {
            samples: 100,
            gap: Duration::from_millis(5),
            bulk: Duration::from_secs(5),
            warmup: Duration::from_secs(1),
        }
    }
}

/// Order statistics of a set of durations, in ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Summary {
    pub count: usize,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Summary {
    pub fn of(samples: &[Duration]) -> Summary {
        if samples.is_empty() {
            return Summary::default();
        }
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let rank = |q: f64| ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        Summary {
            count: ms.len(),
            mean_ms: ms.iter().sum::<f64>() / ms.len() as f64,
            min_ms: ms[0],
            p50_ms: rank(0.5),
            p99_ms: rank(0.99),
            max_ms: ms[ms.len() - 1],
        }
    }
}

/// A bulk transfer's outcome.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Transfer {
    /// Payload bytes the receiver got, all of them in order.
    pub bytes: u64,
    /// Payload rate over the measured window, Mbit/s.
    pub goodput_mbit: f64,
    /// IP bytes delivered by the link over the same window, Mbit/s (None: not known).
    pub wire_mbit: Option<f64>,
    /// The measured window, s.
    pub window_s: f64,
    /// Segments the sender's TCP retransmitted.
    pub retransmissions: u32,
}

/// Configured against observed.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub mode: &'static str,
    pub params: LinkParams,
    /// Half of each idle round trip.
    pub one_way: Summary,
    /// Half of each round trip while the bulk transfer runs the same way.
    pub one_way_loaded: Option<Summary>,
    pub transfer: Option<Transfer>,
    /// The kernel's congestion control on the measured connections.
    pub congestion_control: String,
    /// How late the emulator handed packets over, mean and maximum over the whole run, ms.
    pub emulator_late_ms_mean: f64,
    pub emulator_late_ms_max: f64,
    /// Packets lost to random and bursty loss, percent of those that reached the wire, A → B.
    pub loss_percent_observed: f64,
}

impl Report {
    fn new(one_way: Summary, congestion_control: String) -> Report {
        Report {
            mode: "",
            params: LinkParams::default(),
            one_way,
            one_way_loaded: None,
            transfer: None,
            congestion_control,
            emulator_late_ms_mean: 0.0,
            emulator_late_ms_max: 0.0,
            loss_percent_observed: 0.0,
        }
    }

    /// Fills in what the emulator's counters tell; `stats[0].a_to_b` is the measured direction.
    fn add_stats(&mut self, stats: &[LinkStats]) {
        let paths: Vec<&PathStats> = stats.iter().flat_map(|s| [&s.a_to_b, &s.b_to_a]).collect();
        let delivered: u64 = paths.iter().map(|p| p.packets_delivered).sum();
        let late_ns: u64 = paths.iter().map(|p| p.late_ns_total).sum();
        self.emulator_late_ms_mean = late_ns as f64 / delivered.max(1) as f64 / 1e6;
        self.emulator_late_ms_max = paths.iter().map(|p| p.late_ns_max).max().unwrap_or(0) as f64 / 1e6;
        let ab = &stats[0].a_to_b;
        let on_wire = ab.packets_in - ab.dropped_cut - ab.dropped_queue;
        self.loss_percent_observed = 100.0 * (ab.dropped_loss + ab.dropped_burst) as f64 / on_wire.max(1) as f64;
    }

    /// A header for [`Report::row`].
    pub fn header() -> String {
        format!(
            "{:<5} {:>6} {:>7} {:>7} {:>7} {:>7} {:>8} {:>6} {:>6} {:>6} {:>11} {:>7} {:>13}",
            "mode",
            "delay",
            "mean",
            "p50",
            "p99",
            "max",
            "load p50",
            "rate",
            "wire",
            "good",
            "loss cfg/obs",
            "retrans",
            "late mean/max"
        ) + &format!(
            "\n{:<5} {:>6} {:>7} {:>7} {:>7} {:>7} {:>8} {:>6} {:>6} {:>6} {:>11} {:>7} {:>13}",
            "", "ms", "ms", "ms", "ms", "ms", "ms", "Mb/s", "Mb/s", "Mb/s", "%", "", "ms"
        )
    }

    /// One line: configured delay, observed one-way delay (idle; median beside a bulk
    /// transfer), configured rate, observed wire rate and goodput, loss, the emulator's lateness.
    pub fn row(&self) -> String {
        let rate = self.params.rate_mbit.map_or("-".into(), |r| format!("{r:.1}"));
        let loaded = self.one_way_loaded.map_or("-".into(), |s| format!("{:.3}", s.p50_ms));
        let (wire, good, retrans) = match &self.transfer {
            Some(t) => (
                t.wire_mbit.map_or("-".into(), |w| format!("{w:.1}")),
                format!("{:.1}", t.goodput_mbit),
                t.retransmissions.to_string(),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let mut configured_loss = self.params.loss_percent;
        if let Some(b) = self.params.burst_loss {
            configured_loss += (100.0 - configured_loss) * b.mean_loss();
        }
        let loss = format!("{configured_loss:.2}/{:.2}", self.loss_percent_observed);
        let late = format!("{:.3}/{:.1}", self.emulator_late_ms_mean, self.emulator_late_ms_max);
        let o = &self.one_way;
        format!(
            "{:<5} {:>6.1} {:>7.3} {:>7.3} {:>7.3} {:>7.3} {:>8} {:>6} {:>6} {:>6} {:>11} {:>7} {:>13}",
            self.mode,
            self.params.delay_ms_one_way,
            o.mean_ms,
            o.p50_ms,
            o.p99_ms,
            o.max_ms,
            loaded,
            rate,
            wire,
            good,
            loss,
            retrans,
            late
        )
    }
}

/// Measures a namespace link from end A to end B.
pub fn measure_link(link: &Link, options: &MeasureOptions) -> Result<Report, LinkError> {
    let io = |what: &'static str| move |e: std::io::Error| LinkError::Io { what: what.into(), source: e };
    let b = link.end(Side::B).address;
    let server = link
        .run_in(Side::B, || TcpListener::bind(SocketAddr::from((b, 0))))?
        .map_err(io("binding the measuring server"))?;
    let address = server.local_addr().map_err(io("reading the server's address"))?;
    let connect = || {
        link.run_in(Side::A, || TcpStream::connect_timeout(&address, PEER_TIMEOUT))?
            .map_err(io("connecting through the link"))
    };
    let wire_bytes = || link.stats().a_to_b.bytes_delivered;
    let mut report = run(server, connect, &wire_bytes, options)?;
    report.mode = "netns";
    report.params = link.params();
    report.add_stats(&[link.stats()]);
    Ok(report)
}

/// Starts a proxy with `params` in front of a local server and measures it.
pub fn measure_proxy(params: LinkParams, options: &MeasureOptions) -> Result<Report, LinkError> {
    let io = |what: &'static str| move |e: std::io::Error| LinkError::Io { what: what.into(), source: e };
    let local: SocketAddr = "127.0.0.1:0".parse().expect("a valid address");
    let server = TcpListener::bind(local).map_err(io("binding the measuring server"))?;
    let proxy = Proxy::start(local, server.local_addr().map_err(io("reading the server's address"))?, params)?;
    let connect = || TcpStream::connect_timeout(&proxy.address(), PEER_TIMEOUT).map_err(io("connecting to the proxy"));
    // The proxy counts payload bytes: its "wire" rate is the goodput it paced.
    let wire_bytes = || proxy.stats().a_to_b.bytes_delivered;
    let mut report = run(server, connect, &wire_bytes, options)?;
    report.mode = "proxy";
    report.params = params;
    report.add_stats(&[proxy.stats()]);
    Ok(report)
}

/// The first byte of a measuring connection: what the server does with it.
const ROLE_ECHO: u8 = b'E';
const ROLE_SINK: u8 = b'S';

fn run(
    server: TcpListener,
    connect: impl Fn() -> Result<TcpStream, LinkError>,
    wire_bytes: &(dyn Fn() -> u64 + Sync),
    options: &MeasureOptions,
) -> Result<Report, LinkError> {
    let io = |what: &'static str| move |e: std::io::Error| LinkError::Io { what: what.into(), source: e };
    let open = |role: u8| -> Result<TcpStream, LinkError> {
        let mut stream = connect()?;
        stream.write_all(&[role]).map_err(io("starting a measuring connection"))?;
        Ok(stream)
    };
    // Idle round trips; with a bulk transfer, also the transfer and round trips beside it.
    let connections = if options.bulk.is_zero() { 1 } else { 3 };
    let (transfer_tx, transfer_rx) = mpsc::channel();
    let warmup = options.warmup;
    std::thread::scope(|scope| {
        scope.spawn(move || serve(&server, connections, warmup, wire_bytes, &transfer_tx));
        let mut ping = open(ROLE_ECHO)?;
        let congestion_control = sys::tcp_congestion(&ping).unwrap_or_else(|_| "?".into());
        let rtts = round_trips(&mut ping, options.samples, options.gap).map_err(io("measuring round trips"))?;
        let one_way = Summary::of(&rtts.iter().map(|d| *d / 2).collect::<Vec<_>>());
        drop(ping);
        let mut report = Report::new(one_way, congestion_control);
        if options.bulk.is_zero() {
            return Ok(report);
        }
        let sender = open(ROLE_SINK)?;
        let done = Arc::new(AtomicBool::new(false));
        let sender_done = done.clone();
        let bulk = options.bulk;
        let sending = scope.spawn(move || send_bulk(sender, bulk, &sender_done));
        // Round trips beside the transfer, after its slow start.
        std::thread::sleep(options.warmup);
        let mut ping = open(ROLE_ECHO)?;
        let mut loaded = Vec::new();
        while !done.load(Ordering::SeqCst) && loaded.len() < options.samples {
            let rtt = round_trips(&mut ping, 1, options.gap).map_err(io("measuring round trips under load"))?;
            loaded.extend(rtt.iter().map(|d| *d / 2));
        }
        drop(ping);
        let retransmissions =
            sending.join().expect("the sender does not panic").map_err(io("sending the bulk transfer"))?;
        let received = transfer_rx
            .recv_timeout(PEER_TIMEOUT)
            .map_err(|_| io("receiving the bulk transfer")(std::io::ErrorKind::TimedOut.into()))?;
        let mut transfer = received.map_err(io("receiving the bulk transfer"))?;
        transfer.retransmissions = retransmissions;
        report.one_way_loaded = Some(Summary::of(&loaded));
        report.transfer = Some(transfer);
        Ok(report)
    })
}

/// Accepts `connections` measuring connections and serves each by its first byte: echo it, or
/// receive a bulk transfer and send the outcome to `transfers`.
fn serve(
    listener: &TcpListener,
    connections: usize,
    warmup: Duration,
    wire_bytes: &(dyn Fn() -> u64 + Sync),
    transfers: &mpsc::Sender<std::io::Result<Transfer>>,
) {
    std::thread::scope(|scope| {
        for _ in 0..connections {
            let Ok(mut stream) = accept_within(listener, PEER_TIMEOUT) else {
                return;
            };
            scope.spawn(move || {
                let mut role = [0u8];
                if stream.set_read_timeout(Some(PEER_TIMEOUT)).and_then(|()| stream.read_exact(&mut role)).is_err() {
                    return;
                }
                match role[0] {
                    ROLE_ECHO => echo(stream),
                    ROLE_SINK => {
                        let _ = transfers.send(receive_bulk(stream, warmup, wire_bytes));
                    }
                    _ => {}
                }
            });
        }
    });
}

/// Echoes until the peer closes.
fn echo(mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = read_some(&mut stream, &mut buf) {
        if stream.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// One `read`, retried when a signal interrupts it (a socket with a timeout returns EINTR
/// instead of restarting, also for a stop and continue of the process).
pub fn read_some(stream: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            result => return result,
        }
    }
}

/// Accepts one connection, giving up after `timeout`.
pub fn accept_within(listener: &TcpListener, timeout: Duration) -> std::io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                return Ok(stream);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// `count` round trips of a small message to an echo server, `gap` apart.
pub fn round_trips(stream: &mut TcpStream, count: usize, gap: Duration) -> std::io::Result<Vec<Duration>> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(PEER_TIMEOUT))?;
    let mut rtts = Vec::with_capacity(count);
    let mut message = [0u8; PING_BYTES];
    let mut echo = [0u8; PING_BYTES];
    for i in 0..count {
        message.fill(i as u8);
        let start = Instant::now();
        stream.write_all(&message)?;
        stream.read_exact(&mut echo)?;
        rtts.push(start.elapsed());
        if echo != message {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the echo differs from the message"));
        }
        std::thread::sleep(gap);
    }
    Ok(rtts)
}

/// The byte at `offset` of a bulk transfer: the receiver checks every byte.
fn pattern(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// Writes the pattern for `duration`, closes, and returns the retransmission count.
fn send_bulk(mut stream: TcpStream, duration: Duration, done: &AtomicBool) -> std::io::Result<u32> {
    stream.set_write_timeout(Some(PEER_TIMEOUT))?;
    let mut buf = vec![0u8; BULK_WRITE_BYTES + 251];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(i as u64);
    }
    let deadline = Instant::now() + duration;
    let mut offset = 0u64;
    let result: std::io::Result<()> = (|| {
        while Instant::now() < deadline {
            let start = (offset % 251) as usize;
            stream.write_all(&buf[start..start + BULK_WRITE_BYTES])?;
            offset += BULK_WRITE_BYTES as u64;
        }
        stream.shutdown(Shutdown::Write)?;
        // Wait for the receiver to close, so that every retransmission is counted.
        let mut rest = [0u8; 16];
        let _ = read_some(&mut stream, &mut rest);
        Ok(())
    })();
    done.store(true, Ordering::SeqCst);
    result?;
    Ok(sys::tcp_info(&stream)?.total_retrans)
}

/// Receives until end of file, checking every byte, and measures the rate after `warmup`.
pub fn receive_bulk(
    mut stream: TcpStream,
    warmup: Duration,
    wire_bytes: &dyn Fn() -> u64,
) -> std::io::Result<Transfer> {
    stream.set_read_timeout(Some(PEER_TIMEOUT))?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    let mut first: Option<Instant> = None;
    let mut window_start: Option<(Instant, u64, u64)> = None;
    let mut last = (Instant::now(), 0u64, 0u64);
    loop {
        let n = read_some(&mut stream, &mut buf)?;
        let now = Instant::now();
        if n == 0 {
            break;
        }
        if let Some(i) = buf[..n].iter().enumerate().position(|(i, &b)| b != pattern(total + i as u64)) {
            let offset = total + i as u64;
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("byte {offset} differs from what was sent"),
            ));
        }
        total += n as u64;
        let first = *first.get_or_insert(now);
        if window_start.is_none() && now - first >= warmup {
            window_start = Some((now, total, wire_bytes()));
        }
        last = (now, total, wire_bytes());
    }
    stream.shutdown(Shutdown::Both)?;
    let Some((start, start_bytes, start_wire)) = window_start else {
        return Ok(Transfer { bytes: total, ..Transfer::default() });
    };
    let window_s = (last.0 - start).as_secs_f64();
    let mbit = |bytes: u64| {
        if window_s > 0.0 {
            bytes as f64 * 8.0 / window_s / 1e6
        } else {
            0.0
        }
    };
    Ok(Transfer {
        bytes: total,
        goodput_mbit: mbit(last.1 - start_bytes),
        wire_mbit: Some(mbit(last.2 - start_wire)),
        window_s,
        retransmissions: 0,
    })
}

/// Segments the connection's TCP has retransmitted so far.
pub fn retransmissions(stream: &TcpStream) -> std::io::Result<u32> {
    Ok(sys::tcp_info(stream)?.total_retrans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_ranks() {
        let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
        let s = Summary::of(&ms(&[5, 1, 3, 2, 4]));
        assert_eq!((s.count, s.min_ms, s.p50_ms, s.p99_ms, s.max_ms, s.mean_ms), (5, 1.0, 3.0, 5.0, 5.0, 3.0));
        let s = Summary::of(&ms(&(1..=100).collect::<Vec<_>>()));
        assert_eq!((s.p50_ms, s.p99_ms), (50.0, 99.0));
    }
}
