//! The checkpointer: a thread that turns a sealed log into a checkpoint while commits go on
//! in the next segment, and prepares the segment the log moves to next.
//!
//! A commit that fills the live segment *seals* it (`Committer::seal`): the writer moves to
//! the next segment and takes note of each volume's applied sequence and of the block map
//! chunks changed since the previous seal. This thread then syncs the data files, writes the
//! images of those chunks into the map files and commits the metadata naming the new segment
//! as the start of the log. Commits go on meanwhile, so the data synced and the map images
//! written may already include records after the seal: that does no harm, as those records
//! are in the log from the new segment on, which replay applies again (rewriting their blocks
//! and entries) after a crash.
//! A seal while a checkpoint is still queued merges into it. Only when the log not covered by
//! a committed checkpoint reaches `CHECKPOINT_LAG_SEGMENTS_MAX` segments does a seal wait.
//!
//! Between checkpoints the thread prepares a *spare* for the next segment: a recycled segment
//! dropped from the replay log, or a new file filled with zeroes, so that appends overwrite
//! allocated space and `fdatasync` does not have to commit a new file size or extents.

use std::{
    fs::{self, File, OpenOptions},
    ops::Range,
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{Arc, Condvar, Mutex},
};

use proto::{Epoch, Sequence, BLOCK_BYTES};

use crate::{
    block_map::{merge_chunks, ChunkImages, PendingSlots, SLOT_BYTES},
    error::io_error,
    log::{self, Segment},
    store::{lock, Shared},
    sys,
    volume::Volume,
    StoreError, FREE_SEGMENTS_MAX, MAP_CHUNK_BLOCKS, MAP_SLOTS_PER_LOCK, SPARE_FILL_STEP_BYTES, WRITEBACK_KICK_BYTES,
};

/// Changed block map chunks (340 blocks each) whose data a checkpoint writes back and waits for
/// at a time, before its `fdatasync` of the data file...
const WRITEBACK_GROUP_CHUNKS: usize = 2;
/// ...in at most this many waits per volume: more chunks changed, larger groups.
const WRITEBACK_GROUPS_MAX: usize = 512;

/// Tests: how long every checkpoint sleeps before it starts (a checkpointer falling behind).
#[cfg(test)]
pub static CHECKPOINT_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One volume as of a seal.
pub struct VolumeSeal {
    pub volume: Arc<Volume>,
    /// Index in the store's volume list (and the metadata's).
    pub index: usize,
    pub applied: Sequence,
    pub applied_epoch: Epoch,
    /// The block map chunks changed since the previous seal, ascending.
    pub chunks: Vec<u64>,
}

/// A checkpoint to write: the state of every volume at a seal.
pub struct CheckpointJob {
    /// The segment the writer moved to at the seal: the log from there on is not covered.
    pub log_start: u64,
    pub epoch: Epoch,
    /// Every volume at the seal, in index order.
    pub volumes: Vec<VolumeSeal>,
}

impl CheckpointJob {
    /// One checkpoint at `newer`'s seal covering both (`older` was never written).
    fn merge(older: CheckpointJob, mut newer: CheckpointJob) -> CheckpointJob {
        assert!(older.log_start <= newer.log_start && older.volumes.len() <= newer.volumes.len());
        for (old, new) in older.volumes.into_iter().zip(&mut newer.volumes) {
            assert_eq!(old.index, new.index, "volumes only grow");
            new.chunks = merge_chunks(old.chunks, std::mem::take(&mut new.chunks));
        }
        newer
    }
}

/// A prepared segment file, ready for the writer.
pub struct Spare {
    pub id: u64,
    pub path: PathBuf,
    pub file: Arc<File>,
    pub file_bytes: u64,
}

/// A spare being prepared (or found at open), owned by the checkpointer thread.
pub struct PartialSpare {
    spare: Spare,
}

impl PartialSpare {
    /// An unused segment file found at open, named as spare `id`.
    pub fn adopt(id: u64, path: PathBuf, file: Arc<File>) -> Result<PartialSpare, StoreError> {
        let file_bytes = file.metadata().map_err(io_error("stat", &path))?.len();
        Ok(PartialSpare { spare: Spare { id, path, file, file_bytes } })
    }
}

#[derive(Default)]
struct Queue {
    queued: Option<CheckpointJob>,
    running: bool,
    /// First segment of the log as of the last committed checkpoint.
    committed_log_start: u64,
    /// The writer's segment.
    live_segment: u64,
    /// The live segment is filling up: time to prepare the next one (an idle store, a test,
    /// never pays for filling a segment it does not need).
    spare_wanted: bool,
    /// Ready for segment `live_segment + 1`.
    spare: Option<Spare>,
    /// Files of segments dropped from the replay log, to recycle as spares.
    free: Vec<PathBuf>,
    /// Spans of volumes' data files (volume by index) whose writeback is to be started.
    writeback: Vec<(usize, Arc<Volume>, Range<u64>)>,
    closing: bool,
}

pub struct Checkpointer {
    queue: Mutex<Queue>,
    /// Wakes the thread: a job, a spare wanted, closing.
    wake: Condvar,
    /// Wakes committers waiting for a checkpoint to commit.
    progress: Condvar,
    /// Tests hold it to stall checkpoints.
    #[cfg(test)]
    pub gate: Mutex<()>,
    /// Tests: wake the thread each time the writer takes a spare, before it renames it.
    #[cfg(test)]
    pub wake_after_take: std::sync::atomic::AtomicBool,
    /// Tests: a checkpoint's write-back steps fail as a failing device would make them.
    #[cfg(test)]
    pub fail_write_back: std::sync::atomic::AtomicBool,
}

impl Checkpointer {
    pub fn new(committed_log_start: u64, live_segment: u64, free: Vec<PathBuf>) -> Checkpointer {
        Checkpointer {
            queue: Mutex::new(Queue { committed_log_start, live_segment, free, ..Queue::default() }),
            wake: Condvar::new(),
            progress: Condvar::new(),
            #[cfg(test)]
            gate: Mutex::new(()),
            #[cfg(test)]
            wake_after_take: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            fail_write_back: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn committed_log_start(&self) -> u64 {
        lock(&self.queue).committed_log_start
    }

    /// Wait until moving the writer to segment `next` keeps the log not covered by a committed
    /// checkpoint within `segments_max` segments, as long as a checkpoint is on its way (after
    /// a restart none is: the seal about to be made starts it).
    pub fn wait_lag_below(&self, shared: &Shared, next: u64, segments_max: u64) -> Result<(), StoreError> {
        let mut queue = lock(&self.queue);
        while next + 1 - queue.committed_log_start > segments_max && (queue.running || queue.queued.is_some()) {
            shared.check_failure()?;
            queue = self.progress.wait(queue).expect("checkpoint queue lock");
        }
        Ok(())
    }

    /// The spare prepared for segment `id`, if ready. Taking it makes `id` the live segment
    /// at once: the writer renames the spare to its segment name after this returns, and a
    /// thread woken in between must not prepare segment `id` again (it would rename a free
    /// file over the spare, and the writer's rename would then give the segment's name to
    /// that stale file while the records went into a file without a name).
    pub fn take_spare(&self, id: u64) -> Option<Spare> {
        let mut queue = lock(&self.queue);
        let taken = match &queue.spare {
            Some(spare) if spare.id == id => queue.spare.take(),
            _ => None,
        };
        if taken.is_some() {
            queue.live_segment = id;
            queue.spare_wanted = false;
        }
        drop(queue);
        #[cfg(test)]
        if taken.is_some() && self.wake_after_take.load(std::sync::atomic::Ordering::Relaxed) {
            // Tests: the thread wakes, and has time to act, before the writer renames.
            self.wake.notify_all();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        taken
    }

    /// Tests: wait (at most `timeout`) while a spare is wanted and not ready yet.
    #[cfg(test)]
    pub fn wait_for_wanted_spare(&self, timeout: std::time::Duration) {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            {
                let queue = lock(&self.queue);
                if !queue.spare_wanted || queue.spare.is_some() || queue.closing {
                    return;
                }
            }
            if std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    pub fn set_live_segment(&self, id: u64) {
        let mut queue = lock(&self.queue);
        queue.live_segment = id;
        queue.spare_wanted = false;
        drop(queue);
        self.wake.notify_all();
    }

    /// Start the writeback of a volume's data file over `blocks` (`sync_file_range`, not
    /// waited for).
    pub fn start_writeback(&self, index: usize, volume: &Arc<Volume>, blocks: Range<u64>) {
        let mut queue = lock(&self.queue);
        queue_span(&mut queue.writeback, index, || volume.clone(), blocks);
        drop(queue);
        self.wake.notify_all();
    }

    /// Start preparing the segment after the live one.
    pub fn want_spare(&self) {
        lock(&self.queue).spare_wanted = true;
        self.wake.notify_all();
    }

    pub fn enqueue(&self, job: CheckpointJob) {
        let mut queue = lock(&self.queue);
        queue.queued = Some(match queue.queued.take() {
            Some(older) => CheckpointJob::merge(older, job),
            None => job,
        });
        drop(queue);
        self.wake.notify_all();
    }

    /// Wait until no checkpoint is queued or running.
    pub fn wait_idle(&self, shared: &Shared) {
        let mut queue = lock(&self.queue);
        while (queue.running || queue.queued.is_some()) && shared.check_failure().is_ok() {
            queue = self.progress.wait(queue).expect("checkpoint queue lock");
        }
    }

    pub fn close(&self) {
        lock(&self.queue).closing = true;
        self.wake.notify_all();
        self.progress.notify_all();
    }

    /// A segment dropped from the replay log: keep its file for recycling if no reader holds
    /// it (a reader may still read records from it), else delete it.
    pub fn recycle_or_remove(&self, dir: &std::path::Path, segment: Segment) {
        let Segment { id, path, file, .. } = segment;
        // Once out of the index, no reader can take a new reference to the file.
        if Arc::strong_count(&file) == 1 && lock(&self.queue).free.len() < FREE_SEGMENTS_MAX {
            let free = log::free_path(dir, id);
            match fs::rename(&path, &free) {
                Ok(()) => {
                    lock(&self.queue).free.push(free);
                    self.wake.notify_all();
                    return;
                }
                Err(error) => {
                    tracing::warn!(segment = %path.display(), %error, "cannot keep a log segment for recycling")
                }
            }
        }
        if let Err(error) = fs::remove_file(&path) {
            tracing::warn!(segment = %path.display(), %error, "cannot remove a log segment");
        }
    }
}

/// Queue the writeback of `blocks` of volume `index`, merged into a queued span of that volume
/// only where the two touch or overlap: a union of distant spans would take in the scattered
/// blocks between them, the very writeback the committer chose not to start.
fn queue_span<V>(
    spans: &mut Vec<(usize, V, Range<u64>)>,
    index: usize,
    volume: impl FnOnce() -> V,
    blocks: Range<u64>,
) {
    let touching =
        spans.iter_mut().find(|(i, _, queued)| *i == index && queued.start <= blocks.end && blocks.start <= queued.end);
    match touching {
        Some((_, _, queued)) => *queued = queued.start.min(blocks.start)..queued.end.max(blocks.end),
        None => spans.push((index, volume(), blocks)),
    }
}

enum Work {
    Job(CheckpointJob),
    Writeback(Vec<(usize, Arc<Volume>, Range<u64>)>),
    Spare(u64),
}

/// The checkpointer thread: runs until the store closes.
pub fn run(shared: &Shared, mut images: Vec<ChunkImages>, mut partial: Option<PartialSpare>) {
    let checkpointer = &shared.checkpointer;
    let mut spares_disabled = false;
    loop {
        let work = {
            let mut queue = lock(&checkpointer.queue);
            loop {
                if queue.closing {
                    return;
                }
                if let Some(job) = queue.queued.take() {
                    queue.running = true;
                    break Work::Job(job);
                }
                if !queue.writeback.is_empty() {
                    break Work::Writeback(std::mem::take(&mut queue.writeback));
                }
                let wanted = queue.live_segment + 1;
                if queue.spare.as_ref().is_some_and(|s| s.id != wanted) {
                    let stale = queue.spare.take().expect("just checked");
                    if partial.is_some() {
                        let _ = fs::remove_file(&stale.path);
                    } else {
                        partial = Some(PartialSpare { spare: stale });
                    }
                }
                if queue.spare_wanted && !spares_disabled && queue.spare.is_none() && shared.check_failure().is_ok() {
                    break Work::Spare(wanted);
                }
                queue = checkpointer.wake.wait(queue).expect("checkpoint queue lock");
            }
        };
        match work {
            Work::Job(job) => {
                let log_start = job.log_start;
                let started = std::time::Instant::now();
                let result = shared.check_failure().and_then(|()| run_job(shared, &mut images, job));
                match &result {
                    Ok(()) => {
                        let took_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                        tracing::debug!(log_start, took_ms, "checkpoint committed");
                        shared.trim_replay_log(log_start);
                    }
                    Err(error) => shared.fail(error),
                }
                let mut queue = lock(&checkpointer.queue);
                queue.running = false;
                if result.is_ok() {
                    queue.committed_log_start = log_start;
                } else {
                    queue.queued = None;
                }
                drop(queue);
                checkpointer.progress.notify_all();
            }
            Work::Writeback(volumes) => {
                for (_, volume, blocks) in volumes {
                    // A failed write shows again in the checkpoint's fdatasync.
                    let offset = blocks.start * BLOCK_BYTES;
                    let length = (blocks.end - blocks.start) * BLOCK_BYTES;
                    if let Err(error) = sys::start_writeback(&volume.data, offset, length) {
                        tracing::warn!(path = %volume.data_path.display(), %error, "cannot start writeback");
                    }
                }
            }
            Work::Spare(id) => {
                if let Err(error) = prepare_spare(shared, id, &mut partial) {
                    tracing::warn!(%error, "cannot prepare a log segment ahead; the log grows its segments as it goes");
                    spares_disabled = true;
                }
            }
        }
    }
}

/// Write one checkpoint: data files synced, block map images written and synced, metadata
/// committed.
fn run_job(shared: &Shared, images: &mut Vec<ChunkImages>, job: CheckpointJob) -> Result<(), StoreError> {
    #[cfg(test)]
    let _gate = lock(&shared.checkpointer.gate);
    #[cfg(test)]
    std::thread::sleep(std::time::Duration::from_millis(
        CHECKPOINT_DELAY_MS.load(std::sync::atomic::Ordering::Relaxed),
    ));
    // Only this thread changes the generation.
    let generation = lock(&shared.meta).generation + 1;
    let mut written = Vec::new();
    let mut images_buffer = vec![0u8; (MAP_SLOTS_PER_LOCK as u64 * SLOT_BYTES) as usize];
    for seal in &job.volumes {
        if images.len() == seal.index {
            images.push(ChunkImages::for_blocks(seal.volume.blocks()));
        }
        // The volume may have grown since its images were made (`Store::resize_volume`).
        images[seal.index].grow(seal.volume.blocks());
        if seal.chunks.is_empty() {
            continue;
        }
        let volume = &seal.volume;
        if volume.is_removed() {
            continue;
        }
        // Write the changed parts back a few chunks at a time, waiting for each, so that the
        // device queue never holds thousands of this checkpoint's writes ahead of a log sync
        // (docs/benchmarks.md). The fdatasync then finds little left but the device flush.
        let group_chunks = WRITEBACK_GROUP_CHUNKS.max(seal.chunks.len().div_ceil(WRITEBACK_GROUPS_MAX));
        for group in seal.chunks.chunks(group_chunks) {
            let (first, last) = (group[0], group[group.len() - 1]);
            let offset = first * MAP_CHUNK_BLOCKS * BLOCK_BYTES;
            let length = (last + 1 - first) * MAP_CHUNK_BLOCKS * BLOCK_BYTES;
            // An error fails the checkpoint as the fdatasync's would: having been reported here,
            // it would not be reported again by the fdatasync.
            #[cfg(test)]
            if shared.checkpointer.fail_write_back.load(std::sync::atomic::Ordering::Relaxed) {
                let error = std::io::Error::from_raw_os_error(libc::EIO);
                return Err(io_error("write back volume data", &volume.data_path)(error));
            }
            sys::write_back(&volume.data, offset, length)
                .map_err(io_error("write back volume data", &volume.data_path))?;
        }
        volume.data.sync_data().map_err(io_error("sync volume data", &volume.data_path))?;
        let chunk_images = &images[seal.index];
        let mut pending = PendingSlots::default();
        let mut removed = false;
        for chunks in seal.chunks.chunks(MAP_SLOTS_PER_LOCK) {
            {
                // Applies wait meanwhile (readers do not): keep it short. A volume removed
                // meanwhile has an empty map: nothing of it is written any more.
                let Ok(state) = volume.live_state() else {
                    removed = true;
                    break;
                };
                for (chunk, image) in chunks.iter().zip(images_buffer.chunks_exact_mut(SLOT_BYTES as usize)) {
                    state.map.encode_slot(*chunk, generation, image);
                }
            }
            for (chunk, image) in chunks.iter().zip(images_buffer.chunks_exact(SLOT_BYTES as usize)) {
                let slot = chunk_images.free_slot(*chunk);
                volume.map_file.write_slot(*chunk, slot, image)?;
                pending.writes.push((*chunk, slot));
            }
        }
        if removed {
            continue;
        }
        volume.map_file.sync()?;
        written.push((seal.index, pending));
    }
    {
        // Volumes removed since the seal have left the metadata: they are skipped.
        let mut meta = lock(&shared.meta);
        let mut next = meta.clone();
        for seal in &job.volumes {
            if let Some(entry) = next.volumes.iter_mut().find(|v| v.number == seal.volume.number) {
                entry.applied = seal.applied;
                entry.applied_epoch = seal.applied_epoch;
            }
        }
        for (i, pending) in &written {
            let number = job.volumes.iter().find(|seal| seal.index == *i).expect("sealed").volume.number;
            if let Some(entry) = next.volumes.iter_mut().find(|v| v.number == number) {
                entry.map_digest = images[*i].digest_after(pending, generation);
            }
        }
        next.generation = generation;
        next.log_start = job.log_start;
        next.epoch = next.epoch.max(job.epoch);
        next.write(&shared.dir)?;
        // Committed.
        *meta = next;
    }
    for (i, pending) in written {
        images[i].commit(&pending, generation);
    }
    Ok(())
}

/// Prepare the spare for segment `id`: resume `partial`, or recycle a free segment file, or
/// create one; fill it with zeroes to the expected segment size; make it and its name durable;
/// hand it over. Gives way (keeping the work in `partial`) to a checkpoint, to a writeback, to
/// closing, or if the writer moved on meanwhile.
fn prepare_spare(shared: &Shared, id: u64, partial: &mut Option<PartialSpare>) -> Result<(), StoreError> {
    let checkpointer = &shared.checkpointer;
    let dir = &shared.dir;
    let log_dir = dir.join(log::LOG_DIR);
    let path = log::spare_path(dir, id);
    let mut spare = match partial.take() {
        Some(PartialSpare { mut spare }) => {
            if spare.id != id {
                fs::rename(&spare.path, &path).map_err(io_error("rename log spare", &spare.path))?;
                spare.id = id;
                spare.path = path;
            }
            spare
        }
        None => {
            let free = lock(&checkpointer.queue).free.pop();
            let source = free.as_ref().unwrap_or(&path);
            if let Some(free) = &free {
                // A recycled segment's stale batches name their own segment id: they never
                // pass for batches of this one.
                fs::rename(free, &path).map_err(io_error("rename log spare", free))?;
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io_error("create log spare", source))?;
            let file_bytes = file.metadata().map_err(io_error("stat", &path))?.len();
            Spare { id, path, file: Arc::new(file), file_bytes }
        }
    };
    let options = &shared.options;
    let target_bytes = options.checkpoint_log_bytes + options.checkpoint_log_bytes / 16;
    let zeroes = vec![0u8; SPARE_FILL_STEP_BYTES as usize];
    let mut unflushed = 0;
    while spare.file_bytes < target_bytes {
        {
            let queue = lock(&checkpointer.queue);
            if queue.closing || queue.queued.is_some() || !queue.writeback.is_empty() || queue.live_segment + 1 != id {
                *partial = Some(PartialSpare { spare });
                return Ok(());
            }
        }
        let step = (target_bytes - spare.file_bytes).min(SPARE_FILL_STEP_BYTES);
        spare
            .file
            .write_all_at(&zeroes[..step as usize], spare.file_bytes)
            .map_err(io_error("fill log spare", &spare.path))?;
        spare.file_bytes += step;
        unflushed += step;
        if unflushed >= WRITEBACK_KICK_BYTES {
            unflushed = 0;
            sys::start_writeback(&spare.file, 0, 0).map_err(io_error("start writeback of log spare", &spare.path))?;
        }
    }
    spare.file.sync_all().map_err(io_error("sync log spare", &spare.path))?;
    // The writer syncs only data: the name must be durable before records go into the file.
    sys::sync_dir(&log_dir).map_err(io_error("sync directory", &log_dir))?;
    let mut queue = lock(&checkpointer.queue);
    if queue.live_segment + 1 == id && queue.spare.is_none() {
        queue.spare = Some(spare);
    } else {
        *partial = Some(PartialSpare { spare });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::queue_span;

    #[test]
    fn writeback_spans_merge_only_where_they_touch() {
        let mut spans: Vec<(usize, (), std::ops::Range<u64>)> = Vec::new();
        queue_span(&mut spans, 0, || (), 0..2048);
        // Following on: one span.
        queue_span(&mut spans, 0, || (), 2048..4096);
        // Overlapping: still one.
        queue_span(&mut spans, 0, || (), 1000..3000);
        // Far away: a span of its own, not the union 0..200_000.
        queue_span(&mut spans, 0, || (), 100_000..102_048);
        // The same blocks of another volume: separate.
        queue_span(&mut spans, 1, || (), 0..2048);
        // Touching the far span from below: merged into it.
        queue_span(&mut spans, 0, || (), 98_000..100_000);
        let mut got: Vec<_> = spans.iter().map(|(i, _, r)| (*i, r.clone())).collect();
        got.sort_by_key(|(i, r)| (*i, r.start));
        assert_eq!(got, vec![(0, 0..4096), (0, 98_000..102_048), (1, 0..2048)]);
    }
}
