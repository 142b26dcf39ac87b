//! The element core's storage trait over this store (implemented for `&Store`, so that the
//! committer thread and the blocking pool share one store).

use proto::{BlockChunk, BlockExtent, BlockSummary, Epoch, HostId, ReadData, Record, Sequence, VolumeSpec};
use starfish_core::{CommitDone, ElementStorage, LocalVolume, VolumeInfo};

use crate::{Store, StoreError, VolumeHandle};

impl Store {
    /// The handle of a local volume the element core named.
    pub fn handle_of(&self, volume: LocalVolume) -> VolumeHandle {
        self.volume_numbered(volume.0).expect("the element core names only volumes storage created")
    }

    /// What the element core needs to know of a volume.
    pub fn volume_info(&self, handle: VolumeHandle) -> VolumeInfo {
        VolumeInfo {
            applied: self.applied_sequence(handle),
            applied_epoch: self.applied_epoch(handle),
            copying: self.copy_state(handle).is_some_and(|s| !s.is_pending_repair()),
            repair: self.copy_state(handle).is_some_and(|s| s.is_pending_repair()),
        }
    }
}

impl Store {
    /// A block of `volume` failed its checksum (`error` says so): the volume becomes a repair.
    fn on_damage(&self, volume: VolumeHandle, error: &StoreError) {
        if let StoreError::BlockChecksum { block, .. } = error {
            if let Err(e) = self.mark_for_repair(volume, *block, true) {
                tracing::error!(error = %e, "cannot start the repair of a damaged volume");
            }
        }
    }
}

impl ElementStorage for &Store {
    fn epoch(&self) -> Epoch {
        Store::epoch(self)
    }

    fn epoch_holder(&self) -> HostId {
        Store::epoch_holder(self)
    }

    fn adopt_epoch(&mut self, epoch: Epoch, host: HostId) -> Result<(), String> {
        self.set_epoch(epoch, host).map_err(|e| e.to_string())
    }

    fn check_new_volumes(&self, specs: &[VolumeSpec]) -> Result<(), String> {
        let specs: Vec<(String, u64, bool)> =
            specs.iter().map(|s| (s.name.clone(), requested_bytes(self, s), s.clone_of.is_some())).collect();
        Store::check_new_volumes(self, &specs).map_err(|e| e.to_string())
    }

    fn ensure_volume(&mut self, spec: &VolumeSpec) -> Result<LocalVolume, String> {
        match &spec.clone_of {
            None => Store::ensure_volume(self, &spec.name, requested_bytes(self, spec)),
            Some(base) => Store::ensure_clone(self, &spec.name, spec.size_bytes, &base.volume, base.snapshot),
        }
        .map(|h| LocalVolume(h.number()))
        .map_err(|e| e.to_string())
    }

    fn info(&self, volume: LocalVolume) -> VolumeInfo {
        self.volume_info(self.handle_of(volume))
    }

    fn remove_volume(&mut self, volume: LocalVolume) -> Result<(), String> {
        Store::remove_volume(self, self.handle_of(volume)).map_err(|e| e.to_string())
    }

    fn resize_volume(&mut self, volume: LocalVolume, size_bytes: u64) -> Result<(), String> {
        Store::resize_volume(self, self.handle_of(volume), size_bytes).map_err(|e| e.to_string())
    }

    fn commit(&mut self, batch: &[(LocalVolume, Record)]) -> Result<CommitDone, String> {
        let records: Vec<(VolumeHandle, Record)> =
            batch.iter().map(|(volume, record)| (self.handle_of(*volume), record.clone())).collect();
        let outcome = Store::commit(self, &records).map_err(|e| e.to_string())?;
        for r in &outcome.rejected {
            self.on_damage(records[r.index].0, &r.error);
        }
        Ok(CommitDone {
            applied: outcome
                .applied
                .iter()
                .map(|&(h, sequence)| (LocalVolume(h.number()), sequence, self.applied_epoch(h)))
                .collect(),
            rejected: outcome.rejected.iter().map(|r| (r.index, r.error.to_string())).collect(),
        })
    }

    fn read(&self, volume: LocalVolume, offset_bytes: u64, length_bytes: u32) -> Result<(Sequence, ReadData), String> {
        let handle = self.handle_of(volume);
        Store::read_checked(self, handle, offset_bytes, length_bytes).map_err(|e| {
            // A snapshot is not repaired on its own (a full recovery does not copy it): the
            // damaged block, if it is its live volume's, is found by that volume's scrub.
            if self.snapshot_parent(handle).is_none() {
                self.on_damage(handle, &e);
            }
            e.to_string()
        })
    }

    fn snapshot(&self, volume: LocalVolume, id: u64) -> Option<LocalVolume> {
        Store::snapshot(self, self.handle_of(volume), id).map(|h| LocalVolume(h.number()))
    }

    fn try_read(
        &self,
        volume: LocalVolume,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> Option<Result<(Sequence, ReadData), String>> {
        let handle = self.handle_of(volume);
        match Store::try_read_checked(self, handle, offset_bytes, length_bytes) {
            Ok(read) => read.map(Ok),
            Err(e) => {
                self.on_damage(handle, &e);
                Some(Err(e.to_string()))
            }
        }
    }

    fn block_status(
        &self,
        volume: LocalVolume,
        offset_bytes: u64,
        length_bytes: u64,
    ) -> Result<(Sequence, Vec<BlockExtent>), String> {
        Store::block_status(self, self.handle_of(volume), offset_bytes, length_bytes).map_err(|e| e.to_string())
    }

    fn log_records(&self, volume: LocalVolume, after: Sequence, max_bytes: u64) -> Result<Vec<Record>, String> {
        Store::log_records(self, self.handle_of(volume), after, max_bytes).map_err(|e| e.to_string())
    }

    fn scrub_chunk(
        &self,
        volume: LocalVolume,
        first_block: u64,
        count: u32,
    ) -> Result<(Sequence, Vec<BlockSummary>), String> {
        let handle = self.handle_of(volume);
        Store::scrub_chunk(self, handle, first_block, count).map_err(|e| {
            self.on_damage(handle, &e);
            e.to_string()
        })
    }

    fn copy_chunk(&self, volume: LocalVolume, first_block: u64, have: &[BlockSummary]) -> Result<BlockChunk, String> {
        let handle = self.handle_of(volume);
        Store::copy_chunk(self, handle, first_block, have).map_err(|e| {
            self.on_damage(handle, &e);
            e.to_string()
        })
    }

    fn take_damaged(&self) -> Vec<LocalVolume> {
        Store::take_damaged(self).into_iter().map(LocalVolume).collect()
    }
}

/// The size to hold volume `spec` at: its size, or (`at_least`: a consistency group's storage
/// volume, which grew as volumes joined the group) the size held here if that is larger.
fn requested_bytes(store: &Store, spec: &VolumeSpec) -> u64 {
    if !spec.at_least {
        return spec.size_bytes;
    }
    let held = store.volumes().into_iter().find(|(name, _)| name == &spec.name).map_or(0, |(_, bytes)| bytes);
    held.max(spec.size_bytes)
}
