//! The per-block map of a volume — last-write sequence, content checksum, allocated or hole —
//! in memory, and its map file, written incrementally at checkpoints.
//!
//! The map file holds two slots per chunk of [`MAP_CHUNK_BLOCKS`] blocks. A checkpoint writes a
//! dirty chunk into the slot that does not hold its current image, stamped with the
//! checkpoint's generation, so a crash in the middle of a checkpoint leaves the previous image
//! intact. The metadata file, renamed last, names the committed generation and a digest of the
//! generation chosen for every chunk: loading picks per chunk the newest slot not newer than
//! the committed generation, and the digest proves nothing fell back to an older image.
//!
//! The committer marks the chunks each apply changes ([`DirtyChunks`]); a seal takes that set
//! for the checkpointer, which alone knows which slot holds each chunk's image
//! ([`ChunkImages`]) and encodes the images from the map as it is when it writes them.

use std::{
    fs::{File, OpenOptions},
    ops::Range,
    os::unix::fs::FileExt,
    path::Path,
    sync::OnceLock,
};

use proto::{Sequence, BLOCK_BYTES};

use crate::{error::io_error, StoreError, MAP_CHUNK_BLOCKS, SCAN_BUFFER_BYTES};

const MAP_MAGIC: [u8; 8] = *b"SFBLKMAP";
const MAP_VERSION: u32 = 1;
/// The map file header fills the first page; the header proper is its first 40 bytes.
const MAP_HEADER_BYTES: u64 = BLOCK_BYTES;
pub(crate) const SLOT_BYTES: u64 = BLOCK_BYTES;
pub(crate) const SLOT_HEADER_BYTES: u64 = 16;
pub(crate) const ENTRY_BYTES: u64 = 12;
/// Top bit of a persisted block sequence: the block is allocated in the data file.
const ALLOCATED_BIT: u64 = 1 << 63;

/// crc32c of a block of zeroes: the checksum of every hole.
pub fn zero_block_crc() -> u32 {
    static CRC: OnceLock<u32> = OnceLock::new();
    *CRC.get_or_init(|| proto::crc32c(&[0u8; BLOCK_BYTES as usize]))
}

/// The map of one volume, one entry per block, as a struct of arrays (12 bytes per block).
pub struct BlockMap {
    sequences: Vec<u64>,
    crcs: Vec<u32>,
    /// Bit set: block allocated in the data file (else a hole that reads as zeroes).
    allocated: Vec<u64>,
}

impl BlockMap {
    /// A map of `blocks` empty blocks; `Err` (never an abort) if the memory cannot be had.
    pub fn new(blocks: u64) -> Result<BlockMap, String> {
        let too_large = || format!("a block map of {blocks} blocks does not fit in memory");
        let blocks = usize::try_from(blocks).map_err(|_| too_large())?;
        fn zeroed<T: Clone + Default>(count: usize) -> Option<Vec<T>> {
            let mut v = Vec::new();
            v.try_reserve_exact(count).ok()?;
            v.resize(count, T::default());
            Some(v)
        }
        Ok(BlockMap {
            sequences: zeroed(blocks).ok_or_else(too_large)?,
            crcs: zeroed(blocks).ok_or_else(too_large)?,
            allocated: zeroed(blocks.div_ceil(64)).ok_or_else(too_large)?,
        })
    }

    /// Room for `blocks` blocks in all, so that [`BlockMap::grow`] to them cannot fail; `Err`
    /// (nothing changed but capacity) if the memory cannot be had.
    pub fn reserve(&mut self, blocks: u64) -> Result<(), String> {
        let too_large = || format!("a block map of {blocks} blocks does not fit in memory");
        let total = usize::try_from(blocks).map_err(|_| too_large())?;
        let more = total.saturating_sub(self.sequences.len());
        let more_words = total.div_ceil(64).saturating_sub(self.allocated.len());
        self.sequences.try_reserve_exact(more).map_err(|_| too_large())?;
        self.crcs.try_reserve_exact(more).map_err(|_| too_large())?;
        self.allocated.try_reserve_exact(more_words).map_err(|_| too_large())?;
        Ok(())
    }

    /// Grow to `blocks` blocks: the new ones are never-written holes (see
    /// [`BlockMap::reserve`] for a grow that must not fail).
    pub fn grow(&mut self, blocks: u64) {
        let total = blocks as usize;
        assert!(total >= self.sequences.len(), "block maps only grow");
        self.sequences.resize(total, 0);
        self.crcs.resize(total, 0);
        self.allocated.resize(total.div_ceil(64), 0);
    }

    pub fn blocks(&self) -> u64 {
        self.sequences.len() as u64
    }

    pub fn is_allocated(&self, block: u64) -> bool {
        self.allocated[(block / 64) as usize] & (1 << (block % 64)) != 0
    }

    /// Checksum of the block's content (of zeroes for a hole).
    pub fn crc(&self, block: u64) -> u32 {
        if self.is_allocated(block) {
            self.crcs[block as usize]
        } else {
            zero_block_crc()
        }
    }

    /// Sequence of the last operation that changed the block (for recovery planning).
    pub fn sequence(&self, block: u64) -> Sequence {
        Sequence(self.sequences[block as usize])
    }

    pub fn set_written(&mut self, block: u64, sequence: Sequence, crc: u32) {
        self.sequences[block as usize] = sequence.0;
        self.crcs[block as usize] = crc;
        self.allocated[(block / 64) as usize] |= 1 << (block % 64);
    }

    pub fn set_holes(&mut self, blocks: Range<u64>, sequence: Sequence) {
        if blocks.is_empty() {
            return;
        }
        let range = blocks.start as usize..blocks.end as usize;
        self.sequences[range.clone()].fill(sequence.0);
        self.crcs[range].fill(0);
        for (word, mask) in crate::word_masks(blocks) {
            self.allocated[word] &= !mask;
        }
    }

    /// End of the run of blocks from `start` (exclusive bound `end`) that share `start`'s
    /// allocation state.
    pub fn run_end(&self, start: u64, end: u64) -> u64 {
        debug_assert!(start < end && end <= self.blocks());
        let allocated = self.is_allocated(start);
        let mut block = start;
        while block < end {
            let word = self.allocated[(block / 64) as usize];
            let word = if allocated { !word } else { word }; // ones where the state differs
            let word = word >> (block % 64);
            if word != 0 {
                return (block + word.trailing_zeros() as u64).min(end);
            }
            block = (block / 64 + 1) * 64;
        }
        end
    }

    pub fn allocated_blocks(&self) -> u64 {
        self.allocated.iter().map(|w| w.count_ones() as u64).sum()
    }
}

/// Chunks changed since the last seal (owned by the committer: every apply marks them).
pub struct DirtyChunks {
    bits: Vec<u64>,
}

impl DirtyChunks {
    pub fn for_blocks(blocks: u64) -> DirtyChunks {
        DirtyChunks { bits: vec![0; (chunk_count(blocks) as usize).div_ceil(64)] }
    }

    /// Cover a volume grown to `blocks` blocks.
    pub fn grow(&mut self, blocks: u64) {
        let words = (chunk_count(blocks) as usize).div_ceil(64);
        if words > self.bits.len() {
            self.bits.resize(words, 0);
        }
    }

    pub fn mark_dirty(&mut self, blocks: Range<u64>) {
        if blocks.is_empty() {
            return;
        }
        for chunk in blocks.start / MAP_CHUNK_BLOCKS..=(blocks.end - 1) / MAP_CHUNK_BLOCKS {
            self.bits[(chunk / 64) as usize] |= 1 << (chunk % 64);
        }
    }

    pub fn is_dirty(&self) -> bool {
        self.bits.iter().any(|w| *w != 0)
    }

    /// The dirty chunks, ascending; none is dirty afterwards.
    pub fn take(&mut self) -> Vec<u64> {
        let mut chunks = Vec::new();
        for (i, word) in self.bits.iter_mut().enumerate() {
            let mut w = std::mem::take(word);
            while w != 0 {
                chunks.push(i as u64 * 64 + w.trailing_zeros() as u64);
                w &= w - 1;
            }
        }
        chunks
    }
}

/// Merge two ascending lists of chunks.
pub fn merge_chunks(a: Vec<u64>, b: Vec<u64>) -> Vec<u64> {
    if a.is_empty() {
        return b;
    }
    let mut merged = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        let next = match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x == y => {
                i += 1;
                j += 1;
                *x
            }
            (Some(x), Some(y)) if x < y => {
                i += 1;
                *x
            }
            (Some(x), None) => {
                i += 1;
                *x
            }
            (_, Some(y)) => {
                j += 1;
                *y
            }
            (None, None) => unreachable!("loop condition"),
        };
        merged.push(next);
    }
    merged
}

impl BlockMap {
    /// Encode the slot image of `chunk` at `generation` into `image` (one slot).
    pub fn encode_slot(&self, chunk: u64, generation: u64, image: &mut [u8]) {
        debug_assert_eq!(image.len() as u64, SLOT_BYTES);
        image.fill(0);
        image[0..8].copy_from_slice(&generation.to_le_bytes());
        image[12..16].copy_from_slice(&(chunk as u32).to_le_bytes());
        let first = chunk * MAP_CHUNK_BLOCKS;
        let last = (first + MAP_CHUNK_BLOCKS).min(self.blocks());
        let entries = &mut image[SLOT_HEADER_BYTES as usize..];
        for (block, entry) in (first..last).zip(entries.chunks_exact_mut(ENTRY_BYTES as usize)) {
            let allocated = (self.allocated[(block / 64) as usize] >> (block % 64)) & 1;
            let raw = self.sequences[block as usize] | (allocated << 63);
            entry[0..8].copy_from_slice(&raw.to_le_bytes());
            entry[8..12].copy_from_slice(&self.crcs[block as usize].to_le_bytes());
        }
        let crc = slot_crc(image);
        image[8..12].copy_from_slice(&crc.to_le_bytes());
    }

    /// The newest sequence of any block.
    pub fn sequence_max(&self) -> Sequence {
        Sequence(self.sequences.iter().copied().max().unwrap_or(0))
    }
}

/// Which map file slot holds each chunk's current image (owned by the checkpointer).
pub struct ChunkImages {
    /// Generation of the image each chunk was loaded from or last checkpointed to (0: never
    /// written, all its blocks are never-written holes).
    generations: Vec<u64>,
    /// Slot (0 or 1) holding that image.
    slots: Vec<u8>,
}

impl ChunkImages {
    /// A volume of `blocks` blocks that was never checkpointed.
    pub fn for_blocks(blocks: u64) -> ChunkImages {
        ChunkImages::new(chunk_count(blocks))
    }

    fn new(chunks: u64) -> ChunkImages {
        let chunks = chunks as usize;
        ChunkImages { generations: vec![0; chunks], slots: vec![0; chunks] }
    }

    /// Cover a volume grown to `blocks` blocks: its new chunks were never written.
    pub fn grow(&mut self, blocks: u64) {
        let chunks = chunk_count(blocks) as usize;
        if chunks > self.generations.len() {
            self.generations.resize(chunks, 0);
            self.slots.resize(chunks, 0);
        }
    }

    /// Digest recorded in the metadata: crc32c of every chunk's generation (u64 LE, in order).
    pub fn digest(&self) -> u32 {
        digest_of(&self.generations)
    }

    /// The chunk digest the metadata must record once `pending` is committed at `generation`.
    pub fn digest_after(&self, pending: &PendingSlots, generation: u64) -> u32 {
        if pending.writes.is_empty() {
            return self.digest();
        }
        let mut generations = self.generations.clone();
        for (chunk, _) in &pending.writes {
            generations[*chunk as usize] = generation;
        }
        digest_of(&generations)
    }

    /// The slot the next image of `chunk` goes to: not the one holding its current image.
    pub fn free_slot(&self, chunk: u64) -> u8 {
        if self.generations[chunk as usize] == 0 {
            0
        } else {
            1 - self.slots[chunk as usize]
        }
    }

    /// The checkpoint of `generation` is committed: its images are now the current ones.
    pub fn commit(&mut self, pending: &PendingSlots, generation: u64) {
        for (chunk, slot) in &pending.writes {
            self.generations[*chunk as usize] = generation;
            self.slots[*chunk as usize] = *slot;
        }
    }
}

/// The chunk digest of a volume that grew from `old_blocks` to `new_blocks`, given its digest
/// before: the new chunks were never written (generation 0), so the digest goes on over their
/// zeros.
pub fn grown_digest(digest: u32, old_blocks: u64, new_blocks: u64) -> u32 {
    let added = chunk_count(new_blocks) - chunk_count(old_blocks);
    let zeros = [0u8; 8 * 1024];
    let mut crc = digest;
    let mut left = added * 8;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        crc = crc32c::crc32c_append(crc, &zeros[..n]);
        left -= n as u64;
    }
    crc
}

fn digest_of(generations: &[u64]) -> u32 {
    let mut crc = 0;
    for generations in generations.chunks(1024) {
        let bytes: Vec<u8> = generations.iter().flat_map(|g| g.to_le_bytes()).collect();
        crc = crc32c::crc32c_append(crc, &bytes);
    }
    crc
}

/// Slot images written for a checkpoint, not yet committed.
#[derive(Default)]
pub struct PendingSlots {
    pub writes: Vec<(u64, u8)>, // (chunk, slot)
}

/// The open map file of one volume.
pub struct MapFile {
    file: File,
    path: std::path::PathBuf,
    volume: String,
}

fn chunk_count(blocks: u64) -> u64 {
    blocks.div_ceil(MAP_CHUNK_BLOCKS)
}

fn slot_offset(chunk: u64, slot: u8) -> u64 {
    MAP_HEADER_BYTES + (2 * chunk + slot as u64) * SLOT_BYTES
}

fn slot_crc(slot: &[u8]) -> u32 {
    crc32c::crc32c_append(proto::crc32c(&slot[0..8]), &slot[12..])
}

fn header_bytes(volume_number: u32, size_bytes: u64) -> Vec<u8> {
    let mut header = vec![0u8; MAP_HEADER_BYTES as usize];
    header[0..8].copy_from_slice(&MAP_MAGIC);
    header[8..12].copy_from_slice(&MAP_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&volume_number.to_le_bytes());
    header[16..24].copy_from_slice(&size_bytes.to_le_bytes());
    header[24..32].copy_from_slice(&(size_bytes / BLOCK_BYTES).to_le_bytes());
    header[32..36].copy_from_slice(&(MAP_CHUNK_BLOCKS as u32).to_le_bytes());
    let crc = proto::crc32c(&header[0..36]);
    header[36..40].copy_from_slice(&crc.to_le_bytes());
    header
}

impl MapFile {
    /// Create (or truncate) the map file of a new volume: a header and a sparse slot area.
    pub fn create(path: &Path, volume: &str, volume_number: u32, size_bytes: u64) -> Result<MapFile, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io_error("create block map", path))?;
        let blocks = size_bytes / BLOCK_BYTES;
        file.write_all_at(&header_bytes(volume_number, size_bytes), 0)
            .map_err(io_error("write block map header", path))?;
        file.set_len(slot_offset(chunk_count(blocks), 0)).map_err(io_error("size block map", path))?;
        file.sync_all().map_err(io_error("sync block map", path))?;
        Ok(MapFile { file, path: path.to_path_buf(), volume: volume.to_string() })
    }

    /// Grow the file to describe a volume of `size_bytes`: the slot area first (new chunks are
    /// sparse, never written), synced, then the header, synced. The metadata, written before,
    /// is the grow's commit point; a crash before the header is finished by
    /// [`MapFile::finish_grow`] when the store opens.
    pub fn grow(&self, volume_number: u32, size_bytes: u64) -> Result<(), StoreError> {
        let path = &self.path;
        let end = slot_offset(chunk_count(size_bytes / BLOCK_BYTES), 0);
        let length = self.file.metadata().map_err(io_error("stat block map", path))?.len();
        if length < end {
            self.file.set_len(end).map_err(io_error("size block map", path))?;
        }
        self.file.sync_all().map_err(io_error("sync block map", path))?;
        self.file
            .write_all_at(&header_bytes(volume_number, size_bytes), 0)
            .map_err(io_error("write block map header", path))?;
        self.file.sync_data().map_err(io_error("sync block map", path))
    }

    /// A store opening finds volume `volume_number` of `size_bytes` in its metadata: if the map
    /// file's header describes it smaller (a grow a crash interrupted after its commit point),
    /// the file is grown now and the smaller size returned (the data file may still have it).
    /// Any other header is left for [`MapFile::load`] to judge.
    pub fn finish_grow(
        path: &Path,
        volume: &str,
        volume_number: u32,
        size_bytes: u64,
    ) -> Result<Option<u64>, StoreError> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_error("open block map", path))?;
        let mut header = vec![0u8; MAP_HEADER_BYTES as usize];
        if file.read_exact_at(&mut header, 0).is_err() {
            return Ok(None);
        }
        let old_bytes = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        if old_bytes >= size_bytes || header != header_bytes(volume_number, old_bytes) {
            return Ok(None);
        }
        tracing::info!(volume, old_bytes, size_bytes, "finishing a volume's grow that a crash interrupted");
        let map_file = MapFile { file, path: path.to_path_buf(), volume: volume.to_string() };
        map_file.grow(volume_number, size_bytes)?;
        Ok(Some(old_bytes))
    }

    fn corrupt(&self, reason: String) -> StoreError {
        StoreError::CorruptBlockMap { path: self.path.clone(), volume: self.volume.clone(), reason }
    }

    /// Open and load a map file as of checkpoint `generation`, whose chunk digest was
    /// `digest`. Slot images newer than the
    /// committed generation (from a checkpoint that crashed before its commit) are erased, so
    /// a later generation number can never revive them.
    pub fn load(
        path: &Path,
        volume: &str,
        volume_number: u32,
        size_bytes: u64,
        generation: u64,
        digest: u32,
    ) -> Result<(MapFile, BlockMap, ChunkImages), StoreError> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_error("open block map", path))?;
        let map_file = MapFile { file, path: path.to_path_buf(), volume: volume.to_string() };
        let mut header = vec![0u8; MAP_HEADER_BYTES as usize];
        map_file
            .file
            .read_exact_at(&mut header, 0)
            .map_err(|e| map_file.corrupt(format!("cannot read the header: {e}")))?;
        if header != header_bytes(volume_number, size_bytes) {
            return Err(map_file.corrupt(format!(
                "header does not describe volume number {volume_number} of {size_bytes} bytes \
                 with {MAP_CHUNK_BLOCKS} blocks per chunk"
            )));
        }
        let blocks = size_bytes / BLOCK_BYTES;
        let chunk_total = chunk_count(blocks);
        let mut map = BlockMap::new(blocks).map_err(|reason| StoreError::Failed { reason })?;
        let mut chunks = ChunkImages::new(chunk_total);
        let mut stale_slots = Vec::new();
        let pairs_per_read = SCAN_BUFFER_BYTES / (2 * SLOT_BYTES);
        let mut buffer = vec![0u8; (pairs_per_read * 2 * SLOT_BYTES) as usize];
        let mut chunk = 0;
        while chunk < chunk_total {
            let pairs = pairs_per_read.min(chunk_total - chunk);
            let bytes = &mut buffer[..(pairs * 2 * SLOT_BYTES) as usize];
            map_file
                .file
                .read_exact_at(bytes, slot_offset(chunk, 0))
                .map_err(|e| map_file.corrupt(format!("cannot read chunk {chunk}: {e}")))?;
            for pair in bytes.chunks_exact((2 * SLOT_BYTES) as usize) {
                let mut chosen: Option<(u64, u8)> = None;
                for slot in 0..2u8 {
                    let image = &pair[(slot as u64 * SLOT_BYTES) as usize..][..SLOT_BYTES as usize];
                    let slot_generation = u64::from_le_bytes(image[0..8].try_into().expect("8"));
                    let crc = u32::from_le_bytes(image[8..12].try_into().expect("4"));
                    let slot_chunk = u32::from_le_bytes(image[12..16].try_into().expect("4"));
                    let valid = slot_generation != 0 && slot_chunk as u64 == chunk && crc == slot_crc(image);
                    if !valid {
                        continue;
                    }
                    if slot_generation > generation {
                        stale_slots.push((chunk, slot));
                    } else if chosen.map_or(true, |(g, _)| slot_generation > g) {
                        chosen = Some((slot_generation, slot));
                    }
                }
                if let Some((slot_generation, slot)) = chosen {
                    chunks.generations[chunk as usize] = slot_generation;
                    chunks.slots[chunk as usize] = slot;
                    let image = &pair[(slot as u64 * SLOT_BYTES) as usize..][..SLOT_BYTES as usize];
                    map_file.decode_slot(image, chunk, &mut map)?;
                }
                chunk += 1;
            }
        }
        if chunks.digest() != digest {
            return Err(map_file.corrupt(format!(
                "the chunk images found (digest {:#010x}) are not those of checkpoint {generation} \
                 (digest {digest:#010x}): a committed chunk image is damaged",
                chunks.digest()
            )));
        }
        for (chunk, slot) in &stale_slots {
            tracing::info!(path = %path.display(), chunk, slot, "erasing an uncommitted block map image");
            map_file
                .file
                .write_all_at(&[0u8; SLOT_BYTES as usize], slot_offset(*chunk, *slot))
                .map_err(io_error("erase block map slot", path))?;
        }
        if !stale_slots.is_empty() {
            map_file.file.sync_data().map_err(io_error("sync block map", path))?;
        }
        Ok((map_file, map, chunks))
    }

    fn decode_slot(&self, image: &[u8], chunk: u64, map: &mut BlockMap) -> Result<(), StoreError> {
        let first = chunk * MAP_CHUNK_BLOCKS;
        for (i, entry) in image[SLOT_HEADER_BYTES as usize..].chunks_exact(ENTRY_BYTES as usize).enumerate() {
            let block = first + i as u64;
            let raw = u64::from_le_bytes(entry[0..8].try_into().expect("8"));
            let crc = u32::from_le_bytes(entry[8..12].try_into().expect("4"));
            if block >= map.blocks() {
                if raw != 0 || crc != 0 {
                    return Err(self.corrupt(format!("chunk {chunk} describes block {block} past the end")));
                }
                continue;
            }
            // A checkpoint writes images of the map as it is when it writes them, so an entry
            // may come from a record after its applied sequence: one in the log that replay
            // applies again (checked once the log is replayed).
            let sequence = Sequence(raw & !ALLOCATED_BIT);
            if raw & ALLOCATED_BIT != 0 {
                map.set_written(block, sequence, crc);
            } else {
                map.sequences[block as usize] = sequence.0;
            }
        }
        Ok(())
    }

    /// Write one slot image (not synced: see [`MapFile::sync`]).
    pub fn write_slot(&self, chunk: u64, slot: u8, image: &[u8]) -> Result<(), StoreError> {
        self.file.write_all_at(image, slot_offset(chunk, slot)).map_err(io_error("write block map", &self.path))
    }

    pub fn sync(&self) -> Result<(), StoreError> {
        self.file.sync_data().map_err(io_error("sync block map", &self.path))
    }

    /// Free the file's space (its volume is being removed).
    pub fn truncate(&self) -> Result<(), StoreError> {
        self.file.set_len(0).map_err(io_error("empty block map", &self.path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_chunks_are_taken_once_and_merged() {
        let mut dirty = DirtyChunks::for_blocks(200 * MAP_CHUNK_BLOCKS);
        assert!(!dirty.is_dirty());
        // (blocks marked) -> chunks
        for (blocks, chunks) in [
            (0..1, vec![0]),
            (MAP_CHUNK_BLOCKS - 1..MAP_CHUNK_BLOCKS + 1, vec![0, 1]),
            (64 * MAP_CHUNK_BLOCKS..64 * MAP_CHUNK_BLOCKS + 1, vec![64]),
            (5..5, vec![]),
        ] {
            dirty.mark_dirty(blocks.clone());
            assert_eq!(dirty.take(), chunks, "{blocks:?}");
            assert!(!dirty.is_dirty());
        }
        dirty.mark_dirty(130 * MAP_CHUNK_BLOCKS..133 * MAP_CHUNK_BLOCKS);
        assert_eq!(dirty.take(), vec![130, 131, 132]);
        // (a, b) -> union
        let check = |a: Vec<u64>, b: Vec<u64>, union: Vec<u64>| {
            assert_eq!(merge_chunks(a.clone(), b.clone()), union, "{a:?} + {b:?}");
        };
        check(vec![], vec![1, 2], vec![1, 2]);
        check(vec![1, 2], vec![], vec![1, 2]);
        check(vec![1, 3, 5], vec![2, 3, 9], vec![1, 2, 3, 5, 9]);
        check(vec![7], vec![7], vec![7]);
    }

    #[test]
    fn slot_images_round_trip() {
        let mut map = BlockMap::new(MAP_CHUNK_BLOCKS + 10).unwrap();
        map.set_written(3, Sequence(5), 0xabcd);
        map.set_written(MAP_CHUNK_BLOCKS + 2, Sequence(6), 7);
        map.set_holes(MAP_CHUNK_BLOCKS + 3..MAP_CHUNK_BLOCKS + 5, Sequence(8));
        let mut image = vec![0u8; SLOT_BYTES as usize];
        let mut loaded = BlockMap::new(MAP_CHUNK_BLOCKS + 10).unwrap();
        for chunk in 0..2 {
            map.encode_slot(chunk, 9, &mut image);
            assert_eq!(u64::from_le_bytes(image[0..8].try_into().expect("8")), 9);
            assert_eq!(u32::from_le_bytes(image[8..12].try_into().expect("4")), slot_crc(&image));
            let file = MapFile { file: tempfile_like(), path: "map".into(), volume: "v".into() };
            file.decode_slot(&image, chunk, &mut loaded).expect("decodes");
        }
        for block in 0..map.blocks() {
            assert_eq!(
                (loaded.is_allocated(block), loaded.crc(block), loaded.sequence(block)),
                (map.is_allocated(block), map.crc(block), map.sequence(block)),
                "block {block}"
            );
        }
        assert_eq!(map.sequence_max(), Sequence(8));
    }

    fn tempfile_like() -> File {
        File::open("/dev/null").expect("open /dev/null")
    }

    #[test]
    fn holes_and_runs() {
        let mut map = BlockMap::new(300).unwrap();
        for block in [3, 4, 5, 64, 65, 200] {
            map.set_written(block, Sequence(1), 7);
        }
        // (start, end) -> run end
        let check = |map: &BlockMap, start: u64, end: u64, expected: u64| {
            assert_eq!(map.run_end(start, end), expected, "run from {start} to {end}");
        };
        check(&map, 0, 300, 3);
        check(&map, 3, 300, 6);
        check(&map, 6, 300, 64);
        check(&map, 64, 300, 66);
        check(&map, 66, 300, 200);
        check(&map, 201, 300, 300);
        check(&map, 0, 2, 2);
        map.set_holes(4..65, Sequence(2));
        assert!(map.is_allocated(3) && !map.is_allocated(4) && !map.is_allocated(64));
        assert!(map.is_allocated(65));
        assert_eq!(map.sequence(64), Sequence(2));
        assert_eq!(map.allocated_blocks(), 3);
        map.set_holes(0..300, Sequence(3));
        assert_eq!(map.allocated_blocks(), 0);
        assert_eq!(map.crc(5), zero_block_crc());
    }
}
