//! Full recovery in the element's shell: the target pulls, chunk by chunk, the blocks that
//! differ from a peer (the source), keeping several chunks in flight so a long fat link stays
//! full, installs them in order, saves a resume cursor every few MiB, and finally adopts the
//! pass's base sequence. The host element then replays (or streams) the writes after it. The
//! reasoning and the durable state are in `store::Store::copy_chunk` and its module.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::{BlockChunk, ElementMessage, Epoch, HostMessage, Sequence, VolumeId, BLOCK_BYTES};
use store::{Store, VolumeHandle};
use tokio::sync::mpsc;

use crate::element::{connect_peer, recv_frame, send_frame};

/// Blocks asked about per request: 1 MiB of volume to begin with; doubled (up to
/// `COPY_CHUNK_BLOCKS_MAX`, 16 MiB) while replies carry little content (holes, blocks equal on
/// both sides), halved again when they carry much.
const CHUNK_BLOCKS_MIN: u64 = 256;
/// Requests in flight at most, and volume bytes they cover at most: at least 16 MiB of content
/// in flight, more than the bandwidth-delay product of a 124 Mbit/s link with a 130 ms round
/// trip (2 MiB), and up to 64 MiB of volume per round trip over never-written space.
const WINDOW_CHUNKS: usize = 16;
const WINDOW_VOLUME_BYTES: u64 = 64 * 1024 * 1024;
/// Save the resume cursor (a checkpoint) after this much installed content, or this long.
const CURSOR_SAVE_BYTES: u64 = 64 * 1024 * 1024;
const CURSOR_SAVE_INTERVAL: Duration = Duration::from_secs(2);
const PROGRESS_INTERVAL: Duration = Duration::from_millis(500);

pub(crate) struct CopyJob {
    pub volume: VolumeId,
    pub spec: proto::VolumeSpec,
    pub epoch: Epoch,
    /// The host element that ordered the copy (the peer's hello carries it).
    pub host: proto::HostId,
    pub handle: VolumeHandle,
    pub source: String,
    pub rate_bytes_per_s: u64,
    /// How to reach the source (mutual TLS, if the cluster uses it).
    pub tls: Option<crate::tls::TlsContext>,
}

/// Run one copy; `session` is the ordering session's writer (the copy stops once it is
/// closed); `replies` takes the progress reports and, last, the `CopyDone`. The element core
/// runs one copy of a volume at a time.
pub(crate) async fn copy_from_peer(
    job: CopyJob,
    store: Arc<Store>,
    session: mpsc::UnboundedSender<ElementMessage>,
    replies: mpsc::UnboundedSender<ElementMessage>,
) {
    let started = Instant::now();
    tracing::info!(source = %job.source, volume = %job.spec.name, "full recovery: copying from peer");
    let result = copy(&job, &store, &session, &replies).await;
    let result = match result {
        Ok((base, copied_bytes)) => {
            let seconds = started.elapsed().as_secs_f64();
            tracing::info!(%base, seconds, copied_bytes, volume = %job.spec.name, "full recovery: copy done");
            let (done_bytes, total_bytes) = (job.spec.size_bytes, job.spec.size_bytes);
            let _ = replies.send(ElementMessage::CopyProgress {
                volume: job.volume,
                done_bytes,
                total_bytes,
                copied_bytes,
            });
            Ok(base)
        }
        Err(reason) => {
            tracing::warn!(%reason, volume = %job.spec.name, "full recovery: copy failed");
            Err(reason)
        }
    };
    let _ = replies.send(ElementMessage::CopyDone { volume: job.volume, result });
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, store::StoreError> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())
}

/// Returns the base adopted and the bytes of block content received.
async fn copy(
    job: &CopyJob,
    store: &Arc<Store>,
    session: &mpsc::UnboundedSender<ElementMessage>,
    replies: &mpsc::UnboundedSender<ElementMessage>,
) -> Result<(Sequence, u64), String> {
    let (mut stream, mut buf) = connect_peer(&job.source, job.epoch, job.host, &job.spec, job.tls.as_ref()).await?;
    let (s, h, epoch) = (store.clone(), job.handle, job.epoch);
    let state = blocking(move || s.begin_copy(h, epoch)).await?;
    let blocks = job.spec.size_bytes / BLOCK_BYTES;
    // The pass's base: the lowest applied sequence any of its chunks was read at. Unset on a
    // fresh pass until the first reply.
    let mut base = (state.cursor_block > 0 || state.base != Sequence::ZERO).then_some((state.base, state.base_epoch));
    let min_applied = base.map_or(Sequence::ZERO, |(b, _)| b);
    if state.cursor_block > 0 {
        tracing::info!(cursor_block = state.cursor_block, blocks, volume = %job.spec.name, "full recovery: resuming an interrupted copy");
    }
    let mut next_request = state.cursor_block;
    let mut installed = state.cursor_block;
    let mut saved = state.cursor_block;
    let mut request_id = 0u64;
    let mut in_flight: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // request id -> (first block, count)
    let mut ready: BTreeMap<u64, (u64, BlockChunk)> = BTreeMap::new(); // first block -> (count, reply)
    let mut chunk_blocks = CHUNK_BLOCKS_MIN;
    let chunk_blocks_max = proto::COPY_CHUNK_BLOCKS_MAX as u64;
    let mut copied_bytes = 0u64;
    let mut unsaved_bytes = 0u64;
    let mut last_save = Instant::now();
    let mut last_progress = Instant::now();
    let pace_started = Instant::now();
    while installed < blocks {
        if session.is_closed() {
            return Err("the host element's session ended".into());
        }
        while in_flight.len() < WINDOW_CHUNKS
            && next_request < blocks
            && (in_flight.is_empty() || (next_request - installed + chunk_blocks) * BLOCK_BYTES <= WINDOW_VOLUME_BYTES)
        {
            let count = chunk_blocks.min(blocks - next_request);
            let have = store.block_summaries(job.handle, next_request, count).map_err(|e| e.to_string())?;
            request_id += 1;
            let request = HostMessage::FetchBlocks {
                request_id,
                volume: VolumeId(0),
                first_block: next_request,
                min_applied,
                have,
                snapshot: None,
            };
            send_frame(&mut stream, &request).await?;
            in_flight.insert(request_id, (next_request, count));
            next_request += count;
        }
        let (id, result) = match recv_frame::<ElementMessage>(&mut stream, &mut buf).await? {
            ElementMessage::Blocks { request_id, result } => (request_id, result),
            ElementMessage::Pong { .. } => continue,
            other => return Err(format!("peer answered {other:?} to a block fetch")),
        };
        let (first, count) =
            in_flight.remove(&id).ok_or_else(|| format!("peer answered request {id}, which was not asked"))?;
        let chunk = result.map_err(|e| format!("peer could not send blocks from {first}: {e}"))?;
        let content_blocks = chunk.blocks.iter().filter(|b| b.content.is_some()).count() as u64;
        if content_blocks * 8 < count {
            chunk_blocks = (chunk_blocks * 2).min(chunk_blocks_max);
        } else if content_blocks * 2 > count {
            chunk_blocks = (chunk_blocks / 2).max(CHUNK_BLOCKS_MIN);
        }
        ready.insert(first, (count, chunk));
        // Install in block order, so that the cursor means "everything before is done".
        while let Some((count, chunk)) = ready.remove(&installed) {
            if let Some(block) = chunk.blocks.iter().find(|b| b.block < installed || b.block >= installed + count) {
                return Err(format!("peer sent block {} for the chunk at {installed}", block.block));
            }
            if !matches!(base, Some((b, _)) if chunk.applied >= b) {
                base = Some((chunk.applied, chunk.applied_epoch));
                let (s, h) = (store.clone(), job.handle);
                let (b, e) = (chunk.applied, chunk.applied_epoch);
                blocking(move || s.set_copy_base(h, b, e)).await?;
            }
            let bytes = chunk.blocks.iter().filter(|b| b.content.is_some()).count() as u64 * BLOCK_BYTES;
            copied_bytes += bytes;
            unsaved_bytes += bytes;
            if !chunk.blocks.is_empty() {
                let (s, h) = (store.clone(), job.handle);
                blocking(move || s.install_blocks(h, &chunk.blocks)).await?;
            }
            installed += count;
            if unsaved_bytes >= CURSOR_SAVE_BYTES || (last_save.elapsed() >= CURSOR_SAVE_INTERVAL && installed > saved)
            {
                let (s, h, cursor) = (store.clone(), job.handle, installed);
                blocking(move || s.save_copy_cursor(h, cursor)).await?;
                saved = installed;
                unsaved_bytes = 0;
                last_save = Instant::now();
            }
        }
        if last_progress.elapsed() >= PROGRESS_INTERVAL {
            last_progress = Instant::now();
            let _ = replies.send(ElementMessage::CopyProgress {
                volume: job.volume,
                done_bytes: installed * BLOCK_BYTES,
                total_bytes: job.spec.size_bytes,
                copied_bytes,
            });
        }
        if job.rate_bytes_per_s > 0 {
            let due = Duration::from_secs_f64(copied_bytes as f64 / job.rate_bytes_per_s as f64);
            if let Some(wait) = due.checked_sub(pace_started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    // The source's snapshots taken at or before the base: copied whole (one taken after it
    // comes with the records after the base, one deleted after it is deleted by them).
    let base = base.map_or(Sequence::ZERO, |(b, _)| b);
    request_id += 1;
    let list = HostMessage::FetchBlocks {
        request_id,
        volume: VolumeId(0),
        first_block: blocks,
        min_applied: base,
        have: Vec::new(),
        snapshot: None,
    };
    send_frame(&mut stream, &list).await?;
    let listed = receive_chunk(&mut stream, &mut buf, request_id).await?.snapshots;
    for snapshot in listed.into_iter().filter(|s| s.taken_at <= base) {
        copied_bytes += copy_snapshot(job, store, &mut stream, &mut buf, &mut request_id, snapshot).await?;
    }
    let (s, h) = (store.clone(), job.handle);
    // Its checkpoint makes the installed blocks durable before the copy state goes.
    let base = blocking(move || s.finish_copy(h)).await?;
    Ok((base, copied_bytes))
}

/// The answer to request `request_id` (pings skipped).
async fn receive_chunk(
    stream: &mut crate::tls::Stream,
    buf: &mut bytes::BytesMut,
    request_id: u64,
) -> Result<BlockChunk, String> {
    loop {
        match recv_frame::<ElementMessage>(stream, buf).await? {
            ElementMessage::Blocks { request_id: id, result } if id == request_id => {
                return result.map_err(|e| format!("peer could not send blocks: {e}"))
            }
            ElementMessage::Pong { .. } => continue,
            other => return Err(format!("peer answered {other:?} to a block fetch")),
        }
    }
}

/// Copy one snapshot of the source whole (see `Store::begin_snapshot_copy`), a chunk at a
/// time; the bytes of content it brought.
async fn copy_snapshot(
    job: &CopyJob,
    store: &Arc<Store>,
    stream: &mut crate::tls::Stream,
    buf: &mut bytes::BytesMut,
    request_id: &mut u64,
    snapshot: proto::SnapshotSummary,
) -> Result<u64, String> {
    let (s, h) = (store.clone(), job.handle);
    let (id, taken_at, size_bytes) = (snapshot.id, snapshot.taken_at, snapshot.size_bytes);
    let handle = blocking(move || s.begin_snapshot_copy(h, id, taken_at, size_bytes)).await?;
    let blocks = size_bytes / BLOCK_BYTES;
    let mut copied = 0;
    let mut first = 0;
    while first < blocks {
        let count = (blocks - first).min(proto::COPY_CHUNK_BLOCKS_MAX as u64);
        let have = store.block_summaries(handle, first, count).map_err(|e| e.to_string())?;
        *request_id += 1;
        let fetch = HostMessage::FetchBlocks {
            request_id: *request_id,
            volume: VolumeId(0),
            first_block: first,
            min_applied: taken_at,
            have,
            snapshot: Some(id),
        };
        send_frame(stream, &fetch).await?;
        let chunk = receive_chunk(stream, buf, *request_id).await?;
        if let Some(block) = chunk.blocks.iter().find(|b| b.block < first || b.block >= first + count) {
            return Err(format!("peer sent block {} of snapshot {id} for the chunk at {first}", block.block));
        }
        copied += chunk.blocks.iter().filter(|b| b.content.is_some()).count() as u64 * BLOCK_BYTES;
        let s = store.clone();
        blocking(move || s.install_blocks(handle, &chunk.blocks)).await?;
        first += count;
    }
    let s = store.clone();
    blocking(move || s.finish_snapshot_copy(handle)).await?;
    tracing::info!(volume = %job.spec.name, snapshot = id, %taken_at, copied, "full recovery: snapshot copied");
    Ok(copied)
}
