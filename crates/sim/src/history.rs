//! Histories recorded against real StarFish processes (`tests/test_fault_history.py`), judged
//! by the simulator's own [`Model`]: the same read, flush, block-status and settle checks, the
//! same self-describing sectors ([`crate::sector`]). Only the source of the history differs:
//! here a client that timestamped every request when it sent it and when the answer came.
//!
//! # Format (text, one request per line)
//!
//! ```text
//! starfish-history 1 volumes=1 volume_bytes=4194304
//! # comment
//! ID INSTANCE KIND VOLUME OFFSET LENGTH SUBMIT_NS REPLY_NS OUTCOME [data=AT] [extents=L:a,L:h,…] [final]
//! ```
//!
//! - `ID`: 1, 2, 3… in submission order (by `SUBMIT_NS`, ties by id): the id a write puts in
//!   its sectors, and the model's id for the request.
//! - `INSTANCE`: the NBD connection (a new one after a reconnect); informative.
//! - `KIND`: `write`, `trim`, `zero` (write-zeroes), `read`, `flush`, `status` (block status).
//! - `OFFSET`, `LENGTH`: bytes, multiples of 512 (0 0 for a flush).
//! - `SUBMIT_NS`, `REPLY_NS`: monotonic nanoseconds taken before the request was sent and after
//!   its answer arrived (`-`: no answer). Both err on the safe side — the real submission is
//!   later, the real answer earlier — so "acknowledged before that read was sent" is never
//!   claimed when it did not hold.
//! - `OUTCOME`: `ok`, an errno name (`EPERM`: refused, read-only — never applied; `EIO`: failed,
//!   maybe applied; anything else: the connection went, maybe applied), or `none`.
//! - `data=AT`: a successful read's data is `LENGTH` bytes at byte `AT` of the data file (the
//!   history's path with `.data` appended), raw, so the sectors are decoded here.
//! - `extents=`: a successful block status, `LENGTH:a` allocated or `LENGTH:h` hole.
//! - `final`: a read of the read-back after every fault healed (figures only).
//!
//! Acknowledged writes the replicas lost show up as stale reads in the final read-back: it is
//! sent after every write was answered, so each sector must hold its newest acknowledged write
//! or something newer.
//!
//! # What the recorder must guarantee, and what is not judged
//!
//! The model takes a higher id to be a newer write wherever two writes overlap, as it is in the
//! simulator, whose hosts hand each request to the core at once. NBD orders nothing among the
//! requests in flight, on one connection or several (StarFish's server runs each request as its
//! own task), so the recorder never has two overlapping write-likes in flight at once: of two
//! overlapping ones, the later was sent after the earlier was answered, and the core sequenced
//! them in id order. Reads are sent freely.
//!
//! For the same reason a FLUSH's reply order is not judged here: over NBD a flush covers the
//! writes *completed* before it was sent (durable once acknowledged, in StarFish), not those
//! still in flight. The simulator judges the core's stronger rule (a flush waits for every
//! write the core accepted before it).

use std::fmt;

use proto::BlockExtent;

use crate::model::{Model, OpKind, Outcome};
use crate::report::json_string;
use crate::sector::{decode_sector, SectorValue, SECTOR_BYTES};

const HEADER: &str = "starfish-history";
const VERSION: u32 = 1;
/// Sectors per volume the model indexes (64 MiB): a bound on the checker's memory.
const VOLUME_SECTORS_MAX: u64 = 1 << 17;
const VOLUMES_MAX: usize = 16;

/// One recorded request.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryOp {
    pub id: u64,
    pub instance: u32,
    pub kind: OpKind,
    pub volume: usize,
    pub offset_bytes: u64,
    pub length_bytes: u64,
    pub submit_ns: u64,
    pub reply_ns: Option<u64>,
    pub outcome: Outcome,
    /// The errno name as recorded (`ok`, `EIO`, …).
    pub outcome_name: String,
    pub data_at: Option<u64>,
    pub extents: Option<Vec<BlockExtent>>,
    pub final_read: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct History {
    pub volumes: usize,
    pub volume_bytes: u64,
    /// In id order.
    pub ops: Vec<HistoryOp>,
}

/// A history the checker cannot judge (a recorder bug or a damaged file, not a verdict on
/// StarFish).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HistoryError {
    Header(String),
    Line { line: usize, message: String },
    Inconsistent(String),
}

impl fmt::Display for HistoryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HistoryError::Header(m) => write!(f, "history header: {m}"),
            HistoryError::Line { line, message } => write!(f, "history line {line}: {message}"),
            HistoryError::Inconsistent(m) => write!(f, "history: {m}"),
        }
    }
}

impl std::error::Error for HistoryError {}

fn outcome_of(name: &str) -> Outcome {
    match name {
        "ok" => Outcome::Ok,
        "EPERM" => Outcome::ReadOnly,
        "EIO" => Outcome::QuorumLost,
        _ => Outcome::NoReply,
    }
}

fn kind_of(name: &str) -> Option<OpKind> {
    Some(match name {
        "write" => OpKind::Write,
        "trim" => OpKind::Trim,
        "zero" => OpKind::Zero,
        "read" => OpKind::Read,
        "flush" => OpKind::Flush,
        "status" => OpKind::BlockStatus,
        _ => return None,
    })
}

fn number(word: &str, what: &str) -> Result<u64, String> {
    word.parse::<u64>().map_err(|e| format!("{what} {word:?}: {e}"))
}

fn parse_extents(list: &str) -> Result<Vec<BlockExtent>, String> {
    if list.is_empty() {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|e| {
            let (length, state) = e.split_once(':').ok_or(format!("extent {e:?}: expected LENGTH:a or LENGTH:h"))?;
            let allocated = match state {
                "a" => true,
                "h" => false,
                _ => return Err(format!("extent {e:?}: state must be a or h")),
            };
            Ok(BlockExtent { length_bytes: number(length, "extent length")?, allocated })
        })
        .collect()
}

fn parse_op(line: &str) -> Result<HistoryOp, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    if words.len() < 9 {
        return Err(format!("expected at least 9 fields, found {}", words.len()));
    }
    let kind = kind_of(words[2]).ok_or(format!("unknown kind {:?}", words[2]))?;
    let reply_ns = match words[7] {
        "-" => None,
        w => Some(number(w, "reply time")?),
    };
    let outcome_name = words[8].to_string();
    let outcome = if reply_ns.is_none() {
        if outcome_name != "none" {
            return Err("a request without a reply time must have outcome none".into());
        }
        Outcome::NoReply
    } else {
        if outcome_name == "none" {
            return Err("a request with a reply time needs an outcome".into());
        }
        outcome_of(&outcome_name)
    };
    let mut op = HistoryOp {
        id: number(words[0], "id")?,
        instance: u32::try_from(number(words[1], "instance")?).map_err(|_| "instance too large".to_string())?,
        kind,
        volume: number(words[3], "volume")? as usize,
        offset_bytes: number(words[4], "offset")?,
        length_bytes: number(words[5], "length")?,
        submit_ns: number(words[6], "submit time")?,
        reply_ns,
        outcome,
        outcome_name,
        data_at: None,
        extents: None,
        final_read: false,
    };
    for word in &words[9..] {
        if let Some(at) = word.strip_prefix("data=") {
            op.data_at = Some(number(at, "data offset")?);
        } else if let Some(list) = word.strip_prefix("extents=") {
            op.extents = Some(parse_extents(list)?);
        } else if *word == "final" {
            op.final_read = true;
        } else {
            return Err(format!("unknown field {word:?}"));
        }
    }
    Ok(op)
}

impl History {
    pub fn parse(text: &str) -> Result<History, HistoryError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
        let (_, header) = lines.next().ok_or(HistoryError::Header("empty file".into()))?;
        let words: Vec<&str> = header.split_whitespace().collect();
        if words.first() != Some(&HEADER) {
            return Err(HistoryError::Header(format!("expected {HEADER:?}, found {header:?}")));
        }
        if words.get(1) != Some(&VERSION.to_string().as_str()) {
            return Err(HistoryError::Header(format!("version {:?}, this checker reads {VERSION}", words.get(1))));
        }
        let mut volumes = None;
        let mut volume_bytes = None;
        for word in &words[2..] {
            let (key, value) =
                word.split_once('=').ok_or(HistoryError::Header(format!("expected KEY=VALUE: {word:?}")))?;
            let value = number(value, key).map_err(HistoryError::Header)?;
            match key {
                "volumes" => volumes = Some(value as usize),
                "volume_bytes" => volume_bytes = Some(value),
                _ => return Err(HistoryError::Header(format!("unknown key {key:?}"))),
            }
        }
        let volumes = volumes.ok_or(HistoryError::Header("volumes= missing".into()))?;
        let volume_bytes = volume_bytes.ok_or(HistoryError::Header("volume_bytes= missing".into()))?;
        if volumes == 0 || volumes > VOLUMES_MAX {
            return Err(HistoryError::Header(format!("volumes={volumes}: 1 to {VOLUMES_MAX}")));
        }
        if volume_bytes == 0 || volume_bytes % SECTOR_BYTES != 0 || volume_bytes / SECTOR_BYTES > VOLUME_SECTORS_MAX {
            return Err(HistoryError::Header(format!(
                "volume_bytes={volume_bytes}: a multiple of {SECTOR_BYTES} up to {} bytes",
                VOLUME_SECTORS_MAX * SECTOR_BYTES
            )));
        }
        let mut ops = Vec::new();
        for (line, text) in lines {
            let op = parse_op(text).map_err(|message| HistoryError::Line { line, message })?;
            let bad = |message: String| HistoryError::Line { line, message };
            if op.volume >= volumes {
                return Err(bad(format!("volume {} of {volumes}", op.volume)));
            }
            if op.offset_bytes % SECTOR_BYTES != 0 || op.length_bytes % SECTOR_BYTES != 0 {
                return Err(bad("offset and length must be multiples of 512".into()));
            }
            if op.offset_bytes.checked_add(op.length_bytes).is_none_or(|end| end > volume_bytes) {
                return Err(bad("beyond the end of the volume".into()));
            }
            if op.kind != OpKind::Flush && op.length_bytes == 0 {
                return Err(bad("length 0".into()));
            }
            if op.reply_ns.is_some_and(|r| r < op.submit_ns) {
                return Err(bad("answered before it was sent".into()));
            }
            let answered_ok = op.outcome == Outcome::Ok;
            if (op.kind == OpKind::Read && answered_ok) != op.data_at.is_some() {
                return Err(bad("data= goes with (and only with) a successful read".into()));
            }
            if (op.kind == OpKind::BlockStatus && answered_ok) != op.extents.is_some() {
                return Err(bad("extents= goes with (and only with) a successful block status".into()));
            }
            if op.final_read && op.kind != OpKind::Read {
                return Err(bad("only a read can be final".into()));
            }
            ops.push(op);
        }
        ops.sort_by_key(|op| op.id);
        for (i, op) in ops.iter().enumerate() {
            if op.id != i as u64 + 1 {
                return Err(HistoryError::Inconsistent(format!(
                    "ids must be 1..{} without gaps or repeats; found {} at position {}",
                    ops.len(),
                    op.id,
                    i + 1
                )));
            }
        }
        for pair in ops.windows(2) {
            if pair[1].submit_ns < pair[0].submit_ns {
                return Err(HistoryError::Inconsistent(format!(
                    "ids are not in submission order: #{} sent at {} ns, #{} at {} ns",
                    pair[0].id, pair[0].submit_ns, pair[1].id, pair[1].submit_ns
                )));
            }
        }
        Ok(History { volumes, volume_bytes, ops })
    }
}

/// What [`check`] found.
#[derive(Clone, Debug, Default)]
pub struct HistoryReport {
    pub ops: u64,
    pub writes: u64,
    pub writes_acked: u64,
    /// Write-likes answered with an error or not at all, by outcome name.
    pub writes_failed: std::collections::BTreeMap<String, u64>,
    pub reads_checked: u64,
    pub sectors_checked: u64,
    pub final_sectors_checked: u64,
    /// Answered ok; not judged (see the module's documentation).
    pub flushes: u64,
    pub block_status_checked: u64,
    pub unanswered: u64,
    /// Acknowledged writes the final read-back did not find (every one is also a violation).
    pub acked_writes_lost: u64,
    pub violations: Vec<String>,
}

impl HistoryReport {
    pub fn text(&self) -> String {
        let failed: Vec<String> = self.writes_failed.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let mut s = format!(
            "{} requests checked: {} write-likes ({} acknowledged; failed: {}), {} reads ({} sectors, {} in the final read-back), {} flushes (not judged), {} block status; {} unanswered\nacknowledged writes lost: {}\nviolations: {}\n",
            self.ops,
            self.writes,
            self.writes_acked,
            if failed.is_empty() { "none".to_string() } else { failed.join(", ") },
            self.reads_checked,
            self.sectors_checked,
            self.final_sectors_checked,
            self.flushes,
            self.block_status_checked,
            self.unanswered,
            self.acked_writes_lost,
            self.violations.len()
        );
        for v in &self.violations {
            s.push_str(&format!("  violation: {v}\n"));
        }
        s
    }

    pub fn json(&self) -> String {
        let failed: Vec<String> = self.writes_failed.iter().map(|(k, v)| format!("{}:{v}", json_string(k))).collect();
        let violations: Vec<String> = self.violations.iter().map(|v| json_string(v)).collect();
        format!(
            "{{\"ops\":{},\"writes\":{},\"writes_acked\":{},\"writes_failed\":{{{}}},\"reads_checked\":{},\"sectors_checked\":{},\"final_sectors_checked\":{},\"flushes\":{},\"block_status_checked\":{},\"unanswered\":{},\"acked_writes_lost\":{},\"violations\":{},\"violation_messages\":[{}]}}",
            self.ops,
            self.writes,
            self.writes_acked,
            failed.join(","),
            self.reads_checked,
            self.sectors_checked,
            self.final_sectors_checked,
            self.flushes,
            self.block_status_checked,
            self.unanswered,
            self.acked_writes_lost,
            self.violations.len(),
            violations.join(",")
        )
    }
}

/// Judge `history`, whose reads' data are in `data`, with the simulator's model. A panic in
/// the model is reported as a violation, not propagated.
pub fn check(history: &History, data: &[u8]) -> Result<HistoryReport, HistoryError> {
    for op in &history.ops {
        if let Some(at) = op.data_at {
            if at.checked_add(op.length_bytes).is_none_or(|end| end > data.len() as u64) {
                return Err(HistoryError::Inconsistent(format!(
                    "read #{} has data at {at}+{} beyond the data file ({} bytes)",
                    op.id,
                    op.length_bytes,
                    data.len()
                )));
            }
        }
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| judge(history, data))) {
        Ok(report) => Ok(report),
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Ok(HistoryReport {
                ops: history.ops.len() as u64,
                violations: vec![format!("panic in the checker: {message}")],
                ..HistoryReport::default()
            })
        }
    }
}

/// Clip the extents to the request; cover what the server did not describe (NBD lets it
/// answer for less) as allocated, which claims nothing.
fn extents_for_request(extents: &[BlockExtent], length_bytes: u64) -> Vec<BlockExtent> {
    let mut out = Vec::new();
    let mut covered = 0;
    for e in extents {
        if covered >= length_bytes {
            break;
        }
        let length = e.length_bytes.min(length_bytes - covered);
        if length > 0 {
            out.push(BlockExtent { length_bytes: length, allocated: e.allocated });
        }
        covered += length;
    }
    if covered < length_bytes {
        out.push(BlockExtent { length_bytes: length_bytes - covered, allocated: true });
    }
    out
}

fn judge(history: &History, data: &[u8]) -> HistoryReport {
    let mut model = Model::new(history.volumes, history.volume_bytes / SECTOR_BYTES);
    let mut report = HistoryReport { ops: history.ops.len() as u64, ..HistoryReport::default() };
    // Every submission and answer, in time order; at equal times submissions first (the
    // cautious order: a read sent at the instant a write was answered does not have to see it).
    let mut events: Vec<(u64, u8, u64)> = Vec::with_capacity(history.ops.len() * 2);
    for op in &history.ops {
        events.push((op.submit_ns, 0, op.id));
        if let Some(r) = op.reply_ns {
            events.push((r, 1, op.id));
        }
    }
    events.sort_unstable();
    for (_, phase, id) in events {
        let op = &history.ops[(id - 1) as usize];
        let first_sector = op.offset_bytes / SECTOR_BYTES;
        let sectors = op.length_bytes / SECTOR_BYTES;
        if phase == 0 {
            let got = model.submit(op.kind, op.volume, first_sector, sectors, op.instance);
            assert_eq!(got, id, "ids were checked to follow submission order");
            continue;
        }
        if op.outcome == Outcome::Ok {
            match op.kind {
                OpKind::Read => {
                    let at = op.data_at.expect("checked at parse") as usize;
                    let buf = &data[at..at + op.length_bytes as usize];
                    model.check_read(id, buf);
                    report.sectors_checked += sectors;
                    if op.final_read {
                        report.final_sectors_checked += sectors;
                    }
                }
                OpKind::BlockStatus => {
                    let extents =
                        extents_for_request(op.extents.as_deref().expect("checked at parse"), op.length_bytes);
                    model.check_block_status(id, &extents);
                    report.block_status_checked += 1;
                }
                OpKind::Flush => report.flushes += 1,
                OpKind::Write | OpKind::Trim | OpKind::Zero => {}
                OpKind::Snapshot | OpKind::SnapshotDelete | OpKind::SnapshotRead => {
                    unreachable!("a recorded history names no snapshot requests (checked at parse)")
                }
            }
        }
        model.resolve(id, op.outcome);
    }
    for op in &history.ops {
        if op.reply_ns.is_none() {
            report.unanswered += 1;
            model.resolve(op.id, Outcome::NoReply);
        }
        if op.kind.write_like() {
            report.writes += 1;
            if op.outcome == Outcome::Ok {
                report.writes_acked += 1;
            } else {
                *report.writes_failed.entry(op.outcome_name.clone()).or_default() += 1;
            }
        }
    }
    report.acked_writes_lost = lost_in_final_read_back(history, data, &model);
    // No host element restarts in a recorded history, so no loss is ever allowed.
    model.settle(false);
    report.reads_checked = model.reads_checked;
    report.violations = std::mem::take(&mut model.violations);
    report
}

/// Acknowledged writes that the final read-back does not find: per sector, the newest write
/// acknowledged before the final read was sent, when the sector holds something older (a
/// sector holding a newer, unacknowledged write does not count).
fn lost_in_final_read_back(history: &History, data: &[u8], model: &Model) -> u64 {
    let mut lost = std::collections::BTreeSet::new();
    for read in history.ops.iter().filter(|op| op.final_read) {
        let Some(at) = read.data_at else { continue };
        let submit_step = model.op(read.id).submit_step;
        let first = read.offset_bytes / SECTOR_BYTES;
        let count = read.length_bytes / SECTOR_BYTES;
        // Per sector of the read, the newest (by submission) write-like acknowledged before it.
        let mut newest: Vec<Option<(u64, OpKind)>> = vec![None; count as usize];
        // And the newest trim or write-zeroes that may have reached it (not refused).
        let mut zeroed: Vec<u64> = vec![0; count as usize];
        for (id, op) in model.ops() {
            if !op.kind.write_like() || op.volume != read.volume || op.submit_step >= submit_step {
                continue;
            }
            let acked = op.outcome == Outcome::Ok && op.reply_step < submit_step;
            let zeroes = op.kind != OpKind::Write && op.outcome != Outcome::ReadOnly;
            let start = op.first_sector.max(first);
            let end = (op.first_sector + op.sectors).min(first + count);
            for sector in start..end {
                let i = (sector - first) as usize;
                if acked {
                    newest[i] = Some((id, op.kind));
                }
                if zeroes {
                    zeroed[i] = id;
                }
            }
        }
        for (i, newest) in newest.into_iter().enumerate() {
            let Some((newest, kind)) = newest else {
                continue;
            };
            let sector = first + i as u64;
            let start = at as usize + i * SECTOR_BYTES as usize;
            let value = decode_sector(&data[start..start + SECTOR_BYTES as usize], read.volume as u32, sector);
            let found = match value {
                SectorValue::Data(id) => id >= newest,
                SectorValue::Zero => kind != OpKind::Write || zeroed[i] > newest,
                SectorValue::Garbage(_) => true,
            };
            if !found {
                lost.insert(newest);
            }
        }
    }
    lost.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sector::fill_sector;

    /// A history built line by line, with its data file.
    struct Recorder {
        lines: Vec<String>,
        data: Vec<u8>,
    }

    impl Recorder {
        fn new(volume_bytes: u64) -> Recorder {
            Recorder {
                lines: vec![format!("starfish-history 1 volumes=1 volume_bytes={volume_bytes}")],
                data: Vec::new(),
            }
        }

        fn op(&mut self, line: &str) {
            self.lines.push(line.to_string());
        }

        /// A read (times in µs for readability) that returned the given sectors: `Some(id)` is
        /// write `id`'s sector, `None` zeroes.
        fn read(&mut self, id: u64, first: u64, sectors: &[Option<u64>], t: (u64, u64), extra: &str) {
            let at = self.data.len();
            for (i, s) in sectors.iter().enumerate() {
                let mut buf = vec![0u8; 512];
                if let Some(w) = s {
                    fill_sector(&mut buf, *w, 0, first + i as u64);
                }
                self.data.extend_from_slice(&buf);
            }
            self.lines.push(format!(
                "{id} 1 read 0 {} {} {} {} ok data={at}{extra}",
                first * 512,
                sectors.len() * 512,
                t.0 * 1000,
                t.1 * 1000
            ));
        }

        fn check(&self) -> HistoryReport {
            let history = History::parse(&self.lines.join("\n")).expect("a valid history");
            check(&history, &self.data).expect("consistent")
        }
    }

    /// Two writes of sectors 0..4 (#1, then #2 over sectors 2..4), acknowledged at 20 and 40 µs.
    fn two_writes() -> Recorder {
        let mut r = Recorder::new(8 * 512);
        r.op("1 1 write 0 0 2048 10000 20000 ok");
        r.op("2 2 write 0 1024 1024 30000 40000 ok");
        r
    }

    #[test]
    fn a_correct_history_passes() {
        let mut r = two_writes();
        // Sent after both acknowledgements: sees both.
        r.read(3, 0, &[Some(1), Some(1), Some(2), Some(2), None], (50, 60), "");
        r.op("4 1 flush 0 0 0 70000 80000 ok");
        r.op("5 1 status 0 0 4096 90000 95000 ok extents=2048:a,2048:h");
        r.read(6, 0, &[Some(1), Some(1), Some(2), Some(2), None, None, None, None], (100, 110), " final");
        let report = r.check();
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        assert_eq!(report.reads_checked, 2);
        assert_eq!(report.sectors_checked, 13);
        assert_eq!(report.final_sectors_checked, 8);
        assert_eq!(report.writes_acked, 2);
        assert_eq!(report.flushes, 1);
        assert_eq!(report.block_status_checked, 1);
        assert_eq!(report.acked_writes_lost, 0);
    }

    #[test]
    fn concurrent_reads_may_see_either() {
        let mut r = two_writes();
        // Sent at 35 µs, while #2 (answered at 40) was in flight: old or new data both fine.
        r.read(3, 2, &[Some(1), Some(1)], (35, 45), "");
        r.read(4, 2, &[Some(2), Some(2)], (36, 46), "");
        let report = r.check();
        assert!(report.violations.is_empty(), "{:?}", report.violations);
    }

    #[test]
    fn a_lost_acknowledged_write_is_caught() {
        let mut r = two_writes();
        // The final read-back finds write #1's data where #2 was acknowledged.
        r.read(3, 0, &[Some(1), Some(1), Some(1), Some(1)], (100, 110), " final");
        let report = r.check();
        assert_eq!(report.acked_writes_lost, 1);
        assert_eq!(report.violations.len(), 2, "{:?}", report.violations);
        assert!(report.violations[0].contains("stale read #3"), "{:?}", report.violations);
        assert!(report.violations[0].contains("write #2"), "{:?}", report.violations);
    }

    #[test]
    fn a_stale_read_is_caught() {
        let mut r = two_writes();
        // Sent at 45 µs, after #2's acknowledgement at 40: must not return zeroes or #1.
        r.read(3, 0, &[Some(1), None], (45, 50), "");
        r.read(4, 2, &[Some(1), Some(2)], (45, 50), "");
        let report = r.check();
        let v = &report.violations;
        assert!(v.iter().any(|m| m.starts_with("stale read #3") && m.contains("zeroes")), "{v:?}");
        assert!(v.iter().any(|m| m.starts_with("stale read #4") && m.contains("data of #1")), "{v:?}");
    }

    #[test]
    fn other_breaches_are_caught() {
        let mut r = two_writes();
        // A write that was refused (EPERM) is never applied.
        r.op("3 1 write 0 3072 512 44000 45000 EPERM");
        r.read(4, 3072 / 512, &[Some(3)], (46, 47), "");
        // Torn: #2 visible in sector 2, not in sector 3.
        r.read(5, 2, &[Some(2), Some(1)], (48, 49), "");
        // A hole where #1 must be.
        r.op("6 1 status 0 0 1024 50000 51000 ok extents=1024:h");
        // Data of a write sent after the read was answered.
        r.read(7, 4, &[Some(8)], (52, 53), "");
        r.op("8 1 write 0 2048 512 54000 55000 ok");
        let mut report = r.check();
        report.violations.sort();
        let v = &report.violations;
        assert_eq!(v.len(), 5, "{v:?}");
        assert!(v[0].starts_with("hole reported over data #6"), "{v:?}");
        assert!(v[1].contains("the data of request #3, which never wrote it"), "{v:?}");
        assert!(v[2].contains("read #7 returned at volume 0 sector 4 the data of request #8"), "{v:?}");
        assert!(v[3].starts_with("stale read #5"), "{v:?}");
        assert!(v[4].starts_with("torn read #5"), "{v:?}");
    }

    #[test]
    fn flush_reply_order_is_not_judged() {
        // Over NBD a flush need not wait for a write still in flight.
        let mut r = two_writes();
        r.op("3 2 write 0 2048 1024 41000 60000 ok");
        r.op("4 2 flush 0 0 0 42000 43000 ok");
        let report = r.check();
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        assert_eq!(report.flushes, 1);
    }

    #[test]
    fn garbage_is_caught() {
        let mut r = two_writes();
        r.read(3, 0, &[Some(1)], (50, 60), "");
        r.data[100] ^= 1;
        let report = r.check();
        assert!(report.violations[0].contains("garbage"), "{:?}", report.violations);
    }

    #[test]
    fn malformed_histories_are_refused() {
        let check = |text: &str| History::parse(text).map(|_| ()).map_err(|e| e.to_string());
        let header = "starfish-history 1 volumes=1 volume_bytes=4096\n";
        assert!(check("").unwrap_err().contains("empty"));
        assert!(check("starfish-history 2 volumes=1 volume_bytes=4096").unwrap_err().contains("version"));
        for (line, expect) in [
            ("1 1 write 0 0 100 1 2 ok", "multiples of 512"),
            ("1 1 write 0 0 8192 1 2 ok", "beyond the end"),
            ("1 1 read 0 0 512 1 2 ok", "data="),
            ("1 1 write 0 0 512 5 2 ok", "answered before"),
            ("1 1 write 0 0 512 1 - ok", "outcome none"),
            ("2 1 write 0 0 512 1 2 ok", "ids must be"),
            ("1 1 frob 0 0 512 1 2 ok", "unknown kind"),
        ] {
            let err = check(&format!("{header}{line}")).unwrap_err();
            assert!(err.contains(expect), "{line}: {err}");
        }
        let err = check(&format!("{header}1 1 write 0 0 512 5 6 ok\n2 1 write 0 0 512 4 6 ok")).unwrap_err();
        assert!(err.contains("submission order"), "{err}");
    }

    #[test]
    fn data_beyond_the_file_is_refused() {
        let history = History::parse("starfish-history 1 volumes=1 volume_bytes=4096\n1 1 read 0 0 512 1 2 ok data=0")
            .expect("valid");
        assert!(check(&history, &[0u8; 100]).is_err());
    }

    /// The Python recorder writes the same bytes (tests/test_fault_history.py checks the same
    /// digest): sector formats cannot drift apart unnoticed.
    #[test]
    fn sector_golden_value() {
        let mut buf = vec![0u8; 512];
        fill_sector(&mut buf, 7, 0, 3);
        // Not the crc32c of all 512 bytes: a buffer followed by its own crc32c always has the
        // same one (the CRC's residue), whatever the buffer holds.
        let crc = crc32c::crc32c(&buf[..508]);
        assert_eq!(crc, GOLDEN_SECTOR_CRC32C, "{crc:#010x}");
        assert_eq!(buf[508..], GOLDEN_SECTOR_CRC32C.to_le_bytes(), "the sector ends with its checksum");
    }

    /// crc32c of the first 508 bytes of `fill_sector(id 7, volume 0, sector 3)`.
    const GOLDEN_SECTOR_CRC32C: u32 = 0x9f3f_a95d;
}
