use super::*;

fn ms(n: u64) -> Time {
    Time(n * 1000)
}

#[test]
fn documents_round_trip_and_damage_is_refused() {
    assert_eq!(Catalog::decode(&vec![0u8; 4096]), Ok(Catalog::default()), "all zero: a new cluster");
    let catalog = Catalog {
        version: 7,
        next_id: 12,
        volumes: vec![CatalogVolume::new("db".into(), 1 << 30, 3)],
        intentions: vec![Intention {
            id: 11,
            op: Intent::Create {
                name: "logs".into(),
                size_bytes: 8 << 20,
                clone_of: None,
                member_of: None,
                storage_bytes: 8 << 20,
            },
        }],
        snapshots: Vec::new(),
        grown: Vec::new(),
    };
    let doc = catalog.encode();
    assert_eq!(doc.len() % 4096, 0);
    assert_eq!(Catalog::stored_bytes(&doc[..4096]), Ok(Some(4096)));
    assert_eq!(Catalog::decode(&doc).as_ref(), Ok(&catalog));
    for at in [0, 9, 13, 20, 40] {
        let mut bad = doc.clone();
        bad[at] ^= 0x10;
        assert!(Catalog::decode(&bad).is_err(), "a flip at byte {at} is noticed");
    }
    assert!(Catalog::decode(&doc[..16]).is_err(), "cut short");
    // Well-formed but wrong: an id not below next_id, a name twice, a bad size.
    for broken in [
        Catalog { next_id: 3, ..catalog.clone() },
        Catalog {
            intentions: vec![Intention {
                id: 11,
                op: Intent::Create {
                    name: "db".into(),
                    size_bytes: 4096,
                    clone_of: None,
                    member_of: None,
                    storage_bytes: 4096,
                },
            }],
            ..catalog.clone()
        },
        Catalog { volumes: vec![CatalogVolume::new("db".into(), 1000, 3)], ..catalog.clone() },
    ] {
        assert!(Catalog::decode(&broken.encode()).is_err(), "{broken:?}");
    }
    // A starting host element serves what was created and what was intended.
    let served: Vec<String> = catalog.volumes_to_serve().into_iter().map(|(n, s)| format!("{n}={}", s.name)).collect();
    assert_eq!(served, ["db=db#3", "logs=logs#11"]);
    let mut rolled = catalog.clone();
    assert_eq!(rolled.roll_forward(), 1);
    assert!(rolled.intentions.is_empty() && rolled.volumes.len() == 2);
}

#[test]
fn names_and_sizes_are_checked() {
    for bad in ["", ".catalog", "a/b", "a b", "x#1", "v@snap", &"n".repeat(201)] {
        assert!(check_name(bad).is_err(), "{bad:?}");
    }
    for good in ["vol1", "db-01.data_2", &"n".repeat(200)] {
        assert_eq!(check_name(good), Ok(()));
    }
    for bad in [0, 512, 1000, 4097, VOLUME_BYTES_MAX + 4096] {
        assert!(check_size(bad).is_err(), "{bad}");
    }
    assert_eq!(check_size(4096), Ok(()));
}

#[test]
fn single_commit_writes_one_intention_at_a_time_in_order() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Single);
    let a = log.intend_create(ms(0), "a", 1 << 20).expect("a");
    let b = log.intend_create(ms(0), "b", 1 << 20).expect("b");
    assert!(log.intend_create(ms(0), "a", 1 << 20).is_err(), "a name waiting to be logged is taken");
    let first = log.poll_write(ms(0)).expect("due at once");
    assert_eq!(first.logs, vec![a.clone()]);
    assert_eq!(log.poll_write(ms(0)), None, "one write at a time");
    assert_eq!(Catalog::decode(&first.document).expect("valid").intentions, vec![a.clone()]);
    assert_eq!(log.written(), vec![a.clone()]);
    let second = log.poll_write(ms(1)).expect("the next");
    assert_eq!(second.logs, vec![b.clone()]);
    log.written();
    // Completions are written at once too; the volume is listed, the intention gone.
    log.finish(ms(2), a.id, true);
    log.finish(ms(2), b.id, false);
    let done = log.poll_write(ms(2)).expect("completions");
    assert!(done.logs.is_empty());
    let catalog = Catalog::decode(&done.document).expect("valid");
    assert!(catalog.intentions.is_empty());
    assert_eq!(catalog.volumes, vec![CatalogVolume::new("a".into(), 1 << 20, a.id)]);
    assert!(!log.has_name("b"), "an undone creation frees its name");
    log.written();
    assert!(log.idle());
}

#[test]
fn group_commit_waits_for_a_batch_or_its_deadline() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Group);
    log.intend_create(ms(0), "a", 4096).expect("a");
    assert_eq!(log.poll_write(ms(5)), None, "waits for others");
    assert_eq!(log.deadline(), Some(ms(GROUP_WAIT_MS)));
    let w = log.poll_write(ms(GROUP_WAIT_MS)).expect("due at the deadline");
    assert_eq!(w.logs.len(), 1);
    log.written();
    for k in 0..GROUP_BATCH {
        log.intend_create(ms(20), &format!("v{k}"), 4096).expect("v");
    }
    let w = log.poll_write(ms(20)).expect("a full batch goes at once");
    assert_eq!(w.logs.len(), GROUP_BATCH);
    assert_eq!(Catalog::decode(&w.document).expect("valid").intentions.len(), 1 + GROUP_BATCH);
    // A failed write undoes its intentions (the next write says so).
    assert_eq!(log.write_failed().len(), GROUP_BATCH);
    let w = log.poll_write(ms(21)).expect("the undoing is written");
    assert_eq!(Catalog::decode(&w.document).expect("valid").intentions.len(), 1);
}

#[test]
fn no_logging_executes_at_once_and_lists_after() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::None);
    let a = log.intend_create(ms(0), "a", 4096).expect("a");
    assert_eq!(log.poll_write(ms(0)), None, "nothing logged");
    assert_eq!(log.take_unlogged(), vec![a.clone()]);
    log.finish_unlogged(ms(1), a.volume());
    let w = log.poll_write(ms(1)).expect("the completion lists it");
    assert_eq!(Catalog::decode(&w.document).expect("valid").volumes, vec![a.volume()]);
}

/// A deletion: its intention's write drops the volume's entry and is rolled forward by a
/// starting host element (a placeholder in creation order); its completion drops the
/// intention; one undone lists the volume again, and only once a write says so is the undoing
/// durable (`take_durable`).
#[test]
fn deletions_are_logged_completed_and_undone() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Single);
    for (name, at) in [("a", 0), ("b", 1)] {
        let i = log.intend_create(ms(at), name, 4096).expect("create");
        log.poll_write(ms(at)).expect("logged");
        log.written();
        log.finish(ms(at), i.id, true);
    }
    log.poll_write(ms(2)).expect("completions");
    log.written();
    assert!(log.intend_delete(ms(3), "zz", false).expect_err("unknown").contains("no volume zz"));
    let d = log.intend_delete(ms(3), "a", false).expect("delete a");
    assert!(log.intend_delete(ms(3), "a", false).is_err(), "deleted once");
    let w = log.poll_write(ms(3)).expect("the deletion is logged");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert_eq!(on_disk.volumes.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["b"], "its entry leaves");
    assert_eq!(on_disk.intentions, vec![d.clone()]);
    assert_eq!(on_disk.removed_to_serve(), ["a#0"]);
    let restart: Vec<(String, u64)> =
        on_disk.volumes_to_restart().into_iter().map(|(_, s)| (s.name, s.size_bytes)).collect();
    assert_eq!(restart, [("a#0".to_string(), 0), ("b#1".to_string(), 4096)], "creation order, a placeholder");
    let mut rolled = on_disk.clone();
    rolled.roll_forward();
    assert_eq!(rolled.intentions.len(), 1, "a deletion stays until every element removed it");
    assert_eq!(log.written(), vec![d.clone()]);
    // Its name is free at once (a new volume is another storage volume).
    log.intend_create(ms(4), "a", 8192).expect("the name is free");
    log.poll_write(ms(4)).expect("logged");
    log.written();
    log.finish(ms(5), d.id, true);
    let w = log.poll_write(ms(5)).expect("the completion");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert!(on_disk.intentions.iter().all(|i| i.id != d.id), "completed");
    log.written();
    // Undone: the entry comes back, known durable only after a write that says so.
    let e = log.intend_delete(ms(6), "b", false).expect("delete b");
    log.poll_write(ms(6)).expect("logged");
    assert_eq!(log.write_failed(), vec![e.clone()]);
    log.take_durable();
    let w = log.poll_write(ms(7)).expect("rewritten at once");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert!(on_disk.volumes.iter().any(|v| v.name == "b") && on_disk.intentions.iter().all(|i| i.id != e.id));
    assert!(log.take_durable().is_empty(), "not durable before the write is");
    log.written();
    assert!(log.take_durable().contains(&(e.id, false)));
}

/// A volume whose creation was carried out but not yet completed on disk (a starting host
/// element rolled it forward; group commit waits) can be deleted at once.
#[test]
fn a_creation_rolled_forward_can_be_deleted_before_its_completion_is_written() {
    let create = Intention {
        id: 0,
        op: Intent::Create { name: "v".into(), size_bytes: 4096, clone_of: None, member_of: None, storage_bytes: 4096 },
    };
    let catalog = Catalog { next_id: 1, intentions: vec![create], ..Catalog::default() };
    let mut log = IntentionLog::new(catalog, LogPolicy::Group);
    log.finish(ms(0), 0, true);
    let d = log.intend_delete(ms(1), "v", false).expect("deletable");
    let w = log.poll_write(ms(20)).expect("written");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert!(on_disk.volumes.is_empty(), "{on_disk:?}");
    assert_eq!(on_disk.intentions, vec![d]);
    log.written();
    assert!(log.take_durable().contains(&(0, true)), "the creation's completion is durable with it");
}

/// A resize is logged with the volume's entry at its old size; a starting host element serves
/// the new size (rolled forward); its completion lists the new size; undone, nothing changes.
/// Bad requests (policy `none`, not larger, unknown, another operation pending) are refused.
#[test]
fn resizes_are_logged_rolled_forward_completed_and_undone() {
    let mut none = IntentionLog::new(Catalog::default(), LogPolicy::None);
    assert!(none.intend_resize(ms(0), "a", 8192, false).expect_err("never unlogged").contains("must be logged"));
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Single);
    let a = log.intend_create(ms(0), "a", 4096).expect("create");
    log.poll_write(ms(0)).expect("logged");
    log.written();
    assert!(log.intend_resize(ms(0), "a", 8192, false).expect_err("not created yet").contains("being created"));
    log.finish(ms(0), a.id, true);
    assert!(log.intend_resize(ms(1), "zz", 8192, false).expect_err("unknown").contains("no volume zz"));
    assert!(log.intend_resize(ms(1), "a", 4096, false).expect_err("same size").contains("already"));
    assert!(log.intend_resize(ms(1), "a", 6000, false).is_err(), "not whole blocks");
    let r = log.intend_resize(ms(1), "a", 1 << 20, false).expect("resize a");
    assert!(log.intend_resize(ms(1), "a", 2 << 20, false).expect_err("one at a time").contains("being resized"));
    assert!(log.intend_delete(ms(1), "a", false).expect_err("not while resizing").contains("being resized"));
    let w = log.poll_write(ms(1)).expect("logged, with the creation's completion");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert_eq!(on_disk.volumes, vec![CatalogVolume::new("a".into(), 4096, a.id)]);
    assert_eq!(on_disk.intentions, vec![r.clone()]);
    let served: Vec<(String, u64)> = on_disk.volumes_to_serve().into_iter().map(|(n, s)| (n, s.size_bytes)).collect();
    assert_eq!(served, [("a".to_string(), 1 << 20)], "a starting host element serves the new size");
    let mut rolled = on_disk.clone();
    assert_eq!(rolled.roll_forward(), 1);
    assert!(rolled.intentions.is_empty() && rolled.volumes[0].size_bytes == 1 << 20);
    assert_eq!(log.written(), vec![r.clone()]);
    log.finish(ms(2), r.id, true);
    let w = log.poll_write(ms(2)).expect("the completion");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert!(on_disk.intentions.is_empty() && on_disk.volumes[0].size_bytes == 1 << 20, "{on_disk:?}");
    log.written();
    // Undone: the size stays.
    let u = log.intend_resize(ms(3), "a", 4 << 20, false).expect("resize again");
    log.poll_write(ms(3)).expect("logged");
    assert_eq!(log.write_failed(), vec![u.clone()]);
    let w = log.poll_write(ms(4)).expect("rewritten");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert!(on_disk.intentions.is_empty() && on_disk.volumes[0].size_bytes == 1 << 20, "{on_disk:?}");
    log.written();
    assert!(log.take_durable().contains(&(u.id, false)));
    // A document whose resize names no listed volume, starts from another size, or keeps
    // less storage than it exports, is refused.
    let grow = |volume_id, from_bytes, size_bytes: u64| Intention {
        id: 9,
        op: Intent::Resize { name: "a".into(), volume_id, from_bytes, size_bytes, storage_bytes: size_bytes },
    };
    for bad in [grow(5, 1 << 20, 2 << 20), grow(a.id, 8192, 4096), grow(a.id, 1 << 20, 4096)] {
        let broken = Catalog { next_id: 10, intentions: vec![bad], ..on_disk.clone() };
        assert!(Catalog::decode(&broken.encode()).is_err(), "{broken:?}");
    }
    let fine = Catalog { next_id: 10, intentions: vec![grow(a.id, 1 << 20, 2 << 20)], ..on_disk.clone() };
    assert_eq!(Catalog::decode(&fine.encode()), Ok(fine));
}

/// A shrink needs `--shrink`; it keeps the storage size, is served at its new size while
/// pending, stays pending through a roll forward (its tail is zeroed again first), and its
/// completion lists both sizes. A later grow within the storage keeps the storage size; one
/// past it grows the storage. A format 1 document is read with storage sizes equal to sizes.
#[test]
fn shrinks_keep_the_storage_and_stay_pending_until_completed() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Single);
    let a = log.intend_create(ms(0), "a", 8 << 20).expect("create");
    log.poll_write(ms(0)).expect("logged");
    log.written();
    log.finish(ms(0), a.id, true);
    assert!(log.intend_resize(ms(1), "a", 4 << 20, false).expect_err("no flag").contains("--shrink"));
    assert!(log.intend_resize(ms(1), "a", 16 << 20, true).expect_err("flag, larger").contains("--shrink"));
    let s = log.intend_resize(ms(1), "a", 4 << 20, true).expect("shrink");
    assert!(s.is_shrink() && s.volume().storage_bytes == 8 << 20 && s.volume().size_bytes == 4 << 20);
    let w = log.poll_write(ms(1)).expect("logged");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert_eq!(on_disk.volumes, vec![CatalogVolume::new("a".into(), 8 << 20, a.id)], "listed as it was");
    assert_eq!(on_disk.exports_shrunk(), vec![(storage_name("a", a.id), 4 << 20)], "served shrunk while pending");
    assert_eq!(on_disk.volumes_to_serve()[0].1.size_bytes, 8 << 20, "the storage volume keeps its size");
    let mut rolled = on_disk.clone();
    assert_eq!(rolled.roll_forward(), 0);
    assert_eq!(rolled.intentions, vec![s.clone()], "a shrink stays pending until its tail is zeroed");
    log.written();
    log.finish(ms(2), s.id, true);
    let w = log.poll_write(ms(2)).expect("the completion");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    let shrunk = CatalogVolume {
        name: "a".into(),
        size_bytes: 4 << 20,
        id: a.id,
        storage_bytes: 8 << 20,
        clone_of: None,
        member_of: None,
    };
    assert_eq!(on_disk.volumes, vec![shrunk]);
    assert_eq!(on_disk.volumes_to_serve()[0].1.size_bytes, 8 << 20);
    log.written();
    // Grown within the storage, then past it.
    let g = log.intend_resize(ms(3), "a", 6 << 20, false).expect("grow within");
    assert_eq!(g.volume().storage_bytes, 8 << 20);
    log.poll_write(ms(3)).expect("logged");
    log.written();
    log.finish(ms(3), g.id, true);
    let h = log.intend_resize(ms(4), "a", 12 << 20, false).expect("grow past");
    assert_eq!(h.volume().storage_bytes, 12 << 20);
    let w = log.poll_write(ms(4)).expect("logged");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert_eq!((on_disk.volumes[0].size_bytes, on_disk.volumes[0].storage_bytes), (6 << 20, 8 << 20));
    assert!(on_disk.exports_shrunk().is_empty(), "the pending grow is served at its new size");
    // Format 1: the same document without storage sizes.
    let old = Catalog {
        version: 1,
        next_id: 3,
        volumes: vec![CatalogVolume::new("b".into(), 4 << 20, 1)],
        intentions: vec![Intention {
            id: 2,
            op: Intent::Resize {
                name: "b".into(),
                volume_id: 1,
                from_bytes: 4 << 20,
                size_bytes: 8 << 20,
                storage_bytes: 8 << 20,
            },
        }],
        snapshots: Vec::new(),
        grown: Vec::new(),
    };
    let mut body = Vec::new();
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&3u64.to_le_bytes());
    body.extend_from_slice(&1u32.to_le_bytes());
    put_name(&mut body, "b");
    body.extend_from_slice(&(4u64 << 20).to_le_bytes());
    body.extend_from_slice(&1u64.to_le_bytes());
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&2u64.to_le_bytes());
    body.push(INTENT_RESIZE);
    put_name(&mut body, "b");
    for n in [1u64, 4 << 20, 8 << 20] {
        body.extend_from_slice(&n.to_le_bytes());
    }
    let mut doc = MAGIC_V1.to_vec();
    doc.extend_from_slice(&(body.len() as u32).to_le_bytes());
    doc.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    doc.extend_from_slice(&body);
    doc.resize(4096, 0);
    assert_eq!(Catalog::decode(&doc), Ok(old));
}

/// An intention log (policy `single`) whose catalog lists volume `name` of 1 MiB, created by
/// the intention returned.
fn with_volume(name: &str) -> (IntentionLog, Intention) {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Single);
    let v = log.intend_create(ms(0), name, 1 << 20).expect("create");
    write(&mut log, 0);
    log.finish(ms(0), v.id, true);
    write(&mut log, 0);
    (log, v)
}

/// Write what is due and say it is durable: the intentions it logged.
fn write(log: &mut IntentionLog, at: u64) -> Catalog {
    let w = log.poll_write(ms(at)).expect("a write is due");
    log.written();
    Catalog::decode(&w.document).expect("valid")
}

#[test]
fn snapshots_are_logged_listed_with_their_sequence_deleted_and_go_with_their_volume() {
    let (mut log, v) = with_volume("db");
    // Taken: logged first (not listed), then listed by its completion with its sequence.
    let s = log.intend_snapshot(ms(1), "db", v.id, "monday", 1 << 20).expect("snapshot");
    assert!(log.intend_snapshot(ms(1), "db", v.id, "monday", 1 << 20).is_err(), "a name being taken is taken");
    assert!(log.intend_snapshot(ms(1), "db", v.id, "bad@name", 1 << 20).is_err());
    assert!(log.intend_snapshot(ms(1), "nosuch", 99, "x", 4096).expect_err("unknown").contains("no volume nosuch"));
    let on_disk = write(&mut log, 1);
    assert!(on_disk.snapshots.is_empty() && on_disk.intentions == vec![s.clone()]);
    let mut rolled = on_disk.clone();
    rolled.roll_forward();
    assert_eq!(rolled.intentions, vec![s.clone()], "a snapshot stays pending until its record is sent again");
    assert!(log.intend_delete(ms(2), "db", true).expect_err("busy").contains("being snapshotted"));
    log.set_taken_at(s.id, 42);
    log.finish(ms(2), s.id, true);
    let on_disk = write(&mut log, 2);
    let listed = &on_disk.snapshots;
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].export_name(), listed[0].id, listed[0].taken_at), ("db@monday".into(), s.id, 42));
    // Of a configured volume too; names are per volume.
    let c = log.intend_snapshot(ms(3), "vol0", CONFIGURED_VOLUME_ID, "monday", 4096).expect("a configured volume's");
    assert!(log.intend_snapshot(ms(3), "vol0", CONFIGURED_VOLUME_ID, "monday", 4096).is_err());
    write(&mut log, 3);
    log.set_taken_at(c.id, 7);
    log.finish(ms(3), c.id, true);
    write(&mut log, 3);
    // A volume with snapshots is deleted only with them.
    let refused = log.intend_delete(ms(4), "db", false).expect_err("has snapshots");
    assert!(refused.contains("--with-snapshots") && refused.contains("monday"), "{refused}");
    // A snapshot's deletion drops its entry with the write that logs it; undone, it is back.
    let d = log.intend_snapshot_delete(ms(4), "db", "monday").expect("delete it");
    assert!(log.intend_snapshot_delete(ms(4), "db", "monday").is_err(), "deleted once");
    let w = log.poll_write(ms(4)).expect("logged");
    assert!(Catalog::decode(&w.document)
        .expect("valid")
        .snapshots
        .iter()
        .all(|x| x.name != "monday" || x.volume != "db"));
    assert_eq!(log.write_failed(), vec![d.clone()]);
    let on_disk = write(&mut log, 5);
    assert!(on_disk.snapshots.iter().any(|x| x.export_name() == "db@monday"), "undone: listed again");
    // With the volume: the volume's deletion carries them, and lists them again if undone.
    let gone = log.intend_delete(ms(6), "db", true).expect("with its snapshots");
    let w = log.poll_write(ms(6)).expect("logged");
    let on_disk = Catalog::decode(&w.document).expect("valid");
    assert_eq!(on_disk.snapshots.iter().map(|x| x.export_name()).collect::<Vec<_>>(), ["vol0@monday"]);
    assert!(matches!(&on_disk.intentions[0].op, Intent::Delete { snapshots, .. } if snapshots.len() == 1));
    log.write_failed();
    let on_disk = write(&mut log, 7);
    assert_eq!(on_disk.snapshots.len(), 2, "the undone deletion lists its snapshots again");
    assert!(on_disk.intentions.iter().all(|i| i.id != gone.id));
    // Format 2 documents have no snapshots; damage and duplicates are refused.
    let doc = on_disk.encode();
    let end = HEADER_BYTES + u32::from_le_bytes(doc[8..12].try_into().expect("4")) as usize;
    for at in [HEADER_BYTES + 60, end - 3] {
        let mut bad = doc.clone();
        bad[at] ^= 0x01;
        assert!(Catalog::decode(&bad).is_err());
    }
    let mut twice = on_disk.clone();
    twice.snapshots.push(CatalogSnapshot { id: 0, ..twice.snapshots[0].clone() });
    assert!(Catalog::decode(&twice.encode()).expect_err("a name twice").contains("twice"));
}

#[test]
fn without_the_intention_log_a_snapshot_is_refused() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::None);
    assert!(log
        .intend_snapshot(ms(0), "vol0", CONFIGURED_VOLUME_ID, "s", 4096)
        .expect_err("unlogged")
        .contains("must be logged"));
}

#[test]
fn clones_are_logged_with_their_snapshot_and_keep_it_from_being_deleted() {
    let (mut log, v) = with_volume("db");
    let s = log.intend_snapshot(ms(1), "db", v.id, "monday", 1 << 20).expect("snapshot");
    assert!(log.intend_clone(ms(1), "db@monday", "test").expect_err("being taken").contains("being taken"));
    write(&mut log, 1);
    log.set_taken_at(s.id, 42);
    log.finish(ms(1), s.id, true);
    write(&mut log, 1);
    assert!(log.intend_clone(ms(2), "db@sunday", "x").expect_err("unknown").contains("no snapshot db@sunday"));
    assert!(log.intend_clone(ms(2), "db", "x").expect_err("not a snapshot").contains("names no snapshot"));
    assert!(log.intend_clone(ms(2), "db@monday", "db").expect_err("taken").contains("exists"));
    let c = log.intend_clone(ms(2), "db@monday", "test").expect("clone");
    let spec = c.volume().spec();
    assert_eq!(spec.size_bytes, 1 << 20, "a clone has its snapshot's size");
    assert_eq!(spec.clone_of, Some(proto::CloneBase { volume: storage_name("db", v.id), snapshot: s.id }));
    // Logged (format 4), it reads back as a clone; rolled forward, it is served as one.
    let on_disk = write(&mut log, 2);
    assert_eq!(on_disk.intentions, vec![c.clone()]);
    let mut rolled = on_disk.clone();
    rolled.roll_forward();
    assert_eq!(rolled.volumes_to_serve().iter().find(|(n, _)| n == "test").map(|(_, s)| s.clone()), Some(spec.clone()));
    // A damaged document that makes a volume the clone of a snapshot larger than itself, or
    // of one with a bad name, is refused.
    for bad in [
        CatalogSnapshot { size_bytes: 2 << 20, ..c.volume().clone_of.expect("a clone") },
        CatalogSnapshot { name: "bad/name".into(), ..c.volume().clone_of.expect("a clone") },
    ] {
        let mut damaged = on_disk.clone();
        damaged.intentions = vec![Intention {
            id: c.id,
            op: Intent::Create {
                name: "test".into(),
                size_bytes: 1 << 20,
                clone_of: Some(bad),
                member_of: None,
                storage_bytes: 1 << 20,
            },
        }];
        let refused = Catalog::decode(&damaged.encode()).expect_err("refused");
        assert!(refused.contains("clone of snapshot") || refused.contains("snapshot name"), "{refused}");
    }
    // Neither the snapshot nor its volume goes while the clone is there, even pending.
    let refused = log.intend_snapshot_delete(ms(3), "db", "monday").expect_err("has a clone");
    assert!(refused.contains("clone") && refused.contains("test"), "{refused}");
    assert!(log.intend_delete(ms(3), "db", true).expect_err("has a clone").contains("test"));
    log.finish(ms(3), c.id, true);
    let on_disk = write(&mut log, 3);
    let listed = on_disk.volumes.iter().find(|v| v.name == "test").expect("listed");
    assert_eq!(listed.clone_of.as_ref().map(|s| s.id), Some(s.id));
    // A resize of the clone keeps it a clone in what is served meanwhile.
    let r = log.intend_resize(ms(4), "test", 2 << 20, false).expect("grow");
    let on_disk = write(&mut log, 4);
    let served = on_disk.volumes_to_serve();
    let (_, grown) = served.iter().find(|(n, _)| n == "test").expect("served");
    assert_eq!((grown.size_bytes, grown.clone_of.clone()), (2 << 20, spec.clone_of.clone()));
    log.finish(ms(4), r.id, true);
    write(&mut log, 4);
    // Its deletion, undone, lists it as a clone again.
    let d = log.intend_delete(ms(5), "test", false).expect("delete the clone");
    let on_disk = write(&mut log, 5);
    assert!(on_disk.volumes.iter().all(|v| v.name != "test"), "the write that logs it drops it");
    log.finish(ms(5), d.id, false);
    let on_disk = write(&mut log, 5);
    let back = on_disk.volumes.iter().find(|v| v.name == "test").expect("listed again");
    assert_eq!(back.spec().clone_of, spec.clone_of);
}

/// Issue 15: a volume that joins a consistency group is logged with its window, past the
/// group's members and past every snapshot of the group (so that no snapshot holds other data
/// under its name), reads back, is served as a window, keeps the group's storage size once it
/// leaves, and cannot be resized. One join or leave of a group at a time.
#[test]
fn joins_are_logged_with_their_window_and_the_group_never_shrinks() {
    let mut log = IntentionLog::new(Catalog::default(), LogPolicy::Single);
    let none = IntentionLog::new(Catalog::default(), LogPolicy::None).intend_join(ms(0), "x", 4096, "g", "g[a,b]", 0);
    assert!(none.expect_err("unlogged").contains("must be logged"));
    let end = (3 << 20) + 4096; // the configured members end inside a MiB
    let j = log.intend_join(ms(0), "log", 2 << 20, "g", "g[a,b]", end).expect("join");
    let busy = log.intend_join(ms(0), "idx", 4096, "g", "g[a,b]", end).expect_err("one at a time");
    assert!(busy.contains("log is joining"), "{busy}");
    let window = j.volume().member_of.expect("a member");
    assert_eq!((window.offset_bytes, j.volume().storage_bytes), (4 << 20, 6 << 20), "at the next MiB past the members");
    let on_disk = write(&mut log, 0);
    assert_eq!(on_disk.intentions, vec![j.clone()], "reads back with its window");
    let mut rolled = on_disk.clone();
    rolled.roll_forward();
    let served = rolled.members_to_serve();
    assert_eq!(served.len(), 1);
    assert_eq!(
        (served[0].offset_bytes, served[0].size_bytes, served[0].storage.as_str()),
        (4 << 20, 2 << 20, "g[a,b]")
    );
    assert!(
        rolled.volumes_to_serve().is_empty() && rolled.volumes_to_restart().is_empty(),
        "no storage volume of its own"
    );
    assert_eq!(rolled.groups_grown(), vec![("g[a,b]".to_string(), 6 << 20)]);
    log.finish(ms(1), j.id, true);
    write(&mut log, 1);
    assert!(log.intend_resize(ms(2), "log", 4 << 20, false).expect_err("a member").contains("consistency group g"));
    // A snapshot of the group covers the member: the next joins past it.
    let s = log.intend_snapshot(ms(2), "g", CONFIGURED_VOLUME_ID, "s", 7 << 20).expect("snapshot");
    write(&mut log, 2);
    log.set_taken_at(s.id, 9);
    log.finish(ms(2), s.id, true);
    write(&mut log, 2);
    let k = log.intend_join(ms(3), "idx", 4096, "g", "g[a,b]", 6 << 20).expect("join");
    assert_eq!(k.volume().member_of.expect("a member").offset_bytes, 7 << 20, "past the snapshot");
    write(&mut log, 3);
    log.finish(ms(3), k.id, true);
    write(&mut log, 3);
    // Leaving: the deletion names the window; once carried out, its window is free at once,
    // and the group's storage keeps its size.
    let d = log.intend_delete(ms(4), "idx", false).expect("delete");
    assert_eq!(d.volume().member_of.map(|w| w.offset_bytes), Some(7 << 20));
    let on_disk = write(&mut log, 4);
    assert_eq!(on_disk.volumes_to_restart(), Vec::new(), "no placeholder: its window is zeroed instead");
    log.finish(ms(4), d.id, true);
    let again = log.intend_join(ms(4), "idx2", 4096, "g", "g[a,b]", 6 << 20).expect("join again");
    assert_eq!(again.volume().member_of.expect("a member").offset_bytes, 7 << 20, "the zeroed window again");
    let on_disk = write(&mut log, 4);
    assert_eq!(on_disk.grown, vec![("g[a,b]".to_string(), (7 << 20) + 4096)]);
    assert!(on_disk.intentions.iter().all(|i| i.id != d.id), "the write that logs the join completes the deletion");
    // A damaged window is refused.
    let mut damaged = on_disk.clone();
    damaged.volumes[0].member_of.as_mut().expect("log is a member").offset_bytes = 5 << 20;
    assert!(Catalog::decode(&damaged.encode()).expect_err("past its storage").contains("member log"));
}
