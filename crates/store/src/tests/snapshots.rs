//! Snapshots against the byte-array model: a snapshot reads, forever, what its volume held at
//! the sequence of its record, through commits, checkpoints, reopening, the deletion of other
//! snapshots and a kill -9.

use super::*;
use crate::SnapshotInfo;

/// Pseudo-random operation number `n` on a volume of `size_bytes` (writes, partial writes,
/// trims and zeroes, some of them large).
pub(super) fn random_op(n: u64, size_bytes: u64) -> Op {
    let h = pattern(n ^ 0x5eed, 8);
    let sectors = size_bytes / 512;
    let length = match h[4] % 8 {
        0 => (1 + h[6] as u64 % 64) * BLOCK_BYTES,
        _ => (1 + h[6] as u64 % 24) * 512,
    };
    let offset = (u32::from_le_bytes(h[0..4].try_into().expect("4")) as u64 % (sectors - length / 512 + 1)) * 512;
    match h[5] % 6 {
        0 => trim_op(offset, length),
        1 => zeroes_op(offset, length),
        _ => write_op(offset, length as usize, n),
    }
}

/// Take snapshot `id` now (a record of its own); its model is the volume's as of now.
fn take(f: &mut Fixture, id: u64) -> Model {
    f.commit(&[Op::Snapshot { id }]);
    f.model.clone()
}

fn snapshot_of(f: &Fixture, id: u64) -> SnapshotInfo {
    let snapshots = f.store().snapshots(f.volume);
    *snapshots.iter().find(|s| s.id == id).unwrap_or_else(|| panic!("snapshot {id} in {snapshots:?}"))
}

/// Snapshot `id` holds exactly `model`: content (whole and in pieces), extents, and its
/// digest is that of the model's content.
fn check_snapshot(f: &Fixture, id: u64, model: &Model) {
    let snap = f.store().snapshot(f.volume, id).unwrap_or_else(|| panic!("snapshot {id} exists"));
    check_as(f.store(), snap, model, snapshot_of(f, id).taken_at, &format!("snapshot {id}"));
}

/// Volume `handle` (a snapshot, a clone) holds exactly `model` at `sequence`: content (whole
/// and in pieces), extents, and its digest is that of the model's content.
pub(super) fn check_as(store: &Store, handle: VolumeHandle, model: &Model, sequence: Sequence, what: &str) {
    let size = model.bytes.len() as u64;
    let piece = size.min(PAYLOAD_BYTES_MAX as u64);
    for offset in (0..size).step_by(piece as usize) {
        let (at, data) = store.read(handle, offset, piece as u32).expect("read");
        assert_eq!(at, sequence, "{what}: a read reflects its sequence");
        let expected = &model.bytes[offset as usize..][..piece as usize];
        if data != expected {
            let first = offset as usize + data.iter().zip(expected).position(|(a, b)| a != b).expect("differs");
            panic!("{what} differs from its model first at byte {first} (block {})", first as u64 / BLOCK_BYTES);
        }
    }
    for (offset, length) in [(512, 512), (4096 - 512, 1024), (1000, 10000), (size - 4608, 4608)] {
        let (_, data) = store.read(handle, offset, length).expect("read a piece");
        assert_eq!(&data[..], &model.bytes[offset as usize..][..length as usize], "{what}: {length} at {offset}");
    }
    let (_, extents) = store.block_status(handle, 0, size).expect("block status");
    assert_eq!(extents, model.extents(0, size), "{what}: allocation extents");
    let (_, extents) = store.block_status(handle, 1536, 3 * BLOCK_BYTES).expect("block status");
    assert_eq!(extents, model.extents(1536, 3 * BLOCK_BYTES), "{what}: extents of a piece");
    assert_eq!(store.verify(handle).expect("verify").content_digest, digest_of(&model.bytes), "{what}: digest");
}

/// The content digest `Store::verify` computes, of bytes held in memory.
fn digest_of(bytes: &[u8]) -> u64 {
    bytes
        .chunks_exact(BLOCK_BYTES as usize)
        .enumerate()
        .map(|(b, block)| crate::volume::block_digest(b as u64, crc32c::crc32c(block)))
        .fold(0u64, u64::wrapping_add)
}

#[test]
fn snapshots_keep_their_content_while_the_volume_changes_and_across_reopening() {
    let size = 2 << 20;
    let mut f = Fixture::new("snapshots", size, small_options());
    let mut models = Vec::new();
    let mut n = 0;
    for id in 1..=4u64 {
        for _ in 0..60 {
            n += 1;
            // Batches of 1 to 5: a snapshot's preserving records share batches with writes
            // that touch the same block twice.
            let ops: Vec<Op> = (0..1 + n % 5).map(|k| random_op(n * 8 + k, size)).collect();
            f.commit(&ops);
        }
        models.push((id, take(&mut f, id)));
    }
    for n in 0..150 {
        f.commit(&[random_op(10_000 + n, size)]);
    }
    f.check();
    for (id, model) in &models {
        check_snapshot(&f, *id, model);
    }
    // Replayed from the log alone, then from a checkpoint.
    f.reopen();
    f.check();
    for (id, model) in &models {
        check_snapshot(&f, *id, model);
    }
    f.store().checkpoint().expect("checkpoint");
    f.reopen();
    for (id, model) in &models {
        check_snapshot(&f, *id, model);
    }
    let ids: Vec<u64> = f.store().snapshots(f.volume).iter().map(|s| s.id).collect();
    assert_eq!(ids, vec![1, 2, 3, 4], "listed oldest first");
}

#[test]
fn a_snapshot_in_the_middle_of_a_batch_takes_exactly_the_records_before_it() {
    let mut f = Fixture::new("snapshot-in-batch", 64 * BLOCK_BYTES, StoreOptions::default());
    f.commit(&[write_op(0, 8192, 1)]);
    let mut before = f.model.clone();
    before.apply(&write_op(512, 100, 2));
    // Two writes of one block around the snapshot, a partial one before, a trim after.
    f.commit(&[
        write_op(512, 100, 2),
        Op::Snapshot { id: 9 },
        write_op(0, 4096, 3),
        trim_op(0, 8192),
        write_op(600, 10, 4),
    ]);
    check_snapshot(&f, 9, &before);
    f.check();
    f.reopen();
    check_snapshot(&f, 9, &before);
}

#[test]
fn a_snapshot_costs_only_the_blocks_changed_after_it() {
    let blocks = 256;
    let mut f = Fixture::new("snapshot-cost", blocks * BLOCK_BYTES, StoreOptions::default());
    f.commit(&[write_op(0, (blocks * BLOCK_BYTES) as usize, 1)]);
    let model = take(&mut f, 1);
    assert_eq!(snapshot_of(&f, 1).blocks_owned, 0, "a new snapshot holds nothing");
    // 10 blocks written, 5 of them twice, and 3 trimmed: 13 blocks preserved once each.
    for k in 0..10 {
        f.commit(&[write_op(k * 7 * BLOCK_BYTES, 4096, 100 + k)]);
    }
    for k in 0..5 {
        f.commit(&[write_op(k * 7 * BLOCK_BYTES + 100, 50, 200 + k)]);
    }
    f.commit(&[trim_op(200 * BLOCK_BYTES, 3 * BLOCK_BYTES)]);
    assert_eq!(snapshot_of(&f, 1).blocks_owned, 13);
    check_snapshot(&f, 1, &model);
    // A second snapshot: the first no longer preserves, the new one does.
    let model2 = take(&mut f, 2);
    f.commit(&[write_op(0, 4096, 300), write_op(100 * BLOCK_BYTES, 4096, 301)]);
    assert_eq!(snapshot_of(&f, 1).blocks_owned, 13, "only the newest snapshot preserves");
    assert_eq!(snapshot_of(&f, 2).blocks_owned, 2);
    check_snapshot(&f, 1, &model);
    check_snapshot(&f, 2, &model2);
}

#[test]
fn deleting_a_snapshot_hands_its_blocks_to_the_older_one() {
    let size = 1 << 20;
    let mut f = Fixture::new("snapshot-delete", size, small_options());
    let mut models = Vec::new();
    for id in 1..=4u64 {
        for n in 0..40 {
            f.commit(&[random_op(id * 1000 + n, size)]);
        }
        models.push((id, take(&mut f, id)));
    }
    for n in 0..40 {
        f.commit(&[random_op(9000 + n, size)]);
    }
    let handle = |f: &Fixture, id| f.store().snapshot(f.volume, id).expect("exists");
    // A middle one, then the newest (the older one preserves from then on), then the oldest.
    for gone in [2u64, 4, 1] {
        let h = handle(&f, gone);
        f.store().remove_volume(h).expect("delete the snapshot");
        models.retain(|(id, _)| *id != gone);
        assert!(f.store().snapshot(f.volume, gone).is_none());
        assert!(matches!(f.store().read(h, 0, 4096), Err(StoreError::Removed { .. })));
        for n in 0..20 {
            f.commit(&[random_op(gone * 100_000 + n, size)]);
        }
        for (id, model) in &models {
            check_snapshot(&f, *id, model);
        }
        f.check();
    }
    f.reopen();
    for (id, model) in &models {
        check_snapshot(&f, *id, model);
    }
}

#[test]
fn a_large_trim_after_a_snapshot_preserves_in_several_commits() {
    // 96 MiB written, then trimmed whole: the preserving records carry more than one commit
    // takes, so they are committed in steps before the trim.
    let size = 96 << 20;
    let mut f = Fixture::new("snapshot-large-trim", size, StoreOptions::default());
    let chunk = PAYLOAD_BYTES_MAX as u64;
    for (k, offset) in (0..size).step_by(chunk as usize).enumerate() {
        f.commit(&[write_op(offset, chunk as usize, k as u64)]);
    }
    let model = take(&mut f, 1);
    f.commit(&[trim_op(0, size)]);
    f.check();
    assert_eq!(snapshot_of(&f, 1).blocks_owned, size / BLOCK_BYTES);
    check_snapshot(&f, 1, &model);
    f.reopen();
    check_snapshot(&f, 1, &model);
}

#[test]
fn removing_a_volume_removes_its_snapshots_and_their_files() {
    let mut f = Fixture::new("snapshot-remove-volume", 64 * BLOCK_BYTES, StoreOptions::default());
    f.commit(&[write_op(0, 65536, 1)]);
    take(&mut f, 1);
    f.commit(&[write_op(0, 65536, 2)]);
    take(&mut f, 2);
    let files = || fs::read_dir(f.dir.0.join("volumes")).expect("list").count();
    assert_eq!(files(), 6, "data and map files of the volume and two snapshots");
    let snaps: Vec<VolumeHandle> = f.store().snapshots(f.volume).iter().map(|s| s.handle).collect();
    f.store().remove_volume(f.volume).expect("remove");
    assert_eq!(files(), 0);
    for snap in snaps {
        assert!(matches!(f.store().read(snap, 0, 4096), Err(StoreError::Removed { .. })));
    }
    f.close();
    let store = Store::open(&f.dir.0, f.options).expect("reopen");
    assert!(store.volume("vol").is_none());
    assert!(store.volumes().is_empty(), "no snapshot survives its volume");
}

#[test]
fn a_snapshot_is_read_only_and_answers_only_reads() {
    let mut f = Fixture::new("snapshot-read-only", 64 * BLOCK_BYTES, StoreOptions::default());
    f.commit(&[write_op(0, 4096, 1)]);
    take(&mut f, 1);
    let snap = f.store().snapshot(f.volume, 1).expect("exists");
    let outcome = f.store().commit(&[(snap, record(1, write_op(0, 4096, 2)))]).expect("commit");
    assert!(matches!(outcome.rejected[0].error, StoreError::Snapshot { .. }), "{outcome:?}");
    assert!(matches!(f.store().resize_volume(snap, 128 * BLOCK_BYTES), Err(StoreError::Snapshot { .. })));
    assert!(matches!(f.store().log_records(snap, Sequence::ZERO, 1 << 20), Err(StoreError::Snapshot { .. })));
    assert!(matches!(f.store().scrub_chunk(snap, 0, 16), Err(StoreError::Snapshot { .. })));
    assert_eq!(f.store().snapshot_parent(snap), Some(f.volume));
    assert!(f.store().volume("vol@1").is_none(), "snapshots are not found by volume name");
    // A snapshot record sent again under a later sequence changes nothing.
    let model = f.model.clone();
    f.commit(&[write_op(0, 4096, 3)]);
    f.commit(&[Op::Snapshot { id: 1 }]);
    assert_eq!(f.store().snapshots(f.volume).len(), 1);
    let mut first = model.clone();
    first.bytes[..4096].copy_from_slice(&pattern(1, 4096));
    check_snapshot(&f, 1, &first);
    // The replay log serves the snapshot record to peers as it came.
    let records = f.store().log_records(f.volume, Sequence::ZERO, 1 << 20).expect("log");
    assert_eq!(records[1].op, Op::Snapshot { id: 1 });
}

#[test]
fn a_snapshot_whose_record_a_crash_lost_is_removed_at_open() {
    let mut f = Fixture::new("snapshot-lost-record", 64 * BLOCK_BYTES, super::exact_growth());
    f.commit(&[write_op(0, 4096, 1)]);
    let segment = f.live_segment();
    let before = log_end(&segment);
    f.commit(&[Op::Snapshot { id: 7 }]);
    f.close();
    // The snapshot's volume was made, but its record never reached the disk.
    let bytes = fs::read(&segment).expect("read segment");
    fs::write(&segment, &bytes[..before as usize]).expect("cut the record");
    f.applied -= 1;
    f.reopen();
    f.check();
    assert!(f.store().snapshots(f.volume).is_empty());
    assert_eq!(fs::read_dir(f.dir.0.join("volumes")).expect("list").count(), 2, "its files are gone");
    // Sent again, it is taken.
    take(&mut f, 7);
    assert_eq!(f.store().snapshots(f.volume).len(), 1);
}

// ---------------------------------------------------------------------------------------------
// kill -9 with snapshots: every 23rd record takes one, and a record deletes each one 80
// records later (so kills land in preserving commits and in deletions).
// ---------------------------------------------------------------------------------------------

const SNAPSHOT_EVERY: u64 = 23;
const SNAPSHOT_KEPT: u64 = 80;

fn crash_op_with_snapshots(sequence: u64) -> Op {
    if sequence % SNAPSHOT_EVERY == 0 {
        Op::Snapshot { id: sequence }
    } else if sequence > SNAPSHOT_KEPT && (sequence - SNAPSHOT_KEPT) % SNAPSHOT_EVERY == 0 {
        Op::SnapshotDelete { id: sequence - SNAPSHOT_KEPT }
    } else {
        crash_op(sequence)
    }
}

#[test]
fn crash_child_with_snapshots() {
    run_crash_child(crash_op_with_snapshots, |_, _| {});
}

#[test]
fn every_snapshot_survives_kill_9_with_its_content() {
    kill_9_rounds_of(
        "kill-9-snapshots",
        "tests::snapshots::crash_child_with_snapshots",
        0,
        5,
        |store, volume, applied, round| {
            let snapshots = store.snapshots(volume);
            let expected: Vec<u64> =
                (1..=applied).filter(|s| s % SNAPSHOT_EVERY == 0 && s + SNAPSHOT_KEPT > applied).collect();
            let ids: Vec<u64> = snapshots.iter().map(|s| s.id).collect();
            assert_eq!(ids, expected, "round {round}: the snapshots taken and not deleted by sequence {applied}");
            let mut model = Model::new(CRASH_VOLUME_BYTES);
            let mut s = 0;
            for snapshot in &snapshots {
                assert_eq!(snapshot.taken_at, Sequence(snapshot.id), "taken at its record");
                while s < snapshot.id {
                    s += 1;
                    model.apply(&crash_op_with_snapshots(s));
                }
                let (_, data) = store.read(snapshot.handle, 0, CRASH_VOLUME_BYTES as u32).expect("read snapshot");
                assert!(data == model.bytes, "round {round}: snapshot {} differs from its model", snapshot.id);
                assert_eq!(store.verify(snapshot.handle).expect("verify").content_digest, digest_of(&model.bytes));
            }
            while s < applied {
                s += 1;
                model.apply(&crash_op_with_snapshots(s));
            }
            let (_, data) = store.read(volume, 0, CRASH_VOLUME_BYTES as u32).expect("read");
            assert!(data == model.bytes, "round {round}: the volume differs from the model at {applied}");
        },
    );
}

/// The kill -9 child with clones: after the commit that takes a snapshot, it makes a clone of
/// every other one (`c<id>`); the snapshot's deletion, 80 records later, materializes its clone
/// (kills land in that too).
#[test]
fn crash_child_with_clones() {
    run_crash_child(crash_op_with_snapshots, |store, volume| {
        for s in store.snapshots(volume) {
            let name = format!("c{}", s.id);
            if s.id % (2 * SNAPSHOT_EVERY) == 0 && store.volume(&name).is_none() {
                store.ensure_clone(&name, CRASH_VOLUME_BYTES, "vol", s.id).expect("child: clone");
            }
        }
    });
}

#[test]
fn every_clone_survives_kill_9_with_its_snapshots_content_as_its_base_goes() {
    kill_9_rounds_of("kill-9-clones", "tests::snapshots::crash_child_with_clones", 0, 5, |store, _, applied, round| {
        let mut clones: Vec<(u64, VolumeHandle)> = store
            .volumes()
            .iter()
            .filter_map(|(name, _)| Some((name.strip_prefix('c')?.parse().ok()?, store.volume(name)?)))
            .collect();
        clones.sort();
        assert!(round < 2 || !clones.is_empty(), "round {round}: the child made clones (applied {applied})");
        let mut model = Model::new(CRASH_VOLUME_BYTES);
        let mut s = 0;
        for (id, clone) in clones {
            while s < id {
                s += 1;
                model.apply(&crash_op_with_snapshots(s));
            }
            let (at, data) = store.read(clone, 0, CRASH_VOLUME_BYTES as u32).expect("read clone");
            assert_eq!(at, Sequence::ZERO, "a clone nothing wrote");
            assert!(data == model.bytes, "round {round}: clone c{id} differs from its snapshot's model");
            let based = id + SNAPSHOT_KEPT > applied;
            println!("round {round}: clone c{id} holds its snapshot ({})", if based { "shared" } else { "its own" });
        }
    });
}

#[test]
fn a_snapshot_deleted_by_a_record_is_gone_even_if_a_crash_cut_its_deletion_short() {
    let size = 256 * BLOCK_BYTES;
    let mut f = Fixture::new("snapshot-delete-record", size, StoreOptions::default());
    let mut models = Vec::new();
    for id in 1..=3u64 {
        for n in 0..30 {
            f.commit(&[random_op(id * 1000 + n, size)]);
        }
        models.push((id, take(&mut f, id)));
    }
    f.commit(&[random_op(5000, size), Op::SnapshotDelete { id: 2 }, random_op(5001, size)]);
    models.retain(|(id, _)| *id != 2);
    for (id, model) in &models {
        check_snapshot(&f, *id, model);
    }
    // Sent again, or naming a snapshot that never existed: nothing happens.
    f.commit(&[Op::SnapshotDelete { id: 2 }, Op::SnapshotDelete { id: 99 }]);
    assert_eq!(f.store().snapshots(f.volume).iter().map(|s| s.id).collect::<Vec<_>>(), vec![1, 3]);
    let records = f.store().log_records(f.volume, Sequence::ZERO, 64 << 20).expect("log");
    assert!(records.iter().any(|r| r.op == Op::SnapshotDelete { id: 99 }), "served to peers as it came");

    // A crash after the deletion's record was durable, before the metadata changed: the
    // metadata and the snapshot's files are as they were before, and the log holds the record.
    let snap = f.store().snapshot(f.volume, 3).expect("exists");
    let number = snap.number();
    let volumes = f.dir.0.join("volumes");
    let saved: Vec<(PathBuf, Vec<u8>)> =
        ["meta".to_string(), format!("volumes/{number}.data"), format!("volumes/{number}.map")]
            .iter()
            .map(|p| (f.dir.0.join(p), fs::read(f.dir.0.join(p)).expect("read")))
            .collect();
    f.commit(&[Op::SnapshotDelete { id: 3 }]);
    models.retain(|(id, _)| *id != 3);
    f.close();
    assert!(fs::read_dir(&volumes).expect("list").count() < 6);
    for (path, bytes) in &saved {
        fs::write(path, bytes).expect("restore");
    }
    f.reopen();
    assert_eq!(f.store().snapshots(f.volume).iter().map(|s| s.id).collect::<Vec<_>>(), vec![1]);
    for (id, model) in &models {
        check_snapshot(&f, *id, model);
    }
    f.check();
    assert_eq!(fs::read_dir(&volumes).expect("list").count(), 4, "the deleted snapshot's files are gone");
}

#[test]
fn repair_removes_snapshots_it_cannot_vouch_for() {
    // A damaged snapshot's block map: the snapshot goes, its volume stays whole.
    let mut f = Fixture::new("snapshot-map-damage", 64 * BLOCK_BYTES, super::exact_growth());
    f.commit(&[write_op(0, 65536, 1)]);
    take(&mut f, 1);
    f.commit(&[write_op(0, 8192, 2)]);
    f.store().checkpoint().expect("checkpoint");
    let number = f.store().snapshot(f.volume, 1).expect("taken").number();
    f.close();
    let map = f.dir.0.join(format!("volumes/{number}.map"));
    let mut bytes = fs::read(&map).expect("read map");
    bytes[4096 + 16] ^= 1;
    fs::write(&map, &bytes).expect("write map");
    assert!(matches!(Store::open(&f.dir.0, f.options).err(), Some(StoreError::CorruptBlockMap { .. })));
    let report = Store::repair(&f.dir.0, f.options).expect("repair");
    assert!(report.volumes_to_repair.is_empty() && report.actions[0].contains("removed snapshot"), "{report:?}");
    f.reopen();
    f.check();
    assert!(f.store().snapshots(f.volume).is_empty());
    assert_eq!(fs::read_dir(f.dir.0.join("volumes")).expect("list").count(), 2, "its files are gone");

    // A log truncated by repair may have lost preserving records: the volume's snapshots go.
    let mut f = Fixture::new("snapshot-log-damage", 64 * BLOCK_BYTES, super::exact_growth());
    f.commit(&[write_op(0, 65536, 1)]);
    take(&mut f, 1);
    f.commit(&[write_op(0, 8192, 2)]);
    let segment = f.live_segment();
    let start = log_end(&segment);
    f.commit(&[write_op(16384, 8192, 3)]);
    f.close();
    let mut damaged = fs::read(&segment).expect("read segment");
    damaged[start as usize + 200] ^= 0x08;
    fs::write(&segment, &damaged).expect("write segment");
    assert!(Store::open(&f.dir.0, f.options).is_err(), "the damage refuses to open");
    let report = Store::repair(&f.dir.0, f.options).expect("repair");
    assert_eq!(report.volumes_to_repair, vec!["vol".to_string()], "{report:?}");
    assert!(report.actions.iter().any(|a| a.contains("removed the 1 snapshot(s) of volume vol")), "{report:?}");
    f.applied -= 1;
    f.reopen();
    assert!(f.store().snapshots(f.volume).is_empty());
    assert!(f.store().copy_state(f.volume).is_some_and(|s| s.is_pending_repair()));
}

#[test]
fn a_full_copy_brings_the_snapshots_taken_before_its_base_and_replay_the_rest() {
    let options = StoreOptions { checkpoint_log_bytes: 1 << 20, replay_log_bytes: 64 << 20, ..StoreOptions::default() };
    let dir_s = TempDir::new("snapshot-copy-source");
    let source = Store::open(&dir_s.0, options).expect("open");
    let s = source.ensure_volume("vol", VOLUME).expect("volume");
    let snap = |store: &Store, v, sequence: u64, op: Op| {
        let outcome =
            store.commit(&[(v, Record { volume: VolumeId(0), epoch: Epoch(1), sequence: Sequence(sequence), op })]);
        assert!(outcome.expect("commit").rejected.is_empty());
    };
    write_history(&source, s, 1, 200, 21, 1);
    snap(&source, s, 201, Op::Snapshot { id: 1 });
    write_history(&source, s, 202, 200, 22, 1);
    snap(&source, s, 402, Op::Snapshot { id: 2 });
    write_history(&source, s, 403, 100, 23, 1);
    // A target holding a snapshot of its own (a diverged history's): the copy replaces it.
    let dir_t = TempDir::new("snapshot-copy-target");
    let target = Store::open(&dir_t.0, options).expect("open");
    let t = target.ensure_volume("vol", VOLUME).expect("volume");
    write_history(&target, t, 1, 50, 99, 1);
    snap(&target, t, 51, Op::Snapshot { id: 9 });
    assert!(copy_pass(&source, s, &target, t, 97, None));
    let ids = |store: &Store, v| store.snapshots(v).iter().map(|x| (x.id, x.taken_at)).collect::<Vec<_>>();
    assert_eq!(ids(&target, t), ids(&source, s));
    let same = |id| {
        let (a, b) = (source.snapshot(s, id).expect("source"), target.snapshot(t, id).expect("target"));
        (source.read(a, 0, VOLUME as u32).expect("read").1, digest(&source, a))
            == (target.read(b, 0, VOLUME as u32).expect("read").1, digest(&target, b))
    };
    assert!(same(1) && same(2), "the copied snapshots read as the source's");
    // The records after the base: writes (the target's newest snapshot owns every block
    // already), a new snapshot and a deletion, replayed.
    write_history(&source, s, 503, 100, 24, 1);
    snap(&source, s, 603, Op::Snapshot { id: 3 });
    snap(&source, s, 604, Op::SnapshotDelete { id: 1 });
    write_history(&source, s, 605, 100, 25, 1);
    replay_into(&source, s, &target, t);
    assert_eq!(ids(&target, t), ids(&source, s));
    assert!(same(2) && same(3));
    assert_eq!(digest(&target, t), digest(&source, s));
    // And it all survives reopening.
    drop(target);
    let target = Store::open(&dir_t.0, options).expect("reopen");
    let t = target.volume("vol").expect("volume");
    assert_eq!(ids(&target, t), ids(&source, s));
    let b = target.snapshot(t, 2).expect("kept");
    assert_eq!(digest(&target, b), digest(&source, source.snapshot(s, 2).expect("source")));
}

#[test]
fn a_snapshot_a_crash_left_half_copied_is_removed_at_open() {
    let options = StoreOptions { checkpoint_log_bytes: 1 << 20, replay_log_bytes: 64 << 20, ..StoreOptions::default() };
    let dir_s = TempDir::new("half-copy-source");
    let source = Store::open(&dir_s.0, options).expect("open");
    let s = source.ensure_volume("vol", VOLUME).expect("volume");
    write_history(&source, s, 1, 100, 31, 1);
    let r = Record { volume: VolumeId(0), epoch: Epoch(1), sequence: Sequence(101), op: Op::Snapshot { id: 4 } };
    assert!(source.commit(&[(s, r)]).expect("commit").rejected.is_empty());
    let dir_t = TempDir::new("half-copy-target");
    let target = Store::open(&dir_t.0, options).expect("open");
    let t = target.ensure_volume("vol", VOLUME).expect("volume");
    target.begin_copy(t, Epoch(1)).expect("begin");
    let h = target.begin_snapshot_copy(t, 4, Sequence(101), VOLUME).expect("begin the snapshot");
    let from = source.snapshot(s, 4).expect("taken");
    let have = target.block_summaries(h, 0, 64).expect("summaries");
    target.install_blocks(h, &source.copy_chunk(from, 0, &have).expect("chunk").blocks).expect("install");
    target.checkpoint().expect("durable, but not finished");
    assert!(target.snapshots(t).is_empty(), "hidden while it is copied");
    drop(target);
    let target = Store::open(&dir_t.0, options).expect("reopen");
    let t = target.volume("vol").expect("volume");
    assert!(target.snapshots(t).is_empty() && target.volumes().len() == 1, "{:?}", target.volumes());
    assert!(target.copy_state(t).is_some(), "the volume's copy goes on (and copies the snapshot again)");
}
