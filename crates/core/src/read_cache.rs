//! The host element's read cache: LRU over 4 KiB blocks, write-through. It always holds the
//! newest content of a block (including writes still in flight), so a hit is linearizable.
//! A block that a read missed is cached only if a read missed it once before recently (the
//! [`Doorkeeper`]): reads spread over more than the cache holds would otherwise copy every
//! block they miss into it, evicting blocks that will be read again, for hits they rarely get.

use std::collections::HashMap;

use bytes::Bytes;
use proto::{Op, VolumeId, BLOCK_BYTES};

type Key = (VolumeId, u64);

/// Writes and reads of at least this many bytes pass the cache by (a write takes its blocks out
/// of it): large, mostly sequential transfers would each copy hundreds of blocks into it only
/// to evict the small, hot ones (at 1 MiB writes the cache's own code took 6 % of the host
/// element's samples, its blocks' allocations and copies some of the rest; docs/benchmarks.md).
pub const READ_CACHE_BYPASS_BYTES: u64 = 128 * 1024;

/// No slot: the end of the recency list.
const NIL: u32 = u32::MAX;

/// One cached block, linked into the recency list by slot numbers.
#[derive(Debug)]
struct Slot {
    key: Key,
    block: Bytes,
    /// The next more recently used slot, or `NIL`.
    newer: u32,
    /// The next less recently used slot, or `NIL`.
    older: u32,
}

/// Every operation is O(1) per block: a hash index from block to slot, and the slots linked
/// from the most to the least recently used (two B-trees before: about 8 % of the host element's
/// samples at random 4 KiB reads; docs/benchmarks.md).
#[derive(Debug)]
pub struct ReadCache {
    capacity_blocks: usize,
    index: HashMap<Key, u32, foldhash::fast::FixedState>,
    slots: Vec<Slot>,
    /// Slots emptied by a removal, to be used again before the list grows.
    free: Vec<u32>,
    newest: u32,
    oldest: u32,
    /// Which blocks read and missed may be cached.
    doorkeeper: Doorkeeper,
    pub hits: u64,
    pub misses: u64,
    /// Blocks a read missed that the doorkeeper did not let in (seen once).
    pub declined: u64,
}

/// Admission of blocks read into the cache, as TinyLFU's doorkeeper (Einziger, Friedman and
/// Manes, 2017): one bit per hash of a block; a block missed whose bit is set was (most likely)
/// missed since the last clearing, and is cached; otherwise its bit is set. The bits are cleared
/// once twice as many blocks were seen as the cache holds, so "recently" is two caches' worth of
/// missed blocks (a hot set up to twice the cache's size gets in on its second pass). A set bit
/// of another block (a collision) admits a block early; eight bits per cached block keep that
/// to at most a quarter of the blocks seen once.
#[derive(Debug)]
struct Doorkeeper {
    bits: Vec<u64>,
    /// Blocks whose bit this clearing set.
    seen: usize,
    /// Clear after this many.
    seen_max: usize,
}

impl Doorkeeper {
    fn new(capacity_blocks: usize) -> Doorkeeper {
        let seen_max = capacity_blocks.saturating_mul(2).max(1);
        let bit_count = seen_max.saturating_mul(4).next_power_of_two().max(64);
        Doorkeeper { bits: vec![0; bit_count / 64], seen: 0, seen_max }
    }

    /// Whether `key`, just missed by a read, is to be cached.
    fn admit(&mut self, key: Key) -> bool {
        use std::hash::BuildHasher;
        let hash = foldhash::fast::FixedState::default().hash_one(key);
        let bit = (hash as usize) & (self.bits.len() * 64 - 1);
        let (word, mask) = (bit / 64, 1u64 << (bit % 64));
        if self.bits[word] & mask != 0 {
            return true;
        }
        self.bits[word] |= mask;
        self.seen += 1;
        if self.seen >= self.seen_max {
            self.bits.fill(0);
            self.seen = 0;
        }
        false
    }
}

impl ReadCache {
    pub fn new(capacity_bytes: u64) -> ReadCache {
        // Slot numbers are u32 with one value for "none": 16 TiB of cache at most.
        let capacity_blocks = (capacity_bytes / BLOCK_BYTES).min(u64::from(NIL - 1)) as usize;
        ReadCache {
            capacity_blocks,
            index: HashMap::with_hasher(foldhash::fast::FixedState::default()),
            slots: Vec::new(),
            free: Vec::new(),
            newest: NIL,
            oldest: NIL,
            doorkeeper: Doorkeeper::new(capacity_blocks),
            hits: 0,
            misses: 0,
            declined: 0,
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.index.len() as u64 * BLOCK_BYTES
    }

    /// Take slot `i` out of the recency list.
    fn unlink(&mut self, i: u32) {
        let Slot { newer, older, .. } = self.slots[i as usize];
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
    }

    /// Put slot `i` (not in the list) at its most recently used end.
    fn link_newest(&mut self, i: u32) {
        let slot = &mut self.slots[i as usize];
        slot.newer = NIL;
        slot.older = self.newest;
        match self.newest {
            NIL => self.oldest = i,
            n => self.slots[n as usize].newer = i,
        }
        self.newest = i;
    }

    /// Make slot `i` (in the list) the most recently used.
    fn touch(&mut self, i: u32) {
        if self.newest != i {
            self.unlink(i);
            self.link_newest(i);
        }
    }

    fn insert(&mut self, key: Key, block: Bytes) {
        debug_assert_eq!(block.len() as u64, BLOCK_BYTES);
        if self.capacity_blocks == 0 {
            return;
        }
        if let Some(&i) = self.index.get(&key) {
            self.slots[i as usize].block = block;
            self.touch(i);
            return;
        }
        let i = if self.index.len() >= self.capacity_blocks {
            // Full: the least recently used block's slot takes the new one.
            let oldest = self.oldest;
            self.unlink(oldest);
            let slot = &mut self.slots[oldest as usize];
            self.index.remove(&slot.key);
            slot.key = key;
            slot.block = block;
            oldest
        } else if let Some(i) = self.free.pop() {
            let slot = &mut self.slots[i as usize];
            slot.key = key;
            slot.block = block;
            i
        } else {
            self.slots.push(Slot { key, block, newer: NIL, older: NIL });
            (self.slots.len() - 1) as u32
        };
        self.index.insert(key, i);
        self.link_newest(i);
    }

    fn remove(&mut self, key: Key) {
        if let Some(i) = self.index.remove(&key) {
            self.unlink(i);
            self.slots[i as usize].block = Bytes::new();
            self.free.push(i);
        }
    }

    /// Forget the blocks `[first_block, end_block)` of `volume` (a scrub found that the replicas
    /// differ there: what the cache holds may be the minority's).
    pub fn remove_range(&mut self, volume: VolumeId, first_block: u64, end_block: u64) {
        if end_block.saturating_sub(first_block) <= self.index.len() as u64 {
            for block in first_block..end_block {
                self.remove((volume, block));
            }
            return;
        }
        // A range wider than what is cached (a whole volume trimmed): look at the cached blocks.
        let keys: Vec<Key> = self
            .index
            .keys()
            .filter(|(v, block)| *v == volume && (first_block..end_block).contains(block))
            .copied()
            .collect();
        for key in keys {
            self.remove(key);
        }
    }

    /// The whole range, if every block of it is cached.
    pub fn get(&mut self, volume: VolumeId, offset_bytes: u64, length_bytes: u64) -> Option<Bytes> {
        if self.capacity_blocks == 0 || length_bytes == 0 {
            return None;
        }
        let first = offset_bytes / BLOCK_BYTES;
        let end = (offset_bytes + length_bytes).div_ceil(BLOCK_BYTES);
        if end - first == 1 {
            // One block (most reads): one lookup of the index, not three (`get` and `touch`
            // took about 6 % of the host element's samples at cached random 4 KiB reads;
            // docs/benchmarks.md).
            let Some(&i) = self.index.get(&(volume, first)) else {
                self.misses += 1;
                return None;
            };
            self.hits += 1;
            self.touch(i);
            let start = (offset_bytes - first * BLOCK_BYTES) as usize;
            return Some(self.slots[i as usize].block.slice(start..start + length_bytes as usize));
        }
        let slots: Option<Vec<u32>> = if (end - first) as usize > self.index.len() {
            None
        } else {
            (first..end).map(|b| self.index.get(&(volume, b)).copied()).collect()
        };
        let Some(slots) = slots else {
            self.misses += 1;
            return None;
        };
        self.hits += 1;
        let mut out = Vec::with_capacity(length_bytes as usize);
        for (b, i) in (first..end).zip(slots) {
            self.touch(i);
            let block = &self.slots[i as usize].block;
            let block_start = b * BLOCK_BYTES;
            let from = offset_bytes.max(block_start) - block_start;
            let to = (offset_bytes + length_bytes).min(block_start + BLOCK_BYTES) - block_start;
            out.extend_from_slice(&block[from as usize..to as usize]);
        }
        Some(Bytes::from(out))
    }

    /// Record the current content of a range read from an element (after overlaying the write
    /// queue). Only whole blocks are kept: those cached already, and those the doorkeeper admits.
    pub fn fill(&mut self, volume: VolumeId, offset_bytes: u64, data: &Bytes) {
        if self.capacity_blocks == 0 || data.len() as u64 >= READ_CACHE_BYPASS_BYTES {
            return;
        }
        let end_bytes = offset_bytes + data.len() as u64;
        let first = offset_bytes.div_ceil(BLOCK_BYTES);
        let end = end_bytes / BLOCK_BYTES;
        for b in first..end.max(first) {
            if !self.index.contains_key(&(volume, b)) && !self.doorkeeper.admit((volume, b)) {
                self.declined += 1;
                continue;
            }
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
            Op::Snapshot { .. } | Op::SnapshotDelete { .. } | Op::Begin => {}
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
                    } else if let Some(&i) = self.index.get(&(volume, b)) {
                        let mut patched = self.slots[i as usize].block.to_vec();
                        let at = (from - block_start) as usize;
                        patched[at..at + src.len()].copy_from_slice(src);
                        self.insert((volume, b), Bytes::from(patched));
                    }
                }
            }
        }
    }

    pub fn assert_invariants(&self) {
        assert!(self.index.len() <= self.capacity_blocks);
        assert_eq!(self.index.len() + self.free.len(), self.slots.len(), "every slot is listed or free");
        let mut listed = 0;
        let mut newer = NIL;
        let mut i = self.newest;
        while i != NIL {
            let slot = &self.slots[i as usize];
            assert_eq!(slot.newer, newer, "the list links both ways");
            assert_eq!(self.index.get(&slot.key), Some(&i), "a listed slot is indexed");
            assert_eq!(slot.block.len() as u64, BLOCK_BYTES);
            listed += 1;
            assert!(listed <= self.index.len(), "the list has no cycle");
            newer = i;
            i = slot.older;
        }
        assert_eq!(self.oldest, newer);
        assert_eq!(listed, self.index.len());
        for &f in &self.free {
            assert!(self.slots[f as usize].block.is_empty(), "a free slot holds no block");
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
        // Read twice: a block read that missed is cached the second time (the doorkeeper).
        c.fill(V, 0, &Bytes::from(vec![3u8; big - 4096]));
        c.fill(V, 0, &Bytes::from(vec![3u8; big - 4096]));
        let filled = (big as u64 - 4096) / BLOCK_BYTES;
        assert_eq!(c.used_bytes(), BLOCK_BYTES * (filled + 1), "a smaller one is (and the block beyond)");
        c.assert_invariants();
    }

    #[test]
    fn fill_keeps_only_whole_blocks() {
        let mut c = ReadCache::new(16 * BLOCK_BYTES);
        c.fill(V, 512, &Bytes::from(vec![7u8; 3 * 4096]));
        c.fill(V, 512, &Bytes::from(vec![7u8; 3 * 4096]));
        assert!(c.get(V, 0, 512).is_none());
        assert_eq!(c.get(V, 4096, 8192).as_deref(), Some(&[7u8; 8192][..]));
        assert_eq!(c.used_bytes(), 2 * BLOCK_BYTES);
        let mut off = ReadCache::new(0);
        off.apply(V, &write(0, 1, 4096));
        assert!(off.get(V, 0, 4096).is_none());
    }

    /// A block a read missed is cached when a read misses it again (not the first time), a
    /// cached block read is kept current at once, and a written block is cached at once; blocks
    /// read once each, over four times what the cache holds, mostly stay out of it.
    #[test]
    fn a_block_read_is_cached_when_it_is_read_again() {
        let mut c = ReadCache::new(64 * BLOCK_BYTES);
        let block = |fill: u8| Bytes::from(vec![fill; BLOCK_BYTES as usize]);
        c.fill(V, 0, &block(1));
        assert!(c.get(V, 0, 4096).is_none(), "read once: not cached");
        assert_eq!(c.declined, 1);
        c.fill(V, 0, &block(1));
        assert_eq!(c.get(V, 0, 4096).as_deref(), Some(&[1u8; 4096][..]), "read again: cached");
        assert_eq!(c.declined, 1, "taken the second time");
        c.apply(V, &write(8192, 2, 4096));
        assert_eq!(c.get(V, 8192, 4096).as_deref(), Some(&[2u8; 4096][..]), "written: cached at once");
        c.fill(V, 8192, &block(2));
        assert_eq!(c.get(V, 8192, 4096).as_deref(), Some(&[2u8; 4096][..]));
        c.assert_invariants();
        // 256 blocks read once each: some pass on a shared bit (of 1,024, cleared after 128).
        let mut once = ReadCache::new(64 * BLOCK_BYTES);
        for b in 0..256u64 {
            once.fill(V, b * BLOCK_BYTES, &block(3));
        }
        let cached = once.used_bytes() / BLOCK_BYTES;
        assert!(cached < 64, "{cached} of 256 blocks read once were cached");
        once.assert_invariants();
        // The same 64 blocks read again and again: all cached.
        let mut hot = ReadCache::new(64 * BLOCK_BYTES);
        for _ in 0..2 {
            for b in 0..64u64 {
                hot.fill(V, b * BLOCK_BYTES, &block(4));
            }
        }
        assert_eq!(hot.used_bytes(), 64 * BLOCK_BYTES, "a hot set read twice is cached whole");
    }

    /// The cache against a plain list kept in recency order (the least recently used first),
    /// over random inserts, reads and removals; both must hold the same blocks at every step.
    #[test]
    fn behaves_as_a_least_recently_used_list() {
        let capacity = 16;
        let mut c = ReadCache::new(capacity as u64 * BLOCK_BYTES);
        let mut model: Vec<(Key, u8)> = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for step in 0..20_000 {
            let key = (VolumeId(next(2) as u32), next(40));
            match next(10) {
                0..=4 => {
                    let fill = next(256) as u8;
                    c.insert(key, Bytes::from(vec![fill; BLOCK_BYTES as usize]));
                    model.retain(|(k, _)| *k != key);
                    model.push((key, fill));
                    if model.len() > capacity {
                        model.remove(0);
                    }
                }
                5..=8 => {
                    // One block mostly, sometimes two or three: a hit only if all are cached,
                    // and then each becomes the most recently used, in order.
                    let blocks = if next(3) == 0 { 2 + next(2) } else { 1 };
                    let got = c
                        .get(key.0, key.1 * BLOCK_BYTES, blocks * BLOCK_BYTES)
                        .map(|data| data.chunks(BLOCK_BYTES as usize).map(|block| block[0]).collect::<Vec<u8>>());
                    let keys: Vec<Key> = (key.1..key.1 + blocks).map(|b| (key.0, b)).collect();
                    let expected = keys.iter().all(|k| model.iter().any(|(m, _)| m == k)).then(|| {
                        keys.iter()
                            .map(|k| {
                                let at = model.iter().position(|(m, _)| m == k).expect("cached");
                                let entry = model.remove(at);
                                model.push(entry);
                                entry.1
                            })
                            .collect::<Vec<u8>>()
                    });
                    assert_eq!(got, expected, "step {step}: read of {blocks} blocks at {key:?}");
                }
                _ => {
                    // Short ranges go block by block, wide ones over the cached blocks.
                    let first = next(40);
                    let end = first + if next(2) == 0 { 1 + next(4) } else { 1000 };
                    c.remove_range(key.0, first, end);
                    model.retain(|((v, b), _)| !(*v == key.0 && (first..end).contains(b)));
                }
            }
            c.assert_invariants();
            assert_eq!(c.used_bytes(), model.len() as u64 * BLOCK_BYTES, "step {step}");
        }
    }
}
