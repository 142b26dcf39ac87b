//! Reclaiming the disk space of blocks that became holes (trim, write zeroes).
//!
//! The block map alone decides what a read returns: a hole reads as zeroes and the data file
//! is never looked at there. Punching the file is therefore only space reclamation, and it can
//! be slow (ext4 frees extent by extent: seconds for a fragmented gibibyte). So applying a trim
//! only updates the map and queues the range here; a background thread punches it in bounded
//! slices, each under the commit lock (no apply can write into the range meanwhile) and only
//! where the map still says hole and the file still holds data.

use std::{
    collections::VecDeque,
    io,
    ops::Range,
    sync::{Condvar, Mutex, MutexGuard},
};

use proto::BLOCK_BYTES;

use crate::{block_map::BlockMap, sys, volume::Volume};

/// Queue of `(volume index, blocks)` ranges to punch.
#[derive(Default)]
pub struct Reclaim {
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Default)]
struct Queue {
    ranges: VecDeque<(usize, Range<u64>)>,
    /// Ranges popped and not yet finished (their rest may come back to the queue).
    in_flight: usize,
    closing: bool,
}

impl Reclaim {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().expect("a thread panicked while holding the reclaim queue")
    }

    pub fn push(&self, volume: usize, blocks: Range<u64>) {
        if blocks.is_empty() {
            return;
        }
        let mut queue = self.queue();
        match queue.ranges.back_mut() {
            Some((v, last)) if *v == volume && blocks.start <= last.end && last.start <= blocks.end => {
                *last = last.start.min(blocks.start)..last.end.max(blocks.end);
            }
            _ => queue.ranges.push_back((volume, blocks)),
        }
        drop(queue);
        self.wake.notify_all();
    }

    pub fn push_front(&self, volume: usize, blocks: Range<u64>) {
        if !blocks.is_empty() {
            self.queue().ranges.push_front((volume, blocks));
        }
    }

    /// The next range; the caller calls [`Reclaim::finish`] once done with it.
    pub fn pop(&self) -> Option<(usize, Range<u64>)> {
        let mut queue = self.queue();
        let range = queue.ranges.pop_front();
        queue.in_flight += range.is_some() as usize;
        range
    }

    pub fn finish(&self) {
        let mut queue = self.queue();
        queue.in_flight -= 1;
        drop(queue);
        self.wake.notify_all();
    }

    /// Wait until a range is queued or none is in flight; `true` if the queue is empty and
    /// nothing is in flight.
    pub fn wait_settled(&self) -> bool {
        let mut queue = self.queue();
        while queue.ranges.is_empty() && queue.in_flight > 0 {
            queue = self.wake.wait(queue).expect("reclaim queue lock");
        }
        queue.ranges.is_empty()
    }

    /// Wait for work; `None` once closing.
    pub fn wait(&self) -> Option<()> {
        let mut queue = self.queue();
        while queue.ranges.is_empty() && !queue.closing {
            queue = self.wake.wait(queue).expect("reclaim queue lock");
        }
        (!queue.closing).then_some(())
    }

    pub fn close(&self) {
        self.queue().closing = true;
        self.wake.notify_all();
    }

    pub fn clear(&self) {
        self.queue().ranges.clear();
    }

    /// Bytes queued (an upper bound: most of it may already be holes in the file).
    pub fn backlog_bytes(&self) -> u64 {
        self.queue().ranges.iter().map(|(_, r)| (r.end - r.start) * BLOCK_BYTES).sum()
    }
}

/// Punch the file data under the map's holes in `blocks`, stopping once `budget_bytes` were
/// punched. Returns the first block not yet handled. The caller excludes applies.
pub fn punch_holes(volume: &Volume, map: &BlockMap, blocks: Range<u64>, budget_bytes: u64) -> io::Result<u64> {
    let mut punched = 0;
    let mut block = blocks.start;
    while block < blocks.end {
        let run_end = map.run_end(block, blocks.end);
        if !map.is_allocated(block) {
            let end = run_end * BLOCK_BYTES;
            let mut position = block * BLOCK_BYTES;
            while position < end {
                let data = match sys::next_data(&volume.data, position)? {
                    Some(data) if data < end => data.max(position),
                    _ => break,
                };
                let hole = sys::next_hole(&volume.data, data)?.min(end);
                volume.data_punched(data, hole - data);
                sys::punch_hole(&volume.data, data, hole - data)?;
                punched += hole - data;
                position = hole;
                if punched >= budget_bytes {
                    return Ok(position / BLOCK_BYTES);
                }
            }
        }
        block = run_end;
    }
    Ok(blocks.end)
}
