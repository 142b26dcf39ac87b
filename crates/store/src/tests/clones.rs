//! Clones against the byte-array model: a clone starts with its snapshot's content, diverges
//! with its own writes, owns only what it wrote, and keeps its content when its base goes (a
//! deleted snapshot, a removed volume, its volume's full recovery) or when it is copied whole.

use super::snapshots::{check_as, random_op};
use super::*;

/// One more volume of a store, with its model and sequence.
struct Extra {
    handle: VolumeHandle,
    model: Model,
    applied: u64,
}

impl Extra {
    fn commit(&mut self, store: &Store, ops: &[Op]) {
        let batch: Vec<(VolumeHandle, Record)> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| (self.handle, record(self.applied + 1 + i as u64, op.clone())))
            .collect();
        let outcome = store.commit(&batch).expect("commit");
        assert!(outcome.rejected.is_empty(), "rejected: {:?}", outcome.rejected);
        for op in ops {
            self.model.apply(op);
        }
        self.applied += ops.len() as u64;
    }
}

fn clone_of(f: &Fixture, name: &str, model: &Model, snapshot: u64) -> Extra {
    let handle = f.store().ensure_clone(name, f.size_bytes, "vol", snapshot).expect("create the clone");
    Extra { handle, model: model.clone(), applied: 0 }
}

#[test]
fn a_clone_starts_as_its_snapshot_diverges_and_owns_only_what_it_wrote() {
    let size = 1 << 20;
    let mut f = Fixture::new("clone", size, small_options());
    for n in 0..80 {
        f.commit(&[random_op(n, size)]);
    }
    f.commit(&[write_op(0, size as usize, 77)]);
    f.commit(&[trim_op(BLOCK_BYTES, 8 * BLOCK_BYTES), write_op(9000, 3000, 78)]);
    f.commit(&[Op::Snapshot { id: 1 }]);
    let snapshot = f.model.clone();
    let mut c = clone_of(&f, "c", &snapshot, 1);
    check_as(f.store(), c.handle, &c.model, Sequence::ZERO, "a new clone");
    assert_eq!(f.store().owned_blocks(c.handle), 0, "a new clone owns nothing");
    // Partial writes and trims of blocks it reads through, whole writes; the volume changes too.
    c.commit(f.store(), &[write_op(512, 1000, 1), trim_op(3 * BLOCK_BYTES + 512, 512), zeroes_op(40960, 8192)]);
    c.commit(f.store(), &[write_op(20 * BLOCK_BYTES, 4 * BLOCK_BYTES as usize, 2)]);
    for n in 0..40 {
        f.commit(&[random_op(500 + n, size)]);
        c.commit(f.store(), &[random_op(900 + n, size)]);
    }
    check_as(f.store(), c.handle, &c.model, Sequence(c.applied), "the clone");
    f.check();
    let snap = f.store().snapshot(f.volume, 1).expect("snapshot");
    check_as(f.store(), snap, &snapshot, f.store().snapshots(f.volume)[0].taken_at, "its snapshot");
    let owned = f.store().owned_blocks(c.handle);
    assert!(owned > 0 && owned < size / BLOCK_BYTES / 2, "the clone owns {owned} blocks: only what it changed");
    // Through checkpoints and reopening.
    f.store().checkpoint().expect("checkpoint");
    c.commit(f.store(), &[write_op(100, 50, 3)]);
    f.reopen();
    c.handle = f.store().volume("c").expect("the clone survives");
    check_as(f.store(), c.handle, &c.model, Sequence(c.applied), "the clone reopened");
    f.check();
}

#[test]
fn a_clone_can_be_snapshotted_and_cloned() {
    let size = 512 * 1024;
    let mut f = Fixture::new("clone-of-clone", size, small_options());
    for n in 0..50 {
        f.commit(&[random_op(n, size)]);
    }
    f.commit(&[Op::Snapshot { id: 1 }]);
    let mut c = clone_of(&f, "c", &f.model.clone(), 1);
    for n in 0..30 {
        c.commit(f.store(), &[random_op(100 + n, size)]);
    }
    c.commit(f.store(), &[Op::Snapshot { id: 2 }]);
    let of_c = c.model.clone();
    let d = f.store().ensure_clone("d", size, "c", 2).expect("a clone of the clone");
    let mut d = Extra { handle: d, model: of_c.clone(), applied: 0 };
    for n in 0..30 {
        c.commit(f.store(), &[random_op(200 + n, size)]);
        d.commit(f.store(), &[random_op(300 + n, size)]);
        f.commit(&[random_op(400 + n, size)]);
    }
    let snap = f.store().snapshot(c.handle, 2).expect("the clone's snapshot");
    check_as(f.store(), snap, &of_c, Sequence(31), "the clone's snapshot");
    check_as(f.store(), d.handle, &d.model, Sequence(d.applied), "the clone of the clone");
    check_as(f.store(), c.handle, &c.model, Sequence(c.applied), "the clone");
    f.check();
}

#[test]
fn a_clone_keeps_its_content_when_its_base_goes() {
    let size = 512 * 1024;
    let mut f = Fixture::new("clone-base-goes", size, small_options());
    for n in 0..60 {
        f.commit(&[random_op(n, size)]);
    }
    f.commit(&[Op::Snapshot { id: 1 }]);
    let mut c = clone_of(&f, "c", &f.model.clone(), 1);
    f.commit(&[Op::Snapshot { id: 2 }]);
    let mut e = clone_of(&f, "e", &f.model.clone(), 2);
    for n in 0..20 {
        c.commit(f.store(), &[random_op(100 + n, size)]);
        e.commit(f.store(), &[random_op(150 + n, size)]);
        f.commit(&[random_op(200 + n, size)]);
    }
    // The deletion of snapshot 1 (a record of its volume): c comes to own its content.
    f.commit(&[Op::SnapshotDelete { id: 1 }]);
    let owned = f.store().owned_blocks(c.handle);
    assert!(owned >= size / BLOCK_BYTES - holes_of(&c.model), "it owns every block with data ({owned})");
    check_as(f.store(), c.handle, &c.model, Sequence(c.applied), "the clone of a deleted snapshot");
    check_as(f.store(), e.handle, &e.model, Sequence(e.applied), "the other clone");
    c.commit(f.store(), &[random_op(300, size)]);
    f.reopen();
    c.handle = f.store().volume("c").expect("c");
    e.handle = f.store().volume("e").expect("e");
    check_as(f.store(), c.handle, &c.model, Sequence(c.applied), "reopened, with no base");
    // The volume goes, and snapshot 2 with it.
    f.store().remove_volume(f.volume).expect("remove the volume");
    check_as(f.store(), e.handle, &e.model, Sequence(e.applied), "the clone of a removed volume's snapshot");
    f.store().checkpoint().expect("checkpoint");
    drop(f.store.take());
    let store = Store::open(&f.dir.0, f.options).expect("reopen");
    let e_handle = store.volume("e").expect("e");
    check_as(&store, e_handle, &e.model, Sequence(e.applied), "reopened after its base volume went");
}

/// Blocks the model holds as holes (a clone that came to own its content may hold those as
/// holes at sequence 0, which it does not own).
fn holes_of(model: &Model) -> u64 {
    model.allocated.iter().filter(|a| !**a).count() as u64
}

#[test]
fn a_clone_of_a_snapshot_this_store_lacks_waits_for_a_full_recovery_that_copies_it_whole() {
    let size = 512 * 1024;
    let mut f = Fixture::new("clone-copy-source", size, small_options());
    for n in 0..60 {
        f.commit(&[random_op(n, size)]);
    }
    f.commit(&[Op::Snapshot { id: 1 }]);
    let mut c = clone_of(&f, "c", &f.model.clone(), 1);
    for n in 0..25 {
        c.commit(f.store(), &[random_op(100 + n, size)]);
    }
    // A target that has the volume but not the snapshot: the clone is created to be copied.
    let dir_t = TempDir::new("clone-copy-target");
    let target = Store::open(&dir_t.0, small_options()).expect("open");
    target.ensure_volume("vol", size).expect("volume");
    let t = target.ensure_clone("c", size, "vol", 1).expect("a clone to copy");
    assert!(target.copy_state(t).is_some(), "copying: it holds nothing yet");
    target.begin_copy(t, Epoch(1)).expect("begin");
    let blocks = size / BLOCK_BYTES;
    let have = target.block_summaries(t, 0, blocks).expect("summaries");
    let chunk = f.store().copy_chunk(c.handle, 0, &have).expect("chunk");
    assert_eq!(chunk.applied, Sequence(c.applied));
    target.set_copy_base(t, chunk.applied, chunk.applied_epoch).expect("base");
    target.install_blocks(t, &chunk.blocks).expect("install");
    target.save_copy_cursor(t, blocks).expect("cursor");
    target.finish_copy(t).expect("finish");
    check_as(&target, t, &c.model, Sequence(c.applied), "the copied clone");
    assert_eq!(target.verify(t).expect("verify").content_digest, f.store().verify(c.handle).expect("v").content_digest);
    // Its summaries agree with the source's, where it shares its blocks.
    let ours = f.store().copy_chunk(c.handle, 0, &target.block_summaries(t, 0, blocks).expect("s"));
    assert!(ours.expect("chunk").blocks.is_empty(), "nothing differs once copied");
    // A full recovery of the source's clone (it has its base) copies it whole too.
    f.store().begin_copy(c.handle, Epoch(2)).expect("begin a copy of a clone");
    let have = f.store().block_summaries(c.handle, 0, blocks).expect("summaries");
    let chunk = target.copy_chunk(t, 0, &have).expect("chunk");
    f.store().set_copy_base(c.handle, chunk.applied, chunk.applied_epoch).expect("base");
    f.store().install_blocks(c.handle, &chunk.blocks).expect("install");
    f.store().save_copy_cursor(c.handle, blocks).expect("cursor");
    f.store().finish_copy(c.handle).expect("finish");
    check_as(f.store(), c.handle, &c.model, Sequence(c.applied), "a clone copied back whole");
}

#[test]
fn snapshot_and_clone_reads_racing_commits_and_deletions_see_their_content_and_never_fail() {
    // The reads run without the chain's locks: a block its volume overwrites (after
    // preserving it) or a newer snapshot being deleted (its blocks handed over, its file
    // emptied) under a read makes the read start again, never return other content or fail.
    let size = 64 * BLOCK_BYTES;
    let mut f = Fixture::new("chain-race", size, StoreOptions::default());
    f.commit(&[write_op(0, size as usize, 1)]);
    f.commit(&[Op::Snapshot { id: 1 }]);
    let expected = f.model.bytes.clone();
    let store = f.store();
    let (volume, mut sequence) = (f.volume, f.applied);
    let clone = store.ensure_clone("c", size, "vol", 1).expect("clone");
    let snap = store.snapshot(volume, 1).expect("snapshot");
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut reads = 0u64;
            while !done.load(Ordering::Acquire) {
                for handle in [snap, clone] {
                    let (_, data) = store.read(handle, 0, size as u32).expect("a read never fails here");
                    assert!(data == expected, "a read of the snapshot or its clone saw other content");
                    reads += 1;
                }
            }
            reads
        });
        for n in 0..150u64 {
            sequence += 1;
            let op = match n % 10 {
                // A newer snapshot, deleted a few records later: snapshot 1 takes its blocks.
                3 => Op::Snapshot { id: 1000 + n },
                8 => Op::SnapshotDelete { id: 1000 + n - 5 },
                _ => write_op((n * 7 % 60) * BLOCK_BYTES, 4 * BLOCK_BYTES as usize, 100 + n),
            };
            let outcome = store.commit(&[(volume, record(sequence, op))]).expect("commit");
            assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
        }
        done.store(true, Ordering::Release);
        let reads = reader.join().expect("reader");
        assert!(reads > 0);
        println!("{reads} reads of a snapshot and its clone raced 150 commits");
    });
}
