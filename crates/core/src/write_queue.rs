//! The write queue: a bounded, sequence-indexed buffer of a volume's recent writes with their
//! data. It is the source for quick recovery and for reads of blocks an element has not applied
//! yet. An entry leaves only when every element that is not failed has acknowledged it.

use std::collections::VecDeque;

use proto::{Epoch, Op, Record, Sequence};

use crate::limits::WRITE_QUEUE_ENTRY_OVERHEAD_BYTES;
use crate::{ElementSet, Time, Token};

/// What the host is owed for an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostReply {
    /// The host waits for a write quorum.
    Waiting(Token),
    /// Answered (successfully or not), or never owed (recovered from an element's log).
    Done,
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub record: Record,
    /// Elements that have durably applied this entry.
    pub acked_by: ElementSet,
    /// Elements whose weaker acknowledgement arrived (`received`: in its memory;
    /// `network-sync`: on the wire toward it): they count toward the quorum under their ack
    /// policy before they are in `acked_by`. Cleared for an element that fails.
    pub weak_by: ElementSet,
    pub host_reply: HostReply,
    /// When the host element assigned its sequence (none for a record recovered from an
    /// element's log at start-up): elements' acknowledgement latencies count from here.
    pub assigned_at: Option<Time>,
}

impl Entry {
    pub fn cost_bytes(&self) -> u64 {
        self.record.op.payload_bytes() + WRITE_QUEUE_ENTRY_OVERHEAD_BYTES
    }
}

#[derive(Debug)]
pub struct WriteQueue {
    entries: VecDeque<Entry>,
    used_bytes: u64,
    capacity_bytes: u64,
    /// Highest sequence ever evicted (0 if none): data older than this exists only on elements.
    evicted_through: Sequence,
    /// Epoch of the record at `evicted_through` (0: unknown, or no record).
    base_epoch: Epoch,
}

impl WriteQueue {
    /// `last` is the highest sequence already assigned (elements hold everything up to it).
    /// `last_epoch` is the epoch of the record at `last` (0 if unknown).
    pub fn new(capacity_bytes: u64, last: Sequence, last_epoch: Epoch) -> WriteQueue {
        WriteQueue {
            entries: VecDeque::new(),
            used_bytes: 0,
            capacity_bytes,
            evicted_through: last,
            base_epoch: last_epoch,
        }
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn evicted_through(&self) -> Sequence {
        self.evicted_through
    }
    /// Highest sequence assigned so far.
    pub fn last_sequence(&self) -> Sequence {
        self.entries.back().map_or(self.evicted_through, |e| e.record.sequence)
    }
    /// Lowest sequence still held, if any.
    pub fn first_sequence(&self) -> Option<Sequence> {
        self.entries.front().map(|e| e.record.sequence)
    }
    /// Whether the queue can stream every record after `applied` (quick recovery's condition).
    pub fn covers_after(&self, applied: Sequence) -> bool {
        applied >= self.evicted_through && applied <= self.last_sequence()
    }

    pub fn fits(&self, cost_bytes: u64) -> bool {
        self.used_bytes + cost_bytes <= self.capacity_bytes
    }

    pub fn push(&mut self, entry: Entry) {
        assert_eq!(entry.record.sequence, self.last_sequence().next(), "sequence gap in queue");
        assert!(self.fits(entry.cost_bytes()), "pushed past capacity");
        self.used_bytes += entry.cost_bytes();
        self.entries.push_back(entry);
    }

    pub fn front(&self) -> Option<&Entry> {
        self.entries.front()
    }

    pub fn pop_front(&mut self) -> Entry {
        let entry = self.entries.pop_front().expect("pop_front on an empty write queue");
        self.used_bytes -= entry.cost_bytes();
        self.evicted_through = entry.record.sequence;
        self.base_epoch = entry.record.epoch;
        entry
    }

    /// Epoch of the record at `sequence`, if the queue knows it (held, or just evicted).
    pub fn epoch_at(&self, sequence: Sequence) -> Option<Epoch> {
        if sequence == self.evicted_through {
            return (self.base_epoch != Epoch(0)).then_some(self.base_epoch);
        }
        self.get(sequence).map(|e| e.record.epoch)
    }

    fn index(&self, sequence: Sequence) -> Option<usize> {
        let first = self.first_sequence()?;
        if sequence < first || sequence > self.last_sequence() {
            return None;
        }
        Some((sequence.0 - first.0) as usize)
    }

    pub fn get(&self, sequence: Sequence) -> Option<&Entry> {
        self.index(sequence).map(|i| &self.entries[i])
    }

    pub fn get_mut(&mut self, sequence: Sequence) -> Option<&mut Entry> {
        self.index(sequence).map(|i| &mut self.entries[i])
    }

    /// Entries with sequence in `(after, through]`, oldest first.
    pub fn range(&self, after: Sequence, through: Sequence) -> impl Iterator<Item = &Entry> {
        let (start, end) = self.bounds(after, through);
        self.entries.range(start..end)
    }

    /// Indexes of the entries with sequence in `(after, through]`, clamped to what is held.
    fn bounds(&self, after: Sequence, through: Sequence) -> (usize, usize) {
        let Some(first) = self.first_sequence() else { return (0, 0) };
        let start = after.0.saturating_sub(first.0 - 1).min(self.entries.len() as u64) as usize;
        let end = (through.0 + 1).saturating_sub(first.0).min(self.entries.len() as u64) as usize;
        (start, end.max(start))
    }

    pub fn range_mut(&mut self, after: Sequence, through: Sequence) -> impl Iterator<Item = &mut Entry> {
        let (start, end) = self.bounds(after, through);
        self.entries.range_mut(start..end)
    }

    /// Overlay every queued operation newer than `applied` onto `data`, which holds the
    /// element's content of `[offset_bytes, offset_bytes + data.len())` as of `applied`.
    /// Returns whether anything changed.
    pub fn overlay(&self, applied: Sequence, offset_bytes: u64, data: &mut [u8]) -> bool {
        let end_bytes = offset_bytes + data.len() as u64;
        let mut changed = false;
        for entry in self.range(applied, self.last_sequence()) {
            let op = &entry.record.op;
            let op_start = op.offset_bytes();
            let op_end = op_start + op.length_bytes();
            let start = op_start.max(offset_bytes);
            let end = op_end.min(end_bytes);
            if start >= end {
                continue;
            }
            let dst = &mut data[(start - offset_bytes) as usize..(end - offset_bytes) as usize];
            match op {
                Op::Write { data: src, .. } => {
                    dst.copy_from_slice(&src[(start - op_start) as usize..(end - op_start) as usize])
                }
                Op::Trim { .. } | Op::WriteZeroes { .. } => dst.fill(0),
                Op::Snapshot { .. } | Op::SnapshotDelete { .. } | Op::Begin => {
                    unreachable!("a record that changes no block has no bytes, so none overlap")
                }
            }
            changed = true;
        }
        changed
    }

    /// Whether any queued operation newer than `applied` touches the byte range.
    pub fn touches(&self, applied: Sequence, offset_bytes: u64, length_bytes: u64) -> bool {
        let end_bytes = offset_bytes + length_bytes;
        self.range(applied, self.last_sequence()).any(|e| {
            let start = e.record.op.offset_bytes();
            start < end_bytes && start + e.record.op.length_bytes() > offset_bytes
        })
    }

    pub fn assert_invariants(&self) {
        let mut used = 0;
        let mut previous = self.evicted_through;
        for entry in &self.entries {
            assert_eq!(entry.record.sequence, previous.next());
            previous = entry.record.sequence;
            used += entry.cost_bytes();
        }
        assert_eq!(used, self.used_bytes);
        assert!(self.used_bytes <= self.capacity_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use proto::VolumeId;

    fn entry(sequence: u64, offset_bytes: u64, fill: u8, len: usize) -> Entry {
        Entry {
            record: Record {
                volume: VolumeId(0),
                epoch: Epoch(1),
                sequence: Sequence(sequence),
                op: Op::write(offset_bytes, Bytes::from(vec![fill; len])),
            },
            acked_by: ElementSet::default(),
            weak_by: ElementSet::default(),
            host_reply: HostReply::Done,
            assigned_at: None,
        }
    }

    #[test]
    fn sequence_indexing_and_eviction() {
        let mut q = WriteQueue::new(10_000, Sequence(5), Epoch(1));
        assert!(q.covers_after(Sequence(5)));
        assert!(!q.covers_after(Sequence(4)));
        for s in 6..=9 {
            q.push(entry(s, 0, s as u8, 100));
        }
        q.assert_invariants();
        assert_eq!(q.first_sequence(), Some(Sequence(6)));
        assert_eq!(q.last_sequence(), Sequence(9));
        assert_eq!(q.range(Sequence(6), Sequence(8)).count(), 2);
        assert_eq!(q.range(Sequence(9), Sequence(9)).count(), 0);
        assert_eq!(q.range(Sequence(2), Sequence(9)).count(), 4, "clamped to what is held");
        q.pop_front();
        assert_eq!(q.evicted_through(), Sequence(6));
        assert_eq!(q.epoch_at(Sequence(6)), Some(Epoch(1)), "the base keeps its epoch");
        assert_eq!(q.epoch_at(Sequence(7)), Some(Epoch(1)));
        assert_eq!(q.epoch_at(Sequence(5)), None);
        assert!(!q.covers_after(Sequence(5)));
        assert!(q.covers_after(Sequence(6)));
        assert!(!q.covers_after(Sequence(10)), "an element ahead of the host is not covered");
        q.assert_invariants();
    }

    #[test]
    fn overlay_applies_newer_writes_in_order() {
        let mut q = WriteQueue::new(100_000, Sequence(0), Epoch(0));
        q.push(entry(1, 0, 1, 1024));
        q.push(entry(2, 512, 2, 512));
        q.push(Entry {
            record: Record {
                volume: VolumeId(0),
                epoch: Epoch(1),
                sequence: Sequence(3),
                op: Op::WriteZeroes { offset_bytes: 768, length_bytes: 128 },
            },
            acked_by: ElementSet::default(),
            weak_by: ElementSet::default(),
            host_reply: HostReply::Done,
            assigned_at: None,
        });
        let mut data = vec![9u8; 1024];
        assert!(q.overlay(Sequence(1), 0, &mut data));
        assert_eq!(&data[..512], &[9u8; 512][..], "sequence 1 is already applied");
        assert_eq!(&data[512..768], &[2u8; 256][..]);
        assert_eq!(&data[768..896], &[0u8; 128][..]);
        assert_eq!(&data[896..], &[2u8; 128][..]);
        assert!(!q.overlay(Sequence(3), 0, &mut data));
        assert!(q.touches(Sequence(0), 1000, 10));
        assert!(!q.touches(Sequence(0), 1024, 10));
    }
}
