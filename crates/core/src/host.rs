//! The host element's replication state machine.
//!
//! It owns, per volume, the sequence counter and the write queue; per element, its state
//! (in sync, recovering, failed) and what it has acknowledged. Writes are answered once a write
//! quorum of in-sync elements has applied them durably; reads go to the read cache or to the
//! closest in-sync element, with the write queue overlaid on what that element has not applied.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;
use proto::{
    BlockExtent, ElementMessage, Epoch, HostId, HostMessage, Op, ReadData, Record, Sequence, SnapshotRef, VolumeId,
    VolumeSpec, VolumeState, BLOCK_BYTES,
};

use crate::ack_policy::AckPolicy;
use crate::failure::Failure;
use crate::latency::LatencyHistogram;
use crate::limits;
use crate::read_cache::ReadCache;
use crate::write_queue::{Entry, HostReply, WriteQueue};
use crate::{ElementId, ElementSet, Time, Token};

#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The first epoch this host element offers. Elements that follow an epoch at least as new
    /// refuse it and say which, and a starting host element raises its own above it, so the
    /// epoch does not depend on any clock.
    pub epoch: Epoch,
    /// This host element's identity (random per start): elements refuse an epoch they follow
    /// for another host element, so two host elements never share one.
    pub host_id: HostId,
    pub quorum: usize,
    pub elements: Vec<String>,
    /// Per element, in the order of `elements`: what its acknowledgement of a write means
    /// before it counts toward the quorum.
    pub ack_policies: Vec<AckPolicy>,
    /// Storage volumes: each a volume of its own, or a consistency group holding its member
    /// volumes (see `crate::groups`).
    pub volumes: Vec<VolumeSpec>,
    /// The volumes exported over NBD, each a range of a storage volume; empty: every storage
    /// volume exported whole under its own name (no groups). See [`HostConfig::exported`].
    pub exports: Vec<crate::groups::ExportedVolume>,
    pub write_queue_bytes: u64,
    pub read_cache_bytes: u64,
    pub throttle_timeout_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub heartbeat_timeout_ms: u64,
    pub startup_grace_ms: u64,
    /// How long requests that arrive before the host element is ready are held; then they
    /// (and later ones, until it is ready) fail with EIO.
    pub startup_timeout_ms: u64,
    /// Element addresses as elements reach each other (for replay recovery between peers), in
    /// the order of `elements`; empty disables replay recovery.
    pub element_addresses: Vec<String>,
    /// Pace of recovery traffic per recovering volume (0: unlimited).
    pub recovery_rate_bytes_per_s: u64,
    /// Raise the epoch above what a refusing element follows while starting. Off only in the
    /// simulator's deliberately broken variant (`--broken clock-epochs`), which its checkers
    /// must catch.
    pub raise_epoch: bool,
    /// This host element's admin address, told to the elements in the hello (a standby that
    /// observes them learns where the active one is).
    pub admin: String,
    /// Answer reads only under the read lease (see `lease_held`). Off only in the simulator's
    /// deliberately broken variant (`--broken no-read-lease`), which its checkers must catch.
    pub read_lease: bool,
    /// Bound the reads out at each element (`limits::READ_WINDOW_MS`). Off only in the
    /// simulator's deliberately broken variant (`--broken unbounded-reads`), which its checkers
    /// must catch (a lease lost behind a backlog of read replies).
    pub read_window: bool,
    /// Scrub every volume this often (0: never by itself), at most this fast.
    pub scrub_interval_ms: u64,
    pub scrub_rate_bytes_per_s: u64,
    /// A scrub fails the elements whose blocks differ from the majority's, so that a full
    /// recovery repairs them. Off only in the simulator's deliberately broken variant
    /// (`--broken no-scrub-repair`), which its checkers must catch.
    pub scrub_repair: bool,
    /// A FLUSH waits until Q elements hold every earlier write durably. Off only in the
    /// simulator's deliberately broken variant (`--broken flush-before-durable`).
    pub flush_waits_for_durable: bool,
    /// A host element that becomes ready appends a beginning record (`Op::Begin`) to every
    /// volume, and answers reads of the volume once Q elements hold it durably. Off only in
    /// the simulator's deliberately broken variant (`--broken no-begin`), which its checkers
    /// must catch.
    pub begin_records: bool,
    /// While no element is in sync, a copy comes only from a peer the write queue streams the
    /// volume to (it holds the volume on the current history). Off only in the simulator's
    /// deliberately broken variant (`--broken any-copy-source`): any live peer serves, even one
    /// whose copy of the volume diverged, is ahead, or is to be copied itself.
    pub copy_source_check: bool,
}

impl HostConfig {
    pub fn new(epoch: Epoch, quorum: usize, elements: Vec<String>, volumes: Vec<VolumeSpec>) -> Self {
        HostConfig {
            epoch,
            host_id: HostId(1),
            quorum,
            ack_policies: vec![AckPolicy::Durable; elements.len()],
            elements,
            volumes,
            exports: Vec::new(),
            write_queue_bytes: limits::WRITE_QUEUE_BYTES_DEFAULT,
            read_cache_bytes: limits::READ_CACHE_BYTES_DEFAULT,
            throttle_timeout_ms: limits::THROTTLE_TIMEOUT_MS_DEFAULT,
            heartbeat_interval_ms: limits::HEARTBEAT_INTERVAL_MS_DEFAULT,
            heartbeat_timeout_ms: limits::HEARTBEAT_TIMEOUT_MS_DEFAULT,
            startup_grace_ms: limits::STARTUP_GRACE_MS_DEFAULT,
            startup_timeout_ms: limits::STARTUP_TIMEOUT_MS_DEFAULT,
            element_addresses: Vec::new(),
            recovery_rate_bytes_per_s: 0,
            raise_epoch: true,
            admin: String::new(),
            read_lease: true,
            read_window: true,
            scrub_interval_ms: limits::SCRUB_INTERVAL_MS_DEFAULT,
            scrub_rate_bytes_per_s: limits::SCRUB_RATE_BYTES_PER_S_DEFAULT,
            scrub_repair: true,
            flush_waits_for_durable: true,
            begin_records: true,
            copy_source_check: true,
        }
    }

    /// The volumes exported over NBD (the storage volumes themselves when no groups are
    /// configured).
    pub fn exported(&self) -> Vec<crate::groups::ExportedVolume> {
        if self.exports.is_empty() {
            crate::groups::ungrouped(&self.volumes)
        } else {
            self.exports.clone()
        }
    }

    /// Boundary check of a configuration; the message is meant for the operator.
    /// Serve storage volume `spec` too, exported whole as `name`.
    fn add_whole_volume(&mut self, name: String, spec: VolumeSpec) {
        if self.exports.is_empty() {
            self.exports = crate::groups::ungrouped(&self.volumes);
        }
        let volume = self.volumes.len();
        let size_bytes = spec.size_bytes;
        let snapshot = None;
        self.exports.push(crate::groups::ExportedVolume {
            name,
            group: None,
            volume,
            offset_bytes: 0,
            size_bytes,
            snapshot,
        });
        self.volumes.push(spec);
    }

    /// Export `member`, which joined a consistency group while running, as a window of the
    /// group's storage volume, growing that to hold it; the storage volume's index. Refused
    /// (changing nothing) if no configured group of that name is carried by that storage
    /// volume, or if the name is taken or the window overlaps another member.
    fn add_member(&mut self, member: &crate::groups::JoinedMember) -> Result<usize, String> {
        let crate::groups::JoinedMember { name, group, storage, offset_bytes, size_bytes } = member;
        let Some(i) = self.volumes.iter().position(|v| &v.name == storage && v.size_bytes > 0) else {
            return Err(format!(
                "volume {name} joined consistency group {group} carried by storage volume {storage}, which is not served (was the group's configured membership changed?)"
            ));
        };
        let exported = self.exported();
        if !exported.iter().any(|e| e.volume == i && e.snapshot.is_none() && e.group.as_deref() == Some(group)) {
            return Err(format!("storage volume {storage} carries no consistency group {group}"));
        }
        let taken = exported.iter().any(|e| &e.name == name || e.group.as_deref() == Some(name.as_str()))
            || self.volumes.iter().any(|v| &v.name == name);
        if taken {
            return Err(format!("a volume named {name} exists"));
        }
        let end = offset_bytes.checked_add(*size_bytes).filter(|&end| end <= crate::catalog::VOLUME_BYTES_MAX);
        let Some(end) = end else { return Err(format!("volume {name} lies beyond the largest volume")) };
        let mut volumes = self.volumes.clone();
        volumes[i].size_bytes = volumes[i].size_bytes.max(end);
        let mut exports = exported;
        exports.push(crate::groups::ExportedVolume {
            name: name.clone(),
            group: Some(group.clone()),
            volume: i,
            offset_bytes: *offset_bytes,
            size_bytes: *size_bytes,
            snapshot: None,
        });
        crate::groups::check_exports(&volumes, &exports)?;
        self.volumes = volumes;
        self.exports = exports;
        Ok(i)
    }

    /// Keep storage volume `name` as a placeholder (size 0, not exported): a volume removed
    /// while an earlier host element ran, whose removal some element has not confirmed yet.
    /// Its hello tells every element to remove it.
    fn add_placeholder(&mut self, name: String) {
        if self.exports.is_empty() {
            self.exports = crate::groups::ungrouped(&self.volumes);
        }
        self.volumes.push(VolumeSpec { name, size_bytes: 0, clone_of: None, at_least: false });
    }

    pub fn validate(&self) -> Result<(), String> {
        let n = self.elements.len();
        if n == 0 || n > limits::ELEMENTS_MAX {
            return Err(format!("need 1 to {} elements, got {n}", limits::ELEMENTS_MAX));
        }
        if self.quorum == 0 || self.quorum > n {
            return Err(format!("quorum must be between 1 and the number of elements ({n}), got {}", self.quorum));
        }
        if self.ack_policies.len() != n {
            return Err(format!("{} ack policies for {n} elements", self.ack_policies.len()));
        }
        let counting = self.ack_policies.iter().filter(|p| p.counts_toward_quorum()).count();
        if counting < self.quorum {
            return Err(format!(
                "quorum {} needs at least {} elements that count toward it; only {counting} are not local-sync",
                self.quorum, self.quorum
            ));
        }
        // The host element serves the catalog of volumes created while running as one more
        // storage volume (`catalog::CATALOG_VOLUME`, added at start): what an operator
        // configures must leave it room (a second catalog is refused below, as any name
        // configured twice).
        let configured = self.volumes.iter().filter(|v| v.name != crate::catalog::CATALOG_VOLUME).count();
        if configured == 0 || configured > limits::VOLUMES_MAX - 1 {
            return Err(format!(
                "need 1 to {} volumes (one more is the catalog of volumes created while running), got {configured}",
                limits::VOLUMES_MAX - 1
            ));
        }
        for (i, v) in self.volumes.iter().enumerate() {
            if v.name.is_empty() || v.name.len() > 255 {
                return Err(format!("volume name {:?} must be 1 to 255 bytes", v.name));
            }
            let placeholder = v.size_bytes == 0 && self.exports.iter().all(|e| e.volume != i);
            if (v.size_bytes == 0 && !placeholder) || v.size_bytes % proto::BLOCK_BYTES != 0 {
                return Err(format!(
                    "volume {} size {} must be a positive multiple of {} bytes",
                    v.name,
                    v.size_bytes,
                    proto::BLOCK_BYTES
                ));
            }
            if self.volumes[..i].iter().any(|w| w.name == v.name) {
                return Err(format!("volume {} is configured twice", v.name));
            }
        }
        for (i, e) in self.elements.iter().enumerate() {
            if self.elements[..i].contains(e) {
                return Err(format!("element {e} is configured twice"));
            }
        }
        if !self.exports.is_empty() {
            crate::groups::check_exports(&self.volumes, &self.exports)?;
        }
        if self.write_queue_bytes < limits::WRITE_QUEUE_BYTES_MIN {
            return Err(format!(
                "write queue of {} bytes cannot hold one maximal write; need at least {}",
                self.write_queue_bytes,
                limits::WRITE_QUEUE_BYTES_MIN
            ));
        }
        if !self.element_addresses.is_empty() && self.element_addresses.len() != n {
            return Err("element addresses must be given for every element or none".into());
        }
        for (i, a) in self.element_addresses.iter().enumerate() {
            if let Some(j) = self.element_addresses[..i].iter().position(|b| b == a) {
                return Err(format!(
                    "elements {} and {} have the same address {a}: one copy would count twice toward the quorum",
                    self.elements[j], self.elements[i]
                ));
            }
        }
        if self.startup_timeout_ms < self.startup_grace_ms {
            return Err("the start-up timeout must be at least the start-up grace period".into());
        }
        if self.epoch == Epoch(0) {
            return Err("the first epoch offered must be at least 1".into());
        }
        if self.host_id == HostId(0) {
            return Err("host element identity 0 is reserved".into());
        }
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms {
            return Err("heartbeat timeout must exceed the heartbeat interval".into());
        }
        Ok(())
    }
}

/// Errors returned to the host for one request; the shell maps them to NBD errors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostError {
    /// Fewer than Q elements are in sync: the volume only serves reads (NBD EPERM).
    ReadOnly,
    /// The write was sent but the volume lost its quorum before Q elements held it (EIO).
    QuorumLost,
    /// No in-sync element can serve the read (EIO).
    Unavailable,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Read(Result<Bytes, HostError>),
    Done(Result<(), HostError>),
    BlockStatus(Result<Vec<BlockExtent>, HostError>),
    /// Answer to [`HostCore::check_volumes`]: every live element has room, or why not.
    Checked(Result<(), String>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeMode {
    ReadWrite,
    ReadOnly,
    /// Starting: requests are held until enough elements answered (at most the start-up
    /// timeout).
    Starting,
    /// The start-up timeout passed without enough elements: requests fail at once (EIO) until
    /// they answer.
    Unavailable,
}

impl VolumeMode {
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeMode::ReadWrite => "read-write",
            VolumeMode::ReadOnly => "read-only",
            VolumeMode::Starting => "starting",
            VolumeMode::Unavailable => "unavailable",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecoveryKind {
    /// The gap is in the host element's write queue, which streams it.
    Quick,
    /// The gap is older: the element pulls it from a peer's replay log, then continues quick.
    Replay,
    /// No replay log covers the gap (or the element's history diverged, or its disk is new):
    /// the element copies the blocks that differ from a peer, then replays from there.
    Full,
}

impl RecoveryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryKind::Quick => "quick",
            RecoveryKind::Replay => "replay",
            RecoveryKind::Full => "full",
        }
    }
}

/// Something worth a log line; the shell logs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Ready {
        volume: VolumeId,
        last: Sequence,
    },
    ElementFailed {
        element: ElementId,
        reason: Failure,
    },
    RecoveryStarted {
        element: ElementId,
        kind: RecoveryKind,
        records: u64,
        source: Option<ElementId>,
        /// A volume's history diverged from ours (its newest record is of another epoch than
        /// ours at that sequence): that volume is copied, never brought forward by records.
        diverged: bool,
    },
    RecoveryProgress {
        element: ElementId,
        message: String,
    },
    ElementInSync {
        element: ElementId,
    },
    VolumeMode {
        volume: VolumeId,
        mode: VolumeMode,
        in_sync: usize,
    },
    Throttled {
        volume: VolumeId,
    },
    /// An element followed an epoch (`seen`) whose owner is gone, and a majority were free
    /// (followed ours, or an epoch whose owner is gone): this host element started over with
    /// epoch `to`, serving the configured volumes only. The driver reads the catalog again and
    /// adds its volumes with `restart_with_volumes`, as at start-up.
    Restarted {
        from: Epoch,
        to: Epoch,
        refused_by: ElementId,
        seen: Epoch,
    },
    /// A majority of elements follow a newer epoch than ours: this host element no longer
    /// serves (every request fails with EIO).
    Superseded {
        ours: Epoch,
        seen: Epoch,
    },
    /// With ack policies weaker than durable, fewer than Q elements held this host element's
    /// beginning record of `volume` (at `sequence`) durably when the start-up timeout passed:
    /// its `reads` held reads, and later ones, are served all the same. Until Q hold it, a
    /// later start without those that do may bring back a weakly acknowledged write that this
    /// host element's start did without (and reads now do not show).
    BeginNotHeld {
        volume: VolumeId,
        sequence: Sequence,
        held: usize,
        reads: usize,
    },
    /// Not ready when the start-up timeout passed: held requests failed.
    StartupTimedOut {
        welcomed: usize,
        /// Of those, the ones being copied (a full recovery interrupted): they hold nothing
        /// of a volume they copy, so they do not count for it.
        copying: usize,
    },
    /// Starting, an element followed an epoch at least as new as ours: ours is now `to`.
    EpochRaised {
        from: Epoch,
        to: Epoch,
        refused_by: ElementId,
    },
    /// A scrub of `volume` ended.
    ScrubDone {
        volume: VolumeId,
        status: ScrubStatus,
    },
    /// A volume added while running (`add_volumes`) exists on Q elements that count toward
    /// the quorum (told once per volume).
    VolumeCreated {
        volume: VolumeId,
    },
    /// A volume removed while running (`remove_volumes`) is gone from every element that was
    /// live when this was told (`everywhere: false`), or from every configured element
    /// (`everywhere: true`, perhaps much later: an element that was down removes it when it
    /// comes back). Each told at most once; only the second if both hold at once.
    VolumeRemoved {
        volume: VolumeId,
        everywhere: bool,
    },
    /// A volume grown while running (`resize_volume`) has its new size on Q elements that
    /// count toward the quorum (told once per resize).
    VolumeResized {
        volume: VolumeId,
        size_bytes: u64,
    },
    /// An element could not answer a read of snapshot `id` of `volume` (it does not hold it,
    /// or its copy failed a checksum): the read goes to another element.
    SnapshotReadRefused {
        volume: VolumeId,
        element: ElementId,
        id: u64,
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send one message to every element in the set (encode once).
    Send {
        to: ElementSet,
        message: HostMessage,
    },
    /// Close the session with this element; the shell reconnects later.
    Disconnect {
        element: ElementId,
    },
    Reply {
        token: Token,
        reply: Reply,
    },
    Event(Event),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum ElementState {
    InSync,
    Recovering(RecoveryKind),
    Failed(Failure),
}

/// How one volume of a recovering element catches up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum VolumeRecovery {
    /// The write queue streams to it (or it is in sync).
    Streaming,
    /// It pulls its gap from a peer's replay log: the queue sends it only the writes after
    /// the pull's `through` and does not wait for it, until its sequence is back within what
    /// the queue holds.
    Replaying,
    /// It copies blocks from a peer (full recovery; the peer is in `copy_source`): the queue
    /// sends it nothing and does not wait for it.
    Copying,
    /// It needs a copy (or a replay, which a copy replaces), and no peer can serve one yet: no
    /// peer is in sync, and none holds the volume on the current history. It holds nothing the
    /// queue counts on, as a copy, and waits connected, so that it can serve its other volumes
    /// to peers that need them; the copy starts once a peer can serve it
    /// (`HostCore::start_waiting_copies`).
    AwaitingSource,
}

impl VolumeRecovery {
    /// The write queue neither streams to it in order nor waits for it.
    fn off_queue(self) -> bool {
        self != VolumeRecovery::Streaming
    }

    /// Its blocks are to be copied, or are being copied: it holds nothing the queue counts on,
    /// and takes no records.
    fn copies(self) -> bool {
        matches!(self, VolumeRecovery::Copying | VolumeRecovery::AwaitingSource)
    }
}

#[derive(Clone, Debug)]
struct Recovery {
    kind: RecoveryKind,
    /// The peer a replay pulls from.
    source: Option<ElementId>,
    started: Time,
    /// Per volume, what the element held when recovery began.
    start: Vec<Sequence>,
    /// Block content received by finished copy passes.
    copied_bytes: u64,
}

#[derive(Clone, Debug)]
struct LastRecovery {
    kind: RecoveryKind,
    records: u64,
    copied_bytes: u64,
    micros: u64,
}

#[derive(Debug)]
struct ElementRuntime {
    name: String,
    state: ElementState,
    /// A transport session exists (Hello sent).
    session: bool,
    /// The session's Welcome has been processed.
    welcomed: bool,
    welcome: Option<Vec<VolumeState>>,
    /// Per volume: highest sequence the element has durably applied (cumulative ack).
    applied: Vec<Sequence>,
    /// Per volume: highest sequence sent in this session.
    sent_through: Vec<Sequence>,
    rtt_us: Option<u64>,
    last_heard: Time,
    next_ping: Time,
    recovery: Option<Recovery>,
    last_recovery: Option<LastRecovery>,
    /// Per volume: how it catches up (see [`VolumeRecovery`]).
    volume_recovery: Vec<VolumeRecovery>,
    /// Peers that could not serve this element's replay (their log no longer holds its gap,
    /// or they failed mid-way); cleared when a recovery completes.
    replay_tried: ElementSet,
    /// Per volume: the copy's last progress report (done bytes, total bytes, copied bytes).
    copy_progress: Vec<(u64, u64, u64)>,
    /// Per volume: the peer its copy was ordered from, while it is `Copying`.
    copy_source: Vec<Option<ElementId>>,
    /// Per volume waiting for a copy: the sequence a repair holds, if its welcome said
    /// `repair` and that sequence is on the current history where the write queue covers what
    /// follows it. Its element's store serves copies of its intact blocks if it made the
    /// repair itself (`copy_source`).
    repair_held: Vec<Option<Sequence>>,
    /// Copy passes since the element last was in sync: a pass whose replay the peers' logs no
    /// longer cover starts another one, up to `COPY_PASSES_MAX`.
    copy_passes: u32,
    /// The current session ended in a failure with a reason of its own.
    failed_in_session: bool,
    /// Latency of its acknowledgements that count under its ack policy (durable: applied;
    /// received, network-sync: the weaker one), from each write's sequence assignment, while
    /// in sync.
    ack_latency: LatencyHistogram,
    /// Its failures so far, per kind (`Failure::kind`).
    failures: BTreeMap<&'static str, u64>,
    /// The identity it reported (kept across sessions): a second configured element with the
    /// same identity is the same disk and is refused.
    identity: Option<u64>,
    /// The epoch it said it follows (welcome: ours; pong; refusal), and when.
    follows: Option<(Epoch, Time)>,
    /// With `follows`: how long no session of that epoch had been open at the element.
    owner_absent_ms: u64,
    /// With `follows`: the epoch is ours, taken for us (a welcome, a pong of our session).
    follows_ours: bool,
    /// The element promised (in a pong of our epoch) to welcome no other host element's epoch
    /// before this, on our clock with the margin taken off.
    lease_until: Time,
    /// Reply bytes of the reads out at it (`PendingRead::reply_bytes`).
    read_bytes_out: u64,
    /// What its read replies delivered, bytes per second, a moving average; `None` before the
    /// first measure. A reply took its link from when it was sent or the reply before it
    /// arrived, whichever is later (reads out all along), to its arrival; replies that arrive
    /// together are measured together, over at least `READ_RATE_SAMPLE_US_MIN`.
    read_rate: Option<u64>,
    /// When its last read reply arrived, while more reads were out.
    last_read_reply: Option<Time>,
    /// A measure under way: its start, and the reply bytes since.
    read_sample: Option<(Time, u64)>,
    /// Per volume: a scrub found blocks where it differs from the other replicas; its next
    /// session repairs the volume by a full recovery.
    scrub_repair: Vec<bool>,
    /// Per volume: the highest sequence a weaker acknowledgement (see `Entry::weak_by`) came
    /// for in this session.
    weak_through: Vec<Sequence>,
    /// How many volumes its session numbers: those of its hello, then each `AddVolumes`
    /// answered. `adding` holds the counts of those sent and not answered yet, oldest first.
    session_volumes: usize,
    adding: VecDeque<usize>,
    /// `ResizeVolumes` sent in this session and not answered yet: while there are some, its
    /// welcome does not say it holds the new sizes (its hello named the old ones).
    resizes_unanswered: usize,
    /// The volumes its hello named by placeholders (removed): its welcome says it holds them
    /// no more.
    hello_removed: Vec<usize>,
}

impl ElementRuntime {
    fn live(&self) -> bool {
        matches!(self.state, ElementState::InSync | ElementState::Recovering(_))
    }

    /// Failed in this session, whose end the shell has been asked for: nothing more to time
    /// out (else every timeout until the shell closes it would fail it again).
    fn closing(&self) -> bool {
        self.failed_in_session && matches!(self.state, ElementState::Failed(_))
    }
}

#[derive(Debug)]
struct PendingWrite {
    token: Token,
    op: Op,
}

#[derive(Debug)]
struct VolumeRuntime {
    spec: VolumeSpec,
    mode: VolumeMode,
    queue: WriteQueue,
    /// Every entry up to here has had its host reply resolved.
    host_resolved: Sequence,
    /// Highest sequence acknowledged to the host as written.
    host_acked: Sequence,
    admission: VecDeque<PendingWrite>,
    blocked_since: Option<Time>,
    flushes: VecDeque<(Sequence, Token)>,
    /// Every entry up to here is durable on Q in-sync elements (or gone from the queue, which
    /// every live element applied first): what a FLUSH waits for.
    durable_through: Sequence,
    scrubs: scrub::VolumeScrubs,
    /// Added while running: the elements whose session created it, until Q that count have
    /// (then `None`, and `Event::VolumeCreated` told).
    creating: Option<ElementSet>,
    /// Removed while running (`remove_volumes`): a placeholder of size 0 that keeps its
    /// number. The elements known to hold it no more, and whether each event was told.
    removed: Option<Removal>,
    /// Grown while running (`resize_volume`): the elements known to hold the new size, until
    /// Q that count do (then `None`, and `Event::VolumeResized` told).
    resizing: Option<ElementSet>,
    /// This host element's beginning record (`Op::Begin`), appended when it became ready, with
    /// ack policies weaker than durable (`begin_guards_reads`; else `None`): reads of the
    /// volume wait until Q elements hold it durably (see `reads_wait_for_begin`). Kept until
    /// they do, or until it matters no more.
    begin: Option<Beginning>,
}

/// A volume's beginning record, not yet known to be held by Q elements.
#[derive(Clone, Copy, Debug)]
struct Beginning {
    sequence: Sequence,
    /// When it was appended.
    since: Time,
    /// The start-up timeout passed with fewer than Q holders: reads no longer wait for it,
    /// and `Event::BeginNotHeld` was told.
    overdue: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct Removal {
    confirmed: ElementSet,
    told_live: bool,
    told_everywhere: bool,
}

impl VolumeRuntime {
    /// A volume with nothing written yet in this host element (its write queue empty).
    fn new(spec: VolumeSpec, mode: VolumeMode, write_queue_bytes: u64) -> VolumeRuntime {
        VolumeRuntime {
            spec,
            mode,
            queue: WriteQueue::new(write_queue_bytes, Sequence::ZERO, Epoch(0)),
            host_resolved: Sequence::ZERO,
            host_acked: Sequence::ZERO,
            admission: VecDeque::new(),
            blocked_since: None,
            flushes: VecDeque::new(),
            durable_through: Sequence::ZERO,
            scrubs: scrub::VolumeScrubs::default(),
            creating: None,
            removed: None,
            resizing: None,
            begin: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadKind {
    Data { length_bytes: u32 },
    BlockStatus { length_bytes: u64 },
}

#[derive(Debug)]
struct PendingRead {
    token: Token,
    volume: VolumeId,
    offset_bytes: u64,
    kind: ReadKind,
    element: ElementId,
    attempts: u32,
    /// A read of this snapshot of the volume, not of the volume.
    snapshot: Option<SnapshotRef>,
    /// Elements that could not answer this snapshot read (one that does not hold the
    /// snapshot is asked no more, and not failed: its volume may be fine).
    tried: ElementSet,
    /// When it was last sent to an element.
    sent_at: Time,
}

impl PendingRead {
    /// What its reply counts for in its element's read window.
    fn reply_bytes(&self) -> u64 {
        match self.kind {
            ReadKind::Data { length_bytes } => length_bytes as u64,
            ReadKind::BlockStatus { .. } => limits::BLOCK_STATUS_REPLY_BYTES,
        }
    }
}

/// A host request that arrived before the host element was ready.
#[derive(Debug)]
enum Deferred {
    Read { token: Token, volume: VolumeId, snapshot: Option<SnapshotRef>, offset_bytes: u64, length_bytes: u32 },
    Write { token: Token, volume: VolumeId, op: Op },
    Flush { token: Token, volume: VolumeId },
    BlockStatus { token: Token, volume: VolumeId, snapshot: Option<SnapshotRef>, offset_bytes: u64, length_bytes: u64 },
}

impl Deferred {
    fn volume(&self) -> VolumeId {
        match self {
            Deferred::Read { volume, .. }
            | Deferred::Write { volume, .. }
            | Deferred::Flush { volume, .. }
            | Deferred::BlockStatus { volume, .. } => *volume,
        }
    }
}

/// Start-up reconciliation: records fetched from the most advanced element so the others can
/// be brought level through the write queue.
#[derive(Debug)]
struct Fetch {
    volume: VolumeId,
    element: ElementId,
    after: Sequence,
    through: Sequence,
    /// Epoch of the source's record at `through`.
    through_epoch: Epoch,
    /// Records received so far (a reply is bounded in size, so it may take several).
    collected: Vec<Record>,
}

/// Payload asked of an element's replay log per start-up fetch reply: well inside one frame
/// even with per-record overhead (a single larger record still comes alone).
const FETCH_BYTES_MAX: u64 = proto::PAYLOAD_BYTES_MAX as u64 / 2;

const READ_ATTEMPTS_MAX: u32 = 8;
/// The shortest stretch an element's read rate is measured over.
const READ_RATE_SAMPLE_US_MIN: u64 = 1_000;

/// How often a starting host element raises its epoch before it gives up and counts the
/// refusing elements as fenced: two host elements started together would otherwise take
/// epochs from each other forever.
const EPOCH_RAISES_MAX: u32 = 16;

/// A running host element starts over above an element's epoch at most this often: two live
/// host elements (a misconfiguration the failover issue's lease prevents) would otherwise take
/// the elements from each other without pause.
const RESTART_INTERVAL_MS_MIN: u64 = 10_000;

pub struct HostCore {
    config: HostConfig,
    /// The configuration it was started with: the volumes declared at start-up, before any
    /// from the catalog or created, removed or grown while running. A takeover (`restart`)
    /// starts over with these only: what changed while running is read from the catalog again,
    /// as a newer host element may have changed it since this one read it.
    configured: HostConfig,
    /// The epoch offered now: `config.epoch`, raised while starting above any an element
    /// reports. Fixed once ready.
    epoch: Epoch,
    /// How often it was raised (bounded: two host elements starting together must not chase
    /// each other forever).
    epoch_raises: u32,
    /// An element took the current epoch. From then on a refusal means a newer host element
    /// started after this one, which wins: the epoch is raised only while unclaimed.
    claimed: bool,
    /// Times it started over above an epoch an element followed, and the last time.
    restarts: u32,
    /// Times it took the elements back from a host element that is gone (`restart`): what a
    /// driver acting on a catalog read before compares against (`takeovers`).
    takeovers: u64,
    last_restart: Option<Time>,
    /// An element said it follows a newer epoch: the read cache is off for good.
    newer_epoch_seen: bool,
    /// A majority of elements follow newer epochs (the newest one seen): another host element
    /// took over and this one serves nothing.
    superseded: Option<Epoch>,
    started: Time,
    ready: bool,
    /// The start-up grace period has passed (so it no longer sets a deadline).
    grace_over: bool,
    /// The start-up timeout passed before the host element was ready: requests are answered
    /// with `Unavailable` until it is.
    hold_expired: bool,
    elements: Vec<ElementRuntime>,
    volumes: Vec<VolumeRuntime>,
    cache: ReadCache,
    /// Reads out at elements, by request id: change through `reads_insert`/`reads_remove`,
    /// which count each element's `read_bytes_out`.
    reads: HashMap<u64, PendingRead>,
    /// Reads waiting for room in their element's window, oldest first.
    reads_waiting: VecDeque<PendingRead>,
    fetches: HashMap<u64, Fetch>,
    /// Volume checks under way (`check_volumes`), by request id: the token, the elements not
    /// answered yet, and the refusals so far.
    checks: BTreeMap<u64, (Token, ElementSet, Vec<String>)>,
    deferred: Vec<Deferred>,
    /// Reads and block-status requests of volumes whose beginning record is not yet held
    /// durably by Q elements, oldest first.
    held_reads: Vec<Deferred>,
    /// Read replies waiting for the read lease, with their deadline.
    lease_waiting: VecDeque<(Token, Reply, Time)>,
    next_request_id: u64,
    scrubs_started: u64,
    /// Elements whose ack policy counts toward the quorum (all but local-sync ones).
    counting: ElementSet,
    /// Some counting element counts before it stores a write (`received`, `network-sync`):
    /// a FLUSH then waits for durable copies after the writes' answers.
    weak_acks: bool,
    /// Beginning records are appended, and ack policies weaker than durable count: reads of
    /// a volume wait for its beginning record (`reads_wait_for_begin`).
    begin_guards_reads: bool,
    actions: VecDeque<Action>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct VolumeStatus {
    pub name: String,
    pub size_bytes: u64,
    pub mode: VolumeMode,
    pub acked_sequence: Sequence,
    pub last_sequence: Sequence,
    pub write_queue_used_bytes: u64,
    pub write_queue_capacity_bytes: u64,
    pub write_queue_oldest: Option<Sequence>,
    pub writes_waiting: usize,
    /// The last scrubs since this host element started (oldest first, the running one last).
    pub scrubs: Vec<ScrubStatus>,
    /// This host element's beginning record, while fewer than Q elements hold it durably and
    /// that matters (ack policies weaker than durable; see `Event::BeginNotHeld`).
    pub beginning: Option<BeginningStatus>,
}

/// A volume's beginning record not yet held by Q elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BeginningStatus {
    pub sequence: Sequence,
    /// Elements that hold it durably.
    pub held_by: usize,
    /// Whether reads of the volume wait for it (else the start-up timeout passed and reads
    /// are served all the same).
    pub reads_wait: bool,
    /// Reads and block-status requests waiting for it now.
    pub reads_held: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RecoveryStatus {
    pub kind: RecoveryKind,
    /// Name of the peer a replay pulls from; `None` for the host element's write queue.
    pub source: Option<String>,
    pub done_records: u64,
    pub total_records: u64,
    /// A full recovery's block copy: volume bytes compared so far and in all (of the volumes
    /// being copied), and block content received.
    pub copy_done_bytes: Option<u64>,
    pub copy_total_bytes: Option<u64>,
    pub copied_bytes: Option<u64>,
    pub elapsed_us: u64,
    /// Volumes whose full recovery waits for a peer to copy from: none is in sync, and none
    /// holds the volume on the current history.
    pub waiting_for_source: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LastRecoveryStatus {
    pub kind: RecoveryKind,
    pub records: u64,
    /// Block content a full recovery copied (0 for quick and replay).
    pub copied_bytes: u64,
    pub seconds: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ElementStatus {
    pub name: String,
    pub ack_policy: AckPolicy,
    /// "in-sync", "recovering" or "failed".
    pub state: &'static str,
    /// Why it is failed, as `starfish status` shows it (`failure`, as text).
    pub reason: Option<String>,
    pub failure: Option<Failure>,
    /// Per volume, in configuration order.
    pub applied_sequence: Vec<Sequence>,
    /// Writes behind the newest assigned sequence, summed over volumes.
    pub lag: u64,
    pub rtt_us: Option<u64>,
    pub recovery: Option<RecoveryStatus>,
    pub last_recovery: Option<LastRecoveryStatus>,
    /// Its acknowledgements' latency while in sync (see `ElementRuntime::ack_latency`).
    pub ack_latency: LatencyHistogram,
    /// Its failures since this host element started, per kind (`Failure::kind`).
    pub failures: Vec<(&'static str, u64)>,
    /// Reply bytes of the reads out at it.
    pub reads_out_bytes: u64,
    /// The most reply bytes of reads out at it at once (`limits::READ_WINDOW_MS` of its
    /// measured rate, at least `limits::READ_WINDOW_BYTES_MIN`); `None` with the window off.
    pub read_window_bytes: Option<u64>,
    /// What its read replies delivered, bytes per second (`None` before the first measure).
    pub read_rate_bytes_per_s: Option<u64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct HostStatus {
    pub epoch: Epoch,
    pub quorum: usize,
    pub ready: bool,
    pub volumes: Vec<VolumeStatus>,
    pub elements: Vec<ElementStatus>,
    pub read_cache_used_bytes: u64,
    pub read_cache_hits: u64,
    pub read_cache_misses: u64,
    /// Blocks reads missed that the read cache did not take (it takes one on its second miss).
    pub read_cache_declined: u64,
    /// Reads waiting in the host element for room in an element's read window, and their
    /// reply bytes.
    pub reads_waiting: u64,
    pub reads_waiting_bytes: u64,
}

impl HostCore {
    /// Whether `volume` takes writes now (serving, Q elements in sync).
    pub fn writable(&self, volume: VolumeId) -> bool {
        self.ready && self.volumes.get(volume.0 as usize).is_some_and(|v| v.mode == VolumeMode::ReadWrite)
    }

    pub fn new(config: HostConfig, now: Time) -> HostCore {
        config.validate().expect("configuration validated at the boundary");
        let volume_count = config.volumes.len();
        let elements = config
            .elements
            .iter()
            .map(|name| ElementRuntime {
                name: name.clone(),
                state: ElementState::Failed(Failure::NotConnectedYet),
                session: false,
                welcomed: false,
                welcome: None,
                applied: vec![Sequence::ZERO; volume_count],
                sent_through: vec![Sequence::ZERO; volume_count],
                rtt_us: None,
                last_heard: now,
                next_ping: now,
                recovery: None,
                last_recovery: None,
                volume_recovery: vec![VolumeRecovery::Streaming; volume_count],
                replay_tried: ElementSet::default(),
                copy_progress: vec![(0, 0, 0); volume_count],
                copy_source: vec![None; volume_count],
                repair_held: vec![None; volume_count],
                copy_passes: 0,
                failed_in_session: false,
                ack_latency: LatencyHistogram::default(),
                failures: BTreeMap::new(),
                identity: None,
                follows: None,
                owner_absent_ms: 0,
                follows_ours: false,
                lease_until: Time(0),
                read_bytes_out: 0,
                read_rate: None,
                last_read_reply: None,
                read_sample: None,
                scrub_repair: vec![false; volume_count],
                weak_through: vec![Sequence::ZERO; volume_count],
                session_volumes: 0,
                adding: VecDeque::new(),
                resizes_unanswered: 0,
                hello_removed: Vec::new(),
            })
            .collect();
        let mut counting = ElementSet::default();
        for (i, p) in config.ack_policies.iter().enumerate() {
            if p.counts_toward_quorum() {
                counting.insert(ElementId(i as u8));
            }
        }
        let weak_policies = config.ack_policies.iter().any(|p| p.counts_toward_quorum() && !p.needs_durable());
        let weak_acks = config.flush_waits_for_durable && weak_policies;
        let begin_guards_reads = config.begin_records && weak_policies;
        let volumes = config
            .volumes
            .iter()
            .map(|spec| {
                let mut volume = VolumeRuntime::new(spec.clone(), VolumeMode::ReadOnly, config.write_queue_bytes);
                if spec.size_bytes == 0 {
                    volume.removed = Some(Removal::default());
                }
                volume
            })
            .collect();
        HostCore {
            cache: ReadCache::new(config.read_cache_bytes),
            epoch: config.epoch,
            epoch_raises: 0,
            claimed: false,
            restarts: 0,
            takeovers: 0,
            last_restart: None,
            newer_epoch_seen: false,
            superseded: None,
            configured: config.clone(),
            config,
            started: now,
            ready: false,
            grace_over: false,
            hold_expired: false,
            elements,
            volumes,
            reads: HashMap::new(),
            reads_waiting: VecDeque::new(),
            fetches: HashMap::new(),
            checks: BTreeMap::new(),
            deferred: Vec::new(),
            held_reads: Vec::new(),
            lease_waiting: VecDeque::new(),
            next_request_id: 1,
            scrubs_started: 0,
            counting,
            weak_acks,
            begin_guards_reads,
            actions: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// A storage volume by its name, or the storage volume of an exported volume or of a
    /// consistency group (by the group's name).
    pub fn volume_id(&self, name: &str) -> Option<VolumeId> {
        let storage = self.volumes.iter().position(|v| v.spec.name == name);
        let exported = || {
            let e = self
                .config
                .exports
                .iter()
                .find(|e| e.snapshot.is_none() && (e.name == name || e.group.as_deref() == Some(name)))?;
            Some(e.volume)
        };
        storage.or_else(exported).map(|i| VolumeId(i as u32))
    }

    /// Export snapshot `snapshot` of the volume exported as `of` (a whole storage volume),
    /// read-only, as `name` (`VOLUME@SNAP`), of `size_bytes` (the volume's size when it was
    /// taken). Of a consistency group `of` (its storage volume's snapshot: all its members at
    /// one point), each member `M` is exported as `M@SNAP`, the member's window of it. Its
    /// reads go to the elements ([`HostCore::handle_host_snapshot_read`]); it goes when its
    /// volume is removed.
    pub fn add_snapshot_export(
        &mut self,
        name: String,
        of: &str,
        snapshot: SnapshotRef,
        size_bytes: u64,
    ) -> Result<(), String> {
        let members: Vec<crate::groups::ExportedVolume> = self
            .config
            .exports
            .iter()
            .filter(|e| e.snapshot.is_none() && e.group.as_deref() == Some(of))
            .cloned()
            .collect();
        if !members.is_empty() {
            let Some((_, short)) = name.rsplit_once('@') else {
                return Err(format!("snapshot {name} of group {of} is not named GROUP@NAME"));
            };
            for member in members {
                // A member that joined the group after the snapshot lies past its end.
                if member.offset_bytes + member.size_bytes > size_bytes {
                    continue;
                }
                let export = format!("{}@{short}", member.name);
                if self.config.exports.iter().any(|e| e.name == export) {
                    continue; // Exported already (a catalog read again).
                }
                let snapshot = Some(snapshot);
                self.config.exports.push(crate::groups::ExportedVolume { name: export, snapshot, ..member });
            }
            return Ok(());
        }
        let Some(e) = self.config.exports.iter().find(|e| e.name == of && e.snapshot.is_none()) else {
            // Exports of ungrouped volumes only, so far: the storage volume by that name.
            let Some(volume) = self.volumes.iter().position(|v| v.spec.name == of && v.spec.size_bytes > 0) else {
                return Err(format!("no volume {of} is exported"));
            };
            return self.push_snapshot_export(name, volume, snapshot, size_bytes);
        };
        if e.group.is_some() || e.offset_bytes != 0 {
            return Err(format!("volume {of} is a member of a consistency group: its snapshots are not exported"));
        }
        let volume = e.volume;
        self.push_snapshot_export(name, volume, snapshot, size_bytes)
    }

    fn push_snapshot_export(
        &mut self,
        name: String,
        volume: usize,
        snapshot: SnapshotRef,
        size_bytes: u64,
    ) -> Result<(), String> {
        if self.config.exports.iter().any(|e| e.name == name) {
            return Ok(()); // Exported already (a catalog read again).
        }
        if size_bytes == 0 || size_bytes > self.config.volumes[volume].size_bytes {
            return Err(format!("snapshot {name}: {size_bytes} bytes do not fit its storage volume"));
        }
        if self.config.exports.is_empty() {
            self.config.exports = crate::groups::ungrouped(&self.config.volumes);
        }
        let snapshot = Some(snapshot);
        let export = crate::groups::ExportedVolume { name, group: None, volume, offset_bytes: 0, size_bytes, snapshot };
        self.config.exports.push(export);
        Ok(())
    }

    /// Stop exporting snapshot export `name` (`VOLUME@SNAP`; of a group, `GROUP@SNAP` stops
    /// every member's `M@SNAP`) (nothing if it is not exported).
    pub fn remove_snapshot_export(&mut self, name: &str) {
        let (of, short) = name.rsplit_once('@').unwrap_or((name, ""));
        self.config.exports.retain(|e| {
            let of_group = e.group.as_deref() == Some(of) && e.name.rsplit_once('@').is_some_and(|(_, s)| s == short);
            e.snapshot.is_none() || (e.name != name && !of_group)
        });
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The next time `handle_timeout` has work to do.
    pub fn poll_timeout(&self) -> Option<Time> {
        let mut next: Option<Time> = None;
        let mut consider = |t: Time| next = Some(next.map_or(t, |n: Time| n.min(t)));
        if !self.ready && !self.grace_over {
            consider(self.started.plus_ms(self.config.startup_grace_ms));
        }
        if !self.ready && !self.hold_expired {
            consider(self.started.plus_ms(self.config.startup_timeout_ms));
        }
        for e in &self.elements {
            if e.welcomed {
                consider(e.next_ping);
            }
            if e.session && !e.closing() {
                // Also bounds a handshake whose element went silent before its welcome.
                consider(e.last_heard.plus_ms(self.config.heartbeat_timeout_ms));
            }
        }
        for v in &self.volumes {
            if let Some(since) = v.blocked_since {
                consider(since.plus_ms(self.config.throttle_timeout_ms));
            }
            if let Some(b) = v.begin.filter(|b| !b.overdue) {
                consider(b.since.plus_ms(self.config.startup_timeout_ms));
            }
        }
        if let Some((_, _, deadline)) = self.lease_waiting.front() {
            consider(*deadline);
        }
        if let Some(t) = self.scrub_timeout() {
            consider(t);
        }
        next
    }

    fn emit(&mut self, action: Action) {
        self.actions.push_back(action);
    }

    fn reply(&mut self, token: Token, reply: Reply) {
        self.emit(Action::Reply { token, reply });
    }

    fn welcomed_count(&self) -> usize {
        self.elements.iter().filter(|e| e.welcome.is_some() || e.welcomed).count()
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Where an element stands, for log lines: `name@applied` per volume it serves (removed
    /// ones left out), at most `LOG_VOLUMES_MAX` of them.
    pub fn element_applied_text(&self, element: ElementId) -> String {
        const LOG_VOLUMES_MAX: usize = 8;
        let e = &self.elements[element.0 as usize];
        let mut parts: Vec<String> = self
            .volumes
            .iter()
            .zip(&e.applied)
            .filter(|(v, _)| v.removed.is_none())
            .map(|(v, s)| format!("{}@{}", v.spec.name, s.0))
            .collect();
        if parts.len() > LOG_VOLUMES_MAX {
            let more = parts.len() - LOG_VOLUMES_MAX;
            parts.truncate(LOG_VOLUMES_MAX);
            parts.push(format!("… {more} more"));
        }
        parts.join(",")
    }

    /// The highest sequence of `volume` acknowledged to clients, and the newest assigned.
    pub fn volume_sequences(&self, volume: VolumeId) -> (Sequence, Sequence) {
        let v = &self.volumes[volume.0 as usize];
        (v.host_acked, v.queue.last_sequence())
    }

    /// In-sync elements that count toward the write quorum (local-sync ones never do): what
    /// decides whether a volume is read-write.
    fn in_sync_count(&self) -> usize {
        (0..self.elements.len())
            .filter(|&i| self.elements[i].state == ElementState::InSync && self.counting.contains(ElementId(i as u8)))
            .count()
    }

    /// Whether any element is in sync, counting toward the write quorum or not: one can serve
    /// every recovery.
    fn any_in_sync(&self) -> bool {
        self.elements.iter().any(|e| e.state == ElementState::InSync)
    }

    // ----- elements -------------------------------------------------------------------------

    /// The shell opened a transport session to an element.
    pub fn handle_element_connected(&mut self, now: Time, element: ElementId) {
        let e = &mut self.elements[element.0 as usize];
        assert!(!e.session, "connected twice without a disconnect");
        e.session = true;
        e.welcomed = false;
        e.failed_in_session = false;
        e.last_heard = now;
        e.session_volumes = self.config.volumes.len();
        e.adding.clear();
        e.resizes_unanswered = 0;
        e.hello_removed = (0..self.volumes.len()).filter(|&i| self.volumes[i].removed.is_some()).collect();
        // The state stays what it was (failed, with its reason) until the welcome decides.
        let message = HostMessage::Hello {
            epoch: self.epoch,
            host: self.config.host_id,
            volumes: self.config.volumes.clone(),
            admin: self.config.admin.clone(),
            receipt_acks: self.config.ack_policies[element.0 as usize] == AckPolicy::Received,
        };
        let mut to = ElementSet::default();
        to.insert(element);
        self.emit(Action::Send { to, message });
    }

    /// The transport session ended (or could not be opened).
    pub fn handle_element_disconnected(&mut self, now: Time, element: ElementId, reason: &str) {
        let e = &mut self.elements[element.0 as usize];
        let was_session = e.session;
        e.session = false;
        e.welcomed = false;
        e.welcome = None;
        match &e.state {
            ElementState::InSync | ElementState::Recovering(_) => {
                return self.fail_element(now, element, Failure::ConnectionLost(reason.to_string()), false)
            }
            // A reason given when the element was failed in this session stays: it says more.
            ElementState::Failed(_) if was_session && e.failed_in_session => {}
            ElementState::Failed(_) if was_session => {
                e.state = ElementState::Failed(Failure::HandshakeLost(reason.to_string()))
            }
            ElementState::Failed(_) => e.state = ElementState::Failed(Failure::CannotConnect(reason.to_string())),
        }
        self.abandon_requests_to(now, element);
    }

    /// Part of a message from the element arrived (a large frame still coming over a thin
    /// link): the element is alive, though no whole message has arrived for a while.
    pub fn handle_element_progress(&mut self, now: Time, element: ElementId) {
        let e = &mut self.elements[element.0 as usize];
        if e.session {
            e.last_heard = now;
        }
    }

    pub fn handle_element_message(&mut self, now: Time, element: ElementId, message: ElementMessage) {
        let e = &mut self.elements[element.0 as usize];
        if !e.session {
            return; // A late message of a closed session.
        }
        e.last_heard = now;
        match &message {
            ElementMessage::Pong { epoch, owner_absent_ms, .. } => {
                e.follows = Some((*epoch, now));
                e.owner_absent_ms = *owner_absent_ms;
                // Our session's epoch: the element can only follow it for us.
                e.follows_ours = *epoch == self.epoch;
            }
            ElementMessage::Refused { epoch: Some(epoch), owner_absent_ms, .. } => {
                e.follows = Some((*epoch, now));
                e.owner_absent_ms = *owner_absent_ms;
                e.follows_ours = false;
            }
            _ => {}
        }
        match message {
            ElementMessage::Welcome { epoch, element_id, volumes } => {
                self.on_welcome(now, element, epoch, element_id, volumes)
            }
            ElementMessage::VolumesAdded { volumes } => self.on_volumes_added(now, element, volumes),
            ElementMessage::VolumesChecked { request_id, result } => {
                self.on_volumes_checked(element, request_id, result)
            }
            ElementMessage::VolumesRemoved { volumes } => self.on_volumes_removed(element, volumes),
            ElementMessage::VolumesResized { volumes } => self.on_volumes_resized(now, element, volumes),
            ElementMessage::Refused { reason: _, epoch: Some(seen), .. }
                if !self.ready
                    && !self.claimed
                    && seen >= self.epoch
                    && self.config.raise_epoch
                    && self.epoch_raises < EPOCH_RAISES_MAX =>
            {
                self.raise_epoch(now, element, seen)
            }
            ElementMessage::Refused { reason: _, epoch: Some(seen), .. } if seen >= self.epoch => {
                self.on_epoch_refused(now, element, seen)
            }
            ElementMessage::Refused { reason, .. } => {
                self.fail_element(now, element, Failure::SessionRefused(reason), true)
            }
            ElementMessage::Applied { volume, sequence } => self.on_applied(now, element, volume, sequence),
            ElementMessage::Received { volume, sequence } => self.on_weak_ack(now, element, volume, sequence),
            ElementMessage::ReadReply { request_id, applied_sequence, result } => {
                self.on_read_reply(now, element, request_id, applied_sequence, ReadResult::Data(result));
                self.dispatch_waiting_reads(now);
            }
            ElementMessage::BlockStatusReply { request_id, applied_sequence, result } => {
                self.on_read_reply(now, element, request_id, applied_sequence, ReadResult::Extents(result));
                self.dispatch_waiting_reads(now);
            }
            ElementMessage::ScrubReply { request_id, result } => self.on_scrub_reply(now, element, request_id, result),
            ElementMessage::Pong { epoch, .. } if epoch > self.epoch => self.on_epoch_refused(now, element, epoch),
            ElementMessage::Pong { nonce, epoch, lease_ms, .. } => {
                let sample = now.0.saturating_sub(nonce);
                let e = &mut self.elements[element.0 as usize];
                e.rtt_us = Some(match e.rtt_us {
                    None => sample,
                    Some(old) => (old * 7 + sample) / 8,
                });
                if epoch == self.epoch && lease_ms > 0 {
                    // Promised from when the element sent the pong, after our ping left.
                    let sent = Time(nonce.min(now.0));
                    let lease_us = lease_ms as u64 * 1000 * limits::LEASE_CLOCK_MARGIN_PERMILLE / 1000;
                    e.lease_until = e.lease_until.max(Time(sent.0 + lease_us));
                    if !self.lease_waiting.is_empty() {
                        self.settle_lease_waiting(now);
                    }
                }
            }
            ElementMessage::LogRecords { request_id, result } => self.on_log_records(now, element, request_id, result),
            ElementMessage::RecoveryDone { volume, result } => self.on_recovery_done(now, element, volume, result),
            ElementMessage::CopyDone { volume, result } => self.on_copy_done(now, element, volume, result),
            ElementMessage::CopyProgress { volume, done_bytes, total_bytes, copied_bytes } => {
                let e = &mut self.elements[element.0 as usize];
                if let Some(p) = e.copy_progress.get_mut(volume.0 as usize) {
                    *p = (done_bytes.min(total_bytes), total_bytes, copied_bytes);
                }
            }
            ElementMessage::Blocks { .. } => {
                self.fail_element(now, element, Failure::Protocol("unsolicited blocks".into()), true)
            }
            // Failed in this session already (its end asked for): the first reason stands, and a
            // burst of faults (one per refused record) counts as the one failure it is.
            ElementMessage::Fault { .. } if self.elements[element.0 as usize].closing() => {}
            ElementMessage::Fault { reason } => self.fail_element(now, element, Failure::Fault(reason), true),
            ElementMessage::Observed { .. } => {
                self.fail_element(now, element, Failure::Protocol("unsolicited observation".into()), true)
            }
        }
    }

    /// Starting, an element refused our epoch because it follows `seen`: take the next epoch
    /// above it and redo every session with it (those already welcomed adopted the old one).
    fn raise_epoch(&mut self, now: Time, refused_by: ElementId, seen: Epoch) {
        let Some(next) = seen.0.checked_add(1) else {
            return self.fail_element(now, refused_by, Failure::Protocol(last_epoch_claim(seen)), true);
        };
        let old = self.epoch;
        self.epoch = Epoch(next);
        self.epoch_raises += 1;
        self.claimed = false;
        self.emit(Action::Event(Event::EpochRaised { from: old, to: self.epoch, refused_by }));
        // What a start-up fetch gathered is gathered again under the new epoch.
        self.fetches.clear();
        for i in 0..self.elements.len() {
            let e = &mut self.elements[i];
            if e.session && !e.closing() {
                self.fail_element(now, ElementId(i as u8), Failure::EpochRaised(self.epoch), true);
            }
        }
    }

    /// Elements that said within `within_ms` that they follow an epoch `which` accepts.
    fn following(&self, now: Time, within_ms: u64, which: impl Fn(Epoch) -> bool) -> usize {
        self.elements
            .iter()
            .filter(|e| e.follows.is_some_and(|(epoch, at)| which(epoch) && now.micros_since(at) / 1000 <= within_ms))
            .count()
    }

    /// An element said it follows `seen`, newer than our epoch (or ours, of another host
    /// element). The read cache may hold what a newer host element has overwritten since, so it
    /// serves no more; and once a majority follows newer epochs, this host element was taken
    /// over and serves nothing.
    fn on_newer_epoch(&mut self, now: Time, seen: Epoch) {
        if !self.newer_epoch_seen {
            self.newer_epoch_seen = true;
            self.cache = ReadCache::new(0);
        }
        let majority = self.elements.len() / 2 + 1;
        let ours = self.epoch;
        if self.superseded.is_none() && self.following(now, self.config.heartbeat_timeout_ms, |e| e > ours) >= majority
        {
            self.superseded = Some(seen);
            self.emit(Action::Event(Event::Superseded { ours, seen }));
            self.fail_everything_under_way();
        }
    }

    /// An element follows `seen`, at least as new as our epoch (a refused hello), or newer (a
    /// pong), and our epoch is claimed (or we are running), so a newer host element started
    /// after us, or one that started and died before it was ready left its epoch behind. The
    /// newer one wins while it lives: this host element stays out. But once the element says
    /// that no session of its epoch has been open for two heartbeat timeouts (its owner is
    /// gone: dead, or cut off from it), and a majority of elements either follow our epoch or
    /// say the same of theirs, this host element starts over above every epoch it saw and
    /// takes them back. The start
    /// over reads the history from the elements again, so nothing their owner acknowledged is
    /// lost; it only decides who serves.
    fn on_epoch_refused(&mut self, now: Time, element: ElementId, seen: Epoch) {
        self.on_newer_epoch(now, seen);
        let ours = self.epoch;
        let gone_ms = 2 * self.config.heartbeat_timeout_ms;
        // What an element said stays true until it says otherwise, and a failed element is
        // dialled again (and welcomed, or refused) at least every 2 s; four heartbeat
        // timeouts leave room for that without trusting old news.
        let within_ms = 2 * gone_ms;
        let fresh = |at: Time| now.micros_since(at) / 1000 <= within_ms;
        let mut free = 0;
        let mut newest = seen;
        for e in &self.elements {
            let Some((epoch, _)) = e.follows.filter(|(_, at)| fresh(*at)) else { continue };
            if e.follows_ours || e.owner_absent_ms >= gone_ms {
                free += 1;
            }
            newest = newest.max(epoch);
        }
        let majority = self.elements.len() / 2 + 1;
        let recently = self.last_restart.is_some_and(|at| now < at.plus_ms(RESTART_INTERVAL_MS_MIN));
        // Never from a live owner: the element itself must have lost its owner.
        let owner_gone = self.elements[element.0 as usize].owner_absent_ms >= gone_ms;
        if !owner_gone || free < majority || recently || !self.config.raise_epoch {
            return self.fail_element(now, element, Failure::Fenced { seen, ours }, true);
        }
        let Some(next) = newest.0.checked_add(1) else {
            return self.fail_element(now, element, Failure::Protocol(last_epoch_claim(newest)), true);
        };
        self.restart(now, Epoch(next), element, newest);
    }

    /// Start over as if this host element had just started with `epoch`: every request under
    /// way fails (a write may or may not have reached the elements: the start-up roll forward
    /// decides), every session is redone, and the history is read from the elements again.
    /// It serves the configured volumes only: the host element it takes over from may have
    /// created, deleted or grown volumes since this one read the catalog, so the driver reads
    /// the catalog again (`Event::Restarted`) and adds its volumes (`restart_with_volumes`),
    /// as at start-up. Never a hello naming a volume that may have been deleted since.
    fn restart(&mut self, now: Time, epoch: Epoch, refused_by: ElementId, seen: Epoch) {
        let old = self.epoch;
        self.config = self.configured.clone();
        self.start_over(now, epoch);
        self.takeovers += 1;
        self.emit(Action::Event(Event::Restarted { from: old, to: epoch, refused_by, seen }));
    }

    /// A new core with the same configuration at `epoch`: every request under way fails and
    /// every session is redone.
    fn start_over(&mut self, now: Time, epoch: Epoch) {
        let replies = self.take_everything_under_way();
        let sessions: Vec<ElementId> =
            (0..self.elements.len()).filter(|&i| self.elements[i].session).map(|i| ElementId(i as u8)).collect();
        let old_actions = std::mem::take(&mut self.actions);
        let restarts = self.restarts + 1;
        let takeovers = self.takeovers;
        let mut config = self.config.clone();
        config.epoch = epoch;
        let configured = self.configured.clone();
        *self = HostCore::new(config, now);
        self.configured = configured;
        self.restarts = restarts;
        self.takeovers = takeovers;
        self.last_restart = Some(now);
        self.actions = old_actions;
        for (token, reply) in replies {
            self.reply(token, reply);
        }
        for element in sessions {
            self.emit(Action::Disconnect { element });
        }
    }

    fn fail_everything_under_way(&mut self) {
        for (token, reply) in self.take_everything_under_way() {
            self.reply(token, reply);
        }
    }

    /// The failure replies of every request under way: written and unanswered (`QuorumLost`:
    /// it may or may not be on the elements), waiting for room, flushes, reads, held ones.
    fn take_everything_under_way(&mut self) -> Vec<(Token, Reply)> {
        let mut replies: Vec<(Token, Reply)> = Vec::new();
        for v in &mut self.volumes {
            for entry in v.queue.range_mut(v.queue.evicted_through(), v.queue.last_sequence()) {
                if let HostReply::Waiting(token) = entry.host_reply {
                    replies.push((token, Reply::Done(Err(HostError::QuorumLost))));
                    entry.host_reply = HostReply::Done;
                }
            }
            for w in v.admission.drain(..) {
                replies.push((w.token, Reply::Done(Err(HostError::Unavailable))));
            }
            for (_, token) in v.flushes.drain(..) {
                replies.push((token, Reply::Done(Err(HostError::Unavailable))));
            }
        }
        for (token, _, _) in std::mem::take(&mut self.checks).into_values() {
            replies.push((token, Reply::Checked(Err("the host element started over".into()))));
        }
        let mut reads: Vec<(u64, PendingRead)> = self.reads.drain().collect();
        reads.sort_unstable_by_key(|(id, _)| *id);
        for e in &mut self.elements {
            (e.read_bytes_out, e.last_read_reply, e.read_sample) = (0, None, None);
        }
        let waiting = std::mem::take(&mut self.reads_waiting);
        for read in reads.into_iter().map(|(_, read)| read).chain(waiting) {
            let reply = match read.kind {
                ReadKind::Data { .. } => Reply::Read(Err(HostError::Unavailable)),
                ReadKind::BlockStatus { .. } => Reply::BlockStatus(Err(HostError::Unavailable)),
            };
            replies.push((read.token, reply));
        }
        for (token, reply, _) in std::mem::take(&mut self.lease_waiting) {
            replies.push((token, unavailable_like(&reply)));
        }
        let held = std::mem::take(&mut self.held_reads);
        for request in std::mem::take(&mut self.deferred).into_iter().chain(held) {
            let (token, reply) = match request {
                Deferred::Read { token, .. } => (token, Reply::Read(Err(HostError::Unavailable))),
                Deferred::Write { token, .. } | Deferred::Flush { token, .. } => {
                    (token, Reply::Done(Err(HostError::Unavailable)))
                }
                Deferred::BlockStatus { token, .. } => (token, Reply::BlockStatus(Err(HostError::Unavailable))),
            };
            replies.push((token, reply));
        }
        replies
    }

    fn on_welcome(&mut self, now: Time, element: ElementId, epoch: Epoch, element_id: u64, volumes: Vec<VolumeState>) {
        let e = &mut self.elements[element.0 as usize];
        if e.welcomed {
            return self.fail_element(now, element, Failure::Protocol("second welcome".into()), true);
        }
        // Volumes added after the hello come in `VolumesAdded`, after the welcome: until then
        // they count as empty here (they are new).
        let hello_volumes = e.session_volumes - e.adding.iter().sum::<usize>();
        if volumes.len() != hello_volumes {
            return self.fail_element(now, element, Failure::Protocol("welcome volume count".into()), true);
        }
        let mut volumes = volumes;
        let empty = VolumeState {
            applied_sequence: Sequence::ZERO,
            applied_epoch: Epoch(0),
            copying: false,
            repair: false,
            size_bytes: 0,
        };
        volumes.resize(self.volumes.len(), empty);
        let resized_by_hello = self.elements[element.0 as usize].resizes_unanswered == 0;
        for v in self.volumes[..hello_volumes].iter_mut() {
            if let Some(created) = &mut v.creating {
                created.insert(element);
            }
            if let Some(resized) = v.resizing.as_mut().filter(|_| resized_by_hello) {
                resized.insert(element);
            }
        }
        self.tell_created();
        self.tell_resized();
        for i in std::mem::take(&mut self.elements[element.0 as usize].hello_removed) {
            if let Some(removal) = &mut self.volumes[i].removed {
                removal.confirmed.insert(element);
            }
        }
        if epoch > self.epoch {
            return self.fail_element(now, element, Failure::Fenced { seen: epoch, ours: self.epoch }, true);
        }
        if element_id != 0 {
            let twin = self
                .elements
                .iter()
                .enumerate()
                .find(|(i, other)| *i != element.0 as usize && other.identity == Some(element_id));
            if let Some((_, twin)) = twin {
                let name = twin.name.clone();
                return self.fail_element(now, element, Failure::SameElementAs(name), true);
            }
        }
        let e = &mut self.elements[element.0 as usize];
        if element_id != 0 {
            e.identity = Some(element_id);
        }
        e.follows = Some((self.epoch, now));
        e.owner_absent_ms = 0;
        e.follows_ours = true;
        self.claimed = true;
        e.welcomed = true;
        // The first ping at once: its pong starts the read lease.
        e.next_ping = now.plus_ms(self.config.heartbeat_interval_ms);
        self.adopt_grown_sizes(element, &volumes);
        let e = &mut self.elements[element.0 as usize];
        e.welcome = Some(volumes);
        self.ping(now, ElementSet::one(element));
        if self.ready {
            self.admit_element(now, element);
        } else {
            self.maybe_become_ready(now);
        }
    }

    /// Why volumes cannot be added or removed now, if they cannot: the host element must serve
    /// writes (ready, not superseded, Q elements in sync).
    fn volume_change_refusal(&self) -> Option<String> {
        if !self.ready || self.superseded.is_some() {
            return Some("the host element is not serving (starting, or superseded)".into());
        }
        let in_sync = self.in_sync_count();
        (in_sync < self.config.quorum).then(|| {
            format!("read-only: {in_sync} element(s) in sync, fewer than the write quorum {}", self.config.quorum)
        })
    }

    /// Add new, empty volumes while running (`starfish volume create`): each exported whole
    /// under its name (`(export name, storage volume)`). Every element with a session is told
    /// (`AddVolumes`); the others find them in their next hello. Writes may come at once: an
    /// element takes a session's messages in order, so it creates the volume before any record
    /// of it. `Event::VolumeCreated` says when Q elements that count hold a volume. Refused
    /// while starting or read-only (below quorum), and for a name or size that cannot be.
    pub fn add_volumes(&mut self, now: Time, added: Vec<(String, VolumeSpec)>) -> Result<Vec<VolumeId>, String> {
        if let Some(reason) = self.volume_change_refusal() {
            return Err(reason);
        }
        if added.is_empty() || self.volumes.len() + added.len() > limits::VOLUMES_MAX {
            return Err(format!("a host element serves 1 to {} volumes", limits::VOLUMES_MAX));
        }
        let exported = self.config.exported();
        for (i, (name, spec)) in added.iter().enumerate() {
            if name.is_empty() || name.len() > 255 || spec.name.is_empty() || spec.name.len() > 255 {
                return Err(format!("volume name {name:?} must be 1 to 255 bytes"));
            }
            if spec.size_bytes == 0 || spec.size_bytes % proto::BLOCK_BYTES != 0 {
                return Err(format!(
                    "volume {name}: size {} is not a positive multiple of {} bytes",
                    spec.size_bytes,
                    proto::BLOCK_BYTES
                ));
            }
            let taken = exported.iter().any(|e| &e.name == name || e.group.as_deref() == Some(name.as_str()))
                || self.config.volumes.iter().any(|v| v.name == spec.name || &v.name == name)
                || added[..i].iter().any(|(n, v)| n == name || v.name == spec.name);
            if taken {
                return Err(format!("a volume named {name} exists"));
            }
        }
        let n = added.len();
        let mut ids = Vec::with_capacity(n);
        let mut specs = Vec::with_capacity(n);
        for (name, spec) in added {
            let index = self.volumes.len();
            let id = VolumeId(index as u32);
            let mut volume = VolumeRuntime::new(spec.clone(), VolumeMode::ReadWrite, self.config.write_queue_bytes);
            volume.creating = Some(ElementSet::default());
            self.volumes.push(volume);
            for e in &mut self.elements {
                e.applied.push(Sequence::ZERO);
                e.sent_through.push(Sequence::ZERO);
                e.volume_recovery.push(VolumeRecovery::Streaming);
                e.copy_progress.push((0, 0, 0));
                e.copy_source.push(None);
                e.repair_held.push(None);
                e.scrub_repair.push(false);
                e.weak_through.push(Sequence::ZERO);
                if let Some(welcome) = &mut e.welcome {
                    welcome.push(VolumeState {
                        applied_sequence: Sequence::ZERO,
                        applied_epoch: Epoch(0),
                        copying: false,
                        repair: false,
                        size_bytes: 0,
                    });
                }
            }
            self.config.add_whole_volume(name, spec.clone());
            ids.push(id);
            specs.push(spec);
        }
        let mut to = ElementSet::default();
        for (i, e) in self.elements.iter_mut().enumerate() {
            if e.session {
                e.session_volumes += n;
                e.adding.push_back(n);
                to.insert(ElementId(i as u8));
            }
        }
        if !to.is_empty() {
            self.emit(Action::Send { to, message: HostMessage::AddVolumes { volumes: specs } });
        }
        self.after_membership_change(now);
        Ok(ids)
    }

    /// A volume joins a consistency group while running (`starfish volume create NAME SIZE
    /// --group G`): `member` is exported at once as a window of the group's storage volume,
    /// which grows to hold it as `resize_volume` grows a volume (every element grows it in its
    /// stream, before any write into the window; `Event::VolumeResized` for the storage volume
    /// says when Q elements that count hold it, at once if it need not grow). Its writes then
    /// share the group's one order. Refused while starting or read-only, for a group or window
    /// that cannot be, and while the group's storage volume is being resized.
    pub fn join_group(&mut self, now: Time, member: crate::groups::JoinedMember) -> Result<VolumeId, String> {
        if let Some(reason) = self.volume_change_refusal() {
            return Err(reason);
        }
        let mut config = self.config.clone();
        let i = config.add_member(&member)?;
        if self.volumes[i].resizing.is_some() {
            return Err(format!(
                "consistency group {} is growing already; ask again once that is answered",
                member.group
            ));
        }
        let storage_bytes = config.volumes[i].size_bytes;
        config.volumes[i].size_bytes = self.config.volumes[i].size_bytes;
        self.config = config;
        Ok(self.grow_storage(now, i, storage_bytes))
    }

    /// A member that joined a consistency group while running leaves it (its deletion): it is
    /// no longer exported, nor are its windows of the group's snapshots. The caller zeroes its
    /// window through the group's stream; the storage volume keeps its size. The storage
    /// volume's id. Refused for a volume that is no member of a group.
    pub fn leave_group(&mut self, name: &str) -> Result<VolumeId, String> {
        let exported = self.config.exported();
        let Some(member) = exported.iter().find(|e| e.snapshot.is_none() && e.name == name) else {
            return Err(format!("no volume {name}"));
        };
        if member.group.is_none() {
            return Err(format!("volume {name} is no member of a consistency group"));
        }
        let (volume, prefix) = (member.volume, format!("{name}@"));
        self.config.exports = exported;
        self.config.exports.retain(|e| !(e.volume == volume && (e.name == name || e.name.starts_with(&prefix))));
        Ok(VolumeId(volume as u32))
    }

    /// Ask every live element whether `specs`, new volumes, would fit there (memory for their
    /// maps, disk space); `Reply::Checked` on `token` once each answered or left. Read-only
    /// (below quorum), nothing is asked.
    pub fn check_volumes(&mut self, _now: Time, token: Token, specs: Vec<VolumeSpec>) {
        if !self.ready || self.superseded.is_some() || self.in_sync_count() < self.config.quorum {
            let reason = format!(
                "not serving writes: {} element(s) in sync, the write quorum is {}",
                self.in_sync_count(),
                self.config.quorum
            );
            return self.reply(token, Reply::Checked(Err(reason)));
        }
        let mut to = ElementSet::default();
        for (i, e) in self.elements.iter().enumerate() {
            if e.live() && e.welcomed {
                to.insert(ElementId(i as u8));
            }
        }
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        self.checks.insert(request_id, (token, to, Vec::new()));
        self.emit(Action::Send { to, message: HostMessage::CheckVolumes { request_id, volumes: specs } });
    }

    /// Remove volumes while running (`starfish volume delete`), named by their storage volume:
    /// they stop being exported at once, and every element with a session is told
    /// (`RemoveVolumes`, after every record of them it was sent); the others learn it from
    /// their next hello, which names each removed volume by a placeholder of size 0. A removed
    /// volume keeps its number as that placeholder: nothing is written to it, nothing is
    /// recovered. `Event::VolumeRemoved` tells when the live elements, and then all, removed
    /// it. Refused while starting or read-only, for a volume of a consistency group, and for
    /// one with requests under way (its writes must be answered first).
    pub fn remove_volumes(&mut self, now: Time, names: Vec<String>) -> Result<Vec<VolumeId>, String> {
        if let Some(reason) = self.volume_change_refusal() {
            return Err(reason);
        }
        let exported = self.config.exported();
        let mut ids = Vec::with_capacity(names.len());
        for name in &names {
            let Some(i) = self.config.volumes.iter().position(|v| &v.name == name && v.size_bytes > 0) else {
                return Err(format!("no volume {name}"));
            };
            if exported.iter().any(|e| e.volume == i && e.group.is_some()) {
                return Err(format!("volume {name} belongs to a consistency group"));
            }
            let v = &self.volumes[i];
            if v.host_resolved < v.queue.last_sequence() || !v.admission.is_empty() || !v.flushes.is_empty() {
                return Err(format!("volume {name} has writes under way; stop its clients first"));
            }
            // A read an element answers after removing the volume would fail that element.
            let volume = VolumeId(i as u32);
            if self.reads.values().chain(&self.reads_waiting).any(|r| r.volume == volume) {
                return Err(format!("volume {name} has reads under way; stop its clients first"));
            }
            if ids.contains(&VolumeId(i as u32)) {
                return Err(format!("volume {name} is named twice"));
            }
            ids.push(VolumeId(i as u32));
        }
        if ids.is_empty() {
            return Err("no volume named".into());
        }
        if self.config.exports.is_empty() {
            self.config.exports = crate::groups::ungrouped(&self.config.volumes);
        }
        for id in &ids {
            let i = id.0 as usize;
            self.config.exports.retain(|e| e.volume != i);
            self.config.volumes[i].size_bytes = 0;
            // What was written is gone with it: the placeholder holds nothing, everywhere.
            let spec = self.config.volumes[i].clone();
            let mode = self.volumes[i].mode;
            let mut placeholder = VolumeRuntime::new(spec, mode, self.config.write_queue_bytes);
            placeholder.removed = Some(Removal::default());
            self.volumes[i] = placeholder;
            for e in &mut self.elements {
                e.applied[i] = Sequence::ZERO;
                e.sent_through[i] = Sequence::ZERO;
                e.volume_recovery[i] = VolumeRecovery::Streaming;
                e.copy_progress[i] = (0, 0, 0);
                e.copy_source[i] = None;
                e.repair_held[i] = None;
                e.scrub_repair[i] = false;
                e.weak_through[i] = Sequence::ZERO;
                if let Some(welcome) = &mut e.welcome {
                    if let Some(state) = welcome.get_mut(i) {
                        *state = VolumeState {
                            applied_sequence: Sequence::ZERO,
                            applied_epoch: Epoch(0),
                            copying: false,
                            repair: false,
                            size_bytes: 0,
                        };
                    }
                }
            }
        }
        let mut to = ElementSet::default();
        for (i, e) in self.elements.iter().enumerate() {
            if e.session {
                to.insert(ElementId(i as u8));
            }
        }
        if !to.is_empty() {
            self.emit(Action::Send { to, message: HostMessage::RemoveVolumes { volumes: ids.clone() } });
        }
        // A volume it was recovering may have been all it lacked.
        for i in 0..self.elements.len() {
            self.maybe_in_sync(now, ElementId(i as u8));
        }
        self.tell_removed();
        Ok(ids)
    }

    /// Resize a volume while running (`starfish volume resize`), named by its storage volume:
    /// it is exported at `size_bytes` at once (to NBD clients that connect from now on), and
    /// its storage volume becomes `storage_bytes`, never less than it was nor than the export.
    /// A storage volume that grows: every element with a session is told (`ResizeVolumes`, in
    /// its stream: before any write into the new blocks), the others grow it when their next
    /// hello names the new size, and `Event::VolumeResized` says when Q elements that count
    /// hold it (the new blocks read as zeroes). Otherwise nothing changes on the elements and
    /// `Event::VolumeResized` comes at once: a shrink, whose blocks past the new end the
    /// caller zeroes through the ordered stream, or a grow back within the storage volume,
    /// whose blocks such a zeroing left as zeroes. Refused while starting or read-only, for a
    /// volume of a consistency group, for sizes that do not fit, and while another resize of
    /// the volume is under way.
    pub fn resize_volume(
        &mut self,
        now: Time,
        name: &str,
        storage_bytes: u64,
        size_bytes: u64,
    ) -> Result<VolumeId, String> {
        if let Some(reason) = self.volume_change_refusal() {
            return Err(reason);
        }
        let Some(i) = self.config.volumes.iter().position(|v| v.name == name && v.size_bytes > 0) else {
            return Err(format!("no volume {name}"));
        };
        if self.config.exported().iter().any(|e| e.volume == i && e.group.is_some()) {
            return Err(format!("volume {name} belongs to a consistency group"));
        }
        let current = self.config.volumes[i].size_bytes;
        if storage_bytes < current || size_bytes > storage_bytes {
            return Err(format!(
                "storage volume {name} has {current} bytes: it never shrinks, and cannot export {size_bytes} bytes in {storage_bytes}"
            ));
        }
        for bytes in [size_bytes, storage_bytes] {
            if bytes == 0 || !bytes.is_multiple_of(proto::BLOCK_BYTES) || bytes > crate::catalog::VOLUME_BYTES_MAX {
                return Err(format!(
                    "size {bytes} is not a positive multiple of {} bytes up to {}",
                    proto::BLOCK_BYTES,
                    crate::catalog::VOLUME_BYTES_MAX
                ));
            }
        }
        if self.volumes[i].resizing.is_some() {
            return Err(format!("volume {name} is being resized; wait for that to be answered"));
        }
        if self.config.exports.is_empty() {
            self.config.exports = crate::groups::ungrouped(&self.config.volumes);
        }
        for e in self.config.exports.iter_mut().filter(|e| e.volume == i && e.snapshot.is_none()) {
            e.size_bytes = size_bytes;
        }
        let volume = VolumeId(i as u32);
        if storage_bytes == current {
            self.emit(Action::Event(Event::VolumeResized { volume, size_bytes }));
            return Ok(volume);
        }
        Ok(self.grow_storage(now, i, storage_bytes))
    }

    /// Storage volume `i` becomes `storage_bytes` (never less than it is): every element with
    /// a session is told in its stream, the others by their next hello; `Event::VolumeResized`
    /// once Q elements that count hold it (at once if it does not grow).
    fn grow_storage(&mut self, now: Time, i: usize, storage_bytes: u64) -> VolumeId {
        let volume = VolumeId(i as u32);
        if storage_bytes <= self.config.volumes[i].size_bytes {
            let size_bytes = self.config.volumes[i].size_bytes;
            self.emit(Action::Event(Event::VolumeResized { volume, size_bytes }));
            return volume;
        }
        self.config.volumes[i].size_bytes = storage_bytes;
        self.volumes[i].spec.size_bytes = storage_bytes;
        self.volumes[i].resizing = Some(ElementSet::default());
        let mut to = ElementSet::default();
        for (k, e) in self.elements.iter_mut().enumerate() {
            if e.session {
                e.resizes_unanswered += 1;
                to.insert(ElementId(k as u8));
            }
        }
        if !to.is_empty() {
            let message = HostMessage::ResizeVolumes { volumes: vec![(volume, storage_bytes)] };
            self.emit(Action::Send { to, message });
        }
        self.after_membership_change(now);
        volume
    }

    /// An element grew the volumes of a `ResizeVolumes`.
    fn on_volumes_resized(&mut self, now: Time, element: ElementId, ids: Vec<VolumeId>) {
        let e = &mut self.elements[element.0 as usize];
        if e.resizes_unanswered == 0 {
            return self.fail_element(now, element, Failure::Protocol("unsolicited volumes resized".into()), true);
        }
        e.resizes_unanswered -= 1;
        for id in ids {
            if let Some(resized) = self.volumes.get_mut(id.0 as usize).and_then(|v| v.resizing.as_mut()) {
                resized.insert(element);
            }
        }
        self.tell_resized();
    }

    /// `Event::VolumeResized` for each volume grown while running that Q elements that count
    /// now hold at its new size.
    fn tell_resized(&mut self) {
        let (counting, quorum) = (self.counting, self.config.quorum);
        let mut resized = Vec::new();
        for (i, v) in self.volumes.iter_mut().enumerate() {
            if v.resizing.is_some_and(|set| ElementSet(set.0 & counting.0).len() >= quorum) {
                v.resizing = None;
                resized.push(Event::VolumeResized { volume: VolumeId(i as u32), size_bytes: v.spec.size_bytes });
            }
        }
        for event in resized {
            self.emit(Action::Event(event));
        }
    }

    /// An element removed the volumes of a `RemoveVolumes`.
    fn on_volumes_removed(&mut self, element: ElementId, ids: Vec<VolumeId>) {
        for id in ids {
            if let Some(removal) = self.volumes.get_mut(id.0 as usize).and_then(|v| v.removed.as_mut()) {
                removal.confirmed.insert(element);
            }
        }
        self.tell_removed();
    }

    /// `Event::VolumeRemoved` for each removed volume that the live elements (then all of
    /// them) confirmed.
    fn tell_removed(&mut self) {
        let mut live = ElementSet::default();
        for (i, e) in self.elements.iter().enumerate() {
            if e.live() && e.session {
                live.insert(ElementId(i as u8));
            }
        }
        let all = self.elements.len();
        let mut events = Vec::new();
        for (i, v) in self.volumes.iter_mut().enumerate() {
            let Some(removal) = &mut v.removed else { continue };
            let everywhere = removal.confirmed.len() == all;
            if everywhere && !removal.told_everywhere {
                // Told once, covering the live elements too.
                removal.told_live = true;
                removal.told_everywhere = true;
                events.push(Event::VolumeRemoved { volume: VolumeId(i as u32), everywhere: true });
            } else if !removal.told_live && (live.0 & !removal.confirmed.0) == 0 {
                removal.told_live = true;
                events.push(Event::VolumeRemoved { volume: VolumeId(i as u32), everywhere: false });
            }
        }
        for event in events {
            self.emit(Action::Event(event));
        }
    }

    fn on_volumes_checked(&mut self, element: ElementId, request_id: u64, result: Result<(), String>) {
        let name = self.elements[element.0 as usize].name.clone();
        let Some((_, waiting, refusals)) = self.checks.get_mut(&request_id) else { return };
        if !waiting.contains(element) {
            return;
        }
        waiting.remove(element);
        if let Err(reason) = result {
            refusals.push(format!("element {name}: {reason}"));
        }
        if waiting.is_empty() {
            let (token, _, refusals) = self.checks.remove(&request_id).expect("present");
            let outcome = if refusals.is_empty() { Ok(()) } else { Err(refusals.join("; ")) };
            self.reply(token, Reply::Checked(outcome));
        }
    }

    /// An element created the volumes of our oldest unanswered `AddVolumes`: they must be new
    /// there (nothing applied), and count toward `Event::VolumeCreated`.
    fn on_volumes_added(&mut self, now: Time, element: ElementId, states: Vec<VolumeState>) {
        let e = &mut self.elements[element.0 as usize];
        let pending: usize = e.adding.iter().sum();
        let first = e.session_volumes - pending;
        let Some(expected) = e.adding.pop_front() else {
            return self.fail_element(now, element, Failure::Protocol("unsolicited volumes added".into()), true);
        };
        if states.len() != expected {
            return self.fail_element(now, element, Failure::Protocol("added volume count".into()), true);
        }
        // A clone the element lacks the snapshot of is created empty, to be copied: it joins by
        // a full recovery at its next session.
        let uncopied = states.iter().enumerate().find(|(i, s)| {
            (s.copying || s.repair)
                && s.applied_sequence == Sequence::ZERO
                && self.volumes[first + i].spec.clone_of.is_some()
        });
        if let Some((i, _)) = uncopied {
            let volume = self.volumes[first + i].spec.name.clone();
            return self.fail_element(now, element, Failure::CloneNeedsCopy { volume }, true);
        }
        if let Some(i) = states.iter().position(|s| s.applied_sequence != Sequence::ZERO || s.copying || s.repair) {
            let name = self.volumes[first + i].spec.name.clone();
            return self.fail_element(
                now,
                element,
                Failure::Protocol(format!("volume {name}, created while running, is not new on the element")),
                true,
            );
        }
        for v in &mut self.volumes[first..first + expected] {
            if let Some(created) = &mut v.creating {
                created.insert(element);
            }
        }
        self.tell_created();
    }

    /// `Event::VolumeCreated` for each volume added while running that Q elements that count
    /// now hold.
    fn tell_created(&mut self) {
        let (counting, quorum) = (self.counting, self.config.quorum);
        let mut created = Vec::new();
        for (i, v) in self.volumes.iter_mut().enumerate() {
            if v.creating.is_some_and(|set| ElementSet(set.0 & counting.0).len() >= quorum) {
                v.creating = None;
                created.push(VolumeId(i as u32));
            }
        }
        for volume in created {
            self.emit(Action::Event(Event::VolumeCreated { volume }));
        }
    }

    /// Times this host element took the elements back from one that is gone
    /// (`Event::Restarted`), each time serving the configured volumes only.
    pub fn takeovers(&self) -> u64 {
        self.takeovers
    }

    /// Start over with more volumes, which may hold data on the elements (`starfish` volumes
    /// created while an earlier host element ran, found in the catalog at start-up): as after
    /// an epoch refusal, every request under way fails, every session is redone, and the
    /// start-up decision covers the new volumes too. Used at start-up, before any host request
    /// was taken, and after a takeover (`Event::Restarted`), which serves the configured
    /// volumes only until the catalog is read again.
    /// A spec of size 0 names a storage volume removed while an earlier host element ran that
    /// some element may still hold: it is served as a placeholder (see `remove_volumes`).
    /// `shrunk` names storage volumes (of `added`) exported smaller than they are (see
    /// `resize_volume`), with their exported sizes; `joined`, volumes that joined configured
    /// consistency groups while running (see `join_group`), exported as windows of their
    /// groups' storage volumes, grown to hold them; `grown`, storage volumes of configured
    /// groups with the sizes joins grew them to (never less, even once members left).
    pub fn restart_with_volumes(
        &mut self,
        now: Time,
        added: Vec<(String, VolumeSpec)>,
        shrunk: &[(String, u64)],
        joined: &[crate::groups::JoinedMember],
        grown: &[(String, u64)],
    ) -> Result<(), String> {
        let mut config = self.config.clone();
        let first = config.volumes.len();
        for (name, spec) in added {
            if spec.size_bytes == 0 {
                config.add_placeholder(spec.name);
            } else {
                config.add_whole_volume(name, spec);
            }
        }
        for (storage, size_bytes) in shrunk {
            let Some(i) = config.volumes.iter().skip(first).position(|v| &v.name == storage) else {
                return Err(format!("storage volume {storage}, exported shrunk, is not among the added volumes"));
            };
            for e in config.exports.iter_mut().filter(|e| e.volume == first + i && e.snapshot.is_none()) {
                e.size_bytes = *size_bytes;
            }
        }
        for (storage, bytes) in grown {
            let Some(v) = config.volumes.iter_mut().find(|v| &v.name == storage && v.size_bytes > 0) else {
                return Err(format!(
                    "consistency group storage volume {storage}, grown while running, is not served (was the group's configured membership changed?)"
                ));
            };
            v.size_bytes = v.size_bytes.max(*bytes);
        }
        for member in joined {
            config.add_member(member)?;
        }
        config.validate()?;
        let next = Epoch(self.epoch.0 + 1);
        self.config = config;
        self.start_over(now, next);
        // It had claimed the elements under its epoch already: an element that refuses the
        // next one follows a host element that started since (and may have changed the
        // catalog this one read: deleted a volume it is about to name). That one wins; this
        // one never raises its epoch above it.
        self.claimed = true;
        Ok(())
    }

    /// Consistency groups' storage volumes (`at_least`) that a welcome says are larger on
    /// `element` than this host element serves them grew as volumes joined the group while
    /// running (it names their configured sizes until it has read its catalog): it adopts the
    /// larger size and grows them on every other element with a session, in its stream. Those
    /// `element` holds smaller are grown there before it catches up (what it misses may lie
    /// past its end). The new blocks read as zeroes; what was written there comes with the
    /// records that wrote it.
    fn adopt_grown_sizes(&mut self, element: ElementId, volumes: &[VolumeState]) {
        let mut grown: Vec<(VolumeId, u64)> = Vec::new();
        let mut behind: Vec<(VolumeId, u64)> = Vec::new();
        for (i, state) in volumes.iter().enumerate().take(self.config.volumes.len()) {
            let spec = &self.config.volumes[i];
            if !spec.at_least || spec.size_bytes == 0 {
                continue;
            }
            let valid = state.size_bytes.is_multiple_of(proto::BLOCK_BYTES)
                && state.size_bytes <= crate::catalog::VOLUME_BYTES_MAX;
            if state.size_bytes > spec.size_bytes && valid {
                self.config.volumes[i].size_bytes = state.size_bytes;
                self.volumes[i].spec.size_bytes = state.size_bytes;
                grown.push((VolumeId(i as u32), state.size_bytes));
            } else if state.size_bytes < spec.size_bytes {
                behind.push((VolumeId(i as u32), spec.size_bytes));
            }
        }
        let mut to = ElementSet::default();
        for (k, e) in self.elements.iter_mut().enumerate() {
            if e.session && k != element.0 as usize && !grown.is_empty() {
                e.resizes_unanswered += 1;
                to.insert(ElementId(k as u8));
            }
        }
        if !to.is_empty() {
            self.emit(Action::Send { to, message: HostMessage::ResizeVolumes { volumes: grown } });
        }
        if !behind.is_empty() {
            self.elements[element.0 as usize].resizes_unanswered += 1;
            let to = ElementSet::one(element);
            self.emit(Action::Send { to, message: HostMessage::ResizeVolumes { volumes: behind } });
        }
    }

    /// Decide how a welcomed element joins: in sync, or recovering (quick, replay, full).
    fn admit_element(&mut self, now: Time, element: ElementId) {
        let welcome = self.elements[element.0 as usize].welcome.take().expect("welcomed");
        // A new session tries every peer again, and every peer may try it again.
        self.elements[element.0 as usize].replay_tried = ElementSet::default();
        for peer in &mut self.elements {
            peer.replay_tried.remove(element);
        }
        let mut behind = 0u64;
        let mut plan = vec![VolumeRecovery::Streaming; self.volumes.len()];
        let source = self.replay_source(element);
        let mut waiting_why = Vec::new();
        let mut any_diverged = false;
        for (i, state) in welcome.iter().enumerate() {
            let v = &self.volumes[i];
            let applied = state.applied_sequence;
            let last = v.queue.last_sequence();
            // What the volume holds cannot be brought forward by records: copy blocks.
            let diverged = state.applied_epoch != Epoch(0)
                && !state.copying
                && applied <= last
                && v.queue.epoch_at(applied).is_some_and(|ours| ours != state.applied_epoch);
            let why_copy = if state.copying {
                Some("an interrupted full recovery resumes".to_string())
            } else if state.repair {
                Some("a block fails its checksum: a full recovery that verifies every block repairs it".to_string())
            } else if self.elements[element.0 as usize].scrub_repair[i] {
                Some(
                    "a scrub found blocks that differ from the other replicas: a full recovery repairs them"
                        .to_string(),
                )
            } else if applied > last {
                Some(format!("holds sequence {applied}, beyond the newest this host element knows ({last})"))
            } else {
                match v.queue.epoch_at(applied) {
                    Some(ours) if state.applied_epoch != Epoch(0) && ours != state.applied_epoch => Some(format!(
                        "its sequence {applied} comes from epoch {}, ours from epoch {ours}: diverged history",
                        state.applied_epoch
                    )),
                    _ => None,
                }
            };
            // A repair whose position is on the current history, the queue covering what
            // follows: it may serve copies of its intact blocks.
            let repair_on_history = state.repair
                && applied <= last
                && v.queue.covers_after(applied)
                && (applied == Sequence::ZERO || v.queue.epoch_at(applied) == Some(state.applied_epoch));
            self.elements[element.0 as usize].repair_held[i] = repair_on_history.then_some(applied);
            if let Some(why) = why_copy {
                any_diverged |= diverged;
                plan[i] = VolumeRecovery::AwaitingSource;
                waiting_why.push((i, why));
                // Even a volume with nothing written yet: the copy clears the element's
                // repair (until then it takes no record), so the element is not in sync.
                behind += last.0.max(1);
                continue;
            }
            // Where the queue cannot vouch for the epoch of the element's newest record, the
            // replay path checks it against a peer's log before pulling anything.
            let unverifiable =
                applied != Sequence::ZERO && state.applied_epoch != Epoch(0) && v.queue.epoch_at(applied).is_none();
            if !v.queue.covers_after(applied) || unverifiable {
                if source.is_none() {
                    // No in-sync peer's replay log to pull from: a copy brings it back instead,
                    // from a peer the queue streams the volume to if none is in sync.
                    plan[i] = VolumeRecovery::AwaitingSource;
                    waiting_why.push((
                        i,
                        format!(
                            "missed writes {}..={last}, no longer in the write queue (it starts after {}), and no in-sync peer to replay them from",
                            applied.next(),
                            v.queue.evicted_through()
                        ),
                    ));
                    behind += last.0.max(1);
                    continue;
                }
                plan[i] = VolumeRecovery::Replaying;
            }
            behind += last.0 - applied.0;
        }
        if let (Some((i, why)), true) = (waiting_why.first(), self.config.element_addresses.is_empty()) {
            let reason = format!(
                "volume {}: {why}; no peer address is configured to recover it from",
                self.volumes[*i].spec.name
            );
            return self.fail_element(now, element, Failure::Unrecoverable { reason }, true);
        }
        let e = &mut self.elements[element.0 as usize];
        for (i, state) in welcome.iter().enumerate() {
            // A volume to copy holds nothing the queue can count on.
            let held = if plan[i].copies() { Sequence::ZERO } else { state.applied_sequence };
            e.applied[i] = held;
            e.sent_through[i] = held;
        }
        for (i, state) in welcome.iter().enumerate() {
            if plan[i].copies() {
                continue;
            }
            let through = state.applied_sequence;
            let queue = &mut self.volumes[i].queue;
            let after = queue.evicted_through();
            for entry in queue.range_mut(after, through) {
                entry.acked_by.insert(element);
            }
        }
        let e = &mut self.elements[element.0 as usize];
        if behind == 0 {
            e.state = ElementState::InSync;
            self.emit(Action::Event(Event::ElementInSync { element }));
            self.after_membership_change(now);
            return;
        }
        let replay = plan.iter().any(|r| r.off_queue());
        let kind = if plan.iter().any(|r| r.copies()) {
            RecoveryKind::Full
        } else if replay {
            RecoveryKind::Replay
        } else {
            RecoveryKind::Quick
        };
        let source = if replay { source } else { None };
        e.state = ElementState::Recovering(kind);
        e.volume_recovery = plan.clone();
        e.copy_progress.iter_mut().for_each(|p| *p = (0, 0, 0));
        e.recovery = Some(Recovery {
            kind,
            source,
            started: now,
            start: welcome.iter().map(|s| s.applied_sequence).collect(),
            copied_bytes: 0,
        });
        self.emit(Action::Event(Event::RecoveryStarted {
            element,
            kind,
            records: behind,
            source,
            diverged: any_diverged,
        }));
        for (i, how) in plan.into_iter().enumerate() {
            match how {
                VolumeRecovery::Replaying => self.send_recover(element, VolumeId(i as u32)),
                VolumeRecovery::Streaming => self.pump(element, VolumeId(i as u32)),
                VolumeRecovery::Copying | VolumeRecovery::AwaitingSource => {}
            }
        }
        for (i, why) in waiting_why {
            self.try_copy(element, VolumeId(i as u32), Some(&why));
        }
        // Peers that wait for a volume it holds.
        self.start_waiting_copies();
    }

    /// The peer to replay from: in sync, reachable, closest.
    fn replay_source(&self, element: ElementId) -> Option<ElementId> {
        if self.config.element_addresses.is_empty() {
            return None;
        }
        self.elements
            .iter()
            .enumerate()
            .filter(|(i, e)| *i != element.0 as usize && e.state == ElementState::InSync && e.session)
            .filter(|(i, _)| !self.elements[element.0 as usize].replay_tried.contains(ElementId(*i as u8)))
            .min_by_key(|(i, e)| (e.rtt_us.unwrap_or(u64::MAX), *i))
            .map(|(i, _)| ElementId(i as u8))
    }

    /// Ask a replaying element to pull what it misses from its source, up to the newest
    /// sequence now.
    fn send_recover(&mut self, element: ElementId, volume: VolumeId) {
        let e = &self.elements[element.0 as usize];
        let source = e.recovery.as_ref().and_then(|r| r.source).expect("a replay has a source");
        let message = HostMessage::Recover {
            volume,
            source: self.config.element_addresses[source.0 as usize].clone(),
            after: e.applied[volume.0 as usize],
            through: self.volumes[volume.0 as usize].queue.last_sequence(),
            rate_bytes_per_s: self.config.recovery_rate_bytes_per_s,
        };
        // The element keeps the current writes after `through` aside while it pulls the gap,
        // so the replay finishes even when it is paced below the foreground write rate.
        let HostMessage::Recover { through, .. } = &message else { unreachable!() };
        let sent = &mut self.elements[element.0 as usize].sent_through[volume.0 as usize];
        *sent = (*sent).max(*through);
        let mut to = ElementSet::default();
        to.insert(element);
        self.emit(Action::Send { to, message });
    }

    /// A peer to copy `volume` of `element` from: the closest in-sync one; or, while no element
    /// is in sync (so no write is taken), a live peer the write queue streams the volume to. Such
    /// a peer holds the volume on the current history, at a sequence the queue covers, so the
    /// queue brings the copy forward from its base; the most advanced first. Never a peer that
    /// failed this element's copy or replay in this session (unless it came back since).
    fn copy_source(&self, element: ElementId, volume: usize) -> Option<ElementId> {
        if let Some(source) = self.replay_source(element) {
            return Some(source);
        }
        if self.config.element_addresses.is_empty() || self.any_in_sync() {
            return None;
        }
        let tried = &self.elements[element.0 as usize].replay_tried;
        let peers = || {
            self.elements
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != element.0 as usize && !tried.contains(ElementId(*i as u8)))
                .filter(|(_, p)| matches!(p.state, ElementState::Recovering(_)) && p.session && p.welcomed)
        };
        let streamed = peers()
            .filter(|(_, p)| !self.config.copy_source_check || p.volume_recovery[volume] == VolumeRecovery::Streaming)
            .max_by_key(|(i, p)| (p.applied[volume], std::cmp::Reverse((p.rtt_us.unwrap_or(u64::MAX), *i))))
            .map(|(i, _)| ElementId(i as u8));
        if streamed.is_some() {
            return streamed;
        }
        // Else a repair on the current history, for the blocks it holds intact. Copies flow
        // from the most advanced repair to the others only (never between two repairs both
        // ways): once one of those is whole, the most advanced copies from it.
        let rank = |i: usize| self.elements[i].repair_held[volume].map(|held| (held, std::cmp::Reverse(i)));
        let own = rank(element.0 as usize);
        peers()
            .filter_map(|(i, _)| rank(i).map(|r| (r, i)))
            .filter(|(r, _)| own.is_none_or(|own| *r > own))
            .max()
            .map(|(_, i)| ElementId(i as u8))
    }

    /// Ask an element to copy the blocks of `volume` that differ from `source`'s.
    fn send_copy(&mut self, element: ElementId, volume: VolumeId, source: ElementId) {
        let vi = volume.0 as usize;
        let e = &mut self.elements[element.0 as usize];
        e.volume_recovery[vi] = VolumeRecovery::Copying;
        e.copy_source[vi] = Some(source);
        // Its blocks change under the copy: it serves no more copies of them.
        e.repair_held[vi] = None;
        // The copy's state is on the element's disk from its start: it resumes there.
        e.scrub_repair[vi] = false;
        let message = HostMessage::Copy {
            volume,
            source: self.config.element_addresses[source.0 as usize].clone(),
            rate_bytes_per_s: self.config.recovery_rate_bytes_per_s,
        };
        self.emit(Action::Send { to: ElementSet::one(element), message });
    }

    /// Start the copy of a volume that waits for a source if a peer can serve one now. `why`:
    /// the reason it needs the copy, to report, also when it goes on waiting.
    fn try_copy(&mut self, element: ElementId, volume: VolumeId, why: Option<&str>) {
        let name = &self.volumes[volume.0 as usize].spec.name;
        let why = why.map(|w| format!("{w}; ")).unwrap_or_default();
        let Some(source) = self.copy_source(element, volume.0 as usize) else {
            if !why.is_empty() {
                let message = format!(
                    "{why}full recovery of volume {name} waits for a peer to copy from: none is in sync, and none holds the volume on the current history"
                );
                self.emit(Action::Event(Event::RecoveryProgress { element, message }));
            }
            return;
        };
        let peer = &self.elements[source.0 as usize];
        let how = if peer.state == ElementState::InSync {
            ""
        } else if peer.volume_recovery[volume.0 as usize] == VolumeRecovery::Streaming {
            " (not in sync, as none is: the write queue streams the volume to it)"
        } else {
            " (not in sync, as none is: a repair, for the blocks it holds intact)"
        };
        let message = format!("{why}full recovery of volume {name} from {}{how}", peer.name);
        self.emit(Action::Event(Event::RecoveryProgress { element, message }));
        self.send_copy(element, volume, source);
    }

    /// Start the copies that wait for a source where a peer can serve one now: after an element
    /// joined, a copy ended, a replay reached the queue, or an element came in sync.
    fn start_waiting_copies(&mut self) {
        for i in 0..self.elements.len() {
            for vi in 0..self.volumes.len() {
                let e = &self.elements[i];
                if e.live() && e.volume_recovery[vi] == VolumeRecovery::AwaitingSource {
                    self.try_copy(ElementId(i as u8), VolumeId(vi as u32), None);
                }
            }
        }
    }

    /// Switch one replaying volume of a recovering element to a full recovery (another pass,
    /// if it copied before), or fail the element when it has had its passes.
    fn start_copy(&mut self, now: Time, element: ElementId, volume: VolumeId, why: String) {
        let vi = volume.0 as usize;
        let e = &mut self.elements[element.0 as usize];
        e.copy_passes += 1;
        if e.copy_passes > limits::COPY_PASSES_MAX {
            // Start afresh when it reconnects: the writes may have calmed down by then.
            e.copy_passes = 0;
            e.replay_tried = ElementSet::default();
            let reason = format!(
                "{why}; {} full recovery passes did not catch up (writes outrun the recovery: raise --recovery-rate or the peers' --replay-log); retrying when it reconnects",
                limits::COPY_PASSES_MAX
            );
            return self.fail_element(now, element, Failure::Unrecoverable { reason }, true);
        }
        e.replay_tried = ElementSet::default();
        e.volume_recovery[vi] = VolumeRecovery::AwaitingSource;
        e.applied[vi] = Sequence::ZERO;
        e.sent_through[vi] = Sequence::ZERO;
        e.copy_progress[vi] = (0, 0, 0);
        e.state = ElementState::Recovering(RecoveryKind::Full);
        e.recovery.as_mut().expect("recovering").kind = RecoveryKind::Full;
        self.try_copy(element, volume, Some(&why));
    }

    fn on_copy_done(&mut self, now: Time, element: ElementId, volume: VolumeId, result: Result<Sequence, String>) {
        let vi = volume.0 as usize;
        if self.volumes.get(vi).is_some_and(|v| v.removed.is_some()) {
            return;
        }
        let e = &self.elements[element.0 as usize];
        if vi >= self.volumes.len() || !e.live() || e.volume_recovery[vi] != VolumeRecovery::Copying {
            return;
        }
        match result {
            Ok(base) => {
                let v = &self.volumes[vi];
                if base > v.queue.last_sequence() {
                    return self.fail_element(
                        now,
                        element,
                        Failure::Protocol(format!(
                            "copied volume {} up to sequence {base}, newer than any assigned",
                            v.spec.name
                        )),
                        true,
                    );
                }
                let name = v.spec.name.clone();
                let e = &mut self.elements[element.0 as usize];
                let copied = e.copy_progress[vi].2;
                if let Some(r) = e.recovery.as_mut() {
                    r.copied_bytes += copied;
                }
                e.copy_progress[vi] = (0, 0, 0);
                e.copy_source[vi] = None;
                e.volume_recovery[vi] = VolumeRecovery::Replaying;
                e.applied[vi] = base;
                e.sent_through[vi] = base;
                let queue = &mut self.volumes[vi].queue;
                let after = queue.evicted_through();
                for entry in queue.range_mut(after, base) {
                    entry.acked_by.insert(element);
                }
                let message = format!("copy of volume {name} done at sequence {base}; replaying the writes after it");
                self.emit(Action::Event(Event::RecoveryProgress { element, message }));
                // From here it is a replay: from the write queue if it still holds the rest,
                // else from a peer's replay log (one that fails sends it back to copying).
                if self.volumes[vi].queue.covers_after(base) {
                    self.elements[element.0 as usize].volume_recovery[vi] = VolumeRecovery::Streaming;
                    self.pump(element, volume);
                    // Nothing after the base yet: it may be caught up already.
                    if !self.maybe_in_sync(now, element) {
                        // Peers that wait for this volume may copy it from here now.
                        self.start_waiting_copies();
                    }
                } else {
                    self.elements[element.0 as usize].replay_tried = ElementSet::default();
                    match self.replay_source(element) {
                        Some(source) => {
                            self.elements[element.0 as usize].recovery.as_mut().expect("recovering").source =
                                Some(source);
                            self.send_recover(element, volume);
                        }
                        None => self.fail_element(
                            now,
                            element,
                            Failure::Unrecoverable {
                                reason: format!(
                                    "copy of volume {name} done at sequence {base}, but no in-sync peer to replay the rest from"
                                ),
                            },
                            true,
                        ),
                    }
                }
            }
            Err(reason) => {
                let source = e.copy_source[vi].expect("a copy has a source");
                let source_name = self.elements[source.0 as usize].name.clone();
                let e = &mut self.elements[element.0 as usize];
                e.replay_tried.insert(source);
                e.copy_source[vi] = None;
                match self.copy_source(element, vi) {
                    Some(next) => {
                        let message = format!(
                            "copy from {source_name} failed ({reason}); resuming from {}",
                            self.elements[next.0 as usize].name
                        );
                        self.emit(Action::Event(Event::RecoveryProgress { element, message }));
                        self.send_copy(element, volume, next);
                    }
                    None if !self.any_in_sync() => {
                        // It waits connected, so that it can serve its other volumes, until a
                        // peer can serve this one (one that failed may, once it comes back).
                        self.elements[element.0 as usize].volume_recovery[vi] = VolumeRecovery::AwaitingSource;
                        let why = format!("copy from {source_name} failed ({reason})");
                        self.try_copy(element, volume, Some(&why));
                    }
                    None => {
                        self.elements[element.0 as usize].replay_tried = ElementSet::default();
                        self.fail_element(now, element, Failure::CopyFailed { source: source_name, reason }, true)
                    }
                }
            }
        }
    }

    fn on_recovery_done(&mut self, now: Time, element: ElementId, volume: VolumeId, result: Result<Sequence, String>) {
        let vi = volume.0 as usize;
        if self.volumes.get(vi).is_some_and(|v| v.removed.is_some()) {
            return;
        }
        let e = &self.elements[element.0 as usize];
        if vi >= self.volumes.len() || !e.live() || e.volume_recovery[vi].copies() {
            return; // Failed meanwhile, or superseded by a copy.
        }
        if e.volume_recovery[vi] == VolumeRecovery::Streaming {
            // Already switched to the write queue, which holds everything after its applied
            // sequence. A pull that failed after that point left a hole before the current
            // writes it had kept aside: send the queue again from what it holds.
            if result.is_err() {
                self.elements[element.0 as usize].sent_through[vi] = self.elements[element.0 as usize].applied[vi];
                self.pump(element, volume);
            }
            return;
        }
        match result {
            // The element pulled its gap and committed the current writes it kept aside (their
            // acknowledgements came first): normally the write queue covers it now and
            // `on_applied` switched it to streaming. If not (it had to drop current writes, or
            // the queue moved past it meanwhile), pull the rest from where it got to.
            Ok(_) => {
                if !self.volumes[vi].queue.covers_after(e.applied[vi]) {
                    self.send_recover(element, volume);
                }
            }
            Err(reason) => {
                // Try the next peer; when none is left, the verdict is full recovery.
                let source = e.recovery.as_ref().and_then(|r| r.source).expect("a replay has a source");
                let source_name = self.elements[source.0 as usize].name.clone();
                self.elements[element.0 as usize].replay_tried.insert(source);
                if let Some(next) = self.replay_source(element) {
                    self.emit(Action::Event(Event::RecoveryProgress {
                        element,
                        message: format!(
                            "replay from {source_name} failed ({reason}); trying {}",
                            self.elements[next.0 as usize].name
                        ),
                    }));
                    let e = &mut self.elements[element.0 as usize];
                    e.recovery.as_mut().expect("recovering").source = Some(next);
                    let replaying: Vec<usize> = (0..e.volume_recovery.len())
                        .filter(|&i| e.volume_recovery[i] == VolumeRecovery::Replaying)
                        .collect();
                    for i in replaying {
                        self.send_recover(element, VolumeId(i as u32));
                    }
                    return;
                }
                let reason = format!("no peer could replay what it misses (last: {source_name}: {reason})");
                self.start_copy(now, element, volume, reason)
            }
        }
    }

    /// Send an element every queued record it has not been sent in this session.
    fn pump(&mut self, element: ElementId, volume: VolumeId) {
        let e = &self.elements[element.0 as usize];
        let v = &self.volumes[volume.0 as usize];
        let from = e.sent_through[volume.0 as usize];
        let last = v.queue.last_sequence();
        let mut to = ElementSet::default();
        to.insert(element);
        let messages: Vec<Action> = v
            .queue
            .range(from, last)
            .map(|entry| Action::Send { to, message: HostMessage::Apply(entry.record.clone()) })
            .collect();
        self.actions.extend(messages);
        self.elements[element.0 as usize].sent_through[volume.0 as usize] = last;
    }

    fn fail_element(&mut self, now: Time, element: ElementId, reason: Failure, disconnect: bool) {
        let e = &mut self.elements[element.0 as usize];
        let was_live = e.live();
        *e.failures.entry(reason.kind()).or_insert(0) += 1;
        e.state = ElementState::Failed(reason.clone());
        e.failed_in_session = e.session;
        e.recovery = None;
        e.volume_recovery.iter_mut().for_each(|r| *r = VolumeRecovery::Streaming);
        e.copy_source.iter_mut().for_each(|s| *s = None);
        e.repair_held.iter_mut().for_each(|s| *s = None);
        // What it only had in memory, or on its way to it, may be gone with it (weak
        // acknowledgements marked entries up to `weak_through`, nothing beyond).
        let weak_through = std::mem::replace(&mut e.weak_through, vec![Sequence::ZERO; self.volumes.len()]);
        for (v, through) in self.volumes.iter_mut().zip(weak_through) {
            let after = v.queue.evicted_through();
            for entry in v.queue.range_mut(after, through) {
                entry.weak_by.remove(element);
            }
        }
        let e = &self.elements[element.0 as usize];
        if disconnect && e.session {
            self.emit(Action::Disconnect { element });
        }
        self.emit(Action::Event(Event::ElementFailed { element, reason }));
        self.abandon_requests_to(now, element);
        if was_live {
            self.after_membership_change(now);
        }
    }

    /// Reads waiting on an element go elsewhere; a start-up fetch from it ends empty-handed.
    fn abandon_requests_to(&mut self, now: Time, element: ElementId) {
        let asked: Vec<u64> =
            self.checks.iter().filter(|(_, (_, waiting, _))| waiting.contains(element)).map(|(id, _)| *id).collect();
        for id in asked {
            // Gone: it learns of the volumes from its next hello (and refuses that session if
            // they do not fit, which its status then says).
            self.on_volumes_checked(element, id, Ok(()));
        }
        let mut stranded: Vec<u64> =
            self.reads.iter().filter(|(_, r)| r.element == element).map(|(id, _)| *id).collect();
        stranded.sort_unstable(); // HashMap order is random per process; replays must not be.
        for id in stranded {
            let read = self.reads_remove(id).expect("listed above");
            self.dispatch_read(now, read);
        }
        let e = &mut self.elements[element.0 as usize];
        debug_assert_eq!(e.read_bytes_out, 0, "every read out at it was taken back");
        (e.last_read_reply, e.read_sample) = (None, None);
        self.dispatch_waiting_reads(now);
        let mut fetches: Vec<u64> =
            self.fetches.iter().filter(|(_, f)| f.element == element).map(|(id, _)| *id).collect();
        fetches.sort_unstable();
        for id in fetches {
            let fetch = self.fetches.remove(&id).expect("listed above");
            self.finish_fetch(now, fetch);
        }
        self.scrub_forget(now, element);
    }

    fn on_applied(&mut self, now: Time, element: ElementId, volume: VolumeId, sequence: Sequence) {
        let vi = volume.0 as usize;
        if self.volumes.get(vi).is_some_and(|v| v.removed.is_some()) {
            return; // Sent before the element heard of the removal.
        }
        let e = &self.elements[element.0 as usize];
        if vi >= self.volumes.len() || sequence > self.volumes[vi].queue.last_sequence() {
            return self.fail_element(
                now,
                element,
                Failure::Protocol(format!(
                    "acknowledged sequence {sequence} of volume {volume}, newer than any assigned"
                )),
                true,
            );
        }
        if !e.live() || e.volume_recovery[vi].copies() {
            return;
        }
        let old = e.applied[vi];
        if sequence <= old {
            return;
        }
        let e = &mut self.elements[element.0 as usize];
        e.applied[vi] = sequence;
        // A replay from a peer can acknowledge records this session never sent.
        e.sent_through[vi] = e.sent_through[vi].max(sequence);
        let timed = e.state == ElementState::InSync && self.config.ack_policies[element.0 as usize].needs_durable();
        for entry in self.volumes[vi].queue.range_mut(old, sequence) {
            entry.acked_by.insert(element);
            if let (true, Some(at)) = (timed, entry.assigned_at) {
                e.ack_latency.observe(now.0.saturating_sub(at.0));
            }
        }
        if self.elements[element.0 as usize].volume_recovery[vi] == VolumeRecovery::Replaying
            && self.volumes[vi].queue.covers_after(sequence)
        {
            // The replay reached what the write queue holds: stream the rest from here.
            self.elements[element.0 as usize].volume_recovery[vi] = VolumeRecovery::Streaming;
            self.emit(Action::Event(Event::RecoveryProgress {
                element,
                message: format!(
                    "replay of volume {} reached the write queue at sequence {sequence}; continuing from the queue",
                    self.volumes[vi].spec.name
                ),
            }));
            self.pump(element, volume);
            // Peers that wait for this volume may copy it from here now.
            self.start_waiting_copies();
        }
        if self.maybe_in_sync(now, element) {
            return;
        }
        self.settle_volume(now, volume);
    }

    /// The shell handed the records of `volume` through `sequence` to the element's connection
    /// (written to its socket): a `network-sync` element counts toward the quorum from here.
    pub fn handle_element_sent(&mut self, now: Time, element: ElementId, volume: VolumeId, sequence: Sequence) {
        if self.config.ack_policies[element.0 as usize] == AckPolicy::NetworkSync
            && self.elements[element.0 as usize].session
        {
            self.on_weak_ack(now, element, volume, sequence);
        }
    }

    /// An acknowledgement weaker than durable (`Received`, or the shell's word that a record
    /// is on the wire): it counts toward the quorum for an element whose ack policy takes it.
    fn on_weak_ack(&mut self, now: Time, element: ElementId, volume: VolumeId, sequence: Sequence) {
        let vi = volume.0 as usize;
        let policy = self.config.ack_policies[element.0 as usize];
        if policy.needs_durable() || !policy.counts_toward_quorum() {
            return; // Not asked for (a network-sync element's receipt counts, though).
        }
        if self.volumes.get(vi).is_some_and(|v| v.removed.is_some()) {
            return; // Sent before the element heard of the removal.
        }
        if vi >= self.volumes.len() || sequence > self.volumes[vi].queue.last_sequence() {
            return self.fail_element(
                now,
                element,
                Failure::Protocol(format!("received sequence {sequence} of volume {volume}, newer than any assigned")),
                true,
            );
        }
        let e = &mut self.elements[element.0 as usize];
        if e.state != ElementState::InSync || e.volume_recovery[vi].off_queue() {
            return;
        }
        let after = e.weak_through[vi].max(e.applied[vi]);
        if sequence <= after {
            return;
        }
        e.weak_through[vi] = sequence;
        for entry in self.volumes[vi].queue.range_mut(after, sequence) {
            entry.weak_by.insert(element);
            if let Some(at) = entry.assigned_at {
                e.ack_latency.observe(now.0.saturating_sub(at.0));
            }
        }
        self.settle_volume(now, volume);
    }

    /// A recovering element that holds everything the queues hold rejoins: true if it did.
    fn maybe_in_sync(&mut self, now: Time, element: ElementId) -> bool {
        let e = &self.elements[element.0 as usize];
        let ElementState::Recovering(kind) = e.state else { return false };
        let caught_up = self
            .volumes
            .iter()
            .enumerate()
            .all(|(i, v)| !e.volume_recovery[i].off_queue() && e.applied[i] >= v.queue.last_sequence());
        if !caught_up {
            return false;
        }
        let recovery = e.recovery.as_ref().expect("recovering has a recovery");
        let last = LastRecovery {
            kind,
            records: recovery.start.iter().zip(&e.applied).map(|(s, a)| a.0.saturating_sub(s.0)).sum(),
            copied_bytes: recovery.copied_bytes,
            micros: now.micros_since(recovery.started),
        };
        let e = &mut self.elements[element.0 as usize];
        e.last_recovery = Some(last);
        e.recovery = None;
        e.replay_tried = ElementSet::default();
        e.copy_passes = 0;
        e.state = ElementState::InSync;
        self.emit(Action::Event(Event::ElementInSync { element }));
        self.after_membership_change(now);
        true
    }

    /// Re-evaluate every volume after the set of in-sync elements changed.
    fn after_membership_change(&mut self, now: Time) {
        if !self.ready {
            return;
        }
        self.tell_removed();
        let in_sync = self.in_sync_count();
        if self.any_in_sync() {
            // An in-sync peer serves every copy that waited for a source, even one whose copy
            // failed from it before it was in sync.
            for e in &mut self.elements {
                if e.volume_recovery.contains(&VolumeRecovery::AwaitingSource) {
                    e.replay_tried = ElementSet::default();
                }
            }
            self.start_waiting_copies();
        }
        for i in 0..self.volumes.len() {
            let volume = VolumeId(i as u32);
            let mode = if in_sync >= self.config.quorum { VolumeMode::ReadWrite } else { VolumeMode::ReadOnly };
            if self.volumes[i].mode != mode {
                self.volumes[i].mode = mode;
                self.emit(Action::Event(Event::VolumeMode { volume, mode, in_sync }));
            }
            self.settle_volume(now, volume);
        }
    }

    /// Answer what can be answered, fail what must fail, evict and admit.
    fn settle_volume(&mut self, now: Time, volume: VolumeId) {
        let vi = volume.0 as usize;
        let quorum = self.config.quorum;
        let (counting, weak_acks) = (self.counting, self.weak_acks);
        let in_sync: ElementSet = {
            let mut s = ElementSet::default();
            for (i, e) in self.elements.iter().enumerate() {
                if e.state == ElementState::InSync {
                    s.insert(ElementId(i as u8));
                }
            }
            s
        };
        let mut replies = Vec::new();
        let v = &mut self.volumes[vi];
        let last = v.queue.last_sequence();
        while v.host_resolved < last {
            let sequence = v.host_resolved.next();
            let Some(entry) = v.queue.get_mut(sequence) else {
                v.host_resolved = sequence;
                continue;
            };
            let held = ElementSet((entry.acked_by.0 | entry.weak_by.0) & in_sync.0 & counting.0).len();
            let outcome = if held >= quorum {
                Ok(())
            } else if v.mode == VolumeMode::ReadOnly {
                Err(HostError::QuorumLost)
            } else {
                break;
            };
            if outcome.is_ok() {
                v.host_acked = sequence;
            }
            if let HostReply::Waiting(token) = entry.host_reply {
                replies.push((token, Reply::Done(outcome)));
            }
            entry.host_reply = HostReply::Done;
            v.host_resolved = sequence;
        }
        // A FLUSH answers once every write before it is durable on Q elements, whatever their
        // ack policies: with weaker ones that comes after the writes' own answers.
        if weak_acks {
            // What left the queue was applied by every live element first.
            v.durable_through = v.durable_through.max(v.queue.evicted_through().min(v.host_resolved));
            while v.durable_through < v.host_resolved {
                let sequence = v.durable_through.next();
                match v.queue.get(sequence) {
                    Some(entry) if ElementSet(entry.acked_by.0 & in_sync.0).len() < quorum => break,
                    _ => v.durable_through = sequence,
                }
            }
        } else {
            v.durable_through = v.host_resolved;
        }
        while let Some(&(sequence, token)) = v.flushes.front() {
            let outcome = if sequence <= v.durable_through {
                Ok(())
            } else if sequence <= v.host_resolved && v.mode == VolumeMode::ReadOnly {
                Err(HostError::QuorumLost)
            } else {
                break;
            };
            v.flushes.pop_front();
            replies.push((token, Reply::Done(outcome)));
        }
        for (token, reply) in replies {
            self.reply(token, reply);
        }
        self.admit_writes(now, volume);
        self.release_held_reads(now, volume);
    }

    /// Whether an entry may leave the queue: answered, and applied by every live element the
    /// queue streams to (a replaying element catches up from its peer instead).
    fn evictable(&self, entry: &Entry) -> bool {
        let vi = entry.record.volume.0 as usize;
        entry.host_reply == HostReply::Done
            && self.elements.iter().enumerate().all(|(i, e)| {
                !e.live() || e.volume_recovery[vi].off_queue() || entry.acked_by.contains(ElementId(i as u8))
            })
    }

    fn admit_writes(&mut self, now: Time, volume: VolumeId) {
        let vi = volume.0 as usize;
        loop {
            let v = &self.volumes[vi];
            let Some(pending) = v.admission.front() else {
                self.volumes[vi].blocked_since = None;
                return;
            };
            if v.mode == VolumeMode::ReadOnly {
                let pending = self.volumes[vi].admission.pop_front().expect("front exists");
                self.reply(pending.token, Reply::Done(Err(HostError::ReadOnly)));
                continue;
            }
            let cost = pending.op.payload_bytes() + limits::WRITE_QUEUE_ENTRY_OVERHEAD_BYTES;
            while !self.volumes[vi].queue.fits(cost) {
                match self.volumes[vi].queue.front() {
                    Some(front) if self.evictable(front) => {
                        self.volumes[vi].queue.pop_front();
                    }
                    _ => break,
                }
            }
            if !self.volumes[vi].queue.fits(cost) {
                if self.volumes[vi].blocked_since.is_none() {
                    self.volumes[vi].blocked_since = Some(now);
                    self.emit(Action::Event(Event::Throttled { volume }));
                }
                return;
            }
            let pending = self.volumes[vi].admission.pop_front().expect("front exists");
            // Progress: the throttle clock measures only time blocked without any.
            self.volumes[vi].blocked_since = None;
            self.accept_record(now, volume, pending.op, HostReply::Waiting(pending.token));
        }
    }

    /// Give the operation the volume's next sequence, queue it and send it to every element
    /// the queue streams to.
    fn accept_record(&mut self, now: Time, volume: VolumeId, op: Op, host_reply: HostReply) {
        let vi = volume.0 as usize;
        let v = &mut self.volumes[vi];
        let sequence = v.queue.last_sequence().next();
        let record = Record { volume, epoch: self.epoch, sequence, op };
        self.cache.apply(volume, &record.op);
        let mut to = ElementSet::default();
        for (i, e) in self.elements.iter_mut().enumerate() {
            // Never to a volume being copied (its copy is followed by the queue from the copy's
            // sequence): one with nothing written yet is at the queue's end all the same.
            let copying = e.volume_recovery.get(vi).is_some_and(|r| r.copies());
            if e.live() && e.welcomed && !copying && e.sent_through[vi].next() == sequence {
                e.sent_through[vi] = sequence;
                to.insert(ElementId(i as u8));
            }
        }
        v.queue.push(Entry {
            record: record.clone(),
            acked_by: ElementSet::default(),
            weak_by: ElementSet::default(),
            // Acknowledgement latency is timed for host writes only.
            assigned_at: matches!(host_reply, HostReply::Waiting(_)).then_some(now),
            host_reply,
        });
        if !to.is_empty() {
            self.emit(Action::Send { to, message: HostMessage::Apply(record) });
        }
    }

    // ----- host requests --------------------------------------------------------------------

    fn check_range(&self, volume: VolumeId, offset_bytes: u64, length_bytes: u64) {
        let size = self.volumes[volume.0 as usize].spec.size_bytes;
        assert!(
            offset_bytes.checked_add(length_bytes).is_some_and(|end| end <= size),
            "request past the end of the volume: the NBD layer checks ranges"
        );
    }

    /// A write-like operation (write, trim, write-zeroes). FUA needs nothing extra: every
    /// acknowledgement is already durable on Q elements.
    pub fn handle_host_write(&mut self, now: Time, token: Token, volume: VolumeId, op: Op) {
        self.check_range(volume, op.offset_bytes(), op.length_bytes());
        assert!(op.payload_bytes() <= proto::PAYLOAD_BYTES_MAX as u64, "NBD layer bounds writes");
        assert!(op != Op::Begin, "a beginning is appended by the host core only");
        if !self.ready || self.superseded.is_some() {
            return self.hold(Deferred::Write { token, volume, op });
        }
        let v = &mut self.volumes[volume.0 as usize];
        if v.mode == VolumeMode::ReadOnly {
            return self.reply(token, Reply::Done(Err(HostError::ReadOnly)));
        }
        v.admission.push_back(PendingWrite { token, op });
        self.admit_writes(now, volume);
    }

    /// FLUSH: answered once every write accepted before it has been answered.
    pub fn handle_host_flush(&mut self, now: Time, token: Token, volume: VolumeId) {
        if !self.ready || self.superseded.is_some() {
            return self.hold(Deferred::Flush { token, volume });
        }
        let v = &mut self.volumes[volume.0 as usize];
        // Writes still waiting for room are accepted later; a flush covers them too.
        let through = Sequence(v.queue.last_sequence().0 + v.admission.len() as u64);
        if through <= v.durable_through {
            return self.reply(token, Reply::Done(Ok(())));
        }
        v.flushes.push_back((through, token));
        self.settle_volume(now, volume);
    }

    pub fn handle_host_read(
        &mut self,
        now: Time,
        token: Token,
        volume: VolumeId,
        offset_bytes: u64,
        length_bytes: u32,
    ) {
        self.read_request(now, token, volume, None, offset_bytes, length_bytes)
    }

    /// A read of snapshot `snapshot` of the volume (a read-only export): from an in-sync
    /// element that holds it (one that has not applied its record yet waits for it), never
    /// from the cache or the write queue, which hold the volume's newer content.
    pub fn handle_host_snapshot_read(
        &mut self,
        now: Time,
        token: Token,
        volume: VolumeId,
        snapshot: SnapshotRef,
        offset_bytes: u64,
        length_bytes: u32,
    ) {
        self.read_request(now, token, volume, Some(snapshot), offset_bytes, length_bytes)
    }

    fn read_request(
        &mut self,
        now: Time,
        token: Token,
        volume: VolumeId,
        snapshot: Option<SnapshotRef>,
        offset_bytes: u64,
        length_bytes: u32,
    ) {
        self.check_range(volume, offset_bytes, length_bytes as u64);
        if !self.ready || self.superseded.is_some() {
            return self.hold(Deferred::Read { token, volume, snapshot, offset_bytes, length_bytes });
        }
        if self.reads_wait_for_begin(volume.0 as usize, now) {
            return self.held_reads.push(Deferred::Read { token, volume, snapshot, offset_bytes, length_bytes });
        }
        if length_bytes == 0 {
            return self.reply(token, Reply::Read(Ok(Bytes::new())));
        }
        if snapshot.is_none() {
            if let Some(data) = self.cache.get(volume, offset_bytes, length_bytes as u64) {
                return self.answer_read(now, token, Reply::Read(Ok(data)));
            }
        }
        let read = PendingRead {
            token,
            volume,
            offset_bytes,
            kind: ReadKind::Data { length_bytes },
            element: ElementId(0),
            attempts: 0,
            snapshot,
            tried: ElementSet::default(),
            sent_at: now,
        };
        self.dispatch_read(now, read);
    }

    pub fn handle_host_block_status(
        &mut self,
        now: Time,
        token: Token,
        volume: VolumeId,
        offset_bytes: u64,
        length_bytes: u64,
    ) {
        self.block_status_request(now, token, volume, None, offset_bytes, length_bytes)
    }

    /// Block status of snapshot `snapshot` of the volume (see [`HostCore::handle_host_snapshot_read`]).
    pub fn handle_host_snapshot_block_status(
        &mut self,
        now: Time,
        token: Token,
        volume: VolumeId,
        snapshot: SnapshotRef,
        offset_bytes: u64,
        length_bytes: u64,
    ) {
        self.block_status_request(now, token, volume, Some(snapshot), offset_bytes, length_bytes)
    }

    fn block_status_request(
        &mut self,
        now: Time,
        token: Token,
        volume: VolumeId,
        snapshot: Option<SnapshotRef>,
        offset_bytes: u64,
        length_bytes: u64,
    ) {
        self.check_range(volume, offset_bytes, length_bytes);
        if !self.ready || self.superseded.is_some() {
            return self.hold(Deferred::BlockStatus { token, volume, snapshot, offset_bytes, length_bytes });
        }
        if self.reads_wait_for_begin(volume.0 as usize, now) {
            return self.held_reads.push(Deferred::BlockStatus { token, volume, snapshot, offset_bytes, length_bytes });
        }
        let read = PendingRead {
            token,
            volume,
            offset_bytes,
            kind: ReadKind::BlockStatus { length_bytes },
            element: ElementId(0),
            attempts: 0,
            snapshot,
            tried: ElementSet::default(),
            sent_at: now,
        };
        self.dispatch_read(now, read);
    }

    /// The closest in-sync element: lowest measured round-trip time, then configuration order.
    fn closest_in_sync(&self) -> Option<ElementId> {
        self.closest_in_sync_but(ElementSet::default())
    }

    /// As [`HostCore::closest_in_sync`], leaving out `tried`.
    fn closest_in_sync_but(&self, tried: ElementSet) -> Option<ElementId> {
        self.elements
            .iter()
            .enumerate()
            .filter(|(i, e)| e.state == ElementState::InSync && e.session && !tried.contains(ElementId(*i as u8)))
            .min_by_key(|(i, e)| (e.rtt_us.unwrap_or(u64::MAX), *i))
            .map(|(i, _)| ElementId(i as u8))
    }

    /// Send a read to the closest element that can answer it, after the reads waiting before
    /// it; it waits if that element's window is full (`limits::READ_WINDOW_MS`).
    fn dispatch_read(&mut self, now: Time, read: PendingRead) {
        if !self.reads_waiting.is_empty() {
            return self.reads_waiting.push_back(read);
        }
        if let Some(read) = self.send_read(now, read) {
            self.reads_waiting.push_back(read);
        }
    }

    /// Send the waiting reads, oldest first, while their elements have room.
    fn dispatch_waiting_reads(&mut self, now: Time) {
        while let Some(read) = self.reads_waiting.pop_front() {
            if let Some(read) = self.send_read(now, read) {
                self.reads_waiting.push_front(read);
                break;
            }
        }
    }

    /// The most reply bytes of reads out at element `e` (see `limits::READ_WINDOW_MS`).
    fn read_window_bytes(&self, e: ElementId) -> u64 {
        let measured = self.elements[e.0 as usize].read_rate.unwrap_or(0) * limits::READ_WINDOW_MS / 1000;
        measured.max(limits::READ_WINDOW_BYTES_MIN)
    }

    /// Send `read` to the closest element that can answer it (or fail it if none can); give
    /// it back if that element's window has no room for it.
    #[must_use]
    fn send_read(&mut self, now: Time, mut read: PendingRead) -> Option<PendingRead> {
        let closest = match read.snapshot {
            None => self.closest_in_sync(),
            Some(_) => self.closest_in_sync_but(read.tried),
        };
        let element = match closest {
            Some(e) if read.attempts < READ_ATTEMPTS_MAX => e,
            _ => {
                let reply = match read.kind {
                    ReadKind::Data { .. } => Reply::Read(Err(HostError::Unavailable)),
                    ReadKind::BlockStatus { .. } => Reply::BlockStatus(Err(HostError::Unavailable)),
                };
                self.reply(read.token, reply);
                return None;
            }
        };
        let out = self.elements[element.0 as usize].read_bytes_out;
        if self.config.read_window && out > 0 && out + read.reply_bytes() > self.read_window_bytes(element) {
            return Some(read);
        }
        read.attempts += 1;
        read.element = element;
        read.sent_at = now;
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        let message = match read.kind {
            ReadKind::Data { length_bytes } => HostMessage::Read {
                request_id,
                volume: read.volume,
                offset_bytes: read.offset_bytes,
                length_bytes,
                snapshot: read.snapshot,
            },
            ReadKind::BlockStatus { length_bytes } => HostMessage::BlockStatus {
                request_id,
                volume: read.volume,
                offset_bytes: read.offset_bytes,
                length_bytes,
                snapshot: read.snapshot,
            },
        };
        self.reads_insert(request_id, read);
        let mut to = ElementSet::default();
        to.insert(element);
        self.emit(Action::Send { to, message });
        None
    }

    /// Note a read out at its element.
    fn reads_insert(&mut self, request_id: u64, read: PendingRead) {
        self.elements[read.element.0 as usize].read_bytes_out += read.reply_bytes();
        self.reads.insert(request_id, read);
    }

    /// Take back a read out at its element.
    fn reads_remove(&mut self, request_id: u64) -> Option<PendingRead> {
        let read = self.reads.remove(&request_id)?;
        let e = &mut self.elements[read.element.0 as usize];
        e.read_bytes_out = e.read_bytes_out.checked_sub(read.reply_bytes()).expect("counted when sent");
        Some(read)
    }

    fn on_read_reply(&mut self, now: Time, element: ElementId, request_id: u64, applied: Sequence, result: ReadResult) {
        let Some(read) = self.reads_remove(request_id) else {
            return; // Re-dispatched after this element failed.
        };
        if read.element != element {
            self.reads_insert(request_id, read);
            return self.fail_element(now, element, Failure::Protocol("reply to another element's read".into()), true);
        }
        // What its link delivers (see `ElementRuntime::read_rate`).
        let e = &mut self.elements[element.0 as usize];
        let idle = e.read_bytes_out == 0;
        let start = e.last_read_reply.map_or(read.sent_at, |t| t.max(read.sent_at));
        let (since, bytes) = e.read_sample.take().unwrap_or((start, 0));
        let bytes = bytes + read.reply_bytes();
        let elapsed_us = now.0.saturating_sub(since.0);
        if elapsed_us >= READ_RATE_SAMPLE_US_MIN || (idle && elapsed_us > 0) {
            let sample = bytes * 1_000_000 / elapsed_us;
            e.read_rate = Some(e.read_rate.map_or(sample, |rate| (rate * 7 + sample) / 8));
        } else if !idle {
            e.read_sample = Some((since, bytes));
        }
        e.last_read_reply = (!idle).then_some(now);
        if let Some(snapshot) = read.snapshot {
            return self.on_snapshot_read_reply(now, element, read, snapshot, result);
        }
        let vi = read.volume.0 as usize;
        let queue = &self.volumes[vi].queue;
        if applied > queue.last_sequence() {
            self.reads_insert(request_id, read);
            return self.fail_element(
                now,
                element,
                Failure::Protocol(format!("read reply claims sequence {applied}, beyond the newest")),
                true,
            );
        }
        match (read.kind, result) {
            (_, ReadResult::Data(Err(reason)) | ReadResult::Extents(Err(reason))) => {
                self.reads_insert(request_id, read);
                self.fail_element(now, element, Failure::ReadFailed(reason), true);
            }
            (ReadKind::Data { length_bytes }, ReadResult::Data(Ok(ReadData { data, crcs }))) => {
                if data.len() != length_bytes as usize {
                    self.reads_insert(request_id, read);
                    return self.fail_element(now, element, Failure::Protocol("short read reply".into()), true);
                }
                // The checksums the element stored (computed when this host element received
                // the writes): what the host gets is what it wrote.
                if let Err(mismatch) = proto::pieces::check_pieces(read.offset_bytes, &data, &crcs) {
                    let name = self.volumes[vi].spec.name.clone();
                    let (first, end) = (
                        read.offset_bytes / BLOCK_BYTES,
                        (read.offset_bytes + length_bytes as u64).div_ceil(BLOCK_BYTES),
                    );
                    self.reads_insert(request_id, read);
                    self.fail_element(now, element, Failure::ReadChecksum(format!("volume {name}: {mismatch}")), true);
                    return self.scrub_range(now, vi, first, end);
                }
                if applied < queue.evicted_through() {
                    // Writes between what it applied and what we still hold are gone from the
                    // queue: this copy may be stale. Ask again (the element has caught up since).
                    return self.dispatch_read(now, read);
                }
                let data = if queue.touches(applied, read.offset_bytes, data.len() as u64) {
                    let mut buf = data.to_vec();
                    queue.overlay(applied, read.offset_bytes, &mut buf);
                    Bytes::from(buf)
                } else {
                    data
                };
                self.cache.fill(read.volume, read.offset_bytes, &data);
                self.answer_read(now, read.token, Reply::Read(Ok(data)));
            }
            (ReadKind::BlockStatus { length_bytes }, ReadResult::Extents(Ok(extents))) => {
                if applied < queue.evicted_through() {
                    return self.dispatch_read(now, read);
                }
                let extents = overlay_extents(queue, applied, read.offset_bytes, length_bytes, extents);
                self.answer_read(now, read.token, Reply::BlockStatus(Ok(extents)));
            }
            _ => {
                self.reads_insert(request_id, read);
                self.fail_element(
                    now,
                    element,
                    Failure::Protocol("reply kind does not match the request".into()),
                    true,
                );
            }
        }
    }

    /// A snapshot's content is the element's answer as it is (no newer write applies to it).
    /// An element that cannot answer (it holds no such snapshot, its copy fails a checksum) is
    /// asked no more for this read, and another one is.
    fn on_snapshot_read_reply(
        &mut self,
        now: Time,
        element: ElementId,
        mut read: PendingRead,
        snapshot: SnapshotRef,
        result: ReadResult,
    ) {
        let checked = match (read.kind, result) {
            (ReadKind::Data { length_bytes }, ReadResult::Data(Ok(ReadData { data, crcs }))) => {
                if data.len() != length_bytes as usize {
                    Err("short read reply".to_string())
                } else {
                    proto::pieces::check_pieces(read.offset_bytes, &data, &crcs)
                        .map(|()| Reply::Read(Ok(data)))
                        .map_err(|m| m.to_string())
                }
            }
            (ReadKind::BlockStatus { .. }, ReadResult::Extents(Ok(extents))) => Ok(Reply::BlockStatus(Ok(extents))),
            (_, ReadResult::Data(Err(reason)) | ReadResult::Extents(Err(reason))) => Err(reason),
            _ => Err("reply kind does not match the request".to_string()),
        };
        match checked {
            Ok(reply) => self.answer_read(now, read.token, reply),
            Err(reason) => {
                let (volume, id) = (read.volume, snapshot.id);
                self.emit(Action::Event(Event::SnapshotReadRefused { volume, element, id, reason }));
                read.tried.insert(element);
                self.dispatch_read(now, read);
            }
        }
    }

    // ----- start-up ---------------------------------------------------------------------------

    fn maybe_become_ready(&mut self, now: Time) {
        if self.ready || !self.fetches.is_empty() {
            return;
        }
        let welcomed: Vec<usize> = (0..self.elements.len()).filter(|&i| self.elements[i].welcome.is_some()).collect();
        let grace_over = self.grace_over || now >= self.started.plus_ms(self.config.startup_grace_ms);
        // The start-up set meets every write quorum, so it holds every acknowledged write:
        // only if its members hold their volumes. One whose full recovery was interrupted
        // holds nothing consistent of that volume (it says `copying`), however recently it
        // acknowledged writes: it counts for no volume it is copying.
        let holding = |vi: usize| {
            welcomed.iter().filter(|&&i| !self.elements[i].welcome.as_ref().expect("welcomed")[vi].copying).count()
        };
        let enough = welcomed.len() == self.elements.len()
            || (grace_over
                && welcomed.len() >= self.start_minimum()
                && (0..self.volumes.len()).all(|vi| holding(vi) >= self.start_minimum()));
        if !enough {
            return;
        }
        // Per volume, the most advanced element defines where the sequence continues. Those
        // behind it are brought level through the write queue, with the records fetched from
        // that element's replay log (roll forward).
        let mut fetches = Vec::new();
        for vi in 0..self.volumes.len() {
            let states: Vec<(usize, VolumeState)> = welcomed
                .iter()
                .map(|&i| (i, self.elements[i].welcome.as_ref().expect("welcomed")[vi].clone()))
                .collect();
            // A newer epoch's history supersedes an older one's at any sequence: the host
            // element of that epoch started from everything a quorum had acknowledged.
            let (source, top, top_epoch) = states
                .iter()
                .max_by_key(|(i, s)| (s.applied_epoch, s.applied_sequence, std::cmp::Reverse(*i)))
                .map(|(i, s)| (*i, s.applied_sequence, s.applied_epoch))
                .expect("at least one welcomed element");
            // One being copied holds nothing to bring level: the copy does (and a fetch from
            // sequence 1 would outrun every replay log).
            let low = states
                .iter()
                .filter(|(_, s)| !s.copying)
                .map(|(_, s)| s.applied_sequence)
                .filter(|&s| s <= top)
                .min()
                .unwrap_or(top);
            let v = &mut self.volumes[vi];
            if low < top {
                // One record more than needed, so the epoch at `low` is known and a diverged
                // element sitting there is recognised.
                let after = Sequence(low.0.saturating_sub(1));
                v.queue = WriteQueue::new(self.config.write_queue_bytes, after, Epoch(0));
                fetches.push(Fetch {
                    volume: VolumeId(vi as u32),
                    element: ElementId(source as u8),
                    after,
                    through: top,
                    through_epoch: top_epoch,
                    collected: Vec::new(),
                });
            } else {
                v.queue = WriteQueue::new(self.config.write_queue_bytes, top, top_epoch);
            }
            v.host_resolved = v.queue.last_sequence();
            v.host_acked = v.queue.last_sequence();
        }
        if fetches.is_empty() {
            return self.become_ready(now);
        }
        for fetch in fetches {
            self.send_fetch(fetch);
        }
    }

    /// Ask the source for the next part of what a start-up fetch still misses.
    fn send_fetch(&mut self, fetch: Fetch) {
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        let mut to = ElementSet::default();
        to.insert(fetch.element);
        let after = fetch.collected.last().map_or(fetch.after, |r| r.sequence);
        let message = HostMessage::FetchLog { request_id, volume: fetch.volume, after, max_bytes: FETCH_BYTES_MAX };
        self.fetches.insert(request_id, fetch);
        self.emit(Action::Send { to, message });
    }

    fn on_log_records(&mut self, now: Time, element: ElementId, request_id: u64, result: Result<Vec<Record>, String>) {
        let Some(fetch) = self.fetches.remove(&request_id) else { return };
        if fetch.element != element {
            self.fetches.insert(request_id, fetch);
            return self.fail_element(
                now,
                element,
                Failure::Protocol("log records for another element's request".into()),
                true,
            );
        }
        let mut fetch = fetch;
        match result {
            Ok(records) => {
                let before = fetch.collected.len();
                for record in records {
                    let expected = fetch.collected.last().map_or(fetch.after, |r| r.sequence).next();
                    if record.sequence != expected || record.volume != fetch.volume || expected > fetch.through {
                        break;
                    }
                    fetch.collected.push(record);
                }
                let reached = fetch.collected.last().map_or(fetch.after, |r| r.sequence);
                if reached < fetch.through && fetch.collected.len() > before {
                    return self.send_fetch(fetch);
                }
            }
            Err(reason) => {
                self.emit(Action::Event(Event::ElementFailed { element, reason: Failure::LogFetchFailed(reason) }));
            }
        }
        self.finish_fetch(now, fetch);
    }

    /// Put fetched records into the write queue; what could not be fetched leaves the queue
    /// starting at the source's position, so elements behind it fail admission with a reason.
    fn finish_fetch(&mut self, now: Time, mut fetch: Fetch) {
        let records = std::mem::take(&mut fetch.collected);
        let vi = fetch.volume.0 as usize;
        let mut expected = fetch.after.next();
        let mut valid = Vec::new();
        for record in records {
            if record.sequence != expected || record.volume != fetch.volume || expected > fetch.through {
                break;
            }
            expected = expected.next();
            valid.push(record);
        }
        let complete = expected > fetch.through;
        let cost: u64 = valid.iter().map(|r| r.op.payload_bytes() + limits::WRITE_QUEUE_ENTRY_OVERHEAD_BYTES).sum();
        let v = &mut self.volumes[vi];
        // Room is left for the beginning record that follows (`append_begin`).
        if complete && cost + limits::WRITE_QUEUE_ENTRY_OVERHEAD_BYTES <= self.config.write_queue_bytes {
            for record in valid {
                let mut acked_by = ElementSet::default();
                for (i, e) in self.elements.iter().enumerate() {
                    if e.welcome.as_ref().is_some_and(|w| w[vi].applied_sequence >= record.sequence) {
                        acked_by.insert(ElementId(i as u8));
                    }
                }
                self.cache.apply(fetch.volume, &record.op);
                v.queue.push(Entry {
                    record,
                    acked_by,
                    weak_by: ElementSet::default(),
                    host_reply: HostReply::Done,
                    assigned_at: None,
                });
            }
        } else {
            v.queue = WriteQueue::new(self.config.write_queue_bytes, fetch.through, fetch.through_epoch);
        }
        // Rolled-forward records are owed to no host request.
        v.host_resolved = v.queue.last_sequence();
        v.host_acked = v.queue.last_sequence();
        if self.fetches.is_empty() {
            self.become_ready(now);
        }
    }

    /// A request before the host element is ready: held, or failed once the start-up timeout
    /// has passed.
    fn hold(&mut self, request: Deferred) {
        if self.hold_expired || self.superseded.is_some() {
            return self.fail_held(request);
        }
        self.deferred.push(request);
    }

    fn fail_held(&mut self, request: Deferred) {
        let (token, reply) = match request {
            Deferred::Read { token, .. } => (token, Reply::Read(Err(HostError::Unavailable))),
            Deferred::Write { token, .. } | Deferred::Flush { token, .. } => {
                (token, Reply::Done(Err(HostError::Unavailable)))
            }
            Deferred::BlockStatus { token, .. } => (token, Reply::BlockStatus(Err(HostError::Unavailable))),
        };
        self.reply(token, reply);
    }

    /// The smallest number of welcomed elements a host element starts with once the grace
    /// period is over: a write quorum, and a majority, so that any two host elements' sets
    /// share an element. Its epoch is then above that of every host element that could have
    /// written before it, and a history is never outranked by an older host element's.
    ///
    /// And N−Q+1, so that the set meets every write quorum of an older host element: once the
    /// new epoch is taken there, an older host element can never gather Q acknowledgements
    /// again, and among the welcomes is every write it may have acknowledged.
    pub fn start_minimum(&self) -> usize {
        start_minimum_of(self.elements.len(), self.config.quorum)
    }

    /// How many elements' read leases a read needs: enough to meet every start-up set of a
    /// newer host element (`start_minimum`), so no newer one can have acknowledged anything.
    pub fn lease_minimum(&self) -> usize {
        self.elements.len() + 1 - self.start_minimum()
    }

    /// Whether no newer host element can have acknowledged a write by `now`: enough elements
    /// promised, in pongs of our epoch, to welcome nobody else until after `now`.
    pub fn lease_held(&self, now: Time) -> bool {
        !self.config.read_lease || self.elements.iter().filter(|e| e.lease_until > now).count() >= self.lease_minimum()
    }

    /// Answer a read, or hold it until the read lease is renewed: a host element another one
    /// took over from must not answer with data the new one has overwritten.
    fn answer_read(&mut self, now: Time, token: Token, reply: Reply) {
        if self.superseded.is_some() {
            return self.reply(token, unavailable_like(&reply));
        }
        if self.lease_held(now) {
            // Earlier held reads first (they were asked first).
            self.settle_lease_waiting(now);
            return self.reply(token, reply);
        }
        if self.lease_waiting.is_empty() {
            self.ping_all(now);
        }
        let deadline = now.plus_ms(self.config.heartbeat_timeout_ms);
        self.lease_waiting.push_back((token, reply, deadline));
    }

    fn ping_all(&mut self, now: Time) {
        let mut to = ElementSet::default();
        for (i, e) in self.elements.iter_mut().enumerate() {
            if e.welcomed && e.session && !e.closing() {
                to.insert(ElementId(i as u8));
                e.next_ping = now.plus_ms(self.config.heartbeat_interval_ms);
            }
        }
        if !to.is_empty() {
            self.ping(now, to);
        }
    }

    /// A ping carries its send time: the pong's round trip, and where a read lease starts.
    fn ping(&mut self, now: Time, to: ElementSet) {
        self.emit(Action::Send { to, message: HostMessage::Ping { nonce: now.0 } });
    }

    /// Answer the held reads if the lease is back, fail those past their deadline.
    fn settle_lease_waiting(&mut self, now: Time) {
        if self.lease_held(now) && self.superseded.is_none() {
            while let Some((token, reply, _)) = self.lease_waiting.pop_front() {
                self.reply(token, reply);
            }
            return;
        }
        while self.lease_waiting.front().is_some_and(|(_, _, deadline)| *deadline <= now || self.superseded.is_some()) {
            let (token, reply, _) = self.lease_waiting.pop_front().expect("checked");
            self.reply(token, unavailable_like(&reply));
        }
    }

    fn become_ready(&mut self, now: Time) {
        self.ready = true;
        for (i, v) in self.volumes.iter().enumerate() {
            let last = v.queue.last_sequence();
            self.actions.push_back(Action::Event(Event::Ready { volume: VolumeId(i as u32), last }));
        }
        for i in 0..self.elements.len() {
            if self.elements[i].welcome.is_some() {
                self.admit_element(now, ElementId(i as u8));
            }
        }
        self.after_membership_change(now);
        if self.config.begin_records {
            for vi in 0..self.volumes.len() {
                self.append_begin(now, VolumeId(vi as u32));
            }
        }
        for request in std::mem::take(&mut self.deferred) {
            self.run_deferred(now, request);
        }
    }

    fn run_deferred(&mut self, now: Time, request: Deferred) {
        match request {
            Deferred::Read { token, volume, snapshot, offset_bytes, length_bytes } => {
                self.read_request(now, token, volume, snapshot, offset_bytes, length_bytes)
            }
            Deferred::Write { token, volume, op } => self.handle_host_write(now, token, volume, op),
            Deferred::Flush { token, volume } => self.handle_host_flush(now, token, volume),
            Deferred::BlockStatus { token, volume, snapshot, offset_bytes, length_bytes } => {
                self.block_status_request(now, token, volume, snapshot, offset_bytes, length_bytes)
            }
        }
    }

    /// Append this host element's beginning record to the volume, after every record it
    /// started from (bug 7 in docs/testing.md). A start chooses the history whose last record
    /// has the newest epoch, then the longest: once Q elements hold this record, every later
    /// start sees this host element's history as newer than any tail of an older epoch that
    /// its own start did without (a write acknowledged under a weaker ack policy by an element
    /// then absent), so such a tail is diverged, never rolled forward, and what this host
    /// element serves is never undone. Reads of the volume wait until then.
    fn append_begin(&mut self, now: Time, volume: VolumeId) {
        let vi = volume.0 as usize;
        let v = &mut self.volumes[vi];
        if v.spec.size_bytes == 0 || v.removed.is_some() {
            return; // A placeholder: no element holds it.
        }
        // The start-up roll-forward leaves room for it (`finish_fetch`).
        assert!(v.queue.fits(limits::WRITE_QUEUE_ENTRY_OVERHEAD_BYTES), "no room for the beginning record");
        // Reads wait for it only with weaker ack policies; with durable ones nothing needs it.
        if self.begin_guards_reads {
            v.begin = Some(Beginning { sequence: v.queue.last_sequence().next(), since: now, overdue: false });
        }
        // Owed to no host request: resolved once it is held like any write.
        self.accept_record(now, volume, Op::Begin, HostReply::Done);
    }

    /// How many elements hold volume `vi`'s beginning record durably, while that matters:
    /// with ack policies weaker than durable (only then is `begin` set), until Q do. Only a
    /// weakly acknowledged write can be missing from a start's history (a durable one is on
    /// every start-up set), so only then can a later start bring back what this one served
    /// reads without.
    fn begin_holders(&self, vi: usize) -> Option<usize> {
        let v = &self.volumes[vi];
        if v.removed.is_some() {
            return None;
        }
        // Gone from the queue: every live element applied it first, Q at least (the queue
        // makes room only while the volume takes writes).
        let held = v.queue.get(v.begin?.sequence)?.acked_by.len();
        (held < self.config.quorum).then_some(held)
    }

    /// Whether reads of volume `vi` wait for this host element's beginning record: while
    /// fewer than Q elements hold it (`begin_holders`), for at most the start-up timeout.
    /// Past it the volume is read as it is (readable below quorum), with a warning
    /// (`Event::BeginNotHeld`).
    fn reads_wait_for_begin(&self, vi: usize, now: Time) -> bool {
        let Some(b) = self.volumes[vi].begin else { return false };
        !b.overdue && now < b.since.plus_ms(self.config.startup_timeout_ms) && self.begin_holders(vi).is_some()
    }

    /// Serve the reads held for the volume's beginning record once they need not wait, and
    /// forget the record once it matters no more.
    fn release_held_reads(&mut self, now: Time, volume: VolumeId) {
        let vi = volume.0 as usize;
        let Some(b) = self.volumes[vi].begin else { return };
        match self.begin_holders(vi) {
            None => self.volumes[vi].begin = None,
            Some(_) if self.reads_wait_for_begin(vi, now) => return,
            Some(held) if !b.overdue => {
                let reads = self.held_reads.iter().filter(|r| r.volume() == volume).count();
                self.emit(Action::Event(Event::BeginNotHeld { volume, sequence: b.sequence, held, reads }));
                self.volumes[vi].begin = Some(Beginning { overdue: true, ..b });
            }
            Some(_) => {}
        }
        if !self.held_reads.iter().any(|r| r.volume() == volume) {
            return;
        }
        let (mine, rest): (Vec<Deferred>, Vec<Deferred>) =
            std::mem::take(&mut self.held_reads).into_iter().partition(|r| r.volume() == volume);
        self.held_reads = rest;
        for request in mine {
            self.run_deferred(now, request);
        }
    }

    // ----- time -------------------------------------------------------------------------------

    pub fn handle_timeout(&mut self, now: Time) {
        self.dispatch_waiting_reads(now);
        if !self.ready {
            if now >= self.started.plus_ms(self.config.startup_grace_ms) {
                self.grace_over = true;
            }
            self.maybe_become_ready(now);
        }
        if !self.ready && !self.hold_expired && now >= self.started.plus_ms(self.config.startup_timeout_ms) {
            self.hold_expired = true;
            let copying = self
                .elements
                .iter()
                .filter(|e| e.welcome.as_ref().is_some_and(|w| w.iter().any(|s| s.copying)))
                .count();
            self.emit(Action::Event(Event::StartupTimedOut { welcomed: self.welcomed_count(), copying }));
            for request in std::mem::take(&mut self.deferred) {
                self.fail_held(request);
            }
        }
        for i in 0..self.elements.len() {
            let element = ElementId(i as u8);
            let e = &mut self.elements[i];
            if !e.session || e.closing() {
                continue;
            }
            if now >= e.last_heard.plus_ms(self.config.heartbeat_timeout_ms) {
                let silent_ms = now.micros_since(e.last_heard) / 1000;
                let reason = if e.welcomed {
                    Failure::HeartbeatTimeout { silent_ms }
                } else {
                    Failure::HandshakeTimeout { silent_ms }
                };
                if !e.welcomed {
                    // Not live, so failing it would keep the old reason: set the new one.
                    e.state = ElementState::Failed(reason.clone());
                }
                self.fail_element(now, element, reason, true);
                continue;
            }
            if !e.welcomed {
                continue;
            }
            if now >= e.next_ping {
                e.next_ping = now.plus_ms(self.config.heartbeat_interval_ms);
                self.ping(now, ElementSet::one(element));
            }
        }
        if !self.lease_waiting.is_empty() {
            self.settle_lease_waiting(now);
        }
        for vi in 0..self.volumes.len() {
            self.release_held_reads(now, VolumeId(vi as u32));
        }
        self.pump_scrubs(now);
        for vi in 0..self.volumes.len() {
            let volume = VolumeId(vi as u32);
            let Some(since) = self.volumes[vi].blocked_since else { continue };
            if now < since.plus_ms(self.config.throttle_timeout_ms) {
                continue;
            }
            // The queue stayed full: whoever holds its oldest entry is too slow to keep.
            let front = self.volumes[vi].queue.front().expect("a blocked queue is not empty");
            let sequence = front.record.sequence;
            let laggards: Vec<ElementId> = (0..self.elements.len())
                .map(|i| ElementId(i as u8))
                .filter(|&e| {
                    let el = &self.elements[e.0 as usize];
                    el.live() && !el.volume_recovery[vi].off_queue() && !front.acked_by.contains(e)
                })
                .collect();
            let name = self.volumes[vi].spec.name.clone();
            for element in laggards {
                let behind = self.volumes[vi].queue.last_sequence().0 - self.elements[element.0 as usize].applied[vi].0;
                let waited_ms = self.config.throttle_timeout_ms;
                self.fail_element(
                    now,
                    element,
                    Failure::TooSlow { volume: name.clone(), waited_ms, sequence, behind },
                    true,
                );
            }
            self.volumes[vi].blocked_since = None;
            self.settle_volume(now, volume);
        }
    }

    // ----- status -----------------------------------------------------------------------------

    pub fn status(&self, now: Time) -> HostStatus {
        let volumes = self
            .volumes
            .iter()
            .enumerate()
            .map(|(vi, v)| VolumeStatus {
                name: v.spec.name.clone(),
                size_bytes: v.spec.size_bytes,
                mode: match (self.ready, self.hold_expired) {
                    _ if self.superseded.is_some() => VolumeMode::Unavailable,
                    (true, _) => v.mode,
                    (false, false) => VolumeMode::Starting,
                    (false, true) => VolumeMode::Unavailable,
                },
                acked_sequence: v.host_acked,
                last_sequence: v.queue.last_sequence(),
                write_queue_used_bytes: v.queue.used_bytes(),
                write_queue_capacity_bytes: v.queue.capacity_bytes(),
                write_queue_oldest: v.queue.first_sequence(),
                writes_waiting: v.admission.len(),
                scrubs: self.scrub_statuses(now, vi),
                beginning: self.begin_holders(vi).zip(v.begin).map(|(held_by, b)| BeginningStatus {
                    sequence: b.sequence,
                    held_by,
                    reads_wait: self.reads_wait_for_begin(vi, now),
                    reads_held: self.held_reads.iter().filter(|r| r.volume().0 as usize == vi).count(),
                }),
            })
            .collect();
        let elements = self
            .elements
            .iter()
            .zip(&self.config.ack_policies)
            .enumerate()
            .map(|(i, (e, &ack_policy))| {
                let (state, reason) = match &e.state {
                    ElementState::InSync => ("in-sync", None),
                    ElementState::Recovering(_) => ("recovering", None),
                    ElementState::Failed(failure) => ("failed", Some(failure.clone())),
                };
                let lag = self
                    .volumes
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v.queue.last_sequence().0.saturating_sub(e.applied[i].0))
                    .sum();
                let recovery = e.recovery.as_ref().map(|r| RecoveryStatus {
                    kind: r.kind,
                    // The first copy's source while one runs, else the replay's.
                    source: e
                        .copy_source
                        .iter()
                        .flatten()
                        .next()
                        .copied()
                        .or(r.source)
                        .map(|s| self.elements[s.0 as usize].name.clone()),
                    done_records: r.start.iter().zip(&e.applied).map(|(s, a)| a.0.saturating_sub(s.0)).sum::<u64>(),
                    // Writes that arrived meanwhile are part of the way back too.
                    total_records: r
                        .start
                        .iter()
                        .zip(&self.volumes)
                        .map(|(s, v)| v.queue.last_sequence().0.saturating_sub(s.0))
                        .sum::<u64>(),
                    copy_done_bytes: e.volume_recovery.contains(&VolumeRecovery::Copying).then(|| {
                        (0..self.volumes.len())
                            .filter(|&i| e.volume_recovery[i] == VolumeRecovery::Copying)
                            .map(|i| e.copy_progress[i].0)
                            .sum()
                    }),
                    copy_total_bytes: e.volume_recovery.contains(&VolumeRecovery::Copying).then(|| {
                        (0..self.volumes.len())
                            .filter(|&i| e.volume_recovery[i] == VolumeRecovery::Copying)
                            .map(|i| self.volumes[i].spec.size_bytes)
                            .sum()
                    }),
                    copied_bytes: e.volume_recovery.contains(&VolumeRecovery::Copying).then(|| {
                        (0..self.volumes.len())
                            .filter(|&i| e.volume_recovery[i] == VolumeRecovery::Copying)
                            .map(|i| e.copy_progress[i].2)
                            .sum()
                    }),
                    elapsed_us: now.micros_since(r.started),
                    waiting_for_source: (0..self.volumes.len())
                        .filter(|&i| e.volume_recovery[i] == VolumeRecovery::AwaitingSource)
                        .map(|i| self.volumes[i].spec.name.clone())
                        .collect(),
                });
                let last_recovery = e.last_recovery.as_ref().map(|r| LastRecoveryStatus {
                    kind: r.kind,
                    records: r.records,
                    copied_bytes: r.copied_bytes,
                    seconds: r.micros as f64 / 1e6,
                });
                ElementStatus {
                    name: e.name.clone(),
                    ack_policy,
                    state,
                    reason: reason.as_ref().map(|f| f.to_string()),
                    failure: reason,
                    applied_sequence: e.applied.clone(),
                    lag,
                    rtt_us: e.rtt_us,
                    recovery,
                    last_recovery,
                    ack_latency: e.ack_latency.clone(),
                    failures: e.failures.iter().map(|(k, n)| (*k, *n)).collect(),
                    reads_out_bytes: e.read_bytes_out,
                    read_window_bytes: self.config.read_window.then(|| self.read_window_bytes(ElementId(i as u8))),
                    read_rate_bytes_per_s: e.read_rate,
                }
            })
            .collect();
        HostStatus {
            epoch: self.epoch,
            quorum: self.config.quorum,
            ready: self.ready,
            volumes,
            elements,
            read_cache_used_bytes: self.cache.used_bytes(),
            read_cache_hits: self.cache.hits,
            read_cache_misses: self.cache.misses,
            read_cache_declined: self.cache.declined,
            reads_waiting: self.reads_waiting.len() as u64,
            reads_waiting_bytes: self.reads_waiting.iter().map(PendingRead::reply_bytes).sum(),
        }
    }

    /// Invariants that hold after every input (checked by tests and the simulator).
    pub fn assert_invariants(&self) {
        self.cache.assert_invariants();
        for (i, e) in self.elements.iter().enumerate() {
            let out: u64 =
                self.reads.values().filter(|r| r.element == ElementId(i as u8)).map(PendingRead::reply_bytes).sum();
            assert_eq!(e.read_bytes_out, out, "element {i}: its read window counts the reads out at it");
        }
        let in_sync = self.in_sync_count();
        for held in &self.held_reads {
            let v = &self.volumes[held.volume().0 as usize];
            assert!(
                v.begin.is_some_and(|b| !b.overdue),
                "reads are held only for a beginning not yet held by Q, and not past the timeout"
            );
            assert!(matches!(held, Deferred::Read { .. } | Deferred::BlockStatus { .. }), "only reads wait for it");
        }
        for (vi, v) in self.volumes.iter().enumerate() {
            v.queue.assert_invariants();
            assert!(v.host_acked <= v.host_resolved);
            assert!(v.host_resolved <= v.queue.last_sequence());
            if self.ready {
                let expect = if in_sync >= self.config.quorum { VolumeMode::ReadWrite } else { VolumeMode::ReadOnly };
                assert_eq!(v.mode, expect, "volume mode follows the in-sync count");
            }
            for entry in v.queue.range(v.queue.evicted_through(), v.host_resolved) {
                assert_eq!(entry.host_reply, HostReply::Done);
            }
            for (i, e) in self.elements.iter().enumerate() {
                assert!(e.applied[vi] <= e.sent_through[vi] || !e.welcomed);
                let how = e.volume_recovery[vi];
                if how != VolumeRecovery::Streaming {
                    assert!(
                        matches!(e.state, ElementState::Recovering(_)),
                        "element {i}: volume {vi} {how:?} but the element is {:?}",
                        e.state
                    );
                }
                let source = match how {
                    VolumeRecovery::Replaying => e.recovery.as_ref().and_then(|r| r.source),
                    VolumeRecovery::Copying => e.copy_source[vi],
                    VolumeRecovery::Streaming | VolumeRecovery::AwaitingSource => None,
                };
                if matches!(how, VolumeRecovery::Replaying | VolumeRecovery::Copying) {
                    assert!(source.is_some_and(|s| s.0 as usize != i), "element {i}: {how:?} needs a peer as source");
                }
                assert_eq!(e.copy_source[vi].is_some(), how == VolumeRecovery::Copying, "element {i}: volume {vi}");
                if how == VolumeRecovery::AwaitingSource {
                    // It waits only while no peer can serve it: none is in sync.
                    assert!(!self.any_in_sync(), "element {i}: volume {vi} waits for a source beside an in-sync peer");
                    assert!(
                        !e.live() || self.copy_source(ElementId(i as u8), vi).is_none(),
                        "element {i}: volume {vi} waits for a source while a peer can serve it"
                    );
                }
                if how.copies() {
                    assert_eq!(e.recovery.as_ref().map(|r| r.kind), Some(RecoveryKind::Full));
                    assert_eq!(
                        e.applied[vi],
                        Sequence::ZERO,
                        "a volume being copied holds nothing the queue counts on"
                    );
                }
                if e.state == ElementState::InSync {
                    assert!(e.session, "an in-sync element has a session");
                    // Everything the queue holds up to its acknowledgement carries its mark.
                    for entry in v.queue.range(v.queue.evicted_through(), e.applied[vi]) {
                        assert!(entry.acked_by.contains(ElementId(i as u8)));
                    }
                }
            }
        }
    }
}

enum ReadResult {
    Data(Result<ReadData, String>),
    Extents(Result<Vec<BlockExtent>, String>),
}

/// Why an element that claims the last epoch there is is not followed: no host element could
/// ever take it over (elements refuse hellos so far ahead; a damaged or hostile element says it).
fn last_epoch_claim(seen: Epoch) -> String {
    format!("it follows epoch {seen}, the last there is: no newer epoch exists to take it over (a damaged or hostile element)")
}

/// `HostCore::start_minimum` for N elements and write quorum Q: max(Q, N−Q+1, ⌊N/2⌋+1).
pub fn start_minimum_of(n: usize, quorum: usize) -> usize {
    quorum.max(n + 1 - quorum).max(n / 2 + 1)
}

/// The failure reply of the same kind as `reply`.
fn unavailable_like(reply: &Reply) -> Reply {
    match reply {
        Reply::Read(_) => Reply::Read(Err(HostError::Unavailable)),
        Reply::Done(_) => Reply::Done(Err(HostError::Unavailable)),
        Reply::BlockStatus(_) => Reply::BlockStatus(Err(HostError::Unavailable)),
        Reply::Checked(_) => Reply::Checked(Err("the host element is not serving".into())),
    }
}

/// Mark ranges touched by queued operations newer than `applied` as allocated (a safe answer:
/// block status may always report data where there are zeroes), clip to the request, and merge.
fn overlay_extents(
    queue: &WriteQueue,
    applied: Sequence,
    offset_bytes: u64,
    length_bytes: u64,
    extents: Vec<BlockExtent>,
) -> Vec<BlockExtent> {
    let end_bytes = offset_bytes + length_bytes;
    let mut touched: Vec<(u64, u64)> = queue
        .range(applied, queue.last_sequence())
        .filter(|e| matches!(e.record.op, Op::Write { .. }))
        .map(|e| (e.record.op.offset_bytes(), e.record.op.offset_bytes() + e.record.op.length_bytes()))
        .filter(|&(s, t)| s < end_bytes && t > offset_bytes)
        .collect();
    touched.sort_unstable();
    let mut out: Vec<BlockExtent> = Vec::new();
    let mut push = |length_bytes: u64, allocated: bool| {
        if length_bytes == 0 {
            return;
        }
        match out.last_mut() {
            Some(last) if last.allocated == allocated => last.length_bytes += length_bytes,
            _ => out.push(BlockExtent { length_bytes, allocated }),
        }
    };
    let mut at = offset_bytes;
    for extent in extents {
        if at >= end_bytes {
            break;
        }
        let extent_end = (at + extent.length_bytes).min(end_bytes);
        if extent.allocated {
            push(extent_end - at, true);
        } else {
            // Split the hole around queued writes.
            let mut cursor = at;
            for &(s, t) in &touched {
                let (s, t) = (s.max(cursor), t.min(extent_end));
                if s >= t {
                    continue;
                }
                push(s - cursor, false);
                push(t - s, true);
                cursor = t;
            }
            push(extent_end - cursor, false);
        }
        at = extent_end;
    }
    if at < end_bytes {
        // The element described less than asked: report the rest as data (always safe).
        push(end_bytes - at, true);
    }
    out
}

#[cfg(test)]
mod tests;

mod scrub;
pub use scrub::{ScrubFindings, ScrubReason, ScrubStatus};
