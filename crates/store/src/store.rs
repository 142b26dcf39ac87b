//! The store: opening and crash recovery, group commit, sealing the log for checkpoints, and
//! the read side. The checkpoints themselves run in the background (`checkpoint`).

use std::{
    collections::{BTreeMap, HashMap},
    fs::{self, File, OpenOptions},
    ops::Range,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, RwLock, RwLockWriteGuard,
    },
};

use bytes::{Bytes, BytesMut};
use proto::{BlockExtent, BlockSummary, Epoch, HostId, Op, ReadData, Record, Sequence, BLOCK_BYTES, PAYLOAD_BYTES_MAX};

use crate::{
    block_map::{BlockMap, ChunkImages, DirtyChunks, MapFile},
    checkpoint::{self, CheckpointJob, Checkpointer, PartialSpare, VolumeSeal},
    error::io_error,
    log::{self, Change, Edge, Geometry, Kind, LogIndex, LogRecord, LogWriter},
    meta::{Meta, SnapshotOf, VolumeMeta},
    reclaim::{self, Reclaim},
    sys,
    volume::{Attempt, MapSlice, Volume, VolumeState},
    CommitOutcome, Rejected, StoreError, StoreOptions, VolumeDigest, VolumeHandle, CHECKPOINT_LAG_SEGMENTS_MAX,
    LOCK_WAIT_MS, PLACED_WRITE_BYTES_MIN, RECLAIM_PUNCH_BYTES_MAX, RECLAIM_SCAN_BLOCKS_MAX, VOLUMES_MAX,
    VOLUME_BYTES_MAX, VOLUME_NAME_BYTES_MAX, WRITEBACK_KICK_BYTES,
};

mod clone;
mod copy;
mod snapshot;

pub use copy::CopyState;
pub use snapshot::SnapshotInfo;

const LOCK_FILE: &str = "lock";
pub(crate) const VOLUMES_DIR: &str = "volumes";

fn data_path(dir: &Path, number: u32) -> PathBuf {
    dir.join(VOLUMES_DIR).join(format!("{number}.data"))
}

fn map_path(dir: &Path, number: u32) -> PathBuf {
    dir.join(VOLUMES_DIR).join(format!("{number}.map"))
}

/// The durable storage of one element. See the crate documentation.
pub struct Store {
    options: StoreOptions,
    /// Held (flock) for the life of the store: one process per data directory.
    _lock: File,
    /// Newest epoch seen: set by `set_epoch` or raised by committed records.
    epoch: AtomicU64,
    /// The host element `epoch` belongs to (0: not known); changed with it.
    epoch_holder: AtomicU64,
    /// Random at creation; see `Meta::element_id`.
    element_id: u64,
    /// Indexed by `VolumeHandle`; only grows.
    volumes: Arc<RwLock<Vec<Arc<Volume>>>>,
    /// Everything that appends to the log or applies; one commit at a time.
    committer: Arc<Mutex<Committer>>,
    /// What the committer shares with the checkpointer thread.
    shared: Arc<Shared>,
    /// Ranges whose file space is to be reclaimed, and the thread that does it.
    reclaim: Arc<Reclaim>,
    reclaimer: Option<std::thread::JoinHandle<()>>,
    checkpointer: Option<std::thread::JoinHandle<()>>,
    /// How [`Store::try_read_checked`] reads without waiting for the disk: one of the
    /// `NON_BLOCKING_*` values (off once the file system said it cannot tell).
    non_blocking_reads: AtomicU8,
    /// The file system holds everything in memory (tmpfs, ramfs): see [`Store::in_memory`].
    in_memory: bool,
    /// Snapshots the store holds (commits look for the newest snapshots only if there are);
    /// counted up by `create_volume_locked`, down by `snapshot::forget_removed`.
    snapshot_count: AtomicUsize,
}

const NON_BLOCKING_OFF: u8 = 0;
const NON_BLOCKING_ALWAYS: u8 = 1;
const NON_BLOCKING_PAGE_CACHE: u8 = 2;

/// State used by both the committer and the checkpointer thread. Lock order: the committer
/// lock before any of these; `checkpointer.queue` before `log_index`; `meta` alone.
pub(crate) struct Shared {
    pub dir: PathBuf,
    pub options: StoreOptions,
    /// As last written to the metadata file; held while it is rewritten.
    pub meta: Mutex<Meta>,
    /// Set after an I/O error while changing durable state: from then on the in-memory state
    /// may not match the disk, so only reopening (and replaying) may change anything again.
    pub failure: Mutex<Option<String>>,
    /// The failure was the file system running out of space (`ENOSPC`, or `EDQUOT`).
    pub failure_no_space: std::sync::atomic::AtomicBool,
    /// Volume numbers made repairs (a block failed its checksum) not yet taken.
    pub damaged: Mutex<Vec<u32>>,
    /// Retained log records, for `log_records`; short critical sections only.
    pub log_index: Mutex<LogIndex>,
    pub checkpointer: Checkpointer,
}

impl Shared {
    pub fn fail(&self, error: &StoreError) {
        tracing::error!(%error, "store failed; it accepts no more changes until reopened");
        let mut failure = lock(&self.failure);
        if failure.is_none() {
            *failure = Some(error.to_string());
            self.failure_no_space.store(error.is_no_space(), Ordering::Release);
        }
    }

    pub fn check_failure(&self) -> Result<(), StoreError> {
        match &*lock(&self.failure) {
            Some(reason) => Err(StoreError::Failed { reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// Drop the oldest closed segments beyond the replay log budget (never one the last
    /// committed checkpoint still needs) and recycle or delete their files.
    pub fn trim_replay_log(&self, checkpoint_log_start: u64) {
        let dropped = lock(&self.log_index).trim_to(self.options.replay_log_bytes, checkpoint_log_start);
        for segment in dropped {
            self.checkpointer.recycle_or_remove(&self.dir, segment);
        }
    }
}

struct Committer {
    log: LogWriter,
    /// Per volume (same index as `Store::volumes`): chunks changed since the last seal.
    dirty: Vec<DirtyChunks>,
    /// Per volume: data written to the data file since writeback was last considered.
    unflushed: Vec<Unflushed>,
    /// The checkpointer was asked to prepare the segment after the live one.
    spare_requested: bool,
}

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().expect("a thread panicked while holding a store lock")
}

/// One log segment file found at open.
struct FoundSegment {
    path: PathBuf,
    file: Arc<File>,
    /// `(previous segment, end of its log)` if the segment was written to.
    header: Option<(u64, u64)>,
}

/// Reads tried without the volume lock before one under it (see [`Store::read`]).
const READ_UNLOCKED_ATTEMPTS_MAX: u32 = 4;

impl Store {
    /// Open the store in `dir`, creating an empty one if `dir` is empty or missing, and
    /// recover: load the last checkpoint, replay the log after it (a torn tail is logged and
    /// cut off), and index the replay log.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<Store, StoreError> {
        options.check().map_err(StoreError::InvalidOptions)?;
        fs::create_dir_all(dir).map_err(io_error("create data directory", dir))?;
        if let Some(device) = sys::ext4_without_journal(dir) {
            // docs/testing.md: after a power cut, e2fsck cleared whole files' extent trees
            // (another file's sync had written their inodes ahead of their extent blocks).
            tracing::warn!(
                dir = %dir.display(),
                %device,
                "the data directory is on ext4 without a journal: after a power loss, e2fsck may clear \
                 files this element synced (tests saw a block map lost so); keep it on a file system \
                 with a journal (ext4 as mkfs makes it, XFS, btrfs)"
            );
        }
        let lock_file = lock_directory(dir)?;
        let mut meta = match Meta::read(dir)? {
            Some(meta) => meta,
            None => initialize(dir)?,
        };
        if meta.element_id == 0 {
            // A store of format version 2: choose its identity now.
            meta.element_id = fresh_element_id();
            meta.write(dir)?;
        }

        // The block maps must fit the memory this element allows before any is loaded (a store
        // from before that check, or moved to a smaller machine, is refused, not aborted on).
        let sizes: Vec<u64> = meta.volumes.iter().map(|v| v.size_bytes).collect();
        let memory = crate::map_memory_bytes(&sizes);
        if memory > options.map_memory_bytes_max {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            return Err(StoreError::Failed {
                reason: format!(
                    "the block maps of this store's volumes need {:.1} GiB of memory, more than the {:.1} GiB this element allows",
                    gib(memory),
                    gib(options.map_memory_bytes_max)
                ),
            });
        }
        let mut volumes = Vec::with_capacity(meta.volumes.len());
        let mut images = Vec::with_capacity(meta.volumes.len());
        let mut dirty = Vec::with_capacity(meta.volumes.len());
        for volume_meta in &meta.volumes {
            let (volume, chunk_images) = open_volume(dir, &meta, volume_meta)?;
            dirty.push(DirtyChunks::for_blocks(volume.blocks()));
            volumes.push(volume);
            images.push(chunk_images);
        }
        remove_orphan_files(dir, &meta)?;

        let log_files = log::list_log_files(dir)?;
        let mut found: BTreeMap<u64, FoundSegment> = BTreeMap::new();
        for (id, paths) in log_files.segments {
            for path in paths {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(io_error("open log segment", &path))?;
                let header = log::read_segment_header(&file, &path, id)?;
                let candidate = FoundSegment { path, file: Arc::new(file), header };
                // Two files of one id: a spare prepared for an id the writer had already
                // taken. The written one (else the `.seg`, listed first) is the segment.
                let loser = match found.remove(&id) {
                    Some(kept) if kept.header.is_some() || candidate.header.is_none() => {
                        found.insert(id, kept);
                        candidate
                    }
                    Some(kept) => {
                        found.insert(id, candidate);
                        kept
                    }
                    None => {
                        found.insert(id, candidate);
                        continue;
                    }
                };
                fs::remove_file(&loser.path).map_err(io_error("remove", &loser.path))?;
            }
        }

        let log_start = meta.log_start;
        let mut index = LogIndex::default();
        let closed: Vec<u64> = found.range(..log_start).map(|(id, _)| *id).collect();
        for id in closed {
            let mut segment = found.remove(&id).expect("listed");
            if segment.header.is_some() {
                rename_to_segment(dir, id, &segment.path)?;
                segment.path = log::segment_path(dir, id);
            }
            let sealed_end = found
                .get(&(id + 1))
                .and_then(|next| next.header)
                .filter(|(previous, _)| *previous == id)
                .map(|(_, end)| end);
            index_closed_segment(id, segment, sealed_end, &mut index)?;
        }

        // The segments written since the checkpoint: from `log_start`, consecutive.
        let mut chain = Vec::new();
        while let Some(segment) = found.get(&(log_start + chain.len() as u64)) {
            if segment.header.is_none() {
                break;
            }
            chain.push(log_start + chain.len() as u64);
        }
        let live = chain.last().copied().unwrap_or(log_start);
        for (id, segment) in found.range(log_start..) {
            let corrupt =
                |reason: String| Err(StoreError::CorruptLog { path: segment.path.clone(), offset: 0, reason });
            match segment.header {
                Some(_) if *id > live => {
                    return corrupt(format!("segment {id} was written to, but segment {} before it was not", id - 1))
                }
                Some((previous, _)) if *id > log_start && previous != id - 1 => {
                    return corrupt(format!("segment {id} says it follows segment {previous}, not {}", id - 1))
                }
                _ => {}
            }
        }
        if !found.contains_key(&log_start) {
            return Err(StoreError::CorruptLog {
                path: log::segment_path(dir, log_start),
                offset: 0,
                reason: "the first log segment after the checkpoint is missing".into(),
            });
        }
        for id in &chain {
            let segment = found.get_mut(id).expect("in the chain");
            rename_to_segment(dir, *id, &segment.path)?;
            segment.path = log::segment_path(dir, *id);
        }
        // What reads and commits may do without waiting for a disk is decided by the file
        // systems of the data files and of the log, each at its own directory (either may be a
        // mount of its own): in memory only if both are.
        let reads = sys::non_blocking_reads(&dir.join(VOLUMES_DIR));
        let log_in_memory =
            matches!(sys::non_blocking_reads(&dir.join(log::LOG_DIR)), Ok(sys::NonBlockingReads::Always));
        let in_memory = matches!(reads, Ok(sys::NonBlockingReads::Always)) && log_in_memory;
        let mut log_epoch = Epoch(0);
        let mut live_end = 0;
        let mut deleted_snapshots = Vec::new();
        for &id in &chain {
            let sealed_end = (id < live).then(|| found[&(id + 1)].header.expect("segments of the chain are written").1);
            let segment = &found[&id];
            let replay = Replay {
                volumes: &volumes,
                next_volume_number: meta.next_volume_number,
                write_window: write_window_bytes(in_memory),
            };
            let (end, epoch) =
                replay_segment(id, segment, sealed_end, &replay, &mut dirty, &mut index, &mut deleted_snapshots)?;
            log_epoch = log_epoch.max(epoch);
            live_end = end;
        }
        let epoch = meta.epoch.max(log_epoch);
        // An epoch raised by records alone has no known holder.
        let epoch_holder = if log_epoch > meta.epoch { HostId(0) } else { meta.epoch_holder };
        let element_id = meta.element_id;
        for volume in &volumes {
            let state = volume.state.read().expect("not shared yet");
            let newest = state.map.sequence_max();
            // Blocks a full recovery installed carry their source's sequences until it ends.
            let copying = lock(&volume.copy).is_some();
            if newest > state.applied && !copying {
                return Err(StoreError::CorruptBlockMap {
                    path: map_path(dir, volume.number),
                    volume: volume.name.clone(),
                    reason: format!(
                        "a block was written at sequence {newest}, after the applied sequence \
                         {} (the checkpoint's and the log's)",
                        state.applied
                    ),
                });
            }
        }

        // Snapshots whose record the crash lost (never taken; so is every snapshot of a volume
        // whose full recovery has not finished: its applied sequence is behind them until
        // then), snapshots whose deletion's record was logged but not the metadata after it,
        // and snapshots a full recovery had not finished copying (it copies them again).
        let untaken = snapshot::untaken(&volumes);
        let copying: Vec<u32> =
            volumes.iter().filter(|v| v.snapshot_of.is_some() && lock(&v.copy).is_some()).map(|v| v.number).collect();
        let mut gone: Vec<u32> = untaken.iter().chain(&copying).copied().collect();
        gone.extend(volumes.iter().filter_map(|v| {
            let of = v.snapshot_of?;
            deleted_snapshots.contains(&(of.parent, of.id)).then_some(v.number)
        }));
        gone.sort_unstable();
        gone.dedup();
        if !gone.is_empty() {
            meta.volumes.retain(|v| !gone.contains(&v.number));
            meta.write(dir)?;
            for number in &gone {
                let k = volumes.iter().position(|v| v.number == *number).expect("listed");
                let name = &volumes[k].name;
                if copying.contains(number) {
                    tracing::info!(snapshot = %name, "snapshot a full recovery had not finished copying: removed");
                } else if untaken.contains(number) {
                    tracing::warn!(snapshot = %name, "snapshot whose record a crash lost (or of a volume being copied): removed");
                } else {
                    tracing::info!(snapshot = %name, "deletion of a snapshot finished");
                }
                remove_volume_files(dir, *number, Some(&volumes[k]))?;
                volumes.remove(k);
                dirty.remove(k);
                images.remove(k);
            }
        }
        let snapshot_count = volumes.iter().filter(|v| v.snapshot_of.is_some()).count();
        // Clones whose base snapshot is gone (`Store::repair` removed it; nothing else takes a
        // base from a clone) read wrong blocks: each becomes a repair, a full recovery that
        // verifies every block (the copy state durable before the metadata forgets the base).
        let orphans: Vec<usize> = (0..volumes.len())
            .filter(|&k| {
                volumes[k]
                    .clone_base()
                    .is_some_and(|base| !volumes.iter().any(|s| s.number == base && s.snapshot_of.is_some()))
            })
            .collect();
        for &k in &orphans {
            let v = &volumes[k];
            let state = CopyState::fresh(true);
            copy::save(dir, v.number, &state)?;
            *lock(&v.copy) = Some(state);
            v.set_clone_base(None);
            if let Some(entry) = meta.volumes.iter_mut().find(|m| m.number == v.number) {
                entry.clone_of = None;
            }
            tracing::error!(volume = %v.name, "clone whose base snapshot is gone: a full recovery that verifies every block repairs it");
        }
        if !orphans.is_empty() {
            meta.write(dir)?;
        }

        for id in &chain {
            if *id != live {
                found.remove(id).expect("in the chain: indexed now");
            }
        }
        // The writer continues the live segment (or starts it if it was never written).
        let live_segment = found.remove(&live).expect("checked above");
        let live_path = log::segment_path(dir, live);
        let log_dir = dir.join(log::LOG_DIR);
        rename_to_segment(dir, live, &live_segment.path)?;
        let live_file = live_segment.file;
        if live_segment.header.is_none() {
            // A first batch cut short (its segment header lost) must never become valid
            // under a later header: wipe both headers.
            wipe_segment_start(&live_file, &live_path)?;
            index.push_segment(live, live_path.clone(), live_file.clone(), 0);
        }
        // The header the live segment gets with its first batch, if it has none yet.
        let previous =
            live.checked_sub(1).and_then(|previous| Some((previous, index.segment_bytes(previous)?))).unwrap_or((0, 0));
        let live_file_bytes = live_file.metadata().map_err(io_error("stat", &live_path))?.len();
        let mut writer = LogWriter::new(live, live_path, live_file, live_end, live_file_bytes, previous);

        // A spare prepared for the next segment is kept; anything newer is left over from a
        // spare retargeted before a crash.
        let mut partial_spare = None;
        for (id, segment) in std::mem::take(&mut found) {
            if id == live + 1 {
                let spare_path = log::spare_path(dir, id);
                if segment.path != spare_path {
                    fs::rename(&segment.path, &spare_path).map_err(io_error("rename log segment", &segment.path))?;
                }
                wipe_segment_start(&segment.file, &spare_path)?;
                partial_spare = Some(PartialSpare::adopt(id, spare_path, segment.file)?);
            } else {
                fs::remove_file(&segment.path).map_err(io_error("remove", &segment.path))?;
            }
        }
        sys::sync_dir(&log_dir).map_err(io_error("sync directory", &log_dir))?;

        for volume in &volumes {
            let state = volume.state.read().expect("not shared yet");
            tracing::info!(volume = %volume.name, applied = %state.applied, "volume recovered");
        }
        // Space of holes whose punching a crash interrupted (or never started) is found by
        // a background pass over every volume: cheap where the file has no data under holes.
        let reclaim = Arc::new(Reclaim::default());
        for (i, volume) in volumes.iter().enumerate() {
            reclaim.push(i, 0..volume.blocks());
        }
        let unflushed = (0..volumes.len()).map(|_| Unflushed::default()).collect();
        let volumes = Arc::new(RwLock::new(volumes));
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            options,
            meta: Mutex::new(meta),
            failure: Mutex::new(None),
            failure_no_space: std::sync::atomic::AtomicBool::new(false),
            damaged: Mutex::new(Vec::new()),
            log_index: Mutex::new(index),
            checkpointer: Checkpointer::new(log_start, live, log_files.free),
        });
        shared.trim_replay_log(log_start);
        // Both are about the log's `fdatasync`, so both follow the log's own file system: growing
        // by zeroes makes it cheaper on a disk, and in memory it does nothing.
        if !log_in_memory {
            writer.grow_step_bytes = options.log_grow_step();
        }
        writer.in_memory = log_in_memory;
        let committer = Arc::new(Mutex::new(Committer { log: writer, dirty, unflushed, spare_requested: false }));
        let reclaimer = {
            let (reclaim, committer, volumes, shared) =
                (reclaim.clone(), committer.clone(), volumes.clone(), shared.clone());
            std::thread::Builder::new()
                .name("store-reclaim".into())
                .spawn(move || {
                    while reclaim.wait().is_some() {
                        // Leave the commit lock free at least as long as a slice held it.
                        let started = std::time::Instant::now();
                        reclaim_slice(&reclaim, &committer, &volumes, &shared);
                        std::thread::sleep(started.elapsed());
                    }
                })
                .map_err(io_error("start the reclaim thread for", dir))?
        };
        let checkpointer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("store-checkpoint".into())
                .spawn(move || checkpoint::run(&shared, images, partial_spare))
                .map_err(io_error("start the checkpoint thread for", dir))?
        };
        Ok(Store {
            options,
            _lock: lock_file,
            epoch: AtomicU64::new(epoch.0),
            epoch_holder: AtomicU64::new(epoch_holder.0),
            element_id,
            volumes,
            committer,
            shared,
            reclaim,
            reclaimer: Some(reclaimer),
            checkpointer: Some(checkpointer),
            non_blocking_reads: AtomicU8::new(match reads {
                Ok(sys::NonBlockingReads::Always) => NON_BLOCKING_ALWAYS,
                Ok(sys::NonBlockingReads::PageCacheOnly) => NON_BLOCKING_PAGE_CACHE,
                Err(_) => NON_BLOCKING_OFF,
            }),
            in_memory,
            snapshot_count: AtomicUsize::new(snapshot_count),
        })
    }

    pub fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Acquire))
    }

    /// Why the store failed, if it did: it takes no more changes until it is reopened.
    pub fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).clone()
    }

    /// The store's file system holds everything in memory (tmpfs, ramfs): a commit never
    /// waits for a disk (its `fdatasync` returns at once), so a caller that must not block on
    /// I/O (the element's actor) may run it itself instead of handing it to a thread.
    pub fn in_memory(&self) -> bool {
        self.in_memory
    }

    /// The log's own file system holds everything in memory, so commits do not sync it
    /// ([`crate::log::LogWriter::in_memory`]).
    #[cfg(test)]
    pub(crate) fn log_in_memory(&self) -> bool {
        lock(&self.committer).log.in_memory
    }

    /// The most bytes of a data file one write of an apply covers (see [`write_window_bytes`]).
    fn write_window_bytes(&self) -> u64 {
        write_window_bytes(self.in_memory)
    }

    /// The store failed because its file system ran out of space: once space is freed,
    /// reopening it (which replays the log) brings it back.
    pub fn failed_for_space(&self) -> bool {
        self.shared.failure_no_space.load(Ordering::Acquire)
    }

    /// Free bytes an element needs before it reopens a store that ran out of space: a new log
    /// segment, its spare, and one largest batch.
    pub fn reopen_space_bytes(options: &StoreOptions) -> u64 {
        2 * options.checkpoint_log_bytes + crate::LOG_BATCH_BYTES_MAX
    }

    /// The host element the epoch belongs to (`HostId(0)`: not known).
    pub fn epoch_holder(&self) -> HostId {
        HostId(self.epoch_holder.load(Ordering::Acquire))
    }

    /// This element's identity (random, chosen when the store was created).
    pub fn element_id(&self) -> u64 {
        self.element_id
    }

    /// Raise the epoch, held by `holder`, durably. Setting the current epoch of the same
    /// holder again is a no-op; an older epoch, or the current one of another holder, is
    /// refused.
    pub fn set_epoch(&self, epoch: Epoch, holder: HostId) -> Result<(), StoreError> {
        let _committer = self.lock_committer()?;
        let current = self.epoch();
        if epoch < current || (epoch == current && holder != self.epoch_holder()) {
            return Err(StoreError::EpochBackwards { requested: epoch, current });
        }
        if epoch == current {
            return Ok(());
        }
        self.write_meta(|meta| {
            meta.epoch = epoch;
            meta.epoch_holder = holder;
        })?;
        self.epoch_holder.store(holder.0, Ordering::Release);
        self.epoch.store(epoch.0, Ordering::Release);
        Ok(())
    }

    /// Change the metadata durably (under its lock, which a checkpoint holds while it commits).
    fn write_meta(&self, change: impl FnOnce(&mut Meta)) -> Result<(), StoreError> {
        let mut meta = lock(&self.shared.meta);
        let mut next = meta.clone();
        change(&mut next);
        if let Err(error) = next.write(&self.shared.dir) {
            self.shared.fail(&error);
            return Err(error);
        }
        *meta = next;
        Ok(())
    }

    /// Whether volumes of these sizes (named in a hello, say) can be held besides the ones the
    /// store has: the ones that exist are left out (or count by what they would grow), the
    /// others must fit whole, in memory and on disk (unless overcommitting); a new clone (the
    /// flag) in memory only, as a snapshot: its disk space is what it will write. Checked
    /// before any is created. A size below a volume's is refused: volumes do not shrink.
    pub fn check_new_volumes(&self, specs: &[(String, u64, bool)]) -> Result<(), StoreError> {
        let mut new = Vec::new();
        let mut clones = Vec::new();
        for (name, size_bytes, clone) in specs {
            match self.volume(name) {
                Some(handle) => {
                    let existing_bytes = self.volume_at(handle).size_bytes();
                    if existing_bytes > *size_bytes {
                        return Err(StoreError::VolumeSizeMismatch {
                            name: name.clone(),
                            existing_bytes,
                            requested_bytes: *size_bytes,
                        });
                    }
                    // A volume that grew while this element was away: the growth must fit.
                    if existing_bytes < *size_bytes {
                        new.push(*size_bytes - existing_bytes);
                    }
                }
                None if *clone => clones.push(*size_bytes),
                None => new.push(*size_bytes),
            }
        }
        if new.is_empty() && clones.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = specs.iter().map(|(n, _, _)| n.as_str()).collect();
        self.check_room_with(&new, &clones)
            .map_err(|reason| StoreError::InvalidVolume { name: names.join(", "), reason })
    }

    /// Room for new volumes of these sizes besides the existing ones; the reason if not.
    fn check_room(&self, new: &[u64]) -> Result<(), String> {
        self.check_room_with(new, &[])
    }

    /// As [`Store::check_room`], with new volumes of `shared` sizes besides: snapshots and
    /// clones. Their block maps take memory like a volume's, but their disk space is only what
    /// they preserve or write, which the disk check cannot know ahead: it counts none (for the
    /// existing ones too; a clone that came to own its content counts whole).
    fn check_room_with(&self, new: &[u64], shared: &[u64]) -> Result<(), String> {
        let volumes = self.volumes.read().expect("volume list lock");
        let whole = |v: &&Arc<Volume>| !v.is_removed() && v.snapshot_of.is_none() && v.clone_base().is_none();
        let mut sizes: Vec<u64> = volumes.iter().filter(whole).map(|v| v.size_bytes()).collect();
        let mut shared_sizes: Vec<u64> = volumes
            .iter()
            .filter(|v| !v.is_removed() && (v.snapshot_of.is_some() || v.clone_base().is_some()))
            .map(|v| v.size_bytes())
            .collect();
        drop(volumes);
        sizes.extend_from_slice(new);
        shared_sizes.extend_from_slice(shared);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let memory = crate::map_memory_bytes(&sizes) + crate::map_memory_bytes(&shared_sizes);
        if memory > self.options.map_memory_bytes_max {
            return Err(format!(
                "the block maps of all volumes would take {:.1} GiB of memory, more than the {:.1} GiB this element allows (the map costs 12 bytes per 4 KiB block)",
                gib(memory),
                gib(self.options.map_memory_bytes_max)
            ));
        }
        if self.options.overcommit || new.is_empty() {
            return Ok(());
        }
        let dir = &self.shared.dir;
        let needed = crate::space_needed_bytes(&sizes, &self.options);
        let free =
            sys::available_bytes(dir).map_err(|e| format!("cannot tell the free space of {}: {e}", dir.display()))?;
        let used = sys::allocated_bytes_under(dir)
            .map_err(|e| format!("cannot tell the space used in {}: {e}", dir.display()))?;
        if needed > free + used {
            return Err(format!(
                "all volumes with their block maps and the log need {:.1} GiB, and this element's file system has {:.1} GiB for it ({:.1} GiB free, {:.1} GiB used by the element); free space, or start the element with --overcommit",
                gib(needed),
                gib(free + used),
                gib(free),
                gib(used)
            ));
        }
        Ok(())
    }

    /// The volume named `name`, created (durably, empty) if there is none. Its size must be a
    /// positive multiple of 4096 bytes, and match if the volume exists.
    pub fn ensure_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeHandle, StoreError> {
        check_new_volume(name, size_bytes)?;
        let mut committer = self.lock_committer()?;
        if self.volume(name).is_none() {
            self.check_room(&[size_bytes])
                .map_err(|reason| StoreError::InvalidVolume { name: name.to_string(), reason })?;
        }
        if let Some(handle) = self.volume(name) {
            let existing_bytes = self.volume_at(handle).size_bytes();
            if existing_bytes > size_bytes {
                return Err(StoreError::VolumeSizeMismatch {
                    name: name.to_string(),
                    existing_bytes,
                    requested_bytes: size_bytes,
                });
            }
            if existing_bytes < size_bytes {
                // It grew while this element was away (a hello names it larger).
                self.grow_locked(&mut committer, handle, size_bytes)?;
            }
            return Ok(handle);
        }
        self.create_volume_locked(&mut committer, name, size_bytes, None, None, None)
    }

    /// Create a volume (a snapshot if `snapshot_of` says so, a clone of the snapshot numbered
    /// `clone_of`, or one a full recovery is to fill if `copy` says so) durably, the commit
    /// lock held: files first (the copy state too), then the metadata (the commit point). The
    /// caller checked the name, the size and the room for it, and holds no lock of the volume
    /// list.
    fn create_volume_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        name: &str,
        size_bytes: u64,
        snapshot_of: Option<SnapshotOf>,
        clone_of: Option<u32>,
        copy: Option<CopyState>,
    ) -> Result<VolumeHandle, StoreError> {
        let invalid = |reason: String| Err(StoreError::InvalidVolume { name: name.to_string(), reason });
        let (count, number) = {
            let meta = lock(&self.shared.meta);
            (meta.volumes.len(), meta.next_volume_number)
        };
        if count >= VOLUMES_MAX {
            return invalid(format!("the store already holds {VOLUMES_MAX} volumes"));
        }
        // The block map's memory first: a volume that cannot have it leaves nothing behind.
        let map = BlockMap::new(size_bytes / BLOCK_BYTES)
            .map_err(|reason| StoreError::InvalidVolume { name: name.to_string(), reason })?;
        let dir = &self.shared.dir;
        let data_path = data_path(dir, number);
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&data_path)
            .map_err(io_error("create volume data", &data_path))?;
        data.set_len(size_bytes).map_err(io_error("size volume data", &data_path))?;
        data.sync_all().map_err(io_error("sync volume data", &data_path))?;
        let map_file = MapFile::create(&map_path(dir, number), name, number, size_bytes)?;
        if let Some(state) = &copy {
            copy::save(dir, number, state)?;
        }
        let volumes_dir = dir.join(VOLUMES_DIR);
        sys::sync_dir(&volumes_dir).map_err(io_error("sync directory", &volumes_dir))?;
        let map_digest = ChunkImages::for_blocks(size_bytes / BLOCK_BYTES).digest();
        self.write_meta(|meta| {
            meta.next_volume_number += 1;
            meta.volumes.push(VolumeMeta {
                number,
                name: name.to_string(),
                size_bytes,
                applied: Sequence::ZERO,
                applied_epoch: Epoch(0),
                map_digest,
                snapshot_of,
                clone_of,
            });
        })?;
        committer.dirty.push(DirtyChunks::for_blocks(size_bytes / BLOCK_BYTES));
        committer.unflushed.push(Unflushed::default());
        let mut volumes = self.volumes.write().expect("volume list lock");
        volumes.push(Arc::new(Volume::new(
            name.to_string(),
            number,
            size_bytes,
            data_path,
            data,
            map_file,
            VolumeState { applied: Sequence::ZERO, applied_epoch: Epoch(0), map },
            copy,
            snapshot_of,
        )));
        volumes.last().expect("just pushed").set_clone_base(clone_of);
        if snapshot_of.is_some() {
            self.snapshot_count.fetch_add(1, Ordering::AcqRel);
        }
        tracing::info!(volume = name, size_bytes, number, snapshot = snapshot_of.is_some(), "volume created");
        Ok(VolumeHandle(volumes.len() as u32 - 1))
    }

    /// Remove a volume durably and free its space: it leaves the metadata (the commit point:
    /// after a crash before it, the volume is still whole; after it, its files are deleted
    /// when the store opens, and the log's records of it are skipped), then its files are
    /// emptied and deleted. From then on every request for it fails with
    /// [`StoreError::Removed`]; its name may be created again (as a new, empty volume). Waits
    /// for a commit under way. Removing a removed volume does nothing. A live volume's
    /// snapshots go with it; a snapshot's blocks that its next older snapshot reads through it
    /// are first handed to that one (see `snapshot::remove_snapshot_locked`).
    pub fn remove_volume(&self, handle: VolumeHandle) -> Result<(), StoreError> {
        let mut committer = self.lock_committer()?;
        let volume = self.volume_at(handle);
        if volume.is_removed() {
            return Ok(());
        }
        if volume.snapshot_of.is_some() {
            let result = self.remove_snapshot_locked(&mut committer, &volume);
            self.guard(result)?;
            drop(committer);
            let result = self.remove_snapshot_files(&[volume]);
            return self.guard(result);
        }
        // Its snapshots go first (a crash between leaves the volume without them).
        let snapshots = self.discard_snapshots_locked(&mut committer, &volume)?;
        let number = volume.number;
        self.write_meta(|meta| meta.volumes.retain(|v| v.number != number))?;
        self.forget_removed(&mut committer, &volume);
        drop(committer);
        // Emptied first: checkpoints and writebacks under way may still hold the files open.
        let dir = &self.shared.dir;
        let result = remove_volume_files(dir, number, Some(&volume));
        self.guard(result)?;
        let result = self.remove_snapshot_files(&snapshots);
        self.guard(result)?;
        tracing::info!(volume = %volume.name, number, snapshots = snapshots.len(), "volume removed");
        Ok(())
    }

    /// Grow a volume to `size_bytes` durably: the new blocks read as zeroes. The metadata is the
    /// commit point (a crash after it finishes the grow when the store opens; before it, the
    /// volume keeps its size). Waits for a commit and a checkpoint under way. A volume never
    /// shrinks: a smaller size is refused, the same size does nothing. The growth must fit
    /// like a new volume of that size would (memory for the map, disk unless overcommitting).
    pub fn resize_volume(&self, handle: VolumeHandle, size_bytes: u64) -> Result<(), StoreError> {
        let mut committer = self.lock_committer()?;
        let volume = self.volume_at(handle);
        if volume.is_removed() {
            return Err(StoreError::Removed { volume: volume.name.clone() });
        }
        self.refuse_snapshot(&volume, "it keeps the size it was taken at")?;
        let existing_bytes = volume.size_bytes();
        if size_bytes < existing_bytes {
            return Err(StoreError::VolumeSizeMismatch {
                name: volume.name.clone(),
                existing_bytes,
                requested_bytes: size_bytes,
            });
        }
        if size_bytes == existing_bytes {
            return Ok(());
        }
        self.grow_locked(&mut committer, handle, size_bytes)
    }

    /// [`Store::resize_volume`]'s work, the commit lock held; `size_bytes` is larger.
    fn grow_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        handle: VolumeHandle,
        size_bytes: u64,
    ) -> Result<(), StoreError> {
        let volume = self.volume_at(handle);
        let name = volume.name.clone();
        let invalid = |reason: String| StoreError::InvalidVolume { name: name.clone(), reason };
        let existing_bytes = volume.size_bytes();
        assert!(size_bytes > existing_bytes, "a grow makes the volume larger");
        if size_bytes % BLOCK_BYTES != 0 || size_bytes > VOLUME_BYTES_MAX {
            return Err(invalid(format!(
                "size {size_bytes} is not a multiple of {BLOCK_BYTES} up to {VOLUME_BYTES_MAX}"
            )));
        }
        self.check_room(&[size_bytes - existing_bytes]).map_err(invalid)?;
        let (old_blocks, new_blocks) = (existing_bytes / BLOCK_BYTES, size_bytes / BLOCK_BYTES);
        // The map's memory first: a grow that cannot have it changes nothing.
        volume.live_state_mut()?.map.reserve(new_blocks).map_err(invalid)?;
        // The metadata's map digest must describe the committed chunk images: no checkpoint
        // may be under way (none can start: seals need the commit lock).
        self.shared.checkpointer.wait_idle(&self.shared);
        self.shared.check_failure()?;
        let number = volume.number;
        self.write_meta(|meta| {
            if let Some(entry) = meta.volumes.iter_mut().find(|v| v.number == number) {
                entry.size_bytes = size_bytes;
                entry.map_digest = crate::block_map::grown_digest(entry.map_digest, old_blocks, new_blocks);
            }
        })?;
        // Committed. The files follow; if this fails, the store fails and opening it again
        // finishes the grow.
        let files = volume
            .data
            .set_len(size_bytes)
            .and_then(|()| volume.data.sync_all())
            .map_err(io_error("grow volume data", &volume.data_path))
            .and_then(|()| volume.map_file.grow(number, size_bytes));
        self.guard(files)?;
        {
            let mut state = volume.state.write().expect("volume lock");
            state.map.grow(new_blocks);
            volume.set_size_bytes(size_bytes);
        }
        committer.dirty[handle.index()].grow(new_blocks);
        tracing::info!(volume = %volume.name, number, existing_bytes, size_bytes, "volume grown");
        Ok(())
    }

    /// The handle of the volume numbered `number` (see [`VolumeHandle::number`]).
    pub fn volume_numbered(&self, number: u32) -> Option<VolumeHandle> {
        let volumes = self.volumes.read().expect("volume list lock");
        ((number as usize) < volumes.len()).then_some(VolumeHandle(number))
    }

    /// The volume named `name`, if the store holds it.
    pub fn volume(&self, name: &str) -> Option<VolumeHandle> {
        let volumes = self.volumes.read().expect("volume list lock");
        volumes
            .iter()
            .position(|v| v.name == name && !v.is_removed() && v.snapshot_of.is_none())
            .map(|i| VolumeHandle(i as u32))
    }

    /// Name and size of every volume, in handle order; a volume removed since the store was
    /// opened, or a snapshot ([`Store::snapshots`] lists those), has size 0.
    pub fn volumes(&self) -> Vec<(String, u64)> {
        let volumes = self.volumes.read().expect("volume list lock");
        volumes
            .iter()
            .map(|v| (v.name.clone(), if v.is_removed() || v.snapshot_of.is_some() { 0 } else { v.size_bytes() }))
            .collect()
    }

    pub fn applied_sequence(&self, volume: VolumeHandle) -> Sequence {
        self.volume_at(volume).state.read().expect("volume lock").applied
    }

    /// Epoch of the volume's last applied record (0 before the first): with the applied
    /// sequence, the `(epoch, sequence)` a failover compares across elements.
    pub fn applied_epoch(&self, volume: VolumeHandle) -> Epoch {
        self.volume_at(volume).state.read().expect("volume lock").applied_epoch
    }

    /// Group commit: log every new record of `batch` with one write and one `fdatasync`, then
    /// apply them in order. Records already applied are skipped; records that cannot be
    /// applied (gap, stale epoch, out of range, damaged base block) are returned in
    /// [`CommitOutcome::rejected`] and change nothing. `Err` means an I/O error: the store then
    /// accepts no more changes until reopened.
    pub fn commit(&self, batch: &[(VolumeHandle, Record)]) -> Result<CommitOutcome, StoreError> {
        let mut committer = self.lock_committer()?;
        // Held for the whole commit (`ensure_volume` takes the committer lock first), but
        // for taking a snapshot, which adds a volume.
        let mut volumes = self.volumes.read().expect("volume list lock");
        let mut outcome = CommitOutcome::default();
        let mut running_epoch = self.epoch();
        // Applied sequence and its epoch, per volume, as of the records accepted so far.
        // Fencing is per volume: along one volume's sequence epochs never go back, but a
        // volume may legitimately still receive (replayed) records of an epoch that another
        // volume has already left behind.
        let mut pending: HashMap<usize, (Sequence, Epoch)> = HashMap::new();
        let mut accepted: Vec<(usize, LogRecord)> = Vec::new();
        // The newest snapshot of each live volume that has one, and what the records accepted
        // so far preserve for snapshots.
        let mut newest = self.newest_snapshots(&volumes);
        let mut preserving = snapshot::Preserving::default();
        for (index, (handle, record)) in batch.iter().enumerate() {
            let i = handle.index();
            let volume = volumes.get(i).expect("a volume handle of this store").clone();
            let (applied, volume_epoch) = pending.entry(i).or_insert_with(|| {
                outcome.applied.push((*handle, Sequence::ZERO));
                let state = volume.state.read().expect("volume lock");
                (state.applied, state.applied_epoch)
            });
            let reject = |error| Rejected { index, volume: *handle, sequence: record.sequence, error };
            if volume.is_removed() {
                outcome.rejected.push(reject(StoreError::Removed { volume: volume.name.clone() }));
                continue;
            }
            if volume.snapshot_of.is_some() {
                let what = "it takes no records";
                outcome.rejected.push(reject(StoreError::Snapshot { volume: volume.name.clone(), what }));
                continue;
            }
            if record.sequence <= *applied {
                outcome.duplicates += 1;
                continue;
            }
            if lock(&volume.copy).is_some() {
                // A full recovery rebuilds the volume and supersedes records still on their way
                // from before it began (a replay that gave up): skipped, not a fault.
                tracing::debug!(volume = %volume.name, sequence = %record.sequence, "record skipped: the volume is being copied");
                outcome.duplicates += 1;
                continue;
            }
            if record.epoch < *volume_epoch {
                outcome.rejected.push(reject(StoreError::StaleEpoch {
                    volume: volume.name.clone(),
                    sequence: record.sequence,
                    epoch: record.epoch,
                    store_epoch: *volume_epoch,
                }));
                continue;
            }
            if record.sequence != applied.next() {
                outcome.rejected.push(reject(StoreError::Gap {
                    volume: volume.name.clone(),
                    applied: *applied,
                    sequence: record.sequence,
                }));
                continue;
            }
            if let Op::Snapshot { id } = record.op {
                // The snapshot's volume exists before its record is logged: a crash between
                // the two leaves a snapshot taken after the applied sequence, which the next
                // open removes. It takes every record accepted before it.
                if !accepted.is_empty() {
                    let result = committer.commit_prepared(self, &volumes, std::mem::take(&mut accepted));
                    self.guard(result)?;
                    preserving = snapshot::Preserving::default();
                }
                drop(volumes);
                let taken = self.take_snapshot_locked(&mut committer, &volume, id, record.sequence);
                volumes = self.volumes.read().expect("volume list lock");
                if let Err(error) = taken {
                    self.shared.check_failure()?;
                    outcome.rejected.push(reject(error));
                    continue;
                }
                newest = self.newest_snapshots(&volumes);
            }
            if let Op::SnapshotDelete { id } = record.op {
                // Its older snapshot takes over its blocks, then its record is logged, then
                // it leaves the metadata; a crash before that is finished by replay (`open`).
                if !accepted.is_empty() {
                    let result = committer.commit_prepared(self, &volumes, std::mem::take(&mut accepted));
                    self.guard(result)?;
                    preserving = snapshot::Preserving::default();
                }
                let prepared =
                    prepare(&volume, i, record, &accepted, &[]).expect("a snapshot's record always prepares");
                let result = self.delete_snapshot_locked(&mut committer, &volumes, &volume, id, prepared);
                self.guard(result)?;
                newest = self.newest_snapshots(&volumes);
                *applied = record.sequence;
                *volume_epoch = record.epoch;
                running_epoch = running_epoch.max(record.epoch);
                continue;
            }
            // A placed write's blocks are changed by no later record of the same commit: a
            // commit written as several log batches may lose its later batches in a power
            // failure, and such a record's apply would have overwritten the placed data. The
            // records before it are committed first.
            if let Some(g) = log::Geometry::of(record.op.offset_bytes(), record.op.length_bytes()) {
                let blocks = g.first..g.last + 1;
                if overlaps(&accepted, i, &blocks, true) {
                    let result = committer.commit_prepared(self, &volumes, std::mem::take(&mut accepted));
                    self.guard(result)?;
                    preserving = snapshot::Preserving::default();
                }
            }
            // A clone reads the blocks it does not own through its base snapshot's chain: a
            // record needs it to merge a partial block, and its snapshot to preserve one. A
            // write of whole blocks to a clone without snapshots (the common case) does not.
            let unaligned = record.op.offset_bytes() % BLOCK_BYTES != 0 || record.op.length_bytes() % BLOCK_BYTES != 0;
            let through = match volume.clone_base() {
                Some(_) if unaligned || newest.contains_key(&i) => match clone::chain_in(&volumes, &volume) {
                    Ok(mut chain) => chain.split_off(1),
                    Err(error) => {
                        outcome.rejected.push(reject(error));
                        continue;
                    }
                },
                _ => Vec::new(),
            };
            match prepare(&volume, i, record, &accepted, &through) {
                Ok(mut prepared) => {
                    if self.options.placed_writes && !newest.contains_key(&i) && volume.clone_base().is_none() {
                        let checkpointed = || {
                            lock(&self.shared.meta)
                                .volumes
                                .iter()
                                .find(|v| v.number == volume.number)
                                .map_or(Sequence(0), |v| v.applied)
                        };
                        place_if_holes(&volume, &mut prepared, &accepted, i, checkpointed);
                    }
                    if let Some(&s) = newest.get(&i) {
                        let result = self.preserve(
                            &mut committer,
                            &volumes,
                            &mut accepted,
                            &mut preserving,
                            (i, &through),
                            s,
                            &prepared,
                        );
                        self.guard(result)?;
                    }
                    let copies = self.copies_of_placed_data(&volume, i, &prepared, &accepted);
                    accepted.extend(self.guard(copies)?.into_iter().map(|copy| (i, copy)));
                    *applied = record.sequence;
                    *volume_epoch = record.epoch;
                    running_epoch = running_epoch.max(record.epoch);
                    accepted.push((i, prepared));
                }
                Err(error) => outcome.rejected.push(reject(error)),
            }
        }
        if !accepted.is_empty() {
            let result = committer.commit_prepared(self, &volumes, accepted);
            self.guard(result)?;
            self.epoch.fetch_max(running_epoch.0, Ordering::AcqRel);
        }
        for (handle, applied) in &mut outcome.applied {
            *applied = volumes[handle.index()].state.read().expect("volume lock").applied;
        }
        let position = committer.log.position;
        if !committer.spare_requested && position >= self.options.checkpoint_log_bytes / 8 {
            committer.spare_requested = true;
            self.shared.checkpointer.want_spare();
        }
        if position >= seal_bytes(&self.options, self.element_id, committer.log.segment) {
            let result = committer.seal(self, &volumes);
            self.guard(result)?;
        }
        Ok(outcome)
    }

    /// Write the data files and block maps durably and start a new log segment, and wait for
    /// it (`commit` starts the same in the background when the live log outgrows
    /// `checkpoint_log_bytes`). A clean shutdown calls this so the next open replays nothing.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        let mut committer = self.lock_committer()?;
        let volumes = self.volumes.read().expect("volume list lock");
        let checkpointer = &self.shared.checkpointer;
        let behind = checkpointer.committed_log_start() != committer.log.segment;
        if committer.log.position > 0 || behind || committer.dirty.iter().any(|d| d.is_dirty()) {
            let result = committer.seal(self, &volumes);
            self.guard(result)?;
        }
        // Holding the commit lock: no later seal can queue more work meanwhile.
        checkpointer.wait_idle(&self.shared);
        self.shared.check_failure()
    }

    /// Read `length_bytes` at `offset_bytes`, with the applied sequence the data reflects.
    /// Every block is checked against its checksum: a mismatch is an error naming the block.
    pub fn read(
        &self,
        volume: VolumeHandle,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Result<(Sequence, Bytes), StoreError> {
        self.read_checked(volume, offset_bytes, length_bytes).map(|(applied, read)| (applied, read.data))
    }

    /// As [`Store::read_checked`], but only if it needs no disk I/O (the file system holds
    /// everything in memory, or the page cache holds the blocks): `Ok(None)` means "read it
    /// the blocking way". For a caller that must not wait (the element's actor).
    pub fn try_read_checked(
        &self,
        volume: VolumeHandle,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Result<Option<(Sequence, ReadData)>, StoreError> {
        let reads = match self.non_blocking_reads.load(Ordering::Relaxed) {
            NON_BLOCKING_ALWAYS => sys::NonBlockingReads::Always,
            NON_BLOCKING_PAGE_CACHE => sys::NonBlockingReads::PageCacheOnly,
            _ => return Ok(None),
        };
        match self.read_with(volume, offset_bytes, length_bytes, Some(reads))? {
            (Attempt::Done, read) => Ok(read),
            (Attempt::Unsupported, _) => {
                self.non_blocking_reads.store(NON_BLOCKING_OFF, Ordering::Relaxed);
                Ok(None)
            }
            (Attempt::WouldBlock, _) => Ok(None),
        }
    }

    /// As [`Store::read`], with the data's piece checksums ([`proto::pieces`]): for a whole
    /// block the one stored with it (which the data was just checked against), for a piece of
    /// a block computed from the data read.
    pub fn read_checked(
        &self,
        volume: VolumeHandle,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Result<(Sequence, ReadData), StoreError> {
        match self.read_with(volume, offset_bytes, length_bytes, None)? {
            (Attempt::Done, Some(read)) => Ok(read),
            (attempt, _) => unreachable!("a read that may wait always reads, not {attempt:?}"),
        }
    }

    /// A read, waiting for the disk or not (`non_blocking`); the data only if it was `Done`.
    fn read_with(
        &self,
        volume: VolumeHandle,
        offset_bytes: u64,
        length_bytes: u32,
        non_blocking: Option<sys::NonBlockingReads>,
    ) -> Result<(Attempt, Option<(Sequence, ReadData)>), StoreError> {
        let volume = self.volume_at(volume);
        volume.check_range(offset_bytes, length_bytes as u64)?;
        if length_bytes > PAYLOAD_BYTES_MAX {
            return Err(StoreError::PayloadTooLarge { volume: volume.name.clone(), length_bytes: length_bytes as u64 });
        }
        if volume.snapshot_of.is_some() || volume.clone_base().is_some() {
            // Read through the snapshot's or the clone's chain, always the blocking way.
            if non_blocking.is_some() {
                return Ok((Attempt::WouldBlock, None));
            }
            return Ok((Attempt::Done, Some(self.read_through_chain(&volume, offset_bytes, length_bytes)?)));
        }
        let Some(geometry) = Geometry::of(offset_bytes, length_bytes as u64) else {
            let applied = volume.live_state()?.applied;
            return Ok((Attempt::Done, Some((applied, ReadData { data: Bytes::new(), crcs: Vec::new() }))));
        };
        let count = geometry.last - geometry.first + 1;
        let len = (count * BLOCK_BYTES) as usize;
        let mut buffer = BytesMut::with_capacity(len);
        let (applied, map) =
            match read_verified(&volume, geometry.first, count, &mut buffer.spare_capacity_mut()[..len], non_blocking)?
            {
                (Attempt::Done, read) => read,
                (attempt, _) => return Ok((attempt, None)),
            };
        // SAFETY: a read that is `Done` wrote every byte of the first `len` (`read_verified`).
        unsafe { buffer.set_len(len) };
        let skip = (offset_bytes - geometry.first * BLOCK_BYTES) as usize;
        let data = buffer.freeze().slice(skip..skip + length_bytes as usize);
        let crcs = piece_crcs(offset_bytes, &data, |i| map.entries[i].1);
        Ok((Attempt::Done, Some((applied, ReadData { data, crcs }))))
    }

    /// A scrub's chunk: blocks `first..first + count` (fewer past the volume's end) read and
    /// each checked against its stored checksum, summarised, with the applied sequence they
    /// reflect. A block that fails is [`StoreError::BlockChecksum`].
    pub fn scrub_chunk(
        &self,
        volume: VolumeHandle,
        first: u64,
        count: u32,
    ) -> Result<(Sequence, Vec<BlockSummary>), StoreError> {
        self.refuse_if_copying(volume)?;
        let v = self.volume_at(volume);
        self.refuse_snapshot(&v, "it is checked through its live volume")?;
        let end = first.saturating_add(count as u64).min(v.blocks());
        if first > end || count as u64 * BLOCK_BYTES > PAYLOAD_BYTES_MAX as u64 {
            return Err(StoreError::OutOfRange {
                volume: v.name.clone(),
                offset_bytes: first.saturating_mul(BLOCK_BYTES),
                length_bytes: count as u64 * BLOCK_BYTES,
                size_bytes: v.size_bytes(),
            });
        }
        if v.clone_base().is_some() {
            let (applied, _, summaries, _) = self.clone_summaries(&v, first, end - first)?;
            return Ok((applied, summaries));
        }
        let len = ((end - first) * BLOCK_BYTES) as usize;
        let mut buffer = Vec::with_capacity(len);
        let (_, (applied, map)) = read_verified(&v, first, end - first, &mut buffer.spare_capacity_mut()[..len], None)?;
        let summaries =
            map.entries.iter().map(|&(allocated, crc, sequence)| BlockSummary { sequence, crc, allocated }).collect();
        Ok((applied, summaries))
    }

    /// Allocated and hole extents of a range, in order, with the applied sequence they
    /// reflect. At most [`crate::BLOCK_STATUS_EXTENTS_MAX`] extents: then they cover only a
    /// prefix of the range (as NBD allows).
    pub fn block_status(
        &self,
        volume: VolumeHandle,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(Sequence, Vec<BlockExtent>), StoreError> {
        let volume = self.volume_at(volume);
        volume.check_range(offset_bytes, length_bytes)?;
        if volume.snapshot_of.is_some() || volume.clone_base().is_some() {
            return self.chain_block_status(&volume, offset_bytes, length_bytes);
        }
        let state = volume.live_state()?;
        Ok((state.applied, volume.block_status(&state.map, offset_bytes, length_bytes)))
    }

    /// Records of `volume` after `after`, in order, from the replay log: at least one, then as
    /// many as fit in `max_bytes` of log frames, up to the applied sequence. Empty if `after`
    /// is already the applied sequence; an error if `after + 1` is no longer held. The
    /// records' `volume` field is zero: the caller sets its own.
    pub fn log_records(
        &self,
        volume: VolumeHandle,
        after: Sequence,
        max_bytes: u64,
    ) -> Result<Vec<Record>, StoreError> {
        let volume = self.volume_at(volume);
        self.refuse_snapshot(&volume, "its preserving records are its element's own")?;
        if lock(&volume.copy).is_some() {
            return Err(StoreError::Copying { volume: volume.name.clone() });
        }
        let applied = volume.live_state()?.applied;
        if after >= applied {
            return Ok(Vec::new());
        }
        let locations =
            lock(&self.shared.log_index).locate(volume.number, after, applied, max_bytes).map_err(|oldest| {
                StoreError::NotInReplayLog { volume: volume.name.clone(), sequence: after.next(), oldest }
            })?;
        let mut records = Vec::with_capacity(locations.len());
        // The locations fit `max_bytes` as logged; a placed write's data, read from the data
        // file, counts too.
        let mut bytes = 0;
        for location in locations {
            let mut record = log::read_record(&location.file, &location.path, location.offset, location.frame)?;
            assert_eq!(record.volume_number, volume.number, "the log index points at this volume's records");
            bytes += u64::from(location.frame) + if record.is_placed() { record.length_bytes } else { 0 };
            if !records.is_empty() && bytes > max_bytes {
                break;
            }
            if record.is_placed() && !self.placed_data(&volume, &mut record)? {
                // Served up to the record before: the caller asks again from there, and is
                // told why no further.
                if records.is_empty() {
                    return Err(StoreError::PlacedRewritten { volume: volume.name.clone(), sequence: record.sequence });
                }
                break;
            }
            records.push(record.to_record());
        }
        Ok(records)
    }

    /// Read every block of the volume, check it against its checksum, and digest the logical
    /// content: the wrapping sum over blocks `b` of `splitmix64(b * 0x9E3779B97F4A7C15 ^
    /// crc32c(content of b))`, holes as zeroes. Blocks the volume's applies while it runs (meant
    /// for an idle or offline store).
    pub fn verify(&self, volume: VolumeHandle) -> Result<VolumeDigest, StoreError> {
        let volume = self.volume_at(volume);
        if volume.snapshot_of.is_some() || volume.clone_base().is_some() {
            return self.verify_through_chain(&volume);
        }
        let state = volume.live_state()?;
        volume.verify(&state)
    }

    /// Reclaim now, on this thread, the file space of every block that became a hole (the
    /// background thread otherwise does it a slice at a time).
    pub fn reclaim(&self) {
        loop {
            while reclaim_slice(&self.reclaim, &self.committer, &self.volumes, &self.shared) {}
            // The background thread may hold a slice whose rest it puts back.
            if self.reclaim.wait_settled() {
                break;
            }
        }
    }

    /// Bytes of volume ranges still to be examined for space to reclaim (an upper bound).
    pub fn reclaim_backlog_bytes(&self) -> u64 {
        self.reclaim.backlog_bytes()
    }

    /// Segment ids of the retained log, oldest first (the last is the live one).
    pub fn log_segments(&self) -> Vec<u64> {
        lock(&self.shared.log_index).segment_ids()
    }

    /// Stall the checkpointer (tests): a checkpoint waits at its start while this is held.
    #[cfg(test)]
    pub(crate) fn checkpoint_gate(&self) -> MutexGuard<'_, ()> {
        lock(&self.shared.checkpointer.gate)
    }

    /// Make every write-back step of a checkpoint fail with EIO from now on (tests).
    #[cfg(test)]
    pub(crate) fn fail_checkpoint_write_back(&self) {
        self.shared.checkpointer.fail_write_back.store(true, Ordering::Relaxed);
    }

    /// Wake the checkpointer each time the writer takes a spare, before it renames it (tests).
    #[cfg(test)]
    pub(crate) fn wake_checkpointer_after_spare_taken(&self) {
        self.shared.checkpointer.wake_after_take.store(true, Ordering::Relaxed);
    }

    /// Wait (at most `timeout`) until the spare the writer asked for is ready (tests: on a
    /// busy machine the writer may otherwise fill its segment before the checkpointer thread
    /// runs, and move on to a new file instead of a spare).
    #[cfg(test)]
    pub(crate) fn wait_for_wanted_spare(&self, timeout: std::time::Duration) {
        self.shared.checkpointer.wait_for_wanted_spare(timeout);
    }

    /// `Err` if `volume` is a snapshot, which cannot do `what`.
    fn refuse_snapshot(&self, volume: &Volume, what: &'static str) -> Result<(), StoreError> {
        match volume.snapshot_of {
            Some(_) => Err(StoreError::Snapshot { volume: volume.name.clone(), what }),
            None => Ok(()),
        }
    }

    fn volume_at(&self, handle: VolumeHandle) -> Arc<Volume> {
        let volumes = self.volumes.read().expect("volume list lock");
        volumes.get(handle.index()).expect("a volume handle of this store").clone()
    }

    fn lock_committer(&self) -> Result<MutexGuard<'_, Committer>, StoreError> {
        let committer = lock(&self.committer);
        self.shared.check_failure()?;
        Ok(committer)
    }

    /// Pass `result` on; on error remember the store as failed.
    fn guard<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(error) = &result {
            self.shared.fail(error);
        }
        result
    }
}

/// Data written to one volume's data file since its writeback was last considered.
///
/// Once [`WRITEBACK_KICK_BYTES`] were written, the committer looks at the span of blocks they
/// fall in. If they fill at least half of it (large or sequential writes), that span's
/// writeback is started now, so that a checkpoint's `fdatasync` finds little left to do.
/// Otherwise (small writes spread over the volume) nothing is started, and the checkpoint
/// writes them back: starting the writeback of a whole file of scattered dirty blocks puts
/// thousands of small writes in the device queue at once, and every log `fdatasync` on that
/// device waits behind them (4 KiB random writes at QD16 on a disk the three elements share:
/// p99 3.0–4.0× the mean with it, 2.6–2.9× without; docs/benchmarks.md).
#[derive(Default)]
struct Unflushed {
    bytes: u64,
    /// First to last block written since.
    blocks: Option<Range<u64>>,
}

impl Unflushed {
    fn add_record(&mut self, record: &LogRecord) {
        if let Some(written) = record.written_blocks() {
            self.add(written, record.written_bytes());
        }
    }

    /// `bytes` were written to the data file within `written`.
    fn add(&mut self, written: Range<u64>, bytes: u64) {
        self.bytes += bytes;
        self.blocks = Some(match self.blocks.take() {
            Some(blocks) => blocks.start.min(written.start)..blocks.end.max(written.end),
            None => written,
        });
    }

    /// The span to write back now, if enough was written and it is dense; resets either way.
    fn take_writeback(&mut self) -> Option<Range<u64>> {
        if self.bytes < WRITEBACK_KICK_BYTES {
            return None;
        }
        let bytes = std::mem::take(&mut self.bytes);
        let blocks = self.blocks.take()?;
        let span_bytes = (blocks.end - blocks.start).saturating_mul(BLOCK_BYTES);
        (span_bytes <= bytes.saturating_mul(2)).then_some(blocks)
    }
}

impl Committer {
    fn commit_prepared(
        &mut self,
        store: &Store,
        volumes: &[Arc<Volume>],
        accepted: Vec<(usize, LogRecord)>,
    ) -> Result<(), StoreError> {
        let (indices, records): (Vec<usize>, Vec<LogRecord>) = accepted.into_iter().unzip();
        let mut holes = Vec::new();
        // Placed writes: their data goes into the data files, durably, before their records
        // are logged. Under the commit lock: nothing else writes or punches the data files.
        // Only their ranges are synced: an `fdatasync` of the data file would also write back
        // what earlier applies left in its page cache, and the small writes of this commit would
        // wait for all of that.
        let mut placed: Vec<(usize, Range<u64>)> = Vec::new();
        let window = store.write_window_bytes();
        for (&i, record) in indices.iter().zip(&records) {
            if let Change::Blocks { first_block, pieces, placed: true, .. } = &record.change {
                let volume = &volumes[i];
                let slices: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
                let offset = first_block * BLOCK_BYTES;
                sys::write_all_vectored_at_windowed(&volume.data, &slices, offset, window)
                    .map_err(io_error("write volume data", &volume.data_path))?;
                placed.push((i, offset..offset + record.length_bytes));
            }
        }
        if !store.in_memory() {
            for (i, range) in joined_ranges(placed) {
                let volume = &volumes[i];
                sys::sync_data_range(&volume.data, range.start, range.end - range.start)
                    .map_err(io_error("sync volume data", &volume.data_path))?;
            }
        }
        let positions = self.log.append(&records)?;
        {
            let mut index = lock(&store.shared.log_index);
            for (record, (offset, frame)) in records.iter().zip(&positions) {
                add_to_index(&mut index, record, *offset, *frame);
            }
            index.set_newest_bytes(self.log.position);
        }
        // Lock each volume once per run of its records, so readers wait only for its own
        // applies.
        let mut locked: Option<(usize, RwLockWriteGuard<'_, VolumeState>)> = None;
        let mut k = 0;
        while k < records.len() {
            let i = indices[k];
            if records[k].kind == Kind::PlacedCopy {
                // Kept for peers only: the blocks are left as they are.
                k += 1;
                continue;
            }
            if locked.as_ref().map(|(l, _)| *l) != Some(i) {
                drop(locked.take());
                locked = Some((i, volumes[i].state.write().expect("volume lock")));
            }
            let (_, state) = locked.as_mut().expect("just locked");
            // Writes whose blocks follow each other (sequential I/O) go out in one pwritev.
            let run_end = block_run_end(&indices, &records, k);
            if run_end - k > 1 {
                let run: Vec<&LogRecord> = records[k..run_end].iter().collect();
                volumes[i].apply_run(state, &mut self.dirty[i], &run, window)?;
            } else {
                let new_holes = volumes[i].apply(state, &mut self.dirty[i], &records[k], window)?;
                if !new_holes.is_empty() {
                    holes.push((i, new_holes));
                }
            }
            for record in &records[k..run_end] {
                self.unflushed[i].add_record(record);
            }
            k = run_end;
        }
        drop(locked);
        // Have the blocks of large writes written back as they come, so the checkpoint's
        // fdatasync finds little left to do (see `Unflushed`). The checkpointer thread starts
        // it: submitting the writes can block for as long as the device queue is full.
        for (i, (unflushed, volume)) in self.unflushed.iter_mut().zip(volumes).enumerate() {
            if let Some(blocks) = unflushed.take_writeback() {
                store.shared.checkpointer.start_writeback(i, volume, blocks);
            }
        }
        for (i, blocks) in holes {
            store.reclaim.push(i, blocks);
        }
        Ok(())
    }

    /// Seal the log for a checkpoint: move the writer to the next segment (if the live one
    /// was written to), take the set of block map chunks changed since, and hand the checkpoint to
    /// the checkpointer thread. Waits only if the checkpointer has fallen
    /// `CHECKPOINT_LAG_SEGMENTS_MAX` segments behind.
    fn seal(&mut self, store: &Store, volumes: &[Arc<Volume>]) -> Result<(), StoreError> {
        let shared = &store.shared;
        let checkpointer = &shared.checkpointer;
        if self.log.position > 0 {
            let next = self.log.segment + 1;
            checkpointer.wait_lag_below(shared, next, CHECKPOINT_LAG_SEGMENTS_MAX)?;
            let (path, file, file_bytes) = match checkpointer.take_spare(next) {
                Some(spare) => {
                    let path = log::segment_path(&shared.dir, next);
                    // Not synced: recovery reads a spare's name as the segment's.
                    fs::rename(&spare.path, &path).map_err(io_error("rename log segment", &spare.path))?;
                    (path, spare.file, spare.file_bytes)
                }
                None => (log::segment_path(&shared.dir, next), LogWriter::create_segment(&shared.dir, next)?, 0),
            };
            {
                let mut index = lock(&shared.log_index);
                index.seal_newest(self.log.position, self.log.file_bytes);
                index.push_segment(next, path.clone(), file.clone(), 0);
            }
            self.log.rotate(next, path, file, file_bytes);
            self.spare_requested = false;
            checkpointer.set_live_segment(next);
        }
        let job = CheckpointJob {
            log_start: self.log.segment,
            epoch: store.epoch(),
            volumes: volumes
                .iter()
                .enumerate()
                .map(|(i, volume)| {
                    let state = volume.state.read().expect("volume lock");
                    VolumeSeal {
                        volume: volume.clone(),
                        index: i,
                        applied: state.applied,
                        applied_epoch: state.applied_epoch,
                        chunks: self.dirty[i].take(),
                    }
                })
                .collect(),
        };
        checkpointer.enqueue(job);
        shared.trim_replay_log(checkpointer.committed_log_start());
        Ok(())
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.reclaim.close();
        if let Some(reclaimer) = self.reclaimer.take() {
            if reclaimer.join().is_err() {
                tracing::error!("the reclaim thread panicked");
            }
        }
        self.shared.checkpointer.close();
        if let Some(checkpointer) = self.checkpointer.take() {
            if checkpointer.join().is_err() {
                tracing::error!("the checkpoint thread panicked");
            }
        }
    }
}

/// Punch one bounded slice of the reclaim queue, under the commit lock. `false` if there was
/// nothing to do.
fn reclaim_slice(
    reclaim: &Reclaim,
    committer: &Mutex<Committer>,
    volumes: &RwLock<Vec<Arc<Volume>>>,
    shared: &Shared,
) -> bool {
    let Some((i, blocks)) = reclaim.pop() else {
        return false;
    };
    let committer = lock(committer);
    if shared.check_failure().is_err() {
        reclaim.clear();
        reclaim.finish();
        return false;
    }
    let volume = volumes.read().expect("volume list lock")[i].clone();
    let Ok(state) = volume.live_state() else {
        // Removed meanwhile: its files are gone.
        drop(committer);
        reclaim.finish();
        return true;
    };
    let scan_end = blocks.end.min(blocks.start + RECLAIM_SCAN_BLOCKS_MAX);
    match reclaim::punch_holes(&volume, &state.map, blocks.start..scan_end, RECLAIM_PUNCH_BYTES_MAX) {
        Ok(done) => reclaim.push_front(i, done..blocks.end),
        Err(error) => tracing::warn!(
            volume = %volume.name,
            path = %volume.data_path.display(),
            %error,
            "cannot punch holes: the space of trimmed blocks is not reclaimed"
        ),
    }
    drop(state);
    drop(committer);
    reclaim.finish();
    true
}

impl Store {
    /// Give a placed write read from the log its data: from the data file for the blocks that
    /// still hold it (their map sequence is still the record's), from the copies logged before
    /// later records changed the others ([`Kind::PlacedCopy`], see
    /// [`Store::copies_of_placed_data`]). `false` if a block's data is in neither: a copy
    /// that could not be made (its read failed).
    fn placed_data(&self, volume: &Volume, record: &mut LogRecord) -> Result<bool, StoreError> {
        let (sequence, number) = (record.sequence, volume.number);
        let Change::Blocks { first_block, pieces, crcs, placed } = &mut record.change else {
            unreachable!("a placed write changes blocks")
        };
        let blocks = *first_block..*first_block + crcs.len() as u64;
        let mut data = BytesMut::zeroed((blocks.end - blocks.start) as usize * BLOCK_BYTES as usize);
        let at = |b: u64| ((b - blocks.start) * BLOCK_BYTES) as usize;
        let mut missing: Vec<u64> = Vec::new();
        {
            let state = volume.live_state()?;
            if blocks.end > volume.blocks() {
                // Never written so (volumes only grow): refused, not a panic on the map.
                return Ok(false);
            }
            let holds = |b: u64| state.map.is_allocated(b) && state.map.sequence(b) == sequence;
            let mut b = blocks.start;
            while b < blocks.end {
                let held = holds(b);
                let end = (b + 1..blocks.end).find(|&k| holds(k) != held).unwrap_or(blocks.end);
                if held {
                    // Checked against the map's checksums, which are the record's.
                    volume.read_blocks(&state.map, b, &mut data[at(b)..at(end)])?;
                } else {
                    missing.extend(b..end);
                }
                b = end;
            }
        }
        if !missing.is_empty() {
            // Each copy was indexed before the record that changed its blocks was applied,
            // so before the map said so above.
            let locations = lock(&self.shared.log_index).placed_copies(number, sequence);
            for location in locations {
                let copy = log::read_record(&location.file, &location.path, location.offset, location.frame)?;
                let Change::Blocks { first_block: from, pieces: copied, crcs: copied_crcs, .. } = &copy.change else {
                    unreachable!("a copy of placed data carries blocks")
                };
                let copied_blocks = *from..from + copied_crcs.len() as u64;
                let content = &copied[0];
                missing.retain(|&b| {
                    if !copied_blocks.contains(&b) {
                        return true;
                    }
                    let k = (b - from) as usize;
                    if copied_crcs[k] != crcs[(b - blocks.start) as usize] {
                        // Not this write's data: never made so (its blocks held this write's
                        // sequence when copied); left missing.
                        tracing::warn!(volume = %volume.name, %sequence, block = b, "a copy of placed data does not match the placed write's checksum");
                        return true;
                    }
                    let source = k * BLOCK_BYTES as usize;
                    data[at(b)..at(b) + BLOCK_BYTES as usize].copy_from_slice(&content[source..source + BLOCK_BYTES as usize]);
                    false
                });
                if missing.is_empty() {
                    break;
                }
            }
            if !missing.is_empty() {
                return Ok(false);
            }
        }
        *pieces = vec![data.freeze()];
        *placed = false;
        Ok(true)
    }

    /// Copies of the data of placed writes still in the replay log that `record` (of volume
    /// `i`, not yet accepted) is about to change in the data file, to log just before it
    /// ([`Kind::PlacedCopy`]). A placed write's data is nowhere else: `log_records` serves it
    /// to lagging peers from the data file while its blocks hold it, then from these copies,
    /// so that a replay need not become a full recovery. Blocks a copy accepted earlier in the
    /// same commit already keeps are left out. Empty unless the replay log holds a placed
    /// write of the volume. The caller holds the commit lock: the blocks do not change
    /// meanwhile. A block that cannot be read is left out, with a warning (a peer that needs it
    /// then recovers in full).
    fn copies_of_placed_data(
        &self,
        volume: &Volume,
        i: usize,
        record: &LogRecord,
        accepted: &[(usize, LogRecord)],
    ) -> Result<Vec<LogRecord>, StoreError> {
        let Some(changed) = record.blocks_changed() else { return Ok(Vec::new()) };
        if !lock(&self.shared.log_index).holds_placed(volume.number) {
            return Ok(Vec::new());
        }
        // Runs of allocated blocks last written by one record, with its sequence.
        let mut runs: Vec<(Range<u64>, Sequence)> = Vec::new();
        {
            let state = volume.live_state()?;
            let map = &state.map;
            let mut b = changed.start;
            while b < changed.end {
                if !map.is_allocated(b) {
                    b += 1;
                    continue;
                }
                let s = map.sequence(b);
                let end =
                    (b + 1..changed.end).find(|&k| !map.is_allocated(k) || map.sequence(k) != s).unwrap_or(changed.end);
                runs.push((b..end, s));
                b = end;
            }
        }
        {
            let index = lock(&self.shared.log_index);
            runs.retain(|(_, s)| index.is_placed(volume.number, *s));
        }
        let kept = |s: Sequence, b: u64| {
            accepted.iter().any(|(v, r)| {
                *v == i
                    && r.kind == Kind::PlacedCopy
                    && r.sequence == s
                    && r.offset_bytes / BLOCK_BYTES <= b
                    && b < (r.offset_bytes + r.length_bytes) / BLOCK_BYTES
            })
        };
        let mut copies = Vec::new();
        for (run, s) in runs {
            let mut b = run.start;
            while b < run.end {
                if kept(s, b) {
                    b += 1;
                    continue;
                }
                let end = (b + 1..run.end).find(|&k| kept(s, k)).unwrap_or(run.end);
                let state = volume.live_state()?;
                let mut data = crate::zeroed_buffer(((end - b) * BLOCK_BYTES) as usize);
                match volume.read_blocks(&state.map, b, &mut data) {
                    Ok(()) => copies.push(LogRecord {
                        volume_number: volume.number,
                        epoch: record.epoch,
                        sequence: s,
                        kind: Kind::PlacedCopy,
                        offset_bytes: b * BLOCK_BYTES,
                        length_bytes: (end - b) * BLOCK_BYTES,
                        change: Change::Blocks {
                            first_block: b,
                            pieces: vec![data.freeze()],
                            crcs: (b..end).map(|k| state.map.crc(k)).collect(),
                            placed: false,
                        },
                    }),
                    Err(error) => tracing::warn!(
                        volume = %volume.name,
                        sequence = %s,
                        blocks = ?(b..end),
                        %error,
                        "cannot keep a placed write's data before it is overwritten: a peer that needs it recovers in full"
                    ),
                }
                b = end;
            }
        }
        Ok(copies)
    }
}

/// `ranges` of volumes' data files, sorted, with the ranges of one volume that touch or overlap
/// joined (the placed writes of a sequential stream: one sync for them all).
pub(crate) fn joined_ranges(mut ranges: Vec<(usize, Range<u64>)>) -> Vec<(usize, Range<u64>)> {
    ranges.sort_by_key(|(i, range)| (*i, range.start));
    let mut joined: Vec<(usize, Range<u64>)> = Vec::with_capacity(ranges.len());
    for (i, range) in ranges {
        match joined.last_mut() {
            Some((last_i, last)) if *last_i == i && range.start <= last.end => last.end = last.end.max(range.end),
            _ => joined.push((i, range)),
        }
    }
    joined
}

/// Whether a record of volume `i` among `accepted` (only placed writes if `placed_only`)
/// changes a block of `blocks`.
fn overlaps(accepted: &[(usize, LogRecord)], i: usize, blocks: &Range<u64>, placed_only: bool) -> bool {
    accepted.iter().any(|(v, r)| {
        *v == i
            && (!placed_only || r.is_placed())
            && r.blocks_changed().is_some_and(|b| b.start < blocks.end && blocks.start < b.end)
    })
}

/// Make `record` a placed write (its data written into the data file before it is logged,
/// the log holding only its checksums; see [`Change::Blocks`]) if that is safe and pays: a
/// write of whole blocks of at least [`PLACED_WRITE_BYTES_MIN`], all of them holes since a
/// change the last committed checkpoint covers (the volume's sequence there, `checkpointed()`,
/// asked only of such a write),
/// none of them changed by a record accepted before it in this commit. The caller has checked
/// that the volume has no snapshot (whose copy-before-write reads old content through the log)
/// and is no clone (whose holes may read through its base).
///
/// Writing where the map says hole overwrites no content: a hole reads as zeroes whatever its
/// file holds. Until the record is durable, a crash leaves the blocks holes; once it is, its
/// data is in the file (synced first), and replay only sets the map. But replay rewrites the
/// data file with every logged write after the checkpoint: one to these blocks before they
/// became holes (a write, then a trim, then this write) would overwrite the placed data, and
/// the block would then fail its checksum. Holes whose last change the checkpoint covers had
/// no such write since it.
fn place_if_holes(
    volume: &Volume,
    record: &mut LogRecord,
    accepted: &[(usize, LogRecord)],
    i: usize,
    checkpointed: impl FnOnce() -> Sequence,
) {
    let Change::Blocks { first_block, crcs, placed, .. } = &mut record.change else {
        return;
    };
    let blocks = *first_block..*first_block + crcs.len() as u64;
    let whole = record.offset_bytes % BLOCK_BYTES == 0 && record.length_bytes % BLOCK_BYTES == 0;
    if !whole || record.length_bytes < PLACED_WRITE_BYTES_MIN || overlaps(accepted, i, &blocks, false) {
        return;
    }
    let checkpointed = checkpointed();
    let state = volume.state.read().expect("volume lock");
    let map = &state.map;
    if !map.is_allocated(blocks.start)
        && map.run_end(blocks.start, blocks.end) == blocks.end
        && blocks.clone().all(|b| map.sequence(b) <= checkpointed)
    {
        *placed = true;
    }
}

/// End of the run of records from `k` that write blocks of one volume, each starting where the
/// previous one ends (at least `k + 1`).
fn block_run_end(indices: &[usize], records: &[LogRecord], k: usize) -> usize {
    let block_end = |record: &LogRecord| match &record.change {
        Change::Blocks { first_block, crcs, placed: false, .. } if record.kind != Kind::PlacedCopy => {
            Some((*first_block, first_block + crcs.len() as u64))
        }
        _ => None,
    };
    let Some((_, mut end)) = block_end(&records[k]) else {
        return k + 1;
    };
    let mut next = k + 1;
    while next < records.len() && indices[next] == indices[k] {
        match block_end(&records[next]) {
            Some((first, last)) if first == end => end = last,
            _ => break,
        }
        next += 1;
    }
    next
}

/// Index a record of the newest segment. If the older segments do not lead up to it (some
/// were lost or damaged), they cannot serve a continuous history and are forgotten.
fn add_to_index(index: &mut LogIndex, record: &LogRecord, offset: u64, frame: u32) {
    if let Err(discontinuity) = index.add_record(record, offset, frame) {
        assert!(discontinuity.at_segment_start, "records of a segment are consecutive: {discontinuity:?}");
        let dropped = index.drop_older_than_newest();
        tracing::warn!(
            volume_number = record.volume_number,
            expected = %discontinuity.expected,
            found = %discontinuity.found,
            segments = dropped.len(),
            "the replay log does not lead up to the live log; forgetting its older segments"
        );
        remove_segments(dropped);
        index.add_record(record, offset, frame).expect("the first record of a volume in the only segment always fits");
    }
}

/// Take the directory's lock file. A child process forked by this process holds a copy of
/// the lock until its exec: wait that out briefly before concluding another owner holds it.
/// A name and size a volume may be created with: 1 to [`VOLUME_NAME_BYTES_MAX`] bytes, a
/// positive multiple of 4096 bytes up to [`VOLUME_BYTES_MAX`].
fn check_new_volume(name: &str, size_bytes: u64) -> Result<(), StoreError> {
    let invalid = |reason: String| Err(StoreError::InvalidVolume { name: name.to_string(), reason });
    if name.is_empty() || name.len() > VOLUME_NAME_BYTES_MAX {
        return invalid(format!("names have 1 to {VOLUME_NAME_BYTES_MAX} bytes"));
    }
    if size_bytes == 0 || size_bytes % BLOCK_BYTES != 0 || size_bytes > VOLUME_BYTES_MAX {
        return invalid(format!(
            "size {size_bytes} is not a positive multiple of {BLOCK_BYTES} up to {VOLUME_BYTES_MAX}"
        ));
    }
    Ok(())
}

fn lock_directory(dir: &Path) -> Result<File, StoreError> {
    let lock_path = dir.join(LOCK_FILE);
    let lock_file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(io_error("open lock file", &lock_path))?;
    let mut waited_ms = 0;
    while !sys::try_lock_exclusive(&lock_file).map_err(io_error("lock", &lock_path))? {
        if waited_ms >= LOCK_WAIT_MS {
            return Err(StoreError::Locked { path: dir.to_path_buf() });
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited_ms += 10;
    }
    Ok(lock_file)
}

/// Give a segment found under its spare name (the writer's rename was not synced) its own.
fn rename_to_segment(dir: &Path, id: u64, path: &Path) -> Result<(), StoreError> {
    let segment_path = log::segment_path(dir, id);
    if path != segment_path {
        fs::rename(path, &segment_path).map_err(io_error("rename log segment", path))?;
    }
    Ok(())
}

/// Zero the segment header and the first batch header of an unused segment, durably: a first
/// batch that was written but whose segment header was lost must never become valid later.
fn wipe_segment_start(file: &File, path: &Path) -> Result<(), StoreError> {
    let file_bytes = file.metadata().map_err(io_error("stat", path))?.len();
    if file_bytes == 0 {
        return Ok(());
    }
    let wiped = (log::SEGMENT_HEADER_BYTES + log::BATCH_HEADER_BYTES) as u64;
    file.write_all_at(&vec![0u8; wiped.min(file_bytes) as usize], 0).map_err(io_error("wipe log segment", path))?;
    file.sync_data().map_err(io_error("sync log", path))
}

/// What the replay of the log applies to.
struct Replay<'a> {
    volumes: &'a [Arc<Volume>],
    /// Numbers below it without a volume: volumes removed after their records were logged.
    next_volume_number: u32,
    /// See [`write_window_bytes`].
    write_window: u64,
}

/// The most bytes of a data file one write of an apply covers, in commits and in replay alike:
/// [`crate::WRITE_WINDOW_BYTES`], but unbounded for a store in memory, whose file system keeps
/// no block buffers to walk.
fn write_window_bytes(in_memory: bool) -> u64 {
    if in_memory {
        1 << 63
    } else {
        crate::WRITE_WINDOW_BYTES
    }
}

/// Replay one segment written since the checkpoint: apply every valid batch. A sealed segment
/// (`sealed_end`: where the next segment's header says its log ends) must be valid up to
/// there. The last segment's log ends at its first invalid batch: a torn tail is cut off (with
/// a warning), damage followed by valid batches refuses to open. Returns the end of its log
/// and the newest epoch of its records. The snapshots whose deletion it logged (live volume
/// number, id) are added to `deleted_snapshots`.
fn replay_segment(
    id: u64,
    segment: &FoundSegment,
    sealed_end: Option<u64>,
    replay: &Replay<'_>,
    dirty: &mut [DirtyChunks],
    index: &mut LogIndex,
    deleted_snapshots: &mut Vec<(u32, u64)>,
) -> Result<(u64, Epoch), StoreError> {
    let (volumes, next_volume_number) = (replay.volumes, replay.next_volume_number);
    let numbers: HashMap<u32, usize> = volumes.iter().enumerate().map(|(i, v)| (v.number, i)).collect();
    let (path, file) = (&segment.path, &segment.file);
    index.push_segment(id, path.clone(), file.clone(), 0);
    let mut epoch = Epoch(0);
    let (valid_end, torn) = log::scan_segment(file, path, id, sealed_end, |offset, frame, record| {
        let corrupt = |reason: String| StoreError::CorruptLog { path: path.clone(), offset, reason };
        let Some(&i) = numbers.get(&record.volume_number) else {
            if record.volume_number < next_volume_number {
                // Its volume was removed after the record was logged.
                epoch = epoch.max(record.epoch);
                return Ok(());
            }
            return Err(corrupt(format!("record for unknown volume number {}", record.volume_number)));
        };
        let volume = &volumes[i];
        if record.kind == Kind::PlacedCopy {
            // Data of an earlier placed write, kept for peers: nothing to apply. Volumes only
            // grow, so one past the end is damage, as for any record.
            if volume.check_range(record.offset_bytes, record.length_bytes).is_err() {
                return Err(corrupt(format!("copy of placed data ends past volume {:?}", volume.name)));
            }
            add_to_index(index, &record, offset, frame);
            epoch = epoch.max(record.epoch);
            return Ok(());
        }
        let mut state = volume.state.write().expect("volume lock");
        if record.sequence != state.applied.next() {
            return Err(corrupt(format!(
                "record of sequence {} for volume {:?} does not follow its applied sequence {}",
                record.sequence, volume.name, state.applied
            )));
        }
        if !record.kind.changes_no_block() && volume.check_range(record.offset_bytes, record.length_bytes).is_err() {
            return Err(corrupt(format!("record of sequence {} ends past volume {:?}", record.sequence, volume.name)));
        }
        add_to_index(index, &record, offset, frame);
        if record.kind == Kind::SnapshotDelete {
            deleted_snapshots.push((volume.number, record.offset_bytes));
        }
        // The holes need no reclaiming here: `open` queues every volume whole.
        volume.apply(&mut state, &mut dirty[i], &record, replay.write_window)?;
        epoch = epoch.max(record.epoch);
        Ok(())
    })?;
    let file_bytes = file.metadata().map_err(io_error("stat", path))?.len();
    index.seal_newest(valid_end, file_bytes);
    if let Some(end) = sealed_end {
        if valid_end != end || torn.is_some() {
            return Err(StoreError::CorruptLog {
                path: path.clone(),
                offset: valid_end,
                reason: format!(
                    "{}; the segment was sealed with its log ending at byte {end} (refusing to \
                     skip records)",
                    torn.map_or("the log ends early".to_string(), |t| t.reason)
                ),
            });
        }
        return Ok((valid_end, epoch));
    }
    if let Some(torn) = torn {
        if let Some(next) = log::find_batch_after(file, path, id, torn.offset)? {
            return Err(StoreError::CorruptLog {
                path: path.clone(),
                offset: torn.offset,
                reason: format!(
                    "{}; a valid batch (or the sync mark written after an fdatasync) follows at \
                     byte {next}, so these records were durable and acknowledged: damage, not a \
                     torn tail (refusing to skip records). `starfish element repair --data DIR` \
                     keeps what is intact and has the volumes repaired from their peers",
                    torn.reason
                ),
            });
        }
        if !torn.clean {
            tracing::warn!(
                segment = %path.display(),
                offset = torn.offset,
                bytes_discarded = file_bytes - torn.offset,
                reason = %torn.reason,
                "torn tail of the log (a commit cut short by a crash): discarding it"
            );
            file.set_len(valid_end).map_err(io_error("truncate log", path))?;
            file.sync_all().map_err(io_error("sync log", path))?;
        }
    }
    Ok((valid_end, epoch))
}

/// Create the layout of an empty store in `dir`, which must hold nothing else.
fn initialize(dir: &Path) -> Result<Meta, StoreError> {
    let not_a_store = || StoreError::NotAStore { path: dir.to_path_buf() };
    for entry in fs::read_dir(dir).map_err(io_error("list", dir))? {
        let entry = entry.map_err(io_error("list", dir))?;
        let name = entry.file_name();
        match name.to_str() {
            Some(LOCK_FILE) | Some("meta.tmp") => {}
            Some(VOLUMES_DIR) | Some(log::LOG_DIR) => {
                // Left by an initialization that crashed: acceptable only if empty of data.
                for inner in fs::read_dir(entry.path()).map_err(io_error("list", &entry.path()))? {
                    let inner = inner.map_err(io_error("list", &entry.path()))?;
                    let bytes = inner.metadata().map_err(io_error("stat", &inner.path()))?.len();
                    if name == VOLUMES_DIR || bytes != 0 {
                        return Err(not_a_store());
                    }
                    fs::remove_file(inner.path()).map_err(io_error("remove", &inner.path()))?;
                }
            }
            _ => return Err(not_a_store()),
        }
    }
    for sub in [VOLUMES_DIR, log::LOG_DIR] {
        let path = dir.join(sub);
        fs::create_dir_all(&path).map_err(io_error("create directory", &path))?;
    }
    sys::sync_dir(dir).map_err(io_error("sync directory", dir))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sys::sync_dir(parent).map_err(io_error("sync directory", parent))?;
    }
    let meta = Meta {
        epoch: Epoch(0),
        epoch_holder: HostId(0),
        element_id: fresh_element_id(),
        generation: 0,
        log_start: 1,
        next_volume_number: 0,
        volumes: Vec::new(),
    };
    LogWriter::create_segment(dir, meta.log_start)?;
    meta.write(dir)?;
    tracing::info!(dir = %dir.display(), "created an empty store");
    Ok(meta)
}

/// Where the live log segment `segment` of the element `element_id` is sealed (a checkpoint
/// begins): at a size between three quarters of `checkpoint_log_bytes` and all of it, drawn
/// from the two. The replicas of a volume receive the same writes, so with one fixed size
/// they would checkpoint in step, and a write then waits on a quorum that is all
/// checkpointing at once (4 KiB random writes at QD16, three elements on one disk: p99 about
/// 3.0 times the mean against 2.4 staggered; docs/benchmarks.md). Drawn, not random: the same
/// store seals the same segment at the same size every time.
pub(crate) fn seal_bytes(options: &StoreOptions, element_id: u64, segment: u64) -> u64 {
    let spread = options.checkpoint_log_bytes / 4 / BLOCK_BYTES;
    let draw = proto::splitmix64(element_id ^ proto::splitmix64(segment));
    options.checkpoint_log_bytes - draw % (spread + 1) * BLOCK_BYTES
}

/// A random, non-zero element identity.
fn fresh_element_id() -> u64 {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return id;
        }
    }
}

/// Delete the files of volumes the metadata does not name (a removal that a crash
/// interrupted after its commit point; or a creation cut short before its own).
fn remove_orphan_files(dir: &Path, meta: &Meta) -> Result<(), StoreError> {
    let volumes_dir = dir.join(VOLUMES_DIR);
    let entries = match fs::read_dir(&volumes_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error("list", &volumes_dir)(e)),
    };
    let mut orphans = std::collections::BTreeSet::new();
    for entry in entries {
        let entry = entry.map_err(io_error("list", &volumes_dir))?;
        let name = entry.file_name();
        let Some(number) = name.to_str().and_then(|n| n.split('.').next()).and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if number < meta.next_volume_number && !meta.volumes.iter().any(|v| v.number == number) {
            orphans.insert(number);
        }
    }
    for number in orphans {
        tracing::info!(number, "deleting the files of a removed volume");
        remove_volume_files(dir, number, None)?;
    }
    Ok(())
}

/// Empty and delete the files of volume `number` (data, map, copy state), then sync the
/// directory. Missing files are fine (a removal a crash interrupted).
fn remove_volume_files(dir: &Path, number: u32, open: Option<&Volume>) -> Result<(), StoreError> {
    if let Some(volume) = open {
        volume.unmap_data();
        volume.data.set_len(0).map_err(io_error("empty volume data", &volume.data_path))?;
        volume.map_file.truncate()?;
    }
    for path in [data_path(dir, number), map_path(dir, number), copy::copy_path(dir, number)] {
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error("remove", &path)(e)),
        }
    }
    let volumes_dir = dir.join(VOLUMES_DIR);
    sys::sync_dir(&volumes_dir).map_err(io_error("sync directory", &volumes_dir))
}

fn open_volume(dir: &Path, meta: &Meta, volume_meta: &VolumeMeta) -> Result<(Arc<Volume>, ChunkImages), StoreError> {
    let data_path = data_path(dir, volume_meta.number);
    let data =
        OpenOptions::new().read(true).write(true).open(&data_path).map_err(io_error("open volume data", &data_path))?;
    let mut data_bytes = data.metadata().map_err(io_error("stat", &data_path))?.len();
    let map_path = map_path(dir, volume_meta.number);
    // A grow whose commit point (the metadata) was reached before a crash is finished: the
    // map file's header, written last, still has the old size; the data file may too.
    let grown_from = MapFile::finish_grow(&map_path, &volume_meta.name, volume_meta.number, volume_meta.size_bytes)?;
    if grown_from == Some(data_bytes) {
        data.set_len(volume_meta.size_bytes).map_err(io_error("size volume data", &data_path))?;
        data.sync_all().map_err(io_error("sync volume data", &data_path))?;
        data_bytes = volume_meta.size_bytes;
    }
    if data_bytes != volume_meta.size_bytes {
        return Err(StoreError::InvalidVolume {
            name: volume_meta.name.clone(),
            reason: format!("{} holds {data_bytes} bytes, the volume {}", data_path.display(), volume_meta.size_bytes),
        });
    }
    let (map_file, map, images) = MapFile::load(
        &map_path,
        &volume_meta.name,
        volume_meta.number,
        volume_meta.size_bytes,
        meta.generation,
        volume_meta.map_digest,
    )?;
    let volume = Volume::new(
        volume_meta.name.clone(),
        volume_meta.number,
        volume_meta.size_bytes,
        data_path,
        data,
        map_file,
        VolumeState { applied: volume_meta.applied, applied_epoch: volume_meta.applied_epoch, map },
        copy::load(dir, volume_meta.number)?,
        volume_meta.snapshot_of,
    );
    volume.set_clone_base(volume_meta.clone_of);
    Ok((Arc::new(volume), images))
}

/// Index a closed segment of the replay log (`sealed_end`: where the next segment's header
/// says its log ends, if it says). Damage there costs only history: the segment and
/// everything older are forgotten (and deleted), with a warning, never skipped over.
fn index_closed_segment(
    id: u64,
    segment: FoundSegment,
    sealed_end: Option<u64>,
    index: &mut LogIndex,
) -> Result<(), StoreError> {
    let FoundSegment { path, file, header } = segment;
    let file_bytes = file.metadata().map_err(io_error("stat", &path))?.len();
    index.push_segment(id, path.clone(), file.clone(), 0);
    let scanned = if header.is_none() {
        Ok((0, Some(log::Torn { offset: 0, reason: "no valid segment header".into(), clean: false })))
    } else {
        log::scan_segment(&file, &path, id, sealed_end, |offset, frame, record| {
            match index.add_record(&record, offset, frame) {
                Ok(()) => Ok(()),
                Err(discontinuity) if discontinuity.at_segment_start => {
                    let dropped = index.drop_older_than_newest();
                    tracing::warn!(
                        segment = %path.display(),
                        expected = %discontinuity.expected,
                        found = %discontinuity.found,
                        "replay log segments do not follow each other; forgetting the older ones"
                    );
                    remove_segments(dropped);
                    index.add_record(&record, offset, frame).expect("fits after the drop");
                    Ok(())
                }
                Err(discontinuity) => Err(StoreError::CorruptLog {
                    path: path.clone(),
                    offset,
                    reason: format!("sequence {} where {} was expected", discontinuity.found, discontinuity.expected),
                }),
            }
        })
    };
    let damage = match scanned {
        // Without a known end, the log of a preallocated segment ends at its first invalid
        // batch; with one, it must reach it.
        Ok((end, torn))
            if (sealed_end.is_none() && torn.as_ref().map_or(true, |t| t.clean))
                || (sealed_end == Some(end) && torn.is_none()) =>
        {
            index.seal_newest(end, file_bytes);
            return Ok(());
        }
        Ok((end, torn)) => StoreError::CorruptLog {
            path: path.clone(),
            offset: end,
            reason: torn
                .map_or_else(|| format!("the log ends before byte {sealed_end:?}, where it was sealed"), |t| t.reason),
        },
        Err(error @ StoreError::CorruptLog { .. }) => error,
        Err(error) => return Err(error),
    };
    tracing::warn!(
        error = %damage,
        "a closed replay log segment is damaged; forgetting and deleting it and every older segment \
         (peers needing those records fall back to a full recovery)"
    );
    remove_segments(index.clear());
    Ok(())
}

fn remove_segments(segments: Vec<log::Segment>) {
    for segment in segments {
        if let Err(error) = fs::remove_file(&segment.path) {
            tracing::warn!(segment = %segment.path.display(), %error, "cannot remove a log segment");
        }
    }
}

/// Read blocks `first..first + count` of `volume` into `buffer` (zeroes for holes; it need not
/// be initialized, and every byte of it is written when the read is `Done`), each checked
/// against its stored checksum, with the block map entries and applied sequence they
/// reflect. The disk read runs without the volume lock, so that a slow read never delays a
/// commit's apply; a commit that changed a block under it shows as a checksum mismatch with a
/// newer applied sequence, and the read is tried again (the last time under the lock). A
/// mismatch at an unchanged sequence is real damage.
fn read_verified(
    volume: &Volume,
    first: u64,
    count: u64,
    buffer: &mut [std::mem::MaybeUninit<u8>],
    non_blocking: Option<sys::NonBlockingReads>,
) -> Result<(Attempt, (Sequence, MapSlice)), StoreError> {
    let read =
        |map: &MapSlice, buffer: &mut [std::mem::MaybeUninit<u8>]| volume.read_blocks_into(map, buffer, non_blocking);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let state = volume.live_state()?;
        let (map, applied) = (MapSlice::of(&state.map, first, count), state.applied);
        if attempt > READ_UNLOCKED_ATTEMPTS_MAX {
            let done = read(&map, buffer)?;
            return Ok((done, (applied, map)));
        }
        drop(state);
        match read(&map, buffer) {
            Ok(done) => return Ok((done, (applied, map))),
            Err(e @ StoreError::BlockChecksum { .. }) => {
                if volume.live_state()?.applied == applied {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The checksums of the pieces of `data` read at `offset_bytes` ([`proto::pieces`]): a whole
/// block's is the stored one (`block_crc` of its index in the read, which checked the data
/// against it), a piece of a block's is computed.
fn piece_crcs(offset_bytes: u64, data: &[u8], block_crc: impl Fn(usize) -> u32) -> Vec<u32> {
    proto::pieces::piece_ranges(offset_bytes, data.len())
        .enumerate()
        .map(|(i, range)| if range.len() == BLOCK_BYTES as usize { block_crc(i) } else { proto::crc32c(&data[range]) })
        .collect()
}

/// Resolve a record against the volume's current content (and the records accepted before it
/// in the same batch): range checks, and partial edge blocks merged into whole blocks.
fn prepare(
    volume: &Volume,
    i: usize,
    record: &Record,
    earlier: &[(usize, LogRecord)],
    through: &[Arc<Volume>],
) -> Result<LogRecord, StoreError> {
    let (kind, offset_bytes, length_bytes) = match &record.op {
        Op::Write { offset_bytes, data, .. } => (Kind::Write, *offset_bytes, data.len() as u64),
        Op::Trim { offset_bytes, length_bytes } => (Kind::Trim, *offset_bytes, *length_bytes),
        Op::WriteZeroes { offset_bytes, length_bytes } => (Kind::WriteZeroes, *offset_bytes, *length_bytes),
        // The snapshot's id goes where other records keep their offset.
        Op::Snapshot { id } => (Kind::Snapshot, *id, 0),
        Op::SnapshotDelete { id } => (Kind::SnapshotDelete, *id, 0),
        Op::Begin => (Kind::Begin, 0, 0),
    };
    if kind.changes_no_block() {
        return Ok(LogRecord {
            volume_number: volume.number,
            epoch: record.epoch,
            sequence: record.sequence,
            kind,
            offset_bytes,
            length_bytes,
            change: Change::Nothing,
        });
    }
    volume.check_range(offset_bytes, length_bytes)?;
    if kind == Kind::Write && length_bytes > PAYLOAD_BYTES_MAX as u64 {
        return Err(StoreError::PayloadTooLarge { volume: volume.name.clone(), length_bytes });
    }
    // The piece checksums came with the write from the host element, which computed them
    // when it received it: the data must still match them, and whole blocks keep them.
    record.op.check_data().map_err(|mismatch| StoreError::RecordChecksum {
        volume: volume.name.clone(),
        sequence: record.sequence,
        detail: mismatch.to_string(),
    })?;
    let base = |block: u64| base_block(volume, i, block, earlier, through);
    let change = match (Geometry::of(offset_bytes, length_bytes), &record.op) {
        (None, _) => Change::Nothing,
        (Some(g), Op::Write { data, crcs: piece_crcs, .. }) => {
            let end = offset_bytes + length_bytes;
            let mut pieces = Vec::with_capacity(3);
            let mut position = offset_bytes;
            if g.head_partial {
                let block_start = g.first * BLOCK_BYTES;
                let mut merged = base(g.first)?;
                let n = (end.min(block_start + BLOCK_BYTES) - offset_bytes) as usize;
                let at = (offset_bytes - block_start) as usize;
                merged[at..at + n].copy_from_slice(&data[..n]);
                pieces.push(merged.freeze());
                position += n as u64;
            }
            let whole_end = if g.tail_partial { g.last * BLOCK_BYTES } else { end };
            if position < whole_end {
                pieces.push(data.slice((position - offset_bytes) as usize..(whole_end - offset_bytes) as usize));
                position = whole_end;
            }
            if g.tail_partial {
                let mut merged = base(g.last)?;
                let n = (end - position) as usize;
                merged[..n].copy_from_slice(&data[(position - offset_bytes) as usize..]);
                pieces.push(merged.freeze());
            }
            // One block per piece checksum: the merged edge blocks get new ones, whole blocks
            // keep the host element's.
            let last_piece = piece_crcs.len() - 1;
            let crcs = piece_crcs
                .iter()
                .enumerate()
                .map(|(k, &crc)| match k {
                    0 if g.head_partial => proto::crc32c(pieces.first().expect("a head piece")),
                    k if k == last_piece && g.tail_partial => proto::crc32c(pieces.last().expect("a tail piece")),
                    _ => crc,
                })
                .collect();
            Change::Blocks { first_block: g.first, pieces, crcs, placed: false }
        }
        (Some(g), _) => {
            let end = offset_bytes + length_bytes;
            let zeroed_edge = |block: u64, zero: std::ops::Range<u64>| -> Result<Edge, StoreError> {
                let content = match base_content(volume, i, block, earlier, through)? {
                    None => None,
                    Some(base) => {
                        let mut merged = BytesMut::from(&base[..]);
                        merged[zero.start as usize..zero.end as usize].fill(0);
                        if merged.iter().all(|b| *b == 0) {
                            None
                        } else {
                            let crc = proto::crc32c(&merged);
                            Some((merged.freeze(), crc))
                        }
                    }
                };
                Ok(Edge { block, content })
            };
            let head = if g.head_partial {
                let block_start = g.first * BLOCK_BYTES;
                Some(zeroed_edge(
                    g.first,
                    offset_bytes - block_start..end.min(block_start + BLOCK_BYTES) - block_start,
                )?)
            } else {
                None
            };
            let tail = if g.tail_partial { Some(zeroed_edge(g.last, 0..end - g.last * BLOCK_BYTES)?) } else { None };
            Change::Zero { head, whole: g.whole(), tail }
        }
    };
    Ok(LogRecord {
        volume_number: volume.number,
        epoch: record.epoch,
        sequence: record.sequence,
        kind,
        offset_bytes,
        length_bytes,
        change,
    })
}

/// A block's content as a mutable copy (zeroes for a hole).
fn base_block(
    volume: &Volume,
    i: usize,
    block: u64,
    earlier: &[(usize, LogRecord)],
    through: &[Arc<Volume>],
) -> Result<BytesMut, StoreError> {
    Ok(match base_content(volume, i, block, earlier, through)? {
        Some(content) => BytesMut::from(&content[..]),
        None => BytesMut::zeroed(BLOCK_BYTES as usize),
    })
}

/// A block's content as of the records accepted so far (`None`: a hole), checked against its
/// checksum when read from the data file. A clone's block it does not own is read through its
/// chain after it, `through` (empty for a volume that is no clone).
fn base_content(
    volume: &Volume,
    i: usize,
    block: u64,
    earlier: &[(usize, LogRecord)],
    through: &[Arc<Volume>],
) -> Result<Option<Bytes>, StoreError> {
    for (_, record) in earlier.iter().rev().filter(|(v, _)| *v == i) {
        if let Some(content) = record.content_of(block) {
            return Ok(content);
        }
    }
    let state = volume.state.read().expect("volume lock");
    if volume.clone_base().is_some() && !Volume::owns(&state.map, block) {
        assert!(!through.is_empty(), "volume {}: a clone's base content is read through its chain", volume.name);
        drop(state);
        return Ok(clone::content_through(through, block)?.map(|(content, _)| content));
    }
    if !state.map.is_allocated(block) {
        return Ok(None);
    }
    let mut content = BytesMut::zeroed(BLOCK_BYTES as usize);
    volume.read_blocks(&state.map, block, &mut content)?;
    Ok(Some(content.freeze()))
}

impl LogRecord {
    /// The content this record leaves in `block`: `None` if it does not touch it,
    /// `Some(None)` if it leaves a hole.
    fn content_of(&self, block: u64) -> Option<Option<Bytes>> {
        if self.kind == Kind::PlacedCopy {
            return None; // It keeps data for peers and changes nothing.
        }
        match &self.change {
            Change::Nothing => None,
            Change::Blocks { first_block, pieces, crcs, .. } => {
                if block < *first_block || block >= first_block + crcs.len() as u64 {
                    return None;
                }
                let mut at = (block - first_block) * BLOCK_BYTES;
                for piece in pieces {
                    if at < piece.len() as u64 {
                        return Some(Some(piece.slice(at as usize..(at + BLOCK_BYTES) as usize)));
                    }
                    at -= piece.len() as u64;
                }
                unreachable!("pieces cover every block of the record")
            }
            Change::Zero { head, whole, tail } => {
                for edge in [head, tail].into_iter().flatten() {
                    if edge.block == block {
                        return Some(edge.content.as_ref().map(|(b, _)| b.clone()));
                    }
                }
                whole.contains(&block).then_some(None)
            }
        }
    }
}

/// A volume whose block map is damaged: a fresh, empty map (every block a hole at sequence 0;
/// the log replays the records after the checkpoint onto it), and a pending repair, whose full
/// recovery fetches every block the source holds. The volume's applied sequence and log stay.
///
/// A snapshot's damaged block map cannot be rebuilt (nothing copies a snapshot from a peer):
/// the snapshot leaves the metadata (its files go at the next open). Returns whether it was a
/// snapshot.
fn repair_block_map(dir: &Path, volume: &str, error: &StoreError) -> Result<bool, StoreError> {
    let mut meta = Meta::read(dir)?.ok_or_else(|| StoreError::Failed { reason: "no metadata".into() })?;
    let Some(entry) = meta.volumes.iter_mut().find(|v| v.name == volume) else {
        return Err(StoreError::Failed { reason: format!("volume {volume} is not in the metadata ({error})") });
    };
    if entry.snapshot_of.is_some() {
        let number = entry.number;
        meta.volumes.retain(|v| v.number != number);
        meta.write(dir)?;
        return Ok(true);
    }
    MapFile::create(&map_path(dir, entry.number), volume, entry.number, entry.size_bytes)?;
    entry.map_digest = ChunkImages::for_blocks(entry.size_bytes / BLOCK_BYTES).digest();
    let number = entry.number;
    meta.write(dir)?;
    // An empty map: not intact, it serves no peer's copy.
    copy::save(dir, number, &CopyState::fresh(true))?;
    Ok(false)
}

/// What `Store::repair` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// One line per change made, in order.
    pub actions: Vec<String>,
    /// Volumes now waiting for a repair from their peers (records they had acknowledged may
    /// be gone from this element).
    pub volumes_to_repair: Vec<String>,
}

impl Store {
    /// Make a store that refuses to open because its log is damaged openable again, keeping
    /// everything intact: a damaged segment of the replay log (already covered by a checkpoint)
    /// is dropped with the older ones; damage in the log written since the last checkpoint
    /// truncates it there (the later segments go too), and every volume becomes a repair (a
    /// full recovery that verifies every block and fetches what differs or fails its checksum
    /// from a peer), since records it had acknowledged may be gone. Then it checkpoints. A
    /// store that opens as it is is left alone. Damaged block maps are not repaired.
    pub fn repair(dir: &Path, options: StoreOptions) -> Result<RepairReport, StoreError> {
        const ATTEMPTS_MAX: usize = 64;
        let mut report = RepairReport::default();
        let mut truncated = false;
        for _ in 0..ATTEMPTS_MAX {
            let error = match Store::open(dir, options) {
                Ok(store) => {
                    if truncated {
                        // Size 0: a snapshot (dropped with its volume's repair below).
                        for (name, size_bytes) in store.volumes().into_iter().filter(|(_, size)| *size > 0) {
                            let handle = store.ensure_volume(&name, size_bytes)?;
                            // Its snapshots may have lost preserving records with the log:
                            // they go (the repair's full copy would drop them anyway).
                            let dropped = store.drop_snapshots(handle)?;
                            if dropped > 0 {
                                report.actions.push(format!("removed the {dropped} snapshot(s) of volume {name}"));
                            }
                            // Its log was cut: blocks may hold what dropped records wrote.
                            store.mark_for_repair(handle, 0, false)?;
                            if !report.volumes_to_repair.contains(&name) {
                                report.volumes_to_repair.push(name);
                            }
                        }
                        store.checkpoint()?;
                        report.actions.push("checkpoint written".into());
                    }
                    return Ok(report);
                }
                Err(error) => error,
            };
            if let StoreError::CorruptBlockMap { volume, .. } = &error {
                let volume = volume.clone();
                if repair_block_map(dir, &volume, &error)? {
                    report.actions.push(format!("removed snapshot {volume}, whose block map is damaged: {error}"));
                } else {
                    report.actions.push(format!("rebuilt the block map of volume {volume} as empty: {error}"));
                    report.volumes_to_repair.push(volume);
                }
                continue;
            }
            let StoreError::CorruptLog { path, offset, .. } = &error else {
                return Err(error);
            };
            let id = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split('.').next())
                .and_then(|n| n.parse::<u64>().ok())
                .ok_or_else(|| StoreError::Failed {
                    reason: format!("cannot tell the segment of {}", path.display()),
                })?;
            let log_start = Meta::read(dir)?.map_or(1, |m| m.log_start);
            let files = log::list_log_files(dir)?;
            if id < log_start {
                // Replay log only: its records are in the data files already.
                for (other, paths) in files.segments.range(..=id) {
                    for p in paths {
                        fs::remove_file(p).map_err(io_error("remove", p))?;
                    }
                    report.actions.push(format!("dropped replay log segment {other} ({error})"));
                }
            } else {
                let file = OpenOptions::new().write(true).open(path).map_err(io_error("open", path))?;
                let before = file.metadata().map_err(io_error("stat", path))?.len();
                let at = (*offset).max(log::SEGMENT_HEADER_BYTES as u64).min(before);
                file.set_len(at).map_err(io_error("truncate log", path))?;
                file.sync_all().map_err(io_error("sync log", path))?;
                report
                    .actions
                    .push(format!("truncated log segment {id} at byte {at} ({} bytes dropped): {error}", before - at));
                for (other, paths) in files.segments.range(id + 1..) {
                    for p in paths {
                        fs::remove_file(p).map_err(io_error("remove", p))?;
                    }
                    report.actions.push(format!("dropped log segment {other}, written after the damage"));
                }
                truncated = true;
            }
            let log_dir = dir.join(log::LOG_DIR);
            sys::sync_dir(&log_dir).map_err(io_error("sync directory", &log_dir))?;
        }
        Err(StoreError::Failed { reason: format!("the log is still damaged after {ATTEMPTS_MAX} repairs") })
    }
}

#[cfg(test)]
mod unflushed_tests {
    use super::*;

    const KICK_BLOCKS: u64 = WRITEBACK_KICK_BYTES / BLOCK_BYTES;

    #[test]
    fn sequential_writes_are_written_back_over_their_span() {
        let mut unflushed = Unflushed::default();
        let piece = 256;
        let mut next = 1000;
        while next + piece <= 1000 + KICK_BLOCKS {
            assert_eq!(unflushed.take_writeback(), None, "not before {WRITEBACK_KICK_BYTES} bytes");
            unflushed.add(next..next + piece, piece * BLOCK_BYTES);
            next += piece;
        }
        assert_eq!(unflushed.take_writeback(), Some(1000..1000 + KICK_BLOCKS));
        assert_eq!(unflushed.take_writeback(), None, "taken once");
        unflushed.add(5..6, BLOCK_BYTES);
        assert_eq!(unflushed.blocks, Some(5..6), "a new span starts after a writeback");
    }

    #[test]
    fn scattered_small_writes_are_left_to_the_checkpoint() {
        let mut unflushed = Unflushed::default();
        for i in 0..KICK_BLOCKS {
            // Every third block: a third of the span written.
            unflushed.add(i * 3..i * 3 + 1, BLOCK_BYTES);
        }
        assert_eq!(unflushed.take_writeback(), None);
        assert_eq!((unflushed.bytes, unflushed.blocks.clone()), (0, None), "reset: the next span starts afresh");
        for i in 0..KICK_BLOCKS {
            // Every other block: half of the span, still dense enough.
            unflushed.add(i * 2..i * 2 + 1, BLOCK_BYTES);
        }
        assert_eq!(unflushed.take_writeback(), Some(0..KICK_BLOCKS * 2 - 1));
    }
}
