//! Sans-IO replication core of the host element: sequence assignment, the write queue, quorum
//! tracking, read routing, the read cache and element states.
//!
//! Nothing here does I/O or reads a clock. Inputs arrive through `HostCore::handle_*` with the
//! current time passed in; outputs are taken with [`HostCore::poll_action`] and
//! [`HostCore::poll_timeout`]. The shell (crates/shell) carries the actions out.

mod ack_policy;
pub mod admin_request;
pub mod catalog;
mod element;
mod failure;
pub mod groups;
mod host;
pub mod latency;
pub mod limits;
pub mod mem_storage;
mod read_cache;
pub mod standby;
mod storage;
mod write_queue;

pub use ack_policy::AckPolicy;
pub use element::{
    role_refusal, CommitDone, ElementAction, ElementConfig, ElementCore, LocalVolume, LogLevel, PeerId, Refusal,
    SessionId, SessionRole, StorageDone, StorageJob, VolumeInfo,
};
pub use failure::Failure;
pub use host::{
    start_minimum_of, Action, BeginningStatus, ElementStatus, Event, HostConfig, HostCore, HostError, HostStatus,
    RecoveryKind, RecoveryStatus, Reply, ScrubFindings, ScrubReason, ScrubStatus, VolumeMode, VolumeStatus,
};
pub use read_cache::ReadCache;
pub use storage::{serve, try_serve, ElementStorage};
pub use write_queue::{Entry, WriteQueue};

use std::fmt;

/// Index of an element in the host element's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ElementId(pub u8);

impl fmt::Display for ElementId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "element#{}", self.0)
    }
}

/// A set of elements, as a bitmask (bounded by [`limits::ELEMENTS_MAX`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ElementSet(pub u64);

impl ElementSet {
    pub fn one(e: ElementId) -> ElementSet {
        let mut set = ElementSet::default();
        set.insert(e);
        set
    }
    pub fn insert(&mut self, e: ElementId) {
        self.0 |= 1 << e.0;
    }
    pub fn remove(&mut self, e: ElementId) {
        self.0 &= !(1 << e.0);
    }
    pub fn contains(self, e: ElementId) -> bool {
        self.0 & (1 << e.0) != 0
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }
    pub fn iter(self) -> impl Iterator<Item = ElementId> {
        (0..64u8).filter(move |i| self.0 & (1 << i) != 0).map(ElementId)
    }
}

/// Identifies one host request (an NBD request) so its reply can be routed back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// Time as seen by the core: microseconds since an origin the shell chooses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(pub u64);

impl Time {
    pub fn plus_ms(self, ms: u64) -> Time {
        Time(self.0.saturating_add(ms.saturating_mul(1000)))
    }
    pub fn micros_since(self, earlier: Time) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}
