//! The element's shell: a TCP server in front of the durable [`store::Store`], driving the
//! sans-IO [`ElementCore`], which holds every rule.
//!
//! One actor task owns the core. Session tasks read frames and hand them to it over a bounded
//! channel (a busy element stops reading, and TCP pushes back on the host element). Storage
//! jobs (group commits, epoch adoption) run one at a time on the committer thread; reads,
//! block status and replay-log or block fetches run on the blocking pool and answer the
//! session directly, concurrently with commits. Peer sessions (a replay's source) are tasks
//! that report to the actor; a full recovery's block walk runs in `copy.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use proto::{decode_frame, encode_frame, ElementMessage, HostMessage, Sequence, VolumeId, VolumeSpec};
use starfish_core::{
    ElementAction, ElementConfig, ElementCore, ElementStorage, LocalVolume, LogLevel, PeerId, SessionId, SessionRole,
    StorageDone, StorageJob, Time, VolumeInfo,
};
use store::{Store, StoreOptions};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::outgoing::Outgoing;
use crate::tls::{PeerCertificate, Role, Stream, TlsContext};

/// Sessions (host elements and peers' recoveries) served at once; more are refused with a log
/// line until one ends.
pub const SESSIONS_MAX: usize = 64;
/// Inputs waiting for the actor, all sessions together: beyond it session tasks stop reading.
const ACTOR_QUEUE_MAX: usize = 4096;
/// A session must send its first message (a hello, or a standby's observe) within this.
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// A frame that started arriving must go on arriving: nothing of it for this long ends the
/// session (a stalled sender holds no memory longer than this).
const FRAME_STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames larger than this are counted against [`RECEIVING_BYTES_MAX`] while they arrive.
const LARGE_FRAME_BYTES: usize = 1 << 20;
/// Bytes of large frames being received, all sessions together; a session whose frame would go
/// beyond waits (up to [`RECEIVING_WAIT_MAX`]: stalled senders are gone by then).
const RECEIVING_BYTES_MAX: usize = 256 << 20;
const RECEIVING_WAIT_MAX: Duration = Duration::from_secs(60);
const _: () = assert!(RECEIVING_BYTES_MAX >= proto::FRAME_BODY_BYTES_MAX as usize * 4);
/// A peer that does not accept a connection within this is unreachable.
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A peer that answers nothing for this long has failed the replay or copy that uses it.
pub(crate) const REPLAY_IDLE_TIMEOUT: Duration = Duration::from_millis(starfish_core::limits::REPLAY_IDLE_TIMEOUT_MS);

#[derive(Clone, Debug)]
pub struct ElementOptions {
    pub listen: SocketAddr,
    pub data: PathBuf,
    pub store: StoreOptions,
    /// Mutual TLS: every session must present a certificate of this cluster's CA (a host
    /// element's or an element's), and peers are reached over TLS. `None`: plain TCP, which
    /// [`run`] allows on loopback only unless `insecure`.
    pub tls: Option<TlsContext>,
    /// Serve plain TCP beyond loopback (`--insecure`).
    pub insecure: bool,
    /// On a loopback address, listen on the local socket too (`crate::local_socket`);
    /// `--no-local-socket` turns it off.
    pub local_socket: bool,
}

/// What reaches the actor.
enum Input {
    Opened {
        session: SessionId,
        role: SessionRole,
        writer: mpsc::UnboundedSender<ElementMessage>,
    },
    Message {
        session: SessionId,
        message: HostMessage,
    },
    Closed {
        session: SessionId,
    },
    VolumesEnsured {
        session: SessionId,
        result: Result<Vec<(LocalVolume, VolumeInfo)>, String>,
    },
    VolumesChecked {
        session: SessionId,
        request_id: u64,
        result: Result<(), String>,
    },
    Storage(StorageDone),
    PeerMessage {
        peer: PeerId,
        message: ElementMessage,
    },
    PeerClosed {
        peer: PeerId,
        reason: String,
    },
    CopyProgress {
        volume: LocalVolume,
        message: ElementMessage,
    },
    CopyDone {
        volume: LocalVolume,
        session_volume: VolumeId,
        info: VolumeInfo,
        result: Result<Sequence, String>,
    },
    /// Storage made the volume a repair.
    Damaged {
        volume: LocalVolume,
    },
}

/// Open the store, start the committer and serve sessions until `shutdown` completes; then
/// checkpoint, so the next start has no log to replay. A store that runs out of space is
/// reopened once space is freed (meanwhile every session is refused with the reason), so an
/// operator who frees space needs not restart the element.
pub async fn run(options: ElementOptions, shutdown: impl std::future::Future<Output = ()>) -> std::io::Result<()> {
    crate::tls::check_listen("the element port", options.listen, options.tls.is_some(), options.insecure)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e))?;
    let mut store =
        open_store(&options).await.map_err(|e| std::io::Error::other(format!("cannot open data directory: {e}")))?;
    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", options.listen)))?;
    // The far link: host elements that reach this element over a lossy long path open
    // sessions over UDP (FEC, see `far_link`) on the same port number.
    let far = crate::far_link::FarListener::bind(listener.local_addr()?).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot listen for the far link on UDP {}: {e}", options.listen))
    })?;
    let local = crate::local_socket::take(listener.local_addr()?, options.local_socket)?;
    let mut listeners = Listeners { tcp: listener, far, local };
    tokio::pin!(shutdown);
    let mut next_session = 1u64;
    loop {
        match serve(&mut listeners, store, &options, &mut next_session, &mut shutdown).await? {
            Served::Stopped(store) => {
                tracing::info!("element stopping: checkpoint");
                return tokio::task::spawn_blocking(move || store.checkpoint())
                    .await
                    .map_err(std::io::Error::other)?
                    .map_err(|e| std::io::Error::other(format!("checkpoint at shutdown: {e}")));
            }
            Served::OutOfSpace(reason) => {
                match reopen_when_space(&mut listeners, &options, &reason, &mut shutdown).await {
                    Some(reopened) => store = reopened,
                    None => return Ok(()),
                }
            }
        }
    }
}

async fn open_store(options: &ElementOptions) -> Result<Arc<Store>, store::StoreError> {
    let (data, store_options) = (options.data.clone(), options.store);
    let opened = tokio::task::spawn_blocking(move || Store::open(&data, store_options))
        .await
        .map_err(|e| store::StoreError::Failed { reason: format!("opening task: {e}") })?;
    opened.map(Arc::new)
}

enum Served {
    Stopped(Arc<Store>),
    /// The store failed for lack of space (the reason), and every task that used it is gone.
    OutOfSpace(String),
}

/// Serve sessions over one open store until shutdown, or until the store runs out of space.
async fn serve(
    listeners: &mut Listeners,
    store: Arc<Store>,
    options: &ElementOptions,
    next_session: &mut u64,
    shutdown: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> std::io::Result<Served> {
    let volumes = store
        .volumes()
        .into_iter()
        .enumerate()
        .map(|(i, (name, size_bytes))| {
            let handle = store.volume_numbered(i as u32).expect("listed");
            (VolumeSpec { name, size_bytes, clone_of: None, at_least: false }, store.volume_info(handle))
        })
        .collect();
    let config = ElementConfig { element_id: store.element_id(), ..ElementConfig::default() };
    let core = ElementCore::new(config, store.epoch(), store.epoch_holder(), volumes);
    let (inputs, input_rx) = mpsc::channel::<Input>(ACTOR_QUEUE_MAX);
    let (jobs, job_rx) = std::sync::mpsc::channel::<StorageJob>();
    let (out_of_space, mut out_of_space_rx) = tokio::sync::watch::channel(false);
    let out_of_space = Arc::new(out_of_space);
    let committer = {
        let (store, inputs, out_of_space) = (store.clone(), inputs.clone(), out_of_space.clone());
        std::thread::Builder::new()
            .name("committer".into())
            .spawn(move || run_committer(&store, job_rx, inputs, &out_of_space))?
    };
    let peers = Peers { links: HashMap::new(), tls: options.tls.clone() };
    let storage = Storage { store: store.clone(), jobs, out_of_space };
    let mut actor = tokio::spawn(run_actor(core, storage, input_rx, inputs.clone(), peers));
    tracing::info!(listen = %options.listen, data = %options.data.display(), epoch = %store.epoch(), "element serving");
    let sessions = Arc::new(tokio::sync::Semaphore::new(SESSIONS_MAX));
    let receiving = Arc::new(tokio::sync::Semaphore::new(RECEIVING_BYTES_MAX));
    let stopped = loop {
        let (stream, peer) = tokio::select! {
            accepted = listeners.accept() => accepted?,
            _ = shutdown.as_mut() => break true,
            _ = out_of_space_rx.changed() => break false,
        };
        let Ok(permit) = sessions.clone().try_acquire_owned() else {
            tracing::warn!(%peer, limit = SESSIONS_MAX, "element: session limit reached; connection closed");
            drop(stream);
            continue;
        };
        let session = SessionId(*next_session);
        *next_session += 1;
        let inputs = inputs.clone();
        let tls = options.tls.clone();
        let receiving = receiving.clone();
        tokio::spawn(async move {
            let (stream, role) = match authenticate(stream, tls.as_ref()).await {
                Ok(authenticated) => authenticated,
                Err(reason) => {
                    tracing::warn!(%peer, session = session.0, "connection refused: {reason}");
                    return;
                }
            };
            let reason = serve_session(stream, session, role, inputs, receiving).await;
            tracing::info!(%peer, session = session.0, %reason, "session ended");
            drop(permit);
        });
    };
    actor.abort();
    let _ = (&mut actor).await;
    drop(inputs);
    if stopped {
        return Ok(Served::Stopped(store));
    }
    // The actor is gone, so the committer's job channel is closed and it ends; sessions end
    // as their writers were dropped with the actor.
    let _ = tokio::task::spawn_blocking(move || committer.join()).await;
    let reason = store.failure().unwrap_or_else(|| "no space left on device".into());
    Ok(Served::OutOfSpace(reason))
}

/// The store ran out of space: refuse every session with the reason until the file system
/// has room again, then reopen the store (replaying its log). `None`: shut down meanwhile.
async fn reopen_when_space(
    listeners: &mut Listeners,
    options: &ElementOptions,
    reason: &str,
    shutdown: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Option<Arc<Store>> {
    let needed = Store::reopen_space_bytes(&options.store);
    let refusal = format!(
        "this element is out of disk space ({reason}); it takes no records until {} MiB are free in {}, then reopens its store by itself",
        needed >> 20,
        options.data.display()
    );
    tracing::error!(data = %options.data.display(), needed_mib = needed >> 20, %reason, "element OUT OF SPACE: refusing sessions until space is freed");
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.as_mut() => return None,
            accepted = listeners.accept() => {
                if let Ok((stream, _)) = accepted {
                    let message = ElementMessage::Refused { reason: refusal.clone(), epoch: None, owner_absent_ms: 0 };
                    tokio::spawn(refuse_connection(stream, options.tls.clone(), message));
                }
            }
            _ = tick.tick() => {
                let free = store::sys_available_bytes(&options.data).unwrap_or(0);
                if free < needed {
                    continue;
                }
                match open_store(options).await {
                    Ok(store) => {
                        tracing::info!(free_mib = free >> 20, "space is free again: store reopened");
                        return Some(store);
                    }
                    // The old store may still be held by a task that is ending.
                    Err(e) => tracing::warn!(error = %e, "reopening the store failed; retrying"),
                }
            }
        }
    }
}

/// A connection as accepted: over TCP, a far-link session over UDP, or over the local socket.
enum Incoming {
    Tcp(TcpStream),
    Far(crate::far_link::FecStream),
    Local(crate::local_socket::LocalStream),
}

/// Where an element takes connections: its TCP port, the far link on the same UDP port, and
/// (on a loopback address) its local socket (`crate::local_socket`).
struct Listeners {
    tcp: TcpListener,
    far: crate::far_link::FarListener,
    local: Option<crate::local_socket::LocalSocket>,
}

impl Listeners {
    /// The next connection, and who it came from (for logs).
    async fn accept(&mut self) -> std::io::Result<(Incoming, String)> {
        let local = async {
            match &self.local {
                Some(crate::local_socket::LocalSocket::Listening(local)) => {
                    crate::accept::accept_with(|| local.accept(), "element local socket").await
                }
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            accepted = crate::accept::accept(&self.tcp, "element") => {
                let (stream, peer) = accepted?;
                let _ = stream.set_nodelay(true);
                Ok((Incoming::Tcp(stream), peer.to_string()))
            }
            accepted = self.far.accept() => {
                let (stream, peer) = accepted?;
                Ok((Incoming::Far(stream), format!("far link {peer}")))
            }
            accepted = local => {
                let (stream, _) = accepted?;
                let stream = crate::local_socket::LocalStream::from_tokio(stream)?;
                Ok((Incoming::Local(stream), "local socket".to_string()))
            }
        }
    }
}

/// The TLS handshake of a session (if TLS is configured) and the role its certificate gives:
/// only host elements and elements are served.
async fn authenticate(stream: Incoming, tls: Option<&TlsContext>) -> Result<(Stream, SessionRole), String> {
    use crate::tls::Carrier;
    let Some(tls) = tls else {
        let stream = match stream {
            Incoming::Tcp(s) => s.plain(),
            Incoming::Far(s) => s.plain(),
            Incoming::Local(s) => s.plain(),
        };
        return Ok((stream, SessionRole::Unauthenticated));
    };
    let (stream, identity) = match stream {
        Incoming::Tcp(s) => tls.accept(s, PeerCertificate::Required).await?,
        Incoming::Far(s) => tls.accept(s, PeerCertificate::Required).await?,
        Incoming::Local(s) => tls.accept(s, PeerCertificate::Required).await?,
    };
    let identity = identity.ok_or("no client certificate")?;
    match identity.role {
        Role::Host => Ok((stream, SessionRole::Host)),
        Role::Element => Ok((stream, SessionRole::Element)),
        Role::Admin | Role::Client => {
            Err(format!("{identity} may not speak to an element (only host elements and elements may)"))
        }
    }
}

/// Answer a connection with one refusal and close it.
async fn refuse_connection(stream: Incoming, tls: Option<TlsContext>, message: ElementMessage) {
    let Ok((mut stream, _)) = authenticate(stream, tls.as_ref()).await else { return };
    let _ = tokio::time::timeout(Duration::from_secs(2), send_frame(&mut stream, &message)).await;
}

/// Carry out storage jobs in order, one at a time (a commit is one write and one fdatasync).
fn run_committer(
    store: &Store,
    jobs: std::sync::mpsc::Receiver<StorageJob>,
    inputs: mpsc::Sender<Input>,
    out_of_space: &tokio::sync::watch::Sender<bool>,
) {
    while let Ok(job) = jobs.recv() {
        let done = run_job(store, job);
        if inputs.blocking_send(Input::Storage(done)).is_err() {
            return;
        }
        report_damage(store, &inputs);
        if store.failed_for_space() {
            let _ = out_of_space.send(true);
        }
    }
}

/// Carry out one storage job, on the committer thread or, for a store in memory, on the actor.
fn run_job(store: &Store, job: StorageJob) -> StorageDone {
    let mut storage = store;
    match job {
        StorageJob::AdoptEpoch(epoch, host) => {
            StorageDone::AdoptEpoch(ElementStorage::adopt_epoch(&mut storage, epoch, host))
        }
        StorageJob::Commit(batch) => {
            let result = ElementStorage::commit(&mut storage, &batch);
            if let Err(e) = &result {
                tracing::error!(error = %e, "commit failed");
            }
            StorageDone::Commit(result)
        }
        StorageJob::RemoveVolumes(volumes) => {
            let result = volumes.iter().try_for_each(|v| ElementStorage::remove_volume(&mut storage, *v));
            if let Err(e) = &result {
                tracing::error!(error = %e, "volume removal failed");
            }
            StorageDone::RemoveVolumes(result)
        }
        StorageJob::ResizeVolumes(volumes) => {
            let result = volumes
                .iter()
                .try_for_each(|(v, size_bytes)| ElementStorage::resize_volume(&mut storage, *v, *size_bytes));
            if let Err(e) = &result {
                tracing::error!(error = %e, "volume resize failed");
            }
            StorageDone::ResizeVolumes(result)
        }
    }
}

/// Tell the actor of volumes that storage made repairs (a block failed its checksum).
fn report_damage(store: &Store, inputs: &mpsc::Sender<Input>) {
    for volume in ElementStorage::take_damaged(&store) {
        let _ = inputs.blocking_send(Input::Damaged { volume });
    }
}

/// Peer sessions the actor opened (what to send them), and how to reach peers.
struct Peers {
    links: HashMap<PeerId, (mpsc::UnboundedSender<HostMessage>, tokio::task::JoinHandle<()>)>,
    tls: Option<TlsContext>,
}

/// Where the actor's storage jobs go: the committer thread, or, for a store in memory, the
/// actor itself (a thread hand-off each way costs more than such a commit; docs/benchmarks.md).
struct Storage {
    store: Arc<Store>,
    jobs: std::sync::mpsc::Sender<StorageJob>,
    out_of_space: Arc<tokio::sync::watch::Sender<bool>>,
}

/// The most bytes a commit the actor runs itself may touch (a store in memory). A larger one
/// goes to the committer thread: the actor is never kept from its other inputs (heartbeats,
/// reads) by more than about a tenth of a millisecond of copying, and a large write's copies
/// run beside the receipt of the next one.
const ACTOR_COMMIT_BYTES_MAX: u64 = 256 * 1024;

/// Whether the actor runs `job` itself: only for a store in memory (no job then waits for a
/// disk), and only a small one: an epoch adoption, or a commit of at most
/// `ACTOR_COMMIT_BYTES_MAX` bytes of writes, trims and zeroes and no snapshot deletion (which
/// may hand over many blocks). Removing or resizing volumes frees memory page by page: the
/// committer thread.
fn runs_on_actor(store: &Store, job: &StorageJob) -> bool {
    if !store.in_memory() {
        return false;
    }
    match job {
        StorageJob::AdoptEpoch(..) => true,
        StorageJob::Commit(batch) => batch
            .iter()
            .try_fold(0u64, |sum, (_, record)| match record.op {
                proto::Op::SnapshotDelete { .. } => None,
                ref op => sum.checked_add(op.length_bytes()),
            })
            .is_some_and(|bytes| bytes <= ACTOR_COMMIT_BYTES_MAX),
        StorageJob::RemoveVolumes(_) | StorageJob::ResizeVolumes(_) => false,
    }
}

/// Inputs the actor takes in one turn before carrying out what they asked for: those that
/// arrived while a commit ran then share the next one.
const INPUTS_PER_TURN_MAX: usize = 64;

async fn run_actor(
    mut core: ElementCore,
    storage: Storage,
    mut input_rx: mpsc::Receiver<Input>,
    inputs: mpsc::Sender<Input>,
    mut peers: Peers,
) {
    let origin = Instant::now();
    let now = || Time(origin.elapsed().as_micros() as u64);
    let mut writers: HashMap<SessionId, mpsc::UnboundedSender<ElementMessage>> = HashMap::new();
    loop {
        let timeout = core.poll_timeout();
        let input = match timeout {
            Some(at) => {
                let wait = Duration::from_micros(at.0.saturating_sub(now().0));
                match tokio::time::timeout(wait, input_rx.recv()).await {
                    Ok(input) => input,
                    Err(_) => {
                        core.handle_timeout(now());
                        carry_out(now(), &mut core, &storage, &inputs, &mut writers, &mut peers);
                        continue;
                    }
                }
            }
            None => input_rx.recv().await,
        };
        let Some(input) = input else { return };
        handle_input(now(), &mut core, input, &mut writers, &mut peers);
        for _ in 1..INPUTS_PER_TURN_MAX {
            let Ok(input) = input_rx.try_recv() else { break };
            handle_input(now(), &mut core, input, &mut writers, &mut peers);
        }
        if core.poll_timeout().is_some_and(|at| at <= now()) {
            core.handle_timeout(now());
        }
        carry_out(now(), &mut core, &storage, &inputs, &mut writers, &mut peers);
    }
}

fn handle_input(
    t: Time,
    core: &mut ElementCore,
    input: Input,
    writers: &mut HashMap<SessionId, mpsc::UnboundedSender<ElementMessage>>,
    peers: &mut Peers,
) {
    match input {
        Input::Opened { session, role, writer } => {
            writers.insert(session, writer);
            core.handle_session_opened(t, session, role);
        }
        Input::Message { session, message } => core.handle_host_message(t, session, message),
        Input::Closed { session } => {
            writers.remove(&session);
            core.handle_session_closed(t, session);
        }
        Input::VolumesEnsured { session, result } => core.handle_volumes_ensured(t, session, result),
        Input::VolumesChecked { session, request_id, result } => {
            core.handle_volumes_checked(t, session, request_id, result)
        }
        Input::Storage(done) => core.handle_storage_done(t, done),
        Input::PeerMessage { peer, message } => core.handle_peer_message(t, peer, message),
        Input::PeerClosed { peer, reason } => {
            peers.links.remove(&peer);
            core.handle_peer_closed(t, peer, reason);
        }
        Input::CopyProgress { volume, message } => core.handle_copy_progress(t, volume, message),
        Input::CopyDone { volume, session_volume, info, result } => {
            core.handle_copy_done(t, volume, session_volume, info, result)
        }
        Input::Damaged { volume } => core.handle_volume_damaged(t, volume),
    }
}

fn carry_out(
    now: Time,
    core: &mut ElementCore,
    storage: &Storage,
    inputs: &mpsc::Sender<Input>,
    writers: &mut HashMap<SessionId, mpsc::UnboundedSender<ElementMessage>>,
    peers: &mut Peers,
) {
    let store = &storage.store;
    while let Some(action) = core.poll_action() {
        match action {
            ElementAction::Send { session, message } => {
                if let Some(writer) = writers.get(&session) {
                    let _ = writer.send(message);
                }
            }
            ElementAction::Close { session } => {
                // Dropping the writer ends the session task once the refusal is out.
                writers.remove(&session);
            }
            ElementAction::EnsureVolumes { session, specs } => {
                let (store, inputs) = (store.clone(), inputs.clone());
                tokio::task::spawn_blocking(move || {
                    let mut storage = &*store;
                    let result = ElementStorage::check_new_volumes(&storage, &specs).and_then(|()| {
                        specs
                            .iter()
                            .map(|spec| {
                                let volume = ElementStorage::ensure_volume(&mut storage, spec)?;
                                Ok((volume, ElementStorage::info(&storage, volume)))
                            })
                            .collect::<Result<Vec<_>, String>>()
                    });
                    let _ = inputs.blocking_send(Input::VolumesEnsured { session, result });
                });
            }
            ElementAction::CheckVolumes { session, request_id, specs } => {
                let (store, inputs) = (store.clone(), inputs.clone());
                tokio::task::spawn_blocking(move || {
                    let result = ElementStorage::check_new_volumes(&&*store, &specs);
                    let _ = inputs.blocking_send(Input::VolumesChecked { session, request_id, result });
                });
            }
            // The core has one storage job out at a time, so the committer is idle now and
            // running this one here keeps the order.
            ElementAction::Storage(job) if runs_on_actor(store, &job) => {
                let done = run_job(store, job);
                core.handle_storage_done(now, done);
                for damaged in ElementStorage::take_damaged(&&**store) {
                    core.handle_volume_damaged(now, damaged);
                }
                if store.failed_for_space() {
                    let _ = storage.out_of_space.send(true);
                }
            }
            ElementAction::Storage(job) => {
                storage.jobs.send(job).expect("the committer thread outlives the actor");
            }
            ElementAction::Serve { session, volume, request } => {
                let Some(writer) = writers.get(&session) else { continue };
                // A read of up to 2 MiB of data in memory is answered here: handing it to a
                // blocking thread and back costs more than the read (docs/benchmarks.md).
                if let Some(reply) = starfish_core::try_serve(&&**store, volume, &request) {
                    // Only a failed read (a block failing its checksum) can have found damage.
                    let failed = matches!(&reply, ElementMessage::ReadReply { result: Err(_), .. });
                    let _ = writer.send(reply);
                    if failed {
                        for damaged in ElementStorage::take_damaged(&&**store) {
                            core.handle_volume_damaged(now, damaged);
                        }
                    }
                    continue;
                }
                let (writer, store, inputs) = (writer.clone(), store.clone(), inputs.clone());
                tokio::task::spawn_blocking(move || {
                    let _ = writer.send(starfish_core::serve(&&*store, volume, request));
                    report_damage(&store, &inputs);
                });
            }
            ElementAction::ConnectPeer { peer, address, hello } => {
                let (tx, rx) = mpsc::unbounded_channel();
                let task = tokio::spawn(run_peer(peer, address, hello, rx, inputs.clone(), peers.tls.clone()));
                peers.links.insert(peer, (tx, task));
            }
            ElementAction::SendPeer { peer, message } => {
                if let Some((tx, _)) = peers.links.get(&peer) {
                    let _ = tx.send(message);
                }
            }
            ElementAction::ClosePeer { peer } => {
                if let Some((_, task)) = peers.links.remove(&peer) {
                    task.abort();
                }
            }
            ElementAction::StartCopy {
                session,
                session_volume,
                volume,
                spec,
                epoch,
                host,
                source,
                rate_bytes_per_s,
            } => {
                let Some(writer) = writers.get(&session).cloned() else {
                    // The session is gone already: the copy does not run.
                    let info = store.volume_info(store.handle_of(volume));
                    let result = Err("the host element's session ended".to_string());
                    core.handle_copy_done(now, volume, session_volume, info, result);
                    continue;
                };
                let job = crate::copy::CopyJob {
                    volume: session_volume,
                    spec,
                    epoch,
                    host,
                    handle: store.handle_of(volume),
                    source,
                    rate_bytes_per_s,
                    tls: peers.tls.clone(),
                };
                let (store, inputs) = (store.clone(), inputs.clone());
                tokio::spawn(async move {
                    let (reports, mut report_rx) = mpsc::unbounded_channel();
                    let copy = tokio::spawn(crate::copy::copy_from_peer(job, store.clone(), writer, reports));
                    while let Some(message) = report_rx.recv().await {
                        let input = match message {
                            ElementMessage::CopyDone { volume: session_volume, result } => {
                                let info = store.volume_info(store.handle_of(volume));
                                Input::CopyDone { volume, session_volume, info, result }
                            }
                            message => Input::CopyProgress { volume, message },
                        };
                        if inputs.send(input).await.is_err() {
                            break;
                        }
                    }
                    let _ = copy.await;
                });
            }
            // The reason went out as a `Fault` and into the log; nothing else to do here.
            ElementAction::Refused { .. } => {}
            // The epoch the element follows names every line of its core.
            ElementAction::Log { level: LogLevel::Info, message } => tracing::info!(epoch = %core.epoch(), "{message}"),
            ElementAction::Log { level: LogLevel::Warn, message } => tracing::warn!(epoch = %core.epoch(), "{message}"),
        }
    }
}

/// A session with a peer element (a replay's source): say hello, then pass messages both ways
/// until the actor closes it or the peer fails.
async fn run_peer(
    peer: PeerId,
    address: String,
    hello: HostMessage,
    mut outgoing: mpsc::UnboundedReceiver<HostMessage>,
    inputs: mpsc::Sender<Input>,
    tls: Option<TlsContext>,
) {
    let reason = async {
        let address: SocketAddr = address.parse().map_err(|e| format!("bad peer address {address}: {e}"))?;
        let mut stream =
            crate::tls::connect_element(address, tls.as_ref(), &[Role::Element], PEER_CONNECT_TIMEOUT, true).await?;
        send_frame(&mut stream, &hello).await?;
        let mut buf = BytesMut::with_capacity(1 << 20);
        loop {
            tokio::select! {
                // No timeout here: the core knows when it asked and how long an answer may take
                // (a paced replay may ask nothing for a long while).
                message = read_frame::<ElementMessage>(&mut stream, &mut buf, None) => {
                    let message = message?;
                    if inputs.send(Input::PeerMessage { peer, message }).await.is_err() {
                        return Err("element stopping".to_string());
                    }
                }
                message = outgoing.recv() => match message {
                    Some(message) => send_frame(&mut stream, &message).await?,
                    None => return Err("closed".to_string()),
                },
            }
        }
    }
    .await;
    let reason: String = match reason {
        Ok(()) => "closed".into(),
        Err(reason) => reason,
    };
    let _ = inputs.send(Input::PeerClosed { peer, reason }).await;
}

/// Queue one frame for a session: a read reply of whole blocks in pieces, its data neither
/// copied nor read again (`proto::encode_block_read_reply`); anything else encoded into `buf`
/// (kept between replies, so that it is not grown again for each).
fn queue_reply(queue: &mut Outgoing, buf: &mut BytesMut, message: &ElementMessage) {
    match proto::encode_block_read_reply(message) {
        Some(parts) => parts.pieces().for_each(|piece| queue.push(piece)),
        None => {
            encode_frame(message, buf);
            queue.push_encoded(buf);
        }
    }
}

async fn serve_session(
    stream: Stream,
    session: SessionId,
    role: SessionRole,
    inputs: mpsc::Sender<Input>,
    receiving: Arc<tokio::sync::Semaphore>,
) -> String {
    let opened = tokio::time::Instant::now();
    let mut low_water = crate::low_water::LowWater::of(&stream);
    let (mut read_half, write_half) = tokio::io::split(stream);
    let (writer, mut reply_rx) = mpsc::unbounded_channel::<ElementMessage>();
    // A peer of another wire version is told why before the session ends (a weak sender: the
    // writer ends when the core drops its sender, as on a refusal).
    let refuse = writer.downgrade();
    if inputs.send(Input::Opened { session, role, writer }).await.is_err() {
        return "element stopping".into();
    }
    let mut writer_task = tokio::spawn(async move {
        let mut out = write_half;
        let mut queue = Outgoing::new();
        let mut buf = BytesMut::new();
        while let Some(message) = reply_rx.recv().await {
            queue_reply(&mut queue, &mut buf, &message);
            while !queue.is_full() {
                let Ok(message) = reply_rx.try_recv() else { break };
                queue_reply(&mut queue, &mut buf, &message);
            }
            // Replies are copied, not lent (`crate::lending`): lent 1 MiB read replies cost the
            // host element more to receive than the copy saved here (docs/benchmarks.md).
            queue.write_to(&mut out, None).await?;
        }
        Ok::<(), std::io::Error>(())
    });
    let mut buf = BytesMut::with_capacity(256 * 1024);
    let mut writer_done = false;
    let mut first_message = true;
    // The large frame being received: its length and its share of `receiving`.
    let mut large: Option<(usize, tokio::sync::OwnedSemaphorePermit)> = None;
    let reason = 'session: loop {
        loop {
            let message = match decode_frame::<HostMessage>(&mut buf) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e @ proto::DecodeError::WireVersion { .. }) => {
                    if let Some(writer) = refuse.upgrade() {
                        let _ = writer.send(ElementMessage::Refused {
                            reason: e.to_string(),
                            epoch: None,
                            owner_absent_ms: 0,
                        });
                    }
                    break 'session e.to_string();
                }
                Err(e) => break 'session format!("bad frame: {e}"),
            };
            first_message = false;
            if inputs.send(Input::Message { session, message }).await.is_err() {
                break 'session "element stopping".to_string();
            }
        }
        // The length of the frame being received, once its header is in.
        let length = (buf.len() >= proto::FRAME_HEADER_BYTES)
            .then(|| u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize);
        // A large frame arriving: count it before reading more of it.
        let arriving = length.filter(|&length| length > LARGE_FRAME_BYTES);
        if large.as_ref().map(|(length, _)| *length) != arriving {
            large = None;
            if let Some(length) = arriving {
                let acquire = receiving.clone().acquire_many_owned(length as u32);
                match tokio::time::timeout(RECEIVING_WAIT_MAX, acquire).await {
                    Ok(Ok(permit)) => large = Some((length, permit)),
                    _ => {
                        break format!("element busy: no room for a {length}-byte frame within {RECEIVING_WAIT_MAX:?}")
                    }
                }
            }
        }
        // A frame whose header is in has room for all of it (`decode_frame` made it, copying its
        // start at most once, and 64 KiB more when the frame outgrew the buffer); between
        // frames, and beside small ones, keep 64 KiB of room.
        if buf.capacity() - buf.len() < 64 * 1024 {
            buf.reserve(256 * 1024);
        }
        low_water.expect(length.map_or(0, |length| (proto::FRAME_HEADER_BYTES + length).saturating_sub(buf.len())));
        // How long the next read may take: the first message comes soon, and a frame that
        // started keeps coming; between frames a session may be idle (a paced replay, say).
        let limit = if first_message {
            Some((FIRST_MESSAGE_TIMEOUT.saturating_sub(opened.elapsed()), "sent no message within the first"))
        } else if !buf.is_empty() {
            Some((FRAME_STALL_TIMEOUT, "stalled in the middle of a frame for"))
        } else {
            None
        };
        let read = async {
            match limit {
                Some((left, _)) => tokio::time::timeout(left, read_half.read_buf(&mut buf)).await.ok(),
                None => Some(read_half.read_buf(&mut buf).await),
            }
        };
        tokio::select! {
            read = read => match read {
                None => {
                    let (_, what) = limit.expect("only a bounded read times out");
                    let bound = if first_message { FIRST_MESSAGE_TIMEOUT } else { FRAME_STALL_TIMEOUT };
                    break format!("{what} {bound:?}");
                }
                Some(Ok(0)) => break "host element closed the connection".to_string(),
                Some(Ok(_)) => {}
                Some(Err(e)) => break format!("read error: {e}"),
            },
            // The core ended the session (a refusal): its writer was dropped and drained.
            _ = &mut writer_task => {
                writer_done = true;
                break "refused".to_string();
            }
        }
    };
    let _ = inputs.send(Input::Closed { session }).await;
    // Let queued replies go out (a finished task must not be awaited again).
    if !writer_done {
        let _ = tokio::time::timeout(Duration::from_millis(200), writer_task).await;
    }
    reason
}

/// Per-volume summary of a stopped element's data directory, for `starfish element verify`.
pub fn verify(data: &std::path::Path) -> Result<Vec<(String, u64, Sequence, String)>, String> {
    let store = Store::open(data, StoreOptions::default()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (name, size_bytes) in store.volumes() {
        let Some(handle) = store.volume(&name).filter(|_| size_bytes > 0) else { continue };
        // Each snapshot after its volume, named VOLUME@ID, with the sequence it was taken at.
        let snapshots: Vec<(String, u64, store::VolumeHandle)> =
            store.snapshots(handle).into_iter().map(|s| (format!("{name}@{}", s.id), s.size_bytes, s.handle)).collect();
        for (name, size_bytes, handle) in [(name, size_bytes, handle)].into_iter().chain(snapshots) {
            let digest = store.verify(handle).map_err(|e| e.to_string())?;
            if digest.blocks_corrupt > 0 {
                return Err(format!(
                    "volume {name}: {} of {} blocks fail their checksum",
                    digest.blocks_corrupt, digest.blocks_total
                ));
            }
            out.push((name, size_bytes, digest.applied_sequence, format!("{:016x}", digest.content_digest)));
        }
    }
    Ok(out)
}

pub(crate) async fn send_frame<M: proto::Body>(
    stream: &mut (impl AsyncWrite + Unpin),
    message: &M,
) -> Result<(), String> {
    let mut buf = BytesMut::new();
    encode_frame(message, &mut buf);
    stream.write_all(&buf).await.map_err(|e| format!("send to peer: {e}"))?;
    // TLS keeps records until flushed (a no-op on plain TCP).
    stream.flush().await.map_err(|e| format!("send to peer: {e}"))
}

/// The next frame from a peer whose answer is awaited: a peer silent for
/// `REPLAY_IDLE_TIMEOUT` has failed.
pub(crate) async fn recv_frame<M: proto::Body>(
    stream: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
) -> Result<M, String> {
    read_frame(stream, buf, Some(REPLAY_IDLE_TIMEOUT)).await
}

/// The next frame, waiting at most `idle` between reads (`None`: as long as it takes; the
/// caller keeps its own time).
async fn read_frame<M: proto::Body>(
    stream: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
    idle: Option<Duration>,
) -> Result<M, String> {
    loop {
        if let Some(message) = decode_frame::<M>(buf).map_err(|e| format!("bad frame from peer: {e}"))? {
            return Ok(message);
        }
        let read = match idle {
            Some(idle) => tokio::time::timeout(idle, stream.read_buf(buf))
                .await
                .map_err(|_| "peer stopped answering".to_string())?,
            None => stream.read_buf(buf).await,
        };
        match read {
            Ok(0) => return Err("peer closed the connection".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("read from peer: {e}")),
        }
    }
}

/// Open a session with a peer element as the host element's epoch would, for one volume (its
/// volume number in that session is 0).
pub(crate) async fn connect_peer(
    source: &str,
    epoch: proto::Epoch,
    host: proto::HostId,
    spec: &proto::VolumeSpec,
    tls: Option<&TlsContext>,
) -> Result<(Stream, BytesMut), String> {
    let address: SocketAddr = source.parse().map_err(|e| format!("bad peer address {source}: {e}"))?;
    let mut stream = crate::tls::connect_element(address, tls, &[Role::Element], PEER_CONNECT_TIMEOUT, true).await?;
    let mut buf = BytesMut::with_capacity(1 << 20);
    send_frame(
        &mut stream,
        &HostMessage::Hello { epoch, host, volumes: vec![spec.clone()], admin: String::new(), receipt_acks: false },
    )
    .await?;
    match recv_frame::<ElementMessage>(&mut stream, &mut buf).await? {
        ElementMessage::Welcome { .. } => Ok((stream, buf)),
        ElementMessage::Refused { reason, .. } => Err(format!("peer refused: {reason}")),
        other => Err(format!("peer answered {other:?} to hello")),
    }
}
