//! Newtypes for the identifiers that must never be mixed up on the wire or on disk.

use std::fmt;

/// Position of a write-like operation in its group's order. Sequence 0 means "nothing yet";
/// the first operation of a volume has sequence 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Sequence(pub u64);

impl Sequence {
    pub const ZERO: Sequence = Sequence(0);
    pub fn next(self) -> Sequence {
        Sequence(self.0.checked_add(1).expect("sequence space is 2^64 and never wraps"))
    }
}

impl fmt::Display for Sequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Generation of the host element that owns a group; bumped at every host element start or
/// takeover. Elements refuse operations from an epoch older than the newest they have seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identity of one host element incarnation (random, chosen at start). An element remembers
/// which host element its epoch belongs to, so two host elements can never share an epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostId(pub u64);

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Index of a volume within one host element ↔ element session (the order of `Hello::volumes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId(pub u32);

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
