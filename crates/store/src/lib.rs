//! The element's durable storage engine: one data directory holds several volumes, a
//! write-ahead log shared by all of them, and per volume a sparse data file and a block map.
//!
//! A commit is one group commit: every record of the batch is checked (epoch, sequence, range),
//! its partial edge blocks are merged with their current content, the batch is written to the
//! log in one vectored write and made durable with one `fdatasync`, and only then applied to
//! the data files. Replaying the log therefore never needs to read a data file, and a record is
//! never applied before it is durable. The byte layout is in `docs/on-disk-format.md`.
//!
//! Checkpoints (data files synced, block maps written, the log start moved) run off the commit
//! path: a commit that fills the live log segment only seals it (moves to the next segment,
//! notes which block map chunks changed); a background thread writes the checkpoint while
//! commits go on in the next segment, which that thread prepared ahead (recycled or
//! zero-filled, so appends overwrite).
//!
//! Blocking std I/O only: the element shell calls `commit` from one committer thread and
//! `read`/`block_status` from any number of threads. The store runs two threads of its own:
//! the checkpointer (`checkpoint`) and one that reclaims the disk space of trimmed blocks
//! (`reclaim`).

mod block_map;
mod checkpoint;
mod element_storage;
mod error;
#[cfg(feature = "fuzz")]
pub mod fuzz;
mod log;
mod meta;
mod reclaim;
mod store;
mod sys;
mod volume;

#[cfg(test)]
mod tests;

pub use error::StoreError;
pub use store::{CopyState, RepairReport, SnapshotInfo, Store};

/// Bytes of the file system holding `dir` still free for an unprivileged writer.
pub fn sys_available_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    sys::available_bytes(dir)
}

use proto::{Sequence, BLOCK_BYTES, PAYLOAD_BYTES_MAX};

/// A buffer of `len` zero bytes for a log read to fill, zeroed by writing the zeroes (a volume
/// read writes every byte of its buffer and zeroes nothing first: `Volume::read_blocks_into`).
/// `BytesMut::zeroed` asks the allocator for zeroed memory, and jemalloc gives a large one as
/// pages the kernel must fault in afresh (it zeroes memory by giving pages back,
/// `madvise(MADV_DONTNEED)`, or hands out pages it gave back before): every page of every large
/// read's buffer faulted, 256 faults per 1 MiB read on an element (`perf record -e
/// page-faults`). Writing the zeroes into pages the process already has costs less.
pub(crate) fn zeroed_buffer(len: usize) -> bytes::BytesMut {
    let mut buffer = bytes::BytesMut::with_capacity(len);
    buffer.resize(len, 0);
    buffer
}

// ---------------------------------------------------------------------------------------------
// Bounds. Every size the store allocates or writes is bounded by one of these.
// ---------------------------------------------------------------------------------------------

/// A log segment that appends must grow (a new store's first segment, or one created while no
/// spare was ready) grows by at least this many zeroes at a time on a disk, so most commits
/// overwrite space the file already has: their `fdatasync` then writes data only, not also the
/// file's new size and blocks (a third less time for three elements syncing on one disk,
/// measured with fio). Not on a file system in memory.
pub const LOG_GROW_STEP_BYTES: u64 = 256 * 1024;

/// Smallest write of whole blocks that holes receive as a *placed write*
/// ([`StoreOptions::placed_writes`]): its data written into the data file and synced before
/// its record, which then holds only the blocks' checksums, is logged (`log::Change::Blocks`).
/// Smaller writes are logged with their data: for them, the second sync would cost more than
/// the copy it saves.
pub const PLACED_WRITE_BYTES_MIN: u64 = 256 * 1024;

/// Default for [`StoreOptions::checkpoint_log_bytes`]: the live log segment stays around this
/// size; each one filled starts a checkpoint in the background and a new segment.
pub const CHECKPOINT_LOG_BYTES_DEFAULT: u64 = 64 * 1024 * 1024;
/// Default for [`StoreOptions::replay_log_bytes`]: closed log segments kept for peer recovery.
pub const REPLAY_LOG_BYTES_DEFAULT: u64 = 256 * 1024 * 1024;
/// Smallest accepted `checkpoint_log_bytes`: below this, checkpoints would dominate.
pub const CHECKPOINT_LOG_BYTES_MIN: u64 = 64 * 1024;
/// Largest accepted `checkpoint_log_bytes`: bounds replay time after a crash.
pub const CHECKPOINT_LOG_BYTES_MAX: u64 = 4 * 1024 * 1024 * 1024;
/// Log segments not covered by a committed checkpoint (the live one included): once a seal
/// would exceed this, because the checkpointer lags behind, the commit that seals waits for
/// it. Bounds crash replay to about this many times `checkpoint_log_bytes`.
pub const CHECKPOINT_LAG_SEGMENTS_MAX: u64 = 4;
/// Block map chunk images a checkpoint encodes per hold of a volume's lock (applies to the
/// volume wait meanwhile: about 20 µs per image).
pub const MAP_SLOTS_PER_LOCK: usize = 64;
/// Files of segments dropped from the replay log kept to be recycled as the next segments.
pub const FREE_SEGMENTS_MAX: usize = 2;
/// Write unit of zero-filling a new log segment ahead of the writer (the checkpointer checks
/// between steps whether a checkpoint waits).
pub const SPARE_FILL_STEP_BYTES: u64 = 1024 * 1024;
/// Largest log batch (header and records). A commit bigger than this is written as several
/// batches, still with one `fdatasync`. One record of the largest payload always fits.
pub const LOG_BATCH_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// Largest encoded log record: header, one checksum per block, the payload widened to whole
/// blocks (one more block at each end).
pub const LOG_RECORD_BYTES_MAX: u64 = log::RECORD_FRAME_BYTES
    + log::RECORD_HEADER_BYTES
    + (PAYLOAD_BYTES_MAX as u64 / BLOCK_BYTES + 2) * (BLOCK_BYTES + 4);
/// Volumes per store.
pub const VOLUMES_MAX: usize = 4096;
/// Longest volume name, in bytes of UTF-8 (the wire protocol's limit).
pub const VOLUME_NAME_BYTES_MAX: usize = 255;
/// Largest volume: 16 TiB. The in-memory block map costs 12 bytes per 4 KiB block (3 MiB per
/// GiB of volume), so this is a bound, not a recommendation.
pub const VOLUME_BYTES_MAX: u64 = 16 << 40;
/// Blocks described by one block map chunk: one chunk slot is exactly one 4 KiB page.
pub const MAP_CHUNK_BLOCKS: u64 = 340;
/// Most extents one `block_status` answer returns; the answer then covers a prefix of the range.
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 1 << 16;
/// Most bytes of file data one reclaim slice punches (under the commit lock, so this bounds
/// the delay a background reclaim adds to a commit: ext4 frees ~40 extents per millisecond).
pub const RECLAIM_PUNCH_BYTES_MAX: u64 = 1024 * 1024;
/// Most blocks one reclaim slice examines (map runs and `SEEK_DATA`, cheap).
pub const RECLAIM_SCAN_BLOCKS_MAX: u64 = 256 * 1024;
/// Most bytes one write of an apply puts into a data file, and the alignment of the windows it
/// writes in (not on a file system in memory). The page cache makes a file's folios as large as
/// the writes that create them (ext4 does since Linux 6.16), and every later small write into a
/// large folio walks all its block buffers, as does its writeback: a 4 KiB write into a folio
/// made by a 1 MiB write costs 15–35 µs of CPU instead of 2–4 µs. So a large apply goes out
/// 64 KiB at a time, each piece within one aligned 64 KiB window (docs/benchmarks.md).
pub const WRITE_WINDOW_BYTES: u64 = 64 * 1024;
/// Once this many bytes were written to a volume's data file, its writeback is started
/// (`sync_file_range`, not waited for), so checkpoints find little dirty data to sync.
pub const WRITEBACK_KICK_BYTES: u64 = 8 * 1024 * 1024;
/// How long `Store::open` retries a held directory lock before reporting it locked.
pub const LOCK_WAIT_MS: u64 = 500;
/// Read unit of `verify` and of log scans.
pub const SCAN_BUFFER_BYTES: u64 = 4 * 1024 * 1024;

const _: () = assert!(LOG_RECORD_BYTES_MAX + (log::BATCH_HEADER_BYTES as u64) <= LOG_BATCH_BYTES_MAX);
const _: () = assert!(CHECKPOINT_LOG_BYTES_MIN <= CHECKPOINT_LOG_BYTES_DEFAULT);
const _: () = assert!(CHECKPOINT_LAG_SEGMENTS_MAX >= 2);
const _: () = assert!(CHECKPOINT_LOG_BYTES_DEFAULT <= CHECKPOINT_LOG_BYTES_MAX);
const _: () = assert!(block_map::SLOT_HEADER_BYTES + MAP_CHUNK_BLOCKS * block_map::ENTRY_BYTES == BLOCK_BYTES);
const _: () = assert!(VOLUME_BYTES_MAX / BLOCK_BYTES < 1 << 62);
const _: () = assert!(SCAN_BUFFER_BYTES % BLOCK_BYTES == 0);
const _: () = assert!(RECLAIM_PUNCH_BYTES_MAX % BLOCK_BYTES == 0);

/// The element shell shares one store between its committer thread and its readers.
const _: fn() = || {
    fn shared<T: Send + Sync>() {}
    shared::<Store>();
};

// ---------------------------------------------------------------------------------------------
// Public types.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// Checkpoint (start a new log segment; in the background sync the data files and persist
    /// the block maps) once the live log segment holds this many bytes, or a little less: each
    /// segment is sealed somewhere between three quarters of this and all of it, drawn from
    /// the element's identity and the segment, so that replicas receiving the same writes do
    /// not checkpoint in step.
    pub checkpoint_log_bytes: u64,
    /// Keep closed log segments (the replay log, served to recovering peers through
    /// [`Store::log_records`]) up to this many bytes of their files, a placed write's data
    /// counted as if it were in them; older segments are recycled or deleted (never one a
    /// committed checkpoint does not cover yet).
    pub replay_log_bytes: u64,
    /// Create volumes whose sizes add up to more than the file system can hold (thin
    /// provisioning: a write then fails with "no space left" when the disk fills). Off by
    /// default: a volume that cannot be held whole is refused when it is created.
    pub overcommit: bool,
    /// Memory the block maps of all volumes may take (12 bytes per 4 KiB block); a volume
    /// beyond it is refused when it is created. Default: half the machine's memory.
    pub map_memory_bytes_max: u64,
    /// A log segment that appends must grow grows by zeroes to a multiple of this (at most a
    /// sixteenth of `checkpoint_log_bytes`, in 4 KiB); 0: to the end of each batch. See
    /// [`LOG_GROW_STEP_BYTES`], the default. Not on a file system in memory.
    pub log_grow_step_bytes: u64,
    /// Write large writes into holes once (*placed writes*, [`PLACED_WRITE_BYTES_MIN`]): their
    /// data into the data file, synced, before a record of their checksums only is logged.
    /// Up to about twice as fast a first fill of a volume, and half the bytes on the disk. The
    /// costs: on a disk, small writes beside them wait longer (a placed write syncs its data
    /// file); and a write over blocks of a placed write still in the replay log first logs a
    /// copy of their data (a copy record, so that `Store::log_records` can still
    /// serve the placed write to a lagging peer), which the replay log's budget bounds. Off by
    /// default.
    pub placed_writes: bool,
}

impl StoreOptions {
    /// Whether [`Store::open`] takes these options; if not, why (what a configuration that
    /// sets them reports).
    pub fn check(&self) -> Result<(), String> {
        if !(CHECKPOINT_LOG_BYTES_MIN..=CHECKPOINT_LOG_BYTES_MAX).contains(&self.checkpoint_log_bytes) {
            return Err(format!(
                "the checkpoint log's size must be from 64KiB to 4GiB ({CHECKPOINT_LOG_BYTES_MIN} to \
                 {CHECKPOINT_LOG_BYTES_MAX} bytes), not {} bytes",
                self.checkpoint_log_bytes
            ));
        }
        Ok(())
    }

    /// The step a growing log segment takes ([`StoreOptions::log_grow_step_bytes`], bounded).
    pub fn log_grow_step(&self) -> u64 {
        self.log_grow_step_bytes.min(self.checkpoint_log_bytes / 16) / BLOCK_BYTES * BLOCK_BYTES
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            checkpoint_log_bytes: CHECKPOINT_LOG_BYTES_DEFAULT,
            replay_log_bytes: REPLAY_LOG_BYTES_DEFAULT,
            overcommit: false,
            map_memory_bytes_max: sys::physical_memory_bytes() / 2,
            log_grow_step_bytes: LOG_GROW_STEP_BYTES,
            placed_writes: false,
        }
    }
}

/// What the volumes of a store need besides their data: block map memory and files, and the
/// log (the replay log, the live segment, a spare and one segment being checkpointed).
pub fn space_needed_bytes(volume_sizes: &[u64], options: &StoreOptions) -> u64 {
    let blocks: u64 = volume_sizes.iter().map(|s| s / BLOCK_BYTES).sum();
    let data: u64 = volume_sizes.iter().sum();
    let map_files = (blocks.div_ceil(MAP_CHUNK_BLOCKS) * 2 + volume_sizes.len() as u64) * BLOCK_BYTES;
    let log = options.replay_log_bytes + 3 * options.checkpoint_log_bytes;
    data + map_files + log
}

/// Block map memory of volumes of these sizes.
pub fn map_memory_bytes(volume_sizes: &[u64]) -> u64 {
    volume_sizes.iter().map(|s| s / BLOCK_BYTES * block_map::ENTRY_BYTES).sum()
}

/// A volume of one open [`Store`]. Only meaningful for the store that returned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeHandle(u32);

impl VolumeHandle {
    fn index(self) -> usize {
        self.0 as usize
    }

    /// The volume's number in its store: volumes are numbered densely, in creation order, and
    /// keep their number across restarts (the element core's `LocalVolume`).
    pub fn number(self) -> u32 {
        self.0
    }
}

/// What one [`Store::commit`] did.
#[derive(Debug, Default)]
pub struct CommitOutcome {
    /// Every volume named in the batch, in order of first appearance, with its applied
    /// sequence after the commit (unchanged if all its records were duplicates or rejected).
    pub applied: Vec<(VolumeHandle, Sequence)>,
    /// Records skipped because their sequence was already applied.
    pub duplicates: usize,
    /// Records refused (gap, stale epoch, out of range, corrupt base block). Nothing of them
    /// was logged or applied; the caller turns them into a fault of the session.
    pub rejected: Vec<Rejected>,
}

/// One refused record of a commit batch.
#[derive(Debug)]
pub struct Rejected {
    /// Position in the batch passed to [`Store::commit`].
    pub index: usize,
    pub volume: VolumeHandle,
    pub sequence: Sequence,
    pub error: StoreError,
}

/// Summary of a volume's content, equal on two replicas exactly when their logical content is
/// equal (up to hash collisions), whatever their allocation or history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeDigest {
    pub applied_sequence: Sequence,
    /// See [`Store::verify`] for the definition.
    pub content_digest: u64,
    pub blocks_total: u64,
    pub blocks_allocated: u64,
    /// Blocks whose content does not match their checksum (their actual content went into the
    /// digest, so the digest then differs from a healthy replica's).
    pub blocks_corrupt: u64,
    pub first_corrupt_block: Option<u64>,
}

/// The bits `bits` of a bitmap of `u64` words, word by word: each word's index and the mask of
/// its bits in the range (for the block map's allocation bits and the mapped pages' set).
pub(crate) fn word_masks(bits: std::ops::Range<u64>) -> impl Iterator<Item = (usize, u64)> {
    let (first, end) = (bits.start, bits.end.max(bits.start));
    (first / 64..end.div_ceil(64)).map(move |word| {
        let low = first.max(word * 64) - word * 64;
        let high = end.min(word * 64 + 64) - word * 64;
        let mask = if high - low == 64 { u64::MAX } else { ((1u64 << (high - low)) - 1) << low };
        (word as usize, mask)
    })
}
