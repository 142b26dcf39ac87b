//! Clones: live volumes that start with a snapshot's content and share the blocks they have
//! not written with it.
//!
//! A clone is created (durably, at sequence 0 like any new volume) with the number of its
//! *base* snapshot in the metadata (`VolumeMeta::clone_of`). A block the clone does not own (a
//! hole at sequence 0: it never wrote, trimmed or zeroed it) reads through the base snapshot's
//! chain (the snapshot, its newer snapshots, its live volume, and that volume's base if it is
//! a clone too); what the clone writes goes to its own data file. A snapshot never changes, so
//! the content read through is the same at any moment: the clone needs no rule of ordering
//! with its base's volume.
//!
//! A block read through reports sequence 0 (the clone never changed it) and the checksum
//! stored with it where it is: so a clone's summaries, digests and full recoveries describe its
//! content, not where it lives, and an element where a clone owns every block (copied by a full
//! recovery) agrees with one where it shares them.
//!
//! Nothing may take a base away from a clone: before a snapshot a clone reads through leaves
//! (deleted, removed with its volume, or dropped by its volume's full recovery), the clone is
//! made to own its whole content (`materialize`): the blocks it read through are written into
//! its data file and map at sequence 0, a checkpoint makes them durable, and only then does
//! the metadata forget its base. A crash at any point leaves the clone reading what it read.

use std::sync::{Arc, MutexGuard, RwLockReadGuard};

use bytes::{Bytes, BytesMut};
use proto::{BlockChunk, BlockCopy, BlockSummary, Epoch, ReadData, Sequence, BLOCK_BYTES, COPY_CHUNK_BLOCKS_MAX};

use super::{copy, lock, Committer, Store};
use crate::{
    log::Geometry,
    volume::{MapSlice, Volume, VolumeState},
    CopyState, StoreError, VolumeHandle, SCAN_BUFFER_BYTES, VOLUMES_MAX,
};

/// How many times a read lists a chain again because one of its volumes went meanwhile.
const CHAIN_CHANGES_MAX: u32 = 64;

/// What a read through a chain found for one block: where it lives decides the content and
/// checksum; the sequence is the first volume's own (0 for a block read through).
#[derive(Clone, Copy, Debug)]
pub(super) struct Found {
    pub allocated: bool,
    pub crc: u32,
    pub sequence: Sequence,
}

/// The volumes a read of `start` goes through, in order: a snapshot, its newer snapshots and
/// its live volume; a live volume; then, while the live volume is a clone, its base
/// snapshot's chain. A chain that loops or names a volume that is not there (a damaged
/// metadata file could) is an error.
pub(super) fn chain_in(volumes: &[Arc<Volume>], start: &Arc<Volume>) -> Result<Vec<Arc<Volume>>, StoreError> {
    let broken = |reason: String| StoreError::InvalidVolume { name: start.name.clone(), reason };
    let mut chain: Vec<Arc<Volume>> = Vec::new();
    let mut current = start.clone();
    loop {
        if chain.len() > VOLUMES_MAX {
            return Err(broken("its chain of snapshots and clones loops".into()));
        }
        if let Some(of) = current.snapshot_of {
            let mut newer: Vec<Arc<Volume>> = volumes
                .iter()
                .filter(|v| {
                    !v.is_removed() && v.snapshot_of.is_some_and(|o| o.parent == of.parent && o.taken_at > of.taken_at)
                })
                .cloned()
                .collect();
            newer.sort_by_key(|v| v.snapshot_of.expect("a snapshot").taken_at);
            chain.push(current.clone());
            chain.extend(newer);
            current = volumes
                .iter()
                .find(|v| v.number == of.parent && !v.is_removed())
                .ok_or_else(|| StoreError::Removed { volume: current.name.clone() })?
                .clone();
            continue;
        }
        chain.push(current.clone());
        let Some(base) = current.clone_base() else { return Ok(chain) };
        current = volumes
            .iter()
            .find(|v| v.number == base && !v.is_removed() && v.snapshot_of.is_some())
            .ok_or_else(|| broken(format!("its base snapshot (volume {base}) is not there")))?
            .clone();
    }
}

/// Where block `b` lives along a chain whose locks the caller holds: the first volume that
/// owns it, the last one if none does; `None` past the end of a volume on the way (a hole).
pub(super) fn owner_in(states: &[RwLockReadGuard<'_, VolumeState>], b: u64) -> Option<usize> {
    for (k, state) in states.iter().enumerate() {
        if b >= state.map.blocks() {
            return None;
        }
        if k == states.len() - 1 || Volume::owns(&state.map, b) {
            return Some(k);
        }
    }
    unreachable!("the last volume of a chain owns what reaches it")
}

/// Blocks `first..first + count` of `chain[0]` into `out` (zeroed, whole blocks), each from
/// where it lives ([`owner_in`]), checked against its checksum. The caller holds the read
/// locks of the chain (`states`), so no block changes under the read.
pub(super) fn read_through(
    chain: &[Arc<Volume>],
    states: &[RwLockReadGuard<'_, VolumeState>],
    first: u64,
    count: u64,
    out: &mut [u8],
) -> Result<Vec<Found>, StoreError> {
    let (found, runs) = plan_through(states, first, count);
    read_runs(chain, &runs, first, out)?;
    Ok(found)
}

/// Read `runs` (of [`plan_through`] from `first`) into `out`, each checked against the
/// checksums its map entries give.
fn read_runs(chain: &[Arc<Volume>], runs: &[(usize, MapSlice)], first: u64, out: &mut [u8]) -> Result<(), StoreError> {
    runs.iter().try_for_each(|(k, slice)| {
        let at = ((slice.first - first) * BLOCK_BYTES) as usize;
        let end = at + slice.entries.len() * BLOCK_BYTES as usize;
        chain[*k].read_blocks_unlocked(slice, &mut out[at..end])
    })
}

/// Where blocks `first..first + count` live along a chain whose locks the caller holds: what
/// each holds (content, checksum, the first volume's own sequence: 0 for a block read
/// through), and the runs to read, each of one volume of the chain (its index) with its map
/// entries (holes are not read).
fn plan_through(
    states: &[RwLockReadGuard<'_, VolumeState>],
    first: u64,
    count: u64,
) -> (Vec<Found>, Vec<(usize, MapSlice)>) {
    let mut found = Vec::with_capacity(count as usize);
    let mut runs = Vec::new();
    let end = first + count;
    let mut block = first;
    while block < end {
        let k = owner_in(states, block);
        let mut run_end = block + 1;
        while run_end < end && owner_in(states, run_end) == k {
            run_end += 1;
        }
        match k {
            None => found.extend((block..run_end).map(|_| Found {
                allocated: false,
                crc: crate::block_map::zero_block_crc(),
                sequence: Sequence::ZERO,
            })),
            Some(k) => {
                let map = &states[k].map;
                found.extend((block..run_end).map(|b| Found {
                    allocated: map.is_allocated(b),
                    crc: map.crc(b),
                    sequence: if k == 0 { map.sequence(b) } else { Sequence::ZERO },
                }));
                runs.push((k, MapSlice::of(map, block, run_end - block)));
            }
        }
        block = run_end;
    }
    (found, runs)
}

/// What a read through `chain` depended on: its volumes and their applied sequences.
fn chain_state(chain: &[Arc<Volume>], states: &[RwLockReadGuard<'_, VolumeState>]) -> Vec<(u32, Sequence)> {
    chain.iter().zip(states).map(|(v, s)| (v.number, s.applied)).collect()
}

/// The content of one block of the clone whose chain after itself is `through` (`None`: a
/// hole), with its checksum: for a block the clone does not own.
pub(super) fn content_through(through: &[Arc<Volume>], block: u64) -> Result<Option<(Bytes, u32)>, StoreError> {
    let states: Vec<RwLockReadGuard<'_, VolumeState>> =
        through.iter().map(|v| v.live_state()).collect::<Result<_, _>>()?;
    let mut content = BytesMut::zeroed(BLOCK_BYTES as usize);
    let found = read_through(through, &states, block, 1, &mut content)?[0];
    Ok(found.allocated.then(|| (content.freeze(), found.crc)))
}

impl Store {
    /// The chain a read of `volume` goes through (see [`chain_in`]).
    pub(super) fn chain(&self, volume: &Arc<Volume>) -> Result<Vec<Arc<Volume>>, StoreError> {
        chain_in(&self.volumes.read().expect("volume list lock"), volume)
    }

    /// Read blocks `first..first + count` of `volume` (a snapshot or a clone) through its
    /// chain into `out`; with the sequence the content is of (a snapshot's `taken_at`, a live
    /// volume's applied sequence) and that sequence's epoch.
    ///
    /// As a live volume's read does (`read_verified`), it takes the chain's locks only to see
    /// where each block lives and with which checksum, and reads the data files without them,
    /// so that a slow read never delays the commits of the volumes it reads through. A block
    /// that changed meanwhile (its volume's commit overwrote or trimmed it after preserving
    /// it, a deletion emptied its snapshot) fails its checksum, or its read, with the chain no
    /// longer as it was: the read starts again (the last time under the locks). A failure with
    /// the chain unchanged is real (damage, an I/O error).
    pub(super) fn read_chain(
        &self,
        volume: &Arc<Volume>,
        first: u64,
        count: u64,
        out: &mut [u8],
    ) -> Result<(Sequence, Epoch, Vec<Found>), StoreError> {
        let (mut attempt, mut went) = (0, 0);
        loop {
            attempt += 1;
            let chain = self.chain(volume)?;
            let states: Vec<RwLockReadGuard<'_, VolumeState>> =
                match chain.iter().map(|v| v.live_state()).collect::<Result<_, _>>() {
                    Ok(states) => states,
                    // A volume of the chain went between listing it and locking it (a newer
                    // snapshot deleted): the chain is listed again.
                    Err(StoreError::Removed { .. }) if !volume.is_removed() && went < CHAIN_CHANGES_MAX => {
                        went += 1;
                        attempt -= 1;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
            let (sequence, epoch) = match volume.snapshot_of {
                Some(of) => (of.taken_at, Epoch(0)),
                None => (states[0].applied, states[0].applied_epoch),
            };
            if attempt > super::READ_UNLOCKED_ATTEMPTS_MAX {
                let found = read_through(&chain, &states, first, count, out)?;
                return Ok((sequence, epoch, found));
            }
            let (found, runs) = plan_through(&states, first, count);
            let seen = chain_state(&chain, &states);
            drop(states);
            match read_runs(&chain, &runs, first, out) {
                Ok(()) => return Ok((sequence, epoch, found)),
                Err(e) => {
                    // A deleted snapshot's data file is emptied before it goes: a read of it
                    // fails short, not only with a checksum.
                    let unchanged = self.chain(volume).ok().is_some_and(|now| {
                        let states: Result<Vec<RwLockReadGuard<'_, VolumeState>>, StoreError> =
                            now.iter().map(|v| v.live_state()).collect();
                        states.is_ok_and(|states| chain_state(&now, &states) == seen)
                    });
                    if unchanged {
                        return Err(e);
                    }
                    out.fill(0);
                }
            }
        }
    }

    /// A read of a snapshot or a clone: its content, with the sequence it is of.
    pub(super) fn read_through_chain(
        &self,
        volume: &Arc<Volume>,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Result<(Sequence, ReadData), StoreError> {
        let Some(geometry) = Geometry::of(offset_bytes, length_bytes as u64) else {
            let sequence = match volume.snapshot_of {
                Some(of) => of.taken_at,
                None => volume.live_state()?.applied,
            };
            return Ok((sequence, ReadData { data: Bytes::new(), crcs: Vec::new() }));
        };
        let count = geometry.last - geometry.first + 1;
        let mut buffer = crate::zeroed_buffer((count * BLOCK_BYTES) as usize);
        let (sequence, _, found) = self.read_chain(volume, geometry.first, count, &mut buffer)?;
        let skip = (offset_bytes - geometry.first * BLOCK_BYTES) as usize;
        let data = buffer.freeze().slice(skip..skip + length_bytes as usize);
        let crcs = super::piece_crcs(offset_bytes, &data, |i| found[i].crc);
        Ok((sequence, ReadData { data, crcs }))
    }

    /// Summaries of blocks `first..first + count` of a clone as a scrub or a full recovery
    /// compares them (content through the chain, sequence 0 for a block read through), each
    /// checked against its checksum, with the clone's applied sequence.
    pub(super) fn clone_summaries(
        &self,
        clone: &Arc<Volume>,
        first: u64,
        count: u64,
    ) -> Result<(Sequence, Epoch, Vec<BlockSummary>, Bytes), StoreError> {
        let mut buffer = crate::zeroed_buffer((count * BLOCK_BYTES) as usize);
        let (applied, epoch, found) = self.read_chain(clone, first, count, &mut buffer)?;
        let summaries =
            found.iter().map(|f| BlockSummary { sequence: f.sequence, crc: f.crc, allocated: f.allocated }).collect();
        Ok((applied, epoch, summaries, buffer.freeze()))
    }

    /// Source side of a full recovery of a clone: as `copy_chunk`, with the clone's content
    /// read through its chain (a block read through is sent at sequence 0: the target's clone
    /// owns it).
    pub(super) fn clone_copy_chunk(
        &self,
        clone: &Arc<Volume>,
        handle: VolumeHandle,
        first: u64,
        have: &[BlockSummary],
    ) -> Result<BlockChunk, StoreError> {
        if have.len() > COPY_CHUNK_BLOCKS_MAX {
            let length_bytes = have.len() as u64 * BLOCK_BYTES;
            return Err(StoreError::PayloadTooLarge { volume: clone.name.clone(), length_bytes });
        }
        clone.check_range(first * BLOCK_BYTES, have.len() as u64 * BLOCK_BYTES)?;
        let (applied, applied_epoch, ours, buffer) = self.clone_summaries(clone, first, have.len() as u64)?;
        let mut blocks = Vec::new();
        for (i, (mine, theirs)) in ours.iter().zip(have).enumerate() {
            let differs = match (mine.allocated, theirs.allocated) {
                (false, false) => false,
                (true, true) => mine.sequence != theirs.sequence || mine.crc != theirs.crc,
                _ => true,
            };
            if differs {
                let at = i * BLOCK_BYTES as usize;
                let content = mine.allocated.then(|| buffer.slice(at..at + BLOCK_BYTES as usize));
                blocks.push(BlockCopy { block: first + i as u64, sequence: mine.sequence, content });
            }
        }
        let snapshots = self
            .snapshots(handle)
            .into_iter()
            .map(|s| proto::SnapshotSummary { id: s.id, taken_at: s.taken_at, size_bytes: s.size_bytes })
            .collect();
        Ok(BlockChunk { applied, applied_epoch, blocks, snapshots })
    }

    /// The volume `name`, a clone of snapshot `snapshot_id` of live volume `parent`, created
    /// (durably, at sequence 0) if there is none; as [`Store::ensure_volume`] if there is one
    /// (a clone is a volume like any other once created). If this store does not hold the
    /// snapshot (its volume has not taken it yet, or a full recovery is copying it), the clone
    /// is created empty and copying: it holds nothing until a full recovery copies it from a
    /// peer (the element says it is copying; the copy state is on disk before the metadata
    /// names the volume).
    pub fn ensure_clone(
        &self,
        name: &str,
        size_bytes: u64,
        parent: &str,
        snapshot_id: u64,
    ) -> Result<VolumeHandle, StoreError> {
        if self.volume(name).is_some() {
            return self.ensure_volume(name, size_bytes);
        }
        super::check_new_volume(name, size_bytes)?;
        let invalid = |reason: String| Err(StoreError::InvalidVolume { name: name.to_string(), reason });
        let base = self.volume(parent).and_then(|p| self.snapshot(p, snapshot_id));
        if let Some(base) = base {
            let snapshot_bytes = self.volume_at(base).size_bytes();
            if snapshot_bytes > size_bytes {
                return invalid(format!(
                    "its snapshot holds {snapshot_bytes} bytes, more than the clone's {size_bytes}"
                ));
            }
        }
        let mut committer = self.lock_committer()?;
        // Sharing its snapshot's blocks, it costs the disk what it writes (as a snapshot); one
        // made to be copied will hold its whole content.
        let room = match base {
            Some(_) => self.check_room_with(&[], &[size_bytes]),
            None => self.check_room(&[size_bytes]),
        };
        room.map_err(|reason| StoreError::InvalidVolume { name: name.to_string(), reason })?;
        match base {
            Some(base) => {
                let base_number = self.volume_at(base).number;
                let handle =
                    self.create_volume_locked(&mut committer, name, size_bytes, None, Some(base_number), None)?;
                tracing::info!(volume = name, parent, snapshot_id, "clone created");
                Ok(handle)
            }
            None => {
                let copy = CopyState::fresh(false);
                let handle = self.create_volume_locked(&mut committer, name, size_bytes, None, None, Some(copy))?;
                tracing::warn!(
                    volume = name,
                    parent,
                    snapshot_id,
                    "clone of a snapshot this element does not hold (yet): created empty, for a full recovery to copy"
                );
                Ok(handle)
            }
        }
    }

    /// Make every clone whose base is one of the snapshots numbered `going` own its whole
    /// content (see the module's documentation), before they leave. (A clone that reads
    /// through one of them further down its chain, through another clone, needs nothing: that
    /// clone's content does not change when it comes to own it.) The commit lock held.
    pub(super) fn materialize_dependents_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        going: &[u32],
    ) -> Result<(), StoreError> {
        let volumes = self.volumes.read().expect("volume list lock").clone();
        for clone in volumes.iter().filter(|v| !v.is_removed() && v.clone_base().is_some()) {
            if going.contains(&clone.number) {
                continue;
            }
            if clone.clone_base().is_some_and(|base| going.contains(&base)) {
                self.materialize_locked(committer, &volumes, clone)?;
            }
        }
        Ok(())
    }

    /// Write the blocks `clone` reads through into its own data file and map (sequence 0),
    /// make them durable, then forget its base. If its chain cannot be read, the clone becomes
    /// a repair instead (a full recovery that verifies every block copies it from a peer).
    fn materialize_locked(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        volumes: &[Arc<Volume>],
        clone: &Arc<Volume>,
    ) -> Result<(), StoreError> {
        let i = volumes.iter().position(|v| Arc::ptr_eq(v, clone)).expect("listed");
        let copying = lock(&clone.copy).is_some();
        let result = if copying { Ok(0) } else { self.copy_in_base(committer, volumes, i) };
        match result {
            Ok(blocks) => {
                // Durable before the metadata stops reading through the base.
                let sealed = committer.seal(self, volumes);
                self.guard(sealed)?;
                self.shared.checkpointer.wait_idle(&self.shared);
                self.shared.check_failure()?;
                self.forget_base(clone)?;
                tracing::info!(volume = %clone.name, blocks, "clone now owns its content: its base snapshot goes");
            }
            Err(error @ StoreError::Failed { .. }) => return Err(error),
            Err(error) => {
                tracing::error!(volume = %clone.name, %error, "clone's base cannot be read: it is repaired by a full recovery");
                let state = CopyState::fresh(true);
                let saved = copy::save(&self.shared.dir, clone.number, &state);
                self.guard(saved)?;
                *lock(&clone.copy) = Some(state);
                self.forget_base(clone)?;
                lock(&self.shared.damaged).push(i as u32);
            }
        }
        Ok(())
    }

    /// Copy the blocks volume `i` (a clone) reads through into it; how many.
    fn copy_in_base(
        &self,
        committer: &mut MutexGuard<'_, Committer>,
        volumes: &[Arc<Volume>],
        i: usize,
    ) -> Result<u64, StoreError> {
        let clone = &volumes[i];
        let chain = chain_in(volumes, clone)?;
        let step = SCAN_BUFFER_BYTES / BLOCK_BYTES;
        let blocks = clone.blocks();
        let mut buffer = vec![0u8; SCAN_BUFFER_BYTES as usize];
        let mut copied = 0;
        let mut first = 0;
        while first < blocks {
            let count = step.min(blocks - first);
            let out = &mut buffer[..(count * BLOCK_BYTES) as usize];
            out.fill(0);
            let mut wanted = Vec::new();
            {
                let states: Vec<RwLockReadGuard<'_, VolumeState>> =
                    chain.iter().map(|v| v.live_state()).collect::<Result<_, _>>()?;
                let found = read_through(&chain, &states, first, count, out)?;
                for (k, f) in found.iter().enumerate() {
                    let b = first + k as u64;
                    if !Volume::owns(&states[0].map, b) && f.allocated {
                        wanted.push((b, f.crc));
                    }
                }
            }
            if !wanted.is_empty() {
                let mut state = clone.live_state_mut()?;
                for &(b, crc) in &wanted {
                    let at = ((b - first) * BLOCK_BYTES) as usize;
                    std::os::unix::fs::FileExt::write_all_at(
                        &clone.data,
                        &out[at..at + BLOCK_BYTES as usize],
                        b * BLOCK_BYTES,
                    )
                    .map_err(crate::error::io_error("write volume data", &clone.data_path))?;
                    state.map.set_written(b, Sequence::ZERO, crc);
                }
                committer.dirty[i].mark_dirty(first..first + count);
                copied += wanted.len() as u64;
            }
            first += count;
        }
        Ok(copied)
    }

    /// Blocks `volume` holds itself (a clone: the blocks it wrote or trimmed, not those it
    /// reads through; a snapshot: those it preserved): what it costs in space.
    pub fn owned_blocks(&self, volume: VolumeHandle) -> u64 {
        let v = self.volume_at(volume);
        let state = v.state.read().expect("volume lock");
        (0..state.map.blocks()).filter(|&b| Volume::owns(&state.map, b)).count() as u64
    }

    /// The metadata and the volume stop naming `clone`'s base.
    pub(super) fn forget_base(&self, clone: &Volume) -> Result<(), StoreError> {
        let number = clone.number;
        self.write_meta(|meta| {
            if let Some(v) = meta.volumes.iter_mut().find(|v| v.number == number) {
                v.clone_of = None;
            }
        })?;
        clone.set_clone_base(None);
        Ok(())
    }
}

impl CopyState {
    /// The state of a copy no host element has ordered yet (`verify`: a repair), not `intact`.
    pub(crate) fn fresh(verify: bool) -> CopyState {
        CopyState {
            epoch: Epoch(0),
            base: Sequence::ZERO,
            base_epoch: Epoch(0),
            cursor_block: 0,
            verify,
            intact: false,
        }
    }
}
