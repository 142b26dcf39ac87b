//! The simulated world: one thread, one clock, one event queue. It runs the real
//! [`HostCore`] behind a model of its shell (element links that connect, break and reconnect
//! with backoff; a session id filter), in-memory [`Element`]s, TCP-like sessions over links
//! that delay, stall, slow down and reset, simulated hosts issuing requests, a fault schedule
//! drawn from the seed, and the checkers.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};

use bytes::Bytes;
use proto::{ElementMessage, Epoch, HostMessage, Op, Record, Sequence, VolumeId, VolumeSpec};
use starfish_core::catalog::{Catalog, IntentionLog, LogPolicy};
use starfish_core::groups::{ExportedVolume, GroupSpec};
use starfish_core::mem_storage::DIVERGED_BYTE;
use starfish_core::standby::{Decision, Key, Observation, StandbyConfig, StandbyCore};
use starfish_core::{Action, ElementId, Event, Failure, HostConfig, HostCore, HostError, PeerId, Reply, Time, Token};

use crate::element::{CrashKind, Element, Out};
use crate::model::{Model, OpKind, OpRec, Outcome};
use crate::options::{Broken, FaultKind, Scenario, SimOptions};
use crate::report::RunReport;
use crate::rng::{splitmix64, Rng};
use crate::sector::{fill_sector, SECTOR_BYTES};

/// How long the system gets, after every fault is healed, to converge before it is judged.
const QUIET_MS: u64 = 20_000;
/// How long the final probe requests get to be answered.
const FINAL_MS: u64 = 15_000;
/// A connection attempt to an unreachable element gives up after this (`CONNECT_TIMEOUT` of
/// `crates/shell/src/host.rs`).
const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// A stopping host element waits this long at most for its clients' requests under way (the
/// shell's `STOP_WAIT`).
const STOP_WAIT_MS: u64 = 2_000;
/// Reconnect backoff: from 50 ms, doubling to 2 s; reset only by a session that lasted 10 s
/// (`run_element_link`).
const BACKOFF_MS_MIN: u64 = 50;
const BACKOFF_MS_MAX: u64 = 2_000;
const SESSION_STABLE_MS: u64 = 10_000;
/// A run that needs more events than this is stuck.
const EVENTS_MAX: u64 = 20_000_000;
/// `--volume-ops`: the catalog's storage volume here (the shell's is 16 MiB; the document of a
/// few volumes fits in one block).
const CATALOG_BYTES: u64 = 64 << 10;
/// Tokens of the requests the simulated shell makes itself (the catalog's I/O and checks).
const INTERNAL_TOKENS: u64 = 1 << 60;
/// Volumes created per run, at most.
const CREATED_MAX: usize = 3;
/// Volume operations (creations and deletions: the catalog's ids) per run, at most.
const OPS_MAX: u64 = 5;
/// A volume created while running grows to at most this many times its first size.
const GROW_MAX_FACTOR: u64 = 2;
/// The consistency group's name (`--groups`).
const GROUP: &str = "g";

const TO_ELEMENT: usize = 0;
const TO_HOST: usize = 1;

#[derive(Debug)]
enum ToElement {
    Msg(HostMessage),
    /// The host element closed the session (FIN after the data already sent).
    Close,
}

#[derive(Debug)]
enum ToHost {
    Msg(ElementMessage),
    /// The element's end closed or reset.
    Close(String),
}

#[derive(Debug)]
enum Wire {
    ToElement(ToElement),
    ToHost(ToHost),
}

impl Wire {
    fn bytes(&self) -> u64 {
        let payload = match self {
            Wire::ToElement(ToElement::Msg(HostMessage::Apply(r))) => r.op.payload_bytes(),
            Wire::ToHost(ToHost::Msg(ElementMessage::ReadReply { result: Ok(d), .. })) => d.data.len() as u64,
            Wire::ToHost(ToHost::Msg(ElementMessage::LogRecords { result: Ok(rs), .. })) => {
                rs.iter().map(|r| r.op.payload_bytes() + 48).sum()
            }
            _ => 0,
        };
        64 + payload
    }
}

#[derive(Debug)]
enum Ev {
    Deliver {
        session: u64,
        wire: Wire,
        /// When its last byte leaves the sender (later than now: still queued there).
        departs: Time,
    },
    LinkEnded {
        instance: u32,
        element: usize,
        session: u64,
        reason: String,
    },
    ConnectStart {
        instance: u32,
        element: usize,
    },
    ConnectDone {
        instance: u32,
        element: usize,
    },
    ElementSend {
        element: usize,
        incarnation: u64,
        session: u64,
        message: ElementMessage,
    },
    SyncDone {
        element: usize,
        incarnation: u64,
    },
    CopyFetched {
        element: usize,
        incarnation: u64,
        session: u64,
        volume: VolumeId,
        result: Result<starfish_core::mem_storage::VolumeCopy, String>,
    },
    /// A message on a peer link reaches the element it was opened to.
    PeerDeliver {
        link: u64,
        message: HostMessage,
    },
    /// The answer on a peer link reaches the element that opened it.
    PeerReply {
        link: u64,
        message: ElementMessage,
    },
    /// A peer link ended (its far side crashed or refused).
    PeerEnded {
        element: usize,
        incarnation: u64,
        peer: PeerId,
        reason: String,
    },
    /// An element core's timer.
    ElementTimer {
        element: usize,
        incarnation: u64,
    },
    ElementRestart {
        element: usize,
    },
    HostRestart,
    /// With volume operations: the host element `instance` that took over from a paused one
    /// carries out one volume operation now (`HostPause`; it crashes before the paused one runs
    /// again, which then takes the elements back with the catalog it read before the pause).
    VolumeOpOnce {
        instance: u32,
    },
    /// A shrink's zeroing (or its FLUSH) was answered: its next step.
    ShrinkStep {
        instance: u32,
    },
    /// ... and then crashes; the next host element starts only once the paused one could have
    /// taken the elements back.
    CrashTakeover {
        instance: u32,
    },
    /// The standby asks the elements and the coordinator again (`host_crash_standby_takes_over`).
    StandbyPoll,
    /// The superseded host element `instance` is finally killed.
    KillSuperseded {
        instance: u32,
    },
    /// The stopping host element `instance` checks whether it may let the elements go.
    HostStopStep {
        instance: u32,
    },
    HealStall {
        element: usize,
        dir: usize,
    },
    HealSlowLink {
        element: usize,
    },
    HealSlowDisk {
        element: usize,
    },
    HealDiskFull {
        element: usize,
    },
    NextFault,
    /// `--volume-ops`: an operator asks for a new volume.
    VolumeOp,
    /// `--volume-ops`: the host element `instance` crashes in the middle of a creation (the
    /// real tests' failpoints, at random steps).
    CrashMidOp {
        instance: u32,
    },
    ClientWake {
        client: usize,
    },
    EndFaultPhase,
    EndQuiet,
    EndFinal,
    /// An `Apply` to a `network-sync` element left the host element's side of the link: the
    /// shell tells the core so.
    Sent {
        instance: u32,
        element: usize,
        session: u64,
        volume: VolumeId,
        sequence: Sequence,
    },
}

impl Ev {
    fn code(&self) -> u64 {
        match self {
            Ev::Deliver { session, .. } => 1 ^ (session << 8),
            Ev::LinkEnded { session, .. } => 2 ^ (session << 8),
            Ev::ConnectStart { element, .. } => 3 ^ ((*element as u64) << 8),
            Ev::ConnectDone { element, .. } => 4 ^ ((*element as u64) << 8),
            Ev::ElementSend { session, .. } => 5 ^ (session << 8),
            Ev::SyncDone { element, .. } => 6 ^ ((*element as u64) << 8),
            Ev::PeerDeliver { link, .. } => 7 ^ (link << 8),
            Ev::PeerReply { link, .. } => 21 ^ (link << 8),
            Ev::PeerEnded { element, .. } => 22 ^ ((*element as u64) << 8),
            Ev::ElementTimer { element, .. } => 23 ^ ((*element as u64) << 8),
            Ev::ElementRestart { element } => 8 ^ ((*element as u64) << 8),
            Ev::HostRestart => 9,
            Ev::VolumeOp => 31,
            Ev::CrashMidOp { instance } => 32 ^ ((*instance as u64) << 8),
            Ev::VolumeOpOnce { instance } => 33 ^ ((*instance as u64) << 8),
            Ev::ShrinkStep { instance } => 35 ^ ((*instance as u64) << 8),
            Ev::CrashTakeover { instance } => 34 ^ ((*instance as u64) << 8),
            Ev::StandbyPoll => 24,
            Ev::HealStall { element, .. } => 10 ^ ((*element as u64) << 8),
            Ev::HealSlowLink { element } => 11 ^ ((*element as u64) << 8),
            Ev::HealSlowDisk { element } => 12 ^ ((*element as u64) << 8),
            Ev::HealDiskFull { element } => 13 ^ ((*element as u64) << 8),
            Ev::NextFault => 14,
            Ev::ClientWake { client } => 15 ^ ((*client as u64) << 8),
            Ev::EndFaultPhase => 16,
            Ev::EndQuiet => 17,
            Ev::EndFinal => 18,
            Ev::KillSuperseded { instance } => 19 ^ ((*instance as u64) << 8),
            Ev::HostStopStep { instance } => 36 ^ ((*instance as u64) << 8),
            Ev::CopyFetched { element, .. } => 20 ^ ((*element as u64) << 8),
            Ev::Sent { session, .. } => 25 ^ (session << 8),
        }
    }
}

struct Scheduled {
    at: Time,
    id: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.id) == (other.at, other.id)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.id).cmp(&(other.at, other.id))
    }
}

#[derive(Default, Clone, Copy)]
struct Channel {
    busy_until: Time,
    last_arrival: Time,
}

/// One TCP connection between the host element and an element.
struct NetSession {
    element: usize,
    instance: u32,
    incarnation: u64,
    host_open: bool,
    element_open: bool,
    /// Reset: whatever is in flight is dropped.
    dead: bool,
    channels: [Channel; 2],
}

/// The state of the network path to one element.
struct Link {
    latency_us: u64,
    jitter_us: u64,
    bandwidth_bytes_per_s: u64,
    stalled: [bool; 2],
    stall_until: [Time; 2],
    held: [VecDeque<(u64, Wire)>; 2],
    slow_factor: u64,
    slow_bandwidth_bytes_per_s: u64,
    slow_until: Time,
}

/// The shell's view of one element: the current session and the reconnect loop.
#[derive(Clone)]
struct HostLink {
    /// The session messages are accepted from (the shell's session id filter).
    current: Option<u64>,
    /// The session whose end the link task has not reported yet.
    running: Option<u64>,
    backoff_ms: u64,
    /// When the running session was opened.
    opened: Time,
}

struct Host {
    instance: u32,
    core: HostCore,
    links: Vec<HostLink>,
    /// The core has taken a Welcome in the current session.
    welcomed: Vec<bool>,
    ready: bool,
    /// Per volume, the sequence the next accepted write gets.
    next_sequence: Vec<u64>,
    /// Per volume, write-like requests in submission order not yet given a sequence.
    unsequenced: Vec<VecDeque<u64>>,
    last_timeout: Option<Time>,
    past_deadline_since: Option<Time>,
    /// The core started over (`Event::Restarted`): ops before this one count as an earlier
    /// host element's.
    restarted_before_op: Option<u64>,
    /// Paused (SIGSTOP) until then: nothing reaches it and its timers wait.
    paused_until: Option<Time>,
    /// `welcomed` when the core, not yet ready, last asked for a start-up roll-forward
    /// (`FetchLog`): the elements its start-up decision was made from. Welcomes that arrive
    /// while that fetch is under way do not change the decision.
    decided_with: Option<Vec<bool>>,
    /// `--volume-ops`, as the shell's catalog task: the intention log once the catalog is read,
    /// whether it is being read or written, and whether a creation is under way.
    catalog: Option<IntentionLog>,
    catalog_reading: bool,
    catalog_writing: bool,
    /// A volume operation is under way (one at a time, as an operator's script).
    creating: bool,
    /// A deletion waits for its volume's requests to end (index in `World::created`).
    draining: Option<usize>,
    /// A shrink waits for its volume's requests to end (as the shell refuses one while NBD
    /// clients are connected): index in `World::created`, and the new size.
    draining_shrink: Option<(usize, u64)>,
    zeroing: Option<Zeroing>,
    /// Stopping cleanly (`host_stop`): it takes no new request, and lets the elements go once
    /// those under way are answered or at this time.
    stopping_until: Option<Time>,
}

/// A request the simulated shell made itself.
#[derive(Clone, Debug)]
enum Internal {
    CatalogRead,
    CatalogWrite,
    CatalogFlush,
    /// A creation's prepare (of a clone of the snapshot at this index of `World::snapshots`).
    Check {
        name: String,
        clone_of: Option<usize>,
    },
    CheckResize {
        name: String,
        size_bytes: u64,
    },
    /// A prepare of a volume that joins the consistency group (`--groups --volume-ops`).
    CheckJoin {
        name: String,
    },
}

/// A snapshot a host asked for (`--snapshots`).
#[derive(Clone, Debug)]
struct SimSnapshot {
    /// Its request (and the snapshot's id).
    id: u64,
    /// The hosts' volume it was taken of (a consistency group's member: of its group).
    volume: usize,
    /// Acknowledged: it may be read.
    acked: bool,
    /// Its deletion was asked for: it is read no more.
    deleting: bool,
    /// A clone of it was asked for (`--volume-ops`): as the catalog refuses to delete a
    /// snapshot with clones (made or being made), it is never deleted.
    cloned: bool,
}

/// A volume created while running (`--volume-ops`).
#[derive(Clone, Debug)]
struct Created {
    name: String,
    /// Its storage volume on the elements.
    storage: String,
    /// Its index among the hosts' volumes (the model's).
    volume: usize,
    /// The operator was told it exists.
    acked: bool,
    intention: u64,
    /// Asked to be deleted (its requests end, then the deletion is logged).
    deleting: bool,
    /// The deletion's intention (logged, or found pending by a starting host element).
    delete_intention: Option<u64>,
    /// The operator was told it is deleted: it must never be served again.
    delete_acked: bool,
    /// A resize logged (and maybe carried out), not yet acknowledged: its intention.
    resize_intention: Option<u64>,
    /// The size the operator was last told it has by a resize (0: never resized).
    resize_acked_bytes: u64,
    /// A shrink to this size was asked and not acknowledged: a new host element may serve
    /// the volume that small (the shrink rolled forward) or as it was (never logged).
    shrink_to: Option<u64>,
    /// A clone (`--snapshots --volume-ops`) of the snapshot at this index of
    /// `World::snapshots`: the workload only reads it, as that snapshot (never resized).
    clone_of: Option<usize>,
    /// A member that joined the consistency group while running: the group's storage volume
    /// (then `storage` is only its key here, unique). Never resized here; its deletion zeroes
    /// its window.
    member_of: Option<String>,
}

impl Created {
    /// Served again: a deletion asked for and never logged (or undone) leaves it. Its volume.
    fn kept(&mut self) -> usize {
        self.deleting = false;
        self.delete_intention = None;
        self.volume
    }

    /// A created volume with nothing under way: neither a clone nor a joined member.
    fn new(name: String, storage: String, volume: usize, acked: bool, intention: u64) -> Created {
        Created {
            name,
            storage,
            volume,
            acked,
            intention,
            deleting: false,
            delete_intention: None,
            delete_acked: false,
            resize_intention: None,
            resize_acked_bytes: 0,
            shrink_to: None,
            clone_of: None,
            member_of: None,
        }
    }
}

/// A shrink carried out whose blocks past the new end are being zeroed, as the shell's
/// catalog task does: a WRITE_ZEROES of them through the ordered stream, then a FLUSH, each
/// retried until it succeeds; then the shrink is acknowledged and completed.
#[derive(Clone, Debug)]
struct Zeroing {
    intention: u64,
    /// Index in `World::created`.
    created: usize,
    /// The hosts' volume's sectors from the new end to its storage volume's end.
    from_sector: u64,
    to_sector: u64,
    /// The model's requests of the zeroing and the FLUSH under way.
    zero: Option<u64>,
    flush: Option<u64>,
}

#[derive(PartialEq, Eq, Clone, Copy, Debug)]
enum Phase {
    Faults,
    Quiet,
    Final,
    Done,
}

pub struct World {
    o: SimOptions,
    sc: Scenario,
    now: Time,
    queue: BinaryHeap<Reverse<Scheduled>>,
    next_event: u64,
    rng_net: Rng,
    rng_work: Rng,
    rng_fault: Rng,
    rng_disk: Rng,
    /// Host elements' clocks: the first epoch each offers (skewed, frozen, cloned).
    rng_clock: Rng,
    /// `--volume-ops`: when operators ask for volumes.
    rng_ops: Rng,
    /// Whether a volume operation is a resize: a stream of its own, so that runs that resize
    /// nothing take the same path as before resizes existed.
    rng_resize: Rng,
    /// Whether a creation is a clone (`--snapshots --volume-ops`): its own stream, so that
    /// other runs draw as before.
    rng_clone: Rng,
    /// The first epoch the last host element offered (what its clock said).
    last_offer: u64,
    elements: Vec<Element>,
    links: Vec<Link>,
    sessions: BTreeMap<u64, NetSession>,
    next_session: u64,
    /// The current host element: the newest one started.
    host: Option<Host>,
    /// A host element a newer one took over from while it still runs (`host_superseded`):
    /// it keeps its sessions, its clients and its timers until it is killed. Its inputs run
    /// through the same code as the current one's: while one is handled, it is swapped into
    /// `host` (and the current one into this field), with `in_superseded` set.
    superseded: Option<Host>,
    in_superseded: bool,
    instances: u32,
    model: Model,
    clients: Vec<Option<u64>>,
    phase: Phase,
    /// (volume, epoch, sequence) → request id. Looked up only, never iterated.
    sequences: HashMap<(usize, u64, u64), u64>,
    /// The beginnings host elements appended (`Op::Begin`): (storage volume, epoch, sequence).
    begins: HashSet<(usize, u64, u64)>,
    /// Epoch → the host element instance that acknowledged a write in it: never two.
    ack_owner: HashMap<u64, u32>,
    final_requests: Vec<u64>,
    /// Silent divergences injected (`diverge_block`).
    diverge_faults: u64,
    /// Writes answered while fewer than Q elements held them durably (weaker ack policies),
    /// until Q do: (volume, epoch, sequence).
    weak_acked: BTreeMap<u64, (usize, Epoch, Sequence)>,
    /// Of those, the ones a successful FLUSH covered: never to be lost.
    weak_flushed: std::collections::BTreeSet<u64>,
    in_sync_at_quiet: usize,
    /// Of those, the ones whose ack policy counts toward the quorum.
    counting_in_sync_at_quiet: usize,
    /// Per element, whether it was in sync and counted toward Q when every fault had healed,
    /// and how many damaged volumes it had found by then (a bad block injected during the
    /// faults may surface only at a final request's read).
    counting_at_quiet: Vec<(bool, u64)>,
    /// Per element, the newest reason the core gave for failing it.
    last_failure: Vec<Option<Failure>>,
    /// Per element, the kind of the recovery under way (to say how a diverged one got in).
    recovery_kind: Vec<Option<&'static str>>,
    sectors_per_volume: u64,
    /// Per hosts' volume, the sectors it is served with: only ever grows (a resize carried
    /// out). The workload stays inside; a host element serving fewer breaks the promise.
    volume_sectors: Vec<u64>,
    /// The volumes the host element's core and the elements hold (a consistency group is one
    /// of them), and where each volume the hosts see lies in them (by the hosts' volume index).
    storage_volumes: Vec<VolumeSpec>,
    exports: Vec<ExportedVolume>,
    /// The name of the storage volume that carries each hosts' volume (by the hosts' volume
    /// index): stable across host elements, which may number storage volumes differently.
    export_storage: Vec<String>,
    /// The storage volumes that carry the consistency group's members (one; two in the
    /// `split-group` broken variant); empty without `--groups`.
    group_storage: Vec<usize>,
    /// (storage volume, epoch) → the group's acknowledged write-likes there in the order
    /// they were answered: (reply step, the highest sequence answered so far).
    group_acks: HashMap<(usize, u64), Vec<(u64, u64)>>,
    /// Per element, what the group-order check last saw of it: per group storage volume,
    /// its history's length and last epoch.
    group_checked: Vec<Vec<(usize, Option<Epoch>)>>,
    /// `--volume-ops`: the volumes created, the shell's own requests in flight (token →
    /// host element instance, what), and which of the hosts' volumes the current host
    /// element serves.
    created: Vec<Created>,
    /// `--snapshots`: the snapshots asked for (their ids are their requests'), and which
    /// snapshot each snapshot read reads.
    snapshots: Vec<SimSnapshot>,
    snapshot_reads: HashMap<u64, u64>,
    internal: HashMap<u64, (u32, Internal)>,
    next_internal: u64,
    served: Vec<bool>,
    report: RunReport,
    /// Sessions elements opened to peers (replay sources, copy sources), by session id.
    peer_links: BTreeMap<u64, PeerLink>,
    /// Per element, the time its core's timer is set for.
    timers: Vec<Option<Time>>,
    /// A standby waiting to take over (`host_crash_standby_takes_over`), and the coordinator's
    /// key as it models it: (holder, revision, when the holder's lease lapses).
    standby: Option<StandbyCore>,
    coordinator_key: Option<(proto::HostId, i64, Option<Time>)>,
    coordinator_revision: i64,
}

/// An element's session to a peer element.
struct PeerLink {
    from: usize,
    from_incarnation: u64,
    /// The opening element's name for it (`None` for a copy's fetch, which the world runs).
    peer: Option<PeerId>,
    to: usize,
    to_incarnation: u64,
    copy: Option<CopyFetch>,
}

/// A full recovery's fetch of a peer's volume, on behalf of the element's `session`.
#[derive(Clone, Copy)]
struct CopyFetch {
    session: u64,
    volume: VolumeId,
}

/// Whether a copy of a volume holds record `sequence` of `epoch` (applied, durably).
fn holds(copy: Option<&starfish_core::mem_storage::Volume>, epoch: Epoch, sequence: Sequence) -> bool {
    copy.and_then(|v| v.history.get((sequence.0 - 1) as usize)) == Some(&epoch)
}

fn us(ms: u64) -> u64 {
    ms * 1000
}

fn at_delay(now: Time, delay_us: u64) -> Time {
    Time(now.0 + delay_us)
}

impl World {
    pub fn new(o: SimOptions) -> World {
        let mut rng_scenario = Rng::new(o.seed, 1);
        let sc = Scenario::draw(&o, &mut rng_scenario);
        let (mut storage_volumes, exports, group_storage) = layout(&o, &sc);
        if o.volume_ops {
            let name = starfish_core::catalog::CATALOG_VOLUME.to_string();
            storage_volumes.push(VolumeSpec { name, size_bytes: CATALOG_BYTES, clone_of: None, at_least: false });
        }
        let volume_count = exports.len();
        let export_storage = exports.iter().map(|e| storage_volumes[e.volume].name.clone()).collect();
        let names: Vec<String> = (0..o.elements).map(|i| format!("e{i}")).collect();
        // Room for volumes grown, and for the group's storage volume grown by every join.
        let align = starfish_core::groups::MEMBER_ALIGN_BYTES;
        let joins = group_storage
            .first()
            .map_or(0, |&g| storage_volumes[g].size_bytes + OPS_MAX * sc.volume_bytes.div_ceil(align) * align);
        let largest = if o.volume_ops { (sc.volume_bytes * GROW_MAX_FACTOR).max(joins) } else { 0 };
        let elements = (0..o.elements)
            .map(|i| {
                Element::new(
                    names[i].clone(),
                    i as u64 + 1,
                    &storage_volumes,
                    largest,
                    sc.fsync_us[i],
                    sc.replay_log_bytes[i],
                    o.broken,
                )
            })
            .collect();
        let links = sc
            .links
            .iter()
            .map(|p| Link {
                latency_us: p.latency_us,
                jitter_us: p.jitter_us,
                bandwidth_bytes_per_s: p.bandwidth_bytes_per_s,
                stalled: [false; 2],
                stall_until: [Time(0); 2],
                held: [VecDeque::new(), VecDeque::new()],
                slow_factor: 1,
                slow_bandwidth_bytes_per_s: 0,
                slow_until: Time(0),
            })
            .collect();
        let sectors_per_volume = sc.volume_bytes / SECTOR_BYTES;
        let report = RunReport {
            seed: o.seed,
            replay: o.replay_command(),
            peer_recovery: sc.replay_recovery,
            ..RunReport::default()
        };
        let n = o.elements;
        World {
            model: Model::new(sc.volumes, sectors_per_volume),
            clients: vec![None; sc.clients],
            rng_net: Rng::new(o.seed, 2),
            rng_work: Rng::new(o.seed, 3),
            rng_fault: Rng::new(o.seed, 4),
            rng_disk: Rng::new(o.seed, 5),
            rng_clock: Rng::new(o.seed, 7),
            rng_ops: Rng::new(o.seed, 9),
            rng_resize: Rng::new(o.seed, 10),
            rng_clone: Rng::new(o.seed, 11),
            last_offer: 1,
            sc,
            o,
            now: Time(0),
            queue: BinaryHeap::new(),
            next_event: 0,
            elements,
            links,
            sessions: BTreeMap::new(),
            next_session: 1,
            host: None,
            superseded: None,
            in_superseded: false,
            instances: 0,
            phase: Phase::Faults,
            sequences: HashMap::new(),
            begins: HashSet::new(),
            ack_owner: HashMap::new(),
            standby: None,
            coordinator_key: None,
            coordinator_revision: 0,
            final_requests: Vec::new(),
            diverge_faults: 0,
            weak_acked: BTreeMap::new(),
            weak_flushed: std::collections::BTreeSet::new(),
            in_sync_at_quiet: 0,
            counting_in_sync_at_quiet: 0,
            counting_at_quiet: Vec::new(),
            last_failure: vec![None; n],
            recovery_kind: vec![None; n],
            sectors_per_volume,
            volume_sectors: vec![sectors_per_volume; volume_count],
            storage_volumes,
            exports,
            export_storage,
            group_storage,
            group_acks: HashMap::new(),
            group_checked: vec![Vec::new(); n],
            created: Vec::new(),
            snapshots: Vec::new(),
            snapshot_reads: HashMap::new(),
            internal: HashMap::new(),
            next_internal: INTERNAL_TOKENS,
            served: vec![true; volume_count],
            report,
            peer_links: BTreeMap::new(),
            timers: vec![None; n],
        }
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.o.trace {
            let who = if self.in_superseded { "[superseded HE] " } else { "" };
            eprintln!("{:>11.6} {who}{}", self.now.0 as f64 / 1e6, what());
        }
    }

    fn schedule(&mut self, at: Time, ev: Ev) {
        let at = at.max(self.now);
        self.next_event += 1;
        self.queue.push(Reverse(Scheduled { at, id: self.next_event, ev }));
    }

    fn violation(&mut self, message: String) {
        self.trace(|| format!("VIOLATION {message}"));
        self.model.violation(message);
    }

    fn count_fault(&mut self, kind: FaultKind) {
        *self.report.faults.entry(kind.name()).or_default() += 1;
    }

    // ----- the run ----------------------------------------------------------------------------

    pub fn run(mut self) -> RunReport {
        self.start_host();
        for c in 0..self.clients.len() {
            let at = at_delay(self.now, self.rng_work.range(0, 2_000));
            self.schedule(at, Ev::ClientWake { client: c });
        }
        let first_fault = at_delay(self.now, (self.rng_fault.exp(self.sc.fault_interval_ms) * 1000.0) as u64);
        self.schedule(first_fault, Ev::NextFault);
        if self.o.volume_ops {
            let first = at_delay(self.now, (self.rng_ops.exp(1_500.0) * 1000.0) as u64 + 1);
            self.schedule(first, Ev::VolumeOp);
        }
        self.schedule(Time(us(self.o.fault_phase_ms)), Ev::EndFaultPhase);
        while self.phase != Phase::Done {
            self.report.events += 1;
            if self.report.events > EVENTS_MAX {
                self.violation(format!("the run did not finish within {EVENTS_MAX} events"));
                break;
            }
            let next_at = self.queue.peek().map(|s| s.0.at);
            if let Some((deadline, instance)) = self.core_deadline() {
                if next_at.is_none_or(|t| deadline < t) {
                    self.now = self.now.max(deadline);
                    self.report.digest = splitmix64(self.report.digest ^ self.now.0 ^ 0xC0);
                    let now = self.now;
                    self.with_host(instance, |w| {
                        let host = w.host.as_mut().expect("a deadline comes from a host");
                        host.last_timeout = Some(now);
                        host.core.handle_timeout(now);
                        w.drain();
                    });
                    continue;
                }
            }
            let Some(Reverse(s)) = self.queue.pop() else {
                self.violation("nothing left to do before the end of the run".into());
                break;
            };
            self.now = s.at;
            self.report.digest = splitmix64(self.report.digest ^ self.now.0.rotate_left(17) ^ s.ev.code());
            self.dispatch(s.ev);
            if !self.group_storage.is_empty() {
                self.check_group_order();
            }
        }
        self.report.sim_ms = self.now.0 / 1000;
        self.report.violations = std::mem::take(&mut self.model.violations);
        self.report.reads_checked = self.model.reads_checked;
        self.report.sectors_checked = self.model.sectors_checked;
        self.report.requests = self.model.len() as u64;
        self.report.writes_acked =
            self.model.ops().filter(|(_, op)| op.kind.write_like() && op.outcome == Outcome::Ok).count() as u64;
        self.report.torn_records = self.elements.iter().map(|e| e.storage.torn_records).sum();
        self.report.copies_interrupted = self.elements.iter().map(|e| e.storage.copies_interrupted).sum();
        self.report.unsynced_records_lost = self.elements.iter().map(|e| e.storage.unsynced_lost).sum();
        self.report.records_applied_behind_another_volume =
            self.elements.iter().map(|e| e.storage.applied_behind_another_volume).sum();
        self.report
    }

    /// When a core wants `handle_timeout`, and which host element's (the current one's, or the
    /// superseded one's while it runs). A deadline already handled and still in the past (the
    /// core has nothing to do until another input) is polled every 10 ms instead, as a shell
    /// with a coarse timer would; how long that lasts is reported.
    fn core_deadline(&mut self) -> Option<(Time, u32)> {
        let now = self.now;
        let mut next: Option<(Time, u32)> = None;
        for host in [self.host.as_mut(), self.superseded.as_mut()].into_iter().flatten() {
            let Some(t) = host.core.poll_timeout() else {
                continue;
            };
            // A paused process's timers fire when it runs again.
            let t = match host.paused_until {
                Some(until) if until > now => t.max(until),
                _ => t,
            };
            let at = match host.last_timeout {
                Some(last) if t <= last => {
                    let since = *host.past_deadline_since.get_or_insert(last);
                    let ms = now.micros_since(since) / 1000;
                    self.report.past_deadline_ms_max = self.report.past_deadline_ms_max.max(ms);
                    last.plus_ms(10)
                }
                _ => {
                    host.past_deadline_since = None;
                    t.max(now)
                }
            };
            if next.is_none_or(|(n, _)| at < n) {
                next = Some((at, host.instance));
            }
        }
        next
    }

    /// Run `f` with host element `instance` as `self.host` (see `superseded`); nothing if it
    /// no longer runs.
    fn with_host(&mut self, instance: u32, f: impl FnOnce(&mut World)) {
        if self.host.as_ref().is_some_and(|h| h.instance == instance) {
            f(self);
        } else if self.superseded.as_ref().is_some_and(|h| h.instance == instance) {
            std::mem::swap(&mut self.host, &mut self.superseded);
            self.in_superseded = true;
            f(self);
            self.in_superseded = false;
            std::mem::swap(&mut self.host, &mut self.superseded);
        }
    }

    /// The host element a client's requests go to. While a superseded one runs, even clients
    /// stay with it (still connected to it) and odd ones go to the new one at once (a
    /// floating address moved): what one acknowledges, the other must not read stale.
    fn serving_instance(&self, client: usize) -> Option<u32> {
        let current = self.host.as_ref().map(|h| h.instance);
        match &self.superseded {
            Some(old) if client.is_multiple_of(2) || current.is_none() => Some(old.instance),
            _ => current,
        }
    }

    /// The time a paused host element runs again, if `ev` is for it.
    fn paused_target(&self, ev: &Ev) -> Option<Time> {
        let instance = match ev {
            Ev::Deliver { session, wire: Wire::ToHost(_), .. } => self.sessions.get(session)?.instance,
            Ev::LinkEnded { instance, .. }
            | Ev::ConnectStart { instance, .. }
            | Ev::ConnectDone { instance, .. }
            | Ev::Sent { instance, .. } => *instance,
            Ev::ClientWake { client } => self.serving_instance(*client)?,
            _ => return None,
        };
        let host =
            [self.host.as_ref(), self.superseded.as_ref()].into_iter().flatten().find(|h| h.instance == instance)?;
        host.paused_until.filter(|&until| until > self.now)
    }

    fn dispatch(&mut self, ev: Ev) {
        if let Some(until) = self.paused_target(&ev) {
            return self.schedule(until, ev);
        }
        match ev {
            Ev::Deliver { session, wire, .. } => self.deliver(session, wire),
            Ev::LinkEnded { instance, element, session, reason } => {
                self.with_host(instance, |w| w.link_ended(element, session, reason))
            }
            Ev::ConnectStart { instance, element } => self.with_host(instance, |w| w.connect_start(instance, element)),
            Ev::ConnectDone { instance, element } => self.with_host(instance, |w| w.connect_done(instance, element)),
            Ev::Sent { instance, element, session, volume, sequence } => self.with_host(instance, |w| {
                let host = w.host.as_mut().expect("with_host");
                if host.links[element].current == Some(session) {
                    host.core.handle_element_sent(w.now, ElementId(element as u8), volume, sequence);
                    w.drain();
                }
            }),
            Ev::ElementSend { element, incarnation, session, message } => {
                if self.elements[element].alive && self.elements[element].incarnation == incarnation {
                    self.element_send(element, session, message);
                }
            }
            Ev::SyncDone { element, incarnation } => {
                let el = &mut self.elements[element];
                if el.alive && el.incarnation == incarnation {
                    let mut out = Vec::new();
                    el.sync_done(self.now, &mut self.rng_disk, &mut out);
                    self.element_outputs(element, out);
                }
            }
            Ev::PeerDeliver { link, message } => self.peer_deliver(link, message),
            Ev::PeerReply { link, message } => self.peer_reply(link, message),
            Ev::PeerEnded { element, incarnation, peer, reason } => {
                let el = &mut self.elements[element];
                if el.alive && el.incarnation == incarnation {
                    let mut out = Vec::new();
                    el.peer_closed(self.now, &mut self.rng_disk, peer, reason, &mut out);
                    self.element_outputs(element, out);
                }
            }
            Ev::ElementTimer { element, incarnation } => {
                let now = self.now;
                let el = &mut self.elements[element];
                if el.alive && el.incarnation == incarnation && self.timers[element].is_some_and(|t| t <= now) {
                    self.timers[element] = None;
                    let mut out = Vec::new();
                    el.timeout(now, &mut self.rng_disk, &mut out);
                    self.element_outputs(element, out);
                }
            }
            Ev::CopyFetched { element, incarnation, session, volume, result } => {
                let el = &mut self.elements[element];
                if !(el.alive && el.incarnation == incarnation) {
                    return;
                }
                let mut out = Vec::new();
                if !el.has_session(session) {
                    // As the real copy task: it stops once its session is gone, and says so.
                    let reason = "the host element's session ended".to_string();
                    el.copy_failed(self.now, &mut self.rng_disk, volume, reason, &mut out);
                    self.element_outputs(element, out);
                    return;
                }
                match result {
                    Ok(copy) if el.commits_pending(volume.0 as usize) => {
                        // Let the committer finish first, as the real store's lock order does.
                        let at = at_delay(self.now, 1_000);
                        self.schedule(at, Ev::CopyFetched { element, incarnation, session, volume, result: Ok(copy) });
                        return;
                    }
                    Ok(copy) => {
                        self.trace(|| {
                            format!(
                                "element e{element} installs a copy of vol {volume} at sequence {}",
                                copy.history.len()
                            )
                        });
                        self.elements[element].install_copy(self.now, &mut self.rng_disk, volume, copy, &mut out);
                    }
                    Err(reason) => {
                        self.elements[element].copy_failed(self.now, &mut self.rng_disk, volume, reason, &mut out)
                    }
                }
                self.element_outputs(element, out);
            }
            Ev::ElementRestart { element } => {
                if !self.elements[element].alive {
                    self.trace(|| format!("element e{element} restarts"));
                    self.elements[element].restart();
                }
            }
            Ev::HostRestart => {
                if self.host.is_none() {
                    self.start_host();
                }
            }
            Ev::StandbyPoll => self.standby_poll(),
            Ev::KillSuperseded { instance } => self.kill_superseded(instance),
            Ev::HostStopStep { instance } => self.host_stop_step(instance),
            Ev::HealStall { element, dir } => {
                if self.links[element].stalled[dir] && self.now >= self.links[element].stall_until[dir] {
                    self.heal_stall(element, dir);
                }
            }
            Ev::HealSlowLink { element } => {
                if self.now >= self.links[element].slow_until && self.links[element].slow_factor != 1 {
                    self.heal_slow_link(element);
                }
            }
            Ev::HealSlowDisk { element } => self.elements[element].storage.slow_disk_factor = 1,
            Ev::HealDiskFull { element } => self.heal_disk_full(element),
            Ev::NextFault => {
                if self.phase == Phase::Faults {
                    self.inject_fault();
                    let at = at_delay(self.now, (self.rng_fault.exp(self.sc.fault_interval_ms) * 1000.0) as u64 + 1);
                    self.schedule(at, Ev::NextFault);
                }
            }
            Ev::ClientWake { client } => self.client_wake(client),
            Ev::VolumeOp => {
                // The catalog task retries what failed (a read while the volume could not
                // serve, a write that lost its quorum) on its next round.
                self.catalog_step();
                // A shrink's zeroing goes on in every phase (as the shell retries it).
                self.shrink_step();
                if self.phase == Phase::Faults && !self.host_stopping() {
                    self.volume_op();
                } else if self.phase != Phase::Faults {
                    self.abort_drain();
                }
                if matches!(self.phase, Phase::Faults | Phase::Quiet) {
                    let at = at_delay(self.now, (self.rng_ops.exp(1_500.0) * 1000.0) as u64 + 1);
                    self.schedule(at, Ev::VolumeOp);
                }
            }
            Ev::VolumeOpOnce { instance } => {
                if self.host.as_ref().is_some_and(|h| h.instance == instance) && self.phase == Phase::Faults {
                    self.volume_op();
                }
            }
            Ev::ShrinkStep { instance } => {
                if self.host.as_ref().is_some_and(|h| h.instance == instance) {
                    self.shrink_step();
                }
            }
            Ev::CrashTakeover { instance } => {
                if self.host.as_ref().is_some_and(|h| h.instance == instance) && self.phase == Phase::Faults {
                    self.count_fault(FaultKind::HostCrash);
                    self.crash_host();
                    let later_ms = 2 * self.sc.heartbeat_timeout_ms + self.rng_ops.range(3_000, 5_000);
                    self.schedule(at_delay(self.now, us(later_ms)), Ev::HostRestart);
                }
            }
            Ev::CrashMidOp { instance } => {
                let current = self.host.as_ref().is_some_and(|h| h.instance == instance);
                // Also while a superseded (paused) one runs: it may then take the elements
                // back with a catalog older than what this one just wrote.
                if current && self.phase == Phase::Faults {
                    self.trace(|| "FAULT host element crashes in the middle of a volume creation".into());
                    self.count_fault(FaultKind::HostCrash);
                    self.crash_host();
                    let at = at_delay(self.now, us(self.rng_ops.range(50, 2_000)));
                    self.schedule(at, Ev::HostRestart);
                }
            }
            Ev::EndFaultPhase => self.end_fault_phase(),
            Ev::EndQuiet => self.end_quiet(),
            Ev::EndFinal => self.end_final(),
        }
    }

    // ----- network ----------------------------------------------------------------------------

    /// Put a message on a session's channel: serialised behind earlier ones at the link's
    /// bandwidth, delayed by latency and jitter, never overtaking (TCP is in order).
    fn net_send(&mut self, session: u64, wire: Wire) {
        let dir = match wire {
            Wire::ToElement(_) => TO_ELEMENT,
            Wire::ToHost(_) => TO_HOST,
        };
        let element = self.sessions[&session].element;
        let link = &mut self.links[element];
        if link.stalled[dir] {
            link.held[dir].push_back((session, wire));
            return;
        }
        let (serialise_us, latency_us) = self.link_timing(element, wire.bytes());
        let now = self.now;
        let channel = &mut self.sessions.get_mut(&session).expect("checked").channels[dir];
        let departs = Time(now.0.max(channel.busy_until.0) + serialise_us);
        channel.busy_until = departs;
        let arrive = Time((departs.0 + latency_us).max(channel.last_arrival.0));
        channel.last_arrival = arrive;
        if let Wire::ToElement(ToElement::Msg(HostMessage::Apply(r))) = &wire {
            if self.o.ack.get(element) == Some(&starfish_core::AckPolicy::NetworkSync) {
                let instance = self.sessions[&session].instance;
                let (volume, sequence) = (r.volume, r.sequence);
                self.schedule(departs, Ev::Sent { instance, element, session, volume, sequence });
            }
        }
        self.schedule(arrive, Ev::Deliver { session, wire, departs });
    }

    /// Time to put `bytes` on the link to `element` and one-way latency (with jitter), as the
    /// link is now.
    fn link_timing(&mut self, element: usize, bytes: u64) -> (u64, u64) {
        let link = &self.links[element];
        let mut bandwidth = link.bandwidth_bytes_per_s;
        if link.slow_bandwidth_bytes_per_s > 0 {
            bandwidth = if bandwidth == 0 {
                link.slow_bandwidth_bytes_per_s
            } else {
                bandwidth.min(link.slow_bandwidth_bytes_per_s)
            };
        }
        let serialise_us = (bytes * 1_000_000).checked_div(bandwidth).unwrap_or(0);
        let latency_us = link.latency_us * link.slow_factor + self.rng_net.below(link.jitter_us * link.slow_factor + 1);
        (serialise_us, latency_us)
    }

    /// A slow link is fast again: what its sessions still had queued at the sender (not yet
    /// departed) now leaves at the link's normal rate, in the same order, as TCP would send
    /// its backlog; what was already on the wire arrives as scheduled.
    fn heal_slow_link(&mut self, element: usize) {
        self.trace(|| format!("slow link to e{element} heals"));
        self.links[element].slow_factor = 1;
        self.links[element].slow_bandwidth_bytes_per_s = 0;
        let now = self.now;
        let mut events = std::mem::take(&mut self.queue).into_vec();
        // Per (session, direction): where the channel stands after what keeps its timing.
        let mut channels: BTreeMap<(u64, usize), Channel> = BTreeMap::new();
        let mut requeue: Vec<usize> = Vec::new();
        for (i, Reverse(s)) in events.iter().enumerate() {
            let Ev::Deliver { session, wire, departs } = &s.ev else {
                continue;
            };
            if self.sessions.get(session).is_none_or(|n| n.element != element) {
                continue;
            }
            let dir = match wire {
                Wire::ToElement(_) => TO_ELEMENT,
                Wire::ToHost(_) => TO_HOST,
            };
            let c = channels.entry((*session, dir)).or_insert(Channel { busy_until: now, last_arrival: Time(0) });
            if *departs > now {
                requeue.push(i);
            } else {
                c.last_arrival = c.last_arrival.max(s.at);
            }
        }
        requeue.sort_by_key(|&i| (events[i].0.at, events[i].0.id));
        for i in requeue {
            let Ev::Deliver { session, wire, .. } = &events[i].0.ev else { unreachable!("selected above") };
            let (session, bytes) = (*session, wire.bytes());
            let dir = match wire {
                Wire::ToElement(_) => TO_ELEMENT,
                Wire::ToHost(_) => TO_HOST,
            };
            let (serialise_us, latency_us) = self.link_timing(element, bytes);
            let c = channels.get_mut(&(session, dir)).expect("collected above");
            let departs = Time(c.busy_until.0 + serialise_us);
            c.busy_until = departs;
            let arrive = Time((departs.0 + latency_us).max(c.last_arrival.0));
            c.last_arrival = arrive;
            let s = &mut events[i].0;
            s.at = arrive;
            if let Ev::Deliver { departs: d, .. } = &mut s.ev {
                *d = departs;
            }
        }
        for ((session, dir), c) in channels {
            if let Some(n) = self.sessions.get_mut(&session) {
                let channel = &mut n.channels[dir];
                channel.busy_until = c.busy_until.max(now);
                channel.last_arrival = c.last_arrival;
            }
        }
        self.queue = BinaryHeap::from(events);
    }

    fn heal_stall(&mut self, element: usize, dir: usize) {
        self.trace(|| format!("link e{element} direction {dir} heals"));
        self.links[element].stalled[dir] = false;
        let held = std::mem::take(&mut self.links[element].held[dir]);
        for (session, wire) in held {
            self.net_send(session, wire);
        }
    }

    fn deliver(&mut self, session: u64, wire: Wire) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        if s.dead {
            return;
        }
        let element = s.element;
        match wire {
            Wire::ToElement(m) => {
                let el = &self.elements[element];
                if !s.element_open || !el.alive || el.incarnation != s.incarnation || !el.has_session(session) {
                    return;
                }
                match m {
                    ToElement::Close => {
                        self.sessions.get_mut(&session).expect("exists").element_open = false;
                        self.close_element_session(element, session);
                    }
                    ToElement::Msg(message) => {
                        self.trace(|| format!("e{element} <- s{session} {}", brief_host(&message)));
                        let mut out = Vec::new();
                        self.elements[element].handle(self.now, &mut self.rng_disk, session, message, &mut out);
                        self.element_outputs(element, out);
                    }
                }
            }
            Wire::ToHost(m) => {
                if s.host_open {
                    let instance = s.instance;
                    self.with_host(instance, |w| w.deliver_to_host(element, session, m));
                }
            }
        }
    }

    /// A message or the end of a session reaches the host element `self.host`.
    fn deliver_to_host(&mut self, element: usize, session: u64, m: ToHost) {
        match m {
            ToHost::Close(reason) => self.link_ended(element, session, reason),
            ToHost::Msg(message) => {
                let host = self.host.as_mut().expect("routed to a running host element");
                if host.links[element].current != Some(session) {
                    return; // The shell's filter: a late message of another session.
                }
                if matches!(message, ElementMessage::Welcome { .. }) {
                    host.welcomed[element] = true;
                }
                self.trace(|| format!("HE <- e{element} s{session} {}", brief_element(&message)));
                let host = self.host.as_mut().expect("checked");
                host.core.handle_element_message(self.now, ElementId(element as u8), message);
                self.drain();
            }
        }
    }

    fn element_send(&mut self, element: usize, session: u64, message: ElementMessage) {
        if let Some(link) = self.peer_links.get(&session) {
            if self.elements[element].has_session(session) {
                let at = at_delay(self.now, self.peer_delay_us(link.from, link.to));
                self.schedule(at, Ev::PeerReply { link: session, message });
            }
            return;
        }
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        if s.dead || !s.element_open || !self.elements[element].has_session(session) {
            return;
        }
        self.net_send(session, Wire::ToHost(ToHost::Msg(message)));
    }

    fn element_outputs(&mut self, element: usize, out: Vec<Out>) {
        for o in out {
            match o {
                Out::Send { session, message, delay_us } => {
                    if delay_us == 0 {
                        self.element_send(element, session, message);
                    } else {
                        let incarnation = self.elements[element].incarnation;
                        let at = at_delay(self.now, delay_us);
                        self.schedule(at, Ev::ElementSend { element, incarnation, session, message });
                    }
                }
                Out::SyncAfter { delay_us } => {
                    let incarnation = self.elements[element].incarnation;
                    let at = at_delay(self.now, delay_us);
                    self.schedule(at, Ev::SyncDone { element, incarnation });
                }
                Out::Close { session } => {
                    if let Some(link) = self.peer_links.remove(&session) {
                        // The element refused a peer's session: the peer learns it.
                        self.peer_link_ended(link, "the peer closed the session".into());
                        self.close_element_session(element, session);
                        continue;
                    }
                    self.close_element_session(element, session);
                    if let Some(s) = self.sessions.get_mut(&session) {
                        if s.element_open && !s.dead {
                            s.element_open = false;
                            self.net_send(session, Wire::ToHost(ToHost::Close("element closed the connection".into())));
                        }
                    }
                }
                Out::Refused { session, reason, ordering, replayed } => {
                    let live = self.sessions.get(&session).is_some_and(|s| {
                        self.host
                            .as_ref()
                            .is_some_and(|h| h.instance == s.instance && h.links[element].current == Some(session))
                    });
                    if live && ordering {
                        let what = if reason.contains("stale epoch") {
                            "a record of an older epoch than it already holds"
                        } else {
                            "a record out of order"
                        };
                        let how = if replayed {
                            "by the replay recovery the host element ordered on the live session"
                        } else {
                            "on the live session"
                        };
                        self.violation(format!("element e{element} was sent {what} {how}: {reason}"));
                    }
                }
                Out::Copy { session, epoch, host, volume, source } => {
                    // As `copy.rs`: a session to the source with a one-volume hello, then the
                    // volume (taken whole here, see `peer_reply`).
                    let local = &self.elements[element].storage.vols[volume.0 as usize];
                    let spec = VolumeSpec {
                        name: local.name.clone(),
                        size_bytes: local.data.len() as u64,
                        clone_of: None,
                        at_least: false,
                    };
                    let hello = HostMessage::Hello {
                        epoch,
                        host,
                        volumes: vec![spec],
                        admin: String::new(),
                        receipt_acks: false,
                    };
                    self.connect_peer(element, PeerId(0), &source, hello, Some(CopyFetch { session, volume }));
                }
                Out::ConnectPeer { peer, address, hello } => self.connect_peer(element, peer, &address, hello, None),
                Out::SendPeer { peer, message } => {
                    let link = self.peer_links.iter().find(|(_, l)| l.from == element && l.peer == Some(peer));
                    if let Some((&id, link)) = link {
                        let at = at_delay(self.now, self.peer_delay_us(link.from, link.to));
                        self.schedule(at, Ev::PeerDeliver { link: id, message });
                    }
                }
                Out::ClosePeer { peer } => {
                    let link = self.peer_links.iter().find(|(_, l)| l.from == element && l.peer == Some(peer));
                    if let Some((&id, _)) = link {
                        let link = self.peer_links.remove(&id).expect("found");
                        if self.elements[link.to].alive && self.elements[link.to].incarnation == link.to_incarnation {
                            self.close_element_session(link.to, id);
                        }
                    }
                }
                Out::TimerAt { at } => {
                    if self.timers[element].is_none_or(|t| at < t) {
                        self.timers[element] = Some(at);
                        let incarnation = self.elements[element].incarnation;
                        self.schedule(at.max(self.now), Ev::ElementTimer { element, incarnation });
                    }
                }
            }
        }
    }

    /// One-way delay between two elements (each one's link to the network, once).
    fn peer_delay_us(&self, a: usize, b: usize) -> u64 {
        self.links[a].latency_us + self.links[b].latency_us
    }

    /// An element's own session to a peer (a replay's source, or the source of a full
    /// recovery's copy when `copy` is set): opened on the peer as any session, its `Hello`
    /// goes through the peer's core like a host element's.
    fn connect_peer(
        &mut self,
        element: usize,
        peer: PeerId,
        address: &str,
        hello: HostMessage,
        copy: Option<CopyFetch>,
    ) {
        let incarnation = self.elements[element].incarnation;
        let target = self.elements.iter().position(|e| e.name == address);
        let refused = match target {
            None => Some((format!("unknown peer {address}"), 100)),
            Some(p) if p == element => Some((format!("cannot connect to {address}"), 1_000)),
            Some(p) if !self.elements[p].alive => {
                let delay = if self.elements[p].machine_up { 1_000 } else { us(CONNECT_TIMEOUT_MS) };
                Some((format!("cannot connect to {address}"), delay))
            }
            Some(_) => None,
        };
        if let Some((reason, delay_us)) = refused {
            let at = at_delay(self.now, delay_us);
            match copy {
                Some(c) => self.schedule(
                    at,
                    Ev::CopyFetched { element, incarnation, session: c.session, volume: c.volume, result: Err(reason) },
                ),
                None => self.schedule(at, Ev::PeerEnded { element, incarnation, peer, reason }),
            }
            return;
        }
        let to = target.expect("checked");
        let id = self.next_session;
        self.next_session += 1;
        let to_incarnation = self.elements[to].incarnation;
        self.peer_links.insert(
            id,
            PeerLink {
                from: element,
                from_incarnation: incarnation,
                peer: copy.is_none().then_some(peer),
                to,
                to_incarnation,
                copy,
            },
        );
        self.elements[to].open_session(self.now, id, starfish_core::SessionRole::Element);
        self.trace(|| format!("e{element} connects to peer e{to}: session s{id}"));
        let at = at_delay(self.now, self.peer_delay_us(element, to));
        self.schedule(at, Ev::PeerDeliver { link: id, message: hello });
    }

    /// A session with an element's certificate does what only a host element may: either a
    /// hello of a newer epoch, or, at the element's own epoch and as its holder (what
    /// `Observe` tells anyone), writes at the element's next sequences with content nobody
    /// wrote. The element must refuse them by role; if it did not, the checkers see the damage.
    fn rogue_element_session(&mut self, e: usize) {
        let (epoch, holder, _) = self.elements[e].observe(self.now);
        let volumes = self.elements[e].storage.vols.len();
        let specs: Vec<VolumeSpec> = self.elements[e]
            .storage
            .vols
            .iter()
            .map(|v| VolumeSpec {
                name: v.name.clone(),
                size_bytes: v.data.len() as u64,
                clone_of: None,
                at_least: false,
            })
            .collect();
        let v = self.rng_fault.below(volumes as u64) as usize;
        let applied = self.elements[e].storage.vols[v].applied();
        let blocks = specs[v].size_bytes / proto::BLOCK_BYTES;
        let offset_bytes = self.rng_fault.below(blocks) * proto::BLOCK_BYTES;
        self.trace(|| {
            format!("FAULT rogue element session to e{e}: epoch {epoch}+1, then writes after {applied} on vol{v}")
        });
        let newer = HostMessage::Hello {
            epoch: proto::Epoch(epoch.0 + 1),
            host: proto::HostId(u64::MAX - 1),
            volumes: specs.clone(),
            admin: String::new(),
            receipt_acks: false,
        };
        let writes: Vec<HostMessage> = (1..=3)
            .map(|k| {
                HostMessage::Apply(Record {
                    volume: VolumeId(v as u32),
                    epoch,
                    sequence: Sequence(applied.0 + k),
                    op: Op::write(offset_bytes, bytes::Bytes::from(vec![0xee; proto::BLOCK_BYTES as usize])),
                })
            })
            .collect();
        let same =
            HostMessage::Hello { epoch, host: holder, volumes: specs, admin: String::new(), receipt_acks: false };
        let script: Vec<HostMessage> =
            if self.rng_fault.chance(0.5) { vec![newer] } else { std::iter::once(same).chain(writes).collect() };
        {
            let id = self.next_session;
            self.next_session += 1;
            self.elements[e].open_session(self.now, id, starfish_core::SessionRole::Element);
            for message in script {
                if !self.elements[e].has_session(id) {
                    break;
                }
                let mut out = Vec::new();
                self.elements[e].handle(self.now, &mut self.rng_disk, id, message, &mut out);
                self.element_outputs(e, out);
            }
            // The stranger stays connected: a refusal closes the session; without one, what it
            // asked is carried out in its turn.
        }
    }

    fn peer_deliver(&mut self, id: u64, message: HostMessage) {
        let Some(link) = self.peer_links.get(&id) else { return };
        let to = link.to;
        let el = &self.elements[to];
        if !(el.alive && el.incarnation == link.to_incarnation && el.has_session(id)) {
            return;
        }
        self.trace(|| format!("e{to} <- peer s{id} {}", brief_host(&message)));
        let mut out = Vec::new();
        self.elements[to].handle(self.now, &mut self.rng_disk, id, message, &mut out);
        self.element_outputs(to, out);
    }

    fn peer_reply(&mut self, id: u64, message: ElementMessage) {
        let Some(link) = self.peer_links.get(&id) else { return };
        let (from, to) = (link.from, link.to);
        let el = &self.elements[from];
        if !(el.alive && el.incarnation == link.from_incarnation) {
            return;
        }
        self.trace(|| format!("e{from} <- peer s{id} {}", brief_element(&message)));
        if let Some(CopyFetch { session, volume }) = link.copy {
            // The source took the copy's hello (adopting a newer epoch, or refusing as one
            // that follows a newer one): the volume is taken at once, then the link closes.
            let incarnation = link.from_incarnation;
            // The source numbers its volumes its own way: the volume is the one of that name.
            let name = &self.elements[from].storage.vols[volume.0 as usize].name;
            let source = self.elements[to].storage.vols.iter().position(|v| &v.name == name && !v.removed);
            let result = match (message, source) {
                (ElementMessage::Welcome { .. }, Some(vi)) => {
                    // As the copy task: the copy state is on the target's disk once the source
                    // answered, before the first block comes.
                    self.elements[from].storage.begin_copy(volume.0 as usize);
                    self.elements[to].storage.copy_volume(vi, &self.elements[from].storage, volume.0 as usize)
                }
                (ElementMessage::Welcome { .. }, None) => Err(format!("peer holds no volume {name}")),
                (ElementMessage::Refused { reason, .. }, _) => Err(format!("peer refused: {reason}")),
                _ => return,
            };
            self.peer_links.remove(&id);
            self.close_element_session(to, id);
            let bytes =
                result.as_ref().map_or(0, |c| c.allocated.iter().filter(|a| **a).count() as u64 * proto::BLOCK_BYTES);
            let at = at_delay(self.now, self.peer_delay_us(from, to) + bytes / 100);
            self.schedule(at, Ev::CopyFetched { element: from, incarnation, session, volume, result });
            return;
        }
        let peer = link.peer.expect("a replay link has a peer id");
        let mut out = Vec::new();
        self.elements[from].peer_message(self.now, &mut self.rng_disk, peer, message, &mut out);
        self.element_outputs(from, out);
    }

    /// The far side of a peer link is gone: the element that opened it learns it.
    fn peer_link_ended(&mut self, link: PeerLink, reason: String) {
        let at = at_delay(self.now, self.peer_delay_us(link.from, link.to));
        let (element, incarnation) = (link.from, link.from_incarnation);
        match (link.copy, link.peer) {
            (Some(c), _) => self.schedule(
                at,
                Ev::CopyFetched { element, incarnation, session: c.session, volume: c.volume, result: Err(reason) },
            ),
            (None, Some(peer)) => self.schedule(at, Ev::PeerEnded { element, incarnation, peer, reason }),
            (None, None) => unreachable!("a link is a replay's or a copy's"),
        }
    }

    /// Close a session on an element (it may end recoveries that session ordered).
    fn close_element_session(&mut self, element: usize, session: u64) {
        let mut out = Vec::new();
        self.elements[element].close_session(self.now, &mut self.rng_disk, session, &mut out);
        self.element_outputs(element, out);
    }

    // ----- the host element's shell ------------------------------------------------------------

    fn start_host(&mut self) {
        self.instances += 1;
        self.report.host_starts += 1;
        let instance = self.instances;
        // The real host element offers epoch 1 and raises it above what elements follow; an
        // epoch from a clock is modelled here, so that clocks frozen, cloned (two host
        // elements in one millisecond), behind or ahead of the last one are all tried.
        let offer = match self.rng_clock.below(5) {
            0 => 1,
            1 => self.last_offer,
            2 => self.last_offer.saturating_sub(self.rng_clock.range(1, 1_000)).max(1),
            3 => self.last_offer + self.rng_clock.range(1, 1_000_000),
            _ => self.last_offer + 1,
        };
        self.last_offer = offer;
        let epoch = Epoch(offer);
        let mut config = HostConfig::new(
            epoch,
            self.o.quorum,
            self.elements.iter().map(|e| e.name.clone()).collect(),
            self.storage_volumes.clone(),
        );
        if self.o.volume_ops || self.exports.iter().any(|e| e.group.is_some()) {
            // The configured volumes only: the catalog's storage volume is never exported, and
            // the volumes created while running come from the catalog once it is read.
            config.exports = self.exports[..self.sc.volumes].to_vec();
        }
        for v in self.sc.volumes..self.served.len() {
            self.served[v] = false;
        }
        config.write_queue_bytes = self.sc.write_queue_bytes;
        config.read_cache_bytes = self.sc.read_cache_bytes;
        config.heartbeat_interval_ms = self.sc.heartbeat_interval_ms;
        config.heartbeat_timeout_ms = self.sc.heartbeat_timeout_ms;
        config.throttle_timeout_ms = self.sc.throttle_timeout_ms;
        config.startup_grace_ms = self.sc.startup_grace_ms;
        config.startup_timeout_ms = config.startup_timeout_ms.max(config.startup_grace_ms);
        config.host_id = proto::HostId(instance as u64);
        config.raise_epoch = self.o.broken != Broken::ClockEpochs;
        config.read_lease = self.o.broken != Broken::NoReadLease;
        config.read_window = self.o.broken != Broken::UnboundedReads;
        config.scrub_repair = self.o.broken != Broken::NoScrubRepair;
        config.flush_waits_for_durable = self.o.broken != Broken::FlushBeforeDurable;
        config.begin_records = self.o.broken != Broken::NoBegin;
        config.copy_source_check = self.o.broken != Broken::AnyCopySource;
        if !self.o.ack.is_empty() {
            config.ack_policies = self.o.ack.clone();
        }
        if self.sc.scrub_interval_ms > 0 {
            config.scrub_interval_ms = self.sc.scrub_interval_ms;
            config.scrub_rate_bytes_per_s = 0;
        }
        if self.sc.replay_recovery {
            config.element_addresses = self.elements.iter().map(|e| e.name.clone()).collect();
        }
        self.trace(|| format!("host element starts: instance {instance}, first epoch offered {epoch}"));
        self.recovery_kind.iter_mut().for_each(|k| *k = None);
        let n = self.elements.len();
        self.host = Some(Host {
            instance,
            core: HostCore::new(config, self.now),
            links: vec![HostLink { current: None, running: None, backoff_ms: BACKOFF_MS_MIN, opened: Time(0) }; n],
            welcomed: vec![false; n],
            ready: false,
            next_sequence: vec![0; self.storage_volumes.len()],
            unsequenced: vec![VecDeque::new(); self.storage_volumes.len()],
            last_timeout: None,
            past_deadline_since: None,
            restarted_before_op: None,
            decided_with: None,
            paused_until: None,
            catalog: None,
            catalog_reading: false,
            catalog_writing: false,
            draining: None,
            draining_shrink: None,
            zeroing: None,
            creating: false,
            stopping_until: None,
        });
        for element in 0..n {
            let at = at_delay(self.now, self.rng_net.range(0, 200));
            self.schedule(at, Ev::ConnectStart { instance, element });
        }
        for client in 0..self.clients.len() {
            let at = at_delay(self.now, self.rng_work.range(0, 5_000));
            self.schedule(at, Ev::ClientWake { client });
        }
    }

    /// The standby's round: ask every element it can reach (as `Observe` would), read the key,
    /// and act on the real `StandbyCore`'s decision.
    fn standby_poll(&mut self) {
        let Some(mut standby) = self.standby.take() else { return };
        if self.host.is_some() {
            return; // Started some other way meanwhile.
        }
        let now = self.now;
        for e in 0..self.elements.len() {
            let observation = if self.elements[e].alive && self.reachable(e) {
                let (epoch, holder, owner_absent_ms) = self.elements[e].observe(now);
                Some(Observation { epoch, holder, owner_absent_ms, at: now })
            } else {
                None
            };
            standby.observe(e, observation);
        }
        let key = match self.coordinator_key {
            Some((_, _, Some(lapse))) if lapse <= now => Key::Absent,
            Some((holder, revision, _)) => Key::Held { holder, revision },
            None => Key::Absent,
        };
        let take_over = match standby.decide(now, key) {
            Decision::Wait => false,
            Decision::TakeOver => true,
            Decision::Claim { expected } => {
                let current = match key {
                    Key::Held { revision, .. } => Some(revision),
                    _ => None,
                };
                if expected == current {
                    self.coordinator_revision += 1;
                    self.coordinator_key =
                        Some((proto::HostId(self.instances as u64 + 1), self.coordinator_revision, None));
                    true
                } else {
                    false
                }
            }
        };
        if take_over {
            self.trace(|| "the standby takes over".into());
            self.report.standby_takeovers += 1;
            self.start_host();
        } else {
            self.standby = Some(standby);
            let at = at_delay(self.now, us(100));
            self.schedule(at, Ev::StandbyPoll);
        }
    }

    fn reachable(&self, element: usize) -> bool {
        !self.links[element].stalled[TO_ELEMENT] && !self.links[element].stalled[TO_HOST]
    }

    fn connect_start(&mut self, instance: u32, element: usize) {
        let Some(host) = &self.host else { return };
        if host.instance != instance || host.links[element].running.is_some() {
            return;
        }
        let rtt = 2 * self.links[element].latency_us * self.links[element].slow_factor;
        let delay_us =
            if self.reachable(element) && self.elements[element].machine_up { rtt } else { us(CONNECT_TIMEOUT_MS) };
        let at = at_delay(self.now, delay_us);
        self.schedule(at, Ev::ConnectDone { instance, element });
    }

    fn connect_done(&mut self, instance: u32, element: usize) {
        let Some(host) = &self.host else { return };
        if host.instance != instance || host.links[element].running.is_some() {
            return;
        }
        let el = &self.elements[element];
        let now = self.now;
        if self.reachable(element) && el.alive {
            let session = self.next_session;
            self.next_session += 1;
            self.sessions.insert(
                session,
                NetSession {
                    element,
                    instance,
                    incarnation: el.incarnation,
                    host_open: true,
                    element_open: true,
                    dead: false,
                    channels: [Channel::default(); 2],
                },
            );
            self.elements[element].open_session(now, session, starfish_core::SessionRole::Host);
            self.trace(|| format!("HE connects to e{element}: session s{session}"));
            let host = self.host.as_mut().expect("checked");
            let link = &mut host.links[element];
            link.current = Some(session);
            link.running = Some(session);
            link.opened = now;
            host.welcomed[element] = false;
            host.core.handle_element_connected(now, ElementId(element as u8));
            self.drain();
        } else {
            let reason =
                if self.reachable(element) && el.machine_up { "connection refused" } else { "connection timed out" };
            let host = self.host.as_mut().expect("checked");
            if host.links[element].current.is_none() {
                host.welcomed[element] = false;
                host.core.handle_element_disconnected(now, ElementId(element as u8), reason);
            }
            self.retry_later(element);
            self.drain();
        }
    }

    fn retry_later(&mut self, element: usize) {
        let host = self.host.as_mut().expect("a host retries");
        let instance = host.instance;
        let link = &mut host.links[element];
        let at = Time(self.now.0 + us(link.backoff_ms));
        link.backoff_ms = (link.backoff_ms * 2).min(BACKOFF_MS_MAX);
        self.schedule(at, Ev::ConnectStart { instance, element });
    }

    /// The link task saw its session end (as `run_element_link` reports `Disconnected`).
    fn link_ended(&mut self, element: usize, session: u64, reason: String) {
        let now = self.now;
        self.trace(|| format!("HE link to e{element} ended (s{session}): {reason}"));
        let host = self.host.as_mut().expect("checked by callers");
        let link = &mut host.links[element];
        if link.running != Some(session) {
            return;
        }
        link.running = None;
        if now.micros_since(link.opened) >= us(SESSION_STABLE_MS) {
            link.backoff_ms = BACKOFF_MS_MIN;
        }
        let notify = link.current == Some(session) || link.current.is_none();
        if link.current == Some(session) {
            link.current = None;
        }
        if let Some(s) = self.sessions.get_mut(&session) {
            s.host_open = false;
        }
        if notify {
            host.welcomed[element] = false;
            host.core.handle_element_disconnected(now, ElementId(element as u8), &reason);
        }
        self.retry_later(element);
        self.drain();
    }

    /// Carry out every action the core has queued.
    fn drain(&mut self) {
        loop {
            let Some(host) = self.host.as_mut() else {
                return;
            };
            let Some(action) = host.core.poll_action() else {
                break;
            };
            self.report.digest = splitmix64(self.report.digest ^ action_code(&action));
            match action {
                Action::Send { to, message } => {
                    if let HostMessage::Apply(record) = &message {
                        self.map_sequence(record);
                    }
                    if matches!(message, HostMessage::FetchLog { .. }) {
                        let host = self.host.as_mut().expect("checked");
                        if !host.ready {
                            host.decided_with = Some(host.welcomed.clone());
                        }
                    }
                    let host = self.host.as_ref().expect("checked");
                    let targets: Vec<(usize, u64)> =
                        to.iter().filter_map(|e| host.links[e.0 as usize].current.map(|s| (e.0 as usize, s))).collect();
                    for (element, session) in targets {
                        self.trace(|| format!("HE -> e{element} s{session} {}", brief_host(&message)));
                        self.net_send(session, Wire::ToElement(ToElement::Msg(message.clone())));
                    }
                }
                Action::Disconnect { element } => {
                    let e = element.0 as usize;
                    let host = self.host.as_mut().expect("checked");
                    let instance = host.instance;
                    if let Some(session) = host.links[e].current.take() {
                        self.trace(|| format!("HE closes s{session} to e{e}"));
                        self.sessions.get_mut(&session).expect("a current session exists").host_open = false;
                        self.net_send(session, Wire::ToElement(ToElement::Close));
                        let at = at_delay(self.now, 30);
                        self.schedule(
                            at,
                            Ev::LinkEnded {
                                instance,
                                element: e,
                                session,
                                reason: "closed by the host element".into(),
                            },
                        );
                    }
                }
                Action::Reply { token, reply } => self.on_reply(token, reply),
                Action::Event(event) => self.on_event(event),
            }
        }
        if let Some(host) = &self.host {
            host.core.assert_invariants();
        }
    }

    fn on_event(&mut self, event: Event) {
        self.trace(|| format!("HE event {event:?}"));
        match event {
            Event::Ready { volume, last } => {
                let host = self.host.as_mut().expect("events come from a host");
                host.next_sequence[volume.0 as usize] = last.0 + 1;
                if !host.ready {
                    host.ready = true;
                    self.mark_at_risk();
                    if self.o.volume_ops && !self.in_superseded {
                        self.catalog_step();
                    }
                }
            }
            Event::VolumeCreated { volume } if !self.in_superseded => self.on_volume_created(volume),
            Event::VolumeResized { volume, size_bytes } if !self.in_superseded => {
                self.on_volume_resized(volume, size_bytes)
            }
            Event::VolumeRemoved { volume, everywhere } if !self.in_superseded => {
                self.on_volume_removed(volume, everywhere)
            }
            Event::ElementFailed { element, reason } if !self.in_superseded => {
                self.recovery_kind[element.0 as usize] = None;
                if matches!(reason, Failure::HandshakeTimeout { .. }) {
                    self.report.handshake_timeouts += 1;
                }
                if !reason.is_transient() {
                    self.last_failure[element.0 as usize] = Some(reason);
                }
            }
            Event::RecoveryStarted { kind, element, diverged, .. } => {
                *self.report.recoveries.entry(kind.as_str().to_string()).or_default() += 1;
                if diverged && !self.in_superseded {
                    self.report.diverged_elements_refused += 1;
                }
                if !self.in_superseded {
                    self.recovery_kind[element.0 as usize] = Some(kind.as_str());
                }
            }
            Event::ElementInSync { element } if !self.in_superseded => {
                self.check_joined_history(element.0 as usize);
            }
            Event::EpochRaised { .. } => self.report.epoch_raises += 1,
            Event::ScrubDone { status, .. } => {
                self.report.scrubs_done += 1;
                self.report.scrub_repairs += status.findings.repaired.len() as u64;
            }
            Event::Restarted { .. } => {
                // The core starts over: as a new host element, except that what it
                // acknowledged before is held to the same promise as an earlier one's.
                self.report.host_restarts += 1;
                let first_op = self.model.len() as u64;
                let host = self.host.as_mut().expect("events come from a host");
                host.ready = false;
                host.welcomed.iter_mut().for_each(|w| *w = false);
                host.decided_with = None;
                host.restarted_before_op = Some(first_op);
                // It serves the configured volumes only, and reads the catalog again (as the
                // shell's catalog task does): a host element it took over from may have
                // changed it. Operations under way are abandoned (the catalog decides them).
                let stale = host.catalog.take().map(|log| log.catalog().encode());
                host.catalog_reading = false;
                host.catalog_writing = false;
                host.creating = false;
                host.draining = None;
                host.draining_shrink = None;
                host.zeroing = None;
                for v in self.sc.volumes..self.served.len() {
                    self.served[v] = false;
                }
                for c in &mut self.created {
                    c.resize_intention = None;
                }
                self.grow_host_vectors();
                if let (Broken::StaleCatalog, Some(stale)) = (self.o.broken, stale) {
                    // The broken variant: the catalog it read before stands.
                    self.trace(|| "catalog: the one read before stands (broken variant)".into());
                    self.catalog_read(&stale);
                }
            }
            _ => {}
        }
    }

    /// A host element became ready: every acknowledged write of an earlier host element that
    /// no element it started with holds durably may be lost, within the contract when
    /// Q ≤ N/2 (the host element and every holder failed together). "Started with": welcomed
    /// when it made its start-up decision (when it asked for the roll-forward, if it did).
    fn mark_at_risk(&mut self) {
        let host = self.host.as_mut().expect("called when ready");
        let welcomed = host.decided_with.take().unwrap_or_else(|| host.welcomed.clone());
        let host = self.host.as_ref().expect("called when ready");
        let mut at_risk = Vec::new();
        for (id, op) in self.model.ops() {
            let earlier = op.instance < host.instance || host.restarted_before_op.is_some_and(|first| id < first);
            if !op.kind.write_like() || op.outcome != Outcome::Ok || !earlier || op.at_risk {
                continue;
            }
            let Some((epoch, sequence)) = op.seq else {
                continue;
            };
            let name = &self.export_storage[op.volume];
            let held = (0..self.elements.len())
                .any(|e| welcomed[e] && holds(self.element_vol_named(e, name), epoch, sequence));
            if !held {
                at_risk.push(id);
            }
        }
        self.trace(|| format!("host element ready; {} acknowledged writes at risk", at_risk.len()));
        for id in at_risk {
            self.model.op_mut(id).at_risk = true;
        }
    }

    /// An element the current host element just declared in sync must hold the same history
    /// as every other in-sync element, as far as both reach (the end of the run compares
    /// whole replicas; this says when and how a diverged one got in).
    fn check_joined_history(&mut self, element: usize) {
        let how = match self.recovery_kind[element].take() {
            Some(kind) => format!(" after a {kind} recovery"),
            None => String::new(),
        };
        let host = self.host.as_ref().expect("events come from a host");
        let status = host.core.status(self.now);
        let mut found = None;
        'others: for (other, s) in status.elements.iter().enumerate() {
            if other == element || s.state != "in-sync" {
                continue;
            }
            for v in 0..self.host_volumes() {
                // A removed volume (a placeholder): what the elements still hold of it is
                // going, whatever its history (a copy of it may have been cut short).
                if host.core.config().volumes[v].size_bytes == 0 {
                    continue;
                }
                let (Some(a), Some(b)) = (self.element_vol(element, v), self.element_vol(other, v)) else {
                    continue;
                };
                let (a, b) = (&a.history, &b.history);
                if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
                    found = Some((other, v, i, a[i], b[i]));
                    break 'others;
                }
            }
        }
        if let Some((other, v, i, mine, theirs)) = found {
            self.violation(format!(
                "diverged element in sync: e{element} became in sync{how} holding volume {v} sequence {} of epoch {mine}, where in-sync e{other} holds epoch {theirs}",
                i + 1
            ));
        }
    }

    /// Learn which request a sequence belongs to: the core gives sequences to accepted writes
    /// in submission order, so the first `Apply` of a new sequence belongs to the oldest
    /// write-like request not yet sequenced and not refused.
    fn map_sequence(&mut self, record: &Record) {
        let v = record.volume.0 as usize;
        let catalog = starfish_core::catalog::CATALOG_VOLUME;
        if self.host.as_ref().is_some_and(|h| h.core.config().volumes.get(v).is_some_and(|s| s.name == catalog)) {
            return; // The simulated shell's own writes: no host's request.
        }
        let sv = self.storage_key(v);
        let key = (sv, record.epoch.0, record.sequence.0);
        if self.sequences.contains_key(&key) || self.begins.contains(&key) {
            return;
        }
        let host = self.host.as_mut().expect("sends come from a host");
        if record.epoch != host.core.epoch() {
            let message = format!(
                "the host element sent volume {v} sequence {} of epoch {} that no host element created",
                record.sequence, record.epoch
            );
            return self.violation(message);
        }
        if record.op == Op::Begin {
            // A host element's beginning: right after the history it became ready with
            // (`Event::Ready`), owed to no request.
            if host.next_sequence[v] < record.sequence.0 {
                let message = format!(
                    "the host element began volume {v} at sequence {}, after {} that no request had",
                    record.sequence, host.next_sequence[v]
                );
                return self.violation(message);
            }
            if host.next_sequence[v] == record.sequence.0 {
                host.next_sequence[v] += 1;
            }
            self.begins.insert(key);
            return;
        }
        while host.next_sequence[v] <= record.sequence.0 {
            let id = loop {
                match host.unsequenced[v].pop_front() {
                    // Failed before it was given a sequence.
                    Some(id) if matches!(self.model.op(id).outcome, Outcome::ReadOnly | Outcome::Unavailable) => {
                        continue
                    }
                    other => break other,
                }
            };
            let sequence = host.next_sequence[v];
            host.next_sequence[v] += 1;
            let Some(id) = id else {
                let message = format!("volume {v} sequence {sequence} has no host write");
                return self.violation(message);
            };
            self.sequences.insert((sv, record.epoch.0, sequence), id);
            self.model.op_mut(id).seq = Some((record.epoch, Sequence(sequence)));
        }
        let Some(&id) = self.sequences.get(&key) else {
            return;
        };
        let op = self.model.op(id);
        let (storage, base) = self.place(op.volume);
        let kind = match record.op {
            Op::Write { .. } => OpKind::Write,
            Op::Trim { .. } => OpKind::Trim,
            Op::WriteZeroes { .. } => OpKind::Zero,
            Op::Snapshot { .. } => OpKind::Snapshot,
            Op::SnapshotDelete { .. } => OpKind::SnapshotDelete,
            Op::Begin => {
                let message =
                    format!("volume {v} sequence {} carries a beginning, but request #{id} had it", record.sequence);
                return self.violation(message);
            }
        };
        // A snapshot's record names its snapshot, not a range.
        let same_range = match record.op {
            Op::Snapshot { id: taken } => taken == id,
            Op::SnapshotDelete { .. } => true,
            _ => {
                (base + op.first_sector) * SECTOR_BYTES == record.op.offset_bytes()
                    && op.sectors * SECTOR_BYTES == record.op.length_bytes()
            }
        };
        if op.kind != kind || storage != v || !same_range {
            let message = format!(
                "volume {v} sequence {} carries {:?} but request #{id} is {:?}",
                record.sequence, kind, op.kind
            );
            self.violation(message);
        }
    }

    /// A key for storage volume `v` of the current host element that stays the same across
    /// host elements (which may number storage volumes differently once one was deleted): its
    /// name's hash.
    fn storage_key(&self, v: usize) -> usize {
        match self.host.as_ref().and_then(|h| h.core.config().volumes.get(v)) {
            Some(spec) => {
                let hash = spec
                    .name
                    .bytes()
                    .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
                hash as usize
            }
            None => v,
        }
    }

    /// How many storage volumes the current host element serves.
    fn host_volumes(&self) -> usize {
        self.host.as_ref().map_or(self.storage_volumes.len(), |h| h.core.config().volumes.len())
    }

    /// The storage volume that carries the hosts' volume `v`, and the sector it starts at.
    fn place(&self, v: usize) -> (usize, u64) {
        let export = &self.exports[v];
        (export.volume, export.offset_bytes / SECTOR_BYTES)
    }

    /// Element `e`'s copy of the host element's storage volume `v`, found by name (an element
    /// that was down while a volume was created and deleted numbers the later ones
    /// differently); by number while no host element runs. `None` for a removed volume.
    fn element_vol(&self, e: usize, v: usize) -> Option<&starfish_core::mem_storage::Volume> {
        match self.host.as_ref().and_then(|h| h.core.config().volumes.get(v)) {
            Some(spec) => self.element_vol_named(e, &spec.name),
            None => self.elements[e].storage.vols.get(v).filter(|x| !x.removed),
        }
    }

    /// Element `e`'s copy of storage volume `name` (`None` if removed or never created).
    fn element_vol_named(&self, e: usize, name: &str) -> Option<&starfish_core::mem_storage::Volume> {
        self.elements[e].storage.vols.iter().find(|x| x.name == name && !x.removed)
    }

    /// How many elements hold sequence `sequence` of epoch `epoch` of storage volume `volume`.
    fn holders(&self, volume: usize, epoch: Epoch, sequence: Sequence) -> usize {
        (0..self.elements.len()).filter(|&e| holds(self.element_vol(e, volume), epoch, sequence)).count()
    }

    /// `holders` of the storage volume named `name`.
    fn holders_named(&self, name: &str, epoch: Epoch, sequence: Sequence) -> usize {
        (0..self.elements.len()).filter(|&e| holds(self.element_vol_named(e, name), epoch, sequence)).count()
    }

    fn on_reply(&mut self, token: Token, reply: Reply) {
        let id = token.0;
        if id >= INTERNAL_TOKENS {
            return self.on_internal_reply(id, reply);
        }
        if self.model.op(id).outcome != Outcome::Pending {
            return self.violation(format!("request #{id} answered twice"));
        }
        let zeroing = self.host.as_ref().and_then(|h| h.zeroing.as_ref().map(|z| (h.instance, z)));
        if let Some((instance, _)) = zeroing.filter(|(_, z)| z.zero == Some(id) || z.flush == Some(id)) {
            // The shrink under way goes on once this answer is in the model.
            self.schedule(at_delay(self.now, 1), Ev::ShrinkStep { instance });
        }
        let op = self.model.op(id).clone();
        let outcome = |result: Result<(), &HostError>| match result {
            Ok(()) => Outcome::Ok,
            Err(HostError::ReadOnly) => Outcome::ReadOnly,
            Err(HostError::QuorumLost) => Outcome::QuorumLost,
            Err(HostError::Unavailable) => Outcome::Unavailable,
        };
        let result = match &reply {
            Reply::Done(r) => outcome(r.as_ref().map(|_| ())),
            Reply::Read(r) => outcome(r.as_ref().map(|_| ())),
            Reply::BlockStatus(r) => outcome(r.as_ref().map(|_| ())),
            Reply::Checked(_) => return self.violation(format!("request #{id} answered as a volume check")),
        };
        self.trace(|| format!("reply #{id} {:?} {:?}", op.kind, result));
        let mut group_ack = None;
        match (op.kind, &reply) {
            (OpKind::Read, Reply::Read(Ok(data))) if self.holds_diverged_sector(data) => {
                self.judge_diverged_read(id, &op, data)
            }
            (OpKind::Read, Reply::Read(Ok(data))) => self.model.check_read(id, data),
            (OpKind::SnapshotRead, Reply::Read(Ok(data))) => {
                let snapshot = self.snapshot_reads[&id];
                self.model.check_snapshot_read(id, snapshot, data);
            }
            (OpKind::Snapshot, Reply::Done(Ok(()))) => {
                if op.seq.is_none() {
                    self.violation(format!("snapshot #{id} acknowledged but never sent to an element"));
                }
                for s in self.snapshots.iter_mut().filter(|s| s.id == id) {
                    s.acked = true;
                }
                self.report.snapshots_taken += 1;
            }
            (OpKind::SnapshotDelete, Reply::Done(Ok(()))) => self.report.snapshots_deleted += 1,
            (OpKind::BlockStatus, Reply::BlockStatus(Ok(extents))) => self.model.check_block_status(id, extents),
            (OpKind::Flush, Reply::Done(Ok(()))) => {
                self.model.check_flush(id);
                // Every write answered before the flush was sent must now be durable on Q
                // elements, whatever their ack policies: its loss is a violation from here.
                // A flush covers its storage volume: a consistency group's, all its members.
                let storage = self.place(op.volume).0;
                let covered: Vec<u64> = self
                    .weak_acked
                    .iter()
                    .filter(|(w, (volume, _, _))| {
                        let write = self.model.op(**w);
                        // The same host element: a flush answers for what it acknowledged.
                        *volume == storage && write.instance == op.instance && write.reply_step < op.submit_step
                    })
                    .map(|(w, _)| *w)
                    .collect();
                self.weak_flushed.extend(covered);
            }
            (OpKind::Write | OpKind::Trim | OpKind::Zero, Reply::Done(Ok(()))) => match op.seq {
                None => self.violation(format!("write #{id} acknowledged but never sent to an element")),
                Some((epoch, sequence)) => {
                    let owner = *self.ack_owner.entry(epoch.0).or_insert(op.instance);
                    if owner != op.instance {
                        self.violation(format!(
                            "write #{id} acknowledged in epoch {epoch} by host element {}, which host element {owner} acknowledged writes in too",
                            op.instance
                        ));
                    }
                    if self.in_superseded {
                        // Acknowledged by a host element after a newer one started: with
                        // Q ≤ N/2 the two can hold disjoint quorums, and only then may it be
                        // lost (fencing protects it when Q > N/2).
                        self.model.op_mut(id).at_risk = true;
                    }
                    let storage = self.place(op.volume).0;
                    if self.group_storage.contains(&storage) {
                        group_ack = Some((storage, epoch, sequence));
                    }
                    // By its storage volume's name: a superseded host element (answering now)
                    // may number its storage volumes unlike the host element that runs.
                    let holders = self.holders_named(&self.export_storage[op.volume], epoch, sequence);
                    // A superseded host element may answer late, for a volume deleted since
                    // (its elements applied the write, then removed the volume): nothing is
                    // left to hold it, and nothing may be read of it any more.
                    let deleted = self.created.iter().any(|c| c.volume == op.volume && c.delete_intention.is_some());
                    if holders < self.o.quorum && deleted {
                        self.trace(|| format!("write #{id} acknowledged for volume {} deleted since", op.volume));
                    } else if holders < self.o.quorum && self.weak_policies() {
                        // Counted on receipts or sends: kept only while those elements keep it
                        // until they store it (the weaker promise; see `check_replicas`).
                        self.weak_acked.insert(id, (storage, epoch, sequence));
                    } else if holders < self.o.quorum {
                        self.violation(format!(
                            "write #{id} (volume {} sequence {sequence}) acknowledged while {holders} element(s) hold it durably, fewer than Q={}",
                            op.volume, self.o.quorum
                        ));
                    }
                }
            },
            (_, Reply::Done(_) | Reply::Read(Err(_)) | Reply::BlockStatus(Err(_))) => {}
            (kind, reply) => {
                self.violation(format!("request #{id} ({kind:?}) got a reply of the wrong kind: {reply:?}"))
            }
        }
        self.model.resolve(id, result);
        if let Some((storage, epoch, sequence)) = group_ack {
            let step = self.model.op(id).reply_step;
            let acks = self.group_acks.entry((storage, epoch.0)).or_default();
            let highest = acks.last().map_or(0, |&(_, s)| s).max(sequence.0);
            acks.push((step, highest));
        }
        if let Some(client) = self.clients.iter().position(|c| *c == Some(id)) {
            self.clients[client] = None;
            let think_us = if self.rng_work.chance(0.02) {
                self.rng_work.range(50_000, 300_000)
            } else {
                self.rng_work.exp(1_500.0) as u64
            };
            let at = at_delay(self.now, think_us);
            self.schedule(at, Ev::ClientWake { client });
        }
    }

    // ----- hosts (the workload) ------------------------------------------------------------------

    fn client_wake(&mut self, client: usize) {
        if self.phase != Phase::Faults || self.clients[client].is_some() {
            return;
        }
        let Some(instance) = self.serving_instance(client) else {
            return;
        };
        let current = self.host.as_ref().is_some_and(|h| h.instance == instance);
        if current && self.host_stopping() {
            // A stopping host element reads no new request: the client waits for the next one.
            let at = at_delay(self.now, 5_000);
            return self.schedule(at, Ev::ClientWake { client });
        }
        if self.o.volume_ops && current && self.host.as_ref().is_some_and(|h| h.catalog.is_none()) {
            // The shell serves NBD once the catalog is read (the volumes it names with the
            // configured ones): the client waits in the listen queue.
            let at = at_delay(self.now, 5_000);
            return self.schedule(at, Ev::ClientWake { client });
        }
        let volume = if self.o.volume_ops {
            // A superseded host element serves the configured volumes only here.
            let served: Vec<usize> =
                (0..self.served.len()).filter(|&v| self.served[v] && (current || v < self.sc.volumes)).collect();
            served[self.rng_work.below(served.len() as u64) as usize]
        } else {
            self.rng_work.below(self.sc.volumes as u64) as usize
        };
        if self.o.snapshots && volume < self.sc.volumes && self.rng_work.chance(0.08) {
            return self.snapshot_request(instance, volume, client);
        }
        if let Some(k) = self.created.iter().find(|c| c.volume == volume).and_then(|c| c.clone_of) {
            // A clone is only read, as its snapshot: it must read exactly as the snapshot does.
            let parent = self.snapshots[k].volume;
            let (first, sectors) = self.pick_range(OpKind::Read, parent);
            return self.with_host(instance, |w| {
                w.submit_clone_read(volume, k, first, sectors, Some(client));
            });
        }
        let kind = match self.rng_work.below(100) {
            0..=41 => OpKind::Write,
            42..=46 => OpKind::Trim,
            47..=51 => OpKind::Zero,
            52..=83 => OpKind::Read,
            84..=91 => OpKind::Flush,
            _ => OpKind::BlockStatus,
        };
        let (first, sectors) = self.pick_range(kind, volume);
        self.with_host(instance, |w| {
            w.submit(kind, volume, first, sectors, Some(client));
        });
    }

    fn pick_range(&mut self, kind: OpKind, volume: usize) -> (u64, u64) {
        let total = self.volume_sectors[volume];
        let r = &mut self.rng_work;
        let span = if r.chance(0.5) { total.min(256) } else { total };
        let mut count = match kind {
            OpKind::Flush => return (0, 0),
            OpKind::Write | OpKind::Trim | OpKind::Zero => {
                if r.chance(self.sc.big_write_share) {
                    r.range(256, 2048)
                } else if r.chance(0.25) {
                    r.range(16, 128)
                } else {
                    r.range(1, 16)
                }
            }
            OpKind::Read => {
                if r.chance(0.05) {
                    r.range(128, 1024)
                } else {
                    r.range(1, 128)
                }
            }
            OpKind::BlockStatus => r.range(8, 1024),
            OpKind::Snapshot | OpKind::SnapshotDelete | OpKind::SnapshotRead => {
                unreachable!("snapshot requests are drawn by snapshot_request")
            }
        };
        let span = if count > span { total } else { span };
        count = count.min(total);
        let mut first = r.below(span - count + 1);
        if r.chance(0.3) {
            first = first / 8 * 8;
            count = (count.div_ceil(8) * 8).min(total - first);
        }
        (first, count)
    }

    /// Hand a request to the core; `client` waits for its reply (which may come at once).
    fn submit(&mut self, kind: OpKind, volume: usize, first: u64, sectors: u64, client: Option<usize>) -> u64 {
        let now = self.now;
        let host = self.host.as_mut().expect("requests need a host element");
        let instance = host.instance;
        let id = self.model.submit(kind, volume, first, sectors, instance);
        if let Some(c) = client {
            self.clients[c] = Some(id);
        }
        self.trace(|| format!("request #{id} {kind:?} volume {volume} sectors {first}+{sectors}"));
        // As the shell's `HostBackend`: the hosts' volume is a window of a storage volume.
        let (storage, base) = self.place(volume);
        let host = self.host.as_mut().expect("checked");
        let token = Token(id);
        let vid = VolumeId(storage as u32);
        let offset_bytes = (base + first) * SECTOR_BYTES;
        let length_bytes = sectors * SECTOR_BYTES;
        match kind {
            OpKind::Write => {
                let mut data = vec![0u8; length_bytes as usize];
                for (i, chunk) in data.chunks_exact_mut(SECTOR_BYTES as usize).enumerate() {
                    fill_sector(chunk, id, volume as u32, first + i as u64);
                }
                host.unsequenced[storage].push_back(id);
                host.core.handle_host_write(now, token, vid, Op::write(offset_bytes, Bytes::from(data)));
            }
            OpKind::Trim => {
                host.unsequenced[storage].push_back(id);
                host.core.handle_host_write(now, token, vid, Op::Trim { offset_bytes, length_bytes });
            }
            OpKind::Zero => {
                host.unsequenced[storage].push_back(id);
                host.core.handle_host_write(now, token, vid, Op::WriteZeroes { offset_bytes, length_bytes });
            }
            OpKind::Read => host.core.handle_host_read(now, token, vid, offset_bytes, length_bytes as u32),
            OpKind::Flush => host.core.handle_host_flush(now, token, vid),
            OpKind::BlockStatus => host.core.handle_host_block_status(now, token, vid, offset_bytes, length_bytes),
            OpKind::Snapshot | OpKind::SnapshotDelete | OpKind::SnapshotRead => {
                unreachable!("snapshot requests go through submit_snapshot")
            }
        }
        self.drain();
        id
    }

    /// A host's snapshot request on `volume` (`--snapshots`): take one (at most four readable
    /// per volume), delete the oldest, or read a range of one.
    fn snapshot_request(&mut self, instance: u32, volume: usize, client: usize) {
        let readable: Vec<usize> = (0..self.snapshots.len())
            .filter(|&k| self.snapshots[k].volume == volume && self.snapshots[k].acked && !self.snapshots[k].deleting)
            .collect();
        // As the catalog refuses it: a snapshot with clones is not deleted.
        let cloned = |k: usize| self.snapshots[k].cloned;
        let r = self.rng_work.below(100);
        let (kind, target) = match readable.first() {
            None => (OpKind::Snapshot, None),
            Some(_) if r < 20 && readable.len() < 4 => (OpKind::Snapshot, None),
            Some(&oldest) if (r < 30 || readable.len() >= 4 && r < 40) && !cloned(oldest) => {
                (OpKind::SnapshotDelete, Some(oldest))
            }
            Some(_) => (OpKind::SnapshotRead, Some(readable[self.rng_work.below(readable.len() as u64) as usize])),
        };
        let (first, sectors) = match kind {
            OpKind::SnapshotRead => self.pick_range(OpKind::Read, volume),
            _ => (0, 0),
        };
        self.with_host(instance, |w| {
            w.submit_snapshot(kind, volume, first, sectors, target, client);
        });
    }

    /// A read of clone `volume` of snapshot `k`: to the model a read of the snapshot (of its
    /// volume's sectors), to the core an ordinary read of the clone's storage volume.
    fn submit_clone_read(&mut self, volume: usize, k: usize, first: u64, sectors: u64, client: Option<usize>) -> u64 {
        let now = self.now;
        let instance = self.host.as_ref().expect("requests need a host element").instance;
        let (of, parent) = (self.snapshots[k].id, self.snapshots[k].volume);
        let id = self.model.submit(OpKind::SnapshotRead, parent, first, sectors, instance);
        if let Some(c) = client {
            self.clients[c] = Some(id);
        }
        self.report.clone_reads += 1;
        self.trace(|| {
            format!("request #{id} read of clone volume {volume} (snapshot #{of}) sectors {first}+{sectors}")
        });
        self.snapshot_reads.insert(id, of);
        let (storage, base) = self.place(volume);
        let (offset_bytes, length_bytes) = ((base + first) * SECTOR_BYTES, (sectors * SECTOR_BYTES) as u32);
        let host = self.host.as_mut().expect("checked");
        host.core.handle_host_read(now, Token(id), VolumeId(storage as u32), offset_bytes, length_bytes);
        self.drain();
        id
    }

    /// Hand a snapshot request to the core, as the shell's catalog task and NBD server do: a
    /// snapshot's record (or its deletion's) as a write of the storage volume, a snapshot read
    /// naming the snapshot and the sequence of its record.
    fn submit_snapshot(
        &mut self,
        kind: OpKind,
        volume: usize,
        first: u64,
        sectors: u64,
        target: Option<usize>,
        client: usize,
    ) {
        let now = self.now;
        let instance = self.host.as_ref().expect("requests need a host element").instance;
        let id = self.model.submit(kind, volume, first, sectors, instance);
        self.clients[client] = Some(id);
        self.trace(|| format!("request #{id} {kind:?} volume {volume} sectors {first}+{sectors} of {target:?}"));
        let (storage, base) = self.place(volume);
        let (token, vid) = (Token(id), VolumeId(storage as u32));
        match kind {
            OpKind::Snapshot => {
                self.snapshots.push(SimSnapshot { id, volume, acked: false, deleting: false, cloned: false });
                let host = self.host.as_mut().expect("checked");
                host.unsequenced[storage].push_back(id);
                host.core.handle_host_write(now, token, vid, Op::Snapshot { id });
            }
            OpKind::SnapshotDelete => {
                let snapshot = &mut self.snapshots[target.expect("a snapshot to delete")];
                snapshot.deleting = true;
                let of = snapshot.id;
                let host = self.host.as_mut().expect("checked");
                host.unsequenced[storage].push_back(id);
                host.core.handle_host_write(now, token, vid, Op::SnapshotDelete { id: of });
            }
            _ => {
                let of = self.snapshots[target.expect("a snapshot to read")].id;
                let (_, taken_at) = self.model.op(of).seq.expect("an acknowledged snapshot was sequenced");
                self.snapshot_reads.insert(id, of);
                let reference = proto::SnapshotRef { id: of, taken_at };
                let (offset_bytes, length_bytes) = ((base + first) * SECTOR_BYTES, (sectors * SECTOR_BYTES) as u32);
                let host = self.host.as_mut().expect("checked");
                host.core.handle_host_snapshot_read(now, token, vid, reference, offset_bytes, length_bytes);
            }
        }
        self.drain();
    }

    // ----- faults -------------------------------------------------------------------------------

    fn pick_element(&mut self, alive: bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.elements.len()).filter(|&e| self.elements[e].alive == alive).collect();
        if candidates.is_empty() {
            return None;
        }
        Some(candidates[self.rng_fault.below(candidates.len() as u64) as usize])
    }

    /// A live element whose newest synced batch every other element holds (see `rot_is_redundant`).
    fn pick_redundant_element(&mut self) -> Option<usize> {
        let candidates: Vec<usize> =
            (0..self.elements.len()).filter(|&e| self.elements[e].alive && self.rot_is_redundant(e)).collect();
        if candidates.is_empty() {
            return None;
        }
        Some(candidates[self.rng_fault.below(candidates.len() as u64) as usize])
    }

    fn crash_element(&mut self, element: usize, kind: CrashKind) {
        self.trace(|| format!("FAULT element e{element} crashes ({kind:?})"));
        self.prune_weak_acked();
        let sessions = self.elements[element].sessions();
        self.elements[element].crash(kind, &mut self.rng_disk);
        self.timers[element] = None;
        // Its sessions to peers end (the peers close their side), and so do the peers'
        // sessions to it (they learn it).
        let links: Vec<u64> =
            self.peer_links.iter().filter(|(_, l)| l.from == element || l.to == element).map(|(id, _)| *id).collect();
        for id in links {
            let link = self.peer_links.remove(&id).expect("listed");
            if link.to == element {
                self.peer_link_ended(link, "peer closed the connection".into());
            } else if self.elements[link.to].alive && self.elements[link.to].incarnation == link.to_incarnation {
                self.close_element_session(link.to, id);
            }
        }
        let sessions: Vec<u64> = sessions.into_iter().filter(|s| self.sessions.contains_key(s)).collect();
        for session in sessions {
            let s = self.sessions.get_mut(&session).expect("an element session is a network session");
            if !s.element_open || s.dead {
                continue;
            }
            s.element_open = false;
            if kind == CrashKind::Kill {
                // The kernel resets the connection after what was already sent.
                self.net_send(session, Wire::ToHost(ToHost::Close("connection reset by peer".into())));
            }
        }
    }

    fn crash_host(&mut self) {
        if let Some(host) = &self.host {
            let instance = host.instance;
            self.trace(|| format!("FAULT host element crashes (instance {instance})"));
        }
        self.end_host(false);
    }

    /// The host element's process ends: `clean` (a stop) closes every session after what it
    /// sent; a crash resets half of them, dropping what was not delivered yet.
    fn end_host(&mut self, clean: bool) {
        let Some(host) = self.host.take() else { return };
        let sessions: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.instance == host.instance && s.host_open && !s.dead)
            .map(|(id, _)| *id)
            .collect();
        for session in sessions {
            self.sessions.get_mut(&session).expect("listed").host_open = false;
            if !clean && self.rng_net.chance(0.5) {
                // A reset: data not yet delivered is dropped.
                let s = self.sessions.get_mut(&session).expect("listed");
                s.dead = true;
                s.element_open = false;
                let element = s.element;
                self.close_element_session(element, session);
            } else {
                // The kernel still delivers what the process had sent, then a FIN.
                self.net_send(session, Wire::ToElement(ToElement::Close));
            }
        }
        let pending: Vec<u64> = self
            .model
            .ops()
            .filter(|(_, op)| op.outcome == Outcome::Pending && op.instance == host.instance)
            .map(|(id, _)| id)
            .collect();
        for id in pending {
            self.model.resolve(id, Outcome::NoReply);
        }
        for client in &mut self.clients {
            if client.is_some_and(|id| self.model.op(id).instance == host.instance) {
                *client = None;
            }
        }
        self.final_requests.clear();
    }

    /// `Release` on every open session of the current host element (`Node::stop`, a drain).
    fn send_release(&mut self) {
        let Some(instance) = self.host.as_ref().map(|h| h.instance) else { return };
        let sessions: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.instance == instance && s.host_open && !s.dead)
            .map(|(id, _)| *id)
            .collect();
        for session in sessions {
            self.net_send(session, Wire::ToElement(ToElement::Msg(HostMessage::Release)));
        }
    }

    /// The current host element is stopping cleanly (`host_stop`).
    fn host_stopping(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.stopping_until.is_some())
    }

    /// `host_stop`: the host element stops taking requests, then lets the elements go
    /// (`host_stop_step`). `--broken release-while-serving` lets them go at once and serves on.
    fn begin_host_stop(&mut self) {
        let Some(instance) = self.host.as_ref().map(|h| h.instance) else { return };
        if self.o.broken == Broken::ReleaseWhileServing {
            self.trace(|| format!("FAULT host element {instance} stops: Release sent, and it serves on (broken)"));
            self.send_release();
            self.superseded = self.host.take();
            self.start_host();
            let at = at_delay(self.now, us(self.rng_fault.range(200, 2_000)));
            self.schedule(at, Ev::KillSuperseded { instance });
            return;
        }
        self.trace(|| format!("FAULT host element {instance} stops (SIGTERM): no new requests"));
        let until = at_delay(self.now, us(STOP_WAIT_MS));
        self.host.as_mut().expect("checked").stopping_until = Some(until);
        self.schedule(at_delay(self.now, us(1)), Ev::HostStopStep { instance });
    }

    /// A stopping host element lets the elements go once no request of its clients is under
    /// way (or at its deadline: those left are cut, unanswered), and ends; the next one starts
    /// 0–500 ms later.
    fn host_stop_step(&mut self, instance: u32) {
        let Some(until) = self.host.as_ref().filter(|h| h.instance == instance).and_then(|h| h.stopping_until) else {
            return;
        };
        let under_way = self.model.ops().any(|(_, op)| op.outcome == Outcome::Pending && op.instance == instance);
        if under_way && self.now < until {
            return self.schedule(at_delay(self.now, us(5)), Ev::HostStopStep { instance });
        }
        self.trace(|| format!("host element {instance} lets the elements go (Release) and exits"));
        self.send_release();
        self.end_host(true);
        let at = at_delay(self.now, us(self.rng_fault.range(0, 500)));
        self.schedule(at, Ev::HostRestart);
    }

    /// The superseded host element is killed at last; its hosts turn to the current one.
    fn kill_superseded(&mut self, instance: u32) {
        self.with_host(instance, |w| {
            w.trace(|| "the superseded host element is killed".into());
            w.crash_host();
        });
        if self.superseded.as_ref().is_some_and(|h| h.instance == instance) {
            unreachable!("crash_host took it");
        }
        for client in 0..self.clients.len() {
            if self.clients[client].is_none() {
                let at = at_delay(self.now, self.rng_work.range(0, 5_000));
                self.schedule(at, Ev::ClientWake { client });
            }
        }
    }

    fn stall(&mut self, element: usize, dir: usize, ms: u64) {
        let until = at_delay(self.now, us(ms));
        let link = &mut self.links[element];
        link.stalled[dir] = true;
        link.stall_until[dir] = link.stall_until[dir].max(until);
        self.schedule(until, Ev::HealStall { element, dir });
    }

    fn inject_fault(&mut self) {
        let kind = FaultKind::ALL[self.rng_fault.weighted(&self.sc.fault_weights)];
        let n = self.elements.len();
        let applied = match kind {
            FaultKind::ElementKill | FaultKind::ElementPowerLoss => match self.pick_element(true) {
                Some(e) => {
                    let (crash, down_ms) = if kind == FaultKind::ElementKill {
                        (CrashKind::Kill, self.rng_fault.range(50, 3_000))
                    } else {
                        (CrashKind::PowerLoss, self.rng_fault.range(100, 5_000))
                    };
                    self.crash_element(e, crash);
                    let at = at_delay(self.now, us(down_ms));
                    self.schedule(at, Ev::ElementRestart { element: e });
                    true
                }
                None => false,
            },
            FaultKind::HostCrash => {
                // With volume operations, the running host element may also crash while a
                // superseded one still runs: that one may then take the elements back
                // (`Event::Restarted`) with a catalog older than what the crashed one wrote.
                if self.host.is_some() && (self.superseded.is_none() || self.o.volume_ops) {
                    self.crash_host();
                    let at = at_delay(self.now, us(self.rng_fault.range(50, 4_000)));
                    self.schedule(at, Ev::HostRestart);
                    true
                } else {
                    false
                }
            }
            FaultKind::Disaster => {
                if self.host.is_some() && self.superseded.is_none() {
                    self.crash_host();
                    let mut alive: Vec<usize> = (0..n).filter(|&e| self.elements[e].alive).collect();
                    alive.sort_by_key(|&e| {
                        Reverse(self.elements[e].storage.vols.iter().map(|v| v.applied().0).sum::<u64>())
                    });
                    let grace = self.sc.startup_grace_ms;
                    for &e in alive.iter().take(self.o.quorum) {
                        let crash = if self.rng_fault.chance(0.5) { CrashKind::Kill } else { CrashKind::PowerLoss };
                        self.crash_element(e, crash);
                        let at = at_delay(self.now, us(grace + self.rng_fault.range(2_000, 6_000)));
                        self.schedule(at, Ev::ElementRestart { element: e });
                    }
                    let at = at_delay(self.now, us(self.rng_fault.range(50, 1_000)));
                    self.schedule(at, Ev::HostRestart);
                    true
                } else {
                    false
                }
            }
            FaultKind::HostCrashStandby => {
                if self.host.is_some() && self.superseded.is_none() && self.standby.is_none() {
                    let instance = self.host.as_ref().expect("checked").instance;
                    self.crash_host();
                    // The dead one's key lapses with its lease (etcd: 2.4–2.5 s).
                    self.coordinator_revision += 1;
                    let lapse = at_delay(self.now, us(2_500));
                    self.coordinator_key =
                        Some((proto::HostId(instance as u64), self.coordinator_revision, Some(lapse)));
                    self.standby = Some(StandbyCore::new(StandbyConfig::new(
                        proto::HostId(self.instances as u64 + 1),
                        n,
                        self.o.quorum,
                        starfish_core::limits::TAKEOVER_AFTER_MS_DEFAULT,
                    )));
                    self.trace(|| "a standby watches the elements".into());
                    let at = at_delay(self.now, us(100));
                    self.schedule(at, Ev::StandbyPoll);
                    true
                } else {
                    false
                }
            }
            FaultKind::RogueElementSession => {
                let alive: Vec<usize> = (0..n).filter(|&e| self.elements[e].alive).collect();
                if alive.is_empty() {
                    false
                } else {
                    let e = alive[self.rng_fault.below(alive.len() as u64) as usize];
                    self.rogue_element_session(e);
                    true
                }
            }
            FaultKind::HostPause => {
                if self.host.is_some() && self.superseded.is_none() {
                    let mut old = self.host.take().expect("checked");
                    let instance = old.instance;
                    let pause_ms = self.rng_fault.range(500, 4_000);
                    let until = at_delay(self.now, us(pause_ms));
                    self.trace(|| {
                        format!("FAULT host element {instance} paused for {pause_ms} ms; a standby takes over")
                    });
                    old.paused_until = Some(until);
                    self.superseded = Some(old);
                    self.start_host();
                    let mut kill_at = at_delay(until, us(self.rng_fault.range(200, 3_000)));
                    if self.o.volume_ops && self.rng_fault.chance(0.5) {
                        // The one that took over changes the catalog and crashes; the paused
                        // one runs again, and once the elements' owner is gone for two
                        // heartbeat timeouts it takes them back (`Event::Restarted`): it must
                        // read the catalog again, not serve the one it read before the pause.
                        let new = self.host.as_ref().expect("started").instance;
                        let op_at = at_delay(self.now, us(self.rng_fault.range(1_000, 1_800)));
                        let crash_at = at_delay(op_at, us(self.rng_fault.range(100, 400)));
                        self.schedule(op_at, Ev::VolumeOpOnce { instance: new });
                        self.schedule(crash_at, Ev::CrashTakeover { instance: new });
                        let gone_ms = 2 * self.sc.heartbeat_timeout_ms + self.rng_fault.range(1_000, 3_000);
                        kill_at = at_delay(until.max(crash_at), us(gone_ms));
                    }
                    self.schedule(kill_at, Ev::KillSuperseded { instance });
                    true
                } else {
                    false
                }
            }
            FaultKind::HostStop => {
                if self.host.is_some() && self.superseded.is_none() && !self.host_stopping() {
                    self.begin_host_stop();
                    true
                } else {
                    false
                }
            }
            FaultKind::HostSuperseded => {
                if self.host.is_some() && self.superseded.is_none() {
                    let old = self.host.take().expect("checked");
                    let instance = old.instance;
                    self.trace(|| format!("FAULT host element {instance} superseded while it still runs"));
                    self.superseded = Some(old);
                    self.start_host();
                    let at = at_delay(self.now, us(self.rng_fault.range(200, 4_000)));
                    self.schedule(at, Ev::KillSuperseded { instance });
                    true
                } else {
                    false
                }
            }
            FaultKind::LinkReset => {
                let e = self.rng_fault.below(n as u64) as usize;
                let sessions: Vec<u64> = self
                    .sessions
                    .iter()
                    .filter(|(_, s)| s.element == e && !s.dead && (s.host_open || s.element_open))
                    .map(|(id, _)| *id)
                    .collect();
                self.trace(|| format!("FAULT link to e{e} reset ({} sessions)", sessions.len()));
                for session in &sessions {
                    let s = self.sessions.get_mut(session).expect("listed");
                    s.dead = true;
                    s.element_open = false;
                    let (instance, host_open) = (s.instance, s.host_open);
                    self.close_element_session(e, *session);
                    if host_open {
                        let at = at_delay(self.now, self.links[e].latency_us);
                        self.schedule(
                            at,
                            Ev::LinkEnded {
                                instance,
                                element: e,
                                session: *session,
                                reason: "connection reset".into(),
                            },
                        );
                    }
                }
                !sessions.is_empty()
            }
            FaultKind::Partition | FaultKind::StallToElement | FaultKind::StallToHost => {
                let e = self.rng_fault.below(n as u64) as usize;
                let ms = self.rng_fault.range(100, 6_000);
                self.trace(|| format!("FAULT {} of e{e} for {ms} ms", kind.name()));
                if kind != FaultKind::StallToHost {
                    self.stall(e, TO_ELEMENT, ms);
                }
                if kind != FaultKind::StallToElement {
                    self.stall(e, TO_HOST, ms);
                }
                true
            }
            FaultKind::SlowLink => {
                let e = self.rng_fault.below(n as u64) as usize;
                let link = &mut self.links[e];
                link.slow_factor = self.rng_fault.range(10, 100);
                link.slow_bandwidth_bytes_per_s = self.rng_fault.range(100_000, 10_000_000);
                link.slow_until = link.slow_until.max(Time(self.now.0 + us(self.rng_fault.range(1_000, 8_000))));
                let until = link.slow_until;
                self.trace(|| format!("FAULT slow link to e{e}"));
                self.schedule(until, Ev::HealSlowLink { element: e });
                true
            }
            FaultKind::SlowDisk => {
                let e = self.rng_fault.below(n as u64) as usize;
                self.elements[e].storage.slow_disk_factor = self.rng_fault.range(10, 100);
                let at = at_delay(self.now, us(self.rng_fault.range(1_000, 5_000)));
                self.trace(|| format!("FAULT slow disk on e{e}"));
                self.schedule(at, Ev::HealSlowDisk { element: e });
                true
            }
            FaultKind::DiskFull => {
                let e = self.rng_fault.below(n as u64) as usize;
                if self.elements[e].storage.disk_full {
                    false
                } else {
                    self.elements[e].storage.disk_full = true;
                    let at = at_delay(self.now, us(self.rng_fault.range(200, 3_000)));
                    self.trace(|| format!("FAULT disk full on e{e}"));
                    self.schedule(at, Ev::HealDiskFull { element: e });
                    true
                }
            }
            FaultKind::CorruptBlock => {
                let e = self.rng_fault.below(n as u64) as usize;
                match self.elements[e].allocated_block(&mut self.rng_fault) {
                    Some(block) => {
                        self.trace(|| format!("FAULT corrupt block {block:?} on e{e}"));
                        self.elements[e].storage.corrupt_blocks.insert(block);
                        true
                    }
                    None => false,
                }
            }
            // Only where the batch's records are held durably by all the others: rot is a
            // partial disk loss, and the checkers' premise (a majority start sees every
            // acknowledged write) holds for failures within the contract.
            FaultKind::RotNewestBatch => match self.pick_redundant_element() {
                Some(e) => {
                    self.crash_element(e, CrashKind::Kill);
                    let lost = self.elements[e].storage.rot_newest_batch();
                    self.trace(|| format!("FAULT e{e}: newest log batch rotted; repaired, {lost} records lost"));
                    let at = at_delay(self.now, us(self.rng_fault.range(500, 3_000)));
                    self.schedule(at, Ev::ElementRestart { element: e });
                    true
                }
                None => false,
            },
            FaultKind::DivergeBlock => {
                let e = self.rng_fault.below(n as u64) as usize;
                match self.elements[e].allocated_block(&mut self.rng_fault) {
                    // Only where every other element holds the block alike (and this one does
                    // too): a majority knows the right content.
                    Some((vi, block)) if self.block_agreed(vi, block) => {
                        self.trace(|| format!("FAULT e{e}: vol{vi} block {block} silently diverges"));
                        self.elements[e].storage.diverge_block(vi, block);
                        self.diverge_faults += 1;
                        true
                    }
                    _ => false,
                }
            }
            FaultKind::CorruptLog => {
                let e = self.rng_fault.below(n as u64) as usize;
                match self.elements[e].logged_record(&mut self.rng_fault) {
                    Some(record) => {
                        self.trace(|| format!("FAULT corrupt replay-log record {record:?} on e{e}"));
                        self.elements[e].storage.corrupt_log.insert(record);
                        true
                    }
                    None => false,
                }
            }
        };
        if applied {
            self.count_fault(kind);
        }
    }

    /// Whether some element's ack policy counts toward the quorum before it stores a write.
    fn weak_policies(&self) -> bool {
        self.o.ack.iter().any(|p| p.counts_toward_quorum() && !p.needs_durable())
    }

    /// Weakly acknowledged writes that Q elements now hold durably are held to the durable
    /// promise from here (checked before each element crash, which is what could lose them).
    fn prune_weak_acked(&mut self) {
        let quorum = self.o.quorum;
        let strong: Vec<u64> = self
            .weak_acked
            .iter()
            .filter(|(_, &(volume, epoch, sequence))| self.holders(volume, epoch, sequence) >= quorum)
            .map(|(id, _)| *id)
            .collect();
        for id in strong {
            self.weak_acked.remove(&id);
        }
    }

    /// Whether every element holds block `block` of volume `vi` alike.
    fn block_agreed(&self, vi: usize, block: u64) -> bool {
        let range = (block * proto::BLOCK_BYTES) as usize..((block + 1) * proto::BLOCK_BYTES) as usize;
        let Some(first) = self.element_vol(0, vi).map(|v| &v.data[range.clone()]) else { return false };
        (0..self.elements.len()).all(|e| self.element_vol(e, vi).is_some_and(|v| v.data[range.clone()] == *first))
    }

    /// Whether a read's data holds a sector a silent divergence wrote (runs that inject it
    /// only: elsewhere such a sector is garbage, for the model to judge).
    fn holds_diverged_sector(&self, data: &[u8]) -> bool {
        self.diverge_faults > 0
            && data.chunks(proto::SECTOR_BYTES as usize).any(|s| s.iter().all(|&b| b == DIVERGED_BYTE))
    }

    /// A read that returned silently diverged content. Before the final probe nothing but a
    /// scrub can tell it from the right content: not judged. The final probe comes after
    /// every element has been in sync for a while, with scrubs every second: a diverged block
    /// still read then is a violation, unless the divergence had spread to a majority of the
    /// elements in sync (a full recovery copied it from the diverged element before any scrub
    /// compared it), which no comparison can undo.
    fn judge_diverged_read(&mut self, id: u64, op: &OpRec, data: &[u8]) {
        if !self.final_requests.contains(&id) {
            self.report.diverged_reads_unjudged += 1;
            return;
        }
        let status = self.host.as_ref().map(|h| h.core.status(self.now));
        let in_sync: Vec<usize> = (0..self.elements.len())
            .filter(|&e| status.as_ref().is_some_and(|s| s.elements[e].state == "in-sync"))
            .collect();
        let sector_bytes = proto::SECTOR_BYTES as usize;
        for (i, content) in data.chunks(sector_bytes).enumerate() {
            if !content.iter().all(|&b| b == DIVERGED_BYTE) {
                continue;
            }
            let sector = op.first_sector as usize + i;
            let (storage, base) = self.place(op.volume);
            let at = base as usize + sector;
            let holders = self.diverged_holders(storage, at, &in_sync);
            let (volume, n) = (op.volume, in_sync.len());
            if self.diverged_without_majority(storage, at, &in_sync) {
                self.report.notes.push(format!(
                    "final read #{id}: vol{volume} sector {sector} diverged on {holders} of {n} in-sync elements: no majority holds the right content (spread by a full recovery, or its peers out of sync)"
                ));
            } else {
                self.violation(format!(
                    "final read #{id} returned silently diverged content at vol{volume} sector {sector}, which {holders} of {n} in-sync elements hold: a scrub should have repaired it"
                ));
                return;
            }
        }
    }

    /// How many of the `in_sync` elements hold sector `sector` of storage volume `vi` silently
    /// diverged.
    fn diverged_holders(&self, vi: usize, sector: usize, in_sync: &[usize]) -> usize {
        let at = sector * proto::SECTOR_BYTES as usize..(sector + 1) * proto::SECTOR_BYTES as usize;
        in_sync
            .iter()
            .filter(|&&e| {
                self.element_vol(e, vi).is_some_and(|v| v.data[at.clone()].iter().all(|&b| b == DIVERGED_BYTE))
            })
            .count()
    }

    /// Whether sector `sector` of volume `vi` silently diverged (in a run that injects it) on
    /// at least half of the `in_sync` elements: no majority of them holds the right content,
    /// so no scrub can repair it (the weaker promise of that fault).
    fn diverged_without_majority(&self, vi: usize, sector: usize, in_sync: &[usize]) -> bool {
        let holders = self.diverged_holders(vi, sector, in_sync);
        self.diverge_faults > 0 && holders > 0 && 2 * holders >= in_sync.len()
    }

    /// Whether every record of element `e`'s newest synced batch is held durably, with the
    /// same epoch, by every other element (and so by at least Q).
    fn rot_is_redundant(&self, e: usize) -> bool {
        let mine = &self.elements[e].storage;
        !mine.last_batch.is_empty()
            && mine.last_batch.iter().all(|&(vi, sequence)| {
                let at = (sequence.0 - 1) as usize;
                let Some(epoch) = mine.vols[vi].history.get(at) else { return true };
                let name = &mine.vols[vi].name;
                let holders = (0..self.elements.len())
                    .filter(|&j| {
                        let theirs = self.elements[j].storage.vols.iter().find(|v| &v.name == name && !v.removed);
                        j != e && theirs.and_then(|v| v.history.get(at)) == Some(epoch)
                    })
                    .count();
                // Every other element, and at least Q: a rot never removes a record's last
                // copies, however many follow (each is a partial disk loss of one element).
                holders >= self.o.quorum && holders + 1 == self.elements.len()
            })
    }

    fn heal_disk_full(&mut self, element: usize) {
        self.elements[element].storage.disk_full = false;
        if self.elements[element].alive && self.elements[element].storage.poisoned {
            // Space is freed: the element reopens its store by itself (the real one drops its
            // store, core and sessions and opens the store again: a restart in all but name).
            self.crash_element(element, CrashKind::Kill);
            let at = at_delay(self.now, us(self.rng_fault.range(100, 1_000)));
            self.schedule(at, Ev::ElementRestart { element });
        }
    }

    // ----- the end: heal, let it converge, judge ------------------------------------------------

    fn end_fault_phase(&mut self) {
        self.trace(|| "end of the fault phase: healing everything".into());
        self.phase = Phase::Quiet;
        if let Some(instance) = self.superseded.as_ref().map(|h| h.instance) {
            self.kill_superseded(instance);
        }
        for e in 0..self.elements.len() {
            if self.elements[e].storage.disk_full || self.elements[e].storage.poisoned {
                self.elements[e].storage.disk_full = false;
                if self.elements[e].alive {
                    self.crash_element(e, CrashKind::Kill);
                }
            }
            if !self.elements[e].alive {
                self.elements[e].restart();
            }
            self.elements[e].storage.slow_disk_factor = 1;
            // Scrubbing replaces corrupt blocks (the model kept their intended bytes).
            self.elements[e].storage.corrupt_blocks.clear();
            self.elements[e].storage.corrupt_log.clear();
            for dir in [TO_ELEMENT, TO_HOST] {
                if self.links[e].stalled[dir] {
                    self.heal_stall(e, dir);
                }
            }
            if self.links[e].slow_factor != 1 || self.links[e].slow_bandwidth_bytes_per_s != 0 {
                self.heal_slow_link(e);
            }
        }
        if self.host.is_none() {
            self.start_host();
        }
        let at = at_delay(self.now, us(QUIET_MS));
        self.schedule(at, Ev::EndQuiet);
    }

    fn end_quiet(&mut self) {
        self.phase = Phase::Final;
        let at = at_delay(self.now, us(FINAL_MS));
        self.schedule(at, Ev::EndFinal);
        let Some(host) = &self.host else { unreachable!("healed") };
        let status = host.core.status(self.now);
        if !status.ready {
            self.violation(format!("liveness: the host element is not ready {QUIET_MS} ms after every fault healed"));
            return;
        }
        let mut in_sync = 0;
        let mut counting_in_sync = 0;
        self.counting_at_quiet = status
            .elements
            .iter()
            .zip(&self.elements)
            .map(|(s, e)| (s.state == "in-sync" && s.ack_policy.counts_toward_quorum(), e.damage_found))
            .collect();
        for (e, s) in status.elements.iter().enumerate() {
            match s.state {
                "in-sync" => {
                    in_sync += 1;
                    counting_in_sync += s.ack_policy.counts_toward_quorum() as usize;
                }
                // Failed for a documented reason, or caught between two rounds of the reconnect loop
                // of an element that keeps failing for one.
                "failed" | "recovering"
                    if s.failure.as_ref().is_some_and(needs_recovery)
                        || (s.failure.as_ref().is_none_or(Failure::is_transient)
                            && self.last_failure[e].as_ref().is_some_and(needs_recovery)) =>
                {
                    self.report.elements_needing_recovery += 1;
                    let reason = match &s.failure {
                        Some(f) if needs_recovery(f) => f.to_string(),
                        _ => self.last_failure[e].as_ref().map(|f| f.to_string()).unwrap_or_default(),
                    };
                    self.report.notes.push(format!("e{e} ended failed: {reason}"));
                }
                // Waiting for a peer to copy a volume from, where none can serve it (no element
                // in sync, none holding the volume on the current history: the core asserts it).
                "recovering" if s.recovery.as_ref().is_some_and(|r| !r.waiting_for_source.is_empty()) => {
                    self.report.elements_needing_recovery += 1;
                    let waiting = &s.recovery.as_ref().expect("checked").waiting_for_source;
                    self.report
                        .notes
                        .push(format!("e{e} ended waiting for a peer to copy {} from", waiting.join(", ")));
                }
                state => self.violation(format!(
                    "liveness: element e{e} is {state} ({}) {QUIET_MS} ms after every fault healed",
                    s.reason.as_deref().unwrap_or("-")
                )),
            }
        }
        self.in_sync_at_quiet = in_sync;
        self.counting_in_sync_at_quiet = counting_in_sync;
        self.report.elements_in_sync_at_end = in_sync as u64;
        // No element holds a created volume that the catalog does not name (an orphan).
        // An element in sync holds no deleted volume; one that is not removes it once back
        // (a placeholder names it).
        if self.o.volume_ops && self.host.as_ref().is_some_and(|h| h.catalog.is_some()) {
            let host = self.host.as_ref().expect("checked");
            let volumes = &host.core.config().volumes;
            let served: Vec<&str> = volumes.iter().filter(|v| v.size_bytes > 0).map(|v| v.name.as_str()).collect();
            let placeholders: Vec<&str> =
                volumes.iter().filter(|v| v.size_bytes == 0).map(|v| v.name.as_str()).collect();
            let status = host.core.status(self.now);
            let mut orphans = Vec::new();
            for (e, element) in self.elements.iter().enumerate() {
                let in_sync = status.elements[e].state == "in-sync";
                for v in element.storage.vols.iter().filter(|v| !v.removed && v.snapshot_of.is_none()) {
                    let pending = placeholders.contains(&v.name.as_str()) && !in_sync;
                    if v.name.contains('#') && !served.contains(&v.name.as_str()) && !pending {
                        orphans.push(format!("e{e} holds {}", v.name));
                    }
                }
            }
            if !orphans.is_empty() {
                self.violation(format!(
                    "orphaned volumes: {} (created on the elements, named by no catalog)",
                    orphans.join(", ")
                ));
            }
        }
        // Probe: a write per volume, then the whole volume read back.
        for v in 0..self.served.len() {
            if !self.served[v] {
                if let Some(c) = self.created.iter().find(|c| c.volume == v && c.acked && c.delete_intention.is_none())
                {
                    let name = c.name.clone();
                    if counting_in_sync >= self.o.quorum {
                        self.violation(format!(
                            "the host element does not serve volume {name}, whose creation was acknowledged"
                        ));
                    } else {
                        // Fewer than Q elements in sync (those left need a recovery the core
                        // documents): the catalog cannot be read, as no volume can.
                        self.report.notes.push(format!("volume {name} not served: the catalog could not be read"));
                    }
                }
                continue;
            }
            let sectors = self.volume_sectors[v];
            if let Some(k) = self.created.iter().find(|c| c.volume == v).and_then(|c| c.clone_of) {
                // A clone reads, whole, as its snapshot.
                let mut at = 0;
                while at < sectors {
                    let count = 256.min(sectors - at);
                    let id = self.submit_clone_read(v, k, at, count, None);
                    self.final_requests.push(id);
                    at += count;
                }
                continue;
            }
            let first = self.rng_work.below(sectors - 8);
            let id = self.submit(OpKind::Write, v, first, 8, None);
            self.final_requests.push(id);
            let mut at = 0;
            while at < sectors {
                let count = 256.min(sectors - at);
                let id = self.submit(OpKind::Read, v, at, count, None);
                self.final_requests.push(id);
                at += count;
            }
        }
    }

    fn end_final(&mut self) {
        self.phase = Phase::Done;
        let quorum = self.o.quorum;
        // A bad block injected during the faults and found only by a final request turns its
        // element a repair: it counts no more (with a local-sync element, one such is enough
        // to leave fewer than Q that count).
        let surfaced = self
            .counting_at_quiet
            .iter()
            .zip(&self.elements)
            .filter(|((counted, found), e)| *counted && e.damage_found > *found)
            .count();
        if surfaced > 0 {
            self.report
                .notes
                .push(format!("{surfaced} element(s) in sync found a bad block during the final requests"));
        }
        let counting_in_sync = self.counting_in_sync_at_quiet - surfaced;
        for id in self.final_requests.clone() {
            let op = self.model.op(id).clone();
            // A read needs the read lease of enough elements to meet any newer host element's
            // start-up set; the in-sync ones give it.
            let lease_minimum = self.host.as_ref().map_or(quorum, |h| h.core.lease_minimum());
            // Writes need Q in-sync elements that count (local-sync ones never do).
            let expected = counting_in_sync >= quorum
                || (op.kind == OpKind::Read && self.in_sync_at_quiet >= lease_minimum.max(1));
            if op.outcome == Outcome::Pending {
                self.violation(format!(
                    "liveness: final request #{id} ({:?}) not answered within {FINAL_MS} ms",
                    op.kind
                ));
            } else if expected && op.outcome != Outcome::Ok {
                self.violation(format!(
                    "liveness: final request #{id} ({:?}) failed with {:?} while {} of Q={quorum} elements are in sync",
                    op.kind, op.outcome, self.in_sync_at_quiet
                ));
            }
        }
        self.check_replicas();
        self.check_snapshot_replicas();
        self.check_only_host_elements_wrote();
        self.model.settle(2 * self.o.quorum <= self.o.elements);
        self.model.settle_snapshots(2 * self.o.quorum <= self.o.elements);
        self.report.snapshot_reads_checked = self.model.snapshot_reads_checked;
    }

    /// Every in-sync element that holds a snapshot acknowledged and not deleted holds the same
    /// copy of it (an element that went through a full recovery holds none: not carried yet),
    /// up to zeroes past the end of the shorter.
    fn check_snapshot_replicas(&mut self) {
        let Some(host) = &self.host else { return };
        let status = host.core.status(self.now);
        let in_sync: Vec<usize> = (0..self.elements.len()).filter(|&e| status.elements[e].state == "in-sync").collect();
        let mut differing = Vec::new();
        for s in self.snapshots.iter().filter(|s| s.acked && !s.deleting) {
            let storage = &self.export_storage[s.volume];
            let copies: Vec<(usize, &[u8])> = in_sync
                .iter()
                .filter_map(|&e| {
                    let vols = &self.elements[e].storage.vols;
                    let parent =
                        vols.iter().position(|v| &v.name == storage && !v.removed && v.snapshot_of.is_none())?;
                    let at = self.elements[e].storage.snapshot_index(parent, s.id)?;
                    Some((e, &vols[at].data[..]))
                })
                .collect();
            // The same content, up to zeroes past the shorter: a group's storage volume that
            // grew (a volume joined it) is snapshotted at the size each element held when it
            // applied the record, and an element that missed the growth (it grows as records
            // need) holds it smaller; what lies past is zeroes everywhere.
            let same = |a: &[u8], b: &[u8]| {
                let common = a.len().min(b.len());
                a[..common] == b[..common] && a[common..].iter().chain(&b[common..]).all(|&x| x == 0)
            };
            if let Some((e, _)) = copies.iter().skip(1).find(|(_, data)| !same(data, copies[0].1)) {
                differing.push(format!(
                    "in-sync elements e{} and e{e} hold different copies of snapshot #{}",
                    copies[0].0, s.id
                ));
            }
        }
        for message in differing {
            self.violation(message);
        }
    }

    /// Only host elements set epochs and write: no element follows an epoch newer than the
    /// host element's, and none holds a block of what a rogue session wrote (0xee throughout:
    /// the workload's self-describing sectors never are).
    fn check_only_host_elements_wrote(&mut self) {
        let Some(host) = &self.host else { return };
        let host_epoch = host.core.status(self.now).epoch;
        for e in 0..self.elements.len() {
            if !self.elements[e].alive {
                continue;
            }
            let (epoch, holder, _) = self.elements[e].observe(self.now);
            if epoch > host_epoch {
                self.violation(format!(
                    "element e{e} follows epoch {epoch} of {holder}, newer than any host element's ({host_epoch})"
                ));
            }
            let rogue = self.elements[e].storage.vols.iter().enumerate().find_map(|(v, vol)| {
                vol.data
                    .chunks(proto::BLOCK_BYTES as usize)
                    .position(|block| block.iter().all(|&b| b == 0xee))
                    .map(|block| (v, block))
            });
            if let Some((v, block)) = rogue {
                self.violation(format!("element e{e} holds at vol{v} block {block} what no host element wrote"));
            }
        }
    }

    /// Consistency groups (SMFS's group mirroring): every element's copy of the group, at every
    /// moment, is what a prefix of one order of the group's writes made of it. Judged on what
    /// the element holds: holding a group write-like whose request was sent after another of
    /// the group was acknowledged, it must hold that one too. (Within one host element's
    /// epoch: an acknowledged write of an earlier epoch that a disaster lost is the
    /// durability checkers' business.) Run whenever an element's group histories change.
    fn check_group_order(&mut self) {
        for e in 0..self.elements.len() {
            let seen: Vec<(usize, Option<Epoch>)> = self
                .group_storage
                .iter()
                .map(|&sv| match self.element_vol(e, sv) {
                    Some(vol) => (vol.history.len(), vol.history.last().copied()),
                    None => (0, None),
                })
                .collect();
            if seen == self.group_checked[e] {
                continue;
            }
            let carriers = self.group_storage.clone();
            for (&sv, &(len, last)) in carriers.iter().zip(&seen) {
                let Some(epoch) = last else { continue };
                // The newest it holds there: sent last, so the one with the most to require.
                let Some(&newest) = self.sequences.get(&(self.storage_key(sv), epoch.0, len as u64)) else { continue };
                let sent = self.model.op(newest).submit_step;
                let mut judged = false;
                for &other in &carriers {
                    let Some(acks) = self.group_acks.get(&(other, epoch.0)) else { continue };
                    let answered = acks.partition_point(|&(step, _)| step < sent);
                    let Some(&(_, needed)) = answered.checked_sub(1).and_then(|i| acks.get(i)) else { continue };
                    judged = true;
                    let history = self.element_vol(e, other).map_or(&[][..], |vol| &vol.history[..]);
                    if history.get((needed - 1) as usize) != Some(&epoch) {
                        let (held, volume) = (history.len(), self.model.op(newest).volume);
                        self.violation(format!(
                            "e{e}'s copy of consistency group g is no prefix of one order: it holds request #{newest} (vol{volume}, storage volume {sv} sequence {len} of epoch {epoch}) but storage volume {other} only through {held}, not sequence {needed} of epoch {epoch}, acknowledged before #{newest} was sent"
                        ));
                    }
                }
                if judged {
                    self.report.group_states_checked += 1;
                }
            }
            self.group_checked[e] = seen;
        }
    }

    // ----- volumes created while running (`--volume-ops`), as the shell's catalog task ----------

    /// A request of the simulated shell itself to the current host element's core.
    fn internal(&mut self, what: Internal, request: impl FnOnce(&mut HostCore, Time, Token)) {
        let token = self.next_internal;
        self.next_internal += 1;
        let now = self.now;
        let host = self.host.as_mut().expect("asked of a host element");
        self.internal.insert(token, (host.instance, what));
        request(&mut host.core, now, Token(token));
    }

    fn catalog_volume(&self) -> VolumeId {
        let host = self.host.as_ref().expect("a host element");
        let at = host.core.config().volumes.iter().position(|v| v.name == starfish_core::catalog::CATALOG_VOLUME);
        VolumeId(at.expect("the catalog is configured") as u32)
    }

    /// The sequence bookkeeping follows the core's volume list when it grows.
    fn grow_host_vectors(&mut self) {
        let host = self.host.as_mut().expect("a host element");
        let n = host.core.config().volumes.len();
        // A volume added while running starts at sequence 1 (a restart's `Ready` says anew).
        host.next_sequence.resize(n, 1);
        host.unsequenced.resize(n, VecDeque::new());
    }

    /// Read the catalog once the host element serves; then write what is due, one write at a
    /// time (a FLUSH after each), and carry out what was logged.
    fn catalog_step(&mut self) {
        let Some(host) = self.host.as_ref() else { return };
        if !host.ready || host.catalog_reading || host.catalog_writing || host.paused_until.is_some() {
            return;
        }
        if host.catalog.is_none() {
            let volume = self.catalog_volume();
            // As the shell: read only once the catalog takes writes (what is read then is
            // durable on Q elements: no later host element finds an older catalog).
            if !host.core.writable(volume) {
                return;
            }
            self.host.as_mut().expect("checked").catalog_reading = true;
            self.trace(|| "catalog: reading".into());
            return self.internal(Internal::CatalogRead, |core, now, token| {
                core.handle_host_read(now, token, volume, 0, CATALOG_BYTES as u32)
            });
        }
        let now = self.now;
        let host = self.host.as_mut().expect("checked");
        let log = host.catalog.as_mut().expect("read");
        let unlogged = log.take_unlogged();
        let write = log.poll_write(now);
        for intention in unlogged {
            self.execute_intention(intention);
        }
        if let Some(write) = write {
            let volume = self.catalog_volume();
            self.host.as_mut().expect("checked").catalog_writing = true;
            let data = Bytes::from(write.document);
            self.internal(Internal::CatalogWrite, |core, now, token| {
                core.handle_host_write(now, token, volume, Op::write(0, data))
            });
        }
    }

    fn on_internal_reply(&mut self, token: u64, reply: Reply) {
        let Some((instance, what)) = self.internal.remove(&token) else {
            return self.violation(format!("internal request {token} answered twice"));
        };
        if self.host.as_ref().is_none_or(|h| h.instance != instance) {
            return; // A host element that is gone or superseded.
        }
        if !matches!(what, Internal::CatalogRead) && self.host.as_ref().is_some_and(|h| h.catalog.is_none()) {
            return; // Asked before a takeover (`Event::Restarted`): the catalog is read again.
        }
        match (what, reply) {
            (Internal::CatalogRead, Reply::Read(Ok(data))) => self.catalog_read(&data),
            (Internal::CatalogRead, reply) => {
                self.trace(|| format!("catalog: read failed: {reply:?}"));
                // Not serving after all (restarted, or read-only and then gone): read again at
                // the next ready.
                self.host.as_mut().expect("checked").catalog_reading = false;
            }
            (Internal::CatalogWrite, Reply::Done(Ok(()))) => {
                let volume = self.catalog_volume();
                self.internal(Internal::CatalogFlush, |core, now, token| core.handle_host_flush(now, token, volume));
            }
            (Internal::CatalogFlush, Reply::Done(Ok(()))) => {
                let host = self.host.as_mut().expect("checked");
                host.catalog_writing = false;
                let log = host.catalog.as_mut().expect("read");
                let logged = log.written();
                let durable = log.take_durable();
                // An operation whose intention's write failed is undone only now (until this
                // write, a new host element might have found it logged and carried it out).
                for (id, done) in durable {
                    let undone =
                        self.created.iter().find(|c| c.delete_intention == Some(id)).map(|c| c.storage.clone());
                    if let (false, Some(storage)) = (done, undone) {
                        self.host.as_mut().expect("checked").creating = false;
                        self.deletion_undone(&storage);
                    }
                }
                for intention in logged {
                    self.execute_intention(intention);
                }
                self.catalog_step();
            }
            (Internal::CatalogWrite | Internal::CatalogFlush, _) => {
                let host = self.host.as_mut().expect("checked");
                host.catalog_writing = false;
                let undone = host.catalog.as_mut().expect("read").write_failed();
                // A creation or resize undone is simply not acknowledged; a deletion undone
                // waits for the write that says so (above). The next write is tried at the
                // next round.
                if undone.iter().any(|i| !i.is_delete()) {
                    host.creating = false;
                }
                for i in undone.iter().filter(|i| i.is_resize()) {
                    if let Some(c) = self.created.iter_mut().find(|c| c.resize_intention == Some(i.id)) {
                        c.resize_intention = None;
                    }
                }
            }
            (Internal::Check { name, clone_of }, Reply::Checked(Ok(()))) => {
                let now = self.now;
                let size = self.sc.volume_bytes;
                // The simulated hosts take snapshots of configured volumes through the core,
                // not the catalog: the clone's intention names the snapshot as the catalog
                // would list it.
                let base = clone_of.map(|k| {
                    let s = &self.snapshots[k];
                    starfish_core::catalog::CatalogSnapshot {
                        id: s.id,
                        volume: format!("vol{}", s.volume),
                        volume_id: starfish_core::catalog::CONFIGURED_VOLUME_ID,
                        name: format!("s{}", s.id),
                        size_bytes: size,
                        taken_at: self.model.op(s.id).seq.map_or(0, |(_, sequence)| sequence.0),
                    }
                });
                let host = self.host.as_mut().expect("checked");
                let log = host.catalog.as_mut().expect("read");
                let intended = match base {
                    None => log.intend_create(now, &name, size),
                    Some(base) => log.intend_clone_of(now, &name, base),
                };
                match intended {
                    Ok(_) => self.catalog_step(),
                    Err(reason) => {
                        host.creating = false;
                        self.violation(format!("creating {name} was refused by the intention log: {reason}"));
                    }
                }
            }
            (Internal::CheckResize { name, size_bytes }, Reply::Checked(Ok(()))) => {
                let now = self.now;
                let host = self.host.as_mut().expect("checked");
                match host.catalog.as_mut().expect("read").intend_resize(now, &name, size_bytes, false) {
                    Ok(intention) => {
                        if let Some(c) = self.created.iter_mut().find(|c| c.name == name && !c.deleting) {
                            c.resize_intention = Some(intention.id);
                        }
                        self.catalog_step();
                    }
                    Err(reason) => {
                        host.creating = false;
                        self.violation(format!("resizing {name} was refused by the intention log: {reason}"));
                    }
                }
            }
            (Internal::CheckJoin { name }, Reply::Checked(Ok(()))) => {
                let now = self.now;
                let size = self.sc.volume_bytes;
                let Some((storage, members_end)) = self.joinable_group() else {
                    self.host.as_mut().expect("checked").creating = false;
                    return;
                };
                let host = self.host.as_mut().expect("checked");
                let log = host.catalog.as_mut().expect("read");
                match log.intend_join(now, &name, size, GROUP, &storage, members_end) {
                    Ok(_) => self.catalog_step(),
                    Err(reason) => {
                        host.creating = false;
                        self.violation(format!("{name} joining the group was refused by the intention log: {reason}"));
                    }
                }
            }
            (Internal::Check { .. } | Internal::CheckResize { .. } | Internal::CheckJoin { .. }, _) => {
                self.host.as_mut().expect("checked").creating = false
            }
        }
    }

    /// The catalog as the starting host element reads it: every creation acknowledged so far
    /// must be in it; the core starts over serving its volumes, and its intentions are
    /// finished (rolled forward).
    fn catalog_read(&mut self, data: &[u8]) {
        let catalog = match Catalog::decode(data) {
            Ok(c) => c,
            Err(reason) => return self.violation(format!("the catalog cannot be read: {reason}")),
        };
        let mut catalog = catalog;
        if self.o.broken == Broken::ForgetResizes {
            // The broken variant: pending resizes are undone, not rolled forward.
            catalog.intentions.retain(|i| !i.is_resize());
        }
        let serve = catalog.volumes_to_serve();
        // A volume shrinks only when asked to: one served (and written) at a size, or whose
        // resize was acknowledged, is served at least that large by every later host element,
        // unless a shrink was asked (then at least at the size asked for). Its storage volume
        // never shrinks.
        let served_volumes = catalog.volumes_served();
        let shrunk: Vec<(String, u64, u64)> = self
            .created
            .iter()
            .filter(|c| c.acked && c.delete_intention.is_none() && !c.deleting)
            .filter_map(|c| {
                let served = served_volumes.iter().find(|v| v.spec().name == c.storage)?.size_bytes;
                let promised = match c.shrink_to {
                    Some(size) => size,
                    None => (self.volume_sectors[c.volume] * SECTOR_BYTES).max(c.resize_acked_bytes),
                };
                (served < promised).then(|| (c.name.clone(), promised, served))
            })
            .collect();
        for (name, promised, served) in shrunk {
            self.violation(format!(
                "volume {name} was served (or its resize acknowledged) at {promised} bytes, and a new host element serves it at {served}: it shrank unasked, and what was written past that end is lost"
            ));
        }
        let stored: Vec<(String, u64, u64)> = served_volumes
            .iter()
            .filter_map(|v| {
                let storage = v.spec().name;
                let c = self.created.iter().find(|c| c.storage == storage)?;
                let held = self.model.sectors(c.volume) * SECTOR_BYTES;
                (v.storage_bytes < held).then(|| (v.name.clone(), held, v.storage_bytes))
            })
            .collect();
        for (name, held, storage_bytes) in stored {
            self.violation(format!(
                "the storage volume of {name} was {held} bytes, and a new host element's catalog says {storage_bytes}: a storage volume never shrinks"
            ));
        }
        let forget = self.o.broken == Broken::ForgetDeletions;
        let mut restart = catalog.volumes_to_restart();
        if forget {
            restart.retain(|(_, spec)| spec.size_bytes > 0);
        }
        let members = catalog.members_to_serve();
        let lost: Vec<(String, u64)> = self
            .created
            .iter()
            .filter(|c| {
                let served = match c.member_of {
                    None => serve.iter().any(|(_, spec)| spec.name == c.storage),
                    Some(_) => members.iter().any(|m| m.name == c.name),
                };
                c.acked && c.delete_intention.is_none() && !served
            })
            .map(|c| (c.name.clone(), c.intention))
            .collect();
        for (name, intention) in lost {
            self.violation(format!(
                "the acknowledged creation of volume {name} (intention {intention}) is lost: the catalog a new host element read does not name it"
            ));
        }
        let back: Vec<String> = self
            .created
            .iter()
            .filter(|c| {
                c.delete_acked
                    && match c.member_of {
                        None => serve.iter().any(|(_, spec)| spec.name == c.storage),
                        Some(_) => members.iter().any(|m| m.name == c.name),
                    }
            })
            .map(|c| c.name.clone())
            .collect();
        for name in back {
            self.violation(format!(
                "volume {name}, whose deletion was acknowledged, is served again by a new host element (read from its catalog)"
            ));
        }
        let policy = if self.o.broken == Broken::NoIntentionLog { LogPolicy::None } else { LogPolicy::Single };
        let now = self.now;
        let host = self.host.as_mut().expect("checked");
        host.catalog_reading = false;
        let mut log = IntentionLog::new(catalog.clone(), policy);
        for intention in &catalog.intentions {
            // A pending shrink is completed once its tail is zeroed again (below).
            if intention.is_create() || (intention.is_resize() && !intention.is_shrink()) || forget {
                log.finish(now, intention.id, true);
            }
        }
        host.catalog = Some(log);
        // Deletions found pending are rolled forward: their volumes are not served.
        let mut leaving = None;
        for intention in catalog.intentions.iter().filter(|i| !i.is_create()) {
            let volume = intention.volume();
            let storage = volume.spec().name;
            let found = self.created.iter().position(|c| match (&c.member_of, &volume.member_of) {
                (Some(_), Some(_)) => c.name == volume.name,
                (None, None) => c.storage == storage,
                _ => false,
            });
            if let Some(ci) = found {
                let c = &mut self.created[ci];
                c.deleting = true;
                c.delete_intention = Some(intention.id);
                let v = c.volume;
                self.served[v] = false;
                if volume.member_of.is_some() && intention.is_delete() {
                    leaving = Some((intention.id, ci));
                }
            }
        }
        let grown = catalog.groups_grown();
        if !restart.is_empty() || !members.is_empty() || !grown.is_empty() {
            let first_op = self.model.len() as u64;
            let host = self.host.as_mut().expect("checked");
            if let Err(reason) =
                host.core.restart_with_volumes(now, restart, &catalog.exports_shrunk(), &members, &grown)
            {
                return self.violation(format!("the host element cannot serve the catalog's volumes: {reason}"));
            }
            // As after `Event::Restarted`: a new start-up, what it acknowledged before held to
            // an earlier host element's promise.
            host.ready = false;
            host.welcomed.iter_mut().for_each(|w| *w = false);
            host.decided_with = None;
            host.restarted_before_op = Some(first_op);
            self.grow_host_vectors();
            let volumes = self.host.as_ref().expect("checked").core.config().volumes.clone();
            for (name, spec) in &serve {
                let storage = volumes.iter().position(|v| v.name == spec.name).expect("served");
                let v = match self.created.iter_mut().find(|c| c.storage == spec.name) {
                    // A deletion asked for and never logged: the volume stays.
                    Some(c) => c.kept(),
                    None => {
                        // Logged by a host element that crashed before executing it.
                        let v = self.add_hosts_volume(storage);
                        let clone_of = self.snapshot_index(spec);
                        self.created
                            .push(Created { clone_of, ..Created::new(name.clone(), spec.name.clone(), v, false, 0) });
                        v
                    }
                };
                self.exports[v].volume = storage;
                self.export_storage[v] = spec.name.clone();
                self.served[v] = true;
                // Served at the catalog's size (a pending resize rolled forward; a storage
                // volume as large as it stores); the workload stays inside what this host
                // element exports (a shrink not asked for was reported above).
                let exported = served_volumes.iter().find(|v| v.spec().name == spec.name).map_or(0, |v| v.size_bytes);
                self.model.grow_volume(v, spec.size_bytes / SECTOR_BYTES);
                self.volume_sectors[v] = exported / SECTOR_BYTES;
                self.exports[v].size_bytes = exported;
            }
            // Volumes that joined the group: windows of its storage volume.
            for m in &members {
                let storage = volumes.iter().position(|v| v.name == m.storage).expect("served");
                let v = match self.created.iter_mut().find(|c| c.member_of.is_some() && c.name == m.name) {
                    // A deletion asked for and never logged: the member stays.
                    Some(c) => c.kept(),
                    None => {
                        // Logged by a host element that crashed before executing it: listed
                        // now, it must be served from now on (as if acknowledged).
                        let v = self.add_hosts_volume(storage);
                        self.created.push(Created {
                            member_of: Some(m.storage.clone()),
                            ..Created::new(m.name.clone(), format!("{}+{}", m.storage, m.name), v, true, 0)
                        });
                        v
                    }
                };
                self.exports[v].volume = storage;
                self.exports[v].offset_bytes = m.offset_bytes;
                self.exports[v].group = Some(GROUP.to_string());
                self.export_storage[v] = m.storage.clone();
                self.served[v] = true;
            }
        }
        // Resizes the crashed host element had under way are finished by this one (or were
        // undone): nothing waits for their answer any more. A shrink found pending is served
        // at its new size; its tail is zeroed again, then it is completed (and acknowledged).
        for c in &mut self.created {
            c.resize_intention = None;
            c.shrink_to = None;
        }
        let forgotten = matches!(self.o.broken, Broken::ForgetDeletions);
        for intention in catalog.intentions.iter().filter(|i| i.is_shrink() && !forgotten) {
            let volume = intention.volume();
            let Some(ci) = self.created.iter().position(|c| c.storage == volume.spec().name) else { continue };
            self.created[ci].resize_intention = Some(intention.id);
            self.created[ci].shrink_to = Some(volume.size_bytes);
            let host = self.host.as_mut().expect("checked");
            host.creating = true;
            host.zeroing = Some(Zeroing {
                intention: intention.id,
                created: ci,
                from_sector: volume.size_bytes / SECTOR_BYTES,
                to_sector: volume.storage_bytes / SECTOR_BYTES,
                zero: None,
                flush: None,
            });
        }
        if let Some((intention, ci)) = leaving {
            // A member's deletion found pending: its window is zeroed again, then completed.
            self.start_leave_zeroing(intention, ci);
        }
        self.trace(|| {
            format!("catalog read: {} volumes, {} intentions", catalog.volumes.len(), catalog.intentions.len())
        });
        self.catalog_step();
    }

    /// A new hosts' volume at storage volume `storage`: the model's index.
    fn add_hosts_volume(&mut self, storage: usize) -> usize {
        let v = self.model.add_volume(self.sectors_per_volume);
        assert_eq!(v, self.exports.len());
        self.volume_sectors.push(self.sectors_per_volume);
        let name = self.host.as_ref().expect("a host element").core.config().volumes[storage].name.clone();
        self.export_storage.push(name);
        self.exports.push(ExportedVolume {
            name: format!("created{v}"),
            group: None,
            volume: storage,
            offset_bytes: 0,
            size_bytes: self.sc.volume_bytes,
            snapshot: None,
        });
        self.served.push(false);
        v
    }

    /// Whether every request of created volume `ci` that the running host element took has
    /// been answered, with that host element serving and its catalog read: a deletion or a
    /// shrink waits for that (as an operator disconnects the clients first).
    fn drained(&self, ci: usize) -> bool {
        let Some(host) = self.host.as_ref() else { return false };
        if !host.ready || host.catalog.is_none() || host.paused_until.is_some() {
            return false;
        }
        let (v, instance) = (self.created[ci].volume, host.instance);
        !self.model.ops().any(|(_, op)| op.volume == v && op.instance == instance && op.outcome == Outcome::Pending)
    }

    /// An operator asks for a volume: checked on the elements, then logged and carried out.
    fn volume_op(&mut self) {
        let Some(host) = self.host.as_ref() else { return };
        if let Some((ci, size_bytes)) = host.draining_shrink {
            if !self.drained(ci) {
                return;
            }
            let v = self.created[ci].volume;
            let name = self.created[ci].name.clone();
            let now = self.now;
            let host = self.host.as_mut().expect("checked");
            host.draining_shrink = None;
            match host.catalog.as_mut().expect("read").intend_resize(now, &name, size_bytes, true) {
                Ok(intention) => {
                    // Its clients may connect again (the export shrinks once it is logged).
                    self.trace(|| format!("volume shrink {name} to {size_bytes}: intention {}", intention.id));
                    self.created[ci].resize_intention = Some(intention.id);
                    self.created[ci].shrink_to = Some(size_bytes);
                    self.served[v] = true;
                    self.catalog_step();
                }
                Err(reason) => {
                    host.creating = false;
                    self.served[v] = true;
                    self.violation(format!("shrinking {name} was refused by the intention log: {reason}"));
                }
            }
            return;
        }
        if let Some(ci) = host.draining {
            if !self.drained(ci) {
                return;
            }
            let v = self.created[ci].volume;
            // Its acknowledged writes are checked against its replicas before they go: the
            // deletion waits until an in-sync element applied everything the host element sent.
            let c = &self.created[ci];
            let storage = c.member_of.clone().unwrap_or_else(|| c.storage.clone());
            let Some(canonical) = self.caught_up_element(&storage) else { return };
            self.account_losses(Some(canonical), Some(v));
            let name = self.created[ci].name.clone();
            let now = self.now;
            let host = self.host.as_mut().expect("checked");
            host.draining = None;
            match host.catalog.as_mut().expect("read").intend_delete(now, &name, false) {
                Ok(intention) => {
                    self.trace(|| format!("volume delete {name}: intention {}", intention.id));
                    self.created[ci].delete_intention = Some(intention.id);
                    self.catalog_step();
                }
                Err(reason) => {
                    host.creating = false;
                    self.violation(format!("deleting {name} was refused by the intention log: {reason}"));
                }
            }
            return;
        }
        if !host.ready || host.catalog.is_none() || host.creating || host.paused_until.is_some() {
            return;
        }
        let total = host.catalog.as_ref().map_or(0, |l| l.catalog().next_id);
        if total >= OPS_MAX {
            return;
        }
        let deletable = self.created.iter().position(|c| c.acked && !c.deleting && self.served[c.volume]);
        if let Some(ci) = deletable {
            if self.created.len() >= CREATED_MAX || self.rng_ops.chance(0.4) {
                let name = self.created[ci].name.clone();
                self.trace(|| format!("volume delete {name}: its clients stop"));
                self.created[ci].deleting = true;
                let v = self.created[ci].volume;
                self.served[v] = false;
                let host = self.host.as_mut().expect("checked");
                host.creating = true;
                host.draining = Some(ci);
                self.maybe_crash_mid_op();
                return;
            }
        }
        let resizable = self.created.iter().position(|c| {
            c.acked
                && !c.deleting
                && c.resize_intention.is_none()
                && c.shrink_to.is_none()
                && c.clone_of.is_none()
                && c.member_of.is_none()
                && self.served[c.volume]
        });
        if let Some(ci) = resizable {
            let now_bytes = self.volume_sectors[self.created[ci].volume] * SECTOR_BYTES;
            let least = (self.sc.volume_bytes / 2 / proto::BLOCK_BYTES).max(1) * proto::BLOCK_BYTES;
            let can_grow = now_bytes < GROW_MAX_FACTOR * self.sc.volume_bytes;
            let resize = self.rng_resize.chance(0.5);
            if resize && now_bytes > least && (!can_grow || self.rng_resize.chance(0.5)) {
                // Shrunk by half its first size, down to half of it: its clients stop first.
                let size_bytes = now_bytes.saturating_sub(least).max(least);
                let name = self.created[ci].name.clone();
                self.trace(|| format!("volume shrink {name} to {size_bytes}: its clients stop"));
                let v = self.created[ci].volume;
                self.served[v] = false;
                let host = self.host.as_mut().expect("checked");
                host.creating = true;
                host.draining_shrink = Some((ci, size_bytes));
                self.maybe_crash_mid_op();
                return;
            }
            if resize && can_grow {
                // Grown by half its first size (a block multiple), up to the largest.
                let now_bytes = self.volume_sectors[self.created[ci].volume] * SECTOR_BYTES;
                let size_bytes = (now_bytes + self.sc.volume_bytes / 2).min(GROW_MAX_FACTOR * self.sc.volume_bytes);
                let (name, storage) = (self.created[ci].name.clone(), self.created[ci].storage.clone());
                let spec = VolumeSpec { name: storage, size_bytes, clone_of: None, at_least: false };
                self.maybe_crash_mid_op();
                self.host.as_mut().expect("checked").creating = true;
                self.trace(|| format!("volume resize {name} to {size_bytes}"));
                self.internal(Internal::CheckResize { name, size_bytes }, |core, now, token| {
                    core.check_volumes(now, token, vec![spec])
                });
                return;
            }
        }
        if self.created.len() >= CREATED_MAX {
            return;
        }
        // With snapshots (not of groups: their storage volume is the group's), some creations
        // are clones of a snapshot acknowledged and not being deleted.
        let clonable: Vec<usize> = if self.o.snapshots && !self.o.groups {
            (0..self.snapshots.len()).filter(|&k| self.snapshots[k].acked && !self.snapshots[k].deleting).collect()
        } else {
            Vec::new()
        };
        let clone_of = match clonable.is_empty() {
            false if self.rng_clone.chance(0.5) => Some(clonable[self.rng_clone.below(clonable.len() as u64) as usize]),
            _ => None,
        };
        if let Some(k) = clone_of {
            self.snapshots[k].cloned = true;
        }
        let name = format!("c{total}");
        // With groups (the group's storage volume one, not split), some creations join it.
        if let (None, Some((storage, members_end))) = (clone_of, self.joinable_group()) {
            if self.rng_clone.chance(0.5) {
                let align = starfish_core::groups::MEMBER_ALIGN_BYTES;
                let size_bytes = members_end.div_ceil(align) * align + self.sc.volume_bytes;
                let spec = VolumeSpec { name: storage, size_bytes, clone_of: None, at_least: true };
                self.maybe_crash_mid_op();
                self.host.as_mut().expect("checked").creating = true;
                self.trace(|| format!("volume create {name} --group {GROUP}"));
                self.internal(Internal::CheckJoin { name }, |core, now, token| {
                    core.check_volumes(now, token, vec![spec])
                });
                return;
            }
        }
        let spec = VolumeSpec {
            name: format!("{name}#check"),
            size_bytes: self.sc.volume_bytes,
            clone_of: None,
            at_least: false,
        };
        self.maybe_crash_mid_op();
        self.host.as_mut().expect("checked").creating = true;
        self.trace(|| format!("volume create {name} (a clone of {clone_of:?})"));
        self.internal(Internal::Check { name, clone_of }, |core, now, token| {
            core.check_volumes(now, token, vec![spec])
        });
    }

    /// Sometimes, crash the host element a little later (0–40 ms: before, during or after
    /// the next step of the creation under way).
    fn maybe_crash_mid_op(&mut self) {
        if self.rng_ops.chance(0.25) {
            let instance = self.host.as_ref().expect("a host element").instance;
            let at = at_delay(self.now, self.rng_ops.range(0, 40_000));
            self.schedule(at, Ev::CrashMidOp { instance });
        }
    }

    fn execute_intention(&mut self, intention: starfish_core::catalog::Intention) {
        if intention.is_create() && intention.volume().member_of.is_some() {
            self.execute_join(intention)
        } else if intention.is_create() {
            self.execute_creation(intention)
        } else if intention.is_resize() {
            self.execute_resize(intention)
        } else {
            self.execute_deletion(intention)
        }
    }

    /// Carry out a logged resize: the core serves the new size at once (the workload writes
    /// into the new blocks from now on).
    fn execute_resize(&mut self, intention: starfish_core::catalog::Intention) {
        self.maybe_crash_mid_op();
        let volume = intention.volume();
        let storage = volume.spec().name;
        let now = self.now;
        let host = self.host.as_mut().expect("a host element");
        match host.core.resize_volume(now, &storage, volume.storage_bytes, volume.size_bytes) {
            Ok(_) => {
                self.trace(|| format!("volume {} resized to {} ({storage})", volume.name, volume.size_bytes));
                if let Some(v) = self.created.iter().find(|c| c.storage == storage).map(|c| c.volume) {
                    if intention.is_shrink() {
                        // Served at its new size: the workload stays inside it from now on.
                        self.volume_sectors[v] = volume.size_bytes / SECTOR_BYTES;
                        self.exports[v].size_bytes = volume.size_bytes;
                        self.served[v] = true;
                    } else {
                        self.grow_served(v, volume.size_bytes);
                    }
                }
            }
            Err(reason) => {
                self.trace(|| format!("volume resize of {} undone: {reason}", volume.name));
                let host = self.host.as_mut().expect("checked");
                host.creating = false;
                host.catalog.as_mut().expect("read").finish(now, intention.id, false);
                if let Some(c) = self.created.iter_mut().find(|c| c.storage == storage) {
                    c.resize_intention = None;
                    c.shrink_to = None;
                    let v = c.volume;
                    self.served[v] = true;
                }
            }
        }
    }

    /// Hosts' volume `v` is served at `size_bytes` (larger than before, or the same).
    fn grow_served(&mut self, v: usize, size_bytes: u64) {
        let sectors = size_bytes / SECTOR_BYTES;
        if sectors > self.volume_sectors[v] {
            self.volume_sectors[v] = sectors;
            self.model.grow_volume(v, sectors);
            self.exports[v].size_bytes = size_bytes;
        }
    }

    /// Q elements hold a resized volume at its new size: the operator is answered; the
    /// completion is written.
    fn on_volume_resized(&mut self, volume: VolumeId, size_bytes: u64) {
        let Some(host) = self.host.as_ref() else { return };
        let storage = host.core.config().volumes[volume.0 as usize].name.clone();
        let stored = host.core.config().volumes[volume.0 as usize].size_bytes;
        // Volumes joining the group whose storage volume Q elements now hold grown.
        let joined: Vec<usize> = (0..self.created.len())
            .filter(|&ci| !self.created[ci].acked && self.created[ci].member_of.as_deref() == Some(storage.as_str()))
            .collect();
        if !joined.is_empty() {
            for ci in joined {
                let c = &mut self.created[ci];
                c.acked = true;
                self.report.volumes_joined += 1;
                let (id, name) = (c.intention, c.name.clone());
                self.trace(|| format!("volume {name} joined the group (acknowledged)"));
                let now = self.now;
                let host = self.host.as_mut().expect("checked");
                host.creating = false;
                if let Some(log) = host.catalog.as_mut() {
                    log.finish(now, id, true);
                }
            }
            self.maybe_crash_mid_op();
            return self.catalog_step();
        }
        let Some(ci) = self.created.iter().position(|c| c.storage == storage) else { return };
        let c = &mut self.created[ci];
        if c.shrink_to.is_some() {
            // A shrink: acknowledged once what lies past the new end is zeroed.
            let Some(intention) = c.resize_intention else { return };
            let host = self.host.as_mut().expect("checked");
            host.zeroing = Some(Zeroing {
                intention,
                created: ci,
                from_sector: size_bytes / SECTOR_BYTES,
                to_sector: stored / SECTOR_BYTES,
                zero: None,
                flush: None,
            });
            return self.shrink_step();
        }
        let Some(id) = c.resize_intention.take() else { return };
        c.resize_acked_bytes = size_bytes;
        self.report.volumes_resized += 1;
        let name = c.name.clone();
        self.trace(|| format!("volume {name} resized to {size_bytes} (acknowledged)"));
        self.maybe_crash_mid_op();
        let now = self.now;
        let host = self.host.as_mut().expect("checked");
        host.creating = false;
        if let Some(log) = host.catalog.as_mut() {
            log.finish(now, id, true);
        }
        self.catalog_step();
    }

    /// The next step of the shrink whose tail is being zeroed: the WRITE_ZEROES, once it is
    /// answered the FLUSH, once that is answered the acknowledgement and the completion. A
    /// step that failed is tried again (at the next round). Before acknowledging, the checker
    /// holds the promise: every sector past the new end reads as zeroes from now on, so the
    /// newest acknowledged write-like request of each is a zeroing.
    fn shrink_step(&mut self) {
        let Some(host) = self.host.as_ref() else { return };
        if !host.ready || host.paused_until.is_some() || self.in_superseded {
            return;
        }
        let Some(z) = host.zeroing.clone() else { return };
        let v = self.created[z.created].volume;
        let outcome = |id: Option<u64>| id.map(|id| self.model.op(id).outcome);
        let (zero, flush) = (outcome(z.zero), outcome(z.flush));
        // Not asked yet, or failed: asked (again).
        let to_ask = |o: Option<Outcome>| o.is_none_or(|o| !matches!(o, Outcome::Ok | Outcome::Pending));
        if to_ask(zero) {
            // The broken variant leaves the tail as it is: a FLUSH stands in for the zeroing.
            let leaving = self.created[z.created].delete_intention == Some(z.intention);
            let broken = if leaving { Broken::LeaveKeepsData } else { Broken::ShrinkKeepsTail };
            let id = if self.o.broken == broken {
                self.submit(OpKind::Flush, v, 0, 0, None)
            } else {
                self.trace(|| {
                    format!("volume shrink: zeroing sectors {}..{} of volume {v}", z.from_sector, z.to_sector)
                });
                self.submit(OpKind::Zero, v, z.from_sector, z.to_sector - z.from_sector, None)
            };
            self.set_zeroing(|z| {
                z.zero = Some(id);
                z.flush = None;
            });
        } else if zero == Some(Outcome::Ok) && to_ask(flush) {
            let id = self.submit(OpKind::Flush, v, 0, 0, None);
            self.set_zeroing(|z| z.flush = Some(id));
        } else if zero == Some(Outcome::Ok) && flush == Some(Outcome::Ok) {
            self.shrink_acknowledged(z);
        }
    }

    /// `f` applied to the zeroing under way, if the host element still has one.
    fn set_zeroing(&mut self, f: impl FnOnce(&mut Zeroing)) {
        if let Some(z) = self.host.as_mut().and_then(|h| h.zeroing.as_mut()) {
            f(z);
        }
    }

    /// A shrink's tail is zeroed and flushed: the operator is answered; the completion is
    /// written.
    fn shrink_acknowledged(&mut self, z: Zeroing) {
        let v = self.created[z.created].volume;
        let leaving = self.created[z.created].delete_intention == Some(z.intention);
        for sector in z.from_sector..z.to_sector {
            if let Some(id) = self.model.newest_acked(v, sector) {
                if self.model.op(id).kind == OpKind::Write {
                    let name = self.created[z.created].name.clone();
                    return self.violation(if leaving {
                        format!(
                            "the deletion of group member {name} was acknowledged while sector {sector} of its window still holds write #{id}: a member that joins there would read it"
                        )
                    } else {
                        format!(
                            "the shrink of volume {name} was acknowledged while sector {sector} past its new end still holds write #{id}: a later grow would expose it"
                        )
                    });
                }
            }
        }
        let c = &mut self.created[z.created];
        let name = c.name.clone();
        if leaving {
            c.delete_acked = true;
            self.report.volumes_deleted += 1;
            self.trace(|| format!("volume {name} left the group (acknowledged)"));
        } else {
            let size_bytes = z.from_sector * SECTOR_BYTES;
            c.resize_intention = None;
            c.shrink_to = None;
            c.resize_acked_bytes = size_bytes;
            self.report.volumes_shrunk += 1;
            self.trace(|| format!("volume {name} shrunk to {size_bytes} (acknowledged)"));
        }
        self.maybe_crash_mid_op();
        let now = self.now;
        let host = self.host.as_mut().expect("checked");
        host.zeroing = None;
        host.creating = false;
        if let Some(log) = host.catalog.as_mut() {
            log.finish(now, z.intention, true);
        }
        self.catalog_step();
    }

    /// The faults are over: a deletion (or shrink) still waiting for its volume's requests is
    /// given up (the volume is served again; nothing was logged).
    fn abort_drain(&mut self) {
        let Some(host) = self.host.as_mut() else { return };
        if let Some((ci, _)) = host.draining_shrink.take() {
            host.creating = false;
            let v = self.created[ci].volume;
            self.served[v] = true;
            return;
        }
        let Some(ci) = host.draining.take() else { return };
        host.creating = false;
        let c = &mut self.created[ci];
        c.deleting = false;
        let v = c.volume;
        self.served[v] = true;
    }

    /// Carry out a logged (or, without the log, unlogged) deletion.
    fn execute_deletion(&mut self, intention: starfish_core::catalog::Intention) {
        self.maybe_crash_mid_op();
        let volume = intention.volume();
        let storage = volume.spec().name;
        let now = self.now;
        let host = self.host.as_mut().expect("a host element");
        if let Some(window) = &volume.member_of {
            // A group's member leaves: its exports go, then its window is zeroed.
            let key = format!("{}+{}", window.storage, volume.name);
            match host.core.leave_group(&volume.name) {
                Ok(_) => {
                    self.trace(|| format!("volume {} left the group", volume.name));
                    if let Some(ci) = self.created.iter().position(|c| c.storage == key) {
                        self.start_leave_zeroing(intention.id, ci);
                    }
                }
                Err(reason) => {
                    self.trace(|| format!("volume deletion of {} undone: {reason}", volume.name));
                    let host = self.host.as_mut().expect("checked");
                    host.creating = false;
                    host.catalog.as_mut().expect("read").finish(now, intention.id, false);
                    self.deletion_undone(&key);
                }
            }
            return;
        }
        match host.core.remove_volumes(now, vec![storage.clone()]) {
            Ok(_) => self.trace(|| format!("volume {} removed ({storage})", volume.name)),
            Err(reason) => {
                self.trace(|| format!("volume deletion of {} undone: {reason}", volume.name));
                let host = self.host.as_mut().expect("checked");
                host.creating = false;
                let log = host.catalog.as_mut().expect("read");
                if log.policy() == LogPolicy::None {
                    log.finish_unlogged(now, volume);
                } else {
                    log.finish(now, intention.id, false);
                }
                self.deletion_undone(&storage);
            }
        }
    }

    /// Zero the whole window of member `ci` that left the group (deletion `intention`), in
    /// its group's stream, then FLUSH (`shrink_step`), then acknowledge the deletion.
    fn start_leave_zeroing(&mut self, intention: u64, ci: usize) {
        let to_sector = self.volume_sectors[self.created[ci].volume];
        let Some(host) = self.host.as_mut() else { return };
        host.creating = true;
        host.zeroing = Some(Zeroing { intention, created: ci, from_sector: 0, to_sector, zero: None, flush: None });
        self.shrink_step();
    }

    /// A deletion was undone: its volume is served again.
    fn deletion_undone(&mut self, storage: &str) {
        if let Some(c) = self.created.iter_mut().find(|c| c.storage == storage) {
            let v = c.kept();
            self.served[v] = true;
        }
    }

    /// Every live element (then every element) removed a deleted volume: the operator is
    /// answered; then the completion is written.
    fn on_volume_removed(&mut self, volume: VolumeId, everywhere: bool) {
        let Some(host) = self.host.as_ref() else { return };
        let storage = host.core.config().volumes[volume.0 as usize].name.clone();
        let Some(c) = self.created.iter_mut().find(|c| c.storage == storage) else { return };
        let Some(id) = c.delete_intention else { return };
        let name = c.name.clone();
        if !c.delete_acked {
            c.delete_acked = true;
            self.report.volumes_deleted += 1;
            self.trace(|| format!("volume {name} deleted (acknowledged)"));
            // The operator is answered: the next operation may start. (Its completion, once
            // every element removed it, may come while a later operation is under way.)
            self.host.as_mut().expect("checked").creating = false;
        }
        if everywhere {
            self.maybe_crash_mid_op();
            let now = self.now;
            let host = self.host.as_mut().expect("checked");
            if let Some(log) = host.catalog.as_mut() {
                log.finish(now, id, true);
            }
            self.catalog_step();
        }
    }

    /// Carry out a logged (or, without the log, unlogged) creation.
    fn execute_creation(&mut self, intention: starfish_core::catalog::Intention) {
        self.maybe_crash_mid_op();
        let volume = intention.volume();
        let spec = volume.spec();
        let now = self.now;
        let host = self.host.as_mut().expect("a host element");
        match host.core.add_volumes(now, vec![(volume.name.clone(), spec.clone())]) {
            Ok(ids) => {
                self.grow_host_vectors();
                if self.in_superseded {
                    // A superseded host element carries out what it logged: its core adds the
                    // volume (no element takes its epoch any more). What is served is the
                    // running host element's to say: it found the intention in the catalog.
                    self.trace(|| format!("volume {} added as {} (superseded)", volume.name, spec.name));
                    return;
                }
                let v = self.add_hosts_volume(ids[0].0 as usize);
                self.served[v] = true;
                let clone_of = self.snapshot_index(&spec);
                self.created.push(Created {
                    clone_of,
                    ..Created::new(volume.name.clone(), spec.name.clone(), v, false, intention.id)
                });
                self.trace(|| format!("volume {} added as {}", volume.name, spec.name));
            }
            Err(reason) => {
                self.trace(|| format!("volume {} undone: {reason}", volume.name));
                let host = self.host.as_mut().expect("checked");
                host.creating = false;
                let log = host.catalog.as_mut().expect("read");
                if log.policy() != LogPolicy::None {
                    log.finish(now, intention.id, false);
                }
            }
        }
    }

    /// The consistency group's storage volume and where its members end now, if a volume may
    /// join it (`--groups --volume-ops`, the group carried as one storage volume).
    fn joinable_group(&self) -> Option<(String, u64)> {
        if !self.o.groups || self.group_storage.len() != 1 {
            return None;
        }
        let host = self.host.as_ref()?;
        let config = host.core.config();
        let storage = config.volumes.get(self.group_storage[0])?.name.clone();
        let exports = config.exported();
        let members = exports.iter().filter(|e| e.snapshot.is_none() && e.group.as_deref() == Some(GROUP));
        Some((storage, members.map(|e| e.offset_bytes + e.size_bytes).max()?))
    }

    /// Carry out a logged join: the core exports the member as a window of the group's storage
    /// volume, which grows on the elements (acknowledged once Q hold it grown:
    /// `on_volume_resized`). The broken variant `join-split` gives it a storage volume of its
    /// own instead, which the group checker then holds to the group's one order.
    fn execute_join(&mut self, intention: starfish_core::catalog::Intention) {
        self.maybe_crash_mid_op();
        let volume = intention.volume();
        let member = volume.joined().expect("a join");
        let now = self.now;
        let split = self.o.broken == Broken::JoinSplit;
        let host = self.host.as_mut().expect("a host element");
        let result = if split {
            let spec = VolumeSpec {
                name: format!("{}#split", member.name),
                size_bytes: member.size_bytes,
                clone_of: None,
                at_least: false,
            };
            host.core.add_volumes(now, vec![(member.name.clone(), spec)]).map(|ids| (ids[0], 0))
        } else {
            host.core.join_group(now, member.clone()).map(|id| (id, member.offset_bytes))
        };
        match result {
            Ok((id, offset_bytes)) => {
                self.grow_host_vectors();
                if self.in_superseded {
                    self.trace(|| format!("volume {} joined the group (superseded)", member.name));
                    return;
                }
                let storage = id.0 as usize;
                let v = self.add_hosts_volume(storage);
                self.exports[v].offset_bytes = offset_bytes;
                self.exports[v].group = Some(GROUP.to_string());
                self.served[v] = true;
                if split && !self.group_storage.contains(&storage) {
                    self.group_storage.push(storage);
                }
                let key =
                    if split { self.export_storage[v].clone() } else { format!("{}+{}", member.storage, member.name) };
                self.created.push(Created {
                    member_of: Some(member.storage.clone()),
                    ..Created::new(member.name.clone(), key, v, false, intention.id)
                });
                self.trace(|| format!("volume {} joined the group at {offset_bytes}", member.name));
            }
            Err(reason) => {
                self.trace(|| format!("volume {} joining undone: {reason}", member.name));
                let host = self.host.as_mut().expect("checked");
                host.creating = false;
                host.catalog.as_mut().expect("read").finish(now, intention.id, false);
            }
        }
    }

    /// The snapshot (its index in `snapshots`) a clone's spec names.
    fn snapshot_index(&self, spec: &VolumeSpec) -> Option<usize> {
        let base = spec.clone_of.as_ref()?;
        let k = self.snapshots.iter().position(|s| s.id == base.snapshot);
        assert!(k.is_some(), "a clone of snapshot #{} the hosts never took", base.snapshot);
        k
    }

    /// Q elements hold a created volume: the operator is answered; the completion is written.
    fn on_volume_created(&mut self, volume: VolumeId) {
        let Some(host) = self.host.as_ref() else { return };
        let storage = host.core.config().volumes[volume.0 as usize].name.clone();
        let Some(c) = self.created.iter_mut().find(|c| c.storage == storage) else { return };
        c.acked = true;
        self.report.volumes_created += 1;
        self.report.clones_created += c.clone_of.is_some() as u64;
        let (id, name) = (c.intention, c.name.clone());
        self.trace(|| format!("volume {name} created (acknowledged)"));
        self.maybe_crash_mid_op();
        let now = self.now;
        let size = self.sc.volume_bytes;
        let host = self.host.as_mut().expect("checked");
        host.creating = false;
        let Some(log) = host.catalog.as_mut() else { return };
        if log.policy() == LogPolicy::None {
            log.finish_unlogged(now, starfish_core::catalog::CatalogVolume::new(name, size, id));
        } else {
            log.finish(now, id, true);
        }
        self.catalog_step();
    }

    /// An in-sync element that applied every record of storage volume `storage` the host
    /// element sent, if one did.
    fn caught_up_element(&self, storage: &str) -> Option<usize> {
        let host = self.host.as_ref()?;
        let status = host.core.status(self.now);
        let index = host.core.config().volumes.iter().position(|spec| spec.name == storage)?;
        let last = status.volumes.get(index)?.last_sequence;
        (0..self.elements.len()).find(|&e| {
            status.elements[e].state == "in-sync"
                && self.element_vol_named(e, storage).is_some_and(|v| v.applied() == last)
        })
    }

    /// Replicas in sync are byte-identical and hold the same history; every acknowledged write
    /// is in that history (or its loss is counted, and allowed only as the contract says).
    fn check_replicas(&mut self) {
        let Some(host) = &self.host else { return };
        let status = host.core.status(self.now);
        let in_sync: Vec<usize> = (0..self.elements.len()).filter(|&e| status.elements[e].state == "in-sync").collect();
        let Some(&canonical) = in_sync.first() else {
            // Each volume's history is then the one a starting host element would continue,
            // volume by volume (one element for all, chosen by its newest epoch anywhere, once
            // took the history of a volume from an element still copying it: seed 702546).
            self.report.notes.push(
                "no element in sync at the end: each volume's history taken from the element a starting host element would continue it from"
                    .into(),
            );
            return self.account_losses(None, None);
        };
        for &e in in_sync.iter().skip(1) {
            for v in 0..self.host_volumes() {
                let (a, b) = (self.element_vol(canonical, v), self.element_vol(e, v));
                let (Some(a), Some(b)) = (a, b) else {
                    if a.is_none() && b.is_none() {
                        continue; // A removed volume: neither holds it.
                    }
                    self.violation(format!(
                        "in-sync elements e{canonical} and e{e} do not both hold storage volume {v}"
                    ));
                    continue;
                };
                if a.history != b.history {
                    let at = a.history.iter().zip(&b.history).position(|(x, y)| x != y);
                    let message = format!(
                        "replicas diverge: e{canonical} and e{e} (both in sync) hold volume {v} histories of {} and {} records, first differing at index {at:?}",
                        a.history.len(),
                        b.history.len()
                    );
                    self.violation(message);
                } else if a.data != b.data {
                    let differing: Vec<usize> = a
                        .data
                        .chunks(512)
                        .zip(b.data.chunks(512))
                        .enumerate()
                        .filter(|(_, (x, y))| x != y)
                        .map(|(sector, _)| sector)
                        .collect();
                    match differing.iter().find(|&&sector| !self.diverged_without_majority(v, sector, &in_sync)) {
                        Some(sector) => self.violation(format!(
                            "replicas differ: e{canonical} and e{e} (both in sync) differ at volume {v} sector {sector}"
                        )),
                        None => self.report.notes.push(format!(
                            "e{canonical} and e{e} differ at volume {v} in {} sectors silently diverged where no majority of the in-sync elements holds the right content (a scrub cannot decide)",
                            differing.len()
                        )),
                    }
                }
            }
        }
        for &e in &in_sync {
            for v in 0..self.host_volumes() {
                let Some(local) = self.element_vol(e, v) else { continue };
                let applied = local.applied();
                if applied != status.volumes[v].last_sequence {
                    let message = format!(
                        "in-sync element e{e} has applied volume {v} through {applied}, the host element is at {}",
                        status.volumes[v].last_sequence
                    );
                    self.violation(message);
                }
            }
        }
        self.account_losses(Some(canonical), None);
    }

    /// The element a starting host element would continue storage volume `name` from
    /// (`HostCore::maybe_become_ready`): of those that hold it and are not copying it, the
    /// newest epoch first, then the furthest sequence (by sequence alone, an older epoch's
    /// longer history would win).
    fn continued_from(&self, name: &str) -> Option<usize> {
        (0..self.elements.len())
            .filter_map(|e| {
                let storage = &self.elements[e].storage;
                let vi = storage.vols.iter().position(|x| x.name == name && !x.removed)?;
                let volume = &storage.vols[vi];
                (!storage.copying(vi)).then(|| (volume.applied_epoch(), volume.applied(), Reverse(e)))
            })
            .max()
            .map(|(_, _, Reverse(e))| e)
    }

    /// Every acknowledged write of the hosts' volumes (or only of `only`) is in the history
    /// element `canonical` holds (`None`: for each volume, the element a starting host element
    /// would continue it from), or its loss is counted, and allowed only as the contract says.
    /// A volume being deleted is accounted for before its deletion is logged (its history is
    /// gone after), and left out at the end.
    fn account_losses(&mut self, canonical: Option<usize>, only: Option<usize>) {
        let loss_allowed = 2 * self.o.quorum <= self.o.elements;
        let mut lost = Vec::new();
        for (id, op) in self.model.ops() {
            if !op.kind.write_like() || op.outcome != Outcome::Ok || op.lost {
                continue;
            }
            let Some((epoch, sequence)) = op.seq else {
                continue;
            };
            match only {
                Some(v) if op.volume != v => continue,
                Some(_) => {}
                None if self.created.iter().any(|c| c.volume == op.volume && c.delete_intention.is_some()) => {
                    continue; // Its volume was deleted: accounted for before, what it held is gone.
                }
                None => {}
            }
            let name = &self.export_storage[op.volume];
            let holds = |e: usize| holds(self.element_vol_named(e, name), epoch, sequence);
            // A created volume no host element serves at the end (its catalog could not be
            // read: too few elements in sync) was never brought back on the canonical element;
            // its writes count as kept while any element still holds them.
            let unserved = only.is_none() && op.volume >= self.sc.volumes && !self.served[op.volume];
            let from = canonical.or_else(|| self.continued_from(name));
            let kept = from.is_some_and(holds) || (unserved && (0..self.elements.len()).any(holds));
            if !kept {
                lost.push((id, op.volume, epoch, sequence, op.at_risk));
            }
        }
        self.prune_weak_acked();
        for (id, volume, epoch, sequence, at_risk) in lost {
            self.model.mark_lost(id);
            self.report.acked_writes_lost += 1;
            if loss_allowed && at_risk {
                self.report.acked_writes_lost_allowed += 1;
            } else if self.weak_acked.contains_key(&id) && !self.weak_flushed.contains(&id) {
                // Acknowledged on receipts or sends, and never stored by Q elements before
                // those that counted crashed: what `received` and `network-sync` allow.
                self.report.acked_writes_lost_allowed += 1;
                self.report.acked_writes_lost_weak += 1;
                let when = if only.is_some() { " (before its volume's deletion)" } else { "" };
                self.trace(|| format!("write #{id} of volume {volume}, weakly acknowledged, lost as allowed{when}"));
            } else if self.weak_acked.contains_key(&id) {
                self.violation(format!(
                    "acknowledged write #{id} (volume {volume}, epoch {epoch}, sequence {sequence}) is lost although a FLUSH answered after it (a flush waits for Q durable copies)"
                ));
            } else {
                self.violation(format!(
                    "acknowledged write #{id} (volume {volume}, epoch {epoch}, sequence {sequence}) is not in the history the replicas ended with{}",
                    if at_risk { " (Q > N/2: never allowed)" } else { " (an element that held it was there when the host element restarted)" }
                ));
            }
        }
    }
}

/// The storage volumes, the hosts' volumes in them, and which storage volumes carry the
/// consistency group, as the host element's shell lays them out (`starfish_core::groups`):
/// with `--groups`, vol0 and vol1 form group `g`; `split-group` lays every volume out alone.
fn layout(o: &SimOptions, sc: &Scenario) -> (Vec<VolumeSpec>, Vec<ExportedVolume>, Vec<usize>) {
    let volumes: Vec<VolumeSpec> = (0..sc.volumes)
        .map(|v| VolumeSpec { name: format!("vol{v}"), size_bytes: sc.volume_bytes, clone_of: None, at_least: false })
        .collect();
    if !o.groups || sc.volumes < 2 {
        return (volumes.clone(), starfish_core::groups::ungrouped(&volumes), Vec::new());
    }
    let group = GroupSpec { name: "g".into(), volumes: vec!["vol0".into(), "vol1".into()] };
    if o.broken == Broken::SplitGroup {
        return (volumes.clone(), starfish_core::groups::ungrouped(&volumes), vec![0, 1]);
    }
    let (storage, exports) = starfish_core::groups::layout(&volumes, &[group]).expect("a valid group");
    let carriers = vec![exports[0].volume];
    (storage, exports, carriers)
}

/// An element the core cannot bring back with the recovery it implements (the write queue or
/// a peer's replay log no longer covers its gap, or its history diverged, and no peer can serve
/// it): a figure, not a liveness violation.
fn needs_recovery(failure: &Failure) -> bool {
    matches!(failure, Failure::Unrecoverable { .. })
}

fn action_code(action: &Action) -> u64 {
    match action {
        Action::Send { to, message } => {
            let m = match message {
                HostMessage::Apply(r) => r.sequence.0 << 8 | 1,
                HostMessage::Read { request_id, .. } => request_id << 8 | 2,
                _ => 3,
            };
            to.0.rotate_left(40) ^ m
        }
        Action::Disconnect { element } => 0xD0 ^ element.0 as u64,
        Action::Reply { token, .. } => 0xE0 ^ (token.0 << 8),
        Action::Event(_) => 0xF0,
    }
}

fn brief_host(m: &HostMessage) -> String {
    match m {
        HostMessage::Apply(r) => format!(
            "Apply vol {} epoch {} seq {} {} {}+{}",
            r.volume,
            r.epoch,
            r.sequence,
            match r.op {
                Op::Write { .. } => "write",
                Op::Trim { .. } => "trim",
                Op::WriteZeroes { .. } => "zero",
                Op::Snapshot { .. } => "snapshot",
                Op::SnapshotDelete { .. } => "snapshot-delete",
                Op::Begin => "begin",
            },
            r.op.offset_bytes(),
            r.op.length_bytes()
        ),
        HostMessage::Hello { epoch, .. } => format!("Hello epoch {epoch}"),
        HostMessage::Read { request_id, volume, offset_bytes, length_bytes, snapshot } => match snapshot {
            None => format!("Read #{request_id} vol {volume} {offset_bytes}+{length_bytes}"),
            Some(s) => format!("Read #{request_id} vol {volume}@{} {offset_bytes}+{length_bytes}", s.id),
        },
        HostMessage::BlockStatus { request_id, .. } => format!("BlockStatus #{request_id}"),
        HostMessage::Scrub { request_id, volume, first_block, count, min_applied } => {
            format!("Scrub #{request_id} vol {volume} blocks {first_block}+{count} at {min_applied}")
        }
        HostMessage::Ping { .. } => "Ping".into(),
        HostMessage::Observe { .. } => "Observe".into(),
        HostMessage::Release => "Release".into(),
        HostMessage::FetchLog { request_id, volume, after, .. } => {
            format!("FetchLog #{request_id} vol {volume} after {after}")
        }
        HostMessage::Recover { volume, source, after, through, .. } => {
            format!("Recover vol {volume} from {source} ({after}, {through}]")
        }
        HostMessage::Copy { volume, source, .. } => format!("Copy vol {volume} from {source}"),
        HostMessage::AddVolumes { volumes } => format!("AddVolumes {}", volumes.len()),
        HostMessage::CheckVolumes { request_id, volumes } => format!("CheckVolumes #{request_id} {}", volumes.len()),
        HostMessage::RemoveVolumes { volumes } => format!("RemoveVolumes {volumes:?}"),
        HostMessage::ResizeVolumes { volumes } => format!("ResizeVolumes {volumes:?}"),
        HostMessage::FetchBlocks { request_id, first_block, have, .. } => {
            format!("FetchBlocks #{request_id} {first_block}+{}", have.len())
        }
    }
}

fn brief_element(m: &ElementMessage) -> String {
    match m {
        ElementMessage::ReadReply { request_id, applied_sequence, result } => format!(
            "ReadReply #{request_id} applied {applied_sequence} {}",
            match result {
                Ok(d) => format!("{} bytes", d.data.len()),
                Err(e) => format!("error {e}"),
            }
        ),
        ElementMessage::LogRecords { request_id, result } => format!(
            "LogRecords #{request_id} {}",
            match result {
                Ok(r) => format!(
                    "{} records {:?}..{:?}",
                    r.len(),
                    r.first().map(|r| r.sequence.0),
                    r.last().map(|r| r.sequence.0)
                ),
                Err(e) => format!("error {e}"),
            }
        ),
        other => format!("{other:?}"),
    }
}
