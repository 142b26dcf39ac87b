//! Element storage in memory: [`ElementStorage`] with the semantics of `crates/store` and a
//! disk that can fail, for the simulator and the cores' tests.
//!
//! A commit is *written* when the core's job is taken (it sits in the page cache: `unsynced`)
//! and *durable* once the simulated fdatasync completes ([`MemStorage::sync`]); only then does
//! the element hear of it. A crash decides what the unsynced job leaves behind: a killed
//! process keeps what it had written (the page cache survives), a power loss keeps a prefix of
//! the batch (the caller draws it) and may tear the next record (discarded by its checksum). Per-block
//! checksums fail reads of a corrupt block; a corrupt replay-log record fails its fetch; a full
//! disk makes the next change fail and the store refuse changes until it is reopened.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::element::{CommitDone, LocalVolume, VolumeInfo};
use crate::storage::ElementStorage;
use bytes::Bytes;
use proto::{
    BlockChunk, BlockExtent, BlockSummary, Epoch, HostId, Op, ReadData, Record, Sequence, VolumeSpec, BLOCK_BYTES,
};

/// What a power loss leaves of the job that was written but not synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PowerLoss {
    /// Records of the unsynced commit that reached the disk (a prefix).
    pub records_kept: usize,
    /// The next record was torn (discarded by its checksum at the next start).
    pub torn: bool,
    /// An unsynced epoch adoption reached the disk.
    pub epoch_kept: bool,
}

/// What a block silently diverged by [`MemStorage::diverge_block`] holds, every byte of it.
pub const DIVERGED_BYTE: u8 = 0xdd;

/// Replay-log bookkeeping per record beyond its payload.
const LOG_RECORD_OVERHEAD_BYTES: u64 = 64;

pub struct Volume {
    pub name: String,
    pub data: Vec<u8>,
    /// Per 4 KiB block: holds data (false: a hole that reads as zeroes).
    pub allocated: Vec<bool>,
    /// Epoch of every applied record, index = sequence − 1. The simulator's ground truth of
    /// this replica's history (the real element keeps only the bounded replay log).
    pub history: Vec<Epoch>,
    /// Per 4 KiB block: the sequence of the record that last changed it (as the store's block
    /// map), for scrub summaries.
    pub changed: Vec<Sequence>,
    log: VecDeque<Record>,
    log_bytes: u64,
    /// Removed (`remove_volume`): it holds nothing (its bytes stay, zeroed, so that indexing
    /// by volume number keeps working) and storage lists it with size 0 at the next start.
    pub removed: bool,
    /// A snapshot (read-only): of which volume, its id, and the sequence it was taken at. The
    /// model keeps a whole copy (the store keeps only the blocks changed since); storage lists
    /// it with size 0, as a volume no session names.
    pub snapshot_of: Option<(usize, u64, Sequence)>,
}

impl Volume {
    pub fn applied(&self) -> Sequence {
        Sequence(self.history.len() as u64)
    }

    /// The sequence a read reflects: the applied one, or a snapshot's.
    pub fn read_sequence(&self) -> Sequence {
        self.snapshot_of.map_or(self.applied(), |(_, _, taken_at)| taken_at)
    }

    /// Epoch of the last applied record (0 before the first), as `Store::applied_epoch`.
    pub fn applied_epoch(&self) -> Epoch {
        self.history.last().copied().unwrap_or(Epoch(0))
    }
}

/// A peer's volume as a full recovery copies it (the real copy's chunk-by-chunk, resumable
/// walk is not modelled, only its outcome).
#[derive(Debug)]
pub struct VolumeCopy {
    pub data: Vec<u8>,
    pub allocated: Vec<bool>,
    pub history: Vec<Epoch>,
    pub changed: Vec<Sequence>,
    /// Its snapshots (all taken at or before the copy's point): id, the sequence of its
    /// record, content and allocation.
    pub snapshots: Vec<(u64, Sequence, Vec<u8>, Vec<bool>)>,
}

/// Written, not yet synced.
enum Unsynced {
    Records(Vec<(usize, Record)>),
    Epoch(Epoch, HostId),
}

pub struct MemStorage {
    /// The epoch on disk: adopted, or raised by committed records.
    pub epoch: Epoch,
    /// The host element the epoch belongs to.
    pub holder: HostId,
    pub vols: Vec<Volume>,
    /// The largest volume it holds (its "disk").
    volume_bytes_max: u64,
    replay_log_bytes: u64,
    /// Off in the `no-fencing` broken variant (as the element core's `fencing`).
    fencing: bool,
    unsynced: Option<Unsynced>,
    pub disk_full: bool,
    /// A change failed: refuses changes until the element restarts.
    pub poisoned: bool,
    pub fsync_us: u64,
    pub slow_disk_factor: u64,
    pub corrupt_blocks: BTreeSet<(usize, u64)>,
    /// Volumes being repaired (a block failed its checksum), as the store's copy state file:
    /// they take no records and report `copying` until a copy is installed. The flag: found
    /// while running (the store's `CopyState::intact`), so the volume serves copies of its
    /// intact blocks; not so after `starfish element repair` (a rotted batch).
    repairs: std::cell::RefCell<BTreeMap<usize, bool>>,
    /// Repairs not yet taken by the element.
    damaged: std::cell::RefCell<Vec<u32>>,
    /// (volume, sequence) of the newest synced batch.
    pub last_batch: Vec<(usize, Sequence)>,
    pub corrupt_log: BTreeSet<(usize, u64)>,
    pub torn_records: u64,
    pub unsynced_lost: u64,
    /// Records applied with an epoch older than the last record of another volume here (the
    /// roll-forward of a volume that another volume had already left behind; the old
    /// store-wide fencing refused them: core bug 1 in docs/testing.md).
    pub applied_behind_another_volume: u64,
    /// A deliberately broken variant (the simulator's `snapshot-shares-live`): a snapshot
    /// reads its live volume, as if it preserved nothing.
    pub snapshots_share_live: bool,
    /// Broken variant `clone-starts-empty`: a clone is created empty, as if its snapshot
    /// were not named (the simulator's clone checker must catch it).
    pub clones_start_empty: bool,
    /// Volumes whose full-recovery copy began and was not installed, as the store's copy
    /// state file: they take no records and report `copying` (a crash keeps the mark).
    copying: BTreeSet<usize>,
    /// Copies interrupted (failed, or cut by a crash) so far.
    pub copies_interrupted: u64,
    /// Broken variant: a crash forgets the copy state (the volume reports what it held before
    /// the copy, although a part of its blocks was overwritten by copied ones).
    pub forget_copy_state: bool,
}

impl MemStorage {
    /// Storage for volumes of up to `volume_bytes_max` bytes each.
    pub fn new(volume_bytes_max: u64, fsync_us: u64, replay_log_bytes: u64, fencing: bool) -> MemStorage {
        MemStorage {
            epoch: Epoch(0),
            holder: HostId(0),
            vols: Vec::new(),
            volume_bytes_max,
            replay_log_bytes,
            fencing,
            unsynced: None,
            disk_full: false,
            poisoned: false,
            fsync_us,
            slow_disk_factor: 1,
            corrupt_blocks: BTreeSet::new(),
            repairs: std::cell::RefCell::new(BTreeMap::new()),
            damaged: std::cell::RefCell::new(Vec::new()),
            last_batch: Vec::new(),
            corrupt_log: BTreeSet::new(),
            torn_records: 0,
            unsynced_lost: 0,
            applied_behind_another_volume: 0,
            snapshots_share_live: false,
            clones_start_empty: false,
            copying: BTreeSet::new(),
            copies_interrupted: 0,
            forget_copy_state: false,
        }
    }

    /// The bytes a read of volume `vi` sees: its own, or (broken variant) a snapshot's live
    /// volume's.
    fn readable(&self, vi: usize) -> &Volume {
        match self.vols[vi].snapshot_of {
            Some((parent, _, _)) if self.snapshots_share_live => &self.vols[parent],
            _ => &self.vols[vi],
        }
    }

    /// A new empty volume of `size_bytes` (a whole number of blocks, at most the largest).
    pub fn add_volume(&mut self, name: String, size_bytes: u64) -> LocalVolume {
        assert!(
            size_bytes <= self.volume_bytes_max && size_bytes.is_multiple_of(BLOCK_BYTES),
            "volume {name}: {size_bytes} bytes"
        );
        let blocks = (size_bytes / BLOCK_BYTES) as usize;
        self.vols.push(Volume {
            name,
            data: vec![0; size_bytes as usize],
            allocated: vec![false; blocks],
            history: Vec::new(),
            changed: vec![Sequence::ZERO; blocks],
            log: VecDeque::new(),
            log_bytes: 0,
            removed: false,
            snapshot_of: None,
        });
        LocalVolume(self.vols.len() as u32 - 1)
    }

    /// Snapshot `id` of volume `vi`, if it holds one.
    pub fn snapshot_index(&self, vi: usize, id: u64) -> Option<usize> {
        self.vols.iter().position(|v| !v.removed && v.snapshot_of.is_some_and(|(p, i, _)| p == vi && i == id))
    }

    /// Apply a snapshot's record of volume `vi` (taking it, unless it exists; deleting it, if
    /// it exists).
    fn apply_snapshot(&mut self, vi: usize, record: &Record) {
        match record.op {
            Op::Snapshot { id } if self.snapshot_index(vi, id).is_none() => {
                let v = &self.vols[vi];
                let snapshot = Volume {
                    name: format!("{}@{id}", v.name),
                    data: v.data.clone(),
                    allocated: v.allocated.clone(),
                    history: Vec::new(),
                    changed: vec![Sequence::ZERO; v.changed.len()],
                    log: VecDeque::new(),
                    log_bytes: 0,
                    removed: false,
                    snapshot_of: Some((vi, id, record.sequence)),
                };
                self.vols.push(snapshot);
            }
            Op::SnapshotDelete { id } => {
                if let Some(si) = self.snapshot_index(vi, id) {
                    self.drop_volume(si);
                }
            }
            _ => {}
        }
    }

    /// Volume `vi` holds nothing any more (removed, or a snapshot deleted).
    fn drop_volume(&mut self, vi: usize) {
        let v = &mut self.vols[vi];
        v.removed = true;
        v.data.fill(0);
        v.allocated.fill(false);
        v.changed.fill(Sequence::ZERO);
        v.history.clear();
        v.log.clear();
        v.log_bytes = 0;
        self.repairs.borrow_mut().remove(&vi);
        self.copying.remove(&vi);
    }

    /// A full recovery's copy of volume `vi` begins (the store's `begin_copy`): until a copy
    /// is installed, the volume holds nothing consistent.
    pub fn begin_copy(&mut self, vi: usize) {
        self.copying.insert(vi);
    }

    /// Whether a copy of volume `vi` began and was not installed.
    pub fn copying(&self, vi: usize) -> bool {
        self.copying.contains(&vi)
    }

    /// A copy under way stops (it failed, or the process died): the real store's volume then
    /// holds the blocks copied so far over its old ones, a mix of two states that no replica
    /// ever held. Modelled as every allocated block altered, so that a replica taken back as
    /// if it held its old content is seen to differ.
    pub fn interrupt_copy(&mut self, vi: usize) {
        if !self.copying.contains(&vi) {
            return;
        }
        self.copies_interrupted += 1;
        let v = &mut self.vols[vi];
        for (block, data) in v.data.chunks_mut(BLOCK_BYTES as usize).enumerate() {
            if v.allocated[block] {
                // Not 0xee throughout (the checker's mark of what no host element wrote).
                data.iter_mut().for_each(|b| *b ^= 0x5a);
            }
        }
    }

    /// How long the sync of what is written takes.
    pub fn sync_delay_us(&self) -> u64 {
        let bytes = match &self.unsynced {
            Some(Unsynced::Records(records)) => records.iter().map(|(_, r)| r.op.payload_bytes()).sum(),
            _ => 0,
        };
        (self.fsync_us + bytes / 400) * self.slow_disk_factor
    }

    /// The fdatasync completed: what was written is durable and applied.
    pub fn sync(&mut self) {
        match self.unsynced.take() {
            Some(Unsynced::Records(records)) => {
                for (vi, record) in &records {
                    self.apply(*vi, record);
                }
                self.last_batch = records.iter().map(|(vi, r)| (*vi, r.sequence)).collect();
            }
            Some(Unsynced::Epoch(epoch, host)) => self.raise_epoch(epoch, host),
            None => {}
        }
    }

    /// Bit rot in the newest synced log batch, found at the next start, and the operator's
    /// `starfish element repair`: the batch's records are gone (its history and replay log
    /// end before them; the blocks they wrote may hold anything) and every volume waits for a
    /// repair. Returns how many acknowledged records were lost.
    pub fn rot_newest_batch(&mut self) -> usize {
        let batch = std::mem::take(&mut self.last_batch);
        let mut lost = 0;
        for &(vi, sequence) in &batch {
            let v = &mut self.vols[vi];
            if v.applied() < sequence {
                continue; // already gone (a copy replaced the volume since)
            }
            let keep = (sequence.0 - 1) as usize;
            lost += v.history.len() - keep;
            v.history.truncate(keep);
            while v.log.back().is_some_and(|r| r.sequence >= sequence) {
                let old = v.log.pop_back().expect("non-empty");
                v.log_bytes -= old.op.payload_bytes() + LOG_RECORD_OVERHEAD_BYTES;
            }
        }
        if lost > 0 {
            for vi in 0..self.vols.len() {
                if self.vols[vi].snapshot_of.is_none() {
                    self.mark_for_repair(vi);
                    // Made by `starfish element repair`: no copy source.
                    self.repairs.borrow_mut().insert(vi, false);
                }
            }
        }
        lost
    }

    /// Whether records of volume `vi` are written but not synced.
    pub fn unsynced_records_of(&self, vi: usize) -> bool {
        matches!(&self.unsynced, Some(Unsynced::Records(records)) if records.iter().any(|(v, _)| *v == vi))
    }

    /// Newest sequence of `vi` written (synced or not).
    pub fn written_through(&self, vi: usize) -> Sequence {
        let mut written = self.vols[vi].applied();
        if let Some(Unsynced::Records(records)) = &self.unsynced {
            for (v, record) in records {
                if *v == vi {
                    written = record.sequence;
                }
            }
        }
        written
    }

    /// Records written but not synced.
    pub fn unsynced_records(&self) -> usize {
        match &self.unsynced {
            Some(Unsynced::Records(records)) => records.len(),
            _ => 0,
        }
    }

    /// The process stops (`None`: killed, the page cache survives) or the machine loses power:
    /// what the unsynced job leaves behind depends on which.
    pub fn crash(&mut self, power_loss: Option<PowerLoss>) {
        match self.unsynced.take() {
            Some(Unsynced::Records(records)) => {
                let keep = power_loss.map_or(records.len(), |p| p.records_kept.min(records.len()));
                if keep < records.len() && power_loss.is_some_and(|p| p.torn) {
                    self.torn_records += 1;
                }
                self.unsynced_lost += (records.len() - keep) as u64;
                for (vi, record) in &records[..keep] {
                    self.apply(*vi, record);
                }
            }
            // The metadata write of a newer epoch may or may not have reached the disk.
            Some(Unsynced::Epoch(epoch, host)) if power_loss.is_none_or(|p| p.epoch_kept) => {
                self.raise_epoch(epoch, host)
            }
            Some(Unsynced::Epoch(..)) | None => {}
        }
        for vi in self.copying.clone() {
            self.interrupt_copy(vi);
        }
        if self.forget_copy_state {
            // The store keeps a repair's mark in the same copy state file: gone with it.
            for vi in std::mem::take(&mut self.copying) {
                self.repairs.borrow_mut().remove(&vi);
            }
        }
    }

    /// A block of volume `vi` failed its checksum: the volume becomes a repair.
    fn mark_for_repair(&self, vi: usize) {
        if let std::collections::btree_map::Entry::Vacant(entry) = self.repairs.borrow_mut().entry(vi) {
            entry.insert(!self.copying.contains(&vi));
            self.damaged.borrow_mut().push(vi as u32);
        }
    }

    /// Whether volume `vi` is being repaired.
    pub fn repairing(&self, vi: usize) -> bool {
        self.repairs.borrow().contains_key(&vi)
    }

    fn raise_epoch(&mut self, epoch: Epoch, host: HostId) {
        if epoch > self.epoch {
            self.epoch = epoch;
            self.holder = host;
        }
    }

    fn refuse_changes(&mut self) -> Option<String> {
        if self.disk_full || self.poisoned {
            self.poisoned = true;
            return Some("no space left on device (the store refuses changes until reopened)".into());
        }
        None
    }

    fn partially_covered_corrupt_block(&self, vi: usize, record: &Record) -> Option<u64> {
        let start = record.op.offset_bytes();
        let end = start + record.op.length_bytes();
        (start / BLOCK_BYTES..end.div_ceil(BLOCK_BYTES)).find(|b| {
            let covered = start <= b * BLOCK_BYTES && end >= (b + 1) * BLOCK_BYTES;
            !covered && self.corrupt_blocks.contains(&(vi, *b))
        })
    }

    fn apply(&mut self, vi: usize, record: &Record) {
        if self.vols.iter().enumerate().any(|(j, w)| j != vi && w.applied_epoch() > record.epoch) {
            self.applied_behind_another_volume += 1;
        }
        let v = &mut self.vols[vi];
        assert_eq!(record.sequence, v.applied().next(), "storage applies strictly in sequence order");
        let start = record.op.offset_bytes();
        let end = start + record.op.length_bytes();
        let zeroing = !matches!(record.op, Op::Write { .. });
        match &record.op {
            Op::Write { data, .. } => v.data[start as usize..end as usize].copy_from_slice(data),
            _ => v.data[start as usize..end as usize].fill(0),
        }
        for b in start / BLOCK_BYTES..end.div_ceil(BLOCK_BYTES) {
            let covered = start <= b * BLOCK_BYTES && end >= (b + 1) * BLOCK_BYTES;
            if !zeroing {
                v.allocated[b as usize] = true;
            } else if covered {
                v.allocated[b as usize] = false;
            }
            if covered {
                self.corrupt_blocks.remove(&(vi, b));
            }
            v.changed[b as usize] = record.sequence;
        }
        v.history.push(record.epoch);
        if record.epoch > self.epoch {
            // As the store: an epoch raised by records alone has no known holder.
            self.epoch = record.epoch;
            self.holder = HostId(0);
        }
        v.log_bytes += record.op.payload_bytes() + LOG_RECORD_OVERHEAD_BYTES;
        v.log.push_back(record.clone());
        while v.log_bytes > self.replay_log_bytes && v.log.len() > 1 {
            let old = v.log.pop_front().expect("non-empty");
            v.log_bytes -= old.op.payload_bytes() + LOG_RECORD_OVERHEAD_BYTES;
            self.corrupt_log.remove(&(vi, old.sequence.0));
        }
        self.apply_snapshot(vi, record);
    }

    /// The volume as a full recovery copies it (`Err` if a block fails its checksum, as the
    /// real source's verified read does).
    /// `target` and `tvi`: the copier's storage and volume. As the store's `copy_chunk`, the
    /// source reads only the blocks whose summary differs from the copier's (or that the
    /// copier's own read finds bad), so a bad block of the source fails the copy only where the
    /// copier needs it.
    pub fn copy_volume(&self, vi: usize, target: &MemStorage, tvi: usize) -> Result<VolumeCopy, String> {
        // As the store's `copy_chunk`: a volume being copied here is no source, nor is a
        // repair, but one found while running of a volume without snapshots that is no clone.
        let has_snapshots = self.vols.iter().any(|s| !s.removed && s.snapshot_of.is_some_and(|(p, _, _)| p == vi));
        let repair_serves = self.repairs.borrow().get(&vi).copied().unwrap_or(true) && !has_snapshots;
        if self.copying(vi) || (self.repairing(vi) && !repair_serves) {
            return Err(format!("volume {} is being recovered here: no source for a copy", self.vols[vi].name));
        }
        let v = &self.vols[vi];
        let t = &target.vols[tvi];
        let summary = |w: &Volume, b: usize| {
            let start = b * BLOCK_BYTES as usize;
            (
                w.allocated[b],
                w.allocated[b].then(|| (w.changed[b], proto::crc32c(&w.data[start..start + BLOCK_BYTES as usize]))),
            )
        };
        let needed = |b: u64| {
            target.corrupt_blocks.contains(&(tvi, b))
                || t.allocated.len() != v.allocated.len()
                || summary(t, b as usize) != summary(v, b as usize)
        };
        if let Some((_, b)) = self.corrupt_blocks.iter().find(|(w, b)| *w == vi && needed(*b)) {
            return Err(format!("peer could not send blocks: block {b} fails its checksum"));
        }
        let snapshots = self
            .vols
            .iter()
            .filter(|s| !s.removed)
            .filter_map(|s| {
                let (parent, id, taken_at) = s.snapshot_of?;
                (parent == vi).then(|| (id, taken_at, s.data.clone(), s.allocated.clone()))
            })
            .collect();
        Ok(VolumeCopy {
            data: v.data.clone(),
            allocated: v.allocated.clone(),
            history: v.history.clone(),
            changed: v.changed.clone(),
            snapshots,
        })
    }

    /// Install a copy durably; the volume's replay log (its pre-copy history) is dropped, and
    /// its snapshots are replaced by the copy's (as the store's full recovery does).
    pub fn install_copy(&mut self, vi: usize, copy: VolumeCopy) {
        let snapshots: Vec<usize> = (0..self.vols.len())
            .filter(|&si| !self.vols[si].removed && self.vols[si].snapshot_of.is_some_and(|(p, _, _)| p == vi))
            .collect();
        for si in snapshots {
            self.drop_volume(si);
        }
        for (id, taken_at, data, allocated) in copy.snapshots {
            let blocks = allocated.len();
            self.vols.push(Volume {
                name: format!("{}@{id}", self.vols[vi].name),
                data,
                allocated,
                history: Vec::new(),
                changed: vec![Sequence::ZERO; blocks],
                log: VecDeque::new(),
                log_bytes: 0,
                removed: false,
                snapshot_of: Some((vi, id, taken_at)),
            });
        }
        let v = &mut self.vols[vi];
        v.data = copy.data;
        v.allocated = copy.allocated;
        v.history = copy.history;
        v.changed = copy.changed;
        v.log.clear();
        v.log_bytes = 0;
        self.corrupt_blocks.retain(|(w, _)| *w != vi);
        self.corrupt_log.retain(|(w, _)| *w != vi);
        // The copy replaced what the newest batch wrote to this volume: a rot of that batch
        // no longer reaches it (it would take the copied history's tail instead).
        self.last_batch.retain(|(w, _)| *w != vi);
        self.repairs.borrow_mut().remove(&vi);
        self.copying.remove(&vi);
        if self.vols[vi].applied_epoch() > self.epoch {
            self.epoch = self.vols[vi].applied_epoch();
            self.holder = HostId(0);
        }
    }

    /// The blocks of volume `vi` that hold data (to corrupt one).
    pub fn allocated_blocks(&self, vi: usize) -> Vec<u64> {
        (0..self.vols[vi].allocated.len() as u64).filter(|b| self.vols[vi].allocated[*b as usize]).collect()
    }

    /// Change block `b` of volume `vi` behind the element's back, its checksum with it: a
    /// replica that silently differs (a misdirected write, a bug), which only a comparison
    /// with the other replicas (scrub) finds. The block then holds [`DIVERGED_BYTE`]
    /// throughout.
    pub fn diverge_block(&mut self, vi: usize, b: u64) {
        let v = &mut self.vols[vi];
        let start = (b * BLOCK_BYTES) as usize;
        v.data[start..start + BLOCK_BYTES as usize].fill(DIVERGED_BYTE);
        v.allocated[b as usize] = true;
    }

    /// The sequences volume `vi`'s replay log holds (to corrupt one).
    pub fn logged_sequences(&self, vi: usize) -> Vec<u64> {
        self.vols[vi].log.iter().map(|r| r.sequence.0).collect()
    }

    /// Forget the replay log before `sequence` (as a store whose retention ran out).
    pub fn truncate_log_before(&mut self, vi: usize, sequence: Sequence) {
        let v = &mut self.vols[vi];
        while v.log.front().is_some_and(|r| r.sequence < sequence) {
            let old = v.log.pop_front().expect("non-empty");
            v.log_bytes -= old.op.payload_bytes() + LOG_RECORD_OVERHEAD_BYTES;
        }
    }
}

impl ElementStorage for MemStorage {
    fn epoch(&self) -> Epoch {
        self.epoch
    }

    fn epoch_holder(&self) -> HostId {
        self.holder
    }

    fn adopt_epoch(&mut self, epoch: Epoch, host: HostId) -> Result<(), String> {
        assert!(self.unsynced.is_none(), "one storage job at a time");
        if let Some(reason) = self.refuse_changes() {
            return Err(reason);
        }
        self.unsynced = Some(Unsynced::Epoch(epoch, host));
        Ok(())
    }

    fn check_new_volumes(&self, specs: &[VolumeSpec]) -> Result<(), String> {
        for spec in specs {
            let here = self.vols.iter().find(|v| v.name == spec.name && !v.removed).map(|v| v.data.len() as u64);
            match here {
                Some(size) if size > spec.size_bytes && !spec.at_least => {
                    return Err(format!("volume {}: {} bytes here, not {}", spec.name, size, spec.size_bytes))
                }
                Some(_) | None
                    if spec.size_bytes > self.volume_bytes_max || !spec.size_bytes.is_multiple_of(BLOCK_BYTES) =>
                {
                    return Err(format!(
                        "volume {}: this storage holds volumes of whole blocks up to {} bytes only",
                        spec.name, self.volume_bytes_max
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn ensure_volume(&mut self, spec: &VolumeSpec) -> Result<LocalVolume, String> {
        match self.vols.iter().position(|v| v.name == spec.name && !v.removed) {
            Some(i) => {
                // A volume that grew while the element was away: a hello names it larger (a
                // group's storage volume named `at_least` keeps a larger size).
                let here = self.vols[i].data.len() as u64;
                let size_bytes = if spec.at_least { spec.size_bytes.max(here) } else { spec.size_bytes };
                self.resize_volume(LocalVolume(i as u32), size_bytes)?;
                Ok(LocalVolume(i as u32))
            }
            None => {
                let base = spec.clone_of.as_ref().map(|base| {
                    let parent = self.vols.iter().position(|v| v.name == base.volume && !v.removed);
                    parent.and_then(|p| self.snapshot_index(p, base.snapshot))
                });
                let local = self.add_volume(spec.name.clone(), spec.size_bytes);
                let vi = local.0 as usize;
                match base {
                    None => {}
                    // A clone: the snapshot's content (the model copies what the store shares).
                    Some(Some(si)) if !self.clones_start_empty => {
                        let (data, allocated) = (self.vols[si].data.clone(), self.vols[si].allocated.clone());
                        let v = &mut self.vols[vi];
                        v.data[..data.len()].copy_from_slice(&data);
                        v.allocated[..allocated.len()].copy_from_slice(&allocated);
                    }
                    // Broken variant `clone-starts-empty`: as if the snapshot were not named.
                    Some(_) if self.clones_start_empty => {}
                    // A snapshot this element does not hold (yet): empty, to be copied whole
                    // by a full recovery (the store's copy state; here a repair).
                    Some(None) => self.mark_for_repair(vi),
                    Some(Some(_)) => unreachable!("matched above"),
                }
                Ok(local)
            }
        }
    }

    /// Durable at once (the store's commit point is one metadata write).
    fn resize_volume(&mut self, volume: LocalVolume, size_bytes: u64) -> Result<(), String> {
        let v = &self.vols[volume.0 as usize];
        let here = v.data.len() as u64;
        if v.removed {
            return Err(format!("volume {} was removed", v.name));
        }
        if size_bytes < here {
            return Err(format!("volume {}: {here} bytes here, not {size_bytes}: volumes do not shrink", v.name));
        }
        if size_bytes == here {
            return Ok(());
        }
        if size_bytes > self.volume_bytes_max || !size_bytes.is_multiple_of(BLOCK_BYTES) {
            return Err(format!(
                "volume {}: this storage holds volumes of whole blocks up to {} bytes only",
                v.name, self.volume_bytes_max
            ));
        }
        if let Some(reason) = self.refuse_changes() {
            return Err(reason);
        }
        let blocks = (size_bytes / BLOCK_BYTES) as usize;
        let v = &mut self.vols[volume.0 as usize];
        v.data.resize(size_bytes as usize, 0);
        v.allocated.resize(blocks, false);
        v.changed.resize(blocks, Sequence::ZERO);
        Ok(())
    }

    /// Durable at once (the store's commit point is one metadata write).
    fn remove_volume(&mut self, volume: LocalVolume) -> Result<(), String> {
        if let Some(reason) = self.refuse_changes() {
            return Err(reason);
        }
        // Its snapshots go with it, as in the store.
        let vi = volume.0 as usize;
        let snapshots: Vec<usize> = (0..self.vols.len())
            .filter(|&si| !self.vols[si].removed && self.vols[si].snapshot_of.is_some_and(|(p, _, _)| p == vi))
            .collect();
        for si in snapshots.into_iter().chain([vi]) {
            self.drop_volume(si);
        }
        Ok(())
    }

    fn info(&self, volume: LocalVolume) -> VolumeInfo {
        let v = &self.vols[volume.0 as usize];
        let repair = self.repairing(volume.0 as usize);
        let copying = self.copying(volume.0 as usize);
        VolumeInfo { applied: v.applied(), applied_epoch: v.applied_epoch(), copying, repair }
    }

    /// As `Store::commit`, except that the accepted records are only written here: they are
    /// applied by [`MemStorage::sync`], and the outcome is what they will have done then.
    fn commit(&mut self, batch: &[(LocalVolume, Record)]) -> Result<CommitDone, String> {
        assert!(self.unsynced.is_none(), "one storage job at a time");
        if let Some(reason) = self.refuse_changes() {
            return Err(format!("commit failed: {reason}"));
        }
        let mut done = CommitDone::default();
        let mut running: Vec<(Sequence, Epoch)> = self.vols.iter().map(|v| (v.applied(), v.applied_epoch())).collect();
        let mut accepted = Vec::new();
        for (index, (volume, record)) in batch.iter().enumerate() {
            let vi = volume.0 as usize;
            let (applied, epoch) = running[vi];
            // As the store: a volume being repaired or copied skips records (superseded).
            if record.sequence <= applied || self.repairing(vi) || self.copying(vi) {
                continue;
            }
            let refusal = if self.fencing && record.epoch < epoch {
                Some(format!(
                    "record {} of stale epoch {} (the volume's last is of epoch {epoch})",
                    record.sequence, record.epoch
                ))
            } else if record.sequence != applied.next() {
                Some(format!("gap: applied {applied} but got {}", record.sequence))
            } else if let Err(mismatch) = record.op.check_data() {
                Some(format!("record {} arrived damaged: {mismatch}; not committed", record.sequence))
            } else if record.op.offset_bytes() + record.op.length_bytes() > self.vols[vi].data.len() as u64 {
                // As the store: an element that missed a growth of the volume (a group's storage
                // volume named at its configured size until the catalog is read) refuses it.
                let (start, size) = (record.op.offset_bytes(), self.vols[vi].data.len());
                Some(format!("range of {} bytes at {start} ends past the volume size {size}", record.op.length_bytes()))
            } else {
                self.partially_covered_corrupt_block(vi, record).map(|b| {
                    self.mark_for_repair(vi);
                    format!("block {b}: checksum mismatch in the base of a partial write")
                })
            };
            if let Some(reason) = refusal {
                done.rejected.push((index, format!("volume {}: {reason}", self.vols[vi].name)));
                continue;
            }
            running[vi] = (record.sequence, record.epoch);
            accepted.push((vi, record.clone()));
        }
        let mut touched: Vec<usize> = batch.iter().map(|(v, _)| v.0 as usize).collect();
        touched.sort_unstable();
        touched.dedup();
        done.applied = touched.into_iter().map(|vi| (LocalVolume(vi as u32), running[vi].0, running[vi].1)).collect();
        self.unsynced = Some(Unsynced::Records(accepted));
        Ok(done)
    }

    fn read(&self, volume: LocalVolume, offset_bytes: u64, length_bytes: u32) -> Result<(Sequence, ReadData), String> {
        let vi = volume.0 as usize;
        let v = &self.vols[vi];
        let first = offset_bytes / BLOCK_BYTES;
        let end = (offset_bytes + length_bytes as u64).div_ceil(BLOCK_BYTES);
        if let Some(b) = (first..end).find(|b| self.corrupt_blocks.contains(&(vi, *b))) {
            // As the store: a snapshot is not repaired on its own (a full recovery does not
            // copy it); the read fails and the host element reads it elsewhere.
            if v.snapshot_of.is_none() {
                self.mark_for_repair(vi);
            }
            return Err(format!("volume {} block {b}: checksum mismatch", v.name));
        }
        let bytes = &self.readable(vi).data;
        let end_bytes = offset_bytes + length_bytes as u64;
        if end_bytes > bytes.len() as u64 {
            // As the store (a snapshot taken smaller here than elsewhere, say).
            return Err(format!(
                "volume {}: range of {length_bytes} bytes at {offset_bytes} ends past {}",
                v.name,
                bytes.len()
            ));
        }
        let data = Bytes::copy_from_slice(&bytes[offset_bytes as usize..end_bytes as usize]);
        Ok((v.read_sequence(), ReadData::computed(offset_bytes, data)))
    }

    fn block_status(
        &self,
        volume: LocalVolume,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(Sequence, Vec<BlockExtent>), String> {
        let v = &self.vols[volume.0 as usize];
        let mut extents: Vec<BlockExtent> = Vec::new();
        let end_bytes = offset_bytes + length_bytes;
        let mut at = offset_bytes;
        while at < end_bytes {
            let block = at / BLOCK_BYTES;
            let next = ((block + 1) * BLOCK_BYTES).min(end_bytes);
            let allocated = v.allocated[block as usize];
            match extents.last_mut() {
                Some(last) if last.allocated == allocated => last.length_bytes += next - at,
                _ => extents.push(BlockExtent { length_bytes: next - at, allocated }),
            }
            at = next;
        }
        Ok((v.read_sequence(), extents))
    }

    fn log_records(&self, volume: LocalVolume, after: Sequence, max_bytes: u64) -> Result<Vec<Record>, String> {
        let vi = volume.0 as usize;
        let v = &self.vols[vi];
        let last = v.applied();
        if after >= last {
            return Ok(Vec::new());
        }
        let Some(front) = v.log.front() else {
            return Err(format!("sequence {} is no longer in the replay log (it is empty)", after.next()));
        };
        if front.sequence > after.next() {
            return Err(format!(
                "sequence {} is no longer in the replay log (oldest {})",
                after.next(),
                front.sequence
            ));
        }
        let mut records = Vec::new();
        let mut bytes = 0;
        let start = (after.next().0 - front.sequence.0) as usize;
        for record in v.log.iter().skip(start) {
            if record.sequence > last || (!records.is_empty() && bytes + record.op.payload_bytes() > max_bytes) {
                break;
            }
            if self.corrupt_log.contains(&(vi, record.sequence.0)) {
                return Err(format!("replay log record {} fails its checksum", record.sequence));
            }
            bytes += record.op.payload_bytes();
            records.push(record.clone());
        }
        Ok(records)
    }

    fn copy_chunk(
        &self,
        _volume: LocalVolume,
        _first_block: u64,
        _have: &[BlockSummary],
    ) -> Result<BlockChunk, String> {
        Err("the simulator copies a volume whole (MemStorage::copy_volume), not chunk by chunk".into())
    }

    fn scrub_chunk(
        &self,
        volume: LocalVolume,
        first_block: u64,
        count: u32,
    ) -> Result<(Sequence, Vec<BlockSummary>), String> {
        let vi = volume.0 as usize;
        let v = &self.vols[vi];
        let end = (first_block + count as u64).min(v.allocated.len() as u64);
        if let Some(b) = (first_block..end).find(|b| self.corrupt_blocks.contains(&(vi, *b))) {
            self.mark_for_repair(vi);
            return Err(format!("volume {} block {b}: checksum mismatch", v.name));
        }
        let summaries = (first_block..end)
            .map(|b| {
                let start = (b * BLOCK_BYTES) as usize;
                BlockSummary {
                    sequence: v.changed[b as usize],
                    crc: proto::crc32c(&v.data[start..start + BLOCK_BYTES as usize]),
                    allocated: v.allocated[b as usize],
                }
            })
            .collect();
        Ok((v.applied(), summaries))
    }

    fn take_damaged(&self) -> Vec<LocalVolume> {
        self.damaged.borrow_mut().drain(..).map(LocalVolume).collect()
    }

    fn snapshot(&self, volume: LocalVolume, id: u64) -> Option<LocalVolume> {
        self.snapshot_index(volume.0 as usize, id).map(|si| LocalVolume(si as u32))
    }
}
