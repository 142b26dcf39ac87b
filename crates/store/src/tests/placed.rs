//! Placed writes: a large write of whole blocks that were holes goes into the data file first
//! and is logged without its data (`store::place_if_holes`). Against the byte-array model, and
//! through the log: what is logged, what replay rebuilds, what peer replay can still serve.

use super::*;
use crate::PLACED_WRITE_BYTES_MIN;

const MIB: u64 = 1 << 20;

/// A store that places large writes into holes.
fn placing() -> StoreOptions {
    StoreOptions { placed_writes: true, ..StoreOptions::default() }
}

/// Every record of the store's log segments, in order, as logged: (segment, offset, record).
fn logged_records(f: &Fixture) -> Vec<(u64, u64, log::LogRecord)> {
    let mut records = Vec::new();
    for id in f.store().log_segments() {
        let path = log::segment_path(&f.dir.0, id);
        let file = fs::File::open(&path).expect("open segment");
        log::scan_segment(&file, &path, id, None, |offset, _, record| {
            records.push((id, offset, record));
            Ok(())
        })
        .expect("scan segment");
    }
    records
}

/// The logged record of `sequence`: whether it is placed, and its bytes in the log.
fn logged(f: &Fixture, sequence: u64) -> (bool, u64) {
    let records = logged_records(f);
    let (_, _, record) =
        records.iter().find(|(_, _, r)| r.sequence == Sequence(sequence)).expect("the record is in the log");
    (record.is_placed(), record.frame_bytes())
}

/// Whether the records of `a` and `a + 1` were logged in one batch (back to back).
fn one_batch(f: &Fixture, a: u64) -> bool {
    let records = logged_records(f);
    let at = |s: u64| records.iter().find(|(_, _, r)| r.sequence == Sequence(s)).expect("the record is in the log");
    let ((segment_a, offset_a, record_a), (segment_b, offset_b, _)) = (at(a), at(a + 1));
    segment_a == segment_b && offset_a + record_a.frame_bytes() == *offset_b
}

#[test]
fn a_large_write_into_holes_is_logged_without_its_data_and_replayed() {
    let mut f = Fixture::new("placed", 4 * MIB, placing());
    f.commit(&[write_op(MIB, MIB as usize, 1)]);
    let (placed, frame_bytes) = logged(&f, 1);
    assert!(placed, "a 1 MiB write into holes is placed");
    assert!(frame_bytes < 4096, "its record holds its checksums only: {frame_bytes} bytes");
    f.check();

    // Replay sets the map from the record; the data is in the data file.
    f.reopen();
    f.check();
    assert_eq!(f.store().verify(f.volume).expect("verify").blocks_corrupt, 0);

    // Peer replay reads its data back from the data file.
    let records = f.store().log_records(f.volume, Sequence(0), 64 * MIB).expect("log records");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].op, write_op(MIB, MIB as usize, 1));
}

#[test]
fn writes_over_data_small_writes_and_unaligned_writes_keep_their_data_in_the_log() {
    let mut f = Fixture::new("not-placed", 4 * MIB, placing());
    let min = PLACED_WRITE_BYTES_MIN as usize;
    f.commit(&[write_op(0, MIB as usize, 1)]);
    f.commit(&[write_op(0, MIB as usize, 2)]); // over data
    f.commit(&[write_op(2 * MIB, min - 4096, 3)]); // too small
    f.commit(&[write_op(3 * MIB + 512, min, 4)]); // unaligned
    f.commit(&[write_op(2 * MIB + 128 * 1024, min, 5)]); // partly over data (sequence 3's)
    f.commit(&[write_op(2 * MIB + 512 * 1024, min, 6)]); // holes: placed
    let placed: Vec<bool> = (1..=6).map(|s| logged(&f, s).0).collect();
    assert_eq!(placed, [true, false, false, false, false, true]);
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn a_write_into_trimmed_blocks_is_placed_once_a_checkpoint_covers_the_trim() {
    // A write, a smaller one over it, a trim, then a write into the trimmed blocks. Placed at
    // once, a crash before the next checkpoint replayed the smaller write over its data (replay
    // rewrites the data file with every logged write after the checkpoint), and the block then
    // failed its checksum (1 to 4 % of kill -9 test runs under load, stop 68). So it is logged,
    // and a write into trimmed blocks is placed once a checkpoint covers the trim.
    let mut f = Fixture::new("placed-after-trim", 4 * MIB, placing());
    f.commit(&[write_op(0, MIB as usize, 1)]);
    assert!(logged(&f, 1).0, "a write into blocks never written is placed");
    f.commit(&[write_op(4096, 4096, 2)]);
    f.commit(&[trim_op(0, MIB)]);
    f.store().reclaim();
    f.commit(&[write_op(0, MIB as usize, 4)]);
    assert!(!logged(&f, 4).0, "not placed while a write to its blocks is to be replayed");
    // A crash (no checkpoint at close): the replay leaves every block as written.
    f.reopen();
    f.check();
    assert_eq!(f.store().verify(f.volume).expect("verify").blocks_corrupt, 0);
    f.commit(&[trim_op(0, MIB)]);
    f.store().reclaim();
    f.store().checkpoint().expect("checkpoint");
    f.commit(&[write_op(0, MIB as usize, 6)]);
    assert!(logged(&f, 6).0, "placed once a checkpoint covers the trim");
    f.reopen();
    f.check();
    assert_eq!(f.store().verify(f.volume).expect("verify").blocks_corrupt, 0);
}

#[test]
fn a_later_record_of_the_same_commit_over_a_placed_write_is_committed_after_it() {
    // A commit written as several log batches may lose its later batches in a power failure;
    // a later record of the same commit over the placed blocks would then have overwritten
    // the placed data without being logged. So it goes into a commit of its own.
    let mut f = Fixture::new("placed-then-overwritten", 4 * MIB, placing());
    f.commit(&[write_op(0, MIB as usize, 1), write_op(4096 + 512, 8192, 2), write_op(2 * MIB, MIB as usize, 3)]);
    let placed: Vec<bool> = (1..=3).map(|s| logged(&f, s).0).collect();
    // The third is placed too: the records before it (the first two, committed on their own)
    // do not touch its blocks.
    assert_eq!(placed, [true, false, true]);
    assert!(!one_batch(&f, 1), "the record over the placed write is logged in a commit of its own");
    assert!(one_batch(&f, 2), "the records after it share a commit");
    f.check();
    f.reopen();
    f.check();
    assert_eq!(f.store().verify(f.volume).expect("verify").blocks_corrupt, 0);
}

/// The copies of placed data in the log ([`log::Kind::PlacedCopy`]): (placed write's
/// sequence, first block, blocks).
fn copies(f: &Fixture) -> Vec<(u64, u64, u64)> {
    logged_records(f)
        .into_iter()
        .filter(|(_, _, r)| r.kind == log::Kind::PlacedCopy)
        .map(|(_, _, r)| (r.sequence.0, r.offset_bytes / 4096, r.length_bytes / 4096))
        .collect()
}

/// Every record the log serves after `after`, checked against `op(sequence)`, the operation
/// committed; returns their sequences.
fn served(store: &Store, volume: VolumeHandle, after: u64, op: impl Fn(u64) -> Op) -> Vec<u64> {
    let mut sequences = Vec::new();
    let mut after = Sequence(after);
    loop {
        let records = store.log_records(volume, after, 2 * MIB).expect("log records");
        let Some(last) = records.last() else { return sequences };
        after = last.sequence;
        for r in records {
            assert!(r.op == op(r.sequence.0), "record {} is served as it was committed", r.sequence);
            sequences.push(r.sequence.0);
        }
    }
}

#[test]
fn a_placed_write_whose_blocks_are_written_again_is_still_served_whole_from_copies_of_its_data() {
    let mut f = Fixture::new("placed-rewritten", 4 * MIB, placing());
    let ops = [
        write_op(0, MIB as usize, 1),
        write_op(2 * MIB, MIB as usize, 2),
        write_op(2 * MIB + 8192 + 512, 4096, 3), // over blocks 514 and 515 of sequence 2
        trim_op(2 * MIB + 64 * 1024, 16 * 1024), // blocks 528..532
        write_op(2 * MIB, 256 * 1024, 5),        // blocks 512..576: 514, 515 and 528..532 no longer sequence 2's
        zeroes_op(2 * MIB + 512 * 1024 + 100, 5000), // blocks 640 and 641, partly
    ];
    let op = |s: u64| ops[s as usize - 1].clone();
    for s in 1..=ops.len() as u64 {
        f.commit(&[op(s)]);
    }
    f.check();
    // Sequence 2's data was copied into the log just before each record that changed some of
    // its blocks, and only the blocks that still held it.
    assert_eq!(copies(&f), [(2, 514, 2), (2, 528, 4), (2, 512, 2), (2, 516, 12), (2, 532, 44), (2, 640, 2)]);
    assert_eq!(served(f.store(), f.volume, 0, op), [1, 2, 3, 4, 5, 6]);
    // Found again after a restart, and from the replay log's closed segments.
    f.reopen();
    assert_eq!(served(f.store(), f.volume, 1, op), [2, 3, 4, 5, 6]);
    f.store().checkpoint().expect("checkpoint");
    f.commit(&[write_op(2 * MIB + 768 * 1024, 4096, 7)]);
    let op = |s: u64| if s == 7 { write_op(2 * MIB + 768 * 1024, 4096, 7) } else { ops[s as usize - 1].clone() };
    f.reopen();
    assert_eq!(served(f.store(), f.volume, 1, op), [2, 3, 4, 5, 6, 7]);
    f.check();
}

#[test]
fn records_of_one_commit_over_a_placed_write_copy_each_block_once() {
    let mut f = Fixture::new("placed-copied-once", 4 * MIB, placing());
    f.commit(&[write_op(0, MIB as usize, 1)]);
    let ops = [write_op(0, MIB as usize, 1), write_op(4096, 8192, 2), write_op(8192, 8192, 3), trim_op(0, 16384)];
    f.commit(&[ops[1].clone(), ops[2].clone(), ops[3].clone()]);
    assert_eq!(copies(&f), [(1, 1, 2), (1, 3, 1), (1, 0, 1)]);
    assert_eq!(served(f.store(), f.volume, 0, |s| ops[s as usize - 1].clone()), [1, 2, 3, 4]);
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn a_write_over_a_placed_write_after_a_snapshot_keeps_its_data_for_both() {
    // No write is placed while the volume has a snapshot; one placed before it is preserved
    // for the snapshot and copied for peers by the same overwrite.
    let mut f = Fixture::new("placed-then-snapshot", 4 * MIB, placing());
    let ops = [write_op(0, MIB as usize, 1), Op::Snapshot { id: 1 }, write_op(8192, 4096, 3)];
    for op in &ops {
        f.commit(std::slice::from_ref(op));
    }
    assert_eq!(copies(&f), [(1, 2, 1)]);
    for reopened in [false, true] {
        if reopened {
            f.reopen();
        }
        f.check();
        let snapshot = f.store().snapshot(f.volume, 1).expect("snapshot 1");
        let (_, data) = f.store().read(snapshot, 0, MIB as u32).expect("read the snapshot");
        assert!(data == pattern(1, MIB as usize), "the snapshot holds the placed write's data");
        assert_eq!(served(f.store(), f.volume, 0, |s| ops[s as usize - 1].clone()), [1, 2, 3]);
    }
}

#[test]
fn placed_data_that_fails_its_checksum_is_not_copied_and_peers_are_told_so() {
    let mut f = Fixture::new("placed-damaged", 4 * MIB, placing());
    f.commit(&[write_op(0, MIB as usize, 1)]);
    let data = fs::OpenOptions::new().write(true).open(f.dir.0.join("volumes/0.data")).expect("open data");
    data.write_all_at(&[0xa5; 4096], 3 * BLOCK_BYTES).expect("garble block 3");
    drop(data);
    // The write over blocks 2 and 3 goes through; their copy cannot be made.
    f.commit(&[write_op(2 * BLOCK_BYTES, 8192, 2)]);
    assert_eq!(copies(&f), []);
    match f.store().log_records(f.volume, Sequence(0), 2 * MIB) {
        Err(StoreError::PlacedRewritten { sequence, .. }) => assert_eq!(sequence, Sequence(1)),
        Ok(records) => panic!("expected the placed write refused, got {} records", records.len()),
        Err(error) => panic!("expected the placed write refused: {error}"),
    }
    assert_eq!(served(f.store(), f.volume, 1, |_| write_op(2 * BLOCK_BYTES, 8192, 2)), [2]);
    f.check();
}

#[test]
fn a_placed_write_no_longer_in_the_replay_log_is_not_copied() {
    let options = StoreOptions { replay_log_bytes: 0, ..placing() };
    let mut f = Fixture::new("placed-forgotten", 4 * MIB, options);
    f.commit(&[write_op(0, MIB as usize, 1)]);
    for s in 2..=3 {
        f.store().checkpoint().expect("checkpoint");
        f.commit(&[write_op(2 * MIB, 4096, s)]);
    }
    f.store().checkpoint().expect("checkpoint");
    assert!(matches!(f.store().log_records(f.volume, Sequence(0), MIB), Err(StoreError::NotInReplayLog { .. })));
    f.commit(&[write_op(0, 4096, 4)]);
    assert_eq!(copies(&f), []);
    f.check();
}

#[test]
fn the_replay_log_budget_counts_a_placed_writes_data() {
    // Eight segments of a few KiB each, each with a placed write of 1 MiB: as data, 8 MiB,
    // twice the budget, so the older half is dropped (by their files alone, none would be).
    let options =
        StoreOptions { checkpoint_log_bytes: CHECKPOINT_LOG_BYTES_MIN, replay_log_bytes: 4 * MIB, ..placing() };
    let mut f = Fixture::new("placed-budget", 8 * MIB, options);
    for s in 1..=8 {
        f.commit(&[write_op((s - 1) * MIB, MIB as usize, s)]);
        f.store().checkpoint().expect("checkpoint");
    }
    let oldest = match f.store().log_records(f.volume, Sequence(0), MIB) {
        Err(StoreError::NotInReplayLog { oldest: Some(oldest), .. }) => oldest.0,
        Ok(records) => panic!("expected the oldest placed writes dropped, got {} records", records.len()),
        Err(error) => panic!("expected the oldest placed writes dropped: {error}"),
    };
    assert!((4..=6).contains(&oldest), "oldest held {oldest}");
    let sequences = served(f.store(), f.volume, oldest - 1, |s| write_op((s - 1) * MIB, MIB as usize, s));
    assert_eq!(sequences, (oldest..=8).collect::<Vec<_>>());
}

#[test]
fn log_records_count_a_placed_writes_data_against_the_reply_size() {
    let mut f = Fixture::new("placed-reply-size", 8 * MIB, placing());
    for s in 0..4 {
        f.commit(&[write_op(s * MIB, MIB as usize, s + 1)]);
    }
    let sequences = |after: u64, max_bytes: u64| -> Vec<u64> {
        let records = f.store().log_records(f.volume, Sequence(after), max_bytes).expect("log records");
        records.iter().map(|r| r.sequence.0).collect()
    };
    // At least one record, however small the reply; then as many as fit.
    assert_eq!(sequences(0, 4096), [1]);
    assert_eq!(sequences(0, 2 * MIB + 8192), [1, 2]);
    assert_eq!(sequences(2, 64 * MIB), [3, 4]);
}

/// The operation of sequence `sequence` in the placed-write crash test: on a volume of eight
/// 256 KiB slots, whole-slot writes (placed when the slot is a hole), whole-slot trims that
/// make slots holes again, and small writes and zeroes over them.
fn placed_crash_op(sequence: u64) -> Op {
    let h = pattern(sequence, 8);
    let slot_bytes = PLACED_WRITE_BYTES_MIN;
    let slot = h[0] as u64 % (CRASH_VOLUME_BYTES / slot_bytes);
    match h[1] % 8 {
        0..=2 => write_op(slot * slot_bytes, slot_bytes as usize, sequence),
        3 | 4 => trim_op(slot * slot_bytes, slot_bytes),
        5 => zeroes_op(slot * slot_bytes + 4096, 8192),
        _ => write_op(slot * slot_bytes + h[2] as u64 * 512, 4096, sequence),
    }
}

#[test]
fn placed_crash_child() {
    run_crash_child_with(StoreOptions { placed_writes: true, ..small_options() }, placed_crash_op, |_, _| {});
}

#[test]
fn every_returned_commit_with_placed_writes_survives_kill_9() {
    kill_9_rounds_of("kill-9-placed", "tests::placed::placed_crash_child", 0, 6, |store, volume, applied, round| {
        let mut model = Model::new(CRASH_VOLUME_BYTES);
        for s in 1..=applied {
            model.apply(&placed_crash_op(s));
        }
        let (_, data) = store.read(volume, 0, CRASH_VOLUME_BYTES as u32).expect("read");
        assert!(data == model.bytes, "round {round}: content differs from the model at {applied}");
        let (_, extents) = store.block_status(volume, 0, CRASH_VOLUME_BYTES).expect("status");
        assert_eq!(extents, model.extents(0, CRASH_VOLUME_BYTES), "round {round}");
        // Every record the replay log holds is served as it was committed, placed writes
        // whose blocks were written again included.
        let after = match store.log_records(volume, Sequence(0), 4096) {
            Ok(_) => 0,
            Err(StoreError::NotInReplayLog { oldest: Some(oldest), .. }) => oldest.0 - 1,
            // None held: the replay log's budget (small here) counts a placed write's data, so
            // one closed segment can outgrow it, and then only the live segment is kept; after
            // a reopen that is a new, empty one.
            Err(StoreError::NotInReplayLog { oldest: None, .. }) => applied,
            Err(error) => panic!("round {round}: {error}"),
        };
        let sequences = served(store, volume, after, placed_crash_op);
        assert_eq!(sequences, (after + 1..=applied).collect::<Vec<_>>(), "round {round}");
    });
}

#[test]
fn without_the_option_a_large_write_into_holes_keeps_its_data_in_the_log() {
    let mut f = Fixture::new("placed-off", 4 * MIB, StoreOptions::default());
    f.commit(&[write_op(MIB, MIB as usize, 1)]);
    let (placed, frame_bytes) = logged(&f, 1);
    assert!(!placed && frame_bytes > MIB, "placed {placed}, {frame_bytes} bytes in the log");
    f.check();
}

#[test]
fn writes_into_holes_are_placed_however_much_the_data_file_holds_unsynced() {
    // A placed write syncs its own range of the data file, not what earlier applies left in
    // its page cache (`sys::sync_data_range`), so no amount of that holds placing back.
    let mut f = Fixture::new("placed-unsynced", 8 * MIB, placing());
    f.commit(&[write_op(0, 2 * MIB as usize, 1)]);
    f.commit(&[write_op(0, 2 * MIB as usize, 2)]); // over data: 2 MiB applied, unsynced
    f.commit(&[write_op(4 * MIB, MIB as usize, 3), write_op(6 * MIB, MIB as usize, 4)]);
    let placed: Vec<bool> = (1..=4).map(|s| logged(&f, s).0).collect();
    assert_eq!(placed, [true, false, true, true]);
    f.check();
    f.reopen();
    f.check();
}

#[test]
fn the_ranges_a_commit_syncs_are_joined_per_volume_where_they_touch() {
    let ranges = vec![(1, 10..20), (0, 5..6), (1, 20..30), (1, 40..50), (0, 6..8), (1, 12..15)];
    assert_eq!(crate::store::joined_ranges(ranges), vec![(0, 5..8), (1, 10..30), (1, 40..50)]);
    assert_eq!(crate::store::joined_ranges(Vec::new()), Vec::new());
}
