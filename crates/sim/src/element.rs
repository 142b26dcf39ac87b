//! An element in memory, with the semantics of the real one (`crates/shell/src/element.rs`
//! over `crates/store`): one committer that takes, in arrival order, records and the `Hello`s
//! of new sessions; group commit (records wait for one simulated fdatasync, then are applied
//! and acknowledged cumulatively); fencing at two levels — a `Hello` of an older epoch is
//! refused, a newer one is adopted durably in order with the records queued before it, and a
//! record whose *session* epoch is older than the element's is refused ("fenced"); in the
//! store, per volume, a record older than the volume's last record is refused (epochs never
//! decrease along one volume's sequence); strict sequence order, duplicates skipped, gaps
//! refused with a `Fault`; a bounded replay log, per-block checksums that fail reads of a
//! corrupt block, and crash behaviour that depends on what crashed: a killed process keeps
//! what it had written (the page cache survives), a power loss keeps a random prefix of the
//! unsynced batch and may tear the next record (discarded by its checksum).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use proto::{
    BlockExtent, ElementMessage, Epoch, HostMessage, Op, Record, Sequence, VolumeId, VolumeState, BLOCK_BYTES,
};

use crate::options::Broken;
use crate::rng::Rng;

/// Records taken into one group commit at most (as the real committer).
const COMMIT_BATCH_RECORDS_MAX: usize = 1024;
/// Replay-log bookkeeping per record beyond its payload.
const LOG_RECORD_OVERHEAD_BYTES: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashKind {
    Kill,
    PowerLoss,
}

/// What the element asks the world to do.
#[derive(Debug)]
pub enum Out {
    Send {
        session: u64,
        message: ElementMessage,
        delay_us: u64,
    },
    /// Schedule the end of the fdatasync of the current batch.
    SyncAfter {
        delay_us: u64,
    },
    /// The element ends this session (after a refusal).
    Close {
        session: u64,
    },
    /// A record was refused. `ordering`: for arriving out of order (a gap not caused by an
    /// earlier refusal in the same commit) or from an older epoch than the element holds.
    Refused {
        session: u64,
        reason: String,
        ordering: bool,
        /// The record came from a peer's replay log (a replay recovery), not from the host
        /// element.
        replayed: bool,
    },
    /// A replay recovery asks for records of a peer's replay log. `epoch`: the epoch of the
    /// session that ordered it, which the element says hello with to the peer and which the
    /// pulled records are committed under.
    Recover {
        session: u64,
        epoch: Epoch,
        volume: VolumeId,
        source: String,
        after: Sequence,
        through: Sequence,
    },
    /// A full recovery asks for a copy of a peer's volume (the world takes it as one snapshot
    /// at the peer's applied sequence: the real copy's chunk-by-chunk, resumable walk is not
    /// modelled, only its outcome — the peer's content and history, durably, and the volume's
    /// replay log dropped).
    Copy {
        session: u64,
        epoch: Epoch,
        volume: VolumeId,
        source: String,
    },
}

/// One fetch of a replay's pull, as the world delivers it.
pub struct Pull {
    pub epoch: Epoch,
    pub volume: VolumeId,
    pub source: String,
    /// Newest sequence fetched (the `after` asked if none).
    pub reached: Sequence,
    pub through: Sequence,
}

/// A peer's volume as a full recovery copies it.
#[derive(Debug)]
pub struct VolumeCopy {
    pub data: Vec<u8>,
    pub allocated: Vec<bool>,
    pub history: Vec<Epoch>,
}

pub struct Volume {
    pub data: Vec<u8>,
    /// Per 4 KiB block: holds data (false: a hole that reads as zeroes).
    pub allocated: Vec<bool>,
    /// Epoch of every applied record, index = sequence − 1. The simulator's ground truth of
    /// this replica's history (the real element keeps only the bounded replay log).
    pub history: Vec<Epoch>,
    log: VecDeque<Record>,
    log_bytes: u64,
    /// Ack-before-sync variant: highest sequence received in order.
    received_through: Sequence,
}

impl Volume {
    pub fn applied(&self) -> Sequence {
        Sequence(self.history.len() as u64)
    }

    /// Epoch of the last applied record (0 before the first), as `Store::applied_epoch`.
    pub fn applied_epoch(&self) -> Epoch {
        self.history.last().copied().unwrap_or(Epoch(0))
    }
}

/// Work for the committer, in arrival order (the real element's `Job`).
enum Job {
    Commit {
        session: u64,
        /// Epoch of the session that sent it (or that ordered the replay it came from).
        session_epoch: Epoch,
        record: Record,
        /// Pulled from a peer by a replay recovery.
        replayed: bool,
    },
    /// A session starts (`session` None: a peer's replay recovery saying hello to fetch from
    /// this element's replay log). Ordered after every record queued before it.
    Hello { session: Option<u64>, epoch: Epoch },
}

/// What the committer is busy with until its simulated sync completes.
enum Batch {
    Records {
        records: Vec<Record>,
        /// Who gets a cumulative `Applied` once the batch is durable.
        acks: Vec<(u64, VolumeId)>,
    },
    /// Adopting a newer epoch durably (a metadata write).
    Hello { session: Option<u64>, epoch: Epoch },
}

/// One session's state as the element sees it.
#[derive(Default)]
struct SessionState {
    /// Epoch of the session, once its `Hello` was accepted.
    epoch: Option<Epoch>,
    /// Its `Hello` waits in the committer: the session reads nothing more until it is answered.
    hello_pending: bool,
    /// Messages that arrived meanwhile (the real session task reads them after the Welcome).
    deferred: VecDeque<HostMessage>,
}

pub struct Element {
    pub name: String,
    pub alive: bool,
    /// False while powered off: connection attempts time out instead of being refused.
    pub machine_up: bool,
    pub incarnation: u64,
    /// The store's epoch (durable): adopted from accepted `Hello`s, raised by committed records.
    pub epoch: Epoch,
    pub vols: Vec<Volume>,
    sessions: BTreeMap<u64, SessionState>,
    pending: VecDeque<Job>,
    batch: Option<Batch>,
    pub disk_full: bool,
    /// A commit failed (I/O error): the store refuses changes until the element restarts.
    pub poisoned: bool,
    pub fsync_us: u64,
    pub slow_disk_factor: u64,
    pub corrupt_blocks: BTreeSet<(usize, u64)>,
    pub corrupt_log: BTreeSet<(usize, u64)>,
    replay_log_bytes: u64,
    recover_waiters: Vec<(u64, VolumeId, Sequence)>,
    /// (session, volume) that had a record refused.
    refused: BTreeSet<(u64, usize)>,
    /// Replays under way per (session, volume): `through` and the current writes after it,
    /// kept aside until the gap is pulled (as the element core's stash).
    stashes: BTreeMap<(u64, usize), (Sequence, Vec<Record>)>,
    /// Replays whose pull failed: current writes beyond the gap are dropped until a new order
    /// or until the host element sends the gap again.
    failed_pulls: BTreeSet<(u64, usize)>,
    broken: Broken,
    pub torn_records: u64,
    pub unsynced_lost: u64,
    /// Records applied with an epoch older than the last record of another volume here (the
    /// roll-forward of a volume that another volume had already left behind; the old
    /// store-wide fencing refused them: core bug 1 in docs/testing.md).
    pub applied_behind_another_volume: u64,
}

impl Element {
    pub fn new(
        name: String,
        volumes: usize,
        volume_bytes: u64,
        fsync_us: u64,
        replay_log_bytes: u64,
        broken: Broken,
    ) -> Element {
        let blocks = (volume_bytes / BLOCK_BYTES) as usize;
        Element {
            name,
            alive: true,
            machine_up: true,
            incarnation: 1,
            epoch: Epoch(0),
            vols: (0..volumes)
                .map(|_| Volume {
                    data: vec![0; volume_bytes as usize],
                    allocated: vec![false; blocks],
                    history: Vec::new(),
                    log: VecDeque::new(),
                    log_bytes: 0,
                    received_through: Sequence::ZERO,
                })
                .collect(),
            sessions: BTreeMap::new(),
            pending: VecDeque::new(),
            batch: None,
            disk_full: false,
            poisoned: false,
            fsync_us,
            slow_disk_factor: 1,
            corrupt_blocks: BTreeSet::new(),
            corrupt_log: BTreeSet::new(),
            replay_log_bytes,
            recover_waiters: Vec::new(),
            refused: BTreeSet::new(),
            stashes: BTreeMap::new(),
            failed_pulls: BTreeSet::new(),
            broken,
            torn_records: 0,
            unsynced_lost: 0,
            applied_behind_another_volume: 0,
        }
    }

    pub fn has_session(&self, session: u64) -> bool {
        self.sessions.contains_key(&session)
    }

    pub fn open_session(&mut self, session: u64) {
        assert!(self.alive);
        self.sessions.insert(session, SessionState::default());
    }

    pub fn close_session(&mut self, session: u64) {
        self.sessions.remove(&session);
        self.stashes.retain(|(s, _), _| *s != session);
        self.failed_pulls.retain(|(s, _)| *s != session);
    }

    pub fn sessions(&self) -> Vec<u64> {
        self.sessions.keys().copied().collect()
    }

    fn read_delay_us(&self, rng: &mut Rng, bytes: u64) -> u64 {
        (rng.range(20, 400) + bytes / 1000) * self.slow_disk_factor
    }

    pub fn handle(&mut self, rng: &mut Rng, session: u64, message: HostMessage, out: &mut Vec<Out>) {
        assert!(self.alive && self.sessions.contains_key(&session));
        let state = self.sessions.get_mut(&session).expect("checked");
        if state.hello_pending {
            state.deferred.push_back(message);
            return;
        }
        let session_epoch = state.epoch;
        let Some(session_epoch) = session_epoch.or(match message {
            HostMessage::Hello { .. } => Some(Epoch(0)),
            _ => None,
        }) else {
            out.push(Out::Send {
                session,
                message: ElementMessage::Refused { reason: "protocol: request before hello".into() },
                delay_us: 0,
            });
            out.push(Out::Close { session });
            return;
        };
        match message {
            HostMessage::Hello { epoch, volumes } => {
                if self.sessions[&session].epoch.is_some() {
                    out.push(Out::Send {
                        session,
                        message: ElementMessage::Refused { reason: "protocol: second hello".into() },
                        delay_us: 0,
                    });
                    out.push(Out::Close { session });
                    return;
                }
                assert_eq!(volumes.len(), self.vols.len(), "the simulator configures every volume everywhere");
                // As the real element: the hello goes through the committer, after every
                // record queued before it; the session reads nothing more until it is answered.
                self.sessions.get_mut(&session).expect("checked").hello_pending = true;
                self.pending.push_back(Job::Hello { session: Some(session), epoch });
                if self.batch.is_none() {
                    self.start_batch(rng, out);
                }
            }
            HostMessage::Apply(record) => {
                if self.broken == Broken::AckBeforeSync {
                    let v = &mut self.vols[record.volume.0 as usize];
                    v.received_through = v.received_through.max(v.applied());
                    if record.sequence == v.received_through.next() {
                        v.received_through = record.sequence;
                        let message = ElementMessage::Applied { volume: record.volume, sequence: record.sequence };
                        out.push(Out::Send { session, message, delay_us: 0 });
                    }
                }
                let key = (session, record.volume.0 as usize);
                if self.stashes.get(&key).is_some_and(|(through, stash)| {
                    record.sequence > *through && stash.is_empty() && self.failed_pulls.contains(&key)
                }) {
                    // A failed pull: current writes wait for the next order, unless the host
                    // element sends the gap again itself (it had switched to its write queue).
                    let vi = record.volume.0 as usize;
                    let accepted = self
                        .pending
                        .iter()
                        .filter_map(|j| match j {
                            Job::Commit { record: r, .. } if r.volume.0 as usize == vi => Some(r.sequence),
                            _ => None,
                        })
                        .chain(self.batch_sequences(vi))
                        .fold(self.vols[vi].applied(), |a, s| if s == a.next() { s } else { a });
                    if record.sequence != accepted.next() {
                        return;
                    }
                    self.stashes.remove(&key);
                    self.failed_pulls.remove(&key);
                }
                if let Some((through, stash)) = self.stashes.get_mut(&key) {
                    if record.sequence > *through {
                        // Kept aside while the gap is pulled (dropped if not contiguous: the
                        // pull goes on to it then).
                        let next = stash.last().map_or(through.next(), |r| r.sequence.next());
                        if record.sequence == next {
                            stash.push(record);
                        }
                        return;
                    }
                }
                self.pending.push_back(Job::Commit { session, session_epoch, record, replayed: false });
                if self.batch.is_none() {
                    self.start_batch(rng, out);
                }
            }
            HostMessage::Read { request_id, volume, offset_bytes, length_bytes } => {
                let v = &self.vols[volume.0 as usize];
                let applied_sequence = v.applied();
                let first = offset_bytes / BLOCK_BYTES;
                let end = (offset_bytes + length_bytes as u64).div_ceil(BLOCK_BYTES);
                let corrupt = (first..end).find(|b| self.corrupt_blocks.contains(&(volume.0 as usize, *b)));
                let result = match corrupt {
                    Some(b) => Err(format!("volume {volume} block {b}: checksum mismatch")),
                    None => Ok(Bytes::copy_from_slice(
                        &v.data[offset_bytes as usize..(offset_bytes + length_bytes as u64) as usize],
                    )),
                };
                let delay_us = self.read_delay_us(rng, length_bytes as u64);
                out.push(Out::Send {
                    session,
                    message: ElementMessage::ReadReply { request_id, applied_sequence, result },
                    delay_us,
                });
            }
            HostMessage::BlockStatus { request_id, volume, offset_bytes, length_bytes } => {
                let v = &self.vols[volume.0 as usize];
                let mut extents: Vec<BlockExtent> = Vec::new();
                let end_bytes = offset_bytes + length_bytes;
                let mut at = offset_bytes;
                while at < end_bytes {
                    let block = at / BLOCK_BYTES;
                    let next = ((block + 1) * BLOCK_BYTES).min(end_bytes);
                    let allocated = v.allocated[block as usize];
                    match extents.last_mut() {
                        Some(last) if last.allocated == allocated => last.length_bytes += next - at,
                        _ => extents.push(BlockExtent { length_bytes: next - at, allocated }),
                    }
                    at = next;
                }
                let delay_us = self.read_delay_us(rng, 0);
                let message =
                    ElementMessage::BlockStatusReply { request_id, applied_sequence: v.applied(), result: Ok(extents) };
                out.push(Out::Send { session, message, delay_us });
            }
            HostMessage::Ping { nonce } => {
                out.push(Out::Send { session, message: ElementMessage::Pong { nonce }, delay_us: 0 });
            }
            HostMessage::FetchLog { request_id, volume, after, max_bytes } => {
                let result = self.log_records(volume.0 as usize, after, Sequence(u64::MAX), max_bytes);
                let bytes: u64 = result.as_ref().map_or(0, |r| r.iter().map(|r| r.op.payload_bytes()).sum());
                let delay_us = self.read_delay_us(rng, bytes);
                out.push(Out::Send { session, message: ElementMessage::LogRecords { request_id, result }, delay_us });
            }
            HostMessage::Recover { volume, source, after, through, .. } => {
                self.stashes.insert((session, volume.0 as usize), (through, Vec::new()));
                self.failed_pulls.remove(&(session, volume.0 as usize));
                out.push(Out::Recover { session, epoch: session_epoch, volume, source, after, through });
            }
            HostMessage::Copy { volume, source, .. } => {
                self.stashes.remove(&(session, volume.0 as usize));
                self.failed_pulls.remove(&(session, volume.0 as usize));
                out.push(Out::Copy { session, epoch: session_epoch, volume, source });
            }
            HostMessage::FetchBlocks { request_id, .. } => {
                out.push(Out::Send {
                    session,
                    message: ElementMessage::Blocks { request_id, result: Err("not modelled".into()) },
                    delay_us: 0,
                });
            }
        }
    }

    /// Records of a volume after `after` through `through` from the replay log: at least one,
    /// then as many as fit in `max_bytes` (as `Store::log_records`).
    pub fn log_records(
        &self,
        vi: usize,
        after: Sequence,
        through: Sequence,
        max_bytes: u64,
    ) -> Result<Vec<Record>, String> {
        let v = &self.vols[vi];
        let last = v.applied().min(through);
        if after >= last {
            return Ok(Vec::new());
        }
        let Some(front) = v.log.front() else {
            return Err(format!("sequence {} is no longer in the replay log (it is empty)", after.next()));
        };
        if front.sequence > after.next() {
            return Err(format!(
                "sequence {} is no longer in the replay log (oldest {})",
                after.next(),
                front.sequence
            ));
        }
        let mut records = Vec::new();
        let mut bytes = 0;
        let start = (after.next().0 - front.sequence.0) as usize;
        for record in v.log.iter().skip(start) {
            if record.sequence > last || (!records.is_empty() && bytes + record.op.payload_bytes() > max_bytes) {
                break;
            }
            if self.corrupt_log.contains(&(vi, record.sequence.0)) {
                return Err(format!("replay log record {} fails its checksum", record.sequence));
            }
            bytes += record.op.payload_bytes();
            records.push(record.clone());
        }
        Ok(records)
    }

    /// Records pulled from a peer for a replay recovery: committed as if the host element had
    /// sent them on `session`, under the epoch of the session that ordered the replay. Once
    /// the pull reached its `through`, the current writes kept aside follow, and
    /// `RecoveryDone` goes out when all of it is applied; short of it, the pull goes on.
    pub fn recover_records(
        &mut self,
        rng: &mut Rng,
        session: u64,
        pull: Pull,
        records: Vec<Record>,
        out: &mut Vec<Out>,
    ) {
        if !self.sessions.contains_key(&session) {
            return;
        }
        let Pull { epoch: session_epoch, volume, source, reached, through } = pull;
        for record in records {
            self.pending.push_back(Job::Commit {
                session,
                session_epoch,
                record: Record { volume, ..record },
                replayed: true,
            });
        }
        let key = (session, volume.0 as usize);
        if reached < through && self.stashes.contains_key(&key) {
            // The peer had not applied that far yet: pull on from where it got to.
            out.push(Out::Recover { session, epoch: session_epoch, volume, source, after: reached, through });
            if self.batch.is_none() {
                self.start_batch(rng, out);
            }
            return;
        }
        let mut target = reached;
        if let Some((_, stash)) = self.stashes.remove(&key) {
            for record in stash {
                target = record.sequence;
                self.pending.push_back(Job::Commit { session, session_epoch, record, replayed: false });
            }
        }
        self.recover_waiters.push((session, volume, target));
        if self.batch.is_none() {
            self.start_batch(rng, out);
        }
        self.answer_recover_waiters(out);
    }

    /// A failed replay: what was kept aside is dropped, and so are current writes beyond the
    /// gap until the host element orders the next attempt.
    pub fn replay_failed(&mut self, session: u64, volume: VolumeId) {
        if let Some((_, stash)) = self.stashes.get_mut(&(session, volume.0 as usize)) {
            stash.clear();
            self.failed_pulls.insert((session, volume.0 as usize));
        }
    }

    /// A peer's replay recovery says hello (with the epoch of its own host element session)
    /// before fetching from this element's replay log: refused if older than this element's
    /// epoch, otherwise adopted, in order with the records queued here.
    /// The volume as a full recovery copies it (`Err` if a block fails its checksum, as the
    /// real source's verified read does).
    pub fn copy_volume(&self, vi: usize) -> Result<VolumeCopy, String> {
        if let Some((_, b)) = self.corrupt_blocks.iter().find(|(v, _)| *v == vi) {
            return Err(format!("peer could not send blocks: block {b} fails its checksum"));
        }
        let v = &self.vols[vi];
        Ok(VolumeCopy { data: v.data.clone(), allocated: v.allocated.clone(), history: v.history.clone() })
    }

    /// Sequences of volume `vi` in the batch being committed.
    fn batch_sequences(&self, vi: usize) -> Vec<Sequence> {
        match &self.batch {
            Some(Batch::Records { records, .. }) => {
                records.iter().filter(|r| r.volume.0 as usize == vi).map(|r| r.sequence).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Whether records of volume `vi` wait in the committer (a copy is installed only when
    /// none do: the real store skips them while the volume is being copied).
    pub fn commits_pending(&self, vi: usize) -> bool {
        let in_batch = match &self.batch {
            Some(Batch::Records { records, .. }) => records.iter().any(|r| r.volume.0 as usize == vi),
            _ => false,
        };
        in_batch
            || self.pending.iter().any(|j| matches!(j, Job::Commit { record, .. } if record.volume.0 as usize == vi))
    }

    /// Install a finished copy durably and answer `CopyDone` with the sequence adopted.
    pub fn install_copy(&mut self, session: u64, volume: VolumeId, copy: VolumeCopy, out: &mut Vec<Out>) {
        let vi = volume.0 as usize;
        let v = &mut self.vols[vi];
        v.data = copy.data;
        v.allocated = copy.allocated;
        v.history = copy.history;
        v.log.clear();
        v.log_bytes = 0;
        v.received_through = v.applied();
        let applied = v.applied();
        self.corrupt_blocks.retain(|(w, _)| *w != vi);
        self.corrupt_log.retain(|(w, _)| *w != vi);
        self.epoch = self.epoch.max(self.vols[vi].applied_epoch());
        out.push(Out::Send {
            session,
            message: ElementMessage::CopyProgress {
                volume,
                done_bytes: self.vols[vi].data.len() as u64,
                total_bytes: self.vols[vi].data.len() as u64,
                copied_bytes: self.vols[vi].allocated.iter().filter(|a| **a).count() as u64 * BLOCK_BYTES,
            },
            delay_us: 0,
        });
        out.push(Out::Send { session, message: ElementMessage::CopyDone { volume, result: Ok(applied) }, delay_us: 0 });
    }

    pub fn peer_hello(&mut self, rng: &mut Rng, epoch: Epoch, out: &mut Vec<Out>) -> Result<(), String> {
        if epoch < self.epoch {
            return Err(format!(
                "peer refused: stale epoch {epoch}: this element already follows epoch {}",
                self.epoch
            ));
        }
        if epoch > self.epoch {
            self.pending.push_back(Job::Hello { session: None, epoch });
            if self.batch.is_none() {
                self.start_batch(rng, out);
            }
        }
        Ok(())
    }

    fn answer_recover_waiters(&mut self, out: &mut Vec<Out>) {
        let vols = &self.vols;
        self.recover_waiters.retain(|(session, volume, through)| {
            let applied = vols[volume.0 as usize].applied();
            if applied >= *through {
                let message = ElementMessage::RecoveryDone { volume: *volume, result: Ok(applied) };
                out.push(Out::Send { session: *session, message, delay_us: 0 });
                false
            } else {
                true
            }
        });
    }

    fn volume_states(&self) -> Vec<VolumeState> {
        self.vols
            .iter()
            .map(|v| VolumeState { applied_sequence: v.applied(), applied_epoch: v.applied_epoch(), copying: false })
            .collect()
    }

    /// The committer takes the next job: a `Hello` alone, or every record waiting up to the
    /// next `Hello`, checked as `run_committer`/`commit_batch` and `Store::commit` do, with one
    /// write + fdatasync for what it accepts.
    fn start_batch(&mut self, rng: &mut Rng, out: &mut Vec<Out>) {
        while self.batch.is_none() {
            match self.pending.front() {
                None => return,
                Some(Job::Hello { .. }) => {
                    let Some(Job::Hello { session, epoch }) = self.pending.pop_front() else {
                        unreachable!("just looked")
                    };
                    self.start_hello(rng, session, epoch, out);
                }
                Some(Job::Commit { .. }) => self.start_records(out),
            }
        }
    }

    /// `hello` of the real element: refuse an older epoch; adopt a newer one durably (a
    /// metadata write, which keeps the committer busy); answer with the epoch held before.
    fn start_hello(&mut self, rng: &mut Rng, session: Option<u64>, epoch: Epoch, out: &mut Vec<Out>) {
        let live = session.filter(|s| self.sessions.contains_key(s));
        let refuse = |reason: String, out: &mut Vec<Out>| {
            if let Some(session) = live {
                out.push(Out::Send { session, message: ElementMessage::Refused { reason }, delay_us: 0 });
                out.push(Out::Close { session });
            }
        };
        if epoch < self.epoch {
            let reason = format!("stale epoch {epoch}: this element already follows epoch {}", self.epoch);
            return refuse(reason, out);
        }
        if epoch == self.epoch {
            return self.welcome(rng, live, epoch, self.epoch, out);
        }
        if self.disk_full || self.poisoned {
            // The metadata write fails: the store refuses changes until reopened.
            self.poisoned = true;
            return refuse("no space left on device".into(), out);
        }
        let delay_us = self.fsync_us * self.slow_disk_factor;
        self.batch = Some(Batch::Hello { session, epoch });
        out.push(Out::SyncAfter { delay_us });
    }

    /// The hello's answer, then whatever the session sent meanwhile.
    fn welcome(&mut self, rng: &mut Rng, session: Option<u64>, epoch: Epoch, previous: Epoch, out: &mut Vec<Out>) {
        let Some(session) = session.filter(|s| self.sessions.contains_key(s)) else {
            return;
        };
        let state = self.sessions.get_mut(&session).expect("checked");
        state.hello_pending = false;
        state.epoch = Some(epoch);
        let deferred = std::mem::take(&mut state.deferred);
        out.push(Out::Send {
            session,
            message: ElementMessage::Welcome { epoch: previous, volumes: self.volume_states() },
            delay_us: 0,
        });
        for message in deferred {
            if !self.sessions.contains_key(&session) {
                break;
            }
            self.handle(rng, session, message, out);
        }
    }

    fn start_records(&mut self, out: &mut Vec<Out>) {
        assert!(self.batch.is_none());
        let mut items = Vec::new();
        while items.len() < COMMIT_BATCH_RECORDS_MAX {
            match self.pending.front() {
                Some(Job::Commit { .. }) => {
                    let Some(Job::Commit { session, session_epoch, record, replayed }) = self.pending.pop_front()
                    else {
                        unreachable!("just looked")
                    };
                    items.push((session, session_epoch, record, replayed));
                }
                _ => break,
            }
        }
        // `commit_batch`: records of sessions a newer host element superseded are fenced.
        let current = self.epoch;
        if self.broken != Broken::NoFencing {
            items.retain(|(session, session_epoch, _, _)| {
                if *session_epoch >= current {
                    return true;
                }
                let reason = format!("fenced: a host element of epoch {current} superseded epoch {session_epoch}");
                out.push(Out::Send { session: *session, message: ElementMessage::Fault { reason }, delay_us: 0 });
                false
            });
        }
        if items.is_empty() {
            return;
        }
        if self.disk_full || self.poisoned {
            self.poisoned = true;
            let mut told = BTreeSet::new();
            for (session, _, _, _) in &items {
                if told.insert(*session) {
                    let reason =
                        "commit failed: no space left on device (the store refuses changes until reopened)".to_string();
                    out.push(Out::Send { session: *session, message: ElementMessage::Fault { reason }, delay_us: 0 });
                }
            }
            return;
        }
        // `Store::commit`: per volume, the applied sequence and the epoch of its last record
        // as of the records accepted so far.
        let mut applied: Vec<(Sequence, Epoch)> = self.vols.iter().map(|v| (v.applied(), v.applied_epoch())).collect();
        let mut records = Vec::new();
        let mut acks: Vec<(u64, VolumeId)> = Vec::new();
        let mut bytes = 0;
        for (session, _, record, replayed) in items {
            let vi = record.volume.0 as usize;
            if !acks.contains(&(session, record.volume)) {
                acks.push((session, record.volume));
            }
            let mut refuse = |reason: String, ordering: bool, out: &mut Vec<Out>| {
                // Records behind a refused one on the same session are refused as gaps too;
                // only the first says something about the order the host element sent.
                let ordering = ordering && self.refused.insert((session, vi));
                out.push(Out::Refused { session, reason: reason.clone(), ordering, replayed });
                out.push(Out::Send { session, message: ElementMessage::Fault { reason }, delay_us: 0 });
            };
            let (volume_applied, volume_epoch) = applied[vi];
            if record.sequence <= volume_applied {
                continue; // duplicate
            }
            if record.epoch < volume_epoch && self.broken != Broken::NoFencing {
                refuse(
                    format!(
                        "volume {}: record {} of stale epoch {} (the volume's last record, {volume_applied}, is of epoch {volume_epoch})",
                        record.volume, record.sequence, record.epoch
                    ),
                    true,
                    out,
                );
                continue;
            }
            if record.sequence != volume_applied.next() {
                refuse(
                    format!("volume {}: gap: applied {volume_applied} but got {}", record.volume, record.sequence),
                    true,
                    out,
                );
                continue;
            }
            if let Some(block) = self.partially_covered_corrupt_block(&record) {
                self.refused.insert((session, vi));
                out.push(Out::Send {
                    session,
                    message: ElementMessage::Fault {
                        reason: format!(
                            "volume {}: block {block}: checksum mismatch in the base of a partial write",
                            record.volume
                        ),
                    },
                    delay_us: 0,
                });
                continue;
            }
            applied[vi] = (record.sequence, record.epoch);
            bytes += record.op.payload_bytes();
            records.push(record);
        }
        let delay_us = (self.fsync_us + bytes / 400) * self.slow_disk_factor;
        self.batch = Some(Batch::Records { records, acks });
        out.push(Out::SyncAfter { delay_us });
    }

    fn partially_covered_corrupt_block(&self, record: &Record) -> Option<u64> {
        let start = record.op.offset_bytes();
        let end = start + record.op.length_bytes();
        let vi = record.volume.0 as usize;
        (start / BLOCK_BYTES..end.div_ceil(BLOCK_BYTES)).find(|b| {
            let covered = start <= b * BLOCK_BYTES && end >= (b + 1) * BLOCK_BYTES;
            !covered && self.corrupt_blocks.contains(&(vi, *b))
        })
    }

    /// The fdatasync of the current batch (or the metadata write of a hello) completed:
    /// apply and acknowledge, then take the next job.
    pub fn sync_done(&mut self, rng: &mut Rng, out: &mut Vec<Out>) {
        match self.batch.take().expect("a sync completes a batch") {
            Batch::Records { records, acks } => {
                for record in &records {
                    self.apply(record);
                }
                for (session, volume) in acks {
                    if self.sessions.contains_key(&session) {
                        let sequence = self.vols[volume.0 as usize].applied();
                        out.push(Out::Send {
                            session,
                            message: ElementMessage::Applied { volume, sequence },
                            delay_us: 0,
                        });
                    }
                }
                self.answer_recover_waiters(out);
            }
            Batch::Hello { session, epoch } => {
                let previous = self.epoch;
                self.epoch = self.epoch.max(epoch);
                self.welcome(rng, session, epoch, previous, out);
            }
        }
        self.start_batch(rng, out);
    }

    fn apply(&mut self, record: &Record) {
        let vi = record.volume.0 as usize;
        if self.vols.iter().enumerate().any(|(j, w)| j != vi && w.applied_epoch() > record.epoch) {
            self.applied_behind_another_volume += 1;
        }
        let v = &mut self.vols[vi];
        assert_eq!(record.sequence, v.applied().next(), "elements apply strictly in sequence order");
        let start = record.op.offset_bytes();
        let end = start + record.op.length_bytes();
        let zeroing = !matches!(record.op, Op::Write { .. });
        match &record.op {
            Op::Write { data, .. } => v.data[start as usize..end as usize].copy_from_slice(data),
            _ => v.data[start as usize..end as usize].fill(0),
        }
        for b in start / BLOCK_BYTES..end.div_ceil(BLOCK_BYTES) {
            let covered = start <= b * BLOCK_BYTES && end >= (b + 1) * BLOCK_BYTES;
            if !zeroing {
                v.allocated[b as usize] = true;
            } else if covered {
                v.allocated[b as usize] = false;
            }
            if covered {
                self.corrupt_blocks.remove(&(vi, b));
            }
        }
        v.history.push(record.epoch);
        self.epoch = self.epoch.max(record.epoch);
        v.log_bytes += record.op.payload_bytes() + LOG_RECORD_OVERHEAD_BYTES;
        v.log.push_back(record.clone());
        while v.log_bytes > self.replay_log_bytes && v.log.len() > 1 {
            let old = v.log.pop_front().expect("non-empty");
            v.log_bytes -= old.op.payload_bytes() + LOG_RECORD_OVERHEAD_BYTES;
            self.corrupt_log.remove(&(vi, old.sequence.0));
        }
    }

    pub fn crash(&mut self, kind: CrashKind, rng: &mut Rng) {
        self.stashes.clear();
        self.failed_pulls.clear();
        assert!(self.alive);
        match self.batch.take() {
            Some(Batch::Records { records, .. }) => {
                // The batch was written (not yet synced) when it was started.
                let keep = match kind {
                    CrashKind::Kill => records.len(),
                    CrashKind::PowerLoss => rng.range(0, records.len() as u64) as usize,
                };
                if keep < records.len() && rng.chance(0.5) {
                    self.torn_records += 1;
                }
                self.unsynced_lost += (records.len() - keep) as u64;
                for record in &records[..keep] {
                    self.apply(record);
                }
            }
            // The metadata write of a newer epoch may or may not have reached the disk; its
            // Welcome never went out.
            Some(Batch::Hello { epoch, .. }) if rng.chance(0.5) => {
                self.epoch = self.epoch.max(epoch);
            }
            Some(Batch::Hello { .. }) | None => {}
        }
        self.unsynced_lost += self.pending.iter().filter(|j| matches!(j, Job::Commit { .. })).count() as u64;
        self.pending.clear();
        self.sessions.clear();
        self.recover_waiters.clear();
        for v in &mut self.vols {
            v.received_through = Sequence::ZERO;
        }
        self.alive = false;
        self.machine_up = kind == CrashKind::Kill;
        self.incarnation += 1;
    }

    pub fn restart(&mut self) {
        assert!(!self.alive);
        self.alive = true;
        self.machine_up = true;
        self.poisoned = false;
    }

    /// A block that holds data, to corrupt.
    pub fn allocated_block(&self, rng: &mut Rng) -> Option<(usize, u64)> {
        let vi = rng.below(self.vols.len() as u64) as usize;
        let blocks: Vec<u64> =
            (0..self.vols[vi].allocated.len() as u64).filter(|b| self.vols[vi].allocated[*b as usize]).collect();
        if blocks.is_empty() {
            return None;
        }
        Some((vi, blocks[rng.below(blocks.len() as u64) as usize]))
    }

    pub fn logged_record(&self, rng: &mut Rng) -> Option<(usize, u64)> {
        let vi = rng.below(self.vols.len() as u64) as usize;
        let log = &self.vols[vi].log;
        if log.is_empty() {
            return None;
        }
        Some((vi, log[rng.below(log.len() as u64) as usize].sequence.0))
    }
}
