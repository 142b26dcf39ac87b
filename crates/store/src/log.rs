//! The write-ahead log: segment files of batches of records, the scan that validates them
//! (finding a torn tail and telling it apart from corruption in the middle), the index of
//! retained records that serves peer recovery, and the writer.
//!
//! A record carries its change already resolved to whole blocks (partial edge blocks merged
//! with their content at commit time), with one crc32c per block; the record checksum covers
//! the header and that checksum table. Replay therefore only writes and punches holes.

use std::{
    collections::{HashMap, VecDeque},
    fs::{File, OpenOptions},
    ops::Range,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use bytes::{Bytes, BytesMut};
use proto::{Epoch, Op, Record, Sequence, VolumeId, BLOCK_BYTES};

use crate::{error::io_error, sys, StoreError, LOG_BATCH_BYTES_MAX, LOG_RECORD_BYTES_MAX, SCAN_BUFFER_BYTES};

pub const LOG_DIR: &str = "log";
const SEGMENT_SUFFIX: &str = ".seg";
/// A prepared segment not yet written to (zero-filled or recycled): renamed to `.seg` when the
/// writer moves to it. The rename is not synced, so recovery reads both names alike.
const SPARE_SUFFIX: &str = ".spare";
/// A segment dropped from the replay log, kept only to be recycled as a spare.
const FREE_SUFFIX: &str = ".free";

const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"SFLS");
/// Every used segment starts with this header; its first batch follows it.
pub const SEGMENT_HEADER_BYTES: usize = 40;
/// Zeroes written after a batch that ends inside the file (preallocated space), so the end of
/// the log reads as zeroes, never as the stale bytes of a recycled segment.
const END_MARK: [u8; BATCH_HEADER_BYTES] = [0; BATCH_HEADER_BYTES];
/// Zeroes appended to grow a segment ahead of its log, in pieces of this size.
static GROW_ZEROES: [u8; 64 * 1024] = [0; 64 * 1024];

const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"SFLB");
pub const BATCH_HEADER_BYTES: usize = 40;
/// The record parser on any payload, for `store::fuzz`: never a panic; an accepted record
/// re-encodes to the same header and table, and converts to a wire record.
#[cfg(feature = "fuzz")]
pub(crate) fn fuzz_record(payload: &[u8]) {
    let header = RECORD_HEADER_BYTES as usize;
    let table_end = (payload.len() >= header)
        .then(|| header as u64 + 4 * u32::from_le_bytes(payload[4..8].try_into().expect("4")) as u64)
        .filter(|end| *end <= payload.len() as u64);
    let crc = table_end.map_or(0, |end| proto::crc32c(&payload[..end as usize]));
    if let Ok(record) = LogRecord::decode(Bytes::copy_from_slice(payload), crc) {
        let mut head = Vec::new();
        record.encode_head(&mut head);
        let end = table_end.expect("an accepted record has its table") as usize;
        assert_eq!(&head[RECORD_FRAME_BYTES as usize..], &payload[..end]);
        assert_eq!(record.frame_bytes(), RECORD_FRAME_BYTES + payload.len() as u64);
        if !record.is_placed() && record.kind != Kind::PlacedCopy {
            let _ = record.to_record();
        }
    }
}

/// `[u32 payload length][u32 crc32c]` before every record payload.
pub const RECORD_FRAME_BYTES: u64 = 8;
/// Fixed part of a record payload, before its block checksums and blocks.
pub const RECORD_HEADER_BYTES: u64 = 44;

const FLAG_HEAD: u8 = 1;
const FLAG_TAIL: u8 = 2;
/// A write of whole blocks whose data is not in the log: it was written into the volume's data
/// file, over blocks that held no content, and synced before the record was logged (see
/// [`Change::Blocks`]'s `placed`). The record carries the checksum table only.
const FLAG_PLACED: u8 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Write = 1,
    Trim = 2,
    WriteZeroes = 3,
    /// A snapshot taken at this sequence (`Op::Snapshot`): no block changes, and the
    /// snapshot's id is kept where other records keep their offset (the length is 0).
    Snapshot = 4,
    /// A snapshot deleted at this sequence (`Op::SnapshotDelete`), its id kept the same way.
    SnapshotDelete = 5,
    /// A host element began serving the volume here (`Op::Begin`): offset and length 0.
    Begin = 6,
    /// The data of the placed write of this sequence (an earlier record of the same volume)
    /// for some of its blocks, logged just before a later record changes them in the data
    /// file, so that `Store::log_records` can still serve the placed write to a lagging peer
    /// (see `Store::commit`). Whole blocks, like a write; it changes no block when replayed,
    /// and is indexed by the placed write's sequence, apart from the volume's records.
    PlacedCopy = 7,
}

impl Kind {
    /// A snapshot's creation or deletion (its "offset" is the snapshot's id) or a beginning:
    /// it changes no block of its volume, and its length is 0.
    pub fn changes_no_block(self) -> bool {
        matches!(self, Kind::Snapshot | Kind::SnapshotDelete | Kind::Begin)
    }

    fn from_u8(value: u8) -> Option<Kind> {
        match value {
            1 => Some(Kind::Write),
            2 => Some(Kind::Trim),
            3 => Some(Kind::WriteZeroes),
            4 => Some(Kind::Snapshot),
            5 => Some(Kind::SnapshotDelete),
            6 => Some(Kind::Begin),
            7 => Some(Kind::PlacedCopy),
            _ => None,
        }
    }
}

/// A record as logged and applied.
#[derive(Debug)]
pub struct LogRecord {
    pub volume_number: u32,
    pub epoch: Epoch,
    pub sequence: Sequence,
    pub kind: Kind,
    /// The operation's range as the host element sent it.
    pub offset_bytes: u64,
    pub length_bytes: u64,
    pub change: Change,
}

/// What a record does to the blocks of its volume.
#[derive(Debug)]
pub enum Change {
    /// Zero-length operation: only the sequence advances.
    Nothing,
    /// Blocks `first_block..first_block + crcs.len()` get the content of `pieces`, back to back
    /// (every piece is whole blocks).
    ///
    /// `placed`: the data went into the volume's data file before the record was logged, and
    /// the log holds only the checksums (a *placed write*: whole blocks that were holes, see
    /// `Store::commit`). A placed record read back from the log has no `pieces`; applying it
    /// writes nothing.
    Blocks { first_block: u64, pieces: Vec<Bytes>, crcs: Vec<u32>, placed: bool },
    /// The range reads as zeroes: whole blocks become holes; a partially covered edge block
    /// gets its merged content, or becomes a hole if that content is all zeroes.
    Zero { head: Option<Edge>, whole: Range<u64>, tail: Option<Edge> },
}

#[derive(Debug)]
pub struct Edge {
    pub block: u64,
    /// `None`: the merged block is all zeroes and becomes a hole.
    pub content: Option<(Bytes, u32)>,
}

/// Which blocks a byte range touches, and whether its first and last blocks are covered only
/// partially.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub first: u64,
    pub last: u64,
    pub head_partial: bool,
    pub tail_partial: bool,
}

impl Geometry {
    /// `None` for an empty range.
    pub fn of(offset_bytes: u64, length_bytes: u64) -> Option<Geometry> {
        if length_bytes == 0 {
            return None;
        }
        let end = offset_bytes + length_bytes;
        let first = offset_bytes / BLOCK_BYTES;
        let last = (end - 1) / BLOCK_BYTES;
        // `end - first block's start < a block`, not `end < (first + 1) * BLOCK_BYTES`: that
        // overflows for a range in the last block below 2^64 (a damaged record; found by fuzzing).
        let head_partial = offset_bytes % BLOCK_BYTES != 0 || end - first * BLOCK_BYTES < BLOCK_BYTES;
        let tail_partial = last != first && end % BLOCK_BYTES != 0;
        Some(Geometry { first, last, head_partial, tail_partial })
    }

    /// Blocks fully covered by the range.
    pub fn whole(&self) -> Range<u64> {
        self.first + self.head_partial as u64..self.last + 1 - self.tail_partial as u64
    }
}

impl LogRecord {
    fn flags(&self) -> u8 {
        match &self.change {
            Change::Zero { head, tail, .. } => {
                (if edge_content(head).is_some() { FLAG_HEAD } else { 0 })
                    | (if edge_content(tail).is_some() { FLAG_TAIL } else { 0 })
            }
            Change::Blocks { placed: true, .. } => FLAG_PLACED,
            _ => 0,
        }
    }

    /// A placed write (see [`Change::Blocks`]): its data is in the data file, not in the log.
    pub fn is_placed(&self) -> bool {
        matches!(self.change, Change::Blocks { placed: true, .. })
    }

    /// The data carried in the log after the checksum table: whole blocks, back to back.
    fn logged_pieces(&self) -> impl Iterator<Item = &Bytes> {
        let (pieces, head, tail): (&[Bytes], _, _) = match &self.change {
            Change::Nothing => (&[], None, None),
            Change::Blocks { placed: true, .. } => (&[], None, None),
            Change::Blocks { pieces, .. } => (pieces, None, None),
            Change::Zero { head, tail, .. } => (&[], edge_content(head), edge_content(tail)),
        };
        pieces.iter().chain(head.map(|(b, _)| b)).chain(tail.map(|(b, _)| b))
    }

    /// The checksum of every logged block, in order.
    fn logged_crcs(&self) -> impl Iterator<Item = u32> + '_ {
        let (crcs, head, tail): (&[u32], _, _) = match &self.change {
            Change::Nothing => (&[], None, None),
            Change::Blocks { crcs, .. } => (crcs, None, None),
            Change::Zero { head, tail, .. } => (&[], edge_content(head), edge_content(tail)),
        };
        crcs.iter().copied().chain(head.map(|(_, c)| *c)).chain(tail.map(|(_, c)| *c))
    }

    /// Bytes this record writes to the data file when applied (none for a placed write:
    /// its data was written and synced before it was logged).
    pub fn written_bytes(&self) -> u64 {
        match &self.change {
            Change::Nothing | Change::Blocks { placed: true, .. } => 0,
            Change::Blocks { crcs, .. } => crcs.len() as u64 * BLOCK_BYTES,
            Change::Zero { .. } => self.logged_crcs().count() as u64 * BLOCK_BYTES,
        }
    }

    /// The blocks this record writes to the data file when applied, first to last (`None` if
    /// it writes none: holes are not written, nor are a placed write's blocks).
    pub fn written_blocks(&self) -> Option<Range<u64>> {
        match &self.change {
            Change::Nothing | Change::Blocks { placed: true, .. } => None,
            Change::Blocks { first_block, crcs, .. } => {
                (!crcs.is_empty()).then(|| *first_block..first_block + crcs.len() as u64)
            }
            Change::Zero { head, tail, .. } => {
                let mut written = [head, tail].into_iter().flatten().filter(|e| e.content.is_some()).map(|e| e.block);
                let first = written.next()?;
                let last = written.last().unwrap_or(first);
                Some(first..last + 1)
            }
        }
    }

    /// Bytes of the record in the log, frame included.
    pub fn frame_bytes(&self) -> u64 {
        let blocks = self.logged_crcs().count() as u64;
        let data_blocks = if self.is_placed() { 0 } else { blocks };
        RECORD_FRAME_BYTES + RECORD_HEADER_BYTES + blocks * 4 + data_blocks * BLOCK_BYTES
    }

    /// The record as the host element sent it (with `volume` zero: the caller sets its own).
    /// A placed write read back from the log needs its data first (`Store::log_records`).
    pub fn to_record(&self) -> Record {
        assert!(
            !matches!(&self.change, Change::Blocks { placed: true, pieces, .. } if pieces.is_empty()),
            "a placed write read from the log gets its data before it is sent"
        );
        let op = match self.kind {
            Kind::Write => {
                let data = match &self.change {
                    Change::Nothing => Bytes::new(),
                    Change::Blocks { first_block, pieces, .. } => {
                        let skip = (self.offset_bytes - first_block * BLOCK_BYTES) as usize;
                        let length = self.length_bytes as usize;
                        if pieces.len() == 1 {
                            pieces[0].slice(skip..skip + length)
                        } else {
                            let mut data = BytesMut::with_capacity(skip + length);
                            for piece in pieces {
                                data.extend_from_slice(piece);
                            }
                            data.freeze().slice(skip..skip + length)
                        }
                    }
                    Change::Zero { .. } => unreachable!("writes change blocks"),
                };
                // The checksums stored with whole blocks are the host element's; only the
                // pieces of partly written blocks are computed again here.
                let crcs = match &self.change {
                    Change::Blocks { crcs, .. }
                        if self.offset_bytes % BLOCK_BYTES == 0 && self.length_bytes % BLOCK_BYTES == 0 =>
                    {
                        crcs.clone()
                    }
                    _ => proto::pieces::piece_crcs(self.offset_bytes, &data),
                };
                Op::Write { offset_bytes: self.offset_bytes, data, crcs }
            }
            Kind::Trim => Op::Trim { offset_bytes: self.offset_bytes, length_bytes: self.length_bytes },
            Kind::WriteZeroes => Op::WriteZeroes { offset_bytes: self.offset_bytes, length_bytes: self.length_bytes },
            Kind::Snapshot => Op::Snapshot { id: self.offset_bytes },
            Kind::SnapshotDelete => Op::SnapshotDelete { id: self.offset_bytes },
            Kind::Begin => Op::Begin,
            Kind::PlacedCopy => unreachable!("a placed write's copy is served as part of its write"),
        };
        Record { volume: VolumeId(0), epoch: self.epoch, sequence: self.sequence, op }
    }

    /// Append the frame, header and checksum table to `scratch`; the blocks follow separately.
    fn encode_head(&self, scratch: &mut Vec<u8>) {
        let blocks = self.logged_crcs().count() as u32;
        let start = scratch.len();
        scratch.extend_from_slice(&[0; RECORD_FRAME_BYTES as usize]);
        scratch.extend_from_slice(&self.volume_number.to_le_bytes());
        scratch.extend_from_slice(&blocks.to_le_bytes());
        scratch.extend_from_slice(&self.epoch.0.to_le_bytes());
        scratch.extend_from_slice(&self.sequence.0.to_le_bytes());
        scratch.extend_from_slice(&self.offset_bytes.to_le_bytes());
        scratch.extend_from_slice(&self.length_bytes.to_le_bytes());
        scratch.push(self.kind as u8);
        scratch.push(self.flags());
        scratch.extend_from_slice(&[0, 0]);
        for crc in self.logged_crcs() {
            scratch.extend_from_slice(&crc.to_le_bytes());
        }
        let payload_bytes = self.frame_bytes() - RECORD_FRAME_BYTES;
        let crc = proto::crc32c(&scratch[start + RECORD_FRAME_BYTES as usize..]);
        scratch[start..start + 4].copy_from_slice(&(payload_bytes as u32).to_le_bytes());
        scratch[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decode and verify one record payload (the frame checksum `crc` included).
    pub fn decode(payload: Bytes, crc: u32) -> Result<LogRecord, String> {
        if payload.len() < RECORD_HEADER_BYTES as usize {
            return Err(format!("record of {} bytes is shorter than its header", payload.len()));
        }
        let u32_at = |at: usize| u32::from_le_bytes(payload[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().expect("8"));
        let blocks = u32_at(4) as u64;
        let table_end = RECORD_HEADER_BYTES + 4 * blocks;
        let placed = payload[41] & FLAG_PLACED != 0;
        let data_blocks = if placed { 0 } else { blocks };
        if payload.len() as u64 != table_end + data_blocks * BLOCK_BYTES {
            return Err(format!("record of {} bytes cannot hold {blocks} blocks", payload.len()));
        }
        let actual = proto::crc32c(&payload[..table_end as usize]);
        if actual != crc {
            return Err(format!("record checksum mismatch: frame has {crc:#010x}, record {actual:#010x}"));
        }
        let volume_number = u32_at(0);
        let epoch = Epoch(u64_at(8));
        let sequence = Sequence(u64_at(16));
        let offset_bytes = u64_at(24);
        let length_bytes = u64_at(32);
        let kind = Kind::from_u8(payload[40]).ok_or_else(|| format!("unknown operation {}", payload[40]))?;
        let flags = payload[41];
        if payload[42] != 0 || payload[43] != 0 {
            return Err("reserved bytes are not zero".into());
        }
        if offset_bytes.checked_add(length_bytes).is_none() {
            return Err(format!("range of {length_bytes} bytes at {offset_bytes} overflows"));
        }
        let crcs: Vec<u32> = (0..blocks as usize).map(|i| u32_at(RECORD_HEADER_BYTES as usize + 4 * i)).collect();
        let data = payload.slice(table_end as usize..);
        for (i, block) in data.chunks_exact(BLOCK_BYTES as usize).enumerate() {
            let actual = proto::crc32c(block);
            if actual != crcs[i] {
                return Err(format!("block {i} of the record fails its checksum"));
            }
        }
        if kind.changes_no_block() && length_bytes != 0 {
            return Err(format!("record of kind {} (no block changes) of {length_bytes} bytes", kind as u8));
        }
        if kind == Kind::Begin && offset_bytes != 0 {
            return Err(format!("beginning record with offset {offset_bytes}"));
        }
        if kind == Kind::PlacedCopy && length_bytes == 0 {
            return Err("an empty copy of placed data".into());
        }
        let geometry = Geometry::of(offset_bytes, length_bytes);
        let change = match (kind, geometry) {
            (_, None) => {
                if blocks != 0 || flags != 0 {
                    return Err("empty operation carries blocks".into());
                }
                Change::Nothing
            }
            (Kind::PlacedCopy, Some(g)) => {
                if flags != 0 || g.head_partial || g.tail_partial || blocks != g.last - g.first + 1 {
                    return Err(format!(
                        "copy of placed data covering blocks {}..={} (flags {flags:#x}) carries {blocks} whole blocks",
                        g.first, g.last
                    ));
                }
                Change::Blocks { first_block: g.first, pieces: vec![data], crcs, placed: false }
            }
            (Kind::Write, Some(g)) => {
                if flags & !FLAG_PLACED != 0 || blocks != g.last - g.first + 1 {
                    return Err(format!("write covering blocks {}..={} carries {blocks} blocks", g.first, g.last));
                }
                if placed && (g.head_partial || g.tail_partial) {
                    return Err("a placed write covers partial blocks".into());
                }
                let pieces = if placed { Vec::new() } else { vec![data] };
                Change::Blocks { first_block: g.first, pieces, crcs, placed }
            }
            (_, Some(g)) => {
                let head_logged = flags & FLAG_HEAD != 0;
                let tail_logged = flags & FLAG_TAIL != 0;
                if flags & !(FLAG_HEAD | FLAG_TAIL) != 0
                    || (head_logged && !g.head_partial)
                    || (tail_logged && !g.tail_partial)
                    || blocks != head_logged as u64 + tail_logged as u64
                {
                    return Err(format!("zeroing record has inconsistent edge blocks (flags {flags:#x})"));
                }
                let mut logged = data.chunks_exact(BLOCK_BYTES as usize).zip(crcs.iter()).map(|(b, c)| {
                    let start = b.as_ptr() as usize - data.as_ptr() as usize;
                    (data.slice(start..start + BLOCK_BYTES as usize), *c)
                });
                let head = g
                    .head_partial
                    .then(|| Edge { block: g.first, content: if head_logged { logged.next() } else { None } });
                let tail = g
                    .tail_partial
                    .then(|| Edge { block: g.last, content: if tail_logged { logged.next() } else { None } });
                Change::Zero { head, whole: g.whole(), tail }
            }
        };
        Ok(LogRecord { volume_number, epoch, sequence, kind, offset_bytes, length_bytes, change })
    }
}

fn edge_content(edge: &Option<Edge>) -> Option<&(Bytes, u32)> {
    edge.as_ref().and_then(|e| e.content.as_ref())
}

pub fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(LOG_DIR).join(format!("{id:020}{SEGMENT_SUFFIX}"))
}

pub fn spare_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(LOG_DIR).join(format!("{id:020}{SPARE_SUFFIX}"))
}

pub fn free_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(LOG_DIR).join(format!("{id:020}{FREE_SUFFIX}"))
}

/// The files of the log directory: per segment id its `.seg` and `.spare` files (normally
/// one), and the free files awaiting recycling.
#[derive(Default)]
pub struct LogFiles {
    pub segments: std::collections::BTreeMap<u64, Vec<PathBuf>>,
    pub free: Vec<PathBuf>,
}

pub fn list_log_files(dir: &Path) -> Result<LogFiles, StoreError> {
    let log_dir = dir.join(LOG_DIR);
    let mut files = LogFiles::default();
    for entry in std::fs::read_dir(&log_dir).map_err(io_error("list", &log_dir))? {
        let entry = entry.map_err(io_error("list", &log_dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let id = |suffix: &str| name.strip_suffix(suffix).and_then(|n| n.parse::<u64>().ok());
        if let Some(id) = id(SEGMENT_SUFFIX) {
            // `.seg` first: it wins over a `.spare` of the same id when both are valid.
            files.segments.entry(id).or_default().insert(0, entry.path());
        } else if let Some(id) = id(SPARE_SUFFIX) {
            files.segments.entry(id).or_default().push(entry.path());
        } else if id(FREE_SUFFIX).is_some() {
            files.free.push(entry.path());
        } else {
            tracing::warn!(file = %entry.path().display(), "ignoring a foreign file in the log directory");
        }
    }
    Ok(files)
}

/// The header of segment `segment`: which segment precedes it and where that one's log ends.
pub fn segment_header(segment: u64, previous: u64, previous_end: u64) -> [u8; SEGMENT_HEADER_BYTES] {
    let mut header = [0u8; SEGMENT_HEADER_BYTES];
    header[0..4].copy_from_slice(&SEGMENT_MAGIC.to_le_bytes());
    header[8..16].copy_from_slice(&segment.to_le_bytes());
    header[16..24].copy_from_slice(&previous.to_le_bytes());
    header[24..32].copy_from_slice(&previous_end.to_le_bytes());
    let crc = proto::crc32c(&header[8..]);
    header[4..8].copy_from_slice(&crc.to_le_bytes());
    header
}

/// `(previous segment, its end)` if `file` starts with a valid header of segment `segment`;
/// `None` if the segment was never written to (or its first write was cut short).
pub fn read_segment_header(file: &File, path: &Path, segment: u64) -> Result<Option<(u64, u64)>, StoreError> {
    let mut header = [0u8; SEGMENT_HEADER_BYTES];
    let file_bytes = file.metadata().map_err(io_error("stat", path))?.len();
    if file_bytes < SEGMENT_HEADER_BYTES as u64 {
        return Ok(None);
    }
    file.read_exact_at(&mut header, 0).map_err(io_error("read log", path))?;
    let u32_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4"));
    let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8"));
    let valid = u32_at(0) == SEGMENT_MAGIC
        && proto::crc32c(&header[8..]) == u32_at(4)
        && u64_at(8) == segment
        && u64_at(32) == 0;
    Ok(valid.then(|| (u64_at(16), u64_at(24))))
}

/// Ids of the segment files in `dir/log`, ascending.
#[cfg_attr(not(test), allow(dead_code))]
pub fn list_segments(dir: &Path) -> Result<Vec<u64>, StoreError> {
    let log_dir = dir.join(LOG_DIR);
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(&log_dir).map_err(io_error("list", &log_dir))? {
        let entry = entry.map_err(io_error("list", &log_dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        match name.strip_suffix(SEGMENT_SUFFIX).and_then(|n| n.parse::<u64>().ok()) {
            Some(id) => ids.push(id),
            None => {
                tracing::warn!(file = %entry.path().display(), "ignoring a foreign file in the log directory")
            }
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

fn batch_header(segment: u64, offset: u64, body_bytes: u64, records: u32) -> [u8; BATCH_HEADER_BYTES] {
    let mut header = [0u8; BATCH_HEADER_BYTES];
    header[0..4].copy_from_slice(&BATCH_MAGIC.to_le_bytes());
    header[8..16].copy_from_slice(&segment.to_le_bytes());
    header[16..24].copy_from_slice(&offset.to_le_bytes());
    header[24..32].copy_from_slice(&body_bytes.to_le_bytes());
    header[32..36].copy_from_slice(&records.to_le_bytes());
    let crc = proto::crc32c(&header[8..]);
    header[4..8].copy_from_slice(&crc.to_le_bytes());
    header
}

/// A batch header that is valid for position `offset` of segment `segment`: `(body bytes,
/// record count)`.
fn parse_batch_header(header: &[u8], segment: u64, offset: u64) -> Result<(u64, u32), String> {
    let u32_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4"));
    let u64_at = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8"));
    if header.iter().all(|b| *b == 0) {
        return Err("zeroes instead of a batch header".into());
    }
    if u32_at(0) != BATCH_MAGIC {
        return Err("no batch header (bad magic)".into());
    }
    if proto::crc32c(&header[8..BATCH_HEADER_BYTES]) != u32_at(4) {
        return Err("batch header checksum mismatch".into());
    }
    if u64_at(8) != segment || u64_at(16) != offset {
        return Err(format!("batch header belongs to segment {} at byte {}", u64_at(8), u64_at(16)));
    }
    let body = u64_at(24);
    let records = u32_at(32);
    // A batch of no records is a sync mark (see `LogWriter::append`): no body either.
    if body > LOG_BATCH_BYTES_MAX - BATCH_HEADER_BYTES as u64 || (records == 0) != (body == 0) || u32_at(36) != 0 {
        return Err(format!("batch header is inconsistent ({body} bytes, {records} records)"));
    }
    Ok((body, records))
}

/// Where and why the scan of a segment stopped before its end.
#[derive(Debug)]
pub struct Torn {
    pub offset: u64,
    pub reason: String,
    /// The log simply ends here: at the end of the file, or at zeroes (an end mark or
    /// zero-filled space), not at the remains of a cut-short batch.
    pub clean: bool,
}

/// Read the batches of a used segment in order (after its header), handing every record of
/// every complete, valid batch to `visit` (a batch is all or nothing). Returns the end of the
/// valid prefix and, if the file goes on past it, why the next batch is invalid. With `end`
/// (a sealed segment whose end the next segment's header names), the scan stops there.
pub fn scan_segment(
    file: &File,
    path: &Path,
    segment: u64,
    end: Option<u64>,
    mut visit: impl FnMut(u64, u32, LogRecord) -> Result<(), StoreError>,
) -> Result<(u64, Option<Torn>), StoreError> {
    let file_bytes = file.metadata().map_err(io_error("stat", path))?.len();
    let limit = end.map_or(file_bytes, |end| end.min(file_bytes));
    let mut offset = SEGMENT_HEADER_BYTES as u64;
    let mut header = [0u8; BATCH_HEADER_BYTES];
    if end.is_some_and(|end| end > file_bytes) {
        return Ok((
            offset,
            Some(Torn {
                offset,
                reason: format!("the segment is {file_bytes} bytes, shorter than its sealed end"),
                clean: false,
            }),
        ));
    }
    while offset < limit {
        let torn = |reason: String, clean: bool| Ok((offset, Some(Torn { offset, reason, clean })));
        if limit - offset < BATCH_HEADER_BYTES as u64 {
            return torn(format!("{} bytes, too short for a batch header", limit - offset), false);
        }
        file.read_exact_at(&mut header, offset).map_err(io_error("read log", path))?;
        let (body_bytes, records) = match parse_batch_header(&header, segment, offset) {
            Ok(parsed) => parsed,
            Err(reason) => return torn(reason, header.iter().all(|b| *b == 0)),
        };
        let body_start = offset + BATCH_HEADER_BYTES as u64;
        if limit - body_start < body_bytes {
            return torn(format!("batch of {body_bytes} bytes runs past the end of the segment"), false);
        }
        let mut body = crate::zeroed_buffer(body_bytes as usize);
        file.read_exact_at(&mut body, body_start).map_err(io_error("read log", path))?;
        let body = body.freeze();
        let mut decoded = Vec::with_capacity(records as usize);
        let mut at = 0usize;
        for _ in 0..records {
            if body.len() - at < RECORD_FRAME_BYTES as usize {
                return torn(format!("batch ends inside record {}", decoded.len()), false);
            }
            let length = u32::from_le_bytes(body[at..at + 4].try_into().expect("4")) as usize;
            let crc = u32::from_le_bytes(body[at + 4..at + 8].try_into().expect("4"));
            let frame = RECORD_FRAME_BYTES as usize + length;
            if frame as u64 > LOG_RECORD_BYTES_MAX || body.len() - at < frame {
                return torn(format!("record {} claims {length} bytes", decoded.len()), false);
            }
            let payload = body.slice(at + RECORD_FRAME_BYTES as usize..at + frame);
            match LogRecord::decode(payload, crc) {
                Ok(record) => decoded.push((body_start + at as u64, frame as u32, record)),
                Err(reason) => return torn(format!("record {}: {reason}", decoded.len()), false),
            }
            at += frame;
        }
        if at != body.len() {
            return torn(format!("{} bytes after the batch's last record", body.len() - at), false);
        }
        for (record_offset, frame, record) in decoded {
            visit(record_offset, frame, record)?;
        }
        offset = body_start + body_bytes;
    }
    Ok((offset, None))
}

/// The first offset after `from` where a valid batch header of this segment starts, if any:
/// if one exists, the invalid batch at `from` is corruption, not a torn tail.
pub fn find_batch_after(file: &File, path: &Path, segment: u64, from: u64) -> Result<Option<u64>, StoreError> {
    let file_bytes = file.metadata().map_err(io_error("stat", path))?.len();
    let magic = BATCH_MAGIC.to_le_bytes();
    let mut buffer = vec![0u8; SCAN_BUFFER_BYTES as usize];
    let mut start = from + 1;
    while start + BATCH_HEADER_BYTES as u64 <= file_bytes {
        let length = (file_bytes - start).min(SCAN_BUFFER_BYTES) as usize;
        let window = &mut buffer[..length];
        file.read_exact_at(window, start).map_err(io_error("read log", path))?;
        let candidates = window.len().saturating_sub(BATCH_HEADER_BYTES - 1);
        for i in 0..candidates {
            if window[i..i + 4] == magic
                && parse_batch_header(&window[i..i + BATCH_HEADER_BYTES], segment, start + i as u64).is_ok()
            {
                return Ok(Some(start + i as u64));
            }
        }
        start += candidates as u64;
    }
    Ok(None)
}

/// Read one record back from a segment (for peer recovery), verifying every checksum.
pub fn read_record(file: &File, path: &Path, offset: u64, frame: u32) -> Result<LogRecord, StoreError> {
    let mut bytes = crate::zeroed_buffer(frame as usize);
    file.read_exact_at(&mut bytes, offset).map_err(io_error("read log", path))?;
    let bytes = bytes.freeze();
    let corrupt = |reason: String| StoreError::CorruptLog { path: path.to_path_buf(), offset, reason };
    let length = u32::from_le_bytes(bytes[0..4].try_into().expect("4"));
    if length as u64 + RECORD_FRAME_BYTES != frame as u64 {
        return Err(corrupt(format!("record length {length} changed since it was indexed")));
    }
    let crc = u32::from_le_bytes(bytes[4..8].try_into().expect("4"));
    LogRecord::decode(bytes.slice(RECORD_FRAME_BYTES as usize..), crc).map_err(corrupt)
}

// ---------------------------------------------------------------------------------------------
// The index of retained records.
// ---------------------------------------------------------------------------------------------

/// One segment of the log and where each volume's records are in it.
pub struct Segment {
    pub id: u64,
    pub path: PathBuf,
    pub file: Arc<File>,
    /// End of the segment's log.
    pub bytes: u64,
    /// Size of its file (preallocated space included), if larger.
    pub disk_bytes: u64,
    /// Per volume number: its first sequence in this segment and `(offset, frame bytes)` of
    /// each record, consecutive sequences.
    runs: HashMap<u32, Run>,
    /// Per volume number: the sequences of its placed writes in this segment.
    placed: HashMap<u32, Vec<Sequence>>,
    /// Data bytes of the placed writes in this segment (in the data files, not in the log).
    placed_bytes: u64,
    /// Per (volume number, sequence of a placed write): `(offset, frame bytes)` of the copies
    /// of its data in this segment ([`Kind::PlacedCopy`]). A copy is never older than its
    /// placed write, so it is dropped with or after it.
    copies: HashMap<(u32, Sequence), Vec<(u64, u32)>>,
}

struct Run {
    first: Sequence,
    records: Vec<(u64, u32)>,
}

impl Run {
    fn last(&self) -> Sequence {
        Sequence(self.first.0 + self.records.len() as u64 - 1)
    }
}

/// A volume's records do not follow each other across the index.
#[derive(Debug)]
pub struct Discontinuity {
    pub expected: Sequence,
    pub found: Sequence,
    /// The break is at the start of the segment (older segments disagree), not inside it.
    pub at_segment_start: bool,
}

/// The retained log: closed segments (the replay log) and the live one, oldest first.
#[derive(Default)]
pub struct LogIndex {
    segments: VecDeque<Segment>,
}

/// Where to read the records of a [`LogIndex::locate`] answer.
pub struct RecordLocation {
    pub file: Arc<File>,
    pub path: PathBuf,
    pub offset: u64,
    pub frame: u32,
}

impl LogIndex {
    pub fn push_segment(&mut self, id: u64, path: PathBuf, file: Arc<File>, bytes: u64) {
        if let Some(last) = self.segments.back() {
            assert!(last.id < id, "segments are indexed in order");
        }
        self.segments.push_back(Segment {
            id,
            path,
            file,
            bytes,
            disk_bytes: 0,
            runs: HashMap::new(),
            placed: HashMap::new(),
            placed_bytes: 0,
            copies: HashMap::new(),
        });
    }

    /// The newest segment was sealed: its log ends at `bytes`, its file holds `disk_bytes`.
    pub fn seal_newest(&mut self, bytes: u64, disk_bytes: u64) {
        let newest = self.segments.back_mut().expect("the live segment is indexed");
        newest.bytes = bytes;
        newest.disk_bytes = disk_bytes;
    }

    /// End of the log of segment `id`, if indexed.
    pub fn segment_bytes(&self, id: u64) -> Option<u64> {
        self.segments.iter().find(|s| s.id == id).map(|s| s.bytes)
    }

    fn last_sequence(&self, volume: u32, before_segment: usize) -> Option<Sequence> {
        self.segments.iter().take(before_segment).rev().find_map(|s| s.runs.get(&volume).map(Run::last))
    }

    /// Index a record of the newest segment.
    pub fn add(&mut self, volume: u32, sequence: Sequence, offset: u64, frame: u32) -> Result<(), Discontinuity> {
        let newest = self.segments.len() - 1;
        let expected = match self.segments[newest].runs.get(&volume) {
            Some(run) => Some((run.last().next(), false)),
            None => self.last_sequence(volume, newest).map(|s| (s.next(), true)),
        };
        if let Some((expected, at_segment_start)) = expected {
            if sequence != expected {
                return Err(Discontinuity { expected, found: sequence, at_segment_start });
            }
        }
        let segment = &mut self.segments[newest];
        segment.bytes = segment.bytes.max(offset + frame as u64);
        segment
            .runs
            .entry(volume)
            .or_insert(Run { first: sequence, records: Vec::new() })
            .records
            .push((offset, frame));
        Ok(())
    }

    /// Index a record of the newest segment: [`LogIndex::add`] for the volume's own records
    /// (placed writes noted as such), [`Kind::PlacedCopy`] apart, under its placed write.
    pub fn add_record(&mut self, record: &LogRecord, offset: u64, frame: u32) -> Result<(), Discontinuity> {
        let newest = self.segments.len() - 1;
        let segment = &mut self.segments[newest];
        let key = (record.volume_number, record.sequence);
        if record.kind == Kind::PlacedCopy {
            segment.bytes = segment.bytes.max(offset + frame as u64);
            segment.copies.entry(key).or_default().push((offset, frame));
            return Ok(());
        }
        self.add(record.volume_number, record.sequence, offset, frame)?;
        if record.is_placed() {
            let segment = &mut self.segments[newest];
            segment.placed.entry(record.volume_number).or_default().push(record.sequence);
            segment.placed_bytes += record.length_bytes;
        }
        Ok(())
    }

    /// Whether the retained log holds any placed write of `volume`.
    pub fn holds_placed(&self, volume: u32) -> bool {
        self.segments.iter().any(|s| s.placed.contains_key(&volume))
    }

    /// Whether record `sequence` of `volume` is a placed write the retained log holds.
    pub fn is_placed(&self, volume: u32, sequence: Sequence) -> bool {
        self.segments.iter().any(|s| s.placed.get(&volume).is_some_and(|list| list.binary_search(&sequence).is_ok()))
    }

    /// The copies of placed write `sequence` of `volume`'s data ([`Kind::PlacedCopy`]), oldest
    /// first.
    pub fn placed_copies(&self, volume: u32, sequence: Sequence) -> Vec<RecordLocation> {
        let mut out = Vec::new();
        for segment in &self.segments {
            for &(offset, frame) in segment.copies.get(&(volume, sequence)).into_iter().flatten() {
                out.push(RecordLocation { file: segment.file.clone(), path: segment.path.clone(), offset, frame });
            }
        }
        out
    }

    pub fn set_newest_bytes(&mut self, bytes: u64) {
        self.segments.back_mut().expect("the live segment is indexed").bytes = bytes;
    }

    /// Forget every segment older than the newest (after a discontinuity or corruption).
    pub fn drop_older_than_newest(&mut self) -> Vec<Segment> {
        let keep = self.segments.pop_back();
        let dropped = self.segments.drain(..).collect();
        self.segments.extend(keep);
        dropped
    }

    /// Forget every segment.
    pub fn clear(&mut self) -> Vec<Segment> {
        self.segments.drain(..).collect()
    }

    /// Disk bytes of the closed segments (all but the newest).
    pub fn closed_bytes(&self) -> u64 {
        self.segments.iter().rev().skip(1).map(|s| s.bytes.max(s.disk_bytes)).sum()
    }

    /// What the closed segments hold for peers: their disk bytes, and the data of their placed
    /// writes, which `Store::log_records` serves from the data files (so that the replay log's
    /// budget bounds the history it serves, and the copies of placed data it keeps, alike).
    pub fn closed_replay_bytes(&self) -> u64 {
        self.closed_bytes() + self.segments.iter().rev().skip(1).map(|s| s.placed_bytes).sum::<u64>()
    }

    /// Drop the oldest closed segments older than `before` (the checkpoint's first segment:
    /// the newer ones are still needed for crash recovery) until what the closed ones hold
    /// fits in `budget` bytes ([`LogIndex::closed_replay_bytes`]).
    pub fn trim_to(&mut self, budget: u64, before: u64) -> Vec<Segment> {
        let mut dropped = Vec::new();
        while self.segments.len() > 1 && self.segments[0].id < before && self.closed_replay_bytes() > budget {
            dropped.push(self.segments.pop_front().expect("len > 1"));
        }
        dropped
    }

    /// Whether any indexed segment holds records of `volume` (copies of placed data included).
    pub fn holds_volume(&self, volume: u32) -> bool {
        self.segments.iter().any(|s| s.runs.contains_key(&volume) || s.copies.keys().any(|(v, _)| *v == volume))
    }

    pub fn segment_ids(&self) -> Vec<u64> {
        self.segments.iter().map(|s| s.id).collect()
    }

    /// Records `after + 1 ..= last` of `volume` (at least one, then while their frames fit in
    /// `max_bytes`). `Err(oldest held)` if `after + 1` is not held.
    pub fn locate(
        &self,
        volume: u32,
        after: Sequence,
        last: Sequence,
        max_bytes: u64,
    ) -> Result<Vec<RecordLocation>, Option<Sequence>> {
        let oldest = self.segments.iter().find_map(|s| s.runs.get(&volume).map(|r| r.first));
        let mut wanted = after.next();
        match oldest {
            Some(oldest) if oldest <= wanted => {}
            _ => return Err(oldest),
        }
        let mut out = Vec::new();
        let mut bytes = 0u64;
        for segment in &self.segments {
            let Some(run) = segment.runs.get(&volume) else {
                continue;
            };
            while wanted >= run.first && wanted <= run.last() && wanted <= last {
                let (offset, frame) = run.records[(wanted.0 - run.first.0) as usize];
                if !out.is_empty() && bytes + frame as u64 > max_bytes {
                    return Ok(out);
                }
                bytes += frame as u64;
                out.push(RecordLocation { file: segment.file.clone(), path: segment.path.clone(), offset, frame });
                wanted = wanted.next();
            }
        }
        if out.is_empty() && wanted <= last {
            return Err(oldest);
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// The writer.
// ---------------------------------------------------------------------------------------------

enum Part {
    Scratch(Range<usize>),
    Data(Bytes),
    EndMark,
    /// Zeroes that grow the file (at most `GROW_ZEROES.len()` bytes each).
    Zeroes(usize),
}

/// Appends batches to the live segment.
pub struct LogWriter {
    pub segment: u64,
    pub path: PathBuf,
    pub file: Arc<File>,
    /// End of the valid log in the live segment (0: not written to yet, not even its header).
    pub position: u64,
    /// Size of the file. Past `position` it holds zeroes or a recycled segment's bytes that
    /// appends overwrite, which is cheaper to sync than growing the file.
    pub file_bytes: u64,
    /// When a batch must grow the file, grow it to a multiple of this (zeroes after the batch);
    /// 0: grow it to the batch's end only. See [`crate::LOG_GROW_STEP_BYTES`].
    pub grow_step_bytes: u64,
    /// The log's file system holds everything in memory (tmpfs, ramfs), whose `fdatasync`
    /// does nothing: batches are not synced (one system call fewer per commit). Set from the
    /// log directory itself, which may be a mount of its own.
    pub in_memory: bool,
    /// Written with the segment's first batch.
    header: [u8; SEGMENT_HEADER_BYTES],
    scratch: Vec<u8>,
    parts: Vec<Part>,
}

impl LogWriter {
    /// A writer appending to segment `segment` at `position`; if that is 0, it starts with the
    /// segment header naming `previous` (`(segment, end of its log)`, `(0, 0)` if unknown).
    pub fn new(
        segment: u64,
        path: PathBuf,
        file: Arc<File>,
        position: u64,
        file_bytes: u64,
        previous: (u64, u64),
    ) -> LogWriter {
        LogWriter {
            segment,
            path,
            file,
            position,
            file_bytes,
            grow_step_bytes: 0,
            in_memory: false,
            header: segment_header(segment, previous.0, previous.1),
            scratch: Vec::new(),
            parts: Vec::new(),
        }
    }

    /// Create segment `id` (empty) durably and open it.
    pub fn create_segment(dir: &Path, id: u64) -> Result<Arc<File>, StoreError> {
        let path = segment_path(dir, id);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_error("create log segment", &path))?;
        let log_dir = dir.join(LOG_DIR);
        sys::sync_dir(&log_dir).map_err(io_error("sync directory", &log_dir))?;
        Ok(Arc::new(file))
    }

    /// Seal the live segment and switch to the unused segment `id`, whose file holds
    /// `file_bytes` bytes.
    pub fn rotate(&mut self, id: u64, path: PathBuf, file: Arc<File>, file_bytes: u64) {
        assert!(id == self.segment + 1, "segments follow each other");
        assert!(self.position > 0, "only a used segment is sealed");
        self.header = segment_header(id, self.segment, self.position);
        self.segment = id;
        self.path = path;
        self.file = file;
        self.position = 0;
        self.file_bytes = file_bytes;
    }

    /// Write `records` as batches and make them durable: one vectored write and one
    /// `fdatasync` (none for a log in memory) unless the records exceed one batch. Returns each
    /// record's `(offset, frame bytes)` in the segment. On error the segment's tail past
    /// `position` is undefined and the writer must not be used again.
    pub fn append(&mut self, records: &[LogRecord]) -> Result<Vec<(u64, u32)>, StoreError> {
        let mut positions = Vec::with_capacity(records.len());
        let mut next = 0;
        while next < records.len() {
            self.scratch.clear();
            self.parts.clear();
            let write_start = self.position;
            if self.position == 0 {
                self.scratch.extend_from_slice(&self.header);
                self.position = SEGMENT_HEADER_BYTES as u64;
            }
            let batch_header_at = self.scratch.len();
            self.scratch.extend_from_slice(&[0; BATCH_HEADER_BYTES]);
            self.parts.push(Part::Scratch(0..self.scratch.len()));
            let batch_start = self.position;
            let mut batch_bytes = BATCH_HEADER_BYTES as u64;
            let mut count = 0u32;
            while next < records.len() {
                let record = &records[next];
                let frame = record.frame_bytes();
                if count > 0 && batch_bytes + frame > LOG_BATCH_BYTES_MAX {
                    break;
                }
                positions.push((batch_start + batch_bytes, frame as u32));
                let start = self.scratch.len();
                record.encode_head(&mut self.scratch);
                // Consecutive scratch parts are merged: fewer iovecs.
                match self.parts.last_mut() {
                    Some(Part::Scratch(range)) if range.end == start => range.end = self.scratch.len(),
                    _ => self.parts.push(Part::Scratch(start..self.scratch.len())),
                }
                for piece in record.logged_pieces() {
                    self.parts.push(Part::Data(piece.clone()));
                }
                batch_bytes += frame;
                count += 1;
                next += 1;
            }
            let header = batch_header(self.segment, batch_start, batch_bytes - BATCH_HEADER_BYTES as u64, count);
            self.scratch[batch_header_at..batch_header_at + BATCH_HEADER_BYTES].copy_from_slice(&header);
            let batch_end = batch_start + batch_bytes;
            // Room for the sync mark and an end mark after the batch.
            let wanted_end = batch_end + 2 * BATCH_HEADER_BYTES as u64;
            let mut tail_bytes = 0;
            if self.in_memory && next == records.len() {
                // In memory the sync mark goes into the last batch's own write, after it: the
                // bytes `write_sync_mark` would write next (no sync comes between), one system
                // call fewer a commit. A write is done in order, so a crash in the middle of
                // it leaves no mark after a batch that is not whole.
                let start = self.scratch.len();
                self.scratch.extend_from_slice(&batch_header(self.segment, batch_end, 0, 0));
                self.parts.push(Part::Scratch(start..self.scratch.len()));
                tail_bytes = BATCH_HEADER_BYTES as u64;
                if wanted_end <= self.file_bytes {
                    self.parts.push(Part::EndMark);
                    tail_bytes += END_MARK.len() as u64;
                }
            } else if self.grow_step_bytes > 0 && wanted_end > self.file_bytes {
                // Grow by zeroes: the next commits overwrite them, which syncs cheaper.
                let grown = wanted_end.div_ceil(self.grow_step_bytes) * self.grow_step_bytes;
                tail_bytes = grown - batch_end;
                let mut left = tail_bytes as usize;
                while left > 0 {
                    let piece = left.min(GROW_ZEROES.len());
                    self.parts.push(Part::Zeroes(piece));
                    left -= piece;
                }
            } else if batch_end < self.file_bytes {
                // Inside preallocated space, mark the end of the log with zeroes (they are
                // overwritten by the next batch), so recovery never reads stale bytes there as
                // the remains of a torn batch.
                self.parts.push(Part::EndMark);
                tail_bytes = END_MARK.len() as u64;
            }
            let slices: Vec<&[u8]> = self
                .parts
                .iter()
                .map(|part| match part {
                    Part::Scratch(range) => &self.scratch[range.clone()],
                    Part::Data(bytes) => &bytes[..],
                    Part::EndMark => &END_MARK[..],
                    Part::Zeroes(bytes) => &GROW_ZEROES[..*bytes],
                })
                .collect();
            debug_assert_eq!(slices.iter().map(|s| s.len() as u64).sum::<u64>(), batch_end - write_start + tail_bytes);
            sys::write_all_vectored_at(&self.file, &slices, write_start).map_err(io_error("write log", &self.path))?;
            // One sync per batch: a later batch must never be durable before an earlier one,
            // or a crash could leave a valid batch after a torn one (read as corruption).
            if !self.in_memory {
                self.file.sync_data().map_err(io_error("sync log", &self.path))?;
            }
            self.position = batch_end;
            self.file_bytes = self.file_bytes.max(batch_end + tail_bytes);
        }
        // In memory, the last batch's write held it (above).
        if !self.in_memory || records.is_empty() {
            self.write_sync_mark();
        }
        Ok(positions)
    }

    /// After a sync: a batch of no records at the end of the log (followed by an end mark),
    /// not synced and overwritten by the next batch. Its presence proves the batch before it
    /// was synced (it is written only after the `fdatasync` returned; in memory, where a sync
    /// would wait for nothing, in the batch's own write, after the batch), so damage in that batch
    /// is read as rot of acknowledged records (refusing to start), never as a torn tail to
    /// discard. Best effort: without it, that damage reads as a torn tail, as before.
    fn write_sync_mark(&mut self) {
        let mark = batch_header(self.segment, self.position, 0, 0);
        let mut bytes = Vec::with_capacity(2 * BATCH_HEADER_BYTES);
        bytes.extend_from_slice(&mark);
        if self.position + (2 * BATCH_HEADER_BYTES) as u64 <= self.file_bytes {
            bytes.extend_from_slice(&END_MARK);
        }
        if let Err(e) = self.file.write_all_at(&bytes, self.position) {
            tracing::warn!(segment = %self.path.display(), error = %e, "cannot write the log's sync mark");
            return;
        }
        self.file_bytes = self.file_bytes.max(self.position + bytes.len() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_of_a_range_in_the_last_block_below_2_to_the_64_does_not_overflow() {
        let last_block_start = u64::MAX / BLOCK_BYTES * BLOCK_BYTES;
        let g = Geometry::of(last_block_start, 9).expect("not empty");
        assert_eq!(
            (g.first, g.last, g.head_partial, g.tail_partial),
            (u64::MAX / BLOCK_BYTES, u64::MAX / BLOCK_BYTES, true, false)
        );
        let g = Geometry::of(last_block_start - BLOCK_BYTES, BLOCK_BYTES).expect("not empty");
        assert!(!g.head_partial && !g.tail_partial);
    }

    #[test]
    fn geometry_of_ranges() {
        // (offset, length) -> (first, last, head partial, tail partial, whole blocks)
        let check = |offset: u64, length: u64, expected: (u64, u64, bool, bool, Range<u64>)| {
            let g = Geometry::of(offset, length).expect("non-empty");
            assert_eq!((g.first, g.last, g.head_partial, g.tail_partial, g.whole()), expected, "{length} at {offset}");
        };
        check(0, 4096, (0, 0, false, false, 0..1));
        check(0, 8192, (0, 1, false, false, 0..2));
        check(512, 512, (0, 0, true, false, 1..1));
        check(3584, 1024, (0, 1, true, true, 1..1));
        check(512, 8192, (0, 2, true, true, 1..2));
        check(4096, 4096 + 512, (1, 2, false, true, 1..2));
        check(512, 4096 - 512, (0, 0, true, false, 1..1));
        assert_eq!(Geometry::of(4096, 0), None);
    }

    fn sample_records() -> Vec<LogRecord> {
        let block = |seed: u8| Bytes::from(vec![seed; BLOCK_BYTES as usize]);
        let crc = |b: &Bytes| proto::crc32c(b);
        let (a, b) = (block(1), block(2));
        vec![
            LogRecord {
                volume_number: 3,
                epoch: Epoch(2),
                sequence: Sequence(9),
                kind: Kind::Write,
                offset_bytes: 4096 + 512,
                length_bytes: 4096,
                change: Change::Blocks {
                    first_block: 1,
                    pieces: vec![a.clone(), b.clone()],
                    crcs: vec![crc(&a), crc(&b)],
                    placed: false,
                },
            },
            LogRecord {
                volume_number: 0,
                epoch: Epoch(2),
                sequence: Sequence(10),
                kind: Kind::Trim,
                offset_bytes: 512,
                length_bytes: 3 * 4096,
                change: Change::Zero {
                    head: Some(Edge { block: 0, content: Some((a.clone(), crc(&a))) }),
                    whole: 1..3,
                    tail: Some(Edge { block: 3, content: None }),
                },
            },
            LogRecord {
                volume_number: 0,
                epoch: Epoch(2),
                sequence: Sequence(11),
                kind: Kind::WriteZeroes,
                offset_bytes: 8192,
                length_bytes: 0,
                change: Change::Nothing,
            },
        ]
    }

    /// A placed write of blocks 2 and 3 (its data in the data file, only checksums logged).
    fn placed_sample() -> LogRecord {
        let a = Bytes::from(vec![7u8; 2 * BLOCK_BYTES as usize]);
        let crcs = vec![proto::crc32c(&a[..4096]), proto::crc32c(&a[4096..])];
        LogRecord {
            volume_number: 1,
            epoch: Epoch(3),
            sequence: Sequence(12),
            kind: Kind::Write,
            offset_bytes: 2 * BLOCK_BYTES,
            length_bytes: 2 * BLOCK_BYTES,
            change: Change::Blocks { first_block: 2, pieces: vec![a], crcs, placed: true },
        }
    }

    /// A copy of `placed_sample`'s data, as logged before a later record changes its blocks.
    fn copy_sample() -> LogRecord {
        let LogRecord { change: Change::Blocks { first_block, pieces, crcs, .. }, .. } = placed_sample() else {
            unreachable!("the sample is a placed write")
        };
        LogRecord {
            volume_number: 1,
            epoch: Epoch(4),
            sequence: Sequence(12),
            kind: Kind::PlacedCopy,
            offset_bytes: 2 * BLOCK_BYTES,
            length_bytes: 2 * BLOCK_BYTES,
            change: Change::Blocks { first_block, pieces, crcs, placed: false },
        }
    }

    /// `bytes` (an encoded record) changed by `change`, its frame's length and checksum made
    /// to fit again, decoded: what the decoder says of the change itself.
    fn refit(mut bytes: Vec<u8>, change: &dyn Fn(&mut Vec<u8>)) -> Result<LogRecord, String> {
        change(&mut bytes);
        let payload = &bytes[RECORD_FRAME_BYTES as usize..];
        let table_end = (RECORD_HEADER_BYTES + 4 * u64::from(u32::from_le_bytes(payload[4..8].try_into().unwrap())))
            .min(payload.len() as u64) as usize;
        let (length, crc) = (payload.len() as u32, proto::crc32c(&payload[..table_end]));
        bytes[..4].copy_from_slice(&length.to_le_bytes());
        bytes[4..8].copy_from_slice(&crc.to_le_bytes());
        decode(&bytes)
    }

    fn encode(record: &LogRecord) -> Vec<u8> {
        let mut bytes = Vec::new();
        record.encode_head(&mut bytes);
        for piece in record.logged_pieces() {
            bytes.extend_from_slice(piece);
        }
        assert_eq!(bytes.len() as u64, record.frame_bytes());
        bytes
    }

    fn decode(bytes: &[u8]) -> Result<LogRecord, String> {
        if bytes.len() < RECORD_FRAME_BYTES as usize {
            return Err("short".into());
        }
        let crc = u32::from_le_bytes(bytes[4..8].try_into().expect("4"));
        LogRecord::decode(Bytes::copy_from_slice(&bytes[8..]), crc)
    }

    #[test]
    fn segment_headers_are_valid_only_for_their_segment() {
        let dir = std::env::temp_dir().join(format!("starfish-store-header-{}", std::process::id()));
        let path = dir.join("segment");
        std::fs::create_dir_all(&dir).expect("create dir");
        let header = segment_header(7, 6, 12345);
        // (bytes at the start of the file, id asked for) -> header
        let mut damaged = header;
        damaged[20] ^= 1;
        for (bytes, id, expected) in [
            (header.to_vec(), 7, Some((6, 12345))),
            (header.to_vec(), 8, None),
            (damaged.to_vec(), 7, None),
            (header[..39].to_vec(), 7, None),
            (vec![0; 40], 7, None),
        ] {
            std::fs::write(&path, &bytes).expect("write");
            let file = File::open(&path).expect("open");
            assert_eq!(read_segment_header(&file, &path, id).expect("read"), expected, "{bytes:?} as segment {id}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_round_trip() {
        for record in sample_records() {
            let decoded = decode(&encode(&record)).expect("decodes");
            assert_eq!(encode(&decoded), encode(&record));
            assert_eq!(decoded.to_record(), record.to_record());
        }
        let write = &sample_records()[0];
        let Op::Write { data, .. } = write.to_record().op else { panic!("a write") };
        assert_eq!(&data[..3584], &[1; 3584][..]);
        assert_eq!(&data[3584..], &[2; 512][..]);
    }

    #[test]
    fn a_placed_write_is_logged_with_its_checksums_only() {
        let record = placed_sample();
        let bytes = encode(&record);
        assert_eq!(bytes.len() as u64, RECORD_FRAME_BYTES + RECORD_HEADER_BYTES + 2 * 4);
        let decoded = decode(&bytes).expect("decodes");
        assert!(decoded.is_placed());
        let Change::Blocks { first_block, pieces, crcs, placed: true } = &decoded.change else { panic!("placed") };
        let Change::Blocks { crcs: logged_crcs, .. } = &record.change else { panic!("blocks") };
        assert_eq!((*first_block, pieces.len(), crcs), (2, 0, logged_crcs));
        assert_eq!(encode(&decoded), bytes);
        assert_eq!((decoded.written_blocks(), decoded.written_bytes()), (None, 0));

        // The flag is refused where it does not belong: with the data after the table, on a
        // write of partial blocks, on a trim.
        let with_data = refit(bytes.clone(), &|b| b.extend_from_slice(&[7; 2 * BLOCK_BYTES as usize]));
        assert!(with_data.is_err(), "{with_data:?}");
        let header = RECORD_FRAME_BYTES as usize;
        let partial = refit(bytes.clone(), &|b| {
            b[header + 24..header + 32].copy_from_slice(&(8192u64 + 512).to_le_bytes());
            b[header + 32..header + 40].copy_from_slice(&(8192u64 - 512).to_le_bytes());
        });
        assert_eq!(partial.err().as_deref(), Some("a placed write covers partial blocks"));
        let trim = refit(bytes.clone(), &|b| b[header + 40] = Kind::Trim as u8);
        assert!(trim.is_err(), "{trim:?}");
    }

    #[test]
    fn a_copy_of_placed_data_carries_whole_blocks_and_changes_none() {
        let record = copy_sample();
        let bytes = encode(&record);
        assert_eq!(bytes.len() as u64, RECORD_FRAME_BYTES + RECORD_HEADER_BYTES + 2 * 4 + 2 * BLOCK_BYTES);
        let decoded = decode(&bytes).expect("decodes");
        assert_eq!((decoded.kind, decoded.sequence, decoded.is_placed()), (Kind::PlacedCopy, Sequence(12), false));
        let Change::Blocks { first_block, pieces, .. } = &decoded.change else { panic!("blocks") };
        assert_eq!((*first_block, pieces.concat()), (2, vec![7u8; 2 * BLOCK_BYTES as usize]));
        assert_eq!(encode(&decoded), bytes);
        assert_eq!(decoded.blocks_changed(), None, "it keeps data for peers and changes nothing");

        // Partial blocks, flags and an empty range are refused.
        let header = RECORD_FRAME_BYTES as usize;
        let partial =
            refit(bytes.clone(), &|b| b[header + 24..header + 32].copy_from_slice(&(8192u64 + 512).to_le_bytes()));
        assert!(partial.is_err(), "{partial:?}");
        let flagged = refit(bytes.clone(), &|b| b[header + 41] = FLAG_PLACED);
        assert!(flagged.is_err(), "{flagged:?}");
        let empty = refit(bytes[..header + RECORD_HEADER_BYTES as usize].to_vec(), &|b| {
            b[header + 4..header + 8].copy_from_slice(&0u32.to_le_bytes());
            b[header + 32..header + 40].copy_from_slice(&0u64.to_le_bytes());
        });
        assert_eq!(empty.err().as_deref(), Some("an empty copy of placed data"));
    }

    #[test]
    fn damaged_records_are_refused_never_panic() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for record in sample_records().into_iter().chain([placed_sample(), copy_sample()]) {
            let bytes = encode(&record);
            // Every single-bit flip of the headers and checksums is caught.
            let checked = (RECORD_FRAME_BYTES + RECORD_HEADER_BYTES) as usize + 4 * record.logged_crcs().count();
            for i in 0..checked * 8 {
                let mut damaged = bytes.clone();
                damaged[i / 8] ^= 1 << (i % 8);
                if i / 8 >= 4 {
                    assert!(decode(&damaged).is_err(), "flip of bit {i} went unnoticed");
                }
            }
            // Random damage and truncation: an error or a record, never a panic.
            for _ in 0..2000 {
                let mut damaged = bytes.clone();
                for _ in 0..1 + next() % 4 {
                    let at = (next() % damaged.len() as u64) as usize;
                    damaged[at] = next() as u8;
                }
                let cut = (next() % (damaged.len() as u64 + 1)) as usize;
                let _ = decode(&damaged[..cut]);
                let _ = decode(&damaged);
            }
        }
        for _ in 0..20_000 {
            let length = (next() % 128) as usize;
            let garbage: Vec<u8> = (0..length).map(|_| next() as u8).collect();
            let _ = decode(&garbage);
            if garbage.len() >= BATCH_HEADER_BYTES {
                let _ = parse_batch_header(&garbage[..BATCH_HEADER_BYTES], next() % 4, next() % 4);
            }
        }
    }
}
