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
    // Sized at once: collecting from `piece_ranges` (no size hint) grew it five times a MiB.
    let mut crcs = Vec::with_capacity(piece_count(offset_bytes, data.len() as u64));
    crcs.extend(piece_ranges(offset_bytes, data.len()).map(|r| crate::crc32c(&data[r])));
    crcs
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
        let actual = crate::crc32c(&data[range.clone()]);
        let at = offset_bytes + range.start as u64;
        match expected.next() {
            Some(&crc) if crc == actual => {}
            Some(&crc) => return Err(PieceMismatch { offset_bytes: at, expected: crc, actual }),
            None => return Err(PieceMismatch { offset_bytes: at, expected: 0, actual }),
        }
    }
    Ok(())
}

/// crc32c of what `crc` covers followed by `data` at `offset_bytes`, from `crcs` (one per
/// piece, as [`piece_crcs`] gives them) without reading the data of whole-block pieces: for
/// those, crc32c(A‖B) = shift₄ₖ(crc32c(A)) ⊕ crc32c(B), where shift₄ₖ, feeding 4096 zero bytes
/// through the register, is linear and is applied by four table look-ups. A partial piece
/// (an unaligned write's first or last) is read. Equals `crc32c_append(crc, data)` when `crcs`
/// are the data's piece checksums; otherwise it is the checksum of the data those pieces
/// describe, so a frame checksum computed this way vouches for the pieces and the bytes around
/// them, and the data must then be checked against its pieces ([`check_pieces`]) before it is
/// used. With a checksum count that does not fit the pieces, every byte is read.
pub fn crc_append_pieces(crc: u32, offset_bytes: u64, data: &[u8], crcs: impl ExactSizeIterator<Item = u32>) -> u32 {
    if crcs.len() != piece_count(offset_bytes, data.len() as u64) {
        return crc32c::crc32c_append(crc, data);
    }
    let shift = block_shift_tables();
    piece_ranges(offset_bytes, data.len()).zip(crcs).fold(crc, |crc, (range, piece)| {
        if range.len() == BLOCK_BYTES as usize {
            let [b0, b1, b2, b3] = crc.to_le_bytes();
            shift[0][b0 as usize] ^ shift[1][b1 as usize] ^ shift[2][b2 as usize] ^ shift[3][b3 as usize] ^ piece
        } else {
            crc32c::crc32c_append(crc, &data[range])
        }
    })
}

/// shift₄ₖ by bytes: `tables[k][b]` is shift₄ₖ of `b << 8k`.
fn block_shift_tables() -> &'static [[u32; 256]; 4] {
    static TABLES: std::sync::OnceLock<Box<[[u32; 256]; 4]>> = std::sync::OnceLock::new();
    TABLES.get_or_init(|| {
        // crc32c_combine(x, 0, n) is shift by n bytes of x: linear, so one call per bit.
        let bit: Vec<u32> = (0..32).map(|i| crc32c::crc32c_combine(1 << i, 0, BLOCK_BYTES as usize)).collect();
        let mut tables = Box::new([[0u32; 256]; 4]);
        for (k, table) in tables.iter_mut().enumerate() {
            for (b, entry) in table.iter_mut().enumerate() {
                *entry = (0..8).filter(|j| b & (1 << j) != 0).fold(0, |acc, j| acc ^ bit[8 * k + j]);
            }
        }
        tables
    })
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
    fn the_checksum_over_pieces_is_the_checksum_over_their_data() {
        let data: Vec<u8> = (0..40_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for (offset, length) in [(0u64, 4096usize), (8192, 32_768), (4096 - 512, 20_000), (100, 7), (512, 40_000 - 512)]
        {
            let part = &data[..length];
            let crcs = piece_crcs(offset, part);
            for seed in [0u32, 0xdead_beef, crc32c::crc32c(b"a frame's head")] {
                assert_eq!(
                    crc_append_pieces(seed, offset, part, crcs.iter().copied()),
                    crc32c::crc32c_append(seed, part),
                    "{offset} {length}"
                );
            }
        }
        // Whole blocks are not read: the result follows the checksums, not the data.
        let mut changed = data[..8192].to_vec();
        let crcs = piece_crcs(0, &changed);
        changed[10] ^= 1;
        assert_eq!(crc_append_pieces(0, 0, &changed, crcs.iter().copied()), crc32c::crc32c(&data[..8192]));
        let mut wrong = crcs.clone();
        wrong[1] ^= 1;
        assert_ne!(crc_append_pieces(0, 0, &changed, wrong.into_iter()), crc32c::crc32c(&data[..8192]));
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
