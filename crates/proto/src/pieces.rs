//! Checksums of data at a volume offset, one per *piece*: the data cut at 4 KiB block
//! boundaries of the volume. A piece that is a whole block has the crc32c the element's store
//! keeps for that block, so a write's checksums, computed once when the host element receives
//! it, are the ones stored, and a read's checksums are the stored ones again.

use crate::BLOCK_BYTES;

/// Number of pieces of `length_bytes` at `offset_bytes` (0 for no data).
pub fn piece_count(offset_bytes: u64, length_bytes: u64) -> usize {
    if length_bytes == 0 {
        return 0;
    }
    let first = offset_bytes / BLOCK_BYTES;
    let last = (offset_bytes + length_bytes - 1) / BLOCK_BYTES;
    (last - first + 1) as usize
}

/// The byte ranges (within `data`) of the pieces of `length_bytes` at `offset_bytes`.
pub fn piece_ranges(offset_bytes: u64, length_bytes: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        if at >= length_bytes {
            return None;
        }
        let position = offset_bytes + at as u64;
        let to_boundary = (BLOCK_BYTES - position % BLOCK_BYTES) as usize;
        let end = (at + to_boundary).min(length_bytes);
        let range = at..end;
        at = end;
        Some(range)
    })
}

/// crc32c of each piece of `data` at `offset_bytes`.
pub fn piece_crcs(offset_bytes: u64, data: &[u8]) -> Vec<u32> {
    piece_ranges(offset_bytes, data.len()).map(|r| crc32c::crc32c(&data[r])).collect()
}

/// A piece whose data does not match its checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceMismatch {
    /// Volume offset of the piece's first byte.
    pub offset_bytes: u64,
    pub expected: u32,
    pub actual: u32,
}

impl std::fmt::Display for PieceMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "data at offset {} (block {}) fails its checksum: crc32c {:08x}, expected {:08x}",
            self.offset_bytes,
            self.offset_bytes / BLOCK_BYTES,
            self.actual,
            self.expected
        )
    }
}

/// Check `data` at `offset_bytes` against `crcs` (one per piece). A wrong count is a mismatch
/// too: of the first piece without a checksum, or (too many) of the last piece.
pub fn check_pieces(offset_bytes: u64, data: &[u8], crcs: &[u32]) -> Result<(), PieceMismatch> {
    let count = piece_count(offset_bytes, data.len() as u64);
    if crcs.len() > count {
        let at =
            if count == 0 { offset_bytes } else { (offset_bytes + data.len() as u64 - 1) / BLOCK_BYTES * BLOCK_BYTES };
        return Err(PieceMismatch { offset_bytes: at.max(offset_bytes), expected: crcs[count], actual: 0 });
    }
    let mut expected = crcs.iter();
    for range in piece_ranges(offset_bytes, data.len()) {
        let actual = crc32c::crc32c(&data[range.clone()]);
        let at = offset_bytes + range.start as u64;
        match expected.next() {
            Some(&crc) if crc == actual => {}
            Some(&crc) => return Err(PieceMismatch { offset_bytes: at, expected: crc, actual }),
            None => return Err(PieceMismatch { offset_bytes: at, expected: 0, actual }),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_cut_at_block_boundaries() {
        let ranges: Vec<_> = piece_ranges(4096 - 512, 8192).collect();
        assert_eq!(ranges, vec![0..512, 512..4608, 4608..8192]);
        assert_eq!(piece_count(4096 - 512, 8192), 3);
        assert_eq!(piece_ranges(8192, 8192).collect::<Vec<_>>(), vec![0..4096, 4096..8192]);
        assert_eq!(piece_count(8192, 8192), 2);
        assert_eq!(piece_count(100, 0), 0);
        assert_eq!(piece_ranges(100, 0).count(), 0);
        assert_eq!(piece_count(512, 512), 1);
    }

    #[test]
    fn whole_pieces_have_the_block_checksum() {
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        let crcs = piece_crcs(4096, &data);
        assert_eq!(crcs.len(), 3);
        assert_eq!(crcs[1], crc32c::crc32c(&data[4096..8192]));
        assert_eq!(check_pieces(4096, &data, &crcs), Ok(()));
    }

    #[test]
    fn a_flipped_bit_is_found_in_its_piece() {
        let mut data = vec![7u8; 6000];
        let crcs = piece_crcs(1024, &data);
        data[3500] ^= 1;
        let err = check_pieces(1024, &data, &crcs).unwrap_err();
        assert_eq!(err.offset_bytes, 4096);
        assert!(err.to_string().contains("block 1"), "{err}");
        assert!(check_pieces(1024, &data, &crcs[..1]).is_err());
        let mut extra = piece_crcs(1024, &data);
        extra.push(0);
        assert!(check_pieces(1024, &data, &extra).is_err());
        assert!(check_pieces(1024, &[], &[0]).is_err());
    }
}
