//! Full recovery, both sides: the source answers a chunk with the blocks whose summary differs
//! from the target's; the target installs them directly (no log), makes them durable with a
//! checkpoint before it moves its resume cursor, and at the end adopts the sequence its blocks
//! are at least as new as.
//!
//! Why the result is exact: every block the target holds at the end of a pass was read from an
//! in-sync source whose applied sequence was at least the pass's `base`, so each block is the
//! volume's content at some sequence `>= base`. Replaying the records after `base` in order
//! (the ordinary replay and quick recovery do) then leaves every block at its newest content:
//! a block that none of them writes was already current, and a block that some of them write
//! ends with the last of them, whichever older or newer content it had before.
//!
//! Durable state: `volumes/<n>.copy` while a copy is in progress (its presence makes the
//! volume "copying": no records are applied, no log served, the element says so in its
//! welcome); see `docs/on-disk-format.md`.

use std::{
    fs::{self, File, OpenOptions},
    io::Write,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use proto::{BlockChunk, BlockCopy, BlockSummary, Epoch, Sequence, BLOCK_BYTES, COPY_CHUNK_BLOCKS_MAX};

use super::{lock, remove_segments, Store, VOLUMES_DIR};
use crate::{error::io_error, sys, StoreError, VolumeHandle};

/// 02: the `verify` flag (byte 12, covered by the checksum, which starts at byte 12), and the
/// `intact` flag (byte 13, 0 in files written before it). 01 (the checksum from byte 16, no
/// flag) is read as `verify: false`.
const COPY_MAGIC: &[u8; 8] = b"SFCOPY02";
const COPY_MAGIC_V1: &[u8; 8] = b"SFCOPY01";
const COPY_FILE_BYTES: usize = 48;

/// A full recovery of one volume in progress, as persisted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyState {
    /// Epoch of the host element that ordered the copy: a copy ordered by another one starts
    /// over (blocks copied under an older epoch may hold writes the new one never made).
    pub epoch: Epoch,
    /// The source's applied sequence when this pass began (and its record's epoch): every
    /// block copied since is at least as new. `Sequence::ZERO` until the first chunk arrives.
    pub base: Sequence,
    pub base_epoch: Epoch,
    /// Blocks before this one are compared (and, where they differed, installed) durably.
    pub cursor_block: u64,
    /// A repair: the element found a block failing its checksum, so this copy also reads its
    /// own blocks and fetches every one whose content does not match its checksum (a summary
    /// alone would call such a block equal to the source's).
    pub verify: bool,
    /// A pending repair this element made itself on finding a block that fails its checksum:
    /// its block map and log are intact, only blocks may be bad, so the volume may serve a
    /// peer's copy the blocks that pass their checksum (never one made by `Store::repair`,
    /// whose map may be empty or whose log was cut).
    pub intact: bool,
}

pub(super) fn copy_path(dir: &Path, number: u32) -> PathBuf {
    dir.join(VOLUMES_DIR).join(format!("{number}.copy"))
}

impl CopyState {
    /// A repair no host element has ordered yet: the volume's blocks and log still hold its
    /// applied sequence (only some blocks fail their checksum).
    pub fn is_pending_repair(&self) -> bool {
        self.verify && self.epoch == Epoch(0) && self.base == Sequence::ZERO && self.cursor_block == 0
    }

    fn encode(&self) -> [u8; COPY_FILE_BYTES] {
        let mut out = [0u8; COPY_FILE_BYTES];
        out[0..8].copy_from_slice(COPY_MAGIC);
        out[16..24].copy_from_slice(&self.epoch.0.to_le_bytes());
        out[24..32].copy_from_slice(&self.base.0.to_le_bytes());
        out[32..40].copy_from_slice(&self.base_epoch.0.to_le_bytes());
        out[40..48].copy_from_slice(&self.cursor_block.to_le_bytes());
        out[12] = self.verify as u8;
        out[13] = self.intact as u8;
        let crc = proto::crc32c(&out[12..]);
        out[8..12].copy_from_slice(&crc.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Result<CopyState, String> {
        if bytes.len() != COPY_FILE_BYTES {
            return Err(format!("{} bytes, expected {COPY_FILE_BYTES}", bytes.len()));
        }
        let covered = match &bytes[0..8] {
            m if m == COPY_MAGIC => 12,
            m if m == COPY_MAGIC_V1 => 16,
            _ => return Err("bad magic".into()),
        };
        let stored = u32::from_le_bytes(bytes[8..12].try_into().expect("4"));
        let actual = proto::crc32c(&bytes[covered..]);
        if stored != actual {
            return Err(format!("checksum mismatch: stored {stored:#010x}, content {actual:#010x}"));
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        Ok(CopyState {
            epoch: Epoch(u64_at(16)),
            base: Sequence(u64_at(24)),
            base_epoch: Epoch(u64_at(32)),
            cursor_block: u64_at(40),
            verify: covered == 12 && bytes[12] != 0,
            intact: covered == 12 && bytes[13] == 1,
        })
    }
}

/// The copy state of a volume, if its file exists. A damaged file is not an error: the copy
/// was in progress, so it starts over from block 0 (nothing is lost, only time).
pub(super) fn load(dir: &Path, number: u32) -> Result<Option<CopyState>, StoreError> {
    let path = copy_path(dir, number);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("read copy state", &path)(e)),
    };
    match CopyState::decode(&bytes) {
        Ok(state) => Ok(Some(state)),
        Err(reason) => {
            tracing::warn!(path = %path.display(), %reason, "copy state damaged; the full recovery starts over, verifying every block");
            Ok(Some(CopyState::fresh(true)))
        }
    }
}

/// Replace the copy state file atomically (write, sync, rename, sync the directory).
pub(super) fn save(dir: &Path, number: u32, state: &CopyState) -> Result<(), StoreError> {
    let path = copy_path(dir, number);
    let tmp = path.with_extension("copy.tmp");
    let mut file: File = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io_error("create copy state", &tmp))?;
    file.write_all(&state.encode()).map_err(io_error("write copy state", &tmp))?;
    file.sync_data().map_err(io_error("sync copy state", &tmp))?;
    fs::rename(&tmp, &path).map_err(io_error("rename copy state", &tmp))?;
    let volumes_dir = dir.join(VOLUMES_DIR);
    sys::sync_dir(&volumes_dir).map_err(io_error("sync directory", &volumes_dir))
}

impl Store {
    /// The full recovery in progress for `volume`, if any.
    pub fn copy_state(&self, volume: VolumeHandle) -> Option<CopyState> {
        *lock(&self.volume_at(volume).copy)
    }

    pub(super) fn refuse_if_copying(&self, volume: VolumeHandle) -> Result<(), StoreError> {
        let v = self.volume_at(volume);
        if lock(&v.copy).is_some() {
            return Err(StoreError::Copying { volume: v.name.clone() });
        }
        Ok(())
    }

    /// A copy source: not a volume being copied, nor a repair, unless it is a pending repair
    /// this element made itself (`CopyState::intact`) of a volume without snapshots that is no
    /// clone: its map and log are as committed and its applied sequence holds, so the blocks
    /// that pass their checksum are what they were at that sequence (a bad one fails the
    /// chunk that needs it, as on any source).
    fn refuse_as_copy_source(&self, volume: VolumeHandle) -> Result<(), StoreError> {
        let v = self.volume_at(volume);
        let state = *lock(&v.copy);
        let serves = state.is_some_and(|s| s.intact && s.is_pending_repair())
            && v.snapshot_of.is_none()
            && v.clone_base().is_none()
            && self.snapshots(volume).is_empty();
        if state.is_some() && !serves {
            return Err(StoreError::Copying { volume: v.name.clone() });
        }
        Ok(())
    }

    /// What the block map says of `count` blocks from `first` (a full recovery's target sends
    /// this to its source).
    pub fn block_summaries(
        &self,
        volume: VolumeHandle,
        first: u64,
        count: u64,
    ) -> Result<Vec<BlockSummary>, StoreError> {
        let v = self.volume_at(volume);
        v.check_range(first * BLOCK_BYTES, count * BLOCK_BYTES)?;
        let verify = self.copy_state(volume).is_some_and(|s| s.verify);
        let state = v.live_state()?;
        let mut summaries: Vec<BlockSummary> = (first..first + count)
            .map(|b| BlockSummary {
                sequence: state.map.sequence(b),
                crc: state.map.crc(b),
                allocated: state.map.is_allocated(b),
            })
            .collect();
        if verify {
            // A block whose content does not match its checksum is asked for whatever the
            // source holds: its summary is made to differ.
            let mut content = vec![0u8; BLOCK_BYTES as usize];
            for (i, summary) in summaries.iter_mut().enumerate() {
                if !summary.allocated {
                    continue;
                }
                let b = first + i as u64;
                v.data
                    .read_exact_at(&mut content, b * BLOCK_BYTES)
                    .map_err(io_error("read volume data", &v.data_path))?;
                if proto::crc32c(&content) != summary.crc {
                    tracing::warn!(volume = %v.name, block = b, "repair: block fails its checksum; fetching it from the source");
                    summary.crc = !summary.crc;
                    summary.sequence = Sequence(u64::MAX);
                }
            }
        }
        Ok(summaries)
    }

    /// A block of `volume` failed its checksum: make the volume a repair, a full recovery that
    /// verifies every block (durably: the copy state file; the volume takes no records and
    /// serves nothing until it is done, and the element says it is copying in its welcome).
    /// Returns whether this made it one (false if it already was). `intact`: its block map
    /// and log are as committed (a bad block found while running), so until the copy begins
    /// the volume may serve peers' copies of its intact blocks; not so for `Store::repair`.
    pub fn mark_for_repair(&self, volume: VolumeHandle, block: u64, intact: bool) -> Result<bool, StoreError> {
        let v = self.volume_at(volume);
        let _committer = self.lock_committer()?;
        let current = *lock(&v.copy);
        if current.is_some_and(|s| s.verify) {
            return Ok(false);
        }
        let state = match current {
            Some(s) => CopyState { verify: true, intact: false, ..s },
            None => CopyState { intact, ..CopyState::fresh(true) },
        };
        let result = save(&self.shared.dir, v.number, &state);
        self.guard(result)?;
        *lock(&v.copy) = Some(state);
        lock(&self.shared.damaged).push(volume.number());
        tracing::error!(volume = %v.name, block, "block fails its checksum: the volume is repaired by a full recovery that verifies every block; it serves nothing until then");
        Ok(true)
    }

    /// Volumes made repairs since the last call (for the element core).
    pub fn take_damaged(&self) -> Vec<u32> {
        std::mem::take(&mut *lock(&self.shared.damaged))
    }

    /// Source side: the blocks from `first` whose summary differs from `have`, read (and
    /// checked against their checksums) at one moment, with the applied sequence of that
    /// moment. Holes on both sides are skipped; a hole here that is allocated there is sent as
    /// a hole.
    pub fn copy_chunk(
        &self,
        volume: VolumeHandle,
        first: u64,
        have: &[BlockSummary],
    ) -> Result<BlockChunk, StoreError> {
        self.refuse_as_copy_source(volume)?;
        let v = self.volume_at(volume);
        if v.snapshot_of.is_some() {
            return self.snapshot_copy_chunk(&v, first, have);
        }
        if v.clone_base().is_some() {
            return self.clone_copy_chunk(&v, volume, first, have);
        }
        if have.len() > COPY_CHUNK_BLOCKS_MAX {
            return Err(StoreError::PayloadTooLarge {
                volume: v.name.clone(),
                length_bytes: have.len() as u64 * BLOCK_BYTES,
            });
        }
        v.check_range(first * BLOCK_BYTES, have.len() as u64 * BLOCK_BYTES)?;
        let state = v.live_state()?;
        let (applied, applied_epoch) = (state.applied, state.applied_epoch);
        let map = &state.map;
        let differs = |i: usize| {
            let b = first + i as u64;
            let theirs = &have[i];
            match (map.is_allocated(b), theirs.allocated) {
                (false, false) => false,
                (true, true) => map.sequence(b) != theirs.sequence || map.crc(b) != theirs.crc,
                _ => true,
            }
        };
        let mut blocks = Vec::new();
        let mut i = 0;
        while i < have.len() {
            if !differs(i) {
                i += 1;
                continue;
            }
            let b = first + i as u64;
            if !map.is_allocated(b) {
                blocks.push(BlockCopy { block: b, sequence: map.sequence(b), content: None });
                i += 1;
                continue;
            }
            // A run of differing allocated blocks: one read.
            let mut end = i + 1;
            while end < have.len() && map.is_allocated(first + end as u64) && differs(end) {
                end += 1;
            }
            let mut buffer = crate::zeroed_buffer((end - i) * BLOCK_BYTES as usize);
            v.read_blocks(map, b, &mut buffer)?;
            let buffer = bytes::Bytes::from(buffer);
            for k in i..end {
                let at = (k - i) * BLOCK_BYTES as usize;
                let block = first + k as u64;
                blocks.push(BlockCopy {
                    block,
                    sequence: map.sequence(block),
                    content: Some(buffer.slice(at..at + BLOCK_BYTES as usize)),
                });
            }
            i = end;
        }
        drop(state);
        let snapshots = self
            .snapshots(volume)
            .into_iter()
            .map(|s| proto::SnapshotSummary { id: s.id, taken_at: s.taken_at, size_bytes: s.size_bytes })
            .collect();
        Ok(BlockChunk { applied, applied_epoch, blocks, snapshots })
    }

    /// Target side: start (or restart) a copy pass under the host element epoch `epoch`. An
    /// interrupted copy of the same epoch goes on where it stopped; otherwise it starts at
    /// block 0. Checkpoints first, so that no log record of the volume is replayed over
    /// installed blocks after a crash. Returns the state to go on from.
    ///
    /// The copy installs blocks without preserving them, so the volume's snapshots here could
    /// no longer be read through it: they are removed. The copy then brings the source's
    /// (`begin_snapshot_copy`).
    pub fn begin_copy(&self, volume: VolumeHandle, epoch: Epoch) -> Result<CopyState, StoreError> {
        self.volume_at(volume).check_range(0, 0)?;
        self.refuse_snapshot(&self.volume_at(volume), "a full recovery copies its live volume")?;
        let previous = self.copy_state(volume);
        if let Some(state) = previous {
            if state.epoch == epoch {
                return Ok(state);
            }
        }
        let v = self.volume_at(volume);
        // A repair stays one when a new host element orders it again.
        let verify = previous.is_some_and(|s| s.verify);
        let state =
            CopyState { epoch, base: Sequence::ZERO, base_epoch: Epoch(0), cursor_block: 0, verify, intact: false };
        {
            // Under the committer lock, which `commit` holds while it checks the flag: a record
            // of this volume is either committed before (and covered by the checkpoint below,
            // so never replayed over installed blocks) or skipped.
            let mut committer = self.lock_committer()?;
            let snapshots = self.discard_snapshots_locked(&mut committer, &v)?;
            let result = save(&self.shared.dir, v.number, &state);
            self.guard(result)?;
            // A clone is copied whole: it reads nothing through its base any more.
            if v.clone_base().is_some() {
                self.forget_base(&v)?;
            }
            *lock(&v.copy) = Some(state);
            drop(committer);
            for snapshot in &snapshots {
                tracing::info!(volume = %v.name, snapshot = %snapshot.name, "full recovery: snapshot removed (the copy brings the source's)");
            }
            let result = self.remove_snapshot_files(&snapshots);
            self.guard(result)?;
        }
        self.checkpoint()?;
        tracing::info!(volume = %v.name, %epoch, "full recovery: copy started");
        Ok(state)
    }

    /// Target side: the first chunk of a pass fixes its base (the source's applied sequence
    /// then); persisted before any block of that chunk is installed.
    pub fn set_copy_base(
        &self,
        volume: VolumeHandle,
        base: Sequence,
        base_epoch: Epoch,
    ) -> Result<CopyState, StoreError> {
        let v = self.volume_at(volume);
        let mut state = lock(&v.copy).ok_or(StoreError::NotCopying { volume: v.name.clone() })?;
        state.base = base;
        state.base_epoch = base_epoch;
        let result = save(&self.shared.dir, v.number, &state);
        self.guard(result)?;
        *lock(&v.copy) = Some(state);
        Ok(state)
    }

    /// Target side: write copied blocks (content with its sequence, or a hole) into the data
    /// file and block map. Not durable until the next checkpoint (`save_copy_cursor` makes
    /// one); a crash before it leaves blocks whose map disagrees, which the resumed copy sends
    /// again because their summary still differs from the source's.
    pub fn install_blocks(&self, volume: VolumeHandle, blocks: &[BlockCopy]) -> Result<(), StoreError> {
        let mut committer = self.lock_committer()?;
        let i = volume.index();
        let v = self.volume_at(volume);
        if lock(&v.copy).is_none() {
            return Err(StoreError::NotCopying { volume: v.name.clone() });
        }
        for copy in blocks {
            v.check_range(copy.block * BLOCK_BYTES, BLOCK_BYTES)?;
            if let Some(content) = &copy.content {
                if content.len() as u64 != BLOCK_BYTES {
                    return Err(StoreError::InvalidVolume {
                        name: v.name.clone(),
                        reason: format!("copied block {} has {} bytes", copy.block, content.len()),
                    });
                }
            }
        }
        let mut state = v.live_state_mut()?;
        let mut holes = Vec::new();
        for copy in blocks {
            let b = copy.block;
            match &copy.content {
                Some(content) => {
                    let result = v
                        .data
                        .write_all_at(content, b * BLOCK_BYTES)
                        .map_err(io_error("write volume data", &v.data_path));
                    self.guard(result)?;
                    state.map.set_written(b, copy.sequence, proto::crc32c(content));
                    committer.unflushed[i].add(b..b + 1, BLOCK_BYTES);
                }
                None => {
                    state.map.set_holes(b..b + 1, copy.sequence);
                    holes.push(b);
                }
            }
            committer.dirty[i].mark_dirty(b..b + 1);
        }
        drop(state);
        for b in holes {
            self.reclaim.push(i, b..b + 1);
        }
        Ok(())
    }

    /// Target side: make every installed block durable (a checkpoint), then record that the
    /// blocks before `cursor_block` are done.
    pub fn save_copy_cursor(&self, volume: VolumeHandle, cursor_block: u64) -> Result<CopyState, StoreError> {
        self.checkpoint()?;
        let v = self.volume_at(volume);
        let mut state = lock(&v.copy).ok_or(StoreError::NotCopying { volume: v.name.clone() })?;
        state.cursor_block = cursor_block;
        let result = save(&self.shared.dir, v.number, &state);
        self.guard(result)?;
        *lock(&v.copy) = Some(state);
        Ok(state)
    }

    /// Target side, after the last chunk of a pass: adopt the pass's base as the applied
    /// sequence (durably, with a checkpoint), forget the volume's older log records (they
    /// belong to the history before the copy), and end the copy. Returns the base.
    pub fn finish_copy(&self, volume: VolumeHandle) -> Result<Sequence, StoreError> {
        let i = volume.index();
        let v = self.volume_at(volume);
        let state = lock(&v.copy).ok_or(StoreError::NotCopying { volume: v.name.clone() })?;
        {
            let mut committer = self.lock_committer()?;
            let volumes = self.volumes.read().expect("volume list lock");
            {
                let mut s = v.live_state_mut()?;
                s.applied = state.base;
                s.applied_epoch = state.base_epoch;
                // Blocks newer than the base say so with the base's sequence until the replay
                // after it rewrites them (it rewrites every block changed after the base): no
                // block of a volume is newer than its applied sequence.
                for b in 0..v.blocks() {
                    if s.map.sequence(b) > state.base {
                        if s.map.is_allocated(b) {
                            let crc = s.map.crc(b);
                            s.map.set_written(b, state.base, crc);
                        } else {
                            s.map.set_holes(b..b + 1, state.base);
                        }
                        committer.dirty[i].mark_dirty(b..b + 1);
                    }
                }
            }
            let result = committer.seal(self, &volumes);
            self.guard(result)?;
            self.shared.checkpointer.wait_idle(&self.shared);
            self.shared.check_failure()?;
            // The checkpoint covers everything before the live segment now: the older segments
            // (this volume's pre-copy records among them) are not needed for crash recovery.
            let mut index = lock(&self.shared.log_index);
            if index.holds_volume(v.number) {
                let dropped = index.drop_older_than_newest();
                tracing::info!(volume = %v.name, segments = dropped.len(), "full recovery: dropping the replay log, which holds the volume's pre-copy history");
                remove_segments(dropped);
            }
        }
        let path = copy_path(&self.shared.dir, v.number);
        let result = fs::remove_file(&path).map_err(io_error("remove copy state", &path));
        self.guard(result)?;
        let volumes_dir = self.shared.dir.join(VOLUMES_DIR);
        let result = sys::sync_dir(&volumes_dir).map_err(io_error("sync directory", &volumes_dir));
        self.guard(result)?;
        *lock(&v.copy) = None;
        tracing::info!(volume = %v.name, base = %state.base, "full recovery: copy finished");
        Ok(state.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_state_round_trips_and_detects_damage() {
        let state = CopyState {
            epoch: Epoch(3),
            base: Sequence(99),
            base_epoch: Epoch(2),
            cursor_block: 4096,
            verify: true,
            intact: false,
        };
        let mut bytes = state.encode();
        assert_eq!(CopyState::decode(&bytes), Ok(state));
        bytes[12] = 0;
        assert!(CopyState::decode(&bytes).unwrap_err().contains("checksum"), "the flag is covered");
        bytes[12] = 1;
        bytes[41] ^= 1;
        assert!(CopyState::decode(&bytes).unwrap_err().contains("checksum"));
        assert!(CopyState::decode(&bytes[..40]).is_err());
    }
}
