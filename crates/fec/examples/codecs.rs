//! `cargo run --release -p fec --example codecs`: the two maintained Reed–Solomon crates on the
//! far link's groups — (r, c) = (8, 3), shards of one 1 400-byte datagram and of one 4 KiB
//! block — encode per group, and decode per group with 1 and with 3 data shards lost. Prints
//! µs per group (median of 5 runs of 2 000 groups). `fec::GaloisCode` wraps the first.

use std::time::Instant;

use fec::{ErasureCode, GaloisCode};

const R: usize = 8;
const C: usize = 3;
const GROUPS: usize = 2_000;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn time(mut f: impl FnMut()) -> f64 {
    median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..GROUPS {
                    f();
                }
                t.elapsed().as_secs_f64() * 1e6 / GROUPS as f64
            })
            .collect(),
    )
}

fn main() {
    println!("| shard bytes | codec | encode µs/group | decode, 1 lost, µs/group | decode, 3 lost, µs/group |");
    println!("|---|---|---|---|---|");
    for shard in [1_400usize, 4_100] {
        let originals: Vec<Vec<u8>> = (0..R).map(|i| (0..shard).map(|j| (i * 31 + j) as u8).collect()).collect();
        let refs: Vec<&[u8]> = originals.iter().map(Vec::as_slice).collect();

        let mut galois = GaloisCode::default();
        let repairs = galois.encode(&refs, C).expect("encode");
        let enc = time(|| {
            std::hint::black_box(galois.encode(&refs, C).expect("encode"));
        });
        let mut dec = |lost: usize| {
            let o: Vec<(usize, &[u8])> = (lost..R).map(|i| (i, refs[i])).collect();
            let r: Vec<(usize, &[u8])> = (0..C).map(|i| (i, repairs[i].as_slice())).collect();
            time(|| {
                std::hint::black_box(galois.reconstruct(R, C, &o, &r).expect("decode"));
            })
        };
        let (one, three) = (dec(1), dec(3));
        println!("| {shard} | reed-solomon-erasure 6 (GF(2^8)) | {enc:.2} | {one:.2} | {three:.2} |");

        let repairs = reed_solomon_simd::encode(R, C, &refs).expect("encode");
        let enc = time(|| {
            std::hint::black_box(reed_solomon_simd::encode(R, C, &refs).expect("encode"));
        });
        let mut decoder = reed_solomon_simd::ReedSolomonDecoder::new(R, C, shard).expect("decoder");
        let mut dec = |lost: usize| {
            time(|| {
                decoder.reset(R, C, shard).expect("reset");
                for (i, s) in refs.iter().enumerate().skip(lost) {
                    decoder.add_original_shard(i, s).expect("add");
                }
                for (i, r) in repairs.iter().enumerate() {
                    decoder.add_recovery_shard(i, r).expect("add");
                }
                let result = decoder.decode().expect("decode");
                std::hint::black_box(result.restored_original_iter().count());
            })
        };
        let (one, three) = (dec(1), dec(3));
        println!("| {shard} | reed-solomon-simd 3 (decoder reused) | {enc:.2} | {one:.2} | {three:.2} |");
    }
}
