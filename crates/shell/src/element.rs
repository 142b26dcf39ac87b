//! The element's shell: a TCP server in front of the durable [`store::Store`].
//!
//! Writes from every session go to one committer thread that group-commits them (one
//! fdatasync per batch) and only then sends `Applied`: an acknowledgement can never precede
//! durability. Reads, block status and replay-log fetches run on the blocking pool,
//! concurrently with commits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::BytesMut;
use proto::{decode_frame, encode_frame, ElementMessage, HostMessage, Record, Sequence, VolumeId, VolumeState};
use store::{Store, StoreOptions, VolumeHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Records taken into one group commit at most (and their payload bytes).
const COMMIT_BATCH_RECORDS_MAX: usize = 1024;
const COMMIT_BATCH_BYTES_MAX: u64 = 64 * 1024 * 1024;

#[derive(Clone, Debug)]
pub struct ElementOptions {
    pub listen: SocketAddr,
    pub data: PathBuf,
    pub store: StoreOptions,
}

/// Work for the committer thread, in arrival order.
enum Job {
    Commit(CommitRequest),
    /// A host element session starts: adopt its epoch durably and report what is applied. As
    /// a job it is ordered after every record queued before it, and records of older
    /// sessions queued after it are fenced: the host element never sees a stale position.
    Hello {
        epoch: proto::Epoch,
        handles: Vec<VolumeHandle>,
        reply: tokio::sync::oneshot::Sender<Result<(proto::Epoch, Vec<VolumeState>), String>>,
    },
}

struct CommitRequest {
    /// Epoch of the session that sent it: refused once a newer host element has said hello.
    session_epoch: proto::Epoch,
    record: Record,
    handle: VolumeHandle,
    /// The session's own volume number, to address its acknowledgement.
    session_volume: VolumeId,
    reply: mpsc::UnboundedSender<ElementMessage>,
}

/// Open the store, start the committer and serve sessions until `shutdown` completes; then
/// checkpoint, so the next start has no log to replay.
pub async fn run(options: ElementOptions, shutdown: impl std::future::Future<Output = ()>) -> std::io::Result<()> {
    let data = options.data.clone();
    let store = tokio::task::spawn_blocking(move || Store::open(&data, options.store))
        .await
        .map_err(std::io::Error::other)?
        .map_err(|e| std::io::Error::other(format!("cannot open data directory: {e}")))?;
    let store = Arc::new(store);
    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", options.listen)))?;
    let (commits, commit_rx) = std::sync::mpsc::channel::<Job>();
    {
        let store = store.clone();
        std::thread::Builder::new().name("committer".into()).spawn(move || run_committer(&store, commit_rx))?;
    }
    tracing::info!(listen = %options.listen, data = %options.data.display(), epoch = %store.epoch(), "element serving");
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => accepted?,
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let store = store.clone();
        let commits = commits.clone();
        tokio::spawn(async move {
            let reason = serve_session(stream, store, commits).await;
            tracing::info!(%peer, %reason, "session ended");
        });
    }
    tracing::info!("element stopping: checkpoint");
    tokio::task::spawn_blocking(move || store.checkpoint())
        .await
        .map_err(std::io::Error::other)?
        .map_err(|e| std::io::Error::other(format!("checkpoint at shutdown: {e}")))
}

fn run_committer(store: &Store, jobs: std::sync::mpsc::Receiver<Job>) {
    let mut batch: Vec<CommitRequest> = Vec::with_capacity(COMMIT_BATCH_RECORDS_MAX);
    let mut next: Option<Job> = None;
    loop {
        let Some(first) = next.take().or_else(|| jobs.recv().ok()) else { return };
        let first = match first {
            Job::Hello { epoch, handles, reply } => {
                let _ = reply.send(hello(store, epoch, &handles));
                continue;
            }
            Job::Commit(request) => request,
        };
        let mut bytes = first.record.op.payload_bytes();
        batch.push(first);
        while batch.len() < COMMIT_BATCH_RECORDS_MAX && bytes < COMMIT_BATCH_BYTES_MAX {
            match jobs.try_recv() {
                Ok(Job::Commit(request)) => {
                    bytes += request.record.op.payload_bytes();
                    batch.push(request);
                }
                Ok(hello) => {
                    next = Some(hello);
                    break;
                }
                Err(_) => break,
            }
        }
        commit_batch(store, &mut batch);
        batch.clear();
    }
}

fn hello(
    store: &Store,
    epoch: proto::Epoch,
    handles: &[VolumeHandle],
) -> Result<(proto::Epoch, Vec<VolumeState>), String> {
    let previous = store.epoch();
    if epoch < previous {
        return Err(format!("stale epoch {epoch}: this element already follows epoch {previous}"));
    }
    if epoch > previous {
        store.set_epoch(epoch).map_err(|e| e.to_string())?;
    }
    let states = handles
        .iter()
        .map(|&h| match store.copy_state(h) {
            // An interrupted full recovery: nothing consistent to report.
            Some(_) => VolumeState { applied_sequence: Sequence::ZERO, applied_epoch: proto::Epoch(0), copying: true },
            None => VolumeState {
                applied_sequence: store.applied_sequence(h),
                applied_epoch: store.applied_epoch(h),
                copying: false,
            },
        })
        .collect();
    Ok((previous, states))
}

fn commit_batch(store: &Store, batch: &mut Vec<CommitRequest>) {
    let current = store.epoch();
    batch.retain(|r| {
        if r.session_epoch >= current {
            return true;
        }
        let reason = format!("fenced: a host element of epoch {current} superseded epoch {}", r.session_epoch);
        let _ = r.reply.send(ElementMessage::Fault { reason });
        false
    });
    if batch.is_empty() {
        return;
    }
    let records: Vec<(VolumeHandle, Record)> = batch.iter().map(|r| (r.handle, r.record.clone())).collect();
    match store.commit(&records) {
        Ok(outcome) => {
            // A refused record (gap, stale epoch, damaged base block) ends its session: the
            // host element marks this element failed with the reason.
            for rejected in &outcome.rejected {
                let r = &batch[rejected.index];
                tracing::warn!(sequence = %r.record.sequence, error = %rejected.error, "record refused");
                let _ = r.reply.send(ElementMessage::Fault { reason: rejected.error.to_string() });
            }
            // One cumulative acknowledgement per (session, volume).
            let mut acked: Vec<(usize, VolumeId, VolumeHandle)> = Vec::new();
            for (i, r) in batch.iter().enumerate() {
                if !acked.iter().any(|(j, v, _)| batch[*j].reply.same_channel(&r.reply) && *v == r.session_volume) {
                    acked.push((i, r.session_volume, r.handle));
                }
            }
            for (i, volume, handle) in acked {
                let sequence = store.applied_sequence(handle);
                let _ = batch[i].reply.send(ElementMessage::Applied { volume, sequence });
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "commit failed");
            for r in batch.iter() {
                let _ = r.reply.send(ElementMessage::Fault { reason: format!("commit failed: {e}") });
            }
        }
    }
}

async fn serve_session(stream: TcpStream, store: Arc<Store>, commits: std::sync::mpsc::Sender<Job>) -> String {
    let (mut read_half, write_half) = stream.into_split();
    let (replies, mut reply_rx) = mpsc::unbounded_channel::<ElementMessage>();
    let writer = tokio::spawn(async move {
        let mut out = BufWriter::with_capacity(256 * 1024, write_half);
        let mut buf = BytesMut::new();
        while let Some(message) = reply_rx.recv().await {
            buf.clear();
            encode_frame(&message, &mut buf);
            out.write_all(&buf).await?;
            while let Ok(message) = reply_rx.try_recv() {
                buf.clear();
                encode_frame(&message, &mut buf);
                out.write_all(&buf).await?;
            }
            out.flush().await?;
        }
        Ok::<(), std::io::Error>(())
    });
    let mut volumes: Option<Session> = None;
    let mut buf = BytesMut::with_capacity(256 * 1024);
    let reason = 'session: loop {
        loop {
            let message = match decode_frame::<HostMessage>(&mut buf) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => break 'session format!("bad frame: {e}"),
            };
            if let Err(reason) = handle(message, &store, &mut volumes, &replies, &commits).await {
                let _ = replies.send(ElementMessage::Refused { reason: reason.clone() });
                break 'session reason;
            }
        }
        if buf.capacity() - buf.len() < 64 * 1024 {
            buf.reserve(256 * 1024);
        }
        match read_half.read_buf(&mut buf).await {
            Ok(0) => break "host element closed the connection".to_string(),
            Ok(_) => {}
            Err(e) => break format!("read error: {e}"),
        }
    };
    drop(replies);
    // Let queued replies (a refusal) go out; the committer holds its own senders.
    let _ = tokio::time::timeout(std::time::Duration::from_millis(200), writer).await;
    reason
}

/// What a session learned from its Hello.
struct Session {
    epoch: proto::Epoch,
    specs: Vec<proto::VolumeSpec>,
    handles: Vec<VolumeHandle>,
}

fn handle_of(session: &Option<Session>, volume: VolumeId) -> Result<VolumeHandle, String> {
    let session = session.as_ref().ok_or("protocol: request before hello")?;
    session.handles.get(volume.0 as usize).copied().ok_or_else(|| format!("protocol: unknown volume {volume}"))
}

async fn handle(
    message: HostMessage,
    store: &Arc<Store>,
    volumes: &mut Option<Session>,
    replies: &mpsc::UnboundedSender<ElementMessage>,
    commits: &std::sync::mpsc::Sender<Job>,
) -> Result<(), String> {
    match message {
        HostMessage::Hello { epoch, volumes: specs } => {
            if volumes.is_some() {
                return Err("protocol: second hello".into());
            }
            let store2 = store.clone();
            let specs2 = specs.clone();
            let handles = tokio::task::spawn_blocking(move || {
                specs2
                    .iter()
                    .map(|spec| store2.ensure_volume(&spec.name, spec.size_bytes).map_err(|e| e.to_string()))
                    .collect::<Result<Vec<_>, String>>()
            })
            .await
            .map_err(|e| e.to_string())??;
            let (reply, answer) = tokio::sync::oneshot::channel();
            commits
                .send(Job::Hello { epoch, handles: handles.clone(), reply })
                .map_err(|_| "committer stopped".to_string())?;
            let (ours, states) = answer.await.map_err(|_| "committer stopped".to_string())??;
            *volumes = Some(Session { epoch, specs, handles });
            let _ = replies.send(ElementMessage::Welcome { epoch: ours, volumes: states });
        }
        HostMessage::Apply(record) => {
            let handle = handle_of(volumes, record.volume)?;
            let session_volume = record.volume;
            let session_epoch = volumes.as_ref().expect("checked by handle_of").epoch;
            commits
                .send(Job::Commit(CommitRequest {
                    session_epoch,
                    record,
                    handle,
                    session_volume,
                    reply: replies.clone(),
                }))
                .map_err(|_| "committer stopped".to_string())?;
        }
        HostMessage::Read { request_id, volume, offset_bytes, length_bytes } => {
            let handle = handle_of(volumes, volume)?;
            let (store, replies) = (store.clone(), replies.clone());
            tokio::task::spawn_blocking(move || {
                let (applied_sequence, result) = match store.read(handle, offset_bytes, length_bytes) {
                    Ok((sequence, data)) => (sequence, Ok(data)),
                    Err(e) => (store.applied_sequence(handle), Err(e.to_string())),
                };
                let _ = replies.send(ElementMessage::ReadReply { request_id, applied_sequence, result });
            });
        }
        HostMessage::BlockStatus { request_id, volume, offset_bytes, length_bytes } => {
            let handle = handle_of(volumes, volume)?;
            let (store, replies) = (store.clone(), replies.clone());
            tokio::task::spawn_blocking(move || {
                let (applied_sequence, result) = match store.block_status(handle, offset_bytes, length_bytes) {
                    Ok((sequence, extents)) => (sequence, Ok(extents)),
                    Err(e) => (store.applied_sequence(handle), Err(e.to_string())),
                };
                let _ = replies.send(ElementMessage::BlockStatusReply { request_id, applied_sequence, result });
            });
        }
        HostMessage::FetchLog { request_id, volume, after, max_bytes } => {
            let handle = handle_of(volumes, volume)?;
            let (store, replies) = (store.clone(), replies.clone());
            tokio::task::spawn_blocking(move || {
                // Bounded so that the reply always fits one frame, whatever was asked.
                let result = store
                    .log_records(handle, after, max_bytes.min(LOG_REPLY_BYTES_MAX))
                    .map(|records| records.into_iter().map(|r| Record { volume, ..r }).collect::<Vec<_>>())
                    .map_err(|e| e.to_string());
                let _ = replies.send(ElementMessage::LogRecords { request_id, result });
            });
        }
        HostMessage::Recover { volume, source, after, through, rate_bytes_per_s } => {
            let handle = handle_of(volumes, volume)?;
            let session = volumes.as_ref().expect("checked by handle_of");
            let job = ReplayJob {
                volume,
                spec: session.specs[volume.0 as usize].clone(),
                epoch: session.epoch,
                handle,
                source,
                after,
                through,
                rate_bytes_per_s,
            };
            tokio::spawn(replay_from_peer(job, store.clone(), commits.clone(), replies.clone()));
        }
        HostMessage::Copy { volume, source, rate_bytes_per_s } => {
            let handle = handle_of(volumes, volume)?;
            let session = volumes.as_ref().expect("checked by handle_of");
            let job = crate::copy::CopyJob {
                volume,
                spec: session.specs[volume.0 as usize].clone(),
                epoch: session.epoch,
                handle,
                source,
                rate_bytes_per_s,
            };
            tokio::spawn(crate::copy::copy_from_peer(job, store.clone(), replies.clone()));
        }
        HostMessage::FetchBlocks { request_id, volume, first_block, min_applied, have } => {
            let handle = handle_of(volumes, volume)?;
            let (store, replies) = (store.clone(), replies.clone());
            tokio::task::spawn_blocking(move || {
                let result = crate::copy::serve_chunk(&store, handle, first_block, min_applied, &have);
                let _ = replies.send(ElementMessage::Blocks { request_id, result });
            });
        }
        HostMessage::Ping { nonce } => {
            let _ = replies.send(ElementMessage::Pong { nonce });
        }
    }
    Ok(())
}

/// Per-volume summary of a stopped element's data directory, for `starfish element verify`.
pub fn verify(data: &std::path::Path) -> Result<Vec<(String, u64, Sequence, String)>, String> {
    let store = Store::open(data, StoreOptions::default()).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (name, size_bytes) in store.volumes() {
        let handle = store.ensure_volume(&name, size_bytes).map_err(|e| e.to_string())?;
        let digest = store.verify(handle).map_err(|e| e.to_string())?;
        if digest.blocks_corrupt > 0 {
            return Err(format!(
                "volume {name}: {} of {} blocks fail their checksum",
                digest.blocks_corrupt, digest.blocks_total
            ));
        }
        out.push((name, size_bytes, digest.applied_sequence, format!("{:016x}", digest.content_digest)));
    }
    Ok(out)
}

/// Replay recovery ordered by the host element: records pulled from a peer's replay log.
struct ReplayJob {
    volume: VolumeId,
    spec: proto::VolumeSpec,
    epoch: proto::Epoch,
    handle: VolumeHandle,
    source: String,
    after: Sequence,
    through: Sequence,
    rate_bytes_per_s: u64,
}

/// Payload bytes in one `LogRecords` reply at most (beyond a single larger record), so the
/// frame stays within `FRAME_BODY_BYTES_MAX` with the per-record overhead of small records.
const LOG_REPLY_BYTES_MAX: u64 = proto::PAYLOAD_BYTES_MAX as u64 / 2;

/// Payload bytes asked of the peer per fetch: one fetch is in flight at a time, so each costs
/// an idle round trip; 16 MiB keeps a 124 Mbit/s link with a 130 ms round trip about 90 % busy.
const REPLAY_FETCH_BYTES: u64 = LOG_REPLY_BYTES_MAX;
/// A peer that has had nothing new for this long while we wait for `through` has failed us.
pub(crate) const REPLAY_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

async fn replay_from_peer(
    job: ReplayJob,
    store: Arc<Store>,
    commits: std::sync::mpsc::Sender<Job>,
    replies: mpsc::UnboundedSender<ElementMessage>,
) {
    let started = std::time::Instant::now();
    tracing::info!(source = %job.source, after = %job.after, through = %job.through, volume = %job.spec.name, "replay recovery: pulling from peer");
    let result = pull_from_peer(&job, &store, &commits, &replies).await;
    match &result {
        Ok(reached) => tracing::info!(%reached, seconds = started.elapsed().as_secs_f64(), "replay recovery: pulled"),
        Err(reason) => tracing::warn!(%reason, "replay recovery failed"),
    }
    let _ = replies.send(ElementMessage::RecoveryDone { volume: job.volume, result });
}

pub(crate) async fn send_frame<M: proto::Body>(stream: &mut TcpStream, message: &M) -> Result<(), String> {
    let mut buf = BytesMut::new();
    encode_frame(message, &mut buf);
    stream.write_all(&buf).await.map_err(|e| format!("send to peer: {e}"))
}

pub(crate) async fn recv_frame<M: proto::Body>(stream: &mut TcpStream, buf: &mut BytesMut) -> Result<M, String> {
    loop {
        if let Some(message) = decode_frame::<M>(buf).map_err(|e| format!("bad frame from peer: {e}"))? {
            return Ok(message);
        }
        let read = tokio::time::timeout(REPLAY_IDLE_TIMEOUT, stream.read_buf(buf))
            .await
            .map_err(|_| "peer stopped answering".to_string())?;
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
    spec: &proto::VolumeSpec,
) -> Result<(TcpStream, BytesMut), String> {
    let address: SocketAddr = source.parse().map_err(|e| format!("bad peer address {source}: {e}"))?;
    let mut stream = tokio::time::timeout(std::time::Duration::from_secs(5), TcpStream::connect(address))
        .await
        .map_err(|_| format!("connecting to {address} timed out"))?
        .map_err(|e| format!("cannot connect to {address}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let mut buf = BytesMut::with_capacity(1 << 20);
    send_frame(&mut stream, &HostMessage::Hello { epoch, volumes: vec![spec.clone()] }).await?;
    match recv_frame::<ElementMessage>(&mut stream, &mut buf).await? {
        ElementMessage::Welcome { .. } => Ok((stream, buf)),
        ElementMessage::Refused { reason } => Err(format!("peer refused: {reason}")),
        other => Err(format!("peer answered {other:?} to hello")),
    }
}

async fn pull_from_peer(
    job: &ReplayJob,
    store: &Arc<Store>,
    commits: &std::sync::mpsc::Sender<Job>,
    replies: &mpsc::UnboundedSender<ElementMessage>,
) -> Result<Sequence, String> {
    let (mut stream, mut buf) = connect_peer(&job.source, job.epoch, &job.spec).await?;
    // First make sure our newest record is the peer's record at that sequence: a replay onto
    // a diverged history would make a wrong replica look in sync.
    let own = store.applied_sequence(job.handle);
    if own != Sequence::ZERO {
        let own_epoch = store.applied_epoch(job.handle);
        let probe =
            HostMessage::FetchLog { request_id: 0, volume: VolumeId(0), after: Sequence(own.0 - 1), max_bytes: 1 };
        send_frame(&mut stream, &probe).await?;
        let theirs = match recv_frame::<ElementMessage>(&mut stream, &mut buf).await? {
            ElementMessage::LogRecords { result: Ok(records), .. } => {
                records.first().filter(|r| r.sequence == own).map(|r| r.epoch)
            }
            ElementMessage::LogRecords { result: Err(e), .. } => {
                return Err(format!(
                    "cannot check sequence {own} against the peer's replay log ({e}); needs full recovery"
                ))
            }
            other => return Err(format!("peer answered {other:?} to a log fetch")),
        };
        match theirs {
            Some(epoch) if epoch == own_epoch => {}
            Some(epoch) => {
                return Err(format!(
                    "diverged: sequence {own} is from epoch {own_epoch} here and from epoch {epoch} on the peer; needs full recovery"
                ))
            }
            None => return Err(format!("the peer's replay log does not hold sequence {own} to check it; needs full recovery")),
        }
    }
    let started = std::time::Instant::now();
    let mut bytes = 0u64;
    let mut cursor = job.after.max(own);
    let mut previous_batch_end = cursor;
    let mut idle_since: Option<std::time::Instant> = None;
    let mut request_id = 0u64;
    while cursor < job.through {
        if replies.is_closed() {
            return Err("the host element's session ended".into());
        }
        // Keep at most about two fetches in the committer.
        while store.applied_sequence(job.handle) < previous_batch_end {
            if replies.is_closed() {
                return Err("the host element's session ended".into());
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        request_id += 1;
        let fetch =
            HostMessage::FetchLog { request_id, volume: VolumeId(0), after: cursor, max_bytes: REPLAY_FETCH_BYTES };
        send_frame(&mut stream, &fetch).await?;
        let records = loop {
            match recv_frame::<ElementMessage>(&mut stream, &mut buf).await? {
                ElementMessage::LogRecords { request_id: id, result } if id == request_id => {
                    break result.map_err(|e| format!("peer's replay log: {e}"))?
                }
                ElementMessage::Pong { .. } => continue,
                other => return Err(format!("peer answered {other:?} to a log fetch")),
            }
        };
        if records.is_empty() {
            // The peer itself has not applied up to `through` yet.
            let since = *idle_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > REPLAY_IDLE_TIMEOUT {
                return Err(format!("peer has had nothing after sequence {cursor} for {REPLAY_IDLE_TIMEOUT:?}"));
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        }
        idle_since = None;
        previous_batch_end = cursor;
        for record in records {
            if record.sequence != cursor.next() {
                return Err(format!("peer sent sequence {} after {cursor}", record.sequence));
            }
            cursor = record.sequence;
            bytes += record.op.payload_bytes();
            let record = Record { volume: job.volume, ..record };
            commits
                .send(Job::Commit(CommitRequest {
                    session_epoch: job.epoch,
                    record,
                    handle: job.handle,
                    session_volume: job.volume,
                    reply: replies.clone(),
                }))
                .map_err(|_| "committer stopped".to_string())?;
        }
        if job.rate_bytes_per_s > 0 {
            let due = std::time::Duration::from_secs_f64(bytes as f64 / job.rate_bytes_per_s as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    // Report only what is durable here (its acknowledgement precedes this answer or races it).
    while store.applied_sequence(job.handle) < cursor {
        if replies.is_closed() {
            return Err("the host element's session ended".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    Ok(cursor)
}
