//! Why the host element counts an element as failed: one enum for the core, its events, the
//! status (as text, through `Display`) and the simulator's checkers (by variant).

use std::fmt;

use proto::{Epoch, Sequence};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No session yet since the host element started.
    NotConnectedYet,
    CannotConnect(String),
    /// A live session ended.
    ConnectionLost(String),
    /// The session ended before the element was admitted.
    HandshakeLost(String),
    HandshakeTimeout {
        silent_ms: u64,
    },
    HeartbeatTimeout {
        silent_ms: u64,
    },
    /// The element refused the session (e.g. it follows a newer epoch).
    SessionRefused(String),
    /// The element reported a fault (a refused record, a failed commit, …).
    Fault(String),
    /// The element has seen a newer host element's epoch.
    Fenced {
        seen: Epoch,
        ours: Epoch,
    },
    /// The element broke the protocol.
    Protocol(String),
    /// Starting, this host element learned of a newer epoch and raised its own above it: the
    /// session is redone with the new epoch.
    EpochRaised(Epoch),
    /// The same element (by the identity it keeps on disk) is already configured under
    /// another name: it would count twice toward the quorum.
    SameElementAs(String),
    /// Its replay log could not be read for the start-up roll forward.
    LogFetchFailed(String),
    /// A read the element served failed (e.g. a block failed its checksum).
    ReadFailed(String),
    /// A read's data did not match the checksums the element sent with it: the read goes to
    /// another element, and a scrub of the blocks it read compares the replicas.
    ReadChecksum(String),
    /// A scrub found blocks of `volume` where it differs from the other replicas: a full
    /// recovery (which copies only the blocks that differ) repairs it when it reconnects.
    ScrubMismatch {
        volume: String,
        blocks: u64,
        first_block: u64,
    },
    /// A clone created while the session ran found no snapshot to share here (the element has
    /// not taken it yet): it is created empty, and a full recovery copies it when the element
    /// reconnects.
    CloneNeedsCopy {
        volume: String,
    },
    /// The write queue stayed full waiting for it.
    TooSlow {
        volume: String,
        waited_ms: u64,
        sequence: Sequence,
        behind: u64,
    },
    /// It cannot be brought back by the recovery this host element can run now (the copy
    /// passes ran out, or a copy ended where no peer's replay log covers the rest). An element
    /// that needs a copy no peer can serve yet is not failed: it waits, recovering.
    Unrecoverable {
        reason: String,
    },
    /// A full recovery failed and no other peer can serve it; it resumes at the next session.
    CopyFailed {
        source: String,
        reason: String,
    },
}

impl Failure {
    /// A short name of the kind of failure (the metrics' `reason` label).
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::NotConnectedYet => "not_connected_yet",
            Failure::CannotConnect(_) => "cannot_connect",
            Failure::ConnectionLost(_) => "connection_lost",
            Failure::HandshakeLost(_) => "handshake_lost",
            Failure::HandshakeTimeout { .. } => "handshake_timeout",
            Failure::HeartbeatTimeout { .. } => "heartbeat_timeout",
            Failure::SessionRefused(_) => "refused",
            Failure::Fault(_) => "fault",
            Failure::Fenced { .. } => "fenced",
            Failure::Protocol(_) => "protocol",
            Failure::EpochRaised(_) => "epoch_raised",
            Failure::SameElementAs(_) => "same_element",
            Failure::LogFetchFailed(_) => "log_fetch_failed",
            Failure::ReadFailed(_) => "read_failed",
            Failure::ReadChecksum(_) => "read_checksum",
            Failure::ScrubMismatch { .. } => "scrub_mismatch",
            Failure::CloneNeedsCopy { .. } => "clone_needs_copy",
            Failure::TooSlow { .. } => "too_slow",
            Failure::Unrecoverable { .. } => "unrecoverable",
            Failure::CopyFailed { .. } => "copy_failed",
        }
    }

    /// Failures of the reconnect loop itself, which say nothing about why an element keeps
    /// failing.
    pub fn is_transient(&self) -> bool {
        matches!(self, Failure::CannotConnect(_) | Failure::ConnectionLost(_) | Failure::HandshakeLost(_))
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NotConnectedYet => write!(f, "not connected yet"),
            Failure::CannotConnect(reason) => write!(f, "cannot connect: {reason}"),
            Failure::ConnectionLost(reason) => write!(f, "connection lost: {reason}"),
            Failure::HandshakeLost(reason) => write!(f, "connection lost during the handshake: {reason}"),
            Failure::HandshakeTimeout { silent_ms } => write!(f, "no answer to the handshake for {silent_ms} ms"),
            Failure::HeartbeatTimeout { silent_ms } => write!(f, "no heartbeat for {silent_ms} ms"),
            Failure::SessionRefused(reason) => write!(f, "refused the session: {reason}"),
            Failure::Fault(reason) => write!(f, "fault: {reason}"),
            Failure::Fenced { seen, ours } => {
                write!(f, "fenced: the element has seen epoch {seen}, newer than ours ({ours}); another host element owns it")
            }
            Failure::Protocol(what) => write!(f, "protocol: {what}"),
            Failure::EpochRaised(epoch) => write!(f, "reconnecting to offer the newer epoch {epoch}"),
            Failure::SameElementAs(other) => write!(
                f,
                "it is the same element as {other} (same identity on disk): one copy must not count twice toward the quorum"
            ),
            Failure::ReadFailed(reason) => write!(f, "read failed: {reason}"),
            Failure::ReadChecksum(reason) => write!(f, "read data damaged on the way: {reason}"),
            Failure::CloneNeedsCopy { volume } => write!(
                f,
                "volume {volume} is a clone of a snapshot this element does not hold yet: a full recovery copies it"
            ),
            Failure::ScrubMismatch { volume, blocks, first_block } => write!(
                f,
                "scrub: volume {volume}: {blocks} block(s) (first {first_block}) differ from the other replicas; a full recovery repairs them"
            ),
            Failure::LogFetchFailed(reason) => write!(f, "could not read its replay log: {reason}"),
            Failure::TooSlow { volume, waited_ms, sequence, behind } => write!(
                f,
                "too slow: volume {volume} write queue full for {waited_ms} ms waiting for it to acknowledge sequence {sequence} ({behind} writes behind)"
            ),
            Failure::Unrecoverable { reason, .. } => write!(f, "{reason}"),
            Failure::CopyFailed { source, reason } => {
                write!(f, "full recovery from {source} failed: {reason} (it resumes when the element reconnects)")
            }
        }
    }
}
