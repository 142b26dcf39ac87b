//! The erasure code behind a small trait. [`GaloisCode`] is `reed-solomon-erasure`'s (GF(2^8),
//! Backblaze's construction); it was picked over `reed-solomon-simd` by measurement on our
//! groups, `(8, 3)` with 1 400-byte and 4 KiB shards (`examples/codecs.rs`, docs/benchmarks.md):
//! reed-solomon-simd encodes 5× faster but decodes a group in ~0.8 ms against ~10 µs, so at
//! 1 % loss (a tenth of the groups need decoding) it costs several times more.

use std::collections::{BTreeMap, HashMap};

use reed_solomon_erasure::galois_8::ReedSolomon;

/// A systematic erasure code over equal-sized shards.
pub trait ErasureCode {
    /// The `repairs` repair shards of `originals` (all the same length).
    fn encode(&mut self, originals: &[&[u8]], repairs: usize) -> Result<Vec<Vec<u8>>, String>;

    /// The missing original shards, by index, from the `originals` and `repairs` present
    /// (`original_count` originals were encoded with `repair_count` repairs). Fails when fewer
    /// than `original_count` shards are present.
    fn reconstruct(
        &mut self,
        original_count: usize,
        repair_count: usize,
        originals: &[(usize, &[u8])],
        repairs: &[(usize, &[u8])],
    ) -> Result<BTreeMap<usize, Vec<u8>>, String>;
}

/// `reed-solomon-erasure` over GF(2^8): up to 255 shards in all. The coding matrices of each
/// (originals, repairs) shape are built once and kept.
#[derive(Default)]
pub struct GaloisCode {
    shapes: HashMap<(usize, usize), ReedSolomon>,
}

impl GaloisCode {
    fn shape(&mut self, originals: usize, repairs: usize) -> Result<&ReedSolomon, String> {
        match self.shapes.entry((originals, repairs)) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                Ok(e.insert(ReedSolomon::new(originals, repairs).map_err(|e| format!("{e:?}"))?))
            }
        }
    }
}

impl ErasureCode for GaloisCode {
    fn encode(&mut self, originals: &[&[u8]], repairs: usize) -> Result<Vec<Vec<u8>>, String> {
        let len = originals.first().map_or(0, |s| s.len());
        if originals.iter().any(|s| s.len() != len) {
            return Err("shards of different lengths".into());
        }
        let rs = self.shape(originals.len(), repairs)?;
        let mut parity = vec![vec![0u8; len]; repairs];
        rs.encode_sep(originals, &mut parity).map_err(|e| format!("{e:?}"))?;
        Ok(parity)
    }

    fn reconstruct(
        &mut self,
        original_count: usize,
        repair_count: usize,
        originals: &[(usize, &[u8])],
        repairs: &[(usize, &[u8])],
    ) -> Result<BTreeMap<usize, Vec<u8>>, String> {
        let mut shards: Vec<Option<Vec<u8>>> = vec![None; original_count + repair_count];
        for &(i, s) in originals {
            *shards.get_mut(i).ok_or("original index out of range")? = Some(s.to_vec());
        }
        for &(i, s) in repairs {
            *shards.get_mut(original_count + i).ok_or("repair index out of range")? = Some(s.to_vec());
        }
        let missing: Vec<usize> = (0..original_count).filter(|&i| shards[i].is_none()).collect();
        let rs = self.shape(original_count, repair_count)?;
        rs.reconstruct_data(&mut shards).map_err(|e| format!("{e:?}"))?;
        Ok(missing.into_iter().map(|i| (i, shards[i].take().expect("reconstructed"))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_three_of_eleven_shards_lost_are_rebuilt() {
        let originals: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i.wrapping_mul(37); 64]).collect();
        let refs: Vec<&[u8]> = originals.iter().map(|v| v.as_slice()).collect();
        let mut code = GaloisCode::default();
        let repairs = code.encode(&refs, 3).expect("encode");
        for a in 0..11 {
            for b in a + 1..11 {
                for c in b + 1..11 {
                    let lost = [a, b, c];
                    let have_o: Vec<(usize, &[u8])> =
                        (0..8).filter(|i| !lost.contains(i)).map(|i| (i, refs[i])).collect();
                    let have_r: Vec<(usize, &[u8])> =
                        (0..3).filter(|i| !lost.contains(&(i + 8))).map(|i| (i, repairs[i].as_slice())).collect();
                    let rebuilt = code.reconstruct(8, 3, &have_o, &have_r).expect("3 of 11 lost");
                    for i in lost.iter().filter(|i| **i < 8) {
                        assert_eq!(rebuilt[i], originals[*i], "shard {i} with {lost:?} lost");
                    }
                }
            }
        }
        let too_few: Vec<(usize, &[u8])> = (0..4).map(|i| (i, refs[i])).collect();
        assert!(code.reconstruct(8, 3, &too_few, &[(0, &repairs[0])]).is_err());
        assert!(code.reconstruct(8, 3, &[(9, refs[0])], &[]).is_err(), "an index out of range");
    }
}
