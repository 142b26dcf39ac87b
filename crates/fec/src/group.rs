//! Groups of data packets with their repair packets: the sender's [`Encoder`] and the
//! receiver's [`Decoder`].
//!
//! A group holds `k ≤ r` data packets (indexes `0..k`), sent at once as they come, then `c`
//! repair packets computed over their *shards*: each data payload framed as `[u32 length]
//! [payload]` and zero-padded to the group's shard size (the largest frame, which every repair
//! packet's length gives). A group closes when it has `r` data
//! packets, or earlier when the sender has nothing more to send (`Encoder::close`): a write
//! never waits for later writes to fill its group. Repair packets carry `k`; so does a data
//! packet sent again.
//!
//! The decoder delivers payloads in (group, index) order. It rebuilds a group's missing data
//! once `k` of its `k + c` packets are there, and names (`Decoder::nacks`) the groups it
//! cannot finish — a later group has started, so no more of it is coming — with what it has,
//! for the encoder to send the rest again (`Encoder::resend`).

use std::collections::{BTreeMap, VecDeque};

use bytes::{BufMut, Bytes, BytesMut};

use crate::code::ErasureCode;

/// Largest payload of one packet (a UDP datagram's payload less our header).
pub const PAYLOAD_BYTES_MAX: usize = 65_000;
/// Bytes of a packet's header.
pub const HEADER_BYTES: usize = 1 + 8 + 1 + 1 + 1;
/// Groups the encoder keeps for resending.
pub const RESEND_GROUPS_MAX: usize = 4096;
/// Groups the decoder holds while they wait for missing packets: more means the link is gone
/// or the sender could not resend, and the session must start over.
pub const PENDING_GROUPS_MAX: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FecError {
    /// A packet that is not one of ours (the reason says how).
    Malformed(&'static str),
    /// The receiver holds too many unfinished groups, or was asked for one it no longer has.
    Overrun(String),
    /// The erasure code failed (a bug, or shards that do not match).
    Code(String),
}

impl std::fmt::Display for FecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FecError::Malformed(why) => write!(f, "malformed FEC packet: {why}"),
            FecError::Overrun(why) => write!(f, "FEC link overrun: {why}"),
            FecError::Code(why) => write!(f, "erasure code: {why}"),
        }
    }
}

impl std::error::Error for FecError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketKind {
    Data,
    Repair,
    /// No payload: it only says how many data packets its group has (`originals`). Sent when
    /// a group closes without repair packets (c = 0) and after every resend, so a receiver
    /// that lost every packet carrying the count still completes the group.
    End,
}

/// One datagram.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub kind: PacketKind,
    pub group: u64,
    /// Data: `0..k`; repair: `0..c`.
    pub index: u8,
    /// `k`, the group's data packets: 0 in a data packet sent before its group closed.
    pub originals: u8,
    /// `c`, the group's repair packets.
    pub repairs: u8,
    pub payload: Bytes,
}

impl Packet {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_BYTES + self.payload.len());
        out.put_u8(match self.kind {
            PacketKind::Data => 1,
            PacketKind::Repair => 2,
            PacketKind::End => 3,
        });
        out.put_u64_le(self.group);
        out.put_u8(self.index);
        out.put_u8(self.originals);
        out.put_u8(self.repairs);
        out.put_slice(&self.payload);
        out.freeze()
    }

    pub fn decode(datagram: Bytes) -> Result<Packet, FecError> {
        if datagram.len() < HEADER_BYTES {
            return Err(FecError::Malformed("shorter than a header"));
        }
        let kind = match datagram[0] {
            1 => PacketKind::Data,
            2 => PacketKind::Repair,
            3 => PacketKind::End,
            _ => return Err(FecError::Malformed("unknown kind")),
        };
        let group = u64::from_le_bytes(datagram[1..9].try_into().expect("8 bytes"));
        let (index, originals, repairs) = (datagram[9], datagram[10], datagram[11]);
        let payload = datagram.slice(HEADER_BYTES..);
        if payload.len() > PAYLOAD_BYTES_MAX + 4 + 1 {
            return Err(FecError::Malformed("payload too long"));
        }
        let packet = Packet { kind, group, index, originals, repairs, payload };
        match kind {
            PacketKind::Repair if originals == 0 || index >= repairs || packet.payload.len() < 4 => {
                Err(FecError::Malformed("repair packet with no data count, a bad index or no shard"))
            }
            PacketKind::Data if originals != 0 && index >= originals => Err(FecError::Malformed("data index past k")),
            PacketKind::End if originals == 0 || !packet.payload.is_empty() => {
                Err(FecError::Malformed("end packet without a data count, or with a payload"))
            }
            _ => Ok(packet),
        }
    }
}

/// A data payload as a coding shard: `[u32 length][payload]`, zero-padded to `shard_bytes`.
fn shard(payload: &[u8], shard_bytes: usize) -> Vec<u8> {
    let mut s = Vec::with_capacity(shard_bytes);
    s.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    s.extend_from_slice(payload);
    s.resize(shard_bytes, 0);
    s
}

fn shard_bytes_for(longest_payload: usize) -> usize {
    4 + longest_payload
}

/// The sender's side.
pub struct Encoder<C: ErasureCode> {
    code: C,
    r: u8,
    c: u8,
    group: u64,
    open: Vec<Bytes>,
    /// Closed groups kept for resending: (group, payloads).
    sent: VecDeque<(u64, Vec<Bytes>)>,
}

impl<C: ErasureCode> Encoder<C> {
    /// `r` data packets and `c` repair packets per group (1 ≤ r, r + c ≤ 255).
    pub fn new(code: C, r: u8, c: u8) -> Encoder<C> {
        assert!(r >= 1 && r as usize + c as usize <= 255, "1 ≤ r and r + c ≤ 255");
        Encoder { code, r, c, group: 0, open: Vec::new(), sent: VecDeque::new() }
    }

    /// A payload to send: its data packet now, and the group's repair packets if it fills it.
    pub fn push(&mut self, payload: Bytes) -> Result<Vec<Packet>, FecError> {
        if payload.len() > PAYLOAD_BYTES_MAX {
            return Err(FecError::Malformed("payload too long"));
        }
        let index = self.open.len() as u8;
        let mut out = vec![Packet {
            kind: PacketKind::Data,
            group: self.group,
            index,
            originals: 0,
            repairs: self.c,
            payload: payload.clone(),
        }];
        self.open.push(payload);
        if self.open.len() == self.r as usize {
            out.extend(self.close()?);
        }
        Ok(out)
    }

    /// Close the open group (if it has any data): its repair packets. The caller closes when
    /// it has nothing more to send right now, so that no write waits for others.
    pub fn close(&mut self) -> Result<Vec<Packet>, FecError> {
        if self.open.is_empty() {
            return Ok(Vec::new());
        }
        let payloads = std::mem::take(&mut self.open);
        let k = payloads.len() as u8;
        let shard_bytes = shard_bytes_for(payloads.iter().map(Bytes::len).max().unwrap_or(0));
        let shards: Vec<Vec<u8>> = payloads.iter().map(|p| shard(p, shard_bytes)).collect();
        let refs: Vec<&[u8]> = shards.iter().map(Vec::as_slice).collect();
        let repairs =
            if self.c == 0 { Vec::new() } else { self.code.encode(&refs, self.c as usize).map_err(FecError::Code)? };
        let group = self.group;
        let mut out: Vec<Packet> = repairs
            .into_iter()
            .enumerate()
            .map(|(i, payload)| Packet {
                kind: PacketKind::Repair,
                group,
                index: i as u8,
                originals: k,
                repairs: self.c,
                payload: Bytes::from(payload),
            })
            .collect();
        if self.c == 0 {
            out.push(self.end_packet(group, k));
        }
        if self.sent.len() == RESEND_GROUPS_MAX {
            self.sent.pop_front();
        }
        self.sent.push_back((group, payloads));
        self.group += 1;
        Ok(out)
    }

    /// Data packets of a closed `group` that the receiver lacks (`have`: bit i set if it has
    /// data packet i), each with the group's `k`.
    pub fn resend(&self, group: u64, have: u64) -> Result<Vec<Packet>, FecError> {
        let Some((_, payloads)) = self.sent.iter().find(|(g, _)| *g == group) else {
            return Err(FecError::Overrun(format!("group {group} is no longer kept for resending")));
        };
        let k = payloads.len() as u8;
        let mut out: Vec<Packet> = payloads
            .iter()
            .enumerate()
            .filter(|(i, _)| have & (1 << i) == 0)
            .map(|(i, p)| Packet {
                kind: PacketKind::Data,
                group,
                index: i as u8,
                originals: k,
                repairs: self.c,
                payload: p.clone(),
            })
            .collect();
        out.push(self.end_packet(group, k));
        Ok(out)
    }

    fn end_packet(&self, group: u64, k: u8) -> Packet {
        Packet { kind: PacketKind::End, group, index: 0, originals: k, repairs: self.c, payload: Bytes::new() }
    }

    /// The receiver has every group before `next_group`: they need not be kept for resending.
    pub fn acknowledge(&mut self, next_group: u64) {
        while self.sent.front().is_some_and(|(g, _)| *g < next_group) {
            self.sent.pop_front();
        }
    }

    /// The number the next group will have.
    pub fn next_group(&self) -> u64 {
        self.group
    }

    /// Payloads pushed into the group that is still open.
    pub fn open_payloads(&self) -> usize {
        self.open.len()
    }
}

#[derive(Debug, Default)]
struct PendingGroup {
    /// `k`, once a repair packet or a resent data packet said it.
    originals: Option<u8>,
    repairs: u8,
    data: BTreeMap<u8, Bytes>,
    repair: BTreeMap<u8, Bytes>,
    /// When it was last named in a NACK (µs of the caller's clock).
    nacked_at: Option<u64>,
}

/// Counters of what the decoder did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecoderStats {
    pub delivered: u64,
    pub rebuilt: u64,
    pub duplicates: u64,
}

/// The receiver's side.
pub struct Decoder<C: ErasureCode> {
    code: C,
    /// The next payload to deliver: (group, index).
    next: (u64, u8),
    groups: BTreeMap<u64, PendingGroup>,
    newest_group: u64,
    pub stats: DecoderStats,
}

impl<C: ErasureCode> Decoder<C> {
    pub fn new(code: C) -> Decoder<C> {
        Decoder { code, next: (0, 0), groups: BTreeMap::new(), newest_group: 0, stats: DecoderStats::default() }
    }

    /// A datagram arrived: the payloads it lets the decoder deliver, in order.
    pub fn receive(&mut self, packet: Packet) -> Result<Vec<Bytes>, FecError> {
        if packet.group < self.next.0 {
            self.stats.duplicates += 1;
            return Ok(Vec::new());
        }
        if packet.group >= self.next.0 + PENDING_GROUPS_MAX as u64 {
            return Err(FecError::Overrun(format!(
                "group {} arrived while group {} is still incomplete",
                packet.group, self.next.0
            )));
        }
        self.newest_group = self.newest_group.max(packet.group);
        let g = self.groups.entry(packet.group).or_default();
        if packet.originals != 0 {
            match g.originals {
                Some(k) if k != packet.originals => return Err(FecError::Malformed("two data counts for one group")),
                _ => g.originals = Some(packet.originals),
            }
        }
        g.repairs = packet.repairs;
        let fresh = match packet.kind {
            PacketKind::Data => g.data.insert(packet.index, packet.payload).is_none(),
            PacketKind::Repair => g.repair.insert(packet.index, packet.payload).is_none(),
            PacketKind::End => true,
        };
        if !fresh {
            self.stats.duplicates += 1;
        }
        self.rebuild(packet.group)?;
        Ok(self.deliver())
    }

    /// Rebuild the missing data of `group` if enough of its packets are here.
    fn rebuild(&mut self, group: u64) -> Result<(), FecError> {
        let g = self.groups.get_mut(&group).expect("present");
        let (Some(k), Some(first_repair)) = (g.originals, g.repair.values().next()) else { return Ok(()) };
        let missing = (0..k).filter(|i| !g.data.contains_key(i)).count();
        if missing == 0 || g.data.len() + g.repair.len() < k as usize {
            return Ok(());
        }
        let shard_bytes = first_repair.len();
        let mut originals = Vec::new();
        for (&i, payload) in &g.data {
            if i >= k || 4 + payload.len() > shard_bytes {
                return Err(FecError::Malformed("data packet that does not fit its group"));
            }
            originals.push((i as usize, shard(payload, shard_bytes)));
        }
        if g.repair.values().any(|r| r.len() != shard_bytes) {
            return Err(FecError::Malformed("repair packets of different lengths"));
        }
        let o: Vec<(usize, &[u8])> = originals.iter().map(|(i, s)| (*i, s.as_slice())).collect();
        let r: Vec<(usize, &[u8])> = g.repair.iter().map(|(i, s)| (*i as usize, s.as_ref())).collect();
        let rebuilt = self.code.reconstruct(k as usize, g.repairs as usize, &o, &r).map_err(FecError::Code)?;
        for (i, s) in rebuilt {
            if i >= k as usize {
                continue;
            }
            let len = u32::from_le_bytes(s[..4].try_into().expect("4 bytes")) as usize;
            if 4 + len > s.len() {
                return Err(FecError::Malformed("rebuilt shard with a bad length"));
            }
            g.data.insert(i as u8, Bytes::copy_from_slice(&s[4..4 + len]));
            self.stats.rebuilt += 1;
        }
        Ok(())
    }

    fn deliver(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        loop {
            let (group, index) = self.next;
            let Some(g) = self.groups.get_mut(&group) else { break };
            // Delivered payloads stay until the group is done: they are shards a rebuild of
            // the rest needs.
            if let Some(payload) = g.data.get(&index) {
                out.push(payload.clone());
                self.stats.delivered += 1;
                self.next.1 += 1;
            }
            let done = g.originals.is_some_and(|k| self.next.1 >= k);
            if done {
                self.groups.remove(&group);
                self.next = (group + 1, 0);
            } else if !g.data.contains_key(&self.next.1) {
                break;
            }
        }
        out
    }

    /// Groups it cannot finish by itself, with a bitmap of the data packets it has, each named
    /// at most once per `retry_us`: a group before the newest one seen (no more of it is
    /// coming) that still lacks data and has fewer than `k` packets, or whose `k` is unknown.
    pub fn nacks(&mut self, now_us: u64, retry_us: u64) -> Vec<(u64, u64)> {
        let newest = self.newest_group;
        let mut out = Vec::new();
        for (&group, g) in self.groups.iter_mut().filter(|(&group, _)| group < newest) {
            let complete = g.originals.is_some_and(|k| (0..k).all(|i| g.data.contains_key(&i)));
            if complete || g.nacked_at.is_some_and(|at| now_us < at + retry_us) {
                continue;
            }
            g.nacked_at = Some(now_us);
            let have = g.data.keys().fold(0u64, |bits, &i| bits | (1 << i));
            out.push((group, have));
        }
        // The group being delivered may also wait on its own missing packets.
        if let Some(g) = self.groups.get_mut(&self.next.0) {
            if self.next.0 < newest && !out.iter().any(|(grp, _)| *grp == self.next.0) && g.nacked_at.is_none() {
                g.nacked_at = Some(now_us);
                out.push((self.next.0, g.data.keys().fold(0u64, |bits, &i| bits | (1 << i))));
            }
        }
        out
    }

    /// Groups held, waiting for packets.
    /// Every group before this one has been delivered.
    pub fn next_group(&self) -> u64 {
        self.next.0
    }

    pub fn pending_groups(&self) -> usize {
        self.groups.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GaloisCode;

    fn payloads(n: usize) -> Vec<Bytes> {
        (0..n).map(|i| Bytes::from(vec![i as u8; 100 + (i * 37) % 900])).collect()
    }

    /// Send `items` through an encoder (closing after each `burst`), dropping the packets
    /// `drop` says, and deliver what arrives (after NACKs and resends, rounds of them).
    fn run(items: &[Bytes], burst: usize, drop: impl Fn(usize, &Packet) -> bool) -> (Vec<Bytes>, DecoderStats) {
        let mut enc = Encoder::new(GaloisCode::default(), 8, 3);
        let mut dec = Decoder::new(GaloisCode::default());
        let mut delivered = Vec::new();
        let mut n = 0;
        for chunk in items.chunks(burst) {
            let mut packets = Vec::new();
            for p in chunk {
                packets.extend(enc.push(p.clone()).expect("push"));
            }
            packets.extend(enc.close().expect("close"));
            for packet in packets {
                n += 1;
                if !drop(n, &packet) {
                    let wire = Packet::decode(packet.encode()).expect("our own packet");
                    delivered.extend(dec.receive(wire).expect("receive"));
                }
            }
        }
        // A final empty group marks the end, as the next write would.
        for round in 0..4u64 {
            for (group, have) in dec.nacks(round * 1000, 500) {
                for packet in enc.resend(group, have).expect("kept") {
                    delivered.extend(dec.receive(packet).expect("receive"));
                }
            }
            let probe = enc.push(Bytes::from_static(b"probe")).expect("push");
            for packet in probe.into_iter().chain(enc.close().expect("close")) {
                delivered.extend(dec.receive(packet).expect("receive"));
            }
        }
        delivered.retain(|p| p.as_ref() != b"probe");
        (delivered, dec.stats)
    }

    #[test]
    fn without_loss_everything_arrives_in_order() {
        let items = payloads(100);
        let (got, stats) = run(&items, 8, |_, _| false);
        assert_eq!(got, items);
        assert_eq!(stats.rebuilt, 0);
    }

    #[test]
    fn up_to_c_losses_per_group_are_rebuilt_without_a_resend() {
        let items = payloads(64);
        // Drop the data packets 1, 4 and 6 of every group of 8 (3 of its 11 packets).
        let (got, stats) =
            run(&items, 8, |_, p| p.kind == PacketKind::Data && p.originals == 0 && [1, 4, 6].contains(&p.index));
        assert_eq!(got, items);
        assert_eq!(stats.rebuilt, 3 * 8);
    }

    #[test]
    fn more_than_c_losses_are_named_and_sent_again() {
        let items = payloads(40);
        // Four data packets of each group lost, and its first repair packet: only resends help.
        let (got, stats) = run(&items, 8, |_, p| {
            (p.kind == PacketKind::Data && p.originals == 0 && p.index % 2 == 0)
                || (p.kind == PacketKind::Repair && p.index == 0)
        });
        assert_eq!(got, items);
        assert!(stats.rebuilt < 5 * 4, "resends, not repairs, brought most of it");
    }

    #[test]
    fn partial_groups_close_at_once_and_reordering_is_undone() {
        let items = payloads(13);
        let mut enc = Encoder::new(GaloisCode::default(), 8, 3);
        let mut packets = Vec::new();
        for p in &items[..3] {
            packets.extend(enc.push(p.clone()).expect("push"));
        }
        let repairs = enc.close().expect("close");
        assert_eq!((repairs.len(), repairs[0].originals), (3, 3), "a group of 3 closes with its repairs");
        packets.extend(repairs);
        for p in &items[3..] {
            packets.extend(enc.push(p.clone()).expect("push"));
        }
        packets.extend(enc.close().expect("close"));
        packets.reverse();
        let mut dec = Decoder::new(GaloisCode::default());
        let mut got = Vec::new();
        for p in packets {
            got.extend(dec.receive(p).expect("receive"));
        }
        assert_eq!(got, items);
    }

    #[test]
    fn hostile_packets_are_refused() {
        assert!(Packet::decode(Bytes::from_static(b"short")).is_err());
        let mut bad = Packet {
            kind: PacketKind::Repair,
            group: 0,
            index: 5,
            originals: 8,
            repairs: 3,
            payload: Bytes::from_static(b"ab"),
        };
        assert!(Packet::decode(bad.encode()).is_err(), "repair index past c");
        bad.index = 0;
        bad.originals = 0;
        assert!(Packet::decode(bad.encode()).is_err(), "repair without k");
        let mut dec = Decoder::new(GaloisCode::default());
        let far = Packet {
            kind: PacketKind::Data,
            group: 1 << 40,
            index: 0,
            originals: 0,
            repairs: 3,
            payload: Bytes::new(),
        };
        assert!(matches!(dec.receive(far), Err(FecError::Overrun(_))));
    }
}
