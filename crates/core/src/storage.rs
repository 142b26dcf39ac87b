//! What the element core asks of storage, as a trait: `store::Store` implements it over files
//! (through `&Store`), and the simulator implements it in memory with a live and a durable
//! image (`crates/sim/src/storage.rs`). [`serve`] answers the read-only requests the core hands
//! out as `ElementAction::Serve`, the same way over either.

use proto::{
    BlockChunk, BlockExtent, BlockSummary, ElementMessage, Epoch, HostId, HostMessage, ReadData, Record, Sequence,
    VolumeSpec,
};

use crate::element::{CommitDone, LocalVolume, VolumeInfo};
use crate::limits::LOG_REPLY_BYTES_MAX;

/// An element's storage. Failures are reasons (the element's session gets them as a fault or
/// an error reply). Changes are durable when the call returns; an implementation that models
/// time (the simulator) reports the job to the core only once it is.
pub trait ElementStorage {
    /// The epoch storage follows (raised by adopting one, and by committing newer records).
    fn epoch(&self) -> Epoch;
    /// The host element `epoch` belongs to (`HostId(0)`: not known).
    fn epoch_holder(&self) -> HostId;
    /// Make `epoch`, held by `host`, the element's epoch, durably.
    fn adopt_epoch(&mut self, epoch: Epoch, host: HostId) -> Result<(), String>;
    /// Whether the volumes of a hello that are new here fit (memory, disk), before any of them
    /// is created: a volume too large for the element is refused with a reason, and the
    /// volumes it already holds are untouched.
    fn check_new_volumes(&self, specs: &[VolumeSpec]) -> Result<(), String>;
    /// The volume named in `spec`, created if new (local volumes are numbered densely).
    fn ensure_volume(&mut self, spec: &VolumeSpec) -> Result<LocalVolume, String>;
    fn info(&self, volume: LocalVolume) -> VolumeInfo;
    /// Remove the volume durably and free its space; its local number stays taken (by
    /// nothing) until storage is reopened. Every later request for it fails.
    fn remove_volume(&mut self, volume: LocalVolume) -> Result<(), String>;
    /// Grow the volume to `size_bytes` durably (its new blocks read as zeroes); the same size
    /// does nothing, a smaller one is refused. A grow that does not fit (memory, disk) is
    /// refused and changes nothing.
    fn resize_volume(&mut self, volume: LocalVolume, size_bytes: u64) -> Result<(), String>;
    /// Log the records with one sync, then apply them in order; refused records are listed in
    /// the outcome and change nothing. `Err`: storage failed and takes no more changes.
    fn commit(&mut self, batch: &[(LocalVolume, Record)]) -> Result<CommitDone, String>;
    /// Read with the applied sequence the data reflects and the data's piece checksums (the
    /// stored ones for whole blocks, [`proto::pieces`]); a block that fails its checksum is an
    /// error, never data.
    fn read(&self, volume: LocalVolume, offset_bytes: u64, length_bytes: u32) -> Result<(Sequence, ReadData), String>;
    /// As `read`, but only if it can be done without waiting for a disk (`None`: do not know,
    /// or it would wait). Storage that cannot tell leaves it at `None`.
    fn try_read(
        &self,
        _volume: LocalVolume,
        _offset_bytes: u64,
        _length_bytes: u32,
    ) -> Option<Result<(Sequence, ReadData), String>> {
        None
    }
    fn block_status(
        &self,
        volume: LocalVolume,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(Sequence, Vec<BlockExtent>), String>;
    /// Replay-log records after `after`: at least one, then up to `max_bytes`.
    fn log_records(&self, volume: LocalVolume, after: Sequence, max_bytes: u64) -> Result<Vec<Record>, String>;
    /// Volumes that became repairs (a block failed its checksum in a read, a commit or a copy)
    /// since the last call: the element core must learn of them.
    fn take_damaged(&self) -> Vec<LocalVolume>;
    /// A full recovery's chunk: the blocks from `first_block` that differ from `have`.
    fn copy_chunk(&self, volume: LocalVolume, first_block: u64, have: &[BlockSummary]) -> Result<BlockChunk, String>;
    /// A scrub's chunk: read `count` blocks from `first_block` (fewer past the volume's end),
    /// check each against its stored checksum, and summarise them, with the applied sequence
    /// they reflect. A block that fails its checksum is an error and makes the volume a repair.
    fn scrub_chunk(
        &self,
        volume: LocalVolume,
        first_block: u64,
        count: u32,
    ) -> Result<(Sequence, Vec<BlockSummary>), String>;
    /// Snapshot `id` of the volume (read-only, numbered among local volumes), if storage holds
    /// it: taken by an `Op::Snapshot` record, deleted by an `Op::SnapshotDelete` one.
    fn snapshot(&self, volume: LocalVolume, id: u64) -> Option<LocalVolume>;
}

/// Reads up to this size may be answered by [`try_serve`] where the request arrived. A 2 MiB
/// read of memory takes a few hundred microseconds; sending 1 MiB reads to a blocking thread
/// and back was slower for them and, on tmpfs, for the writes beside them (docs/benchmarks.md,
/// "large reads answered by the element's actor").
pub const SERVE_AT_ONCE_BYTES_MAX: u32 = 2 * 1024 * 1024;

/// Answer a small `Read` at once if storage can without waiting for a disk (the data is in
/// memory): the same answer [`serve`] gives, or `None` (then `serve` it where waiting is fine).
pub fn try_serve(storage: &impl ElementStorage, volume: LocalVolume, request: &HostMessage) -> Option<ElementMessage> {
    let HostMessage::Read { request_id, offset_bytes, length_bytes, snapshot: None, .. } = *request else {
        return None;
    };
    if length_bytes > SERVE_AT_ONCE_BYTES_MAX {
        return None;
    }
    let read = storage.try_read(volume, offset_bytes, length_bytes)?;
    Some(read_reply(storage, volume, request_id, read))
}

/// The answer to a `Read`: the data with the applied sequence it reflects, or the error with
/// the volume's applied sequence.
fn read_reply(
    storage: &impl ElementStorage,
    volume: LocalVolume,
    request_id: u64,
    read: Result<(Sequence, ReadData), String>,
) -> ElementMessage {
    let (applied_sequence, result) = match read {
        Ok((sequence, data)) => (sequence, Ok(data)),
        Err(e) => (storage.info(volume).applied, Err(e)),
    };
    ElementMessage::ReadReply { request_id, applied_sequence, result }
}

/// Answer a read-only request (`Read`, `BlockStatus`, `FetchLog`, `FetchBlocks`, `Scrub`). A
/// read of a snapshot reads the snapshot storage holds, or fails if it holds none.
pub fn serve(storage: &impl ElementStorage, volume: LocalVolume, request: HostMessage) -> ElementMessage {
    let snapshot = match &request {
        HostMessage::Read { snapshot: Some(s), .. } | HostMessage::BlockStatus { snapshot: Some(s), .. } => Some(s.id),
        HostMessage::FetchBlocks { snapshot: Some(id), .. } => Some(*id),
        _ => None,
    };
    let (volume, missing) = match snapshot {
        None => (volume, None),
        Some(id) => match storage.snapshot(volume, id) {
            Some(local) => (local, None),
            None => (volume, Some(format!("this element holds no snapshot {id} of the volume"))),
        },
    };
    match (request, missing) {
        (HostMessage::FetchBlocks { request_id, .. }, Some(reason)) => {
            ElementMessage::Blocks { request_id, result: Err(reason) }
        }
        (HostMessage::Read { request_id, .. }, Some(reason)) => ElementMessage::ReadReply {
            request_id,
            applied_sequence: storage.info(volume).applied,
            result: Err(reason),
        },
        (HostMessage::BlockStatus { request_id, .. }, Some(reason)) => ElementMessage::BlockStatusReply {
            request_id,
            applied_sequence: storage.info(volume).applied,
            result: Err(reason),
        },
        (request, _) => serve_volume(storage, volume, request),
    }
}

fn serve_volume(storage: &impl ElementStorage, volume: LocalVolume, request: HostMessage) -> ElementMessage {
    match request {
        HostMessage::Read { request_id, offset_bytes, length_bytes, .. } => {
            read_reply(storage, volume, request_id, storage.read(volume, offset_bytes, length_bytes))
        }
        HostMessage::BlockStatus { request_id, offset_bytes, length_bytes, .. } => {
            let (applied_sequence, result) = match storage.block_status(volume, offset_bytes, length_bytes) {
                Ok((sequence, extents)) => (sequence, Ok(extents)),
                Err(e) => (storage.info(volume).applied, Err(e)),
            };
            ElementMessage::BlockStatusReply { request_id, applied_sequence, result }
        }
        HostMessage::FetchLog { request_id, volume: session_volume, after, max_bytes } => {
            // Bounded so that the reply always fits one frame, whatever was asked.
            let result = storage
                .log_records(volume, after, max_bytes.min(LOG_REPLY_BYTES_MAX))
                .map(|records| records.into_iter().map(|r| Record { volume: session_volume, ..r }).collect::<Vec<_>>());
            ElementMessage::LogRecords { request_id, result }
        }
        HostMessage::FetchBlocks { request_id, first_block, have, .. } => {
            ElementMessage::Blocks { request_id, result: storage.copy_chunk(volume, first_block, &have) }
        }
        HostMessage::Scrub { request_id, first_block, count, .. } => {
            ElementMessage::ScrubReply { request_id, result: storage.scrub_chunk(volume, first_block, count) }
        }
        other => unreachable!("the core serves only read-only requests, not {other:?}"),
    }
}
