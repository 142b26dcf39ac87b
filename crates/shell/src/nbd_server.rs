//! The NBD server: the tokio driver of the sans-IO `nbd` codec. Every accepted connection is
//! its own task; within a connection, requests run concurrently up to a bound and replies go out
//! in completion order. A misbehaving client only ever ends its own connection.
//!
//! Backpressure: the connection stops reading its socket while `in_flight_requests_max`
//! requests (or `in_flight_bytes_max` bytes of read and write data) are in flight, so a slow
//! backend slows the client down instead of growing queues here.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use nbd::{
    Command, Decoded, Exports, Handshake, HandshakeConfig, HandshakeOutcome, Request, Transmission,
    BLOCK_SIZE_MAX_BYTES, HANDSHAKE_INPUT_BYTES_MAX, REQUEST_HEADER_BYTES,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Mutex, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use crate::tls::{PeerCertificate, Role, Stream, TlsContext};

pub use nbd::{Errno, ExportInfo, Extent};

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the NBD server serves. Offsets and lengths it passes are already validated against the
/// export's size (as of the handshake) and aligned to 512 bytes (a range may end at an unaligned
/// export end); lengths are never zero; reads and writes are at most 32 MiB. Calls run
/// concurrently, also for one connection.
pub trait Backend: Send + Sync + 'static {
    /// The exports offered, asked afresh during every handshake.
    fn exports(&self) -> Vec<ExportInfo>;

    /// Must return exactly `length_bytes` bytes.
    fn read(&self, export: &str, offset_bytes: u64, length_bytes: u32) -> BoxFuture<Result<Bytes, Errno>>;

    /// `fua`: reply only once the data is durable. A read-only volume answers `Errno::Perm`.
    fn write(&self, export: &str, offset_bytes: u64, data: Bytes, fua: bool) -> BoxFuture<Result<(), Errno>>;

    /// The range must read back as zeroes and stay writable without `ENOSPC` afterwards (the
    /// client's `NBD_CMD_FLAG_NO_HOLE` is not passed on, so this must always hold).
    fn write_zeroes(
        &self,
        export: &str,
        offset_bytes: u64,
        length_bytes: u64,
        fua: bool,
    ) -> BoxFuture<Result<(), Errno>>;

    /// A hint that the range is no longer needed; its contents are undefined afterwards.
    fn trim(&self, export: &str, offset_bytes: u64, length_bytes: u64, fua: bool) -> BoxFuture<Result<(), Errno>>;

    /// Every write completed before this call (on any connection, if `multi_conn`) is durable
    /// when it returns `Ok`.
    fn flush(&self, export: &str) -> BoxFuture<Result<(), Errno>>;

    /// Consecutive extents from `offset_bytes`. They may cover less or more than asked, be
    /// unaligned or many: the server trims, aligns and bounds what it sends.
    fn block_status(&self, export: &str, offset_bytes: u64, length_bytes: u64)
        -> BoxFuture<Result<Vec<Extent>, Errno>>;

    /// A connection asks to enter the transmission phase on `export`: `Err(reason)` refuses it
    /// (the client hears the reason), `Ok` counts it, and `closed` follows once it ends. What
    /// `starfish volume delete` and a shrink ask to know whether a volume is in use, and how
    /// they keep new clients out while they run.
    fn opened(&self, _export: &str) -> Result<(), String> {
        Ok(())
    }
    fn closed(&self, _export: &str) {}

    /// Why a client that asks for `export`, which is not served, is refused, if more is known
    /// than that there is no such export (it is being deleted, say).
    fn unknown(&self, _export: &str) -> Option<String> {
        None
    }
}

/// Calls `Backend::closed` when dropped (the connection ended, however).
struct OpenExport {
    backend: Arc<dyn Backend>,
    export: Arc<str>,
}

impl Drop for OpenExport {
    fn drop(&mut self) {
        self.backend.closed(&self.export);
    }
}

/// Per-connection limits and policy.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Requests of one connection being served at once; at the bound the socket is not read.
    pub in_flight_requests_max: u32,
    /// Bytes of read and write data of one connection in flight at once (at least the maximum
    /// block size, 32 MiB, so every valid request fits).
    pub in_flight_bytes_max: u64,
    /// The same, all connections together (at least `in_flight_bytes_max`): what a crowd of
    /// clients that send writes slowly or never read replies can hold.
    pub total_in_flight_bytes_max: u64,
    /// A request that started arriving must go on arriving, and a reply must be taken by the
    /// client, within this; otherwise the connection is closed and what it held is freed.
    pub stall_timeout: Duration,
    /// Time a client has from connecting to finishing option haggling.
    pub handshake_timeout: Duration,
    /// Advertise `NBD_FLAG_CAN_MULTI_CONN`: only if a flush covers writes completed on every
    /// connection to the export.
    pub multi_conn: bool,
    /// Set to `true` to drain (a graceful handover, or the host element stopping): the listener
    /// closes, every connection stops reading requests, answers those it took, and closes;
    /// `serve` then returns. A client that reconnects (qemu's `reconnect-delay`) resends what
    /// was not answered.
    pub drain: Option<watch::Receiver<bool>>,
    /// Serve NBD only over TLS (FORCEDTLS: `NBD_OPT_STARTTLS` first).
    pub tls: Option<NbdTls>,
}

/// NBD over TLS: this server's certificate, and whether clients must present one.
#[derive(Clone, Debug)]
pub struct NbdTls {
    pub context: TlsContext,
    /// Clients must present a certificate of the cluster's CA with the `admin` or `client` role.
    pub verify_peer: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            in_flight_requests_max: 64,
            in_flight_bytes_max: 64 * 1024 * 1024,
            total_in_flight_bytes_max: 1024 * 1024 * 1024,
            stall_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            multi_conn: false,
            drain: None,
            tls: None,
        }
    }
}

impl ServerOptions {
    fn validate(&self) -> io::Result<()> {
        let invalid = |message: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, message.to_owned()));
        if self.in_flight_requests_max == 0 || self.in_flight_requests_max as usize > Semaphore::MAX_PERMITS {
            return invalid("in_flight_requests_max must be at least 1");
        }
        if self.in_flight_bytes_max < u64::from(BLOCK_SIZE_MAX_BYTES) {
            return invalid("in_flight_bytes_max must be at least the maximum block size (32 MiB)");
        }
        if self.in_flight_bytes_max > Semaphore::MAX_PERMITS as u64 {
            return invalid("in_flight_bytes_max is too large");
        }
        if self.total_in_flight_bytes_max < self.in_flight_bytes_max
            || self.total_in_flight_bytes_max > Semaphore::MAX_PERMITS as u64
        {
            return invalid("total_in_flight_bytes_max must be at least in_flight_bytes_max");
        }
        Ok(())
    }
}

/// NBD connections served at once; more are closed at once, with a log line, until one ends.
pub const CONNECTIONS_MAX: usize = 256;

/// Serves NBD on `listener` until the returned future is dropped (which also drops every
/// connection and the backend calls in flight), or until accepting fails for good.
pub async fn serve(listener: TcpListener, backend: Arc<dyn Backend>, options: ServerOptions) -> io::Result<()> {
    options.validate()?;
    let total_bytes = Arc::new(Semaphore::new(options.total_in_flight_bytes_max as usize));
    let options = Arc::new(options);
    let mut connections = JoinSet::new();
    let mut drain = options.drain.clone();
    loop {
        let accepted = tokio::select! {
            accepted = crate::accept::accept(&listener, "nbd") => accepted?,
            () = drained(&mut drain) => {
                drop(listener);
                tracing::info!(connections = connections.len(), "nbd: draining");
                while connections.join_next().await.is_some() {}
                return Ok(());
            }
            Some(joined) = connections.join_next(), if !connections.is_empty() => {
                if let Err(error) = joined {
                    if error.is_panic() {
                        tracing::error!("nbd connection task panicked: {error}");
                    }
                }
                continue;
            }
        };
        let (stream, peer) = accepted;
        if connections.len() >= CONNECTIONS_MAX {
            tracing::warn!(%peer, limit = CONNECTIONS_MAX, "nbd: connection limit reached; connection closed");
            drop(stream);
            continue;
        }
        let backend = backend.clone();
        let options = options.clone();
        let total_bytes = total_bytes.clone();
        connections.spawn(async move {
            tracing::debug!(%peer, "nbd connection accepted");
            match serve_connection(stream, peer, backend, &options, total_bytes).await {
                Ok(end) => tracing::info!(%peer, "nbd connection closed: {end}"),
                Err(error) => tracing::warn!(%peer, "nbd connection ended: {error}"),
            }
        });
    }
}

/// Resolves once `drain` says so (never without one).
async fn drained(drain: &mut Option<watch::Receiver<bool>>) {
    match drain {
        Some(rx) => {
            if rx.wait_for(|&d| d).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// How a connection ended normally.
#[derive(Debug, PartialEq, Eq)]
enum ConnectionEnd {
    Aborted,
    Disconnected,
    ClosedByClient,
    Drained,
}

impl std::fmt::Display for ConnectionEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnectionEnd::Aborted => "client aborted the handshake",
            ConnectionEnd::Disconnected => "client disconnected (NBD_CMD_DISC)",
            ConnectionEnd::ClosedByClient => "client closed the connection",
            ConnectionEnd::Drained => {
                "drained for a handover or a stop (a reconnecting client resends what was unanswered)"
            }
        })
    }
}

/// Why a connection ended abnormally; logged once, by [`serve`].
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("client closed the connection during the handshake")]
    HandshakeClosed,
    #[error("protocol violation: {0}")]
    Protocol(#[from] nbd::FatalError),
    #[error("client closed the connection in the middle of a request")]
    RequestTruncated,
    #[error("sending a reply failed: {0}")]
    ReplyFailed(io::Error),
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("a request task panicked")]
    RequestPanicked,
    #[error("TLS: {0}")]
    Tls(String),
    #[error("the client stopped sending in the middle of a request for {0:?}")]
    Stalled(Duration),
}

/// Lets the handshake look exports up in the backend.
struct BackendExports<'a>(&'a dyn Backend);

impl Exports for BackendExports<'_> {
    fn list(&self) -> Vec<ExportInfo> {
        self.0.exports()
    }

    fn open(&self, export: &ExportInfo) -> Result<(), String> {
        self.0.opened(&export.name)
    }

    fn unknown(&self, name: &str) -> String {
        self.0.unknown(name).unwrap_or_else(|| nbd::NO_SUCH_EXPORT.to_string())
    }
}

/// Bytes read ahead from the socket at a time (beyond what the current message needs).
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// A write payload smaller than this is copied out of the read buffer: kept in the host
/// element's write queue, a slice of the buffer would keep the whole read chunk it came in
/// allocated (at 4 KiB writes the queue's memory was twice its payloads; docs/benchmarks.md).
const PAYLOAD_COPY_BYTES_BELOW: usize = 16 * 1024;

/// Take a write's payload of `length` bytes off the front of `buffer`: a small one copied into
/// its own allocation, a large one shared with the buffer (not copied).
fn take_payload(buffer: &mut BytesMut, length: usize) -> Bytes {
    if length < PAYLOAD_COPY_BYTES_BELOW {
        let payload = Bytes::copy_from_slice(&buffer[..length]);
        buffer.advance(length);
        payload
    } else {
        buffer.split_to(length).freeze()
    }
}

/// The reading and writing halves of a connection, plain or TLS.
type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

fn split(stream: Stream) -> (Reader, Writer) {
    match stream {
        Stream::Plain(tcp) => {
            let (reader, writer) = tcp.into_split();
            (Box::new(reader), Box::new(writer))
        }
        tls => {
            let (reader, writer) = tokio::io::split(tls);
            (Box::new(reader), Box::new(writer))
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    backend: Arc<dyn Backend>,
    options: &ServerOptions,
    total_bytes: Arc<Semaphore>,
) -> Result<ConnectionEnd, ConnectionError> {
    stream.set_nodelay(true)?;
    let mut buffer = BytesMut::with_capacity(READ_CHUNK_BYTES);
    let handshake = handshake(Stream::Plain(stream), &mut buffer, &backend, options);
    let (stream, outcome, open) = match tokio::time::timeout(options.handshake_timeout, handshake).await {
        Ok(outcome) => outcome?,
        Err(_elapsed) => return Err(ConnectionError::HandshakeTimeout(options.handshake_timeout)),
    };
    let low_water = crate::low_water::LowWater::of(&stream);
    let (reader, writer) = split(stream);
    let transmission = match outcome {
        HandshakeOutcome::Transmission(transmission) => transmission,
        HandshakeOutcome::Aborted => return Ok(ConnectionEnd::Aborted),
        HandshakeOutcome::Fatal(error) => return Err(error.into()),
    };
    tracing::debug!(
        %peer,
        export = %transmission.export().name,
        structured_replies = transmission.structured_replies(),
        block_status = transmission.block_status_enabled(),
        "nbd transmission phase"
    );
    let open = open.expect("a connection entering transmission was counted");
    let mut connection = Connection {
        export: open.export.clone(),
        transmission: Arc::new(transmission),
        backend,
        reader,
        low_water,
        buffer,
        writer: Arc::new(Mutex::new(writer)),
        reply_failed: Arc::new(ReplyFailure::default()),
        requests: Arc::new(Semaphore::new(options.in_flight_requests_max as usize)),
        data_bytes: Arc::new(Semaphore::new(options.in_flight_bytes_max as usize)),
        total_bytes,
        stall_timeout: options.stall_timeout,
        tasks: JoinSet::new(),
        drain: options.drain.clone(),
    };
    let end = connection.run().await;
    drop(open);
    end
}

/// Runs the handshake. A connection entering the transmission phase is counted
/// (`Backend::opened`, through `Exports::open`, and then the returned guard) before the client
/// hears that the handshake ended, so that a client told its export is open is never missed by
/// an `in use` check (a shrink, a delete), and a client the backend refuses hears why.
async fn handshake(
    mut stream: Stream,
    buffer: &mut BytesMut,
    backend: &Arc<dyn Backend>,
    options: &ServerOptions,
) -> Result<(Stream, HandshakeOutcome, Option<OpenExport>), ConnectionError> {
    let exports = BackendExports(backend.as_ref());
    let config = HandshakeConfig { multi_conn: options.multi_conn, tls: options.tls.is_some() };
    let mut handshake = Handshake::new(config);
    loop {
        // The outcome comes with the last reply. The connection was counted when the handshake
        // opened the export (`Exports::open`); from here the guard uncounts it, however it ends.
        let outcome = handshake.poll_outcome();
        let open = match &outcome {
            Some(HandshakeOutcome::Transmission(transmission)) => {
                let export: Arc<str> = transmission.export().name.as_str().into();
                Some(OpenExport { backend: backend.clone(), export })
            }
            _ => None,
        };
        if let Some(output) = handshake.poll_transmit() {
            stream.write_all(&output).await?;
            stream.flush().await?;
        }
        if let Some(outcome) = outcome {
            return Ok((stream, outcome, open));
        }
        if handshake.wants_tls() {
            let tls = options.tls.as_ref().expect("STARTTLS is acknowledged only with TLS configured");
            stream = start_tls(stream, buffer, tls).await?;
            handshake.tls_established();
            continue;
        }
        buffer.reserve(READ_CHUNK_BYTES);
        if stream.read_buf(buffer).await? == 0 {
            return Err(ConnectionError::HandshakeClosed);
        }
        let consumed = handshake.handle_input(buffer, &exports);
        buffer.advance(consumed);
        assert!(handshake.is_done() || buffer.len() < HANDSHAKE_INPUT_BYTES_MAX);
    }
}

/// The server side of TLS after `NBD_OPT_STARTTLS`, and who the client is if it must say.
async fn start_tls(stream: Stream, buffer: &BytesMut, tls: &NbdTls) -> Result<Stream, ConnectionError> {
    if !buffer.is_empty() {
        // The client could not have seen our acknowledgement yet: these bytes were injected.
        return Err(ConnectionError::Tls("data sent after NBD_OPT_STARTTLS before the TLS handshake".into()));
    }
    let Stream::Plain(tcp) = stream else {
        return Err(ConnectionError::Tls("STARTTLS inside TLS".into()));
    };
    let peer = if tls.verify_peer { PeerCertificate::Required } else { PeerCertificate::Optional };
    let (stream, identity) = tls.context.accept(tcp, peer).await.map_err(ConnectionError::Tls)?;
    if let Some(identity) = identity {
        if tls.verify_peer && !matches!(identity.role, Role::Admin | Role::Client) {
            return Err(ConnectionError::Tls(format!(
                "{identity} may not use NBD (only admin and client certificates)"
            )));
        }
        tracing::debug!(%identity, "nbd client authenticated");
    }
    Ok(stream)
}

/// One connection in the transmission phase.
struct Connection {
    export: Arc<str>,
    transmission: Arc<Transmission>,
    backend: Arc<dyn Backend>,
    reader: Reader,
    low_water: crate::low_water::LowWater,
    /// Received bytes not yet consumed (read ahead of the current message).
    buffer: BytesMut,
    writer: Arc<Mutex<Writer>>,
    /// Signalled when a reply could not be sent: the connection is dead.
    reply_failed: Arc<ReplyFailure>,
    /// One permit per request in flight.
    requests: Arc<Semaphore>,
    /// One permit per byte of read or write data in flight.
    data_bytes: Arc<Semaphore>,
    /// The same for every connection of the server.
    total_bytes: Arc<Semaphore>,
    stall_timeout: Duration,
    tasks: JoinSet<()>,
    drain: Option<watch::Receiver<bool>>,
}

/// What reading the next request led to.
enum Next {
    Continue,
    /// A graceful handover: answer what was taken, then close.
    Drain,
    Disconnect,
    Closed,
}

impl Connection {
    async fn run(&mut self) -> Result<ConnectionEnd, ConnectionError> {
        let reply_failed = self.reply_failed.clone();
        let mut drain = self.drain.take();
        let result = loop {
            if let Err(error) = self.reap_finished_tasks() {
                break Err(error);
            }
            let next = tokio::select! {
                next = self.handle_next_request() => next,
                error = reply_failed.wait() => Err(ConnectionError::ReplyFailed(error)),
                () = drained(&mut drain) => Ok(Next::Drain),
            };
            match next {
                Ok(Next::Continue) => {}
                Ok(Next::Drain) => break Ok(ConnectionEnd::Drained),
                Ok(Next::Disconnect) => break Ok(ConnectionEnd::Disconnected),
                Ok(Next::Closed) => break Ok(ConnectionEnd::ClosedByClient),
                Err(error) => break Err(error),
            }
        };
        // NBD_CMD_DISC asks us to finish what is in flight; on errors the backend calls
        // already made are let finish too rather than cancelled halfway.
        let mut panicked = false;
        while let Some(joined) = self.tasks.join_next().await {
            panicked |= joined.is_err_and(|error| error.is_panic());
        }
        let _ = self.writer.lock().await.shutdown().await;
        match result {
            Ok(_) if panicked => Err(ConnectionError::RequestPanicked),
            other => other,
        }
    }

    fn reap_finished_tasks(&mut self) -> Result<(), ConnectionError> {
        while let Some(joined) = self.tasks.try_join_next() {
            if joined.is_err_and(|error| error.is_panic()) {
                return Err(ConnectionError::RequestPanicked);
            }
        }
        Ok(())
    }

    /// Waits for room, reads one request (with its payload), and starts serving it.
    async fn handle_next_request(&mut self) -> Result<Next, ConnectionError> {
        let request_permit =
            self.requests.clone().acquire_owned().await.expect("the request semaphore is never closed");
        if !self.fill(REQUEST_HEADER_BYTES).await? {
            return Ok(Next::Closed);
        }
        let header: [u8; REQUEST_HEADER_BYTES] =
            self.buffer[..REQUEST_HEADER_BYTES].try_into().expect("the buffer holds a whole header");
        self.buffer.advance(REQUEST_HEADER_BYTES);
        match self.transmission.decode_request(&header)? {
            Decoded::Disconnect => Ok(Next::Disconnect),
            Decoded::NoOp { handle, kind } => {
                let reply = self.transmission.encode_success(handle, kind);
                self.spawn_reply(reply, request_permit);
                Ok(Next::Continue)
            }
            Decoded::Rejected(rejected) => {
                self.discard(rejected.payload_bytes).await?;
                let reply = self.transmission.encode_error(rejected.handle, rejected.errno, rejected.message);
                self.spawn_reply(reply, request_permit);
                Ok(Next::Continue)
            }
            Decoded::Request(request) => {
                let data_bytes = match request.command {
                    Command::Read { length_bytes, .. } | Command::Write { length_bytes, .. } => length_bytes,
                    _ => 0,
                };
                let data_permit = self
                    .data_bytes
                    .clone()
                    .acquire_many_owned(data_bytes)
                    .await
                    .expect("the data semaphore is never closed");
                let total_permit = self
                    .total_bytes
                    .clone()
                    .acquire_many_owned(data_bytes)
                    .await
                    .expect("the data semaphore is never closed");
                let payload = match request.command.payload_bytes() {
                    0 => None,
                    length => {
                        let length = length as usize;
                        if !self.fill(length).await? {
                            return Err(ConnectionError::RequestTruncated);
                        }
                        Some(take_payload(&mut self.buffer, length))
                    }
                };
                let job = RequestJob {
                    export: self.export.clone(),
                    transmission: self.transmission.clone(),
                    backend: self.backend.clone(),
                    writer: self.writer.clone(),
                    reply_failed: self.reply_failed.clone(),
                    stall_timeout: self.stall_timeout,
                };
                self.tasks.spawn(job.run(request, payload, [request_permit, data_permit, total_permit]));
                Ok(Next::Continue)
            }
        }
    }

    /// Reads until the buffer holds `wanted` bytes. `Ok(false)`: the client closed the
    /// connection cleanly before sending any of them.
    async fn fill(&mut self, wanted: usize) -> Result<bool, ConnectionError> {
        while self.buffer.len() < wanted {
            if wanted > READ_CHUNK_BYTES {
                // A large payload: room for all of it, without copying the old room (and no
                // growth near its end).
                proto::room_for(&mut self.buffer, wanted);
            } else {
                self.buffer.reserve((wanted - self.buffer.len()).max(READ_CHUNK_BYTES));
            }
            // Between requests a client may be idle as long as it likes; inside one it may not.
            let started = !self.buffer.is_empty() || wanted > REQUEST_HEADER_BYTES;
            if self.read_more(started, wanted - self.buffer.len()).await? == 0 {
                if self.buffer.is_empty() {
                    return Ok(false);
                }
                return Err(ConnectionError::RequestTruncated);
            }
        }
        Ok(true)
    }

    /// Reads and drops `count` bytes without ever holding more than a read chunk of them.
    async fn discard(&mut self, count: u32) -> Result<(), ConnectionError> {
        let mut remaining = count as usize;
        loop {
            let dropped = remaining.min(self.buffer.len());
            self.buffer.advance(dropped);
            remaining -= dropped;
            if remaining == 0 {
                return Ok(());
            }
            self.buffer.reserve(READ_CHUNK_BYTES);
            if self.read_more(true, remaining).await? == 0 {
                return Err(ConnectionError::RequestTruncated);
            }
        }
    }

    /// One read into the buffer; inside a request (`started`) bounded by the stall timeout.
    /// `missing`: the bytes of the request the client still sends without waiting for a reply,
    /// the socket's wake-up mark (`low_water`; a mark left from an earlier request could wait
    /// for bytes that never come).
    async fn read_more(&mut self, started: bool, missing: usize) -> Result<usize, ConnectionError> {
        self.low_water.expect(missing);
        if !started {
            return Ok(self.reader.read_buf(&mut self.buffer).await?);
        }
        match tokio::time::timeout(self.stall_timeout, self.reader.read_buf(&mut self.buffer)).await {
            Ok(read) => Ok(read?),
            Err(_) => Err(ConnectionError::Stalled(self.stall_timeout)),
        }
    }

    fn spawn_reply(&mut self, reply: Vec<u8>, permit: OwnedSemaphorePermit) {
        let writer = self.writer.clone();
        let reply_failed = self.reply_failed.clone();
        let stall_timeout = self.stall_timeout;
        self.tasks.spawn(async move {
            send_reply(&writer, &reply_failed, reply, None, stall_timeout).await;
            drop(permit);
        });
    }
}

/// What a request task needs of its connection.
struct RequestJob {
    export: Arc<str>,
    transmission: Arc<Transmission>,
    backend: Arc<dyn Backend>,
    writer: Arc<Mutex<Writer>>,
    reply_failed: Arc<ReplyFailure>,
    stall_timeout: Duration,
}

impl RequestJob {
    /// Runs one request on the backend and sends its reply; the permits are released after.
    async fn run(self, request: Request, payload: Option<Bytes>, permits: [OwnedSemaphorePermit; 3]) {
        let (reply, data) = self.execute(request, payload).await;
        send_reply(&self.writer, &self.reply_failed, reply, data, self.stall_timeout).await;
        drop(permits);
    }

    async fn execute(&self, request: Request, payload: Option<Bytes>) -> (Vec<u8>, Option<Bytes>) {
        let transmission = &self.transmission;
        let handle = request.handle;
        let export = &*self.export;
        let done = |result: Result<(), Errno>| match result {
            Ok(()) => transmission.encode_success(handle, request.command.kind()),
            Err(errno) => transmission.encode_error(handle, errno, &errno.to_string()),
        };
        match request.command {
            Command::Read { offset_bytes, length_bytes } => {
                match self.backend.read(export, offset_bytes, length_bytes).await {
                    Ok(data) => {
                        assert_eq!(data.len(), length_bytes as usize, "Backend::read returned the wrong length");
                        (transmission.encode_read_header(handle, offset_bytes, length_bytes), Some(data))
                    }
                    Err(errno) => (transmission.encode_error(handle, errno, &errno.to_string()), None),
                }
            }
            Command::Write { offset_bytes, fua, .. } => {
                let data = payload.expect("a write request comes with its payload");
                (done(self.backend.write(export, offset_bytes, data, fua).await), None)
            }
            Command::Flush => (done(self.backend.flush(export).await), None),
            Command::Trim { offset_bytes, length_bytes, fua } => {
                (done(self.backend.trim(export, offset_bytes, u64::from(length_bytes), fua).await), None)
            }
            Command::WriteZeroes { offset_bytes, length_bytes, fua, no_hole: _ } => {
                let result = self.backend.write_zeroes(export, offset_bytes, u64::from(length_bytes), fua).await;
                (done(result), None)
            }
            Command::BlockStatus { offset_bytes, length_bytes, req_one } => {
                match self.backend.block_status(export, offset_bytes, u64::from(length_bytes)).await {
                    Ok(extents) => (transmission.encode_block_status(handle, length_bytes, req_one, &extents), None),
                    Err(errno) => (transmission.encode_error(handle, errno, &errno.to_string()), None),
                }
            }
        }
    }
}

/// Writes one reply (header and data together, with no other reply in between).
async fn send_reply(
    writer: &Mutex<Writer>,
    reply_failed: &ReplyFailure,
    header: Vec<u8>,
    data: Option<Bytes>,
    stall_timeout: Duration,
) {
    let mut writer = writer.lock().await;
    if reply_failed.failed() {
        return;
    }
    // A client that takes no replies would hold its requests' memory for good: every piece of
    // the reply must be taken within the stall timeout (a slow client that keeps reading is
    // fine, however long the whole reply takes).
    let stalled = || io::Error::new(io::ErrorKind::TimedOut, format!("the client took no reply for {stall_timeout:?}"));
    let mut reply = Bytes::from(header).chain(data.unwrap_or_default());
    let result = async {
        while reply.has_remaining() {
            let written =
                tokio::time::timeout(stall_timeout, writer.write_buf(&mut reply)).await.map_err(|_| stalled())?;
            if written? == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "the connection took no more bytes"));
            }
        }
        // TLS keeps records until flushed (a no-op on plain TCP).
        tokio::time::timeout(stall_timeout, writer.flush()).await.map_err(|_| stalled())?
    }
    .await;
    if let Err(error) = result {
        reply_failed.report(error);
    }
}

/// The first failure to send a reply, which ends the connection: the client cannot make sense
/// of the stream any more.
#[derive(Default)]
struct ReplyFailure {
    notify: Notify,
    error: std::sync::Mutex<Option<io::Error>>,
    failed: std::sync::atomic::AtomicBool,
}

impl ReplyFailure {
    /// Whether a reply failed already: later ones are not even tried.
    fn failed(&self) -> bool {
        self.failed.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn report(&self, error: io::Error) {
        self.failed.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut first = self.error.lock().expect("no panic while holding this lock");
        if first.is_none() {
            *first = Some(error);
            self.notify.notify_one();
        }
    }

    async fn wait(&self) -> io::Error {
        self.notify.notified().await;
        self.error.lock().expect("no panic while holding this lock").take().expect("reported before notified")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_payload_does_not_keep_its_read_chunk_and_a_large_one_is_not_copied() {
        let mut buffer = BytesMut::with_capacity(READ_CHUNK_BYTES);
        buffer.extend_from_slice(&[7; 2 * 4096]);
        let small = take_payload(&mut buffer, 4096);
        assert_eq!(small, Bytes::from(vec![7; 4096]));
        buffer.clear();
        assert!(buffer.try_reclaim(READ_CHUNK_BYTES), "the small payload shares the read chunk");

        buffer.extend_from_slice(&[8; PAYLOAD_COPY_BYTES_BELOW + 512]);
        let large = take_payload(&mut buffer, PAYLOAD_COPY_BYTES_BELOW);
        assert_eq!(large.len(), PAYLOAD_COPY_BYTES_BELOW);
        assert_eq!(buffer.len(), 512);
        buffer.clear();
        assert!(!buffer.try_reclaim(READ_CHUNK_BYTES), "the large payload was copied");
        drop(large);
        assert!(buffer.try_reclaim(READ_CHUNK_BYTES));
        assert_eq!(small.len(), 4096);
    }
}
