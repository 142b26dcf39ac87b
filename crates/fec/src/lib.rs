//! Forward error correction for the far link (SMFS), sans-IO: a sender cuts its stream of
//! messages into groups of up to `r` data packets and adds `c` systematic Reed–Solomon repair
//! packets per group; a receiver rebuilds up to `c` lost packets of a group from the others,
//! delivers the messages in order, and names what it could not rebuild so the sender can send
//! it again. A pacer spaces packets to the link's rate. No sockets and no clock here: the
//! shell sends the packets (UDP), feeds what arrives, and passes the time in.
//!
//! The erasure code sits behind [`ErasureCode`]; [`GaloisCode`] is `reed-solomon-erasure`'s.

mod code;
mod group;
pub mod link;
mod pacer;

pub use code::{ErasureCode, GaloisCode};
pub use group::{Decoder, Encoder, FecError, Packet, PacketKind};
pub use link::{Datagram, Link, LinkConfig, LinkState, LinkStats};
pub use pacer::Pacer;

/// The paper's default: 8 data packets and 3 repair packets per group.
pub const DEFAULT_DATA_PER_GROUP: u8 = 8;
pub const DEFAULT_REPAIR_PER_GROUP: u8 = 3;
