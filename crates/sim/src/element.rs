//! A simulated element: the real [`ElementCore`] (every rule of the element) over
//! [`MemStorage`] (the disk), with what `crates/shell/src/element.rs` does around it done here
//! in simulated time. Storage jobs take a simulated fdatasync and are reported to the core only
//! once durable; read-only requests are answered by the same [`starfish_core::serve`] as the
//! real shell's, after a simulated disk delay; peer sessions (a replay's source) and the block
//! copy of a full recovery are carried by the world.

use std::collections::{BTreeMap, BTreeSet};

use proto::{ElementMessage, Epoch, HostMessage, Sequence, VolumeId};
use starfish_core::{
    ElementAction, ElementConfig, ElementCore, ElementStorage, LocalVolume, PeerId, Refusal, SessionId, StorageDone,
    StorageJob, Time,
};

use crate::options::Broken;
use crate::rng::Rng;
use starfish_core::mem_storage::{MemStorage, PowerLoss, VolumeCopy};

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
    /// Schedule the end of the fdatasync of the storage job under way.
    SyncAfter {
        delay_us: u64,
    },
    /// The element ends this session (after a refusal).
    Close {
        session: u64,
    },
    /// A record was refused. `ordering`: the first refusal on this session and volume for
    /// arriving out of order or from an older epoch than the volume holds.
    Refused {
        session: u64,
        reason: String,
        ordering: bool,
        /// The record came from a peer's replay log (a replay recovery), not from the host
        /// element.
        replayed: bool,
    },
    /// Open a session with the peer named `address` and say `hello` on it.
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
    /// A full recovery asks for a copy of a peer's volume (the world takes it as one snapshot
    /// at the peer's applied sequence).
    Copy {
        session: u64,
        epoch: Epoch,
        host: proto::HostId,
        volume: VolumeId,
        source: String,
    },
    /// Call [`Element::timeout`] at this time.
    TimerAt {
        at: Time,
    },
}

pub struct Element {
    pub name: String,
    pub alive: bool,
    /// False while powered off: connection attempts time out instead of being refused.
    pub machine_up: bool,
    pub incarnation: u64,
    pub storage: MemStorage,
    core: ElementCore,
    config: ElementConfig,
    sessions: BTreeSet<u64>,
    /// The storage job under way, answered when its sync completes.
    storage_done: Option<StorageDone>,
    /// Full recoveries under way: local volume → the ordering session's volume number.
    copies: BTreeMap<u32, VolumeId>,
    /// (session, volume) that had a record refused: only the first says something about the
    /// order the host element sent.
    refused: BTreeSet<(u64, u32)>,
    broken: Broken,
    /// Ack-before-sync variant: per volume, the newest sequence received in order.
    received_through: Vec<Sequence>,
    /// Volumes found damaged (a block failing its checksum) so far: each turns a repair.
    pub damage_found: u64,
}

impl Element {
    pub fn new(
        name: String,
        element_id: u64,
        volumes: &[proto::VolumeSpec],
        largest: u64,
        fsync_us: u64,
        replay_log_bytes: u64,
        broken: Broken,
    ) -> Element {
        let fencing = broken != Broken::NoFencing;
        let largest = volumes.iter().map(|v| v.size_bytes).max().unwrap_or(0).max(largest);
        let mut storage = MemStorage::new(largest, fsync_us, replay_log_bytes, fencing);
        storage.snapshots_share_live = broken == Broken::SnapshotSharesLive;
        storage.clones_start_empty = broken == Broken::CloneStartsEmpty;
        storage.forget_copy_state = broken == Broken::ForgetCopyState;
        for v in volumes {
            storage.add_volume(v.name.clone(), v.size_bytes);
        }
        let lease_ms = if broken == Broken::NoReadLease { 0 } else { starfish_core::limits::LEASE_MS_DEFAULT };
        let check_roles = broken != Broken::NoRoleCheck;
        let config = ElementConfig { fencing, element_id, lease_ms, check_roles, ..ElementConfig::default() };
        let core = Self::boot(config, &storage);
        Element {
            name,
            alive: true,
            machine_up: true,
            incarnation: 1,
            storage,
            core,
            config,
            sessions: BTreeSet::new(),
            storage_done: None,
            copies: BTreeMap::new(),
            refused: BTreeSet::new(),
            broken,
            received_through: vec![Sequence::ZERO; volumes.len()],
            damage_found: 0,
        }
    }

    /// A core for what storage holds, as the real element starts.
    fn boot(config: ElementConfig, storage: &MemStorage) -> ElementCore {
        let volumes = (0..storage.vols.len())
            .map(|i| {
                let v = &storage.vols[i];
                let size_bytes = if v.removed || v.snapshot_of.is_some() { 0 } else { v.data.len() as u64 };
                let spec = proto::VolumeSpec { name: v.name.clone(), size_bytes, clone_of: None, at_least: false };
                (spec, storage.info(LocalVolume(i as u32)))
            })
            .collect();
        ElementCore::new(config, storage.epoch, storage.holder, volumes)
    }

    pub fn has_session(&self, session: u64) -> bool {
        self.sessions.contains(&session)
    }

    /// `role`: who opened it (a host element, or a peer's recovery), as TLS would tell.
    pub fn open_session(&mut self, now: Time, session: u64, role: starfish_core::SessionRole) {
        assert!(self.alive);
        self.sessions.insert(session);
        self.core.handle_session_opened(now, SessionId(session), role);
    }

    /// What the element answers to `Observe` now (a standby's question).
    pub fn observe(&mut self, now: Time) -> (proto::Epoch, proto::HostId, u64) {
        self.core.observe(now)
    }

    pub fn close_session(&mut self, now: Time, rng: &mut Rng, session: u64, out: &mut Vec<Out>) {
        if self.sessions.remove(&session) {
            self.core.handle_session_closed(now, SessionId(session));
            self.drain(now, rng, out);
        }
    }

    pub fn sessions(&self) -> Vec<u64> {
        self.sessions.iter().copied().collect()
    }

    fn read_delay_us(&self, rng: &mut Rng, bytes: u64) -> u64 {
        (rng.range(20, 400) + bytes / 1000) * self.storage.slow_disk_factor
    }

    pub fn handle(&mut self, now: Time, rng: &mut Rng, session: u64, message: HostMessage, out: &mut Vec<Out>) {
        assert!(self.alive && self.sessions.contains(&session));
        if let (Broken::AckBeforeSync, HostMessage::Apply(record)) = (self.broken, &message) {
            // The deliberately broken shell: acknowledges what it received in order, before
            // the core has it on stable storage.
            let vi = record.volume.0 as usize;
            if vi < self.received_through.len() {
                let received = &mut self.received_through[vi];
                *received = (*received).max(self.storage.vols[vi].applied());
                if record.sequence == received.next() {
                    *received = record.sequence;
                    let message = ElementMessage::Applied { volume: record.volume, sequence: record.sequence };
                    out.push(Out::Send { session, message, delay_us: 0 });
                }
            }
        }
        self.core.handle_host_message(now, SessionId(session), message);
        self.drain(now, rng, out);
    }

    /// A peer answered on a session this element opened.
    pub fn peer_message(
        &mut self,
        now: Time,
        rng: &mut Rng,
        peer: PeerId,
        message: ElementMessage,
        out: &mut Vec<Out>,
    ) {
        self.core.handle_peer_message(now, peer, message);
        self.drain(now, rng, out);
    }

    pub fn peer_closed(&mut self, now: Time, rng: &mut Rng, peer: PeerId, reason: String, out: &mut Vec<Out>) {
        self.core.handle_peer_closed(now, peer, reason);
        self.drain(now, rng, out);
    }

    pub fn timeout(&mut self, now: Time, rng: &mut Rng, out: &mut Vec<Out>) {
        self.core.handle_timeout(now);
        self.drain(now, rng, out);
    }

    /// Tell the core of the volumes storage found damaged.
    fn report_damage(&mut self, now: Time) {
        for damaged in self.storage.take_damaged() {
            self.damage_found += 1;
            self.core.handle_volume_damaged(now, damaged);
        }
    }

    /// The fdatasync of the storage job under way completed: the core hears of it now.
    pub fn sync_done(&mut self, now: Time, rng: &mut Rng, out: &mut Vec<Out>) {
        self.storage.sync();
        let done = self.storage_done.take().expect("a sync completes a storage job");
        self.core.handle_storage_done(now, done);
        self.report_damage(now);
        self.drain(now, rng, out);
    }

    /// Whether records of volume `vi` wait for storage (a copy is installed only when none
    /// do, as the real store's lock order has it).
    pub fn commits_pending(&self, vi: usize) -> bool {
        self.core.commits_pending(LocalVolume(vi as u32)) || self.storage.unsynced_records_of(vi)
    }

    /// The world fetched the peer's volume for a full recovery: install it durably.
    pub fn install_copy(&mut self, now: Time, rng: &mut Rng, volume: VolumeId, copy: VolumeCopy, out: &mut Vec<Out>) {
        let local = LocalVolume(volume.0);
        let Some(session_volume) = self.copies.remove(&volume.0) else { return };
        self.storage.install_copy(volume.0 as usize, copy);
        let v = &self.storage.vols[volume.0 as usize];
        let bytes = v.data.len() as u64;
        let copied_bytes = v.allocated.iter().filter(|a| **a).count() as u64 * proto::BLOCK_BYTES;
        let progress = ElementMessage::CopyProgress {
            volume: session_volume,
            done_bytes: bytes,
            total_bytes: bytes,
            copied_bytes,
        };
        self.core.handle_copy_progress(now, local, progress);
        let info = self.storage.info(local);
        self.core.handle_copy_done(now, local, session_volume, info, Ok(info.applied));
        self.drain(now, rng, out);
    }

    /// The world could not fetch the peer's volume: the copy ends with what the element had.
    pub fn copy_failed(&mut self, now: Time, rng: &mut Rng, volume: VolumeId, reason: String, out: &mut Vec<Out>) {
        let Some(session_volume) = self.copies.remove(&volume.0) else { return };
        let local = LocalVolume(volume.0);
        // What it copied so far stays over its old blocks, and the copy state with it.
        self.storage.interrupt_copy(volume.0 as usize);
        let info = self.storage.info(local);
        self.core.handle_copy_done(now, local, session_volume, info, Err(reason));
        self.drain(now, rng, out);
    }

    /// Carry out what the core asks, as the real shell does.
    fn drain(&mut self, now: Time, rng: &mut Rng, out: &mut Vec<Out>) {
        self.core.assert_invariants();
        while let Some(action) = self.core.poll_action() {
            match action {
                ElementAction::Send { session, message } => {
                    out.push(Out::Send { session: session.0, message, delay_us: 0 })
                }
                ElementAction::Close { session } => out.push(Out::Close { session: session.0 }),
                ElementAction::EnsureVolumes { session, specs } => {
                    let result = specs
                        .iter()
                        .map(|spec| {
                            let volume = self.storage.ensure_volume(spec)?;
                            Ok((volume, self.storage.info(volume)))
                        })
                        .collect::<Result<Vec<_>, String>>();
                    self.core.handle_volumes_ensured(now, session, result);
                }
                ElementAction::CheckVolumes { session, request_id, specs } => {
                    let result = self.storage.check_new_volumes(&specs);
                    self.core.handle_volumes_checked(now, session, request_id, result);
                }
                ElementAction::Storage(job) => {
                    assert!(self.storage_done.is_none(), "one storage job at a time");
                    let result = match &job {
                        StorageJob::AdoptEpoch(epoch, host) => self.storage.adopt_epoch(*epoch, *host).map(|()| None),
                        StorageJob::Commit(batch) => self.storage.commit(batch).map(Some),
                        StorageJob::RemoveVolumes(volumes) => {
                            volumes.iter().try_for_each(|v| self.storage.remove_volume(*v)).map(|()| None)
                        }
                        StorageJob::ResizeVolumes(volumes) => volumes
                            .iter()
                            .try_for_each(|(v, size_bytes)| self.storage.resize_volume(*v, *size_bytes))
                            .map(|()| None),
                    };
                    match (job, result) {
                        // Refused at once (a full disk): no sync to wait for.
                        (StorageJob::AdoptEpoch(..), Err(reason)) => {
                            self.core.handle_storage_done(now, StorageDone::AdoptEpoch(Err(reason)))
                        }
                        (StorageJob::Commit(_), Err(reason)) => {
                            self.core.handle_storage_done(now, StorageDone::Commit(Err(reason)))
                        }
                        (StorageJob::RemoveVolumes(_), Err(reason)) => {
                            self.core.handle_storage_done(now, StorageDone::RemoveVolumes(Err(reason)))
                        }
                        (StorageJob::ResizeVolumes(_), Err(reason)) => {
                            self.core.handle_storage_done(now, StorageDone::ResizeVolumes(Err(reason)))
                        }
                        (StorageJob::ResizeVolumes(_), Ok(_)) => {
                            self.storage_done = Some(StorageDone::ResizeVolumes(Ok(())));
                            out.push(Out::SyncAfter { delay_us: self.storage.sync_delay_us() });
                        }
                        (StorageJob::RemoveVolumes(_), Ok(_)) => {
                            self.storage_done = Some(StorageDone::RemoveVolumes(Ok(())));
                            out.push(Out::SyncAfter { delay_us: self.storage.sync_delay_us() });
                        }
                        (StorageJob::AdoptEpoch(..), Ok(_)) => {
                            self.storage_done = Some(StorageDone::AdoptEpoch(Ok(())));
                            out.push(Out::SyncAfter { delay_us: self.storage.sync_delay_us() });
                        }
                        (StorageJob::Commit(_), Ok(done)) => {
                            self.storage_done = Some(StorageDone::Commit(Ok(done.expect("a commit's outcome"))));
                            out.push(Out::SyncAfter { delay_us: self.storage.sync_delay_us() });
                        }
                    }
                }
                ElementAction::Serve { session, volume, request } => {
                    let message = starfish_core::serve(&self.storage, volume, request);
                    self.report_damage(now);
                    let bytes = match &message {
                        ElementMessage::ReadReply { result: Ok(read), .. } => read.data.len() as u64,
                        ElementMessage::LogRecords { result: Ok(records), .. } => {
                            records.iter().map(|r| r.op.payload_bytes()).sum()
                        }
                        _ => 0,
                    };
                    let delay_us = self.read_delay_us(rng, bytes);
                    out.push(Out::Send { session: session.0, message, delay_us });
                }
                ElementAction::ConnectPeer { peer, address, hello } => {
                    out.push(Out::ConnectPeer { peer, address, hello })
                }
                ElementAction::SendPeer { peer, message } => out.push(Out::SendPeer { peer, message }),
                ElementAction::ClosePeer { peer } => out.push(Out::ClosePeer { peer }),
                ElementAction::StartCopy { session, session_volume, volume, epoch, host, source, .. } => {
                    self.copies.insert(volume.0, session_volume);
                    out.push(Out::Copy { session: session.0, epoch, host, volume: VolumeId(volume.0), source });
                }
                ElementAction::Refused { session, volume, sequence, refusal, replayed } => {
                    let first = self.refused.insert((session.0, volume.0));
                    let ordering = first && matches!(refusal, Refusal::Gap | Refusal::StaleEpoch);
                    let reason = format!("volume {}: sequence {sequence} refused: {refusal:?}", volume.0);
                    out.push(Out::Refused { session: session.0, reason, ordering, replayed });
                }
                ElementAction::Log { message, .. } => {
                    // `SIM_ELEMENT_LOG=1`: the element cores' log lines go to the trace (stderr).
                    if std::env::var_os("SIM_ELEMENT_LOG").is_some() {
                        eprintln!("  {:.6} [{}] {message}", now.0 as f64 / 1e6, self.name);
                    }
                }
            }
        }
        self.core.assert_invariants();
        if let Some(at) = self.core.poll_timeout() {
            out.push(Out::TimerAt { at });
        }
    }

    pub fn crash(&mut self, kind: CrashKind, rng: &mut Rng) {
        assert!(self.alive);
        self.storage_done = None;
        let power_loss = (kind == CrashKind::PowerLoss).then(|| {
            let records_kept = rng.range(0, self.storage.unsynced_records() as u64) as usize;
            PowerLoss { records_kept, torn: rng.chance(0.5), epoch_kept: rng.chance(0.5) }
        });
        self.storage.crash(power_loss);
        self.sessions.clear();
        self.copies.clear();
        self.received_through.iter_mut().for_each(|r| *r = Sequence::ZERO);
        self.alive = false;
        self.machine_up = kind == CrashKind::Kill;
        self.incarnation += 1;
    }

    /// A block that holds data, to corrupt.
    pub fn allocated_block(&self, rng: &mut Rng) -> Option<(usize, u64)> {
        let vi = rng.below(self.storage.vols.len() as u64) as usize;
        let blocks = self.storage.allocated_blocks(vi);
        (!blocks.is_empty()).then(|| (vi, blocks[rng.below(blocks.len() as u64) as usize]))
    }

    /// A record of a replay log, to corrupt.
    pub fn logged_record(&self, rng: &mut Rng) -> Option<(usize, u64)> {
        let vi = rng.below(self.storage.vols.len() as u64) as usize;
        let sequences = self.storage.logged_sequences(vi);
        (!sequences.is_empty()).then(|| (vi, sequences[rng.below(sequences.len() as u64) as usize]))
    }

    pub fn restart(&mut self) {
        assert!(!self.alive);
        self.alive = true;
        self.machine_up = true;
        self.storage.poisoned = false;
        self.core = Self::boot(self.config, &self.storage);
    }
}
