//! The element core's storage trait over this store (implemented for `&Store`, so that the
//! committer thread and the blocking pool share one store).

use bytes::Bytes;
use proto::{BlockChunk, BlockExtent, BlockSummary, Epoch, Record, Sequence, VolumeSpec};
use starfish_core::{CommitDone, ElementStorage, LocalVolume, VolumeInfo};

use crate::{Store, VolumeHandle};

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
            copying: self.copy_state(handle).is_some(),
        }
    }
}

impl ElementStorage for &Store {
    fn epoch(&self) -> Epoch {
        Store::epoch(self)
    }

    fn adopt_epoch(&mut self, epoch: Epoch) -> Result<(), String> {
        self.set_epoch(epoch).map_err(|e| e.to_string())
    }

    fn ensure_volume(&mut self, spec: &VolumeSpec) -> Result<LocalVolume, String> {
        Store::ensure_volume(self, &spec.name, spec.size_bytes)
            .map(|h| LocalVolume(h.number()))
            .map_err(|e| e.to_string())
    }

    fn info(&self, volume: LocalVolume) -> VolumeInfo {
        self.volume_info(self.handle_of(volume))
    }

    fn commit(&mut self, batch: &[(LocalVolume, Record)]) -> Result<CommitDone, String> {
        let records: Vec<(VolumeHandle, Record)> =
            batch.iter().map(|(volume, record)| (self.handle_of(*volume), record.clone())).collect();
        let outcome = Store::commit(self, &records).map_err(|e| e.to_string())?;
        Ok(CommitDone {
            applied: outcome
                .applied
                .iter()
                .map(|&(h, sequence)| (LocalVolume(h.number()), sequence, self.applied_epoch(h)))
                .collect(),
            rejected: outcome.rejected.iter().map(|r| (r.index, r.error.to_string())).collect(),
        })
    }

    fn read(&self, volume: LocalVolume, offset_bytes: u64, length_bytes: u32) -> Result<(Sequence, Bytes), String> {
        Store::read(self, self.handle_of(volume), offset_bytes, length_bytes).map_err(|e| e.to_string())
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

    fn copy_chunk(&self, volume: LocalVolume, first_block: u64, have: &[BlockSummary]) -> Result<BlockChunk, String> {
        Store::copy_chunk(self, self.handle_of(volume), first_block, have).map_err(|e| e.to_string())
    }
}
