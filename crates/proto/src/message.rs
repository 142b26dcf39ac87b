//! Messages, their encoding, and framing with a crc32c over each body.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::{Epoch, HostId, Sequence, VolumeId, BLOCK_BYTES, PAYLOAD_BYTES_MAX};

/// `[u32 body_len][u32 crc32c(body)]`.
pub const FRAME_HEADER_BYTES: usize = 8;
/// A frame body never exceeds this: one full payload plus generous room for headers.
pub const FRAME_BODY_BYTES_MAX: u32 = PAYLOAD_BYTES_MAX + 64 * 1024;
/// Bounds on the small variable-length fields, so a hostile peer cannot make us allocate.
const NAME_BYTES_MAX: usize = 255;
const REASON_BYTES_MAX: usize = 4096;
/// A host element's admin address as text (`[v6]:port` fits with room to spare).
const ADDRESS_BYTES_MAX: usize = 255;
const VOLUMES_MAX: usize = 4096;
const EXTENTS_MAX: usize = 1 << 20;
/// Blocks one `FetchBlocks` may ask about (and one `Blocks` reply may carry): 16 MiB of data,
/// so that a reply with its per-block headers always fits one frame.
pub const COPY_CHUNK_BLOCKS_MAX: usize = (PAYLOAD_BYTES_MAX as u64 / BLOCK_BYTES / 2) as usize;
const _: () = assert!(
    COPY_CHUNK_BLOCKS_MAX as u64 * (BLOCK_BYTES + 32) + 64 + SNAPSHOTS_PER_CHUNK_MAX as u64 * 24
        <= FRAME_BODY_BYTES_MAX as u64
);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("frame body of {0} bytes exceeds the limit of {FRAME_BODY_BYTES_MAX}")]
    FrameTooLarge(u32),
    #[error("frame checksum mismatch: header says {expected:#010x}, body has {actual:#010x}")]
    Checksum { expected: u32, actual: u32 },
    #[error("message truncated: needed {needed} more bytes for {what}")]
    Truncated { what: &'static str, needed: usize },
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    #[error("{0} bytes left over after the message")]
    TrailingBytes(usize),
    #[error("field {what} out of bounds: {value}")]
    OutOfBounds { what: &'static str, value: u64 },
    #[error("field {0} is not valid UTF-8")]
    Utf8(&'static str),
    #[error(
        "the peer speaks StarFish wire version {peer} (in its {what}), this side version {WIRE_VERSION}: run one StarFish version on every host element and element"
    )]
    WireVersion { what: &'static str, peer: u16 },
}

/// The version of this protocol, first in the messages that open a session (`Hello`, `Welcome`)
/// or stand alone (a standby's `Observe`, `Observed`): a peer of another version
/// is refused with [`DecodeError::WireVersion`] before anything else of its messages is read.
/// Raise it with every change to a message's encoding.
pub const WIRE_VERSION: u16 = 2;

/// Read a message's wire version; another than ours ends the decoding there.
fn read_wire_version(r: &mut Reader, what: &'static str) -> Result<(), DecodeError> {
    match r.u16(what)? {
        WIRE_VERSION => Ok(()),
        peer => Err(DecodeError::WireVersion { what, peer }),
    }
}

/// A write-like operation, the unit that gets a sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `crcs`: the crc32c of each piece of `data` (cut at block boundaries of the volume,
    /// [`crate::pieces`]), computed once when the host element received the write: the element
    /// checks the data against them before it commits, and stores them.
    Write {
        offset_bytes: u64,
        data: Bytes,
        crcs: Vec<u32>,
    },
    /// Discard: the range reads back as zeroes afterwards (we promise that, NBD does not).
    Trim {
        offset_bytes: u64,
        length_bytes: u64,
    },
    WriteZeroes {
        offset_bytes: u64,
        length_bytes: u64,
    },
    /// Take snapshot `id` of the volume here, between the records before and after it: every
    /// element takes it at this sequence. It changes no block (offset and length are 0).
    Snapshot {
        id: u64,
    },
    /// Delete snapshot `id` of the volume here (nothing if there is none): through the ordered
    /// stream, so every element, and one that catches up later, deletes it at this sequence.
    SnapshotDelete {
        id: u64,
    },
    /// The host element of the record's epoch began serving the volume here, after every
    /// record it started from. It changes no block. Because a start's history is chosen by
    /// the epoch of its last record first, this record makes the history that follows the
    /// newest host element's: a longer tail of an older epoch that its start did without
    /// (writes acknowledged under a weaker ack policy by an element then absent) is seen as
    /// diverged at a later start, never rolled forward.
    Begin,
}

impl Op {
    /// A write of `data` at `offset_bytes`, its piece checksums computed here.
    pub fn write(offset_bytes: u64, data: Bytes) -> Op {
        let crcs = crate::pieces::piece_crcs(offset_bytes, &data);
        Op::Write { offset_bytes, data, crcs }
    }

    /// Check a write's data against its piece checksums (other operations carry no data).
    pub fn check_data(&self) -> Result<(), crate::pieces::PieceMismatch> {
        match self {
            Op::Write { offset_bytes, data, crcs } => crate::pieces::check_pieces(*offset_bytes, data, crcs),
            _ => Ok(()),
        }
    }

    pub fn offset_bytes(&self) -> u64 {
        match self {
            Op::Write { offset_bytes, .. } | Op::Trim { offset_bytes, .. } | Op::WriteZeroes { offset_bytes, .. } => {
                *offset_bytes
            }
            Op::Snapshot { .. } | Op::SnapshotDelete { .. } | Op::Begin => 0,
        }
    }

    pub fn length_bytes(&self) -> u64 {
        match self {
            Op::Write { data, .. } => data.len() as u64,
            Op::Trim { length_bytes, .. } | Op::WriteZeroes { length_bytes, .. } => *length_bytes,
            Op::Snapshot { .. } | Op::SnapshotDelete { .. } | Op::Begin => 0,
        }
    }

    /// Bytes of data the operation carries (zero for trims and write-zeroes).
    pub fn payload_bytes(&self) -> u64 {
        match self {
            Op::Write { data, .. } => data.len() as u64,
            _ => 0,
        }
    }
}

/// A snapshot a read names: its id, and the volume's sequence it was taken at (the element
/// answers once it has applied that far; the reply's sequence is that one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotRef {
    pub id: u64,
    pub taken_at: Sequence,
}

/// One sequenced operation of one volume, as sent to elements and kept in logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub volume: VolumeId,
    pub epoch: Epoch,
    pub sequence: Sequence,
    pub op: Op,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeSpec {
    pub name: String,
    pub size_bytes: u64,
    /// A clone (`starfish volume clone`): the snapshot whose content it starts with. An element
    /// that creates it and holds the snapshot shares the snapshot's blocks; one that does not
    /// hold it (yet) creates it empty, to be filled by a full recovery. Ignored for a volume
    /// the element holds already.
    pub clone_of: Option<CloneBase>,
    /// The element may hold it larger: a consistency group's storage volume, which grows as
    /// volumes join the group while running (the host element names its configured size until
    /// it has read its catalog). A larger one is kept, not refused; a smaller one grows.
    pub at_least: bool,
}

/// The snapshot a clone starts from: snapshot `snapshot` (its id) of storage volume `volume`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloneBase {
    pub volume: String,
    pub snapshot: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeState {
    /// Highest sequence the element has durably applied for this volume.
    pub applied_sequence: Sequence,
    /// Epoch of the record at `applied_sequence` (0 if none): two elements at the same sequence
    /// with different epochs hold different histories.
    pub applied_epoch: Epoch,
    /// A full recovery (block copy) of this volume was interrupted here: its blocks are not
    /// one consistent image and the two fields above mean nothing; the copy must resume.
    pub copying: bool,
    /// A block of this volume failed its checksum: the two fields above hold (its log is
    /// intact), but it takes no records until a full recovery that verifies every block has
    /// repaired it.
    pub repair: bool,
    /// Its size here. A host element adopts a larger one for a consistency group's storage
    /// volume (named `at_least`: it grew as volumes joined the group, and the host element
    /// names its configured size until it has read its catalog), and grows the elements that
    /// hold less before they catch up.
    pub size_bytes: u64,
}

/// What an element holds of one block, as the block map says: sent by a full recovery's
/// target so that its source sends only the blocks that differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSummary {
    /// Sequence of the record that last changed the block (0: never).
    pub sequence: Sequence,
    /// crc32c of the block's 4096 bytes (of zeroes for a hole).
    pub crc: u32,
    pub allocated: bool,
}

/// One block sent by a full recovery's source: its content (`None`: a hole) and the sequence
/// of the record that last changed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub block: u64,
    pub sequence: Sequence,
    /// Exactly `BLOCK_BYTES` bytes, or `None` for a hole.
    pub content: Option<Bytes>,
}

/// The answer to one `FetchBlocks`: the blocks that differ, read at one moment of the source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockChunk {
    /// The source's applied sequence (and its record's epoch) when it read the chunk (of a
    /// snapshot's blocks: the sequence it was taken at, epoch 0).
    pub applied: Sequence,
    pub applied_epoch: Epoch,
    pub blocks: Vec<BlockCopy>,
    /// Of a volume's blocks: the volume's snapshots the source holds (a full recovery copies
    /// those taken at or before its base).
    pub snapshots: Vec<SnapshotSummary>,
}

/// A snapshot a full recovery's source holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotSummary {
    pub id: u64,
    /// The volume's sequence of its record.
    pub taken_at: Sequence,
    pub size_bytes: u64,
}

/// Snapshots one `Blocks` reply lists at most.
pub const SNAPSHOTS_PER_CHUNK_MAX: usize = 4096;

/// A read's data with the crc32c of each of its pieces ([`crate::pieces`]): for a whole block,
/// the checksum the element stored with it, which the host element checks before the host
/// sees the data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadData {
    pub data: Bytes,
    pub crcs: Vec<u32>,
}

impl ReadData {
    /// Data whose piece checksums are computed here (for data no stored checksum covers).
    pub fn computed(offset_bytes: u64, data: Bytes) -> ReadData {
        let crcs = crate::pieces::piece_crcs(offset_bytes, &data);
        ReadData { data, crcs }
    }
}

/// A run of blocks with the same allocation state, for NBD block status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockExtent {
    pub length_bytes: u64,
    /// False: a hole that reads as zeroes (never written, trimmed or zeroed).
    pub allocated: bool,
}

/// Host element → element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostMessage {
    /// First message of a session: the host element's epoch, its identity, and the volumes it
    /// exports. Element to element (replay, copy), the epoch and identity of the host element
    /// that ordered the recovery.
    Hello {
        epoch: Epoch,
        host: HostId,
        volumes: Vec<VolumeSpec>,
        /// The host element's admin address (empty if unknown): an element tells it to a
        /// standby that observes it (`Observe`), so the standby can ask it to hand over.
        admin: String,
        /// Acknowledge each record as it arrives, before it is durable (`Received`): the host
        /// element counts this element's writes under the `received` ack policy.
        receipt_acks: bool,
    },
    /// Apply one record; the element answers `Applied` once it is durable and applied.
    Apply(Record),
    /// Read the volume, or one of its snapshots.
    Read {
        request_id: u64,
        volume: VolumeId,
        offset_bytes: u64,
        length_bytes: u32,
        snapshot: Option<SnapshotRef>,
    },
    BlockStatus {
        request_id: u64,
        volume: VolumeId,
        offset_bytes: u64,
        length_bytes: u64,
        snapshot: Option<SnapshotRef>,
    },
    Ping {
        nonce: u64,
    },
    /// A standby host element's question, allowed without a hello: whom does the element
    /// follow, and since when has it not heard from it? Answered by `Observed`.
    Observe {
        nonce: u64,
    },
    /// A graceful handover: the host element has answered everything it took and serves
    /// nothing more; its read lease ends now.
    Release,
    /// Send the records after `after` from the replay log, up to about `max_bytes` of payload.
    FetchLog {
        request_id: u64,
        volume: VolumeId,
        after: Sequence,
        max_bytes: u64,
    },
    /// Replay recovery: pull the records `(after, through]` of `volume` directly from the
    /// element at `source` (its replay log), at most `rate_bytes_per_s` (0: unlimited), and
    /// commit them as if they came from the host element. Answered by `RecoveryDone`.
    Recover {
        volume: VolumeId,
        source: String,
        after: Sequence,
        through: Sequence,
        rate_bytes_per_s: u64,
    },
    /// Full recovery: copy the blocks of `volume` that differ from the element at `source`
    /// (resuming an interrupted copy where it stopped), at most `rate_bytes_per_s` (0:
    /// unlimited). `CopyProgress` reports meanwhile; answered by `CopyDone`.
    Copy {
        volume: VolumeId,
        source: String,
        rate_bytes_per_s: u64,
    },
    /// Element to element, during a full recovery: the blocks from `first_block` on whose
    /// summary differs from `have` (one entry per block), read once the applied sequence is at
    /// least `min_applied`. Answered by `Blocks`.
    FetchBlocks {
        request_id: u64,
        volume: VolumeId,
        first_block: u64,
        min_applied: Sequence,
        have: Vec<BlockSummary>,
        /// The blocks of this snapshot of the volume (its content as read through), not of
        /// the volume.
        snapshot: Option<u64>,
    },
    /// Scrub: read the `count` blocks of `volume` from `first_block` on (at most
    /// [`SCRUB_CHUNK_BLOCKS_MAX`]), check each against its stored checksum, and answer their
    /// summaries, once the applied sequence is at least `min_applied`. Answered by
    /// `ScrubReply`; a block that fails its checksum makes the volume a repair, as on a read.
    Scrub {
        request_id: u64,
        volume: VolumeId,
        first_block: u64,
        count: u32,
        min_applied: Sequence,
    },
    /// Volumes created while the session runs (`starfish volume create`): the element creates
    /// those it lacks (durably, empty), numbers them after the session's volumes in this order,
    /// and answers `VolumesAdded`; what the session sends meanwhile waits for that answer.
    AddVolumes {
        volumes: Vec<VolumeSpec>,
    },
    /// Whether these volumes, new to the element, would fit (memory for their maps, disk
    /// space): nothing is created. Answered by `VolumesChecked`.
    CheckVolumes {
        request_id: u64,
        volumes: Vec<VolumeSpec>,
    },
    /// Volumes deleted while the session runs (`starfish volume delete`): once every record of
    /// them sent before is committed, the element removes their storage (durably, freeing its
    /// space) and answers `VolumesRemoved`. Their numbers stay taken in the session, by
    /// placeholders (as a hello's volume of size 0).
    RemoveVolumes {
        volumes: Vec<VolumeId>,
    },
    /// Volumes grown while the session runs (`starfish volume resize`): pairs of (volume, new
    /// size in bytes). The element grows its storage (durably; the new blocks read as zeroes)
    /// after every record sent before, and before any sent after (which may reach into the
    /// new blocks), then answers `VolumesResized`. An element that cannot grow a volume
    /// refuses the session.
    ResizeVolumes {
        volumes: Vec<(VolumeId, u64)>,
    },
}

/// Element → host element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ElementMessage {
    /// Answer to `Hello`: the highest epoch the element had seen before, its identity (random,
    /// kept on disk: the same element behind two addresses is recognised), and per volume (in
    /// `Hello` order) what it holds.
    Welcome {
        epoch: Epoch,
        element_id: u64,
        volumes: Vec<VolumeState>,
    },
    /// The element will not serve this session (stale epoch, volume size mismatch, ...).
    /// `epoch` is set when the hello's epoch was the reason: the epoch the element follows,
    /// which a starting host element must exceed. `owner_absent_ms`: how long no session of
    /// that epoch has been open at the element (0: one is open).
    Refused {
        reason: String,
        epoch: Option<Epoch>,
        owner_absent_ms: u64,
    },
    /// Every record of `volume` up to and including `sequence` is durable and applied.
    Applied {
        volume: VolumeId,
        sequence: Sequence,
    },
    /// Answer to `AddVolumes`: what the element holds of each added volume, in that order
    /// (numbered after the session's earlier volumes).
    VolumesAdded {
        volumes: Vec<VolumeState>,
    },
    /// Answer to `CheckVolumes`: they would fit, or why not.
    VolumesChecked {
        request_id: u64,
        result: Result<(), String>,
    },
    /// Answer to `RemoveVolumes`: the element holds none of these volumes any more.
    VolumesRemoved {
        volumes: Vec<VolumeId>,
    },
    /// Answer to `ResizeVolumes`: the element holds these volumes at their new sizes.
    VolumesResized {
        volumes: Vec<VolumeId>,
    },
    /// The record of `volume` at `sequence` arrived and waits in the element's memory to be
    /// committed (sessions whose hello asked for `receipt_acks` only).
    Received {
        volume: VolumeId,
        sequence: Sequence,
    },
    ReadReply {
        request_id: u64,
        applied_sequence: Sequence,
        result: Result<ReadData, String>,
    },
    BlockStatusReply {
        request_id: u64,
        applied_sequence: Sequence,
        result: Result<Vec<BlockExtent>, String>,
    },
    /// Answer to `Ping`, with the epoch the element follows now: a host element learns within
    /// a heartbeat that a newer one took the element over.
    Pong {
        nonce: u64,
        epoch: Epoch,
        /// How long no session of `epoch` has been open at the element (0: one is open).
        owner_absent_ms: u64,
        /// The read lease: the element promises not to welcome another host element's epoch
        /// for this long after it sent this pong (0: no promise, another one is waiting).
        lease_ms: u32,
    },
    /// Answer to `Observe`: the epoch the element follows, its holder and the holder's admin
    /// address (empty if unknown), and how long the holder has not been heard from (0: it is).
    Observed {
        nonce: u64,
        epoch: Epoch,
        holder: HostId,
        holder_admin: String,
        owner_absent_ms: u64,
    },
    LogRecords {
        request_id: u64,
        result: Result<Vec<Record>, String>,
    },
    /// A `Recover` ended: the sequence reached, or why it could not go on.
    RecoveryDone {
        volume: VolumeId,
        result: Result<Sequence, String>,
    },
    /// Answer to `FetchBlocks`.
    Blocks {
        request_id: u64,
        result: Result<BlockChunk, String>,
    },
    /// A full recovery's progress: `done_bytes` of the volume's `total_bytes` compared,
    /// `copied_bytes` of block content received in this run.
    CopyProgress {
        volume: VolumeId,
        done_bytes: u64,
        total_bytes: u64,
        copied_bytes: u64,
    },
    /// A `Copy` ended: on success the sequence the blocks are now at least as new as (the
    /// element has adopted it as its applied sequence: replay from there makes it exact).
    CopyDone {
        volume: VolumeId,
        result: Result<Sequence, String>,
    },
    /// Answer to `Scrub`: the applied sequence when the blocks were read, and one summary per
    /// block asked (a block past the volume's end is not sent).
    ScrubReply {
        request_id: u64,
        result: Result<(Sequence, Vec<BlockSummary>), String>,
    },
    /// The element hit a fault it cannot continue from in this session (I/O error, a gap in
    /// the sequence, a checksum mismatch on its own disk). The host element marks it failed.
    Fault {
        reason: String,
    },
}

/// Most blocks one `Scrub` asks about (4 MiB of data; 13 bytes of summary each in the reply).
pub const SCRUB_CHUNK_BLOCKS_MAX: u32 = 1024;

/// A message that can be put into and taken out of a frame body.
pub trait Body: Sized {
    fn encode_body(&self, out: &mut BytesMut);
    fn decode_body(body: Bytes) -> Result<Self, DecodeError>;
    /// The checksum [`decode_frame`] compares with the frame's: crc32c of the body, which a
    /// message type may compute without reading all of it (a large write's data:
    /// [`HostMessage`]'s).
    fn body_crc(body: &[u8]) -> u32 {
        crate::crc32c(body)
    }
}

/// Append one framed message to `out`.
pub fn encode_frame<M: Body>(message: &M, out: &mut BytesMut) {
    let start = out.len();
    out.put_u32_le(0);
    out.put_u32_le(0);
    message.encode_body(out);
    let body_len = out.len() - start - FRAME_HEADER_BYTES;
    assert!(body_len <= FRAME_BODY_BYTES_MAX as usize, "encoded an oversized frame");
    let crc = crate::crc32c(&out[start + FRAME_HEADER_BYTES..]);
    out[start..start + 4].copy_from_slice(&(body_len as u32).to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// A record's data from this size up is not copied into its frame ([`encode_host_frame`]).
pub const FRAME_DATA_SHARED_BYTES_MIN: usize = 16 * 1024;

/// One frame in up to three pieces, written in this order: what precedes a record's data, the
/// data itself (the write's payload, shared, not copied), and what follows it. Together they
/// are exactly the bytes [`encode_frame`] produces for the same message.
#[derive(Clone, Debug, Default)]
pub struct FrameParts {
    pub head: Bytes,
    pub data: Bytes,
    pub tail: Bytes,
}

impl FrameParts {
    /// A frame in one piece.
    pub fn whole(frame: Bytes) -> FrameParts {
        FrameParts { head: frame, data: Bytes::new(), tail: Bytes::new() }
    }

    pub fn len(&self) -> usize {
        self.head.len() + self.data.len() + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pieces that hold bytes, in order.
    pub fn pieces(&self) -> impl Iterator<Item = &Bytes> {
        [&self.head, &self.data, &self.tail].into_iter().filter(|piece| !piece.is_empty())
    }
}

/// Encode a host element's message as one frame. A record whose data has at least
/// [`FRAME_DATA_SHARED_BYTES_MIN`] bytes keeps its data where the write put it: only the bytes
/// around it are new, and the frame's checksum runs over the three pieces in turn. Anything
/// else is encoded by [`encode_frame`] into one buffer allocated at its final size.
pub fn encode_host_frame(message: &HostMessage) -> FrameParts {
    let HostMessage::Apply(Record { volume, epoch, sequence, op: Op::Write { offset_bytes, data, crcs } }) = message
    else {
        let mut buf = BytesMut::with_capacity(message.frame_bytes_hint());
        encode_frame(message, &mut buf);
        return FrameParts::whole(buf.freeze());
    };
    if data.len() < FRAME_DATA_SHARED_BYTES_MIN {
        let mut buf = BytesMut::with_capacity(message.frame_bytes_hint());
        encode_frame(message, &mut buf);
        return FrameParts::whole(buf.freeze());
    }
    // `HostMessage::encode_body` for `Apply` and `Record::encode` for a write, cut around the
    // data (the unit test compares the two byte for byte).
    let mut head = BytesMut::with_capacity(FRAME_HEADER_BYTES + 64);
    head.put_u32_le(0);
    head.put_u32_le(0);
    head.put_u8(HOST_APPLY);
    put_record_head(&mut head, *volume, *epoch, *sequence);
    put_write_head(&mut head, *offset_bytes, data.len());
    // The element's store checks the data against its piece checksums.
    debug_assert_eq!(head.len() - FRAME_HEADER_BYTES, APPLY_WRITE_DATA_AT, "the decoder finds the data there");
    frame_around_data(head, *offset_bytes, data, crcs)
}

/// A frame in three pieces: `head` (room for the frame header, then the body up to the data),
/// the data (shared, not copied), then the count and piece checksums of the data read at
/// `offset_bytes`. The frame's checksum runs over the data by those checksums
/// ([`body_crc_by_pieces`], as the decoder's does): no pass over the data here.
fn frame_around_data(mut head: BytesMut, offset_bytes: u64, data: &Bytes, crcs: &[u32]) -> FrameParts {
    let mut tail = BytesMut::with_capacity(4 + 4 * crcs.len());
    put_crcs(&mut tail, crcs);
    let body_len = head.len() - FRAME_HEADER_BYTES + data.len() + tail.len();
    assert!(body_len <= FRAME_BODY_BYTES_MAX as usize, "encoded an oversized frame");
    let crc = body_crc_by_pieces(&head[FRAME_HEADER_BYTES..], offset_bytes, data, crcs.iter().copied(), &tail);
    head[0..4].copy_from_slice(&(body_len as u32).to_le_bytes());
    head[4..8].copy_from_slice(&crc.to_le_bytes());
    FrameParts { head: head.freeze(), data: data.clone(), tail: tail.freeze() }
}

/// The checksum of a body made of `head`, `data` (read at `offset_bytes`) and `tail`, the data
/// taken by its piece checksums `crcs` instead of being read ([`crate::pieces`]).
fn body_crc_by_pieces(
    head: &[u8],
    offset_bytes: u64,
    data: &[u8],
    crcs: impl ExactSizeIterator<Item = u32>,
    tail: &[u8],
) -> u32 {
    let crc = crate::pieces::crc_append_pieces(crate::crc32c(head), offset_bytes, data, crcs);
    crc32c::crc32c_append(crc, tail)
}

/// The piece checksums stored little-endian in `bytes`.
fn crcs_in(bytes: &[u8]) -> impl ExactSizeIterator<Item = u32> + '_ {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
}

/// The volumes of a `Hello`, `AddVolumes` or `CheckVolumes`: their count, then each one's name,
/// size and kind (0 new, 2 at least this size, 1 a clone: then its base volume and snapshot).
fn put_volume_specs(out: &mut BytesMut, volumes: &[VolumeSpec]) {
    out.put_u32_le(volumes.len() as u32);
    for v in volumes {
        put_bytes(out, v.name.as_bytes());
        out.put_u64_le(v.size_bytes);
        match &v.clone_of {
            None => out.put_u8(if v.at_least { 2 } else { 0 }),
            Some(base) => {
                out.put_u8(1);
                put_bytes(out, base.volume.as_bytes());
                out.put_u64_le(base.snapshot);
            }
        }
    }
}

fn read_volume_specs(r: &mut Reader, what: &'static str) -> Result<Vec<VolumeSpec>, DecodeError> {
    let n = r.count(what, VOLUMES_MAX)?;
    let mut volumes = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.string("volume name", NAME_BYTES_MAX)?;
        let size_bytes = r.u64("volume size")?;
        let flag = r.u8("volume flag")?;
        let clone_of = match flag {
            0 | 2 => None,
            1 => Some(CloneBase {
                volume: r.string("clone base volume", NAME_BYTES_MAX)?,
                snapshot: r.u64("clone base")?,
            }),
            flag => return Err(DecodeError::OutOfBounds { what: "volume flag", value: flag as u64 }),
        };
        volumes.push(VolumeSpec { name, size_bytes, clone_of, at_least: flag == 2 });
    }
    Ok(volumes)
}

fn put_volume_ids(out: &mut BytesMut, volumes: &[VolumeId]) {
    out.put_u32_le(volumes.len() as u32);
    for v in volumes {
        out.put_u32_le(v.0);
    }
}

/// At least one, at most [`VOLUMES_MAX`].
fn read_volume_ids(r: &mut Reader, what: &'static str) -> Result<Vec<VolumeId>, DecodeError> {
    let n = r.count(what, VOLUMES_MAX)?;
    if n == 0 {
        return Err(DecodeError::OutOfBounds { what, value: 0 });
    }
    (0..n).map(|_| Ok(VolumeId(r.u32("volume")?))).collect()
}

fn put_volume_states(out: &mut BytesMut, volumes: &[VolumeState]) {
    out.put_u32_le(volumes.len() as u32);
    for v in volumes {
        out.put_u64_le(v.applied_sequence.0);
        out.put_u64_le(v.applied_epoch.0);
        out.put_u8(v.copying as u8 | (v.repair as u8) << 1);
        out.put_u64_le(v.size_bytes);
    }
}

fn read_volume_states(r: &mut Reader, what: &'static str) -> Result<Vec<VolumeState>, DecodeError> {
    let n = r.count(what, VOLUMES_MAX)?;
    let mut volumes = Vec::with_capacity(n);
    for _ in 0..n {
        let applied_sequence = Sequence(r.u64("applied")?);
        let applied_epoch = Epoch(r.u64("applied epoch")?);
        let flags = r.u8("volume state flags")?;
        if flags > 3 {
            return Err(DecodeError::OutOfBounds { what: "volume state flags", value: flags as u64 });
        }
        let (copying, repair) = (flags & 1 != 0, flags & 2 != 0);
        let size_bytes = r.u64("volume size")?;
        volumes.push(VolumeState { applied_sequence, applied_epoch, copying, repair, size_bytes });
    }
    Ok(volumes)
}

/// Room a frame that outgrew its receive buffer gets beyond its end, for the start of the next
/// one: the readers keep 64 KiB of room free, and must not grow the buffer near a large frame's
/// end (a growth there copied nearly all of the frame).
const ROOM_AFTER_FRAME_BYTES: usize = 64 * 1024;

/// Take one complete frame off the front of `buf`, if there is one. `Ok(None)` means "need
/// more bytes" (and `buf` then has room for the whole frame, grown without `realloc`); an error
/// means the stream is unusable and the connection must be closed.
pub fn decode_frame<M: Body>(buf: &mut BytesMut) -> Result<Option<M>, DecodeError> {
    if buf.len() < FRAME_HEADER_BYTES {
        return Ok(None);
    }
    let body_len = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes"));
    let expected = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
    if body_len > FRAME_BODY_BYTES_MAX {
        return Err(DecodeError::FrameTooLarge(body_len));
    }
    let frame_len = FRAME_HEADER_BYTES + body_len as usize;
    if buf.len() < frame_len {
        // A frame larger than the room left gets new room for all of it and then some; one
        // that fits (most small frames) is read into the room there is.
        if buf.capacity() < frame_len {
            crate::room_for(buf, frame_len + ROOM_AFTER_FRAME_BYTES);
        }
        return Ok(None);
    }
    buf.advance(FRAME_HEADER_BYTES);
    let body = buf.split_to(body_len as usize).freeze();
    let actual = M::body_crc(&body);
    if actual != expected {
        return Err(DecodeError::Checksum { expected, actual });
    }
    M::decode_body(body).map(Some)
}

struct Reader {
    body: Bytes,
}

impl Reader {
    fn need(&self, what: &'static str, n: usize) -> Result<(), DecodeError> {
        if self.body.remaining() < n {
            return Err(DecodeError::Truncated { what, needed: n - self.body.remaining() });
        }
        Ok(())
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.need(what, 1)?;
        Ok(self.body.get_u8())
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.need(what, 2)?;
        Ok(self.body.get_u16_le())
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.need(what, 4)?;
        Ok(self.body.get_u32_le())
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.need(what, 8)?;
        Ok(self.body.get_u64_le())
    }
    fn bytes(&mut self, what: &'static str, max: usize) -> Result<Bytes, DecodeError> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(DecodeError::OutOfBounds { what, value: len as u64 });
        }
        self.need(what, len)?;
        Ok(self.body.split_to(len))
    }
    fn string(&mut self, what: &'static str, max: usize) -> Result<String, DecodeError> {
        let raw = self.bytes(what, max)?;
        String::from_utf8(raw.to_vec()).map_err(|_| DecodeError::Utf8(what))
    }
    /// The piece checksums of `length_bytes` at `offset_bytes`: exactly one per piece.
    fn crcs(&mut self, what: &'static str, offset_bytes: u64, length_bytes: usize) -> Result<Vec<u32>, DecodeError> {
        let n = self.count(what, PIECES_MAX)?;
        if offset_bytes.checked_add(length_bytes as u64).is_none()
            || n != crate::pieces::piece_count(offset_bytes, length_bytes as u64)
        {
            return Err(DecodeError::OutOfBounds { what, value: n as u64 });
        }
        let mut crcs = Vec::with_capacity(n);
        for _ in 0..n {
            crcs.push(self.u32(what)?);
        }
        Ok(crcs)
    }
    fn summaries(&mut self, what: &'static str, max: usize) -> Result<Vec<BlockSummary>, DecodeError> {
        let n = self.count(what, max)?;
        let mut summaries = Vec::with_capacity(n);
        for _ in 0..n {
            let sequence = Sequence(self.u64("block summary sequence")?);
            let crc = self.u32("block summary crc")?;
            let allocated = self.u8("block summary allocated")? != 0;
            summaries.push(BlockSummary { sequence, crc, allocated });
        }
        Ok(summaries)
    }
    fn count(&mut self, what: &'static str, max: usize) -> Result<usize, DecodeError> {
        let n = self.u32(what)? as usize;
        if n > max {
            return Err(DecodeError::OutOfBounds { what, value: n as u64 });
        }
        Ok(n)
    }
    /// `u8 ok`, then a sequence or a reason (`RecoveryDone`, `CopyDone`).
    fn sequence_result(&mut self, what: &'static str) -> Result<Result<Sequence, String>, DecodeError> {
        Ok(match self.u8(what)? {
            RESULT_OK => Ok(Sequence(self.u64(what)?)),
            RESULT_ERR => Err(self.string(what, REASON_BYTES_MAX)?),
            tag => return Err(DecodeError::UnknownTag(tag)),
        })
    }
    fn finish(self) -> Result<(), DecodeError> {
        match self.body.remaining() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }
}

/// Most pieces one payload can have: one per block, plus one for a start inside a block.
const PIECES_MAX: usize = (PAYLOAD_BYTES_MAX as u64 / BLOCK_BYTES) as usize + 1;

fn put_summaries(out: &mut BytesMut, summaries: &[BlockSummary]) {
    out.put_u32_le(u32::try_from(summaries.len()).expect("bounded by the chunk limits"));
    for h in summaries {
        out.put_u64_le(h.sequence.0);
        out.put_u32_le(h.crc);
        out.put_u8(h.allocated as u8);
    }
}

fn put_crcs(out: &mut BytesMut, crcs: &[u32]) {
    out.put_u32_le(u32::try_from(crcs.len()).expect("bounded by the payload"));
    for crc in crcs {
        out.put_u32_le(*crc);
    }
}

fn put_bytes(out: &mut BytesMut, b: &[u8]) {
    out.put_u32_le(u32::try_from(b.len()).expect("field length bounded by the frame limit"));
    out.put_slice(b);
}

/// A record's fields before its operation.
fn put_record_head(out: &mut BytesMut, volume: VolumeId, epoch: Epoch, sequence: Sequence) {
    out.put_u32_le(volume.0);
    out.put_u64_le(epoch.0);
    out.put_u64_le(sequence.0);
}

/// Where an `Apply` body's write data starts: its tag, `put_record_head`, `put_write_head`.
const APPLY_WRITE_DATA_AT: usize = 1 + (4 + 8 + 8) + (1 + 8 + 4);

/// The body of an `Apply` of a write of [`FRAME_DATA_SHARED_BYTES_MIN`] bytes or more, as far
/// as its unchecked fields say: its offset, where its data ends and its piece checksums'
/// bytes. `None` for any other body, or one whose lengths do not fit in it.
fn large_write_layout(body: &[u8]) -> Option<(u64, usize, &[u8])> {
    const OP_AT: usize = 1 + (4 + 8 + 8);
    if body.first() != Some(&HOST_APPLY) || body.get(OP_AT) != Some(&OP_WRITE) {
        return None;
    }
    let u32_at = |at: usize| Some(u32::from_le_bytes(body.get(at..at + 4)?.try_into().expect("4 bytes")));
    let offset_bytes = u64::from_le_bytes(body.get(OP_AT + 1..OP_AT + 9)?.try_into().expect("8 bytes"));
    let data_bytes = u32_at(OP_AT + 9)? as usize;
    let data_end = APPLY_WRITE_DATA_AT + data_bytes;
    let crcs_at = data_end + 4;
    let crcs = body.get(crcs_at..crcs_at.checked_add(4 * u32_at(data_end)? as usize)?)?;
    (data_bytes >= FRAME_DATA_SHARED_BYTES_MIN).then_some((offset_bytes, data_end, crcs))
}

/// Where a successful `ReadReply` body's data starts: its tag, request id, applied sequence,
/// result and the data's length.
const READ_REPLY_DATA_AT: usize = 1 + 8 + 8 + 1 + 4;

/// The body of a successful `ReadReply` of whole blocks, as far as its unchecked fields say:
/// where its data ends and its checksums' bytes. Whole blocks means [`FRAME_DATA_SHARED_BYTES_MIN`]
/// bytes or more, a multiple of the block size, and one checksum per block. A reply does not
/// carry its read's offset, but such a reply's pieces do not depend on it: a read of whole
/// blocks that does not start on a block boundary has one piece more than it has blocks.
/// `None` for any other body, or one whose lengths do not fit in it.
fn block_read_reply_layout(body: &[u8]) -> Option<(usize, &[u8])> {
    if body.first() != Some(&ELEMENT_READ_REPLY) || body.get(READ_REPLY_DATA_AT - 5) != Some(&RESULT_OK) {
        return None;
    }
    let u32_at = |at: usize| Some(u32::from_le_bytes(body.get(at..at.checked_add(4)?)?.try_into().expect("4 bytes")));
    let data_bytes = u32_at(READ_REPLY_DATA_AT - 4)? as usize;
    let data_end = READ_REPLY_DATA_AT.checked_add(data_bytes)?;
    let count = u32_at(data_end)? as usize;
    let crcs = body.get(data_end + 4..(data_end + 4).checked_add(count.checked_mul(4)?)?)?;
    whole_blocks(data_bytes, count).then_some((data_end, crcs))
}

/// Whether a read reply of `data_bytes` with `checksums` piece checksums is one of whole
/// blocks whose frame is checked by them ([`block_read_reply_layout`]).
fn whole_blocks(data_bytes: usize, checksums: usize) -> bool {
    data_bytes >= FRAME_DATA_SHARED_BYTES_MIN
        && data_bytes % BLOCK_BYTES as usize == 0
        && checksums == data_bytes / BLOCK_BYTES as usize
}

/// The frame of a successful read reply of whole blocks ([`block_read_reply_layout`]), its
/// data not copied, and its checksum computed from the blocks' checksums without reading the
/// data (the element's store just checked the data against them). The same bytes as
/// [`encode_frame`] gives. `None` for any other message: encode it with `encode_frame`.
pub fn encode_block_read_reply(message: &ElementMessage) -> Option<FrameParts> {
    let ElementMessage::ReadReply { request_id, applied_sequence, result: Ok(ReadData { data, crcs }) } = message
    else {
        return None;
    };
    if !whole_blocks(data.len(), crcs.len()) {
        return None;
    }
    let mut head = BytesMut::with_capacity(FRAME_HEADER_BYTES + READ_REPLY_DATA_AT);
    head.put_u32_le(0);
    head.put_u32_le(0);
    head.put_u8(ELEMENT_READ_REPLY);
    head.put_u64_le(*request_id);
    head.put_u64_le(applied_sequence.0);
    head.put_u8(RESULT_OK);
    head.put_u32_le(u32::try_from(data.len()).expect("bounded by the payload"));
    debug_assert_eq!(head.len() - FRAME_HEADER_BYTES, READ_REPLY_DATA_AT, "the decoder finds the data there");
    Some(frame_around_data(head, 0, data, crcs))
}

/// A write's fields before its data: the data itself, then its piece checksums, follow.
fn put_write_head(out: &mut BytesMut, offset_bytes: u64, data_bytes: usize) {
    out.put_u8(OP_WRITE);
    out.put_u64_le(offset_bytes);
    out.put_u32_le(u32::try_from(data_bytes).expect("field length bounded by the frame limit"));
}

const OP_WRITE: u8 = 1;
const OP_TRIM: u8 = 2;
const OP_WRITE_ZEROES: u8 = 3;
const OP_SNAPSHOT: u8 = 4;
const OP_SNAPSHOT_DELETE: u8 = 5;
const OP_BEGIN: u8 = 6;

/// `u8 0`, or `u8 1, u64 id, u64 taken_at`.
fn put_snapshot_ref(out: &mut BytesMut, snapshot: &Option<SnapshotRef>) {
    match snapshot {
        None => out.put_u8(0),
        Some(SnapshotRef { id, taken_at }) => {
            out.put_u8(1);
            out.put_u64_le(*id);
            out.put_u64_le(taken_at.0);
        }
    }
}

fn read_snapshot_ref(r: &mut Reader) -> Result<Option<SnapshotRef>, DecodeError> {
    Ok(match r.u8("snapshot flag")? {
        0 => None,
        1 => Some(SnapshotRef { id: r.u64("snapshot id")?, taken_at: Sequence(r.u64("snapshot sequence")?) }),
        flag => return Err(DecodeError::OutOfBounds { what: "snapshot flag", value: flag as u64 }),
    })
}

impl Record {
    /// Encode without framing (the wire format only: the element's log has its own record).
    pub fn encode(&self, out: &mut BytesMut) {
        put_record_head(out, self.volume, self.epoch, self.sequence);
        match &self.op {
            Op::Write { offset_bytes, data, crcs } => {
                put_write_head(out, *offset_bytes, data.len());
                out.put_slice(data);
                put_crcs(out, crcs);
            }
            Op::Trim { offset_bytes, length_bytes } => {
                out.put_u8(OP_TRIM);
                out.put_u64_le(*offset_bytes);
                out.put_u64_le(*length_bytes);
            }
            Op::WriteZeroes { offset_bytes, length_bytes } => {
                out.put_u8(OP_WRITE_ZEROES);
                out.put_u64_le(*offset_bytes);
                out.put_u64_le(*length_bytes);
            }
            Op::Snapshot { id } => {
                out.put_u8(OP_SNAPSHOT);
                out.put_u64_le(*id);
            }
            Op::SnapshotDelete { id } => {
                out.put_u8(OP_SNAPSHOT_DELETE);
                out.put_u64_le(*id);
            }
            Op::Begin => out.put_u8(OP_BEGIN),
        }
    }

    /// Decode a record encoded by [`Record::encode`], requiring that nothing is left over.
    pub fn decode(body: Bytes) -> Result<Record, DecodeError> {
        let mut r = Reader { body };
        let record = Self::read(&mut r)?;
        r.finish()?;
        Ok(record)
    }

    fn read(r: &mut Reader) -> Result<Record, DecodeError> {
        let volume = VolumeId(r.u32("record volume")?);
        let epoch = Epoch(r.u64("record epoch")?);
        let sequence = Sequence(r.u64("record sequence")?);
        let op = match r.u8("op kind")? {
            OP_WRITE => {
                let offset_bytes = r.u64("write offset")?;
                let data = r.bytes("write data", PAYLOAD_BYTES_MAX as usize)?;
                let crcs = r.crcs("write checksums", offset_bytes, data.len())?;
                Op::Write { offset_bytes, data, crcs }
            }
            OP_TRIM => Op::Trim { offset_bytes: r.u64("trim offset")?, length_bytes: r.u64("trim length")? },
            OP_WRITE_ZEROES => {
                Op::WriteZeroes { offset_bytes: r.u64("zeroes offset")?, length_bytes: r.u64("zeroes length")? }
            }
            OP_SNAPSHOT => Op::Snapshot { id: r.u64("snapshot id")? },
            OP_SNAPSHOT_DELETE => Op::SnapshotDelete { id: r.u64("snapshot id")? },
            OP_BEGIN => Op::Begin,
            tag => return Err(DecodeError::UnknownTag(tag)),
        };
        if op.offset_bytes().checked_add(op.length_bytes()).is_none() {
            return Err(DecodeError::OutOfBounds { what: "op end", value: op.offset_bytes() });
        }
        Ok(Record { volume, epoch, sequence, op })
    }
}

const HOST_HELLO: u8 = 1;
const HOST_APPLY: u8 = 2;
const HOST_READ: u8 = 3;
const HOST_BLOCK_STATUS: u8 = 4;
const HOST_PING: u8 = 5;
const HOST_FETCH_LOG: u8 = 6;
const HOST_RECOVER: u8 = 7;
const HOST_COPY: u8 = 8;
const HOST_FETCH_BLOCKS: u8 = 9;
const HOST_OBSERVE: u8 = 10;
const HOST_RELEASE: u8 = 11;
const HOST_SCRUB: u8 = 12;
const HOST_ADD_VOLUMES: u8 = 13;
const HOST_CHECK_VOLUMES: u8 = 14;
const HOST_REMOVE_VOLUMES: u8 = 15;
const HOST_RESIZE_VOLUMES: u8 = 16;

impl HostMessage {
    /// Bytes its frame takes, at least, for a record that carries data (0 for the rest): the
    /// encoder's buffer is allocated once at that size, not grown (and copied) as the data
    /// and then its piece checksums are appended.
    pub fn frame_bytes_hint(&self) -> usize {
        const RECORD_FIELDS_BYTES_MAX: usize = 64;
        match self {
            HostMessage::Apply(Record { op: Op::Write { data, crcs, .. }, .. }) => {
                FRAME_HEADER_BYTES + RECORD_FIELDS_BYTES_MAX + data.len() + 4 * crcs.len()
            }
            _ => 0,
        }
    }
}

impl Body for HostMessage {
    /// A write of [`FRAME_DATA_SHARED_BYTES_MIN`] bytes or more is checked by its piece
    /// checksums, not read: the frame's checksum vouches for everything but the data, and the
    /// element's store checks the data against its pieces before it keeps it (a damaged one is
    /// refused with a fault, never stored). One pass over every byte of a large write fewer on
    /// each side (docs/benchmarks.md). Anything else, or a body whose fields do not describe a
    /// write, is read whole.
    fn body_crc(body: &[u8]) -> u32 {
        let Some((offset_bytes, data_end, crcs)) = large_write_layout(body) else { return crate::crc32c(body) };
        let (head, data, tail) =
            (&body[..APPLY_WRITE_DATA_AT], &body[APPLY_WRITE_DATA_AT..data_end], &body[data_end..]);
        body_crc_by_pieces(head, offset_bytes, data, crcs_in(crcs), tail)
    }

    fn encode_body(&self, out: &mut BytesMut) {
        match self {
            HostMessage::Hello { epoch, host, volumes, admin, receipt_acks } => {
                out.put_u8(HOST_HELLO);
                out.put_u16_le(WIRE_VERSION);
                out.put_u64_le(epoch.0);
                out.put_u64_le(host.0);
                put_volume_specs(out, volumes);
                put_bytes(out, truncate_to(admin, ADDRESS_BYTES_MAX).as_bytes());
                out.put_u8(*receipt_acks as u8);
            }
            HostMessage::AddVolumes { volumes } => {
                out.put_u8(HOST_ADD_VOLUMES);
                put_volume_specs(out, volumes);
            }
            HostMessage::CheckVolumes { request_id, volumes } => {
                out.put_u8(HOST_CHECK_VOLUMES);
                out.put_u64_le(*request_id);
                put_volume_specs(out, volumes);
            }
            HostMessage::RemoveVolumes { volumes } => {
                out.put_u8(HOST_REMOVE_VOLUMES);
                put_volume_ids(out, volumes);
            }
            HostMessage::ResizeVolumes { volumes } => {
                out.put_u8(HOST_RESIZE_VOLUMES);
                out.put_u32_le(volumes.len() as u32);
                for (volume, size_bytes) in volumes {
                    out.put_u32_le(volume.0);
                    out.put_u64_le(*size_bytes);
                }
            }
            HostMessage::Apply(record) => {
                out.put_u8(HOST_APPLY);
                record.encode(out);
            }
            HostMessage::Read { request_id, volume, offset_bytes, length_bytes, snapshot } => {
                out.put_u8(HOST_READ);
                out.put_u64_le(*request_id);
                out.put_u32_le(volume.0);
                out.put_u64_le(*offset_bytes);
                out.put_u32_le(*length_bytes);
                put_snapshot_ref(out, snapshot);
            }
            HostMessage::BlockStatus { request_id, volume, offset_bytes, length_bytes, snapshot } => {
                out.put_u8(HOST_BLOCK_STATUS);
                out.put_u64_le(*request_id);
                out.put_u32_le(volume.0);
                out.put_u64_le(*offset_bytes);
                out.put_u64_le(*length_bytes);
                put_snapshot_ref(out, snapshot);
            }
            HostMessage::Ping { nonce } => {
                out.put_u8(HOST_PING);
                out.put_u64_le(*nonce);
            }
            HostMessage::Observe { nonce } => {
                out.put_u8(HOST_OBSERVE);
                out.put_u16_le(WIRE_VERSION);
                out.put_u64_le(*nonce);
            }
            HostMessage::Release => out.put_u8(HOST_RELEASE),
            HostMessage::FetchLog { request_id, volume, after, max_bytes } => {
                out.put_u8(HOST_FETCH_LOG);
                out.put_u64_le(*request_id);
                out.put_u32_le(volume.0);
                out.put_u64_le(after.0);
                out.put_u64_le(*max_bytes);
            }
            HostMessage::Recover { volume, source, after, through, rate_bytes_per_s } => {
                out.put_u8(HOST_RECOVER);
                out.put_u32_le(volume.0);
                put_bytes(out, source.as_bytes());
                out.put_u64_le(after.0);
                out.put_u64_le(through.0);
                out.put_u64_le(*rate_bytes_per_s);
            }
            HostMessage::Copy { volume, source, rate_bytes_per_s } => {
                out.put_u8(HOST_COPY);
                out.put_u32_le(volume.0);
                put_bytes(out, source.as_bytes());
                out.put_u64_le(*rate_bytes_per_s);
            }
            HostMessage::FetchBlocks { request_id, volume, first_block, min_applied, have, snapshot } => {
                out.put_u8(HOST_FETCH_BLOCKS);
                out.put_u64_le(*request_id);
                out.put_u32_le(volume.0);
                out.put_u64_le(*first_block);
                out.put_u64_le(min_applied.0);
                assert!(have.len() <= COPY_CHUNK_BLOCKS_MAX, "a fetch asks about at most COPY_CHUNK_BLOCKS_MAX blocks");
                put_summaries(out, have);
                match snapshot {
                    None => out.put_u8(0),
                    Some(id) => {
                        out.put_u8(1);
                        out.put_u64_le(*id);
                    }
                }
            }
            HostMessage::Scrub { request_id, volume, first_block, count, min_applied } => {
                out.put_u8(HOST_SCRUB);
                out.put_u64_le(*request_id);
                out.put_u32_le(volume.0);
                out.put_u64_le(*first_block);
                out.put_u32_le(*count);
                out.put_u64_le(min_applied.0);
            }
        }
    }

    fn decode_body(body: Bytes) -> Result<Self, DecodeError> {
        let mut r = Reader { body };
        let message = match r.u8("host message tag")? {
            HOST_HELLO => {
                read_wire_version(&mut r, "hello")?;
                let epoch = Epoch(r.u64("hello epoch")?);
                let host = HostId(r.u64("hello host")?);
                let volumes = read_volume_specs(&mut r, "hello volume count")?;
                let admin = r.string("hello admin address", ADDRESS_BYTES_MAX)?;
                let receipt_acks = match r.u8("hello flags")? {
                    0 => false,
                    1 => true,
                    flags => return Err(DecodeError::OutOfBounds { what: "hello flags", value: flags as u64 }),
                };
                HostMessage::Hello { epoch, host, volumes, admin, receipt_acks }
            }
            HOST_APPLY => HostMessage::Apply(Record::read(&mut r)?),
            HOST_READ => {
                let request_id = r.u64("read request id")?;
                let volume = VolumeId(r.u32("read volume")?);
                let offset_bytes = r.u64("read offset")?;
                let length_bytes = r.u32("read length")?;
                if length_bytes > PAYLOAD_BYTES_MAX {
                    return Err(DecodeError::OutOfBounds { what: "read length", value: length_bytes as u64 });
                }
                let snapshot = read_snapshot_ref(&mut r)?;
                HostMessage::Read { request_id, volume, offset_bytes, length_bytes, snapshot }
            }
            HOST_BLOCK_STATUS => HostMessage::BlockStatus {
                request_id: r.u64("block status request id")?,
                volume: VolumeId(r.u32("block status volume")?),
                offset_bytes: r.u64("block status offset")?,
                length_bytes: r.u64("block status length")?,
                snapshot: read_snapshot_ref(&mut r)?,
            },
            HOST_PING => HostMessage::Ping { nonce: r.u64("ping nonce")? },
            HOST_OBSERVE => {
                read_wire_version(&mut r, "observe")?;
                HostMessage::Observe { nonce: r.u64("observe nonce")? }
            }
            HOST_RELEASE => HostMessage::Release,
            HOST_FETCH_LOG => HostMessage::FetchLog {
                request_id: r.u64("fetch log request id")?,
                volume: VolumeId(r.u32("fetch log volume")?),
                after: Sequence(r.u64("fetch log after")?),
                max_bytes: r.u64("fetch log max bytes")?,
            },
            HOST_RECOVER => HostMessage::Recover {
                volume: VolumeId(r.u32("recover volume")?),
                source: r.string("recover source", NAME_BYTES_MAX)?,
                after: Sequence(r.u64("recover after")?),
                through: Sequence(r.u64("recover through")?),
                rate_bytes_per_s: r.u64("recover rate")?,
            },
            HOST_COPY => HostMessage::Copy {
                volume: VolumeId(r.u32("copy volume")?),
                source: r.string("copy source", NAME_BYTES_MAX)?,
                rate_bytes_per_s: r.u64("copy rate")?,
            },
            HOST_FETCH_BLOCKS => {
                let request_id = r.u64("fetch blocks request id")?;
                let volume = VolumeId(r.u32("fetch blocks volume")?);
                let first_block = r.u64("fetch blocks first block")?;
                let min_applied = Sequence(r.u64("fetch blocks min applied")?);
                let have = r.summaries("fetch blocks count", COPY_CHUNK_BLOCKS_MAX)?;
                let snapshot = match r.u8("fetch blocks snapshot flag")? {
                    0 => None,
                    1 => Some(r.u64("fetch blocks snapshot id")?),
                    flag => return Err(DecodeError::OutOfBounds { what: "snapshot flag", value: flag as u64 }),
                };
                HostMessage::FetchBlocks { request_id, volume, first_block, min_applied, have, snapshot }
            }
            HOST_SCRUB => {
                let request_id = r.u64("scrub request id")?;
                let volume = VolumeId(r.u32("scrub volume")?);
                let first_block = r.u64("scrub first block")?;
                let count = r.u32("scrub block count")?;
                if count > SCRUB_CHUNK_BLOCKS_MAX {
                    return Err(DecodeError::OutOfBounds { what: "scrub block count", value: count as u64 });
                }
                let min_applied = Sequence(r.u64("scrub min applied")?);
                HostMessage::Scrub { request_id, volume, first_block, count, min_applied }
            }
            HOST_ADD_VOLUMES => {
                let volumes = read_volume_specs(&mut r, "added volume count")?;
                if volumes.is_empty() {
                    return Err(DecodeError::OutOfBounds { what: "added volume count", value: 0 });
                }
                HostMessage::AddVolumes { volumes }
            }
            HOST_CHECK_VOLUMES => {
                let request_id = r.u64("check request id")?;
                let volumes = read_volume_specs(&mut r, "checked volume count")?;
                HostMessage::CheckVolumes { request_id, volumes }
            }
            HOST_REMOVE_VOLUMES => {
                HostMessage::RemoveVolumes { volumes: read_volume_ids(&mut r, "removed volume count")? }
            }
            HOST_RESIZE_VOLUMES => {
                let n = r.count("resized volume count", VOLUMES_MAX)?;
                if n == 0 {
                    return Err(DecodeError::OutOfBounds { what: "resized volume count", value: 0 });
                }
                let mut volumes = Vec::with_capacity(n);
                for _ in 0..n {
                    let volume = VolumeId(r.u32("resized volume")?);
                    let size_bytes = r.u64("resized volume size")?;
                    if size_bytes == 0 || size_bytes % BLOCK_BYTES != 0 {
                        return Err(DecodeError::OutOfBounds { what: "resized volume size", value: size_bytes });
                    }
                    volumes.push((volume, size_bytes));
                }
                HostMessage::ResizeVolumes { volumes }
            }
            tag => return Err(DecodeError::UnknownTag(tag)),
        };
        r.finish()?;
        Ok(message)
    }
}

const ELEMENT_WELCOME: u8 = 1;
const ELEMENT_REFUSED: u8 = 2;
const ELEMENT_APPLIED: u8 = 3;
const ELEMENT_READ_REPLY: u8 = 4;
const ELEMENT_BLOCK_STATUS_REPLY: u8 = 5;
const ELEMENT_PONG: u8 = 6;
const ELEMENT_FAULT: u8 = 7;
const ELEMENT_LOG_RECORDS: u8 = 8;
const ELEMENT_RECOVERY_DONE: u8 = 9;
const ELEMENT_BLOCKS: u8 = 10;
const ELEMENT_COPY_PROGRESS: u8 = 11;
const ELEMENT_COPY_DONE: u8 = 12;
const ELEMENT_OBSERVED: u8 = 13;
const ELEMENT_SCRUB_REPLY: u8 = 14;
const ELEMENT_RECEIVED: u8 = 15;
const ELEMENT_VOLUMES_ADDED: u8 = 16;
const ELEMENT_VOLUMES_CHECKED: u8 = 17;
const ELEMENT_VOLUMES_REMOVED: u8 = 18;
const ELEMENT_VOLUMES_RESIZED: u8 = 19;
const LOG_RECORDS_MAX: usize = 1 << 20;

const RESULT_OK: u8 = 0;
const RESULT_ERR: u8 = 1;

impl Body for ElementMessage {
    /// A read reply of whole blocks ([`block_read_reply_layout`]) is checked by its blocks'
    /// checksums, not read: the frame's checksum vouches for everything but the data, and the
    /// host element checks the data against those checksums before it uses it (a damaged one
    /// fails the element's session and has the blocks scrubbed, as a damaged frame failed it).
    /// Anything else is read whole.
    fn body_crc(body: &[u8]) -> u32 {
        let Some((data_end, crcs)) = block_read_reply_layout(body) else { return crate::crc32c(body) };
        let (head, data, tail) = (&body[..READ_REPLY_DATA_AT], &body[READ_REPLY_DATA_AT..data_end], &body[data_end..]);
        body_crc_by_pieces(head, 0, data, crcs_in(crcs), tail)
    }

    fn encode_body(&self, out: &mut BytesMut) {
        match self {
            ElementMessage::Welcome { epoch, element_id, volumes } => {
                out.put_u8(ELEMENT_WELCOME);
                out.put_u16_le(WIRE_VERSION);
                out.put_u64_le(epoch.0);
                out.put_u64_le(*element_id);
                put_volume_states(out, volumes);
            }
            ElementMessage::VolumesAdded { volumes } => {
                out.put_u8(ELEMENT_VOLUMES_ADDED);
                put_volume_states(out, volumes);
            }
            ElementMessage::VolumesRemoved { volumes } => {
                out.put_u8(ELEMENT_VOLUMES_REMOVED);
                put_volume_ids(out, volumes);
            }
            ElementMessage::VolumesResized { volumes } => {
                out.put_u8(ELEMENT_VOLUMES_RESIZED);
                put_volume_ids(out, volumes);
            }
            ElementMessage::VolumesChecked { request_id, result } => {
                out.put_u8(ELEMENT_VOLUMES_CHECKED);
                out.put_u64_le(*request_id);
                match result {
                    Ok(()) => out.put_u8(RESULT_OK),
                    Err(reason) => {
                        out.put_u8(RESULT_ERR);
                        put_bytes(out, truncate(reason).as_bytes());
                    }
                }
            }
            ElementMessage::Refused { reason, epoch, owner_absent_ms } => {
                out.put_u8(ELEMENT_REFUSED);
                put_bytes(out, truncate(reason).as_bytes());
                out.put_u64_le(*owner_absent_ms);
                match epoch {
                    None => out.put_u8(0),
                    Some(epoch) => {
                        out.put_u8(1);
                        out.put_u64_le(epoch.0);
                    }
                }
            }
            ElementMessage::Applied { volume, sequence } => {
                out.put_u8(ELEMENT_APPLIED);
                out.put_u32_le(volume.0);
                out.put_u64_le(sequence.0);
            }
            ElementMessage::Received { volume, sequence } => {
                out.put_u8(ELEMENT_RECEIVED);
                out.put_u32_le(volume.0);
                out.put_u64_le(sequence.0);
            }
            ElementMessage::ReadReply { request_id, applied_sequence, result } => {
                out.put_u8(ELEMENT_READ_REPLY);
                out.put_u64_le(*request_id);
                out.put_u64_le(applied_sequence.0);
                match result {
                    Ok(read) => {
                        out.put_u8(RESULT_OK);
                        put_bytes(out, &read.data);
                        put_crcs(out, &read.crcs);
                    }
                    Err(reason) => {
                        out.put_u8(RESULT_ERR);
                        put_bytes(out, truncate(reason).as_bytes());
                    }
                }
            }
            ElementMessage::BlockStatusReply { request_id, applied_sequence, result } => {
                out.put_u8(ELEMENT_BLOCK_STATUS_REPLY);
                out.put_u64_le(*request_id);
                out.put_u64_le(applied_sequence.0);
                match result {
                    Ok(extents) => {
                        out.put_u8(RESULT_OK);
                        out.put_u32_le(extents.len() as u32);
                        for e in extents {
                            out.put_u64_le(e.length_bytes);
                            out.put_u8(e.allocated as u8);
                        }
                    }
                    Err(reason) => {
                        out.put_u8(RESULT_ERR);
                        put_bytes(out, truncate(reason).as_bytes());
                    }
                }
            }
            ElementMessage::Pong { nonce, epoch, owner_absent_ms, lease_ms } => {
                out.put_u8(ELEMENT_PONG);
                out.put_u64_le(*nonce);
                out.put_u64_le(epoch.0);
                out.put_u64_le(*owner_absent_ms);
                out.put_u32_le(*lease_ms);
            }
            ElementMessage::Observed { nonce, epoch, holder, holder_admin, owner_absent_ms } => {
                out.put_u8(ELEMENT_OBSERVED);
                out.put_u16_le(WIRE_VERSION);
                out.put_u64_le(*nonce);
                out.put_u64_le(epoch.0);
                out.put_u64_le(holder.0);
                put_bytes(out, truncate_to(holder_admin, ADDRESS_BYTES_MAX).as_bytes());
                out.put_u64_le(*owner_absent_ms);
            }
            ElementMessage::Fault { reason } => {
                out.put_u8(ELEMENT_FAULT);
                put_bytes(out, truncate(reason).as_bytes());
            }
            ElementMessage::RecoveryDone { volume, result } => {
                out.put_u8(ELEMENT_RECOVERY_DONE);
                out.put_u32_le(volume.0);
                put_sequence_result(out, result);
            }
            ElementMessage::LogRecords { request_id, result } => {
                out.put_u8(ELEMENT_LOG_RECORDS);
                out.put_u64_le(*request_id);
                match result {
                    Ok(records) => {
                        out.put_u8(RESULT_OK);
                        out.put_u32_le(records.len() as u32);
                        for record in records {
                            record.encode(out);
                        }
                    }
                    Err(reason) => {
                        out.put_u8(RESULT_ERR);
                        put_bytes(out, truncate(reason).as_bytes());
                    }
                }
            }
            ElementMessage::ScrubReply { request_id, result } => {
                out.put_u8(ELEMENT_SCRUB_REPLY);
                out.put_u64_le(*request_id);
                match result {
                    Ok((applied, blocks)) => {
                        out.put_u8(RESULT_OK);
                        out.put_u64_le(applied.0);
                        assert!(blocks.len() <= SCRUB_CHUNK_BLOCKS_MAX as usize, "a scrub reply answers one chunk");
                        put_summaries(out, blocks);
                    }
                    Err(reason) => {
                        out.put_u8(RESULT_ERR);
                        put_bytes(out, truncate(reason).as_bytes());
                    }
                }
            }
            ElementMessage::Blocks { request_id, result } => {
                out.put_u8(ELEMENT_BLOCKS);
                out.put_u64_le(*request_id);
                match result {
                    Ok(chunk) => {
                        out.put_u8(RESULT_OK);
                        out.put_u64_le(chunk.applied.0);
                        out.put_u64_le(chunk.applied_epoch.0);
                        assert!(
                            chunk.blocks.len() <= COPY_CHUNK_BLOCKS_MAX,
                            "a chunk holds at most COPY_CHUNK_BLOCKS_MAX blocks"
                        );
                        out.put_u32_le(chunk.blocks.len() as u32);
                        for b in &chunk.blocks {
                            out.put_u64_le(b.block);
                            out.put_u64_le(b.sequence.0);
                            match &b.content {
                                Some(content) => {
                                    assert_eq!(content.len() as u64, BLOCK_BYTES, "a copied block is one block");
                                    out.put_u8(1);
                                    out.put_slice(content);
                                }
                                None => out.put_u8(0),
                            }
                        }
                        assert!(chunk.snapshots.len() <= SNAPSHOTS_PER_CHUNK_MAX, "a store holds fewer snapshots");
                        out.put_u32_le(chunk.snapshots.len() as u32);
                        for s in &chunk.snapshots {
                            out.put_u64_le(s.id);
                            out.put_u64_le(s.taken_at.0);
                            out.put_u64_le(s.size_bytes);
                        }
                    }
                    Err(reason) => {
                        out.put_u8(RESULT_ERR);
                        put_bytes(out, truncate(reason).as_bytes());
                    }
                }
            }
            ElementMessage::CopyProgress { volume, done_bytes, total_bytes, copied_bytes } => {
                out.put_u8(ELEMENT_COPY_PROGRESS);
                out.put_u32_le(volume.0);
                out.put_u64_le(*done_bytes);
                out.put_u64_le(*total_bytes);
                out.put_u64_le(*copied_bytes);
            }
            ElementMessage::CopyDone { volume, result } => {
                out.put_u8(ELEMENT_COPY_DONE);
                out.put_u32_le(volume.0);
                put_sequence_result(out, result);
            }
        }
    }

    fn decode_body(body: Bytes) -> Result<Self, DecodeError> {
        let mut r = Reader { body };
        let message = match r.u8("element message tag")? {
            ELEMENT_WELCOME => {
                read_wire_version(&mut r, "welcome")?;
                let epoch = Epoch(r.u64("welcome epoch")?);
                let element_id = r.u64("welcome element id")?;
                let volumes = read_volume_states(&mut r, "welcome volume count")?;
                ElementMessage::Welcome { epoch, element_id, volumes }
            }
            ELEMENT_VOLUMES_ADDED => {
                let volumes = read_volume_states(&mut r, "added volume state count")?;
                ElementMessage::VolumesAdded { volumes }
            }
            ELEMENT_VOLUMES_REMOVED => {
                ElementMessage::VolumesRemoved { volumes: read_volume_ids(&mut r, "removed volume count")? }
            }
            ELEMENT_VOLUMES_RESIZED => {
                ElementMessage::VolumesResized { volumes: read_volume_ids(&mut r, "resized volume count")? }
            }
            ELEMENT_VOLUMES_CHECKED => {
                let request_id = r.u64("check request id")?;
                let result = match r.u8("check result")? {
                    RESULT_OK => Ok(()),
                    RESULT_ERR => Err(r.string("check refusal", REASON_BYTES_MAX)?),
                    other => return Err(DecodeError::OutOfBounds { what: "check result", value: other as u64 }),
                };
                ElementMessage::VolumesChecked { request_id, result }
            }
            ELEMENT_REFUSED => {
                let reason = r.string("refusal reason", REASON_BYTES_MAX)?;
                let owner_absent_ms = r.u64("refusal owner absence")?;
                let epoch = match r.u8("refusal epoch flag")? {
                    0 => None,
                    1 => Some(Epoch(r.u64("refusal epoch")?)),
                    other => return Err(DecodeError::OutOfBounds { what: "refusal epoch flag", value: other as u64 }),
                };
                ElementMessage::Refused { reason, epoch, owner_absent_ms }
            }
            ELEMENT_APPLIED => ElementMessage::Applied {
                volume: VolumeId(r.u32("applied volume")?),
                sequence: Sequence(r.u64("applied sequence")?),
            },
            ELEMENT_READ_REPLY => {
                let request_id = r.u64("read reply id")?;
                let applied_sequence = Sequence(r.u64("read reply applied")?);
                let result = match r.u8("read result")? {
                    RESULT_OK => {
                        let data = r.bytes("read data", PAYLOAD_BYTES_MAX as usize)?;
                        let n = r.count("read checksum count", PIECES_MAX)?;
                        let mut crcs = Vec::with_capacity(n);
                        for _ in 0..n {
                            crcs.push(r.u32("read checksum")?);
                        }
                        Ok(ReadData { data, crcs })
                    }
                    RESULT_ERR => Err(r.string("read error", REASON_BYTES_MAX)?),
                    tag => return Err(DecodeError::UnknownTag(tag)),
                };
                ElementMessage::ReadReply { request_id, applied_sequence, result }
            }
            ELEMENT_BLOCK_STATUS_REPLY => {
                let request_id = r.u64("block status reply id")?;
                let applied_sequence = Sequence(r.u64("block status applied")?);
                let result = match r.u8("block status result")? {
                    RESULT_OK => {
                        let n = r.count("extent count", EXTENTS_MAX)?;
                        let mut extents = Vec::with_capacity(n.min(4096));
                        for _ in 0..n {
                            let length_bytes = r.u64("extent length")?;
                            let allocated = r.u8("extent allocated")? != 0;
                            extents.push(BlockExtent { length_bytes, allocated });
                        }
                        Ok(extents)
                    }
                    RESULT_ERR => Err(r.string("block status error", REASON_BYTES_MAX)?),
                    tag => return Err(DecodeError::UnknownTag(tag)),
                };
                ElementMessage::BlockStatusReply { request_id, applied_sequence, result }
            }
            ELEMENT_PONG => ElementMessage::Pong {
                nonce: r.u64("pong nonce")?,
                epoch: Epoch(r.u64("pong epoch")?),
                owner_absent_ms: r.u64("pong owner absence")?,
                lease_ms: r.u32("pong lease")?,
            },
            ELEMENT_OBSERVED => ElementMessage::Observed {
                nonce: {
                    read_wire_version(&mut r, "observed")?;
                    r.u64("observed nonce")?
                },
                epoch: Epoch(r.u64("observed epoch")?),
                holder: HostId(r.u64("observed holder")?),
                holder_admin: r.string("observed holder admin", ADDRESS_BYTES_MAX)?,
                owner_absent_ms: r.u64("observed owner absence")?,
            },
            ELEMENT_FAULT => ElementMessage::Fault { reason: r.string("fault", REASON_BYTES_MAX)? },
            ELEMENT_RECOVERY_DONE => {
                let volume = VolumeId(r.u32("recovery done volume")?);
                let result = r.sequence_result("recovery done")?;
                ElementMessage::RecoveryDone { volume, result }
            }
            ELEMENT_LOG_RECORDS => {
                let request_id = r.u64("log records id")?;
                let result = match r.u8("log records result")? {
                    RESULT_OK => {
                        let n = r.count("log record count", LOG_RECORDS_MAX)?;
                        let mut records = Vec::with_capacity(n.min(4096));
                        for _ in 0..n {
                            records.push(Record::read(&mut r)?);
                        }
                        Ok(records)
                    }
                    RESULT_ERR => Err(r.string("log records error", REASON_BYTES_MAX)?),
                    tag => return Err(DecodeError::UnknownTag(tag)),
                };
                ElementMessage::LogRecords { request_id, result }
            }
            ELEMENT_RECEIVED => ElementMessage::Received {
                volume: VolumeId(r.u32("received volume")?),
                sequence: Sequence(r.u64("received sequence")?),
            },
            ELEMENT_SCRUB_REPLY => {
                let request_id = r.u64("scrub reply id")?;
                let result = match r.u8("scrub result")? {
                    RESULT_OK => {
                        let applied = Sequence(r.u64("scrub applied")?);
                        Ok((applied, r.summaries("scrub block count", SCRUB_CHUNK_BLOCKS_MAX as usize)?))
                    }
                    RESULT_ERR => Err(r.string("scrub error", REASON_BYTES_MAX)?),
                    tag => return Err(DecodeError::UnknownTag(tag)),
                };
                ElementMessage::ScrubReply { request_id, result }
            }
            ELEMENT_BLOCKS => {
                let request_id = r.u64("blocks id")?;
                let result = match r.u8("blocks result")? {
                    RESULT_OK => {
                        let applied = Sequence(r.u64("blocks applied")?);
                        let applied_epoch = Epoch(r.u64("blocks applied epoch")?);
                        let n = r.count("block count", COPY_CHUNK_BLOCKS_MAX)?;
                        let mut blocks = Vec::with_capacity(n.min(4096));
                        for _ in 0..n {
                            let block = r.u64("copied block number")?;
                            let sequence = Sequence(r.u64("copied block sequence")?);
                            let content = match r.u8("copied block kind")? {
                                0 => None,
                                1 => {
                                    r.need("copied block content", BLOCK_BYTES as usize)?;
                                    Some(r.body.split_to(BLOCK_BYTES as usize))
                                }
                                tag => return Err(DecodeError::UnknownTag(tag)),
                            };
                            blocks.push(BlockCopy { block, sequence, content });
                        }
                        let n = r.count("snapshot count", SNAPSHOTS_PER_CHUNK_MAX)?;
                        let mut snapshots = Vec::with_capacity(n.min(64));
                        for _ in 0..n {
                            snapshots.push(SnapshotSummary {
                                id: r.u64("snapshot id")?,
                                taken_at: Sequence(r.u64("snapshot taken at")?),
                                size_bytes: r.u64("snapshot size")?,
                            });
                        }
                        Ok(BlockChunk { applied, applied_epoch, blocks, snapshots })
                    }
                    RESULT_ERR => Err(r.string("blocks error", REASON_BYTES_MAX)?),
                    tag => return Err(DecodeError::UnknownTag(tag)),
                };
                ElementMessage::Blocks { request_id, result }
            }
            ELEMENT_COPY_PROGRESS => ElementMessage::CopyProgress {
                volume: VolumeId(r.u32("copy progress volume")?),
                done_bytes: r.u64("copy progress done")?,
                total_bytes: r.u64("copy progress total")?,
                copied_bytes: r.u64("copy progress copied")?,
            },
            ELEMENT_COPY_DONE => {
                let volume = VolumeId(r.u32("copy done volume")?);
                let result = r.sequence_result("copy done")?;
                ElementMessage::CopyDone { volume, result }
            }
            tag => return Err(DecodeError::UnknownTag(tag)),
        };
        r.finish()?;
        Ok(message)
    }
}

fn put_sequence_result(out: &mut BytesMut, result: &Result<Sequence, String>) {
    match result {
        Ok(sequence) => {
            out.put_u8(RESULT_OK);
            out.put_u64_le(sequence.0);
        }
        Err(reason) => {
            out.put_u8(RESULT_ERR);
            put_bytes(out, truncate(reason).as_bytes());
        }
    }
}

fn truncate(reason: &str) -> &str {
    truncate_to(reason, REASON_BYTES_MAX)
}

fn truncate_to(text: &str, bytes_max: usize) -> &str {
    if text.len() <= bytes_max {
        return text;
    }
    let mut end = bytes_max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<M: Body + PartialEq + std::fmt::Debug + Clone>(m: M) {
        let mut buf = BytesMut::new();
        encode_frame(&m, &mut buf);
        encode_frame(&m, &mut buf);
        // Every strict prefix is "need more", never an error or a panic.
        let full = buf.clone();
        for cut in 0..(full.len() / 2) {
            let mut partial = BytesMut::from(&full[..cut]);
            assert_eq!(decode_frame::<M>(&mut partial), Ok(None), "prefix {cut}");
        }
        assert_eq!(decode_frame::<M>(&mut buf).expect("valid"), Some(m.clone()));
        assert_eq!(decode_frame::<M>(&mut buf).expect("valid"), Some(m));
        assert!(buf.is_empty());
    }

    #[test]
    fn a_session_opened_or_observed_by_another_wire_version_is_refused_with_both_versions_named() {
        // Encode, then put `version` where the wire version goes (after the tag) and seal the
        // frame's checksum again: what a peer of that version sends.
        fn as_version<M: Body>(message: &M, version: u16) -> BytesMut {
            let mut buf = BytesMut::new();
            encode_frame(message, &mut buf);
            buf[FRAME_HEADER_BYTES + 1..FRAME_HEADER_BYTES + 3].copy_from_slice(&version.to_le_bytes());
            let crc = crc32c::crc32c(&buf[FRAME_HEADER_BYTES..]);
            buf[4..8].copy_from_slice(&crc.to_le_bytes());
            buf
        }
        let hello = HostMessage::Hello {
            epoch: Epoch(3),
            host: HostId(9),
            volumes: vec![VolumeSpec { name: "vol0".into(), size_bytes: 1 << 30, clone_of: None, at_least: false }],
            admin: String::new(),
            receipt_acks: false,
        };
        let welcome = ElementMessage::Welcome { epoch: Epoch(3), element_id: 5, volumes: Vec::new() };
        assert_eq!(
            decode_frame::<HostMessage>(&mut as_version(&hello, WIRE_VERSION)).expect("ours"),
            Some(hello.clone())
        );
        let error = decode_frame::<HostMessage>(&mut as_version(&hello, WIRE_VERSION + 1)).expect_err("another");
        assert_eq!(error, DecodeError::WireVersion { what: "hello", peer: WIRE_VERSION + 1 });
        let text = error.to_string();
        assert!(text.contains(&format!("wire version {}", WIRE_VERSION + 1)), "{text}");
        assert!(text.contains(&format!("this side version {WIRE_VERSION}")), "{text}");
        let error = decode_frame::<ElementMessage>(&mut as_version(&welcome, 0)).expect_err("another");
        assert_eq!(error, DecodeError::WireVersion { what: "welcome", peer: 0 });
        // A standby's question and its answer stand alone, without a session: they carry it too.
        let observe = HostMessage::Observe { nonce: 4 };
        assert_eq!(
            decode_frame::<HostMessage>(&mut as_version(&observe, WIRE_VERSION)).expect("ours"),
            Some(observe.clone())
        );
        let error = decode_frame::<HostMessage>(&mut as_version(&observe, 7)).expect_err("another");
        assert_eq!(error, DecodeError::WireVersion { what: "observe", peer: 7 });
        let observed = ElementMessage::Observed {
            nonce: 4,
            epoch: Epoch(2),
            holder: HostId(1),
            holder_admin: String::new(),
            owner_absent_ms: 0,
        };
        let error = decode_frame::<ElementMessage>(&mut as_version(&observed, 7)).expect_err("another");
        assert_eq!(error, DecodeError::WireVersion { what: "observed", peer: 7 });
    }

    #[test]
    fn a_frame_in_pieces_is_the_frame_in_one() {
        let sizes = [0usize, 512, 4096, FRAME_DATA_SHARED_BYTES_MIN - 512, FRAME_DATA_SHARED_BYTES_MIN, 1 << 20];
        for (i, length) in sizes.into_iter().enumerate() {
            let data = Bytes::from((0..length).map(|b| (b * 7 + i) as u8).collect::<Vec<u8>>());
            let record = Record {
                volume: VolumeId(i as u32),
                epoch: Epoch(5),
                sequence: Sequence(77),
                op: Op::write(1536, data),
            };
            let message = HostMessage::Apply(record);
            let parts = encode_host_frame(&message);
            let mut whole = BytesMut::new();
            encode_frame(&message, &mut whole);
            let joined: Vec<u8> = parts.pieces().flat_map(|p| p.iter().copied()).collect();
            assert_eq!(joined, &whole[..], "{length} bytes");
            assert_eq!(parts.len(), whole.len());
            assert_eq!(!parts.data.is_empty(), length >= FRAME_DATA_SHARED_BYTES_MIN, "{length} bytes");
            let mut buf = BytesMut::from(&joined[..]);
            assert_eq!(decode_frame::<HostMessage>(&mut buf).expect("valid"), Some(message));
        }
        for message in [HostMessage::Ping { nonce: 3 }, HostMessage::Release] {
            let parts = encode_host_frame(&message);
            let mut whole = BytesMut::new();
            encode_frame(&message, &mut whole);
            assert_eq!(&parts.head[..], &whole[..]);
            assert!(parts.data.is_empty() && parts.tail.is_empty());
        }
    }

    /// Reads `messages`, framed, as the shells' readers do: a 256 KiB buffer that keeps 64 KiB of
    /// room, reads of at most `read` bytes into it. Returns what was decoded and how often
    /// `decode_frame` moved the buffer; `check` sees the buffer after each "need more bytes".
    fn read_framed(
        messages: &[HostMessage],
        read: usize,
        mut check: impl FnMut(&BytesMut),
    ) -> (Vec<HostMessage>, usize) {
        let mut stream = BytesMut::new();
        for message in messages {
            encode_frame(message, &mut stream);
        }
        let mut buf = BytesMut::with_capacity(256 * 1024);
        let (mut at, mut moved, mut decoded) = (0, 0, Vec::new());
        loop {
            let before = buf.as_ptr();
            match decode_frame::<HostMessage>(&mut buf).expect("valid") {
                Some(message) => decoded.push(message),
                None if at == stream.len() => return (decoded, moved),
                None => {
                    moved += usize::from(buf.as_ptr() != before);
                    check(&buf);
                    if buf.capacity() - buf.len() < 64 * 1024 {
                        buf.reserve(256 * 1024);
                    }
                    let take = (buf.capacity() - buf.len()).min(stream.len() - at).min(read);
                    buf.extend_from_slice(&stream[at..at + take]);
                    at += take;
                }
            }
        }
    }

    fn write_message(sequence: u64, data: Bytes) -> HostMessage {
        HostMessage::Apply(Record {
            volume: VolumeId(1),
            epoch: Epoch(2),
            sequence: Sequence(sequence),
            op: Op::write(0, data),
        })
    }

    #[test]
    fn a_frame_arriving_in_reads_gets_room_for_all_of_it_once() {
        let data = Bytes::from((0..(1usize << 20)).map(|b| (b * 13 % 251) as u8).collect::<Vec<u8>>());
        let large = vec![write_message(3, data), HostMessage::Ping { nonce: 9 }];
        let mut frame = BytesMut::new();
        encode_frame(&large[0], &mut frame);
        let (decoded, moved) = read_framed(&large, 70_001, |buf| {
            if buf.len() >= FRAME_HEADER_BYTES && buf.len() < frame.len() && buf[..8] == frame[..8] {
                assert!(buf.capacity() >= frame.len() + ROOM_AFTER_FRAME_BYTES, "room for the frame and more");
            }
        });
        assert_eq!(decoded, large);
        assert_eq!(moved, 1, "the buffer moved once, at the large frame's header");
        // Small frames that fit the room there is are read into it, even when one straddles
        // two reads: `decode_frame` moves no buffer for them.
        let small: Vec<HostMessage> = (0..100u64).map(|i| write_message(i, Bytes::from(vec![i as u8; 4096]))).collect();
        let (decoded, moved) = read_framed(&small, 10_001, |_| {});
        assert_eq!(decoded, small);
        assert_eq!(moved, 0, "no new room for small frames");
        // `room_for` keeps the bytes held and makes exactly the room asked for.
        let mut small = BytesMut::from(&b"held"[..]);
        crate::room_for(&mut small, 10_000);
        assert_eq!((&small[..], small.capacity() >= 10_000), (&b"held"[..], true));
        let before = small.as_ptr();
        crate::room_for(&mut small, 5_000);
        assert_eq!(small.as_ptr(), before, "no growth when the room is there");
    }

    #[test]
    fn a_record_frame_fits_its_hint() {
        for (offset, length) in [(0u64, 0usize), (512, 4096), (4096, 1 << 20), (1000, PAYLOAD_BYTES_MAX as usize)] {
            let data = Bytes::from(vec![7u8; length]);
            let record =
                Record { volume: VolumeId(3), epoch: Epoch(2), sequence: Sequence(9), op: Op::write(offset, data) };
            let message = HostMessage::Apply(record);
            let hint = message.frame_bytes_hint();
            let mut buf = BytesMut::with_capacity(hint);
            encode_frame(&message, &mut buf);
            assert!(buf.len() <= hint && buf.capacity() == hint, "{length} bytes at {offset}: {} > {hint}", buf.len());
        }
        assert_eq!(HostMessage::Ping { nonce: 1 }.frame_bytes_hint(), 0);
    }

    #[test]
    fn host_messages_round_trip() {
        round_trip(HostMessage::RemoveVolumes { volumes: vec![VolumeId(2)] });
        round_trip(HostMessage::ResizeVolumes { volumes: vec![(VolumeId(2), 1 << 30), (VolumeId(0), 4096)] });
        round_trip(HostMessage::CheckVolumes {
            request_id: 3,
            volumes: vec![VolumeSpec { name: "big#3".into(), size_bytes: 1 << 40, clone_of: None, at_least: false }],
        });
        round_trip(HostMessage::AddVolumes {
            volumes: vec![
                VolumeSpec { name: "vol1".into(), size_bytes: 1 << 20, clone_of: None, at_least: false },
                VolumeSpec { name: "g[a,b]".into(), size_bytes: 3 << 20, clone_of: None, at_least: true },
                VolumeSpec {
                    name: "c#12".into(),
                    size_bytes: 4 << 20,
                    clone_of: Some(CloneBase { volume: "vol1".into(), snapshot: 11 }),
                    at_least: false,
                },
            ],
        });
        round_trip(HostMessage::Hello {
            epoch: Epoch(3),
            host: HostId(0xfeed),
            volumes: vec![VolumeSpec { name: "vol0".into(), size_bytes: 1 << 30, clone_of: None, at_least: false }],
            admin: "127.0.0.1:7190".into(),
            receipt_acks: true,
        });
        for op in [
            Op::write(4096, Bytes::from_static(b"hello world")),
            Op::write(4000, Bytes::from(vec![3u8; 9000])),
            Op::Trim { offset_bytes: 0, length_bytes: 1 << 20 },
            Op::WriteZeroes { offset_bytes: 512, length_bytes: 1024 },
            Op::Snapshot { id: 7 },
            Op::SnapshotDelete { id: 7 },
            Op::Begin,
        ] {
            round_trip(HostMessage::Apply(Record { volume: VolumeId(1), epoch: Epoch(2), sequence: Sequence(77), op }));
        }
        round_trip(HostMessage::Read {
            request_id: 9,
            volume: VolumeId(0),
            offset_bytes: 8192,
            length_bytes: 4096,
            snapshot: None,
        });
        round_trip(HostMessage::Read {
            request_id: 9,
            volume: VolumeId(0),
            offset_bytes: 8192,
            length_bytes: 4096,
            snapshot: Some(SnapshotRef { id: 12, taken_at: Sequence(400) }),
        });
        round_trip(HostMessage::BlockStatus {
            request_id: 9,
            volume: VolumeId(0),
            offset_bytes: 0,
            length_bytes: 1 << 30,
            snapshot: Some(SnapshotRef { id: 3, taken_at: Sequence(1) }),
        });
        round_trip(HostMessage::Ping { nonce: 5 });
        round_trip(HostMessage::Observe { nonce: 6 });
        round_trip(HostMessage::Release);
        round_trip(HostMessage::Recover {
            volume: VolumeId(0),
            source: "127.0.0.1:7102".into(),
            after: Sequence(3),
            through: Sequence(90),
            rate_bytes_per_s: 1 << 20,
        });
        round_trip(HostMessage::Copy { volume: VolumeId(0), source: "127.0.0.1:7103".into(), rate_bytes_per_s: 0 });
        round_trip(HostMessage::FetchBlocks {
            request_id: 8,
            volume: VolumeId(0),
            first_block: 256,
            min_applied: Sequence(17),
            have: vec![
                BlockSummary { sequence: Sequence(3), crc: 0xdead_beef, allocated: true },
                BlockSummary { sequence: Sequence(0), crc: 0, allocated: false },
            ],
            snapshot: None,
        });
        round_trip(HostMessage::FetchBlocks {
            request_id: 9,
            volume: VolumeId(0),
            first_block: 0,
            min_applied: Sequence(3),
            have: vec![],
            snapshot: Some(12),
        });
        round_trip(HostMessage::Scrub {
            request_id: 4,
            volume: VolumeId(1),
            first_block: 1024,
            count: SCRUB_CHUNK_BLOCKS_MAX,
            min_applied: Sequence(99),
        });
        round_trip(HostMessage::FetchLog {
            request_id: 3,
            volume: VolumeId(0),
            after: Sequence(7),
            max_bytes: 1 << 20,
        });
    }

    #[test]
    fn element_messages_round_trip() {
        round_trip(ElementMessage::VolumesChecked { request_id: 4, result: Ok(()) });
        round_trip(ElementMessage::VolumesRemoved { volumes: vec![VolumeId(3), VolumeId(0)] });
        round_trip(ElementMessage::VolumesResized { volumes: vec![VolumeId(1)] });
        round_trip(ElementMessage::VolumesChecked { request_id: 5, result: Err("no room".into()) });
        round_trip(ElementMessage::VolumesAdded {
            volumes: vec![VolumeState {
                applied_sequence: Sequence(0),
                applied_epoch: Epoch(0),
                copying: false,
                repair: false,
                size_bytes: 0,
            }],
        });
        round_trip(ElementMessage::Welcome {
            epoch: Epoch(1),
            element_id: 77,
            volumes: vec![
                VolumeState {
                    applied_sequence: Sequence(10),
                    applied_epoch: Epoch(2),
                    copying: false,
                    repair: false,
                    size_bytes: 0,
                },
                VolumeState {
                    applied_sequence: Sequence(0),
                    applied_epoch: Epoch(0),
                    copying: true,
                    repair: false,
                    size_bytes: 0,
                },
                VolumeState {
                    applied_sequence: Sequence(9),
                    applied_epoch: Epoch(2),
                    copying: false,
                    repair: true,
                    size_bytes: 0,
                },
            ],
        });
        round_trip(ElementMessage::Blocks {
            request_id: 5,
            result: Ok(BlockChunk {
                applied: Sequence(40),
                applied_epoch: Epoch(2),
                blocks: vec![
                    BlockCopy { block: 7, sequence: Sequence(39), content: Some(Bytes::from(vec![3u8; 4096])) },
                    BlockCopy { block: 9, sequence: Sequence(12), content: None },
                ],
                snapshots: vec![SnapshotSummary { id: 4, taken_at: Sequence(30), size_bytes: 1 << 20 }],
            }),
        });
        round_trip(ElementMessage::Blocks { request_id: 5, result: Err("not in sync".into()) });
        round_trip(ElementMessage::ScrubReply {
            request_id: 6,
            result: Ok((
                Sequence(12),
                vec![
                    BlockSummary { sequence: Sequence(3), crc: 0xdead_beef, allocated: true },
                    BlockSummary { sequence: Sequence(0), crc: 0, allocated: false },
                ],
            )),
        });
        round_trip(ElementMessage::ScrubReply { request_id: 6, result: Err("a repair waits".into()) });
        round_trip(ElementMessage::Received { volume: VolumeId(2), sequence: Sequence(41) });
        round_trip(ElementMessage::CopyProgress {
            volume: VolumeId(0),
            done_bytes: 1 << 20,
            total_bytes: 1 << 30,
            copied_bytes: 4096,
        });
        round_trip(ElementMessage::CopyDone { volume: VolumeId(0), result: Ok(Sequence(40)) });
        round_trip(ElementMessage::CopyDone { volume: VolumeId(0), result: Err("source gone".into()) });
        round_trip(ElementMessage::Refused { reason: "stale epoch".into(), epoch: Some(Epoch(9)), owner_absent_ms: 7 });
        round_trip(ElementMessage::Refused { reason: "size mismatch".into(), epoch: None, owner_absent_ms: 0 });
        round_trip(ElementMessage::Applied { volume: VolumeId(0), sequence: Sequence(4) });
        round_trip(ElementMessage::ReadReply {
            request_id: 1,
            applied_sequence: Sequence(4),
            result: Ok(ReadData::computed(4000, Bytes::from_static(&[7; 100]))),
        });
        round_trip(ElementMessage::ReadReply {
            request_id: 1,
            applied_sequence: Sequence(4),
            result: Err("checksum mismatch".into()),
        });
        round_trip(ElementMessage::BlockStatusReply {
            request_id: 2,
            applied_sequence: Sequence(4),
            result: Ok(vec![
                BlockExtent { length_bytes: 4096, allocated: true },
                BlockExtent { length_bytes: 8192, allocated: false },
            ]),
        });
        round_trip(ElementMessage::Pong { nonce: 8, epoch: Epoch(4), owner_absent_ms: 0, lease_ms: 500 });
        round_trip(ElementMessage::Observed {
            nonce: 9,
            epoch: Epoch(4),
            holder: HostId(77),
            holder_admin: "127.0.0.1:7190".into(),
            owner_absent_ms: 120,
        });
        round_trip(ElementMessage::Fault { reason: "EIO".into() });
        round_trip(ElementMessage::RecoveryDone { volume: VolumeId(0), result: Ok(Sequence(9)) });
        round_trip(ElementMessage::RecoveryDone { volume: VolumeId(0), result: Err("gone".into()) });
        round_trip(ElementMessage::LogRecords {
            request_id: 4,
            result: Ok(vec![Record {
                volume: VolumeId(0),
                epoch: Epoch(1),
                sequence: Sequence(8),
                op: Op::Trim { offset_bytes: 0, length_bytes: 4096 },
            }]),
        });
        round_trip(ElementMessage::LogRecords { request_id: 4, result: Err("gone".into()) });
    }

    #[test]
    fn a_large_writes_frame_is_checked_by_its_pieces_and_its_data_by_the_store() {
        let data = Bytes::from((0..64 * 1024).map(|b| (b % 253) as u8).collect::<Vec<u8>>());
        let message = HostMessage::Apply(Record {
            volume: VolumeId(1),
            epoch: Epoch(2),
            sequence: Sequence(3),
            op: Op::write(4096 - 512, data.clone()),
        });
        let mut whole = BytesMut::new();
        encode_frame(&message, &mut whole);
        let data_at = whole.len() - data.len() - 4 - 4 * 17;
        assert_eq!(&whole[data_at..data_at + data.len()], &data[..]);
        // Damaged data of a whole-block piece passes the frame (it is not read there) and is
        // caught by its piece checksum, as the store checks it.
        let mut damaged = whole.clone();
        damaged[data_at + 10_000] ^= 0x10;
        let Some(HostMessage::Apply(record)) = decode_frame::<HostMessage>(&mut damaged).expect("the frame holds")
        else {
            panic!("not an apply")
        };
        let mismatch = record.op.check_data().expect_err("damaged data");
        assert_eq!(mismatch.offset_bytes, 12288);
        // Damaged data of a partial piece, a damaged piece checksum, a damaged head: the frame.
        for at in [data_at + 100, whole.len() - 8, data_at - 3, FRAME_HEADER_BYTES + 2] {
            let mut damaged = whole.clone();
            damaged[at] ^= 0x10;
            assert!(
                matches!(decode_frame::<HostMessage>(&mut damaged), Err(DecodeError::Checksum { .. })),
                "byte {at} damaged"
            );
        }
        // A length field that points past the body is read whole, and fails.
        let mut damaged = whole.clone();
        damaged[data_at - 1] = 0xff;
        assert!(decode_frame::<HostMessage>(&mut damaged).is_err());
    }

    #[test]
    fn a_read_reply_of_whole_blocks_is_framed_without_copying_or_reading_its_data() {
        let reply = |offset: u64, length: usize| {
            let data = Bytes::from((0..length).map(|b| (b % 251) as u8).collect::<Vec<u8>>());
            let read = ReadData::computed(offset, data);
            ElementMessage::ReadReply { request_id: 9, applied_sequence: Sequence(41), result: Ok(read) }
        };
        let block = BLOCK_BYTES as usize;
        // Whole blocks from 16 KiB up are framed in pieces, the same bytes as in one piece.
        for (offset, length, in_pieces) in [
            (0u64, 1usize << 20, true),
            (8192, FRAME_DATA_SHARED_BYTES_MIN, true),
            (0, FRAME_DATA_SHARED_BYTES_MIN - block, false),
            (512, 1 << 20, false),
            (0, (1 << 20) - 512, false),
            (512, (1 << 20) - 512, false),
        ] {
            let message = reply(offset, length);
            let mut whole = BytesMut::new();
            encode_frame(&message, &mut whole);
            let parts = encode_block_read_reply(&message);
            assert_eq!(parts.is_some(), in_pieces, "{length} bytes at {offset}");
            if let Some(parts) = parts {
                let joined: Vec<u8> = parts.pieces().flat_map(|p| p.iter().copied()).collect();
                assert_eq!(joined, &whole[..], "{length} bytes at {offset}");
                let ElementMessage::ReadReply { result: Ok(read), .. } = &message else { unreachable!("a reply") };
                assert_eq!(parts.data.as_ptr(), read.data.as_ptr(), "the data is not copied");
            }
            let mut buf = whole.clone();
            assert_eq!(decode_frame::<ElementMessage>(&mut buf).expect("valid"), Some(message));
            // Whether or not its data is read for the frame's checksum, a frame damaged
            // anywhere else is refused.
            for at in [FRAME_HEADER_BYTES + 2, FRAME_HEADER_BYTES + READ_REPLY_DATA_AT - 1, whole.len() - 3] {
                let mut damaged = whole.clone();
                damaged[at] ^= 0x10;
                assert!(decode_frame::<ElementMessage>(&mut damaged).is_err(), "{length} bytes at {offset}, byte {at}");
            }
            // Damaged data: refused by the frame when the frame reads it; otherwise the frame
            // holds and the data fails its blocks' checksums, which the host element checks.
            let mut damaged = whole.clone();
            damaged[FRAME_HEADER_BYTES + READ_REPLY_DATA_AT + 5000] ^= 0x10;
            match decode_frame::<ElementMessage>(&mut damaged) {
                Ok(Some(ElementMessage::ReadReply { result: Ok(read), .. })) => {
                    assert!(in_pieces, "{length} bytes at {offset}: damaged data passed a frame that reads it");
                    let mismatch = crate::pieces::check_pieces(offset, &read.data, &read.crcs).expect_err("damaged");
                    assert_eq!(mismatch.offset_bytes, offset + 4096);
                }
                other => assert!(
                    !in_pieces && matches!(other, Err(DecodeError::Checksum { .. })),
                    "{length} bytes at {offset}: {other:?}"
                ),
            }
        }
        // Not a reply of data: no pieces.
        let failed =
            ElementMessage::ReadReply { request_id: 1, applied_sequence: Sequence(1), result: Err("no".into()) };
        assert!(encode_block_read_reply(&failed).is_none());
        // A checksum count that does not fit whole blocks reads the data.
        let ElementMessage::ReadReply { result: Ok(mut read), .. } = reply(0, 1 << 20) else { unreachable!("a reply") };
        read.crcs.pop();
        let odd = ElementMessage::ReadReply { request_id: 2, applied_sequence: Sequence(2), result: Ok(read) };
        assert!(encode_block_read_reply(&odd).is_none());
        let mut whole = BytesMut::new();
        encode_frame(&odd, &mut whole);
        assert_eq!(decode_frame::<ElementMessage>(&mut whole).expect("valid"), Some(odd));
    }

    #[test]
    fn corruption_is_detected() {
        let mut buf = BytesMut::new();
        encode_frame(&HostMessage::Ping { nonce: 1 }, &mut buf);
        let last = buf.len() - 1;
        buf[last] ^= 0x40;
        assert!(matches!(decode_frame::<HostMessage>(&mut buf), Err(DecodeError::Checksum { .. })));
    }

    #[test]
    fn oversized_frame_is_rejected_before_allocation() {
        let mut buf = BytesMut::new();
        buf.put_u32_le(u32::MAX);
        buf.put_u32_le(0);
        assert_eq!(decode_frame::<ElementMessage>(&mut buf), Err(DecodeError::FrameTooLarge(u32::MAX)));
    }

    #[test]
    fn random_bodies_never_panic() {
        // A cheap deterministic fuzz pass: valid frames around arbitrary bodies.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 64) as usize;
            let body: Vec<u8> = (0..len).map(|i| (state >> (i % 8 * 8)) as u8).collect();
            let mut buf = BytesMut::new();
            buf.put_u32_le(len as u32);
            buf.put_u32_le(crc32c::crc32c(&body));
            buf.put_slice(&body);
            let _ = decode_frame::<HostMessage>(&mut buf.clone());
            let _ = decode_frame::<ElementMessage>(&mut buf);
        }
    }
}
