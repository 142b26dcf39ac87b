//! The host element's read cache: LRU over 4 KiB blocks, write-through. It always holds the
//! newest content of a block (including writes still in flight), so a hit is linearizable.

use std::collections::BTreeMap;

use bytes::Bytes;
use proto::{Op, VolumeId, BLOCK_BYTES};

type Key = (VolumeId, u64);

/// Writes and reads of at least this many bytes pass the cache by (a write takes its blocks out
/// of it): large, mostly sequential transfers would each copy hundreds of blocks into it only
/// to evict the small, hot ones (at 1 MiB writes the cache's own code took 6 % of the host
/// element's samples, its blocks' allocations and copies some of the rest; docs/benchmarks.md).
pub const READ_CACHE_BYPASS_BYTES: u64 = 128 * 1024;

#[derive(Debug)]
pub struct ReadCache {
    capacity_blocks: usize,
    blocks: BTreeMap<Key, (Bytes, u64)>,
    by_age: BTreeMap<u64, Key>,
    clock: u64,
    pub hits: u64,
    pub misses: u64,
}

impl ReadCache {
    pub fn new(capacity_bytes: u64) -> ReadCache {
        ReadCache {
            capacity_blocks: (capacity_bytes / BLOCK_BYTES) as usize,
            blocks: BTreeMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
            hits: 0,
            misses: 0,
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.blocks.len() as u64 * BLOCK_BYTES
    }

    fn touch(&mut self, key: Key) {
        if let Some((_, age)) = self.blocks.get_mut(&key) {
            self.by_age.remove(age);
            self.clock += 1;
            *age = self.clock;
            self.by_age.insert(self.clock, key);
        }
    }

    fn insert(&mut self, key: Key, block: Bytes) {
        debug_assert_eq!(block.len() as u64, BLOCK_BYTES);
        if self.capacity_blocks == 0 {
            return;
        }
        self.clock += 1;
        if let Some((_, old_age)) = self.blocks.insert(key, (block, self.clock)) {
            self.by_age.remove(&old_age);
        }
        self.by_age.insert(self.clock, key);
        while self.blocks.len() > self.capacity_blocks {
            let (_, oldest) = self.by_age.pop_first().expect("non-empty when over capacity");
            self.blocks.remove(&oldest);
        }
    }

    /// Forget the blocks `[first_block, end_block)` of `volume` (a scrub found that the replicas
    /// differ there: what the cache holds may be the minority's).
    pub fn remove_range(&mut self, volume: VolumeId, first_block: u64, end_block: u64) {
        let keys: Vec<Key> = self.blocks.range((volume, first_block)..(volume, end_block)).map(|(k, _)| *k).collect();
        for key in keys {
            if let Some((_, age)) = self.blocks.remove(&key) {
                self.by_age.remove(&age);
            }
        }
    }

    /// The whole range, if every block of it is cached.
    pub fn get(&mut self, volume: VolumeId, offset_bytes: u64, length_bytes: u64) -> Option<Bytes> {
        if self.capacity_blocks == 0 || length_bytes == 0 {
            return None;
        }
        let first = offset_bytes / BLOCK_BYTES;
        let end = (offset_bytes + length_bytes).div_ceil(BLOCK_BYTES);
        if (end - first) as usize > self.blocks.len() || (first..end).any(|b| !self.blocks.contains_key(&(volume, b))) {
            self.misses += 1;
            return None;
        }
        self.hits += 1;
        if end - first == 1 {
            self.touch((volume, first));
            let start = (offset_bytes - first * BLOCK_BYTES) as usize;
            let block = &self.blocks[&(volume, first)].0;
            return Some(block.slice(start..start + length_bytes as usize));
        }
        let mut out = Vec::with_capacity(length_bytes as usize);
        for b in first..end {
            self.touch((volume, b));
            let block = &self.blocks[&(volume, b)].0;
            let block_start = b * BLOCK_BYTES;
            let from = offset_bytes.max(block_start) - block_start;
            let to = (offset_bytes + length_bytes).min(block_start + BLOCK_BYTES) - block_start;
            out.extend_from_slice(&block[from as usize..to as usize]);
        }
        Some(Bytes::from(out))
    }

    /// Record the current content of a range read from an element (after overlaying the write
    /// queue). Only whole blocks are kept.
    pub fn fill(&mut self, volume: VolumeId, offset_bytes: u64, data: &Bytes) {
        if self.capacity_blocks == 0 || data.len() as u64 >= READ_CACHE_BYPASS_BYTES {
            return;
        }
        let end_bytes = offset_bytes + data.len() as u64;
        let first = offset_bytes.div_ceil(BLOCK_BYTES);
        let end = end_bytes / BLOCK_BYTES;
        for b in first..end.max(first) {
            let start = (b * BLOCK_BYTES - offset_bytes) as usize;
            // Copy so a cached block never pins a large read buffer.
            let block = Bytes::copy_from_slice(&data[start..start + BLOCK_BYTES as usize]);
            self.insert((volume, b), block);
        }
    }

    /// Write-through: apply a write-like operation to the cached blocks it touches. Whole blocks
    /// of a write are cached; partial blocks are patched if present.
    pub fn apply(&mut self, volume: VolumeId, op: &Op) {
        if self.capacity_blocks == 0 {
            return;
        }
        let offset_bytes = op.offset_bytes();
        let end_bytes = offset_bytes + op.length_bytes();
        let first = offset_bytes / BLOCK_BYTES;
        let end = end_bytes.div_ceil(BLOCK_BYTES);
        match op {
            Op::Trim { .. } | Op::WriteZeroes { .. } => self.remove_range(volume, first, end),
            Op::Snapshot { .. } | Op::SnapshotDelete { .. } => {}
            Op::Write { data, .. } if data.len() as u64 >= READ_CACHE_BYPASS_BYTES => {
                self.remove_range(volume, first, end)
            }
            Op::Write { data, .. } => {
                for b in first..end {
                    let block_start = b * BLOCK_BYTES;
                    let from = offset_bytes.max(block_start);
                    let to = end_bytes.min(block_start + BLOCK_BYTES);
                    let src = &data[(from - offset_bytes) as usize..(to - offset_bytes) as usize];
                    if to - from == BLOCK_BYTES {
                        self.insert((volume, b), Bytes::copy_from_slice(src));
                    } else if let Some((block, _)) = self.blocks.get(&(volume, b)) {
                        let mut patched = block.to_vec();
                        let at = (from - block_start) as usize;
                        patched[at..at + src.len()].copy_from_slice(src);
                        self.insert((volume, b), Bytes::from(patched));
                    }
                }
            }
        }
    }

    pub fn assert_invariants(&self) {
        assert_eq!(self.blocks.len(), self.by_age.len());
        assert!(self.blocks.len() <= self.capacity_blocks);
        for (age, key) in &self.by_age {
            assert_eq!(self.blocks[key].1, *age);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: VolumeId = VolumeId(0);

    fn write(offset_bytes: u64, fill: u8, len: usize) -> Op {
        Op::write(offset_bytes, Bytes::from(vec![fill; len]))
    }

    #[test]
    fn write_through_then_hit() {
        let mut c = ReadCache::new(4 * BLOCK_BYTES);
        c.apply(V, &write(0, 1, 8192));
        assert_eq!(c.get(V, 512, 4096).as_deref(), Some(&[1u8; 4096][..]));
        // A partial write patches a cached block and leaves uncached ones alone.
        c.apply(V, &write(4096 + 512, 2, 512));
        let block = c.get(V, 4096, 4096).expect("cached");
        assert_eq!(block[512..1024], [2u8; 512]);
        assert_eq!(block[..512], [1u8; 512]);
        c.apply(V, &write(5 * 4096, 3, 512));
        assert!(c.get(V, 5 * 4096, 512).is_none(), "partial write of an uncached block");
        c.apply(V, &Op::Trim { offset_bytes: 0, length_bytes: 4096 });
        assert!(c.get(V, 0, 512).is_none());
        c.assert_invariants();
    }

    #[test]
    fn lru_evicts_oldest() {
        let mut c = ReadCache::new(2 * BLOCK_BYTES);
        c.apply(V, &write(0, 1, 4096));
        c.apply(V, &write(4096, 2, 4096));
        assert!(c.get(V, 0, 4096).is_some()); // block 0 is now the newest
        c.apply(V, &write(8192, 3, 4096));
        assert!(c.get(V, 4096, 4096).is_none(), "block 1 was the least recently used");
        assert!(c.get(V, 0, 4096).is_some());
        c.assert_invariants();
    }

    #[test]
    fn large_writes_and_reads_pass_the_cache_by_and_a_large_write_takes_its_blocks_out() {
        let big = READ_CACHE_BYPASS_BYTES as usize;
        let mut c = ReadCache::new(1 << 20);
        c.apply(V, &write(0, 1, 4096));
        c.apply(V, &write(big as u64, 2, 4096));
        c.apply(V, &write(0, 3, big));
        assert!(c.get(V, 0, 4096).is_none(), "the old content of a block a large write covers is gone");
        assert!(c.get(V, 4096, 4096).is_none(), "nor is the large write's data cached");
        assert_eq!(c.get(V, big as u64, 4096).as_deref(), Some(&[2u8; 4096][..]), "beyond it, kept");
        c.fill(V, 0, &Bytes::from(vec![3u8; big]));
        assert_eq!(c.used_bytes(), BLOCK_BYTES, "a large read is not cached");
        c.fill(V, 0, &Bytes::from(vec![3u8; big - 4096]));
        let filled = (big as u64 - 4096) / BLOCK_BYTES;
        assert_eq!(c.used_bytes(), BLOCK_BYTES * (filled + 1), "a smaller one is (and the block beyond)");
        c.assert_invariants();
    }

    #[test]
    fn fill_keeps_only_whole_blocks() {
        let mut c = ReadCache::new(16 * BLOCK_BYTES);
        c.fill(V, 512, &Bytes::from(vec![7u8; 3 * 4096]));
        assert!(c.get(V, 0, 512).is_none());
        assert_eq!(c.get(V, 4096, 8192).as_deref(), Some(&[7u8; 8192][..]));
        assert_eq!(c.used_bytes(), 2 * BLOCK_BYTES);
        let mut off = ReadCache::new(0);
        off.apply(V, &write(0, 1, 4096));
        assert!(off.get(V, 0, 4096).is_none());
    }
}
