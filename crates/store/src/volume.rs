//! One volume: its sparse data file and in-memory block map. Applying a logged record only
//! writes whole blocks and punches holes; every block read is checked against the block map.

use std::{fs::File, mem::MaybeUninit, ops::Range, os::unix::fs::FileExt, path::PathBuf, sync::RwLock};

use proto::{BlockExtent, Epoch, Sequence, BLOCK_BYTES};

use crate::{
    block_map::{zero_block_crc, BlockMap, DirtyChunks, MapFile},
    error::io_error,
    log::{Change, LogRecord},
    sys, StoreError, BLOCK_STATUS_EXTENTS_MAX, SCAN_BUFFER_BYTES,
};

/// [`Volume::clone_base`] of a volume that is no clone.
const NOT_A_CLONE: u64 = u64::MAX;

pub struct Volume {
    pub name: String,
    pub number: u32,
    /// Grows only (`Store::resize_volume`), after the block map grew: a reader that saw the
    /// new size finds the map's entries.
    size_bytes: std::sync::atomic::AtomicU64,
    pub data_path: PathBuf,
    pub data: File,
    /// Written only by checkpoints (one at a time).
    pub map_file: MapFile,
    /// Held for writing only while a record is applied, so a reader sees the block map, the
    /// data file and the applied sequence of one moment.
    pub state: RwLock<VolumeState>,
    /// A full recovery in progress (mirrors `volumes/<n>.copy`): while set, records of the
    /// volume are skipped and its log is not served.
    pub copy: std::sync::Mutex<Option<crate::CopyState>>,
    /// Removed (`Store::remove_volume`): its files are gone (or going), its map is empty, and
    /// every request for it fails. Its handle stays taken until the store is reopened.
    pub removed: std::sync::atomic::AtomicBool,
    /// Set if this volume is a snapshot of another (read-only; see [`crate::meta::SnapshotOf`]).
    pub snapshot_of: Option<crate::meta::SnapshotOf>,
    /// Set while this live volume is a clone: the volume number of the snapshot it reads the
    /// blocks it does not own through (see [`crate::meta::VolumeMeta::clone_of`]). Cleared
    /// (with the metadata) once the clone owns its whole content. [`NOT_A_CLONE`]: none (an
    /// atomic: every read of every live volume asks).
    clone_of: std::sync::atomic::AtomicU64,
    /// How applies write the data file: through a mapping if the file is in memory (tmpfs),
    /// else `pwritev` (see [`sys::MappedWrites`]). Used under the store's commit lock.
    data_writes: std::sync::Mutex<sys::MappedWrites>,
}

/// What a read that may not wait for the disk did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// Read (and checked) it all.
    Done,
    /// Part of it is not in memory: read it the blocking way.
    WouldBlock,
    /// The file system cannot tell what is in memory: never try again.
    Unsupported,
}

/// The block map's (allocated, crc) of a run of blocks, copied under the volume lock.
pub struct MapSlice {
    pub first: u64,
    /// Per block: allocated, crc32c, sequence of the record that last changed it.
    pub entries: Vec<(bool, u32, Sequence)>,
}

impl MapSlice {
    pub fn of(map: &BlockMap, first: u64, count: u64) -> MapSlice {
        MapSlice {
            first,
            entries: (first..first + count).map(|b| (map.is_allocated(b), map.crc(b), map.sequence(b))).collect(),
        }
    }
}

pub struct VolumeState {
    pub applied: Sequence,
    /// Epoch of the record of sequence `applied` (0 before the first).
    pub applied_epoch: Epoch,
    pub map: BlockMap,
}

impl Volume {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        number: u32,
        size_bytes: u64,
        data_path: PathBuf,
        data: File,
        map_file: MapFile,
        state: VolumeState,
        copy: Option<crate::CopyState>,
        snapshot_of: Option<crate::meta::SnapshotOf>,
    ) -> Volume {
        // Applies write a live volume's data file through a mapping where it is in memory.
        let in_memory = snapshot_of.is_none()
            && data_path
                .parent()
                .is_some_and(|dir| matches!(sys::non_blocking_reads(dir), Ok(sys::NonBlockingReads::Always)));
        Volume {
            name,
            number,
            size_bytes: std::sync::atomic::AtomicU64::new(size_bytes),
            data_path,
            data,
            map_file,
            state: RwLock::new(state),
            copy: std::sync::Mutex::new(copy),
            removed: std::sync::atomic::AtomicBool::new(false),
            snapshot_of,
            clone_of: std::sync::atomic::AtomicU64::new(NOT_A_CLONE),
            data_writes: std::sync::Mutex::new(sys::MappedWrites::new(in_memory)),
        }
    }

    /// The snapshot (volume number) this clone reads through, if it is a clone.
    pub fn clone_base(&self) -> Option<u32> {
        match self.clone_of.load(std::sync::atomic::Ordering::Acquire) {
            NOT_A_CLONE => None,
            base => Some(base as u32),
        }
    }

    /// The volume reads through snapshot `base` from now on (`None`: it owns its content).
    pub fn set_clone_base(&self, base: Option<u32>) {
        let value = base.map_or(NOT_A_CLONE, u64::from);
        self.clone_of.store(value, std::sync::atomic::Ordering::Release);
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The volume is `size_bytes` long from now on (called with its state locked for writing,
    /// once the block map holds every block).
    pub fn set_size_bytes(&self, size_bytes: u64) {
        assert!(size_bytes >= self.size_bytes(), "volumes only grow");
        self.size_bytes.store(size_bytes, std::sync::atomic::Ordering::Release);
    }

    pub fn blocks(&self) -> u64 {
        self.size_bytes() / BLOCK_BYTES
    }

    /// Whether this snapshot holds block `block` itself (preserved it, content or hole),
    /// rather than reading it through (see [`crate::meta::SnapshotOf`]).
    pub fn owns(map: &BlockMap, block: u64) -> bool {
        map.is_allocated(block) || map.sequence(block) > Sequence::ZERO
    }

    /// `Ok` if `offset + length` stays inside the volume.
    /// The state for reading, unless the volume was removed (checked under the lock: a removal
    /// empties the map while it holds the lock for writing).
    pub fn live_state(&self) -> Result<std::sync::RwLockReadGuard<'_, VolumeState>, StoreError> {
        let state = self.state.read().expect("volume lock");
        if self.is_removed() {
            return Err(StoreError::Removed { volume: self.name.clone() });
        }
        Ok(state)
    }

    /// As [`Volume::live_state`], for writing.
    pub fn live_state_mut(&self) -> Result<std::sync::RwLockWriteGuard<'_, VolumeState>, StoreError> {
        let state = self.state.write().expect("volume lock");
        if self.is_removed() {
            return Err(StoreError::Removed { volume: self.name.clone() });
        }
        Ok(state)
    }

    pub fn is_removed(&self) -> bool {
        self.removed.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn check_range(&self, offset_bytes: u64, length_bytes: u64) -> Result<(), StoreError> {
        if self.is_removed() {
            return Err(StoreError::Removed { volume: self.name.clone() });
        }
        match offset_bytes.checked_add(length_bytes) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(StoreError::OutOfRange {
                volume: self.name.clone(),
                offset_bytes,
                length_bytes,
                size_bytes: self.size_bytes(),
            }),
        }
    }

    /// Apply a durable record that follows `state.applied`, its blocks written one aligned
    /// `window` of the file at a time. Returns the blocks that became
    /// holes: their file space is still to be reclaimed (see `reclaim`).
    pub fn apply(
        &self,
        state: &mut VolumeState,
        chunks: &mut DirtyChunks,
        record: &LogRecord,
        window: u64,
    ) -> Result<Range<u64>, StoreError> {
        self.apply_written(state, chunks, record, Some(window))
    }

    /// Write the blocks of consecutive block-writing records (whose blocks follow each other)
    /// with one `pwritev` per aligned `window` of the file (see
    /// [`crate::WRITE_WINDOW_BYTES`]), then apply them. The caller holds `state` for
    /// writing.
    pub fn apply_run(
        &self,
        state: &mut VolumeState,
        chunks: &mut DirtyChunks,
        records: &[&LogRecord],
        window: u64,
    ) -> Result<(), StoreError> {
        let mut slices: Vec<&[u8]> = Vec::new();
        let mut start = None;
        let mut next = 0;
        for record in records {
            let Change::Blocks { first_block, pieces, crcs, placed: false } = &record.change else {
                unreachable!("a run holds block writes that are not placed only")
            };
            if start.is_some() {
                assert_eq!(next, *first_block, "the blocks of a run follow each other");
            }
            start.get_or_insert(*first_block);
            next = first_block + crcs.len() as u64;
            slices.extend(pieces.iter().map(|p| &p[..]));
        }
        let Some(start) = start else {
            return Ok(());
        };
        self.write_data(&slices, start * BLOCK_BYTES, window)?;
        for record in records {
            let holes = self.apply_written(state, chunks, record, None)?;
            debug_assert!(holes.is_empty());
        }
        Ok(())
    }

    /// Write `slices`, back to back, at `offset` of the data file: through its mapping if it is
    /// in memory, else one aligned `window` at a time. The caller holds the commit lock (nothing
    /// punches or truncates the file meanwhile).
    fn write_data(&self, slices: &[&[u8]], offset: u64, window: u64) -> Result<(), StoreError> {
        let error = io_error("write volume data", &self.data_path);
        let mut writes = self.data_writes.lock().expect("data writes lock");
        if writes.is_on() {
            writes.write(&self.data, self.size_bytes(), slices, offset).map_err(error)
        } else {
            sys::write_all_vectored_at_windowed(&self.data, slices, offset, window).map_err(error)
        }
    }

    /// `length` bytes at `offset` of the data file are about to be punched: the next write
    /// there through the mapping makes its pages present again. The caller holds the commit
    /// lock.
    pub fn data_punched(&self, offset: u64, length: u64) {
        self.data_writes.lock().expect("data writes lock").punched(offset, length);
    }

    /// Let go of the data file's mapping, if any (before the file is emptied).
    pub fn unmap_data(&self) {
        self.data_writes.lock().expect("data writes lock").unmap();
    }

    /// `apply`, a record's carried blocks written one `write_window` at a time; `None`: they are
    /// already in the data file.
    fn apply_written(
        &self,
        state: &mut VolumeState,
        chunks: &mut DirtyChunks,
        record: &LogRecord,
        write_window: Option<u64>,
    ) -> Result<Range<u64>, StoreError> {
        assert_eq!(record.sequence, state.applied.next(), "volume {}: records apply in sequence order", self.name);
        let sequence = record.sequence;
        let mut holes = 0..0;
        match &record.change {
            Change::Nothing => {}
            Change::Blocks { first_block, pieces, crcs, placed } => {
                // A placed write's data is in the file already (written and synced before
                // its record was logged).
                if let (Some(window), false) = (write_window, *placed) {
                    let slices: Vec<&[u8]> = pieces.iter().map(|p| &p[..]).collect();
                    self.write_data(&slices, first_block * BLOCK_BYTES, window)?;
                }
                for (i, crc) in crcs.iter().enumerate() {
                    state.map.set_written(first_block + i as u64, sequence, *crc);
                }
                chunks.mark_dirty(*first_block..first_block + crcs.len() as u64);
            }
            Change::Zero { head, whole, tail } => {
                let span_start = head.as_ref().map_or(whole.start, |e| e.block);
                let span_end = tail.as_ref().map_or(whole.end, |e| e.block + 1);
                // Edge blocks with content are at the ends of the span; the rest is one hole.
                holes = span_start..span_end;
                for edge in [head, tail].into_iter().flatten() {
                    if let Some((content, _)) = &edge.content {
                        self.data
                            .write_all_at(content, edge.block * BLOCK_BYTES)
                            .map_err(io_error("write volume data", &self.data_path))?;
                        if edge.block == holes.start {
                            holes.start += 1;
                        } else {
                            assert_eq!(edge.block + 1, holes.end, "an edge block is at an end of the span");
                            holes.end -= 1;
                        }
                    }
                }
                state.map.set_holes(span_start..span_end, sequence);
                for edge in [head, tail].into_iter().flatten() {
                    if let Some((_, crc)) = &edge.content {
                        state.map.set_written(edge.block, sequence, *crc);
                    }
                }
                chunks.mark_dirty(span_start..span_end);
            }
        }
        state.applied = sequence;
        state.applied_epoch = record.epoch;
        Ok(holes)
    }

    /// Fill `out` (whole blocks) with the content of the blocks from `first`, verifying every
    /// allocated block against its checksum; holes are written as zeroes. The caller holds the
    /// volume lock that `map` is under.
    pub fn read_blocks(&self, map: &BlockMap, first: u64, out: &mut [u8]) -> Result<(), StoreError> {
        debug_assert_eq!(out.len() as u64 % BLOCK_BYTES, 0);
        self.read_blocks_unlocked(&MapSlice::of(map, first, out.len() as u64 / BLOCK_BYTES), out)
    }

    /// As [`Volume::read_blocks`], against a copy of the block map's entries taken under the
    /// volume lock, without holding it: a record applied meanwhile can make a block fail its
    /// (old) checksum, which the caller tells from real damage by the applied sequence.
    pub fn read_blocks_unlocked(&self, map: &MapSlice, out: &mut [u8]) -> Result<(), StoreError> {
        // SAFETY: `read_map_blocks` writes only what it read and zeroes.
        let out = unsafe { sys::as_uninit(out) };
        match self.read_map_blocks(map, out, None)? {
            Attempt::Done => Ok(()),
            Attempt::WouldBlock | Attempt::Unsupported => unreachable!("a blocking read always reads"),
        }
    }

    /// As [`Volume::read_blocks_unlocked`] into a buffer that need not be initialized, waiting
    /// for the disk (`reads` `None`) or not: when it is `Done`, every byte of `out` is written
    /// (holes as zeroes).
    pub fn read_blocks_into(
        &self,
        map: &MapSlice,
        out: &mut [MaybeUninit<u8>],
        reads: Option<sys::NonBlockingReads>,
    ) -> Result<Attempt, StoreError> {
        self.read_map_blocks(map, out, reads)
    }

    /// Every byte of `out` written, runs of allocated blocks read and checked, holes zeroed, or
    /// `WouldBlock` / `Unsupported` (then `out` holds garbage).
    fn read_map_blocks(
        &self,
        map: &MapSlice,
        out: &mut [MaybeUninit<u8>],
        non_blocking: Option<sys::NonBlockingReads>,
    ) -> Result<Attempt, StoreError> {
        let block_bytes = BLOCK_BYTES as usize;
        assert_eq!(out.len(), map.entries.len() * block_bytes, "a whole block of room per map entry");
        let entries = &map.entries;
        let mut i = 0;
        while i < entries.len() {
            // A run of allocated blocks is read with one system call, then checked block by
            // block (a 1 MiB read was 256 `pread`s); a run of holes is zeroed.
            let allocated = entries[i].0;
            let run_end = entries[i..].iter().position(|entry| entry.0 != allocated).map_or(entries.len(), |n| i + n);
            let run = &mut out[i * block_bytes..run_end * block_bytes];
            if !allocated {
                sys::zero_uninit(run);
                i = run_end;
                continue;
            }
            let offset = (map.first + i as u64) * BLOCK_BYTES;
            let read_error = io_error("read volume data", &self.data_path);
            let run = match non_blocking {
                None | Some(sys::NonBlockingReads::Always) => {
                    sys::read_exact_at_uninit(&self.data, run, offset).map_err(read_error)?
                }
                Some(sys::NonBlockingReads::PageCacheOnly) => {
                    match sys::read_exact_at_cached(&self.data, run, offset) {
                        Ok(Some(run)) => run,
                        Ok(None) => return Ok(Attempt::WouldBlock),
                        Err(e) if e.kind() == std::io::ErrorKind::Unsupported => return Ok(Attempt::Unsupported),
                        Err(e) => return Err(read_error(e)),
                    }
                }
            };
            self.check_run(map.first + i as u64, run, |b| entries[(b - map.first) as usize].1)?;
            i = run_end;
        }
        Ok(Attempt::Done)
    }

    /// Check each block of `run`, read from block `first` on, against its checksum (`crc` of
    /// its block number).
    fn check_run(&self, first: u64, run: &[u8], crc: impl Fn(u64) -> u32) -> Result<(), StoreError> {
        for (i, content) in run.chunks_exact(BLOCK_BYTES as usize).enumerate() {
            let b = first + i as u64;
            let actual = proto::crc32c(content);
            if actual != crc(b) {
                return Err(self.checksum_error(b, crc(b), actual));
            }
        }
        Ok(())
    }

    fn checksum_error(&self, block: u64, expected: u32, actual: u32) -> StoreError {
        StoreError::BlockChecksum { volume: self.name.clone(), path: self.data_path.clone(), block, expected, actual }
    }

    /// Allocation extents of `[offset, offset + length)`, at most
    /// [`BLOCK_STATUS_EXTENTS_MAX`] of them (then covering only a prefix of the range).
    pub fn block_status(&self, map: &BlockMap, offset_bytes: u64, length_bytes: u64) -> Vec<BlockExtent> {
        let mut extents = Vec::new();
        if length_bytes == 0 {
            return extents;
        }
        let end_bytes = offset_bytes + length_bytes;
        let end_block = (end_bytes - 1) / BLOCK_BYTES + 1;
        let mut block = offset_bytes / BLOCK_BYTES;
        let mut position = offset_bytes;
        while block < end_block && extents.len() < BLOCK_STATUS_EXTENTS_MAX {
            let run_end = map.run_end(block, end_block);
            let extent_end = (run_end * BLOCK_BYTES).min(end_bytes);
            extents.push(BlockExtent { length_bytes: extent_end - position, allocated: map.is_allocated(block) });
            position = extent_end;
            block = run_end;
        }
        extents
    }

    /// Read and check every block; see [`crate::Store::verify`].
    pub fn verify(&self, state: &VolumeState) -> Result<crate::VolumeDigest, StoreError> {
        let map = &state.map;
        let blocks = self.blocks();
        let mut digest = 0u64;
        let mut blocks_corrupt = 0;
        let mut first_corrupt_block = None;
        let mut buffer = vec![0u8; SCAN_BUFFER_BYTES as usize];
        let mut block = 0;
        while block < blocks {
            let end = (block + SCAN_BUFFER_BYTES / BLOCK_BYTES).min(blocks);
            while block < end {
                let run_end = map.run_end(block, end);
                if map.is_allocated(block) {
                    let run = &mut buffer[..((run_end - block) * BLOCK_BYTES) as usize];
                    self.data
                        .read_exact_at(run, block * BLOCK_BYTES)
                        .map_err(io_error("read volume data", &self.data_path))?;
                    for (i, content) in run.chunks_exact(BLOCK_BYTES as usize).enumerate() {
                        let b = block + i as u64;
                        let actual = proto::crc32c(content);
                        if actual != map.crc(b) {
                            tracing::warn!(error = %self.checksum_error(b, map.crc(b), actual), "verify");
                            blocks_corrupt += 1;
                            first_corrupt_block.get_or_insert(b);
                        }
                        digest = digest.wrapping_add(block_digest(b, actual));
                    }
                } else {
                    for b in block..run_end {
                        digest = digest.wrapping_add(block_digest(b, zero_block_crc()));
                    }
                }
                block = run_end;
            }
        }
        Ok(crate::VolumeDigest {
            applied_sequence: state.applied,
            content_digest: digest,
            blocks_total: blocks,
            blocks_allocated: map.allocated_blocks(),
            blocks_corrupt,
            first_corrupt_block,
        })
    }
}

/// One block's term of the content digest: splitmix64's finalizer over the block number and
/// its content's crc32c. Summing the terms makes the digest independent of read order.
pub fn block_digest(block: u64, crc: u32) -> u64 {
    let mut z = block.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ crc as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
