//! Every bound of the NBD codec in one place, with their relations checked at compile time.

use crate::wire::OPTION_HEADER_BYTES;

/// Smallest addressable unit we advertise (`NBD_INFO_BLOCK_SIZE` minimum): offsets and lengths
/// must be multiples of it.
pub const BLOCK_SIZE_MIN_BYTES: u32 = 512;

/// Preferred I/O size we advertise: aligned requests of this size avoid read-modify-write.
pub const BLOCK_SIZE_PREFERRED_BYTES: u32 = 4096;

/// Largest `NBD_CMD_READ` / `NBD_CMD_WRITE` we accept (advertised maximum block size). One such
/// request is one record of the replication protocol.
pub const BLOCK_SIZE_MAX_BYTES: u32 = 32 * 1024 * 1024;

/// Longest string (export name, description, metadata context query) the spec allows.
pub const STRING_BYTES_MAX: usize = 4096;

/// Largest option payload we read into memory. Known options with more data are skipped without
/// being buffered and answered `NBD_REP_ERR_TOO_BIG`; unknown options are always skipped.
pub const OPTION_DATA_BYTES_MAX: u32 = 16 * 1024;

/// Most bytes the handshake ever needs buffered before it can make progress: one option header
/// plus its data. A caller whose buffer holds this many bytes is guaranteed consumption.
pub const HANDSHAKE_INPUT_BYTES_MAX: usize = OPTION_HEADER_BYTES + OPTION_DATA_BYTES_MAX as usize;

/// Most descriptors in one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk; the spec lets a server describe
/// less than was asked, and the client asks again from where the reply stopped.
pub const BLOCK_STATUS_DESCRIPTORS_MAX: usize = 1024;

/// Longest human-readable message in an error reply (must fit the 16-bit length field).
pub const ERROR_MESSAGE_BYTES_MAX: usize = 4096;

const _: () = assert!(BLOCK_SIZE_MIN_BYTES.is_power_of_two());
const _: () = assert!(BLOCK_SIZE_MIN_BYTES <= 65536);
const _: () = assert!(BLOCK_SIZE_PREFERRED_BYTES.is_power_of_two());
const _: () = assert!(BLOCK_SIZE_PREFERRED_BYTES >= BLOCK_SIZE_MIN_BYTES);
const _: () = assert!(BLOCK_SIZE_PREFERRED_BYTES >= 512);
const _: () = assert!(BLOCK_SIZE_MAX_BYTES % BLOCK_SIZE_MIN_BYTES == 0);
const _: () = assert!(BLOCK_SIZE_MAX_BYTES >= BLOCK_SIZE_PREFERRED_BYTES);
const _: () = assert!(BLOCK_SIZE_MAX_BYTES >= 1024 * 1024);
// A structured read reply is one OFFSET_DATA chunk: 8 bytes of offset plus the data must fit the
// 32-bit chunk length.
const _: () = assert!(BLOCK_SIZE_MAX_BYTES as u64 + 8 <= u32::MAX as u64);
// NBD_OPT_GO / NBD_OPT_INFO with the longest name and every information type we know fits, and so
// does a metadata context request with a longest name and a few longest queries.
const _: () = assert!(OPTION_DATA_BYTES_MAX as usize >= 4 + STRING_BYTES_MAX + 2 + 2 * 16);
const _: () = assert!(OPTION_DATA_BYTES_MAX as usize >= 8 + 3 * (4 + STRING_BYTES_MAX));
const _: () = assert!(ERROR_MESSAGE_BYTES_MAX <= u16::MAX as usize);
const _: () = assert!(BLOCK_STATUS_DESCRIPTORS_MAX >= 1);
