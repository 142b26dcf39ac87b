//! The transmission phase: decoding and validating request headers, and encoding replies (simple
//! or structured, as negotiated). A [`Transmission`] is immutable once the handshake made it, so
//! a driver may share it between tasks that answer requests concurrently.

use crate::handshake::{ExportInfo, BASE_ALLOCATION_CONTEXT_ID};
use crate::limits::{
    BLOCK_SIZE_MAX_BYTES, BLOCK_SIZE_MIN_BYTES, BLOCK_STATUS_DESCRIPTORS_MAX, ERROR_MESSAGE_BYTES_MAX,
};
use crate::wire::*;
use crate::{Errno, FatalError};

/// One stretch of an export as the backend sees it, for `base:allocation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub length_bytes: u64,
    /// Unallocated and reading as zeroes: reported as `NBD_STATE_HOLE | NBD_STATE_ZERO`.
    pub hole: bool,
}

/// Which command a request carried, for replies and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommandKind {
    Read,
    Write,
    Disconnect,
    Flush,
    Trim,
    WriteZeroes,
    BlockStatus,
    /// A command type we do not implement (including `NBD_CMD_CACHE`).
    Other(u16),
}

impl CommandKind {
    fn from_wire(command: u16) -> CommandKind {
        match command {
            CMD_READ => CommandKind::Read,
            CMD_WRITE => CommandKind::Write,
            CMD_DISC => CommandKind::Disconnect,
            CMD_FLUSH => CommandKind::Flush,
            CMD_TRIM => CommandKind::Trim,
            CMD_WRITE_ZEROES => CommandKind::WriteZeroes,
            CMD_BLOCK_STATUS => CommandKind::BlockStatus,
            other => CommandKind::Other(other),
        }
    }
}

/// A valid request for the backend. Offsets and lengths are within the export, aligned to the
/// minimum block size (or ending exactly at the export's end), and nonzero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// At most [`BLOCK_SIZE_MAX_BYTES`].
    Read {
        offset_bytes: u64,
        length_bytes: u32,
    },
    /// `length_bytes` (at most [`BLOCK_SIZE_MAX_BYTES`]) of payload follow the header.
    Write {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
    },
    /// `no_hole`: the client asked for the range to stay allocated.
    WriteZeroes {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
        no_hole: bool,
    },
    /// Only decoded when `base:allocation` was negotiated for this export.
    BlockStatus {
        offset_bytes: u64,
        length_bytes: u32,
        req_one: bool,
    },
}

impl Command {
    pub fn kind(&self) -> CommandKind {
        match self {
            Command::Read { .. } => CommandKind::Read,
            Command::Write { .. } => CommandKind::Write,
            Command::Flush => CommandKind::Flush,
            Command::Trim { .. } => CommandKind::Trim,
            Command::WriteZeroes { .. } => CommandKind::WriteZeroes,
            Command::BlockStatus { .. } => CommandKind::BlockStatus,
        }
    }

    /// Bytes of payload that follow the request header.
    pub fn payload_bytes(&self) -> u32 {
        match self {
            Command::Write { length_bytes, .. } => *length_bytes,
            _ => 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub handle: u64,
    pub command: Command,
}

/// A request answered with an error without reaching the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejected {
    pub handle: u64,
    pub kind: CommandKind,
    pub errno: Errno,
    pub message: &'static str,
    /// Payload that follows the header anyway (a rejected `NBD_CMD_WRITE`'s data) and must be
    /// read and thrown away before the next header. It is at most `u32::MAX` bytes; drain it
    /// without buffering it whole.
    pub payload_bytes: u32,
}

/// What one request header means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    Request(Request),
    /// A valid request of length zero: reply success at once (the spec leaves its meaning open
    /// and asks servers not to disconnect).
    NoOp {
        handle: u64,
        kind: CommandKind,
    },
    Rejected(Rejected),
    /// `NBD_CMD_DISC`: finish the requests in flight, then close. No reply.
    Disconnect,
}

/// The negotiated state of one connection in the transmission phase.
#[derive(Clone, Debug)]
pub struct Transmission {
    export: ExportInfo,
    flags: u16,
    structured_replies: bool,
    block_status: bool,
}

impl Transmission {
    pub(crate) fn new(export: ExportInfo, flags: u16, structured_replies: bool, block_status: bool) -> Transmission {
        assert!(!block_status || structured_replies);
        assert!(flags & FLAG_HAS_FLAGS != 0);
        assert_eq!(flags & FLAG_SEND_DF != 0, structured_replies);
        Transmission { export, flags, structured_replies, block_status }
    }

    /// A transmission phase as if negotiated, for tests of drivers and replies.
    pub fn for_tests(export: ExportInfo, structured_replies: bool, block_status: bool) -> Transmission {
        let mut flags = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_TRIM;
        flags |= FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO;
        if structured_replies {
            flags |= FLAG_SEND_DF;
        }
        Transmission::new(export, flags, structured_replies, block_status)
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    /// The transmission flags sent to the client.
    pub fn flags(&self) -> u16 {
        self.flags
    }

    pub fn structured_replies(&self) -> bool {
        self.structured_replies
    }

    /// Whether `base:allocation` was selected for this export, so `NBD_CMD_BLOCK_STATUS` works.
    pub fn block_status_enabled(&self) -> bool {
        self.block_status
    }

    /// Decodes and validates one request header. An `Err` means the stream is garbage: close
    /// the connection.
    pub fn decode_request(&self, header: &[u8; REQUEST_HEADER_BYTES]) -> Result<Decoded, FatalError> {
        let u16_at = |at: usize| u16::from_be_bytes([header[at], header[at + 1]]);
        let u32_at = |at: usize| u32::from_be_bytes([0, 1, 2, 3].map(|i| header[at + i]));
        let u64_at = |at: usize| u64::from_be_bytes([0, 1, 2, 3, 4, 5, 6, 7].map(|i| header[at + i]));
        let magic = u32_at(0);
        let flags = u16_at(4);
        let command = u16_at(6);
        let handle = u64_at(8);
        let offset_bytes = u64_at(16);
        let length_bytes = u32_at(24);
        if magic != REQUEST_MAGIC {
            return Err(FatalError::RequestMagic(magic));
        }
        let kind = CommandKind::from_wire(command);
        let payload_bytes = if command == CMD_WRITE { length_bytes } else { 0 };
        let reject = |errno: Errno, message: &'static str| {
            Ok(Decoded::Rejected(Rejected { handle, kind, errno, message, payload_bytes }))
        };

        // FUA is valid on every command once advertised; the others only where documented.
        let flags_allowed = CMD_FLAG_FUA
            | match kind {
                CommandKind::Read if self.structured_replies => CMD_FLAG_DF,
                CommandKind::WriteZeroes => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CommandKind::BlockStatus => CMD_FLAG_REQ_ONE,
                _ => 0,
            };
        match kind {
            CommandKind::Disconnect => return Ok(Decoded::Disconnect),
            CommandKind::Other(_) => return reject(Errno::Inval, "unknown command"),
            _ => {}
        }
        if flags & !flags_allowed != 0 {
            return reject(Errno::Inval, "command flags not valid for this command");
        }
        let fua = flags & CMD_FLAG_FUA != 0;

        if kind == CommandKind::Flush {
            if offset_bytes != 0 || length_bytes != 0 {
                return reject(Errno::Inval, "flush offset and length must be zero");
            }
            return Ok(Decoded::Request(Request { handle, command: Command::Flush }));
        }
        if kind == CommandKind::BlockStatus && !self.block_status {
            return reject(Errno::Inval, "no metadata context was negotiated");
        }
        if matches!(kind, CommandKind::Read | CommandKind::Write) && length_bytes > BLOCK_SIZE_MAX_BYTES {
            return reject(Errno::Inval, "request longer than the maximum block size");
        }

        if self.export.read_only && matches!(kind, CommandKind::Write | CommandKind::Trim | CommandKind::WriteZeroes) {
            return reject(Errno::Perm, "the export is read-only");
        }
        let size_bytes = self.export.size_bytes;
        let block = u64::from(BLOCK_SIZE_MIN_BYTES);
        let end_bytes = offset_bytes.checked_add(u64::from(length_bytes));
        let ends_at_export_end = end_bytes == Some(size_bytes);
        if offset_bytes % block != 0 || (u64::from(length_bytes) % block != 0 && !ends_at_export_end) {
            return reject(Errno::Inval, "request not aligned to the minimum block size");
        }
        if end_bytes.map_or(true, |end| end > size_bytes) {
            // The spec's choice: ENOSPC for writes past the end, EINVAL for the rest.
            return match kind {
                CommandKind::Write | CommandKind::WriteZeroes => {
                    reject(Errno::NoSpc, "request beyond the end of the export")
                }
                _ => reject(Errno::Inval, "request beyond the end of the export"),
            };
        }
        if length_bytes == 0 {
            return match kind {
                CommandKind::BlockStatus => reject(Errno::Inval, "block status of zero bytes"),
                _ => Ok(Decoded::NoOp { handle, kind }),
            };
        }

        let command = match kind {
            CommandKind::Read => Command::Read { offset_bytes, length_bytes },
            CommandKind::Write => Command::Write { offset_bytes, length_bytes, fua },
            CommandKind::Trim => Command::Trim { offset_bytes, length_bytes, fua },
            CommandKind::WriteZeroes => {
                if flags & CMD_FLAG_FAST_ZERO != 0 {
                    // We cannot tell in advance whether zeroing beats writing, so every fast
                    // zero request fails fast, as the spec allows.
                    return reject(Errno::NotSup, "fast zero is not supported");
                }
                let no_hole = flags & CMD_FLAG_NO_HOLE != 0;
                Command::WriteZeroes { offset_bytes, length_bytes, fua, no_hole }
            }
            CommandKind::BlockStatus => {
                Command::BlockStatus { offset_bytes, length_bytes, req_one: flags & CMD_FLAG_REQ_ONE != 0 }
            }
            CommandKind::Flush | CommandKind::Disconnect | CommandKind::Other(_) => {
                unreachable!("handled above")
            }
        };
        Ok(Decoded::Request(Request { handle, command }))
    }

    /// The whole reply to a successful request without data: any command but a read of one byte
    /// or more, and block status.
    pub fn encode_success(&self, handle: u64, kind: CommandKind) -> Vec<u8> {
        assert!(kind != CommandKind::BlockStatus && kind != CommandKind::Disconnect);
        if self.structured_replies && kind == CommandKind::Read {
            // A read must be answered with a structured reply once negotiated.
            let mut out = Vec::with_capacity(CHUNK_HEADER_BYTES);
            put_chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle, 0);
            out
        } else {
            simple_reply(handle, 0)
        }
    }

    /// What to send before the `data_bytes` of a successful read (the data itself follows,
    /// unchanged, to keep big buffers out of the codec).
    pub fn encode_read_header(&self, handle: u64, offset_bytes: u64, data_bytes: u32) -> Vec<u8> {
        assert!(data_bytes > 0 && data_bytes <= BLOCK_SIZE_MAX_BYTES);
        if self.structured_replies {
            // One content chunk covering the whole request, final: the data is already in
            // memory, so no error can come up while it is sent.
            let mut out = Vec::with_capacity(CHUNK_HEADER_BYTES + 8);
            put_chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, handle, 8 + data_bytes);
            put_u64(&mut out, offset_bytes);
            out
        } else {
            simple_reply(handle, 0)
        }
    }

    /// The whole reply to a failed request (any command). Structured replies carry `message`
    /// (cut to [`ERROR_MESSAGE_BYTES_MAX`]); simple replies have no room for it.
    pub fn encode_error(&self, handle: u64, errno: Errno, message: &str) -> Vec<u8> {
        if !self.structured_replies {
            return simple_reply(handle, errno.code());
        }
        let message = truncate_at_char_boundary(message, ERROR_MESSAGE_BYTES_MAX);
        let payload_bytes = 4 + 2 + message.len() as u32;
        let mut out = Vec::with_capacity(CHUNK_HEADER_BYTES + payload_bytes as usize);
        put_chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, handle, payload_bytes);
        put_u32(&mut out, errno.code());
        put_u16(&mut out, message.len() as u16);
        out.extend_from_slice(message.as_bytes());
        out
    }

    /// The whole reply to a successful `NBD_CMD_BLOCK_STATUS` for `base:allocation`, from the
    /// backend's extents starting at `offset_bytes`. The extents may be unaligned, too long,
    /// too many or too few: the descriptors sent are aligned to the minimum block size (a block
    /// that is only partly a hole is reported as data, which is always safe), never extend past
    /// the request, number at most [`BLOCK_STATUS_DESCRIPTORS_MAX`] (one with `req_one`), and
    /// there is always at least one.
    pub fn encode_block_status(&self, handle: u64, length_bytes: u32, req_one: bool, extents: &[Extent]) -> Vec<u8> {
        assert!(self.block_status, "block status was not negotiated");
        let descriptors = block_status_descriptors(length_bytes, req_one, extents);
        let payload_bytes = 4 + 8 * descriptors.len() as u32;
        let mut out = Vec::with_capacity(CHUNK_HEADER_BYTES + payload_bytes as usize);
        put_chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, handle, payload_bytes);
        put_u32(&mut out, BASE_ALLOCATION_CONTEXT_ID);
        for (length, status) in descriptors {
            put_u32(&mut out, length);
            put_u32(&mut out, status);
        }
        out
    }
}

fn simple_reply(handle: u64, error: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(SIMPLE_REPLY_HEADER_BYTES);
    put_u32(&mut out, SIMPLE_REPLY_MAGIC);
    put_u32(&mut out, error);
    put_u64(&mut out, handle);
    out
}

fn put_chunk_header(out: &mut Vec<u8>, flags: u16, chunk_type: u16, handle: u64, length: u32) {
    put_u32(out, STRUCTURED_REPLY_MAGIC);
    put_u16(out, flags);
    put_u16(out, chunk_type);
    put_u64(out, handle);
    put_u32(out, length);
}

fn truncate_at_char_boundary(text: &str, bytes_max: usize) -> &str {
    if text.len() <= bytes_max {
        return text;
    }
    let mut end = bytes_max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `(length, status flags)` descriptors for a block status reply of a request of `length_bytes`
/// whose offset is aligned; see [`Transmission::encode_block_status`].
fn block_status_descriptors(length_bytes: u32, req_one: bool, extents: &[Extent]) -> Vec<(u32, u32)> {
    const HOLE: u32 = STATE_HOLE | STATE_ZERO;
    const DATA: u32 = 0;
    let end = u64::from(length_bytes);
    let block = u64::from(BLOCK_SIZE_MIN_BYTES);
    // The end of the request counts as aligned: it is, or it is the end of the export.
    let round_up = |position: u64| (position.div_ceil(block) * block).min(end);
    let round_down = |position: u64| {
        if position == end {
            end
        } else {
            position / block * block
        }
    };

    let mut descriptors: Vec<(u64, u32)> = Vec::new();
    let push = |descriptors: &mut Vec<(u64, u32)>, length: u64, status: u32| {
        assert!(length > 0);
        match descriptors.last_mut() {
            Some(last) if last.1 == status => last.0 += length,
            _ => descriptors.push((length, status)),
        }
    };
    // `covered` walks the backend's extents (clamped to the request); `position` is how far the
    // descriptors reach, always aligned.
    let mut covered: u64 = 0;
    let mut position: u64 = 0;
    let mut iter = extents.iter().filter(|extent| extent.length_bytes > 0).peekable();
    while let Some(extent) = iter.next() {
        if covered >= end || descriptors.len() > BLOCK_STATUS_DESCRIPTORS_MAX {
            break;
        }
        let start = covered;
        let mut stop = covered.saturating_add(extent.length_bytes).min(end);
        // Merge runs of the same kind first, so rounding does not split them.
        while let Some(next) = iter.next_if(|next| next.hole == extent.hole) {
            stop = stop.saturating_add(next.length_bytes).min(end);
        }
        covered = stop;
        if stop <= position {
            continue;
        }
        if extent.hole {
            let hole_start = round_up(start.max(position));
            let hole_stop = round_down(stop);
            if hole_start < hole_stop {
                if position < hole_start {
                    push(&mut descriptors, hole_start - position, DATA);
                }
                push(&mut descriptors, hole_stop - hole_start, HOLE);
                position = hole_stop;
            }
        } else {
            let data_stop = round_up(stop);
            push(&mut descriptors, data_stop - position, DATA);
            position = data_stop;
        }
    }
    if descriptors.is_empty() {
        // Nothing usable from the backend: "data" is always a safe answer. Describe what it
        // covered (rounded up), or the whole request if it said nothing.
        let length = if covered == 0 { end } else { round_up(covered) };
        push(&mut descriptors, length, DATA);
    }
    let keep = if req_one { 1 } else { BLOCK_STATUS_DESCRIPTORS_MAX };
    descriptors.truncate(keep);
    descriptors
        .into_iter()
        .map(|(length, status)| (u32::try_from(length).expect("descriptors lie within a u32 request"), status))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 1 << 40;

    fn transmission(structured: bool, block_status: bool) -> Transmission {
        let export = ExportInfo { name: "v".into(), size_bytes: SIZE, description: String::new(), read_only: false };
        Transmission::for_tests(export, structured, block_status)
    }

    fn header(flags: u16, command: u16, offset: u64, length: u32) -> [u8; REQUEST_HEADER_BYTES] {
        let mut out = Vec::new();
        put_u32(&mut out, REQUEST_MAGIC);
        put_u16(&mut out, flags);
        put_u16(&mut out, command);
        put_u64(&mut out, 0x1122_3344_5566_7788);
        put_u64(&mut out, offset);
        put_u32(&mut out, length);
        out.try_into().unwrap()
    }

    /// Decodes one header on a structured, block-status-enabled connection (unless `simple`)
    /// and renders the outcome as short text, so the cases below read as a table.
    fn check(simple: bool, flags: u16, command: u16, offset: u64, length: u32, expected: &str) {
        let transmission = transmission(!simple, !simple);
        let got = match transmission.decode_request(&header(flags, command, offset, length)) {
            Ok(Decoded::Request(request)) => {
                assert_eq!(request.handle, 0x1122_3344_5566_7788);
                format!("{:?}", request.command)
            }
            Ok(Decoded::NoOp { kind, .. }) => format!("noop {kind:?}"),
            Ok(Decoded::Rejected(rejected)) => {
                format!("{:?} payload={}", rejected.errno, rejected.payload_bytes)
            }
            Ok(Decoded::Disconnect) => "disconnect".into(),
            Err(error) => format!("fatal {error}"),
        };
        assert_eq!(got, expected, "flags={flags:#x} command={command} offset={offset} length={length}");
    }

    const MAX: u32 = BLOCK_SIZE_MAX_BYTES;

    #[test]
    fn a_read_only_export_refuses_every_change_and_serves_the_rest() {
        let export = ExportInfo { name: "v@s".into(), size_bytes: SIZE, description: String::new(), read_only: true };
        let t = Transmission::for_tests(export, true, true);
        let decode = |command, length| t.decode_request(&header(0, command, 4096, length));
        for (command, payload) in [(CMD_WRITE, 8192), (CMD_TRIM, 0), (CMD_WRITE_ZEROES, 0)] {
            match decode(command, 8192) {
                Ok(Decoded::Rejected(r)) => {
                    assert_eq!((r.errno, r.payload_bytes), (Errno::Perm, payload), "command {command}")
                }
                other => panic!("command {command} on a read-only export: {other:?}"),
            }
        }
        assert!(matches!(decode(CMD_READ, 8192), Ok(Decoded::Request(_))));
        assert!(matches!(decode(CMD_BLOCK_STATUS, 8192), Ok(Decoded::Request(_))));
        assert!(matches!(t.decode_request(&header(0, CMD_FLUSH, 0, 0)), Ok(Decoded::Request(_))));
    }

    #[test]
    #[rustfmt::skip]
    fn requests() {
        let end = SIZE - 4096;
        for (simple, flags, command, offset, length, expected) in [
            (false, 0, CMD_READ, 0, 4096, "Read { offset_bytes: 0, length_bytes: 4096 }"),
            (false, CMD_FLAG_DF | CMD_FLAG_FUA, CMD_READ, 512, 512, "Read { offset_bytes: 512, length_bytes: 512 }"),
            (true, CMD_FLAG_DF, CMD_READ, 0, 512, "Inval payload=0"),
            (false, 0, CMD_READ, 0, MAX, "Read { offset_bytes: 0, length_bytes: 33554432 }"),
            (false, 0, CMD_READ, 0, MAX + 512, "Inval payload=0"),
            (false, 0, CMD_READ, 1, 512, "Inval payload=0"),
            (false, 0, CMD_READ, 0, 100, "Inval payload=0"),
            (false, 0, CMD_READ, end, 8192, "Inval payload=0"),
            (false, 0, CMD_READ, u64::MAX - 511, 1024, "Inval payload=0"),
            (false, 0, CMD_READ, 0, 0, "noop Read"),
            (false, 0, CMD_READ, SIZE, 0, "noop Read"),
            (false, 0, CMD_READ, SIZE + 512, 0, "Inval payload=0"),
            (false, CMD_FLAG_REQ_ONE, CMD_READ, 0, 512, "Inval payload=0"),
            (false, 1 << 9, CMD_READ, 0, 512, "Inval payload=0"),
            (false, CMD_FLAG_FUA, CMD_WRITE, 4096, 8192, "Write { offset_bytes: 4096, length_bytes: 8192, fua: true }"),
            (false, 0, CMD_WRITE, end, 8192, "NoSpc payload=8192"),
            (false, 0, CMD_WRITE, 0, MAX + 512, "Inval payload=33554944"),
            (false, 0, CMD_WRITE, 0, u32::MAX, "Inval payload=4294967295"),
            (false, 0, CMD_WRITE, 3, 512, "Inval payload=512"),
            (false, CMD_FLAG_DF, CMD_WRITE, 0, 512, "Inval payload=512"),
            (false, 0, CMD_WRITE, 0, 0, "noop Write"),
            (false, 0, CMD_DISC, 0, 0, "disconnect"),
            (false, 0, CMD_FLUSH, 0, 0, "Flush"),
            (false, CMD_FLAG_FUA, CMD_FLUSH, 0, 0, "Flush"),
            (false, 0, CMD_FLUSH, 0, 512, "Inval payload=0"),
            (false, 0, CMD_TRIM, 0, u32::MAX - 511, "Trim { offset_bytes: 0, length_bytes: 4294966784, fua: false }"),
            (false, 0, CMD_TRIM, end, 8192, "Inval payload=0"),
            (false, CMD_FLAG_NO_HOLE, CMD_TRIM, 0, 512, "Inval payload=0"),
            (false, CMD_FLAG_NO_HOLE | CMD_FLAG_FUA, CMD_WRITE_ZEROES, 0, u32::MAX - 511,
                "WriteZeroes { offset_bytes: 0, length_bytes: 4294966784, fua: true, no_hole: true }"),
            (false, 0, CMD_WRITE_ZEROES, end, 8192, "NoSpc payload=0"),
            (false, CMD_FLAG_FAST_ZERO, CMD_WRITE_ZEROES, 0, 512, "NotSup payload=0"),
            (false, CMD_FLAG_FAST_ZERO, CMD_WRITE_ZEROES, 0, 100, "Inval payload=0"),
            (false, CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 0, 1 << 20,
                "BlockStatus { offset_bytes: 0, length_bytes: 1048576, req_one: true }"),
            (false, 0, CMD_BLOCK_STATUS, end, 8192, "Inval payload=0"),
            (false, 0, CMD_BLOCK_STATUS, 0, 0, "Inval payload=0"),
            (true, 0, CMD_BLOCK_STATUS, 0, 512, "Inval payload=0"),
            (false, 0, CMD_CACHE, 0, 512, "Inval payload=0"),
            (false, 0, 0xffff, 0, 512, "Inval payload=0"),
        ] {
            check(simple, flags, command, offset, length, expected);
        }
    }

    #[test]
    fn export_size_not_a_multiple_of_the_block_size() {
        let export = ExportInfo { name: "v".into(), size_bytes: 1000, description: String::new(), read_only: false };
        let transmission = Transmission::for_tests(export, false, false);
        let decode = |offset, length| transmission.decode_request(&header(0, CMD_READ, offset, length));
        assert!(matches!(decode(512, 488), Ok(Decoded::Request(_))), "the tail is reachable");
        assert!(matches!(decode(0, 1000), Ok(Decoded::Request(_))));
        assert!(matches!(decode(512, 512), Ok(Decoded::Rejected(_))));
        assert!(matches!(decode(0, 488), Ok(Decoded::Rejected(_))));
    }

    #[test]
    fn bad_magic_is_fatal() {
        let mut bytes = header(0, CMD_READ, 0, 512);
        bytes[0] ^= 1;
        let error = transmission(true, true).decode_request(&bytes).unwrap_err();
        assert_eq!(error, FatalError::RequestMagic(REQUEST_MAGIC ^ (1 << 24)));
    }

    #[test]
    fn replies() {
        let handle = 0x0102_0304_0506_0708u64;
        let simple = transmission(false, false);
        let structured = transmission(true, true);
        let mut expected_simple = vec![0x67, 0x44, 0x66, 0x98, 0, 0, 0, 0];
        expected_simple.extend_from_slice(&handle.to_be_bytes());
        assert_eq!(simple.encode_success(handle, CommandKind::Write), expected_simple);
        assert_eq!(simple.encode_success(handle, CommandKind::Read), expected_simple);
        assert_eq!(simple.encode_read_header(handle, 4096, 512), expected_simple);
        assert_eq!(structured.encode_success(handle, CommandKind::Flush), expected_simple);

        let mut expected_error = vec![0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22];
        expected_error.extend_from_slice(&handle.to_be_bytes());
        assert_eq!(simple.encode_error(handle, Errno::Inval, "ignored"), expected_error);

        let chunk = |flags: u16, chunk_type: u16, length: u32| {
            let mut out = vec![0x66, 0x8e, 0x33, 0xef];
            out.extend_from_slice(&flags.to_be_bytes());
            out.extend_from_slice(&chunk_type.to_be_bytes());
            out.extend_from_slice(&handle.to_be_bytes());
            out.extend_from_slice(&length.to_be_bytes());
            out
        };
        assert_eq!(structured.encode_success(handle, CommandKind::Read), chunk(1, 0, 0));
        let mut read = chunk(1, 1, 8 + 4096);
        read.extend_from_slice(&8192u64.to_be_bytes());
        assert_eq!(structured.encode_read_header(handle, 8192, 4096), read);
        let mut error = chunk(1, 0x8001, 4 + 2 + 3);
        error.extend_from_slice(&[0, 0, 0, 5, 0, 3, b'b', b'a', b'd']);
        assert_eq!(structured.encode_error(handle, Errno::Io, "bad"), error);
        let long = "é".repeat(3000);
        let error = structured.encode_error(handle, Errno::Io, &long);
        assert_eq!(error.len(), CHUNK_HEADER_BYTES + 6 + 4096);

        let mut status = chunk(1, 5, 4 + 16);
        status.extend_from_slice(&[0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 0]);
        let extents = [Extent { length_bytes: 512, hole: true }, Extent { length_bytes: 512, hole: false }];
        assert_eq!(structured.encode_block_status(handle, 1024, false, &extents), status);
    }

    /// Extents and descriptors as text: `h512 d1024` is a 512-byte hole then 1024 bytes of data.
    fn check_descriptors(length: u32, req_one: bool, extents: &str, expected: &str) {
        let extents: Vec<Extent> = extents
            .split_whitespace()
            .map(|token| Extent { length_bytes: token[1..].parse().unwrap(), hole: token.starts_with('h') })
            .collect();
        let got: Vec<String> = block_status_descriptors(length, req_one, &extents)
            .iter()
            .map(|(length, status)| match *status {
                0 => format!("d{length}"),
                3 => format!("h{length}"),
                other => panic!("status {other}"),
            })
            .collect();
        assert_eq!(got.join(" "), expected, "length={length} req_one={req_one} extents={extents:?}");
    }

    #[test]
    #[rustfmt::skip]
    fn descriptors() {
        for (length, req_one, extents, expected) in [
            (4096, false, "h4096", "h4096"),
            (4096, false, "d1024 h3072", "d1024 h3072"),
            (4096, true, "d1024 h3072", "d1024"),
            (4096, false, "h1024 h1024 d2048", "h2048 d2048"),
            (4096, false, "d1024 d3072", "d4096"),
            // Longer than asked: cut at the request's end.
            (4096, false, "h8192", "h4096"),
            (4096, true, "h8192", "h4096"),
            // Too short: describe what is known.
            (4096, false, "d1024", "d1024"),
            (4096, false, "", "d4096"),
            (4096, false, "h0 d0", "d4096"),
            // Unaligned: partial hole blocks become data.
            (4096, false, "d100 h4000", "d512 h3584"),
            (4096, false, "h100 d3996", "d4096"),
            (4096, false, "h1000 d100 h2996", "h512 d1024 h2560"),
            (4096, false, "h100", "d512"),
            (4096, false, "h1000", "h512"),
            (4096, false, "d600 h1000 d10", "d1024 h512 d512"),
            // A request ending at an unaligned export end keeps its tail.
            (1000, false, "d100 h900", "d512 h488"),
            (1000, false, "h900 d100", "h512 d488"),
        ] {
            check_descriptors(length, req_one, extents, expected);
        }
    }

    #[test]
    fn descriptors_are_bounded() {
        let extents: Vec<Extent> = (0..10_000).map(|i| Extent { length_bytes: 512, hole: i % 2 == 0 }).collect();
        let descriptors = block_status_descriptors(u32::MAX - 511, false, &extents);
        assert_eq!(descriptors.len(), BLOCK_STATUS_DESCRIPTORS_MAX);
        let descriptors = block_status_descriptors(u32::MAX - 511, true, &extents);
        assert_eq!(descriptors, vec![(512, 3)]);
        let huge = [Extent { length_bytes: u64::MAX, hole: true }, Extent { length_bytes: u64::MAX, hole: false }];
        assert_eq!(block_status_descriptors(4096, false, &huge), vec![(4096, 3)]);
    }
}
