//! Scrub: the host element compares the replicas of a volume block by block, at one sequence
//! point, and repairs an element whose blocks differ from the others'.
//!
//! The volume is walked in chunks of [`SCRUB_CHUNK_BLOCKS_MAX`] blocks. For each chunk the host
//! element takes the newest sequence it assigned, `at`, and asks every in-sync element for the
//! chunk's block summaries once it has applied `at` (`Scrub`); each element reads the blocks,
//! checks each against the checksum it stored (a block that fails is an element fault and a
//! repair, as on a read), and answers (sequence that last changed the block, crc32c). A block
//! that some element changed after `at` is left to the next scrub; every other block reflects
//! the same records everywhere, so the replicas must agree. Where a minority differs from the
//! majority, each element of that minority is failed with [`Failure::ScrubMismatch`] and, when
//! it reconnects, repaired by a full recovery from an in-sync peer (which copies only the
//! blocks whose summaries differ). Without a majority nothing is repaired and the blocks are
//! reported undecided. Chunks are paced to the scrub's rate; a scrub waits while an element of
//! the cluster is recovering.

use std::collections::BTreeMap;

use proto::{BlockSummary, HostMessage, Sequence, VolumeId, BLOCK_BYTES, SCRUB_CHUNK_BLOCKS_MAX};

use super::{Action, ElementState, Event, HostCore};
use crate::failure::Failure;
use crate::{ElementId, ElementSet, Time};

/// While an element is recovering or the host element is not serving, a scrub looks again
/// this often.
const SCRUB_RECHECK_MS: u64 = 500;

/// Why a scrub runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScrubReason {
    /// `starfish scrub` (`POST /scrub`).
    Ordered,
    /// The background schedule (`--scrub-interval`).
    Scheduled,
    /// A read's data failed its checksums at the host element: the blocks it read.
    ReadChecksum,
}

impl ScrubReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ScrubReason::Ordered => "ordered",
            ScrubReason::Scheduled => "scheduled",
            ScrubReason::ReadChecksum => "read-checksum",
        }
    }
}

/// What a scrub found so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScrubFindings {
    /// Blocks every element that answered holds alike.
    pub blocks_compared: u64,
    /// Blocks written while the scrub ran (after its sequence point): left to the next one.
    pub blocks_changed: u64,
    /// Blocks where a minority differed from the majority: that minority is repaired.
    pub blocks_mismatched: u64,
    /// Blocks where the elements differ without a majority: reported, not repaired.
    pub blocks_undecided: u64,
    /// Chunks an element could not scrub (a block failing its own checksum: that element
    /// repairs itself), with the last reason.
    pub element_errors: u64,
    pub last_error: Option<String>,
    /// Elements ordered to repair, by name.
    pub repaired: Vec<String>,
}

/// A scrub's progress, for status and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScrubStatus {
    /// Numbers the scrubs of this host element, from 1.
    pub id: u64,
    pub running: bool,
    pub reason: ScrubReason,
    pub done_bytes: u64,
    pub total_bytes: u64,
    /// 0: unlimited.
    pub rate_bytes_per_s: u64,
    pub elapsed_ms: u64,
    pub findings: ScrubFindings,
}

#[derive(Debug)]
pub(super) struct Scrub {
    id: u64,
    reason: ScrubReason,
    first_block: u64,
    next_block: u64,
    end_block: u64,
    rate_bytes_per_s: u64,
    started: Time,
    finished: Option<Time>,
    not_before: Time,
    request: Option<ScrubRequest>,
    findings: ScrubFindings,
}

#[derive(Debug)]
struct ScrubRequest {
    request_id: u64,
    first_block: u64,
    count: u32,
    /// The sequence point: every element answers once it has applied it.
    at: Sequence,
    sent: Time,
    awaiting: ElementSet,
    replies: Vec<(ElementId, Vec<BlockSummary>)>,
}

/// Finished scrubs kept per volume for status (a `starfish scrub` finds its report there even
/// if a later scrub finished before it looked).
const SCRUBS_KEPT: usize = 4;

/// Per volume: the running scrub, the last finished ones, ranges waiting, the next scheduled.
#[derive(Debug, Default)]
pub(super) struct VolumeScrubs {
    running: Option<Scrub>,
    /// Oldest first, at most [`SCRUBS_KEPT`].
    finished: std::collections::VecDeque<Scrub>,
    /// Block ranges to scrub after the running one (reads that failed their checksums).
    pending: Vec<(u64, u64)>,
    next_scheduled: Option<Time>,
}

impl Scrub {
    fn new(id: u64, reason: ScrubReason, first_block: u64, end_block: u64, rate_bytes_per_s: u64, now: Time) -> Scrub {
        Scrub {
            id,
            reason,
            first_block,
            next_block: first_block,
            end_block,
            rate_bytes_per_s,
            started: now,
            finished: None,
            not_before: now,
            request: None,
            findings: ScrubFindings::default(),
        }
    }

    fn status(&self, now: Time) -> ScrubStatus {
        let end = self.finished.unwrap_or(now);
        ScrubStatus {
            id: self.id,
            running: self.finished.is_none(),
            reason: self.reason,
            done_bytes: (self.next_block - self.first_block) * BLOCK_BYTES,
            total_bytes: (self.end_block - self.first_block) * BLOCK_BYTES,
            rate_bytes_per_s: self.rate_bytes_per_s,
            elapsed_ms: end.micros_since(self.started) / 1000,
            findings: self.findings.clone(),
        }
    }
}

impl HostCore {
    /// Start scrubbing all of `volume` at most `rate_bytes_per_s` (0: unlimited); its id. Refused
    /// (with the reason) while the host element does not serve or a scrub of the volume runs.
    pub fn start_scrub(&mut self, now: Time, volume: VolumeId, rate_bytes_per_s: u64) -> Result<u64, String> {
        let vi = volume.0 as usize;
        let Some(v) = self.volumes.get(vi).filter(|v| v.removed.is_none()) else {
            return Err(format!("no volume {volume}"));
        };
        if let Some(running) = &v.scrubs.running {
            let s = running.status(now);
            return Err(format!(
                "a scrub of volume {} is running ({}, {} of {} bytes done)",
                v.spec.name,
                s.reason.as_str(),
                s.done_bytes,
                s.total_bytes
            ));
        }
        if let Some(reason) = self.scrub_refusal() {
            return Err(reason);
        }
        let blocks = v.spec.size_bytes / BLOCK_BYTES;
        let id = self.next_scrub_id();
        self.volumes[vi].scrubs.running = Some(Scrub::new(id, ScrubReason::Ordered, 0, blocks, rate_bytes_per_s, now));
        self.pump_scrub(now, vi);
        Ok(id)
    }

    fn next_scrub_id(&mut self) -> u64 {
        self.scrubs_started += 1;
        self.scrubs_started
    }

    /// Why no scrub can start now, if none can.
    fn scrub_refusal(&self) -> Option<String> {
        if let Some(seen) = self.superseded {
            return Some(format!("this host element was superseded (epoch {seen} is newer): it serves nothing"));
        }
        if !self.ready {
            return Some("the host element is not serving yet".into());
        }
        None
    }

    /// Scrub blocks `[first, end)` of volume `vi` (a read's blocks whose data came back
    /// damaged), now or after the running scrub.
    pub(super) fn scrub_range(&mut self, now: Time, vi: usize, first: u64, end: u64) {
        if self.volumes[vi].scrubs.running.is_some() {
            self.volumes[vi].scrubs.pending.push((first, end));
        } else {
            let id = self.next_scrub_id();
            self.volumes[vi].scrubs.running = Some(Scrub::new(id, ScrubReason::ReadChecksum, first, end, 0, now));
        }
        self.pump_scrub(now, vi);
    }

    /// Start scheduled scrubs that are due and move every scrub on.
    pub(super) fn pump_scrubs(&mut self, now: Time) {
        for vi in 0..self.volumes.len() {
            let interval_ms = self.config.scrub_interval_ms;
            if interval_ms > 0 && self.scrub_refusal().is_none() && self.volumes[vi].removed.is_none() {
                let scrubs = &mut self.volumes[vi].scrubs;
                let due = *scrubs.next_scheduled.get_or_insert(now.plus_ms(interval_ms));
                if now >= due && scrubs.running.is_none() {
                    let blocks = self.volumes[vi].spec.size_bytes / BLOCK_BYTES;
                    let rate = self.config.scrub_rate_bytes_per_s;
                    let id = self.next_scrub_id();
                    let scrubs = &mut self.volumes[vi].scrubs;
                    scrubs.running = Some(Scrub::new(id, ScrubReason::Scheduled, 0, blocks, rate, now));
                    scrubs.next_scheduled = Some(now.plus_ms(interval_ms));
                }
            }
            self.pump_scrub(now, vi);
        }
    }

    /// When a scrub has something to do next (for `poll_timeout`).
    pub(super) fn scrub_timeout(&self) -> Option<Time> {
        let mut next: Option<Time> = None;
        for v in &self.volumes {
            // A schedule that came due while a scrub runs waits for its end (an answer wakes
            // the core then): a deadline in the past would wake it without pause.
            let t = match &v.scrubs.running {
                Some(s) => s.request.is_none().then_some(s.not_before),
                None => v.scrubs.next_scheduled.filter(|_| self.config.scrub_interval_ms > 0),
            };
            if let Some(t) = t {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        next
    }

    /// Send the running scrub's next chunk if it may go.
    fn pump_scrub(&mut self, now: Time, vi: usize) {
        let Some(scrub) = &self.volumes[vi].scrubs.running else { return };
        if scrub.request.is_some() || now < scrub.not_before {
            return;
        }
        let recovering = self.elements.iter().any(|e| matches!(e.state, ElementState::Recovering(_)));
        let participants: ElementSet = {
            let mut set = ElementSet::default();
            for (i, e) in self.elements.iter().enumerate() {
                if e.state == ElementState::InSync && e.welcomed && e.session {
                    set.insert(ElementId(i as u8));
                }
            }
            set
        };
        if recovering || participants.is_empty() || self.scrub_refusal().is_some() {
            let scrub = self.volumes[vi].scrubs.running.as_mut().expect("checked above");
            scrub.not_before = now.plus_ms(SCRUB_RECHECK_MS);
            return;
        }
        let at = self.volumes[vi].queue.last_sequence();
        let request_id = self.next_request_id;
        self.next_request_id += 1;
        let volume = VolumeId(vi as u32);
        let scrub = self.volumes[vi].scrubs.running.as_mut().expect("checked above");
        let count = (scrub.end_block - scrub.next_block).min(SCRUB_CHUNK_BLOCKS_MAX as u64) as u32;
        let first_block = scrub.next_block;
        scrub.request = Some(ScrubRequest {
            request_id,
            first_block,
            count,
            at,
            sent: now,
            awaiting: participants,
            replies: Vec::new(),
        });
        let message = HostMessage::Scrub { request_id, volume, first_block, count, min_applied: at };
        self.emit(Action::Send { to: participants, message });
    }

    pub(super) fn on_scrub_reply(
        &mut self,
        now: Time,
        element: ElementId,
        request_id: u64,
        result: Result<(Sequence, Vec<BlockSummary>), String>,
    ) {
        let found = self.volumes.iter().position(|v| {
            v.scrubs.running.as_ref().and_then(|s| s.request.as_ref()).is_some_and(|r| r.request_id == request_id)
        });
        let Some(vi) = found else {
            return; // The element failed since, or the scrub ended.
        };
        let scrub = self.volumes[vi].scrubs.running.as_mut().expect("found above");
        let request = scrub.request.as_mut().expect("found above");
        if !request.awaiting.contains(element) {
            return self.fail_element(
                now,
                element,
                Failure::Protocol("a scrub reply it was not asked for".into()),
                true,
            );
        }
        match result {
            Ok((applied, blocks)) if applied < request.at || blocks.len() != request.count as usize => {
                let why = format!(
                    "scrub reply of {} blocks at sequence {applied}; asked {} at {}",
                    blocks.len(),
                    request.count,
                    request.at
                );
                return self.fail_element(now, element, Failure::Protocol(why), true);
            }
            Ok((_, blocks)) => {
                request.awaiting.remove(element);
                request.replies.push((element, blocks));
            }
            Err(reason) => {
                request.awaiting.remove(element);
                let name = self.elements[element.0 as usize].name.clone();
                let scrub = self.volumes[vi].scrubs.running.as_mut().expect("found above");
                scrub.findings.element_errors += 1;
                scrub.findings.last_error = Some(format!("{name}: {reason}"));
            }
        }
        self.maybe_finish_scrub_chunk(now, vi);
    }

    /// An element failed: its answers are not waited for.
    pub(super) fn scrub_forget(&mut self, now: Time, element: ElementId) {
        for vi in 0..self.volumes.len() {
            let Some(request) = self.volumes[vi].scrubs.running.as_mut().and_then(|s| s.request.as_mut()) else {
                continue;
            };
            if request.awaiting.contains(element) {
                request.awaiting.remove(element);
                self.maybe_finish_scrub_chunk(now, vi);
            }
        }
    }

    fn maybe_finish_scrub_chunk(&mut self, now: Time, vi: usize) {
        let scrub = self.volumes[vi].scrubs.running.as_mut().expect("a scrub runs");
        if !scrub.request.as_ref().expect("a chunk is asked").awaiting.is_empty() {
            return;
        }
        let request = scrub.request.take().expect("checked above");
        let (differing, suspect) = compare_chunk(&request, &mut scrub.findings);
        scrub.next_block = request.first_block + request.count as u64;
        scrub.not_before = match (request.count as u64 * BLOCK_BYTES * 1_000_000).checked_div(scrub.rate_bytes_per_s) {
            Some(micros) => Time(request.sent.0 + micros),
            None => now, // Unlimited.
        };
        // The read cache may hold what a minority (or, without a majority, anyone) served.
        for block in suspect {
            self.cache.remove_range(VolumeId(vi as u32), block, block + 1);
        }
        let name = self.volumes[vi].spec.name.clone();
        let repair = self.config.scrub_repair;
        for (element, blocks) in differing.into_iter().filter(|_| repair) {
            let element_name = self.elements[element.0 as usize].name.clone();
            let scrub = self.volumes[vi].scrubs.running.as_mut().expect("a scrub runs");
            if !scrub.findings.repaired.contains(&element_name) {
                scrub.findings.repaired.push(element_name);
            }
            self.elements[element.0 as usize].scrub_repair[vi] = true;
            let failure =
                Failure::ScrubMismatch { volume: name.clone(), blocks: blocks.len() as u64, first_block: blocks[0] };
            self.fail_element(now, element, failure, true);
        }
        let scrub = self.volumes[vi].scrubs.running.as_mut().expect("a scrub runs");
        if scrub.next_block >= scrub.end_block {
            scrub.finished = Some(now);
            let next = (!self.volumes[vi].scrubs.pending.is_empty()).then(|| self.next_scrub_id());
            let scrubs = &mut self.volumes[vi].scrubs;
            let done = scrubs.running.take().expect("checked above");
            let status = done.status(now);
            if scrubs.finished.len() == SCRUBS_KEPT {
                scrubs.finished.pop_front();
            }
            scrubs.finished.push_back(done);
            if let Some(id) = next {
                let (first, end) = scrubs.pending.remove(0);
                scrubs.running = Some(Scrub::new(id, ScrubReason::ReadChecksum, first, end, 0, now));
            }
            self.emit(Action::Event(Event::ScrubDone { volume: VolumeId(vi as u32), status }));
        }
        self.pump_scrub(now, vi);
    }

    /// The scrubs of volume `vi` for status: the finished ones kept (oldest first), then the
    /// running one.
    pub(super) fn scrub_statuses(&self, now: Time, vi: usize) -> Vec<ScrubStatus> {
        let scrubs = &self.volumes[vi].scrubs;
        scrubs.finished.iter().chain(scrubs.running.as_ref()).map(|s| s.status(now)).collect()
    }
}

/// Compare one chunk's replies, count what was found, and return each element that holds
/// blocks differing from the majority, with those blocks, and every block where the replicas
/// differ.
fn compare_chunk(request: &ScrubRequest, findings: &mut ScrubFindings) -> (BTreeMap<ElementId, Vec<u64>>, Vec<u64>) {
    let mut differing: BTreeMap<ElementId, Vec<u64>> = BTreeMap::new();
    let mut suspect = Vec::new();
    if request.replies.is_empty() {
        return (differing, suspect);
    }
    for k in 0..request.count as usize {
        let block = request.first_block + k as u64;
        let summaries: Vec<(ElementId, &BlockSummary)> = request.replies.iter().map(|(e, b)| (*e, &b[k])).collect();
        if summaries.iter().any(|(_, s)| s.sequence > request.at) {
            findings.blocks_changed += 1;
            continue;
        }
        let mut counts: Vec<(u32, usize)> = Vec::new();
        for (_, s) in &summaries {
            match counts.iter_mut().find(|(crc, _)| *crc == s.crc) {
                Some((_, n)) => *n += 1,
                None => counts.push((s.crc, 1)),
            }
        }
        if counts.len() == 1 {
            findings.blocks_compared += 1;
            continue;
        }
        suspect.push(block);
        match counts.iter().find(|(_, n)| 2 * n > summaries.len()) {
            Some(&(majority, _)) => {
                findings.blocks_mismatched += 1;
                for (e, s) in &summaries {
                    if s.crc != majority {
                        differing.entry(*e).or_default().push(block);
                    }
                }
            }
            None => findings.blocks_undecided += 1,
        }
    }
    (differing, suspect)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(sequence: u64, crc: u32) -> BlockSummary {
        BlockSummary { sequence: Sequence(sequence), crc, allocated: true }
    }

    #[test]
    fn a_minority_that_differs_is_named_and_a_tie_is_undecided() {
        let (a, b, c) = (ElementId(0), ElementId(1), ElementId(2));
        let request = ScrubRequest {
            request_id: 1,
            first_block: 10,
            count: 4,
            at: Sequence(50),
            sent: Time(0),
            awaiting: ElementSet::default(),
            replies: vec![
                (a, vec![summary(3, 1), summary(4, 2), summary(60, 3), summary(5, 4)]),
                (b, vec![summary(3, 1), summary(4, 9), summary(49, 3), summary(5, 4)]),
                (c, vec![summary(3, 1), summary(4, 2), summary(49, 3), summary(5, 4)]),
            ],
        };
        let mut findings = ScrubFindings::default();
        let (differing, suspect) = compare_chunk(&request, &mut findings);
        assert_eq!(differing.into_iter().collect::<Vec<_>>(), vec![(b, vec![11])]);
        assert_eq!(suspect, vec![11]);
        assert_eq!((findings.blocks_compared, findings.blocks_mismatched, findings.blocks_changed), (2, 1, 1));

        let tie = ScrubRequest { replies: request.replies[..2].to_vec(), ..request };
        let mut findings = ScrubFindings::default();
        let (differing, suspect) = compare_chunk(&tie, &mut findings);
        assert!(differing.is_empty());
        assert_eq!(suspect, vec![11]);
        assert_eq!(findings.blocks_undecided, 1);
    }
}
