//! Behaviour of the whole store against a byte-array model, recovery from torn and damaged
//! logs, checkpoints and the replay log, and a kill -9 crash test in a child process.

use std::{
    fs,
    io::{BufRead, BufReader, Write},
    os::unix::fs::{FileExt, MetadataExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
};

use bytes::Bytes;
use proto::{BlockExtent, Epoch, Op, Record, Sequence, VolumeId, BLOCK_BYTES, PAYLOAD_BYTES_MAX};

mod clones;
mod placed;
mod snapshots;

use crate::{
    log, CommitOutcome, Store, StoreError, StoreOptions, VolumeHandle, CHECKPOINT_LAG_SEGMENTS_MAX,
    CHECKPOINT_LOG_BYTES_MAX, CHECKPOINT_LOG_BYTES_MIN, MAP_CHUNK_BLOCKS,
};

// ---------------------------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------------------------

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "starfish-store-test-{}-{name}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes (never a whole block of zeroes).
fn pattern(seed: u64, length: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state as u8) | 1
        })
        .collect()
}

fn record(sequence: u64, op: Op) -> Record {
    Record { volume: VolumeId(0), epoch: Epoch(1), sequence: Sequence(sequence), op }
}

fn write_op(offset_bytes: u64, length: usize, seed: u64) -> Op {
    Op::write(offset_bytes, Bytes::from(pattern(seed, length)))
}

fn trim_op(offset_bytes: u64, length_bytes: u64) -> Op {
    Op::Trim { offset_bytes, length_bytes }
}

fn zeroes_op(offset_bytes: u64, length_bytes: u64) -> Op {
    Op::WriteZeroes { offset_bytes, length_bytes }
}

fn small_options() -> StoreOptions {
    StoreOptions {
        checkpoint_log_bytes: CHECKPOINT_LOG_BYTES_MIN,
        replay_log_bytes: 4 * CHECKPOINT_LOG_BYTES_MIN,
        ..StoreOptions::default()
    }
}

/// What a volume must hold: its bytes and which blocks are allocated.
#[derive(Clone)]
struct Model {
    bytes: Vec<u8>,
    allocated: Vec<bool>,
}

impl Model {
    fn new(size_bytes: u64) -> Model {
        Model { bytes: vec![0; size_bytes as usize], allocated: vec![false; (size_bytes / BLOCK_BYTES) as usize] }
    }

    fn grow(&mut self, size_bytes: u64) {
        self.bytes.resize(size_bytes as usize, 0);
        self.allocated.resize((size_bytes / BLOCK_BYTES) as usize, false);
    }

    fn apply(&mut self, op: &Op) {
        let (offset, length) = (op.offset_bytes() as usize, op.length_bytes() as usize);
        if length == 0 {
            return;
        }
        let block = BLOCK_BYTES as usize;
        let (first, last) = (offset / block, (offset + length - 1) / block);
        match op {
            Op::Write { data, .. } => {
                self.bytes[offset..offset + length].copy_from_slice(data);
                self.allocated[first..=last].fill(true);
            }
            _ => {
                self.bytes[offset..offset + length].fill(0);
                for b in first..=last {
                    let whole = offset <= b * block && (b + 1) * block <= offset + length;
                    // A partially zeroed block stays allocated only if something non-zero is left.
                    self.allocated[b] =
                        !whole && self.allocated[b] && self.bytes[b * block..(b + 1) * block].iter().any(|x| *x != 0);
                }
            }
        }
    }

    fn extents(&self, offset: u64, length: u64) -> Vec<BlockExtent> {
        let mut extents: Vec<BlockExtent> = Vec::new();
        let end = offset + length;
        let mut position = offset;
        while position < end {
            let block = position / BLOCK_BYTES;
            let next = ((block + 1) * BLOCK_BYTES).min(end);
            let allocated = self.allocated[block as usize];
            match extents.last_mut() {
                Some(last) if last.allocated == allocated => last.length_bytes += next - position,
                _ => extents.push(BlockExtent { length_bytes: next - position, allocated }),
            }
            position = next;
        }
        extents
    }
}

/// A store with one volume, and the model of that volume.
struct Fixture {
    options: StoreOptions,
    store: Option<Store>,
    volume: VolumeHandle,
    size_bytes: u64,
    model: Model,
    applied: u64,
    /// Last: fields drop in order, and the store's threads (checkpoint, reclaim) must be joined
    /// before the directory goes, or a checkpoint's `meta` lands in it while it is removed.
    dir: TempDir,
}

impl Fixture {
    fn new(name: &str, size_bytes: u64, options: StoreOptions) -> Fixture {
        let dir = TempDir::new(name);
        let store = Store::open(&dir.0, options).expect("open a new store");
        let volume = store.ensure_volume("vol", size_bytes).expect("create the volume");
        Fixture { dir, options, store: Some(store), volume, size_bytes, model: Model::new(size_bytes), applied: 0 }
    }

    fn store(&self) -> &Store {
        self.store.as_ref().expect("store is open")
    }

    /// Commit `ops` as one batch with the next sequences; all must be accepted.
    fn commit(&mut self, ops: &[Op]) -> CommitOutcome {
        let batch: Vec<(VolumeHandle, Record)> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| (self.volume, record(self.applied + 1 + i as u64, op.clone())))
            .collect();
        let outcome = self.store().commit(&batch).expect("commit");
        assert!(outcome.rejected.is_empty(), "rejected: {:?}", outcome.rejected);
        for op in ops {
            self.model.apply(op);
        }
        self.applied += ops.len() as u64;
        assert_eq!(outcome.applied, vec![(self.volume, Sequence(self.applied))]);
        outcome
    }

    fn close(&mut self) {
        self.store = None;
    }

    fn reopen(&mut self) {
        self.store = None;
        let store = Store::open(&self.dir.0, self.options).expect("reopen");
        self.volume = store.volume("vol").expect("volume survives");
        self.store = Some(store);
    }

    /// The store holds exactly the model: content (whole and in unaligned pieces), allocation
    /// extents, applied sequence.
    fn check(&self) {
        let store = self.store();
        assert_eq!(store.applied_sequence(self.volume), Sequence(self.applied));
        let piece_bytes = self.size_bytes.min(PAYLOAD_BYTES_MAX as u64);
        for offset in (0..self.size_bytes).step_by(piece_bytes as usize) {
            let (applied, data) = store.read(self.volume, offset, piece_bytes as u32).expect("read all");
            assert_eq!(applied, Sequence(self.applied));
            let model = &self.model.bytes[offset as usize..][..piece_bytes as usize];
            if data != model {
                let first = offset as usize + data.iter().zip(model).position(|(a, b)| a != b).expect("differs");
                panic!("content differs from the model first at byte {first} (block {})", first as u64 / BLOCK_BYTES);
            }
        }
        for (offset, length) in [(512, 512), (4096 - 512, 1024), (1000, 10000), (self.size_bytes - 4608, 4608)] {
            let (_, data) = store.read(self.volume, offset, length).expect("read piece");
            assert_eq!(&data[..], &self.model.bytes[offset as usize..][..length as usize], "read {length} at {offset}");
        }
        let (_, extents) = store.block_status(self.volume, 0, self.size_bytes).expect("block status");
        assert_eq!(extents, self.model.extents(0, self.size_bytes), "allocation extents");
        let (_, extents) = store.block_status(self.volume, 1536, 3 * BLOCK_BYTES).expect("block status");
        assert_eq!(extents, self.model.extents(1536, 3 * BLOCK_BYTES), "allocation extents of a piece");
    }

    fn live_segment(&self) -> PathBuf {
        let id = *self.store().log_segments().last().expect("a live segment");
        log::segment_path(&self.dir.0, id)
    }
}

// ---------------------------------------------------------------------------------------------
// Data path.
// ---------------------------------------------------------------------------------------------

#[test]
fn writes_trims_and_zeroes_read_back() {
    let mut f = Fixture::new("round-trip", 1 << 20, StoreOptions::default());
    f.check();
    let b = BLOCK_BYTES;
    // One op per commit, checked after each: (op, what it exercises).
    let table: Vec<(Op, &str)> = vec![
        (write_op(0, 4096, 1), "one aligned block"),
        (write_op(8 * b, 8 * 4096, 2), "aligned multi-block"),
        (write_op(512, 512, 3), "one sector inside an allocated block"),
        (write_op(20 * b + 1024, 512, 4), "one sector inside a hole"),
        (write_op(30 * b - 512, 1024, 5), "two sectors across a block boundary"),
        (write_op(40 * b + 512, 5 * 4096, 6), "unaligned at both ends, several blocks"),
        (write_op(10 * b + 3584, 4096 + 1024, 7), "unaligned into allocated blocks"),
        (write_op(50 * b, 0, 8), "zero-length write"),
        (trim_op(9 * b, 2 * b), "trim whole blocks"),
        (trim_op(12 * b + 512, 1024), "trim inside a block"),
        (trim_op(40 * b + 512, 4096 - 512), "trim the written part of a block: it becomes a hole"),
        (zeroes_op(13 * b + 2048, 3 * 4096), "write zeroes unaligned across blocks"),
        (zeroes_op(60 * b, 4 * b), "write zeroes over holes"),
        (write_op(60 * b + 512, 4096, 9), "write over zeroed blocks"),
        (trim_op(0, 0), "zero-length trim"),
        (write_op((1 << 20) - 512, 512, 10), "last sector of the volume"),
    ];
    for (op, what) in table {
        f.commit(&[op]);
        println!("{what}");
        f.check();
    }
    f.reopen();
    f.check();
    f.store().checkpoint().expect("checkpoint");
    f.reopen();
    f.check();
}

/// A removed volume frees its files at once, refuses every request, stays removed across a
/// reopen (its records still in the log are skipped), and its name can be created again as a
/// new, empty volume; the other volumes are untouched. A removal cut short after its commit
/// point (the metadata) has its files deleted when the store opens.
#[test]
fn removed_volumes_free_their_space_and_stay_removed() {
    let dir = TempDir::new("remove");
    let size = 4u64 << 20;
    let store = Store::open(&dir.0, small_options()).expect("open");
    let keep = store.ensure_volume("keep", size).expect("keep");
    let gone = store.ensure_volume("gone", size).expect("gone");
    let commit = |volume: VolumeHandle, sequence: u64, seed: u64| {
        let outcome = store.commit(&[(volume, record(sequence, write_op(0, 1 << 20, seed)))]).expect("commit");
        assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    };
    commit(keep, 1, 1);
    commit(gone, 1, 2);
    let data = |number: u32| dir.0.join("volumes").join(format!("{number}.data"));
    let number_of_gone = 1;
    assert!(fs::metadata(data(number_of_gone)).expect("data file").blocks() > 0);
    store.remove_volume(gone).expect("remove");
    store.remove_volume(gone).expect("removing twice is a no-op");
    assert!(!data(number_of_gone).exists(), "the data file is deleted");
    assert!(store.volume("gone").is_none());
    assert!(matches!(store.read(gone, 0, 4096), Err(StoreError::Removed { .. })));
    assert!(matches!(store.block_status(gone, 0, 4096), Err(StoreError::Removed { .. })));
    let outcome = store.commit(&[(gone, record(2, write_op(0, 4096, 3)))]).expect("commit");
    assert!(matches!(outcome.rejected[0].error, StoreError::Removed { .. }), "a record of a removed volume is refused");
    commit(keep, 2, 4);
    let again = store.ensure_volume("gone", size).expect("a removed name can be created again");
    assert_ne!(again, gone);
    assert_eq!(store.applied_sequence(again), Sequence::ZERO);
    assert!(store.read(again, 0, 4096).expect("read").1.iter().all(|&b| b == 0), "new, empty");
    let kept = store.read(keep, 0, 4096).expect("read").1;
    drop(store);

    // Reopened: the records of the removed volume in the log are skipped.
    let store = Store::open(&dir.0, small_options()).expect("reopen");
    let names: Vec<String> = store.volumes().into_iter().map(|(name, _)| name).collect();
    assert_eq!(names, vec!["keep".to_string(), "gone".to_string()]);
    let keep = store.volume("keep").expect("keep");
    assert_eq!(store.applied_sequence(keep), Sequence(2));
    assert!(store.read(keep, 0, 4096).expect("read").1 == kept);
    let again = store.volume("gone").expect("the new one");
    assert_eq!(store.applied_sequence(again), Sequence::ZERO);

    // A removal cut short after its metadata was written left files behind.
    store.remove_volume(again).expect("remove");
    drop(store);
    let orphan = dir.0.join("volumes").join("2.data");
    fs::write(&orphan, b"left over").expect("write");
    let store = Store::open(&dir.0, small_options()).expect("reopen");
    assert!(!orphan.exists(), "files of a removed volume are deleted at open");
    assert!(store.volume("gone").is_none());
    assert_eq!(store.volumes().len(), 1);
}

#[test]
fn a_new_log_segment_on_a_disk_grows_in_steps_of_zeroes() {
    let mut f = Fixture::new("grow", 1 << 20, StoreOptions::default());
    if f.store().in_memory() {
        return; // The temporary directory is on tmpfs: segments grow as written there.
    }
    let segment = f.live_segment();
    f.commit(&[Op::write(0, Bytes::from(pattern(1, 4096)))]);
    let grown = fs::metadata(&segment).expect("stat").len();
    assert_eq!(grown, crate::LOG_GROW_STEP_BYTES, "one step holds the first record");
    for i in 0..80u64 {
        f.commit(&[Op::write(i * 4096 % (1 << 20), Bytes::from(pattern(i + 2, 4096)))]);
    }
    let grown = fs::metadata(&segment).expect("stat").len();
    assert!(grown > crate::LOG_GROW_STEP_BYTES && grown % crate::LOG_GROW_STEP_BYTES == 0, "{grown} bytes");
    f.check();
    // The zeroes past the log read as its end: nothing lost, nothing torn.
    f.reopen();
    f.check();
}

#[test]
fn reads_racing_commits_see_one_whole_version_and_never_a_false_checksum_error() {
    // Each commit rewrites the same 16 blocks with one repeated byte, the sequence's low byte;
    // a reader running all the while must see every block of a read from one commit no
    // older than the sequence it reports (the read runs without the volume lock now).
    let f = Fixture::new("read-race", 1 << 20, StoreOptions::default());
    let store = f.store();
    let volume = f.volume;
    let length = 16 * BLOCK_BYTES as usize;
    let commits = 300u64;
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut reads = 0u64;
            loop {
                let (applied, data) = store.read(volume, 0, length as u32).expect("a read never fails here");
                reads += 1;
                let first = data[0];
                assert!(data.iter().all(|b| *b == first), "a read mixes two versions at sequence {applied}");
                if applied.0 > 0 {
                    assert_eq!(first, applied.0 as u8, "the data is the version of the sequence reported");
                }
                if applied.0 == commits {
                    return reads;
                }
            }
        });
        for sequence in 1..=commits {
            let op = Op::write(0, Bytes::from(vec![sequence as u8; length]));
            store.commit(&[(volume, record(sequence, op))]).expect("commit");
        }
        let reads = reader.join().expect("reader");
        assert!(reads > 0);
    });
}

#[test]
fn one_batch_with_overlapping_partial_writes() {
    // Later records of a batch merge their partial blocks with earlier records of the batch,
    // not with the data file.
    let mut f = Fixture::new("overlap", 1 << 20, StoreOptions::default());
    let b = BLOCK_BYTES;
    f.commit(&[
        write_op(0, 4096, 1),
        write_op(512, 512, 2),
        write_op(1024, 4096, 3),
        trim_op(0, 1536),
        write_op(2 * b, 4096, 4),
        zeroes_op(2 * b + 512, 512),
        write_op(2 * b + 1024, 100, 5),
        trim_op(5 * b, 2 * b),
        write_op(5 * b + 4000, 200, 6),
    ]);
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn a_batch_of_sequential_writes_is_applied_in_one_run() {
    let mut f = Fixture::new("run", 1 << 20, StoreOptions::default());
    f.commit(&[write_op(5 * BLOCK_BYTES, 4096, 9)]);
    let b = BLOCK_BYTES;
    // Blocks 0, 1-2, 3-4 (the last partial), 5 (partial, merged with its content), then a
    // trim and writes that continue after it: one run, a break, another run.
    f.commit(&[
        write_op(0, 4096, 1),
        write_op(b, 8192, 2),
        write_op(3 * b, 4096 + 100, 3),
        write_op(5 * b + 512, 512, 4),
        trim_op(6 * b, 2 * b),
        write_op(8 * b, 4096, 5),
        write_op(9 * b, 4096, 6),
        write_op(9 * b + 1000, 100, 7),
    ]);
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn a_commit_larger_than_a_log_batch() {
    // 96 MiB of writes in one commit: several log batches, each synced before the next.
    let mut f = Fixture::new("big-commit", 128 << 20, StoreOptions::default());
    let big = |offset: u64, byte: u8| Op::write(offset, Bytes::from(vec![byte; 32 << 20]));
    f.commit(&[big(0, 1), big(32 << 20, 2), write_op(512, 1024, 3), big((64 << 20) + 512, 4)]);
    f.reopen();
    f.check();
}

#[test]
fn block_status_extents() {
    let mut f = Fixture::new("extents", 64 * BLOCK_BYTES, StoreOptions::default());
    let b = BLOCK_BYTES;
    f.commit(&[write_op(b, 2 * 4096, 1), write_op(5 * b, 4096, 2), write_op(6 * b + 512, 512, 3)]);
    let check = |offset: u64, length: u64, expected: &[(u64, bool)]| {
        let (_, extents) = f.store().block_status(f.volume, offset, length).expect("block status");
        let expected: Vec<BlockExtent> =
            expected.iter().map(|&(length_bytes, allocated)| BlockExtent { length_bytes, allocated }).collect();
        assert_eq!(extents, expected, "block status of {length} bytes at {offset}");
    };
    check(0, 8 * b, &[(b, false), (2 * b, true), (2 * b, false), (2 * b, true), (b, false)]);
    check(512, 1024, &[(1024, false)]);
    check(b + 100, 200, &[(200, true)]);
    check(2 * b, 2 * b, &[(b, true), (b, false)]);
    check(0, 0, &[]);
    check(0, 64 * b, &[(b, false), (2 * b, true), (2 * b, false), (2 * b, true), (57 * b, false)]);
    assert!(matches!(f.store().block_status(f.volume, 60 * b, 5 * b), Err(StoreError::OutOfRange { .. })));
}

#[test]
fn ranges_past_the_end_are_refused() {
    let mut f = Fixture::new("range", 16 * BLOCK_BYTES, StoreOptions::default());
    let size = 16 * BLOCK_BYTES;
    assert!(matches!(f.store().read(f.volume, size - 512, 1024), Err(StoreError::OutOfRange { .. })));
    assert!(matches!(f.store().read(f.volume, u64::MAX, 1), Err(StoreError::OutOfRange { .. })));
    let outcome = f
        .store()
        .commit(&[
            (f.volume, record(1, write_op(size - 512, 1024, 1))),
            (f.volume, record(2, trim_op(u64::MAX - 1, 4))),
        ])
        .expect("commit");
    assert_eq!(outcome.rejected.len(), 2);
    assert!(outcome.rejected.iter().all(|r| matches!(r.error, StoreError::OutOfRange { .. } | StoreError::Gap { .. })));
    assert_eq!(f.store().applied_sequence(f.volume), Sequence(0));
    f.commit(&[write_op(size - 512, 512, 2)]);
    f.check();
}

#[test]
fn trimming_a_whole_gibibyte_punches_holes() {
    let size = 1 << 30;
    let mut f = Fixture::new("huge-trim", size, StoreOptions::default());
    let ops: Vec<Op> = (0..64).map(|i| write_op(i * (16 << 20), 1 << 20, i)).collect();
    f.commit(&ops);
    let data_file = f.dir.0.join("volumes/0.data");
    let allocated_before = fs::metadata(&data_file).expect("stat").blocks() * 512;
    assert!(allocated_before >= 64 << 20, "writes allocated {allocated_before} bytes");
    let started = std::time::Instant::now();
    f.commit(&[trim_op(0, size)]);
    f.commit(&[zeroes_op(4096, size - 8192)]);
    println!("trim + write zeroes of 1 GiB: {:?}", started.elapsed());
    f.store().reclaim();
    assert_eq!(f.store().reclaim_backlog_bytes(), 0);
    let allocated_after = fs::metadata(&data_file).expect("stat").blocks() * 512;
    assert!(allocated_after < 1 << 20, "{allocated_after} bytes still allocated after the trim");
    let (_, extents) = f.store().block_status(f.volume, 0, size).expect("block status");
    assert_eq!(extents, vec![BlockExtent { length_bytes: size, allocated: false }]);
    let (_, data) = f.store().read(f.volume, (16 << 20) - 512, 4096).expect("read");
    assert!(data.iter().all(|b| *b == 0));
}

// ---------------------------------------------------------------------------------------------
// Sequences and epochs.
// ---------------------------------------------------------------------------------------------

#[test]
fn a_beginning_changes_no_block_and_is_kept_in_the_log_and_through_a_reopen() {
    let mut f = Fixture::new("begin", 1 << 20, small_options());
    f.commit(&[write_op(0, 8192, 1), Op::Begin, write_op(4096, 4096, 2)]);
    f.check();
    let ops = |f: &Fixture| -> Vec<Op> {
        f.store().log_records(f.volume, Sequence::ZERO, u64::MAX).expect("log").into_iter().map(|r| r.op).collect()
    };
    assert_eq!(ops(&f)[1], Op::Begin, "served to peers as it came");
    f.reopen();
    f.check();
    assert_eq!(ops(&f)[1], Op::Begin, "replayed from the log");
}

#[test]
fn duplicates_are_skipped_and_gaps_rejected() {
    let mut f = Fixture::new("sequence", 1 << 20, StoreOptions::default());
    f.commit(&[write_op(0, 4096, 1), write_op(4096, 4096, 2)]);
    let v = f.volume;
    // (batch sequences, expected applied after, duplicates, rejected sequences)
    let check = |sequences: &[u64], applied: u64, duplicates: usize, rejected: &[u64]| {
        let batch: Vec<_> = sequences.iter().map(|s| (v, record(*s, write_op(8192, 512, *s)))).collect();
        let outcome = f.store().commit(&batch).expect("commit");
        assert_eq!(outcome.applied, vec![(v, Sequence(applied))], "batch {sequences:?}");
        assert_eq!(outcome.duplicates, duplicates, "batch {sequences:?}");
        let refused: Vec<u64> = outcome.rejected.iter().map(|r| r.sequence.0).collect();
        assert_eq!(refused, rejected, "batch {sequences:?}");
        assert!(outcome.rejected.iter().all(|r| matches!(r.error, StoreError::Gap { .. })));
    };
    check(&[1, 2], 2, 2, &[]);
    check(&[4], 2, 0, &[4]);
    check(&[3, 3, 5, 4], 4, 1, &[5]);
    check(&[5, 7, 8], 5, 0, &[7, 8]);
    check(&[2, 6], 6, 1, &[]);
    let message =
        f.store().commit(&[(v, record(8, write_op(0, 512, 8)))]).expect("commit").rejected[0].error.to_string();
    assert_eq!(message, "volume \"vol\": sequence 8 leaves a gap after the applied sequence 6");
}

#[test]
fn stale_epochs_are_fenced_and_the_epoch_is_durable() {
    let mut f = Fixture::new("epoch", 1 << 20, StoreOptions::default());
    assert_eq!(f.store().epoch(), Epoch(0));
    f.store().set_epoch(Epoch(5), proto::HostId(7)).expect("raise epoch");
    f.store().set_epoch(Epoch(5), proto::HostId(7)).expect("same epoch again");
    assert!(matches!(f.store().set_epoch(Epoch(4), proto::HostId(7)), Err(StoreError::EpochBackwards { .. })));
    let v = f.volume;
    let at = |epoch: u64, sequence: u64| {
        let mut r = record(sequence, write_op(0, 512, sequence));
        r.epoch = Epoch(epoch);
        (v, r)
    };
    let outcome = f.store().commit(&[at(4, 1), at(5, 1), at(7, 2), at(6, 3)]).expect("commit");
    assert_eq!(outcome.applied, vec![(v, Sequence(2))]);
    let stale: Vec<(usize, u64)> = outcome
        .rejected
        .iter()
        .map(|r| match r.error {
            StoreError::StaleEpoch { epoch, .. } => (r.index, epoch.0),
            ref other => panic!("unexpected {other}"),
        })
        .collect();
    // Sequence 1 of epoch 4 is accepted: fencing is per volume (the store-wide epoch set
    // above only says what the newest host element is); sequence 3 of epoch 6 follows a
    // record of epoch 7 on the same volume and is refused.
    assert_eq!(stale, vec![(3, 6)]);
    assert_eq!(f.store().epoch(), Epoch(7), "a newer record raises the epoch");
    assert_eq!(f.store().applied_epoch(v), Epoch(7));
    f.reopen();
    assert_eq!(f.store().epoch(), Epoch(7), "replayed from the log");
    assert_eq!(f.store().applied_epoch(f.volume), Epoch(7));
    f.store().checkpoint().expect("checkpoint");
    f.reopen();
    assert_eq!(f.store().epoch(), Epoch(7), "from the metadata");
    assert_eq!(f.store().applied_epoch(f.volume), Epoch(7));
    f.store().set_epoch(Epoch(9), proto::HostId(7)).expect("raise");
    f.reopen();
    assert_eq!(f.store().epoch(), Epoch(9));
}

#[test]
fn an_epoch_belongs_to_one_host_element_and_the_element_keeps_its_identity() {
    let mut f = Fixture::new("holder", 1 << 20, StoreOptions::default());
    let id = f.store().element_id();
    assert_ne!(id, 0, "an identity is chosen at creation");
    f.store().set_epoch(Epoch(3), proto::HostId(7)).expect("adopt");
    assert!(
        matches!(f.store().set_epoch(Epoch(3), proto::HostId(8)), Err(StoreError::EpochBackwards { .. })),
        "the same epoch of another host element is refused"
    );
    f.reopen();
    assert_eq!((f.store().epoch(), f.store().epoch_holder(), f.store().element_id()), (Epoch(3), proto::HostId(7), id));
    f.store().checkpoint().expect("checkpoint");
    f.reopen();
    assert_eq!((f.store().epoch(), f.store().epoch_holder(), f.store().element_id()), (Epoch(3), proto::HostId(7), id));
}

// ---------------------------------------------------------------------------------------------
// Volumes.
// ---------------------------------------------------------------------------------------------

#[test]
fn a_volume_too_large_for_the_element_is_refused_before_anything_is_written() {
    let dir = TempDir::new("too-large");
    let options = StoreOptions { map_memory_bytes_max: 1 << 30, ..small_options() };
    let store = Store::open(&dir.0, options).expect("open");
    let kept = store.ensure_volume("kept", 1 << 20).expect("a small volume");
    let files = |d: &Path| std::fs::read_dir(d.join("volumes")).expect("volumes dir").count();
    let before = files(&dir.0);
    // 15 TiB: its block map alone would take 45 GiB of memory.
    let specs = vec![("kept".to_string(), 1 << 20, false), ("typo".to_string(), 15u64 << 40, false)];
    let error = store.check_new_volumes(&specs).expect_err("too large").to_string();
    assert!(error.contains("memory"), "{error}");
    let error = store.ensure_volume("typo", 15 << 40).expect_err("too large").to_string();
    assert!(error.contains("memory"), "{error}");
    // Within the memory budget but beyond the disk: refused unless overcommitting.
    let disk = crate::sys_available_bytes(&dir.0).expect("statvfs");
    let beyond = (disk * 2 + (1 << 30)) / BLOCK_BYTES * BLOCK_BYTES;
    let big = StoreOptions { map_memory_bytes_max: u64::MAX, ..options };
    drop(store);
    let store = Store::open(&dir.0, big).expect("reopen");
    let error = store.check_new_volumes(&[("typo".into(), beyond, false)]).expect_err("beyond the disk").to_string();
    assert!(error.contains("--overcommit"), "{error}");
    // A clone of that size shares its snapshot's blocks: its map must fit in memory, its
    // blocks are what it will write.
    store.check_new_volumes(&[("clone".into(), beyond, true)]).expect("a clone counts no disk ahead");
    assert_eq!(files(&dir.0), before, "nothing was created");
    assert_eq!(store.volumes(), vec![("kept".to_string(), 1 << 20)]);
    drop(store);
    let store = Store::open(&dir.0, StoreOptions { overcommit: true, ..big }).expect("reopen");
    store.check_new_volumes(&[("typo".into(), beyond, false)]).expect("overcommitting");
    let _ = kept;
}

#[test]
fn a_store_whose_block_maps_exceed_the_memory_allowed_is_refused_at_open_not_aborted_on() {
    let dir = TempDir::new("maps-too-large");
    let store = Store::open(&dir.0, small_options()).expect("open");
    store.ensure_volume("v", 64 << 20).expect("a volume");
    drop(store);
    // A smaller machine (or a store made before the check): the maps do not fit.
    let tiny = StoreOptions { map_memory_bytes_max: 1 << 10, ..small_options() };
    let error = Store::open(&dir.0, tiny).err().expect("refused").to_string();
    assert!(error.contains("memory"), "{error}");
    Store::open(&dir.0, small_options()).expect("opens where the maps fit");
}

#[test]
fn running_out_of_space_is_told_apart() {
    let full = StoreError::Io {
        operation: "write",
        path: "x".into(),
        source: std::io::Error::from_raw_os_error(libc::ENOSPC),
    };
    let other =
        StoreError::Io { operation: "write", path: "x".into(), source: std::io::Error::from_raw_os_error(libc::EIO) };
    assert!(full.is_no_space());
    assert!(!other.is_no_space());
}

/// A small tmpfs mounted for a test, unmounted (lazily, so a failing test cannot leave it
/// behind busy) and removed when dropped.
struct SmallTmpfs(PathBuf);

impl SmallTmpfs {
    /// `None` where this process may not mount (not root, or a sandbox).
    fn mount(name: &str, size: &str) -> Option<SmallTmpfs> {
        let dir = TempDir::new(name);
        fs::create_dir_all(&dir.0).expect("mount point");
        let path = std::mem::replace(&mut std::mem::ManuallyDrop::new(dir).0, PathBuf::new());
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .stderr(std::process::Stdio::null())
            .status();
        if !status.is_ok_and(|s| s.success()) {
            let _ = fs::remove_dir(&path);
            return None;
        }
        Some(SmallTmpfs(path))
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = fs::remove_dir(&self.0);
    }
}

/// Tests whose body could die of a signal (a `SIGBUS`: a store into a page that a full file
/// system cannot give) run that body in a child: this test binary run again for that one test,
/// with this variable naming the directory the parent prepared (on a tmpfs it mounted). A
/// signal then fails the test by its name, instead of ending the whole binary, and the parent
/// still unmounts.
const SIGNAL_CHILD_ENV: &str = "STARFISH_STORE_TEST_SIGNAL_CHILD_DIR";

/// This test binary run again for test `test` (its whole name) alone, output not captured: the
/// child processes of the signal and kill -9 tests.
fn test_in_child(test: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    command
}

/// Run test `test` (its whole name) again in a child with `dir`; fail if the child fails or
/// dies of a signal, with what it said.
fn run_in_signal_child(test: &str, dir: &Path) {
    use std::os::unix::process::ExitStatusExt;
    let output = test_in_child(test)
        .env(SIGNAL_CHILD_ENV, dir)
        .stdin(Stdio::null())
        .output()
        .expect("run the test's body in a child");
    let said = String::from_utf8_lossy(&output.stderr);
    if let Some(signal) = output.status.signal() {
        let what =
            if signal == libc::SIGBUS { " (SIGBUS: a store into a page the file system could not give)" } else { "" };
        panic!("the test's body died of signal {signal}{what}; it said:\n{said}");
    }
    assert!(output.status.success(), "the test's body failed in its child ({}):\n{said}", output.status);
    // A child that ran no test (a wrong name) would pass too. (The harness prints the test's
    // name on the line its output starts.)
    let done = format!("{SIGNAL_CHILD_DONE} {test}");
    assert!(String::from_utf8_lossy(&output.stdout).contains(&done), "the child did not run {test}");
}

/// What a signal child prints once its body returned.
const SIGNAL_CHILD_DONE: &str = "signal child done:";

/// In a signal child, run `body` with the parent's directory and say so; `false` in the parent.
fn ran_as_signal_child(test: &str, body: fn(&Path)) -> bool {
    let Some(dir) = std::env::var_os(SIGNAL_CHILD_ENV) else {
        return false;
    };
    body(Path::new(&dir));
    println!("{SIGNAL_CHILD_DONE} {test}");
    true
}

/// A mapped write skips making pages present where it made them present before; a range the
/// store punches is made present again. On a full tmpfs, a write into a page punched and taken
/// by another file then fails for space, where a plain store into it would be a `SIGBUS`
/// (without `MappedWrites::punched`, this test's body dies so, in its child).
#[test]
fn a_mapped_write_into_a_punched_page_of_a_full_file_system_fails_for_space() {
    const TEST: &str = "tests::a_mapped_write_into_a_punched_page_of_a_full_file_system_fails_for_space";
    if ran_as_signal_child(TEST, mapped_write_into_a_punched_page) {
        return;
    }
    let Some(small) = SmallTmpfs::mount("punched-full", "1m") else {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    };
    run_in_signal_child(TEST, &small.0);
}

/// The body of the test above, on the tmpfs `small` of 1 MiB.
fn mapped_write_into_a_punched_page(small: &Path) {
    let open = |name: &str| {
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(small.join(name))
            .expect("create")
    };
    let data = open("data");
    let size = 4 << 20;
    data.set_len(size).expect("size");
    let mut writes = crate::sys::MappedWrites::new(true);
    writes.write(&data, size, &[&[1u8; 4096]], 0).expect("first write");
    writes.write(&data, size, &[&[2u8; 4096]], 0).expect("second write");
    assert_eq!(writes.populate_calls(), 1);
    // Fill the file system, then punch the page as the store's reclaim does, and fill again.
    let filler = open("filler");
    let fill = |filler: &fs::File| {
        let chunk = [9u8; 4096];
        let mut at = filler.metadata().expect("stat").len();
        while filler.write_all_at(&chunk, at).is_ok() {
            at += 4096;
        }
    };
    fill(&filler);
    writes.punched(0, 4096);
    crate::sys::punch_hole(&data, 0, 4096).expect("punch");
    fill(&filler);
    let error = writes.write(&data, size, &[&[3u8; 4096]], 0).expect_err("no room for the page");
    assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
    // Room again: the write goes through.
    drop(filler);
    fs::remove_file(small.join("filler")).expect("remove filler");
    writes.write(&data, size, &[&[4u8; 4096]], 0).expect("with room");
    let mut back = [0u8; 4096];
    data.read_exact_at(&mut back, 0).expect("read");
    assert_eq!(back, [4u8; 4096]);
}

/// Data files in memory are written through a mapping (`sys::MappedWrites`). When their file
/// system is full, an apply fails for space, the store says so, and the process lives (a store
/// into a page tmpfs cannot allocate is a `SIGBUS`: the body runs in a child); once room is
/// made, reopening replays the log and loses nothing acknowledged. The volumes are on a small
/// tmpfs of their own, the log on a larger one, so the log has room when the data files have
/// none.
#[test]
fn an_apply_to_a_full_file_system_in_memory_fails_for_space_and_loses_nothing() {
    const TEST: &str = "tests::an_apply_to_a_full_file_system_in_memory_fails_for_space_and_loses_nothing";
    if ran_as_signal_child(TEST, apply_to_a_full_file_system_in_memory) {
        return;
    }
    let memory = PathBuf::from("/dev/shm");
    if !memory.is_dir() || crate::sys::non_blocking_reads(&memory).ok() != Some(crate::sys::NonBlockingReads::Always) {
        eprintln!("skipped: no tmpfs at /dev/shm");
        return;
    }
    let Some(small) = SmallTmpfs::mount("full-volumes", "4m") else {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    let mut dir = TempDir::new("full-volumes-store");
    dir.0 = memory.join(dir.0.file_name().expect("a name"));
    fs::create_dir_all(&dir.0).expect("store directory");
    let volumes = small.0.join("volumes");
    fs::create_dir_all(&volumes).expect("volumes directory");
    std::os::unix::fs::symlink(&volumes, dir.0.join(crate::store::VOLUMES_DIR)).expect("link");
    run_in_signal_child(TEST, &dir.0);
}

/// The body of the test above: the store's directory `dir` (in memory), whose volumes are a
/// link into a tmpfs of 4 MiB of their own.
fn apply_to_a_full_file_system_in_memory(dir: &Path) {
    let volumes = fs::read_link(dir.join(crate::store::VOLUMES_DIR)).expect("the volumes' link");
    let small = volumes.parent().expect("the small tmpfs");
    // The default checkpoint size: 4 MiB of writes seal no segment, so no checkpoint writes a
    // block map into the full file system before the apply meets it.
    let options = StoreOptions { overcommit: true, ..StoreOptions::default() };
    let store = Store::open(dir, options).expect("open");
    assert!(store.in_memory());
    let volume = store.ensure_volume("vol", 64 << 20).expect("create");
    // Leave the volumes' file system about 1 MiB.
    let free = crate::sys::available_bytes(&volumes).expect("statvfs");
    let filler = small.join("filler");
    fs::write(&filler, vec![0xffu8; (free - (1 << 20)) as usize]).expect("filler");
    let mut written = Vec::new();
    let mut failure = None;
    for i in 0..16u64 {
        let op = write_op(i * (256 << 10), 256 << 10, 40 + i);
        match store.commit(&[(volume, record(i + 1, op))]) {
            Ok(_) => written.push(i),
            Err(error) => {
                failure = Some(error);
                break;
            }
        }
    }
    let failure = failure.expect("4 MiB of writes into 1 MiB of room fail");
    assert!(failure.is_no_space(), "{failure}");
    assert!(failure.to_string().contains("write volume data"), "the apply failed: {failure}");
    assert!(store.failed_for_space(), "the store says it failed for space");
    assert!(written.len() >= 2, "the writes that had room were taken: {written:?}");
    drop(store);
    fs::remove_file(&filler).expect("free the room");
    let store = Store::open(dir, options).expect("reopen once there is room");
    let volume = store.volume("vol").expect("the volume");
    for &i in &written {
        let (_, data) = store.read_checked(volume, i * (256 << 10), 256 << 10).expect("read");
        assert_eq!(data.data, pattern(40 + i, 256 << 10), "write {i} survived");
    }
}

#[test]
fn a_grown_volume_keeps_its_data_reads_zeroes_beyond_and_survives_reopening_and_an_interrupted_grow() {
    // Sizes that end inside a block map chunk, so the last chunk's image is partial.
    let old_bytes = (MAP_CHUNK_BLOCKS + 3) * BLOCK_BYTES;
    let mut f = Fixture::new("grow", old_bytes, small_options());
    f.commit(&[write_op(0, 8192, 1), write_op(old_bytes - 6000, 6000, 2)]);
    f.store().checkpoint().expect("checkpoint");
    f.commit(&[write_op(old_bytes - 4096, 4096, 3)]);
    let grow = |f: &mut Fixture, size_bytes: u64| {
        let volume = f.volume;
        f.store().resize_volume(volume, size_bytes).expect("grow");
        f.size_bytes = size_bytes;
        f.model.grow(size_bytes);
    };
    let new_bytes = (3 * MAP_CHUNK_BLOCKS + 7) * BLOCK_BYTES;
    grow(&mut f, new_bytes);
    assert_eq!(f.store().volumes(), vec![("vol".to_string(), new_bytes)]);
    f.check();
    // Writes across the old end and at the new end; a range past it is refused.
    f.commit(&[write_op(old_bytes - 2048, 8192, 4), write_op(new_bytes - 4096, 4096, 5)]);
    f.check();
    let past = f.store().commit(&[(f.volume, record(f.applied + 1, write_op(new_bytes, 4096, 6)))]).expect("commit");
    assert!(matches!(past.rejected[0].error, StoreError::OutOfRange { .. }), "{:?}", past.rejected);
    // Shrinking is refused, the same size does nothing.
    let error = f.store().resize_volume(f.volume, old_bytes).expect_err("no shrink");
    assert!(matches!(error, StoreError::VolumeSizeMismatch { .. }), "{error}");
    f.store().resize_volume(f.volume, new_bytes).expect("same size");
    // The log replays onto the grown map; then the map is loaded from a checkpoint.
    f.reopen();
    f.check();
    f.store().checkpoint().expect("checkpoint");
    f.reopen();
    f.check();

    // A crash after the metadata (the commit point) and before the files: the map file's
    // header and the data file still have the old size. Opening finishes the grow.
    let map_path = f.dir.0.join("volumes").join("0.map");
    let data_path = f.dir.0.join("volumes").join("0.data");
    let header = fs::read(&map_path).expect("map file")[..4096].to_vec();
    let third_bytes = new_bytes + 5 * MAP_CHUNK_BLOCKS * BLOCK_BYTES;
    grow(&mut f, third_bytes);
    f.commit(&[write_op(third_bytes - 8192, 8192, 7)]);
    f.close();
    std::os::unix::fs::FileExt::write_all_at(
        &fs::OpenOptions::new().write(true).open(&map_path).expect("map"),
        &header,
        0,
    )
    .expect("old header");
    fs::OpenOptions::new().write(true).open(&data_path).expect("data").set_len(new_bytes).expect("old length");
    f.reopen();
    assert_eq!(f.store().volumes(), vec![("vol".to_string(), third_bytes)]);
    assert_eq!(fs::metadata(&data_path).expect("data").len(), third_bytes);
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn a_hello_naming_a_volume_larger_grows_it_if_the_growth_fits() {
    let dir = TempDir::new("grow-hello");
    let store = Store::open(&dir.0, StoreOptions::default()).expect("open");
    let a = store.ensure_volume("a", 1 << 20).expect("create");
    store.commit(&[(a, record(1, write_op(0, 4096, 1)))]).expect("commit");
    store.check_new_volumes(&[("a".into(), 4 << 20, false)]).expect("the growth fits");
    let error = store.check_new_volumes(&[("a".into(), 512 << 10, false)]).expect_err("smaller");
    assert!(matches!(error, StoreError::VolumeSizeMismatch { .. }), "{error}");
    assert_eq!(store.ensure_volume("a", 4 << 20).expect("grown"), a);
    assert_eq!(store.volumes(), vec![("a".to_string(), 4 << 20)]);
    assert_eq!(store.read(a, 0, 4096).expect("read").1, Bytes::from(pattern(1, 4096)));
    assert!(store.read(a, (4 << 20) - 4096, 4096).expect("read").1.iter().all(|&b| b == 0));
    drop(store);
    // 4 MiB of volume has 12 KiB of map; 64 MiB would have 192 KiB.
    let small = StoreOptions { map_memory_bytes_max: 64 << 10, ..StoreOptions::default() };
    let store = Store::open(&dir.0, small).expect("reopen with a small map memory bound");
    let a = store.volume("a").expect("a");
    let error = store.resize_volume(a, 64 << 20).expect_err("the map would not fit");
    assert!(matches!(error, StoreError::InvalidVolume { .. }), "{error}");
    assert_eq!(store.volumes(), vec![("a".to_string(), 4 << 20)], "a refused grow changes nothing");
    assert_eq!(store.read(a, 0, 4096).expect("read").1, Bytes::from(pattern(1, 4096)));
}

#[test]
fn volumes_are_created_once_and_survive_reopening() {
    let dir = TempDir::new("volumes");
    let store = Store::open(&dir.0, StoreOptions::default()).expect("open");
    let a = store.ensure_volume("a", 1 << 20).expect("create a");
    let b = store.ensure_volume("b with spaces/and slashes", 2 << 20).expect("create b");
    assert_eq!(store.ensure_volume("a", 1 << 20).expect("existing"), a);
    assert_ne!(a, b);
    let error = store.ensure_volume("b with spaces/and slashes", 1 << 20).expect_err("volumes do not shrink");
    assert_eq!(error.to_string(), "volume \"b with spaces/and slashes\" exists with 2097152 bytes, not 1048576");
    for (name, size) in [("", 4096), ("c", 0), ("c", 1000), ("c", 4096 + 512), (&"x".repeat(256)[..], 4096)] {
        assert!(matches!(store.ensure_volume(name, size), Err(StoreError::InvalidVolume { .. })), "{name:?} {size}");
    }
    // Two volumes in one batch.
    let outcome = store
        .commit(&[
            (a, record(1, write_op(0, 4096, 1))),
            (b, record(1, write_op(0, 4096, 2))),
            (a, record(2, trim_op(0, 4096))),
        ])
        .expect("commit");
    assert_eq!(outcome.applied, vec![(a, Sequence(2)), (b, Sequence(1))]);
    drop(store);
    let store = Store::open(&dir.0, StoreOptions::default()).expect("reopen");
    assert_eq!(store.volumes(), vec![("a".to_string(), 1 << 20), ("b with spaces/and slashes".to_string(), 2 << 20)]);
    let b = store.volume("b with spaces/and slashes").expect("b");
    assert_eq!(store.read(b, 0, 4096).expect("read").1, Bytes::from(pattern(2, 4096)));
    assert_eq!(store.applied_sequence(store.volume("a").expect("a")), Sequence(2));
    assert!(matches!(Store::open(&dir.0, StoreOptions::default()), Err(StoreError::Locked { .. })));
}

#[test]
fn a_foreign_directory_is_not_taken_over() {
    let dir = TempDir::new("foreign");
    fs::create_dir_all(&dir.0).expect("mkdir");
    fs::write(dir.0.join("precious.txt"), "data").expect("write");
    assert!(matches!(Store::open(&dir.0, StoreOptions::default()), Err(StoreError::NotAStore { .. })));
}

// ---------------------------------------------------------------------------------------------
// Recovery.
// ---------------------------------------------------------------------------------------------

#[test]
fn reopening_returns_the_same_data() {
    let mut f = Fixture::new("reopen", 1 << 20, small_options());
    for i in 0..60u64 {
        let offset = (i * 7919 % 250) * BLOCK_BYTES + (i % 8) * 512;
        match i % 5 {
            3 => f.commit(&[trim_op(offset, 3 * 4096)]),
            4 => f.commit(&[zeroes_op(offset, 1536), write_op(offset + 8192, 512, i)]),
            _ => f.commit(&[write_op(offset, 4096 * (1 + i as usize % 3), i)]),
        };
        if i % 20 == 19 {
            f.reopen();
            f.check();
        }
    }
    f.check();
    let digest = f.store().verify(f.volume).expect("verify");
    f.reopen();
    assert_eq!(f.store().verify(f.volume).expect("verify"), digest);
}

/// Commits four records, then `last` as its own batch, into blocks never written before (so
/// the data file, where it was already applied, still reads as the older state once the record
/// is gone). Returns the fixture (closed, its model without `last`), the segment, its bytes
/// and where the last batch starts.
/// The sync mark written after each commit at the end of the log (a batch header of no
/// records), which the next batch overwrites.
const SYNC_MARK_BYTES: u64 = log::BATCH_HEADER_BYTES as u64;

/// Options for tests that find the end of the log by the live segment's length (to cut or
/// damage its tail): segments grow to the end of each batch, no zeroes after it.
fn exact_growth() -> StoreOptions {
    StoreOptions { log_grow_step_bytes: 0, ..StoreOptions::default() }
}

/// Where the next batch goes: the end of the live segment's file, less its sync mark.
fn log_end(segment: &Path) -> u64 {
    fs::metadata(segment).expect("stat").len() - SYNC_MARK_BYTES
}

fn store_with_last_batch(name: &str, last: Op) -> (Fixture, PathBuf, Vec<u8>, u64) {
    let mut f = Fixture::new(name, 16 * BLOCK_BYTES, exact_growth());
    f.commit(&[write_op(0, 4096, 1), write_op(512, 1024, 2)]);
    f.commit(&[trim_op(1024, 512), write_op(BLOCK_BYTES, 4096, 3)]);
    let segment = f.live_segment();
    let last_batch_start = log_end(&segment);
    let before = f.model.clone();
    f.commit(&[last]);
    f.close();
    f.model = before;
    f.applied -= 1;
    let bytes = fs::read(&segment).expect("read segment");
    (f, segment, bytes, last_batch_start)
}

/// The last batch, cut at each of `cuts`, is discarded and the rest recovered intact.
fn check_cuts(f: &mut Fixture, segment: &Path, bytes: &[u8], start: u64, cuts: impl Iterator<Item = u64>) {
    for cut in cuts {
        fs::write(segment, &bytes[..cut as usize]).expect("write segment");
        f.reopen();
        f.check();
        assert_eq!(fs::metadata(segment).expect("stat").len(), start, "cut at {cut}: tail truncated");
        f.close();
    }
}

#[test]
fn a_torn_tail_is_cut_off_at_every_byte() {
    // A small last record (a trim of whole blocks): cut at every byte.
    // A cut lands before the sync mark (written after the fdatasync returned): gone too.
    let (mut f, segment, bytes, start) = store_with_last_batch("torn-trim", trim_op(8 * BLOCK_BYTES, 2 * BLOCK_BYTES));
    let end = bytes.len() as u64 - SYNC_MARK_BYTES;
    check_cuts(&mut f, &segment, &bytes, start, start..end);
    // A write (one whole block carried): every byte of the headers and the checksum table,
    // then every 61st byte of the block.
    let (mut f, segment, bytes, start) = store_with_last_batch("torn-write", write_op(5 * BLOCK_BYTES + 512, 1024, 4));
    let headers = start + 40 + 8 + 44 + 4;
    let end = bytes.len() as u64 - SYNC_MARK_BYTES;
    check_cuts(&mut f, &segment, &bytes, start, (start..headers).chain((headers..end).step_by(61)));
    // Zeroes instead of the last batch (the file grew but the data never landed).
    let mut zeroed = bytes.clone();
    zeroed[start as usize..].fill(0);
    fs::write(&segment, &zeroed).expect("write segment");
    f.reopen();
    f.check();
}

#[test]
fn a_damaged_last_batch_is_cut_off_unless_its_sync_mark_proves_it_was_acknowledged() {
    let (mut f, segment, bytes, start) = store_with_last_batch("flip", write_op(5 * BLOCK_BYTES + 512, 1024, 4));
    let end = bytes.len() as u64 - SYNC_MARK_BYTES;
    // Every byte of the headers, then every 97th byte of the block data.
    let positions = (start..start + 100).chain((start + 100..end).step_by(97));
    for position in positions {
        let mut damaged = bytes.clone();
        damaged[position as usize] ^= 0x20;
        // Without the sync mark (a crash before the fdatasync returned): a torn tail.
        fs::write(&segment, &damaged[..end as usize]).expect("write segment");
        f.reopen();
        f.check();
        f.close();
        // With it: the batch was synced, so acknowledged; damage, never discarded silently.
        fs::write(&segment, &damaged).expect("write segment");
        let error = Store::open(&f.dir.0, f.options).err().unwrap_or_else(|| panic!("byte {position}: opened"));
        let message = error.to_string();
        assert!(
            matches!(error, StoreError::CorruptLog { offset, .. } if offset == start),
            "byte {position}: {message}"
        );
        assert!(message.contains("acknowledged") && message.contains("element repair"), "{message}");
    }
}

#[test]
fn repair_keeps_what_is_intact_and_marks_the_volumes_for_a_repair() {
    let (mut f, segment, bytes, start) = store_with_last_batch("repair", write_op(5 * BLOCK_BYTES + 512, 1024, 4));
    let mut damaged = bytes.clone();
    damaged[start as usize + 200] ^= 0x08;
    fs::write(&segment, &damaged).expect("write segment");
    assert!(Store::open(&f.dir.0, f.options).is_err());
    let report = Store::repair(&f.dir.0, f.options).expect("repair");

    assert_eq!(report.volumes_to_repair, vec!["vol".to_string()], "{report:?}");
    assert!(report.actions[0].starts_with("truncated log segment"), "{report:?}");
    f.reopen();
    // The intact prefix is kept: the four records before the damaged batch.
    assert_eq!(f.store().applied_sequence(f.volume), Sequence(4));
    let state = f.store().copy_state(f.volume).expect("a repair is pending");
    assert!(state.verify && state.is_pending_repair(), "{state:?}");
    // Its log was cut: its blocks may hold what the dropped records wrote, so it is no copy
    // source.
    assert!(!state.intact, "{state:?}");
    // Nothing more to do the second time.
    f.close();
    let again = Store::repair(&f.dir.0, f.options).expect("repair again");
    assert!(again.actions.is_empty() && again.volumes_to_repair.is_empty(), "{again:?}");
}

#[test]
fn damage_in_the_middle_of_the_log_refuses_to_open() {
    let mut f = Fixture::new("middle", 16 * BLOCK_BYTES, exact_growth());
    f.commit(&[write_op(0, 4096, 1)]);
    let segment = f.live_segment();
    let second = log_end(&segment);
    f.commit(&[write_op(4096, 4096, 2)]);
    let third = log_end(&segment);
    f.commit(&[write_op(8192, 4096, 3)]);
    f.close();
    let bytes = fs::read(&segment).expect("read");
    // (byte flipped, what)
    for (position, what) in [(second, "batch magic"), (second + 20, "batch header"), (third - 100, "block data")] {
        let mut damaged = bytes.clone();
        damaged[position as usize] ^= 0x01;
        fs::write(&segment, &damaged).expect("write");
        let error = Store::open(&f.dir.0, f.options).err().unwrap_or_else(|| panic!("{what}: opened"));
        let message = error.to_string();
        assert!(matches!(error, StoreError::CorruptLog { offset, .. } if offset == second), "{what}: {message}");
        assert!(message.contains("not a torn tail"), "{what}: {message}");
        assert!(message.contains(&segment.display().to_string()), "{what}: {message}");
    }
    fs::write(&segment, &bytes).expect("restore");
    f.reopen();
    assert_eq!(f.store().applied_sequence(f.volume), Sequence(3));
}

#[test]
fn a_segment_is_sealed_between_three_quarters_of_the_checkpoint_size_and_all_of_it() {
    let options = StoreOptions { checkpoint_log_bytes: 64 << 20, ..StoreOptions::default() };
    let (full, least) = (options.checkpoint_log_bytes, options.checkpoint_log_bytes / 4 * 3);
    let draws = |element: u64| (0..1000u64).map(move |s| crate::store::seal_bytes(&options, element, s));
    for element in [1, 2, 3, u64::MAX, 0x5eed] {
        let sizes: Vec<u64> = draws(element).collect();
        assert!(sizes.iter().all(|&b| (least..=full).contains(&b) && b % BLOCK_BYTES == 0), "{element}");
        assert_eq!(sizes, draws(element).collect::<Vec<_>>(), "the same draw every time");
        // Spread over the whole range, not stuck at one end.
        let (low, high) = (sizes.iter().min().expect("some"), sizes.iter().max().expect("some"));
        assert!(*low < least + full / 32 && *high > full - full / 32, "{element}: {low}..{high}");
    }
    // Two elements draw apart: on average by about a twelfth of the size (uniform over a quarter).
    let apart: u64 = draws(1).zip(draws(2)).map(|(a, b)| a.abs_diff(b)).sum::<u64>() / 1000;
    assert!(apart > full / 16 && apart < full / 8, "{apart}");
    // The smallest accepted size still seals between the same bounds.
    let small = small_options();
    for s in 0..100 {
        let b = crate::store::seal_bytes(&small, 7, s);
        assert!((CHECKPOINT_LOG_BYTES_MIN / 4 * 3..=CHECKPOINT_LOG_BYTES_MIN).contains(&b), "{b}");
    }
}

#[test]
fn replicas_fed_the_same_writes_do_not_checkpoint_in_step() {
    // Two stores (two elements, each with its own identity) commit the same small writes;
    // note the commits after which each opened a new log segment.
    let mut fixtures =
        [Fixture::new("stagger-a", 1 << 20, small_options()), Fixture::new("stagger-b", 1 << 20, small_options())];
    assert_ne!(fixtures[0].store().element_id(), fixtures[1].store().element_id());
    let mut seals = [Vec::new(), Vec::new()];
    for i in 0..400u64 {
        for (f, seals) in fixtures.iter_mut().zip(&mut seals) {
            let before = *f.store().log_segments().last().expect("a live segment");
            f.commit(&[write_op((i % 256) * BLOCK_BYTES, 4096, i)]);
            if *f.store().log_segments().last().expect("a live segment") != before {
                seals.push(i);
            }
        }
    }
    // About 25 seals each (a 4 KiB record every commit, a seal every 48-64 KiB of log) ...
    for seals in &seals {
        assert!((20..=35).contains(&seals.len()), "{seals:?}");
        for gap in seals.windows(2).map(|w| w[1] - w[0]) {
            assert!((11..=16).contains(&gap), "a seal every 48-64 KiB: {seals:?}");
        }
    }
    // ... at different commits: with one fixed size they would be the same list.
    assert_ne!(seals[0], seals[1]);
    for f in &mut fixtures {
        f.reopen();
        f.check();
    }
}

#[test]
fn checkpoints_rotate_segments_and_keep_a_bounded_replay_log() {
    let options = small_options(); // checkpoint every 64 KiB, keep 256 KiB
    let mut f = Fixture::new("replay-log", 1 << 20, options);
    for i in 0..200u64 {
        f.commit(&[write_op((i % 256) * BLOCK_BYTES, 4096, i)]);
    }
    let segments = f.store().log_segments();
    assert!(segments.len() >= 4, "segments {segments:?}");
    let on_disk = log::list_segments(&f.dir.0).expect("list");
    assert_eq!(on_disk, segments, "deleted segments are gone from disk");
    let closed: u64 = segments[..segments.len() - 1]
        .iter()
        .map(|id| fs::metadata(log::segment_path(&f.dir.0, *id)).expect("stat").len())
        .sum();
    assert!(closed <= options.replay_log_bytes, "replay log of {closed} bytes");

    let check_records = |store: &Store, after: u64, max_bytes: u64| -> Result<u64, StoreError> {
        let volume = store.volume("vol").expect("volume");
        let records = store.log_records(volume, Sequence(after), max_bytes)?;
        for (i, r) in records.iter().enumerate() {
            let sequence = after + 1 + i as u64;
            assert_eq!(r.sequence, Sequence(sequence));
            assert_eq!(r.op, write_op(((sequence - 1) % 256) * BLOCK_BYTES, 4096, sequence - 1));
        }
        Ok(records.len() as u64)
    };
    assert_eq!(check_records(f.store(), 199, 1 << 20).expect("recent"), 1);
    assert_eq!(check_records(f.store(), 200, 1 << 20).expect("nothing newer"), 0);
    assert_eq!(check_records(f.store(), 180, 1 << 20).expect("recent"), 20);
    assert_eq!(check_records(f.store(), 180, 10_000).expect("bounded"), 2);
    assert_eq!(check_records(f.store(), 180, 1).expect("at least one"), 1);
    let error = check_records(f.store(), 0, 1 << 20).expect_err("trimmed away");
    let StoreError::NotInReplayLog { oldest: Some(oldest), .. } = error else { panic!("{error}") };
    let oldest = oldest.0;
    // Three closed segments fit the budget (their files are a little over 64 KiB each), each
    // sealed after 48-64 KiB of log: at least 33 records of about 4 KiB are held.
    assert!(oldest > 1 && oldest < 170, "oldest held {oldest}");
    assert_eq!(check_records(f.store(), oldest - 1, 1 << 30).expect("from the oldest"), 200 - (oldest - 1));

    f.reopen();
    f.check();
    assert_eq!(f.store().log_segments(), segments);
    assert_eq!(check_records(f.store(), oldest - 1, 1 << 30).expect("after reopen"), 200 - (oldest - 1));
}

#[test]
fn unsynced_data_file_writes_lost_in_a_power_failure_are_replayed() {
    // After a power failure, every block written since the last checkpoint (the data files are
    // synced only then) may hold anything: old content, new content, a mix. Replay must
    // rebuild them from the log alone.
    let mut f = Fixture::new("power-loss", 1 << 20, StoreOptions::default());
    let b = BLOCK_BYTES;
    f.commit(&[write_op(0, 16 * 4096, 1), write_op(40 * b, 4096, 2), write_op(60 * b, 2 * 4096, 3)]);
    f.store().checkpoint().expect("checkpoint");
    let after_checkpoint = [
        write_op(512, 1024, 4),
        trim_op(4 * b + 512, 2 * 4096),
        write_op(40 * b + 1024, 100, 5),
        zeroes_op(60 * b, 4096 + 512),
        write_op(100 * b + 512, 3 * 4096, 6),
        write_op(100 * b + 2048, 512, 7),
    ];
    let mut touched = Vec::new();
    for op in &after_checkpoint {
        let g = log::Geometry::of(op.offset_bytes(), op.length_bytes()).expect("non-empty");
        touched.extend(g.first..=g.last);
        f.commit(std::slice::from_ref(op));
    }
    f.close();
    let data = fs::OpenOptions::new().write(true).open(f.dir.0.join("volumes/0.data")).expect("open data");
    for (i, block) in touched.iter().enumerate() {
        data.write_all_at(&pattern(1000 + i as u64, 4096), block * BLOCK_BYTES).expect("garble");
    }
    drop(data);
    f.reopen();
    f.check();
    assert_eq!(f.store().verify(f.volume).expect("verify").blocks_corrupt, 0);
}

#[test]
fn a_crash_between_block_map_writes_and_the_commit_keeps_the_old_checkpoint() {
    let mut f = Fixture::new("checkpoint-crash", 1 << 20, StoreOptions::default());
    f.commit(&[write_op(0, 8192, 1), write_op(100 * BLOCK_BYTES, 4096, 2)]);
    f.store().checkpoint().expect("first checkpoint");
    f.commit(&[write_op(0, 4096, 3), trim_op(100 * BLOCK_BYTES, 4096), write_op(200 * BLOCK_BYTES, 4096, 4)]);
    let meta = fs::read(f.dir.0.join("meta")).expect("read meta");
    let model = f.model.clone();
    f.store().checkpoint().expect("second checkpoint");
    // The second checkpoint wrote its block map images and the next segment, but "crashed"
    // before its metadata rename.
    f.close();
    fs::write(f.dir.0.join("meta"), &meta).expect("restore meta");
    f.reopen();
    f.model = model;
    f.check();
    // The uncommitted images were erased: a checkpoint reusing their generation number
    // without touching those chunks must not bring them back.
    f.commit(&[write_op(220 * BLOCK_BYTES, 4096, 5)]);
    f.store().checkpoint().expect("checkpoint again");
    f.reopen();
    f.check();
}

#[test]
fn a_damaged_block_map_refuses_to_open() {
    let mut f = Fixture::new("map-damage", 1 << 20, StoreOptions::default());
    f.commit(&[write_op(0, 4096, 1)]);
    f.store().checkpoint().expect("checkpoint");
    f.close();
    let map = f.dir.0.join("volumes/0.map");
    let mut bytes = fs::read(&map).expect("read map");
    bytes[4096 + 16] ^= 1; // first entry of chunk 0, slot 0
    fs::write(&map, &bytes).expect("write map");
    let error = Store::open(&f.dir.0, f.options).err().expect("refused");
    assert!(matches!(error, StoreError::CorruptBlockMap { .. }), "{error}");
    // Repair keeps the volume's position and log, and has it rebuilt from a peer.
    let report = Store::repair(&f.dir.0, f.options).expect("repair");
    assert_eq!(report.volumes_to_repair, vec!["vol".to_string()], "{report:?}");
    f.reopen();
    assert_eq!(f.store().applied_sequence(f.volume), Sequence(1));
    assert!(f.store().copy_state(f.volume).is_some_and(|s| s.is_pending_repair()));
}

#[test]
fn a_damaged_replay_log_segment_only_costs_history() {
    let mut f = Fixture::new("closed-damage", 1 << 20, small_options());
    for i in 0..100u64 {
        f.commit(&[write_op((i % 256) * BLOCK_BYTES, 4096, i)]);
    }
    // Every sealed segment's checkpoint done, so that the damaged one is history only: a
    // segment sealed last may still wait for its background checkpoint, and then recovery
    // needs it, and rightly refuses to skip it (2 of 40 runs on tmpfs, where commits are fast).
    f.store().checkpoint().expect("checkpoint");
    let segments = f.store().log_segments();
    assert!(segments.len() >= 3);
    f.close();
    let damaged = log::segment_path(&f.dir.0, segments[1]);
    let mut bytes = fs::read(&damaged).expect("read");
    bytes[100] ^= 1;
    fs::write(&damaged, &bytes).expect("write");
    f.reopen();
    f.check();
    assert_eq!(f.store().log_segments(), segments[2..].to_vec());
    assert!(matches!(f.store().log_records(f.volume, Sequence(1), 1 << 20), Err(StoreError::NotInReplayLog { .. })));
}

#[test]
fn a_damaged_data_block_is_reported_never_returned() {
    let mut f = Fixture::new("block-damage", 1 << 20, StoreOptions::default());
    f.commit(&[write_op(0, 16 * 4096, 1)]);
    let before = f.store().verify(f.volume).expect("verify");
    assert_eq!((before.blocks_corrupt, before.blocks_allocated, before.blocks_total), (0, 16, 256));
    let data_path = f.dir.0.join("volumes/0.data");
    let file = fs::OpenOptions::new().write(true).open(&data_path).expect("open data");
    file.write_all_at(b"rot", 7 * BLOCK_BYTES + 100).expect("damage");
    let error = f.store().read(f.volume, 6 * BLOCK_BYTES, 3 * 4096).expect_err("damaged");
    assert!(matches!(error, StoreError::BlockChecksum { block: 7, .. }), "{error}");
    let message = error.to_string();
    assert!(message.contains("block 7") && message.contains("\"vol\""), "{message}");
    assert!(f.store().read(f.volume, 8 * BLOCK_BYTES, 4096).is_ok(), "other blocks still read");
    // A partial write into the damaged block cannot be merged: rejected, nothing changes.
    let outcome = f.store().commit(&[(f.volume, record(2, write_op(7 * BLOCK_BYTES, 512, 2)))]).expect("commit");
    assert!(matches!(outcome.rejected[0].error, StoreError::BlockChecksum { block: 7, .. }));
    assert_eq!(f.store().applied_sequence(f.volume), Sequence(1));
    let after = f.store().verify(f.volume).expect("verify");
    assert_eq!((after.blocks_corrupt, after.first_corrupt_block), (1, Some(7)));
    assert_ne!(after.content_digest, before.content_digest);
    // A whole-block write repairs it.
    f.commit(&[write_op(7 * BLOCK_BYTES, 4096, 3)]);
    f.check();
}

#[test]
fn digests_depend_on_content_only() {
    // Same content through different histories (written zeroes vs never written, trims).
    let mut a = Fixture::new("digest-a", 1 << 20, StoreOptions::default());
    let mut b = Fixture::new("digest-b", 1 << 20, StoreOptions::default());
    a.commit(&[write_op(0, 8192, 1), Op::write(8192, Bytes::from(vec![0; 4096]))]);
    b.commit(&[write_op(0, 4096, 1), write_op(4096, 4096, 9)]);
    b.commit(&[Op::write(4096, Bytes::from(pattern(1, 8192)[4096..].to_vec()))]);
    let (da, db) = (a.store().verify(a.volume).expect("a"), b.store().verify(b.volume).expect("b"));
    assert_eq!(da.content_digest, db.content_digest);
    assert_ne!(da.blocks_allocated, db.blocks_allocated);
    b.commit(&[write_op(100 * BLOCK_BYTES, 512, 5)]);
    assert_ne!(b.store().verify(b.volume).expect("b").content_digest, da.content_digest);
}

#[test]
fn reads_never_see_half_an_apply() {
    // Every commit rewrites all 64 blocks with one byte value; a read must see one value.
    let mut f = Fixture::new("concurrent", 64 * BLOCK_BYTES, StoreOptions::default());
    let store = Arc::new(f.store.take().expect("open"));
    let volume = f.volume;
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || {
                let mut reads = 0;
                while !done.load(Ordering::Relaxed) {
                    let (applied, data) = store.read(volume, 0, 64 * 4096).expect("read");
                    let expected = (applied.0 % 251) as u8;
                    assert!(data.iter().all(|b| *b == expected), "read at {applied} saw a mix");
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for sequence in 1..=150u64 {
        let data = Bytes::from(vec![(sequence % 251) as u8; 64 * 4096]);
        let r = record(sequence, Op::write(0, data));
        store.commit(&[(volume, r)]).expect("commit");
    }
    done.store(true, Ordering::Relaxed);
    let reads: usize = readers.into_iter().map(|r| r.join().expect("reader")).sum();
    assert!(reads > 0);
}

// ---------------------------------------------------------------------------------------------
// Background checkpoints, sealed segments, preallocated and recycled segments.
// ---------------------------------------------------------------------------------------------

/// The write of sequence `sequence` in the tests below: one block, 256 blocks round.
fn block_write(sequence: u64) -> Op {
    write_op((sequence % 256) * BLOCK_BYTES, 4096, sequence)
}

fn meta_log_start(dir: &Path) -> u64 {
    crate::meta::Meta::read(dir).expect("read meta").expect("a store").log_start
}

#[test]
fn commits_go_on_during_a_checkpoint_and_wait_only_at_the_lag_bound() {
    let mut f = Fixture::new("lag", 1 << 20, small_options());
    let store = Arc::new(f.store.take().expect("open"));
    let volume = f.volume;
    let total = 120u64; // 16 commits fill a 64 KiB segment: about 7 segments
    let committed = Arc::new(AtomicU64::new(0));
    let gate = store.checkpoint_gate();
    let committer = {
        let (store, committed) = (store.clone(), committed.clone());
        std::thread::spawn(move || {
            for sequence in 1..=total {
                store.commit(&[(volume, record(sequence, block_write(sequence)))]).expect("commit");
                committed.store(sequence, Ordering::Relaxed);
            }
        })
    };
    // The first seal starts a checkpoint, which stalls; the next seals queue behind it until
    // the log not covered by a committed checkpoint spans `CHECKPOINT_LAG_SEGMENTS_MAX`
    // segments. Then the committer waits.
    let mut stalled_at = 0;
    for _ in 0..150 {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let now = committed.load(Ordering::Relaxed);
        let live = store.log_segments().last().copied();
        if now == stalled_at && live == Some(CHECKPOINT_LAG_SEGMENTS_MAX) {
            break;
        }
        stalled_at = now;
    }
    let segments = store.log_segments();
    assert!(stalled_at < total, "the committer never waited");
    assert_eq!(
        segments.last().copied(),
        Some(CHECKPOINT_LAG_SEGMENTS_MAX),
        "live segment while stalled ({stalled_at} commits): {segments:?}"
    );
    assert!(stalled_at >= 3 * 15, "commits went on through three seals: {stalled_at}");
    assert_eq!(meta_log_start(&f.dir.0), 1, "nothing was checkpointed yet");
    drop(gate);
    committer.join().expect("committer");
    assert_eq!(committed.load(Ordering::Relaxed), total);
    store.checkpoint().expect("checkpoint");
    assert_eq!(Some(meta_log_start(&f.dir.0)), store.log_segments().last().copied());
    f.store = Some(Arc::into_inner(store).expect("the only owner"));
    for sequence in 1..=total {
        f.model.apply(&block_write(sequence));
    }
    f.applied = total;
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn a_failed_write_back_fails_the_checkpoint_and_keeps_the_log() {
    // A checkpoint writes the data files back in steps before it syncs them. A step's error
    // is reported once only (the file's error cursor moves on), so it must fail the
    // checkpoint as the sync's own error would: a checkpoint committed over data that never
    // reached the disk would trim the log records that still hold it.
    let mut f = Fixture::new("write-back-error", 1 << 20, small_options());
    for sequence in 1..=5 {
        f.commit(&[block_write(sequence)]);
    }
    f.store().checkpoint().expect("a checkpoint on a healthy disk");
    let log_start = meta_log_start(&f.dir.0);
    for sequence in 6..=12 {
        f.commit(&[block_write(sequence)]);
    }
    f.store().fail_checkpoint_write_back();
    let error = f.store().checkpoint().expect_err("the write-back step failed");
    assert!(error.to_string().contains("write back volume data"), "{error}");
    assert_eq!(meta_log_start(&f.dir.0), log_start, "the failed checkpoint committed nothing");
    let volume = f.volume;
    let refused = f.store().commit(&[(volume, record(13, block_write(13)))]);
    assert!(refused.is_err(), "a failed store accepts no more changes");
    let records = f.store().log_records(volume, Sequence(5), 1 << 20).expect("the log is kept");
    assert_eq!(records.len(), 7);

    f.reopen();
    f.check();
    f.store().checkpoint().expect("the reopened store checkpoints");
    assert!(meta_log_start(&f.dir.0) > log_start);
    f.reopen();
    f.check();
}

#[test]
fn a_sealed_segment_must_hold_its_whole_log() {
    let mut f = Fixture::new("sealed", 1 << 20, exact_growth());
    f.commit(&[write_op(0, 4096, 1)]);
    f.store().checkpoint().expect("first checkpoint");
    let meta = fs::read(f.dir.0.join("meta")).expect("read meta");
    let sealed = f.live_segment();
    f.commit(&[write_op(4096, 4096, 2), write_op(8192, 8192, 3)]);
    f.commit(&[write_op(10 * BLOCK_BYTES + 512, 100, 4)]);
    // The second checkpoint seals the segment, but "crashes" before its metadata commit:
    // recovery replays the sealed segment and the next one.
    f.store().checkpoint().expect("second checkpoint");
    f.commit(&[write_op(20 * BLOCK_BYTES, 4096, 5)]);
    f.close();
    fs::write(f.dir.0.join("meta"), &meta).expect("restore meta");
    f.reopen();
    f.check();
    f.close();
    fs::write(f.dir.0.join("meta"), &meta).expect("restore meta");
    let bytes = fs::read(&sealed).expect("read sealed segment");
    let log_bytes = bytes.len() - SYNC_MARK_BYTES as usize;
    let mut flipped = bytes.clone();
    flipped[log_bytes - 1] ^= 1;
    // (content of the sealed segment, what): the next segment's header says where its log
    // ends, so losing its last batch is damage, not a torn tail.
    for (damaged, what) in
        [(flipped, "last batch damaged"), (bytes[..log_bytes - 100].to_vec(), "last batch cut short")]
    {
        fs::write(&sealed, &damaged).expect("damage");
        let error = Store::open(&f.dir.0, f.options).err().unwrap_or_else(|| panic!("{what}: opened"));
        let message = error.to_string();
        assert!(matches!(&error, StoreError::CorruptLog { path, .. } if *path == sealed), "{what}: {message}");
        assert!(message.contains("sealed"), "{what}: {message}");
    }
    fs::write(&sealed, &bytes).expect("restore");
    f.reopen();
    f.check();
}

#[test]
fn stale_batches_after_the_end_of_the_log_are_never_read_as_records() {
    // A recycled segment file still holds the batches of the segment it was: valid ones, of
    // another segment id. Past the end of the log they must read as its end.
    let mut f = Fixture::new("stale", 1 << 20, exact_growth());
    f.commit(&[write_op(0, 4096, 1), write_op(4096, 8192, 2)]);
    f.commit(&[write_op(40 * BLOCK_BYTES, 4096, 3)]);
    let old = f.live_segment();
    f.store().checkpoint().expect("checkpoint");
    f.commit(&[write_op(80 * BLOCK_BYTES, 4096, 4)]);
    let live = f.live_segment();
    assert_eq!(live, log::segment_path(&f.dir.0, f.store().log_segments()[1]));
    f.close();
    let old_bytes = fs::read(&old).expect("read old");
    let live_bytes = fs::read(&live).expect("read live");
    assert!(old_bytes.len() > live_bytes.len() + 40);
    // (bytes between the log and the stale rest: none (cut short) or an end mark)
    for gap in [0usize, 40] {
        let mut recycled = old_bytes.clone();
        recycled[..live_bytes.len()].copy_from_slice(&live_bytes);
        recycled[live_bytes.len()..live_bytes.len() + gap].fill(0);
        fs::write(&live, &recycled).expect("write recycled");
        f.reopen();
        f.check();
        f.close();
    }
    f.reopen();
    f.commit(&[write_op(90 * BLOCK_BYTES, 4096, 5), write_op(0, 512, 6)]);
    f.reopen();
    f.check();
}

#[test]
fn a_first_batch_without_its_segment_header_never_comes_back() {
    let mut f = Fixture::new("headerless", 1 << 20, exact_growth());
    f.commit(&[write_op(0, 4096, 1)]);
    f.store().checkpoint().expect("checkpoint");
    let segment = f.live_segment();
    let (model, applied) = (f.model.clone(), f.applied);
    f.commit(&[write_op(8 * BLOCK_BYTES, 4096, 7)]);
    f.close();
    // Power failure: the first batch reached the disk, the segment header written with it
    // did not. The segment counts as never written: the batch was never acknowledged.
    let mut bytes = fs::read(&segment).expect("read");
    bytes[..log::SEGMENT_HEADER_BYTES].fill(0);
    // Its fdatasync never returned, so no sync mark was written after it.
    bytes.truncate(bytes.len() - SYNC_MARK_BYTES as usize);
    fs::write(&segment, &bytes).expect("write");
    (f.model, f.applied) = (model.clone(), applied);
    f.reopen();
    f.check();
    let before_next = fs::read(&segment).expect("read");
    // The same sequence again, other content.
    f.commit(&[write_op(16 * BLOCK_BYTES, 4096, 8)]);
    f.close();
    // Power failure again: this time the segment header landed and the batch did not. The
    // old batch below it must not count.
    let after = fs::read(&segment).expect("read");
    let mut lost = before_next.clone();
    lost.resize(after.len().max(lost.len()), 0);
    lost[..log::SEGMENT_HEADER_BYTES].copy_from_slice(&after[..log::SEGMENT_HEADER_BYTES]);
    fs::write(&segment, &lost).expect("write");
    (f.model, f.applied) = (model, applied);
    f.reopen();
    f.check();
}

#[test]
fn a_segment_is_found_under_its_spare_name() {
    // The writer renames a spare `.spare` to `.seg` without syncing the directory: after a
    // crash the live segment (or a sealed one) may have its spare name again, and a spare
    // prepared for an id the writer had already taken may sit beside the segment.
    let mut f = Fixture::new("spare-name", 1 << 20, StoreOptions::default());
    f.commit(&[write_op(0, 4096, 1)]);
    f.store().checkpoint().expect("checkpoint");
    f.commit(&[write_op(4096, 4096, 2), write_op(3 * BLOCK_BYTES, 100, 3)]);
    let segments = f.store().log_segments();
    let live = f.live_segment();
    f.close();
    let spare_name = live.with_extension("spare");
    fs::rename(&live, &spare_name).expect("rename");
    f.reopen();
    f.check();
    assert_eq!(f.store().log_segments(), segments);
    assert!(live.exists() && !spare_name.exists(), "the segment got its own name back");
    f.commit(&[write_op(8 * BLOCK_BYTES, 4096, 4)]);
    f.close();
    // An unwritten spare of the live segment's id, full of stale bytes.
    fs::write(&spare_name, pattern(5, 3 * 4096)).expect("write spare");
    f.reopen();
    f.check();
    assert!(!spare_name.exists(), "the stale spare is gone");
    f.commit(&[write_op(9 * BLOCK_BYTES, 4096, 5)]);
    f.reopen();
    f.check();
}

#[test]
fn segments_are_recycled_and_the_replay_log_stays_bounded() {
    let options = StoreOptions {
        checkpoint_log_bytes: CHECKPOINT_LOG_BYTES_MIN,
        replay_log_bytes: 2 * CHECKPOINT_LOG_BYTES_MIN,
        ..StoreOptions::default()
    };
    let mut f = Fixture::new("recycle", 1 << 20, options);
    let mut inodes = std::collections::HashSet::new();
    let mut reused = 0;
    for sequence in 1..=400u64 {
        f.commit(&[block_write(sequence)]);
        let live = f.live_segment();
        if let Ok(metadata) = fs::metadata(&live) {
            if !inodes.insert(metadata.ino()) && sequence % 16 == 1 {
                reused += 1;
            }
        }
        if sequence % 100 == 0 {
            f.store().checkpoint().expect("checkpoint");
        }
    }
    assert!(reused > 0, "no segment file was recycled");
    f.store().checkpoint().expect("checkpoint");
    let segments = f.store().log_segments();
    let closed: u64 = segments[..segments.len() - 1]
        .iter()
        .map(|id| fs::metadata(log::segment_path(&f.dir.0, *id)).expect("stat").len())
        .sum();
    assert!(closed <= options.replay_log_bytes, "replay log of {closed} bytes");
    let records = f.store().log_records(f.volume, Sequence(399), 1 << 20).expect("recent records");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].op, block_write(400));
    f.reopen();
    f.check();
}

#[test]
fn a_spare_taken_by_the_writer_is_not_prepared_again() {
    // The checkpointer thread may wake at any moment, as any thread on a condition variable.
    // Woken between the writer taking the spare and renaming it to its segment name, it once
    // prepared the same segment again: it renamed a free segment file over the spare, the
    // writer's rename then gave the segment's name to that stale file, and the commits went
    // into a file without a name, lost at the next crash. (Found at 1 MiB writes on tmpfs.)
    // Each commit waits for a spare the writer asked for: on a busy machine the writer could
    // otherwise fill its segment first and move on to a new file, and the race never comes up
    // (it did so in 2 of 3 runs of this binary three at a time on tmpfs: 1 of 52 rotations onto
    // a recycled file).
    let mut f = Fixture::new("spare-taken", 1 << 20, small_options());
    // Two free files of stale bytes at every open: one for the spare, one for a second try.
    let stale = pattern(7, (CHECKPOINT_LOG_BYTES_MIN + CHECKPOINT_LOG_BYTES_MIN / 16) as usize);
    let mut stale_id = 1_000_000;
    // The free files by inode: a segment renamed from one keeps it. (Not any inode seen
    // before: a file system may give a deleted file's inode number to a new file.)
    let mut free_inodes = std::collections::HashSet::new();
    let mut add_free_files = |f: &mut Fixture, free_inodes: &mut std::collections::HashSet<u64>| {
        for _ in 0..2 {
            stale_id += 1;
            let path = log::free_path(&f.dir.0, stale_id);
            fs::write(&path, &stale).expect("write a free file");
            free_inodes.insert(fs::metadata(&path).expect("stat a free file").ino());
        }
        f.reopen();
        f.store().wake_checkpointer_after_spare_taken();
    };
    add_free_files(&mut f, &mut free_inodes);
    let (mut rotations, mut recycled) = (0, 0);
    let mut live = f.live_segment();
    for _ in 0..600 {
        f.commit(&[block_write(f.applied + 1)]);
        f.store().wait_for_wanted_spare(std::time::Duration::from_secs(5));
        if f.live_segment() == live {
            continue;
        }
        // A few commits into the new segment, then a crash (no checkpoint at close).
        for _ in 0..3 {
            f.commit(&[block_write(f.applied + 1)]);
        }
        live = f.live_segment();
        rotations += 1;
        let live_inode = fs::metadata(&live).expect("stat live segment").ino();
        f.close();
        add_free_files(&mut f, &mut free_inodes);
        if free_inodes.contains(&live_inode) {
            recycled += 1;
        }
        f.check();
    }
    assert!(rotations >= 8 && recycled >= 2, "{rotations} rotations, {recycled} onto recycled files");
}

// ---------------------------------------------------------------------------------------------
// kill -9: a child process (this test binary, re-executed) commits in a loop and reports every
// returned commit; the parent kills it at some point, reopens, and checks every reported
// record is there, and the content is exactly the model of what was applied.
// ---------------------------------------------------------------------------------------------

const CRASH_CHILD_ENV: &str = "STARFISH_STORE_CRASH_CHILD_DIR";
/// Milliseconds every checkpoint of the child sleeps first: its checkpointer lags behind, so
/// several segments await a checkpoint and seals wait at the lag bound.
const CRASH_CHILD_DELAY_ENV: &str = "STARFISH_STORE_CRASH_CHILD_CHECKPOINT_DELAY_MS";
const CRASH_VOLUME_BYTES: u64 = 2 << 20;

/// The operation of sequence `sequence` in the crash test (a pure function of it).
fn crash_op(sequence: u64) -> Op {
    let h = pattern(sequence, 8);
    let sectors = CRASH_VOLUME_BYTES / 512;
    let offset = (u32::from_le_bytes(h[0..4].try_into().expect("4")) as u64 % (sectors - 64)) * 512;
    let length = (1 + h[4] as u64 % 48) * 512;
    match h[5] % 8 {
        0 => trim_op(offset, length),
        1 => zeroes_op(offset, length),
        2 => write_op(offset - offset % BLOCK_BYTES, 8 * 4096, sequence),
        _ => write_op(offset, length as usize, sequence),
    }
}

#[test]
fn crash_child() {
    run_crash_child(crash_op, |_, _| {});
}

/// The body of a crash child (if this process is one): commit `op(s)` for every next
/// sequence, in batches of 1 to 7, report each commit, and call `between` after each.
fn run_crash_child(op: fn(u64) -> Op, between: impl FnMut(&Store, VolumeHandle)) {
    run_crash_child_with(small_options(), op, between);
}

/// [`run_crash_child`] with the store opened with `options`.
fn run_crash_child_with(options: StoreOptions, op: fn(u64) -> Op, mut between: impl FnMut(&Store, VolumeHandle)) {
    let Ok(dir) = std::env::var(CRASH_CHILD_ENV) else {
        return;
    };
    if let Ok(delay) = std::env::var(CRASH_CHILD_DELAY_ENV) {
        crate::checkpoint::CHECKPOINT_DELAY_MS.store(delay.parse().expect("child: delay"), Ordering::Relaxed);
    }
    let store = Store::open(Path::new(&dir), options).expect("child: open");
    let volume = store.ensure_volume("vol", CRASH_VOLUME_BYTES).expect("child: volume");
    let mut applied = store.applied_sequence(volume).0;
    let mut stdout = std::io::stdout();
    loop {
        let size = 1 + applied % 7;
        let batch: Vec<_> = (applied + 1..=applied + size).map(|s| (volume, record(s, op(s)))).collect();
        let outcome = store.commit(&batch).expect("child: commit");
        assert!(outcome.rejected.is_empty());
        applied += size;
        writeln!(stdout, "committed {applied}").expect("child: report");
        stdout.flush().expect("child: flush");
        between(&store, volume);
    }
}

#[test]
fn every_returned_commit_survives_kill_9() {
    kill_9_rounds("kill-9", 0, 6);
}

#[test]
fn every_returned_commit_survives_kill_9_with_a_lagging_checkpointer() {
    // Checkpoints start 30 ms late: up to `CHECKPOINT_LAG_SEGMENTS_MAX` segments await one,
    // seals merge into a queued checkpoint or wait, and recovery replays several segments.
    kill_9_rounds("kill-9-lagging", 30, 6);
}

/// Rounds of: a child commits in a loop (its checkpoints delayed by `delay_ms`), is killed,
/// and the store must hold every reported commit and exactly the model of what it applied.
fn kill_9_rounds(name: &str, delay_ms: u64, rounds: u64) {
    kill_9_rounds_of(name, "tests::crash_child", delay_ms, rounds, |store, volume, applied, round| {
        let mut model = Model::new(CRASH_VOLUME_BYTES);
        for s in 1..=applied {
            model.apply(&crash_op(s));
        }
        let (_, data) = store.read(volume, 0, CRASH_VOLUME_BYTES as u32).expect("read");
        assert!(data == model.bytes, "round {round}: content differs from the model at {applied}");
        let (_, extents) = store.block_status(volume, 0, CRASH_VOLUME_BYTES).expect("status");
        assert_eq!(extents, model.extents(0, CRASH_VOLUME_BYTES), "round {round}");
    });
}

/// Rounds of: the child test `child` (run by this test binary) commits to volume "vol" in a
/// loop and reports every returned commit, and is killed; reopened, the store must hold every
/// reported commit, and pass `check(store, volume, applied sequence, round)`.
fn kill_9_rounds_of(
    name: &str,
    child: &str,
    delay_ms: u64,
    rounds: u64,
    check: impl Fn(&Store, VolumeHandle, u64, u64),
) {
    let dir = TempDir::new(name);
    let mut reported = 0u64;
    for round in 0..rounds {
        let started = std::time::Instant::now();
        let mut child = test_in_child(child)
            .env(CRASH_CHILD_ENV, &dir.0)
            .env(CRASH_CHILD_DELAY_ENV, delay_ms.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn child");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let kill_after = 10 + round * 13;
        let mut seen = 0;
        while let Some(Ok(line)) = lines.next() {
            if let Some(n) = line.strip_prefix("committed ") {
                reported = reported.max(n.parse().expect("number"));
                seen += 1;
                if seen == kill_after {
                    // Vary the moment: between commits, inside one, inside a checkpoint.
                    std::thread::sleep(std::time::Duration::from_micros(round * 200));
                    child.kill().expect("kill -9");
                }
            }
        }
        child.wait().expect("reap child");
        assert!(seen >= kill_after, "round {round}: child died early after {seen} commits");

        let store = Store::open(&dir.0, small_options()).expect("reopen after kill");
        let volume = store.volume("vol").expect("volume");
        let applied = store.applied_sequence(volume).0;
        assert!(applied >= reported, "round {round}: reported commit {reported} lost (applied {applied})");
        check(&store, volume, applied, round);
        assert_eq!(store.verify(volume).expect("verify").blocks_corrupt, 0);
        println!("round {round}: killed after {reported}, recovered at {applied} ({:?})", started.elapsed());
    }
}

// ---------------------------------------------------------------------------------------------
// Full recovery: block copy between two stores, then replay from the copy's base.
// ---------------------------------------------------------------------------------------------

/// One copy pass of `volume` from `source` into `target`, in chunks of `chunk` blocks,
/// interrupted (returning `false`) after `stop_after` chunks if given. Saves the cursor every
/// other chunk, as the element does every few MiB.
fn copy_pass(
    source: &Store,
    s: VolumeHandle,
    target: &Store,
    t: VolumeHandle,
    chunk: u64,
    stop_after: Option<usize>,
) -> bool {
    let state = target.begin_copy(t, Epoch(1)).expect("begin copy");
    let blocks = VOLUME / BLOCK_BYTES;
    let mut cursor = state.cursor_block;
    let mut base = state.base;
    let mut done = 0usize;
    while cursor < blocks {
        if stop_after == Some(done) {
            return false;
        }
        let count = chunk.min(blocks - cursor);
        let have = target.block_summaries(t, cursor, count).expect("summaries");
        let reply = source.copy_chunk(s, cursor, &have).expect("copy chunk");
        assert!(reply.applied >= base, "a source never goes back");
        if cursor == 0 || base == Sequence::ZERO {
            base = target.set_copy_base(t, reply.applied, reply.applied_epoch).expect("base").base;
        }
        target.install_blocks(t, &reply.blocks).expect("install");
        cursor += count;
        done += 1;
        if done % 2 == 0 {
            target.save_copy_cursor(t, cursor).expect("cursor");
        }
    }
    target.save_copy_cursor(t, cursor).expect("cursor");
    copy_snapshots(source, s, target, t, base);
    let adopted = target.finish_copy(t).expect("finish");
    assert_eq!(adopted, base);
    true
}

/// A copy pass's last step, as the element's: the source's snapshots taken at or before the
/// base, copied whole.
fn copy_snapshots(source: &Store, s: VolumeHandle, target: &Store, t: VolumeHandle, base: Sequence) {
    let end = VOLUME / BLOCK_BYTES;
    let listed = source.copy_chunk(s, end, &[]).expect("the list").snapshots;
    for snapshot in listed.into_iter().filter(|x| x.taken_at <= base) {
        let from = source.snapshot(s, snapshot.id).expect("listed");
        let h = target.begin_snapshot_copy(t, snapshot.id, snapshot.taken_at, snapshot.size_bytes).expect("begin");
        let blocks = snapshot.size_bytes / BLOCK_BYTES;
        let mut first = 0;
        while first < blocks {
            let count = (blocks - first).min(300);
            let have = target.block_summaries(h, first, count).expect("summaries");
            let reply = source.copy_chunk(from, first, &have).expect("snapshot chunk");
            assert_eq!(reply.applied, snapshot.taken_at);
            target.install_blocks(h, &reply.blocks).expect("install");
            first += count;
        }
        assert!(target.snapshot(t, snapshot.id).is_none(), "hidden until it is copied whole");
        target.finish_snapshot_copy(h).expect("finish");
    }
}

/// Replay the source's records after the target's applied sequence into the target.
fn replay_into(source: &Store, s: VolumeHandle, target: &Store, t: VolumeHandle) {
    loop {
        let after = target.applied_sequence(t);
        let records = source.log_records(s, after, 1 << 20).expect("the source's log holds the gap");
        if records.is_empty() {
            return;
        }
        let batch: Vec<_> = records.into_iter().map(|r| (t, r)).collect();
        let outcome = target.commit(&batch).expect("commit");
        assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    }
}

const VOLUME: u64 = 4 << 20;

fn write_history(store: &Store, v: VolumeHandle, from: u64, count: u64, seed: u64, epoch: u64) {
    for k in 0..count {
        let sequence = from + k;
        let x = pattern(seed + sequence, 8);
        let block = (x[0] as u64 * 7 + x[1] as u64) % (VOLUME / BLOCK_BYTES);
        let op = match x[2] % 8 {
            0 => trim_op(block * BLOCK_BYTES, BLOCK_BYTES * 3),
            1 => zeroes_op(block * BLOCK_BYTES + 512, 1024),
            2 => write_op(block * BLOCK_BYTES + 1024, 512, seed + sequence),
            _ => write_op(block * BLOCK_BYTES, BLOCK_BYTES as usize * (1 + x[3] as usize % 3), seed + sequence),
        };
        let op = match op {
            Op::Write { offset_bytes, data, .. } if offset_bytes + data.len() as u64 > VOLUME => {
                write_op(0, data.len(), seed + sequence)
            }
            Op::Trim { offset_bytes, length_bytes } if offset_bytes + length_bytes > VOLUME => trim_op(0, length_bytes),
            op => op,
        };
        let r = Record { volume: VolumeId(0), epoch: Epoch(epoch), sequence: Sequence(sequence), op };
        let outcome = store.commit(&[(v, r)]).expect("commit");
        assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    }
}

fn digest(store: &Store, v: VolumeHandle) -> (Sequence, u64) {
    let d = store.verify(v).expect("verify");
    assert_eq!(d.blocks_corrupt, 0, "no block fails its checksum");
    (d.applied_sequence, d.content_digest)
}

/// `checkpoint_log_bytes` (the element's `--checkpoint-log`) may differ from one open of a store
/// to the next: the log written with the old seal sizes replays, and the store goes on with the
/// new ones, ending as a store fed the same writes with the default throughout.
#[test]
fn the_checkpoint_log_size_may_change_between_opens() {
    let sized =
        |bytes| StoreOptions { checkpoint_log_bytes: bytes, replay_log_bytes: 64 << 20, ..StoreOptions::default() };
    let reference_dir = TempDir::new("seal-sizes-reference");
    let reference = Store::open(&reference_dir.0, StoreOptions::default()).expect("open");
    let r = reference.ensure_volume("vol", VOLUME).expect("volume");
    let dir = TempDir::new("seal-sizes");
    let mut next = 1;
    for (round, bytes) in [1 << 20, 64 << 20, 64 << 10, 1 << 20].into_iter().enumerate() {
        let store = Store::open(&dir.0, sized(bytes)).expect("open with another checkpoint log size");
        let v = store.ensure_volume("vol", VOLUME).expect("volume");
        if round > 0 {
            assert_eq!(digest(&store, v), digest(&reference, r), "reopened with {bytes} bytes");
        }
        write_history(&store, v, next, 400, 5, 1);
        write_history(&reference, r, next, 400, 5, 1);
        next += 400;
        assert_eq!(digest(&store, v), digest(&reference, r), "written with {bytes} bytes");
    }
    // Sizes outside the range are refused, with the reason, before the directory is touched.
    for bytes in [CHECKPOINT_LOG_BYTES_MIN - 4096, CHECKPOINT_LOG_BYTES_MAX + 1] {
        let refused = TempDir::new("seal-sizes-refused");
        let missing = refused.0.join("never-made");
        match Store::open(&missing, sized(bytes)) {
            Err(StoreError::InvalidOptions(reason)) => {
                assert!(reason.contains("from 64KiB to 4GiB") && reason.contains(&bytes.to_string()), "{reason}")
            }
            other => panic!("{bytes} bytes: {:?}", other.map(|_| "opened")),
        }
        assert!(!missing.exists(), "a refused open made {}", missing.display());
    }
}

#[test]
fn full_copy_brings_a_lagging_a_diverged_and_an_empty_target_to_the_source() {
    let options = StoreOptions { checkpoint_log_bytes: 1 << 20, replay_log_bytes: 64 << 20, ..StoreOptions::default() };
    let dir_s = TempDir::new("copy-source");
    let source = Store::open(&dir_s.0, options).expect("open");
    let s = source.ensure_volume("vol", VOLUME).expect("volume");
    for (case, (target_writes, diverge)) in [(0u64, false), (300, false), (300, true)].into_iter().enumerate() {
        let dir_t = TempDir::new("copy-target");
        let target = Store::open(&dir_t.0, options).expect("open");
        let t = target.ensure_volume("vol", VOLUME).expect("volume");
        if case == 0 {
            write_history(&source, s, 1, 600, 11, 1);
        }
        // The target holds the source's first writes, and diverged ones if asked.
        if target_writes > 0 {
            let records = source.log_records(s, Sequence::ZERO, u64::MAX).expect("log");
            let batch: Vec<_> = records.into_iter().take(target_writes as usize).map(|r| (t, r)).collect();
            target.commit(&batch).expect("commit");
            if diverge {
                write_history(&target, t, target_writes + 1, 40, 999, 1);
            }
        }
        assert!(copy_pass(&source, s, &target, t, 64, None));
        assert_eq!(target.copy_state(t), None);
        // Writes go on at the source meanwhile; replay from the base makes the target exact.
        let next = source.applied_sequence(s).0 + 1;
        write_history(&source, s, next, 50, 77 + case as u64, 1);
        replay_into(&source, s, &target, t);
        assert_eq!(digest(&target, t), digest(&source, s), "case {case}");
    }
}

#[test]
fn an_interrupted_copy_resumes_after_a_restart_and_converges() {
    let options = StoreOptions { checkpoint_log_bytes: 1 << 20, replay_log_bytes: 64 << 20, ..StoreOptions::default() };
    let dir_s = TempDir::new("resume-source");
    let dir_t = TempDir::new("resume-target");
    let source = Store::open(&dir_s.0, options).expect("open");
    let s = source.ensure_volume("vol", VOLUME).expect("volume");
    write_history(&source, s, 1, 500, 5, 1);
    {
        let target = Store::open(&dir_t.0, options).expect("open");
        let t = target.ensure_volume("vol", VOLUME).expect("volume");
        assert!(!copy_pass(&source, s, &target, t, 32, Some(5)));
        // Some installed blocks are past the saved cursor and not checkpointed: dropped here
        // without a checkpoint (the store's drop does not write one).
    }
    write_history(&source, s, 501, 100, 6, 1);
    let target = Store::open(&dir_t.0, options).expect("reopen");
    let t = target.volume("vol").expect("volume");
    let state = target.copy_state(t).expect("the copy is still in progress");
    assert_eq!(state.cursor_block, 4 * 32, "resumes from the last saved cursor");
    // A copying volume takes no records and serves no log.
    assert!(matches!(target.log_records(t, Sequence::ZERO, 1 << 20), Err(StoreError::Copying { .. })));
    assert!(copy_pass(&source, s, &target, t, 32, None));
    replay_into(&source, s, &target, t);
    assert_eq!(digest(&target, t), digest(&source, s));
    drop(target);
    let target = Store::open(&dir_t.0, options).expect("reopen after the copy");
    let t = target.volume("vol").expect("volume");
    assert_eq!(target.copy_state(t), None);
    assert_eq!(digest(&target, t), digest(&source, s));
}

#[test]
fn a_copy_ordered_under_a_new_epoch_starts_over() {
    let dir = TempDir::new("copy-epoch");
    let store = Store::open(&dir.0, small_options()).expect("open");
    let v = store.ensure_volume("vol", VOLUME).expect("volume");
    store.begin_copy(v, Epoch(1)).expect("begin");
    store.save_copy_cursor(v, 100).expect("cursor");
    assert_eq!(store.begin_copy(v, Epoch(1)).expect("same epoch").cursor_block, 100);
    assert_eq!(store.begin_copy(v, Epoch(2)).expect("new epoch").cursor_block, 0);
}

#[test]
fn the_host_elements_checksums_are_checked_stored_and_read_back() {
    let mut f = Fixture::new("piece-checksums", 1 << 20, StoreOptions::default());
    // A write that arrives with data that no longer matches its checksums is refused whole.
    let Op::Write { offset_bytes, data, crcs } = write_op(4096 - 512, 8192, 1) else { unreachable!("a write") };
    let mut damaged = data.to_vec();
    damaged[4000] ^= 1;
    let op = Op::Write { offset_bytes, data: Bytes::from(damaged), crcs: crcs.clone() };
    let outcome = f.store().commit(&[(f.volume, record(1, op))]).expect("commit");
    assert!(matches!(&outcome.rejected[0].error, StoreError::RecordChecksum { .. }), "{:?}", outcome.rejected);
    assert!(outcome.rejected[0].error.to_string().contains("block 1"), "{}", outcome.rejected[0].error);
    assert_eq!(f.store().applied_sequence(f.volume), Sequence(0));
    // The same write intact: the whole block in the middle keeps the host element's checksum,
    // which a read returns again; the replay log gives the record back with its checksums.
    f.commit(&[Op::Write { offset_bytes, data: data.clone(), crcs: crcs.clone() }]);
    let (_, read) = f.store().read_checked(f.volume, 4096, 4096).expect("read");
    assert_eq!(read.crcs, vec![crcs[1]]);
    let (_, read) = f.store().read_checked(f.volume, offset_bytes, 8192).expect("read");
    assert_eq!((read.data, read.crcs), (data, crcs.clone()));
    let logged = f.store().log_records(f.volume, Sequence(0), 1 << 20).expect("log");
    assert_eq!(logged[0].op.check_data(), Ok(()));
    // A scrub chunk summarises what the blocks hold, and finds rot.
    let (applied, summaries) = f.store().scrub_chunk(f.volume, 0, 4).expect("scrub");
    assert_eq!((applied, summaries.len()), (Sequence(1), 4));
    assert_eq!((summaries[1].crc, summaries[1].sequence, summaries[3].allocated), (crcs[1], Sequence(1), false));
    let data_path = f.dir.0.join("volumes/0.data");
    let file = fs::OpenOptions::new().write(true).open(&data_path).expect("open data");
    file.write_all_at(b"rot", BLOCK_BYTES + 9).expect("damage");
    let error = f.store().scrub_chunk(f.volume, 0, 4).expect_err("rot is found");
    assert!(matches!(error, StoreError::BlockChecksum { block: 1, .. }), "{error}");
    assert_eq!(f.store().scrub_chunk(f.volume, 254, 4).expect("past the end is cut").1.len(), 2);
    assert!(f.store().scrub_chunk(f.volume, 257, 1).is_err(), "a chunk past the end is refused");
}

/// A read across runs of written blocks and holes reads each run with one system call and still
/// checks every block: the content is what was written, and rot in the middle of a run is
/// found at its own block, by reads that may wait and by reads that may not.
#[test]
fn a_read_across_runs_and_holes_checks_every_block_of_each_run() {
    let mut f = Fixture::new("read-runs", 1 << 20, StoreOptions::default());
    // Blocks 0..3 and 5..9 written, 3..5 and 9..12 holes.
    f.commit(&[write_op(0, 9 * 4096, 5), trim_op(3 * 4096, 2 * 4096)]);
    let expected = &f.model.bytes[..12 * 4096];
    let (_, read) = f.store().read_checked(f.volume, 0, 12 * 4096).expect("read");
    assert_eq!(&read.data[..], expected);
    let at_once = f.store().try_read_checked(f.volume, 0, 12 * 4096).expect("no error");
    if let Some((_, at_once)) = at_once {
        assert_eq!(&at_once.data[..], expected);
    }
    // An unaligned read starting and ending inside runs.
    let (_, read) = f.store().read_checked(f.volume, 2 * 4096 + 100, 5 * 4096).expect("read");
    assert_eq!(&read.data[..], &expected[2 * 4096 + 100..7 * 4096 + 100]);
    let file = fs::OpenOptions::new().write(true).open(f.dir.0.join("volumes/0.data")).expect("open data");
    file.write_all_at(b"rot", 7 * BLOCK_BYTES + 9).expect("damage");
    let error = f.store().read_checked(f.volume, 0, 12 * 4096).expect_err("rot is found");
    assert!(matches!(error, StoreError::BlockChecksum { block: 7, .. }), "{error}");
    if let Err(error) = f.store().try_read_checked(f.volume, 0, 12 * 4096) {
        assert!(matches!(error, StoreError::BlockChecksum { block: 7, .. }), "{error}");
    } else {
        assert_eq!(f.store().try_read_checked(f.volume, 0, 12 * 4096).expect("no error"), None, "rot read as data");
    }
    // Blocks before the rot in the same run still read.
    let (_, read) = f.store().read_checked(f.volume, 5 * 4096, 2 * 4096).expect("read");
    assert_eq!(&read.data[..], &expected[5 * 4096..7 * 4096]);
}

/// A read's buffer is not zeroed before the read: every hole in it must be written as
/// zeroes. The memory a trimmed range's read gets is most likely the memory the same read of
/// its data had a moment before (the allocator reuses it), so holes left unwritten would show
/// the old data.
#[test]
fn holes_read_as_zeroes_into_memory_that_held_data() {
    let mut f = Fixture::new("read-holes", 4 << 20, StoreOptions::default());
    f.commit(&[write_op(0, 2 << 20, 9)]);
    for round in 0..4 {
        let (_, read) = f.store().read_checked(f.volume, 0, 2 << 20).expect("read");
        assert_eq!(&read.data[..], &f.model.bytes[..2 << 20]);
        drop(read);
        // Every other 64 KiB becomes a hole.
        let trims: Vec<Op> = (0..16).map(|i| trim_op((2 * i + round % 2) * 65_536, 65_536)).collect();
        f.commit(&trims);
        let (_, read) = f.store().read_checked(f.volume, 0, 2 << 20).expect("read");
        assert_eq!(&read.data[..], &f.model.bytes[..2 << 20], "round {round}");
        if let Some((_, read)) = f.store().try_read_checked(f.volume, 0, 2 << 20).expect("no error") {
            assert_eq!(&read.data[..], &f.model.bytes[..2 << 20], "round {round}, at once");
        }
        f.commit(&[write_op(0, 2 << 20, 10 + round)]);
    }
}

/// Times `reads_that_may_not_wait_return_what_memory_holds_and_nothing_else` drops a file from the
/// page cache and reads it without waiting.
const EVICTION_TRIES: usize = 8;

/// What a read that may not wait for the disk returns, on a file system that keeps files in
/// memory (tmpfs: always at once, and commits run on the caller) and on one that does not (the
/// page cache decides).
#[test]
fn reads_that_may_not_wait_return_what_memory_holds_and_nothing_else() {
    let mut places = vec![std::env::temp_dir()];
    if Path::new("/dev/shm").is_dir() {
        places.push(PathBuf::from("/dev/shm"));
    }
    for place in places {
        let reads = crate::sys::non_blocking_reads(&place).expect("statfs");
        let mut dir = TempDir::new("nowait-reads");
        dir.0 = place.join(dir.0.file_name().expect("a name"));
        let store = Store::open(&dir.0, StoreOptions::default()).expect("open");
        // Commits may run where nothing may block only where reads may too: in memory.
        assert_eq!(store.in_memory(), reads == crate::sys::NonBlockingReads::Always, "{reads:?}");
        // The log is synced unless its own file system is in memory.
        assert_eq!(store.log_in_memory(), reads == crate::sys::NonBlockingReads::Always, "{reads:?}");
        let volume = store.ensure_volume("vol", 1 << 20).expect("create");
        let op = write_op(4096 + 512, 16384, 3);
        store.commit(&[(volume, record(1, op))]).expect("commit");
        let blocking = store.read_checked(volume, 4096, 20480).expect("read");
        // Just written, so in memory: the same answer as a read that may wait.
        let at_once = store.try_read_checked(volume, 4096, 20480).expect("no error").expect("in memory");
        assert_eq!(at_once, blocking, "{reads:?}");
        // A range of holes needs no file at all.
        let holes = store.try_read_checked(volume, 65536, 8192).expect("no error").expect("holes");
        assert!(holes.1.data.iter().all(|&b| b == 0));
        // Synced, then dropped from the page cache: only a file system that keeps files in
        // memory answers at once; otherwise the read must wait, and says so. Such a read still
        // starts the readahead of what it missed (Linux does for `RWF_NOWAIT`), and a fast
        // enough disk can finish it before the read looks again (CI saw it once): then the
        // answer is the data, never anything else. So the eviction is tried a few times, and at
        // least one read must say it would wait.
        store.checkpoint().expect("checkpoint");
        let data = fs::File::open(dir.0.join("volumes/0.data")).expect("open data");
        data.sync_all().expect("sync");
        let mut waits = 0;
        for _ in 0..EVICTION_TRIES {
            // SAFETY: a plain advice call on an open file descriptor.
            let advised =
                unsafe { libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&data), 0, 0, libc::POSIX_FADV_DONTNEED) };
            assert_eq!(advised, 0);
            match store.try_read_checked(volume, 4096, 20480).expect("no error") {
                None => waits += 1,
                Some(evicted) => assert_eq!(evicted, blocking, "{reads:?}"),
            }
        }
        match reads {
            crate::sys::NonBlockingReads::Always => assert_eq!(waits, 0, "a file in memory read waited"),
            crate::sys::NonBlockingReads::PageCacheOnly => {
                assert!(waits > 0, "{EVICTION_TRIES} reads from the disk at once, none said it would wait")
            }
        }
        // A read that may wait brings it back; then it is at once again.
        assert_eq!(store.read_checked(volume, 4096, 20480).expect("read"), blocking);
        assert_eq!(store.try_read_checked(volume, 4096, 20480).expect("no error"), Some(blocking));
        // Rot is an error either way, never data.
        fs::OpenOptions::new()
            .write(true)
            .open(dir.0.join("volumes/0.data"))
            .expect("open data")
            .write_all_at(b"rot", 2 * BLOCK_BYTES + 9)
            .expect("damage");
        let error = store.try_read_checked(volume, 4096, 20480).expect_err("rot is found");
        assert!(matches!(error, StoreError::BlockChecksum { block: 2, .. }), "{error}");
    }
}

/// The volumes' and the log's directories may each be on another file system than the store
/// (a mount; here a link): the log is synced unless its own file system is in memory, and the
/// store counts as in memory (commits on the caller, placed data not synced) only if both are.
#[test]
fn the_log_is_synced_unless_its_own_file_system_is_in_memory() {
    let in_memory =
        |place: &Path| crate::sys::non_blocking_reads(place).expect("statfs") == crate::sys::NonBlockingReads::Always;
    // The temporary directory is tmpfs on some systems (Debian 13's /tmp), /var/tmp a disk.
    let places = [std::env::temp_dir(), PathBuf::from("/var/tmp"), PathBuf::from("/dev/shm")];
    let places: Vec<&PathBuf> = places.iter().filter(|p| p.is_dir()).collect();
    let (Some(&disk), Some(&memory)) = (places.iter().find(|p| !in_memory(p)), places.iter().find(|p| in_memory(p)))
    else {
        eprintln!("skipped: needs a directory on a disk and one in memory among {places:?}");
        return;
    };
    // (the store's directory, the place its subdirectory `linked` is linked to)
    let layouts = [
        (memory, crate::log::LOG_DIR, disk),
        (disk, crate::log::LOG_DIR, memory),
        (memory, crate::store::VOLUMES_DIR, disk),
    ];
    for (store_place, linked, link_place) in layouts {
        let mut dir = TempDir::new("subdirectory-elsewhere");
        dir.0 = store_place.join(dir.0.file_name().expect("a name"));
        let mut target = TempDir::new("subdirectory-target");
        target.0 = link_place.join(target.0.file_name().expect("a name"));
        fs::create_dir_all(&dir.0).expect("store directory");
        fs::create_dir_all(&target.0).expect("linked directory");
        std::os::unix::fs::symlink(&target.0, dir.0.join(linked)).expect("link");
        let store = Store::open(&dir.0, StoreOptions::default()).expect("open");
        let log_in_memory = if linked == crate::log::LOG_DIR { in_memory(link_place) } else { in_memory(store_place) };
        let volumes_in_memory =
            if linked == crate::store::VOLUMES_DIR { in_memory(link_place) } else { in_memory(store_place) };
        let layout = format!("store in {}, {linked} in {}", store_place.display(), link_place.display());
        assert_eq!(store.log_in_memory(), log_in_memory, "{layout}");
        assert_eq!(store.in_memory(), log_in_memory && volumes_in_memory, "{layout}");
        let volume = store.ensure_volume("vol", 1 << 20).expect("create");
        store.commit(&[(volume, record(1, write_op(0, 4096, 5)))]).expect("commit");
        assert_eq!(store.read_checked(volume, 0, 4096).expect("read").1.data, pattern(5, 4096), "{layout}");
        // On a disk the new segment grew by a step of zeroes (a cheaper sync); in memory by
        // what was written.
        let step = StoreOptions::default().log_grow_step();
        let segment = dir.0.join(crate::log::LOG_DIR).join(format!("{:020}.seg", 1));
        let bytes = fs::metadata(&segment).expect("the first segment").len();
        assert_eq!(bytes % step == 0, !log_in_memory, "{layout}: segment of {bytes} bytes, step {step}");
    }
}

/// A pending repair this store made itself on finding a bad block keeps its map and log as
/// committed, so it serves a peer's copy the blocks that pass their checksum, and fails one
/// that needs its bad block. One made by `Store::repair` (here: an empty map for a damaged one)
/// serves none: its map says nothing of what the volume held.
#[test]
fn a_repair_found_while_running_serves_copies_of_its_intact_blocks_and_one_made_by_repair_serves_none() {
    let blocks = (1 << 20) / BLOCK_BYTES;
    let content = pattern(1, 4 * BLOCK_BYTES as usize);
    let op = Op::write(0, Bytes::from(content.clone()));
    let mut f = Fixture::new("repair-source", 1 << 20, StoreOptions::default());
    let mut t = Fixture::new("repair-source-peer", 1 << 20, StoreOptions::default());
    f.commit(std::slice::from_ref(&op));
    t.commit(std::slice::from_ref(&op));
    f.store().checkpoint().expect("checkpoint");
    f.close();
    let data = fs::OpenOptions::new().write(true).open(f.dir.0.join("volumes/0.data")).expect("open data");
    data.write_all_at(&pattern(77, 4096), 2 * BLOCK_BYTES).expect("garble block 2");
    drop(data);
    f.reopen();
    let error = f.store().read(f.volume, 2 * BLOCK_BYTES, 4096).expect_err("block 2 fails its checksum");
    assert!(matches!(error, StoreError::BlockChecksum { block: 2, .. }), "{error}");
    // What the element's read does with it (`ElementStorage::read`).
    assert!(f.store().mark_for_repair(f.volume, 2, true).expect("mark"));
    let state = f.store().copy_state(f.volume).expect("a repair");
    assert!(state.intact && state.is_pending_repair(), "{state:?}");
    // A peer that lacks blocks 0 and 1 gets them; one that lacks block 2 too gets nothing.
    let theirs = t.store().block_summaries(t.volume, 0, blocks).expect("summaries");
    let mut have = theirs.clone();
    for b in [0, 1] {
        have[b].allocated = false;
    }
    let chunk = f.store().copy_chunk(f.volume, 0, &have).expect("the intact blocks are served");
    assert_eq!(chunk.applied, Sequence(1));
    assert_eq!(chunk.blocks.iter().map(|b| b.block).collect::<Vec<_>>(), vec![0, 1]);
    for b in &chunk.blocks {
        let at = (b.block * BLOCK_BYTES) as usize;
        assert_eq!(&b.content.as_ref().expect("allocated")[..], &content[at..at + BLOCK_BYTES as usize]);
    }
    have[2].allocated = false;
    assert!(f.store().copy_chunk(f.volume, 0, &have).is_err(), "the bad block is never served");
    // Kept across a restart: the flag is in the copy state file.
    f.reopen();
    assert!(f.store().copy_state(f.volume).is_some_and(|s| s.intact));
    assert!(f.store().copy_chunk(f.volume, 0, &theirs).is_ok());
    // A damaged block map, repaired offline: an empty map and a pending repair that serves no copy.
    f.close();
    let map = f.dir.0.join("volumes/0.map");
    let mut bytes = fs::read(&map).expect("read map");
    bytes[4096 + 16] ^= 1;
    fs::write(&map, &bytes).expect("write map");
    fs::remove_file(f.dir.0.join("volumes/0.copy")).expect("remove the copy state");
    Store::repair(&f.dir.0, f.options).expect("repair");
    f.reopen();
    let state = f.store().copy_state(f.volume).expect("a repair");
    assert!(state.is_pending_repair() && !state.intact, "{state:?}");
    assert!(matches!(f.store().copy_chunk(f.volume, 0, &theirs), Err(StoreError::Copying { .. })));
}
