//! The unprivileged mode: a TCP proxy (normally on 127.0.0.1) that holds every byte for the
//! one-way delay in each direction and paces each direction to the rate, with cut and heal. It
//! needs no root and no tools, but it terminates TCP: the peers' connections run over loopback
//! and see the delay and the rate, never a lost segment, and their congestion control never
//! acts on the emulated path. Loss therefore needs the namespace mode ([`crate::Link`]).
//!
//! It generalises `shell::link::start_delay_proxy` (delay only): the rate is shared by all
//! connections through the proxy, as a link's is; a cut holds the bytes until the heal, as
//! TCP's retransmissions would deliver them, and connections survive it.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::limits::{
    CONNECT_TIMEOUT_MS, PROXY_CHUNK_BYTES_MAX, PROXY_CHUNK_BYTES_MIN, PROXY_IN_FLIGHT_BYTES_MAX, PROXY_PACING_NS_MAX,
    STOP_POLL_MS,
};
use crate::link::LinkStats;
use crate::params::LinkParams;
use crate::relay::{self, lock, SharedModel};
use crate::sys::{self, StopEvent, Wait};
use crate::LinkError;

/// A running proxy; dropping it closes the listener and every connection through it.
#[derive(Debug)]
pub struct Proxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    /// [0]: client → target, [1]: target → client.
    models: [SharedModel; 2],
    cut: Mutex<bool>,
    healed: Condvar,
    stop: StopEvent,
    epoch: Instant,
    connections: Mutex<Vec<Connection>>,
}

#[derive(Debug)]
struct Connection {
    sockets: [TcpStream; 2],
    threads: Vec<JoinHandle<()>>,
}

impl Proxy {
    /// Listens on `listen` and forwards every connection to `target` through the emulated path.
    pub fn start(listen: SocketAddr, target: SocketAddr, params: LinkParams) -> Result<Proxy, LinkError> {
        params.validate_for_proxy()?;
        let listener =
            TcpListener::bind(listen).map_err(|e| LinkError::Io { what: format!("binding {listen}"), source: e })?;
        let address =
            listener.local_addr().map_err(|e| LinkError::Io { what: "reading the bound address".into(), source: e })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| LinkError::Io { what: "configuring the listener".into(), source: e })?;
        let shared = Arc::new(Shared {
            models: relay::models(params),
            cut: Mutex::new(false),
            healed: Condvar::new(),
            stop: StopEvent::new().map_err(|e| LinkError::Io { what: "creating an eventfd".into(), source: e })?,
            epoch: Instant::now(),
            connections: Mutex::new(Vec::new()),
        });
        let accept_shared = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name(format!("sfn-proxy-{address}"))
            .spawn(move || accept_connections(&listener, target, &accept_shared))
            .map_err(|e| LinkError::Io { what: "starting the proxy thread".into(), source: e })?;
        tracing::info!(%address, %target, %params, "link proxy up");
        Ok(Proxy { address, shared, accept_thread: Some(accept_thread) })
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    pub fn set(&self, params: LinkParams) -> Result<(), LinkError> {
        params.validate_for_proxy()?;
        for model in &self.shared.models {
            lock(model).set_params(params);
        }
        Ok(())
    }

    pub fn params(&self) -> LinkParams {
        lock(&self.shared.models[0]).params()
    }

    /// Stops delivering bytes in both directions until [`Proxy::heal`]; they are held, not lost.
    pub fn cut(&self) {
        *self.shared.cut.lock().expect("no panics while holding the cut flag") = true;
    }

    pub fn heal(&self) {
        *self.shared.cut.lock().expect("no panics while holding the cut flag") = false;
        self.shared.healed.notify_all();
    }

    pub fn is_cut(&self) -> bool {
        *self.shared.cut.lock().expect("no panics while holding the cut flag")
    }

    /// Counters; a "packet" here is one chunk of the byte stream. `a_to_b` is client → target.
    pub fn stats(&self) -> LinkStats {
        LinkStats { a_to_b: lock(&self.shared.models[0]).stats(), b_to_a: lock(&self.shared.models[1]).stats() }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.stop();
        self.shared.healed.notify_all();
        if let Some(thread) = self.accept_thread.take() {
            let _ = thread.join();
        }
        let connections =
            std::mem::take(&mut *self.shared.connections.lock().expect("no panics while holding the list"));
        for connection in &connections {
            for socket in &connection.sockets {
                let _ = socket.shutdown(Shutdown::Both);
            }
        }
        for connection in connections {
            for thread in connection.threads {
                let _ = thread.join();
            }
        }
        tracing::info!(address = %self.address, "link proxy down");
    }
}

fn accept_connections(listener: &TcpListener, target: SocketAddr, shared: &Arc<Shared>) {
    loop {
        match listener.accept() {
            Ok((inbound, _)) => {
                if let Err(e) = open_connection(inbound, target, shared) {
                    tracing::warn!(%target, error = %e, "link proxy: could not forward a connection");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match sys::wait_readable(listener.as_raw_fd(), &shared.stop, -1) {
                    Ok(Wait::Readable | Wait::TimedOut) => {}
                    Ok(Wait::Stopped) => return,
                    Err(e) => {
                        tracing::error!(error = %e, "link proxy: poll failed");
                        return;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors and the like: wait a little rather than spin.
                tracing::warn!(error = %e, "link proxy: accept failed");
                std::thread::sleep(Duration::from_millis(STOP_POLL_MS));
            }
        }
    }
}

fn open_connection(inbound: TcpStream, target: SocketAddr, shared: &Arc<Shared>) -> std::io::Result<()> {
    inbound.set_nonblocking(false)?;
    let outbound = TcpStream::connect_timeout(&target, Duration::from_millis(CONNECT_TIMEOUT_MS))?;
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    let mut threads = Vec::new();
    for (from, to, model) in [(&inbound, &outbound, &shared.models[0]), (&outbound, &inbound, &shared.models[1])] {
        let (tx, rx) = mpsc::channel::<Chunk>();
        let budget = Arc::new(Budget::new(PROXY_IN_FLIGHT_BYTES_MAX));
        let from_clone = from.try_clone()?;
        let (from, reader_model, reader_shared, reader_budget) =
            (from.try_clone()?, model.clone(), shared.clone(), budget.clone());
        threads.push(std::thread::Builder::new().name("sfn-proxy-read".into()).spawn(move || {
            read_stream(from, &reader_model, &tx, &reader_shared, &reader_budget);
        })?);
        let (to, writer_from, writer_model, writer_shared) =
            (to.try_clone()?, from_clone, model.clone(), shared.clone());
        threads.push(std::thread::Builder::new().name("sfn-proxy-write".into()).spawn(move || {
            write_stream(to, &writer_from, &writer_model, &rx, &writer_shared, &budget);
        })?);
    }
    let mut connections = shared.connections.lock().expect("no panics while holding the list");
    connections.retain(|c| !c.threads.iter().all(JoinHandle::is_finished));
    connections.push(Connection { sockets: [inbound, outbound], threads });
    Ok(())
}

enum Chunk {
    /// Bytes due at `at_ns` after the proxy's epoch.
    Data { at_ns: u64, bytes: Vec<u8> },
    /// The sender closed its side (after all data).
    End,
    /// The connection failed; reset both sides.
    Abort,
}

/// Bytes in flight in one direction of one connection: bounds the proxy's memory and passes
/// backpressure on to the sender's socket.
#[derive(Debug)]
struct Budget {
    /// (bytes in flight, whether the writer has gone)
    used: Mutex<(usize, bool)>,
    freed: Condvar,
    max: usize,
}

impl Budget {
    fn new(max: usize) -> Budget {
        Budget { used: Mutex::new((0, false)), freed: Condvar::new(), max }
    }

    /// Waits until `n` more bytes fit; false if the proxy stopped or the writer has gone.
    fn acquire(&self, n: usize, stop: &StopEvent) -> bool {
        let mut used = self.used.lock().expect("no panics while holding the budget");
        loop {
            if stop.is_stopped() || used.1 {
                return false;
            }
            if used.0 == 0 || used.0 + n <= self.max {
                used.0 += n;
                return true;
            }
            used = self
                .freed
                .wait_timeout(used, Duration::from_millis(STOP_POLL_MS))
                .expect("no panics while holding the budget")
                .0;
        }
    }

    fn release(&self, n: usize) {
        self.used.lock().expect("no panics while holding the budget").0 -= n;
        self.freed.notify_all();
    }

    fn close(&self) {
        self.used.lock().expect("no panics while holding the budget").1 = true;
        self.freed.notify_all();
    }
}

fn read_stream(mut from: TcpStream, model: &SharedModel, tx: &mpsc::Sender<Chunk>, shared: &Shared, budget: &Budget) {
    let mut buf = vec![0u8; PROXY_CHUNK_BYTES_MAX];
    loop {
        // Read no further ahead of the serialiser than the pacing bound: the sender then sees
        // the rate as a full socket buffer, as behind a real bottleneck.
        let (chunk_bytes, backlog_ns) = {
            let model = lock(model);
            let now_ns = (Instant::now() - shared.epoch).as_nanos() as u64;
            (chunk_bytes_for(&model.params()), model.backlog_ns(now_ns))
        };
        if backlog_ns > PROXY_PACING_NS_MAX {
            sys::sleep_until(Instant::now() + Duration::from_nanos(backlog_ns - PROXY_PACING_NS_MAX));
            continue;
        }
        let chunk = match from.read(&mut buf[..chunk_bytes]) {
            Ok(0) => Chunk::End,
            Ok(n) => {
                if !budget.acquire(n, &shared.stop) {
                    return;
                }
                let now_ns = (Instant::now() - shared.epoch).as_nanos() as u64;
                let at_ns = lock(model).handle_bytes(now_ns, n as u64);
                Chunk::Data { at_ns, bytes: buf[..n].to_vec() }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => Chunk::Abort,
        };
        let last = !matches!(chunk, Chunk::Data { .. });
        if tx.send(chunk).is_err() || last {
            return;
        }
    }
}

/// Chunks short enough that one takes at most about a millisecond at the rate, so that pacing
/// is smooth and a small message is not stuck behind a long chunk.
fn chunk_bytes_for(params: &LinkParams) -> usize {
    match params.rate_mbit {
        // Mbit/s × 1 ms = 125 bytes per Mbit/s.
        Some(rate) => ((rate * 125.0) as usize).clamp(PROXY_CHUNK_BYTES_MIN, PROXY_CHUNK_BYTES_MAX),
        None => PROXY_CHUNK_BYTES_MAX,
    }
}

fn write_stream(
    mut to: TcpStream,
    from: &TcpStream,
    model: &SharedModel,
    rx: &mpsc::Receiver<Chunk>,
    shared: &Shared,
    budget: &Budget,
) {
    sys::set_timer_slack_ns(1);
    let stop_poll = Duration::from_millis(STOP_POLL_MS);
    let mut abandoned = 0u64;
    let outcome = loop {
        let chunk = match rx.recv_timeout(stop_poll) {
            Ok(chunk) => chunk,
            Err(mpsc::RecvTimeoutError::Timeout) if !shared.stop.is_stopped() => continue,
            Err(_) => break Chunk::Abort,
        };
        let Chunk::Data { at_ns, bytes } = chunk else {
            break chunk;
        };
        abandoned += 1;
        if !wait_until_due(shared.epoch + Duration::from_nanos(at_ns), shared) {
            break Chunk::Abort;
        }
        let now_ns = (Instant::now() - shared.epoch).as_nanos() as u64;
        lock(model).handle_due(now_ns, at_ns, bytes.len() as u64);
        abandoned -= 1;
        let written = to.write_all(&bytes);
        budget.release(bytes.len());
        if written.is_err() {
            break Chunk::Abort;
        }
    };
    budget.close();
    let abandoned = abandoned + rx.try_iter().filter(|c| matches!(c, Chunk::Data { .. })).count() as u64;
    lock(model).handle_abandoned(abandoned);
    match outcome {
        Chunk::End => {
            let _ = to.shutdown(Shutdown::Write);
        }
        _ => {
            // A failed connection fails both ways, also unblocking this direction's reader.
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        }
    }
}

/// Sleeps until `due` and then while the link is cut; false if the proxy stops meanwhile.
fn wait_until_due(due: Instant, shared: &Shared) -> bool {
    let stop_poll = Duration::from_millis(STOP_POLL_MS);
    loop {
        if shared.stop.is_stopped() {
            return false;
        }
        let now = Instant::now();
        if now >= due {
            break;
        }
        sys::sleep_until(now + (due - now).min(stop_poll));
    }
    let mut cut = shared.cut.lock().expect("no panics while holding the cut flag");
    while *cut {
        if shared.stop.is_stopped() {
            return false;
        }
        cut = shared.healed.wait_timeout(cut, stop_poll).expect("no panics while holding the cut flag").0;
    }
    true
}
