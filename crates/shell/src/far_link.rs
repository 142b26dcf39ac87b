//! The far link over UDP: the sans-IO `fec::Link` sessions carried out on a socket. A
//! [`FecStream`] is a reliable ordered byte stream (AsyncRead + AsyncWrite) like a TCP one,
//! so TLS and the element protocol run over it unchanged; what TCP cannot say, it does: how
//! much of the stream is *protected on the wire* (every data and repair packet of its groups
//! has left the socket), for the network-sync acknowledgement.
//!
//! One driver task per socket: a client's (one session, [`connect`]) or an element's
//! ([`FarListener`], sessions keyed by peer address and session id). The task feeds arrivals
//! and the time to the links, sends what they release (paced), and wakes the streams.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fec::{Datagram, GaloisCode, Link, LinkConfig, LinkState};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch, Notify};

/// Sessions an element serves over its far-link port at most.
const SESSIONS_MAX: usize = 64;
/// Socket buffers asked of the kernel (it may give less).
const SOCKET_BUFFER_BYTES: libc::c_int = 8 << 20;
/// Largest datagram read.
const DATAGRAM_BYTES_MAX: usize = 65_536;
/// A refused datagram is logged at most this often per socket.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

/// What the host element asks of one far link (from `--element NAME=ADDR,fec=R:C,rate=…`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FarLinkOptions {
    pub r: u8,
    pub c: u8,
    /// Pacing rate, bytes/s (0: unpaced).
    pub rate_bytes_per_s: u64,
}

impl FarLinkOptions {
    pub fn link_config(&self) -> LinkConfig {
        LinkConfig { r: self.r, c: self.c, rate_bytes_per_s: self.rate_bytes_per_s, ..LinkConfig::default() }
    }
}

struct SessionState {
    link: Link<GaloisCode>,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    /// Datagrams the link released that the socket could not take yet (its buffer was full),
    /// in order; the driver sends them when it can.
    backlog: std::collections::VecDeque<Bytes>,
    /// Since when sending has failed with an error other than a full buffer (µs), and why:
    /// the datagram has not left, so it stays in the backlog and is tried again.
    send_failing: Option<(u64, String)>,
}

impl SessionState {
    fn new(link: Link<GaloisCode>) -> SessionState {
        SessionState { link, read_waker: None, write_waker: None, backlog: Default::default(), send_failing: None }
    }
}

/// A send that keeps failing (no route, a firewall's refusal) closes the session after this.
const SEND_FAILING_CLOSE_US: u64 = 2_000_000;
/// While sending fails, it is tried again this often.
const SEND_RETRY: Duration = Duration::from_millis(20);

struct Shared {
    state: Mutex<SessionState>,
    socket: Arc<UdpSocket>,
    origin: Instant,
    /// Wakes the socket's driver (something to send).
    driver: Arc<Notify>,
    /// Stream bytes protected on the wire, and whether the session is closed, as last seen by
    /// the driver.
    protected: watch::Sender<(u64, bool)>,
    peer: SocketAddr,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64 + 1
    }

    /// Send what the link releases now, without waiting (the socket is non-blocking), and
    /// publish how much of the stream is protected: only what has really left the socket
    /// counts. Called with the session locked, so sends keep the link's order. Returns whether
    /// datagrams wait in the backlog (the driver then waits for the socket to take more).
    fn transmit(&self, s: &mut SessionState, now: u64) -> bool {
        while let Some(d) = s.link.poll_transmit(now) {
            s.backlog.push_back(d);
        }
        while let Some(d) = s.backlog.front() {
            match self.socket.try_send_to(d, self.peer) {
                Ok(_) => {
                    s.backlog.pop_front();
                    s.send_failing = None;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // Not sent (so not protected): tried again, and the session ends if it lasts.
                Err(e) => {
                    let since = s.send_failing.get_or_insert_with(|| (now, e.to_string())).0;
                    if now >= since + SEND_FAILING_CLOSE_US {
                        s.link.close(&format!("sending to {} fails: {e}", self.peer));
                        s.backlog.clear();
                    }
                    break;
                }
            }
        }
        let protected = if s.backlog.is_empty() { s.link.protected() } else { self.protected.borrow().0 };
        let now_seen = (protected, matches!(s.link.state(), LinkState::Closed(_)));
        self.protected.send_if_modified(|seen| {
            let changed = *seen != now_seen;
            *seen = now_seen;
            changed
        });
        !s.backlog.is_empty()
    }
}

/// One session's byte stream. Dropping it closes the session (the peer hears why).
pub struct FecStream {
    shared: Arc<Shared>,
}

/// How far a stream's bytes have gone: written into it, protected on the wire.
#[derive(Clone)]
pub struct FarProgress {
    shared: Arc<Shared>,
}

impl FarProgress {
    /// Stream bytes written so far (below any TLS layer: ciphertext).
    pub fn written(&self) -> u64 {
        self.shared.lock().link.written()
    }

    /// Stream bytes protected on the wire now.
    pub fn protected_now(&self) -> u64 {
        self.shared.protected.borrow().0
    }

    /// Wait until the first `offset` bytes of the stream are protected on the wire; false if
    /// the session closed first.
    pub async fn protected(&self, offset: u64) -> bool {
        let mut rx = self.shared.protected.subscribe();
        let reached = match rx.wait_for(|&(p, closed)| p >= offset || closed).await {
            Ok(seen) => seen.0 >= offset,
            Err(_) => false,
        };
        reached
    }
}

impl FecStream {
    pub fn peer(&self) -> SocketAddr {
        self.shared.peer
    }

    pub fn progress(&self) -> FarProgress {
        FarProgress { shared: self.shared.clone() }
    }
}

impl Drop for FecStream {
    fn drop(&mut self) {
        self.shared.lock().link.close("the stream was closed");
        self.shared.driver.notify_one();
    }
}

fn closed_error(state: &LinkState) -> io::Error {
    let why = match state {
        LinkState::Closed(why) => why.clone(),
        _ => "not open".into(),
    };
    io::Error::new(io::ErrorKind::ConnectionReset, format!("far link: {why}"))
}

impl AsyncRead for FecStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut s = self.shared.lock();
        if s.link.readable() > 0 {
            let bytes = s.link.read(buf.remaining());
            buf.put_slice(&bytes);
            drop(s);
            // Room in the receive buffer may let the driver take more.
            self.shared.driver.notify_one();
            return Poll::Ready(Ok(()));
        }
        if let LinkState::Closed(why) = s.link.state() {
            if why.starts_with("closed by the peer") {
                return Poll::Ready(Ok(())); // end of stream
            }
            return Poll::Ready(Err(closed_error(s.link.state())));
        }
        s.read_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl AsyncWrite for FecStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let mut s = self.shared.lock();
        if let LinkState::Closed(_) = s.link.state() {
            return Poll::Ready(Err(closed_error(s.link.state())));
        }
        let n = s.link.write(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        if n == 0 {
            s.write_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        if self.shared.transmit(&mut s, self.shared.now_us()) {
            drop(s);
            self.shared.driver.notify_one();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.shared.lock();
        if let LinkState::Closed(_) = s.link.state() {
            return Poll::Ready(Err(closed_error(s.link.state())));
        }
        s.link.flush().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        // Sent from this task at once: the network-sync acknowledgement waits for it. What
        // the pacer holds back, the driver sends when due.
        self.shared.transmit(&mut s, self.shared.now_us());
        drop(s);
        self.shared.driver.notify_one();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = self.as_mut().poll_flush(cx);
        self.shared.lock().link.close("shut down");
        self.shared.driver.notify_one();
        flushed
    }
}

fn enlarge_buffers(socket: &UdpSocket) {
    use std::os::fd::AsRawFd;
    for option in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        let value = SOCKET_BUFFER_BYTES;
        // SAFETY: a valid socket descriptor and a c_int option value of the right size.
        unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                &value as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// The sessions this process opened (a host element's), so that it can let them drain before
/// it exits: unlike a TCP socket's buffer, what a far-link session has not delivered dies with
/// the process.
static OPENED: Mutex<Vec<std::sync::Weak<Shared>>> = Mutex::new(Vec::new());

/// Wait until every far-link session this process opened has had everything written to it
/// acknowledged by the peer (or was closed), at most `timeout`. Returns how many had not.
pub async fn drain(timeout: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let pending = {
            let mut opened = OPENED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            opened.retain(|weak| weak.strong_count() > 0);
            opened
                .iter()
                .filter_map(|weak| weak.upgrade())
                .filter(|shared| {
                    let mut s = shared.lock();
                    if matches!(s.link.state(), LinkState::Closed(_)) {
                        return false;
                    }
                    let _ = s.link.flush();
                    shared.transmit(&mut s, shared.now_us());
                    shared.driver.notify_one();
                    !(s.link.drained() && s.backlog.is_empty())
                })
                .count()
        };
        if pending == 0 || tokio::time::Instant::now() >= deadline {
            return pending;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn random_session() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.finish().max(1)
}

/// Open a far-link session to `address` (an element's far-link port: its address, over UDP).
pub async fn connect(address: SocketAddr, options: FarLinkOptions, timeout: Duration) -> Result<FecStream, String> {
    let config = options.link_config();
    config.check()?;
    let local: SocketAddr = if address.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("an address");
    let socket = UdpSocket::bind(local).await.map_err(|e| format!("far link to {address}: cannot bind UDP: {e}"))?;
    enlarge_buffers(&socket);
    let socket = Arc::new(socket);
    let origin = Instant::now();
    let link = Link::client(config, random_session(), GaloisCode::default(), GaloisCode::default(), 1);
    let driver = Arc::new(Notify::new());
    let shared = Arc::new(Shared {
        state: Mutex::new(SessionState::new(link)),
        socket: socket.clone(),
        origin,
        driver: driver.clone(),
        protected: watch::channel((0, false)).0,
        peer: address,
    });
    let mut sessions = HashMap::new();
    sessions.insert((address, shared.lock().link.session()), shared.clone());
    let endpoint = Endpoint { socket, origin, driver, sessions, accept: None, limits: config };
    tokio::spawn(endpoint.run());
    {
        // A host element redials an absent far element every few seconds: forget ended ones.
        let mut opened = OPENED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        opened.retain(|weak| weak.strong_count() > 0);
        opened.push(Arc::downgrade(&shared));
    }
    let stream = FecStream { shared };
    let opened = async {
        loop {
            match stream.shared.lock().link.state() {
                LinkState::Open => return Ok(()),
                LinkState::Closed(why) => return Err(format!("far link to {address}: {why}")),
                LinkState::Opening => {}
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    match tokio::time::timeout(timeout, opened).await {
        Ok(Ok(())) => Ok(stream),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("far link to {address}: no answer over UDP within {timeout:?}")),
    }
}

/// An element's far-link port: sessions opened by host elements over UDP.
pub struct FarListener {
    accepted: mpsc::Receiver<FecStream>,
    local: SocketAddr,
}

impl FarListener {
    pub async fn bind(address: SocketAddr) -> io::Result<FarListener> {
        let socket = UdpSocket::bind(address).await?;
        enlarge_buffers(&socket);
        let local = socket.local_addr()?;
        let socket = Arc::new(socket);
        let (tx, accepted) = mpsc::channel(8);
        let endpoint = Endpoint {
            socket,
            origin: Instant::now(),
            driver: Arc::new(Notify::new()),
            sessions: HashMap::new(),
            accept: Some(tx),
            limits: LinkConfig::default(),
        };
        tokio::spawn(endpoint.run());
        Ok(FarListener { accepted, local })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next session a host element opened.
    pub async fn accept(&mut self) -> io::Result<(FecStream, SocketAddr)> {
        match self.accepted.recv().await {
            Some(stream) => {
                let peer = stream.peer();
                Ok((stream, peer))
            }
            None => Err(io::Error::other("the far-link socket's driver ended")),
        }
    }
}

struct Endpoint {
    socket: Arc<UdpSocket>,
    origin: Instant,
    driver: Arc<Notify>,
    /// Held here until a session is closed and its last datagram (the `Close`) has left.
    sessions: HashMap<(SocketAddr, u64), Arc<Shared>>,
    /// An element's: where new sessions go.
    accept: Option<mpsc::Sender<FecStream>>,
    limits: LinkConfig,
}

impl Endpoint {
    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64 + 1
    }

    async fn run(mut self) {
        let mut buf = vec![0u8; DATAGRAM_BYTES_MAX];
        let mut refused_logged: Option<Instant> = None;
        let mut refused = 0u64;
        loop {
            let (backlog, failing) = self.pump();
            // A client's socket ends with its one session; an element's when its listener goes.
            if self.accept.as_ref().map_or(self.sessions.is_empty(), |tx| tx.is_closed()) {
                return;
            }
            let mut deadline = self.sessions.values().filter_map(|s| s.lock().link.poll_timeout()).min();
            if failing {
                let retry = self.now_us() + SEND_RETRY.as_micros() as u64;
                deadline = Some(deadline.map_or(retry, |d| d.min(retry)));
            }
            let sleep = async {
                match deadline {
                    Some(t) => {
                        tokio::time::sleep_until((self.origin + Duration::from_micros(t.saturating_sub(1))).into())
                            .await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                received = self.socket.recv_from(&mut buf) => {
                    let (n, from) = match received {
                        Ok(r) => r,
                        // ICMP port unreachable and the like: the peer is not there (yet).
                        Err(_) => continue,
                    };
                    if let Err(why) = self.arrive(&buf[..n], from) {
                        refused += 1;
                        if refused_logged.is_none_or(|at| at.elapsed() >= REFUSED_LOG_EVERY) {
                            tracing::warn!(%from, refused, "far link: datagram refused: {why}");
                            refused_logged = Some(Instant::now());
                        }
                    }
                }
                _ = self.driver.notified() => {}
                _ = sleep => {}
                _ = self.socket.writable(), if backlog && !failing => {}
            }
        }
    }

    /// One datagram from `from`.
    fn arrive(&mut self, datagram: &[u8], from: SocketAddr) -> Result<(), String> {
        let d = Datagram::parse(datagram).map_err(|e| e.to_string())?;
        let key = (from, d.session);
        let now = self.now_us();
        if let Some(shared) = self.sessions.get(&key) {
            let mut s = shared.lock();
            let result = s.link.receive(d, now).map_err(|e| e.to_string());
            wake(&mut s);
            return result;
        }
        let Some(accept) = &self.accept else { return Err("datagram of no session of ours".into()) };
        if !d.is_open() {
            return Err("datagram of an unknown session (the session ended, or a stranger)".into());
        }
        if self.sessions.len() >= SESSIONS_MAX {
            return Err(format!("session limit ({SESSIONS_MAX}) reached"));
        }
        let link = Link::server(&d, self.limits, GaloisCode::default(), GaloisCode::default(), now)
            .map_err(|e| format!("Open refused: {e}"))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(SessionState::new(link)),
            socket: self.socket.clone(),
            origin: self.origin,
            driver: self.driver.clone(),
            protected: watch::channel((0, false)).0,
            peer: from,
        });
        let stream = FecStream { shared: shared.clone() };
        if let Err(refused) = accept.try_send(stream) {
            // Dropping it closes the session; it is not kept.
            drop(refused);
            self.sessions.remove(&key);
            return Err("too many sessions waiting to be accepted".into());
        }
        self.sessions.insert(key, shared);
        Ok(())
    }

    /// Timers, then everything the links release now; forget sessions that are over. Returns
    /// whether some session's datagrams wait for room in the socket, and whether some
    /// session's sends fail (tried again after a pause).
    fn pump(&mut self) -> (bool, bool) {
        let now = self.now_us();
        let mut gone = Vec::new();
        let mut backlog = false;
        let mut failing = false;
        for (&key, shared) in &self.sessions {
            let mut s = shared.lock();
            if s.link.poll_timeout().is_some_and(|t| t <= now) {
                if let Err(e) = s.link.handle_timeout(now) {
                    s.link.close(&e.to_string());
                }
            }
            backlog |= shared.transmit(&mut s, now);
            failing |= s.send_failing.is_some();
            wake(&mut s);
            if matches!(s.link.state(), LinkState::Closed(_)) && s.link.poll_timeout().is_none() && s.backlog.is_empty()
            {
                gone.push(key);
            }
        }
        for key in gone {
            // The stream may still be held: it sees the closed state.
            self.sessions.remove(&key);
        }
        (backlog, failing)
    }
}

fn wake(s: &mut SessionState) {
    if s.link.readable() > 0 || matches!(s.link.state(), LinkState::Closed(_)) {
        if let Some(w) = s.read_waker.take() {
            w.wake();
        }
    }
    if s.link.window_room() > 0 || matches!(s.link.state(), LinkState::Closed(_)) {
        if let Some(w) = s.write_waker.take() {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const OPTIONS: FarLinkOptions = FarLinkOptions { r: 8, c: 3, rate_bytes_per_s: 0 };

    #[tokio::test]
    async fn a_session_carries_bytes_both_ways_and_tells_what_is_protected() {
        let mut listener = FarListener::bind("127.0.0.1:0".parse().expect("an address")).await.expect("bind");
        let address = listener.local_addr();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("a session");
            let mut buf = vec![0u8; 300_000];
            stream.read_exact(&mut buf).await.expect("read");
            stream.write_all(&buf[..1000]).await.expect("write");
            stream.flush().await.expect("flush");
            // Hold the session until the client has read.
            let mut end = [0u8; 1];
            let _ = stream.read(&mut end).await;
            buf
        });
        let mut client = connect(address, OPTIONS, Duration::from_secs(5)).await.expect("connect");
        let progress = client.progress();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        client.write_all(&data).await.expect("write");
        client.flush().await.expect("flush");
        assert_eq!(progress.written(), data.len() as u64);
        assert!(progress.protected(data.len() as u64).await, "every group's repair packets left");
        assert_eq!(drain(Duration::from_secs(5)).await, 0, "the peer acknowledged everything");
        let mut back = vec![0u8; 1000];
        client.read_exact(&mut back).await.expect("read back");
        assert_eq!(back, data[..1000]);
        drop(client);
        assert_eq!(server.await.expect("server"), data);
    }

    #[tokio::test]
    async fn nobody_answering_and_sends_that_fail_are_clear_errors() {
        // A UDP port where nothing listens: no answer to the Open.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let address = silent.local_addr().expect("address");
        drop(silent);
        let error = connect(address, OPTIONS, Duration::from_millis(700)).await.err().expect("no session");
        assert!(error.contains("no answer over UDP"), "{error}");
        // The broadcast address without SO_BROADCAST: every send is refused by the kernel.
        let broadcast: SocketAddr = "255.255.255.255:9".parse().expect("an address");
        let error = connect(broadcast, OPTIONS, Duration::from_secs(10)).await.err().expect("no session");
        assert!(error.contains("fails"), "{error}");
    }
}
