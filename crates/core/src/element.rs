//! Sans-IO core of the storage element: the rules an element follows, with no sockets, files,
//! threads or clock.
//!
//! The shell feeds it what happened (`handle_*`: a message of a host element session, a
//! storage job done, a peer's message, a timeout) and carries out what it asks
//! ([`ElementCore::poll_action`]: write these records, adopt this epoch, serve this read, send
//! this frame, open a session with a peer). It owns:
//!
//! - **epoch adoption and fencing**: a session's `Hello` is answered in order with the records
//!   queued before it; an older epoch is refused; a newer one is adopted durably before the
//!   `Welcome`; records of a session older than the element's epoch are refused ("fenced");
//! - **duplicate and gap rules**: per volume, records apply in sequence order; a duplicate is
//!   skipped (and acknowledged), a gap or an epoch going backwards is a fault of the session;
//! - **group commit and cumulative acknowledgement**: whatever waits when storage is idle goes
//!   out as one commit; `Applied` is emitted only from [`ElementCore::handle_storage_done`], so
//!   an acknowledgement before durability cannot be expressed;
//! - **replay recovery**: the puller that fetches the gap from a peer's replay log, paced,
//!   checking the newest record's epoch first; meanwhile the current writes the host element
//!   sends are kept aside (the stash) and committed right after the gap, so a replay slower
//!   than the foreground writes still finishes (the paper's section 3);
//! - **full recovery**: ordered and tracked here, while the block walk runs in the shell;
//! - a copy source's wait for its applied sequence to reach what a `FetchBlocks` asks.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use proto::{
    ElementMessage, Epoch, HostId, HostMessage, Record, Sequence, SnapshotRef, VolumeId, VolumeSpec, VolumeState,
};

use crate::limits::{
    COMMIT_BATCH_BYTES_MAX, COMMIT_BATCH_RECORDS_MAX, EPOCH_JUMP_MAX, LEASE_MS_DEFAULT, OWNER_RELEASED_ABSENT_MS,
    OWNER_SILENCE_MS_DEFAULT, REPLAY_EMPTY_RETRY_MS, REPLAY_FETCH_BYTES, REPLAY_IDLE_TIMEOUT_MS,
    REPLAY_STASH_BYTES_MAX, SESSION_DEFERRED_MAX, SOURCE_CATCH_UP_TIMEOUT_MS, VOLUMES_PER_SESSION_MAX,
};
use crate::Time;

/// A session a host element (or a peer's recovery) opened with this element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub u64);

/// Who opened a session, as the shell authenticated it (mutual TLS: the role its certificate
/// names). What each may ask is [`role_refusal`]'s rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SessionRole {
    /// No authentication configured (a loopback-only cluster): anything goes, as before TLS.
    #[default]
    Unauthenticated,
    /// A host element: writes, epochs, recovery orders, reads, start-up log fetches, observing.
    Host,
    /// A peer element: only a replay's log fetches and a full recovery's block fetches, in a
    /// session opened at the epoch this element follows (it never sets one).
    Element,
}

/// Why a session of `role` may not send `message`, if it may not. `current` is the epoch the
/// element follows.
pub fn role_refusal(role: SessionRole, message: &HostMessage, current: Epoch) -> Option<String> {
    let kind = match message {
        HostMessage::Hello { .. } => "hello",
        HostMessage::Apply(_) => "write",
        HostMessage::Read { .. } => "read",
        HostMessage::BlockStatus { .. } => "block status",
        HostMessage::Ping { .. } => "ping",
        HostMessage::FetchLog { .. } => "replay-log fetch",
        HostMessage::Recover { .. } => "recovery order",
        HostMessage::Copy { .. } => "copy order",
        HostMessage::FetchBlocks { .. } => "block fetch",
        HostMessage::Scrub { .. } => "scrub",
        HostMessage::Observe { .. } => "observe",
        HostMessage::Release => "release",
        HostMessage::AddVolumes { .. } => "volume creation",
        HostMessage::CheckVolumes { .. } => "volume check",
        HostMessage::RemoveVolumes { .. } => "volume removal",
        HostMessage::ResizeVolumes { .. } => "volume resize",
    };
    match (role, message) {
        (SessionRole::Unauthenticated, _) => None,
        (SessionRole::Host, HostMessage::FetchBlocks { .. }) => {
            Some(format!("a host element may not send a {kind}: only an element copies blocks"))
        }
        (SessionRole::Host, _) => None,
        (SessionRole::Element, HostMessage::Hello { epoch, .. }) if *epoch != current => Some(format!(
            "an element may not set epochs: its hello names epoch {epoch}, this element follows {current}"
        )),
        (
            SessionRole::Element,
            HostMessage::Hello { .. } | HostMessage::FetchLog { .. } | HostMessage::FetchBlocks { .. },
        ) => None,
        (SessionRole::Element, _) => Some(format!("an element may not send a {kind}: only a host element may")),
    }
}

/// A session this element opened with a peer (a replay recovery's source).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(pub u64);

/// A volume of this element's storage (its number there, not a session's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalVolume(pub u32);

impl LocalVolume {
    /// A session's number whose volume was removed (`RemoveVolumes`, or a hello's placeholder
    /// of size 0): it names nothing any more.
    pub const REMOVED: LocalVolume = LocalVolume(u32::MAX);
}

/// What storage holds of a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    pub applied: Sequence,
    /// Epoch of the record at `applied` (0 before the first).
    pub applied_epoch: Epoch,
    /// An interrupted full recovery: the volume's blocks are not consistent.
    pub copying: bool,
    /// A repair waits (a block failed its checksum): `applied` holds, no record is taken.
    pub repair: bool,
}

/// What one storage commit did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommitDone {
    /// Each volume of the batch with its applied sequence and that record's epoch afterwards.
    pub applied: Vec<(LocalVolume, Sequence, Epoch)>,
    /// Records storage refused (index in the batch, reason): nothing of them was written.
    pub rejected: Vec<(usize, String)>,
}

/// Work for storage, one at a time, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageJob {
    /// Log these records with one sync, then apply them; answer with a [`CommitDone`].
    Commit(Vec<(LocalVolume, Record)>),
    /// Make this the element's epoch, held by this host element, durably.
    AdoptEpoch(Epoch, HostId),
    /// Remove these volumes durably, freeing their space (every record of them queued before
    /// is committed).
    RemoveVolumes(Vec<LocalVolume>),
    /// Grow these volumes durably to these sizes (every record queued before is committed;
    /// none queued after runs before it).
    ResizeVolumes(Vec<(LocalVolume, u64)>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageDone {
    Commit(Result<CommitDone, String>),
    AdoptEpoch(Result<(), String>),
    RemoveVolumes(Result<(), String>),
    ResizeVolumes(Result<(), String>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Info,
    Warn,
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq)]
pub enum ElementAction {
    Send {
        session: SessionId,
        message: ElementMessage,
    },
    /// End the session (after a refusal).
    Close {
        session: SessionId,
    },
    /// Create the volumes storage does not have yet; answer with
    /// [`ElementCore::handle_volumes_ensured`].
    EnsureVolumes {
        session: SessionId,
        specs: Vec<VolumeSpec>,
    },
    /// Whether volumes new here would fit, creating nothing; answer with
    /// [`ElementCore::handle_volumes_checked`].
    CheckVolumes {
        session: SessionId,
        request_id: u64,
        specs: Vec<VolumeSpec>,
    },
    Storage(StorageJob),
    /// Answer a read-only request (`Read`, `BlockStatus`, `FetchLog`, `FetchBlocks`, `Scrub`) from
    /// storage, on the session; the request keeps the session's volume number.
    Serve {
        session: SessionId,
        volume: LocalVolume,
        request: HostMessage,
    },
    /// Open a session with a peer element and say this hello; report with
    /// `handle_peer_message` (its `Welcome` first) or `handle_peer_closed`.
    ConnectPeer {
        peer: PeerId,
        address: String,
        hello: HostMessage,
    },
    SendPeer {
        peer: PeerId,
        message: HostMessage,
    },
    ClosePeer {
        peer: PeerId,
    },
    /// Run the block copy of a full recovery; report with `handle_copy_progress` and
    /// `handle_copy_done`. It stops by itself once `session` is closed.
    StartCopy {
        session: SessionId,
        session_volume: VolumeId,
        volume: LocalVolume,
        spec: VolumeSpec,
        epoch: Epoch,
        /// The host element that ordered it (for the peer's `Hello`).
        host: HostId,
        source: String,
        rate_bytes_per_s: u64,
    },
    Log {
        level: LogLevel,
        message: String,
    },
    /// A record was refused (its session also got a `Fault`): for logs, metrics and the
    /// simulator's checkers, which must not parse reasons.
    Refused {
        session: SessionId,
        volume: LocalVolume,
        sequence: Sequence,
        refusal: Refusal,
        /// It came from a peer's replay log (a replay recovery), not from the host element.
        replayed: bool,
    },
}

/// Why a record was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its session's epoch is older than the element's: a newer host element took over.
    Fenced,
    /// Older than the volume's last record (epochs never go back along a volume).
    StaleEpoch,
    /// Not the next sequence after what is applied.
    Gap,
    /// Storage refused it (a damaged base block) or failed.
    Storage,
    /// A sequence the element already holds, with another epoch or other content.
    Diverged,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ElementConfig {
    pub replay_fetch_bytes: u64,
    pub replay_stash_bytes_max: u64,
    pub commit_batch_records_max: usize,
    pub commit_batch_bytes_max: u64,
    pub replay_idle_timeout_ms: u64,
    pub source_catch_up_timeout_ms: u64,
    /// Refuse records of superseded sessions and records whose epoch goes back. Off only in
    /// the simulator's deliberately broken variant (`--broken no-fencing`), which its checkers
    /// must catch.
    pub fencing: bool,
    /// This element's identity (storage keeps it), sent in every `Welcome`.
    pub element_id: u64,
    /// The read lease each pong promises (0: none; see `LEASE_MS_DEFAULT`).
    pub lease_ms: u64,
    /// See `OWNER_SILENCE_MS_DEFAULT`.
    pub owner_silence_ms: u64,
    /// Refuse what a session's role may not send ([`role_refusal`]). Off only in the
    /// simulator's deliberately broken variant (`--broken no-role-check`).
    pub check_roles: bool,
}

impl Default for ElementConfig {
    fn default() -> Self {
        ElementConfig {
            replay_fetch_bytes: REPLAY_FETCH_BYTES,
            replay_stash_bytes_max: REPLAY_STASH_BYTES_MAX,
            commit_batch_records_max: COMMIT_BATCH_RECORDS_MAX,
            commit_batch_bytes_max: COMMIT_BATCH_BYTES_MAX,
            replay_idle_timeout_ms: REPLAY_IDLE_TIMEOUT_MS,
            source_catch_up_timeout_ms: SOURCE_CATCH_UP_TIMEOUT_MS,
            fencing: true,
            element_id: 0,
            lease_ms: LEASE_MS_DEFAULT,
            owner_silence_ms: OWNER_SILENCE_MS_DEFAULT,
            check_roles: true,
        }
    }
}

/// Where a volume stands with respect to recovery, as this element sees it.
#[derive(Debug)]
enum Recovery {
    /// Records come from the host element in order.
    Streaming,
    /// Pulling a gap from a peer's replay log, current writes kept aside.
    Replaying(Box<Replay>),
    /// The gap is pulled; the stash is being committed. `RecoveryDone` goes out once `target`
    /// is applied.
    Draining { session: SessionId, session_volume: VolumeId, target: Sequence },
    /// A block copy runs in the shell. `next`: a newer order waiting for it to stop.
    Copying { session: SessionId, next: Option<Box<CopyOrder>> },
}

#[derive(Debug)]
struct CopyOrder {
    session: SessionId,
    session_volume: VolumeId,
    source: String,
    rate_bytes_per_s: u64,
}

#[derive(Debug)]
struct Replay {
    /// The host element session that ordered it: pulled records are acknowledged there.
    session: SessionId,
    session_volume: VolumeId,
    epoch: Epoch,
    source: String,
    rate_bytes_per_s: u64,
    peer: PeerId,
    phase: ReplayPhase,
    /// Pull up to here from the peer.
    through: Sequence,
    /// Newest record fetched and queued for commit.
    cursor: Sequence,
    /// Current writes after `through`, contiguous, waiting for the gap.
    stash: VecDeque<Record>,
    stash_bytes: u64,
    /// Newest current write seen; beyond the stash when it overflowed.
    seen: Sequence,
    started: Time,
    fetched_bytes: u64,
    /// The next fetch waits until this is applied (about two fetches in the committer at most).
    backlog_until_applied: Sequence,
    idle_since: Option<Time>,
    request_id: u64,
    /// The stash overflowed: no more pacing (see `schedule_fetch`).
    unpaced: bool,
    /// When the peer was last asked something (the connection, the check, a fetch): it has
    /// `replay_idle_timeout_ms` to answer.
    asked_at: Time,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayPhase {
    Connecting,
    /// Asked the peer for our newest record, to compare epochs.
    Verifying {
        own: Sequence,
        own_epoch: Epoch,
    },
    Fetching {
        request_id: u64,
    },
    /// Waiting for the pace, for the peer to have more, or (`until` None) for the committer.
    Waiting {
        until: Option<Time>,
    },
    /// Failed: `RecoveryDone` was sent; current writes are dropped until a new order.
    Stopped,
}

#[derive(Debug)]
struct Volume {
    spec: VolumeSpec,
    applied: Sequence,
    applied_epoch: Epoch,
    copy_interrupted: bool,
    /// A block failed its checksum: the volume waits for a repair (a full recovery that
    /// verifies every block); its applied sequence still holds.
    repair: bool,
    recovery: Recovery,
    /// The newest records applied in this run of the element: (sequence, epoch, digest), at
    /// most `RECENT_RECORDS_MAX`. A record sent again at one of these sequences must be the
    /// same record; another one means two histories, and is a fault, never a duplicate.
    recent: VecDeque<(Sequence, Epoch, u32)>,
    /// Removed (its storage is gone); its local number stays taken until the element restarts.
    removed: bool,
    /// The host element's session whose records or recovery orders it followed last.
    followed: Option<SessionId>,
}

impl Volume {
    /// A full recovery rebuilds the volume: under way, or interrupted and to be resumed. It
    /// takes no records meanwhile (the copy supersedes them).
    fn rebuilding(&self) -> bool {
        self.copy_interrupted || matches!(self.recovery, Recovery::Copying { .. })
    }

    /// A local volume no session may name (a snapshot storage numbers among volumes): held
    /// like a removed one.
    fn placeholder() -> Volume {
        Volume {
            spec: VolumeSpec { name: String::new(), size_bytes: 0, clone_of: None, at_least: false },
            applied: Sequence::ZERO,
            applied_epoch: Epoch(0),
            copy_interrupted: false,
            repair: false,
            recovery: Recovery::Streaming,
            recent: VecDeque::new(),
            followed: None,
            removed: true,
        }
    }
}

/// Records remembered per volume to check duplicates against (a host element resends only
/// what it sent since the element's last acknowledgement, far fewer). 24 bytes each: at most
/// 24 KiB per volume, 96 MiB for the largest store (4096 volumes).
const RECENT_RECORDS_MAX: usize = 1024;

/// A digest of what a record does (kind, range, content): a write's content through its piece
/// checksums, which storage checked the data against before it committed.
fn record_digest(op: &proto::Op) -> u32 {
    let (kind, offset, length, crcs): (u8, u64, u64, &[u32]) = match op {
        proto::Op::Write { offset_bytes, data, crcs } => (1, *offset_bytes, data.len() as u64, crcs),
        proto::Op::Trim { offset_bytes, length_bytes } => (2, *offset_bytes, *length_bytes, &[]),
        proto::Op::WriteZeroes { offset_bytes, length_bytes } => (3, *offset_bytes, *length_bytes, &[]),
        proto::Op::Snapshot { id } => (4, *id, 0, &[]),
        proto::Op::SnapshotDelete { id } => (5, *id, 0, &[]),
        proto::Op::Begin => (6, 0, 0, &[]),
    };
    let mut head = [0u8; 17];
    head[0] = kind;
    head[1..9].copy_from_slice(&offset.to_le_bytes());
    head[9..17].copy_from_slice(&length.to_le_bytes());
    crcs.iter().fold(proto::crc32c(&head), |digest, crc| crc32c::crc32c_append(digest, &crc.to_le_bytes()))
}

#[derive(Debug, Default)]
struct Session {
    role: SessionRole,
    epoch: Option<Epoch>,
    /// The host element it speaks for (set with the hello).
    host: HostId,
    /// Its `Hello` is being answered: what it sends meanwhile waits in `deferred`.
    hello_pending: bool,
    /// The `Hello` whose volumes storage is creating.
    hello: Option<(Epoch, Vec<VolumeSpec>)>,
    /// The `AddVolumes` whose volumes storage is creating: what the session sends meanwhile
    /// waits in `deferred`, as during a hello.
    adding: Option<Vec<VolumeSpec>>,
    /// Its `ResizeVolumes` waits for storage (behind the commits queued before it): what the
    /// session sends meanwhile waits in `deferred` (a read of the new blocks must not reach
    /// storage before they exist).
    resizing: bool,
    /// The admin address its hello gave.
    admin: String,
    /// Its hello asked for `Received` as each record arrives.
    receipt_acks: bool,
    deferred: VecDeque<HostMessage>,
    /// Session volume number → local volume.
    volumes: Vec<LocalVolume>,
}

/// A record refused at commit: its session, volume, sequence, whether a replay brought it, why.
type RefusedRecord = (SessionId, LocalVolume, Sequence, bool, Refusal, String);

#[derive(Debug)]
struct Commit {
    session: SessionId,
    session_volume: VolumeId,
    /// Epoch of the session that sent it (or that ordered the replay it came from).
    session_epoch: Epoch,
    volume: LocalVolume,
    record: Record,
    /// Pulled from a peer by a replay recovery.
    replayed: bool,
}

#[derive(Debug)]
enum Job {
    Commit(Commit),
    Hello {
        session: SessionId,
        epoch: Epoch,
        host: HostId,
    },
    /// Remove these volumes once the commits queued before are done; answer the session's
    /// `RemoveVolumes` (if one asked) with its numbers. For a hello's placeholders, the
    /// session is `reply`'s with no numbers: if removing fails, its hello is refused.
    Remove {
        volumes: Vec<LocalVolume>,
        reply: Option<(SessionId, Vec<VolumeId>)>,
    },
    /// Grow these volumes once the commits queued before are done; answer the session's
    /// `ResizeVolumes` with its numbers.
    Resize {
        volumes: Vec<(LocalVolume, u64)>,
        reply: (SessionId, Vec<VolumeId>),
    },
}

#[derive(Debug)]
enum InFlight {
    Commit {
        records: Vec<Commit>,
        /// Sessions owed a cumulative `Applied` once the commit is done (duplicates included).
        acks: Vec<(SessionId, VolumeId, LocalVolume)>,
    },
    AdoptEpoch {
        session: SessionId,
        epoch: Epoch,
        host: HostId,
        previous: Epoch,
    },
    Remove {
        volumes: Vec<LocalVolume>,
        reply: Option<(SessionId, Vec<VolumeId>)>,
    },
    Resize {
        volumes: Vec<(LocalVolume, u64)>,
        reply: (SessionId, Vec<VolumeId>),
    },
}

/// A copy source's `FetchBlocks`, or a `Scrub`, waiting for `min_applied`.
#[derive(Debug)]
struct WaitingFetch {
    session: SessionId,
    volume: LocalVolume,
    min_applied: Sequence,
    deadline: Time,
    request: HostMessage,
}

pub struct ElementCore {
    config: ElementConfig,
    epoch: Epoch,
    /// The host element that `epoch` belongs to (`HostId(0)`: not known, say after an epoch
    /// raised by records alone). A hello with the same epoch from another host element is
    /// refused: two host elements never share an epoch.
    holder: HostId,
    /// The last time a session of the current epoch sent something or closed (the element's
    /// start if none ever did): a host element that wants the element back, and a standby,
    /// ask how long its owner is gone.
    owner_heard_at: Option<Time>,
    /// The holder sent `Release` (a graceful handover): it is gone for good.
    owner_released: bool,
    /// The holder's admin address, as its hello gave it (empty: not known since this start).
    holder_admin: String,
    /// No other host element's epoch is welcomed before this (the read lease promised in the
    /// pongs). Set to a full lease at start: a promise made before a restart still holds.
    promised_until: Option<Time>,
    /// A newer host element's hello waits at the head of `jobs` for `promised_until`.
    hello_waits: bool,
    volumes: Vec<Volume>,
    sessions: BTreeMap<SessionId, Session>,
    jobs: VecDeque<Job>,
    in_flight: Option<InFlight>,
    /// Storage failed: it accepts no more changes until the element restarts.
    storage_failed: Option<String>,
    waiting_fetches: Vec<WaitingFetch>,
    next_peer: u64,
    now: Time,
    actions: VecDeque<ElementAction>,
}

impl fmt::Debug for ElementCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElementCore")
            .field("epoch", &self.epoch)
            .field("volumes", &self.volumes)
            .field("sessions", &self.sessions.len())
            .field("jobs", &self.jobs.len())
            .field("in_flight", &self.in_flight.is_some())
            .finish()
    }
}

impl ElementCore {
    /// `volumes`: what storage holds, in local volume order.
    pub fn new(
        config: ElementConfig,
        epoch: Epoch,
        holder: HostId,
        volumes: Vec<(VolumeSpec, VolumeInfo)>,
    ) -> ElementCore {
        let volumes = volumes
            .into_iter()
            .map(|(spec, info)| Volume {
                // Storage lists a volume removed since it was opened with size 0.
                removed: spec.size_bytes == 0,
                spec,
                applied: info.applied,
                applied_epoch: info.applied_epoch,
                copy_interrupted: info.copying,
                repair: info.repair,
                recovery: Recovery::Streaming,
                recent: VecDeque::new(),
                followed: None,
            })
            .collect();
        ElementCore {
            config,
            epoch,
            holder,
            owner_heard_at: None,
            owner_released: false,
            holder_admin: String::new(),
            promised_until: None,
            hello_waits: false,
            volumes,
            sessions: BTreeMap::new(),
            jobs: VecDeque::new(),
            in_flight: None,
            storage_failed: None,
            waiting_fetches: Vec::new(),
            next_peer: 1,
            now: Time(0),
            actions: VecDeque::new(),
        }
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Why a hello of `epoch` from `host` cannot be welcomed now, if it cannot. Epochs only
    /// grow, so a hello refused now would be refused later too.
    fn epoch_refusal(&self, epoch: Epoch, host: HostId) -> Option<String> {
        if epoch < self.epoch {
            Some(format!("stale epoch {epoch}: this element already follows epoch {}", self.epoch))
        } else if epoch == self.epoch && (host != self.holder || host == HostId(0)) {
            Some(format!("epoch {epoch} belongs to another host element; a new host element takes a newer one"))
        } else if epoch.0 - self.epoch.0 > EPOCH_JUMP_MAX {
            Some(format!(
                "epoch {epoch} jumps more than {EPOCH_JUMP_MAX} past this element's {}: it would leave no newer epoch for any host element",
                self.epoch
            ))
        } else {
            None
        }
    }

    /// The newest epoch of a hello waiting for its turn: its volumes being ensured, queued
    /// behind storage (or a read lease), or its epoch being adopted.
    fn pending_hello_epoch(&self) -> Option<Epoch> {
        let ensuring = self.sessions.values().filter_map(|st| st.hello.as_ref().map(|(e, _)| *e));
        let queued = self.jobs.iter().filter_map(|j| match j {
            Job::Hello { epoch, .. } => Some(*epoch),
            _ => None,
        });
        let adopting = match &self.in_flight {
            Some(InFlight::AdoptEpoch { epoch, .. }) => Some(*epoch),
            _ => None,
        };
        ensuring.chain(queued).chain(adopting).max()
    }

    /// What an `Observe` would be answered now: the epoch followed, its holder, and how long
    /// the holder has been gone (the simulator's standby asks this way).
    pub fn observe(&mut self, now: Time) -> (Epoch, HostId, u64) {
        self.tick(now);
        (self.epoch, self.holder, self.owner_absent_ms())
    }

    /// Durably applied sequence of a volume, as storage last reported it.
    pub fn applied(&self, volume: LocalVolume) -> Sequence {
        self.volumes[volume.0 as usize].applied
    }

    /// Whether records of a volume wait for storage or are being committed.
    pub fn commits_pending(&self, volume: LocalVolume) -> bool {
        let in_flight = matches!(&self.in_flight, Some(InFlight::Commit { records, .. }) if records.iter().any(|c| c.volume == volume));
        in_flight || self.jobs.iter().any(|j| matches!(j, Job::Commit(c) if c.volume == volume))
    }

    pub fn poll_action(&mut self) -> Option<ElementAction> {
        self.actions.pop_front()
    }

    /// The earliest time `handle_timeout` has something to do.
    pub fn poll_timeout(&self) -> Option<Time> {
        let idle_timeout_us = self.config.replay_idle_timeout_ms * 1000;
        let replays = self.volumes.iter().filter_map(|v| match &v.recovery {
            Recovery::Replaying(r) => match r.phase {
                ReplayPhase::Waiting { until } => until,
                ReplayPhase::Connecting | ReplayPhase::Verifying { .. } | ReplayPhase::Fetching { .. } => {
                    Some(Time(r.asked_at.0 + idle_timeout_us))
                }
                ReplayPhase::Stopped => None,
            },
            _ => None,
        });
        let fetches = self.waiting_fetches.iter().map(|w| w.deadline);
        let lease = if self.hello_waits { self.promised_until } else { None };
        replays.chain(fetches).chain(lease).min()
    }

    fn emit(&mut self, action: ElementAction) {
        self.actions.push_back(action);
    }

    /// A volume's name for log lines (`#N` for a number it does not hold).
    fn volume_label(&self, volume: LocalVolume) -> String {
        match self.volumes.get(volume.0 as usize) {
            Some(v) => format!("{:?}", v.spec.name),
            None => format!("#{}", volume.0),
        }
    }

    fn log(&mut self, level: LogLevel, message: String) {
        self.emit(ElementAction::Log { level, message });
    }

    fn send(&mut self, session: SessionId, message: ElementMessage) {
        if self.sessions.contains_key(&session) {
            self.emit(ElementAction::Send { session, message });
        }
    }

    fn refuse(&mut self, session: SessionId, reason: String) {
        self.refuse_with(session, reason, None);
    }

    /// Refuse a session; `epoch` is set when its hello's epoch was the reason.
    fn refuse_with(&mut self, session: SessionId, reason: String, epoch: Option<Epoch>) {
        self.log(LogLevel::Warn, format!("session {}: refused: {reason}", session.0));
        let owner_absent_ms = self.owner_absent_ms();
        self.send(session, ElementMessage::Refused { reason, epoch, owner_absent_ms });
        self.emit(ElementAction::Close { session });
        self.close_session(session);
    }

    // ----- sessions --------------------------------------------------------------------------

    pub fn handle_session_opened(&mut self, now: Time, session: SessionId, role: SessionRole) {
        self.tick(now);
        let previous = self.sessions.insert(session, Session { role, ..Session::default() });
        assert!(previous.is_none(), "session ids are not reused");
    }

    /// Why a recovery order of `session` for `volume` comes too late, if it does: the volume
    /// has since followed a newer session of the same host element, at an epoch no older. A
    /// host element opens a new session only after closing the old one (a reconnect), so an
    /// order still on its way through the old one (a copy arriving over a slow link after the
    /// new session had the volume copied and in sync again) would rebuild the volume under the
    /// new session's stream and drop its records (found with swarm seed 650 of `--volume-ops`).
    fn order_superseded(&self, session: SessionId, volume: LocalVolume) -> Option<String> {
        let newer = self.volumes[volume.0 as usize].followed.filter(|&s| s > session)?;
        let (old, new) = (self.sessions.get(&session)?, self.sessions.get(&newer)?);
        (new.host == old.host && new.epoch >= old.epoch).then(|| {
            format!(
                "superseded: volume {:?} follows a newer session of this host element",
                self.volumes[volume.0 as usize].spec.name
            )
        })
    }

    pub fn handle_session_closed(&mut self, now: Time, session: SessionId) {
        self.tick(now);
        self.close_session(session);
    }

    /// How long the owner of the current epoch has been gone: no session of it open, or none
    /// that sent anything for `owner_silence_ms` (0: it is here).
    fn owner_absent_ms(&self) -> u64 {
        if self.owner_released {
            return OWNER_RELEASED_ABSENT_MS;
        }
        let silent_ms = self.owner_heard_at.map_or(0, |at| self.now.micros_since(at) / 1000);
        let open = self.sessions.values().any(|s| s.epoch == Some(self.epoch));
        if open && silent_ms < self.config.owner_silence_ms {
            return 0;
        }
        silent_ms
    }

    /// Every input brings the time.
    fn tick(&mut self, now: Time) {
        self.now = now;
        // Until some session is opened, the owner is gone since the element started.
        self.owner_heard_at.get_or_insert(now);
        // A promise made before a restart may still run (an element that never followed a
        // host element made none).
        if self.promised_until.is_none() {
            let until = if self.epoch > Epoch(0) { now.plus_ms(self.config.lease_ms) } else { now };
            self.promised_until = Some(until);
        }
    }

    /// Another host element's hello waits for the lease: no more promises meanwhile. Nor while
    /// a newer epoch is being adopted: the lease ran out (or there was none) and the element is
    /// about to welcome it, so a promise now would be broken at once.
    fn lease_promise_ms(&self, session_epoch: Epoch) -> u64 {
        let adopting = matches!(self.in_flight, Some(InFlight::AdoptEpoch { .. }));
        // A holder that released the element gets no promise again (its pings may still come).
        if session_epoch == self.epoch && !self.hello_waits && !self.owner_released && !adopting {
            self.config.lease_ms
        } else {
            0
        }
    }

    fn close_session(&mut self, session: SessionId) {
        let Some(closed) = self.sessions.remove(&session) else {
            return;
        };
        if closed.epoch == Some(self.epoch) && !self.sessions.values().any(|s| s.epoch == Some(self.epoch)) {
            self.owner_heard_at = Some(self.now);
        }
        self.waiting_fetches.retain(|w| w.session != session);
        // Recoveries it ordered stop: their records would be acknowledged to nobody. Queued
        // records stay: committing them is harmless and a new session sees them applied.
        for vi in 0..self.volumes.len() {
            let v = &mut self.volumes[vi];
            match &v.recovery {
                Recovery::Replaying(r) if r.session == session => {
                    let peer = r.peer;
                    v.recovery = Recovery::Streaming;
                    self.emit(ElementAction::ClosePeer { peer });
                }
                Recovery::Draining { session: s, .. } if *s == session => v.recovery = Recovery::Streaming,
                _ => {}
            }
            if let Recovery::Copying { next, .. } = &mut self.volumes[vi].recovery {
                if next.as_ref().is_some_and(|order| order.session == session) {
                    *next = None;
                }
            }
        }
    }

    pub fn handle_host_message(&mut self, now: Time, session: SessionId, message: HostMessage) {
        self.tick(now);
        let Some(state) = self.sessions.get_mut(&session) else { return };
        let role = if self.config.check_roles { state.role } else { SessionRole::Unauthenticated };
        if let Some(reason) = role_refusal(role, &message, self.epoch) {
            self.log(LogLevel::Warn, format!("session {}: refused: {reason}", session.0));
            return self.refuse(session, format!("not allowed: {reason}"));
        }
        if role == SessionRole::Element {
            if let HostMessage::Hello { volumes, .. } = &message {
                // A peer reads what exists; it never creates a volume here. (Whether a volume
                // was made a clone matters only to its creation: not compared.)
                let held = |spec: &VolumeSpec| {
                    self.volumes
                        .iter()
                        .any(|v| !v.removed && v.spec.name == spec.name && v.spec.size_bytes == spec.size_bytes)
                };
                if let Some(unknown) = volumes.iter().find(|spec| !held(spec)) {
                    let reason = format!("an element may not create volumes: {:?} does not exist here", unknown.name);
                    self.log(LogLevel::Warn, format!("session {}: refused: {reason}", session.0));
                    return self.refuse(session, format!("not allowed: {reason}"));
                }
            }
        }
        let Some(state) = self.sessions.get_mut(&session) else { return };
        // The holder pings every heartbeat; peers' sessions (replay, copy) share its epoch but
        // say nothing of it.
        if state.epoch == Some(self.epoch) && matches!(message, HostMessage::Ping { .. } | HostMessage::Apply(_)) {
            self.owner_heard_at = Some(now);
        }
        if let HostMessage::Observe { nonce } = message {
            // A standby's question: allowed in any session, before a hello or without one.
            let observed = ElementMessage::Observed {
                nonce,
                epoch: self.epoch,
                holder: self.holder,
                holder_admin: self.holder_admin.clone(),
                owner_absent_ms: self.owner_absent_ms(),
            };
            return self.send(session, observed);
        }
        if state.hello_pending || state.adding.is_some() || state.resizing {
            if state.deferred.len() >= SESSION_DEFERRED_MAX {
                return self.refuse(session, "protocol: too many requests before the welcome".into());
            }
            state.deferred.push_back(message);
            return;
        }
        let Some(session_epoch) = state.epoch else {
            let HostMessage::Hello { epoch, host, volumes, admin, receipt_acks } = message else {
                return self.refuse(session, "protocol: request before hello".into());
            };
            state.host = host;
            state.admin = admin;
            state.receipt_acks = receipt_acks;
            // A hello that cannot be welcomed creates nothing. Otherwise the epoch is compared
            // again when the hello's turn comes, after the volumes exist.
            if let Some(reason) = self.epoch_refusal(epoch, host) {
                let current = self.epoch;
                return self.refuse_with(session, reason, Some(current));
            }
            // Nor one older than a hello waiting for its turn: once that one's epoch is
            // adopted, this one is refused, and what it created would be left behind (a
            // superseded host element naming a volume deleted since). It is told to try again
            // (no epoch: this element does not follow the newer one yet).
            if let Some(newer) = self.pending_hello_epoch().filter(|e| *e > epoch) {
                return self.refuse(session, format!("a hello of newer epoch {newer} is being taken; try again"));
            }
            let state = self.sessions.get_mut(&session).expect("present");
            state.hello_pending = true;
            state.hello = Some((epoch, volumes.clone()));
            // Placeholders (size 0) stand for removed volumes: nothing is created for them.
            let specs = volumes.into_iter().filter(|spec| spec.size_bytes > 0).collect();
            self.emit(ElementAction::EnsureVolumes { session, specs });
            return;
        };
        match message {
            HostMessage::Hello { .. } => self.refuse(session, "protocol: second hello".into()),
            HostMessage::Ping { nonce } => {
                let (epoch, owner_absent_ms) = (self.epoch, self.owner_absent_ms());
                let lease_ms = self.lease_promise_ms(session_epoch);
                if lease_ms > 0 {
                    let until = now.plus_ms(lease_ms);
                    self.promised_until = Some(self.promised_until.map_or(until, |p| p.max(until)));
                }
                let lease_ms = lease_ms.min(u32::MAX as u64) as u32;
                self.send(session, ElementMessage::Pong { nonce, epoch, owner_absent_ms, lease_ms })
            }
            HostMessage::Observe { .. } => unreachable!("answered above"),
            HostMessage::Release => {
                // A graceful handover: the holder serves nothing any more, so its lease ends
                // now and a standby may take the element at once.
                if session_epoch == self.epoch {
                    self.log(LogLevel::Info, format!("host element {} released epoch {}", self.holder, self.epoch));
                    self.promised_until = Some(now);
                    self.owner_released = true;
                }
            }
            HostMessage::Apply(record) => {
                let Some(volume) = self.local(session, record.volume) else { return };
                self.volumes[volume.0 as usize].followed = Some(session);
                self.on_apply(session, session_epoch, volume, record);
            }
            // They wait until the element has applied `min_applied` (a snapshot exists here once
            // its record is applied: `serve` finds it, or answers that there is none).
            HostMessage::Read {
                volume: session_volume,
                snapshot: Some(SnapshotRef { taken_at: min_applied, .. }),
                ..
            }
            | HostMessage::BlockStatus {
                volume: session_volume,
                snapshot: Some(SnapshotRef { taken_at: min_applied, .. }),
                ..
            }
            | HostMessage::FetchBlocks { volume: session_volume, min_applied, .. }
            | HostMessage::Scrub { volume: session_volume, min_applied, .. } => {
                let Some(volume) = self.local(session, session_volume) else { return };
                if self.volumes[volume.0 as usize].applied >= min_applied {
                    self.emit(ElementAction::Serve { session, volume, request: message });
                } else {
                    let deadline = Time(now.0 + self.config.source_catch_up_timeout_ms * 1000);
                    self.waiting_fetches.push(WaitingFetch {
                        session,
                        volume,
                        min_applied,
                        deadline,
                        request: message,
                    });
                }
            }
            HostMessage::Read { volume: session_volume, .. }
            | HostMessage::BlockStatus { volume: session_volume, .. }
            | HostMessage::FetchLog { volume: session_volume, .. } => {
                let Some(volume) = self.local(session, session_volume) else { return };
                self.emit(ElementAction::Serve { session, volume, request: message });
            }
            HostMessage::Recover { .. }
            | HostMessage::Copy { .. }
            | HostMessage::AddVolumes { .. }
            | HostMessage::RemoveVolumes { .. }
            | HostMessage::ResizeVolumes { .. }
                if self.config.fencing && session_epoch < self.epoch =>
            {
                // A recovery order of a superseded host element (one that woke from a pause,
                // say) would rebuild a volume under the newer one's stream.
                let reason = format!(
                    "fenced: a host element of epoch {} superseded epoch {session_epoch}; its recovery and volume orders are refused",
                    self.epoch
                );
                self.refuse(session, reason)
            }
            HostMessage::Recover { volume: session_volume, source, after, through, rate_bytes_per_s } => {
                let Some(volume) = self.local(session, session_volume) else { return };
                if let Some(reason) = self.order_superseded(session, volume) {
                    let result = Err(reason);
                    return self.send(session, ElementMessage::RecoveryDone { volume: session_volume, result });
                }
                self.volumes[volume.0 as usize].followed = Some(session);
                self.start_replay(
                    session,
                    session_epoch,
                    session_volume,
                    volume,
                    source,
                    after,
                    through,
                    rate_bytes_per_s,
                );
            }
            HostMessage::Copy { volume: session_volume, source, rate_bytes_per_s } => {
                let Some(volume) = self.local(session, session_volume) else { return };
                if let Some(reason) = self.order_superseded(session, volume) {
                    return self
                        .send(session, ElementMessage::CopyDone { volume: session_volume, result: Err(reason) });
                }
                self.volumes[volume.0 as usize].followed = Some(session);
                let order = CopyOrder { session, session_volume, source, rate_bytes_per_s };
                self.order_copy(volume, order);
            }
            HostMessage::AddVolumes { volumes } => {
                let state = self.sessions.get_mut(&session).expect("present");
                if state.volumes.len() + volumes.len() > VOLUMES_PER_SESSION_MAX {
                    return self.refuse(session, format!("protocol: more than {VOLUMES_PER_SESSION_MAX} volumes"));
                }
                state.adding = Some(volumes.clone());
                self.emit(ElementAction::EnsureVolumes { session, specs: volumes });
            }
            HostMessage::CheckVolumes { request_id, volumes } => {
                self.emit(ElementAction::CheckVolumes { session, request_id, specs: volumes });
            }
            HostMessage::RemoveVolumes { volumes: ids } => {
                let state = self.sessions.get_mut(&session).expect("present");
                if let Some(unknown) = ids.iter().find(|id| id.0 as usize >= state.volumes.len()) {
                    let reason = format!("protocol: unknown volume {unknown}");
                    return self.refuse(session, reason);
                }
                let mut locals = Vec::new();
                for id in &ids {
                    let local = std::mem::replace(&mut state.volumes[id.0 as usize], LocalVolume::REMOVED);
                    if local != LocalVolume::REMOVED && !locals.contains(&local) {
                        locals.push(local);
                    }
                }
                self.jobs.push_back(Job::Remove { volumes: locals, reply: Some((session, ids)) });
                self.pump_storage();
            }
            HostMessage::ResizeVolumes { volumes } => {
                let mut locals: Vec<(LocalVolume, u64)> = Vec::with_capacity(volumes.len());
                for &(id, size_bytes) in &volumes {
                    let Some(local) = self.local(session, id) else { return };
                    match locals.iter_mut().find(|(l, _)| *l == local) {
                        Some(entry) => entry.1 = entry.1.max(size_bytes),
                        None => locals.push((local, size_bytes)),
                    }
                }
                let ids = volumes.iter().map(|(id, _)| *id).collect();
                self.sessions.get_mut(&session).expect("present").resizing = true;
                self.jobs.push_back(Job::Resize { volumes: locals, reply: (session, ids) });
                self.pump_storage();
            }
        }
    }

    /// The local volume of a session's volume number; refuses the session if there is none.
    fn local(&mut self, session: SessionId, volume: VolumeId) -> Option<LocalVolume> {
        let found = self.sessions.get(&session).and_then(|s| s.volumes.get(volume.0 as usize).copied());
        match found {
            None => self.refuse(session, format!("protocol: unknown volume {volume}")),
            Some(LocalVolume::REMOVED) => self.refuse(session, format!("protocol: volume {volume} was removed")),
            Some(local) => return Some(local),
        }
        None
    }

    /// Storage created (or found) the volumes of a session's `Hello`: `Ok` holds, per spec in
    /// order, its local volume and what storage holds of it.
    pub fn handle_volumes_ensured(
        &mut self,
        now: Time,
        session: SessionId,
        result: Result<Vec<(LocalVolume, VolumeInfo)>, String>,
    ) {
        self.tick(now);
        let Some(state) = self.sessions.get_mut(&session) else { return };
        if let Some(specs) = state.adding.take() {
            return self.volumes_added(session, specs, result);
        }
        assert!(state.hello_pending && state.epoch.is_none());
        let (epoch, specs) = state.hello.take().expect("volumes are ensured for a pending hello");
        let ensured = match result {
            Ok(ensured) => ensured,
            Err(reason) => return self.refuse(session, reason),
        };
        let real: Vec<VolumeSpec> = specs.iter().filter(|spec| spec.size_bytes > 0).cloned().collect();
        self.register_volumes(&ensured, &real);
        // A placeholder's volume, if this element still holds it (it was down when the volume
        // was deleted), is removed before the welcome.
        let mut ensured = ensured.iter();
        let mut session_volumes = Vec::with_capacity(specs.len());
        let mut stale = Vec::new();
        for spec in &specs {
            if spec.size_bytes > 0 {
                session_volumes.push(ensured.next().expect("one per real spec").0);
                continue;
            }
            session_volumes.push(LocalVolume::REMOVED);
            let held = self.volumes.iter().position(|v| !v.removed && v.spec.name == spec.name);
            if let Some(vi) = held {
                stale.push(LocalVolume(vi as u32));
            }
        }
        self.sessions.get_mut(&session).expect("present").volumes = session_volumes;
        if !stale.is_empty() {
            self.jobs.push_back(Job::Remove { volumes: stale, reply: Some((session, Vec::new())) });
        }
        let host = self.sessions[&session].host;
        self.jobs.push_back(Job::Hello { session, epoch, host });
        self.pump_storage();
    }

    /// Storage said whether the volumes of a session's `CheckVolumes` would fit.
    pub fn handle_volumes_checked(
        &mut self,
        now: Time,
        session: SessionId,
        request_id: u64,
        result: Result<(), String>,
    ) {
        self.tick(now);
        if self.sessions.contains_key(&session) {
            self.send(session, ElementMessage::VolumesChecked { request_id, result });
        }
    }

    /// Volumes storage created or found for a session: new local volumes join the list.
    fn register_volumes(&mut self, ensured: &[(LocalVolume, VolumeInfo)], specs: &[VolumeSpec]) {
        assert_eq!(ensured.len(), specs.len(), "one local volume per spec");
        for ((local, info), spec) in ensured.iter().zip(specs) {
            let vi = local.0 as usize;
            // Storage numbers snapshots among volumes: the ones taken since the core last
            // heard of a new volume are places no session names.
            while self.volumes.len() < vi {
                self.volumes.push(Volume::placeholder());
            }
            if vi < self.volumes.len() {
                // A volume that grew while this element was away was grown by the hello.
                let held = &mut self.volumes[vi].spec;
                held.size_bytes = held.size_bytes.max(spec.size_bytes);
            } else {
                self.volumes.push(Volume {
                    spec: spec.clone(),
                    applied: info.applied,
                    applied_epoch: info.applied_epoch,
                    copy_interrupted: info.copying,
                    repair: info.repair,
                    recovery: Recovery::Streaming,
                    recent: VecDeque::new(),
                    followed: None,
                    removed: false,
                });
            }
        }
    }

    /// What a session is told it holds of a local volume (a copy under way holds nothing yet).
    fn volume_state(&self, local: LocalVolume) -> VolumeState {
        let removed = VolumeState {
            applied_sequence: Sequence::ZERO,
            applied_epoch: Epoch(0),
            copying: false,
            repair: false,
            size_bytes: 0,
        };
        if local == LocalVolume::REMOVED || self.volumes[local.0 as usize].removed {
            return removed;
        }
        let v = &self.volumes[local.0 as usize];
        let size_bytes = v.spec.size_bytes;
        if v.rebuilding() {
            VolumeState {
                applied_sequence: Sequence::ZERO,
                applied_epoch: Epoch(0),
                copying: true,
                repair: false,
                size_bytes,
            }
        } else {
            VolumeState {
                applied_sequence: v.applied,
                applied_epoch: v.applied_epoch,
                copying: false,
                repair: v.repair,
                size_bytes,
            }
        }
    }

    /// Storage created (or found) the volumes of a session's `AddVolumes`: they are numbered
    /// after its earlier ones, the session hears what this element holds of them, and what it
    /// sent meanwhile runs.
    fn volumes_added(
        &mut self,
        session: SessionId,
        specs: Vec<VolumeSpec>,
        result: Result<Vec<(LocalVolume, VolumeInfo)>, String>,
    ) {
        let ensured = match result {
            Ok(ensured) => ensured,
            Err(reason) => return self.refuse(session, format!("cannot create volumes: {reason}")),
        };
        self.register_volumes(&ensured, &specs);
        let states = ensured.iter().map(|(local, _)| self.volume_state(*local)).collect();
        let state = self.sessions.get_mut(&session).expect("present");
        state.volumes.extend(ensured.iter().map(|(local, _)| *local));
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        self.log(LogLevel::Info, format!("session {}: volumes added: {}", session.0, names.join(", ")));
        let deferred = std::mem::take(&mut self.sessions.get_mut(&session).expect("present").deferred);
        self.send(session, ElementMessage::VolumesAdded { volumes: states });
        for message in deferred {
            self.handle_host_message(self.now, session, message);
        }
    }

    fn welcome(&mut self, session: SessionId, epoch: Epoch, previous: Epoch) {
        let Some(state) = self.sessions.get_mut(&session) else { return };
        state.epoch = Some(epoch);
        state.hello_pending = false;
        if epoch == self.epoch {
            self.holder_admin = state.admin.clone();
            self.owner_released = false;
            self.owner_heard_at = Some(self.now);
        }
        let locals = state.volumes.clone();
        let states = locals.iter().map(|l| self.volume_state(*l)).collect();
        let state = self.sessions.get_mut(&session).expect("present");
        let deferred = std::mem::take(&mut state.deferred);
        let element_id = self.config.element_id;
        self.send(session, ElementMessage::Welcome { epoch: previous, element_id, volumes: states });
        for message in deferred {
            self.handle_host_message(self.now, session, message);
        }
    }

    // ----- records and storage ----------------------------------------------------------------

    fn on_apply(&mut self, session: SessionId, session_epoch: Epoch, volume: LocalVolume, record: Record) {
        let session_volume = record.volume;
        let stopped_beyond = matches!(&self.volumes[volume.0 as usize].recovery,
            Recovery::Replaying(r) if r.phase == ReplayPhase::Stopped && record.sequence > r.through);
        if stopped_beyond {
            // A failed pull: current writes wait for the next order, unless the host element
            // sends the gap again itself (it had switched to its write queue).
            if record.sequence != self.accepted(volume).next() {
                return;
            }
            self.volumes[volume.0 as usize].recovery = Recovery::Streaming;
        }
        let v = &mut self.volumes[volume.0 as usize];
        if v.rebuilding() {
            // The copy rebuilds the volume; the host element sends nothing until it is done,
            // and what was on its way from before is superseded (no receipt for it either).
            return;
        }
        match &mut v.recovery {
            Recovery::Replaying(r) if record.sequence > r.through => {
                r.seen = r.seen.max(record.sequence);
                let bytes = record.op.payload_bytes();
                let contiguous = record.sequence
                    == r.through.next().max(r.stash.back().map_or(Sequence::ZERO, |s| s.sequence.next()));
                let room = self.config.replay_stash_bytes_max;
                if contiguous && stash_bytes_total(&self.volumes) + bytes <= room {
                    if let Recovery::Replaying(r) = &mut self.volumes[volume.0 as usize].recovery {
                        r.stash_bytes += bytes;
                        r.stash.push_back(record);
                    }
                }
                return;
            }
            _ => {}
        }
        let sequence = record.sequence;
        // A receipt counts toward the write quorum (the `received` ack policy): only for data
        // that matches its piece checksums (the frame's checksum does not cover a large write's
        // data; the store refuses a damaged record with a fault).
        let receipt = self.sessions.get(&session).is_some_and(|s| s.receipt_acks) && record.op.check_data().is_ok();
        let commit = Commit { session, session_volume, session_epoch, volume, record, replayed: false };
        self.jobs.push_back(Job::Commit(commit));
        if receipt {
            self.send(session, ElementMessage::Received { volume: session_volume, sequence });
        }
        self.pump_storage();
    }

    /// Start the next storage job if storage is idle.
    fn pump_storage(&mut self) {
        while self.in_flight.is_none() {
            match self.jobs.front() {
                None => return,
                Some(&Job::Hello { session, epoch, host }) => {
                    let takeover = epoch > self.epoch && host != self.holder && self.sessions.contains_key(&session);
                    let promised = self.promised_until.is_some_and(|until| self.now < until);
                    if takeover && promised && self.config.fencing {
                        // The read lease promised to the holder runs: wait for its end.
                        if !self.hello_waits {
                            self.log(
                                LogLevel::Info,
                                format!(
                                    "epoch {epoch} of host element {host} waits for the lease of epoch {}",
                                    self.epoch
                                ),
                            );
                        }
                        self.hello_waits = true;
                        return;
                    }
                    self.hello_waits = false;
                    self.jobs.pop_front();
                    if !self.sessions.contains_key(&session) {
                        continue;
                    }
                    let previous = self.epoch;
                    if let Some(reason) = self.epoch_refusal(epoch, host) {
                        self.refuse_with(session, reason, Some(previous));
                    } else if epoch > previous {
                        self.in_flight = Some(InFlight::AdoptEpoch { session, epoch, host, previous });
                        self.emit(ElementAction::Storage(StorageJob::AdoptEpoch(epoch, host)));
                    } else {
                        self.welcome(session, epoch, previous);
                    }
                }
                Some(Job::Commit(_)) => self.start_commit(),
                Some(Job::Remove { .. }) => {
                    let Some(Job::Remove { volumes, reply }) = self.jobs.pop_front() else { unreachable!() };
                    if volumes.is_empty() {
                        self.volumes_removed(&volumes, reply);
                        continue;
                    }
                    self.in_flight = Some(InFlight::Remove { volumes: volumes.clone(), reply });
                    self.emit(ElementAction::Storage(StorageJob::RemoveVolumes(volumes)));
                }
                Some(Job::Resize { .. }) => {
                    let Some(Job::Resize { volumes, reply }) = self.jobs.pop_front() else { unreachable!() };
                    if !self.sessions.contains_key(&reply.0) {
                        // Its session is gone: its next hello names the sizes again.
                        continue;
                    }
                    // Never smaller than held (a group's storage volume this element holds
                    // larger than the host element had heard of when it asked).
                    let volumes: Vec<(LocalVolume, u64)> = volumes
                        .into_iter()
                        .map(|(l, size)| (l, size.max(self.volumes[l.0 as usize].spec.size_bytes)))
                        .collect();
                    self.in_flight = Some(InFlight::Resize { volumes: volumes.clone(), reply });
                    self.emit(ElementAction::Storage(StorageJob::ResizeVolumes(volumes)));
                }
            }
        }
    }

    /// Storage removed these volumes: nothing names them any more. A replay into one stops,
    /// records of them still queued are dropped, and fetches waiting on them are answered (with
    /// storage's error).
    fn volumes_removed(&mut self, volumes: &[LocalVolume], reply: Option<(SessionId, Vec<VolumeId>)>) {
        for &local in volumes {
            let vi = local.0 as usize;
            if matches!(&self.volumes[vi].recovery, Recovery::Replaying(r) if r.phase != ReplayPhase::Stopped) {
                self.fail_replay(vi, "the volume was removed".into());
            }
            // A copy under way fails by itself (storage refuses it) and reports as usual.
            if !matches!(self.volumes[vi].recovery, Recovery::Copying { .. }) {
                self.volumes[vi].recovery = Recovery::Streaming;
            }
            let v = &mut self.volumes[vi];
            v.removed = true;
            v.recent.clear();
            for s in self.sessions.values_mut() {
                for l in s.volumes.iter_mut().filter(|l| **l == local) {
                    *l = LocalVolume::REMOVED;
                }
            }
            let name = self.volumes[vi].spec.name.clone();
            self.log(LogLevel::Info, format!("volume {name:?} removed"));
        }
        self.jobs.retain(|job| !matches!(job, Job::Commit(c) if volumes.contains(&c.volume)));
        let (waiting, kept): (Vec<WaitingFetch>, Vec<WaitingFetch>) =
            std::mem::take(&mut self.waiting_fetches).into_iter().partition(|w| volumes.contains(&w.volume));
        self.waiting_fetches = kept;
        for w in waiting {
            self.emit(ElementAction::Serve { session: w.session, volume: w.volume, request: w.request });
        }
        if let Some((session, ids)) = reply.filter(|(_, ids)| !ids.is_empty()) {
            if self.sessions.contains_key(&session) {
                self.send(session, ElementMessage::VolumesRemoved { volumes: ids });
            }
        }
    }

    /// Form one group commit from the records at the front of the queue, applying the
    /// fencing, duplicate and gap rules.
    fn start_commit(&mut self) {
        let mut records: Vec<Commit> = Vec::new();
        let mut acks: Vec<(SessionId, VolumeId, LocalVolume)> = Vec::new();
        let mut bytes = 0u64;
        // Per volume touched: (applied, epoch) as of the records accepted so far.
        let mut running: BTreeMap<LocalVolume, (Sequence, Epoch)> = BTreeMap::new();
        let mut refused: Vec<RefusedRecord> = Vec::new();
        while records.len() < self.config.commit_batch_records_max && bytes < self.config.commit_batch_bytes_max {
            let Some(Job::Commit(_)) = self.jobs.front() else { break };
            let Some(Job::Commit(commit)) = self.jobs.pop_front() else { unreachable!() };
            let fenced = self.config.fencing && commit.session_epoch < self.epoch;
            if !self.sessions.contains_key(&commit.session) && fenced {
                continue;
            }
            let mut refuse = |commit: &Commit, refusal, reason| {
                let (session, volume, sequence) = (commit.session, commit.volume, commit.record.sequence);
                refused.push((session, volume, sequence, commit.replayed, refusal, reason));
            };
            if fenced {
                let reason =
                    format!("fenced: a host element of epoch {} superseded epoch {}", self.epoch, commit.session_epoch);
                refuse(&commit, Refusal::Fenced, reason);
                continue;
            }
            if let Some(reason) = &self.storage_failed {
                refuse(&commit, Refusal::Storage, format!("commit failed: {reason}"));
                continue;
            }
            let v = &self.volumes[commit.volume.0 as usize];
            if v.repair {
                // Storage takes no records until the repair; the session that sent it had a
                // fault when the damage was found, and the host element sends no more.
                continue;
            }
            if v.rebuilding() {
                // Queued before the copy began: superseded, as `on_apply` drops those that
                // come during it. Not a gap to refuse.
                continue;
            }
            let (applied, applied_epoch) = running.entry(commit.volume).or_insert((v.applied, v.applied_epoch));
            let ack = (commit.session, commit.session_volume, commit.volume);
            let record = &commit.record;
            if record.sequence <= *applied {
                let held = v.recent.iter().find(|(sequence, ..)| *sequence == record.sequence);
                let differs = match held {
                    Some(&(_, epoch, digest)) => epoch != record.epoch || digest != record_digest(&record.op),
                    // The newest one's epoch is known even when it was applied before a restart.
                    None => record.sequence == *applied && record.epoch != *applied_epoch,
                };
                if differs {
                    let reason = format!(
                        "volume {:?}: sequence {} of epoch {} differs from the record this element holds at that sequence: two histories",
                        v.spec.name, record.sequence, record.epoch
                    );
                    refuse(&commit, Refusal::Diverged, reason);
                    continue;
                }
                if !acks.contains(&ack) {
                    acks.push(ack);
                }
                continue;
            }
            if self.config.fencing && record.epoch < *applied_epoch {
                let reason = format!(
                    "volume {:?}: record of sequence {} comes from epoch {}, older than the volume's epoch {}",
                    v.spec.name, record.sequence, record.epoch, applied_epoch
                );
                refuse(&commit, Refusal::StaleEpoch, reason);
                continue;
            }
            if record.sequence != applied.next() {
                let reason = format!(
                    "volume {:?}: sequence {} leaves a gap after the applied sequence {}",
                    v.spec.name, record.sequence, applied
                );
                refuse(&commit, Refusal::Gap, reason);
                continue;
            }
            *applied = record.sequence;
            *applied_epoch = record.epoch;
            bytes += record.op.payload_bytes();
            if !acks.contains(&ack) {
                acks.push(ack);
            }
            records.push(commit);
        }
        self.report_refused(refused);
        if records.is_empty() {
            // Only duplicates: acknowledge what is applied.
            self.send_acks(&acks);
            return;
        }
        let batch = records.iter().map(|c| (c.volume, c.record.clone())).collect();
        self.emit(ElementAction::Storage(StorageJob::Commit(batch)));
        self.in_flight = Some(InFlight::Commit { records, acks });
    }

    fn send_acks(&mut self, acks: &[(SessionId, VolumeId, LocalVolume)]) {
        for &(session, session_volume, volume) in acks {
            let sequence = self.volumes[volume.0 as usize].applied;
            self.send(session, ElementMessage::Applied { volume: session_volume, sequence });
        }
    }

    /// Tell each session whose records were refused: one fault, which fails the session, so
    /// the rest of a burst (a gap refuses every record after it) is logged as a count.
    fn report_refused(&mut self, refused: Vec<RefusedRecord>) {
        let mut faulted: Vec<(SessionId, usize)> = Vec::new();
        for (session, volume, sequence, replayed, refusal, reason) in refused {
            self.emit(ElementAction::Refused { session, volume, sequence, refusal, replayed });
            if let Some((_, more)) = faulted.iter_mut().find(|(s, _)| *s == session) {
                *more += 1;
                continue;
            }
            faulted.push((session, 0));
            let name = self.volume_label(volume);
            self.log(
                LogLevel::Warn,
                format!("session {}: record {sequence} of volume {name} refused: {reason}", session.0),
            );
            self.send(session, ElementMessage::Fault { reason });
        }
        for (session, more) in faulted.into_iter().filter(|(_, more)| *more > 0) {
            self.log(LogLevel::Warn, format!("session {}: {more} more records of the batch refused", session.0));
        }
    }

    /// Storage finished the job it was given last.
    pub fn handle_storage_done(&mut self, now: Time, done: StorageDone) {
        self.tick(now);
        let in_flight = self.in_flight.take().expect("storage reports only the job it was given");
        match (in_flight, done) {
            (InFlight::AdoptEpoch { session, epoch, host, previous }, StorageDone::AdoptEpoch(result)) => {
                match result {
                    Ok(()) => {
                        assert!(epoch > self.epoch, "only a newer epoch is adopted");
                        self.epoch = epoch;
                        self.holder = host;
                        self.owner_released = false;
                        self.owner_heard_at = Some(now);
                        self.log(
                            LogLevel::Info,
                            format!("adopted epoch {epoch} of host element {host} (was {previous})"),
                        );
                        self.stop_superseded_replays(epoch);
                        self.welcome(session, epoch, previous);
                    }
                    Err(reason) => self.refuse(session, format!("cannot adopt epoch {epoch}: {reason}")),
                }
            }
            (InFlight::Commit { records, acks }, StorageDone::Commit(result)) => match result {
                Ok(done) => {
                    for &(volume, applied, applied_epoch) in &done.applied {
                        let v = &mut self.volumes[volume.0 as usize];
                        assert!(applied >= v.applied, "applied sequences never go back");
                        v.applied = applied;
                        v.applied_epoch = applied_epoch;
                    }
                    // Storage raises its epoch to the newest record it holds.
                    let newest = records.iter().map(|c| c.record.epoch).max().expect("a commit has records");
                    self.epoch = self.epoch.max(newest);
                    for (index, c) in records.iter().enumerate() {
                        if done.rejected.iter().any(|(i, _)| *i == index) {
                            continue;
                        }
                        let recent = &mut self.volumes[c.volume.0 as usize].recent;
                        if recent.len() == RECENT_RECORDS_MAX {
                            recent.pop_front();
                        }
                        recent.push_back((c.record.sequence, c.record.epoch, record_digest(&c.record.op)));
                    }
                    let refused = done
                        .rejected
                        .iter()
                        .map(|(index, reason)| {
                            let c = &records[*index];
                            (c.session, c.volume, c.record.sequence, c.replayed, Refusal::Storage, reason.clone())
                        })
                        .collect();
                    self.report_refused(refused);
                    self.send_acks(&acks);
                    self.after_applied();
                }
                Err(reason) => {
                    self.log(LogLevel::Warn, format!("commit failed: {reason}"));
                    let mut sessions: Vec<SessionId> = records.iter().map(|c| c.session).collect();
                    sessions.dedup();
                    for session in sessions {
                        self.send(session, ElementMessage::Fault { reason: format!("commit failed: {reason}") });
                    }
                    self.storage_failed = Some(reason);
                }
            },
            (InFlight::Remove { volumes, reply }, StorageDone::RemoveVolumes(result)) => match result {
                Ok(()) => self.volumes_removed(&volumes, reply),
                Err(reason) => {
                    self.log(LogLevel::Warn, format!("volume removal failed: {reason}"));
                    match reply {
                        // A hello's placeholders: it is not welcomed (its welcome would say the
                        // volumes are gone).
                        Some((session, ids)) if ids.is_empty() => {
                            self.jobs.retain(|j| !matches!(j, Job::Hello { session: s, .. } if *s == session));
                            self.refuse(session, format!("cannot remove deleted volumes: {reason}"));
                        }
                        Some((session, _)) => {
                            let reason = format!("volume removal failed: {reason}");
                            self.send(session, ElementMessage::Fault { reason });
                        }
                        None => {}
                    }
                    self.storage_failed = Some(reason);
                }
            },
            (InFlight::Resize { volumes, reply: (session, ids) }, StorageDone::ResizeVolumes(result)) => match result {
                Ok(()) => {
                    for (local, size_bytes) in &volumes {
                        let spec = &mut self.volumes[local.0 as usize].spec;
                        spec.size_bytes = spec.size_bytes.max(*size_bytes);
                    }
                    let names: Vec<String> = volumes
                        .iter()
                        .map(|(l, size)| format!("{} to {size} bytes", self.volumes[l.0 as usize].spec.name))
                        .collect();
                    self.log(LogLevel::Info, format!("volumes grown: {}", names.join(", ")));
                    self.send(session, ElementMessage::VolumesResized { volumes: ids });
                    if let Some(state) = self.sessions.get_mut(&session) {
                        state.resizing = false;
                        let deferred = std::mem::take(&mut state.deferred);
                        for message in deferred {
                            self.handle_host_message(self.now, session, message);
                        }
                    }
                }
                Err(reason) => {
                    // Nothing changed (a grow that does not fit), or storage failed (then it
                    // takes no more changes): either way this session cannot go on.
                    self.log(LogLevel::Warn, format!("volume resize failed: {reason}"));
                    self.refuse(session, format!("cannot grow volumes: {reason}"));
                }
            },
            (in_flight, done) => unreachable!("storage answered {done:?} to {in_flight:?}"),
        }
        self.pump_storage();
    }

    /// Applied sequences moved: waiting fetches, replay back-pressure and drains may go on.
    fn after_applied(&mut self) {
        let mut ready = Vec::new();
        self.waiting_fetches.retain(|w| {
            let go = self.volumes[w.volume.0 as usize].applied >= w.min_applied;
            if go {
                ready.push((w.session, w.volume, w.request.clone()));
            }
            !go
        });
        for (session, volume, request) in ready {
            self.emit(ElementAction::Serve { session, volume, request });
        }
        for vi in 0..self.volumes.len() {
            let v = &self.volumes[vi];
            match &v.recovery {
                Recovery::Replaying(r)
                    if r.phase == (ReplayPhase::Waiting { until: None }) && v.applied >= r.backlog_until_applied =>
                {
                    self.next_fetch(vi);
                }
                &Recovery::Draining { session, session_volume, target } if v.applied >= target => {
                    let reached = v.applied;
                    self.volumes[vi].recovery = Recovery::Streaming;
                    self.log(
                        LogLevel::Info,
                        format!("volume {:?}: replay recovery done at sequence {reached}", self.volumes[vi].spec.name),
                    );
                    self.send(session, ElementMessage::RecoveryDone { volume: session_volume, result: Ok(reached) });
                }
                _ => {}
            }
        }
    }

    // ----- replay recovery ------------------------------------------------------------------

    /// Newest sequence of a volume that is applied or queued for commit.
    fn accepted(&self, volume: LocalVolume) -> Sequence {
        let mut accepted = self.volumes[volume.0 as usize].applied;
        let in_flight = match &self.in_flight {
            Some(InFlight::Commit { records, .. }) => records.iter().collect::<Vec<_>>(),
            _ => Vec::new(),
        };
        let queued = self.jobs.iter().filter_map(|j| match j {
            Job::Commit(c) => Some(c),
            Job::Hello { .. } | Job::Remove { .. } | Job::Resize { .. } => None,
        });
        for c in in_flight.into_iter().chain(queued) {
            if c.volume == volume && c.record.sequence == accepted.next() {
                accepted = c.record.sequence;
            }
        }
        accepted
    }

    #[allow(clippy::too_many_arguments)]
    fn start_replay(
        &mut self,
        session: SessionId,
        epoch: Epoch,
        session_volume: VolumeId,
        volume: LocalVolume,
        source: String,
        after: Sequence,
        through: Sequence,
        rate_bytes_per_s: u64,
    ) {
        let vi = volume.0 as usize;
        match &self.volumes[vi].recovery {
            Recovery::Copying { .. } => {
                let result = Err("the volume is being copied (full recovery); replay refused".to_string());
                return self.send(session, ElementMessage::RecoveryDone { volume: session_volume, result });
            }
            Recovery::Replaying(old) => {
                let peer = old.peer;
                self.emit(ElementAction::ClosePeer { peer });
            }
            _ => {}
        }
        let cursor = after.max(self.accepted(volume));
        let peer = PeerId(self.next_peer);
        self.next_peer += 1;
        let spec = self.volumes[vi].spec.clone();
        self.log(
            LogLevel::Info,
            format!("volume {:?}: replay recovery: pulling {}..={through} from {source}", spec.name, cursor.next()),
        );
        self.volumes[vi].recovery = Recovery::Replaying(Box::new(Replay {
            session,
            session_volume,
            epoch,
            source: source.clone(),
            rate_bytes_per_s,
            peer,
            phase: ReplayPhase::Connecting,
            through,
            cursor,
            stash: VecDeque::new(),
            stash_bytes: 0,
            seen: through,
            started: self.now,
            fetched_bytes: 0,
            backlog_until_applied: Sequence::ZERO,
            idle_since: None,
            request_id: 0,
            unpaced: false,
            asked_at: self.now,
        }));
        if cursor >= through {
            return self.finish_pull(vi);
        }
        self.emit(ElementAction::ConnectPeer {
            peer,
            address: source,
            hello: HostMessage::Hello {
                epoch,
                host: self.session_host(session),
                volumes: vec![spec],
                admin: String::new(),
                receipt_acks: false,
            },
        });
    }

    /// The host element a session speaks for (`HostId(0)` once it is gone).
    fn session_host(&self, session: SessionId) -> HostId {
        self.sessions.get(&session).map_or(HostId(0), |s| s.host)
    }

    fn replay_of_peer(&self, peer: PeerId) -> Option<usize> {
        self.volumes.iter().position(
            |v| matches!(&v.recovery, Recovery::Replaying(r) if r.peer == peer && r.phase != ReplayPhase::Stopped),
        )
    }

    fn replay_mut(&mut self, vi: usize) -> &mut Replay {
        match &mut self.volumes[vi].recovery {
            Recovery::Replaying(r) => r,
            other => unreachable!("volume {vi} is not replaying: {other:?}"),
        }
    }

    pub fn handle_peer_message(&mut self, now: Time, peer: PeerId, message: ElementMessage) {
        self.tick(now);
        let Some(vi) = self.replay_of_peer(peer) else { return };
        let phase = self.replay_mut(vi).phase;
        match (phase, message) {
            (_, ElementMessage::Pong { .. }) => {}
            (ReplayPhase::Connecting, ElementMessage::Welcome { .. }) => {
                let v = &self.volumes[vi];
                let (own, own_epoch) = (v.applied, v.applied_epoch);
                if own == Sequence::ZERO {
                    return self.next_fetch(vi);
                }
                // Our newest record must be the peer's record at that sequence: a replay onto a
                // diverged history would make a wrong replica look in sync.
                let now = self.now;
                let r = self.replay_mut(vi);
                r.phase = ReplayPhase::Verifying { own, own_epoch };
                r.asked_at = now;
                let probe = HostMessage::FetchLog { request_id: 0, volume: VolumeId(0), after: Sequence(own.0 - 1), max_bytes: 1 };
                self.emit(ElementAction::SendPeer { peer, message: probe });
            }
            (ReplayPhase::Connecting, ElementMessage::Refused { reason, .. }) => self.fail_replay(vi, format!("peer refused: {reason}")),
            (ReplayPhase::Verifying { own, own_epoch }, ElementMessage::LogRecords { request_id: 0, result }) => {
                match result {
                    Err(e) => self.fail_replay(
                        vi,
                        format!("cannot check sequence {own} against the peer's replay log ({e}); needs full recovery"),
                    ),
                    Ok(records) => match records.first().filter(|r| r.sequence == own).map(|r| r.epoch) {
                        Some(epoch) if epoch == own_epoch => self.next_fetch(vi),
                        Some(epoch) => self.fail_replay(
                            vi,
                            format!("diverged: sequence {own} is from epoch {own_epoch} here and from epoch {epoch} on the peer; needs full recovery"),
                        ),
                        None => self.fail_replay(
                            vi,
                            format!("the peer's replay log does not hold sequence {own} to check it; needs full recovery"),
                        ),
                    },
                }
            }
            (ReplayPhase::Fetching { request_id }, ElementMessage::LogRecords { request_id: id, result }) if id == request_id => {
                match result {
                    Err(e) => self.fail_replay(vi, format!("peer's replay log: {e}")),
                    Ok(records) => self.on_fetched(vi, records),
                }
            }
            (_, other) => self.fail_replay(vi, format!("peer answered {} unexpectedly", message_name(&other))),
        }
    }

    pub fn handle_peer_closed(&mut self, now: Time, peer: PeerId, reason: String) {
        self.tick(now);
        if let Some(vi) = self.replay_of_peer(peer) {
            self.fail_replay(vi, reason);
        }
    }

    fn on_fetched(&mut self, vi: usize, records: Vec<Record>) {
        let now = self.now;
        let idle_timeout_us = self.config.replay_idle_timeout_ms * 1000;
        let r = self.replay_mut(vi);
        if records.is_empty() {
            // The peer itself has not applied that far yet.
            let since = *r.idle_since.get_or_insert(now);
            if now.0.saturating_sub(since.0) > idle_timeout_us {
                let reason =
                    format!("peer has had nothing after sequence {} for {} s", r.cursor, idle_timeout_us / 1_000_000);
                return self.fail_replay(vi, reason);
            }
            r.phase = ReplayPhase::Waiting { until: Some(now.plus_ms(REPLAY_EMPTY_RETRY_MS)) };
            return;
        }
        r.idle_since = None;
        r.backlog_until_applied = r.cursor;
        let (session, session_volume, epoch, through) = (r.session, r.session_volume, r.epoch, r.through);
        let mut cursor = r.cursor;
        let mut commits = Vec::new();
        for record in records {
            if record.sequence != cursor.next() {
                return self.fail_replay(vi, format!("peer sent sequence {} after {cursor}", record.sequence));
            }
            if record.sequence > through {
                break; // The rest comes from the stash.
            }
            cursor = record.sequence;
            commits.push(Commit {
                session,
                session_volume,
                session_epoch: epoch,
                volume: LocalVolume(vi as u32),
                record: Record { volume: session_volume, ..record },
                replayed: true,
            });
        }
        let r = self.replay_mut(vi);
        r.fetched_bytes += commits.iter().map(|c| c.record.op.payload_bytes()).sum::<u64>();
        r.cursor = cursor;
        self.jobs.extend(commits.into_iter().map(Job::Commit));
        self.pump_storage();
        let r = self.replay_mut(vi);
        if r.cursor >= r.through {
            return self.finish_pull(vi);
        }
        self.schedule_fetch(vi);
    }

    /// Fetch now, or wait for the pace or the committer.
    fn schedule_fetch(&mut self, vi: usize) {
        let now = self.now;
        let applied = self.volumes[vi].applied;
        let r = self.replay_mut(vi);
        if applied < r.backlog_until_applied {
            r.phase = ReplayPhase::Waiting { until: None };
            return;
        }
        // Once current writes outgrew the stash, pacing would let them outrun the pull for ever:
        // the rest of this replay goes as fast as the peer and the disk allow.
        let stash_full = r.seen > r.stash.back().map_or(r.through, |s| s.sequence);
        if stash_full && !r.unpaced {
            r.unpaced = true;
            let message = format!(
                "volume {:?}: current writes outgrew the replay stash; the rest of the replay is no longer paced",
                self.volumes[vi].spec.name
            );
            self.log(LogLevel::Warn, message);
        }
        let r = self.replay_mut(vi);
        if r.rate_bytes_per_s > 0 && !r.unpaced {
            let due_us = (r.fetched_bytes as u128 * 1_000_000 / r.rate_bytes_per_s as u128) as u64;
            let due = Time(r.started.0.saturating_add(due_us));
            if due > now {
                r.phase = ReplayPhase::Waiting { until: Some(due) };
                return;
            }
        }
        self.next_fetch(vi);
    }

    fn next_fetch(&mut self, vi: usize) {
        let (max_bytes, now) = (self.config.replay_fetch_bytes, self.now);
        let r = self.replay_mut(vi);
        r.request_id += 1;
        r.asked_at = now;
        let (peer, request_id, after) = (r.peer, r.request_id, r.cursor);
        r.phase = ReplayPhase::Fetching { request_id };
        let message = HostMessage::FetchLog { request_id, volume: VolumeId(0), after, max_bytes };
        self.emit(ElementAction::SendPeer { peer, message });
    }

    /// The gap is pulled through `through`: commit the stash after it. If the stash overflowed,
    /// pull on to the newest current write seen.
    fn finish_pull(&mut self, vi: usize) {
        let r = self.replay_mut(vi);
        let stash: Vec<Record> = r.stash.drain(..).collect();
        r.stash_bytes = 0;
        let (session, session_volume, epoch) = (r.session, r.session_volume, r.epoch);
        if let Some(last) = stash.last() {
            r.cursor = last.sequence;
            r.through = r.through.max(last.sequence);
        }
        let overflowed = r.seen > r.cursor;
        let (peer, cursor, seen) = (r.peer, r.cursor, r.seen);
        let volume = LocalVolume(vi as u32);
        self.jobs.extend(stash.into_iter().map(|record| {
            Job::Commit(Commit { session, session_volume, session_epoch: epoch, volume, record, replayed: false })
        }));
        self.pump_storage();
        if overflowed {
            let name = self.volumes[vi].spec.name.clone();
            self.log(
                LogLevel::Info,
                format!("volume {name:?}: current writes outgrew the replay stash; pulling on through {seen}"),
            );
            let r = self.replay_mut(vi);
            r.through = seen;
            if r.phase == ReplayPhase::Connecting {
                return; // The welcome starts the fetches.
            }
            return self.schedule_fetch(vi);
        }
        self.emit(ElementAction::ClosePeer { peer });
        self.volumes[vi].recovery = Recovery::Draining { session, session_volume, target: cursor };
        self.after_applied();
    }

    /// Replays a host element of an older epoch ordered stop once a newer one is adopted: the
    /// new one knows nothing of them and sends or orders what it needs itself. One left
    /// running would keep its records past the old order in its stash, waiting for a pull that
    /// may never end (its peer behind it), and the element would hold none of them.
    fn stop_superseded_replays(&mut self, epoch: Epoch) {
        for vi in 0..self.volumes.len() {
            if matches!(&self.volumes[vi].recovery, Recovery::Replaying(r) if r.epoch < epoch && r.phase != ReplayPhase::Stopped)
            {
                self.fail_replay(vi, format!("superseded: host element of epoch {epoch} took over"));
            }
        }
    }

    fn fail_replay(&mut self, vi: usize, reason: String) {
        let name = self.volumes[vi].spec.name.clone();
        let source = self.replay_mut(vi).source.clone();
        self.log(LogLevel::Warn, format!("volume {name:?}: replay recovery from {source} failed: {reason}"));
        let r = self.replay_mut(vi);
        r.phase = ReplayPhase::Stopped;
        r.stash.clear();
        r.stash_bytes = 0;
        let (peer, session, session_volume) = (r.peer, r.session, r.session_volume);
        self.emit(ElementAction::ClosePeer { peer });
        self.send(session, ElementMessage::RecoveryDone { volume: session_volume, result: Err(reason) });
    }

    pub fn handle_timeout(&mut self, now: Time) {
        self.tick(now);
        if self.hello_waits && self.promised_until.is_some_and(|until| until <= now) {
            self.pump_storage();
        }
        let idle_timeout_us = self.config.replay_idle_timeout_ms * 1000;
        for vi in 0..self.volumes.len() {
            let Recovery::Replaying(r) = &self.volumes[vi].recovery else { continue };
            match r.phase {
                ReplayPhase::Waiting { until: Some(until) } if until <= now => self.schedule_fetch(vi),
                ReplayPhase::Connecting | ReplayPhase::Verifying { .. } | ReplayPhase::Fetching { .. }
                    if now.0 >= r.asked_at.0 + idle_timeout_us =>
                {
                    let reason = format!("peer {} did not answer for {} s", r.source, idle_timeout_us / 1_000_000);
                    self.fail_replay(vi, reason);
                }
                _ => {}
            }
        }
        let mut expired = Vec::new();
        self.waiting_fetches.retain(|w| {
            let keep = w.deadline > now;
            if !keep {
                expired.push((w.session, w.volume, w.min_applied, w.request.clone()));
            }
            keep
        });
        for (session, volume, min_applied, request) in expired {
            let applied = self.volumes[volume.0 as usize].applied;
            let waited_s = self.config.source_catch_up_timeout_ms / 1000;
            let behind =
                format!("this element has applied only sequence {applied} after {waited_s} s; the snapshot was taken at {min_applied}");
            let reply = match request {
                HostMessage::Read { request_id, .. } => {
                    ElementMessage::ReadReply { request_id, applied_sequence: applied, result: Err(behind) }
                }
                HostMessage::BlockStatus { request_id, .. } => {
                    ElementMessage::BlockStatusReply { request_id, applied_sequence: applied, result: Err(behind) }
                }
                HostMessage::FetchBlocks { request_id, .. } => ElementMessage::Blocks {
                    request_id,
                    result: Err(format!(
                        "this element has applied only sequence {applied} after {waited_s} s; the copy needs {min_applied}"
                    )),
                },
                HostMessage::Scrub { request_id, .. } => ElementMessage::ScrubReply {
                    request_id,
                    result: Err(format!(
                        "this element has applied only sequence {applied} after {waited_s} s; the scrub needs {min_applied}"
                    )),
                },
                other => unreachable!("only block fetches, scrubs and snapshot reads wait, not {other:?}"),
            };
            self.send(session, reply);
        }
    }

    // ----- full recovery ----------------------------------------------------------------------

    fn order_copy(&mut self, volume: LocalVolume, order: CopyOrder) {
        let vi = volume.0 as usize;
        match &mut self.volumes[vi].recovery {
            Recovery::Copying { next, .. } => {
                // The running copy stops once its session is gone; this one starts after it.
                *next = Some(Box::new(order));
                return;
            }
            Recovery::Replaying(r) => {
                let peer = r.peer;
                self.emit(ElementAction::ClosePeer { peer });
            }
            _ => {}
        }
        self.start_copy(vi, order);
    }

    fn start_copy(&mut self, vi: usize, order: CopyOrder) {
        let state = self.sessions.get(&order.session).expect("a copy is ordered in a session");
        let (epoch, host) = (state.epoch.expect("a copy is ordered in a welcomed session"), state.host);
        let v = &mut self.volumes[vi];
        v.recovery = Recovery::Copying { session: order.session, next: None };
        let spec = v.spec.clone();
        self.emit(ElementAction::StartCopy {
            session: order.session,
            session_volume: order.session_volume,
            volume: LocalVolume(vi as u32),
            spec,
            epoch,
            host,
            source: order.source,
            rate_bytes_per_s: order.rate_bytes_per_s,
        });
    }

    pub fn handle_copy_progress(&mut self, now: Time, volume: LocalVolume, progress: ElementMessage) {
        self.tick(now);
        if let Recovery::Copying { session, .. } = self.volumes[volume.0 as usize].recovery {
            self.send(session, progress);
        }
    }

    /// Storage found a block of `volume` failing its checksum and made the volume a repair (a
    /// full recovery that verifies every block). The element is not in sync for it any more:
    /// every session that uses it gets a fault, a replay of it stops, and the next welcome
    /// reports it as needing repair, so the host element orders the copy that repairs it.
    pub fn handle_volume_damaged(&mut self, now: Time, volume: LocalVolume) {
        self.tick(now);
        let vi = volume.0 as usize;
        // A volume no session names (a snapshot storage numbered among volumes) is not
        // repaired on its own.
        let Some(v) = self.volumes.get_mut(vi).filter(|v| !v.removed) else { return };
        if v.repair || v.rebuilding() {
            // A copy under way or due rebuilds the volume anyway.
            return;
        }
        v.repair = true;
        match &v.recovery {
            Recovery::Replaying(r) => {
                let peer = r.peer;
                v.recovery = Recovery::Streaming;
                self.emit(ElementAction::ClosePeer { peer });
            }
            Recovery::Draining { .. } => v.recovery = Recovery::Streaming,
            _ => {}
        }
        let name = self.volumes[vi].spec.name.clone();
        self.log(
            LogLevel::Warn,
            format!("volume {name:?}: a block fails its checksum; repairing it by a full recovery"),
        );
        let users: Vec<SessionId> =
            self.sessions.iter().filter(|(_, s)| s.volumes.contains(&volume)).map(|(id, _)| *id).collect();
        for session in users {
            let reason =
                format!("volume {name:?}: a block fails its checksum; the element repairs it by a full recovery");
            self.send(session, ElementMessage::Fault { reason });
        }
    }

    /// The block copy ended: `info` is what storage now holds of the volume (still `copying`
    /// if it was interrupted), `result` what to tell the host element.
    pub fn handle_copy_done(
        &mut self,
        now: Time,
        volume: LocalVolume,
        session_volume: VolumeId,
        info: VolumeInfo,
        result: Result<Sequence, String>,
    ) {
        self.tick(now);
        let vi = volume.0 as usize;
        let Recovery::Copying { session, next } =
            std::mem::replace(&mut self.volumes[vi].recovery, Recovery::Streaming)
        else {
            unreachable!("copy done for a volume that is not copying")
        };
        let v = &mut self.volumes[vi];
        v.applied = info.applied;
        v.applied_epoch = info.applied_epoch;
        v.copy_interrupted = info.copying;
        v.repair = info.repair;
        // The copy replaced the volume's history.
        v.recent.clear();
        self.send(session, ElementMessage::CopyDone { volume: session_volume, result });
        if let Some(order) = next {
            if self.sessions.contains_key(&order.session) && !self.volumes[vi].removed {
                self.start_copy(vi, *order);
            }
        }
        self.after_applied();
    }

    // ----- checks -----------------------------------------------------------------------------

    /// Invariants that hold after every input (checked by the tests and the simulator).
    pub fn assert_invariants(&self) {
        let mut stash_total = 0;
        for (vi, v) in self.volumes.iter().enumerate() {
            match &v.recovery {
                Recovery::Replaying(r) => {
                    assert!(
                        r.cursor <= r.through || r.phase == ReplayPhase::Stopped,
                        "volume {vi}: cursor past through"
                    );
                    let mut expect = r.through;
                    for record in &r.stash {
                        assert_eq!(
                            record.sequence,
                            expect.next(),
                            "volume {vi}: the stash is contiguous after through"
                        );
                        expect = record.sequence;
                    }
                    assert!(r.seen >= expect, "volume {vi}: the stash holds only what was seen");
                    assert_eq!(r.stash_bytes, r.stash.iter().map(|s| s.op.payload_bytes()).sum::<u64>());
                    if r.phase == ReplayPhase::Stopped {
                        assert!(r.stash.is_empty(), "volume {vi}: a stopped replay keeps nothing");
                    }
                    stash_total += r.stash_bytes;
                    assert!(self.sessions.contains_key(&r.session), "volume {vi}: a replay belongs to a live session");
                }
                Recovery::Draining { session, target, .. } => {
                    assert!(self.sessions.contains_key(session));
                    assert!(
                        v.applied < *target || self.in_flight.is_some(),
                        "volume {vi}: a finished drain was not reported"
                    );
                }
                Recovery::Copying { .. } | Recovery::Streaming => {}
            }
        }
        assert!(stash_total <= self.config.replay_stash_bytes_max, "the stash stays within its bound");
        for (id, s) in &self.sessions {
            assert!(!(s.hello_pending && s.epoch.is_some()), "session {}: answered and pending", id.0);
            if s.epoch.is_some() {
                assert!(
                    (s.deferred.is_empty() || s.adding.is_some() || s.resizing) && s.hello.is_none(),
                    "session {}: nothing waits after the welcome but behind a volume change",
                    id.0
                );
            }
            assert!(s.volumes.iter().all(|l| *l == LocalVolume::REMOVED || (l.0 as usize) < self.volumes.len()));
        }
        if self.in_flight.is_none() {
            assert!(
                self.jobs.is_empty() || (self.hello_waits && matches!(self.jobs.front(), Some(Job::Hello { .. }))),
                "storage idles only with nothing queued, or with a hello waiting for the lease"
            );
        }
    }
}

fn stash_bytes_total(volumes: &[Volume]) -> u64 {
    volumes
        .iter()
        .map(|v| match &v.recovery {
            Recovery::Replaying(r) => r.stash_bytes,
            _ => 0,
        })
        .sum()
}

fn message_name(message: &ElementMessage) -> &'static str {
    match message {
        ElementMessage::Welcome { .. } => "Welcome",
        ElementMessage::VolumesAdded { .. } => "VolumesAdded",
        ElementMessage::VolumesChecked { .. } => "VolumesChecked",
        ElementMessage::VolumesRemoved { .. } => "VolumesRemoved",
        ElementMessage::VolumesResized { .. } => "VolumesResized",
        ElementMessage::Refused { .. } => "Refused",
        ElementMessage::Applied { .. } => "Applied",
        ElementMessage::Received { .. } => "Received",
        ElementMessage::ReadReply { .. } => "ReadReply",
        ElementMessage::BlockStatusReply { .. } => "BlockStatusReply",
        ElementMessage::Pong { .. } => "Pong",
        ElementMessage::Observed { .. } => "Observed",
        ElementMessage::LogRecords { .. } => "LogRecords",
        ElementMessage::RecoveryDone { .. } => "RecoveryDone",
        ElementMessage::Blocks { .. } => "Blocks",
        ElementMessage::ScrubReply { .. } => "ScrubReply",
        ElementMessage::CopyProgress { .. } => "CopyProgress",
        ElementMessage::CopyDone { .. } => "CopyDone",
        ElementMessage::Fault { .. } => "Fault",
    }
}

#[cfg(test)]
mod tests;
