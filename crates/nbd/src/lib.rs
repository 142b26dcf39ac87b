//! The NBD server protocol as a sans-IO codec: no sockets, no tasks, no clock.
//!
//! A driver feeds the client's bytes to a [`Handshake`] until it yields a [`Transmission`], then
//! decodes each 28-byte request header with [`Transmission::decode_request`] and encodes each
//! reply with the `encode_*` methods. Everything follows `doc/proto.md` of NetworkBlockDevice/nbd
//! (fixed newstyle, no TLS, no extended headers); what we implement and the limits we advertise
//! are in `docs/nbd.md`. No input makes this crate panic or allocate without bound.

// Their suggested replacements (`is_multiple_of`, `is_none_or`) are newer than our MSRV, 1.80.
#![allow(clippy::manual_is_multiple_of, clippy::unnecessary_map_or)]

mod errno;
mod handshake;
pub mod limits;
mod transmission;
pub mod wire;

pub use errno::Errno;
pub use handshake::{
    ExportInfo, Exports, Handshake, HandshakeConfig, HandshakeOutcome, BASE_ALLOCATION_CONTEXT_ID, NO_SUCH_EXPORT,
};
pub use limits::{BLOCK_SIZE_MAX_BYTES, BLOCK_SIZE_MIN_BYTES, BLOCK_SIZE_PREFERRED_BYTES, HANDSHAKE_INPUT_BYTES_MAX};
pub use transmission::{Command, CommandKind, Decoded, Extent, Rejected, Request, Transmission};
pub use wire::REQUEST_HEADER_BYTES;

/// A protocol violation after which the connection must be closed (a hard disconnect).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FatalError {
    #[error("client sent unknown handshake flags {0:#x}")]
    ClientFlags(u32),
    #[error("bad option magic {0:#018x}")]
    OptionMagic(u64),
    #[error("NBD_OPT_EXPORT_NAME with an export name longer than the spec allows")]
    ExportName,
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    #[error("NBD_OPT_EXPORT_NAME for export {name:?}, which is not open to new connections now: {reason}")]
    ExportRefused { name: String, reason: String },
    #[error("bad request magic {0:#010x}")]
    RequestMagic(u32),
    #[error("NBD_OPT_EXPORT_NAME before TLS on a server that requires TLS")]
    TlsRequired,
}
