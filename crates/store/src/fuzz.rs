//! Entry points for the coverage-guided fuzz targets in `fuzz/` (cargo feature `fuzz`): the
//! log's record parser, and opening a data directory whose files were damaged.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use bytes::Bytes;
use proto::{Epoch, Op, Record, Sequence, VolumeId};

use crate::{Store, StoreOptions};

/// The log record parser on any payload (its frame checksum made to match, so the fuzzer
/// reaches past it): never a panic; what it accepts re-encodes to the same bytes.
pub fn log_record(payload: &[u8]) {
    crate::log::fuzz_record(payload);
}

/// Options that keep a store small: little log segments, no room checks against the disk.
fn options() -> StoreOptions {
    StoreOptions {
        checkpoint_log_bytes: 256 * 1024,
        replay_log_bytes: 512 * 1024,
        overcommit: true,
        map_memory_bytes_max: 64 << 20,
        log_grow_step_bytes: crate::LOG_GROW_STEP_BYTES,
        placed_writes: true,
    }
}

/// A store with two volumes and records of every kind, some checkpointed and some only in the
/// log, made once per process.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = base.join(format!("starfish-fuzz-template-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Store::open(&dir, options()).expect("a fresh store opens");
        store.set_epoch(Epoch(3), proto::HostId(7)).expect("epoch");
        let a = store.ensure_volume("a", 1 << 20).expect("volume a");
        let b = store.ensure_volume("b", 96 * 1024).expect("volume b");
        let op = |i: u64| match i % 4 {
            // A placed write (into holes, logged without its data), after the checkpoint.
            0 if i == 16 => Op::write(768 * 1024, Bytes::from(vec![i as u8; crate::PLACED_WRITE_BYTES_MIN as usize])),
            // Over two of its blocks: a copy of their placed data is logged first.
            0 if i == 20 => Op::write(768 * 1024 + 4096, Bytes::from(vec![i as u8; 8192])),
            0 => Op::write((i * 12_288) % (1 << 20), Bytes::from(vec![i as u8; 8192])),
            1 => Op::write((i * 512) % 65_536, Bytes::from(vec![!(i as u8); 1536])),
            2 => Op::WriteZeroes { offset_bytes: (i * 1024) % 65_536, length_bytes: 6144 },
            _ => Op::Trim { offset_bytes: (i * 4096) % (1 << 20), length_bytes: 4096 },
        };
        for i in 1..=24u64 {
            let record =
                |volume| Record { volume: VolumeId(volume), epoch: Epoch(3), sequence: Sequence(i), op: op(i) };
            let b_record = Record { op: Op::write((i * 4096) % 65_536, Bytes::from(vec![i as u8; 4096])), ..record(1) };
            store.commit(&[(a, record(0)), (b, b_record)]).expect("commit");
            if i == 12 {
                store.checkpoint().expect("checkpoint");
            }
        }
        // The placed write is served whole, two of its blocks from the copy of their data.
        let served = store.log_records(a, Sequence(15), 1 << 20).expect("the template's log serves");
        assert_eq!(served[0].op, op(16), "the template's placed write is served as written");
        drop(store);
        dir
    })
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// Copy the template, damage it as `damage` says — 6 bytes a step: which file, where (a
/// fraction of its length), and an XOR mask, or (mask 0) cut the file there — then open it and,
/// if it opens, verify every volume. Errors are fine; a panic or an abort is the bug.
pub fn open_damaged(damage: &[u8]) {
    let template = template();
    let dir = template.with_file_name(format!("starfish-fuzz-case-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(template, &dir).expect("copying the template");
    let mut paths = Vec::new();
    files(&dir, &mut paths);
    for step in damage.chunks_exact(6).take(16) {
        let path = &paths[step[0] as usize % paths.len()];
        let Ok(bytes) = std::fs::read(path) else { continue };
        if bytes.is_empty() {
            continue;
        }
        let at = (u32::from_le_bytes([step[1], step[2], step[3], step[4]]) as usize) % bytes.len();
        let mut bytes = bytes;
        if step[5] == 0 {
            bytes.truncate(at);
        } else {
            bytes[at] ^= step[5];
        }
        std::fs::write(path, &bytes).expect("writing the damaged file");
    }
    if let Ok(store) = Store::open(&dir, options()) {
        for (name, _) in store.volumes() {
            if let Some(volume) = store.volume(&name) {
                let _ = store.verify(volume);
                // What a lagging peer would be served (a placed write from its copies too).
                let _ = store.log_records(volume, Sequence(0), 4 << 20);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
