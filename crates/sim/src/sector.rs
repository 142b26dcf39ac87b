//! Self-describing sectors: every 512-byte sector a simulated host writes names the write that
//! produced it, its own position and volume, and carries a checksum, so any sector read back
//! tells exactly which write it comes from — or that it is garbage.
//!
//! Layout: `[u64 write id][u64 sector][u32 magic][u32 volume][480 bytes filler: the splitmix64
//! stream from the first three][u32 zero][u32 crc32c of bytes 0..508]`. An all-zero sector is
//! "zero" (never written, trimmed or zeroed): ids start at 1 so no written sector is all zero.

use crate::rng::splitmix64;

pub const SECTOR_BYTES: u64 = 512;
const MAGIC: u32 = 0x5346_5345;
/// splitmix64's increment: the filler's word i is `splitmix64(seed + i·GAMMA)`.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

pub fn fill_sector(buf: &mut [u8], id: u64, volume: u32, sector: u64) {
    assert_eq!(buf.len() as u64, SECTOR_BYTES);
    assert!(id != 0, "write ids start at 1");
    buf[0..8].copy_from_slice(&id.to_le_bytes());
    buf[8..16].copy_from_slice(&sector.to_le_bytes());
    buf[16..20].copy_from_slice(&MAGIC.to_le_bytes());
    buf[20..24].copy_from_slice(&volume.to_le_bytes());
    // The splitmix64 stream from `seed`: its words do not depend on each other, so they are
    // computed side by side (feeding each word back in as the next one's input made this the
    // simulator's hottest function).
    let seed = id ^ sector.rotate_left(32) ^ ((volume as u64) << 56);
    for (i, chunk) in buf[24..504].chunks_exact_mut(8).enumerate() {
        let x = seed.wrapping_add((i as u64).wrapping_mul(GAMMA));
        chunk.copy_from_slice(&splitmix64(x).to_le_bytes());
    }
    buf[504..508].fill(0);
    let crc = crc32c::crc32c(&buf[..508]);
    buf[508..512].copy_from_slice(&crc.to_le_bytes());
}

/// What one sector read back holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SectorValue {
    Zero,
    /// Written by the write with this id.
    Data(u64),
    Garbage(String),
}

pub fn decode_sector(buf: &[u8], volume: u32, sector: u64) -> SectorValue {
    assert_eq!(buf.len() as u64, SECTOR_BYTES);
    if buf.iter().all(|b| *b == 0) {
        return SectorValue::Zero;
    }
    let crc = u32::from_le_bytes(buf[508..512].try_into().expect("4 bytes"));
    if crc32c::crc32c(&buf[..508]) != crc {
        return SectorValue::Garbage("checksum mismatch".into());
    }
    let id = u64::from_le_bytes(buf[0..8].try_into().expect("8 bytes"));
    let at = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
    let magic = u32::from_le_bytes(buf[16..20].try_into().expect("4 bytes"));
    let vol = u32::from_le_bytes(buf[20..24].try_into().expect("4 bytes"));
    if magic != MAGIC {
        return SectorValue::Garbage("bad magic".into());
    }
    if at != sector || vol != volume {
        return SectorValue::Garbage(format!(
            "misplaced: sector {at} of volume {vol} found at sector {sector} of volume {volume}"
        ));
    }
    SectorValue::Data(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_detection() {
        let mut buf = vec![0u8; 512];
        assert_eq!(decode_sector(&buf, 0, 3), SectorValue::Zero);
        fill_sector(&mut buf, 42, 1, 3);
        assert_eq!(decode_sector(&buf, 1, 3), SectorValue::Data(42));
        assert!(matches!(decode_sector(&buf, 1, 4), SectorValue::Garbage(_)));
        buf[100] ^= 1;
        assert!(matches!(decode_sector(&buf, 1, 3), SectorValue::Garbage(_)));
    }
}
