//! The store's error type: every message names the file, volume, block or sequence involved.

use std::{
    io,
    path::{Path, PathBuf},
};

use proto::{Epoch, Sequence, BLOCK_BYTES, PAYLOAD_BYTES_MAX};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{operation} {}: {source}", path.display())]
    Io {
        operation: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("data directory {} is in use by another process (lock file held)", path.display())]
    Locked { path: PathBuf },
    #[error("{} is not empty and holds no StarFish store (no metadata file)", path.display())]
    NotAStore { path: PathBuf },
    #[error("invalid store options: {0}")]
    InvalidOptions(String),
    #[error("store metadata {} is corrupt: {reason}", path.display())]
    CorruptMetadata { path: PathBuf, reason: String },
    #[error("block map {} of volume {volume:?} is corrupt: {reason}", path.display())]
    CorruptBlockMap { path: PathBuf, volume: String, reason: String },
    #[error("log segment {} is corrupt at byte {offset}: {reason}", path.display())]
    CorruptLog { path: PathBuf, offset: u64, reason: String },
    #[error(
        "volume {volume:?}: block {block} (bytes {}..{}) fails its checksum in {}: \
         block map has {expected:#010x}, content has {actual:#010x}",
        block * BLOCK_BYTES, (block + 1) * BLOCK_BYTES, path.display()
    )]
    BlockChecksum { volume: String, path: PathBuf, block: u64, expected: u32, actual: u32 },
    #[error("volume {volume:?}: sequence {sequence} leaves a gap after the applied sequence {applied}")]
    Gap { volume: String, applied: Sequence, sequence: Sequence },
    #[error(
        "volume {volume:?}: record of sequence {sequence} comes from epoch {epoch}, older than the \
         store's epoch {store_epoch}"
    )]
    StaleEpoch { volume: String, sequence: Sequence, epoch: Epoch, store_epoch: Epoch },
    #[error("epoch {requested} is older than the store's epoch {current}, or is that epoch of another host element")]
    EpochBackwards { requested: Epoch, current: Epoch },
    #[error(
        "volume {volume:?}: range of {length_bytes} bytes at {offset_bytes} ends past the volume \
         size {size_bytes}"
    )]
    OutOfRange { volume: String, offset_bytes: u64, length_bytes: u64, size_bytes: u64 },
    #[error("volume {volume:?}: {length_bytes} bytes exceed the largest payload, {PAYLOAD_BYTES_MAX}")]
    PayloadTooLarge { volume: String, length_bytes: u64 },
    #[error("volume {volume:?}: record {sequence} arrived damaged: {detail}; not committed")]
    RecordChecksum { volume: String, sequence: Sequence, detail: String },
    #[error("volume {name:?} exists with {existing_bytes} bytes, not {requested_bytes}")]
    VolumeSizeMismatch { name: String, existing_bytes: u64, requested_bytes: u64 },
    #[error("volume {volume:?} is being rebuilt by a full recovery (block copy): it holds no consistent image yet")]
    Copying { volume: String },
    #[error("volume {volume:?} has no full recovery in progress")]
    NotCopying { volume: String },
    #[error("invalid volume {name:?}: {reason}")]
    InvalidVolume { name: String, reason: String },
    #[error("volume {volume:?} was removed")]
    Removed { volume: String },
    #[error("volume {volume:?} is a snapshot: {what}")]
    Snapshot { volume: String, what: &'static str },
    #[error(
        "volume {volume:?}: the replay log no longer holds sequence {sequence} (oldest held: {})",
        match oldest { Some(s) => s.to_string(), None => "none".to_string() }
    )]
    NotInReplayLog { volume: String, sequence: Sequence, oldest: Option<Sequence> },
    #[error(
        "volume {volume:?}: blocks of the placed write of sequence {sequence} were written again \
         since, and no copy of their data was kept in the log: the log cannot serve it"
    )]
    PlacedRewritten { volume: String, sequence: Sequence },
    #[error("the store failed earlier and accepts no more changes until reopened: {reason}")]
    Failed { reason: String },
}

impl StoreError {
    /// The file system ran out of space (or quota): freeing space and reopening the store
    /// brings it back.
    pub fn is_no_space(&self) -> bool {
        matches!(self, StoreError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)))
    }
}

/// `map_err` helper: an I/O error with what was being done to which file.
pub(crate) fn io_error<'a>(operation: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { operation, path: path.to_path_buf(), source }
}
