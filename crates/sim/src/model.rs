//! The checkers' model of what the host was promised: every request with its submission and
//! reply order, and per sector the write-like requests that touched it. A read is judged
//! against it sector by sector; judgements that depend on whether an acknowledged write was
//! lost in a way the contract allows are kept as suspicions and settled at the end of the run.

use std::collections::{BTreeSet, HashMap};

use proto::{BlockExtent, Epoch, Sequence};

use crate::sector::{decode_sector, SectorValue, SECTOR_BYTES};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Write,
    Trim,
    Zero,
    Read,
    Flush,
    BlockStatus,
    /// A snapshot's record (`Op::Snapshot`, its id the request's): in the ordered stream like
    /// a write, but it changes no sector.
    Snapshot,
    /// A snapshot's deletion record (`Op::SnapshotDelete`).
    SnapshotDelete,
    /// A read of a snapshot (which one: the world keeps it).
    SnapshotRead,
}

impl OpKind {
    pub fn write_like(self) -> bool {
        matches!(self, OpKind::Write | OpKind::Trim | OpKind::Zero)
    }

    /// Sequenced in the volume's stream: written, or a snapshot's record.
    pub fn sequenced(self) -> bool {
        self.write_like() || matches!(self, OpKind::Snapshot | OpKind::SnapshotDelete)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Pending,
    Ok,
    ReadOnly,
    QuorumLost,
    Unavailable,
    /// The host element crashed before answering.
    NoReply,
}

#[derive(Clone, Debug)]
pub struct OpRec {
    pub kind: OpKind,
    pub volume: usize,
    pub first_sector: u64,
    pub sectors: u64,
    pub instance: u32,
    pub submit_step: u64,
    pub reply_step: u64,
    pub outcome: Outcome,
    /// Where it went in the history (write-likes that were accepted and sent).
    pub seq: Option<(Epoch, Sequence)>,
    /// The host element restarted without any element that held it durably (the contract's
    /// "host element and Q up-to-date elements fail together").
    pub at_risk: bool,
    /// Acknowledged, but not in the history the replicas ended with.
    pub lost: bool,
}

impl OpRec {
    fn covers(&self, volume: usize, sector: u64) -> bool {
        self.volume == volume && sector >= self.first_sector && sector < self.first_sector + self.sectors
    }
}

#[derive(Clone, Debug)]
struct Suspicion {
    what: &'static str,
    request: u64,
    volume: usize,
    sector: u64,
    /// `None`: zeroes.
    got: Option<u64>,
}

#[derive(Default)]
pub struct Model {
    ops: Vec<OpRec>,
    /// [volume][sector] → ids of write-like requests touching it, in submission order.
    sector_ops: Vec<Vec<Vec<u64>>>,
    /// Per volume, write-like requests not answered yet.
    unanswered: Vec<BTreeSet<u64>>,
    suspicions: Vec<Suspicion>,
    /// Snapshot reads to judge at the end, once lost writes are known: (read, snapshot, what
    /// each sector held).
    snapshot_reads: Vec<(u64, u64, Vec<SectorValue>)>,
    /// What each sector of a snapshot read first: (snapshot, sector) → value.
    snapshot_seen: HashMap<(u64, u64), SectorValue>,
    step: u64,
    pub violations: Vec<String>,
    pub reads_checked: u64,
    pub sectors_checked: u64,
    pub snapshot_reads_checked: u64,
}

impl Model {
    pub fn new(volumes: usize, sectors: u64) -> Model {
        Model {
            sector_ops: (0..volumes).map(|_| vec![Vec::new(); sectors as usize]).collect(),
            unanswered: vec![BTreeSet::new(); volumes],
            ..Model::default()
        }
    }

    /// A volume created while running; its index.
    pub fn add_volume(&mut self, sectors: u64) -> usize {
        self.sector_ops.push(vec![Vec::new(); sectors as usize]);
        self.unanswered.push(BTreeSet::new());
        self.sector_ops.len() - 1
    }

    /// A volume grown while running: its new sectors were never written.
    pub fn grow_volume(&mut self, volume: usize, sectors: u64) {
        let held = &mut self.sector_ops[volume];
        if (held.len() as u64) < sectors {
            held.resize(sectors as usize, Vec::new());
        }
    }

    /// The sectors of `volume` ever served (its storage volume's size).
    pub fn sectors(&self, volume: usize) -> u64 {
        self.sector_ops[volume].len() as u64
    }

    /// The newest write-like request acknowledged so far that touched `sector` of `volume`.
    pub fn newest_acked(&self, volume: usize, sector: u64) -> Option<u64> {
        self.floor(volume, sector, self.step + 1, None)
    }

    pub fn volumes(&self) -> usize {
        self.sector_ops.len()
    }

    pub fn op(&self, id: u64) -> &OpRec {
        &self.ops[(id - 1) as usize]
    }

    pub fn op_mut(&mut self, id: u64) -> &mut OpRec {
        &mut self.ops[(id - 1) as usize]
    }

    pub fn ops(&self) -> impl Iterator<Item = (u64, &OpRec)> {
        self.ops.iter().enumerate().map(|(i, op)| (i as u64 + 1, op))
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Ids start at 1 (a written sector is never all zero).
    pub fn submit(&mut self, kind: OpKind, volume: usize, first_sector: u64, sectors: u64, instance: u32) -> u64 {
        self.step += 1;
        self.ops.push(OpRec {
            kind,
            volume,
            first_sector,
            sectors,
            instance,
            submit_step: self.step,
            reply_step: u64::MAX,
            outcome: Outcome::Pending,
            seq: None,
            at_risk: false,
            lost: false,
        });
        let id = self.ops.len() as u64;
        if kind.write_like() {
            for s in first_sector..first_sector + sectors {
                self.sector_ops[volume][s as usize].push(id);
            }
            self.unanswered[volume].insert(id);
        }
        id
    }

    pub fn resolve(&mut self, id: u64, outcome: Outcome) {
        self.step += 1;
        let step = self.step;
        let op = self.op_mut(id);
        assert_eq!(op.outcome, Outcome::Pending, "one reply per request");
        op.outcome = outcome;
        op.reply_step = step;
        let (kind, volume) = (op.kind, op.volume);
        if kind.write_like() {
            self.unanswered[volume].remove(&id);
        }
    }

    pub fn violation(&mut self, message: String) {
        self.violations.push(message);
    }

    /// The newest write-like request on the sector acknowledged before `step`.
    /// With `excused`, writes lost (or at risk, when the contract allows losing those) do not
    /// count.
    /// The order in which elements apply writes: by (epoch, sequence), which two host elements
    /// running at once (a takeover) do not give in request order; a request never sent (no
    /// sequence) after every sent one, in request order.
    fn order(&self, id: u64) -> (u64, u64, u64) {
        match self.op(id).seq {
            Some((epoch, sequence)) => (epoch.0, sequence.0, id),
            None => (u64::MAX, u64::MAX, id),
        }
    }

    fn floor(&self, volume: usize, sector: u64, step: u64, excused: Option<bool>) -> Option<u64> {
        self.sector_ops[volume][sector as usize]
            .iter()
            .copied()
            .filter(|&id| {
                let op = self.op(id);
                let skip = match excused {
                    None => false,
                    Some(at_risk_allowed) => op.lost || (at_risk_allowed && op.at_risk),
                };
                op.outcome == Outcome::Ok && op.reply_step < step && !skip
            })
            .max_by_key(|&id| self.order(id))
    }

    /// Zeroes are a valid content: never acknowledged anything, or a trim / write-zeroes no
    /// older than `floor`, submitted before `until`, not refused.
    fn zero_allowed(
        &self,
        volume: usize,
        sector: u64,
        floor: Option<u64>,
        newer_than: Option<u64>,
        until: u64,
    ) -> bool {
        if floor.is_none() && newer_than.is_none() {
            return true;
        }
        let at_least = floor.map(|f| self.order(f));
        let above = newer_than.map(|n| self.order(n));
        self.sector_ops[volume][sector as usize].iter().rev().copied().any(|id| {
            let key = self.order(id);
            let op = self.op(id);
            at_least.is_none_or(|low| key >= low)
                && above.is_none_or(|low| key > low)
                && matches!(op.kind, OpKind::Trim | OpKind::Zero)
                && op.outcome != Outcome::ReadOnly
                && op.submit_step < until
        })
    }

    /// Judge a read's data (`request` is the read).
    pub fn check_read(&mut self, request: u64, data: &[u8]) {
        self.reads_checked += 1;
        let read = self.op(request).clone();
        let until = self.step + 1;
        assert_eq!(data.len() as u64, read.sectors * SECTOR_BYTES, "the core answers with the asked length");
        let mut values = Vec::with_capacity(read.sectors as usize);
        for i in 0..read.sectors {
            let sector = read.first_sector + i;
            let buf = &data[(i * SECTOR_BYTES) as usize..((i + 1) * SECTOR_BYTES) as usize];
            self.sectors_checked += 1;
            let value = decode_sector(buf, read.volume as u32, sector);
            let floor = self.floor(read.volume, sector, read.submit_step, None);
            match &value {
                SectorValue::Garbage(why) => self.violation(format!(
                    "read #{request} returned garbage at volume {} sector {sector}: {why}",
                    read.volume
                )),
                SectorValue::Data(id) => {
                    let id = *id;
                    let valid = id as usize <= self.ops.len() && {
                        let op = self.op(id);
                        op.kind == OpKind::Write
                            && op.covers(read.volume, sector)
                            && op.outcome != Outcome::ReadOnly
                            && op.submit_step < until
                    };
                    if !valid {
                        self.violation(format!(
                            "read #{request} returned at volume {} sector {sector} the data of request #{id}, which never wrote it",
                            read.volume
                        ));
                    } else if floor.is_some_and(|f| self.order(id) < self.order(f)) {
                        self.suspicions.push(Suspicion {
                            what: "stale read",
                            request,
                            volume: read.volume,
                            sector,
                            got: Some(id),
                        });
                    }
                }
                SectorValue::Zero => {
                    if !self.zero_allowed(read.volume, sector, floor, None, until) {
                        self.suspicions.push(Suspicion {
                            what: "stale read",
                            request,
                            volume: read.volume,
                            sector,
                            got: None,
                        });
                    }
                }
            }
            values.push(value);
        }
        // Atomicity: a write seen in one sector is seen (or overwritten) in all its sectors.
        let seen: BTreeSet<u64> =
            values.iter().filter_map(|v| if let SectorValue::Data(id) = v { Some(*id) } else { None }).collect();
        for w in seen {
            if w as usize > self.ops.len() {
                continue;
            }
            let op = self.op(w).clone();
            if op.volume != read.volume {
                continue;
            }
            let start = op.first_sector.max(read.first_sector);
            let end = (op.first_sector + op.sectors).min(read.first_sector + read.sectors);
            for sector in start..end {
                let ok = match &values[(sector - read.first_sector) as usize] {
                    SectorValue::Data(id) => self.order(*id) >= self.order(w),
                    SectorValue::Zero => self.zero_allowed(read.volume, sector, None, Some(w), until),
                    SectorValue::Garbage(_) => true,
                };
                if !ok {
                    self.violation(format!(
                        "torn read #{request}: write #{w} is visible in volume {} sector {} but not in sector {sector}, which holds {:?}",
                        read.volume,
                        (start..end).find(|s| values[(s - read.first_sector) as usize] == SectorValue::Data(w)).unwrap_or(start),
                        values[(sector - read.first_sector) as usize]
                    ));
                    break;
                }
            }
        }
    }

    /// Block status: the extents cover exactly the request, and a hole is never reported
    /// where the data must be something other than zeroes.
    pub fn check_block_status(&mut self, request: u64, extents: &[BlockExtent]) {
        let op = self.op(request).clone();
        let total: u64 = extents.iter().map(|e| e.length_bytes).sum();
        if total != op.sectors * SECTOR_BYTES {
            self.violation(format!(
                "block status #{request}: extents cover {total} bytes of {}",
                op.sectors * SECTOR_BYTES
            ));
            return;
        }
        let until = self.step + 1;
        let mut at = op.first_sector * SECTOR_BYTES;
        for extent in extents {
            if !extent.allocated {
                let first = at.div_ceil(SECTOR_BYTES);
                let end = (at + extent.length_bytes) / SECTOR_BYTES;
                for sector in first..end {
                    let floor = self.floor(op.volume, sector, op.submit_step, None);
                    if !self.zero_allowed(op.volume, sector, floor, None, until) {
                        self.suspicions.push(Suspicion {
                            what: "hole reported over data",
                            request,
                            volume: op.volume,
                            sector,
                            got: None,
                        });
                        break;
                    }
                }
            }
            at += extent.length_bytes;
        }
    }

    /// FLUSH is answered only once every write accepted before it has been answered.
    pub fn check_flush(&mut self, request: u64) {
        let op = self.op(request).clone();
        if let Some(&first) = self.unanswered[op.volume].first() {
            if first < request && self.op(first).instance == op.instance {
                self.violation(format!("flush #{request} answered before the earlier write #{first}"));
            }
        }
    }

    /// A read of snapshot `snapshot` (a `Snapshot` request, acknowledged) returned `data`.
    /// A snapshot never changes: every sector must read as it read the first time. What it
    /// holds is judged at the end ([`Model::settle_snapshots`]).
    pub fn check_snapshot_read(&mut self, request: u64, snapshot: u64, data: &[u8]) {
        self.snapshot_reads_checked += 1;
        let read = self.op(request).clone();
        assert_eq!(data.len() as u64, read.sectors * SECTOR_BYTES, "the core answers with the asked length");
        let mut values = Vec::with_capacity(read.sectors as usize);
        for i in 0..read.sectors {
            let sector = read.first_sector + i;
            let buf = &data[(i * SECTOR_BYTES) as usize..((i + 1) * SECTOR_BYTES) as usize];
            self.sectors_checked += 1;
            let value = decode_sector(buf, read.volume as u32, sector);
            if let SectorValue::Garbage(why) = &value {
                self.violation(format!(
                    "snapshot read #{request} of snapshot #{snapshot} returned garbage at volume {} sector {sector}: {why}",
                    read.volume
                ));
            }
            match self.snapshot_seen.get(&(snapshot, sector)) {
                Some(first) if *first != value => self.violation(format!(
                    "snapshot #{snapshot} changed: volume {} sector {sector} read as {first:?} before, as {value:?} by read #{request}",
                    read.volume
                )),
                Some(_) => {}
                None => {
                    self.snapshot_seen.insert((snapshot, sector), value.clone());
                }
            }
            values.push(value);
        }
        self.snapshot_reads.push((request, snapshot, values));
    }

    /// Judge every snapshot read now that lost writes are known. A sector of snapshot `s`
    /// holds what the volume held when `s`'s record was applied: the newest write-like
    /// request on it ordered before `s` that is in the history. That is at least the newest
    /// such request acknowledged and not lost (or put at risk the way the contract allows:
    /// `at_risk_allowed`), never one ordered after `s`; zeroes only if nothing is that, or a
    /// trim or write-zeroes is.
    pub fn settle_snapshots(&mut self, at_risk_allowed: bool) {
        for (request, snapshot, values) in std::mem::take(&mut self.snapshot_reads) {
            let read = self.op(request).clone();
            if self.op(snapshot).seq.is_none() {
                self.violation(format!("snapshot #{snapshot} was acknowledged but never sent to an element"));
                continue;
            }
            let taken = self.order(snapshot);
            for (i, value) in values.iter().enumerate() {
                let sector = read.first_sector + i as u64;
                let before: Vec<u64> = self.sector_ops[read.volume][sector as usize]
                    .iter()
                    .copied()
                    .filter(|&id| self.op(id).seq.is_some() && self.order(id) < taken)
                    .filter(|&id| self.op(id).outcome != Outcome::ReadOnly)
                    .collect();
                let in_history = |op: &OpRec| op.outcome == Outcome::Ok && !op.lost && !(at_risk_allowed && op.at_risk);
                let floor =
                    before.iter().copied().filter(|&id| in_history(self.op(id))).max_by_key(|&id| self.order(id));
                let ok = match value {
                    SectorValue::Garbage(_) => true, // Told at once.
                    SectorValue::Data(id) => {
                        let id = *id;
                        id as usize <= self.ops.len() && before.contains(&id) && self.op(id).kind == OpKind::Write && {
                            floor.is_none_or(|f| self.order(id) >= self.order(f))
                        }
                    }
                    SectorValue::Zero => {
                        floor.is_none()
                            || before.iter().any(|&id| {
                                matches!(self.op(id).kind, OpKind::Trim | OpKind::Zero)
                                    && floor.is_none_or(|f| self.order(id) >= self.order(f))
                            })
                    }
                };
                if !ok {
                    let newest = floor.map_or("nothing".to_string(), |f| format!("write #{f} ({:?})", self.op(f).seq));
                    self.violation(format!(
                        "snapshot #{snapshot} ({:?}) read by #{request}: volume {} sector {sector} holds {value:?}, but the newest write-like request before the snapshot is {newest}",
                        self.op(snapshot).seq,
                        read.volume,
                    ));
                    break;
                }
            }
        }
    }

    pub fn mark_lost(&mut self, id: u64) {
        self.op_mut(id).lost = true;
    }

    /// Settle the suspicions now that lost writes are known: a stale read explained by a lost
    /// write is that loss (counted once, elsewhere); so is one explained by a write put at
    /// risk the way the contract allows (`at_risk_allowed`: Q ≤ N/2), even if it came back
    /// later. Anything else is a violation.
    pub fn settle(&mut self, at_risk_allowed: bool) {
        let suspicions = std::mem::take(&mut self.suspicions);
        for s in suspicions {
            let read = self.op(s.request).clone();
            let floor = self.floor(s.volume, s.sector, read.submit_step, Some(at_risk_allowed));
            let explained = match s.got {
                Some(id) => floor.is_none_or(|f| self.order(id) >= self.order(f)),
                None => self.zero_allowed(s.volume, s.sector, floor, None, read.reply_step),
            };
            if !explained {
                let newest = floor.expect("a floor when not explained");
                self.violation(format!(
                    "{} #{}: volume {} sector {} returned {} although write #{newest} ({:?}) was acknowledged before the request",
                    s.what,
                    s.request,
                    s.volume,
                    s.sector,
                    s.got.map_or("zeroes".to_string(), |id| format!("the data of #{id}")),
                    self.op(newest).seq,
                ));
            }
        }
    }
}
