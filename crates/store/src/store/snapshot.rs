//! Snapshots: read-only volumes that keep a live volume's content as of one of its sequences,
//! at the cost of the blocks written after it.
//!
//! A snapshot is taken by a record of the live volume (`Op::Snapshot`), so every element takes
//! it between the same two records. Its volume (`meta::SnapshotOf`) is created before that
//! record is logged; a crash in between leaves a snapshot taken after the live volume's applied
//! sequence, which [`prune_untaken`] removes when the store opens (the record was never
//! acknowledged, so the host element sends it again).
//!
//! Copy before write: when a commit changes a block of a live volume that its newest snapshot
//! has not preserved yet, the block's current content (or its being a hole) goes first into a
//! *preserving record* of the snapshot, in the same commit, before the record that changes it.
//! Logged together and applied in order, the snapshot's copy is durable before the live block
//! can change on disk, and replay after a crash applies both as it applies any records: no new
//! ordering rule, no extra sync. The snapshot's own sequence counts its preserving records;
//! they never leave the element (the replay log serves only live volumes).
//!
//! A snapshot *owns* a block it preserved (content, or a hole at a sequence above 0); any other
//! block it reads through: the next newer snapshot's, and so on up to the live volume. Only the
//! newest snapshot preserves: an older one reads through it, which holds the same content for
//! every block the older one did not preserve (the live block did not change between them).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{atomic::Ordering, Arc, MutexGuard, RwLockReadGuard};

use bytes::Bytes;
use proto::{
    BlockChunk, BlockCopy, BlockExtent, BlockSummary, Epoch, Sequence, BLOCK_BYTES, COPY_CHUNK_BLOCKS_MAX,
    PAYLOAD_BYTES_MAX,
};

use super::{base_content, copy, lock, remove_volume_files, Committer, Store, VOLUMES_DIR};
use crate::{
    block_map::zero_block_crc,
    log::{Change, Kind, LogRecord},
    meta::SnapshotOf,
    volume::{block_digest, Volume, VolumeState},
    StoreError, VolumeDigest, VolumeHandle, BLOCK_STATUS_EXTENTS_MAX, LOG_BATCH_BYTES_MAX, SCAN_BUFFER_BYTES,
    VOLUME_NAME_BYTES_MAX,
};
use crate::{error::io_error, sys};

/// The sequence of every block of a snapshot a full recovery copied (and its own applied
/// sequence then): above 0, so that it owns them all.
const COPIED_SEQUENCE: Sequence = Sequence(1);

/// Most blocks one preserving record carries (a largest write's worth).
const PRESERVE_RECORD_BLOCKS_MAX: u64 = PAYLOAD_BYTES_MAX as u64 / BLOCK_BYTES;
/// Once the preserving records accepted in one commit carry this many bytes, they are
/// committed (logged, synced, applied) before more are made: bounds the memory that a large
/// trim or zeroing after a snapshot takes. Preserving early is always right: a block not
/// preserved yet still holds the snapshot's content.
const PRESERVE_COMMIT_BYTES: u64 = LOG_BATCH_BYTES_MAX / 2;

/// What the preserving records accepted so far in one commit did.
#[derive(Default)]
pub(super) struct Preserving {
    /// Per snapshot (by index): the sequence of its last preserving record.
    sequences: HashMap<usize, Sequence>,
    /// `(snapshot, block)` preserved by one of them.
    blocks: HashSet<(usize, u64)>,
    /// Bytes of content they carry.
    bytes: u64,
}

/// One snapshot of a live volume, as [`Store::snapshots`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub handle: VolumeHandle,
    pub id: u64,
    /// The live volume's sequence the snapshot holds the content of.
    pub taken_at: Sequence,
    pub size_bytes: u64,
    /// Blocks the snapshot holds itself (preserved with content): the space it costs.
    pub blocks_owned: u64,
}

/// The store's name for snapshot `id` of volume `parent` (only for messages and listings:
/// snapshots are found by their live volume and id).
fn snapshot_name(parent: &str, id: u64) -> String {
    let name = format!("{parent}@{id}");
    if name.len() <= VOLUME_NAME_BYTES_MAX {
        name
    } else {
        format!("@{id}")
    }
}

impl LogRecord {
    /// The blocks this record changes, if any.
    pub(crate) fn blocks_changed(&self) -> Option<Range<u64>> {
        if self.kind == Kind::PlacedCopy {
            return None; // It keeps data for peers and changes nothing.
        }
        match &self.change {
            Change::Nothing => None,
            Change::Blocks { first_block, crcs, .. } => Some(*first_block..first_block + crcs.len() as u64),
            Change::Zero { head, whole, tail } => {
                let start = head.as_ref().map_or(whole.start, |e| e.block);
                let end = tail.as_ref().map_or(whole.end, |e| e.block + 1);
                Some(start..end.max(start))
            }
        }
    }
}

impl Store {
    /// The newest snapshot (index) of each live volume (index) that has one.
    pub(super) fn newest_snapshots(&self, volumes: &[Arc<Volume>]) -> HashMap<usize, usize> {
        let mut newest: HashMap<usize, (Sequence, usize)> = HashMap::new();
        if self.snapshot_count.load(Ordering::Acquire) == 0 {
            return HashMap::new();
        }
        let live: HashMap<u32, usize> = volumes
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_removed() && v.snapshot_of.is_none())
            .map(|(i, v)| (v.number, i))
            .collect();
        for (s, volume) in volumes.iter().enumerate() {
            let Some(of) = volume.snapshot_of.filter(|_| !volume.is_removed()) else { continue };
            let Some(&parent) = live.get(&of.parent) else { continue };
            if !matches!(newest.get(&parent), Some((taken_at, _)) if *taken_at >= of.taken_at) {
                newest.insert(parent, (of.taken_at, s));
            }
        }
        newest.into_iter().map(|(parent, (_, s))| (parent, s)).collect()
    }

    /// Create snapshot `id` of `parent`, taken at `taken_at`, unless it exists (a record sent
    /// again). The commit lock held, no lock of the volume list.
    pub(super) fn take_snapshot_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        parent: &Volume,
        id: u64,
        taken_at: Sequence,
    ) -> Result<(), StoreError> {
        let exists = find_snapshot(&self.volumes.read().expect("volume list lock"), parent.number, id).is_some();
        if exists {
            tracing::info!(volume = %parent.name, id, "snapshot exists already: its record does nothing");
            return Ok(());
        }
        let name = snapshot_name(&parent.name, id);
        let size_bytes = parent.size_bytes();
        self.check_room_with(&[], &[size_bytes])
            .map_err(|reason| StoreError::InvalidVolume { name: name.clone(), reason })?;
        let snapshot_of = SnapshotOf { parent: parent.number, taken_at, id };
        self.create_volume_locked(committer, &name, size_bytes, Some(snapshot_of), None, None)?;
        tracing::info!(volume = %parent.name, id, %taken_at, "snapshot taken");
        Ok(())
    }

    /// Accept, before `record` of live volume `live`, preserving records of its newest
    /// snapshot `snap` for every block `record` changes that `snap` holds nothing of yet.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn preserve(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        volumes: &[Arc<Volume>],
        accepted: &mut Vec<(usize, LogRecord)>,
        preserving: &mut Preserving,
        (live, through): (usize, &[Arc<Volume>]),
        snap: usize,
        record: &LogRecord,
    ) -> Result<(), StoreError> {
        let Some(changed) = record.blocks_changed() else { return Ok(()) };
        let snapshot = &volumes[snap];
        let end = changed.end.min(snapshot.blocks());
        if changed.start >= end {
            return Ok(());
        }
        let wanted: Vec<u64> = {
            let state = snapshot.live_state()?;
            (changed.start..end)
                .filter(|&b| !Volume::owns(&state.map, b) && !preserving.blocks.contains(&(snap, b)))
                .collect()
        };
        for chunk in wanted.chunks(PRESERVE_RECORD_BLOCKS_MAX as usize) {
            let mut contents = current_blocks(&volumes[live], live, chunk, accepted, through)?;
            // Runs of consecutive blocks that all hold data, or are all holes: one record each.
            let mut k = 0;
            while k < chunk.len() {
                let hole = contents[k].is_none();
                let mut n = 1;
                while k + n < chunk.len() && chunk[k + n] == chunk[k] + n as u64 && contents[k + n].is_none() == hole {
                    n += 1;
                }
                let first_block = chunk[k];
                let change = if hole {
                    Change::Zero { head: None, whole: first_block..first_block + n as u64, tail: None }
                } else {
                    let (pieces, crcs) = contents[k..k + n].iter_mut().map(|c| c.take().expect("data")).unzip();
                    preserving.bytes += n as u64 * BLOCK_BYTES;
                    Change::Blocks { first_block, pieces, crcs, placed: false }
                };
                let sequence = preserving
                    .sequences
                    .entry(snap)
                    .or_insert_with(|| snapshot.state.read().expect("volume lock").applied);
                *sequence = sequence.next();
                accepted.push((
                    snap,
                    LogRecord {
                        volume_number: snapshot.number,
                        epoch: record.epoch,
                        sequence: *sequence,
                        kind: if hole { Kind::Trim } else { Kind::Write },
                        offset_bytes: first_block * BLOCK_BYTES,
                        length_bytes: n as u64 * BLOCK_BYTES,
                        change,
                    },
                ));
                preserving.blocks.extend(chunk[k..k + n].iter().map(|&b| (snap, b)));
                k += n;
            }
            if preserving.bytes >= PRESERVE_COMMIT_BYTES {
                committer.commit_prepared(self, volumes, std::mem::take(accepted))?;
                *preserving = Preserving::default();
            }
        }
        Ok(())
    }

    /// Snapshot `id` of live volume `parent`, if it exists (and is not being copied by a full
    /// recovery). Every read of a snapshot looks it up: no block map is scanned.
    pub fn snapshot(&self, parent: VolumeHandle, id: u64) -> Option<VolumeHandle> {
        let volumes = self.volumes.read().expect("volume list lock");
        let k = find_snapshot(&volumes, volumes[parent.index()].number, id)?;
        let copying = lock(&volumes[k].copy).is_some();
        (!copying).then_some(VolumeHandle(k as u32))
    }

    /// The snapshots of live volume `parent`, oldest first (not one a full recovery is still
    /// copying).
    pub fn snapshots(&self, parent: VolumeHandle) -> Vec<SnapshotInfo> {
        let volumes = self.volumes.read().expect("volume list lock");
        let number = volumes[parent.index()].number;
        let mut snapshots: Vec<SnapshotInfo> = volumes
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_removed() && lock(&v.copy).is_none())
            .filter_map(|(i, v)| {
                let of = v.snapshot_of.filter(|of| of.parent == number)?;
                Some(SnapshotInfo {
                    handle: VolumeHandle(i as u32),
                    id: of.id,
                    taken_at: of.taken_at,
                    size_bytes: v.size_bytes(),
                    blocks_owned: v.state.read().expect("volume lock").map.allocated_blocks(),
                })
            })
            .collect();
        snapshots.sort_by_key(|s| s.taken_at);
        snapshots
    }

    /// The live volume `handle` is a snapshot of, if it is one.
    pub fn snapshot_parent(&self, handle: VolumeHandle) -> Option<VolumeHandle> {
        let volumes = self.volumes.read().expect("volume list lock");
        let of = volumes[handle.index()].snapshot_of?;
        volumes.iter().position(|v| v.number == of.parent && !v.is_removed()).map(|i| VolumeHandle(i as u32))
    }

    /// Blocks `first..first + count` of snapshot `snap` into `out` (zeroes for holes), each
    /// read from whoever holds it and checked against its checksum; per block, whether it is
    /// allocated and its checksum (see [`Store::read_chain`]: where each block lives is seen
    /// under the chain's read locks, at one moment; the commit that preserves a block into a
    /// snapshot applies that before it changes the live block).
    fn read_snapshot_blocks(
        &self,
        snap: &Arc<Volume>,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> Result<Vec<(bool, u32)>, StoreError> {
        let (_, _, found) = self.read_chain(snap, first, count, out)?;
        Ok(found.iter().map(|f| (f.allocated, f.crc)).collect())
    }

    /// Source side of a full recovery, for a snapshot: its blocks from `first` (its content as
    /// read through its chain) whose allocation or checksum differ from `have`, with the
    /// sequence it was taken at. A snapshot never changes, so any moment will do.
    pub(super) fn snapshot_copy_chunk(
        &self,
        snap: &Arc<Volume>,
        first: u64,
        have: &[BlockSummary],
    ) -> Result<BlockChunk, StoreError> {
        let taken_at = snap.snapshot_of.expect("a snapshot").taken_at;
        let count = have.len() as u64;
        if have.len() > COPY_CHUNK_BLOCKS_MAX {
            return Err(StoreError::PayloadTooLarge { volume: snap.name.clone(), length_bytes: count * BLOCK_BYTES });
        }
        snap.check_range(first * BLOCK_BYTES, count * BLOCK_BYTES)?;
        let mut buffer = crate::zeroed_buffer((count * BLOCK_BYTES) as usize);
        let entries = self.read_snapshot_blocks(snap, first, count, &mut buffer)?;
        let buffer = Bytes::from(buffer);
        let mut blocks = Vec::new();
        for (i, ((allocated, crc), theirs)) in entries.iter().zip(have).enumerate() {
            let differs = match (*allocated, theirs.allocated) {
                (false, false) => false,
                (true, true) => *crc != theirs.crc,
                _ => true,
            };
            if differs {
                let at = i * BLOCK_BYTES as usize;
                let content = allocated.then(|| buffer.slice(at..at + BLOCK_BYTES as usize));
                blocks.push(BlockCopy { block: first + i as u64, sequence: COPIED_SEQUENCE, content });
            }
        }
        Ok(BlockChunk { applied: taken_at, applied_epoch: Epoch(0), blocks, snapshots: Vec::new() })
    }

    /// Target side of a full recovery of live volume `parent` (copying: `begin_copy` removed
    /// its snapshots here): a new snapshot `id`, taken at `taken_at`, to copy whole from the
    /// source. It owns every block from the start (each a hole until its content is
    /// installed: nothing is read through it), and is hidden, with a copy state file, until
    /// `finish_snapshot_copy`; open removes one a crash left unfinished (the volume's copy,
    /// resumed, copies it again).
    pub fn begin_snapshot_copy(
        &self,
        parent: VolumeHandle,
        id: u64,
        taken_at: Sequence,
        size_bytes: u64,
    ) -> Result<VolumeHandle, StoreError> {
        let mut committer = self.lock_committer()?;
        let live = self.volume_at(parent);
        if lock(&live.copy).is_none() {
            return Err(StoreError::NotCopying { volume: live.name.clone() });
        }
        if let Some(handle) = self.any_snapshot(&live, id) {
            return Ok(handle);
        }
        let name = snapshot_name(&live.name, id);
        let invalid = |reason: String| StoreError::InvalidVolume { name: name.clone(), reason };
        if size_bytes == 0 || size_bytes % BLOCK_BYTES != 0 || size_bytes > live.size_bytes() {
            return Err(invalid(format!("a copied snapshot of {size_bytes} bytes does not fit its volume")));
        }
        self.check_room_with(&[], &[size_bytes]).map_err(invalid)?;
        let snapshot_of = SnapshotOf { parent: live.number, taken_at, id };
        let handle = self.create_volume_locked(&mut committer, &name, size_bytes, Some(snapshot_of), None, None)?;
        let snap = self.volume_at(handle);
        let state = crate::CopyState {
            epoch: Epoch(0),
            base: taken_at,
            base_epoch: Epoch(0),
            cursor_block: 0,
            verify: false,
            intact: false,
        };
        let saved = copy::save(&self.shared.dir, snap.number, &state);
        self.guard(saved)?;
        *lock(&snap.copy) = Some(state);
        let blocks = snap.blocks();
        {
            let mut s = snap.state.write().expect("volume lock");
            s.map.set_holes(0..blocks, COPIED_SEQUENCE);
            s.applied = COPIED_SEQUENCE;
        }
        committer.dirty[handle.index()].mark_dirty(0..blocks);
        tracing::info!(volume = %live.name, id, %taken_at, "full recovery: copying a snapshot");
        Ok(handle)
    }

    /// Target side: the copied snapshot's blocks are installed; make them durable (a
    /// checkpoint) and the snapshot visible.
    pub fn finish_snapshot_copy(&self, handle: VolumeHandle) -> Result<(), StoreError> {
        self.checkpoint()?;
        let snap = self.volume_at(handle);
        let path = copy::copy_path(&self.shared.dir, snap.number);
        let result = std::fs::remove_file(&path).map_err(io_error("remove copy state", &path));
        self.guard(result)?;
        let volumes_dir = self.shared.dir.join(VOLUMES_DIR);
        let result = sys::sync_dir(&volumes_dir).map_err(io_error("sync directory", &volumes_dir));
        self.guard(result)?;
        *lock(&snap.copy) = None;
        tracing::info!(snapshot = %snap.name, "full recovery: snapshot copied");
        Ok(())
    }

    /// Snapshot `id` of `live`, copied whole or not.
    fn any_snapshot(&self, live: &Volume, id: u64) -> Option<VolumeHandle> {
        find_snapshot(&self.volumes.read().expect("volume list lock"), live.number, id).map(|k| VolumeHandle(k as u32))
    }

    /// [`Store::block_status`] of a snapshot or a clone: through its chain.
    pub(super) fn chain_block_status(
        &self,
        volume: &Arc<Volume>,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(Sequence, Vec<BlockExtent>), StoreError> {
        let mut went = 0;
        loop {
            let chain = self.chain(volume)?;
            let states = chain.iter().map(|v| v.live_state()).collect::<Result<Vec<_>, _>>();
            match states {
                Ok(states) => return Ok(chain_extents(volume, &states, offset_bytes, length_bytes)),
                // A volume of the chain went between listing it and locking it: list it again.
                Err(StoreError::Removed { .. }) if !volume.is_removed() && went < 64 => went += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// [`Store::verify`] of a snapshot or a clone: the digest of its content (the same formula
    /// as a live volume's, so a snapshot equals a live volume of the same content), read
    /// through its chain. A block that fails its checksum is an error.
    pub(super) fn verify_through_chain(&self, snap: &Arc<Volume>) -> Result<VolumeDigest, StoreError> {
        let mut sequence = Sequence::ZERO;
        let blocks = snap.blocks();
        let step = SCAN_BUFFER_BYTES / BLOCK_BYTES;
        let mut buffer = vec![0u8; SCAN_BUFFER_BYTES as usize];
        let (mut digest, mut allocated) = (0u64, 0u64);
        let mut block = 0;
        while block < blocks {
            let count = step.min(blocks - block);
            let out = &mut buffer[..(count * BLOCK_BYTES) as usize];
            let (at, _, found) = self.read_chain(snap, block, count, out)?;
            sequence = at;
            for (i, is_allocated) in found.iter().map(|f| f.allocated).enumerate() {
                let content = &out[i * BLOCK_BYTES as usize..(i + 1) * BLOCK_BYTES as usize];
                let crc = if is_allocated { proto::crc32c(content) } else { zero_block_crc() };
                digest = digest.wrapping_add(block_digest(block + i as u64, crc));
                allocated += is_allocated as u64;
            }
            block += count;
        }
        Ok(VolumeDigest {
            applied_sequence: sequence,
            content_digest: digest,
            blocks_total: blocks,
            blocks_allocated: allocated,
            blocks_corrupt: 0,
            first_corrupt_block: None,
        })
    }

    /// Remove snapshot `snap` durably (`Store::remove_volume` of a snapshot): as
    /// [`Store::delete_snapshot_locked`] without a record in the live volume's log.
    pub(super) fn remove_snapshot_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        snap: &Arc<Volume>,
    ) -> Result<(), StoreError> {
        self.materialize_dependents_locked(committer, &[snap.number])?;
        let volumes = self.volumes.read().expect("volume list lock").clone();
        self.hand_over_locked(committer, &volumes, snap)?;
        self.drop_snapshot_locked(committer, snap)
    }

    /// Carry out the deletion record `prepared` of snapshot `id` of live volume `parent`: the
    /// snapshot's next older snapshot, if any, first takes over every block the snapshot
    /// holds and it does not (it read them through the snapshot), by preserving records
    /// committed like any; then the record is committed; then the snapshot leaves the
    /// metadata and its files go. A crash before the record is durable leaves both snapshots
    /// whole (the older holding copies of what it read through), and the record is sent
    /// again; after it, the store's opening finishes the deletion. A snapshot that does not
    /// exist (deleted already, or never taken here) is no error: the record only advances the
    /// sequence. Holds the commit lock throughout, so no write preserves into the snapshot
    /// meanwhile: the time is that of copying the blocks taken over.
    pub(super) fn delete_snapshot_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        volumes: &[Arc<Volume>],
        parent: &Volume,
        id: u64,
        prepared: LogRecord,
    ) -> Result<(), StoreError> {
        let i = volumes.iter().position(|v| v.number == parent.number && !v.is_removed()).expect("listed");
        let snap = find_snapshot(volumes, parent.number, id).map(|k| volumes[k].clone());
        if let Some(snap) = &snap {
            // Clones of it own their content first: nothing reads through it once it goes.
            self.materialize_dependents_locked(committer, &[snap.number])?;
            self.hand_over_locked(committer, volumes, snap)?;
        }
        committer.commit_prepared(self, volumes, vec![(i, prepared)])?;
        match snap {
            Some(snap) => {
                self.drop_snapshot_locked(committer, &snap)?;
                tracing::info!(volume = %parent.name, id, "snapshot deleted");
                self.remove_snapshot_files(&[snap])
            }
            None => {
                tracing::info!(volume = %parent.name, id, "no such snapshot here: its deletion does nothing");
                Ok(())
            }
        }
    }

    /// The next older snapshot of `snap`, if any, takes over every block `snap` holds and it
    /// does not, by preserving records, committed.
    fn hand_over_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        volumes: &[Arc<Volume>],
        snap: &Arc<Volume>,
    ) -> Result<(), StoreError> {
        let of = snap.snapshot_of.expect("a snapshot");
        let older = volumes
            .iter()
            .enumerate()
            .filter(|(_, v)| {
                !v.is_removed() && v.snapshot_of.is_some_and(|o| o.parent == of.parent && o.taken_at < of.taken_at)
            })
            .max_by_key(|(_, v)| v.snapshot_of.expect("a snapshot").taken_at)
            .map(|(i, _)| i);
        let Some(older) = older else { return Ok(()) };
        let here = volumes.iter().position(|v| Arc::ptr_eq(v, snap)).expect("listed");
        let blocks = volumes[older].blocks();
        let mut taken = 0u64;
        let mut block = 0;
        while block < blocks {
            let end = (block + PRESERVE_RECORD_BLOCKS_MAX * 4).min(blocks);
            // As if the older snapshot were the newest and `snap` the live volume that changes
            // these blocks: the same preserving records.
            let wanted: Vec<u64> = {
                let (theirs, own) = (volumes[older].live_state()?, snap.live_state()?);
                (block..end).filter(|&b| Volume::owns(&own.map, b) && !Volume::owns(&theirs.map, b)).collect()
            };
            let mut accepted = Vec::new();
            let mut preserving = Preserving::default();
            for run in runs(&wanted) {
                let stand_in = LogRecord {
                    volume_number: snap.number,
                    epoch: snap.state.read().expect("volume lock").applied_epoch,
                    sequence: Sequence::ZERO,
                    kind: Kind::Trim,
                    offset_bytes: run.start * BLOCK_BYTES,
                    length_bytes: (run.end - run.start) * BLOCK_BYTES,
                    change: Change::Zero { head: None, whole: run.clone(), tail: None },
                };
                self.preserve(committer, volumes, &mut accepted, &mut preserving, (here, &[]), older, &stand_in)?;
                taken += run.end - run.start;
            }
            if !accepted.is_empty() {
                committer.commit_prepared(self, volumes, accepted)?;
            }
            block = end;
        }
        tracing::info!(snapshot = %snap.name, older = %volumes[older].name, blocks = taken, "blocks taken over by the older snapshot");
        Ok(())
    }

    /// `snap` leaves the metadata and is forgotten (its files are the caller's to remove).
    fn drop_snapshot_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        snap: &Arc<Volume>,
    ) -> Result<(), StoreError> {
        let number = snap.number;
        self.write_meta(|meta| meta.volumes.retain(|v| v.number != number))?;
        self.forget_removed(committer, snap);
        Ok(())
    }

    /// Remove every snapshot of live volume `parent` durably, at once (no older snapshot takes
    /// anything over: they all go): `Store::repair` does, for a volume that lost records.
    /// Returns how many.
    pub fn drop_snapshots(&self, parent: VolumeHandle) -> Result<usize, StoreError> {
        let mut committer = self.lock_committer()?;
        let volume = self.volume_at(parent);
        let dropped = self.discard_snapshots_locked(&mut committer, &volume);
        let dropped = self.guard(dropped)?;
        drop(committer);
        let removed = self.remove_snapshot_files(&dropped);
        self.guard(removed)?;
        Ok(dropped.len())
    }

    /// Remove every snapshot of live volume `parent` from the metadata (one change) and forget
    /// them; the caller removes their files ([`Store::remove_snapshot_files`]) once it lets go
    /// of the commit lock.
    pub(super) fn discard_snapshots_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        parent: &Volume,
    ) -> Result<Vec<Arc<Volume>>, StoreError> {
        let number = parent.number;
        let snapshots: Vec<Arc<Volume>> = self
            .volumes
            .read()
            .expect("volume list lock")
            .iter()
            .filter(|v| !v.is_removed() && v.snapshot_of.is_some_and(|of| of.parent == number))
            .cloned()
            .collect();
        if snapshots.is_empty() {
            return Ok(snapshots);
        }
        let gone: Vec<u32> = snapshots.iter().map(|v| v.number).collect();
        self.materialize_dependents_locked(committer, &gone)?;
        self.write_meta(|meta| meta.volumes.retain(|v| !gone.contains(&v.number)))?;
        for snap in &snapshots {
            self.forget_removed(committer, snap);
        }
        Ok(snapshots)
    }

    /// After `volume` left the metadata: mark it removed and drop its map and commit state.
    /// Its files are the caller's to remove ([`remove_volume_files`]).
    pub(super) fn forget_removed(&self, committer: &mut MutexGuard<'_, Committer>, volume: &Arc<Volume>) {
        let index = {
            let volumes = self.volumes.read().expect("volume list lock");
            volumes.iter().position(|v| Arc::ptr_eq(v, volume)).expect("listed")
        };
        {
            let mut state = volume.state.write().expect("volume lock");
            volume.removed.store(true, Ordering::Release);
            // The map's memory goes now; the handle stays (handles are positions).
            state.map = crate::block_map::BlockMap::new(0).expect("an empty map");
        }
        committer.dirty[index] = crate::block_map::DirtyChunks::for_blocks(0);
        committer.unflushed[index] = super::Unflushed::default();
        *super::lock(&volume.copy) = None;
        if volume.snapshot_of.is_some() {
            self.snapshot_count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Delete the files of removed snapshots (after the metadata no longer lists them).
    pub(super) fn remove_snapshot_files(&self, snapshots: &[Arc<Volume>]) -> Result<(), StoreError> {
        for snap in snapshots {
            remove_volume_files(&self.shared.dir, snap.number, Some(snap))?;
            tracing::info!(snapshot = %snap.name, number = snap.number, "snapshot removed");
        }
        Ok(())
    }
}

/// The current content of `blocks` (ascending) of volume `volumes[i]` as of the records
/// `accepted` so far, each with its checksum (`None`: a hole). Blocks no accepted record
/// touches and that lie close together are read with one read, checked against the block map.
/// A clone's (`through`: its chain after it) are read one by one.
#[allow(clippy::type_complexity)]
fn current_blocks(
    volume: &Volume,
    i: usize,
    blocks: &[u64],
    accepted: &[(usize, LogRecord)],
    through: &[Arc<Volume>],
) -> Result<Vec<Option<(Bytes, u32)>>, StoreError> {
    let (Some(&first), Some(&last)) = (blocks.first(), blocks.last()) else { return Ok(Vec::new()) };
    let span = first..last + 1;
    let touched = accepted.iter().any(|(v, r)| {
        *v == i && r.blocks_changed().is_some_and(|changed| changed.start < span.end && span.start < changed.end)
    });
    if touched || span.end - span.start > PRESERVE_RECORD_BLOCKS_MAX || volume.clone_base().is_some() {
        return blocks
            .iter()
            .map(|&b| Ok(base_content(volume, i, b, accepted, through)?.map(|c| (c.clone(), proto::crc32c(&c)))))
            .collect();
    }
    let state = volume.live_state()?;
    let mut buffer = crate::zeroed_buffer(((span.end - span.start) * BLOCK_BYTES) as usize);
    volume.read_blocks(&state.map, span.start, &mut buffer)?;
    let buffer = buffer.freeze();
    Ok(blocks
        .iter()
        .map(|&b| {
            state.map.is_allocated(b).then(|| {
                let at = ((b - span.start) * BLOCK_BYTES) as usize;
                (buffer.slice(at..at + BLOCK_BYTES as usize), state.map.crc(b))
            })
        })
        .collect())
}

/// The position of snapshot `id` of the live volume numbered `parent` (copied whole or not).
fn find_snapshot(volumes: &[Arc<Volume>], parent: u32, id: u64) -> Option<usize> {
    volumes.iter().position(|v| !v.is_removed() && v.snapshot_of.is_some_and(|of| of.parent == parent && of.id == id))
}

/// Runs of consecutive blocks in an ascending list.
fn runs(blocks: &[u64]) -> Vec<Range<u64>> {
    let mut runs: Vec<Range<u64>> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some(run) if run.end == b => run.end += 1,
            _ => runs.push(b..b + 1),
        }
    }
    runs
}

/// At open, after the log's replay: the snapshots whose record never became durable (taken
/// after their live volume's applied sequence: a crash between creating the snapshot and
/// logging its record) are removed from the metadata and their files deleted. Returns which
/// (numbers).
pub(super) fn untaken(volumes: &[Arc<Volume>]) -> Vec<u32> {
    volumes
        .iter()
        .filter_map(|v| {
            let of = v.snapshot_of?;
            let parent = volumes.iter().find(|p| p.number == of.parent)?;
            let applied = parent.state.read().expect("volume lock").applied;
            (of.taken_at > applied).then_some(v.number)
        })
        .collect()
}

/// The extents of `volume` (a snapshot or a clone) through its chain, whose locks the caller
/// holds (`states`), with the sequence they are of.
fn chain_extents(
    volume: &Volume,
    states: &[RwLockReadGuard<'_, VolumeState>],
    offset_bytes: u64,
    length_bytes: u64,
) -> (Sequence, Vec<BlockExtent>) {
    let sequence = match volume.snapshot_of {
        Some(of) => of.taken_at,
        None => states[0].applied,
    };
    let mut extents: Vec<BlockExtent> = Vec::new();
    if length_bytes == 0 {
        return (sequence, extents);
    }
    let allocated =
        |block: u64| super::clone::owner_in(states, block).is_some_and(|k| states[k].map.is_allocated(block));
    let end_bytes = offset_bytes + length_bytes;
    let mut position = offset_bytes;
    while position < end_bytes {
        let block = position / BLOCK_BYTES;
        let extent_end = ((block + 1) * BLOCK_BYTES).min(end_bytes);
        let is_allocated = allocated(block);
        let full = extents.len() == BLOCK_STATUS_EXTENTS_MAX;
        match extents.last_mut() {
            Some(last) if last.allocated == is_allocated => last.length_bytes += extent_end - position,
            _ if full => break,
            _ => extents.push(BlockExtent { length_bytes: extent_end - position, allocated: is_allocated }),
        }
        position = extent_end;
    }
    (sequence, extents)
}
