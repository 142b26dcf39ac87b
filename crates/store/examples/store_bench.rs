//! Micro-benchmark of the store: group-committed 4 KiB writes, large writes, reads, and a
//! whole-volume trim, with real `fdatasync`s. Reports figures; asserts nothing.
//!
//! `cargo run --release -p store --example store_bench -- [DIR] [SECONDS_PER_PHASE]`

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use bytes::Bytes;
use proto::{Epoch, Op, Record, Sequence, VolumeId};
use store::{Store, StoreOptions, VolumeHandle};

const VOLUME_BYTES: u64 = 4 << 30;

struct Bench {
    store: Store,
    volume: VolumeHandle,
    sequence: u64,
}

impl Bench {
    /// Commit batches of `batch` writes of `size` bytes for `seconds`; offsets sequential or
    /// pseudo-random. Prints ops/s and MB/s.
    fn writes(&mut self, name: &str, size: u64, batch: usize, random: bool, seconds: f64) {
        let data = Bytes::from(vec![0x5a; size as usize]);
        let slots = VOLUME_BYTES / size;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next_slot = 0;
        let mut ops = 0u64;
        let mut latencies: Vec<Duration> = Vec::new();
        let started = Instant::now();
        while started.elapsed().as_secs_f64() < seconds {
            let records: Vec<(VolumeHandle, Record)> = (0..batch)
                .map(|_| {
                    let slot = if random {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng % slots
                    } else {
                        next_slot = (next_slot + 1) % slots;
                        next_slot
                    };
                    self.sequence += 1;
                    let op = Op::write(slot * size, data.clone());
                    (
                        self.volume,
                        Record { volume: VolumeId(0), epoch: Epoch(1), sequence: Sequence(self.sequence), op },
                    )
                })
                .collect();
            let commit_started = Instant::now();
            let outcome = self.store.commit(&records).expect("commit");
            latencies.push(commit_started.elapsed());
            assert!(outcome.rejected.is_empty());
            ops += batch as u64;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let commits = latencies.len();
        let mean_us = latencies.iter().map(|l| l.as_secs_f64()).sum::<f64>() * 1e6 / commits as f64;
        latencies.sort_unstable();
        let p99 = latencies[(commits * 99 / 100).min(commits - 1)];
        let max = latencies[commits - 1];
        // Share of the time spent in commits of 10 ms or more: what a stall costs the
        // requests queued behind it, which a closed loop of one committer does not show.
        let stalled =
            latencies.iter().filter(|l| **l >= Duration::from_millis(10)).map(|l| l.as_secs_f64()).sum::<f64>();
        println!(
            "{name:<34} {:>9.0} ops/s {:>8.1} MB/s {:>8.0} commits/s  commit mean {:>6.0} us  p99 {:>7.0} us  max {:>6.1} ms  stalled {:>4.1} %",
            ops as f64 / elapsed,
            (ops * size) as f64 / elapsed / 1e6,
            commits as f64 / elapsed,
            mean_us,
            p99.as_secs_f64() * 1e6,
            max.as_secs_f64() * 1e3,
            stalled / elapsed * 100.0,
        );
    }

    fn reads(&mut self, name: &str, size: u32, seconds: f64) {
        let slots = (64 << 20) / size as u64; // the first 64 MiB were written sequentially
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut ops = 0u64;
        let started = Instant::now();
        while started.elapsed().as_secs_f64() < seconds {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let (_, data) = self.store.read(self.volume, (rng % slots) * size as u64, size).expect("read");
            assert_eq!(data.len(), size as usize);
            ops += 1;
        }
        let elapsed = started.elapsed().as_secs_f64();
        println!(
            "{name:<34} {:>9.0} ops/s {:>8.1} MB/s  (page cache, crc checked)",
            ops as f64 / elapsed,
            (ops * size as u64) as f64 / elapsed / 1e6
        );
    }
}

/// A 4 KiB `pwrite` + `fdatasync` loop on a plain file for `seconds`, overwriting a written
/// 64 MiB file or appending to an empty one: what one commit of one block costs at least.
fn bare_syncs(dir: &std::path::Path, overwrite: bool, seconds: f64) {
    use std::os::unix::fs::FileExt;
    std::fs::create_dir_all(dir).expect("bench directory");
    let path = dir.join("bare");
    let file = std::fs::File::create(&path).expect("bare file");
    let block = vec![0x5au8; 4096];
    if overwrite {
        for i in 0..(64 << 20) / 4096u64 {
            file.write_all_at(&block, i * 4096).expect("fill");
        }
        file.sync_all().expect("sync");
    }
    let mut latencies = Vec::new();
    let started = Instant::now();
    let mut i = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        let commit_started = Instant::now();
        file.write_all_at(
            &block,
            (i % ((64 << 20) / 4096)) * 4096 + if overwrite { 0 } else { (i / ((64 << 20) / 4096)) << 26 },
        )
        .expect("write");
        file.sync_data().expect("sync");
        latencies.push(commit_started.elapsed());
        i += 1;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let n = latencies.len();
    let mean_us = latencies.iter().map(|l| l.as_secs_f64()).sum::<f64>() * 1e6 / n as f64;
    latencies.sort_unstable();
    println!(
        "{:<34} {:>9.0} ops/s  mean {:>6.0} us  p99 {:>7.0} us",
        if overwrite { "bare 4 KiB overwrite + fdatasync" } else { "bare 4 KiB append + fdatasync" },
        n as f64 / elapsed,
        mean_us,
        latencies[(n * 99 / 100).min(n - 1)].as_secs_f64() * 1e6,
    );
    drop(file);
    let _ = std::fs::remove_file(&path);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "/tmp/starfish-store-bench".into()));
    let seconds: f64 = args.next().map(|s| s.parse().expect("seconds")).unwrap_or(3.0);
    let _ = std::fs::remove_dir_all(&dir);
    bare_syncs(&dir, true, seconds);
    bare_syncs(&dir, false, seconds);
    let _ = std::fs::remove_dir_all(&dir);
    let options = StoreOptions::default();
    let store = Store::open(&dir, options).expect("open");
    let volume = store.ensure_volume("bench", VOLUME_BYTES).expect("volume");
    println!(
        "store in {} (checkpoint every {} MiB of log, replay log {} MiB), {seconds} s per phase",
        dir.display(),
        options.checkpoint_log_bytes >> 20,
        options.replay_log_bytes >> 20
    );
    let mut bench = Bench { store, volume, sequence: 0 };
    bench.writes("4 KiB sequential, batches of 16", 4096, 16, false, seconds);
    bench.writes("4 KiB random, batches of 16", 4096, 16, true, seconds);
    bench.writes("4 KiB random, batches of 64", 4096, 64, true, seconds);
    bench.writes("4 KiB random, batches of 1", 4096, 1, true, seconds);
    bench.writes("1 MiB sequential, batches of 1", 1 << 20, 1, false, seconds);
    bench.writes("1 MiB sequential, batches of 4", 1 << 20, 4, false, seconds);
    bench.reads("4 KiB random reads", 4096, seconds);
    bench.reads("1 MiB random reads", 1 << 20, seconds);
    let started = Instant::now();
    bench.sequence += 1;
    let trim = Record {
        volume: VolumeId(0),
        epoch: Epoch(1),
        sequence: Sequence(bench.sequence),
        op: Op::Trim { offset_bytes: 0, length_bytes: VOLUME_BYTES },
    };
    bench.store.commit(&[(volume, trim)]).expect("trim");
    println!("trim of the whole 4 GiB volume: {:?}", started.elapsed());
    let started = Instant::now();
    bench.store.checkpoint().expect("checkpoint");
    println!("final checkpoint: {:?}", started.elapsed());
    drop(bench);
    let started = Instant::now();
    let store = Store::open(&dir, options).expect("reopen");
    println!("reopen (4 GiB volume, empty live log): {:?}", started.elapsed());
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
